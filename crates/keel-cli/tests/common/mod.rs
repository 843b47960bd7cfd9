//! Fixtures for the `keel` binary's tests: a git workspace in a temporary directory, a contract
//! written into it, and helpers that run `keel` and explain failures with the command, its
//! output and the directory listing.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

pub struct Fixture {
    pub dir: tempfile::TempDir,
}

pub fn keel_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_keel"))
}

pub use keel_test_support::git;

impl Fixture {
    /// A git repository with one commit (a README, a lockfile, .gitignore for .keel) and the
    /// contract `contract` written to `keel.toml`.
    pub fn new(contract: &str) -> Fixture {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path();
        git(root, &["init", "-q", "-b", "main"]);
        std::fs::write(root.join("README.md"), "fixture\n").unwrap();
        std::fs::write(root.join("Cargo.lock"), "# lock v1\n").unwrap();
        std::fs::write(root.join(".gitignore"), ".keel/\n").unwrap();
        git(root, &["add", "-A"]);
        git(root, &["commit", "-q", "-m", "init"]);
        let f = Fixture { dir };
        f.write_contract(contract);
        f
    }

    pub fn root(&self) -> &Path {
        self.dir.path()
    }

    pub fn path(&self, rel: &str) -> PathBuf {
        self.dir.path().join(rel)
    }

    pub fn write_contract(&self, contract: &str) {
        std::fs::write(self.path("keel.toml"), contract).unwrap();
    }

    pub fn keel(&self) -> Command {
        let mut c = Command::new(keel_bin());
        c.current_dir(self.root());
        c.env_remove("KEEL_STORE");
        c.env_remove("KEEL_CRASH_AT");
        c.env_remove("KEEL_FAULT_TRACE");
        c.env_remove("KEEL_STORE_FAULT");
        c.env_remove("KEEL_CLOCK");
        c
    }

    /// Runs keel with `args` and returns its output.
    pub fn run(&self, args: &[&str]) -> Output {
        self.keel().args(args).output().expect("keel runs")
    }

    /// Runs keel and asserts its exit code, explaining a mismatch.
    pub fn expect(&self, args: &[&str], code: i32) -> Output {
        self.expect_exit(self.run(args), args, code)
    }

    /// Asserts the exit code of `out` (keel run with `args`, perhaps in a prepared environment),
    /// explaining a mismatch.
    pub fn expect_exit(&self, out: Output, args: &[&str], code: i32) -> Output {
        if out.status.code() != Some(code) {
            panic!(
                "keel {args:?}: expected exit {code}, got {:?}\n{}",
                out.status.code(),
                self.explain(&out)
            );
        }
        out
    }

    pub fn explain(&self, out: &Output) -> String {
        let listing = walk(self.root());
        format!(
            "--- stdout\n{}\n--- stderr\n{}\n--- files in {}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
            self.root().display(),
            listing.join("\n")
        )
    }

    /// Starts `keel run keel.toml` and returns the run id it printed first, with the output.
    pub fn start(&self, env: &[(&str, String)]) -> (String, Output) {
        let mut cmd = self.keel();
        cmd.args(["run", "keel.toml"]);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let out = cmd.output().expect("keel runs");
        let stdout = String::from_utf8_lossy(&out.stdout).to_string();
        let id = stdout
            .lines()
            .next()
            .and_then(|l| l.strip_prefix("run "))
            .unwrap_or_else(|| {
                panic!(
                    "keel run did not print its id first\n{}",
                    self.explain(&out)
                )
            })
            .trim()
            .to_string();
        (id, out)
    }

    pub fn status(&self, id: &str) -> Value {
        let out = self.expect(&["status", id, "--json"], 0);
        serde_json::from_slice(&out.stdout).expect("status --json is JSON")
    }

    pub fn events(&self, id: &str) -> Vec<Value> {
        let out = self.expect(&["log", id, "--json"], 0);
        let v: Value = serde_json::from_slice(&out.stdout).expect("log --json is JSON");
        v.as_array().expect("an array").clone()
    }

    pub fn db(&self) -> rusqlite::Connection {
        rusqlite::Connection::open(self.path(".keel/keel.db")).expect("store opens")
    }

    /// The run's events as stored (every field as its row holds it), in order; a row that
    /// does not decode reads as one event of kind `keel_store::UNREADABLE`.
    #[allow(dead_code)]
    pub fn stored_events(&self, id: &str) -> Vec<keel_store::StoredEvent> {
        keel_store::Store::open(&self.path(".keel/keel.db"))
            .and_then(|store| store.events_from(id, 1))
            .unwrap()
    }

