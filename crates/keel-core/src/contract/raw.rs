//! The contract's TOML exactly as written: serde types with no meaning attached yet.
//!
//! Every table denies unknown keys. Values a later check may need to point at are wrapped in
//! [`Spanned`], which records their byte range in the source; `#[schemars(with = ...)]` keeps the
//! wrapper out of the JSON Schema. Integers are read as `i64` so that a negative limit reaches
//! validation and gets a clear message instead of a type error. The doc comments here are the
//! descriptions in `schema/contract.schema.json`.

use std::fmt;

use schemars::JsonSchema;
use serde::Deserialize;
use serde::de::{self, Deserializer, Visitor};
use toml::Spanned;

use super::{DriverKind, Tier};

/// A keel task contract: the goal, the workspace, the phases to run, the verifiers whose
/// evidence completes a run, and the limits it must stay within.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(title = "keel contract")]
pub(super) struct RawContract {
    /// What the run must achieve.
    pub task: RawTask,
    /// Where the run works and what belongs to its environment fingerprint.
    pub workspace: Option<RawWorkspace>,
    /// The decision-maker behind agent phases.
    pub driver: Option<RawDriver>,
    /// Which paths may be written and which commands run.
    pub scope: Option<RawScope>,
    /// Hard limits; every one is optional and an absent one is unlimited.
    pub budget: Option<RawBudget>,
    /// How requests for people (approvals, questions) are announced and how long they wait.
    pub approvals: Option<RawApprovals>,
    /// Verifiers: commands whose exit status is evidence. At least one must have
    /// tier = "acceptance": keel completes a run only with acceptance evidence.
    #[serde(default)]
    #[schemars(with = "Vec<RawVerifier>", length(min = 1))]
    pub verify: Vec<Spanned<RawVerifier>>,
    /// The phases of the run, in order. At least one.
    #[serde(default)]
    #[schemars(with = "Vec<RawPhase>", length(min = 1))]
    pub phase: Vec<Spanned<RawPhase>>,
    /// Contract-defined tools for agent phases: a command with JSON-schema'd arguments.
    #[serde(default)]
    #[schemars(with = "Vec<RawTool>")]
    pub tool: Vec<Spanned<RawTool>>,
    /// MCP servers whose tools agent phases may list as "server.tool" or "server.*".
    #[serde(default)]
    #[schemars(with = "Vec<RawMcp>")]
    pub mcp: Vec<Spanned<RawMcp>>,
    /// How every command keel runs is confined.
    pub sandbox: Option<RawSandbox>,
}

/// `[[mcp]]`: an MCP (Model Context Protocol) server whose tools agent phases may use, started
/// as a child process (`command`) or reached over streamable HTTP (`url`). Its tools are named
/// "server.tool"; a phase lists them one by one or all at once as "server.*".
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "Mcp")]
pub(super) struct RawMcp {
    /// The server's name, the prefix of its tools' names: letters, digits, `_` and `-`, 1 to 64
    /// characters, unique, not a built-in tool's name.
    #[schemars(with = "String", regex(pattern = r"^[A-Za-z0-9_-]{1,64}$"))]
    pub name: Spanned<String>,
    /// The program and its arguments of a server spoken to on stdin/stdout (no shell); it runs
    /// in the workspace. Give `command` or `url`, not both.
    #[schemars(with = "Option<Vec<String>>", length(min = 1))]
    pub command: Option<Spanned<Vec<Spanned<String>>>>,
    /// The endpoint of a streamable-HTTP server, e.g. "http://127.0.0.1:8080/mcp".
    #[schemars(with = "Option<String>")]
    pub url: Option<Spanned<String>>,
    /// Names of environment variables passed from keel's environment to a `command` server
    /// (besides PATH, HOME and LANG; nothing else is inherited).
    #[schemars(with = "Option<Vec<String>>")]
    pub env: Option<Spanned<Vec<Spanned<String>>>>,
    /// Names of secrets a `command` server sees as environment variables.
    #[schemars(with = "Option<Vec<String>>")]
    pub secrets: Option<Spanned<Vec<Spanned<String>>>>,
    /// What undoing a call of any of its tools takes. Default "irreversible"; a tool's own
    /// annotations never lower it.
    #[schemars(with = "Option<RawReversibility>")]
    pub reversibility: Option<Spanned<RawReversibility>>,
    /// Names (unqualified) of this server's tools that change nothing: they are read_only.
    #[schemars(with = "Option<Vec<String>>")]
    pub read_only: Option<Spanned<Vec<Spanned<String>>>>,
    /// Ask a person before each call of any of its tools.
    #[schemars(with = "Option<bool>")]
    pub approval: Option<Spanned<bool>>,
    /// How long one call may take, e.g. "30s". Default "2m".
    #[schemars(with = "Option<String>", extend("default" = "2m"))]
    pub timeout: Option<Spanned<String>>,
}

