//! `keel-bench`: figures about keel's own behaviour over a long run, measured by driving the
//! engine as a library on a temporary git workspace.
//!
//! The first figure is the prompt size: a scripted agent phase of `--steps` steps (default 500:
//! varied `note`, `read` and `plan` calls, then `finish`) is run with `context_tokens` 4000, and
//! the size of every assembled prompt (the `prompt_tokens` of each `model_requested` event) is
//! read back from the store. The prompt must stay within `context_tokens` and flat: the mean
//! over the last fifth of the steps is compared with the mean over steps 10%–30% (50–150 and
//! 400–500 for 500 steps). The same script is then run with `context_tokens` 32000, where
//! nothing has to be cut, to show that the projection the prompt is built from is bounded by
//! itself and not only by the cut.
//!
//! Usage: `cargo run --release -p keel-bench -- [--json] [--steps N] [--context-tokens N]`.

use std::path::Path;
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail, ensure};
use keel_core::event::EventBody;
use keel_core::state::RunState;
use keel_engine::{Actor, DriverOverride, NewRun, Quiet};
use keel_store::Store;
use serde_json::{Value, json};

/// The context size of the run without a binding limit: keel's default.
const UNCAPPED_CONTEXT_TOKENS: u64 = keel_core::contract::DEFAULT_CONTEXT_TOKENS;

struct Options {
    json: bool,
    steps: usize,
    context_tokens: u64,
}

fn options() -> Result<Options> {
    let mut o = Options {
        json: false,
        steps: 500,
        context_tokens: 4000,
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut number = |what: &str| -> Result<u64> {
            let text = args
                .next()
                .with_context(|| format!("{what} needs a number"))?;
            text.parse()
                .with_context(|| format!("{what} {text}: not a whole number"))
        };
        match arg.as_str() {
            "--json" => o.json = true,
            "--steps" => o.steps = usize::try_from(number("--steps")?)?,
            "--context-tokens" => o.context_tokens = number("--context-tokens")?,
            "-h" | "--help" => {
                println!(
                    "keel-bench [--json] [--steps N (default 500, at least 20)] [--context-tokens N (default 4000)]\n\
                     Runs a scripted agent phase of N steps through keel-engine and reports the prompt size per step."
                );
                std::process::exit(0);
            }
            other => bail!("unknown argument `{other}`; try --help"),
        }
    }
    ensure!(o.steps >= 20, "--steps must be at least 20");
    Ok(o)
}

fn main() -> Result<()> {
    keel_engine::sandbox_main();
    let o = options()?;
    let capped = scenario(o.steps, o.context_tokens)?;
    let uncapped = scenario(o.steps, UNCAPPED_CONTEXT_TOKENS)?;
    let report = json!({
        "prompt_tokens": capped.prompt_figures(),
        "prompt_tokens_uncapped": uncapped.prompt_figures(),
        "steps": o.steps,
        "elapsed_ms": capped.elapsed_ms,
        "ms_per_step": round1(capped.elapsed_ms as f64 / o.steps as f64),
        "events": capped.events,
        "store_bytes": capped.store_bytes,
        "state": capped.state,
    });
    if o.json {
        println!("{report:#}");
    } else {
        print_text(&report, o.steps);
    }
    Ok(())
}

fn print_text(r: &Value, steps: usize) {
    for (label, key) in [
        ("prompt tokens", "prompt_tokens"),
        ("prompt tokens, no binding limit", "prompt_tokens_uncapped"),
    ] {
        let p = &r[key];
        println!(
            "{label} (context_tokens {}): step 10 {}, step {steps} {}, max {}, mean {} {} vs {} {}: flat within {}%",
            p["context_tokens"],
            p["step_10"],
            p[format!("step_{steps}")],
            p["max"],
            p["early_window"].as_str().unwrap_or(""),
            p["mean_early"],
            p["late_window"].as_str().unwrap_or(""),
            p["mean_late"],
            p["flat_within_pct"],
        );
    }
    println!(
        "{steps} steps in {} ms ({} ms per step), {} events, store {} bytes",
        r["elapsed_ms"], r["ms_per_step"], r["events"], r["store_bytes"]
    );
}

/// What one run measured.
struct Scenario {
    steps: usize,
    context_tokens: u64,
    /// `prompt_tokens` of each step's request, in step order.
    tokens: Vec<u64>,
    elapsed_ms: u64,
    events: usize,
    store_bytes: u64,
    state: String,
}

