//! Small helpers: statistics, CPU time and memory of this process, git workspaces.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use nix::sys::resource::{UsageWho, getrusage};
use serde_json::{Value, json};

/// Median, 99th percentile, mean, min and max of `values` (any unit), rounded to 0.1.
pub fn summary(values: &[f64]) -> Value {
    let mut v: Vec<f64> = values.to_vec();
    v.sort_by(f64::total_cmp);
    json!({
        "median": round1(percentile(&v, 50.0)),
        "p99": round1(percentile(&v, 99.0)),
        "mean": round1(v.iter().sum::<f64>() / v.len().max(1) as f64),
        "min": round1(v.first().copied().unwrap_or(0.0)),
        "max": round1(v.last().copied().unwrap_or(0.0)),
        "n": v.len(),
    })
}

/// The `p`th percentile of sorted values (nearest rank).
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

pub fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    percentile(&v, 50.0)
}

pub fn round1(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}

/// Two decimals: for a ratio judged against a target (1.5, 2), so that one just over it (1.53)
/// does not print as the target itself beside `meets_target: false`.
pub fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

pub fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

pub fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// CPU time (user + system) so far, in microseconds: of this process, and of its children that
/// have been waited for (git, sandboxed commands).
#[derive(Debug, Clone, Copy, Default)]
pub struct Cpu {
    pub process_us: f64,
    pub children_us: f64,
}

pub fn cpu() -> Cpu {
    Cpu {
        process_us: used_us(UsageWho::RUSAGE_SELF) as f64,
        children_us: used_us(UsageWho::RUSAGE_CHILDREN) as f64,
    }
}

/// The CPU (user and system) the calling thread has used, in µs.
pub fn thread_cpu_us() -> u64 {
    used_us(UsageWho::RUSAGE_THREAD)
}

/// User and system CPU of `who` in µs; 0 if it cannot be read.
fn used_us(who: UsageWho) -> u64 {
    let us = |tv: nix::sys::time::TimeVal| {
        u64::try_from(tv.tv_sec()).unwrap_or(0) * 1_000_000
            + u64::try_from(tv.tv_usec()).unwrap_or(0)
    };
    getrusage(who).map_or(0, |u| us(u.user_time()) + us(u.system_time()))
}

/// A field of `/proc/self/status` in kB (`VmHWM`, `VmRSS`).
pub fn status_kb(field: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|rest| rest.split_whitespace().next()?.parse().ok())
}

/// Resets `VmHWM` to the current resident size (Linux: `5` to `/proc/self/clear_refs`), so the
/// peak measured next belongs to what follows. Whether the kernel allowed it.
pub fn reset_peak_rss() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

pub fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

pub fn git(dir: &Path, args: &[&str]) -> Result<()> {
    let out = Command::new("git")
        .args(args)
        .current_dir(dir)
        .env("GIT_AUTHOR_NAME", "keel-bench")
        .env("GIT_AUTHOR_EMAIL", "keel-bench@localhost")
        .env("GIT_COMMITTER_NAME", "keel-bench")
        .env("GIT_COMMITTER_EMAIL", "keel-bench@localhost")
        .output()
        .context("running git (is it installed?)")?;
    ensure!(
        out.status.success(),
        "git {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

/// A git repository with five 200-line files to read (the survey's workspace).
pub fn workspace(ws: &Path) -> Result<()> {
    std::fs::create_dir_all(ws)?;
    git(ws, &["init", "-q", "-b", "main"])?;
    std::fs::write(ws.join("README.md"), "keel-bench workspace\n")?;
    std::fs::write(ws.join(".gitignore"), ".keel/\n")?;
    keel_test_support::survey::write_files(ws)?;
    git(ws, &["add", "-A"])?;
    git(ws, &["commit", "-q", "-m", "bench workspace"])
}

/// Bytes of every file under `dir`, and how many files.
pub fn size(dir: &Path) -> Result<(u64, u64)> {
    let mut total = (0, 0);
    if !dir.exists() {
        return Ok(total);
    }
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let meta = entry.metadata()?;
        if meta.is_dir() {
            let (b, n) = size(&entry.path())?;
            total.0 += b;
            total.1 += n;
        } else {
            total.0 += meta.len();
            total.1 += 1;
        }
    }
    Ok(total)
}

/// A figure of the report: its value(s), what it is compared with, the target, whether it is
/// met (`null` for a reference, which has no target of its own), and how it was measured.
pub fn figure(
    value: Value,
    reference: Value,
    target: &str,
    meets: Option<bool>,
    note: &str,
) -> serde_json::Map<String, Value> {
    let mut m = serde_json::Map::new();
    m.insert("value".into(), value);
    m.insert("reference".into(), reference);
    m.insert("target".into(), json!(target));
    m.insert("meets_target".into(), json!(meets));
    m.insert("note".into(), json!(note));
    m
}

/// How many artifacts the store keeps with run `run`'s events (in its `log` rows).
pub fn count_blobs(db: &Path, run: &str) -> Result<u64> {
    let conn =
        rusqlite::Connection::open(db).with_context(|| format!("opening {}", db.display()))?;
    // Each name in a row's `blob_hashes` is 64 hex digits and a newline (keel-store `log`).
    Ok(conn.query_row(
        "SELECT coalesce(sum(length(blob_hashes) / 65), 0) FROM log WHERE run_id = ?1",
        [run],
        |r| r.get(0),
    )?)
}

/// The CPU's model name as `/proc/cpuinfo` gives it (the first one), or "" where it says none.
pub fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|info| {
            info.lines()
                .find_map(|l| l.strip_prefix("model name")?.split_once(':'))
                .map(|(_, name)| name.trim().to_string())
        })
        .unwrap_or_default()
}

/// The CPU (user + system, in µs) of starting `program` with `args` and waiting for it, the mean
/// of `n` starts: what a process costs this machine before it does anything. An error if the
/// program cannot be started or fails.
pub fn process_start_cpu_us(program: &str, args: &[&str], n: u32) -> Result<f64, String> {
    let before = cpu().children_us;
    for _ in 0..n {
        let status = std::process::Command::new(program)
            .args(args)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .map_err(|e| format!("{program} cannot be started: {e}"))?;
        if !status.success() {
            return Err(format!("{program} {args:?} failed: {status}"));
        }
    }
    Ok(round1((cpu().children_us - before) / f64::from(n.max(1))))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ratio_just_over_its_target_does_not_print_as_the_target() {
        // The no-op step's target is 1.5 floors: 1.526 is a miss, and must not read as 1.5.
        assert_eq!(round2(1.526), 1.53);
        assert_eq!(round2(1.499), 1.5);
        assert_eq!(round2(2.0), 2.0);
        assert!(round2(1.526) > 1.5 && round1(1.526) == 1.5);
    }
}
