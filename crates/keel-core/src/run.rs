//! The run projection: everything keel knows about a run, as a fold over its events.
//!
//! The store keeps this projection beside the log, updated in the same transaction; resume
//! rebuilds it from the newest checkpoint and the events after it. [`Run::apply`] is the only
//! way the projection changes, and it refuses any event the state machines do not allow, leaving
//! the run untouched.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::agent::ModelReply;
use crate::budget::{BudgetLimits, BudgetName};
use crate::event::{Block, BudgetStop, Decision, Event, EventBody, Evidence, StepId};
use crate::fingerprint::Fingerprint;
use crate::state::{self, RunState, StepState, TransitionError};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepProgress {
    pub command: String,
    pub state: StepState,
    pub attempts: u32,
    /// Artifact hash of the output of the step's latest attempt.
    pub output: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PhaseProgress {
    pub name: String,
    /// The steps the projection holds: every step of a command phase; of an agent phase, the
    /// steps from index `earlier` on.
    pub steps: Vec<StepProgress>,
    /// An agent phase's settled steps (verified or failed) before `steps`, which the projection
    /// no longer holds, so that it does not grow with the run (their rows are in the store's
    /// `steps` table and their events in the log). No event may change such a step.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub earlier: u32,
    pub verified: bool,
    /// An agent phase: its steps are made as the driver decides.
    #[serde(default)]
    pub agent: bool,
    /// The driver called `finish` and the verifiers have not judged the claim yet.
    #[serde(default)]
    pub finish_claimed: bool,
    /// The phase waits for a person's approval before its first step.
    #[serde(default)]
    pub gated: bool,
    /// A person approved this phase's gate.
    #[serde(default)]
    pub approved: bool,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// How many steps of an agent phase the projection holds at least before it lets settled ones
/// go (see [`PhaseProgress::earlier`]).
pub const KEPT_AGENT_STEPS: usize = 32;

impl PhaseProgress {
    /// Every step the phase has had, held or not.
    pub fn step_count(&self) -> u32 {
        self.earlier + self.steps.len() as u32
    }

    /// Step `index` of the phase, if the projection holds it.
    pub fn step(&self, index: u32) -> Option<&StepProgress> {
        index
            .checked_sub(self.earlier)
            .and_then(|i| self.steps.get(i as usize))
    }

    fn step_mut(&mut self, index: u32) -> Option<&mut StepProgress> {
        index
            .checked_sub(self.earlier)
            .and_then(|i| self.steps.get_mut(i as usize))
    }

    /// The steps held, with their index in the phase.
    pub fn held_steps(&self) -> impl Iterator<Item = (u32, &StepProgress)> {
        (self.earlier..).zip(self.steps.iter())
    }

    /// Lets an agent phase's oldest settled steps go once it holds more than
    /// [`KEPT_AGENT_STEPS`].
    fn compact(&mut self) {
        if !self.agent {
            return;
        }
        let excess = self.steps.len().saturating_sub(KEPT_AGENT_STEPS);
        let settled = self
            .steps
            .iter()
            .take(excess)
            .take_while(|s| matches!(s.state, StepState::Verified | StepState::Failed))
            .count();
        if settled > 0 {
            self.steps.drain(..settled);
            self.earlier += settled as u32;
        }
    }
}

/// A question the driver asked, and the answer once given.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Question {
    pub n: u32,
    pub step: StepId,
    pub question: String,
    pub answer: Option<Answer>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Answer {
    pub text: String,
    pub by: String,
    pub via: String,
    pub at_ms: i64,
}

/// An approval request and, once made, the decision on it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Approval {
    pub request: crate::event::ApprovalRequest,
    pub decision: Option<ApprovalDecision>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ApprovalDecision {
    pub approve: bool,
    pub by: String,
    pub reason: String,
    pub via: String,
    pub at_ms: i64,
}

/// One tool call of the agent step in progress, as far as it got.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CallProgress {
    pub tool: String,
    pub arguments: String,
    pub decision: Decision,
    pub pre_tree: Option<String>,
    pub finished: bool,
    #[serde(default)]
    pub post_tree: Option<String>,
    /// The call's external effect, once intended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub effect: Option<EffectProgress>,
}

/// The effect of a call of the step in progress, as far as the ledger knows.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EffectProgress {
    pub key: String,
    pub class: crate::agent::Reversibility,
    pub keyed: bool,
    pub status: crate::event::EffectStatus,
}

/// What the driver was shown of an earlier call: the last few go into every prompt.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Observation {
    pub step: StepId,
    pub tool: String,
    pub arguments: String,
    pub ok: bool,
    pub text: String,
}

/// How many observations, notes and step signatures the projection keeps: enough for the
/// prompt and for loop detection, bounded so that neither grows with the run.
pub const KEPT_OBSERVATIONS: usize = 8;
pub const KEPT_NOTES: usize = 20;
pub const KEPT_SIGNATURES: usize = 8;
/// The same action with the same result this many times in a row is a loop.
pub const REPEAT_LIMIT: usize = 3;
/// Observations are cut to this many bytes in the projection (the whole output is an artifact).
pub const OBSERVATION_BYTES: usize = 2000;

