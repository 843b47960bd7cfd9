//! Bad input to the HTTP API: the JSON bodies of every POST endpoint (decisions, answers,
//! freeze, unfreeze, cancel) and their path numbers, sent to the real router on loopback, over a
//! real store with a run waiting at its approval gate.
//!
//! Each property runs 256 cases by default; set `KEEL_FUZZ_CASES` (for example
//! `KEEL_FUZZ_CASES=100000`) to run more. Nothing is written to the source tree: a failure prints
//! the smallest input it found instead of saving it.
//!
//! What is asserted, for arbitrary bytes (invalid UTF-8 included) and for valid bodies mutated in
//! place (values swapped for wrong types, huge numbers, long strings and deep nesting; keys
//! removed, added and repeated; bytes flipped, cut and inserted):
//! - the server never fails (no 5xx, no dropped connection) and always answers with a JSON error
//!   that says something;
//! - a body is read exactly when it is a JSON object with only the endpoint's keys, each of its
//!   type, once (restated plainly below); anything else is a 400 that shows what to send;
//! - what is accepted is recorded as sent: one event of the endpoint's kind with its reason;
//! - a request number that is not a positive number is a 400 that says they count from 1.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::fmt;

use common::{Server, TOKEN, Workspace};
use keel_test_support::fuzz::{self, apply, apply_bytes};
use proptest::prelude::*;
use serde::de::{Deserialize, Deserializer, MapAccess, Visitor};
use serde_json::{Value, json};

// ---- the endpoints -------------------------------------------------------------------------------

#[derive(Debug, Clone, Copy)]
enum Endpoint {
    Decide,
    Answer,
    Freeze,
    Unfreeze,
    Cancel,
}

const ENDPOINTS: [Endpoint; 5] = [
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
    fn path(self, run: &str, n: &str) -> String {
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
    fn event(self) -> &'static str {
        match self {
            Endpoint::Decide => "approval_decided",
            Endpoint::Answer => "question_answered",
            Endpoint::Freeze => "frozen",
            Endpoint::Unfreeze => "unfrozen",
            Endpoint::Cancel => "cancelled",
        }
    }

    fn sample(self) -> Value {
        match self {
            // Never the pending request's hash: the run stays at its gate for every case.
            Endpoint::Decide => json!({"decision": "approve", "payload_hash": "0".repeat(64),
                                       "reason": "looks right", "by": "fuzz"}),
            Endpoint::Answer => json!({"answer": "staging", "by": "fuzz"}),
            Endpoint::Freeze | Endpoint::Unfreeze | Endpoint::Cancel => {
                json!({"reason": "incident 42", "by": "fuzz"})
            }
        }
    }
}

/// A JSON object's entries in order, repeats kept (a `Value` keeps only the last).
struct Entries(Vec<(String, Value)>);

impl<'de> Deserialize<'de> for Entries {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Entries, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Entries;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Entries, A::Error> {
                let mut out = Vec::new();
                while let Some(entry) = map.next_entry::<String, Value>()? {
                    out.push(entry);
                }
                Ok(Entries(out))
            }
        }
        d.deserialize_map(V)
    }
}

/// The body as the endpoint must read it: `Some(entries)` for a JSON object with only the
/// endpoint's keys, each once and of its type; `None` for anything else.
fn readable(endpoint: Endpoint, body: &[u8]) -> Option<Vec<(String, Value)>> {
    let Entries(entries) = serde_json::from_slice(body).ok()?;
    let mut seen = Vec::new();
    for (k, v) in &entries {
        let (_, slot) = endpoint.keys().iter().find(|(name, _)| name == k)?;
        if seen.contains(&k) {
            return None;
        }
        seen.push(k);
        match (slot, v) {
            (_, Value::String(_)) | (Slot::OptionalString, Value::Null) => {}
            _ => return None,
        }
    }
    Some(entries)
}

// ---- the server -----------------------------------------------------------------------------------

struct Fixture {
    workspace: Workspace,
    server: Server,
    client: reqwest::blocking::Client,
}

/// One run and one server for every case of a property: a case that is accepted changes the
/// run (frozen, cancelled), and later cases are judged on the same rules.
fn fixture() -> Fixture {
    let workspace = Workspace::gated();
    let server = Server::start(&workspace.store);
    let client = reqwest::blocking::Client::builder()
        .timeout(std::time::Duration::from_secs(60))
        .build()
        .unwrap();
    Fixture {
        workspace,
        server,
        client,
    }
}

struct Answer {
    status: u16,
    error: Option<String>,
    text: String,
}

fn post(f: &Fixture, path: &str, body: &[u8]) -> Answer {
    let response = f
        .client
        .post(f.server.url(path))
        .header("Authorization", format!("Bearer {TOKEN}"))
        .header("Content-Type", "application/json")
        .body(body.to_vec())
        .send()
        .unwrap_or_else(|e| panic!("POST {path}: the server did not answer: {e}"));
    let status = response.status().as_u16();
    let text = response.text().unwrap();
    let error = serde_json::from_str::<Value>(&text)
        .ok()
        .and_then(|v| v.get("error").and_then(Value::as_str).map(str::to_string));
    Answer {
        status,
        error,
        text,
    }
}

/// Sends `body` to `endpoint` and checks the answer against what the body is.
fn check(f: &Fixture, endpoint: Endpoint, body: &[u8]) {
    let path = endpoint.path(&f.workspace.run, "1");
    let before = f.workspace.count(endpoint.event());
    let answer = post(f, &path, body);
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
                f.workspace.count(endpoint.event()),
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
                assert_eq!(f.workspace.count(endpoint.event()), before + 1);
                assert!(
                    reason.is_some_and(|r| !r.trim().is_empty()),
                    "POST {path}: accepted without a reason: {}",
                    shown()
                );
            } else {
                assert_eq!(f.workspace.count(endpoint.event()), before);
            }
        }
    }
}

