//! keel's driver parsers' oracle: what each driver's `parse` must do with whatever it reads: a
//! line of a script (`ScriptDriver`), the record of a delegated program (`CommandDriver`), and a
//! model server's answer through the model drivers that `make_driver` builds for `openai` and
//! `anthropic` contracts. Shared by keel-engine's property tests (`tests/fuzz_drivers.rs`) and
//! the coverage-guided fuzz target `drivers` (`fuzz/`):
//! - a script line or a record is accepted exactly when it is one (restated plainly below), and
//!   gives exactly the calls, text and usage it says; nothing in it is dropped without a word;
//! - the model drivers parse exactly as keel-llm's client does;
//! - a refusal says why.
//!
//! Each check panics with what it found, as a test's assertion does.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;

use keel_core::agent::{ModelReply, ToolCall, Usage};
use keel_core::contract::Contract;
use keel_engine::DriverOverride;
use keel_engine::driver::{CommandDriver, Driver, ScriptDriver};
use serde_json::{Value, json};

use super::json::Ordered;

/// A script driver over an empty script: its `parse` reads one line given to it.
pub fn script_driver() -> ScriptDriver {
    let file = tempfile::NamedTempFile::new().unwrap();
    ScriptDriver::load(file.path()).unwrap()
}

/// The driver `make_driver` builds for a contract with a model driver of `kind` (`openai`,
/// `anthropic`); its server is never reached.
pub fn model_driver(kind: &str) -> Box<dyn Driver> {
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
    // Only now: a key keel does not know is refused however often it is written.
    if repeats_a_field(body) {
        return Expect::Either;
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

/// Whether a key is written twice in an object a script line's parse reads as a struct: the
/// action, one of its calls, its usage. serde refuses that, but not always by saying so: it reads
/// the first value before it sees the second key, and a first value of the wrong type is what
/// it reports. A `Value` keeps only the last, so the restatement above cannot see it.
fn repeats_a_field(body: &[u8]) -> bool {
    let Some(action) = Ordered::parse(body) else {
        return false;
    };
    let Ordered::Object(entries) = &action else {
        return false;
    };
    action.repeats_a_key()
        || entries.iter().any(|(k, v)| match (k.as_str(), v) {
            ("calls", Ordered::Array(calls)) => calls.iter().any(Ordered::repeats_a_key),
            ("usage", usage) => usage.repeats_a_key(),
            _ => false,
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
            panic!("{what}: refused a valid one ({message}): {}", shown())
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

/// Holds `body` to every driver's promises: the script's, the delegated program's, and each
/// model driver's.
pub fn check_all(body: &[u8]) {
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
