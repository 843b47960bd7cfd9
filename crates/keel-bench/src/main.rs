//! `keel-bench`: figures about keel's own behaviour, each measured in the same run as the
//! reference it is judged against, by driving keel-engine and keel-store as libraries on
//! temporary git workspaces.
//!
//! - `sqlite_commit_us`: the floor, one synced single-row SQLite commit (WAL,
//!   `synchronous = FULL`, the same SQLite build as keel-store's) on the same disk.
//! - `step_overhead_us`, `cpu_us_per_step`: the durable cost of one no-op agent step (scripted
//!   driver, a short `note` at every step), timed step by step.
//! - `survey_step_us`, `step_breakdown`: the same of a step of the survey run (scripted driver,
//!   varied read-only `note`/`read`/`plan` calls), and where it goes.
//! - `prompt_tokens`: the prompt size over the survey run (flat, never over `context_tokens`).
//! - `resume_ms`: `keel_engine::resume` of runs with logs of 100, 10,000 and 100,000 events.
//! - `events_per_s`: events appended per second by concurrent writers, with group commit
//!   (`Store::commit`'s shared transactions) and without (a transaction per commit).
//! - `concurrent_runs`: 1,000 runs in one process against a loopback model that answers after
//!   50 ms, through keel's real OpenAI-compatible driver.
//!
//! Usage: `cargo run --release -p keel-bench -- [--json] [--quick] [--steps N]
//! [--context-tokens N] [--runs N] [--pool N] [--only a,b,…] [--keep]`.

mod breakdown;
mod concurrent;
mod events;
mod floor;
mod resume;
mod survey;
mod synth;
mod util;

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use serde_json::{Map, Value, json};

use util::{figure, median, round1, round2, round3, summary};

/// The context size of the run without a binding limit: keel's default.
const UNCAPPED_CONTEXT_TOKENS: u64 = keel_core::contract::DEFAULT_CONTEXT_TOKENS;
/// The model latency of the concurrent-runs figure.
const MODEL_LATENCY: Duration = Duration::from_millis(50);
/// Timed resumes of each size (3 with `--quick`).
const RESUME_SAMPLES: usize = 9;
const SECTIONS: [&str; 7] = [
    "floor",
    "noop",
    "survey",
    "events",
    "resume",
    "concurrent",
    "uncapped",
];

struct Options {
    json: bool,
    /// Keep the survey run's workspace and store.
    keep: bool,
    quick: bool,
    steps: usize,
    context_tokens: u64,
    runs: usize,
    pool: usize,
    steps_per_run: usize,
    resume_sizes: Vec<u64>,
    writers: Vec<usize>,
    writer_commits: usize,
    floor_commits: usize,
    only: Vec<String>,
}

