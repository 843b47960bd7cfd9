//! Commits of one process to one store file, written together: one transaction and one fsync
//! for whatever commits are waiting.
//!
//! Every connection a process has to a store file shares one [`Writers`]: the write lock (SQLite
//! takes one writer at a time anyway; queuing here rather than in SQLite's busy handler keeps a
//! thread from sleeping past the busy timeout) and the commits waiting for it. A thread that
//! commits while the lock is free writes at once, its own commit and any that are waiting. A
//! thread that finds the lock taken leaves its commit in the queue and waits for the lock; by
//! the time it has the lock, the thread before it has usually written its commit with its own
//! (each in a savepoint, one `COMMIT` for all), so it returns at once; if not, it writes what is
//! waiting. So with one writer nothing changes, and with many, the commits that queue during one
//! fsync share the next.
//!
//! Each commit gets its own result: one that fails its checks (a stale lease token, a log that
//! moved) is rolled back to its savepoint and refused alone, with the error a commit of its own
//! would have had; a failure of the transaction (it cannot begin, or its `COMMIT` or fsync
//! fails) is every commit's, and a batch of more than one reports it as
//! [`StoreError::SharedCommit`].

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};

use keel_core::checkpoint::Checkpoint;
use keel_core::event::Event;
use keel_core::run::Run;
use rusqlite::TransactionBehavior;

use crate::{Lease, StoreError, TxError, Written, write_blobs, write_events};

/// The write lock of one store file in this process, and the commits waiting for it.
#[derive(Default)]
pub(crate) struct Writers {
    pub(crate) lock: Mutex<()>,
    /// The connection shared commits are written on, opened by the first leader and taken
    /// only with `lock` held. One connection keeps its page cache: SQLite drops a connection's
    /// whole cache when it sees that another connection wrote, so leaders writing on their own
    /// connections by turns each read every page they touch again.
    conn: Mutex<Option<Shared>>,
    state: Mutex<State>,
    /// Signalled when a leader is done: its followers' outcomes are set, and another may lead.
    turn: Condvar,
    /// Transactions written through here, and the commits they held.
    transactions: AtomicU64,
    commits: AtomicU64,
    largest: AtomicU64,
}

#[derive(Default)]
struct State {
    /// Commits left for the next leader.
    queue: Vec<Arc<Slot>>,
    /// Whether a thread is leading: waiting for the lock, then writing what is queued with its
    /// own commit.
    leading: bool,
    /// Whether the leader is still waiting for the lock (its own commit waits with the queue).
    leader_waiting: bool,
}

/// The shared write connection and the busy timeout last set on it.
struct Shared {
    conn: rusqlite::Connection,
    busy: std::time::Duration,
}

/// A queued commit and its outcome.
struct Slot {
    queued: Mutex<Queued>,
    done: AtomicBool,
}

/// The transactions `Store::commit` wrote to one store file in this process: how many, the
/// commits they held, the most one held.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CommitStats {
    pub transactions: u64,
    pub commits: u64,
    pub largest: u64,
}

/// One commit: what `Store::commit` was given, and the blobs and contracts waiting for it.
pub(crate) struct Commit<'a> {
    pub lease: &'a Lease,
    pub events: &'a [Event],
    pub run: &'a Run,
    pub checkpoint: Option<&'a Checkpoint>,
    pub lease_until_ms: i64,
    pub blobs: &'a [(String, i64, Vec<u8>)],
    pub contracts: &'a [ContractText],
    pub extra: Extra,
}

/// A contract's exact text, stored under its hash.
#[derive(Debug, Clone)]
pub(crate) struct ContractText {
    pub hash: String,
    pub file: String,
    pub source: String,
}

/// What a commit does besides appending events.
#[derive(Debug, Clone, Default)]
pub(crate) struct Extra {
    /// The run is new: its row is inserted first, held by `holder`.
    pub create: Option<NewRun>,
    /// The lease is given back after the events (the drive ends).
    pub release: bool,
}