/// The step a process was working on when its last event was written.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InProgress {
    pub step: StepId,
    pub attempt: u32,
    /// The environment before the step started: what an interrupted step is rolled back to.
    pub pre: Fingerprint,
    pub pre_diff: (u64, u64),
    /// The environment after the step's command ended, once known.
    pub post: Option<Fingerprint>,
    /// An agent step: the driver's request and reply once recorded, and its calls so far.
    #[serde(default)]
    pub agent: bool,
    #[serde(default)]
    pub request: Option<String>,
    #[serde(default)]
    pub reply: Option<ModelReply>,
    #[serde(default)]
    pub calls: Vec<CallProgress>,
    /// The tree a workspace-editing driver left, once recorded.
    #[serde(default)]
    pub reply_tree: Option<String>,
    /// The tree once out-of-scope changes were undone, once recorded.
    #[serde(default)]
    pub scope_tree: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Run {
    pub id: String,
    pub contract_hash: String,
    pub contract_file: String,
    pub workspace: String,
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
    pub state: RunState,
    pub reason: String,
    pub block: Option<Block>,
    pub frozen: bool,
    pub phases: Vec<PhaseProgress>,
    /// Index of the phase being worked on; equal to the number of phases once all are done.
    pub cursor: u32,
    pub acceptance: Vec<String>,
    pub limits: BudgetLimits,
    pub used: BTreeMap<BudgetName, u64>,
    /// How often each error fingerprint was seen.
    pub error_counts: BTreeMap<String, u64>,
    /// The environment when the run was created: the base of its diff.
    pub base: Fingerprint,
    /// The environment at the last step boundary.
    pub fingerprint: Fingerprint,
    pub in_progress: Option<InProgress>,
    /// The newest evidence of each verifier.
    pub evidence: BTreeMap<String, Evidence>,
    pub evidence_count: u32,
    pub checkpoints: u32,
    pub rejected_paths: Vec<String>,
    pub plan_version: u32,
    #[serde(default)]
    pub plan: Vec<String>,
    #[serde(default)]
    pub notes: Vec<String>,
    #[serde(default)]
    pub observations: Vec<Observation>,
    /// Signatures of the latest agent steps, newest last.
    #[serde(default)]
    pub recent: Vec<String>,
    #[serde(default)]
    pub model_calls: u64,
    /// Tool calls the policy denied and out-of-scope changes undone.
    #[serde(default)]
    pub violations: u64,
    /// The driver choices made on the command line for this run.
    #[serde(default)]
    pub driver: Option<crate::event::DriverChoice>,
    /// Every approval request of the run, with its decision once made.
    #[serde(default)]
    pub approvals: Vec<Approval>,
    #[serde(default)]
    pub questions: Vec<Question>,
    /// Time spent waiting for people (awaiting approval, waiting for an answer).
    #[serde(default)]
    pub human_wait_ms: u64,
    #[serde(default)]
    pub waiting_since_ms: Option<i64>,
    pub seq: u64,
    pub lease: u64,
    /// When the run last became active in this process, for wall-time accounting.
    pub active_since_ms: Option<i64>,
}

/// An event the projection cannot accept.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ApplyError {
    #[error("event {got} out of order: expected sequence number {expected}")]
    Sequence { expected: u64, got: u64 },
    #[error("a run's first event must be run_created, found {0}")]
    NotCreated(&'static str),
    #[error("run_created may only be the first event")]
    CreatedTwice,
    #[error("the run is {0}: no event may follow a terminal state")]
    AfterTerminal(RunState),
    #[error(transparent)]
    Transition(#[from] TransitionError),
    #[error("state_changed says the run was {said}, but it is {actual}")]
    WrongFrom { said: RunState, actual: RunState },
    #[error("{event} names step {step}, which does not exist")]
    UnknownStep { event: &'static str, step: StepId },
    #[error("{event} for step {step}, but {in_progress}")]
    NotInProgress {
        event: &'static str,
        step: StepId,
        in_progress: String,
    },
    #[error("{event} needs the run to be {needed}, but it is {actual}")]
    WrongState {
        event: &'static str,
        needed: RunState,
        actual: RunState,
    },
    #[error("{0}")]
    Invalid(String),
    #[error(
        "completed without passing evidence of acceptance verifier `{0}` for the current working tree"
    )]
    NoEvidence(String),
}

impl Run {
    /// Builds a run from its `run_created` event.
    pub fn create(event: &Event) -> Result<Run, ApplyError> {
        let EventBody::RunCreated {
            contract_hash,
            contract_file,
            workspace,
            phases,
            acceptance,
            limits,
            base,
            driver,
            ..
        } = &event.body
        else {
            return Err(ApplyError::NotCreated(event.body.kind()));
        };
        if event.seq != 1 {
            return Err(ApplyError::Sequence {
                expected: 1,
                got: event.seq,
            });
        }
        Ok(Run {
            id: event.run_id.clone(),
            contract_hash: contract_hash.clone(),
            contract_file: contract_file.clone(),
            workspace: workspace.clone(),
            created_at_ms: event.at_ms,
            updated_at_ms: event.at_ms,
            state: RunState::Planned,
            reason: "created".into(),
            block: None,
            frozen: false,
            phases: phases
                .iter()
                .map(|p| PhaseProgress {
                    name: p.name.clone(),
                    steps: p
                        .commands
                        .iter()
                        .map(|c| StepProgress {
                            command: c.clone(),
                            state: StepState::NotStarted,
                            attempts: 0,
                            output: None,
                        })
                        .collect(),
                    earlier: 0,
                    verified: false,
                    agent: p.agent,
                    finish_claimed: false,
                    gated: p.approval,
                    approved: false,
                })
                .collect(),
            cursor: 0,
            acceptance: acceptance.clone(),
            limits: limits.clone(),
            used: BTreeMap::new(),
            error_counts: BTreeMap::new(),
            base: base.clone(),
            fingerprint: base.clone(),
            in_progress: None,
            evidence: BTreeMap::new(),
            evidence_count: 0,
            checkpoints: 0,
            rejected_paths: Vec::new(),
            plan_version: 0,
            plan: Vec::new(),
            notes: Vec::new(),
            observations: Vec::new(),
            recent: Vec::new(),
            model_calls: 0,
            violations: 0,
            driver: driver.clone(),
            approvals: Vec::new(),
            questions: Vec::new(),
            human_wait_ms: 0,
            waiting_since_ms: None,
            seq: 1,
            lease: 0,
            active_since_ms: None,
        })
    }

