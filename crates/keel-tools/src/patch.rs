//! `patch`: unified diffs, applied to every file or to none.
//!
//! Parsing is `diffy`'s `PatchSet` (plain unified diffs, and git's extended format when the diff
//! has `diff --git` lines: creation, deletion, rename, copy, mode changes). Every file's hunks
//! are applied in memory, in the order the diff gives them, to the file as the earlier parts of
//! the same diff left it; only when all apply is anything written.

use std::collections::BTreeMap;
use std::fs::Permissions;
use std::os::unix::fs::PermissionsExt;

use diffy::patch_set::{FileMode, FileOperation, ParseOptions, PatchKind, PatchSet};
use diffy::{ApplyError, Line, Patch};

use crate::write::{Existing, atomic_write, line_counts, remove};
use crate::{Resolved, ToolError, ToolOutput, Workspace};

/// A displayed line from a file or a hunk is cut to this many bytes in messages.
const SHOWN_LINE_BYTES: usize = 120;

/// How to write a unified diff, for messages about one that does not parse.
const DIFF_FORMAT_HINT: &str = "write a unified diff: a `--- a/path` line, a `+++ b/path` line \
    (`/dev/null` on the old side creates the file, on the new side deletes it), then hunks \
    `@@ -start,count +start,count @@` whose counts match their ` `, `-` and `+` lines";

/// One file's part of a diff, its paths taken out of the headers.
struct FileDiff<'a> {
    operation: Operation,
    patch: Patch<'a, str>,
    new_mode: Option<FileMode>,
}

/// What a file's part of a diff does, with header paths as the diff names them (prefix removed).
enum Operation {
    Modify(String),
    Create(String),
    Delete(String),
    Rename { from: String, to: String },
    Copy { from: String, to: String },
}

impl Operation {
    /// The paths written (created, modified or deleted).
    fn written(&self) -> Vec<&str> {
        match self {
            Operation::Modify(path) | Operation::Create(path) | Operation::Delete(path) => {
                vec![path]
            }
            Operation::Rename { from, to } => vec![from, to],
            Operation::Copy { to, .. } => vec![to],
        }
    }
}

/// A file as the diff leaves it so far.
struct Entry {
    /// The path as the diff names it, for messages.
    given: String,
    resolved: Resolved,
    before: Option<Existing>,
    now: Option<Vec<u8>>,
    /// The mode to give the file, when the diff sets one.
    mode: Option<Permissions>,
    added: usize,
    removed: usize,
}

impl Entry {
    fn text(&self) -> Result<Option<&str>, ToolError> {
        match &self.now {
            None => Ok(None),
            Some(bytes) => {
                std::str::from_utf8(bytes)
                    .map(Some)
                    .map_err(|_| ToolError::PatchRejected {
                        path: self.given.clone(),
                        reason: "the file is not UTF-8 text; patch edits text files (use write to \
                             replace it whole)"
                            .to_owned(),
                    })
            }
        }
    }

    fn changed(&self) -> bool {
        let before = self.before.as_ref();
        before.map(|old| &old.bytes) != self.now.as_ref()
            || self.mode.as_ref().is_some_and(|mode| {
                before.is_some_and(|old| old.permissions.mode() & 0o7777 != mode.mode() & 0o7777)
            })
    }
}

impl Workspace {
    /// The workspace-relative paths a unified diff would touch (created, modified, deleted),
    /// resolved, sorted and without duplicates, for the caller's scope check before anything is
    /// applied. Refuses a diff that does not parse or whose header paths resolve outside the
    /// workspace or into a denied directory.
    pub fn patch_paths(&self, diff: &str) -> Result<Vec<String>, ToolError> {
        let text = with_final_newline(diff);
        let files = parse(&text)?;
        let mut paths = Vec::new();
        for file in &files {
            if let Operation::Copy { from, .. } = &file.operation {
                self.resolve(from, false)?;
            }
            for path in file.operation.written() {
                paths.push(self.resolve(path, true)?.rel);
            }
        }
        paths.sort();
        paths.dedup();
        Ok(paths)
    }

