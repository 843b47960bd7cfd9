//! The HTTP API's oracle: what keel's router must do with the JSON body of every POST endpoint
//! (decisions, answers, freeze, unfreeze, cancel), sent over a real store with a run waiting at
//! its approval gate. Shared by keel-server's property tests (`tests/fuzz.rs`, over loopback
//! TCP) and the coverage-guided fuzz target `api` (`fuzz/`, through the same router in this
//! process, [`InProcess`]):
//! - the server never fails (no 5xx) and always answers an error with a JSON error that says
//!   something;
//! - a body is read exactly when it is a JSON object with only the endpoint's keys, each of its
//!   type, once ([`readable`], restated plainly); anything else is a 400 that shows what to send,
//!   and changes nothing;
//! - what is accepted is recorded as sent: one event of the endpoint's kind, with its reason;
//!   a freeze of a frozen run, or the lifting of a hold that is not there, records nothing.
//!
//! Each check panics with what it found, as a test's assertion does.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use serde_json::{Value, json};

use super::json::Ordered;
use crate::workspace::Workspace;

// ---- the endpoints -------------------------------------------------------------------------------

/// A POST endpoint that takes a JSON body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Decide,
    Answer,
    Freeze,
    Unfreeze,
    Cancel,
}

pub const ENDPOINTS: [Endpoint; 5] = [
    Endpoint::Decide,
    Endpoint::Answer,
    Endpoint::Freeze,
    Endpoint::Unfreeze,
    Endpoint::Cancel,
];

/// How a key's value may be written.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Slot {
    /// A string, or null for "not given".
    OptionalString,
    /// A string (the key may be left out, but not set to null).
    String,
}

impl Endpoint {
    /// Its name in the fuzz target's input (`decide`, `answer`, `freeze`, `unfreeze`, `cancel`).
    pub fn name(self) -> &'static str {
        match self {
            Endpoint::Decide => "decide",
            Endpoint::Answer => "answer",
            Endpoint::Freeze => "freeze",
            Endpoint::Unfreeze => "unfreeze",
            Endpoint::Cancel => "cancel",
        }
    }

    /// Its path for run `run` and request or question number `n` (as sent: any text).
    pub fn path(self, run: &str, n: &str) -> String {
        match self {
            Endpoint::Decide => format!("/api/runs/{run}/approvals/{n}"),
            Endpoint::Answer => format!("/api/runs/{run}/questions/{n}"),
            Endpoint::Freeze => format!("/api/runs/{run}/freeze"),
            Endpoint::Unfreeze => format!("/api/runs/{run}/unfreeze"),
            Endpoint::Cancel => format!("/api/runs/{run}/cancel"),
        }
    }

    fn keys(self) -> &'static [(&'static str, Slot)] {
        match self {
            Endpoint::Decide => &[
                ("decision", Slot::OptionalString),
                ("payload_hash", Slot::OptionalString),
                ("reason", Slot::String),
                ("by", Slot::OptionalString),
            ],
            Endpoint::Answer => &[
                ("answer", Slot::OptionalString),
                ("by", Slot::OptionalString),
            ],
            Endpoint::Freeze | Endpoint::Unfreeze | Endpoint::Cancel => &[
                ("reason", Slot::OptionalString),
                ("by", Slot::OptionalString),
            ],
        }
    }

    /// The event an accepted request records.
    pub fn event(self) -> &'static str {
        match self {
            Endpoint::Decide => "approval_decided",
            Endpoint::Answer => "question_answered",
            Endpoint::Freeze => "frozen",
            Endpoint::Unfreeze => "unfrozen",
            Endpoint::Cancel => "cancelled",
        }
    }

    /// A body the endpoint reads. A decision's is never for the pending request's payload, so
    /// the run stays at its gate.
    pub fn sample(self) -> Value {
        match self {
            Endpoint::Decide => json!({"decision": "approve", "payload_hash": "0".repeat(64),
                                       "reason": "looks right", "by": "fuzz"}),
            Endpoint::Answer => json!({"answer": "staging", "by": "fuzz"}),
            Endpoint::Freeze | Endpoint::Unfreeze | Endpoint::Cancel => {
                json!({"reason": "incident 42", "by": "fuzz"})
            }
        }
    }
}

/// The body as the endpoint must read it: `Some(entries)` for a JSON object with only the
/// endpoint's keys, each once and of its type; `None` for anything else.
pub fn readable(endpoint: Endpoint, body: &[u8]) -> Option<Vec<(String, Value)>> {
    let parsed = Ordered::parse(body)?;
    if parsed.repeats_a_key() {
        return None;
    }
    let Ordered::Object(entries) = parsed else {
        return None;
    };
    let mut out = Vec::new();
    for (k, v) in entries {
        let (_, slot) = endpoint.keys().iter().find(|(name, _)| *name == k)?;
        match (slot, v) {
            (_, Ordered::Scalar(v @ Value::String(_)))
            | (Slot::OptionalString, Ordered::Scalar(v @ Value::Null)) => out.push((k, v)),
            _ => return None,
        }
    }
    Some(out)
}

// ---- the check -------------------------------------------------------------------------------------

/// What the server answered: its status, the `error` of its JSON body if it has one, and the
/// body's text.
pub struct Answer {
    pub status: u16,
    pub error: Option<String>,
    pub text: String,
}

