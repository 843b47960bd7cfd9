//! Budgets of the `keel` binary: a run whose budget runs out stops `blocked` (exit 4) naming the
//! budget, its use and its limit; only `keel unblock --budget NAME=+N --reason` raises it, the
//! raise is logged with who and why, and the run then finishes. Consumed budgets never go down.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::BTreeMap;
use std::path::Path;

use common::{Fixture, kinds, of_kind, state, stderr, stdout};
use serde_json::Value;

/// A contract with one command phase of `steps`, the `[budget]` lines `budget` and an acceptance
/// verifier `verify`. Commands are TOML literal strings, so they may hold `"` but not `'`.
fn contract(budget: &str, verify: &str, steps: &[String]) -> String {
    let run: Vec<String> = steps.iter().map(|s| format!("'{s}'")).collect();
    format!(
        "[task]\ngoal = \"The budget test's files exist.\"\n\n[budget]\n{budget}\n\n\
         [[verify]]\nname = \"done\"\ntier = \"acceptance\"\nrun = '{verify}'\n\n\
         [[phase]]\nname = \"work\"\nkind = \"command\"\nrun = [{}]\n{}",
        run.join(", "),
        common::outside_writable()
    )
}

fn s(text: &str) -> String {
    text.to_string()
}

/// What the run has used of every budget, from `status --json`.
fn used(status: &Value) -> BTreeMap<String, u64> {
    status["budgets"]
        .as_object()
        .expect("budgets is an object")
        .iter()
        .map(|(name, b)| {
            let used = b["used"]
                .as_u64()
                .unwrap_or_else(|| panic!("budgets.{name}.used is a number: {b}"));
            (name.clone(), used)
        })
        .collect()
}

fn limit(status: &Value, budget: &str) -> Option<u64> {
    status["budgets"][budget]["limit"].as_u64()
}

fn assert_not_lower(before: &BTreeMap<String, u64>, after: &BTreeMap<String, u64>, when: &str) {
    for (name, was) in before {
        let now = after.get(name).copied().unwrap_or(0);
        assert!(
            now >= *was,
            "{when}: consumed budget `{name}` went down from {was} to {now}\nbefore: {before:?}\nafter: {after:?}"
        );
    }
}

fn assert_blocked_on(f: &Fixture, id: &str, budget: &str, limit_now: u64) -> Value {
    let st = f.status(id);
    assert_eq!(state(&st), "blocked", "status: {st:#}");
    let block = &st["block"];
    assert_eq!(block["cause"], "budget", "block: {block}");
    assert_eq!(block["budget"], budget, "block: {block}");
    assert_eq!(block["limit"].as_u64(), Some(limit_now), "block: {block}");
    let block_used = block["used"].as_u64().expect("block.used is a number");
    assert!(
        block_used >= limit_now,
        "blocked on `{budget}` with {block_used} used of {limit_now}: {block}"
    );
    let reason = st["reason"].as_str().unwrap_or("");
    assert!(
        reason.contains(&format!("budget `{budget}` exhausted")),
        "reason does not name the budget: {reason}"
    );
    assert!(
        reason.contains("keel unblock"),
        "reason does not say how to raise it: {reason}"
    );
    assert_eq!(
        limit(&st, budget),
        Some(limit_now),
        "status budgets: {st:#}"
    );
    assert_eq!(st["budgets"][budget]["enforced"], true);
    let status_used = st["budgets"][budget]["used"].as_u64().unwrap();
    assert!(
        status_used >= block_used,
        "status says `{budget}` used {status_used}, less than the {block_used} the block recorded"
    );
    st
}

/// One budget's life: the run exhausts it and blocks, a resume without a raise stays blocked and
/// changes no state, then `unblock` raises it and the run completes.
struct Exhaust<'a> {
    budget: &'a str,
    contract: String,
    limit: u64,
    /// What follows `NAME=` on the command line, e.g. `+5` or `+1m`.
    raise: &'a str,
    raised_to: u64,
}

