//! The invariants every run's log keeps, checked over its decoded events.
//!
//! The fold ([`Run::apply`]) refuses events that break the run's protocol as they arrive; this
//! module judges a whole log after the fact, the way a test or an auditor reads the store after
//! a scenario, and checks what no single event can show:
//!
//! - sequence numbers start at 1 and are contiguous, every event belongs to one run, the first is
//!   `run_created` and nothing follows a terminal state;
//! - every `state_changed` starts where the run was and is a legal transition;
//! - consumed budgets that accumulate never go down, and at the end each equals the sum of the
//!   usage its events carry, recomputed here independently of the fold;
//! - limits change only through a `budget_raised` event that names the person who raised it;
//! - a step verified in any prefix of the log is still verified at the end, unless a later
//!   `step_invalidated` says why not;
//! - every effect's settlements follow its status machine; with the applications an outside
//!   service observed, each key was applied at most once, and exactly once when recorded `done`.
//!
//! The hash chain is the store's to check: it covers the stored bytes, not the decoded events.
//! Comparing an interrupted run with an uninterrupted reference is [`Outcome`]'s job.

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;

use crate::budget::BudgetName;
use crate::effect::{Effect, ledger};
use crate::event::{EffectStatus, Event, EventBody, StepId};
use crate::run::Run;
use crate::state::{RunState, StepState};

/// Budgets whose consumption only accumulates. The others are gauges that may go down by
/// design: `same_error` and `no_progress_steps` reset on progress, `diff_lines` and
/// `files_changed` follow the working tree, `parallel_workers` is a level.
pub const CUMULATIVE: [BudgetName; 9] = [
    BudgetName::Tokens,
    BudgetName::CostUsd,
    BudgetName::WallTime,
    BudgetName::ComputeTime,
    BudgetName::Steps,
    BudgetName::ToolCalls,
    BudgetName::Writes,
    BudgetName::NetworkRequests,
    BudgetName::Approvals,
];

/// One broken invariant: where, which rule, and what was seen.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Violation {
    /// The sequence number of the event where it shows (0: the log as a whole).
    pub seq: u64,
    pub rule: &'static str,
    pub detail: String,
}

impl std::fmt::Display for Violation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "event {}: {}: {}", self.seq, self.rule, self.detail)
    }
}

/// What a log that keeps every invariant folds to.
#[derive(Debug, Clone)]
pub struct Audit {
    pub run: Run,
    pub effects: Vec<Effect>,
    /// Steps verified at some point of the log.
    pub verified_steps: BTreeSet<StepId>,
}

/// Checks every invariant of one run's log (all of its events, in order).
pub fn check(events: &[Event]) -> Result<Audit, Vec<Violation>> {
    let mut v = Vec::new();
    let Some(first) = events.first() else {
        return Err(vec![violation(0, "log", "the log has no events".into())]);
    };
    let mut run = match Run::create(first) {
        Ok(run) => run,
        Err(e) => return Err(vec![violation(first.seq, "fold", e.to_string())]),
    };
    let mut sums = Sums::default();
    sums.add(&first.body);
    let mut verified: BTreeMap<StepId, u64> = BTreeMap::new();
    let mut invalidated: BTreeMap<StepId, u64> = BTreeMap::new();
    for (i, event) in events.iter().enumerate() {
        let expected = i as u64 + 1;
        if event.seq != expected {
            v.push(violation(
                event.seq,
                "sequence",
                format!("expected sequence number {expected}"),
            ));
        }
        if event.run_id != first.run_id {
            v.push(violation(
                event.seq,
                "sequence",
                format!("belongs to run {}, not {}", event.run_id, first.run_id),
            ));
        }
        if i == 0 {
            continue;
        }
        if run.state.is_terminal() {
            v.push(violation(
                event.seq,
                "after_terminal",
                format!("{} after the run was {}", event.body.kind(), run.state),
            ));
            break;
        }
        if let EventBody::StateChanged { from, to, .. } = &event.body {
            if *from != run.state {
                v.push(violation(
                    event.seq,
                    "transition",
                    format!("says the run was {from}, but it was {}", run.state),
                ));
            }
            if !from.can_become(*to) {
                v.push(violation(
                    event.seq,
                    "transition",
                    format!("{from} → {to} is not a legal transition"),
                ));
            }
        }
        let before = run.clone();
        if let Err(e) = run.apply(event) {
            v.push(violation(event.seq, "fold", e.to_string()));
            break;
        }
        sums.add(&event.body);
        for budget in CUMULATIVE {
            if run.used(budget) < before.used(budget) {
                v.push(violation(
                    event.seq,
                    "budget_decreased",
                    format!(
                        "{} went from {} to {}",
                        budget.as_str(),
                        before.used(budget),
                        run.used(budget)
                    ),
                ));
            }
        }
        check_limits(event, &before, &run, &mut v);
        for (p, phase) in run.phases.iter().enumerate() {
            for (s, step) in phase.held_steps() {
                let id = StepId {
                    phase: p as u32,
                    index: s,
                };
                if step.state == StepState::Verified {
                    verified.entry(id).or_insert(event.seq);
                }
            }
        }
        if let EventBody::StepInvalidated { step, .. } = &event.body {
            invalidated.insert(*step, event.seq);
        }
    }
    let last = events.last().map_or(0, |e| e.seq);
    for (id, since) in &verified {
        // A step the projection let go was settled, and no event may change it after.
        let let_go = run
            .phases
            .get(id.phase as usize)
            .is_some_and(|p| id.index < p.earlier);
        let still = let_go
            || run
                .step(*id)
                .is_some_and(|s| s.state == StepState::Verified);
        let excused = invalidated.get(id).is_some_and(|at| at > since);
        if !still && !excused {
            v.push(violation(
                last,
                "verified_step_lost",
                format!("step {id}, verified at event {since}, is no longer verified and no event invalidated it"),
            ));
        }
    }
    for budget in CUMULATIVE {
        // Wall time is the time between events; it has no usage event to add up.
        if budget == BudgetName::WallTime {
            continue;
        }
        let summed = sums.used.get(&budget).copied().unwrap_or(0);
        if run.used(budget) != summed {
            v.push(violation(
                last,
                "budget_sum",
                format!(
                    "{} consumed is {} but the usage events add up to {summed}",
                    budget.as_str(),
                    run.used(budget)
                ),
            ));
        }
    }
    let effects = ledger(events.iter().map(|e| (e.seq, &e.body)));
    check_settlements(events, &mut v);
    if v.is_empty() {
        Ok(Audit {
            run,
            effects,
            verified_steps: verified.into_keys().collect(),
        })
    } else {
        Err(v)
    }
}

