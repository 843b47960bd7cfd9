//! Seeded simulation of keel's run machine under faults.
//!
//! One seed makes everything: the scenario (phases: command phases with one to three steps,
//! agent phases whose scripted driver plans, notes, writes and calls an external service with
//! the call's idempotency key, some phases behind a person's approval), a fake clock, and the
//! faults: a crash at any commit (the batch lost, or durable but unacknowledged, like an
//! fsync error after the write), a command that fails once, approval decisions delivered one to
//! three times and late, after the run moved on. A simulated process follows exactly what
//! `Run::next` says, as keel-engine does, and commits the events the engine commits for each
//! move, in the same batches; after a crash, a new process folds the durable log (the store's
//! state) and carries on; the external service applies each key at most once.
//!
//! Every seed's log must keep every invariant of `keel_core::invariant`, the service must have
//! applied each key at most once and each `done` effect exactly once, and the run must end
//! where the same scenario without faults ends ([`Outcome`]). `KEEL_SIM_SEEDS=N` runs N seeds
//! (default 300); `KEEL_SIM_SEED=S` replays one. A failure prints its seed and the trace of
//! moves, and replays exactly: nothing depends on time or on the order of a hash map.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;

use keel_core::agent::{ModelReply, Reversibility, ToolCall, Usage};
use keel_core::budget::BudgetLimits;
use keel_core::contract::Tier;
use keel_core::event::{
    ApprovalRequest, Decision, EffectStatus, Event, EventBody, Evidence, Gate, PhaseOutline,
    StepId, effect_key,
};
use keel_core::fingerprint::Fingerprint;
use keel_core::invariant::{self, Outcome};
use keel_core::run::{Next, Run};
use keel_core::state::RunState;
use keel_test_support::rng::SplitMix as Rng;

const RUN: &str = "0193sim";

/// One tool call of a scripted reply.
#[derive(Debug, Clone)]
enum Call {
    Plan(Vec<String>),
    Note(String),
    Write(String),
    /// A call to the external service with the call's idempotency key.
    Apply(String),
    Finish,
}

#[derive(Debug, Clone)]
enum PhaseSpec {
    Command { steps: u32, flaky: Option<u32> },
    Agent { replies: Vec<Vec<Call>> },
}

#[derive(Debug, Clone)]
struct Scenario {
    phases: Vec<(PhaseSpec, bool)>,
}

impl Scenario {
    fn generate(rng: &mut Rng) -> Scenario {
        let n = 1 + rng.below(3) as usize;
        let mut phases = Vec::new();
        for p in 0..n {
            let gated = rng.chance(35);
            let spec = if rng.chance(50) {
                let steps = 1 + rng.below(3) as u32;
                let flaky = rng.chance(30).then(|| rng.below(u64::from(steps)) as u32);
                PhaseSpec::Command { steps, flaky }
            } else {
                let mut replies = Vec::new();
                for r in 0..1 + rng.below(3) {
                    let mut calls = Vec::new();
                    for c in 0..1 + rng.below(2) {
                        calls.push(match rng.below(4) {
                            0 => Call::Plan(vec![format!("p{p} r{r}"), "finish".into()]),
                            1 => Call::Note(format!("note {p}.{r}.{c}")),
                            2 => Call::Write(format!("f{p}-{r}-{c}.txt")),
                            _ => Call::Apply(format!("item {p}.{r}.{c}")),
                        });
                    }
                    replies.push(calls);
                }
                replies.last_mut().unwrap().push(Call::Finish);
                PhaseSpec::Agent { replies }
            };
            phases.push((spec, gated));
        }
        Scenario { phases }
    }
}

#[derive(Debug, Clone, Copy)]
struct Faults {
    /// Percent chance that a commit crashes the process (half before the batch is durable,
    /// half after).
    crash: u64,
    /// Whether flaky commands fail (once).
    flaky: bool,
    /// Deliver each decision one to three times, some late.
    redeliver: bool,
}

/// The external service: applications per idempotency key (a repeated key is not applied again).
#[derive(Default)]
struct Service {
    applied: BTreeMap<String, u64>,
}