fn options() -> Result<Options> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let quick = args.iter().any(|a| a == "--quick");
    let mut o = Options {
        json: false,
        keep: false,
        quick,
        steps: if quick { 100 } else { 500 },
        context_tokens: 4000,
        runs: if quick { 100 } else { 1000 },
        pool: 64,
        steps_per_run: 5,
        resume_sizes: if quick {
            vec![100, 1_000, 10_000]
        } else {
            vec![100, 10_000, 100_000]
        },
        writers: if quick { vec![8] } else { vec![8, 32] },
        writer_commits: if quick { 40 } else { 1600 },
        floor_commits: if quick { 200 } else { 1000 },
        only: SECTIONS.iter().map(|s| s.to_string()).collect(),
    };
    let mut args = args.into_iter();
    while let Some(arg) = args.next() {
        let mut value = |what: &str| -> Result<String> {
            args.next().with_context(|| format!("{what} needs a value"))
        };
        let number = |what: &str, text: String| -> Result<u64> {
            text.parse()
                .with_context(|| format!("{what} {text}: not a whole number"))
        };
        match arg.as_str() {
            "--json" => o.json = true,
            "--keep" => o.keep = true,
            "--quick" => {}
            "--steps" => o.steps = usize::try_from(number("--steps", value("--steps")?)?)?,
            "--context-tokens" => {
                o.context_tokens = number("--context-tokens", value("--context-tokens")?)?
            }
            "--runs" => o.runs = usize::try_from(number("--runs", value("--runs")?)?)?,
            "--pool" => o.pool = usize::try_from(number("--pool", value("--pool")?)?)?,
            "--resume-sizes" => {
                o.resume_sizes = value("--resume-sizes")?
                    .split(',')
                    .map(|n| number("--resume-sizes", n.trim().to_string()))
                    .collect::<Result<_>>()?;
                ensure!(!o.resume_sizes.is_empty(), "--resume-sizes needs a size");
            }
            "--only" => {
                o.only = value("--only")?
                    .split(',')
                    .map(|s| s.trim().to_string())
                    .collect();
                for s in &o.only {
                    ensure!(
                        SECTIONS.contains(&s.as_str()),
                        "--only: unknown section `{s}` (sections: {})",
                        SECTIONS.join(", ")
                    );
                }
            }
            "-h" | "--help" => {
                println!(
                    "keel-bench [--json] [--quick] [--steps N (default 500, at least 20)] \
                     [--context-tokens N (default 4000)] [--runs N (default 1000)] \
                     [--pool N (default 64)] [--resume-sizes A,B,… (default 100,10000,100000)] [--only {}] \
                     [--keep]\n\
                     Measures keel's per-step cost against the fsync floor, resume time against \
                     log length, prompt size over a long run, group commit, and many runs \
                     against a 50 ms model. --quick uses small sizes for a smoke run; --only noop \
                     measures the floor and the no-op runs alone (step_overhead_us, \
                     cpu_us_per_step: for profiling a step); --keep keeps the survey run's \
                     workspace and store (its path is in the report as `kept_survey`), or with \
                     the no-op runs alone theirs (`kept_noop`).",
                    SECTIONS.join(",")
                );
                std::process::exit(0);
            }
            other => bail!("unknown argument `{other}`; try --help"),
        }
    }
    ensure!(o.steps >= 20, "--steps must be at least 20");
    ensure!(
        o.runs >= 1 && o.pool >= 1,
        "--runs and --pool must be at least 1"
    );
    Ok(o)
}

