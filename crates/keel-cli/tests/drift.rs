//! Environment drift between a kill and a resume: a changed HEAD, branch, tracked file, untracked
//! file, lockfile or fingerprint command output stops the run as `blocked`, naming each change;
//! `--migrate --reason` continues and records who and why; putting the environment back
//! continues as well; no change continues without a drift event. A step interrupted by the kill
//! is rolled back (its tree kept under a ref) before the comparison, and is not drift.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::{Path, PathBuf};

use common::{
    Fixture, after_step_verified, fault_points, git, killed_at, kinds, nth_point, state, stdout,
};
use serde_json::Value;

/// Two phases of steps that each append a letter to marker.txt; `fingerprint` is the contract's
/// `[workspace] fingerprint` list.
fn contract(fingerprint: &[String]) -> String {
    let list = fingerprint
        .iter()
        .map(|c| format!("{c:?}"))
        .collect::<Vec<_>>()
        .join(", ");
    format!(
        r#"
[task]
goal = "Write the letters a to c into marker.txt."

[workspace]
fingerprint = [{list}]

[[verify]]
name = "letters"
tier = "acceptance"
run = "test -s marker.txt"

[[phase]]
name = "one"
kind = "command"
run = ["echo a >> marker.txt", "echo b >> marker.txt"]

[[phase]]
name = "two"
kind = "command"
run = ["echo c >> marker.txt"]
"#
    )
}

const ALL_LETTERS: &str = "a\nb\nc\n";

/// A workspace with a file outside it that a fingerprint command reads.
struct Scenario {
    f: Fixture,
    contract: String,
    _outside: tempfile::TempDir,
    tool_version: PathBuf,
}

impl Scenario {
    fn new() -> Scenario {
        let outside = tempfile::tempdir().unwrap();
        let tool_version = outside.path().join("tool-version.txt");
        std::fs::write(&tool_version, "tool 1.0\n").unwrap();
        let contract = contract(&[format!("cat {}", tool_version.display())]);
        Scenario {
            f: Fixture::new(&contract),
            contract,
            _outside: outside,
            tool_version,
        }
    }

    fn fingerprint_command(&self) -> String {
        format!("cat {}", self.tool_version.display())
    }

    /// Runs the contract until it is killed at the step boundary right after step `k` (1-based)
    /// was verified, and checks that no step is in progress. Returns the run id.
    fn killed_after_step(&self, k: usize) -> String {
        let n = after_step_verified(&fault_points(&self.contract), k);
        let id = killed_at(&self.f, n);
        let events = self.f.events(&id);
        assert_eq!(
            events.last().unwrap()["kind"],
            "step_verified",
            "killed at a step boundary: {:?}",
            kinds(&events)
        );
        assert_eq!(in_progress_steps(&self.f.status(&id)), 0);
        id
    }
}

fn in_progress_steps(status: &Value) -> usize {
    status["phases"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|p| p["steps"].as_array().unwrap().iter())
        .filter(|s| s["state"] == "in_progress")
        .count()
}

fn count(events: &[Value], kind: &str) -> usize {
    events.iter().filter(|e| e["kind"] == kind).count()
}

/// Resumes a drifted run: exit 4, `blocked`, every phrase in `named` in the printed reason, the
/// status reason and the `drift_detected` event; nothing ran.
fn expect_blocked(f: &Fixture, id: &str, named: &[&str]) {
    let before = f.events(id);
    let out = f.expect(&["resume", id], 4);
    let printed = stdout(&out);
    let status = f.status(id);
    assert_eq!(state(&status), "blocked");
    let reason = status["reason"].as_str().unwrap();
    let events = f.events(id);
    let drift: Vec<&Value> = events
        .iter()
        .skip(before.len())
        .filter(|e| e["kind"] == "drift_detected")
        .collect();
    assert_eq!(drift.len(), 1, "one drift_detected: {:?}", kinds(&events));
    let text_log = stdout(&f.expect(&["log", id], 0));
    for phrase in named {
        assert!(
            printed.contains(phrase),
            "resume should name `{phrase}`\n{}",
            f.explain(&out)
        );
        assert!(
            reason.contains(phrase),
            "status reason lacks `{phrase}`: {reason}"
        );
        assert!(
            text_log.contains(phrase),
            "the log lacks `{phrase}`\n{text_log}"
        );
    }
    assert_eq!(
        count(&events, "step_started"),
        count(&before, "step_started"),
        "no step ran in the changed environment"
    );
    assert!(std::fs::read_to_string(f.path("marker.txt")).unwrap().len() < ALL_LETTERS.len());
    // Asking again without a decision changes nothing: still blocked.
    f.expect(&["resume", id], 4);
    assert_eq!(state(&f.status(id)), "blocked");
    assert_eq!(
        count(&f.events(id), "step_started"),
        count(&before, "step_started")
    );
}

