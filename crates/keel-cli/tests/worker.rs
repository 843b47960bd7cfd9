//! `keel worker`: claims runnable runs (detached, decided, orphaned) and drives them; two workers
//! never drive one run at once; a killed worker's run is taken over and no verified step runs
//! twice; a paused worker's late write is refused by the fencing token; SIGTERM stops a worker at
//! a step boundary.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::Path;
use std::process::{Child, Stdio};
use std::time::Duration;

use common::{Fixture, kinds, state};

/// Three steps that each write their file at once and then take a second. The file comes
/// first: a paused worker's command goes on running, and a write of it landing after another
/// worker took the run over is a change of the workspace that keel (rightly) blocks on as
/// drift; written at once, it lands long before the paused worker's lease can expire.
fn slow_contract(marker: &Path, gated: bool) -> String {
    let m = marker.display();
    format!(
        r#"
[task]
goal = "Three slow steps, each leaving a file."

[[verify]]
name = "all"
tier = "acceptance"
run = "test -f a.txt && test -f b.txt && test -f c.txt"

[[phase]]
name = "slow"
kind = "command"
approval = {gated}
run = [
  "echo a >> {m}; echo a > a.txt; sleep 1",
  "echo b >> {m}; echo b > b.txt; sleep 1",
  "echo c >> {m}; echo c > c.txt; sleep 1",
]
{sandbox}"#,
        sandbox = common::outside_writable()
    )
}

/// `keel run --detach`: the run id.
fn detach(f: &Fixture) -> String {
    let out = f.expect(&["run", "keel.toml", "--detach"], 0);
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .next()
        .unwrap()
        .trim_start_matches("run ")
        .to_string()
}