fn main() -> Result<()> {
    // First: this binary is also the sandbox helper of the commands its runs start.
    keel_engine::sandbox_main();
    let o = options()?;
    let on = |s: &str| o.only.iter().any(|x| x == s);
    let base = std::env::temp_dir();
    let started = Instant::now();
    let load_start = util::loadavg();
    let mut report = Map::new();
    // What starting a process costs this machine, before anything else runs: the sandbox starts
    // two for each confined command of the concurrent runs (its helper and the command's shell).
    // Only with those runs: the other sections run no command in the sandbox, and a profile of
    // one of them should not hold these processes.
    let starts = if o.quick { 20 } else { 200 };
    let process_start: Value = if on("concurrent") {
        [
            ("true", "true", &[][..]),
            ("sh -c true", "sh", &["-c", "true"][..]),
        ]
        .into_iter()
        .map(|(name, program, args)| {
            let cost = util::process_start_cpu_us(program, args, starts);
            (name.to_string(), cost.map_or_else(Value::from, Value::from))
        })
        .collect::<Map<String, Value>>()
        .into()
    } else {
        json!("not measured: only with the concurrent section")
    };

    // Half the floor first, the other half after the no-op and survey runs: the disk may
    // change under load.
    let mut floor_commits = floor::Commits::default();
    let floor_dir = tempfile::tempdir_in(&base)?;
    if on("floor") || on("survey") || on("noop") {
        floor_commits.add(floor::sqlite_commits(
            floor_dir.path(),
            o.floor_commits / 2,
        )?);
    }
    // Where the half made before the runs ends in `floor_commits.times`.
    let before_runs = floor_commits.times.len();
    let second_half =
        || floor::sqlite_commits(&floor_dir.path().join("again"), o.floor_commits / 2);

    let mut survey = None;
    let mut template = None;
    let mut noop = None;
    let survey_run = on("survey") || on("events") || on("resume");
    if on("survey") || on("noop") {
        // With the no-op runs alone (`--only noop`, for profiling a step), `--keep` keeps them.
        let keep = o.keep && !survey_run;
        let n = survey::run(&base, survey::Script::Noop, o.steps, o.context_tokens, keep)?;
        if keep {
            report.insert("kept_noop".into(), json!(n.workspace.display().to_string()));
        }
        if !survey_run {
            floor_commits.add(second_half()?);
        }
        noop = Some(n);
    }
    if survey_run {
        let s = survey::run(
            &base,
            survey::Script::Survey,
            o.steps,
            o.context_tokens,
            o.keep,
        )?;
        if o.keep {
            report.insert(
                "kept_survey".into(),
                json!(s.workspace.display().to_string()),
            );
        }
        let t = synth::Template::from_log(&s.events, s.steps / 2)?;
        floor_commits.add(second_half()?);
        survey = Some(s);
        template = Some(t);
    }
    // The median of each half alone, so that a reader sees whether the floor moved between them
    // (the machine's speed does, between reports and within one).
    let floor_us = &floor_commits.times;
    let (before, after) = floor_us.split_at(before_runs);
    let halves = json!({
        "before_runs": (!before.is_empty()).then(|| round1(median(before))),
        "after_runs": (!after.is_empty()).then(|| round1(median(after))),
    });
    let floor = summary(floor_us);
    let floor_median = floor["median"].as_f64().unwrap_or(0.0);
    let floor_cpu = round1(floor_commits.cpu_us / floor_us.len().max(1) as f64);
    if !floor_us.is_empty() {
        let mut f = figure(
            floor.clone(),
            json!(null),
            "none: this is the floor step_overhead_us is judged against",
            None,
            "One INSERT of a 300-byte row in BEGIN IMMEDIATE … COMMIT, WAL, synchronous = \
             FULL, keel-store's page size (its settings, with the same build of SQLite and its VFS: it syncs \
             with fdatasync, and writes a commit's WAL frames in one pwrite), in the same \
             temporary directory as the runs; half the commits before \
             the no-op and survey runs and half after them, each half in a new database whose WAL one \
             unmeasured transaction of 1,200 rows of 3.5 KB first grew past the checkpoint threshold, so \
             the measured commits write over it from its start, as a store in use does (a new \
             WAL's commits grow the file, and a sync then also writes its size and block map). \
             cpu_us_per_commit is this process's user + \
             system time over those commits (the sync's work in the kernel included), divided \
             by them; median_of_each_half gives the two halves' medians alone (after_runs is \
             null when no run was measured); wal_pages_per_commit is the bytes they wrote to \
             the WAL divided by them and by a WAL frame's size (a page and its 24-byte header): \
             the pages each commit's sync carried to the disk.",
        );
        f.insert("cpu_us_per_commit".into(), json!(floor_cpu));
        f.insert("median_of_each_half".into(), halves);
        f.insert(
            "wal_pages_per_commit".into(),
            json!(wal_pages(floor_commits.wal_bytes, floor_us.len())),
        );
        report.insert("sqlite_commit_us".into(), Value::Object(f));
    }

    if let Some(n) = &noop {
        noop_figures(&mut report, n, (floor_median, floor_cpu));
    }
    if let (Some(s), Some(t), true) = (&survey, &template, on("survey")) {
        survey_figures(&mut report, s, t, floor_median, &o)?;
    }

    if let (Some(s), Some(t), true) = (&survey, &template, on("events")) {
        let created = s
            .events
            .first()
            .context("the survey log is empty")?
            .decode()?;
        let mut trials = Vec::new();
        for &w in &o.writers {
            // Every writer count makes the same number of commits a trial: a trial of 8
            // writers with the 50 steps each of 32 lasted a few dozen milliseconds, in
            // which one slow sync moved its figure by a third.
            let steps = (o.writer_commits / w).max(1);
            trials.push(events::measure(&base, &created, t, w, steps)?);
        }
        let worst = trials
            .iter()
            .map(|t| t.group_events_per_s / t.separate_events_per_s.max(1e-9))
            .fold(f64::INFINITY, f64::min);
        let mut f = figure(
            json!(
                trials
                    .iter()
                    .map(|t| (
                        format!("writers_{}", t.writers),
                        json!(round1(t.group_events_per_s))
                    ))
                    .collect::<Map<_, _>>()
            ),
            json!(
                trials
                    .iter()
                    .map(|t| (
                        format!("writers_{}", t.writers),
                        json!(round1(t.separate_events_per_s))
                    ))
                    .collect::<Map<_, _>>()
            ),
            "group commit ≥ 2× the events per second of a transaction per commit, at every writer count",
            Some(worst >= 2.0),
            "Each writer thread owns a run and a store connection and appends synthetic note \
             steps through Store::commit (8 events in the engine's one commit per read-only \
             step, built from a real step of the survey run), 1,600 commits a trial at every \
             writer count (40 with --quick). value: group commit, keel-store's \
             default and what the engine does: the commits that wait for the process's write \
             lock share the next transaction and fsync, each in its own savepoint with its own \
             checks. reference: Store::set_grouped(false), every commit its own fsynced \
             transaction. Events per second over the wall time of all writers: the median of 3 \
             trials of each mode, taken in turns (without, with, without, …), each in a fresh \
             database (the trials' figures in `trials`).",
        );
        f.insert(
            "trials".into(),
            json!(trials.iter().map(events::Trial::report).collect::<Vec<_>>()),
        );
        report.insert("events_per_s".into(), Value::Object(f));
    }

    if let (Some(t), true) = (&template, on("resume")) {
        let mut built = Vec::new();
        for &n in &o.resume_sizes {
            built.push(resume::build(&base, t, n)?);
        }
        // The builds' dirty pages written out before any resume is timed (see `resume`).
        nix::unistd::sync();
        for _ in 0..if o.quick { 3 } else { RESUME_SAMPLES } {
            for b in &mut built {
                b.resume_once()?;
            }
        }
        let results = built
            .into_iter()
            .map(resume::Built::finish)
            .collect::<Result<Vec<_>>>()?;
        let first = median(&results[0].resume_ms);
        let last = median(&results[results.len() - 1].resume_ms);
        let value: Map<String, Value> = o
            .resume_sizes
            .iter()
            .zip(&results)
            .map(|(n, r)| (format!("events_{n}"), json!(round1(median(&r.resume_ms)))))
            .collect();
        let ratio = last / first.max(1e-9);
        let mut f = figure(
            Value::Object(value),
            json!({format!("events_{}", o.resume_sizes[0]): round1(first)}),
            &format!(
                "the {}-event figure ≤ 1.5× the {}-event figure",
                o.resume_sizes[o.resume_sizes.len() - 1],
                o.resume_sizes[0]
            ),
            Some(ratio <= 1.5),
            "Median wall time of keel_engine::resume of a run waiting for an answer (lease, \
             newest checkpoint and the events after it checked and folded, contract, driver, \
             the resumed commit, the drift check), of 9 resumes a size (3 with --quick), taken in \
             turns across the sizes after every size's log was built and the machine's dirty \
             pages written out. The log is a real run's start and end \
             around synthetic note steps committed through keel-store (8 events a step, made \
             from a real survey step); the engine itself wrote the last steps and a checkpoint \
             a few events before the end. Sizes are approximate: events_N is the size asked \
             for, `runs` gives the exact count.",
        );
        f.insert("ratio".into(), json!(round2(ratio)));
        f.insert(
            "runs".into(),
            json!(
                results
                    .iter()
                    .map(resume::Resume::report)
                    .collect::<Vec<_>>()
            ),
        );
        report.insert("resume_ms".into(), Value::Object(f));
    }

    if on("uncapped")
        && let Some(s) = &survey
    {
        let uncapped = survey::run(
            &base,
            survey::Script::Survey,
            s.steps,
            UNCAPPED_CONTEXT_TOKENS,
            false,
        )?;
        report.insert("prompt_tokens_uncapped".into(), uncapped.prompt_figures());
    }

    if on("concurrent") {
        let c = concurrent::measure(&base, o.runs, o.pool, o.steps_per_run, MODEL_LATENCY)?;
        report.insert("concurrent_runs".into(), concurrent_figure(&c));
    }

    report.insert(
        "machine".into(),
        json!({
            "cpus": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
            "cpu_model": util::cpu_model(),
            "process_start_cpu_us": process_start,
            "loadavg_at_start": load_start,
            "loadavg_at_end": util::loadavg(),
            "temp_dir": base.display().to_string(),
            "quick": o.quick,
            "total_s": round1(started.elapsed().as_secs_f64()),
            "note": "loadavg is the 1, 5 and 15 minute load of the whole machine (other work \
                     included); with more runnable tasks than CPUs every figure is slower than \
                     on an idle machine. process_start_cpu_us: the CPU (user + system) of \
                     starting a program and waiting for it, the mean of 200 starts (20 with \
                     --quick) before the sections run, with the concurrent section only, or why \
                     it could not be measured: what each process the sandbox starts (its \
                     helper, the command's shell) costs this machine before doing anything. \
                     Under a hypervisor that traps CPUID it is mostly glibc's start reading the \
                     CPU's caches.",
        }),
    );
    let report = Value::Object(report);
    if o.json {
        println!("{report:#}");
    } else {
        print_text(&report);
    }
    Ok(())
}

