//! Approval gates: a gated phase stops the run waiting for a person (exit 3, no process left),
//! the request carries the exact payload and its hash, a decision applies only to that hash, is
//! recorded once however often it is delivered, and `keel resume` carries out what was approved.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{Fixture, kinds, state};
use serde_json::Value;

struct Gated {
    f: Fixture,
    _outside: tempfile::TempDir,
    marker: std::path::PathBuf,
    id: String,
}

fn gated() -> Gated {
    let outside = tempfile::tempdir().unwrap();
    let marker = outside.path().join("published-count");
    let f = Fixture::new(&common::publish_contract(&marker));
    let (id, out) = f.start(&[]);
    assert_eq!(out.status.code(), Some(3), "{}", f.explain(&out));
    assert!(String::from_utf8_lossy(&out.stdout).contains("awaiting_approval"));
    Gated {
        f,
        _outside: outside,
        marker,
        id,
    }
}

fn pending(f: &Fixture) -> Vec<Value> {
    let out = f.expect(&["approvals", "--json"], 0);
    serde_json::from_slice::<Value>(&out.stdout)
        .unwrap()
        .as_array()
        .unwrap()
        .clone()
}

#[test]
fn a_gated_phase_waits_with_its_exact_payload_and_an_approval_lets_resume_finish() {
    let g = gated();
    let f = &g.f;
    assert_eq!(state(&f.status(&g.id)), "awaiting_approval");
    assert!(
        !f.path("published.txt").exists(),
        "nothing ran before the approval"
    );
    let list = pending(f);
    assert_eq!(list.len(), 1);
    let request = &list[0];
    let payload = request["payload"].as_str().unwrap();
    assert!(payload.contains("cp note.txt published.txt"), "{payload}");
    assert!(
        payload.contains("+note"),
        "the diff so far is shown: {payload}"
    );
    let hash = request["payload_hash"].as_str().unwrap();
    assert_eq!(hash, blake3::hash(payload.as_bytes()).to_hex().as_str());
    for key in ["intent", "risk", "rollback", "checks", "reversibility"] {
        assert!(!request[key].is_null(), "request has no {key}: {request:#}");
    }
    // Nothing happens by resuming without a decision.
    f.expect(&["resume", &g.id], 3);

    f.expect(
        &[
            "approve",
            &g.id,
            "1",
            "--payload-hash",
            hash,
            "--reason",
            "ok",
        ],
        0,
    );
    f.expect(&["resume", &g.id], 0);
    assert!(f.path("published.txt").exists());
    let status = f.status(&g.id);
    assert_eq!(state(&status), "completed");
    assert!(status["human_wait_ms"].as_u64().is_some());
    assert_eq!(status["approvals"][0]["decision"]["approve"], true);
    f.verify_log_ok(&g.id);
}

#[test]
fn a_stale_payload_hash_is_refused_and_changes_nothing() {
    let g = gated();
    let f = &g.f;
    let before = f.events(&g.id).len();
    let out = f.expect(
        &["approve", &g.id, "1", "--payload-hash", &"0".repeat(64)],
        2,
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("payload changed"), "{err}");
    assert_eq!(f.events(&g.id).len(), before);
    f.expect(&["resume", &g.id], 3);
    assert!(!f.path("published.txt").exists());
}

#[test]
fn the_same_approval_delivered_twice_is_one_decision_and_one_execution() {
    let g = gated();
    let f = &g.f;
    let hash = pending(f)[0]["payload_hash"].as_str().unwrap().to_string();
    let approve = ["approve", &g.id, "1", "--payload-hash", &hash];
    f.expect(&approve, 0);
    let out = f.expect(&approve, 0);
    assert!(String::from_utf8_lossy(&out.stdout).contains("already approved"));
    // A conflicting decision after it is refused.
    f.expect(
        &[
            "reject",
            &g.id,
            "1",
            "--payload-hash",
            &hash,
            "--reason",
            "no",
        ],
        2,
    );
    f.expect(&["resume", &g.id], 0);
    f.expect(&["resume", &g.id], 0);
    let decided = kinds(&f.events(&g.id))
        .iter()
        .filter(|k| *k == "approval_decided")
        .count();
    assert_eq!(decided, 1);
    assert_eq!(
        std::fs::read_to_string(&g.marker).unwrap(),
        "published\n",
        "the gated action ran once"
    );
}

