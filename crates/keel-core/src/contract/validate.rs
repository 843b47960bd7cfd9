//! From [`RawContract`] to [`Contract`]: every check that serde cannot express, each problem
//! recorded with the span of the key or value at fault, all of them reported together.

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;

use globset::Glob;
use serde::Deserialize;
use toml::Spanned;

use super::diagnostic::{Diagnostics, reword_toml_error};
use super::raw::{
    Dollars, RawApprovals, RawBudget, RawContract, RawDriver, RawHttpRule, RawMcp, RawPhase,
    RawPhaseKind, RawReversibility, RawSandbox, RawScope, RawTask, RawTool, RawVerifier,
    RawWorkspace,
};
use super::scope::{HttpRule, Scope, command_glob, path_glob};
use super::{
    ApprovalPolicy, Contract, ContractError, ContractTool, DEFAULT_LOCKFILES,
    DEFAULT_MCP_TIMEOUT_MS, DEFAULT_TIMEOUT_MS, Driver, DriverKind, KeyPassing, McpServer,
    McpSource, Phase, PhaseKind, SandboxSettings, Task, Tier, Verifier, Workspace, placeholders,
};
use crate::agent::Reversibility;
use crate::budget::{BudgetLimits, BudgetName};

const MAX_NAME_LEN: usize = 64;

pub(super) fn parse(file: &str, source: &str) -> Result<Contract, ContractError> {
    let mut d = Diagnostics::new(file, source);
    // Parsing the TOML and deserialising it are separate steps so that a syntax error can be
    // told apart from a contract that is valid TOML but has the wrong shape.
    let deserializer = match toml::Deserializer::parse(source) {
        Ok(deserializer) => deserializer,
        Err(e) => {
            report_toml_error(&mut d, &e, true);
            return Err(d.into_error());
        }
    };
    let raw = match RawContract::deserialize(deserializer) {
        Ok(raw) => raw,
        Err(e) => {
            report_toml_error(&mut d, &e, false);
            return Err(d.into_error());
        }
    };
    let contract = Validator {
        d: &mut d,
        tool_names: Vec::new(),
        mcp_names: Vec::new(),
    }
    .contract(raw, source);
    match contract {
        Some(contract) if d.is_empty() => Ok(contract),
        _ => {
            if d.is_empty() {
                // Every check that fails records why; this keeps the promise of at least one
                // diagnostic should one ever forget.
                d.document("the contract was refused without a reason; this is a bug in keel");
            }
            Err(d.into_error())
        }
    }
}

fn report_toml_error(d: &mut Diagnostics<'_>, e: &toml::de::Error, syntax: bool) {
    let span = e.span().unwrap_or(0..0);
    let message = reword_toml_error(e.message(), syntax, d.text(&span));
    d.at(&span, message);
}

struct Validator<'d, 'a> {
    d: &'d mut Diagnostics<'a>,
    /// The contract-defined tools, which agent phases may list beside the built-in ones.
    tool_names: Vec<String>,
    /// The declared MCP servers, whose tools agent phases may list as `server.tool` or
    /// `server.*`.
    mcp_names: Vec<String>,
}

impl Validator<'_, '_> {
    /// `None` when something is wrong; the reasons are in the diagnostics. Every section is
    /// checked even after an earlier one failed, so that one run reports every problem.
    fn contract(&mut self, raw: RawContract, source: &str) -> Option<Contract> {
        let RawContract {
            task,
            workspace,
            driver,
            scope,
            budget,
            verify,
            phase,
            tool,
            mcp,
            approvals,
            sandbox,
        } = raw;

        let task = self.task(task);
        let workspace = self.workspace(workspace);
        let driver = match driver {
            Some(driver) => self.driver(driver).map(Some),
            None => Some(None),
        };
        let scope = self.scope(scope);
        let budget = self.budget(budget);
        let verifiers = self.verifiers(&verify);
        let tools = self.tools(tool);
        let mcp = self.mcp_servers(mcp);
        let phases = self.phases(&phase, &verify);
        let sandbox = self.sandbox(sandbox);

        if let Some(None) = &driver {
            for p in &phase {
                if *p.get_ref().kind.get_ref() == RawPhaseKind::Agent {
                    self.d.at(
                        &p.get_ref().kind.span(),
                        format!(
                            "agent phase \"{}\" needs a [driver]: add a [driver] table with kind = \
                             \"openai\", \"anthropic\", \"command\" or \"script\"",
                            p.get_ref().name.get_ref()
                        ),
                    );
                    return None;
                }
            }
        }

        let approvals = self.approvals(approvals);

        Some(Contract {
            approvals: approvals?,
            hash: blake3::hash(source.as_bytes()).to_hex().to_string(),
            source: source.to_string(),
            task: task?,
            workspace: workspace?,
            driver: driver?,
            scope: scope?,
            budget: budget?,
            verifiers: verifiers?,
            phases: phases?,
            tools: tools?,
            mcp: mcp?,
            sandbox: sandbox?,
        })
    }

    /// `[[mcp]]`: names valid, unique and distinct from the built-in tools; `command` or `url`,
    /// not both; env and secrets only for a command; a timeout that parses.
    fn mcp_servers(&mut self, raw: Vec<Spanned<RawMcp>>) -> Option<Vec<McpServer>> {
        let mut out = Vec::new();
        let mut ok = true;
        // Phases may list the tools of every declared server, even one refused below: one
        // mistake, one message.
        self.mcp_names = raw
            .iter()
            .map(|m| m.get_ref().name.get_ref().clone())
            .collect();
        let mut seen: BTreeMap<String, usize> = BTreeMap::new();
        for spanned in raw {
            let span = spanned.span();
            let m = spanned.into_inner();
            let name = m.name.get_ref().clone();
            if let Some(first) = seen.get(&name) {
                self.d.at(
                    &m.name.span(),
                    format!(
                        "there are two MCP servers named \"{name}\" (the first at line {first}); \
                         rename one"
                    ),
                );
                ok = false;
                continue;
            }
            seen.insert(name, self.d.line(m.name.span().start));
            match self.mcp_server(span, m) {
                Some(server) => out.push(server),
                None => ok = false,
            }
        }
        ok.then_some(out)
    }

