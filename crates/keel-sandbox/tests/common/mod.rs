//! Runs commands through the sandbox the way keel's process.rs runs commands: own process
//! group, timeout, SIGTERM to the group, SIGKILL after a grace period, SIGKILL again at the end.
#![allow(clippy::unwrap_used, clippy::expect_used, dead_code)]

use std::fs::File;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::mpsc;
use std::time::Duration;

use keel_sandbox::{Limits, Policy, Sandbox};
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;

pub const GRACE: Duration = Duration::from_secs(2);
/// Generous: only an upper bound for commands that should end by themselves.
pub const LONG: Duration = Duration::from_secs(120);

pub fn sandbox() -> Sandbox {
    Sandbox::new(env!("CARGO_BIN_EXE_keel-sandbox-test-helper"))
}

pub fn python() -> String {
    if Path::new("/usr/bin/python3").exists() {
        "/usr/bin/python3".into()
    } else {
        "python3".into()
    }
}

/// A workspace inside a directory of its own (`root/ws`), and a second directory `outside`
/// that is not under the workspace.
pub struct Fixture {
    pub root: tempfile::TempDir,
    pub ws: PathBuf,
    pub outside: tempfile::TempDir,
}

impl Fixture {
    pub fn new() -> Self {
        let root = tempfile::tempdir().unwrap();
        let ws = root.path().join("ws");
        std::fs::create_dir(&ws).unwrap();
        let outside = tempfile::tempdir().unwrap();
        Fixture { root, ws, outside }
    }

    pub fn policy(&self, argv: Vec<String>) -> Policy {
        Policy {
            workspace: self.ws.clone(),
            writable: vec![],
            hidden: vec![],
            network: false,
            limits: Limits::default(),
            env: vec![
                ("PATH".into(), "/usr/local/bin:/usr/bin:/bin".into()),
                ("HOME".into(), self.ws.display().to_string()),
            ],
            argv,
        }
    }

    pub fn sh(&self, script: &str) -> Policy {
        self.policy(sh(script))
    }
}

pub fn sh(script: &str) -> Vec<String> {
    vec!["/bin/sh".into(), "-c".into(), script.into()]
}

#[derive(Debug)]
pub struct Ran {
    /// Exit code, or 128 + signal.
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
    pub timed_out: bool,
    pub refusal: Option<String>,
}

/// Runs `policy` with `timeout`, like process.rs does.
pub fn run(policy: &Policy, timeout: Duration) -> Ran {
    run_with(policy, timeout, |_| {})
}

/// Like [`run`]; `started` is called with the workspace once the helper is spawned, and the
/// timeout clock starts after it returns.
pub fn run_with(policy: &Policy, timeout: Duration, started: impl FnOnce(&Path)) -> Ran {
    let out_dir = tempfile::tempdir().unwrap();
    let out_path = out_dir.path().join("stdout");
    let err_path = out_dir.path().join("stderr");
    let (mut cmd, tmp) = sandbox().command(policy).unwrap();
    cmd.stdin(Stdio::null())
        .stdout(File::create(&out_path).unwrap())
        .stderr(File::create(&err_path).unwrap())
        .process_group(0);
    let mut child = cmd.spawn().unwrap();
    let pgid = Pid::from_raw(child.id() as i32);
    let (tx, rx) = mpsc::channel();
    let waiter = std::thread::spawn(move || {
        let _ = tx.send(child.wait());
    });
    started(&policy.workspace);
    let mut timed_out = false;
    let status = match rx.recv_timeout(timeout) {
        Ok(status) => status,
        Err(_) => {
            timed_out = true;
            let _ = killpg(pgid, Signal::SIGTERM);
            match rx.recv_timeout(GRACE) {
                Ok(status) => status,
                Err(_) => {
                    let _ = killpg(pgid, Signal::SIGKILL);
                    rx.recv().unwrap()
                }
            }
        }
    };
    let _ = killpg(pgid, Signal::SIGKILL);
    waiter.join().unwrap();
    let status = status.unwrap();
    let code = status
        .code()
        .unwrap_or_else(|| 128 + status.signal().unwrap_or(0));
    Ran {
        code,
        stdout: std::fs::read_to_string(&out_path).unwrap(),
        stderr: std::fs::read_to_string(&err_path).unwrap(),
        timed_out,
        refusal: tmp.refusal(),
    }
}

/// Processes on the machine whose command line contains `marker`.
pub fn processes_with(marker: &str) -> Vec<String> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .filter(|n| n.bytes().all(|b| b.is_ascii_digit()))
        else {
            continue;
        };
        if let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) {
            let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
            if cmdline.contains(marker) {
                found.push(format!("{pid}: {cmdline}"));
            }
        }
    }
    found
}

/// Waits (at most `limit`) until no process has `marker` in its command line; returns those
/// left.
pub fn wait_gone(marker: &str, limit: Duration) -> Vec<String> {
    let deadline = std::time::Instant::now() + limit;
    loop {
        let left = processes_with(marker);
        if left.is_empty() || std::time::Instant::now() > deadline {
            return left;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

pub fn unique(prefix: &str) -> String {
    format!(
        "{prefix}-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    )
}

/// Runs `policy` to its end (stdout captured, stderr passed through), says the helper exited by
/// itself when `exited`, and returns the stdout with the private directory dropped (kept or
/// removed, and with it the command's network namespace and cgroup).
pub fn run_to_end(policy: &Policy, exited: bool) -> String {
    let (mut cmd, mut tmp) = sandbox().command(policy).unwrap();
    cmd.stdout(Stdio::piped()).stderr(Stdio::inherit());
    // Started as keel starts its commands (from the thread in the command's cgroup, if any).
    let out = tmp.spawn(cmd).unwrap().wait_with_output().unwrap();
    assert!(out.status.success(), "{out:?}");
    if exited {
        tmp.helper_exited();
    }
    drop(tmp);
    String::from_utf8(out.stdout).unwrap()
}

/// A python script that forks sleeping children until a fork is refused (`fork refused
/// <errno>`) or it has `tries`, then prints `children <n>`.
pub fn forks_script(tries: u32) -> String {
    format!(
        "
import os, time
children = 0
for i in range({tries}):
    try:
        pid = os.fork()
    except OSError as e:
        print('fork refused', e.errno)
        break
    if pid == 0:
        time.sleep(60)
        os._exit(0)
    children += 1
print('children', children)
"
    )
}

/// What `keel-sandbox-test-helper --run-one <workspace>` printed: a program of its own that runs
/// one command in the sandbox and exits normally (see that binary).
pub fn run_one(workspace: &Path) -> String {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_keel-sandbox-test-helper"))
        .arg("--run-one")
        .arg(workspace)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    String::from_utf8(out.stdout).unwrap()
}
