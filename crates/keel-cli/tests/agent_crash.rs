//! Crash recovery of agent steps, through the `keel` binary: a short scripted agent run (a plan,
//! writes, `run` calls that append to a marker file outside the workspace, a note and finish) is
//! killed with SIGKILL at each of its fault points in turn and resumed. Every time: the run
//! completes; each script line was used once and in order (a recorded reply is never asked for
//! again: for the script driver a second ask would take the next line); a tool call whose
//! `tool_call_finished` was recorded before the kill did not run again, and only a call that was
//! not recorded as finished may have run twice; the log verifies.
//!
//! The same is done to a run whose `run` call also changes a file outside the scope (undone by
//! the drift guard at the end of the step), and to a delegated `command` driver whose program
//! edits files in and out of scope: the out-of-scope change is undone and recorded, and the
//! delegate's recorded work is used, not thrown away and asked for again.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};

use common::{Fixture, fault_points, kinds, of_kind, state};
use serde_json::{Value, json};

/// The `run` calls of the script: (step index, call index, the label each appends to the
/// marker).
const RUNS: [(u64, u64, &str); 2] = [(2, 0, "run-3"), (3, 1, "run-4")];

/// Whether the scripted `run` call also changes a file outside the scope.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    InScope,
    OutOfScope,
}

fn script(marker: &Path, kind: Kind) -> Vec<Value> {
    let m = marker.display();
    let extra = match kind {
        Kind::InScope => "",
        Kind::OutOfScope => "; echo pwned >> README.md",
    };
    vec![
        json!({"tool": "plan", "args": {"items": ["write a", "run b", "write c and run", "finish"]}}),
        json!({"tool": "write", "args": {"path": "src/a.txt", "content": "a\n"}}),
        json!({"tool": "run", "args": {"command": format!("echo run-3 >> {m}; mkdir -p src; echo b > src/b.txt{extra}")}}),
        json!({"calls": [
            {"tool": "write", "args": {"path": "src/c.txt", "content": "c\n"}},
            {"tool": "run", "args": {"command": format!("echo run-4 >> {m}; echo d > src/d.txt")}}
        ]}),
        json!({"calls": [
            {"tool": "note", "args": {"text": "all written"}},
            {"tool": "finish", "args": {"summary": "a, b and c are there"}}
        ]}),
    ]
}

fn contract(script_path: &Path) -> String {
    format!(
        r#"
[task]
goal = "src/a.txt, src/b.txt and src/c.txt hold a, b and c."

[driver]
kind = "script"
script = "{}"

[scope]
writable = ["src/**"]

# `run` calls count themselves in a marker beside the script, outside the workspace.
[sandbox]
writable = ["{dir}"]

[budget]
steps = 40
same_error = 20

[[verify]]
name = "src-exists"
tier = "step"
run = "test -d src"

[[verify]]
name = "all"
tier = "acceptance"
run = "grep -qx a src/a.txt && grep -qx b src/b.txt && grep -qx c src/c.txt"

[[phase]]
name = "work"
kind = "agent"
objective = "Write a, b and c into src/a.txt, src/b.txt and src/c.txt, then finish."
done_when = []
"#,
        script_path.display(),
        dir = script_path.parent().unwrap().display()
    )
}

/// A workspace, and outside it the driver script and the marker file.
struct Scenario {
    fx: Fixture,
    _outside: tempfile::TempDir,
    marker: PathBuf,
    lines: Vec<Value>,
    kind: Kind,
}

impl Scenario {
    fn new(kind: Kind) -> Scenario {
        let outside = tempfile::tempdir().unwrap();
        let (contract, marker, lines) = write_script(outside.path(), kind);
        Scenario {
            fx: Fixture::new(&contract),
            _outside: outside,
            marker,
            lines,
            kind,
        }
    }

    fn marker_counts(&self) -> BTreeMap<String, usize> {
        let mut counts = BTreeMap::new();
        for line in std::fs::read_to_string(&self.marker)
            .unwrap_or_default()
            .lines()
        {
            *counts.entry(line.trim().to_string()).or_insert(0) += 1;
        }
        counts
    }

