//! Seeded simulation of the whole engine: the `keel` binary, its real store, git workspace,
//! sandbox and tools, driven from one seed.
//!
//! One seed makes everything:
//! - the scenario: one to three phases, each a command phase (one to three commands appending
//!   to a file, now and then one that always fails) or an agent phase whose scripted driver
//!   plans, notes, writes files, runs shell commands, calls an outside service through `http`
//!   and through a contract tool (each with the call's idempotency key) and asks a person a
//!   question; sometimes a step verifier and a phase verifier; some phases behind a person's
//!   approval, sometimes every irreversible call too, sometimes with a one-hour deadline on
//!   requests; in half the seeds the decisions come from a model over HTTP instead of the
//!   script (keel's `anthropic` driver against a fake Messages API on loopback, which answers
//!   each step with the script's calls for the phase and step its prompt names, and answers
//!   some steps' first one or two attempts with a 429, 500, 503 or 529 that keel's retries
//!   outlast), so a model call's request is stored before it is sent and its reply committed
//!   on its own;
//! - the world: a fake clock (`KEEL_CLOCK`) that places each keel process after the last one;
//!   the person's delay before each decision (sometimes past the deadline, so the request
//!   expires and counts as rejected), their rejections, a commit of theirs to the repository
//!   while a phase waits (the run then blocks on the drift and they migrate it), and how many
//!   times each decision and answer is delivered (one to three); incident holds the person puts
//!   on and lifts while the run waits (`keel freeze`/`unfreeze`, each delivered once or twice,
//!   with a `keel resume` or worker between them that must leave the frozen run as it is), and
//!   runs they cancel instead of deciding; whether `keel resume` or `keel worker --once`
//!   carries the run on;
//! - the faults, at random points of random processes: SIGKILL at any fault point of the engine
//!   (`KEEL_CRASH_AT`: before and after every commit, while a command runs, between an effect's
//!   intent and its result, in recovery itself), a commit that fails with an I/O error and one
//!   made durable whose fsync reports an error (`KEEL_STORE_FAULT`).
//!
//! The same scenario and world without faults is the reference. Every seed's run must keep
//! every invariant of `keel_test_support::invariants`, the service must have applied each key
//! at most once and each `done` effect exactly once, no process may panic or hang, and the run
//! must end where the reference ends: the same outcome (state, phases, verdicts, effects,
//! approvals, plan, notes, model calls), the same answers and the same files.
//!
//! `KEEL_ENGINE_SIM_SEEDS=N` runs seeds 0 to N-1 (default 128, in four tests side by side:
//! every seed starts a few dozen processes); `KEEL_ENGINE_SIM_SEED=S` replays one and prints
//! what it did. A failure prints its seed, the scenario, the processes it ran with their faults
//! and both runs' logs; nothing depends on the real time or on the order of a hash map, so the
//! seed replays the same scenario, world and faults.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::Output;
use std::sync::{Arc, Mutex};

use common::{Fixture, state};
use keel_core::invariant::Outcome;
use keel_test_support::invariants;
use keel_test_support::rng::SplitMix as Rng;
use keel_test_support::service::{CountingService, Recorded};
use serde_json::{Value, json};

// ---------------------------------------------------------------------------------------------
// The scenario
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone)]
enum Call {
    Plan(Vec<String>),
    Note(String),
    /// Writes `content` to `file` (whole).
    Write(String, String),
    /// The contract tool that applies an item to the service, keyed.
    Apply(String),
    /// A POST to the service through keel's `http` tool.
    Post(String),
    Ask(String),
    /// A shell command through keel's `run` tool, appending `line` to `file`.
    Run(String, String),
    Finish(String),
}

impl Call {
    fn json(&self, url: &str) -> Value {
        match self {
            Call::Plan(items) => json!({"tool": "plan", "args": {"items": items}}),
            Call::Note(text) => json!({"tool": "note", "args": {"text": text}}),
            Call::Write(file, content) => {
                json!({"tool": "write", "args": {"path": file, "content": content}})
            }
            Call::Apply(item) => json!({"tool": "apply_keyed", "args": {"item": item}}),
            Call::Post(body) => json!({"tool": "http", "args": {
                "method": "POST", "url": format!("{url}/apply"), "body": body
            }}),
            Call::Ask(question) => json!({"tool": "ask", "args": {"question": question}}),
            Call::Run(file, line) => json!({"tool": "run", "args": {
                "command": format!("printf '%s\\n' '{line}' >> {file}")
            }}),
            Call::Finish(summary) => json!({"tool": "finish", "args": {"summary": summary}}),
        }
    }
}