impl Answer {
    /// The answer of status `status` and body `body`.
    pub fn new(status: u16, body: &[u8]) -> Answer {
        let text = String::from_utf8_lossy(body).into_owned();
        let error = serde_json::from_str::<Value>(&text)
            .ok()
            .and_then(|v| v.get("error").and_then(Value::as_str).map(str::to_string));
        Answer {
            status,
            error,
            text,
        }
    }
}

/// Sends `body` to `endpoint` for the run of `workspace` with `send(path, body)`, and checks the
/// answer, and the run's events, against what the body is.
pub fn check(
    workspace: &Workspace,
    endpoint: Endpoint,
    body: &[u8],
    send: impl FnOnce(&str, &[u8]) -> Answer,
) {
    let path = endpoint.path(&workspace.run, "1");
    let before = workspace.count(endpoint.event());
    // A hold asked for again is answered with the run as it is, and records nothing: a request
    // delivered twice changes the run once.
    let already = match endpoint {
        Endpoint::Freeze => workspace.run().frozen,
        Endpoint::Unfreeze => !workspace.run().frozen,
        _ => false,
    };
    let answer = send(&path, body);
    let shown = || String::from_utf8_lossy(body).into_owned();
    assert!(
        answer.status < 500,
        "POST {path} failed with {}: {}\nbody: {}",
        answer.status,
        answer.text,
        shown()
    );
    if answer.status >= 400 {
        let error = answer.error.as_deref().unwrap_or_else(|| {
            panic!(
                "POST {path}: {} without a JSON error: {}",
                answer.status, answer.text
            )
        });
        assert!(!error.trim().is_empty(), "POST {path}: an empty error");
    }
    let body_refused = answer.status == 400
        && answer
            .error
            .as_deref()
            .is_some_and(|e| e.contains("send JSON like") && !e.contains("is required"));
    match readable(endpoint, body) {
        None => {
            assert!(
                body_refused,
                "POST {path}: a body that is not one was not refused as such ({} {}): {}",
                answer.status,
                answer.text,
                shown()
            );
            assert_eq!(
                workspace.count(endpoint.event()),
                before,
                "and it changed the run"
            );
        }
        Some(entries) => {
            assert!(
                !body_refused,
                "POST {path}: a readable body was refused: {}\nbody: {}",
                answer.text,
                shown()
            );
            let reason = entries
                .iter()
                .find(|(k, _)| k == "reason")
                .and_then(|(_, v)| v.as_str());
            if answer.status == 200 {
                let recorded = workspace.count(endpoint.event()) - before;
                assert_eq!(
                    recorded,
                    usize::from(!already),
                    "POST {path}: accepted ({}), with {recorded} `{}` events recorded (the run \
                     was already so: {already}): {}",
                    answer.text,
                    endpoint.event(),
                    shown()
                );
                assert!(
                    reason.is_some_and(|r| !r.trim().is_empty()),
                    "POST {path}: accepted without a reason: {}",
                    shown()
                );
            } else {
                assert_eq!(workspace.count(endpoint.event()), before);
            }
        }
    }
}

// ---- the router in this process ------------------------------------------------------------------

const TOKEN: &str = "fuzz-token-0123456789abcdef";

/// keel's router over a run stopped at its approval gate, called in this process (no socket):
/// what the fuzz target sends its requests to. Every request goes through the same router,
/// token check and handlers as `keel serve`'s.
pub struct InProcess {
    pub workspace: Workspace,
    router: axum::Router,
    runtime: tokio::runtime::Runtime,
}

impl InProcess {
    /// A new workspace with a gated run, and the router over its store.
    pub fn gated() -> InProcess {
        let workspace = Workspace::gated();
        let state = keel_server::AppState::new(&workspace.store, TOKEN).unwrap();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        InProcess {
            workspace,
            router: keel_server::router(state),
            runtime,
        }
    }

    /// POSTs `body` to `path` with the token, as JSON.
    pub fn post(&self, path: &str, body: &[u8]) -> Answer {
        use tower::ServiceExt as _;
        let request = axum::http::Request::builder()
            .method("POST")
            .uri(path)
            .header("Authorization", format!("Bearer {TOKEN}"))
            .header("Content-Type", "application/json")
            .body(axum::body::Body::from(body.to_vec()))
            .unwrap();
        self.runtime.block_on(async {
            let response = self.router.clone().oneshot(request).await.unwrap();
            let status = response.status().as_u16();
            let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
                .await
                .unwrap_or_else(|e| panic!("POST {path}: the answer's body broke off: {e}"));
            Answer::new(status, &bytes)
        })
    }

    /// The fuzz target's input: an endpoint's name, a newline, then the body (any bytes).
    /// Anything else is not a request and is skipped.
    pub fn check_input(&self, data: &[u8]) {
        let Some(newline) = data.iter().position(|&b| b == b'\n') else {
            return;
        };
        let (name, body) = (&data[..newline], &data[newline + 1..]);
        let Some(endpoint) = ENDPOINTS.into_iter().find(|e| e.name().as_bytes() == name) else {
            return;
        };
        check(&self.workspace, endpoint, body, |path, body| {
            self.post(path, body)
        });
    }
}