/// `resume --migrate --reason` continues to `completed`, and the log (text and JSON) records the
/// reason, who and which changes.
fn expect_migrated(f: &Fixture, id: &str, part: &str) {
    let reason = "the change was made on purpose by the release team";
    let out = f
        .keel()
        .args(["resume", id, "--migrate", "--reason", reason])
        .env("KEEL_USER", "alice")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", f.explain(&out));
    assert_eq!(state(&f.status(id)), "completed");
    f.verify_log_ok(id);
    assert_eq!(
        std::fs::read_to_string(f.path("marker.txt")).unwrap(),
        ALL_LETTERS,
        "every step ran exactly once"
    );
    let events = f.events(id);
    let migrated: Vec<&Value> = events.iter().filter(|e| e["kind"] == "migrated").collect();
    assert_eq!(migrated.len(), 1, "{:?}", kinds(&events));
    let body = &migrated[0]["body"];
    assert_eq!(body["reason"], reason);
    assert_eq!(body["by"], "alice");
    let parts: Vec<&str> = body["changes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["part"].as_str().unwrap())
        .collect();
    assert!(
        parts.contains(&part),
        "migrated changes {parts:?} lack {part}"
    );
    let text = stdout(&f.expect(&["log", id], 0));
    assert!(
        text.contains("migrated") && text.contains(reason) && text.contains("alice"),
        "the text log shows the migration, its reason and who\n{text}"
    );
}

/// Resuming after the environment was put back continues to `completed` without a migration.
fn expect_continues_after_revert(f: &Fixture, id: &str) {
    let out = f.expect(&["resume", id], 0);
    assert!(stdout(&out).contains("completed"), "{}", f.explain(&out));
    assert_eq!(state(&f.status(id)), "completed");
    f.verify_log_ok(id);
    let events = f.events(id);
    assert_eq!(count(&events, "migrated"), 0, "{:?}", kinds(&events));
    assert!(
        count(&events, "drift_detected") >= 1,
        "{:?}",
        kinds(&events)
    );
    let lifted = events.iter().any(|e| {
        e["kind"] == "state_changed"
            && e["body"]["from"] == "blocked"
            && e["body"]["to"] == "executing"
    });
    assert!(
        lifted,
        "the drift block is lifted by an event: {:?}",
        kinds(&events)
    );
    assert_eq!(
        std::fs::read_to_string(f.path("marker.txt")).unwrap(),
        ALL_LETTERS
    );
}

fn write(path: &Path, text: &str) {
    std::fs::write(path, text).unwrap();
}

// HEAD

#[test]
fn a_new_commit_blocks_and_migrate_continues() {
    let s = Scenario::new();
    let id = s.killed_after_step(1);
    git(
        s.f.root(),
        &["commit", "-q", "--allow-empty", "-m", "meanwhile"],
    );
    expect_blocked(&s.f, &id, &["HEAD changed"]);
    expect_migrated(&s.f, &id, "head");
}

#[test]
fn a_new_commit_taken_back_continues() {
    let s = Scenario::new();
    let id = s.killed_after_step(1);
    git(
        s.f.root(),
        &["commit", "-q", "--allow-empty", "-m", "meanwhile"],
    );
    expect_blocked(&s.f, &id, &["HEAD changed"]);
    git(s.f.root(), &["reset", "-q", "--soft", "HEAD~1"]);
    expect_continues_after_revert(&s.f, &id);
}

// A tracked file

#[test]
fn a_changed_tracked_file_blocks_and_migrate_continues() {
    let s = Scenario::new();
    let id = s.killed_after_step(2);
    write(&s.f.path("README.md"), "edited by a person\n");
    expect_blocked(&s.f, &id, &["the working tree (M README.md) changed"]);
    expect_migrated(&s.f, &id, "tree");
    assert_eq!(
        std::fs::read_to_string(s.f.path("README.md")).unwrap(),
        "edited by a person\n",
        "a migration keeps the person's change"
    );
}

#[test]
fn a_changed_tracked_file_put_back_continues() {
    let s = Scenario::new();
    let id = s.killed_after_step(2);
    write(&s.f.path("README.md"), "edited by a person\n");
    expect_blocked(&s.f, &id, &["the working tree (M README.md) changed"]);
    write(&s.f.path("README.md"), "fixture\n");
    expect_continues_after_revert(&s.f, &id);
}

// An untracked file

#[test]
fn an_added_untracked_file_blocks_and_migrate_continues() {
    let s = Scenario::new();
    let id = s.killed_after_step(1);
    write(&s.f.path("notes.txt"), "a person's notes\n");
    expect_blocked(&s.f, &id, &["the working tree (A notes.txt) changed"]);
    expect_migrated(&s.f, &id, "tree");
    assert!(s.f.path("notes.txt").exists());
}

#[test]
fn an_added_untracked_file_removed_again_continues() {
    let s = Scenario::new();
    let id = s.killed_after_step(1);
    write(&s.f.path("notes.txt"), "a person's notes\n");
    expect_blocked(&s.f, &id, &["notes.txt"]);
    std::fs::remove_file(s.f.path("notes.txt")).unwrap();
    expect_continues_after_revert(&s.f, &id);
}

#[test]
fn an_ignored_file_is_not_drift() {
    let s = Scenario::new();
    let id = s.killed_after_step(1);
    write(&s.f.path(".keel/scratch.txt"), "keel's own directory\n");
    let out = s.f.expect(&["resume", &id], 0);
    assert!(stdout(&out).contains("completed"));
    assert_eq!(count(&s.f.events(&id), "drift_detected"), 0);
}

// A lockfile

#[test]
fn a_changed_lockfile_blocks_and_migrate_continues() {
    let s = Scenario::new();
    let id = s.killed_after_step(2);
    write(&s.f.path("Cargo.lock"), "# lock v2\n");
    expect_blocked(&s.f, &id, &["lockfile Cargo.lock changed", "M Cargo.lock"]);
    expect_migrated(&s.f, &id, "lockfile");
}

#[test]
fn a_changed_lockfile_put_back_continues() {
    let s = Scenario::new();
    let id = s.killed_after_step(2);
    write(&s.f.path("Cargo.lock"), "# lock v2\n");
    expect_blocked(&s.f, &id, &["lockfile Cargo.lock changed"]);
    write(&s.f.path("Cargo.lock"), "# lock v1\n");
    expect_continues_after_revert(&s.f, &id);
}

// A fingerprint command's output

#[test]
fn a_changed_fingerprint_command_output_blocks_and_migrate_continues() {
    let s = Scenario::new();
    let id = s.killed_after_step(1);
    write(&s.tool_version, "tool 2.0\n");
    let named = format!(
        "the output of fingerprint command `{}` changed: tool 1.0 -> tool 2.0",
        s.fingerprint_command()
    );
    expect_blocked(&s.f, &id, &[&named]);
    let events = s.f.events(&id);
    let drift = events
        .iter()
        .find(|e| e["kind"] == "drift_detected")
        .unwrap();
    let changes = drift["body"]["changes"].as_array().unwrap();
    assert_eq!(changes.len(), 1, "only the command changed: {changes:?}");
    assert_eq!(changes[0]["part"], "command");
    assert_eq!(changes[0]["key"], s.fingerprint_command().as_str());
    expect_migrated(&s.f, &id, "command");
}

#[test]
fn a_changed_fingerprint_command_output_put_back_continues() {
    let s = Scenario::new();
    let id = s.killed_after_step(1);
    write(&s.tool_version, "tool 2.0\n");
    expect_blocked(&s.f, &id, &["the output of fingerprint command"]);
    write(&s.tool_version, "tool 1.0\n");
    expect_continues_after_revert(&s.f, &id);
}

// Several changes at once

#[test]
fn every_change_is_named() {
    let s = Scenario::new();
    let id = s.killed_after_step(2);
    git(s.f.root(), &["checkout", "-q", "-b", "elsewhere"]);
    git(
        s.f.root(),
        &["commit", "-q", "--allow-empty", "-m", "meanwhile"],
    );
    write(&s.f.path("README.md"), "edited\n");
    write(&s.f.path("Cargo.lock"), "# lock v2\n");
    write(&s.tool_version, "tool 2.0\n");
    let command = format!(
        "the output of fingerprint command `{}` changed",
        s.fingerprint_command()
    );
    expect_blocked(
        &s.f,
        &id,
        &[
            "HEAD changed",
            "the branch changed: main -> elsewhere",
            "lockfile Cargo.lock changed",
            "M Cargo.lock",
            "M README.md",
            &command,
        ],
    );
    expect_migrated(&s.f, &id, "branch");
}

// No change

#[test]
fn resume_without_drift_continues_without_a_drift_event() {
    let s = Scenario::new();
    let id = s.killed_after_step(2);
    let out = s.f.expect(&["resume", &id], 0);
    assert!(stdout(&out).contains("completed"), "{}", s.f.explain(&out));
    let events = s.f.events(&id);
    assert_eq!(count(&events, "drift_detected"), 0, "{:?}", kinds(&events));
    assert_eq!(count(&events, "migrated"), 0);
    assert!(
        !events
            .iter()
            .any(|e| e["kind"] == "state_changed" && e["body"]["to"] == "blocked")
    );
    s.f.verify_log_ok(&id);
    assert_eq!(
        std::fs::read_to_string(s.f.path("marker.txt")).unwrap(),
        ALL_LETTERS
    );
}

// Usage

#[test]
fn migrate_without_a_reason_is_a_usage_error() {
    let s = Scenario::new();
    let id = s.killed_after_step(1);
    write(&s.f.path("README.md"), "edited\n");
    let before = s.f.events(&id);
    let out = s.f.expect(&["resume", &id, "--migrate"], 2);
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--reason"),
        "{}",
        s.f.explain(&out)
    );
    assert_eq!(s.f.events(&id), before, "a usage error writes nothing");

    // A blank reason is no reason either.
    let out =
        s.f.expect(&["resume", &id, "--migrate", "--reason", "  "], 2);
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("reason"),
        "{}",
        s.f.explain(&out)
    );
    let events = s.f.events(&id);
    assert_eq!(count(&events, "migrated"), 0);
    assert_eq!(
        count(&events, "step_started"),
        count(&before, "step_started"),
        "nothing ran"
    );
    assert_ne!(state(&s.f.status(&id)), "completed");

    // With a reason the run goes on.
    expect_migrated(&s.f, &id, "tree");
}