fn worker(f: &Fixture, args: &[&str]) -> Child {
    f.keel()
        .arg("worker")
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Polls (no timing assertion: a bounded number of looks) until `pred` holds for the run.
fn wait_for(f: &Fixture, id: &str, what: &str, pred: impl Fn(&serde_json::Value) -> bool) {
    for _ in 0..600 {
        if let Ok(out) = f.keel().args(["status", id, "--json"]).output()
            && let Ok(v) = serde_json::from_slice::<serde_json::Value>(&out.stdout)
            && pred(&v)
        {
            return;
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    panic!("the run never got to: {what}");
}

fn step_state(v: &serde_json::Value, i: usize) -> String {
    v["phases"][0]["steps"][i]["state"]
        .as_str()
        .unwrap_or("")
        .to_string()
}

fn signal(child: &Child, sig: &str) {
    let ok = std::process::Command::new("kill")
        .args([sig, &child.id().to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill {sig}");
}

fn executions(marker: &Path) -> Vec<String> {
    std::fs::read_to_string(marker)
        .unwrap_or_default()
        .lines()
        .map(str::to_string)
        .collect()
}

#[test]
fn a_detached_run_is_driven_by_a_worker() {
    let outside = tempfile::tempdir().unwrap();
    let marker = outside.path().join("m");
    let f = Fixture::new(&slow_contract(&marker, false).replace("; sleep 1", ""));
    let id = detach(&f);
    assert_eq!(state(&f.status(&id)), "planned");
    assert!(!marker.exists(), "nothing ran yet");
    let out = f.expect(&["worker", "--once"], 0);
    assert!(String::from_utf8_lossy(&out.stdout).contains("completed"));
    assert_eq!(state(&f.status(&id)), "completed");
    assert_eq!(executions(&marker), ["a", "b", "c"]);
    // Nothing is left to do.
    let out = f.expect(&["worker", "--once"], 0);
    assert!(String::from_utf8_lossy(&out.stdout).trim().is_empty());
}

#[test]
fn a_worker_carries_out_an_approval_that_arrived() {
    let outside = tempfile::tempdir().unwrap();
    let marker = outside.path().join("m");
    let f = Fixture::new(&slow_contract(&marker, true).replace("; sleep 1", ""));
    let (id, out) = f.start(&[]);
    assert_eq!(out.status.code(), Some(3));
    // Waiting for a person is not work for a worker.
    let out = f.expect(&["worker", "--once"], 0);
    assert!(String::from_utf8_lossy(&out.stdout).trim().is_empty());
    let list: serde_json::Value =
        serde_json::from_slice(&f.expect(&["approvals", "--json"], 0).stdout).unwrap();
    let hash = list[0]["payload_hash"].as_str().unwrap();
    f.expect(&["approve", &id, "1", "--payload-hash", hash], 0);
    f.expect(&["worker", "--once"], 0);
    assert_eq!(state(&f.status(&id)), "completed");
    assert_eq!(executions(&marker), ["a", "b", "c"]);
}

#[test]
fn a_killed_worker_is_taken_over_and_no_verified_step_runs_twice() {
    let outside = tempfile::tempdir().unwrap();
    let marker = outside.path().join("m");
    let f = Fixture::new(&slow_contract(&marker, false));
    let id = detach(&f);
    let mut a = worker(&f, &["--lease-ttl", "60s"]);
    // Killed while its second step runs: the first is verified.
    wait_for(&f, &id, "step 2 running", |v| {
        step_state(v, 0) == "verified" && step_state(v, 1) == "in_progress"
    });
    a.kill().unwrap();
    a.wait().unwrap();
    // The dead worker's lease is not waited out: its holder is gone from this machine.
    f.expect(&["worker", "--once"], 0);
    let status = f.status(&id);
    assert_eq!(state(&status), "completed", "{status:#}");
    let runs = executions(&marker);
    assert_eq!(runs.iter().filter(|r| *r == "a").count(), 1, "{runs:?}");
    assert_eq!(runs.iter().filter(|r| *r == "c").count(), 1, "{runs:?}");
    assert!(kinds(&f.events(&id)).contains(&"step_rolled_back".to_string()));
    f.verify_log_ok(&id);
}

#[test]
fn a_paused_workers_late_write_is_refused_by_the_fencing_token() {
    let outside = tempfile::tempdir().unwrap();
    let marker = outside.path().join("m");
    let f = Fixture::new(&slow_contract(&marker, false));
    let id = detach(&f);
    let a = worker(&f, &["--once", "--lease-ttl", "1s"]);
    wait_for(&f, &id, "step 1 running", |v| {
        step_state(v, 0) == "in_progress"
    });
    // Paused mid-step: its heartbeat stops with it, its lease expires, another worker takes the
    // run over and finishes it.
    signal(&a, "-STOP");
    let mut taken = false;
    // What the other workers said, to explain a failure.
    let mut said = Vec::new();
    for _ in 0..200 {
        let out = f.expect(&["worker", "--once", "--lease-ttl", "1s"], 0);
        let stdout = String::from_utf8_lossy(&out.stdout).to_string();
        if stdout.contains("completed") {
            taken = true;
            break;
        }
        if !stdout.trim().is_empty() || !out.stderr.is_empty() {
            said.push(format!("{stdout}{}", String::from_utf8_lossy(&out.stderr)));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        taken,
        "no worker took the run over; they said {said:#?}; the run is {:#}",
        f.status(&id)
    );
    let events_after_takeover = f.events(&id).len();
    // The paused worker wakes up and tries to record the step it was running: refused.
    signal(&a, "-CONT");
    let out = a.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("not driven") && stdout.contains("taken over"),
        "the late writer was not refused:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        f.events(&id).len(),
        events_after_takeover,
        "the late write landed"
    );
    assert_eq!(state(&f.status(&id)), "completed");
    f.verify_log_ok(&id);
}

#[test]
fn sigterm_stops_a_worker_at_a_step_boundary() {
    let outside = tempfile::tempdir().unwrap();
    let marker = outside.path().join("m");
    let f = Fixture::new(&slow_contract(&marker, false));
    let id = detach(&f);
    let a = worker(&f, &[]);
    wait_for(&f, &id, "step 1 running", |v| {
        step_state(v, 0) == "in_progress"
    });
    signal(&a, "-TERM");
    let out = a.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", f.explain(&out));
    let status = f.status(&id);
    // The step it was running was finished and recorded; nothing more was started.
    assert_eq!(step_state(&status, 0), "verified", "{status:#}");
    assert_eq!(step_state(&status, 1), "not_started", "{status:#}");
    assert_eq!(state(&status), "executing");
    // The run is free for the next worker, which finishes it without repeating step 1.
    f.expect(&["worker", "--once"], 0);
    assert_eq!(state(&f.status(&id)), "completed");
    assert_eq!(executions(&marker), ["a", "b", "c"]);
}

#[test]
fn a_worker_killed_while_a_run_waits_leaves_it_for_the_next_and_nothing_runs_twice() {
    let outside = tempfile::tempdir().unwrap();
    let marker = outside.path().join("m");
    let f = Fixture::new(&slow_contract(&marker, true).replace("; sleep 1", ""));
    let id = detach(&f);
    // A worker takes the run to its gate, where it waits for a person, and is killed there.
    let mut a = worker(&f, &[]);
    wait_for(&f, &id, "awaiting approval", |v| {
        v["state"] == "awaiting_approval"
    });
    a.kill().unwrap();
    a.wait().unwrap();
    let list: serde_json::Value =
        serde_json::from_slice(&f.expect(&["approvals", "--json"], 0).stdout).unwrap();
    let hash = list[0]["payload_hash"].as_str().unwrap();
    f.expect(&["approve", &id, "1", "--payload-hash", hash], 0);
    f.expect(&["worker", "--once"], 0);
    assert_eq!(state(&f.status(&id)), "completed");
    assert_eq!(executions(&marker), ["a", "b", "c"]);
    f.verify_log_ok(&id);
}

#[test]
fn a_git_lock_left_by_a_killed_process_does_not_stop_the_next_one() {
    let outside = tempfile::tempdir().unwrap();
    let marker = outside.path().join("m");
    let f = Fixture::new(&slow_contract(&marker, true).replace("; sleep 1", ""));
    let (id, out) = f.start(&[]);
    assert_eq!(out.status.code(), Some(3));
    let checkpoints = f.status(&id)["checkpoints"].as_u64().unwrap();
    // The lock git holds while it moves the next checkpoint's ref, as a killed git leaves it.
    let refs = f.path(&format!(".git/refs/keel/{id}"));
    std::fs::write(refs.join(format!("{checkpoints}.lock")), "").unwrap();
    let list: serde_json::Value =
        serde_json::from_slice(&f.expect(&["approvals", "--json"], 0).stdout).unwrap();
    let hash = list[0]["payload_hash"].as_str().unwrap();
    f.expect(&["approve", &id, "1", "--payload-hash", hash], 0);
    let out = f.expect(&["worker", "--once"], 0);
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("completed"),
        "{}",
        f.explain(&out)
    );
    assert!(refs.join(checkpoints.to_string()).exists());
}

#[test]
fn a_run_that_cannot_be_driven_does_not_keep_a_worker_busy() {
    let outside = tempfile::tempdir().unwrap();
    let marker = outside.path().join("m");
    let f = Fixture::new(&slow_contract(&marker, false).replace("; sleep 1", ""));
    let id = detach(&f);
    // Damage in the middle of the log: resume refuses the run, every time.
    f.tamper(&id, 1, |e| {
        e.body = e.body.replace("run_created", "run_createx")
    });
    f.db()
        .execute("DELETE FROM checkpoints WHERE run_id = ?1", [&id])
        .unwrap();
    let out = f.expect(&["worker", "--once"], 0);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("not driven"), "{}", f.explain(&out));
    assert_eq!(
        stdout.matches("not driven").count(),
        1,
        "tried once: {stdout}"
    );
}
