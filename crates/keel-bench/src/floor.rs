//! The floor: one single-row SQLite commit, fsynced, with the settings keel-store uses (WAL,
//! `synchronous = FULL`), on the disk the other figures use.

use std::path::Path;
use std::time::Instant;

use anyhow::Result;
use rusqlite::{Connection, params};

use crate::util::us;

/// The time of each of `n` commits, in microseconds.
pub fn sqlite_commits(dir: &Path, n: usize) -> Result<Vec<f64>> {
    std::fs::create_dir_all(dir)?;
    let conn = Connection::open(dir.join("floor.db"))?;
    conn.pragma_update(None, "journal_mode", "WAL")?;
    conn.pragma_update(None, "synchronous", "FULL")?;
    conn.execute_batch("CREATE TABLE t (id INTEGER PRIMARY KEY, body TEXT NOT NULL)")?;
    // About the size of a small event body.
    let body = "x".repeat(300);
    let mut insert = conn.prepare("INSERT INTO t (body) VALUES (?1)")?;
    let mut times = Vec::with_capacity(n);
    // A few unmeasured commits first: the WAL file is created and grown by the first ones.
    for i in 0..n + 10 {
        let started = Instant::now();
        conn.execute_batch("BEGIN IMMEDIATE")?;
        insert.execute(params![body])?;
        conn.execute_batch("COMMIT")?;
        if i >= 10 {
            times.push(us(started.elapsed()));
        }
    }
    Ok(times)
}
