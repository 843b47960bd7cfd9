//! The model drivers end to end, through the `keel` binary, against loopback fake model servers
//! started by each test (no network): an OpenAI-compatible server answering Chat Completions and
//! an Anthropic server answering Messages drive whole runs. The tests check what keel sends (the
//! model, the phase's tools with their JSON schemas, the system and user parts, the key in its
//! header and nowhere in `.keel/`), that tool calls are executed, usage and cost accounted, a 429
//! or 529 retried and the retry recorded, a 401 blocks the run with the provider's message (and a
//! resume with the right key goes on), malformed output is denied and shown to the model in the
//! next prompt without crashing, and `--driver`/`--model` overrides are recorded and used.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::Path;
use std::process::Output;

use common::{Fixture, of_kind, state};
use keel_test_support::model_server::{FakeServer, Reply, Request};
use serde_json::{Value, json};

/// The environment variable the contracts name as `secret:…`, and the key the tests put in it.
const KEY_VAR: &str = "KEEL_TEST_MODEL_KEY";
const KEY: &str = "sk-test-7f3a9c1e5b2d4086-DO-NOT-STORE";

// ---------------------------------------------------------------------------------------------
// The fake server (keel-test-support's) and its requests
// ---------------------------------------------------------------------------------------------

/// The user part of the prompt a request carries (OpenAI: the `user` message; Anthropic:
/// `messages[0]`).
fn user(request: &Request) -> String {
    let v = request.json();
    let messages = v["messages"].as_array().expect("messages");
    messages
        .iter()
        .find(|m| m["role"] == "user")
        .and_then(|m| m["content"].as_str())
        .expect("a user message with text content")
        .to_string()
}

// ---------------------------------------------------------------------------------------------
// Provider wire formats
// ---------------------------------------------------------------------------------------------

/// A Chat Completions answer with these tool calls (name, raw argument text) and usage, with
/// the extra fields a real server sends.
fn openai_calls(calls: &[(&str, &str)], usage: (u64, u64)) -> Reply {
    let tool_calls: Vec<Value> = calls
        .iter()
        .enumerate()
        .map(|(i, (name, arguments))| {
            json!({
                "id": format!("call_{i}"),
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            })
        })
        .collect();
    Reply::value(
        200,
        json!({
            "id": "chatcmpl-fake",
            "object": "chat.completion",
            "created": 1_700_000_000,
            "model": "whatever-the-server-says",
            "system_fingerprint": "fp_fake",
            "choices": [{
                "index": 0,
                "message": {"role": "assistant", "content": null, "tool_calls": tool_calls, "refusal": null},
                "logprobs": null,
                "finish_reason": "tool_calls",
            }],
            "usage": {
                "prompt_tokens": usage.0,
                "completion_tokens": usage.1,
                "total_tokens": usage.0 + usage.1,
                "prompt_tokens_details": {"cached_tokens": 0},
            },
        }),
    )
}

/// A Messages answer with a text block and these tool_use blocks (name, input) and usage.
fn anthropic_calls(calls: &[(&str, Value)], usage: (u64, u64)) -> Reply {
    let mut content = vec![json!({"type": "text", "text": "On it."})];
    for (i, (name, input)) in calls.iter().enumerate() {
        content.push(json!({
            "type": "tool_use",
            "id": format!("toolu_{i:02}"),
            "name": name,
            "input": input,
        }));
    }
    Reply::value(
        200,
        json!({
            "id": "msg_fake",
            "type": "message",
            "role": "assistant",
            "model": "whatever-the-server-says",
            "content": content,
            "stop_reason": "tool_use",
            "stop_sequence": null,
            "usage": {"input_tokens": usage.0, "output_tokens": usage.1},
        }),
    )
}

fn write_args(path: &str, content: &str) -> String {
    json!({"path": path, "content": content}).to_string()
}

fn finish_args() -> String {
    json!({"summary": "out/hello.txt says hello"}).to_string()
}

// ---------------------------------------------------------------------------------------------
// Contracts and helpers
// ---------------------------------------------------------------------------------------------

const TOOLS: [&str; 4] = ["read", "write", "plan", "finish"];
const OBJECTIVE: &str = "Write hello into out/hello.txt, then finish.";
const GOAL: &str = "out/hello.txt says hello.";

/// A contract whose one agent phase is driven by `driver` (the body of `[driver]`), with a
/// price of $2 / $10 per million input / output tokens.
fn contract(driver: &str) -> String {
    format!(
        r#"
[task]
goal = "{GOAL}"

[driver]
{driver}
api_key = "secret:{KEY_VAR}"
context_tokens = 6000
max_output_tokens = 512
timeout = "30s"
max_retries = 2
retry_backoff = "10ms"
input_usd_per_mtok = 2.0
output_usd_per_mtok = 10.0

[scope]
writable = ["out/**"]

[budget]
tokens = 100000
cost_usd = 1.0
steps = 20

[[verify]]
name = "hello"
tier = "acceptance"
run = "grep -qx hello out/hello.txt"

[[phase]]
name = "write"
kind = "agent"
objective = "{OBJECTIVE}"
tools = ["read", "write", "plan", "finish"]
"#
    )
}

