//! keel-engine: the runtime. It is the only code that changes a run: it asks keel-core what to
//! do next, does it (commands, verifiers, git snapshots), and records each outcome as events
//! through keel-store before acting on it further.
//!
//! Invariants:
//! - every state change is an event committed (fsynced, fencing token checked) before the next
//!   action; a process that lost its lease stops writing;
//! - an interrupted step is rolled back to the working tree it started from before it runs again,
//!   and what the tree held is kept under a ref;
//! - resume never continues silently in a changed environment.

mod agent;
mod approvals;
pub mod driver;
mod environment;
pub mod fault;
mod llm_driver;
mod mcp;
mod process;
pub mod secrets;

pub use process::{SMALL_HELPER, choose_helper, sandbox_helper, sandbox_main, set_sandbox_helper};
pub mod worker;

use std::path::{Path, PathBuf};
use std::time::Duration;

use keel_core::budget::BudgetName;
use keel_core::checkpoint::Checkpoint;
use keel_core::contract::{Contract, ContractError, PhaseKind, Tier, Verifier};
use keel_core::errorfp::error_fingerprint;
use keel_core::event::{
    ApprovalRequest, Block, Event, EventBody, Evidence, Gate, PhaseOutline, StepId,
};
use keel_core::fingerprint::{Fingerprint, FingerprintChange};
use keel_core::run::{ApplyError, Next, Run};
use keel_core::state::RunState;
use keel_git::{Git, GitError};
use keel_store::{ChainProblem, Lease, Store, StoreError, StoredEvent, verify_chain};

pub use approvals::{Answered, Decided, DecisionError, answer, decide, freeze};
use environment::Environment;
pub use environment::keel_excludes;

/// How long a lease lasts without a commit. A holder on this machine whose process is gone
/// loses it at once (see [`holder_is_stale`]).
pub(crate) const LEASE_TTL_MS: i64 = 5 * 60 * 1000;
/// How many changed paths a drift report names.
const NAMED_PATHS: usize = 10;
/// How many lines, and bytes, of a failing verifier's output its evidence keeps for a prompt.
const EXCERPT_LINES: usize = 40;
const EXCERPT_BYTES: usize = 3000;
/// How much of a failure's output is read to fingerprint it.
const FAILURE_TAIL_BYTES: u64 = 64 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Contract(#[from] ContractError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Git(#[from] GitError),
    #[error("cannot read the contract {path}: {source}")]
    ContractFile {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "the event log of run {run} is damaged: {problem}. keel does not repair damage in the middle of a log; the run will not resume. The log is left as it is for inspection (`keel verify-log {run}`)."
    )]
    DamagedLog { run: String, problem: String },
    #[error("run {run}: {source}")]
    Apply {
        run: String,
        #[source]
        source: ApplyError,
    },
    #[error("run {run}: the contract it was started with ({hash}) is missing from the store")]
    ContractMissing { run: String, hash: String },
    #[error("run {run} is {state}: {what}")]
    Refused {
        run: String,
        state: RunState,
        what: String,
    },
    #[error("{0}")]
    Usage(String),
    /// The tree the working tree must be put back to, or objects below it that putting it back
    /// needs, are gone from the repository (deleted, or lost with the disk), so what was
    /// interrupted cannot be undone.
    #[error(
        "run {run}: {what}, and the working tree it started from (tree {tree}) {gone} the \
         repository at {repo}, so keel cannot put back what it changed; put the repository's \
         objects back (from a backup, or a clone that has them) and resume, or end the run \
         with `keel cancel {run} --reason \"…\"`",
        gone = tree_gone(missing)
    )]
    TreeMissing {
        run: String,
        what: String,
        tree: String,
        repo: PathBuf,
        /// The objects below the tree that are gone; empty when the tree itself is.
        missing: Vec<keel_git::MissingObject>,
    },
    /// The engine went round its loop without recording anything: a keel bug, stopped rather
    /// than spun on.
    #[error(
        "run {run}: keel made no progress at {at} (the same state, no new event); this is a \
         keel bug: the run is left as it is, please report it with `keel log {run}`"
    )]
    Stuck { run: String, at: String },
}

impl EngineError {
    pub(crate) fn io(path: &Path, source: std::io::Error) -> EngineError {
        EngineError::Io {
            path: path.to_path_buf(),
            source,
        }
    }
}

/// What the engine tells a person while it works.
#[derive(Debug, Clone)]
pub enum Progress<'a> {
    Phase {
        index: u32,
        count: u32,
        name: &'a str,
    },
    Step {
        step: StepId,
        steps: u32,
        attempt: u32,
        command: &'a str,
    },
    Verifier {
        name: &'a str,
        tier: Tier,
    },
    Checkpoint {
        n: u32,
    },
    Note(&'a str),
}

pub trait Observer {
    fn progress(&mut self, run: &Run, progress: Progress<'_>);
}

/// An observer that shows nothing.
pub struct Quiet;
impl Observer for Quiet {
    fn progress(&mut self, _: &Run, _: Progress<'_>) {}
}

/// Who is acting, and where: recorded in the lease and in events that people cause.
#[derive(Debug, Clone)]
pub struct Actor {
    /// `host:pid:start` of this process.
    pub holder: String,
    /// The person (or account) behind a human action.
    pub by: String,
}

impl Actor {
    pub fn current() -> Actor {
        let pid = std::process::id();
        Actor {
            holder: format!("{}:{}:{}", hostname(), pid, process_start(pid).unwrap_or(0)),
            by: std::env::var("KEEL_USER")
                .or_else(|_| std::env::var("USER"))
                .unwrap_or_else(|_| "unknown".to_string()),
        }
    }
}

/// How a `TreeMissing` error says what is gone: the tree itself, or objects below it.
fn tree_gone(missing: &[keel_git::MissingObject]) -> String {
    if missing.is_empty() {
        "is no longer in".to_string()
    } else {
        format!(
            "has objects missing ({}) from",
            keel_git::list_missing(missing)
        )
    }
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "localhost".to_string())
}

/// The start time of a process (clock ticks since boot), to tell a live process from a new one
/// that reuses its pid; `None` when there is no such process, or it has exited and waits only
/// for its parent to reap it (a zombie: it writes nothing more).
fn process_start(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may contain spaces, so count after its `)`: field 3 is the
    // state, field 22 the start time.
    let mut fields = stat.rsplit_once(')')?.1.split_whitespace();
    if matches!(fields.next()?, "Z" | "X" | "x") {
        return None;
    }
    fields.nth(18)?.parse().ok()
}

/// A lease holder on this machine whose process no longer exists holds nothing.
pub fn holder_is_stale(holder: &str) -> bool {
    let mut parts = holder.rsplitn(3, ':');
    let (Some(start), Some(pid), Some(host)) = (parts.next(), parts.next(), parts.next()) else {
        return false;
    };
    if host != hostname() {
        return false;
    }
    let (Ok(pid), Ok(start)) = (pid.parse::<u32>(), start.parse::<u64>()) else {
        return false;
    };
    process_start(pid) != Some(start)
}

/// keel's clock, in milliseconds since the Unix epoch: every event's time and every lease and
/// request deadline comes from here.
///
/// `KEEL_CLOCK=MS` (for tests and the seeded simulation) makes it a fake clock that reads MS
/// at this process's first reading and runs on at the real rate from there, so a test can
/// place each process hours or days after the last one (a lease long expired, a request past
/// its deadline) without waiting. A value that is not a whole number is reported once on
/// stderr and the real clock is used.
pub fn now_ms() -> i64 {
    static FAKE: std::sync::OnceLock<Option<(i64, std::time::Instant)>> =
        std::sync::OnceLock::new();
    let fake = FAKE.get_or_init(|| {
        let value = std::env::var("KEEL_CLOCK").ok()?;
        match value.trim().parse::<i64>() {
            Ok(ms) => Some((ms, std::time::Instant::now())),
            Err(_) => {
                eprintln!(
                    "keel: KEEL_CLOCK={value:?} is not a number of milliseconds since 1970; \
                     using the real clock"
                );
                None
            }
        }
    });
    match fake {
        Some((start, at)) => {
            start.saturating_add(i64::try_from(at.elapsed().as_millis()).unwrap_or(i64::MAX))
        }
        None => std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
            .unwrap_or(0),
    }
}

/// A fresh run id: a UUIDv7, so ids sort by creation time.
pub fn new_run_id() -> String {
    uuid::Uuid::now_v7().simple().to_string()
}

/// Reads and validates a contract file. Errors name the file, line and column.
pub fn load_contract(path: &Path) -> Result<Contract, EngineError> {
    let source = std::fs::read_to_string(path).map_err(|source| EngineError::ContractFile {
        path: path.to_path_buf(),
        source,
    })?;
    Ok(Contract::parse(&path.display().to_string(), &source)?)
}

/// How many times the same error may occur when the contract sets no `same_error` budget.
pub const DEFAULT_SAME_ERROR: u64 = 3;

/// The driving side of one run in this process.
pub struct Engine<'a> {
    store: &'a mut Store,
    contract: Contract,
    run: Run,
    lease: Lease,
    env: Environment,
    observer: &'a mut dyn Observer,
    /// The workspace as agent tools see it: paths resolved so they cannot escape.
    tools: keel_tools::Workspace,
    /// The decision-maker of agent phases, when the contract has any.
    driver: Option<Box<dyn driver::Driver>>,
    lease_ttl_ms: i64,
    /// The contract's secret values known now: scrubbed from every event and artifact.
    scrubber: std::sync::Arc<keel_core::secret::Scrubber>,
    /// The contract's MCP servers, connected when the engine is made.
    mcp: mcp::McpTools,
    /// Events applied to `run` but not stored yet. What a step does inside keel (its start,
    /// a driver's reply, calls of keel's own read-only tools, its end when the next step's
    /// request is stored at once, a verifier's evidence, a checkpoint) changes nothing outside
    /// the process, so it waits for the next commit and is stored with it in one transaction.
    /// Anything that reaches outside (a command, a model that costs money, a network call, a
    /// person) commits first, and so does the end of the drive.
    staged: Vec<Event>,
    /// The checkpoint whose `checkpoint_taken` event is staged: its row is written in the same
    /// commit as the event.
    staged_checkpoint: Option<Checkpoint>,
    /// A commit or a staged event failed: `run` may hold events that were not stored, so this
    /// engine writes nothing more (the caller stops driving the run; a resume reads the log).
    /// Events are applied to `run` in place, with no copy kept to go back to.
    poisoned: bool,
    /// The agent step this process started (not one it took over after a crash): only its
    /// course is fully known here.
    fresh_step: Option<StepId>,
    /// The diff of the run's base against a tree, as last computed: (tree, files, lines).
    diff_cache: Option<(String, u64, u64)>,
    /// When the last command this run started before this process had ended with every
    /// process of it gone (its end file, read before this process ran any command); `None`
    /// when that is not known. A path changed after it was not changed by that command.
    commands_ended: Option<std::time::SystemTime>,
    /// The tools of the agent phase last asked for (see `phase_tools`).
    phase_tools: Option<(u32, std::sync::Arc<agent::PhaseTools>)>,
}

