//! Loop detection of agent phases, through the `keel` binary: a scripted driver that repeats a
//! failing action stops `blocked` on `same_error`, the same harmless action with the same result
//! stops as `repeat`, two alternating actions as `ping_pong`, steps without any verifier newly
//! passing on `no_progress_steps`. Each records the approach as a rejected path (in the event,
//! in the checkpoint taken at the block, in `status`), and a resumed run's next prompt lists it.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{Fixture, kinds, of_kind, state};
use serde_json::{Value, json};

fn contract(budget: &str) -> String {
    format!(
        r#"
[task]
goal = "src/out.txt says done."

[driver]
kind = "script"
script = "actions.jsonl"

[scope]
writable = ["src/**"]

[budget]
steps = 40
{budget}

[[verify]]
name = "some-output"
tier = "step"
run = "test -f src/a.txt || test -f src/out.txt"

[[verify]]
name = "out"
tier = "acceptance"
run = "grep -qx done src/out.txt"

[[phase]]
name = "work"
kind = "agent"
objective = "Write done into src/out.txt, then finish."
done_when = []
"#
    )
}

fn fixture(budget: &str, script: &[Value]) -> Fixture {
    let f = Fixture::new(&contract(budget));
    let text: String = script.iter().map(|l| format!("{l}\n")).collect();
    std::fs::write(f.path("actions.jsonl"), text).unwrap();
    f
}

fn read(path: &str) -> Value {
    json!({"tool": "read", "args": {"path": path}})
}

fn note(text: &str) -> Value {
    json!({"tool": "note", "args": {"text": text}})
}

fn run(command: &str) -> Value {
    json!({"tool": "run", "args": {"command": command}})
}

fn done() -> Value {
    json!({"calls": [
        {"tool": "write", "args": {"path": "src/out.txt", "content": "done\n"}},
        {"tool": "finish", "args": {"summary": "src/out.txt says done"}}
    ]})
}

