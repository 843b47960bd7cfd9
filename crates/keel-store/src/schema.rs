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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schema_4_moves_each_projection_into_its_own_table() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keel.db");
        let conn = Connection::open(&path).unwrap();
        for (i, migration) in MIGRATIONS.iter().take(3).enumerate() {
            conn.execute_batch(&format!("{migration}; PRAGMA user_version = {};", i + 1))
                .unwrap();
        }
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
}
