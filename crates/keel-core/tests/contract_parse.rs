//! What a valid contract turns into, and how invalid ones are reported.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::fs;
use std::path::Path;

use keel_core::agent::Reversibility;
use keel_core::budget::BudgetName;
use keel_core::contract::{
    Contract, ContractError, DEFAULT_LOCKFILES, DEFAULT_MCP_TIMEOUT_MS, DEFAULT_TIMEOUT_MS,
    Diagnostic, DriverKind, McpServer, McpSource, PhaseKind, Tier,
};

fn fixture(name: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/contracts")
        .join(name);
    fs::read_to_string(&path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()))
}

fn parse(source: &str) -> Contract {
    Contract::parse("contract.toml", source).unwrap_or_else(|e| panic!("refused:\n{e}"))
}

fn refuse(source: &str) -> ContractError {
    match Contract::parse("contract.toml", source) {
        Ok(_) => panic!("accepted, but should have been refused:\n{source}"),
        Err(e) => e,
    }
}

const MINIMAL: &str = r#"[task]
goal = "The tests pass."

[[verify]]
name = "tests"
tier = "acceptance"
run = "cargo test"

[[phase]]
name = "build"
kind = "command"
run = ["cargo build"]
"#;

#[test]
fn maximal_contract_keeps_every_value() {
    let source = fixture("good/maximal.toml");
    let c = parse(&source);

    assert_eq!(
        c.task.goal, "Parsing a 10 MB JSON array no longer overflows the stack; all tests pass.",
        "the goal is trimmed"
    );
    assert_eq!(
        c.task.out_of_scope,
        ["the public API of crate `parser`", "CI configuration"]
    );

    assert_eq!(c.workspace.path, "../repo");
    assert_eq!(c.workspace.fingerprint.len(), 2);
    assert_eq!(
        c.workspace.lockfiles,
        ["Cargo.lock", "web/package-lock.json"]
    );

    let driver = c.driver.as_ref().unwrap();
    assert_eq!(driver.kind, DriverKind::Openai);
    assert_eq!(driver.model.as_deref(), Some("gpt-5-mini"));
    assert_eq!(
        driver.base_url.as_deref(),
        Some("http://127.0.0.1:11434/v1")
    );
    assert_eq!(driver.api_key.as_deref(), Some("secret:OPENAI_API_KEY"));
    assert_eq!(driver.context_tokens, Some(32_000));
    assert_eq!(driver.command, None);
    assert_eq!(driver.script, None);

    assert_eq!(c.scope.writable, ["src/**", "tests/**"]);
    assert_eq!(c.scope.forbidden, ["Cargo.lock", ".github/**"]);
    assert_eq!(c.scope.commands, ["cargo *", "git diff *"]);
    assert!(c.scope.network);
    assert!(c.scope.allows_write("src/parser/mod.rs"));
    assert!(!c.scope.allows_write("Cargo.lock"));
    assert!(!c.scope.allows_write("README.md"));
    assert!(c.scope.command_allowed("cargo test --quiet"));
    assert!(!c.scope.command_allowed("git push"));

    let b = &c.budget;
    let expected = [
        (BudgetName::Tokens, 2_000_000),
        (BudgetName::CostUsd, 5_500_000),
        (BudgetName::WallTime, 4 * 3_600_000),
        (BudgetName::ComputeTime, 90 * 60_000),
        (BudgetName::Steps, 300),
        (BudgetName::ToolCalls, 1000),
        (BudgetName::SameError, 3),
        (BudgetName::NoProgressSteps, 25),
        (BudgetName::Writes, 200),
        (BudgetName::NetworkRequests, 10),
        (BudgetName::ParallelWorkers, 1),
        (BudgetName::DiffLines, 400),
        (BudgetName::FilesChanged, 12),
        (BudgetName::Approvals, 3),
    ];
    for (name, amount) in expected {
        assert_eq!(b.get(name), Some(amount), "budget {name}");
    }
    assert_eq!(b.0.len(), BudgetName::ALL.len(), "every budget is set");

    let names: Vec<&str> = c.verifiers.iter().map(|v| v.name.as_str()).collect();
    assert_eq!(names, ["check", "lint", "fmt", "tests"], "contract order");
    let check = c.verifier("check").unwrap();
    assert_eq!(check.tier, Tier::Step);
    assert_eq!(check.run, "cargo check --quiet");
    assert_eq!(check.timeout_ms, 2 * 60_000);
    assert_eq!(c.verifier("lint").unwrap().timeout_ms, DEFAULT_TIMEOUT_MS);
    assert_eq!(c.verifier("fmt").unwrap().timeout_ms, 30_000);
    assert!(c.verifier("nope").is_none());
    let phase_tier: Vec<&str> = c
        .verifiers_of(Tier::Phase)
        .map(|v| v.name.as_str())
        .collect();
    assert_eq!(phase_tier, ["lint", "fmt"]);
    assert_eq!(c.verifiers_of(Tier::Acceptance).count(), 1);

    assert_eq!(c.phases.len(), 2);
    let build = &c.phases[0];
    assert_eq!(build.name, "build");
    assert_eq!(
        build.kind,
        PhaseKind::Command {
            run: vec![
                "cargo build --quiet".to_string(),
                "cargo build --release --quiet".to_string()
            ],
            timeout_ms: 15 * 60_000,
        }
    );
    assert_eq!(build.gate, ["check", "lint"], "done_when, in its order");
    let package = c.phase("package_2").unwrap();
    assert_eq!(
        package.gate,
        ["lint", "fmt"],
        "default gate: every phase-tier verifier"
    );
    assert_eq!(
        package.kind,
        PhaseKind::Command {
            run: vec!["cargo package --no-verify".to_string()],
            timeout_ms: DEFAULT_TIMEOUT_MS,
        }
    );

    assert_eq!(
        c.mcp,
        [
            McpServer {
                name: "github".into(),
                source: McpSource::Stdio {
                    command: vec!["github-mcp-server".into(), "stdio".into()],
                    env: vec!["GITHUB_HOST".into()],
                },
                secrets: vec!["GITHUB_TOKEN".into()],
                reversibility: Reversibility::Irreversible,
                read_only: vec!["get_issue".into(), "search_code".into()],
                approval: true,
                timeout_ms: 30_000,
            },
            McpServer {
                name: "docs".into(),
                source: McpSource::Http {
                    url: "http://127.0.0.1:8080/mcp".into()
                },
                secrets: vec![],
                reversibility: Reversibility::ReadOnly,
                read_only: vec![],
                approval: false,
                timeout_ms: DEFAULT_MCP_TIMEOUT_MS,
            },
        ]
    );
    assert!(c.secret_names().contains(&"GITHUB_TOKEN".to_string()));
    assert_eq!(c.mcp[0].class_of("get_issue"), Reversibility::ReadOnly);
    assert_eq!(
        c.mcp[0].class_of("create_issue"),
        Reversibility::Irreversible
    );
    assert_eq!(c.mcp_server("docs").map(|m| m.timeout_ms), Some(120_000));

    assert_eq!(c.source, source);
}

