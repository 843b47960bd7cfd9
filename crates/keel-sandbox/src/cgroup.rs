//! A pids cgroup per command, for root (the kernel does not apply `RLIMIT_NPROC` to uid 0).
//!
//! The cgroup is made directly under the root of the pids hierarchy (cgroup v2 when its pids
//! controller is usable, else the v1 `pids` hierarchy), named `keel-<stage 1 pid>-<nanos>`.
//! Stage 2 moves itself in before anything else; stage 1 removes it once stage 2 is gone. A
//! cgroup left by a stage 1 that was killed (its pid no longer exists) is removed by the next
//! one.

use std::fs;
use std::path::{Path, PathBuf};
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
