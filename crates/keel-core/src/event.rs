//! The versioned event vocabulary and the hash chain over it.
//!
//! Events are the audit log and the source of truth: the run projection is a fold over them
//! ([`crate::run::Run::apply`]). The body is stored as JSON with a `kind` tag; the envelope carries
//! a version so that old logs stay readable when the vocabulary grows.

use serde::{Deserialize, Serialize};

use crate::agent::{ModelReply, Reversibility, Usage};
use crate::budget::{BudgetLimits, BudgetName};
use crate::fingerprint::{Fingerprint, FingerprintChange};
use crate::state::RunState;

/// The version of the event encoding this keel writes. A decoder keeps reading every older one.
pub const EVENT_VERSION: u32 = 1;

/// The `prev_hash` of a run's first event.
pub const GENESIS_HASH: &str = "0000000000000000000000000000000000000000000000000000000000000000";

/// Identifies a step: the phase's index in the contract and the step's index in the phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StepId {
    pub phase: u32,
    pub index: u32,
}

impl std::fmt::Display for StepId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.phase + 1, self.index + 1)
    }
}

/// A verifier's result: what ran, how it ended, where its output is, and in which environment.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Evidence {
    /// 1-based number of this evidence within the run.
    pub n: u32,
    pub verifier: String,
    pub tier: crate::contract::Tier,
    pub command: String,
    pub passed: bool,
    /// `exit 0`, `exit 1`, `killed by signal 9`, `timed out after 10s`.
    pub status: String,
    pub duration_ms: u64,
    pub cpu_ms: u64,
    /// Artifact hash of the combined stdout and stderr.
    pub output: String,
    /// The working tree the verifier judged.
    pub tree: String,
    /// Hash of the environment fingerprint at the time.
    pub fingerprint: String,
    /// The step this evidence judged, for step verifiers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step: Option<StepId>,
    /// The phase this evidence judged, for phase verifiers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<u32>,
    /// For a failure: the part of the output that says what failed, compacted for a prompt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub excerpt: Option<String>,
}

/// What a budget stop names: the budget, what was used and the limit.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BudgetStop {
    pub budget: BudgetName,
    pub used: u64,
    pub limit: u64,
}

impl std::fmt::Display for BudgetStop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "budget `{}` exhausted: used {} of {}",
            self.budget,
            self.budget.format_amount(self.used),
            self.budget.format_amount(self.limit)
        )
    }
}

/// Why a run is blocked, in a form a program can act on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "cause", rename_all = "snake_case", deny_unknown_fields)]
pub enum Block {
    Budget(BudgetStop),
    Drift {
        changes: Vec<FingerprintChange>,
    },
    Verification {
        verifier: String,
        evidence: u32,
    },
    /// The driver called `blocked`.
    Driver {
        category: String,
        reason: String,
    },
    /// The driver could not be asked (a rejected key or model, retries used up, a script out of
    /// actions).
    DriverFailed {
        message: String,
    },
    /// The driver went round in circles; the approach is a rejected path now.
    Loop {
        kind: String,
    },
    /// A person rejected approval request `n` (or nobody decided it in time).
    Rejected {
        n: u32,
        by: String,
        reason: String,
    },
}

/// What the policy check said about a tool call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Decision {
    Allow,
    Deny,
    NeedsApproval,
}

impl Decision {
    pub fn as_str(self) -> &'static str {
        match self {
            Decision::Allow => "allow",
            Decision::Deny => "deny",
            Decision::NeedsApproval => "needs_approval",
        }
    }
}

/// What an approval request holds back.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "gate", rename_all = "snake_case", deny_unknown_fields)]
pub enum Gate {
    /// A phase whose contract says `approval = true`, before its first step.
    Phase { phase: u32 },
    /// Raising a budget that ran out.
    BudgetRaise { budget: BudgetName, to: u64 },
    /// Continuing in an environment that changed.
    Migration,
    /// A tool call whose class (or tool) the contract says needs a person's approval.
    ToolCall { step: StepId, call: u32 },
    /// A call with an external effect was interrupted and its outcome is unknown: approve to
    /// make it again with the same key, reject to leave it unrepeated.
    Reconcile {
        step: StepId,
        call: u32,
        key: String,
    },
}

