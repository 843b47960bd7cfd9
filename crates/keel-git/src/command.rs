//! Running `git` in a controlled environment.

use std::ffi::{OsStr, OsString};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use crate::GitError;

/// Configuration forced on every invocation, so that the user's global or repository
/// configuration cannot change what keel records or make its plumbing fail.
const FORCED_CONFIG: &[&str] = &[
    // Paths verbatim (we also use -z wherever git prints paths).
    "core.quotePath=false",
    // No hook runs for anything keel does (update-ref runs reference-transaction hooks).
    "core.hooksPath=/dev/null",
    // commit-tree honours commit.gpgsign; a snapshot must never wait for a key or a pinentry.
    "commit.gpgsign=false",
    "i18n.commitEncoding=UTF-8",
    // fsmonitor would start daemons or run a user hook; assume-unchanged by config would hide
    // changes from `git add`.
    "core.fsmonitor=false",
    "core.ignoreStat=false",
    // A temporary index must not create shared-index files in the git directory.
    "core.splitIndex=false",
    // With safecrlf=true `git add` refuses files; we record what is on disk, so only warn.
    "core.safecrlf=false",
    "gc.auto=0",
    "maintenance.auto=false",
];

/// Environment variables that would redirect git to another repository, index or object store,
/// or change how pathspecs and objects are interpreted.
const CLEARED_ENV: &[&str] = &[
    "GIT_DIR",
    "GIT_WORK_TREE",
    "GIT_INDEX_FILE",
    "GIT_OBJECT_DIRECTORY",
    "GIT_ALTERNATE_OBJECT_DIRECTORIES",
    "GIT_COMMON_DIR",
    "GIT_NAMESPACE",
    "GIT_PREFIX",
    "GIT_SHALLOW_FILE",
    "GIT_GRAFT_FILE",
    "GIT_REPLACE_REF_BASE",
    "GIT_LITERAL_PATHSPECS",
    "GIT_GLOB_PATHSPECS",
    "GIT_NOGLOB_PATHSPECS",
    "GIT_ICASE_PATHSPECS",
    "GIT_ATTR_SOURCE",
    "GIT_EXTERNAL_DIFF",
    "GIT_DIFF_OPTS",
    "GIT_AUTHOR_NAME",
    "GIT_AUTHOR_EMAIL",
    "GIT_AUTHOR_DATE",
    "GIT_COMMITTER_NAME",
    "GIT_COMMITTER_EMAIL",
    "GIT_COMMITTER_DATE",
];

/// One `git` invocation, built up and then run.
pub(crate) struct Invocation<'a> {
    cwd: &'a Path,
    args: Vec<OsString>,
    index_file: Option<PathBuf>,
    env: Vec<(&'static str, &'static str)>,
    stdin: Option<Vec<u8>>,
    /// Whether git is killed when keel dies (see [`Invocation::dies_with_keel`]).
    dies_with_keel: bool,
}

impl<'a> Invocation<'a> {
    pub(crate) fn new(cwd: &'a Path) -> Self {
        Invocation {
            cwd,
            args: Vec::new(),
            index_file: None,
            env: Vec::new(),
            stdin: None,
            dies_with_keel: false,
        }
    }

    /// git gets SIGTERM when keel dies (also by SIGKILL), for commands that change what the
    /// user or a resumed keel sees (a ref, files in the working tree): a crash must not leave
    /// one running beside the keel that resumes the run. Other commands only read, or write
    /// objects and keel's own temporary index, and are left to finish. Both kinds start
    /// without a `fork` where the system allows (see [`crate::spawn`]).
    pub(crate) fn dies_with_keel(mut self) -> Self {
        self.dies_with_keel = true;
        self
    }

    pub(crate) fn arg(mut self, arg: impl AsRef<OsStr>) -> Self {
        self.args.push(arg.as_ref().to_os_string());
        self
    }

