//! The report's shape: `keel-bench --quick --json` (made smaller still) prints one JSON object
//! with every figure, each with its value, reference, target, verdict and note. No timing is
//! asserted.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::process::Command;

use serde_json::Value;

const FIGURES: [&str; 8] = [
    "sqlite_commit_us",
    "step_overhead_us",
    "survey_step_us",
    "cpu_us_per_step",
    "prompt_tokens",
    "resume_ms",
    "events_per_s",
    "concurrent_runs",
];

/// The report `keel-bench --quick --json` with `args` prints, its temporary directories under
/// `tmp`; it must succeed and print one JSON value.
fn report(args: &[&str], tmp: &Path) -> Value {
    let out = Command::new(env!("CARGO_BIN_EXE_keel-bench"))
        .args(["--quick", "--json"])
        .args(args)
        .env("TMPDIR", tmp)
        .output()
        .expect("keel-bench runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "keel-bench failed ({})\nstdout:\n{stdout}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(&stdout)
        .unwrap_or_else(|e| panic!("the report is not one JSON value ({e}):\n{stdout}"))
}

#[test]
fn the_quick_report_is_json_with_every_figure() {
    let tmp = tempfile::tempdir().unwrap();
    let report = report(
        &[
            "--steps",
            "20",
            "--runs",
            "6",
            // Four runs at a time, so that the last of the two rounds is not full (the
            // reference is the bound of that schedule). This test checks the report's shape.
            "--pool",
            "4",
            "--resume-sizes",
            "100,1000",
        ],
        tmp.path(),
    );
    for name in FIGURES {
        let f = &report[name];
        assert!(f.is_object(), "{name} is missing:\n{report:#}");
        for key in ["value", "reference", "target", "note"] {
            assert!(f.get(key).is_some(), "{name}.{key} is missing:\n{f:#}");
        }
        assert!(
            f["meets_target"].is_boolean()
                || (f["meets_target"].is_null()
                    && ["sqlite_commit_us", "survey_step_us"].contains(&name)),
            "{name}.meets_target must be true or false:\n{f:#}"
        );
        assert!(
            f["note"].as_str().is_some_and(|n| !n.is_empty()),
            "{name} says how it was measured"
        );
    }
    for key in ["median", "p99"] {
        assert!(
            report["step_overhead_us"]["value"][key].is_number(),
            "{key}"
        );
        assert!(
            report["sqlite_commit_us"]["value"][key].is_number(),
            "{key}"
        );
    }
    // The no-op steps and the survey's: 20 steps, 19 from one step's start to the next's.
    assert_eq!(report["step_overhead_us"]["value"]["n"], 19, "{report:#}");
    assert_eq!(report["survey_step_us"]["value"]["n"], 19, "{report:#}");
    assert!(report["survey_step_us"]["cpu_us"]["process"].is_number());
    assert!(report["survey_step_us"]["wal_pages_per_step"].is_number());
    assert!(report["sqlite_commit_us"]["cpu_us_per_commit"].is_number());
    assert!(report["cpu_us_per_step"]["reference"]["floor_commit_cpu_us"].is_number());
    // What a process start costs the machine, beside the figures it explains: measured (a
    // number; a kernel that accounts CPU by ticks may round a few short processes to 0), not
    // the reason it could not be.
    let machine = &report["machine"];
    for program in ["true", "sh -c true"] {
        let cost = &machine["process_start_cpu_us"][program];
        assert!(
            cost.as_f64().is_some_and(|us| us >= 0.0),
            "{program}: {machine:#}"
        );
    }
    assert!(machine["cpu_model"].is_string(), "{machine:#}");
    assert!(report["resume_ms"]["value"]["events_100"].is_number());
    assert!(report["resume_ms"]["value"]["events_1000"].is_number());
    // Three timed resumes of each size (--quick), and three trials of each group commit mode.
    for run in report["resume_ms"]["runs"].as_array().unwrap() {
        assert_eq!(run["samples_ms"].as_array().unwrap().len(), 3, "{run}");
    }
    for trial in report["events_per_s"]["trials"].as_array().unwrap() {
        for key in ["group_commit_trials", "without_group_commit_trials"] {
            assert_eq!(trial[key].as_array().unwrap().len(), 3, "{trial}");
        }
    }
    assert!(report["prompt_tokens"]["value"]["step_10"].is_number());
    assert!(report["prompt_tokens"]["value"]["step_20"].is_number());
    assert!(report["concurrent_runs"]["value"]["steps_per_s"].is_number());
    assert_eq!(report["concurrent_runs"]["completed"], 6, "{report:#}");
    // Six runs on four threads: the busiest thread drives two runs one after the other, so the
    // model's 50 ms allow 6 runs' steps in 2 rounds of steps, 60 a second, not 4 / 0.05 s.
    let reference = &report["concurrent_runs"]["reference"];
    assert_eq!(reference["rounds"], 2, "{reference}");
    assert_eq!(reference["allowed_steps_per_s"], 60.0, "{reference}");
    assert_eq!(
        reference["in_flight_bound_steps_per_s"], 80.0,
        "{reference}"
    );
    assert!(report["concurrent_runs"]["tokenizer_build_ms"].is_number());
    // What the CPUs allow at the CPU the steps cost: both parts of it, per CPU.
    let concurrent = &report["concurrent_runs"];
    let bound = &concurrent["cpu_bound"];
    let per_step = bound["cpu_ms_per_step"].as_f64().unwrap();
    let parts = &concurrent["cpu_ms_per_step"];
    let sum = ["process", "children", "model_server"]
        .iter()
        .map(|part| parts[part].as_f64().unwrap())
        .sum::<f64>();
    // The fake model answered every step, on threads of the benchmark's process: some CPU.
    assert!(parts["model_server"].as_f64().unwrap() > 0.0, "{parts}");
    assert!((per_step - sum).abs() < 0.002, "{bound} {parts}");
    let cpus = bound["cpus"].as_f64().unwrap();
    let at_full = bound["steps_per_s_at_full_cpu"].as_f64().unwrap();
    assert!(
        (at_full * per_step / 1000.0 - cpus).abs() < 0.01 * cpus,
        "{bound}"
    );
    let needs = bound["cpus_the_target_needs"].as_f64().unwrap();
    assert!(
        (needs - 0.8 * 60.0 * per_step / 1000.0).abs() < 0.002,
        "{bound}"
    );
    assert!(bound["cpu_busy"].as_f64().unwrap() > 0.0, "{bound}");
    // Each run's gaps between its model calls, and its one acceptance verifier.
    let gaps = &report["concurrent_runs"]["run_gaps_ms"];
    for (key, n) in [
        ("to_first_request", 6),
        ("between_calls", 6 * 4),
        ("before_send", 6 * 5),
        ("after_last_reply", 6),
        ("verifier_command", 6),
    ] {
        assert_eq!(gaps[key]["n"], n, "{key}: {gaps}");
    }
    // Each run as its pool thread waited for it holds the run's log from its first event to
    // its last, and more (events are stamped in whole milliseconds: one of slack).
    let (run_ms, drive_ms) = (
        &report["concurrent_runs"]["run_ms"],
        &report["concurrent_runs"]["drive_ms"],
    );
    assert_eq!(drive_ms["n"], 6, "{drive_ms}");
    assert!(
        drive_ms["mean"].as_f64().unwrap() + 1.0 >= run_ms["mean"].as_f64().unwrap(),
        "{run_ms} {drive_ms}"
    );
    // The acceptance verifiers ran in the sandbox, through the helper the report names.
    let helper = &report["concurrent_runs"]["sandbox_helper"];
    let path = std::path::Path::new(helper["path"].as_str().unwrap());
    assert!(path.is_file(), "{helper}");
    assert_eq!(
        helper["small"],
        path.file_name().unwrap() == "keel-sandbox-helper",
        "{helper}"
    );
    for key in [
        "commits_per_step_at_most",
        "git_processes_per_step",
        "stored_blobs_per_step",
        "artifact_files_per_step",
    ] {
        assert!(report["step_breakdown"][key].is_number(), "{key}");
    }
    for key in ["ms_per_step", "events", "store_bytes"] {
        assert!(report[key].is_number(), "{key}");
    }
    assert_eq!(report["state"], "completed");
}

/// `--only noop`: the floor and the no-op runs alone, for profiling a step, with their figures
/// and no others; `--keep` keeps the measured no-op run's workspace and store.
#[test]
fn the_noop_section_alone_gives_the_step_figures() {
    let tmp = tempfile::tempdir().unwrap();
    let report = report(&["--steps", "20", "--only", "noop", "--keep"], tmp.path());
    assert_eq!(report["step_overhead_us"]["value"]["n"], 19, "{report:#}");
    assert!(report["cpu_us_per_step"]["value"]["process"].is_number());
    // Both halves of the floor, before and after the no-op runs: 200 commits with --quick, and
    // each half's median alone, within the range of all of them.
    let floor = &report["sqlite_commit_us"];
    assert_eq!(floor["value"]["n"], 200, "{report:#}");
    for half in ["before_runs", "after_runs"] {
        let median = floor["median_of_each_half"][half]
            .as_f64()
            .unwrap_or_else(|| panic!("{half} is not a number:\n{floor:#}"));
        let (min, max) = (
            floor["value"]["min"].as_f64().unwrap(),
            floor["value"]["max"].as_f64().unwrap(),
        );
        assert!(
            (min - 0.05..=max + 0.05).contains(&median),
            "{half}'s median {median} is outside {min}..{max}"
        );
    }
    // The pages each commit's sync carried to the disk. A 300-byte row's commit writes its
    // table's leaf, and page 1 and the leaf's parent only when it starts a new leaf; a step's
    // commit writes pages of two tables at least: its log row's and its run's.
    let floor_pages = floor["wal_pages_per_commit"]
        .as_f64()
        .unwrap_or_else(|| panic!("no wal_pages_per_commit:\n{floor:#}"));
    assert!(
        (1.0..2.0).contains(&floor_pages),
        "a floor commit wrote {floor_pages} pages"
    );
    let step_pages = report["step_overhead_us"]["wal_pages_per_step"]
        .as_f64()
        .unwrap_or_else(|| panic!("no wal_pages_per_step:\n{report:#}"));
    assert!(step_pages >= 2.0, "a no-op step wrote {step_pages} pages");
    for absent in [
        "survey_step_us",
        "prompt_tokens",
        "resume_ms",
        "events_per_s",
        "concurrent_runs",
        "kept_survey",
    ] {
        assert!(report.get(absent).is_none(), "{absent}:\n{report:#}");
    }
    // No command runs in the sandbox in these sections: no process start is measured for them.
    assert!(
        report["machine"]["process_start_cpu_us"].is_string(),
        "{:#}",
        report["machine"]
    );
    let kept = Path::new(report["kept_noop"].as_str().unwrap());
    assert!(kept.starts_with(tmp.path()), "{kept:?}");
    assert!(kept.join(".keel/keel.db").is_file(), "{kept:?}");
}
