//! Opening a repository and reading its facts: root, HEAD, branch, resolve, version, errors.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::Repo;
use keel_git::{Git, GitError};

#[test]
fn open_outside_a_repository_is_not_a_repository_naming_the_path() {
    let dir = tempfile::tempdir().unwrap();
    let err = Git::open(dir.path(), &[]).unwrap_err();
    assert!(
        matches!(&err, GitError::NotARepository { path } if path == dir.path()),
        "{err:?}"
    );
    let message = err.to_string();
    assert!(
        message.contains(&dir.path().display().to_string()),
        "{message}"
    );
    assert!(message.contains("git init"), "{message}");
}

#[test]
fn open_of_a_missing_directory_names_the_path() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nowhere");
    let err = Git::open(&missing, &[]).unwrap_err();
    assert!(
        matches!(&err, GitError::Io { path, .. } if *path == missing),
        "{err:?}"
    );
}

#[test]
fn open_inside_the_git_directory_or_a_bare_repository_is_no_work_tree() {
    let repo = Repo::new();
    let err = Git::open(&repo.file(".git"), &[]).unwrap_err();
    assert!(matches!(err, GitError::NoWorkTree { .. }), "{err:?}");

    let bare = tempfile::tempdir().unwrap();
    common::git_command(bare.path())
        .args(["init", "-q", "--bare"])
        .status()
        .unwrap();
    let err = Git::open(bare.path(), &[]).unwrap_err();
    assert!(matches!(err, GitError::NoWorkTree { .. }), "{err:?}");
}

#[test]
fn open_from_a_subdirectory_finds_the_top_of_the_working_tree() {
    let repo = Repo::with_commit(&[("src/deep/a.txt", "a\n")]);
    let git = Git::open(&repo.file("src/deep"), &[]).unwrap();
    assert_eq!(
        git.root().canonicalize().unwrap(),
        repo.path().canonicalize().unwrap()
    );
}

#[test]
fn open_refuses_exclude_paths_outside_the_working_tree() {
    let repo = Repo::new();
    for bad in ["/etc", "../up", "a/../../b", "", "./"] {
        let err = Git::open(repo.path(), &[bad.to_string()]).unwrap_err();
        assert!(
            matches!(err, GitError::InvalidArgument { .. }),
            "{bad:?}: {err:?}"
        );
    }
}

#[test]
fn head_is_none_and_branch_is_named_on_an_unborn_branch() {
    let repo = Repo::new();
    let git = repo.open(&[]);
    assert_eq!(git.head().unwrap(), None);
    assert_eq!(git.branch().unwrap(), Some("main".to_string()));
}

#[test]
fn head_and_branch_on_a_branch_with_commits() {
    let repo = Repo::with_commit(&[("a.txt", "a\n")]);
    repo.git(&["checkout", "-q", "-b", "feature/x"]);
    let git = repo.open(&[]);
    assert_eq!(git.head().unwrap(), Some(repo.git(&["rev-parse", "HEAD"])));
    assert_eq!(git.branch().unwrap(), Some("feature/x".to_string()));
}

#[test]
fn branch_is_none_when_head_is_detached() {
    let repo = Repo::with_commit(&[("a.txt", "a\n")]);
    let first = repo.git(&["rev-parse", "HEAD"]);
    repo.write("a.txt", "b\n");
    repo.commit_all("second");
    repo.git(&["checkout", "-q", "--detach", &first]);
    let git = repo.open(&[]);
    assert_eq!(git.head().unwrap(), Some(first));
    assert_eq!(git.branch().unwrap(), None);
}

#[test]
fn branch_and_head_are_read_right_when_refs_are_kept_in_a_reftable() {
    // The HEAD file of such a repository points at `refs/heads/.invalid`; the branch is asked
    // of git.
    let repo = Repo::new_reftable();
    let head_file = std::fs::read_to_string(repo.path().join(".git/HEAD")).unwrap();
    assert_eq!(head_file.trim(), "ref: refs/heads/.invalid");
    let git = repo.open(&[]);
    assert_eq!(git.head().unwrap(), None);
    assert_eq!(git.branch().unwrap(), Some("main".to_string()));

    repo.write("a.txt", "a\n");
    let first = repo.commit_all("first");
    repo.git(&["checkout", "-q", "-b", "feature/y"]);
    assert_eq!(git.branch().unwrap(), Some("feature/y".to_string()));
    assert_eq!(git.head().unwrap(), Some(first.clone()));
    // A snapshot never moves the checked-out branch, here either.
    let tree = git.worktree_tree().unwrap();
    assert!(
        git.snapshot(&tree, None, "s", "refs/heads/feature/y")
            .is_err()
    );
    assert_eq!(repo.git(&["rev-parse", "HEAD"]), first);
    // A pin is not a loose file in such a repository: git writes it.
    repo.write("b.txt", "b\n");
    let pinned = git.worktree_tree().unwrap();
    git.pin("refs/keel/r/pinned/step", &pinned).unwrap();
    assert_eq!(repo.git(&["rev-parse", "refs/keel/r/pinned/step"]), pinned);
    assert!(!repo.path().join(".git/refs/keel").exists());

    repo.git(&["checkout", "-q", "--detach"]);
    assert_eq!(git.branch().unwrap(), None);
}