    fn mcp_server(&mut self, span: Range<usize>, m: RawMcp) -> Option<McpServer> {
        let mut ok = true;
        let name = m.name.get_ref().clone();
        if name.is_empty()
            || name.len() > MAX_NAME_LEN
            || !name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
        {
            self.d.at(
                &m.name.span(),
                format!(
                    "MCP server name \"{name}\" may only hold letters, digits, `_` and `-` (1 to \
                     {MAX_NAME_LEN} characters; its tools are called \"name.tool\"); rename it, \
                     for example to \"{}\"",
                    suggest_server_name(&name)
                ),
            );
            ok = false;
        } else if crate::tools::BUILTIN.contains(&name.as_str()) {
            self.d.at(
                &m.name.span(),
                format!("\"{name}\" is a built-in tool; give the MCP server another name"),
            );
            ok = false;
        }
        let source = match (&m.command, &m.url) {
            (Some(_), Some(url)) => {
                self.d.at(
                    &url.span(),
                    format!(
                        "MCP server \"{name}\" has both command and url; keep command for a \
                         server keel starts (stdio) or url for one it reaches over HTTP"
                    ),
                );
                ok = false;
                None
            }
            (None, None) => {
                self.d.at(
                    &span,
                    format!(
                        "MCP server \"{name}\" has neither command nor url; add command = \
                         [\"program\", \"args\"...] (a server keel starts, spoken to on stdio) or \
                         url = \"http://host:port/mcp\" (streamable HTTP)"
                    ),
                );
                ok = false;
                None
            }
            (Some(command), None) => {
                let argv = command.get_ref();
                if argv.is_empty() {
                    self.d.at(
                        &command.span(),
                        "command is empty; give the program and its arguments",
                    );
                    ok = false;
                } else if argv[0].get_ref().trim().is_empty() {
                    self.d
                        .at(&argv[0].span(), "the program of command is empty; name it");
                    ok = false;
                }
                let env = match &m.env {
                    None => Vec::new(),
                    Some(list) => {
                        self.env_names(list, "environment variable")
                            .unwrap_or_else(|| {
                                ok = false;
                                Vec::new()
                            })
                    }
                };
                Some(McpSource::Stdio {
                    command: argv.iter().map(|a| a.get_ref().clone()).collect(),
                    env,
                })
            }
            (None, Some(url)) => {
                let text = url.get_ref().trim();
                let host = text
                    .strip_prefix("http://")
                    .or_else(|| text.strip_prefix("https://"));
                if host.is_none_or(|h| h.is_empty() || h.starts_with('/')) {
                    self.d.at(
                        &url.span(),
                        format!(
                            "url \"{text}\" is not an HTTP URL; write it like \
                             \"http://127.0.0.1:8080/mcp\" or \"https://mcp.example.com/mcp\""
                        ),
                    );
                    ok = false;
                }
                for (key, present) in [
                    ("env", m.env.as_ref().map(|e| e.span())),
                    ("secrets", m.secrets.as_ref().map(|e| e.span())),
                ] {
                    if let Some(at) = present {
                        self.d.at(
                            &at,
                            format!(
                                "{key} is only for a server keel starts (command); MCP server \
                                 \"{name}\" is reached at its url: remove {key}"
                            ),
                        );
                        ok = false;
                    }
                }
                Some(McpSource::Http {
                    url: text.to_string(),
                })
            }
        };
        let secrets = match &m.secrets {
            None => Vec::new(),
            Some(list) => self.env_names(list, "secret name").unwrap_or_else(|| {
                ok = false;
                Vec::new()
            }),
        };
        let reversibility = match &m.reversibility {
            None => Reversibility::Irreversible,
            Some(r) if *r.get_ref() == RawReversibility::Compensatable => {
                self.d.at(
                    &r.span(),
                    format!(
                        "MCP server \"{name}\" cannot be compensatable: keel has no command that \
                         undoes its calls; write \"irreversible\" (the default), or \
                         \"reversible\" if its calls change only the workspace"
                    ),
                );
                ok = false;
                Reversibility::Irreversible
            }
            Some(r) => reversibility(*r.get_ref()),
        };
        let mut read_only: Vec<String> = Vec::new();
        for tool in m.read_only.iter().flat_map(|l| l.get_ref()) {
            let t = tool.get_ref();
            if t.trim().is_empty() {
                self.d.at(
                    &tool.span(),
                    "this tool name is empty; write the name of one of the server's tools (without \
                     the server's name)",
                );
                ok = false;
            } else if let Some(bare) = t.strip_prefix(&format!("{name}.")) {
                self.d.at(
                    &tool.span(),
                    format!(
                        "read_only lists the server's own tool names: write \"{bare}\", not \"{t}\""
                    ),
                );
                ok = false;
            } else if !read_only.contains(t) {
                read_only.push(t.clone());
            }
        }
        let timeout_ms = match &m.timeout {
            None => Some(DEFAULT_MCP_TIMEOUT_MS),
            Some(v) => self.duration(&format!("the timeout of MCP server \"{name}\""), v),
        };
        let timeout_ms = timeout_ms.unwrap_or_else(|| {
            ok = false;
            0
        });
        match source {
            Some(source) if ok => Some(McpServer {
                name,
                source,
                secrets,
                reversibility,
                read_only,
                approval: m.approval.as_ref().is_some_and(|a| *a.get_ref()),
                timeout_ms,
            }),
            _ => None,
        }
    }

    /// Environment variable names (letters, digits and `_`, not starting with a digit); `None`
    /// after reporting a bad one.
    fn env_names(
        &mut self,
        list: &Spanned<Vec<Spanned<String>>>,
        what: &str,
    ) -> Option<Vec<String>> {
        let mut ok = true;
        let mut out = Vec::new();
        for s in list.get_ref() {
            let n = s.get_ref();
            let valid = n.chars().next().is_some_and(|c| !c.is_ascii_digit())
                && n.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
            if !valid {
                self.d.at(
                    &s.span(),
                    format!(
                        "{what} \"{n}\" must be an environment variable name (letters, digits and \
                         `_`, not starting with a digit)"
                    ),
                );
                ok = false;
            } else if !out.contains(n) {
                out.push(n.clone());
            }
        }
        ok.then_some(out)
    }

    /// `[[tool]]`: names unique and distinct from the built-in tools, argv templates whose
    /// placeholders are declared arguments, a compensation for compensatable tools.
    fn tools(&mut self, raw: Vec<Spanned<RawTool>>) -> Option<Vec<ContractTool>> {
        let mut out = Vec::new();
        let mut ok = true;
        // Phases may list every declared tool, even one refused below: one mistake, one message.
        self.tool_names = raw
            .iter()
            .map(|t| t.get_ref().name.get_ref().clone())
            .collect();
        for spanned in raw {
            let span = spanned.span();
            let t = spanned.into_inner();
            match self.tool(span.clone(), t) {
                Some(tool) if out.iter().any(|o: &ContractTool| o.name == tool.name) => {
                    self.d.at(
                        &span,
                        format!("there are two tools named \"{}\"; rename one", tool.name),
                    );
                    ok = false;
                }
                Some(tool) => out.push(tool),
                None => ok = false,
            }
        }
        ok.then_some(out)
    }

