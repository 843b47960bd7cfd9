//! Fixtures shared by keel's tests and benchmarks. Nothing in keel depends on this crate except
//! tests and `keel-bench`.

pub mod fuzz;
pub mod invariants;
pub mod mcp;
pub mod model_server;
pub mod priority;
pub mod rng;
pub mod service;
pub mod survey;

use std::path::Path;
use std::process::Command;

/// Runs `git args` in `dir` with a test identity and returns its output, trimmed.
///
/// # Panics
/// If git cannot be started or fails: the test's workspace is not what it needs.
pub fn git(dir: &Path, args: &[&str]) -> String {
    let out = Command::new("git")
        .args(args)
        .current_dir(dir)
        .env("GIT_AUTHOR_NAME", "test")
        .env("GIT_AUTHOR_EMAIL", "test@localhost")
        .env("GIT_COMMITTER_NAME", "test")
        .env("GIT_COMMITTER_EMAIL", "test@localhost")
        .output()
        .unwrap_or_else(|e| panic!("git {args:?} cannot start in {}: {e}", dir.display()));
    assert!(
        out.status.success(),
        "git {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}
