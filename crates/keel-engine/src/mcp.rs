//! MCP servers declared in the contract (`[[mcp]]`) as agent tools.
//!
//! Every server is connected when the engine is made (a stdio server is started in the
//! workspace with a bare environment; an HTTP one is reached at its URL) and its tools are
//! listed once. A server's tool is the agent tool `server.tool`; a phase lists it by that name
//! or all of the server's tools as `server.*` ([`McpTools::expand`]). Its class is the one the
//! contract gives (`read_only` for the tools it lists so, else the server's `reversibility`,
//! irreversible by default): the server's own annotations are never trusted to lower it.
//!
//! Model APIs accept only `^[a-zA-Z0-9_-]{1,64}$` as tool names, so `server.tool` travels to
//! them as [`wire_name`] and comes back through [`from_wire_name`] ([`wire_specs`] and
//! [`unwire_calls`] do both for a whole request and reply).

use std::path::Path;
use std::time::Duration;

use keel_core::agent::{ModelReply, Reversibility, ToolSpec};
use keel_core::contract::{Contract, McpServer, McpSource};
use keel_core::errorfp::error_fingerprint;
use keel_mcp::{CallOutcome, McpClient, McpError, McpTool, ServerSpec};

/// How long connecting to one server (start, handshake, tool listing) may take.
pub(crate) const CONNECT_TIMEOUT: Duration = Duration::from_secs(20);
/// What a stdio server inherits from keel's environment besides the variables its `env` names.
const INHERITED_ENV: [&str; 3] = ["PATH", "HOME", "LANG"];
/// How much of a call's result the driver reads; the whole result is kept as an artifact.
const OBSERVATION_BYTES: usize = 6000;

/// Resolves secret names to `(name, value)` environment variables, or says why not.
pub(crate) type SecretEnv<'a> = &'a dyn Fn(&[String]) -> Result<Vec<(String, String)>, String>;

/// One connected server.
#[derive(Debug)]
struct Server {
    config: McpServer,
    client: McpClient,
}

/// The contract's MCP servers, connected. Dropping it stops the stdio servers.
#[derive(Debug, Default)]
pub(crate) struct McpTools {
    servers: Vec<Server>,
}

/// What came of one call, for the agent step to record.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct McpMade {
    /// The tool answered and did not flag an error.
    pub ok: bool,
    /// What the driver reads: the result's text, cut to a few KB.
    pub observation: String,
    /// The whole result (text, and the structured content when there is some).
    pub full: Vec<u8>,
    /// The error fingerprint of a failed call.
    pub error: Option<String>,
    /// The call may or may not have reached the tool: it timed out, or the connection broke
    /// while it was under way. Its effect is then unknown rather than failed.
    pub uncertain: bool,
}

impl McpTools {
    /// Connects every server `contract` declares, each within [`CONNECT_TIMEOUT`]: a stdio
    /// server is started in `workspace` with PATH, HOME and LANG, the variables its `env`
    /// names (those set in keel's environment) and its secrets (`secret_env` resolves them);
    /// an HTTP server is reached at its URL. The error names the server. A contract without
    /// servers gives an empty set and starts nothing.
    pub(crate) fn connect(
        contract: &Contract,
        workspace: &Path,
        secret_env: SecretEnv<'_>,
    ) -> Result<McpTools, String> {
        let mut servers = Vec::with_capacity(contract.mcp.len());
        for config in &contract.mcp {
            let spec = match &config.source {
                McpSource::Stdio { command, env } => {
                    let mut vars: Vec<(String, String)> = Vec::new();
                    for name in INHERITED_ENV
                        .iter()
                        .copied()
                        .chain(env.iter().map(String::as_str))
                    {
                        if let Ok(value) = std::env::var(name)
                            && !vars.iter().any(|(k, _)| k == name)
                        {
                            vars.push((name.to_string(), value));
                        }
                    }
                    let secrets = secret_env(&config.secrets)
                        .map_err(|e| format!("MCP server `{}`: {e}", config.name))?;
                    for (name, value) in secrets {
                        vars.retain(|(k, _)| *k != name);
                        vars.push((name, value));
                    }
                    ServerSpec::Stdio {
                        command: command.clone(),
                        env: vars,
                        cwd: workspace.to_path_buf(),
                    }
                }
                McpSource::Http { url } => ServerSpec::Http { url: url.clone() },
            };
            let client = McpClient::connect(&config.name, &spec, CONNECT_TIMEOUT)
                .map_err(|e| connect_error(&config.name, &e))?;
            servers.push(Server {
                config: config.clone(),
                client,
            });
        }
        Ok(McpTools { servers })
    }

