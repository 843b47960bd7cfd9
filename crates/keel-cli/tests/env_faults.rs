//! Environment and dependency faults:
//!
//! - drift between a crash in the middle of a step and the resume (HEAD, a tracked file, the
//!   lockfile and a fingerprint command's output, all at once): the interrupted step is rolled
//!   back, the run is blocked naming every change, and a migration completes it;
//! - a person's edit between keel's death in the middle of a command and the resume: only the
//!   command's own write is undone (it came before the command's noted end), the edit is kept
//!   and reported as drift, and a migration completes the run on the person's tree; without an
//!   edit the command's write is undone and the run completes by itself;
//! - a contract tool that times out: the observation says so and the run goes on; a tool that
//!   times out every time ends as `same_error` says;
//! - a model API failing for a window (500/429): a short window is retried within the retry
//!   budget and the run completes with the retries recorded; a long one blocks the run with the
//!   provider's message (each resume inside the window blocks again), then `same_error` keeps
//!   it blocked until a person raises it, after which it completes. No budget limit changes
//!   without a logged human event.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::os::unix::process::ExitStatusExt;
use std::sync::{Arc, Mutex};

use common::{Fixture, fault_points, git, kinds, of_kind, state, stdout};
use serde_json::{Value, json};

// ---------------------------------------------------------------------------------------------
// Drift after a crash in the middle of a step
// ---------------------------------------------------------------------------------------------

fn mid_step_contract(tool: &std::path::Path) -> String {
    format!(
        r#"
[task]
goal = "Write the letters a to c into marker.txt."

[workspace]
fingerprint = ["cat {}"]

[[verify]]
name = "letters"
tier = "acceptance"
run = "test -s marker.txt"

[[phase]]
name = "one"
kind = "command"
run = ["echo a >> marker.txt", "echo b >> marker.txt; sleep 1; echo b2 >> marker.txt", "echo c >> marker.txt"]
"#,
        tool.display()
    )
}

/// A run killed while its second step's command runs (after its first write, before its
/// second). Returns the fixture, the run id and the fingerprinted tool-version file.
fn killed_mid_step(outside: &std::path::Path) -> (Fixture, String, std::path::PathBuf) {
    let tool = outside.join("tool-version");
    std::fs::write(&tool, "tool 1.0\n").unwrap();
    let contract = mid_step_contract(&tool);
    let points = fault_points(&contract);
    let running = points
        .iter()
        .enumerate()
        .filter(|(_, p)| *p == "command running")
        .nth(1)
        .map(|(i, _)| i as u64 + 1)
        .unwrap();
    let f = Fixture::new(&contract);
    let (id, out) = f.start(&[("KEEL_CRASH_AT", running.to_string())]);
    assert_eq!(out.status.signal(), Some(9), "{}", f.explain(&out));
    (f, id, tool)
}

#[test]
fn drift_after_a_crash_mid_step_blocks_naming_every_change_and_migrate_completes() {
    let outside = tempfile::tempdir().unwrap();
    let (f, id, tool) = killed_mid_step(outside.path());
    // Meanwhile: a commit and a new tool version.
    git(
        f.root(),
        &["commit", "-q", "--allow-empty", "-m", "meanwhile"],
    );
    std::fs::write(&tool, "tool 2.0\n").unwrap();

    let out = f.expect(&["resume", &id], 4);
    let printed = stdout(&out);
    let status = f.status(&id);
    assert_eq!(state(&status), "blocked");
    let reason = status["reason"].as_str().unwrap();
    for named in ["HEAD changed", "tool 1.0 -> tool 2.0"] {
        assert!(
            printed.contains(named) && reason.contains(named),
            "`{named}` is named\n{}",
            f.explain(&out)
        );
    }
    let events = f.events(&id);
    let rolled = events.iter().position(|e| e["kind"] == "step_rolled_back");
    let drift = events.iter().position(|e| e["kind"] == "drift_detected");
    assert!(
        rolled.is_some() && drift.is_some() && rolled < drift,
        "the interrupted step is rolled back, then the environment compared: {:?}",
        kinds(&events)
    );
    assert!(
        !std::fs::read_to_string(f.path("marker.txt"))
            .unwrap_or_default()
            .contains('b'),
        "the interrupted step's partial write was undone"
    );
    let started = of_kind(&events, "step_started").len();
    f.expect(&["resume", &id], 4);
    assert_eq!(of_kind(&f.events(&id), "step_started").len(), started);

    f.expect(
        &[
            "resume",
            &id,
            "--migrate",
            "--reason",
            "the upgrade was planned",
        ],
        0,
    );
    assert_eq!(state(&f.status(&id)), "completed");
    assert_eq!(
        std::fs::read_to_string(f.path("marker.txt")).unwrap(),
        "a\nb\nb2\nc\n"
    );
    let events = f.events(&id);
    assert_eq!(of_kind(&events, "migrated").len(), 1);
    assert_eq!(of_kind(&events, "step_verified").len(), 3, "each step once");
    f.verify_log_ok(&id);
}

