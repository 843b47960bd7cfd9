//! Prompt size over a long run: a scripted agent phase of 500 steps (499 varied `note`, `read`
//! and `plan` calls, then `finish`) with `context_tokens = 4000`. Every prompt stays within
//! `context_tokens`, the prompt does not grow with the history (the mean over steps 400–500 is
//! within 10% of the mean over steps 50–150), the parts that must always be there (goal,
//! objective, the last observation) are in every prompt, and the first step's note is long gone
//! from the last prompt. No timing is asserted; the run takes some tens of seconds in debug.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{Fixture, git, state};
use serde_json::{Value, json};

const STEPS: usize = 500;
const CONTEXT_TOKENS: u64 = 4000;
const GOAL: &str = "Survey the five files and keep notes on them.";
const OBJECTIVE: &str = "Read the files, keep notes and a plan, then finish.";

/// xorshift64*: a small deterministic generator, so the script is the same on every run.
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

    /// Uniform in `lo..=hi`.
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }
}

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

fn words(rng: &mut Rng, n: u64) -> String {
    (0..n)
        .map(|_| WORDS[rng.range(0, WORDS.len() as u64 - 1) as usize])
        .collect::<Vec<_>>()
        .join(" ")
}

/// `steps - 1` varied calls, drawn from the same distribution all along (so a growing prompt
/// would be the harness's doing, not the script's), then `finish`.
fn script(steps: usize) -> String {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let mut lines = Vec::with_capacity(steps);
    for i in 0..steps - 1 {
        let action = match i % 3 {
            0 => {
                // Mostly short notes, now and then a long one.
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

fn contract() -> String {
    format!(
        r#"
[task]
goal = "{GOAL}"

[driver]
kind = "script"
script = "actions.jsonl"
context_tokens = {CONTEXT_TOKENS}

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

fn mean(values: &[u64]) -> f64 {
    values.iter().sum::<u64>() as f64 / values.len() as f64
}

#[test]
fn prompt_size_stays_within_context_tokens_and_flat_over_500_steps() {
    let f = Fixture::new(&contract());
    for k in 0..5 {
        let text: String = (1..=200)
            .map(|n| format!("file {k} line {n}: {}\n", WORDS[(n * 7 + k) % WORDS.len()]))
            .collect();
        std::fs::write(f.path(&format!("file{k}.txt")), text).unwrap();
    }
    git(f.root(), &["add", "-A"]);
    git(f.root(), &["commit", "-q", "-m", "files"]);
    std::fs::write(f.path("actions.jsonl"), script(STEPS)).unwrap();

    let started = std::time::Instant::now();
    let (id, out) = f.start(&[]);
    let elapsed = started.elapsed();
    assert_eq!(out.status.code(), Some(0), "{}", f.explain(&out));
    let status = f.status(&id);
    assert_eq!(state(&status), "completed");
    assert_eq!(status["model_calls"], STEPS);
    assert_eq!(status["budgets"]["steps"]["used"], STEPS);
    assert_eq!(status["violations"], 0);

    let events = f.events(&id);
    let requested: Vec<&Value> = events
        .iter()
        .filter(|e| e["kind"] == "model_requested")
        .collect();
    assert_eq!(requested.len(), STEPS);
    let tokens: Vec<u64> = requested
        .iter()
        .map(|e| e["body"]["prompt_tokens"].as_u64().unwrap())
        .collect();
    for (i, e) in requested.iter().enumerate() {
        assert_eq!(
            e["body"]["step"]["index"], i,
            "one request per step, in order"
        );
        assert_eq!(e["body"]["context_tokens"], CONTEXT_TOKENS);
        assert!(
            tokens[i] <= CONTEXT_TOKENS,
            "step {}: a prompt of {} tokens, over context_tokens = {CONTEXT_TOKENS}",
            i + 1,
            tokens[i]
        );
    }
    // Steps 51–150 and 401–500 (1-based), as keel-bench compares them.
    let early = mean(&tokens[50..150]);
    let late = mean(&tokens[400..500]);
    let drift = (late - early).abs() / early * 100.0;
    eprintln!(
        "{STEPS} steps in {:.1}s; prompt tokens: step 10 {}, step 500 {}, max {}, mean 50-150 {early:.0}, mean 400-500 {late:.0} ({drift:.1}% apart)",
        elapsed.as_secs_f64(),
        tokens[9],
        tokens[STEPS - 1],
        tokens.iter().max().unwrap(),
    );
    assert!(
        drift <= 10.0,
        "the prompt trends: mean {early:.0} tokens over steps 50-150, {late:.0} over 400-500"
    );

    // What every prompt keeps, and what the last one no longer carries.
    for (i, e) in requested.iter().enumerate() {
        let hash = e["body"]["request"].as_str().unwrap();
        let path = f.path(&format!(".keel/artifacts/{}/{hash}", &hash[..2]));
        let request: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        let user = request["user"].as_str().unwrap();
        assert_eq!(
            request["tokens"], tokens[i],
            "the event counts the stored prompt"
        );
        assert!(user.contains(GOAL), "step {}: the goal is dropped", i + 1);
        assert!(
            user.contains(OBJECTIVE),
            "step {}: the objective is dropped",
            i + 1
        );
        if i > 0 {
            assert!(
                user.contains(&format!("[step 1.{i}] ")),
                "step {}: the previous step's observation is missing:\n{user}",
                i + 1
            );
        }
        if i == STEPS - 1 {
            assert!(
                !user.contains("fact 0:"),
                "the first step's note is still carried at step {STEPS}"
            );
        }
    }
}
