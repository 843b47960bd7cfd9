//! `keel worker`: a long-lived process that claims runnable runs from the store and drives them.
//!
//! Runnable: a run whose approval decision or answer arrived, a run left by `keel run --detach`,
//! and a run whose driving process died (its lease expired, or its holder on this machine is
//! gone). Two workers never drive one run at once: each takes the run's lease, renews it with a
//! heartbeat while it works, and every write checks the fencing token.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::Duration;

use keel_core::run::Run;
use keel_core::state::RunState;
use keel_store::{Store, StoreError};

use crate::{Actor, EngineError, Observer, ResumeOptions, holder_is_stale, now_ms, resume};

/// The first wait before a worker tries again a run it could not drive; it doubles each time.
const FAILED_RETRY_BASE: Duration = Duration::from_secs(5);

#[derive(Debug, Clone)]
pub struct WorkerOptions {
    pub actor: Actor,
    /// How long a lease lasts without a heartbeat: how soon another worker takes over a run
    /// whose worker died on another machine.
    pub lease_ttl_ms: i64,
    /// How long to wait when nothing is runnable.
    pub poll: Duration,
    /// Stop when nothing is runnable instead of waiting for more.
    pub once: bool,
}

/// What a worker did: the runs it drove and the state each was left in.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WorkerReport {
    pub driven: Vec<(String, RunState)>,
    /// Runs that could not be driven, with why (the worker goes on with the others).
    pub errors: Vec<(String, String)>,
}

/// The runs a worker may take now.
pub fn runnable(store: &Store) -> Result<Vec<String>, EngineError> {
    let now = now_ms();
    let mut out = Vec::new();
    for run in store.runs()? {
        if run.frozen || run.state.is_terminal() {
            continue;
        }
        let free = {
            let lease = store.lease_info(&run.id)?;
            match lease.holder {
                None => true,
                Some(h) => lease.until_ms < now || holder_is_stale(&h),
            }
        };
        if free && wants_work(&run) {
            out.push(run.id.clone());
        }
    }
    // Oldest first.
    out.reverse();
    Ok(out)
}

fn wants_work(run: &Run) -> bool {
    match run.state {
        RunState::AwaitingApproval => run.approvals.last().is_some_and(|a| {
            a.decision.is_some() || a.request.expires_at_ms.is_some_and(|at| now_ms() >= at)
        }),
        RunState::Waiting => run.questions.last().is_some_and(|q| q.answer.is_some()),
        RunState::Planned | RunState::Executing | RunState::Verifying => true,
        // A block a person lifted in the inbox (a raise or a migration approved).
        RunState::Blocked => run.approvals.last().is_some_and(|a| {
            a.decision.as_ref().is_some_and(|d| d.approve)
                && matches!(
                    a.request.gate,
                    keel_core::event::Gate::BudgetRaise { .. } | keel_core::event::Gate::Migration
                )
        }),
        RunState::Completed | RunState::Failed => false,
    }
}

/// Claims and drives runnable runs until `stop` is set (or, with `once`, until none is left).
pub fn work(
    store_path: &Path,
    options: &WorkerOptions,
    stop: &AtomicBool,
    observer: &mut dyn Observer,
) -> Result<WorkerReport, EngineError> {
    let mut store = Store::open(store_path)?;
    let mut report = WorkerReport::default();
    let stopped = || stop.load(Ordering::SeqCst) || crate::stop_requested();
    // Runs that failed in this worker, and when they may be tried again: a run that cannot be
    // driven must not keep the worker busy (a `--once` worker does not try it again at all).
    let mut failed: std::collections::HashMap<String, (u32, std::time::Instant)> =
        std::collections::HashMap::new();
    while !stopped() {
        let mut did = false;
        for id in runnable(&store)? {
            if stopped() {
                break;
            }
            if let Some((_, retry_at)) = failed.get(&id)
                && (options.once || std::time::Instant::now() < *retry_at)
            {
                continue;
            }
            let heartbeat = Heartbeat::start(
                store_path.to_path_buf(),
                id.clone(),
                options.actor.holder.clone(),
                options.lease_ttl_ms,
            );
            let result = resume(
                &mut store,
                &id,
                &ResumeOptions {
                    migrate: None,
                    lease_ttl_ms: Some(options.lease_ttl_ms),
                },
                &options.actor,
                observer,
            );
            heartbeat.stop();
            match result {
                Ok(run) => {
                    did = true;
                    report.driven.push((run.id.clone(), run.state));
                }
                // Another worker got there first.
                Err(EngineError::Store(StoreError::LeaseHeld { .. })) => {}
                Err(e) => {
                    let tries = failed.get(&id).map_or(0, |(n, _)| *n) + 1;
                    let wait = FAILED_RETRY_BASE.saturating_mul(2u32.saturating_pow(tries.min(6)));
                    failed.insert(id.clone(), (tries, std::time::Instant::now() + wait));
                    report.errors.push((id.clone(), e.to_string()));
                }
            }
        }
        if !did {
            if options.once {
                break;
            }
            std::thread::sleep(options.poll);
        }
    }
    Ok(report)
}

/// Renews a run's lease every third of its lifetime while a worker drives it, from a thread
/// with its own connection, so a long step does not let the lease expire.
struct Heartbeat {
    done: mpsc::Sender<()>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Heartbeat {
    fn start(store: PathBuf, run: String, holder: String, ttl_ms: i64) -> Heartbeat {
        let (done, stopped) = mpsc::channel::<()>();
        let every = Duration::from_millis(u64::try_from(ttl_ms / 3).unwrap_or(1000).max(10));
        let thread = std::thread::spawn(move || {
            let Ok(store) = Store::open(&store) else {
                return;
            };
            while let Err(mpsc::RecvTimeoutError::Timeout) = stopped.recv_timeout(every) {
                // A lease that is no longer ours is not taken back: the fencing token decides.
                let _ = store.renew(&run, &holder, now_ms() + ttl_ms);
            }
        });
        Heartbeat {
            done,
            thread: Some(thread),
        }
    }

    fn stop(mut self) {
        let _ = self.done.send(());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