// An interrupted step

/// A contract whose second step writes two files; `extra` is put between the two writes.
fn interrupted_contract(extra: &str) -> String {
    format!(
        r#"
[task]
goal = "Write the letters and two more files."

[[verify]]
name = "files"
tier = "acceptance"
run = "test -s partial.txt && test -s other.txt"

[[phase]]
name = "one"
kind = "command"
run = ["echo a >> marker.txt", "echo x >> partial.txt; {extra}echo y >> other.txt", "echo c >> marker.txt"]
"#
    )
}

/// Checks that the interrupted step was rolled back (not reported as drift) and run again,
/// and returns the `step_rolled_back` event.
fn expect_rolled_back_and_completed(f: &Fixture, id: &str) -> Value {
    let out = f.expect(&["resume", id], 0);
    assert!(stdout(&out).contains("completed"), "{}", f.explain(&out));
    f.verify_log_ok(id);
    let events = f.events(id);
    assert_eq!(count(&events, "drift_detected"), 0, "{:?}", kinds(&events));
    assert_eq!(count(&events, "migrated"), 0);
    let rolled: Vec<&Value> = events
        .iter()
        .filter(|e| e["kind"] == "step_rolled_back")
        .collect();
    assert_eq!(rolled.len(), 1, "{:?}", kinds(&events));
    assert_eq!(rolled[0]["body"]["step"]["index"], 1);
    let status = f.status(id);
    let step = &status["phases"][0]["steps"][1];
    assert_eq!(step["state"], "verified");
    assert_eq!(step["attempts"], 2, "the interrupted step ran again");
    // Its effects are there once: the partial ones were undone before it ran again.
    for (file, text) in [
        ("marker.txt", "a\nc\n"),
        ("partial.txt", "x\n"),
        ("other.txt", "y\n"),
    ] {
        assert_eq!(
            std::fs::read_to_string(f.path(file)).unwrap(),
            text,
            "{file}"
        );
    }
    rolled[0].clone()
}