    /// Applies a unified diff (one or more files, `--- a/x` / `+++ b/x` headers as git writes
    /// them, also without the `a/` `b/` prefixes; `/dev/null` for creation and deletion; git's
    /// rename, copy and mode headers). All or nothing: if any file's hunks do not apply, nothing
    /// is written and the error says which file and hunk.
    pub fn patch(&self, diff: &str) -> Result<ToolOutput, ToolError> {
        let text = with_final_newline(diff);
        let files = parse(&text)?;

        // Resolve every path before reading or applying anything.
        let mut entries: BTreeMap<String, Entry> = BTreeMap::new();
        for file in &files {
            if let Operation::Copy { from, .. } = &file.operation {
                self.load(&mut entries, from, false)?;
            }
            for path in file.operation.written() {
                self.load(&mut entries, path, true)?;
            }
        }

        for file in &files {
            apply(&mut entries, self, file)?;
        }

        let changed: Vec<&Entry> = entries.values().filter(|entry| entry.changed()).collect();
        let mut written: Vec<&Entry> = Vec::new();
        for entry in &changed {
            if let Err(error) = write_entry(self, entry) {
                // Every one is attempted, latest first, even after one fails.
                let mut restored = true;
                for done in written.iter().rev() {
                    restored &= restore(done).is_ok();
                }
                let note = if written.is_empty() {
                    "nothing was changed"
                } else if restored {
                    "the files written before it were restored, so nothing was changed"
                } else {
                    "restoring the files written before it failed too; check them"
                };
                return Err(match error {
                    ToolError::Io { path, source } => ToolError::Io {
                        path,
                        source: std::io::Error::new(source.kind(), format!("{source}; {note}")),
                    },
                    ToolError::Invalid { message } => ToolError::Invalid {
                        message: format!("{message}; {note}"),
                    },
                    other => other,
                });
            }
            written.push(entry);
        }

        let mut summary = String::new();
        if changed.is_empty() {
            summary.push_str("the patch applies but changes nothing\n");
        }
        for entry in &changed {
            let rel = &entry.resolved.rel;
            let line = match (&entry.before, &entry.now) {
                (None, _) => format!("created `{rel}` (+{})", entry.added),
                (Some(_), None) => format!("deleted `{rel}`"),
                (Some(_), Some(_)) => {
                    format!("modified `{rel}` (+{} -{})", entry.added, entry.removed)
                }
            };
            summary.push_str(&line);
            summary.push('\n');
        }
        let mut full = summary.clone();
        full.push('\n');
        full.push_str(&text);
        Ok(ToolOutput {
            observation: crate::output::cap(&summary, |_| "the full list is stored".to_owned()),
            full: full.into_bytes(),
            changed: changed
                .iter()
                .map(|entry| entry.resolved.rel.clone())
                .collect(),
        })
    }

    /// Resolves `path` and reads what is there now, once per real path.
    fn load<'e>(
        &self,
        entries: &'e mut BTreeMap<String, Entry>,
        path: &str,
        for_write: bool,
    ) -> Result<&'e mut Entry, ToolError> {
        let resolved = self.resolve(path, for_write)?;
        if !entries.contains_key(&resolved.rel) {
            let before = self.existing_file(path, &resolved)?;
            let entry = Entry {
                given: path.to_owned(),
                now: before.as_ref().map(|old| old.bytes.clone()),
                before,
                resolved: resolved.clone(),
                mode: None,
                added: 0,
                removed: 0,
            };
            entries.insert(resolved.rel.clone(), entry);
        }
        entries
            .get_mut(&resolved.rel)
            .ok_or_else(|| ToolError::invalid(format!("`{path}` was lost while patching")))
    }
}

/// Applies one file's part of the diff to the entries, in memory.
fn apply(
    entries: &mut BTreeMap<String, Entry>,
    workspace: &Workspace,
    file: &FileDiff<'_>,
) -> Result<(), ToolError> {
    let (added, removed) = line_counts(&file.patch);
    let mode = file.new_mode.map(permissions_for);
    match &file.operation {
        Operation::Modify(path) => {
            let entry = workspace.load(entries, path, true)?;
            let current = entry
                .text()?
                .ok_or_else(|| ToolError::NotFound { path: path.clone() })?;
            let new = apply_hunks(path, current, &file.patch)?;
            entry.now = Some(new.into_bytes());
            entry.mode = mode.or(entry.mode.take());
            entry.added += added;
            entry.removed += removed;
        }
        Operation::Create(path) => {
            let entry = workspace.load(entries, path, true)?;
            if entry.now.is_some() {
                return Err(already_exists(path));
            }
            let new = apply_hunks(path, "", &file.patch)?;
            entry.now = Some(new.into_bytes());
            entry.mode = mode;
            entry.added += added;
        }
        Operation::Delete(path) => {
            let entry = workspace.load(entries, path, true)?;
            let current = entry
                .text()?
                .ok_or_else(|| ToolError::NotFound { path: path.clone() })?;
            let rest = apply_hunks(path, current, &file.patch)?;
            if !rest.is_empty() {
                return Err(ToolError::PatchRejected {
                    path: path.clone(),
                    reason: format!(
                        "the diff deletes the file, but its hunks remove only part of it ({} \
                         would remain); read the file and make the deletion diff against all of \
                         its current content",
                        crate::output::count(rest.lines().count() as u64, "line")
                    ),
                });
            }
            entry.now = None;
            entry.removed += removed;
        }
        Operation::Rename { from, to } | Operation::Copy { from, to } => {
            let renames = matches!(file.operation, Operation::Rename { .. });
            let source = workspace.load(entries, from, renames)?;
            let current = source
                .text()?
                .ok_or_else(|| ToolError::NotFound { path: from.clone() })?;
            let new = apply_hunks(from, current, &file.patch)?;
            let source_mode = source.before.as_ref().map(|old| old.permissions.clone());
            if renames {
                source.now = None;
            }
            let target = workspace.load(entries, to, true)?;
            if target.now.is_some() {
                return Err(already_exists(to));
            }
            target.now = Some(new.into_bytes());
            target.mode = mode.or(source_mode);
            target.added += added;
            target.removed += removed;
        }
    }
    Ok(())
}

