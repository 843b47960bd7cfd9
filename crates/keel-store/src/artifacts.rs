//! The content-addressed artifact store: blobs named by their blake3 hash, under
//! `<dir>/<first two hex digits>/<hash>`. Writes go to a temporary file that is fsynced and renamed,
//! so a blob is either whole or absent.

use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};

use crate::StoreError;

#[derive(Debug, Clone)]
pub struct Artifacts {
    dir: PathBuf,
    /// Known secret values, replaced by `[secret:NAME]` in every blob before it is written.
    scrubber: std::sync::Arc<keel_core::secret::Scrubber>,
}

impl Artifacts {
    pub fn new(dir: PathBuf) -> Artifacts {
        Artifacts {
            dir,
            scrubber: std::sync::Arc::new(keel_core::secret::Scrubber::empty()),
        }
    }

    /// From now on every blob is scrubbed of these secrets before it is stored.
    pub fn set_scrubber(&mut self, scrubber: std::sync::Arc<keel_core::secret::Scrubber>) {
        self.scrubber = scrubber;
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn path(&self, hash: &str) -> PathBuf {
        let prefix = hash.get(..2).unwrap_or("00");
        self.dir.join(prefix).join(hash)
    }

    /// Stores `bytes` and returns their hash. Storing the same bytes twice is a no-op.
    pub fn put(&self, bytes: &[u8]) -> Result<String, StoreError> {
        let bytes = self.scrubber.scrub_bytes(bytes);
        let bytes = bytes.as_ref();
        let hash = blake3::hash(bytes).to_hex().to_string();
        self.write(&hash, |f| f.write_all(bytes))?;
        Ok(hash)
    }

    /// `bytes` as they would be stored: scrubbed of every known secret.
    pub fn scrub<'b>(&self, bytes: &'b [u8]) -> std::borrow::Cow<'b, [u8]> {
        self.scrubber.scrub_bytes(bytes)
    }

    /// Stores the content of a file (streamed, not read into memory) and returns its hash.
    pub fn put_file(&self, source: &Path) -> Result<String, StoreError> {
        let io_err = |e| StoreError::io(source, e);
        if !self.scrubber.is_empty() {
            // With secrets known, the blob is scrubbed as a whole (a value may straddle any
            // chunk boundary), so it is read into memory.
            let bytes = fs::read(source).map_err(io_err)?;
            return self.put(&bytes);
        }
        let mut hasher = blake3::Hasher::new();
        let mut file = File::open(source).map_err(io_err)?;
        hasher.update_reader(&mut file).map_err(io_err)?;
        let hash = hasher.finalize().to_hex().to_string();
        self.write(&hash, |out| {
            let mut input = File::open(source)?;
            io::copy(&mut input, out).map(|_| ())
        })?;
        Ok(hash)
    }

    fn write(
        &self,
        hash: &str,
        fill: impl FnOnce(&mut File) -> io::Result<()>,
    ) -> Result<(), StoreError> {
        let target = self.path(hash);
        if target.exists() {
            return Ok(());
        }
        let parent = target.parent().unwrap_or(&self.dir).to_path_buf();
        crate::dirs::create_synced(&parent).map_err(|e| StoreError::io(&parent, e))?;
        // Unique per write, not only per process: two threads storing the same bytes at once
        // must not share a temporary file (the second rename would find it gone).
        static WRITES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = WRITES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let tmp = parent.join(format!(".{hash}.{}.{n}.tmp", std::process::id()));
        let result = (|| {
            let mut file = File::create(&tmp)?;
            fill(&mut file)?;
            // `KEEL_STORE_FAULT=artifact-fsync@N` fails this fsync (see `fault.rs`).
            if let Some(e) = crate::fault::next_artifact() {
                return Err(e);
            }
            file.sync_all()?;
            fs::rename(&tmp, &target)?;
            crate::dirs::sync(&parent)
        })();
        if result.is_err() {
            let _ = fs::remove_file(&tmp);
        }
        result.map_err(|e| StoreError::io(&target, e))
    }

    /// Reads a blob, at most `limit` bytes of it.
    pub fn read(&self, hash: &str, limit: usize) -> Result<Vec<u8>, StoreError> {
        let path = self.path(hash);
        let file = File::open(&path).map_err(|e| StoreError::io(&path, e))?;
        let mut buf = Vec::new();
        file.take(limit as u64)
            .read_to_end(&mut buf)
            .map_err(|e| StoreError::io(&path, e))?;
        Ok(buf)
    }

    /// Whether the blob exists and still has the content its name says.
    pub fn verify(&self, hash: &str) -> Result<bool, StoreError> {
        let path = self.path(hash);
        let mut file = match File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
            Err(e) => return Err(StoreError::io(&path, e)),
        };
        let mut hasher = blake3::Hasher::new();
        hasher
            .update_reader(&mut file)
            .map_err(|e| StoreError::io(&path, e))?;
        Ok(hasher.finalize().to_hex().as_str() == hash)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blobs_are_named_by_content_and_stored_once() {
        let dir = tempfile::tempdir().unwrap();
        let a = Artifacts::new(dir.path().join("artifacts"));
        let h1 = a.put(b"hello").unwrap();
        let h2 = a.put(b"hello").unwrap();
        assert_eq!(h1, h2);
        assert_eq!(h1, blake3::hash(b"hello").to_hex().to_string());
        assert_eq!(a.read(&h1, 100).unwrap(), b"hello");
        assert_eq!(a.read(&h1, 2).unwrap(), b"he");
        assert!(a.verify(&h1).unwrap());
        std::fs::write(a.path(&h1), b"tampered").unwrap();
        assert!(!a.verify(&h1).unwrap());
        assert!(!a.verify(&"ab".repeat(32)).unwrap());
    }

    #[test]
    fn files_are_streamed_in() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("out.log");
        std::fs::write(&src, vec![7u8; 100_000]).unwrap();
        let a = Artifacts::new(dir.path().join("artifacts"));
        let h = a.put_file(&src).unwrap();
        assert_eq!(a.read(&h, usize::MAX).unwrap().len(), 100_000);
        assert!(a.verify(&h).unwrap());
    }
}
