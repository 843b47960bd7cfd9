//! Path resolution: from what the model wrote to where it really is, or a refusal.
//!
//! The input is normalised lexically first (`a/../b` is `b`; a `..` above the root is an escape),
//! then walked component by component from the root the way the kernel would: every symlink met
//! is replaced by its target, so a chain of links, a relative link with `..` and a dangling link
//! are all judged by where they really lead. The walk stops looking at the disk at the first
//! component that does not exist; the rest is appended as written, which is how a new file under
//! a symlinked directory is judged by where that directory really is.
//!
//! What is checked is what is used: executors open `Resolved::abs`, which contains no symlink in
//! its existing part. A symlink swapped in between the check and the use is not defended against
//! here (writes replace the final component by rename, which never follows a link).

use std::collections::VecDeque;
use std::ffi::OsString;
use std::fs;
use std::io::ErrorKind;
use std::os::unix::fs::MetadataExt;
use std::path::{Component, Path, PathBuf};

use crate::{ALWAYS_DENIED, Resolved, ToolError, Workspace};

/// The kernel's own limit on symlinks followed while resolving one path (Linux `MAXSYMLINKS`).
const MAX_SYMLINK_HOPS: u32 = 40;

impl Workspace {
    /// Resolves a path the model gave (relative to the root, or absolute inside it). Lexically
    /// normalises `.` and `..` (never above the root), then resolves symlinks of the longest
    /// existing prefix (so a file that does not exist yet under a symlinked dir is judged by
    /// where the dir really is), and refuses anything that ends up outside the root or inside a
    /// denied dir. `for_write`: also refuses when the final component is an existing symlink
    /// (writing through it would change its target: `Escape` when the target is outside,
    /// `Invalid` naming the target when it is inside) and when the file has more than one hard
    /// link (`Escape`: writing would change a file that may live outside).
    pub fn resolve(&self, path: &str, for_write: bool) -> Result<Resolved, ToolError> {
        if path.contains('\0') {
            return Err(ToolError::invalid(format!(
                "the path `{}` contains a NUL byte",
                path.escape_debug()
            )));
        }
        let given = Path::new(path);
        let (start, names) = if given.is_absolute() {
            let lexical = normalize_absolute(given);
            match lexical.strip_prefix(&self.root) {
                Ok(inside) => (self.root.clone(), normal_names(inside)),
                // Possibly the root spelled through a symlink (`/tmp` for `/private/tmp`):
                // walk it from `/` and judge where it lands.
                Err(_) => (PathBuf::from("/"), normal_names(&lexical)),
            }
        } else {
            (self.root.clone(), normalize_relative(path)?)
        };
        let lexical_rel = (start == self.root).then(|| join_names(&names));

        let elsewhere = || ToolError::Escape {
            path: path.to_owned(),
            reason: format!(
                "the workspace root is `{}`; give a path relative to it",
                self.root.display()
            ),
        };
        let walked = match walk(&start, names) {
            Ok(walked) => walked,
            // An absolute path elsewhere is refused as such, whatever its walk ran into
            // (a directory this process may not enter, say).
            Err(_) if lexical_rel.is_none() => return Err(elsewhere()),
            Err(WalkFailure::Io(source)) => return Err(ToolError::io(path, source)),
            Err(WalkFailure::TooManyLinks) => {
                return Err(ToolError::invalid(format!(
                    "`{path}` goes through more than {MAX_SYMLINK_HOPS} symlinks; give the real \
                     path"
                )));
            }
        };

        let Ok(inside) = walked.real.strip_prefix(&self.root) else {
            return Err(match (&walked.first_link, &lexical_rel) {
                (Some(link), Some(_)) => ToolError::Escape {
                    path: path.to_owned(),
                    reason: format!(
                        "it resolves to `{}` through the symlink `{}`",
                        walked.real.display(),
                        self.shown(link),
                    ),
                },
                _ => elsewhere(),
            });
        };
        let rel = rel_string(inside).ok_or_else(|| {
            ToolError::invalid(format!(
                "`{path}` resolves to `{}`, which is not valid UTF-8",
                walked.real.display()
            ))
        })?;

        for candidate in lexical_rel.iter().chain(std::iter::once(&rel)) {
            if let Some(reason) = denied_reason(candidate, &self.denied) {
                return Err(ToolError::Denied {
                    path: path.to_owned(),
                    reason,
                });
            }
        }

        if for_write {
            // The target is inside (an outside one was refused above): not an escape, but
            // writing through the link would change another path than the one named.
            if let Some(link) = &walked.final_link {
                return Err(ToolError::invalid(format!(
                    "`{}` is a symlink to `{rel}`; writing through it would change its target, so \
                     write to `{rel}` instead",
                    self.shown(link),
                )));
            }
            if walked.exists {
                match fs::symlink_metadata(&walked.real) {
                    Ok(meta) if meta.is_file() && meta.nlink() > 1 => {
                        return Err(ToolError::Escape {
                            path: path.to_owned(),
                            reason: format!(
                                "the file has {} hard links, and the others may be outside the \
                                 workspace; writing it would change them too, so tools do not \
                                 write hard-linked files",
                                meta.nlink()
                            ),
                        });
                    }
                    Ok(_) => {}
                    Err(source) if source.kind() == ErrorKind::NotFound => {}
                    Err(source) => return Err(ToolError::io(path, source)),
                }
            }
        }

        Ok(Resolved {
            abs: walked.real,
            rel,
        })
    }

