//! The helper's two stages (see the crate documentation).

use std::fs::{self, File};
use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use nix::errno::Errno;
use nix::mount::{MsFlags, mount};
use nix::sched::{CloneFlags, unshare};
use nix::sys::resource::{Resource, getrlimit, setrlimit};
use nix::sys::signal::{SigSet, SigmaskHow, Signal, kill, sigprocmask};
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::{Pid, getgid, getuid};
use serde::Deserialize;

use crate::error::SandboxError;
use crate::{
    BUILD, BUILD_MARKER, COVER_FILE, MESSAGE_PREFIX, REFUSED_EXIT_CODE, REPORT_FILE, REQUEST_VAR,
    Request, STAGE1_MARKER, cgroup, check_policy, rules,
};

/// What stage 1 hands to stage 2 (its fork).
#[derive(Debug)]
struct Stage2 {
    request: Request,
    /// Stage 1's pid (in the caller's pid namespace).
    parent: u32,
    /// The command's pids cgroup, as root.
    cgroup: Option<PathBuf>,
    /// Whether stage 2 moves into `cgroup`: stage 1 made it, and is not in it. A cgroup the
    /// caller gave, stage 1 is in, and stage 2 is made there.
    join_cgroup: bool,
    /// More writable places stage 1 made (the private `/dev/shm`).
    extra_writable: Vec<PathBuf>,
}

/// Call first thing in `main`, before any thread is started. If this process is the sandbox
/// helper (`argv[1]` is `__keel-sandbox` or its second stage), it never returns: it applies the
/// policy and becomes the command, or writes `keel-sandbox: <why>` to stderr and exits
/// [`REFUSED_EXIT_CODE`] (125). With `argv[1]` `__keel-sandbox-build` it prints [`BUILD`]
/// (what [`is_helper_of_this_build`](crate::is_helper_of_this_build) reads) and exits 0. Otherwise it returns at once.
pub fn enter_if_helper() {
    let mut args = std::env::args_os();
    let _ = args.next();
    match args.next() {
        Some(a) if a == STAGE1_MARKER => stage1(),
        Some(a) if a == BUILD_MARKER => {
            println!("{BUILD:016x}");
            std::process::exit(0)
        }
        _ => {}
    }
}

/// The whole `main` of a binary that is only the sandbox helper (keel's `keel-sandbox-helper`):
/// [`enter_if_helper`], and when this process was not started as the helper, a message naming
/// `name` on stderr and exit code 2.
pub fn helper_main(name: &str) -> ! {
    enter_if_helper();
    eprintln!(
        "{name}: not a sandbox helper invocation (it is started by keel to confine a command)"
    );
    std::process::exit(2)
}

fn read_env<T: for<'de> Deserialize<'de>>() -> Result<T, SandboxError> {
    let json = std::env::var(REQUEST_VAR)
        .map_err(|e| SandboxError::BadRequest(format!("{REQUEST_VAR}: {e}")))?;
    serde_json::from_str(&json).map_err(|e| SandboxError::BadRequest(e.to_string()))
}

/// Says why the command did not run, on stderr and in the report file, and exits 125.
fn refuse(report: Option<&File>, err: &SandboxError) -> ! {
    let message = err.to_string();
    eprintln!("{MESSAGE_PREFIX}{message}");
    if let Some(dir) = report {
        use nix::fcntl::{OFlag, openat};
        use nix::sys::stat::Mode;
        let flags = OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_APPEND | OFlag::O_CLOEXEC;
        if let Ok(fd) = openat(dir, REPORT_FILE, flags, Mode::from_bits_truncate(0o644)) {
            let _ = File::from(fd).write_all(message.as_bytes());
        }
    }
    std::process::exit(REFUSED_EXIT_CODE)
}

/// The directory the refusal report goes into, opened before anything could cover it. The
/// report file itself is made only when there is a refusal to write: a file made and removed
/// for every command costs an inode's allocation and release, and on a filesystem without a
/// journal (ext4 keeps recently released inodes unused for a while, and passes over them one by
/// one at every allocation) each release slows every file created after it.
fn open_report(request: &Request) -> Option<File> {
    File::open(&request.private).ok()
}

