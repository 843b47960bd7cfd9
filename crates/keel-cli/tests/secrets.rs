//! Secrets never reach keel's store or its output, through the `keel` binary.
//!
//! A run whose contract names three secrets — two in keel's environment (one of them with a
//! double quote and a backslash, to exercise JSON escaping) and one only in a secrets file
//! (`$KEEL_SECRETS_FILE`, mode 600, outside the workspace) — makes every value flow everywhere it
//! could leak: a command phase with `secrets` prints them (step output); a contract tool with
//! `secrets` prints them on stdout and stderr and writes them into a workspace file (observation,
//! `tool_call_finished`, output artifact, the step's diff); the scripted model echoes them in its
//! reply text, a `plan` item, `note` calls, a tool argument and the `finish` summary
//! (`model_replied`, response artifact, note events, the next prompt's request artifact); the
//! acceptance verifier prints the file the tool wrote (evidence output). The run completes.
//!
//! Then: every file under `.keel/` (the database, its WAL, every artifact), read as bytes, holds
//! none of the values — raw, JSON-escaped, JSON-escaped twice (JSON in a JSON string), nor a
//! distinctive tail of each value that survives any escaping — and it does hold
//! `[secret:NAME]` for each of them, so scrubbing is shown to have happened. The same after the
//! WAL is checkpointed into the database. keel's stdout and stderr of `run`, `status --json`,
//! `log`, `log --json`, `effects --json` and `verify-log` hold no value either.
//!
//! And a secret shorter than 4 characters, or a secrets file readable by others (when a value
//! has to be read from it), is refused with exit code 2 (usage) and a clear message, before any
//! step runs.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Output;

use common::{Fixture, kinds, state};
use serde_json::{Value, json};

/// In keel's environment.
const TOKEN: &str = "s3cr3t-VALUE-9f8e7d6c5b4a";
/// In keel's environment; a double quote and a backslash, escaped in JSON.
const QUOTED: &str = r#"p"a\ss-w0rd-1234"#;
/// Only in the secrets file.
const FILEONLY: &str = "f1le-0nly-7c6b5a4d3e2f";

/// Each secret: name, value, a distinctive tail that survives any escaping of the value.
const SECRETS: [(&str, &str, &str); 3] = [
    ("TOKEN", TOKEN, "9f8e7d6c5b4a"),
    ("QUOTED", QUOTED, "ss-w0rd-1234"),
    ("FILEONLY", FILEONLY, "7c6b5a4d3e2f"),
];

/// `value` as it appears inside a JSON string.
fn json_escaped(value: &str) -> String {
    let quoted = Value::String(value.to_owned()).to_string();
    quoted[1..quoted.len() - 1].to_owned()
}