    /// Changes the stored event `seq` of run `id` in place, as damage on disk or a hand with a
    /// database tool would (nothing is checked).
    #[allow(dead_code)]
    pub fn tamper(&self, id: &str, seq: u64, edit: impl FnOnce(&mut keel_store::StoredEvent)) {
        let mut edit = Some(edit);
        let found = keel_store::log::rewrite_stored(&self.db(), id, seq, |events| {
            let e = events
                .iter_mut()
                .find(|e| e.seq == seq)
                .expect("the event is stored");
            (edit.take().unwrap())(e);
        })
        .unwrap();
        assert!(found, "no stored event {seq}");
    }

    /// Removes the stored events of run `id` that `gone` picks, as a lost write would.
    #[allow(dead_code)]
    pub fn remove_events(&self, id: &str, gone: impl Fn(u64) -> bool) {
        for e in self.stored_events(id) {
            if gone(e.seq) {
                keel_store::log::rewrite_stored(&self.db(), id, e.seq, |events| {
                    events.retain(|x| x.seq != e.seq)
                })
                .unwrap();
            }
        }
    }

    /// An artifact's bytes, read through keel's store (small ones live in the log rows of the
    /// commits that stored them, maybe compressed; large ones in files under
    /// `.keel/artifacts/`).
    pub fn artifact(&self, hash: &str) -> Vec<u8> {
        keel_store::Store::open(&self.path(".keel/keel.db"))
            .and_then(|store| store.read_artifact(hash, usize::MAX))
            .unwrap_or_else(|e| panic!("artifact {hash}: {e}"))
    }

    /// The id of the run in this workspace's store, if one was created (a process killed early
    /// may have died before printing it).
    pub fn stored_run_id(&self) -> Option<String> {
        if !self.path(".keel/keel.db").exists() {
            return None;
        }
        self.db()
            .query_row("SELECT id FROM runs", [], |r| r.get(0))
            .ok()
    }

    /// `keel verify-log` accepts the run's log, and every invariant of
    /// `keel_test_support::invariants` holds for it.
    pub fn verify_log_ok(&self, id: &str) {
        self.expect(&["verify-log", id], 0);
        if let Err(e) = keel_test_support::invariants::check(&self.path(".keel/keel.db"), id) {
            panic!("{e}");
        }
    }
}

fn walk(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            let p = e.path();
            if p.file_name().is_some_and(|n| n == ".git") {
                continue;
            }
            out.push(p.display().to_string());
            if p.is_dir() {
                out.extend(walk(&p));
            }
        }
    }
    out
}

pub fn state(status: &Value) -> &str {
    status["state"].as_str().unwrap_or("?")
}

/// The events of one kind, in order.
pub fn of_kind<'a>(events: &'a [Value], kind: &str) -> Vec<&'a Value> {
    events.iter().filter(|e| e["kind"] == kind).collect()
}

pub fn kinds(events: &[Value]) -> Vec<String> {
    events
        .iter()
        .map(|e| e["kind"].as_str().unwrap_or("?").to_string())
        .collect()
}

/// The fault points a whole run of `contract` passes, in order (`points[i]` is point `i + 1`),
/// taken from a run in a twin workspace.
pub fn fault_points(contract: &str) -> Vec<String> {
    let f = Fixture::new(contract);
    let outside = tempfile::tempdir().unwrap();
    let trace = outside.path().join("trace");
    let (_, out) = f.start(&[("KEEL_FAULT_TRACE", trace.display().to_string())]);
    assert_eq!(out.status.code(), Some(0), "{}", f.explain(&out));
    std::fs::read_to_string(&trace)
        .unwrap()
        .lines()
        .map(|l| l.split_once(' ').unwrap().1.to_string())
        .collect()
}

/// The 0-based index in `points` of the `k`th (1-based) point called `name`.
pub fn nth_point(points: &[String], name: &str, k: usize) -> usize {
    points
        .iter()
        .enumerate()
        .filter(|(_, p)| *p == name)
        .nth(k - 1)
        .map(|(i, _)| i)
        .unwrap_or_else(|| panic!("fewer than {k} `{name}` points in {points:?}"))
}

