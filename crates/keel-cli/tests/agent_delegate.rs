//! The delegated `command` driver, through the `keel` binary: a shell script stands in for a
//! coding agent. keel writes it the prompt (goal, objective, scope, the last verification), runs
//! it in the workspace, undoes what it changed outside the scope (recording the paths), keeps
//! what it changed inside, and lets the acceptance verifier decide whether its claim of being
//! done holds.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::BTreeSet;
use std::path::Path;

use common::{Fixture, git, kinds, of_kind, state};
use serde_json::Value;

const GOAL: &str = "src/answer.txt holds the answer to everything, 42.";
const OBJECTIVE: &str = "Compute the answer and write it to src/answer.txt.";

fn contract(out: &Path) -> String {
    format!(
        r#"
[task]
goal = "{GOAL}"
out_of_scope = ["README.md and the lockfile"]

[driver]
kind = "command"
command = "sh delegate.sh"

[scope]
writable = ["src/**"]
forbidden = ["src/secret.txt"]

# The stand-in agent keeps its notes outside the workspace.
[sandbox]
writable = ["{out}"]

[budget]
steps = 10
same_error = 5

[[verify]]
name = "answer"
tier = "acceptance"
run = "grep -qx 42 src/answer.txt"

[[phase]]
name = "solve"
kind = "agent"
objective = "{OBJECTIVE}"
done_when = []
"#,
        out = out.display()
    )
}

/// The stand-in agent: counts its invocations in `out`, keeps a copy of each prompt and what it
/// found in the workspace when it started, then does what invocation `n` of `cases` says.
fn delegate(out: &Path, cases: &str) -> String {
    format!(
        r#"OUT='{out}'
n=$(cat "$OUT/count" 2>/dev/null || echo 0)
n=$((n + 1))
echo "$n" > "$OUT/count"
cp "$KEEL_PROMPT_FILE" "$OUT/prompt-$n.md"
echo "$KEEL_STEP" > "$OUT/step-$n"
{{
  echo "README: $(cat README.md)"
  echo "lock: $(cat Cargo.lock 2>/dev/null || echo missing)"
  echo "answer: $(cat src/answer.txt 2>/dev/null || echo missing)"
  echo "secret: $(cat src/secret.txt)"
  test -e stray.txt && echo "stray present"
  test -e docs/new.md && echo "docs present"
}} > "$OUT/seen-$n"
mkdir -p src
case $n in
{cases}
esac
"#,
        out = out.display()
    )
}

fn setup(cases: &str) -> (Fixture, tempfile::TempDir) {
    let out = tempfile::tempdir().unwrap();
    let f = Fixture::new(&contract(out.path()));
    std::fs::create_dir_all(f.path("src")).unwrap();
    std::fs::write(f.path("src/secret.txt"), "original secret\n").unwrap();
    git(f.root(), &["add", "src"]);
    git(f.root(), &["commit", "-q", "-m", "src"]);
    std::fs::write(f.path("delegate.sh"), delegate(out.path(), cases)).unwrap();
    (f, out)
}

fn read(dir: &Path, name: &str) -> String {
    std::fs::read_to_string(dir.join(name))
        .unwrap_or_else(|e| panic!("{}: {e}", dir.join(name).display()))
}

fn reverted(events: &[Value], step: u64) -> BTreeSet<String> {
    of_kind(events, "scope_reverted")
        .iter()
        .filter(|e| e["body"]["step"]["index"] == step)
        .flat_map(|e| e["body"]["paths"].as_array().unwrap().clone())
        .map(|p| p.as_str().unwrap().to_string())
        .collect()
}

fn set(items: &[&str]) -> BTreeSet<String> {
    items.iter().map(|s| s.to_string()).collect()
}

#[test]
fn out_of_scope_edits_are_reverted_in_scope_kept_and_the_verifier_decides() {
    let cases = r##"
1)
  echo 40 > src/answer.txt
  echo scratch > src/notes.txt
  echo hacked > README.md
  echo stray > stray.txt
  rm Cargo.lock
  echo leaked > src/secret.txt
  echo "gave up for now"
  exit 3 ;;
2)
  echo 41 > src/answer.txt
  mkdir -p docs && echo doc > docs/new.md
  echo "done, I think"
  exit 0 ;;
*)
  echo 42 > src/answer.txt
  echo "# lock v2" > Cargo.lock
  exit 0 ;;