    pub fn used(&self, budget: BudgetName) -> u64 {
        self.used.get(&budget).copied().unwrap_or(0)
    }

    pub fn step(&self, id: StepId) -> Option<&StepProgress> {
        self.phases
            .get(id.phase as usize)
            .and_then(|p| p.step(id.index))
    }

    fn step_mut(
        &mut self,
        event: &'static str,
        id: StepId,
    ) -> Result<&mut StepProgress, ApplyError> {
        self.phases
            .get_mut(id.phase as usize)
            .and_then(|p| p.step_mut(id.index))
            .ok_or(ApplyError::UnknownStep { event, step: id })
    }

    fn active(&self) -> bool {
        matches!(
            self.state,
            RunState::Planned | RunState::Executing | RunState::Verifying
        )
    }

    /// Applies one event. On error the run is left exactly as it was.
    pub fn apply(&mut self, event: &Event) -> Result<(), ApplyError> {
        let mut next = self.clone();
        next.apply_in_place(event)?;
        *self = next;
        Ok(())
    }

    /// The event that would follow the run's last one: `body` at `at_ms`, with the next
    /// sequence number.
    pub fn next_event(&self, at_ms: i64, body: EventBody) -> Event {
        Event {
            run_id: self.id.clone(),
            seq: self.seq + 1,
            at_ms,
            body,
        }
    }

    /// [`Run::apply`] without the copy that makes it all-or-nothing: on an error the run is
    /// left part-changed. For a run the caller drops on any error (a scratch copy, a fold that
    /// stops at the first bad event); a long run is expensive to copy for every event.
    pub fn apply_in_place(&mut self, event: &Event) -> Result<(), ApplyError> {
        if event.seq != self.seq + 1 {
            return Err(ApplyError::Sequence {
                expected: self.seq + 1,
                got: event.seq,
            });
        }
        if self.state.is_terminal() {
            return Err(ApplyError::AfterTerminal(self.state));
        }
        // Wall time: the time between events while the run is active. A `resumed` event starts
        // a new stretch: the time a crashed process lay dead is not work.
        if let (Some(since), false) = (
            self.active_since_ms,
            matches!(event.body, EventBody::Resumed { .. }),
        ) {
            let elapsed = u64::try_from(event.at_ms.saturating_sub(since)).unwrap_or(0);
            self.add(BudgetName::WallTime, elapsed);
        }
        let was_waiting = self.state.needs_human() && self.state != RunState::Blocked;
        self.apply_body(&event.body, event.at_ms)?;
        let waiting = self.state.needs_human() && self.state != RunState::Blocked;
        match (was_waiting, waiting) {
            (false, true) => self.waiting_since_ms = Some(event.at_ms),
            (true, false) => {
                if let Some(since) = self.waiting_since_ms.take() {
                    self.human_wait_ms += u64::try_from(event.at_ms - since).unwrap_or(0);
                }
            }
            _ => {}
        }
        self.seq = event.seq;
        self.updated_at_ms = self.updated_at_ms.max(event.at_ms);
        self.active_since_ms = if self.active() {
            Some(event.at_ms)
        } else {
            None
        };
        Ok(())
    }

    fn add(&mut self, budget: BudgetName, amount: u64) {
        let used = self.used.entry(budget).or_insert(0);
        *used = used.saturating_add(amount);
    }

    fn expect_in_progress(&self, event: &'static str, step: StepId) -> Result<(), ApplyError> {
        match &self.in_progress {
            Some(p) if p.step == step => Ok(()),
            Some(p) => Err(ApplyError::NotInProgress {
                event,
                step,
                in_progress: format!("step {} is in progress", p.step),
            }),
            None => Err(ApplyError::NotInProgress {
                event,
                step,
                in_progress: "no step is in progress".into(),
            }),
        }
    }

    fn compact_phase(&mut self, phase: u32) {
        if let Some(p) = self.phases.get_mut(phase as usize) {
            p.compact();
        }
    }

    fn set_step(
        &mut self,
        event: &'static str,
        id: StepId,
        to: StepState,
    ) -> Result<(), ApplyError> {
        let step = self.step_mut(event, id)?;
        state::check_step(&id.to_string(), step.state, to)?;
        step.state = to;
        Ok(())
    }