fn openai_contract(server: &FakeServer) -> String {
    contract(&format!(
        "kind = \"openai\"\nmodel = \"acme-coder-1\"\nbase_url = \"{}/v1\"",
        server.url
    ))
}

fn anthropic_contract(server: &FakeServer) -> String {
    contract(&format!(
        "kind = \"anthropic\"\nmodel = \"acme-claude-1\"\nbase_url = \"{}\"",
        server.url
    ))
}

/// Runs `keel run keel.toml ARGS…` with the key in the environment; returns the run id (the
/// first line of output) and the output.
fn start(f: &Fixture, args: &[&str], key: &str) -> (String, Output) {
    let out = f
        .keel()
        .args(["run", "keel.toml"])
        .args(args)
        .env(KEY_VAR, key)
        .output()
        .expect("keel runs");
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    let id = stdout
        .lines()
        .next()
        .and_then(|l| l.strip_prefix("run "))
        .unwrap_or_else(|| panic!("keel run printed no id first\n{}", f.explain(&out)))
        .trim()
        .to_string();
    (id, out)
}

fn resume(f: &Fixture, id: &str, key: &str) -> Output {
    f.keel()
        .args(["resume", id])
        .env(KEY_VAR, key)
        .output()
        .expect("keel runs")
}

fn assert_exit(f: &Fixture, out: &Output, code: i32) {
    assert_eq!(
        out.status.code(),
        Some(code),
        "exit code\n{}",
        f.explain(out)
    );
}

fn artifact(f: &Fixture, hash: &str) -> Vec<u8> {
    f.artifact(hash)
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

/// Every file under `dir`, recursively.
fn files_under(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let path = entry.path();
        if path.is_dir() {
            out.extend(files_under(&path));
        } else {
            out.push(path);
        }
    }
    out
}

/// The key is nowhere in `.keel/` (database, its WAL, artifacts, anything else), byte for byte,
/// nor in what keel printed or in its log and status.
fn assert_key_not_stored(f: &Fixture, id: &str, outputs: &[&Output]) {
    let files = files_under(&f.path(".keel"));
    assert!(
        files.iter().any(|p| p.ends_with("keel.db")),
        "the store is under .keel: {files:?}"
    );
    for path in &files {
        let bytes = std::fs::read(path).unwrap();
        assert!(
            !contains(&bytes, KEY.as_bytes()),
            "the API key is stored in {}",
            path.display()
        );
    }
    let log = f.expect(&["log", id], 0);
    let log_json = f.expect(&["log", id, "--json"], 0);
    let status = f.expect(&["status", id, "--json"], 0);
    for out in outputs.iter().copied().chain([&log, &log_json, &status]) {
        assert!(!contains(&out.stdout, KEY.as_bytes()), "key printed");
        assert!(!contains(&out.stderr, KEY.as_bytes()), "key printed");
    }
}

fn budget_used(status: &Value, name: &str) -> u64 {
    status["budgets"][name]["used"]
        .as_u64()
        .unwrap_or_else(|| panic!("budget {name} in {status:#}"))
}

