//! Delivery faults: decisions, answers and results that arrive more than once, out of order or
//! at the same time.
//!
//! - approvals and rejections delivered one to three times each, in seeded random orders, one
//!   after another and all at once: the first decision is the one recorded, a repeat of it
//!   changes nothing, a different one is refused in words, and the gated action runs at most
//!   once even when two resumes race;
//! - answers to a question delivered several times, differing, all at once: the first counts
//!   and is what the driver sees;
//! - a model reply handed to a resumed run again, and different this time: the recorded reply
//!   is the one acted on;
//! - N workers started at once on one runnable run: exactly one drives it, nothing runs twice.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{Output, Stdio};

use common::{Fixture, Rng, assert_no_panic, fault_points, kinds, of_kind, state, stderr, stdout};
use serde_json::Value;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Decision {
    Approve,
    Reject,
}

fn decision_args(d: Decision, id: &str, hash: &str) -> Vec<String> {
    let mut args = vec![
        match d {
            Decision::Approve => "approve",
            Decision::Reject => "reject",
        }
        .to_string(),
        id.to_string(),
        "1".to_string(),
        "--payload-hash".to_string(),
        hash.to_string(),
    ];
    if d == Decision::Reject {
        args.extend(["--reason".to_string(), "not now".to_string()]);
    }
    args
}

/// Checks one delivery's answer against the decision that was recorded.
fn check_delivery(out: &Output, d: Decision, recorded: Decision, first: bool, context: &str) {
    assert_no_panic(out, context);
    if d == recorded {
        assert_eq!(
            out.status.code(),
            Some(0),
            "{context}: {d:?}\n{}",
            stderr(out)
        );
        if !first {
            assert!(
                stdout(out).contains("already") || stdout(out).contains("recorded"),
                "{context}: {d:?} {}",
                stdout(out)
            );
        }
    } else {
        assert_eq!(
            out.status.code(),
            Some(2),
            "{context}: {d:?}\n{}",
            stdout(out)
        );
        assert!(
            stderr(out).contains("a decision cannot be changed"),
            "{context}: a conflicting decision is refused in words: {}",
            stderr(out)
        );
    }
}

