//! Running a shell command the way keel runs every command: in the workspace, in its own process
//! group, with a timeout that kills the whole group, output captured to a file, CPU time measured.

use std::fs::File;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;

use crate::fault;

/// Environment variables no command keel runs may see: the secrets keel itself uses (the
/// model's API key). Registered when a run's driver is made.
static HIDDEN: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

/// Keeps `name` out of the environment of every command keel runs from now on.
pub fn hide_from_commands(name: &str) {
    if let Ok(mut hidden) = HIDDEN.lock()
        && !hidden.iter().any(|h| h == name)
    {
        hidden.push(name.to_string());
    }
}

/// What to run: a shell command line, or an argv that no shell sees.
#[derive(Debug, Clone, Copy)]
pub enum Program<'a> {
    Shell(&'a str),
    Argv(&'a [String]),
}

impl Program<'_> {
    /// The argv that runs it.
    pub fn argv(&self) -> Vec<String> {
        match self {
            Program::Shell(command) => vec!["sh".into(), "-c".into(), command.to_string()],
            Program::Argv(argv) => argv.to_vec(),
        }
    }
}

/// How long a command gets between SIGTERM and SIGKILL at its timeout.
const GRACE: Duration = Duration::from_secs(2);

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    pub success: bool,
    /// `exit 0`, `exit 1`, `killed by signal 9`, `timed out after 10s`.
    pub status: String,
    pub timed_out: bool,
    pub duration_ms: u64,
    pub cpu_ms: u64,
}

