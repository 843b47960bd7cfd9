//! `list` and `search`: walks of the workspace that respect `.gitignore`, never follow a symlink
//! and never enter a denied directory.

use std::fs;
use std::io::ErrorKind;
use std::path::Path;

use grep_regex::RegexMatcher;
use grep_searcher::{BinaryDetection, Searcher, SearcherBuilder, Sink, SinkMatch};
use ignore::WalkBuilder;

use crate::output::count;
use crate::resolve::rel_string;
use crate::{Resolved, ToolError, ToolOutput, Workspace};

/// Levels `list` shows when the call gives no `depth`.
pub const DEFAULT_LIST_DEPTH: u32 = 2;
/// Matching lines `search` returns when the call gives no `max_results`.
pub const DEFAULT_MAX_RESULTS: u32 = 100;
/// A matching line longer than this is cut in the output (minified files).
const MAX_MATCH_LINE_BYTES: usize = 500;

impl Workspace {
    /// The entries under `path` (default the root), `depth` levels deep (default
    /// [`DEFAULT_LIST_DEPTH`]), as workspace-relative paths in sorted tree order: directories end
    /// with `/`, symlinks show their target (`link -> target`) and are not followed. Entries
    /// ignored by `.gitignore`, `.ignore` or `.git/info/exclude`, and denied directories, are
    /// not shown.
    pub fn list(&self, path: &str, depth: Option<u32>) -> Result<ToolOutput, ToolError> {
        let depth = depth.unwrap_or(DEFAULT_LIST_DEPTH);
        if depth == 0 {
            return Err(ToolError::invalid(
                "depth must be at least 1 (1 lists the directory's own entries)",
            ));
        }
        let start = self.resolve(path, false)?;
        let meta = self.existing(path, &start)?;
        if !meta.is_dir() {
            return Ok(ToolOutput::text(start.rel, "", Vec::new()));
        }

        let mut entries = Vec::new();
        let mut unreadable = 0u64;
        let walker = self
            .walker(&start.abs)
            .max_depth(Some(usize::try_from(depth).unwrap_or(usize::MAX)))
            .build();
        for entry in walker {
            let Ok(entry) = entry else {
                unreadable += 1;
                continue;
            };
            if entry.depth() == 0 {
                continue;
            }
            let Some(rel) = self.rel_of(entry.path()) else {
                unreadable += 1;
                continue;
            };
            let line = match entry.file_type() {
                Some(kind) if kind.is_dir() => format!("{rel}/"),
                Some(kind) if kind.is_symlink() => match fs::read_link(entry.path()) {
                    Ok(target) => format!("{rel} -> {}", target.display()),
                    Err(_) => format!("{rel} -> ?"),
                },
                _ => rel,
            };
            entries.push(line);
        }

        let shown = if start.rel.is_empty() {
            "the workspace root".to_owned()
        } else {
            format!("`{}/`", start.rel)
        };
        let mut full = if entries.is_empty() {
            format!("{shown} has no entries (ignored and denied entries are not shown)\n")
        } else {
            entries.join("\n") + "\n"
        };
        if unreadable > 0 {
            full.push_str(&format!("[{unreadable} unreadable entries skipped]\n"));
        }
        Ok(ToolOutput::text(
            full,
            "list a subdirectory, or a smaller depth",
            Vec::new(),
        ))
    }

