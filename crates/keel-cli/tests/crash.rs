//! Crash tests: `keel run` is killed with SIGKILL at every fault point of a multi-phase run (and
//! at random instants from outside), resumed, and checked: the run completes, no verified step
//! ran again, sequence numbers are contiguous, the log verifies, consumed budgets never went down.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::BTreeMap;
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use common::{Fixture, state};

/// Each step appends its label to a marker file outside the workspace, so every execution is
/// seen, also those whose workspace changes were rolled back.
fn contract(marker: &Path) -> String {
    let m = marker.display();
    format!(
        r#"
[task]
goal = "Build out/ab.txt and out/done.txt through three phases."

[budget]
steps = 200
same_error = 20
wall_time = "10m"

[[verify]]
name = "out-exists"
tier = "step"
run = "test -d out"

[[verify]]
name = "inputs"
tier = "phase"
run = "test -s out/a.txt && test -s out/b.txt"

[[verify]]
name = "final"
tier = "acceptance"
run = "grep -q built out/ab.txt && test -f out/done.txt"

[[phase]]
name = "prepare"
kind = "command"
run = [
  "echo 1.1 >> {m}; mkdir -p out; echo a > out/a.txt",
  "echo 1.2 >> {m}; echo b > out/b.txt",
]

[[phase]]
name = "build"
kind = "command"
run = [
  "echo 2.1 >> {m}; cat out/a.txt out/b.txt > out/ab.txt",
  "echo 2.2 >> {m}; sleep 0.05; echo built >> out/ab.txt",
]
done_when = ["inputs"]

[[phase]]
name = "finish"
kind = "command"
run = ["echo 3.1 >> {m}; echo done > out/done.txt"]
done_when = []
{sandbox}"#,
        sandbox = common::outside_writable()
    )
}

struct Scenario {
    fx: Fixture,
    _outside: tempfile::TempDir,
    marker: std::path::PathBuf,
}

impl Scenario {
    fn new() -> Scenario {
        let outside = tempfile::tempdir().unwrap();
        let marker = outside.path().join("marker");
        let fx = Fixture::new(&contract(&marker));
        Scenario {
            fx,
            _outside: outside,
            marker,
        }
    }

    fn executions(&self) -> BTreeMap<String, usize> {
        let text = std::fs::read_to_string(&self.marker).unwrap_or_default();
        let mut counts = BTreeMap::new();
        for line in text.lines() {
            *counts.entry(line.trim().to_string()).or_insert(0) += 1;
        }
        counts
    }

    /// Steps the store says are verified, as `phase.index` labels (1-based).
    fn verified(&self) -> Vec<String> {
        if !self.fx.path(".keel/keel.db").exists() {
            return Vec::new();
        }
        let db = self.fx.db();
        let mut stmt = db
            .prepare("SELECT phase, idx FROM steps WHERE state = 'verified'")
            .unwrap();
        stmt.query_map([], |r| {
            let (p, i): (i64, i64) = (r.get(0)?, r.get(1)?);
            Ok(format!("{}.{}", p + 1, i + 1))
        })
        .unwrap()
        .map(Result::unwrap)
        .collect()
    }

    /// Consumed counters from the projection (the gauges diff_lines and files_changed may go
    /// down when a step is rolled back, so they are not counters).
    fn consumed(&self, id: &str) -> BTreeMap<String, u64> {
        let status = self.fx.status(id);
        [
            "steps",
            "tool_calls",
            "writes",
            "wall_time",
            "compute_time",
            "same_error",
        ]
        .iter()
        .map(|b| {
            (
                b.to_string(),
                status["budgets"][*b]["used"].as_u64().unwrap(),
            )
        })
        .collect()
    }

    fn run_id(&self) -> Option<String> {
        self.fx.stored_run_id()
    }

