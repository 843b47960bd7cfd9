//! Agent steps: one driver decision and the tool calls it makes, each checked by policy before
//! it runs and recorded before and after. A step interrupted by a crash continues from what is
//! recorded: a recorded reply is not asked for again, a finished call is not made again, and a
//! call that was allowed but not finished is rolled back to the tree it started from and made
//! again (every built-in tool acts only on the workspace).

use std::time::Duration;

use keel_core::agent::{ModelReply, Reversibility, ToolCall, ToolSpec};
use keel_core::budget::BudgetName;
use keel_core::context::{self, compact_failure};
use keel_core::contract::{PhaseKind, Tier, Verifier};
use keel_core::errorfp::error_fingerprint;
use keel_core::event::{
    Block, BudgetStop, Decision, EffectStatus, EventBody, Gate, StepId, effect_key,
};
use keel_core::run::cut;
use keel_core::state::RunState;
use keel_core::tools;
use keel_tools::ToolError;

use crate::driver::{DriverError, SendContext};
use crate::{Engine, EngineError, Progress, process};

/// How much of a call's arguments an event keeps (the whole reply is an artifact).
const ARGUMENT_BYTES: usize = 4096;
/// A command line for people to read (and paste): each word quoted for a POSIX shell when it
/// needs it. keel itself never runs it through a shell.
pub(crate) fn shell_words(argv: &[String]) -> String {
    argv.iter()
        .map(|w| {
            if !w.is_empty()
                && w.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_./=:,@%+".contains(c))
            {
                w.clone()
            } else {
                format!("'{}'", w.replace('\'', "'\\''"))
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// How much of an `http` response is read; the rest is cut.
const HTTP_RESPONSE_BYTES: u64 = 1 << 20;
/// How much of a `run` call's output the driver reads.
const RUN_OUTPUT_BYTES: usize = 6000;

/// What the policy check concluded about one call.
/// An agent phase's tools: their names as the phase offers them and their specifications.
pub(crate) struct PhaseTools {
    names: Vec<String>,
    specs: Vec<ToolSpec>,
    /// The tokens of every prompt of the phase that do not depend on the run's state, as the
    /// driver counts them.
    fixed_tokens: std::sync::OnceLock<u64>,
}

struct Verdict {
    decision: Decision,
    rule: String,
    reversibility: Reversibility,
    /// The tool honours the call's idempotency key.
    keyed: bool,
    /// The parsed arguments, when they parsed.
    args: serde_json::Value,
}

/// A tool call's outcome before it is recorded.
struct Outcome {
    ok: bool,
    observation: String,
    full: Option<Vec<u8>>,
    changed: Vec<String>,
    error: Option<String>,
    /// Events the call adds beside its `tool_call_finished` (plan, note, finish).
    extra: Vec<EventBody>,
}

impl Outcome {
    fn failed(observation: String) -> Outcome {
        Outcome {
            ok: false,
            ..Outcome::ok(observation)
        }
    }

    fn ok(observation: String) -> Outcome {
        Outcome {
            ok: true,
            observation,
            full: None,
            changed: Vec::new(),
            error: None,
            extra: Vec::new(),
        }
    }
}

impl Engine<'_> {
    /// An agent phase's objective, tools as the contract lists them, and step timeout.
    fn agent_phase(&self, phase: u32) -> (&str, &[String], u64) {
        match self.contract.phases.get(phase as usize).map(|p| &p.kind) {
            Some(PhaseKind::Agent {
                objective,
                tools,
                timeout_ms,
            }) => (objective, tools, *timeout_ms),
            _ => ("", &[], 0),
        }
    }

    /// Runs (or continues, after a crash) the agent step `id`.
    pub(crate) fn agent_step(&mut self, id: StepId) -> Result<(), EngineError> {
        if self.run.in_progress.is_none()
            && self.run.state == RunState::Executing
            && let Some(q) = self.run.pending_question().cloned()
        {
            // A question nobody answered yet: the run waits for it before its next step (a log
            // written before the wait was stored with the step's end can be here).
            return self.wait_for_answer(&q);
        }
        let (objective, _, timeout_ms) = self.agent_phase(id.phase);
        let objective = objective.to_string();
        let tools = self.phase_tools(id.phase);
        let (tool_names, specs) = (&tools.names, &tools.specs);
        if self.run.in_progress.is_none() {
            let mut bodies = Vec::new();
            if self.run.state != RunState::Executing {
                bodies.push(self.state_change(
                    RunState::Executing,
                    "working on the next step",
                    None,
                ));
            }
            let phase = &self.run.phases[id.phase as usize];
            if phase.step_count() == 0 {
                let name = phase.name.clone();
                self.observer.progress(
                    &self.run,
                    Progress::Phase {
                        index: id.phase,
                        count: self.run.phases.len() as u32,
                        name: &name,
                    },
                );
                bodies.push(EventBody::PhaseStarted {
                    phase: id.phase,
                    name,
                });
            }
            bodies.push(EventBody::StepStarted {
                step: id,
                attempt: 1,
                command: format!("agent step {}", id.index + 1),
                agent: true,
            });
            let pre_tree = self.run.fingerprint.tree.clone();
            self.pin_tree("step", &pre_tree)?;
            // Stored with whatever the step does first outside keel, or with its end.
            self.stage(bodies)?;
            self.fresh_step = Some(id);
        }
        let driver_label = self.driver_label();
        self.observer.progress(
            &self.run,
            Progress::Step {
                step: id,
                steps: 0,
                attempt: 1,
                command: &driver_label,
            },
        );
        let Some(reply) = self.decide(id, &objective, &tools)? else {
            return Ok(());
        };
        let mut blocked_by_driver = None;
        let mut finished = false;
        let mut outcomes = Vec::new();
        for (i, call) in reply.calls.iter().enumerate() {
            let i = i as u32;
            let recorded = self
                .run
                .in_progress
                .as_ref()
                .and_then(|p| p.calls.get(i as usize))
                .cloned();
            let verdict = self.check(id, i, call, tool_names, specs, finished);
            let verdict = match recorded {
                Some(c) if c.finished || c.decision == Decision::Deny => verdict,
                Some(c) if c.decision == Decision::NeedsApproval => {
                    // The call waited for a person; their decision is recorded as the call's.
                    match self.call_approval(Gate::ToolCall { step: id, call: i }) {
                        Some((n, Some(d))) if d.approve => {
                            let verdict = Verdict {
                                decision: Decision::Allow,
                                rule: format!("approved by {} (request {n}): {}", d.by, d.reason),
                                ..verdict
                            };
                            self.decide_call(id, i, call, &verdict)?;
                            self.execute(id, i, call, &verdict, timeout_ms)?;
                            verdict
                        }
                        Some((n, Some(d))) => {
                            let verdict = Verdict {
                                decision: Decision::Deny,
                                rule: format!(
                                    "a person rejected this call (request {n}, by {}): {}",
                                    d.by, d.reason
                                ),
                                ..verdict
                            };
                            self.decide_call(id, i, call, &verdict)?;
                            verdict
                        }
                        // Asked, not decided yet: the run waits.
                        Some((_, None)) => return Ok(()),
                        // keel stopped after deciding to ask and before the request was
                        // stored: ask now.
                        None => return self.request_call_approval(id, i, call, &verdict),
                    }
                }
                Some(c) => {
                    // Allowed before a crash but not recorded as finished.
                    match &c.effect {
                        Some(e)
                            if e.status == EffectStatus::Unknown
                                || (e.status == EffectStatus::Intended
                                    && !e.keyed
                                    && matches!(
                                        e.class,
                                        Reversibility::Compensatable | Reversibility::Irreversible
                                    )) =>
                        {
                            let key = e.key.clone();
                            let gate = Gate::Reconcile {
                                step: id,
                                call: i,
                                key: key.clone(),
                            };
                            match self.call_approval(gate) {
                                None if e.status == EffectStatus::Intended => {
                                    return self.request_reconciliation(id, i, call, &key);
                                }
                                None | Some((_, None)) => return Ok(()),
                                Some((n, Some(d))) if !d.approve => {
                                    self.commit(vec![EventBody::ToolCallFinished {
                                        step: id,
                                        call: i,
                                        ok: false,
                                        observation: format!(
                                            "the outcome of this call is unknown (keel was \
                                             interrupted while making it); a person chose not \
                                             to repeat it (request {n}, by {}): {}",
                                            d.by, d.reason
                                        ),
                                        output: None,
                                        changed: Vec::new(),
                                        error_fingerprint: None,
                                        post_tree: Some(self.env.git.worktree_tree()?),
                                    }])?;
                                }
                                Some((_, Some(_))) => {
                                    self.restore_call_tree(&c)?;
                                    self.execute(id, i, call, &verdict, timeout_ms)?;
                                }
                            }
                        }
                        // Read-only, reversible (undone with the tree) or keyed (the service
                        // recognises the same key): made again.
                        _ => {
                            self.restore_call_tree(&c)?;
                            self.execute(id, i, call, &verdict, timeout_ms)?;
                        }
                    }
                    verdict
                }
                None => {
                    self.decide_call(id, i, call, &verdict)?;
                    fault_point("policy decided");
                    match verdict.decision {
                        Decision::Allow => self.execute(id, i, call, &verdict, timeout_ms)?,
                        Decision::NeedsApproval => {
                            return self.request_call_approval(id, i, call, &verdict);
                        }
                        Decision::Deny => {}
                    }
                    verdict
                }
            };
            if verdict.decision == Decision::Allow {
                match call.name.as_str() {
                    "finish" => finished = true,
                    "blocked" => {
                        blocked_by_driver = Some((
                            verdict.args["category"]
                                .as_str()
                                .unwrap_or("other")
                                .to_string(),
                            verdict.args["reason"].as_str().unwrap_or("").to_string(),
                        ))
                    }
                    _ => {}
                }
            }
            outcomes.push(format!(
                "{}:{}:{:?}",
                call.name,
                call.arguments,
                self.run.observations.last().map(|o| &o.text)
            ));
        }
        // What the step leads to (waiting for its question, or the driver's stop) is stored in
        // the same commit as the step's end: a crash or a failed commit in between must not
        // keep the step and lose where it leads.
        let question = self
            .run
            .pending_question()
            .filter(|q| q.step == id)
            .cloned();
        let then = match (&question, &blocked_by_driver) {
            (Some(q), _) => Some((RunState::Waiting, self.waiting_reason(q), None)),
            (None, Some((category, reason))) => Some((
                RunState::Blocked,
                format!("the driver stopped the run ({category}): {reason}"),
                Some(Block::Driver {
                    category: category.clone(),
                    reason: reason.clone(),
                }),
            )),
            (None, None) => None,
        };
        self.finish_agent_step(id, &outcomes, then.clone())?;
        if let Some(q) = question
            && matches!(self.run.state, RunState::Executing | RunState::Waiting)
        {
            return self.wait_for_answer(&q);
        }
        if let Some((to @ RunState::Blocked, text, block)) = then {
            self.set_state(to, &text, block)?;
        }
        // A loop this step completed was blocked on in the step's last commit.
        Ok(())
    }

    /// What the `http` tool may reach, from the contract's `[scope] http` rules.
    pub(crate) fn http_policy(&self) -> keel_tools::http::HttpPolicy {
        keel_tools::http::HttpPolicy {
            allow: self
                .contract
                .scope
                .http
                .iter()
                .map(|r| keel_tools::http::HttpRule {
                    host: r.host.clone(),
                    port: r.port,
                    methods: r.methods.clone(),
                })
                .collect(),
            max_response_bytes: HTTP_RESPONSE_BYTES,
            timeout: Duration::from_secs(60),
        }
    }

    /// The environment variables carrying `names`' secret values, resolved now.
    pub(crate) fn secret_env(&self, names: &[String]) -> Result<Vec<(String, String)>, String> {
        if names.is_empty() {
            return Ok(Vec::new());
        }
        let file = self.secrets_file();
        let secrets = crate::secrets::resolve(
            names,
            &|name: &str| std::env::var(name).ok(),
            file.exists().then_some(file.as_path()),
        )
        .map_err(|e| e.to_string())?;
        Ok(secrets
            .iter()
            .map(|s| (s.name().to_string(), s.expose().to_string()))
            .collect())
    }

    /// The tools agent phase `phase` offers (`server.*` expanded) and their specifications,
    /// made once per phase: the contract and the MCP servers' tool lists do not change while
    /// the engine lives.
    fn phase_tools(&mut self, phase: u32) -> std::sync::Arc<PhaseTools> {
        if let Some((at, tools)) = &self.phase_tools
            && *at == phase
        {
            return tools.clone();
        }
        let names = self.mcp.expand(self.agent_phase(phase).1);
        let specs = names.iter().filter_map(|t| self.spec_of(t)).collect();
        let tools = std::sync::Arc::new(PhaseTools {
            names,
            specs,
            fixed_tokens: std::sync::OnceLock::new(),
        });
        self.phase_tools = Some((phase, tools.clone()));
        tools
    }

    /// A built-in or contract-defined tool's specification.
    fn spec_of(&self, name: &str) -> Option<ToolSpec> {
        tools::builtin(name)
            .cloned()
            .or_else(|| self.contract.tool(name).map(|t| t.spec()))
            .or_else(|| self.mcp.spec(name))
    }

    /// Records the policy decision on call `i` (and, for an allowed call with an external effect,
    /// the intended effect with its key) before anything runs.
    fn decide_call(
        &mut self,
        id: StepId,
        i: u32,
        call: &ToolCall,
        verdict: &Verdict,
    ) -> Result<(), EngineError> {
        let effectful = verdict.reversibility != Reversibility::ReadOnly;
        let pre_tree = match verdict.decision {
            Decision::Allow if effectful => Some(self.env.git.worktree_tree()?),
            _ => None,
        };
        if let Some(tree) = &pre_tree {
            self.pin_tree("call", tree)?;
        }
        let error_fingerprint = (verdict.decision == Decision::Deny).then(|| {
            error_fingerprint(&format!("policy {}", call.name), "denied", &verdict.rule).0
        });
        let mut bodies = vec![EventBody::PolicyDecision {
            step: id,
            call: i,
            tool: call.name.clone(),
            arguments: cut(&call.arguments, ARGUMENT_BYTES),
            decision: verdict.decision,
            rule: verdict.rule.clone(),
            reversibility: verdict.reversibility,
            pre_tree,
            error_fingerprint,
        }];
        let reaches_out = verdict.decision == Decision::Allow && !self.in_process(&call.name);
        if verdict.decision == Decision::Allow && effectful {
            let key = effect_key(&self.run.id, id, i);
            bodies.push(EventBody::EffectIntended {
                step: id,
                call: i,
                tool: call.name.clone(),
                class: verdict.reversibility,
                keyed: verdict.keyed,
                payload: cut(
                    &self.effect_payload(call, &verdict.args, &key),
                    ARGUMENT_BYTES,
                ),
                compensation: self
                    .contract
                    .tool(&call.name)
                    .and_then(|t| t.compensation(&verdict.args, &key))
                    .map(|argv| shell_words(&argv)),
                key,
            });
        }
        // A call that reaches outside keel is made only once its decision is stored; one of
        // keel's own read-only tools waits for the next commit.
        if reaches_out || verdict.decision == Decision::NeedsApproval {
            self.commit(bodies)?;
        } else {
            self.stage(bodies)?;
        }
        if verdict.decision == Decision::Allow && effectful {
            fault_point("effect intended");
        }
        Ok(())
    }

    /// What a call attempts, in words a person checking an external system can use.
    fn effect_payload(&self, call: &ToolCall, args: &serde_json::Value, key: &str) -> String {
        let s = |k: &str| {
            args.get(k)
                .and_then(serde_json::Value::as_str)
                .unwrap_or("")
        };
        match call.name.as_str() {
            "run" => format!("sh -c {}", shell_words(&[s("command").to_string()])),
            "write" => format!("write {}", s("path")),
            "patch" => format!("patch\n{}", s("diff")),
            "http" => format!(
                "{} {} (Idempotency-Key: {key})\n{}",
                s("method"),
                s("url"),
                s("body")
            ),
            name => match self.contract.tool(name) {
                Some(t) => shell_words(&t.argv(args, key)),
                None if self.mcp.class(name).is_some() => {
                    self.mcp.describe_call(name, &call.arguments)
                }
                None => format!("{name} {}", call.arguments),
            },
        }
    }

    /// The newest request guarding `gate`, if one was made: its number and, once a person
    /// decided, the decision.
    fn call_approval(&self, gate: Gate) -> Option<(u32, Option<keel_core::run::ApprovalDecision>)> {
        self.run
            .approvals
            .iter()
            .rev()
            .find(|a| a.request.gate == gate)
            .map(|a| (a.request.n, a.decision.clone()))
    }

    /// Puts the tree back to where an interrupted call started.
    fn restore_call_tree(&mut self, c: &keel_core::run::CallProgress) -> Result<(), EngineError> {
        if let Some(pre) = &c.pre_tree {
            self.put_back(pre, &format!("a `{}` call was interrupted", c.tool), true)?;
        }
        Ok(())
    }

    fn driver_label(&self) -> String {
        match &self.contract.driver {
            Some(d) => match &d.model {
                Some(m) => format!("{} {m}", d.kind),
                None => d.kind.to_string(),
            },
            None => "driver".into(),
        }
    }

    /// The driver's reply for this step: recorded, or asked for now (re-sending the recorded
    /// request after a crash). `None` when the run stopped instead.
    fn decide(
        &mut self,
        id: StepId,
        objective: &str,
        tools: &PhaseTools,
    ) -> Result<Option<ModelReply>, EngineError> {
        let specs = &tools.specs;
        if let Some(reply) = self.run.in_progress.as_ref().and_then(|p| p.reply.clone()) {
            return Ok(Some(reply));
        }
        let recorded = self
            .run
            .in_progress
            .as_ref()
            .and_then(|p| p.request.clone());
        let request = match recorded {
            Some(hash) => {
                // A delegated program may have half-changed the workspace before the crash.
                let pre = self.run.in_progress.as_ref().map(|p| p.pre.tree.clone());
                if let Some(pre) = pre {
                    self.put_back(&pre, &format!("step {id} was interrupted"), false)?;
                }
                self.store
                    .read_run_artifact(&self.run.id, &hash, usize::MAX)?
            }
            None => {
                let limit = self
                    .contract
                    .driver
                    .as_ref()
                    .map_or(keel_core::contract::DEFAULT_CONTEXT_TOKENS, |d| {
                        d.context_budget()
                    });
                let driver = self
                    .driver
                    .as_ref()
                    .ok_or_else(|| EngineError::Usage("an agent phase needs a [driver]".into()))?;
                let fixed = *tools
                    .fixed_tokens
                    .get_or_init(|| context::fixed_tokens(specs, driver.counter()));
                let prompt = match context::assemble_within(
                    &self.contract,
                    &self.run,
                    id.phase as usize,
                    objective,
                    fixed,
                    driver.counter(),
                    limit,
                ) {
                    Ok(p) => p,
                    Err(e) => {
                        self.fail_driver(id, &e.to_string())?;
                        return Ok(None);
                    }
                };
                let bytes = driver.request(&prompt, specs);
                let local = driver.local();
                // Stored against the run's earlier requests, which it mostly repeats.
                let series = format!("{}/request", self.run.id);
                let hash = self.store.put_artifact_in(&series, &bytes)?;
                self.stage(vec![EventBody::ModelRequested {
                    step: id,
                    request: hash,
                    prompt_tokens: prompt.tokens,
                    context_tokens: limit,
                }])?;
                // A model that costs money or a program that acts must find the request
                // stored: a crash then re-sends these exact bytes and counts what they cost.
                if !local {
                    self.flush()?;
                }
                bytes
            }
        };
        fault_point("model request recorded");
        let ctx = SendContext {
            confinement: &self.env.confinement,
            workspace: &self.env.workspace,
            tmp: &self.env.tmp,
            run_id: &self.run.id,
            step: id.to_string(),
            call_no: self.run.model_calls + 1,
        };
        let Some(driver) = self.driver.as_mut() else {
            return Err(EngineError::Usage("an agent phase needs a [driver]".into()));
        };
        let exchange = match driver.send(&request, &ctx) {
            Ok(x) => x,
            Err(DriverError(message)) => {
                self.fail_driver(id, &message)?;
                return Ok(None);
            }
        };
        fault_point("model replied");
        let mut reply = driver
            .parse(&exchange.response)
            .unwrap_or_else(|problem| ModelReply {
                text: Some(format!("(keel could not read this reply: {problem})")),
                calls: Vec::new(),
                usage: Default::default(),
                stop_reason: None,
            });
        crate::mcp::unwire_calls(&mut reply, specs);
        let cost = driver.cost(reply.usage);
        let post_tree = if driver.edits_workspace() {
            Some(self.env.git.worktree_tree()?)
        } else {
            None
        };
        let response = self.store.put_artifact(&exchange.response)?;
        let edits = driver.edits_workspace();
        let replied = vec![EventBody::ModelReplied {
            step: id,
            response,
            usage: reply.usage,
            reply: reply.clone(),
            cost_micro_usd: cost,
            retries: exchange.retries,
            duration_ms: exchange.duration_ms,
            post_tree,
        }];
        // The reply is stored with the next commit, which comes before anything reaches
        // outside keel: a call of a tool outside keel stores its decision first, and the step's
        // end goes with the next request, which is stored before it is sent. Between the two
        // is only keel's own work (its read-only tools, the next prompt). A delegated
        // program's reply (it changed the workspace) is stored at once.
        if edits {
            self.commit(replied)?;
        } else {
            self.stage(replied)?;
        }
        // The reply as recorded (scrubbed of secrets): what a resume would read, so the calls
        // made now and after a crash are the same.
        Ok(self
            .run
            .in_progress
            .as_ref()
            .and_then(|p| p.reply.clone())
            .or(Some(reply)))
    }

    /// The driver could not answer: the step ends failed and the run is blocked with why.
    fn fail_driver(&mut self, id: StepId, message: &str) -> Result<(), EngineError> {
        let (fp, _) = error_fingerprint("driver", "failed", message);
        let reason = format!("the driver could not decide: {message}");
        self.commit(vec![
            EventBody::StepFailed {
                step: id,
                reason: reason.clone(),
                error_fingerprint: fp,
                excerpt: cut(message, 500),
                rolled_back: Vec::new(),
                kept: true,
            },
            self.state_change_after_fail(&reason, message),
        ])
    }

    fn state_change_after_fail(&self, reason: &str, message: &str) -> EventBody {
        EventBody::StateChanged {
            from: self.run.state,
            to: RunState::Blocked,
            reason: reason.to_string(),
            block: Some(Block::DriverFailed {
                message: message.to_string(),
            }),
        }
    }

    /// The policy check of one call: nothing runs that this does not allow.
    fn check(
        &self,
        id: StepId,
        i: u32,
        call: &ToolCall,
        phase_tools: &[String],
        specs: &[ToolSpec],
        after_finish: bool,
    ) -> Verdict {
        let deny = |rule: String, reversibility| Verdict {
            decision: Decision::Deny,
            rule,
            reversibility,
            keyed: false,
            args: serde_json::Value::Null,
        };
        let Some(spec) = specs.iter().find(|s| s.name == call.name) else {
            return match self.spec_of(&call.name) {
                None => deny(
                    format!(
                        "there is no tool `{}`; the tools of this phase are {}",
                        call.name,
                        phase_tools.join(", ")
                    ),
                    Reversibility::Irreversible,
                ),
                Some(spec) => deny(
                    format!(
                        "tool `{}` is not allowed in this phase; its tools are {}",
                        call.name,
                        phase_tools.join(", ")
                    ),
                    spec.reversibility,
                ),
            };
        };
        let class = spec.reversibility;
        if after_finish {
            return deny(
                "a call after finish in the same reply is not made: finish ends the step".into(),
                class,
            );
        }
        let args: serde_json::Value = match serde_json::from_str(&call.arguments) {
            Ok(v) => v,
            Err(e) => {
                return deny(
                    format!("the arguments are not valid JSON ({e}); send a JSON object"),
                    class,
                );
            }
        };
        let problems = tools::check_arguments(&spec.parameters, &args);
        if !problems.is_empty() {
            return deny(
                format!("the arguments do not fit the tool: {}", problems.join("; ")),
                class,
            );
        }
        let scope = &self.contract.scope;
        let path_rule = |path: &str, for_write: bool| -> Option<String> {
            match self.tools.resolve(path, for_write) {
                Err(e) => Some(e.to_string()),
                Ok(r) if for_write && scope.is_forbidden(&r.rel) => Some(format!(
                    "`{}` is forbidden by the contract's scope (forbidden: {})",
                    r.rel,
                    scope.forbidden.join(", ")
                )),
                Ok(r) if for_write && !scope.is_writable(&r.rel) => Some(format!(
                    "`{}` is outside the writable scope (writable: {})",
                    r.rel,
                    scope.writable.join(", ")
                )),
                Ok(_) => None,
            }
        };
        let path_arg = |key: &str| args.get(key).and_then(serde_json::Value::as_str);
        let problem = match call.name.as_str() {
            "read" => path_arg("path").and_then(|p| path_rule(p, false)),
            "list" => path_rule(path_arg("path").unwrap_or("."), false),
            "search" => path_arg("path").and_then(|p| path_rule(p, false)),
            "write" => path_arg("path").and_then(|p| path_rule(p, true)),
            "patch" => match self.tools.patch_paths(path_arg("diff").unwrap_or("")) {
                Err(e) => Some(e.to_string()),
                Ok(paths) => paths.iter().find_map(|p| path_rule(p, true)),
            },
            "run" => {
                let command = path_arg("command").unwrap_or("");
                match simple_commands(command) {
                    _ if scope.commands.is_empty() => None,
                    Err(why) => Some(format!(
                        "command `{}` {why}; with [scope] commands set, run one allowed command at a time",
                        cut(command, 200)
                    )),
                    Ok(parts) => parts
                        .iter()
                        .find(|part| !scope.command_allowed(part))
                        .map(|part| {
                            format!(
                                "command `{}` is not allowed by the contract's scope (commands: {})",
                                cut(part, 200),
                                scope.commands.join(", ")
                            )
                        }),
                }
            }
            "http" => keel_tools::http::check(&self.http_policy(), &http_request(&args))
                .err()
                .map(|denied| denied.to_string()),
            _ => None,
        };
        if let Some(rule) = problem {
            return deny(rule, class);
        }
        let (class, keyed) = self.call_class(call, &args);
        let writes = class != Reversibility::ReadOnly;
        for (budget, applies) in [
            (BudgetName::ToolCalls, true),
            (BudgetName::Tokens, true),
            (BudgetName::CostUsd, true),
            (BudgetName::Writes, writes),
            (BudgetName::Approvals, call.name == "ask"),
            (BudgetName::NetworkRequests, call.name == "http"),
        ] {
            if let Some(limit) = self.run.limits.get(budget)
                && applies
                && self.run.used(budget) >= limit
            {
                return deny(
                    format!(
                        "budget `{budget}` exhausted: used {} of {}",
                        budget.format_amount(self.run.used(budget)),
                        budget.format_amount(limit)
                    ),
                    class,
                );
            }
        }
        let tool_approval = self.contract.tool(&call.name).is_some_and(|t| t.approval)
            || self.mcp.needs_approval(&call.name);
        if tool_approval || self.contract.approvals.require.contains(&class) {
            let why = if tool_approval {
                format!("the contract says tool `{}` needs approval", call.name)
            } else {
                format!("[approvals] require lists {class} calls")
            };
            return Verdict {
                decision: Decision::NeedsApproval,
                rule: format!(
                    "`{}` is allowed, but {why}; key {}",
                    call.name,
                    effect_key(&self.run.id, id, i)
                ),
                reversibility: class,
                keyed,
                args,
            };
        }
        Verdict {
            decision: Decision::Allow,
            rule: format!("`{}` is allowed in this phase and within scope", call.name),
            reversibility: class,
            keyed,
            args,
        }
    }

    /// The reversibility class of one call, and whether its tool honours an idempotency key.
    fn call_class(&self, call: &ToolCall, args: &serde_json::Value) -> (Reversibility, bool) {
        match call.name.as_str() {
            // With the network, a command can reach beyond the workspace.
            "run" if self.contract.scope.network => (Reversibility::Irreversible, false),
            "http" => match args.get("method").and_then(serde_json::Value::as_str) {
                Some("GET" | "HEAD") => (Reversibility::ReadOnly, false),
                _ => (Reversibility::Irreversible, true),
            },
            name => match self.contract.tool(name) {
                Some(t) => (t.reversibility, t.idempotency_key.is_some()),
                None if let Some(class) = self.mcp.class(name) => (class, false),
                None => (
                    tools::builtin(name).map_or(Reversibility::Irreversible, |s| s.reversibility),
                    false,
                ),
            },
        }
    }

    /// Makes one allowed call and records its outcome.
    fn execute(
        &mut self,
        id: StepId,
        i: u32,
        call: &ToolCall,
        verdict: &Verdict,
        timeout_ms: u64,
    ) -> Result<(), EngineError> {
        let key = effect_key(&self.run.id, id, i);
        let outcome = self.make(id, call, &verdict.args, &key, timeout_ms)?;
        fault_point("tool call made");
        let output = match &outcome.full {
            Some(bytes) if bytes.len() > outcome.observation.len() => {
                Some(self.store.put_artifact(bytes)?)
            }
            _ => None,
        };
        let post_tree = match verdict.reversibility {
            Reversibility::ReadOnly => None,
            _ => Some(self.env.git.worktree_tree()?),
        };
        let effect = self
            .run
            .in_progress
            .as_ref()
            .and_then(|p| p.calls.get(i as usize))
            .and_then(|c| c.effect.as_ref())
            .map(|e| e.key.clone());
        let mut bodies = outcome.extra;
        let detail = cut(
            outcome.observation.lines().next().unwrap_or(""),
            ARGUMENT_BYTES / 16,
        );
        let ok = outcome.ok;
        bodies.push(EventBody::ToolCallFinished {
            step: id,
            call: i,
            ok,
            observation: outcome.observation,
            output,
            changed: outcome.changed,
            error_fingerprint: outcome.error,
            post_tree,
        });
        let inside = effect.is_none() && self.in_process(&call.name);
        if let Some(key) = effect {
            bodies.push(EventBody::EffectSettled {
                step: id,
                call: i,
                key,
                status: if ok {
                    EffectStatus::Done
                } else {
                    EffectStatus::Failed
                },
                detail,
            });
        }
        if inside {
            self.stage(bodies)
        } else {
            self.commit(bodies)
        }
    }

    /// One of keel's own read-only tools (read, list, search, plan, note, ask, finish,
    /// blocked): it runs inside keel's process and changes nothing outside it.
    pub(crate) fn in_process(&self, name: &str) -> bool {
        self.contract.tool(name).is_none()
            && self.mcp.class(name).is_none()
            && name != "http"
            && tools::builtin(name).is_some_and(|s| s.reversibility == Reversibility::ReadOnly)
    }

    fn make(
        &mut self,
        id: StepId,
        call: &ToolCall,
        args: &serde_json::Value,
        key: &str,
        timeout_ms: u64,
    ) -> Result<Outcome, EngineError> {
        // A call that reaches outside keel is made only once what led to it is stored (its
        // decision was committed: this stores nothing more).
        if !self.in_process(&call.name) {
            self.flush()?;
        }
        let s = |key: &str| args.get(key).and_then(serde_json::Value::as_str);
        let n = |key: &str| args.get(key).and_then(serde_json::Value::as_u64);
        let result = match call.name.as_str() {
            "read" => self
                .tools
                .read(s("path").unwrap_or(""), n("offset"), n("limit")),
            "list" => self
                .tools
                .list(s("path").unwrap_or("."), n("depth").map(|d| d as u32)),
            "search" => self.tools.search(
                s("pattern").unwrap_or(""),
                s("path"),
                n("max_results").map(|d| d as u32),
            ),
            "write" => self
                .tools
                .write(s("path").unwrap_or(""), s("content").unwrap_or("")),
            "patch" => self.tools.patch(s("diff").unwrap_or("")),
            "run" => {
                return self.run_tool(
                    id,
                    s("command").unwrap_or(""),
                    n("timeout_seconds"),
                    timeout_ms,
                );
            }
            "plan" => {
                let items: Vec<String> = args["items"]
                    .as_array()
                    .map(|a| {
                        a.iter()
                            .filter_map(|v| v.as_str().map(str::to_string))
                            .collect()
                    })
                    .unwrap_or_default();
                let mut o = Outcome::ok(format!(
                    "plan updated (version {}, {} items)",
                    self.run.plan_version + 1,
                    items.len()
                ));
                o.extra.push(EventBody::PlanUpdated { step: id, items });
                return Ok(o);
            }
            "note" => {
                let mut o = Outcome::ok("noted".into());
                o.extra.push(EventBody::NoteAdded {
                    step: id,
                    text: s("text").unwrap_or("").to_string(),
                });
                return Ok(o);
            }
            "finish" => {
                let mut o = Outcome::ok(
                    "finish claimed: keel runs the verifiers; only passing evidence ends the phase"
                        .into(),
                );
                o.extra.push(EventBody::FinishClaimed {
                    step: id,
                    summary: s("summary").unwrap_or("").to_string(),
                });
                return Ok(o);
            }
            "ask" => {
                let n = self.run.questions.len() as u32 + 1;
                let mut o = Outcome::ok(format!(
                    "question {n} asked; the run waits for a person's answer, which comes back as an observation"
                ));
                o.extra.push(EventBody::QuestionAsked {
                    n,
                    step: id,
                    question: s("question").unwrap_or("").to_string(),
                });
                return Ok(o);
            }
            "blocked" => {
                return Ok(Outcome::ok(format!(
                    "blocked ({}): {}",
                    s("category").unwrap_or("other"),
                    s("reason").unwrap_or("")
                )));
            }
            "http" => return self.http_tool(args, key),
            other if self.contract.tool(other).is_some() => {
                return self.contract_tool(id, other, args, key, timeout_ms);
            }
            other if self.mcp.class(other).is_some() => {
                let timeout = self.command_timeout(self.mcp.timeout_ms(other), timeout_ms);
                let made = self.mcp.make(other, args, timeout);
                return Ok(Outcome {
                    ok: made.ok,
                    observation: made.observation,
                    full: Some(made.full),
                    changed: Vec::new(),
                    error: made.error,
                    extra: Vec::new(),
                });
            }
            other => {
                return Ok(Outcome {
                    ok: false,
                    observation: format!("tool `{other}` cannot be made"),
                    full: None,
                    changed: Vec::new(),
                    error: None,
                    extra: Vec::new(),
                });
            }
        };
        Ok(match result {
            Ok(out) => Outcome {
                ok: true,
                observation: out.observation,
                full: Some(out.full),
                changed: out.changed,
                error: None,
                extra: Vec::new(),
            },
            Err(e) => {
                let text = e.to_string();
                let (fp, _) =
                    error_fingerprint(&format!("tool {}", call.name), tool_error_kind(&e), &text);
                Outcome {
                    ok: false,
                    observation: text,
                    full: None,
                    changed: Vec::new(),
                    error: Some(fp),
                    extra: Vec::new(),
                }
            }
        })
    }

    /// How long a command of this step may run: the asked or tool timeout, within the phase's,
    /// within what is left of the wall-time budget.
    fn command_timeout(&self, asked_ms: Option<u64>, phase_timeout_ms: u64) -> Duration {
        let mut timeout = Duration::from_millis(phase_timeout_ms);
        if let Some(ms) = asked_ms {
            timeout = timeout.min(Duration::from_millis(ms));
        }
        if let Some(limit) = self.run.limits.get(BudgetName::WallTime) {
            let left = limit.saturating_sub(self.run.used(BudgetName::WallTime));
            timeout = timeout.min(Duration::from_millis(left.max(1)));
        }
        timeout
    }

    fn run_tool(
        &mut self,
        id: StepId,
        command: &str,
        asked_seconds: Option<u64>,
        phase_timeout_ms: u64,
    ) -> Result<Outcome, EngineError> {
        let timeout = self.command_timeout(
            asked_seconds.map(|s| s.saturating_mul(1000)),
            phase_timeout_ms,
        );
        let env = self.command_env(Some(id));
        self.command_tool(
            process::Program::Shell(command),
            command,
            env,
            timeout,
            None,
        )
    }

    /// A contract-defined tool: its argv filled from the arguments, run without a shell, with
    /// its key and its declared secrets in the environment.
    fn contract_tool(
        &mut self,
        id: StepId,
        name: &str,
        args: &serde_json::Value,
        key: &str,
        phase_timeout_ms: u64,
    ) -> Result<Outcome, EngineError> {
        let Some(tool) = self.contract.tool(name).cloned() else {
            return Ok(Outcome::failed(format!("tool `{name}` cannot be made")));
        };
        let argv = tool.argv(args, key);
        let timeout = self.command_timeout(tool.timeout_ms, phase_timeout_ms);
        let mut env: Vec<(String, String)> = self
            .command_env(Some(id))
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
        if let Some(keel_core::contract::KeyPassing::Env(var)) = &tool.idempotency_key {
            env.push((var.clone(), key.to_string()));
        }
        match self.secret_env(&tool.secrets) {
            Ok(secrets) => env.extend(secrets),
            Err(e) => return Ok(Outcome::failed(e)),
        }
        let env: Vec<(&str, String)> = env.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
        let label = shell_words(&argv);
        self.command_tool(
            process::Program::Argv(&argv),
            &label,
            env,
            timeout,
            tool.network,
        )
    }

    /// Runs one command of a tool call and describes what came of it.
    fn command_tool(
        &mut self,
        program: process::Program<'_>,
        label: &str,
        env: Vec<(&str, String)>,
        timeout: Duration,
        network: Option<bool>,
    ) -> Result<Outcome, EngineError> {
        let before = self.env.git.worktree_tree()?;
        let out = self.output_path("run");
        let outcome = self
            .env
            .confinement
            .run(program, &env, &out, timeout, None, network)
            .map_err(|e| EngineError::io(&out, e))?;
        let full = std::fs::read(&out).unwrap_or_default();
        let _ = std::fs::remove_file(&out);
        let after = self.env.git.worktree_tree()?;
        let changed = if after == before {
            Vec::new()
        } else {
            self.env
                .git
                .diff(&before, &after)?
                .changes
                .into_iter()
                .map(|c| c.path)
                .collect()
        };
        let text = String::from_utf8_lossy(&full);
        let tail = text
            .get(text.len().saturating_sub(RUN_OUTPUT_BYTES)..)
            .unwrap_or(&text);
        let shown = if outcome.success {
            tail.to_string()
        } else {
            compact_failure(&text, 60)
        };
        let observation = format!("{}\n{}", outcome.status, shown.trim_end());
        let error = (!outcome.success).then(|| error_fingerprint(label, &outcome.status, &text).0);
        Ok(Outcome {
            ok: outcome.success,
            observation,
            full: Some(full),
            changed,
            error,
            extra: Vec::new(),
        })
    }

    /// The `http` tool: the contract's allow-list is checked again here (the policy check
    /// already refused what it does not allow), the key goes in `Idempotency-Key`.
    fn http_tool(&mut self, args: &serde_json::Value, key: &str) -> Result<Outcome, EngineError> {
        let request = http_request(args);
        let policy = self.http_policy();
        let keyed = !matches!(request.method.as_str(), "GET" | "HEAD");
        match keel_tools::http::send(&policy, &request, keyed.then_some(key)) {
            Ok(response) => {
                let body = String::from_utf8_lossy(&response.body);
                let status_line = format!(
                    "HTTP {}{}",
                    response.status,
                    if response.truncated {
                        format!(" (body cut at {} bytes)", policy.max_response_bytes)
                    } else {
                        String::new()
                    }
                );
                let observation = format!("{status_line}\n{}", cut(&body, RUN_OUTPUT_BYTES));
                let ok = response.status < 400;
                let error = (!ok).then(|| {
                    error_fingerprint(
                        &format!("http {} {}", request.method, request.url),
                        &response.status.to_string(),
                        &body,
                    )
                    .0
                });
                let mut full = format!("{status_line}\n").into_bytes();
                for (k, v) in &response.headers {
                    full.extend_from_slice(format!("{k}: {v}\n").as_bytes());
                }
                full.push(b'\n');
                full.extend_from_slice(&response.body);
                Ok(Outcome {
                    ok,
                    observation,
                    full: Some(full),
                    changed: Vec::new(),
                    error,
                    extra: Vec::new(),
                })
            }
            Err(e) => {
                let text = e.to_string();
                let fp = error_fingerprint(&format!("http {}", request.url), "error", &text).0;
                let mut o = Outcome::failed(text);
                o.error = Some(fp);
                Ok(o)
            }
        }
    }

    /// After the calls: changes outside the scope are undone and recorded, the step's result is
    /// recorded, and step verifiers judge a changed workspace. `then` is the state the step
    /// leads to (waiting for its question, the driver's stop), stored in the same commit as the
    /// step's last event.
    fn finish_agent_step(
        &mut self,
        id: StepId,
        outcomes: &[String],
        then: Option<(RunState, String, Option<Block>)>,
    ) -> Result<(), EngineError> {
        let then = |engine: &Self| {
            then.clone()
                .filter(|_| engine.run.state == RunState::Executing)
                .map(|(to, reason, block)| engine.state_change(to, &reason, block))
        };
        let pre = self
            .run
            .in_progress
            .as_ref()
            .map(|p| p.pre.tree.clone())
            .unwrap_or_default();
        // A step this process ran from its start, in which only keel's own read-only tools
        // ran, left the workspace as it found it: no need to ask git.
        let untouched = self.fresh_step == Some(id)
            && !self.driver.as_ref().is_some_and(|d| d.edits_workspace())
            && self.run.in_progress.as_ref().is_some_and(|p| {
                p.calls
                    .iter()
                    .all(|c| c.decision != Decision::Allow || self.in_process(&c.tool))
            });
        let mut now = if untouched {
            pre.clone()
        } else {
            self.env.git.worktree_tree()?
        };
        if now != pre {
            let scope = &self.contract.scope;
            let outside: Vec<String> = self
                .env
                .git
                .diff(&pre, &now)?
                .changes
                .into_iter()
                .map(|c| c.path)
                .filter(|p| !scope.allows_write(p))
                .collect();
            if !outside.is_empty() {
                // The calls that led here are stored before the workspace changes: a crash in
                // between must find them recorded (see `Run::expected_tree`).
                self.flush()?;
                self.env.git.restore_paths(&pre, &outside)?;
                fault_point("scope reverted");
                now = self.env.git.worktree_tree()?;
                self.commit(vec![EventBody::ScopeReverted {
                    step: id,
                    paths: outside,
                    post_tree: Some(now.clone()),
                }])?;
            }
        }
        // `now` is the tree as the step leaves it, computed just above. An untouched step
        // leaves the environment it started in.
        let post = match self.run.in_progress.as_ref() {
            Some(p) if untouched => p.pre.clone(),
            _ => self
                .env
                .fingerprint_with_tree(&self.contract, now.clone())?,
        };
        let (diff_files, diff_lines) = self.diff_from_base(&post.tree)?;
        let files_written = if post.tree == pre {
            0
        } else {
            self.env.git.diff(&pre, &post.tree)?.files_changed
        };
        let outcomes = outcomes.join("\n");
        let signature = blake3::hash(outcomes.as_bytes()).to_hex()[..16].to_string();
        let output = self.store.put_artifact(outcomes.as_bytes())?;
        let finished = |post| EventBody::StepFinished {
            step: id,
            signature: Some(signature),
            status: "decided".into(),
            success: true,
            duration_ms: 0,
            cpu_ms: 0,
            output,
            post,
            files_written,
            diff_files,
            diff_lines,
        };
        let verifiers: Vec<Verifier> = if now != pre {
            self.contract.verifiers_of(Tier::Step).cloned().collect()
        } else {
            Vec::new()
        };
        // With no step verifier to run, nothing happens between the step's end and its
        // verification: one commit (one fsync) records both.
        if verifiers.is_empty() {
            let mut last = vec![finished(post), EventBody::StepVerified { step: id }];
            last.extend(then(self));
            return self.commit_then_stop(last, Some(id));
        }
        self.commit(vec![finished(post.clone())])?;
        for v in verifiers {
            let evidence = self.run_verifier(&v, Some(id), None, &post)?;
            if !evidence.passed {
                let (fp, excerpt) = error_fingerprint(
                    &v.name,
                    &evidence.status,
                    evidence.excerpt.as_deref().unwrap_or(""),
                );
                return self.commit_then_stop(
                    vec![EventBody::StepFailed {
                        step: id,
                        reason: format!(
                            "step verifier `{}` failed ({}), evidence #{}",
                            v.name, evidence.status, evidence.n
                        ),
                        error_fingerprint: fp,
                        excerpt,
                        rolled_back: Vec::new(),
                        kept: true,
                    }]
                    .into_iter()
                    .chain(then(self))
                    .collect(),
                    Some(id),
                );
            }
        }
        let mut last = vec![EventBody::StepVerified { step: id }];
        last.extend(then(self));
        self.commit_then_stop(last, Some(id))
    }

    fn waiting_reason(&self, q: &keel_core::run::Question) -> String {
        format!(
            "waiting for the answer to question {}: {}; answer with `keel answer {} {} \"…\"`",
            q.n,
            cut(&q.question, 200),
            self.run.id,
            q.n
        )
    }

    /// The run waits for the answer to `q` (if it is not waiting already) and the contract's
    /// `notify` command is told of the question.
    fn wait_for_answer(&mut self, q: &keel_core::run::Question) -> Result<(), EngineError> {
        let reason = self.waiting_reason(q);
        self.set_state(RunState::Waiting, &reason, None)?;
        let announcement = serde_json::json!({
            "run": self.run.id,
            "kind": "question",
            "question": q,
        });
        self.notify(&format!("question {}", q.n), &announcement)
    }

    /// Files and lines changed from the run's base to `tree`; the last answer is kept, as
    /// most steps leave the tree the previous one left.
    fn diff_from_base(&mut self, tree: &str) -> Result<(u64, u64), EngineError> {
        if let Some((t, files, lines)) = &self.diff_cache
            && t == tree
        {
            return Ok((*files, *lines));
        }
        let whole = self.env.git.diff(&self.run.base.tree, tree)?;
        let answer = (whole.files_changed, whole.lines_added + whole.lines_removed);
        self.diff_cache = Some((tree.to_string(), answer.0, answer.1));
        Ok(answer)
    }

    /// The driver repeats itself (`pattern`: `repeat`, `ping_pong`, or a budget that bounds
    /// retries, `same_error` or `no_progress_steps`): the approach becomes a rejected path, the
    /// run stops blocked with the evidence, and a checkpoint keeps the rejected path for a
    /// resumed run.
    pub(crate) fn block_loop(
        &mut self,
        id: StepId,
        pattern: &str,
        budget: Option<BudgetStop>,
    ) -> Result<(), EngineError> {
        let last: Vec<String> = self
            .run
            .observations
            .iter()
            .rev()
            .take(2)
            .map(|o| {
                format!(
                    "{}({}) → {}",
                    o.tool,
                    cut(&o.arguments, 120),
                    cut(&o.text, 160)
                )
            })
            .collect();
        let what = match pattern {
            "repeat" => "the same action with the same result, again and again",
            "ping_pong" => "two actions alternating without progress",
            "same_error" => "the same error, again and again",
            _ => "steps without any verifier improving",
        };
        let rejected = format!("{what}: {}", last.join(" / "));
        let evidence = format!(
            "the last {} steps' signatures: {}; error counts: {:?}",
            self.run.recent.len(),
            self.run.recent.join(", "),
            self.run.error_counts.values().collect::<Vec<_>>()
        );
        let (reason, block) = match budget {
            Some(stop) => (
                format!(
                    "{stop} ({what}); the approach is recorded as a rejected path. Raise it with `keel unblock {} --budget {}=+N --reason \"…\"`",
                    self.run.id, stop.budget
                ),
                Block::Budget(stop),
            ),
            None => (
                format!(
                    "loop detected ({pattern}): {what}; the approach is recorded as a rejected path, and `keel resume {}` continues with it in the prompt",
                    self.run.id
                ),
                Block::Loop {
                    kind: pattern.to_string(),
                },
            ),
        };
        self.commit(vec![
            EventBody::LoopDetected {
                step: id,
                pattern: pattern.to_string(),
                evidence,
                rejected_path: rejected,
            },
            self.state_change(RunState::Blocked, &reason, Some(block)),
        ])?;
        self.checkpoint()
    }

    /// Phase verification after the driver called `finish`: the phase's gate, and for the last
    /// phase the acceptance verifiers too, so a failure goes back to the driver, not to a person.
    pub(crate) fn verify_agent_claim(&mut self, phase: u32) -> Result<(), EngineError> {
        let name = self.run.phases[phase as usize].name.clone();
        self.set_state(
            RunState::Verifying,
            &format!("the driver claims phase `{name}` is done: verifying"),
            None,
        )?;
        let mut verifiers: Vec<Verifier> = self.contract.phases[phase as usize]
            .gate
            .iter()
            .filter_map(|n| self.contract.verifier(n).cloned())
            .collect();
        if phase as usize + 1 == self.contract.phases.len() {
            verifiers.extend(self.contract.verifiers_of(Tier::Acceptance).cloned());
        }
        for v in verifiers {
            let judged = self.run.fingerprint.clone();
            let evidence = self.run_verifier(&v, None, Some(phase), &judged)?;
            if !evidence.passed {
                let (fp, _) = error_fingerprint(
                    &v.name,
                    &evidence.status,
                    evidence.excerpt.as_deref().unwrap_or(""),
                );
                return self.commit(vec![
                    EventBody::VerificationFailed {
                        phase,
                        verifier: v.name.clone(),
                        evidence: evidence.n,
                        error_fingerprint: fp,
                    },
                    self.state_change(
                        RunState::Executing,
                        &format!(
                            "verifier `{}` failed ({}): the evidence goes back to the driver",
                            v.name, evidence.status
                        ),
                        None,
                    ),
                ]);
            }
        }
        self.commit_then_stop(vec![EventBody::PhaseVerified { phase }], None)
    }
}

/// The simple commands of a shell command line, split at `;`, `&&`, `||`, `|`, `&` and
/// newlines, so that each is checked against `[scope] commands` on its own (a glob like `cat *`
/// must not let `cat x; rm -rf y` through). Command substitution and process substitution are
/// refused: what they run cannot be checked. The split does not read quotes, so a quoted `;`
/// splits too: that refuses more, never less.
fn simple_commands(line: &str) -> Result<Vec<String>, &'static str> {
    if line.contains("$(") || line.contains('`') || line.contains("<(") || line.contains(">(") {
        return Err("uses command substitution, which keel cannot check");
    }
    let parts: Vec<String> = line
        .split(['\n', ';', '|', '&'])
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .map(str::to_string)
        .collect();
    if parts.is_empty() {
        return Err("is empty");
    }
    Ok(parts)
}

fn tool_error_kind(e: &ToolError) -> &'static str {
    match e {
        ToolError::Escape { .. } => "escape",
        ToolError::Denied { .. } => "denied",
        ToolError::NotFound { .. } => "not found",
        ToolError::Invalid { .. } => "invalid",
        ToolError::PatchRejected { .. } => "patch rejected",
        ToolError::Io { .. } => "io",
    }
}

fn fault_point(name: &str) {
    crate::fault::point(name);
}

/// The `http` tool's arguments as a request (already checked against the tool's schema).
pub(crate) fn http_request(args: &serde_json::Value) -> keel_tools::http::HttpRequest {
    let s = |k: &str| args.get(k).and_then(serde_json::Value::as_str);
    keel_tools::http::HttpRequest {
        method: s("method").unwrap_or("GET").to_string(),
        url: s("url").unwrap_or("").to_string(),
        headers: args
            .get("headers")
            .and_then(serde_json::Value::as_object)
            .map(|h| {
                h.iter()
                    .map(|(k, v)| (k.clone(), v.as_str().unwrap_or("").to_string()))
                    .collect()
            })
            .unwrap_or_default(),
        body: s("body").map(str::to_string),
    }
}

impl Engine<'_> {
    fn request_call_approval(
        &mut self,
        id: StepId,
        i: u32,
        call: &ToolCall,
        verdict: &Verdict,
    ) -> Result<(), EngineError> {
        let key = effect_key(&self.run.id, id, i);
        let payload = serde_json::json!({
            "tool": call.name,
            "arguments": verdict.args,
            "attempts": self.effect_payload(call, &verdict.args, &key),
            "class": verdict.reversibility,
            "idempotency_key": key,
        });
        let payload = serde_json::to_string_pretty(&payload).unwrap_or_default();
        let compensation = self
            .contract
            .tool(&call.name)
            .and_then(|t| t.compensation(&verdict.args, &key))
            .map(|argv| shell_words(&argv));
        self.request_call_approval_payload(
            id,
            i,
            &call.name,
            payload,
            verdict.reversibility,
            compensation,
        )
    }

    fn request_reconciliation(
        &mut self,
        id: StepId,
        i: u32,
        call: &ToolCall,
        key: &str,
    ) -> Result<(), EngineError> {
        let args: serde_json::Value =
            serde_json::from_str(&call.arguments).unwrap_or(serde_json::Value::Null);
        let (class, _) = self.call_class(call, &args);
        let payload = serde_json::json!({
            "tool": call.name,
            "arguments": args,
            "attempted": self.effect_payload(call, &args, key),
            "class": class,
            "idempotency_key": key,
            "how_to_check": format!(
                "look in the system `{}` acts on for key {key} or for the attempted payload",
                call.name
            ),
        });
        let payload = serde_json::to_string_pretty(&payload).unwrap_or_default();
        self.request_reconciliation_payload(id, i, &call.name, key, payload, class)
    }
}

#[cfg(test)]
mod tests {
    use super::simple_commands;

    #[test]
    fn compound_commands_are_split_into_simple_ones() {
        assert_eq!(
            simple_commands("cat a.txt; echo x > /tmp/y && ls | wc -l").unwrap(),
            ["cat a.txt", "echo x > /tmp/y", "ls", "wc -l"]
        );
        assert_eq!(simple_commands("cargo test").unwrap(), ["cargo test"]);
        assert!(simple_commands("cat $(echo /etc/passwd)").is_err());
        assert!(simple_commands("cat `ls`").is_err());
        assert!(simple_commands(" ; ").is_err());
    }
}
