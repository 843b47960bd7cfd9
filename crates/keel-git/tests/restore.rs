//! `Git::restore_worktree`: putting the working tree's files back to a recorded tree.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::Repo;

#[test]
fn restore_undoes_modifications_deletions_and_new_files_in_subdirectories() {
    let repo = Repo::with_commit(&[
        ("top.txt", "top\n"),
        ("src/b.rs", "b\n"),
        ("src/lib/a.rs", "a\n"),
    ]);
    let git = repo.open(&[]);
    let recorded = git.worktree_tree().unwrap();

    repo.write("src/lib/a.rs", "broken by an interrupted step\n");
    repo.remove("src/b.rs");
    repo.write("src/new/deep/c.rs", "half written\n");
    repo.write("stray.txt", "stray\n");

    let changed = git.restore_worktree(&recorded).unwrap();

    assert_eq!(
        changed,
        ["src/b.rs", "src/lib/a.rs", "src/new/deep/c.rs", "stray.txt"]
    );
    assert_eq!(repo.read("src/lib/a.rs"), "a\n");
    assert_eq!(repo.read("src/b.rs"), "b\n");
    assert!(!repo.exists("src/new/deep/c.rs"));
    assert!(!repo.exists("src/new"), "emptied directories are removed");
    assert!(!repo.exists("stray.txt"));
    assert_eq!(git.worktree_tree().unwrap(), recorded);
    assert_eq!(repo.status(), "");
    assert_eq!(repo.leftover_temp_indexes(), Vec::<String>::new());
}

#[test]
fn restore_brings_back_uncommitted_work_recorded_in_a_snapshot() {
    let repo = Repo::with_commit(&[("a.txt", "a\n")]);
    let git = repo.open(&[".keel"]);
    repo.write("a.txt", "edited, not committed\n");
    repo.write("notes/new.md", "untracked work\n");
    let tree = git.worktree_tree().unwrap();
    let head = git.head().unwrap();
    let snapshot = git
        .snapshot(&tree, head.as_deref(), "before step 3", "refs/keel/r/3")
        .unwrap();

    repo.remove("notes/new.md");
    repo.write("a.txt", "step 3 went wrong\n");

    // A snapshot commit id works as well as its tree id.
    let changed = git.restore_worktree(&snapshot).unwrap();
    assert_eq!(changed, ["a.txt", "notes/new.md"]);
    assert_eq!(repo.read("a.txt"), "edited, not committed\n");
    assert_eq!(repo.read("notes/new.md"), "untracked work\n");
    assert_eq!(git.worktree_tree().unwrap(), tree);
}

#[test]
fn restore_keeps_ignored_and_excluded_files() {
    let repo = Repo::with_commit(&[("a.txt", "a\n"), (".gitignore", "*.log\nbuild/\n")]);
    repo.write("debug.log", "old log\n");
    repo.write(".keel/keel.db", "old db\n");
    let git = repo.open(&[".keel"]);
    let recorded = git.worktree_tree().unwrap();

    repo.write("a.txt", "changed\n");
    repo.write("debug.log", "new log\n");
    repo.write("build/out.o", "object\n");
    repo.write(".keel/keel.db", "new db\n");
    repo.write(".keel/artifacts/x", "artifact\n");

    let changed = git.restore_worktree(&recorded).unwrap();

    assert_eq!(changed, ["a.txt"]);
    assert_eq!(repo.read("a.txt"), "a\n");
    assert_eq!(repo.read("debug.log"), "new log\n");
    assert_eq!(repo.read("build/out.o"), "object\n");
    assert_eq!(repo.read(".keel/keel.db"), "new db\n");
    assert_eq!(repo.read(".keel/artifacts/x"), "artifact\n");
    assert_eq!(git.worktree_tree().unwrap(), recorded);
}

#[test]
fn restore_to_a_commit_with_excluded_paths_does_not_write_them() {
    let repo = Repo::with_commit(&[("a.txt", "a\n"), (".keel/config", "committed\n")]);
    let git = repo.open(&[".keel"]);
    repo.write(".keel/config", "keel's current state\n");
    repo.write("a.txt", "b\n");
    let changed = git.restore_worktree("HEAD").unwrap();
    assert_eq!(changed, ["a.txt"]);
    assert_eq!(repo.read(".keel/config"), "keel's current state\n");
}

#[test]
fn restore_does_not_move_head_or_branch_and_keeps_the_index() {
    let repo = Repo::with_commit(&[("a.txt", "a\n"), ("b.txt", "b\n")]);
    let git = repo.open(&[]);
    let recorded = git.worktree_tree().unwrap();
    repo.write("a.txt", "staged\n");
    repo.git(&["add", "a.txt"]);
    repo.write("b.txt", "unstaged\n");
    let head = repo.git(&["rev-parse", "HEAD"]);
    let index = repo.index_bytes();
    let staged = repo.git(&["ls-files", "--stage"]);

    git.restore_worktree(&recorded).unwrap();

    assert_eq!(repo.git(&["rev-parse", "HEAD"]), head);
    assert_eq!(repo.git(&["symbolic-ref", "HEAD"]), "refs/heads/main");
    assert_eq!(repo.index_bytes(), index);
    assert_eq!(repo.git(&["ls-files", "--stage"]), staged);
    // The staged change is still staged; the working tree is back to HEAD's content.
    assert_eq!(repo.read("a.txt"), "a\n");
    assert_eq!(repo.status(), "MM a.txt");
}