/// The file where a run's commands note their end (see `Confinement::note_ends_in`).
fn end_file(tmp: &Path, run_id: &str) -> PathBuf {
    tmp.join(format!("{run_id}.ended"))
}

/// Whether `change` (between two trees of the working tree at `workspace`) was made after
/// `ended`: the path's status change time (a deleted path's: its directory's) is later. A path
/// that cannot be looked at counts as not later.
fn changed_after(
    workspace: &Path,
    change: &keel_git::Change,
    ended: std::time::SystemTime,
) -> bool {
    use std::os::unix::fs::MetadataExt;
    let path = workspace.join(&change.path);
    // A deleted path's nearest directory still there was changed when it went.
    let meta = if change.status == 'D' {
        path.ancestors()
            .skip(1)
            .take_while(|p| p.starts_with(workspace))
            .find_map(|p| std::fs::symlink_metadata(p).ok())
    } else {
        std::fs::symlink_metadata(&path).ok()
    };
    let Some(meta) = meta else {
        return false;
    };
    let (Ok(secs), Ok(nanos)) = (
        u64::try_from(meta.ctime()),
        u32::try_from(meta.ctime_nsec()),
    ) else {
        return false;
    };
    std::time::UNIX_EPOCH + std::time::Duration::new(secs, nanos) > ended
}

/// What undoing an interrupted change of the working tree did.
struct Undone {
    /// Paths put back as they were.
    restored: Vec<String>,
    /// Paths changed after the run's last command had ended, left as they are.
    kept: Vec<String>,
    /// The ref that keeps the working tree as it was found.
    saved_ref: String,
}

/// The confinement of a run's commands from its contract; an error if the kernel cannot
/// enforce it. keel's store directory and the secrets file are invisible to every command.
fn confinement_for(
    contract: &Contract,
    env: &Environment,
) -> Result<process::Confinement, EngineError> {
    let store_dir = env.tmp.parent().unwrap_or(&env.workspace).to_path_buf();
    let protect = [secrets_file_in(&store_dir), store_dir];
    process::Confinement::new(
        &contract.sandbox,
        contract.scope.network,
        &env.workspace,
        &protect,
    )
    .map_err(EngineError::Usage)
}

/// Scrubs every string in `value` (map keys are names keel chose, not data); whether anything
/// changed.
fn scrub_strings(scrubber: &keel_core::secret::Scrubber, value: &mut serde_json::Value) -> bool {
    match value {
        serde_json::Value::String(s) => match scrubber.scrub(s) {
            std::borrow::Cow::Owned(clean) => {
                *s = clean;
                true
            }
            std::borrow::Cow::Borrowed(_) => false,
        },
        serde_json::Value::Array(items) => items
            .iter_mut()
            .fold(false, |changed, v| scrub_strings(scrubber, v) | changed),
        serde_json::Value::Object(map) => map
            .values_mut()
            .fold(false, |changed, v| scrub_strings(scrubber, v) | changed),
        _ => false,
    }
}

/// The secrets file of a store directory (see [`Engine::secrets_file`]).
fn secrets_file_in(store_dir: &Path) -> PathBuf {
    match std::env::var_os("KEEL_SECRETS_FILE") {
        Some(path) => PathBuf::from(path),
        None => store_dir.join("secrets"),
    }
}

/// Every secret the contract names whose value can be found now (in the environment or the
/// secrets file): what keel scrubs. One that cannot be found now is an error only when it is
/// used.
fn known_secrets(
    contract: &Contract,
    env: &Environment,
) -> Result<std::sync::Arc<keel_core::secret::Scrubber>, EngineError> {
    let file = secrets_file_in(env.tmp.parent().unwrap_or(&env.workspace));
    let file = file.exists().then_some(file.as_path());
    let mut found = Vec::new();
    for name in contract.secret_names() {
        match secrets::resolve(
            std::slice::from_ref(&name),
            &|n: &str| std::env::var(n).ok(),
            file,
        ) {
            Ok(mut s) => found.append(&mut s),
            Err(secrets::SecretError::NotSet { .. }) => {}
            Err(e) => return Err(EngineError::Usage(e.to_string())),
        }
    }
    keel_core::secret::Scrubber::new(found.iter())
        .map(std::sync::Arc::new)
        .map_err(|e| EngineError::Usage(e.to_string()))
}

/// Choices made on the command line for one run (driver kind, model), recorded with it.
pub use keel_core::event::DriverChoice as DriverOverride;

/// The driver of a contract's agent phases, with command-line overrides applied; `None` when
/// the contract has no agent phase. Secrets are read here, at the moment of use, and kept only in
/// memory.
pub fn make_driver(
    contract: &Contract,
    contract_dir: &Path,
    choice: &DriverOverride,
) -> Result<Option<Box<dyn driver::Driver>>, EngineError> {
    let has_agent = contract
        .phases
        .iter()
        .any(|p| matches!(p.kind, PhaseKind::Agent { .. }));
    let Some(d) = &contract.driver else {
        return Ok(None);
    };
    // The API key's variable is keel's alone: no command it runs sees it.
    if let Some(name) = d.api_key.as_deref().and_then(|k| k.strip_prefix("secret:")) {
        process::hide_from_commands(name);
    }
    if !has_agent && choice.kind.is_none() && choice.model.is_none() {
        return Ok(None);
    }
    let kind = choice.kind.unwrap_or(d.kind);
    let model = choice.model.clone().or_else(|| d.model.clone());
    use keel_core::contract::DriverKind;
    Ok(Some(match kind {
        DriverKind::Script => {
            let script = d.script.as_deref().ok_or_else(|| {
                EngineError::Usage("the script driver needs `script` in [driver]".into())
            })?;
            Box::new(
                driver::ScriptDriver::load(&contract_dir.join(script))
                    .map_err(|e| EngineError::Usage(e.0))?,
            )
        }
        DriverKind::Command => {
            let command = d.command.as_deref().ok_or_else(|| {
                EngineError::Usage("the command driver needs `command` in [driver]".into())
            })?;
            Box::new(driver::CommandDriver::new(command, d.timeout_ms))
        }
        DriverKind::Openai | DriverKind::Anthropic => {
            let model = model.ok_or_else(|| {
                EngineError::Usage(format!(
                    "the {kind} driver needs a model: set model in [driver] or pass --model"
                ))
            })?;
            llm_driver::make(kind, &model, d)?
        }
    }))
}

/// What a new run is made of.
pub struct NewRun<'a> {
    pub contract_path: &'a Path,
    /// Already validated.
    pub contract: Contract,
    pub run_id: &'a str,
    pub choice: &'a DriverOverride,
    /// Create the run and leave it for a worker instead of driving it.
    pub detach: bool,
}

/// Creates a run of a contract and drives it until it stops.
/// `on_created` receives the new run's id as soon as the run exists, before anything runs.
pub fn start(
    store: &mut Store,
    new: NewRun<'_>,
    actor: &Actor,
    observer: &mut dyn Observer,
    on_created: &mut dyn FnMut(&str),
) -> Result<Run, EngineError> {
    let NewRun {
        contract_path,
        contract,
        run_id,
        choice,
        detach,
    } = new;
    let (workspace, probe) = open_workspace(contract_path, &contract)?;
    let mut env = environment_from(store, &workspace, probe)?;
    // Refused before the run exists when the kernel cannot confine its commands.
    env.confinement = confinement_for(&contract, &env)?;
    env.confinement.note_ends_in(end_file(&env.tmp, run_id));
    let scrubber = known_secrets(&contract, &env)?;
    let base = env.fingerprint(&contract)?;
    let mut limits = contract.budget.clone();
    if limits.get(BudgetName::SameError).is_none() {
        limits.set(BudgetName::SameError, DEFAULT_SAME_ERROR);
    }
    let phases = contract
        .phases
        .iter()
        .map(|p| PhaseOutline {
            name: p.name.clone(),
            commands: match &p.kind {
                PhaseKind::Command { run, .. } => run.clone(),
                PhaseKind::Agent { .. } => Vec::new(),
            },
            agent: matches!(p.kind, PhaseKind::Agent { .. }),
            approval: p.approval,
        })
        .collect();
    let contract_dir = workspace_contract_dir(contract_path)?;
    let driver = make_driver(&contract, &contract_dir, choice)?;
    let tools = agent_workspace(&workspace)?;
    let created = Event {
        run_id: run_id.to_string(),
        seq: 1,
        at_ms: now_ms(),
        body: EventBody::RunCreated {
            contract_hash: contract.hash.clone(),
            contract_file: contract_path
                .canonicalize()
                .unwrap_or_else(|_| contract_path.to_path_buf())
                .display()
                .to_string(),
            workspace: workspace.display().to_string(),
            phases,
            acceptance: contract
                .verifiers_of(Tier::Acceptance)
                .map(|v| v.name.clone())
                .collect(),
            limits,
            base,
            keel_version: keel_core::KEEL_VERSION.to_string(),
            driver: (*choice != DriverOverride::default()).then(|| choice.clone()),
            sandbox_off: !contract.sandbox.enabled,
        },
    };
    let run = Run::create(&created).map_err(|source| EngineError::Apply {
        run: run_id.to_string(),
        source,
    })?;
    store.put_contract(&contract.hash, &run.contract_file, &contract.source)?;
    let now = now_ms();
    // The contract is stored in the run's creating commit.
    let lease = store.create_run(&created, &run, &actor.holder, now, LEASE_TTL_MS)?;
    on_created(run_id);
    fault::point("run created");
    if detach {
        // Left for a worker: the run exists, planned, and nobody holds it.
        store.release(&lease)?;
        return Ok(run);
    }
    store.set_scrubber(scrubber.clone());
    let mut engine = Engine {
        store,
        contract,
        run,
        lease,
        env,
        observer,
        tools,
        driver,
        scrubber,
        lease_ttl_ms: LEASE_TTL_MS,
        mcp: mcp::McpTools::default(),
        staged: Vec::new(),
        staged_checkpoint: None,
        poisoned: false,
        fresh_step: None,
        diff_cache: None,
        commands_ended: None,
        phase_tools: None,
    };
    engine.mcp = mcp::McpTools::connect(&engine.contract, &engine.env.workspace, &|names| {
        engine.secret_env(names)
    })
    .map_err(EngineError::Usage)?;
    // Stored with the run's first commit (the first checkpoint's): the run was created with
    // this process's lease, which the commit checks.
    engine.stage(vec![EventBody::Resumed {
        holder: actor.holder.clone(),
        lease: engine.lease.token,
        checkpoint: None,
    }])?;
    engine.drive()
}

