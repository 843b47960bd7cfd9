#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The tools that change the workspace: write and patch.

mod support;

use std::fs;
use std::io::Read;
use std::os::unix::fs::{MetadataExt, PermissionsExt};

use keel_tools::ToolError;
use support::{Fixture, assert_invalid, observation};

fn mode(fx: &Fixture, rel: &str) -> u32 {
    fs::metadata(fx.root().join(rel))
        .unwrap()
        .permissions()
        .mode()
        & 0o7777
}

fn leftovers(fx: &Fixture) -> Vec<String> {
    fx.snapshot()
        .keys()
        .map(|path| path.display().to_string())
        .filter(|path| path.contains(".keel-write-"))
        .collect()
}

// ---- write ----

#[test]
fn write_creates_a_file_and_reports_it_changed() {
    let fx = Fixture::new();
    let output = fx.ws.write("notes/todo.md", "- one\n- two\n").unwrap();
    assert_eq!(
        output.observation,
        "created `notes/todo.md` (12 bytes, 2 lines)\n"
    );
    assert_eq!(output.changed, vec!["notes/todo.md"]);
    assert_eq!(fx.content("notes/todo.md"), "- one\n- two\n");
}

#[test]
fn write_replaces_atomically_by_renaming_a_temporary_file() {
    let fx = Fixture::new();
    let path = fx.root().join("b.txt");
    let inode_before = fs::metadata(&path).unwrap().ino();
    // A reader that opened the file before the write keeps seeing the whole old content: the
    // file was replaced by a rename, not truncated and rewritten in place.
    let mut reader = fs::File::open(&path).unwrap();
    let output = fx.ws.write("b.txt", "bee\nbumble\n").unwrap();
    let mut old = String::new();
    reader.read_to_string(&mut old).unwrap();
    assert_eq!(old, "bee\n");
    assert_eq!(fx.content("b.txt"), "bee\nbumble\n");
    assert_ne!(fs::metadata(&path).unwrap().ino(), inode_before);
    assert_eq!(
        output.observation,
        "replaced `b.txt` (11 bytes, 2 lines; +1 -0)\n"
    );
    assert_eq!(output.changed, vec!["b.txt"]);
    let full = String::from_utf8(output.full).unwrap();
    assert!(
        full.contains("--- a/b.txt\n+++ b/b.txt\n@@ -1 +1,2 @@\n bee\n+bumble\n"),
        "{full}"
    );
    assert!(leftovers(&fx).is_empty(), "{:?}", leftovers(&fx));
}

#[test]
fn write_keeps_the_mode_of_an_existing_file() {
    let fx = Fixture::new();
    fx.file("run.sh", "#!/bin/sh\necho hi\n");
    fs::set_permissions(fx.root().join("run.sh"), fs::Permissions::from_mode(0o750)).unwrap();
    observation(fx.ws.write("run.sh", "#!/bin/sh\necho bye\n"));
    assert_eq!(mode(&fx, "run.sh"), 0o750);
    assert_eq!(fx.content("run.sh"), "#!/bin/sh\necho bye\n");
    // A new file is not executable and is readable by the owner.
    observation(fx.ws.write("new.sh", "x\n"));
    assert_eq!(mode(&fx, "new.sh") & 0o711, 0o600);
}

#[test]
fn write_of_the_same_content_changes_nothing() {
    let fx = Fixture::new();
    let output = fx.ws.write("b.txt", "bee\n").unwrap();
    assert!(output.changed.is_empty());
    assert_eq!(
        output.observation,
        "`b.txt` already has this content; nothing changed\n"
    );
}

#[test]
fn write_refuses_directories_and_paths_through_files() {
    let fx = Fixture::new();
    let before = fx.snapshot();
    assert!(assert_invalid(fx.ws.write("src", "x")).contains("is a directory"));
    assert!(assert_invalid(fx.ws.write("", "x")).contains("is a directory"));
    let message = assert_invalid(fx.ws.write("b.txt/inner.txt", "x"));
    assert!(
        message.contains("`b.txt` exists and is not a directory"),
        "{message}"
    );
    assert_eq!(fx.snapshot(), before);
}

// ---- patch ----

const MULTI_FILE: &str = "\
diff --git a/src/lib.rs b/src/lib.rs
index 1111111..2222222 100644
--- a/src/lib.rs
+++ b/src/lib.rs
@@ -1,3 +1,4 @@
 //! lib
