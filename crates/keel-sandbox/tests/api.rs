//! probe(), refusals, exit statuses.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{Fixture, LONG, run};
use keel_sandbox::{MESSAGE_PREFIX, ProcessLimit, REFUSED_EXIT_CODE, probe};

#[test]
fn probe_reports_what_this_machine_enforces() {
    let support = probe().unwrap();
    assert!(
        support.landlock_abi >= keel_sandbox::MIN_LANDLOCK_ABI,
        "{support:?}"
    );
    // The test machine runs as root, with a writable pids cgroup.
    assert!(!support.user_namespace, "{support:?}");
    assert!(
        matches!(
            support.process_limit,
            Some(ProcessLimit::CgroupV1(_) | ProcessLimit::CgroupV2(_))
        ),
        "{support:?}"
    );
    let f = Fixture::new();
    support.check(&f.sh("true")).unwrap();
}

#[test]
fn a_refusal_is_told_apart_from_a_command_that_exits_125() {
    let f = Fixture::new();
    let mut policy = f.sh("echo should-not-run");
    policy.workspace = f.root.path().join("does-not-exist");
    let ran = run(&policy, LONG);
    assert_eq!(ran.code, REFUSED_EXIT_CODE, "{ran:?}");
    assert!(ran.stderr.starts_with(MESSAGE_PREFIX), "{ran:?}");
    assert!(ran.stderr.contains("did not run"), "{ran:?}");
    assert!(!ran.stdout.contains("should-not-run"));
    let refusal = ran.refusal.unwrap();
    assert!(refusal.contains("does-not-exist"), "{refusal}");

    let ran = run(&f.sh("exit 125"), LONG);
    assert_eq!(ran.code, 125);
    assert_eq!(ran.refusal, None);
}

#[test]
fn a_missing_writable_path_is_refused_before_anything_runs() {
    let f = Fixture::new();
    let mut policy = f.sh("touch ran");
    policy.writable = vec![f.root.path().join("nope")];
    let ran = run(&policy, LONG);
    assert_eq!(ran.code, REFUSED_EXIT_CODE, "{ran:?}");
    assert!(ran.refusal.is_some());
    assert!(!f.ws.join("ran").exists());
}

#[test]
fn invalid_policies_are_refused_by_command() {
    let f = Fixture::new();
    let mut policy = f.sh("true");
    policy.argv.clear();
    assert!(common::sandbox().command(&policy).is_err());
    let mut policy = f.sh("true");
    policy.workspace = "relative".into();
    let err = common::sandbox().command(&policy).unwrap_err();
    assert!(err.to_string().contains("not an absolute path"), "{err}");
}

#[test]
fn exit_codes_and_signals_pass_through() {
    let f = Fixture::new();
    assert_eq!(run(&f.sh("exit 3"), LONG).code, 3);
    // The command is PID 1: it has a handler-less SIGTERM ignored, but a signal sent with a
    // handler-independent default (SIGKILL) from inside works; a child killed shows up normally.
    let ran = run(&f.sh("sh -c 'kill -9 $$'; echo child=$?"), LONG);
    assert!(ran.stdout.contains("child=137"), "{ran:?}");
    let ran = run(&f.policy(vec!["no-such-program-xyz".into()]), LONG);
    assert_eq!(ran.code, 127, "{ran:?}");
    assert!(ran.stderr.starts_with(MESSAGE_PREFIX), "{ran:?}");
    assert_eq!(ran.refusal, None);
}

#[test]
fn the_private_tmp_is_emptied_on_drop() {
    let f = Fixture::new();
    let (_cmd, tmp) = common::sandbox().command(&f.sh("true")).unwrap();
    let path = tmp.path().to_path_buf();
    assert!(path.is_dir());
    std::fs::write(path.join("left"), "by the command").unwrap();
    drop(tmp);
    // Removed, or kept for the next command (tests/private_tmp.rs), empty.
    assert!(!path.exists() || std::fs::read_dir(&path).unwrap().next().is_none());
}