    /// Resumes a killed run to completion and checks that no step verified before the kill ran
    /// again and that no consumed budget went down.
    fn resume_after_kill(&self, id: &str, what: &str) {
        let verified = self.verified();
        let before = self.executions();
        let consumed_before = self.consumed(id);
        let out = self.fx.run(&["resume", id]);
        assert_eq!(
            out.status.code(),
            Some(0),
            "{what}: resume did not complete:\n{}",
            self.fx.explain(&out)
        );
        let after = self.executions();
        for step in &verified {
            assert_eq!(
                before.get(step),
                after.get(step),
                "{what}: step {step} was verified before the kill and ran again after resume"
            );
        }
        let consumed_after = self.consumed(id);
        for (name, used) in &consumed_before {
            assert!(
                consumed_after[name] >= *used,
                "{what}: budget {name} went down from {used} to {}",
                consumed_after[name]
            );
        }
    }

    /// Every invariant of a finished scenario.
    fn check_final(&self, id: &str) {
        let status = self.fx.status(id);
        assert_eq!(state(&status), "completed", "{status:#}");
        let seqs: Vec<u64> = self.fx.stored_events(id).iter().map(|e| e.seq).collect();
        let expected: Vec<u64> = (1..=seqs.len() as u64).collect();
        assert_eq!(seqs, expected, "sequence numbers are not contiguous");
        self.fx.verify_log_ok(id);
        let counts = self.executions();
        for step in ["1.1", "1.2", "2.1", "2.2", "3.1"] {
            assert!(
                counts.get(step).copied().unwrap_or(0) >= 1,
                "step {step} never ran: {counts:?}"
            );
        }
        let out = std::fs::read_to_string(self.fx.path("out/ab.txt")).unwrap();
        assert_eq!(
            out, "a\nb\nbuilt\n",
            "the workspace holds exactly one run's work"
        );
        // Budgets recorded in successive checkpoints never go down.
        let bodies: Vec<String> = self
            .fx
            .db()
            .prepare("SELECT body FROM checkpoints WHERE run_id = ?1 ORDER BY n")
            .unwrap()
            .query_map([id], |r| r.get(0))
            .unwrap()
            .map(Result::unwrap)
            .collect();
        let mut last: BTreeMap<String, u64> = BTreeMap::new();
        for body in bodies {
            let ck: serde_json::Value = serde_json::from_str(&body).unwrap();
            for (name, used) in ck["run"]["used"].as_object().unwrap() {
                if name == "diff_lines" || name == "files_changed" {
                    continue;
                }
                let used = used.as_u64().unwrap();
                let before = last.get(name).copied().unwrap_or(0);
                assert!(
                    used >= before,
                    "budget {name} went down from {before} to {used} between checkpoints"
                );
                last.insert(name.clone(), used);
            }
        }
    }
}

fn killed(status: &std::process::ExitStatus) -> bool {
    status.signal() == Some(9)
}

/// One crash of `keel run` at fault point `n`, then a resume; returns false when the run
/// finished before reaching point `n`.
fn crash_once_and_resume(n: u64) -> bool {
    let sc = Scenario::new();
    let (id, out) = {
        let mut cmd = sc.fx.keel();
        cmd.args(["run", "keel.toml"])
            .env("KEEL_CRASH_AT", n.to_string());
        let out = cmd.output().unwrap();
        let first = String::from_utf8_lossy(&out.stdout)
            .lines()
            .next()
            .map(|l| l.trim_start_matches("run ").to_string());
        (first, out)
    };
    if !killed(&out.status) {
        assert_eq!(
            out.status.code(),
            Some(0),
            "point {n}: {}",
            sc.fx.explain(&out)
        );
        return false;
    }
    let Some(id) = id.filter(|s| !s.is_empty()).or_else(|| sc.run_id()) else {
        // Killed before the run existed: nothing to resume, and nothing may be half-created.
        assert!(sc.run_id().is_none(), "point {n}");
        return true;
    };
    sc.resume_after_kill(&id, &format!("point {n}"));
    sc.check_final(&id);
    true
}

