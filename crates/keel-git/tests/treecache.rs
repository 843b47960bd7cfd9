//! A working-tree tree answered without git when nothing it was built from has changed, and
//! built again by git after every kind of change. A test binary of its own, its tests one at a
//! time: they count git processes, which are counted per process.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::Path;
use std::time::Duration;

use common::{Repo, counted, one_at_a_time};
use keel_git::Git;

/// The tree and the number of git processes asking for it started.
fn asked(git: &Git) -> (String, u64) {
    counted(|| git.worktree_tree().unwrap())
}

/// Waits until the file system's clock has moved on by a tick since everything written so far,
/// so that no stamp of it can be mistaken for one taken in the same tick as the next survey.
fn settle(repo: &Repo) {
    let probe = |n: u32| {
        let path = repo.path().join(format!(".git/settle-{n}"));
        std::fs::write(&path, "").unwrap();
        let modified = std::fs::metadata(&path).unwrap().modified().unwrap();
        std::fs::remove_file(&path).unwrap();
        modified
    };
    let start = probe(0);
    for n in 1.. {
        std::thread::sleep(Duration::from_millis(2));
        if probe(n) > start {
            return;
        }
    }
}

/// The tree git itself builds of the working tree now, from nothing: HEAD's tree in a new
/// index, `add -A`, `write-tree`.
fn built_by_git(repo: &Repo) -> String {
    let index = repo.path().join(".git/fixture-index");
    let _ = std::fs::remove_file(&index);
    let run = |args: &[&str]| {
        let out = common::git_command(repo.path())
            .env("GIT_INDEX_FILE", &index)
            .args(args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap().trim().to_string()
    };
    if repo
        .git_output(&["rev-parse", "-q", "--verify", "HEAD"])
        .status
        .success()
    {
        run(&["read-tree", "HEAD"]);
    }
    run(&["add", "-A"]);
    let tree = run(&["write-tree"]);
    std::fs::remove_file(&index).unwrap();
    tree
}

/// Asks until the answer is kept (a tree built from files stamped in the same tick as its
/// survey is not), then checks that the next answer starts no process.
fn kept(repo: &Repo, git: &Git) -> String {
    settle(repo);
    let (tree, _) = asked(git);
    let (again, started) = asked(git);
    assert_eq!(
        (again.as_str(), started),
        (tree.as_str(), 0),
        "kept after a settled survey"
    );
    tree
}

#[test]
fn an_unchanged_working_tree_is_answered_without_a_process() {
    let _serial = one_at_a_time();
    let repo = Repo::with_commit(&[("a.txt", "a\n"), ("src/b.rs", "fn b() {}\n")]);
    repo.write("untracked.txt", "u\n");
    let git = repo.open(&[]);
    let tree = kept(&repo, &git);
    assert_eq!(tree, built_by_git(&repo));
    // Another handle on the same repository (as a run started later in the same process has)
    // gets the kept answer too.
    let (again, started) = asked(&repo.open(&[]));
    assert_eq!((again, started), (tree, 0));
}

#[test]
fn a_tree_git_builds_is_synced_to_the_disk_and_a_kept_one_is_not() {
    let _serial = one_at_a_time();
    let repo = Repo::with_commit(&[("a.txt", "a\n")]);
    repo.write("b.txt", "b\n");
    let git = repo.open(&[]);
    settle(&repo);
    let (tree, started) = asked(&git);
    assert!(started > 0, "built by git");
    assert_eq!(
        git.object_syncs(),
        1,
        "its new blob and tree are put on the disk before a step's event can name them"
    );
    let (again, started) = asked(&git);
    assert_eq!((again.as_str(), started), (tree.as_str(), 0));
    assert_eq!(
        git.object_syncs(),
        1,
        "a tree proven unchanged writes nothing"
    );

    repo.write("b.txt", "changed\n");
    settle(&repo);
    let (changed, started) = asked(&git);
    assert!(started > 0);
    assert_ne!(changed, tree);
    assert_eq!(git.clone().object_syncs(), 2, "clones share the count");
}

#[test]
fn every_kind_of_change_is_seen_and_then_kept() {
    let _serial = one_at_a_time();
    let outside = tempfile::tempdir().unwrap();
    let global_ignore = outside.path().join("ignore");
    std::fs::write(&global_ignore, "").unwrap();
    let repo = Repo::with_commit(&[
        ("a.txt", "aaaa\n"),
        ("dir/b.txt", "bbbb\n"),
        ("dir/c.dat", "one\r\ntwo\r\n"),
        (".gitignore", "*.log\n"),
    ]);
    repo.write("free.txt", "untracked\n");
    for name in ["u1.txt", "u2.txt", "u3.txt"] {
        repo.write(name, "untracked\n");
    }
    repo.git(&[
        "config",
        "core.excludesFile",
        global_ignore.to_str().unwrap(),
    ]);
    #[cfg(unix)]
    std::os::unix::fs::symlink("a.txt", repo.file("link")).unwrap();
    let git = repo.open(&[]);

    type Change<'a> = (&'a str, Box<dyn Fn() + 'a>);
    let changes: Vec<Change> = vec![
        (
            "same-size content",
            Box::new(|| repo.write("a.txt", "AAAA\n")),
        ),
        (
            "executable bit",
            Box::new(|| common::set_executable(&repo.file("dir/b.txt"), true)),
        ),
        (
            "new untracked file",
            Box::new(|| repo.write("dir/new/n.txt", "n\n")),
        ),
        ("deleted file", Box::new(|| repo.remove("dir/new/n.txt"))),
        (
            "rename",
            Box::new(|| std::fs::rename(repo.file("free.txt"), repo.file("dir/free.txt")).unwrap()),
        ),
        (
            "symlink pointed elsewhere",
            Box::new(|| {
                repo.remove("link");
                std::os::unix::fs::symlink("b.txt", repo.file("link")).unwrap();
            }),
        ),
        (
            "new ignored file",
            Box::new(|| repo.write("noise.log", "x\n")),
        ),
        (
            "a .gitignore that now ignores an untracked file",
            Box::new(|| repo.write(".gitignore", "*.log\nu1.txt\n")),
        ),
        (
            "the repository's exclude file",
            Box::new(|| repo.write(".git/info/exclude", "u2.txt\n")),
        ),
        (
            "the global ignore file",
            Box::new(|| std::fs::write(&global_ignore, "u3.txt\n").unwrap()),
        ),
        (
            // The file is written again (same bytes, new stamps), as an editor's save or a
            // checkout does, so that every way of building the tree hashes it under the new
            // rule. With the rule alone, whether git hashes the unchanged file again depends on
            // the stamps its index holds for it (a `git add` from a copy of the user's index
            // may keep the blob as committed, one from HEAD's tree alone converts it): the
            // reference below, built from HEAD's tree alone, once differed from keel's answer
            // under load.
            "an attribute that converts line endings, and the file it converts written again",
            Box::new(|| {
                repo.write(".gitattributes", "*.dat text\n");
                repo.write("dir/c.dat", "one\r\ntwo\r\n");
            }),
        ),
        (
            // Only HEAD moves: the ignored file was there all along, untouched.
            "a commit that tracks an ignored file",
            Box::new(|| {
                repo.git(&["add", "-f", "noise.log"]);
                repo.git(&["commit", "-q", "-m", "track a log"]);
            }),
        ),
        (
            "the ignored tracked file changed, same size",
            Box::new(|| std::fs::write(repo.file("noise.log"), "y\n").unwrap()),
        ),
        (
            "a file replaced by another of the same size and times",
            Box::new(|| {
                let old = std::fs::metadata(repo.file("a.txt")).unwrap();
                repo.write("tmp-a", "BBBB\n");
                let file = std::fs::File::options()
                    .write(true)
                    .open(repo.file("tmp-a"))
                    .unwrap();
                file.set_modified(old.modified().unwrap()).unwrap();
                std::fs::rename(repo.file("tmp-a"), repo.file("a.txt")).unwrap();
            }),
        ),
        (
            "content changed in place with the old modification time put back",
            Box::new(|| {
                let path = repo.file("dir/b.txt");
                let old = std::fs::metadata(&path).unwrap().modified().unwrap();
                std::fs::write(&path, "BBBB\n").unwrap();
                let file = std::fs::File::options().write(true).open(&path).unwrap();
                file.set_modified(old).unwrap();
            }),
        ),
        (
            "the repository's configuration",
            Box::new(|| {
                repo.git(&["config", "core.fileMode", "false"]);
            }),
        ),
    ];
    let mut last = kept(&repo, &git);
    assert_eq!(last, built_by_git(&repo));
    for (what, change) in &changes {
        change();
        let (tree, started) = asked(&git);
        assert!(started > 0, "{what}: git builds the tree again");
        assert_eq!(tree, built_by_git(&repo), "{what}: the tree git builds");
        let now = kept(&repo, &git);
        assert_eq!(now, tree, "{what}");
        if !what.starts_with("new ignored") && !what.starts_with("the repository's config") {
            assert_ne!(now, last, "{what}: the change is in the tree");
        }
        last = now;
    }
}

#[test]
fn a_same_size_change_right_after_an_answer_is_seen() {
    let _serial = one_at_a_time();
    let repo = Repo::with_commit(&[("a.txt", "0\n")]);
    let git = repo.open(&[]);
    // No settling: each change comes within a tick or two of the survey before it.
    for n in 0..40 {
        repo.write("a.txt", &format!("{}\n", n % 10));
        let (tree, _) = asked(&git);
        assert_eq!(tree, built_by_git(&repo), "change {n}");
        std::fs::write(repo.file("a.txt"), format!("{}\n", (n + 5) % 10)).unwrap();
        let (tree, _) = asked(&git);
        assert_eq!(tree, built_by_git(&repo), "change {n}, in place");
    }
}

#[test]
fn changes_under_an_excluded_path_do_not_cost_a_process() {
    let _serial = one_at_a_time();
    let repo = Repo::with_commit(&[("a.txt", "a\n")]);
    repo.write(".keel/keel.db", "store\n");
    let git = repo.open(&[".keel"]);
    let tree = kept(&repo, &git);
    repo.write(".keel/keel.db", "store, longer now\n");
    repo.write(".keel/tmp/out", "x\n");
    let (again, started) = asked(&git);
    assert_eq!((again, started), (tree, 0));
}

#[test]
fn a_repository_inside_the_working_tree_is_asked_of_git_every_time() {
    let _serial = one_at_a_time();
    let repo = Repo::with_commit(&[("a.txt", "a\n")]);
    let nested = repo.path().join("inner");
    std::fs::create_dir(&nested).unwrap();
    let inner = |args: &[&str]| {
        let out = common::git_command(&nested).args(args).output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    inner(&["init", "-q"]);
    std::fs::write(nested.join("f"), "1\n").unwrap();
    inner(&["add", "f"]);
    inner(&["commit", "-q", "-m", "one"]);
    let git = repo.open(&[]);
    settle(&repo);
    let (first, _) = asked(&git);
    let (_, started) = asked(&git);
    assert!(started > 0, "never kept");
    // The nested repository's HEAD moves without a change its directory's stamps would show.
    inner(&["commit", "-q", "--allow-empty", "-m", "two"]);
    let (second, _) = asked(&git);
    assert_ne!(first, second);
    assert_eq!(second, built_by_git(&repo));
}

#[test]
fn a_working_tree_too_large_to_survey_is_asked_of_git_every_time() {
    let _serial = one_at_a_time();
    let repo = Repo::with_commit(&[("a.txt", "a\n"), (".gitignore", "build/\n")]);
    let build = repo.path().join("build");
    std::fs::create_dir(&build).unwrap();
    for n in 0..20_001 {
        std::fs::write(build.join(n.to_string()), "").unwrap();
    }
    let git = repo.open(&[]);
    settle(&repo);
    for _ in 0..3 {
        let (tree, started) = asked(&git);
        assert!(started > 0);
        assert_eq!(tree, repo.head_tree());
    }
}

#[test]
fn a_kept_tree_that_was_pruned_is_built_again() {
    let _serial = one_at_a_time();
    let repo = Repo::with_commit(&[("a.txt", "a\n")]);
    repo.write("b.txt", "b\n");
    let git = repo.open(&[]);
    let tree = kept(&repo, &git);
    let object = repo
        .path()
        .join(".git/objects")
        .join(&tree[..2])
        .join(&tree[2..]);
    std::fs::remove_file(&object).unwrap();
    let (again, started) = asked(&git);
    assert!(started > 0);
    assert_eq!(again, tree);
    assert!(Path::new(&object).exists(), "written again");
}

#[test]
fn a_process_keeps_the_trees_of_a_bounded_number_of_working_trees() {
    let _serial = one_at_a_time();
    let repos: Vec<Repo> = (0..40)
        .map(|i| Repo::with_commit(&[("a.txt", &format!("{i}\n"))]))
        .collect();
    let gits: Vec<Git> = repos.iter().map(|r| r.open(&[])).collect();
    settle(&repos[39]);
    for git in &gits {
        asked(git);
    }
    let again: Vec<u64> = gits.iter().map(|git| asked(git).1).collect();
    let answered = again.iter().filter(|started| **started == 0).count();
    assert!(
        (1..=32).contains(&answered),
        "{answered} of 40 answered from a kept tree: {again:?}"
    );
}

#[test]
fn threads_asking_at_once_wait_for_one_build() {
    let _serial = one_at_a_time();
    let files = [("a.txt", "a\n"), ("src/b.rs", "fn b() {}\n")];
    // What one build costs.
    let alone = Repo::with_commit(&files);
    let git = alone.open(&[]);
    settle(&alone);
    let (tree, one_build) = asked(&git);
    assert!(one_build > 0);

    let repo = Repo::with_commit(&files);
    let git = repo.open(&[]);
    settle(&repo);
    let barrier = std::sync::Barrier::new(8);
    let (trees, started) = counted(|| {
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..8)
                .map(|_| {
                    s.spawn(|| {
                        barrier.wait();
                        git.worktree_tree().unwrap()
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap())
                .collect::<Vec<_>>()
        })
    });
    assert!(trees.iter().all(|t| *t == tree), "{trees:?}");
    assert_eq!(started, one_build, "eight threads, one build");
    assert_eq!(asked(&git), (tree, 0), "and it is kept");
}
