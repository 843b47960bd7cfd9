//! Evidence and the verification ladder, through the `keel` binary: no `completed` without every
//! acceptance verifier passing for the final working tree with its evidence stored; a failing
//! phase verifier stops the run before the next phase; a failing step verifier rolls the step
//! back and retries it; evidence records what ran, how it ended, its output and its environment.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{Fixture, git, kinds, of_kind, state, stdout};
use serde_json::Value;

fn is_hex(s: &str, len: usize) -> bool {
    s.len() == len && s.chars().all(|c| c.is_ascii_hexdigit())
}

/// The text of the artifact a hash names.
fn artifact(f: &Fixture, hash: &str) -> String {
    assert!(
        is_hex(hash, 64),
        "an artifact hash is 64 hex digits: {hash:?}"
    );
    String::from_utf8(f.artifact(hash)).unwrap()
}

fn evidence_of<'a>(status: &'a Value, verifier: &str) -> &'a Value {
    status["evidence"]
        .as_array()
        .expect("evidence is an array")
        .iter()
        .find(|e| e["verifier"] == verifier)
        .unwrap_or_else(|| panic!("no evidence of `{verifier}` in {status:#}"))
}

fn never_completed(f: &Fixture, id: &str) {
    let events = f.events(id);
    assert!(
        !events
            .iter()
            .any(|e| e["kind"] == "state_changed" && e["body"]["to"] == "completed"),
        "the run must never have been completed: {:?}",
        kinds(&events)
    );
    assert_ne!(state(&f.status(id)), "completed");
}

/// `(run_id, verifier, tier, passed, status, output, tree, body)` rows of the evidence table.
type Row = (String, String, String, bool, String, String, String, String);

fn evidence_rows(f: &Fixture, id: &str) -> Vec<Row> {
    let db = f.db();
    let mut stmt = db
        .prepare(
            "SELECT run_id, verifier, tier, passed, status, output, tree, body \
             FROM evidence WHERE run_id = ?1 ORDER BY n",
        )
        .unwrap();
    stmt.query_map([id], |r| {
        Ok((
            r.get(0)?,
            r.get(1)?,
            r.get(2)?,
            r.get(3)?,
            r.get(4)?,
            r.get(5)?,
            r.get(6)?,
            r.get(7)?,
        ))
    })
    .unwrap()
    .collect::<Result<_, _>>()
    .unwrap()
}

/// Straight from SQLite: every run in the store whose state is `completed` has, for each of its
/// acceptance verifiers, a passing evidence row for the tree the run ended with, and that
/// verifier's newest evidence passed. Returns how many completed runs were checked.
fn completed_runs_have_passing_acceptance_evidence(f: &Fixture) -> usize {
    completed_runs_in_db_have_passing_acceptance_evidence(&f.db())
}

fn completed_runs_in_db_have_passing_acceptance_evidence(db: &rusqlite::Connection) -> usize {
    let mut stmt = db
        .prepare(
            "SELECT r.id, p.body FROM runs r JOIN projections p ON p.run_id = r.id \
                  WHERE r.state = 'completed'",
        )
        .unwrap();
    let runs: Vec<(String, String)> = stmt
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    for (id, projection) in &runs {
        let run: Value = serde_json::from_str(projection).unwrap();
        let acceptance = run["acceptance"].as_array().expect("acceptance list");
        assert!(
            !acceptance.is_empty(),
            "run {id} completed with no acceptance verifiers"
        );
        let tree = run["fingerprint"]["tree"].as_str().expect("final tree");
        for name in acceptance {
            let name = name.as_str().unwrap();
            let passing: i64 = db
                .query_row(
                    "SELECT count(*) FROM evidence WHERE run_id = ?1 AND verifier = ?2 \
                     AND tier = 'acceptance' AND passed = 1 AND tree = ?3",
                    rusqlite::params![id, name, tree],
                    |r| r.get(0),
                )
                .unwrap();
            assert!(
                passing >= 1,
                "completed run {id} has no passing evidence of acceptance verifier `{name}` for tree {tree}"
            );
            let newest: bool = db
                .query_row(
                    "SELECT passed FROM evidence WHERE run_id = ?1 AND verifier = ?2 \
                     ORDER BY n DESC LIMIT 1",
                    rusqlite::params![id, name],
                    |r| r.get(0),
                )
                .unwrap();
            assert!(
                newest,
                "completed run {id}: the newest evidence of `{name}` failed"
            );
        }
    }
    runs.len()
}