const MCP_AGENT: &str = r#"[task]
goal = "The issue is filed."

[driver]
kind = "script"
script = "run.jsonl"

[[verify]]
name = "tests"
tier = "acceptance"
run = "cargo test"

[[phase]]
name = "work"
kind = "agent"
objective = "File it."
tools = ["read", "finish", "gh.*", "docs.search"]

[[mcp]]
name = "gh"
command = ["gh-mcp"]

[[mcp]]
name = "docs"
url = "https://docs.example.com/mcp"
"#;

#[test]
fn agent_phases_list_mcp_tools_by_server() {
    let c = parse(MCP_AGENT);
    match &c.phases[0].kind {
        PhaseKind::Agent { tools, .. } => {
            assert_eq!(tools, &["read", "finish", "gh.*", "docs.search"]);
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(c.mcp[0].timeout_ms, DEFAULT_MCP_TIMEOUT_MS);
    assert_eq!(c.mcp[0].reversibility, Reversibility::Irreversible);
    assert!(!c.mcp[0].approval);
}

#[test]
fn mcp_servers_are_checked() {
    let cases = [
        (
            MCP_AGENT.replace("\"docs.search\"", "\"docs.\""),
            "names no tool; write \"docs.TOOL\"",
        ),
        (
            MCP_AGENT.replace("name = \"gh\"", "name = \"run\""),
            "\"run\" is a built-in tool; give the MCP server another name",
        ),
        (
            MCP_AGENT.replace("https://docs", "ftp://docs"),
            "is not an HTTP URL",
        ),
        (
            MCP_AGENT.replace(
                "url = \"https://docs.example.com/mcp\"",
                "url = \"https://docs.example.com/mcp\"\nsecrets = [\"TOKEN\"]",
            ),
            "secrets is only for a server keel starts (command)",
        ),
        (
            MCP_AGENT.replace("command = [\"gh-mcp\"]", "command = []"),
            "command is empty",
        ),
        (
            MCP_AGENT.replace(
                "command = [\"gh-mcp\"]",
                "command = [\"gh-mcp\"]\nenv = [\"1BAD\"]",
            ),
            "environment variable \"1BAD\" must be an environment variable name",
        ),
        (
            MCP_AGENT.replace(
                "command = [\"gh-mcp\"]",
                "command = [\"gh-mcp\"]\nreversibility = \"compensatable\"",
            ),
            "cannot be compensatable",
        ),
        (
            MCP_AGENT.replace(
                "command = [\"gh-mcp\"]",
                "command = [\"gh-mcp\"]\nread_only = [\"gh.get\"]",
            ),
            "write \"get\", not \"gh.get\"",
        ),
        (
            MCP_AGENT.replace(
                "command = [\"gh-mcp\"]",
                "command = [\"gh-mcp\"]\ntimeout = \"soon\"",
            ),
            "the timeout of MCP server \"gh\" is \"soon\", which is not a duration",
        ),
        (
            MCP_AGENT.replace("\"gh.*\"", "\"hub.*\""),
            "there is no MCP server \"hub\"; the servers are gh, docs",
        ),
        (
            MCP_AGENT.replace("\"read\", ", "\"gh\", "),
            "or an MCP server's as \"server.tool\" or \"server.*\" (servers: gh, docs)",
        ),
    ];
    for (source, fragment) in cases {
        let e = refuse(&source);
        assert!(
            e.diagnostics.iter().any(|d| d.message.contains(fragment)),
            "expected {fragment:?} in:\n{e}"
        );
    }
}

#[test]
fn minimal_contract_gets_the_defaults() {
    let c = parse(MINIMAL);
    assert_eq!(c.workspace.path, ".");
    assert!(c.workspace.fingerprint.is_empty());
    assert_eq!(c.workspace.lockfiles, DEFAULT_LOCKFILES);
    assert!(c.driver.is_none());
    assert!(c.scope.writable.is_empty() && c.scope.forbidden.is_empty());
    assert!(c.scope.commands.is_empty());
    assert!(!c.scope.network);
    assert!(c.scope.allows_write("anything"));
    assert!(c.scope.command_allowed("anything"));
    assert!(c.budget.0.is_empty(), "no [budget]: unlimited");
    assert!(c.task.out_of_scope.is_empty());
    assert_eq!(c.verifiers[0].timeout_ms, DEFAULT_TIMEOUT_MS);
    assert!(
        c.phases[0].gate.is_empty(),
        "no phase-tier verifiers, no done_when"
    );
}

#[test]
fn empty_done_when_means_no_gate() {
    let c = parse(&fixture("good/delegated.toml"));
    assert!(c.phases[0].gate.is_empty());
    assert_eq!(
        c.budget.get(BudgetName::CostUsd),
        Some(2_000_000),
        "integer dollars"
    );
    let driver = c.driver.unwrap();
    assert_eq!(driver.kind, DriverKind::Command);
    assert_eq!(
        driver.command.as_deref(),
        Some("my-agent --prompt-file {prompt}")
    );
}

#[test]
fn script_driver_needs_its_script() {
    let with = MINIMAL.replace(
        "[[verify]]",
        "[driver]\nkind = \"script\"\nscript = \"run.jsonl\"\n\n[[verify]]",
    );
    assert_eq!(
        parse(&with).driver.unwrap().script.as_deref(),
        Some("run.jsonl")
    );

    let without = MINIMAL.replace("[[verify]]", "[driver]\nkind = \"script\"\n\n[[verify]]");
    let e = refuse(&without);
    assert_eq!(e.diagnostics.len(), 1, "{e}");
    assert_eq!((e.diagnostics[0].line, e.diagnostics[0].column), (5, 8));
    assert!(e.diagnostics[0].message.contains("needs `script`"), "{e}");

    let wrong = MINIMAL.replace(
        "[[verify]]",
        "[driver]\nkind = \"anthropic\"\nmodel = \"m\"\nscript = \"x\"\n\n[[verify]]",
    );
    let e = refuse(&wrong);
    assert!(
        e.diagnostics[0]
            .message
            .contains("`script` is used only by kind = \"script\""),
        "{e}"
    );
}

#[test]
fn every_validation_problem_is_reported() {
    let source = r#"[task]
goal = ""

[budget]
steps = 0
writes = -1
wall_time = "soon"

[scope]
forbidden = ["a/[b"]

[[verify]]
name = "Check"
tier = "step"
run = "cargo check"
timeout = "1 fortnight"

[[verify]]
name = "check2"
tier = "phase"
run = ""

[[phase]]
name = "build"
kind = "command"
run = []
done_when = ["tests"]

[[phase]]
name = "build"
kind = "agent"

[[tool]]
name = "notify"
run = ["notify"]
"#;
    let e = refuse(source);
    let at: Vec<(usize, usize)> = e.diagnostics.iter().map(|d| (d.line, d.column)).collect();
    assert_eq!(
        at,
        [
            (2, 8),   // empty goal
            (5, 9),   // steps = 0
            (6, 10),  // writes = -1
            (7, 13),  // wall_time
            (10, 14), // bad glob
            (12, 1),  // no acceptance verifier, at the first [[verify]]
            (13, 8),  // bad name
            (16, 11), // bad timeout
            (21, 7),  // empty run
            (26, 7),  // empty run list
            (27, 14), // done_when names an unknown verifier
            (29, 1),  // agent phase without an objective
            (30, 8),  // duplicate phase name
            (31, 8),  // agent phase without a [driver]
            (33, 1),  // [[tool]]
        ],
        "\n{e}"
    );
    assert!(e.diagnostics.iter().all(|d| d.file == "contract.toml"));
    assert_eq!(
        e.to_string().lines().count(),
        e.diagnostics.len(),
        "one per line"
    );
    assert!(
        e.to_string()
            .starts_with("contract.toml:2:8: the goal is empty"),
        "{e}"
    );
}

#[test]
fn hash_is_blake3_of_the_exact_source() {
    let c = parse(MINIMAL);
    assert_eq!(
        c.hash,
        blake3::hash(MINIMAL.as_bytes()).to_hex().to_string()
    );
    assert_eq!(c.hash.len(), 64);
    assert_eq!(parse(MINIMAL).hash, c.hash, "the same bytes, the same hash");

    // Any byte changes the version, even where the meaning does not change: a trailing newline,
    // whitespace, and every byte of a comment.
    assert_ne!(parse(&format!("{MINIMAL}\n")).hash, c.hash);
    assert_ne!(parse(&MINIMAL.replace("goal = ", "goal  = ")).hash, c.hash);
    let commented = format!("{MINIMAL}# note\n");
    let base = parse(&commented).hash;
    assert_ne!(base, c.hash);
    let start = MINIMAL.len() + 2;
    for i in start..commented.len() - 1 {
        let mut bytes = commented.clone().into_bytes();
        bytes[i] = if bytes[i] == b'x' { b'y' } else { b'x' };
        let changed = String::from_utf8(bytes).unwrap();
        assert_ne!(
            parse(&changed).hash,
            base,
            "changing byte {i} must change the hash"
        );
    }
}

#[test]
fn columns_count_characters_and_crlf_is_fine() {
    let source = "[task]\r\ngoal = \"é\"\r\nmotto = \"ü\"\r\n";
    let e = refuse(source);
    assert_eq!(
        e.diagnostics[0],
        Diagnostic {
            file: "contract.toml".to_string(),
            line: 3,
            column: 1,
            message: e.diagnostics[0].message.clone(),
        }
    );
    let source = "[task]\ngoal = \"ééé\" x\n";
    let e = refuse(source);
    assert_eq!(
        (e.diagnostics[0].line, e.diagnostics[0].column),
        (2, 14),
        "{e}"
    );

    let crlf = MINIMAL.replace('\n', "\r\n");
    assert_eq!(parse(&crlf).task.goal, "The tests pass.");
}

#[test]
fn tier_is_serialised_as_its_lowercase_name() {
    for (tier, word) in [
        (Tier::Step, "step"),
        (Tier::Phase, "phase"),
        (Tier::Acceptance, "acceptance"),
    ] {
        assert_eq!(tier.to_string(), word);
        assert_eq!(serde_json::to_string(&tier).unwrap(), format!("\"{word}\""));
        assert_eq!(
            serde_json::from_str::<Tier>(&format!("\"{word}\"")).unwrap(),
            tier
        );
    }
}

#[test]
fn tiny_and_huge_values() {
    let with_budget =
        |budget: &str| MINIMAL.replace("[[verify]]", &format!("[budget]\n{budget}\n\n[[verify]]"));
    let e = refuse(&with_budget("cost_usd = 0.0000001"));
    assert!(
        e.diagnostics[0].message.contains("at least $0.000001"),
        "{e}"
    );
    let e = refuse(&with_budget("cost_usd = nan"));
    assert!(e.diagnostics[0].message.contains("cost_usd is NaN"), "{e}");
    let e = refuse(&with_budget("wall_time = \"10us\""));
    assert!(
        e.diagnostics[0].message.contains("less than a millisecond"),
        "{e}"
    );
    let e = refuse(&with_budget("steps = 99999999999999999999"));
    assert!(e.diagnostics[0].message.contains("too large"), "{e}");
    let c = parse(&with_budget(
        "steps = 9223372036854775807\ncost_usd = 0.000001",
    ));
    assert_eq!(c.budget.get(BudgetName::Steps), Some(i64::MAX as u64));
    assert_eq!(c.budget.get(BudgetName::CostUsd), Some(1));
}