    fn apply_body(&mut self, body: &EventBody, at_ms: i64) -> Result<(), ApplyError> {
        match body {
            EventBody::RunCreated { .. } => return Err(ApplyError::CreatedTwice),
            EventBody::StateChanged {
                from,
                to,
                reason,
                block,
            } => {
                if *from != self.state {
                    return Err(ApplyError::WrongFrom {
                        said: *from,
                        actual: self.state,
                    });
                }
                if self.frozen && *to != RunState::Failed {
                    return Err(TransitionError::Frozen.into());
                }
                state::check_run(*from, *to)?;
                if *to == RunState::Completed {
                    self.check_completion()?;
                }
                if (*to == RunState::Blocked) != block.is_some() {
                    return Err(ApplyError::Invalid(
                        "a change to blocked, and only that, carries what blocked the run".into(),
                    ));
                }
                self.state = *to;
                self.reason = reason.clone();
                self.block = block.clone();
            }
            EventBody::Resumed { lease, .. } => self.lease = *lease,
            EventBody::PhaseStarted { phase, .. } => {
                if *phase != self.cursor {
                    return Err(ApplyError::Invalid(format!(
                        "phase {} started while the run is at phase {}",
                        phase + 1,
                        self.cursor + 1
                    )));
                }
            }
            EventBody::StepStarted {
                step,
                attempt,
                command,
                agent,
            } => {
                if self.state != RunState::Executing {
                    return Err(ApplyError::WrongState {
                        event: "step_started",
                        needed: RunState::Executing,
                        actual: self.state,
                    });
                }
                if let Some(p) = &self.in_progress {
                    return Err(ApplyError::Invalid(format!(
                        "step {step} started while step {} is in progress",
                        p.step
                    )));
                }
                if step.phase != self.cursor {
                    return Err(ApplyError::Invalid(format!(
                        "step {step} is not in the current phase {}",
                        self.cursor + 1
                    )));
                }
                let phase =
                    self.phases
                        .get_mut(step.phase as usize)
                        .ok_or(ApplyError::UnknownStep {
                            event: "step_started",
                            step: *step,
                        })?;
                if phase.agent != *agent {
                    return Err(ApplyError::Invalid(format!(
                        "step {step}: agent steps belong to agent phases, and only they"
                    )));
                }
                if *agent && step.index == phase.step_count() {
                    // Agent phases grow a step at a time, as the driver decides.
                    phase.steps.push(StepProgress {
                        command: command.clone(),
                        state: StepState::NotStarted,
                        attempts: 0,
                        output: None,
                    });
                }
                self.set_step("step_started", *step, StepState::InProgress)?;
                self.step_mut("step_started", *step)?.attempts = *attempt;
                self.in_progress = Some(InProgress {
                    step: *step,
                    attempt: *attempt,
                    pre: self.fingerprint.clone(),
                    pre_diff: (
                        self.used(BudgetName::FilesChanged),
                        self.used(BudgetName::DiffLines),
                    ),
                    post: None,
                    agent: *agent,
                    request: None,
                    reply: None,
                    calls: Vec::new(),
                    reply_tree: None,
                    scope_tree: None,
                });
                self.add(BudgetName::Steps, 1);
                if *agent {
                    self.add(BudgetName::NoProgressSteps, 1);
                } else {
                    self.add(BudgetName::ToolCalls, 1);
                }
            }
            EventBody::ModelRequested { step, request, .. } => {
                self.expect_in_progress("model_requested", *step)?;
                let p = self.agent_step_mut("model_requested")?;
                p.request = Some(request.clone());
            }
            EventBody::ModelReplied {
                step,
                reply,
                usage,
                cost_micro_usd,
                post_tree,
                ..
            } => {
                self.expect_in_progress("model_replied", *step)?;
                let p = self.agent_step_mut("model_replied")?;
                if p.reply.is_some() {
                    return Err(ApplyError::Invalid(format!(
                        "step {step} already has the driver's reply"
                    )));
                }
                p.reply = Some(reply.clone());
                p.reply_tree = post_tree.clone();
                self.add(BudgetName::Tokens, usage.input_tokens + usage.output_tokens);
                self.add(BudgetName::CostUsd, *cost_micro_usd);
                self.model_calls += 1;
                if reply.calls.is_empty() {
                    let text = reply.text.clone().unwrap_or_default();
                    self.observe(Observation {
                        step: *step,
                        tool: "(no tool call)".into(),
                        arguments: String::new(),
                        ok: false,
                        text: format!(
                            "Your reply had no tool call{}. Act only through tools; call finish when the objective is met.",
                            if text.trim().is_empty() {
                                String::new()
                            } else {
                                format!(" (it said: {})", cut(&text, 300))
                            }
                        ),
                    });
                }
            }
            EventBody::PolicyDecision {
                step,
                call,
                tool,
                arguments,
                decision,
                rule,
                pre_tree,
                error_fingerprint,
                ..
            } => {
                self.expect_in_progress("policy_decision", *step)?;
                let p = self.agent_step_mut("policy_decision")?;
                // A call that waited for a person is decided again, once: approved or rejected.
                let redecided = p.calls.last().is_some_and(|c| {
                    c.decision == Decision::NeedsApproval
                        && *decision != Decision::NeedsApproval
                        && *call as usize + 1 == p.calls.len()
                });
                if redecided {
                    if let Some(c) = p.calls.last_mut() {
                        c.decision = *decision;
                        c.pre_tree = pre_tree.clone();
                    }
                } else {
                    if p.reply.is_none() || *call as usize != p.calls.len() {
                        return Err(ApplyError::Invalid(format!(
                            "policy decision for call {call} of step {step} out of order"
                        )));
                    }
                    p.calls.push(CallProgress {
                        tool: tool.clone(),
                        arguments: arguments.clone(),
                        decision: *decision,
                        pre_tree: pre_tree.clone(),
                        finished: false,
                        post_tree: None,
                        effect: None,
                    });
                    self.add(BudgetName::ToolCalls, 1);
                }
                if *decision == Decision::Deny {
                    self.violations += 1;
                    self.observe(Observation {
                        step: *step,
                        tool: tool.clone(),
                        arguments: cut(arguments, 200),
                        ok: false,
                        text: format!("DENIED: {rule}"),
                    });
                }
                if let Some(fp) = error_fingerprint {
                    self.count_error(fp);
                }
            }
            EventBody::EffectIntended {
                step,
                call,
                key,
                class,
                keyed,
                ..
            } => {
                self.expect_in_progress("effect_intended", *step)?;
                let p = self.agent_step_mut("effect_intended")?;
                let c = p.calls.get_mut(*call as usize).ok_or_else(|| {
                    ApplyError::Invalid(format!("call {call} of step {step} was never decided"))
                })?;
                if c.decision != Decision::Allow || c.finished || c.effect.is_some() {
                    return Err(ApplyError::Invalid(format!(
                        "effect of call {call} of step {step} intended without an allowed, \
                         unfinished call, or twice"
                    )));
                }
                c.effect = Some(EffectProgress {
                    key: key.clone(),
                    class: *class,
                    keyed: *keyed,
                    status: crate::event::EffectStatus::Intended,
                });
            }
            EventBody::EffectSettled {
                step,
                call,
                key,
                status,
                ..
            } => {
                // A compensation can come after the step ended; only the step in progress is
                // tracked in the projection.
                let current = self
                    .in_progress
                    .as_mut()
                    .filter(|p| p.step == *step)
                    .and_then(|p| p.calls.get_mut(*call as usize))
                    .and_then(|c| c.effect.as_mut());
                match current {
                    Some(e) if e.key == *key => {
                        if !e.status.can_become(*status) {
                            return Err(ApplyError::Invalid(format!(
                                "effect {key} cannot go from {} to {status}",
                                e.status
                            )));
                        }
                        e.status = *status;
                    }
                    Some(e) => {
                        return Err(ApplyError::Invalid(format!(
                            "effect {key} settled, but call {call} of step {step} has key {}",
                            e.key
                        )));
                    }
                    None if *status == crate::event::EffectStatus::Compensated => {}
                    None => {
                        return Err(ApplyError::Invalid(format!(
                            "effect {key} of call {call} of step {step} settled but never intended"
                        )));
                    }
                }
            }
            EventBody::ToolCallFinished {
                step,
                call,
                ok,
                observation,
                changed,
                error_fingerprint,
                post_tree,
                ..
            } => {
                self.expect_in_progress("tool_call_finished", *step)?;
                let p = self.agent_step_mut("tool_call_finished")?;
                let c = p.calls.get_mut(*call as usize).ok_or_else(|| {
                    ApplyError::Invalid(format!("call {call} of step {step} was never decided"))
                })?;
                if c.decision != Decision::Allow || c.finished {
                    return Err(ApplyError::Invalid(format!(
                        "call {call} of step {step} finished without being allowed, or twice"
                    )));
                }
                c.finished = true;
                c.post_tree = post_tree.clone();
                let (tool, arguments) = (c.tool.clone(), cut(&c.arguments, 200));
                self.add(BudgetName::Writes, changed.len() as u64);
                if tool == "http" {
                    self.add(BudgetName::NetworkRequests, 1);
                }
                self.observe(Observation {
                    step: *step,
                    tool,
                    arguments,
                    ok: *ok,
                    text: cut(observation, OBSERVATION_BYTES),
                });
                if let Some(fp) = error_fingerprint {
                    self.count_error(fp);
                }
            }
            EventBody::PlanUpdated { items, .. } => {
                self.plan = items.clone();
                self.plan_version += 1;
            }
            EventBody::NoteAdded { text, .. } => {
                self.notes.push(cut(text, OBSERVATION_BYTES));
                let excess = self.notes.len().saturating_sub(KEPT_NOTES);
                self.notes.drain(..excess);
            }
            EventBody::FinishClaimed { step, .. } => {
                self.expect_in_progress("finish_claimed", *step)?;
                if let Some(phase) = self.phases.get_mut(step.phase as usize) {
                    phase.finish_claimed = true;
                }
            }
            EventBody::ScopeReverted {
                step,
                paths,
                post_tree,
            } => {
                self.violations += paths.len() as u64;
                if let Some(p) = self.in_progress.as_mut() {
                    p.scope_tree = post_tree.clone();
                }
                self.observe(Observation {
                    step: *step,
                    tool: "(scope)".into(),
                    arguments: String::new(),
                    ok: false,
                    text: format!(
                        "keel undid these changes, which are outside the contract's scope: {}",
                        cut(&paths.join(", "), 1000)
                    ),
                });
            }
            EventBody::VerificationFailed {
                phase,
                error_fingerprint,
                ..
            } => {
                if let Some(p) = self.phases.get_mut(*phase as usize) {
                    p.finish_claimed = false;
                }
                self.count_error(error_fingerprint);
            }
            EventBody::ApprovalRequested { request } => {
                if request.n as usize != self.approvals.len() + 1 {
                    return Err(ApplyError::Invalid(format!(
                        "approval request {} after {} requests",
                        request.n,
                        self.approvals.len()
                    )));
                }
                if request.payload_hash
                    != crate::event::ApprovalRequest::hash_payload(&request.payload)
                {
                    return Err(ApplyError::Invalid(format!(
                        "approval request {}: the payload hash does not match the payload",
                        request.n
                    )));
                }
                self.approvals.push(Approval {
                    request: request.clone(),
                    decision: None,
                });
                self.add(BudgetName::Approvals, 1);
            }
            EventBody::ApprovalDecided {
                n,
                approve,
                payload_hash,
                by,
                reason,
                via,
            } => {
                let approval = self
                    .approvals
                    .get_mut((*n as usize).wrapping_sub(1))
                    .ok_or_else(|| {
                        ApplyError::Invalid(format!("there is no approval request {n}"))
                    })?;
                if approval.decision.is_some() {
                    return Err(ApplyError::Invalid(format!(
                        "approval request {n} is decided already"
                    )));
                }
                if *payload_hash != approval.request.payload_hash {
                    return Err(ApplyError::Invalid(format!(
                        "the decision names payload {payload_hash}, but request {n} is for {}",
                        approval.request.payload_hash
                    )));
                }
                approval.decision = Some(ApprovalDecision {
                    approve: *approve,
                    by: by.clone(),
                    reason: reason.clone(),
                    via: via.clone(),
                    at_ms,
                });
                if let (true, crate::event::Gate::Phase { phase }) =
                    (*approve, &approval.request.gate)
                    && let Some(p) = self.phases.get_mut(*phase as usize)
                {
                    p.approved = true;
                }
            }
            EventBody::QuestionAsked { n, step, question } => {
                if *n as usize != self.questions.len() + 1 {
                    return Err(ApplyError::Invalid(format!(
                        "question {n} after {} questions",
                        self.questions.len()
                    )));
                }
                self.questions.push(Question {
                    n: *n,
                    step: *step,
                    question: question.clone(),
                    answer: None,
                });
                self.add(BudgetName::Approvals, 1);
            }
            EventBody::QuestionAnswered { n, answer, by, via } => {
                let q = self
                    .questions
                    .get_mut((*n as usize).wrapping_sub(1))
                    .ok_or_else(|| ApplyError::Invalid(format!("there is no question {n}")))?;
                if q.answer.is_some() {
                    return Err(ApplyError::Invalid(format!(
                        "question {n} is answered already"
                    )));
                }
                q.answer = Some(Answer {
                    text: answer.clone(),
                    by: by.clone(),
                    via: via.clone(),
                    at_ms,
                });
                let step = q.step;
                let text = format!("{} (answered by {by})", cut(answer, OBSERVATION_BYTES));
                self.observe(Observation {
                    step,
                    tool: "ask".into(),
                    arguments: format!("question {n}"),
                    ok: true,
                    text,
                });
            }
            EventBody::Notified { .. } => {}
            EventBody::Frozen { .. } => self.frozen = true,
            EventBody::Unfrozen { .. } => self.frozen = false,
            EventBody::LoopDetected { rejected_path, .. } => {
                self.rejected_paths.push(rejected_path.clone());
            }
            EventBody::StepFinished {
                step,
                signature,
                cpu_ms,
                output,
                post,
                files_written,
                diff_files,
                diff_lines,
                ..
            } => {
                self.expect_in_progress("step_finished", *step)?;
                // The step's end recorded again: keel stopped between the step's end and its
                // verification, and the resumed process ended it once more. Still one step.
                let again = self.in_progress.as_ref().is_some_and(|p| p.post.is_some());
                if let Some(p) = self.in_progress.as_mut() {
                    p.post = Some(post.clone());
                }
                self.step_mut("step_finished", *step)?.output = Some(output.clone());
                if let Some(signature) = signature {
                    if again {
                        self.recent.pop();
                    }
                    self.recent.push(signature.clone());
                    let excess = self.recent.len().saturating_sub(KEPT_SIGNATURES);
                    self.recent.drain(..excess);
                }
                // An agent step's writes were counted call by call.
                if !self.in_progress.as_ref().is_some_and(|p| p.agent) {
                    self.add(BudgetName::Writes, *files_written);
                }
                self.add(BudgetName::ComputeTime, *cpu_ms);
                self.used.insert(BudgetName::FilesChanged, *diff_files);
                self.used.insert(BudgetName::DiffLines, *diff_lines);
            }
            EventBody::EvidenceRecorded { evidence } => {
                if evidence.n != self.evidence_count + 1 {
                    return Err(ApplyError::Invalid(format!(
                        "evidence #{} recorded after #{}",
                        evidence.n, self.evidence_count
                    )));
                }
                self.evidence_count = evidence.n;
                self.add(BudgetName::ComputeTime, evidence.cpu_ms);
                // Progress: a verifier passes that had not passed before.
                let before = self.evidence.get(&evidence.verifier).map(|e| e.passed);
                if evidence.passed && before != Some(true) {
                    self.used.insert(BudgetName::NoProgressSteps, 0);
                }
                self.evidence
                    .insert(evidence.verifier.clone(), evidence.clone());
            }
            EventBody::StepVerified { step } => {
                self.expect_in_progress("step_verified", *step)?;
                let post = self
                    .in_progress
                    .as_ref()
                    .and_then(|p| p.post.clone())
                    .ok_or_else(|| {
                        ApplyError::Invalid(format!(
                            "step {step} verified before its command finished"
                        ))
                    })?;
                self.set_step("step_verified", *step, StepState::Verified)?;
                self.fingerprint = post;
                self.in_progress = None;
                self.compact_phase(step.phase);
            }
            EventBody::StepFailed {
                step,
                error_fingerprint,
                kept,
                ..
            } => {
                self.expect_in_progress("step_failed", *step)?;
                self.set_step("step_failed", *step, StepState::Failed)?;
                self.count_error(error_fingerprint);
                if *kept {
                    if let Some(p) = self.in_progress.take() {
                        self.fingerprint = p.post.unwrap_or(p.pre);
                    }
                } else {
                    self.roll_back();
                }
                self.compact_phase(step.phase);
            }
            EventBody::StepRolledBack { step, .. } => {
                self.expect_in_progress("step_rolled_back", *step)?;
                self.set_step("step_rolled_back", *step, StepState::Failed)?;
                self.roll_back();
                self.compact_phase(step.phase);
            }
            EventBody::StepInvalidated { step, .. } => {
                self.set_step("step_invalidated", *step, StepState::Invalidated)?;
                if let Some(phase) = self.phases.get_mut(step.phase as usize) {
                    phase.verified = false;
                }
                self.cursor = self.cursor.min(step.phase);
            }
            EventBody::PhaseVerified { phase } => {
                let current = self.phases.get(*phase as usize);
                // An agent phase keeps its failed steps as history; a command phase needs each
                // of its steps verified.
                let all_verified = current
                    .map(|p| p.agent || p.steps.iter().all(|s| s.state == StepState::Verified))
                    .unwrap_or(false);
                if *phase != self.cursor || !all_verified {
                    return Err(ApplyError::Invalid(format!(
                        "phase {} verified before all its steps were",
                        phase + 1
                    )));
                }
                if let Some(p) = self.phases.get_mut(*phase as usize) {
                    p.verified = true;
                    p.finish_claimed = false;
                }
                self.used.insert(BudgetName::NoProgressSteps, 0);
            }
            EventBody::CheckpointTaken { n, .. } => {
                if *n != self.checkpoints {
                    return Err(ApplyError::Invalid(format!(
                        "checkpoint {n} taken after {} checkpoints",
                        self.checkpoints
                    )));
                }
                if self.in_progress.is_some() {
                    return Err(ApplyError::Invalid(
                        "a checkpoint cannot be taken while a step is in progress".into(),
                    ));
                }
                self.checkpoints += 1;
                if self
                    .phases
                    .get(self.cursor as usize)
                    .is_some_and(|p| p.verified)
                {
                    self.cursor += 1;
                }
            }
            EventBody::BudgetRaised {
                budget, from, to, ..
            } => {
                if *from != self.limits.get(*budget) {
                    return Err(ApplyError::Invalid(format!(
                        "budget {budget} raised from {from:?}, but its limit is {:?}",
                        self.limits.get(*budget)
                    )));
                }
                if from.is_some_and(|f| *to <= f) {
                    return Err(ApplyError::Invalid(format!(
                        "budget {budget} may only go up, not from {from:?} to {to}"
                    )));
                }
                self.limits.set(*budget, *to);
            }
            EventBody::DriftDetected { .. } => {}
            EventBody::Migrated { fingerprint, .. } => {
                if self.in_progress.is_some() {
                    return Err(ApplyError::Invalid(
                        "a migration cannot happen while a step is in progress".into(),
                    ));
                }
                self.fingerprint = fingerprint.clone();
            }
            EventBody::TailCut { .. } | EventBody::Cancelled { .. } => {}
        }
        Ok(())
    }

