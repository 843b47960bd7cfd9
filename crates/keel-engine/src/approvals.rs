//! Approval gates: a phase with `approval = true` waits, with no process, until a person decides
//! on its exact payload. Decisions arrive from any process (CLI now, HTTP later) and are recorded
//! once: the first decision on a request is the one that counts.

use keel_core::agent::Reversibility;
use keel_core::budget::BudgetName;
use keel_core::contract::PhaseKind;
use keel_core::event::{ApprovalRequest, Block, Check, Event, EventBody, Gate, OnExpiry, StepId};
use keel_core::run::Run;
use keel_core::state::RunState;
use keel_store::Store;

use crate::{Actor, Engine, EngineError, LEASE_TTL_MS, holder_is_stale, now_ms};

/// How long the contract's notify command may take.
const NOTIFY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// How much of a diff an approval payload shows in full.
const PAYLOAD_DIFF_BYTES: usize = 512 * 1024;

/// An approval request before it has a number and a time.
struct PendingRequest {
    gate: Gate,
    intent: String,
    payload: String,
    checks: Vec<Check>,
    risk: String,
    reversibility: Reversibility,
    rollback: String,
    /// For the state change's reason: "phase `x`", "call `y`".
    waiting_for: String,
}

impl Engine<'_> {
    /// The exact payload of a phase gate: what the phase will do, and the change so far.
    fn phase_payload(&self, phase: u32) -> Result<(String, Reversibility), EngineError> {
        let Some(p) = self.contract.phases.get(phase as usize) else {
            return Ok((String::new(), Reversibility::Reversible));
        };
        let mut payload = match &p.kind {
            PhaseKind::Command { run, .. } => {
                let mut text = format!("phase `{}` runs these commands, in order:\n", p.name);
                for command in run {
                    text.push_str(&format!("  $ {command}\n"));
                }
                text
            }
            PhaseKind::Agent {
                objective, tools, ..
            } => format!(
                "phase `{}` lets the driver work toward:\n  {objective}\nwith the tools: {}\n",
                p.name,
                tools.join(", ")
            ),
        };
        let diff = self
            .env
            .git
            .diff_text(&self.run.base.tree, &self.run.fingerprint.tree)?;
        payload.push_str("\nthe workspace's change so far (against the run's base):\n");
        if diff.is_empty() {
            payload.push_str("(no change)\n");
        } else {
            payload.push_str(&keel_core::run::cut(&diff, PAYLOAD_DIFF_BYTES));
        }
        Ok((payload, Reversibility::Reversible))
    }

    /// Creates the approval request of a gated phase and stops the run to wait for it.
    pub(crate) fn request_phase_approval(&mut self, phase: u32) -> Result<(), EngineError> {
        if let Some(stop) = self.approvals_exhausted() {
            return self.block_budget(stop);
        }
        let name = self.run.phases[phase as usize].name.clone();
        let (payload, reversibility) = self.phase_payload(phase)?;
        let checks = self
            .run
            .evidence
            .values()
            .map(|e| Check {
                verifier: e.verifier.clone(),
                passed: e.passed,
                status: e.status.clone(),
                evidence: e.n,
            })
            .collect();
        let last_checkpoint = self.run.checkpoints.saturating_sub(1);
        let pending = PendingRequest {
            gate: Gate::Phase { phase },
            intent: format!(
                "Run phase `{name}` of \"{}\".",
                keel_core::run::cut(&self.contract.task.goal, 200)
            ),
            payload,
            checks,
            risk: format!(
                "{reversibility}: the phase's commands act on the workspace; anything they do \
                 outside it (a push, a message, a payment) is not undone by keel"
            ),
            reversibility,
            rollback: format!(
                "restore the workspace to checkpoint {last_checkpoint}: git checkout {} -- .",
                keel_core::checkpoint::Checkpoint::snapshot_ref(&self.run.id, last_checkpoint)
            ),
            waiting_for: format!("phase `{name}`"),
        };
        self.request_approval(pending, Vec::new(), true)
    }

    /// Records a request and moves the run to `awaiting_approval` (beside `before`, in one
    /// commit), takes a checkpoint at a step boundary, and announces it.
    fn request_approval(
        &mut self,
        pending: PendingRequest,
        before: Vec<EventBody>,
        checkpoint: bool,
    ) -> Result<(), EngineError> {
        let request = ApprovalRequest {
            n: self.run.approvals.len() as u32 + 1,
            gate: pending.gate,
            intent: pending.intent,
            payload_hash: ApprovalRequest::hash_payload(&pending.payload),
            payload: pending.payload,
            checks: pending.checks,
            risk: pending.risk,
            reversibility: pending.reversibility,
            rollback: pending.rollback,
            created_at_ms: now_ms(),
            expires_at_ms: self
                .contract
                .approvals
                .expires_ms
                .map(|ms| now_ms().saturating_add(i64::try_from(ms).unwrap_or(i64::MAX))),
            on_expiry: self.contract.approvals.expires_ms.map(|_| {
                if self.contract.approvals.block_on_expiry {
                    OnExpiry::Block
                } else {
                    OnExpiry::Reject
                }
            }),
        };
        let announcement = serde_json::json!({
            "run": self.run.id,
            "kind": "approval",
            "request": request,
        });
        let n = request.n;
        let reason = format!(
            "waiting for approval request {n} ({}); see `keel approvals {}`",
            pending.waiting_for, self.run.id
        );
        let mut bodies = before;
        bodies.push(EventBody::ApprovalRequested { request });
        bodies.push(self.state_change(RunState::AwaitingApproval, &reason, None));
        self.commit(bodies)?;
        if checkpoint {
            self.checkpoint()?;
        }
        self.notify(&format!("approval request {n}"), &announcement)
    }

    /// A tool call the contract wants a person to approve: the exact call is the payload.
    pub(crate) fn request_call_approval_payload(
        &mut self,
        step: StepId,
        call: u32,
        tool: &str,
        payload: String,
        class: Reversibility,
        compensation: Option<String>,
    ) -> Result<(), EngineError> {
        if let Some(stop) = self.approvals_exhausted() {
            return self.block_budget(stop);
        }
        let key = keel_core::event::effect_key(&self.run.id, step, call);
        let pending = PendingRequest {
            gate: Gate::ToolCall { step, call },
            intent: format!(
                "Let the driver call `{tool}` (step {step}, call {}).",
                call + 1
            ),
            payload,
            checks: Vec::new(),
            risk: format!(
                "{class}: {}",
                match class {
                    Reversibility::Irreversible => "once made, keel cannot undo it",
                    Reversibility::Compensatable => "undone only by its compensation",
                    Reversibility::Reversible => "it changes the workspace, undone by a checkpoint",
                    Reversibility::ReadOnly => "it changes nothing",
                }
            ),
            reversibility: class,
            rollback: match compensation {
                Some(c) => format!("run the compensation: {c}"),
                None => format!("no compensation; the call's idempotency key is {key}"),
            },
            waiting_for: format!("call `{tool}`"),
        };
        self.request_approval(pending, Vec::new(), false)
    }

    /// A call with an external effect was interrupted and may or may not have happened: its
    /// outcome becomes `unknown` and a person says whether to make it again.
    pub(crate) fn request_reconciliation_payload(
        &mut self,
        step: StepId,
        call: u32,
        tool: &str,
        key: &str,
        payload: String,
        class: Reversibility,
    ) -> Result<(), EngineError> {
        let settle = EventBody::EffectSettled {
            step,
            call,
            key: key.to_string(),
            status: keel_core::event::EffectStatus::Unknown,
            detail: "keel stopped after the effect was intended and before its outcome was \
                     recorded"
                .into(),
        };
        let pending = PendingRequest {
            gate: Gate::Reconcile {
                step,
                call,
                key: key.to_string(),
            },
            intent: format!(
                "Settle call `{tool}` (step {step}, call {}): it may or may not have happened. \
                 Approve to make it again with the same key; reject to leave it as it is and \
                 go on.",
                call + 1
            ),
            payload,
            checks: Vec::new(),
            risk: format!(
                "{class}, and `{tool}` takes no idempotency key: making it again could apply it \
                 twice. Check the external system for key {key} (or for the payload) first."
            ),
            reversibility: class,
            rollback: "none needed to leave it; if it happened twice, undo one by hand".into(),
            waiting_for: format!("reconciliation of call `{tool}`, key {key}"),
        };
        self.commit(vec![settle])?;
        self.request_approval(pending, Vec::new(), false)
    }

    fn approvals_exhausted(&self) -> Option<keel_core::event::BudgetStop> {
        let limit = self.run.limits.get(BudgetName::Approvals)?;
        let used = self.run.used(BudgetName::Approvals);
        (used >= limit).then_some(keel_core::event::BudgetStop {
            budget: BudgetName::Approvals,
            used,
            limit,
        })
    }

    /// Runs the contract's notify command with `what` as JSON on stdin; its outcome is recorded,
    /// and its failure never stops the run.
    pub(crate) fn notify(
        &mut self,
        what: &str,
        payload: &serde_json::Value,
    ) -> Result<(), EngineError> {
        let Some(command) = self.contract.approvals.notify.clone() else {
            return Ok(());
        };
        // The person it tells finds what it tells of stored.
        self.flush()?;
        let input = self.output_path("notify-input");
        let output = self.output_path("notify");
        let outcome = std::fs::write(&input, payload.to_string()).and_then(|()| {
            self.run_program(
                crate::process::Program::Shell(&command),
                &self.command_env(None),
                &output,
                NOTIFY_TIMEOUT,
                Some(&input),
            )
        });
        let _ = std::fs::remove_file(&input);
        let _ = std::fs::remove_file(&output);
        let (status, ok) = match outcome {
            Ok(o) => (o.status, o.success),
            Err(e) => (format!("could not run: {e}"), false),
        };
        self.commit(vec![EventBody::Notified {
            what: what.to_string(),
            status,
            ok,
        }])
    }

    /// On resume of a run awaiting approval: a decision that arrived moves it on (approve) or
    /// stops it (reject). Returns whether the run may go on.
    pub(crate) fn settle_approval(&mut self) -> Result<bool, EngineError> {
        let Some(approval) = self.run.approvals.last().cloned() else {
            return Ok(false);
        };
        let n = approval.request.n;
        let Some(decision) = approval.decision else {
            // Nobody decided in time: the contract says what that becomes. The decision and
            // what it leads to are one commit: a run found with the first and not the second
            // would be taken for one a person rejected.
            let expired = approval
                .request
                .expires_at_ms
                .is_some_and(|at| now_ms() >= at);
            if !expired {
                return Ok(false);
            }
            let reason = "nobody decided before the request's deadline".to_string();
            self.stage(vec![EventBody::ApprovalDecided {
                n,
                approve: false,
                payload_hash: approval.request.payload_hash.clone(),
                by: "keel".into(),
                reason: reason.clone(),
                via: "expiry".into(),
            }])?;
            if approval.request.on_expiry == Some(OnExpiry::Block) {
                self.set_state(
                    RunState::Blocked,
                    &format!(
                        "approval request {n} expired: {reason}; a person decides how to go on"
                    ),
                    Some(Block::Rejected {
                        n,
                        by: "keel".into(),
                        reason,
                    }),
                )?;
                return Ok(false);
            }
            // Otherwise it counts as rejected: a call's driver is told no and works on, a
            // phase stops, as after a person's rejection.
            let text = format!("approval request {n} expired and counts as rejected: {reason}");
            return self.rejected(&approval.request.gate, n, text, "keel", &reason);
        };
        if !decision.approve {
            let text = format!(
                "approval request {n} was rejected by {}: {}",
                decision.by, decision.reason
            );
            return self.rejected(
                &approval.request.gate,
                n,
                text,
                &decision.by,
                &decision.reason,
            );
        }
        // An approval applies to the payload it names: if what would run has changed since,
        // it asks again.
        if let Gate::Phase { phase } = approval.request.gate {
            let (payload, _) = self.phase_payload(phase)?;
            if ApprovalRequest::hash_payload(&payload) != approval.request.payload_hash {
                self.set_state(
                    RunState::Executing,
                    &format!("approval {n} was for another payload; asking again"),
                    None,
                )?;
                self.request_phase_approval(phase)?;
                return Ok(false);
            }
        }
        self.set_state(
            RunState::Executing,
            &format!(
                "approval request {n} approved by {}: {}",
                decision.by, decision.reason
            ),
            None,
        )?;
        Ok(true)
    }

    /// A rejected request (by a person, or by its deadline): a rejected call is not a dead end,
    /// its driver is told and works on (returns `true`); anything else blocks the run.
    fn rejected(
        &mut self,
        gate: &Gate,
        n: u32,
        text: String,
        by: &str,
        reason: &str,
    ) -> Result<bool, EngineError> {
        if matches!(gate, Gate::ToolCall { .. } | Gate::Reconcile { .. }) {
            self.set_state(
                RunState::Executing,
                &format!("{text}; the driver is told"),
                None,
            )?;
            return Ok(true);
        }
        self.set_state(
            RunState::Blocked,
            &text,
            Some(Block::Rejected {
                n,
                by: by.to_string(),
                reason: reason.to_string(),
            }),
        )?;
        Ok(false)
    }
}

