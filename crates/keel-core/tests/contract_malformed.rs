//! Every file in `tests/contracts/bad/` is a contract keel must refuse. Its first line says how:
//! `# expect: LINE:COL: <part of the message>`, checked against the first diagnostic.
//! Every file in `tests/contracts/good/` must parse.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::fs;
use std::path::{Path, PathBuf};

use keel_core::contract::{Contract, Diagnostic};

fn fixtures(kind: &str) -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/contracts")
        .join(kind);
    let mut files: Vec<PathBuf> = fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", dir.display()))
        .map(|entry| entry.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "toml"))
        .collect();
    files.sort();
    files
}

struct Expectation {
    line: usize,
    column: usize,
    message: String,
}

fn expectation(name: &str, source: &str) -> Expectation {
    let first = source.lines().next().unwrap_or("");
    let parse = || -> Option<Expectation> {
        let rest = first.strip_prefix("# expect: ")?;
        let (line, rest) = rest.split_once(':')?;
        let (column, message) = rest.split_once(':')?;
        Some(Expectation {
            line: line.trim().parse().ok()?,
            column: column.trim().parse().ok()?,
            message: message.trim().to_string(),
        })
    };
    parse().unwrap_or_else(|| {
        panic!("{name}: the first line must be `# expect: LINE:COL: <message part>`, not {first:?}")
    })
}

/// Checks one bad contract; returns a description of the mismatch, if any.
fn check_bad(path: &Path) -> Option<String> {
    let name = path.file_name().unwrap().to_string_lossy().into_owned();
    let source = fs::read_to_string(path).unwrap();
    let expect = expectation(&name, &source);
    let diagnostics: Vec<Diagnostic> = match Contract::parse(&name, &source) {
        Ok(_) => return Some(format!("{name}: parsed, but it should have been refused")),
        Err(e) => e.diagnostics,
    };
    let listing = || {
        diagnostics
            .iter()
            .map(|d| {
                let text = source.lines().nth(d.line - 1).unwrap_or("");
                format!("  {d}\n      | {text}")
            })
            .collect::<Vec<_>>()
            .join("\n")
    };
    let Some(first) = diagnostics.first() else {
        return Some(format!("{name}: refused without a diagnostic"));
    };
    let problems = [
        (first.file != name).then(|| format!("file is {:?}, not {name:?}", first.file)),
        ((first.line, first.column) != (expect.line, expect.column)).then(|| {
            format!(
                "first diagnostic is at {}:{}, expected {}:{}",
                first.line, first.column, expect.line, expect.column
            )
        }),
        (!first.message.contains(&expect.message))
            .then(|| format!("first message does not contain {:?}", expect.message)),
    ];
    let problems: Vec<String> = problems.into_iter().flatten().collect();
    (!problems.is_empty()).then(|| {
        format!(
            "{name}: {}\n  actual diagnostics:\n{}",
            problems.join("; "),
            listing()
        )
    })
}

#[test]
fn bad_contracts_are_refused_at_the_right_place() {
    let files = fixtures("bad");
    assert!(
        files.len() >= 20,
        "expected at least 20 bad contracts, found {}",
        files.len()
    );
    let failures: Vec<String> = files.iter().filter_map(|f| check_bad(f)).collect();
    assert!(
        failures.is_empty(),
        "{} of {} bad contracts were not refused as expected:\n\n{}",
        failures.len(),
        files.len(),
        failures.join("\n\n")
    );
}

#[test]
fn good_contracts_parse() {
    let files = fixtures("good");
    assert!(!files.is_empty(), "no good contracts found");
    let failures: Vec<String> = files
        .iter()
        .filter_map(|path| {
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            let source = fs::read_to_string(path).unwrap();
            Contract::parse(&name, &source)
                .err()
                .map(|e| format!("{name} was refused:\n{e}"))
        })
        .collect();
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

#[test]
fn every_diagnostic_is_printed_as_file_line_column_message() {
    let source = "[task]\ngoal = 3\n";
    let err = Contract::parse("dir/contract.toml", source).unwrap_err();
    assert_eq!(
        err.to_string(),
        "dir/contract.toml:2:8: wrong type: expected a string, found the integer 3"
    );
}
