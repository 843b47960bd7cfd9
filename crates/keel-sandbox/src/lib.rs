//! Runs one command under an enforced sandbox.
//!
//! # Mechanism
//!
//! The sandbox is applied by a helper process that is the caller's own binary re-executed: the
//! binary calls [`enter_if_helper`] first thing in `main`, and [`Sandbox::command`] returns a
//! [`Command`] that runs that binary as `<helper> __keel-sandbox`, with an empty environment but
//! for one variable carrying the serialized request (the [`Policy`] plus the paths of the
//! [`PrivateTmp`]). The helper works in two stages, one process each: stage 2 is a `fork` of
//! stage 1 (one of this crate's two `unsafe` calls, the other an `atexit` in `private`; sound
//! because stage 1 has one thread, which it checks: the helper is entered before any thread
//! starts), not a second exec of the binary, whose start alone costs about a millisecond of CPU
//! on a virtual machine:
//!
//! 1. **Stage 1** (in the caller's process group) blocks SIGTERM, SIGINT, SIGHUP, SIGQUIT and
//!    SIGCHLD, moves into the pids cgroup the caller made for the command when running as root
//!    (unless the caller started it there, see [`PrivateTmp::spawn`]; or makes one itself, when
//!    the caller gave none), then `unshare`s a mount namespace, a pid namespace,
//!    an IPC namespace, a network namespace (unless `network` is true; as root it enters the one
//!    the caller made or kept instead, see **Network** below) and, when not root, a user namespace
//!    in which the caller's uid and gid are mapped to 0 (setgroups denied). It makes every mount
//!    private, covers each `hidden` path (a directory with an empty read-only tmpfs of mode 000,
//!    anything else with a bind-mounted, read-only, empty file of mode 000), mounts a fresh tmpfs
//!    on `/dev/shm`, and forks stage 2. It then waits; on SIGTERM (or SIGINT, SIGHUP, SIGQUIT) it
//!    kills stage 2 with SIGKILL, and so it does when the process that started it dies
//!    (`PR_SET_PDEATHSIG` is SIGTERM). When stage 2 is gone it removes the cgroup if it made it
//!    (the caller keeps or removes its own), writes the end file if it was given one
//!    ([`Sandbox::command_noting_end`]), and exits with stage 2's exit code, or 128 + the signal
//!    that killed it.
//! 2. **Stage 2** is PID 1 of the new pid namespace. It joins the cgroup stage 1 made (one
//!    the caller gave, it is made in), sets
//!    `PR_SET_PDEATHSIG` to SIGKILL (and checks that stage 1 is still alive), mounts a fresh
//!    `/proc` (which shows only the sandbox's processes), sets the resource limits, drops every
//!    capability (bounding, ambient, inheritable, effective, permitted sets), sets
//!    `no_new_privs`, applies Landlock, and `exec`s the command with exactly `policy.env` (plus
//!    `TMPDIR`) in the workspace.
//!
//! Because the command runs as PID 1 of its own pid namespace, its death makes the kernel kill
//! everything else in the namespace, including grandchildren that called `setsid` or ignore
//! SIGTERM. Stage 2 dies when stage 1 dies (pdeathsig), and stage 1 kills stage 2 when it gets
//! SIGTERM, so the caller's `killpg(helper, SIGTERM)` (then SIGKILL) ends the whole tree.
//!
//! # Exit status
//!
//! The helper's exit status is the command's, except:
//! - [`REFUSED_EXIT_CODE`] (125): the sandbox refused to start the command (a policy that
//!   cannot be enforced, a kernel that lacks a feature, ...). The helper also writes
//!   `keel-sandbox: <why>` to stderr and the reason to a report file that
//!   [`PrivateTmp::refusal`] reads, which is how a caller tells a refusal from a command that
//!   itself exited 125.
//! - 126 or 127: the command could not be executed (not executable, not found), after the
//!   sandbox was in place, with `keel-sandbox: cannot execute ...` on stderr (as a shell does).
//! - 128 + N: the command was killed by signal N.
//!
//! # What is enforced
//!
//! - **Filesystem writes** (Landlock, ABI 3 or later required, all filesystem rights of the
//!   best ABI the kernel and the `landlock` crate share are handled): the command may read and
//!   execute anything under `/`, and change only the workspace, the `writable` hierarchies, its
//!   private temporary directory, a private `/dev/shm` and the usual character devices
//!   (`/dev/null`, `/dev/zero`, `/dev/full`, `/dev/random`, `/dev/urandom`, `/dev/tty`).
//!   Linking or renaming a file from outside into a writable place is refused (`EXDEV`,
//!   `LANDLOCK_ACCESS_FS_REFER`), and so is truncating a file outside.
//! - **Hidden paths**: covered by mounts the command cannot undo (it has no capabilities). A
//!   hidden directory lists as "Permission denied" and cannot be written; a hidden file reads as
//!   "Permission denied" (the cover is empty anyway).
//! - **Network**: with `network: false` the command has a network namespace of its own with only
//!   a loopback interface that is down: every TCP/UDP connect or send fails (`ENETUNREACH`).
//!   Abstract unix sockets are per network namespace too. As root, the namespace is made by the
//!   caller and kept for a later command once every process of this one is gone (never two
//!   commands at once; see `netns.rs`).
//! - **Environment**: exactly `policy.env` plus `TMPDIR`.
//! - **Limits**: `RLIMIT_CPU` (SIGXCPU at the limit, SIGKILL a second later; the command itself,
//!   being PID 1, does not get SIGXCPU and dies by the SIGKILL), `RLIMIT_AS`,
//!   `RLIMIT_NOFILE`; the number of processes (tasks, threads included) by a pids cgroup as root
//!   (the kernel does not enforce `RLIMIT_NPROC` for uid 0), by `RLIMIT_NPROC` otherwise.
//! - **Privileges**: no capabilities at all (so root inside does not bypass file modes), and
//!   `no_new_privs` (setuid binaries do not elevate).
//!
//! # What is not enforced, and kernel caveats
//!
//! - **Reads**: anything not `hidden` is readable if file modes allow it. As root without
//!   `CAP_DAC_OVERRIDE` the command reads only what uid 0 may read by its mode bits.
//! - **Hard links**: Landlock checks the path used, not the inode. A hard link *already present*
//!   in the workspace to a file outside is writable through the workspace path. Creating such a
//!   link from inside the sandbox is refused (`EXDEV`), but the caller must refuse to run in a
//!   workspace that contains hard-linked files it did not make (keel-tools already refuses them
//!   for writing).
//! - **Pathname unix sockets**: before Landlock ABI 9 (`LANDLOCK_ACCESS_FS_RESOLVE_UNIX`),
//!   connecting to a socket file (e.g. `/var/run/docker.sock`) is not a filesystem write for
//!   Landlock and the network namespace does not cover it: put such sockets (or their
//!   directories) in `hidden`. From ABI 9 on it is refused outside the writable places.
//! - **`/proc`**: a fresh procfs for the sandbox's pid namespace, so the caller's processes (and
//!   their environments) are invisible. `/sys` is the host's (read-only through Landlock).
//! - **`/dev/stdout`-style reopening** of an inherited descriptor that points outside the
//!   writable places is refused (it is a new open of that file); writing to the inherited
//!   descriptor itself works.
//! - **PID 1 signal semantics**: the command is PID 1 of its namespace, so signals it has no
//!   handler for (SIGTERM, SIGINT) are ignored when sent from inside the namespace or to it
//!   directly; SIGKILL from the caller always works, and so does stage 1's SIGKILL. PID 1 also
//!   inherits orphans: a command that never reaps them leaves zombies until it exits.
//! - **Loopback**: the loopback interface is down with `network: false`, so a command cannot
//!   run a local server and talk to it.
//! - **`RLIMIT_NPROC`** (non-root) counts all processes of the real uid on the machine, not only
//!   the sandbox's.
//! - **Threads**: the helper must be entered before the binary starts any thread (unsharing a
//!   user or mount namespace needs a single-threaded process): call [`enter_if_helper`] before
//!   building an async runtime.

