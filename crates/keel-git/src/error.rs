//! The one error type of this crate.

use std::io;
use std::path::PathBuf;

/// Why a git operation failed, with what a person needs to act on it: the command line, git's
/// exit status and stderr, or the path that could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum GitError {
    /// `git` found no repository at or above `path`.
    #[error(
        "{} is not inside a git repository; keel needs the workspace to be a git repository (run `git init` there)",
        path.display()
    )]
    NotARepository { path: PathBuf },

    /// `path` is inside a repository that has no working tree here: a bare repository, or the
    /// `.git` directory itself.
    #[error(
        "{} is inside a git directory but not in a working tree (a bare repository or the .git directory); keel needs the workspace to be a git working tree",
        path.display()
    )]
    NoWorkTree { path: PathBuf },

    /// The `git` program could not be started at all.
    #[error("could not run `{command}`: {source}{hint}", hint = spawn_hint(source))]
    Spawn {
        command: String,
        #[source]
        source: io::Error,
    },

    /// `git` ran and exited unsuccessfully.
    #[error("`{command}` failed ({status}): {stderr}")]
    Failed {
        command: String,
        /// As the operating system reports it, e.g. "exit status: 128".
        status: String,
        /// git's standard error, trimmed.
        stderr: String,
    },

    /// A file operation of our own (outside `git`) failed.
    #[error("could not {action} {}: {source}", path.display())]
    Io {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },

    /// An argument was refused before running anything.
    #[error("invalid {what} {value:?}: {reason}")]
    InvalidArgument {
        what: &'static str,
        value: String,
        reason: &'static str,
    },

    /// The working tree cannot be put back to `tree`: objects it needs are gone from the
    /// repository. Nothing was changed.
    #[error(
        "cannot put the working tree back to tree {tree}: the repository at {} lacks {} it \
         needs ({}); nothing was changed",
        repo.display(),
        objects(missing.len()),
        crate::list_missing(missing)
    )]
    ObjectsMissing {
        tree: String,
        repo: PathBuf,
        missing: Vec<crate::MissingObject>,
    },

    /// `git` succeeded but printed something this crate does not understand.
    #[error("`{command}` printed unexpected output ({expected} expected): {output:?}")]
    UnexpectedOutput {
        command: String,
        expected: &'static str,
        output: String,
    },
}

fn objects(n: usize) -> String {
    if n == 1 {
        "an object".to_string()
    } else {
        format!("{n} objects")
    }
}

fn spawn_hint(source: &io::Error) -> &'static str {
    if source.kind() == io::ErrorKind::NotFound {
        " (is git installed and on PATH?)"
    } else {
        ""
    }
}
