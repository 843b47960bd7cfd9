//! `Git::snapshot`: commits of working-tree trees on keel's own refs.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::Repo;
use keel_git::{Git, GitError};

#[test]
fn snapshot_creates_the_ref_at_a_commit_with_the_tree_and_parent() {
    let repo = Repo::with_commit(&[("a.txt", "a\n")]);
    let git = repo.open(&[]);
    repo.write("a.txt", "work in progress\n");
    let tree = git.worktree_tree().unwrap();
    let head = git.head().unwrap().unwrap();

    let commit = git
        .snapshot(&tree, Some(&head), "keel run r1 step 1\n", "refs/keel/r1/1")
        .unwrap();

    assert_eq!(repo.git(&["rev-parse", "refs/keel/r1/1"]), commit);
    assert_eq!(git.resolve("refs/keel/r1/1").unwrap(), Some(commit.clone()));
    assert_eq!(
        repo.git(&["rev-parse", &format!("{commit}^{{tree}}")]),
        tree
    );
    assert_eq!(repo.git(&["rev-parse", &format!("{commit}^1")]), head);
    assert_eq!(
        repo.git(&["log", "-1", "--format=%an <%ae>|%cn <%ce>|%B", &commit]),
        "keel <keel@localhost>|keel <keel@localhost>|keel run r1 step 1"
    );
}

#[test]
fn snapshot_without_a_parent_is_a_root_commit() {
    let repo = Repo::new();
    repo.write("a.txt", "a\n");
    let git = repo.open(&[]);
    let tree = git.worktree_tree().unwrap();
    let commit = git.snapshot(&tree, None, "first", "refs/keel/r/0").unwrap();
    assert_eq!(
        repo.git(&["rev-list", "--parents", "-1", &commit]),
        commit,
        "a root commit lists no parents"
    );
    assert_eq!(git.head().unwrap(), None, "the branch stays unborn");
}

#[test]
fn snapshot_moves_an_existing_ref() {
    let repo = Repo::with_commit(&[("a.txt", "a\n")]);
    let git = repo.open(&[]);
    let first_tree = git.worktree_tree().unwrap();
    let first = git
        .snapshot(&first_tree, None, "one", "refs/keel/r/latest")
        .unwrap();
    repo.write("a.txt", "b\n");
    let second_tree = git.worktree_tree().unwrap();
    let second = git
        .snapshot(&second_tree, Some(&first), "two", "refs/keel/r/latest")
        .unwrap();
    assert_ne!(first, second);
    assert_eq!(repo.git(&["rev-parse", "refs/keel/r/latest"]), second);
}

#[test]
fn snapshot_works_without_identity_and_with_signing_and_failing_hooks_configured() {
    let repo = Repo::with_commit(&[("a.txt", "a\n")]);
    // An identity git refuses, signing with a program that always fails, and a hooks directory
    // whose every hook fails.
    repo.git(&["config", "user.name", ""]);
    repo.git(&["config", "user.email", ""]);
    repo.git(&["config", "user.useConfigOnly", "true"]);
    repo.git(&["config", "commit.gpgsign", "true"]);
    repo.git(&["config", "gpg.program", "false"]);
    repo.git(&["config", "core.hooksPath", "hooks"]);
    #[cfg(unix)]
    for hook in ["reference-transaction", "pre-commit", "post-commit"] {
        repo.write(&format!("hooks/{hook}"), "#!/bin/sh\nexit 1\n");
        common::set_executable(&repo.file(&format!("hooks/{hook}")), true);
    }
    // Check the fixture: git itself fails to commit or move a ref here.
    let tree = repo.head_tree();
    let plain = common::git_command(repo.path())
        .env_remove("GIT_AUTHOR_NAME")
        .env_remove("GIT_AUTHOR_EMAIL")
        .env_remove("GIT_COMMITTER_NAME")
        .env_remove("GIT_COMMITTER_EMAIL")
        .args(["commit-tree", &tree, "-m", "x"])
        .output()
        .unwrap();
    assert!(!plain.status.success(), "fixture should refuse to commit");
    #[cfg(unix)]
    {
        let head = repo.git(&["rev-parse", "HEAD"]);
        let update = repo.git_output(&["update-ref", "refs/fixture/x", &head]);
        assert!(!update.status.success(), "fixture hook should refuse");
    }

    let git = repo.open(&[]);
    let head = git.head().unwrap();
    let commit = git
        .snapshot(&tree, head.as_deref(), "snapshot", "refs/keel/r/1")
        .unwrap();
    assert_eq!(repo.git(&["rev-parse", "refs/keel/r/1"]), commit);
    assert_eq!(
        repo.git(&["cat-file", "-p", &commit])
            .lines()
            .filter(|line| line.starts_with("gpgsig"))
            .count(),
        0
    );
}

