//! `Git::worktree_tree`: the tree id of the working tree as it is on disk.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::Repo;

#[test]
fn a_clean_checkout_has_the_tree_of_head() {
    let repo = Repo::with_commit(&[("a.txt", "a\n"), ("src/b.rs", "fn b() {}\n")]);
    let git = repo.open(&[]);
    assert_eq!(git.worktree_tree().unwrap(), repo.head_tree());
}

#[test]
fn the_tree_changes_when_a_tracked_file_changes() {
    let repo = Repo::with_commit(&[("a.txt", "a\n"), ("src/b.rs", "fn b() {}\n")]);
    let git = repo.open(&[]);
    let before = git.worktree_tree().unwrap();
    repo.write("src/b.rs", "fn b() { changed() }\n");
    let after = git.worktree_tree().unwrap();
    assert_ne!(before, after);
    assert_eq!(
        repo.git(&["cat-file", "-p", &format!("{after}:src/b.rs")]),
        "fn b() { changed() }"
    );
}

#[test]
fn the_tree_changes_when_an_untracked_file_appears() {
    let repo = Repo::with_commit(&[("a.txt", "a\n")]);
    let git = repo.open(&[]);
    let before = git.worktree_tree().unwrap();
    repo.write("new/untracked.txt", "new\n");
    let after = git.worktree_tree().unwrap();
    assert_ne!(before, after);
    assert!(
        repo.ls_tree(&after)
            .contains(&"100644 new/untracked.txt".to_string())
    );
}

#[test]
fn a_deleted_tracked_file_is_absent_from_the_tree() {
    let repo = Repo::with_commit(&[("a.txt", "a\n"), ("b.txt", "b\n")]);
    let git = repo.open(&[]);
    repo.remove("b.txt");
    let tree = git.worktree_tree().unwrap();
    assert_eq!(repo.ls_tree(&tree), ["100644 a.txt"]);
}

#[test]
fn an_ignored_file_does_not_change_the_tree() {
    let repo = Repo::with_commit(&[("a.txt", "a\n"), (".gitignore", "*.log\ntarget/\n")]);
    let git = repo.open(&[]);
    let before = git.worktree_tree().unwrap();
    repo.write("debug.log", "noise\n");
    repo.write("target/debug/out", "binary\n");
    assert_eq!(git.worktree_tree().unwrap(), before);
}

#[test]
fn an_excluded_path_does_not_change_the_tree() {
    let repo = Repo::with_commit(&[("a.txt", "a\n")]);
    let git = repo.open(&[".keel", "var/state/"]);
    let before = git.worktree_tree().unwrap();
    repo.write(".keel/keel.db", "db\n");
    repo.write("var/state/lock", "1\n");
    assert_eq!(git.worktree_tree().unwrap(), before);
    // A sibling with the same prefix is not excluded.
    repo.write(".keelish", "mine\n");
    assert_ne!(git.worktree_tree().unwrap(), before);
}

#[test]
fn an_excluded_path_committed_to_head_is_left_out_of_the_tree() {
    let repo = Repo::with_commit(&[("a.txt", "a\n"), (".keel/config", "committed\n")]);
    let git = repo.open(&[".keel"]);
    let tree = git.worktree_tree().unwrap();
    assert_eq!(repo.ls_tree(&tree), ["100644 a.txt"]);
}

#[test]
fn an_excluded_path_staged_in_the_users_index_or_nested_is_left_out_of_the_tree() {
    let repo = Repo::with_commit(&[("a.txt", "a\n"), ("var/state/kept", "committed\n")]);
    repo.write(".keel/staged", "staged\n");
    repo.git(&["add", "-f", ".keel/staged"]);
    let git = repo.open(&[".keel", "var/state"]);
    let tree = git.worktree_tree().unwrap();
    assert_eq!(repo.ls_tree(&tree), ["100644 a.txt"]);
    let (again, head) = git.worktree_tree_and_head().unwrap();
    assert_eq!(again, tree);
    assert_eq!(head, git.head().unwrap());
}