/// A figure of the wall time of a run's steps, judged against the floor's median (`meets` is
/// given the ratio), with how the median moved along the run; and the median.
fn step_figure(
    run: &survey::Survey,
    floor_median: f64,
    target: &str,
    meets: impl FnOnce(f64) -> Option<bool>,
    note: &str,
) -> (Map<String, Value>, f64) {
    let step = summary(&run.step_us);
    let step_median = step["median"].as_f64().unwrap_or(0.0);
    let ratio = step_median / floor_median.max(1e-9);
    let steps = run.step_us.len();
    let tenth = (steps / 10).max(1);
    let mut f = figure(
        step,
        json!({"sqlite_commit_us_median": floor_median}),
        target,
        meets(ratio),
        note,
    );
    f.insert("ratio_to_floor".into(), json!(round2(ratio)));
    f.insert(
        "median_first_tenth".into(),
        json!(round1(median(&run.step_us[..tenth]))),
    );
    f.insert(
        "median_last_tenth".into(),
        json!(round1(median(&run.step_us[steps - tenth..]))),
    );
    f.insert("steps".into(), json!(steps));
    // Over the steps the CPU is counted for (see `step_cpu`).
    f.insert(
        "wal_pages_per_step".into(),
        json!(wal_pages(run.wal_bytes, steps)),
    );
    (f, step_median)
}