#[test]
fn killed_at_every_fault_point_the_run_resumes_and_completes() {
    // Count the fault points of an uninterrupted run.
    let reference = Scenario::new();
    let trace = reference.fx.dir.path().join("..").join(format!(
        "trace-{}",
        reference
            .fx
            .dir
            .path()
            .file_name()
            .unwrap()
            .to_string_lossy()
    ));
    let (id, out) = reference
        .fx
        .start(&[("KEEL_FAULT_TRACE", trace.display().to_string())]);
    assert_eq!(out.status.code(), Some(0), "{}", reference.fx.explain(&out));
    reference.check_final(&id);
    let points = std::fs::read_to_string(&trace).unwrap();
    let _ = std::fs::remove_file(&trace);
    let total = points.lines().count() as u64;
    let names: std::collections::BTreeSet<&str> = points
        .lines()
        .filter_map(|l| l.split_once(' ').map(|(_, name)| name))
        .collect();
    for kind in [
        "before commit",
        "after commit",
        "command running",
        "command ended",
        "verifier ended",
        "snapshot written",
    ] {
        assert!(
            names.contains(kind),
            "no `{kind}` fault point in a run: {names:?}"
        );
    }
    assert!(total >= 50, "only {total} fault points in the scenario");

    let mut crashed = 0;
    for n in 1..=total {
        if crash_once_and_resume(n) {
            crashed += 1;
        }
    }
    assert!(crashed >= 50, "only {crashed} kills landed");
    assert!(
        !crash_once_and_resume(total + 1),
        "a run past its last point completes"
    );
}

#[test]
fn a_run_killed_again_and_again_still_completes() {
    let sc = Scenario::new();
    // Every process, the first and each resume, dies at its own fault point until one gets
    // through; the points come from a fixed sequence so a failure replays.
    let mut crash_points = [7u64, 12, 5, 20, 9, 15, 6, 25, 11, 8, 30, 13]
        .iter()
        .cycle();
    let mut id: Option<String> = None;
    let mut kills = 0;
    for _ in 0..200 {
        let n = *crash_points.next().unwrap();
        let mut cmd = sc.fx.keel();
        match &id {
            None => cmd.args(["run", "keel.toml"]),
            Some(id) => cmd.args(["resume", id]),
        };
        let out = cmd.env("KEEL_CRASH_AT", n.to_string()).output().unwrap();
        if id.is_none() {
            id = sc.run_id();
        }
        if killed(&out.status) {
            kills += 1;
            continue;
        }
        assert_eq!(out.status.code(), Some(0), "{}", sc.fx.explain(&out));
        break;
    }
    let id = id.expect("a run was created");
    assert!(kills >= 5, "only {kills} kills");
    sc.check_final(&id);
}

