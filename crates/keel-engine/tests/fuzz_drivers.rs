//! Bad input to the engine's drivers' `parse`: a line of a script (`ScriptDriver`), the record of
//! a delegated program (`CommandDriver`), and a model server's answer through the model drivers
//! that `make_driver` builds for `openai` and `anthropic` contracts.
//!
//! Each property runs 256 cases by default; set `KEEL_FUZZ_CASES` (for example
//! `KEEL_FUZZ_CASES=100000`) to run more. Nothing is written to the source tree: a failure prints
//! the smallest input it found instead of saving it.
//!
//! What is asserted, for arbitrary bytes and for valid inputs mutated in place (values swapped
//! for wrong types, huge numbers, long strings and deep nesting; keys removed, added and
//! repeated; bytes flipped, cut and inserted, invalid UTF-8 included):
//! - no parse panics;
//! - a script line or a record is accepted exactly when it is one (restated plainly in
//!   `keel_test_support::oracle::drivers`, which the fuzz target `drivers` shares), and gives
//!   exactly the calls, text and usage it says; nothing in it is dropped without a word;
//! - the model drivers parse exactly as keel-llm's client does;
//! - a refusal says why.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use keel_engine::driver::{CommandDriver, Driver};
use keel_test_support::fuzz::{self, apply, apply_bytes};
use keel_test_support::oracle::drivers::{check_all, model_driver, script_driver};
use proptest::prelude::*;
use proptest::sample::Index;
use serde_json::{Value, json};

// ---- valid inputs ---------------------------------------------------------------------------------

fn script_lines() -> Vec<Value> {
    vec![
        json!({"tool": "read", "args": {"path": "src/lib.rs"}}),
        json!({"calls": [{"tool": "note", "args": {"text": "x"}}, {"tool": "write", "arguments": "{not json"}],
               "usage": {"input_tokens": 5, "output_tokens": 2}}),
        json!({"text": "Done, I think.", "tool": "finish", "args": {"summary": "done"}}),
        json!({"tool": "ask", "arguments": "{\"question\": \"Which database?\"}", "usage": null}),
        json!({"text": "nothing to do"}),
    ]
}

fn records() -> Vec<Value> {
    vec![
        json!({"command": "my-agent", "status": "exit 0", "success": true, "output_tail": "all good\n"}),
        json!({"command": "my-agent", "status": "exit 1", "success": false, "output_tail": "error: boom"}),
        json!({"command": "my-agent", "status": "timed out after 10s", "success": false, "output_tail": ""}),
    ]
}

fn answers() -> Vec<Value> {
    vec![
        json!({"choices": [{"message": {"content": "hi", "tool_calls": [
            {"id": "c1", "function": {"name": "read", "arguments": "{\"path\":\"a\"}"}}]},
            "finish_reason": "tool_calls"}], "usage": {"prompt_tokens": 3, "completion_tokens": 4}}),
        json!({"content": [{"type": "text", "text": "hi"}, {"type": "tool_use", "id": "t1", "name": "finish", "input": {}}],
               "stop_reason": "tool_use", "usage": {"input_tokens": 3, "output_tokens": 4}}),
    ]
}

// ---- JSON mutations -------------------------------------------------------------------------------

const KEYS: &[&str] = &[
    "tool",
    "args",
    "arguments",
    "calls",
    "text",
    "usage",
    "input_tokens",
    "output_tokens",
    "status",
    "success",
    "output_tail",
    "command",
    "choices",
    "message",
    "content",
];

/// `fuzz::hostile`'s values, numbers below zero and not quite integers, and arrays in the places
/// of a call and of a usage.
fn hostile() -> BoxedStrategy<Value> {
    let fixed = vec![
        json!(-1),
        json!(2.0),
        json!(["read", null, null]),
        json!([5, 2]),
    ];
    fuzz::hostile(fixed, vec![])
}

// ---- properties ---------------------------------------------------------------------------------------

proptest! {
    #![proptest_config(fuzz::config())]

    #[test]
    fn arbitrary_bytes_are_refused_or_parsed_exactly(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
        check_all(&bytes);
    }

    #[test]
    fn a_mutated_input_is_refused_or_parsed_exactly(
        which in any::<Index>(),
        edits in proptest::collection::vec(fuzz::edit(fuzz::key(KEYS), hostile()), 1..4),
    ) {
        let samples: Vec<Value> = script_lines().into_iter().chain(records()).chain(answers()).collect();
        let v = edits.iter().fold(samples[which.index(samples.len())].clone(), apply);
        check_all(v.to_string().as_bytes());
    }

    #[test]
    fn mutated_bytes_of_an_input_are_refused_or_parsed_exactly(
        which in any::<Index>(),
        edits in proptest::collection::vec(fuzz::byte_edit(), 1..4),
    ) {
        let samples: Vec<Value> = script_lines().into_iter().chain(records()).chain(answers()).collect();
        let bytes = edits.iter().fold(samples[which.index(samples.len())].to_string().into_bytes(), apply_bytes);
        check_all(&bytes);
    }
}

