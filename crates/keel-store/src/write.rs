//! A commit, made ready before the write lock is taken ([`prepare`]: each event encoded and
//! hashed onto the log's end, the log row compressed, the projection and the changed rows
//! worked out), and written with it held ([`apply`]: the checks of the lease and the log's end,
//! then the statements). Threads that commit at the same moment prepare theirs at the same
//! time; the lock is held only for the statements (see `batch`).

use keel_core::checkpoint::Checkpoint;
use keel_core::event::{EVENT_VERSION, Envelope, Event, EventBody, GENESIS_HASH};
use keel_core::run::Run;
use rusqlite::{Connection, OptionalExtension, params};

use crate::batch::{ContractText, Extra};
use crate::{Lease, StoreError, StoredEvent, TxError, log};

/// Events a projection may trail its log by, beyond one per two steps it holds.
const PROJECTION_TAIL: u64 = 64;

/// An agent phase's newest steps, whose rows may wait for the projection's next full write: at
/// most half of what the projection keeps ([`keel_core::run::KEPT_AGENT_STEPS`]), so a step
/// cannot be let go with its row unwritten unless a single commit adds that many steps.
const FRESH_AGENT_STEPS: u32 = keel_core::run::KEPT_AGENT_STEPS as u32 / 2;

/// The queryable rows of a run's projection as last written, and the log's end: step (phase,
/// index) to (state, attempts), budget name to (used, limit).
#[derive(Debug, Default, Clone)]
pub(crate) struct Rows {
    pub steps: std::collections::HashMap<(usize, usize), (String, u32)>,
    pub budgets: std::collections::HashMap<String, (u64, Option<u64>)>,
    pub head: Head,
    /// The lease they were written under: under another, they are read again.
    pub token: u64,
}

/// Where a run's log ends, with the state and projection stored with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Head {
    pub seq: u64,
    pub hash: String,
    pub state: String,
    pub projection_seq: u64,
}

impl Default for Head {
    fn default() -> Head {
        Head {
            seq: 0,
            hash: GENESIS_HASH.to_string(),
            state: String::new(),
            projection_seq: 0,
        }
    }
}

/// What a write knows of the rows already stored for the run.
pub(crate) enum Written {
    /// Write every row and the whole projection (a new run, a rebuilt projection), after
    /// `Head` (a new run: the beginning).
    Rewrite(Head),
    /// Read the stored rows first, then write those that differ.
    Unknown,
    /// The rows as this connection last wrote them.
    Known(Rows),
}

/// A commit ready to be written: every statement's values.
pub(crate) struct Prepared {
    pub run_id: String,
    pub token: u64,
    /// The log's end its events follow (checked when it is written).
    pub after: (u64, String),
    pub row: Option<LogRow>,
    pub evidence: Vec<EvidenceRow>,
    pub checkpoint: Option<CheckpointRow>,
    pub runs: RunsRow,
    pub projection: Option<String>,
    pub steps: Vec<(usize, usize, String, String, u32)>,
    pub budgets: Vec<(&'static str, u64, Option<u64>)>,
    pub contracts: Vec<ContractText>,
    pub extra: Extra,
    pub contract_hash: String,
    pub created_at: i64,
    /// What the connection knows of the stored rows once this is written.
    pub rows: Rows,
}

/// The `log` row of a commit.
pub(crate) struct LogRow {
    pub first_seq: u64,
    pub last_seq: u64,
    pub codec: i64,
    pub events: Vec<u8>,
    pub blob_hashes: Option<Vec<u8>>,
    pub blobs: Option<Vec<u8>>,
}

pub(crate) struct EvidenceRow {
    n: u32,
    seq: u64,
    verifier: String,
    tier: String,
    passed: bool,
    status: String,
    output: String,
    tree: String,
    body: String,
}

pub(crate) struct CheckpointRow {
    n: u32,
    seq: u64,
    at_ms: i64,
    hash: String,
    snapshot_ref: String,
    commit: String,
    body: String,
}

pub(crate) struct RunsRow {
    state: String,
    reason: String,
    phase: Option<String>,
    updated_at: i64,
    last_seq: u64,
    last_hash: String,
    lease_until: Option<i64>,
}

/// What a commit writes, given to [`prepare`].
pub(crate) struct Commit<'a> {
    pub lease: &'a Lease,
    pub events: &'a [Event],
    pub run: &'a Run,
    pub checkpoint: Option<&'a Checkpoint>,
    pub lease_until_ms: i64,
    pub blobs: &'a [log::InlineBlob],
    pub contracts: &'a [ContractText],
    pub extra: Extra,
}