#[test]
fn restore_to_the_current_tree_changes_nothing() {
    let repo = Repo::with_commit(&[("a.txt", "a\n")]);
    repo.write("new.txt", "n\n");
    let git = repo.open(&[]);
    let tree = git.worktree_tree().unwrap();
    assert_eq!(git.restore_worktree(&tree).unwrap(), Vec::<String>::new());
    assert_eq!(repo.read("new.txt"), "n\n");
}

#[test]
fn restore_replaces_a_directory_with_a_file_and_back() {
    let repo = Repo::with_commit(&[("thing", "a file\n")]);
    let git = repo.open(&[]);
    let as_file = git.worktree_tree().unwrap();
    repo.remove("thing");
    repo.write("thing/inside.txt", "now a directory\n");
    let as_dir = git.worktree_tree().unwrap();

    assert_eq!(
        git.restore_worktree(&as_file).unwrap(),
        ["thing", "thing/inside.txt"]
    );
    assert_eq!(repo.read("thing"), "a file\n");

    git.restore_worktree(&as_dir).unwrap();
    assert_eq!(repo.read("thing/inside.txt"), "now a directory\n");
    assert_eq!(git.worktree_tree().unwrap(), as_dir);
}

#[test]
fn restore_to_the_empty_tree_deletes_untracked_files_only_up_to_ignored_ones() {
    let repo = Repo::new();
    repo.write(".gitignore", "*.log\n");
    repo.write("dir/a.txt", "a\n");
    repo.write("dir/keep.log", "ignored\n");
    let git = repo.open(&[]);
    let empty = git.empty_tree().unwrap();
    let changed = git.restore_worktree(&empty).unwrap();
    assert_eq!(changed, [".gitignore", "dir/a.txt"]);
    assert_eq!(repo.read("dir/keep.log"), "ignored\n");
}

#[cfg(unix)]
#[test]
fn executable_bits_and_symlinks_round_trip_through_restore() {
    let repo = Repo::with_commit(&[("run.sh", "#!/bin/sh\necho hi\n"), ("plain.txt", "p\n")]);
    common::set_executable(&repo.file("run.sh"), true);
    std::os::unix::fs::symlink("plain.txt", repo.file("link")).unwrap();
    std::os::unix::fs::symlink("../plain.txt", repo.file("sub-link")).unwrap();
    let git = repo.open(&[]);
    let recorded = git.worktree_tree().unwrap();

    common::set_executable(&repo.file("run.sh"), false);
    repo.remove("link");
    repo.write("link", "a regular file now\n");
    repo.remove("sub-link");

    let changed = git.restore_worktree(&recorded).unwrap();

    assert_eq!(changed, ["link", "run.sh", "sub-link"]);
    assert!(common::is_executable(&repo.file("run.sh")));
    assert_eq!(
        std::fs::read_link(repo.file("link")).unwrap(),
        std::path::Path::new("plain.txt")
    );
    assert_eq!(
        std::fs::read_link(repo.file("sub-link")).unwrap(),
        std::path::Path::new("../plain.txt")
    );
    assert_eq!(git.worktree_tree().unwrap(), recorded);
}

#[cfg(unix)]
#[test]
fn restore_does_not_delete_through_a_symlinked_directory() {
    let outside = tempfile::tempdir().unwrap();
    std::fs::write(outside.path().join("precious.txt"), "keep\n").unwrap();
    let repo = Repo::new();
    repo.write("dir/precious.txt", "tracked\n");
    let git = repo.open(&[]);

    // Replace the directory by a link to somewhere else: the tree now has `dir` as a symlink.
    std::fs::remove_dir_all(repo.file("dir")).unwrap();
    std::os::unix::fs::symlink(outside.path(), repo.file("dir")).unwrap();
    let empty = git.empty_tree().unwrap();
    git.restore_worktree(&empty).unwrap();

    assert_eq!(
        std::fs::read_to_string(outside.path().join("precious.txt")).unwrap(),
        "keep\n"
    );
    assert!(!repo.exists("dir"), "the symlink itself is removed");
}