#[derive(Debug, Clone)]
pub(crate) struct NewRun {
    pub holder: String,
    pub lease_until_ms: i64,
}

/// A commit left in the queue by a thread that found the lock taken.
pub(crate) struct Queued {
    lease: Lease,
    events: Vec<Event>,
    run: Run,
    checkpoint: Option<Checkpoint>,
    lease_until_ms: i64,
    blobs: Vec<(String, i64, Vec<u8>)>,
    contracts: Vec<ContractText>,
    extra: Extra,
    written: Option<Written>,
    /// Set, with the rows the write left, by the thread that wrote it.
    outcome: Option<Result<Written, StoreError>>,
}

impl Queued {
    fn commit(&self) -> Commit<'_> {
        Commit {
            lease: &self.lease,
            events: &self.events,
            run: &self.run,
            checkpoint: self.checkpoint.as_ref(),
            lease_until_ms: self.lease_until_ms,
            blobs: &self.blobs,
            contracts: &self.contracts,
            extra: self.extra.clone(),
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Writers {
    /// Commits waiting for the lock now.
    pub(crate) fn waiting(&self) -> usize {
        let state = lock(&self.state);
        state.queue.len() + usize::from(state.leader_waiting)
    }

    /// Transactions written through `Store::commit` in this process, and the commits they held.
    pub(crate) fn stats(&self) -> CommitStats {
        CommitStats {
            transactions: self.transactions.load(Ordering::Relaxed),
            commits: self.commits.load(Ordering::Relaxed),
            largest: self.largest.load(Ordering::Relaxed),
        }
    }

    /// Writes `commit` on `conn`, with the commits other threads leave waiting meanwhile.
    /// Returns the rows the write left (for the caller's cache), or why it failed.
    ///
    /// One thread at a time leads: it waits for the lock, takes every commit queued by then,
    /// writes them with its own in one transaction and wakes their threads. A thread that
    /// comes while another leads queues a copy of its commit and waits to be woken: its commit
    /// is written by that leader or the next, or, when no one leads any more, by itself.
    pub(crate) fn commit(
        &self,
        conn: &mut rusqlite::Connection,
        path: &std::path::Path,
        commit: Commit<'_>,
        written: Written,
        grouped: bool,
        busy: std::time::Duration,
    ) -> Result<Written, StoreError> {
        if !grouped {
            let _held = lock(&self.lock);
            return write(self, conn, path, Some((commit, written)), &[])
                .unwrap_or_else(|| Err(abandoned(path)));
        }
        let mut state = lock(&self.state);
        if !state.leading {
            // Nobody leads: lead, with this commit as it is (no copy).
            state.leading = true;
            state.leader_waiting = true;
            drop(state);
            let _leading = Leading(self);
            let _held = lock(&self.lock);
            let waiting = {
                let mut state = lock(&self.state);
                state.leader_waiting = false;
                std::mem::take(&mut state.queue)
            };
            return self
                .lead(conn, path, busy, Some((commit, written)), &waiting)
                .unwrap_or_else(|| Err(abandoned(path)));
        }
        let slot = Arc::new(Slot {
            queued: Mutex::new(Queued {
                lease: commit.lease.clone(),
                events: commit.events.to_vec(),
                run: commit.run.clone(),
                checkpoint: commit.checkpoint.cloned(),
                lease_until_ms: commit.lease_until_ms,
                blobs: commit.blobs.to_vec(),
                contracts: commit.contracts.to_vec(),
                extra: commit.extra.clone(),
                written: Some(written),
                outcome: None,
            }),
            done: AtomicBool::new(false),
        });
        state.queue.push(slot.clone());
        loop {
            state = self
                .turn
                .wait(state)
                .unwrap_or_else(PoisonError::into_inner);
            if slot.done.load(Ordering::Acquire) {
                break;
            }
            if !state.leading {
                // The leaders before left it queued: lead, and write it with the others.
                state.leading = true;
                drop(state);
                let _leading = Leading(self);
                let _held = lock(&self.lock);
                let waiting = std::mem::take(&mut lock(&self.state).queue);
                self.lead(conn, path, busy, None, &waiting);
                break;
            }
        }
        let outcome = lock(&slot.queued).outcome.take();
        outcome.unwrap_or_else(|| Err(abandoned(path)))
    }

    /// [`write`] as the leader, with the write lock held: on the shared write connection, or on
    /// the leader's own when the shared one cannot be opened (the leader's then reports what
    /// is wrong with the file, if anything is).
    fn lead(
        &self,
        own_conn: &mut rusqlite::Connection,
        path: &std::path::Path,
        busy: std::time::Duration,
        own: Option<(Commit<'_>, Written)>,
        queued: &[Arc<Slot>],
    ) -> Option<Result<Written, StoreError>> {
        let mut shared = lock(&self.conn);
        if shared.is_none() {
            *shared = crate::connect(path).ok().map(|conn| Shared {
                conn,
                busy: crate::BUSY_TIMEOUT,
            });
        }
        let conn = match shared.as_mut() {
            Some(shared) => {
                if shared.busy != busy && shared.conn.busy_timeout(busy).is_ok() {
                    shared.busy = busy;
                }
                &mut shared.conn
            }
            None => own_conn,
        };
        write(self, conn, path, own, queued)
    }
}

/// A thread's lead, given up when it is dropped (also when the thread panics): the next may
/// lead, and every thread waiting looks at its outcome.
struct Leading<'a>(&'a Writers);

impl Drop for Leading<'_> {
    fn drop(&mut self) {
        let mut state = lock(&self.0.state);
        state.leading = false;
        state.leader_waiting = false;
        self.0.turn.notify_all();
    }
}

/// A queued commit whose writer stopped before giving it an outcome (it panicked).
fn abandoned(path: &std::path::Path) -> StoreError {
    StoreError::SharedCommit {
        path: path.to_path_buf(),
        size: 0,
        message: "the thread writing it stopped first; it may or may not be written".to_string(),
    }
}

/// One transaction for `own` (this thread's commit, if it has one) and `queued`. Sets each
/// queued commit's outcome and returns `own`'s.
fn write(
    writers: &Writers,
    conn: &mut rusqlite::Connection,
    path: &std::path::Path,
    own: Option<(Commit<'_>, Written)>,
    queued: &[Arc<Slot>],
) -> Option<Result<Written, StoreError>> {
    let mut guards: Vec<_> = queued.iter().map(|slot| lock(&slot.queued)).collect();
    let has_own = own.is_some();
    let mut written = Vec::with_capacity(guards.len() + 1);
    let mut commits = Vec::with_capacity(guards.len() + 1);
    if let Some((commit, own_written)) = own {
        commits.push(commit);
        written.push(own_written);
    }
    for guard in &mut guards {
        written.push(guard.written.take().unwrap_or(Written::Unknown));
    }
    commits.extend(guards.iter().map(|guard| guard.commit()));
    let size = commits.len();
    let outcomes = write_commits(conn, path, &commits, written);
    if outcomes
        .as_ref()
        .is_ok_and(|outcomes| outcomes.iter().any(Result::is_ok))
    {
        writers.transactions.fetch_add(1, Ordering::Relaxed);
        writers.commits.fetch_add(size as u64, Ordering::Relaxed);
        writers.largest.fetch_max(size as u64, Ordering::Relaxed);
    }
    let outcomes = match outcomes {
        Ok(outcomes) => outcomes,
        // The transaction's failure is every commit's; a commit alone reports it as its own.
        Err(source) if size == 1 => vec![Err(StoreError::Sqlite {
            path: path.to_path_buf(),
            source,
        })],
        Err(e) => (0..size)
            .map(|_| {
                Err(StoreError::SharedCommit {
                    path: path.to_path_buf(),
                    size,
                    message: e.to_string(),
                })
            })
            .collect(),
    };
    drop(commits);
    let mut outcomes = outcomes.into_iter();
    let own = if has_own { outcomes.next() } else { None };
    for guard in &mut guards {
        guard.outcome = Some(outcomes.next().unwrap_or_else(|| Err(abandoned(path))));
    }
    drop(guards);
    for slot in queued {
        slot.done.store(true, Ordering::Release);
    }
    own
}

/// One commit's statements, inside the transaction (and its savepoint, if it shares one).
fn write_one(
    tx: &rusqlite::Transaction<'_>,
    commit: &Commit<'_>,
    written: &mut Written,
) -> Result<(), TxError> {
    if !commit.contracts.is_empty() {
        let mut insert = tx.prepare_cached(
            "INSERT OR IGNORE INTO contracts (hash, file, source) VALUES (?1, ?2, ?3)",
        )?;
        for c in commit.contracts {
            insert.execute(rusqlite::params![c.hash, c.file, c.source])?;
        }
    }
    if let Some(new) = &commit.extra.create {
        let created_at = commit.events.first().map_or(0, |e| e.at_ms);
        tx.prepare_cached(
            "INSERT INTO runs (id, contract_hash, state, reason, created_at, updated_at, \
             last_seq, last_hash, lease_holder, lease_token, lease_until) \
             VALUES (?1, ?2, 'planned', '', ?3, ?3, 0, ?4, ?5, ?6, ?7)",
        )?
        .execute(rusqlite::params![
            commit.run.id,
            commit.run.contract_hash,
            created_at,
            keel_core::event::GENESIS_HASH,
            new.holder,
            commit.lease.token,
            new.lease_until_ms
        ])?;
    }
    write_events(
        tx,
        commit.lease,
        commit.events,
        commit.run,
        commit.checkpoint,
        commit.lease_until_ms,
        written,
    )?;
    write_blobs(tx, commit.blobs)?;
    if commit.extra.release {
        tx.prepare_cached(
            "UPDATE runs SET lease_holder = NULL, lease_until = 0 \
             WHERE id = ?1 AND lease_token = ?2",
        )?
        .execute(rusqlite::params![commit.lease.run_id, commit.lease.token])?;
    }
    Ok(())
}

/// Writes `commits` in one transaction, each in a savepoint with its `written` rows (a commit
/// alone needs none): the outcome of each (the rows it left, or why it was refused, alone), or
/// the transaction's own failure, which is all of theirs. A transaction in which every commit
/// was refused is rolled back, not committed, as a commit alone that is refused always was.
pub(crate) fn write_commits(
    conn: &mut rusqlite::Connection,
    path: &std::path::Path,
    commits: &[Commit<'_>],
    written: Vec<Written>,
) -> Result<Vec<Result<Written, StoreError>>, rusqlite::Error> {
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    let savepoints = commits.len() > 1;
    // Cached statements: each commit of a batch makes the same ones.
    let run = |sql: &str| -> rusqlite::Result<()> {
        tx.prepare_cached(sql)?.execute([])?;
        Ok(())
    };
    let mut outcomes = Vec::with_capacity(commits.len());
    for (commit, mut written) in commits.iter().zip(written) {
        if savepoints {
            run("SAVEPOINT keel_commit")?;
        }
        let result = write_one(&tx, commit, &mut written);
        match result {
            Ok(()) => {
                if savepoints {
                    run("RELEASE keel_commit")?;
                }
                outcomes.push(Ok(written));
            }
            Err(e) => {
                if savepoints {
                    run("ROLLBACK TO keel_commit")?;
                    run("RELEASE keel_commit")?;
                }
                outcomes.push(Err(e.into_store(path)));
            }
        }
    }
    if outcomes.iter().all(Result::is_err) {
        tx.rollback()?;
        return Ok(outcomes);
    }
    // Through `finish`, so that `KEEL_STORE_FAULT` reaches a shared commit as it does any other.
    crate::finish(tx)?;
    Ok(outcomes)
}
