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
    /// The parts of one survey step, with the count of each per step (counted during the
    /// survey run), and how much of the measured step they explain.
    pub fn report(&self, survey: &Survey, step_median_us: f64, events_per_step: f64) -> Value {
        let steps = survey.steps as f64;
        let artifact_files_per_step = survey.artifact_files as f64 / steps;
        let blobs_per_step = survey.stored_blobs as f64 / steps;
        // Counted over the whole run (its start and acceptance too): at most this many.
        let commits_per_step = survey.commits as f64 / steps;
        // Counted between the first and the last step's start.
        let git_per_step = survey.git_processes as f64 / (steps - 1.0).max(1.0);
        // One git process costs about what one `git rev-parse HEAD` does.
        let git_us = git_per_step * median(&self.head_us);
        let mid_steps = steps / 2.0;
        // Should the commit cost grow with the run (commit_us_late against _early), a step of the
        // survey run is on average half way through it.
        let commit_mid = median(&self.commit_early_us)
            + (median(&self.commit_late_us) - median(&self.commit_early_us)) * mid_steps
                / self.late_steps as f64;
        let store_us = commits_per_step * commit_mid;
        let artifacts_us = artifact_files_per_step * median(&self.artifact_put_us);
        let explained = store_us + artifacts_us + git_us;
        json!({
            "events_per_step": crate::util::round1(events_per_step),
            "commits_per_step_at_most": crate::util::round1(commits_per_step),
            "artifact_files_per_step": crate::util::round1(artifact_files_per_step),
            "stored_blobs_per_step": crate::util::round1(blobs_per_step),
            "git_processes_per_step": crate::util::round1(git_per_step),
            "store_commit_us_early": summary(&self.commit_early_us),
            "store_commit_us_late": summary(&self.commit_late_us),
            "late_run_steps": self.late_steps,
            "artifact_file_put_us": summary(&self.artifact_put_us),
            "git_worktree_tree_us": summary(&self.worktree_tree_us),
            "git_head_us": summary(&self.head_us),
            "git_branch_us": summary(&self.branch_us),
            "git_diff_us": summary(&self.diff_us),
            "projection_bytes_at_end": survey.projection_bytes,
            "estimate_us_per_step": {
                "store_commits": crate::util::round1(store_us),
                "artifact_files": crate::util::round1(artifacts_us),
                "git": crate::util::round1(git_us),
                "rest": crate::util::round1((step_median_us - explained).max(0.0)),
                "measured_step_median": crate::util::round1(step_median_us),
            },
            "note": "Counts are taken during the survey run: commits_per_step_at_most is the \
                     engine's event commits over the whole run divided by its steps (a step \
                     that only reads is one commit: its events wait in memory until the step \
                     ends, see `staged` in keel-engine); git_processes_per_step counts the git \
                     processes keel started between the first and last step; small artifacts \
                     (the request, the reply, the step's output) are stored in the row of the \
                     commit's events (keel-store's `log` table), larger ones as fsynced files. Each part \
                     is then timed alone on the survey's workspace and store. \
                     store_commit_us_early and _late time one synthetic step's commit on a \
                     short run and on one with late_run_steps steps: a commit writes the \
                     step's events and small artifacts (one `log` row) and changed rows, and the projection (which holds \
                     an agent phase's newest 32 steps) only now and then, so the two should \
                     be close. `rest` is what the parts do not explain: prompt assembly and \
                     token counting, JSON, hashing, the policy check and the tool (0 when the \
                     synthetic commit, which compresses and hashes its own request, costs as \
                     much as a whole step)."
        })
    }
}
