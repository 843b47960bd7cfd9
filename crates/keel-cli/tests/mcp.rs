//! MCP servers declared in the contract as agent tools, through the real `keel` binary: a
//! scripted run calls the tools of keel-test-support's fixture server (`keel-mcp-fixture` over
//! stdio, and the same server over streamable HTTP) as `fixture.echo`, `fixture.record`, … .
//! `record` appends a line to a log file, so the log says how often it really ran: once, even
//! when keel is killed around the call and the run resumed; never before a person approves it
//! when the server needs approval; never when the phase does not list the tool.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::{Path, PathBuf};
use std::process::Output;

use common::{Fixture, kinds, of_kind, state};
use serde_json::{Value, json};

/// The MCP fixture server's binary (see `keel_test_support::mcp::fixture_binary`).
fn fixture_bin() -> std::path::PathBuf {
    keel_test_support::mcp::fixture_binary().unwrap()
}

fn lines(path: &Path) -> usize {
    std::fs::read_to_string(path)
        .map(|t| t.lines().count())
        .unwrap_or(0)
}

/// A scripted run against an MCP server: the script, the log `record` appends to, and the
/// workspace with its contract.
struct Scenario {
    fx: Fixture,
    log: PathBuf,
    _outside: tempfile::TempDir,
}

impl Scenario {
    /// `server` is the `[[mcp]]` table's keys after `name = "fixture"`; `tools` the phase's
    /// tool list; `script` the driver's actions.
    fn new(server: &str, tools: &str, script: &[Value]) -> Scenario {
        let outside = tempfile::tempdir().unwrap();
        let path = outside.path().join("script.jsonl");
        let text: Vec<String> = script.iter().map(|l| l.to_string()).collect();
        std::fs::write(&path, text.join("\n") + "\n").unwrap();
        let contract = format!(
            r#"
[task]
goal = "Entries are recorded through the fixture server."

[driver]
kind = "script"
script = "{script}"

[budget]
steps = 20

[[verify]]
name = "present"
tier = "acceptance"
run = "test -f README.md"

[[phase]]
name = "record"
kind = "agent"
objective = "Record the entry."
tools = {tools}
done_when = []

[[mcp]]
name = "fixture"
{server}
"#,
            script = path.display(),
        );
        Scenario {
            fx: Fixture::new(&contract),
            log: outside.path().join("record.log"),
            _outside: outside,
        }
    }

    /// The stdio fixture; `record` logs to the file keel's environment names, passed on by the
    /// contract's `env`. `echo` is declared read-only.
    fn stdio(extra: &str, tools: &str, script: &[Value]) -> Scenario {
        Scenario::new(
            &format!(
                "command = [{:?}]\nenv = [\"KEEL_MCP_FIXTURE_LOG\"]\nread_only = [\"echo\"]\n{extra}",
                fixture_bin().display().to_string()
            ),
            tools,
            script,
        )
    }

    fn env(&self) -> Vec<(&'static str, String)> {
        vec![("KEEL_MCP_FIXTURE_LOG", self.log.display().to_string())]
    }