impl Engine<'_> {
    /// A request to a person that stands beside a block: raise the exhausted budget, or accept
    /// the changed environment. The run stays blocked; an approval in the inbox (or `keel unblock`
    /// / `keel resume --migrate` on the command line) lets it go on.
    fn request_beside_block(
        &mut self,
        gate: Gate,
        intent: String,
        payload: String,
        risk: String,
    ) -> Result<(), EngineError> {
        // Not twice for the same thing, and never beyond the approvals budget.
        let hash = ApprovalRequest::hash_payload(&payload);
        if self
            .run
            .pending_approval()
            .is_some_and(|a| a.request.payload_hash == hash)
        {
            return Ok(());
        }
        if let Some(limit) = self.run.limits.get(BudgetName::Approvals)
            && self.run.used(BudgetName::Approvals) >= limit
        {
            return Ok(());
        }
        let request = ApprovalRequest {
            n: self.run.approvals.len() as u32 + 1,
            gate,
            intent,
            payload_hash: hash,
            payload,
            checks: self
                .run
                .evidence
                .values()
                .map(|e| Check {
                    verifier: e.verifier.clone(),
                    passed: e.passed,
                    status: e.status.clone(),
                    evidence: e.n,
                })
                .collect(),
            risk,
            reversibility: Reversibility::Reversible,
            rollback: "nothing to undo: approving only lets the run go on; cancel it to stop"
                .into(),
            created_at_ms: now_ms(),
            expires_at_ms: None,
            on_expiry: None,
        };
        let n = request.n;
        let announcement = serde_json::json!({
            "run": self.run.id,
            "kind": "approval",
            "request": request,
        });
        self.commit(vec![EventBody::ApprovalRequested { request }])?;
        self.notify(&format!("approval request {n}"), &announcement)
    }

    pub(crate) fn request_budget_raise(
        &mut self,
        stop: &keel_core::event::BudgetStop,
    ) -> Result<(), EngineError> {
        if stop.budget == BudgetName::Approvals {
            return Ok(());
        }
        let to = stop.limit.saturating_add((stop.limit / 2).max(1));
        let b = stop.budget;
        self.request_beside_block(
            Gate::BudgetRaise { budget: b, to },
            format!("Raise budget `{b}` so that the run can go on."),
            format!(
                "raise budget `{b}` from {} to {} (used {})\n",
                b.format_amount(stop.limit),
                b.format_amount(to),
                b.format_amount(stop.used)
            ),
            format!(
                "the run may spend up to {} more of `{b}`",
                b.format_amount(to - stop.limit)
            ),
        )
    }

    pub(crate) fn request_migration(&mut self, payload: String) -> Result<(), EngineError> {
        self.request_beside_block(
            Gate::Migration,
            "Continue the run in the changed environment.".into(),
            payload,
            "the run continues from facts that changed under it; its verified steps are not re-run"
                .into(),
        )
    }

    /// An approved raise request of a budget-blocked run becomes the raise, recorded with who
    /// approved it. Returns false when the newest such request was rejected.
    pub(crate) fn apply_approved_raise(
        &mut self,
        stop: &keel_core::event::BudgetStop,
    ) -> Result<bool, EngineError> {
        let Some(a) = self.run.approvals.iter().rev().find(
            |a| matches!(a.request.gate, Gate::BudgetRaise { budget, .. } if budget == stop.budget),
        ) else {
            return Ok(true);
        };
        let (Gate::BudgetRaise { to, .. }, Some(d)) = (&a.request.gate, &a.decision) else {
            return Ok(true);
        };
        if !d.approve {
            return Ok(false);
        }
        // Closed by a raise a person made with `keel unblock`: that raise is the one that counts.
        if d.via == crate::SETTLED_ON_THE_COMMAND_LINE {
            return Ok(true);
        }
        let from = self.run.limits.get(stop.budget);
        if from.is_some_and(|f| f < *to) {
            let body = EventBody::BudgetRaised {
                budget: stop.budget,
                from,
                to: *to,
                reason: format!("approved request {}: {}", a.request.n, d.reason),
                by: d.by.clone(),
            };
            self.commit(vec![body])?;
        }
        Ok(true)
    }
}

