//! The contract `keel init` writes.

/// A commented contract that explains every section. It parses as it is; a user edits the goal,
/// the commands and the limits to fit their project.
pub const TEMPLATE: &str = r#"# keel contract: what this task must achieve, how keel checks it, and the limits it must stay within.
# The file is immutable for a run: its blake3 hash is the contract version, and a run refuses to
# continue if the file changes under it. Unknown keys are errors, not warnings.

[task]
# What must be true when the run is done, in a sentence or two. Required.
goal = "The project builds and all of its tests pass."
# Things the run must not change or attempt. Optional.
out_of_scope = ["the public API", "CI configuration"]

[workspace]
# The directory the run works in (a git repository), relative to this file. Default ".".
path = "."
# Shell commands whose output is part of the environment fingerprint. On resume keel recomputes
# the fingerprint (git HEAD, lockfile hashes, tool versions and these outputs) and never continues
# silently in a changed environment. Optional.
fingerprint = []
# Lockfiles hashed into the fingerprint. Leave the key out for the usual ones (Cargo.lock,
# package-lock.json, yarn.lock, pnpm-lock.yaml, poetry.lock, uv.lock, Pipfile.lock, Gemfile.lock,
# go.sum, composer.lock).
# lockfiles = ["Cargo.lock"]

# [driver] chooses the actions of agent phases (see the commented agent phase at the end). Kinds:
# "openai" (any OpenAI-compatible server), "anthropic", "command" (a delegated program, which
# finds the prompt in $KEEL_PROMPT_FILE) and "script" (recorded actions, one JSON per line). API
# keys are secret references, never the key itself: keel reads the variable when the run starts.
# [driver]
# kind = "openai"
# model = "gpt-5-mini"
# base_url = "http://127.0.0.1:11434/v1"
# api_key = "secret:OPENAI_API_KEY"
# context_tokens = 32000

[scope]
# Globs over paths relative to the workspace. `*` stays within a directory, `**` crosses them.
# An empty `writable` list means every path is writable; `forbidden` always wins.
writable = ["src/**", "tests/**"]
forbidden = [".git/**", ".github/**"]
# Globs over whole command lines; an empty list allows every command.
commands = []
# Whether commands may use the network.
network = false

[budget]
# Hard limits; leave a key out for no limit. Exhausting one stops the run as `blocked`, and only
# an explicit, logged human action raises it. Durations are written like "90s", "30m" or "4h".
# Also available: tokens, cost_usd (dollars), tool_calls, no_progress_steps, writes,
# network_requests (http tool calls), parallel_workers, approvals.
wall_time = "2h"
compute_time = "1h"
steps = 200
same_error = 3        # the same error this many times in a row blocks the run
diff_lines = 2000
files_changed = 50

# Verifiers are commands whose exit status is evidence; their output is stored with the run.
# Names use lowercase letters, digits, "_" and "-". Tiers:
#   step        cheap; runs after every step that changed the workspace
#   phase       runs when a phase claims to be done (unless the phase has its own done_when)
#   acceptance  runs before the run may complete. At least one is required: keel completes a run
#               only with acceptance evidence, never because something said "done".
# `timeout` defaults to "10m".

[[verify]]
name = "check"
tier = "step"
run = "cargo check --quiet"
timeout = "5m"

[[verify]]
name = "lint"
tier = "phase"
run = "cargo clippy --quiet -- -D warnings"

[[verify]]
name = "tests"
tier = "acceptance"
run = "cargo test --quiet"
timeout = "20m"

# Phases run in order. A "command" phase runs its shell commands one after another; each may take
# up to `timeout` (default "10m"). `done_when` names the verifiers that must pass before the phase
# is done; without it, every verifier with tier = "phase" must.
# An "agent" phase lets the [driver] choose each action (see the README); `approval = true` makes
# a person approve the phase first; `secrets = ["NAME"]` gives its commands those secrets (from
# the environment or .keel/secrets). [[tool]] defines a command an agent may call, [[mcp]] an MCP
# server whose tools it may call, [sandbox] how every command is confined (on by default).
# Phases of kind "approval" and irreversible command phases are not supported yet.

[[phase]]
name = "build"
kind = "command"
run = ["cargo build --quiet"]
done_when = ["check"]

[[phase]]
name = "test"
kind = "command"
run = ["cargo test --quiet --no-run", "cargo test --quiet"]
timeout = "20m"

# An agent phase: the [driver] chooses each step's tool calls toward the objective; keel checks
# every call against [scope] and the budgets before it runs, and only passing verifiers end the
# phase when the driver calls `finish`. It needs the [driver] table above.
# [[phase]]
# name = "fix"
# kind = "agent"
# objective = "Make the failing test pass without changing the public API."
# tools = ["read", "list", "search", "write", "patch", "run", "plan", "note", "finish", "blocked"]
# done_when = ["check"]
"#;

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::TEMPLATE;
    use crate::budget::BudgetName;
    use crate::contract::{Contract, PhaseKind, Tier};

    #[test]
    fn template_parses() {
        let contract = match Contract::parse("keel.toml", TEMPLATE) {
            Ok(contract) => contract,
            Err(e) => panic!("the template does not parse:\n{e}"),
        };
        assert_eq!(contract.phases.len(), 2);
        assert!(
            contract
                .phases
                .iter()
                .all(|p| matches!(p.kind, PhaseKind::Command { .. }))
        );
        for tier in [Tier::Step, Tier::Phase, Tier::Acceptance] {
            assert_eq!(
                contract.verifiers_of(tier).count(),
                1,
                "one {tier} verifier"
            );
        }
        assert_eq!(contract.phases[0].gate, ["check"]);
        assert_eq!(
            contract.phases[1].gate,
            ["lint"],
            "default gate: the phase-tier verifiers"
        );
        assert_eq!(
            contract.budget.get(BudgetName::WallTime),
            Some(2 * 3600 * 1000)
        );
        assert_eq!(contract.budget.get(BudgetName::Steps), Some(200));
        assert!(contract.driver.is_none());
        assert!(contract.scope.allows_write("src/lib.rs"));
        assert!(!contract.scope.allows_write(".github/workflows/ci.yml"));
    }

    #[test]
    fn template_explains_every_section() {
        for section in [
            "[task]",
            "[workspace]",
            "[driver]",
            "[scope]",
            "[budget]",
            "[[verify]]",
            "[[phase]]",
            "[[tool]]",
        ] {
            assert!(
                TEMPLATE.contains(section),
                "the template does not mention {section}"
            );
        }
    }
}