/// The user part of each model call's prompt, by step index.
fn prompts(f: &Fixture, events: &[Value]) -> Vec<(u64, String)> {
    of_kind(events, "model_requested")
        .iter()
        .map(|e| {
            let hash = e["body"]["request"].as_str().unwrap();
            let v: Value = serde_json::from_slice(&f.artifact(hash)).unwrap();
            (
                e["body"]["step"]["index"].as_u64().unwrap(),
                v["user"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

/// The rejected paths of the newest checkpoint's body.
fn checkpoint_rejected(f: &Fixture, id: &str) -> Vec<String> {
    let body: String = f
        .db()
        .query_row(
            "SELECT body FROM checkpoints WHERE run_id = ?1 ORDER BY n DESC LIMIT 1",
            [id],
            |r| r.get(0),
        )
        .unwrap();
    let v: Value = serde_json::from_str(&body).unwrap();
    v["run"]["rejected_paths"]
        .as_array()
        .unwrap_or_else(|| panic!("no run.rejected_paths in the checkpoint: {v:#}"))
        .iter()
        .map(|p| p.as_str().unwrap().to_string())
        .collect()
}

/// The run stopped blocked on a loop: exactly one `loop_detected` with `pattern`, after
/// `steps` model calls, its rejected path in the event, the newest checkpoint (taken after it)
/// and `status`. Returns the rejected path.
fn assert_loop(f: &Fixture, id: &str, pattern: &str, steps: usize) -> String {
    let st = f.status(id);
    assert_eq!(state(&st), "blocked", "{st:#}");
    let events = f.events(id);
    assert_eq!(
        of_kind(&events, "model_replied").len(),
        steps,
        "{:?}",
        kinds(&events)
    );
    let loops = of_kind(&events, "loop_detected");
    assert_eq!(loops.len(), 1, "{:?}", kinds(&events));
    assert_eq!(loops[0]["body"]["pattern"], pattern, "{:#}", loops[0]);
    let rejected = loops[0]["body"]["rejected_path"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(!rejected.is_empty());
    let last_checkpoint = events
        .iter()
        .rposition(|e| e["kind"] == "checkpoint_taken")
        .unwrap();
    let loop_at = events
        .iter()
        .position(|e| e["kind"] == "loop_detected")
        .unwrap();
    assert!(last_checkpoint > loop_at, "{:?}", kinds(&events));
    assert!(
        checkpoint_rejected(f, id).contains(&rejected),
        "the checkpoint lacks the rejected path {rejected}"
    );
    let in_status: Vec<&str> = st["rejected_paths"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert_eq!(in_status, [rejected.as_str()], "{st:#}");
    assert!(
        st["reason"].as_str().unwrap().contains("rejected path"),
        "{st:#}"
    );
    f.verify_log_ok(id);
    rejected
}

/// The prompt of the step after `after` lists `rejected` under the rejected paths.
fn assert_prompt_lists(f: &Fixture, id: &str, after: u64, rejected: &str) {
    let events = f.events(id);
    let prompts = prompts(f, &events);
    let (_, next) = prompts
        .iter()
        .find(|(s, _)| *s == after + 1)
        .unwrap_or_else(|| panic!("no prompt for step {}", after + 2));
    let section = next
        .split("## Rejected paths")
        .nth(1)
        .unwrap_or_else(|| panic!("no Rejected paths section:\n{next}"));
    assert!(
        section.contains(&format!("- {rejected}")),
        "the resumed prompt does not list {rejected}:\n{next}"
    );
    // Earlier prompts had no rejected path to show.
    for (s, p) in &prompts {
        if *s <= after {
            assert!(!p.contains("## Rejected paths"), "step {}: {p}", s + 1);
        }
    }
}

#[test]
fn the_same_failing_action_stops_on_same_error_and_unblocking_shows_the_rejected_path() {
    // The command fails the same way each time; its output differs only in a number, so the
    // steps are not literal repeats but the error fingerprint is the same.
    let counter = tempfile::tempdir().unwrap();
    let c = counter.path().join("n").display().to_string();
    let cmd = format!(
        "n=$(cat {c} 2>/dev/null || echo 0); n=$((n + 1)); echo $n > {c}; echo \"attempt $n: connection refused\"; exit 3"
    );
    let script = [run(&cmd), run(&cmd), run(&cmd), done(), run(&cmd)];
    // The counter lives outside the workspace, where commands may write only when allowed.
    let sandbox = format!(
        "\n[sandbox]\nwritable = [\"{}\"]\n",
        counter.path().display()
    );
    let f = fixture(&sandbox, &script);
    let (id, out) = f.start(&[]);
    assert_eq!(out.status.code(), Some(4), "{}", f.explain(&out));
    let rejected = assert_loop(&f, &id, "same_error", 3);
    assert!(rejected.contains("connection refused"), "{rejected}");
    let st = f.status(&id);
    assert_eq!(st["block"]["cause"], "budget", "{st:#}");
    assert_eq!(st["block"]["budget"], "same_error", "{st:#}");
    assert_eq!(st["budgets"]["same_error"]["used"].as_u64(), Some(3));

    // A budget block stays until a person raises it.
    let again = f.expect(&["resume", &id], 4);
    assert_eq!(state(&f.status(&id)), "blocked", "{}", f.explain(&again));
    assert_eq!(of_kind(&f.events(&id), "model_replied").len(), 3);

    f.expect(
        &[
            "unblock",
            &id,
            "--budget",
            "same_error=+3",
            "--reason",
            "try it differently",
        ],
        0,
    );
    assert_eq!(state(&f.status(&id)), "completed");
    assert_prompt_lists(&f, &id, 2, &rejected);
    f.verify_log_ok(&id);
}

#[test]
fn run_exit_3_again_and_again_stops_blocked_after_three_steps() {
    let script = [
        run("exit 3"),
        run("exit 3"),
        run("exit 3"),
        run("exit 3"),
        done(),
    ];
    let f = fixture("", &script);
    let (id, out) = f.start(&[]);
    assert_eq!(out.status.code(), Some(4), "{}", f.explain(&out));
    let events = f.events(&id);
    assert_eq!(
        of_kind(&events, "model_replied").len(),
        3,
        "{:?}",
        kinds(&events)
    );
    let loops = of_kind(&events, "loop_detected");
    assert_eq!(loops.len(), 1, "{:?}", kinds(&events));
    let pattern = loops[0]["body"]["pattern"].as_str().unwrap();
    assert!(["repeat", "same_error"].contains(&pattern), "{pattern}");
    assert_eq!(f.status(&id)["rejected_paths"].as_array().unwrap().len(), 1);
    assert_eq!(checkpoint_rejected(&f, &id).len(), 1);
    f.verify_log_ok(&id);
}

#[test]
fn the_same_harmless_action_three_times_is_a_repeat_and_resume_goes_on_without_it() {
    let script = [
        read("README.md"),
        read("README.md"),
        read("README.md"),
        done(),
    ];
    let f = fixture("", &script);
    let (id, out) = f.start(&[]);
    assert_eq!(out.status.code(), Some(4), "{}", f.explain(&out));
    let rejected = assert_loop(&f, &id, "repeat", 3);
    assert!(rejected.contains("README.md"), "{rejected}");
    let st = f.status(&id);
    assert_eq!(st["block"]["cause"], "loop", "{st:#}");
    assert_eq!(st["block"]["kind"], "repeat", "{st:#}");

    let out = f.expect(&["resume", &id], 0);
    let st = f.status(&id);
    assert_eq!(state(&st), "completed", "{}", f.explain(&out));
    assert_eq!(
        std::fs::read_to_string(f.path("src/out.txt")).unwrap(),
        "done\n"
    );
    assert_prompt_lists(&f, &id, 2, &rejected);
    // The rejected path stays on the record.
    assert_eq!(st["rejected_paths"].as_array().unwrap().len(), 1);
    f.verify_log_ok(&id);
}

#[test]
fn two_actions_alternating_are_a_ping_pong() {
    let (a, b) = (read("README.md"), read("Cargo.lock"));
    let script = [a.clone(), b.clone(), a.clone(), b.clone(), a, b, done()];
    let f = fixture("", &script);
    let (id, out) = f.start(&[]);
    assert_eq!(out.status.code(), Some(4), "{}", f.explain(&out));
    let rejected = assert_loop(&f, &id, "ping_pong", 6);
    assert!(
        rejected.contains("README.md") && rejected.contains("Cargo.lock"),
        "{rejected}"
    );
    let st = f.status(&id);
    assert_eq!(st["block"]["kind"], "ping_pong", "{st:#}");
    // Resumed, the driver goes on with something else.
    let out = f.expect(&["resume", &id], 0);
    assert_eq!(state(&f.status(&id)), "completed", "{}", f.explain(&out));
    assert_prompt_lists(&f, &id, 5, &rejected);
    f.verify_log_ok(&id);
}

#[test]
fn no_progress_steps_stops_after_that_many_steps_without_a_verifier_improving() {
    let notes: Vec<Value> = (1..=8)
        .map(|i| note(&format!("thinking, round {i}")))
        .collect();
    let mut script = notes.clone();
    script.push(done());
    let f = fixture("no_progress_steps = 4", &script);
    let (id, out) = f.start(&[]);
    assert_eq!(out.status.code(), Some(4), "{}", f.explain(&out));
    let rejected = assert_loop(&f, &id, "no_progress_steps", 4);
    assert!(rejected.contains("thinking"), "{rejected}");
    let st = f.status(&id);
    assert_eq!(st["block"]["cause"], "budget", "{st:#}");
    assert_eq!(st["block"]["budget"], "no_progress_steps", "{st:#}");
    let steps = of_kind(&f.events(&id), "step_started").len();
    assert_eq!(steps, 4);
}

#[test]
fn a_verifier_newly_passing_is_progress_and_resets_the_count() {
    // Three notes, a write that makes the step verifier pass for the first time, then notes
    // until four steps in a row made no progress.
    let mut script: Vec<Value> = (1..=3).map(|i| note(&format!("before {i}"))).collect();
    script.push(json!({"tool": "write", "args": {"path": "src/a.txt", "content": "a\n"}}));
    script.extend((1..=6).map(|i| note(&format!("after {i}"))));
    let f = fixture("no_progress_steps = 4", &script);
    let (id, out) = f.start(&[]);
    assert_eq!(out.status.code(), Some(4), "{}", f.explain(&out));
    let rejected = assert_loop(&f, &id, "no_progress_steps", 8);
    assert!(rejected.contains("after"), "{rejected}");
    let events = f.events(&id);
    let evidence = of_kind(&events, "evidence_recorded");
    assert_eq!(
        evidence.len(),
        1,
        "the step verifier ran once, for the one change"
    );
    assert_eq!(evidence[0]["body"]["evidence"]["passed"], true);
}

#[test]
fn each_prompt_names_the_step_it_is_for() {
    let script = [note("first"), note("second"), done()];
    let f = fixture("", &script);
    let (id, out) = f.start(&[]);
    assert_eq!(out.status.code(), Some(0), "{}", f.explain(&out));
    let events = f.events(&id);
    for (step, user) in prompts(&f, &events) {
        let header = user
            .lines()
            .find(|l| l.starts_with("## Phase "))
            .unwrap_or_else(|| panic!("no phase header:\n{user}"));
        assert!(
            header.ends_with(&format!("(step {})", step + 1)),
            "the prompt of agent step 1.{} says `{header}`",
            step + 1
        );
    }
}

/// The step that completes a loop and the block on it are one commit: whichever commit of the
/// run fails (nothing stored, or stored and reported failed), the resumed run still stops on
/// the loop after the same three steps, and never takes a fourth.
#[test]
fn a_loop_is_caught_whichever_commit_of_the_run_fails() {
    let script: String = [
        read("README.md"),
        read("README.md"),
        read("README.md"),
        done(),
    ]
    .iter()
    .map(|l| format!("{l}\n"))
    .collect();
    common::with_each_commit_failing(&contract(""), &script, |f, id, what| {
        if state(&f.status(id)) != "blocked" {
            common::assert_no_panic(&f.run(&["resume", id]), what);
        }
        let st = f.status(id);
        assert_eq!(state(&st), "blocked", "{what}: {st:#}");
        assert_eq!(st["block"]["kind"], "repeat", "{what}: {st:#}");
        let events = f.events(id);
        assert_eq!(
            of_kind(&events, "model_replied").len(),
            3,
            "{what}: {:?}",
            kinds(&events)
        );
        assert!(!f.path("src/out.txt").exists(), "{what}: a fourth step ran");
        f.verify_log_ok(id);
    });
}

/// A budget the last phase's verification itself goes over (here the acceptance verifier's
/// own wall time) stops the run whichever commit of it fails: the block is in the commit of the
/// verification, so a resumed run never goes on to accept and complete past it.
#[test]
fn a_budget_the_verification_exceeds_blocks_whichever_commit_of_the_run_fails() {
    let slow = contract("wall_time = \"1s\"").replace(
        "run = \"grep -qx done src/out.txt\"",
        "run = \"sleep 1.5 && grep -qx done src/out.txt\"",
    );
    let script = format!("{}\n", done());
    let blocked_on_wall_time = |f: &Fixture, id: &str, what: &str| {
        let st = f.status(id);
        assert_eq!(state(&st), "blocked", "{what}: {st:#}");
        assert_eq!(st["block"]["budget"], "wall_time", "{what}: {st:#}");
        f.verify_log_ok(id);
    };
    let twin = Fixture::new(&slow);
    std::fs::write(twin.path("actions.jsonl"), &script).unwrap();
    let (id, out) = twin.start(&[]);
    assert_eq!(out.status.code(), Some(4), "{}", twin.explain(&out));
    blocked_on_wall_time(&twin, &id, "without a fault");
    common::with_each_commit_failing(&slow, &script, |f, id, what| {
        if state(&f.status(id)) != "blocked" {
            common::assert_no_panic(&f.run(&["resume", id]), what);
        }
        blocked_on_wall_time(f, id, what);
    });
}
