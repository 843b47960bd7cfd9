//! `read`: numbered lines of a text file.

use std::fs::{self, File};
use std::io::{BufRead, BufReader, ErrorKind, Read};

use crate::output::{self, count};
use crate::{ToolError, ToolOutput, Workspace};

/// Lines `read` returns when the call gives no `limit`.
pub const DEFAULT_READ_LINES: u64 = 2000;

/// How much of a file is looked at to decide it is binary: a NUL byte in it means binary, the
/// heuristic git and ripgrep use.
pub(crate) const BINARY_SNIFF_BYTES: u64 = 8000;

impl Workspace {
    /// Numbered lines (`  12| text`) of a text file, from `offset` (1-based, default 1), at most
    /// `limit` lines (default [`DEFAULT_READ_LINES`]). A binary file is named with its size,
    /// not dumped.
    pub fn read(
        &self,
        path: &str,
        offset: Option<u64>,
        limit: Option<u64>,
    ) -> Result<ToolOutput, ToolError> {
        let first = offset.unwrap_or(1);
        if first == 0 {
            return Err(ToolError::invalid(
                "offset is the 1-based number of the first line to read; use 1 for the start",
            ));
        }
        let limit = limit.unwrap_or(DEFAULT_READ_LINES);
        if limit == 0 {
            return Err(ToolError::invalid("limit must be at least 1 line"));
        }
        let resolved = self.resolve(path, false)?;
        let rel = resolved.rel.as_str();
        let meta = fs::metadata(&resolved.abs).map_err(|source| match source.kind() {
            ErrorKind::NotFound => ToolError::NotFound { path: path.into() },
            _ => ToolError::io(path, source),
        })?;
        if meta.is_dir() {
            return Err(ToolError::invalid(format!(
                "`{path}` is a directory; use list to see what it holds"
            )));
        }
        if !meta.is_file() {
            return Err(ToolError::invalid(format!(
                "`{path}` is not a regular file"
            )));
        }

        let file = File::open(&resolved.abs).map_err(|source| ToolError::io(path, source))?;
        let mut reader = BufReader::new(file);
        let mut head = Vec::new();
        (&mut reader)
            .take(BINARY_SNIFF_BYTES)
            .read_to_end(&mut head)
            .map_err(|source| ToolError::io(path, source))?;
        if head.contains(&0) {
            let text = format!(
                "`{rel}` is a binary file ({}); it is not shown as text",
                count(meta.len(), "byte")
            );
            return Ok(ToolOutput::text(text, "", Vec::new()));
        }

        let mut lines = std::io::Cursor::new(head).chain(reader);
        let end = first.saturating_add(limit);
        let mut shown: Vec<(u64, String)> = Vec::new();
        let mut total = 0u64;
        let mut buf = Vec::new();
        loop {
            buf.clear();
            let n = lines
                .read_until(b'\n', &mut buf)
                .map_err(|source| ToolError::io(path, source))?;
            if n == 0 {
                break;
            }
            total += 1;
            if (first..end).contains(&total) {
                let line = buf.strip_suffix(b"\n").unwrap_or(&buf);
                let line = line.strip_suffix(b"\r").unwrap_or(line);
                shown.push((total, String::from_utf8_lossy(line).into_owned()));
            }
        }

        if total == 0 {
            let text = format!("`{rel}` is empty (0 lines)");
            return Ok(ToolOutput::text(text, "", Vec::new()));
        }
        let Some(&(last, _)) = shown.last() else {
            return Err(ToolError::invalid(format!(
                "offset {first} is beyond the end of `{rel}`, which has {}",
                count(total, "line")
            )));
        };

        let mut full = String::new();
        let partial = first > 1 || last < total;
        if partial {
            full.push_str(&format!("[`{rel}`: lines {first}-{last} of {total}]\n"));
        }
        let width = last.to_string().len().max(4);
        for (number, line) in &shown {
            full.push_str(&format!("{number:>width$}| {line}\n"));
        }
        if last < total {
            full.push_str(&format!(
                "[{} more {}; continue with offset={}]\n",
                total - last,
                if total - last == 1 { "line" } else { "lines" },
                last + 1
            ));
        }
        let header = u64::from(partial);
        let observation = output::cap(&full, |lines_shown| {
            let numbered = (lines_shown as u64).saturating_sub(header);
            if numbered == 0 {
                format!(
                    "line {first} alone is longer than the observation limit; use search to \
                     find the part you need"
                )
            } else {
                format!("continue with offset={}", first + numbered)
            }
        });
        Ok(ToolOutput {
            observation,
            full: full.into_bytes(),
            changed: Vec::new(),
        })
    }
}
