//! keel-store: the durable store.
//!
//! One SQLite file (WAL, `synchronous = FULL`: every commit is fsynced) holds each run's
//! hash-chained event log and the projections that follow from it (runs, steps, budgets,
//! evidence, checkpoints). Every commit appends events and updates the projections in one
//! transaction and checks the writer's fencing token, so the state read at resume never
//! disagrees with the log and a process that lost its lease cannot write.
//!
//! Large payloads live in the content-addressed [`Artifacts`] store beside the database.

mod artifacts;
mod batch;
mod blob;
mod dirs;
mod fault;
pub mod log;
mod schema;
mod verify;
pub mod vfs;
mod write;

use std::path::{Path, PathBuf};

use keel_core::checkpoint::Checkpoint;
use keel_core::event::{Envelope, Event, EventBody};
use keel_core::run::Run;
use rusqlite::{Connection, OptionalExtension, TransactionBehavior, params};
use write::{Head, Rows, Written};

pub use artifacts::Artifacts;
pub use batch::CommitStats;
pub use verify::{ChainProblem, verify_chain};

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("store {path}: {source}")]
    Sqlite {
        path: PathBuf,
        #[source]
        source: rusqlite::Error,
    },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("no run `{0}` in this store (see `keel status` for the runs it has)")]
    NoSuchRun(String),
    #[error("`{prefix}` matches several runs ({}); give more of the id", matches.join(", "))]
    AmbiguousRun {
        prefix: String,
        matches: Vec<String>,
    },
    #[error(
        "run {run} is held by {holder} until {} (UTC); wait for that process to finish or stop it \
         (a holder on another machine that died holds the run until then)",
        keel_core::time::rfc3339(*until_ms)
    )]
    LeaseHeld {
        run: String,
        holder: String,
        until_ms: i64,
    },
    #[error(
        "run {run} was taken over by another process (lease {actual}, ours {ours}); this process stops writing"
    )]
    LeaseLost { run: String, ours: u64, actual: u64 },
    #[error(
        "run {run}: expected to append at sequence number {expected}, but the log is at {actual}"
    )]
    Conflict {
        run: String,
        expected: u64,
        actual: u64,
    },
    #[error(
        "run {run}: the log's last event {seq} is not the one this process last wrote; it stops writing (`keel resume {run}` goes on from what is stored)"
    )]
    HeadMoved { run: String, seq: u64 },
    #[error("run {run}, event {seq}: {message}")]
    Decode {
        run: String,
        seq: u64,
        message: String,
    },
    #[error(
        "run {run}: its stored projection does not decode ({message}); `keel resume {run}` rebuilds it from the event log"
    )]
    Projection { run: String, message: String },
    #[error(
        "store {path} was written by a newer keel (schema {found}, this keel knows up to {known}); upgrade keel"
    )]
    NewerSchema {
        path: PathBuf,
        found: i64,
        known: i64,
    },
    #[error(
        "artifact {hash} in the store is damaged: {reason}; `keel verify-log` lists what else is"
    )]
    DamagedBlob { hash: String, reason: String },
    /// The transaction a commit shared with others of this process failed (it could not
    /// begin, or its commit or fsync failed); whether it was written is as for a commit alone
    /// that failed the same way.
    #[error(
        "store {path}: the transaction of {size} commits this one was part of failed: {message}"
    )]
    SharedCommit {
        path: PathBuf,
        size: usize,
        message: String,
    },
}

impl StoreError {
    pub(crate) fn io(path: &Path, source: std::io::Error) -> StoreError {
        StoreError::Io {
            path: path.to_path_buf(),
            source,
        }
    }
}

/// An event as stored: the envelope, the exact body text the hash covers, and the chain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredEvent {
    pub run_id: String,
    pub seq: u64,
    pub at_ms: i64,
    pub version: u32,
    pub kind: String,
    pub body: String,
    pub prev_hash: String,
    pub hash: String,
}

impl StoredEvent {
    pub fn computed_hash(&self) -> String {
        Envelope {
            prev_hash: &self.prev_hash,
            run_id: &self.run_id,
            seq: self.seq,
            at_ms: self.at_ms,
            version: self.version,
            kind: &self.kind,
            body: &self.body,
        }
        .hash()
    }

    pub fn decode(&self) -> Result<Event, StoreError> {
        let body = EventBody::decode(self.version, &self.body).map_err(|e| StoreError::Decode {
            run: self.run_id.clone(),
            seq: self.seq,
            message: e.to_string(),
        })?;
        Ok(Event {
            run_id: self.run_id.clone(),
            seq: self.seq,
            at_ms: self.at_ms,
            body,
        })
    }
}

/// The right to write a run: whoever holds the newest token. Every commit checks it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    pub run_id: String,
    pub token: u64,
    pub holder: String,
}

/// Who holds a run now, as the runs table says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseInfo {
    pub holder: Option<String>,
    pub token: u64,
    pub until_ms: i64,
}

/// A stored checkpoint: its body (JSON of [`Checkpoint`]) and the hash its event recorded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointRow {
    pub n: u32,
    pub seq: u64,
    pub at_ms: i64,
    pub hash: String,
    pub snapshot_ref: String,
    pub commit: String,
    pub body: String,
}

impl CheckpointRow {
    pub fn decode(&self, run: &str) -> Result<Checkpoint, StoreError> {
        serde_json::from_str(&self.body).map_err(|e| StoreError::Decode {
            run: run.to_string(),
            seq: self.seq,
            message: format!("checkpoint {}: {e}", self.n),
        })
    }
}

/// The base of a series of artifacts: the last one stored alone.
struct Base {
    hash: String,
    bytes: Vec<u8>,
    /// The length of its stored frame.
    stored_len: usize,
}

pub struct Store {
    conn: Connection,
    path: PathBuf,
    artifacts: Artifacts,
    /// Small artifacts waiting for the next commit, which stores them in its transaction: hash,
    /// codec (see `blob`), stored bytes.
    pending_blobs: std::cell::RefCell<Vec<(String, i64, Vec<u8>)>>,
    /// Contracts waiting for the next commit (the creation of the run that names them).
    pending_contracts: std::cell::RefCell<Vec<batch::ContractText>>,
    /// The base of each series of artifacts (see [`Store::put_artifact_in`]). Stored alone,
    /// with a commit of this connection or waiting for one.
    series: std::cell::RefCell<std::collections::HashMap<String, Base>>,
    /// The `steps` and `budgets` rows this connection last wrote for each run it holds, so a
    /// commit rewrites only the rows that changed (a long run has thousands of steps).
    rows: std::cell::RefCell<std::collections::HashMap<String, Rows>>,
    /// Event commits made through this connection (for the benchmark's count per step).
    commits: std::cell::Cell<u64>,
    /// Shared by every connection this process has to the same file: its writers queue here
    /// rather than in SQLite's busy handler, which sleeps and retries and, with many threads,
    /// can leave one waiting past the busy timeout (`database is locked`); and commits that
    /// wait are written together (see `batch`).
    writer: std::sync::Arc<batch::Writers>,
    /// Whether this connection's commits may share a transaction with others (the default).
    grouped: bool,
    /// How long a commit of this connection waits for another process's write lock.
    busy: std::time::Duration,
}

