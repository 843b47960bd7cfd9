//! `Git::diff`: files and lines changed between two trees.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::Repo;
use keel_git::{Change, Diff};

fn change(status: char, path: &str) -> Change {
    Change {
        status,
        path: path.to_string(),
    }
}

#[test]
fn diff_counts_added_modified_deleted_and_binary_files_and_their_lines() {
    let repo = Repo::with_commit(&[
        ("a.txt", "1\n2\n3\n"),
        ("b.txt", "x\ny\n"),
        ("keep.txt", "same\n"),
    ]);
    let git = repo.open(&[]);
    let before = git.worktree_tree().unwrap();
    repo.write("a.txt", "1\nTWO\n3\n4\n"); // +2 -1
    repo.remove("b.txt"); // -2
    repo.write("d.txt", "a\nb\nc\nd\n"); // +4
    repo.write_bytes("e.bin", b"\x00\x01\x02binary\x00"); // binary: no lines
    let after = git.worktree_tree().unwrap();

    assert_eq!(
        git.diff(&before, &after).unwrap(),
        Diff {
            files_changed: 4,
            lines_added: 6,
            lines_removed: 3,
            changes: vec![
                change('M', "a.txt"),
                change('D', "b.txt"),
                change('A', "d.txt"),
                change('A', "e.bin"),
            ],
        }
    );
}

#[test]
fn a_modified_binary_file_counts_as_one_file_with_no_lines() {
    let repo = Repo::new();
    repo.write_bytes("img.bin", b"\x00one");
    repo.commit_all("binary");
    let git = repo.open(&[]);
    repo.write_bytes("img.bin", b"\x00two\x00longer");
    let after = git.worktree_tree().unwrap();
    let diff = git.diff("HEAD", &after).unwrap();
    assert_eq!(
        (diff.files_changed, diff.lines_added, diff.lines_removed),
        (1, 0, 0)
    );
    assert_eq!(diff.changes, [change('M', "img.bin")]);
}

#[test]
fn identical_trees_have_an_empty_diff() {
    let repo = Repo::with_commit(&[("a.txt", "a\n")]);
    let git = repo.open(&[]);
    let tree = git.worktree_tree().unwrap();
    assert_eq!(git.diff(&tree, "HEAD").unwrap(), Diff::default());
}

#[test]
fn diff_from_the_empty_tree_adds_every_file() {
    let repo = Repo::new();
    repo.write("a.txt", "1\n2\n");
    repo.write("src/b.rs", "b\n");
    let git = repo.open(&[]);
    let tree = git.worktree_tree().unwrap();
    let diff = git.diff(&git.empty_tree().unwrap(), &tree).unwrap();
    assert_eq!(
        (diff.files_changed, diff.lines_added, diff.lines_removed),
        (2, 3, 0)
    );
    assert_eq!(
        diff.changes,
        [change('A', "a.txt"), change('A', "src/b.rs")]
    );
}

#[test]
fn diff_accepts_commits_and_leaves_out_excluded_paths() {
    let repo = Repo::with_commit(&[("a.txt", "a\n"), (".keel/config", "committed\n")]);
    let git = repo.open(&[".keel"]);
    repo.write("a.txt", "b\n");
    let tree = git.worktree_tree().unwrap();
    // HEAD has .keel/config and the working tree's tree does not; that is not a change.
    let diff = git.diff("HEAD", &tree).unwrap();
    assert_eq!(diff.changes, [change('M', "a.txt")]);
    assert_eq!((diff.lines_added, diff.lines_removed), (1, 1));
}

#[test]
fn a_rename_is_a_deletion_and_an_addition() {
    let repo = Repo::with_commit(&[("old.txt", "same content\nover lines\n")]);
    let git = repo.open(&[]);
    std::fs::rename(repo.file("old.txt"), repo.file("new.txt")).unwrap();
    let tree = git.worktree_tree().unwrap();
    let diff = git.diff("HEAD", &tree).unwrap();
    assert_eq!(
        diff.changes,
        [change('A', "new.txt"), change('D', "old.txt")]
    );
    assert_eq!((diff.lines_added, diff.lines_removed), (2, 2));
}

#[cfg(unix)]
#[test]
fn a_file_replaced_by_a_symlink_is_a_type_change() {
    let repo = Repo::with_commit(&[("a.txt", "a\n"), ("b.txt", "b\n")]);
    let git = repo.open(&[]);
    repo.remove("b.txt");
    std::os::unix::fs::symlink("a.txt", repo.file("b.txt")).unwrap();
    let tree = git.worktree_tree().unwrap();
    let diff = git.diff("HEAD", &tree).unwrap();
    assert_eq!(diff.changes, [change('T', "b.txt")]);
    assert_eq!(diff.files_changed, 1);
}

#[test]
fn diff_reports_paths_with_spaces_and_non_ascii_verbatim() {
    let repo = Repo::with_commit(&[("a.txt", "a\n")]);
    let git = repo.open(&[]);
    repo.write("dir with space/ファイル é.txt", "x\n");
    repo.write("line\nbreak.txt", "y\n");
    let tree = git.worktree_tree().unwrap();
    let diff = git.diff("HEAD", &tree).unwrap();
    assert_eq!(
        diff.changes,
        [
            change('A', "dir with space/ファイル é.txt"),
            change('A', "line\nbreak.txt"),
        ]
    );
    assert_eq!(diff.lines_added, 2);
}

#[test]
fn diff_text_is_a_readable_patch() {
    let repo = Repo::with_commit(&[("a.txt", "one\n")]);
    let git = repo.open(&[".keel"]);
    let before = git.worktree_tree().unwrap();
    repo.write("a.txt", "one\ntwo\n");
    repo.write(".keel/x", "keel's own\n");
    let after = git.worktree_tree().unwrap();
    let text = git.diff_text(&before, &after).unwrap();
    assert!(text.contains("--- a/a.txt"), "{text}");
    assert!(text.contains("+two"), "{text}");
    assert!(!text.contains(".keel"), "{text}");
    assert_eq!(git.diff_text(&before, &before).unwrap(), "");
}