/// Where run `id`'s log ends as its `runs` row says, read on `conn`.
pub(crate) fn head(conn: &Connection, id: &str) -> rusqlite::Result<Head> {
    let (seq, hash, state): (u64, String, String) = conn
        .prepare_cached("SELECT last_seq, last_hash, state FROM runs WHERE id = ?1")?
        .query_row([id], |r| {
            Ok((r.get(0)?, crate::text(r, 1)?, crate::text(r, 2)?))
        })?;
    let projection_seq: u64 = conn
        .prepare_cached("SELECT seq FROM projections WHERE run_id = ?1")?
        .query_row([id], |r| r.get(0))
        .optional()?
        .unwrap_or(0);
    Ok(Head {
        seq,
        hash,
        state,
        projection_seq,
    })
}

/// The log's end and the rows stored for run `id`, read on `conn`.
pub(crate) fn stored(conn: &Connection, id: &str, run: &Run) -> rusqlite::Result<Rows> {
    let mut rows = Rows {
        head: head(conn, id)?,
        ..Rows::default()
    };
    // The rows of the steps `run` holds (not those of settled steps its projection let go,
    // which no commit changes), and of its budgets.
    let mut steps = conn.prepare_cached(
        "SELECT phase, idx, state, attempts FROM steps WHERE run_id = ?1 AND phase = ?2 \
         AND idx >= ?3",
    )?;
    for (p, phase) in run.phases.iter().enumerate() {
        for row in steps.query_map(params![id, p, phase.earlier], |r| {
            Ok(((r.get(0)?, r.get(1)?), (r.get(2)?, r.get(3)?)))
        })? {
            let (key, value) = row?;
            rows.steps.insert(key, value);
        }
    }
    let mut budgets =
        conn.prepare_cached("SELECT name, used, lim FROM budgets WHERE run_id = ?1")?;
    for row in budgets.query_map([id], |r| Ok((r.get(0)?, (r.get(1)?, r.get(2)?))))? {
        let (name, value) = row?;
        rows.budgets.insert(name, value);
    }
    Ok(rows)
}

