//! The SQLite schema and its migrations, versioned with `PRAGMA user_version`.

use std::path::Path;

use rusqlite::Connection;

use crate::StoreError;

const MIGRATIONS: &[&str] = &[
    // 1: the first schema.
    "CREATE TABLE contracts (
        hash TEXT PRIMARY KEY,
        file TEXT NOT NULL,
        source TEXT NOT NULL
    );
    CREATE TABLE runs (
        id TEXT PRIMARY KEY,
        contract_hash TEXT NOT NULL,
        state TEXT NOT NULL,
        reason TEXT NOT NULL,
        phase TEXT,
        created_at INTEGER NOT NULL,
        updated_at INTEGER NOT NULL,
        last_seq INTEGER NOT NULL,
        last_hash TEXT NOT NULL,
        lease_holder TEXT,
        lease_token INTEGER NOT NULL DEFAULT 0,
        lease_until INTEGER NOT NULL DEFAULT 0,
        projection TEXT NOT NULL
    );
    CREATE TABLE events (
        run_id TEXT NOT NULL,
        seq INTEGER NOT NULL,
        at INTEGER NOT NULL,
        v INTEGER NOT NULL,
        kind TEXT NOT NULL,
        body TEXT NOT NULL,
        prev_hash TEXT NOT NULL,
        hash TEXT NOT NULL,
        PRIMARY KEY (run_id, seq)
    ) WITHOUT ROWID;
    CREATE TABLE steps (
        run_id TEXT NOT NULL,
        phase INTEGER NOT NULL,
        idx INTEGER NOT NULL,
        command TEXT NOT NULL,
        state TEXT NOT NULL,
        attempts INTEGER NOT NULL,
        PRIMARY KEY (run_id, phase, idx)
    ) WITHOUT ROWID;
    CREATE TABLE budgets (
        run_id TEXT NOT NULL,
        name TEXT NOT NULL,
        used INTEGER NOT NULL,
        lim INTEGER,
        PRIMARY KEY (run_id, name)
    ) WITHOUT ROWID;
    CREATE TABLE evidence (
        run_id TEXT NOT NULL,
        n INTEGER NOT NULL,
        seq INTEGER NOT NULL,
        verifier TEXT NOT NULL,
        tier TEXT NOT NULL,
        passed INTEGER NOT NULL,
        status TEXT NOT NULL,
        output TEXT NOT NULL,
        tree TEXT NOT NULL,
        body TEXT NOT NULL,
        PRIMARY KEY (run_id, n)
    ) WITHOUT ROWID;
    CREATE TABLE checkpoints (
        run_id TEXT NOT NULL,
        n INTEGER NOT NULL,
        seq INTEGER NOT NULL,
        at INTEGER NOT NULL,
        hash TEXT NOT NULL,
        snapshot_ref TEXT NOT NULL,
        commit_id TEXT NOT NULL,
        body TEXT NOT NULL,
        PRIMARY KEY (run_id, n)
    ) WITHOUT ROWID;",
    // 2: small artifacts (a step's request, reply and tool output) stored in the same
    // transaction as the events that name them, so a step costs one fsync, not one per blob.
    "CREATE TABLE blobs (
        hash TEXT PRIMARY KEY,
        bytes BLOB NOT NULL
    );",
    // 3: the projection is rewritten only now and then (a long run's is large); readers fold
    // the events after `projection_seq` onto it.
    "ALTER TABLE runs ADD COLUMN projection_seq INTEGER NOT NULL DEFAULT 0;
    UPDATE runs SET projection_seq = last_seq;",
    // 4: the projection in a table of its own. In the `runs` row, every lease change and every
    // commit rewrote the whole row, a long run's large projection included.
    "CREATE TABLE projections (
        run_id TEXT PRIMARY KEY,
        seq INTEGER NOT NULL,
        body TEXT NOT NULL
    );
    INSERT INTO projections (run_id, seq, body) SELECT id, projection_seq, projection FROM runs;
    ALTER TABLE runs DROP COLUMN projection;
    ALTER TABLE runs DROP COLUMN projection_seq;",
    // 5: a small artifact may be stored compressed (0 = as it is, 1 = one zstd frame); the
    // blobs already stored keep their bytes as they are.
    "ALTER TABLE blobs ADD COLUMN codec INTEGER NOT NULL DEFAULT 0;",
    // 6: a row per commit of a run (its events and the small artifacts it stored, see `log`)
    // instead of a row per event and per artifact; `move_events_into_log` moves the events,
    // and the `blobs` already stored stay where they are.
    "CREATE TABLE log (
        id INTEGER PRIMARY KEY,
        run_id TEXT NOT NULL,
        first_seq INTEGER NOT NULL,
        last_seq INTEGER NOT NULL,
        codec INTEGER NOT NULL,
        blob_hashes BLOB,
        events BLOB NOT NULL,
        blobs BLOB
    );
    CREATE UNIQUE INDEX log_run ON log (run_id, last_seq);",
    // 7: a run's rows linked newest to oldest (`prev`, the run's row before; `runs.last_log`,
    // its newest) instead of the `(run_id, last_seq)` index, which every commit wrote a page
    // of besides the row's own (see `log`). `prev` comes before the large columns, so following
    // the links reads no overflow page.
    "CREATE TABLE log7 (
        id INTEGER PRIMARY KEY,
        prev INTEGER,
        run_id TEXT NOT NULL,
        first_seq INTEGER NOT NULL,
        last_seq INTEGER NOT NULL,
        codec INTEGER NOT NULL,
        blob_hashes BLOB,
        events BLOB NOT NULL,
        blobs BLOB
    );
    INSERT INTO log7 (id, prev, run_id, first_seq, last_seq, codec, blob_hashes, events, blobs)
        SELECT l.id,
            (SELECT b.id FROM log b WHERE b.run_id = l.run_id AND b.last_seq < l.last_seq
             ORDER BY b.last_seq DESC LIMIT 1),
            l.run_id, l.first_seq, l.last_seq, l.codec, l.blob_hashes, l.events, l.blobs
        FROM log l;
    DROP TABLE log;
    ALTER TABLE log7 RENAME TO log;
    ALTER TABLE runs ADD COLUMN last_log INTEGER;
    UPDATE runs SET last_log =
        (SELECT l.id FROM log l WHERE l.run_id = runs.id ORDER BY l.last_seq DESC LIMIT 1);",
];