fn workspace_contract_dir(contract_path: &Path) -> Result<PathBuf, EngineError> {
    Ok(contract_path
        .canonicalize()
        .map_err(|e| EngineError::io(contract_path, e))?
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from(".")))
}

/// The workspace as agent tools see it: keel's store directory is denied to them too.
fn agent_workspace(workspace: &Path) -> Result<keel_tools::Workspace, EngineError> {
    keel_tools::Workspace::new(workspace, &[]).map_err(|e| EngineError::Usage(e.to_string()))
}

/// The workspace a contract names (relative to the contract's directory), checked to be inside
/// a git repository. Call it before creating anything, so a bad workspace leaves no trace.
pub fn workspace_of(contract_path: &Path, contract: &Contract) -> Result<PathBuf, EngineError> {
    open_workspace(contract_path, contract).map(|(workspace, _)| workspace)
}

/// [`workspace_of`], and the repository it opened to check it (one git process, reused).
fn open_workspace(
    contract_path: &Path,
    contract: &Contract,
) -> Result<(PathBuf, Git), EngineError> {
    let contract_dir = contract_path
        .canonicalize()
        .map_err(|e| EngineError::io(contract_path, e))?
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."));
    let workspace_path = contract_dir.join(&contract.workspace.path);
    let workspace = workspace_path
        .canonicalize()
        .map_err(|e| EngineError::io(&workspace_path, e))?;
    let git = Git::open(&workspace, &[])?;
    Ok((workspace, git))
}

fn open_environment(store: &Store, workspace: &Path) -> Result<Environment, EngineError> {
    environment_from(store, workspace, Git::open(workspace, &[])?)
}

/// The run's environment on `probe`, the workspace's repository opened without excludes.
fn environment_from(
    store: &Store,
    workspace: &Path,
    probe: Git,
) -> Result<Environment, EngineError> {
    let store_dir = store
        .path()
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."));
    let excludes = keel_excludes(probe.root(), &store_dir);
    let git = probe.with_excludes(&excludes)?;
    let tmp = store_dir.join("tmp");
    std::fs::create_dir_all(&tmp).map_err(|e| EngineError::io(&tmp, e))?;
    Ok(Environment::new(git, workspace.to_path_buf(), tmp))
}

/// Options of a resume.
#[derive(Debug, Clone, Default)]
pub struct ResumeOptions {
    /// Continue in a changed environment, recording this reason.
    pub migrate: Option<String>,
    /// How long the lease lasts without a commit (default five minutes). Workers use a shorter
    /// one and renew it with a heartbeat.
    pub lease_ttl_ms: Option<i64>,
}

/// Set (by a signal handler) to make every driving loop stop at its next step boundary.
static STOP: std::sync::LazyLock<std::sync::Arc<std::sync::atomic::AtomicBool>> =
    std::sync::LazyLock::new(|| std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false)));

/// The flag that stops every driving loop of this process at its next step boundary (for
/// signal handlers: `signal_hook::flag::register(SIGTERM, stop_flag())`).
pub fn stop_flag() -> std::sync::Arc<std::sync::atomic::AtomicBool> {
    STOP.clone()
}

fn stop_requested() -> bool {
    STOP.load(std::sync::atomic::Ordering::SeqCst)
}

/// Loads a run from its newest valid checkpoint and the events after it, checks the log and
/// the environment, and drives it on.
pub fn resume(
    store: &mut Store,
    run_id: &str,
    options: &ResumeOptions,
    actor: &Actor,
    observer: &mut dyn Observer,
) -> Result<Run, EngineError> {
    let id = store.resolve_run(run_id)?;
    // An unreadable projection is rebuilt from the log below.
    let projected = match store.run(&id) {
        Ok(run) => Some(run),
        Err(StoreError::Projection { .. }) => None,
        Err(e) => return Err(e.into()),
    };
    let lease_ttl_ms = options.lease_ttl_ms.unwrap_or(LEASE_TTL_MS);
    let lease = store.acquire(
        &id,
        &actor.holder,
        now_ms(),
        lease_ttl_ms,
        false,
        &holder_is_stale,
    )?;
    // Checked even for a run that looks finished: its last event may be the torn one.
    let (run, checkpoint_n) = load_verified(store, &lease, &id, projected.as_ref())?;
    if run.state.is_terminal() {
        store.release(&lease)?;
        return Ok(run);
    }
    if run.frozen {
        store.release(&lease)?;
        return Err(EngineError::Refused {
            run: id,
            state: run.state,
            what: "it is frozen (an incident hold); lift it with `keel unfreeze RUN --reason \"…\"` first".into(),
        });
    }
    let source = stored_contract(store, &id, &run.contract_hash)?;
    let contract = Contract::parse(&run.contract_file, &source)?;
    let env = open_environment(store, Path::new(&run.workspace))?;
    let contract_dir = Path::new(&run.contract_file)
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."));
    let choice = run.driver.clone().unwrap_or_default();
    let driver = make_driver(&contract, &contract_dir, &choice)?;
    let tools = agent_workspace(Path::new(&run.workspace))?;
    let scrubber = known_secrets(&contract, &env)?;
    let mut env = env;
    // Read before any command of this process rewrites it.
    let commands_ended = std::fs::metadata(end_file(&env.tmp, &id))
        .and_then(|m| m.modified())
        .ok();
    env.confinement = confinement_for(&contract, &env)?;
    env.confinement.note_ends_in(end_file(&env.tmp, &id));
    store.set_scrubber(scrubber.clone());
    let mut engine = Engine {
        store,
        contract,
        run,
        lease,
        env,
        observer,
        tools,
        driver,
        scrubber,
        lease_ttl_ms,
        mcp: mcp::McpTools::default(),
        staged: Vec::new(),
        staged_checkpoint: None,
        poisoned: false,
        fresh_step: None,
        diff_cache: None,
        commands_ended,
        phase_tools: None,
    };
    engine.mcp = mcp::McpTools::connect(&engine.contract, &engine.env.workspace, &|names| {
        engine.secret_env(names)
    })
    .map_err(EngineError::Usage)?;
    // An interrupted command step is rolled back here; an interrupted agent step continues
    // from what it recorded when the run is driven.
    if let Some(p) = engine.run.in_progress.clone()
        && !p.agent
    {
        engine.recover(p.step)?;
    }
    engine.commit(vec![EventBody::Resumed {
        holder: actor.holder.clone(),
        lease: engine.lease.token,
        checkpoint: checkpoint_n,
    }])?;
    // A block whose cause is gone is lifted first, so that drift found now is what the run
    // reports; a drift block itself is settled by the drift check.
    let drift_block = matches!(engine.run.block, Some(Block::Drift { .. }));
    if engine.run.state == RunState::Blocked && !drift_block && !engine.lift_block()? {
        engine.release();
        return Ok(engine.run);
    }
    if !engine.check_drift(options, actor)? {
        engine.release();
        return Ok(engine.run);
    }
    if engine.run.state == RunState::AwaitingApproval && !engine.settle_approval()? {
        engine.release();
        return Ok(engine.run);
    }
    if engine.run.state == RunState::Waiting {
        match engine
            .run
            .questions
            .last()
            .and_then(|q| q.answer.clone().map(|a| (q.n, a)))
        {
            Some((n, a)) => engine.set_state(
                RunState::Executing,
                &format!("question {n} answered by {}", a.by),
                None,
            )?,
            None => {
                engine.release();
                return Ok(engine.run);
            }
        }
    }
    engine.drive()
}

/// Rebuilds the run from its newest valid checkpoint and the events after it, checking their
/// chain. A bad last event is a torn write: it is cut back (and the cut logged). Damage anywhere
/// else stops here.
fn load_verified(
    store: &mut Store,
    lease: &Lease,
    id: &str,
    projected: Option<&Run>,
) -> Result<(Run, Option<u32>), EngineError> {
    let id = id.to_string();
    // The newest checkpoint whose body matches the hash its event recorded; older ones are read
    // only when it does not.
    let mut base = None;
    if let Some(newest) = store.newest_checkpoint(&id)? {
        if checkpoint_is_valid(store, &id, &newest)? {
            base = Some(newest);
        } else {
            for row in store.checkpoints(&id)?.into_iter().rev() {
                if row.n < newest.n && checkpoint_is_valid(store, &id, &row)? {
                    base = Some(row);
                    break;
                }
            }
        }
    }
    let (mut run, anchor_seq, checkpoint_n) = match base {
        Some(row) => {
            let ck = row.decode(&id)?;
            (ck.run, ck.seq, Some(row.n))
        }
        None => {
            let first = first_event(store, &id)?;
            let run = Run::create(&first).map_err(|source| EngineError::Apply {
                run: id.clone(),
                source,
            })?;
            (run, 1, None)
        }
    };
    let tail = store.events_from(&id, anchor_seq)?;
    let anchor = tail.first().ok_or_else(|| EngineError::DamagedLog {
        run: id.clone(),
        problem: format!("event {anchor_seq} is missing"),
    })?;
    let problem = if anchor.seq != anchor_seq {
        return Err(EngineError::DamagedLog {
            run: id.clone(),
            problem: format!("event {anchor_seq} is missing"),
        });
    } else if anchor.computed_hash() != anchor.hash {
        Some(ChainProblem::Altered { seq: anchor.seq })
    } else {
        verify_chain(Some((anchor.seq, &anchor.hash)), tail.iter().skip(1)).err()
    };
    let log_end = tail.last().map_or(anchor_seq, |e| e.seq);
    let (projected_end, _) = store.log_head(&id)?;
    // A bad *last* event is a torn write, and so is a last write the projection recorded but
    // the log lost; both are cut back to the last whole event. Anything else is damage that
    // keel does not repair.
    let torn: Option<(u64, String)> = match problem {
        Some(p)
            if p.seq() == log_end
                && p.seq() > anchor_seq
                && matches!(
                    p,
                    ChainProblem::Altered { .. }
                        | ChainProblem::Undecodable { .. }
                        | ChainProblem::Unreadable { .. }
                        | ChainProblem::KindMismatch { .. }
                ) =>
        {
            Some((p.seq(), p.to_string()))
        }
        Some(p) => {
            return Err(EngineError::DamagedLog {
                run: id,
                problem: p.to_string(),
            });
        }
        None if projected_end > log_end => Some((
            log_end + 1,
            format!(
                "the projection records events up to {projected_end}, but the log ends at {log_end}: the last write was lost"
            ),
        )),
        None => None,
    };
    for stored in tail.iter().skip(1) {
        if torn.as_ref().is_some_and(|(seq, _)| stored.seq >= *seq) {
            break;
        }
        apply_stored(&mut run, stored)?;
    }
    if let Some((seq, why)) = torn {
        let event = Event {
            run_id: id.clone(),
            seq,
            at_ms: now_ms(),
            body: EventBody::TailCut {
                seq,
                reason: format!("torn last write cut back: {why}"),
            },
        };
        run.apply(&event).map_err(|source| EngineError::Apply {
            run: id.clone(),
            source,
        })?;
        store.cut_tail(lease, seq, &[event], &run, now_ms() + LEASE_TTL_MS)?;
    } else if projected != Some(&run) {
        // The projection disagrees with the log (or does not decode): the log wins.
        store.replace_projection(lease, &run)?;
    }
    Ok((run, checkpoint_n))
}

