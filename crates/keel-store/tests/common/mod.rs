//! Runs and events for the store's tests.

#![allow(dead_code, unused_imports, clippy::unwrap_used, clippy::expect_used)]

pub use keel_test_support::runs::{created, next};

pub fn db(dir: &tempfile::TempDir) -> std::path::PathBuf {
    dir.path().join(".keel/keel.db")
}
