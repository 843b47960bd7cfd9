//! The survey run: a scripted agent phase of N steps (varied `note`, `read` and `plan` calls,
//! then `finish`), driven through `keel_engine::start` on a temporary git workspace. It gives
//! the prompt size per step and, timed step by step, the durable cost of a step.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result, bail, ensure};
use keel_core::event::EventBody;
use keel_core::run::Run;
use keel_core::state::RunState;
use keel_engine::{Actor, DriverOverride, NewRun, Observer, Progress};
use keel_store::{Store, StoredEvent};
use serde_json::{Value, json};

use crate::util::{self, Cpu, round1};

/// What one survey run measured.
pub struct Survey {
    pub steps: usize,
    pub context_tokens: u64,
    /// `prompt_tokens` of each step's request, in step order.
    pub tokens: Vec<u64>,
    pub elapsed_ms: u64,
    pub events: Vec<StoredEvent>,
    pub store_bytes: u64,
    pub artifact_files: u64,
    pub state: String,
    /// Wall time from the start of each step to the start of the next, in microseconds.
    pub step_us: Vec<f64>,
    /// CPU time from the first step's start to the last step's start.
    pub cpu: Cpu,
    /// The projection as stored at the end, in bytes of JSON.
    pub projection_bytes: usize,
    /// Event commits the engine made over the whole run (start and acceptance included).
    pub commits: u64,
    /// Git processes keel started from the first step's start to the last step's start.
    pub git_processes: u64,
    /// Bytes written to WAL files from the first step's start to the last step's start.
    pub wal_bytes: u64,
    /// Artifacts kept in the store's own table (small ones, written with their events).
    pub stored_blobs: u64,
    /// Kept for the measurements that reuse the workspace and store.
    pub _dir: tempfile::TempDir,
    pub workspace: PathBuf,
    pub db: PathBuf,
}

/// Notes the moment each agent step begins, and a [`Tally`] at the first and the last of
/// `steps`: the engine reports a step once it has recorded its `step_started` (after the
/// previous step's commit), so the time between two reports is one whole step, its commit
/// included. The CPU is read (two `getrusage` calls, each a system call) only at those two
/// steps, so that what the clock itself costs is not counted as the steps'.
struct StepClock {
    steps: usize,
    marks: Vec<Instant>,
    first: Option<Tally>,
    last: Option<Tally>,
}

/// What the process has spent so far: CPU time, git processes started, bytes written to WAL
/// files.
#[derive(Clone, Copy)]
struct Tally {
    cpu: Cpu,
    git_processes: u64,
    wal_bytes: u64,
}

impl StepClock {
    fn new(steps: usize) -> StepClock {
        StepClock {
            steps,
            marks: Vec::with_capacity(steps),
            first: None,
            last: None,
        }
    }
}

impl Observer for StepClock {
    fn progress(&mut self, _: &Run, progress: Progress<'_>) {
        if let Progress::Step { .. } = progress {
            self.marks.push(Instant::now());
            let n = self.marks.len();
            if n == 1 || n == self.steps {
                let now = Some(Tally {
                    cpu: util::cpu(),
                    git_processes: keel_git::processes(),
                    wal_bytes: keel_store::vfs::wal_bytes_written(),
                });
                if n == 1 {
                    self.first = now;
                }
                if n == self.steps {
                    self.last = now;
                }
            }
        }
    }
}

/// The script a run follows.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Script {
    /// Varied `note`, `read` and `plan` calls (`keel_test_support::survey::script`).
    Survey,
    /// A short `note` at every step (`keel_test_support::survey::noop_script`), measured in a
    /// store that has driven one such run before (unmeasured), so that its commits write over
    /// WAL frames already on the disk, as the floor's do.
    Noop,
}

