//! The invariant checker as the tests use it: reads one run from a keel store after a scenario
//! and checks its hash chain (keel-store), every invariant of its log (keel-core's
//! [`keel_core::invariant`]), that the stored projection agrees with the fold of the log, and
//! that the `steps` and `budgets` tables agree with the stored projection.

use std::collections::BTreeMap;
use std::path::Path;

use keel_core::invariant::{self, Audit, Outcome};
use keel_store::Store;

/// Checks the run `run` of the store at `db` (the `keel.db` file). The error lists every
/// problem found, one per line, so a failing test shows them all.
pub fn check(db: &Path, run: &str) -> Result<Audit, String> {
    let store = Store::open(db).map_err(|e| format!("{}: {e}", db.display()))?;
    let stored = store
        .events_from(run, 1)
        .map_err(|e| format!("run {run}: {e}"))?;
    keel_store::verify_chain(None, &stored).map_err(|e| format!("run {run}: hash chain: {e}"))?;
    let (head_seq, head_hash) = store.log_head(run).map_err(|e| format!("run {run}: {e}"))?;
    let last = stored.last().map(|e| (e.seq, e.hash.clone()));
    if last != Some((head_seq, head_hash.clone())) {
        return Err(format!(
            "run {run}: the runs table says the log ends at {head_seq} {head_hash}, the log ends at {last:?}"
        ));
    }
    let events = stored
        .iter()
        .map(|e| e.decode().map_err(|e| format!("run {run}: {e}")))
        .collect::<Result<Vec<_>, _>>()?;
    let audit = invariant::check(&events).map_err(|v| {
        let lines: Vec<String> = v.iter().map(|v| format!("  {v}")).collect();
        format!(
            "run {run}: {} invariant(s) broken:\n{}",
            v.len(),
            lines.join("\n")
        )
    })?;
    let projection = store.run(run).map_err(|e| format!("run {run}: {e}"))?;
    let folded = &audit.run;
    let differs = [
        ("state", projection.state != folded.state),
        ("seq", projection.seq != folded.seq),
        ("used", projection.used != folded.used),
        ("limits", projection.limits != folded.limits),
        ("phases", projection.phases != folded.phases),
        ("evidence", projection.evidence != folded.evidence),
    ];
    let differs: Vec<&str> = differs.iter().filter(|d| d.1).map(|d| d.0).collect();
    if !differs.is_empty() {
        return Err(format!(
            "run {run}: the stored projection differs from the fold of the log in {differs:?}"
        ));
    }
    let tables = store
        .projection_table_problems(run)
        .map_err(|e| format!("run {run}: {e}"))?;
    if !tables.is_empty() {
        return Err(format!(
            "run {run}: the steps and budgets tables differ from the stored projection:\n  {}",
            tables.join("\n  ")
        ));
    }
    Ok(audit)
}

/// [`check`], and with the applications an outside service counted per idempotency key: each
/// effect of the tools in `tools` (the ones that reach that service) applied at most once,
/// exactly once when recorded `done`, and no key the run never intended.
pub fn check_effects(
    db: &Path,
    run: &str,
    tools: &[&str],
    applied: &BTreeMap<String, u64>,
) -> Result<Audit, String> {
    let audit = check(db, run)?;
    let seen: Vec<_> = audit
        .effects
        .iter()
        .filter(|e| tools.contains(&e.tool.as_str()))
        .cloned()
        .collect();
    let v = invariant::check_applied(&seen, applied);
    if v.is_empty() {
        Ok(audit)
    } else {
        let lines: Vec<String> = v.iter().map(|v| format!("  {v}")).collect();
        Err(format!("run {run}: effects:\n{}", lines.join("\n")))
    }
}

/// The run's [`Outcome`] after [`check`], for comparison with a reference run.
pub fn outcome(db: &Path, run: &str) -> Result<Outcome, String> {
    check(db, run).map(|a| Outcome::of(&a))
}
