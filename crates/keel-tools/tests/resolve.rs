#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Legitimate paths resolve to where they really are.

mod support;

use keel_tools::{Resolved, Workspace};
use support::{Fixture, observation};

#[track_caller]
fn check(fx: &Fixture, path: &str, for_write: bool, rel: &str) {
    let resolved = fx.ws.resolve(path, for_write).unwrap();
    assert_eq!(
        resolved,
        Resolved {
            abs: if rel.is_empty() {
                fx.root()
            } else {
                fx.root().join(rel)
            },
            rel: rel.to_owned(),
        },
        "resolving `{path}` (for_write: {for_write})"
    );
}

#[test]
fn dotdot_that_stays_inside_is_normalised() {
    let fx = Fixture::new();
    check(&fx, "a/../b.txt", false, "b.txt");
    check(&fx, "a/../b.txt", true, "b.txt");
    check(&fx, "src/./../src/lib.rs", false, "src/lib.rs");
    check(&fx, "./b.txt", true, "b.txt");
    check(&fx, "src//lib.rs", false, "src/lib.rs");
    check(&fx, ".git/../b.txt", true, "b.txt");
    assert_eq!(
        observation(fx.ws.read("a/../b.txt", None, None)),
        "   1| bee\n"
    );
}

#[test]
fn the_root_resolves_to_an_empty_relative_path() {
    let fx = Fixture::new();
    for path in ["", ".", "./", "src/..", fx.root().to_str().unwrap()] {
        check(&fx, path, false, "");
    }
}

#[test]
fn absolute_path_inside_the_root_resolves() {
    let fx = Fixture::new();
    let absolute = fx.root().join("src/lib.rs");
    check(&fx, absolute.to_str().unwrap(), false, "src/lib.rs");
    let new = fx.root().join("src/new.rs");
    check(&fx, new.to_str().unwrap(), true, "src/new.rs");
    observation(fx.ws.write(new.to_str().unwrap(), "new\n"));
    assert_eq!(fx.content("src/new.rs"), "new\n");
}

#[test]
fn root_spelled_through_a_symlink_resolves_inside() {
    let fx = Fixture::new();
    let alias = fx.dir.path().join("alias");
    std::os::unix::fs::symlink(fx.root(), &alias).unwrap();
    check(&fx, alias.join("b.txt").to_str().unwrap(), false, "b.txt");
    // A workspace opened through the alias has the canonical root.
    let ws = Workspace::new(&alias, &[]).unwrap();
    assert_eq!(ws.root(), fx.root());
}

#[test]
fn symlink_inside_pointing_inside_is_read_through_and_judged_by_its_target() {
    let fx = Fixture::new();
    fx.symlink("alias.txt", "b.txt");
    fx.symlink("docs/lib", "../src");
    check(&fx, "alias.txt", false, "b.txt");
    check(&fx, "docs/lib/lib.rs", false, "src/lib.rs");
    assert_eq!(
        observation(fx.ws.read("alias.txt", None, None)),
        "   1| bee\n"
    );
    // A new file under a symlinked directory is judged by where the directory really is.
    check(&fx, "docs/lib/new.rs", true, "src/new.rs");
    observation(fx.ws.write("docs/lib/new.rs", "x\n"));
    assert_eq!(fx.content("src/new.rs"), "x\n");
}

#[test]
fn new_files_in_new_dirs_resolve_and_are_created() {
    let fx = Fixture::new();
    check(&fx, "new/deep/dir/file.txt", true, "new/deep/dir/file.txt");
    let output = fx.ws.write("new/deep/dir/file.txt", "hello\n").unwrap();
    assert_eq!(output.changed, vec!["new/deep/dir/file.txt"]);
    assert_eq!(fx.content("new/deep/dir/file.txt"), "hello\n");
}

#[test]
fn a_missing_path_resolves_but_reading_it_is_not_found() {
    let fx = Fixture::new();
    check(&fx, "nope/x.txt", false, "nope/x.txt");
    let error = fx.ws.read("nope/x.txt", None, None).unwrap_err();
    assert!(
        matches!(&error, keel_tools::ToolError::NotFound { path } if path == "nope/x.txt"),
        "{error:?}"
    );
    assert!(error.to_string().contains("use list or search"), "{error}");
}

#[test]
fn dot_git_prefixed_names_are_not_denied() {
    let fx = Fixture::new();
    fx.file(".gitignore", "target/\n");
    fx.file(".github/workflows/ci.yml", "on: push\n");
    check(&fx, ".gitignore", true, ".gitignore");
    check(
        &fx,
        ".github/workflows/ci.yml",
        true,
        ".github/workflows/ci.yml",
    );
    check(&fx, ".keelrc", true, ".keelrc");
}