    pub(crate) fn args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        self.args
            .extend(args.into_iter().map(|a| a.as_ref().to_os_string()));
        self
    }

    /// Runs against this index file instead of the repository's own.
    pub(crate) fn index_file(mut self, path: &Path) -> Self {
        self.index_file = Some(path.to_path_buf());
        self
    }

    pub(crate) fn env(mut self, key: &'static str, value: &'static str) -> Self {
        self.env.push((key, value));
        self
    }

    pub(crate) fn stdin(mut self, input: Vec<u8>) -> Self {
        self.stdin = Some(input);
        self
    }

    /// The command line as a person would type it to reproduce it.
    pub(crate) fn display(&self) -> String {
        let mut line = String::new();
        if let Some(index) = &self.index_file {
            line.push_str("GIT_INDEX_FILE=");
            line.push_str(&quote(index.as_os_str()));
            line.push(' ');
        }
        line.push_str("git -C ");
        line.push_str(&quote(self.cwd.as_os_str()));
        for arg in &self.args {
            line.push(' ');
            line.push_str(&quote(arg));
        }
        line
    }

    /// Runs git and returns its output whatever the exit status.
    pub(crate) fn output(&self) -> Result<Output, GitError> {
        PROCESSES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let git = crate::spawn::program_path("git");
        let mut command = if self.dies_with_keel {
            // SIGTERM, not SIGKILL: git removes its lock files when terminated, and a lock
            // file left behind would block the next write.
            crate::spawn::dying_with_keel(git.as_os_str(), nix::sys::signal::Signal::SIGTERM)
        } else {
            Command::new(git)
        };
        command.current_dir(self.cwd);
        for config in FORCED_CONFIG {
            command.arg("-c").arg(config);
        }
        command.args(&self.args);
        for key in CLEARED_ENV {
            command.env_remove(key);
        }
        command
            .env("LC_ALL", "C")
            .env("GIT_TERMINAL_PROMPT", "0")
            .env("GIT_PAGER", "cat")
            .env("PAGER", "cat")
            .env("GIT_EDITOR", ":")
            .env("GIT_OPTIONAL_LOCKS", "0")
            .env("GIT_NO_REPLACE_OBJECTS", "1")
            .env("GIT_ADVICE", "0");
        if let Some(index) = &self.index_file {
            command.env("GIT_INDEX_FILE", index);
        }
        for (key, value) in &self.env {
            command.env(key, value);
        }
        command
            .stdin(if self.stdin.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());

        let spawn_error = |source| GitError::Spawn {
            command: self.display(),
            source,
        };
        let mut child = command.spawn().map_err(spawn_error)?;
        // Feed stdin from another thread so a git that writes a lot before reading all of its
        // input cannot deadlock against us.
        let writer = match (self.stdin.clone(), child.stdin.take()) {
            (Some(input), Some(mut pipe)) => Some(std::thread::spawn(move || {
                // A broken pipe means git exited early; its status and stderr say why.
                let _ = pipe.write_all(&input);
            })),
            _ => None,
        };
        let output = child.wait_with_output().map_err(spawn_error)?;
        if let Some(writer) = writer {
            let _ = writer.join();
        }
        Ok(output)
    }

    /// Runs git, requires success, and returns its stdout.
    pub(crate) fn run(&self) -> Result<Vec<u8>, GitError> {
        let output = self.output()?;
        if output.status.success() {
            Ok(output.stdout)
        } else {
            Err(self.failed(&output))
        }
    }

    /// Runs git, requires success, and returns its stdout as one trimmed line of text.
    pub(crate) fn run_line(&self, expected: &'static str) -> Result<String, GitError> {
        let stdout = self.run()?;
        self.text(stdout, expected)
    }

    pub(crate) fn text(&self, stdout: Vec<u8>, expected: &'static str) -> Result<String, GitError> {
        match String::from_utf8(stdout) {
            Ok(text) => Ok(text.trim_end_matches(['\n', '\r']).to_string()),
            Err(err) => Err(self.unexpected(
                expected,
                String::from_utf8_lossy(err.as_bytes()).into_owned(),
            )),
        }
    }

    pub(crate) fn failed(&self, output: &Output) -> GitError {
        GitError::Failed {
            command: self.display(),
            status: output.status.to_string(),
            stderr: String::from_utf8_lossy(&output.stderr).trim().to_string(),
        }
    }

    pub(crate) fn unexpected(&self, expected: &'static str, output: String) -> GitError {
        GitError::UnexpectedOutput {
            command: self.display(),
            expected,
            output,
        }
    }
}

/// Quotes an argument for display the way a POSIX shell would need it.
fn quote(arg: &OsStr) -> String {
    let text = arg.to_string_lossy();
    let plain = !text.is_empty()
        && text
            .chars()
            .all(|c| c.is_alphanumeric() || "-_./:=@+,%^{}".contains(c));
    if plain {
        text.into_owned()
    } else {
        format!("'{}'", text.replace('\'', r"'\''"))
    }
}

/// How many git processes this process has started (see [`crate::processes`]).
pub(crate) static PROCESSES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_quotes_arguments_with_spaces_and_magic() {
        let invocation = Invocation::new(Path::new("/tmp/a b"))
            .args([
                "add",
                "-A",
                "--",
                ".",
                ":(exclude,top,literal).keel",
                "it's",
            ])
            .index_file(Path::new("/x/keel-index"));
        assert_eq!(
            invocation.display(),
            "GIT_INDEX_FILE=/x/keel-index git -C '/tmp/a b' add -A -- . ':(exclude,top,literal).keel' 'it'\\''s'"
        );
    }
}
