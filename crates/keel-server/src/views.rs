//! The API's serialisable types: the wire format of `keel serve`. Field names follow the CLI's
//! `--json` output (`keel status`, `keel log`, `keel approvals`), so a script reads both alike.

use std::collections::BTreeMap;

use keel_core::budget::{BudgetName, Unit};
use keel_core::event::{Block, Check, Evidence, Gate};
use keel_core::run::{Answer, Approval, ApprovalDecision, Run};
use keel_store::StoredEvent;
use serde::{Deserialize, Serialize};

use keel_core::time::rfc3339 as time;

#[derive(Debug, Clone, Serialize)]
pub struct BudgetView {
    pub used: u64,
    pub limit: Option<u64>,
    /// `count`, `ms` or `micro_usd`.
    pub unit: &'static str,
    pub enforced: bool,
}

/// One run as the list shows it.
#[derive(Debug, Clone, Serialize)]
pub struct RunSummary {
    pub id: String,
    pub state: &'static str,
    pub reason: String,
    pub block: Option<Block>,
    pub frozen: bool,
    /// The phase being worked on (none once all are done).
    pub phase: Option<String>,
    pub phase_index: u32,
    pub phase_count: usize,
    pub budgets: BTreeMap<&'static str, BudgetView>,
    /// Time the run was active (its `wall_time` budget).
    pub working_ms: u64,
    /// Time spent waiting for people (approvals, answers), finished waits only.
    pub human_wait_ms: u64,
    /// When the current wait for a person began, if the run waits now.
    pub waiting_since_ms: Option<i64>,
    pub pending_approvals: usize,
    pub pending_questions: usize,
    pub contract: String,
    pub workspace: String,
    pub created_at: String,
    pub created_at_ms: i64,
    pub updated_at: String,
    pub updated_at_ms: i64,
    /// How many events the log holds.
    pub events: u64,
}