/// A contract: phases `(name, commands)`, and verifiers `(name, tier, run)`. Commands and
/// verifier runs are TOML literal strings (no `'`).
fn contract(verifiers: &[(&str, &str, &str)], phases: &[(&str, &[&str])]) -> String {
    let mut text =
        String::from("[task]\ngoal = \"The evidence test passes.\"\n\n[budget]\nsteps = 50\n");
    for (name, tier, run) in verifiers {
        text.push_str(&format!(
            "\n[[verify]]\nname = \"{name}\"\ntier = \"{tier}\"\nrun = '{run}'\n"
        ));
    }
    for (name, commands) in phases {
        let run: Vec<String> = commands.iter().map(|c| format!("'{c}'")).collect();
        text.push_str(&format!(
            "\n[[phase]]\nname = \"{name}\"\nkind = \"command\"\nrun = [{}]\n",
            run.join(", ")
        ));
    }
    text.push_str(&common::outside_writable());
    text
}

#[test]
fn a_failing_acceptance_verifier_blocks_with_evidence_and_resume_completes_once_fixed() {
    let outside = tempfile::tempdir().unwrap();
    let ready = outside.path().join("ready");
    let check = format!(
        "echo acceptance-marker-output; echo looking for {r} >&2; test -f {r}",
        r = ready.display()
    );
    let f = Fixture::new(&contract(
        &[("ready", "acceptance", &check)],
        &[("work", &["echo a > a.txt"])],
    ));
    let (id, out) = f.start(&[]);
    assert_eq!(out.status.code(), Some(4), "{}", f.explain(&out));
    let text = stdout(&out);
    assert!(!text.contains("completed"), "{}", f.explain(&out));
    assert!(
        text.contains("verifier `ready` failed"),
        "{}",
        f.explain(&out)
    );

    let st = f.status(&id);
    assert_eq!(state(&st), "blocked");
    assert_eq!(st["block"]["cause"], "verification", "{st:#}");
    assert_eq!(st["block"]["verifier"], "ready", "{st:#}");
    let ev = evidence_of(&st, "ready");
    assert_eq!(ev["passed"], false);
    assert_eq!(ev["tier"], "acceptance");
    assert_eq!(ev["status"], "exit 1");
    assert_eq!(st["block"]["evidence"], ev["n"]);
    let log = artifact(&f, ev["output"].as_str().unwrap());
    assert!(
        log.contains("acceptance-marker-output"),
        "stdout in the artifact: {log:?}"
    );
    assert!(
        log.contains("looking for"),
        "stderr in the artifact: {log:?}"
    );

    let events = f.events(&id);
    let recorded = of_kind(&events, "evidence_recorded");
    assert_eq!(recorded.len(), 1);
    assert_eq!(recorded[0]["body"]["evidence"]["passed"], false);
    let rows = evidence_rows(&f, &id);
    assert_eq!(rows.len(), 1);
    assert!(!rows[0].3, "the failing evidence is stored as passed = 0");
    never_completed(&f, &id);

    // Unfixed, a resume runs the verifier again and stays blocked.
    let out = f.expect(&["resume", &id], 4);
    assert!(
        stdout(&out).contains("verifier `ready` failed"),
        "{}",
        f.explain(&out)
    );
    never_completed(&f, &id);
    assert_eq!(evidence_rows(&f, &id).len(), 2);

    // Fixed, it completes.
    std::fs::write(&ready, "yes\n").unwrap();
    let out = f.expect(&["resume", &id], 0);
    assert!(stdout(&out).starts_with("completed"), "{}", f.explain(&out));
    let st = f.status(&id);
    assert_eq!(state(&st), "completed");
    assert_eq!(evidence_of(&st, "ready")["passed"], true);
    let rows = evidence_rows(&f, &id);
    assert_eq!(
        rows.iter().map(|r| r.3).collect::<Vec<_>>(),
        vec![false, false, true]
    );
    assert_eq!(completed_runs_have_passing_acceptance_evidence(&f), 1);
    f.verify_log_ok(&id);
}