#[derive(Debug, Clone)]
enum PhaseSpec {
    /// Shell commands, each appending one line to `cmd{phase}.txt`.
    Command(Vec<String>),
    /// The scripted driver's replies, each one to two calls; the last ends with `finish`.
    Agent(Vec<Vec<Call>>),
}

#[derive(Debug, Clone)]
struct Scenario {
    /// Each phase, and whether a person approves it before it runs.
    phases: Vec<(PhaseSpec, bool)>,
    /// `[approvals] require = ["irreversible"]`: every call to the service waits for a person.
    gate_effects: bool,
    /// `[approvals] expires = "1h"`.
    deadline: bool,
    /// A step verifier (run after every step that changed the tree) and a phase verifier that
    /// every phase must pass.
    step_verifier: bool,
    phase_verifier: bool,
    /// The driver: the script, or a model over HTTP (keel's `anthropic` driver against the
    /// fake service, which answers each step with the same calls the script has).
    model: Option<Model>,
}

/// A model over HTTP, and the outages it has: for some steps (agent phase index, step number
/// in it) the first one or two attempts are answered with this error status, which keel's
/// retries (two) outlast. The model counts attempts across all processes of a world, so a
/// request re-sent after a crash may find the outage over.
#[derive(Debug, Clone)]
struct Model {
    outages: BTreeMap<(usize, usize), (u32, u16)>,
}

impl Scenario {
    fn generate(rng: &mut Rng) -> Scenario {
        let n = 1 + rng.below(3) as usize;
        let mut phases = Vec::new();
        let mut item = 0;
        for p in 0..n {
            let spec = if rng.chance(40) {
                let steps = 1 + rng.below(3);
                // Now and then a step that always fails: the run blocks there.
                let failing = rng.chance(10).then(|| rng.below(steps));
                PhaseSpec::Command(
                    (0..steps)
                        .map(|s| {
                            if failing == Some(s) {
                                format!(
                                    "printf 'phase {p} step {s} fails\\n' >> cmd{p}.txt; exit 3"
                                )
                            } else {
                                format!("printf 'phase {p} step {s}\\n' >> cmd{p}.txt")
                            }
                        })
                        .collect(),
                )
            } else {
                let mut replies = Vec::new();
                for r in 0..1 + rng.below(4) {
                    let mut calls = Vec::new();
                    for _ in 0..1 + rng.below(2) {
                        item += 1;
                        calls.push(match rng.below(12) {
                            0 => Call::Plan(vec![format!("item {item}"), "finish".into()]),
                            1 => Call::Note(format!("phase {p} reply {r}: noted {item}")),
                            2 | 3 => Call::Write(
                                format!("out{p}.txt"),
                                format!("phase {p} wrote {item}\n"),
                            ),
                            4 | 5 => Call::Apply(format!("item-{item}")),
                            6 | 7 => Call::Post(format!("post-{item}")),
                            8 => Call::Ask(format!("phase {p}: may I go on with {item}?")),
                            9 | 10 => Call::Run(format!("out{p}.txt"), format!("ran {item}")),
                            _ => Call::Note(format!("thinking about {item}")),
                        });
                    }
                    replies.push(calls);
                }
                replies.push(vec![Call::Finish(format!("phase {p} done"))]);
                PhaseSpec::Agent(replies)
            };
            phases.push((spec, rng.chance(30)));
        }
        let gate_effects = rng.chance(25);
        let deadline = rng.chance(40);
        let step_verifier = rng.chance(30);
        let phase_verifier = rng.chance(30);
        // Drawn last, so the seeds' scenarios are what they were before models over HTTP.
        let model = rng.chance(50).then(|| {
            let mut outages = BTreeMap::new();
            for (p, (spec, _)) in phases.iter().enumerate() {
                if let PhaseSpec::Agent(replies) = spec {
                    for step in 1..=replies.len() {
                        if rng.chance(30) {
                            let status = [500, 529, 429, 503][rng.below(4) as usize];
                            outages.insert((p, step), (1 + rng.below(2) as u32, status));
                        }
                    }
                }
            }
            Model { outages }
        });
        Scenario {
            phases,
            gate_effects,
            deadline,
            step_verifier,
            phase_verifier,
            model,
        }
    }