#[test]
fn snapshot_leaves_head_branch_index_and_status_alone() {
    let repo = Repo::with_commit(&[("a.txt", "a\n")]);
    repo.write("a.txt", "staged\n");
    repo.git(&["add", "a.txt"]);
    repo.write("b.txt", "untracked\n");
    let head = repo.git(&["rev-parse", "HEAD"]);
    let index = repo.index_bytes();
    let status = repo.status();

    let git = repo.open(&[]);
    let tree = git.worktree_tree().unwrap();
    git.snapshot(&tree, Some(&head), "s", "refs/keel/r/1")
        .unwrap();

    assert_eq!(repo.git(&["rev-parse", "HEAD"]), head);
    assert_eq!(repo.git(&["symbolic-ref", "HEAD"]), "refs/heads/main");
    assert_eq!(repo.index_bytes(), index);
    assert_eq!(repo.status(), status);
}

#[test]
fn snapshot_refuses_names_outside_refs_and_the_checked_out_branch() {
    let repo = Repo::with_commit(&[("a.txt", "a\n")]);
    let git = repo.open(&[]);
    let tree = repo.head_tree();
    let head = repo.git(&["rev-parse", "HEAD"]);
    for refname in ["HEAD", "main", "refs/heads/main"] {
        let err = git.snapshot(&tree, None, "x", refname).unwrap_err();
        assert!(
            matches!(err, GitError::InvalidArgument { .. }),
            "{refname}: {err:?}"
        );
    }
    assert_eq!(repo.git(&["rev-parse", "HEAD"]), head);
}

#[test]
fn snapshot_of_a_missing_tree_fails_with_gits_message() {
    let repo = Repo::with_commit(&[("a.txt", "a\n")]);
    let git = repo.open(&[]);
    let err = git
        .snapshot(&"1".repeat(40), None, "x", "refs/keel/r/1")
        .unwrap_err();
    assert!(
        matches!(&err, GitError::Failed { command, stderr, .. }
            if command.contains("commit-tree") && !stderr.is_empty()),
        "{err:?}"
    );
    assert_eq!(git.resolve("refs/keel/r/1").unwrap(), None);
}

#[test]
fn snapshot_onto_a_symbolic_ref_replaces_it_instead_of_moving_its_target() {
    let repo = Repo::with_commit(&[("a.txt", "a\n")]);
    repo.git(&["branch", "other"]);
    repo.git(&["symbolic-ref", "refs/keel/r/alias", "refs/heads/other"]);
    let other = repo.git(&["rev-parse", "refs/heads/other"]);
    let git = repo.open(&[]);
    repo.write("a.txt", "b\n");
    let tree = git.worktree_tree().unwrap();
    let commit = git.snapshot(&tree, None, "s", "refs/keel/r/alias").unwrap();
    assert_eq!(repo.git(&["rev-parse", "refs/heads/other"]), other);
    assert_eq!(repo.git(&["rev-parse", "refs/keel/r/alias"]), commit);
}

#[test]
fn a_stale_lock_on_a_keel_ref_can_be_cleared_and_the_snapshot_goes_ahead() {
    let repo = Repo::with_commit(&[("a.txt", "a\n")]);
    let git = repo.open(&[]);
    let tree = git.worktree_tree().unwrap();
    let refname = "refs/keel/run1/1";
    git.snapshot(&tree, None, "first", refname).unwrap();
    // A git killed while moving the ref leaves its lock behind: the next update fails.
    std::fs::write(repo.path().join(".git/refs/keel/run1/1.lock"), "").unwrap();
    assert!(git.snapshot(&tree, None, "second", refname).is_err());
    assert!(git.clear_ref_lock(refname).unwrap());
    assert!(
        !git.clear_ref_lock(refname).unwrap(),
        "nothing left to clear"
    );
    git.snapshot(&tree, None, "second", refname).unwrap();
    // Only keel's own refs.
    assert!(git.clear_ref_lock("refs/heads/main").is_err());
}

