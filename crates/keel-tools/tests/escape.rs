#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Every way out of the workspace is refused, and a refused call changes nothing, inside or out.

mod support;

use std::fs;

use keel_tools::{ToolError, Workspace};
use support::{Fixture, assert_denied, assert_escape};

/// Runs read and write (and resolve for both) on `path`; each must be refused by `check`, and
/// nothing on disk may change.
fn refused_for_read_and_write(
    fx: &Fixture,
    path: &str,
    check: fn(Result<(), ToolError>) -> String,
) {
    let before = fx.snapshot();
    check(fx.ws.resolve(path, false).map(drop));
    check(fx.ws.resolve(path, true).map(drop));
    check(fx.ws.read(path, None, None).map(drop));
    check(fx.ws.write(path, "overwritten\n").map(drop));
    check(fx.ws.list(path, None).map(drop));
    check(fx.ws.search("secret", Some(path), None).map(drop));
    assert_eq!(
        fx.snapshot(),
        before,
        "a refused call changed something for `{path}`"
    );
}

#[test]
fn absolute_path_outside_the_workspace_is_an_escape() {
    let fx = Fixture::new();
    let secret = fx.outside().join("secret.txt");
    refused_for_read_and_write(&fx, secret.to_str().unwrap(), assert_escape);
    refused_for_read_and_write(&fx, "/etc/passwd", assert_escape);
    let message = assert_escape(fx.ws.read(secret.to_str().unwrap(), None, None));
    assert!(message.contains("the workspace root is"), "{message}");
}

#[test]
fn dotdot_above_the_root_is_an_escape() {
    let fx = Fixture::new();
    for path in [
        "../outside/secret.txt",
        "a/../../outside/secret.txt",
        "./../outside/secret.txt",
        "src/../../outside/new.txt",
        "..",
    ] {
        refused_for_read_and_write(&fx, path, assert_escape);
    }
    let message = assert_escape(fx.ws.resolve("a/../../x", false));
    assert!(
        message.contains("`..` climbs above the workspace root"),
        "{message}"
    );
}

#[test]
fn symlink_to_an_outside_file_is_an_escape_for_read_and_write() {
    let fx = Fixture::new();
    fx.symlink("leak.txt", fx.outside().join("secret.txt"));
    fx.symlink("src/rel-leak.txt", "../../outside/secret.txt");
    refused_for_read_and_write(&fx, "leak.txt", assert_escape);
    refused_for_read_and_write(&fx, "src/rel-leak.txt", assert_escape);
    let message = assert_escape(fx.ws.read("leak.txt", None, None));
    assert!(
        message.contains("through the symlink `leak.txt`"),
        "{message}"
    );
}

#[test]
fn symlink_to_an_outside_dir_is_an_escape_as_a_parent() {
    let fx = Fixture::new();
    fx.symlink("out", fx.outside());
    refused_for_read_and_write(&fx, "out/secret.txt", assert_escape);
    // A file that does not exist yet is judged by where its directory really is.
    refused_for_read_and_write(&fx, "out/new.txt", assert_escape);
    refused_for_read_and_write(&fx, "out/new/dir/file.txt", assert_escape);
    assert!(!fx.outside().join("new.txt").exists());
}

#[test]
fn chain_of_symlinks_leading_outside_is_an_escape() {
    let fx = Fixture::new();
    fx.symlink("one", "two");
    fx.symlink("two", "src/three");
    fx.symlink("src/three", "../../outside");
    refused_for_read_and_write(&fx, "one/secret.txt", assert_escape);
    refused_for_read_and_write(&fx, "one/new.txt", assert_escape);
}

#[test]
fn dangling_symlink_pointing_outside_cannot_create_its_target() {
    let fx = Fixture::new();
    fx.symlink("dangling.txt", fx.outside().join("created-by-tool.txt"));
    fx.symlink("dangling-dir", fx.outside().join("no-such-dir"));
    refused_for_read_and_write(&fx, "dangling.txt", assert_escape);
    refused_for_read_and_write(&fx, "dangling-dir/x.txt", assert_escape);
    assert!(!fx.outside().join("created-by-tool.txt").exists());
    assert!(!fx.outside().join("no-such-dir").exists());
}

#[test]
fn symlink_loop_is_refused_without_hanging() {
    let fx = Fixture::new();
    fx.symlink("loop-a", "loop-b");
    fx.symlink("loop-b", "loop-a");
    let message = support::assert_invalid(fx.ws.resolve("loop-a/x", false));
    assert!(message.contains("symlinks"), "{message}");
}

#[test]
fn symlink_to_a_denied_dir_is_denied() {
    let fx = Fixture::new();
    fx.symlink("gitdir", ".git");
    fx.symlink("src/state", "../.keel/run.db");
    refused_for_read_and_write(&fx, "gitdir/config", assert_denied);
    refused_for_read_and_write(&fx, "gitdir/hooks/pre-commit", assert_denied);
    refused_for_read_and_write(&fx, "src/state", assert_denied);
}