/// Waits for `child` and returns how it ended with the CPU time (user and system, in ms) that it
/// and the descendants it waited for used: `wait4`'s own account of that one child. (The
/// process-wide `RUSAGE_CHILDREN` would also count every other child that ended meanwhile,
/// such as the commands of other runs this process drives: a run's compute budget would be
/// charged for them.)
fn wait_with_cpu(
    child: &mut std::process::Child,
) -> std::io::Result<(std::process::ExitStatus, u64)> {
    use wait4::Wait4;
    loop {
        match child.wait4() {
            Ok(done) => {
                let cpu = done.rusage.utime + done.rusage.stime;
                return Ok((
                    done.status,
                    u64::try_from(cpu.as_millis()).unwrap_or(u64::MAX),
                ));
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
}

/// A started command being waited for, with a limit on the wait.
enum Waiting {
    /// The usual way: the calling thread polls a pidfd of the child (readable once it has
    /// exited) for at most the limit, then reaps it. No thread is started for the wait.
    Pidfd {
        child: std::process::Child,
        pidfd: std::os::fd::OwnedFd,
    },
    /// Where the kernel has no pidfds (before Linux 5.3) or one cannot be opened: a thread
    /// reaps the child and hands its status over a channel, which is received with a limit.
    Thread {
        done: mpsc::Receiver<std::io::Result<(std::process::ExitStatus, u64)>>,
        thread: std::thread::JoinHandle<()>,
    },
}

impl Waiting {
    fn start(child: std::process::Child) -> Waiting {
        // The child is not reaped until this process waits for it, so its pid names it here.
        let pid = rustix::process::Pid::from_child(&child);
        match rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty()) {
            Ok(pidfd) => Waiting::Pidfd { child, pidfd },
            Err(_) => Waiting::by_thread(child),
        }
    }

    fn by_thread(mut child: std::process::Child) -> Waiting {
        let (tx, done) = mpsc::channel();
        let thread = std::thread::spawn(move || {
            let _ = tx.send(wait_with_cpu(&mut child));
        });
        Waiting::Thread { done, thread }
    }

    /// The command's end (its status and CPU, or why they could not be read), if it ends
    /// within `limit`; `None` if it still runs.
    fn within(
        &mut self,
        limit: Duration,
    ) -> Option<std::io::Result<(std::process::ExitStatus, u64)>> {
        match self {
            Waiting::Pidfd { child, pidfd } => match exits_within(pidfd, limit) {
                Ok(false) => None,
                Ok(true) => Some(wait_with_cpu(child)),
                Err(e) => {
                    // Not left running unwatched: the group is killed and the child reaped.
                    let _ = killpg(Pid::from_raw(child.id() as i32), Signal::SIGKILL);
                    let _ = wait_with_cpu(child);
                    Some(Err(e))
                }
            },
            Waiting::Thread { done, .. } => done.recv_timeout(limit).ok(),
        }
    }

    /// Waits for the command's end, however long it takes (after it was killed).
    fn end(self) -> std::io::Result<(std::process::ExitStatus, u64)> {
        match self {
            Waiting::Pidfd { mut child, .. } => wait_with_cpu(&mut child),
            Waiting::Thread { done, thread } => {
                let status = done.recv().map_err(std::io::Error::other)?;
                let _ = thread.join();
                status
            }
        }
    }
}

/// Whether the process of `pidfd` exits within `limit` (it may have already).
fn exits_within(pidfd: &std::os::fd::OwnedFd, limit: Duration) -> std::io::Result<bool> {
    use rustix::event::{PollFd, PollFlags, Timespec, poll};
    let deadline = Instant::now() + limit;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        // A limit too far off to write as a timespec is no limit.
        let left = Timespec::try_from(left).ok();
        let mut fds = [PollFd::new(pidfd, PollFlags::IN)];
        match poll(&mut fds, left.as_ref()) {
            Ok(0) if Instant::now() >= deadline => return Ok(false),
            // Woken early (the kernel may round a timeout down): wait for what is left.
            Ok(0) => continue,
            Ok(_) => return Ok(true),
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
    }
}

/// Runs `sh -c command` in `dir`, unconfined, output (stdout and stderr together) to `output`,
/// for at most `timeout`. `env` is added to the inherited environment.
#[cfg(test)]
pub fn run_shell(
    command: &str,
    dir: &Path,
    env: &[(&str, String)],
    output: &Path,
    timeout: Duration,
) -> std::io::Result<Outcome> {
    run_program(Program::Shell(command), dir, env, output, timeout, None)
}

/// Runs `program` in `dir` (see [`run_shell`]), unconfined: keel's own environment minus the
/// hidden variables, plus `env`.
pub fn run_program(
    program: Program<'_>,
    dir: &Path,
    env: &[(&str, String)],
    output: &Path,
    timeout: Duration,
    input: Option<&Path>,
) -> std::io::Result<Outcome> {
    let argv = program.argv();
    let Some((first, rest)) = argv.split_first() else {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "an empty command",
        ));
    };
    // The command's shell dies when keel dies (for example by SIGKILL), so a crashed run does
    // not leave its step running beside the one that resumes it.
    let mut cmd = keel_git::spawn::dying_with_keel(first.as_ref(), Signal::SIGKILL);
    cmd.args(rest).current_dir(dir);
    for (k, v) in env {
        cmd.env(k, v);
    }
    // Last, so that nothing puts a hidden variable back.
    if let Ok(hidden) = HIDDEN.lock() {
        for name in hidden.iter() {
            cmd.env_remove(name);
        }
    }
    let (outcome, _) = spawn_and_wait(cmd, |mut c| c.spawn(), output, timeout, input)?;
    Ok(outcome)
}

/// Spawns `cmd` in its own process group with its output to `output`, kills the whole group at
/// the timeout, and says how it ended (and its exit code, if it exited).
fn spawn_and_wait(
    mut cmd: Command,
    spawn: impl FnOnce(Command) -> std::io::Result<std::process::Child>,
    output: &Path,
    timeout: Duration,
    input: Option<&Path>,
) -> std::io::Result<(Outcome, Option<i32>)> {
    let out = File::create(output)?;
    let err = out.try_clone()?;
    let stdin = match input {
        Some(path) => Stdio::from(File::open(path)?),
        None => Stdio::null(),
    };
    // The caller makes the command die with keel: an unconfined one through
    // `keel_git::spawn::dying_with_keel`, the sandbox helper by itself after exec (both are
    // started without a fork, which would copy keel's memory map).
    cmd.stdin(stdin).stdout(out).stderr(err).process_group(0);
    let started = Instant::now();
    let child = spawn(cmd)?;
    let pgid = Pid::from_raw(child.id() as i32);
    fault::point("command running");
    let mut waiting = Waiting::start(child);
    let mut timed_out = false;
    let status = match waiting.within(timeout) {
        Some(status) => status,
        None => {
            timed_out = true;
            let _ = killpg(pgid, Signal::SIGTERM);
            match waiting.within(GRACE) {
                Some(status) => status,
                None => {
                    let _ = killpg(pgid, Signal::SIGKILL);
                    waiting.end()
                }
            }
        }
    };
    // Whatever the command left running in its group goes with it: steps are short and must not
    // leave processes behind that change the workspace later.
    let _ = killpg(pgid, Signal::SIGKILL);
    let (status, cpu_ms) = status?;
    let duration_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
    let described = if timed_out {
        format!("timed out after {}", humanise(timeout))
    } else if let Some(code) = status.code() {
        format!("exit {code}")
    } else {
        use std::os::unix::process::ExitStatusExt;
        format!("killed by signal {}", status.signal().unwrap_or(0))
    };
    Ok((
        Outcome {
            success: !timed_out && status.success(),
            status: described,
            timed_out,
            duration_ms,
            cpu_ms,
        },
        status.code(),
    ))
}