/// `[sandbox]`: how every command keel runs (command phases, the `run` tool, delegated drivers,
/// verifiers, contract tools) is confined. On by default; the kernel must be able to enforce it.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "Sandbox")]
pub(super) struct RawSandbox {
    /// "on" (the default) or "off". Off runs commands unconfined and is recorded in the run's
    /// log; use it only where the kernel cannot enforce the sandbox and you accept the risk.
    #[schemars(with = "Option<String>")]
    pub mode: Option<Spanned<String>>,
    /// Extra directories commands may write besides the workspace and their private temp
    /// directory (for example a build cache). "~/" is the home directory.
    #[schemars(with = "Option<Vec<String>>")]
    pub writable: Option<Vec<Spanned<String>>>,
    /// Names of environment variables passed to commands besides keel's short allow-list.
    #[schemars(with = "Option<Vec<String>>")]
    pub env: Option<Vec<Spanned<String>>>,
    /// Address-space limit of each command, e.g. "4GiB" (default "8GiB").
    #[schemars(with = "Option<String>")]
    pub memory: Option<Spanned<String>>,
    /// How many processes a command may have at once (default 512).
    #[schemars(with = "Option<u64>")]
    pub processes: Option<Spanned<u64>>,
    /// How many files a command may have open (default 1024).
    #[schemars(with = "Option<u64>")]
    pub open_files: Option<Spanned<u64>>,
    /// CPU time limit of each command, e.g. "10m" (default: none besides the timeout).
    #[schemars(with = "Option<String>")]
    pub cpu_time: Option<Spanned<String>>,
}

/// `[approvals]`: how requests for a person are announced, and how long they may wait.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "Approvals")]
pub(super) struct RawApprovals {
    /// A shell command run whenever a request or question is created, with it as JSON on
    /// stdin (for example to post it to a chat channel). Its failure never stops the run.
    #[schemars(with = "Option<String>")]
    pub notify: Option<Spanned<String>>,
    /// How long a request may wait for a decision, e.g. "24h". Default: no deadline.
    #[schemars(with = "Option<String>")]
    pub expires: Option<Spanned<String>>,
    /// What a request nobody decided in time becomes: "reject" (default) or "block".
    #[schemars(with = "Option<String>")]
    pub on_expiry: Option<Spanned<String>>,
    /// Tool calls of these reversibility classes wait for a person's approval, e.g.
    /// ["irreversible", "compensatable"]. Default: none (a tool's own `approval` still applies).
    #[schemars(with = "Option<Vec<RawReversibility>>")]
    pub require: Option<Vec<Spanned<RawReversibility>>>,
}

/// `[task]`: what the run must achieve.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "Task")]
pub(super) struct RawTask {
    /// What must be true when the run is done, in a sentence or two. Not empty.
    #[schemars(with = "String", length(min = 1))]
    pub goal: Spanned<String>,
    /// Things the run must not change or attempt.
    #[schemars(with = "Option<Vec<String>>")]
    pub out_of_scope: Option<Vec<Spanned<String>>>,
}

/// `[workspace]`: where the run works and what belongs to its environment fingerprint.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "Workspace")]
pub(super) struct RawWorkspace {
    /// The workspace directory (a git repository), relative to the contract file's directory.
    /// Default ".".
    #[schemars(with = "Option<String>", extend("default" = "."))]
    pub path: Option<Spanned<String>>,
    /// Shell commands whose output is part of the environment fingerprint checked on resume.
    #[schemars(with = "Option<Vec<String>>")]
    pub fingerprint: Option<Vec<Spanned<String>>>,
    /// Lockfiles hashed into the environment fingerprint. Default: Cargo.lock,
    /// package-lock.json, yarn.lock, pnpm-lock.yaml, poetry.lock, uv.lock, Pipfile.lock,
    /// Gemfile.lock, go.sum, composer.lock.
    #[schemars(with = "Option<Vec<String>>")]
    pub lockfiles: Option<Vec<Spanned<String>>>,
}