#[test]
fn hard_link_to_an_outside_file_is_refused_for_write() {
    let fx = Fixture::new();
    fs::hard_link(
        fx.outside().join("secret.txt"),
        fx.root().join("linked.txt"),
    )
    .unwrap();
    let before = fx.snapshot();
    let message = assert_escape(fx.ws.write("linked.txt", "changed\n"));
    assert!(message.contains("2 hard links"), "{message}");
    assert_escape(fx.ws.resolve("linked.txt", true));
    let diff = "--- a/linked.txt\n+++ b/linked.txt\n@@ -1 +1 @@\n-secret\n+changed\n";
    assert_escape(fx.ws.patch_paths(diff));
    assert_escape(fx.ws.patch(diff));
    assert_eq!(fx.snapshot(), before);
    assert_eq!(
        fs::read_to_string(fx.outside().join("secret.txt")).unwrap(),
        "secret\n"
    );
}

#[test]
fn writing_into_git_and_keel_is_denied() {
    let fx = Fixture::with_denied(&["target", "vendor/cache/"]);
    fx.file("target/debug/app", "bin\n");
    for path in [
        ".git/config",
        ".git/hooks/pre-commit",
        ".keel/run.db",
        ".keel/new/file",
        "./.git/config",
        "src/../.git/config",
        "vendor/sub/.git/config",
        "target/debug/app",
        "target",
        "vendor/cache/x.txt",
    ] {
        refused_for_read_and_write(&fx, path, assert_denied);
    }
    let absolute = fx.root().join(".git/config");
    refused_for_read_and_write(&fx, absolute.to_str().unwrap(), assert_denied);
    let message = assert_denied(fx.ws.write(".git/config", ""));
    assert!(message.contains("git's internals"), "{message}");
    let message = assert_denied(fx.ws.read("target/debug/app", None, None));
    assert!(
        message.contains("`target/` is closed to tools"),
        "{message}"
    );
}

#[test]
fn final_symlink_is_refused_for_write_even_when_it_points_inside() {
    let fx = Fixture::new();
    fx.symlink("alias.txt", "b.txt");
    let before = fx.snapshot();
    // Not an escape, but the model must name the real file.
    let message = support::assert_invalid(fx.ws.write("alias.txt", "changed\n"));
    assert_eq!(
        message,
        "`alias.txt` is a symlink to `b.txt`; writing through it would change its target, so \
         write to `b.txt` instead"
    );
    support::assert_invalid(fx.ws.resolve("alias.txt", true));
    let diff = "--- a/alias.txt\n+++ /dev/null\n@@ -1 +0,0 @@\n-bee\n";
    support::assert_invalid(fx.ws.patch(diff));
    assert_eq!(fx.snapshot(), before);
}

#[test]
fn patch_whose_header_paths_escape_is_refused_and_changes_nothing() {
    let fx = Fixture::new();
    fx.symlink("out", fx.outside());
    let modify_ok = "--- a/b.txt\n+++ b/b.txt\n@@ -1 +1 @@\n-bee\n+bea\n";
    let secret = fx.outside().join("secret.txt");
    let escapes = [
        "--- a/../outside/secret.txt\n+++ b/../outside/secret.txt\n@@ -1 +1 @@\n-secret\n+owned\n"
            .to_owned(),
        format!(
            "--- {0}\n+++ {0}\n@@ -1 +1 @@\n-secret\n+owned\n",
            secret.display()
        ),
        "--- /dev/null\n+++ b/out/planted.txt\n@@ -0,0 +1 @@\n+planted\n".to_owned(),
        "--- a/out/secret.txt\n+++ /dev/null\n@@ -1 +0,0 @@\n-secret\n".to_owned(),
    ];
    let git_rename = "diff --git a/b.txt b/b.txt\n--- a/b.txt\n+++ b/b.txt\n@@ -1 +1 @@\n-bee\n+bea\n\
        diff --git a/src/lib.rs b/../outside/moved.rs\nsimilarity index 100%\n\
        rename from src/lib.rs\nrename to ../outside/moved.rs\n";
    // The escaping file comes second: the first, legitimate one must not be written either.
    let diffs = escapes
        .iter()
        .map(|escape| format!("{modify_ok}{escape}"))
        .chain([git_rename.to_owned()]);
    for diff in diffs {
        let before = fx.snapshot();
        assert_escape(fx.ws.patch_paths(&diff));
        assert_escape(fx.ws.patch(&diff));
        assert_eq!(
            fx.snapshot(),
            before,
            "patch changed something for:\n{diff}"
        );
    }
    let into_git = "--- /dev/null\n+++ b/.git/hooks/post-checkout\n@@ -0,0 +1 @@\n+evil\n";
    assert_denied(fx.ws.patch(into_git));
    assert!(!fx.root().join(".git/hooks/post-checkout").exists());
}

#[test]
fn extra_denied_dir_must_be_relative_inside() {
    let dir = tempfile::tempdir().unwrap();
    for bad in ["../x", "/etc", "", "."] {
        let result = Workspace::new(dir.path(), &[bad]);
        assert!(
            matches!(result, Err(ToolError::Invalid { .. })),
            "`{bad}` accepted: {result:?}"
        );
    }
}