/// How long a connection waits for another process's write lock unless told otherwise.
const BUSY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Runs `f` again, for up to [`BUSY_TIMEOUT`], while SQLite answers "database is locked"
/// without having waited: it does not call the busy handler where waiting could deadlock, as
/// when connections that opened a new store at once each turn it to WAL or create its schema.
pub(crate) fn retry_busy<T>(mut f: impl FnMut() -> rusqlite::Result<T>) -> rusqlite::Result<T> {
    let start = std::time::Instant::now();
    loop {
        match f() {
            Err(rusqlite::Error::SqliteFailure(e, _))
                if e.code == rusqlite::ErrorCode::DatabaseBusy
                    && start.elapsed() < BUSY_TIMEOUT =>
            {
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            other => return other,
        }
    }
}

/// A connection to the SQLite file at `path` (created if missing) through keel-store's VFS
/// ([`vfs`]: a commit's WAL frames written in one `pwrite`), with no other setting changed.
pub fn open_connection(path: &Path) -> rusqlite::Result<Connection> {
    let vfs = vfs::name()
        .map_err(|code| rusqlite::Error::SqliteFailure(rusqlite::ffi::Error::new(code), None))?;
    Connection::open_with_flags_and_vfs(path, rusqlite::OpenFlags::default(), vfs)
}

/// The page size of a store keel makes (see [`connect`]).
pub const PAGE_SIZE: i64 = 2048;

/// A connection to the store file at `path` (created if missing) with keel's settings: its VFS,
/// [`PAGE_SIZE`] for a new file, WAL, `synchronous = FULL`. The schema is not touched.
/// keel-bench's floor is a commit through such a connection.
pub fn connect(path: &Path) -> Result<Connection, StoreError> {
    let sql = |source| StoreError::Sqlite {
        path: path.to_path_buf(),
        source,
    };
    let conn = open_connection(path).map_err(sql)?;
    conn.busy_timeout(BUSY_TIMEOUT).map_err(sql)?;
    // A new store's pages are 2 KB rather than SQLite's 4 KB: every commit writes whole pages
    // to the WAL (the database header, the run's row, the log's leaf and its parent), mostly
    // room they leave empty, and on a VM a sync's CPU grows with the bytes it writes. A no-op
    // step's row of events (about 2.8 KB) then fills one overflow page and keeps the rest, under
    // 1 KB, in a leaf it shares with the next row: a commit writes 4 or 5 pages of 2 KB where
    // it wrote 4 of 4 KB. Measured in docs/performance.md ("What the figures show"). SQLite
    // sets a file's page size when it writes its first page, so an existing store keeps the
    // size it was made with, and keel reads either.
    conn.pragma_update(None, "page_size", PAGE_SIZE)
        .map_err(sql)?;
    retry_busy(|| conn.pragma_update(None, "journal_mode", "WAL")).map_err(sql)?;
    conn.pragma_update(None, "synchronous", "FULL")
        .map_err(sql)?;
    // SQLite's page cache is per connection (2 MB by default). A process driving many runs
    // has a connection for each; 512 KB holds what one resume reads. Their event commits are
    // written through one connection of the process (see `batch`), whose cache stays warm.
    conn.pragma_update(None, "cache_size", -512).map_err(sql)?;
    // A group commit runs each commit in a savepoint (see `batch`), and SQLite keeps the pages
    // a savepoint changes in a statement journal, written to a temporary file once it passes
    // 64 KiB: with 64 runs in flight that was a file made and removed every few transactions,
    // and on ext4 without a journal a file's creation passes over every inode freed in the
    // last minute. In memory it costs what those pages take, until the transaction ends.
    conn.pragma_update(None, "temp_store", "MEMORY")
        .map_err(sql)?;
    Ok(conn)
}

/// The writers of the store file at `path` in this process: shared while any connection to it
/// is open, so the write connection they hold is closed with the last.
fn writer_lock(path: &Path) -> std::sync::Arc<batch::Writers> {
    type Locks =
        std::sync::Mutex<std::collections::HashMap<PathBuf, std::sync::Weak<batch::Writers>>>;
    static LOCKS: std::sync::OnceLock<Locks> = std::sync::OnceLock::new();
    let key = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    let mut locks = LOCKS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some(writers) = locks.get(&key).and_then(std::sync::Weak::upgrade) {
        return writers;
    }
    // Files no connection holds any more are let go, so a process that opens many stores
    // (a test suite) keeps only the open ones.
    locks.retain(|_, writers| writers.strong_count() > 0);
    let writers = std::sync::Arc::new(batch::Writers::default());
    locks.insert(key, std::sync::Arc::downgrade(&writers));
    writers
}

/// Artifacts up to this size live in the store's `blobs` table, written in the transaction of
/// the events that name them; larger ones are files under `artifacts/`.
pub const INLINE_ARTIFACT_BYTES: usize = 256 * 1024;

impl Store {
    /// Opens (creating if needed) the store at `path`; artifacts go to `artifacts/` beside it.
    pub fn open(path: &Path) -> Result<Store, StoreError> {
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            dirs::create_synced(parent).map_err(|e| StoreError::io(parent, e))?;
        }
        let new = std::fs::symlink_metadata(path).is_err();
        let conn = connect(path)?;
        schema::migrate(&conn, path)?;
        if new {
            // SQLite syncs the file, not its name (see `dirs`).
            dirs::sync_holder(path).map_err(|e| StoreError::io(path, e))?;
        }
        let dir = path.parent().unwrap_or(Path::new(".")).join("artifacts");
        Ok(Store {
            conn,
            path: path.to_path_buf(),
            artifacts: Artifacts::new(dir),
            pending_blobs: std::cell::RefCell::new(Vec::new()),
            pending_contracts: std::cell::RefCell::new(Vec::new()),
            series: std::cell::RefCell::new(std::collections::HashMap::new()),
            rows: std::cell::RefCell::new(std::collections::HashMap::new()),
            commits: std::cell::Cell::new(0),
            writer: writer_lock(path),
            grouped: true,
            busy: BUSY_TIMEOUT,
        })
    }

    /// Stores an artifact and returns its hash (scrubbed of secrets first, like every artifact).
    /// A small one is kept for the next commit, which writes it in the same transaction as
    /// the events: only a committed event can name it, so it needs no fsync of its own. A
    /// large one is written to a file under `artifacts/` and fsynced at once.
    pub fn put_artifact(&self, bytes: &[u8]) -> Result<String, StoreError> {
        if bytes.len() > INLINE_ARTIFACT_BYTES {
            return self.artifacts.put(bytes);
        }
        let bytes = self.artifacts.scrub(bytes);
        let hash = blake3::hash(&bytes).to_hex().to_string();
        let mut pending = self.pending_blobs.borrow_mut();
        if !pending.iter().any(|(h, _, _)| *h == hash) {
            let (codec, stored) = blob::encode(&bytes);
            pending.push((hash.clone(), codec, stored.into_owned()));
        }
        Ok(hash)
    }

    /// [`Store::put_artifact`] for an artifact of a series of much alike ones (a run's requests:
    /// each is mostly the one before). A small one may be stored against the series' base, the
    /// last of its artifacts stored alone: an LZ4 block with the base's bytes as its dictionary
    /// (`blob::LZ4_BASED`). It is when that takes at most a third of what it takes alone (first
    /// estimated from the base's own ratio, and compressed alone to know only when the estimate
    /// says no); otherwise it is stored alone and becomes the base. A base is always stored
    /// alone, so a read needs at most one other blob; the series starts afresh with each
    /// connection (a resumed run) and after a cut tail.
    pub fn put_artifact_in(&self, series: &str, bytes: &[u8]) -> Result<String, StoreError> {
        if bytes.len() > INLINE_ARTIFACT_BYTES {
            return self.artifacts.put(bytes);
        }
        let bytes = self.artifacts.scrub(bytes);
        let hash = blake3::hash(&bytes).to_hex().to_string();
        let mut pending = self.pending_blobs.borrow_mut();
        if pending.iter().any(|(h, _, _)| *h == hash) {
            return Ok(hash);
        }
        let mut bases = self.series.borrow_mut();
        // Against the base when that takes at most a third of what the artifact takes alone.
        // What it takes alone is first estimated from the base (alike text compresses alike:
        // the base's frame, scaled by the lengths), and compressed to know only when the
        // estimate says no, so a step compresses its request once.
        let based = bases
            .get(series)
            .filter(|base| base.hash != hash)
            .and_then(|base| {
                let frame = blob::encode_based(&bytes, &base.hash, &base.bytes)?;
                let estimate = base.stored_len * bytes.len() / base.bytes.len().max(1);
                Some((frame, estimate))
            });
        let alone = |bytes: &[u8]| {
            let (codec, alone) = blob::encode(bytes);
            (codec, alone.into_owned())
        };
        let (codec, frame) = match based {
            Some((frame, estimate)) if frame.len() <= estimate / 3 => (blob::LZ4_BASED, frame),
            Some((frame, _)) => match alone(&bytes) {
                (_, stored) if frame.len() <= stored.len() / 3 => (blob::LZ4_BASED, frame),
                stored => stored,
            },
            None => alone(&bytes),
        };
        if codec != blob::LZ4_BASED {
            bases.insert(
                series.to_string(),
                Base {
                    hash: hash.clone(),
                    stored_len: frame.len(),
                    bytes: bytes.into_owned(),
                },
            );
        }
        pending.push((hash.clone(), codec, frame));
        Ok(hash)
    }

    /// Stores a command's output file: one of up to [`INLINE_ARTIFACT_BYTES`] as a small
    /// artifact (stored with the next commit's events, see [`Store::put_artifact`]), a larger
    /// one as a file of its own.
    pub fn put_output_file(&self, path: &Path) -> Result<String, StoreError> {
        let size = std::fs::metadata(path)
            .map_err(|e| StoreError::io(path, e))?
            .len();
        if size > INLINE_ARTIFACT_BYTES as u64 {
            return self.artifacts.put_file(path);
        }
        let bytes = std::fs::read(path).map_err(|e| StoreError::io(path, e))?;
        self.put_artifact(&bytes)
    }

    /// An artifact's bytes (at most `limit`), wherever it is kept. One stored with a run's
    /// events is searched for in every run's rows: with the run at hand,
    /// [`Store::read_run_artifact`] looks at its rows alone.
    pub fn read_artifact(&self, hash: &str, limit: usize) -> Result<Vec<u8>, StoreError> {
        self.read_artifact_of(None, hash, limit)
    }

    /// An artifact's bytes (at most `limit`): one this connection is waiting to store, one
    /// stored with the events of run `id` (of any run for `None`), one stored before schema 6,
    /// or a file.
    fn read_artifact_of(
        &self,
        id: Option<&str>,
        hash: &str,
        limit: usize,
    ) -> Result<Vec<u8>, StoreError> {
        if let Some(bytes) = self.pending_blob(hash)? {
            return Ok(cut_to(bytes, limit));
        }
        if let Some(bytes) = self.inline_blob(id, hash)? {
            return Ok(cut_to(bytes, limit));
        }
        match self.blob(hash)? {
            Some(b) => Ok(cut_to(b, limit)),
            None => self.artifacts.read(hash, limit),
        }
    }

    /// Whether the artifact exists (stored with a run's events, in schema 5's table or as a
    /// file) and still has the content its name says.
    pub fn verify_artifact(&self, hash: &str) -> Result<bool, StoreError> {
        match self.inline_blob(None, hash) {
            Ok(Some(b)) => return Ok(blake3::hash(&b).to_hex().as_str() == hash),
            Ok(None) => {}
            Err(StoreError::DamagedBlob { .. }) => return Ok(false),
            Err(e) => return Err(e),
        }
        match self.blob(hash) {
            Ok(Some(b)) => Ok(blake3::hash(&b).to_hex().as_str() == hash),
            Ok(None) => self.artifacts.verify(hash),
            Err(StoreError::DamagedBlob { .. }) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// A small artifact this connection is waiting to store.
    fn pending_blob(&self, hash: &str) -> Result<Option<Vec<u8>>, StoreError> {
        let found = self
            .pending_blobs
            .borrow()
            .iter()
            .find(|(h, _, _)| h == hash)
            .map(|(_, codec, b)| (*codec, b.clone()));
        found
            .map(|(codec, stored)| self.decode_stored(None, hash, codec, stored))
            .transpose()
    }

    /// A small artifact stored with the events of run `id` (newest rows first), or of any run.
    fn inline_blob(&self, id: Option<&str>, hash: &str) -> Result<Option<Vec<u8>>, StoreError> {
        self.inline_frame(id, hash)?
            .map(|(codec, stored)| self.decode_stored(id, hash, codec, stored))
            .transpose()
    }

    /// The bytes of the blob `hash` as stored (`codec`, `stored`), decoded; one stored against a
    /// base is decoded with its base's bytes, looked for where `hash` was (waiting, or in the
    /// rows of run `id`, of any run for `None`). A base must be stored alone.
    fn decode_stored(
        &self,
        id: Option<&str>,
        hash: &str,
        codec: i64,
        stored: Vec<u8>,
    ) -> Result<Vec<u8>, StoreError> {
        if codec != blob::LZ4_BASED {
            return blob::decode(hash, codec, stored);
        }
        let damaged = |reason: String| StoreError::DamagedBlob {
            hash: hash.to_string(),
            reason,
        };
        let base_hash = blob::base_of(&stored)
            .ok_or_else(|| damaged("its frame does not name its base".into()))?
            .to_string();
        let pending = self
            .pending_blobs
            .borrow()
            .iter()
            .find(|(h, _, _)| *h == base_hash)
            .map(|(_, codec, b)| (*codec, b.clone()));
        let base_damaged = |e: StoreError| match e {
            StoreError::DamagedBlob { reason, .. } => {
                damaged(format!("its base {base_hash} is damaged: {reason}"))
            }
            other => other,
        };
        let base = match pending {
            Some(found) => Some(found),
            None => self.inline_frame(id, &base_hash).map_err(base_damaged)?,
        };
        let Some((base_codec, base)) = base else {
            return Err(damaged(format!("its base {base_hash} is not stored")));
        };
        if base_codec == blob::LZ4_BASED {
            return Err(damaged(format!(
                "its base {base_hash} is itself stored against another"
            )));
        }
        let base = blob::decode(&base_hash, base_codec, base).map_err(base_damaged)?;
        blob::decode_based(hash, &stored, &base)
    }

    /// A small artifact stored with the events of run `id` (newest rows first), or of any run,
    /// as stored: its codec and bytes.
    fn inline_frame(
        &self,
        id: Option<&str>,
        hash: &str,
    ) -> Result<Option<(i64, Vec<u8>)>, StoreError> {
        let _snapshot = ReadSnapshot::take(&self.conn).map_err(|e| self.sql(e))?;
        let mut found = None;
        match id {
            Some(id) => {
                // The run's rows by their links, newest first; a broken link ends the search
                // (the log's own checks report it).
                let mut names = self
                    .conn
                    .prepare_cached("SELECT blob_hashes FROM log WHERE id = ?1")
                    .map_err(|e| self.sql(e))?;
                log::walk_rows(&self.conn, id, 0, |row| {
                    let named: Option<Vec<u8>> = names.query_row([row], |r| r.get(0))?;
                    if named.is_some_and(|n| log::names_blob(&n, hash)) {
                        found = Some(row);
                        return Ok(false);
                    }
                    Ok(true)
                })
                .map_err(|e| self.sql(e))?;
            }
            None => {
                let mut stmt = self
                    .conn
                    .prepare_cached("SELECT id, blob_hashes FROM log WHERE blob_hashes IS NOT NULL")
                    .map_err(|e| self.sql(e))?;
                let mut rows = stmt.query([]).map_err(|e| self.sql(e))?;
                while let Some(r) = rows.next().map_err(|e| self.sql(e))? {
                    let names = r
                        .get_ref(1)
                        .and_then(|v| Ok(v.as_bytes()?))
                        .map_err(|e| self.sql(e))?;
                    if log::names_blob(names, hash) {
                        found = Some(r.get::<_, i64>(0).map_err(|e| self.sql(e))?);
                        break;
                    }
                }
            }
        }
        let Some(row) = found else {
            return Ok(None);
        };
        let stored: Option<Vec<u8>> = self
            .conn
            .query_row("SELECT blobs FROM log WHERE id = ?1", [row], |r| r.get(0))
            .map_err(|e| self.sql(e))?;
        let damaged = |reason: String| StoreError::DamagedBlob {
            hash: hash.to_string(),
            reason,
        };
        let blobs = log::decode_blobs(&stored.unwrap_or_default())
            .map_err(|e| damaged(format!("the artifacts stored with it do not decode: {e}")))?;
        match blobs.into_iter().find(|(h, _, _)| h == hash) {
            Some((_, codec, bytes)) => Ok(Some((codec, bytes))),
            None => Err(damaged("its row names it but does not hold it".to_string())),
        }
    }

    /// A small artifact's bytes from the `blobs` table, decoded.
    fn blob(&self, hash: &str) -> Result<Option<Vec<u8>>, StoreError> {
        let stored: Option<(i64, Vec<u8>)> = self
            .conn
            .prepare_cached("SELECT codec, bytes FROM blobs WHERE hash = ?1")
            .and_then(|mut q| {
                q.query_row([hash], |r| Ok((r.get(0)?, r.get(1)?)))
                    .optional()
            })
            .map_err(|e| self.sql(e))?;
        stored
            .map(|(codec, bytes)| blob::decode(hash, codec, bytes))
            .transpose()
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// How many times [`Store::commit`] has committed through this connection.
    pub fn commits(&self) -> u64 {
        self.commits.get()
    }

    pub fn artifacts(&self) -> &Artifacts {
        &self.artifacts
    }

    /// Every artifact stored from now on is scrubbed of these secrets.
    pub fn set_scrubber(&mut self, scrubber: std::sync::Arc<keel_core::secret::Scrubber>) {
        self.artifacts.set_scrubber(scrubber);
    }

    fn sql(&self, source: rusqlite::Error) -> StoreError {
        StoreError::Sqlite {
            path: self.path.clone(),
            source,
        }
    }

    /// Stores a contract's exact text under its hash, with the next commit of this connection
    /// (the run that names it is created in that commit): once, a contract already stored is
    /// not written again.
    pub fn put_contract(&self, hash: &str, file: &str, source: &str) -> Result<(), StoreError> {
        // A read never waits for a writer (WAL); most runs of a contract find it stored.
        let stored = self
            .conn
            .prepare_cached("SELECT 1 FROM contracts WHERE hash = ?1")
            .and_then(|mut q| q.exists([hash]))
            .map_err(|e| self.sql(e))?;
        let mut pending = self.pending_contracts.borrow_mut();
        if !stored && !pending.iter().any(|c| c.hash == hash) {
            pending.push(batch::ContractText {
                hash: hash.to_string(),
                file: file.to_string(),
                source: source.to_string(),
            });
        }
        Ok(())
    }

    /// The exact text of a contract by its hash.
    pub fn contract(&self, hash: &str) -> Result<Option<(String, String)>, StoreError> {
        self.conn
            .query_row(
                "SELECT file, source FROM contracts WHERE hash = ?1",
                [hash],
                |r| Ok((text(r, 0)?, text(r, 1)?)),
            )
            .optional()
            .map_err(|e| self.sql(e))
    }

    /// Inserts a new run with its `run_created` event and takes its lease, with the contracts
    /// [`Store::put_contract`] left waiting, in one transaction (shared with other threads'
    /// commits, see [`Store::commit`]).
    pub fn create_run(
        &mut self,
        created: &Event,
        run: &Run,
        holder: &str,
        now_ms: i64,
        ttl_ms: i64,
    ) -> Result<Lease, StoreError> {
        let lease = Lease {
            run_id: run.id.clone(),
            token: 1,
            holder: holder.to_string(),
        };
        self.write(
            &lease,
            std::slice::from_ref(created),
            run,
            None,
            now_ms + ttl_ms,
            batch::Extra {
                create: Some(batch::NewRun {
                    holder: holder.to_string(),
                    lease_until_ms: now_ms + ttl_ms,
                }),
                release: false,
            },
        )?;
        Ok(lease)
    }

    /// Takes the lease of a run: when nobody holds it, when it has expired, when `is_stale`
    /// says its holder is gone (a process on this machine that no longer exists), or when
    /// `force` is set (cancel). The token goes up, so the previous holder's writes fail.
    pub fn acquire(
        &mut self,
        run_id: &str,
        holder: &str,
        now_ms: i64,
        ttl_ms: i64,
        force: bool,
        is_stale: &dyn Fn(&str) -> bool,
    ) -> Result<Lease, StoreError> {
        let path = self.path.clone();
        let sql = |source| StoreError::Sqlite {
            path: path.clone(),
            source,
        };
        let writer = std::sync::Arc::clone(&self.writer);
        let _queued = writer
            .lock
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(sql)?;
        let row: Option<(Option<String>, u64, i64)> = tx
            .query_row(
                "SELECT lease_holder, lease_token, lease_until FROM runs WHERE id = ?1",
                [run_id],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
            )
            .optional()
            .map_err(sql)?;
        let Some((current, token, until)) = row else {
            return Err(StoreError::NoSuchRun(run_id.to_string()));
        };
        if let Some(current) = current {
            let free = force || until < now_ms || current == holder || is_stale(&current);
            if !free {
                return Err(StoreError::LeaseHeld {
                    run: run_id.to_string(),
                    holder: current,
                    until_ms: until,
                });
            }
        }
        let token = token + 1;
        // Another process may have written the run's rows since this one last did.
        self.rows.borrow_mut().remove(run_id);
        tx.execute(
            "UPDATE runs SET lease_holder = ?2, lease_token = ?3, lease_until = ?4 WHERE id = ?1",
            params![run_id, holder, token, now_ms + ttl_ms],
        )
        .map_err(sql)?;
        tx.commit().map_err(sql)?;
        Ok(Lease {
            run_id: run_id.to_string(),
            token,
            holder: holder.to_string(),
        })
    }

    /// Gives the lease back (only if it is still ours).
    pub fn release(&self, lease: &Lease) -> Result<(), StoreError> {
        let _queued = self
            .writer
            .lock
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        self.conn
            .execute(
                "UPDATE runs SET lease_holder = NULL, lease_until = 0 WHERE id = ?1 AND lease_token = ?2",
                params![lease.run_id, lease.token],
            )
            .map_err(|e| self.sql(e))?;
        Ok(())
    }

    /// Extends a lease that is still ours (a heartbeat during a long step). Returns whether it
    /// still was.
    pub fn renew(&self, run_id: &str, holder: &str, until_ms: i64) -> Result<bool, StoreError> {
        let _queued = self
            .writer
            .lock
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let n = self
            .conn
            .execute(
                "UPDATE runs SET lease_until = ?3 WHERE id = ?1 AND lease_holder = ?2",
                params![run_id, holder, until_ms],
            )
            .map_err(|e| self.sql(e))?;
        Ok(n == 1)
    }

    pub fn lease_info(&self, run_id: &str) -> Result<LeaseInfo, StoreError> {
        self.conn
            .query_row(
                "SELECT lease_holder, lease_token, lease_until FROM runs WHERE id = ?1",
                [run_id],
                |r| {
                    Ok(LeaseInfo {
                        holder: r.get(0)?,
                        token: r.get(1)?,
                        until_ms: r.get(2)?,
                    })
                },
            )
            .optional()
            .map_err(|e| self.sql(e))?
            .ok_or_else(|| StoreError::NoSuchRun(run_id.to_string()))
    }

    /// Appends `events` (already applied to `run`, which is the projection after them) and
    /// updates every projection, in one fsynced transaction, if the lease is still ours and the
    /// log is where the caller thinks it is. A checkpoint row is written in the same transaction.
    /// Commits other threads of this process make to the same file at the same moment may share
    /// the transaction and its fsync (see `batch`); each is checked and refused on its own.
    pub fn commit(
        &mut self,
        lease: &Lease,
        events: &[Event],
        run: &Run,
        checkpoint: Option<&Checkpoint>,
        lease_until_ms: i64,
    ) -> Result<(), StoreError> {
        let extra = batch::Extra::default();
        self.write(lease, events, run, checkpoint, lease_until_ms, extra)
    }

    /// [`Store::commit`], and the lease given back in the same transaction (a run whose drive
    /// ends here). `events` may be empty.
    pub fn commit_and_release(
        &mut self,
        lease: &Lease,
        events: &[Event],
        run: &Run,
        checkpoint: Option<&Checkpoint>,
    ) -> Result<(), StoreError> {
        let extra = batch::Extra {
            create: None,
            release: true,
        };
        self.write(lease, events, run, checkpoint, 0, extra)
    }

    /// One write through this process's shared transactions (see `batch`), with the artifacts
    /// and contracts waiting for it. Counted in [`Store::commits`] when it appends events to a
    /// run that was there.
    fn write(
        &mut self,
        lease: &Lease,
        events: &[Event],
        run: &Run,
        checkpoint: Option<&Checkpoint>,
        lease_until_ms: i64,
        extra: batch::Extra,
    ) -> Result<(), StoreError> {
        let written = match self.rows.borrow_mut().remove(&lease.run_id) {
            Some(rows) if rows.token == lease.token => Written::Known(rows),
            _ if extra.create.is_some() => Written::Rewrite(Head::default()),
            _ => Written::Unknown,
        };
        let creates = extra.create.is_some();
        // Artifacts go into the row of a commit with events (one that names them).
        let blobs = if events.is_empty() {
            Vec::new()
        } else {
            std::mem::take(&mut *self.pending_blobs.borrow_mut())
        };
        let contracts = std::mem::take(&mut *self.pending_contracts.borrow_mut());
        let keep_waiting = |store: &Store| {
            // The blobs and contracts stay waiting for the next commit, as the events that
            // name them do.
            store
                .pending_blobs
                .borrow_mut()
                .extend(blobs.iter().cloned());
            store
                .pending_contracts
                .borrow_mut()
                .extend(contracts.iter().cloned());
        };
        let commit = write::Commit {
            lease,
            events,
            run,
            checkpoint,
            lease_until_ms,
            blobs: &blobs,
            contracts: &contracts,
            extra,
        };
        // Made ready (encoded, hashed, compressed) before the write lock is taken.
        let prepared = match write::prepare(&self.conn, &commit, written) {
            Ok(p) => p,
            Err(e) => {
                keep_waiting(self);
                return Err(e.into_store(&self.path));
            }
        };
        let writer = std::sync::Arc::clone(&self.writer);
        match writer.commit(
            &mut self.conn,
            &self.path,
            prepared,
            self.grouped,
            self.busy,
        ) {
            Ok(rows) => {
                if !events.is_empty() && !creates {
                    self.commits.set(self.commits.get() + 1);
                }
                // Only a committed write is remembered: after a failure the rows are read again.
                self.rows.borrow_mut().insert(lease.run_id.clone(), rows);
                Ok(())
            }
            Err(e) => {
                keep_waiting(self);
                Err(e)
            }
        }
    }

    /// Holds this process's write lock of the store file until the guard is dropped: commits
    /// other threads make meanwhile wait, and are then written together. For work that must
    /// see the store still, and for tests of shared commits.
    pub fn hold_writes(&self) -> std::sync::MutexGuard<'_, ()> {
        self.writer
            .lock
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// How many commits of this process wait for the write lock of this store file.
    pub fn waiting_commits(&self) -> usize {
        self.writer.waiting()
    }

    /// The transactions [`Store::commit`] has written to this store file in this process, and
    /// the commits they held (more commits than transactions: commits shared one).
    pub fn shared_commit_stats(&self) -> CommitStats {
        self.writer.stats()
    }

    /// How long this connection waits for another process's write lock before a write fails
    /// (10 seconds unless set).
    pub fn set_busy_timeout(&mut self, timeout: std::time::Duration) -> Result<(), StoreError> {
        self.busy = timeout;
        self.conn.busy_timeout(timeout).map_err(|e| self.sql(e))
    }

    /// Whether this connection's commits may share a transaction (and its fsync) with the
    /// commits other threads of this process make at the same moment (on by default). Off, each
    /// commit is a transaction of its own: the benchmark's reference.
    pub fn set_grouped(&mut self, grouped: bool) {
        self.grouped = grouped;
    }

    /// Cuts a torn tail: removes the events from `from_seq` on (and the checkpoints and evidence
    /// that came with them), then appends `events` (the `tail_cut` record) onto the remaining
    /// chain and stores `run`, the projection rebuilt without the removed events.
    pub fn cut_tail(
        &mut self,
        lease: &Lease,
        from_seq: u64,
        events: &[Event],
        run: &Run,
        lease_until_ms: i64,
    ) -> Result<(), StoreError> {
        let path = self.path.clone();
        let writer = std::sync::Arc::clone(&self.writer);
        let _queued = writer
            .lock
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        // A base may be in a row the cut removes: every series starts afresh, and an artifact
        // waiting to be stored against a base is stored alone.
        self.series.borrow_mut().clear();
        let waiting = self.pending_blobs.borrow().clone();
        let mut blobs = Vec::with_capacity(waiting.len());
        for (hash, codec, stored) in waiting {
            if codec == blob::LZ4_BASED {
                // Decoded while its base may still be waiting with it.
                let bytes = self.decode_stored(Some(&lease.run_id), &hash, codec, stored)?;
                let (codec, alone) = blob::encode(&bytes);
                blobs.push((hash, codec, alone.into_owned()));
            } else {
                blobs.push((hash, codec, stored));
            }
        }
        self.pending_blobs.borrow_mut().clear();
        let written = (|| -> Result<(), TxError> {
            let tx = self
                .conn
                .transaction_with_behavior(TransactionBehavior::Immediate)?;
            let id = &lease.run_id;
            // Rows wholly after the cut go; a row the cut falls in keeps the events before it.
            let found = log::run_rows(&tx, id, from_seq)?;
            if let Some(broken) = found.broken {
                return Err(TxError::Store(StoreError::Decode {
                    run: id.clone(),
                    seq: from_seq,
                    message: format!("the cut cannot find the rows it falls among: {broken}"),
                }));
            }
            // The run's newest row once the cut is made: the one the cut falls in, or the one
            // before the first that goes.
            if let Some(&oldest) = found.ids.first() {
                let (prev, first): (Option<i64>, u64) = tx.query_row(
                    "SELECT prev, first_seq FROM log WHERE id = ?1",
                    [oldest],
                    |r| Ok((r.get(0)?, r.get(1)?)),
                )?;
                let newest = if first >= from_seq {
                    prev
                } else {
                    Some(oldest)
                };
                tx.execute(
                    "UPDATE runs SET last_log = ?2 WHERE id = ?1",
                    params![id, newest],
                )?;
            }
            for row in found.ids {
                let (first, codec, bytes): (u64, i64, Vec<u8>) = tx.query_row(
                    "SELECT first_seq, codec, events FROM log WHERE id = ?1",
                    [row],
                    |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
                )?;
                if first >= from_seq {
                    tx.execute("DELETE FROM log WHERE id = ?1", [row])?;
                    continue;
                }
                let kept: Vec<StoredEvent> = log::decode_events(id, codec, &bytes)
                    .map_err(|message| {
                        TxError::Store(StoreError::Decode {
                            run: id.clone(),
                            seq: first,
                            message: format!(
                                "the events the cut falls among do not decode: {message}"
                            ),
                        })
                    })?
                    .into_iter()
                    .filter(|e| e.seq < from_seq)
                    .collect();
                let last = kept.last().map_or(first, |e| e.seq);
                let (codec, bytes) = log::pack(log::encode_events(&kept));
                tx.execute(
                    "UPDATE log SET last_seq = ?2, codec = ?3, events = ?4 WHERE id = ?1",
                    params![row, last, codec, bytes],
                )?;
            }
            tx.execute(
                "DELETE FROM checkpoints WHERE run_id = ?1 AND seq >= ?2 - 1",
                params![id, from_seq],
            )?;
            tx.execute(
                "DELETE FROM evidence WHERE run_id = ?1 AND n > ?2",
                params![id, run.evidence_count],
            )?;
            self.rows.borrow_mut().remove(&lease.run_id);
            rebuild(&tx, lease, events, run, lease_until_ms, &blobs)?;
            finish(tx)?;
            Ok(())
        })();
        if written.is_err() {
            self.pending_blobs.borrow_mut().extend(blobs);
        }
        written.map_err(|e| e.into_store(&path))
    }

    /// Resolves a run id or a unique prefix of one.
    pub fn resolve_run(&self, id_or_prefix: &str) -> Result<String, StoreError> {
        if id_or_prefix.trim().is_empty() {
            return Err(StoreError::NoSuchRun(id_or_prefix.to_string()));
        }
        let escaped = id_or_prefix
            .replace('\\', "\\\\")
            .replace('%', "\\%")
            .replace('_', "\\_");
        let pattern = format!("{escaped}%");
        let mut stmt = self
            .conn
            .prepare("SELECT id FROM runs WHERE id LIKE ?1 ESCAPE '\\' ORDER BY id LIMIT 6")
            .map_err(|e| self.sql(e))?;
        let ids: Vec<String> = stmt
            .query_map([pattern], |r| r.get(0))
            .map_err(|e| self.sql(e))?
            .collect::<Result<_, _>>()
            .map_err(|e| self.sql(e))?;
        if ids.iter().any(|i| i == id_or_prefix) {
            return Ok(id_or_prefix.to_string());
        }
        match ids.len() {
            0 => Err(StoreError::NoSuchRun(id_or_prefix.to_string())),
            1 => Ok(ids.into_iter().next().unwrap_or_default()),
            _ => Err(StoreError::AmbiguousRun {
                prefix: id_or_prefix.to_string(),
                matches: ids,
            }),
        }
    }

    /// The run as last committed: the stored projection with the events after it folded on.
    /// A tail event that does not decode or apply (a damaged log) ends the fold there: the
    /// run as far as its intact log goes (`verify_log` reports the damage).
    pub fn run(&self, id: &str) -> Result<Run, StoreError> {
        let (json, projection_seq, last_seq): (String, u64, u64) = self
            .conn
            .query_row(
                // A missing projection row reads as one that does not decode: resume rebuilds it.
                "SELECT COALESCE(p.body, ''), COALESCE(p.seq, 0), r.last_seq FROM runs r \
                 LEFT JOIN projections p ON p.run_id = r.id WHERE r.id = ?1",
                [id],
                |r| Ok((text(r, 0)?, r.get(1)?, r.get(2)?)),
            )
            .optional()
            .map_err(|e| self.sql(e))?
            .ok_or_else(|| StoreError::NoSuchRun(id.to_string()))?;
        let decode = || -> Result<Run, StoreError> {
            serde_json::from_str(&json).map_err(|e| StoreError::Projection {
                run: id.to_string(),
                message: e.to_string(),
            })
        };
        let mut run = decode()?;
        if projection_seq >= last_seq {
            return Ok(run);
        }
        let tail = self.events_from(id, run.seq + 1)?;
        let folded = |run: &mut Run, events: &[StoredEvent]| -> Option<usize> {
            for (i, stored) in events.iter().enumerate() {
                match stored.decode().map(|e| run.apply_in_place(&e)) {
                    Ok(Ok(())) => {}
                    _ => return Some(i),
                }
            }
            None
        };
        // Folded in place; a bad event leaves the run part-changed, so the good ones before it
        // are folded again onto a fresh copy.
        if let Some(bad) = folded(&mut run, &tail) {
            run = decode()?;
            folded(&mut run, &tail[..bad]);
        }
        Ok(run)
    }

    /// Every run's projection, newest first.
    pub fn runs(&self) -> Result<Vec<Run>, StoreError> {
        let mut stmt = self
            .conn
            .prepare("SELECT id FROM runs ORDER BY created_at DESC, id DESC")
            .map_err(|e| self.sql(e))?;
        let ids: Vec<String> = stmt
            .query_map([], |r| r.get(0))
            .map_err(|e| self.sql(e))?
            .collect::<Result<_, _>>()
            .map_err(|e| self.sql(e))?;
        ids.iter().map(|id| self.run(id)).collect()
    }

    /// Where the `steps` and `budgets` rows of run `id` disagree with its stored projection,
    /// with which they are written (see `write`): each budget's row holds the projection's used
    /// and limit; each step the projection holds has its row, with its state and attempts; each
    /// agent step it let go has a row, settled. (Rows of steps a cut tail removed stay and are
    /// not looked at.) Empty when they agree.
    pub fn projection_table_problems(&self, id: &str) -> Result<Vec<String>, StoreError> {
        let json: String = self
            .conn
            .query_row(
                "SELECT body FROM projections WHERE run_id = ?1",
                [id],
                |r| text(r, 0),
            )
            .optional()
            .map_err(|e| self.sql(e))?
            .ok_or_else(|| StoreError::NoSuchRun(id.to_string()))?;
        let projection: Run = serde_json::from_str(&json).map_err(|e| StoreError::Projection {
            run: id.to_string(),
            message: e.to_string(),
        })?;
        // The rows as a commit reads them back: the budgets', and the held steps'.
        let stored = write::stored(&self.conn, id, &projection).map_err(|e| self.sql(e))?;
        let mut problems = Vec::new();
        for name in keel_core::budget::BudgetName::ALL {
            let expected = (projection.used(name), projection.limits.get(name));
            let found = stored.budgets.get(name.as_str());
            if found != Some(&expected) {
                problems.push(format!(
                    "budget {}: the row holds {found:?}, the projection (used, limit) {expected:?}",
                    name.as_str()
                ));
            }
        }
        let mut settled = self
            .conn
            .prepare(
                "SELECT idx FROM steps WHERE run_id = ?1 AND phase = ?2 AND idx < ?3 \
                 AND state IN ('verified', 'failed')",
            )
            .map_err(|e| self.sql(e))?;
        for (p, phase) in projection.phases.iter().enumerate() {
            let rows: std::collections::HashSet<u32> = settled
                .query_map(params![id, p, phase.earlier], |r| r.get(0))
                .and_then(|rows| rows.collect())
                .map_err(|e| self.sql(e))?;
            for i in (0..phase.earlier).filter(|i| !rows.contains(i)) {
                problems.push(format!(
                    "step {p}.{i}: let go by the projection, but no row holds it settled"
                ));
            }
            for (i, step) in phase.held_steps() {
                let expected = (step.state.as_str().to_string(), step.attempts);
                let found = stored.steps.get(&(p, i as usize));
                if found != Some(&expected) {
                    problems.push(format!(
                        "step {p}.{i}: the row holds {found:?}, the projection {expected:?}"
                    ));
                }
            }
        }
        Ok(problems)
    }

    /// Where the runs table says the log ends: (last sequence number, its hash).
    pub fn log_head(&self, id: &str) -> Result<(u64, String), StoreError> {
        self.conn
            .query_row(
                "SELECT last_seq, last_hash FROM runs WHERE id = ?1",
                [id],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .optional()
            .map_err(|e| self.sql(e))?
            .ok_or_else(|| StoreError::NoSuchRun(id.to_string()))
    }

    /// Events with `seq >= from_seq`, in order.
    pub fn events_from(&self, id: &str, from_seq: u64) -> Result<Vec<StoredEvent>, StoreError> {
        let mut out = Vec::new();
        self.for_each_event(id, from_seq, |e| {
            out.push(e);
            Ok(())
        })?;
        Ok(out)
    }

    /// One event, if it exists.
    pub fn event(&self, id: &str, seq: u64) -> Result<Option<StoredEvent>, StoreError> {
        let mut found = None;
        self.for_each_row(id, seq, |events| {
            found = events.into_iter().find(|e| e.seq == seq);
            Ok(false)
        })?;
        Ok(found)
    }

    /// Streams events with `seq >= from_seq` in order, without holding them all in memory. A
    /// row whose events do not decode reads as one event that cannot be right (see
    /// [`row_events`]).
    pub fn for_each_event(
        &self,
        id: &str,
        from_seq: u64,
        mut f: impl FnMut(StoredEvent) -> Result<(), StoreError>,
    ) -> Result<(), StoreError> {
        self.for_each_row(id, from_seq, |events| {
            for event in events {
                f(event)?;
            }
            Ok(true)
        })
    }

    /// The events of each of run `id`'s log rows that hold events from `from_seq` on, a row at
    /// a time in order, until `f` says to stop. Rows whose links cannot be followed back to
    /// `from_seq` read as one event that cannot be right, where the missing events begin (see
    /// [`row_events`]), as rows whose events do not decode do.
    fn for_each_row(
        &self,
        id: &str,
        from_seq: u64,
        mut f: impl FnMut(Vec<StoredEvent>) -> Result<bool, StoreError>,
    ) -> Result<(), StoreError> {
        let _snapshot = ReadSnapshot::take(&self.conn).map_err(|e| self.sql(e))?;
        let rows = log::run_rows(&self.conn, id, from_seq).map_err(|e| self.sql(e))?;
        if let Some(broken) = &rows.broken {
            let first = from_seq.max(1);
            if !f(vec![unreadable(id, first, broken.to_string())])? {
                return Ok(());
            }
        }
        let mut stmt = self
            .conn
            .prepare_cached("SELECT first_seq, last_seq, codec, events FROM log WHERE id = ?1")
            .map_err(|e| self.sql(e))?;
        for row in rows.ids {
            let events = stmt
                .query_row([row], |r| {
                    let bytes = r.get_ref(3)?.as_bytes()?;
                    Ok(row_events(
                        id,
                        r.get(0)?,
                        r.get(1)?,
                        from_seq,
                        r.get(2)?,
                        bytes,
                    ))
                })
                .map_err(|e| self.sql(e))?;
            if !f(events)? {
                break;
            }
        }
        Ok(())
    }

    /// A small artifact of run `id` by its hash (at most `limit` bytes): one it is waiting to
    /// store, one stored with the run's events (its newest commits are looked at first), one
    /// stored before schema 6, or a file.
    pub fn read_run_artifact(
        &self,
        id: &str,
        hash: &str,
        limit: usize,
    ) -> Result<Vec<u8>, StoreError> {
        self.read_artifact_of(Some(id), hash, limit)
    }

    /// Which of `hashes`, artifacts of run `id`, are missing or no longer match their hash: the
    /// ones stored with its events are checked in one pass over its rows, the others where they
    /// are kept (schema 5's table, files).
    pub fn unsound_run_artifacts(
        &self,
        id: &str,
        hashes: &std::collections::BTreeSet<String>,
    ) -> Result<Vec<String>, StoreError> {
        let mut unchecked = hashes.clone();
        let mut bad = Vec::new();
        // A broken link leaves the artifacts of the rows before it unchecked here: they are
        // looked for where older ones are kept, and reported missing.
        let _snapshot = ReadSnapshot::take(&self.conn).map_err(|e| self.sql(e))?;
        let rows = log::run_rows(&self.conn, id, 0).map_err(|e| self.sql(e))?;
        let mut stmt = self
            .conn
            .prepare_cached("SELECT blob_hashes FROM log WHERE id = ?1")
            .map_err(|e| self.sql(e))?;
        let mut blobs_of = self
            .conn
            .prepare_cached("SELECT blobs FROM log WHERE id = ?1")
            .map_err(|e| self.sql(e))?;
        for row in rows.ids {
            let names: Option<Vec<u8>> = stmt
                .query_row([row], |r| r.get(0))
                .map_err(|e| self.sql(e))?;
            let Some(names) = names else {
                continue;
            };
            if !unchecked.iter().any(|h| log::names_blob(&names, h)) {
                continue;
            }
            let stored: Vec<u8> = blobs_of
                .query_row([row], |r| r.get::<_, Option<Vec<u8>>>(0))
                .map_err(|e| self.sql(e))?
                .unwrap_or_default();
            let Ok(blobs) = log::decode_blobs(&stored) else {
                // Their bytes are unreadable: each one named here is unsound.
                for h in unchecked.clone() {
                    if log::names_blob(&names, &h) {
                        unchecked.remove(&h);
                        bad.push(h);
                    }
                }
                continue;
            };
            for (hash, codec, bytes) in blobs {
                if unchecked.remove(&hash) {
                    let sound = self
                        .decode_stored(Some(id), &hash, codec, bytes)
                        .is_ok_and(|b| blake3::hash(&b).to_hex().as_str() == hash);
                    if !sound {
                        bad.push(hash);
                    }
                }
            }
        }
        for hash in unchecked {
            if !self.verify_artifact(&hash)? {
                bad.push(hash);
            }
        }
        Ok(bad)
    }

    /// Rows of run `id`'s log whose stored blobs disagree with the names they carry (a row names
    /// its blobs exactly when it holds some), as the events each row holds, and the first row
    /// that cannot be read at all. This reads every row's `blobs` column, which the reads of a
    /// row without blobs never touch, so that damage there is found too.
    pub fn unsound_log_rows(&self, id: &str) -> Result<Vec<String>, StoreError> {
        let mut bad = Vec::new();
        let _snapshot = ReadSnapshot::take(&self.conn).map_err(|e| self.sql(e))?;
        let rows = match log::run_rows(&self.conn, id, 0) {
            Ok(rows) => rows,
            Err(e) => {
                bad.push(format!("the log's rows cannot be followed: {e}"));
                return Ok(bad);
            }
        };
        if let Some(broken) = &rows.broken {
            bad.push(broken.to_string());
        }
        // Rows of the run that its links do not reach (a scan of the whole table: this check
        // reads everything anyway).
        let held: usize = self
            .conn
            .query_row("SELECT count(*) FROM log WHERE run_id = ?1", [id], |r| {
                r.get::<_, i64>(0)
            })
            .map_err(|e| self.sql(e))?
            .try_into()
            .unwrap_or(usize::MAX);
        if rows.broken.is_none() && held > rows.ids.len() {
            bad.push(format!(
                "{} of the log's {held} rows of this run are not linked from its newest: their \
                 events are not read",
                held - rows.ids.len()
            ));
        }
        let mut stmt = self
            .conn
            .prepare_cached(
                "SELECT first_seq, last_seq, blob_hashes IS NULL, blobs IS NULL FROM log \
                 WHERE id = ?1",
            )
            .map_err(|e| self.sql(e))?;
        let mut read_to = 0u64;
        for row in rows.ids {
            let found = stmt.query_row([row], |r| {
                Ok((
                    r.get::<_, u64>(0)?,
                    r.get::<_, u64>(1)?,
                    r.get::<_, bool>(2)?,
                    r.get::<_, bool>(3)?,
                ))
            });
            match found {
                Ok((first, last, no_names, no_blobs)) => {
                    read_to = last;
                    if no_names != no_blobs {
                        bad.push(format!(
                            "the log's row of events {first}-{last} {}",
                            if no_names {
                                "holds blobs but names none"
                            } else {
                                "names blobs but holds none"
                            }
                        ));
                    }
                }
                Err(e) => {
                    bad.push(format!(
                        "the log's row after event {read_to} cannot be read: {e}"
                    ));
                    break;
                }
            }
        }
        Ok(bad)
    }

    /// Every checkpoint row of a run, oldest first.
    pub fn checkpoints(&self, id: &str) -> Result<Vec<CheckpointRow>, StoreError> {
        let mut stmt = self
            .conn
            .prepare(
                "SELECT n, seq, at, hash, snapshot_ref, commit_id, body FROM checkpoints \
                 WHERE run_id = ?1 ORDER BY n",
            )
            .map_err(|e| self.sql(e))?;
        let rows = stmt
            .query_map([id], checkpoint_row)
            .map_err(|e| self.sql(e))?;
        rows.collect::<Result<_, _>>().map_err(|e| self.sql(e))
    }

    /// The newest checkpoint row, read without touching older ones.
    pub fn newest_checkpoint(&self, id: &str) -> Result<Option<CheckpointRow>, StoreError> {
        self.conn
            .query_row(
                "SELECT n, seq, at, hash, snapshot_ref, commit_id, body FROM checkpoints \
                 WHERE run_id = ?1 ORDER BY n DESC LIMIT 1",
                [id],
                checkpoint_row,
            )
            .optional()
            .map_err(|e| self.sql(e))
    }

    /// Rewrites the projection of a run from `run`, folded from the log, after it was found to
    /// disagree with the log. The log's end becomes the projection's end.
    pub fn replace_projection(&mut self, lease: &Lease, run: &Run) -> Result<(), StoreError> {
        let path = self.path.clone();
        let writer = std::sync::Arc::clone(&self.writer);
        let _queued = writer
            .lock
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let written = (|| -> Result<(), TxError> {
            let tx = self
                .conn
                .transaction_with_behavior(TransactionBehavior::Immediate)?;
            self.rows.borrow_mut().remove(&lease.run_id);
            rebuild(&tx, lease, &[], run, 0, &[])?;
            finish(tx)?;
            Ok(())
        })();
        written.map_err(|e| e.into_store(&path))
    }
}

/// A checkpoint row (`n, seq, at, hash, snapshot_ref, commit_id, body`).
fn checkpoint_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<CheckpointRow> {
    Ok(CheckpointRow {
        n: r.get(0)?,
        seq: r.get(1)?,
        at_ms: r.get(2)?,
        hash: text(r, 3)?,
        snapshot_ref: text(r, 4)?,
        commit: text(r, 5)?,
        body: text(r, 6)?,
    })
}

/// A text column as stored. A damaged byte can leave it invalid UTF-8; it is read with the damage
/// replaced (U+FFFD), so that the hash chain, which covers the exact text, reports the event as
/// altered (and a contract's hash, or a projection's decoding, its damage) instead of every read
/// of the run failing with a conversion error.
pub(crate) fn text(r: &rusqlite::Row<'_>, i: usize) -> rusqlite::Result<String> {
    let value = r.get_ref(i)?;
    value
        .as_bytes()
        .map(|b| String::from_utf8_lossy(b).into_owned())
        .map_err(|e| rusqlite::Error::FromSqlConversionFailure(i, value.data_type(), Box::new(e)))
}

/// A transaction that `finish` ends.
pub(crate) trait Ending {
    fn commit(self) -> rusqlite::Result<()>;
    fn rollback(self) -> rusqlite::Result<()>;
}

impl Ending for rusqlite::Transaction<'_> {
    fn commit(self) -> rusqlite::Result<()> {
        rusqlite::Transaction::commit(self)
    }
    fn rollback(self) -> rusqlite::Result<()> {
        rusqlite::Transaction::rollback(self)
    }
}

/// One snapshot of the store for the statements run while it is held: a savepoint, which is a
/// read transaction when none is open (and nothing more inside one). A run's log is read by
/// following its links, a statement a row; without it a commit or a cut made between two of
/// them could show a link to a row that is not there yet, or no more.
pub(crate) struct ReadSnapshot<'c>(&'c Connection);

impl<'c> ReadSnapshot<'c> {
    pub(crate) fn take(conn: &'c Connection) -> rusqlite::Result<ReadSnapshot<'c>> {
        conn.prepare_cached("SAVEPOINT keel_read")?.execute([])?;
        Ok(ReadSnapshot(conn))
    }
}

impl Drop for ReadSnapshot<'_> {
    fn drop(&mut self) {
        // Nothing was written under it: ending it cannot lose anything, and a failure to end
        // it leaves the read transaction to the connection's next statement.
        let _ = self
            .0
            .prepare_cached("RELEASE keel_read")
            .and_then(|mut s| s.execute([]));
    }
}

/// The event commits' write transaction, begun and ended with cached statements: rusqlite's
/// `Transaction` parses `BEGIN` and `COMMIT` anew each time, about 2% of a no-op step's CPU.
/// Dropped while open (an error on the way), it is rolled back, as rusqlite's is.
pub(crate) struct WriteTx<'c> {
    conn: &'c Connection,
    open: bool,
}

impl<'c> WriteTx<'c> {
    /// `BEGIN IMMEDIATE` on `conn`: the write lock is taken now, not at the first write.
    pub(crate) fn begin(conn: &'c Connection) -> rusqlite::Result<WriteTx<'c>> {
        conn.prepare_cached("BEGIN IMMEDIATE")?.execute([])?;
        Ok(WriteTx { conn, open: true })
    }

    fn end(mut self, sql: &str) -> rusqlite::Result<()> {
        // Still open if the statement fails (a `COMMIT` that could not write): `Drop` rolls
        // it back.
        self.conn.prepare_cached(sql)?.execute([])?;
        self.open = false;
        Ok(())
    }
}

impl Ending for WriteTx<'_> {
    fn commit(self) -> rusqlite::Result<()> {
        self.end("COMMIT")
    }
    fn rollback(self) -> rusqlite::Result<()> {
        self.end("ROLLBACK")
    }
}

impl std::ops::Deref for WriteTx<'_> {
    type Target = Connection;
    fn deref(&self) -> &Connection {
        self.conn
    }
}