/// The refusal report is made only for a refusal: a command that ran leaves its private
/// directory holding its `TMPDIR` alone (no file made and removed for every command).
#[test]
fn a_command_that_ran_leaves_no_report_file() {
    let f = Fixture::new();
    let (mut cmd, tmp) = common::sandbox().command(&f.sh("exit 3")).unwrap();
    let out = cmd.output().unwrap();
    assert_eq!(out.status.code(), Some(3), "{out:?}");
    assert_eq!(tmp.refusal(), None);
    let private = tmp.path().parent().unwrap();
    let mut names: Vec<_> = std::fs::read_dir(private)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(names, ["tmp"]);
}

/// Stage 2 is a fork of stage 1, which is sound only in a process of one thread: a helper
/// entered after a thread started refuses, saying why, and the command never runs.
#[test]
fn a_helper_entered_after_a_thread_started_refuses_to_fork() {
    let f = Fixture::new();
    let policy = f.sh("touch ran");
    let sandbox = keel_sandbox::Sandbox::new(env!("CARGO_BIN_EXE_keel-sandbox-threaded-helper"));
    let (mut cmd, tmp) = sandbox.command(&policy).unwrap();
    let out = cmd.output().unwrap();
    assert_eq!(out.status.code(), Some(REFUSED_EXIT_CODE), "{out:?}");
    let refusal = tmp.refusal().unwrap();
    assert!(
        refusal.contains("threads, not one") && refusal.contains("enter_if_helper"),
        "{refusal}"
    );
    assert!(!f.ws.join("ran").exists());
}

#[test]
fn a_helper_says_its_build_and_only_a_helper_of_this_build_passes_the_check() {
    let helper = std::path::Path::new(env!("CARGO_BIN_EXE_keel-sandbox-test-helper"));
    let out = std::process::Command::new(helper)
        .arg("__keel-sandbox-build")
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    assert_eq!(
        String::from_utf8(out.stdout).unwrap(),
        format!("{:016x}\n", keel_sandbox::BUILD)
    );
    assert!(keel_sandbox::is_helper_of_this_build(helper));

    let dir = tempfile::tempdir().unwrap();
    // Not a helper at all, a helper of another build, a missing file, a file that cannot run.
    // The scripts are made so that running them cannot fail with ETXTBSY (see
    // `write_program`): each must run and be refused for what it says.
    let other = dir.path().join("other-build");
    keel_test_support::write_program(&other, "#!/bin/sh\necho 0123456789abcdef\n", 0o755);
    let not_helper = dir.path().join("not-helper");
    keel_test_support::write_program(&not_helper, "#!/bin/sh\nexit 0\n", 0o755);
    let not_executable = dir.path().join("not-executable");
    std::fs::copy(helper, &not_executable).unwrap();
    std::fs::set_permissions(
        &not_executable,
        std::os::unix::fs::PermissionsExt::from_mode(0o644),
    )
    .unwrap();
    for path in [
        other,
        not_helper,
        not_executable,
        dir.path().join("missing"),
        "/bin/true".into(),
    ] {
        assert!(
            !keel_sandbox::is_helper_of_this_build(&path),
            "{}",
            path.display()
        );
    }
}

#[test]
fn a_helper_refuses_a_request_from_another_build() {
    let f = Fixture::new();
    let policy = f.sh("touch ran");
    let (mut cmd, tmp) = common::sandbox().command(&policy).unwrap();
    let request = cmd
        .get_envs()
        .find(|(k, _)| *k == "KEEL_SANDBOX_REQUEST")
        .and_then(|(_, v)| v)
        .unwrap()
        .to_str()
        .unwrap()
        .to_string();
    let mut request: serde_json::Value = serde_json::from_str(&request).unwrap();
    assert_eq!(request["build"], keel_sandbox::BUILD);
    request["build"] = serde_json::json!(keel_sandbox::BUILD ^ 1);
    cmd.env("KEEL_SANDBOX_REQUEST", request.to_string());
    let out = cmd.output().unwrap();
    assert_eq!(out.status.code(), Some(REFUSED_EXIT_CODE), "{out:?}");
    let refusal = tmp.refusal().unwrap();
    assert!(
        refusal.contains("built from other keel-sandbox source")
            && refusal.contains("build or install them together"),
        "{refusal}"
    );
    assert!(!f.ws.join("ran").exists());
}
