//! A process writing through keel-store's VFS (`keel_store::vfs`, which gathers a WAL file's
//! writes and makes them at the end of each commit) is killed with SIGKILL at whatever point it
//! has reached, often in the middle of a transaction with writes gathered and not yet made;
//! then the file is opened again. Every transaction the writer saw commit is there whole, no
//! other is there in part, and SQLite's integrity check passes. No assertion is about time:
//! where a kill lands varies from run to run, and every landing must keep the same facts.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, Command, Stdio};

const ROWS: i64 = 24;

/// The rows of transaction `tx`: some larger than a page, and together more than the VFS
/// gathers before writing (64 KiB), so a kill also lands between two of a transaction's writes.
fn body(tx: i64, row: i64) -> Vec<u8> {
    let len = 200 + ((tx * 7919 + row * 104_729) % 9000) as usize;
    vec![(tx + row) as u8; len]
}

fn open(path: &Path) -> rusqlite::Connection {
    let conn = keel_store::open_connection(path).unwrap();
    conn.busy_timeout(std::time::Duration::from_secs(10))
        .unwrap();
    conn.pragma_update(None, "journal_mode", "WAL").unwrap();
    conn.pragma_update(None, "synchronous", "FULL").unwrap();
    conn
}

/// The writer, run in a child process: commits transactions from the one after the last in
/// the file, printing each one's number once its commit has returned, until it is killed.
#[test]
#[ignore = "run by a_writer_killed_anywhere_keeps_every_commit_it_saw_and_no_part_of_another"]
fn writer() {
    let Some(path) = std::env::var_os("KEEL_VFS_CRASH_DB") else {
        return;
    };
    let conn = open(Path::new(&path));
    conn.execute_batch(
        "CREATE TABLE IF NOT EXISTS t (tx INTEGER NOT NULL, row INTEGER NOT NULL, body BLOB NOT NULL)",
    )
    .unwrap();
    let mut tx: i64 = conn
        .query_row("SELECT coalesce(max(tx), 0) FROM t", [], |r| r.get(0))
        .unwrap();
    let mut out = std::io::stdout().lock();
    loop {
        tx += 1;
        let t = conn.unchecked_transaction().unwrap();
        for row in 0..ROWS {
            t.execute(
                "INSERT INTO t (tx, row, body) VALUES (?1, ?2, ?3)",
                rusqlite::params![tx, row, body(tx, row)],
            )
            .unwrap();
        }
        t.commit().unwrap();
        writeln!(out, "COMMITTED {tx}").unwrap();
        out.flush().unwrap();
    }
}

struct Writer(Child);

impl Drop for Writer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn a_writer_killed_anywhere_keeps_every_commit_it_saw_and_no_part_of_another() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("crash.db");
    let mut seen = 0i64;
    for round in 0..8i64 {
        let mut writer = Writer(
            Command::new(std::env::current_exe().unwrap())
                .args([
                    "--exact",
                    "writer",
                    "--ignored",
                    "--nocapture",
                    "--test-threads=1",
                ])
                .env("KEEL_VFS_CRASH_DB", &db)
                .stdout(Stdio::piped())
                .spawn()
                .unwrap(),
        );
        // Killed after a number of commits that differs by round, at whatever point the
        // writer has reached by the time the signal lands.
        let wait_for = 3 + round * 5;
        let lines = BufReader::new(writer.0.stdout.take().unwrap()).lines();
        // The writer may be ahead of this reader: the commits it acknowledged before the signal
        // landed are read from the pipe to its end, so `seen` is its last acknowledgement.
        let mut acknowledged = 0;
        for line in lines {
            let line = line.unwrap();
            if let Some(n) = line.strip_prefix("COMMITTED ") {
                seen = n.trim().parse().unwrap();
                acknowledged += 1;
                if acknowledged == wait_for {
                    writer.0.kill().unwrap();
                }
            }
        }
        assert!(
            acknowledged >= wait_for,
            "round {round}: the writer stopped early, after {acknowledged} commits"
        );
        writer.0.wait().unwrap();
        drop(writer);

        // Read through the VFS and through SQLite's own, as another program would.
        for conn in [open(&db), rusqlite::Connection::open(&db).unwrap()] {
            let check: String = conn
                .query_row("PRAGMA integrity_check", [], |r| r.get(0))
                .unwrap();
            assert_eq!(check, "ok", "round {round}");
            let txs: Vec<(i64, i64)> = conn
                .prepare("SELECT tx, count(*) FROM t GROUP BY tx ORDER BY tx")
                .unwrap()
                .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
                .unwrap()
                .collect::<Result<_, _>>()
                .unwrap();
            let last = txs.last().map_or(0, |t| t.0);
            assert!(
                last >= seen,
                "round {round}: commit {seen} was acknowledged, the file ends at {last}"
            );
            // At most the one commit whose acknowledgement the kill cut off is there beyond it.
            assert!(
                last <= seen + 1,
                "round {round}: {last} commits, {seen} acknowledged"
            );
            for (i, (tx, rows)) in txs.iter().enumerate() {
                assert_eq!(
                    *tx,
                    i as i64 + 1,
                    "round {round}: transactions are 1..={last}"
                );
                assert_eq!(
                    *rows, ROWS,
                    "round {round}: transaction {tx} is there in part"
                );
            }
            let mut rows = conn
                .prepare("SELECT tx, row, body FROM t WHERE tx > ?1 - 3")
                .unwrap();
            let rows = rows
                .query_map([last], |r| {
                    Ok((
                        r.get::<_, i64>(0)?,
                        r.get::<_, i64>(1)?,
                        r.get::<_, Vec<u8>>(2)?,
                    ))
                })
                .unwrap();
            for row in rows {
                let (tx, row, stored) = row.unwrap();
                assert!(
                    stored == body(tx, row),
                    "round {round}: row {row} of {tx} changed"
                );
            }
        }
    }
    assert!(seen >= 8 * 3, "the writers committed {seen} transactions");
}
