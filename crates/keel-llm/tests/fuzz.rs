//! Bad input to keel's model-output parsers: `Client::parse` for the OpenAI-compatible and the
//! Anthropic wire formats. A model server may answer 200 with anything.
//!
//! Each property runs 256 cases by default; set `KEEL_FUZZ_CASES` (for example
//! `KEEL_FUZZ_CASES=100000`) to run more. Nothing is written to the source tree: a failure prints
//! the smallest input it found instead of saving it.
//!
//! What is asserted, for arbitrary bytes, arbitrary JSON, and real answers mutated in place
//! (values swapped for wrong types, huge numbers, long strings and deep nesting; keys removed,
//! added and repeated; bytes flipped, cut and inserted, invalid UTF-8 included):
//! - no parse panics;
//! - a parse accepts exactly the answers the wire format allows (restated plainly below), so
//!   garbage never becomes a reply, and what it accepts is what the server sent: the calls with
//!   their ids, names and argument text, the text, the usage, the stop reason;
//! - a reply survives being stored (serialised and read back unchanged);
//! - a refusal is `Malformed`, says what is missing, shows the start of the body, and never shows
//!   the API key, even when the server echoes it.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::OnceLock;
use std::time::Duration;

use keel_llm::{Client, ClientConfig, LlmError, ModelReply, Provider};
use keel_test_support::fuzz::{self, JsonSize, apply, apply_bytes};
use proptest::prelude::*;
use proptest::sample::Index;
use serde_json::{Value, json};

const KEY: &str = "sk-fuzz-0123456789abcdefghijklmnopqrstuvwxyz";

/// One client per provider, made once: building one loads TLS roots.
fn client(provider: Provider) -> &'static Client {
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

fn provider() -> impl Strategy<Value = Provider> {
    prop_oneof![Just(Provider::OpenAi), Just(Provider::Anthropic)]
}

// ---- real answers --------------------------------------------------------------------------------