fn stage1() -> ! {
    let request: Request = match read_env() {
        Ok(r) => r,
        Err(e) => refuse(None, &e),
    };
    let report = open_report(&request);
    if request.build != BUILD {
        let exe = std::env::current_exe().unwrap_or_default();
        refuse(
            report.as_ref(),
            &SandboxError::BadRequest(format!(
                "the helper {} was built from other keel-sandbox source ({BUILD:016x}) than the \
                 program that started it ({:016x}): build or install them together",
                exe.display(),
                request.build
            )),
        );
    }
    // When the process that started it dies (keel killed by SIGKILL included), stage 1 gets
    // SIGTERM: it kills stage 2, and with it the command, and notes the end before it exits
    // (stage 2 and the command die with stage 1 in any case). It sets this itself, after exec,
    // so that keel can start it with `posix_spawn` rather than a `fork` of its whole memory map.
    if let Err(source) = nix::sys::prctl::set_pdeathsig(Signal::SIGTERM) {
        refuse(
            report.as_ref(),
            &SandboxError::Prctl {
                what: "the parent-death signal",
                source,
            },
        );
    }
    // The parent may have died before the line above: then nothing would kill us with it.
    if nix::unistd::getppid().as_raw() != request.parent as i32 {
        refuse(
            report.as_ref(),
            &SandboxError::BadRequest("the process that started the sandbox has exited".into()),
        );
    }
    match run_stage1(&request) {
        Ok(code) => std::process::exit(code),
        Err(e) => refuse(report.as_ref(), &e),
    }
}

/// The command's cgroup; stage 1 removes the one it made when it is done with it, whatever
/// happened (one the caller gave is the caller's to keep or remove).
struct CgroupGuard {
    dir: Option<PathBuf>,
    made: bool,
}

impl Drop for CgroupGuard {
    fn drop(&mut self) {
        if let (Some(dir), true) = (&self.dir, self.made) {
            cgroup::remove(dir);
        }
    }
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> SandboxError {
    let what = what.into();
    move |source| SandboxError::Io { what, source }
}

fn errno_io(what: impl Into<String>) -> impl FnOnce(Errno) -> SandboxError {
    let what = what.into();
    move |e| SandboxError::Io {
        what,
        source: std::io::Error::from(e),
    }
}

fn run_stage1(request: &Request) -> Result<i32, SandboxError> {
    let policy = &request.policy;
    check_policy(policy)?;
    if !policy.workspace.is_dir() {
        return Err(SandboxError::InvalidPolicy(format!(
            "the workspace {} is not a directory",
            policy.workspace.display()
        )));
    }
    for w in &policy.writable {
        if !w.exists() {
            return Err(SandboxError::InvalidPolicy(format!(
                "the writable path {} does not exist",
                w.display()
            )));
        }
    }
    let root = nix::unistd::geteuid().is_root();
    let (uid, gid) = (getuid(), getgid());
    // The end file's directory, opened before the hidden paths are covered: keel keeps it in
    // its store directory, which the command must not see.
    let end = match &request.ended {
        Some(path) => Some(EndFile::open(path)?),
        None => None,
    };

    let guard = match (root, policy.limits.processes, &request.cgroup) {
        (true, Some(_), Some(given)) => {
            // Started inside it when the caller's thread in it started the helper (see
            // `cgroup`); stage 2 is made in it either way.
            if !cgroup::holds_self(given) {
                cgroup::join(given)?;
            }
            CgroupGuard {
                dir: Some(given.clone()),
                made: false,
            }
        }
        (true, Some(max), None) => CgroupGuard {
            dir: Some(cgroup::create(max, std::process::id())?),
            made: true,
        },
        _ => CgroupGuard {
            dir: None,
            made: false,
        },
    };

    // Blocked before stage 2 exists, so that no SIGCHLD or SIGTERM is lost; std clears the mask
    // in the child it spawns.
    let mut signals = SigSet::empty();
    for s in [
        Signal::SIGTERM,
        Signal::SIGINT,
        Signal::SIGHUP,
        Signal::SIGQUIT,
        Signal::SIGCHLD,
    ] {
        signals.add(s);
    }
    sigprocmask(SigmaskHow::SIG_BLOCK, Some(&signals), None).map_err(errno_io("block signals"))?;

    let mut flags = CloneFlags::CLONE_NEWNS | CloneFlags::CLONE_NEWPID | CloneFlags::CLONE_NEWIPC;
    match (&request.net, policy.network) {
        (Some(_), true) => {
            return Err(SandboxError::BadRequest(
                "a network namespace was given for a command that may use the network".into(),
            ));
        }
        (Some(path), false) if root => {
            if !enter_kept_net(path, &request.private)? {
                flags |= CloneFlags::CLONE_NEWNET;
            }
        }
        // Not root (a root caller that started the helper as another user): the user namespace
        // it makes must own the command's network namespace, so it makes that too, leaving the
        // caller's untouched.
        (_, false) => flags |= CloneFlags::CLONE_NEWNET,
        (None, true) => {}
    }
    if !root {
        flags |= CloneFlags::CLONE_NEWUSER;
    }
    unshare(flags).map_err(|source| SandboxError::Unshare {
        what: format!("{flags:?}"),
        source,
    })?;
    if !root {
        // The caller's ids become 0 inside, so that stage 2 keeps its capabilities (in the new
        // user namespace) across exec until it drops them itself.
        fs::write("/proc/self/uid_map", format!("0 {uid} 1\n")).map_err(io("write uid_map"))?;
        fs::write("/proc/self/setgroups", "deny").map_err(io("write setgroups"))?;
        fs::write("/proc/self/gid_map", format!("0 {gid} 1\n")).map_err(io("write gid_map"))?;
    }
    mount(
        None::<&str>,
        "/",
        None::<&str>,
        MsFlags::MS_REC | MsFlags::MS_PRIVATE,
        None::<&str>,
    )
    .map_err(|source| SandboxError::Mount {
        what: "make the mounts private".into(),
        target: "/".into(),
        source,
    })?;

    hide(request)?;

    let mut extra_writable = Vec::new();
    let shm = Path::new("/dev/shm");
    if shm.is_dir()
        && mount(
            Some("tmpfs"),
            shm,
            Some("tmpfs"),
            MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
            Some("mode=1777"),
        )
        .is_ok()
    {
        extra_writable.push(shm.to_path_buf());
    }

    let stage2 = Stage2 {
        request: request.clone(),
        parent: std::process::id(),
        cgroup: guard.dir.clone(),
        join_cgroup: guard.made,
        extra_writable,
    };
    let pid = fork_stage2(stage2)?;
    let code = loop {
        match waitpid(pid, Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::Exited(_, code)) => break code,
            Ok(WaitStatus::Signaled(_, sig, _)) => break 128 + sig as i32,
            Ok(_) | Err(Errno::EINTR) => {}
            Err(e) => return Err(errno_io("wait for the sandboxed command")(e)),
        }
        match signals.wait() {
            Ok(Signal::SIGCHLD) | Err(_) => {}
            // The caller is ending the command: end everything in the sandbox now (stage 2 is
            // PID 1 of the namespace; its death takes every other process there with it).
            Ok(_) => {
                let _ = kill(pid, Signal::SIGKILL);
            }
        }
    };
    drop(guard);
    // Stage 2 was PID 1 of the command's pid namespace: the kernel reaped every other process
    // there before stage 2's own exit was reported, so nothing of the command runs any more.
    if let Some(end) = end {
        end.write();
    }
    Ok(code)
}

