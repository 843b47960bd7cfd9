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
//! - a script line or a record is accepted exactly when it is one (restated plainly below), and
//!   gives exactly the calls, text and usage it says; nothing in it is dropped without a word;
//! - the model drivers parse exactly as keel-llm's client does;
//! - a refusal says why.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;

use keel_core::agent::{ModelReply, ToolCall, Usage};
use keel_core::contract::Contract;
use keel_engine::DriverOverride;
use keel_engine::driver::{CommandDriver, Driver, ScriptDriver};
use keel_test_support::fuzz::{self, apply, apply_bytes};
use proptest::prelude::*;
use proptest::sample::Index;
use serde_json::{Value, json};

fn script_driver() -> ScriptDriver {
    let file = tempfile::NamedTempFile::new().unwrap();
    ScriptDriver::load(file.path()).unwrap()
}

/// The driver `make_driver` builds for a contract with a model driver of `kind`.
fn model_driver(kind: &str) -> Box<dyn Driver> {
    let source = format!(
        r#"
[task]
goal = "g"

[driver]
kind = "{kind}"
model = "m"
base_url = "http://127.0.0.1:9/v1"

[[verify]]
name = "v"
tier = "acceptance"
run = "true"

[[phase]]
name = "p"
kind = "agent"
objective = "o"
"#
    );
    let contract = Contract::parse("keel.toml", &source).unwrap();
    keel_engine::make_driver(&contract, Path::new("."), &DriverOverride::default())
        .unwrap()
        .expect("an agent phase has a driver")
}

fn llm_client(provider: keel_llm::Provider) -> keel_llm::Client {
    keel_llm::Client::new(keel_llm::ClientConfig {
        provider,
        base_url: "http://127.0.0.1:9/v1".into(),
        model: "m".into(),
        api_key: None,
        max_output_tokens: 100,
        timeout: std::time::Duration::from_secs(1),
        max_retries: 0,
        backoff_base: std::time::Duration::from_millis(1),
        backoff_max: std::time::Duration::from_millis(1),
    })
    .unwrap()
}

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

// ---- what a script line and a record are, restated -------------------------------------------------

/// What a parser must do with an input.
#[derive(Debug)]
enum Expect {
    Accept(ModelReply),
    Refuse,
    /// Shapes serde also reads but nobody writes (a struct written as an array, a repeated
    /// key): either answer is fine, as long as an accepted one is consistent.
    Either,
}

fn opt_string(v: Option<&Value>) -> Result<Option<String>, ()> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(()),
    }
}

const ACTION_KEYS: [&str; 6] = ["calls", "tool", "args", "arguments", "text", "usage"];
const CALL_KEYS: [&str; 3] = ["tool", "args", "arguments"];
const USAGE_KEYS: [&str; 2] = ["input_tokens", "output_tokens"];

fn script_call(
    id: String,
    tool: Option<String>,
    args: Option<&Value>,
    raw: Option<String>,
) -> Result<Option<ToolCall>, ()> {
    let args = args.filter(|a| !a.is_null());
    match (tool, args, raw) {
        (None, None, None) => Ok(None),
        (None, _, _) | (Some(_), Some(_), Some(_)) => Err(()),
        (Some(name), args, raw) => Ok(Some(ToolCall {
            id,
            name,
            arguments: raw.unwrap_or_else(|| args.map_or("{}".to_string(), Value::to_string)),
        })),
    }
}

fn expected_script(body: &[u8]) -> Expect {
    let v = match serde_json::from_slice::<Value>(body) {
        Ok(v) => v,
        // Deeper than a `Value` may be; the action's own parse skips unknown values without
        // building them, so it may get further.
        Err(e) if e.to_string().contains("recursion limit") => return Expect::Either,
        Err(_) => return Expect::Refuse,
    };
    let Some(obj) = v.as_object() else {
        return Expect::Refuse;
    };
    if obj.keys().any(|k| !ACTION_KEYS.contains(&k.as_str())) {
        return Expect::Refuse;
    }
    let mut calls = Vec::new();
    match obj.get("calls") {
        None => {}
        Some(Value::Array(list)) => {
            for (i, c) in list.iter().enumerate() {
                let Some(c) = c.as_object() else {
                    return if c.is_array() {
                        Expect::Either
                    } else {
                        Expect::Refuse
                    };
                };
                if c.keys().any(|k| !CALL_KEYS.contains(&k.as_str())) {
                    return Expect::Refuse;
                }
                let (Some(Value::String(tool)), Ok(raw)) =
                    (c.get("tool"), opt_string(c.get("arguments")))
                else {
                    return Expect::Refuse;
                };
                match script_call(format!("call-{i}"), Some(tool.clone()), c.get("args"), raw) {
                    Ok(Some(call)) => calls.push(call),
                    _ => return Expect::Refuse,
                }
            }
        }
        Some(_) => return Expect::Refuse,
    }
    let (Ok(tool), Ok(raw), Ok(text)) = (
        opt_string(obj.get("tool")),
        opt_string(obj.get("arguments")),
        opt_string(obj.get("text")),
    ) else {
        return Expect::Refuse;
    };
    match script_call(format!("call-{}", calls.len()), tool, obj.get("args"), raw) {
        Ok(Some(call)) => calls.push(call),
        Ok(None) => {}
        Err(()) => return Expect::Refuse,
    }
    // `Usage` is keel-core's, shared with the event log, and refuses keys it does not know, as
    // the action and its calls do.
    let usage = match obj.get("usage") {
        None | Some(Value::Null) => Usage::default(),
        Some(Value::Object(u)) if u.keys().any(|k| !USAGE_KEYS.contains(&k.as_str())) => {
            return Expect::Refuse;
        }
        Some(Value::Object(u)) => match (
            u.get("input_tokens").and_then(Value::as_u64),
            u.get("output_tokens").and_then(Value::as_u64),
        ) {
            (Some(input_tokens), Some(output_tokens)) => Usage {
                input_tokens,
                output_tokens,
            },
            _ => return Expect::Refuse,
        },
        Some(Value::Array(_)) => return Expect::Either,
        Some(_) => return Expect::Refuse,
    };
    Expect::Accept(ModelReply {
        text,
        calls,
        usage,
        stop_reason: Some("script".into()),
    })
}

