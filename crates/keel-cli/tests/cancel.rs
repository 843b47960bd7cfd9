//! `keel cancel` while another process drives the run: the canceller takes the lease, the run
//! ends `failed` with who and why, and the driving process stops at its next write without
//! running anything more.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::process::Stdio;
use std::time::Duration;

use common::{Fixture, kinds, state};

const CONTRACT: &str = r#"
[task]
goal = "Two slow steps."

[[verify]]
name = "done"
tier = "acceptance"
run = "test -f second.txt"

[[phase]]
name = "slow"
kind = "command"
run = ["sleep 1; echo first > first.txt", "echo second > second.txt"]
"#;

#[test]
fn a_cancel_while_another_process_drives_stops_that_process() {
    let f = Fixture::new(CONTRACT);
    let mut driver = f
        .keel()
        .args(["run", "keel.toml"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Wait (by polling the store, not by timing) until the first step is running.
    let id = loop {
        // A driver that ended before its first step ran would leave this loop waiting forever.
        if driver.try_wait().unwrap().is_some() {
            let out = driver.wait_with_output().unwrap();
            panic!("the driving process ended early\n{}", f.explain(&out));
        }
        if let Ok(out) = f.keel().args(["status", "--json"]).output()
            && let Ok(v) = serde_json::from_slice::<serde_json::Value>(&out.stdout)
            && let Some(run) = v.as_array().and_then(|a| a.first())
            && run["phases"][0]["steps"][0]["state"] == "in_progress"
        {
            break run["id"].as_str().unwrap().to_string();
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let out = f.expect(&["cancel", &id, "--reason", "wrong branch"], 5);
    assert!(String::from_utf8_lossy(&out.stdout).contains("cancelled"));

    let out = driver.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(5), "{}", f.explain(&out));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("taken over by another process"),
        "{}",
        f.explain(&out)
    );
    let status = f.status(&id);
    assert_eq!(state(&status), "failed");
    assert!(status["reason"].as_str().unwrap().contains("wrong branch"));
    assert!(
        !f.path("second.txt").exists(),
        "a step ran after the cancel"
    );
    let events = f.events(&id);
    let kinds = kinds(&events);
    assert_eq!(kinds.last().map(String::as_str), Some("state_changed"));
    assert!(kinds.contains(&"cancelled".to_string()));
    f.verify_log_ok(&id);
    // A finished run cannot be cancelled again.
    f.expect(&["cancel", &id, "--reason", "again"], 2);
}
