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
//! - a parse accepts exactly the answers the wire format allows (restated plainly in
//!   `keel_test_support::oracle::llm`), so garbage never becomes a reply, and what it accepts is
//!   what the server sent: the calls with their ids, names and argument text, the text, the
//!   usage, the stop reason;
//! - a reply survives being stored (serialised and read back unchanged);
//! - a refusal is `Malformed`, says what is missing, shows the start of the body, and never shows
//!   the API key, even when the server echoes it.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use keel_llm::Provider;
use keel_test_support::fuzz::{self, JsonSize, apply, apply_bytes};
use keel_test_support::oracle::llm::{KEY, check, client};
use proptest::prelude::*;
use proptest::sample::Index;
use serde_json::{Value, json};

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