    /// How the model over HTTP answers one request: the calls the script has for the phase and
    /// step its prompt names (`## Phase P/N: name (step S)`), unless an outage says an error.
    fn answer(
        &self,
        url: &str,
        attempts: &Mutex<BTreeMap<(usize, usize), u32>>,
        request: &Recorded,
    ) -> (u16, String) {
        let body: Value = serde_json::from_str(&request.body).unwrap_or(Value::Null);
        let user = body["messages"][0]["content"].as_str().unwrap_or_default();
        let Some((phase, step)) = phase_and_step(user) else {
            return (
                400,
                json!({"type": "error", "error": {"type": "invalid_request_error",
                "message": "the simulated model found no phase and step in the prompt"}})
                .to_string(),
            );
        };
        let seen = {
            let mut attempts = attempts.lock().unwrap_or_else(|e| e.into_inner());
            let n = attempts.entry((phase, step)).or_insert(0);
            *n += 1;
            *n
        };
        if let Some((failures, status)) = self
            .model
            .as_ref()
            .and_then(|m| m.outages.get(&(phase, step)))
            && seen <= *failures
        {
            return (
                *status,
                json!({"type": "error", "error": {"type": "api_error",
                "message": format!("simulated outage, attempt {seen}")}})
                .to_string(),
            );
        }
        let reply = match self.phases.get(phase) {
            Some((PhaseSpec::Agent(replies), _)) => replies.get(step.wrapping_sub(1)),
            _ => None,
        };
        let Some(reply) = reply else {
            return (400, json!({"type": "error", "error": {"type": "invalid_request_error",
                "message": format!("the simulated model has no reply for phase {phase} step {step}")}})
            .to_string());
        };
        let content: Vec<Value> = reply
            .iter()
            .enumerate()
            .map(|(i, call)| {
                let call = call.json(url);
                json!({"type": "tool_use", "id": format!("toolu_{i:02}"),
                       "name": call["tool"], "input": call["args"]})
            })
            .collect();
        (
            200,
            json!({
                "id": "msg_sim", "type": "message", "role": "assistant", "model": "sim-model",
                "content": content, "stop_reason": "tool_use", "stop_sequence": null,
                "usage": {"input_tokens": 100, "output_tokens": 20},
            })
            .to_string(),
        )
    }

    fn script(&self, url: &str) -> Vec<Value> {
        let mut lines = Vec::new();
        for (spec, _) in &self.phases {
            if let PhaseSpec::Agent(replies) = spec {
                for reply in replies {
                    let calls: Vec<Value> = reply.iter().map(|c| c.json(url)).collect();
                    lines.push(json!({ "calls": calls }));
                }
            }
        }
        lines
    }

    fn contract(&self, script: &Path, url: &str) -> String {
        let port = url.rsplit(':').next().unwrap();
        let mut c = format!(
            r#"
[task]
goal = "Every phase of the simulated scenario is done."

[driver]
{driver}

[scope]
writable = ["out0.txt", "out1.txt", "out2.txt"]
http = [{{ host = "127.0.0.1", port = {port}, methods = ["POST"] }}]

[budget]
steps = 200

[[verify]]
name = "workspace"
tier = "acceptance"
run = "test -f README.md"
"#,
            driver = match &self.model {
                None => format!("kind = \"script\"\nscript = \"{}\"", script.display()),
                Some(_) => format!(
                    "kind = \"anthropic\"\nmodel = \"sim-model\"\nbase_url = \"{url}\"\n\
                     max_retries = 2\nretry_backoff = \"1ms\"\ntimeout = \"60s\""
                ),
            },
        );
        if self.step_verifier {
            c.push_str(
                "\n[[verify]]\nname = \"step_ok\"\ntier = \"step\"\nrun = \"test -f keel.toml\"\n",
            );
        }
        if self.phase_verifier {
            c.push_str(
                "\n[[verify]]\nname = \"phase_ok\"\ntier = \"phase\"\nrun = \"test -f .gitignore\"\n",
            );
        }
        if self.gate_effects || self.deadline {
            c.push_str("\n[approvals]\n");
            if self.gate_effects {
                c.push_str("require = [\"irreversible\"]\n");
            }
            if self.deadline {
                c.push_str("expires = \"1h\"\n");
            }
        }
        for (p, (spec, approval)) in self.phases.iter().enumerate() {
            let _ = write!(c, "\n[[phase]]\nname = \"p{p}\"\n");
            match spec {
                PhaseSpec::Command(commands) => {
                    let quoted: Vec<String> = commands
                        .iter()
                        .map(|s| serde_json::to_string(s).unwrap())
                        .collect();
                    let _ = writeln!(c, "kind = \"command\"\nrun = [{}]", quoted.join(", "));
                }
                PhaseSpec::Agent(_) => {
                    c.push_str(
                        "kind = \"agent\"\nobjective = \"Do this phase's part.\"\n\
                         tools = [\"plan\", \"note\", \"write\", \"apply_keyed\", \"http\", \"ask\", \"run\", \"finish\"]\n",
                    );
                }
            }
            c.push_str(if self.phase_verifier {
                "done_when = [\"phase_ok\"]\n"
            } else {
                "done_when = []\n"
            });
            if *approval {
                c.push_str("approval = true\n");
            }
        }
        c.push_str(&common::apply_keyed_tool(url));
        c
    }
}

