//! keel's model-output parsers' oracle: what `Client::parse` must do with any answer, for the
//! OpenAI-compatible and the Anthropic wire formats. Shared by keel-llm's property tests
//! (`tests/fuzz.rs`) and the coverage-guided fuzz target `llm_reply` (`fuzz/`):
//! - a parse accepts exactly the answers the wire format allows (restated plainly below), so
//!   garbage never becomes a reply, and what it accepts is what the server sent: the calls with
//!   their ids, names and argument text, the text, the usage, the stop reason;
//! - a reply survives being stored (serialised and read back unchanged);
//! - a refusal is `Malformed`, says what is missing, shows the start of the body, and never shows
//!   the API key, even when the server echoes it.
//!
//! Each check panics with what it found, as a test's assertion does.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::OnceLock;
use std::time::Duration;

use keel_llm::{Client, ClientConfig, LlmError, ModelReply, Provider};
use serde_json::Value;

/// The API key every client holds, which no error may show.
pub const KEY: &str = "sk-fuzz-0123456789abcdefghijklmnopqrstuvwxyz";

/// One client per provider, made once: building one loads TLS roots.
pub fn client(provider: Provider) -> &'static Client {
    static CLIENTS: OnceLock<(Client, Client)> = OnceLock::new();
    let (openai, anthropic) = CLIENTS.get_or_init(|| {
        (
            make_client(Provider::OpenAi),
            make_client(Provider::Anthropic),
        )
    });
    match provider {
        Provider::OpenAi => openai,
        Provider::Anthropic => anthropic,
    }
}

fn make_client(provider: Provider) -> Client {
    Client::new(ClientConfig {
        provider,
        // Never called: these tests only parse.
        base_url: "http://127.0.0.1:9/v1".into(),
        model: "m".into(),
        api_key: Some(KEY.into()),
        max_output_tokens: 100,
        timeout: Duration::from_secs(1),
        max_retries: 0,
        backoff_base: Duration::from_millis(1),
        backoff_max: Duration::from_millis(1),
    })
    .unwrap()
}

// ---- what each wire format allows, restated -------------------------------------------------------