/// Runs `case` in `f` and returns the run id; every check of the whole story is here.
fn exhaust_then_raise(f: &Fixture, case: &Exhaust<'_>) -> String {
    let budget = case.budget;
    f.write_contract(&case.contract);
    let (id, out) = f.start(&[]);
    assert_eq!(
        out.status.code(),
        Some(4),
        "a run out of `{budget}` must end blocked (exit 4)\n{}",
        f.explain(&out)
    );
    let text = stdout(&out);
    assert!(
        text.contains(&format!("budget `{budget}` exhausted")),
        "stdout does not name the budget `{budget}`\n{}",
        f.explain(&out)
    );
    assert!(
        text.lines().last().unwrap_or("").starts_with("blocked:"),
        "the last line says how the run stopped\n{}",
        f.explain(&out)
    );
    assert!(!text.contains("completed"), "{}", f.explain(&out));
    let blocked = assert_blocked_on(f, &id, budget, case.limit);
    let used_blocked = used(&blocked);
    let events_blocked = f.events(&id);
    let changes_blocked = of_kind(&events_blocked, "state_changed").len();
    assert!(of_kind(&events_blocked, "budget_raised").is_empty());

    // Resuming does not raise anything: still blocked, and no state change was appended.
    let out = f.expect(&["resume", &id], 4);
    assert!(
        stdout(&out).contains(&format!("budget `{budget}` exhausted")),
        "resume without a raise must say the run is still out of `{budget}`\n{}",
        f.explain(&out)
    );
    let resumed = assert_blocked_on(f, &id, budget, case.limit);
    let used_resumed = used(&resumed);
    assert_not_lower(
        &used_blocked,
        &used_resumed,
        "after a resume without a raise",
    );
    let events_resumed = f.events(&id);
    assert_eq!(
        of_kind(&events_resumed, "state_changed").len(),
        changes_blocked,
        "a resume without a raise appended a state change: {:?}",
        kinds(&events_resumed)
    );
    assert!(of_kind(&events_resumed, "budget_raised").is_empty());
    assert!(
        of_kind(&events_resumed, "step_started").len()
            == of_kind(&events_blocked, "step_started").len(),
        "a resume without a raise ran a step: {:?}",
        kinds(&events_resumed)
    );

    // The raise, with who and why, and the run goes on to completion.
    let reason = format!("the {budget} test needs more {budget}");
    let spec = format!("{budget}={}", case.raise);
    let out = f.expect(&["unblock", &id, "--budget", &spec, "--reason", &reason], 0);
    assert!(
        stdout(&out)
            .lines()
            .last()
            .unwrap_or("")
            .starts_with("completed"),
        "{}",
        f.explain(&out)
    );
    let done = f.status(&id);
    assert_eq!(state(&done), "completed", "status: {done:#}");
    assert!(done["block"].is_null(), "a completed run has no block");
    assert_eq!(limit(&done, budget), Some(case.raised_to));
    assert_not_lower(&used_resumed, &used(&done), "after the unblock");

    let events = f.events(&id);
    let raised = of_kind(&events, "budget_raised");
    assert_eq!(
        raised.len(),
        1,
        "one raise, one event: {:?}",
        kinds(&events)
    );
    let body = &raised[0]["body"];
    assert_eq!(body["budget"], budget, "{body}");
    assert_eq!(body["from"].as_u64(), Some(case.limit), "{body}");
    assert_eq!(body["to"].as_u64(), Some(case.raised_to), "{body}");
    assert_eq!(body["reason"], reason.as_str(), "{body}");
    assert!(
        body["by"].as_str().is_some_and(|b| !b.is_empty()),
        "the raise records who: {body}"
    );
    // The raise is logged before the run leaves `blocked`.
    let raise_seq = raised[0]["seq"].as_u64().unwrap();
    let unblocked = events
        .iter()
        .find(|e| e["kind"] == "state_changed" && e["body"]["from"] == "blocked")
        .expect("a state change out of blocked");
    assert!(unblocked["seq"].as_u64().unwrap() > raise_seq);
    assert_eq!(unblocked["body"]["to"], "executing");
    f.verify_log_ok(&id);
    id
}

#[test]
fn steps_budget_blocks_and_unblock_lets_the_run_finish() {
    let f = Fixture::new("");
    let id = exhaust_then_raise(
        &f,
        &Exhaust {
            budget: "steps",
            contract: contract(
                "steps = 2",
                "test -f a && test -f b && test -f c",
                &[s("echo a > a"), s("echo b > b"), s("echo c > c")],
            ),
            limit: 2,
            raise: "+5",
            raised_to: 7,
        },
    );
    let st = f.status(&id);
    assert_eq!(st["budgets"]["steps"]["used"].as_u64(), Some(3));
    assert!(f.path("c").exists());
}