/// The phase index (from 0) and step number a prompt names in `## Phase P/N: name (step S)`.
fn phase_and_step(prompt: &str) -> Option<(usize, usize)> {
    let rest = &prompt[prompt.find("## Phase ")? + "## Phase ".len()..];
    let phase: usize = rest[..rest.find('/')?].parse().ok()?;
    let rest = &rest[rest.find("(step ")? + "(step ".len()..];
    let step: usize = rest[..rest.find(')')?].parse().ok()?;
    Some((phase.checked_sub(1)?, step))
}

// ---------------------------------------------------------------------------------------------
// The world and the faults
// ---------------------------------------------------------------------------------------------

/// What happens to one keel process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    None,
    /// SIGKILL at the Nth fault point (if the process gets that far).
    Kill(u64),
    /// The Nth commit fails with an I/O error; nothing of it is stored.
    CommitError(u64),
    /// The Nth commit is made durable, then reported failed.
    LostAck(u64),
}

impl Fault {
    fn pick(rng: &mut Rng) -> Fault {
        match rng.below(100) {
            0..=39 => Fault::Kill(1 + rng.below(40)),
            40..=54 => Fault::CommitError(1 + rng.below(8)),
            55..=69 => Fault::LostAck(1 + rng.below(8)),
            _ => Fault::None,
        }
    }
}

/// The fake clock's start: 2026-01-01, so that times are far from the real clock's.
const EPOCH_MS: i64 = 1_767_225_600_000;
const MINUTE_MS: i64 = 60_000;

struct World {
    fx: Fixture,
    service: CountingService,
    /// The seed's generator of the person's behaviour (the same for reference and faulty run:
    /// it is drawn per request and per question, not per process).
    seed: u64,
    /// Where the fake clock stands: every process starts a few minutes after the last.
    clock_ms: i64,
    /// Faults still to come, one per process (`None` = no more faults).
    faults: Option<Rng>,
    faulty_processes: u32,
    /// Faults that struck: a process killed, a commit failed.
    hits: u32,
    /// Whether the next process to carry the run on is `keel resume` or `keel worker --once`.
    carrier: Rng,
    log: Vec<String>,
    /// Requests the model over HTTP was sent, per agent phase and step.
    model_attempts: Arc<Mutex<BTreeMap<(usize, usize), u32>>>,
}

impl World {
    fn new(scenario: &Scenario, seed: u64, faults: bool) -> (World, tempfile::TempDir) {
        let service = CountingService::start();
        let model_attempts = Arc::new(Mutex::new(BTreeMap::new()));
        if scenario.model.is_some() {
            let (scenario, url) = (scenario.clone(), service.url());
            let attempts = Arc::clone(&model_attempts);
            service.answer_model(move |request| scenario.answer(&url, &attempts, request));
        }
        let outside = tempfile::tempdir().unwrap();
        let script = common::write_script(outside.path(), &scenario.script(&service.url()));
        let fx = Fixture::new(&scenario.contract(&script, &service.url()));
        let world = World {
            fx,
            service,
            seed,
            clock_ms: EPOCH_MS,
            faults: faults.then_some(Rng(seed ^ 0x5EED_FA17)),
            faulty_processes: 0,
            hits: 0,
            carrier: Rng(seed ^ 0x0C0F_FEE0 ^ u64::from(faults)),
            log: Vec::new(),
            model_attempts,
        };
        (world, outside)
    }

    /// The person's generator for request or question `n` of kind `what`.
    fn person(&self, what: u64, n: u64) -> Rng {
        let mut rng = Rng(self.seed ^ (what << 56) ^ n.wrapping_mul(0x9E37_79B9));
        rng.next_u64();
        rng
    }

    fn tick(&mut self, minutes: i64) {
        self.clock_ms += minutes * MINUTE_MS;
    }