/// keel killed while the second step's command sleeps between its two writes: the command is
/// surely running (its first write is there), unlike at the `command running` fault point,
/// which may come before the sandbox has started it. Waits until the command has noted its end
/// (the sandbox ends it when keel dies), as a person coming to the machine after a crash would
/// find it. Returns the fixture, the run id, the end file and the directory of the
/// fingerprinted tool-version file.
fn killed_while_the_command_runs() -> (Fixture, String, std::path::PathBuf, tempfile::TempDir) {
    let outside = tempfile::tempdir().unwrap();
    let tool = outside.path().join("tool-version");
    std::fs::write(&tool, "tool 1.0\n").unwrap();
    let f = Fixture::new(&mid_step_contract(&tool));
    let (id, ended) = kill_once(&f, "marker.txt", "a\nb\n");
    (f, id, ended, outside)
}

/// Starts the run of `f`, kills keel with SIGKILL once `file` holds `content`, and waits for
/// the killed command to note its end. Returns the run id and the end file.
fn kill_once(f: &Fixture, file: &str, content: &str) -> (String, std::path::PathBuf) {
    let mut child = f
        .keel()
        .args(["run", "keel.toml"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while std::fs::read_to_string(f.path(file)).unwrap_or_default() != content {
        assert!(
            std::time::Instant::now() < deadline,
            "{file} never held {content:?}"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let mut printed = String::new();
    child
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut printed)
        .unwrap();
    let id = printed
        .lines()
        .next()
        .and_then(|l| l.strip_prefix("run "))
        .unwrap_or_else(|| panic!("no run id in {printed:?}"))
        .trim()
        .to_string();
    let ended = f.path(&format!(".keel/tmp/{id}.ended"));
    while !ended.exists() {
        assert!(
            std::time::Instant::now() < deadline,
            "the killed command never noted its end at {}",
            ended.display()
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    (id, ended)
}

/// Writes `content` to `path` so that its change time is later than `ended`'s (the file
/// system's clock is coarse: a write in the same tick would not be later).
fn edit_after(path: &std::path::Path, content: &str, ended: &std::path::Path) {
    use std::os::unix::fs::MetadataExt;
    let end = std::fs::metadata(ended).unwrap();
    let end = (end.mtime(), end.mtime_nsec());
    loop {
        std::fs::write(path, content).unwrap();
        let now = std::fs::metadata(path).unwrap();
        if (now.ctime(), now.ctime_nsec()) > end {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

#[test]
fn a_persons_edit_after_a_crash_mid_step_is_reported_not_undone() {
    let (f, id, ended, _outside) = killed_while_the_command_runs();
    edit_after(&f.path("README.md"), "edited by a person\n", &ended);
    edit_after(&f.path("Cargo.lock"), "# lock v2\n", &ended);
    let out = f.run(&["resume", &id]);
    assert_eq!(
        std::fs::read_to_string(f.path("README.md")).unwrap(),
        "edited by a person\n",
        "the person's edit is kept\n{}",
        f.explain(&out)
    );
    assert_eq!(
        std::fs::read_to_string(f.path("Cargo.lock")).unwrap(),
        "# lock v2\n"
    );
    assert_eq!(
        std::fs::read_to_string(f.path("marker.txt")).unwrap(),
        "a\n",
        "the interrupted command's own write is undone\n{}",
        f.explain(&out)
    );
    assert_eq!(out.status.code(), Some(4), "{}", f.explain(&out));
    for named in ["M README.md", "lockfile Cargo.lock changed"] {
        assert!(
            stdout(&out).contains(named),
            "`{named}` is named\n{}",
            f.explain(&out)
        );
    }
    let events = f.events(&id);
    let rolled = of_kind(&events, "step_rolled_back");
    assert_eq!(rolled.len(), 1, "{:?}", kinds(&events));
    assert_eq!(
        rolled[0]["body"]["restored"],
        json!(["marker.txt"]),
        "{:?}",
        rolled[0]
    );
    // The tree as it was found is kept, the person's edits with the command's write.
    let saved = rolled[0]["body"]["saved_ref"].as_str().unwrap();
    assert_eq!(
        git(f.root(), &["show", &format!("{saved}:marker.txt")]),
        "a\nb"
    );
    assert_eq!(
        git(f.root(), &["show", &format!("{saved}:README.md")]),
        "edited by a person"
    );
    // The person accepts what they did; the step runs again on their tree.
    f.expect(
        &["resume", &id, "--migrate", "--reason", "my edits are meant"],
        0,
    );
    assert_eq!(state(&f.status(&id)), "completed");
    assert_eq!(
        std::fs::read_to_string(f.path("marker.txt")).unwrap(),
        "a\nb\nb2\nc\n"
    );
    assert_eq!(
        std::fs::read_to_string(f.path("README.md")).unwrap(),
        "edited by a person\n"
    );
    f.verify_log_ok(&id);
}

/// Without a person: the command's own writes are all undone and the run goes on by itself.
#[test]
fn a_crash_while_a_command_runs_is_undone_whole_when_nobody_touched_the_tree() {
    let (f, id, ended, _outside) = killed_while_the_command_runs();
    f.expect(&["resume", &id], 0);
    assert_eq!(state(&f.status(&id)), "completed");
    assert!(!ended.exists(), "a finished run's end file is removed");
    assert_eq!(
        std::fs::read_to_string(f.path("marker.txt")).unwrap(),
        "a\nb\nb2\nc\n"
    );
    let events = f.events(&id);
    let rolled = of_kind(&events, "step_rolled_back");
    assert_eq!(
        rolled[0]["body"]["restored"],
        json!(["marker.txt"]),
        "{:?}",
        rolled[0]
    );
    assert!(
        of_kind(&events, "drift_detected").is_empty(),
        "{:?}",
        kinds(&events)
    );
    f.verify_log_ok(&id);
}

// ---------------------------------------------------------------------------------------------
// A tool that times out
// ---------------------------------------------------------------------------------------------

fn tool_contract(script: &str, same_error: u32) -> String {
    format!(
        r#"
[task]
goal = "done.txt exists"

[driver]
kind = "script"
script = "{script}"

[budget]
same_error = {same_error}

[scope]
writable = ["done.txt"]

[[verify]]
name = "done"
tier = "acceptance"
run = "test -f done.txt"

[[phase]]
name = "work"
kind = "agent"
objective = "Ask the slow service, then write done.txt."
tools = ["slow", "write", "finish"]

[[tool]]
name = "slow"
description = "A service that does not answer in time."
run = ["sleep", "30"]
reversibility = "read_only"
timeout = "1s"
"#
    )
}

fn line(v: Value) -> String {
    format!("{v}\n")
}

#[test]
fn a_tool_that_times_out_is_observed_as_such_and_the_run_goes_on() {
    let outside = tempfile::tempdir().unwrap();
    let script = outside.path().join("actions.jsonl");
    std::fs::write(
        &script,
        [
            line(json!({"tool": "slow", "args": {}})),
            line(json!({"calls": [
                {"tool": "write", "args": {"path": "done.txt", "content": "ok\n"}},
                {"tool": "finish", "args": {"summary": "done"}},
            ]})),
        ]
        .concat(),
    )
    .unwrap();
    let f = Fixture::new(&tool_contract(&script.display().to_string(), 3));
    let (id, out) = f.start(&[]);
    assert_eq!(out.status.code(), Some(0), "{}", f.explain(&out));
    let events = f.events(&id);
    let finished = of_kind(&events, "tool_call_finished");
    let slow = finished[0];
    assert_eq!(slow["body"]["ok"], false);
    let observation = slow["body"]["observation"].as_str().unwrap();
    assert!(
        observation.contains("timed out after 1s"),
        "the observation says the call timed out: {observation}"
    );
    assert_eq!(state(&f.status(&id)), "completed");
    f.verify_log_ok(&id);
}

#[test]
fn a_tool_that_times_out_every_time_ends_as_same_error_says() {
    let outside = tempfile::tempdir().unwrap();
    let script = outside.path().join("actions.jsonl");
    std::fs::write(&script, line(json!({"tool": "slow", "args": {}})).repeat(4)).unwrap();
    let f = Fixture::new(&tool_contract(&script.display().to_string(), 2));
    let (id, out) = f.start(&[]);
    assert_eq!(out.status.code(), Some(4), "{}", f.explain(&out));
    let status = f.status(&id);
    assert_eq!(state(&status), "blocked");
    let reason = status["reason"].as_str().unwrap();
    assert!(reason.contains("same_error"), "{reason}");
    let events = f.events(&id);
    let timed_out = of_kind(&events, "tool_call_finished")
        .iter()
        .filter(|e| {
            e["body"]["observation"]
                .as_str()
                .unwrap_or("")
                .contains("timed out")
        })
        .count();
    assert_eq!(timed_out, 2, "blocked after the second identical failure");
    f.verify_log_ok(&id);
}

// ---------------------------------------------------------------------------------------------
// A model API failing for a window
// ---------------------------------------------------------------------------------------------

const KEY_VAR: &str = "KEEL_TEST_MODEL_KEY";

/// A loopback OpenAI-compatible server that fails the first `failures` requests with the given
/// status and answers every later one with the next reply in `replies`.
struct Flaky {
    url: String,
    requests: Arc<Mutex<u32>>,
}

impl Flaky {
    fn start(failures: Vec<u16>, replies: Vec<Value>) -> Flaky {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let requests = Arc::new(Mutex::new(0));
        let count = Arc::clone(&requests);
        std::thread::spawn(move || {
            let mut failures = failures.into_iter();
            let mut replies = replies.into_iter();
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { continue };
                let mut reader = BufReader::new(stream.try_clone().unwrap());
                let mut length = 0usize;
                loop {
                    let mut l = String::new();
                    if reader.read_line(&mut l).unwrap_or(0) == 0 {
                        break;
                    }
                    let l = l.trim_end().to_ascii_lowercase();
                    if l.is_empty() {
                        break;
                    }
                    if let Some(v) = l.strip_prefix("content-length:") {
                        length = v.trim().parse().unwrap_or(0);
                    }
                }
                let mut body = vec![0; length];
                let _ = reader.read_exact(&mut body);
                *count.lock().unwrap() += 1;
                let (status, text) = match failures.next() {
                    Some(s) => (
                        s,
                        json!({"error": {"message": format!("the provider is down ({s})")}})
                            .to_string(),
                    ),
                    None => match replies.next() {
                        Some(r) => (200, r.to_string()),
                        None => (418, r#"{"error":{"message":"no reply left"}}"#.to_string()),
                    },
                };
                let head = format!(
                    "HTTP/1.1 {status} Fake\r\nContent-Type: application/json\r\nContent-Length: {}\r\nRetry-After: 0\r\nConnection: close\r\n\r\n",
                    text.len()
                );
                let _ = stream.write_all(head.as_bytes());
                let _ = stream.write_all(text.as_bytes());
            }
        });
        Flaky { url, requests }
    }

    fn requests(&self) -> u32 {
        *self.requests.lock().unwrap()
    }
}

fn reply(calls: &[(&str, Value)]) -> Value {
    let tool_calls: Vec<Value> = calls
        .iter()
        .enumerate()
        .map(|(i, (name, args))| {
            json!({"id": format!("call_{i}"), "type": "function",
                   "function": {"name": name, "arguments": args.to_string()}})
        })
        .collect();
    json!({
        "id": "chatcmpl-fake", "object": "chat.completion", "created": 1_700_000_000,
        "model": "acme",
        "choices": [{"index": 0, "finish_reason": "tool_calls",
                     "message": {"role": "assistant", "content": null, "tool_calls": tool_calls}}],
        "usage": {"prompt_tokens": 100, "completion_tokens": 10, "total_tokens": 110},
    })
}

fn model_contract(url: &str) -> String {
    format!(
        r#"
[task]
goal = "out.txt says hello."

[driver]
kind = "openai"
model = "acme-coder-1"
base_url = "{url}/v1"
api_key = "secret:{KEY_VAR}"
timeout = "30s"
max_retries = 3
retry_backoff = "10ms"

[scope]
writable = ["out.txt"]

[budget]
tokens = 100000
steps = 20
same_error = 2

[[verify]]
name = "hello"
tier = "acceptance"
run = "grep -qx hello out.txt"

[[phase]]
name = "write"
kind = "agent"
objective = "Write hello into out.txt, then finish."
tools = ["write", "finish"]
"#
    )
}

fn success() -> Value {
    reply(&[
        ("write", json!({"path": "out.txt", "content": "hello\n"})),
        ("finish", json!({"summary": "wrote it"})),
    ])
}

/// The limits the run was created with, and that every change of them is a logged human event.
fn limits_only_change_by_people(f: &Fixture, id: &str) {
    let events = f.events(id);
    let created = &events[0]["body"]["limits"];
    let status = f.status(id);
    let raised = of_kind(&events, "budget_raised");
    assert!(raised.is_empty(), "no raise was asked for: {raised:?}");
    for (name, limit) in created.as_object().unwrap() {
        assert_eq!(
            status["budgets"][name]["limit"], *limit,
            "the {name} limit changed without a logged human event"
        );
    }
}

fn keel_with_key(f: &Fixture, args: &[&str]) -> std::process::Output {
    f.keel()
        .args(args)
        .env(KEY_VAR, "sk-test-window")
        .output()
        .unwrap()
}

#[test]
fn a_short_model_api_outage_is_retried_within_the_budget_and_recorded() {
    let server = Flaky::start(vec![500, 429, 503], vec![success()]);
    let f = Fixture::new(&model_contract(&server.url));
    let out = keel_with_key(&f, &["run", "keel.toml"]);
    assert_eq!(out.status.code(), Some(0), "{}", f.explain(&out));
    let id = stdout(&out)
        .lines()
        .next()
        .unwrap()
        .trim_start_matches("run ")
        .to_string();
    assert_eq!(server.requests(), 4, "three failures and the answer");
    let events = f.events(&id);
    let replied = of_kind(&events, "model_replied");
    assert_eq!(replied.len(), 1);
    let retries = replied[0]["body"]["retries"].as_array().unwrap();
    assert_eq!(retries.len(), 3, "{retries:?}");
    for (r, code) in retries.iter().zip(["500", "429", "503"]) {
        assert!(r.as_str().unwrap().contains(code), "{retries:?}");
    }
    assert_eq!(state(&f.status(&id)), "completed");
    limits_only_change_by_people(&f, &id);
    f.verify_log_ok(&id);
}

#[test]
fn a_long_model_api_outage_blocks_with_the_providers_message_and_resume_completes_after_it() {
    // Each attempt is the first try and three retries: eight failures cover two attempts.
    let server = Flaky::start(vec![500; 8], vec![success()]);
    let f = Fixture::new(&model_contract(&server.url));
    let out = keel_with_key(&f, &["run", "keel.toml"]);
    assert_eq!(out.status.code(), Some(4), "{}", f.explain(&out));
    let id = stdout(&out)
        .lines()
        .next()
        .unwrap()
        .trim_start_matches("run ")
        .to_string();
    assert_eq!(server.requests(), 4, "the first try and max_retries = 3");
    let status = f.status(&id);
    assert_eq!(state(&status), "blocked");
    let reason = status["reason"].as_str().unwrap();
    assert!(reason.contains("the provider is down (500)"), "{reason}");
    limits_only_change_by_people(&f, &id);

    // Still down: blocked again by the retry limit, with the provider's message, nothing raised.
    let out = keel_with_key(&f, &["resume", &id]);
    assert_eq!(out.status.code(), Some(4), "{}", f.explain(&out));
    assert_eq!(server.requests(), 8);
    let status = f.status(&id);
    assert_eq!(status["block"]["cause"], "driver_failed", "{status:#}");
    assert!(
        status["reason"]
            .as_str()
            .unwrap()
            .contains("the provider is down (500)"),
        "{status:#}"
    );
    limits_only_change_by_people(&f, &id);

    // The window is over, but the run has seen the same error twice: `same_error = 2` says
    // stop, and the run stays blocked without asking the provider again.
    let out = keel_with_key(&f, &["resume", &id]);
    assert_eq!(out.status.code(), Some(4), "{}", f.explain(&out));
    assert_eq!(server.requests(), 8, "no request once the budget is spent");
    assert!(stdout(&out).contains("same_error"), "{}", f.explain(&out));
    limits_only_change_by_people(&f, &id);

    // A person raises `same_error` (a logged event) and the run completes.
    let out = f
        .keel()
        .args([
            "unblock",
            &id,
            "--budget",
            "same_error=+1",
            "--reason",
            "the provider is back",
        ])
        .env(KEY_VAR, "sk-test-window")
        .env("KEEL_USER", "alice")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", f.explain(&out));
    assert_eq!(state(&f.status(&id)), "completed");
    assert_eq!(
        std::fs::read_to_string(f.path("out.txt")).unwrap(),
        "hello\n"
    );
    let events = f.events(&id);
    let raised = of_kind(&events, "budget_raised");
    assert_eq!(raised.len(), 1, "{raised:?}");
    assert_eq!(raised[0]["body"]["by"], "alice");
    let created = &events[0]["body"]["limits"];
    let status = f.status(&id);
    for (name, limit) in created.as_object().unwrap() {
        let now = &status["budgets"][name]["limit"];
        if name == "same_error" {
            assert_eq!(now.as_u64(), Some(limit.as_u64().unwrap() + 1));
        } else {
            assert_eq!(now, limit, "{name} changed without a logged human event");
        }
    }
    f.verify_log_ok(&id);
}