impl Drop for WriteTx<'_> {
    fn drop(&mut self) {
        if self.open {
            let _ = self.conn.execute_batch("ROLLBACK");
        }
    }
}

fn finish(tx: impl Ending) -> Result<(), rusqlite::Error> {
    match fault::next_commit() {
        None => tx.commit(),
        Some((fault::CommitFault::Error, n)) => {
            tx.rollback()?;
            Err(fault::commit_error(fault::CommitFault::Error, n))
        }
        Some((fault::CommitFault::LostAck, n)) => {
            tx.commit()?;
            Err(fault::commit_error(fault::CommitFault::LostAck, n))
        }
    }
}

/// `bytes` cut to at most `limit`.
fn cut_to(mut bytes: Vec<u8>, limit: usize) -> Vec<u8> {
    bytes.truncate(limit);
    bytes
}

/// The kind of the event a row whose events do not decode reads as.
pub const UNREADABLE: &str = "";

/// The events of one `log` row of run `id` (holding `first`..=`last`) from `from` on. A row whose
/// events do not decode reads as one event at `first` (or `from`, if later) of kind
/// [`UNREADABLE`], version 0, whose body says why and which events it held, and whose hashes are
/// empty: it cannot pass the chain check, so a reader that checks finds the damage where it is,
/// and one that folds stops there.
fn row_events(
    id: &str,
    first: u64,
    last: u64,
    from: u64,
    codec: i64,
    bytes: &[u8],
) -> Vec<StoredEvent> {
    match log::decode_events(id, codec, bytes) {
        Ok(mut events) => {
            events.retain(|e| e.seq >= from);
            events
        }
        Err(message) => vec![unreadable(
            id,
            first.max(from),
            format!(
                "event {} and the events stored with it up to event {last} do not decode: {message}",
                first.max(from)
            ),
        )],
    }
}