    /// Whether no server is connected.
    #[allow(dead_code)] // for the engine's hooks and the tests
    pub(crate) fn is_empty(&self) -> bool {
        self.servers.is_empty()
    }

    fn server(&self, name: &str) -> Option<&Server> {
        self.servers.iter().find(|s| s.config.name == name)
    }

    /// The server and the tool `server.tool` names, if the server offers it.
    fn lookup(&self, qualified: &str) -> Option<(&Server, &McpTool)> {
        let (server, tool) = keel_mcp::split_qualified(qualified)?;
        let server = self.server(server)?;
        let tool = server.client.tools().iter().find(|t| t.name == tool)?;
        Some((server, tool))
    }

    /// The agent tool `server.tool` as a driver sees it: its description prefixed with
    /// `[server] `, its input schema as parameters, its class from the contract.
    pub(crate) fn spec(&self, qualified: &str) -> Option<ToolSpec> {
        let (server, tool) = self.lookup(qualified)?;
        let parameters = if tool.input_schema.is_object() {
            tool.input_schema.clone()
        } else {
            serde_json::json!({"type": "object"})
        };
        Some(ToolSpec {
            name: qualified.to_string(),
            description: format!("[{}] {}", server.config.name, tool.description)
                .trim_end()
                .to_string(),
            parameters,
            reversibility: server.config.class_of(&tool.name),
        })
    }

    /// A phase's tool list with every `server.*` replaced by all of that server's tools
    /// (qualified, in the server's order); other names (built-in tools, contract tools,
    /// `server.tool`) pass through unchanged. A name that comes twice is kept once.
    pub(crate) fn expand(&self, phase_tools: &[String]) -> Vec<String> {
        let mut out: Vec<String> = Vec::with_capacity(phase_tools.len());
        let mut push = |name: String| {
            if !out.contains(&name) {
                out.push(name);
            }
        };
        for name in phase_tools {
            match name
                .strip_suffix(".*")
                .and_then(|server| self.server(server))
            {
                Some(server) => {
                    for tool in server.client.tools() {
                        push(keel_mcp::qualified(&server.config.name, &tool.name));
                    }
                }
                None => push(name.clone()),
            }
        }
        out
    }

    /// The names a phase lists as `server.tool` that their server does not offer, each with
    /// what to write instead. (`server.*` of a connected server never is.)
    #[allow(dead_code)] // for the engine's hooks and the tests
    pub(crate) fn missing(&self, phase_tools: &[String]) -> Vec<String> {
        phase_tools
            .iter()
            .filter(|name| !name.ends_with(".*"))
            .filter_map(|name| {
                let (server, _) = keel_mcp::split_qualified(name)?;
                if self.lookup(name).is_some() {
                    return None;
                }
                Some(match self.server(server) {
                    Some(s) => format!(
                        "MCP server `{server}` has no tool `{name}`; its tools are {}",
                        tool_list(s)
                    ),
                    None => format!("there is no MCP server `{server}` (listed as `{name}`)"),
                })
            })
            .collect()
    }

    /// The class of a call of `server.tool`: `read_only` when the contract lists the tool so,
    /// else the server's class. `None` when no server offers that tool.
    pub(crate) fn class(&self, qualified: &str) -> Option<Reversibility> {
        self.lookup(qualified)
            .map(|(server, tool)| server.config.class_of(&tool.name))
    }

