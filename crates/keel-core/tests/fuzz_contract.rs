//! Bad input to the contract parser, `Contract::parse`: arbitrary text, and the valid contracts
//! of `tests/contracts/good/` (and `keel init`'s template) mutated byte by byte and key by key.
//!
//! Each property runs 256 cases by default; set `KEEL_FUZZ_CASES` (for example
//! `KEEL_FUZZ_CASES=100000`) to run more. Nothing is written to the source tree: a failure prints
//! the smallest input it found instead of saving it.
//!
//! What is asserted:
//! - the parser never panics, however deep, long or broken the text;
//! - a refusal carries at least one diagnostic, each with this file's name, a line and column
//!   inside the text, and a sentence; never the "refused without a reason" fallback;
//! - a contract that parses keeps every promise `Contract` makes (unique names, resolved
//!   references, positive limits, an acceptance verifier, at least one phase, …): garbage that
//!   gets through is caught here;
//! - parsing is deterministic, and the hash is the hash of the exact text;
//! - an unknown key, or a value of a type no key takes, is refused at its own line.
//!
//! `Contract::parse` takes `&str`; bytes that are not UTF-8 cannot reach it (the caller reads the
//! file as text and fails first), so byte mutations go through a lossy conversion.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use keel_core::contract::TEMPLATE;
use keel_test_support::fuzz::{self, ByteEdit};
use keel_test_support::oracle::contract::check;
use proptest::prelude::*;
use proptest::sample::Index;

/// A contract using every table, so that mutations reach the checks of each.
const EVERYTHING: &str = r#"
[task]
goal = "The service answers on /health."
out_of_scope = ["the database schema"]

[workspace]
path = "."
fingerprint = ["rustc --version"]
lockfiles = ["Cargo.lock"]

[driver]
kind = "anthropic"
model = "claude-sonnet-4"
base_url = "https://api.anthropic.com"
api_key = "secret:ANTHROPIC_API_KEY"
context_tokens = 20000
max_output_tokens = 1000
timeout = "2m"
max_retries = 3
retry_backoff = "250ms"
input_usd_per_mtok = 3
output_usd_per_mtok = 15.0

[scope]
writable = ["src/**"]
forbidden = ["src/secret/**"]
commands = ["cargo *"]
network = false

[[scope.http]]
host = "*.example.com"
port = 443
methods = ["get", "POST"]

[budget]
tokens = 100000
cost_usd = 0.5
wall_time = "1h"
steps = 40

[approvals]
notify = "notify-send keel"
expires = "1d"
on_expiry = "block"
require = ["irreversible", "compensatable"]

[sandbox]
mode = "on"
writable = ["/tmp/cache", "~/.cargo"]
env = ["RUST_LOG"]
memory = "2GiB"
processes = 64
open_files = 256
cpu_time = "10m"

[[tool]]
name = "deploy"
description = "Deploy the service."
run = ["./deploy.sh", "--env", "{env}", "--key", "{idempotency_key}"]
idempotency_key = "arg"
reversibility = "compensatable"
compensate = ["./undeploy.sh", "{env}"]
secrets = ["DEPLOY_TOKEN"]
approval = true
timeout = "5m"
network = true

[tool.parameters]
env = { type = "string", description = "staging or production" }
dry = { type = "boolean", optional = true }

[[mcp]]
name = "docs"
url = "http://127.0.0.1:8080/mcp"
reversibility = "reversible"
read_only = ["search"]

[[verify]]
name = "health"
tier = "acceptance"
run = "curl -fsS localhost:8080/health"
timeout = "30s"

[[verify]]
name = "unit"
tier = "phase"
run = "cargo test --quiet"

[[phase]]
name = "fix"
kind = "agent"
objective = "Make /health answer 200."
tools = ["read", "write", "run", "deploy", "docs.*", "docs.search", "finish"]
timeout = "20m"
done_when = ["unit"]

[[phase]]
name = "ship"
kind = "command"
run = ["./release.sh"]
approval = true
secrets = ["RELEASE_TOKEN"]
"#;

/// Every valid contract the mutations start from.
fn samples() -> Vec<&'static str> {
    vec![
        include_str!("contracts/good/minimal.toml"),
        include_str!("contracts/good/agent.toml"),
        include_str!("contracts/good/approval.toml"),
        include_str!("contracts/good/delegated.toml"),
        include_str!("contracts/good/maximal.toml"),
        TEMPLATE,
        EVERYTHING,
    ]
}

