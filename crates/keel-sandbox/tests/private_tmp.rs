//! The private `TMPDIR` of an ended command is emptied and kept for the next command of the
//! process only when nothing of the command can remain in it; kept directories go when the
//! process exits. One test function: the pool is the process's, and tests run in parallel.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::PathBuf;

use common::{Fixture, python};

/// Runs `script` in the sandbox; returns its `TMPDIR` and stdout, with the private directory
/// dropped (kept or removed) afterwards.
fn run(f: &Fixture, script: &str) -> (PathBuf, String) {
    let (mut cmd, mut tmp) = common::sandbox().command(&f.sh(script)).unwrap();
    let out = cmd.output().unwrap();
    assert!(out.status.success(), "{script}: {out:?}");
    tmp.helper_exited();
    let path = tmp.path().to_path_buf();
    drop(tmp);
    (path, String::from_utf8(out.stdout).unwrap())
}

#[test]
fn a_private_tmp_is_kept_emptied_only_when_nothing_of_the_command_can_remain_in_it() {
    let f = Fixture::new();
    let outside = f.outside.path().join("target");
    std::fs::write(&outside, "stays").unwrap();

    // Files, a tree with a read-only directory, a link to a file outside, a FIFO: all removed,
    // nothing outside touched, and the next command gets the same directory, empty.
    let (first, _) = run(
        &f,
        &format!(
            "cd \"$TMPDIR\" && echo a > file && mkdir -p d/e && echo b > d/e/f && chmod 500 d/e \
             && ln -s {} link && mkfifo fifo && chmod 000 file",
            outside.display()
        ),
    );
    assert!(first.is_dir());
    assert_eq!(std::fs::read_dir(&first).unwrap().count(), 0, "emptied");
    assert_eq!(std::fs::read_to_string(&outside).unwrap(), "stays");
    assert_eq!(keel_sandbox::kept_private_dirs(), 1);
    let (second, listed) = run(&f, "ls -A \"$TMPDIR\"; echo \"$TMPDIR\"");
    assert_eq!(second, first, "the kept directory was used again");
    assert_eq!(listed, format!("{}\n", first.display()), "and it was empty");

    // Without word that the helper exited by itself, the directory is removed.
    let (_cmd, tmp) = common::sandbox().command(&f.sh("true")).unwrap();
    assert_eq!(tmp.path(), first, "the kept directory");
    drop(tmp);
    assert!(!first.exists());
    assert_eq!(keel_sandbox::kept_private_dirs(), 0);
    run(&f, "true");
    assert_eq!(keel_sandbox::kept_private_dirs(), 1);

    // A command that changed what its directory or its TMPDIR is has it removed.
    let changes = [
        "chmod 777 \"$TMPDIR\"".to_string(),
        "chmod 711 \"$TMPDIR/..\"".to_string(),
        format!(
            "{} -c 'import os; os.setxattr(os.environ[\"TMPDIR\"], \"user.keel\", b\"1\")'",
            python()
        ),
        "chattr +d \"$TMPDIR\"".to_string(),
    ];
    for change in changes {
        let (mut cmd, mut tmp) = common::sandbox().command(&f.sh(&change)).unwrap();
        let out = cmd.output().unwrap();
        tmp.helper_exited();
        let path = tmp.path().to_path_buf();
        drop(tmp);
        if !out.status.success() {
            // An attribute this filesystem or machine does not have: nothing was changed.
            eprintln!(
                "skipped `{change}`: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            continue;
        }
        assert!(!path.exists(), "`{change}`: the directory was removed");
        assert!(!path.parent().unwrap().exists(), "`{change}`: all of it");
    }

    // The kept directory is removed when the process exits.
    let stdout = common::run_one(&f.ws);
    // After what the command printed (its cgroups, `N:controllers:/path` lines).
    let mut lines = stdout.lines().skip_while(|l| !l.starts_with('/'));
    let tmp = PathBuf::from(lines.next().unwrap());
    assert_eq!(lines.next(), Some("kept 1"), "{stdout}");
    assert!(
        !tmp.parent().unwrap().exists(),
        "{} is left after the process exited",
        tmp.display()
    );
}
