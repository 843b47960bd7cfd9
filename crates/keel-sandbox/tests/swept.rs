//! The private directories of a process killed by a signal (kept ones, and the one of the
//! command it was running) are removed by the next process that makes its own; those of a
//! living process are not. In a file of its own: the sweep happens once per process, the first
//! time it makes a private directory.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use common::{Fixture, run_to_end, sandbox};

/// Not a test by itself: run by the test below as a separate process (`KEEL_TEST_HOLDER` set).
/// It keeps a private directory for later commands, holds another for a command it is
/// "running", prints that one's path and waits to be killed.
#[test]
#[ignore = "a process the test below starts and kills"]
fn holder() {
    if std::env::var_os("KEEL_TEST_HOLDER").is_none() {
        return;
    }
    let f = Fixture::new();
    let policy = f.sh("true");
    // Held first, so that the next command makes a directory of its own, which is kept.
    let (_cmd, tmp) = sandbox().command(&policy).unwrap();
    run_to_end(&policy, true);
    assert_eq!(keel_sandbox::kept_private_dirs(), 1);
    println!("HOLDING {}", tmp.path().display());
    std::thread::sleep(std::time::Duration::from_secs(600));
}

/// A holder process, killed when dropped (a failed assertion must not leave it waiting).
struct Holder(Child);

impl Drop for Holder {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts a holder and returns it with its process directory (the `keel-sandboxes-` directory
/// that holds its command's private directory).
fn start_holder() -> (Holder, PathBuf) {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "holder",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("KEEL_TEST_HOLDER", "1")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let tmp = lines
        .find_map(|l| {
            let line = l.unwrap();
            line.split_once("HOLDING ")
                .map(|(_, path)| PathBuf::from(path))
        })
        .expect("the holder says what it holds");
    let dir = tmp.parent().unwrap().parent().unwrap().to_path_buf();
    (Holder(child), dir)
}

#[test]
fn the_directories_of_a_killed_process_are_swept_and_a_living_ones_are_not() {
    let (killed, killed_dir) = start_holder();
    let (living, living_dir) = start_holder();
    for dir in [&killed_dir, &living_dir] {
        let name = dir.file_name().unwrap().to_str().unwrap();
        assert!(name.starts_with("keel-sandboxes-"), "{}", dir.display());
        // The lock, the kept directory and the held one.
        assert_eq!(
            std::fs::read_dir(dir).unwrap().count(),
            3,
            "{}",
            dir.display()
        );
    }
    drop(killed);
    assert!(
        killed_dir.exists(),
        "a killed process cannot remove its own"
    );

    // This process's first private directory sweeps.
    let f = Fixture::new();
    let (_cmd, tmp) = sandbox().command(&f.sh("true")).unwrap();
    assert!(!killed_dir.exists(), "{} was swept", killed_dir.display());
    assert!(living_dir.exists(), "{} was left", living_dir.display());
    let own = tmp.path().parent().unwrap().parent().unwrap().to_path_buf();
    assert!(own.join("lock").exists() && own != living_dir);

    // Its directory removed under it (by a cleaner of old files in /tmp): a command still gets a
    // private directory, in the system's temporary directory itself.
    drop(tmp);
    std::fs::remove_dir_all(&own).unwrap();
    let (_cmd, again) = sandbox().command(&f.sh("true")).unwrap();
    assert_eq!(
        again.path().parent().unwrap().parent().unwrap(),
        std::env::temp_dir()
    );
    drop(again);

    drop(living);
    // Swept later, by the next process (not this one: it swept once).
    assert!(living_dir.exists());
    let _ = std::fs::remove_dir_all(&living_dir);
}
