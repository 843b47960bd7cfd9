//! Group commit: the commits of many writers (threads, runs) in one SQLite transaction and one
//! fsync.
//!
//! A [`GroupCommitter`] owns a [`Store`] on a thread of its own. Writers on any thread hand it
//! their commits through a [`GroupHandle`]. It takes every commit that is waiting (up to
//! [`GroupOptions::max_batch`]), writes each inside its own savepoint with the same checks as
//! [`Store::commit`] (the writer's fencing token, the log head, the hash chain, the projections,
//! the checkpoint row), and commits the transaction once. While that fsync is under way the next
//! commits queue up and form the next batch, so the more writers there are, the more commits
//! share one fsync.
//!
//! Each writer gets its own result:
//! - a commit that fails its checks (a stale lease token, a log that moved) is rolled back to its
//!   savepoint and refused alone ([`GroupError::Refused`], carrying the error [`Store::commit`]
//!   would have returned); the other commits of the batch are written;
//! - a failure of the transaction itself (it cannot begin, a savepoint cannot be released, the
//!   commit or its fsync fails) is reported to every writer of the batch
//!   ([`GroupError::Batch`]), and nothing of the batch is written.
//!
//! Commits of one run in one batch are applied in the order they arrived, each seeing the ones
//! before it, so a writer that sends its next commit only after the previous one returned sees
//! its events land in order and chained.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use keel_core::checkpoint::Checkpoint;
use keel_core::event::Event;
use keel_core::run::Run;
use rusqlite::TransactionBehavior;

use std::collections::HashMap;

use crate::{Lease, Rows, Store, StoreError, Written, write_events};

/// How a [`GroupCommitter`] forms its batches.
#[derive(Debug, Clone)]
pub struct GroupOptions {
    /// The most commits in one transaction.
    pub max_batch: usize,
    /// How long to wait for more commits after the first of a batch arrives. Zero (the default)
    /// waits for none: a batch is whatever queued up during the previous fsync.
    pub linger: Duration,
    /// How long to wait for another process's write lock before the batch fails (the store's
    /// own setting when `None`).
    pub busy_timeout: Option<Duration>,
}

impl Default for GroupOptions {
    fn default() -> Self {
        GroupOptions {
            max_batch: 512,
            linger: Duration::ZERO,
            busy_timeout: None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum GroupError {
    /// This commit failed the store's checks and was not written; the other commits of its batch
    /// were.
    #[error(transparent)]
    Refused(StoreError),
    /// The batch's transaction failed: nothing of it was written.
    #[error(
        "store {path}: a group commit of {size} commits failed and none of them was written: {message}"
    )]
    Batch {
        path: PathBuf,
        size: usize,
        message: String,
    },
    /// The committer had stopped before this commit was written.
    #[error("store {path}: the group committer has stopped; the commit was not written")]
    Stopped { path: PathBuf },
}

/// How many transactions a committer made and how many commits they held.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GroupStats {
    pub batches: u64,
    pub commits: u64,
    pub largest_batch: u64,
}

#[derive(Default)]
struct Counters {
    batches: AtomicU64,
    commits: AtomicU64,
    largest: AtomicU64,
}

struct Request {
    lease: Lease,
    events: Vec<Event>,
    run: Run,
    checkpoint: Option<Checkpoint>,
    lease_until_ms: i64,
    reply: mpsc::SyncSender<Result<(), GroupError>>,
}

enum Message {
    Commit(Box<Request>),
    Stop,
}

/// The committing thread and its store. Dropping it (or [`GroupCommitter::stop`]) writes what
/// is queued before the stop and ends the thread; later commits fail with
/// [`GroupError::Stopped`].
pub struct GroupCommitter {
    sender: mpsc::Sender<Message>,
    thread: Option<JoinHandle<Store>>,
    counters: Arc<Counters>,
    path: PathBuf,
}

/// A writer's way to the committer; cheap to clone, one per thread or run.
#[derive(Clone)]
pub struct GroupHandle {
    sender: mpsc::Sender<Message>,
    path: PathBuf,
}

/// A commit handed to the committer, not yet known to be written.
pub struct Pending {
    reply: mpsc::Receiver<Result<(), GroupError>>,
    path: PathBuf,
}

impl Pending {
    /// Waits for this commit's own result.
    pub fn wait(self) -> Result<(), GroupError> {
        self.reply.recv().unwrap_or_else(|_| {
            Err(GroupError::Stopped {
                path: self.path.clone(),
            })
        })
    }
}

impl GroupCommitter {
    /// Starts the committing thread, which owns `store` from now on.
    pub fn start(store: Store, options: GroupOptions) -> Result<GroupCommitter, StoreError> {
        if let Some(timeout) = options.busy_timeout {
            store.conn.busy_timeout(timeout).map_err(|e| store.sql(e))?;
        }
        let path = store.path.clone();
        let (sender, receiver) = mpsc::channel();
        let counters = Arc::new(Counters::default());
        let thread = {
            let counters = counters.clone();
            std::thread::Builder::new()
                .name("keel-group-commit".into())
                .spawn(move || committer(store, receiver, options, &counters))
                .map_err(|e| StoreError::io(&path, e))?
        };
        Ok(GroupCommitter {
            sender,
            thread: Some(thread),
            counters,
            path,
        })
    }

    pub fn handle(&self) -> GroupHandle {
        GroupHandle {
            sender: self.sender.clone(),
            path: self.path.clone(),
        }
    }

    pub fn stats(&self) -> GroupStats {
        GroupStats {
            batches: self.counters.batches.load(Ordering::Relaxed),
            commits: self.counters.commits.load(Ordering::Relaxed),
            largest_batch: self.counters.largest.load(Ordering::Relaxed),
        }
    }

