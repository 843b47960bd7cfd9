//! The task contract: the immutable TOML that says what a run must achieve and within which
//! limits.
//!
//! Parsing happens in two phases. `raw` holds serde types that mirror the TOML exactly (unknown
//! keys are errors) and carry the source spans of every value a later check may need to point
//! at. `validate` then turns them into a [`Contract`], which cannot be invalid: names are
//! unique, references resolve, durations and budgets are positive, globs are compiled. Every
//! problem becomes a [`Diagnostic`] with the file, line and column of the offending key or value
//! and one sentence saying what is wrong and how to fix it; validation reports all of them at
//! once.
//!
//! This module does no I/O: the caller reads the file and passes its name and contents.

mod diagnostic;
mod raw;
mod scope;
mod template;
mod validate;

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::budget::BudgetLimits;

pub use diagnostic::{ContractError, Diagnostic};
pub use scope::{HttpRule, Scope};
pub use template::TEMPLATE;

/// The lockfiles hashed into the environment fingerprint when `[workspace]` does not list its own.
pub const DEFAULT_LOCKFILES: [&str; 10] = [
    "Cargo.lock",
    "package-lock.json",
    "yarn.lock",
    "pnpm-lock.yaml",
    "poetry.lock",
    "uv.lock",
    "Pipfile.lock",
    "Gemfile.lock",
    "go.sum",
    "composer.lock",
];

/// The verifier `run = "keel:secret-scan"`: the run's diff against its base must add no known
/// secret value and no high-confidence credential pattern.
pub const SECRET_SCAN: &str = "keel:secret-scan";

/// The verifiers keel has built in, written as their `run`.
pub const BUILTIN_VERIFIERS: [&str; 1] = [SECRET_SCAN];

/// How long a verifier or a phase command may run when the contract does not say: 10 minutes.
pub const DEFAULT_TIMEOUT_MS: u64 = 10 * 60 * 1000;

/// A validated contract. Build one with [`Contract::parse`].
#[derive(Debug, Clone)]
pub struct Contract {
    /// The blake3 hash (lowercase hex) of the exact source bytes: the contract version.
    pub hash: String,
    /// The source text the contract was parsed from.
    pub source: String,
    pub task: Task,
    pub workspace: Workspace,
    /// `None` when the contract has no `[driver]` table.
    pub driver: Option<Driver>,
    pub scope: Scope,
    /// Absent budgets are unlimited.
    pub budget: BudgetLimits,
    /// In contract order.
    pub verifiers: Vec<Verifier>,
    /// In contract order; there is at least one.
    pub phases: Vec<Phase>,
    pub approvals: ApprovalPolicy,
    /// Contract-defined tools, in contract order.
    pub tools: Vec<ContractTool>,
    /// MCP servers whose tools agent phases may list, in contract order.
    pub mcp: Vec<McpServer>,
    pub sandbox: SandboxSettings,
}

impl Contract {
    /// Every secret name the contract mentions: the driver's `api_key = "secret:NAME"`, the
    /// phases', the tools' and the MCP servers' `secrets`. These are the values scrubbed from everything keel
    /// stores.
    pub fn secret_names(&self) -> Vec<String> {
        let mut names: Vec<String> = Vec::new();
        let driver = self
            .driver
            .as_ref()
            .and_then(|d| d.api_key.as_deref())
            .and_then(|k| k.strip_prefix("secret:"))
            .map(str::to_string);
        for name in driver
            .into_iter()
            .chain(self.phases.iter().flat_map(|p| p.secrets.iter().cloned()))
            .chain(self.tools.iter().flat_map(|t| t.secrets.iter().cloned()))
            .chain(self.mcp.iter().flat_map(|m| m.secrets.iter().cloned()))
        {
            if !names.contains(&name) {
                names.push(name);
            }
        }
        names
    }

    /// The contract-defined tool called `name`.
    pub fn tool(&self, name: &str) -> Option<&ContractTool> {
        self.tools.iter().find(|t| t.name == name)
    }

    /// The MCP server called `name`.
    pub fn mcp_server(&self, name: &str) -> Option<&McpServer> {
        self.mcp.iter().find(|m| m.name == name)
    }
}

/// How long one call of an MCP server's tool may take when the contract does not say: 2 minutes.
pub const DEFAULT_MCP_TIMEOUT_MS: u64 = 2 * 60 * 1000;

