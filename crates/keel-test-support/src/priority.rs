//! The calling thread's scheduling priority, for tests of code that raises it.

/// Whether the calling thread may lower its nice value (root, or `RLIMIT_NICE` allows it):
/// asked of the kernel by doing it, then undoing it.
pub fn may_raise_priority() -> bool {
    let Ok(nice) = rustix::process::getpriority_process(None) else {
        return false;
    };
    let allowed = nice > -20 && rustix::process::setpriority_process(None, nice - 1).is_ok();
    if allowed {
        let _ = rustix::process::setpriority_process(None, nice);
    }
    allowed
}

/// The calling thread's nice value (on Linux, `getpriority` with pid 0 is the thread's).
pub fn nice() -> i32 {
    rustix::process::getpriority_process(None).unwrap_or(0)
}