    /// `keel` with `args` at the fake clock's time, with this process's fault if any.
    fn keel(&mut self, args: &[&str], may_fault: bool) -> (Output, Fault) {
        self.tick(1);
        let fault = match (&mut self.faults, may_fault) {
            (Some(rng), true) if self.faulty_processes < 8 => Fault::pick(rng),
            _ => Fault::None,
        };
        if fault != Fault::None {
            self.faulty_processes += 1;
        }
        let mut cmd = self.fx.keel();
        cmd.args(args).env("KEEL_CLOCK", self.clock_ms.to_string());
        match fault {
            Fault::None => {}
            Fault::Kill(n) => {
                cmd.env("KEEL_CRASH_AT", n.to_string());
            }
            Fault::CommitError(n) => {
                cmd.env("KEEL_STORE_FAULT", format!("commit-error@{n}"));
            }
            Fault::LostAck(n) => {
                cmd.env("KEEL_STORE_FAULT", format!("commit-lost-ack@{n}"));
            }
        }
        let out = self.output(cmd, args);
        let ended = match (out.status.code(), out.status.signal()) {
            (Some(code), _) => format!("exit {code}"),
            (None, Some(sig)) => format!("signal {sig}"),
            _ => "?".into(),
        };
        self.log
            .push(format!("keel {} [{fault:?}] -> {ended}", args.join(" ")));
        // Whatever the fault, keel never panics, and only the kill it was told of kills it.
        let stderr = String::from_utf8_lossy(&out.stderr);
        if out.status.signal().is_some() || stderr.contains("injected by KEEL_STORE_FAULT") {
            self.hits += 1;
        }
        assert!(
            out.status.code() != Some(101) && !stderr.contains("panicked"),
            "keel {args:?} panicked\n{}",
            self.fx.explain(&out)
        );
        if let Some(sig) = out.status.signal() {
            assert!(
                sig == 9 && matches!(fault, Fault::Kill(_)),
                "keel {args:?} died of signal {sig} without being told to\n{}",
                self.fx.explain(&out)
            );
        }
        (out, fault)
    }