/// `[driver]`: the decision-maker behind agent phases (checked, not used yet).
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "Driver")]
pub(super) struct RawDriver {
    /// Which driver decides the actions of agent phases.
    #[schemars(with = "DriverKind")]
    pub kind: Spanned<DriverKind>,
    /// The model name; required for "openai" and "anthropic".
    #[schemars(with = "Option<String>")]
    pub model: Option<Spanned<String>>,
    /// The API's base URL, e.g. "http://127.0.0.1:11434/v1" for any OpenAI-compatible server.
    #[schemars(with = "Option<String>")]
    pub base_url: Option<Spanned<String>>,
    /// A secret reference, "secret:NAME"; never the key itself.
    #[schemars(
        with = "Option<String>",
        regex(pattern = r"^secret:[A-Za-z_][A-Za-z0-9_]*$")
    )]
    pub api_key: Option<Spanned<String>>,
    /// The assembled prompt never exceeds this many tokens.
    #[schemars(with = "Option<i64>", range(min = 1))]
    pub context_tokens: Option<Spanned<i64>>,
    /// The program to run; required for kind = "command".
    #[schemars(with = "Option<String>")]
    pub command: Option<Spanned<String>>,
    /// The recorded actions to replay; required for kind = "script".
    #[schemars(with = "Option<String>")]
    pub script: Option<Spanned<String>>,
    /// The most tokens one model reply may have. Default 4096.
    #[schemars(with = "Option<i64>", range(min = 1))]
    pub max_output_tokens: Option<Spanned<i64>>,
    /// How long one model call (or one run of a command driver) may take, e.g. "120s".
    /// Default 120s for models, 30m for a command driver.
    #[schemars(with = "Option<String>")]
    pub timeout: Option<Spanned<String>>,
    /// How often a model call is retried on 429, 5xx and timeouts. Default 4.
    #[schemars(with = "Option<i64>", range(min = 0))]
    pub max_retries: Option<Spanned<i64>>,
    /// The first wait before a retry (doubling each time, with jitter), e.g. "500ms".
    #[schemars(with = "Option<String>")]
    pub retry_backoff: Option<Spanned<String>>,
    /// Price of a million input tokens in dollars, for models keel has no price for.
    #[schemars(with = "Option<f64>")]
    pub input_usd_per_mtok: Option<Spanned<Dollars>>,
    /// Price of a million output tokens in dollars.
    #[schemars(with = "Option<f64>")]
    pub output_usd_per_mtok: Option<Spanned<Dollars>>,
}

/// `[scope]`: which paths may be written and which commands run. Path globs match whole
/// workspace-relative paths (`*` stays within a directory, `**` crosses them); command globs match
/// whole command lines.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "Scope")]
pub(super) struct RawScope {
    /// Globs over workspace-relative paths that may be written. Empty or absent: every path.
    #[schemars(with = "Option<Vec<String>>")]
    pub writable: Option<Vec<Spanned<String>>>,
    /// Globs over workspace-relative paths that must never be written, even if writable.
    #[schemars(with = "Option<Vec<String>>")]
    pub forbidden: Option<Vec<Spanned<String>>>,
    /// Globs over a whole command line, e.g. "cargo *". Empty or absent: every command.
    #[schemars(with = "Option<Vec<String>>")]
    pub commands: Option<Vec<Spanned<String>>>,
    /// Whether commands may use the network. Default false.
    #[schemars(extend("default" = false))]
    pub network: Option<bool>,
    /// What the `http` tool may reach: each rule a host (exact, or "*.example.com"), an
    /// optional port and the methods allowed.
    #[schemars(with = "Option<Vec<RawHttpRule>>")]
    pub http: Option<Vec<Spanned<RawHttpRule>>>,
}

/// One allow rule of the `http` tool.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "HttpRule")]
pub(super) struct RawHttpRule {
    /// A host name or IP address, or "*.example.com" for its subdomains.
    pub host: String,
    /// The port; absent means any.
    pub port: Option<u16>,
    /// Methods allowed, e.g. ["GET", "POST"]. Default ["GET"].
    pub methods: Option<Vec<String>>,
}