/// `[[mcp]]`: an MCP server whose tools agent phases may list as `server.tool` or `server.*`.
/// Its tools are known only when keel connects to it, at run time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct McpServer {
    /// `[A-Za-z0-9_-]`, 1 to 64 characters; unique; not a built-in tool's name.
    pub name: String,
    pub source: McpSource,
    /// Secrets a stdio server sees as environment variables.
    pub secrets: Vec<String>,
    /// The class of every call of its tools, except those listed in `read_only`.
    pub reversibility: crate::agent::Reversibility,
    /// Unqualified names of its tools that are read-only.
    pub read_only: Vec<String>,
    /// Every call of its tools waits for a person's approval.
    pub approval: bool,
    /// How long one call may take.
    pub timeout_ms: u64,
}

impl McpServer {
    /// The class of a call of its tool `tool` (unqualified): `read_only` when the contract lists
    /// it so, else the server's class. The server's own annotations are not trusted to lower it.
    pub fn class_of(&self, tool: &str) -> crate::agent::Reversibility {
        if self.read_only.iter().any(|t| t == tool) {
            crate::agent::Reversibility::ReadOnly
        } else {
            self.reversibility
        }
    }
}

/// How keel reaches an MCP server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum McpSource {
    /// A child process speaking MCP on stdin/stdout, started in the workspace.
    Stdio {
        /// The program and its arguments (no shell).
        command: Vec<String>,
        /// Names of environment variables passed from keel's environment.
        env: Vec<String>,
    },
    /// A streamable-HTTP endpoint (`http://` or `https://`).
    Http { url: String },
}

/// A contract-defined tool: a command run without a shell, its argv filled from arguments
/// checked against `parameters` (a JSON Schema object).
#[derive(Debug, Clone, PartialEq)]
pub struct ContractTool {
    pub name: String,
    pub description: String,
    /// argv templates: "{param}" and "{idempotency_key}" are filled per call.
    pub run: Vec<String>,
    pub parameters: serde_json::Value,
    pub secrets: Vec<String>,
    pub reversibility: crate::agent::Reversibility,
    pub idempotency_key: Option<KeyPassing>,
    pub approval: bool,
    pub compensate: Option<Vec<String>>,
    pub timeout_ms: Option<u64>,
    /// `Some` when the tool says; otherwise `[scope] network` applies.
    pub network: Option<bool>,
}

impl ContractTool {
    /// The tool as a driver sees it.
    pub fn spec(&self) -> crate::agent::ToolSpec {
        crate::agent::ToolSpec {
            name: self.name.clone(),
            description: self.description.clone(),
            parameters: self.parameters.clone(),
            reversibility: self.reversibility,
        }
    }

    /// `template` with every "{param}" replaced by the argument's value and "{idempotency_key}"
    /// by `key`. Arguments are whole argv elements or parts of one: no shell sees them.
    pub fn fill(template: &str, args: &serde_json::Value, key: &str) -> String {
        let mut out = String::with_capacity(template.len());
        let mut rest = template;
        while let Some(open) = rest.find('{') {
            out.push_str(&rest[..open]);
            let after = &rest[open + 1..];
            match after.find('}') {
                Some(close) if is_param_name(&after[..close]) => {
                    let name = &after[..close];
                    if name == "idempotency_key" {
                        out.push_str(key);
                    } else {
                        match args.get(name) {
                            Some(serde_json::Value::String(s)) => out.push_str(s),
                            Some(serde_json::Value::Null) | None => {}
                            Some(v) => out.push_str(&v.to_string()),
                        }
                    }
                    rest = &after[close + 1..];
                }
                _ => {
                    out.push('{');
                    rest = after;
                }
            }
        }
        out.push_str(rest);
        out
    }

    /// The argv of one call.
    pub fn argv(&self, args: &serde_json::Value, key: &str) -> Vec<String> {
        self.run.iter().map(|t| Self::fill(t, args, key)).collect()
    }

    /// The compensation argv of one call, if the tool has one.
    pub fn compensation(&self, args: &serde_json::Value, key: &str) -> Option<Vec<String>> {
        self.compensate
            .as_ref()
            .map(|c| c.iter().map(|t| Self::fill(t, args, key)).collect())
    }
}

/// The placeholders "{name}" of a template.
pub fn placeholders(template: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut rest = template;
    while let Some(open) = rest.find('{') {
        let after = &rest[open + 1..];
        match after.find('}') {
            Some(close) if is_param_name(&after[..close]) => {
                out.push(&after[..close]);
                rest = &after[close + 1..];
            }
            _ => rest = after,
        }
    }
    out
}

