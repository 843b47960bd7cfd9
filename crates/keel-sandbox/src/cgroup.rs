//! A pids cgroup per command, for root (the kernel does not apply `RLIMIT_NPROC` to uid 0).
//!
//! The cgroup is made directly under the root of the pids hierarchy (cgroup v2 when its pids
//! controller is usable, else the v1 `pids` hierarchy), named `keel-<stage 1 pid>-<nanos>`.
//! Stage 2 moves itself in before anything else; stage 1 removes it once stage 2 is gone. A
//! cgroup left by a stage 1 that was killed (its pid no longer exists) is removed by the next
//! one. (The caller's cgroups below are joined by stage 1 instead.)
//!
//! A caller running as root makes them itself instead (named after its own pid), hands one to
//! each command with a process limit, and keeps it for the next command once the helper has
//! exited by itself and no task is left in it (at most [`KEPT`](crate::private::KEPT), removed
//! at a normal exit): making and removing a cgroup each take the kernel's global cgroup lock,
//! behind every other command's cgroup work; in `keel-bench`'s 1,000 runs keeping them took a
//! verifier command's median from 26-32 ms to 22-26 (three alternating pairs). The caller
//! writes `pids.max` for each command.
//!
//! Moving a task into a cgroup takes the kernel's cgroup thread-group lock for writing, which
//! waits for an RCU grace period unless another move happened just before: 6-18 ms on the
//! benchmark's machine, the largest part of a short command's start (`keel-bench`'s verifier,
//! `test -f`, took 12 ms when run alone). A child is made in its parent's cgroup with no move,
//! and under the v1 hierarchy a cgroup holds threads, not whole processes. So under v1 the
//! caller puts a thread of its own in each cgroup it makes, a holder ([`Holder`]), which moves
//! in once and stays for as long as the cgroup is kept; the helper is started from that thread
//! ([`PrivateTmp::spawn`](crate::PrivateTmp::spawn)), and it and the command are in the cgroup
//! from their start. Stage 1 moves itself into a cgroup the caller gave only when it is not in
//! it already (cgroup v2, where the threads of a process share one cgroup, or a helper started
//! with `Command::spawn`), before it makes stage 2 there. `pids.max` is the command's limit plus
//! the tasks that are there before the command: stage 1, and the holder if there is one.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::{Mutex, PoisonError, mpsc};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::ProcessLimit;
use crate::error::SandboxError;

const V2_CANDIDATES: [&str; 2] = ["/sys/fs/cgroup", "/sys/fs/cgroup/unified"];
const V1_PIDS: &str = "/sys/fs/cgroup/pids";

/// Where per-command pids cgroups can be made, checked by making one.
pub(crate) fn probe() -> Option<ProcessLimit> {
    let found = find()?;
    let dir = base(&found).join(format!("keel-probe-{}-{}", std::process::id(), nanos()));
    let ok = fs::create_dir(&dir).is_ok();
    let writable = ok && fs::write(dir.join("pids.max"), "16").is_ok();
    if ok {
        let _ = fs::remove_dir(&dir);
    }
    writable.then_some(found)
}

fn base(limit: &ProcessLimit) -> &Path {
    match limit {
        ProcessLimit::CgroupV2(p) | ProcessLimit::CgroupV1(p) => p,
        ProcessLimit::Rlimit => Path::new("/"),
    }
}

fn find() -> Option<ProcessLimit> {
    for dir in V2_CANDIDATES {
        let dir = Path::new(dir);
        let Ok(controllers) = fs::read_to_string(dir.join("cgroup.controllers")) else {
            continue;
        };
        if !controllers.split_whitespace().any(|c| c == "pids") {
            continue;
        }
        let control = dir.join("cgroup.subtree_control");
        let enabled = fs::read_to_string(&control)
            .map(|s| s.split_whitespace().any(|c| c == "pids"))
            .unwrap_or(false);
        if enabled || fs::write(&control, "+pids").is_ok() {
            return Some(ProcessLimit::CgroupV2(dir.to_path_buf()));
        }
    }
    let v1 = Path::new(V1_PIDS);
    v1.join("cgroup.procs")
        .exists()
        .then(|| ProcessLimit::CgroupV1(v1.to_path_buf()))
}

fn nanos() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0)
}