    fn agent_step_mut(&mut self, event: &'static str) -> Result<&mut InProgress, ApplyError> {
        match self.in_progress.as_mut() {
            Some(p) if p.agent => Ok(p),
            _ => Err(ApplyError::Invalid(format!(
                "{event} belongs to an agent step, and none is in progress"
            ))),
        }
    }

    fn observe(&mut self, observation: Observation) {
        self.observations.push(observation);
        let excess = self.observations.len().saturating_sub(KEPT_OBSERVATIONS);
        self.observations.drain(..excess);
    }

    fn count_error(&mut self, fingerprint: &str) {
        let count = self
            .error_counts
            .entry(fingerprint.to_string())
            .or_insert(0);
        *count += 1;
        let worst = *count;
        if worst > self.used(BudgetName::SameError) {
            self.used.insert(BudgetName::SameError, worst);
        }
    }

    /// Where the working tree should be now, as far as the log knows: after the last recorded
    /// call of an agent step in progress that changed it, else at the last step boundary. An
    /// agent call that was allowed but not recorded as finished may have left the tree anywhere
    /// from there: `Some(tree)` in `.1` names the tree to roll back to.
    pub fn expected_tree(&self) -> (String, Option<String>) {
        let Some(p) = self.in_progress.as_ref().filter(|p| p.agent) else {
            return (self.fingerprint.tree.clone(), None);
        };
        if let Some(post) = &p.post {
            return (post.tree.clone(), None);
        }
        let Some(reply) = &p.reply else {
            // Asked but not answered: a delegated program may have been changing the
            // workspace; back to where the step started.
            return match p.request {
                Some(_) => (p.pre.tree.clone(), Some(p.pre.tree.clone())),
                None => (p.pre.tree.clone(), None),
            };
        };
        let known = p
            .scope_tree
            .clone()
            .or_else(|| p.calls.iter().rev().find_map(|c| c.post_tree.clone()))
            .or_else(|| p.reply_tree.clone())
            .unwrap_or_else(|| p.pre.tree.clone());
        match p.calls.last() {
            // A call that was running: back to where it started.
            Some(c) if c.decision == Decision::Allow && !c.finished => {
                let pre = c.pre_tree.clone().unwrap_or(known);
                (pre.clone(), Some(pre))
            }
            // Every call recorded, the step's end not: undoing out-of-scope changes may have
            // been under way; back to before it, and it is done again.
            _ if p.calls.len() == reply.calls.len() && p.scope_tree.is_none() => {
                (known.clone(), Some(known))
            }
            _ => (known, None),
        }
    }

