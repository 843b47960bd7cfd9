//! The floor: one single-row SQLite commit, synced to disk, through a connection keel-store
//! makes (`keel_store::connect`: its build of SQLite, which syncs with `fdatasync`, its VFS,
//! which writes a commit's WAL frames in one `pwrite`, its page size, WAL, `synchronous =
//! FULL`), on the disk the other figures use.

use std::path::Path;
use std::time::Instant;

use anyhow::Result;
use rusqlite::{Connection, params};

use crate::util::us;

/// The WAL of a store in use is as large as SQLite lets it grow before a checkpoint (1,000
/// pages), and a commit writes over frames that are already on the disk: the file neither
/// grows nor takes new blocks. A new WAL's first commits grow it instead, which on ext4 adds a
/// synchronous write of the file's metadata (its size, its block map) to each sync: twice the
/// I/O of a commit of a store in use, and half again its CPU. So the floor is measured as a
/// store in use commits: one transaction of 1,200 rows of 3.5 KB (at least 1,200 pages) grows
/// the WAL past the checkpoint threshold, the checkpoint that follows it copies them to the
/// database, and the next transaction starts the WAL over from its first frame.
fn warm_wal(conn: &Connection) -> Result<()> {
    conn.execute_batch(
        "CREATE TABLE warm (body BLOB NOT NULL);
         BEGIN IMMEDIATE;
         WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 1200)
         INSERT INTO warm (body) SELECT zeroblob(3500) FROM n;
         COMMIT;",
    )?;
    let (busy, frames, copied): (i64, i64, i64) =
        conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |r| {
            Ok((r.get(0)?, r.get(1)?, r.get(2)?))
        })?;
    anyhow::ensure!(
        busy == 0 && frames == copied,
        "the floor's WAL was not checkpointed ({copied} of {frames} frames copied): its commits \
         would not start the WAL over"
    );
    Ok(())
}

/// `n` commits of the floor.
#[derive(Default)]
pub struct Commits {
    /// Each one's time, in microseconds.
    pub times: Vec<f64>,
    /// The CPU time (user + system, this process) they took together, in microseconds.
    pub cpu_us: f64,
    /// The bytes they wrote to the WAL together (`keel_store::vfs::wal_bytes_written`).
    pub wal_bytes: u64,
}

impl Commits {
    /// These and `more`, as if made together.
    pub fn add(&mut self, more: Commits) {
        self.times.extend(more.times);
        self.cpu_us += more.cpu_us;
        self.wal_bytes += more.wal_bytes;
    }
}

/// Makes `n` commits of the floor in a new database in `dir`.
pub fn sqlite_commits(dir: &Path, n: usize) -> Result<Commits> {
    std::fs::create_dir_all(dir)?;
    let conn = keel_store::connect(&dir.join("floor.db"))?;
    conn.execute_batch("CREATE TABLE t (id INTEGER PRIMARY KEY, body TEXT NOT NULL)")?;
    // About the size of a small event body.
    let body = "x".repeat(300);
    let mut insert = conn.prepare("INSERT INTO t (body) VALUES (?1)")?;
    warm_wal(&conn)?;
    let mut times = Vec::with_capacity(n);
    let cpu_from = crate::util::cpu();
    let wal_from = keel_store::vfs::wal_bytes_written();
    for _ in 0..n {
        let started = Instant::now();
        conn.execute_batch("BEGIN IMMEDIATE")?;
        insert.execute(params![body])?;
        conn.execute_batch("COMMIT")?;
        times.push(us(started.elapsed()));
    }
    let cpu_us = crate::util::cpu().process_us - cpu_from.process_us;
    let wal_bytes = keel_store::vfs::wal_bytes_written() - wal_from;
    Ok(Commits {
        times,
        cpu_us,
        wal_bytes,
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    /// The commits measured write over the start of a WAL already grown, not at its end.
    #[test]
    fn after_the_warm_up_a_commit_starts_the_wal_over() {
        let dir = tempfile::tempdir().unwrap();
        let conn = keel_store::connect(&dir.path().join("floor.db")).unwrap();
        let page_size: i64 = conn
            .pragma_query_value(None, "page_size", |r| r.get(0))
            .unwrap();
        assert_eq!(page_size, keel_store::PAGE_SIZE, "keel-store's page size");
        conn.execute_batch("CREATE TABLE t (id INTEGER PRIMARY KEY, body TEXT NOT NULL)")
            .unwrap();
        warm_wal(&conn).unwrap();
        let wal = dir.path().join("floor.db-wal");
        let grown = std::fs::metadata(&wal).unwrap().len();
        let threshold = 1000 * keel_store::PAGE_SIZE.unsigned_abs();
        assert!(grown > threshold, "the WAL grew to {grown} bytes");
        conn.execute("INSERT INTO t (body) VALUES ('x')", [])
            .unwrap();
        let frames: i64 = conn
            .query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |r| r.get(1))
            .unwrap();
        assert!(
            frames <= 2,
            "the commit after the warm-up wrote from the WAL's start, not after its {frames} frames"
        );
        assert_eq!(
            std::fs::metadata(&wal).unwrap().len(),
            grown,
            "the WAL kept its size"
        );
    }
}