/// Enters the network namespace the caller made or kept for the command (see `netns`), if it
/// can (the caller's descriptor opens, `setns` succeeds) and the namespace is as made: loopback
/// its only interface, and down. False when not: stage 1 then makes the command a fresh one, as
/// it would without the caller's, and leaves the marker that tells the caller to drop this one.
fn enter_kept_net(path: &Path, private: &Path) -> Result<bool, SandboxError> {
    let entered =
        File::open(path).is_ok_and(|net| nix::sched::setns(&net, CloneFlags::CLONE_NEWNET).is_ok());
    let as_made = entered
        && nix::ifaddrs::getifaddrs().is_ok_and(|mut interfaces| {
            interfaces.all(|i| {
                i.interface_name == "lo" && !i.flags.contains(nix::net::if_::InterfaceFlags::IFF_UP)
            })
        });
    if !as_made {
        File::create(private.join(crate::netns::SPOILED)).map_err(io(format!(
            "mark the network namespace {} as not to be kept",
            path.display()
        )))?;
    }
    Ok(as_made)
}

/// The end file: its directory (open) and its name in it.
struct EndFile {
    dir: File,
    name: std::ffi::OsString,
}

impl EndFile {
    fn open(path: &Path) -> Result<EndFile, SandboxError> {
        let (Some(dir), Some(name)) = (path.parent(), path.file_name()) else {
            return Err(SandboxError::BadRequest(format!(
                "the end file {} has no directory and name",
                path.display()
            )));
        };
        let dir = File::open(dir).map_err(io(format!(
            "open the directory of the end file {}",
            path.display()
        )))?;
        Ok(EndFile {
            dir,
            name: name.to_os_string(),
        })
    }

