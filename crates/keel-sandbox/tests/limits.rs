//! Resource limits, and the caller's timeout ending everything the command started.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::{Duration, Instant};

use common::{Fixture, LONG, forks_script, python, run, run_with, unique, wait_gone};

#[test]
fn the_process_limit_stops_forks() {
    let f = Fixture::new();
    let mut policy = f.policy(vec![python(), "-c".into(), forks_script(200)]);
    policy.limits.processes = Some(32);
    let ran = run(&policy, LONG);
    assert_eq!(ran.code, 0, "{ran:?}");
    // EAGAIN (11) before 32 tasks: python itself counts, so at most 31 children.
    assert!(ran.stdout.contains("fork refused 11"), "{ran:?}");
    let children: u32 = ran
        .stdout
        .lines()
        .find_map(|l| l.strip_prefix("children "))
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..32).contains(&children), "{ran:?}");
    // The sleeping children died with the command (PID 1 of their namespace).
}

#[test]
fn a_fork_bomb_is_contained_and_the_timeout_ends_it() {
    let f = Fixture::new();
    let marker = unique("keel-bomb");
    let mut policy = f.policy(vec![
        "/bin/sh".into(),
        "-c".into(),
        "bomb() { bomb | bomb & }; (bomb) & exec sleep 600".into(),
        marker.clone(),
    ]);
    policy.limits.processes = Some(32);
    // The first shell forks once, before the bomb starts, then execs `sleep`: it is still there
    // at the timeout whatever the bomb does to the process count.
    let ran = run(&policy, Duration::from_secs(3));
    assert!(ran.timed_out, "{ran:?}");
    let left = wait_gone(&marker, Duration::from_secs(30));
    assert!(left.is_empty(), "survivors: {left:?}");
}

#[test]
fn a_memory_hog_fails() {
    let f = Fixture::new();
    let mut policy = f.policy(vec![
        python(),
        "-c".into(),
        "b = bytearray(2**31)\nprint('allocated', len(b))".into(),
    ]);
    policy.limits.memory_bytes = Some(512 << 20);
    let ran = run(&policy, LONG);
    assert_ne!(ran.code, 0, "{ran:?}");
    assert!(ran.stderr.contains("MemoryError"), "{ran:?}");
    assert!(!ran.stdout.contains("allocated"), "{ran:?}");
}

#[test]
fn the_cpu_limit_kills_a_busy_loop() {
    let f = Fixture::new();
    // The command itself is PID 1 of its namespace, for which the kernel drops SIGXCPU (no
    // handler): it dies by SIGKILL at the hard limit, one second later.
    let mut policy = f.policy(vec![python(), "-c".into(), "while True: pass".into()]);
    policy.limits.cpu_seconds = Some(1);
    let ran = run(&policy, LONG);
    assert!(!ran.timed_out, "{ran:?}");
    assert_eq!(ran.code, 128 + 9, "{ran:?}");
    // Its children get SIGXCPU (24) at the soft limit.
    let mut policy = f.sh(&format!("{} -c 'while True: pass'; echo rc=$?", python()));
    policy.limits.cpu_seconds = Some(1);
    let ran = run(&policy, LONG);
    assert!(ran.stdout.contains(&format!("rc={}", 128 + 24)), "{ran:?}");
}

#[test]
fn the_open_files_limit_applies() {
    let f = Fixture::new();
    let mut policy = f.sh("ulimit -n");
    policy.limits.open_files = Some(77);
    let ran = run(&policy, LONG);
    assert_eq!(ran.code, 0, "{ran:?}");
    assert_eq!(ran.stdout.trim(), "77");
}

/// The command ignores SIGTERM and starts a grandchild that leaves the process group and the
/// session (setsid), ignores SIGTERM too, and would create a marker file later. The caller's
/// timeout (SIGTERM to the helper's group, SIGKILL after the grace period) ends them all: the
/// marker never appears and no process is left.
#[test]
fn the_timeout_kills_everything_even_setsid_grandchildren_that_ignore_sigterm() {
    let f = Fixture::new();
    let marker = unique("keel-survivor");
    let script = format!(
        "trap '' TERM
         setsid sh -c 'trap \"\" TERM; echo started > gc-started; sleep 4; touch marker-file' {marker} &
         sleep 600"
    );
    let policy = f.policy(vec!["/bin/sh".into(), "-c".into(), script, marker.clone()]);
    let ran = run_with(&policy, Duration::from_secs(1), |ws| {
        // Start the timeout clock once the grandchild is surely running.
        let deadline = Instant::now() + LONG;
        while !ws.join("gc-started").exists() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
    });
    assert!(ran.timed_out, "{ran:?}");
    assert!(f.ws.join("gc-started").exists(), "{ran:?}");
    let left = wait_gone(&marker, Duration::from_secs(30));
    assert!(left.is_empty(), "survivors: {left:?}");
    // Well past the time the grandchild would have touched the marker.
    std::thread::sleep(Duration::from_secs(6));
    assert!(!f.ws.join("marker-file").exists());
}