/// Makes a pids cgroup allowing `max` tasks, for the stage 1 whose pid is `owner`.
pub(crate) fn create(max: u64, owner: u32) -> Result<PathBuf, SandboxError> {
    let found = find().ok_or(SandboxError::ProcessLimitUnavailable)?;
    let base = base(&found);
    collect_stale(base);
    let dir = base.join(format!("keel-{owner}-{}", nanos()));
    let err = |path: &Path, source| SandboxError::Cgroup {
        path: path.to_path_buf(),
        source,
    };
    fs::create_dir(&dir).map_err(|e| err(&dir, e))?;
    if let Err(e) = fs::write(dir.join("pids.max"), max.to_string()) {
        let _ = fs::remove_dir(&dir);
        return Err(err(&dir.join("pids.max"), e));
    }
    Ok(dir)
}

/// A cgroup taken for one command: its directory and, under the v1 hierarchy, the thread of
/// this process inside it that starts the command's helper.
#[derive(Debug)]
pub(crate) struct Taken {
    pub dir: PathBuf,
    holder: Option<Holder>,
}

/// Tasks in a cgroup the caller made, besides the command's: stage 1, and the holder if it has
/// one.
fn held_tasks(holder: bool) -> u64 {
    1 + u64::from(holder)
}

type Job = Box<dyn FnOnce() + Send>;

/// A thread of this process that moved itself into a cgroup, where it stays, and starts
/// processes there when asked: a child is made in its parent thread's cgroup, with no move.
#[derive(Debug)]
struct Holder {
    tid: i32,
    jobs: mpsc::Sender<Job>,
}

impl Holder {
    /// A holder in the v1 cgroup `dir` (writing "0" to `tasks` moves the writing thread only);
    /// `None` if the thread could not be started or could not move in.
    fn start(dir: &Path) -> Option<Holder> {
        let tasks = dir.join("tasks");
        let (ready, is_ready) = mpsc::channel();
        let (jobs, queue) = mpsc::channel::<Job>();
        std::thread::Builder::new()
            .name("keel-cgroup".into())
            .spawn(move || {
                let tid = nix::unistd::gettid().as_raw();
                let joined = fs::write(&tasks, "0").is_ok();
                let _ = ready.send(joined.then_some(tid));
                if joined {
                    // Ends when the sender is dropped: the cgroup is no longer kept.
                    while let Ok(job) = queue.recv() {
                        job();
                    }
                }
            })
            .ok()?;
        let tid = is_ready.recv().ok()??;
        Some(Holder { tid, jobs })
    }

    /// Whether no task but the holder is in `dir`.
    fn alone_in(&self, dir: &Path) -> bool {
        let tid = self.tid.to_string();
        fs::read_to_string(dir.join("tasks")).is_ok_and(|s| s.split_whitespace().eq([tid.as_str()]))
    }
}

impl Taken {
    /// Starts `cmd` in the cgroup: from its holder thread when it has one (so the command's
    /// helper starts inside it), else from the calling thread (stage 1 then moves in).
    pub(crate) fn spawn(&self, mut cmd: Command) -> std::io::Result<Child> {
        let Some(holder) = &self.holder else {
            return cmd.spawn();
        };
        let (reply, replied) = mpsc::channel();
        let job: Job = Box::new(move || {
            let _ = reply.send(cmd.spawn());
        });
        // A holder that is gone (it cannot be: it ends only when its sender is dropped) gives
        // the job back, which then runs here.
        if let Err(mpsc::SendError(job)) = holder.jobs.send(job) {
            job();
        }
        replied.recv().unwrap_or_else(|_| {
            Err(std::io::Error::other(
                "the thread that starts commands in their cgroup ended while starting one",
            ))
        })
    }

    /// Sets the command's limit: `max` tasks of its own.
    fn limit(&self, max: u64) -> std::io::Result<()> {
        let held = held_tasks(self.holder.is_some());
        fs::write(
            self.dir.join("pids.max"),
            max.saturating_add(held).to_string(),
        )
    }

    /// Whether nothing of a command is left in the cgroup.
    fn empty(&self) -> bool {
        match &self.holder {
            Some(holder) => holder.alone_in(&self.dir),
            None => {
                fs::read_to_string(self.dir.join("cgroup.procs")).is_ok_and(|s| s.trim().is_empty())
            }
        }
    }

    /// Moves the holder back to the hierarchy's root, so that the cgroup can be removed, and
    /// ends its thread.
    fn release(self) -> PathBuf {
        if let (Some(holder), Some(base)) = (self.holder, self.dir.parent()) {
            let _ = fs::write(base.join("tasks"), holder.tid.to_string());
        }
        self.dir
    }
}

/// Cgroups of ended commands with no task left, ready for the next command of this process.
static POOL: Mutex<Vec<Taken>> = Mutex::new(Vec::new());