/// An event that stands for stored events that cannot be read: it cannot pass the chain check,
/// so a reader that checks finds the damage where it is, with `why`.
fn unreadable(id: &str, seq: u64, why: String) -> StoredEvent {
    StoredEvent {
        run_id: id.to_string(),
        seq,
        at_ms: 0,
        version: 0,
        kind: UNREADABLE.to_string(),
        body: why,
        prev_hash: String::new(),
        hash: String::new(),
    }
}

/// Appends `events` onto the log's end as its rows say, and rewrites the whole projection from
/// `run` (after a cut, or to rebuild it), in the transaction `tx`.
fn rebuild(
    tx: &Connection,
    lease: &Lease,
    events: &[Event],
    run: &Run,
    lease_until_ms: i64,
    blobs: &[log::InlineBlob],
) -> Result<(), TxError> {
    let head = new_head(tx, &lease.run_id)?;
    let commit = write::Commit {
        lease,
        events,
        run,
        checkpoint: None,
        lease_until_ms,
        blobs,
        contracts: &[],
        extra: batch::Extra::default(),
    };
    let prepared = write::prepare(tx, &commit, Written::Rewrite(head))?;
    write::apply(tx, &prepared)
}

/// Where run `id`'s log ends as its rows say (after a cut, or to rebuild its projection), with
/// the state and projection stored for it.
fn new_head(conn: &Connection, id: &str) -> Result<Head, TxError> {
    let (first, codec, bytes): (u64, i64, Vec<u8>) = conn.query_row(
        "SELECT l.first_seq, l.codec, l.events FROM runs r JOIN log l ON l.id = r.last_log \
         WHERE r.id = ?1",
        [id],
        |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
    )?;
    let last = log::decode_events(id, codec, &bytes)
        .map_err(|message| {
            TxError::Store(StoreError::Decode {
                run: id.to_string(),
                seq: first,
                message: format!("the log's last events do not decode: {message}"),
            })
        })?
        .pop()
        .ok_or_else(|| {
            TxError::Store(StoreError::Decode {
                run: id.to_string(),
                seq: first,
                message: "the log's last row holds no event".into(),
            })
        })?;
    conn.execute(
        "UPDATE runs SET last_seq = ?2, last_hash = ?3 WHERE id = ?1",
        params![id, last.seq, last.hash],
    )?;
    Ok(write::head(conn, id)?)
}