    fn tool(&mut self, span: Range<usize>, t: RawTool) -> Option<ContractTool> {
        let mut ok = true;
        let name = t.name.get_ref().clone();
        if name.is_empty()
            || !name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
        {
            self.d.at(
                &t.name.span(),
                format!(
                    "tool name \"{name}\" may only hold letters, digits, `_` and `-` (models \
                     call tools by name)"
                ),
            );
            ok = false;
        } else if crate::tools::BUILTIN.contains(&name.as_str()) || name.contains('.') {
            self.d.at(
                &t.name.span(),
                format!("\"{name}\" is a built-in tool; give this tool another name"),
            );
            ok = false;
        }
        let description = match &t.description {
            Some(d) if !d.get_ref().trim().is_empty() => d.get_ref().clone(),
            Some(d) => {
                self.d.at(
                    &d.span(),
                    "the description is empty; say what the tool does, for the driver",
                );
                ok = false;
                String::new()
            }
            None => {
                self.d.at(
                    &span,
                    format!(
                        "tool \"{name}\" has no description; add description = \"...\" (the \
                         driver reads it)"
                    ),
                );
                ok = false;
                String::new()
            }
        };
        let (parameters, declared) = self.tool_parameters(&t);
        let parameters = parameters.unwrap_or_else(|| {
            ok = false;
            serde_json::Value::Null
        });
        let idempotency_key = match &t.idempotency_key {
            None => None,
            Some(k) => match k.get_ref().as_str() {
                "arg" => Some(KeyPassing::Arg),
                other => match other.strip_prefix("env:") {
                    Some(var)
                        if !var.is_empty()
                            && var.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') =>
                    {
                        Some(KeyPassing::Env(var.to_string()))
                    }
                    _ => {
                        self.d.at(
                            &k.span(),
                            format!(
                                "idempotency_key is \"{other}\"; write \"env:NAME\" (an \
                                 environment variable) or \"arg\" (the {{idempotency_key}} \
                                 placeholder in run)"
                            ),
                        );
                        ok = false;
                        None
                    }
                },
            },
        };
        let mut argv_checks = |field: &str, argv: &Spanned<Vec<Spanned<String>>>| -> Vec<String> {
            if argv.get_ref().is_empty() {
                self.d.at(
                    &argv.span(),
                    format!("{field} is empty; give the program and its arguments"),
                );
                ok = false;
            }
            let mut out = Vec::new();
            for (i, element) in argv.get_ref().iter().enumerate() {
                let text = element.get_ref();
                if i == 0 && text.trim().is_empty() {
                    self.d
                        .at(&element.span(), format!("the program of {field} is empty"));
                    ok = false;
                }
                for p in placeholders(text) {
                    if p == "idempotency_key" {
                        if idempotency_key != Some(KeyPassing::Arg) {
                            self.d.at(
                                &element.span(),
                                "{idempotency_key} is used, but the tool does not say \
                                 idempotency_key = \"arg\"; add it",
                            );
                            ok = false;
                        }
                    } else if !declared.iter().any(|d| d == p) {
                        self.d.at(
                            &element.span(),
                            format!(
                                "{{{p}}} is not an argument of tool \"{name}\"; declare it in \
                                 parameters or fix the name (arguments: {})",
                                if declared.is_empty() {
                                    "none".to_string()
                                } else {
                                    declared.join(", ")
                                }
                            ),
                        );
                        ok = false;
                    }
                }
                out.push(text.clone());
            }
            out
        };
        let run = argv_checks("run", &t.run);
        let compensate = t.compensate.as_ref().map(|c| argv_checks("compensate", c));
        if idempotency_key == Some(KeyPassing::Arg)
            && !run
                .iter()
                .any(|r| placeholders(r).contains(&"idempotency_key"))
        {
            self.d.at(
                &t.run.span(),
                "idempotency_key = \"arg\" but run has no {idempotency_key} placeholder; add it \
                 where the command takes the key",
            );
            ok = false;
        }
        let reversibility = match t.reversibility.as_ref().map(|r| *r.get_ref()) {
            None | Some(RawReversibility::Irreversible) => Reversibility::Irreversible,
            Some(other) => reversibility(other),
        };
        if reversibility == Reversibility::Compensatable && compensate.is_none() {
            let at = t
                .reversibility
                .as_ref()
                .map(|r| r.span())
                .unwrap_or(span.clone());
            self.d.at(
                &at,
                format!(
                    "tool \"{name}\" is compensatable but has no compensate; add compensate = \
                     [\"program\", \"args\"...] (the command that undoes a call)"
                ),
            );
            ok = false;
        }
        if let (Some(c), false) = (&t.compensate, reversibility == Reversibility::Compensatable) {
            self.d.at(
                &c.span(),
                format!(
                    "compensate is only for reversibility = \"compensatable\"; tool \"{name}\" \
                     is {reversibility}"
                ),
            );
            ok = false;
        }
        let secrets = match &t.secrets {
            None => Vec::new(),
            Some(list) => {
                let mut out = Vec::new();
                for s in list.get_ref() {
                    let n = s.get_ref();
                    if n.is_empty() || !n.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
                        self.d.at(
                            &s.span(),
                            format!(
                                "secret name \"{n}\" must be an environment variable name \
                                 (letters, digits and `_`)"
                            ),
                        );
                        ok = false;
                    } else {
                        out.push(n.clone());
                    }
                }
                out
            }
        };
        let timeout_ms = match &t.timeout {
            Some(v) => match self.duration("timeout", v) {
                Some(ms) => Some(ms),
                None => {
                    ok = false;
                    None
                }
            },
            None => None,
        };
        ok.then(|| ContractTool {
            name,
            description,
            run,
            parameters,
            secrets,
            reversibility,
            idempotency_key,
            approval: t.approval.as_ref().is_some_and(|a| *a.get_ref()),
            compensate,
            timeout_ms,
            network: t.network.as_ref().map(|n| *n.get_ref()),
        })
    }

    /// A tool's `parameters` table as a JSON Schema object (`None` after reporting why not), and
    /// the argument names.
    fn tool_parameters(&mut self, t: &RawTool) -> (Option<serde_json::Value>, Vec<String>) {
        let mut properties = serde_json::Map::new();
        let mut required = Vec::new();
        let mut names = Vec::new();
        let mut ok = true;
        if let Some(table) = &t.parameters {
            for (pname, spec) in table.get_ref() {
                let at = table.span();
                let Some(spec) = spec.as_table() else {
                    self.d.at(
                        &at,
                        format!(
                            "parameter \"{pname}\" must be a table like {{ type = \"string\", \
                             description = \"...\" }}"
                        ),
                    );
                    ok = false;
                    continue;
                };
                let mut schema = serde_json::Map::new();
                let mut optional = false;
                for (key, value) in spec {
                    match (key.as_str(), value) {
                        ("type", toml::Value::String(ty))
                            if ["string", "integer", "number", "boolean"]
                                .contains(&ty.as_str()) =>
                        {
                            schema.insert("type".into(), serde_json::Value::String(ty.clone()));
                        }
                        ("type", other) => {
                            self.d.at(
                                &at,
                                format!(
                                    "parameter \"{pname}\" has type {other}; write \"string\", \
                                     \"integer\", \"number\" or \"boolean\""
                                ),
                            );
                            ok = false;
                        }
                        ("description", toml::Value::String(d)) => {
                            schema
                                .insert("description".into(), serde_json::Value::String(d.clone()));
                        }
                        ("optional", toml::Value::Boolean(b)) => optional = *b,
                        (other, _) => {
                            self.d.at(
                                &at,
                                format!(
                                    "parameter \"{pname}\" has an unknown key `{other}`; the keys \
                                     are type, description and optional"
                                ),
                            );
                            ok = false;
                        }
                    }
                }
                if !schema.contains_key("type") {
                    self.d.at(
                        &at,
                        format!("parameter \"{pname}\" has no type; add type = \"string\""),
                    );
                    ok = false;
                }
                if !optional {
                    required.push(serde_json::Value::String(pname.clone()));
                }
                names.push(pname.clone());
                properties.insert(pname.clone(), serde_json::Value::Object(schema));
            }
        }
        let schema = ok.then(|| {
            serde_json::json!({
                "type": "object",
                "properties": properties,
                "required": required,
                "additionalProperties": false,
            })
        });
        (schema, names)
    }

    /// `[sandbox]`: on unless explicitly off; limits parsed.
    fn sandbox(&mut self, raw: Option<RawSandbox>) -> Option<SandboxSettings> {
        let mut out = SandboxSettings::default();
        let Some(raw) = raw else {
            return Some(out);
        };
        let mut ok = true;
        if let Some(mode) = &raw.mode {
            match mode.get_ref().as_str() {
                "on" => {}
                "off" => out.enabled = false,
                other => {
                    self.d.at(
                        &mode.span(),
                        format!("sandbox mode is \"{other}\"; write \"on\" or \"off\""),
                    );
                    ok = false;
                }
            }
        }
        if let Some(w) = raw.writable {
            for dir in w {
                let text = dir.get_ref();
                if !(text.starts_with('/') || text.starts_with("~/")) {
                    self.d.at(
                        &dir.span(),
                        format!(
                            "sandbox writable \"{text}\" must be an absolute path or start with \
                             \"~/\""
                        ),
                    );
                    ok = false;
                } else {
                    out.writable.push(text.clone());
                }
            }
        }
        if let Some(env) = raw.env {
            for v in env {
                let n = v.get_ref();
                if n.is_empty() || !n.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
                    self.d.at(
                        &v.span(),
                        format!("\"{n}\" is not an environment variable name"),
                    );
                    ok = false;
                } else {
                    out.env.push(n.clone());
                }
            }
        }
        if let Some(m) = &raw.memory {
            match parse_bytes(m.get_ref()) {
                Some(b) if b >= 16 << 20 => out.memory_bytes = b,
                _ => {
                    self.d.at(
                        &m.span(),
                        format!(
                            "sandbox memory is \"{}\"; write a size of at least 16MiB like \
                             \"512MiB\" or \"4GiB\"",
                            m.get_ref()
                        ),
                    );
                    ok = false;
                }
            }
        }
        for (what, value, slot) in [
            ("processes", &raw.processes, &mut out.processes),
            ("open_files", &raw.open_files, &mut out.open_files),
        ] {
            if let Some(v) = value {
                if *v.get_ref() < 8 {
                    self.d.at(
                        &v.span(),
                        format!("sandbox {what} is {}; allow at least 8", v.get_ref()),
                    );
                    ok = false;
                } else {
                    *slot = *v.get_ref();
                }
            }
        }
        if let Some(t) = &raw.cpu_time {
            match self.duration("sandbox cpu_time", t) {
                Some(ms) => out.cpu_ms = Some(ms),
                None => ok = false,
            }
        }
        ok.then_some(out)
    }

    fn task(&mut self, raw: RawTask) -> Option<Task> {
        let goal = raw.goal.get_ref().trim().to_string();
        if goal.is_empty() {
            self.d.at(
                &raw.goal.span(),
                "the goal is empty; say in a sentence or two what must be true when the run is \
                 done",
            );
        }
        let out_of_scope = self.strings(
            raw.out_of_scope.unwrap_or_default(),
            "this out_of_scope entry is empty; remove it or say what the run must leave alone",
        );
        if goal.is_empty() {
            return None;
        }
        Some(Task {
            goal,
            out_of_scope: out_of_scope?,
        })
    }

    fn workspace(&mut self, raw: Option<RawWorkspace>) -> Option<Workspace> {
        let Some(raw) = raw else {
            return Some(Workspace {
                path: ".".to_string(),
                fingerprint: Vec::new(),
                lockfiles: default_lockfiles(),
            });
        };
        let path = match raw.path {
            Some(path) if path.get_ref().trim().is_empty() => {
                self.d.at(
                    &path.span(),
                    "the workspace path is empty; use \".\" for the contract file's directory",
                );
                None
            }
            Some(path) => Some(path.into_inner()),
            None => Some(".".to_string()),
        };
        let fingerprint = self.strings(
            raw.fingerprint.unwrap_or_default(),
            "this fingerprint command is empty; remove it or write a shell command whose output \
             describes the environment",
        );
        let lockfiles = match raw.lockfiles {
            Some(lockfiles) => self.strings(
                lockfiles,
                "this lockfile path is empty; remove it or name a file in the workspace",
            ),
            None => Some(default_lockfiles()),
        };
        Some(Workspace {
            path: path?,
            fingerprint: fingerprint?,
            lockfiles: lockfiles?,
        })
    }

    fn approvals(&mut self, raw: Option<RawApprovals>) -> Option<ApprovalPolicy> {
        let Some(raw) = raw else {
            return Some(ApprovalPolicy::default());
        };
        let mut ok = self.not_blank(
            &raw.notify,
            "the notify command is empty; write a shell command or remove the key",
        );
        let expires_ms = match &raw.expires {
            Some(t) => match self.duration("approvals.expires", t) {
                Some(ms) => Some(ms),
                None => {
                    ok = false;
                    None
                }
            },
            None => None,
        };
        let block_on_expiry = match &raw.on_expiry {
            None => false,
            Some(v) => match v.get_ref().as_str() {
                "reject" => false,
                "block" => true,
                other => {
                    self.d.at(
                        &v.span(),
                        format!("on_expiry is \"{other}\"; write \"reject\" or \"block\""),
                    );
                    ok = false;
                    false
                }
            },
        };
        let mut require = Vec::new();
        for class in raw.require.unwrap_or_default() {
            let c = reversibility(*class.get_ref());
            if c == Reversibility::ReadOnly {
                self.d.at(
                    &class.span(),
                    "approval for read_only calls would stop every read; list reversible, \
                     compensatable or irreversible",
                );
                ok = false;
            } else if !require.contains(&c) {
                require.push(c);
            }
        }
        ok.then(|| ApprovalPolicy {
            notify: raw.notify.map(Spanned::into_inner),
            expires_ms,
            block_on_expiry,
            require,
        })
    }

    fn driver(&mut self, raw: RawDriver) -> Option<Driver> {
        let RawDriver {
            kind,
            model,
            base_url,
            api_key,
            context_tokens,
            command,
            script,
            max_output_tokens,
            timeout,
            max_retries,
            retry_backoff,
            input_usd_per_mtok,
            output_usd_per_mtok,
        } = raw;
        let kind_span = kind.span();
        let kind = kind.into_inner();
        let mut ok = true;

        ok &= self.not_blank(&model, "the model is empty; name a model or remove the key");
        if matches!(kind, DriverKind::Openai | DriverKind::Anthropic) && model.is_none() {
            self.d.at(
                &kind_span,
                format!("driver kind \"{kind}\" needs a model; add model = \"<model name>\""),
            );
            ok = false;
        }
        if let Some(url) = &base_url {
            let text = url.get_ref();
            if !(text.starts_with("http://") || text.starts_with("https://")) {
                self.d.at(
                    &url.span(),
                    format!(
                        "base_url \"{text}\" is not an http:// or https:// URL; write it like \
                         \"http://127.0.0.1:11434/v1\""
                    ),
                );
                ok = false;
            }
        }
        if let Some(key) = &api_key
            && !is_secret_reference(key.get_ref())
        {
            self.d.at(
                &key.span(),
                "api_key must name a secret like \"secret:OPENAI_API_KEY\", never hold the \
                 key itself: the contract is stored with every run",
            );
            ok = false;
        }
        let context_tokens = match &context_tokens {
            Some(tokens) => match self.positive("context_tokens", tokens) {
                Some(n) => Some(n),
                None => {
                    ok = false;
                    None
                }
            },
            None => None,
        };
        ok &= self.not_blank(&command, "the command is empty; write the program to run");
        ok &= self.not_blank(
            &script,
            "the script path is empty; name the file of recorded actions",
        );
        for (key, value, wanted) in [
            ("command", &command, DriverKind::Command),
            ("script", &script, DriverKind::Script),
        ] {
            match value {
                Some(value) if kind != wanted => {
                    self.d.at(
                        &value.span(),
                        format!(
                            "`{key}` is used only by kind = \"{wanted}\" drivers, and this \
                             driver is kind = \"{kind}\"; remove `{key}` or change the kind"
                        ),
                    );
                    ok = false;
                }
                None if kind == wanted => {
                    self.d.at(
                        &kind_span,
                        format!(
                            "driver kind \"{kind}\" needs `{key}`; add {key} = \"...\" to [driver]"
                        ),
                    );
                    ok = false;
                }
                _ => {}
            }
        }
        let max_output_tokens = match &max_output_tokens {
            Some(n) => self.positive("max_output_tokens", n),
            None => Some(4096),
        };
        let default_timeout = if kind == DriverKind::Command {
            30 * 60 * 1000
        } else {
            120 * 1000
        };
        let timeout_ms = match &timeout {
            Some(t) => self.duration("the driver timeout", t),
            None => Some(default_timeout),
        };
        let max_retries = match &max_retries {
            Some(n) if *n.get_ref() < 0 => {
                self.d.at(
                    &n.span(),
                    format!(
                        "max_retries is {}; it counts retries, so 0 or more",
                        n.get_ref()
                    ),
                );
                None
            }
            Some(n) => Some(u32::try_from(*n.get_ref()).unwrap_or(u32::MAX)),
            None => Some(4),
        };
        let retry_backoff_ms = match &retry_backoff {
            Some(t) => self.duration("retry_backoff", t),
            None => Some(500),
        };
        let price = match (&input_usd_per_mtok, &output_usd_per_mtok) {
            (None, None) => Some(None),
            (Some(i), Some(o)) => match (
                self.price("input_usd_per_mtok", i),
                self.price("output_usd_per_mtok", o),
            ) {
                (Some(i), Some(o)) => Some(Some((i, o))),
                _ => None,
            },
            (Some(one), None) | (None, Some(one)) => {
                self.d.at(
                    &one.span(),
                    "give both input_usd_per_mtok and output_usd_per_mtok, or neither",
                );
                None
            }
        };
        ok.then_some(())?;
        Some(Driver {
            kind,
            model: model.map(Spanned::into_inner),
            base_url: base_url.map(Spanned::into_inner),
            api_key: api_key.map(Spanned::into_inner),
            context_tokens,
            command: command.map(Spanned::into_inner),
            script: script.map(Spanned::into_inner),
            max_output_tokens: max_output_tokens?,
            timeout_ms: timeout_ms?,
            max_retries: max_retries?,
            retry_backoff_ms: retry_backoff_ms?,
            price: price?,
        })
    }

    /// A price per million tokens: zero or more dollars, as micro-dollars.
    fn price(&mut self, what: &str, value: &Spanned<Dollars>) -> Option<u64> {
        let Dollars(dollars) = *value.get_ref();
        if !dollars.is_finite() || dollars < 0.0 {
            self.d.at(
                &value.span(),
                format!("{what} is {dollars}; write a price in dollars like 0.15 (0 for free)"),
            );
            return None;
        }
        Some((dollars * 1_000_000.0).round() as u64)
    }

    fn scope(&mut self, raw: Option<RawScope>) -> Option<Scope> {
        let Some(raw) = raw else {
            return Some(Scope::default());
        };
        let writable = self.globs("writable", raw.writable.unwrap_or_default(), path_glob);
        let forbidden = self.globs("forbidden", raw.forbidden.unwrap_or_default(), path_glob);
        let commands = self.globs("commands", raw.commands.unwrap_or_default(), command_glob);
        let http = self.http_rules(raw.http.unwrap_or_default());
        let (writable, forbidden, commands, http) = (writable?, forbidden?, commands?, http?);
        match Scope::from_globs(writable, forbidden, commands, raw.network.unwrap_or(false)) {
            Ok(mut scope) => {
                scope.http = http;
                Some(scope)
            }
            Err(e) => {
                // Every glob compiled on its own, so this is a limit of the matcher.
                self.d.document(format!(
                    "the [scope] globs cannot be combined: {e}; simplify them"
                ));
                None
            }
        }
    }

    fn http_rules(&mut self, raw: Vec<Spanned<RawHttpRule>>) -> Option<Vec<HttpRule>> {
        let mut out = Vec::new();
        let mut ok = true;
        for rule in raw {
            let span = rule.span();
            let r = rule.into_inner();
            let host = r.host.trim().to_ascii_lowercase();
            let bare = host.strip_prefix("*.").unwrap_or(&host);
            if bare.is_empty()
                || bare.contains('*')
                || bare.contains('/')
                || bare.contains(':') && !bare.starts_with('[')
            {
                self.d.at(
                    &span,
                    format!(
                        "http host \"{}\" is not a host name; write \"api.example.com\", \
                         \"*.example.com\" or an IP address, and the port in `port`",
                        r.host
                    ),
                );
                ok = false;
                continue;
            }
            let methods = r.methods.unwrap_or_else(|| vec!["GET".into()]);
            let mut upper = Vec::new();
            for m in methods {
                let u = m.to_ascii_uppercase();
                if ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE"].contains(&u.as_str()) {
                    upper.push(u);
                } else {
                    self.d.at(
                        &span,
                        format!(
                            "http method \"{m}\" is not one keel sends; use GET, HEAD, POST, PUT, \
                             PATCH or DELETE"
                        ),
                    );
                    ok = false;
                }
            }
            out.push(HttpRule {
                host,
                port: r.port,
                methods: upper,
            });
        }
        ok.then_some(out)
    }

    fn globs(
        &mut self,
        key: &str,
        patterns: Vec<Spanned<String>>,
        compile: fn(&str) -> Result<Glob, globset::Error>,
    ) -> Option<Vec<(String, Glob)>> {
        let mut globs = Vec::with_capacity(patterns.len());
        let mut ok = true;
        for pattern in patterns {
            let text = pattern.get_ref();
            if text.is_empty() {
                self.d.at(
                    &pattern.span(),
                    format!("this {key} glob is empty and matches nothing; remove it"),
                );
                ok = false;
                continue;
            }
            match compile(text) {
                Ok(glob) => globs.push((text.clone(), glob)),
                Err(e) => {
                    self.d.at(
                        &pattern.span(),
                        format!(
                            "{key} glob \"{text}\" is invalid: {}; fix the pattern",
                            e.kind()
                        ),
                    );
                    ok = false;
                }
            }
        }
        ok.then_some(globs)
    }

    fn budget(&mut self, raw: Option<RawBudget>) -> Option<BudgetLimits> {
        let mut limits = BudgetLimits::default();
        let Some(raw) = raw else {
            return Some(limits);
        };
        // Destructured in full so that a budget added to the table cannot be forgotten here.
        let RawBudget {
            tokens,
            cost_usd,
            wall_time,
            compute_time,
            steps,
            tool_calls,
            same_error,
            no_progress_steps,
            writes,
            network_requests,
            parallel_workers,
            diff_lines,
            files_changed,
            approvals,
        } = raw;
        let mut ok = true;
        let counts = [
            (BudgetName::Tokens, tokens),
            (BudgetName::Steps, steps),
            (BudgetName::ToolCalls, tool_calls),
            (BudgetName::SameError, same_error),
            (BudgetName::NoProgressSteps, no_progress_steps),
            (BudgetName::Writes, writes),
            (BudgetName::NetworkRequests, network_requests),
            (BudgetName::ParallelWorkers, parallel_workers),
            (BudgetName::DiffLines, diff_lines),
            (BudgetName::FilesChanged, files_changed),
            (BudgetName::Approvals, approvals),
        ];
        for (name, value) in counts {
            if let Some(value) = value {
                match self.positive(&format!("budget {name}"), &value) {
                    Some(n) => limits.set(name, n),
                    None => ok = false,
                }
            }
        }
        for (name, value) in [
            (BudgetName::WallTime, wall_time),
            (BudgetName::ComputeTime, compute_time),
        ] {
            if let Some(value) = value {
                match self.duration(&format!("budget {name}"), &value) {
                    Some(ms) => limits.set(name, ms),
                    None => ok = false,
                }
            }
        }
        if let Some(cost) = cost_usd {
            match self.dollars(&cost) {
                Some(micros) => limits.set(BudgetName::CostUsd, micros),
                None => ok = false,
            }
        }
        ok.then_some(limits)
    }

    fn dollars(&mut self, value: &Spanned<Dollars>) -> Option<u64> {
        let Dollars(dollars) = *value.get_ref();
        let problem = if !dollars.is_finite() {
            Some(format!(
                "budget cost_usd is {dollars}; write a number of dollars like 5.0"
            ))
        } else if dollars < 0.0 {
            Some(format!(
                "budget cost_usd is {dollars}, but a limit cannot be negative; use an amount \
                 greater than 0, or leave the key out for no limit"
            ))
        } else if dollars == 0.0 {
            Some(
                "budget cost_usd is 0; a limit must be greater than 0 (leave the key out for no \
                 limit)"
                    .to_string(),
            )
        } else if (dollars * 1_000_000.0).round() < 1.0 {
            Some(format!(
                "budget cost_usd is {dollars}; a limit must be at least $0.000001 (leave the key \
                 out for no limit)"
            ))
        } else {
            None
        };
        match problem {
            Some(message) => {
                self.d.at(&value.span(), message);
                None
            }
            // The float-to-integer cast saturates, so an absurdly large amount is just "a lot".
            None => Some((dollars * 1_000_000.0).round() as u64),
        }
    }

    fn verifiers(&mut self, raw: &[Spanned<RawVerifier>]) -> Option<Vec<Verifier>> {
        let mut verifiers = Vec::with_capacity(raw.len());
        let mut ok = true;
        let mut seen = BTreeMap::new();
        for verifier in raw {
            let v = verifier.get_ref();
            ok &= self.name("verifier", &v.name, &mut seen);
            let run = v.run.get_ref();
            if run.trim().is_empty() {
                self.d.at(
                    &v.run.span(),
                    format!(
                        "verifier \"{}\" has an empty run; write the shell command that checks \
                         the work",
                        v.name.get_ref()
                    ),
                );
                ok = false;
            }
            if let Some(builtin) = run.trim().strip_prefix("keel:")
                && !super::BUILTIN_VERIFIERS.contains(&run.trim())
            {
                self.d.at(
                    &v.run.span(),
                    format!(
                        "there is no built-in verifier \"keel:{builtin}\"; the built-in ones are \
                         {}",
                        super::BUILTIN_VERIFIERS.join(", ")
                    ),
                );
                ok = false;
            }
            let timeout = self.timeout(
                &format!("the timeout of verifier \"{}\"", v.name.get_ref()),
                &v.timeout,
            );
            match timeout {
                Some(timeout_ms) => verifiers.push(Verifier {
                    name: v.name.get_ref().clone(),
                    tier: *v.tier.get_ref(),
                    run: run.clone(),
                    timeout_ms,
                }),
                None => ok = false,
            }
        }
        if !raw
            .iter()
            .any(|v| *v.get_ref().tier.get_ref() == Tier::Acceptance)
        {
            let message = "no [[verify]] has tier = \"acceptance\"; keel completes a run only with \
                           acceptance evidence, so add a verifier with tier = \"acceptance\" whose \
                           command proves the goal is met";
            match raw.first() {
                Some(first) => self.d.at(&first.span(), message),
                None => self.d.document(message),
            }
            ok = false;
        }
        ok.then_some(verifiers)
    }

    fn phases(
        &mut self,
        raw: &[Spanned<RawPhase>],
        verifiers: &[Spanned<RawVerifier>],
    ) -> Option<Vec<Phase>> {
        if raw.is_empty() {
            self.d.document(
                "the contract has no [[phase]]; add at least one, for example a [[phase]] with \
                 kind = \"command\" and run = [\"<shell command>\"]",
            );
            return None;
        }
        let verifier_names: Vec<&str> = verifiers
            .iter()
            .map(|v| v.get_ref().name.get_ref().as_str())
            .collect();
        let phase_gate: Vec<String> = verifiers
            .iter()
            .map(Spanned::get_ref)
            .filter(|v| *v.tier.get_ref() == Tier::Phase)
            .map(|v| v.name.get_ref().clone())
            .collect();
        let mut phases = Vec::with_capacity(raw.len());
        let mut ok = true;
        let mut seen = BTreeMap::new();
        for phase in raw {
            ok &= self.name("phase", &phase.get_ref().name, &mut seen);
            let gate = self.gate(phase.get_ref(), &verifier_names, &phase_gate);
            let kind = self.phase_kind(phase.span(), phase.get_ref());
            match (kind, gate) {
                (Some(kind), Some(gate)) => phases.push(Phase {
                    name: phase.get_ref().name.get_ref().clone(),
                    kind,
                    gate,
                    secrets: phase
                        .get_ref()
                        .secrets
                        .as_ref()
                        .map(|s| s.get_ref().clone())
                        .unwrap_or_default(),
                    approval: phase
                        .get_ref()
                        .approval
                        .as_ref()
                        .is_some_and(|a| *a.get_ref()),
                }),
                _ => ok = false,
            }
        }
        ok.then_some(phases)
    }

    fn gate(
        &mut self,
        phase: &RawPhase,
        verifier_names: &[&str],
        phase_gate: &[String],
    ) -> Option<Vec<String>> {
        let Some(done_when) = &phase.done_when else {
            return Some(phase_gate.to_vec());
        };
        let mut gate = Vec::with_capacity(done_when.len());
        let mut ok = true;
        let mut listed = BTreeSet::new();
        for name in done_when {
            let text = name.get_ref();
            if !verifier_names.contains(&text.as_str()) {
                let known = if verifier_names.is_empty() {
                    "the contract has no [[verify]]".to_string()
                } else {
                    format!("the verifiers are {}", quoted(verifier_names))
                };
                self.d.at(
                    &name.span(),
                    format!(
                        "done_when names verifier \"{text}\", but no [[verify]] has that name; \
                         {known}"
                    ),
                );
                ok = false;
            } else if !listed.insert(text.as_str()) {
                self.d.at(
                    &name.span(),
                    format!("done_when lists verifier \"{text}\" twice; list it once"),
                );
                ok = false;
            } else {
                gate.push(text.clone());
            }
        }
        ok.then_some(gate)
    }

    /// The phase's kind with its settings, or `None` after reporting why not. Features this
    /// version of keel cannot run are refused here, each at its own key.
    fn phase_kind(&mut self, header: Range<usize>, phase: &RawPhase) -> Option<PhaseKind> {
        let mut ok = true;
        if let Some(secrets) = &phase.secrets {
            for n in secrets.get_ref() {
                if n.is_empty() || !n.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
                    self.d.at(
                        &secrets.span(),
                        format!(
                            "secret name \"{n}\" must be an environment variable name (letters, \
                             digits and `_`)"
                        ),
                    );
                    ok = false;
                }
            }
        }
        if let Some(class) = &phase.reversibility
            && !matches!(
                class.get_ref(),
                RawReversibility::Reversible | RawReversibility::ReadOnly
            )
        {
            self.d.at(
                &class.span(),
                "only reversible (and read_only) command phases are supported yet: this version \
                 of keel re-runs an interrupted step, which is safe only for changes inside the \
                 workspace; remove `reversibility` or set it to \"reversible\"",
            );
            ok = false;
        }
        if let Some(compensate) = &phase.compensate {
            self.d.at(
                &compensate.span(),
                "compensate is not supported yet: this version of keel runs no compensations; \
                 remove `compensate`",
            );
            ok = false;
        }
        let kind = *phase.kind.get_ref();
        match kind {
            RawPhaseKind::Approval => {
                self.d.at(
                    &phase.kind.span(),
                    "phase kind \"approval\" is not supported yet: this version of keel runs \
                     kind = \"command\" and kind = \"agent\" phases",
                );
                None
            }
            RawPhaseKind::Agent => {
                let name = phase.name.get_ref();
                if let Some(run) = &phase.run {
                    self.d.at(
                        &run.span(),
                        "run is only for command phases; an agent phase's driver chooses its \
                         commands (through the `run` tool)",
                    );
                    ok = false;
                }
                let objective = match &phase.objective {
                    Some(o) if !o.get_ref().trim().is_empty() => {
                        Some(o.get_ref().trim().to_string())
                    }
                    Some(o) => {
                        self.d.at(
                            &o.span(),
                            "the objective is empty; say what this phase must achieve",
                        );
                        None
                    }
                    None => {
                        self.d.at(
                            &header,
                            format!(
                                "agent phase \"{name}\" has no objective; add objective = \"<what \
                                 the driver must achieve>\""
                            ),
                        );
                        None
                    }
                };
                let tools = self.agent_tools(phase);
                let timeout_ms =
                    self.timeout(&format!("the timeout of phase \"{name}\""), &phase.timeout);
                match (objective, tools, timeout_ms) {
                    (Some(objective), Some(tools), Some(timeout_ms)) if ok => {
                        Some(PhaseKind::Agent {
                            objective,
                            tools,
                            timeout_ms,
                        })
                    }
                    _ => None,
                }
            }
            RawPhaseKind::Command => {
                if let Some(objective) = &phase.objective {
                    self.d.at(
                        &objective.span(),
                        "objective is only for agent phases; remove it from this command phase",
                    );
                    ok = false;
                }
                if let Some(tools) = &phase.tools {
                    self.d.at(
                        &tools.span(),
                        "tools are only for agent phases; remove them from this command phase",
                    );
                    ok = false;
                }
                let run = self.phase_run(header, phase);
                let timeout_ms = self.timeout(
                    &format!("the timeout of phase \"{}\"", phase.name.get_ref()),
                    &phase.timeout,
                );
                match (run, timeout_ms) {
                    (Some(run), Some(timeout_ms)) if ok => {
                        Some(PhaseKind::Command { run, timeout_ms })
                    }
                    _ => None,
                }
            }
        }
    }

    /// The tools of an agent phase: built-in names, each once; all of them when absent.
    fn agent_tools(&mut self, phase: &RawPhase) -> Option<Vec<String>> {
        let Some(tools) = &phase.tools else {
            return Some(
                crate::tools::DEFAULT
                    .iter()
                    .map(|t| t.to_string())
                    .collect(),
            );
        };
        let mut out: Vec<String> = Vec::new();
        let mut ok = true;
        for tool in tools.get_ref() {
            let name = tool.get_ref();
            // `server.tool` or `server.*`: the server's tools are known only at run time.
            if let Some((server, rest)) = name.split_once('.') {
                if rest.is_empty() {
                    self.d.at(
                        &tool.span(),
                        format!(
                            "\"{name}\" names no tool; write \"{server}.TOOL\" for one tool of MCP \
                             server \"{server}\" or \"{server}.*\" for all of them"
                        ),
                    );
                    ok = false;
                } else if !self.mcp_names.iter().any(|m| m == server) {
                    self.d.at(
                        &tool.span(),
                        format!(
                            "there is no MCP server \"{server}\"; {}",
                            if self.mcp_names.is_empty() {
                                format!(
                                    "declare it with [[mcp]] name = \"{server}\" (and its command \
                                     or url)"
                                )
                            } else {
                                format!(
                                    "the servers are {} (or declare it with [[mcp]])",
                                    self.mcp_names.join(", ")
                                )
                            }
                        ),
                    );
                    ok = false;
                } else if out.contains(name) {
                    self.d.at(
                        &tool.span(),
                        format!("tool \"{name}\" is listed twice; list it once"),
                    );
                    ok = false;
                } else {
                    out.push(name.clone());
                }
                continue;
            }
            let known =
                crate::tools::BUILTIN.contains(&name.as_str()) || self.tool_names.contains(name);
            if known && out.contains(name) {
                self.d.at(
                    &tool.span(),
                    format!("tool \"{name}\" is listed twice; list it once"),
                );
                ok = false;
            } else if known {
                out.push(name.clone());
            } else {
                self.d.at(
                    &tool.span(),
                    format!(
                        "there is no tool \"{name}\"; the tools are {}{}{}",
                        quoted(&crate::tools::BUILTIN),
                        if self.tool_names.is_empty() {
                            String::new()
                        } else {
                            format!(" and the contract's {}", self.tool_names.join(", "))
                        },
                        if self.mcp_names.is_empty() {
                            String::new()
                        } else {
                            format!(
                                ", or an MCP server's as \"server.tool\" or \"server.*\" \
                                 (servers: {})",
                                self.mcp_names.join(", ")
                            )
                        }
                    ),
                );
                ok = false;
            }
        }
        if ok && !out.iter().any(|t| t == "finish") {
            self.d.at(
                &tools.span(),
                "an agent phase needs the `finish` tool: it is how the driver claims the phase \
                 is done",
            );
            ok = false;
        }
        ok.then_some(out)
    }

    fn phase_run(&mut self, header: Range<usize>, phase: &RawPhase) -> Option<Vec<String>> {
        let name = phase.name.get_ref();
        let Some(run) = &phase.run else {
            self.d.at(
                &header,
                format!(
                    "command phase \"{name}\" has no run; add run = [\"<shell command>\", ...]"
                ),
            );
            return None;
        };
        if run.get_ref().is_empty() {
            self.d.at(
                &run.span(),
                format!(
                    "the run list of phase \"{name}\" is empty; a command phase needs at least \
                     one shell command"
                ),
            );
            return None;
        }
        let mut ok = true;
        for command in run.get_ref() {
            if command.get_ref().trim().is_empty() {
                self.d.at(
                    &command.span(),
                    "this command is empty; remove it or write a shell command",
                );
                ok = false;
            }
        }
        ok.then(|| run.get_ref().iter().map(|c| c.get_ref().clone()).collect())
    }

    /// Checks a phase or verifier name: its characters, its length, and that it is the first
    /// of its kind with that name (`seen` maps names to where they first appeared).
    fn name(
        &mut self,
        what: &str,
        name: &Spanned<String>,
        seen: &mut BTreeMap<String, usize>,
    ) -> bool {
        let text = name.get_ref();
        let span = name.span();
        if text.is_empty() {
            self.d.at(
                &span,
                format!(
                    "the {what} name is empty; name it with lowercase letters, digits, \"_\" and \
                     \"-\""
                ),
            );
            return false;
        }
        if !text
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-')
        {
            self.d.at(
                &span,
                format!(
                    "{what} name \"{text}\" may contain only lowercase letters, digits, \"_\" and \
                     \"-\"; rename it, for example to \"{}\"",
                    suggest_name(text)
                ),
            );
            return false;
        }
        let length = text.chars().count();
        if length > MAX_NAME_LEN {
            self.d.at(
                &span,
                format!(
                    "{what} name \"{text}\" is {length} characters long; names may have at most \
                     {MAX_NAME_LEN}"
                ),
            );
            return false;
        }
        if let Some(first) = seen.get(text) {
            self.d.at(
                &span,
                format!(
                    "{what} name \"{text}\" is used twice (first at line {first}); {what} names \
                     must be unique"
                ),
            );
            return false;
        }
        seen.insert(text.clone(), self.d.line(span.start));
        true
    }

    fn timeout(&mut self, what: &str, value: &Option<Spanned<String>>) -> Option<u64> {
        match value {
            Some(value) => self.duration(what, value),
            None => Some(DEFAULT_TIMEOUT_MS),
        }
    }

    /// A duration such as `"90s"` or `"4h"`, in whole milliseconds, greater than zero.
    fn duration(&mut self, what: &str, value: &Spanned<String>) -> Option<u64> {
        let text = value.get_ref();
        match humantime::parse_duration(text.trim()) {
            Ok(duration) => {
                let ms = u64::try_from(duration.as_millis()).unwrap_or(u64::MAX);
                if ms == 0 {
                    self.d.at(
                        &value.span(),
                        format!(
                            "{what} is \"{text}\", which is less than a millisecond; it must be \
                             at least \"1ms\""
                        ),
                    );
                    return None;
                }
                Some(ms)
            }
            Err(e) => {
                self.d.at(
                    &value.span(),
                    format!(
                        "{what} is \"{text}\", which is not a duration ({e}); write it like \
                         \"90s\", \"10m\" or \"4h\""
                    ),
                );
                None
            }
        }
    }

    /// A whole number greater than zero.
    fn positive(&mut self, what: &str, value: &Spanned<i64>) -> Option<u64> {
        let n = *value.get_ref();
        let message = match n {
            0 => format!(
                "{what} is 0; a limit must be greater than 0 (leave the key out for no limit)"
            ),
            n if n < 0 => format!(
                "{what} is {n}, but a limit cannot be negative; use a number greater than 0, or \
                 leave the key out for no limit"
            ),
            n => return u64::try_from(n).ok(),
        };
        self.d.at(&value.span(), message);
        None
    }

    /// Strings that must not be empty or blank; `None` if any is.
    fn strings(&mut self, values: Vec<Spanned<String>>, message: &str) -> Option<Vec<String>> {
        let mut ok = true;
        let mut out = Vec::with_capacity(values.len());
        for value in values {
            if value.get_ref().trim().is_empty() {
                self.d.at(&value.span(), message);
                ok = false;
            } else {
                out.push(value.into_inner());
            }
        }
        ok.then_some(out)
    }

    /// An optional string that, when present, must not be blank; `false` after reporting a
    /// blank one.
    fn not_blank(&mut self, value: &Option<Spanned<String>>, message: &str) -> bool {
        match value {
            Some(value) if value.get_ref().trim().is_empty() => {
                self.d.at(&value.span(), message);
                false
            }
            _ => true,
        }
    }
}