#[test]
fn the_users_index_and_status_are_left_byte_identical() {
    let repo = Repo::with_commit(&[("a.txt", "a\n"), ("b.txt", "b\n"), ("c.txt", "c\n")]);
    // Staged, unstaged, deleted and untracked changes, so the index differs from HEAD and from
    // the working tree.
    repo.write("a.txt", "staged\n");
    repo.git(&["add", "a.txt"]);
    repo.write("a.txt", "staged then edited\n");
    repo.write("b.txt", "unstaged\n");
    repo.remove("c.txt");
    repo.write("new.txt", "untracked\n");
    repo.write("staged-new.txt", "staged new\n");
    repo.git(&["add", "staged-new.txt"]);
    let index = repo.index_bytes();
    let status = repo.status();

    let git = repo.open(&[]);
    let tree = git.worktree_tree().unwrap();

    assert_eq!(repo.index_bytes(), index);
    assert_eq!(repo.status(), status);
    assert_eq!(repo.leftover_temp_indexes(), Vec::<String>::new());
    assert_eq!(
        repo.ls_tree(&tree),
        [
            "100644 a.txt",
            "100644 b.txt",
            "100644 new.txt",
            "100644 staged-new.txt"
        ]
    );
    assert_eq!(
        repo.git(&["cat-file", "-p", &format!("{tree}:a.txt")]),
        "staged then edited"
    );
}

#[test]
fn a_change_to_an_assume_unchanged_file_is_seen() {
    let repo = Repo::with_commit(&[("config.toml", "a = 1\n")]);
    repo.git(&["update-index", "--assume-unchanged", "config.toml"]);
    repo.write("config.toml", "a = 2\n");
    let git = repo.open(&[]);
    let tree = git.worktree_tree().unwrap();
    assert_ne!(tree, repo.head_tree());
    assert_eq!(
        repo.git(&["cat-file", "-p", &format!("{tree}:config.toml")]),
        "a = 2"
    );
}

#[test]
fn a_same_size_change_right_after_a_commit_is_seen() {
    // The user's index has stat data for the file; a change of the same size within the same
    // second must still be noticed (git's racy-clean handling must survive our index copy).
    let repo = Repo::with_commit(&[("a.txt", "aaaa\n")]);
    let git = repo.open(&[]);
    repo.write("a.txt", "bbbb\n");
    let tree = git.worktree_tree().unwrap();
    assert_eq!(
        repo.git(&["cat-file", "-p", &format!("{tree}:a.txt")]),
        "bbbb"
    );
}

#[test]
fn an_unborn_repository_has_a_tree_of_its_files() {
    let repo = Repo::new();
    repo.write("a.txt", "a\n");
    repo.write("src/b.rs", "b\n");
    let git = repo.open(&[]);
    let tree = git.worktree_tree().unwrap();
    assert_eq!(repo.ls_tree(&tree), ["100644 a.txt", "100644 src/b.rs"]);
    assert_eq!(git.head().unwrap(), None);
    assert_eq!(repo.status(), "?? a.txt\n?? src/b.rs");
}

#[test]
fn an_empty_unborn_repository_has_the_empty_tree() {
    let repo = Repo::new();
    let git = repo.open(&[]);
    assert_eq!(git.worktree_tree().unwrap(), git.empty_tree().unwrap());
}

#[test]
fn the_tree_covers_the_whole_repository_when_opened_from_a_subdirectory() {
    let repo = Repo::with_commit(&[("top.txt", "t\n"), ("sub/a.txt", "a\n")]);
    repo.write("other/new.txt", "n\n");
    let git = keel_git::Git::open(&repo.file("sub"), &[".keel".to_string()]).unwrap();
    repo.write(".keel/db", "x\n");
    let tree = git.worktree_tree().unwrap();
    assert_eq!(
        repo.ls_tree(&tree),
        ["100644 other/new.txt", "100644 sub/a.txt", "100644 top.txt"]
    );
}