mod cgroup;
mod error;
mod helper;
mod netns;
mod private;
mod rules;

use std::path::{Path, PathBuf};
use std::process::Command;

use serde::{Deserialize, Serialize};

pub use cgroup::kept as kept_cgroups;
pub use error::SandboxError;
pub use helper::{enter_if_helper, helper_main};
pub use netns::kept as kept_network_namespaces;
pub use private::{PrivateTmp, kept as kept_private_dirs};

/// The exit code of the helper when the sandbox refused to start the command.
pub const REFUSED_EXIT_CODE: i32 = 125;

/// The prefix of every message the helper itself writes to stderr.
pub const MESSAGE_PREFIX: &str = "keel-sandbox: ";

/// `argv[1]` of the helper's first stage.
pub(crate) const STAGE1_MARKER: &str = "__keel-sandbox";
/// `argv[1]` that makes the helper print [`BUILD`] (16 hex digits and a newline) and exit 0.
pub(crate) const BUILD_MARKER: &str = "__keel-sandbox-build";
/// The environment variable that carries the request to the helper (never to the command).
pub(crate) const REQUEST_VAR: &str = "KEEL_SANDBOX_REQUEST";

/// What a helper and the program that starts it must agree on: a hash (FNV-1a) of this crate's
/// own source and manifest, computed at compile time. Two binaries built from the same
/// keel-sandbox have the same `BUILD`; a helper left from an older build has another, and
/// [`is_helper_of_this_build`] says so before it is used (and the helper refuses a request of another build).
pub const BUILD: u64 = fnv1a(&[
    include_bytes!("lib.rs"),
    include_bytes!("helper.rs"),
    include_bytes!("rules.rs"),
    include_bytes!("cgroup.rs"),
    include_bytes!("error.rs"),
    include_bytes!("netns.rs"),
    include_bytes!("../Cargo.toml"),
]);

const fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    let mut i = 0;
    while i < parts.len() {
        let part = parts[i];
        let mut j = 0;
        while j < part.len() {
            hash ^= part[j] as u64;
            hash = hash.wrapping_mul(0x0100_0000_01b3);
            j += 1;
        }
        i += 1;
    }
    hash
}

/// Whether `helper` is a sandbox helper of this very build: runs it once as
/// `<helper> __keel-sandbox-build` (empty environment, no input) and compares what it prints
/// with [`BUILD`]. False for a missing or non-executable file, a program that is not a helper,
/// and a helper of another build. A program that can re-execute itself uses this to prefer a
/// small helper binary, whose start costs far less than its own.
pub fn is_helper_of_this_build(helper: &Path) -> bool {
    let output = Command::new(helper)
        .arg(BUILD_MARKER)
        .env_clear()
        .current_dir("/")
        .stdin(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .output();
    matches!(output, Ok(out) if out.status.success() && out.stdout == format!("{BUILD:016x}\n").as_bytes())
}

/// The lowest Landlock ABI the sandbox accepts: ABI 3 is the first that handles truncation.
pub const MIN_LANDLOCK_ABI: u8 = 3;

/// What the command may do.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Policy {
    /// The command's working directory, writable. Must be an absolute path to a directory.
    pub workspace: PathBuf,
    /// Extra writable hierarchies (absolute paths that exist).
    pub writable: Vec<PathBuf>,
    /// Paths the command must not see: a directory is covered by an empty read-only tmpfs of
    /// mode 000, anything else by a bind-mounted empty file of mode 000. Paths that do not exist
    /// are skipped; a symbolic link is followed and its target covered.
    pub hidden: Vec<PathBuf>,
    /// `false`: a network namespace of its own with only a loopback interface, down.
    pub network: bool,
    pub limits: Limits,
    /// The complete environment of the command (the private `TMPDIR` is added).
    pub env: Vec<(String, String)>,
    /// The program and its arguments; `argv[0]` is looked up in `PATH` from `env` (or
    /// `/bin:/usr/bin` without one).
    pub argv: Vec<String>,
}

/// Resource limits of the command. `None` leaves the limit as inherited.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Limits {
    /// CPU seconds of each process (`RLIMIT_CPU`): SIGXCPU at the limit, SIGKILL one second
    /// later (the command itself is PID 1 of its namespace, which ignores SIGXCPU: it gets the
    /// SIGKILL). Not a limit on the tree's total.
    pub cpu_seconds: Option<u64>,
    /// Address space in bytes (`RLIMIT_AS`).
    pub memory_bytes: Option<u64>,
    /// Open file descriptors (`RLIMIT_NOFILE`).
    pub open_files: Option<u64>,
    /// Processes and threads of the command together (pids cgroup as root, `RLIMIT_NPROC`
    /// otherwise). At least 1.
    pub processes: Option<u64>,
}

impl Default for Limits {
    /// 8 GiB of address space, 1024 open files, 512 processes, no CPU limit (the caller sets
    /// one from its budget).
    fn default() -> Self {
        Limits {
            cpu_seconds: None,
            memory_bytes: Some(8 << 30),
            open_files: Some(1024),
            processes: Some(512),
        }
    }
}

