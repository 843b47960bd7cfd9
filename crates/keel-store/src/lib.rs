//! keel-store: the durable store.
//!
//! One SQLite file (WAL, `synchronous = FULL`: every commit is fsynced) holds each run's
//! hash-chained event log and the projections that follow from it (runs, steps, budgets,
//! evidence, checkpoints). Every commit appends events and updates the projections in one
//! transaction and checks the writer's fencing token, so the state read at resume never
//! disagrees with the log and a process that lost its lease cannot write.
//!
//! Large payloads live in the content-addressed [`Artifacts`] store beside the database.

mod artifacts;
mod fault;
mod group;
mod schema;
mod verify;

use std::path::{Path, PathBuf};

use keel_core::checkpoint::Checkpoint;
use keel_core::event::{EVENT_VERSION, Envelope, Event, EventBody, GENESIS_HASH};
use keel_core::run::Run;
use rusqlite::{Connection, OptionalExtension, TransactionBehavior, params};

pub use artifacts::Artifacts;
pub use group::{GroupCommitter, GroupError, GroupHandle, GroupOptions, GroupStats, Pending};
pub use verify::{ChainProblem, verify_chain};

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("store {path}: {source}")]
    Sqlite {
        path: PathBuf,
        #[source]
        source: rusqlite::Error,
    },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("no run `{0}` in this store (see `keel status` for the runs it has)")]
    NoSuchRun(String),
    #[error("`{prefix}` matches several runs ({}); give more of the id", matches.join(", "))]
    AmbiguousRun {
        prefix: String,
        matches: Vec<String>,
    },
    #[error(
        "run {run} is held by {holder} until {until_ms} (ms since epoch); wait for it to finish or stop that process"
    )]
    LeaseHeld {
        run: String,
        holder: String,
        until_ms: i64,
    },
    #[error(
        "run {run} was taken over by another process (lease {actual}, ours {ours}); this process stops writing"
    )]
    LeaseLost { run: String, ours: u64, actual: u64 },
    #[error(
        "run {run}: expected to append at sequence number {expected}, but the log is at {actual}"
    )]
    Conflict {
        run: String,
        expected: u64,
        actual: u64,
    },
    #[error("run {run}, event {seq}: {message}")]
    Decode {
        run: String,
        seq: u64,
        message: String,
    },
    #[error(
        "run {run}: its stored projection does not decode ({message}); `keel resume {run}` rebuilds it from the event log"
    )]
    Projection { run: String, message: String },
    #[error(
        "store {path} was written by a newer keel (schema {found}, this keel knows up to {known}); upgrade keel"
    )]
    NewerSchema {
        path: PathBuf,
        found: i64,
        known: i64,
    },
}

impl StoreError {
    pub(crate) fn io(path: &Path, source: std::io::Error) -> StoreError {
        StoreError::Io {
            path: path.to_path_buf(),
            source,
        }
    }
}

/// An event as stored: the envelope, the exact body text the hash covers, and the chain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredEvent {
    pub run_id: String,
    pub seq: u64,
    pub at_ms: i64,
    pub version: u32,
    pub kind: String,
    pub body: String,
    pub prev_hash: String,
    pub hash: String,
}

impl StoredEvent {
    pub fn computed_hash(&self) -> String {
        Envelope {
            prev_hash: &self.prev_hash,
            run_id: &self.run_id,
            seq: self.seq,
            at_ms: self.at_ms,
            version: self.version,
            kind: &self.kind,
            body: &self.body,
        }
        .hash()
    }

    pub fn decode(&self) -> Result<Event, StoreError> {
        let body = EventBody::decode(self.version, &self.body).map_err(|e| StoreError::Decode {
            run: self.run_id.clone(),
            seq: self.seq,
            message: e.to_string(),
        })?;
        Ok(Event {
            run_id: self.run_id.clone(),
            seq: self.seq,
            at_ms: self.at_ms,
            body,
        })
    }
}

/// The right to write a run: whoever holds the newest token. Every commit checks it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    pub run_id: String,
    pub token: u64,
    pub holder: String,
}

