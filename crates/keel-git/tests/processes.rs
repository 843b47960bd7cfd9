//! What keel-git answers without starting a git process. A test binary of its own, its tests
//! one at a time: the count of processes is per process, and no other test may start one while
//! these count.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{Repo, counted, one_at_a_time};

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

#[test]
fn a_snapshot_in_a_plain_repository_is_written_without_a_process() {
    let _serial = one_at_a_time();
    let repo = Repo::with_commit(&[("a.txt", "one\n")]);
    let git = repo.open(&[]);
    let tree = repo.head_tree();
    let head = git.head().unwrap();
    // The first asks git's configuration once (`git var -l`); the next ones start nothing.
    let (_, started) = counted(|| git.snapshot(&tree, head.as_deref(), "0", "refs/keel/r/0"));
    assert_eq!(started, 1);
    for n in 1..4 {
        let refname = format!("refs/keel/r/{n}");
        let (commit, started) =
            counted(|| git.snapshot(&tree, head.as_deref(), "n", &refname).unwrap());
        assert_eq!(started, 0);
        assert_eq!(repo.git(&["rev-parse", &refname]), commit);
    }
    // A change to the configuration is seen: git is asked again, and a setting keel leaves
    // to git (a reflog for every ref) makes git write the snapshot.
    repo.git(&["config", "core.logAllRefUpdates", "always"]);
    let (_, started) = counted(|| git.snapshot(&tree, None, "r", "refs/keel/r/9").unwrap());
    assert_eq!(started, 3, "var -l, commit-tree, update-ref");
    repo.git(&["config", "--unset", "core.logAllRefUpdates"]);
    let (_, started) = counted(|| git.snapshot(&tree, None, "r", "refs/keel/r/10").unwrap());
    assert_eq!(started, 1, "var -l again, then nothing");
}

#[test]
fn a_repository_opened_before_is_opened_without_a_process_until_it_changes() {
    let _serial = one_at_a_time();
    let repo = Repo::with_commit(&[("sub/a.txt", "one\n")]);
    let open = |dir: &std::path::Path| counted(|| keel_git::Git::open(dir, &[]).unwrap());
    let (first, started) = open(repo.path());
    assert_eq!(started, 1);
    let (again, started) = open(repo.path());
    assert_eq!((again.root(), started), (first.root(), 0));
    let sub = repo.path().join("sub");
    assert_eq!(open(&sub).1, 1);
    let (from_sub, started) = open(&sub);
    assert_eq!((from_sub.root(), started), (first.root(), 0));

    // A repository of its own appears in between: it is the nearer one, and git says so.
    let init = common::git_command(&sub)
        .args(["init", "-q"])
        .output()
        .unwrap();
    assert!(init.status.success());
    let (nested, started) = open(&sub);
    assert_eq!(started, 1);
    assert_eq!(nested.root(), sub.canonicalize().unwrap());
    std::fs::remove_dir_all(sub.join(".git")).unwrap();

    // The repository is made anew in the same place: asked again.
    std::fs::remove_dir_all(repo.path().join(".git")).unwrap();
    repo.git(&["init", "-q", "-b", "main"]);
    let (_, started) = open(repo.path());
    assert_eq!(started, 1);
    // Its working tree moved by configuration: asked again, and git's answer holds.
    let elsewhere = tempfile::tempdir().unwrap();
    repo.git(&[
        "config",
        "core.worktree",
        elsewhere.path().to_str().unwrap(),
    ]);
    let moved = keel_git::Git::open(repo.path(), &[]);
    assert!(
        moved.is_err() || moved.as_ref().unwrap().root() != first.root(),
        "core.worktree is followed: {:?}",
        moved.map(|g| g.root().to_path_buf())
    );
}