#[cfg(unix)]
#[test]
fn executable_bits_and_symlinks_are_recorded() {
    let repo = Repo::with_commit(&[("run.sh", "#!/bin/sh\n"), ("plain.txt", "p\n")]);
    common::set_executable(&repo.file("run.sh"), true);
    std::os::unix::fs::symlink("plain.txt", repo.file("link")).unwrap();
    let git = repo.open(&[]);
    let tree = git.worktree_tree().unwrap();
    assert_eq!(
        repo.ls_tree(&tree),
        ["120000 link", "100644 plain.txt", "100755 run.sh"]
    );
}

#[test]
fn paths_with_spaces_and_non_ascii_are_recorded_verbatim() {
    let repo = Repo::with_commit(&[("a.txt", "a\n")]);
    repo.write("dir with space/ファイル é.txt", "unicode\n");
    repo.write("tab\there", "tab\n");
    let git = repo.open(&[]);
    let tree = git.worktree_tree().unwrap();
    assert_eq!(
        repo.ls_tree(&tree),
        [
            "100644 a.txt",
            "100644 dir with space/ファイル é.txt",
            "100644 tab\there"
        ]
    );
}

#[test]
fn a_linked_worktree_has_its_own_head_tree_and_index_and_shares_snapshot_refs() {
    let repo = Repo::with_commit(&[("a.txt", "a\n")]);
    let parent = tempfile::tempdir().unwrap();
    let linked = parent.path().join("linked");
    repo.git(&[
        "worktree",
        "add",
        "-q",
        "-b",
        "side",
        linked.to_str().unwrap(),
    ]);
    std::fs::write(linked.join("a.txt"), "side work\n").unwrap();

    let git = keel_git::Git::open(&linked, &[]).unwrap();
    assert_eq!(git.branch().unwrap(), Some("side".to_string()));
    let tree = git.worktree_tree().unwrap();
    assert_ne!(tree, repo.head_tree());
    let commit = git
        .snapshot(&tree, None, "s", "refs/keel/linked/1")
        .unwrap();
    assert_eq!(repo.git(&["rev-parse", "refs/keel/linked/1"]), commit);
    // A pin goes where the snapshot refs are, the common directory (through git here).
    std::fs::write(linked.join("b.txt"), "more\n").unwrap();
    let pinned = git.worktree_tree().unwrap();
    git.pin("refs/keel/linked/pinned/step", &pinned).unwrap();
    assert_eq!(
        repo.git(&["rev-parse", "refs/keel/linked/pinned/step"]),
        pinned
    );
    std::fs::remove_file(linked.join("b.txt")).unwrap();

    assert_eq!(git.restore_worktree("HEAD").unwrap(), ["a.txt"]);
    assert_eq!(
        std::fs::read_to_string(linked.join("a.txt")).unwrap(),
        "a\n"
    );
    assert_eq!(repo.status(), "", "the main working tree is untouched");
}

#[test]
fn an_excluded_path_that_is_also_ignored_does_not_break_the_tree() {
    // keel's store directory is usually in .gitignore too; naming an ignored path in an exclude
    // pathspec makes `git add` fail unless keel leaves it out.
    let repo = Repo::with_commit(&[("README.md", "hi\n"), (".gitignore", ".keel/\n")]);
    let git = repo.open(&[".keel"]);
    let clean = git.worktree_tree().unwrap();
    repo.write(".keel/keel.db", "store");
    assert_eq!(git.worktree_tree().unwrap(), clean);
    repo.write("new.txt", "x\n");
    assert_ne!(git.worktree_tree().unwrap(), clean);
}

#[test]
fn temporary_indexes_of_dead_processes_are_removed_on_open() {
    let repo = Repo::with_commit(&[("README.md", "hi\n")]);
    // pid 0 is never a process that could still use it.
    let orphan = repo.path().join(".git/keel-index-0-1-0");
    std::fs::write(&orphan, "junk").unwrap();
    let mine = repo
        .path()
        .join(format!(".git/keel-index-{}-1-0", std::process::id()));
    std::fs::write(&mine, "in use").unwrap();
    repo.open(&[]);
    assert!(
        !orphan.exists(),
        "an orphaned temporary index was left behind"
    );
    assert!(
        mine.exists(),
        "a live process's temporary index was removed"
    );
}
