//! Kill at every boundary of a whole scenario, and during recovery, then hold every run to the
//! invariants and to the outcome of an uninterrupted reference run.
//!
//! The scenario has three phases: a command phase; an agent phase whose scripted driver plans,
//! calls the external service through `http` and through a contract tool (both with the call's
//! idempotency key), writes a file and claims it is done; and a command phase behind a person's
//! approval. The reference run goes straight through (approved when asked) with a fault trace per
//! process, which lists every fault point: before and after every commit (every event
//! boundary), after an effect is intended, while a command runs, after a call and before its
//! result, between a snapshot and its checkpoint. Then, for every point of every process of the
//! reference, a fresh run is SIGKILLed exactly there, resumed (approving when asked) and driven
//! to its end; every third time the first recovery is itself killed, at a point that moves
//! through the recovery's own points. Each run must complete with every invariant of
//! `keel_test_support::invariants` intact, the service must have seen each key at most once and
//! each `done` effect exactly once, and the run's outcome (states, verdicts and trees, effects,
//! approvals, plan, notes, model calls) must equal the reference's.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::BTreeMap;
use std::process::Output;

use common::{Fixture, state};
use keel_core::invariant::Outcome;
use keel_test_support::invariants;
use keel_test_support::service::CountingService;
use serde_json::{Value, json};

fn script(url: &str) -> Vec<Value> {
    vec![
        json!({"tool": "plan", "args": {"items": ["apply a", "apply b", "write two", "finish"]}}),
        json!({"tool": "http", "args": {"method": "POST", "url": format!("{url}/apply"), "body": "a"}}),
        json!({"calls": [
            {"tool": "apply_keyed", "args": {"item": "b"}},
            {"tool": "write", "args": {"path": "notes.txt", "content": "one\ntwo\n"}}
        ]}),
        json!({"tool": "finish", "args": {"summary": "applied a and b, notes has two"}}),
    ]
}

fn contract(script_path: &std::path::Path, url: &str) -> String {
    let port = url.rsplit(':').next().unwrap();
    format!(
        r#"
[task]
goal = "a and b are applied, notes.txt lists one and two, shipped.txt exists."

[driver]
kind = "script"
script = "{script}"

[scope]
writable = ["notes.txt", "shipped.txt"]
http = [{{ host = "127.0.0.1", port = {port}, methods = ["POST"] }}]

[budget]
steps = 40

[[verify]]
name = "notes"
tier = "acceptance"
run = "grep -qx two notes.txt && test -f shipped.txt"

[[verify]]
name = "prepared"
tier = "phase"
run = "test -f notes.txt"

[[phase]]
name = "prepare"
kind = "command"
run = ["printf 'one\\n' > notes.txt"]

[[phase]]
name = "apply"
kind = "agent"
objective = "Apply a and b, then add two to notes.txt."
tools = ["plan", "http", "apply_keyed", "write", "finish"]
done_when = []

[[phase]]
name = "ship"
kind = "command"
approval = true
run = ["printf 'shipped\\n' > shipped.txt"]
done_when = []

{apply_keyed}"#,
        script = script_path.display(),
        apply_keyed = common::apply_keyed_tool(url),
    )
}

struct Scenario {
    fx: Fixture,
    service: CountingService,
    outside: tempfile::TempDir,
}

/// One keel invocation of a scenario: what it does, and whether it is killed at a fault point.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kill {
    Never,
    At(u64),
}

impl Scenario {
    fn new() -> Scenario {
        let service = CountingService::start();
        let outside = tempfile::tempdir().unwrap();
        let path = common::write_script(outside.path(), &script(&service.url()));
        Scenario {
            fx: Fixture::new(&contract(&path, &service.url())),
            service,
            outside,
        }
    }

    fn run_id(&self) -> Option<String> {
        self.fx.stored_run_id()
    }

    /// `keel run` or `keel resume`, killed at `kill`, its fault points traced to `trace`.
    fn invoke(&self, id: Option<&str>, kill: Kill, trace: Option<&str>) -> Output {
        let mut cmd = self.fx.keel();
        match id {
            None => cmd.args(["run", "keel.toml"]),
            Some(id) => cmd.args(["resume", id]),
        };
        if let Kill::At(n) = kill {
            cmd.env("KEEL_CRASH_AT", n.to_string());
        }
        if let Some(name) = trace {
            cmd.env("KEEL_FAULT_TRACE", self.outside.path().join(name));
        }
        cmd.output().unwrap()
    }

