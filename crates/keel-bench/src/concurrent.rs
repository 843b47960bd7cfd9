//! Many runs in one process against a model that answers after 50 ms.
//!
//! The model is a fake OpenAI-compatible server on loopback (plain HTTP/1.1, a thread per
//! connection) that waits `latency` before each answer; runs reach it through keel's real
//! `openai` driver (keel-llm's client over ureq). Each run has its own model name, so the
//! server knows which run is asking: it answers `note` (a different text each time, so no
//! loop is seen) until the run's last step, then `finish`.
//!
//! keel's worker drives one run at a time, so the benchmark drives the runs from a bounded
//! pool of threads, each with its own store connection, each calling `keel_engine::start` for
//! the next run until none is left. All runs share one store and one git workspace (their
//! contracts live outside it, so they are not part of its tree).

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow};
use keel_core::state::RunState;
use keel_engine::{Actor, DriverOverride, NewRun, Quiet};
use keel_store::Store;
use serde_json::json;

use crate::util;

pub struct Concurrent {
    pub runs: usize,
    pub pool: usize,
    pub steps_per_run: usize,
    pub latency: Duration,
    pub elapsed: Duration,
    pub steps: u64,
    pub completed: usize,
    pub failures: Vec<String>,
    pub peak_rss_kb: Option<u64>,
    pub peak_reset: bool,
    pub cpu: util::Cpu,
    /// The part of `cpu.process_us` the fake model's threads spent (reading requests, writing
    /// answers): CPU of this machine, but not keel's, the model standing for a server elsewhere.
    pub model_server_us: f64,
    /// The store's shared transactions over the runs (see keel-store `batch`).
    pub commits: keel_store::CommitStats,
    /// Each model exchange as keel's driver timed it (`model_replied.duration_ms`), sorted:
    /// the model's latency and what the HTTP client and the machine add to it.
    pub exchange_ms: Vec<u64>,
    /// How long each run took, from its start to its end, in ms, sorted.
    pub run_ms: Vec<u64>,
    /// How long each run's pool thread waited for it, from loading its contract to
    /// `keel_engine::start`'s return, in ms, sorted: `run_ms`, the run's start before its first
    /// event and the commit of its last events.
    pub drive_ms: Vec<u64>,
    /// Where a run's time goes outside its model calls.
    pub timeline: Timeline,
    /// The binary the runs' confined commands were started with (keel-engine's choice).
    pub helper: Option<std::path::PathBuf>,
    /// Building the token counter's BPE tables, once per process, before the clock started.
    pub tokenizer_build: Duration,
}

