//! Directories that survive a power cut: a file or directory's name lives in the directory
//! that holds it, and is on the disk only once that directory is synced (POSIX; ext4 without
//! a journal, for one, loses a new name otherwise). SQLite syncs the directory of a WAL it
//! creates, not of the database file; a blob's file is synced before its rename.

use std::fs::{self, File};
use std::io;
use std::path::Path;

/// Creates `dir` and whatever of its parents is missing, and syncs the directory that holds
/// each one made: a commit that names a file in it must not outlive it after a power cut.
pub(crate) fn create_synced(dir: &Path) -> io::Result<()> {
    if dir.is_dir() {
        return Ok(());
    }
    let mut made = Vec::new();
    let mut at = dir;
    while fs::symlink_metadata(at).is_err() {
        made.push(at);
        match at.parent() {
            Some(parent) if !parent.as_os_str().is_empty() => at = parent,
            _ => break,
        }
    }
    fs::create_dir_all(dir)?;
    for new in made.iter().rev() {
        sync_holder(new)?;
    }
    Ok(())
}

/// Syncs the directory that holds `path` (the current directory for a bare name).
pub(crate) fn sync_holder(path: &Path) -> io::Result<()> {
    match path.parent().filter(|p| !p.as_os_str().is_empty()) {
        Some(parent) => sync(parent),
        None => sync(Path::new(".")),
    }
}

/// Syncs the directory `dir`: the names in it are on the disk once this returns.
pub(crate) fn sync(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()?;
    #[cfg(test)]
    tests::SYNCED.with(|s| s.borrow_mut().push(dir.to_path_buf()));
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
pub(crate) mod tests {
    use std::cell::RefCell;
    use std::path::PathBuf;

    thread_local! {
        /// The directories synced on this thread.
        pub(crate) static SYNCED: RefCell<Vec<PathBuf>> = const { RefCell::new(Vec::new()) };
    }

    /// The directories synced on this thread since the last call.
    pub(crate) fn synced() -> Vec<PathBuf> {
        SYNCED.with(|s| s.take())
    }

    #[test]
    fn each_directory_made_is_named_durably_in_its_parent() {
        let top = tempfile::tempdir().unwrap();
        let a = top.path().join("a");
        let c = a.join("b").join("c");
        synced();
        super::create_synced(&c).unwrap();
        assert!(c.is_dir());
        // `a` in the top directory, `b` in `a`, `c` in `b`.
        assert_eq!(synced(), [top.path().to_path_buf(), a.clone(), a.join("b")]);
        super::create_synced(&c).unwrap();
        assert_eq!(synced(), Vec::<PathBuf>::new(), "nothing was made");
        super::create_synced(&a.join("d")).unwrap();
        assert_eq!(synced(), [a]);
    }

    #[test]
    fn a_new_store_and_a_blob_in_a_new_directory_are_named_durably() {
        let top = tempfile::tempdir().unwrap();
        let keel = top.path().join(".keel");
        let db = keel.join("keel.db");
        synced();
        let store = crate::Store::open(&db).unwrap();
        // `.keel` in the top directory, `keel.db` in `.keel`.
        assert_eq!(synced(), [top.path().to_path_buf(), keel.clone()]);
        drop(store);
        let store = crate::Store::open(&db).unwrap();
        assert_eq!(
            synced(),
            Vec::<PathBuf>::new(),
            "an open store made nothing"
        );
        // A blob too large for the database is a file of its own, under a directory made for
        // the first two digits of its hash.
        let blob = vec![7u8; crate::INLINE_ARTIFACT_BYTES + 1];
        let hash = store.put_artifact(&blob).unwrap();
        let artifacts = keel.join("artifacts");
        let digits = artifacts.join(&hash[..2]);
        assert!(digits.join(&hash).is_file());
        assert_eq!(synced(), [keel, artifacts, digits]);
    }
}