/// Where an external effect stands (§3 of the design: intended → done | failed | unknown →
/// compensated).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EffectStatus {
    /// The key is written; the call may or may not have been made.
    Intended,
    Done,
    Failed,
    /// Made (perhaps) but its outcome was not recorded before a crash.
    Unknown,
    /// Undone by its compensation.
    Compensated,
}

impl EffectStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            EffectStatus::Intended => "intended",
            EffectStatus::Done => "done",
            EffectStatus::Failed => "failed",
            EffectStatus::Unknown => "unknown",
            EffectStatus::Compensated => "compensated",
        }
    }

    /// Whether `self` may become `to`.
    pub fn can_become(self, to: EffectStatus) -> bool {
        use EffectStatus::*;
        matches!(
            (self, to),
            (Intended, Done | Failed | Unknown) | (Unknown, Done | Failed) | (Done, Compensated)
        )
    }
}

impl std::fmt::Display for EffectStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The idempotency key of call `call` of step `step` of run `run`: blake3 over the three,
/// length-prefixed, as 32 hex digits. The same call always gets the same key, so a retry after a
/// crash is recognised by the service that honours it.
pub fn effect_key(run: &str, step: StepId, call: u32) -> String {
    let mut h = blake3::Hasher::new();
    h.update(&(run.len() as u64).to_le_bytes());
    h.update(run.as_bytes());
    h.update(&step.phase.to_le_bytes());
    h.update(&step.index.to_le_bytes());
    h.update(&call.to_le_bytes());
    let hex = h.finalize().to_hex();
    format!("keel-{}", &hex[..32])
}

/// One verification result shown with an approval request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Check {
    pub verifier: String,
    pub passed: bool,
    pub status: String,
    pub evidence: u32,
}

/// What happens to a request nobody decided by its deadline.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnExpiry {
    Reject,
    Block,
}

/// A request for a person's decision, created by the harness (never by a driver's text): what
/// is intended, the exact payload and its hash, the checks so far, the risk, the way back.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApprovalRequest {
    /// 1-based number of the request within the run.
    pub n: u32,
    pub gate: Gate,
    /// One sentence.
    pub intent: String,
    /// The exact payload: the commands, the diff, the JSON body.
    pub payload: String,
    /// blake3 of `payload`; a decision names it, and applies only to this payload.
    pub payload_hash: String,
    pub checks: Vec<Check>,
    pub risk: String,
    pub reversibility: Reversibility,
    /// How to undo the action if it goes wrong (the compensation), or why it needs none.
    pub rollback: String,
    pub created_at_ms: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at_ms: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_expiry: Option<OnExpiry>,
}

impl ApprovalRequest {
    pub fn hash_payload(payload: &str) -> String {
        blake3::hash(payload.as_bytes()).to_hex().to_string()
    }
}

/// Choices made on the command line for one run, overriding the contract's `[driver]`;
/// recorded with the run so that a resume makes the same ones.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DriverChoice {
    pub kind: Option<crate::contract::DriverKind>,
    pub model: Option<String>,
}

/// The phases of a contract as the run saw them at creation: names and their commands.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PhaseOutline {
    pub name: String,
    /// The commands of a command phase; empty for an agent phase, whose steps are made as the
    /// driver decides.
    pub commands: Vec<String>,
    #[serde(default)]
    pub agent: bool,
    /// A person approves the phase before its first step.
    #[serde(default)]
    pub approval: bool,
}

