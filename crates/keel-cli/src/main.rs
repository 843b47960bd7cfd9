//! The `keel` command line: argument parsing, printing and exit codes; nothing else.

mod print;

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use keel_core::run::Run;
use keel_core::state::RunState;
use keel_engine::{Actor, EngineError, Observer, Progress, ResumeOptions};
use keel_store::{Store, StoreError};

/// Exit codes: how the run stopped, for scripts.
mod exit {
    pub const COMPLETED: u8 = 0;
    pub const INTERNAL: u8 = 1;
    pub const USAGE: u8 = 2;
    pub const WAITING: u8 = 3;
    pub const BLOCKED: u8 = 4;
    pub const FAILED: u8 = 5;
}

#[derive(Parser)]
#[command(
    name = "keel",
    version,
    about = "A durable harness for long-running agents: contracts, budgets, verified checkpoints, resume from facts.",
    after_help = "Exit codes: 0 completed, 3 waiting for a human, 4 blocked, 5 failed, 2 usage error or invalid contract, 1 internal error."
)]
struct Cli {
    /// The store (SQLite file). Default: `.keel/keel.db` beside the contract for `run`, else the
    /// nearest `.keel/keel.db` in this directory or its parents.
    #[arg(long, global = true, env = "KEEL_STORE")]
    store: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Write a commented contract template to start from.
    Init {
        /// Where to write it.
        #[arg(default_value = "keel.toml")]
        path: PathBuf,
        /// Overwrite an existing file.
        #[arg(long)]
        force: bool,
    },
    /// Start a run of a contract and drive it until it completes or stops.
    Run {
        contract: PathBuf,
        /// Leave the run for a worker instead of driving it here.
        #[arg(long)]
        detach: bool,
        /// Use this driver for agent phases instead of the contract's: openai, anthropic,
        /// command or script (recorded with the run).
        #[arg(long, value_parser = parse_driver_kind)]
        driver: Option<keel_core::contract::DriverKind>,
        /// Use this model instead of the contract's (recorded with the run).
        #[arg(long)]
        model: Option<String>,
    },
    /// Continue a run after a crash, a block or a stop, from its newest verified checkpoint.
    Resume {
        run: String,
        /// Continue although the environment changed, recording why.
        #[arg(long, requires = "reason")]
        migrate: bool,
        #[arg(long)]
        reason: Option<String>,
    },
    /// Show one run, or list every run.
    Status {
        run: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// Show a run's timeline.
    Log {
        run: String,
        #[arg(long)]
        json: bool,
    },
    /// List a run's external effects: key, class, status, compensation.
    Effects {
        run: String,
        #[arg(long)]
        json: bool,
    },
    /// List a run's checkpoints.
    Checkpoints {
        run: String,
        #[arg(long)]
        json: bool,
    },
    /// Check a run's whole event log: hash chain, sequence, checkpoints, artifacts.
    VerifyLog {
        run: String,
        #[arg(long)]
        json: bool,
    },
    /// Raise budgets of a blocked run, recorded with who and why, and continue it.
    Unblock {
        run: String,
        /// NAME=+AMOUNT, for example steps=+10, wall_time=+30m, cost_usd=+2 (repeatable).
        #[arg(long = "budget", required = true)]
        budgets: Vec<String>,
        #[arg(long)]
        reason: String,
    },
    /// List approval requests: those waiting for a decision (of one run, or of every run).
    Approvals {
        run: Option<String>,
        /// Decided requests too.
        #[arg(long)]
        all: bool,
        #[arg(long)]
        json: bool,
    },
    /// Approve request N of a run; the decision applies only to the payload with this hash.
    Approve {
        run: String,
        n: u32,
        #[arg(long)]
        payload_hash: String,
        #[arg(long, default_value = "")]
        reason: String,
    },
    /// Reject request N of a run, with a reason.
    Reject {
        run: String,
        n: u32,
        #[arg(long)]
        payload_hash: String,
        #[arg(long)]
        reason: String,
    },
    /// Answer question N that the driver asked (the `ask` tool); `keel resume` goes on with it.
    Answer { run: String, n: u32, text: String },
    /// Put a run on an incident hold: whatever drives it stops at its next write, nothing runs.
    Freeze {
        run: String,
        #[arg(long)]
        reason: String,
    },
    /// Lift an incident hold.
    Unfreeze {
        run: String,
        #[arg(long)]
        reason: String,
    },
    /// Claim runnable runs from the store and drive them: runs whose approval or answer arrived,
    /// runs left by `keel run --detach`, runs whose process died. Stops at a step boundary on
    /// SIGTERM or Ctrl-C.
    Worker {
        /// Stop when nothing is runnable instead of waiting for more.
        #[arg(long)]
        once: bool,
        /// How long to wait between looks when nothing is runnable.
        #[arg(long, default_value = "1s", value_parser = humantime::parse_duration)]
        poll: std::time::Duration,
        /// How long a run's lease lasts without a heartbeat: how soon another worker takes over a
        /// run whose worker died.
        #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
        lease_ttl: std::time::Duration,
    },
    /// Serve the HTTP API and the web page (runs, live timelines, the approval inbox). Every
    /// request needs the bearer token, printed at start; run `keel worker` beside it to carry out
    /// decisions.
    Serve {
        #[arg(long, default_value = "127.0.0.1:7777")]
        addr: std::net::SocketAddr,
        /// The bearer token (default: a new random one, printed).
        #[arg(long, env = "KEEL_TOKEN", hide_env_values = true)]
        token: Option<String>,
    },
    /// Stop a run for good (it ends `failed`), recorded with who and why.
    Cancel {
        run: String,
        #[arg(long)]
        reason: String,
    },
    /// Print the JSON Schema of the contract format.
    #[command(hide = true)]
    ContractSchema,
}

fn main() -> ExitCode {
    // Before anything else (threads, arguments): this process may be keel's sandbox helper.
    keel_engine::sandbox_main();
    let cli = Cli::parse();
    match dispatch(cli) {
        Ok(code) => ExitCode::from(code),
        // The reader of our output went away (`keel log RUN | head`): nothing is wrong.
        Err(err) if is_broken_pipe(&err) => ExitCode::from(exit::COMPLETED),
        Err(err) => {
            let code = error_code(&err);
            let mut stderr = std::io::stderr().lock();
            let message = err.to_string();
            let _ = writeln!(stderr, "error: {message}");
            for cause in err.chain().skip(1) {
                let cause = cause.to_string();
                // Errors that already quote their cause (`path: reason`) need no second line.
                if !message.contains(&cause) {
                    let _ = writeln!(stderr, "  caused by: {cause}");
                }
            }
            ExitCode::from(code)
        }
    }
}

fn is_broken_pipe(err: &anyhow::Error) -> bool {
    err.chain().any(|cause| {
        cause
            .downcast_ref::<std::io::Error>()
            .is_some_and(|e| e.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

fn error_code(err: &anyhow::Error) -> u8 {
    if let Some(e) = err.downcast_ref::<EngineError>() {
        return match e {
            EngineError::Contract(_)
            | EngineError::ContractFile { .. }
            | EngineError::Usage(_)
            | EngineError::Refused { .. } => exit::USAGE,
            EngineError::DamagedLog { .. } | EngineError::TreeMissing { .. } => exit::FAILED,
            EngineError::Store(s) => store_code(s),
            EngineError::Git(keel_git::GitError::NotARepository { .. }) => exit::USAGE,
            _ => exit::INTERNAL,
        };
    }
    if let Some(s) = err.downcast_ref::<StoreError>() {
        return store_code(s);
    }
    if err.downcast_ref::<Usage>().is_some() {
        return exit::USAGE;
    }
    exit::INTERNAL
}

fn store_code(e: &StoreError) -> u8 {
    match e {
        StoreError::NoSuchRun(_) | StoreError::AmbiguousRun { .. } => exit::USAGE,
        StoreError::Projection { .. } => exit::FAILED,
        _ => exit::INTERNAL,
    }
}

/// A mistake in how keel was called.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct Usage(String);

fn state_code(state: RunState) -> u8 {
    match state {
        RunState::Completed => exit::COMPLETED,
        RunState::AwaitingApproval | RunState::Waiting => exit::WAITING,
        RunState::Blocked => exit::BLOCKED,
        RunState::Failed => exit::FAILED,
        // The process stopped driving a run that is still active (it lost its lease).
        RunState::Planned | RunState::Executing | RunState::Verifying => exit::INTERNAL,
    }
}

fn dispatch(cli: Cli) -> Result<u8> {
    let actor = Actor::current();
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    match cli.command {
        Command::Init { path, force } => init(&path, force),
        Command::ContractSchema => {
            print!("{}", keel_core::contract::json_schema());
            Ok(exit::COMPLETED)
        }
        Command::Run {
            contract,
            detach,
            driver,
            model,
        } => {
            let parsed = keel_engine::load_contract(&contract)?;
            let store_path = match cli.store {
                Some(p) => p,
                None => contract
                    .canonicalize()
                    .with_context(|| format!("{}", contract.display()))?
                    .parent()
                    .unwrap_or(Path::new("."))
                    .join(".keel")
                    .join("keel.db"),
            };
            // A workspace that is not a git repository is refused before the store exists.
            keel_engine::workspace_of(&contract, &parsed)?;
            let mut store = Store::open(&store_path)?;
            let id = keel_engine::new_run_id();
            let mut observer = Terminal::new();
            let mut announce = |id: &str| {
                // The id comes first, flushed, so a person or a script can resume after a crash.
                let mut out = std::io::stdout().lock();
                let _ = writeln!(out, "run {id}");
                let _ = out.flush();
            };
            let choice = keel_engine::DriverOverride {
                kind: driver,
                model,
            };
            let new = keel_engine::NewRun {
                contract_path: &contract,
                contract: parsed,
                run_id: &id,
                choice: &choice,
                detach,
            };
            let result = keel_engine::start(&mut store, new, &actor, &mut observer, &mut announce);
            if detach {
                let run = result?;
                let _ = writeln!(
                    out,
                    "{}: left for a worker (`keel worker` drives it)",
                    run.state
                );
                return Ok(exit::COMPLETED);
            }
            finish(&store, result, &observer)
        }
        Command::Resume {
            run,
            migrate,
            reason,
        } => {
            let mut store = open_store(cli.store)?;
            let options = ResumeOptions {
                migrate: if migrate { reason } else { None },
                lease_ttl_ms: None,
            };
            let mut observer = Terminal::new();
            let result = keel_engine::resume(&mut store, &run, &options, &actor, &mut observer);
            finish(&store, result, &observer)
        }
        Command::Unblock {
            run,
            budgets,
            reason,
        } => {
            let raises = budgets
                .iter()
                .map(|b| keel_core::budget::parse_raise(b).map_err(Usage))
                .collect::<Result<Vec<_>, _>>()?;
            let mut store = open_store(cli.store)?;
            let mut observer = Terminal::new();
            let result =
                keel_engine::unblock(&mut store, &run, &raises, &reason, &actor, &mut observer);
            finish(&store, result, &observer)
        }
        Command::Approvals { run, all, json } => {
            let store = open_store(cli.store)?;
            let runs = match run {
                Some(id) => vec![store.run(&store.resolve_run(&id)?)?],
                None => store.runs()?,
            };
            let list: Vec<(&Run, &keel_core::run::Approval)> = runs
                .iter()
                .flat_map(|r| r.approvals.iter().map(move |a| (r, a)))
                .filter(|(_, a)| all || a.decision.is_none())
                .collect();
            if json {
                let values = list
                    .iter()
                    .map(|(r, a)| print::approval_json(r, a))
                    .collect();
                print::json(&mut out, &serde_json::Value::Array(values))?;
            } else {
                print::approvals(&mut out, &list)?;
            }
            Ok(exit::COMPLETED)
        }
        Command::Approve {
            run,
            n,
            payload_hash,
            reason,
        } => decide(cli.store, &run, n, true, &payload_hash, &reason, &actor),
        Command::Reject {
            run,
            n,
            payload_hash,
            reason,
        } => decide(cli.store, &run, n, false, &payload_hash, &reason, &actor),
        Command::Worker {
            once,
            poll,
            lease_ttl,
        } => {
            let store_path = store_path(cli.store)?;
            for signal in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
                signal_hook::flag::register(signal, keel_engine::stop_flag())?;
            }
            let options = keel_engine::worker::WorkerOptions {
                actor: actor.clone(),
                lease_ttl_ms: i64::try_from(lease_ttl.as_millis()).unwrap_or(i64::MAX),
                poll,
                once,
            };
            let stop = std::sync::atomic::AtomicBool::new(false);
            let mut observer = Terminal::new();
            let report = keel_engine::worker::work(&store_path, &options, &stop, &mut observer)?;
            for (id, state) in &report.driven {
                let _ = writeln!(out, "run {id}: {state}");
            }
            for (id, error) in &report.errors {
                let _ = writeln!(out, "run {id}: not driven: {error}");
            }
            Ok(exit::COMPLETED)
        }
        Command::Serve { addr, token } => {
            let store = store_path(cli.store)?;
            let token = match token {
                Some(t) => t,
                None => keel_server::new_token()?,
            };
            if !addr.ip().is_loopback() {
                eprintln!(
                    "warning: serving on {addr}, which is not a loopback address: anyone who can reach it and has the token can approve"
                );
            }
            let config = keel_server::ServeConfig {
                store,
                addr,
                token: token.clone(),
            };
            keel_server::serve_with_ready(config, |bound| {
                let mut out = std::io::stdout().lock();
                let _ = writeln!(out, "keel serve on http://{bound}");
                let _ = writeln!(out, "open {}", keel_server::page_url(bound, &token));
                let _ = out.flush();
            })?;
            Ok(exit::COMPLETED)
        }
        Command::Answer { run, n, text } => {
            let mut store = open_store(cli.store)?;
            match keel_engine::answer(&mut store, &run, n, &text, &actor, "cli")? {
                keel_engine::Answered::Recorded(run) => {
                    let _ = writeln!(
                        out,
                        "question #{n} of run {} answered; `keel resume {}` (or a worker) goes on",
                        run.id, run.id
                    );
                    Ok(exit::COMPLETED)
                }
                keel_engine::Answered::Already { same: true, by } => {
                    let _ = writeln!(
                        out,
                        "question #{n} was already answered so by {by}; nothing changed"
                    );
                    Ok(exit::COMPLETED)
                }
                keel_engine::Answered::Already { same: false, by } => Err(Usage(format!(
                    "question #{n} was already answered by {by}; an answer cannot be changed"
                ))
                .into()),
            }
        }
        Command::Freeze { run, reason } => hold(cli.store, &run, true, &reason, &actor),
        Command::Unfreeze { run, reason } => hold(cli.store, &run, false, &reason, &actor),
        Command::Cancel { run, reason } => {
            let mut store = open_store(cli.store)?;
            let run = keel_engine::cancel(&mut store, &run, &reason, &actor)?;
            let _ = writeln!(out, "run {} cancelled: {}", run.id, run.reason);
            Ok(state_code(run.state))
        }
        Command::Status { run, json } => {
            let store = open_store(cli.store)?;
            match run {
                Some(id) => {
                    let id = store.resolve_run(&id)?;
                    let run = store.run(&id)?;
                    let checkpoints = store.checkpoints(&id)?;
                    if json {
                        print::json(&mut out, &print::run_json(&run, checkpoints.len()))?;
                    } else {
                        print::run_status(&mut out, &run, &checkpoints)?;
                    }
                    Ok(exit::COMPLETED)
                }
                None => {
                    let runs = store.runs()?;
                    if json {
                        let list: Vec<_> = runs
                            .iter()
                            .map(|r| print::run_json(r, r.checkpoints as usize))
                            .collect();
                        print::json(&mut out, &serde_json::Value::Array(list))?;
                    } else {
                        print::run_list(&mut out, &runs)?;
                    }
                    Ok(exit::COMPLETED)
                }
            }
        }
        Command::Log { run, json } => {
            let store = open_store(cli.store)?;
            let id = store.resolve_run(&run)?;
            let events = store.events_from(&id, 1)?;
            if json {
                let list = events.iter().map(print::event_json).collect::<Vec<_>>();
                print::json(&mut out, &serde_json::Value::Array(list))?;
            } else {
                print::timeline(&mut out, &events)?;
            }
            Ok(exit::COMPLETED)
        }
        Command::Effects { run, json } => {
            let store = open_store(cli.store)?;
            let id = store.resolve_run(&run)?;
            let events = store.events_from(&id, 1)?;
            let bodies = events
                .iter()
                .map(|e| {
                    keel_core::event::EventBody::decode(e.version, &e.body)
                        .map(|b| (e.seq, b))
                        .map_err(|err| anyhow::anyhow!("event {} of run {id}: {err}", e.seq))
                })
                .collect::<anyhow::Result<Vec<_>>>()?;
            let ledger = keel_core::effect::ledger(bodies.iter().map(|(seq, b)| (*seq, b)));
            if json {
                print::json(&mut out, &serde_json::to_value(&ledger)?)?;
            } else {
                print::effects(&mut out, &id, &ledger)?;
            }
            Ok(exit::COMPLETED)
        }
        Command::Checkpoints { run, json } => {
            let store = open_store(cli.store)?;
            let id = store.resolve_run(&run)?;
            let rows = store.checkpoints(&id)?;
            if json {
                let list = rows
                    .iter()
                    .map(|r| print::checkpoint_json(&id, r))
                    .collect::<Vec<_>>();
                print::json(&mut out, &serde_json::Value::Array(list))?;
            } else {
                print::checkpoints(&mut out, &id, &rows)?;
            }
            Ok(exit::COMPLETED)
        }
        Command::VerifyLog { run, json } => {
            let store = open_store(cli.store)?;
            let report = keel_engine::verify_log(&store, &run)?;
            if json {
                print::json(&mut out, &serde_json::to_value(&report)?)?;
            } else if report.ok() {
                writeln!(
                    out,
                    "ok: run {}: {} events in an unbroken chain, {} checkpoints, {} artifacts verified",
                    report.run, report.events, report.checkpoints, report.artifacts_checked
                )?;
            } else {
                writeln!(out, "DAMAGED: run {}", report.run)?;
                for p in &report.problems {
                    writeln!(out, "  {p}")?;
                }
            }
            Ok(if report.ok() {
                exit::COMPLETED
            } else {
                exit::FAILED
            })
        }
    }
}

/// Records a decision from the command line. A second delivery of the same decision changes
/// nothing and says so; a conflicting one is refused.
fn decide(
    store: Option<PathBuf>,
    run: &str,
    n: u32,
    approve: bool,
    payload_hash: &str,
    reason: &str,
    actor: &Actor,
) -> Result<u8> {
    let mut store = open_store(store)?;
    let word = if approve { "approved" } else { "rejected" };
    match keel_engine::decide(
        &mut store,
        run,
        n,
        approve,
        payload_hash,
        reason,
        actor,
        "cli",
    ) {
        Ok(keel_engine::Decided::Recorded(run)) => {
            println!(
                "request #{n} of run {} {word}; `keel resume {}` (or a worker) continues the run",
                run.id, run.id
            );
            Ok(exit::COMPLETED)
        }
        Ok(keel_engine::Decided::Already { same: true, by, .. }) => {
            println!("request #{n} was already {word} by {by}; nothing changed");
            Ok(exit::COMPLETED)
        }
        Ok(keel_engine::Decided::Already {
            same: false,
            by,
            approve: earlier,
        }) => Err(Usage(format!(
            "request #{n} was already {} by {by}; a decision cannot be changed",
            if earlier { "approved" } else { "rejected" }
        ))
        .into()),
        Err(keel_engine::DecisionError::Engine(e)) => Err(e.into()),
        Err(e) => Err(Usage(e.to_string()).into()),
    }
}

/// Freezes or unfreezes a run.
fn hold(
    store: Option<PathBuf>,
    run: &str,
    freeze: bool,
    reason: &str,
    actor: &Actor,
) -> Result<u8> {
    let mut store = open_store(store)?;
    let run = keel_engine::freeze(&mut store, run, freeze, reason, actor)?;
    println!(
        "run {} is {}",
        run.id,
        if run.frozen {
            "frozen: nothing runs until `keel unfreeze`"
        } else {
            "no longer frozen; `keel resume` goes on"
        }
    );
    Ok(exit::COMPLETED)
}

fn parse_driver_kind(text: &str) -> Result<keel_core::contract::DriverKind, String> {
    use keel_core::contract::DriverKind;
    match text {
        "openai" => Ok(DriverKind::Openai),
        "anthropic" => Ok(DriverKind::Anthropic),
        "command" => Ok(DriverKind::Command),
        "script" => Ok(DriverKind::Script),
        other => Err(format!(
            "`{other}` is not a driver; drivers are openai, anthropic, command and script"
        )),
    }
}

fn init(path: &Path, force: bool) -> Result<u8> {
    if path.exists() && !force {
        return Err(Usage(format!(
            "{} already exists; pass --force to overwrite it",
            path.display()
        ))
        .into());
    }
    std::fs::write(path, keel_core::contract::TEMPLATE)
        .with_context(|| format!("writing {}", path.display()))?;
    let _ = writeln!(
        std::io::stdout(),
        "wrote {}: edit its goal, phases and verifiers, then `keel run {}`",
        path.display(),
        path.display()
    );
    Ok(exit::COMPLETED)
}

/// The path of the store named by --store/KEEL_STORE, or of the nearest `.keel/keel.db`.
fn store_path(explicit: Option<PathBuf>) -> Result<PathBuf> {
    if let Some(path) = explicit {
        if !path.exists() {
            return Err(Usage(format!("no keel store at {}", path.display())).into());
        }
        return Ok(path);
    }
    let cwd = std::env::current_dir()?;
    for dir in cwd.ancestors() {
        let candidate = dir.join(".keel").join("keel.db");
        if candidate.exists() {
            return Ok(candidate);
        }
    }
    Err(Usage(format!(
        "no keel store (.keel/keel.db) in {} or its parents; pass --store PATH or run from the directory of your contract",
        cwd.display()
    ))
    .into())
}

/// The store named by --store/KEEL_STORE, or the nearest `.keel/keel.db` upwards from here.
fn open_store(explicit: Option<PathBuf>) -> Result<Store> {
    Ok(Store::open(&store_path(explicit)?)?)
}

fn finish(store: &Store, result: Result<Run, EngineError>, observer: &Terminal) -> Result<u8> {
    let run = match result {
        Ok(run) => run,
        // Another process took the run (for example `keel cancel`): say what became of it.
        Err(EngineError::Store(StoreError::LeaseLost { run, .. })) => {
            let now = store.run(&run)?;
            let _ = writeln!(
                std::io::stdout(),
                "run {run} was taken over by another process; it is {}: {}",
                now.state,
                now.reason
            );
            return Ok(state_code(now.state));
        }
        Err(e) => return Err(e.into()),
    };
    let run = &run;
    let elapsed = observer.started.elapsed();
    let steps = run.used(keel_core::budget::BudgetName::Steps);
    // The run's outcome is the exit code; a closed stdout does not change it.
    let mut out = std::io::stdout().lock();
    let _ = match run.state {
        RunState::Completed => writeln!(
            out,
            "completed: {} steps, {} evidence records, {} checkpoints ({:.1}s in this process)",
            steps,
            run.evidence_count,
            run.checkpoints,
            elapsed.as_secs_f64()
        ),
        state => writeln!(out, "{state}: {}", run.reason),
    };
    Ok(state_code(run.state))
}

/// Progress for a person at a terminal; nothing when stderr is piped.
struct Terminal {
    enabled: bool,
    started: Instant,
}

impl Terminal {
    fn new() -> Terminal {
        Terminal {
            enabled: std::io::stderr().is_terminal(),
            started: Instant::now(),
        }
    }
}

impl Observer for Terminal {
    fn progress(&mut self, run: &Run, progress: Progress<'_>) {
        if !self.enabled {
            return;
        }
        let secs = self.started.elapsed().as_secs();
        let clock = format!("[{:02}:{:02}]", secs / 60, secs % 60);
        let line = match progress {
            Progress::Phase { index, count, name } => {
                format!("{clock} phase {}/{count} {name}", index + 1)
            }
            Progress::Step {
                step,
                steps,
                attempt,
                command,
            } => {
                let retry = if attempt > 1 {
                    format!(" (attempt {attempt})")
                } else {
                    String::new()
                };
                format!(
                    "{clock}   step {step} of {steps}{retry}: {}",
                    print::shorten(command, 70)
                )
            }
            Progress::Verifier { name, tier } => format!("{clock}   verify {name} ({tier})"),
            Progress::Checkpoint { n } => format!("{clock}   checkpoint {n}"),
            Progress::Note(text) => format!("{clock}   {text}"),
        };
        let _ = run;
        eprintln!("{line}");
    }
}