/// `[budget]`: hard limits, all enforced together. Durations are strings like "90s", "30m" or
/// "4h"; counts are whole numbers; every limit must be greater than 0.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "Budget")]
pub(super) struct RawBudget {
    /// Model tokens, input and output together.
    #[schemars(with = "Option<i64>", range(min = 1))]
    pub tokens: Option<Spanned<i64>>,
    /// Money, in dollars.
    #[schemars(with = "Option<f64>", range(min = 0))]
    pub cost_usd: Option<Spanned<Dollars>>,
    /// Elapsed time of the run, e.g. "4h".
    #[schemars(with = "Option<String>")]
    pub wall_time: Option<Spanned<String>>,
    /// Time spent running commands, e.g. "1h".
    #[schemars(with = "Option<String>")]
    pub compute_time: Option<Spanned<String>>,
    /// Steps.
    #[schemars(with = "Option<i64>", range(min = 1))]
    pub steps: Option<Spanned<i64>>,
    /// Tool calls.
    #[schemars(with = "Option<i64>", range(min = 1))]
    pub tool_calls: Option<Spanned<i64>>,
    /// The same error this many times blocks the run.
    #[schemars(with = "Option<i64>", range(min = 1))]
    pub same_error: Option<Spanned<i64>>,
    /// This many steps without verifier improvement block the run.
    #[schemars(with = "Option<i64>", range(min = 1))]
    pub no_progress_steps: Option<Spanned<i64>>,
    /// File writes.
    #[schemars(with = "Option<i64>", range(min = 1))]
    pub writes: Option<Spanned<i64>>,
    /// Network requests.
    #[schemars(with = "Option<i64>", range(min = 1))]
    pub network_requests: Option<Spanned<i64>>,
    /// Workers running at once.
    #[schemars(with = "Option<i64>", range(min = 1))]
    pub parallel_workers: Option<Spanned<i64>>,
    /// Lines in the workspace diff.
    #[schemars(with = "Option<i64>", range(min = 1))]
    pub diff_lines: Option<Spanned<i64>>,
    /// Files changed in the workspace.
    #[schemars(with = "Option<i64>", range(min = 1))]
    pub files_changed: Option<Spanned<i64>>,
    /// Approval requests (human attention).
    #[schemars(with = "Option<i64>", range(min = 1))]
    pub approvals: Option<Spanned<i64>>,
}

/// `[[verify]]`: a command whose exit status is evidence.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "Verifier")]
pub(super) struct RawVerifier {
    /// Unique among verifiers: lowercase letters, digits, "_" and "-", 1 to 64 characters.
    #[schemars(with = "String", regex(pattern = r"^[a-z0-9_-]{1,64}$"))]
    pub name: Spanned<String>,
    /// When the verifier runs: "step" after each changing step, "phase" when a phase claims to
    /// be done, "acceptance" before the run may complete.
    #[schemars(with = "Tier")]
    pub tier: Spanned<Tier>,
    /// The shell command; exit status 0 means it passed. Or a built-in check:
    /// "keel:secret-scan" (the run's changes add no known secret value and no credential).
    #[schemars(with = "String", length(min = 1))]
    pub run: Spanned<String>,
    /// How long it may run, e.g. "10m" (the default).
    #[schemars(with = "Option<String>", extend("default" = "10m"))]
    pub timeout: Option<Spanned<String>>,
}

/// What a phase does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
#[schemars(rename = "PhaseKind")]
pub(super) enum RawPhaseKind {
    /// Fixed shell commands.
    Command,
    /// A driver chooses the actions.
    Agent,
    /// An explicit human gate (not supported yet).
    Approval,
}

/// What undoing an effect takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
#[schemars(rename = "Reversibility")]
pub(super) enum RawReversibility {
    /// Changes nothing.
    ReadOnly,
    /// Changes only the workspace: undone by going back to a checkpoint.
    Reversible,
    /// Has a compensation that undoes it.
    Compensatable,
    /// Cannot be undone.
    Irreversible,
}