impl RunSummary {
    pub fn of(run: &Run) -> RunSummary {
        let budgets = BudgetName::ALL
            .iter()
            .map(|b| {
                (
                    b.as_str(),
                    BudgetView {
                        used: run.used(*b),
                        limit: run.limits.get(*b),
                        unit: match b.unit() {
                            Unit::Count => "count",
                            Unit::Millis => "ms",
                            Unit::MicroUsd => "micro_usd",
                        },
                        enforced: b.enforced(),
                    },
                )
            })
            .collect();
        RunSummary {
            id: run.id.clone(),
            state: run.state.as_str(),
            reason: run.reason.clone(),
            block: run.block.clone(),
            frozen: run.frozen,
            phase: run.phases.get(run.cursor as usize).map(|p| p.name.clone()),
            phase_index: run.cursor,
            phase_count: run.phases.len(),
            budgets,
            working_ms: run.used(BudgetName::WallTime),
            human_wait_ms: run.human_wait_ms,
            waiting_since_ms: run.waiting_since_ms,
            pending_approvals: run
                .approvals
                .iter()
                .filter(|a| a.decision.is_none())
                .count(),
            pending_questions: run.questions.iter().filter(|q| q.answer.is_none()).count(),
            contract: run.contract_file.clone(),
            workspace: run.workspace.clone(),
            created_at: time(run.created_at_ms),
            created_at_ms: run.created_at_ms,
            updated_at: time(run.updated_at_ms),
            updated_at_ms: run.updated_at_ms,
            events: run.seq,
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct StepView {
    pub command: String,
    pub state: &'static str,
    pub attempts: u32,
    /// Artifact hash of the latest attempt's output.
    pub output: Option<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct PhaseView {
    pub name: String,
    pub verified: bool,
    pub agent: bool,
    pub gated: bool,
    pub approved: bool,
    /// Settled steps before `steps` that the projection no longer holds.
    pub earlier_steps: u32,
    pub steps: Vec<StepView>,
}

/// One run in full.
#[derive(Debug, Clone, Serialize)]
pub struct RunDetail {
    #[serde(flatten)]
    pub summary: RunSummary,
    pub phases: Vec<PhaseView>,
    pub evidence: Vec<Evidence>,
    pub checkpoints: u32,
    pub plan: Vec<String>,
    pub plan_version: u32,
    pub notes: Vec<String>,
    pub rejected_paths: Vec<String>,
    pub model_calls: u64,
    pub violations: u64,
    pub approvals: Vec<ApprovalView>,
    pub questions: Vec<QuestionView>,
    pub contract_hash: String,
}

impl RunDetail {
    pub fn of(run: &Run) -> RunDetail {
        RunDetail {
            summary: RunSummary::of(run),
            phases: run
                .phases
                .iter()
                .map(|p| PhaseView {
                    name: p.name.clone(),
                    verified: p.verified,
                    agent: p.agent,
                    gated: p.gated,
                    approved: p.approved,
                    earlier_steps: p.earlier,
                    steps: p
                        .steps
                        .iter()
                        .map(|s| StepView {
                            command: s.command.clone(),
                            state: s.state.as_str(),
                            attempts: s.attempts,
                            output: s.output.clone(),
                        })
                        .collect(),
                })
                .collect(),
            evidence: run.evidence.values().cloned().collect(),
            checkpoints: run.checkpoints,
            plan: run.plan.clone(),
            plan_version: run.plan_version,
            notes: run.notes.clone(),
            rejected_paths: run.rejected_paths.clone(),
            model_calls: run.model_calls,
            violations: run.violations,
            approvals: run
                .approvals
                .iter()
                .map(|a| ApprovalView::of(run, a))
                .collect(),
            questions: run
                .questions
                .iter()
                .map(|q| QuestionView::of(run, q))
                .collect(),
            contract_hash: run.contract_hash.clone(),
        }
    }
}

/// An approval request with its decision once made (the shape of `keel approvals --json`).
#[derive(Debug, Clone, Serialize)]
pub struct ApprovalView {
    pub run: String,
    pub run_state: &'static str,
    pub n: u32,
    pub gate: Gate,
    /// The phase a phase gate holds back, by name.
    pub phase: Option<String>,
    pub intent: String,
    pub payload: String,
    pub payload_hash: String,
    pub checks: Vec<Check>,
    pub risk: String,
    pub reversibility: keel_core::agent::Reversibility,
    pub rollback: String,
    pub created_at: String,
    pub created_at_ms: i64,
    pub expires_at: Option<String>,
    pub decision: Option<ApprovalDecision>,
}

impl ApprovalView {
    pub fn of(run: &Run, a: &Approval) -> ApprovalView {
        let r = &a.request;
        ApprovalView {
            run: run.id.clone(),
            run_state: run.state.as_str(),
            n: r.n,
            gate: r.gate.clone(),
            phase: match &r.gate {
                Gate::Phase { phase } => run.phases.get(*phase as usize).map(|p| p.name.clone()),
                Gate::ToolCall { step, .. } | Gate::Reconcile { step, .. } => {
                    run.phases.get(step.phase as usize).map(|p| p.name.clone())
                }
                Gate::BudgetRaise { .. } | Gate::Migration => None,
            },
            intent: r.intent.clone(),
            payload: r.payload.clone(),
            payload_hash: r.payload_hash.clone(),
            checks: r.checks.clone(),
            risk: r.risk.clone(),
            reversibility: r.reversibility,
            rollback: r.rollback.clone(),
            created_at: time(r.created_at_ms),
            created_at_ms: r.created_at_ms,
            expires_at: r.expires_at_ms.map(time),
            decision: a.decision.clone(),
        }
    }
}

/// A question the driver asked, with the answer once given.
#[derive(Debug, Clone, Serialize)]
pub struct QuestionView {
    pub run: String,
    pub run_state: &'static str,
    pub n: u32,
    /// The step that asked, as `phase.index` (1-based).
    pub step: String,
    pub question: String,
    pub answer: Option<Answer>,
}

impl QuestionView {
    pub fn of(run: &Run, q: &keel_core::run::Question) -> QuestionView {
        QuestionView {
            run: run.id.clone(),
            run_state: run.state.as_str(),
            n: q.n,
            step: q.step.to_string(),
            question: q.question.clone(),
            answer: q.answer.clone(),
        }
    }
}

/// One event of a run's log (the shape of `keel log --json`).
#[derive(Debug, Clone, Serialize)]
pub struct EventView {
    pub seq: u64,
    pub at: String,
    pub at_ms: i64,
    pub kind: String,
    pub body: serde_json::Value,
    pub prev_hash: String,
    pub hash: String,
}

impl EventView {
    pub fn of(e: &StoredEvent) -> EventView {
        EventView {
            seq: e.seq,
            at: time(e.at_ms),
            at_ms: e.at_ms,
            kind: e.kind.clone(),
            body: serde_json::from_str(&e.body)
                .unwrap_or_else(|_| serde_json::Value::String(e.body.clone())),
            prev_hash: e.prev_hash.clone(),
            hash: e.hash.clone(),
        }
    }
}

/// A page of a run's events.
#[derive(Debug, Clone, Serialize)]
pub struct EventsPage {
    pub run: String,
    pub state: &'static str,
    pub events: Vec<EventView>,
    /// The sequence number to ask `after` for the next page (the last one sent, or `after`).
    pub last_seq: u64,
    /// Whether more events follow (ask again with `after=last_seq`).
    pub more: bool,
}

/// What a recorded decision or answer returns.
#[derive(Debug, Clone, Serialize)]
pub struct Recorded {
    pub run: String,
    pub n: u32,
    /// `approve`, `reject` or `answer`.
    pub decision: &'static str,
    pub by: String,
    pub via: &'static str,
    /// The run's state after the delivery.
    pub state: &'static str,
    pub message: String,
}

/// `POST /api/runs/{id}/approvals/{n}`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DecisionBody {
    pub decision: Option<String>,
    pub payload_hash: Option<String>,
    #[serde(default)]
    pub reason: String,
    pub by: Option<String>,
}

/// `POST /api/runs/{id}/questions/{n}`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AnswerBody {
    pub answer: Option<String>,
    pub by: Option<String>,
}

/// `POST /api/runs/{id}/freeze`, `/unfreeze`, `/cancel`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReasonBody {
    pub reason: Option<String>,
    pub by: Option<String>,
}

/// `?after=SEQ&limit=N` of the events endpoints.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EventsQuery {
    #[serde(default)]
    pub after: u64,
    pub limit: Option<usize>,
}

/// `?all=true` of the lists of requests and questions.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AllQuery {
    #[serde(default)]
    pub all: bool,
}