#[test]
fn fixing_the_cause_in_the_workspace_then_resuming_completes_or_names_the_change() {
    let f = Fixture::new(&contract(
        &[("fixed", "acceptance", "echo checking; cat fixed.txt")],
        &[("work", &["echo a > a.txt"])],
    ));
    let (id, out) = f.start(&[]);
    assert_eq!(out.status.code(), Some(4), "{}", f.explain(&out));
    let failed_reason = f.status(&id)["reason"].as_str().unwrap().to_string();

    // The person does what the reason says: fix the cause, then `keel resume`.
    std::fs::write(f.path("fixed.txt"), "fixed\n").unwrap();
    let out = f.run(&["resume", &id]);
    match out.status.code() {
        Some(0) => {
            assert_eq!(state(&f.status(&id)), "completed");
        }
        Some(4) => {
            // keel may refuse to continue silently in a changed working tree, but then it must
            // say so: the block is the drift, naming the changed file and how to go on.
            let st = f.status(&id);
            let reason = st["reason"].as_str().unwrap_or("");
            assert!(
                st["block"]["cause"] == "drift"
                    && reason.contains("fixed.txt")
                    && reason.contains("--migrate")
                    && stdout(&out).contains("fixed.txt"),
                "after the cause was fixed in the workspace, `keel resume` stayed blocked \
                 without naming the change or how to continue (reason before the fix: {failed_reason:?})\n\
                 status block: {}\nreason: {reason}\n{}",
                st["block"],
                f.explain(&out)
            );
            let out = f.expect(
                &[
                    "resume",
                    &id,
                    "--migrate",
                    "--reason",
                    "fixed the cause by hand",
                ],
                0,
            );
            assert!(stdout(&out).starts_with("completed"), "{}", f.explain(&out));
            let events = f.events(&id);
            let migrated = of_kind(&events, "migrated");
            assert_eq!(migrated.len(), 1, "{:?}", kinds(&events));
            assert_eq!(migrated[0]["body"]["reason"], "fixed the cause by hand");
        }
        other => panic!("unexpected exit {other:?}\n{}", f.explain(&out)),
    }
    let st = f.status(&id);
    assert_eq!(state(&st), "completed");
    let ev = evidence_of(&st, "fixed");
    assert_eq!(ev["passed"], true);
    assert!(artifact(&f, ev["output"].as_str().unwrap()).contains("fixed"));
    completed_runs_have_passing_acceptance_evidence(&f);
    f.verify_log_ok(&id);
}