/// What ends a simulated process.
#[derive(Debug)]
enum Stop {
    Crashed,
    Waiting,
    Ended,
}

struct World {
    scenario: Scenario,
    faults: Faults,
    rng: Rng,
    clock_ms: i64,
    durable: Vec<Event>,
    run: Option<Run>,
    service: Service,
    /// Decisions still to be delivered: (request n, payload hash).
    deliveries: Vec<(u32, String)>,
    /// Steps whose one failure has happened.
    failed_once: Vec<StepId>,
    crashes: u32,
    trace: Vec<String>,
    /// The tree of the workspace (a counter of writes, as a hex id).
    tree: u64,
}

fn tree_id(n: u64) -> String {
    format!("{n:040x}")
}

impl World {
    fn new(seed: u64, faults: Faults) -> World {
        let mut rng = Rng(seed);
        let scenario = Scenario::generate(&mut rng);
        World {
            scenario,
            faults,
            rng: Rng(seed ^ 0xFA17),
            clock_ms: 1_000_000,
            durable: Vec::new(),
            run: None,
            service: Service::default(),
            deliveries: Vec::new(),
            failed_once: Vec::new(),
            crashes: 0,
            trace: Vec::new(),
            tree: 0,
        }
    }

    fn run(&self) -> &Run {
        self.run.as_ref().expect("a process has the run")
    }

    /// Appends a batch the way keel-engine does: applied to a copy first (an illegal event is a
    /// bug in this simulation or in the fold, and fails loudly), then durable, then acknowledged.
    /// A crash loses the batch or only the acknowledgement.
    fn commit(&mut self, bodies: Vec<EventBody>) -> Result<(), Stop> {
        self.clock_ms += 1 + self.rng.below(400) as i64;
        let mut next = self.run.clone();
        let mut events = Vec::new();
        for body in bodies {
            let seq = self.durable.len() as u64 + events.len() as u64 + 1;
            let event = Event {
                run_id: RUN.into(),
                seq,
                at_ms: self.clock_ms,
                body,
            };
            match &mut next {
                None => next = Some(Run::create(&event).expect("run_created folds")),
                Some(run) => run.apply(&event).unwrap_or_else(|e| {
                    panic!(
                        "event {seq} ({}) does not fold: {e}\ntrace:\n{}",
                        event.body.kind(),
                        self.trace.join("\n")
                    )
                }),
            }
            events.push(event);
        }
        let kinds: Vec<&str> = events.iter().map(|e| e.body.kind()).collect();
        if self.crashes < 12 && self.rng.chance(self.faults.crash) {
            self.crashes += 1;
            if self.rng.chance(50) {
                self.trace
                    .push(format!("crash before {kinds:?} was durable"));
            } else {
                self.durable.extend(events);
                self.trace
                    .push(format!("crash after {kinds:?} was durable, before the ack"));
            }
            self.run = None;
            return Err(Stop::Crashed);
        }
        self.trace.push(format!("commit {kinds:?}"));
        self.durable.extend(events);
        self.run = next;
        Ok(())
    }

    fn outline(&self) -> Vec<PhaseOutline> {
        self.scenario
            .phases
            .iter()
            .enumerate()
            .map(|(i, (spec, gated))| PhaseOutline {
                name: format!("phase{i}"),
                commands: match spec {
                    PhaseSpec::Command { steps, .. } => {
                        (0..*steps).map(|s| format!("cmd {i}.{s}")).collect()
                    }
                    PhaseSpec::Agent { .. } => Vec::new(),
                },
                agent: matches!(spec, PhaseSpec::Agent { .. }),
                approval: *gated,
            })
            .collect()
    }

    fn fingerprint(&self) -> Fingerprint {
        Fingerprint {
            tree: tree_id(self.tree),
            ..Fingerprint::default()
        }
    }