fn already_exists(path: &str) -> ToolError {
    ToolError::PatchRejected {
        path: path.to_owned(),
        reason: format!(
            "the diff creates it, but it already exists; to change it, make the diff against \
             its current content (`--- a/{path}` / `+++ b/{path}`)"
        ),
    }
}

/// Writes one changed entry: its new content (creating missing directories), or its removal.
fn write_entry(workspace: &Workspace, entry: &Entry) -> Result<(), ToolError> {
    let io = |source| ToolError::io(entry.given.clone(), source);
    match &entry.now {
        Some(bytes) => {
            if entry.before.is_none() {
                workspace.create_parent_dirs(&entry.given, &entry.resolved)?;
            }
            let permissions = entry
                .mode
                .clone()
                .or_else(|| entry.before.as_ref().map(|old| old.permissions.clone()));
            atomic_write(&entry.resolved.abs, bytes, permissions.as_ref()).map_err(io)
        }
        None => remove(&entry.resolved.abs).map_err(io),
    }
}

/// Puts back what an entry held before (after a later file of the same diff failed to write).
fn restore(entry: &Entry) -> std::io::Result<()> {
    match &entry.before {
        Some(old) => atomic_write(&entry.resolved.abs, &old.bytes, Some(&old.permissions)),
        None => remove(&entry.resolved.abs),
    }
}

fn permissions_for(mode: FileMode) -> Permissions {
    match mode {
        FileMode::Executable => Permissions::from_mode(0o755),
        FileMode::Regular | FileMode::Symlink | FileMode::Gitlink => Permissions::from_mode(0o644),
    }
}

fn with_final_newline(diff: &str) -> String {
    let mut text = diff.to_owned();
    if !text.ends_with('\n') {
        text.push('\n');
    }
    text
}

/// Splits a diff into its files.
fn parse(text: &str) -> Result<Vec<FileDiff<'_>>, ToolError> {
    let git = text.lines().any(|line| line.starts_with("diff --git "));
    let options = if git {
        ParseOptions::gitdiff()
    } else {
        ParseOptions::unidiff()
    };
    let mut files = Vec::new();
    for file in PatchSet::parse(text, options) {
        let file = file.map_err(|error| {
            ToolError::invalid(format!(
                "the diff does not parse ({error}); {DIFF_FORMAT_HINT}"
            ))
        })?;
        let operation = match file.operation() {
            FileOperation::Modify { original, modified } => {
                let old = strip(original, "a/");
                let new = strip(modified, "b/");
                if old == new {
                    Operation::Modify(old.to_owned())
                } else if original == modified {
                    // No prefixes, and the first directory happens to be `a` or `b`.
                    Operation::Modify(original.to_string())
                } else {
                    return Err(ToolError::invalid(format!(
                        "the diff's `---` and `+++` lines name different files (`{original}` and \
                         `{modified}`); name the same file on both, or, to rename, use git's \
                         `rename from`/`rename to` lines"
                    )));
                }
            }
            FileOperation::Create(path) => Operation::Create(strip(path, "b/").to_owned()),
            FileOperation::Delete(path) => Operation::Delete(strip(path, "a/").to_owned()),
            // git writes rename and copy paths without prefixes.
            FileOperation::Rename { from, to } => Operation::Rename {
                from: from.to_string(),
                to: to.to_string(),
            },
            FileOperation::Copy { from, to } => Operation::Copy {
                from: from.to_string(),
                to: to.to_string(),
            },
        };
        let special = [file.old_mode(), file.new_mode()]
            .into_iter()
            .flatten()
            .any(|mode| matches!(mode, FileMode::Symlink | FileMode::Gitlink));
        if special {
            return Err(ToolError::invalid(format!(
                "the diff for `{}` changes a symlink or a submodule; patch only changes regular \
                 files",
                file.operation().written_name()
            )));
        }
        let new_mode = file.new_mode().copied();
        let name = file.operation().written_name();
        let patch = match file.into_patch() {
            PatchKind::Text(patch) => patch,
            PatchKind::Binary(_) => {
                return Err(ToolError::invalid(format!(
                    "the diff for `{name}` is a binary patch; patch only changes text files"
                )));
            }
        };
        files.push(FileDiff {
            operation,
            patch,
            new_mode,
        });
    }
    // A hunk whose file header was not understood is skipped by the parser (as preamble or
    // trailing text); applying the rest would silently drop part of the change. A line that
    // starts with `@@ ` is always a hunk header: hunk lines start with ` `, `-`, `+` or `\`.
    let headers = text.lines().filter(|line| line.starts_with("@@ ")).count();
    let parsed: usize = files.iter().map(|file| file.patch.hunks().len()).sum();
    if parsed != headers {
        return Err(ToolError::invalid(format!(
            "only {parsed} of the diff's {headers} hunks could be given to a file: every file \
             needs its own `--- `/`+++ ` lines before its hunks, and if one file has a \
             `diff --git` line, all of them need one; {DIFF_FORMAT_HINT}"
        )));
    }
    Ok(files)
}