#[test]
fn a_failing_phase_verifier_blocks_before_the_next_phase_starts() {
    let outside = tempfile::tempdir().unwrap();
    let ok = outside.path().join("gate-ok");
    let gate = format!("echo gate-output; test -f {}", ok.display());
    let f = Fixture::new(&contract(
        &[
            ("gate", "phase", &gate),
            ("final", "acceptance", "test -f one.txt && test -f two.txt"),
        ],
        &[
            ("one", &["echo 1 > one.txt"]),
            ("two", &["echo 2 > two.txt"]),
        ],
    ));
    let (id, out) = f.start(&[]);
    assert_eq!(out.status.code(), Some(4), "{}", f.explain(&out));
    assert!(stdout(&out).contains("phase `one`"), "{}", f.explain(&out));

    let st = f.status(&id);
    assert_eq!(state(&st), "blocked");
    assert_eq!(st["block"]["cause"], "verification");
    assert_eq!(st["block"]["verifier"], "gate");
    assert_eq!(st["phase"], "one", "the run is still at the first phase");
    assert_eq!(st["phases"][0]["verified"], false);
    let second = &st["phases"][1]["steps"][0];
    assert_eq!(second["state"], "not_started", "{st:#}");
    assert_eq!(second["attempts"], 0);
    let gate_ev = evidence_of(&st, "gate");
    assert_eq!(gate_ev["passed"], false);
    assert_eq!(gate_ev["tier"], "phase");
    assert!(artifact(&f, gate_ev["output"].as_str().unwrap()).contains("gate-output"));
    assert!(
        st["evidence"]
            .as_array()
            .unwrap()
            .iter()
            .all(|e| e["verifier"] != "final"),
        "acceptance must not run before the phases are done"
    );

    let events = f.events(&id);
    assert!(
        !events.iter().any(|e| {
            (e["kind"] == "phase_started" && e["body"]["phase"] == 1)
                || (e["kind"] == "step_started" && e["body"]["step"]["phase"] == 1)
        }),
        "nothing of phase two may start while phase one is unverified: {:?}",
        kinds(&events)
    );
    assert!(of_kind(&events, "phase_verified").is_empty());
    assert!(!f.path("two.txt").exists());
    never_completed(&f, &id);

    // Make the gate pass: the run goes on into phase two and completes.
    std::fs::write(&ok, "").unwrap();
    f.expect(&["resume", &id], 0);
    let events = f.events(&id);
    let verified = of_kind(&events, "phase_verified")[0]["seq"]
        .as_u64()
        .unwrap();
    let second_started = events
        .iter()
        .find(|e| e["kind"] == "phase_started" && e["body"]["phase"] == 1)
        .expect("phase two started after the gate passed");
    assert!(second_started["seq"].as_u64().unwrap() > verified);
    assert!(f.path("two.txt").exists());
    assert_eq!(completed_runs_have_passing_acceptance_evidence(&f), 1);
}

#[test]
fn a_failing_step_verifier_rolls_the_step_back_and_retries_it() {
    let outside = tempfile::tempdir().unwrap();
    let c = outside.path().join("attempts");
    let c = c.display();
    let listing = outside.path().join("listing");
    let l = listing.display();
    // Each attempt records what it found in the workspace, then writes attempt-N.txt and
    // appends to the tracked README. The step verifier rejects the first attempt's work.
    let step = format!(
        "n=$(cat {c} 2>/dev/null || echo 0); n=$((n+1)); echo $n > {c}; \
         ls > {l}-$n; cat README.md >> {l}-$n; \
         echo work > attempt-$n.txt; echo \"attempt $n\" >> README.md"
    );
    let f = Fixture::new(&contract(
        &[
            (
                "no-first",
                "step",
                "echo step-verifier-says-no-first; ! test -f attempt-1.txt",
            ),
            ("done", "acceptance", "test -f attempt-2.txt"),
        ],
        &[("work", &[&step])],
    ));
    let (id, out) = f.start(&[]);
    assert_eq!(out.status.code(), Some(0), "{}", f.explain(&out));

    // What the first attempt wrote is gone, the tracked file restored, the retry's work kept.
    assert!(!f.path("attempt-1.txt").exists());
    assert!(f.path("attempt-2.txt").exists());
    assert_eq!(
        std::fs::read_to_string(f.path("README.md")).unwrap(),
        "fixture\nattempt 2\n"
    );
    // ... and it was gone before the retry ran.
    let seen = std::fs::read_to_string(format!("{l}-2")).unwrap();
    assert!(!seen.contains("attempt-1.txt"), "the retry saw: {seen}");
    assert!(!seen.contains("attempt 1"), "the retry saw: {seen}");

    let events = f.events(&id);
    let failed = of_kind(&events, "step_failed");
    assert_eq!(failed.len(), 1, "{:?}", kinds(&events));
    let body = &failed[0]["body"];
    assert!(
        body["reason"].as_str().unwrap().contains("no-first"),
        "the failure names the step verifier: {body}"
    );
    let rolled: Vec<&str> = body["rolled_back"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p.as_str().unwrap())
        .collect();
    assert!(
        rolled.iter().any(|p| p.contains("attempt-1.txt"))
            && rolled.iter().any(|p| p.contains("README.md")),
        "rolled_back names the paths: {rolled:?}"
    );
    let attempts: Vec<u64> = of_kind(&events, "step_started")
        .iter()
        .map(|e| e["body"]["attempt"].as_u64().unwrap())
        .collect();
    assert_eq!(attempts, vec![1, 2]);

    let step_evidence: Vec<&Value> = of_kind(&events, "evidence_recorded")
        .into_iter()
        .filter(|e| e["body"]["evidence"]["tier"] == "step")
        .collect();
    assert_eq!(step_evidence.len(), 2);
    assert_eq!(step_evidence[0]["body"]["evidence"]["passed"], false);
    assert_eq!(step_evidence[1]["body"]["evidence"]["passed"], true);
    for e in &step_evidence {
        assert_eq!(e["body"]["evidence"]["step"]["phase"], 0, "{e}");
        assert_eq!(e["body"]["evidence"]["step"]["index"], 0, "{e}");
    }
    let first_log = artifact(
        &f,
        step_evidence[0]["body"]["evidence"]["output"]
            .as_str()
            .unwrap(),
    );
    assert!(first_log.contains("step-verifier-says-no-first"));
    let st = f.status(&id);
    assert_eq!(st["phases"][0]["steps"][0]["attempts"], 2);
    assert_eq!(st["phases"][0]["steps"][0]["state"], "verified");
    f.verify_log_ok(&id);
}