/// WAL frames (a page and its header: keel-store's page size, as every store and floor the
/// benchmark makes has) a commit or step from the bytes `count` of them wrote to the WAL, to
/// two decimals.
fn wal_pages(bytes: u64, count: usize) -> f64 {
    let frame = keel_store::PAGE_SIZE.unsigned_abs() + keel_store::vfs::FRAME_HEADER as u64;
    round2(bytes as f64 / count.max(1) as f64 / frame as f64)
}

/// A run's CPU per step: (keel's own, its children's), in µs.
fn step_cpu(run: &survey::Survey) -> (f64, f64) {
    let steps = run.step_us.len().max(1) as f64;
    (
        round1(run.cpu.process_us / steps),
        round1(run.cpu.children_us / steps),
    )
}

/// The no-op step's figures: `step_overhead_us` and `cpu_us_per_step`.
fn noop_figures(
    report: &mut Map<String, Value>,
    noop: &survey::Survey,
    (floor_median, floor_cpu): (f64, f64),
) {
    let (f, _) = step_figure(
        noop,
        floor_median,
        "median ≤ 1.5× the median fsynced SQLite commit",
        |ratio| Some(ratio <= 1.5),
        "Wall time from the start of one agent step to the start of the next (the engine \
         reports each step once it has recorded its step_started, after the previous step's \
         commit) of a no-op step: a scripted driver (no model latency), a three-word note \
         (keel's cheapest read-only tool) at every step, fsync on, no command run. Each step \
         assembles and counts its prompt and stores its request, reply and events in one \
         commit. The run is the store's second (the first, the same script, is not measured), \
         so that its commits write over WAL frames already on the disk, as the floor's do. \
         wal_pages_per_step is the bytes written to the WAL over the same steps, divided by \
         them and by a WAL frame's size: the pages each step's sync carried to the disk, \
         beside the floor's wal_pages_per_commit. survey_step_us is the same for the survey \
         run's varied steps.",
    );
    report.insert("step_overhead_us".into(), Value::Object(f));

    let (cpu_process, cpu_children) = step_cpu(noop);
    report.insert(
        "cpu_us_per_step".into(),
        Value::Object(figure(
            json!({"process": cpu_process, "children": cpu_children, "total": round1(cpu_process + cpu_children)}),
            json!({"floor_commit_cpu_us": floor_cpu}),
            "process < 100 µs per step",
            Some(cpu_process < 100.0),
            "getrusage user + system time over the same no-op steps as step_overhead_us, \
             divided by the steps: `process` is keel's own (RUSAGE_SELF), `children` is the git \
             processes it waited for (RUSAGE_CHILDREN). The target is on `process`; \
             `total` is what a step costs the machine. The reference is the CPU one floor \
             commit takes in this process (sqlite_commit_us.cpu_us_per_commit): a durable \
             step makes at least one such commit. survey_step_us.cpu_us gives the survey \
             run's steps.",
        )),
    );
}