/// Runs the survey in a new directory under `base`; with `keep`, the directory (workspace and
/// store) stays after the program ends, for a look at what a step wrote.
pub fn run(
    base: &Path,
    script: Script,
    steps: usize,
    context_tokens: u64,
    keep: bool,
) -> Result<Survey> {
    let dir = tempfile::Builder::new()
        .disable_cleanup(keep)
        .tempdir_in(base)
        .context("creating a temporary directory")?;
    let ws = dir.path().join("ws");
    util::workspace(&ws)?;
    std::fs::write(
        ws.join("actions.jsonl"),
        match script {
            Script::Survey => keel_test_support::survey::script(steps),
            Script::Noop => keel_test_support::survey::noop_script(steps),
        },
    )?;
    let contract_path = ws.join("keel.toml");
    std::fs::write(
        &contract_path,
        keel_test_support::survey::contract(context_tokens),
    )?;
    // Committed, so the workspace tree the run sees is the one HEAD has.
    util::git(&ws, &["add", "-A"])?;
    util::git(&ws, &["commit", "-q", "-m", "contract and script"])?;

    let contract = keel_engine::load_contract(&contract_path)?;
    let db = ws.join(".keel").join("keel.db");
    let mut store = Store::open(&db)?;
    let choice = DriverOverride::default();
    let actor = Actor::current();
    if script == Script::Noop {
        let warm = keel_engine::start(
            &mut store,
            NewRun {
                contract_path: &contract_path,
                contract: contract.clone(),
                run_id: &keel_engine::new_run_id(),
                choice: &choice,
                detach: false,
            },
            &actor,
            &mut StepClock::new(steps),
            &mut |_| {},
        )?;
        ensure!(
            warm.state == RunState::Completed,
            "the warm-up run ended {}: {}",
            warm.state,
            warm.reason
        );
    }
    let commits_before = store.commits();
    let id = keel_engine::new_run_id();
    let mut clock = StepClock::new(steps);
    let started = Instant::now();
    let run = keel_engine::start(
        &mut store,
        NewRun {
            contract_path: &contract_path,
            contract,
            run_id: &id,
            choice: &choice,
            detach: false,
        },
        &actor,
        &mut clock,
        &mut |_| {},
    )?;
    let elapsed_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
    ensure!(
        run.state == RunState::Completed,
        "the survey run ended {}: {}",
        run.state,
        run.reason
    );

    let events = store.events_from(&id, 1)?;
    let mut tokens = Vec::with_capacity(steps);
    for stored in &events {
        if stored.kind != "model_requested" {
            continue;
        }
        if let EventBody::ModelRequested { prompt_tokens, .. } = stored.decode()?.body {
            tokens.push(prompt_tokens);
        }
    }
    ensure!(
        tokens.len() == steps,
        "expected {steps} model requests, the store has {}",
        tokens.len()
    );
    let marks = &clock.marks;
    ensure!(
        marks.len() == steps,
        "expected {steps} step reports, got {}",
        marks.len()
    );
    let step_us = marks.windows(2).map(|w| util::us(w[1] - w[0])).collect();
    let (Some(first), Some(last)) = (&clock.first, &clock.last) else {
        bail!("the step clock did not read the CPU at the first and the last step");
    };
    let cpu = Cpu {
        process_us: last.cpu.process_us - first.cpu.process_us,
        children_us: last.cpu.children_us - first.cpu.children_us,
    };
    let git_processes = last.git_processes - first.git_processes;
    let wal_bytes = last.wal_bytes - first.wal_bytes;
    let commits = store.commits() - commits_before;
    let stored_blobs = util::count_blobs(&db, &id)?;
    let projection_bytes = serde_json::to_string(&store.run(&id)?)?.len();
    let (store_bytes, _) = util::size(&ws.join(".keel"))?;
    let (_, artifact_files) = util::size(&ws.join(".keel").join("artifacts"))?;
    Ok(Survey {
        steps,
        context_tokens,
        tokens,
        elapsed_ms,
        events,
        store_bytes,
        artifact_files,
        state: run.state.to_string(),
        step_us,
        cpu,
        projection_bytes,
        commits,
        git_processes,
        wal_bytes,
        stored_blobs,
        _dir: dir,
        workspace: ws,
        db,
    })
}

impl Survey {
    pub fn prompt_figures(&self) -> Value {
        let n = self.steps;
        let (early, late) = windows(n);
        let mean_early = mean(&self.tokens[early.clone()]);
        let mean_late = mean(&self.tokens[late.clone()]);
        let mut figures = serde_json::Map::new();
        figures.insert("step_10".into(), json!(self.tokens[9]));
        figures.insert(format!("step_{n}"), json!(self.tokens[n - 1]));
        figures.insert("max".into(), json!(self.tokens.iter().max()));
        figures.insert("min".into(), json!(self.tokens.iter().min()));
        figures.insert("context_tokens".into(), json!(self.context_tokens));
        figures.insert("mean_early".into(), json!(round1(mean_early)));
        figures.insert("mean_late".into(), json!(round1(mean_late)));
        figures.insert(
            "early_window".into(),
            json!(format!("steps {}-{}", early.start + 1, early.end)),
        );
        figures.insert(
            "late_window".into(),
            json!(format!("steps {}-{}", late.start + 1, late.end)),
        );
        figures.insert(
            "flat_within_pct".into(),
            json!(round1((mean_late - mean_early).abs() / mean_early * 100.0)),
        );
        Value::Object(figures)
    }

    /// The step-10 and last-step prompt sizes, and how far apart they are in percent.
    pub fn step_10_vs_last(&self) -> (u64, u64, f64) {
        let a = self.tokens[9];
        let b = self.tokens[self.steps - 1];
        (a, b, round1((b as f64 - a as f64).abs() / a as f64 * 100.0))
    }

    /// Events of the run's agent steps (from the first `step_started` to the last
    /// `step_verified`).
    pub fn step_events(&self) -> usize {
        let first = self
            .events
            .iter()
            .position(|e| e.kind == "step_started")
            .unwrap_or(0);
        let last = self
            .events
            .iter()
            .rposition(|e| e.kind == "step_verified")
            .unwrap_or(0);
        self.events.get(first..=last).unwrap_or_default().len()
    }
}

/// The 0-based index ranges compared: steps 10%–30% and the last fifth (for 500 steps, steps
/// 51–150 and 401–500, 1-based).
fn windows(n: usize) -> (std::ops::Range<usize>, std::ops::Range<usize>) {
    (n / 10..n * 3 / 10, n * 4 / 5..n)
}

fn mean(values: &[u64]) -> f64 {
    values.iter().sum::<u64>() as f64 / values.len().max(1) as f64
}