    fn evidence(&self, verifier: &str, tier: Tier, passed: bool, step: Option<StepId>) -> Evidence {
        let run = self.run();
        Evidence {
            n: run.evidence_count + 1,
            verifier: verifier.into(),
            tier,
            command: format!("check {verifier}"),
            passed,
            status: if passed { "exit 0" } else { "exit 1" }.into(),
            duration_ms: 5,
            cpu_ms: 2,
            output: format!("out-{}", run.evidence_count + 1),
            tree: run.fingerprint.tree.clone(),
            fingerprint: "fp".into(),
            step,
            phase: None,
            excerpt: (!passed).then(|| "failed".into()),
        }
    }

    /// One process: `keel run` (creates the run) or `keel resume`, until it crashes, waits for
    /// a person, or the run ends.
    fn process(&mut self) -> Stop {
        match self.drive() {
            Ok(stop) | Err(stop) => stop,
        }
    }

    fn drive(&mut self) -> Result<Stop, Stop> {
        if self.durable.is_empty() {
            self.trace.push("process: keel run".into());
            let mut limits = BudgetLimits::default();
            limits.set(keel_core::budget::BudgetName::Steps, 1000);
            self.commit(vec![EventBody::RunCreated {
                contract_hash: "contract".into(),
                contract_file: "keel.toml".into(),
                workspace: "/sim".into(),
                phases: self.outline(),
                acceptance: vec!["accept".into()],
                limits,
                base: self.fingerprint(),
                keel_version: "sim".into(),
                driver: None,
                sandbox_off: false,
            }])?;
        } else {
            self.trace.push("process: keel resume".into());
            self.run = Some(fold(&self.durable));
            // A run that ended (its last commit durable, the acknowledgement lost) is not
            // resumed: `keel resume` reports it as it is.
            if self.run().state.is_terminal() {
                return Ok(Stop::Ended);
            }
            let lease = self.run().lease + 1;
            self.commit(vec![EventBody::Resumed {
                holder: "sim".into(),
                lease,
                checkpoint: None,
            }])?;
            if self.run().state == RunState::AwaitingApproval && !self.settle_approval()? {
                return Ok(Stop::Waiting);
            }
        }
        loop {
            let next = self.run().next();
            match next {
                Next::Stop => {
                    return Ok(if self.run().state.is_terminal() {
                        Stop::Ended
                    } else {
                        Stop::Waiting
                    });
                }
                Next::Checkpoint => {
                    let n = self.run().checkpoints;
                    self.commit(vec![EventBody::CheckpointTaken {
                        n,
                        hash: format!("ck{n}"),
                        snapshot_ref: format!("refs/keel/{RUN}/{n}"),
                        commit: tree_id(self.tree),
                    }])?
                }
                Next::RequestApproval(phase) => self.request_approval(phase)?,
                Next::Recover(step) if self.is_agent(step.phase) => self.agent_step(step)?,
                Next::Recover(step) => {
                    // The interrupted command's changes are undone.
                    let pre = self.run().in_progress.as_ref().unwrap().pre.tree.clone();
                    self.tree = u64::from_str_radix(&pre, 16).unwrap();
                    self.commit(vec![EventBody::StepRolledBack {
                        step,
                        restored: Vec::new(),
                        saved_ref: None,
                    }])?
                }
                Next::Step(step) if self.is_agent(step.phase) => self.agent_step(step)?,
                Next::Step(step) => self.command_step(step)?,
                Next::VerifyPhase(phase) => self.verify_phase(phase)?,
                Next::Accept => {
                    self.set_state(RunState::Verifying)?;
                    let e = self.evidence("accept", Tier::Acceptance, true, None);
                    self.commit(vec![EventBody::EvidenceRecorded { evidence: e }])?;
                    if self.run().accepted() {
                        self.set_state(RunState::Completed)?;
                    }
                }
                Next::Complete => self.set_state(RunState::Completed)?,
            }
        }
    }

    fn is_agent(&self, phase: u32) -> bool {
        matches!(
            self.scenario.phases[phase as usize].0,
            PhaseSpec::Agent { .. }
        )
    }