#[test]
fn concurrent_approvals_make_one_decision() {
    let g = gated();
    let f = &g.f;
    let hash = pending(f)[0]["payload_hash"].as_str().unwrap().to_string();
    let children: Vec<_> = (0..4)
        .map(|_| {
            f.keel()
                .args(["approve", &g.id, "1", "--payload-hash", &hash])
                .output()
        })
        .collect();
    for out in children {
        assert_eq!(out.unwrap().status.code(), Some(0));
    }
    let decided = kinds(&f.events(&g.id))
        .iter()
        .filter(|k| *k == "approval_decided")
        .count();
    assert_eq!(decided, 1);
}

#[test]
fn a_rejection_blocks_the_run_and_the_gated_action_never_runs() {
    let g = gated();
    let f = &g.f;
    let hash = pending(f)[0]["payload_hash"].as_str().unwrap().to_string();
    // A rejection needs a reason.
    f.expect(
        &[
            "reject",
            &g.id,
            "1",
            "--payload-hash",
            &hash,
            "--reason",
            " ",
        ],
        2,
    );
    f.expect(
        &[
            "reject",
            &g.id,
            "1",
            "--payload-hash",
            &hash,
            "--reason",
            "not today",
        ],
        0,
    );
    let out = f.expect(&["resume", &g.id], 4);
    assert!(String::from_utf8_lossy(&out.stdout).contains("not today"));
    let status = f.status(&g.id);
    assert_eq!(status["block"]["cause"], "rejected");
    assert!(!f.path("published.txt").exists());
    assert!(!g.marker.exists());
    f.expect(&["resume", &g.id], 4);
}

#[test]
fn the_approvals_budget_bounds_how_often_a_person_is_asked() {
    let outside = tempfile::tempdir().unwrap();
    let marker = outside.path().join("m");
    let text = format!(
        "{}\n[budget]\napprovals = 1\n",
        common::publish_contract(&marker)
    )
    .replace("[budget]\napprovals = 1\n", "")
    .replace("[task]", "[budget]\napprovals = 1\n\n[task]");
    // Two gated phases, one approval allowed.
    let text = format!(
        "{text}\n[[phase]]\nname = \"announce\"\nkind = \"command\"\napproval = true\nrun = [\"echo hi > announced.txt\"]\n"
    );
    let f = Fixture::new(&text);
    let (id, out) = f.start(&[]);
    assert_eq!(out.status.code(), Some(3), "{}", f.explain(&out));
    let hash = pending(&f)[0]["payload_hash"].as_str().unwrap().to_string();
    f.expect(&["approve", &id, "1", "--payload-hash", &hash], 0);
    let out = f.expect(&["resume", &id], 4);
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("budget `approvals` exhausted"),
        "{}",
        f.explain(&out)
    );
    assert!(f.path("published.txt").exists());
    assert!(!f.path("announced.txt").exists());
}

#[test]
fn the_notify_command_gets_the_request_and_its_failure_never_blocks() {
    let outside = tempfile::tempdir().unwrap();
    let marker = outside.path().join("m");
    let inbox = outside.path().join("inbox.json");
    let text = common::publish_contract(&marker).replace(
        "[task]",
        &format!(
            "[approvals]\nnotify = \"cat > {}\"\n\n[task]",
            inbox.display()
        ),
    );
    let f = Fixture::new(&text);
    let (id, out) = f.start(&[]);
    assert_eq!(out.status.code(), Some(3), "{}", f.explain(&out));
    let sent: Value = serde_json::from_str(&std::fs::read_to_string(&inbox).unwrap()).unwrap();
    assert_eq!(sent["run"], id.as_str());
    assert_eq!(sent["kind"], "approval");
    assert_eq!(
        sent["request"]["payload_hash"],
        pending(&f)[0]["payload_hash"]
    );
    // A hook that fails is recorded, and the run waits all the same.
    let f = Fixture::new(&common::publish_contract(&marker).replace(
        "[task]",
        "[approvals]\nnotify = \"echo the chat is down >&2; exit 7\"\n\n[task]",
    ));
    let (id, out) = f.start(&[]);
    assert_eq!(out.status.code(), Some(3), "{}", f.explain(&out));
    let notified = f
        .events(&id)
        .into_iter()
        .find(|e| e["kind"] == "notified")
        .unwrap();
    assert_eq!(notified["body"]["ok"], false);
    assert_eq!(notified["body"]["status"], "exit 7");
    assert_eq!(state(&f.status(&id)), "awaiting_approval");
}

