//! A workspace fixture: `<tmp>/ws` is the workspace, `<tmp>/outside` a sibling it must not touch.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use keel_tools::{ToolError, Workspace};

pub struct Fixture {
    pub dir: tempfile::TempDir,
    pub ws: Workspace,
}

impl Fixture {
    /// A workspace with `.git/config`, `.keel/run.db`, `src/lib.rs`, `b.txt`, and an outside
    /// directory holding `secret.txt`.
    pub fn new() -> Fixture {
        Fixture::with_denied(&[])
    }

    pub fn with_denied(denied: &[&str]) -> Fixture {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("ws");
        fs::create_dir_all(root.join(".git")).unwrap();
        fs::create_dir_all(root.join(".keel")).unwrap();
        fs::create_dir_all(root.join("src")).unwrap();
        fs::create_dir_all(dir.path().join("outside")).unwrap();
        fs::write(root.join(".git/config"), "[core]\n").unwrap();
        fs::write(root.join(".keel/run.db"), "state\n").unwrap();
        fs::write(root.join("src/lib.rs"), "fn main() {}\n").unwrap();
        fs::write(root.join("b.txt"), "bee\n").unwrap();
        fs::write(dir.path().join("outside/secret.txt"), "secret\n").unwrap();
        let ws = Workspace::new(&root, denied).unwrap();
        Fixture { dir, ws }
    }

    pub fn root(&self) -> PathBuf {
        self.ws.root().to_path_buf()
    }

    pub fn outside(&self) -> PathBuf {
        self.root().parent().unwrap().join("outside")
    }

    /// Writes a file in the workspace, creating directories.
    pub fn file(&self, rel: &str, content: &str) {
        let path = self.root().join(rel);
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(path, content).unwrap();
    }

    pub fn symlink(&self, rel: &str, target: impl AsRef<Path>) {
        let path = self.root().join(rel);
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::os::unix::fs::symlink(target, path).unwrap();
    }

    pub fn content(&self, rel: &str) -> String {
        fs::read_to_string(self.root().join(rel)).unwrap()
    }

    /// Everything under the temporary directory (workspace and outside): each path with its
    /// content, symlink target or `dir`, and its mode.
    pub fn snapshot(&self) -> BTreeMap<PathBuf, String> {
        let mut out = BTreeMap::new();
        walk(self.dir.path(), self.dir.path(), &mut out);
        out
    }
}

fn walk(base: &Path, dir: &Path, out: &mut BTreeMap<PathBuf, String>) {
    for entry in fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let meta = fs::symlink_metadata(&path).unwrap();
        let rel = path.strip_prefix(base).unwrap().to_path_buf();
        let mode = meta.permissions().mode() & 0o7777;
        if meta.file_type().is_symlink() {
            out.insert(
                rel,
                format!("-> {}", fs::read_link(&path).unwrap().display()),
            );
        } else if meta.is_dir() {
            out.insert(rel, format!("dir {mode:o}"));
            walk(base, &path, out);
        } else {
            let bytes = fs::read(&path).unwrap();
            out.insert(rel, format!("{mode:o} {}", String::from_utf8_lossy(&bytes)));
        }
    }
}

pub fn observation(output: Result<keel_tools::ToolOutput, ToolError>) -> String {
    match output {
        Ok(output) => output.observation,
        Err(error) => panic!("expected success, got: {error}"),
    }
}

#[track_caller]
pub fn assert_escape<T: std::fmt::Debug>(result: Result<T, ToolError>) -> String {
    match result {
        Err(error @ ToolError::Escape { .. }) => error.to_string(),
        other => panic!("expected an Escape error, got {other:?}"),
    }
}

#[track_caller]
pub fn assert_denied<T: std::fmt::Debug>(result: Result<T, ToolError>) -> String {
    match result {
        Err(error @ ToolError::Denied { .. }) => error.to_string(),
        other => panic!("expected a Denied error, got {other:?}"),
    }
}

#[track_caller]
pub fn assert_invalid<T: std::fmt::Debug>(result: Result<T, ToolError>) -> String {
    match result {
        Err(error @ ToolError::Invalid { .. }) => error.to_string(),
        other => panic!("expected an Invalid error, got {other:?}"),
    }
}
