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

use crate::StoreError;
use crate::write::{Prepared, Rows, apply};

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
    /// Transactions whose leader ran at a raised priority (see [`Boost`]).
    boosted: AtomicU64,
    /// How long the write lock was held for those transactions, in all, in µs.
    held_us: AtomicU64,
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
    /// Threads waiting on `turn` (counted under this state's lock, as `wait` releases it), so
    /// that a leader with none to wake makes no wake-up call (a system call each).
    waiters: usize,
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
/// commits they held, the most one held, how many were written by a leader that had others
/// waiting and could raise its thread's priority meanwhile, and how long the write lock was
/// held for them in all (µs; where it is near the wall time, commits queue behind one another).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CommitStats {
    pub transactions: u64,
    pub commits: u64,
    pub largest: u64,
    pub boosted: u64,
    pub held_us: u64,
}

impl CommitStats {
    /// What was written since `before` (stats of the same store, taken earlier); `largest`
    /// stays the most one transaction held over the whole time.
    pub fn since(&self, before: &CommitStats) -> CommitStats {
        CommitStats {
            transactions: self.transactions.saturating_sub(before.transactions),
            commits: self.commits.saturating_sub(before.commits),
            largest: self.largest,
            boosted: self.boosted.saturating_sub(before.boosted),
            held_us: self.held_us.saturating_sub(before.held_us),
        }
    }
}

/// A commit left in the queue by a thread that found the lock taken: made ready before it was
/// queued, so the leader only runs its statements.
struct Queued {
    prepared: Prepared,
    /// Set by the thread that wrote it.
    outcome: Option<Result<(), StoreError>>,
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

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The write lock, held: the time it was held is added to the stats when it is given back.
struct Held<'a> {
    writers: &'a Writers,
    since: std::time::Instant,
    _guard: std::sync::MutexGuard<'a, ()>,
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        let us = u64::try_from(self.since.elapsed().as_micros()).unwrap_or(u64::MAX);
        self.writers.held_us.fetch_add(us, Ordering::Relaxed);
    }
}

impl Writers {
    /// Takes the write lock (waiting for it).
    fn hold(&self) -> Held<'_> {
        let guard = lock(&self.lock);
        Held {
            writers: self,
            since: std::time::Instant::now(),
            _guard: guard,
        }
    }

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
            boosted: self.boosted.load(Ordering::Relaxed),
            held_us: self.held_us.load(Ordering::Relaxed),
        }
    }

    /// Writes `commit` on `conn`, with the commits other threads leave waiting meanwhile.
    /// Returns what the connection knows of the run's rows once it is stored (for its cache),
    /// or why it was not.
    ///
    /// One thread at a time leads: it waits for the lock, takes every commit queued by then,
    /// writes them with its own in one transaction and wakes their threads. A thread that
    /// comes while another leads queues its commit and waits to be woken: its commit is written
    /// by that leader or the next, or, when no one leads any more, by itself.
    pub(crate) fn commit(
        &self,
        conn: &mut rusqlite::Connection,
        path: &std::path::Path,
        commit: Prepared,
        grouped: bool,
        busy: std::time::Duration,
    ) -> Result<Rows, StoreError> {
        if !grouped {
            let _held = self.hold();
            let outcome = write(self, conn, path, Some(&commit), &[]);
            return outcome
                .unwrap_or_else(|| Err(abandoned(path)))
                .map(|()| commit.rows);
        }
        let mut state = lock(&self.state);
        if !state.leading {
            // Nobody leads: lead, with this commit.
            state.leading = true;
            state.leader_waiting = true;
            drop(state);
            let _leading = Leading(self);
            let _held = self.hold();
            let waiting = {
                let mut state = lock(&self.state);
                state.leader_waiting = false;
                std::mem::take(&mut state.queue)
            };
            let outcome = self.lead(conn, path, busy, Some(&commit), &waiting);
            return outcome
                .unwrap_or_else(|| Err(abandoned(path)))
                .map(|()| commit.rows);
        }
        let slot = Arc::new(Slot {
            queued: Mutex::new(Queued {
                prepared: commit,
                outcome: None,
            }),
            done: AtomicBool::new(false),
        });
        state.queue.push(slot.clone());
        loop {
            state.waiters += 1;
            state = self
                .turn
                .wait(state)
                .unwrap_or_else(PoisonError::into_inner);
            state.waiters -= 1;
            if slot.done.load(Ordering::Acquire) {
                break;
            }
            if !state.leading {
                // The leaders before left it queued: lead, and write it with the others.
                state.leading = true;
                drop(state);
                let _leading = Leading(self);
                let _held = self.hold();
                let waiting = std::mem::take(&mut lock(&self.state).queue);
                self.lead(conn, path, busy, None, &waiting);
                break;
            }
        }
        let mut queued = lock(&slot.queued);
        let outcome = queued.outcome.take();
        outcome
            .unwrap_or_else(|| Err(abandoned(path)))
            .map(|()| std::mem::take(&mut queued.prepared.rows))
    }

    /// [`write`] as the leader, with the write lock held: on the shared write connection, or on
    /// the leader's own when the shared one cannot be opened (the leader's then reports what
    /// is wrong with the file, if anything is).
    fn lead(
        &self,
        own_conn: &mut rusqlite::Connection,
        path: &std::path::Path,
        busy: std::time::Duration,
        own: Option<&Prepared>,
        queued: &[Arc<Slot>],
    ) -> Option<Result<(), StoreError>> {
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
        // Others wait for this lock: a leader that loses its CPU to another thread while it
        // holds it stalls them all, so it runs ahead of the process's other threads meanwhile.
        let boost = (!queued.is_empty() || self.waiting() > 0).then(Boost::raise);
        if boost.as_ref().is_some_and(|b| b.restore.is_some()) {
            self.boosted.fetch_add(1, Ordering::Relaxed);
        }
        write(self, conn, path, own, queued)
    }
}

