//! Running a shell command the way keel runs every command: in the workspace, in its own process
//! group, with a timeout that kills the whole group, output captured to a file, CPU time measured.

use std::fs::File;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use nix::sys::resource::{UsageWho, getrusage};
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;

use crate::fault;

/// Environment variables no command keel runs may see: the secrets keel itself uses (the
/// model's API key). Registered when a run's driver is made.
static HIDDEN: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

/// Keeps `name` out of the environment of every command keel runs from now on.
pub fn hide_from_commands(name: &str) {
    if let Ok(mut hidden) = HIDDEN.lock()
        && !hidden.iter().any(|h| h == name)
    {
        hidden.push(name.to_string());
    }
}

/// What to run: a shell command line, or an argv that no shell sees.
#[derive(Debug, Clone, Copy)]
pub enum Program<'a> {
    Shell(&'a str),
    Argv(&'a [String]),
}

impl Program<'_> {
    /// The argv that runs it.
    pub fn argv(&self) -> Vec<String> {
        match self {
            Program::Shell(command) => vec!["sh".into(), "-c".into(), command.to_string()],
            Program::Argv(argv) => argv.to_vec(),
        }
    }
}

/// How long a command gets between SIGTERM and SIGKILL at its timeout.
const GRACE: Duration = Duration::from_secs(2);

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    pub success: bool,
    /// `exit 0`, `exit 1`, `killed by signal 9`, `timed out after 10s`.
    pub status: String,
    pub timed_out: bool,
    pub duration_ms: u64,
    pub cpu_ms: u64,
}

fn cpu_ms_of_children() -> u64 {
    getrusage(UsageWho::RUSAGE_CHILDREN)
        .map(|u| {
            let ms = |t: nix::sys::time::TimeVal| {
                (t.tv_sec() as u64).saturating_mul(1000) + (t.tv_usec() as u64) / 1000
            };
            ms(u.user_time()) + ms(u.system_time())
        })
        .unwrap_or(0)
}

/// Runs `sh -c command` in `dir`, output (stdout and stderr together) to `output`, for at most
/// `timeout`. `env` is added to the inherited environment.
pub fn run_shell(
    command: &str,
    dir: &Path,
    env: &[(&str, String)],
    output: &Path,
    timeout: Duration,
) -> std::io::Result<Outcome> {
    run_shell_with_input(command, dir, env, output, timeout, None)
}

/// Like [`run_shell`], with the file `input` (if any) as the command's stdin.
pub fn run_shell_with_input(
    command: &str,
    dir: &Path,
    env: &[(&str, String)],
    output: &Path,
    timeout: Duration,
    input: Option<&Path>,
) -> std::io::Result<Outcome> {
    run_program(Program::Shell(command), dir, env, output, timeout, input)
}

/// Runs `program` in `dir` (see [`run_shell`]).
pub fn run_program(
    program: Program<'_>,
    dir: &Path,
    env: &[(&str, String)],
    output: &Path,
    timeout: Duration,
    input: Option<&Path>,
) -> std::io::Result<Outcome> {
    let argv = program.argv();
    let Some((first, rest)) = argv.split_first() else {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "an empty command",
        ));
    };
    let out = File::create(output)?;
    let err = out.try_clone()?;
    let stdin = match input {
        Some(path) => Stdio::from(File::open(path)?),
        None => Stdio::null(),
    };
    let mut cmd = Command::new(first);
    cmd.args(rest)
        .current_dir(dir)
        .stdin(stdin)
        .stdout(out)
        .stderr(err)
        .process_group(0);
    for (k, v) in env {
        cmd.env(k, v);
    }
    // Last, so that nothing puts a hidden variable back.
    if let Ok(hidden) = HIDDEN.lock() {
        for name in hidden.iter() {
            cmd.env_remove(name);
        }
    }
    die_with_parent(&mut cmd);
    let cpu_before = cpu_ms_of_children();
    let started = Instant::now();
    let mut child = cmd.spawn()?;
    let pgid = Pid::from_raw(child.id() as i32);
    fault::point("command running");
    let (tx, rx) = mpsc::channel();
    let waiter = std::thread::spawn(move || {
        let _ = tx.send(child.wait());
    });
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
                    rx.recv().map_err(std::io::Error::other)?
                }
            }
        }
    };
    // Whatever the command left running in its group goes with it: steps are short and must not
    // leave processes behind that change the workspace later.
    let _ = killpg(pgid, Signal::SIGKILL);
    let _ = waiter.join();
    let status = status?;
    let duration_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
    let cpu_ms = cpu_ms_of_children().saturating_sub(cpu_before);
    let described = if timed_out {
        format!("timed out after {}", humanise(timeout))
    } else if let Some(code) = status.code() {
        format!("exit {code}")
    } else {
        use std::os::unix::process::ExitStatusExt;
        format!("killed by signal {}", status.signal().unwrap_or(0))
    };
    Ok(Outcome {
        success: !timed_out && status.success(),
        status: described,
        timed_out,
        duration_ms,
        cpu_ms,
    })
}

fn humanise(d: Duration) -> String {
    keel_core::budget::BudgetName::WallTime
        .format_amount(u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// The command's shell dies when keel dies (for example by SIGKILL), so a crashed run does not
/// leave its step running beside the one that resumes it.
#[allow(unsafe_code)]
fn die_with_parent(cmd: &mut Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: the closure runs in the forked child before exec and only calls prctl(2), which is
    // async-signal-safe and touches no memory shared with the parent.
    unsafe {
        cmd.pre_exec(|| {
            nix::sys::prctl::set_pdeathsig(Signal::SIGKILL).map_err(std::io::Error::from)
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_and_status_are_captured() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("out");
        let o = run_shell(
            "echo hello; echo oops >&2; exit 3",
            dir.path(),
            &[],
            &out,
            Duration::from_secs(30),
        )
        .unwrap();
        assert!(!o.success);
        assert_eq!(o.status, "exit 3");
        let text = std::fs::read_to_string(out).unwrap();
        assert!(text.contains("hello") && text.contains("oops"));
    }

    #[test]
    fn hidden_variables_never_reach_a_command() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("out");
        // Handed to the command explicitly, and still not seen once hidden.
        let secret = [("KEEL_TEST_HIDDEN", "sk-secret".to_string())];
        let shown = "echo \"[${KEEL_TEST_HIDDEN-unset}]\"";
        run_shell(shown, dir.path(), &secret, &out, Duration::from_secs(30)).unwrap();
        assert_eq!(std::fs::read_to_string(&out).unwrap(), "[sk-secret]\n");
        hide_from_commands("KEEL_TEST_HIDDEN");
        let o = run_shell(shown, dir.path(), &secret, &out, Duration::from_secs(30)).unwrap();
        assert!(o.success);
        assert_eq!(std::fs::read_to_string(&out).unwrap(), "[unset]\n");
    }

    #[test]
    fn a_timeout_kills_the_whole_group() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("out");
        let marker = dir.path().join("grandchild-survived");
        // The grandchild ignores SIGTERM and would write the marker later if it survived.
        let cmd = format!(
            "(trap '' TERM; sleep 3; touch {}) & trap '' TERM; sleep 30",
            marker.display()
        );
        let o = run_shell(&cmd, dir.path(), &[], &out, Duration::from_millis(300)).unwrap();
        assert!(o.timed_out);
        assert!(o.status.starts_with("timed out after"), "{}", o.status);
        std::thread::sleep(Duration::from_secs(4));
        assert!(!marker.exists(), "a grandchild outlived the timeout");
    }
}
