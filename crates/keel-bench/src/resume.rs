//! Resume time against log length.
//!
//! For each size a run is made through the engine (`keel_engine::start`, detached) on a
//! workspace of its own, its log is filled with synthetic `note` steps committed through
//! keel-store (see `synth.rs`) until it has about the wanted number of events, and then the
//! engine drives it for real with `keel_engine::resume`: the script's next answer is `finish`,
//! so the phase is verified and checkpointed (the newest checkpoint is now at the end of the
//! long log), and the second phase's first step asks a question, so the run waits. Each timed
//! resume is then `keel_engine::resume` of that waiting run: lease, newest checkpoint and the
//! events after it (checked and folded), contract, driver, the `resumed` commit and the drift
//! check, after which the run goes on waiting.
//!
//! Every size's run is built before any is timed, the machine's dirty pages are then written
//! out, and the timed resumes take turns across the sizes (one of each, then again). A resume
//! timed right after its log was built could wait for the kernel still writing that build out
//! ahead of its own `resumed` commit's sync, and a slow second of the machine now falls on one
//! sample of every size rather than on every sample of one.

use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result, ensure};
use keel_core::event::EventBody;
use keel_core::state::RunState;
use keel_engine::{Actor, DriverOverride, NewRun, Quiet, ResumeOptions};
use keel_store::Store;
use serde_json::{Value, json};

use crate::synth::{Sink, SynthRun, Template};
use crate::util::{self, median, ms, round1};

pub struct Resume {
    pub events: u64,
    pub resume_ms: Vec<f64>,
    pub build_s: f64,
    pub tail_events: u64,
    pub checkpoint_bytes: usize,
    pub projection_bytes: usize,
    pub script_bytes: u64,
}

impl Resume {
    pub fn report(&self) -> Value {
        json!({
            "events": self.events,
            "median_ms": round1(median(&self.resume_ms)),
            "samples_ms": self.resume_ms.iter().map(|m| round1(*m)).collect::<Vec<_>>(),
            "events_after_checkpoint": self.tail_events,
            "checkpoint_body_bytes": self.checkpoint_bytes,
            "projection_bytes": self.projection_bytes,
            "script_bytes": self.script_bytes,
            "build_s": round1(self.build_s),
        })
    }
}

/// A run waiting for its answer at the end of a log of about the wanted size, ready to be
/// resumed and timed.
pub struct Built {
    /// Holds the run's workspace and store until the measurement is done.
    _dir: tempfile::TempDir,
    store: Store,
    id: String,
    actor: Actor,
    build_s: f64,
    script_bytes: u64,
    resume_ms: Vec<f64>,
}

pub fn build(base: &Path, template: &Template, events: u64) -> Result<Built> {
    let built = Instant::now();
    let dir = tempfile::tempdir_in(base)?;
    let ws = dir.path().join("ws");
    util::workspace(&ws)?;
    // The synthetic steps' model calls come first in the script (their lines are never read:
    // their replies are in the log), then `finish`, then the question.
    let per_step = template.events_per_step() as u64;
    let steps = (events.saturating_sub(4) / per_step).max(1);
    let mut script = String::new();
    for i in 0..steps {
        script.push_str(&format!(
            "{{\"tool\":\"note\",\"args\":{{\"text\":\"synthetic {i}\"}}}}\n"
        ));
    }
    script.push_str("{\"tool\":\"finish\",\"args\":{\"summary\":\"surveyed\"}}\n");
    script.push_str(
        "{\"tool\":\"ask\",\"args\":{\"question\":\"Which file should be surveyed next?\"}}\n",
    );
    std::fs::write(ws.join("actions.jsonl"), &script)?;
    let contract_path = ws.join("keel.toml");
    std::fs::write(&contract_path, CONTRACT)?;
    util::git(&ws, &["add", "-A"])?;
    util::git(&ws, &["commit", "-q", "-m", "contract and script"])?;

    let contract = keel_engine::load_contract(&contract_path)?;
    let mut store = Store::open(&ws.join(".keel").join("keel.db"))?;
    let id = keel_engine::new_run_id();
    let actor = Actor::current();
    keel_engine::start(
        &mut store,
        NewRun {
            contract_path: &contract_path,
            contract,
            run_id: &id,
            choice: &DriverOverride::default(),
            detach: true,
        },
        &actor,
        &mut Quiet,
        &mut |_| {},
    )?;

    // The synthetic part, written as the engine would: the lease, a `resumed` record, steps.
    let lease = store.acquire(
        &id,
        &actor.holder,
        keel_engine::now_ms(),
        3_600_000,
        false,
        &|_| false,
    )?;
    let run = store.run(&id)?;
    let mut synth = SynthRun::new(run, lease.clone(), template.clone());
    synth.commit(
        &mut Sink::Store(&mut store),
        vec![EventBody::Resumed {
            holder: actor.holder.clone(),
            lease: lease.token,
            checkpoint: None,
        }],
    )?;
    let mut done = 0;
    while done < steps {
        let n = (steps - done).min(200) as usize;
        synth.commit_steps(&mut Sink::Store(&mut store), n)?;
        done += n as u64;
    }
    store.release(&lease)?;

    // The engine takes over: finish, verification, checkpoint, the question.
    let run = keel_engine::resume(
        &mut store,
        &id,
        &ResumeOptions::default(),
        &actor,
        &mut Quiet,
    )?;
    ensure!(
        run.state == RunState::Waiting,
        "the resume benchmark run should wait for its question, but it is {}: {}",
        run.state,
        run.reason
    );
    Ok(Built {
        _dir: dir,
        store,
        id,
        actor,
        build_s: built.elapsed().as_secs_f64(),
        script_bytes: script.len() as u64,
        resume_ms: Vec::new(),
    })
}

impl Built {
    /// Times one resume of the waiting run, which goes on waiting.
    pub fn resume_once(&mut self) -> Result<()> {
        let started = Instant::now();
        let run = keel_engine::resume(
            &mut self.store,
            &self.id,
            &ResumeOptions::default(),
            &self.actor,
            &mut Quiet,
        )?;
        self.resume_ms.push(ms(started.elapsed()));
        ensure!(
            run.state == RunState::Waiting,
            "a timed resume left the run {}: {}",
            run.state,
            run.reason
        );
        Ok(())
    }

    pub fn finish(self) -> Result<Resume> {
        let (last_seq, _) = self.store.log_head(&self.id)?;
        let checkpoint = self
            .store
            .newest_checkpoint(&self.id)?
            .context("the run has no checkpoint")?;
        Ok(Resume {
            events: last_seq,
            resume_ms: self.resume_ms,
            build_s: self.build_s,
            tail_events: last_seq - checkpoint.seq,
            checkpoint_bytes: checkpoint.body.len(),
            projection_bytes: serde_json::to_string(&self.store.run(&self.id)?)?.len(),
            script_bytes: self.script_bytes,
        })
    }
}

const CONTRACT: &str = r#"[task]
goal = "Survey the five files and keep notes on them, then ask what is next."

[driver]
kind = "script"
script = "actions.jsonl"
context_tokens = 4000

[scope]
writable = ["notes/**"]

[[verify]]
name = "files"
tier = "acceptance"
run = "test -f file0.txt && test -f file4.txt"

[[phase]]
name = "survey"
kind = "agent"
objective = "Read the files, keep notes, then finish."
tools = ["read", "note", "plan", "finish"]

[[phase]]
name = "next"
kind = "agent"
objective = "Ask a person which file to survey next."
tools = ["ask", "finish"]
"#;