/// Every form of every secret that must not appear: (name, what form, bytes).
fn forbidden() -> Vec<(&'static str, &'static str, Vec<u8>)> {
    let mut out = Vec::new();
    for (name, value, tail) in SECRETS {
        let once = json_escaped(value);
        let twice = json_escaped(&once);
        out.push((name, "raw value", value.as_bytes().to_vec()));
        out.push((name, "JSON-escaped value", once.into_bytes()));
        out.push((name, "value JSON-escaped twice", twice.into_bytes()));
        out.push((name, "tail of the value", tail.as_bytes().to_vec()));
    }
    out
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// The bytes around `at`, for a failure message (the secret itself is a test value).
fn around(bytes: &[u8], at: usize, len: usize) -> String {
    let start = at.saturating_sub(200);
    let end = (at + len + 200).min(bytes.len());
    String::from_utf8_lossy(&bytes[start..end]).into_owned()
}

/// Where in `bytes` a forbidden form occurs: one line per form found, with how often and the
/// bytes around its first occurrence.
fn leaks_in(what: &str, bytes: &[u8]) -> Vec<String> {
    let mut found = Vec::new();
    for (name, form, needle) in forbidden() {
        if let Some(at) = find(bytes, &needle) {
            let count = bytes.windows(needle.len()).filter(|w| *w == needle).count();
            found.push(format!(
                "{what}: {form} of {name}, {count}x, first at byte {at}: …{}…",
                around(bytes, at, needle.len())
            ));
        }
    }
    found
}

/// Every row of every table of the store, as SQLite returns it, scanned: findings name the
/// table and the row (its `seq`, `kind`, `n`, `id` columns where it has them). Returns the
/// findings and all the text seen.
fn scan_tables(db: &rusqlite::Connection) -> (Vec<String>, Vec<u8>) {
    let tables: Vec<String> = db
        .prepare("SELECT name FROM sqlite_master WHERE type = 'table'")
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    let mut leaks = Vec::new();
    let mut all = Vec::new();
    for table in tables {
        let mut stmt = db.prepare(&format!("SELECT * FROM \"{table}\"")).unwrap();
        let names: Vec<String> = stmt.column_names().map(str::to_string).collect();
        let mut rows = stmt.query([]).unwrap();
        let mut i = 0;
        while let Some(row) = rows.next().unwrap() {
            i += 1;
            let mut label = format!("table {table} row {i}");
            let mut text = Vec::new();
            for (c, name) in names.iter().enumerate() {
                match row.get_ref(c).unwrap() {
                    rusqlite::types::ValueRef::Text(t) | rusqlite::types::ValueRef::Blob(t) => {
                        if ["kind", "id", "name", "verifier"].contains(&name.as_str()) {
                            label.push_str(&format!(" {name}={}", String::from_utf8_lossy(t)));
                        }
                        text.extend_from_slice(t);
                        text.push(b'\n');
                    }
                    rusqlite::types::ValueRef::Integer(n)
                        if ["seq", "n", "phase", "idx"].contains(&name.as_str()) =>
                    {
                        label.push_str(&format!(" {name}={n}"));
                    }
                    _ => {}
                }
            }
            leaks.extend(leaks_in(&format!("{label} (via SQLite)"), &text));
            all.extend_from_slice(&text);
        }
    }
    (leaks, all)
}

fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let p = entry.path();
        if p.is_dir() {
            out.extend(files_under(&p));
        } else {
            out.push(p);
        }
    }
    out.sort();
    out
}

/// Every file under `dir`, read as bytes: (leak findings, all the bytes concatenated).
fn scan_dir(dir: &Path) -> (Vec<String>, Vec<u8>) {
    let mut leaks = Vec::new();
    let mut all = Vec::new();
    for file in files_under(dir) {
        let bytes = std::fs::read(&file).unwrap();
        leaks.extend(leaks_in(&file.display().to_string(), &bytes));
        all.extend_from_slice(&bytes);
        all.push(0);
    }
    (leaks, all)
}

fn script() -> Vec<Value> {
    vec![
        // The model repeats the secrets it should not know: in its text, a plan item, a note.
        json!({
            "text": format!("I will use {TOKEN} and {QUOTED}"),
            "calls": [
                {"tool": "plan", "args": {"items": [format!("call leak with {TOKEN}"), format!("remember {QUOTED}"), "finish".to_string()]}},
                {"tool": "note", "args": {"text": format!("token={TOKEN} password={QUOTED} file={FILEONLY}")}}
            ]
        }),
        // The tool prints and writes every value; the model passes one as an argument too.
        json!({"tool": "leak", "args": {"tag": format!("tag-{TOKEN}")}}),
        json!({"calls": [
            {"tool": "note", "args": {"text": format!("again {QUOTED} / {FILEONLY}")}},
            {"tool": "finish", "args": {"summary": format!("done with {TOKEN} and {QUOTED}")}}
        ]}),
    ]
}

fn contract(script_path: &Path) -> String {
    format!(
        r#"
[task]
goal = "The secrets are used and the run completes."

[driver]
kind = "script"
script = "{script}"

[budget]
steps = 20

[[verify]]
name = "leaked-file"
tier = "acceptance"
run = "cat leaked.txt && test -s leaked.txt"

[[phase]]
name = "prepare"
kind = "command"
run = ["echo db=$FILEONLY; printf 'quoted=%s\n' \"$QUOTED\"; echo \"$FILEONLY\" >&2"]
secrets = ["FILEONLY", "QUOTED"]
done_when = []

[[phase]]
name = "work"
kind = "agent"
objective = "Call leak, then finish."
tools = ["leak", "plan", "note", "finish"]
done_when = []

[[tool]]
name = "leak"
description = "Prints the token and writes it into leaked.txt."
run = ["sh", "-c", "echo token=$TOKEN; echo \"$TOKEN\" >&2; printf 'quoted=%s\n' \"$QUOTED\"; echo file=$FILEONLY; echo tag=$0; echo $TOKEN > leaked.txt; printf '%s\n' \"$QUOTED\" \"$FILEONLY\" >> leaked.txt", "{{tag}}"]
parameters = {{ tag = {{ type = "string" }} }}
secrets = ["TOKEN", "QUOTED", "FILEONLY"]
"#,
        script = script_path.display(),
    )
}