    /// Whether every call of `server.tool` needs a person's approval (the server says
    /// `approval = true`).
    pub(crate) fn needs_approval(&self, qualified: &str) -> bool {
        keel_mcp::split_qualified(qualified)
            .and_then(|(server, _)| self.server(server))
            .is_some_and(|s| s.config.approval)
    }

    /// The contract's timeout of one call of `server.tool`, in milliseconds.
    pub(crate) fn timeout_ms(&self, qualified: &str) -> Option<u64> {
        keel_mcp::split_qualified(qualified)
            .and_then(|(server, _)| self.server(server))
            .map(|s| s.config.timeout_ms)
    }

    /// What a call attempts, for the effect ledger and an approval request: the server, how it
    /// is reached, the tool and its arguments.
    pub(crate) fn describe_call(&self, qualified: &str, arguments: &str) -> String {
        match keel_mcp::split_qualified(qualified)
            .and_then(|(server, tool)| self.server(server).map(|s| (s, tool)))
        {
            Some((server, tool)) => {
                let via = match &server.config.source {
                    McpSource::Stdio { command, .. } => {
                        format!("command `{}`", crate::agent::shell_words(command))
                    }
                    McpSource::Http { url } => format!("URL {url}"),
                };
                format!(
                    "MCP server `{}` ({via}): tool `{tool}` with {arguments}",
                    server.config.name
                )
            }
            None => format!("{qualified} {arguments}"),
        }
    }

    /// Calls `server.tool` with `args` (a JSON object), waiting at most `timeout_override` or
    /// else the server's timeout. A tool error is an `Ok` outcome with `is_error` set; `Err`
    /// says (naming server and tool) why the call did not give a result.
    #[allow(dead_code)] // for the engine's hooks and the tests; `make` is what agent steps use
    pub(crate) fn call(
        &self,
        qualified: &str,
        args: &serde_json::Value,
        timeout_override: Option<Duration>,
    ) -> Result<CallOutcome, String> {
        self.call_inner(qualified, args, timeout_override)
            .map_err(|(message, _)| message)
    }

    /// [`McpTools::call`], and whether a failure leaves the call's effect unknown.
    fn call_inner(
        &self,
        qualified: &str,
        args: &serde_json::Value,
        timeout_override: Option<Duration>,
    ) -> Result<CallOutcome, (String, bool)> {
        let Some((server_name, tool)) = keel_mcp::split_qualified(qualified) else {
            return Err((
                format!("`{qualified}` is not an MCP tool name; write it as `server.tool`"),
                false,
            ));
        };
        let Some(server) = self.server(server_name) else {
            return Err((
                format!(
                    "there is no MCP server `{server_name}` for tool `{qualified}`; the servers are {}",
                    if self.servers.is_empty() {
                        "none".to_string()
                    } else {
                        self.servers
                            .iter()
                            .map(|s| s.config.name.as_str())
                            .collect::<Vec<_>>()
                            .join(", ")
                    }
                ),
                false,
            ));
        };
        let serde_json::Value::Object(arguments) = args else {
            return Err((
                format!(
                    "the arguments of tool `{tool}` of MCP server `{server_name}` must be a JSON \
                     object, not {args}"
                ),
                false,
            ));
        };
        let timeout =
            timeout_override.unwrap_or(Duration::from_millis(server.config.timeout_ms.max(1)));
        server
            .client
            .call(tool, arguments.clone(), timeout)
            .map_err(|e| {
                let uncertain = matches!(e, McpError::CallTimeout { .. } | McpError::Call { .. });
                let text = e.to_string();
                let text = if text.contains(&format!("`{tool}`")) {
                    text
                } else {
                    format!("calling tool `{tool}` of MCP server `{server_name}`: {text}")
                };
                (text, uncertain)
            })
    }