#[test]
fn a_request_nobody_decides_in_time_ends_as_the_contract_says() {
    let outside = tempfile::tempdir().unwrap();
    let marker = outside.path().join("m");
    for (on_expiry, blocked_word) in [
        ("reject", "counts as rejected"),
        ("block", "a person decides"),
    ] {
        let f = Fixture::new(&common::publish_contract(&marker).replace(
            "[task]",
            &format!("[approvals]\nexpires = \"1ms\"\non_expiry = \"{on_expiry}\"\n\n[task]"),
        ));
        let (id, out) = f.start(&[]);
        assert_eq!(out.status.code(), Some(3), "{}", f.explain(&out));
        // The deadline has passed by the time a worker looks.
        let out = f.expect(&["worker", "--once"], 0);
        assert!(
            String::from_utf8_lossy(&out.stdout).contains("blocked"),
            "{}",
            f.explain(&out)
        );
        let status = f.status(&id);
        assert_eq!(state(&status), "blocked");
        assert!(
            status["reason"].as_str().unwrap().contains(blocked_word),
            "{status:#}"
        );
        assert_eq!(status["approvals"][0]["decision"]["via"], "expiry");
        assert!(!f.path("published.txt").exists());
    }
}

/// An agent phase that asks which colour, then writes it; its script is `actions.jsonl`.
const ASKS_THEN_WRITES: &str = r#"
[task]
goal = "answer.txt holds the colour a person chose"

[driver]
kind = "script"
script = "actions.jsonl"

[[verify]]
name = "answered"
tier = "acceptance"
run = "grep -qx blue answer.txt"

[[phase]]
name = "ask"
kind = "agent"
objective = "Ask which colour, then write it to answer.txt."
"#;

#[test]
fn a_question_waits_for_its_answer_which_the_driver_then_sees() {
    let f = Fixture::new(ASKS_THEN_WRITES);
    std::fs::write(
        f.path("actions.jsonl"),
        concat!(
            r#"{"tool": "ask", "args": {"question": "Which colour?"}}"#,
            "\n",
            r#"{"calls": [{"tool": "write", "args": {"path": "answer.txt", "content": "blue\n"}}, {"tool": "finish", "args": {"summary": "wrote it"}}]}"#,
            "\n"
        ),
    )
    .unwrap();
    let (id, out) = f.start(&[]);
    assert_eq!(out.status.code(), Some(3), "{}", f.explain(&out));
    let status = f.status(&id);
    assert_eq!(state(&status), "waiting");
    assert_eq!(status["questions"][0]["question"], "Which colour?");
    // Not answered: nothing to do.
    f.expect(&["resume", &id], 3);
    f.expect(&["answer", &id, "1", "blue"], 0);
    let again = f.expect(&["answer", &id, "1", "blue"], 0);
    assert!(String::from_utf8_lossy(&again.stdout).contains("already answered"));
    f.expect(&["answer", &id, "1", "red"], 2);
    f.expect(&["resume", &id], 0);
    assert_eq!(state(&f.status(&id)), "completed");
    // The second prompt carried the answer.
    let requests: Vec<Value> = f
        .events(&id)
        .into_iter()
        .filter(|e| e["kind"] == "model_requested")
        .collect();
    let hash = requests[1]["body"]["request"].as_str().unwrap();
    let bytes = f.artifact(hash);
    let prompt: Value = serde_json::from_slice(&bytes).unwrap();
    assert!(
        prompt["user"]
            .as_str()
            .unwrap()
            .contains("blue (answered by"),
        "{prompt:#}"
    );
}

/// Found by the seeded engine simulation: the step that asked a question was stored, then the
/// commit that set the run waiting failed, and `keel resume` went on to the next step with the
/// question unanswered. The wait is now stored with the step's end (and a run found going on
/// past an unanswered question waits for it). Each time here the resumed run waits for the
/// answer, the next step has not run, and the answer lets it complete.
#[test]
fn a_failed_commit_around_a_question_never_lets_the_run_go_on_unanswered() {
    let script = concat!(
        r#"{"tool": "ask", "args": {"question": "Which colour?"}}"#,
        "\n",
        r#"{"calls": [{"tool": "write", "args": {"path": "answer.txt", "content": "blue\n"}}, {"tool": "finish", "args": {"summary": "wrote it"}}]}"#,
        "\n"
    );
    common::with_each_commit_failing(ASKS_THEN_WRITES, script, |f, id, what| {
        common::assert_no_panic(&f.run(&["resume", id]), what);
        let status = f.status(id);
        assert_eq!(state(&status), "waiting", "{what}: {status:#}");
        assert!(status["questions"][0]["answer"].is_null(), "{what}");
        assert!(!f.path("answer.txt").exists(), "{what}: the next step ran");
        f.expect(&["answer", id, "1", "blue"], 0);
        f.expect(&["resume", id], 0);
        f.verify_log_ok(id);
    });
}