/// The survey run's figures: `survey_step_us`, `step_breakdown`, `prompt_tokens`, and the
/// run's size.
fn survey_figures(
    report: &mut Map<String, Value>,
    s: &survey::Survey,
    t: &synth::Template,
    floor_median: f64,
    o: &Options,
) -> Result<()> {
    let (survey_process, survey_children) = step_cpu(s);
    let (mut f, step_median) = step_figure(
        s,
        floor_median,
        "none (the targets are on the no-op step, step_overhead_us and cpu_us_per_step)",
        |_| None,
        "As step_overhead_us, over the survey run's steps: read-only note/read/plan calls \
         (notes of 5-300 words, reads of 1-60 lines, plans of 1-12 items), each step's prompt \
         cut to context_tokens (4000: material is cut at almost every step). The run is the \
         store's first, so its first steps also grow the WAL. cpu_us is its CPU per step, as \
         cpu_us_per_step; wal_pages_per_step as step_overhead_us's. See step_breakdown for \
         where a step goes.",
    );
    f.insert(
        "cpu_us".into(),
        json!({"process": survey_process, "children": survey_children}),
    );
    report.insert("survey_step_us".into(), Value::Object(f));

    let b = breakdown::measure(s, t, if o.quick { 20 } else { 50 })?;
    report.insert(
        "step_breakdown".into(),
        b.report(s, step_median, s.step_events() as f64 / s.steps as f64),
    );

    let (at10, at_last, apart) = s.step_10_vs_last();
    let mut p = figure(
        json!({"step_10": at10, format!("step_{}", s.steps): at_last}),
        json!({"step_10": at10}),
        &format!(
            "step {} within 10% of step 10, and no prompt over context_tokens",
            s.steps
        ),
        Some(apart <= 10.0 && s.tokens.iter().all(|t| *t <= s.context_tokens)),
        "prompt_tokens of each model_requested event of the survey run (the prompt keel \
         assembled for that step, counted as the driver counts). The windowed means compare \
         steps 10%-30% with the last fifth.",
    );
    if let Value::Object(m) = s.prompt_figures() {
        p.extend(m);
    }
    p.insert("step_10_vs_last_pct".into(), json!(apart));
    report.insert("prompt_tokens".into(), Value::Object(p));

    report.insert("steps".into(), json!(s.steps));
    report.insert("elapsed_ms".into(), json!(s.elapsed_ms));
    report.insert(
        "ms_per_step".into(),
        json!(round1(s.elapsed_ms as f64 / s.steps as f64)),
    );
    report.insert("events".into(), json!(s.events.len()));
    report.insert("store_bytes".into(), json!(s.store_bytes));
    report.insert("state".into(), json!(s.state));
    Ok(())
}

/// What the machine's CPUs allow the runs, at the CPU a step cost them in this run (keel's
/// process and the processes it started): a throughput the model's latency allows is out of
/// reach when the CPUs cannot give each step its CPU that often, however keel schedules them.
fn cpu_bound(c: &concurrent::Concurrent, target_steps_per_s: f64) -> Value {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    // All of it ran on this machine's CPUs: keel's process (the fake model's threads included)
    // and its children.
    let cpu_s = (c.cpu.process_us + c.cpu.children_us) / 1e6;
    let per_step_s = cpu_s / c.steps.max(1) as f64;
    let at_full = if per_step_s > 0.0 {
        Some(round1(cpus as f64 / per_step_s))
    } else {
        None
    };
    json!({
        "cpus": cpus,
        "cpu_ms_per_step": round3(per_step_s * 1000.0),
        "steps_per_s_at_full_cpu": at_full,
        "cpus_the_target_needs": round3(target_steps_per_s * per_step_s),
        "cpu_busy": round3(cpu_s / c.elapsed.as_secs_f64().max(1e-9) / cpus as f64),
        "note": "cpu_ms_per_step: everything the runs cost this machine's CPUs, the three parts \
                 of cpu_ms_per_step above added (keel, its children, the fake model). \
                 steps_per_s_at_full_cpu = cpus / cpu_ms_per_step: no schedule of these \
                 steps is faster on this machine. cpus_the_target_needs = 80% of \
                 allowed_steps_per_s × cpu_ms_per_step: above cpus, the target is out of this \
                 machine's reach at this CPU per step, and near it the runs wait for a CPU as \
                 much as for the model. cpu_busy: the share of all CPUs the runs kept busy.",
    })
}