    fn state_change(&self, to: RunState) -> EventBody {
        EventBody::StateChanged {
            from: self.run().state,
            to,
            reason: format!("to {to}"),
            block: None,
        }
    }

    fn set_state(&mut self, to: RunState) -> Result<(), Stop> {
        if self.run().state == to {
            return Ok(());
        }
        self.commit(vec![self.state_change(to)])
    }

    /// The first batch of a step: to executing, the phase's start, the step's start.
    fn start_step(&mut self, step: StepId, agent: bool) -> Result<(), Stop> {
        let run = self.run();
        let mut bodies = Vec::new();
        if run.state != RunState::Executing {
            bodies.push(self.state_change(RunState::Executing));
        }
        let phase = &run.phases[step.phase as usize];
        if phase.steps.iter().all(|s| s.attempts == 0) {
            bodies.push(EventBody::PhaseStarted {
                phase: step.phase,
                name: phase.name.clone(),
            });
        }
        let attempt = run.step(step).map_or(0, |s| s.attempts) + 1;
        bodies.push(EventBody::StepStarted {
            step,
            attempt,
            command: if agent {
                "agent".into()
            } else {
                format!("cmd {}.{}", step.phase, step.index)
            },
            agent,
        });
        self.commit(bodies)
    }

    fn finished(&self, step: StepId, signature: Option<String>, ok: bool) -> EventBody {
        EventBody::StepFinished {
            step,
            signature,
            status: if ok { "exit 0" } else { "exit 1" }.into(),
            success: ok,
            duration_ms: 3,
            cpu_ms: 1,
            output: format!("out {step}"),
            post: self.fingerprint(),
            files_written: 0,
            diff_files: 0,
            diff_lines: 0,
        }
    }

    fn command_step(&mut self, step: StepId) -> Result<(), Stop> {
        self.start_step(step, false)?;
        let PhaseSpec::Command { flaky, .. } = self.scenario.phases[step.phase as usize].0 else {
            unreachable!("a command step of a command phase")
        };
        let fails =
            self.faults.flaky && flaky == Some(step.index) && !self.failed_once.contains(&step);
        if fails {
            self.failed_once.push(step);
            self.commit(vec![self.finished(step, None, false)])?;
            return self.commit(vec![EventBody::StepFailed {
                step,
                reason: "exit 1".into(),
                error_fingerprint: format!("fp {step}"),
                excerpt: "failed".into(),
                rolled_back: Vec::new(),
                kept: false,
            }]);
        }
        self.tree += 1;
        self.commit(vec![self.finished(step, None, true)])?;
        self.commit(vec![EventBody::StepVerified { step }])
    }

    fn verify_phase(&mut self, phase: u32) -> Result<(), Stop> {
        self.set_state(RunState::Verifying)?;
        let e = self.evidence(&format!("gate{phase}"), Tier::Phase, true, None);
        self.commit(vec![EventBody::EvidenceRecorded { evidence: e }])?;
        self.commit(vec![EventBody::PhaseVerified { phase }])
    }

    fn request_approval(&mut self, phase: u32) -> Result<(), Stop> {
        let run = self.run();
        let n = run.approvals.len() as u32 + 1;
        let payload = format!(
            "phase {phase}: {:?}",
            self.outline()[phase as usize].commands
        );
        let hash = ApprovalRequest::hash_payload(&payload);
        let request = ApprovalRequest {
            n,
            gate: Gate::Phase { phase },
            intent: format!("Run phase {phase}."),
            payload,
            payload_hash: hash.clone(),
            checks: Vec::new(),
            risk: "reversible".into(),
            reversibility: Reversibility::Reversible,
            rollback: "restore the checkpoint".into(),
            created_at_ms: self.clock_ms,
            expires_at_ms: None,
            on_expiry: None,
        };
        self.commit(vec![
            EventBody::ApprovalRequested { request },
            self.state_change(RunState::AwaitingApproval),
        ])?;
        let n = self.run().checkpoints;
        self.commit(vec![EventBody::CheckpointTaken {
            n,
            hash: format!("ck{n}"),
            snapshot_ref: format!("refs/keel/{RUN}/{n}"),
            commit: tree_id(self.tree),
        }])
    }

