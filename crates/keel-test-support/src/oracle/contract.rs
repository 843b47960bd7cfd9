//! The contract parser's oracle, `Contract::parse`: what any text it is given must come back as.
//! Shared by keel-core's property tests (`tests/fuzz_contract.rs`) and the coverage-guided fuzz
//! target `contract` (`fuzz/`), so that both hold the parser to the same promises:
//! - a refusal carries at least one diagnostic, each with the file's name, a line and column
//!   inside the text, and a sentence; never the "refused without a reason" fallback;
//! - a contract that parses keeps every promise `Contract` makes (unique names, resolved
//!   references, positive limits, an acceptance verifier, at least one phase, …);
//! - parsing is deterministic, and the hash is the hash of the exact text.
//!
//! Each check panics with what it found, as a test's assertion does.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashSet;

use keel_core::agent::Reversibility;
use keel_core::contract::{
    Contract, ContractError, DriverKind, KeyPassing, McpSource, PhaseKind, Tier, placeholders,
};

/// The file name every text is parsed under (and every diagnostic must name).
pub const FILE: &str = "fuzz.toml";

/// Parses `source` and checks whatever comes back. Returns the contract, if it parsed.
pub fn check(source: &str) -> Result<Contract, ContractError> {
    let result = Contract::parse(FILE, source);
    match &result {
        Ok(contract) => assert_keeps_its_promises(contract, source),
        Err(err) => assert_says_where_and_why(err, source),
    }
    // The same text, the same answer.
    match (&result, Contract::parse(FILE, source)) {
        (Ok(a), Ok(b)) => assert_eq!(a.hash, b.hash),
        (Err(a), Err(b)) => assert_eq!(a, &b),
        (a, b) => panic!("two parses of one text disagree: {a:?} then {b:?}"),
    }
    result
}

fn assert_says_where_and_why(err: &ContractError, source: &str) {
    assert!(
        !err.diagnostics.is_empty(),
        "a refusal without a diagnostic"
    );
    let lines: Vec<&str> = source.split('\n').collect();
    let mut previous = (0, 0);
    for d in &err.diagnostics {
        assert_eq!(d.file, FILE);
        assert!(!d.message.trim().is_empty(), "an empty message: {d:?}");
        assert!(
            !d.message.contains("without a reason"),
            "a refusal that gives no reason: {d}\n--- source ---\n{source}"
        );
        assert!(
            (1..=lines.len()).contains(&d.line),
            "line {} is outside the {} lines of the text: {d}",
            d.line,
            lines.len()
        );
        let width = lines[d.line - 1].chars().count();
        assert!(
            (1..=width + 1).contains(&d.column),
            "column {} is outside line {} ({width} characters): {d}",
            d.column,
            d.line
        );
        assert!(
            d.to_string()
                .starts_with(&format!("{FILE}:{}:{}: ", d.line, d.column)),
            "{d}"
        );
        assert!((d.line, d.column) >= previous, "diagnostics out of order");
        previous = (d.line, d.column);
    }
}

fn is_name(s: &str) -> bool {
    (1..=64).contains(&s.chars().count())
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-')
}

fn is_env_name(s: &str) -> bool {
    !s.is_empty()
        && !s.starts_with(|c: char| c.is_ascii_digit())
        && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
}

fn blank(s: &str) -> bool {
    s.trim().is_empty()
}