/// The program keel re-executes as the sandbox helper: set once by a binary whose `main` calls
/// `keel_sandbox::enter_if_helper()` first.
static HELPER: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();

/// The helper commands are started with: chosen once, at the first confined command, by
/// [`choose_helper`].
static CHOSEN: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();

/// The small helper binary keel looks for beside the program (keel-cli builds and installs it
/// with `keel`).
pub const SMALL_HELPER: &str = "keel-sandbox-helper";

/// Makes `helper` (normally `std::env::current_exe()`) the sandbox helper of this process. Its
/// `main` must call `keel_sandbox::enter_if_helper()` before anything else. A
/// `keel-sandbox-helper` of the same build beside it is used in its place (see
/// [`choose_helper`]).
pub fn set_sandbox_helper(helper: std::path::PathBuf) {
    let _ = HELPER.set(helper);
}

/// The first call in `main` of every program that drives runs. When this process was started as
/// keel's sandbox helper it confines itself and execs the command (it never returns); otherwise
/// it makes this program the helper for the commands its runs start.
pub fn sandbox_main() {
    keel_sandbox::enter_if_helper();
    if let Ok(exe) = std::env::current_exe() {
        set_sandbox_helper(exe);
    }
}

/// The binary confined commands are started with, once chosen (at the first one): the small
/// `keel-sandbox-helper` or the program itself. `None` before the first confined command or
/// in a process without a helper.
pub fn sandbox_helper() -> Option<&'static std::path::Path> {
    CHOSEN.get().map(|p| p.as_path())
}

/// The helper of this process, chosen at the first call.
fn helper() -> Option<&'static std::path::Path> {
    let own = HELPER.get()?;
    Some(CHOSEN.get_or_init(|| choose_helper(own)).as_path())
}

/// `keel-sandbox-helper` in the directory of `own` when it is a helper of this very build
/// ([`keel_sandbox::is_helper_of_this_build`], one short process), else `own` itself. Both confine a command
/// alike; the small binary starts with far less work (a large program's start, its pages
/// mapped and its relocations applied, is most of a short confined command's cost). A missing,
/// foreign or stale helper is passed over, never used.
pub fn choose_helper(own: &std::path::Path) -> std::path::PathBuf {
    match own.parent().map(|dir| dir.join(SMALL_HELPER)) {
        Some(small) if small != own && keel_sandbox::is_helper_of_this_build(&small) => small,
        _ => own.to_path_buf(),
    }
}

/// Environment variables a confined command gets from keel's own environment (besides the
/// contract's `[sandbox] env` and what keel sets for the command).
const PASSED_ENV: [&str; 14] = [
    "PATH",
    "HOME",
    "USER",
    "LOGNAME",
    "LANG",
    "LANGUAGE",
    "LC_ALL",
    "LC_CTYPE",
    "LC_MESSAGES",
    "TZ",
    "TERM",
    "CARGO_HOME",
    "RUSTUP_HOME",
    "RUSTUP_TOOLCHAIN",
];

/// Credentials under the home directory that no confined command may read.
const HIDDEN_HOME: [&str; 7] = [
    ".ssh",
    ".aws",
    ".gnupg",
    ".netrc",
    ".git-credentials",
    ".docker/config.json",
    ".config/gcloud",
];