/// What came of delivering a decision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decided {
    /// This delivery is the decision.
    Recorded(Box<Run>),
    /// The request was decided before (this delivery changed nothing); `same` says whether the
    /// earlier decision was the same as this one.
    Already {
        same: bool,
        approve: bool,
        by: String,
    },
}

/// Why a decision was refused.
#[derive(Debug, thiserror::Error)]
pub enum DecisionError {
    #[error("run {run} has no approval request {n}; see `keel approvals {run}`")]
    NoRequest { run: String, n: u32 },
    #[error(
        "request {n} is for payload {expected}, but the decision names {given}: the payload changed or the hash is mistyped; look again with `keel approvals {run}`"
    )]
    StalePayload {
        run: String,
        n: u32,
        expected: String,
        given: String,
    },
    #[error("a rejection needs a reason")]
    NoReason,
    #[error(transparent)]
    Engine(#[from] EngineError),
}

/// Records a person's decision on approval request `n` of a run. Any process may call it; the
/// first decision on a request is the one that counts, and a second delivery changes nothing.
#[allow(clippy::too_many_arguments)]
pub fn decide(
    store: &mut Store,
    run_id: &str,
    n: u32,
    approve: bool,
    payload_hash: &str,
    reason: &str,
    actor: &Actor,
    via: &str,
) -> Result<Decided, DecisionError> {
    let id = store.resolve_run(run_id).map_err(EngineError::from)?;
    if !approve && reason.trim().is_empty() {
        return Err(DecisionError::NoReason);
    }
    // Writers of one run take turns through its lease; a decision needs it only briefly.
    let lease = acquire_briefly(store, &id, actor)?;
    let result = (|| {
        let mut run = store.run(&id).map_err(EngineError::from)?;
        let Some(approval) = run.approvals.get((n as usize).wrapping_sub(1)).cloned() else {
            return Err(DecisionError::NoRequest { run: id.clone(), n });
        };
        if let Some(d) = &approval.decision {
            return Ok(Decided::Already {
                same: d.approve == approve,
                approve: d.approve,
                by: d.by.clone(),
            });
        }
        if approval.request.payload_hash != payload_hash {
            return Err(DecisionError::StalePayload {
                run: id.clone(),
                n,
                expected: approval.request.payload_hash.clone(),
                given: payload_hash.to_string(),
            });
        }
        let event = Event {
            run_id: id.clone(),
            seq: run.seq + 1,
            at_ms: now_ms(),
            body: EventBody::ApprovalDecided {
                n,
                approve,
                payload_hash: payload_hash.to_string(),
                by: actor.by.clone(),
                reason: reason.to_string(),
                via: via.to_string(),
            },
        };
        run.apply(&event).map_err(|source| EngineError::Apply {
            run: id.clone(),
            source,
        })?;
        store
            .commit(&lease, &[event], &run, None, 0)
            .map_err(EngineError::from)?;
        Ok(Decided::Recorded(Box::new(run)))
    })();
    let _ = store.release(&lease);
    result
}

