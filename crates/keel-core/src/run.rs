//! The run projection: everything keel knows about a run, as a fold over its events.
//!
//! The store keeps this projection beside the log, updated in the same transaction; resume
//! rebuilds it from the newest checkpoint and the events after it. [`Run::apply`] is the only
//! way the projection changes, and it refuses any event the state machines do not allow, leaving
//! the run untouched.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::budget::{BudgetLimits, BudgetName};
use crate::event::{Block, BudgetStop, Event, EventBody, Evidence, StepId};
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
    pub steps: Vec<StepProgress>,
    pub verified: bool,
}

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
                    verified: false,
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
            .and_then(|p| p.steps.get(id.index as usize))
    }

    fn step_mut(
        &mut self,
        event: &'static str,
        id: StepId,
    ) -> Result<&mut StepProgress, ApplyError> {
        self.phases
            .get_mut(id.phase as usize)
            .and_then(|p| p.steps.get_mut(id.index as usize))
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

    fn apply_in_place(&mut self, event: &Event) -> Result<(), ApplyError> {
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
        self.apply_body(&event.body)?;
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

    fn apply_body(&mut self, body: &EventBody) -> Result<(), ApplyError> {
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
                command: _,
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
                });
                self.add(BudgetName::Steps, 1);
                self.add(BudgetName::ToolCalls, 1);
            }
            EventBody::StepFinished {
                step,
                cpu_ms,
                output,
                post,
                files_written,
                diff_files,
                diff_lines,
                ..
            } => {
                self.expect_in_progress("step_finished", *step)?;
                if let Some(p) = self.in_progress.as_mut() {
                    p.post = Some(post.clone());
                }
                self.step_mut("step_finished", *step)?.output = Some(output.clone());
                self.add(BudgetName::Writes, *files_written);
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
            }
            EventBody::StepFailed {
                step,
                error_fingerprint,
                ..
            } => {
                self.expect_in_progress("step_failed", *step)?;
                self.set_step("step_failed", *step, StepState::Failed)?;
                let count = self
                    .error_counts
                    .entry(error_fingerprint.clone())
                    .or_insert(0);
                *count += 1;
                let worst = *count;
                if worst > self.used(BudgetName::SameError) {
                    self.used.insert(BudgetName::SameError, worst);
                }
                self.roll_back();
            }
            EventBody::StepRolledBack { step, .. } => {
                self.expect_in_progress("step_rolled_back", *step)?;
                self.set_step("step_rolled_back", *step, StepState::Failed)?;
                self.roll_back();
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
                let all_verified = current
                    .map(|p| p.steps.iter().all(|s| s.state == StepState::Verified))
                    .unwrap_or(false);
                if *phase != self.cursor || !all_verified {
                    return Err(ApplyError::Invalid(format!(
                        "phase {} verified before all its steps were",
                        phase + 1
                    )));
                }
                if let Some(p) = self.phases.get_mut(*phase as usize) {
                    p.verified = true;
                }
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

    /// Every artifact the run refers to: step outputs and evidence logs.
    pub fn artifacts(&self) -> Vec<String> {
        let mut out: Vec<String> = self
            .phases
            .iter()
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