/// How every command of a run is confined: the sandbox policy it runs under, or unconfined
/// when the contract turned the sandbox off.
#[derive(Debug, Clone)]
pub struct Confinement {
    sandbox: Option<keel_sandbox::Sandbox>,
    workspace: std::path::PathBuf,
    writable: Vec<std::path::PathBuf>,
    hidden: Vec<std::path::PathBuf>,
    network: bool,
    limits: keel_sandbox::Limits,
    pass_env: Vec<String>,
    /// The file each command notes its end in (see [`Confinement::note_ends_in`]).
    ended: Option<std::path::PathBuf>,
}

impl Confinement {
    /// Each command run through this confinement removes `file` before it starts and writes it
    /// once every process of the command is gone: keel writes it after the command is reaped,
    /// and a confined command's helper writes it too when keel dies first (it ends the
    /// command, then notes the end). So the file exists only when the last command started has
    /// surely ended, and its modification time bounds when that command last changed a file.
    pub fn note_ends_in(&mut self, file: std::path::PathBuf) {
        self.ended = Some(file);
    }

    /// Commands run unconfined (`[sandbox] mode = "off"`).
    pub fn off(workspace: &Path) -> Confinement {
        Confinement {
            sandbox: None,
            workspace: workspace.to_path_buf(),
            writable: Vec::new(),
            hidden: Vec::new(),
            network: true,
            limits: keel_sandbox::Limits::default(),
            pass_env: Vec::new(),
            ended: None,
        }
    }

    /// The confinement the contract asks for, checked against what this kernel can enforce:
    /// an error (and nothing runs) if it cannot. `protect` are paths no command may see (keel's
    /// store, the secrets file).
    pub fn new(
        settings: &keel_core::contract::SandboxSettings,
        network: bool,
        workspace: &Path,
        protect: &[std::path::PathBuf],
    ) -> Result<Confinement, String> {
        if !settings.enabled {
            return Ok(Confinement::off(workspace));
        }
        let helper = helper().ok_or_else(|| {
            "the sandbox helper is not available in this process (a program that drives runs \
             calls keel_sandbox::enter_if_helper() and keel_engine::set_sandbox_helper() first \
             in main); or set [sandbox] mode = \"off\" to run commands unconfined"
                .to_string()
        })?;
        let home = std::env::var_os("HOME").map(std::path::PathBuf::from);
        let mut writable = Vec::new();
        for w in &settings.writable {
            let path = match (w.strip_prefix("~/"), &home) {
                (Some(rest), Some(home)) => home.join(rest),
                (Some(_), None) => {
                    return Err(format!(
                        "[sandbox] writable \"{w}\" starts with ~/ but HOME is not set"
                    ));
                }
                (None, _) => std::path::PathBuf::from(w),
            };
            if !path.exists() {
                return Err(format!(
                    "[sandbox] writable \"{w}\" does not exist ({}); create it or remove it",
                    path.display()
                ));
            }
            writable.push(path);
        }
        let mut hidden: Vec<std::path::PathBuf> =
            protect.iter().filter(|p| p.exists()).cloned().collect();
        if let Some(home) = &home {
            hidden.extend(
                HIDDEN_HOME
                    .iter()
                    .map(|rel| home.join(rel))
                    .filter(|p| p.exists()),
            );
        }
        let limits = keel_sandbox::Limits {
            cpu_seconds: settings.cpu_ms.map(|ms| ms.div_ceil(1000)),
            memory_bytes: Some(settings.memory_bytes),
            open_files: Some(settings.open_files),
            processes: Some(settings.processes),
        };
        let confinement = Confinement {
            sandbox: Some(keel_sandbox::Sandbox::new(helper)),
            workspace: workspace.to_path_buf(),
            writable,
            hidden,
            network,
            limits,
            pass_env: PASSED_ENV
                .iter()
                .map(|s| s.to_string())
                .chain(settings.env.iter().cloned())
                .collect(),
            ended: None,
        };
        let support = keel_sandbox::probe().map_err(|e| {
            format!(
                "the sandbox cannot be enforced on this machine: {e}; keel runs no command it \
                 cannot confine (set [sandbox] mode = \"off\" to run them unconfined, recorded \
                 in the run's log)"
            )
        })?;
        support
            .check(&confinement.policy(&["true".to_string()], Vec::new(), network))
            .map_err(|e| format!("the sandbox cannot enforce the contract's policy: {e}"))?;
        Ok(confinement)
    }