    /// The driver going round in circles: the same action with the same result
    /// [`REPEAT_LIMIT`] times in a row, or two actions alternating over the last six steps.
    pub fn loop_detected(&self) -> Option<&'static str> {
        let r = &self.recent;
        if r.len() >= REPEAT_LIMIT
            && r[r.len() - REPEAT_LIMIT..]
                .iter()
                .all(|s| *s == r[r.len() - 1])
        {
            return Some("repeat");
        }
        if r.len() >= 6 {
            let last = &r[r.len() - 6..];
            let (a, b) = (&last[0], &last[1]);
            if a != b
                && last
                    .iter()
                    .enumerate()
                    .all(|(i, s)| s == if i % 2 == 0 { a } else { b })
            {
                return Some("ping_pong");
            }
        }
        None
    }

    fn roll_back(&mut self) {
        if let Some(p) = self.in_progress.take() {
            self.fingerprint = p.pre;
            self.used.insert(BudgetName::FilesChanged, p.pre_diff.0);
            self.used.insert(BudgetName::DiffLines, p.pre_diff.1);
        }
    }

    fn check_completion(&self) -> Result<(), ApplyError> {
        if self.cursor as usize != self.phases.len() || self.in_progress.is_some() {
            return Err(ApplyError::Invalid(
                "completed before every phase was done".into(),
            ));
        }
        if self.acceptance.is_empty() {
            return Err(ApplyError::NoEvidence("(none declared)".into()));
        }
        for name in &self.acceptance {
            match self.evidence.get(name) {
                Some(e) if e.passed && e.tree == self.fingerprint.tree => {}
                _ => return Err(ApplyError::NoEvidence(name.clone())),
            }
        }
        Ok(())
    }

    /// The newest question that has no answer yet.
    pub fn pending_question(&self) -> Option<&Question> {
        self.questions.iter().rev().find(|q| q.answer.is_none())
    }

    /// The newest approval request that has no decision yet.
    pub fn pending_approval(&self) -> Option<&Approval> {
        self.approvals.iter().rev().find(|a| a.decision.is_none())
    }

    /// Every artifact the run refers to: step outputs and evidence logs.
    pub fn artifacts(&self) -> Vec<String> {
        let mut out: Vec<String> = self
            .phases
            .iter()
            // Of the steps held: a settled step the projection let go is named by its
            // `step_finished` event.
            .flat_map(|p| p.steps.iter().filter_map(|s| s.output.clone()))
            .chain(self.evidence.values().map(|e| e.output.clone()))
            .collect();
        out.sort();
        out.dedup();
        out
    }

    /// Every acceptance verifier has passing evidence for the working tree as it is.
    pub fn accepted(&self) -> bool {
        self.check_completion().is_ok()
    }

    /// A budget with nothing left, checked before a step starts.
    pub fn budget_stop_before_step(&self) -> Option<BudgetStop> {
        [
            BudgetName::Steps,
            BudgetName::ToolCalls,
            BudgetName::WallTime,
            BudgetName::ComputeTime,
            BudgetName::Tokens,
            BudgetName::CostUsd,
            BudgetName::NoProgressSteps,
        ]
        .into_iter()
        .find_map(|b| self.stop_if(b, |used, limit| used >= limit))
        .or_else(|| self.budget_stop_after_step())
    }

    /// A budget that the work so far went over, checked after each step.
    pub fn budget_stop_after_step(&self) -> Option<BudgetStop> {
        [
            BudgetName::WallTime,
            BudgetName::ComputeTime,
            BudgetName::Writes,
            BudgetName::DiffLines,
            BudgetName::FilesChanged,
        ]
        .into_iter()
        .find_map(|b| self.stop_if(b, |used, limit| used > limit))
        .or_else(|| self.stop_if(BudgetName::SameError, |used, limit| used >= limit))
    }

    fn stop_if(&self, budget: BudgetName, over: impl Fn(u64, u64) -> bool) -> Option<BudgetStop> {
        let limit = self.limits.get(budget)?;
        let used = self.used(budget);
        over(used, limit).then_some(BudgetStop {
            budget,
            used,
            limit,
        })
    }

    /// What the harness does next. Pure: the engine carries it out and records the events.
    pub fn next(&self) -> Next {
        if self.state.is_terminal() || self.state.needs_human() || self.frozen {
            return Next::Stop;
        }
        if let Some(p) = &self.in_progress {
            return Next::Recover(p.step);
        }
        if self.checkpoints == 0 {
            return Next::Checkpoint;
        }
        if let Some(phase) = self.phases.get(self.cursor as usize)
            && phase.gated
            && !phase.approved
            && phase.earlier == 0
            && phase.steps.iter().all(|s| s.attempts == 0)
        {
            return Next::RequestApproval(self.cursor);
        }
        if let Some(phase) = self.phases.get(self.cursor as usize)
            && phase.agent
        {
            return match (phase.verified, phase.finish_claimed) {
                (true, _) => Next::Checkpoint,
                (false, true) => Next::VerifyPhase(self.cursor),
                (false, false) => Next::Step(StepId {
                    phase: self.cursor,
                    index: phase.step_count(),
                }),
            };
        }
        if let Some(phase) = self.phases.get(self.cursor as usize) {
            let pending = phase
                .steps
                .iter()
                .position(|s| s.state != StepState::Verified);
            return match (pending, phase.verified) {
                (Some(index), _) => Next::Step(StepId {
                    phase: self.cursor,
                    index: index as u32,
                }),
                (None, false) => Next::VerifyPhase(self.cursor),
                (None, true) => Next::Checkpoint,
            };
        }
        if self.accepted() {
            Next::Complete
        } else {
            Next::Accept
        }
    }
}

/// The harness's next move for a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    /// Nothing to do: the run is finished or waits for a person.
    Stop,
    /// Ask a person to approve this phase before its first step.
    RequestApproval(u32),
    /// A step was in progress when the last process stopped: undo it before going on.
    Recover(StepId),
    /// Take a checkpoint (the run's first, or the end of a verified phase).
    Checkpoint,
    /// Run (or retry) this step.
    Step(StepId),
    /// Run the gate verifiers of this phase.
    VerifyPhase(u32),
    /// Run the acceptance verifiers.
    Accept,
    /// Every acceptance verifier passed for the current tree: the run is complete.
    Complete,
}

/// Cuts text to at most `max` bytes on a character boundary, saying how much was left out.
pub fn cut(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_string();
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}… [{} more bytes]", &text[..end], text.len() - end)
}