#[test]
fn a_raise_too_small_blocks_again_and_a_second_raise_finishes() {
    let f = Fixture::new(&contract(
        "steps = 2",
        "test -f a && test -f b && test -f c && test -f d",
        &[
            s("echo a > a"),
            s("echo b > b"),
            s("echo c > c"),
            s("echo d > d"),
        ],
    ));
    let (id, out) = f.start(&[]);
    assert_eq!(out.status.code(), Some(4), "{}", f.explain(&out));
    assert!(stdout(&out).contains("used 2 of 2"), "{}", f.explain(&out));
    let first = used(&f.status(&id));

    let out = f.expect(
        &[
            "unblock", &id, "--budget", "steps=+1", "--reason", "one more",
        ],
        4,
    );
    assert!(stdout(&out).contains("used 3 of 3"), "{}", f.explain(&out));
    let second = assert_blocked_on(&f, &id, "steps", 3);
    assert_not_lower(&first, &used(&second), "after the first raise");

    f.expect(
        &[
            "unblock",
            &id,
            "--budget",
            "steps=+1",
            "--reason",
            "and one more",
        ],
        0,
    );
    let done = f.status(&id);
    assert_eq!(state(&done), "completed");
    assert_not_lower(&used(&second), &used(&done), "after the second raise");
    let events = f.events(&id);
    let raises: Vec<(u64, u64, String)> = of_kind(&events, "budget_raised")
        .iter()
        .map(|e| {
            (
                e["body"]["from"].as_u64().unwrap(),
                e["body"]["to"].as_u64().unwrap(),
                e["body"]["reason"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    assert_eq!(
        raises,
        vec![(2, 3, s("one more")), (3, 4, s("and one more"))]
    );
    f.verify_log_ok(&id);
}

#[test]
fn tool_calls_budget_blocks_and_unblock_lets_the_run_finish() {
    let f = Fixture::new("");
    exhaust_then_raise(
        &f,
        &Exhaust {
            budget: "tool_calls",
            contract: contract(
                "tool_calls = 1",
                "test -f a && test -f b",
                &[s("echo a > a"), s("echo b > b")],
            ),
            limit: 1,
            raise: "+3",
            raised_to: 4,
        },
    );
}

/// A step that fails with the same error (up to numbers and paths) until its `n`th attempt. The
/// attempt count lives outside the workspace, so rolling the step back does not reset it.
fn flaky_step(counter: &Path, succeed_at: u32) -> String {
    let c = counter.display();
    format!(
        "n=$(cat {c} 2>/dev/null || echo 0); n=$((n+1)); echo $n > {c}; \
         echo junk-$n > junk.txt; \
         if [ $n -lt {succeed_at} ]; then echo \"error: flaky failure on attempt $n at /tmp/x$n/y.rs:$n\"; exit 1; fi; \
         echo ok > flaky.txt"
    )
}

#[test]
fn same_error_budget_blocks_and_unblock_lets_the_run_finish() {
    let f = Fixture::new("");
    let outside = tempfile::tempdir().unwrap();
    let counter = outside.path().join("attempts");
    let id = exhaust_then_raise(
        &f,
        &Exhaust {
            budget: "same_error",
            contract: contract(
                "same_error = 2",
                "test -f flaky.txt",
                &[flaky_step(&counter, 3)],
            ),
            limit: 2,
            raise: "+2",
            raised_to: 4,
        },
    );
    let events = f.events(&id);
    let failed = of_kind(&events, "step_failed");
    assert_eq!(failed.len(), 2, "{:?}", kinds(&events));
    assert_eq!(
        failed[0]["body"]["error_fingerprint"], failed[1]["body"]["error_fingerprint"],
        "errors that differ only in numbers and paths have one fingerprint"
    );
    // Every failed attempt was rolled back; the third attempt's junk is what is left.
    assert_eq!(
        std::fs::read_to_string(f.path("junk.txt")).unwrap(),
        "junk-3\n"
    );
    let st = f.status(&id);
    assert_eq!(st["budgets"]["same_error"]["used"].as_u64(), Some(2));
}

#[test]
fn same_error_defaults_to_three_when_the_contract_sets_none() {
    let f = Fixture::new(&contract(
        "steps = 100",
        "true",
        &[s("echo junk > junk.txt; echo error: always broken; exit 1")],
    ));
    let (id, out) = f.start(&[]);
    assert_eq!(out.status.code(), Some(4), "{}", f.explain(&out));
    assert!(
        stdout(&out).contains("budget `same_error` exhausted: used 3 of 3"),
        "{}",
        f.explain(&out)
    );
    let st = assert_blocked_on(&f, &id, "same_error", 3);
    assert_eq!(st["budgets"]["same_error"]["used"].as_u64(), Some(3));
    assert_eq!(of_kind(&f.events(&id), "step_failed").len(), 3);
    assert!(
        !f.path("junk.txt").exists(),
        "a failed step's file must be rolled back"
    );
}

#[test]
fn different_errors_do_not_add_up_to_the_same_error_budget() {
    let f = Fixture::new("");
    let outside = tempfile::tempdir().unwrap();
    let c = outside.path().join("attempts");
    let c = c.display();
    let step = format!(
        "n=$(cat {c} 2>/dev/null || echo 0); n=$((n+1)); echo $n > {c}; \
         case $n in 1) echo \"error: alpha went wrong\"; exit 1;; \
         2) echo \"error: missing semicolon\"; exit 1;; \
         3) echo \"error: unknown widget\"; exit 1;; esac; echo ok > ok.txt"
    );
    f.write_contract(&contract("same_error = 2", "test -f ok.txt", &[step]));
    let (id, out) = f.start(&[]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "three different errors are not the same error twice\n{}",
        f.explain(&out)
    );
    let st = f.status(&id);
    assert_eq!(st["budgets"]["same_error"]["used"].as_u64(), Some(1));
    assert_eq!(of_kind(&f.events(&id), "step_failed").len(), 3);
}

#[test]
fn wall_time_budget_blocks_and_unblock_lets_the_run_finish() {
    let f = Fixture::new("");
    // The step needs longer than the whole budget; keel cuts its timeout to what is left.
    let id = exhaust_then_raise(
        &f,
        &Exhaust {
            budget: "wall_time",
            contract: contract(
                "wall_time = \"1s\"",
                "test -f slow.txt",
                &[s("sleep 3 && echo done > slow.txt")],
            ),
            limit: 1_000,
            raise: "+10m",
            raised_to: 601_000,
        },
    );
    assert!(f.path("slow.txt").exists());
    let st = f.status(&id);
    assert_eq!(st["budgets"]["wall_time"]["unit"], "ms");
}

#[test]
fn files_changed_budget_blocks_and_unblock_lets_the_run_finish() {
    let f = Fixture::new("");
    let id = exhaust_then_raise(
        &f,
        &Exhaust {
            budget: "files_changed",
            contract: contract(
                "files_changed = 1",
                "test -f a && test -f b && test -f c",
                &[s("echo a > a"), s("echo b > b"), s("echo c > c")],
            ),
            limit: 1,
            raise: "+5",
            raised_to: 6,
        },
    );
    let st = f.status(&id);
    assert_eq!(st["budgets"]["files_changed"]["used"].as_u64(), Some(3));
}

#[test]
fn writes_budget_counts_every_write_and_unblock_lets_the_run_finish() {
    let f = Fixture::new("");
    // The same file three times: three writes, one changed file. `files_changed = 1` holds
    // throughout; `writes = 1` runs out after the second step.
    let id = exhaust_then_raise(
        &f,
        &Exhaust {
            budget: "writes",
            contract: contract(
                "writes = 1\nfiles_changed = 1",
                "grep -q 3 a",
                &[s("echo 1 > a"), s("echo 2 > a"), s("echo 3 > a")],
            ),
            limit: 1,
            raise: "+5",
            raised_to: 6,
        },
    );
    let st = f.status(&id);
    assert_eq!(st["budgets"]["writes"]["used"].as_u64(), Some(3));
    assert_eq!(st["budgets"]["files_changed"]["used"].as_u64(), Some(1));
}

#[test]
fn diff_lines_budget_blocks_and_unblock_lets_the_run_finish() {
    let f = Fixture::new("");
    exhaust_then_raise(
        &f,
        &Exhaust {
            budget: "diff_lines",
            contract: contract(
                "diff_lines = 3",
                "test -f a && test -f b && test -f c",
                &[
                    s("printf \"1\\n2\\n\" > a"),
                    s("printf \"1\\n2\\n\" > b"),
                    s("echo c > c"),
                ],
            ),
            limit: 3,
            raise: "+10",
            raised_to: 13,
        },
    );
}

#[test]
fn compute_time_budget_blocks_and_unblock_lets_the_run_finish() {
    let f = Fixture::new("");
    // Burns far more than 10ms of CPU on any machine.
    let burn = s("i=0; while [ $i -lt 300000 ]; do i=$((i+1)); done; echo $i > burn.txt");
    exhaust_then_raise(
        &f,
        &Exhaust {
            budget: "compute_time",
            contract: contract(
                "compute_time = \"10ms\"",
                "test -f burn.txt && test -f after.txt",
                &[burn, s("echo after > after.txt")],
            ),
            limit: 10,
            raise: "+1h",
            raised_to: 3_600_010,
        },
    );
}

#[test]
fn bad_raises_are_usage_errors_that_change_nothing() {
    let f = Fixture::new(&contract(
        "steps = 1",
        "test -f a && test -f b",
        &[s("echo a > a"), s("echo b > b")],
    ));
    let (id, out) = f.start(&[]);
    assert_eq!(out.status.code(), Some(4), "{}", f.explain(&out));
    let before = f.events(&id);

    let cases: [(&[&str], &[&str]); 8] = [
        (
            &["--budget", "steps=5", "--reason", "r"],
            &["starts with `+`", "steps=+"],
        ),
        (
            &["--budget", "steps=-5", "--reason", "r"],
            &["starts with `+`"],
        ),
        (
            &["--budget", "stepz=+1", "--reason", "r"],
            &["`stepz` is not a budget", "steps", "wall_time"],
        ),
        (&["--budget", "steps", "--reason", "r"], &["NAME=+AMOUNT"]),
        (&["--budget", "steps=+0", "--reason", "r"], &["above zero"]),
        (
            &["--budget", "wall_time=+soon", "--reason", "r"],
            &["duration"],
        ),
        (&["--budget", "steps=+5"], &["--reason"]),
        (
            &["--budget", "writes=+5", "--reason", "r"],
            &["writes", "no limit"],
        ),
    ];
    for (args, wanted) in cases {
        let mut full = vec!["unblock", id.as_str()];
        full.extend_from_slice(args);
        let out = f.expect(&full, 2);
        let err = stderr(&out);
        for w in wanted {
            assert!(
                err.contains(w),
                "keel {full:?}: stderr should contain {w:?}\n{}",
                f.explain(&out)
            );
        }
    }
    let out = f.expect(
        &["unblock", &id, "--budget", "steps=+5", "--reason", "  "],
        2,
    );
    assert!(stderr(&out).contains("reason"), "{}", f.explain(&out));

    let after = f.events(&id);
    assert_eq!(
        kinds(&after),
        kinds(&before),
        "a refused raise must not touch the log"
    );
    assert_blocked_on(&f, &id, "steps", 1);

    // A good raise still works afterwards.
    f.expect(
        &["unblock", &id, "--budget", "steps=+1", "--reason", "fine"],
        0,
    );
    assert_eq!(state(&f.status(&id)), "completed");
    // A finished run cannot be unblocked.
    let out = f.expect(
        &["unblock", &id, "--budget", "steps=+1", "--reason", "late"],
        2,
    );
    assert!(stderr(&out).contains("completed"), "{}", f.explain(&out));
}

/// A budget a command phase's own verification goes over (here its wall time) stops the run,
/// as an agent phase's does, whichever commit of the run fails: before, the run went on to
/// accept and completed past the budget.
#[test]
fn a_budget_a_command_phases_verification_exceeds_blocks_whichever_commit_fails() {
    let slow = format!(
        "{}\n[[verify]]\nname = \"checked\"\ntier = \"phase\"\nrun = 'sleep 1.5 && test -f a.txt'\n",
        contract(
            "wall_time = \"1s\"",
            "test -f a.txt",
            &[s("echo a > a.txt")]
        )
    );
    let blocked_on_wall_time = |f: &Fixture, id: &str, what: &str| {
        let st = f.status(id);
        assert_eq!(state(&st), "blocked", "{what}: {st:#}");
        assert_eq!(st["block"]["budget"], "wall_time", "{what}: {st:#}");
        let events = f.events(id);
        assert_eq!(of_kind(&events, "phase_verified").len(), 1, "{what}");
        assert!(
            of_kind(&events, "evidence_recorded")
                .iter()
                .all(|e| e["body"]["evidence"]["tier"] != "acceptance"),
            "{what}: the run did not go on to accept: {:?}",
            kinds(&events)
        );
        f.verify_log_ok(id);
    };
    let twin = Fixture::new(&slow);
    let (id, out) = twin.start(&[]);
    assert_eq!(out.status.code(), Some(4), "{}", twin.explain(&out));
    blocked_on_wall_time(&twin, &id, "without a fault");
    common::with_each_commit_failing(&slow, "", |f, id, what| {
        if state(&f.status(id)) != "blocked" {
            common::assert_no_panic(&f.run(&["resume", id]), what);
        }
        blocked_on_wall_time(f, id, what);
    });
}
