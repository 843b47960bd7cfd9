//! Fixtures shared by keel's tests and benchmarks. Nothing in keel depends on this crate except
//! tests and `keel-bench`.

pub mod fuzz;
pub mod invariants;
pub mod mcp;
pub mod model_server;
pub mod oracle;
pub mod priority;
pub mod rng;
pub mod runs;
pub mod service;
pub mod survey;
pub mod workspace;

use std::path::Path;
use std::process::Command;

/// Runs `git args` in `dir` with a test identity and returns its output, trimmed.
///
/// # Panics
/// If git cannot be started or fails: the test's workspace is not what it needs.
pub fn git(dir: &Path, args: &[&str]) -> String {
    let out = Command::new("git")
        .args(args)
        .current_dir(dir)
        .env("GIT_AUTHOR_NAME", "test")
        .env("GIT_AUTHOR_EMAIL", "test@localhost")
        .env("GIT_COMMITTER_NAME", "test")
        .env("GIT_COMMITTER_EMAIL", "test@localhost")
        .output()
        .unwrap_or_else(|e| panic!("git {args:?} cannot start in {}: {e}", dir.display()));
    assert!(
        out.status.success(),
        "git {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// Puts a copy of the program `source` at `dest` to be run: a hard link where the filesystem
/// allows, else a copy made by `cp` in a child process; `dest` is replaced if it is there.
///
/// Never a copy written by this process: a test binary runs its tests on several threads, and
/// when one thread forks while another holds a file open for writing, the child keeps that
/// descriptor until its own exec. Running the file in that window fails with ETXTBSY ("Text
/// file busy"), and a test that runs a program it has just written fails now and then on a
/// loaded machine. A `cp` child holds the only descriptor, closed when it has exited.
///
/// # Panics
/// If the copy cannot be made: the test cannot set up what it needs.
pub fn install_program(source: &Path, dest: &Path) {
    remove_if_there(dest);
    if std::fs::hard_link(source, dest).is_err() {
        cp(source, dest);
    }
}

/// Writes `text` as a script at `path` with mode `mode`, made as [`install_program`] makes its
/// copies (this process writes the text to a file beside it that is never run, and `cp` makes
/// the script from that), so running it at once cannot fail with ETXTBSY.
///
/// # Panics
/// If the files cannot be written.
pub fn write_program(path: &Path, text: &str, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    let mut staged = path.as_os_str().to_owned();
    staged.push(".text");
    let staged = std::path::PathBuf::from(staged);
    std::fs::write(&staged, text)
        .unwrap_or_else(|e| panic!("cannot write {}: {e}", staged.display()));
    remove_if_there(path);
    cp(&staged, path);
    remove_if_there(&staged);
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .unwrap_or_else(|e| panic!("cannot chmod {}: {e}", path.display()));
}

fn remove_if_there(path: &Path) {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            panic!("cannot remove {}: {e}", path.display())
        }
        _ => {}
    }
}

/// `cp source dest` in a child process (see [`install_program`] for why not in this one).
fn cp(source: &Path, dest: &Path) {
    let status = Command::new("cp")
        .arg(source)
        .arg(dest)
        .status()
        .unwrap_or_else(|e| panic!("cp cannot start: {e}"));
    assert!(
        status.success(),
        "cp {} {} failed: {status}",
        source.display(),
        dest.display()
    );
}