#[test]
fn killed_from_outside_at_arbitrary_instants_the_run_completes() {
    // SIGKILL from another process at instants spread over the run; whatever it hits, resume
    // finishes the run and every invariant holds.
    for (i, delay_ms) in [5u64, 20, 40, 60, 90, 120, 160, 200, 260, 330]
        .into_iter()
        .enumerate()
    {
        let sc = Scenario::new();
        let mut child = sc
            .fx
            .keel()
            .args(["run", "keel.toml"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_millis(delay_ms));
        let _ = child.kill();
        let _ = child.wait();
        let Some(id) = sc.run_id() else { continue };
        sc.resume_after_kill(&id, &format!("kill {i}"));
        sc.check_final(&id);
    }
}

/// `git gc` prunes the loose objects nothing names once they are two weeks old (here all of
/// them, `--prune=now`), and the tree a step starts from is named by nothing of the user's. keel
/// pins it (`refs/keel/<run>/pinned/step`), so a run killed after a command changed the
/// working tree and resumed after such a gc still puts the interrupted step back, and ends as
/// the uninterrupted run does.
#[test]
fn killed_after_a_command_and_resumed_after_git_gc_the_interrupted_step_is_still_put_back() {
    let outside = tempfile::tempdir().unwrap();
    let points = common::fault_points(&contract(&outside.path().join("marker")));
    let commands = points.iter().filter(|p| *p == "command ended").count();
    assert_eq!(commands, 5, "{points:?}");
    for k in 1..=commands {
        let sc = Scenario::new();
        let n = common::nth_point(&points, "command ended", k) as u64 + 1;
        let id = common::killed_at(&sc.fx, n);
        common::git_gc_prune_now(sc.fx.root());
        sc.resume_after_kill(&id, &format!("command {k}, after git gc"));
        sc.check_final(&id);
    }
}

/// When the tree an interrupted step started from is gone all the same (its pin deleted, then
/// `git gc`; or its objects lost with the disk), the resume stops before changing anything,
/// with exit 5 and a message that names the step, the tree and what to do (where it was git's
/// "bad object" on every resume); the log is left intact and the run can still be cancelled.
#[test]
fn a_resume_that_cannot_find_the_interrupted_steps_tree_says_so_and_changes_nothing() {
    let outside = tempfile::tempdir().unwrap();
    let points = common::fault_points(&contract(&outside.path().join("marker")));
    let sc = Scenario::new();
    let n = common::nth_point(&points, "command ended", 2) as u64 + 1;
    let id = common::killed_at(&sc.fx, n);
    let pin = format!("refs/keel/{id}/pinned/step");
    common::git_stdout(sc.fx.root(), &["update-ref", "-d", &pin], b"");
    common::git_gc_prune_now(sc.fx.root());
    refused_and_cancelled(
        &sc,
        &id,
        "out/b.txt",
        &["step 1.2 was interrupted", "is no longer in the repository"],
    );
}

/// `keel resume` of the run `id`, whose starting tree cannot be put back, exits 5 saying each of
/// `says` and how to cancel, and changes nothing: `file` is as the crash left it and the log
/// verifies. The run can still be cancelled, and ends `failed` (exit 5).
fn refused_and_cancelled(sc: &Scenario, id: &str, file: &str, says: &[&str]) {
    let events = sc.fx.stored_events(id).len();
    let files = std::fs::read_to_string(sc.fx.path(file)).unwrap();

    let out = sc.fx.run(&["resume", id]);
    common::assert_no_panic(&out, "resume");
    assert_eq!(out.status.code(), Some(5), "{}", sc.fx.explain(&out));
    let said = common::stderr(&out);
    let cancel = format!("keel cancel {id}");
    for part in says.iter().copied().chain([cancel.as_str()]) {
        assert!(said.contains(part), "`{part}` not in: {said}");
    }
    assert_eq!(
        std::fs::read_to_string(sc.fx.path(file)).unwrap(),
        files,
        "the working tree is left as the crash left it"
    );
    sc.fx.verify_log_ok(id);
    assert!(sc.fx.stored_events(id).len() >= events);

    sc.fx
        .expect(&["cancel", id, "--reason", "its starting tree is gone"], 5);
    assert_eq!(state(&sc.fx.status(id)), "failed");
}

/// The same when the tree is there but the content of a file it holds is not (a loose object
/// deleted, a disk that lost it): the resume names the file and stops before changing
/// anything, where the put-back would have deleted and written files until git could not read
/// that one, leaving the working tree half put back.
#[test]
fn a_resume_whose_starting_tree_lacks_a_files_content_names_it_and_changes_nothing() {
    let outside = tempfile::tempdir().unwrap();
    let points = common::fault_points(&contract(&outside.path().join("marker")));
    let sc = Scenario::new();
    // Killed once step 2.2's command has appended to out/ab.txt: putting it back needs the
    // content step 2.2 started from, which only that step's starting tree holds.
    let n = common::nth_point(&points, "command ended", 4) as u64 + 1;
    let id = common::killed_at(&sc.fx, n);
    let before = common::git_stdout(sc.fx.root(), &["hash-object", "--stdin"], b"a\nb\n");
    let loose = sc
        .fx
        .root()
        .join(".git/objects")
        .join(&before[..2])
        .join(&before[2..]);
    std::fs::remove_file(&loose).unwrap();
    assert_eq!(
        std::fs::read_to_string(sc.fx.path("out/ab.txt")).unwrap(),
        "a\nb\nbuilt\n"
    );
    refused_and_cancelled(
        &sc,
        &id,
        "out/ab.txt",
        &[
            "step 2.2 was interrupted",
            "has objects missing (out/ab.txt",
            &before,
        ],
    );
}