/// A checkpoint row is valid when the event after it is its intact `checkpoint_taken` and the
/// body has the hash that event recorded.
fn checkpoint_is_valid(
    store: &Store,
    id: &str,
    row: &keel_store::CheckpointRow,
) -> Result<bool, EngineError> {
    let Some(event) = store.event(id, row.seq + 1)? else {
        return Ok(false);
    };
    let recorded = match event.decode() {
        Ok(Event {
            body: EventBody::CheckpointTaken { n, hash, .. },
            ..
        }) => n == row.n && hash == row.hash,
        _ => false,
    };
    Ok(recorded
        && event.computed_hash() == event.hash
        && blake3::hash(row.body.as_bytes()).to_hex().as_str() == row.hash)
}

fn first_event(store: &Store, id: &str) -> Result<Event, EngineError> {
    let e = store.event(id, 1)?.ok_or_else(|| EngineError::DamagedLog {
        run: id.to_string(),
        problem: "the log has no events".into(),
    })?;
    Ok(e.decode()?)
}

fn apply_stored(run: &mut Run, stored: &StoredEvent) -> Result<(), EngineError> {
    let event = stored.decode()?;
    // A fold stops at its first bad event: no copy is needed to keep the run whole.
    run.apply_in_place(&event)
        .map_err(|source| EngineError::Apply {
            run: run.id.clone(),
            source,
        })
}

/// The run a person acts on by hand (`keel unblock`, `cancel`, `freeze`), with its id: it must
/// not have finished (`finished` says why not, in the refusal), and the act (`act`, "cancelling")
/// must give a reason, as it is recorded with who and why.
pub(crate) fn unfinished_run(
    store: &mut Store,
    run_id: &str,
    reason: &str,
    finished: &str,
    act: &str,
) -> Result<(String, Run), EngineError> {
    let id = store.resolve_run(run_id)?;
    let run = store.run(&id)?;
    if run.state.is_terminal() {
        return Err(EngineError::Refused {
            run: id,
            state: run.state,
            what: finished.into(),
        });
    }
    if reason.trim().is_empty() {
        return Err(EngineError::Usage(format!(
            "give a --reason: {act} is recorded with who and why"
        )));
    }
    Ok((id, run))
}

/// Raises budgets of a blocked run (each recorded with who and why), then resumes it.
pub fn unblock(
    store: &mut Store,
    run_id: &str,
    raises: &[(BudgetName, u64)],
    reason: &str,
    actor: &Actor,
    observer: &mut dyn Observer,
) -> Result<Run, EngineError> {
    let (id, run) = unfinished_run(
        store,
        run_id,
        reason,
        "a finished run cannot be unblocked",
        "raising a budget",
    )?;
    // What resume will need must be at hand before anything is raised: a raise that cannot be
    // followed by a resume would be repeated by the next attempt.
    let source = stored_contract(store, &id, &run.contract_hash)?;
    let contract = Contract::parse(&run.contract_file, &source)?;
    let contract_dir = Path::new(&run.contract_file)
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."));
    make_driver(
        &contract,
        &contract_dir,
        &run.driver.clone().unwrap_or_default(),
    )?;
    let lease = store.acquire(
        &id,
        &actor.holder,
        now_ms(),
        LEASE_TTL_MS,
        false,
        &holder_is_stale,
    )?;
    let mut next = run.clone();
    let mut events = Vec::new();
    let mut append = |next: &mut Run, body: EventBody| -> Result<(), EngineError> {
        let event = Event {
            run_id: id.clone(),
            seq: next.seq + 1,
            at_ms: now_ms(),
            body,
        };
        next.apply(&event).map_err(|source| EngineError::Apply {
            run: id.clone(),
            source,
        })?;
        events.push(event);
        Ok(())
    };
    for (budget, by) in raises {
        let Some(from) = next.limits.get(*budget) else {
            return Err(EngineError::Usage(format!(
                "budget `{budget}` has no limit in this run, so there is nothing to raise"
            )));
        };
        append(
            &mut next,
            EventBody::BudgetRaised {
                budget: *budget,
                from: Some(from),
                to: from.saturating_add(*by),
                reason: reason.to_string(),
                by: actor.by.clone(),
            },
        )?;
    }
    // The request that stands beside the block asked a person for this raise; the person
    // answered on the command line, so it is closed, not left in the inbox to be approved later.
    let beside = next.pending_approval().and_then(|a| match a.request.gate {
        Gate::BudgetRaise { budget, .. } if raises.iter().any(|(b, _)| *b == budget) => {
            Some((a.request.n, a.request.payload_hash.clone()))
        }
        _ => None,
    });
    if let Some((n, payload_hash)) = beside {
        append(
            &mut next,
            EventBody::ApprovalDecided {
                n,
                approve: true,
                payload_hash,
                by: actor.by.clone(),
                reason: format!("settled with `keel unblock`: {reason}"),
                via: SETTLED_ON_THE_COMMAND_LINE.into(),
            },
        )?;
    }
    store.commit(&lease, &events, &next, None, now_ms() + LEASE_TTL_MS)?;
    store.release(&lease)?;
    resume(store, &id, &ResumeOptions::default(), actor, observer)
}

/// The `via` of a decision keel records when a person settles a block on the command line
/// (`keel unblock`, `keel resume --migrate`) while a request for the same thing waits in the
/// inbox: the request is closed with what the person did, and carries nothing more out.
pub const SETTLED_ON_THE_COMMAND_LINE: &str = "command line";

/// Stops a run for good as `failed`, recording who and why. A process driving it loses its
/// lease and stops at its next write.
pub fn cancel(
    store: &mut Store,
    run_id: &str,
    reason: &str,
    actor: &Actor,
) -> Result<Run, EngineError> {
    let (id, _) = unfinished_run(
        store,
        run_id,
        reason,
        "it has already finished",
        "cancelling",
    )?;
    let lease = store.acquire(&id, &actor.holder, now_ms(), LEASE_TTL_MS, true, &|_| true)?;
    let mut next = store.run(&id)?;
    let at = now_ms();
    let events = vec![
        Event {
            run_id: id.clone(),
            seq: next.seq + 1,
            at_ms: at,
            body: EventBody::Cancelled {
                reason: reason.to_string(),
                by: actor.by.clone(),
            },
        },
        Event {
            run_id: id.clone(),
            seq: next.seq + 2,
            at_ms: at,
            body: EventBody::StateChanged {
                from: next.state,
                to: RunState::Failed,
                reason: format!("cancelled by {}: {reason}", actor.by),
                block: None,
            },
        },
    ];
    for e in &events {
        next.apply(e).map_err(|source| EngineError::Apply {
            run: id.clone(),
            source,
        })?;
    }
    store.commit(&lease, &events, &next, None, 0)?;
    store.release(&lease)?;
    Ok(next)
}

/// The result of checking a whole log.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct LogReport {
    pub run: String,
    pub events: u64,
    pub checkpoints: u32,
    pub artifacts_checked: u64,
    pub problems: Vec<String>,
}

impl LogReport {
    pub fn ok(&self) -> bool {
        self.problems.is_empty()
    }
}

/// Checks a run's whole log: sequence numbers, the hash chain, every body decodes and folds
/// legally, checkpoints match their events, the projection matches the log's end, artifacts
/// named by evidence and checkpoints exist with the content their name says.
pub fn verify_log(store: &Store, run_id: &str) -> Result<LogReport, EngineError> {
    let id = store.resolve_run(run_id)?;
    let mut problems = Vec::new();
    let mut expected = 1u64;
    let mut prev = keel_core::event::GENESIS_HASH.to_string();
    let mut run: Option<Run> = None;
    let mut checkpoint_hashes = std::collections::BTreeMap::new();
    // Every step's output, also of the settled steps a long run's projection let go.
    let mut step_outputs = std::collections::BTreeSet::new();
    store.for_each_event(&id, 1, |e| {
        if problems.is_empty() {
            // The anchor of the first event is (0, the genesis hash): the same check as `None`.
            let checked =
                verify_chain(Some((expected - 1, &prev)), std::iter::once(&e)).map(|_| ());
            match checked {
                Err(p) => problems.push(p.to_string()),
                Ok(()) => match e.decode() {
                    Ok(event) => {
                        match &event.body {
                            EventBody::CheckpointTaken { n, hash, .. } => {
                                checkpoint_hashes.insert(*n, hash.clone());
                            }
                            EventBody::StepFinished { output, .. } => {
                                step_outputs.insert(output.clone());
                            }
                            _ => {}
                        }
                        let folded = match run.as_mut() {
                            None => Run::create(&event).map(|r| run = Some(r)),
                            Some(r) => r.apply(&event),
                        };
                        if let Err(err) = folded {
                            problems.push(format!("event {}: {err}", e.seq));
                        }
                    }
                    Err(err) => problems.push(err.to_string()),
                },
            }
        }
        prev = e.hash.clone();
        expected = e.seq + 1;
        Ok(())
    })?;
    let events = expected - 1;
    let (head_seq, head_hash) = store.log_head(&id)?;
    if problems.is_empty() && (head_seq != events || head_hash != prev) {
        problems.push(format!(
            "the run's projection says the log ends at event {head_seq}, but it ends at {events}"
        ));
    }
    problems.extend(store.unsound_log_rows(&id)?);
    let rows = store.checkpoints(&id)?;
    // Checkpoint rows are only removed with the events that took them (a tail cut), so every
    // checkpoint the log took has its row.
    for (n, _) in checkpoint_hashes
        .iter()
        .filter(|(n, _)| !rows.iter().any(|row| row.n == **n))
    {
        problems.push(format!(
            "checkpoint {n} was taken in the log but its row is missing from the store"
        ));
    }
    let mut artifacts = step_outputs;
    for row in &rows {
        let body_hash = blake3::hash(row.body.as_bytes()).to_hex().to_string();
        match checkpoint_hashes.get(&row.n) {
            Some(h) if *h == row.hash && body_hash == row.hash => {}
            Some(_) => problems.push(format!(
                "checkpoint {} does not match the hash its checkpoint_taken event recorded",
                row.n
            )),
            None => problems.push(format!(
                "checkpoint {} has no checkpoint_taken event in the log",
                row.n
            )),
        }
        if let Ok(ck) = row.decode(&id) {
            artifacts.extend(ck.artifacts);
        }
    }
    if let Some(r) = &run {
        match stored_contract(store, &id, &r.contract_hash) {
            Ok(_) => {}
            Err(EngineError::DamagedLog { problem, .. }) => problems.push(problem),
            Err(e @ EngineError::ContractMissing { .. }) => problems.push(e.to_string()),
            Err(e) => return Err(e),
        }
        artifacts.extend(r.artifacts());
        match store.run(&id) {
            Ok(projected) if problems.is_empty() && *r != projected => problems.push(
                "the run's projection disagrees with its log; `keel resume` rebuilds it"
                    .to_string(),
            ),
            Ok(_) => {}
            Err(e @ StoreError::Projection { .. }) => problems.push(e.to_string()),
            Err(e) => return Err(e.into()),
        }
    }
    // One pass over the run's rows for the artifacts stored with its events.
    for hash in store.unsound_run_artifacts(&id, &artifacts)? {
        problems.push(format!(
            "artifact {hash} is missing or does not match its hash"
        ));
    }
    Ok(LogReport {
        run: id,
        events,
        checkpoints: rows.len() as u32,
        artifacts_checked: artifacts.len() as u64,
        problems,
    })
}