/// The reply a well-formed answer must give, or `None` for an answer that must be refused.
fn expected(p: Provider, body: &[u8]) -> Option<ModelReply> {
    let root: Value = serde_json::from_slice(body).ok()?;
    let u64_at = |usage: &Value, k: &str| usage.get(k).and_then(Value::as_u64).unwrap_or(0);
    let text_of = |v: Option<&Value>| -> Option<String> {
        let t = match v? {
            Value::String(s) => s.clone(),
            Value::Array(parts) => parts
                .iter()
                .filter_map(|p| p.get("text").and_then(Value::as_str))
                .collect(),
            _ => return None,
        };
        (!t.is_empty()).then_some(t)
    };
    let usage = root.get("usage").cloned().unwrap_or(Value::Null);
    match p {
        Provider::OpenAi => {
            if root.get("error").is_some_and(|e| !e.is_null()) {
                return None;
            }
            let choice = root.get("choices")?.as_array()?.first()?;
            let message = choice.get("message").filter(|m| m.is_object())?;
            let calls = match message.get("tool_calls") {
                None | Some(Value::Null) => Vec::new(),
                Some(Value::Array(list)) => list
                    .iter()
                    .enumerate()
                    .map(|(i, c)| keel_llm::ToolCall {
                        id: c
                            .get("id")
                            .and_then(Value::as_str)
                            .filter(|s| !s.is_empty())
                            .map_or(format!("call_{i}"), str::to_string),
                        name: c
                            .get("function")
                            .and_then(|f| f.get("name"))
                            .and_then(Value::as_str)
                            .unwrap_or("")
                            .to_string(),
                        arguments: match c.get("function").and_then(|f| f.get("arguments")) {
                            Some(Value::String(s)) => s.clone(),
                            None | Some(Value::Null) => "{}".to_string(),
                            Some(other) => other.to_string(),
                        },
                    })
                    .collect(),
                Some(_) => return None,
            };
            Some(ModelReply {
                text: text_of(message.get("content")).or_else(|| text_of(message.get("refusal"))),
                calls,
                usage: keel_llm::Usage {
                    input_tokens: u64_at(&usage, "prompt_tokens"),
                    output_tokens: u64_at(&usage, "completion_tokens"),
                },
                stop_reason: choice
                    .get("finish_reason")
                    .and_then(Value::as_str)
                    .map(str::to_string),
            })
        }
        Provider::Anthropic => {
            if root.get("type").and_then(Value::as_str) == Some("error") {
                return None;
            }
            let content = root.get("content")?.as_array()?;
            let mut texts = Vec::new();
            let mut calls = Vec::new();
            for block in content {
                match block.get("type").and_then(Value::as_str) {
                    Some("text") => {
                        if let Some(t) = block
                            .get("text")
                            .and_then(Value::as_str)
                            .filter(|t| !t.is_empty())
                        {
                            texts.push(t.to_string());
                        }
                    }
                    Some("tool_use") => calls.push(keel_llm::ToolCall {
                        id: block
                            .get("id")
                            .and_then(Value::as_str)
                            .filter(|s| !s.is_empty())
                            .map_or(format!("toolu_{}", calls.len()), str::to_string),
                        name: block
                            .get("name")
                            .and_then(Value::as_str)
                            .unwrap_or("")
                            .to_string(),
                        arguments: match block.get("input") {
                            None | Some(Value::Null) => "{}".to_string(),
                            Some(v) => v.to_string(),
                        },
                    }),
                    _ => {}
                }
            }
            Some(ModelReply {
                text: (!texts.is_empty()).then(|| texts.join("\n")),
                calls,
                usage: keel_llm::Usage {
                    input_tokens: u64_at(&usage, "input_tokens")
                        .saturating_add(u64_at(&usage, "cache_creation_input_tokens"))
                        .saturating_add(u64_at(&usage, "cache_read_input_tokens")),
                    output_tokens: u64_at(&usage, "output_tokens"),
                },
                stop_reason: root
                    .get("stop_reason")
                    .and_then(Value::as_str)
                    .map(str::to_string),
            })
        }
    }
}

// ---- the check ----------------------------------------------------------------------------------

/// Parses `body` as provider `p`'s answer and checks the reply, or the refusal, against what
/// the wire format allows.
pub fn check(p: Provider, body: &[u8]) {
    let parsed = client(p).parse(body);
    match (&parsed, expected(p, body)) {
        (Ok(reply), Some(want)) => {
            assert_eq!(reply, &want, "{p}: the reply is not what the server sent");
            // Stored in `model_replied`: it must come back unchanged.
            let stored = serde_json::to_string(reply).unwrap();
            assert_eq!(&serde_json::from_str::<ModelReply>(&stored).unwrap(), reply);
            assert!(reply.text.as_deref().is_none_or(|t| !t.is_empty()));
            assert!(reply.calls.iter().all(|c| !c.id.is_empty()));
        }
        (Err(LlmError::Malformed { message, excerpt }), None) => {
            assert!(!message.trim().is_empty(), "a refusal that says nothing");
            let shown = parsed.as_ref().unwrap_err().to_string();
            assert!(
                !shown.contains(KEY),
                "{p}: the error shows the API key: {shown}"
            );
            // The excerpt is the start of the body (the key taken out), cut with `…`.
            let scrubbed = String::from_utf8_lossy(body).replace(KEY, "[redacted]");
            let start = excerpt.strip_suffix('…').unwrap_or(excerpt);
            assert!(
                scrubbed.starts_with(start),
                "{p}: the excerpt {excerpt:?} is not the start of the body"
            );
            assert!(start.len() <= 300);
        }
        (Err(other), None) => panic!("{p}: a bad answer is not `Malformed`: {other}"),
        (Ok(reply), None) => panic!(
            "{p}: accepted an answer the format does not allow: {reply:?}\nbody: {}",
            String::from_utf8_lossy(body)
        ),
        (Err(e), Some(_)) => panic!(
            "{p}: refused a valid answer: {e}\nbody: {}",
            String::from_utf8_lossy(body)
        ),
    }
}
