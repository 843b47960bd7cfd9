//! Starting programs cheaply: each program's path found once, and a child that must die with
//! keel started without copying keel's memory.
//!
//! `std::process::Command` starts a child with `posix_spawn` (a `vfork`-like clone that shares
//! keel's memory until the exec) unless it has a pre-exec hook, or sets `PATH` while naming the
//! program by a bare name; then it forks, which copies the page tables of the whole process and
//! makes every page keel writes afterwards fault once. In a process driving many runs on many
//! threads that cost milliseconds per child. The parent-death signal (`PR_SET_PDEATHSIG`) is the
//! usual reason for a pre-exec hook, so it is set by `setpriv --pdeathsig` instead: `setpriv`
//! (util-linux) sets it and execs the program in the same process, so the child keeps its pid
//! and process group. Without a `setpriv` that knows `--pdeathsig` the hook is used, as before.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

use nix::sys::signal::Signal;

/// The program's path, found in keel's own `PATH` once per process (a bare name searched at
/// each start costs a failed `execve` for every directory before the right one). A name with a
/// `/`, or one not found, is returned as it is, so starting it fails as it would have.
pub fn program_path(name: &str) -> PathBuf {
    static FOUND: OnceLock<std::sync::Mutex<Vec<(String, PathBuf)>>> = OnceLock::new();
    let found = FOUND.get_or_init(Default::default);
    let mut found = found
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some((_, path)) = found.iter().find(|(n, _)| n == name) {
        return path.clone();
    }
    let path = search_path(name, std::env::var_os("PATH").as_deref())
        .unwrap_or_else(|| PathBuf::from(name));
    found.push((name.to_string(), path.clone()));
    path
}

/// The first executable file called `name` in the directories of `path` (a `PATH` value).
fn search_path(name: &str, path: Option<&OsStr>) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    if name.is_empty() || name.contains('/') {
        return None;
    }
    std::env::split_paths(path?)
        .filter(|dir| dir.is_absolute())
        .map(|dir| dir.join(name))
        .find(|candidate| {
            std::fs::metadata(candidate)
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
}

/// `setpriv`, if it is there and knows `--pdeathsig` (util-linux 2.33 and later); asked once.
fn setpriv() -> Option<&'static Path> {
    static SETPRIV: OnceLock<Option<PathBuf>> = OnceLock::new();
    SETPRIV
        .get_or_init(|| {
            let path = search_path("setpriv", std::env::var_os("PATH").as_deref())?;
            let help = Command::new(&path)
                .arg("--help")
                .stdin(Stdio::null())
                .stderr(Stdio::null())
                .output()
                .ok()?;
            String::from_utf8_lossy(&help.stdout)
                .contains("--pdeathsig")
                .then_some(path)
        })
        .as_deref()
}

/// A command that starts `program` with `args` and gets `signal` when the keel thread that
/// started it dies (even by SIGKILL), started without a fork where `setpriv` allows. `program`
/// is looked up as `Command::new` would: a bare name in the child's `PATH` if the caller sets
/// one, else in keel's.
pub fn dying_with_keel(program: &OsStr, signal: Signal) -> Command {
    dying_with(program, signal, setpriv())
}

fn dying_with(program: &OsStr, signal: Signal, setpriv: Option<&Path>) -> Command {
    match setpriv {
        Some(setpriv) => {
            let mut command = Command::new(setpriv);
            command
                .arg("--pdeathsig")
                .arg(signal.as_str())
                .arg("--")
                .arg(program);
            command
        }
        None => {
            let mut command = Command::new(program);
            set_pdeathsig_before_exec(&mut command, signal);
            command
        }
    }
}

#[allow(unsafe_code)]
fn set_pdeathsig_before_exec(command: &mut Command, signal: Signal) {
    use std::os::unix::process::CommandExt;
    // SAFETY: the closure runs in the forked child before exec and only calls prctl(2), which
    // is async-signal-safe and touches no memory shared with the parent.
    unsafe {
        command
            .pre_exec(move || nix::sys::prctl::set_pdeathsig(signal).map_err(std::io::Error::from));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bare_name_is_found_in_the_first_directory_that_has_it_executable() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let (a, b, c) = (
            dir.path().join("a"),
            dir.path().join("b"),
            dir.path().join("c"),
        );
        for d in [&a, &b, &c] {
            std::fs::create_dir(d).unwrap();
        }
        // In a: not executable; in b: a directory; in c: the program.
        std::fs::write(a.join("tool"), "#!/bin/sh\n").unwrap();
        std::fs::create_dir(b.join("tool")).unwrap();
        std::fs::write(c.join("tool"), "#!/bin/sh\n").unwrap();
        std::fs::set_permissions(c.join("tool"), std::fs::Permissions::from_mode(0o755)).unwrap();
        let path = std::env::join_paths([&a, &b, &c]).unwrap();
        assert_eq!(search_path("tool", Some(&path)), Some(c.join("tool")));
        assert_eq!(search_path("missing", Some(&path)), None);
        assert_eq!(
            search_path("c/tool", Some(&path)),
            None,
            "a path is not searched"
        );
        assert_eq!(search_path("tool", None), None);
        // A relative directory in PATH is skipped: it would depend on the working directory.
        let relative = std::env::join_paths(["relative-dir"]).unwrap();
        assert_eq!(search_path("tool", Some(&relative)), None);
    }

    /// The child of a thread that exits gets the signal (the parent-death signal follows the
    /// thread that started the child), with `setpriv` and with the pre-exec hook.
    #[test]
    fn a_dying_child_gets_its_signal_when_the_thread_that_started_it_dies() {
        use std::os::unix::process::ExitStatusExt;
        let found = search_path("setpriv", std::env::var_os("PATH").as_deref());
        for with in [found, None] {
            let setpriv = with.clone();
            let starter = std::thread::spawn(move || {
                let mut command = dying_with(OsStr::new("sh"), Signal::SIGTERM, setpriv.as_deref());
                command
                    .args(["-c", "echo ready; exec sleep 60"])
                    .stdin(Stdio::null())
                    .stdout(Stdio::piped());
                let mut child = command.spawn().unwrap();
                // The shell runs after the signal is set: once it speaks, the thread may go.
                let mut ready = [0u8; 6];
                std::io::Read::read_exact(child.stdout.as_mut().unwrap(), &mut ready).unwrap();
                assert_eq!(&ready, b"ready\n");
                child
            });
            let mut child = starter.join().unwrap();
            let status = child.wait().unwrap();
            assert_eq!(
                status.signal(),
                Some(Signal::SIGTERM as i32),
                "setpriv {with:?}: {status:?}"
            );
        }
    }

    #[test]
    fn a_dying_child_runs_the_program_with_its_arguments() {
        let mut command = dying_with_keel(OsStr::new("sh"), Signal::SIGTERM);
        command.args(["-c", "echo \"$0 $1\"", "first", "second"]);
        let out = command.output().unwrap();
        assert!(out.status.success(), "{out:?}");
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "first second");
    }
}