/// The names of the tools in an OpenAI request, checking each is a function with the built-in
/// tool's description and JSON schema.
fn openai_tools(body: &Value) -> Vec<String> {
    body["tools"]
        .as_array()
        .expect("tools")
        .iter()
        .map(|t| {
            assert_eq!(t["type"], "function", "{t}");
            let name = t["function"]["name"].as_str().unwrap();
            let spec = keel_core::tools::builtin(name).expect("a built-in tool");
            assert_eq!(
                t["function"]["parameters"], spec.parameters,
                "{name} schema"
            );
            assert_eq!(t["function"]["parameters"]["type"], "object");
            assert_eq!(t["function"]["description"], spec.description.as_str());
            name.to_string()
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// OpenAI-compatible
// ---------------------------------------------------------------------------------------------

#[test]
fn openai_driver_runs_a_task_to_completion_and_accounts_usage_and_cost() {
    let server = FakeServer::start(vec![
        openai_calls(
            &[("write", &write_args("out/hello.txt", "hello\n"))],
            (1200, 40),
        ),
        openai_calls(&[("finish", &finish_args())], (1300, 20)),
    ]);
    let f = Fixture::new(&openai_contract(&server));
    let (id, out) = start(&f, &[], KEY);
    assert_exit(&f, &out, 0);
    assert_eq!(
        std::fs::read_to_string(f.path("out/hello.txt")).unwrap(),
        "hello\n"
    );

    // What the server received.
    let requests = server.requests();
    assert_eq!(requests.len(), 2, "one request per step: {requests:#?}");
    let events = f.events(&id);
    let requested = of_kind(&events, "model_requested");
    assert_eq!(requested.len(), 2);
    for (i, (r, event)) in requests.iter().zip(&requested).enumerate() {
        assert_eq!(r.method, "POST");
        assert_eq!(r.path, "/v1/chat/completions");
        assert_eq!(
            r.header("authorization"),
            Some(format!("Bearer {KEY}").as_str())
        );
        assert_eq!(r.header("content-type"), Some("application/json"));
        let body = r.json();
        assert_eq!(body["model"], "acme-coder-1");
        assert_eq!(body["max_completion_tokens"], 512);
        assert_eq!(openai_tools(&body), TOOLS);
        let messages = body["messages"].as_array().unwrap();
        assert_eq!(messages.len(), 2, "a fresh prompt, not a transcript");
        assert_eq!(messages[0]["role"], "system");
        assert_eq!(
            messages[0]["content"].as_str().unwrap(),
            keel_core::context::HARNESS_RULES
        );
        assert_eq!(messages[1]["role"], "user");
        let user = user(r);
        assert!(user.contains(GOAL), "goal in the prompt: {user}");
        assert!(user.contains(OBJECTIVE), "objective in the prompt: {user}");
        assert!(
            user.contains("writable out/**"),
            "scope in the prompt: {user}"
        );
        // The exact bytes sent are the request artifact the event names.
        let hash = event["body"]["request"].as_str().unwrap();
        assert_eq!(artifact(&f, hash), r.body, "request {i} is stored as sent");
        assert!(event["body"]["prompt_tokens"].as_u64().unwrap() <= 6000);
        assert_eq!(event["body"]["context_tokens"], 6000);
    }
    // The second prompt shows what the first step did.
    let second = user(&requests[1]);
    assert!(
        second.contains("[step 1.1] write(") && second.contains("out/hello.txt"),
        "the write's observation is in the next prompt: {second}"
    );

    // Decisions and outcomes.
    let decisions = of_kind(&events, "policy_decision");
    assert_eq!(decisions.len(), 2);
    assert!(decisions.iter().all(|d| d["body"]["decision"] == "allow"));
    assert_eq!(decisions[0]["body"]["tool"], "write");
    let finished = of_kind(&events, "tool_call_finished");
    assert_eq!(finished.len(), 2);
    assert!(
        finished.iter().all(|e| e["body"]["ok"] == true),
        "{finished:#?}"
    );
    assert_eq!(finished[0]["body"]["changed"], json!(["out/hello.txt"]));
    assert_eq!(of_kind(&events, "finish_claimed").len(), 1);
    assert_eq!(of_kind(&events, "phase_verified").len(), 1);

    // Usage and cost: $2 and $10 per million tokens are 2 and 10 micro-dollars per token.
    let replied = of_kind(&events, "model_replied");
    assert_eq!(replied.len(), 2);
    assert_eq!(
        replied[0]["body"]["usage"],
        json!({"input_tokens": 1200, "output_tokens": 40})
    );
    assert_eq!(replied[0]["body"]["cost_micro_usd"], 1200 * 2 + 40 * 10);
    assert_eq!(replied[1]["body"]["cost_micro_usd"], 1300 * 2 + 20 * 10);
    assert_eq!(replied[0]["body"]["retries"], json!([]));
    let response = replied[0]["body"]["response"].as_str().unwrap();
    assert!(
        contains(&artifact(&f, response), b"chatcmpl-fake"),
        "the raw response is stored"
    );
    let status = f.status(&id);
    assert_eq!(state(&status), "completed");
    assert_eq!(budget_used(&status, "tokens"), 1200 + 40 + 1300 + 20);
    assert_eq!(
        budget_used(&status, "cost_usd"),
        1200 * 2 + 40 * 10 + 1300 * 2 + 20 * 10
    );
    assert_eq!(status["budgets"]["cost_usd"]["unit"], "micro_usd");
    assert_eq!(status["budgets"]["cost_usd"]["limit"], 1_000_000);
    assert_eq!(status["model_calls"], 2);
    assert_eq!(status["violations"], 0);

    // Readable log and status.
    let log = String::from_utf8(f.expect(&["log", &id], 0).stdout).unwrap();
    assert!(log.contains("1200 in + 40 out tokens"), "{log}");
    assert!(log.contains("write [reversible] ALLOW"), "{log}");
    let text = String::from_utf8(f.expect(&["status", &id], 0).stdout).unwrap();
    assert!(
        text.contains("2 model calls, 2560 tokens"),
        "status shows the driver's use: {text}"
    );

    assert_key_not_stored(&f, &id, &[&out]);
    f.verify_log_ok(&id);
}

#[test]
fn openai_rate_limit_is_retried_and_the_retry_is_recorded() {
    let server = FakeServer::start(vec![
        Reply::value(
            429,
            json!({"error": {"message": "Rate limit reached for acme-coder-1", "type": "requests", "code": "rate_limit_exceeded"}}),
        )
        .with_header("Retry-After", "0"),
        // Parallel tool calls: a write and the finish in one reply.
        openai_calls(
            &[
                ("write", &write_args("out/hello.txt", "hello\n")),
                ("finish", &finish_args()),
            ],
            (800, 30),
        ),
    ]);
    let f = Fixture::new(&openai_contract(&server));
    let (id, out) = start(&f, &[], KEY);
    assert_exit(&f, &out, 0);

    let requests = server.requests();
    assert_eq!(requests.len(), 2, "the 429 and the retry");
    assert_eq!(requests[0].body, requests[1].body, "the same request again");
    let events = f.events(&id);
    assert_eq!(of_kind(&events, "model_requested").len(), 1, "one step");
    let replied = of_kind(&events, "model_replied");
    assert_eq!(replied.len(), 1);
    let retries = replied[0]["body"]["retries"].as_array().unwrap();
    assert_eq!(retries.len(), 1, "{retries:?}");
    assert!(
        retries[0].as_str().unwrap().contains("429"),
        "the retry says why: {retries:?}"
    );
    let status = f.status(&id);
    assert_eq!(state(&status), "completed");
    assert_eq!(status["model_calls"], 1);
    assert_eq!(budget_used(&status, "tokens"), 830);
    assert_eq!(budget_used(&status, "cost_usd"), 800 * 2 + 30 * 10);
    let log = String::from_utf8(f.expect(&["log", &id], 0).stdout).unwrap();
    assert!(
        log.contains("1 retries (429"),
        "the log shows the retry: {log}"
    );
}

#[test]
fn openai_server_errors_until_retries_run_out_block_the_run() {
    let overloaded = || {
        Reply::value(
            503,
            json!({"error": {"message": "the engine is warming up"}}),
        )
        .with_header("Retry-After", "0")
    };
    let server = FakeServer::start(vec![overloaded(), overloaded(), overloaded()]);
    let f = Fixture::new(&openai_contract(&server));
    let (id, out) = start(&f, &[], KEY);
    assert_exit(&f, &out, 4);
    assert_eq!(
        server.requests().len(),
        3,
        "the first attempt and max_retries = 2"
    );
    let status = f.status(&id);
    assert_eq!(state(&status), "blocked");
    let reason = status["reason"].as_str().unwrap();
    assert!(
        reason.contains("3 attempt") && reason.contains("the engine is warming up"),
        "{reason}"
    );
    assert_eq!(status["block"]["cause"], "driver_failed");
    assert!(!f.path("out/hello.txt").exists());
}

#[test]
fn openai_bad_key_blocks_the_run_with_the_providers_message_and_resume_goes_on() {
    // The server echoes the key it was given, as some do: keel must not store it.
    let wrong = "sk-wrong-key-1234";
    let server = FakeServer::start(vec![
        Reply::value(
            401,
            json!({"error": {
                "message": format!("Incorrect API key provided: {KEY}. You can find your API key at https://example.invalid/keys."),
                "type": "invalid_request_error",
                "param": null,
                "code": "invalid_api_key",
            }}),
        ),
        openai_calls(
            &[("write", &write_args("out/hello.txt", "hello\n"))],
            (100, 10),
        ),
        openai_calls(&[("finish", &finish_args())], (100, 10)),
    ]);
    let f = Fixture::new(&openai_contract(&server));
    let (id, out) = start(&f, &[], KEY);
    assert_exit(&f, &out, 4);
    assert_eq!(server.requests().len(), 1, "a 401 is not retried");

    let status = f.status(&id);
    assert_eq!(state(&status), "blocked");
    let reason = status["reason"].as_str().unwrap();
    assert!(reason.contains("401"), "{reason}");
    assert!(
        reason.contains("Incorrect API key provided"),
        "the provider's message: {reason}"
    );
    assert!(
        reason.contains("Check the API key"),
        "advice on what to do: {reason}"
    );
    assert!(
        !reason.contains(KEY),
        "the echoed key is scrubbed: {reason}"
    );
    assert_eq!(status["block"]["cause"], "driver_failed");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("Incorrect API key provided"),
        "the person running keel sees why: {stdout}"
    );
    assert_key_not_stored(&f, &id, &[&out]);

    // With another key in the environment, a resume asks again and the run completes; the
    // key is read afresh when the run is resumed.
    let again = resume(&f, &id, wrong);
    assert_exit(&f, &again, 0);
    let requests = server.requests();
    assert_eq!(requests.len(), 3);
    assert_eq!(
        requests[1].header("authorization"),
        Some(format!("Bearer {wrong}").as_str())
    );
    assert_eq!(state(&f.status(&id)), "completed");
    assert_key_not_stored(&f, &id, &[&again]);
    f.verify_log_ok(&id);
}

#[test]
fn openai_malformed_tool_calls_are_denied_shown_to_the_model_and_the_run_goes_on() {
    let server = FakeServer::start(vec![
        // Arguments cut off mid-object: not JSON.
        openai_calls(
            &[("write", r#"{"path": "out/hello.txt", "content": "hel"#)],
            (100, 10),
        ),
        // A tool that does not exist.
        openai_calls(&[("deploy", r#"{"target": "prod"}"#)], (100, 10)),
        // Valid JSON that does not fit the schema: a number for a path, no content.
        openai_calls(&[("write", r#"{"path": 42}"#)], (100, 10)),
        // A 200 whose body is not a Chat Completions answer at all.
        Reply::json(200, "<html>gateway hiccup</html>"),
        openai_calls(
            &[
                ("write", &write_args("out/hello.txt", "hello\n")),
                ("finish", &finish_args()),
            ],
            (100, 10),
        ),
    ]);
    let f = Fixture::new(&openai_contract(&server));
    let (id, out) = start(&f, &[], KEY);
    assert_exit(&f, &out, 0);

    let events = f.events(&id);
    let decisions = of_kind(&events, "policy_decision");
    let denials: Vec<(&str, &str)> = decisions
        .iter()
        .filter(|d| d["body"]["decision"] == "deny")
        .map(|d| {
            (
                d["body"]["tool"].as_str().unwrap(),
                d["body"]["rule"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(denials.len(), 3, "{denials:#?}");
    assert_eq!(denials[0].0, "write");
    assert!(denials[0].1.contains("not valid JSON"), "{denials:?}");
    assert_eq!(denials[1].0, "deploy");
    assert!(
        denials[1].1.contains("there is no tool `deploy`"),
        "{denials:?}"
    );
    assert_eq!(denials[2].0, "write");
    assert!(
        denials[2].1.contains("arguments.path must be a string")
            && denials[2].1.contains("arguments.content is required"),
        "{denials:?}"
    );
    // Nothing denied ran.
    assert_eq!(of_kind(&events, "tool_call_finished").len(), 2);

    // Each denial is in the user message of the very next request.
    let requests = server.requests();
    assert_eq!(requests.len(), 5);
    let shown = [
        (1, "DENIED: the arguments are not valid JSON"),
        (2, "DENIED: there is no tool `deploy`"),
        (3, "DENIED: the arguments do not fit the tool"),
        (4, "keel could not read this reply"),
    ];
    for (i, text) in shown {
        let user = user(&requests[i]);
        assert!(user.contains(text), "request {i} shows {text:?}:\n{user}");
    }

    let status = f.status(&id);
    assert_eq!(state(&status), "completed");
    assert_eq!(status["violations"], 3);
    assert_eq!(status["model_calls"], 5);
    let log = String::from_utf8(f.expect(&["log", &id], 0).stdout).unwrap();
    assert!(
        log.contains("deploy [irreversible] DENY: there is no tool"),
        "{log}"
    );
    assert!(
        log.contains("no tool call: (keel could not read this reply"),
        "{log}"
    );
}

// ---------------------------------------------------------------------------------------------
// Anthropic
// ---------------------------------------------------------------------------------------------

#[test]
fn anthropic_driver_runs_a_task_with_tool_use_blocks_and_accounts_usage() {
    let server = FakeServer::start(vec![
        // Overloaded first: retried.
        Reply::value(
            529,
            json!({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}),
        )
        .with_header("retry-after", "0"),
        anthropic_calls(
            &[("write", json!({"path": "out/hello.txt", "content": "hello\n"}))],
            (900, 30),
        ),
        anthropic_calls(&[("finish", json!({"summary": "done"}))], (950, 15)),
    ]);
    let f = Fixture::new(&anthropic_contract(&server));
    let (id, out) = start(&f, &[], KEY);
    assert_exit(&f, &out, 0);
    assert_eq!(
        std::fs::read_to_string(f.path("out/hello.txt")).unwrap(),
        "hello\n"
    );

    let requests = server.requests();
    assert_eq!(requests.len(), 3);
    for r in &requests {
        assert_eq!(r.method, "POST");
        assert_eq!(r.path, "/v1/messages");
        assert_eq!(r.header("x-api-key"), Some(KEY));
        assert_eq!(r.header("authorization"), None, "Anthropic takes x-api-key");
        assert!(r.header("anthropic-version").is_some());
        let body = r.json();
        assert_eq!(body["model"], "acme-claude-1");
        assert_eq!(body["max_tokens"], 512);
        assert_eq!(
            body["system"].as_str().unwrap(),
            keel_core::context::HARNESS_RULES
        );
        let messages = body["messages"].as_array().unwrap();
        assert_eq!(messages.len(), 1, "a fresh prompt, not a transcript");
        assert!(user(r).contains(OBJECTIVE));
        let tools: Vec<&str> = body["tools"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| {
                let name = t["name"].as_str().unwrap();
                let spec = keel_core::tools::builtin(name).unwrap();
                assert_eq!(t["input_schema"], spec.parameters, "{name} schema");
                name
            })
            .collect();
        assert_eq!(tools, TOOLS);
    }
    assert_eq!(requests[0].body, requests[1].body, "the retry resends");
    assert!(user(&requests[2]).contains("[step 1.1] write("));

    let events = f.events(&id);
    let replied = of_kind(&events, "model_replied");
    assert_eq!(replied.len(), 2);
    let retries = replied[0]["body"]["retries"].as_array().unwrap();
    assert_eq!(retries.len(), 1);
    assert!(retries[0].as_str().unwrap().contains("529"), "{retries:?}");
    assert_eq!(replied[0]["body"]["reply"]["text"], "On it.");
    assert_eq!(replied[0]["body"]["reply"]["calls"][0]["id"], "toolu_00");
    let status = f.status(&id);
    assert_eq!(state(&status), "completed");
    assert_eq!(budget_used(&status, "tokens"), 900 + 30 + 950 + 15);
    assert_eq!(
        budget_used(&status, "cost_usd"),
        900 * 2 + 30 * 10 + 950 * 2 + 15 * 10
    );
    assert_eq!(status["model_calls"], 2);
    assert_key_not_stored(&f, &id, &[&out]);
    f.verify_log_ok(&id);
}

#[test]
fn anthropic_bad_key_blocks_the_run_with_the_providers_message() {
    let server = FakeServer::start(vec![Reply::value(
        401,
        json!({"type": "error", "error": {"type": "authentication_error", "message": "invalid x-api-key"}}),
    )]);
    let f = Fixture::new(&anthropic_contract(&server));
    let (id, out) = start(&f, &[], KEY);
    assert_exit(&f, &out, 4);
    assert_eq!(server.requests().len(), 1, "not retried");
    let status = f.status(&id);
    assert_eq!(state(&status), "blocked");
    let reason = status["reason"].as_str().unwrap();
    assert!(
        reason.contains("401") && reason.contains("invalid x-api-key"),
        "{reason}"
    );
    assert_eq!(status["model_calls"], 0);
    assert_eq!(budget_used(&status, "tokens"), 0);
    assert_key_not_stored(&f, &id, &[&out]);
}

// ---------------------------------------------------------------------------------------------
// Overrides
// ---------------------------------------------------------------------------------------------

/// A script-driven contract that also names a model and a server, so that `--driver` can point
/// the same phase at a model.
fn script_contract(server: &FakeServer) -> String {
    contract(&format!(
        "kind = \"script\"\nscript = \"actions.jsonl\"\nmodel = \"contract-model\"\nbase_url = \"{}/v1\"",
        server.url
    ))
}

const SCRIPT: &str = r#"{"tool": "write", "args": {"path": "out/hello.txt", "content": "hello\n"}}
{"tool": "finish", "args": {"summary": "scripted"}}
"#;

#[test]
fn driver_and_model_overrides_are_recorded_and_used_also_on_resume() {
    // As written, the contract replays its script and the server is never asked.
    let quiet = FakeServer::start(Vec::new());
    let f = Fixture::new(&script_contract(&quiet));
    std::fs::write(f.path("actions.jsonl"), SCRIPT).unwrap();
    let (id, out) = start(&f, &[], KEY);
    assert_exit(&f, &out, 0);
    assert!(quiet.requests().is_empty());
    let created = f.events(&id)[0].clone();
    assert_eq!(created["kind"], "run_created");
    assert!(created["body"].get("driver").is_none(), "{created:#}");

    // `--driver openai --model X`: the same phase against the server, with model X; the first
    // answer is a 401, so the run blocks, and a resume keeps the override.
    let server = FakeServer::start(vec![
        Reply::value(401, json!({"error": {"message": "no such key"}})),
        openai_calls(
            &[("write", &write_args("out/hello.txt", "hello\n"))],
            (50, 5),
        ),
        openai_calls(&[("finish", &finish_args())], (50, 5)),
    ]);
    let f = Fixture::new(&script_contract(&server));
    std::fs::write(f.path("actions.jsonl"), SCRIPT).unwrap();
    let (id, out) = start(
        &f,
        &["--driver", "openai", "--model", "override-model"],
        KEY,
    );
    assert_exit(&f, &out, 4);
    let created = f.events(&id)[0].clone();
    assert_eq!(
        created["body"]["driver"],
        json!({"kind": "openai", "model": "override-model"}),
        "the override is recorded with the run"
    );
    let again = resume(&f, &id, KEY);
    assert_exit(&f, &again, 0);
    let requests = server.requests();
    assert_eq!(requests.len(), 3);
    for r in &requests {
        assert_eq!(r.path, "/v1/chat/completions");
        assert_eq!(r.json()["model"], "override-model");
    }
    let status = f.status(&id);
    assert_eq!(state(&status), "completed");
    assert_eq!(budget_used(&status, "tokens"), 110);

    // `--driver anthropic` alone: the contract's model, Anthropic's wire format.
    let server = FakeServer::start(vec![anthropic_calls(
        &[
            (
                "write",
                json!({"path": "out/hello.txt", "content": "hello\n"}),
            ),
            ("finish", json!({"summary": "done"})),
        ],
        (70, 7),
    )]);
    let f = Fixture::new(&script_contract(&server));
    let (id, out) = start(&f, &["--driver", "anthropic"], KEY);
    assert_exit(&f, &out, 0);
    let requests = server.requests();
    assert_eq!(requests.len(), 1);
    assert_eq!(requests[0].path, "/v1/messages");
    assert_eq!(requests[0].json()["model"], "contract-model");
    assert_eq!(
        f.events(&id)[0]["body"]["driver"],
        json!({"kind": "anthropic", "model": null})
    );

    // `--driver script` on a script contract: recorded, and the script is what runs.
    let quiet = FakeServer::start(Vec::new());
    let f = Fixture::new(&script_contract(&quiet));
    std::fs::write(f.path("actions.jsonl"), SCRIPT).unwrap();
    let (id, out) = start(&f, &["--driver", "script"], KEY);
    assert_exit(&f, &out, 0);
    assert!(quiet.requests().is_empty());
    assert_eq!(
        f.events(&id)[0]["body"]["driver"],
        json!({"kind": "script", "model": null})
    );
}

#[test]
fn a_reply_that_exhausts_the_tokens_budget_blocks_after_a_whole_step_and_unblock_goes_on() {
    let server = FakeServer::start(vec![
        openai_calls(
            &[("write", &write_args("out/hello.txt", "hello\n"))],
            (99_000, 2_000),
        ),
        openai_calls(
            &[
                ("write", &write_args("out/hello.txt", "hello\n")),
                ("finish", &finish_args()),
            ],
            (500, 10),
        ),
    ]);
    let f = Fixture::new(&openai_contract(&server));
    let (id, out) = start(&f, &[], KEY);
    assert_exit(&f, &out, 4);
    assert_eq!(server.requests().len(), 1, "no call beyond the budget");
    // The reply that spent the budget is recorded whole, but its calls are checked against the
    // budget like any other: the write is denied.
    let denied = f
        .events(&id)
        .into_iter()
        .find(|e| e["kind"] == "policy_decision")
        .unwrap();
    assert_eq!(denied["body"]["decision"], "deny", "{denied:#}");
    assert!(
        denied["body"]["rule"]
            .as_str()
            .unwrap()
            .contains("budget `tokens` exhausted"),
        "{denied:#}"
    );
    assert!(!f.path("out/hello.txt").exists());
    let status = f.status(&id);
    assert_eq!(state(&status), "blocked");
    assert_eq!(status["block"]["cause"], "budget");
    assert_eq!(status["block"]["budget"], "tokens");
    assert_eq!(budget_used(&status, "tokens"), 101_000);
    let reason = status["reason"].as_str().unwrap();
    assert!(reason.contains("budget `tokens` exhausted"), "{reason}");
    // The step that overshot is recorded whole: its reply, its call, its verification.
    let events = f.events(&id);
    let kinds = common::kinds(&events);
    let blocked_at = kinds.iter().rposition(|k| k == "state_changed").unwrap();
    assert_eq!(kinds[blocked_at - 1], "step_verified", "{kinds:?}");
    assert_eq!(status["model_calls"], 1);

    let out = f
        .keel()
        .args([
            "unblock",
            &id,
            "--budget",
            "tokens=+10000",
            "--reason",
            "one more call",
        ])
        .env(KEY_VAR, KEY)
        .output()
        .unwrap();
    assert_exit(&f, &out, 0);
    assert_eq!(server.requests().len(), 2);
    let status = f.status(&id);
    assert_eq!(state(&status), "completed");
    assert_eq!(budget_used(&status, "tokens"), 101_510);
    assert_eq!(status["budgets"]["tokens"]["limit"], 110_000);
}

#[test]
fn a_server_that_never_answers_times_out_and_blocks_the_run() {
    let server = FakeServer::start(vec![Reply::Hang, Reply::Hang]);
    let c = openai_contract(&server)
        .replace("timeout = \"30s\"", "timeout = \"1s\"")
        .replace("max_retries = 2", "max_retries = 1");
    let f = Fixture::new(&c);
    let (id, out) = start(&f, &[], KEY);
    assert_exit(&f, &out, 4);
    assert_eq!(
        server.requests().len(),
        2,
        "the first attempt and one retry"
    );
    let status = f.status(&id);
    let reason = status["reason"].as_str().unwrap();
    assert!(
        reason.contains("2 attempt") && reason.contains("timeout"),
        "{reason}"
    );
    assert_eq!(status["model_calls"], 0);
}

#[test]
fn a_missing_secret_is_a_usage_error_before_any_run_exists() {
    let server = FakeServer::start(Vec::new());
    let f = Fixture::new(&openai_contract(&server));
    let out = f
        .keel()
        .args(["run", "keel.toml"])
        .env_remove(KEY_VAR)
        .output()
        .unwrap();
    assert_exit(&f, &out, 2);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains(KEY_VAR), "names the variable: {stderr}");
    assert!(server.requests().is_empty());
    let runs = f.expect(&["status", "--json"], 0);
    let runs: Value = serde_json::from_slice(&runs.stdout).unwrap();
    assert_eq!(runs, json!([]), "no run was created");
}

#[test]
fn the_api_key_never_reaches_a_command_the_model_runs() {
    let probe = r#"{"command": "printenv KEEL_TEST_MODEL_KEY; echo exit-of-printenv=$?"}"#;
    let server = FakeServer::start(vec![
        openai_calls(&[("run", probe)], (10, 1)),
        openai_calls(
            &[
                ("write", &write_args("out/hello.txt", "hello\n")),
                ("finish", &finish_args()),
            ],
            (10, 1),
        ),
    ]);
    let contract = openai_contract(&server).replace(
        r#"tools = ["read", "write", "plan", "finish"]"#,
        r#"tools = ["read", "write", "run", "plan", "finish"]"#,
    );
    assert!(contract.contains("\"run\""));
    let f = Fixture::new(&contract);
    let (id, out) = start(&f, &[], KEY);
    assert_exit(&f, &out, 0);
    let finished = f
        .events(&id)
        .into_iter()
        .find(|e| e["kind"] == "tool_call_finished")
        .unwrap();
    let observation = finished["body"]["observation"].as_str().unwrap();
    assert!(observation.contains("exit-of-printenv=1"), "{observation}");
    assert!(!observation.contains(KEY));
    assert_key_not_stored(&f, &id, &[&out]);
}

/// Against a model that costs money, the request is stored before it is sent, and a step of
/// keel's own read-only tools waits to be stored with the next step's request: a run of `N`
/// steps makes `N + 3` commits (the run's creation; its start, first checkpoint and first
/// request; one per step after the first, each with the next request; the last step's end
/// before the acceptance verifier runs; its evidence, the phase's verification, the checkpoint
/// and the completion, with the lease given back). Every step is in the log in order, and each
/// reply is stored.
#[test]
fn a_read_only_step_against_a_paid_model_is_stored_with_the_next_request() {
    let plan = |item: &str| json!({"items": [item]}).to_string();
    let steps = ["first", "second", "third"];
    let mut replies: Vec<Reply> = steps
        .iter()
        .map(|item| openai_calls(&[("plan", &plan(item))], (1000, 10)))
        .collect();
    replies.push(openai_calls(&[("finish", &finish_args())], (1000, 10)));
    let server = FakeServer::start(replies);
    let f = Fixture::new(
        &openai_contract(&server)
            .replace("run = \"grep -qx hello out/hello.txt\"", "run = \"true\""),
    );
    let trace = f.path("commits-trace");
    let out = f
        .keel()
        .args(["run", "keel.toml"])
        .env(KEY_VAR, KEY)
        .env("KEEL_STORE_FAULT_TRACE", &trace)
        .output()
        .unwrap();
    assert_exit(&f, &out, 0);
    let id = f.stored_run_id().unwrap();
    let model_steps = steps.len() + 1;
    assert_eq!(server.requests().len(), model_steps);
    assert_eq!(common::traced(&trace, "commit"), model_steps + 3);
    let events = f.events(&id);
    assert_eq!(of_kind(&events, "model_replied").len(), model_steps);
    let kinds: Vec<&str> = events.iter().map(|e| e["kind"].as_str().unwrap()).collect();
    let requested: Vec<usize> = (0..kinds.len())
        .filter(|&i| kinds[i] == "model_requested")
        .collect();
    let replied: Vec<usize> = (0..kinds.len())
        .filter(|&i| kinds[i] == "model_replied")
        .collect();
    for (r, p) in requested.iter().zip(&replied) {
        assert!(r < p, "each reply follows its request: {kinds:?}");
    }
    f.verify_log_ok(&id);
}
