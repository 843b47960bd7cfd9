//! The "survey" scenario: a long scripted agent phase that reads five files and keeps notes and
//! a plan, drawn from one fixed distribution from the first step to the last, so that a prompt
//! that grew with the run would be keel's doing, not the script's. Used by the prompt-size test
//! and by `keel-bench`, which must measure the same thing.

use std::path::Path;

use serde_json::json;

const WORDS: [&str; 16] = [
    "parser",
    "overflow",
    "buffer",
    "index",
    "lexer",
    "token",
    "arena",
    "cursor",
    "span",
    "recursion",
    "stack",
    "heap",
    "checksum",
    "header",
    "footer",
    "offset",
];

/// A small deterministic generator (xorshift*): the same script on every machine and run.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }
}

fn words(rng: &mut Rng, n: u64) -> String {
    (0..n)
        .map(|_| WORDS[rng.range(0, WORDS.len() as u64 - 1) as usize])
        .collect::<Vec<_>>()
        .join(" ")
}

/// The run's goal, which every prompt must carry.
pub const GOAL: &str = "Survey the five files and keep notes on them.";
/// The phase's objective, which every prompt must carry.
pub const OBJECTIVE: &str = "Read the files, keep notes and a plan, then finish.";

/// The contract of the survey: one agent phase driven by the script in `actions.jsonl`, prompts
/// assembled within `context_tokens`, and an acceptance verifier that the five files are there.
pub fn contract(context_tokens: u64) -> String {
    format!(
        r#"[task]
goal = "{GOAL}"

[driver]
kind = "script"
script = "actions.jsonl"
context_tokens = {context_tokens}

[scope]
writable = ["notes/**"]

[[verify]]
name = "files"
tier = "acceptance"
run = "test -f file0.txt && test -f file4.txt"

[[phase]]
name = "survey"
kind = "agent"
objective = "{OBJECTIVE}"
tools = ["read", "note", "plan", "finish"]
"#
    )
}

/// Writes the five 200-line files `file0.txt` … `file4.txt` the script reads.
pub fn write_files(dir: &Path) -> std::io::Result<()> {
    for k in 0..5 {
        let text: String = (1..=200)
            .map(|n| format!("file {k} line {n}: {}\n", WORDS[(n * 7 + k) % WORDS.len()]))
            .collect();
        std::fs::write(dir.join(format!("file{k}.txt")), text)?;
    }
    Ok(())
}

/// A JSONL script of `steps - 1` calls of keel's cheapest read-only tool, a `note` of three
/// words (each different, so that no loop is seen), then `finish`: the "no-op" step whose
/// durable cost `keel-bench` measures against the floor.
pub fn noop_script(steps: usize) -> String {
    let mut lines: Vec<String> = (0..steps.saturating_sub(1))
        .map(|i| json!({"tool": "note", "args": {"text": format!("step {i} done")}}).to_string())
        .collect();
    lines.push(json!({"tool": "finish", "args": {"summary": "nothing to do"}}).to_string());
    lines.join("\n") + "\n"
}

/// A JSONL script for the script driver: `steps - 1` calls (notes of 5–60 words, one in ten of
/// 150–300; reads of 1–60 lines; plans of 1–12 items), then `finish`.
pub fn script(steps: usize) -> String {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let mut lines = Vec::with_capacity(steps);
    for i in 0..steps.saturating_sub(1) {
        let action = match i % 3 {
            0 => {
                let n = if rng.range(0, 9) == 0 {
                    rng.range(150, 300)
                } else {
                    rng.range(5, 60)
                };
                json!({"tool": "note", "args": {"text": format!("fact {i}: {}", words(&mut rng, n))}})
            }
            1 => json!({"tool": "read", "args": {
                "path": format!("file{}.txt", rng.range(0, 4)),
                "offset": rng.range(1, 150),
                "limit": rng.range(1, 60),
            }}),
            _ => {
                let items: Vec<String> = (0..rng.range(1, 12))
                    .map(|j| {
                        let n = rng.range(2, 10);
                        format!("step {i}.{j}: {}", words(&mut rng, n))
                    })
                    .collect();
                json!({"tool": "plan", "args": {"items": items}})
            }
        };
        lines.push(action.to_string());
    }
    lines.push(json!({"tool": "finish", "args": {"summary": "surveyed"}}).to_string());
    lines.join("\n") + "\n"
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_script_is_the_same_every_time_and_ends_with_finish() {
        let a = script(50);
        assert_eq!(a, script(50));
        assert_eq!(a.lines().count(), 50);
        assert!(a.lines().last().is_some_and(|l| l.contains("finish")));
        assert!(a.contains("\"note\"") && a.contains("\"read\"") && a.contains("\"plan\""));
    }

    #[test]
    fn the_noop_script_is_distinct_notes_then_finish() {
        let a = noop_script(30);
        let lines: Vec<&str> = a.lines().collect();
        assert_eq!(lines.len(), 30);
        assert!(lines[..29].iter().all(|l| l.contains("\"note\"")));
        assert!(lines[29].contains("\"finish\""));
        let distinct: std::collections::HashSet<&&str> = lines.iter().collect();
        assert_eq!(
            distinct.len(),
            30,
            "a repeated action would be seen as a loop"
        );
    }
}