fn is_param_name(s: &str) -> bool {
    !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

/// How a contract tool's command receives its call's idempotency key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyPassing {
    /// In this environment variable.
    Env(String),
    /// Through the "{idempotency_key}" placeholder of `run`.
    Arg,
}

/// `[sandbox]`: how every command keel runs is confined.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SandboxSettings {
    /// `false` only by an explicit `mode = "off"`.
    pub enabled: bool,
    /// Extra writable directories ("~/" not yet expanded).
    pub writable: Vec<String>,
    /// Environment variable names passed through besides the built-in allow-list.
    pub env: Vec<String>,
    pub memory_bytes: u64,
    pub processes: u64,
    pub open_files: u64,
    pub cpu_ms: Option<u64>,
}

impl Default for SandboxSettings {
    fn default() -> Self {
        SandboxSettings {
            enabled: true,
            writable: Vec::new(),
            env: Vec::new(),
            memory_bytes: 8 << 30,
            processes: 512,
            open_files: 1024,
            cpu_ms: None,
        }
    }
}

/// `[approvals]`: how requests for a person are announced and how long they wait.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ApprovalPolicy {
    pub notify: Option<String>,
    pub expires_ms: Option<u64>,
    /// What an undecided request becomes at its deadline: `true` for blocked, `false` for
    /// rejected.
    pub block_on_expiry: bool,
    /// Tool calls of these classes wait for a person's approval.
    pub require: Vec<crate::agent::Reversibility>,
}

/// `[task]`: what the run must achieve.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Task {
    /// The goal, trimmed; never empty.
    pub goal: String,
    pub out_of_scope: Vec<String>,
}

/// `[workspace]`: where the run works and what belongs to its environment fingerprint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Workspace {
    /// As written (default `"."`), relative to the directory of the contract file unless absolute.
    /// Resolving it is the caller's job; this crate does no I/O.
    pub path: String,
    /// Shell commands whose output is part of the environment fingerprint.
    pub fingerprint: Vec<String>,
    /// Lockfiles (relative to the workspace) hashed into the fingerprint; [`DEFAULT_LOCKFILES`]
    /// unless the contract lists its own (an empty list means none).
    pub lockfiles: Vec<String>,
}

/// `[driver]`: the decision-maker behind agent phases.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Driver {
    pub kind: DriverKind,
    /// Required for `openai` and `anthropic`.
    pub model: Option<String>,
    /// An `http://` or `https://` URL.
    pub base_url: Option<String>,
    /// Always a secret reference, `secret:NAME`; never the key itself.
    pub api_key: Option<String>,
    /// Positive.
    pub context_tokens: Option<u64>,
    /// Present exactly when `kind` is `command`.
    pub command: Option<String>,
    /// Present exactly when `kind` is `script`.
    pub script: Option<String>,
    /// The most tokens one model reply may have.
    pub max_output_tokens: u64,
    /// How long one model call, or one run of a command driver, may take.
    pub timeout_ms: u64,
    /// How often a model call is retried on 429, 5xx and timeouts.
    pub max_retries: u32,
    /// The first wait before a retry; it doubles each time, with jitter.
    pub retry_backoff_ms: u64,
    /// Micro-dollars per million input and output tokens, when the contract gives a price.
    pub price: Option<(u64, u64)>,
}

impl Driver {
    /// The assembled prompt never exceeds this many tokens.
    pub fn context_budget(&self) -> u64 {
        self.context_tokens.unwrap_or(DEFAULT_CONTEXT_TOKENS)
    }
}

/// The prompt size when the contract does not say.
pub const DEFAULT_CONTEXT_TOKENS: u64 = 32_000;

/// Which driver decides the actions of agent phases.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum DriverKind {
    /// Chat Completions with tool calls on any OpenAI-compatible server.
    Openai,
    /// The Anthropic Messages API with tool use.
    Anthropic,
    /// A delegated program: keel writes the prompt to a file and runs `command`.
    Command,
    /// A recorded list of actions read from `script`.
    Script,
}

impl DriverKind {
    pub fn as_str(self) -> &'static str {
        match self {
            DriverKind::Openai => "openai",
            DriverKind::Anthropic => "anthropic",
            DriverKind::Command => "command",
            DriverKind::Script => "script",
        }
    }
}