/// What came of delivering an answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answered {
    Recorded(Box<Run>),
    /// The question was answered before; this delivery changed nothing.
    Already {
        by: String,
        same: bool,
    },
}

/// Records a person's answer to question `n`; the first answer counts.
pub fn answer(
    store: &mut Store,
    run_id: &str,
    n: u32,
    text: &str,
    actor: &Actor,
    via: &str,
) -> Result<Answered, EngineError> {
    let id = store.resolve_run(run_id)?;
    if text.trim().is_empty() {
        return Err(EngineError::Usage("the answer is empty".into()));
    }
    let lease = acquire_briefly(store, &id, actor)?;
    let result = (|| {
        let mut run = store.run(&id)?;
        let Some(q) = run.questions.get((n as usize).wrapping_sub(1)).cloned() else {
            return Err(EngineError::Usage(format!(
                "run {id} has no question {n}; see `keel status {id}`"
            )));
        };
        if let Some(a) = q.answer {
            return Ok(Answered::Already {
                same: a.text == text,
                by: a.by,
            });
        }
        let event = Event {
            run_id: id.clone(),
            seq: run.seq + 1,
            at_ms: now_ms(),
            body: EventBody::QuestionAnswered {
                n,
                answer: text.to_string(),
                by: actor.by.clone(),
                via: via.to_string(),
            },
        };
        run.apply(&event).map_err(|source| EngineError::Apply {
            run: id.clone(),
            source,
        })?;
        store.commit(&lease, &[event], &run, None, 0)?;
        Ok(Answered::Recorded(Box::new(run)))
    })();
    let _ = store.release(&lease);
    result
}

