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
];

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
        conn.execute_batch(&format!(
            "BEGIN IMMEDIATE; {migration}; PRAGMA user_version = {next}; COMMIT;"
        ))
        .map_err(sql)?;
    }
    Ok(())
}
