//! Malformed contracts through the `keel` binary: every file in
//! `crates/keel-core/tests/contracts/bad/` (first line `# expect: LINE:COL: text`) is refused by
//! `keel run` with exit 2, `keel.toml:LINE:COL:` and the text on stderr, and no run is created.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::{Path, PathBuf};

use common::Fixture;
use serde_json::Value;

struct Case {
    name: String,
    source: String,
    line: usize,
    column: usize,
    text: String,
}

fn cases() -> Vec<Case> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../keel-core/tests/contracts/bad");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "toml"))
        .collect();
    files.sort();
    files
        .iter()
        .map(|path| {
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            let source = std::fs::read_to_string(path).unwrap();
            let first = source.lines().next().unwrap_or("");
            let parsed = first.strip_prefix("# expect: ").and_then(|rest| {
                let (line, rest) = rest.split_once(':')?;
                let (column, text) = rest.split_once(':')?;
                Some((
                    line.trim().parse().ok()?,
                    column.trim().parse().ok()?,
                    text.trim().to_string(),
                ))
            });
            let (line, column, text) = parsed.unwrap_or_else(|| {
                panic!("{name}: the first line must be `# expect: LINE:COL: text`, not {first:?}")
            });
            Case {
                name,
                source,
                line,
                column,
                text,
            }
        })
        .collect()
}

/// Runs `keel run <contract>` on one bad contract; returns what was wrong, if anything.
fn check(f: &Fixture, case: &Case, contract: &str) -> Option<String> {
    std::fs::write(f.path(contract), &case.source).unwrap();
    let out = f.run(&["run", contract]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let location = format!("{contract}:{}:{}:", case.line, case.column);
    let first_diagnostic = stderr
        .lines()
        .find(|l| l.contains(&format!("{contract}:")))
        .unwrap_or("");
    let mut problems = Vec::new();
    if out.status.code() != Some(2) {
        problems.push(format!("exit {:?}, expected 2", out.status.code()));
    }
    if !first_diagnostic.contains(&location) {
        problems.push(format!("the first diagnostic is not at `{location}`"));
    }
    if !first_diagnostic.contains(&case.text) {
        problems.push(format!("the first diagnostic does not say {:?}", case.text));
    }
    if stdout.starts_with("run ") {
        problems.push("a run id was printed".to_string());
    }
    (!problems.is_empty()).then(|| {
        format!(
            "{}: {}\n  --- stdout\n{stdout}\n  --- stderr\n{stderr}",
            case.name,
            problems.join("; ")
        )
    })
}

#[test]
fn every_bad_contract_is_refused_with_its_line_column_and_message_and_no_store() {
    let cases = cases();
    assert!(
        cases.len() >= 15,
        "expected at least 15 bad contracts, found {}",
        cases.len()
    );
    let f = Fixture::new("");
    let failures: Vec<String> = cases
        .iter()
        .filter_map(|c| check(&f, c, "keel.toml"))
        .collect();
    assert!(
        failures.is_empty(),
        "{} of {} bad contracts were not refused as expected:\n\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n\n")
    );
    assert!(
        !f.path(".keel").exists(),
        "refusing a contract must not create a store"
    );
}

#[test]
fn bad_contracts_add_no_run_to_an_existing_store() {
    let f = Fixture::new(
        r#"[task]
goal = "A file exists."

[[verify]]
name = "file"
tier = "acceptance"
run = "test -f a.txt"

[[phase]]
name = "work"
kind = "command"
run = ["echo a > a.txt"]
"#,
    );
    let (id, out) = f.start(&[]);
    assert_eq!(out.status.code(), Some(0), "{}", f.explain(&out));
    std::fs::create_dir(f.path("sub")).unwrap();

    let cases = cases();
    // Through a path with a directory the diagnostics name that path.
    let failures: Vec<String> = cases
        .iter()
        .filter_map(|c| check(&f, c, "sub/bad.toml"))
        .collect();
    assert!(
        failures.is_empty(),
        "{} of {} bad contracts were not refused as expected:\n\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n\n")
    );
    let out = f.expect(&["status", "--json"], 0);
    let list: Value = serde_json::from_slice(&out.stdout).unwrap();
    let ids: Vec<&str> = list
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, [id.as_str()], "only the good run exists");
    assert!(!f.path("sub/.keel").exists());
    let runs: i64 = f
        .db()
        .query_row("SELECT count(*) FROM runs", [], |r| r.get(0))
        .unwrap();
    assert_eq!(runs, 1);
}

#[test]
fn every_diagnostic_of_a_contract_with_several_problems_is_reported() {
    let f = Fixture::new(
        r#"[task]
goal = "x"

[budget]
steps = 0

[[verify]]
name = "tests"
tier = "phase"
run = "true"

[[phase]]
name = "build"
kind = "command"
run = ["true"]
done_when = ["nope"]
"#,
    );
    let out = f.expect(&["run", "keel.toml"], 2);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let located: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("keel.toml:"))
        .collect();
    assert!(
        located.len() >= 2,
        "more than one problem is reported, each with its place\n{}",
        f.explain(&out)
    );
    assert!(stderr.contains("keel.toml:5:"), "{}", f.explain(&out));
    assert!(!f.path(".keel").exists());
}