+pub mod util;
 pub fn one() -> u32 {
     1
@@ -6,3 +7,3 @@ pub fn one() -> u32 {
 pub fn two() -> u32 {
-    2
+    2 + 0
 }
diff --git a/src/util.rs b/src/util.rs
new file mode 100644
index 0000000..3333333
--- /dev/null
+++ b/src/util.rs
@@ -0,0 +1,2 @@
+//! util
+pub fn help() {}
diff --git a/b.txt b/b.txt
deleted file mode 100644
index 4444444..0000000
--- a/b.txt
+++ /dev/null
@@ -1 +0,0 @@
-bee
";

const LIB: &str = "//! lib\npub fn one() -> u32 {\n    1\n}\n\npub fn two() -> u32 {\n    2\n}\n";

#[test]
fn patch_applies_a_multi_file_diff_that_modifies_creates_and_deletes() {
    let fx = Fixture::new();
    fx.file("src/lib.rs", LIB);
    let output = fx.ws.patch(MULTI_FILE).unwrap();
    assert_eq!(
        fx.content("src/lib.rs"),
        "//! lib\npub mod util;\npub fn one() -> u32 {\n    1\n}\n\npub fn two() -> u32 {\n    2 + 0\n}\n"
    );
    assert_eq!(fx.content("src/util.rs"), "//! util\npub fn help() {}\n");
    assert!(!fx.root().join("b.txt").exists());
    assert_eq!(output.changed, vec!["b.txt", "src/lib.rs", "src/util.rs"]);
    assert_eq!(
        output.observation,
        "deleted `b.txt`\nmodified `src/lib.rs` (+2 -1)\ncreated `src/util.rs` (+2)\n"
    );
    assert!(leftovers(&fx).is_empty());
}

#[test]
fn patch_paths_lists_what_a_diff_would_touch() {
    let fx = Fixture::new();
    fx.file("src/lib.rs", LIB);
    let before = fx.snapshot();
    assert_eq!(
        fx.ws.patch_paths(MULTI_FILE).unwrap(),
        vec!["b.txt", "src/lib.rs", "src/util.rs"]
    );
    // Through a symlinked directory, the real paths are listed.
    fx.symlink("code", "src");
    let diff = "--- a/code/lib.rs\n+++ b/code/lib.rs\n@@ -1 +1 @@\n-//! lib\n+//! the lib\n";
    assert_eq!(fx.ws.patch_paths(diff).unwrap(), vec!["src/lib.rs"]);
    let rename =
        "diff --git a/b.txt b/c.txt\nsimilarity index 100%\nrename from b.txt\nrename to c.txt\n";
    assert_eq!(fx.ws.patch_paths(rename).unwrap(), vec!["b.txt", "c.txt"]);
    fs::remove_file(fx.root().join("code")).unwrap();
    assert_eq!(fx.snapshot(), before, "patch_paths changed something");
}

#[test]
fn patch_that_does_not_apply_names_the_hunk_and_leaves_every_file_unchanged() {
    let fx = Fixture::new();
    // The second hunk of src/lib.rs expects `2`, which the file no longer has.
    fx.file("src/lib.rs", &LIB.replace("    2\n", "    3\n"));
    let before = fx.snapshot();
    let error = fx.ws.patch(MULTI_FILE).unwrap_err();
    match &error {
        ToolError::PatchRejected { path, reason } => {
            assert_eq!(path, "src/lib.rs");
            assert!(
                reason.starts_with(
                    "hunk #2 (@@ -6,3 +7,3 @@) does not apply: line 7 is `    3`, but the hunk \
                     expects `    2`;"
                ),
                "{reason}"
            );
            assert!(reason.contains("read the file again"), "{reason}");
        }
        other => panic!("expected PatchRejected, got {other:?}"),
    }
    assert_eq!(fx.snapshot(), before);
    assert!(!fx.root().join("src/util.rs").exists());
    assert!(fx.root().join("b.txt").exists());
}

#[test]
fn patch_rejection_says_when_only_whitespace_differs() {
    let fx = Fixture::new();
    fx.file("crlf.txt", "one\r\ntwo\r\n");
    let diff = "--- a/crlf.txt\n+++ b/crlf.txt\n@@ -1,2 +1,2 @@\n one\n-two\n+three\n";
    let error = fx.ws.patch(diff).unwrap_err();
    let message = error.to_string();
    assert!(
        message.contains("line 1 differs from what the hunk expects only in whitespace"),
        "{message}"
    );
}

#[test]
fn patch_without_a_b_prefixes_applies() {
    let fx = Fixture::new();
    fx.file("a/inner.txt", "x\n");
    let diff = "\
--- b.txt
+++ b.txt
@@ -1 +1 @@
-bee
+bea
--- a/inner.txt
+++ a/inner.txt
@@ -1 +1 @@
-x
+y
--- /dev/null
+++ fresh/new.txt
@@ -0,0 +1 @@
+new
";
    assert_eq!(
        fx.ws.patch_paths(diff).unwrap(),
        vec!["a/inner.txt", "b.txt", "fresh/new.txt"]
    );
    let output = fx.ws.patch(diff).unwrap();
    assert_eq!(
        output.changed,
        vec!["a/inner.txt", "b.txt", "fresh/new.txt"]
    );
    assert_eq!(fx.content("b.txt"), "bea\n");
    assert_eq!(fx.content("a/inner.txt"), "y\n");
    assert_eq!(fx.content("fresh/new.txt"), "new\n");
}

#[test]
fn patch_keeps_the_mode_and_follows_git_mode_and_rename_headers() {
    let fx = Fixture::new();
    fx.file("run.sh", "echo hi\n");
    fs::set_permissions(fx.root().join("run.sh"), fs::Permissions::from_mode(0o755)).unwrap();
    observation(
        fx.ws
            .patch("--- a/run.sh\n+++ b/run.sh\n@@ -1 +1 @@\n-echo hi\n+echo bye\n"),
    );
    assert_eq!(mode(&fx, "run.sh"), 0o755);
    let diff = "\
diff --git a/b.txt b/tool.sh
old mode 100644
new mode 100755
similarity index 50%
rename from b.txt
rename to tool.sh
--- a/b.txt
+++ b/tool.sh
@@ -1 +1 @@
-bee
+echo bee
";
    let output = fx.ws.patch(diff).unwrap();
    assert_eq!(output.changed, vec!["b.txt", "tool.sh"]);
    assert!(!fx.root().join("b.txt").exists());
    assert_eq!(fx.content("tool.sh"), "echo bee\n");
    assert_eq!(mode(&fx, "tool.sh"), 0o755);
}

#[test]
fn patch_that_creates_an_existing_file_is_rejected() {
    let fx = Fixture::new();
    let before = fx.snapshot();
    let diff = "--- /dev/null\n+++ b/b.txt\n@@ -0,0 +1 @@\n+again\n";
    let error = fx.ws.patch(diff).unwrap_err();
    assert!(
        matches!(&error, ToolError::PatchRejected { path, reason }
            if path == "b.txt" && reason.contains("already exists")),
        "{error:?}"
    );
    assert_eq!(fx.snapshot(), before);
}

#[test]
fn patch_that_deletes_only_part_of_a_file_is_rejected() {
    let fx = Fixture::new();
    fx.file("two.txt", "one\ntwo\n");
    let error = fx
        .ws
        .patch("--- a/two.txt\n+++ /dev/null\n@@ -1 +0,0 @@\n-one\n")
        .unwrap_err();
    assert!(
        error
            .to_string()
            .contains("remove only part of it (1 line would remain)"),
        "{error}"
    );
    assert_eq!(fx.content("two.txt"), "one\ntwo\n");
}

#[test]
fn patch_of_a_missing_file_is_not_found() {
    let fx = Fixture::new();
    let error = fx
        .ws
        .patch("--- a/nope.txt\n+++ b/nope.txt\n@@ -1 +1 @@\n-a\n+b\n")
        .unwrap_err();
    assert!(
        matches!(&error, ToolError::NotFound { path } if path == "nope.txt"),
        "{error:?}"
    );
}

#[test]
fn patch_that_does_not_parse_is_invalid_and_says_how_to_write_one() {
    let fx = Fixture::new();
    let before = fx.snapshot();
    for diff in [
        "",
        "just some text\n",
        // The hunk header counts 2 old lines, the hunk has 1.
        "--- a/b.txt\n+++ b/b.txt\n@@ -1,2 +1 @@\n-bee\n+bea\n",
        // A hunk without file headers after a file with them would be dropped silently.
        "diff --git a/b.txt b/b.txt\n--- a/b.txt\n+++ b/b.txt\n@@ -1 +1 @@\n-bee\n+bea\n\
         junk\n@@ -5 +5 @@\n-x\n+y\n",
        "--- a/b.txt\n+++ b/different.txt\n@@ -1 +1 @@\n-bee\n+bea\n",
    ] {
        let message = assert_invalid(fx.ws.patch(diff));
        assert!(
            message.contains("unified diff") || message.contains("name the same file"),
            "{message}"
        );
        assert_invalid(fx.ws.patch_paths(diff));
    }
    assert_eq!(fx.snapshot(), before);
}

#[test]
fn patch_applies_hunks_of_a_file_named_twice_in_order() {
    let fx = Fixture::new();
    let diff = "\
--- a/b.txt
+++ b/b.txt
@@ -1 +1 @@
-bee
+bea
--- a/b.txt
+++ b/b.txt
@@ -1 +1,2 @@
 bea
+sea
";
    let output = fx.ws.patch(diff).unwrap();
    assert_eq!(output.changed, vec!["b.txt"]);
    assert_eq!(fx.content("b.txt"), "bea\nsea\n");
}

#[test]
fn patch_that_fails_while_writing_restores_the_files_already_written() {
    let fx = Fixture::new();
    fx.file("a.txt", "a\n");
    let before = fx.snapshot();
    // The hunks apply in memory; writing `b.txt/new.txt` fails because `b.txt` is a file, after
    // `a.txt` (first in path order) has been written.
    let diff = "\
--- a/a.txt
+++ b/a.txt
@@ -1 +1 @@
-a
+changed
--- /dev/null
+++ b/b.txt/new.txt
@@ -0,0 +1 @@
+new
";
    let message = assert_invalid(fx.ws.patch(diff));
    assert!(
        message.ends_with(
            "`b.txt` exists and is not a directory; the files written before it were restored, \
             so nothing was changed"
        ),
        "{message}"
    );
    assert_eq!(fx.snapshot(), before);
}