#[test]
fn paths_with_spaces_and_non_ascii_round_trip_through_restore() {
    let repo = Repo::with_commit(&[("dir with space/ファイル é.txt", "original\n")]);
    let git = repo.open(&[]);
    repo.write("über café/naïve file.md", "untracked\n");
    let recorded = git.worktree_tree().unwrap();

    repo.write("dir with space/ファイル é.txt", "changed\n");
    repo.remove("über café/naïve file.md");
    repo.write("новый файл.txt", "stray\n");

    let changed = git.restore_worktree(&recorded).unwrap();

    assert_eq!(
        changed,
        [
            "dir with space/ファイル é.txt",
            "über café/naïve file.md",
            "новый файл.txt"
        ]
    );
    assert_eq!(repo.read("dir with space/ファイル é.txt"), "original\n");
    assert_eq!(repo.read("über café/naïve file.md"), "untracked\n");
    assert!(!repo.exists("новый файл.txt"));
    assert_eq!(git.worktree_tree().unwrap(), recorded);
}

#[test]
fn restore_paths_touches_only_the_named_paths() {
    let repo = Repo::with_commit(&[("keep.txt", "base\n"), ("undo.txt", "base\n")]);
    let git = repo.open(&[]);
    let base = git.worktree_tree().unwrap();
    repo.write("keep.txt", "changed and kept\n");
    repo.write("undo.txt", "changed and undone\n");
    repo.write("new-undone.txt", "new\n");
    repo.write("new-kept.txt", "new\n");
    let changed = git
        .restore_paths(
            &base,
            &["undo.txt".to_string(), "new-undone.txt".to_string()],
        )
        .unwrap();
    assert_eq!(changed, ["new-undone.txt", "undo.txt"]);
    assert_eq!(repo.read("undo.txt"), "base\n");
    assert!(!repo.exists("new-undone.txt"));
    assert_eq!(repo.read("keep.txt"), "changed and kept\n");
    assert!(repo.exists("new-kept.txt"));
}

/// Deletes the loose object `id` from the repository, as a disk that lost it or a careless
/// cleanup would.
fn lose_object(repo: &Repo, id: &str) {
    let path = repo
        .path()
        .join(".git/objects")
        .join(&id[..2])
        .join(&id[2..]);
    std::fs::remove_file(&path).unwrap_or_else(|e| panic!("{} is not loose: {e}", path.display()));
}

#[test]
fn a_restore_whose_file_objects_are_gone_says_which_and_changes_nothing() {
    let repo = Repo::with_commit(&[("a.txt", "a\n"), ("src/b.rs", "b\n")]);
    let git = repo.open(&[]);
    repo.write("src/c.rs", "only in the recorded tree\n");
    let recorded = git.worktree_tree().unwrap();
    let lost = repo.git(&["rev-parse", &format!("{recorded}:src/c.rs")]);

    repo.write("src/c.rs", "changed since\n");
    repo.write("stray.txt", "a restore deletes this\n");
    let now = git.worktree_tree().unwrap();
    assert_eq!(git.missing_for_restore(&now, &recorded).unwrap(), []);
    lose_object(&repo, &lost);

    let missing = git.missing_for_restore(&now, &recorded).unwrap();
    assert_eq!(
        missing,
        [keel_git::MissingObject {
            path: Some("src/c.rs".into()),
            id: lost.clone(),
        }]
    );
    let error = git.restore_worktree(&recorded).unwrap_err();
    assert!(
        matches!(&error, keel_git::GitError::ObjectsMissing { missing: m, .. } if *m == missing),
        "{error:?}"
    );
    let said = error.to_string();
    for part in [&recorded, "src/c.rs", &lost, "nothing was changed"] {
        assert!(said.contains(part), "`{part}` not in: {said}");
    }
    assert_eq!(repo.read("src/c.rs"), "changed since\n");
    assert!(repo.exists("stray.txt"), "nothing was deleted either");
    assert_eq!(repo.leftover_temp_indexes(), Vec::<String>::new());

    // Only the paths asked for need their objects.
    assert_eq!(
        git.restore_paths(&recorded, &["stray.txt".to_string()])
            .unwrap(),
        ["stray.txt"]
    );
    assert!(!repo.exists("stray.txt"));
}

#[test]
fn a_restore_whose_directory_object_is_gone_says_so_and_changes_nothing() {
    let repo = Repo::with_commit(&[("a.txt", "a\n")]);
    let git = repo.open(&[]);
    repo.write("deep/x/y.txt", "y\n");
    let recorded = git.worktree_tree().unwrap();
    let lost = repo.git(&["rev-parse", &format!("{recorded}:deep/x")]);

    repo.remove("deep/x/y.txt");
    repo.write("a.txt", "changed since\n");
    let now = git.worktree_tree().unwrap();
    lose_object(&repo, &lost);

    let missing = git.missing_for_restore(&now, &recorded).unwrap();
    assert!(
        missing.iter().any(|m| m.id == lost && m.path.is_none()),
        "{missing:?}"
    );
    let error = git.restore_worktree(&recorded).unwrap_err();
    let said = error.to_string();
    assert!(
        matches!(error, keel_git::GitError::ObjectsMissing { .. }),
        "{said}"
    );
    assert!(said.contains(&lost), "{said}");
    assert_eq!(repo.read("a.txt"), "changed since\n");
    assert!(!repo.exists("deep/x/y.txt"));
}