trait WrittenName {
    fn written_name(&self) -> String;
}

impl WrittenName for FileOperation<'_, str> {
    fn written_name(&self) -> String {
        match self {
            FileOperation::Modify { modified: path, .. }
            | FileOperation::Create(path)
            | FileOperation::Delete(path)
            | FileOperation::Rename { to: path, .. }
            | FileOperation::Copy { to: path, .. } => path.to_string(),
        }
    }
}

/// `a/src/x.rs` → `src/x.rs` for `prefix` `a/`; a path without the prefix is kept as written.
fn strip<'p>(path: &'p str, prefix: &str) -> &'p str {
    path.strip_prefix(prefix).unwrap_or(path)
}

/// Applies a file's hunks to its current text, or says which hunk does not fit and why.
fn apply_hunks(path: &str, current: &str, patch: &Patch<'_, str>) -> Result<String, ToolError> {
    diffy::apply(current, patch).map_err(|error| ToolError::PatchRejected {
        path: path.to_owned(),
        reason: explain(current, patch, &error),
    })
}

/// Why a hunk did not apply: the first line where the file differs from what the hunk expects
/// at the place the hunk names (diffy also looked everywhere else in the file).
fn explain(current: &str, patch: &Patch<'_, str>, error: &ApplyError) -> String {
    const AFTER: &str = "Nothing was changed; read the file again and make the diff against its \
                         current content";
    // diffy reports the failing hunk only in its message: "error applying hunk #N".
    let message = error.to_string();
    let number = message
        .rsplit('#')
        .next()
        .and_then(|n| n.trim().parse::<usize>().ok())
        .filter(|n| (1..=patch.hunks().len()).contains(n));
    let Some(number) = number else {
        return format!("{message}. {AFTER}");
    };
    let hunk = &patch.hunks()[number - 1];
    let header = format!("@@ -{} +{} @@", hunk.old_range(), hunk.new_range());
    let expected = hunk.lines().iter().filter_map(|line| match line {
        Line::Context(text) | Line::Delete(text) => Some(*text),
        Line::Insert(_) => None,
    });
    let lines: Vec<&str> = current.split_inclusive('\n').collect();
    let start = hunk.old_range().start().saturating_sub(1);
    let mut detail = None;
    for (index, want) in expected.enumerate() {
        let at = start + index;
        match lines.get(at) {
            None => {
                detail = Some(format!(
                    "the file has {}, but the hunk expects line {} to be `{}`",
                    crate::output::count(lines.len() as u64, "line"),
                    at + 1,
                    shown(want)
                ));
                break;
            }
            Some(have) if *have != want => {
                detail = Some(if have.trim() == want.trim() {
                    format!(
                        "line {} differs from what the hunk expects only in whitespace or line \
                         ending (`{}` in the file, `{}` in the hunk)",
                        at + 1,
                        shown(have).escape_debug(),
                        shown(want).escape_debug()
                    )
                } else {
                    format!(
                        "line {} is `{}`, but the hunk expects `{}`",
                        at + 1,
                        shown(have),
                        shown(want)
                    )
                });
                break;
            }
            Some(_) => {}
        }
    }
    let detail = detail.unwrap_or_else(|| {
        "its lines overlap lines that an earlier hunk of the same diff changes".to_owned()
    });
    format!(
        "hunk #{number} ({header}) does not apply: {detail}; its context and removed lines are \
         not found anywhere else in the file either. {AFTER}"
    )
}

/// A line for a message: without its newline, cut if long.
fn shown(line: &str) -> String {
    let line = line.strip_suffix('\n').unwrap_or(line);
    if line.len() <= SHOWN_LINE_BYTES {
        return line.to_owned();
    }
    let mut end = SHOWN_LINE_BYTES;
    while !line.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &line[..end])
}