pub fn measure(
    base: &Path,
    runs: usize,
    pool: usize,
    steps_per_run: usize,
    latency: Duration,
) -> Result<Concurrent> {
    let dir = tempfile::tempdir_in(base)?;
    let ws = dir.path().join("ws");
    util::workspace(&ws)?;
    let server = FakeModel::start(latency, steps_per_run)?;
    let contracts = dir.path().join("contracts");
    std::fs::create_dir_all(&contracts)?;
    for i in 0..runs {
        std::fs::write(
            contracts.join(format!("run{i}.toml")),
            contract(i, &server.url),
        )?;
    }
    let db = ws.join(".keel").join("keel.db");
    // Held open over the runs, so the count of shared transactions covers them all.
    let watch = Store::open(&db)?;
    let commits_before = watch.shared_commit_stats();

    // The BPE tables the openai driver counts tokens with are built once per process, at the
    // first count (keel-llm's `tokens`), in a fraction of a second during which every run that
    // counts waits: a worker that has driven one run has them. They are built here, before the
    // clock starts, and the report gives the time apart (`tokenizer_build_ms`).
    let tokenizer = Instant::now();
    keel_llm::token_counter(keel_llm::Provider::OpenAi, "bench-run-0").count("warm");
    let tokenizer_build = tokenizer.elapsed();

    let peak_reset = util::reset_peak_rss();
    let cpu_before = util::cpu();
    let next = AtomicUsize::new(0);
    let failures = Mutex::new(Vec::new());
    let drive_ms = Mutex::new(Vec::with_capacity(runs));
    let completed = AtomicUsize::new(0);
    let actor = Actor::current();
    let started = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..pool.min(runs) {
            s.spawn(|| {
                let fail = |what: String| {
                    if let Ok(mut f) = failures.lock() {
                        f.push(what);
                    }
                };
                let mut store = match Store::open(&db) {
                    Ok(s) => s,
                    Err(e) => return fail(e.to_string()),
                };
                loop {
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    if i >= runs {
                        break;
                    }
                    let began = Instant::now();
                    let driven = drive(&mut store, &contracts.join(format!("run{i}.toml")), &actor);
                    if let Ok(mut all) = drive_ms.lock() {
                        all.push(u64::try_from(began.elapsed().as_millis()).unwrap_or(u64::MAX));
                    }
                    match driven {
                        Ok(RunState::Completed) => {
                            completed.fetch_add(1, Ordering::SeqCst);
                        }
                        Ok(state) => fail(format!("run {i} ended {state}")),
                        Err(e) => fail(format!("run {i}: {e:#}")),
                    }
                }
            });
        }
    });
    let elapsed = started.elapsed();
    let cpu_after = util::cpu();
    let peak_rss_kb = util::status_kb("VmHWM");
    let steps = server.answered.load(Ordering::SeqCst) as u64;
    let model_server_us = server.cpu_us.load(Ordering::SeqCst) as f64;
    let commits_after = watch.shared_commit_stats();
    server.stop();
    let (mut exchange_ms, mut run_ms) = (Vec::new(), Vec::new());
    let mut timeline = Timeline::default();
    for run in watch.runs()? {
        let events = watch.events_from(&run.id, 1)?;
        for e in &events {
            if let Ok(keel_core::event::EventBody::ModelReplied { duration_ms, .. }) =
                e.decode().map(|e| e.body)
            {
                exchange_ms.push(duration_ms);
            }
        }
        if let (Some(first), Some(last)) = (events.first(), events.last()) {
            run_ms.push(u64::try_from(last.at_ms - first.at_ms).unwrap_or(0));
        }
        timeline.add(&events);
    }
    exchange_ms.sort_unstable();
    run_ms.sort_unstable();
    let mut drive_ms = drive_ms.into_inner().unwrap_or_default();
    drive_ms.sort_unstable();
    timeline.sort();
    Ok(Concurrent {
        runs,
        pool: pool.min(runs),
        steps_per_run,
        latency,
        elapsed,
        steps,
        completed: completed.load(Ordering::SeqCst),
        failures: failures.into_inner().unwrap_or_default(),
        peak_rss_kb,
        peak_reset,
        cpu: util::Cpu {
            process_us: cpu_after.process_us - cpu_before.process_us,
            children_us: cpu_after.children_us - cpu_before.children_us,
        },
        model_server_us,
        commits: commits_after.since(&commits_before),
        exchange_ms,
        run_ms,
        drive_ms,
        timeline,
        helper: keel_engine::sandbox_helper().map(Path::to_path_buf),
        tokenizer_build,
    })
}

/// The gaps of each run's log between its model calls, in ms, each sorted: what keel's own
/// work (and the wait for a CPU among the pool's threads) adds to the model's latency.
#[derive(Default)]
pub struct Timeline {
    /// From the run's first event to its first `model_requested`: the run's start (contract,
    /// lease, workspace, first prompt).
    pub to_first_request: Vec<u64>,
    /// From a `model_replied` to the next `model_requested`: a step's commit and the next
    /// step's prompt.
    pub between_calls: Vec<u64>,
    /// From the last `model_replied` to the run's last event: the finish, the acceptance
    /// verifier in the sandbox, the checkpoint and `completed`.
    pub after_last_reply: Vec<u64>,
    /// From a `model_requested` to the request's sending (its reply's time less the exchange's
    /// `duration_ms`): the commit of the request, waiting for its shared transaction's fsync.
    pub before_send: Vec<u64>,
    /// The acceptance verifier's command in the sandbox, from its start to its end
    /// (`duration_ms` of its evidence): the larger part of `after_last_reply`.
    pub verifier_command: Vec<u64>,
}