    /// Runs `cmd`; a process that takes more than two minutes is killed and the seed fails:
    /// keel hung (every process here takes well under a second).
    fn output(&self, mut cmd: std::process::Command, args: &[&str]) -> Output {
        let dir = tempfile::tempdir().unwrap();
        let (o, e) = (dir.path().join("stdout"), dir.path().join("stderr"));
        cmd.stdout(std::fs::File::create(&o).unwrap());
        cmd.stderr(std::fs::File::create(&e).unwrap());
        let mut child = cmd.spawn().unwrap();
        let started = std::time::Instant::now();
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            if started.elapsed() > std::time::Duration::from_secs(120) {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "keel {args:?} hung: still running after two minutes\nprocesses:\n  {}",
                    self.log.join("\n  ")
                );
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        };
        Output {
            status,
            stdout: std::fs::read(&o).unwrap(),
            stderr: std::fs::read(&e).unwrap(),
        }
    }

    /// A person decides every undecided request (after a delay the seed gives; past the
    /// deadline, they do not answer and the request expires) and answers every unanswered
    /// question, each delivery one to three times. Now and then they first put the run on an
    /// incident hold and lift it, or cancel the run instead of deciding.
    fn person_acts(&mut self, id: &str, status: &Value) {
        let empty = Vec::new();
        for r in status["approvals"].as_array().unwrap_or(&empty) {
            if !r["decision"].is_null() {
                continue;
            }
            let n = r["n"].as_u64().unwrap();
            let mut person = self.person(1, n);
            let late = r["expires_at"].is_string() && person.chance(25);
            if late {
                // Two hours later: the one-hour deadline has passed.
                self.tick(120);
                self.log
                    .push(format!("request {n}: the person is too late"));
                continue;
            }
            // Now and then the person puts the run on an incident hold while they think, or
            // cancels it instead of deciding.
            if person.chance(25) {
                self.hold(id, n);
                self.log
                    .push(format!("request {n}: the person held the run meanwhile"));
            }
            if person.chance(6) {
                self.deliver(id, &["cancel", id, "--reason", "simulated person"], |s| {
                    state(s) == "failed"
                });
                self.log.push(format!("request {n}: the person cancels"));
                return;
            }
            self.tick(5 + person.below(30) as i64);
            // A rejected phase blocks the run; a rejected call only tells the agent no.
            let phase_gate = r["gate"]["gate"] == "phase";
            if phase_gate && person.chance(25) {
                // Meanwhile the person commits to the repository: the run's environment
                // drifted, and it blocks on resume until they migrate it. (Only at a phase
                // gate: keel migrates at a step boundary, and a call's request is mid-step.)
                common::git(
                    self.fx.root(),
                    &["commit", "-q", "--allow-empty", "-m", "a person's commit"],
                );
                self.log
                    .push(format!("request {n}: the person commits meanwhile"));
            }
            let hash = r["payload_hash"].as_str().unwrap().to_string();
            let approve = !person.chance(if phase_gate { 5 } else { 25 });
            let word = if approve { "approve" } else { "reject" };
            for _ in 0..1 + person.below(3) {
                let (out, _) = self.keel(
                    &[
                        word,
                        id,
                        &n.to_string(),
                        "--payload-hash",
                        &hash,
                        "--reason",
                        "simulated person",
                    ],
                    false,
                );
                assert_eq!(
                    out.status.code(),
                    Some(0),
                    "{word} {n}, delivered again or not, is taken\n{}",
                    self.fx.explain(&out)
                );
            }
        }
        for q in status["questions"].as_array().unwrap_or(&empty) {
            if !q["answer"].is_null() {
                continue;
            }
            let n = q["n"].as_u64().unwrap();
            let mut person = self.person(2, n);
            if person.chance(25) {
                self.hold(id, 1 << 32 | n);
                self.log
                    .push(format!("question {n}: the person held the run meanwhile"));
            }
            self.tick(1 + person.below(10) as i64);
            let text = format!("answer {n}: go on");
            for _ in 0..1 + person.below(3) {
                let (out, _) = self.keel(&["answer", id, &n.to_string(), &text], false);
                assert_eq!(
                    out.status.code(),
                    Some(0),
                    "answer {n}, delivered again or not, is taken\n{}",
                    self.fx.explain(&out)
                );
            }
        }
    }

    /// A person's command, given again until what it asks for shows in the run's status (its
    /// process may be given a fault, like any other; the person sees it fail and repeats it).
    fn deliver(&mut self, id: &str, args: &[&str], done: impl Fn(&Value) -> bool) {
        for _ in 0..10 {
            let (out, _) = self.keel(args, true);
            let status = self.fx.status(id);
            if done(&status) {
                return;
            }
            assert!(
                out.status.code() != Some(0),
                "keel {args:?} succeeded and did not do it: {status}\n{}",
                self.fx.explain(&out)
            );
        }
        panic!(
            "seed {}: keel {args:?} did not take after ten deliveries\nprocesses:\n  {}",
            self.seed,
            self.log.join("\n  ")
        );
    }

    /// An incident hold: the run is frozen, whoever carries it on meanwhile (`keel resume` or a
    /// worker) leaves it as it is, then the hold is lifted, each delivered once or twice.
    fn hold(&mut self, id: &str, n: u64) {
        let mut person = self.person(3, n);
        for _ in 0..1 + person.below(2) {
            self.deliver(id, &["freeze", id, "--reason", "an incident"], |s| {
                s["frozen"] == true
            });
        }
        let before = self.fx.status(id);
        if self.carrier.chance(30) {
            self.keel(&["worker", "--once", "--poll", "10ms"], true);
        } else {
            self.keel(&["resume", id], true);
        }
        let after = self.fx.status(id);
        for key in ["state", "frozen", "events", "approvals", "questions"] {
            assert_eq!(
                before[key],
                after[key],
                "seed {}: a frozen run moved ({key})\nprocesses:\n  {}",
                self.seed,
                self.log.join("\n  ")
            );
        }
        for _ in 0..1 + person.below(2) {
            self.deliver(id, &["unfreeze", id, "--reason", "over"], |s| {
                s["frozen"] == false
            });
        }
    }

    /// Drives the run from its start to its end: `keel run`, then `keel resume` until the run
    /// is terminal or blocked, a person acting whenever it waits.
    fn drive(&mut self) -> String {
        for _ in 0..60 {
            let Some(id) = self.fx.stored_run_id() else {
                self.keel(&["run", "keel.toml"], true);
                continue;
            };
            let status = self.fx.status(&id);
            match state(&status) {
                "blocked" if status["block"]["cause"] == "drift" => {
                    // The person made the change on purpose: migrate.
                    self.keel(
                        &[
                            "resume",
                            &id,
                            "--migrate",
                            "--reason",
                            "the person's commit",
                        ],
                        true,
                    );
                    continue;
                }
                "completed" | "failed" | "cancelled" | "blocked" => return id,
                "awaiting_approval" | "waiting" => self.person_acts(&id, &status),
                _ => {}
            }
            // The run is carried on by `keel resume`, or by a worker that claims what is
            // runnable (a dead process's run, an answered request).
            if self.carrier.chance(30) {
                self.keel(&["worker", "--once", "--poll", "10ms"], true);
            } else {
                self.keel(&["resume", &id], true);
            }
        }
        let status = self
            .fx
            .stored_run_id()
            .map(|id| self.fx.status(&id))
            .unwrap_or_default();
        panic!(
            "seed {} (replay: KEEL_ENGINE_SIM_SEED={} cargo test -p keel-cli --test simulation): \
             the run did not end after sixty processes; it is {} ({}, block {})\nprocesses:\n  {}",
            self.seed,
            self.seed,
            state(&status),
            status["reason"],
            status["block"],
            self.log.join("\n  ")
        );
    }

    /// Requests sent to the model over HTTP, and how many of them an outage answered.
    fn model_requests(&self, scenario: &Scenario) -> (u32, u32) {
        let attempts = self
            .model_attempts
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let outages = scenario.model.as_ref().map(|m| &m.outages);
        attempts.iter().fold((0, 0), |(sent, errors), (key, n)| {
            let failures = outages.and_then(|o| o.get(key)).map_or(0, |f| f.0);
            (sent + n, errors + (*n).min(failures))
        })
    }

    fn applied(&self) -> BTreeMap<String, u64> {
        self.service
            .applications()
            .into_iter()
            .map(|(k, n)| (k, u64::from(n)))
            .collect()
    }

    /// The run's invariants and its outcome: what it did, the answers it got, the files it made
    /// and how many applications the service saw.
    fn check(&self, id: &str) -> Result<(Outcome, Value, Vec<String>, u64), String> {
        let db = self.fx.path(".keel/keel.db");
        let audit = invariants::check_effects(&db, id, &["http", "apply_keyed"], &self.applied())?;
        let mut outcome = Outcome::of(&audit);
        // Effect keys come from the run id, and trees cover the contract, which names this
        // world's service port and script: both differ between worlds. The files are compared.
        for e in &mut outcome.effects {
            e.0 = String::new();
        }
        for verdict in outcome.verdicts.values_mut() {
            verdict.1 = String::new();
        }
        let status = self.fx.status(id);
        let answers: Vec<Value> = status["questions"]
            .as_array()
            .cloned()
            .unwrap_or_default()
            .iter()
            .map(|q| json!([q["n"], q["answer"]["text"]]))
            .collect();
        let files = (0..3)
            .flat_map(|p| [format!("out{p}.txt"), format!("cmd{p}.txt")])
            .map(|f| std::fs::read_to_string(self.fx.path(&f)).unwrap_or_default())
            .collect();
        let applications = self.applied().values().sum();
        Ok((outcome, Value::from(answers), files, applications))
    }
}

