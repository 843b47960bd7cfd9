//! Synthetic but valid agent steps, for building long logs fast and for measuring the store
//! alone.
//!
//! The template is one real `note` step taken from the survey run's log (the events the engine
//! committed, with their real sizes). A synthetic step is that template with its step number,
//! command, signature (unique, so loop detection sees no repeat) and post-step fingerprint (the
//! run's own base: a note changes nothing) set for the run it joins. Each event is folded with
//! `Run::apply` before it is committed, and the store checks token, log head and chain as for
//! any commit, so the log is one the engine would accept. A step is one commit, as the engine
//! makes it for a step that only reads (`agent.rs`: its events are staged until the step ends).

use anyhow::{Context, Result, bail, ensure};
use keel_core::event::{EventBody, StepId};
use keel_core::run::Run;
use keel_core::state::RunState;
use keel_store::{Lease, Store, StoredEvent};
use serde_json::{Value, json};

/// The event kinds of one `note` step, in order.
const NOTE_STEP: [&str; 8] = [
    "step_started",
    "model_requested",
    "model_replied",
    "policy_decision",
    "note_added",
    "tool_call_finished",
    "step_finished",
    "step_verified",
];

/// One real `note` step's event bodies, as JSON.
#[derive(Clone)]
pub struct Template {
    bodies: Vec<Value>,
}

impl Template {
    /// The first complete `note` step at or after `from_step` (0-based) in `events`.
    pub fn from_log(events: &[StoredEvent], from_step: usize) -> Result<Template> {
        let mut seen = 0usize;
        for (i, e) in events.iter().enumerate() {
            if e.kind != "step_started" {
                continue;
            }
            seen += 1;
            if seen <= from_step {
                continue;
            }
            let window = events.get(i..i + NOTE_STEP.len());
            if let Some(w) = window
                && w.iter()
                    .map(|e| e.kind.as_str())
                    .eq(NOTE_STEP.iter().copied())
            {
                let bodies = w
                    .iter()
                    .map(|e| serde_json::from_str(&e.body))
                    .collect::<Result<Vec<Value>, _>>()
                    .context("a stored event body is not JSON")?;
                return Ok(Template { bodies });
            }
        }
        bail!("the survey log has no complete note step after step {from_step}")
    }

    pub fn events_per_step(&self) -> usize {
        self.bodies.len()
    }

    /// The bodies of step `id` of `run`, grouped by commit.
    fn step(&self, run: &Run, id: StepId) -> Result<Vec<Vec<EventBody>>> {
        let step = json!({"phase": id.phase, "index": id.index});
        let base = serde_json::to_value(&run.base)?;
        let signature =
            blake3::hash(format!("{}:{id}", run.id).as_bytes()).to_hex()[..16].to_string();
        let mut groups: Vec<Vec<EventBody>> = Vec::new();
        for template in &self.bodies {
            let mut body = template.clone();
            let kind = body["kind"].as_str().unwrap_or_default().to_string();
            body["step"] = step.clone();
            match kind.as_str() {
                "step_started" => {
                    body["command"] = json!(format!("agent step {}", id.index + 1));
                    body["attempt"] = json!(1);
                }
                "step_finished" => {
                    body["signature"] = json!(signature);
                    body["post"] = base.clone();
                    body["files_written"] = json!(0);
                    body["diff_files"] = json!(0);
                    body["diff_lines"] = json!(0);
                }
                _ => {}
            }
            let body: EventBody = serde_json::from_value(body)
                .with_context(|| format!("a synthetic {kind} event does not decode"))?;
            match groups.last_mut() {
                Some(last) => last.push(body),
                None => groups.push(vec![body]),
            }
        }
        Ok(groups)
    }
}

/// Where a synthetic run's commits go.
pub enum Sink<'a> {
    Store(&'a mut Store),
}

/// A run written to directly through the store, a step at a time.
pub struct SynthRun {
    pub run: Run,
    pub lease: Lease,
    template: Template,
}

impl SynthRun {
    pub fn new(run: Run, lease: Lease, template: Template) -> SynthRun {
        SynthRun {
            run,
            lease,
            template,
        }
    }

    /// The bodies of the run's next step, grouped by commit.
    pub fn next_step(&self) -> Result<Vec<Vec<EventBody>>> {
        next_step(&self.template, &self.run)
    }

    /// Folds `bodies` into the run and commits them (one transaction).
    pub fn commit(&mut self, sink: &mut Sink<'_>, bodies: Vec<EventBody>) -> Result<()> {
        let at_ms = keel_engine::now_ms();
        let mut next = self.run.clone();
        let mut events = Vec::with_capacity(bodies.len());
        for body in bodies {
            let event = next.next_event(at_ms, body);
            next.apply_in_place(&event)
                .with_context(|| format!("synthetic event {} refused", event.seq))?;
            events.push(event);
        }
        let until = at_ms + 3_600_000;
        match sink {
            Sink::Store(store) => store.commit(&self.lease, &events, &next, None, until)?,
        }
        self.run = next;
        Ok(())
    }

    /// `steps` whole steps in one commit (for building a long log fast).
    pub fn commit_steps(&mut self, sink: &mut Sink<'_>, steps: usize) -> Result<()> {
        // The steps are folded one after the other, so each sees the run the previous left.
        let mut next = self.run.clone();
        let mut events = Vec::new();
        let at_ms = keel_engine::now_ms();
        for _ in 0..steps {
            for body in next_step(&self.template, &next)?.into_iter().flatten() {
                let event = next.next_event(at_ms, body);
                next.apply_in_place(&event)
                    .with_context(|| format!("synthetic event {} refused", event.seq))?;
                events.push(event);
            }
        }
        let until = at_ms + 3_600_000;
        match sink {
            Sink::Store(store) => store.commit(&self.lease, &events, &next, None, until)?,
        }
        self.run = next;
        Ok(())
    }
}

/// The bodies of `run`'s next step, grouped by commit; the first group also moves the run to
/// `executing` and starts the phase when the engine would.
fn next_step(template: &Template, run: &Run) -> Result<Vec<Vec<EventBody>>> {
    let phase = run.cursor;
    let progress = run
        .phases
        .get(phase as usize)
        .context("the run has no phase left")?;
    ensure!(progress.agent, "synthetic steps belong to an agent phase");
    let id = StepId {
        phase,
        index: progress.step_count(),
    };
    let mut groups = template.step(run, id)?;
    let mut first = Vec::new();
    if run.state != RunState::Executing {
        first.push(EventBody::StateChanged {
            from: run.state,
            to: RunState::Executing,
            reason: "working on the next step".into(),
            block: None,
        });
    }
    if progress.step_count() == 0 {
        first.push(EventBody::PhaseStarted {
            phase,
            name: progress.name.clone(),
        });
    }
    if let Some(g) = groups.first_mut() {
        first.append(g);
        *g = first;
    }
    Ok(groups)
}