/// With the number of times an outside service applied each idempotency key, for the effects
/// that reach that service: every key was applied at most once, and exactly once when the ledger
/// says `done`. Keys the ledger does not know were applied by something other than this run and
/// are reported too.
pub fn check_applied(effects: &[Effect], applied: &BTreeMap<String, u64>) -> Vec<Violation> {
    let mut v = Vec::new();
    for effect in effects {
        let n = applied.get(&effect.key).copied().unwrap_or(0);
        if n > 1 {
            v.push(violation(
                effect.intended_seq,
                "effect_applied_twice",
                format!(
                    "{} (step {} call {}) was applied {n} times",
                    effect.key, effect.step, effect.call
                ),
            ));
        }
        if effect.status == EffectStatus::Done && n != 1 {
            v.push(violation(
                effect.settled_seq.unwrap_or(effect.intended_seq),
                "effect_done_not_applied",
                format!("{} is recorded done but was applied {n} times", effect.key),
            ));
        }
    }
    let known: BTreeSet<&str> = effects.iter().map(|e| e.key.as_str()).collect();
    for (key, n) in applied {
        if !known.contains(key.as_str()) {
            v.push(violation(
                0,
                "effect_unknown",
                format!("{key} was applied {n} times but the run never intended it"),
            ));
        }
    }
    v
}

/// The facts of a run that an interruption must not change: where it ended, what was verified,
/// the verdict of every verifier, the effects and the decisions. Counters that an interruption
/// legitimately changes (wall time, attempts of a step that was rolled back and made again,
/// `resumed` events) are left out.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Outcome {
    pub state: RunState,
    /// Per phase: verified, and the state of each step.
    pub phases: Vec<(String, bool, Vec<StepState>)>,
    /// Per verifier: whether its newest evidence passed, and the tree it judged.
    pub verdicts: BTreeMap<String, (bool, String)>,
    /// Per effect: its key, tool and status.
    pub effects: Vec<(String, String, EffectStatus)>,
    /// Per approval request: its kind of gate and the decision.
    pub approvals: Vec<(String, Option<bool>)>,
    pub plan: Vec<String>,
    pub notes: Vec<String>,
    pub model_calls: u64,
}

impl Outcome {
    pub fn of(audit: &Audit) -> Outcome {
        let run = &audit.run;
        Outcome {
            state: run.state,
            phases: run
                .phases
                .iter()
                .map(|p| {
                    (
                        p.name.clone(),
                        p.verified,
                        p.steps.iter().map(|s| s.state).collect(),
                    )
                })
                .collect(),
            verdicts: run
                .evidence
                .iter()
                .map(|(name, e)| (name.clone(), (e.passed, e.tree.clone())))
                .collect(),
            effects: audit
                .effects
                .iter()
                .map(|e| (e.key.clone(), e.tool.clone(), e.status))
                .collect(),
            approvals: run
                .approvals
                .iter()
                .map(|a| {
                    (
                        serde_json::to_string(&a.request.gate).unwrap_or_default(),
                        a.decision.as_ref().map(|d| d.approve),
                    )
                })
                .collect(),
            plan: run.plan.clone(),
            notes: run.notes.clone(),
            model_calls: run.model_calls,
        }
    }

