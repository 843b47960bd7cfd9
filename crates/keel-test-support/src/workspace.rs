//! A git workspace with a run stopped where a person has to act (at an approval gate, or waiting
//! for an answer): the fixture of keel-server's tests and of the HTTP API's oracle
//! (`oracle::api`).
//!
//! Like every fixture here, it panics when it cannot set up what a test needs.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;

use crate::git;

/// A contract whose second phase waits for a person's approval.
const GATED: &str = r#"
[task]
goal = "The release note is published."

[[verify]]
name = "published"
tier = "acceptance"
run = "test -f published.txt"

[[phase]]
name = "write"
kind = "command"
run = ["printf 'Release 1.4\n\n- faster resume\n- approval inbox\n' > NOTES.md", "printf 'fixture v2\n' > README.md"]

[[phase]]
name = "publish"
kind = "command"
approval = true
run = ["cp NOTES.md published.txt; echo published >> published-count"]
"#;

/// A contract whose agent phase asks a question first.
const ASKING: &str = r#"
[task]
goal = "src/out.txt names the database."

[driver]
kind = "script"
script = "actions.jsonl"

[scope]
writable = ["src/**"]

[[verify]]
name = "out"
tier = "acceptance"
run = "test -f src/out.txt"

[[phase]]
name = "work"
kind = "agent"
objective = "Ask which database to use, then write it to src/out.txt."
tools = ["ask", "write", "finish"]
done_when = []
"#;

/// A workspace, its store and one run started in it.
pub struct Workspace {
    pub dir: tempfile::TempDir,
    pub store: PathBuf,
    pub run: String,
}

impl Workspace {
    /// A git repository with one commit, `contract` as keel.toml, and a run of it started and
    /// stopped where a person has to act.
    ///
    /// # Panics
    /// If git, the store or keel-engine fails, or the run does not stop for a person: the
    /// fixture is not what the test needs.
    pub fn new(contract: &str, files: &[(&str, &str)]) -> Workspace {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        git(root, &["init", "-q", "-b", "main"]);
        std::fs::write(root.join("README.md"), "fixture\n").unwrap();
        std::fs::write(root.join(".gitignore"), ".keel/\n").unwrap();
        for (path, text) in files {
            std::fs::write(root.join(path), text).unwrap();
        }
        git(root, &["add", "-A"]);
        git(root, &["commit", "-q", "-m", "init"]);
        let contract_path = root.join("keel.toml");
        // These runs are driven in this test process, which cannot be keel's sandbox helper (the
        // `keel` binary is; its tests cover the sandbox). The contract says so explicitly, and it
        // is recorded in the run's first event.
        let contract = format!("{contract}\n[sandbox]\nmode = \"off\"\n");
        std::fs::write(&contract_path, contract).unwrap();
        let store = root.join(".keel/keel.db");
        let mut s = keel_store::Store::open(&store).unwrap();
        let run_id = keel_engine::new_run_id();
        let run = keel_engine::start(
            &mut s,
            keel_engine::NewRun {
                contract_path: &contract_path,
                contract: keel_engine::load_contract(&contract_path).unwrap(),
                run_id: &run_id,
                choice: &Default::default(),
                detach: false,
            },
            &keel_engine::Actor::current(),
            &mut keel_engine::Quiet,
            &mut |_| {},
        )
        .unwrap();
        assert!(
            run.state.needs_human(),
            "the run should wait for a person, but it is {}: {}",
            run.state,
            run.reason
        );
        Workspace {
            dir,
            store,
            run: run_id,
        }
    }

    /// A run stopped at its approval gate.
    pub fn gated() -> Workspace {
        Workspace::new(GATED, &[])
    }

    /// A run waiting for the answer to question 1.
    pub fn asking() -> Workspace {
        let actions = r#"{"tool": "ask", "args": {"question": "Which database should the migration target?"}}
{"tool": "write", "args": {"path": "src/out.txt", "content": "staging\n"}}
{"tool": "finish", "args": {"summary": "written"}}
"#;
        Workspace::new(ASKING, &[("actions.jsonl", actions)])
    }

    pub fn path(&self, rel: &str) -> PathBuf {
        self.dir.path().join(rel)
    }

    pub fn open(&self) -> keel_store::Store {
        keel_store::Store::open(&self.store).unwrap()
    }

    pub fn run(&self) -> keel_core::run::Run {
        self.open().run(&self.run).unwrap()
    }

    /// The kinds of the run's events, in order.
    pub fn kinds(&self) -> Vec<String> {
        self.open()
            .events_from(&self.run, 1)
            .unwrap()
            .into_iter()
            .map(|e| e.kind)
            .collect()
    }

    pub fn count(&self, kind: &str) -> usize {
        self.kinds().iter().filter(|k| *k == kind).count()
    }
}