/// Encodes and hashes `c`'s events onto the log's end as `written` knows it (read on `conn`
/// when it knows nothing), and works out every row the commit changes.
pub(crate) fn prepare(
    conn: &Connection,
    c: &Commit<'_>,
    written: Written,
) -> Result<Prepared, TxError> {
    let id = &c.lease.run_id;
    let (mut rows, rewrite) = match written {
        Written::Known(rows) => (rows, false),
        Written::Unknown => (stored(conn, id, c.run)?, false),
        Written::Rewrite(head) => (
            Rows {
                head,
                ..Rows::default()
            },
            true,
        ),
    };
    let after = (rows.head.seq, rows.head.hash.clone());
    let (mut last_seq, mut last_hash) = after.clone();
    let mut stored = Vec::with_capacity(c.events.len());
    let mut evidence = Vec::new();
    let mut checkpoint = None;
    for event in c.events {
        if event.seq != last_seq + 1 {
            return Err(TxError::Store(StoreError::Conflict {
                run: id.clone(),
                expected: event.seq,
                actual: last_seq,
            }));
        }
        let body = event.body.encode();
        let kind = event.body.kind();
        let hash = Envelope {
            prev_hash: &last_hash,
            run_id: id,
            seq: event.seq,
            at_ms: event.at_ms,
            version: EVENT_VERSION,
            kind,
            body: &body,
        }
        .hash();
        match (&event.body, c.checkpoint) {
            (EventBody::EvidenceRecorded { evidence: e }, _) => evidence.push(EvidenceRow {
                n: e.n,
                seq: event.seq,
                verifier: e.verifier.clone(),
                tier: e.tier.to_string(),
                passed: e.passed,
                status: e.status.clone(),
                output: e.output.clone(),
                tree: e.tree.clone(),
                body: serde_json::to_string(e).unwrap_or_default(),
            }),
            (
                EventBody::CheckpointTaken {
                    n,
                    hash: ck_hash,
                    snapshot_ref,
                    commit,
                },
                Some(ck),
            ) => {
                let (json, computed) = ck.encode();
                if computed != *ck_hash || ck.n != *n {
                    return Err(TxError::Store(StoreError::Decode {
                        run: id.clone(),
                        seq: event.seq,
                        message: "checkpoint body does not match its checkpoint_taken event".into(),
                    }));
                }
                checkpoint = Some(CheckpointRow {
                    n: *n,
                    seq: ck.seq,
                    at_ms: ck.at_ms,
                    hash: ck_hash.clone(),
                    snapshot_ref: snapshot_ref.clone(),
                    commit: commit.clone(),
                    body: json,
                });
            }
            _ => {}
        }
        stored.push(StoredEvent {
            run_id: id.clone(),
            seq: event.seq,
            at_ms: event.at_ms,
            version: EVENT_VERSION,
            kind: kind.to_string(),
            body,
            prev_hash: std::mem::replace(&mut last_hash, hash.clone()),
            hash,
        });
        last_seq = event.seq;
    }
    if c.run.seq != last_seq {
        return Err(TxError::Store(StoreError::Conflict {
            run: id.clone(),
            expected: c.run.seq,
            actual: last_seq,
        }));
    }
    let row = match (stored.first(), stored.last()) {
        (Some(first), Some(last)) => {
            let (codec, events) = log::pack(log::encode_events(&stored));
            let (blobs, hashes) = if c.blobs.is_empty() {
                (None, None)
            } else {
                let (blobs, hashes) = log::encode_blobs(c.blobs);
                (Some(blobs), Some(hashes))
            };
            Some(LogRow {
                first_seq: first.seq,
                last_seq: last.seq,
                codec,
                events,
                blob_hashes: hashes,
                blobs,
            })
        }
        // Artifacts with no event to name them (a failed write's, kept waiting) are kept for
        // the next commit that has events.
        _ => None,
    };
    // The steps and budgets whose rows differ from those stored.
    let mut changed_steps = Vec::new();
    // A changed row of a step that the projection may let go before the next full write.
    let mut changed_old_step = false;
    for (p, phase) in c.run.phases.iter().enumerate() {
        for (i, s) in phase.held_steps() {
            let now = (s.state.as_str(), s.attempts);
            if rows
                .steps
                .get(&(p, i as usize))
                .map(|(st, a)| (st.as_str(), *a))
                != Some(now)
            {
                changed_steps.push((p, i as usize, s));
                changed_old_step |=
                    phase.agent && phase.step_count().saturating_sub(i) > FRESH_AGENT_STEPS;
            }
        }
    }
    let mut budget_rows = Vec::new();
    let mut limit_changed = false;
    for name in keel_core::budget::BudgetName::ALL {
        let now = (c.run.used(name), c.run.limits.get(name));
        let stored = rows.budgets.get(name.as_str());
        if stored != Some(&now) {
            limit_changed |= stored.map(|(_, lim)| *lim) != Some(now.1);
            budget_rows.push((name.as_str(), now.0, now.1));
        }
    }
    // The projection, and with it the `steps` and `budgets` rows (the projection tables all
    // describe the run as of `projections.seq`), is written whole when asked, with a
    // checkpoint, when the state or a budget's limit changes, when a step whose row changed
    // is no longer among the phase's newest (so that every step's row is written before the
    // projection lets the step go: see `PhaseProgress::earlier`), and once the events after it
    // are more than a bound that grows with the steps it holds (so a read folds a tail worth
    // about as much as the projection, and a commit does not rewrite the projection every
    // time); otherwise `Store::run` folds the events after its `seq`. The projection holds a
    // bounded number of an agent phase's steps, so the bound is bounded too.
    let steps: usize = c.run.phases.iter().map(|p| p.steps.len()).sum();
    let full = rewrite
        || checkpoint.is_some()
        || rows.head.state != c.run.state.as_str()
        || limit_changed
        || changed_old_step
        || last_seq.saturating_sub(rows.head.projection_seq) >= PROJECTION_TAIL + steps as u64 / 2;
    let projection = full.then(|| serde_json::to_string(c.run).unwrap_or_default());
    let mut step_rows = Vec::new();
    if full {
        for (p, i, s) in changed_steps {
            let state = s.state.as_str().to_string();
            rows.steps.insert((p, i), (state.clone(), s.attempts));
            step_rows.push((p, i, s.command.clone(), state, s.attempts));
        }
        for (name, used, lim) in &budget_rows {
            rows.budgets.insert(name.to_string(), (*used, *lim));
        }
    } else {
        budget_rows.clear();
    }
    // The rows of steps the projection let go are final: they are not remembered.
    if c.run.phases.iter().any(|p| p.earlier > 0) {
        rows.steps.retain(|(p, i), _| {
            c.run
                .phases
                .get(*p)
                .is_some_and(|phase| *i >= phase.earlier as usize)
        });
    }
    rows.token = c.lease.token;
    rows.head = Head {
        seq: last_seq,
        hash: last_hash.clone(),
        state: c.run.state.as_str().to_string(),
        projection_seq: if full {
            last_seq
        } else {
            rows.head.projection_seq
        },
    };
    Ok(Prepared {
        run_id: id.clone(),
        token: c.lease.token,
        after,
        row,
        evidence,
        checkpoint,
        runs: RunsRow {
            state: c.run.state.as_str().to_string(),
            reason: c.run.reason.clone(),
            phase: c
                .run
                .phases
                .get(c.run.cursor as usize)
                .map(|p| p.name.clone()),
            updated_at: c.run.updated_at_ms,
            last_seq,
            last_hash,
            lease_until: (c.lease_until_ms > 0).then_some(c.lease_until_ms),
        },
        projection,
        steps: step_rows,
        budgets: budget_rows,
        contracts: c.contracts.to_vec(),
        extra: c.extra.clone(),
        contract_hash: c.run.contract_hash.clone(),
        created_at: c.events.first().map_or(0, |e| e.at_ms),
        rows,
    })
}