fn interrupted_refs(f: &Fixture, id: &str) -> Vec<String> {
    let refs = git(
        f.root(),
        &[
            "for-each-ref",
            "--format=%(refname)",
            &format!("refs/keel/{id}/interrupted/"),
        ],
    );
    refs.lines().map(str::to_string).collect()
}

#[test]
fn an_interrupted_step_is_rolled_back_not_reported_as_drift() {
    let contract = interrupted_contract("");
    let f = Fixture::new(&contract);
    // Killed after the second step's command wrote both files, before keel recorded its end.
    let points = fault_points(&contract);
    let id = killed_at(&f, nth_point(&points, "command ended", 2) as u64 + 1);
    assert_eq!(in_progress_steps(&f.status(&id)), 1);
    assert_eq!(std::fs::read_to_string(f.path("other.txt")).unwrap(), "y\n");

    let rolled = expect_rolled_back_and_completed(&f, &id);
    let saved = rolled["body"]["saved_ref"].as_str().unwrap().to_string();
    assert!(
        saved.starts_with(&format!("refs/keel/{id}/interrupted/")),
        "{saved}"
    );
    assert_eq!(interrupted_refs(&f, &id), vec![saved.clone()]);
    git(f.root(), &["rev-parse", "--verify", &saved]);
    // The saved tree holds what the interrupted step had written.
    assert_eq!(
        git(f.root(), &["show", &format!("{saved}:partial.txt")]),
        "x"
    );
    assert_eq!(git(f.root(), &["show", &format!("{saved}:other.txt")]), "y");
}

