//! Diagnostics: what is wrong with a contract and where, in the `file:line:column: message` form
//! editors and terminals understand.

use std::fmt;
use std::ops::Range;

/// One problem in a contract. `line` and `column` are 1-based; the column counts characters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Diagnostic {
    pub file: String,
    pub line: usize,
    pub column: usize,
    pub message: String,
}

impl fmt::Display for Diagnostic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}:{}:{}: {}",
            self.file, self.line, self.column, self.message
        )
    }
}

/// Why a contract was refused: at least one diagnostic, in source order.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}", render(&self.diagnostics))]
pub struct ContractError {
    pub diagnostics: Vec<Diagnostic>,
}

fn render(diagnostics: &[Diagnostic]) -> String {
    diagnostics
        .iter()
        .map(Diagnostic::to_string)
        .collect::<Vec<_>>()
        .join("\n")
}

/// Turns byte offsets into the source into 1-based line and column numbers and collects
/// diagnostics for one file.
pub(super) struct Diagnostics<'a> {
    file: &'a str,
    source: &'a str,
    /// Byte offset at which each line starts.
    line_starts: Vec<usize>,
    found: Vec<Diagnostic>,
}

impl<'a> Diagnostics<'a> {
    pub(super) fn new(file: &'a str, source: &'a str) -> Self {
        let line_starts = std::iter::once(0)
            .chain(source.match_indices('\n').map(|(i, _)| i + 1))
            .collect();
        Diagnostics {
            file,
            source,
            line_starts,
            found: Vec::new(),
        }
    }

    /// The 1-based line and column of a byte offset. Offsets past the end (toml reports some
    /// errors there) land just after the last character; an offset inside a multi-byte character
    /// counts as that character.
    pub(super) fn line_col(&self, offset: usize) -> (usize, usize) {
        let offset = offset.min(self.source.len());
        let line = self.line_starts.partition_point(|&start| start <= offset);
        let start = self
            .line_starts
            .get(line.saturating_sub(1))
            .copied()
            .unwrap_or(0);
        let column = self
            .source
            .get(start..)
            .unwrap_or("")
            .char_indices()
            .take_while(|&(i, _)| start + i < offset)
            .count();
        (line.max(1), column + 1)
    }

    /// The line of a byte offset, for messages such as "first at line 5".
    pub(super) fn line(&self, offset: usize) -> usize {
        self.line_col(offset).0
    }

    /// The source text of a span, if the span is valid.
    pub(super) fn text(&self, span: &Range<usize>) -> Option<&'a str> {
        self.source.get(span.clone())
    }

    /// Records a problem at the start of `span`.
    pub(super) fn at(&mut self, span: &Range<usize>, message: impl Into<String>) {
        let (line, column) = self.line_col(span.start);
        self.found.push(Diagnostic {
            file: self.file.to_string(),
            line,
            column,
            message: message.into(),
        });
    }

    /// Records a problem with the contract as a whole (for example a missing section), reported
    /// at 1:1.
    pub(super) fn document(&mut self, message: impl Into<String>) {
        self.at(&(0..0), message);
    }

    pub(super) fn is_empty(&self) -> bool {
        self.found.is_empty()
    }

    /// The diagnostics in source order. Several at one position keep the order they were found in.
    pub(super) fn into_error(self) -> ContractError {
        let mut diagnostics = self.found;
        diagnostics.sort_by_key(|d| (d.line, d.column));
        ContractError { diagnostics }
    }
}

/// Rewords a message from the toml parser or from serde so that it reads as a sentence about the
/// contract (keys and tables, not fields, maps and sequences) and says how to fix the problem.
/// `syntax` says whether the message came from the TOML parser rather than from deserialising
/// the parsed document. `text` is the source text the error points at.
pub(super) fn reword_toml_error(message: &str, syntax: bool, text: Option<&str>) -> String {
    let message = message.trim();
    if syntax {
        if message == "duplicate key" {
            if let Some(key) = text.filter(|t| !t.is_empty()) {
                return format!("key `{key}` is set twice; a key may appear only once per table");
            }
            return "this key is set twice; a key may appear only once per table".to_string();
        }
        return format!("invalid TOML: {message}; fix the syntax here");
    }
    if let Some(rest) = message.strip_prefix("unknown field ") {
        return reword_unknown_field(rest);
    }
    if let Some(rest) = message.strip_prefix("missing field ") {
        let key = rest.trim_matches('`');
        if key == "task" {
            return "the contract has no [task] table; every contract needs one with a `goal`"
                .to_string();
        }
        return match text.filter(|t| t.starts_with('[')) {
            Some(table) => {
                format!("{table} is missing the required key `{key}`; add `{key} = ...`")
            }
            None => format!("missing required key `{key}` in this table; add `{key} = ...`"),
        };
    }
    if let Some(rest) = message.strip_prefix("unknown variant ") {
        let (value, expected) = rest.split_once(", expected ").unwrap_or((rest, ""));
        let value = value.trim_matches('`');
        if expected.is_empty() {
            return format!("\"{value}\" is not an allowed value here");
        }
        let expected = expected.strip_prefix("one of ").unwrap_or(expected);
        return format!(
            "\"{value}\" is not an allowed value here; use one of {}",
            quote_list(expected)
        );
    }
    if let Some(rest) = message.strip_prefix("invalid type: ") {
        let (found, expected) = rest
            .split_once(", expected ")
            .unwrap_or((rest, "another type"));
        if found == "map" && expected == "a sequence" {
            // `[verify]` where `[[verify]]` was meant.
            let example = match text.map(|t| t.trim_matches(['[', ']'])) {
                Some(name) if !name.is_empty() && !name.contains(['{', '=', ' ']) => {
                    format!("[[{name}]]")
                }
                _ => "[[phase]]".to_string(),
            };
            return format!(
                "expected an array of tables but found a single table; write the header with \
                 double brackets, like {example}"
            );
        }
        if let Some(number) = found
            .strip_prefix("integer `")
            .and_then(|r| r.strip_suffix("` as i128"))
        {
            return format!("the integer {number} is too large");
        }
        return format!(
            "wrong type: expected {}, found {}",
            reword_expected(expected),
            reword_found(found)
        );
    }
    message.to_string()
}

