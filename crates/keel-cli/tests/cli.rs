//! The `keel` command line as a script or a person sees it: the run id first, stable JSON field
//! names, every run listed, exit codes, `init`, `cancel`, and quiet output when piped.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::process::Stdio;

use common::{Fixture, kinds, state, stderr, stdout};
use serde_json::Value;

const GOOD: &str = r#"[task]
goal = "a.txt and b.txt exist."

[budget]
steps = 10

[[verify]]
name = "files"
tier = "acceptance"
run = "test -f a.txt && test -f b.txt"

[[verify]]
name = "gate"
tier = "phase"
run = "true"

[[phase]]
name = "first"
kind = "command"
run = ["echo a > a.txt"]

[[phase]]
name = "second"
kind = "command"
run = ["echo b > b.txt"]
"#;

/// Needs more steps than its budget allows: it ends blocked.
const SHORT: &str = r#"[task]
goal = "Three files exist."

[budget]
steps = 1

[[verify]]
name = "files"
tier = "acceptance"
run = "test -f x.txt && test -f y.txt"

[[phase]]
name = "work"
kind = "command"
run = ["echo x > x.txt", "echo y > y.txt"]
"#;

fn json(f: &Fixture, args: &[&str]) -> Value {
    let out = f.expect(args, 0);
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("keel {args:?} --json is not JSON: {e}\n{}", f.explain(&out)))
}

fn has_keys(value: &Value, keys: &[&str], what: &str) {
    let obj = value
        .as_object()
        .unwrap_or_else(|| panic!("{what} is a JSON object: {value}"));
    for k in keys {
        assert!(
            obj.contains_key(*k),
            "{what} lacks the field `{k}`: {value:#}"
        );
    }
}

#[test]
fn run_prints_the_run_id_before_anything_else_and_a_final_line() {
    let f = Fixture::new(GOOD);
    let out = f.expect(&["run", "keel.toml"], 0);
    let text = stdout(&out);
    let lines: Vec<&str> = text.lines().collect();
    let id = lines[0]
        .strip_prefix("run ")
        .unwrap_or_else(|| panic!("first line is `run <id>`\n{}", f.explain(&out)));
    assert!(
        id.len() >= 16 && id.chars().all(|c| c.is_ascii_alphanumeric()),
        "a run id: {id:?}"
    );
    assert!(
        lines.last().unwrap().starts_with("completed"),
        "{}",
        f.explain(&out)
    );
    // The printed id names the run, in full and by a unique prefix.
    assert_eq!(f.status(id)["id"], id);
    assert_eq!(f.status(&id[..12])["id"], id);
    // The store is beside the contract.
    assert!(f.path(".keel/keel.db").exists());
}

#[test]
fn the_id_comes_first_even_when_the_run_blocks_or_fails() {
    let f = Fixture::new(SHORT);
    let (id, out) = f.start(&[]);
    assert_eq!(out.status.code(), Some(4), "{}", f.explain(&out));
    assert_eq!(state(&f.status(&id)), "blocked");
    let text = stdout(&out);
    assert!(
        text.lines().last().unwrap().starts_with("blocked: "),
        "{text}"
    );
}