    fn run_id(&self) -> Option<String> {
        self.fx.stored_run_id()
    }

    /// (step index, call index) of every recorded `tool_call_finished`.
    fn finished_calls(events: &[Value]) -> Vec<(u64, u64)> {
        of_kind(events, "tool_call_finished")
            .iter()
            .map(|e| {
                (
                    e["body"]["step"]["index"].as_u64().unwrap(),
                    e["body"]["call"].as_u64().unwrap(),
                )
            })
            .collect()
    }

    /// Every invariant of a run that completed after being killed; `recorded` are the calls
    /// finished on record at the kill, `marker_at_kill` the marker's lines then.
    fn check_final(
        &self,
        id: &str,
        what: &str,
        recorded: &BTreeSet<(u64, u64)>,
        marker_at_kill: &BTreeMap<String, usize>,
    ) {
        let f = &self.fx;
        let st = f.status(id);
        assert_eq!(state(&st), "completed", "{what}: {st:#}");
        let events = f.events(id);

        // Each script line used once, in order: one request and one reply per model call.
        let replies = of_kind(&events, "model_replied");
        assert_eq!(
            replies.len(),
            self.lines.len(),
            "{what}: model replies {:?}",
            kinds(&events)
        );
        assert_eq!(
            of_kind(&events, "model_requested").len(),
            self.lines.len(),
            "{what}: a recorded request was recorded again"
        );
        assert_eq!(st["model_calls"].as_u64(), Some(self.lines.len() as u64));
        for (i, (reply, line)) in replies.iter().zip(&self.lines).enumerate() {
            let b = &reply["body"];
            assert_eq!(b["step"]["index"].as_u64(), Some(i as u64), "{what}: {b}");
            let hash = b["response"].as_str().unwrap();
            let bytes = f.artifact(hash);
            let response: Value = serde_json::from_slice(&bytes).unwrap();
            assert_eq!(
                &response,
                line,
                "{what}: reply {} is not script line {}",
                i + 1,
                i + 1
            );
            let calls: Vec<(String, Value)> = b["reply"]["calls"]
                .as_array()
                .unwrap()
                .iter()
                .map(|c| {
                    (
                        c["name"].as_str().unwrap().to_string(),
                        serde_json::from_str(c["arguments"].as_str().unwrap()).unwrap(),
                    )
                })
                .collect();
            let expected: Vec<(String, Value)> = match line.get("calls") {
                Some(calls) => calls
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|c| (c["tool"].as_str().unwrap().to_string(), c["args"].clone()))
                    .collect(),
                None => vec![(
                    line["tool"].as_str().unwrap().to_string(),
                    line["args"].clone(),
                )],
            };
            assert_eq!(calls, expected, "{what}: reply {}", i + 1);
        }

        // Every call decided and finished exactly once.
        let finished = Self::finished_calls(&events);
        let unique: BTreeSet<(u64, u64)> = finished.iter().copied().collect();
        assert_eq!(
            unique.len(),
            finished.len(),
            "{what}: a call finished twice: {finished:?}"
        );
        assert_eq!(finished.len(), 7, "{what}: {finished:?}");
        let decided: Vec<(u64, u64)> = of_kind(&events, "policy_decision")
            .iter()
            .map(|e| {
                assert_eq!(e["body"]["decision"], "allow", "{what}: {e}");
                (
                    e["body"]["step"]["index"].as_u64().unwrap(),
                    e["body"]["call"].as_u64().unwrap(),
                )
            })
            .collect();
        assert_eq!(decided.len(), 7, "{what}: {decided:?}");

        // No `run` call recorded as finished ran again; one that was not ran once more.
        let after = self.marker_counts();
        for (step, call, label) in RUNS {
            let at_kill = marker_at_kill.get(label).copied().unwrap_or(0);
            let now = after.get(label).copied().unwrap_or(0);
            if recorded.contains(&(step, call)) {
                assert_eq!(
                    (at_kill, now),
                    (1, 1),
                    "{what}: `{label}` was recorded as finished at the kill and ran again"
                );
            } else {
                assert!(
                    at_kill <= 1,
                    "{what}: `{label}` ran {at_kill} times before the kill"
                );
                assert_eq!(
                    now,
                    at_kill + 1,
                    "{what}: `{label}` (not finished on record at the kill, {at_kill} runs then) ran {now} times in all"
                );
            }
        }