#[test]
fn a_step_killed_while_its_command_runs_is_rolled_back_and_run_again() {
    let contract = interrupted_contract("sleep 1; ");
    let f = Fixture::new(&contract);
    let points = fault_points(&contract);
    let id = killed_at(&f, nth_point(&points, "command running", 2) as u64 + 1);
    assert_eq!(in_progress_steps(&f.status(&id)), 1);
    // The command dies with keel, so it never reaches its second write.
    assert!(!f.path("other.txt").exists());

    let rolled = expect_rolled_back_and_completed(&f, &id);
    // How far the shell got before it died decides if there was anything to keep; if there
    // was, it is under the ref the event names. The shell may have been killed after `>>`
    // created the file and before `echo` wrote to it, so the kept file is "x" or empty.
    match rolled["body"]["saved_ref"].as_str() {
        Some(saved) => {
            assert_eq!(interrupted_refs(&f, &id), [saved.to_string()]);
            let kept = git(f.root(), &["show", &format!("{saved}:partial.txt")]);
            assert!(
                kept == "x" || kept.is_empty(),
                "the saved partial.txt holds {kept:?}, not a prefix of what the step wrote"
            );
        }
        None => assert!(interrupted_refs(&f, &id).is_empty()),
    }
}

#[test]
fn drift_after_an_interrupted_step_is_still_reported() {
    let contract = interrupted_contract("");
    let f = Fixture::new(&contract);
    let points = fault_points(&contract);
    let id = killed_at(&f, nth_point(&points, "command ended", 2) as u64 + 1);
    git(
        f.root(),
        &["commit", "-q", "--allow-empty", "-m", "meanwhile"],
    );

    let out = f.expect(&["resume", &id], 4);
    let printed = stdout(&out);
    assert!(printed.contains("HEAD changed"), "{}", f.explain(&out));
    assert!(
        !printed.contains("partial.txt") && !printed.contains("other.txt"),
        "the interrupted step's own changes are not drift\n{printed}"
    );
    let events = f.events(&id);
    let rolled = events
        .iter()
        .position(|e| e["kind"] == "step_rolled_back")
        .unwrap();
    let drift = events
        .iter()
        .position(|e| e["kind"] == "drift_detected")
        .unwrap();
    assert!(rolled < drift, "rolled back first, then compared");
    assert_eq!(interrupted_refs(&f, &id).len(), 1);
    assert!(
        !f.path("other.txt").exists(),
        "the partial change was undone"
    );

    let out = f
        .keel()
        .args(["resume", &id, "--migrate", "--reason", "rebased on purpose"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", f.explain(&out));
    assert_eq!(std::fs::read_to_string(f.path("other.txt")).unwrap(), "y\n");
    assert_eq!(
        std::fs::read_to_string(f.path("partial.txt")).unwrap(),
        "x\n"
    );
    f.verify_log_ok(&id);
}

#[test]
fn drift_while_blocked_on_a_budget_is_what_the_run_reports_after_the_raise() {
    // Blocked before its third step by `steps = 2`; a person then edits a tracked file. Raising
    // the budget lifts the budget block, and the drift is what blocks the run now, by name.
    let text = format!("{}\n[budget]\nsteps = 2\n", contract(&[]));
    let f = Fixture::new(&text);
    let (id, out) = f.start(&[]);
    assert_eq!(out.status.code(), Some(4), "{}", f.explain(&out));
    write(&f.path("README.md"), "edited while the run was blocked\n");
    let out = f.expect(
        &[
            "unblock", &id, "--budget", "steps=+1", "--reason", "one more",
        ],
        4,
    );
    assert!(
        stdout(&out).contains("the working tree (M README.md) changed"),
        "{}",
        f.explain(&out)
    );
    let status = f.status(&id);
    assert_eq!(status["block"]["cause"], "drift", "{status:#}");
    f.expect(
        &["resume", &id, "--migrate", "--reason", "the edit is wanted"],
        0,
    );
    assert_eq!(
        std::fs::read_to_string(f.path("marker.txt")).unwrap(),
        ALL_LETTERS
    );
}

/// The environment changes while an agent step waits for a person to approve one of its
/// calls. keel cannot migrate in the middle of a step (the step's calls were recorded against
/// the old environment), so it blocks and says how to go on; `--migrate` there is refused with
/// the same directions and changes nothing. Put back, the step finishes once the call is
/// approved, and the call is made once.
#[test]
fn drift_in_the_middle_of_an_agent_step_is_refused_a_migration_and_says_how_to_go_on() {
    let outside = tempfile::tempdir().unwrap();
    let script = outside.path().join("script.jsonl");
    std::fs::write(
        &script,
        [
            r#"{"tool": "record", "args": {"item": "release-1"}}"#,
            r#"{"tool": "finish", "args": {"summary": "recorded"}}"#,
        ]
        .join("\n")
            + "\n",
    )
    .unwrap();
    let contract = format!(
        r#"
[task]
goal = "The release is recorded."

[driver]
kind = "script"
script = "{}"

[scope]
writable = ["releases.txt"]

[approvals]
require = ["irreversible"]

[[verify]]
name = "recorded"
tier = "acceptance"
run = "grep -q release-1 releases.txt"

[[phase]]
name = "record"
kind = "agent"
objective = "Record the release."
tools = ["record", "finish"]
done_when = []

[[tool]]
name = "record"
description = "Record a release."
run = ["sh", "-c", "echo \"$0\" >> releases.txt", "{{item}}"]
parameters = {{ item = {{ type = "string" }} }}
reversibility = "irreversible"
"#,
        script.display()
    );
    let f = Fixture::new(&contract);
    let (id, out) = f.start(&[]);
    assert_eq!(out.status.code(), Some(3), "{}", f.explain(&out));
    git(
        f.root(),
        &["commit", "-q", "--allow-empty", "-m", "meanwhile"],
    );

    let out = f.expect(&["resume", &id], 4);
    let st = f.status(&id);
    assert_eq!(state(&st), "blocked", "{st:#}");
    let reason = st["reason"].as_str().unwrap();
    assert!(
        reason.contains("middle of step 1.1")
            && reason.contains("HEAD changed")
            && reason.contains("step boundary"),
        "{}",
        f.explain(&out)
    );
    let before = f.events(&id).len();
    let out = f.expect(&["resume", &id, "--migrate", "--reason", "on purpose"], 2);
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(
        text.contains("step boundary") && text.contains("put it back"),
        "{text}"
    );
    let after: Vec<String> = kinds(&f.events(&id)[before..]);
    assert!(
        after.iter().all(|k| k == "resumed"),
        "a refused migration records nothing but the process taking the run: {after:?}"
    );
    assert!(!f.path("releases.txt").exists());

    git(f.root(), &["reset", "-q", "--hard", "HEAD~1"]);
    let request = f.status(&id)["approvals"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["decision"].is_null())
        .cloned()
        .unwrap();
    assert_eq!(request["gate"]["gate"], "tool_call", "{request:#}");
    f.expect(
        &[
            "approve",
            &id,
            &request["n"].as_u64().unwrap().to_string(),
            "--payload-hash",
            request["payload_hash"].as_str().unwrap(),
            "--reason",
            "fine",
        ],
        0,
    );
    f.expect(&["resume", &id], 0);
    assert_eq!(
        std::fs::read_to_string(f.path("releases.txt")).unwrap(),
        "release-1\n",
        "the call was made once"
    );
    f.verify_log_ok(&id);
}