/// Events an old log's rows are grouped by when schema 6 moves them.
const MOVED_PER_ROW: usize = 64;

/// Schema 6's move: each run's events, in order, into rows of up to [`MOVED_PER_ROW`], every
/// field as it was stored (a damaged event stays as damaged as it was), then the old table
/// goes.
fn move_events_into_log(tx: &rusqlite::Transaction<'_>) -> rusqlite::Result<()> {
    let mut rows = Vec::new();
    {
        let mut stmt = tx.prepare(
            "SELECT run_id, seq, at, v, kind, body, prev_hash, hash FROM events \
             ORDER BY run_id, seq",
        )?;
        let mut query = stmt.query([])?;
        let mut run: Option<String> = None;
        let mut batch: Vec<crate::StoredEvent> = Vec::new();
        while let Some(r) = query.next()? {
            let run_id = crate::text(r, 0)?;
            if run.as_deref() != Some(&run_id) || batch.len() == MOVED_PER_ROW {
                if let Some(done) = run.take() {
                    rows.push((done, std::mem::take(&mut batch)));
                }
                run = Some(run_id.clone());
            }
            batch.push(crate::StoredEvent {
                run_id,
                seq: r.get(1)?,
                at_ms: r.get(2)?,
                version: r.get(3)?,
                kind: crate::text(r, 4)?,
                body: crate::text(r, 5)?,
                prev_hash: crate::text(r, 6)?,
                hash: crate::text(r, 7)?,
            });
        }
        if let Some(done) = run {
            rows.push((done, batch));
        }
    }
    let mut insert = tx.prepare(
        "INSERT INTO log (run_id, first_seq, last_seq, codec, events) VALUES (?1, ?2, ?3, ?4, ?5)",
    )?;
    for (run_id, events) in rows {
        let (Some(first), Some(last)) = (events.first(), events.last()) else {
            continue;
        };
        let (first, last) = (first.seq, last.seq);
        let (codec, bytes) = crate::log::pack(crate::log::encode_events(&events));
        insert.execute(rusqlite::params![run_id, first, last, codec, bytes])?;
    }
    tx.execute_batch("DROP TABLE events;")
}