    fn traced_points(&self, name: &str) -> u64 {
        std::fs::read_to_string(self.outside.path().join(name))
            .map(|t| t.lines().count() as u64)
            .unwrap_or(0)
    }

    /// Approves the request the run waits for (the phase gate).
    fn approve(&self, id: &str, what: &str) {
        let st = self.fx.status(id);
        let pending: Vec<&Value> = st["approvals"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|a| a["decision"].is_null())
            .collect();
        assert_eq!(pending.len(), 1, "{what}: one request waits: {st:#}");
        let r = pending[0];
        assert_eq!(r["gate"]["gate"], "phase", "{what}: {r:#}");
        self.fx.expect(
            &[
                "approve",
                id,
                &r["n"].as_u64().unwrap().to_string(),
                "--payload-hash",
                r["payload_hash"].as_str().unwrap(),
                "--reason",
                "ship it",
            ],
            0,
        );
    }

    /// The applications the service counted, per key.
    fn applied(&self) -> BTreeMap<String, u64> {
        self.service
            .applications()
            .into_iter()
            .map(|(k, n)| (k, u64::from(n)))
            .collect()
    }

    /// Drives the run to its end from wherever it is: resumes, approves when asked. The
    /// first resume is killed at `recovery_kill`. Returns the run id and whether a recovery
    /// was killed.
    fn drive(&self, what: &str, recovery_kill: Kill) -> (String, bool) {
        let mut kill = recovery_kill;
        let mut killed = false;
        for _ in 1..=10 {
            let id = match self.run_id() {
                Some(id) => id,
                None => {
                    // Killed before the run existed: start again.
                    let out = self.invoke(None, kill, None);
                    killed |= kill != Kill::Never && out.status.code().is_none();
                    kill = Kill::Never;
                    if out.status.code() == Some(0) {
                        return (self.run_id().unwrap(), killed);
                    }
                    continue;
                }
            };
            let st = self.fx.status(&id);
            let undecided = st["approvals"]
                .as_array()
                .is_some_and(|a| a.iter().any(|r| r["decision"].is_null()));
            match state(&st) {
                "completed" => return (id, killed),
                "awaiting_approval" if undecided => self.approve(&id, what),
                _ => {}
            }
            let out = self.invoke(Some(&id), kill, None);
            killed |= kill != Kill::Never && out.status.code().is_none();
            kill = Kill::Never;
            match out.status.code() {
                Some(0) => return (id, killed),
                Some(3) | None => {}
                _ => panic!(
                    "{what}: resume ended unexpectedly\n{}",
                    self.fx.explain(&out)
                ),
            }
        }
        panic!("{what}: the run did not complete after ten processes");
    }

    /// Every invariant of the run, the service's view of its effects, its outcome, and the
    /// files it made.
    fn check(&self, id: &str, what: &str) -> (Outcome, [String; 2]) {
        let db = self.fx.path(".keel/keel.db");
        let audit = invariants::check_effects(&db, id, &["http", "apply_keyed"], &self.applied())
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        let tools: Vec<&str> = audit.effects.iter().map(|e| e.tool.as_str()).collect();
        assert_eq!(tools, ["http", "apply_keyed", "write"], "{what}");
        let mut outcome = Outcome::of(&audit);
        // Effect keys are derived from the run id, and trees cover the contract, which names
        // this scenario's service port and script: both differ from run to run. The files the
        // run made are compared instead.
        for e in &mut outcome.effects {
            e.0 = String::new();
        }
        for verdict in outcome.verdicts.values_mut() {
            verdict.1 = String::new();
        }
        let files = ["notes.txt", "shipped.txt"]
            .map(|f| std::fs::read_to_string(self.fx.path(f)).unwrap_or_default());
        (outcome, files)
    }
}