/// A workspace, and outside it the driver script and the secrets file.
struct Scenario {
    fx: Fixture,
    outside: tempfile::TempDir,
}

impl Scenario {
    fn new(secrets_file: &str, mode: u32) -> Scenario {
        let outside = tempfile::tempdir().unwrap();
        let path = outside.path().join("script.jsonl");
        let lines: Vec<String> = script().iter().map(Value::to_string).collect();
        std::fs::write(&path, lines.join("\n") + "\n").unwrap();
        let file = outside.path().join("secrets");
        std::fs::write(&file, secrets_file).unwrap();
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(mode)).unwrap();
        Scenario {
            fx: Fixture::new(&contract(&path)),
            outside,
        }
    }

    fn secrets_file(&self) -> PathBuf {
        self.outside.path().join("secrets")
    }

    /// keel with `args`, the two environment secrets and the secrets file; FILEONLY is not in
    /// its environment.
    fn keel(&self, args: &[&str]) -> Output {
        self.keel_env(args, &[("TOKEN", TOKEN), ("QUOTED", QUOTED)])
    }

    fn keel_env(&self, args: &[&str], env: &[(&str, &str)]) -> Output {
        let mut cmd = self.fx.keel();
        cmd.args(args)
            .env_remove("TOKEN")
            .env_remove("QUOTED")
            .env_remove("FILEONLY")
            .env("KEEL_SECRETS_FILE", self.secrets_file());
        for (k, v) in env {
            cmd.env(k, v);
        }
        cmd.output().expect("keel runs")
    }

    fn expect(&self, args: &[&str], code: i32) -> Output {
        self.fx.expect_exit(self.keel(args), args, code)
    }
}

fn secrets_file_text() -> String {
    format!("# test secrets\nFILEONLY={FILEONLY}\n")
}

fn run_id(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .next()
        .and_then(|l| l.strip_prefix("run "))
        .expect("keel run prints its id first")
        .trim()
        .to_string()
}

#[test]
fn no_secret_value_reaches_the_store_or_the_output() {
    let s = Scenario::new(&secrets_file_text(), 0o600);
    let f = &s.fx;
    let mut outputs: Vec<(String, Output)> = Vec::new();

    let run = s.expect(&["run", "keel.toml"], 0);
    let id = run_id(&run);
    outputs.push(("keel run".into(), run));

    // The secrets did flow: the tool and the command phase saw them (the workspace file holds
    // them, outside .keel), so their absence below is the scrubbing's doing.
    let leaked = std::fs::read_to_string(f.path("leaked.txt")).unwrap();
    assert_eq!(leaked, format!("{TOKEN}\n{QUOTED}\n{FILEONLY}\n"));

    for args in [
        vec!["status", id.as_str(), "--json"],
        vec!["log", id.as_str()],
        vec!["log", id.as_str(), "--json"],
        vec!["effects", id.as_str(), "--json"],
        vec!["verify-log", id.as_str()],
    ] {
        let out = s.expect(&args, 0);
        outputs.push((format!("keel {}", args.join(" ")), out));
    }

    let status: Value = serde_json::from_slice(&outputs[1].1.stdout).unwrap();
    assert_eq!(state(&status), "completed", "{status:#}");
    let events: Vec<Value> = serde_json::from_slice(&outputs[3].1.stdout).unwrap();
    let kinds = kinds(&events);
    for kind in [
        "model_replied",
        "tool_call_finished",
        "step_finished",
        "evidence_recorded",
    ] {
        assert!(
            kinds.iter().any(|k| k == kind),
            "no {kind} event: {kinds:?}"
        );
    }

    let mut leaks = Vec::new();
    for (what, out) in &outputs {
        leaks.extend(leaks_in(&format!("{what}: stdout"), &out.stdout));
        leaks.extend(leaks_in(&format!("{what}: stderr"), &out.stderr));
    }

    // The store as it is on disk, WAL included, before anything checkpoints it.
    let store = f.path(".keel");
    let (raw_leaks, all) = scan_dir(&store);
    leaks.extend(raw_leaks);
    for (name, _, _) in SECRETS {
        let placeholder = format!("[secret:{name}]");
        assert!(
            find(&all, placeholder.as_bytes()).is_some(),
            "{placeholder} is nowhere under .keel: the value never reached keel, so this test shows nothing"
        );
    }

    // Everything in the database file itself, once the WAL is folded in.
    {
        let db = f.db();
        db.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()))
            .unwrap();
        let (table_leaks, text) = scan_tables(&db);
        leaks.extend(table_leaks);
        assert!(
            find(&text, b"[secret:TOKEN]").is_some(),
            "no row of the store mentions [secret:TOKEN]"
        );
    }
    let db_bytes = std::fs::read(f.path(".keel/keel.db")).unwrap();
    leaks.extend(leaks_in(
        ".keel/keel.db after wal_checkpoint(TRUNCATE)",
        &db_bytes,
    ));

    assert!(
        leaks.is_empty(),
        "secret values leaked:\n{}",
        leaks.join("\n\n")
    );
}