/// The same for the driver's `blocked`: the stop is stored with the step that made it, so a
/// failed commit cannot lose it and let the run take its next step. (`keel resume` of a run the
/// driver stopped is a person telling it to go on, so the check is on the log: the stop comes
/// before any second step.)
#[test]
fn a_failed_commit_around_the_drivers_stop_never_loses_the_stop() {
    let script = concat!(
        r#"{"tool": "blocked", "args": {"category": "ambiguity", "reason": "no colour given"}}"#,
        "\n",
        r#"{"calls": [{"tool": "write", "args": {"path": "answer.txt", "content": "blue\n"}}, {"tool": "finish", "args": {"summary": "wrote it"}}]}"#,
        "\n"
    );
    common::with_each_commit_failing(ASKS_THEN_WRITES, script, |f, id, what| {
        common::assert_no_panic(&f.run(&["resume", id]), what);
        let events = f.events(id);
        let stop = events
            .iter()
            .position(|e| e["kind"] == "state_changed" && e["body"]["block"]["cause"] == "driver");
        let second = events
            .iter()
            .position(|e| e["kind"] == "step_started" && e["body"]["step"]["index"] == 1);
        assert!(
            stop.is_some_and(|stop| second.is_none_or(|second| stop < second)),
            "{what}: the driver's stop is recorded before any next step: {:?}",
            kinds(&events)
        );
        f.verify_log_ok(id);
    });
}

#[test]
fn a_budget_block_asks_for_a_raise_that_an_approval_grants() {
    let outside = tempfile::tempdir().unwrap();
    let marker = outside.path().join("m");
    let text = common::publish_contract(&marker)
        .replace("approval = true\n", "")
        .replace("[task]", "[budget]\nsteps = 1\n\n[task]");
    let f = Fixture::new(&text);
    let (id, out) = f.start(&[]);
    assert_eq!(out.status.code(), Some(4), "{}", f.explain(&out));
    let list = pending(&f);
    assert_eq!(list.len(), 1, "{list:#?}");
    assert_eq!(list[0]["gate"]["gate"], "budget_raise");
    assert_eq!(list[0]["gate"]["budget"], "steps");
    let payload = list[0]["payload"].as_str().unwrap();
    assert!(payload.contains("from 1 to 2"), "{payload}");
    let hash = list[0]["payload_hash"].as_str().unwrap();
    f.keel()
        .args([
            "approve",
            &id,
            "1",
            "--payload-hash",
            hash,
            "--reason",
            "fine",
        ])
        .env("KEEL_USER", "alice")
        .output()
        .unwrap();
    f.expect(&["worker", "--once"], 0);
    assert_eq!(state(&f.status(&id)), "completed");
    let raised = f
        .events(&id)
        .into_iter()
        .find(|e| e["kind"] == "budget_raised")
        .unwrap();
    assert_eq!(raised["body"]["by"], "alice");
    assert_eq!(raised["body"]["to"], 2);
}

/// Found by the seeded engine simulation: a block and the request beside it (raise the budget,
/// accept the changed environment) were two commits, and a failure between them left a block
/// whose request never reached the inbox. They are one commit now: whichever commit fails, the
/// resumed run is blocked with its request waiting.
#[test]
fn a_failed_commit_never_leaves_a_budget_block_without_its_request() {
    let outside = tempfile::tempdir().unwrap();
    let marker = outside.path().join("m");
    let text = common::publish_contract(&marker)
        .replace("approval = true\n", "")
        .replace("[task]", "[budget]\nsteps = 1\n\n[task]");
    common::with_each_commit_failing(&text, "", |f, id, what| {
        common::assert_no_panic(&f.run(&["resume", id]), what);
        let status = f.status(id);
        assert_eq!(state(&status), "blocked", "{what}: {status:#}");
        let list = pending(f);
        assert_eq!(list.len(), 1, "{what}: {list:#?}");
        assert_eq!(list[0]["gate"]["gate"], "budget_raise", "{what}");
        f.verify_log_ok(id);
    });
}

