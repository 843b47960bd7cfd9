//! Prompt size over a long run: a scripted agent phase of 500 steps (499 varied `note`, `read`
//! and `plan` calls, then `finish`) with `context_tokens = 4000`. Every prompt stays within
//! `context_tokens`, the prompt does not grow with the history (the mean over steps 400–500 is
//! within 10% of the mean over steps 50–150), the parts that must always be there (goal,
//! objective, the last observation) are in every prompt, and the first step's note is long gone
//! from the last prompt. No timing is asserted; the run takes some tens of seconds in debug.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{Fixture, git, state};
use keel_test_support::survey::{self, GOAL, OBJECTIVE};
use serde_json::Value;

const STEPS: usize = 500;
const CONTEXT_TOKENS: u64 = 4000;

fn mean(values: &[u64]) -> f64 {
    values.iter().sum::<u64>() as f64 / values.len() as f64
}

#[test]
fn prompt_size_stays_within_context_tokens_and_flat_over_500_steps() {
    let f = Fixture::new(&survey::contract(CONTEXT_TOKENS));
    survey::write_files(f.root()).unwrap();
    git(f.root(), &["add", "-A"]);
    git(f.root(), &["commit", "-q", "-m", "files"]);
    std::fs::write(f.path("actions.jsonl"), survey::script(STEPS)).unwrap();

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
        let request: Value = serde_json::from_slice(&f.artifact(hash)).unwrap();
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