/// The reference: the scenario without a fault, with the number of fault points of its first
/// process (up to the approval) and of the process that carries on after it.
fn reference() -> ((Outcome, [String; 2]), u64, u64) {
    let s = Scenario::new();
    let out = s.invoke(None, Kill::Never, Some("run"));
    assert_eq!(out.status.code(), Some(3), "{}", s.fx.explain(&out));
    let id = s.run_id().unwrap();
    s.approve(&id, "reference");
    let out = s.invoke(Some(&id), Kill::Never, Some("resume"));
    assert_eq!(out.status.code(), Some(0), "{}", s.fx.explain(&out));
    let outcome = s.check(&id, "reference");
    assert_eq!(
        s.applied().values().sum::<u64>(),
        2,
        "reference: both items applied once"
    );
    (outcome, s.traced_points("run"), s.traced_points("resume"))
}

/// The number of fault points a recovery passes: a run killed at its first commit's end and
/// resumed with a trace.
fn recovery_points() -> u64 {
    let s = Scenario::new();
    let _ = s.invoke(None, Kill::At(8), None);
    let id = s.run_id().expect("the run exists after eight fault points");
    let _ = s.invoke(Some(&id), Kill::Never, Some("recovery"));
    s.traced_points("recovery").max(1)
}

/// The points of one shard of the scenario's processes: (process, point), where process 0 is
/// `keel run` up to the approval and 1 the resume after it. Four shards run side by side.
const SHARDS: u64 = 4;

fn kill_shard(shard: u64) {
    let (expected, run_points, resume_points) = reference();
    assert!(
        run_points > 20 && resume_points > 5,
        "the reference passes fault points: {run_points} before the approval, {resume_points} after"
    );
    let recovery = recovery_points();
    let mut kills = 0u32;
    let mut recovery_kills = 0u32;
    let mut recovered = 0u32;
    let mut cases = 0u32;
    let points = (1..=run_points)
        .map(|n| (0, n))
        .chain((1..=resume_points).map(|n| (1, n)))
        .enumerate()
        .filter(|(i, _)| *i as u64 % SHARDS == shard)
        .map(|(_, p)| p);
    for (process, n) in points {
        cases += 1;
        let what = format!("process {process} killed at fault point {n}");
        let s = Scenario::new();
        // Every third case kills the first recovery too, at a point that moves through the
        // recovery's own points.
        let recovery_kill = if cases.is_multiple_of(3) {
            Kill::At(1 + (u64::from(cases / 3) + shard) % recovery)
        } else {
            Kill::Never
        };
        if process == 0 {
            let out = s.invoke(None, Kill::At(n), None);
            assert_eq!(out.status.code(), None, "{what}: it was killed");
        } else {
            let out = s.invoke(None, Kill::Never, None);
            assert_eq!(out.status.code(), Some(3), "{what}: {}", s.fx.explain(&out));
            let id = s.run_id().unwrap();
            s.approve(&id, &what);
            let out = s.invoke(Some(&id), Kill::At(n), None);
            assert_eq!(out.status.code(), None, "{what}: it was killed");
        }
        kills += 1;
        let (id, killed) = s.drive(&what, recovery_kill);
        recovery_kills += u32::from(killed);
        let (outcome, files) = s.check(&id, &what);
        let differences = outcome.differences(&expected.0);
        assert!(
            differences.is_empty(),
            "{what}: the outcome differs from the reference run's:\n{}",
            differences.join("\n")
        );
        assert_eq!(files, expected.1, "{what}: the files the run made");
        recovered += 1;
    }
    println!(
        "kill at every boundary, shard {} of {SHARDS}: {recovered} of {cases} runs recovered \
         ({:.1}%) after {} kills ({kills} at a boundary, {recovery_kills} during recovery)",
        shard + 1,
        f64::from(recovered) * 100.0 / f64::from(cases),
        kills + recovery_kills
    );
    assert_eq!(recovered, cases);
    assert!(
        recovery_kills >= cases / 6,
        "recoveries were killed too: {recovery_kills} of {cases}"
    );
}

#[test]
fn killed_at_every_boundary_and_during_recovery_shard_1() {
    kill_shard(0);
}

#[test]
fn killed_at_every_boundary_and_during_recovery_shard_2() {
    kill_shard(1);
}

#[test]
fn killed_at_every_boundary_and_during_recovery_shard_3() {
    kill_shard(2);
}

#[test]
fn killed_at_every_boundary_and_during_recovery_shard_4() {
    kill_shard(3);
}