    /// On resume of a run awaiting approval: an approval that arrived moves it on.
    fn settle_approval(&mut self) -> Result<bool, Stop> {
        let decided = self
            .run()
            .approvals
            .last()
            .is_some_and(|a| a.decision.as_ref().is_some_and(|d| d.approve));
        if decided {
            self.set_state(RunState::Executing)?;
        }
        Ok(decided)
    }

    /// A person's decision arriving (from another process, as `keel approve` does): the first
    /// for a request counts; a repeat, or one for a request already decided, changes nothing.
    /// Returns whether it was recorded.
    fn deliver(&mut self, n: u32, hash: &str) -> bool {
        let mut run = fold(&self.durable);
        let Some(approval) = run.approvals.get(n as usize - 1) else {
            return false;
        };
        if approval.decision.is_some() || approval.request.payload_hash != hash {
            return false;
        }
        self.clock_ms += 1 + self.rng.below(100_000) as i64;
        let event = Event {
            run_id: RUN.into(),
            seq: run.seq + 1,
            at_ms: self.clock_ms,
            body: EventBody::ApprovalDecided {
                n,
                approve: true,
                payload_hash: hash.into(),
                by: "person".into(),
                reason: "go".into(),
                via: "cli".into(),
            },
        };
        run.apply(&event).unwrap();
        self.trace
            .push(format!("decision for request {n} recorded"));
        self.durable.push(event);
        true
    }

    fn reply(&self, step: StepId) -> Vec<Call> {
        let PhaseSpec::Agent { replies } = &self.scenario.phases[step.phase as usize].0 else {
            unreachable!("an agent step of an agent phase")
        };
        replies
            .get(step.index as usize)
            .cloned()
            .unwrap_or_else(|| vec![Call::Finish])
    }