    /// Lines matching the regular expression `pattern` (Rust `regex` syntax, one line at a time)
    /// in the files under `path` (default the root), as `path:line: text`, in sorted path order,
    /// at most `max_results` (default [`DEFAULT_MAX_RESULTS`]). Ignored files, binary files (a
    /// NUL byte), symlinks and denied directories are skipped.
    pub fn search(
        &self,
        pattern: &str,
        path: Option<&str>,
        max_results: Option<u32>,
    ) -> Result<ToolOutput, ToolError> {
        let max_results =
            usize::try_from(max_results.unwrap_or(DEFAULT_MAX_RESULTS)).unwrap_or(usize::MAX);
        if max_results == 0 {
            return Err(ToolError::invalid("max_results must be at least 1"));
        }
        let matcher = RegexMatcher::new_line_matcher(pattern).map_err(|error| {
            ToolError::invalid(format!(
                "`{pattern}` is not a valid regular expression (Rust regex syntax; the search \
                 is line by line, so it cannot contain a literal newline): {error}"
            ))
        })?;
        let path = path.unwrap_or("");
        let start = self.resolve(path, false)?;
        self.existing(path, &start)?;

        let mut searcher = SearcherBuilder::new()
            .binary_detection(BinaryDetection::quit(0))
            .line_number(true)
            .build();
        let mut results: Vec<String> = Vec::new();
        let mut files_matched = 0u64;
        let mut binary_skipped = 0u64;
        let mut unreadable = 0u64;
        let mut cut = false;
        for entry in self.walker(&start.abs).build() {
            let Ok(entry) = entry else {
                unreadable += 1;
                continue;
            };
            // Symlinks are not followed: their target may be outside the workspace.
            if !entry.file_type().is_some_and(|kind| kind.is_file()) {
                continue;
            }
            let Some(rel) = self.rel_of(entry.path()) else {
                unreadable += 1;
                continue;
            };
            let mut sink = Collect {
                lines: Vec::new(),
                // One more than fits, to know whether the results were cut.
                wanted: max_results + 1 - results.len(),
                binary: false,
            };
            if searcher
                .search_path(&matcher, entry.path(), &mut sink)
                .is_err()
            {
                unreadable += 1;
                continue;
            }
            if sink.binary {
                binary_skipped += 1;
                continue;
            }
            if !sink.lines.is_empty() {
                files_matched += 1;
            }
            for (number, text) in sink.lines {
                if results.len() == max_results {
                    cut = true;
                    break;
                }
                results.push(format!("{rel}:{number}: {text}"));
            }
            if cut {
                break;
            }
        }

        let place = if start.rel.is_empty() {
            "the workspace".to_owned()
        } else {
            format!("`{}`", start.rel)
        };
        let mut full = String::new();
        if results.is_empty() {
            full.push_str(&format!("no matches for `{pattern}` in {place}\n"));
        } else {
            full.push_str(&results.join("\n"));
            full.push('\n');
        }
        if cut {
            full.push_str(&format!(
                "[stopped after {} in {}; there are more: narrow the pattern or the path, or \
                 raise max_results]\n",
                count(results.len() as u64, "result"),
                count(files_matched, "file"),
            ));
        }
        if binary_skipped > 0 {
            full.push_str(&format!(
                "[{} skipped as binary]\n",
                count(binary_skipped, "file")
            ));
        }
        if unreadable > 0 {
            full.push_str(&format!(
                "[{} could not be read]\n",
                count(unreadable, "file")
            ));
        }
        Ok(ToolOutput::text(
            full,
            "narrow the pattern or the path",
            Vec::new(),
        ))
    }

    /// The metadata of a resolved path that must exist.
    fn existing(&self, path: &str, resolved: &Resolved) -> Result<fs::Metadata, ToolError> {
        fs::metadata(&resolved.abs).map_err(|source| match source.kind() {
            ErrorKind::NotFound => ToolError::NotFound { path: path.into() },
            _ => ToolError::io(path, source),
        })
    }

    /// A walker from `start` (a resolved directory or file): `.gitignore` (also outside a git
    /// repository), `.ignore` and `.git/info/exclude` respected, the user's global excludes not
    /// (a run must see the same files on every machine), hidden files shown, symlinks not
    /// followed, denied directories pruned, entries sorted by name.
    fn walker(&self, start: &Path) -> WalkBuilder {
        let mut builder = WalkBuilder::new(start);
        let workspace = self.clone();
        builder
            .hidden(false)
            .parents(true)
            .ignore(true)
            .git_ignore(true)
            .git_exclude(true)
            .git_global(false)
            .require_git(false)
            .follow_links(false)
            .sort_by_file_name(|a, b| a.cmp(b))
            .filter_entry(move |entry| {
                workspace
                    .rel_of(entry.path())
                    .is_some_and(|rel| !workspace.is_denied(&rel))
            });
        builder
    }

    /// The workspace-relative form of a path the walker produced (they all start at a resolved,
    /// real path), or `None` for a name that is not UTF-8.
    fn rel_of(&self, path: &Path) -> Option<String> {
        rel_string(path.strip_prefix(&self.root).ok()?)
    }
}

/// Collects matching lines of one file; notices binary files.
struct Collect {
    lines: Vec<(u64, String)>,
    wanted: usize,
    binary: bool,
}

impl Sink for Collect {
    type Error = std::io::Error;

    fn matched(&mut self, _: &Searcher, found: &SinkMatch<'_>) -> Result<bool, Self::Error> {
        let bytes = found.bytes();
        let bytes = bytes.strip_suffix(b"\n").unwrap_or(bytes);
        let bytes = bytes.strip_suffix(b"\r").unwrap_or(bytes);
        let mut text = String::from_utf8_lossy(bytes).into_owned();
        if text.len() > MAX_MATCH_LINE_BYTES {
            let mut end = MAX_MATCH_LINE_BYTES;
            while !text.is_char_boundary(end) {
                end -= 1;
            }
            text.truncate(end);
            text.push_str(" […]");
        }
        self.lines.push((found.line_number().unwrap_or(0), text));
        Ok(self.lines.len() < self.wanted)
    }

    fn binary_data(&mut self, _: &Searcher, _: u64) -> Result<bool, Self::Error> {
        self.binary = true;
        Ok(false)
    }
}