#[test]
fn a_script_usage_with_a_key_keel_does_not_know_is_refused() {
    // Found by `a_mutated_input_is_refused_or_parsed_exactly` once `Usage` (shared with the event
    // log) began to refuse unknown keys: the script's usage is checked like the rest of it.
    let line = r#"{"calls":[{"args":{"text":"x"},"tool":"note"}],"usage":{"input_tokens":5,"output_tail":-1,"output_tokens":2}}"#;
    let err = script_driver().parse(line.as_bytes()).unwrap_err();
    assert!(err.contains("unknown field `output_tail`"), "{err}");
    check_all(line.as_bytes());
}

#[test]
fn every_sample_is_accepted_by_its_driver() {
    for line in script_lines() {
        assert!(
            script_driver().parse(line.to_string().as_bytes()).is_ok(),
            "{line}"
        );
    }
    for record in records() {
        assert!(
            CommandDriver::new("true", 1000)
                .parse(record.to_string().as_bytes())
                .is_ok(),
            "{record}"
        );
    }
    assert!(
        model_driver("openai")
            .parse(answers()[0].to_string().as_bytes())
            .is_ok()
    );
    assert!(
        model_driver("anthropic")
            .parse(answers()[1].to_string().as_bytes())
            .is_ok()
    );
}

#[test]
fn a_script_action_with_args_but_no_tool_is_refused_not_dropped() {
    // Found by fuzzing: the arguments were silently ignored and the action read as "no call".
    for line in [
        r#"{"args": {"path": "a"}}"#,
        r#"{"arguments": "{}", "text": "reading"}"#,
    ] {
        let err = script_driver().parse(line.as_bytes()).unwrap_err();
        assert!(err.contains("no `tool`"), "{err}");
    }
}

#[test]
fn a_script_call_with_both_args_and_arguments_is_refused() {
    // Found by fuzzing: `args` was dropped in favour of `arguments` without a word.
    for line in [
        r#"{"tool": "read", "args": {"path": "a"}, "arguments": "{\"path\": \"b\"}"}"#,
        r#"{"calls": [{"tool": "read", "args": {}, "arguments": "{}"}]}"#,
    ] {
        let err = script_driver().parse(line.as_bytes()).unwrap_err();
        assert!(err.contains("both `args` and `arguments`"), "{err}");
    }
}

#[test]
fn a_script_action_written_as_an_array_is_refused_not_read_by_position() {
    // Found by fuzzing: serde reads a struct from an array by position, so
    // `[[], "finish", null, null, "done", null]` was a finish claim.
    let line = r#"[[], "finish", null, null, "done", null]"#;
    let err = script_driver().parse(line.as_bytes()).unwrap_err();
    assert!(err.contains("must be a JSON object"), "{err}");
}

#[test]
fn a_delegated_command_record_that_keel_did_not_write_is_refused() {
    // Found by fuzzing: any JSON at all read as "the delegated command ended with ?", a run that
    // claimed nothing; a damaged record now says so.
    for record in [
        "5",
        "[]",
        "{}",
        r#"{"status": "exit 0"}"#,
        r#"{"status": 0, "success": true}"#,
        r#"{"status": "exit 0", "success": "yes"}"#,
        r#"{"status": "exit 0", "success": true, "output_tail": 7}"#,
    ] {
        let err = CommandDriver::new("true", 1000)
            .parse(record.as_bytes())
            .unwrap_err();
        assert!(err.contains("not one keel writes"), "{record}: {err}");
    }
}

#[test]
fn a_script_action_with_a_repeated_key_whose_first_value_is_wrong_is_refused() {
    // Found by the fuzz target `drivers`: serde reads a key's first value before it sees the key
    // again, so the refusal of `"usage"` written twice named the first value's type, not the
    // repeat, and the oracle, reading the line as a `Value` that keeps the last, took the line
    // for a valid one. keel refuses it, as it must; the oracle now sees repeated keys.
    let line = r#"{"usage": [{"tgs": {"text": "x"}}, {"tool": "w|ite", "uments": "{not json"}], "usage": {"input_tokens": 1, "output_tokens": 2}}"#;
    let err = script_driver().parse(line.as_bytes()).unwrap_err();
    assert!(err.contains("expected u64"), "{err}");
    for line in [
        line,
        r#"{"tool": "read", "tool": "note"}"#,
        r#"{"calls": [{"tool": "read", "args": {}, "args": {}}]}"#,
        r#"{"tool": "note", "usage": {"input_tokens": 1, "input_tokens": "x", "output_tokens": 2}}"#,
        r#"{"tool": "note", "tool": "read", "note": 1}"#,
    ] {
        assert!(script_driver().parse(line.as_bytes()).is_err(), "{line}");
        check_all(line.as_bytes());
    }
    // A key repeated inside a call's arguments, which keel keeps as JSON, is no reason to refuse.
    let line = r#"{"tool": "note", "args": {"text": "a", "text": "b"}}"#;
    assert!(script_driver().parse(line.as_bytes()).is_ok());
    check_all(line.as_bytes());
}