/// The commit keel wrote, checked by git: `fsck` finds nothing wrong with it, and git's own
/// `commit-tree` of the same tree, parent, message and time names the very same object.
fn assert_git_would_have_written(repo: &Repo, commit: &str, tree: &str, parent: Option<&str>) {
    use std::io::Write;
    let fsck = repo.git_output(&["fsck", "--strict", "--no-dangling"]);
    assert!(
        fsck.status.success(),
        "git fsck: {}",
        String::from_utf8_lossy(&fsck.stderr)
    );
    let stored = repo.git_output(&["cat-file", "commit", commit]).stdout;
    let split = stored.windows(2).position(|w| w == b"\n\n").unwrap();
    let (headers, message) = (
        String::from_utf8_lossy(&stored[..split]),
        &stored[split + 2..],
    );
    let time = headers
        .lines()
        .find_map(|line| line.strip_prefix("committer keel <keel@localhost> "))
        .expect("a committer line");
    let mut command = common::git_command(repo.path());
    command
        .args(["commit-tree", tree])
        .env("GIT_AUTHOR_NAME", "keel")
        .env("GIT_AUTHOR_EMAIL", "keel@localhost")
        .env("GIT_COMMITTER_NAME", "keel")
        .env("GIT_COMMITTER_EMAIL", "keel@localhost")
        .env("GIT_AUTHOR_DATE", time)
        .env("GIT_COMMITTER_DATE", time)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped());
    if let Some(parent) = parent {
        command.args(["-p", parent]);
    }
    let mut child = command.spawn().unwrap();
    child.stdin.take().unwrap().write_all(message).unwrap();
    let out = child.wait_with_output().unwrap();
    assert_eq!(String::from_utf8(out.stdout).unwrap().trim(), commit);
}

#[test]
fn a_snapshot_keel_writes_itself_is_the_commit_git_would_write() {
    let repo = Repo::with_commit(&[("a.txt", "a\n")]);
    let git = repo.open(&[]);
    repo.write("b.txt", "b\n");
    let tree = git.worktree_tree().unwrap();
    let head = git.head().unwrap().unwrap();
    for (message, refname, parent) in [
        (
            "keel: run r checkpoint 0",
            "refs/keel/r/0",
            Some(head.as_str()),
        ),
        ("two lines\nof message\n", "refs/keel/r/1", None),
    ] {
        let commit = git.snapshot(&tree, parent, message, refname).unwrap();
        assert_eq!(repo.git(&["rev-parse", refname]), commit);
        assert!(
            repo.git_output(&["cat-file", "commit", &commit])
                .stdout
                .ends_with(message.as_bytes()),
            "the message is kept byte for byte"
        );
        assert_git_would_have_written(&repo, &commit, &tree, parent);
    }
    // Its parent packed, as in a clone: found in the pack index.
    repo.git(&["gc", "-q", "--prune=now"]);
    assert!(
        !repo
            .path()
            .join(".git/objects")
            .join(&head[..2])
            .join(&head[2..])
            .exists()
    );
    let commit = git
        .snapshot(&tree, Some(&head), "after gc", "refs/keel/r/2")
        .unwrap();
    assert_git_would_have_written(&repo, &commit, &tree, Some(&head));
    assert_eq!(repo.git(&["rev-parse", &format!("{commit}^1")]), head);
}

#[test]
fn a_snapshot_keeps_a_reflog_when_the_repository_asks_for_every_ref_to_have_one() {
    let repo = Repo::with_commit(&[("a.txt", "a\n")]);
    repo.git(&["config", "core.logAllRefUpdates", "always"]);
    let git = repo.open(&[]);
    let tree = repo.head_tree();
    git.snapshot(&tree, None, "one", "refs/keel/r/0").unwrap();
    assert_eq!(
        repo.git(&["reflog", "show", "--format=%gs", "refs/keel/r/0"]),
        "keel: snapshot"
    );
}