    /// Every difference from `reference`, one line each (empty when they agree).
    pub fn differences(&self, reference: &Outcome) -> Vec<String> {
        let mut out = Vec::new();
        let (a, b) = (
            serde_json::to_value(self).unwrap_or_default(),
            serde_json::to_value(reference).unwrap_or_default(),
        );
        if let (Some(a), Some(b)) = (a.as_object(), b.as_object()) {
            for (field, value) in a {
                if b.get(field) != Some(value) {
                    out.push(format!(
                        "{field}: {value} (the reference has {})",
                        b.get(field).cloned().unwrap_or_default()
                    ));
                }
            }
        }
        out
    }
}

fn violation(seq: u64, rule: &'static str, detail: String) -> Violation {
    Violation { seq, rule, detail }
}

/// Limits change only through `budget_raised`, by a named person, and only the budget it names,
/// from what it was to what it says.
fn check_limits(event: &Event, before: &Run, after: &Run, v: &mut Vec<Violation>) {
    for budget in BudgetName::ALL {
        let (old, new) = (before.limits.get(budget), after.limits.get(budget));
        if old == new {
            continue;
        }
        let legal = matches!(
            &event.body,
            EventBody::BudgetRaised { budget: b, from, to, by, .. }
                if *b == budget && *from == old && Some(*to) == new && !by.trim().is_empty()
        );
        if !legal {
            v.push(violation(
                event.seq,
                "limit_changed",
                format!(
                    "the {} limit went from {old:?} to {new:?} through {}",
                    budget.as_str(),
                    event.body.kind()
                ),
            ));
        }
    }
}

/// Each effect's settlements follow its status machine (intended first, then legal steps).
fn check_settlements(events: &[Event], v: &mut Vec<Violation>) {
    let mut status: BTreeMap<&str, EffectStatus> = BTreeMap::new();
    for event in events {
        match &event.body {
            // Every intent is recorded; one under a key seen before is reported.
            EventBody::EffectIntended { key, .. }
                if status.insert(key, EffectStatus::Intended).is_some() =>
            {
                v.push(violation(
                    event.seq,
                    "effect_intended_twice",
                    format!("{key} was intended again"),
                ));
            }
            EventBody::EffectSettled {
                key, status: to, ..
            } => match status.get(key.as_str()) {
                None => v.push(violation(
                    event.seq,
                    "effect_settled_unintended",
                    format!("{key} settled {} without being intended", to.as_str()),
                )),
                Some(from) if !from.can_become(*to) => v.push(violation(
                    event.seq,
                    "effect_transition",
                    format!("{key}: {} → {} is not legal", from.as_str(), to.as_str()),
                )),
                Some(_) => {
                    status.insert(key, *to);
                }
            },
            _ => {}
        }
    }
}

/// Budget usage recomputed from the events that carry it, independently of the fold.
#[derive(Default)]
struct Sums {
    used: BTreeMap<BudgetName, u64>,
    /// The tool of each call decided so far, and whether it waits for a person.
    calls: BTreeMap<(StepId, u32), (String, bool)>,
    /// Whether the step in progress is an agent step.
    agent_step: bool,
}

impl Sums {
    fn charge(&mut self, budget: BudgetName, amount: u64) {
        let used = self.used.entry(budget).or_insert(0);
        *used = used.saturating_add(amount);
    }

    fn add(&mut self, body: &EventBody) {
        match body {
            EventBody::StepStarted { agent, .. } => {
                self.agent_step = *agent;
                self.charge(BudgetName::Steps, 1);
                if !*agent {
                    self.charge(BudgetName::ToolCalls, 1);
                }
            }
            EventBody::ModelReplied {
                usage,
                cost_micro_usd,
                ..
            } => {
                self.charge(BudgetName::Tokens, usage.input_tokens + usage.output_tokens);
                self.charge(BudgetName::CostUsd, *cost_micro_usd);
            }
            EventBody::PolicyDecision {
                step,
                call,
                tool,
                decision,
                ..
            } => {
                let waiting = *decision == crate::event::Decision::NeedsApproval;
                let previous = self.calls.insert((*step, *call), (tool.clone(), waiting));
                // A call that waited for a person is decided again once; it is one call.
                if !previous.is_some_and(|(_, waited)| waited) {
                    self.charge(BudgetName::ToolCalls, 1);
                }
            }
            EventBody::ToolCallFinished {
                step,
                call,
                changed,
                ..
            } => {
                self.charge(BudgetName::Writes, changed.len() as u64);
                if self
                    .calls
                    .get(&(*step, *call))
                    .is_some_and(|(tool, _)| tool == "http")
                {
                    self.charge(BudgetName::NetworkRequests, 1);
                }
            }
            EventBody::StepFinished {
                files_written,
                cpu_ms,
                ..
            } => {
                if !self.agent_step {
                    self.charge(BudgetName::Writes, *files_written);
                }
                self.charge(BudgetName::ComputeTime, *cpu_ms);
            }
            EventBody::EvidenceRecorded { evidence } => {
                self.charge(BudgetName::ComputeTime, evidence.cpu_ms);
            }
            EventBody::ApprovalRequested { .. } | EventBody::QuestionAsked { .. } => {
                self.charge(BudgetName::Approvals, 1);
            }
            _ => {}
        }
    }
}