fn expected_record(body: &[u8]) -> Expect {
    let Ok(v) = serde_json::from_slice::<Value>(body) else {
        return Expect::Refuse;
    };
    let status = v.get("status").and_then(Value::as_str);
    let success = v.get("success").and_then(Value::as_bool);
    let tail = match v.get("output_tail") {
        None | Some(Value::Null) => Some(""),
        Some(t) => t.as_str(),
    };
    let (Some(status), Some(success), Some(tail)) = (status, success, tail) else {
        return Expect::Refuse;
    };
    let calls = if success {
        vec![ToolCall {
            id: "delegate".into(),
            name: "finish".into(),
            arguments: json!({"summary": format!("the delegated command ended with {status}")})
                .to_string(),
        }]
    } else {
        Vec::new()
    };
    Expect::Accept(ModelReply {
        text: Some(format!("the delegated command ended with {status}\n{tail}")),
        calls,
        usage: Usage::default(),
        stop_reason: Some(status.to_string()),
    })
}

fn check(what: &str, driver: &dyn Driver, expect: Expect, body: &[u8]) {
    let got = driver.parse(body);
    let shown = || String::from_utf8_lossy(body).into_owned();
    match (&got, expect) {
        (Ok(reply), Expect::Accept(want)) => assert_eq!(reply, &want, "{what}: {}", shown()),
        (Ok(reply), Expect::Either) => {
            // Consistent: calls numbered in order, arguments never lost.
            for (i, call) in reply.calls.iter().enumerate() {
                assert!(call.id.ends_with(&i.to_string()) || call.id == "delegate");
            }
        }
        (Err(message), Expect::Refuse | Expect::Either) => {
            assert!(
                !message.trim().is_empty(),
                "{what}: a refusal that says nothing"
            );
        }
        (Ok(reply), Expect::Refuse) => {
            panic!(
                "{what}: accepted what is not one: {reply:?}\ninput: {}",
                shown()
            )
        }
        (Err(message), Expect::Accept(_)) => {
            // serde refuses a repeated key, which a parsed `Value` no longer shows.
            assert!(
                message.contains("duplicate field"),
                "{what}: refused a valid one ({message}): {}",
                shown()
            );
        }
    }
}

/// The drivers under test, made once per thread: a model driver's client loads TLS roots.
struct Drivers {
    script: ScriptDriver,
    command: CommandDriver,
    models: Vec<(&'static str, Box<dyn Driver>, keel_llm::Client)>,
}

thread_local! {
    static DRIVERS: Drivers = Drivers {
        script: script_driver(),
        command: CommandDriver::new("true", 1000),
        models: vec![
            ("openai", model_driver("openai"), llm_client(keel_llm::Provider::OpenAi)),
            ("anthropic", model_driver("anthropic"), llm_client(keel_llm::Provider::Anthropic)),
        ],
    };
}

fn check_all(body: &[u8]) {
    DRIVERS.with(|d| check_with(d, body));
}

fn check_with(d: &Drivers, body: &[u8]) {
    check("script", &d.script, expected_script(body), body);
    check("record", &d.command, expected_record(body), body);
    for (kind, driver, client) in &d.models {
        let ours = driver.parse(body);
        let theirs = client.parse(body).map_err(|e| e.to_string());
        assert_eq!(ours, theirs, "{kind}: the driver and keel-llm disagree");
        if let Err(message) = ours {
            assert!(!message.trim().is_empty());
        }
    }
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