/// Puts a run on an incident hold (`freeze = true`) or lifts it. A process driving the run loses
/// its lease and stops at its next write; while frozen nothing runs.
pub fn freeze(
    store: &mut Store,
    run_id: &str,
    freeze: bool,
    reason: &str,
    actor: &Actor,
) -> Result<Run, EngineError> {
    let (id, run) = crate::unfinished_run(
        store,
        run_id,
        reason,
        "a finished run needs no hold",
        "a freeze",
    )?;
    if run.frozen == freeze {
        return Ok(run);
    }
    // A freeze takes the run from whoever drives it; lifting one waits its turn.
    let lease = if freeze {
        store.acquire(&id, &actor.holder, now_ms(), LEASE_TTL_MS, true, &|_| true)?
    } else {
        acquire_briefly(store, &id, actor)?
    };
    let mut run = store.run(&id)?;
    let body = if freeze {
        EventBody::Frozen {
            reason: reason.to_string(),
            by: actor.by.clone(),
        }
    } else {
        EventBody::Unfrozen {
            reason: reason.to_string(),
            by: actor.by.clone(),
        }
    };
    let event = Event {
        run_id: id.clone(),
        seq: run.seq + 1,
        at_ms: now_ms(),
        body,
    };
    run.apply(&event).map_err(|source| EngineError::Apply {
        run: id.clone(),
        source,
    })?;
    let result = store.commit(&lease, &[event], &run, None, 0);
    let _ = store.release(&lease);
    result?;
    Ok(run)
}

/// Takes a run's lease for a short write, waiting (up to a few seconds) while another process
/// holds it for one.
fn acquire_briefly(
    store: &mut Store,
    id: &str,
    actor: &Actor,
) -> Result<keel_store::Lease, EngineError> {
    let mut waited = 0;
    loop {
        match store.acquire(
            id,
            &actor.holder,
            now_ms(),
            LEASE_TTL_MS,
            false,
            &holder_is_stale,
        ) {
            Ok(lease) => return Ok(lease),
            Err(keel_store::StoreError::LeaseHeld { .. }) if waited < 100 => {
                waited += 1;
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
            Err(e) => return Err(e.into()),
        }
    }
}