/// What one seed's faulty run went through.
struct Seed {
    /// Processes given a fault, and faults that struck (the others' processes ended first).
    faulty: u32,
    hits: u32,
    processes: u32,
    /// Requests the person let expire, and decisions that were rejections.
    late: u32,
    rejected: u32,
    /// Incident holds the person put on and lifted, and runs they cancelled.
    held: u32,
    cancelled: u32,
    /// Requests sent to the model over HTTP, and those it answered with an outage's error.
    model_requests: u32,
    outage_errors: u32,
    end: String,
}

/// One seed: the reference, then the same scenario and world with faults.
fn simulate(seed: u64) -> Result<Seed, String> {
    let scenario = Scenario::generate(&mut Rng(seed));
    let (mut reference, _r) = World::new(&scenario, seed, false);
    let rid = reference.drive();
    let expected = reference
        .check(&rid)
        .map_err(|e| format!("the reference run breaks an invariant: {e}"))?;
    let (mut faulty, _f) = World::new(&scenario, seed, true);
    let id = faulty.drive();
    let explain = |w: &World, what: String| {
        let log = |w: &World, id: &str| {
            String::from_utf8_lossy(&w.fx.run(&["log", id]).stdout).to_string()
        };
        format!(
            "seed {seed} (replay: KEEL_ENGINE_SIM_SEED={seed} cargo test -p keel-cli --test simulation)\n\
             {what}\nscenario: {scenario:?}\nreference processes:\n  {}\nprocesses:\n  {}\n\
             --- the reference's log\n{}--- this run's log\n{}",
            reference.log.join("\n  "),
            w.log.join("\n  "),
            log(&reference, &rid),
            log(w, &id),
        )
    };
    let got = faulty.check(&id).map_err(|e| explain(&faulty, e))?;
    let differences = got.0.differences(&expected.0);
    if !differences.is_empty() {
        return Err(explain(
            &faulty,
            format!(
                "the outcome differs from the reference run's:\n{}",
                differences.join("\n")
            ),
        ));
    }
    for (what, a, b) in [
        ("answers", got.1.to_string(), expected.1.to_string()),
        ("files", format!("{:?}", got.2), format!("{:?}", expected.2)),
        ("applications", got.3.to_string(), expected.3.to_string()),
    ] {
        if a != b {
            return Err(explain(
                &faulty,
                format!("{what} differ: {a} against the reference's {b}"),
            ));
        }
    }
    if std::env::var_os("KEEL_ENGINE_SIM_SEED").is_some() {
        println!(
            "{}",
            explain(
                &faulty,
                format!(
                    "ended {:?}, as the reference did: {}",
                    got.0.state,
                    faulty.fx.status(&id)["reason"]
                )
            )
        );
    }
    let (model_requests, outage_errors) = faulty.model_requests(&scenario);
    Ok(Seed {
        faulty: faulty.faulty_processes,
        hits: faulty.hits,
        processes: faulty.log.len() as u32,
        late: faulty.log.iter().filter(|l| l.contains("too late")).count() as u32,
        rejected: faulty
            .log
            .iter()
            .filter(|l| l.starts_with("keel reject"))
            .count() as u32,
        held: faulty
            .log
            .iter()
            .filter(|l| l.contains("held the run"))
            .count() as u32,
        cancelled: faulty.log.iter().filter(|l| l.contains("cancels")).count() as u32,
        model_requests,
        outage_errors,
        end: format!("{:?}", got.0.state),
    })
}