/// The fault point (1-based) just after the `step_verified` commit of the `k`th (1-based) step
/// command the run executes: a step boundary.
pub fn after_step_verified(points: &[String], k: usize) -> u64 {
    let ended = nth_point(points, "command ended", k);
    let commit = points
        .iter()
        .enumerate()
        .skip(ended)
        .filter(|(_, p)| *p == "after commit")
        .nth(1)
        .map(|(i, _)| i)
        .unwrap_or_else(|| panic!("no step_verified commit after step {k} in {points:?}"));
    commit as u64 + 1
}

/// Starts the run and has it SIGKILL itself at fault point `n`. Returns the run id.
pub fn killed_at(f: &Fixture, n: u64) -> String {
    use std::os::unix::process::ExitStatusExt;
    let (id, out) = f.start(&[("KEEL_CRASH_AT", n.to_string())]);
    assert_eq!(
        out.status.signal(),
        Some(9),
        "keel should have killed itself at fault point {n}\n{}",
        f.explain(&out)
    );
    id
}

/// A `[sandbox]` table letting a scenario's commands write where its tests keep counters and
/// markers: outside the workspace, in the system's temporary directory (which confined
/// commands otherwise cannot write).
pub fn outside_writable() -> String {
    format!(
        "\n[sandbox]\nwritable = [\"{}\"]\n",
        std::env::temp_dir().display()
    )
}

/// Two command phases: one writes a note, the second waits for approval and publishes it,
/// counting each publication in `marker` (outside the workspace, writable in the sandbox).
pub fn publish_contract(marker: &Path) -> String {
    format!(
        r#"
[task]
goal = "The note is published."

[[verify]]
name = "published"
tier = "acceptance"
run = "test -f published.txt"

[[phase]]
name = "write"
kind = "command"
run = ["echo note > note.txt"]

[[phase]]
name = "publish"
kind = "command"
approval = true
run = ["cp note.txt published.txt; echo published >> {}"]

# The phase counts its executions in a marker outside the workspace.
[sandbox]
writable = ["{}"]
"#,
        marker.display(),
        marker.parent().unwrap().display()
    )
}

/// A small seeded generator (xorshift64*) for tests that pick offsets, orders or points at
/// random. The seed comes from `KEEL_TEST_SEED` when set, else from the clock, and is printed
/// so that a failure can be replayed.
pub struct Rng(u64);

impl Rng {
    pub fn seeded(test: &str) -> Rng {
        let seed = std::env::var("KEEL_TEST_SEED")
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_nanos() as u64)
                    .unwrap_or(1)
            });
        eprintln!("{test}: KEEL_TEST_SEED={seed}");
        Rng(seed.max(1))
    }

    pub fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// A number in `lo..hi` (`lo` when the range is empty).
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        if hi <= lo {
            lo
        } else {
            lo + self.next() % (hi - lo)
        }
    }

    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = self.range(0, i as u64 + 1) as usize;
            items.swap(i, j);
        }
    }
}

/// The output of a keel invocation neither panicked nor died of a signal: whatever keel did
/// with a fault, it said so in words.
pub fn assert_no_panic(out: &Output, what: &str) {
    use std::os::unix::process::ExitStatusExt;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.signal().is_none()
            && out.status.code() != Some(101)
            && !stderr.contains("panicked"),
        "{what}: keel panicked or died ({:?})\n--- stdout\n{}\n--- stderr\n{stderr}",
        out.status,
        String::from_utf8_lossy(&out.stdout)
    );
}

/// Writes a script driver's JSONL file (one reply per line) to `dir/script.jsonl`.
pub fn write_script(dir: &Path, lines: &[Value]) -> PathBuf {
    let path = dir.join("script.jsonl");
    let text: Vec<String> = lines.iter().map(Value::to_string).collect();
    std::fs::write(&path, text.join("\n") + "\n").unwrap();
    path
}

pub fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

pub fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Three command steps in phase one (so a killed run has several events after checkpoint 0) and
/// one in phase two. Each appends a letter to marker.txt and prints it, so each step's output is
/// an artifact of its own.
pub const LETTERS_CONTRACT: &str = r#"
[task]
goal = "Write the letters a to d into marker.txt."

[[verify]]
name = "letters"
tier = "acceptance"
run = "test -s marker.txt"

[[phase]]
name = "one"
kind = "command"
run = ["echo a | tee -a marker.txt", "echo b | tee -a marker.txt", "echo c | tee -a marker.txt"]

[[phase]]
name = "two"
kind = "command"
run = ["echo d | tee -a marker.txt"]
"#;