/// Every kind of event keel writes, version 1.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum EventBody {
    RunCreated {
        contract_hash: String,
        contract_file: String,
        workspace: String,
        phases: Vec<PhaseOutline>,
        /// The acceptance verifiers whose passing evidence `completed` requires.
        acceptance: Vec<String>,
        limits: BudgetLimits,
        base: Fingerprint,
        keel_version: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        driver: Option<DriverChoice>,
        /// The contract turned the sandbox off (`[sandbox] mode = "off"`): commands ran
        /// unconfined.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        sandbox_off: bool,
    },
    /// A change of run state, with its cause in words and, for `blocked`, in structure.
    StateChanged {
        from: RunState,
        to: RunState,
        reason: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        block: Option<Block>,
    },
    /// A process took the run (first drive or resume).
    Resumed {
        holder: String,
        lease: u64,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        checkpoint: Option<u32>,
    },
    PhaseStarted {
        phase: u32,
        name: String,
    },
    StepStarted {
        step: StepId,
        attempt: u32,
        command: String,
        /// An agent step: the driver decides its tool calls (each counted as a tool call).
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        agent: bool,
    },
    /// The request for an agent step's decision, stored before it is sent.
    ModelRequested {
        step: StepId,
        /// Artifact hash of the exact request bytes.
        request: String,
        prompt_tokens: u64,
        context_tokens: u64,
    },
    /// The driver's answer, with what it cost.
    ModelReplied {
        step: StepId,
        /// Artifact hash of the exact response bytes.
        response: String,
        reply: ModelReply,
        usage: Usage,
        cost_micro_usd: u64,
        retries: Vec<String>,
        duration_ms: u64,
        /// For a driver that edits the workspace itself (a delegated program): the tree it
        /// left.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        post_tree: Option<String>,
    },
    /// The policy check of one tool call of an agent step, before anything runs.
    PolicyDecision {
        step: StepId,
        call: u32,
        tool: String,
        /// The arguments as the driver wrote them (cut to a few KiB).
        arguments: String,
        decision: Decision,
        rule: String,
        reversibility: Reversibility,
        /// The working tree before a call that may change it: what an interrupted call is
        /// rolled back to.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pre_tree: Option<String>,
        /// For a denial: the fingerprint that counts toward `same_error`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        error_fingerprint: Option<String>,
    },
    /// The outcome of an allowed tool call, and what the driver is shown of it.
    ToolCallFinished {
        step: StepId,
        call: u32,
        ok: bool,
        observation: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        output: Option<String>,
        changed: Vec<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        error_fingerprint: Option<String>,
        /// The working tree after a call that may change it.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        post_tree: Option<String>,
    },
    /// An external effect is about to be attempted: its key, class and payload are durable
    /// before anything runs.
    EffectIntended {
        step: StepId,
        call: u32,
        key: String,
        tool: String,
        class: Reversibility,
        /// The tool honours the key, so it may be retried with it.
        keyed: bool,
        /// What is attempted (the command line, the request), cut to a few KiB.
        payload: String,
        /// The command that undoes it, for a compensatable tool.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        compensation: Option<String>,
    },
    /// Where an effect stands now.
    EffectSettled {
        step: StepId,
        call: u32,
        key: String,
        status: EffectStatus,
        detail: String,
    },
    PlanUpdated {
        step: StepId,
        items: Vec<String>,
    },
    NoteAdded {
        step: StepId,
        text: String,
    },
    /// The driver claimed the phase's objective is met; the verifiers decide.
    FinishClaimed {
        step: StepId,
        summary: String,
    },
    /// Changes outside the contract's scope, made during a step, were undone.
    ScopeReverted {
        step: StepId,
        paths: Vec<String>,
        /// The working tree once they were undone.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        post_tree: Option<String>,
    },
    /// A verification the driver asked for (by `finish`) failed; the evidence goes back to it.
    VerificationFailed {
        phase: u32,
        verifier: String,
        evidence: u32,
        error_fingerprint: String,
    },
    /// The driver is going round in circles; `rejected_path` is kept so it is not tried again.
    ApprovalRequested {
        request: ApprovalRequest,
    },
    /// A person's decision on request `n`, naming the payload hash it approves or rejects.
    ApprovalDecided {
        n: u32,
        approve: bool,
        payload_hash: String,
        by: String,
        reason: String,
        /// `cli`, `http`, `expiry`.
        via: String,
    },
    /// The driver asked a person a question (the `ask` tool); the run waits for the answer.
    QuestionAsked {
        n: u32,
        step: StepId,
        question: String,
    },
    QuestionAnswered {
        n: u32,
        answer: String,
        by: String,
        via: String,
    },
    /// The contract's notify command was run for a new request; `ok` false never stops the run.
    Notified {
        what: String,
        status: String,
        ok: bool,
    },
    /// An incident hold: while frozen nothing runs.
    Frozen {
        reason: String,
        by: String,
    },
    Unfrozen {
        reason: String,
        by: String,
    },
    LoopDetected {
        step: StepId,
        /// `repeat`, `ping_pong`.
        pattern: String,
        evidence: String,
        rejected_path: String,
    },
    StepFinished {
        step: StepId,
        /// Agent steps: a hash of what the step did and what came of it, for loop detection.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        signature: Option<String>,
        status: String,
        success: bool,
        duration_ms: u64,
        cpu_ms: u64,
        output: String,
        post: Fingerprint,
        /// Files this step changed (the `writes` it made).
        files_written: u64,
        /// The size of the whole run's change against its base, after this step.
        diff_files: u64,
        diff_lines: u64,
    },
    EvidenceRecorded {
        evidence: Evidence,
    },
    StepVerified {
        step: StepId,
    },
    /// A step failed; its partial changes were undone (`rolled_back` names the paths).
    StepFailed {
        step: StepId,
        reason: String,
        error_fingerprint: String,
        excerpt: String,
        rolled_back: Vec<String>,
        /// Agent steps keep their changes: the driver sees the failure and works on.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        kept: bool,
    },
    /// A step interrupted by a crash was undone before it is run again. What the working tree
    /// held at that moment is kept under `saved_ref` so nothing is lost.
    StepRolledBack {
        step: StepId,
        restored: Vec<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        saved_ref: Option<String>,
    },
    StepInvalidated {
        step: StepId,
        reason: String,
    },
    PhaseVerified {
        phase: u32,
    },
    CheckpointTaken {
        n: u32,
        /// blake3 of the stored checkpoint body.
        hash: String,
        snapshot_ref: String,
        commit: String,
    },
    BudgetRaised {
        budget: BudgetName,
        from: Option<u64>,
        to: u64,
        reason: String,
        by: String,
    },
    DriftDetected {
        changes: Vec<FingerprintChange>,
    },
    Migrated {
        changes: Vec<FingerprintChange>,
        reason: String,
        by: String,
        fingerprint: Fingerprint,
    },
    /// A torn last write was found and cut back; `seq` is the first sequence number removed.
    TailCut {
        seq: u64,
        reason: String,
    },
    Cancelled {
        reason: String,
        by: String,
    },
}