/// SIGKILL of the helper alone (as when keel itself is killed and PDEATHSIG fires) ends the
/// command too: the second stage has PDEATHSIG, and the command is PID 1 of its namespace.
#[test]
fn killing_the_helper_alone_kills_the_command() {
    let f = Fixture::new();
    let marker = unique("keel-orphan");
    let script = format!(
        "setsid sh -c 'trap \"\" TERM; sleep 4; touch marker-file' {marker} &
         echo up > up; sleep 600"
    );
    let policy = f.policy(vec!["/bin/sh".into(), "-c".into(), script, marker.clone()]);
    let (mut cmd, _tmp) = common::sandbox().command(&policy).unwrap();
    let mut child = cmd.spawn().unwrap();
    let deadline = Instant::now() + LONG;
    while !f.ws.join("up").exists() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(f.ws.join("up").exists());
    child.kill().unwrap();
    child.wait().unwrap();
    let left = wait_gone(&marker, Duration::from_secs(30));
    assert!(left.is_empty(), "survivors: {left:?}");
    std::thread::sleep(Duration::from_secs(6));
    assert!(!f.ws.join("marker-file").exists());
}

/// The end file is written once the command has ended, not before: a command that ends by
/// itself leaves it newer than its last write.
#[test]
fn the_end_file_is_written_when_the_command_ends() {
    let f = Fixture::new();
    let ended = f.outside.path().join("ended");
    let policy = f.sh("echo one > out; sleep 0.2; echo two >> out");
    let (mut cmd, _tmp) = common::sandbox()
        .command_noting_end(&policy, Some(&ended))
        .unwrap();
    let mut child = cmd.spawn().unwrap();
    let deadline = Instant::now() + LONG;
    while !f.ws.join("out").exists() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(!ended.exists(), "written while the command still runs");
    assert!(child.wait().unwrap().success());
    assert!(ended.exists());
    let written = std::fs::metadata(f.ws.join("out"))
        .unwrap()
        .modified()
        .unwrap();
    assert!(std::fs::metadata(&ended).unwrap().modified().unwrap() >= written);
    let err = common::sandbox()
        .command_noting_end(&policy, Some(std::path::Path::new("relative")))
        .unwrap_err()
        .to_string();
    assert!(err.contains("not an absolute path"), "{err}");
}

/// When the process that started the helper dies (here: the thread that spawned it, which is
/// what the parent-death signal follows), the helper ends the command, every process of it,
/// and only then writes the end file: nothing of the command changes a file after it.
#[test]
fn when_the_caller_dies_the_end_file_comes_after_the_commands_last_write() {
    let f = Fixture::new();
    let ended = f.outside.path().join("ended");
    let marker = unique("keel-ending");
    // A grandchild outside the group that ignores SIGTERM keeps writing until it is killed.
    let script = format!(
        "setsid sh -c 'trap \"\" TERM; while :; do date +%s%N >> ticks; sleep 0.01; done' {marker} &
         echo up > up; sleep 600"
    );
    let policy = f.policy(vec!["/bin/sh".into(), "-c".into(), script, marker.clone()]);
    let (mut cmd, _tmp) = common::sandbox()
        .command_noting_end(&policy, Some(&ended))
        .unwrap();
    let ws = f.ws.clone();
    let child = std::thread::spawn(move || {
        let child = cmd.spawn().unwrap();
        let deadline = Instant::now() + LONG;
        while !ws.join("ticks").exists() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        child
    })
    .join()
    .unwrap();
    let deadline = Instant::now() + LONG;
    while !ended.exists() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(ended.exists(), "no end file after the caller died");
    let left = wait_gone(&marker, Duration::from_secs(30));
    assert!(left.is_empty(), "survivors: {left:?}");
    let last_tick = std::fs::metadata(f.ws.join("ticks"))
        .unwrap()
        .modified()
        .unwrap();
    let end = std::fs::metadata(&ended).unwrap().modified().unwrap();
    assert!(
        end >= last_tick,
        "the command wrote after its end was noted"
    );
    let mut child = child;
    let status = child.wait().unwrap();
    assert!(!status.success(), "{status:?}");
}