pub(crate) fn migrate(conn: &Connection, path: &Path) -> Result<(), StoreError> {
    let sql = |source| StoreError::Sqlite {
        path: path.to_path_buf(),
        source,
    };
    let version: i64 = conn
        .pragma_query_value(None, "user_version", |r| r.get(0))
        .map_err(sql)?;
    let known = MIGRATIONS.len() as i64;
    if version > known {
        return Err(StoreError::NewerSchema {
            path: path.to_path_buf(),
            found: version,
            known,
        });
    }
    for (i, migration) in MIGRATIONS.iter().enumerate().skip(version as usize) {
        let next = i as i64 + 1;
        let step = || -> rusqlite::Result<()> {
            let tx = rusqlite::Transaction::new_unchecked(
                conn,
                rusqlite::TransactionBehavior::Immediate,
            )?;
            // Another connection may have applied it since the version was read above (two
            // processes opening a new store at once): read it again under the write lock.
            let now: i64 = tx.pragma_query_value(None, "user_version", |r| r.get(0))?;
            if now >= next {
                return tx.commit();
            }
            tx.execute_batch(migration)?;
            if next == 6 {
                move_events_into_log(&tx)?;
            }
            tx.pragma_update(None, "user_version", next)?;
            tx.commit()
        };
        step().map_err(sql)?;
    }
    // A newer keel may have migrated it further while this one waited for the lock.
    let version: i64 = conn
        .pragma_query_value(None, "user_version", |r| r.get(0))
        .map_err(sql)?;
    if version > known {
        return Err(StoreError::NewerSchema {
            path: path.to_path_buf(),
            found: version,
            known,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn count(conn: &Connection, sql: &str) -> i64 {
        conn.query_row(sql, [], |r| r.get(0)).unwrap()
    }

    /// A new database with the first `version` migrations applied (its directory lives as long
    /// as the returned guard).
    fn store_of_schema(version: usize) -> (tempfile::TempDir, std::path::PathBuf, Connection) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keel.db");
        let conn = Connection::open(&path).unwrap();
        for (i, migration) in MIGRATIONS.iter().take(version).enumerate() {
            conn.execute_batch(&format!("{migration}; PRAGMA user_version = {};", i + 1))
                .unwrap();
        }
        (dir, path, conn)
    }

    #[test]
    fn schema_4_moves_each_projection_into_its_own_table() {
        let (_dir, path, conn) = store_of_schema(3);
        conn.execute(
            "INSERT INTO runs (id, contract_hash, state, reason, created_at, updated_at, \
             last_seq, last_hash, projection, projection_seq) \
             VALUES ('r1', 'c', 'executing', '', 1, 1, 7, 'h', '{\"seq\":5}', 5)",
            [],
        )
        .unwrap();

        migrate(&conn, &path).unwrap();

        let (body, seq): (String, u64) = conn
            .query_row(
                "SELECT body, seq FROM projections WHERE run_id = 'r1'",
                [],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .unwrap();
        assert_eq!((body.as_str(), seq), ("{\"seq\":5}", 5));
        let columns: Vec<String> = conn
            .prepare("SELECT name FROM pragma_table_info('runs')")
            .unwrap()
            .query_map([], |r| r.get(0))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap();
        assert!(columns.contains(&"last_seq".to_string()), "{columns:?}");
        assert!(
            !columns.iter().any(|c| c.starts_with("projection")),
            "{columns:?}"
        );
        let version: i64 = conn
            .pragma_query_value(None, "user_version", |r| r.get(0))
            .unwrap();
        assert_eq!(version, MIGRATIONS.len() as i64);
    }

    /// A store of schema 4 (blobs with no codec, a row per event) reaches schema 6: every event
    /// comes back as it was stored, damage included, in order and grouped into rows; the blobs
    /// already stored read as they were; a new commit's artifacts go with its events.
    #[test]
    fn schema_6_moves_every_event_as_it_was_and_keeps_the_old_blobs() {
        let (_dir, path, conn) = store_of_schema(4);
        let text = "a request that repeats itself. ".repeat(100);
        let old_blob = blake3::hash(text.as_bytes()).to_hex().to_string();
        conn.execute(
            "INSERT INTO blobs (hash, bytes) VALUES (?1, ?2)",
            rusqlite::params![old_blob, text.as_bytes()],
        )
        .unwrap();
        let mut expected = Vec::new();
        for (run, n) in [("a", 150u64), ("b", 3)] {
            for seq in 1..=n {
                let body = if run == "a" && seq == 70 {
                    // Stored damaged before the move: it stays so.
                    "{not json".to_string()
                } else {
                    format!("{{\"kind\":\"note_added\",\"n\":{seq}}}")
                };
                let e = crate::StoredEvent {
                    run_id: run.into(),
                    seq,
                    at_ms: 1000 + seq as i64,
                    version: 1,
                    kind: "note_added".into(),
                    body,
                    prev_hash: format!("p{seq}"),
                    hash: format!("h{seq}"),
                };
                conn.execute(
                    "INSERT INTO events (run_id, seq, at, v, kind, body, prev_hash, hash) \
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
                    rusqlite::params![
                        e.run_id,
                        e.seq,
                        e.at_ms,
                        e.version,
                        e.kind,
                        e.body,
                        e.prev_hash,
                        e.hash
                    ],
                )
                .unwrap();
                expected.push(e);
            }
            conn.execute(
                "INSERT INTO runs (id, contract_hash, state, reason, created_at, updated_at, \
                 last_seq, last_hash) VALUES (?1, 'c', 'executing', '', 1, 1, ?2, ?3)",
                rusqlite::params![run, n, format!("h{n}")],
            )
            .unwrap();
        }
        drop(conn);

        let store = crate::Store::open(&path).unwrap();
        let mut read = store.events_from("a", 1).unwrap();
        read.extend(store.events_from("b", 1).unwrap());
        assert_eq!(read, expected);
        assert_eq!(store.events_from("a", 140).unwrap(), expected[139..150]);
        assert_eq!(store.event("a", 70).unwrap().as_ref(), Some(&expected[69]));
        let conn = Connection::open(&path).unwrap();
        let rows = count(&conn, "SELECT count(*) FROM log WHERE run_id = 'a'");
        assert_eq!(rows, 3, "150 events in rows of up to {MOVED_PER_ROW}");
        let events_table = count(
            &conn,
            "SELECT count(*) FROM sqlite_schema WHERE name = 'events'",
        );
        assert_eq!(events_table, 0);
        assert_eq!(
            store.read_artifact(&old_blob, usize::MAX).unwrap(),
            text.as_bytes()
        );
        assert!(store.verify_artifact(&old_blob).unwrap());
        let version: i64 = conn
            .pragma_query_value(None, "user_version", |r| r.get(0))
            .unwrap();
        assert_eq!(version, MIGRATIONS.len() as i64);
    }

    #[test]
    fn schema_7_links_each_runs_rows_and_drops_the_index() {
        let (_dir, path, conn) = store_of_schema(6);
        let event = |run: &str, seq: u64| crate::StoredEvent {
            run_id: run.into(),
            seq,
            at_ms: seq as i64,
            version: 1,
            kind: "note_added".into(),
            body: format!("{{\"kind\":\"note_added\",\"n\":{seq}}}"),
            prev_hash: format!("p{seq}"),
            hash: format!("h{seq}"),
        };
        // Rows of two runs, interleaved: a 1-2, b 1, a 3-4, b 2-3, a 5.
        let mut expected: std::collections::HashMap<&str, Vec<crate::StoredEvent>> =
            Default::default();
        for (run, first, last) in [
            ("a", 1, 2),
            ("b", 1, 1),
            ("a", 3, 4),
            ("b", 2, 3),
            ("a", 5, 5),
        ] {
            let events: Vec<_> = (first..=last).map(|seq| event(run, seq)).collect();
            let (codec, bytes) = crate::log::pack(crate::log::encode_events(&events));
            conn.execute(
                "INSERT INTO log (run_id, first_seq, last_seq, codec, events) \
                 VALUES (?1, ?2, ?3, ?4, ?5)",
                rusqlite::params![run, first, last, codec, bytes],
            )
            .unwrap();
            expected.entry(run).or_default().extend(events);
        }
        for (run, last) in [("a", 5), ("b", 3), ("c", 0)] {
            conn.execute(
                "INSERT INTO runs (id, contract_hash, state, reason, created_at, updated_at, \
                 last_seq, last_hash) VALUES (?1, 'c', 'executing', '', 1, 1, ?2, 'h')",
                rusqlite::params![run, last],
            )
            .unwrap();
        }

        migrate(&conn, &path).unwrap();

        // Each run's rows, oldest first, by the links the migration made (ids in insert order).
        let linked = |run: &str| {
            let rows = crate::log::run_rows(&conn, run, 0).unwrap();
            assert_eq!(rows.broken, None, "run {run}");
            rows.ids
        };
        assert_eq!(linked("a"), [1, 3, 5]);
        assert_eq!(linked("b"), [2, 4]);
        assert_eq!(linked("c"), Vec::<i64>::new());
        let indexes = count(
            &conn,
            "SELECT count(*) FROM sqlite_schema WHERE type = 'index' AND tbl_name = 'log'",
        );
        assert_eq!(indexes, 0);
        let store = crate::Store::open(&path).unwrap();
        for run in ["a", "b"] {
            assert_eq!(store.events_from(run, 1).unwrap(), expected[run]);
        }
        assert_eq!(store.events_from("a", 4).unwrap(), expected["a"][3..]);
        assert_eq!(store.events_from("c", 1).unwrap(), []);
    }
}