/// A cgroup allowing `max` tasks for a command of this process (the caller, as root): a kept
/// one or a new one. `None` when one cannot be had here: the helper then makes its own, or
/// says why it cannot.
pub(crate) fn take(max: u64) -> Option<Taken> {
    if !nix::unistd::geteuid().is_root() {
        return None;
    }
    let kept = POOL.lock().unwrap_or_else(PoisonError::into_inner).pop();
    if let Some(taken) = kept {
        if taken.limit(max).is_ok() {
            return Some(taken);
        }
        abandon(taken);
    }
    let v1 = matches!(find(), Some(ProcessLimit::CgroupV1(_)));
    let dir = create(max, std::process::id()).ok()?;
    let holder = if v1 { Holder::start(&dir) } else { None };
    let taken = Taken { dir, holder };
    if taken.limit(max).is_err() {
        abandon(taken);
        return None;
    }
    Some(taken)
}

/// Gives back the cgroup of a command whose helper exited by itself: kept for the next
/// command when no task of the command is left in it, else removed.
pub(crate) fn give_back(taken: Taken) {
    if taken.empty() {
        let mut pool = POOL.lock().unwrap_or_else(PoisonError::into_inner);
        if pool.len() < crate::private::KEPT {
            pool.push(taken);
            drop(pool);
            crate::private::remove_kept_at_exit();
            return;
        }
    }
    abandon(taken);
}

/// Removes the cgroup of a command that may still be ending, once its last task is gone,
/// without making the caller wait. A holder leaves only then: the helper's stage 1 is told to
/// end when the thread that started it ends (`PR_SET_PDEATHSIG`).
pub(crate) fn abandon(taken: Taken) {
    if taken.holder.is_some() && !taken.empty() {
        let _ = std::thread::Builder::new()
            .name("keel-cgroup".into())
            .spawn(move || {
                for _ in 0..100 {
                    if taken.empty() {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
                remove(&taken.release());
            });
        return;
    }
    let dir = taken.release();
    if fs::remove_dir(&dir).is_err() && dir.exists() {
        let _ = std::thread::Builder::new()
            .name("keel-cgroup".into())
            .spawn(move || remove(&dir));
    }
}

/// Removes the kept cgroups; the pool is empty afterwards. Called at exit.
pub(crate) fn remove_kept() {
    let kept = match POOL.try_lock() {
        Ok(mut pool) => std::mem::take(&mut *pool),
        Err(std::sync::TryLockError::Poisoned(pool)) => std::mem::take(&mut *pool.into_inner()),
        Err(std::sync::TryLockError::WouldBlock) => return,
    };
    for taken in kept {
        let _ = fs::remove_dir(taken.release());
    }
}

/// How many cgroups are kept now (for tests).
#[doc(hidden)]
pub fn kept() -> usize {
    POOL.lock().unwrap_or_else(PoisonError::into_inner).len()
}

/// Whether the calling process is in the cgroup `dir` of the pids hierarchy, by its line in
/// `/proc/self/cgroup` (`N:pids:/name` under v1, `0::/name` under v2).
pub(crate) fn holds_self(dir: &Path) -> bool {
    let Some(name) = dir.file_name().and_then(|n| n.to_str()) else {
        return false;
    };
    fs::read_to_string("/proc/self/cgroup").is_ok_and(|text| {
        text.lines().any(|line| {
            let mut parts = line.splitn(3, ':');
            let (Some(_), Some(controllers), Some(path)) =
                (parts.next(), parts.next(), parts.next())
            else {
                return false;
            };
            (controllers.is_empty() || controllers.split(',').any(|c| c == "pids"))
                && path.strip_prefix('/') == Some(name)
        })
    })
}

/// Moves the calling process into `dir`.
pub(crate) fn join(dir: &Path) -> Result<(), SandboxError> {
    let procs = dir.join("cgroup.procs");
    fs::write(&procs, "0").map_err(|source| SandboxError::Cgroup {
        path: procs,
        source,
    })
}

/// Removes `dir` once its last task has gone (a few seconds at most).
pub(crate) fn remove(dir: &Path) {
    for _ in 0..100 {
        if fs::remove_dir(dir).is_ok() || !dir.exists() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Removes the cgroups of stage 1 processes that no longer exist.
fn collect_stale(base: &Path) {
    let Ok(entries) = fs::read_dir(base) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(rest) = name.to_str().and_then(|n| n.strip_prefix("keel-")) else {
            continue;
        };
        let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        if !Path::new("/proc").join(pid.to_string()).exists() {
            let _ = fs::remove_dir(entry.path());
        }
    }
}