/// The exact contract text a run was started with, checked against its hash (the contract
/// version): a stored text that no longer matches is damage, never a contract to run.
fn stored_contract(store: &Store, run: &str, hash: &str) -> Result<String, EngineError> {
    let (_, source) = store
        .contract(hash)?
        .ok_or_else(|| EngineError::ContractMissing {
            run: run.to_string(),
            hash: hash.to_string(),
        })?;
    if blake3::hash(source.as_bytes()).to_hex().as_str() != hash {
        return Err(EngineError::DamagedLog {
            run: run.to_string(),
            problem: format!("the stored text of its contract does not match its hash {hash}"),
        });
    }
    Ok(source)
}

impl Engine<'_> {
    /// Appends events (applied to a copy of the run first, so an illegal one changes nothing)
    /// and commits them with the projection in one transaction.
    /// The staged events and checkpoint are stored with them.
    fn commit(&mut self, bodies: Vec<EventBody>) -> Result<(), EngineError> {
        self.store_events(bodies, false)
    }

    /// [`Engine::commit`]; with `release`, the lease is given back in the same transaction.
    fn store_events(&mut self, bodies: Vec<EventBody>, release: bool) -> Result<(), EngineError> {
        self.check_poisoned()?;
        let at_ms = now_ms();
        // Staged events are already applied to `run`; these are applied after them.
        let mut events = std::mem::take(&mut self.staged);
        let checkpoint = self.staged_checkpoint.take();
        self.poisoned = true;
        apply_bodies(&self.scrubber, &mut self.run, bodies, at_ms, &mut events)?;
        fault::point("before commit");
        if release {
            self.store
                .commit_and_release(&self.lease, &events, &self.run, checkpoint.as_ref())?;
        } else {
            self.store.commit(
                &self.lease,
                &events,
                &self.run,
                checkpoint.as_ref(),
                at_ms + self.lease_ttl_ms,
            )?;
        }
        self.poisoned = false;
        fault::point("after commit");
        Ok(())
    }

    /// Applies `bodies` to `run` and keeps them to be stored with the next commit (see
    /// `staged`). Only for events that record what happened inside keel: nothing outside may
    /// have acted on them.
    fn stage(&mut self, bodies: Vec<EventBody>) -> Result<(), EngineError> {
        self.check_poisoned()?;
        self.poisoned = true;
        apply_bodies(
            &self.scrubber,
            &mut self.run,
            bodies,
            now_ms(),
            &mut self.staged,
        )?;
        self.poisoned = false;
        Ok(())
    }

    fn check_poisoned(&self) -> Result<(), EngineError> {
        if self.poisoned {
            return Err(EngineError::Usage(format!(
                "run {}: a write failed earlier in this process, which stops driving the run; \
                 `keel resume {}` goes on from what is stored",
                self.run.id, self.run.id
            )));
        }
        Ok(())
    }

    /// Stores the staged events, if any, before something reaches outside the process: every
    /// command (a step's, a verifier's, a tool's, the notify command), every request to a
    /// model that costs money, every call of a tool outside keel, every wait for a person.
    fn flush(&mut self) -> Result<(), EngineError> {
        if self.staged.is_empty() {
            return Ok(());
        }
        self.commit(Vec::new())
    }

    fn release(&mut self) {
        // Best effort: a lease that is not released expires, and a dead holder is seen as such.
        let _ = self.store.release(&self.lease);
        self.forget_commands();
    }

    /// A finished run starts no command again: its end file has nothing more to tell.
    fn forget_commands(&self) {
        if self.run.state.is_terminal() {
            let _ = std::fs::remove_file(end_file(&self.env.tmp, &self.run.id));
        }
    }

    fn drive(mut self) -> Result<Run, EngineError> {
        let result = self.drive_loop();
        match result {
            // What is staged is stored, and the lease given back, in one commit.
            Ok(()) if !self.staged.is_empty() => {
                let stored = self.store_events(Vec::new(), true);
                if stored.is_err() {
                    self.release();
                } else {
                    self.forget_commands();
                }
                stored.map(|()| self.run)
            }
            _ => {
                self.release();
                result.map(|()| self.run)
            }
        }
    }

    fn drive_loop(&mut self) -> Result<(), EngineError> {
        let mut last: Option<(u64, usize, RunState, Next)> = None;
        loop {
            // A stop request (SIGTERM to a worker) is honoured at a step boundary: the lease is
            // released and the run is left for the next process.
            if stop_requested() && self.run.in_progress.is_none() {
                return Ok(());
            }
            // Every move records something (an event, staged or stored) or changes the state;
            // the same move from the same place again would repeat forever.
            let next = self.run.next();
            let here = (self.run.seq, self.staged.len(), self.run.state, next);
            if last.as_ref() == Some(&here) {
                return Err(EngineError::Stuck {
                    run: self.run.id.clone(),
                    at: format!("{next:?} in state {}", self.run.state),
                });
            }
            last = Some(here);
            match next {
                Next::Stop => return Ok(()),
                Next::RequestApproval(phase) => self.request_phase_approval(phase)?,
                Next::Recover(step) if self.is_agent_phase(step.phase) => {
                    self.agent_step(step)?;
                    self.after_step()?;
                }
                Next::Recover(step) => self.recover(step)?,
                Next::Checkpoint => self.checkpoint()?,
                Next::Step(step) => {
                    if let Some(stop) = self.run.budget_stop_before_step() {
                        self.stop_for_budget(stop)?;
                        continue;
                    }
                    if self.is_agent_phase(step.phase) {
                        self.agent_step(step)?;
                    } else {
                        self.step(step)?;
                    }
                    self.after_step()?;
                }
                Next::VerifyPhase(phase) if self.is_agent_phase(phase) => {
                    self.verify_agent_claim(phase)?;
                    self.after_step()?;
                }
                Next::VerifyPhase(phase) => self.verify_phase(phase)?,
                Next::Accept => self.accept()?,
                Next::Complete => self.stage_state(
                    RunState::Completed,
                    "every acceptance verifier passed with stored evidence",
                )?,
            }
        }
    }

    fn is_agent_phase(&self, phase: u32) -> bool {
        self.run.phases.get(phase as usize).is_some_and(|p| p.agent)
    }

    /// Stores `last`, the events that end a step or a phase's verification, and in the same
    /// commit the stop they lead to: a loop the step `completes` (an agent step's id), or a
    /// budget the work went over. With a crash or a failed commit between the two, the resumed
    /// run would not see the stop: it takes another step, or goes on to accept the run.
    pub(crate) fn commit_then_stop(
        &mut self,
        last: Vec<EventBody>,
        completes: Option<StepId>,
    ) -> Result<(), EngineError> {
        let phase_verified = last
            .iter()
            .any(|b| matches!(b, EventBody::PhaseVerified { .. }));
        self.stage(last)?;
        if !self.run.state.needs_human() && !self.run.state.is_terminal() {
            if let Some(id) = completes
                && let Some(pattern) = self.run.loop_detected()
            {
                return self.block_loop(id, pattern, None);
            }
            if let Some(stop) = self.run.budget_stop_after_step() {
                return self.stop_for_budget(stop);
            }
        }
        // An agent step's end waits for the next step's request when that is stored before it
        // is sent: every way on from here (the next request, a verifier, a wait, the end of the
        // drive) commits first, and nothing but keel's own work comes in between. With a local
        // driver nothing would be stored until the run stops; its steps commit one by one.
        // A phase's verification waits for its checkpoint, which is taken next and stored with
        // whatever follows it (the next step's start or request, or the run's end).
        if (completes.is_some() && self.requests_are_stored()) || phase_verified {
            return Ok(());
        }
        self.flush()
    }

    /// Whether the driver's requests are stored before they are sent (a model that costs
    /// money, a program that acts).
    pub(crate) fn requests_are_stored(&self) -> bool {
        self.driver.as_ref().is_some_and(|d| !d.local())
    }

    /// Budgets a step may have gone over stop the run (if it is still going). The step's own
    /// last commit has stopped on them already ([`Engine::commit_then_stop`]) where it could.
    fn after_step(&mut self) -> Result<(), EngineError> {
        if self.run.state.needs_human() || self.run.state.is_terminal() {
            return Ok(());
        }
        if let Some(stop) = self.run.budget_stop_after_step() {
            self.stop_for_budget(stop)?;
        }
        Ok(())
    }

    /// Blocks on an exhausted budget. In an agent phase, the budgets that bound retrying
    /// (`same_error`, `no_progress_steps`) mean the driver's approach failed: it is recorded as
    /// a rejected path too, so a resumed run is told not to try it again.
    fn stop_for_budget(&mut self, stop: keel_core::event::BudgetStop) -> Result<(), EngineError> {
        let retrying = matches!(
            stop.budget,
            BudgetName::SameError | BudgetName::NoProgressSteps
        );
        let last_agent_step = self
            .run
            .phases
            .get(self.run.cursor as usize)
            .filter(|p| p.agent && p.step_count() > 0)
            .map(|p| StepId {
                phase: self.run.cursor,
                index: p.step_count() - 1,
            });
        match last_agent_step {
            Some(step) if retrying => {
                let pattern = stop.budget.as_str().to_string();
                self.block_loop(step, &pattern, Some(stop))
            }
            _ => self.block_budget(stop),
        }
    }

    fn set_state(
        &mut self,
        to: RunState,
        reason: &str,
        block: Option<Block>,
    ) -> Result<(), EngineError> {
        if self.run.state == to {
            return Ok(());
        }
        self.commit(vec![self.state_change(to, reason, block)])
    }

    /// [`Engine::set_state`], stored with the next commit: for a change that only leads to
    /// more of keel's own work or to a commit (running a verifier commits first; the end of
    /// the drive does).
    fn stage_state(&mut self, to: RunState, reason: &str) -> Result<(), EngineError> {
        if self.run.state == to {
            return Ok(());
        }
        let change = self.state_change(to, reason, None);
        self.stage(vec![change])
    }

    fn state_change(&self, to: RunState, reason: &str, block: Option<Block>) -> EventBody {
        EventBody::StateChanged {
            from: self.run.state,
            to,
            reason: reason.to_string(),
            block,
        }
    }

    fn block_budget(&mut self, stop: keel_core::event::BudgetStop) -> Result<(), EngineError> {
        let reason = format!(
            "{stop}; raise it with `keel unblock {} --budget {}=+N --reason \"…\"`",
            self.run.id, stop.budget
        );
        // The block and the request to raise the budget are stored in one commit: a failure
        // between them must not leave a block whose request never reached the inbox.
        if self.run.state != RunState::Blocked {
            let change = self.state_change(
                RunState::Blocked,
                &reason,
                Some(Block::Budget(stop.clone())),
            );
            self.stage(vec![change])?;
        }
        self.request_budget_raise(&stop)?;
        self.flush()
    }

    fn phase_outline(&self, phase: u32) -> (String, Vec<String>, u64, Vec<String>) {
        match self.contract.phases.get(phase as usize) {
            Some(p) => match &p.kind {
                PhaseKind::Command { run, timeout_ms } => {
                    (p.name.clone(), run.clone(), *timeout_ms, p.gate.clone())
                }
                PhaseKind::Agent { timeout_ms, .. } => {
                    (p.name.clone(), Vec::new(), *timeout_ms, p.gate.clone())
                }
            },
            None => (String::new(), Vec::new(), 0, Vec::new()),
        }
    }

    fn step(&mut self, id: StepId) -> Result<(), EngineError> {
        let (phase_name, commands, timeout_ms, _) = self.phase_outline(id.phase);
        let command = commands.get(id.index as usize).cloned().unwrap_or_default();
        let attempt = self.run.step(id).map(|s| s.attempts).unwrap_or(0) + 1;
        let mut bodies = Vec::new();
        if self.run.state != RunState::Executing {
            bodies.push(self.state_change(RunState::Executing, "working on the next step", None));
        }
        let phase_fresh = self
            .run
            .phases
            .get(id.phase as usize)
            .is_some_and(|p| p.earlier == 0 && p.steps.iter().all(|s| s.attempts == 0));
        if phase_fresh {
            self.observer.progress(
                &self.run,
                Progress::Phase {
                    index: id.phase,
                    count: self.run.phases.len() as u32,
                    name: &phase_name,
                },
            );
            bodies.push(EventBody::PhaseStarted {
                phase: id.phase,
                name: phase_name.clone(),
            });
        }
        // Secrets are resolved before the step starts: a missing one stops here, with nothing
        // half done, and `keel resume` tries again once it is set.
        let names = self
            .contract
            .phases
            .get(id.phase as usize)
            .map(|p| p.secrets.clone())
            .unwrap_or_default();
        let secret_env = self.secret_env(&names).map_err(|e| {
            EngineError::Usage(format!(
                "phase `{phase_name}` cannot start step {id}: {e}; then `keel resume {}`",
                self.run.id
            ))
        })?;
        bodies.push(EventBody::StepStarted {
            step: id,
            attempt,
            command: command.clone(),
            agent: false,
        });
        let pre_tree = self.run.fingerprint.tree.clone();
        self.pin_tree("step", &pre_tree)?;
        self.commit(bodies)?;
        self.observer.progress(
            &self.run,
            Progress::Step {
                step: id,
                steps: commands.len() as u32,
                attempt,
                command: &command,
            },
        );
        // A step may not outlast the run's wall-time budget.
        let mut timeout = Duration::from_millis(timeout_ms);
        if let Some(limit) = self.run.limits.get(BudgetName::WallTime) {
            let left = limit.saturating_sub(self.run.used(BudgetName::WallTime));
            timeout = timeout.min(Duration::from_millis(left.max(1)));
        }
        let out = self.output_path("step");
        let mut env: Vec<(&str, String)> = self.command_env(Some(id));
        env.extend(secret_env.iter().map(|(k, v)| (k.as_str(), v.clone())));
        let outcome = self
            .run_program(process::Program::Shell(&command), &env, &out, timeout, None)
            .map_err(|e| EngineError::io(&out, e))?;
        fault::point("command ended");
        let output = self.store.artifacts().put_file(&out)?;
        // The artifact holds the output from here on.
        let _ = std::fs::remove_file(&out);
        let stored = self.store.artifacts().path(&output);
        let post = self.env.fingerprint(&self.contract)?;
        let base_tree = self.run.base.tree.clone();
        let whole = self.env.git.diff(&base_tree, &post.tree)?;
        let this_step = if post.tree == pre_tree {
            0
        } else {
            self.env.git.diff(&pre_tree, &post.tree)?.files_changed
        };
        self.commit(vec![EventBody::StepFinished {
            step: id,
            signature: None,
            status: outcome.status.clone(),
            success: outcome.success,
            duration_ms: outcome.duration_ms,
            cpu_ms: outcome.cpu_ms,
            output: output.clone(),
            post: post.clone(),
            files_written: this_step,
            diff_files: whole.files_changed,
            diff_lines: whole.lines_added + whole.lines_removed,
        }])?;
        if !outcome.success {
            let what = format!("step {id}");
            let reason = format!("`{command}` ended with {}", outcome.status);
            return self.fail_step(id, &what, &reason, &outcome.status, &read_tail(&stored));
        }
        if post.tree != pre_tree {
            let verifiers: Vec<Verifier> =
                self.contract.verifiers_of(Tier::Step).cloned().collect();
            for v in verifiers {
                let evidence = self.run_verifier(&v, Some(id), None, &post)?;
                if !evidence.passed {
                    let reason = format!(
                        "step verifier `{}` failed ({}), evidence #{}",
                        v.name, evidence.status, evidence.n
                    );
                    let tail = self.output_tail(&evidence.output)?;
                    return self.fail_step(id, &v.name, &reason, &evidence.status, &tail);
                }
            }
        }
        self.commit_then_stop(vec![EventBody::StepVerified { step: id }], None)
    }

    /// Records a failed step, rolled back to the tree it started from.
    fn fail_step(
        &mut self,
        id: StepId,
        what: &str,
        reason: &str,
        status: &str,
        output_tail: &str,
    ) -> Result<(), EngineError> {
        let (fp, excerpt) = error_fingerprint(what, status, output_tail);
        let pre_tree = self
            .run
            .in_progress
            .as_ref()
            .map(|p| p.pre.tree.clone())
            .unwrap_or_default();
        let rolled_back = self.put_back(&pre_tree, &format!("step {id} failed"), false)?;
        fault::point("failed step rolled back");
        self.commit(vec![EventBody::StepFailed {
            step: id,
            reason: reason.to_string(),
            error_fingerprint: fp,
            excerpt,
            rolled_back,
            kept: false,
        }])
    }

    /// Undoes a step that a crash interrupted: its partial changes are saved under a ref, the
    /// working tree is restored to what the step started from, and the step is marked failed so
    /// it runs again.
    fn recover(&mut self, id: StepId) -> Result<(), EngineError> {
        let pre_tree = self
            .run
            .in_progress
            .as_ref()
            .map(|p| p.pre.tree.clone())
            .unwrap_or_default();
        let undone = self.undo_to(&pre_tree, &format!("step {id} was interrupted"), true)?;
        fault::point("interrupted step rolled back");
        let note = match &undone {
            Some(u) if u.kept.is_empty() => format!(
                "step {id} was interrupted: {} paths restored to where it started; the working tree as it was is kept at {}",
                u.restored.len(),
                u.saved_ref
            ),
            Some(u) => format!(
                "step {id} was interrupted: {} paths restored to where it started; {} changed after its command had ended are left as they are ({}); the working tree as it was is kept at {}",
                u.restored.len(),
                u.kept.len(),
                u.kept.join(", "),
                u.saved_ref
            ),
            None => format!("step {id} was interrupted before it changed anything"),
        };
        self.observer.progress(&self.run, Progress::Note(&note));
        let (restored, saved_ref) = match undone {
            Some(u) => (u.restored, Some(u.saved_ref)),
            None => (Vec::new(), None),
        };
        self.commit(vec![EventBody::StepRolledBack {
            step: id,
            restored,
            saved_ref,
        }])
    }

    /// Before the working tree is put back to `tree`, what `what` (something interrupted or
    /// failed) started from: [`EngineError::TreeMissing`] when the repository no longer has it,
    /// or lacks an object below it that the restore from `from` (the working tree's tree now)
    /// would write, rather than git's own "bad object" from the middle of the restore.
    fn restorable(&self, from: &str, tree: &str, what: &str) -> Result<(), EngineError> {
        let missing = if self.env.git.resolve(tree)?.is_some() {
            let missing = self.env.git.missing_for_restore(from, tree)?;
            if missing.is_empty() {
                return Ok(());
            }
            missing
        } else {
            Vec::new()
        };
        Err(EngineError::TreeMissing {
            run: self.run.id.clone(),
            what: what.to_string(),
            tree: tree.to_string(),
            repo: self.env.git.root().to_path_buf(),
            missing,
        })
    }

    /// The working tree's tree now, when it is not `target` and `target` is restorable from it
    /// (`restorable`, for `what`); `None` when it is `target` already.
    fn to_put_back(&self, target: &str, what: &str) -> Result<Option<String>, EngineError> {
        let now = self.env.git.worktree_tree()?;
        if now == target {
            return Ok(None);
        }
        self.restorable(&now, target, what)?;
        Ok(Some(now))
    }

    /// Makes the working tree `target` again, what `what` (something interrupted or failed)
    /// started from, once it is known to be restorable; with `flush`, the staged events are
    /// stored first (what led here must be recorded before the workspace changes). Nothing
    /// when the working tree is `target` already. Returns the paths it changed.
    fn put_back(
        &mut self,
        target: &str,
        what: &str,
        flush: bool,
    ) -> Result<Vec<String>, EngineError> {
        if self.to_put_back(target, what)?.is_none() {
            return Ok(Vec::new());
        }
        if flush {
            self.flush()?;
        }
        Ok(self.env.git.restore_worktree(target)?)
    }

    /// Keeps `tree`, which the run may have to put the working tree back to (what the step or
    /// call starting now starts from: `which`), from git's garbage collection until the next
    /// step or call is pinned in its place (see `Git::pin`): a run resumed weeks after a crash
    /// still finds it.
    fn pin_tree(&self, which: &str, tree: &str) -> Result<(), EngineError> {
        if tree.is_empty() {
            return Ok(());
        }
        let refname = format!("refs/keel/{}/pinned/{which}", self.run.id);
        Ok(self.env.git.pin(&refname, tree)?)
    }

    /// Puts the working tree back to `target`, what it was before something a crash
    /// interrupted began changing it (`what`, for the saved commit's message), keeping the
    /// tree as it was found under a ref. Nothing when the tree is `target` already.
    ///
    /// With `by_commands` (only commands changed the tree since `target`: a command step, whose
    /// only other writes are keel's own restores to `target`), a path whose status changed (its
    /// ctime, which no program can set back) after the run's last command had ended was not
    /// changed by that command: it was changed after the crash, by a person most likely, and is
    /// left as it is, for the drift check to report. Without a known end, or when keel's own
    /// tools may have written since `target` (an agent step's calls write in keel's process),
    /// every changed path is put back (it is kept under the ref all the same).
    fn undo_to(
        &mut self,
        target: &str,
        what: &str,
        by_commands: bool,
    ) -> Result<Option<Undone>, EngineError> {
        let Some(now_tree) = self.to_put_back(target, what)? else {
            return Ok(None);
        };
        let refname = format!("refs/keel/{}/interrupted/{}", self.run.id, self.run.seq);
        self.env.git.clear_ref_lock(&refname)?;
        let head = self.env.git.head()?;
        self.env.git.snapshot(
            &now_tree,
            head.as_deref(),
            &format!("keel: working tree of run {} when {what}", self.run.id),
            &refname,
        )?;
        let Some(ended) = self.commands_ended.filter(|_| by_commands) else {
            let restored = self.env.git.restore_worktree(target)?;
            return Ok(Some(Undone {
                restored,
                kept: Vec::new(),
                saved_ref: refname,
            }));
        };
        let (kept, ours): (Vec<_>, Vec<_>) = self
            .env
            .git
            .diff(target, &now_tree)?
            .changes
            .into_iter()
            .partition(|c| changed_after(&self.env.workspace, c, ended));
        let ours: Vec<String> = ours.into_iter().map(|c| c.path).collect();
        let restored = if ours.is_empty() {
            Vec::new()
        } else {
            self.env.git.restore_paths(target, &ours)?
        };
        Ok(Some(Undone {
            restored,
            kept: kept
                .into_iter()
                .map(|c| format!("{} {}", c.status, c.path))
                .collect(),
            saved_ref: refname,
        }))
    }

    fn output_path(&self, what: &str) -> PathBuf {
        self.env
            .tmp
            .join(format!("{}-{}-{what}.log", self.run.id, self.run.seq))
    }

    /// Runs one command of the run in the workspace: the single place every command keel runs
    /// for a run passes through.
    fn run_program(
        &self,
        program: process::Program<'_>,
        env: &[(&str, String)],
        output: &Path,
        timeout: Duration,
        input: Option<&Path>,
    ) -> std::io::Result<process::Outcome> {
        self.env
            .confinement
            .run(program, env, output, timeout, input, None)
    }

    /// Where `secret:NAME` values not in the environment are read from: `$KEEL_SECRETS_FILE`,
    /// else `secrets` beside the store (`.keel/secrets`), `NAME=value` lines, mode 600.
    pub(crate) fn secrets_file(&self) -> PathBuf {
        secrets_file_in(self.env.tmp.parent().unwrap_or(&self.env.workspace))
    }

    fn command_env(&self, step: Option<StepId>) -> Vec<(&'static str, String)> {
        let mut env = vec![
            ("KEEL_RUN_ID", self.run.id.clone()),
            ("KEEL_WORKSPACE", self.env.workspace.display().to_string()),
        ];
        if let Some(step) = step {
            env.push(("KEEL_STEP", step.to_string()));
        }
        env
    }

    /// Runs one verifier on the working tree described by `judged` and records its evidence.
    fn run_verifier(
        &mut self,
        v: &Verifier,
        step: Option<StepId>,
        phase: Option<u32>,
        judged: &Fingerprint,
    ) -> Result<Evidence, EngineError> {
        self.observer.progress(
            &self.run,
            Progress::Verifier {
                name: &v.name,
                tier: v.tier,
            },
        );
        // A verifier is a command outside keel: what led to it is stored first.
        self.flush()?;
        let out = self.output_path(&format!("verify-{}", v.name));
        let outcome = if v.run.trim() == keel_core::contract::SECRET_SCAN {
            self.secret_scan(&judged.tree, &out)?
        } else {
            self.run_program(
                process::Program::Shell(&v.run),
                &self.command_env(step),
                &out,
                Duration::from_millis(v.timeout_ms),
                None,
            )
            .map_err(|e| EngineError::io(&out, e))?
        };
        fault::point("verifier ended");
        // Stored with the evidence that names it (a large one as a file of its own).
        let output = self.store.put_output_file(&out)?;
        // A failure carries the part of its output that says what failed, for the driver.
        let excerpt = (!outcome.success).then(|| {
            keel_core::run::cut(
                &keel_core::context::compact_failure(&read_tail(&out), EXCERPT_LINES),
                EXCERPT_BYTES,
            )
        });
        let _ = std::fs::remove_file(&out);
        let evidence = Evidence {
            n: self.run.evidence_count + 1,
            verifier: v.name.clone(),
            tier: v.tier,
            command: v.run.clone(),
            passed: outcome.success,
            status: outcome.status,
            duration_ms: outcome.duration_ms,
            cpu_ms: outcome.cpu_ms,
            output,
            tree: judged.tree.clone(),
            fingerprint: judged.hash(),
            step,
            phase,
            excerpt,
        };
        // Stored with what the evidence leads to (the next verifier commits first).
        self.stage(vec![EventBody::EvidenceRecorded {
            evidence: evidence.clone(),
        }])?;
        Ok(evidence)
    }

    /// The built-in `keel:secret-scan` verifier: the lines the run added since its base (up to
    /// `tree`) hold no known secret value and no high-confidence credential. Its report names
    /// the file, line and kind of each finding, never the value.
    fn secret_scan(&mut self, tree: &str, out: &Path) -> Result<process::Outcome, EngineError> {
        let started = std::time::Instant::now();
        let diff = self.env.git.diff_text(&self.run.base.tree, tree)?;
        let findings = keel_core::secret::scan_diff(&diff, &self.scrubber);
        let mut report = String::new();
        for f in &findings {
            report.push_str(&format!("{f}\n"));
        }
        if findings.is_empty() {
            report.push_str("no secret values or credentials added\n");
        } else {
            report.push_str(
                "remove them from the workspace (and rotate any credential that was written)\n",
            );
        }
        std::fs::write(out, &report).map_err(|e| EngineError::io(out, e))?;
        Ok(process::Outcome {
            success: findings.is_empty(),
            status: if findings.is_empty() {
                "exit 0".into()
            } else {
                format!("{} finding(s)", findings.len())
            },
            timed_out: false,
            duration_ms: u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
            cpu_ms: 0,
        })
    }

    fn verify_phase(&mut self, phase: u32) -> Result<(), EngineError> {
        let (name, _, _, gate) = self.phase_outline(phase);
        self.stage_state(RunState::Verifying, &format!("verifying phase `{name}`"))?;
        for verifier in gate {
            let Some(v) = self.contract.verifier(&verifier).cloned() else {
                continue;
            };
            let judged = self.run.fingerprint.clone();
            let evidence = self.run_verifier(&v, None, Some(phase), &judged)?;
            if !evidence.passed {
                return self.block_verification(&format!("phase `{name}`"), &evidence);
            }
        }
        // As an agent phase's: a budget the verification went over stops the run in the same
        // commit, so neither this run nor a resumed one goes on past it.
        self.commit_then_stop(vec![EventBody::PhaseVerified { phase }], None)
    }

    fn block_verification(&mut self, what: &str, evidence: &Evidence) -> Result<(), EngineError> {
        let reason = format!(
            "{what}: verifier `{}` failed ({}), evidence #{} (output in artifact {}); fix the cause, then `keel resume {}`",
            evidence.verifier,
            evidence.status,
            evidence.n,
            &evidence.output[..12.min(evidence.output.len())],
            self.run.id
        );
        self.set_state(
            RunState::Blocked,
            &reason,
            Some(Block::Verification {
                verifier: evidence.verifier.clone(),
                evidence: evidence.n,
            }),
        )
    }

    fn accept(&mut self) -> Result<(), EngineError> {
        self.stage_state(
            RunState::Verifying,
            "every phase is done: running the acceptance verifiers",
        )?;
        let verifiers: Vec<Verifier> = self
            .contract
            .verifiers_of(Tier::Acceptance)
            .cloned()
            .collect();
        for v in verifiers {
            let judged = self.run.fingerprint.clone();
            let evidence = self.run_verifier(&v, None, None, &judged)?;
            if !evidence.passed {
                return self.block_verification("acceptance", &evidence);
            }
        }
        if self.run.accepted() {
            self.stage_state(
                RunState::Completed,
                "every acceptance verifier passed with stored evidence",
            )
        } else {
            Ok(())
        }
    }

    fn checkpoint(&mut self) -> Result<(), EngineError> {
        // A commit stores one checkpoint's row.
        if self.staged_checkpoint.is_some() {
            self.flush()?;
        }
        let n = self.run.checkpoints;
        let refname = Checkpoint::snapshot_ref(&self.run.id, n);
        let tree = self.run.fingerprint.tree.clone();
        // A process that died while writing this ref may have left git's lock on it; this
        // process holds the run's lease, so no one else writes the run's refs.
        self.env.git.clear_ref_lock(&refname)?;
        let commit = self.env.git.snapshot(
            &tree,
            self.run.fingerprint.head.as_deref(),
            &format!("keel: run {} checkpoint {n}", self.run.id),
            &refname,
        )?;
        fault::point("snapshot written");
        let checkpoint = Checkpoint {
            n,
            run_id: self.run.id.clone(),
            seq: self.run.seq,
            at_ms: now_ms(),
            contract_hash: self.run.contract_hash.clone(),
            phase_cursor: self.run.cursor,
            snapshot_ref: refname.clone(),
            commit: commit.clone(),
            fingerprint: self.run.fingerprint.clone(),
            artifacts: self.run.artifacts(),
            pending_approvals: Vec::new(),
            run: self.run.clone(),
        };
        let (_, hash) = checkpoint.encode();
        // Stored, with its row, in the next commit (the snapshot's ref names nothing until
        // then; a checkpoint taken again after a crash writes it anew).
        self.stage(vec![EventBody::CheckpointTaken {
            n,
            hash,
            snapshot_ref: refname,
            commit,
        }])?;
        self.staged_checkpoint = Some(checkpoint);
        self.observer
            .progress(&self.run, Progress::Checkpoint { n });
        Ok(())
    }

    /// Compares the environment with the fingerprint of the last step boundary. Returns whether
    /// the run may go on.
    fn check_drift(&mut self, options: &ResumeOptions, actor: &Actor) -> Result<bool, EngineError> {
        // Mid agent step, the recorded calls changed the tree since the last step boundary; a
        // call that was running when the process died is undone first (its tree kept).
        let (expected_tree, roll_back_to) = self.run.expected_tree();
        if let Some(target) = roll_back_to {
            self.undo_interrupted(&target)?;
        }
        let mut expected = self.run.fingerprint.clone();
        let mid_agent_step = self.run.in_progress.as_ref().is_some_and(|p| p.agent);
        expected.tree = expected_tree;
        let now = self.env.fingerprint(&self.contract)?;
        let mut changes = now.changes_since(&expected);
        if mid_agent_step {
            // Lockfiles the driver wrote are part of the tree, which is compared already.
            changes.retain(|c| c.part != "lockfile");
        }
        for change in &mut changes {
            if change.part == "tree" {
                change.key = Some(self.changed_paths(&expected.tree, &now.tree));
            }
        }
        let drift_block = matches!(self.run.block, Some(Block::Drift { .. }));
        if changes.is_empty() {
            if drift_block {
                self.set_state(
                    RunState::Executing,
                    "the environment is back to what the run recorded",
                    None,
                )?;
            }
            return Ok(true);
        }
        let described: Vec<String> = changes.iter().map(ToString::to_string).collect();
        let payload = migration_payload(&described);
        // A migration a person approved in the inbox, for exactly these changes.
        let approved =
            self.run
                .approvals
                .last()
                .and_then(|a| match (&a.request.gate, &a.decision) {
                    (Gate::Migration, Some(d))
                        if d.approve
                            && a.request.payload_hash
                                == ApprovalRequest::hash_payload(&payload) =>
                    {
                        Some((a.request.n, d.by.clone(), d.reason.clone()))
                    }
                    _ => None,
                });
        // A migration takes the new environment as the run's base at a step boundary. An
        // agent step in progress (waiting for a person, or interrupted) recorded its calls
        // against the old one, and undoing its out-of-scope changes at its end would undo the
        // person's change too: keel refuses to migrate there and says how to go on.
        let mid_step = self.run.in_progress.as_ref().map(|p| p.step);
        let reason = match mid_step {
            Some(step) => format!(
                "run {id} is in the middle of step {step}, and the environment changed: {}. keel \
                 migrates only at a step boundary: put it back and `keel resume {id}` so that the \
                 step finishes (deciding what it waits for), then make the change again and \
                 `keel resume {id} --migrate --reason \"…\"`",
                described.join("; "),
                id = self.run.id
            ),
            None => format!(
                "the environment changed since the last step: {}. Put it back, or continue with `keel resume {} --migrate --reason \"…\"`",
                described.join("; "),
                self.run.id
            ),
        };
        if mid_step.is_some() && options.migrate.is_some() {
            return Err(EngineError::Usage(reason));
        }
        let approved = approved.filter(|_| mid_step.is_none());
        let options = match (&options.migrate, approved) {
            (None, Some((n, by, reason))) => {
                let actor = Actor {
                    holder: actor.holder.clone(),
                    by,
                };
                let reason = format!("approved request {n}: {reason}");
                return self.migrate(changes, now, &reason, &actor, drift_block);
            }
            _ => options,
        };
        if let Some(reason) = &options.migrate {
            if reason.trim().is_empty() {
                return Err(EngineError::Usage(
                    "--migrate needs a --reason: the migration is recorded with who and why".into(),
                ));
            }
            return self.migrate(changes, now, reason, actor, drift_block);
        }
        let mut bodies = vec![EventBody::DriftDetected {
            changes: changes.clone(),
        }];
        if self.run.state != RunState::Blocked {
            bodies.push(self.state_change(
                RunState::Blocked,
                &reason,
                Some(Block::Drift { changes }),
            ));
        }
        // The block and its migration request are stored in one commit (see `block_budget`).
        self.stage(bodies)?;
        // In the middle of a step there is nothing to approve: the person puts it back.
        if mid_step.is_none() {
            self.request_migration(payload)?;
        }
        self.flush()?;
        Ok(false)
    }

    fn migrate(
        &mut self,
        changes: Vec<FingerprintChange>,
        now: Fingerprint,
        reason: &str,
        actor: &Actor,
        drift_block: bool,
    ) -> Result<bool, EngineError> {
        let mut bodies = vec![EventBody::Migrated {
            changes,
            reason: reason.to_string(),
            by: actor.by.clone(),
            fingerprint: now,
        }];
        // A migration request waiting in the inbox is settled by this one.
        if let Some(a) = self
            .run
            .pending_approval()
            .filter(|a| matches!(a.request.gate, Gate::Migration))
        {
            bodies.push(EventBody::ApprovalDecided {
                n: a.request.n,
                approve: true,
                payload_hash: a.request.payload_hash.clone(),
                by: actor.by.clone(),
                reason: format!("settled with `keel resume --migrate`: {reason}"),
                via: SETTLED_ON_THE_COMMAND_LINE.into(),
            });
        }
        if drift_block {
            bodies.push(self.state_change(
                RunState::Executing,
                &format!("migrated by {}: {reason}", actor.by),
                None,
            ));
        }
        self.commit(bodies)?;
        Ok(true)
    }

    /// Puts the working tree back to `target` after a call a crash interrupted (see
    /// [`Engine::undo_to`]): every changed path, since keel's own tools may have written some.
    fn undo_interrupted(&mut self, target: &str) -> Result<(), EngineError> {
        self.undo_to(target, "a call was interrupted", false)?;
        Ok(())
    }

    fn changed_paths(&self, from: &str, to: &str) -> String {
        match self.env.git.diff(from, to) {
            Ok(diff) => {
                let mut names: Vec<String> = diff
                    .changes
                    .iter()
                    .take(NAMED_PATHS)
                    .map(|c| format!("{} {}", c.status, c.path))
                    .collect();
                if diff.changes.len() > NAMED_PATHS {
                    names.push(format!("and {} more", diff.changes.len() - NAMED_PATHS));
                }
                names.join(", ")
            }
            Err(e) => format!("paths unknown: {e}"),
        }
    }

    /// Lifts a block whose cause is gone. Returns whether the run may go on.
    fn lift_block(&mut self) -> Result<bool, EngineError> {
        match self.run.block.clone() {
            Some(Block::Budget(stop)) => {
                if !self.apply_approved_raise(&stop)? {
                    return Ok(false);
                }
                let still = self
                    .run
                    .budget_stop_before_step()
                    .filter(|s| s.budget == stop.budget);
                if let Some(still) = still {
                    self.observer.progress(
                        &self.run,
                        Progress::Note(&format!("still blocked: {still}")),
                    );
                    return Ok(false);
                }
                let limit = self.run.limits.get(stop.budget).unwrap_or(0);
                self.set_state(
                    RunState::Executing,
                    &format!(
                        "budget `{}` raised to {}",
                        stop.budget,
                        stop.budget.format_amount(limit)
                    ),
                    None,
                )?;
                Ok(true)
            }
            Some(Block::Verification { verifier, .. }) => {
                self.set_state(
                    RunState::Executing,
                    &format!("resumed by a person to run verifier `{verifier}` again"),
                    None,
                )?;
                Ok(true)
            }
            Some(Block::Driver { category, .. }) => {
                self.set_state(
                    RunState::Executing,
                    &format!("resumed by a person after the driver stopped ({category})"),
                    None,
                )?;
                Ok(true)
            }
            Some(Block::DriverFailed { .. }) => {
                self.set_state(
                    RunState::Executing,
                    "resumed by a person: asking the driver again",
                    None,
                )?;
                Ok(true)
            }
            Some(Block::Loop { kind }) => {
                self.set_state(
                    RunState::Executing,
                    &format!(
                        "resumed by a person after a loop ({kind}); the approach stays rejected"
                    ),
                    None,
                )?;
                Ok(true)
            }
            // A rejection stands; a person who changed their mind cancels, or a new run asks
            // again.
            Some(Block::Rejected { n, by, .. }) => {
                self.observer.progress(
                    &self.run,
                    Progress::Note(&format!("approval request {n} was rejected by {by}")),
                );
                Ok(false)
            }
            // Settled by `check_drift`.
            Some(Block::Drift { .. }) | None => Ok(true),
        }
    }
}