#[test]
fn a_snapshot_under_a_name_a_packed_ref_holds_as_a_directory_fails_with_gits_message() {
    let repo = Repo::with_commit(&[("a.txt", "a\n")]);
    let head = repo.git(&["rev-parse", "HEAD"]);
    repo.git(&["update-ref", "refs/keel/r", &head]);
    repo.git(&["pack-refs", "--all", "--prune"]);
    let git = repo.open(&[]);
    let err = git
        .snapshot(&repo.head_tree(), None, "x", "refs/keel/r/1")
        .unwrap_err();
    assert!(
        matches!(&err, GitError::Failed { command, .. } if command.contains("update-ref")),
        "{err:?}"
    );
    assert_eq!(repo.git(&["rev-parse", "refs/keel/r"]), head);
}

#[test]
fn a_snapshot_in_a_sha256_repository_is_written_by_git() {
    let repo = Repo::new();
    repo.git(&["init", "-q", "--object-format=sha256", "sub"]);
    let sub = repo.path().join("sub");
    std::fs::write(sub.join("a.txt"), "a\n").unwrap();
    let git = Git::open(&sub, &[]).unwrap();
    let tree = git.worktree_tree().unwrap();
    assert_eq!(tree.len(), 64);
    let commit = git.snapshot(&tree, None, "x", "refs/keel/r/0").unwrap();
    assert_eq!(commit.len(), 64);
    assert_eq!(git.resolve("refs/keel/r/0").unwrap(), Some(commit));
}

/// Object files in the repository: loose objects and packs.
fn object_files(repo: &Repo) -> Vec<String> {
    let mut found = Vec::new();
    let objects = repo.path().join(".git/objects");
    for dir in std::fs::read_dir(&objects).unwrap() {
        let dir = dir.unwrap().path();
        for file in std::fs::read_dir(&dir).unwrap() {
            found.push(file.unwrap().path().display().to_string());
        }
    }
    found.sort();
    found
}

#[test]
fn a_snapshot_of_its_parents_own_tree_is_the_parent_and_writes_no_object() {
    let repo = Repo::with_commit(&[("a.txt", "a\n")]);
    let git = repo.open(&[]);
    let tree = git.worktree_tree().unwrap();
    let head = git.head().unwrap().unwrap();
    let before = object_files(&repo);

    // Loose, as a commit made here is.
    let commit = git
        .snapshot(
            &tree,
            Some(&head),
            "keel: run r checkpoint 0",
            "refs/keel/r/0",
        )
        .unwrap();
    assert_eq!(commit, head);
    assert_eq!(repo.git(&["rev-parse", "refs/keel/r/0"]), head);
    assert_eq!(object_files(&repo), before, "no object was written");

    // Packed, as in a clone.
    repo.git(&["gc", "-q", "--prune=now"]);
    let packed = object_files(&repo);
    let commit = git
        .snapshot(
            &tree,
            Some(&head),
            "keel: run r checkpoint 1",
            "refs/keel/r/1",
        )
        .unwrap();
    assert_eq!(commit, head);
    assert_eq!(repo.git(&["rev-parse", "refs/keel/r/1"]), head);
    assert_eq!(object_files(&repo), packed, "no object was written");

    // Where git writes snapshots (a reflog for every ref), it is asked the parent's tree.
    repo.git(&["config", "core.logAllRefUpdates", "always"]);
    let commit = git
        .snapshot(
            &tree,
            Some(&head),
            "keel: run r checkpoint 2",
            "refs/keel/r/2",
        )
        .unwrap();
    assert_eq!(commit, head);
    assert_eq!(repo.git(&["rev-parse", "refs/keel/r/2"]), head);
    assert_eq!(object_files(&repo), packed, "no object was written");

    // One changed file later, the snapshot is a commit of its own again, on the parent.
    repo.write("a.txt", "b\n");
    let changed = git.worktree_tree().unwrap();
    let commit = git
        .snapshot(
            &changed,
            Some(&head),
            "keel: run r checkpoint 3",
            "refs/keel/r/3",
        )
        .unwrap();
    assert_ne!(commit, head);
    assert_eq!(repo.git(&["rev-parse", &format!("{commit}^1")]), head);
    assert_eq!(
        repo.git(&["rev-parse", &format!("{commit}^{{tree}}")]),
        changed
    );
}