/// What marker.txt holds once a [`LETTERS_CONTRACT`] run has done every step once.
pub const ALL_LETTERS: &str = "a\nb\nc\nd\n";

/// The contract tool `apply_keyed` (TOML): it applies its `item` to the counting service at
/// `url` with the call's idempotency key in `Idempotency-Key`; irreversible, on the network.
pub fn apply_keyed_tool(url: &str) -> String {
    format!(
        r#"
[[tool]]
name = "apply_keyed"
description = "Apply one item to the service, with the call's idempotency key."
run = ["sh", "-c", "curl -sS -f -X POST -H \"Idempotency-Key: $KEY\" --data-binary \"$0\" {url}/apply", "{{item}}"]
parameters = {{ item = {{ type = "string" }} }}
idempotency_key = "env:KEY"
reversibility = "irreversible"
network = true
"#
    )
}

/// How many store writes of a kind (`"commit"`, `"artifact"`) a process traced with
/// `KEEL_STORE_FAULT_TRACE=trace` made.
#[allow(dead_code)]
pub fn traced(trace: &Path, what: &str) -> usize {
    std::fs::read_to_string(trace)
        .unwrap_or_else(|e| panic!("{}: {e}", trace.display()))
        .lines()
        .filter(|l| l.split(' ').next() == Some(what))
        .count()
}

/// Runs `contract` (with `script` as its `actions.jsonl`) with each commit of its first process
/// failing in turn (`commit-error@N`, nothing stored, and `commit-lost-ack@N`, stored but
/// reported failed), and hands the fixture, the run id and the fault to `check`, which carries
/// the run on as its test needs. A fault in the commit that creates the run leaves no run, and
/// nothing to check.
pub fn with_each_commit_failing(
    contract: &str,
    script: &str,
    check: impl Fn(&Fixture, &str, &str),
) {
    let outside = tempfile::tempdir().unwrap();
    let trace = outside.path().join("commits");
    let twin = Fixture::new(contract);
    std::fs::write(twin.path("actions.jsonl"), script).unwrap();
    let (_, out) = twin.start(&[("KEEL_STORE_FAULT_TRACE", trace.display().to_string())]);
    assert_no_panic(&out, "the run without a fault");
    let commits = traced(&trace, "commit");
    assert!(commits >= 2, "the first process commits {commits} times");
    for n in 1..=commits {
        for fault in ["commit-error", "commit-lost-ack"] {
            let what = format!("{fault}@{n}");
            let f = Fixture::new(contract);
            std::fs::write(f.path("actions.jsonl"), script).unwrap();
            let out = f
                .keel()
                .args(["run", "keel.toml"])
                .env("KEEL_STORE_FAULT", &what)
                .output()
                .unwrap();
            assert_no_panic(&out, &what);
            let Some(id) = f.stored_run_id() else {
                continue;
            };
            check(&f, &id, &what);
        }
    }
}

/// How many events the `log` rows on `conn` hold, of run `id` or of every run.
#[allow(dead_code)]
pub fn count_events(conn: &rusqlite::Connection, id: Option<&str>) -> u64 {
    let mut stmt = conn
        .prepare("SELECT run_id, codec, events FROM log WHERE ?1 IS NULL OR run_id = ?1")
        .unwrap();
    stmt.query_map([id], |r| {
        Ok((
            r.get::<_, String>(0)?,
            r.get::<_, i64>(1)?,
            r.get::<_, Vec<u8>>(2)?,
        ))
    })
    .unwrap()
    .map(|row| {
        let (run, codec, bytes) = row.unwrap();
        keel_store::log::decode_events(&run, codec, &bytes).map_or(0, |events| events.len() as u64)
    })
    .sum()
}

/// `git gc --prune=now` in the workspace at `root`: every loose object nothing names is gone,
/// as git's own garbage collection leaves a repository two weeks after they were written.
#[allow(dead_code)]
pub fn git_gc_prune_now(root: &Path) {
    git_stdout(root, &["gc", "--quiet", "--prune=now"], b"");
}

/// What `git <args>` in `root` prints with `input` on its standard input, trimmed; it must
/// succeed.
#[allow(dead_code)]
pub fn git_stdout(root: &Path, args: &[&str], input: &[u8]) -> String {
    use std::io::Write;
    let mut child = std::process::Command::new("git")
        .arg("-C")
        .arg(root)
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(input).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "git {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}