impl Timeline {
    fn add(&mut self, events: &[keel_store::StoredEvent]) {
        let gap = |from: i64, to: i64| u64::try_from(to - from).unwrap_or(0);
        let (Some(first), Some(last)) = (events.first(), events.last()) else {
            return;
        };
        let mut replied: Option<i64> = None;
        let mut requested: Option<i64> = None;
        for e in events {
            match e.kind.as_str() {
                "model_requested" => {
                    requested = Some(e.at_ms);
                    match replied {
                        None => self.to_first_request.push(gap(first.at_ms, e.at_ms)),
                        Some(at) => self.between_calls.push(gap(at, e.at_ms)),
                    }
                }
                "model_replied" => {
                    replied = Some(e.at_ms);
                    if let (
                        Some(at),
                        Ok(keel_core::event::EventBody::ModelReplied { duration_ms, .. }),
                    ) = (requested.take(), e.decode().map(|d| d.body))
                    {
                        let sent = e.at_ms - i64::try_from(duration_ms).unwrap_or(i64::MAX);
                        self.before_send.push(gap(at, sent));
                    }
                }
                "evidence_recorded" => {
                    if let Ok(keel_core::event::EventBody::EvidenceRecorded { evidence }) =
                        e.decode().map(|d| d.body)
                    {
                        self.verifier_command.push(evidence.duration_ms);
                    }
                }
                _ => {}
            }
        }
        if let Some(at) = replied {
            self.after_last_reply.push(gap(at, last.at_ms));
        }
    }

    fn sort(&mut self) {
        self.to_first_request.sort_unstable();
        self.between_calls.sort_unstable();
        self.after_last_reply.sort_unstable();
        self.before_send.sort_unstable();
        self.verifier_command.sort_unstable();
    }
}

fn drive(store: &mut Store, contract_path: &Path, actor: &Actor) -> Result<RunState> {
    let contract = keel_engine::load_contract(contract_path)?;
    let id = keel_engine::new_run_id();
    let run = keel_engine::start(
        store,
        NewRun {
            contract_path,
            contract,
            run_id: &id,
            choice: &DriverOverride::default(),
            detach: false,
        },
        actor,
        &mut Quiet,
        &mut |_| {},
    )?;
    if run.state != RunState::Completed {
        return Err(anyhow!("run ended {}: {}", run.state, run.reason));
    }
    Ok(run.state)
}

fn contract(i: usize, url: &str) -> String {
    format!(
        r#"[task]
goal = "Keep notes on the five files."

[workspace]
path = "../ws"

[driver]
kind = "openai"
model = "bench-run-{i}"
base_url = "{url}/v1"
context_tokens = 4000
max_output_tokens = 256
timeout = "60s"
max_retries = 0

[scope]
writable = ["notes/**"]

[[verify]]
name = "files"
tier = "acceptance"
run = "test -f file0.txt"

[[phase]]
name = "notes"
kind = "agent"
objective = "Keep a note on each file, then finish."
tools = ["read", "note", "finish"]
"#
    )
}