#[test]
fn a_snapshot_that_writes_a_commit_syncs_it_to_the_disk_and_one_of_an_unchanged_tree_does_not() {
    let repo = Repo::with_commit(&[("a.txt", "a\n")]);
    let git = repo.open(&[]);
    let head = git.head().unwrap().unwrap();
    let clean = git.worktree_tree().unwrap();
    // Building the tree syncs what it wrote (see tests/treecache.rs); counted from here.
    let built = git.object_syncs();
    let same = git
        .snapshot(&clean, Some(&head), "unchanged", "refs/keel/r/0")
        .unwrap();
    assert_eq!(same, head, "an unchanged tree's snapshot is its parent");
    assert_eq!(git.object_syncs(), built, "nothing new to put on the disk");

    repo.write("a.txt", "changed\n");
    let tree = git.worktree_tree().unwrap();
    let built = git.object_syncs();
    let commit = git
        .snapshot(&tree, Some(&head), "changed", "refs/keel/r/1")
        .unwrap();
    assert_ne!(commit, head);
    assert_eq!(
        git.object_syncs(),
        built + 1,
        "the new commit and its ref are synced"
    );
    // A root snapshot is a new commit too.
    git.snapshot(&tree, None, "root", "refs/keel/r/2").unwrap();
    assert_eq!(
        git.clone().object_syncs(),
        built + 2,
        "clones share the count"
    );
}

#[test]
fn a_pinned_tree_survives_git_gc_and_an_unpinned_one_does_not() {
    let repo = Repo::with_commit(&[("a.txt", "a\n")]);
    let git = repo.open(&[]);
    repo.write("a.txt", "pinned\n");
    let pinned = git.worktree_tree().unwrap();
    git.pin("refs/keel/r/pin/step", &pinned).unwrap();
    repo.write("a.txt", "not pinned\n");
    let loose = git.worktree_tree().unwrap();
    repo.remove("a.txt");
    repo.git(&["gc", "--quiet", "--prune=now"]);
    let exists = |id: &str| repo.git_output(&["cat-file", "-e", id]).status.success();
    assert!(exists(&pinned), "the pinned tree is kept");
    assert!(
        !exists(&loose),
        "a tree nothing names is pruned (what the pin is for)"
    );
    assert_eq!(repo.git(&["rev-parse", "refs/keel/r/pin/step"]), pinned);
    // gc packed the ref; pinning it again elsewhere still moves it.
    git.pin("refs/keel/r/pin/step", &repo.head_tree()).unwrap();
    assert_eq!(
        repo.git(&["rev-parse", "refs/keel/r/pin/step"]),
        repo.head_tree()
    );
}

#[test]
fn a_pin_already_in_place_writes_nothing_and_only_keels_refs_are_pinned() {
    let repo = Repo::with_commit(&[("a.txt", "a\n")]);
    let git = repo.open(&[]);
    let tree = git.worktree_tree().unwrap();
    git.pin("refs/keel/r/pin/step", &tree).unwrap();
    let file = repo.path().join(".git/refs/keel/r/pin/step");
    let written = std::fs::metadata(&file).unwrap();
    use std::os::unix::fs::MetadataExt;
    // Again through this value (its memory), and through a new one (the ref's file).
    git.pin("refs/keel/r/pin/step", &tree).unwrap();
    repo.open(&[]).pin("refs/keel/r/pin/step", &tree).unwrap();
    let now = std::fs::metadata(&file).unwrap();
    assert_eq!(
        (now.ino(), now.mtime_nsec()),
        (written.ino(), written.mtime_nsec())
    );

    // A snapshot's tree is kept by the snapshot's ref: no pin of it is written.
    repo.write("a.txt", "snapshot\n");
    let snapshot_tree = git.worktree_tree().unwrap();
    git.snapshot(&snapshot_tree, None, "s", "refs/keel/r/0")
        .unwrap();
    git.pin("refs/keel/r/pin/call", &snapshot_tree).unwrap();
    assert!(!repo.path().join(".git/refs/keel/r/pin/call").exists());

    for refname in ["refs/heads/main", "HEAD", "refs/keel/../heads/main"] {
        let err = git.pin(refname, &tree).unwrap_err();
        assert!(
            matches!(err, GitError::InvalidArgument { .. }),
            "{refname}: {err}"
        );
    }
    let err = git.pin("refs/keel/r/pin/step", "-q").unwrap_err();
    assert!(matches!(err, GitError::InvalidArgument { .. }), "{err}");
}