    fn policy(
        &self,
        argv: &[String],
        env: Vec<(String, String)>,
        network: bool,
    ) -> keel_sandbox::Policy {
        keel_sandbox::Policy {
            workspace: self.workspace.clone(),
            writable: self.writable.clone(),
            hidden: self.hidden.clone(),
            network,
            limits: self.limits,
            env,
            argv: argv.to_vec(),
        }
    }

    /// Runs one command of the run: in the workspace, confined (or not, by the contract), with
    /// `network` overriding the contract's default when given.
    pub fn run(
        &self,
        program: Program<'_>,
        env: &[(&str, String)],
        output: &Path,
        timeout: Duration,
        input: Option<&Path>,
        network: Option<bool>,
    ) -> std::io::Result<Outcome> {
        let _noted = self.ended.as_deref().map(EndNote::begin).transpose()?;
        let Some(sandbox) = &self.sandbox else {
            return run_program(program, &self.workspace, env, output, timeout, input);
        };
        let hidden_names: Vec<String> = HIDDEN.lock().map(|h| h.clone()).unwrap_or_default();
        let mut full: Vec<(String, String)> = Vec::new();
        for name in &self.pass_env {
            if let Ok(value) = std::env::var(name)
                && !hidden_names.contains(name)
            {
                full.push((name.clone(), value));
            }
        }
        for (k, v) in env {
            if hidden_names.iter().any(|h| h == k) {
                continue;
            }
            full.retain(|(name, _)| name != k);
            full.push((k.to_string(), v.clone()));
        }
        let policy = self.policy(&program.argv(), full, network.unwrap_or(self.network));
        let (cmd, mut private_tmp) = sandbox
            .command_noting_end(&policy, self.ended.as_deref())
            .map_err(|e| std::io::Error::other(format!("the sandbox refused to start: {e}")))?;
        let (mut outcome, code) =
            spawn_and_wait(cmd, |c| private_tmp.spawn(c), output, timeout, input)?;
        if code == Some(keel_sandbox::REFUSED_EXIT_CODE)
            && let Some(reason) = private_tmp.refusal()
        {
            outcome.success = false;
            outcome.status = format!("refused by the sandbox: {reason}");
        }
        if code.is_some() {
            private_tmp.helper_exited();
        }
        drop(private_tmp);
        Ok(outcome)
    }
}

/// A command's end file while the command may run: removed when it starts, written when the
/// guard is dropped (the command reaped, or it failed to start: whatever started is gone). A
/// failed write leaves no file, which says the end is unknown, as a crash would.
struct EndNote<'a>(&'a Path);

impl<'a> EndNote<'a> {
    fn begin(file: &'a Path) -> std::io::Result<EndNote<'a>> {
        match std::fs::remove_file(file) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
            _ => Ok(EndNote(file)),
        }
    }
}

impl Drop for EndNote<'_> {
    fn drop(&mut self) {
        let _ = std::fs::write(self.0, b"every process of the command is gone\n");
    }
}