fn openai_answers() -> Vec<Value> {
    vec![
        json!({
            "id": "chatcmpl-1", "object": "chat.completion", "model": "gpt-4o-mini",
            "choices": [{
                "index": 0,
                "message": {
                    "role": "assistant", "content": null, "refusal": null,
                    "tool_calls": [
                        {"id": "call_a", "type": "function", "function": {"name": "read", "arguments": "{\"path\":\"src/lib.rs\"}"}},
                        {"id": "call_b", "type": "function", "function": {"name": "finish", "arguments": "{}"}}
                    ]
                },
                "finish_reason": "tool_calls"
            }],
            "usage": {"prompt_tokens": 812, "completion_tokens": 64, "total_tokens": 876}
        }),
        // Ollama: arguments as an object, content as text, no ids.
        json!({
            "model": "qwen3", "choices": [{"message": {"role": "assistant", "content": "Reading.",
              "tool_calls": [{"function": {"name": "read", "arguments": {"path": "a"}}}]},
              "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 10}
        }),
        // Content as parts; a refusal.
        json!({"choices": [{"message": {"content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}}]}),
        json!({"choices": [{"message": {"content": null, "refusal": "I can't."}, "finish_reason": "stop"}]}),
    ]
}

fn anthropic_answers() -> Vec<Value> {
    vec![
        json!({
            "id": "msg_01", "type": "message", "role": "assistant", "model": "claude-sonnet-4",
            "content": [
                {"type": "text", "text": "I'll read both files."},
                {"type": "tool_use", "id": "toolu_a", "name": "read", "input": {"path": "src/lib.rs"}},
                {"type": "thinking", "thinking": "..."},
                {"type": "tool_use", "id": "toolu_b", "name": "finish", "input": {}}
            ],
            "stop_reason": "tool_use",
            "usage": {"input_tokens": 1200, "output_tokens": 88, "cache_read_input_tokens": 100}
        }),
        json!({"content": [{"type": "text", "text": "done"}], "stop_reason": "end_turn"}),
        json!({"content": []}),
    ]
}

fn answers(p: Provider) -> Vec<Value> {
    match p {
        Provider::OpenAi => openai_answers(),
        Provider::Anthropic => anthropic_answers(),
    }
}

// ---- JSON generators and mutations ---------------------------------------------------------------

const KEYS: &[&str] = &[
    "choices",
    "message",
    "content",
    "refusal",
    "tool_calls",
    "function",
    "name",
    "arguments",
    "id",
    "usage",
    "prompt_tokens",
    "completion_tokens",
    "finish_reason",
    "error",
    "type",
    "text",
    "input",
    "stop_reason",
    "input_tokens",
    "output_tokens",
    "cache_read_input_tokens",
    "cache_creation_input_tokens",
];

/// `fuzz::hostile`'s values, numbers below zero and between integers, the names of block types,
/// and the API key itself.
fn hostile() -> BoxedStrategy<Value> {
    let fixed = vec![
        json!(-1),
        json!(0.5),
        json!(KEY),
        json!(format!("invalid key {KEY}")),
        json!({"message": KEY}),
    ];
    let blocks =
        proptest::sample::select(vec!["text", "tool_use", "error", "function", "thinking"]);
    fuzz::hostile(fixed, vec![blocks.prop_map(Value::from).boxed()])
}

fn any_json() -> BoxedStrategy<Value> {
    let size = JsonSize {
        depth: 6,
        branch: 6,
        items: 0..4,
        keys: 0..5,
    };
    fuzz::any_json(KEYS, any::<u64>().prop_map(Value::from).boxed(), size)
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

fn check(p: Provider, body: &[u8]) {
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

// ---- properties -------------------------------------------------------------------------------------

proptest! {
    #![proptest_config(fuzz::config())]

    #[test]
    fn arbitrary_bytes_are_refused_or_parsed_as_the_format_allows(
        p in provider(),
        bytes in proptest::collection::vec(any::<u8>(), 0..400),
    ) {
        check(p, &bytes);
    }

    #[test]
    fn arbitrary_json_is_refused_or_parsed_as_the_format_allows(p in provider(), v in any_json()) {
        check(p, v.to_string().as_bytes());
    }

    #[test]
    fn a_mutated_answer_is_refused_or_parsed_as_the_format_allows(
        p in provider(),
        which in any::<Index>(),
        edits in proptest::collection::vec(fuzz::edit(fuzz::key(KEYS), hostile()), 1..4),
    ) {
        let samples = answers(p);
        let sample = samples[which.index(samples.len())].clone();
        let v = edits.iter().fold(sample, apply);
        check(p, v.to_string().as_bytes());
    }

    #[test]
    fn mutated_bytes_of_an_answer_are_refused_or_parsed_as_the_format_allows(
        p in provider(),
        which in any::<Index>(),
        edits in proptest::collection::vec(fuzz::byte_edit(), 1..4),
    ) {
        let samples = answers(p);
        let sample = serde_json::to_vec(&samples[which.index(samples.len())]).unwrap();
        let bytes = edits.iter().fold(sample, apply_bytes);
        check(p, &bytes);
    }
}

#[test]
fn every_sample_answer_parses() {
    for p in [Provider::OpenAi, Provider::Anthropic] {
        for sample in answers(p) {
            assert!(
                client(p).parse(sample.to_string().as_bytes()).is_ok(),
                "{sample}"
            );
            check(p, sample.to_string().as_bytes());
        }
    }
}

#[test]
fn a_malformed_answer_that_echoes_the_key_does_not_show_it_in_the_error() {
    // Found by fuzzing: the error of a 2xx answer that is not a reply quoted the body as it
    // came, key and all, and an excerpt cut at 300 bytes could show part of it.
    for p in [Provider::OpenAi, Provider::Anthropic] {
        for body in [
            format!(r#"{{"error": {{"message": "bad key {KEY}"}}, "type": "error"}}"#),
            format!("{}{KEY}", "x".repeat(280)),
            format!(r#"{{"echo": "{KEY}"}}"#),
        ] {
            let err = client(p).parse(body.as_bytes()).unwrap_err();
            let shown = err.to_string();
            assert!(!shown.contains(KEY), "{p}: {shown}");
            assert!(
                !shown.contains(&KEY[..20]),
                "{p}: part of the key is shown: {shown}"
            );
        }
    }
}