#[test]
fn a_secret_shorter_than_four_characters_is_refused_before_anything_runs() {
    let outside = tempfile::tempdir().unwrap();
    let marker = outside.path().join("ran");
    let f = Fixture::new(&format!(
        r#"
[task]
goal = "Nothing runs."

[[verify]]
name = "present"
tier = "acceptance"
run = "test -f README.md"

[[phase]]
name = "prepare"
kind = "command"
run = ["touch {}"]
secrets = ["PIN"]
done_when = []
"#,
        marker.display()
    ));
    let out = f
        .keel()
        .args(["run", "keel.toml"])
        .env("PIN", "x7q")
        .env("KEEL_SECRETS_FILE", outside.path().join("absent"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{}", f.explain(&out));
    assert!(
        stderr.contains("secret PIN is shorter than 4 characters"),
        "{}",
        f.explain(&out)
    );
    assert!(!stderr.contains("x7q"), "{}", f.explain(&out));
    assert!(!marker.exists(), "the command ran: {}", f.explain(&out));
    assert_eq!(runs_in(&f), 0, "a run was created: {}", f.explain(&out));
}

/// How many runs the fixture's store holds (none when there is no store).
fn runs_in(f: &Fixture) -> i64 {
    if !f.path(".keel/keel.db").exists() {
        return 0;
    }
    f.db()
        .query_row("SELECT count(*) FROM runs", [], |r| r.get(0))
        .unwrap()
}

#[test]
fn a_secrets_file_readable_by_others_is_refused_when_it_is_needed() {
    let s = Scenario::new(&secrets_file_text(), 0o644);
    let refused = s.keel(&["run", "keel.toml"]);
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(2), "{}", s.fx.explain(&refused));
    let file = s.secrets_file();
    assert!(
        stderr.contains(&format!("run chmod 600 {}", file.display())),
        "{}",
        s.fx.explain(&refused)
    );
    assert!(leaks_in("stderr", &refused.stderr).is_empty(), "{stderr}");
    assert!(
        !s.fx.path("leaked.txt").exists(),
        "the tool ran: {}",
        s.fx.explain(&refused)
    );
    assert_eq!(
        runs_in(&s.fx),
        0,
        "a run was created: {}",
        s.fx.explain(&refused)
    );

    // With every value in the environment the file is not read, and its mode does not matter.
    let s = Scenario::new("this line is not NAME=value\n", 0o644);
    let out = s.keel_env(
        &["run", "keel.toml"],
        &[("TOKEN", TOKEN), ("QUOTED", QUOTED), ("FILEONLY", FILEONLY)],
    );
    assert_eq!(out.status.code(), Some(0), "{}", s.fx.explain(&out));
    assert!(
        std::fs::read_to_string(s.fx.path("leaked.txt"))
            .unwrap()
            .contains(FILEONLY)
    );
}