#[test]
fn a_drift_block_asks_whether_to_migrate_and_an_approval_migrates() {
    let outside = tempfile::tempdir().unwrap();
    let marker = outside.path().join("m");
    let text = common::publish_contract(&marker).replace("approval = true\n", "");
    let f = Fixture::new(&text);
    // Killed right after the first step was verified (the second-to-last commit of step 1).
    let points = common::fault_points(&text);
    let after_verified = points
        .iter()
        .enumerate()
        .filter(|(_, p)| p.as_str() == "after commit")
        .map(|(i, _)| i + 1)
        .find(|&n| {
            let f2 = Fixture::new(&text);
            let (id, _) = f2.start(&[("KEEL_CRASH_AT", n.to_string())]);
            f2.events(&id)
                .last()
                .is_some_and(|e| e["kind"] == "step_verified")
        })
        .unwrap();
    let (id, out) = f.start(&[("KEEL_CRASH_AT", after_verified.to_string())]);
    assert_eq!(out.status.code(), None, "{}", f.explain(&out));
    std::fs::write(f.path("README.md"), "changed by a person\n").unwrap();
    f.expect(&["resume", &id], 4);
    let list = pending(&f);
    assert_eq!(list.len(), 1, "{list:#?}");
    assert_eq!(list[0]["gate"]["gate"], "migration");
    assert!(list[0]["payload"].as_str().unwrap().contains("README.md"));
    let hash = list[0]["payload_hash"].as_str().unwrap();
    f.expect(
        &[
            "approve",
            &id,
            "1",
            "--payload-hash",
            hash,
            "--reason",
            "my edit",
        ],
        0,
    );
    f.expect(&["resume", &id], 0);
    let migrated = f
        .events(&id)
        .into_iter()
        .find(|e| e["kind"] == "migrated")
        .unwrap();
    assert!(
        migrated["body"]["reason"]
            .as_str()
            .unwrap()
            .contains("my edit")
    );
}

/// A block's request waits in the inbox; the person settles the block on the command line
/// instead (`keel unblock`, `keel resume --migrate`). The request is closed with what they did,
/// so nobody approves it later, and approving it again changes nothing.
#[test]
fn a_request_beside_a_block_is_closed_when_a_person_settles_the_block_on_the_command_line() {
    let outside = tempfile::tempdir().unwrap();
    let marker = outside.path().join("m");
    let text = common::publish_contract(&marker)
        .replace("approval = true\n", "")
        .replace("[task]", "[budget]\nsteps = 1\n\n[task]");
    let f = Fixture::new(&text);
    let (id, out) = f.start(&[]);
    assert_eq!(out.status.code(), Some(4), "{}", f.explain(&out));
    let list = pending(&f);
    assert_eq!(list.len(), 1, "{list:#?}");
    assert_eq!(list[0]["gate"]["gate"], "budget_raise");
    let hash = list[0]["payload_hash"].as_str().unwrap().to_string();
    let out = f
        .keel()
        .args(["unblock", &id, "--budget", "steps=+5", "--reason", "more"])
        .env("KEEL_USER", "bob")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", f.explain(&out));
    assert!(pending(&f).is_empty(), "{:#?}", pending(&f));
    let st = f.status(&id);
    let decision = &st["approvals"][0]["decision"];
    assert_eq!(decision["approve"], true, "{st:#}");
    assert_eq!(decision["by"], "bob");
    assert_eq!(decision["via"], "command line");
    // One raise, the person's: +5 from 1.
    let raises: Vec<Value> = f
        .events(&id)
        .into_iter()
        .filter(|e| e["kind"] == "budget_raised")
        .collect();
    assert_eq!(raises.len(), 1, "{raises:#?}");
    assert_eq!(raises[0]["body"]["to"], 6);
    // Approving the closed request later is "already decided", and changes nothing.
    let before = f.events(&id).len();
    let out = f.run(&[
        "approve",
        &id,
        "1",
        "--payload-hash",
        &hash,
        "--reason",
        "late",
    ]);
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("already")
            || String::from_utf8_lossy(&out.stderr).contains("already"),
        "{}",
        f.explain(&out)
    );
    assert_eq!(f.events(&id).len(), before);

    // Drift: the migration request is closed by `keel resume --migrate`.
    let f = Fixture::new(&common::publish_contract(&marker));
    let (id, out) = f.start(&[]);
    assert_eq!(out.status.code(), Some(3), "{}", f.explain(&out));
    let gate = pending(&f)[0].clone();
    f.expect(
        &[
            "approve",
            &id,
            "1",
            "--payload-hash",
            gate["payload_hash"].as_str().unwrap(),
            "--reason",
            "go",
        ],
        0,
    );
    common::git(
        f.root(),
        &["commit", "-q", "--allow-empty", "-m", "meanwhile"],
    );
    f.expect(&["resume", &id], 4);
    let list = pending(&f);
    assert_eq!(list.len(), 1, "{list:#?}");
    assert_eq!(list[0]["gate"]["gate"], "migration");
    f.expect(&["resume", &id, "--migrate", "--reason", "rebased"], 0);
    assert!(pending(&f).is_empty(), "{:#?}", pending(&f));
    let st = f.status(&id);
    assert_eq!(state(&st), "completed");
    assert_eq!(
        st["approvals"][1]["decision"]["via"], "command line",
        "{st:#}"
    );
    f.verify_log_ok(&id);
}