    /// Writes the file (its modification time is what counts). A failure is not the command's:
    /// the caller then knows no end, and treats the command's changes as of unknown origin.
    fn write(self) {
        use nix::fcntl::{OFlag, openat};
        use nix::sys::stat::Mode;
        let flags = OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_TRUNC | OFlag::O_CLOEXEC;
        let mode = Mode::from_bits_truncate(0o644);
        if let Ok(fd) = openat(&self.dir, self.name.as_os_str(), flags, mode) {
            let _ = File::from(fd).write_all(b"every process of the command is gone\n");
        }
    }
}

/// Covers the hidden paths (in stage 1's new mount namespace).
fn hide(request: &Request) -> Result<(), SandboxError> {
    let cover = request.private.join(COVER_FILE);
    let mut cover_made = false;
    let mount_err = |what: &str, target: &Path| {
        let what = what.to_string();
        let target = target.to_path_buf();
        move |source| SandboxError::Mount {
            what,
            target,
            source,
        }
    };
    for path in &request.policy.hidden {
        let meta = match fs::metadata(path) {
            Ok(m) => m,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(io(format!("look at the hidden path {}", path.display()))(e)),
        };
        if meta.is_dir() {
            mount(
                Some("tmpfs"),
                path,
                Some("tmpfs"),
                MsFlags::MS_RDONLY | MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
                Some("mode=000,size=4k"),
            )
            .map_err(mount_err("cover a hidden directory", path))?;
        } else {
            if !cover_made {
                File::create(&cover).map_err(io("create the cover file"))?;
                fs::set_permissions(&cover, fs::Permissions::from_mode(0o000))
                    .map_err(io("make the cover file unreadable"))?;
                cover_made = true;
            }
            mount(
                Some(&cover),
                path,
                None::<&str>,
                MsFlags::MS_BIND,
                None::<&str>,
            )
            .map_err(mount_err("cover a hidden file", path))?;
            mount(
                None::<&str>,
                path,
                None::<&str>,
                MsFlags::MS_REMOUNT
                    | MsFlags::MS_BIND
                    | MsFlags::MS_RDONLY
                    | MsFlags::MS_NOSUID
                    | MsFlags::MS_NODEV
                    | MsFlags::MS_NOEXEC,
                None::<&str>,
            )
            .map_err(mount_err("make a hidden file's cover read-only", path))?;
        }
    }
    Ok(())
}

/// Starts stage 2 as a fork of stage 1 (no second exec of the helper's binary, whose start
/// alone costs a millisecond of CPU on a virtual machine): the child is PID 1 of the new pid
/// namespace and never returns from here.
fn fork_stage2(stage: Stage2) -> Result<Pid, SandboxError> {
    // A fork is sound only in a process of one thread: the child gets a copy of this thread
    // alone, and a lock another thread held would stay held in it for ever. The helper is
    // entered first thing in `main`, before any thread starts; checked, failing closed.
    let threads = fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find_map(|l| l.strip_prefix("Threads:"))
                .and_then(|n| n.trim().parse::<u32>().ok())
        });
    if threads != Some(1) {
        return Err(SandboxError::BadRequest(format!(
            "the sandbox's first stage runs {} threads, not one: it was entered after a thread \
             started (call keel_sandbox::enter_if_helper first thing in main)",
            threads.map_or("an unknown number of".to_string(), |n| n.to_string())
        )));
    }
    match fork_one_thread().map_err(errno_io("start the sandbox's second stage"))? {
        nix::unistd::ForkResult::Parent { child } => Ok(child),
        nix::unistd::ForkResult::Child => {
            // Stage 1 blocked the signals it waits for; the command starts with none blocked.
            let _ = sigprocmask(SigmaskHow::SIG_SETMASK, Some(&SigSet::empty()), None);
            stage2(&stage)
        }
    }
}

/// `fork(2)` of a process of one thread (see `fork_stage2`).
#[allow(unsafe_code)]
fn fork_one_thread() -> nix::Result<nix::unistd::ForkResult> {
    // SAFETY: the caller checked that this process has one thread, so the child's copy of the
    // address space holds no lock or allocator state that another thread was in the middle of
    // changing; the child goes on with ordinary code and ends in exec or exit.
    unsafe { nix::unistd::fork() }
}

fn stage2(stage: &Stage2) -> ! {
    let report = open_report(&stage.request);
    match run_stage2(stage) {
        Ok(exec_error) => {
            let program = stage
                .request
                .policy
                .argv
                .first()
                .cloned()
                .unwrap_or_default();
            eprintln!("{MESSAGE_PREFIX}cannot execute {program}: {exec_error}");
            let code = if exec_error.kind() == std::io::ErrorKind::NotFound {
                127
            } else {
                126
            };
            std::process::exit(code)
        }
        Err(e) => refuse(report.as_ref(), &e),
    }
}

