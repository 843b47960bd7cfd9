//! A pids cgroup per command, for root (the kernel does not apply `RLIMIT_NPROC` to uid 0).
//!
//! The cgroup is made directly under the root of the pids hierarchy (cgroup v2 when its pids
//! controller is usable, else the v1 `pids` hierarchy), named `keel-<stage 1 pid>-<nanos>`.
//! Stage 2 moves itself in before anything else; stage 1 removes it once stage 2 is gone. A
//! cgroup left by a stage 1 that was killed (its pid no longer exists) is removed by the next
//! one.
//!
//! A caller running as root makes them itself instead (named after its own pid), hands one to
//! each command with a process limit, and keeps it for the next command once the helper has
//! exited by itself and no task is left in it (at most [`KEPT`](crate::private::KEPT), removed
//! at a normal exit): making and removing a cgroup each take the kernel's global cgroup lock,
//! behind every other command's cgroup work; in `keel-bench`'s 1,000 runs keeping them took a
//! verifier command's median from 26-32 ms to 22-26 (three alternating pairs). Stage 2 still
//! moves itself in (a move into a cgroup at fork, `CLONE_INTO_CGROUP`, needs cgroup v2, and the
//! v1 `pids` hierarchy is what such hosts give); the caller writes `pids.max` for each command.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};
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

/// Cgroups of ended commands with no task left, ready for the next command of this process.
static POOL: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

/// A cgroup allowing `max` tasks for a command of this process (the caller, as root): a kept
/// one or a new one. `None` when one cannot be had here: the helper then makes its own, or
/// says why it cannot.
pub(crate) fn take(max: u64) -> Option<PathBuf> {
    if !nix::unistd::geteuid().is_root() {
        return None;
    }
    let kept = POOL.lock().unwrap_or_else(PoisonError::into_inner).pop();
    match kept {
        Some(dir) => {
            if fs::write(dir.join("pids.max"), max.to_string()).is_ok() {
                Some(dir)
            } else {
                let _ = fs::remove_dir(&dir);
                create(max, std::process::id()).ok()
            }
        }
        None => create(max, std::process::id()).ok(),
    }
}

/// Gives back the cgroup `dir` of a command whose helper exited by itself: kept for the next
/// command when no task is left in it, else removed.
pub(crate) fn give_back(dir: PathBuf) {
    let empty = fs::read_to_string(dir.join("cgroup.procs")).is_ok_and(|s| s.trim().is_empty());
    if empty {
        let mut pool = POOL.lock().unwrap_or_else(PoisonError::into_inner);
        if pool.len() < crate::private::KEPT {
            pool.push(dir);
            drop(pool);
            crate::private::remove_kept_at_exit();
            return;
        }
    }
    abandon(dir);
}

/// Removes the cgroup `dir` of a command that may still be ending, once its last task is gone,
/// without making the caller wait.
pub(crate) fn abandon(dir: PathBuf) {
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
    for dir in kept {
        let _ = fs::remove_dir(dir);
    }
}

/// How many cgroups are kept now (for tests).
#[doc(hidden)]
pub fn kept() -> usize {
    POOL.lock().unwrap_or_else(PoisonError::into_inner).len()
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
