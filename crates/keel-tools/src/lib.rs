//! keel's built-in workspace tools — `read`, `list`, `search`, `write`, `patch` — and the path
//! resolver every one of them goes through.
//!
//! The engine validates a tool call's JSON arguments, asks [`Workspace::resolve`] (or
//! [`Workspace::patch_paths`]) for the real workspace-relative paths, checks those against the
//! contract's scope, and only then calls the executor here. This crate does not know about
//! contracts, scopes or budgets; it knows where the workspace ends.
//!
//! **Invariants**
//! - Every path an executor touches comes from [`Workspace::resolve`]: after lexical `..`
//!   normalisation (never above the root) and symlink resolution it lies inside the canonical
//!   root and outside `.git`, `.keel` and the extra denied directories. The walkers of `list` and
//!   `search` never follow symlinks and never enter denied directories.
//! - Writes go to a temporary file in the target's directory that is then renamed over the target,
//!   so a reader sees the old content or the new one, never a torn file; an existing file keeps
//!   its mode. A refused call writes nothing.
//! - `patch` is all or nothing: every file's hunks are applied in memory first, and nothing is
//!   written unless all of them apply.
//! - The observation the model reads is at most [`OBSERVATION_LIMIT`] bytes; the whole output
//!   is in [`ToolOutput::full`].
//!
//! Unix only (hard-link counts and file modes).

pub mod http;
mod output;
mod patch;
mod read;
mod resolve;
mod walk;
mod write;

use std::path::{Path, PathBuf};

pub use output::OBSERVATION_LIMIT;
pub use read::DEFAULT_READ_LINES;
pub use walk::{DEFAULT_LIST_DEPTH, DEFAULT_MAX_RESULTS};

/// Directories no tool may read or change, at any depth: git's internals and keel's own state.
pub const ALWAYS_DENIED: [&str; 2] = [".git", ".keel"];

/// The workspace the tools work in: a canonical root and the directories they may not enter.
#[derive(Debug, Clone)]
pub struct Workspace {
    root: PathBuf,
    /// Extra denied directories, workspace-relative, `/`-separated, without a trailing `/`.
    denied: Vec<String>,
}

/// A path the model gave, resolved: where it really is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resolved {
    /// The real absolute path: symlinks of the existing prefix resolved, the rest appended.
    pub abs: PathBuf,
    /// `abs` relative to the workspace root, `/`-separated, no leading `./`, `""` for the root.
    /// This is the path a scope check must look at.
    pub rel: String,
}

/// Why a tool call was refused or failed. Each message says what the model can do about it.
#[derive(Debug, thiserror::Error)]
pub enum ToolError {
    /// The path leads, or may lead, outside the workspace: an absolute path elsewhere, `..`
    /// above the root, a symlink whose target is outside, a hard-linked file (for writing).
    #[error("`{path}` reaches outside the workspace: {reason}")]
    Escape { path: String, reason: String },
    /// The path is inside git's or keel's internals or another denied directory.
    #[error("`{path}` is off limits: {reason}")]
    Denied { path: String, reason: String },
    /// Nothing exists at the path.
    #[error("`{path}` does not exist in the workspace; use list or search to find the right path")]
    NotFound { path: String },
    /// An argument value is unusable (including, for writing, a path whose final component is
    /// a symlink to a file inside the workspace: the model should name the target instead).
    #[error("{message}")]
    Invalid { message: String },
    /// A diff does not apply to the current content of a file.
    #[error("the patch does not apply to `{path}`: {reason}")]
    PatchRejected { path: String, reason: String },
    /// The filesystem failed.
    #[error("I/O error on `{path}`: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

impl ToolError {
    pub(crate) fn invalid(message: impl Into<String>) -> ToolError {
        ToolError::Invalid {
            message: message.into(),
        }
    }

    pub(crate) fn io(path: impl Into<String>, source: std::io::Error) -> ToolError {
        ToolError::Io {
            path: path.into(),
            source,
        }
    }
}

/// What a tool call produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolOutput {
    /// What the model reads: at most [`OBSERVATION_LIMIT`] bytes, ending with a
    /// `[… N more lines (B bytes) not shown; narrow the request: …]` marker when cut.
    pub observation: String,
    /// The whole output, for the artifact store.
    pub full: Vec<u8>,
    /// Workspace-relative paths this call created, modified or deleted, sorted.
    pub changed: Vec<String>,
}

impl ToolOutput {
    /// An output whose observation is `full`, capped with `hint` saying how to narrow the request.
    pub(crate) fn text(full: String, hint: &str, changed: Vec<String>) -> ToolOutput {
        ToolOutput {
            observation: output::cap(&full, |_| hint.to_owned()),
            full: full.into_bytes(),
            changed,
        }
    }
}

impl Workspace {
    /// Opens the workspace at `root` (canonicalised). `.git` and `.keel` are always denied, at any
    /// depth; `denied` adds directories relative to the root (`"target"`, `"vendor/cache"`).
    pub fn new(root: &Path, denied: &[&str]) -> Result<Workspace, ToolError> {
        let shown = root.display().to_string();
        let canonical = std::fs::canonicalize(root).map_err(|source| {
            if source.kind() == std::io::ErrorKind::NotFound {
                ToolError::NotFound {
                    path: shown.clone(),
                }
            } else {
                ToolError::io(shown.clone(), source)
            }
        })?;
        if !canonical.is_dir() {
            return Err(ToolError::invalid(format!(
                "the workspace root `{shown}` is not a directory"
            )));
        }
        let denied = denied
            .iter()
            .map(|dir| resolve::normalize_denied(dir))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Workspace {
            root: canonical,
            denied,
        })
    }

    /// The canonical root.
    pub fn root(&self) -> &Path {
        &self.root
    }
}