#[test]
fn branch_follows_the_head_file_as_git_writes_it() {
    let repo = Repo::with_commit(&[("a.txt", "a\n")]);
    let git = repo.open(&[]);
    for name in ["main", "x", "nested/name", "with-dash_and.dot"] {
        if name != "main" {
            repo.git(&["checkout", "-q", "-b", name]);
        }
        assert_eq!(git.branch().unwrap(), Some(name.to_string()));
        assert_eq!(
            repo.git(&["symbolic-ref", "--short", "HEAD"]),
            name,
            "git agrees"
        );
    }
    repo.git(&["checkout", "-q", "--detach"]);
    assert_eq!(git.branch().unwrap(), None);
    repo.git(&["checkout", "-q", "main"]);
    assert_eq!(git.branch().unwrap(), Some("main".to_string()));

    // A HEAD that is a symbolic link to the branch's file (`core.preferSymlinkRefs`, as old
    // gits wrote it) still names the branch, not the commit in that file.
    let head = repo.path().join(".git/HEAD");
    std::fs::remove_file(&head).unwrap();
    std::os::unix::fs::symlink("refs/heads/x", &head).unwrap();
    assert_eq!(git.branch().unwrap(), Some("x".to_string()));
}

#[test]
fn resolve_gives_full_ids_and_none_for_what_does_not_exist() {
    let repo = Repo::with_commit(&[("a.txt", "a\n"), ("dir with space/b c", "b\n")]);
    let git = repo.open(&[]);
    let head = repo.git(&["rev-parse", "HEAD"]);
    assert_eq!(git.resolve("HEAD").unwrap(), Some(head.clone()));
    assert_eq!(
        git.resolve("HEAD:dir with space/b c").unwrap(),
        Some(repo.git(&["rev-parse", "HEAD:dir with space/b c"]))
    );
    assert_eq!(git.resolve("HEAD:dir with space/nope").unwrap(), None);
    assert_eq!(git.resolve(&head[..12]).unwrap(), Some(head.clone()));
    assert_eq!(git.resolve("refs/heads/main").unwrap(), Some(head));
    assert_eq!(
        git.resolve("HEAD:a.txt").unwrap(),
        Some(repo.git(&["rev-parse", "HEAD:a.txt"]))
    );
    assert_eq!(git.resolve("refs/keel/run/1").unwrap(), None);
    // A well-formed id of an object that is not in the repository.
    assert_eq!(git.resolve(&"1".repeat(40)).unwrap(), None);
    // Option-looking names are names, not options.
    assert_eq!(git.resolve("--help").unwrap(), None);
    assert!(matches!(
        git.resolve("a\nb"),
        Err(GitError::InvalidArgument { .. })
    ));
}

#[test]
fn resolve_refuses_an_abbreviation_two_objects_share() {
    let repo = Repo::new();
    let git = repo.open(&[]);
    // Enough blobs that two ids share their first four digits (by the birthday bound, about
    // 300 do on average; these 1,000 fixed contents do), then the first such pair.
    let paths: Vec<String> = (0..1000).map(|i| format!("blobs/{i}")).collect();
    for (i, path) in paths.iter().enumerate() {
        repo.write(path, &format!("{i}\n"));
    }
    let mut args = vec!["hash-object", "-w", "--"];
    args.extend(paths.iter().map(String::as_str));
    let ids = repo.git(&args);
    let mut seen = std::collections::HashMap::new();
    let shared = ids
        .lines()
        .find_map(|id| {
            seen.insert(id[..4].to_string(), id.to_string())
                .map(|_| id[..4].to_string())
        })
        .expect("two of 1,000 ids share four digits");
    let error = git.resolve(&shared).unwrap_err();
    assert!(
        matches!(&error, GitError::InvalidArgument { reason, .. } if reason.contains("ambiguous")),
        "{error:?}"
    );
    // A longer prefix of one of them is that one.
    let one = &seen[&shared];
    assert_eq!(git.resolve(&one[..12]).unwrap(), Some(one.clone()));
}

#[test]
fn version_is_the_trimmed_version_line() {
    let repo = Repo::new();
    let version = repo.open(&[]).version().unwrap();
    assert!(version.starts_with("git version "), "{version:?}");
    assert_eq!(version, version.trim());
}

#[test]
fn empty_tree_is_the_id_of_the_empty_tree() {
    let repo = Repo::new();
    let git = repo.open(&[]);
    let expected = repo.git(&["hash-object", "-t", "tree", "/dev/null"]);
    assert_eq!(git.empty_tree().unwrap(), expected);
    assert_eq!(git.resolve(&expected).unwrap(), Some(expected));
}

#[test]
fn a_failing_git_command_reports_command_line_status_and_stderr() {
    let repo = Repo::with_commit(&[("a.txt", "a\n")]);
    let git = repo.open(&[]);
    let missing = "1".repeat(40);
    let err = git.diff(&missing, "HEAD").unwrap_err();
    let GitError::Failed {
        command,
        status,
        stderr,
    } = &err
    else {
        panic!("expected Failed, got {err:?}");
    };
    assert!(
        command.contains("diff-tree") && command.contains(&missing),
        "{command}"
    );
    assert!(
        command.contains(&repo.path().display().to_string()),
        "{command}"
    );
    assert!(status.contains("exit status"), "{status}");
    assert!(!stderr.is_empty());
    let message = err.to_string();
    assert!(
        message.contains(command) && message.contains(stderr),
        "{message}"
    );
}

#[test]
fn option_looking_revisions_are_refused_before_running_git() {
    let repo = Repo::with_commit(&[("a.txt", "a\n")]);
    let git = repo.open(&[]);
    assert!(matches!(
        git.diff("--output=/tmp/x", "HEAD"),
        Err(GitError::InvalidArgument { .. })
    ));
    assert!(matches!(
        git.restore_worktree("-q"),
        Err(GitError::InvalidArgument { .. })
    ));
}