fn concurrent_figure(c: &concurrent::Concurrent) -> Value {
    let secs = c.elapsed.as_secs_f64();
    let rate = c.steps as f64 / secs;
    let latency_s = c.latency.as_secs_f64();
    // With `pool` runs in flight, the pool's busiest thread drives ceil(runs / pool) runs one
    // after another, each at least steps_per_run model latencies long: no schedule finishes
    // sooner. 1,000 runs on 64 threads are 16 such rounds, the last with 40 runs.
    let in_flight = c.pool.min(c.runs).max(1);
    let rounds = c.runs.div_ceil(in_flight).max(1);
    let allowed = c.runs as f64 / (rounds as f64 * latency_s);
    let in_flight_bound = in_flight as f64 / latency_s;
    let unbounded = c.runs as f64 / latency_s;
    let ratio = rate / allowed;
    let peak_mb = c.peak_rss_kb.map(|kb| round1(kb as f64 / 1024.0));
    let mut f = figure(
        json!({
            "steps_per_s": round1(rate),
            "peak_rss_mb": peak_mb,
        }),
        json!({
            "allowed_steps_per_s": round1(allowed),
            "rounds": rounds,
            "in_flight_bound_steps_per_s": round1(in_flight_bound),
            "latency_bound_all_runs_at_once": round1(unbounded),
        }),
        "steps_per_s ≥ 80% of allowed_steps_per_s, peak_rss_mb < 200",
        Some(ratio >= 0.8 && peak_mb.is_some_and(|m| m < 200.0) && c.failures.is_empty()),
        "Runs driven through keel_engine::start with keel's openai driver against a fake \
         OpenAI-compatible server on loopback that answers each request after 50 ms (note \
         until the run's last step, then finish; acceptance verifier in keel's sandbox). \
         keel's worker drives one run at a time, so the runs are driven from a bounded pool \
         of threads (`pool`), each with its own store connection; all share one store and one \
         git workspace. allowed_steps_per_s = runs / (rounds × 0.05 s): what the model latency \
         allows with that many runs in flight, where rounds = ceil(runs / pool) is how many \
         runs the pool's busiest thread drives one after another (1,000 runs on 64 threads: \
         16, the last round 40 runs); in_flight_bound_steps_per_s = pool / 0.05 s, the bound \
         were every round full (the reference until 2026-12-04); \
         latency_bound_all_runs_at_once = runs / 0.05 s. \
         steps_per_s counts model answers over the wall time of all runs (run start, \
         verification and checkpoints included). peak_rss_mb is VmHWM after the runs, reset \
         before them (peak_reset says whether the reset worked). The token counter's BPE tables, \
         built once per process, are built before the clock starts (tokenizer_build_ms), as a \
         worker that has driven one run has them. run_gaps_ms: each run's log between its \
         model calls (its start before the first, a step's end and the next prompt between \
         two, and after the last the finish, the acceptance verifier, whose command alone is \
         verifier_command, the checkpoint and completed), and before_send: from each \
         model_requested to the request's sending (the reply's time less the exchange's), \
         the request's commit. run_ms: each run's log, first event to last; drive_ms: each \
         run as its pool thread waited for it, from loading its contract to \
         keel_engine::start's return, which adds the run's start before its first event and \
         the commit of its last events (the checkpoint, completed, the lease given back).",
    );
    f.insert("ratio".into(), json!(round3(ratio)));
    f.insert("runs".into(), json!(c.runs));
    f.insert("completed".into(), json!(c.completed));
    f.insert("pool".into(), json!(c.pool));
    f.insert("steps_per_run".into(), json!(c.steps_per_run));
    f.insert(
        "model_latency_ms".into(),
        json!(c.latency.as_millis() as u64),
    );
    f.insert("steps".into(), json!(c.steps));
    f.insert("elapsed_s".into(), json!(round1(secs)));
    f.insert(
        "cpu_ms_per_step".into(),
        json!({
            "process": round3((c.cpu.process_us - c.model_server_us).max(0.0) / 1000.0 / c.steps.max(1) as f64),
            "children": round3(c.cpu.children_us / 1000.0 / c.steps.max(1) as f64),
            "model_server": round3(c.model_server_us / 1000.0 / c.steps.max(1) as f64),
        }),
    );
    f.insert("cpu_bound".into(), cpu_bound(c, 0.8 * allowed));
    f.insert(
        "store_transactions".into(),
        json!({
            "transactions": c.commits.transactions,
            "commits": c.commits.commits,
            "commits_per_step": round3(c.commits.commits as f64 / c.steps.max(1) as f64),
            "mean_commits_per_transaction": round1(
                c.commits.commits as f64 / c.commits.transactions.max(1) as f64
            ),
            "largest_transaction": c.commits.largest,
            "boosted_transactions": c.commits.boosted,
            "write_lock_busy": round3(c.commits.held_us as f64 / 1e6 / secs.max(1e-9)),
            "mean_transaction_us": round1(
                c.commits.held_us as f64 / c.commits.transactions.max(1) as f64
            ),
        }),
    );
    let quantiles = |v: &[u64]| {
        let at = |q: f64| {
            v.get(((v.len() as f64 - 1.0) * q).round() as usize)
                .copied()
        };
        let mean = (!v.is_empty()).then(|| round1(v.iter().sum::<u64>() as f64 / v.len() as f64));
        json!({"n": v.len(), "mean": mean, "median": at(0.5), "p90": at(0.9), "p99": at(0.99), "max": v.last()})
    };
    f.insert("model_exchange_ms".into(), quantiles(&c.exchange_ms));
    f.insert("run_ms".into(), quantiles(&c.run_ms));
    f.insert("drive_ms".into(), quantiles(&c.drive_ms));
    f.insert(
        "run_gaps_ms".into(),
        json!({
            "to_first_request": quantiles(&c.timeline.to_first_request),
            "between_calls": quantiles(&c.timeline.between_calls),
            "before_send": quantiles(&c.timeline.before_send),
            "after_last_reply": quantiles(&c.timeline.after_last_reply),
            "verifier_command": quantiles(&c.timeline.verifier_command),
        }),
    );
    f.insert("peak_reset".into(), json!(c.peak_reset));
    f.insert(
        "tokenizer_build_ms".into(),
        json!(round1(c.tokenizer_build.as_secs_f64() * 1000.0)),
    );
    let small = c
        .helper
        .as_deref()
        .and_then(|p| p.file_name())
        .is_some_and(|name| name == keel_engine::SMALL_HELPER);
    f.insert(
        "sandbox_helper".into(),
        json!({
            "path": c.helper.as_ref().map(|p| p.display().to_string()),
            "small": small,
            "note": "The binary each confined command (the acceptance verifier) was started \
                     with: keel-sandbox-helper when one of the same build is beside keel-bench \
                     (`cargo build --release -p keel-cli` puts it there, as installing keel \
                     installs it beside keel), else keel-bench itself re-executed, whose start \
                     costs more CPU.",
        }),
    );
    f.insert(
        "failures".into(),
        json!(c.failures.iter().take(5).collect::<Vec<_>>()),
    );
    f.insert("failed_runs".into(), json!(c.failures.len()));
    Value::Object(f)
}

fn print_text(r: &Value) {
    let Some(map) = r.as_object() else { return };
    for (key, value) in map {
        match value.get("value") {
            Some(v) => println!(
                "{key}: {v} (reference {}; target: {}; met: {})",
                value["reference"], value["target"], value["meets_target"]
            ),
            None if !value.is_object() => println!("{key}: {value}"),
            None => {}
        }
    }
}
