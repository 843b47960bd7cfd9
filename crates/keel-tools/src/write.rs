//! `write`, and the atomic file replacement `patch` uses too.

use std::fs::{self, File, Permissions};
use std::io::{ErrorKind, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use crate::output::count;
use crate::{Resolved, ToolError, ToolOutput, Workspace};

/// What a file held before a change, as far as restoring it goes.
#[derive(Debug, Clone)]
pub(crate) struct Existing {
    pub bytes: Vec<u8>,
    pub permissions: Permissions,
}

impl Workspace {
    /// Writes `content` to `path`, creating missing parent directories (each must itself resolve
    /// inside the workspace). Atomic: a temporary file in the same directory is written, synced
    /// and renamed over the target. An existing file keeps its mode; a new one gets `0o666` less
    /// the umask. Writing the content a file already has changes nothing.
    pub fn write(&self, path: &str, content: &str) -> Result<ToolOutput, ToolError> {
        let resolved = self.resolve(path, true)?;
        let old = self.existing_file(path, &resolved)?;
        let rel = resolved.rel.clone();
        let stats = format!(
            "{}, {}",
            count(content.len() as u64, "byte"),
            count(content.lines().count() as u64, "line")
        );
        let Some(old) = old else {
            self.create_parent_dirs(path, &resolved)?;
            atomic_write(&resolved.abs, content.as_bytes(), None)
                .map_err(|source| ToolError::io(path, source))?;
            return Ok(ToolOutput::text(
                format!("created `{rel}` ({stats})\n"),
                "",
                vec![rel],
            ));
        };
        if old.bytes == content.as_bytes() {
            return Ok(ToolOutput::text(
                format!("`{rel}` already has this content; nothing changed\n"),
                "",
                Vec::new(),
            ));
        }
        atomic_write(&resolved.abs, content.as_bytes(), Some(&old.permissions))
            .map_err(|source| ToolError::io(path, source))?;

        let summary = match std::str::from_utf8(&old.bytes) {
            Ok(before) => {
                let diff = diffy::DiffOptions::new()
                    .set_original_filename(format!("a/{rel}"))
                    .set_modified_filename(format!("b/{rel}"))
                    .create_patch(before, content);
                let (added, removed) = line_counts(&diff);
                (
                    format!("replaced `{rel}` ({stats}; +{added} -{removed})\n"),
                    Some(diff.to_string()),
                )
            }
            Err(_) => (
                format!("replaced `{rel}` ({stats}; it was not UTF-8 text before)\n"),
                None,
            ),
        };
        // The model reads the summary; the artifact also keeps the diff of what changed.
        let (observation, diff) = summary;
        let mut full = observation.clone();
        if let Some(diff) = diff {
            full.push('\n');
            full.push_str(&diff);
        }
        Ok(ToolOutput {
            observation,
            full: full.into_bytes(),
            changed: vec![rel],
        })
    }

    /// The current content and mode of the resolved path: `None` if nothing is there; an error if
    /// it is a directory or something else that is not a regular file.
    pub(crate) fn existing_file(
        &self,
        path: &str,
        resolved: &Resolved,
    ) -> Result<Option<Existing>, ToolError> {
        match fs::symlink_metadata(&resolved.abs) {
            Ok(meta) if meta.is_file() => {
                let bytes =
                    fs::read(&resolved.abs).map_err(|source| ToolError::io(path, source))?;
                Ok(Some(Existing {
                    bytes,
                    permissions: meta.permissions(),
                }))
            }
            Ok(meta) if meta.is_dir() => Err(ToolError::invalid(format!(
                "`{path}` is a directory; give the path of a file"
            ))),
            Ok(_) => Err(ToolError::invalid(format!(
                "`{path}` is not a regular file; tools only write regular files"
            ))),
            Err(source)
                if matches!(
                    source.kind(),
                    ErrorKind::NotFound | ErrorKind::NotADirectory
                ) =>
            {
                Ok(None)
            }
            Err(source) => Err(ToolError::io(path, source)),
        }
    }

    /// Creates the missing directories above `resolved`, top down, each one resolved again first
    /// so that none is created outside the workspace or in a denied directory.
    pub(crate) fn create_parent_dirs(
        &self,
        path: &str,
        resolved: &Resolved,
    ) -> Result<(), ToolError> {
        let Some(parent) = resolved.abs.parent() else {
            return Ok(());
        };
        let mut missing = Vec::new();
        for dir in parent.ancestors() {
            match fs::symlink_metadata(dir) {
                Ok(meta) if meta.is_dir() => break,
                Ok(_) => {
                    return Err(ToolError::invalid(format!(
                        "`{path}` cannot be created: `{}` exists and is not a directory",
                        dir.strip_prefix(&self.root).unwrap_or(dir).display()
                    )));
                }
                Err(source)
                    if matches!(
                        source.kind(),
                        ErrorKind::NotFound | ErrorKind::NotADirectory
                    ) =>
                {
                    missing.push(dir);
                }
                Err(source) => return Err(ToolError::io(path, source)),
            }
        }
        for dir in missing.into_iter().rev() {
            let Ok(inside) = dir.strip_prefix(&self.root) else {
                return Err(ToolError::Escape {
                    path: path.to_owned(),
                    reason: format!("its directory `{}` is outside the workspace", dir.display()),
                });
            };
            let again = self.resolve(&inside.to_string_lossy(), true)?;
            if again.abs != dir {
                return Err(ToolError::Escape {
                    path: path.to_owned(),
                    reason: format!(
                        "its directory `{}` now resolves to `{}`; it changed while being created",
                        inside.display(),
                        again.abs.display()
                    ),
                });
            }
            match fs::create_dir(dir) {
                Ok(()) => {}
                Err(source) if source.kind() == ErrorKind::AlreadyExists && dir.is_dir() => {}
                Err(source) => return Err(ToolError::io(path, source)),
            }
        }
        Ok(())
    }
}

/// Replaces `target` with `bytes`: a temporary file in the same directory, written, given
/// `permissions` (or `0o666` less the umask), synced, then renamed over `target`. The rename
/// replaces a symlink at `target` rather than writing through it.
pub(crate) fn atomic_write(
    target: &Path,
    bytes: &[u8],
    permissions: Option<&Permissions>,
) -> std::io::Result<()> {
    let dir = target
        .parent()
        .ok_or_else(|| std::io::Error::new(ErrorKind::InvalidInput, "a file path has a parent"))?;
    let mut temp = tempfile::Builder::new()
        .prefix(".keel-write-")
        .suffix(".tmp")
        .permissions(Permissions::from_mode(0o666))
        .tempfile_in(dir)?;
    temp.write_all(bytes)?;
    if let Some(permissions) = permissions {
        // Set explicitly: the mode given at creation is reduced by the umask.
        temp.as_file().set_permissions(permissions.clone())?;
    }
    temp.as_file().sync_all()?;
    temp.persist(target).map_err(|error| error.error)?;
    sync_dir(dir);
    Ok(())
}

/// Removes `target` and syncs its directory.
pub(crate) fn remove(target: &Path) -> std::io::Result<()> {
    fs::remove_file(target)?;
    if let Some(dir) = target.parent() {
        sync_dir(dir);
    }
    Ok(())
}

/// Makes a rename or removal in `dir` durable. Best effort: some filesystems refuse to sync a
/// directory, and the change itself has already happened.
fn sync_dir(dir: &Path) {
    if let Ok(handle) = File::open(dir) {
        let _ = handle.sync_all();
    }
}

/// Lines added and removed by a patch.
pub(crate) fn line_counts(patch: &diffy::Patch<'_, str>) -> (usize, usize) {
    let mut added = 0;
    let mut removed = 0;
    for hunk in patch.hunks() {
        for line in hunk.lines() {
            match line {
                diffy::Line::Insert(_) => added += 1,
                diffy::Line::Delete(_) => removed += 1,
                diffy::Line::Context(_) => {}
            }
        }
    }
    (added, removed)
}