impl Scenario {
    fn prompt_figures(&self) -> Value {
        let n = self.steps;
        let (early, late) = windows(n);
        let mean_early = mean(&self.tokens[early.clone()]);
        let mean_late = mean(&self.tokens[late.clone()]);
        let mut figures = serde_json::Map::new();
        figures.insert("step_10".into(), json!(self.tokens[9]));
        figures.insert(format!("step_{n}"), json!(self.tokens[n - 1]));
        figures.insert("max".into(), json!(self.tokens.iter().max()));
        figures.insert("min".into(), json!(self.tokens.iter().min()));
        figures.insert("context_tokens".into(), json!(self.context_tokens));
        figures.insert("mean_early".into(), json!(round1(mean_early)));
        figures.insert("mean_late".into(), json!(round1(mean_late)));
        figures.insert(
            "early_window".into(),
            json!(format!("steps {}-{}", early.start + 1, early.end)),
        );
        figures.insert(
            "late_window".into(),
            json!(format!("steps {}-{}", late.start + 1, late.end)),
        );
        figures.insert(
            "flat_within_pct".into(),
            json!(round1((mean_late - mean_early).abs() / mean_early * 100.0)),
        );
        Value::Object(figures)
    }
}

/// The 0-based index ranges compared: steps 10%–30% and the last fifth (for 500 steps, steps
/// 51–150 and 401–500, 1-based).
fn windows(n: usize) -> (std::ops::Range<usize>, std::ops::Range<usize>) {
    (n / 10..n * 3 / 10, n * 4 / 5..n)
}

fn mean(values: &[u64]) -> f64 {
    values.iter().sum::<u64>() as f64 / values.len().max(1) as f64
}

fn round1(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}

/// Builds a workspace, runs the script through the engine, and reads the figures back from the
/// store.
fn scenario(steps: usize, context_tokens: u64) -> Result<Scenario> {
    let dir = tempfile::tempdir().context("creating a temporary directory")?;
    let ws = dir.path();
    workspace(ws)?;
    std::fs::write(
        ws.join("actions.jsonl"),
        keel_test_support::survey::script(steps),
    )?;
    std::fs::write(ws.join("keel.toml"), contract(context_tokens))?;

    let contract_path = ws.join("keel.toml");
    let contract = keel_engine::load_contract(&contract_path)?;
    let mut store = Store::open(&ws.join(".keel").join("keel.db"))?;
    let id = keel_engine::new_run_id();
    let choice = DriverOverride::default();
    let actor = Actor::current();
    let started = Instant::now();
    let run = keel_engine::start(
        &mut store,
        NewRun {
            contract_path: &contract_path,
            contract,
            run_id: &id,
            choice: &choice,
            detach: false,
        },
        &actor,
        &mut Quiet,
        &mut |_| {},
    )?;
    let elapsed_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
    ensure!(
        run.state == RunState::Completed,
        "the benchmark run ended {}: {}",
        run.state,
        run.reason
    );

    let events = store.events_from(&id, 1)?;
    let mut tokens = Vec::with_capacity(steps);
    for stored in &events {
        if stored.kind != "model_requested" {
            continue;
        }
        if let EventBody::ModelRequested { prompt_tokens, .. } = stored.decode()?.body {
            tokens.push(prompt_tokens);
        }
    }
    ensure!(
        tokens.len() == steps,
        "expected {steps} model requests, the store has {}",
        tokens.len()
    );
    Ok(Scenario {
        steps,
        context_tokens,
        tokens,
        elapsed_ms,
        events: events.len(),
        store_bytes: size(&ws.join(".keel"))?,
        state: run.state.to_string(),
    })
}

fn git(dir: &Path, args: &[&str]) -> Result<()> {
    let out = Command::new("git")
        .args(args)
        .current_dir(dir)
        .env("GIT_AUTHOR_NAME", "keel-bench")
        .env("GIT_AUTHOR_EMAIL", "keel-bench@localhost")
        .env("GIT_COMMITTER_NAME", "keel-bench")
        .env("GIT_COMMITTER_EMAIL", "keel-bench@localhost")
        .output()
        .context("running git (is it installed?)")?;
    ensure!(
        out.status.success(),
        "git {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

/// A git repository with five 200-line files to read.
fn workspace(ws: &Path) -> Result<()> {
    git(ws, &["init", "-q", "-b", "main"])?;
    std::fs::write(ws.join("README.md"), "keel-bench workspace\n")?;
    std::fs::write(ws.join(".gitignore"), ".keel/\n")?;
    keel_test_support::survey::write_files(ws)?;
    git(ws, &["add", "-A"])?;
    git(ws, &["commit", "-q", "-m", "bench workspace"])
}

fn contract(context_tokens: u64) -> String {
    format!(
        r#"[task]
goal = "Survey the five files and keep notes on them."

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
objective = "Read the files, keep notes and a plan, then finish."
tools = ["read", "note", "plan", "finish"]
"#
    )
}

/// xorshift64*: deterministic, so every run of the benchmark replays the same script.
/// Bytes of every file under `dir`.
fn size(dir: &Path) -> Result<u64> {
    let mut total = 0;
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let meta = entry.metadata()?;
        total += if meta.is_dir() {
            size(&entry.path())?
        } else {
            meta.len()
        };
    }
    Ok(total)
}