        // The work is there once, the plan and the note recorded once.
        for (file, content) in [
            ("src/a.txt", "a\n"),
            ("src/b.txt", "b\n"),
            ("src/c.txt", "c\n"),
        ] {
            assert_eq!(
                std::fs::read_to_string(f.path(file)).unwrap(),
                content,
                "{what}: {file}"
            );
        }
        assert_eq!(st["plan_version"].as_u64(), Some(1), "{what}: {st:#}");
        assert_eq!(st["notes"], json!(["all written"]), "{what}: {st:#}");
        assert_eq!(of_kind(&events, "finish_claimed").len(), 1, "{what}");
        assert_eq!(
            std::fs::read_to_string(f.path("README.md")).unwrap(),
            "fixture\n",
            "{what}: an out-of-scope change survived"
        );
        if self.kind == Kind::OutOfScope {
            let reverted: Vec<&Value> = of_kind(&events, "scope_reverted")
                .iter()
                .map(|e| &e["body"]["paths"])
                .collect();
            assert_eq!(
                reverted,
                [&json!(["README.md"])],
                "{what}: the undone out-of-scope change is recorded once"
            );
            assert_eq!(st["violations"].as_u64(), Some(1), "{what}: {st:#}");
        }

        let seqs: Vec<u64> = events.iter().map(|e| e["seq"].as_u64().unwrap()).collect();
        let expected: Vec<u64> = (1..=seqs.len() as u64).collect();
        assert_eq!(seqs, expected, "{what}: sequence numbers not contiguous");
        f.verify_log_ok(id);
    }
}

/// Writes the script for a scenario whose outside directory is `dir`; returns the contract, the
/// marker path and the script lines.
fn write_script(dir: &Path, kind: Kind) -> (String, PathBuf, Vec<Value>) {
    let marker = dir.join("marker");
    let lines = script(&marker, kind);
    let path = dir.join("actions.jsonl");
    let text: String = lines.iter().map(|l| format!("{l}\n")).collect();
    std::fs::write(&path, text).unwrap();
    (contract(&path), marker, lines)
}

/// Kills `keel run` at fault point `n` and resumes it; false when the run finished first.
fn crash_at(kind: Kind, n: usize, name: &str) -> bool {
    crash_at_then(kind, n, name, |_| {})
}

/// [`crash_at`], with `meanwhile` done to the workspace between the kill and the resume.
fn crash_at_then(kind: Kind, n: usize, name: &str, meanwhile: impl Fn(&Path)) -> bool {
    let sc = Scenario::new(kind);
    let out = sc
        .fx
        .keel()
        .args(["run", "keel.toml"])
        .env("KEEL_CRASH_AT", n.to_string())
        .output()
        .unwrap();
    let what = format!("point {n} ({name})");
    if out.status.signal() != Some(9) {
        assert_eq!(
            out.status.code(),
            Some(0),
            "{what}: {}",
            sc.fx.explain(&out)
        );
        return false;
    }
    let Some(id) = sc.run_id() else {
        return true; // killed before the run existed
    };
    let events = sc.fx.events(&id);
    let recorded: BTreeSet<(u64, u64)> = Scenario::finished_calls(&events).into_iter().collect();
    let marker_at_kill = sc.marker_counts();
    meanwhile(sc.fx.root());
    let resumed = sc.fx.run(&["resume", &id]);
    assert_resumed(&sc.fx, &resumed, &what);
    sc.check_final(&id, &what, &recorded, &marker_at_kill);
    true
}