"##;
    let (f, out) = setup(cases);
    let (id, run) = f.start(&[]);
    assert_eq!(run.status.code(), Some(0), "{}", f.explain(&run));
    let st = f.status(&id);
    assert_eq!(state(&st), "completed", "{st:#}");
    let events = f.events(&id);
    assert_eq!(
        read(out.path(), "count").trim(),
        "3",
        "{:?}",
        kinds(&events)
    );

    // One invocation, one step.
    assert_eq!(of_kind(&events, "model_replied").len(), 3);
    for n in 1..=3 {
        assert_eq!(
            read(out.path(), &format!("step-{n}")).trim(),
            format!("1.{n}")
        );
    }

    // Out-of-scope changes undone after each step, and recorded.
    assert_eq!(
        reverted(&events, 0),
        set(&["Cargo.lock", "README.md", "src/secret.txt", "stray.txt"])
    );
    assert_eq!(reverted(&events, 1), set(&["docs/new.md"]));
    assert_eq!(reverted(&events, 2), set(&["Cargo.lock"]));
    assert_eq!(st["violations"].as_u64(), Some(6), "{st:#}");
    // What the second and third invocations found: the scope undone, in-scope work kept.
    assert_eq!(
        read(out.path(), "seen-2"),
        "README: fixture\nlock: # lock v1\nanswer: 40\nsecret: original secret\n"
    );
    assert_eq!(
        read(out.path(), "seen-3"),
        "README: fixture\nlock: # lock v1\nanswer: 41\nsecret: original secret\n"
    );

    // A failing exit is a step without a claim; exit 0 is a claim the verifier judges.
    let claims = of_kind(&events, "finish_claimed");
    let claim_steps: Vec<u64> = claims
        .iter()
        .map(|c| c["body"]["step"]["index"].as_u64().unwrap())
        .collect();
    assert_eq!(claim_steps, [1, 2], "{:?}", kinds(&events));
    let failed = of_kind(&events, "verification_failed");
    assert_eq!(failed.len(), 1, "{:?}", kinds(&events));
    assert_eq!(failed[0]["body"]["verifier"], "answer");
    assert_eq!(of_kind(&events, "phase_verified").len(), 1);
    let k = kinds(&events);
    let vf = k.iter().position(|k| k == "verification_failed").unwrap();
    let third = events
        .iter()
        .position(|e| e["kind"] == "step_started" && e["body"]["step"]["index"] == 2)
        .unwrap();
    assert!(vf < third, "the failed claim came before the third step");

    // The final workspace: in scope kept, out of scope as it was.
    assert_eq!(
        std::fs::read_to_string(f.path("src/answer.txt")).unwrap(),
        "42\n"
    );
    assert_eq!(
        std::fs::read_to_string(f.path("src/notes.txt")).unwrap(),
        "scratch\n"
    );
    assert_eq!(
        std::fs::read_to_string(f.path("README.md")).unwrap(),
        "fixture\n"
    );
    assert_eq!(
        std::fs::read_to_string(f.path("Cargo.lock")).unwrap(),
        "# lock v1\n"
    );
    assert_eq!(
        std::fs::read_to_string(f.path("src/secret.txt")).unwrap(),
        "original secret\n"
    );
    assert!(!f.path("stray.txt").exists());
    assert!(!f.path("docs/new.md").exists());

    // The prompt the agent read: the goal, the objective, the scope; later ones what happened.
    let first = read(out.path(), "prompt-1.md");
    for part in [GOAL, OBJECTIVE, "src/**", "src/secret.txt"] {
        assert!(first.contains(part), "prompt 1 lacks `{part}`:\n{first}");
    }
    let second = read(out.path(), "prompt-2.md");
    assert!(
        second.contains(GOAL) && second.contains(OBJECTIVE),
        "{second}"
    );
    assert!(
        second.contains("exit 3"),
        "prompt 2 lacks the first step's end:\n{second}"
    );
    let third_prompt = read(out.path(), "prompt-3.md");
    assert!(
        third_prompt.contains("answer (acceptance): FAILED"),
        "prompt 3 lacks the failed verification:\n{third_prompt}"
    );
    f.verify_log_ok(&id);
}

#[test]
fn a_delegate_that_claims_done_without_doing_it_never_completes() {
    // Every invocation edits only what it may not, and says it is done.
    let cases = r#"
*)
  echo "hacked $n" > README.md
  echo "done"
  exit 0 ;;
"#;
    let (f, out) = setup(cases);
    let (id, run) = f.start(&[]);
    assert_eq!(run.status.code(), Some(4), "{}", f.explain(&run));
    let st = f.status(&id);
    assert_eq!(state(&st), "blocked", "{st:#}");
    let events = f.events(&id);
    let changes = of_kind(&events, "state_changed");
    assert!(changes.iter().all(|c| c["body"]["to"] != "completed"));
    assert!(of_kind(&events, "phase_verified").is_empty());
    let invocations: u64 = read(out.path(), "count").trim().parse().unwrap();
    assert!(invocations >= 2, "{invocations}");
    assert!(!of_kind(&events, "verification_failed").is_empty());
    for step in 0..invocations {
        assert_eq!(reverted(&events, step), set(&["README.md"]), "step {step}");
    }
    assert_eq!(
        std::fs::read_to_string(f.path("README.md")).unwrap(),
        "fixture\n"
    );
    assert!(!f.path("src/answer.txt").exists());
    assert!(
        !st["rejected_paths"].as_array().unwrap().is_empty(),
        "{st:#}"
    );
    f.verify_log_ok(&id);
}