#[test]
fn read_commands_have_stable_json_field_names() {
    let f = Fixture::new(GOOD);
    let (id, out) = f.start(&[]);
    assert_eq!(out.status.code(), Some(0), "{}", f.explain(&out));

    let st = json(&f, &["status", &id, "--json"]);
    has_keys(
        &st,
        &[
            "id",
            "state",
            "reason",
            "block",
            "phase",
            "phase_index",
            "phases",
            "budgets",
            "evidence",
            "checkpoints",
            "contract",
            "contract_hash",
            "workspace",
            "created_at",
            "updated_at",
            "events",
        ],
        "status --json",
    );
    assert_eq!(st["id"], id.as_str());
    assert_eq!(st["state"], "completed");
    assert!(st["reason"].is_string());
    assert_eq!(st["phase_index"], 2, "past the last phase");
    let phases = st["phases"].as_array().unwrap();
    assert_eq!(phases.len(), 2);
    for p in phases {
        has_keys(p, &["name", "verified", "steps"], "a phase");
        assert_eq!(p["verified"], true);
        for s in p["steps"].as_array().unwrap() {
            has_keys(s, &["command", "state", "attempts", "output"], "a step");
            assert_eq!(s["state"], "verified");
        }
    }
    assert_eq!(phases[0]["name"], "first");
    for name in [
        "tokens",
        "cost_usd",
        "wall_time",
        "compute_time",
        "steps",
        "tool_calls",
        "same_error",
        "no_progress_steps",
        "writes",
        "network_requests",
        "parallel_workers",
        "diff_lines",
        "files_changed",
        "approvals",
    ] {
        let b = &st["budgets"][name];
        has_keys(b, &["used", "limit", "unit", "enforced"], name);
        assert!(b["used"].is_u64(), "{name}: {b}");
        assert!(b["enforced"].is_boolean(), "{name}: {b}");
    }
    assert_eq!(st["budgets"]["steps"]["limit"], 10);
    assert_eq!(st["budgets"]["steps"]["used"], 2);
    assert_eq!(st["budgets"]["tokens"]["enforced"], true);
    assert_eq!(st["budgets"]["network_requests"]["enforced"], true);
    assert_eq!(st["budgets"]["parallel_workers"]["enforced"], false);
    assert!(st["budgets"]["tokens"]["limit"].is_null());
    assert_eq!(st["budgets"]["wall_time"]["unit"], "ms");
    assert_eq!(st["budgets"]["cost_usd"]["unit"], "micro_usd");
    for e in st["evidence"].as_array().unwrap() {
        has_keys(
            e,
            &[
                "n",
                "verifier",
                "tier",
                "command",
                "passed",
                "status",
                "duration_ms",
                "output",
                "tree",
                "fingerprint",
            ],
            "evidence",
        );
    }
    let checkpoint_count = st["checkpoints"].as_u64().unwrap();
    assert!(checkpoint_count >= 3, "one at the start and one per phase");

    let log = json(&f, &["log", &id, "--json"]);
    let events = log.as_array().unwrap();
    assert_eq!(st["events"].as_u64(), Some(events.len() as u64));
    for (i, e) in events.iter().enumerate() {
        has_keys(
            e,
            &["seq", "at", "at_ms", "kind", "body", "prev_hash", "hash"],
            "an event",
        );
        assert_eq!(e["seq"].as_u64(), Some(i as u64 + 1), "contiguous seq");
        assert_eq!(e["body"]["kind"], e["kind"]);
        if i > 0 {
            assert_eq!(e["prev_hash"], events[i - 1]["hash"], "hash chain");
        }
    }
    let k = kinds(events);
    assert_eq!(k[0], "run_created");
    for kind in [
        "resumed",
        "checkpoint_taken",
        "phase_started",
        "step_started",
        "step_finished",
        "step_verified",
        "evidence_recorded",
        "phase_verified",
        "state_changed",
    ] {
        assert!(k.iter().any(|x| x == kind), "no `{kind}` event: {k:?}");
    }
    assert_eq!(k.last().unwrap(), "state_changed");
    assert_eq!(events.last().unwrap()["body"]["to"], "completed");

    let cps = json(&f, &["checkpoints", &id, "--json"]);
    let cps = cps.as_array().unwrap();
    assert_eq!(cps.len() as u64, checkpoint_count);
    for (n, c) in cps.iter().enumerate() {
        has_keys(
            c,
            &[
                "n",
                "seq",
                "at",
                "hash",
                "snapshot_ref",
                "commit",
                "phase_index",
                "fingerprint",
            ],
            "a checkpoint",
        );
        assert_eq!(c["n"].as_u64(), Some(n as u64));
        assert_eq!(
            c["snapshot_ref"].as_str().unwrap(),
            format!("refs/keel/{id}/{n}")
        );
        has_keys(
            &c["fingerprint"],
            &["head", "branch", "tree"],
            "a fingerprint",
        );
        let seq = c["seq"].as_u64().unwrap() as usize;
        assert_eq!(events[seq]["kind"], "checkpoint_taken", "{c}");
    }

    let report = json(&f, &["verify-log", &id, "--json"]);
    has_keys(
        &report,
        &[
            "run",
            "events",
            "checkpoints",
            "artifacts_checked",
            "problems",
        ],
        "verify-log --json",
    );
    assert_eq!(report["run"], id.as_str());
    assert_eq!(report["events"].as_u64(), Some(events.len() as u64));
    assert_eq!(report["checkpoints"].as_u64(), Some(checkpoint_count));
    assert_eq!(report["problems"], Value::Array(vec![]));
    let out = f.expect(&["verify-log", &id], 0);
    assert!(stdout(&out).starts_with("ok"), "{}", f.explain(&out));

    // The human forms work too.
    for args in [
        vec!["status", id.as_str()],
        vec!["status"],
        vec!["log", id.as_str()],
        vec!["checkpoints", id.as_str()],
    ] {
        let out = f.expect(&args, 0);
        assert!(!out.stdout.is_empty(), "keel {args:?} printed nothing");
    }
}

