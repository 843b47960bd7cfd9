//! Where a step's time goes: the parts of a step, each timed alone on the survey run's own
//! workspace and store after that run ended.

use std::time::Instant;

use anyhow::{Context, Result};
use keel_core::event::Event;
use keel_core::run::Run;
use keel_git::Git;
use keel_store::Store;
use serde_json::{Value, json};

use crate::survey::Survey;
use crate::synth::{Sink, SynthRun, Template};
use crate::util::{median, summary, us};

pub struct Breakdown {
    /// One `Store::commit` of a synthetic step's commit group, on a run with few steps.
    pub commit_early_us: Vec<f64>,
    /// The same on a run that already has `late_steps` steps.
    pub commit_late_us: Vec<f64>,
    pub late_steps: usize,
    pub artifact_put_us: Vec<f64>,
    pub worktree_tree_us: Vec<f64>,
    pub head_us: Vec<f64>,
    pub branch_us: Vec<f64>,
    pub diff_us: Vec<f64>,
}

pub fn measure(survey: &Survey, template: &Template, samples: usize) -> Result<Breakdown> {
    let mut store = Store::open(&survey.db)?;
    let created = survey
        .events
        .first()
        .context("the survey log is empty")?
        .decode()?;

    let mut early = new_run(&mut store, &created, template)?;
    let commit_early_us = time_steps(&mut store, &mut early, samples)?;

    let late_steps = survey.steps;
    let mut late = new_run(&mut store, &created, template)?;
    let mut done = 0;
    while done < late_steps {
        let n = (late_steps - done).min(250);
        late.commit_steps(&mut Sink::Store(&mut store), n)?;
        done += n;
    }
    let commit_late_us = time_steps(&mut store, &mut late, samples)?;

    let mut artifact_put_us = Vec::with_capacity(samples);
    for i in 0..samples {
        // About the size of a 4000-token request, different each time (content addressed).
        let blob = format!("{i:08}").repeat(1400);
        let started = Instant::now();
        store.artifacts().put(blob.as_bytes())?;
        artifact_put_us.push(us(started.elapsed()));
    }

    let store_dir = survey.db.parent().context("the store has no directory")?;
    let probe = Git::open(&survey.workspace, &[])?;
    let excludes = keel_engine::keel_excludes(probe.root(), store_dir);
    let git = Git::open(&survey.workspace, &excludes)?;
    let base = git.worktree_tree()?;
    let (mut worktree_tree_us, mut head_us, mut branch_us, mut diff_us) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..samples.min(40) {
        let t = Instant::now();
        let tree = git.worktree_tree()?;
        worktree_tree_us.push(us(t.elapsed()));
        let t = Instant::now();
        git.head()?;
        head_us.push(us(t.elapsed()));
        let t = Instant::now();
        git.branch()?;
        branch_us.push(us(t.elapsed()));
        let t = Instant::now();
        git.diff(&base, &tree)?;
        diff_us.push(us(t.elapsed()));
    }
    Ok(Breakdown {
        commit_early_us,
        commit_late_us,
        late_steps,
        artifact_put_us,
        worktree_tree_us,
        head_us,
        branch_us,
        diff_us,
    })
}

/// A new run in the survey's store, created from the survey run's own `run_created` body.
fn new_run(store: &mut Store, created: &Event, template: &Template) -> Result<SynthRun> {
    let id = keel_engine::new_run_id();
    let event = Event {
        run_id: id.clone(),
        seq: 1,
        at_ms: keel_engine::now_ms(),
        body: created.body.clone(),
    };
    let run = Run::create(&event)?;
    let lease = store.create_run(&event, &run, "keel-bench", keel_engine::now_ms(), 3_600_000)?;
    Ok(SynthRun::new(run, lease, template.clone()))
}

/// Commits `steps` synthetic steps commit group by commit group; the time of each commit.
fn time_steps(store: &mut Store, run: &mut SynthRun, steps: usize) -> Result<Vec<f64>> {
    let mut times = Vec::new();
    for _ in 0..steps {
        for group in run.next_step()? {
            let started = Instant::now();
            run.commit(&mut Sink::Store(store), group)?;
            times.push(us(started.elapsed()));
        }
    }
    Ok(times)
}

impl Breakdown {
    /// The parts of one survey step, with the count of each per step, and how much of the
    /// measured step they explain.
    pub fn report(
        &self,
        survey: &Survey,
        step_median_us: f64,
        events_per_step: f64,
        commits_per_step: f64,
    ) -> Value {
        let artifacts_per_step = survey.artifact_files as f64 / survey.steps as f64;
        // Per step, finish_agent_step builds the working tree twice (once itself, once for the
        // fingerprint), reads HEAD and the branch for the fingerprint, and diffs the run's base
        // against the new tree (agent.rs, environment.rs).
        let git_us = 2.0 * median(&self.worktree_tree_us)
            + median(&self.head_us)
            + median(&self.branch_us)
            + median(&self.diff_us);
        let mid_steps = survey.steps as f64 / 2.0;
        // The commit cost grows with the run (see commit_us_late); a step of the survey run is on
        // average half way through it.
        let commit_mid = median(&self.commit_early_us)
            + (median(&self.commit_late_us) - median(&self.commit_early_us)) * mid_steps
                / self.late_steps as f64;
        let store_us = commits_per_step * commit_mid;
        let artifacts_us = artifacts_per_step * median(&self.artifact_put_us);
        let explained = store_us + artifacts_us + git_us;
        json!({
            "events_per_step": crate::util::round1(events_per_step),
            "commits_per_step": crate::util::round1(commits_per_step),
            "fsyncs_per_step_estimate": crate::util::round1(commits_per_step + 2.0 * artifacts_per_step),
            "artifact_files_per_step": crate::util::round1(artifacts_per_step),
            "git_per_step": {"worktree_tree": 2, "head": 1, "branch": 1, "diff": 1},
            "store_commit_us_early": summary(&self.commit_early_us),
            "store_commit_us_late": summary(&self.commit_late_us),
            "late_run_steps": self.late_steps,
            "artifact_put_us": summary(&self.artifact_put_us),
            "git_worktree_tree_us": summary(&self.worktree_tree_us),
            "git_head_us": summary(&self.head_us),
            "git_branch_us": summary(&self.branch_us),
            "git_diff_us": summary(&self.diff_us),
            "projection_bytes_at_end": survey.projection_bytes,
            "estimate_us_per_step": {
                "store_commits": crate::util::round1(store_us),
                "artifact_puts": crate::util::round1(artifacts_us),
                "git": crate::util::round1(git_us),
                "rest": crate::util::round1((step_median_us - explained).max(0.0)),
                "measured_step_median": crate::util::round1(step_median_us),
            },
            "note": "Each part timed alone after the survey run, on its workspace and store. \
                     commits_per_step counts the transactions the engine makes per step \
                     (one per step_started, model_requested, model_replied, policy_decision, \
                     tool_call_finished, and step_finished with step_verified when no step \
                     verifier runs between them); each is one fsync of \
                     the WAL. Each artifact is fsynced twice (the file, then its directory). \
                     store_commit_us_late is the same commit on a run that already has \
                     late_run_steps steps: every commit rewrites the whole projection (which \
                     lists every step) and every step row, so it grows with the run. `rest` is \
                     what the parts do not explain: prompt assembly and token counting, \
                     JSON, projection clones (Run::apply clones the run per event), the \
                     policy check and the tool."
        })
    }
}