impl EventBody {
    /// The `kind` tag, as stored beside the body for queries.
    pub fn kind(&self) -> &'static str {
        match self {
            EventBody::RunCreated { .. } => "run_created",
            EventBody::StateChanged { .. } => "state_changed",
            EventBody::Resumed { .. } => "resumed",
            EventBody::PhaseStarted { .. } => "phase_started",
            EventBody::StepStarted { .. } => "step_started",
            EventBody::ModelRequested { .. } => "model_requested",
            EventBody::ModelReplied { .. } => "model_replied",
            EventBody::PolicyDecision { .. } => "policy_decision",
            EventBody::ToolCallFinished { .. } => "tool_call_finished",
            EventBody::EffectIntended { .. } => "effect_intended",
            EventBody::EffectSettled { .. } => "effect_settled",
            EventBody::PlanUpdated { .. } => "plan_updated",
            EventBody::NoteAdded { .. } => "note_added",
            EventBody::FinishClaimed { .. } => "finish_claimed",
            EventBody::ScopeReverted { .. } => "scope_reverted",
            EventBody::VerificationFailed { .. } => "verification_failed",
            EventBody::LoopDetected { .. } => "loop_detected",
            EventBody::ApprovalRequested { .. } => "approval_requested",
            EventBody::QuestionAsked { .. } => "question_asked",
            EventBody::QuestionAnswered { .. } => "question_answered",
            EventBody::Notified { .. } => "notified",
            EventBody::Frozen { .. } => "frozen",
            EventBody::Unfrozen { .. } => "unfrozen",
            EventBody::ApprovalDecided { .. } => "approval_decided",
            EventBody::StepFinished { .. } => "step_finished",
            EventBody::EvidenceRecorded { .. } => "evidence_recorded",
            EventBody::StepVerified { .. } => "step_verified",
            EventBody::StepFailed { .. } => "step_failed",
            EventBody::StepRolledBack { .. } => "step_rolled_back",
            EventBody::StepInvalidated { .. } => "step_invalidated",
            EventBody::PhaseVerified { .. } => "phase_verified",
            EventBody::CheckpointTaken { .. } => "checkpoint_taken",
            EventBody::BudgetRaised { .. } => "budget_raised",
            EventBody::DriftDetected { .. } => "drift_detected",
            EventBody::Migrated { .. } => "migrated",
            EventBody::TailCut { .. } => "tail_cut",
            EventBody::Cancelled { .. } => "cancelled",
        }
    }

    /// The canonical JSON encoding (struct fields in declaration order, maps sorted).
    pub fn encode(&self) -> String {
        // Every field is a string, number, bool, enum, Vec or BTreeMap: serialisation cannot
        // fail, so an empty body here would be a bug caught by the chain check on read.
        serde_json::to_string(self).unwrap_or_default()
    }

    /// Decodes a stored body written by event encoding `version`.
    pub fn decode(version: u32, json: &str) -> Result<EventBody, DecodeError> {
        match version {
            1 => serde_json::from_str(json).map_err(|e| DecodeError::Body(e.to_string())),
            v => Err(DecodeError::Version(v)),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error(
        "event encoding version {0} is newer than this keel understands (it reads up to {EVENT_VERSION}); upgrade keel"
    )]
    Version(u32),
    #[error("event body does not decode: {0}")]
    Body(String),
}

