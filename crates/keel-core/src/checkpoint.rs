//! Checkpoints: consistent snapshots taken at verified milestones, from which resume starts.

use serde::{Deserialize, Serialize};

use crate::fingerprint::Fingerprint;
use crate::run::Run;

/// Everything needed to continue a run without guessing (DESIGN.md §6). The projection `run`
/// carries the contract hash, plan version, phase cursor and step states, the last verified
/// evidence, budgets consumed and their limits, and rejected paths; the rest is named here.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Checkpoint {
    pub n: u32,
    pub run_id: String,
    /// The last event this checkpoint includes; its own `checkpoint_taken` event follows it.
    pub seq: u64,
    pub at_ms: i64,
    pub contract_hash: String,
    pub phase_cursor: u32,
    /// The workspace snapshot: a git commit under `refs/keel/<run>/<n>`.
    pub snapshot_ref: String,
    pub commit: String,
    pub fingerprint: Fingerprint,
    /// Every artifact the run has referenced so far (outputs and evidence logs).
    pub artifacts: Vec<String>,
    /// Approval requests waiting for a decision (none can exist in this version).
    pub pending_approvals: Vec<String>,
    pub run: Run,
}

impl Checkpoint {
    /// The canonical encoding, and its blake3 hash recorded in the `checkpoint_taken` event.
    pub fn encode(&self) -> (String, String) {
        // Plain data: serialisation cannot fail.
        let json = serde_json::to_string(self).unwrap_or_default();
        let hash = blake3::hash(json.as_bytes()).to_hex().to_string();
        (json, hash)
    }

    pub fn snapshot_ref(run_id: &str, n: u32) -> String {
        format!("refs/keel/{run_id}/{n}")
    }
}