/// Errors inside a transaction, turned into [`StoreError`] with the store's path afterwards.
pub(crate) enum TxError {
    Sql(rusqlite::Error),
    Store(StoreError),
}

impl From<rusqlite::Error> for TxError {
    fn from(e: rusqlite::Error) -> Self {
        TxError::Sql(e)
    }
}

impl TxError {
    pub(crate) fn into_store(self, path: &Path) -> StoreError {
        match self {
            TxError::Sql(source) => StoreError::Sqlite {
                path: path.to_path_buf(),
                source,
            },
            TxError::Store(e) => e,
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    /// The event commits' transaction: kept when committed, undone when rolled back or dropped
    /// open (an error on the way), and the connection is out of it after each, so the next
    /// `BEGIN` works.
    #[test]
    fn a_write_transaction_is_kept_only_when_committed() {
        let dir = tempfile::tempdir().unwrap();
        let conn = connect(&dir.path().join("t.db")).unwrap();
        conn.execute_batch("CREATE TABLE t (x INTEGER)").unwrap();
        let count = || -> i64 {
            conn.query_row("SELECT count(*) FROM t", [], |r| r.get(0))
                .unwrap()
        };
        {
            let tx = WriteTx::begin(&conn).unwrap();
            tx.execute("INSERT INTO t VALUES (1)", []).unwrap();
            assert!(!conn.is_autocommit());
        }
        assert_eq!(count(), 0, "dropped open: rolled back");
        assert!(conn.is_autocommit());
        let tx = WriteTx::begin(&conn).unwrap();
        tx.execute("INSERT INTO t VALUES (2)", []).unwrap();
        Ending::commit(tx).unwrap();
        assert_eq!(count(), 1);
        let tx = WriteTx::begin(&conn).unwrap();
        tx.execute("INSERT INTO t VALUES (3)", []).unwrap();
        Ending::rollback(tx).unwrap();
        assert_eq!(count(), 1);
        assert!(conn.is_autocommit());
        // Another connection sees only what was committed.
        let other = connect(&dir.path().join("t.db")).unwrap();
        let seen: i64 = other
            .query_row("SELECT x FROM t", [], |r| r.get(0))
            .unwrap();
        assert_eq!(seen, 2);
    }

    /// SQLite's temporary files open in this process: unnamed files in its temporary directory,
    /// which `/proc` shows as `<dir>/#<inode> (deleted)`.
    fn sqlite_temp_files() -> usize {
        std::fs::read_dir("/proc/self/fd")
            .unwrap()
            .filter_map(|fd| std::fs::read_link(fd.ok()?.path()).ok())
            .filter(|target| {
                let target = target.to_string_lossy();
                target.ends_with(" (deleted)")
                    && target
                        .rsplit('/')
                        .next()
                        .is_some_and(|name| name.starts_with('#'))
            })
            .count()
    }

    /// A savepoint that changes 300 KB of pages (a group commit's savepoints do, with many
    /// commits in one transaction) keeps its statement journal in memory: no temporary file is
    /// made for it.
    #[test]
    fn a_savepoints_journal_makes_no_temporary_file() {
        let dir = tempfile::tempdir().unwrap();
        let conn = connect(&dir.path().join("keel.db")).unwrap();
        conn.execute_batch(
            "CREATE TABLE t (body BLOB NOT NULL);
             WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 100)
             INSERT INTO t (body) SELECT zeroblob(3000) FROM n;
             BEGIN IMMEDIATE;
             UPDATE t SET body = zeroblob(3001);
             SAVEPOINT one;
             UPDATE t SET body = zeroblob(3002);",
        )
        .unwrap();
        let open = sqlite_temp_files();
        conn.execute_batch("RELEASE one; COMMIT;").unwrap();
        assert_eq!(open, 0, "the statement journal went to a temporary file");
    }
}