/// Becomes the command; returns only the error of `exec`.
fn run_stage2(stage: &Stage2) -> Result<std::io::Error, SandboxError> {
    let policy = &stage.request.policy;
    if let Some(dir) = &stage.cgroup
        && stage.join_cgroup
    {
        cgroup::join(dir)?;
    }
    nix::sys::prctl::set_pdeathsig(Signal::SIGKILL).map_err(|source| SandboxError::Prctl {
        what: "the parent-death signal",
        source,
    })?;
    // Stage 1 may have died before the line above: then nothing would kill us with it.
    if !alive(stage.parent) {
        return Err(SandboxError::BadRequest(
            "the sandbox's first stage has already exited".into(),
        ));
    }
    mount(
        Some("proc"),
        "/proc",
        Some("proc"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        None::<&str>,
    )
    .map_err(|source| SandboxError::Mount {
        what: "mount a private /proc".into(),
        target: "/proc".into(),
        source,
    })?;

    set_limits(policy, stage.cgroup.is_none())?;

    let mut writable = vec![policy.workspace.clone()];
    writable.extend(policy.writable.iter().cloned());
    writable.push(stage.request.tmp.clone());
    writable.extend(stage.extra_writable.iter().cloned());
    let ruleset = rules::build(&writable)?;

    drop_capabilities()?;
    nix::sys::prctl::set_no_new_privs().map_err(|source| SandboxError::Prctl {
        what: "no_new_privs",
        source,
    })?;
    rules::apply(ruleset)?;

    let (program, args) = policy
        .argv
        .split_first()
        .ok_or_else(|| SandboxError::InvalidPolicy("the command is empty".into()))?;
    Ok(Command::new(program)
        .args(args)
        .env_clear()
        .envs(policy.env.iter().map(|(k, v)| (k, v)))
        .current_dir(&policy.workspace)
        .exec())
}

/// Whether the process `pid` (in the caller's pid namespace, as the inherited `/proc` shows it)
/// exists and is not a zombie.
fn alive(pid: u32) -> bool {
    let Ok(stat) = fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    let state = stat
        .rfind(')')
        .and_then(|i| stat[i + 1..].trim_start().chars().next());
    !matches!(state, None | Some('Z') | Some('X'))
}

fn set_limits(policy: &crate::Policy, nproc: bool) -> Result<(), SandboxError> {
    let set = |what: &'static str, resource: Resource, soft: u64, hard: u64| {
        let (_, current_hard) =
            getrlimit(resource).map_err(|source| SandboxError::Rlimit { what, source })?;
        let hard = hard.min(current_hard);
        setrlimit(resource, soft.min(hard), hard)
            .map_err(|source| SandboxError::Rlimit { what, source })
    };
    let limits = &policy.limits;
    if let Some(cpu) = limits.cpu_seconds {
        set("CPU time", Resource::RLIMIT_CPU, cpu, cpu.saturating_add(1))?;
    }
    if let Some(bytes) = limits.memory_bytes {
        set("memory (address space)", Resource::RLIMIT_AS, bytes, bytes)?;
    }
    if let Some(files) = limits.open_files {
        set("open files", Resource::RLIMIT_NOFILE, files, files)?;
    }
    if nproc && let Some(n) = limits.processes {
        set("process", Resource::RLIMIT_NPROC, n, n)?;
    }
    Ok(())
}

fn drop_capabilities() -> Result<(), SandboxError> {
    use caps::CapSet;
    let err = |set: &str, e: caps::errors::CapsError| {
        SandboxError::Capabilities(format!("{set} set: {e}"))
    };
    if caps::runtime::ambient_set_supported().is_ok() {
        caps::clear(None, CapSet::Ambient).map_err(|e| err("ambient", e))?;
    }
    caps::clear(None, CapSet::Bounding).map_err(|e| err("bounding", e))?;
    for (name, set) in [
        ("inheritable", CapSet::Inheritable),
        ("effective", CapSet::Effective),
        ("permitted", CapSet::Permitted),
    ] {
        caps::clear(None, set).map_err(|e| err(name, e))?;
    }
    let left = caps::read(None, CapSet::Permitted).map_err(|e| err("permitted", e))?;
    if !left.is_empty() {
        return Err(SandboxError::Capabilities(format!(
            "still permitted: {left:?}"
        )));
    }
    Ok(())
}
