//! Capping what the model reads.

/// The most bytes of an observation, marker included.
pub const OBSERVATION_LIMIT: usize = 8 * 1024;

/// Room kept for the marker: two numbers, the fixed words and a hint of a sentence or two.
const MARKER_RESERVE: usize = 320;

/// `full` if it fits in [`OBSERVATION_LIMIT`]; otherwise as many whole lines as fit (or, for a
/// first line too long to fit, its beginning), then a marker saying how much is missing and
/// `hint(lines shown)` on how to narrow the request.
pub(crate) fn cap(full: &str, hint: impl FnOnce(usize) -> String) -> String {
    if full.len() <= OBSERVATION_LIMIT {
        return full.to_owned();
    }
    let mut cut = OBSERVATION_LIMIT - MARKER_RESERVE;
    while !full.is_char_boundary(cut) {
        cut -= 1;
    }
    if let Some(newline) = full[..cut].rfind('\n') {
        cut = newline + 1;
    }
    let (shown, rest) = full.split_at(cut);
    let lines_shown = shown.matches('\n').count();
    let more_lines = rest.lines().count();
    let mut hint = hint(lines_shown);
    // The hints are ours and short; this only guards the limit against a future long one.
    hint.truncate(MARKER_RESERVE / 2);
    while !hint.is_char_boundary(hint.len()) {
        hint.pop();
    }
    let mut observation = String::with_capacity(OBSERVATION_LIMIT);
    observation.push_str(shown);
    if !shown.ends_with('\n') {
        observation.push('\n');
    }
    observation.push_str(&format!(
        "[… {} more {} ({} bytes) not shown; narrow the request: {hint}]",
        more_lines,
        if more_lines == 1 { "line" } else { "lines" },
        rest.len(),
    ));
    debug_assert!(observation.len() <= OBSERVATION_LIMIT);
    observation
}

/// `1 line`, `2 lines`.
pub(crate) fn count(n: u64, unit: &str) -> String {
    if n == 1 {
        format!("1 {unit}")
    } else {
        format!("{n} {unit}s")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_output_is_not_touched() {
        assert_eq!(cap("a\nb\n", |_| String::new()), "a\nb\n");
    }

    #[test]
    fn long_output_is_cut_at_a_line_with_the_marker() {
        let full: String = (0..2000).map(|i| format!("line {i}\n")).collect();
        let capped = cap(&full, |shown| format!("start at {shown}"));
        assert!(capped.len() <= OBSERVATION_LIMIT);
        let (shown, marker) = capped.rsplit_once('\n').unwrap_or_default();
        let lines_shown = shown.lines().count();
        assert!(full.starts_with(shown));
        assert_eq!(
            marker,
            format!(
                "[… {} more lines ({} bytes) not shown; narrow the request: start at {lines_shown}]",
                2000 - lines_shown,
                full.len() - shown.len() - 1
            )
        );
    }

    #[test]
    fn a_single_huge_line_is_cut_on_a_char_boundary() {
        let full = "é".repeat(OBSERVATION_LIMIT);
        let capped = cap(&full, |_| "x".into());
        assert!(capped.len() <= OBSERVATION_LIMIT);
        assert!(capped.ends_with("not shown; narrow the request: x]"));
        assert!(capped.contains("[… 1 more line ("));
    }
}