    /// An agent step, or the rest of one a crash interrupted: keel-engine's order.
    fn agent_step(&mut self, step: StepId) -> Result<(), Stop> {
        let in_progress = self
            .run()
            .in_progress
            .as_ref()
            .is_some_and(|p| p.step == step);
        if !in_progress {
            self.start_step(step, true)?;
        }
        // Back to the tree the recorded calls left (the engine restores it on resume).
        let (expected, _) = self.run().expected_tree();
        self.tree = u64::from_str_radix(&expected, 16).unwrap();
        let calls = self.reply(step);
        let p = self.run().in_progress.clone().unwrap();
        if p.request.is_none() {
            self.commit(vec![EventBody::ModelRequested {
                step,
                request: format!("request {step}"),
                prompt_tokens: 100,
                context_tokens: 4000,
            }])?;
        }
        if self.run().in_progress.as_ref().unwrap().reply.is_none() {
            let reply = ModelReply {
                text: None,
                calls: calls
                    .iter()
                    .enumerate()
                    .map(|(i, c)| ToolCall {
                        id: i.to_string(),
                        name: tool_name(c).into(),
                        arguments: arguments(c),
                    })
                    .collect(),
                usage: Usage {
                    input_tokens: 100,
                    output_tokens: 10,
                },
                stop_reason: None,
            };
            self.commit(vec![EventBody::ModelReplied {
                step,
                response: format!("response {step}"),
                usage: reply.usage,
                reply,
                cost_micro_usd: 7,
                retries: Vec::new(),
                duration_ms: 50,
                post_tree: Some(tree_id(self.tree)),
            }])?;
        }
        for (i, call) in calls.iter().enumerate() {
            let i = i as u32;
            let recorded = self
                .run()
                .in_progress
                .as_ref()
                .unwrap()
                .calls
                .get(i as usize)
                .cloned();
            if recorded.as_ref().is_some_and(|c| c.finished) {
                continue;
            }
            let key = effect_key(RUN, step, i);
            if recorded.is_none() {
                let mut bodies = vec![EventBody::PolicyDecision {
                    step,
                    call: i,
                    tool: tool_name(call).into(),
                    arguments: arguments(call),
                    decision: Decision::Allow,
                    rule: "allowed".into(),
                    reversibility: reversibility(call),
                    pre_tree: matches!(call, Call::Write(_)).then(|| tree_id(self.tree)),
                    error_fingerprint: None,
                }];
                if let Call::Apply(item) = call {
                    bodies.push(EventBody::EffectIntended {
                        step,
                        call: i,
                        key: key.clone(),
                        tool: "apply".into(),
                        class: Reversibility::Irreversible,
                        keyed: true,
                        payload: item.clone(),
                        compensation: None,
                    });
                }
                self.commit(bodies)?;
            }
            // The call itself. A keyed effect is made again with its key after a crash; the
            // service applies a key once.
            let mut changed = Vec::new();
            match call {
                Call::Apply(_) => {
                    self.service.applied.entry(key.clone()).or_insert(1);
                }
                Call::Write(path) => {
                    self.tree += 1;
                    changed.push(path.clone());
                }
                _ => {}
            }
            let mut bodies = vec![EventBody::ToolCallFinished {
                step,
                call: i,
                ok: true,
                observation: format!("{} ok", tool_name(call)),
                output: None,
                changed,
                error_fingerprint: None,
                post_tree: matches!(call, Call::Write(_)).then(|| tree_id(self.tree)),
            }];
            match call {
                Call::Apply(_) => bodies.push(EventBody::EffectSettled {
                    step,
                    call: i,
                    key,
                    status: EffectStatus::Done,
                    detail: "applied".into(),
                }),
                Call::Plan(items) => bodies.push(EventBody::PlanUpdated {
                    step,
                    items: items.clone(),
                }),
                Call::Note(text) => bodies.push(EventBody::NoteAdded {
                    step,
                    text: text.clone(),
                }),
                Call::Finish => bodies.push(EventBody::FinishClaimed {
                    step,
                    summary: "done".into(),
                }),
                Call::Write(_) => {}
            }
            self.commit(bodies)?;
        }
        // No step verifier runs for these steps: the engine records the end and the
        // verification in one commit.
        let signature = format!("sig {step}");
        self.commit(vec![
            self.finished(step, Some(signature), true),
            EventBody::StepVerified { step },
        ])
    }

    /// Runs processes until the run ends, delivering decisions between them (and, with
    /// redelivery, some late: after the run has gone on).
    fn play(&mut self) {
        for _ in 0..200 {
            match self.process() {
                Stop::Ended => {
                    // Late duplicates still arrive and must change nothing.
                    let late: Vec<_> = std::mem::take(&mut self.deliveries);
                    for (n, hash) in late {
                        assert!(
                            !self.deliver(n, &hash),
                            "a late decision for request {n} was recorded after the run ended"
                        );
                    }
                    return;
                }
                Stop::Crashed => {}
                Stop::Waiting => {
                    // A person reads the request from the store (as `keel approvals` does) and
                    // decides; with redelivery, the decision arrives one to three times.
                    let run = fold(&self.durable);
                    if let Some(a) = run.approvals.iter().find(|a| a.decision.is_none()) {
                        let copies = if self.faults.redeliver {
                            1 + self.rng.below(3)
                        } else {
                            1
                        };
                        for _ in 0..copies {
                            self.deliveries
                                .push((a.request.n, a.request.payload_hash.clone()));
                        }
                    }
                    let pending: Vec<_> = std::mem::take(&mut self.deliveries);
                    let mut recorded = 0;
                    for (i, (n, hash)) in pending.iter().enumerate() {
                        // Some copies are held back and delivered after the next process.
                        if self.faults.redeliver && i > 0 && self.rng.chance(40) {
                            self.deliveries.push((*n, hash.clone()));
                            continue;
                        }
                        recorded += u32::from(self.deliver(*n, hash));
                    }
                    assert!(recorded <= 1, "one decision per request is recorded");
                }
            }
        }
        panic!(
            "the run did not end after 200 processes\n{}",
            self.trace.join("\n")
        );
    }
}