/// Who holds a run now, as the runs table says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseInfo {
    pub holder: Option<String>,
    pub token: u64,
    pub until_ms: i64,
}

/// A stored checkpoint: its body (JSON of [`Checkpoint`]) and the hash its event recorded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointRow {
    pub n: u32,
    pub seq: u64,
    pub at_ms: i64,
    pub hash: String,
    pub snapshot_ref: String,
    pub commit: String,
    pub body: String,
}

impl CheckpointRow {
    pub fn decode(&self, run: &str) -> Result<Checkpoint, StoreError> {
        serde_json::from_str(&self.body).map_err(|e| StoreError::Decode {
            run: run.to_string(),
            seq: self.seq,
            message: format!("checkpoint {}: {e}", self.n),
        })
    }
}

pub struct Store {
    conn: Connection,
    path: PathBuf,
    artifacts: Artifacts,
}

impl Store {
    /// Opens (creating if needed) the store at `path`; artifacts go to `artifacts/` beside it.
    pub fn open(path: &Path) -> Result<Store, StoreError> {
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).map_err(|e| StoreError::io(parent, e))?;
        }
        let sql = |source| StoreError::Sqlite {
            path: path.to_path_buf(),
            source,
        };
        let conn = Connection::open(path).map_err(sql)?;
        conn.busy_timeout(std::time::Duration::from_secs(10))
            .map_err(sql)?;
        conn.pragma_update(None, "journal_mode", "WAL")
            .map_err(sql)?;
        conn.pragma_update(None, "synchronous", "FULL")
            .map_err(sql)?;
        schema::migrate(&conn, path)?;
        let dir = path.parent().unwrap_or(Path::new(".")).join("artifacts");
        Ok(Store {
            conn,
            path: path.to_path_buf(),
            artifacts: Artifacts::new(dir),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn artifacts(&self) -> &Artifacts {
        &self.artifacts
    }

    /// Every artifact stored from now on is scrubbed of these secrets.
    pub fn set_scrubber(&mut self, scrubber: std::sync::Arc<keel_core::secret::Scrubber>) {
        self.artifacts.set_scrubber(scrubber);
    }

    fn sql(&self, source: rusqlite::Error) -> StoreError {
        StoreError::Sqlite {
            path: self.path.clone(),
            source,
        }
    }

    pub fn put_contract(&self, hash: &str, file: &str, source: &str) -> Result<(), StoreError> {
        self.conn
            .execute(
                "INSERT OR IGNORE INTO contracts (hash, file, source) VALUES (?1, ?2, ?3)",
                params![hash, file, source],
            )
            .map_err(|e| self.sql(e))?;
        Ok(())
    }

    /// The exact text of a contract by its hash.
    pub fn contract(&self, hash: &str) -> Result<Option<(String, String)>, StoreError> {
        self.conn
            .query_row(
                "SELECT file, source FROM contracts WHERE hash = ?1",
                [hash],
                |r| Ok((text(r, 0)?, text(r, 1)?)),
            )
            .optional()
            .map_err(|e| self.sql(e))
    }

    /// Inserts a new run with its `run_created` event and takes its lease.
    pub fn create_run(
        &mut self,
        created: &Event,
        run: &Run,
        holder: &str,
        now_ms: i64,
        ttl_ms: i64,
    ) -> Result<Lease, StoreError> {
        let path = self.path.clone();
        let sql = |source| StoreError::Sqlite {
            path: path.clone(),
            source,
        };
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(sql)?;
        tx.execute(
            "INSERT INTO runs (id, contract_hash, state, reason, created_at, updated_at, last_seq, \
             last_hash, lease_holder, lease_token, lease_until, projection) \
             VALUES (?1, ?2, 'planned', '', ?3, ?3, 0, ?4, ?5, 1, ?6, '{}')",
            params![
                run.id,
                run.contract_hash,
                created.at_ms,
                GENESIS_HASH,
                holder,
                now_ms + ttl_ms
            ],
        )
        .map_err(sql)?;
        let lease = Lease {
            run_id: run.id.clone(),
            token: 1,
            holder: holder.to_string(),
        };
        write_events(
            &tx,
            &lease,
            std::slice::from_ref(created),
            run,
            None,
            now_ms + ttl_ms,
        )
        .map_err(|e| e.into_store(&path))?;
        finish(tx).map_err(sql)?;
        Ok(lease)
    }

    /// Takes the lease of a run: when nobody holds it, when it has expired, when `is_stale`
    /// says its holder is gone (a process on this machine that no longer exists), or when
    /// `force` is set (cancel). The token goes up, so the previous holder's writes fail.
    pub fn acquire(
        &mut self,
        run_id: &str,
        holder: &str,
        now_ms: i64,
        ttl_ms: i64,
        force: bool,
        is_stale: &dyn Fn(&str) -> bool,
    ) -> Result<Lease, StoreError> {
        let path = self.path.clone();
        let sql = |source| StoreError::Sqlite {
            path: path.clone(),
            source,
        };
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(sql)?;
        let row: Option<(Option<String>, u64, i64)> = tx
            .query_row(
                "SELECT lease_holder, lease_token, lease_until FROM runs WHERE id = ?1",
                [run_id],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
            )
            .optional()
            .map_err(sql)?;
        let Some((current, token, until)) = row else {
            return Err(StoreError::NoSuchRun(run_id.to_string()));
        };
        if let Some(current) = current {
            let free = force || until < now_ms || current == holder || is_stale(&current);
            if !free {
                return Err(StoreError::LeaseHeld {
                    run: run_id.to_string(),
                    holder: current,
                    until_ms: until,
                });
            }
        }
        let token = token + 1;
        tx.execute(
            "UPDATE runs SET lease_holder = ?2, lease_token = ?3, lease_until = ?4 WHERE id = ?1",
            params![run_id, holder, token, now_ms + ttl_ms],
        )
        .map_err(sql)?;
        tx.commit().map_err(sql)?;
        Ok(Lease {
            run_id: run_id.to_string(),
            token,
            holder: holder.to_string(),
        })
    }

    /// Gives the lease back (only if it is still ours).
    pub fn release(&self, lease: &Lease) -> Result<(), StoreError> {
        self.conn
            .execute(
                "UPDATE runs SET lease_holder = NULL, lease_until = 0 WHERE id = ?1 AND lease_token = ?2",
                params![lease.run_id, lease.token],
            )
            .map_err(|e| self.sql(e))?;
        Ok(())
    }

    /// Extends a lease that is still ours (a heartbeat during a long step). Returns whether it
    /// still was.
    pub fn renew(&self, run_id: &str, holder: &str, until_ms: i64) -> Result<bool, StoreError> {
        let n = self
            .conn
            .execute(
                "UPDATE runs SET lease_until = ?3 WHERE id = ?1 AND lease_holder = ?2",
                params![run_id, holder, until_ms],
            )
            .map_err(|e| self.sql(e))?;
        Ok(n == 1)
    }

    pub fn lease_info(&self, run_id: &str) -> Result<LeaseInfo, StoreError> {
        self.conn
            .query_row(
                "SELECT lease_holder, lease_token, lease_until FROM runs WHERE id = ?1",
                [run_id],
                |r| {
                    Ok(LeaseInfo {
                        holder: r.get(0)?,
                        token: r.get(1)?,
                        until_ms: r.get(2)?,
                    })
                },
            )
            .optional()
            .map_err(|e| self.sql(e))?
            .ok_or_else(|| StoreError::NoSuchRun(run_id.to_string()))
    }

    /// Appends `events` (already applied to `run`, which is the projection after them) and
    /// updates every projection, in one fsynced transaction, if the lease is still ours and the
    /// log is where the caller thinks it is. A checkpoint row is written in the same transaction.
    pub fn commit(
        &mut self,
        lease: &Lease,
        events: &[Event],
        run: &Run,
        checkpoint: Option<&Checkpoint>,
        lease_until_ms: i64,
    ) -> Result<(), StoreError> {
        let path = self.path.clone();
        let sql = |source| StoreError::Sqlite {
            path: path.clone(),
            source,
        };
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(sql)?;
        write_events(&tx, lease, events, run, checkpoint, lease_until_ms)
            .map_err(|e| e.into_store(&path))?;
        finish(tx).map_err(sql)
    }

    /// Cuts a torn tail: removes the events from `from_seq` on (and the checkpoints and evidence
    /// that came with them), then appends `events` (the `tail_cut` record) onto the remaining
    /// chain and stores `run`, the projection rebuilt without the removed events.
    pub fn cut_tail(
        &mut self,
        lease: &Lease,
        from_seq: u64,
        events: &[Event],
        run: &Run,
        lease_until_ms: i64,
    ) -> Result<(), StoreError> {
        let path = self.path.clone();
        let sql = |source| StoreError::Sqlite {
            path: path.clone(),
            source,
        };
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(sql)?;
        let id = &lease.run_id;
        tx.execute(
            "DELETE FROM events WHERE run_id = ?1 AND seq >= ?2",
            params![id, from_seq],
        )
        .map_err(sql)?;
        tx.execute(
            "DELETE FROM checkpoints WHERE run_id = ?1 AND seq >= ?2 - 1",
            params![id, from_seq],
        )
        .map_err(sql)?;
        tx.execute(
            "DELETE FROM evidence WHERE run_id = ?1 AND n > ?2",
            params![id, run.evidence_count],
        )
        .map_err(sql)?;
        let (last_seq, last_hash): (u64, String) = tx
            .query_row(
                "SELECT seq, hash FROM events WHERE run_id = ?1 ORDER BY seq DESC LIMIT 1",
                [id],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .map_err(sql)?;
        tx.execute(
            "UPDATE runs SET last_seq = ?2, last_hash = ?3 WHERE id = ?1",
            params![id, last_seq, last_hash],
        )
        .map_err(sql)?;
        write_events(&tx, lease, events, run, None, lease_until_ms)
            .map_err(|e| e.into_store(&path))?;
        finish(tx).map_err(sql)
    }

    /// Resolves a run id or a unique prefix of one.
    pub fn resolve_run(&self, id_or_prefix: &str) -> Result<String, StoreError> {
        if id_or_prefix.trim().is_empty() {
            return Err(StoreError::NoSuchRun(id_or_prefix.to_string()));
        }
        let escaped = id_or_prefix
            .replace('\\', "\\\\")
            .replace('%', "\\%")
            .replace('_', "\\_");
        let pattern = format!("{escaped}%");
        let mut stmt = self
            .conn
            .prepare("SELECT id FROM runs WHERE id LIKE ?1 ESCAPE '\\' ORDER BY id LIMIT 6")
            .map_err(|e| self.sql(e))?;
        let ids: Vec<String> = stmt
            .query_map([pattern], |r| r.get(0))
            .map_err(|e| self.sql(e))?
            .collect::<Result<_, _>>()
            .map_err(|e| self.sql(e))?;
        if ids.iter().any(|i| i == id_or_prefix) {
            return Ok(id_or_prefix.to_string());
        }
        match ids.len() {
            0 => Err(StoreError::NoSuchRun(id_or_prefix.to_string())),
            1 => Ok(ids.into_iter().next().unwrap_or_default()),
            _ => Err(StoreError::AmbiguousRun {
                prefix: id_or_prefix.to_string(),
                matches: ids,
            }),
        }
    }

    /// The run projection as last committed.
    pub fn run(&self, id: &str) -> Result<Run, StoreError> {
        let json: String = self
            .conn
            .query_row("SELECT projection FROM runs WHERE id = ?1", [id], |r| {
                text(r, 0)
            })
            .optional()
            .map_err(|e| self.sql(e))?
            .ok_or_else(|| StoreError::NoSuchRun(id.to_string()))?;
        serde_json::from_str(&json).map_err(|e| StoreError::Projection {
            run: id.to_string(),
            message: e.to_string(),
        })
    }

    /// Every run's projection, newest first.
    pub fn runs(&self) -> Result<Vec<Run>, StoreError> {
        let mut stmt = self
            .conn
            .prepare("SELECT id FROM runs ORDER BY created_at DESC, id DESC")
            .map_err(|e| self.sql(e))?;
        let ids: Vec<String> = stmt
            .query_map([], |r| r.get(0))
            .map_err(|e| self.sql(e))?
            .collect::<Result<_, _>>()
            .map_err(|e| self.sql(e))?;
        ids.iter().map(|id| self.run(id)).collect()
    }

    /// Where the runs table says the log ends: (last sequence number, its hash).
    pub fn log_head(&self, id: &str) -> Result<(u64, String), StoreError> {
        self.conn
            .query_row(
                "SELECT last_seq, last_hash FROM runs WHERE id = ?1",
                [id],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .optional()
            .map_err(|e| self.sql(e))?
            .ok_or_else(|| StoreError::NoSuchRun(id.to_string()))
    }

    /// Events with `seq >= from_seq`, in order.
    pub fn events_from(&self, id: &str, from_seq: u64) -> Result<Vec<StoredEvent>, StoreError> {
        let mut out = Vec::new();
        self.for_each_event(id, from_seq, |e| {
            out.push(e);
            Ok(())
        })?;
        Ok(out)
    }

    /// One event, if it exists.
    pub fn event(&self, id: &str, seq: u64) -> Result<Option<StoredEvent>, StoreError> {
        self.conn
            .query_row(
                "SELECT seq, at, v, kind, body, prev_hash, hash FROM events \
                 WHERE run_id = ?1 AND seq = ?2",
                params![id, seq],
                |r| {
                    Ok(StoredEvent {
                        run_id: id.to_string(),
                        seq: r.get(0)?,
                        at_ms: r.get(1)?,
                        version: r.get(2)?,
                        kind: text(r, 3)?,
                        body: text(r, 4)?,
                        prev_hash: text(r, 5)?,
                        hash: text(r, 6)?,
                    })
                },
            )
            .optional()
            .map_err(|e| self.sql(e))
    }

    /// Streams events with `seq >= from_seq` in order, without holding them all in memory.
    pub fn for_each_event(
        &self,
        id: &str,
        from_seq: u64,
        mut f: impl FnMut(StoredEvent) -> Result<(), StoreError>,
    ) -> Result<(), StoreError> {
        let mut stmt = self
            .conn
            .prepare(
                "SELECT seq, at, v, kind, body, prev_hash, hash FROM events \
                 WHERE run_id = ?1 AND seq >= ?2 ORDER BY seq",
            )
            .map_err(|e| self.sql(e))?;
        let mut rows = stmt.query(params![id, from_seq]).map_err(|e| self.sql(e))?;
        while let Some(r) = rows.next().map_err(|e| self.sql(e))? {
            let event = (|| {
                Ok::<_, rusqlite::Error>(StoredEvent {
                    run_id: id.to_string(),
                    seq: r.get(0)?,
                    at_ms: r.get(1)?,
                    version: r.get(2)?,
                    kind: text(r, 3)?,
                    body: text(r, 4)?,
                    prev_hash: text(r, 5)?,
                    hash: text(r, 6)?,
                })
            })()
            .map_err(|e| self.sql(e))?;
            f(event)?;
        }
        Ok(())
    }

    /// Every checkpoint row of a run, oldest first.
    pub fn checkpoints(&self, id: &str) -> Result<Vec<CheckpointRow>, StoreError> {
        let mut stmt = self
            .conn
            .prepare(
                "SELECT n, seq, at, hash, snapshot_ref, commit_id, body FROM checkpoints \
                 WHERE run_id = ?1 ORDER BY n",
            )
            .map_err(|e| self.sql(e))?;
        let rows = stmt
            .query_map([id], |r| {
                Ok(CheckpointRow {
                    n: r.get(0)?,
                    seq: r.get(1)?,
                    at_ms: r.get(2)?,
                    hash: text(r, 3)?,
                    snapshot_ref: text(r, 4)?,
                    commit: text(r, 5)?,
                    body: text(r, 6)?,
                })
            })
            .map_err(|e| self.sql(e))?;
        rows.collect::<Result<_, _>>().map_err(|e| self.sql(e))
    }

    /// The newest checkpoint row, read without touching older ones.
    pub fn newest_checkpoint(&self, id: &str) -> Result<Option<CheckpointRow>, StoreError> {
        self.conn
            .query_row(
                "SELECT n, seq, at, hash, snapshot_ref, commit_id, body FROM checkpoints \
                 WHERE run_id = ?1 ORDER BY n DESC LIMIT 1",
                [id],
                |r| {
                    Ok(CheckpointRow {
                        n: r.get(0)?,
                        seq: r.get(1)?,
                        at_ms: r.get(2)?,
                        hash: text(r, 3)?,
                        snapshot_ref: text(r, 4)?,
                        commit: text(r, 5)?,
                        body: text(r, 6)?,
                    })
                },
            )
            .optional()
            .map_err(|e| self.sql(e))
    }

    /// Rewrites the projection of a run from `run`, folded from the log, after it was found to
    /// disagree with the log. The log's end becomes the projection's end.
    pub fn replace_projection(&mut self, lease: &Lease, run: &Run) -> Result<(), StoreError> {
        let path = self.path.clone();
        let sql = |source| StoreError::Sqlite {
            path: path.clone(),
            source,
        };
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(sql)?;
        let (last_seq, last_hash): (u64, String) = tx
            .query_row(
                "SELECT seq, hash FROM events WHERE run_id = ?1 ORDER BY seq DESC LIMIT 1",
                [&lease.run_id],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .map_err(sql)?;
        tx.execute(
            "UPDATE runs SET last_seq = ?2, last_hash = ?3 WHERE id = ?1",
            params![lease.run_id, last_seq, last_hash],
        )
        .map_err(sql)?;
        write_events(&tx, lease, &[], run, None, 0).map_err(|e| e.into_store(&path))?;
        finish(tx).map_err(sql)
    }
}

/// A text column as stored. A damaged byte can leave it invalid UTF-8; it is read with the damage
/// replaced (U+FFFD), so that the hash chain, which covers the exact text, reports the event as
/// altered (and a contract's hash, or a projection's decoding, its damage) instead of every read
/// of the run failing with a conversion error.
fn text(r: &rusqlite::Row<'_>, i: usize) -> rusqlite::Result<String> {
    let value = r.get_ref(i)?;
    value
        .as_bytes()
        .map(|b| String::from_utf8_lossy(b).into_owned())
        .map_err(|e| rusqlite::Error::FromSqlConversionFailure(i, value.data_type(), Box::new(e)))
}

/// Commits a transaction that appends events or rewrites a projection. This is where
/// `KEEL_STORE_FAULT` makes a commit fail, or succeed and report a failure (see `fault.rs`).
fn finish(tx: rusqlite::Transaction<'_>) -> Result<(), rusqlite::Error> {
    match fault::next_commit() {
        None => tx.commit(),
        Some((fault::CommitFault::Error, n)) => {
            tx.rollback()?;
            Err(fault::commit_error(fault::CommitFault::Error, n))
        }
        Some((fault::CommitFault::LostAck, n)) => {
            tx.commit()?;
            Err(fault::commit_error(fault::CommitFault::LostAck, n))
        }
    }
}

/// Errors inside a transaction, turned into [`StoreError`] with the store's path afterwards.
enum TxError {
    Sql(rusqlite::Error),
    Store(StoreError),
}

impl From<rusqlite::Error> for TxError {
    fn from(e: rusqlite::Error) -> Self {
        TxError::Sql(e)
    }
}

impl TxError {
    fn into_store(self, path: &Path) -> StoreError {
        match self {
            TxError::Sql(source) => StoreError::Sqlite {
                path: path.to_path_buf(),
                source,
            },
            TxError::Store(e) => e,
        }
    }
}

fn write_events(
    tx: &rusqlite::Transaction<'_>,
    lease: &Lease,
    events: &[Event],
    run: &Run,
    checkpoint: Option<&Checkpoint>,
    lease_until_ms: i64,
) -> Result<(), TxError> {
    let id = &lease.run_id;
    let (token, mut last_seq, mut last_hash): (u64, u64, String) = tx.query_row(
        "SELECT lease_token, last_seq, last_hash FROM runs WHERE id = ?1",
        [id],
        |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
    )?;
    if token != lease.token {
        return Err(TxError::Store(StoreError::LeaseLost {
            run: id.clone(),
            ours: lease.token,
            actual: token,
        }));
    }
    {
        let mut insert = tx.prepare_cached(
            "INSERT INTO events (run_id, seq, at, v, kind, body, prev_hash, hash) \
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
        )?;
        for event in events {
            if event.seq != last_seq + 1 {
                return Err(TxError::Store(StoreError::Conflict {
                    run: id.clone(),
                    expected: event.seq,
                    actual: last_seq,
                }));
            }
            let body = event.body.encode();
            let hash = Envelope {
                prev_hash: &last_hash,
                run_id: id,
                seq: event.seq,
                at_ms: event.at_ms,
                version: EVENT_VERSION,
                kind: event.body.kind(),
                body: &body,
            }
            .hash();
            insert.execute(params![
                id,
                event.seq,
                event.at_ms,
                EVENT_VERSION,
                event.body.kind(),
                body,
                last_hash,
                hash
            ])?;
            if let EventBody::EvidenceRecorded { evidence } = &event.body {
                tx.execute(
                    "INSERT OR REPLACE INTO evidence (run_id, n, seq, verifier, tier, passed, status, \
                     output, tree, body) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10)",
                    params![
                        id,
                        evidence.n,
                        event.seq,
                        evidence.verifier,
                        evidence.tier.to_string(),
                        evidence.passed,
                        evidence.status,
                        evidence.output,
                        evidence.tree,
                        serde_json::to_string(evidence).unwrap_or_default()
                    ],
                )?;
            }
            if let (
                EventBody::CheckpointTaken {
                    n,
                    hash: ck_hash,
                    snapshot_ref,
                    commit,
                },
                Some(ck),
            ) = (&event.body, checkpoint)
            {
                let (json, computed) = ck.encode();
                if computed != *ck_hash || ck.n != *n {
                    return Err(TxError::Store(StoreError::Decode {
                        run: id.clone(),
                        seq: event.seq,
                        message: "checkpoint body does not match its checkpoint_taken event".into(),
                    }));
                }
                tx.execute(
                    "INSERT OR REPLACE INTO checkpoints (run_id, n, seq, at, hash, snapshot_ref, \
                     commit_id, body) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
                    params![id, n, ck.seq, ck.at_ms, ck_hash, snapshot_ref, commit, json],
                )?;
            }
            last_seq = event.seq;
            last_hash = hash;
        }
    }
    if run.seq != last_seq {
        return Err(TxError::Store(StoreError::Conflict {
            run: id.clone(),
            expected: run.seq,
            actual: last_seq,
        }));
    }
    let projection = serde_json::to_string(run).unwrap_or_default();
    let phase = run.phases.get(run.cursor as usize).map(|p| p.name.clone());
    let until: Option<i64> = (lease_until_ms > 0).then_some(lease_until_ms);
    tx.execute(
        "UPDATE runs SET state = ?2, reason = ?3, phase = ?4, updated_at = ?5, last_seq = ?6, \
         last_hash = ?7, projection = ?8, lease_until = COALESCE(?9, lease_until) WHERE id = ?1",
        params![
            id,
            run.state.as_str(),
            run.reason,
            phase,
            run.updated_at_ms,
            last_seq,
            last_hash,
            projection,
            until
        ],
    )?;
    {
        let mut step = tx.prepare_cached(
            "INSERT OR REPLACE INTO steps (run_id, phase, idx, command, state, attempts) \
             VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
        )?;
        for (p, phase) in run.phases.iter().enumerate() {
            for (i, s) in phase.steps.iter().enumerate() {
                step.execute(params![id, p, i, s.command, s.state.as_str(), s.attempts])?;
            }
        }
        let mut budget = tx.prepare_cached(
            "INSERT OR REPLACE INTO budgets (run_id, name, used, lim) VALUES (?1, ?2, ?3, ?4)",
        )?;
        for name in keel_core::budget::BudgetName::ALL {
            budget.execute(params![
                id,
                name.as_str(),
                run.used(name),
                run.limits.get(name)
            ])?;
        }
    }
    Ok(())
}