/// What the helper receives.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Request {
    pub policy: Policy,
    /// The private temporary directory (`TMPDIR`).
    pub tmp: PathBuf,
    /// The directory that holds `tmp`, the cover file and the refusal report.
    pub private: PathBuf,
    /// The process that started the helper: stage 1 ends the command when it dies.
    pub parent: u32,
    /// A file stage 1 writes once every process of the command is gone (see
    /// [`Sandbox::command_noting_end`]).
    #[serde(default)]
    pub ended: Option<PathBuf>,
    /// A network namespace the caller made or kept for the command (`/proc/<caller>/fd/<n>`),
    /// which stage 1 enters instead of making one; only as root, only without network.
    #[serde(default)]
    pub net: Option<PathBuf>,
    /// A pids cgroup the caller made or kept for the command, `pids.max` set: stage 1 moves
    /// into it unless it was started there, makes stage 2 in it, and neither makes nor removes
    /// one. Only as root, only with a process limit.
    #[serde(default)]
    pub cgroup: Option<PathBuf>,
    /// The starting program's [`BUILD`]: a helper of another build refuses the request.
    #[serde(default)]
    pub build: u64,
}

/// The refusal report's name in the private directory (made only when there is a refusal).
pub(crate) const REPORT_FILE: &str = "refusal";
/// The cover of hidden files, in the private directory (made only when a file is hidden).
pub(crate) const COVER_FILE: &str = "cover";

/// Runs commands under a sandbox applied by `helper`, a binary that calls [`enter_if_helper`]
/// first thing in `main`.
#[derive(Debug, Clone)]
pub struct Sandbox {
    helper: PathBuf,
}

impl Sandbox {
    /// `helper_exe`: usually `std::env::current_exe()`.
    pub fn new(helper_exe: impl Into<PathBuf>) -> Self {
        Sandbox {
            helper: helper_exe.into(),
        }
    }

    /// The helper binary.
    pub fn helper(&self) -> &Path {
        &self.helper
    }

    /// A [`Command`] that runs `policy.argv` under `policy`, for the caller to spawn (setting
    /// stdin, stdout, stderr and `process_group(0)`; it must not add environment variables, the
    /// helper ignores them). The returned [`PrivateTmp`] must live until the command has ended:
    /// it is the command's `TMPDIR` and holds the refusal report.
    pub fn command(&self, policy: &Policy) -> Result<(Command, PrivateTmp), SandboxError> {
        self.command_noting_end(policy, None)
    }

    /// [`Sandbox::command`], and stage 1 writes the file `ended` (outside the sandbox, created
    /// or overwritten) once every process of the command is gone: when the command ends, when
    /// the caller ends it, and when the caller dies first (stage 1 then ends the command and
    /// writes the file before it exits). The file's modification time is the moment after
    /// which nothing of the command can have changed a file: a caller that crashed while the
    /// command ran tells the command's changes from later ones by it. Stage 1 itself killed
    /// with SIGKILL writes nothing.
    pub fn command_noting_end(
        &self,
        policy: &Policy,
        ended: Option<&Path>,
    ) -> Result<(Command, PrivateTmp), SandboxError> {
        check_policy(policy)?;
        if let Some(path) = ended.filter(|p| !p.is_absolute()) {
            return Err(SandboxError::InvalidPolicy(format!(
                "the end file {} is not an absolute path",
                path.display()
            )));
        }
        let mut private = PrivateTmp::new()?;
        if !policy.network {
            private.net = netns::take();
        }
        if let Some(max) = policy.limits.processes {
            private.cgroup = cgroup::take(max);
        }
        let mut policy = policy.clone();
        policy.env.retain(|(k, _)| k != "TMPDIR");
        policy
            .env
            .push(("TMPDIR".into(), private.path().display().to_string()));
        let request = Request {
            policy,
            tmp: private.path().to_path_buf(),
            private: private.root().to_path_buf(),
            parent: std::process::id(),
            ended: ended.map(Path::to_path_buf),
            net: private.net.as_ref().map(netns::path),
            cgroup: private.cgroup.as_ref().map(|taken| taken.dir.clone()),
            build: BUILD,
        };
        let json = serde_json::to_string(&request).map_err(SandboxError::Serialize)?;
        let mut cmd = Command::new(&self.helper);
        cmd.arg(STAGE1_MARKER)
            .env_clear()
            .env(REQUEST_VAR, json)
            .current_dir("/");
        Ok((cmd, private))
    }
}