/// The fake model server.
struct FakeModel {
    url: String,
    answered: Arc<AtomicUsize>,
    /// CPU the connections' threads spent serving requests, in µs (see [`serve`]).
    cpu_us: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl FakeModel {
    fn start(latency: Duration, steps_per_run: usize) -> Result<FakeModel> {
        let listener = TcpListener::bind("127.0.0.1:0").context("binding the fake model")?;
        let url = format!("http://{}", listener.local_addr()?);
        let answered = Arc::new(AtomicUsize::new(0));
        let cpu_us = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let calls: Arc<Mutex<HashMap<String, usize>>> = Arc::default();
        let thread = {
            let (answered, cpu_us, stop) = (answered.clone(), cpu_us.clone(), stop.clone());
            std::thread::spawn(move || {
                for conn in listener.incoming() {
                    if stop.load(Ordering::SeqCst) {
                        break;
                    }
                    let Ok(conn) = conn else { continue };
                    // Each answer is one write, sent at once: with Nagle's algorithm a write
                    // after a small one waits for its acknowledgement, which the client delays
                    // (about 40 ms on Linux), and the model answered after 90 ms, not 50.
                    let _ = conn.set_nodelay(true);
                    let (answered, cpu_us, calls) =
                        (answered.clone(), cpu_us.clone(), calls.clone());
                    std::thread::spawn(move || {
                        let _ = serve(conn, latency, steps_per_run, &calls, &answered, &cpu_us);
                    });
                }
            })
        };
        Ok(FakeModel {
            url,
            answered,
            cpu_us,
            stop,
            thread: Some(thread),
        })
    }

    fn stop(mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wakes the accept loop so it sees the flag.
        if let Some(addr) = self.url.strip_prefix("http://") {
            let _ = TcpStream::connect(addr);
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// One connection: requests until the client closes it, each answered after `latency`. The
/// thread's CPU is added to `cpu_us` after each answer (from the thread's start, then from the
/// answer before), so that what the server spent before the runs ended is counted.
fn serve(
    conn: TcpStream,
    latency: Duration,
    steps_per_run: usize,
    calls: &Mutex<HashMap<String, usize>>,
    answered: &AtomicUsize,
    cpu_us: &AtomicU64,
) -> Result<()> {
    let mut reader = BufReader::new(conn.try_clone()?);
    let mut conn = conn;
    let mut counted = 0;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line)? == 0 {
            return Ok(());
        }
        let mut length = 0usize;
        loop {
            let mut header = String::new();
            reader.read_line(&mut header)?;
            let header = header.trim_end();
            if header.is_empty() {
                break;
            }
            if let Some((name, value)) = header.split_once(':')
                && name.eq_ignore_ascii_case("content-length")
            {
                length = value.trim().parse().unwrap_or(0);
            }
        }
        let mut body = vec![0; length];
        reader.read_exact(&mut body)?;
        // The model stands for a server elsewhere: what it spends here should not count
        // against keel, so it reads only the model's name (keel's client writes it as
        // `"model":"…"`), not the whole 16 KB request.
        let model = model_name(&body).unwrap_or_else(|| {
            let request: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
            request["model"].as_str().unwrap_or("").to_string()
        });
        let n = {
            let mut calls = calls.lock().map_err(|_| anyhow!("poisoned"))?;
            let n = calls.entry(model.clone()).or_insert(0);
            *n += 1;
            *n
        };
        std::thread::sleep(latency);
        let call = if n >= steps_per_run {
            json!({"name": "finish", "arguments": json!({"summary": "notes kept"}).to_string()})
        } else {
            json!({"name": "note", "arguments": json!({"text": format!("{model}: fact {n} about file{}.txt", n % 5)}).to_string()})
        };
        let reply = json!({
            "id": format!("chatcmpl-{model}-{n}"),
            "object": "chat.completion",
            "model": model,
            "choices": [{
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": null,
                    "tool_calls": [{"id": format!("call_{n}"), "type": "function", "function": call}],
                },
                "finish_reason": "tool_calls",
            }],
            "usage": {"prompt_tokens": 900, "completion_tokens": 20},
        })
        .to_string();
        answered.fetch_add(1, Ordering::SeqCst);
        let answer = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{reply}",
            reply.len()
        );
        conn.write_all(answer.as_bytes())?;
        conn.flush()?;
        let spent = util::thread_cpu_us();
        cpu_us.fetch_add(spent.saturating_sub(counted), Ordering::SeqCst);
        counted = spent;
    }
}

/// The value of the first `"model":"…"` in a request body, if it is written that way.
fn model_name(body: &[u8]) -> Option<String> {
    const KEY: &[u8] = b"\"model\":\"";
    let start = body.windows(KEY.len()).position(|w| w == KEY)? + KEY.len();
    let len = body[start..].iter().position(|b| *b == b'"')?;
    String::from_utf8(body[start..start + len].to_vec()).ok()
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_model_name_is_read_from_a_compact_body() {
        let body = br#"{"model":"bench-run-7","messages":[{"content":"\"model\":\"x\""}]}"#;
        assert_eq!(super::model_name(body).as_deref(), Some("bench-run-7"));
        assert_eq!(super::model_name(b"{}"), None);
    }
}