// ---- mutations -----------------------------------------------------------------------------------

/// TOML values chosen to break assumptions: wrong types, extremes, empties, odd characters, long
/// and deep values, and strings that are nearly right.
fn hostile_value() -> BoxedStrategy<String> {
    let fixed: Vec<&'static str> = vec![
        "-1",
        "0",
        "1",
        "9223372036854775807",
        "-9223372036854775808",
        "99999999999999999999",
        "1e309",
        "-1e309",
        "nan",
        "inf",
        "-inf",
        "0.0000001",
        "1e-300",
        "1.5",
        "true",
        "false",
        "\"\"",
        "\"   \"",
        "\"\\u0000\"",
        "\"a\\u0000b\"",
        "\"\\u202e\"",
        "[]",
        "[\"\"]",
        "[\"a\", \"a\"]",
        "[1, \"a\"]",
        "{}",
        "{ zz = 1 }",
        "1979-05-27T07:32:00Z",
        "07:32:00",
        "\"0s\"",
        "\"0.1ms\"",
        "\"1ns\"",
        "\"584942417356y\"",
        "\"18446744073709551616ms\"",
        "\"-5s\"",
        "\"5 parsecs\"",
        "\"keel:nope\"",
        "\"keel:secret-scan\"",
        "\"secret:\"",
        "\"secret:1A\"",
        "\"sk-live-0123456789\"",
        "\"http://\"",
        "\"https:///x\"",
        "\"ftp://x\"",
        "\"[\"",
        "\"**/{a\"",
        "\"a\\\\\"",
        "\"finish\"",
        "\"a.b\"",
        "\"a.\"",
        "\".*\"",
        "\"UPPER\"",
        "\"ünïcode\"",
        "\"env:\"",
        "\"env:A B\"",
        "\"arg\"",
        "\"off\"",
        "\"15MiB\"",
        "\"18446744073709551615GiB\"",
        "'''multi\nline'''",
        "\"\"\"\n\"\"\"",
    ];
    prop_oneof![
        8 => proptest::sample::select(fixed).prop_map(str::to_string),
        1 => "[a-z_]{0,70}".prop_map(|s| format!("\"{s}\"")),
        1 => any::<i64>().prop_map(|n| n.to_string()),
        1 => any::<f64>().prop_map(|f| format!("{f:?}")),
        1 => (1usize..100_000).prop_map(|n| format!("\"{}\"", "x".repeat(n))),
        1 => (1usize..2_000).prop_map(|n| format!("{}{}", "[".repeat(n), "]".repeat(n))),
        1 => (1usize..2_000).prop_map(|n| format!("{}1{}", "{ a = ".repeat(n), " }".repeat(n))),
    ]
    .boxed()
}

/// Keys of the contract and a few that are not, for added lines.
fn some_key() -> impl Strategy<Value = String> {
    let keys: Vec<&'static str> = vec![
        "goal",
        "name",
        "kind",
        "run",
        "tier",
        "timeout",
        "done_when",
        "tools",
        "objective",
        "model",
        "api_key",
        "tokens",
        "cost_usd",
        "writable",
        "secrets",
        "approval",
        "command",
        "url",
        "mode",
        "memory",
        "zz_unknown",
        "a.b.c",
        "\"quoted key\"",
        "\"\"",
    ];
    proptest::sample::select(keys).prop_map(str::to_string)
}

#[derive(Debug, Clone)]
enum Mutation {
    /// Flip, cut, delete or insert bytes.
    Bytes(ByteEdit),
    DuplicateLine(Index),
    DeleteLine(Index),
    SwapLines(Index, Index),
    /// Replace the value of the chosen `key = value` line.
    SetValue(Index, String),
    /// Add `key = value` after the chosen line.
    AddKey(Index, String, String),
    /// Repeat the chosen line at the end of the text (a table header twice, a key in another
    /// table).
    RepeatAtEnd(Index),
}