/// Checks what can be checked without the kernel.
pub(crate) fn check_policy(policy: &Policy) -> Result<(), SandboxError> {
    let invalid = |m: String| Err(SandboxError::InvalidPolicy(m));
    if policy.argv.is_empty() {
        return invalid("the command is empty: give at least a program in `argv`".into());
    }
    if !policy.workspace.is_absolute() {
        return invalid(format!(
            "the workspace {} is not an absolute path",
            policy.workspace.display()
        ));
    }
    for p in policy.writable.iter().chain(&policy.hidden) {
        if !p.is_absolute() {
            return invalid(format!(
                "{} is not an absolute path: writable and hidden paths must be absolute",
                p.display()
            ));
        }
    }
    if policy.limits.processes == Some(0) {
        return invalid("a process limit of 0 would not let the command itself run".into());
    }
    for (k, _) in &policy.env {
        if k.is_empty() || k.contains('=') || k.contains('\0') {
            return invalid(format!("the environment variable name {k:?} is not valid"));
        }
    }
    Ok(())
}

/// How the number of processes is limited.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProcessLimit {
    /// A pids cgroup per command under this cgroup v2 directory.
    CgroupV2(PathBuf),
    /// A pids cgroup per command under this cgroup v1 `pids` hierarchy.
    CgroupV1(PathBuf),
    /// `RLIMIT_NPROC` (not root: counts all processes of the uid).
    Rlimit,
}

/// What this kernel and this process can enforce.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Support {
    /// The highest Landlock ABI whose restrictions the kernel enforces, as far as they can be
    /// told apart (ABIs that only add flags, like 7 and 8, read as the one before).
    pub landlock_abi: u8,
    /// Whether the sandbox needs a user namespace (not running as root).
    pub user_namespace: bool,
    /// How the process limit is enforced, `None` if it cannot be.
    pub process_limit: Option<ProcessLimit>,
}

impl Support {
    /// Whether `policy` can be enforced here; the error says what is missing.
    pub fn check(&self, policy: &Policy) -> Result<(), SandboxError> {
        check_policy(policy)?;
        if policy.limits.processes.is_some() && self.process_limit.is_none() {
            return Err(SandboxError::ProcessLimitUnavailable);
        }
        Ok(())
    }
}

/// What this kernel can enforce. An error if the sandbox cannot run at all here (Landlock
/// below ABI 3, namespaces missing or forbidden).
///
/// A support found complete (a process limit included) is kept for the life of the process:
/// the probe makes and removes a cgroup, a slow kernel operation, and a worker asked it at the
/// start of every run. Anything less is probed again next time.
pub fn probe() -> Result<Support, SandboxError> {
    static FOUND: std::sync::OnceLock<Support> = std::sync::OnceLock::new();
    if let Some(found) = FOUND.get() {
        return Ok(found.clone());
    }
    let support = probe_now()?;
    if support.process_limit.is_some() {
        let _ = FOUND.set(support.clone());
    }
    Ok(support)
}

fn probe_now() -> Result<Support, SandboxError> {
    let landlock_abi = rules::probe_abi();
    if landlock_abi < MIN_LANDLOCK_ABI {
        return Err(SandboxError::LandlockUnavailable { abi: landlock_abi });
    }
    let root = nix::unistd::geteuid().is_root();
    for ns in ["mnt", "pid", "net"]
        .iter()
        .chain(if root { [].iter() } else { ["user"].iter() })
    {
        if !Path::new("/proc/self/ns").join(ns).exists() {
            return Err(SandboxError::NamespacesUnavailable(format!(
                "this kernel has no {ns} namespaces (no /proc/self/ns/{ns})"
            )));
        }
    }
    if !root {
        let read = |p: &str| {
            std::fs::read_to_string(p)
                .ok()
                .map(|s| s.trim().to_string())
        };
        if read("/proc/sys/user/max_user_namespaces").as_deref() == Some("0") {
            return Err(SandboxError::NamespacesUnavailable(
                "user namespaces are disabled (user.max_user_namespaces = 0); run as root or set it above 0".into(),
            ));
        }
        if read("/proc/sys/kernel/unprivileged_userns_clone").as_deref() == Some("0") {
            return Err(SandboxError::NamespacesUnavailable(
                "unprivileged user namespaces are disabled (kernel.unprivileged_userns_clone = 0); run as root or set it to 1".into(),
            ));
        }
    }
    let process_limit = if root {
        cgroup::probe()
    } else {
        Some(ProcessLimit::Rlimit)
    };
    Ok(Support {
        landlock_abi,
        user_namespace: !root,
        process_limit,
    })
}