#[test]
fn status_json_without_a_run_lists_every_run() {
    let f = Fixture::new(GOOD);
    std::fs::write(f.path("short.toml"), SHORT).unwrap();
    let (done, out) = f.start(&[]);
    assert_eq!(out.status.code(), Some(0), "{}", f.explain(&out));
    let out = f.expect(&["run", "short.toml"], 4);
    let blocked = stdout(&out).lines().next().unwrap()[4..].to_string();
    let out = f.expect(&["run", "short.toml"], 4);
    let cancelled = stdout(&out).lines().next().unwrap()[4..].to_string();
    f.expect(&["cancel", &cancelled, "--reason", "not needed"], 5);

    let list = json(&f, &["status", "--json"]);
    let list = list.as_array().expect("a list of runs");
    assert_eq!(list.len(), 3, "{list:#?}");
    let mut seen: Vec<(String, String)> = list
        .iter()
        .map(|r| {
            has_keys(
                r,
                &["id", "state", "reason", "phase", "budgets"],
                "a listed run",
            );
            (
                r["id"].as_str().unwrap().to_string(),
                r["state"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    seen.sort();
    let mut expected = vec![
        (done.clone(), "completed".to_string()),
        (blocked.clone(), "blocked".to_string()),
        (cancelled.clone(), "failed".to_string()),
    ];
    expected.sort();
    assert_eq!(seen, expected);
    // Each entry is what `status ID --json` says about that run.
    for r in list {
        let one = f.status(r["id"].as_str().unwrap());
        assert_eq!(r["state"], one["state"]);
        assert_eq!(r["reason"], one["reason"]);
        assert_eq!(r["budgets"], one["budgets"]);
    }
    let out = f.expect(&["status"], 0);
    let text = stdout(&out);
    for id in [&done, &blocked, &cancelled] {
        assert!(
            text.contains(id.as_str()),
            "`keel status` lists {id}\n{text}"
        );
    }
}

#[test]
fn an_unknown_run_id_is_a_usage_error_with_a_message() {
    let f = Fixture::new(GOOD);
    let (_, out) = f.start(&[]);
    assert_eq!(out.status.code(), Some(0), "{}", f.explain(&out));
    let commands: [&[&str]; 8] = [
        &["status", "nosuchrun"],
        &["status", "nosuchrun", "--json"],
        &["log", "nosuchrun"],
        &["checkpoints", "nosuchrun"],
        &["verify-log", "nosuchrun"],
        &["resume", "nosuchrun"],
        &["cancel", "nosuchrun", "--reason", "r"],
        &[
            "unblock",
            "nosuchrun",
            "--budget",
            "steps=+1",
            "--reason",
            "r",
        ],
    ];
    for args in commands {
        let out = f.expect(args, 2);
        let err = stderr(&out);
        assert!(
            err.contains("nosuchrun"),
            "keel {args:?}: the message names the id\n{}",
            f.explain(&out)
        );
        assert!(out.stdout.is_empty(), "{}", f.explain(&out));
    }
}

#[test]
fn read_commands_without_a_store_say_where_they_looked() {
    let f = Fixture::new(GOOD);
    let out = f.expect(&["status", "--json"], 2);
    assert!(
        stderr(&out).contains("no keel store"),
        "{}",
        f.explain(&out)
    );
    assert!(!f.path(".keel").exists(), "reading must not create a store");
}

#[test]
fn a_missing_contract_file_is_a_usage_error() {
    let f = Fixture::new(GOOD);
    let out = f.run(&["run", "missing.toml"]);
    assert_eq!(
        out.status.code(),
        Some(2),
        "a contract file that does not exist is a usage error (exit 2), not an internal error\n{}",
        f.explain(&out)
    );
    assert!(stderr(&out).contains("missing.toml"), "{}", f.explain(&out));
    assert!(!f.path(".keel").exists());
}

#[test]
fn detach_creates_the_run_and_leaves_it_for_a_worker() {
    let f = Fixture::new(GOOD);
    let out = f.expect(&["run", "--detach", "keel.toml"], 0);
    let id = stdout(&out).lines().next().unwrap()[4..].to_string();
    assert!(
        stdout(&out).contains("left for a worker"),
        "{}",
        f.explain(&out)
    );
    let status = f.status(&id);
    assert_eq!(state(&status), "planned");
    assert_eq!(status["budgets"]["steps"]["used"], 0, "nothing ran");
}

#[test]
fn init_writes_a_template_that_run_accepts_and_refuses_to_overwrite() {
    let f = Fixture::new(GOOD);
    std::fs::remove_file(f.path("keel.toml")).unwrap();

    // Default path.
    let out = f.expect(&["init"], 0);
    assert!(stdout(&out).contains("keel.toml"), "{}", f.explain(&out));
    let template = std::fs::read_to_string(f.path("keel.toml")).unwrap();
    for section in [
        "[task]",
        "[budget]",
        "[[verify]]",
        "[[phase]]",
        "acceptance",
    ] {
        assert!(template.contains(section), "the template has {section}");
    }
    assert!(
        template.lines().any(|l| l.trim_start().starts_with('#')),
        "commented"
    );

    // It refuses to overwrite, and leaves the file alone.
    std::fs::write(f.path("keel.toml"), "# mine\n").unwrap();
    let out = f.expect(&["init"], 2);
    let err = stderr(&out);
    assert!(
        err.contains("already exists") && err.contains("--force"),
        "{err}"
    );
    assert_eq!(
        std::fs::read_to_string(f.path("keel.toml")).unwrap(),
        "# mine\n"
    );
    f.expect(&["init", "--force"], 0);
    assert_eq!(
        std::fs::read_to_string(f.path("keel.toml")).unwrap(),
        template
    );

    // Another path; `keel run` accepts it as a contract (its cargo commands may well fail in
    // this repository, but it is not refused as invalid).
    f.expect(&["init", "other.toml"], 0);
    f.expect(&["init", "other.toml"], 2);
    let (id, out) = f.start_contract("other.toml");
    let code = out.status.code();
    assert!(
        matches!(code, Some(0) | Some(4) | Some(5)),
        "the template must be a valid contract that runs to an end, got {code:?}\n{}",
        f.explain(&out)
    );
    let st = f.status(&id);
    assert!(st["contract"].as_str().unwrap().ends_with("other.toml"));
    assert_eq!(st["budgets"]["steps"]["limit"], 200);
}

#[test]
fn cancel_ends_a_run_failed_for_good() {
    let f = Fixture::new(SHORT);
    let (id, out) = f.start(&[]);
    assert_eq!(out.status.code(), Some(4), "{}", f.explain(&out));

    f.expect(&["cancel", &id], 2); // --reason is required
    assert_eq!(state(&f.status(&id)), "blocked");

    let out = f.expect(&["cancel", &id, "--reason", "wrong approach"], 5);
    assert!(stdout(&out).contains("cancelled"), "{}", f.explain(&out));
    let st = f.status(&id);
    assert_eq!(state(&st), "failed");
    assert!(
        st["reason"].as_str().unwrap().contains("wrong approach"),
        "{st:#}"
    );
    let events = f.events(&id);
    let cancelled: Vec<&Value> = events.iter().filter(|e| e["kind"] == "cancelled").collect();
    assert_eq!(cancelled.len(), 1);
    assert_eq!(cancelled[0]["body"]["reason"], "wrong approach");
    assert!(cancelled[0]["body"]["by"].is_string());
    let last = events.last().unwrap();
    assert_eq!(last["kind"], "state_changed");
    assert_eq!(last["body"]["to"], "failed");

    // Failed is final: resume reports it (exit 5) and changes nothing; cancel and unblock refuse.
    let count = events.len();
    f.expect(&["resume", &id], 5);
    f.expect(&["cancel", &id, "--reason", "again"], 2);
    f.expect(
        &["unblock", &id, "--budget", "steps=+5", "--reason", "r"],
        2,
    );
    assert_eq!(
        f.events(&id).len(),
        count,
        "nothing is appended to a failed run"
    );
    assert_eq!(state(&f.status(&id)), "failed");
    f.verify_log_ok(&id);
}

#[test]
fn output_is_quiet_when_piped() {
    let f = Fixture::new(GOOD);
    let out = f
        .keel()
        .args(["run", "keel.toml"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", f.explain(&out));
    assert!(
        out.stderr.is_empty(),
        "no progress lines on a piped stderr\n{}",
        f.explain(&out)
    );
    let text = stdout(&out);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 2, "the id and the final line only\n{text}");
    assert!(lines[0].starts_with("run "));
    assert!(lines[1].starts_with("completed"));

    // The same for a resume that blocks.
    let f = Fixture::new(SHORT);
    let (id, out) = f.start(&[]);
    assert!(out.stderr.is_empty(), "{}", f.explain(&out));
    let out = f.expect(&["resume", &id], 4);
    assert!(out.stderr.is_empty(), "{}", f.explain(&out));
    assert_eq!(stdout(&out).lines().count(), 1, "{}", f.explain(&out));
}

#[test]
fn a_closed_stdout_pipe_is_not_a_crash() {
    // `keel log ID --json | head -1`: the reader goes away before keel writes.
    let f = Fixture::new(GOOD);
    let (id, out) = f.start(&[]);
    assert_eq!(out.status.code(), Some(0), "{}", f.explain(&out));
    for args in [
        vec!["log", id.as_str(), "--json"],
        vec!["status", "--json"],
        vec!["log", id.as_str()],
    ] {
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader);
        let out = f
            .keel()
            .args(&args)
            .stdout(writer)
            .stderr(Stdio::piped())
            .output()
            .unwrap();
        let err = stderr(&out);
        assert!(
            !err.contains("panicked") && out.status.code() != Some(101),
            "keel {args:?} with its stdout closed panicked (exit {:?}):\n{err}",
            out.status.code()
        );
    }
}

#[test]
fn the_store_can_be_moved_with_store_or_keel_store() {
    let f = Fixture::new(GOOD);
    let elsewhere = tempfile::tempdir().unwrap();
    let db = elsewhere.path().join("runs.db");
    let db_arg = db.display().to_string();
    let out = f.expect(&["--store", &db_arg, "run", "keel.toml"], 0);
    let id = stdout(&out).lines().next().unwrap()[4..].to_string();
    assert!(db.exists());
    assert!(
        !f.path(".keel/keel.db").exists(),
        "the store went where it was told"
    );
    let out = f.expect(&["--store", &db_arg, "status", &id, "--json"], 0);
    let st: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(st["state"], "completed");
    let out = f
        .keel()
        .env("KEEL_STORE", &db)
        .args(["status", "--json"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", f.explain(&out));
    let list: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(list[0]["id"], id.as_str());
    // A --store that does not exist is a usage error for read commands.
    let missing = elsewhere.path().join("nope.db").display().to_string();
    f.expect(&["--store", &missing, "status"], 2);
}

trait StartContract {
    fn start_contract(&self, contract: &str) -> (String, std::process::Output);
}

impl StartContract for Fixture {
    fn start_contract(&self, contract: &str) -> (String, std::process::Output) {
        let out = self.run(&["run", contract]);
        let id = stdout(&out)
            .lines()
            .next()
            .and_then(|l| l.strip_prefix("run "))
            .unwrap_or_else(|| panic!("no run id first\n{}", self.explain(&out)))
            .to_string();
        (id, out)
    }
}

#[test]
fn a_workspace_that_is_not_a_git_repository_is_refused_without_a_trace() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("keel.toml"), GOOD).unwrap();
    let out = std::process::Command::new(common::keel_bin())
        .current_dir(dir.path())
        .args(["run", "keel.toml"])
        .env_remove("KEEL_STORE")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("git init"), "{}", stderr(&out));
    assert!(
        stdout(&out).is_empty(),
        "no run id for a run that never existed"
    );
    assert!(
        !dir.path().join(".keel").exists(),
        "a refused run left a store behind"
    );
}
