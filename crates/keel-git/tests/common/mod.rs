//! Fixture repositories for the keel-git tests: a temporary directory and the real `git`.
//!
//! Fixture commands run with the developer's global and system configuration switched off and a
//! fixed identity, so the fixtures are the same everywhere. The library under test runs git with
//! whatever environment the test process has, as it would in keel.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use keel_git::Git;
use tempfile::TempDir;

pub struct Repo {
    dir: TempDir,
}

impl Repo {
    /// An empty repository on branch `main`.
    pub fn new() -> Repo {
        let dir = tempfile::tempdir().expect("create a temporary directory");
        let repo = Repo { dir };
        repo.git(&["init", "-q", "-b", "main"]);
        repo
    }

    /// An empty repository on branch `main` whose refs are kept in git's reftable format (its
    /// `HEAD` file is only a placeholder).
    pub fn new_reftable() -> Repo {
        let dir = tempfile::tempdir().expect("create a temporary directory");
        let repo = Repo { dir };
        repo.git(&["init", "-q", "-b", "main", "--ref-format=reftable"]);
        repo
    }

    /// A repository with one commit of `files`.
    pub fn with_commit(files: &[(&str, &str)]) -> Repo {
        let repo = Repo::new();
        for (path, contents) in files {
            repo.write(path, contents);
        }
        repo.commit_all("initial");
        repo
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    pub fn file(&self, relative: &str) -> PathBuf {
        self.path().join(relative)
    }

    pub fn open(&self, excludes: &[&str]) -> Git {
        let excludes: Vec<String> = excludes.iter().map(|e| e.to_string()).collect();
        Git::open(self.path(), &excludes).expect("open the fixture repository")
    }

    /// Runs fixture git in the repository and returns the output whatever the exit status.
    pub fn git_output(&self, args: &[&str]) -> Output {
        git_command(self.path())
            .args(args)
            .output()
            .expect("run git for a fixture")
    }

    /// Runs fixture git, requires success, and returns stdout trimmed.
    pub fn git(&self, args: &[&str]) -> String {
        let output = self.git_output(args);
        assert!(
            output.status.success(),
            "fixture command `git {}` failed in {}: {}\n{}",
            args.join(" "),
            self.path().display(),
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        String::from_utf8(output.stdout)
            .expect("utf-8 output")
            .trim_end()
            .to_string()
    }

    pub fn commit_all(&self, message: &str) -> String {
        self.git(&["add", "-A"]);
        self.git(&["commit", "-q", "--allow-empty", "-m", message]);
        self.git(&["rev-parse", "HEAD"])
    }

    pub fn write(&self, relative: &str, contents: &str) {
        self.write_bytes(relative, contents.as_bytes());
    }

    pub fn write_bytes(&self, relative: &str, contents: &[u8]) {
        let path = self.file(relative);
        if let Some(parent) = path.parent() {
            fs::create_dir_all(parent).expect("create parent directories");
        }
        // Replace rather than write through: the path may be a symlink.
        let _ = fs::remove_file(&path);
        fs::write(&path, contents).expect("write a fixture file");
    }

    pub fn read(&self, relative: &str) -> String {
        fs::read_to_string(self.file(relative)).expect("read a fixture file")
    }

    pub fn exists(&self, relative: &str) -> bool {
        fs::symlink_metadata(self.file(relative)).is_ok()
    }

    pub fn remove(&self, relative: &str) {
        fs::remove_file(self.file(relative)).expect("remove a fixture file");
    }

    /// The bytes of the user's index file.
    pub fn index_bytes(&self) -> Vec<u8> {
        fs::read(self.path().join(".git/index")).unwrap_or_default()
    }

    /// `git status --porcelain`, without letting status refresh the index.
    pub fn status(&self) -> String {
        self.git(&[
            "--no-optional-locks",
            "status",
            "--porcelain=v1",
            "--untracked-files=all",
        ])
    }

    /// Paths of `tree` with their modes: "100644 path".
    pub fn ls_tree(&self, tree: &str) -> Vec<String> {
        let output = self.git(&["ls-tree", "-r", "-z", tree]);
        output
            .split('\0')
            .filter(|entry| !entry.is_empty())
            .map(|entry| {
                // "<mode> <type> <id>\t<path>"
                let (meta, path) = entry.split_once('\t').expect("an ls-tree entry");
                let mode = meta.split(' ').next().expect("a mode");
                format!("{mode} {path}")
            })
            .collect()
    }

    pub fn head_tree(&self) -> String {
        self.git(&["rev-parse", "HEAD^{tree}"])
    }

    /// Files the library left in the git directory under its temporary-index naming scheme.
    pub fn leftover_temp_indexes(&self) -> Vec<String> {
        fs::read_dir(self.path().join(".git"))
            .expect("list .git")
            .filter_map(|entry| entry.ok())
            .map(|entry| entry.file_name().to_string_lossy().into_owned())
            .filter(|name| name.starts_with("keel-index"))
            .collect()
    }
}

/// Held by each test that counts git processes, for its whole length: the count is per process,
/// and no other test may start one while it counts.
pub fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    SERIAL
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Runs `f` and returns its result with the number of git processes it started.
pub fn counted<T>(f: impl FnOnce() -> T) -> (T, u64) {
    let before = keel_git::processes();
    let out = f();
    (out, keel_git::processes() - before)
}

/// A git command for fixtures: no global or system configuration, a fixed identity.
pub fn git_command(dir: &Path) -> Command {
    let mut command = Command::new("git");
    command
        .current_dir(dir)
        .env("GIT_CONFIG_GLOBAL", "/dev/null")
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .env("LC_ALL", "C")
        .env("GIT_AUTHOR_NAME", "Fixture")
        .env("GIT_AUTHOR_EMAIL", "fixture@example.com")
        .env("GIT_COMMITTER_NAME", "Fixture")
        .env("GIT_COMMITTER_EMAIL", "fixture@example.com")
        .env_remove("GIT_DIR")
        .env_remove("GIT_WORK_TREE")
        .env_remove("GIT_INDEX_FILE");
    command
}

#[cfg(unix)]
pub fn set_executable(path: &Path, executable: bool) {
    use std::os::unix::fs::PermissionsExt;
    let mode = if executable { 0o755 } else { 0o644 };
    fs::set_permissions(path, fs::Permissions::from_mode(mode)).expect("chmod");
}

#[cfg(unix)]
pub fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    fs::metadata(path).expect("stat").permissions().mode() & 0o111 != 0
}