    /// Makes one call for an agent step: the observation the driver reads, the whole result,
    /// an error fingerprint when it failed, and whether its effect is unknown.
    pub(crate) fn make(
        &self,
        qualified: &str,
        args: &serde_json::Value,
        timeout: Duration,
    ) -> McpMade {
        match self.call_inner(qualified, args, Some(timeout)) {
            Ok(outcome) => {
                let mut full = outcome.text.clone();
                if let Some(structured) = &outcome.structured
                    && outcome.text.trim().is_empty()
                {
                    full = structured.to_string();
                }
                let observation = if outcome.is_error {
                    format!("the tool reported an error:\n{}", cut_tail(&full))
                } else if full.trim().is_empty() {
                    "(the tool returned no text)".to_string()
                } else {
                    cut_tail(&full)
                };
                let error = outcome.is_error.then(|| {
                    error_fingerprint(&format!("tool {qualified}"), "tool error", &full).0
                });
                McpMade {
                    ok: !outcome.is_error,
                    observation,
                    full: full.into_bytes(),
                    error,
                    uncertain: false,
                }
            }
            Err((message, uncertain)) => McpMade {
                ok: false,
                error: Some(
                    error_fingerprint(&format!("tool {qualified}"), "call failed", &message).0,
                ),
                full: message.clone().into_bytes(),
                observation: message,
                uncertain,
            },
        }
    }
}

fn connect_error(server: &str, e: &McpError) -> String {
    let text = e.to_string();
    if text.contains(&format!("`{server}`")) {
        text
    } else {
        format!("MCP server `{server}`: {text}")
    }
}

#[allow(dead_code)] // used by `missing`
fn tool_list(server: &Server) -> String {
    let names: Vec<String> = server
        .client
        .tools()
        .iter()
        .map(|t| keel_mcp::qualified(&server.config.name, &t.name))
        .collect();
    if names.is_empty() {
        "none".to_string()
    } else {
        names.join(", ")
    }
}

/// The last [`OBSERVATION_BYTES`] of `text` (at a character boundary), marked when cut.
fn cut_tail(text: &str) -> String {
    if text.len() <= OBSERVATION_BYTES {
        return text.to_string();
    }
    let mut start = text.len() - OBSERVATION_BYTES;
    while !text.is_char_boundary(start) {
        start += 1;
    }
    format!(
        "[… {start} bytes cut; the whole result is kept]\n{}",
        &text[start..]
    )
}

/// The longest tool name model APIs accept.
const WIRE_MAX: usize = 64;

/// The name `server.tool` is sent to a model API under (`^[a-zA-Z0-9_-]{1,64}$`):
/// `server__tool`. A name that is already valid there (a built-in or contract tool) is
/// unchanged. When the tool's name has other characters, or the result is too long, they
/// become `_` and the name ends with `_` and 8 hex digits of the qualified name's hash (cut to
/// 64 characters), so different tools keep different names.
pub fn wire_name(qualified: &str) -> String {
    if is_wire_safe(qualified) {
        return qualified.to_string();
    }
    let plain: String = match keel_mcp::split_qualified(qualified) {
        Some((server, tool)) => format!("{server}__{tool}"),
        None => qualified.to_string(),
    };
    if is_wire_safe(&plain) {
        return plain;
    }
    let sanitized: String = plain
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect();
    let hash = blake3::hash(qualified.as_bytes()).to_hex();
    let suffix = format!("_{}", &hash.as_str()[..8]);
    let keep = WIRE_MAX - suffix.len();
    let head: String = sanitized.chars().take(keep).collect();
    format!("{head}{suffix}")
}

fn is_wire_safe(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= WIRE_MAX
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// The tool among `names` (keel's names: built-in, contract, `server.tool`) that a model
/// called `wire`: `wire` itself when it is one of them, else the one whose [`wire_name`] it
/// is. `None` when none matches (the call then stays unknown and is refused as such).
pub fn from_wire_name<'a>(wire: &str, names: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    let mut by_wire = None;
    for name in names {
        if name == wire {
            return Some(name);
        }
        if by_wire.is_none() && wire_name(name) == wire {
            by_wire = Some(name);
        }
    }
    by_wire
}

