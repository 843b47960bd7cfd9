//! Fault injection for crash tests: the process kills itself with SIGKILL at a chosen point.
//!
//! Every place where a crash would leave a different state on disk (before and after each
//! commit, while a command runs, between a snapshot ref and its checkpoint event) calls
//! [`point`]. With `KEEL_CRASH_AT=N` in the environment the Nth call sends SIGKILL to this
//! process, exactly as `kill -9` would; with `KEEL_FAULT_TRACE=FILE` every call appends
//! `N name` to FILE, so a test can see how many points a run passes. Without either variable a
//! point costs one atomic increment.

use std::io::Write;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

struct Config {
    crash_at: Option<u64>,
    trace: Option<std::path::PathBuf>,
}

static CONFIG: OnceLock<Config> = OnceLock::new();
static COUNTER: AtomicU64 = AtomicU64::new(0);

fn config() -> &'static Config {
    CONFIG.get_or_init(|| Config {
        crash_at: std::env::var("KEEL_CRASH_AT")
            .ok()
            .and_then(|v| v.trim().parse().ok()),
        trace: std::env::var_os("KEEL_FAULT_TRACE").map(Into::into),
    })
}

/// A place where a crash is possible. See the module documentation.
pub fn point(name: &str) {
    let n = COUNTER.fetch_add(1, Ordering::SeqCst) + 1;
    let config = config();
    if let Some(path) = &config.trace
        && let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
    {
        let _ = writeln!(f, "{n} {name}");
    }
    if config.crash_at == Some(n) {
        let _ = nix::sys::signal::kill(nix::unistd::getpid(), nix::sys::signal::Signal::SIGKILL);
    }
}