/// `keel resume` completed the run; otherwise the first line of the message says how it ended.
fn assert_resumed(f: &Fixture, out: &std::process::Output, what: &str) {
    if out.status.code() != Some(0) {
        let text = format!(
            "{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let said = text
            .lines()
            .find(|l| !l.trim().is_empty() && !l.starts_with("run "))
            .unwrap_or("");
        panic!(
            "{what}: resume exited {:?}: {said}\n{}",
            out.status.code(),
            f.explain(out)
        );
    }
}

/// Runs `one(n, name)` for every fault point, collecting the points where it panicked, and
/// fails naming all of them. Returns how many kills landed.
fn at_every_point(points: &[String], one: impl Fn(usize, &str) -> bool) -> usize {
    let mut landed = 0;
    let mut failures = Vec::new();
    for (i, name) in points.iter().enumerate() {
        let n = i + 1;
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| one(n, name))) {
            Ok(true) => landed += 1,
            Ok(false) => {}
            Err(panic) => {
                let message = panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                let first = message.lines().next().unwrap_or("");
                let first = first.trim_start_matches("assertion `left == right` failed: ");
                let short: String = first.chars().take(400).collect();
                failures.push(short);
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} fault points fail:\n{}",
        failures.len(),
        points.len(),
        failures.join("\n")
    );
    landed
}

fn every_point(kind: Kind) {
    let twin = tempfile::tempdir().unwrap();
    let (twin_contract, _, _) = write_script(twin.path(), kind);
    let points = fault_points(&twin_contract);
    let names: BTreeSet<&str> = points.iter().map(String::as_str).collect();
    for name in [
        "model request recorded",
        "model replied",
        "policy decided",
        "tool call made",
        "before commit",
        "after commit",
    ] {
        assert!(names.contains(name), "no `{name}` fault point: {names:?}");
    }
    if kind == Kind::OutOfScope {
        assert!(names.contains("scope reverted"), "{names:?}");
    }

    // The uninterrupted run meets every invariant too.
    let sc = Scenario::new(kind);
    let (id, out) = sc.fx.start(&[]);
    assert_eq!(out.status.code(), Some(0), "{}", sc.fx.explain(&out));
    sc.check_final(&id, "no crash", &BTreeSet::new(), &BTreeMap::new());

    let landed = at_every_point(&points, |n, name| crash_at(kind, n, name));
    assert_eq!(
        landed,
        points.len(),
        "every point of the twin run is reached"
    );
    assert!(
        !crash_at(kind, points.len() + 1, "past the last point"),
        "a run past its last point completes"
    );
}

#[test]
fn killed_at_every_fault_point_of_an_agent_run_it_resumes_without_repeating_itself() {
    every_point(Kind::InScope);
}

#[test]
fn killed_at_every_fault_point_while_an_out_of_scope_change_is_undone_it_resumes_and_records_it() {
    every_point(Kind::OutOfScope);
}

// --- The delegated command driver ---

/// A workspace whose driver is a program outside it: each invocation appends to a marker, writes
/// the answer in scope and a change out of scope, and claims done.
struct Delegate {
    fx: Fixture,
    _outside: tempfile::TempDir,
    marker: PathBuf,
}

fn delegate_contract(dir: &Path) -> (String, PathBuf) {
    let marker = dir.join("invocations");
    let program = dir.join("delegate.sh");
    std::fs::write(
        &program,
        format!(
            "echo invoked >> {}\nmkdir -p src\necho 42 > src/answer.txt\necho pwned >> README.md\nexit 0\n",
            marker.display()
        ),
    )
    .unwrap();
    let contract = format!(
        r#"
[task]
goal = "src/answer.txt holds 42."

[driver]
kind = "command"
command = "sh {}"

[scope]
writable = ["src/**"]

# The delegate counts its invocations in a file beside it, outside the workspace.
[sandbox]
writable = ["{}"]

[budget]
steps = 10

[[verify]]
name = "answer"
tier = "acceptance"
run = "grep -qx 42 src/answer.txt"

[[phase]]
name = "solve"
kind = "agent"
objective = "Write 42 into src/answer.txt."
done_when = []
"#,
        program.display(),
        dir.display()
    );
    (contract, marker)
}

impl Delegate {
    fn new() -> Delegate {
        let outside = tempfile::tempdir().unwrap();
        let (contract, marker) = delegate_contract(outside.path());
        Delegate {
            fx: Fixture::new(&contract),
            _outside: outside,
            marker,
        }
    }

