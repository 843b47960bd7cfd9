//! What keel-git answers without starting a git process. A test binary of its own, its tests
//! one at a time: the count of processes is per process, and no other test may start one while
//! these count.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::{Mutex, MutexGuard};

use common::Repo;

/// Held by each test for its whole length.
fn one_at_a_time() -> MutexGuard<'static, ()> {
    static SERIAL: Mutex<()> = Mutex::new(());
    SERIAL
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Runs `f` and returns its result with the number of git processes it started.
fn counted<T>(f: impl FnOnce() -> T) -> (T, u64) {
    let before = keel_git::processes();
    let out = f();
    (out, keel_git::processes() - before)
}

#[test]
fn head_is_read_from_the_files_when_they_say_it_plainly_and_asked_of_git_otherwise() {
    let _serial = one_at_a_time();
    let repo = Repo::with_commit(&[("a.txt", "one\n")]);
    let git = repo.open(&[]);
    let first = repo.git(&["rev-parse", "HEAD"]);

    // On a branch whose ref is a loose file: no process.
    let (head, started) = counted(|| git.head().unwrap());
    assert_eq!((head.as_deref(), started), (Some(first.as_str()), 0));

    // Detached: HEAD holds the id itself.
    repo.write("a.txt", "two\n");
    let second = repo.commit_all("second");
    repo.git(&["checkout", "-q", "--detach", &first]);
    let (head, started) = counted(|| git.head().unwrap());
    assert_eq!((head.as_deref(), started), (Some(first.as_str()), 0));

    // Packed: the branch has no loose file any more, so git is asked, and says the same.
    repo.git(&["checkout", "-q", "main"]);
    repo.git(&["pack-refs", "--all", "--prune"]);
    assert!(!repo.path().join(".git/refs/heads/main").exists());
    let (head, started) = counted(|| git.head().unwrap());
    assert_eq!((head.as_deref(), started), (Some(second.as_str()), 1));

    // A branch that moves is seen at once (nothing is cached).
    repo.write("a.txt", "three\n");
    let third = repo.commit_all("third");
    let (head, started) = counted(|| git.head().unwrap());
    assert_eq!((head.as_deref(), started), (Some(third.as_str()), 0));

    // Unborn: no loose file, git says there is no commit.
    repo.git(&["checkout", "-q", "--orphan", "fresh"]);
    let (head, started) = counted(|| git.head().unwrap());
    assert_eq!((head, started), (None, 1));
}

#[test]
fn the_diff_of_a_tree_with_itself_is_empty_without_a_process() {
    let _serial = one_at_a_time();
    let repo = Repo::with_commit(&[("a.txt", "one\n")]);
    let git = repo.open(&[]);
    let tree = repo.head_tree();
    let (diff, started) = counted(|| git.diff(&tree, &tree).unwrap());
    assert_eq!((diff.files_changed, diff.changes.len(), started), (0, 0, 0));
    let (text, started) = counted(|| git.diff_text(&tree, &tree).unwrap());
    assert_eq!((text.as_str(), started), ("", 0));

    // Different trees still ask git.
    repo.write("a.txt", "two\n");
    let after = git.worktree_tree().unwrap();
    let (diff, started) = counted(|| git.diff(&tree, &after).unwrap());
    assert_eq!((diff.files_changed, started), (1, 1));
}