/// Writes a prepared commit in the transaction `tx`, if the lease is still its writer's and the
/// log ends where it was prepared for.
pub(crate) fn apply(tx: &Connection, p: &Prepared) -> Result<(), TxError> {
    if !p.contracts.is_empty() {
        let mut insert = tx.prepare_cached(
            "INSERT OR IGNORE INTO contracts (hash, file, source) VALUES (?1, ?2, ?3)",
        )?;
        for c in &p.contracts {
            insert.execute(params![c.hash, c.file, c.source])?;
        }
    }
    if let Some(new) = &p.extra.create {
        tx.prepare_cached(
            "INSERT INTO runs (id, contract_hash, state, reason, created_at, updated_at, \
             last_seq, last_hash, lease_holder, lease_token, lease_until) \
             VALUES (?1, ?2, 'planned', '', ?3, ?3, ?4, ?5, ?6, ?7, ?8)",
        )?
        .execute(params![
            p.run_id,
            p.contract_hash,
            p.created_at,
            p.after.0,
            p.after.1,
            new.holder,
            p.token,
            new.lease_until_ms
        ])?;
    }
    let (token, last_seq, last_hash, last_log): (u64, u64, String, Option<i64>) = tx
        .prepare_cached(
            "SELECT lease_token, last_seq, last_hash, last_log FROM runs WHERE id = ?1",
        )?
        .query_row([&p.run_id], |r| {
            Ok((r.get(0)?, r.get(1)?, crate::text(r, 2)?, r.get(3)?))
        })?;
    if token != p.token {
        return Err(TxError::Store(StoreError::LeaseLost {
            run: p.run_id.clone(),
            ours: p.token,
            actual: token,
        }));
    }
    if last_seq != p.after.0 {
        return Err(TxError::Store(StoreError::Conflict {
            run: p.run_id.clone(),
            expected: p.after.0 + 1,
            actual: last_seq,
        }));
    }
    if last_hash != p.after.1 {
        return Err(TxError::Store(StoreError::HeadMoved {
            run: p.run_id.clone(),
            seq: last_seq,
        }));
    }
    // The new row, linked to the run's row before it (see `log`).
    let mut newest = last_log;
    if let Some(row) = &p.row {
        tx.prepare_cached(
            "INSERT INTO log (prev, run_id, first_seq, last_seq, codec, blob_hashes, events, \
             blobs) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
        )?
        .execute(params![
            last_log,
            p.run_id,
            row.first_seq,
            row.last_seq,
            row.codec,
            row.blob_hashes,
            row.events,
            row.blobs
        ])?;
        newest = Some(tx.last_insert_rowid());
    }
    for e in &p.evidence {
        tx.prepare_cached(
            "INSERT OR REPLACE INTO evidence (run_id, n, seq, verifier, tier, passed, status, \
             output, tree, body) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10)",
        )?
        .execute(params![
            p.run_id, e.n, e.seq, e.verifier, e.tier, e.passed, e.status, e.output, e.tree, e.body
        ])?;
    }
    if let Some(ck) = &p.checkpoint {
        tx.prepare_cached(
            "INSERT OR REPLACE INTO checkpoints (run_id, n, seq, at, hash, snapshot_ref, \
             commit_id, body) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
        )?
        .execute(params![
            p.run_id,
            ck.n,
            ck.seq,
            ck.at_ms,
            ck.hash,
            ck.snapshot_ref,
            ck.commit,
            ck.body
        ])?;
    }
    let r = &p.runs;
    tx.prepare_cached(
        "UPDATE runs SET state = ?2, reason = ?3, phase = ?4, updated_at = ?5, last_seq = ?6, \
         last_hash = ?7, lease_until = COALESCE(?8, lease_until), last_log = ?9 WHERE id = ?1",
    )?
    .execute(params![
        p.run_id,
        r.state,
        r.reason,
        r.phase,
        r.updated_at,
        r.last_seq,
        r.last_hash,
        r.lease_until,
        newest
    ])?;
    if let Some(projection) = &p.projection {
        tx.prepare_cached(
            "INSERT OR REPLACE INTO projections (run_id, seq, body) VALUES (?1, ?2, ?3)",
        )?
        .execute(params![p.run_id, r.last_seq, projection])?;
    }
    if !p.steps.is_empty() {
        let mut step = tx.prepare_cached(
            "INSERT OR REPLACE INTO steps (run_id, phase, idx, command, state, attempts) \
             VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
        )?;
        for (phase, idx, command, state, attempts) in &p.steps {
            step.execute(params![p.run_id, phase, idx, command, state, attempts])?;
        }
    }
    if !p.budgets.is_empty() {
        let mut budget = tx.prepare_cached(
            "INSERT OR REPLACE INTO budgets (run_id, name, used, lim) VALUES (?1, ?2, ?3, ?4)",
        )?;
        for (name, used, lim) in &p.budgets {
            budget.execute(params![p.run_id, name, used, lim])?;
        }
    }
    if p.extra.release {
        tx.prepare_cached(
            "UPDATE runs SET lease_holder = NULL, lease_until = 0 \
             WHERE id = ?1 AND lease_token = ?2",
        )?
        .execute(params![p.run_id, p.token])?;
    }
    Ok(())
}