    fn invocations(&self) -> usize {
        std::fs::read_to_string(&self.marker)
            .unwrap_or_default()
            .lines()
            .count()
    }

    fn run_id(&self) -> Option<String> {
        self.fx.stored_run_id()
    }

    /// `pending`: invocations made before the kill that have no recorded reply.
    fn check_final(&self, id: &str, what: &str, pending: usize) {
        let f = &self.fx;
        let st = f.status(id);
        assert_eq!(state(&st), "completed", "{what}: {st:#}");
        let events = f.events(id);
        let replies = of_kind(&events, "model_replied").len();
        assert_eq!(
            replies,
            1,
            "{what}: the delegate's recorded work was thrown away and asked for again: {:?}",
            kinds(&events)
        );
        assert_eq!(
            self.invocations(),
            replies + pending,
            "{what}: the delegate ran again although its reply was recorded"
        );
        assert_eq!(
            std::fs::read_to_string(f.path("src/answer.txt")).unwrap(),
            "42\n",
            "{what}"
        );
        assert_eq!(
            std::fs::read_to_string(f.path("README.md")).unwrap(),
            "fixture\n",
            "{what}: the out-of-scope change survived"
        );
        let reverted: Vec<&Value> = of_kind(&events, "scope_reverted")
            .iter()
            .map(|e| &e["body"]["paths"])
            .collect();
        assert_eq!(
            reverted,
            [&json!(["README.md"])],
            "{what}: the undone out-of-scope change is recorded once"
        );
        f.verify_log_ok(id);
    }
}

fn delegate_crash_at(n: usize, name: &str) -> bool {
    let d = Delegate::new();
    let out =
        d.fx.keel()
            .args(["run", "keel.toml"])
            .env("KEEL_CRASH_AT", n.to_string())
            .output()
            .unwrap();
    let what = format!("point {n} ({name})");
    if out.status.signal() != Some(9) {
        assert_eq!(out.status.code(), Some(0), "{what}: {}", d.fx.explain(&out));
        return false;
    }
    let Some(id) = d.run_id() else {
        return true;
    };
    let replies = of_kind(&d.fx.events(&id), "model_replied").len();
    let pending = d.invocations() - replies;
    assert!(pending <= 1, "{what}: {pending}");
    let resumed = d.fx.run(&["resume", &id]);
    assert_resumed(&d.fx, &resumed, &what);
    d.check_final(&id, &what, pending);
    true
}

#[test]
fn killed_at_every_fault_point_of_a_delegated_step_it_resumes_and_keeps_the_delegates_work() {
    let twin = tempfile::tempdir().unwrap();
    let (twin_contract, _) = delegate_contract(twin.path());
    let points = fault_points(&twin_contract);
    for name in ["model request recorded", "model replied", "scope reverted"] {
        assert!(points.iter().any(|p| p == name), "no `{name}`: {points:?}");
    }
    let d = Delegate::new();
    let (id, out) = d.fx.start(&[]);
    assert_eq!(out.status.code(), Some(0), "{}", d.fx.explain(&out));
    d.check_final(&id, "no crash", 0);

    let landed = at_every_point(&points, delegate_crash_at);
    assert_eq!(landed, points.len());
}

/// Killed just after each call that changed files, with `git gc --prune=now` run before the
/// resume (git prunes the loose objects nothing names once they are two weeks old): the tree
/// the call started from is pinned (`refs/keel/<run>/pinned/call`), so the call is still undone
/// whole and the run ends as the uninterrupted one does.
#[test]
fn killed_after_a_call_and_resumed_after_git_gc_the_call_is_still_undone() {
    let twin = tempfile::tempdir().unwrap();
    let (twin_contract, _, _) = write_script(twin.path(), Kind::InScope);
    let points = fault_points(&twin_contract);
    let mut landed = 0;
    for (i, name) in points.iter().enumerate() {
        if name == "tool call made" {
            assert!(crash_at_then(
                Kind::InScope,
                i + 1,
                name,
                common::git_gc_prune_now
            ));
            landed += 1;
        }
    }
    assert!(landed >= 2, "{points:?}");
}