/// The state a log folds to (the store's projection).
fn fold(events: &[Event]) -> Run {
    let mut run = Run::create(&events[0]).unwrap();
    for e in &events[1..] {
        run.apply(e).unwrap();
    }
    run
}

fn tool_name(call: &Call) -> &'static str {
    match call {
        Call::Plan(_) => "plan",
        Call::Note(_) => "note",
        Call::Write(_) => "write",
        Call::Apply(_) => "apply",
        Call::Finish => "finish",
    }
}

fn arguments(call: &Call) -> String {
    match call {
        Call::Plan(items) => serde_json::json!({ "items": items }),
        Call::Note(text) => serde_json::json!({ "text": text }),
        Call::Write(path) => serde_json::json!({ "path": path, "content": "x" }),
        Call::Apply(item) => serde_json::json!({ "item": item }),
        Call::Finish => serde_json::json!({ "summary": "done" }),
    }
    .to_string()
}

fn reversibility(call: &Call) -> Reversibility {
    match call {
        Call::Write(_) => Reversibility::Reversible,
        Call::Apply(_) => Reversibility::Irreversible,
        _ => Reversibility::ReadOnly,
    }
}

/// Plays one seed with faults and without, and checks everything. Returns the number of crashes.
fn check_seed(seed: u64) -> u32 {
    let faults = Faults {
        crash: 8 + seed % 20,
        flaky: true,
        redeliver: true,
    };
    let calm = Faults {
        crash: 0,
        flaky: true,
        redeliver: false,
    };
    let mut reference = World::new(seed, calm);
    reference.play();
    let mut world = World::new(seed, faults);
    world.play();
    let explain = |w: &World| {
        format!(
            "seed {seed} (replay: KEEL_SIM_SEED={seed} cargo test -p keel-core --test simulation)\nscenario: {:?}\ntrace:\n{}",
            w.scenario.phases,
            w.trace.join("\n")
        )
    };
    let audit = invariant::check(&world.durable).unwrap_or_else(|v| {
        panic!(
            "{}\ninvariants broken:\n{}",
            explain(&world),
            v.iter()
                .map(|v| v.to_string())
                .collect::<Vec<_>>()
                .join("\n")
        )
    });
    let applied = invariant::check_applied(&audit.effects, &world.service.applied);
    assert!(applied.is_empty(), "{}\n{applied:?}", explain(&world));
    let expected = Outcome::of(&invariant::check(&reference.durable).unwrap());
    let got = Outcome::of(&audit);
    let differences = got.differences(&expected);
    assert!(
        differences.is_empty(),
        "{}\nthe outcome differs from the run without faults:\n{}",
        explain(&world),
        differences.join("\n")
    );
    assert_eq!(audit.run.state, RunState::Completed, "{}", explain(&world));
    world.crashes
}

#[test]
fn every_seed_keeps_the_invariants_and_ends_where_the_run_without_faults_ends() {
    if let Ok(seed) = std::env::var("KEEL_SIM_SEED") {
        let seed: u64 = seed.trim().parse().expect("KEEL_SIM_SEED is a number");
        let crashes = check_seed(seed);
        println!("seed {seed}: {crashes} crashes");
        return;
    }
    let seeds: u64 = std::env::var("KEEL_SIM_SEEDS")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(300);
    let mut crashes = 0u64;
    for seed in 0..seeds {
        crashes += u64::from(check_seed(seed));
    }
    println!("{seeds} seeds, {crashes} crashes, every run recovered");
    assert!(
        crashes > seeds / 2,
        "the faults were injected: {crashes} crashes"
    );
}

#[test]
fn the_same_seed_plays_the_same_way() {
    for seed in [3, 17, 99] {
        let faults = Faults {
            crash: 20,
            flaky: true,
            redeliver: true,
        };
        let (mut a, mut b) = (World::new(seed, faults), World::new(seed, faults));
        a.play();
        b.play();
        assert_eq!(a.trace, b.trace, "seed {seed}");
        assert_eq!(a.durable, b.durable, "seed {seed}");
    }
}