/// An event with its place in the run's log.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Event {
    pub run_id: String,
    pub seq: u64,
    pub at_ms: i64,
    pub body: EventBody,
}

/// The stored form of an event as the hash chain covers it: every column but the hash.
#[derive(Debug, Clone, Copy)]
pub struct Envelope<'a> {
    pub prev_hash: &'a str,
    pub run_id: &'a str,
    pub seq: u64,
    pub at_ms: i64,
    pub version: u32,
    pub kind: &'a str,
    pub body: &'a str,
}

impl Envelope<'_> {
    /// The hash chain: blake3 over the previous hash and the event's canonical encoding, each
    /// field length-prefixed so that no two different events encode alike.
    pub fn hash(&self) -> String {
        let mut h = blake3::Hasher::new();
        for field in [self.prev_hash, self.run_id] {
            h.update(&(field.len() as u64).to_le_bytes());
            h.update(field.as_bytes());
        }
        h.update(&self.seq.to_le_bytes());
        h.update(&self.at_ms.to_le_bytes());
        h.update(&self.version.to_le_bytes());
        for field in [self.kind, self.body] {
            h.update(&(field.len() as u64).to_le_bytes());
            h.update(field.as_bytes());
        }
        h.finalize().to_hex().to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_round_trip_through_the_encoding() {
        let body = EventBody::StepStarted {
            step: StepId { phase: 1, index: 2 },
            attempt: 1,
            command: "make".into(),
            agent: false,
        };
        let json = body.encode();
        assert!(json.starts_with(r#"{"kind":"step_started""#), "{json}");
        assert_eq!(EventBody::decode(EVENT_VERSION, &json), Ok(body));
    }

    #[test]
    fn effect_keys_are_stable_and_distinct() {
        let s = StepId { phase: 0, index: 1 };
        let k = effect_key("run-1", s, 0);
        assert_eq!(k, effect_key("run-1", s, 0));
        assert!(k.starts_with("keel-") && k.len() == 37, "{k}");
        assert_ne!(k, effect_key("run-1", s, 1));
        assert_ne!(k, effect_key("run-2", s, 0));
        assert_ne!(k, effect_key("run-1", StepId { phase: 1, index: 0 }, 0));
    }

    #[test]
    fn effect_statuses_only_move_forward() {
        use EffectStatus::*;
        assert!(Intended.can_become(Done) && Intended.can_become(Unknown));
        assert!(Unknown.can_become(Done) && Done.can_become(Compensated));
        assert!(!Done.can_become(Done) && !Failed.can_become(Done));
        assert!(!Done.can_become(Intended) && !Compensated.can_become(Done));
    }

    #[test]
    fn a_newer_version_is_refused_with_advice() {
        let err = EventBody::decode(99, "{}").unwrap_err();
        assert!(err.to_string().contains("upgrade keel"));
    }

    #[test]
    fn the_chain_hash_depends_on_every_field() {
        let base = Envelope {
            prev_hash: GENESIS_HASH,
            run_id: "r",
            seq: 1,
            at_ms: 5,
            version: 1,
            kind: "resumed",
            body: "{}",
        };
        let h = base.hash();
        let other = "1".repeat(64);
        for changed in [
            Envelope {
                prev_hash: &other,
                ..base
            },
            Envelope {
                run_id: "r2",
                ..base
            },
            Envelope { seq: 2, ..base },
            Envelope { at_ms: 6, ..base },
            Envelope { version: 2, ..base },
            Envelope {
                kind: "migrated",
                ..base
            },
            Envelope {
                body: "{ }",
                ..base
            },
            // Length prefixes: moving a byte between fields changes the hash.
            Envelope {
                kind: "resumed{",
                body: "}",
                ..base
            },
        ] {
            assert_ne!(changed.hash(), h, "{changed:?}");
        }
    }
}
