//! The floor: one single-row SQLite commit, synced to disk, with the settings and the build of
//! SQLite keel-store uses (WAL, `synchronous = FULL`, `fdatasync`), on the disk the other
//! figures use.

use std::path::Path;
use std::time::Instant;

use anyhow::Result;
use rusqlite::{Connection, params};

use crate::util::us;

/// The time of each of `n` commits, and the CPU time (user + system, this process) they took
/// together, in microseconds.
pub fn sqlite_commits(dir: &Path, n: usize) -> Result<(Vec<f64>, f64)> {
    std::fs::create_dir_all(dir)?;
    let conn = Connection::open(dir.join("floor.db"))?;
    conn.pragma_update(None, "journal_mode", "WAL")?;
    conn.pragma_update(None, "synchronous", "FULL")?;
    conn.execute_batch("CREATE TABLE t (id INTEGER PRIMARY KEY, body TEXT NOT NULL)")?;
    // About the size of a small event body.
    let body = "x".repeat(300);
    let mut insert = conn.prepare("INSERT INTO t (body) VALUES (?1)")?;
    let mut times = Vec::with_capacity(n);
    let mut cpu_from = crate::util::cpu();
    // A few unmeasured commits first: the WAL file is created and grown by the first ones.
    for i in 0..n + 10 {
        if i == 10 {
            cpu_from = crate::util::cpu();
        }
        let started = Instant::now();
        conn.execute_batch("BEGIN IMMEDIATE")?;
        insert.execute(params![body])?;
        conn.execute_batch("COMMIT")?;
        if i >= 10 {
            times.push(us(started.elapsed()));
        }
    }
    let cpu_us = crate::util::cpu().process_us - cpu_from.process_us;
    Ok((times, cpu_us))
}