impl fmt::Display for DriverKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// `[[verify]]`: a command whose exit status is evidence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verifier {
    /// Unique among verifiers; `[a-z0-9_-]`, 1 to 64 characters.
    pub name: String,
    pub tier: Tier,
    /// A shell command line; never empty.
    pub run: String,
    /// Positive; [`DEFAULT_TIMEOUT_MS`] unless the contract says otherwise.
    pub timeout_ms: u64,
}

/// When a verifier runs.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    Serialize,
    Deserialize,
    schemars::JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum Tier {
    /// Cheap; after every step that changed the workspace.
    Step,
    /// When a phase claims to be done, unless the phase names its own `done_when`.
    Phase,
    /// Before the run may complete; a run completes only when all of these pass.
    Acceptance,
}

impl Tier {
    pub fn as_str(self) -> &'static str {
        match self {
            Tier::Step => "step",
            Tier::Phase => "phase",
            Tier::Acceptance => "acceptance",
        }
    }
}

impl fmt::Display for Tier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// `[[phase]]`: a bounded segment of the run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Phase {
    /// Unique among phases; `[a-z0-9_-]`, 1 to 64 characters.
    pub name: String,
    pub kind: PhaseKind,
    /// The verifiers that must pass before the phase is done, in order: the phase's `done_when`
    /// if it has one (possibly empty), else every verifier with tier `phase`. Every name exists.
    pub gate: Vec<String>,
    /// A person approves the phase (its exact commands or objective, and the diff so far)
    /// before its first step runs.
    pub approval: bool,
    /// Secrets the phase's commands see as environment variables.
    pub secrets: Vec<String>,
}

/// What a phase does. Approval phases are refused with "not supported yet".
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PhaseKind {
    /// Fixed shell commands, run in order; each may take at most `timeout_ms`.
    Command { run: Vec<String>, timeout_ms: u64 },
    /// The driver chooses actions toward `objective`, using only `tools` (built-in names,
    /// contract tools, and MCP tools as `server.tool` or `server.*` for a declared server); a
    /// `run` call may take at most `timeout_ms` unless it asks for less.
    Agent {
        objective: String,
        tools: Vec<String>,
        timeout_ms: u64,
    },
}

impl Contract {
    /// Parses and validates a contract. `file` is used only to label diagnostics.
    pub fn parse(file: &str, source: &str) -> Result<Contract, ContractError> {
        validate::parse(file, source)
    }

    /// The verifier called `name`.
    pub fn verifier(&self, name: &str) -> Option<&Verifier> {
        self.verifiers.iter().find(|v| v.name == name)
    }

    /// The verifiers of one tier, in contract order.
    pub fn verifiers_of(&self, tier: Tier) -> impl Iterator<Item = &Verifier> {
        self.verifiers.iter().filter(move |v| v.tier == tier)
    }

    /// The phase called `name`.
    pub fn phase(&self, name: &str) -> Option<&Phase> {
        self.phases.iter().find(|p| p.name == name)
    }
}

/// The JSON Schema of the contract's TOML shape, pretty-printed and ending with a newline.
/// `schema/contract.schema.json` is this text; editors can use it for completion.
pub fn json_schema() -> String {
    let mut schema = schemars::generate::SchemaSettings::draft2020_12()
        .into_generator()
        .into_root_schema_for::<raw::RawContract>();
    without_null(&mut schema);
    // `{:#}` on a JSON value pretty-prints it and cannot fail, unlike `to_string_pretty`.
    format!("{:#}\n", schema.as_value())
}

/// TOML has no null: an optional key is simply left out. schemars describes `Option<T>` as
/// "T or null", so take the null back out, here and in every subschema.
fn without_null(schema: &mut schemars::Schema) {
    use serde_json::Value;

    let null = serde_json::json!({ "type": "null" });
    if let Some(object) = schema.as_object_mut() {
        if let Some(Value::Array(types)) = object.get_mut("type") {
            types.retain(|t| t != "null");
            if let [only] = types.as_slice() {
                let only = only.clone();
                object.insert("type".to_string(), only);
            }
        }
        let any_of_null = match object.get("anyOf") {
            Some(Value::Array(any)) if any.len() == 2 && any.contains(&null) => {
                any.iter().find(|s| **s != null).cloned()
            }
            _ => None,
        };
        if let Some(Value::Object(inner)) = any_of_null {
            object.remove("anyOf");
            for (key, value) in inner {
                object.entry(key).or_insert(value);
            }
        }
    }
    schemars::transform::transform_subschemas(&mut without_null, schema);
}
