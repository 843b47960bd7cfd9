//! keel starts confined commands with the small `keel-sandbox-helper` beside it when that is a
//! helper of the same build, and re-executes itself otherwise: a missing, foreign or stale
//! helper is passed over, and the run is confined and completes either way.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::{Fixture, keel_bin};

const CONTRACT: &str = r#"[task]
goal = "a.txt exists."

[[verify]]
name = "file"
tier = "acceptance"
run = "test -f a.txt"

[[phase]]
name = "make"
kind = "command"
run = ["echo a > a.txt"]
"#;

fn small_helper() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_keel-sandbox-helper"))
}

/// A script run at once by this test or by keel: made so that running it cannot meet ETXTBSY
/// (see `keel_test_support::write_program`).
fn executable(path: &Path, text: &str) {
    keel_test_support::write_program(path, text, 0o755);
}

/// A copy of keel in a directory of its own (a hard link where the filesystem allows).
fn keel_alone(dir: &Path) -> PathBuf {
    let keel = dir.join("keel");
    keel_test_support::install_program(&keel_bin(), &keel);
    keel
}

/// A `keel-sandbox-helper` in `dir` that notes each confined command in `used` and then is the
/// real small helper (`exec` keeps the pid the request names); asked for its build it says
/// `build`.
fn noting_helper(dir: &Path, build: &str, used: &Path) {
    executable(
        &dir.join(keel_engine::SMALL_HELPER),
        &format!(
            "#!/bin/sh\nif [ \"$1\" = __keel-sandbox-build ]; then echo {build}; exit 0; fi\n\
             echo \"$1\" >> {used}\nexec {real} \"$@\"\n",
            used = used.display(),
            real = small_helper().display()
        ),
    );
}

fn run_with(keel: &Path) -> std::process::Output {
    let f = Fixture::new(CONTRACT);
    let out = Command::new(keel)
        .args(["run", "keel.toml"])
        .current_dir(f.root())
        .env_remove("KEEL_STORE")
        .output()
        .unwrap();
    assert!(
        out.status.success() && f.path("a.txt").exists(),
        "{}",
        f.explain(&out)
    );
    out
}

#[test]
fn the_small_helper_beside_keel_is_chosen_only_when_it_is_of_the_same_build() {
    let dir = tempfile::tempdir().unwrap();
    let own = dir.path().join("keel");
    // Nothing beside: keel itself.
    assert_eq!(keel_engine::choose_helper(&own), own);
    // The real small helper of this build.
    keel_test_support::install_program(
        &small_helper(),
        &dir.path().join(keel_engine::SMALL_HELPER),
    );
    assert_eq!(
        keel_engine::choose_helper(&own),
        dir.path().join(keel_engine::SMALL_HELPER)
    );
    // A helper left from another build, and a program that is no helper at all.
    executable(
        &dir.path().join(keel_engine::SMALL_HELPER),
        "#!/bin/sh\necho 0123456789abcdef\n",
    );
    assert_eq!(keel_engine::choose_helper(&own), own);
    executable(
        &dir.path().join(keel_engine::SMALL_HELPER),
        "#!/bin/sh\nexit 0\n",
    );
    assert_eq!(keel_engine::choose_helper(&own), own);
}

#[test]
fn a_run_confines_its_commands_through_the_small_helper_of_its_build() {
    let dir = tempfile::tempdir().unwrap();
    let keel = keel_alone(dir.path());
    let used = dir.path().join("used");
    noting_helper(dir.path(), &format!("{:016x}", keel_sandbox::BUILD), &used);
    run_with(&keel);
    // The command phase's command and the acceptance verifier.
    let noted = std::fs::read_to_string(&used).unwrap();
    assert_eq!(noted.lines().collect::<Vec<_>>(), ["__keel-sandbox"; 2]);
}

#[test]
fn a_run_passes_over_a_stale_helper_and_confines_its_commands_itself() {
    let dir = tempfile::tempdir().unwrap();
    let keel = keel_alone(dir.path());
    let used = dir.path().join("used");
    noting_helper(dir.path(), "0123456789abcdef", &used);
    run_with(&keel);
    assert!(!used.exists(), "the stale helper was used");
}

#[test]
fn a_run_without_a_helper_beside_keel_confines_its_commands_itself() {
    let dir = tempfile::tempdir().unwrap();
    let keel = keel_alone(dir.path());
    run_with(&keel);
}