    /// A path for a message: workspace-relative when inside, absolute otherwise.
    fn shown(&self, path: &Path) -> String {
        match path.strip_prefix(&self.root) {
            Ok(inside) if inside.as_os_str().is_empty() => ".".to_owned(),
            Ok(inside) => inside.display().to_string(),
            Err(_) => path.display().to_string(),
        }
    }

    /// Whether a workspace-relative path is inside a denied directory (for the walkers).
    pub(crate) fn is_denied(&self, rel: &str) -> bool {
        denied_reason(rel, &self.denied).is_some()
    }
}

/// Why `rel` (workspace-relative, `/`-separated) is off limits, if it is.
pub(crate) fn denied_reason(rel: &str, extra: &[String]) -> Option<String> {
    if let Some(name) = rel.split('/').find(|name| ALWAYS_DENIED.contains(name)) {
        let holds = if name == ".git" {
            "git's internals"
        } else {
            "keel's own state"
        };
        return Some(format!(
            "`{name}` holds {holds}, which tools may not read or change"
        ));
    }
    extra
        .iter()
        .find(|dir| {
            rel == dir.as_str()
                || rel
                    .strip_prefix(dir.as_str())
                    .is_some_and(|rest| rest.starts_with('/'))
        })
        .map(|dir| format!("`{dir}/` is closed to tools in this workspace"))
}

/// Checks and normalises an extra denied directory given to `Workspace::new`.
pub(crate) fn normalize_denied(dir: &str) -> Result<String, ToolError> {
    let refuse = || {
        ToolError::invalid(format!(
            "the denied directory `{dir}` must be a relative path inside the workspace, \
             without `..`"
        ))
    };
    let mut names = Vec::new();
    for component in Path::new(dir).components() {
        match component {
            Component::Normal(name) => names.push(name.to_str().ok_or_else(refuse)?.to_owned()),
            Component::CurDir => {}
            Component::ParentDir | Component::RootDir | Component::Prefix(_) => {
                return Err(refuse());
            }
        }
    }
    if names.is_empty() {
        return Err(refuse());
    }
    Ok(names.join("/"))
}

/// `a/./b/../c` → `[a, c]`; a `..` above the root is an escape.
fn normalize_relative(path: &str) -> Result<Vec<OsString>, ToolError> {
    let mut names: Vec<OsString> = Vec::new();
    for component in Path::new(path).components() {
        match component {
            Component::Normal(name) => names.push(name.to_owned()),
            Component::CurDir => {}
            Component::ParentDir => {
                if names.pop().is_none() {
                    return Err(ToolError::Escape {
                        path: path.to_owned(),
                        reason: "its `..` climbs above the workspace root".to_owned(),
                    });
                }
            }
            // Not produced for a relative path on Unix.
            Component::RootDir | Component::Prefix(_) => {
                return Err(ToolError::invalid(format!("cannot read the path `{path}`")));
            }
        }
    }
    Ok(names)
}