    /// Writes what was queued before this call, stops the thread and gives the store back
    /// (`None` if the committing thread panicked).
    pub fn stop(mut self) -> Option<Store> {
        self.finish()
    }

    fn finish(&mut self) -> Option<Store> {
        let _ = self.sender.send(Message::Stop);
        self.thread.take().and_then(|t| t.join().ok())
    }
}

impl Drop for GroupCommitter {
    fn drop(&mut self) {
        self.finish();
    }
}

impl GroupHandle {
    /// Hands a commit to the committer without waiting for it. The arguments are those of
    /// [`Store::commit`].
    pub fn submit(
        &self,
        lease: &Lease,
        events: &[Event],
        run: &Run,
        checkpoint: Option<&Checkpoint>,
        lease_until_ms: i64,
    ) -> Pending {
        let (reply, receiver) = mpsc::sync_channel(1);
        let request = Request {
            lease: lease.clone(),
            events: events.to_vec(),
            run: run.clone(),
            checkpoint: checkpoint.cloned(),
            lease_until_ms,
            reply,
        };
        // A committer that has stopped drops the request, and `wait` reports it.
        let _ = self.sender.send(Message::Commit(Box::new(request)));
        Pending {
            reply: receiver,
            path: self.path.clone(),
        }
    }

    /// What [`Store::commit`] does, in a transaction shared with other writers: appends
    /// `events` (already applied to `run`) and updates every projection, if the lease is still
    /// ours and the log is where the caller thinks it is. Returns once the batch is fsynced.
    pub fn commit(
        &self,
        lease: &Lease,
        events: &[Event],
        run: &Run,
        checkpoint: Option<&Checkpoint>,
        lease_until_ms: i64,
    ) -> Result<(), GroupError> {
        self.submit(lease, events, run, checkpoint, lease_until_ms)
            .wait()
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

fn committer(
    mut store: Store,
    receiver: mpsc::Receiver<Message>,
    options: GroupOptions,
    counters: &Counters,
) -> Store {
    let max_batch = options.max_batch.max(1);
    // The rows each run's last committed write left, under the lease token it was made with: a
    // commit under the same token writes only the rows that changed (as `Store::commit` does).
    let mut rows: HashMap<String, (u64, Rows)> = HashMap::new();
    loop {
        let first = match receiver.recv() {
            Ok(Message::Commit(request)) => request,
            Ok(Message::Stop) | Err(_) => break,
        };
        let mut batch = vec![first];
        let mut stop = false;
        let deadline = Instant::now() + options.linger;
        while batch.len() < max_batch {
            let left = deadline.saturating_duration_since(Instant::now());
            let next = if left.is_zero() {
                receiver.try_recv().ok()
            } else {
                receiver.recv_timeout(left).ok()
            };
            match next {
                Some(Message::Commit(request)) => batch.push(request),
                Some(Message::Stop) => {
                    stop = true;
                    break;
                }
                None => break,
            }
        }
        let size = batch.len();
        let results = match write_batch(&mut store, &batch, &mut rows) {
            Ok(results) => results,
            Err(source) => {
                let message = source.to_string();
                batch
                    .iter()
                    .map(|_| {
                        Err(GroupError::Batch {
                            path: store.path.clone(),
                            size,
                            message: message.clone(),
                        })
                    })
                    .collect()
            }
        };
        counters.batches.fetch_add(1, Ordering::Relaxed);
        counters.commits.fetch_add(size as u64, Ordering::Relaxed);
        counters.largest.fetch_max(size as u64, Ordering::Relaxed);
        for (request, result) in batch.into_iter().zip(results) {
            // A writer that stopped waiting does not stop the others.
            let _ = request.reply.send(result);
        }
        if stop {
            break;
        }
    }
    store
}

/// One transaction for the whole batch, one savepoint per commit. An error here is the batch's:
/// the transaction is rolled back (when the `Transaction` is dropped) and nothing is written.
fn write_batch(
    store: &mut Store,
    batch: &[Box<Request>],
    rows: &mut HashMap<String, (u64, Rows)>,
) -> Result<Vec<Result<(), GroupError>>, rusqlite::Error> {
    let path = store.path.clone();
    let writer = std::sync::Arc::clone(&store.writer);
    let _queued = writer
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let tx = store
        .conn
        .transaction_with_behavior(TransactionBehavior::Immediate)?;
    let mut results = Vec::with_capacity(batch.len());
    // What this batch wrote, remembered only once it is durable.
    let mut written_now: HashMap<String, (u64, Rows)> = HashMap::new();
    for r in batch {
        tx.execute_batch("SAVEPOINT keel_group")?;
        let id = &r.lease.run_id;
        let known = written_now
            .remove(id)
            .or_else(|| rows.remove(id))
            .filter(|(token, _)| *token == r.lease.token);
        let mut written = match known {
            Some((_, known)) => Written::Known(known),
            None => Written::Unknown,
        };
        match write_events(
            &tx,
            &r.lease,
            &r.events,
            &r.run,
            r.checkpoint.as_ref(),
            r.lease_until_ms,
            &mut written,
        ) {
            Ok(()) => {
                tx.execute_batch("RELEASE keel_group")?;
                if let Written::Known(after) = written {
                    written_now.insert(id.clone(), (r.lease.token, after));
                }
                results.push(Ok(()));
            }
            Err(e) => {
                tx.execute_batch("ROLLBACK TO keel_group; RELEASE keel_group")?;
                results.push(Err(GroupError::Refused(e.into_store(&path))));
            }
        }
    }
    // Through `finish`, so that `KEEL_STORE_FAULT` reaches a group commit as it does any other.
    crate::finish(tx)?;
    rows.extend(written_now);
    Ok(results)
}