const SHARDS: u64 = 4;

fn shard(shard: u64) {
    let seeds: Vec<u64> = match std::env::var("KEEL_ENGINE_SIM_SEED") {
        Ok(seed) => {
            if shard != 0 {
                return;
            }
            vec![
                seed.trim()
                    .parse()
                    .expect("KEEL_ENGINE_SIM_SEED is a number"),
            ]
        }
        Err(_) => {
            let n: u64 = std::env::var("KEEL_ENGINE_SIM_SEEDS")
                .ok()
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(128);
            (0..n).filter(|s| s % SHARDS == shard).collect()
        }
    };
    let (mut faulty, mut hits, mut processes, mut late, mut rejected) = (0, 0, 0, 0, 0);
    let (mut held, mut cancelled, mut model_requests, mut outage_errors) = (0, 0, 0, 0);
    let mut ends: BTreeMap<String, u32> = BTreeMap::new();
    for &seed in &seeds {
        match simulate(seed) {
            Ok(s) => {
                println!(
                    "seed {seed}: {} after {} processes, {} faults struck",
                    s.end, s.processes, s.hits
                );
                faulty += s.faulty;
                hits += s.hits;
                processes += s.processes;
                late += s.late;
                rejected += s.rejected;
                held += s.held;
                cancelled += s.cancelled;
                model_requests += s.model_requests;
                outage_errors += s.outage_errors;
                *ends.entry(s.end).or_default() += 1;
            }
            Err(e) => panic!("{e}"),
        }
    }
    println!(
        "engine simulation, shard {} of {SHARDS}: {} seeds kept every invariant and matched \
         their reference; {processes} keel processes, {faulty} of them given a fault, {hits} \
         faults struck, {late} requests let expire, {rejected} rejections delivered, {held} \
         incident holds, {cancelled} runs cancelled, {model_requests} requests to a model over \
         HTTP ({outage_errors} answered with an outage's error); ends: {ends:?}",
        shard + 1,
        seeds.len()
    );
    // The faults reach the engine: most seeds are hit at least once (a fault given to a process
    // that ends before its point does not strike).
    assert!(
        seeds.len() < 4 || hits as usize >= seeds.len() / 2,
        "too few faults struck: {hits} over {} seeds",
        seeds.len()
    );
    // Half the seeds talk to a model over HTTP, and some of its answers are outages.
    assert!(
        seeds.len() < 16 || (model_requests > 0 && outage_errors > 0),
        "the model over HTTP was never reached ({model_requests} requests, {outage_errors} \
         outage errors over {} seeds)",
        seeds.len()
    );
}

#[test]
fn seeded_engine_simulation_shard_1() {
    shard(0);
}

#[test]
fn seeded_engine_simulation_shard_2() {
    shard(1);
}

#[test]
fn seeded_engine_simulation_shard_3() {
    shard(2);
}

#[test]
fn seeded_engine_simulation_shard_4() {
    shard(3);
}