fn humanise(d: Duration) -> String {
    keel_core::budget::BudgetName::WallTime
        .format_amount(u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_and_status_are_captured() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("out");
        let o = run_shell(
            "echo hello; echo oops >&2; exit 3",
            dir.path(),
            &[],
            &out,
            Duration::from_secs(30),
        )
        .unwrap();
        assert!(!o.success);
        assert_eq!(o.status, "exit 3");
        let text = std::fs::read_to_string(out).unwrap();
        assert!(text.contains("hello") && text.contains("oops"));
    }

    #[test]
    fn a_commands_cpu_is_its_own_not_that_of_commands_that_end_meanwhile() {
        let dir = tempfile::tempdir().unwrap();
        let go = dir.path().join("go");
        nix::unistd::mkfifo(&go, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        let started = dir.path().join("started");
        // `waiting` starts first and blocks, using no CPU, until told to end; `busy` burns CPU
        // and ends (and is reaped) while `waiting` still runs.
        let waiting = std::thread::spawn({
            let dir = dir.path().to_path_buf();
            move || {
                run_shell(
                    "touch started; read line < go",
                    &dir,
                    &[],
                    &dir.join("waiting.out"),
                    Duration::from_secs(600),
                )
                .unwrap()
            }
        });
        while !started.exists() {
            std::thread::sleep(Duration::from_millis(10));
        }
        let busy = run_shell(
            "i=0; while [ $i -lt 400000 ]; do i=$((i+1)); done",
            dir.path(),
            &[],
            &dir.path().join("busy.out"),
            Duration::from_secs(600),
        )
        .unwrap();
        std::fs::write(&go, "end\n").unwrap();
        let waiting = waiting.join().unwrap();
        assert!(busy.success && waiting.success, "{busy:?} {waiting:?}");
        // A shell loop of 400,000 rounds takes a good fraction of a second of CPU anywhere.
        assert!(busy.cpu_ms >= 50, "{busy:?}");
        assert!(
            waiting.cpu_ms * 4 < busy.cpu_ms,
            "the waiting command was charged the busy one's CPU: {waiting:?} {busy:?}"
        );
    }

    #[test]
    fn hidden_variables_never_reach_a_command() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("out");
        // Handed to the command explicitly, and still not seen once hidden.
        let secret = [("KEEL_TEST_HIDDEN", "sk-secret".to_string())];
        let shown = "echo \"[${KEEL_TEST_HIDDEN-unset}]\"";
        run_shell(shown, dir.path(), &secret, &out, Duration::from_secs(30)).unwrap();
        assert_eq!(std::fs::read_to_string(&out).unwrap(), "[sk-secret]\n");
        hide_from_commands("KEEL_TEST_HIDDEN");
        let o = run_shell(shown, dir.path(), &secret, &out, Duration::from_secs(30)).unwrap();
        assert!(o.success);
        assert_eq!(std::fs::read_to_string(&out).unwrap(), "[unset]\n");
    }

    /// Both ways of waiting (a pidfd polled by the caller, the fallback's thread) see a
    /// command that ends within the limit end, with its status, and one that does not as still
    /// running, until it is killed.
    #[test]
    fn both_ways_of_waiting_tell_an_end_from_a_command_still_running() {
        let start = |script: &str| {
            let mut cmd = Command::new("sh");
            cmd.args(["-c", script]).process_group(0);
            cmd.spawn().unwrap()
        };
        type Way = fn(std::process::Child) -> Waiting;
        let ways: [(&str, Way); 2] = [("pidfd", Waiting::start), ("thread", Waiting::by_thread)];
        for (way, wait) in ways {
            let mut quick = wait(start("exit 3"));
            let (status, _) = quick.within(Duration::from_secs(60)).unwrap().unwrap();
            assert_eq!(status.code(), Some(3), "{way}");

            let slow = start("sleep 60");
            let pgid = Pid::from_raw(slow.id() as i32);
            let mut slow = wait(slow);
            assert!(slow.within(Duration::from_millis(50)).is_none(), "{way}");
            killpg(pgid, Signal::SIGKILL).unwrap();
            let (status, _) = slow.end().unwrap();
            use std::os::unix::process::ExitStatusExt;
            assert_eq!(status.signal(), Some(9), "{way}");
        }
        // The usual way is the pidfd's on any kernel keel's sandbox runs on (5.3 and later).
        let waiting = Waiting::start(start("true"));
        assert!(matches!(waiting, Waiting::Pidfd { .. }));
        waiting.end().unwrap();
    }

    #[test]
    fn a_timeout_kills_the_whole_group() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("out");
        let marker = dir.path().join("grandchild-survived");
        // The grandchild ignores SIGTERM and would write the marker later if it survived.
        let cmd = format!(
            "(trap '' TERM; sleep 3; touch {}) & trap '' TERM; sleep 30",
            marker.display()
        );
        let o = run_shell(&cmd, dir.path(), &[], &out, Duration::from_millis(300)).unwrap();
        assert!(o.timed_out);
        assert!(o.status.starts_with("timed out after"), "{}", o.status);
        std::thread::sleep(Duration::from_secs(4));
        assert!(!marker.exists(), "a grandchild outlived the timeout");
    }
}