/// Lexical normalisation of an absolute path; `..` at `/` stays at `/`, as the kernel does.
fn normalize_absolute(path: &Path) -> PathBuf {
    let mut out = PathBuf::from("/");
    for component in path.components() {
        match component {
            Component::Normal(name) => out.push(name),
            Component::ParentDir => {
                out.pop();
            }
            Component::CurDir | Component::RootDir | Component::Prefix(_) => {}
        }
    }
    out
}

fn normal_names(path: &Path) -> Vec<OsString> {
    path.components()
        .filter_map(|component| match component {
            Component::Normal(name) => Some(name.to_owned()),
            _ => None,
        })
        .collect()
}

fn join_names(names: &[OsString]) -> String {
    names
        .iter()
        .map(|name| name.to_string_lossy())
        .collect::<Vec<_>>()
        .join("/")
}

/// A relative path as `/`-separated UTF-8, or `None` if it is not UTF-8.
pub(crate) fn rel_string(path: &Path) -> Option<String> {
    let mut names = Vec::new();
    for component in path.components() {
        if let Component::Normal(name) = component {
            names.push(name.to_str()?);
        }
    }
    Some(names.join("/"))
}

struct Walked {
    /// The real path: no symlink in its existing part.
    real: PathBuf,
    /// Every component existed.
    exists: bool,
    /// The first symlink followed, for messages.
    first_link: Option<PathBuf>,
    /// The input's final component, when it is a symlink.
    final_link: Option<PathBuf>,
}

enum WalkFailure {
    Io(std::io::Error),
    TooManyLinks,
}

enum Step {
    Name(OsString),
    Up,
    Root,
}

/// Walks `names` from `start` (a real directory), replacing each symlink met by its target.
fn walk(start: &Path, names: Vec<OsString>) -> Result<Walked, WalkFailure> {
    let last = names.len();
    let mut pending: VecDeque<(Step, bool)> = names
        .into_iter()
        .enumerate()
        .map(|(index, name)| (Step::Name(name), index + 1 == last))
        .collect();
    let mut walked = Walked {
        real: start.to_path_buf(),
        exists: true,
        first_link: None,
        final_link: None,
    };
    let mut hops = 0;
    while let Some((step, final_input)) = pending.pop_front() {
        let name = match step {
            Step::Root => {
                walked.real = PathBuf::from("/");
                continue;
            }
            Step::Up => {
                walked.real.pop();
                continue;
            }
            Step::Name(name) => name,
        };
        let next = walked.real.join(&name);
        if !walked.exists {
            walked.real = next;
            continue;
        }
        match fs::symlink_metadata(&next) {
            Err(error)
                if matches!(error.kind(), ErrorKind::NotFound | ErrorKind::NotADirectory) =>
            {
                walked.exists = false;
                walked.real = next;
            }
            Err(error) => return Err(WalkFailure::Io(error)),
            Ok(meta) if meta.file_type().is_symlink() => {
                hops += 1;
                if hops > MAX_SYMLINK_HOPS {
                    return Err(WalkFailure::TooManyLinks);
                }
                let target = fs::read_link(&next).map_err(WalkFailure::Io)?;
                if final_input {
                    walked.final_link = Some(next.clone());
                }
                walked.first_link.get_or_insert(next);
                let expansion: Vec<Step> = target
                    .components()
                    .filter_map(|component| match component {
                        Component::RootDir => Some(Step::Root),
                        Component::ParentDir => Some(Step::Up),
                        Component::Normal(part) => Some(Step::Name(part.to_owned())),
                        Component::CurDir | Component::Prefix(_) => None,
                    })
                    .collect();
                for step in expansion.into_iter().rev() {
                    pending.push_front((step, false));
                }
            }
            Ok(_) => walked.real = next,
        }
    }
    Ok(walked)
}