/// Bytes that mean something to a TOML reader.
const TOML_TOKENS: &[&[u8]] = &[
    b"\n",
    b"\r",
    b"\x00",
    b"\xff",
    b"\"",
    b"'''",
    b"[",
    b"]]",
    b"=",
    b"#",
    b"\\",
    b"\n[[phase]]\n",
    b"\n[task]\n",
];

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        1 => fuzz::flip().prop_map(Mutation::Bytes),
        1 => fuzz::truncate().prop_map(Mutation::Bytes),
        1 => fuzz::delete(80).prop_map(Mutation::Bytes),
        1 => fuzz::insert(TOML_TOKENS).prop_map(Mutation::Bytes),
        1 => any::<Index>().prop_map(Mutation::DuplicateLine),
        1 => any::<Index>().prop_map(Mutation::DeleteLine),
        1 => (any::<Index>(), any::<Index>()).prop_map(|(a, b)| Mutation::SwapLines(a, b)),
        3 => (any::<Index>(), hostile_value()).prop_map(|(i, v)| Mutation::SetValue(i, v)),
        2 => (any::<Index>(), some_key(), hostile_value())
            .prop_map(|(i, k, v)| Mutation::AddKey(i, k, v)),
        1 => any::<Index>().prop_map(Mutation::RepeatAtEnd),
    ]
}

/// The lines of `text` that set a key on one line: `key = value`.
fn assignments(lines: &[String]) -> Vec<usize> {
    lines
        .iter()
        .enumerate()
        .filter(|(_, l)| {
            let t = l.trim_start();
            !t.starts_with('#') && !t.starts_with('[') && t.contains(" = ")
        })
        .map(|(i, _)| i)
        .collect()
}

fn mutate(text: &str, m: &Mutation) -> String {
    let mut lines: Vec<String> = text.split('\n').map(str::to_string).collect();
    let n = lines.len();
    match m {
        Mutation::Bytes(edit) => {
            let bytes = fuzz::apply_bytes(text.as_bytes().to_vec(), edit);
            return String::from_utf8_lossy(&bytes).into_owned();
        }
        Mutation::DuplicateLine(i) => {
            let at = i.index(n);
            lines.insert(at, lines[at].clone());
        }
        Mutation::DeleteLine(i) => {
            lines.remove(i.index(n));
        }
        Mutation::SwapLines(a, b) => lines.swap(a.index(n), b.index(n)),
        Mutation::SetValue(i, value) => {
            let candidates = assignments(&lines);
            if !candidates.is_empty() {
                let at = candidates[i.index(candidates.len())];
                let (key, _) = lines[at].split_once(" = ").unwrap();
                lines[at] = format!("{key} = {value}");
            }
        }
        Mutation::AddKey(i, key, value) => {
            lines.insert(i.index(n) + 1, format!("{key} = {value}"));
        }
        Mutation::RepeatAtEnd(i) => {
            let line = lines[i.index(n)].clone();
            lines.push(line);
        }
    }
    lines.join("\n")
}

// ---- properties ------------------------------------------------------------------------------------