#[test]
fn evidence_records_command_status_duration_output_tree_and_fingerprint() {
    let f = Fixture::new(&contract(
        &[
            ("lint", "step", "echo lint-ok"),
            ("gate", "phase", "echo gate-ok"),
            ("tests", "acceptance", "echo tests-ok; test -f b.txt"),
            ("docs", "acceptance", "echo docs-ok"),
        ],
        &[("one", &["echo a > a.txt"]), ("two", &["echo b > b.txt"])],
    ));
    let (id, out) = f.start(&[]);
    assert_eq!(out.status.code(), Some(0), "{}", f.explain(&out));

    let events = f.events(&id);
    let recorded: Vec<&Value> = of_kind(&events, "evidence_recorded")
        .into_iter()
        .map(|e| &e["body"]["evidence"])
        .collect();
    // lint after each step, gate after each phase, then both acceptance verifiers.
    let names: Vec<&str> = recorded
        .iter()
        .map(|e| e["verifier"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["lint", "gate", "lint", "gate", "tests", "docs"]);
    let commands = [
        ("lint", "echo lint-ok"),
        ("gate", "echo gate-ok"),
        ("tests", "echo tests-ok; test -f b.txt"),
        ("docs", "echo docs-ok"),
    ];
    for (i, e) in recorded.iter().enumerate() {
        let name = e["verifier"].as_str().unwrap();
        let command = commands.iter().find(|(n, _)| *n == name).unwrap().1;
        assert_eq!(e["n"].as_u64(), Some(i as u64 + 1), "{e}");
        assert_eq!(e["command"], command, "{e}");
        assert_eq!(e["passed"], true, "{e}");
        assert_eq!(e["status"], "exit 0", "{e}");
        assert!(e["duration_ms"].is_u64(), "{e}");
        assert!(e["cpu_ms"].is_u64(), "{e}");
        let log = artifact(&f, e["output"].as_str().unwrap());
        assert!(
            log.contains(&format!("{name}-ok")),
            "{name}'s output: {log:?}"
        );
        assert!(
            is_hex(e["tree"].as_str().unwrap(), 40),
            "a git tree id: {e}"
        );
        assert!(is_hex(e["fingerprint"].as_str().unwrap(), 64), "{e}");
    }

    // The acceptance evidence judged the tree the run ended with: the one its last checkpoint
    // snapshotted, which holds the work of both phases.
    let out = f.expect(&["checkpoints", &id, "--json"], 0);
    let checkpoints: Value = serde_json::from_slice(&out.stdout).unwrap();
    let last = checkpoints.as_array().unwrap().last().unwrap();
    let commit = last["commit"].as_str().unwrap();
    let snapshot_tree = git(f.root(), &["rev-parse", &format!("{commit}^{{tree}}")]);
    let files = git(f.root(), &["ls-tree", "--name-only", &snapshot_tree]);
    assert!(
        files.contains("a.txt") && files.contains("b.txt"),
        "{files}"
    );
    for e in &recorded[4..] {
        assert_eq!(e["tier"], "acceptance");
        assert_eq!(e["tree"], snapshot_tree.as_str(), "{e}");
    }
    // A step verifier judges the tree its step left: the `post` tree of that step.
    let finished: Vec<&Value> = of_kind(&events, "step_finished");
    assert_eq!(finished.len(), 2);
    let base = &events[0]["body"]["base"]["tree"];
    for (lint, step) in [(recorded[0], finished[0]), (recorded[2], finished[1])] {
        assert_eq!(
            lint["tree"], step["body"]["post"]["tree"],
            "evidence of step verifier `lint` must record the tree it judged (the step's result), \
             not the tree before the step (the run's base tree is {base})\n\
             evidence: {lint}\nstep_finished: {step}"
        );
    }
    assert_ne!(recorded[0]["tree"], recorded[4]["tree"]);

    // status --json shows the newest evidence of each verifier, the same records.
    let st = f.status(&id);
    for name in ["lint", "gate", "tests", "docs"] {
        let shown = evidence_of(&st, name);
        let newest = recorded
            .iter()
            .rev()
            .find(|e| e["verifier"] == name)
            .unwrap();
        assert_eq!(shown, *newest);
    }
    // And SQLite holds every record with the same facts.
    let rows = evidence_rows(&f, &id);
    assert_eq!(rows.len(), recorded.len());
    for (row, e) in rows.iter().zip(&recorded) {
        assert_eq!(row.1, e["verifier"].as_str().unwrap());
        assert_eq!(row.2, e["tier"].as_str().unwrap());
        assert!(row.3);
        assert_eq!(row.4, e["status"].as_str().unwrap());
        assert_eq!(row.5, e["output"].as_str().unwrap());
        assert_eq!(row.6, e["tree"].as_str().unwrap());
        let body: Value = serde_json::from_str(&row.7).unwrap();
        assert_eq!(&body, *e);
    }
    assert_eq!(completed_runs_have_passing_acceptance_evidence(&f), 1);
}

/// Every way the CLI offers to move a run on, tried on a run whose acceptance verifier fails and
/// keeps failing: none of them gives `completed`.
#[test]
fn no_cli_path_completes_a_run_whose_acceptance_verifier_fails() {
    let outside = tempfile::tempdir().unwrap();
    let never = outside.path().join("never");
    let check = format!("echo still-failing; test -f {}", never.display());
    let f = Fixture::new(&contract(
        &[
            ("other", "acceptance", "true"),
            ("never", "acceptance", &check),
        ],
        &[("work", &["echo a > a.txt"])],
    ));
    let (id, out) = f.start(&[]);
    assert_eq!(out.status.code(), Some(4), "{}", f.explain(&out));
    never_completed(&f, &id);

    let attempts: [&[&str]; 5] = [
        &["resume", &id],
        &["resume", &id],
        &["resume", &id, "--migrate", "--reason", "ship it anyway"],
        &[
            "unblock",
            &id,
            "--budget",
            "steps=+10",
            "--reason",
            "more room",
        ],
        &[
            "unblock",
            &id,
            "--budget",
            "same_error=+10",
            "--reason",
            "more room",
        ],
    ];
    for args in attempts {
        let out = f.run(args);
        assert_eq!(
            out.status.code(),
            Some(4),
            "keel {args:?} must leave the run blocked\n{}",
            f.explain(&out)
        );
        assert!(!stdout(&out).contains("completed"), "{}", f.explain(&out));
        never_completed(&f, &id);
    }

    // Changing the workspace, and even the contract file, then migrating: the verifier that
    // the run was started with is what judges, and it still fails.
    std::fs::write(f.path("a.txt"), "edited by hand\n").unwrap();
    let forged = std::fs::read_to_string(f.path("keel.toml"))
        .unwrap()
        .replace(&check, "true");
    f.write_contract(&forged);
    let out = f.run(&["resume", &id]);
    assert_eq!(out.status.code(), Some(4), "{}", f.explain(&out));
    never_completed(&f, &id);
    let out = f.run(&[
        "resume",
        &id,
        "--migrate",
        "--reason",
        "I edited the contract",
    ]);
    assert_ne!(out.status.code(), Some(0), "{}", f.explain(&out));
    never_completed(&f, &id);

    // Cancelling ends it failed, never completed, and nothing revives it.
    f.expect(&["cancel", &id, "--reason", "giving up"], 5);
    assert_eq!(state(&f.status(&id)), "failed");
    f.expect(&["resume", &id], 5);
    f.expect(
        &["unblock", &id, "--budget", "steps=+1", "--reason", "again"],
        2,
    );
    assert_eq!(state(&f.status(&id)), "failed");
    never_completed(&f, &id);

    // Every evidence row of `never` failed; the store holds no completed run.
    let rows = evidence_rows(&f, &id);
    let never_rows: Vec<&Row> = rows.iter().filter(|r| r.1 == "never").collect();
    assert!(
        never_rows.len() >= 6,
        "each attempt ran the verifier again: {}",
        never_rows.len()
    );
    assert!(never_rows.iter().all(|r| !r.3));
    assert_eq!(completed_runs_have_passing_acceptance_evidence(&f), 0);
    f.verify_log_ok(&id);
}

/// Several runs, in three workspaces sharing one store, some completed, some not: the SQLite
/// check holds for all of them.
#[test]
fn in_sqlite_every_completed_run_has_passing_evidence_of_every_acceptance_verifier() {
    let outside = tempfile::tempdir().unwrap();
    // Not beside the store: a confined command cannot see the store's directory.
    let flags = tempfile::tempdir().unwrap();
    let flag = flags.path().join("flag");
    let store = outside.path().join("shared.db");
    let store_arg = store.display().to_string();
    let gated = format!("test -f {}", flag.display());
    let a = Fixture::new(&contract(
        &[("x", "acceptance", "true"), ("y", "acceptance", "echo y")],
        &[("work", &["echo a > a.txt"])],
    ));
    let b = Fixture::new(&contract(
        &[("gated", "acceptance", &gated)],
        &[("work", &["echo b > b.txt"])],
    ));
    let c = Fixture::new(&contract(
        &[
            ("fails", "acceptance", "false"),
            ("x", "acceptance", "true"),
        ],
        &[("work", &["echo c > c.txt"])],
    ));
    let keel = |f: &Fixture, args: &[&str], code: i32| -> String {
        let mut full = vec!["--store", store_arg.as_str()];
        full.extend_from_slice(args);
        let out = f.expect(&full, code);
        stdout(&out)
    };
    let start = |f: &Fixture, code: i32| -> String {
        keel(f, &["run", "keel.toml"], code)
            .lines()
            .next()
            .and_then(|l| l.strip_prefix("run "))
            .expect("the run id comes first")
            .to_string()
    };
    let ida = start(&a, 0);
    let idb = start(&b, 4);
    let idc = start(&c, 4);
    std::fs::write(&flag, "").unwrap();
    keel(&b, &["resume", &idb], 0);
    keel(&c, &["resume", &idc], 4);

    let db = rusqlite::Connection::open(&store).unwrap();
    assert_eq!(
        completed_runs_in_db_have_passing_acceptance_evidence(&db),
        2
    );
    let states: Vec<(String, String)> = db
        .prepare("SELECT id, state FROM runs ORDER BY id")
        .unwrap()
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    let mut expected = vec![
        (ida, "completed".to_string()),
        (idb, "completed".to_string()),
        (idc.clone(), "blocked".to_string()),
    ];
    expected.sort();
    assert_eq!(states, expected);
    let fails: bool = db
        .query_row(
            "SELECT passed FROM evidence WHERE run_id = ?1 AND verifier = 'fails' ORDER BY n DESC",
            [&idc],
            |r| r.get(0),
        )
        .unwrap();
    assert!(!fails);
    for (id, _) in &states {
        keel(&a, &["verify-log", id], 0);
    }
}