/// Everything `Contract`'s documentation promises about a parsed contract.
fn assert_keeps_its_promises(c: &Contract, source: &str) {
    assert_eq!(c.source, source);
    assert_eq!(c.hash, blake3::hash(source.as_bytes()).to_hex().to_string());

    assert!(!blank(&c.task.goal) && c.task.goal.trim() == c.task.goal);
    assert!(c.task.out_of_scope.iter().all(|s| !blank(s)));

    assert!(!blank(&c.workspace.path));
    assert!(c.workspace.fingerprint.iter().all(|s| !blank(s)));
    assert!(c.workspace.lockfiles.iter().all(|s| !blank(s)));

    if let Some(d) = &c.driver {
        let model_needed = matches!(d.kind, DriverKind::Openai | DriverKind::Anthropic);
        assert!(
            !model_needed || d.model.is_some(),
            "{:?} without a model",
            d.kind
        );
        assert!(d.model.as_deref().is_none_or(|m| !blank(m)));
        assert_eq!(d.command.is_some(), d.kind == DriverKind::Command);
        assert_eq!(d.script.is_some(), d.kind == DriverKind::Script);
        assert!(d.command.as_deref().is_none_or(|m| !blank(m)));
        assert!(d.script.as_deref().is_none_or(|m| !blank(m)));
        assert!(
            d.base_url
                .as_deref()
                .is_none_or(|u| u.starts_with("http://") || u.starts_with("https://"))
        );
        assert!(
            d.api_key
                .as_deref()
                .is_none_or(|k| k.strip_prefix("secret:").is_some_and(is_env_name)),
            "api_key {:?} is not a secret reference",
            d.api_key
        );
        assert!(d.context_tokens.is_none_or(|n| n > 0));
        assert!(d.max_output_tokens > 0 && d.timeout_ms > 0 && d.retry_backoff_ms > 0);
    }

    for glob in c
        .scope
        .writable
        .iter()
        .chain(&c.scope.forbidden)
        .chain(&c.scope.commands)
    {
        assert!(!glob.is_empty());
    }
    for rule in &c.scope.http {
        let bare = rule.host.strip_prefix("*.").unwrap_or(&rule.host);
        assert!(!bare.is_empty() && !bare.contains(['*', '/']), "{rule:?}");
        assert!(
            rule.methods
                .iter()
                .all(|m| ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE"].contains(&m.as_str()))
        );
    }

    for (name, limit) in &c.budget.0 {
        assert!(*limit > 0, "budget {name:?} is {limit}");
    }

    let mut verifiers = HashSet::new();
    for v in &c.verifiers {
        assert!(is_name(&v.name), "verifier name {:?}", v.name);
        assert!(
            verifiers.insert(v.name.as_str()),
            "two verifiers {:?}",
            v.name
        );
        assert!(!blank(&v.run) && v.timeout_ms > 0);
        if let Some(builtin) = v.run.trim().strip_prefix("keel:") {
            assert!(
                keel_core::contract::BUILTIN_VERIFIERS.contains(&v.run.trim()),
                "{builtin}"
            );
        }
    }
    assert!(
        c.verifiers.iter().any(|v| v.tier == Tier::Acceptance),
        "no acceptance verifier"
    );

    let mut tools = HashSet::new();
    for t in &c.tools {
        assert!(
            !t.name.is_empty()
                && t.name
                    .chars()
                    .all(|ch| ch.is_ascii_alphanumeric() || ch == '_' || ch == '-'),
            "tool name {:?}",
            t.name
        );
        assert!(!keel_core::tools::BUILTIN.contains(&t.name.as_str()));
        assert!(tools.insert(t.name.as_str()), "two tools {:?}", t.name);
        assert!(!blank(&t.description));
        assert!(!t.run.is_empty() && !blank(&t.run[0]));
        let declared: Vec<&str> = t.parameters["properties"]
            .as_object()
            .map(|p| p.keys().map(String::as_str).collect())
            .unwrap_or_default();
        for element in t.run.iter().chain(t.compensate.iter().flatten()) {
            for p in placeholders(element) {
                assert!(
                    declared.contains(&p)
                        || (p == "idempotency_key" && t.idempotency_key == Some(KeyPassing::Arg)),
                    "{{{p}}} of tool {} is not declared",
                    t.name
                );
            }
        }
        if t.idempotency_key == Some(KeyPassing::Arg) {
            assert!(
                t.run
                    .iter()
                    .any(|r| placeholders(r).contains(&"idempotency_key"))
            );
        }
        if let Some(KeyPassing::Env(var)) = &t.idempotency_key {
            assert!(!var.is_empty());
        }
        assert_eq!(
            t.compensate.is_some(),
            t.reversibility == Reversibility::Compensatable,
            "tool {}",
            t.name
        );
        assert!(t.secrets.iter().all(|s| is_env_name(s)
            || s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') && !s.is_empty()));
        assert!(t.timeout_ms.is_none_or(|ms| ms > 0));
    }

    let mut servers = HashSet::new();
    for m in &c.mcp {
        assert!(
            keel_mcp_like_name(&m.name) && !keel_core::tools::BUILTIN.contains(&m.name.as_str()),
            "MCP server name {:?}",
            m.name
        );
        assert!(
            servers.insert(m.name.as_str()),
            "two MCP servers {:?}",
            m.name
        );
        match &m.source {
            McpSource::Stdio { command, env } => {
                assert!(!command.is_empty() && !blank(&command[0]));
                assert!(env.iter().all(|e| is_env_name(e)));
            }
            McpSource::Http { url } => {
                let host = url
                    .strip_prefix("http://")
                    .or_else(|| url.strip_prefix("https://"));
                assert!(
                    host.is_some_and(|h| !h.is_empty() && !h.starts_with('/')),
                    "{url}"
                );
                assert!(m.secrets.is_empty());
            }
        }
        assert!(m.secrets.iter().all(|s| is_env_name(s)));
        assert_ne!(m.reversibility, Reversibility::Compensatable);
        assert!(m.read_only.iter().all(|t| !blank(t)));
        assert!(m.timeout_ms > 0);
    }

    assert!(!c.phases.is_empty(), "a contract without phases");
    let mut phases = HashSet::new();
    for p in &c.phases {
        assert!(is_name(&p.name), "phase name {:?}", p.name);
        assert!(phases.insert(p.name.as_str()), "two phases {:?}", p.name);
        let mut gate = HashSet::new();
        for g in &p.gate {
            assert!(
                verifiers.contains(g.as_str()),
                "gate {g:?} of {} is no verifier",
                p.name
            );
            assert!(gate.insert(g.as_str()), "gate {g:?} twice");
        }
        assert!(
            p.secrets
                .iter()
                .all(|s| !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'))
        );
        match &p.kind {
            PhaseKind::Command { run, timeout_ms } => {
                assert!(!run.is_empty() && run.iter().all(|r| !blank(r)));
                assert!(*timeout_ms > 0);
            }
            PhaseKind::Agent {
                objective,
                tools: listed,
                timeout_ms,
            } => {
                assert!(
                    c.driver.is_some(),
                    "agent phase {} without a driver",
                    p.name
                );
                assert!(!blank(objective) && objective.trim() == objective);
                assert!(listed.iter().any(|t| t == "finish"));
                assert_eq!(
                    listed.iter().collect::<HashSet<_>>().len(),
                    listed.len(),
                    "a tool listed twice"
                );
                for t in listed {
                    let known = keel_core::tools::BUILTIN.contains(&t.as_str())
                        || tools.contains(t.as_str())
                        || t.split_once('.')
                            .is_some_and(|(s, rest)| servers.contains(s) && !rest.is_empty());
                    assert!(known, "phase {} lists unknown tool {t:?}", p.name);
                }
                assert!(*timeout_ms > 0);
            }
        }
    }

    assert!(c.approvals.notify.as_deref().is_none_or(|n| !blank(n)));
    assert!(c.approvals.expires_ms.is_none_or(|ms| ms > 0));
    assert!(!c.approvals.require.contains(&Reversibility::ReadOnly));

    let s = &c.sandbox;
    assert!(
        s.writable
            .iter()
            .all(|w| w.starts_with('/') || w.starts_with("~/"))
    );
    assert!(
        s.env
            .iter()
            .all(|e| !e.is_empty() && e.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'))
    );
    assert!(s.memory_bytes >= 16 << 20 && s.processes >= 8 && s.open_files >= 8);
    assert!(s.cpu_ms.is_none_or(|ms| ms > 0));

    for name in c.secret_names() {
        assert!(
            !name.is_empty()
                && name
                    .chars()
                    .all(|ch| ch.is_ascii_alphanumeric() || ch == '_'),
            "secret name {name:?}"
        );
    }
}

fn keel_mcp_like_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}
