//! Fault injection for storage tests: a commit or an artifact write fails with an I/O error at a
//! chosen point, as a failing disk or fsync would make it fail.
//!
//! `KEEL_STORE_FAULT` holds a comma-separated list of `KIND@N`:
//!
//! - `commit-error@N`: the Nth commit of this process (a transaction that appends events or
//!   rewrites a projection: creating a run, a commit, a tail cut, a projection rebuild) fails
//!   with SQLite's fsync I/O error before its transaction commits; nothing of it is stored.
//! - `commit-lost-ack@N`: the Nth commit is made durable, and then the caller gets the same
//!   error, as when the write reached the disk but its fsync reported a failure. The caller
//!   cannot tell this from `commit-error`.
//! - `artifact-fsync@N`: the fsync of the Nth artifact blob this process writes fails; the blob
//!   is not stored.
//!
//! With `KEEL_STORE_FAULT_TRACE=FILE` every commit and every artifact write appends
//! `commit N` or `artifact N` to FILE, so a test can see how many a run makes. The variables
//! are read once; without them a commit or an artifact write costs one atomic increment.

use std::io::Write;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

/// What an injected fault does to the write it hits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CommitFault {
    /// The transaction is rolled back and the caller gets an I/O error.
    Error,
    /// The transaction commits and the caller gets an I/O error.
    LostAck,
}

#[derive(Default)]
struct Config {
    commit_error: Vec<u64>,
    commit_lost_ack: Vec<u64>,
    artifact_fsync: Vec<u64>,
    trace: Option<std::path::PathBuf>,
}

static CONFIG: OnceLock<Config> = OnceLock::new();
static COMMITS: AtomicU64 = AtomicU64::new(0);
static ARTIFACTS: AtomicU64 = AtomicU64::new(0);

fn config() -> &'static Config {
    CONFIG.get_or_init(|| {
        let mut config = Config {
            trace: std::env::var_os("KEEL_STORE_FAULT_TRACE").map(Into::into),
            ..Config::default()
        };
        let spec = std::env::var("KEEL_STORE_FAULT").unwrap_or_default();
        for item in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let Some((kind, n)) = item.split_once('@') else {
                continue;
            };
            let Ok(n) = n.trim().parse::<u64>() else {
                continue;
            };
            match kind.trim() {
                "commit-error" => config.commit_error.push(n),
                "commit-lost-ack" => config.commit_lost_ack.push(n),
                "artifact-fsync" => config.artifact_fsync.push(n),
                _ => {}
            }
        }
        config
    })
}

fn trace(config: &Config, what: &str, n: u64) {
    if let Some(path) = &config.trace
        && let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
    {
        let _ = writeln!(f, "{what} {n}");
    }
}

/// Counts a commit; returns the fault to inject into it, if any.
pub(crate) fn next_commit() -> Option<(CommitFault, u64)> {
    let n = COMMITS.fetch_add(1, Ordering::SeqCst) + 1;
    let config = config();
    trace(config, "commit", n);
    if config.commit_error.contains(&n) {
        Some((CommitFault::Error, n))
    } else if config.commit_lost_ack.contains(&n) {
        Some((CommitFault::LostAck, n))
    } else {
        None
    }
}

/// The error a commit hit by a fault returns: SQLite's own fsync I/O error code, with a message
/// saying what failed and that it was injected.
pub(crate) fn commit_error(fault: CommitFault, n: u64) -> rusqlite::Error {
    let kind = match fault {
        CommitFault::Error => "commit-error",
        CommitFault::LostAck => "commit-lost-ack",
    };
    rusqlite::Error::SqliteFailure(
        rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_IOERR_FSYNC),
        Some(format!(
            "disk I/O error: fsync of the commit failed (injected by KEEL_STORE_FAULT={kind}@{n})"
        )),
    )
}

/// Counts an artifact write; returns the error its fsync gets, if a fault is set for it.
pub(crate) fn next_artifact() -> Option<std::io::Error> {
    let n = ARTIFACTS.fetch_add(1, Ordering::SeqCst) + 1;
    let config = config();
    trace(config, "artifact", n);
    config.artifact_fsync.contains(&n).then(|| {
        std::io::Error::other(format!(
            "fsync failed: Input/output error (injected by KEEL_STORE_FAULT=artifact-fsync@{n})"
        ))
    })
}
