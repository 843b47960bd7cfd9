//! Error fingerprints: "the same error three times is not three new attempts".
//!
//! A failure's text is normalised so that two failures that differ only in numbers, hex ids,
//! paths, durations or timestamps get the same fingerprint.

/// How many trailing non-empty lines of a failure's output make up its fingerprint: the end of
/// the output is where commands say what went wrong.
const TAIL_LINES: usize = 12;

/// Normalises one line: hex runs of 7+ characters become `<hex>`, path-like words `<path>`,
/// runs of digits `<n>`; white space is folded.
pub fn normalise_line(line: &str) -> String {
    let mut out = Vec::new();
    for word in line.split_whitespace() {
        out.push(normalise_word(word));
    }
    out.join(" ")
}

fn normalise_word(word: &str) -> String {
    let trimmed = word.trim_matches(|c: char| "\"'`()[]{},;:".contains(c));
    if trimmed.contains('/') && trimmed.len() > 1 {
        return word.replace(trimmed, "<path>");
    }
    let mut out = String::with_capacity(word.len());
    let chars: Vec<char> = word.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c.is_ascii_hexdigit() {
            let start = i;
            while i < chars.len() && chars[i].is_ascii_hexdigit() {
                i += 1;
            }
            let run: String = chars[start..i].iter().collect();
            let has_digit = run.chars().any(|c| c.is_ascii_digit());
            if run.len() >= 7 && has_digit {
                out.push_str("<hex>");
            } else if run.chars().all(|c| c.is_ascii_digit()) {
                out.push_str("<n>");
            } else {
                // Mixed word such as `abc12`: keep letters, fold digits.
                let mut last_digit = false;
                for c in run.chars() {
                    if c.is_ascii_digit() {
                        if !last_digit {
                            out.push_str("<n>");
                        }
                        last_digit = true;
                    } else {
                        out.push(c);
                        last_digit = false;
                    }
                }
            }
            continue;
        }
        if c.is_ascii_digit() {
            while i < chars.len() && chars[i].is_ascii_digit() {
                i += 1;
            }
            out.push_str("<n>");
            continue;
        }
        out.push(c);
        i += 1;
    }
    out
}

/// The fingerprint of a failure: blake3 of `what` (the step or verifier) and the normalised tail
/// of its output, plus the exit status. Returns the hex fingerprint and the excerpt a person reads.
pub fn error_fingerprint(what: &str, status: &str, output: &str) -> (String, String) {
    let lines: Vec<&str> = output
        .lines()
        .map(str::trim_end)
        .filter(|l| !l.trim().is_empty())
        .collect();
    let tail = &lines[lines.len().saturating_sub(TAIL_LINES)..];
    let normalised: Vec<String> = tail.iter().map(|l| normalise_line(l)).collect();
    let mut hasher = blake3::Hasher::new();
    hasher.update(what.as_bytes());
    hasher.update(b"\0");
    hasher.update(status.as_bytes());
    for line in &normalised {
        hasher.update(b"\0");
        hasher.update(line.as_bytes());
    }
    let excerpt = tail
        .iter()
        .rev()
        .take(3)
        .rev()
        .copied()
        .collect::<Vec<_>>()
        .join("\n");
    (hasher.finalize().to_hex()[..16].to_string(), excerpt)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_paths_hex_and_times_fold_together() {
        let a = "error at /tmp/x1/y.rs:12:4 after 35ms (id 3fa9c0de12) 2026-11-29T10:00:01Z";
        let b = "error at /var/a/b.rs:99:1 after 7ms (id 77aa00ff99) 2025-01-02T03:04:05Z";
        assert_eq!(normalise_line(a), normalise_line(b));
    }

    #[test]
    fn different_messages_stay_different() {
        let (a, _) = error_fingerprint("build/0", "exit 1", "error: missing semicolon");
        let (b, _) = error_fingerprint("build/0", "exit 1", "error: type mismatch");
        assert_ne!(a, b);
    }

    #[test]
    fn same_failure_with_other_numbers_has_one_fingerprint() {
        let (a, excerpt) = error_fingerprint("t", "exit 1", "ok\ntest failed after 12 ms\n");
        let (b, _) = error_fingerprint("t", "exit 1", "ok\ntest failed after 345 ms\n");
        assert_eq!(a, b);
        assert_eq!(excerpt, "ok\ntest failed after 12 ms");
    }

    #[test]
    fn exit_status_is_part_of_the_fingerprint() {
        let (a, _) = error_fingerprint("t", "exit 1", "boom");
        let (b, _) = error_fingerprint("t", "killed by signal 9", "boom");
        assert_ne!(a, b);
    }
}