/// `[[phase]]`: a bounded segment of the run. Phases run in order.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "Phase")]
pub(super) struct RawPhase {
    /// Unique among phases: lowercase letters, digits, "_" and "-", 1 to 64 characters.
    #[schemars(with = "String", regex(pattern = r"^[a-z0-9_-]{1,64}$"))]
    pub name: Spanned<String>,
    /// What the phase does: "command" (fixed commands) or "agent" (a driver chooses).
    #[schemars(with = "RawPhaseKind")]
    pub kind: Spanned<RawPhaseKind>,
    /// Command phases: the shell commands to run, in order. Required, not empty.
    #[schemars(with = "Option<Vec<String>>", length(min = 1))]
    pub run: Option<Spanned<Vec<Spanned<String>>>>,
    /// How long each command (command phases) or each `run` tool call (agent phases) may run,
    /// e.g. "10m" (the default).
    #[schemars(with = "Option<String>", extend("default" = "10m"))]
    pub timeout: Option<Spanned<String>>,
    /// Verifier names that must pass before the phase is done. Default: every verifier with
    /// tier = "phase".
    #[schemars(with = "Option<Vec<String>>")]
    pub done_when: Option<Vec<Spanned<String>>>,
    /// Agent phases: what the driver must achieve in this phase. Required for agent phases.
    #[schemars(with = "Option<String>")]
    pub objective: Option<Spanned<String>>,
    /// Agent phases: the tools the driver may use: built-in ones, contract tools, and tools of
    /// declared MCP servers as "server.tool" (one) or "server.*" (all of them). Default: all of
    /// read, list, search, write, patch, run, plan, note, finish, blocked.
    #[schemars(with = "Option<Vec<String>>")]
    pub tools: Option<Spanned<Vec<Spanned<String>>>>,
    /// Ask a person before the phase runs: the run waits, with the phase's exact commands (or
    /// objective) and the diff so far, until someone approves or rejects that payload.
    #[schemars(with = "Option<bool>")]
    pub approval: Option<Spanned<bool>>,
    /// What undoing the phase's effects takes. Command phases are `reversible` (inside the
    /// workspace, undone by a checkpoint); other classes are not supported yet.
    #[schemars(with = "Option<RawReversibility>")]
    pub reversibility: Option<Spanned<RawReversibility>>,
    /// A command that undoes the phase's effects (not supported yet).
    #[schemars(with = "Option<String>")]
    pub compensate: Option<Spanned<String>>,
    /// Names of secrets the phase's commands see as environment variables (resolved from the
    /// environment or the secrets file when the command runs).
    #[schemars(with = "Option<Vec<String>>")]
    pub secrets: Option<Spanned<Vec<String>>>,
}

/// A contract-defined tool an agent phase may list in `tools`: a command run without a shell,
/// its argv filled from JSON-schema'd arguments.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "Tool")]
pub(super) struct RawTool {
    /// The name an agent phase lists in `tools` (letters, digits, `_` and `-`).
    #[schemars(with = "String")]
    pub name: Spanned<String>,
    /// What the tool does, for the driver. Required.
    #[schemars(with = "Option<String>")]
    pub description: Option<Spanned<String>>,
    /// The argv to run (no shell); "{param}" in an element is replaced by that argument, and
    /// "{idempotency_key}" by the call's key when `idempotency_key = "arg"`.
    #[schemars(with = "Vec<String>", length(min = 1))]
    pub run: Spanned<Vec<Spanned<String>>>,
    /// The arguments: a table of name = { type = "string" | "integer" | "number" | "boolean",
    /// description = "...", optional = true }. Every argument is required unless optional.
    #[schemars(with = "Option<serde_json::Map<String, serde_json::Value>>")]
    pub parameters: Option<Spanned<toml::Table>>,
    /// Names of secrets the command sees as environment variables.
    #[schemars(with = "Option<Vec<String>>")]
    pub secrets: Option<Spanned<Vec<Spanned<String>>>>,
    /// What undoing a call takes. Default "irreversible".
    #[schemars(with = "Option<RawReversibility>")]
    pub reversibility: Option<Spanned<RawReversibility>>,
    /// How the call's idempotency key reaches the command: "env:NAME" (an environment
    /// variable) or "arg" (the "{idempotency_key}" placeholder in `run`). A tool with a key is
    /// retried with the same key after a crash; one without is never re-run blindly.
    #[schemars(with = "Option<String>")]
    pub idempotency_key: Option<Spanned<String>>,
    /// Ask a person before each call.
    #[schemars(with = "Option<bool>")]
    pub approval: Option<Spanned<bool>>,
    /// The argv that undoes a call (same placeholders as `run`); required for
    /// reversibility = "compensatable".
    #[schemars(with = "Option<Vec<String>>")]
    pub compensate: Option<Spanned<Vec<Spanned<String>>>>,
    /// How long a call may run, e.g. "2m". Default: the phase's timeout.
    #[schemars(with = "Option<String>")]
    pub timeout: Option<Spanned<String>>,
    /// Whether the command may use the network (default: `[scope] network`).
    #[schemars(with = "Option<bool>")]
    pub network: Option<Spanned<bool>>,
}

/// An amount of dollars written as a TOML integer or float.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Dollars(pub f64);

impl<'de> Deserialize<'de> for Dollars {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct DollarsVisitor;

        impl Visitor<'_> for DollarsVisitor {
            type Value = Dollars;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a number of dollars like 5 or 2.5")
            }

            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Dollars, E> {
                Ok(Dollars(v as f64))
            }

            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Dollars, E> {
                Ok(Dollars(v as f64))
            }

            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Dollars, E> {
                Ok(Dollars(v))
            }
        }

        deserializer.deserialize_any(DollarsVisitor)
    }
}
