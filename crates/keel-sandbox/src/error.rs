//! Why the sandbox cannot run a command. Every message says that the command did not run and
//! what to change.

use std::path::PathBuf;

use nix::errno::Errno;

#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    #[error(
        "Landlock is not available on this kernel (ABI {abi}): the command did not run; the sandbox needs Landlock ABI {min} or later (Linux 6.2+, with `landlock` in the kernel's `lsm=` list)",
        min = crate::MIN_LANDLOCK_ABI
    )]
    LandlockUnavailable { abi: u8 },

    #[error(
        "could not apply the Landlock rules: {0}: the command did not run; check that every writable path exists"
    )]
    Landlock(String),

    #[error("the sandbox cannot work here: {0}; the command did not run")]
    NamespacesUnavailable(String),

    #[error(
        "could not create the sandbox's namespaces ({what}): {source}; the command did not run. As a non-root user this needs unprivileged user namespaces (user.max_user_namespaces > 0, kernel.unprivileged_userns_clone = 1, no AppArmor restriction)"
    )]
    Unshare { what: String, source: Errno },

    #[error("could not {what} ({target}): {source}; the command did not run")]
    Mount {
        what: String,
        target: PathBuf,
        source: Errno,
    },

    #[error(
        "a process limit was requested but this system cannot enforce one: as root it needs a writable cgroup `pids` controller (v2, or v1 at /sys/fs/cgroup/pids), since the kernel does not apply RLIMIT_NPROC to uid 0; the command did not run. Mount the pids controller read-write, or set `processes: None`"
    )]
    ProcessLimitUnavailable,

    #[error("could not set up the process limit in {path}: {source}; the command did not run")]
    Cgroup {
        path: PathBuf,
        source: std::io::Error,
    },

    #[error("could not set the {what} limit: {source}; the command did not run")]
    Rlimit { what: &'static str, source: Errno },

    #[error("could not drop capabilities ({0}); the command did not run")]
    Capabilities(String),

    #[error("could not set {what}: {source}; the command did not run")]
    Prctl { what: &'static str, source: Errno },

    #[error("invalid sandbox policy: {0}; the command did not run")]
    InvalidPolicy(String),

    #[error("could not {what}: {source}; the command did not run")]
    Io {
        what: String,
        source: std::io::Error,
    },

    #[error("could not serialize the sandbox request: {0}")]
    Serialize(serde_json::Error),

    #[error(
        "the sandbox helper got no valid request ({0}); it must be started through Sandbox::command; the command did not run"
    )]
    BadRequest(String),
}