proptest! {
    #![proptest_config(fuzz::config())]

    #[test]
    fn arbitrary_text_is_refused_with_a_located_reason_or_is_a_valid_contract(
        text in prop_oneof![any::<String>(), "[\\[\\]a-z=\"\n .{}_,0-9#'-]{0,400}"],
    ) {
        check(&text).ok();
    }

    #[test]
    fn arbitrary_bytes_never_panic_the_parser(bytes in proptest::collection::vec(any::<u8>(), 0..600)) {
        check(&String::from_utf8_lossy(&bytes)).ok();
    }

    #[test]
    fn a_mutated_valid_contract_is_refused_with_a_located_reason_or_keeps_every_promise(
        which in any::<Index>(),
        mutations in proptest::collection::vec(mutation(), 1..5),
    ) {
        let samples = samples();
        let sample = samples[which.index(samples.len())];
        let text = mutations.iter().fold(sample.to_string(), |t, m| mutate(&t, m));
        check(&text).ok();
    }

    #[test]
    fn an_unknown_key_is_refused_at_its_line(
        which in any::<Index>(),
        table in any::<Index>(),
        key in "zz_[a-z_]{0,12}",
        value in hostile_value(),
    ) {
        let samples = samples();
        let sample = samples[which.index(samples.len())];
        let mut lines: Vec<String> = sample.split('\n').map(str::to_string).collect();
        // Right after a table header, so the key lands in that table (never inside a multi-line
        // string). Keys of `[tool.parameters]` are argument names, chosen by the contract: a
        // problem with one is reported at the table.
        let headers: Vec<usize> = lines
            .iter()
            .enumerate()
            .filter(|(_, l)| l.starts_with('[') && l.trim() != "[tool.parameters]")
            .map(|(i, _)| i)
            .collect();
        let at = headers[table.index(headers.len())] + 1;
        lines.insert(at, format!("{key} = {value}"));
        let text = lines.join("\n");
        let err = check(&text).expect_err("an unknown key was accepted");
        prop_assert!(
            err.diagnostics.iter().any(|d| d.line == at + 1),
            "no diagnostic at line {}: {err}",
            at + 1
        );
    }

    #[test]
    fn a_value_of_a_type_no_key_takes_is_refused_at_its_line(
        which in any::<Index>(),
        line in any::<Index>(),
        value in proptest::sample::select(vec!["{ zz = 1 }", "1979-05-27T07:32:00Z", "07:32:00", "[[]]"]),
    ) {
        let samples = samples();
        let sample = samples[which.index(samples.len())];
        let mut lines: Vec<String> = sample.split('\n').map(str::to_string).collect();
        let candidates: Vec<usize> = assignments(&lines)
            .into_iter()
            .filter(|&i| !lines[i].contains("\"\"\"") && !lines[i].trim_start().starts_with("parameters"))
            .filter(|&i| {
                // Inside `[tool.parameters]` a key names an argument: a table is right there.
                let header = lines[..i].iter().rev().find(|l| l.starts_with('['));
                header.is_none_or(|h| h.trim() != "[tool.parameters]")
            })
            .collect();
        let at = candidates[line.index(candidates.len())];
        let (key, _) = lines[at].split_once(" = ").unwrap();
        lines[at] = format!("{key} = {value}");
        let text = lines.join("\n");
        let err = check(&text).expect_err("a value of the wrong type was accepted");
        prop_assert!(
            err.diagnostics.iter().any(|d| d.line == at + 1),
            "no diagnostic at line {}: {err}",
            at + 1
        );
    }
}

#[test]
fn every_sample_is_valid() {
    // The mutation properties mean something only if what they start from parses.
    for sample in samples() {
        if let Err(e) = check(sample) {
            panic!("{e}\n--- source ---\n{sample}");
        }
    }
}

/// Text nested far deeper than any contract: arrays, inline tables, dotted keys and table
/// headers. Each must be refused with a diagnostic, not overflow the stack.
#[test]
fn deeply_nested_text_is_refused_not_a_crash() {
    const DEPTH: usize = 100_000;
    let goal = "[task]\ngoal = \"g\"\n";
    let cases = [
        format!("{goal}x = {}{}\n", "[".repeat(DEPTH), "]".repeat(DEPTH)),
        format!(
            "{goal}x = {}1{}\n",
            "{ a = ".repeat(DEPTH),
            " }".repeat(DEPTH)
        ),
        format!("{goal}x{} = 1\n", ".a".repeat(DEPTH)),
        format!("{goal}[x{}]\n", ".a".repeat(DEPTH)),
        format!("{goal}[[x{}]]\n", ".a".repeat(DEPTH)),
        format!("{}{goal}", "[".repeat(DEPTH)),
    ];
    for text in &cases {
        check(text).expect_err("a deeply nested contract was accepted");
    }
}

#[test]
fn a_very_long_contract_is_refused_or_parsed_in_one_piece() {
    // 10,000 verifiers with one duplicate name far down: found, and reported at its line.
    let mut text = String::from(
        "[task]\ngoal = \"g\"\n[[phase]]\nname = \"p\"\nkind = \"command\"\nrun = [\"true\"]\n",
    );
    for i in 0..10_000 {
        text.push_str(&format!(
            "[[verify]]\nname = \"v{i}\"\ntier = \"acceptance\"\nrun = \"true\"\n"
        ));
    }
    text.push_str("[[verify]]\nname = \"v9999\"\ntier = \"acceptance\"\nrun = \"true\"\n");
    let err = check(&text).expect_err("a duplicate verifier name was accepted");
    // The name line of the last `[[verify]]`; the text ends with a newline.
    let line = text.split('\n').count() - 3;
    assert!(
        err.diagnostics
            .iter()
            .any(|d| d.line == line && d.message.contains("twice")),
        "{err}"
    );
}
