//! Policy of agent steps, through the `keel` binary: a scripted driver that tries to leave its
//! scope in every way the contract forbids (outside `writable`, into `forbidden`, a command not
//! in `commands`, `../`, an absolute path, symlinks, `.keel` and `.git`, unknown tools, tools
//! not in the phase, malformed arguments) has every attempt denied with a rule that says why,
//! counted as a violation and shown to the driver in its next prompt, while the workspace and a
//! directory outside it stay as they were; legitimate calls in between work and the run
//! completes. Also: a `finish` whose acceptance verifier fails never completes the run.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::Path;

use common::{Fixture, git, kinds, of_kind, state};
use serde_json::{Value, json};

/// The user part of the prompt of every model call, in order (the script driver records its
/// request as JSON with `system` and `user`).
fn prompts(f: &Fixture, events: &[Value]) -> Vec<(u64, String)> {
    of_kind(events, "model_requested")
        .iter()
        .map(|e| {
            let hash = e["body"]["request"].as_str().unwrap();
            let bytes = f.artifact(hash);
            let v: Value = serde_json::from_slice(&bytes).expect("a script request is JSON");
            (
                e["body"]["step"]["index"].as_u64().unwrap(),
                v["user"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

fn jsonl(lines: &[Value]) -> String {
    lines
        .iter()
        .map(|l| format!("{l}\n"))
        .collect::<Vec<_>>()
        .join("")
}

fn listing(dir: &Path) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| {
            (
                e.file_name().to_string_lossy().to_string(),
                std::fs::read_to_string(e.path()).unwrap_or_default(),
            )
        })
        .collect();
    out.sort();
    out
}

const POLICY_CONTRACT: &str = r#"
[task]
goal = "src/out.txt says done."

[driver]
kind = "script"
script = "actions.jsonl"

[scope]
writable = ["src/**"]
forbidden = ["src/locked.txt"]
commands = ["cat *"]

[budget]
steps = 60
same_error = 50

[[verify]]
name = "out"
tier = "acceptance"
run = "grep -qx done src/out.txt"

[[phase]]
name = "work"
kind = "agent"
objective = "Write done into src/out.txt, then finish."
tools = ["read", "write", "patch", "run", "finish"]
done_when = []
"#;

#[test]
fn every_out_of_scope_attempt_is_denied_counted_shown_and_changes_nothing() {
    let f = Fixture::new(POLICY_CONTRACT);
    let outside = tempfile::tempdir().unwrap();
    std::fs::write(outside.path().join("target.txt"), "outside original\n").unwrap();
    std::fs::create_dir_all(f.path("src")).unwrap();
    std::fs::write(f.path("src/locked.txt"), "locked\n").unwrap();
    std::fs::write(f.path("src/keep.txt"), "keep\n").unwrap();
    std::os::unix::fs::symlink(outside.path(), f.path("src/link")).unwrap();
    std::os::unix::fs::symlink(outside.path().join("target.txt"), f.path("src/file-link")).unwrap();
    git(f.root(), &["add", "-A", "src"]);
    git(f.root(), &["commit", "-q", "-m", "src"]);
    let outside_name = outside
        .path()
        .file_name()
        .unwrap()
        .to_string_lossy()
        .to_string();
    let abs = outside.path().join("abs.txt").display().to_string();

    // (the action, for each of its calls: allowed?, and for a denial a part of the rule)
    type Expect = Vec<(bool, &'static str)>;
    let w = |path: &str, content: &str| json!({"tool": "write", "args": {"path": path, "content": content}});
    let patch = |diff: &str| json!({"tool": "patch", "args": {"diff": diff}});
    let steps: Vec<(Value, Expect)> = vec![
        (w("src/out.txt", "draft\n"), vec![(true, "")]),
        (
            w("README.md", "pwned\n"),
            vec![(false, "`README.md` is outside the writable scope")],
        ),
        (
            w("src/locked.txt", "pwned\n"),
            vec![(
                false,
                "`src/locked.txt` is forbidden by the contract's scope",
            )],
        ),
        (
            json!({"tool": "run", "args": {"command": "rm -f src/keep.txt"}}),
            vec![(
                false,
                "command `rm -f src/keep.txt` is not allowed by the contract's scope",
            )],
        ),
        (
            json!({"tool": "run", "args": {"command": "cat README.md"}}),
            vec![(true, "")],
        ),
        (
            w(&format!("../{outside_name}/dotdot.txt"), "pwned\n"),
            vec![(false, "reaches outside the workspace")],
        ),
        (
            w(&abs, "pwned\n"),
            vec![(false, "reaches outside the workspace")],
        ),
        (
            w("src/link/through.txt", "pwned\n"),
            vec![(false, "through the symlink `src/link`")],
        ),
        (
            w("src/file-link", "pwned\n"),
            vec![(false, "reaches outside the workspace")],
        ),
        (
            json!({"tool": "read", "args": {"path": "src/file-link"}}),
            vec![(false, "reaches outside the workspace")],
        ),
        (
            json!({"tool": "read", "args": {"path": ".keel/keel.db"}}),
            vec![(false, "`.keel/keel.db` is off limits")],
        ),
        (
            w(".git/hooks/pre-commit", "#!/bin/sh\n"),
            vec![(false, "is off limits")],
        ),
        (
            json!({"tool": "read", "args": {"path": "src/out.txt"}}),
            vec![(true, "")],
        ),
        (
            patch("--- a/README.md\n+++ b/README.md\n@@ -1 +1 @@\n-fixture\n+pwned\n"),
            vec![(false, "`README.md` is outside the writable scope")],
        ),
        (
            patch(
                "--- a/src/link/target.txt\n+++ b/src/link/target.txt\n@@ -1 +1 @@\n-outside original\n+pwned\n",
            ),
            vec![(false, "through the symlink `src/link`")],
        ),
        (
            patch("--- /dev/null\n+++ b/src/new.txt\n@@ -0,0 +1 @@\n+new\n"),
            vec![(true, "")],
        ),
        (
            json!({"tool": "teleport", "args": {"to": "/"}}),
            vec![(
                false,
                "there is no tool `teleport`; the tools of this phase are read, write, patch, run, finish",
            )],
        ),
        (
            json!({"tool": "plan", "args": {"items": ["x"]}}),
            vec![(false, "tool `plan` is not allowed in this phase")],
        ),
        (
            json!({"tool": "write", "arguments": "{not json"}),
            vec![(false, "the arguments are not valid JSON")],
        ),
        (
            json!({"tool": "write", "args": {"path": "src/x.txt"}}),
            vec![(false, "arguments.content is required")],
        ),
        (
            json!({"calls": [
                {"tool": "write", "args": {"path": "README.md", "content": "again\n"}},
                {"tool": "write", "args": {"path": "src/out.txt", "content": "done\n"}},
                {"tool": "finish", "args": {"summary": "src/out.txt says done"}},
                {"tool": "write", "args": {"path": "src/after.txt", "content": "late\n"}}
            ]}),
            vec![
                (false, "`README.md` is outside the writable scope"),
                (true, ""),
                (true, ""),
                (false, "a call after finish in the same reply is not made"),
            ],
        ),
    ];
    let script: Vec<Value> = steps.iter().map(|(a, _)| a.clone()).collect();
    std::fs::write(f.path("actions.jsonl"), jsonl(&script)).unwrap();

    let (id, out) = f.start(&[]);
    assert_eq!(out.status.code(), Some(0), "{}", f.explain(&out));
    let st = f.status(&id);
    assert_eq!(state(&st), "completed", "{st:#}");
    let events = f.events(&id);

    // Every call decided as expected, each denial with a rule that says why.
    let decisions = of_kind(&events, "policy_decision");
    let expected: Vec<(usize, usize, bool, &str)> = steps
        .iter()
        .enumerate()
        .flat_map(|(s, (_, calls))| {
            calls
                .iter()
                .enumerate()
                .map(move |(c, (allow, rule))| (s, c, *allow, *rule))
        })
        .collect();
    assert_eq!(
        decisions.len(),
        expected.len(),
        "one policy decision per call: {:#?}",
        decisions.iter().map(|d| &d["body"]).collect::<Vec<_>>()
    );
    for (d, (s, c, allow, rule)) in decisions.iter().zip(&expected) {
        let b = &d["body"];
        assert_eq!(b["step"]["index"].as_u64(), Some(*s as u64), "{b}");
        assert_eq!(b["call"].as_u64(), Some(*c as u64), "{b}");
        let want = if *allow { "allow" } else { "deny" };
        assert_eq!(b["decision"], want, "step {} call {c}: {b}", s + 1);
        assert!(
            b["rule"].as_str().unwrap().contains(rule),
            "step {} call {c}: rule does not say `{rule}`: {b}",
            s + 1
        );
    }
    let denials: Vec<&&Value> = decisions
        .iter()
        .filter(|d| d["body"]["decision"] == "deny")
        .collect();
    assert_eq!(denials.len(), 18);

    // A denied call never runs: only allowed calls have a tool_call_finished.
    let finished = of_kind(&events, "tool_call_finished");
    assert_eq!(
        finished.len(),
        expected.iter().filter(|e| e.2).count(),
        "{finished:#?}"
    );
    for t in &finished {
        assert_eq!(t["body"]["ok"], true, "a legitimate call works: {t}");
    }
    let read_back = finished
        .iter()
        .find(|t| t["body"]["step"]["index"] == 12)
        .unwrap();
    assert!(
        read_back["body"]["observation"]
            .as_str()
            .unwrap()
            .contains("draft"),
        "{read_back}"
    );
    let cat = finished
        .iter()
        .find(|t| t["body"]["step"]["index"] == 4)
        .unwrap();
    assert!(
        cat["body"]["observation"]
            .as_str()
            .unwrap()
            .contains("fixture"),
        "{cat}"
    );

    // Counted: every denial is a violation, and nothing else was (no out-of-scope change).
    assert_eq!(st["violations"].as_u64(), Some(18), "{st:#}");
    assert!(of_kind(&events, "scope_reverted").is_empty());

    // Shown: the prompt after each denial tells the driver what was denied and why.
    let prompts = prompts(&f, &events);
    assert_eq!(prompts.len(), steps.len(), "one model call per script line");
    for d in &denials {
        let b = &d["body"];
        let step = b["step"]["index"].as_u64().unwrap();
        let Some((_, next)) = prompts.iter().find(|(s, _)| *s == step + 1) else {
            continue; // the last step's denial: no prompt follows a completed run
        };
        let rule = b["rule"].as_str().unwrap();
        assert!(
            next.contains(&format!("DENIED: {rule}")),
            "the prompt of step {} does not show the denial of step {}: {rule}\n{next}",
            step + 2,
            step + 1
        );
    }

    // Nothing changed outside scope, inside the workspace or outside it.
    assert_eq!(
        std::fs::read_to_string(f.path("README.md")).unwrap(),
        "fixture\n"
    );
    assert_eq!(
        std::fs::read_to_string(f.path("src/locked.txt")).unwrap(),
        "locked\n"
    );
    assert_eq!(
        std::fs::read_to_string(f.path("src/keep.txt")).unwrap(),
        "keep\n"
    );
    assert_eq!(
        std::fs::read_to_string(f.path("src/out.txt")).unwrap(),
        "done\n"
    );
    assert_eq!(
        std::fs::read_to_string(f.path("src/new.txt")).unwrap(),
        "new\n"
    );
    assert!(!f.path("src/x.txt").exists());
    assert!(!f.path("src/after.txt").exists());
    assert!(!f.path(".git/hooks/pre-commit").exists());
    assert_eq!(
        std::fs::read_link(f.path("src/file-link")).unwrap(),
        outside.path().join("target.txt")
    );
    assert_eq!(
        listing(outside.path()),
        vec![("target.txt".to_string(), "outside original\n".to_string())],
        "the directory outside the workspace changed"
    );
    let porcelain = git(f.root(), &["status", "--porcelain"]);
    let mut changed: Vec<&str> = porcelain.lines().collect();
    changed.sort();
    assert_eq!(
        changed,
        [
            "?? actions.jsonl",
            "?? keel.toml",
            "?? src/new.txt",
            "?? src/out.txt"
        ],
        "only the in-scope file changed"
    );
    f.verify_log_ok(&id);
}

/// The same denial under different spellings is the same error: `same_error` (default 3) stops
/// the run, with the approach recorded as a rejected path.
#[test]
fn the_same_denial_again_and_again_blocks_the_run() {
    let f = Fixture::new(&POLICY_CONTRACT.replace("same_error = 50", ""));
    let w = |path: &str| json!({"tool": "write", "args": {"path": path, "content": "x\n"}});
    let script = [
        w("README.md"),
        w("./README.md"),
        w("src/../README.md"),
        w("src/out.txt"),
        json!({"tool": "finish", "args": {"summary": "x"}}),
    ];
    std::fs::write(f.path("actions.jsonl"), jsonl(&script)).unwrap();
    let (id, out) = f.start(&[]);
    assert_eq!(out.status.code(), Some(4), "{}", f.explain(&out));
    let st = f.status(&id);
    assert_eq!(state(&st), "blocked", "{st:#}");
    assert_eq!(st["block"]["cause"], "budget", "{st:#}");
    assert_eq!(st["block"]["budget"], "same_error", "{st:#}");
    assert_eq!(st["violations"].as_u64(), Some(3), "{st:#}");
    let events = f.events(&id);
    assert_eq!(
        of_kind(&events, "model_replied").len(),
        3,
        "{:?}",
        kinds(&events)
    );
    let loops = of_kind(&events, "loop_detected");
    assert_eq!(loops.len(), 1, "{:?}", kinds(&events));
    assert_eq!(loops[0]["body"]["pattern"], "same_error");
    assert_eq!(st["rejected_paths"].as_array().unwrap().len(), 1, "{st:#}");
    assert_eq!(
        std::fs::read_to_string(f.path("README.md")).unwrap(),
        "fixture\n"
    );
    f.verify_log_ok(&id);
}

const CLAIM_CONTRACT: &str = r#"
[task]
goal = "src/out.txt says done."

[driver]
kind = "script"
script = "actions.jsonl"

[scope]
writable = ["src/**"]

[budget]
steps = 60
SAME_ERROR

[[verify]]
name = "out"
tier = "acceptance"
run = "grep -qx done src/out.txt"

[[phase]]
name = "work"
kind = "agent"
objective = "Write done into src/out.txt, then finish."
tools = ["write", "finish"]
done_when = []
"#;

/// Checks a run whose driver kept claiming `finish` over a failing acceptance verifier: never
/// completed, a `verification_failed` for every claim, the failure evidence shown to the
/// driver after each, and nothing recorded as passing.
fn assert_claims_refused(f: &Fixture, id: &str, claims: usize) -> Vec<Value> {
    let events = f.events(id);
    let changes = of_kind(&events, "state_changed");
    assert!(
        changes.iter().all(|c| c["body"]["to"] != "completed"),
        "{changes:#?}"
    );
    assert!(of_kind(&events, "phase_verified").is_empty());
    assert_eq!(of_kind(&events, "finish_claimed").len(), claims);
    let failed = of_kind(&events, "verification_failed");
    assert_eq!(failed.len(), claims, "{:?}", kinds(&events));
    for v in &failed {
        assert_eq!(v["body"]["verifier"], "out");
    }
    let evidence = of_kind(&events, "evidence_recorded");
    assert!(
        evidence
            .iter()
            .all(|e| e["body"]["evidence"]["passed"] == false),
        "{evidence:#?}"
    );
    // The evidence goes back to the driver: each prompt after a refused claim says so.
    let prompts = prompts(f, &events);
    for (step, user) in prompts.iter().skip(1) {
        assert!(
            user.contains("out (acceptance): FAILED"),
            "prompt of step {} lacks the failed verification:\n{user}",
            step + 1
        );
    }
    assert_ne!(
        std::fs::read_to_string(f.path("src/out.txt")).unwrap_or_default(),
        "done\n"
    );
    f.verify_log_ok(id);
    events
}

#[test]
fn finish_over_a_failing_acceptance_verifier_never_completes_same_error_stops_it() {
    let f = Fixture::new(&CLAIM_CONTRACT.replace("SAME_ERROR", ""));
    // Each claim is worded differently (so it is not a plain repeat), the verifier fails the
    // same way each time.
    let script: Vec<Value> = (1..=6)
        .map(|i| {
            json!({"calls": [
                {"tool": "write", "args": {"path": "src/out.txt", "content": format!("almost {i}\n")}},
                {"tool": "finish", "args": {"summary": format!("done, honestly ({i})")}}
            ]})
        })
        .collect();
    std::fs::write(f.path("actions.jsonl"), jsonl(&script)).unwrap();
    let (id, out) = f.start(&[]);
    assert_eq!(out.status.code(), Some(4), "{}", f.explain(&out));
    let st = f.status(&id);
    assert_eq!(state(&st), "blocked", "{st:#}");
    assert_eq!(st["block"]["budget"], "same_error", "{st:#}");
    assert_claims_refused(&f, &id, 3);
    assert!(!st["rejected_paths"].as_array().unwrap().is_empty());
}

#[test]
fn finish_over_a_failing_acceptance_verifier_never_completes_until_the_script_ends() {
    let f = Fixture::new(&CLAIM_CONTRACT.replace("SAME_ERROR", "same_error = 20"));
    let script: Vec<Value> = (1..=4)
        .map(|i| json!({"tool": "finish", "args": {"summary": format!("claim {i}")}}))
        .collect();
    std::fs::write(f.path("actions.jsonl"), jsonl(&script)).unwrap();
    let (id, out) = f.start(&[]);
    assert_eq!(out.status.code(), Some(4), "{}", f.explain(&out));
    let st = f.status(&id);
    assert_eq!(state(&st), "blocked", "{st:#}");
    assert!(
        st["reason"]
            .as_str()
            .unwrap()
            .contains("the script is used up"),
        "{st:#}"
    );
    assert_claims_refused(&f, &id, 4);
}