/// `rest` is what follows "unknown field ": "`x`, expected one of `a`, `b`", "`x`, expected `a`"
/// or "`x`, there are no fields".
fn reword_unknown_field(rest: &str) -> String {
    let (key, allowed) = rest.split_once(", ").unwrap_or((rest, ""));
    let key = key.trim_matches('`');
    let allowed = allowed
        .strip_prefix("expected one of ")
        .or_else(|| allowed.strip_prefix("expected "));
    match allowed {
        Some(allowed) => {
            format!("unknown key `{key}`; the keys allowed here are {allowed} (check the spelling)")
        }
        None => format!("unknown key `{key}`; no keys are allowed here"),
    }
}

/// "`a`, `b` or `c`" becomes "\"a\", \"b\", \"c\"": TOML values are written in double quotes.
fn quote_list(list: &str) -> String {
    list.replace(" or ", ", ").replace('`', "\"")
}

fn reword_expected(expected: &str) -> String {
    match expected {
        "i64" | "u64" | "i32" | "u32" | "usize" => "a whole number".to_string(),
        "f64" | "f32" => "a number".to_string(),
        "a sequence" => "an array".to_string(),
        "a map" => "a table".to_string(),
        "a boolean" => "true or false".to_string(),
        other if other.starts_with("struct ") => "a table".to_string(),
        other => other.to_string(),
    }
}

fn reword_found(found: &str) -> String {
    const KINDS: [(&str, &str); 5] = [
        ("floating point ", "the number "),
        ("integer ", "the integer "),
        ("boolean ", "the boolean "),
        ("string ", "the string "),
        ("date-time ", "the date-time "),
    ];
    match found {
        "map" => "a table".to_string(),
        "sequence" => "an array".to_string(),
        other => KINDS
            .iter()
            .find_map(|(serde, ours)| {
                other
                    .strip_prefix(serde)
                    .map(|value| format!("{ours}{}", value.trim_matches('`')))
            })
            .unwrap_or_else(|| other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn line_col_counts_from_one_and_in_characters() {
        let source = "ab\né = 1\n";
        let d = Diagnostics::new("c.toml", source);
        assert_eq!(d.line_col(0), (1, 1));
        assert_eq!(d.line_col(1), (1, 2));
        assert_eq!(d.line_col(2), (1, 3)); // the newline itself
        assert_eq!(d.line_col(3), (2, 1));
        assert_eq!(d.line_col(5), (2, 2)); // after the two-byte é
        assert_eq!(d.line_col(source.len()), (3, 1));
        assert_eq!(d.line_col(source.len() + 10), (3, 1));
    }

    #[test]
    fn line_col_of_empty_source() {
        let d = Diagnostics::new("c.toml", "");
        assert_eq!(d.line_col(0), (1, 1));
        assert_eq!(d.line_col(7), (1, 1));
    }

    #[test]
    fn messages_read_as_sentences() {
        assert_eq!(
            reword_toml_error("unknown field `foo`, expected `goal`", false, None),
            "unknown key `foo`; the keys allowed here are `goal` (check the spelling)"
        );
        assert_eq!(
            reword_toml_error("unknown variant `x`, expected `a` or `b`", false, None),
            "\"x\" is not an allowed value here; use one of \"a\", \"b\""
        );
        assert_eq!(
            reword_toml_error("invalid type: string \"x\", expected i64", false, None),
            "wrong type: expected a whole number, found the string \"x\""
        );
        assert_eq!(
            reword_toml_error("duplicate key", true, Some("goal")),
            "key `goal` is set twice; a key may appear only once per table"
        );
    }
}