impl Engine<'_> {
    /// The last [`FAILURE_TAIL_BYTES`] of a stored output (a verifier's, kept with its
    /// evidence or as a file).
    fn output_tail(&self, output: &str) -> Result<String, EngineError> {
        let bytes = self
            .store
            .read_run_artifact(&self.run.id, output, usize::MAX)?;
        let from = bytes.len().saturating_sub(FAILURE_TAIL_BYTES as usize);
        Ok(String::from_utf8_lossy(&bytes[from..]).into_owned())
    }
}

fn read_tail(path: &Path) -> String {
    use std::io::{Read, Seek, SeekFrom};
    let Ok(mut f) = std::fs::File::open(path) else {
        return String::new();
    };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let _ = f.seek(SeekFrom::Start(len.saturating_sub(FAILURE_TAIL_BYTES)));
    let mut buf = Vec::new();
    let _ = f.read_to_end(&mut buf);
    String::from_utf8_lossy(&buf).into_owned()
}

/// A short, human description of a fingerprint change list.
pub fn describe_changes(changes: &[FingerprintChange]) -> String {
    changes
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

/// The exact payload of a migration request: the changes, one per line.
fn migration_payload(described: &[String]) -> String {
    let mut text =
        String::from("continue the run in the environment as it is now; what changed:\n");
    for d in described {
        text.push_str(&format!("  - {d}\n"));
    }
    text
}

/// Applies `bodies` to `next`, a run the caller drops if this fails.
fn apply_bodies(
    scrubber: &keel_core::secret::Scrubber,
    next: &mut Run,
    bodies: Vec<EventBody>,
    at_ms: i64,
    events: &mut Vec<Event>,
) -> Result<(), EngineError> {
    for body in bodies {
        let event = next.next_event(at_ms, scrub_body(scrubber, body)?);
        next.apply_in_place(&event)
            .map_err(|source| EngineError::Apply {
                run: next.id.clone(),
                source,
            })?;
        events.push(event);
    }
    Ok(())
}

/// The body with every known secret value replaced by `[secret:NAME]` in every string it
/// holds (a string holding JSON, like a call's arguments, is scrubbed of the escaped forms
/// too). Fails closed: a body that would not decode once scrubbed is not stored.
fn scrub_body(
    scrubber: &keel_core::secret::Scrubber,
    body: EventBody,
) -> Result<EventBody, EngineError> {
    if scrubber.is_empty() {
        return Ok(body);
    }
    let mut value = serde_json::to_value(&body).map_err(|e| {
        EngineError::Usage(format!("an event could not be prepared for storage: {e}"))
    })?;
    if !scrub_strings(scrubber, &mut value) {
        return Ok(body);
    }
    serde_json::from_value(value).map_err(|e| {
        EngineError::Usage(format!(
            "a secret value appears in a `{}` event where keel cannot replace it ({e}); \
             nothing was stored",
            body.kind()
        ))
    })
}
