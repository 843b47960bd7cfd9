//! The sandbox as a non-root user: a user namespace (the caller's ids mapped to 0), and
//! RLIMIT_NPROC for the process limit. The tests run as root, so they drop to `nobody` with
//! util-linux's `setpriv` (skipped where it is missing).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::os::unix::fs::chown;
use std::path::Path;
use std::process::Command;

use common::Fixture;

const NOBODY: u32 = 65534;

fn setpriv() -> Option<&'static str> {
    ["/usr/bin/setpriv", "/bin/setpriv"]
        .into_iter()
        .find(|p| Path::new(p).exists())
}

#[test]
fn as_a_non_root_user_the_sandbox_uses_a_user_namespace() {
    let Some(setpriv) = setpriv() else {
        eprintln!("skipped: no setpriv");
        return;
    };
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipped: needs root to become nobody");
        return;
    }
    let f = Fixture::new();
    for p in [f.root.path(), f.ws.as_path(), f.outside.path()] {
        chown(p, Some(NOBODY), Some(NOBODY)).unwrap();
    }
    std::fs::write(f.outside.path().join("victim"), "original").unwrap();
    chown(f.outside.path().join("victim"), Some(NOBODY), Some(NOBODY)).unwrap();
    let mut policy = f.sh(&format!(
        "id -u; echo pid=$$
         echo hi > made
         echo x > {o}/victim || echo outside-refused
         grep -E '^(CapEff|NoNewPrivs)' /proc/self/status
         grep 'Max processes' /proc/self/limits",
        o = f.outside.path().display()
    ));
    policy.limits.processes = Some(4000);
    // `nobody` must be able to execute the helper wherever the checkout lives (a CI clone may sit
    // in a directory only root can enter): a copy in a directory open to everyone.
    use std::os::unix::fs::PermissionsExt;
    let bin_dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(bin_dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let helper = bin_dir.path().join("keel-sandbox-test-helper");
    keel_test_support::install_program(
        Path::new(env!("CARGO_BIN_EXE_keel-sandbox-test-helper")),
        &helper,
    );
    std::fs::set_permissions(&helper, std::fs::Permissions::from_mode(0o755)).unwrap();
    let (cmd, tmp) = keel_sandbox::Sandbox::new(&helper)
        .command(&policy)
        .unwrap();
    chown(tmp.path().parent().unwrap(), Some(NOBODY), Some(NOBODY)).unwrap();
    chown(tmp.path(), Some(NOBODY), Some(NOBODY)).unwrap();
    let mut wrapped = Command::new(setpriv);
    wrapped
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
        .arg(cmd.get_program())
        .args(cmd.get_args())
        .env_clear();
    for (k, v) in cmd.get_envs() {
        if let Some(v) = v {
            wrapped.env(k, v);
        }
    }
    let out = wrapped.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    if out.status.code() == Some(keel_sandbox::REFUSED_EXIT_CODE) && stderr.contains("namespaces") {
        eprintln!("skipped: user namespaces are not allowed here: {stderr}");
        return;
    }
    assert!(out.status.success(), "{stdout} {stderr}");
    // uid 0 inside the user namespace, with no capabilities.
    assert!(stdout.starts_with("0\npid=1\n"), "{stdout} {stderr}");
    assert!(stdout.contains("outside-refused"), "{stdout} {stderr}");
    assert!(stdout.contains("CapEff:\t0000000000000000"), "{stdout}");
    assert!(stdout.contains("NoNewPrivs:\t1"), "{stdout}");
    assert!(
        stdout.contains("Max processes             4000                 4000"),
        "{stdout}"
    );
    assert_eq!(std::fs::read_to_string(f.ws.join("made")).unwrap(), "hi\n");
    assert_eq!(
        std::fs::read_to_string(f.outside.path().join("victim")).unwrap(),
        "original"
    );
    assert_eq!(tmp.refusal(), None);
}