/// After the decision: two resumes race; the action ran once if approved, never if rejected.
fn check_outcome(f: &Fixture, id: &str, marker: &Path, recorded: Decision, context: &str) {
    let resumes: Vec<_> = (0..2)
        .map(|_| {
            f.keel()
                .args(["resume", id])
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for r in resumes {
        let out = r.wait_with_output().unwrap();
        assert_no_panic(&out, context);
    }
    // Whichever resume lost the race may have stopped early; one more finishes the work.
    let _ = f.run(&["resume", id]);
    let events = f.events(id);
    assert_eq!(
        of_kind(&events, "approval_decided").len(),
        1,
        "{context}: one decision recorded"
    );
    let decided = of_kind(&events, "approval_decided")[0]["body"]["approve"] == true;
    assert_eq!(decided, recorded == Decision::Approve, "{context}");
    let published = std::fs::read_to_string(marker).unwrap_or_default();
    match recorded {
        Decision::Approve => {
            assert_eq!(state(&f.status(id)), "completed", "{context}");
            assert_eq!(
                published, "published\n",
                "{context}: the gated action ran once"
            );
        }
        Decision::Reject => {
            assert_eq!(state(&f.status(id)), "blocked", "{context}");
            assert_eq!(published, "", "{context}: a rejected action never runs");
        }
    }
    f.verify_log_ok(id);
}

fn payload_hash(f: &Fixture) -> String {
    let list: Value =
        serde_json::from_slice(&f.expect(&["approvals", "--json"], 0).stdout).unwrap();
    list[0]["payload_hash"].as_str().unwrap().to_string()
}

/// Approve and reject, each one to three times, shuffled.
fn deliveries(rng: &mut Rng) -> Vec<Decision> {
    let mut all = Vec::new();
    for d in [Decision::Approve, Decision::Reject] {
        for _ in 0..rng.range(1, 4) {
            all.push(d);
        }
    }
    rng.shuffle(&mut all);
    all
}

#[test]
fn decisions_delivered_repeatedly_in_random_orders_count_once_and_first() {
    let mut rng = Rng::seeded("decisions in random orders");
    for trial in 0..3 {
        let outside = tempfile::tempdir().unwrap();
        let marker = outside.path().join("published");
        let f = Fixture::new(&common::publish_contract(&marker));
        let (id, out) = f.start(&[]);
        assert_eq!(out.status.code(), Some(3), "{}", f.explain(&out));
        let hash = payload_hash(&f);
        let order = deliveries(&mut rng);
        let context = format!("trial {trial}, one after another: {order:?}");
        let recorded = order[0];
        for (i, d) in order.iter().enumerate() {
            let out = f
                .keel()
                .args(decision_args(*d, &id, &hash))
                .output()
                .unwrap();
            check_delivery(&out, *d, recorded, i == 0, &context);
        }
        check_outcome(&f, &id, &marker, recorded, &context);
    }
}

#[test]
fn decisions_delivered_all_at_once_make_one_decision() {
    let mut rng = Rng::seeded("decisions at once");
    for trial in 0..3 {
        let outside = tempfile::tempdir().unwrap();
        let marker = outside.path().join("published");
        let f = Fixture::new(&common::publish_contract(&marker));
        let (id, out) = f.start(&[]);
        assert_eq!(out.status.code(), Some(3), "{}", f.explain(&out));
        let hash = payload_hash(&f);
        let order = deliveries(&mut rng);
        let context = format!("trial {trial}, all at once: {order:?}");
        let children: Vec<_> = order
            .iter()
            .map(|d| {
                f.keel()
                    .args(decision_args(*d, &id, &hash))
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped())
                    .spawn()
                    .unwrap()
            })
            .collect();
        let outs: Vec<Output> = children
            .into_iter()
            .map(|c| c.wait_with_output().unwrap())
            .collect();
        let events = f.events(&id);
        let decided = of_kind(&events, "approval_decided");
        assert_eq!(decided.len(), 1, "{context}");
        let recorded = if decided[0]["body"]["approve"] == true {
            Decision::Approve
        } else {
            Decision::Reject
        };
        // Exactly one delivery recorded it; the others saw it already there.
        let recorders = outs
            .iter()
            .filter(|o| !stdout(o).contains("already") && o.status.code() == Some(0))
            .count();
        assert_eq!(recorders, 1, "{context}");
        for (d, out) in order.iter().zip(&outs) {
            check_delivery(out, *d, recorded, true, &context);
        }
        check_outcome(&f, &id, &marker, recorded, &context);
    }
}

#[test]
fn answers_delivered_repeatedly_and_at_once_the_first_counts() {
    let mut rng = Rng::seeded("answers at once");
    let f = Fixture::new(
        r#"
[task]
goal = "answer.txt holds the colour a person chose"

[driver]
kind = "script"
script = "actions.jsonl"

[[verify]]
name = "answered"
tier = "acceptance"
run = "test -s answer.txt"

[[phase]]
name = "ask"
kind = "agent"
objective = "Ask which colour, then write it to answer.txt."
"#,
    );
    std::fs::write(
        f.path("actions.jsonl"),
        concat!(
            r#"{"tool": "ask", "args": {"question": "Which colour?"}}"#,
            "\n",
            r#"{"calls": [{"tool": "write", "args": {"path": "answer.txt", "content": "chosen\n"}}, {"tool": "finish", "args": {"summary": "wrote it"}}]}"#,
            "\n"
        ),
    )
    .unwrap();
    let (id, out) = f.start(&[]);
    assert_eq!(out.status.code(), Some(3), "{}", f.explain(&out));
    let mut answers: Vec<&str> = Vec::new();
    for colour in ["blue", "red", "green"] {
        for _ in 0..rng.range(1, 4) {
            answers.push(colour);
        }
    }
    rng.shuffle(&mut answers);
    let children: Vec<_> = answers
        .iter()
        .map(|a| {
            f.keel()
                .args(["answer", &id, "1", a])
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let outs: Vec<Output> = children
        .into_iter()
        .map(|c| c.wait_with_output().unwrap())
        .collect();
    let events = f.events(&id);
    let answered = of_kind(&events, "question_answered");
    assert_eq!(answered.len(), 1, "{answers:?}");
    let recorded = answered[0]["body"]["answer"].as_str().unwrap().to_string();
    for (a, out) in answers.iter().zip(&outs) {
        assert_no_panic(out, a);
        if *a == recorded {
            assert_eq!(out.status.code(), Some(0), "{a}: {}", stderr(out));
        } else {
            assert_eq!(out.status.code(), Some(2), "{a}: {}", stdout(out));
            assert!(
                stderr(out).contains("an answer cannot be changed"),
                "{}",
                stderr(out)
            );
        }
    }
    // Later deliveries, one after another, change nothing either.
    for a in ["blue", "red", "green"] {
        let out = f.run(&["answer", &id, "1", a]);
        assert_eq!(
            out.status.code(),
            Some(if a == recorded { 0 } else { 2 }),
            "{a}"
        );
    }
    f.expect(&["resume", &id], 0);
    assert_eq!(state(&f.status(&id)), "completed");
    // The driver was shown the recorded answer, and only it.
    let requests = of_kind(&f.events(&id), "model_requested")
        .into_iter()
        .cloned()
        .collect::<Vec<_>>();
    let hash = requests[1]["body"]["request"].as_str().unwrap();
    let prompt = String::from_utf8(f.artifact(hash)).unwrap();
    assert!(
        prompt.contains(&format!("{recorded} (answered by")),
        "{prompt}"
    );
    for other in ["blue", "red", "green"].iter().filter(|c| **c != recorded) {
        assert!(
            !prompt.contains(&format!("{other} (answered by")),
            "{prompt}"
        );
    }
    f.verify_log_ok(&id);
}

#[test]
fn a_model_reply_handed_again_and_different_after_a_crash_is_not_what_counts() {
    // The script driver's line N is model call N's reply. The run is killed right after the
    // first reply was recorded; then the script (outside the workspace) is changed, so that
    // asking again would bring a different answer. Resume acts on the recorded reply and does
    // not ask again.
    let script = concat!(
        r#"{"calls": [{"tool": "write", "args": {"path": "out.txt", "content": "first\n"}}]}"#,
        "\n",
        r#"{"tool": "finish", "args": {"summary": "done"}}"#,
        "\n"
    );
    let outside = tempfile::tempdir().unwrap();
    let contract_for = |name: &str| {
        let path = outside.path().join(name);
        std::fs::write(&path, script).unwrap();
        format!(
            r#"
[task]
goal = "out.txt holds the first answer"

[driver]
kind = "script"
script = "{}"

[scope]
writable = ["out.txt"]

[[verify]]
name = "written"
tier = "acceptance"
run = "test -s out.txt"

[[phase]]
name = "write"
kind = "agent"
objective = "Write the answer to out.txt."
"#,
            path.display()
        )
    };
    let points = fault_points(&contract_for("twin.jsonl"));
    // The fault point right after the first model reply's commit: the first `after commit` at
    // which a killed run's log holds `model_replied` and the call is not made yet. (A script
    // driver's reply is stored with the first thing its step does outside keel: here the
    // write's decision and intended effect.)
    let replied_not_made = |events: &[Value]| {
        !of_kind(events, "model_replied").is_empty()
            && of_kind(events, "tool_call_finished").is_empty()
    };
    let mut found = None;
    for (i, name) in points.iter().enumerate() {
        if name != "after commit" {
            continue;
        }
        let g = Fixture::new(&contract_for("probe.jsonl"));
        let (id, out) = g.start(&[("KEEL_CRASH_AT", (i + 1).to_string())]);
        if out.status.signal() == Some(9) && replied_not_made(&g.events(&id)) {
            found = Some(i + 1);
            break;
        }
    }
    let n = found.expect("a fault point right after the reply is recorded");
    let f = Fixture::new(&contract_for("actions.jsonl"));
    let (id, out) = f.start(&[("KEEL_CRASH_AT", n.to_string())]);
    assert_eq!(out.status.signal(), Some(9), "{}", f.explain(&out));
    assert!(
        replied_not_made(&f.events(&id)),
        "{:?}",
        kinds(&f.events(&id))
    );
    // Now the same call would be answered differently.
    let changed = script.replace("first\\n", "second\\n");
    assert_ne!(changed, script);
    std::fs::write(outside.path().join("actions.jsonl"), changed).unwrap();
    f.expect(&["resume", &id], 0);
    assert_eq!(
        std::fs::read_to_string(f.path("out.txt")).unwrap(),
        "first\n"
    );
    let events = f.events(&id);
    assert_eq!(
        of_kind(&events, "model_requested").len(),
        2,
        "no call asked twice"
    );
    assert_eq!(of_kind(&events, "model_replied").len(), 2);
    f.verify_log_ok(&id);
}

#[test]
fn workers_started_at_once_on_one_run_drive_it_once() {
    let outside = tempfile::tempdir().unwrap();
    let marker = outside.path().join("m");
    let m = marker.display();
    let f = Fixture::new(&format!(
        r#"
[task]
goal = "Three steps, each leaving a file."

[[verify]]
name = "all"
tier = "acceptance"
run = "test -f a.txt && test -f b.txt && test -f c.txt"

[[phase]]
name = "work"
kind = "command"
run = [
  "echo a >> {m}; echo a > a.txt",
  "echo b >> {m}; echo b > b.txt",
  "echo c >> {m}; echo c > c.txt",
]
{}"#,
        common::outside_writable()
    ));
    let out = f.expect(&["run", "keel.toml", "--detach"], 0);
    let id = stdout(&out)
        .lines()
        .next()
        .unwrap()
        .trim_start_matches("run ")
        .to_string();
    let workers: Vec<_> = (0..4)
        .map(|_| {
            f.keel()
                .args(["worker", "--once"])
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let outs: Vec<Output> = workers
        .into_iter()
        .map(|w| w.wait_with_output().unwrap())
        .collect();
    for out in &outs {
        assert_no_panic(out, "worker");
        assert_eq!(out.status.code(), Some(0), "{}", f.explain(out));
    }
    let drove = outs
        .iter()
        .filter(|o| stdout(o).contains("completed"))
        .count();
    assert_eq!(
        drove,
        1,
        "exactly one worker drove the run: {:?}",
        outs.iter().map(stdout).collect::<Vec<_>>()
    );
    assert_eq!(state(&f.status(&id)), "completed");
    assert_eq!(
        std::fs::read_to_string(&marker).unwrap(),
        "a\nb\nc\n",
        "nothing ran twice"
    );
    assert_eq!(of_kind(&f.events(&id), "step_started").len(), 3);
    f.verify_log_ok(&id);
}