    fn start(&self, more: &[(&'static str, String)]) -> (String, Output) {
        let mut env = self.env();
        env.extend(more.iter().cloned());
        self.fx.start(&env)
    }

    fn keel(&self, args: &[&str]) -> Output {
        let mut cmd = self.fx.keel();
        cmd.args(args);
        for (k, v) in self.env() {
            cmd.env(k, v);
        }
        cmd.output().unwrap()
    }

    fn expect(&self, args: &[&str], code: i32) -> Output {
        self.fx.expect_exit(self.keel(args), args, code)
    }

    fn effects(&self, id: &str) -> Vec<Value> {
        let out = self.fx.expect(&["effects", id, "--json"], 0);
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        v.as_array().unwrap().clone()
    }

    fn run_id(&self) -> String {
        self.fx
            .db()
            .query_row("SELECT id FROM runs", [], |r| r.get(0))
            .unwrap()
    }

    /// The fault points a whole run passes, from a run with a trace (`points[i]` is `i + 1`).
    fn points(&self) -> Vec<String> {
        let outside = tempfile::tempdir().unwrap();
        let trace = outside.path().join("trace");
        let (_, out) = self.start(&[("KEEL_FAULT_TRACE", trace.display().to_string())]);
        assert_eq!(out.status.code(), Some(0), "{}", self.fx.explain(&out));
        std::fs::read_to_string(&trace)
            .unwrap()
            .lines()
            .map(|l| l.split_once(' ').unwrap().1.to_string())
            .collect()
    }
}

fn echo_record_finish() -> Vec<Value> {
    vec![
        json!({"tool": "fixture.echo", "args": {"text": "hello from mcp"}}),
        json!({"tool": "fixture.record", "args": {"entry": "one"}}),
        json!({"tool": "finish", "args": {"summary": "recorded"}}),
    ]
}

const ALL_FIXTURE_TOOLS: &str = r#"["fixture.*", "finish"]"#;

/// What every completed run of `echo_record_finish` shows.
fn check_completed(s: &Scenario, id: &str, what: &str) {
    let f = &s.fx;
    let st = f.status(id);
    assert_eq!(state(&st), "completed", "{what}: {st:#}");
    assert_eq!(
        std::fs::read_to_string(&s.log).unwrap(),
        "one\n",
        "{what}: `record` ran exactly once"
    );
    let events = f.events(id);
    let finished = of_kind(&events, "tool_call_finished");
    assert!(
        finished.iter().any(|e| e["body"]["ok"] == true
            && e["body"]["observation"]
                .as_str()
                .unwrap()
                .contains("hello from mcp")),
        "{what}: the echo's observation: {finished:#?}"
    );
    let decisions = of_kind(&events, "policy_decision");
    let echo = decisions
        .iter()
        .find(|e| e["body"]["tool"] == "fixture.echo")
        .unwrap();
    assert_eq!(echo["body"]["decision"], "allow", "{what}: {echo:#}");
    assert_eq!(
        echo["body"]["reversibility"], "read_only",
        "{what}: {echo:#}"
    );

    // Only the record call is an effect: the read-only echo is not.
    let effects = s.effects(id);
    assert_eq!(effects.len(), 1, "{what}: {effects:#?}");
    let e = &effects[0];
    assert_eq!(e["tool"], "fixture.record", "{what}: {e:#}");
    assert_eq!(e["class"], "irreversible", "{what}: {e:#}");
    assert_eq!(e["status"], "done", "{what}: {e:#}");
    assert_eq!(e["keyed"], false, "{what}: {e:#}");
    assert_eq!(
        of_kind(&events, "effect_intended").len(),
        1,
        "{what}: {:?}",
        kinds(&events)
    );
    f.verify_log_ok(id);
}

#[test]
fn stdio_server_tools_are_called_and_recorded() {
    let s = Scenario::stdio("", ALL_FIXTURE_TOOLS, &echo_record_finish());
    let (id, out) = s.start(&[]);
    assert_eq!(out.status.code(), Some(0), "{}", s.fx.explain(&out));
    check_completed(&s, &id, "uninterrupted");

    // The driver was offered every tool of the server, under its qualified name.
    let events = s.fx.events(&id);
    let requested = of_kind(&events, "model_requested");
    assert!(!requested.is_empty(), "{:?}", kinds(&events));
}

#[test]
fn a_resumed_run_does_not_record_twice() {
    let probe = Scenario::stdio("", ALL_FIXTURE_TOOLS, &echo_record_finish());
    let points = probe.points();
    drop(probe);
    // The second call made is `record` (the echo is the first); kill keel once just after its
    // result is committed, and once after the call but before its result is recorded.
    let made: Vec<usize> = points
        .iter()
        .enumerate()
        .filter(|(_, p)| *p == "tool call made")
        .map(|(i, _)| i + 1)
        .collect();
    assert!(made.len() >= 2, "{points:?}");
    let record_made = made[1];
    let committed = points
        .iter()
        .enumerate()
        .skip(record_made)
        .find(|(_, p)| *p == "after commit")
        .map(|(i, _)| i + 1)
        .unwrap();

    // Killed after the outcome is committed: resume goes on without calling again.
    let s = Scenario::stdio("", ALL_FIXTURE_TOOLS, &echo_record_finish());
    let (_, out) = s.start(&[("KEEL_CRASH_AT", committed.to_string())]);
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(out.status.signal(), Some(9), "{}", s.fx.explain(&out));
    assert_eq!(lines(&s.log), 1);
    let id = s.run_id();
    s.expect(&["resume", &id], 0);
    check_completed(&s, &id, "killed after the record was committed");

    // Killed after the call, before its outcome is recorded: the call is irreversible and has
    // no key, so keel does not make it again blindly; it asks a person, who says it is done.
    let s = Scenario::stdio("", ALL_FIXTURE_TOOLS, &echo_record_finish());
    let (_, out) = s.start(&[("KEEL_CRASH_AT", record_made.to_string())]);
    assert_eq!(out.status.signal(), Some(9), "{}", s.fx.explain(&out));
    assert_eq!(lines(&s.log), 1);
    let id = s.run_id();
    s.expect(&["resume", &id], 3);
    assert_eq!(lines(&s.log), 1, "not made again on resume");
    let st = s.fx.status(&id);
    assert_eq!(state(&st), "awaiting_approval", "{st:#}");
    let r = st["approvals"].as_array().unwrap().last().unwrap().clone();
    assert_eq!(r["gate"]["gate"], "reconcile", "{r:#}");
    let effects = s.effects(&id);
    assert_eq!(effects.len(), 1, "{effects:#?}");
    assert_eq!(effects[0]["tool"], "fixture.record");
    assert_eq!(effects[0]["status"], "unknown", "{effects:#?}");
    let n = r["n"].as_u64().unwrap().to_string();
    s.fx.expect(
        &[
            "reject",
            &id,
            &n,
            "--payload-hash",
            r["payload_hash"].as_str().unwrap(),
            "--reason",
            "the log shows it: leave it",
        ],
        0,
    );
    s.expect(&["resume", &id], 0);
    assert_eq!(state(&s.fx.status(&id)), "completed");
    assert_eq!(std::fs::read_to_string(&s.log).unwrap(), "one\n");
    s.fx.verify_log_ok(&id);
}

#[test]
fn a_tool_the_phase_does_not_list_is_denied_and_the_run_goes_on() {
    let s = Scenario::stdio(
        "",
        r#"["fixture.echo", "fixture.record", "finish"]"#,
        &[
            json!({"tool": "fixture.fail", "args": {}}),
            json!({"tool": "fixture.record", "args": {"entry": "one"}}),
            json!({"tool": "finish", "args": {"summary": "recorded"}}),
        ],
    );
    let (id, out) = s.start(&[]);
    assert_eq!(out.status.code(), Some(0), "{}", s.fx.explain(&out));
    assert_eq!(state(&s.fx.status(&id)), "completed");
    let events = s.fx.events(&id);
    let decisions = of_kind(&events, "policy_decision");
    let fail = decisions
        .iter()
        .find(|e| e["body"]["tool"] == "fixture.fail")
        .unwrap_or_else(|| panic!("no decision on fixture.fail: {decisions:#?}"));
    assert_eq!(fail["body"]["decision"], "deny", "{fail:#}");
    let rule = fail["body"]["rule"].as_str().unwrap();
    assert!(
        rule.contains("not allowed in this phase") && rule.contains("fixture.record"),
        "{rule}"
    );
    let record = decisions
        .iter()
        .find(|e| e["body"]["tool"] == "fixture.record")
        .unwrap();
    assert_eq!(record["body"]["decision"], "allow", "{record:#}");
    assert_eq!(std::fs::read_to_string(&s.log).unwrap(), "one\n");
    let effects = s.effects(&id);
    assert_eq!(
        effects.len(),
        1,
        "the denied call is no effect: {effects:#?}"
    );
    s.fx.verify_log_ok(&id);
}

#[test]
fn a_server_that_needs_approval_waits_for_a_person() {
    let s = Scenario::stdio(
        "approval = true",
        ALL_FIXTURE_TOOLS,
        &[
            json!({"tool": "fixture.record", "args": {"entry": "one"}}),
            json!({"tool": "finish", "args": {"summary": "recorded"}}),
        ],
    );
    let (id, out) = s.start(&[]);
    assert_eq!(out.status.code(), Some(3), "{}", s.fx.explain(&out));
    assert_eq!(lines(&s.log), 0, "nothing runs before approval");
    let st = s.fx.status(&id);
    assert_eq!(state(&st), "awaiting_approval", "{st:#}");
    let r = st["approvals"].as_array().unwrap().last().unwrap().clone();
    assert_eq!(r["gate"]["gate"], "tool_call", "{r:#}");
    let payload = r["payload"].as_str().unwrap();
    assert!(
        payload.contains("fixture") && payload.contains("record") && payload.contains("one"),
        "{payload}"
    );
    // Resuming before a decision changes nothing.
    s.expect(&["resume", &id], 3);
    assert_eq!(lines(&s.log), 0);

    let n = r["n"].as_u64().unwrap().to_string();
    s.fx.expect(
        &[
            "approve",
            &id,
            &n,
            "--payload-hash",
            r["payload_hash"].as_str().unwrap(),
            "--reason",
            "ok",
        ],
        0,
    );
    s.expect(&["resume", &id], 0);
    assert_eq!(state(&s.fx.status(&id)), "completed");
    assert_eq!(std::fs::read_to_string(&s.log).unwrap(), "one\n");
    let effects = s.effects(&id);
    assert_eq!(effects.len(), 1, "{effects:#?}");
    assert_eq!(effects[0]["status"], "done");
    s.fx.verify_log_ok(&id);
}

#[test]
fn http_server_tools_are_called_and_recorded() {
    let outside = tempfile::tempdir().unwrap();
    let log = outside.path().join("http.log");
    let server = keel_test_support::mcp::spawn_http(log.clone()).unwrap();
    let s = Scenario::new(
        &format!("url = \"{}\"\nread_only = [\"echo\"]", server.url()),
        ALL_FIXTURE_TOOLS,
        &echo_record_finish(),
    );
    let (id, out) = s.fx.start(&[]);
    assert_eq!(out.status.code(), Some(0), "{}", s.fx.explain(&out));
    assert_eq!(state(&s.fx.status(&id)), "completed");
    assert_eq!(std::fs::read_to_string(&log).unwrap(), "one\n");
    let events = s.fx.events(&id);
    assert!(
        of_kind(&events, "tool_call_finished")
            .iter()
            .any(|e| e["body"]["observation"]
                .as_str()
                .unwrap()
                .contains("hello from mcp")),
        "{:?}",
        kinds(&events)
    );
    let effects = s.effects(&id);
    assert_eq!(effects.len(), 1, "{effects:#?}");
    assert_eq!(effects[0]["tool"], "fixture.record");
    assert_eq!(effects[0]["class"], "irreversible");
    assert_eq!(effects[0]["status"], "done");
    s.fx.verify_log_ok(&id);
    drop(server);
}

#[test]
fn a_server_that_cannot_start_stops_the_run_with_its_name() {
    let s = Scenario::new(
        "command = [\"/nonexistent/keel-mcp-missing\"]",
        ALL_FIXTURE_TOOLS,
        &echo_record_finish(),
    );
    let out = s.keel(&["run", "keel.toml"]);
    assert_ne!(out.status.code(), Some(0), "{}", s.fx.explain(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("fixture") && stderr.contains("keel-mcp-missing"),
        "{}",
        s.fx.explain(&out)
    );
}