/// `specs` with their names as model APIs accept them ([`wire_name`]).
pub fn wire_specs(specs: &[ToolSpec]) -> Vec<ToolSpec> {
    specs
        .iter()
        .map(|s| ToolSpec {
            name: wire_name(&s.name),
            ..s.clone()
        })
        .collect()
}

/// Puts keel's names back on a reply's calls ([`from_wire_name`] over `specs`); a name that
/// matches none is left as it is.
pub fn unwire_calls(reply: &mut ModelReply, specs: &[ToolSpec]) {
    for call in &mut reply.calls {
        if let Some(name) = from_wire_name(&call.name, specs.iter().map(|s| s.name.as_str())) {
            call.name = name.to_string();
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use keel_core::agent::ToolCall;
    use serde_json::json;

    use super::*;

    /// The MCP fixture server's binary (see `keel_test_support::mcp::fixture_binary`).
    fn fixture_bin() -> std::path::PathBuf {
        keel_test_support::mcp::fixture_binary().unwrap()
    }

    /// A contract whose agent phase lists `fixture.*` when `mcp` declares a server `fixture`.
    fn contract(mcp: &str) -> Contract {
        let tools = if mcp.contains("name = \"fixture\"") {
            r#"["read", "finish", "fixture.*"]"#
        } else {
            r#"["read", "finish"]"#
        };
        let source = format!(
            r#"[task]
goal = "g"

[driver]
kind = "script"
script = "s.jsonl"

[[verify]]
name = "t"
tier = "acceptance"
run = "true"

[[phase]]
name = "work"
kind = "agent"
objective = "o"
tools = {tools}

{mcp}
"#
        );
        Contract::parse("keel.toml", &source).unwrap_or_else(|e| panic!("{e}\n{source}"))
    }

    /// The stdio fixture, its `record` appending to `log`. keel passes a server only PATH, HOME,
    /// LANG and what the contract names, and a test cannot set its own environment (that needs
    /// `unsafe`), so the log reaches the server through `env` (the program) here; the CLI test
    /// passes it through the contract's `env` list.
    fn stdio_contract(log: &Path, extra: &str) -> Contract {
        contract(&format!(
            "[[mcp]]\nname = \"fixture\"\ncommand = [\"env\", {:?}, {:?}]\n{extra}",
            format!("KEEL_MCP_FIXTURE_LOG={}", log.display()),
            fixture_bin().display().to_string()
        ))
    }

    fn no_secrets(names: &[String]) -> Result<Vec<(String, String)>, String> {
        assert!(names.is_empty(), "{names:?}");
        Ok(Vec::new())
    }

    fn lines(path: &Path) -> usize {
        std::fs::read_to_string(path)
            .map(|t| t.lines().count())
            .unwrap_or(0)
    }

    #[test]
    fn an_empty_contract_starts_nothing() {
        let c = contract("");
        let dir = tempfile::tempdir().unwrap();
        let tools = McpTools::connect(&c, dir.path(), &no_secrets).unwrap();
        assert!(tools.is_empty());
        let phase = vec!["read".to_string(), "finish".to_string()];
        assert_eq!(tools.expand(&phase), phase);
        assert_eq!(tools.spec("fixture.echo"), None);
        assert_eq!(tools.class("fixture.echo"), None);
        assert!(!tools.needs_approval("fixture.echo"));
        let err = tools
            .call("fixture.echo", &json!({"text": "x"}), None)
            .unwrap_err();
        assert!(err.contains("no MCP server `fixture`"), "{err}");
    }

    #[test]
    fn stdio_server_tools_are_expanded_classed_and_called() {
        let dir = tempfile::tempdir().unwrap();
        let log = &dir.path().join("record.log");
        let c = stdio_contract(log, "read_only = [\"echo\", \"add\"]\ntimeout = \"30s\"");
        let tools = McpTools::connect(&c, dir.path(), &no_secrets).unwrap();
        assert!(!tools.is_empty());

        let phase: Vec<String> = ["read", "fixture.*", "finish", "fixture.echo"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let expanded = tools.expand(&phase);
        assert_eq!(expanded[0], "read");
        for name in [
            "fixture.echo",
            "fixture.add",
            "fixture.record",
            "fixture.fail",
        ] {
            assert!(expanded.contains(&name.to_string()), "{expanded:?}");
        }
        assert_eq!(
            expanded.iter().filter(|n| *n == "fixture.echo").count(),
            1,
            "listed once: {expanded:?}"
        );
        assert!(expanded.contains(&"finish".to_string()));
        assert!(!expanded.iter().any(|n| n.ends_with(".*")), "{expanded:?}");
        assert!(tools.missing(&phase).is_empty());
        let missing = tools.missing(&["fixture.nope".to_string()]);
        assert_eq!(missing.len(), 1);
        assert!(
            missing[0].contains("has no tool `fixture.nope`")
                && missing[0].contains("fixture.echo"),
            "{missing:?}"
        );

        let echo = tools.spec("fixture.echo").unwrap();
        assert_eq!(echo.name, "fixture.echo");
        assert_eq!(
            echo.description,
            "[fixture] Return the given text unchanged."
        );
        assert_eq!(echo.parameters["required"], json!(["text"]));
        assert_eq!(echo.reversibility, Reversibility::ReadOnly);
        assert_eq!(tools.spec("fixture.nope"), None);
        assert_eq!(tools.spec("echo"), None);

        assert_eq!(tools.class("fixture.echo"), Some(Reversibility::ReadOnly));
        assert_eq!(tools.class("fixture.add"), Some(Reversibility::ReadOnly));
        // `record` and `fail` are not listed: the server's default, whatever they annotate.
        assert_eq!(
            tools.class("fixture.record"),
            Some(Reversibility::Irreversible)
        );
        assert_eq!(
            tools.class("fixture.fail"),
            Some(Reversibility::Irreversible)
        );
        assert_eq!(tools.class("fixture.nope"), None);
        assert!(!tools.needs_approval("fixture.record"));
        assert_eq!(tools.timeout_ms("fixture.record"), Some(30_000));

        let out = tools
            .call("fixture.echo", &json!({"text": "héllo"}), None)
            .unwrap();
        assert_eq!(out.text, "héllo");
        assert!(!out.is_error);

        let before = lines(log);
        let made = tools.make(
            "fixture.record",
            &json!({"entry": "one"}),
            Duration::from_secs(30),
        );
        assert!(made.ok, "{made:?}");
        assert!(made.observation.starts_with("recorded"), "{made:?}");
        assert_eq!(lines(log), before + 1, "record appends one line");
        let text = std::fs::read_to_string(log).unwrap();
        assert_eq!(text.lines().last(), Some("one"));

        let made = tools.make("fixture.fail", &json!({}), Duration::from_secs(30));
        assert!(!made.ok && !made.uncertain, "{made:?}");
        assert!(made.observation.contains("always fails"), "{made:?}");
        assert!(made.error.is_some());

        let err = tools
            .call("fixture.echo", &json!(["not", "an", "object"]), None)
            .unwrap_err();
        assert!(
            err.contains("`echo`") && err.contains("`fixture`") && err.contains("JSON object"),
            "{err}"
        );
        let err = tools.call("fixture.nope", &json!({}), None).unwrap_err();
        assert!(err.contains("nope") && err.contains("fixture"), "{err}");

        // A call that outlives its timeout leaves its effect unknown.
        let made = tools.make(
            "fixture.sleep",
            &json!({"ms": 60_000}),
            Duration::from_millis(200),
        );
        assert!(!made.ok && made.uncertain, "{made:?}");
        assert!(
            made.observation.contains("sleep") && made.observation.contains("fixture"),
            "{made:?}"
        );

        let payload = tools.describe_call("fixture.record", r#"{"entry":"one"}"#);
        assert!(
            payload.contains("MCP server `fixture`")
                && payload.contains("keel-mcp-fixture")
                && payload.contains("tool `record`"),
            "{payload}"
        );
    }

    #[test]
    fn server_settings_apply_to_all_its_tools() {
        let dir = tempfile::tempdir().unwrap();
        let c = stdio_contract(
            &dir.path().join("log"),
            "reversibility = \"reversible\"\napproval = true",
        );
        let tools = McpTools::connect(&c, dir.path(), &no_secrets).unwrap();
        // The server says `echo` is read-only; the contract does not, so it is not.
        assert_eq!(tools.class("fixture.echo"), Some(Reversibility::Reversible));
        assert_eq!(
            tools.spec("fixture.record").unwrap().reversibility,
            Reversibility::Reversible
        );
        assert!(tools.needs_approval("fixture.echo"));
        assert!(tools.needs_approval("fixture.record"));
        assert!(!tools.needs_approval("other.record"));
        assert_eq!(
            tools.timeout_ms("fixture.echo"),
            Some(keel_core::contract::DEFAULT_MCP_TIMEOUT_MS)
        );
    }

    #[test]
    fn secrets_reach_a_stdio_server_and_their_errors_name_it() {
        // The log path is the secret: `record` writes where the secret's value says.
        let c = contract(&format!(
            "[[mcp]]\nname = \"fixture\"\ncommand = [{:?}]\nsecrets = [\"KEEL_MCP_FIXTURE_LOG\"]",
            fixture_bin().display().to_string()
        ));
        assert_eq!(c.secret_names(), ["KEEL_MCP_FIXTURE_LOG"]);
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("secret.log");
        let asked = std::cell::RefCell::new(Vec::new());
        let tools = McpTools::connect(&c, dir.path(), &|names: &[String]| {
            asked.borrow_mut().extend(names.iter().cloned());
            Ok(vec![(
                "KEEL_MCP_FIXTURE_LOG".into(),
                log.display().to_string(),
            )])
        })
        .unwrap();
        assert_eq!(*asked.borrow(), ["KEEL_MCP_FIXTURE_LOG"]);
        let made = tools.make(
            "fixture.record",
            &json!({"entry": "via secret"}),
            Duration::from_secs(30),
        );
        assert!(made.ok, "{made:?}");
        assert_eq!(std::fs::read_to_string(&log).unwrap(), "via secret\n");

        let err = McpTools::connect(&c, dir.path(), &|_: &[String]| {
            Err("secret KEEL_MCP_FIXTURE_LOG is not set".to_string())
        })
        .unwrap_err();
        assert!(
            err.contains("MCP server `fixture`") && err.contains("KEEL_MCP_FIXTURE_LOG"),
            "{err}"
        );
    }

    #[test]
    fn only_path_home_lang_and_named_variables_reach_a_stdio_server() {
        // A server that fails its handshake printing its environment shows what it got.
        let c = contract(
            "[[mcp]]\nname = \"envdump\"\ncommand = [\"sh\", \"-c\", \"env >&2; exit 3\"]\nenv = [\"CARGO_PKG_NAME\", \"KEEL_NOT_SET_ANYWHERE\"]",
        );
        let dir = tempfile::tempdir().unwrap();
        let err = McpTools::connect(&c, dir.path(), &no_secrets).unwrap_err();
        assert!(err.contains("`envdump`"), "{err}");
        assert!(err.contains("PATH="), "{err}");
        // Set for test binaries by cargo, so present only because the contract names it.
        if std::env::var("CARGO_PKG_NAME").is_ok() {
            assert!(err.contains("CARGO_PKG_NAME=keel-engine"), "{err}");
        }
        assert!(!err.contains("CARGO_MANIFEST_DIR"), "not inherited: {err}");
        assert!(!err.contains("KEEL_NOT_SET_ANYWHERE"), "{err}");
    }

    #[test]
    fn a_server_that_cannot_start_is_an_error_naming_it() {
        let c = contract("[[mcp]]\nname = \"broken\"\ncommand = [\"/nonexistent/keel-mcp-nope\"]");
        let dir = tempfile::tempdir().unwrap();
        let err = McpTools::connect(&c, dir.path(), &no_secrets).unwrap_err();
        assert!(err.contains("`broken`"), "{err}");
        assert!(err.contains("keel-mcp-nope"), "{err}");
    }

    #[test]
    fn http_server_tools_are_called() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("http.log");
        let server = keel_test_support::mcp::spawn_http(log.clone()).unwrap();
        let c = contract(&format!(
            "[[mcp]]\nname = \"fixture\"\nurl = \"{}\"\nread_only = [\"echo\"]",
            server.url()
        ));
        let tools = McpTools::connect(&c, dir.path(), &no_secrets).unwrap();
        let expanded = tools.expand(&["fixture.*".to_string()]);
        assert!(
            expanded.contains(&"fixture.record".to_string())
                && expanded.contains(&"fixture.echo".to_string()),
            "{expanded:?}"
        );
        assert_eq!(tools.class("fixture.echo"), Some(Reversibility::ReadOnly));
        assert_eq!(
            tools.class("fixture.record"),
            Some(Reversibility::Irreversible)
        );
        let made = tools.make(
            "fixture.record",
            &json!({"entry": "web"}),
            Duration::from_secs(30),
        );
        assert!(made.ok, "{made:?}");
        assert_eq!(std::fs::read_to_string(&log).unwrap(), "web\n");
        let made = tools.make(
            "fixture.add",
            &json!({"a": 1, "b": 2}),
            Duration::from_secs(30),
        );
        assert_eq!(made.observation, "3");
        assert!(
            tools
                .describe_call("fixture.add", "{}")
                .contains(server.url()),
            "the payload names the URL"
        );
        drop(tools);
        drop(server);
    }

    #[test]
    fn wire_names_fit_model_apis_and_come_back() {
        assert_eq!(wire_name("read"), "read");
        assert_eq!(wire_name("my_tool"), "my_tool");
        assert_eq!(wire_name("fixture.echo"), "fixture__echo");
        assert_eq!(wire_name("my-server.get_issue"), "my-server__get_issue");
        let odd = wire_name("fs.read.v2");
        assert!(is_wire_safe(&odd), "{odd}");
        assert!(odd.starts_with("fs__read_v2_"), "{odd}");
        assert_ne!(odd, wire_name("fs.read_v2"));
        let long = format!("{}.{}", "s".repeat(40), "t".repeat(40));
        let w = wire_name(&long);
        assert!(is_wire_safe(&w) && w.len() == WIRE_MAX, "{w}");
        assert_ne!(
            w,
            wire_name(&format!("{}.{}", "s".repeat(40), "u".repeat(40)))
        );

        let names = ["read", "finish", "fixture.echo", "fs.read.v2"];
        for name in names {
            assert_eq!(
                from_wire_name(&wire_name(name), names.iter().copied()),
                Some(name)
            );
            assert_eq!(from_wire_name(name, names.iter().copied()), Some(name));
        }
        assert_eq!(from_wire_name("nope", names.iter().copied()), None);

        let spec = |name: &str| ToolSpec {
            name: name.to_string(),
            description: String::new(),
            parameters: json!({"type": "object"}),
            reversibility: Reversibility::ReadOnly,
        };
        let specs = vec![spec("read"), spec("fixture.echo")];
        let wired: Vec<String> = wire_specs(&specs).into_iter().map(|s| s.name).collect();
        assert_eq!(wired, ["read", "fixture__echo"]);
        let call = |name: &str| ToolCall {
            id: "c".into(),
            name: name.into(),
            arguments: "{}".into(),
        };
        let mut reply = ModelReply {
            text: None,
            calls: vec![call("fixture__echo"), call("read"), call("other__x")],
            usage: Default::default(),
            stop_reason: None,
        };
        unwire_calls(&mut reply, &specs);
        let names: Vec<&str> = reply.calls.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["fixture.echo", "read", "other__x"]);
    }
}
