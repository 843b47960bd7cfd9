//! Events appended per second by concurrent writers, with and without group commit.
//!
//! W writer threads each own a run and a store connection and append synthetic `note` steps
//! (8 events in one commit, grouped as the engine groups them) through `Store::commit`. With
//! group commit (keel-store's default, what the engine does) the commits that wait for the
//! write lock share the next transaction and fsync; without it (`Store::set_grouped(false)`)
//! every commit is its own transaction and fsync. Each trial writes to a fresh database in the
//! same directory; the modes take turns, [`ROUNDS`] trials each.

use std::path::Path;
use std::sync::Barrier;
use std::time::Instant;

use anyhow::{Result, anyhow};
use keel_core::event::{Event, EventBody};
use keel_core::run::Run;
use keel_store::{CommitStats, Store};
use serde_json::{Value, json};

use crate::synth::{Sink, SynthRun, Template};
use crate::util::{round1, round2};

pub struct Trial {
    pub writers: usize,
    pub events: u64,
    pub commits: u64,
    pub separate_events_per_s: f64,
    pub group_events_per_s: f64,
    /// Each trial's events per second, in the order they were taken.
    pub separate_samples: Vec<f64>,
    pub group_samples: Vec<f64>,
    pub mean_batch: f64,
    pub largest_batch: u64,
}

impl Trial {
    pub fn report(&self) -> Value {
        json!({
            "writers": self.writers,
            "events": self.events,
            "commits": self.commits,
            "group_commit": round1(self.group_events_per_s),
            "without_group_commit": round1(self.separate_events_per_s),
            "ratio": round2(self.group_events_per_s / self.separate_events_per_s.max(1e-9)),
            "group_commit_trials": self.group_samples.iter().map(|v| round1(*v)).collect::<Vec<_>>(),
            "without_group_commit_trials":
                self.separate_samples.iter().map(|v| round1(*v)).collect::<Vec<_>>(),
            "mean_commits_per_transaction": round1(self.mean_batch),
            "largest_transaction": self.largest_batch,
        })
    }
}

/// Trials of each mode, taken in turns (without, with, without, …): each mode's figure is the
/// median of its trials, so that a slow moment of the machine falls on one trial of one mode,
/// not on a whole mode. A trial is 1,600 commits (see `main`), a fraction of a second.
pub const ROUNDS: usize = 3;

pub fn measure(
    base: &Path,
    created: &Event,
    template: &Template,
    writers: usize,
    steps: usize,
) -> Result<Trial> {
    let dir = tempfile::tempdir_in(base)?;
    let (mut separate, mut grouped) = (Vec::new(), Vec::new());
    let (mut events, mut commits) = (0, 0);
    let mut stats = CommitStats::default();
    for round in 0..ROUNDS {
        let (n, c, elapsed, _) = trial(
            dir.path(),
            &format!("separate{round}"),
            created,
            template,
            writers,
            steps,
            false,
        )?;
        (events, commits) = (n, c);
        separate.push(n as f64 / elapsed.as_secs_f64());
        let (n, _, elapsed, s) = trial(
            dir.path(),
            &format!("group{round}"),
            created,
            template,
            writers,
            steps,
            true,
        )?;
        grouped.push(n as f64 / elapsed.as_secs_f64());
        stats.transactions += s.transactions;
        stats.commits += s.commits;
        stats.largest = stats.largest.max(s.largest);
        stats.boosted += s.boosted;
        stats.held_us += s.held_us;
    }
    Ok(Trial {
        writers,
        events,
        commits,
        separate_events_per_s: crate::util::median(&separate),
        group_events_per_s: crate::util::median(&grouped),
        separate_samples: separate,
        group_samples: grouped,
        mean_batch: stats.commits as f64 / stats.transactions.max(1) as f64,
        largest_batch: stats.largest,
    })
}

/// One mode: `writers` threads, a connection each, `steps` steps each, into a fresh store
/// under `dir/name`. (events, commits, wall time of all writers, the store's commit counts
/// during it).
fn trial(
    dir: &Path,
    name: &str,
    created: &Event,
    template: &Template,
    writers: usize,
    steps: usize,
    grouped: bool,
) -> Result<(u64, u64, std::time::Duration, CommitStats)> {
    let db = dir.join(name).join("keel.db");
    let runs = create_runs(&db, created, template, writers)?;
    let counter = Store::open(&db)?;
    let before = counter.shared_commit_stats();
    let barrier = Barrier::new(writers + 1);
    let (elapsed, (events, commits)) = std::thread::scope(|s| -> Result<_> {
        let mut threads = Vec::new();
        for mut run in runs {
            let barrier = &barrier;
            let db = &db;
            threads.push(s.spawn(move || -> Result<(u64, u64)> {
                let mut store = Store::open(db)?;
                store.set_grouped(grouped);
                barrier.wait();
                write_steps(&mut Sink::Store(&mut store), &mut run, steps)
            }));
        }
        barrier.wait();
        let started = Instant::now();
        let counts = join(threads)?;
        Ok((started.elapsed(), counts))
    })?;
    let after = counter.shared_commit_stats();
    let stats = after.since(&before);
    Ok((events, commits, elapsed, stats))
}

fn join(threads: Vec<std::thread::ScopedJoinHandle<'_, Result<(u64, u64)>>>) -> Result<(u64, u64)> {
    let mut total = (0, 0);
    for t in threads {
        let (e, c) = t
            .join()
            .map_err(|_| anyhow!("a writer thread panicked"))??;
        total.0 += e;
        total.1 += c;
    }
    Ok(total)
}

/// `writers` runs in a fresh store, each with its lease and a `resumed` record.
fn create_runs(
    db: &Path,
    created: &Event,
    template: &Template,
    writers: usize,
) -> Result<Vec<SynthRun>> {
    let mut store = Store::open(db)?;
    let mut runs = Vec::with_capacity(writers);
    for _ in 0..writers {
        let event = Event {
            run_id: keel_engine::new_run_id(),
            seq: 1,
            at_ms: keel_engine::now_ms(),
            body: created.body.clone(),
        };
        let run = Run::create(&event)?;
        let lease =
            store.create_run(&event, &run, "keel-bench", keel_engine::now_ms(), 3_600_000)?;
        let mut synth = SynthRun::new(run, lease.clone(), template.clone());
        synth.commit(
            &mut Sink::Store(&mut store),
            vec![EventBody::Resumed {
                holder: "keel-bench".into(),
                lease: lease.token,
                checkpoint: None,
            }],
        )?;
        runs.push(synth);
    }
    Ok(runs)
}

/// Appends `steps` steps, commit group by commit group; (events, commits) written.
fn write_steps(sink: &mut Sink<'_>, run: &mut SynthRun, steps: usize) -> Result<(u64, u64)> {
    let (mut events, mut commits) = (0, 0);
    for _ in 0..steps {
        for group in run.next_step()? {
            events += group.len() as u64;
            commits += 1;
            run.commit(sink, group)?;
        }
    }
    Ok((events, commits))
}