/// How far a leader with others waiting raises its thread's scheduling priority, in nice steps
/// (at most to -20): from the default 0 to the top. In `keel-bench`'s 1,000 runs, where the
/// write lock is almost always held and two cores run about a hundred threads, 20 steps gave
/// 77-81% of the allowed throughput against 77-79% for 10 (three alternating pairs), and 10
/// against none 74-80% against 73-76% (four).
const LEADER_BOOST: i32 = 20;

thread_local! {
    /// Whether this thread may raise its priority: root, or `RLIMIT_NICE` allows it. Tried
    /// once per thread; a refusal is not tried again.
    static MAY_RAISE: std::cell::Cell<bool> = const { std::cell::Cell::new(true) };
}

/// The calling thread's priority raised by [`LEADER_BOOST`] (on Linux `setpriority` with pid 0
/// is the calling thread's), put back when dropped. Where the raise is not allowed, nothing
/// changes: commits are only slower to queue behind a preempted leader.
struct Boost {
    restore: Option<i32>,
}

impl Boost {
    fn raise() -> Boost {
        let mut boost = Boost { restore: None };
        if !MAY_RAISE.get() {
            return boost;
        }
        let Ok(nice) = rustix::process::getpriority_process(None) else {
            return boost;
        };
        let raised = nice.saturating_sub(LEADER_BOOST).max(-20);
        if raised >= nice {
            return boost;
        }
        if rustix::process::setpriority_process(None, raised).is_ok() {
            boost.restore = Some(nice);
        } else {
            MAY_RAISE.set(false);
        }
        boost
    }
}

impl Drop for Boost {
    fn drop(&mut self) {
        if let Some(nice) = self.restore {
            let _ = rustix::process::setpriority_process(None, nice);
        }
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
        if state.waiters > 0 {
            self.0.turn.notify_all();
        }
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
    own: Option<&Prepared>,
    queued: &[Arc<Slot>],
) -> Option<Result<(), StoreError>> {
    let mut guards: Vec<_> = queued.iter().map(|slot| lock(&slot.queued)).collect();
    let has_own = own.is_some();
    let mut commits: Vec<&Prepared> = Vec::with_capacity(guards.len() + 1);
    commits.extend(own);
    commits.extend(guards.iter().map(|guard| &guard.prepared));
    let size = commits.len();
    let outcomes = write_commits(conn, path, &commits);
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

/// Writes `commits` in one transaction, each in a savepoint (a commit alone needs none): the
/// outcome of each (or why it was refused, alone), or the transaction's own failure, which is
/// all of theirs. A transaction in which every commit was refused is rolled back, not
/// committed, as a commit alone that is refused always was.
pub(crate) fn write_commits(
    conn: &mut rusqlite::Connection,
    path: &std::path::Path,
    commits: &[&Prepared],
) -> Result<Vec<Result<(), StoreError>>, rusqlite::Error> {
    let tx = crate::WriteTx::begin(conn)?;
    let savepoints = commits.len() > 1;
    // Cached statements: each commit of a batch makes the same ones.
    let run = |sql: &str| -> rusqlite::Result<()> {
        tx.prepare_cached(sql)?.execute([])?;
        Ok(())
    };
    let mut outcomes = Vec::with_capacity(commits.len());
    for commit in commits {
        if savepoints {
            run("SAVEPOINT keel_commit")?;
        }
        match apply(&tx, commit) {
            Ok(()) => {
                if savepoints {
                    run("RELEASE keel_commit")?;
                }
                outcomes.push(Ok(()));
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
        crate::Ending::rollback(tx)?;
        return Ok(outcomes);
    }
    // Through `finish`, so that `KEEL_STORE_FAULT` reaches a shared commit as it does any other.
    crate::finish(tx)?;
    Ok(outcomes)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;
    use keel_test_support::priority::{may_raise_priority as may_raise, nice};

    #[test]
    fn a_boost_raises_the_threads_priority_while_held_and_puts_it_back() {
        std::thread::spawn(|| {
            let allowed = may_raise();
            let before = nice();
            {
                let boost = Boost::raise();
                if allowed {
                    assert_eq!(nice(), (before - LEADER_BOOST).max(-20));
                    assert_eq!(boost.restore, Some(before));
                } else {
                    eprintln!("this thread may not raise its priority: the boost changes nothing");
                    assert_eq!(nice(), before);
                    assert_eq!(boost.restore, None);
                }
            }
            assert_eq!(nice(), before);
            // Another thread's boost is its own: this thread's priority stays as it is.
            let (raised, is_raised) = std::sync::mpsc::channel();
            let (checked, is_checked) = std::sync::mpsc::channel::<()>();
            let other = std::thread::spawn(move || {
                let boost = Boost::raise();
                raised.send(boost.restore.map(|_| nice())).unwrap();
                is_checked.recv().unwrap();
            });
            let theirs = is_raised.recv().unwrap();
            assert_eq!(nice(), before);
            if allowed {
                assert_eq!(theirs, Some((before - LEADER_BOOST).max(-20)));
            }
            checked.send(()).unwrap();
            other.join().unwrap();
        })
        .join()
        .unwrap();
    }

    #[test]
    fn a_thread_refused_once_does_not_ask_again() {
        std::thread::spawn(|| {
            MAY_RAISE.set(false);
            let before = nice();
            let boost = Boost::raise();
            assert_eq!(boost.restore, None);
            assert_eq!(nice(), before);
        })
        .join()
        .unwrap();
    }
}