// ---- JSON mutations -------------------------------------------------------------------------------

const KEYS: &[&str] = &[
    "decision",
    "payload_hash",
    "reason",
    "by",
    "answer",
    "payloadHash",
    "Reason",
    "",
];

/// `fuzz::hostile`'s values, a blank string, the two decisions, and the values of a decision by
/// position.
fn hostile() -> BoxedStrategy<Value> {
    let fixed = vec![
        json!("   "),
        json!("approve"),
        json!("reject"),
        json!(["reject", "0", "why", "me"]),
    ];
    fuzz::hostile(fixed, vec![])
}

fn endpoint() -> impl Strategy<Value = Endpoint> {
    proptest::sample::select(ENDPOINTS.to_vec())
}

// ---- properties ---------------------------------------------------------------------------------------

#[test]
fn request_bodies_are_read_exactly_as_the_endpoints_take_them() {
    // One server for all three properties: starting a run takes a git repository and a store.
    let f = fixture();
    let mut runner = proptest::test_runner::TestRunner::new(fuzz::config());
    runner
        .run(
            &(endpoint(), proptest::collection::vec(any::<u8>(), 0..300)),
            |(e, bytes)| {
                check(&f, e, &bytes);
                Ok(())
            },
        )
        .unwrap();
    runner
        .run(
            &(
                endpoint(),
                proptest::collection::vec(fuzz::edit(fuzz::key(KEYS), hostile()), 1..4),
            ),
            |(e, edits)| {
                let v = edits.iter().fold(e.sample(), apply);
                check(&f, e, v.to_string().as_bytes());
                Ok(())
            },
        )
        .unwrap();
    // The sample's values by position, as serde would also read a struct.
    runner
        .run(
            &(
                endpoint(),
                proptest::collection::vec(hostile(), 0..5),
                any::<bool>(),
            ),
            |(e, extra, keep)| {
                let sample = e.sample();
                let mut values: Vec<Value> = if keep {
                    sample.as_object().unwrap().values().cloned().collect()
                } else {
                    Vec::new()
                };
                values.extend(extra);
                check(&f, e, Value::Array(values).to_string().as_bytes());
                Ok(())
            },
        )
        .unwrap();
    runner
        .run(
            &(
                endpoint(),
                proptest::collection::vec(fuzz::byte_edit(), 1..4),
            ),
            |(e, edits)| {
                let bytes = edits
                    .iter()
                    .fold(e.sample().to_string().into_bytes(), apply_bytes);
                check(&f, e, &bytes);
                Ok(())
            },
        )
        .unwrap();
}

#[test]
fn a_request_number_that_is_not_a_positive_number_is_refused() {
    let f = fixture();
    let mut runner = proptest::test_runner::TestRunner::new(fuzz::config());
    runner
        .run(
            &(
                prop_oneof![Just(Endpoint::Decide), Just(Endpoint::Answer)],
                prop_oneof![
                    ".{1,12}",
                    "[-+]?[0-9]{1,25}",
                    Just("0".to_string()),
                    Just("4294967296".to_string()),
                ],
            ),
            |(e, n)| {
                // `.` and `..` are path steps to a URL, resolved before a request is sent.
                if n == "." || n == ".." {
                    return Ok(());
                }
                // Every byte percent-encoded: the router sees exactly this text as the number.
                let encoded: String = n.bytes().map(|b| format!("%{b:02X}")).collect();
                let path = e.path(&f.workspace.run, &encoded);
                let answer = post(&f, &path, e.sample().to_string().as_bytes());
                prop_assert!(answer.status < 500, "{path}: {}", answer.text);
                let counts_from_one = answer
                    .error
                    .as_deref()
                    .is_some_and(|e| e.contains("count from 1"));
                let number = n.parse::<u32>().ok().filter(|&n| n > 0);
                prop_assert_eq!(
                    counts_from_one,
                    number.is_none(),
                    "{} {}: {}",
                    n,
                    answer.status,
                    answer.text
                );
                Ok(())
            },
        )
        .unwrap();
    // Nothing was decided or answered.
    assert_eq!(f.workspace.count("approval_decided"), 0);
    assert_eq!(f.workspace.count("question_answered"), 0);
}

#[test]
fn every_sample_body_is_readable() {
    for e in ENDPOINTS {
        assert!(
            readable(e, e.sample().to_string().as_bytes()).is_some(),
            "{e:?}"
        );
    }
}

#[test]
fn a_body_that_is_a_json_array_is_refused_not_read_by_position() {
    // Found by fuzzing: serde reads a struct from an array by position, so
    // `["because", "me"]` cancelled a run as if it were {"reason": "because", "by": "me"}.
    let f = fixture();
    for e in ENDPOINTS {
        for body in [
            r#"["because", "me"]"#,
            r#"["approve", "0", "why", "me"]"#,
            "[]",
        ] {
            let path = e.path(&f.workspace.run, "1");
            let answer = post(&f, &path, body.as_bytes());
            assert_eq!(answer.status, 400, "POST {path} {body}: {}", answer.text);
            let error = answer.error.unwrap();
            assert!(error.contains("it must be an object"), "{error}");
        }
    }
    assert_eq!(f.workspace.count("cancelled"), 0);
    assert_eq!(f.workspace.count("frozen"), 0);
    assert_eq!(f.workspace.run().state.as_str(), "awaiting_approval");
}