fn default_lockfiles() -> Vec<String> {
    DEFAULT_LOCKFILES.iter().map(|f| f.to_string()).collect()
}

/// `secret:NAME` with NAME an environment-variable-like name.
fn is_secret_reference(text: &str) -> bool {
    let Some(name) = text.strip_prefix("secret:") else {
        return false;
    };
    let mut chars = name.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// A valid name close to `text`: lowercased, with every other character turned into `-`.
fn suggest_name(text: &str) -> String {
    let name: String = text
        .chars()
        .map(|c| c.to_ascii_lowercase())
        .map(|c| {
            if c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == '-' {
                c
            } else {
                '-'
            }
        })
        .take(MAX_NAME_LEN)
        .collect();
    name
}

/// A valid MCP server name close to `text`: every other character turned into `-`.
fn suggest_server_name(text: &str) -> String {
    let name: String = text
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
                c
            } else {
                '-'
            }
        })
        .take(MAX_NAME_LEN)
        .collect();
    if name.is_empty() {
        "server".to_string()
    } else {
        name
    }
}

fn quoted(names: &[&str]) -> String {
    names
        .iter()
        .map(|n| format!("\"{n}\""))
        .collect::<Vec<_>>()
        .join(", ")
}

fn reversibility(raw: RawReversibility) -> Reversibility {
    match raw {
        RawReversibility::ReadOnly => Reversibility::ReadOnly,
        RawReversibility::Reversible => Reversibility::Reversible,
        RawReversibility::Compensatable => Reversibility::Compensatable,
        RawReversibility::Irreversible => Reversibility::Irreversible,
    }
}

/// "512MiB", "4GiB", "100MB", "1048576" → bytes.
fn parse_bytes(text: &str) -> Option<u64> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (n, unit) = t.split_at(split);
    let n: u64 = n.parse().ok()?;
    let mult: u64 = match unit.trim() {
        "" | "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        "KB" | "kB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        _ => return None,
    };
    n.checked_mul(mult)
}
