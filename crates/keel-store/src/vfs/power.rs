//! A power cut, or a failed write or sync, at any moment of a store's life: what the store
//! reads back afterwards.
//!
//! While a test records (on its own thread), every file the store opens by name is opened
//! through a recorder that sits under keel's VFS, just above `unix`, and notes each write,
//! truncate and sync that reached the file system, in order, with the test's own marks
//! between them (a commit acknowledged to its caller). A power cut after any of those
//! operations leaves each file as it was at its last sync, except that any of the writes and
//! truncates since may or may not have reached the disk: each 512-byte sector holds what it
//! held after any one of the writes, independently of its neighbours, and the file's length is
//! any length it had since; a truncate (a change of the file's size and blocks, which file
//! systems make whole or not at all, in order, as SQLite counts on) happened or did not. (The
//! `-shm` index is not a file SQLite opens through the VFS and is not carried over: it is
//! rebuilt from the WAL once power returns, as after a reboot.) Syncs are noted, not made: what
//! they make durable is the model's to say.
//!
//! The tests replay a scenario of run creations, commits of events small and large (across
//! several pages) and checkpoints. One cuts the power after every operation in several ways,
//! and now and then again while the store reads the files back (its WAL recovery, the
//! checkpoint as it closes; a removed WAL counts as still there, as after a removal the power
//! cut before it reached the disk);
//! the other fails each write (the disk full, or the device failing), truncate and sync in
//! turn, one a replay, and lets the scenario go on as keel does (the run whose commit failed
//! stops, the others go on in the same store). Both check that the store read back holds every
//! acknowledged commit whole, no commit in part, an intact hash chain and consistent tables,
//! and passes SQLite's integrity check; the second, that a commit whose write or sync failed
//! was never acknowledged.

use std::cell::RefCell;
use std::ffi::{CStr, c_int, c_void};
use std::path::{Path, PathBuf};

use rusqlite::ffi;

use super::{OpenFn, methods_of, wrapper};

/// A file as SQLite holds it while a test records: `base` first, the `unix` file after the
/// record, at [`SIZE`].
#[repr(C)]
struct RecFile {
    base: ffi::sqlite3_file,
    inner: *mut ffi::sqlite3_file,
    /// The journal the file was opened in, and the file's index in its `files`: a file left
    /// open from an earlier journal is not recorded in a later one.
    journal: u64,
    file: usize,
}

/// Where the `unix` file starts in a [`RecFile`]'s allocation.
pub(super) const SIZE: usize = std::mem::size_of::<RecFile>().next_multiple_of(16);

/// What reached the file system, in order.
#[derive(Debug, Clone)]
enum Op {
    Write {
        file: usize,
        offset: usize,
        data: Vec<u8>,
    },
    Truncate {
        file: usize,
        size: usize,
    },
    Sync {
        file: usize,
    },
    /// The test's caller was told that commit `commit` of run `run` is made.
    Ack {
        run: usize,
        commit: usize,
    },
    /// A write (or a sync, or a truncate) of `file` failed as a test asked.
    Failed {
        file: usize,
        what: Failure,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Failure {
    Write,
    Truncate,
    Sync,
}

#[derive(Debug, Default)]
struct Journal {
    /// This journal among the thread's: see [`RecFile`].
    id: u64,
    /// Each file's path and its bytes when it was first opened (empty if it did not exist),
    /// taken as on the disk.
    files: Vec<(PathBuf, Vec<u8>)>,
    ops: Vec<Op>,
    /// The write, truncate or sync (counted from 0, in the order they are asked for) that
    /// fails instead of reaching the file system, as a full disk or a failing device fails it.
    fail_at: Option<usize>,
    asked: usize,
}

/// Journals made so far, in any thread: each has its own number.
static JOURNALS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

thread_local! {
    static JOURNAL: RefCell<Option<Journal>> = const { RefCell::new(None) };
}

/// Whether files opened on this thread now are recorded.
pub(super) fn recording() -> bool {
    JOURNAL.with(|j| j.borrow().is_some())
}

/// The journal a file was opened in, if it is still recording.
fn journal_of<T>(r: &RecFile, f: impl FnOnce(&mut Journal) -> T) -> Option<T> {
    JOURNAL.with(|j| j.borrow_mut().as_mut().filter(|j| j.id == r.journal).map(f))
}

fn note(r: &RecFile, op: Op) {
    journal_of(r, |j| j.ops.push(op));
}

/// Whether the write, truncate or sync of `r` asked for now is the one that fails (and its
/// number); a failure is noted.
fn fails(r: &RecFile, what: Failure) -> Option<usize> {
    journal_of(r, |j| {
        let n = j.asked;
        j.asked += 1;
        let fails = j.fail_at == Some(n);
        if fails {
            j.ops.push(Op::Failed { file: r.file, what });
        }
        fails.then_some(n)
    })
    .flatten()
}

/// Opens a recorder over a `unix` file at `file`.
///
/// # Safety
/// As `unix`'s `xOpen`, with [`SIZE`] more bytes at `file` than `unix` needs.
pub(super) unsafe fn open(
    unix_open: OpenFn,
    unix: *mut ffi::sqlite3_vfs,
    name: ffi::sqlite3_filename,
    file: *mut ffi::sqlite3_file,
    flags: c_int,
    out_flags: *mut c_int,
) -> c_int {
    if name.is_null() {
        // A temporary file, gone after a power cut: not recorded.
        // SAFETY: as this function's contract states.
        return unsafe { unix_open(unix, name, file, flags, out_flags) };
    }
    // SAFETY: SQLite passes a file's name as a C string that lives while the file is open.
    let path = PathBuf::from(
        unsafe { CStr::from_ptr(name) }
            .to_string_lossy()
            .into_owned(),
    );
    // SAFETY: SQLite gave `file` `SIZE + unix's szOsFile` bytes, zeroed and aligned for any C
    // struct (as a `RecFile` is); the `unix` file is opened after `SIZE` bytes, and the
    // `RecFile` written only once that succeeded.
    unsafe {
        let inner = file.cast::<u8>().add(SIZE).cast::<ffi::sqlite3_file>();
        let rc = unix_open(unix, name, inner, flags, out_flags);
        if rc != ffi::SQLITE_OK {
            return rc;
        }
        // The caller saw this thread recording; were it not, the file is left out.
        let (journal, index) = JOURNAL
            .with(|j| {
                let mut j = j.borrow_mut();
                let j = j.as_mut()?;
                let index = match j.files.iter().position(|(p, _)| *p == path) {
                    Some(i) => i,
                    None => {
                        let bytes = std::fs::read(&path).unwrap_or_default();
                        j.files.push((path, bytes));
                        j.files.len() - 1
                    }
                };
                Some((j.id, index))
            })
            .unwrap_or((u64::MAX, 0));
        file.cast::<RecFile>().write(RecFile {
            base: ffi::sqlite3_file { pMethods: &METHODS },
            inner,
            journal,
            file: index,
        });
    }
    ffi::SQLITE_OK
}

static METHODS: ffi::sqlite3_io_methods = io_methods!();

unsafe extern "C" fn write(
    file: *mut ffi::sqlite3_file,
    data: *const c_void,
    amount: c_int,
    offset: i64,
) -> c_int {
    // SAFETY: see `wrapper`.
    let r = unsafe { wrapper::<RecFile>(file) };
    let Some(f) = methods_of(r.inner).xWrite else {
        return ffi::SQLITE_IOERR_WRITE;
    };
    if let Some(n) = fails(r, Failure::Write) {
        // Half the failed writes find the disk full, half a failing device.
        return if n % 2 == 0 {
            ffi::SQLITE_FULL
        } else {
            ffi::SQLITE_IOERR_WRITE
        };
    }
    // SAFETY: `inner` is open; the arguments are SQLite's, passed on unchanged.
    let rc = unsafe { f(r.inner, data, amount, offset) };
    if let (ffi::SQLITE_OK, Ok(len), Ok(offset)) =
        (rc, usize::try_from(amount), usize::try_from(offset))
    {
        let data = if len == 0 {
            Vec::new()
        } else {
            // SAFETY: SQLite passes `amount` readable bytes at `data` for the call's length.
            unsafe { std::slice::from_raw_parts(data.cast::<u8>(), len) }.to_vec()
        };
        note(
            r,
            Op::Write {
                file: r.file,
                offset,
                data,
            },
        );
    }
    rc
}

unsafe extern "C" fn truncate(file: *mut ffi::sqlite3_file, size: i64) -> c_int {
    // SAFETY: see `wrapper`.
    let r = unsafe { wrapper::<RecFile>(file) };
    let Some(f) = methods_of(r.inner).xTruncate else {
        return ffi::SQLITE_IOERR_TRUNCATE;
    };
    if fails(r, Failure::Truncate).is_some() {
        return ffi::SQLITE_IOERR_TRUNCATE;
    }
    // SAFETY: `inner` is open.
    let rc = unsafe { f(r.inner, size) };
    if let (ffi::SQLITE_OK, Ok(size)) = (rc, usize::try_from(size)) {
        note(r, Op::Truncate { file: r.file, size });
    }
    rc
}

unsafe extern "C" fn sync(file: *mut ffi::sqlite3_file, flags: c_int) -> c_int {
    // SAFETY: see `wrapper`.
    let r = unsafe { wrapper::<RecFile>(file) };
    if fails(r, Failure::Sync).is_some() {
        return ffi::SQLITE_IOERR_FSYNC;
    }
    // What a sync makes durable is the journal's to say (a power cut is simulated, never
    // real), so the file system is not asked to while it records: the tests run at the speed
    // of memory.
    if journal_of(r, |j| j.ops.push(Op::Sync { file: r.file })).is_some() {
        return ffi::SQLITE_OK;
    }
    match methods_of(r.inner).xSync {
        // SAFETY: `inner` is open.
        Some(f) => unsafe { f(r.inner, flags) },
        None => ffi::SQLITE_IOERR_FSYNC,
    }
}

unsafe extern "C" fn close(file: *mut ffi::sqlite3_file) -> c_int {
    // SAFETY: see `wrapper`. This is the file's last call.
    let r = unsafe { wrapper::<RecFile>(file) };
    let rc = match methods_of(r.inner).xClose {
        // SAFETY: `inner` is open; SQLite does not use it again.
        Some(f) => unsafe { f(r.inner) },
        None => ffi::SQLITE_OK,
    };
    r.base.pMethods = std::ptr::null();
    rc
}

unsafe extern "C" fn shm_barrier(file: *mut ffi::sqlite3_file) {
    // SAFETY: see `wrapper`.
    let r = unsafe { wrapper::<RecFile>(file) };
    if let Some(f) = methods_of(r.inner).xShmBarrier {
        // SAFETY: `inner` is open.
        unsafe { f(r.inner) }
    }
}

forwarded!(RecFile: read, xRead, (buf: *mut c_void, amount: c_int, offset: i64), ffi::SQLITE_IOERR_READ);
forwarded!(RecFile: file_size, xFileSize, (size: *mut i64), ffi::SQLITE_IOERR_FSTAT);
forwarded!(RecFile: lock, xLock, (level: c_int), ffi::SQLITE_IOERR_LOCK);
forwarded!(RecFile: unlock, xUnlock, (level: c_int), ffi::SQLITE_IOERR_UNLOCK);
forwarded!(RecFile: check_reserved_lock, xCheckReservedLock, (out: *mut c_int), ffi::SQLITE_MISUSE);
forwarded!(RecFile: file_control, xFileControl, (op: c_int, arg: *mut c_void), ffi::SQLITE_NOTFOUND);
forwarded!(RecFile: sector_size, xSectorSize, (), 4096);
forwarded!(RecFile: device_characteristics, xDeviceCharacteristics, (), 0);
forwarded!(RecFile: shm_map, xShmMap, (page: c_int, size: c_int, extend: c_int, pp: *mut *mut c_void), ffi::SQLITE_IOERR_SHMMAP);
forwarded!(RecFile: shm_lock, xShmLock, (offset: c_int, n: c_int, flags: c_int), ffi::SQLITE_IOERR_SHMLOCK);
forwarded!(RecFile: shm_unmap, xShmUnmap, (delete: c_int), ffi::SQLITE_OK);
forwarded!(RecFile: fetch, xFetch, (offset: i64, amount: c_int, pp: *mut *mut c_void), ffi::SQLITE_OK);
forwarded!(RecFile: unfetch, xUnfetch, (offset: i64, p: *mut c_void), ffi::SQLITE_OK);

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use crate::{Store, verify_chain};
    use keel_core::event::Event;
    use keel_core::run::Run;
    use keel_test_support::rng::SplitMix;
    use keel_test_support::runs::{created, resumed};

    /// Starts recording the files this thread opens from now on; the write, truncate or sync
    /// numbered `fail_at`, if any, fails.
    fn record(fail_at: Option<usize>) {
        JOURNAL.with(|j| {
            *j.borrow_mut() = Some(Journal {
                id: JOURNALS.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
                fail_at,
                ..Journal::default()
            });
        });
    }

    /// Notes one of the test's own marks.
    fn mark(op: Op) {
        JOURNAL.with(|j| j.borrow_mut().as_mut().map(|j| j.ops.push(op)));
    }

    /// Stops recording and returns what was recorded.
    fn stop() -> Journal {
        JOURNAL.with(|j| j.borrow_mut().take()).expect("recording")
    }

    const SECTOR: usize = 512;

    /// One file through the journal: its bytes at its last sync, and after each write or
    /// truncate since (the last is what the file system holds now), with the size each
    /// truncate cut the file to.
    struct Versions {
        bytes: Vec<Vec<u8>>,
        truncated: Vec<Option<usize>>,
    }

    impl Versions {
        fn new(bytes: Vec<u8>) -> Versions {
            Versions {
                bytes: vec![bytes],
                truncated: vec![None],
            }
        }

        fn now(&self) -> &Vec<u8> {
            self.bytes.last().expect("a file has a version")
        }

        fn apply(&mut self, op: &Op) {
            match op {
                Op::Write { offset, data, .. } => {
                    let mut next = self.now().clone();
                    let end = offset + data.len();
                    if next.len() < end {
                        next.resize(end, 0);
                    }
                    next[*offset..end].copy_from_slice(data);
                    self.bytes.push(next);
                    self.truncated.push(None);
                }
                Op::Truncate { size, .. } => {
                    let mut next = self.now().clone();
                    next.resize(*size, 0);
                    self.bytes.push(next);
                    self.truncated.push(Some(*size));
                }
                Op::Sync { .. } => *self = Versions::new(self.now().clone()),
                Op::Ack { .. } | Op::Failed { .. } => {}
            }
        }

        /// The file after a power cut now. `how`: 0 every write since the sync reached the disk
        /// (the process died, the machine did not), 1 none did, 2 any mix.
        ///
        /// A mix: a truncate changes the file's size and the blocks it holds, not its data, and
        /// file systems (ext4's journal, for one) make such a change whole or not at all, in
        /// the order they were made, as SQLite counts on. So the cut falls after some number
        /// of the truncates since the sync; the size is any the file had since the last of
        /// those, and each sector holds its bytes after any write before the next one, less
        /// what a truncate that happened after that write cut off.
        fn after_cut(&self, how: u8, rng: &mut SplitMix) -> Vec<u8> {
            let last = self.bytes.len() - 1;
            match how {
                0 => return self.now().clone(),
                1 => return self.bytes[0].clone(),
                _ => {}
            }
            let pick = |rng: &mut SplitMix, below: usize| match rng.below(3) {
                0 => 0,
                1 => below - 1,
                _ => rng.below(below as u64) as usize,
            };
            // The last truncate that happened, and the next, which did not.
            let at = pick(rng, last + 1);
            let from = (1..=at)
                .rev()
                .find(|k| self.truncated[*k].is_some())
                .unwrap_or(0);
            let to = (at + 1..=last)
                .find(|k| self.truncated[*k].is_some())
                .map_or(last, |k| k - 1);
            let len = self.bytes[from + pick(rng, to - from + 1)].len();
            let mut out = vec![0; len];
            for start in (0..len).step_by(SECTOR) {
                let end = (start + SECTOR).min(len);
                let k = pick(rng, to + 1);
                let kept = (k + 1..=from)
                    .filter_map(|j| self.truncated[j])
                    .min()
                    .unwrap_or(usize::MAX);
                for (i, byte) in out[start..end].iter_mut().enumerate() {
                    if start + i < kept {
                        *byte = self.bytes[k].get(start + i).copied().unwrap_or(0);
                    }
                }
            }
            out
        }
    }

    /// A run's planned commits: the events of each, and the projection after each (the first
    /// is the run's creation).
    struct Planned {
        id: String,
        commits: Vec<(Vec<Event>, Run)>,
    }

    impl Planned {
        /// The number of events after each commit.
        fn boundaries(&self) -> Vec<usize> {
            let mut n = 0;
            self.commits
                .iter()
                .map(|(events, _)| {
                    n += events.len();
                    n
                })
                .collect()
        }

        fn events(&self) -> Vec<&Event> {
            self.commits.iter().flat_map(|(e, _)| e).collect()
        }
    }

    fn plan(rng: &mut SplitMix) -> Vec<Planned> {
        (0..2)
            .map(|r| {
                let id = format!("run-{r}");
                let (e, run) = created(&id);
                let mut commits = vec![(vec![e], run)];
                for _ in 0..(3 + rng.below(6)) {
                    let mut run = commits.last().expect("created").1.clone();
                    let events = (0..1 + rng.below(6))
                        .map(|_| {
                            // Mostly small; now and then larger than a page or two.
                            let len = if rng.chance(20) {
                                rng.below(9000)
                            } else {
                                rng.below(200)
                            };
                            let holder: String = (0..len)
                                .map(|_| char::from(b'a' + rng.below(26) as u8))
                                .collect();
                            let e = resumed(&run, &holder);
                            run.apply(&e).unwrap();
                            e
                        })
                        .collect();
                    commits.push((events, run));
                }
                Planned { id, commits }
            })
            .collect()
    }

    /// Plays the plan against a store at `db`, recording; returns the journal. With
    /// `fail_at`, that write, truncate or sync fails: the commit it fails stops its run (as
    /// the engine stops a run whose commit failed) and the other runs go on in the same store;
    /// a failed checkpoint is let pass. Without, any error fails the test.
    fn play(db: &Path, plan: &[Planned], rng: &mut SplitMix, fail_at: Option<usize>) -> Journal {
        // The scenario starts from a new store, its schema made once for all.
        static MADE: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
        let made = MADE.get_or_init(|| {
            let dir = tempfile::tempdir().unwrap();
            let db = dir.path().join("keel.db");
            drop(Store::open(&db).unwrap());
            std::fs::read(&db).unwrap()
        });
        std::fs::write(db, made).unwrap();
        record(fail_at);
        let tolerated = |what: &str, e: &dyn std::fmt::Display| {
            assert!(fail_at.is_some(), "{what}: {e}");
        };
        let mut store = match Store::open(db) {
            Ok(store) => store,
            Err(e) => {
                tolerated("open", &e);
                return stop();
            }
        };
        let mut leases = Vec::new();
        // The next commit of each run; a run stopped by a failed commit has none.
        let mut next = Vec::new();
        for (i, p) in plan.iter().enumerate() {
            let (e, run) = &p.commits[0];
            match store.create_run(&e[0], run, "me", 0, 1_000_000) {
                Ok(lease) => {
                    mark(Op::Ack { run: i, commit: 0 });
                    leases.push(Some(lease));
                    next.push(1);
                }
                Err(e) => {
                    tolerated("create_run", &e);
                    leases.push(None);
                    next.push(p.commits.len());
                }
            }
        }
        while next.iter().zip(plan).any(|(n, p)| *n < p.commits.len()) {
            let i = rng.below(plan.len() as u64) as usize;
            let (Some((events, run)), Some(lease)) = (plan[i].commits.get(next[i]), &leases[i])
            else {
                continue;
            };
            match store.commit(lease, events, run, None, 1_000_000) {
                Ok(()) => {
                    mark(Op::Ack {
                        run: i,
                        commit: next[i],
                    });
                    next[i] += 1;
                }
                Err(e) => {
                    tolerated("commit", &e);
                    next[i] = plan[i].commits.len();
                }
            }
            if rng.chance(30) {
                let mode = if rng.chance(50) {
                    "PASSIVE"
                } else {
                    "TRUNCATE"
                };
                let sql = format!("PRAGMA wal_checkpoint({mode})");
                if let Err(e) = store.conn.query_row(&sql, [], |_| Ok(())) {
                    tolerated("checkpoint", &e);
                }
            }
        }
        let journal = stop();
        drop(store);
        journal
    }

    /// What is wrong with the store at `db` read back after a power cut, given the last
    /// commit of each run acknowledged before it.
    /// Returns what the reading store did to the files (its recovery, its checkpoint as it
    /// closed), recorded: its syncs cost nothing, and a power cut can fall in the middle.
    fn check(db: &Path, plan: &[Planned], acked: &[Option<usize>]) -> Result<Journal, String> {
        record(None);
        let found = check_store(db, plan, acked);
        let journal = stop();
        found.map(|()| journal)
    }

    /// The files after a power cut after the first `at` operations of `journal`, cut `how`
    /// (see [`Versions::after_cut`]), each with its name.
    fn cut(
        journal: &Journal,
        at: usize,
        how: u8,
        rng: &mut SplitMix,
    ) -> Vec<(std::ffi::OsString, Vec<u8>)> {
        let mut files: Vec<Versions> = journal
            .files
            .iter()
            .map(|(_, bytes)| Versions::new(bytes.clone()))
            .collect();
        for op in &journal.ops[..at] {
            if let Op::Write { file, .. } | Op::Truncate { file, .. } | Op::Sync { file } = op {
                files[*file].apply(op);
            }
        }
        files
            .iter()
            .zip(&journal.files)
            .map(|(versions, (path, _))| {
                let name = path.file_name().expect("a file's name").to_owned();
                (name, versions.after_cut(how, rng))
            })
            .collect()
    }

    fn check_store(db: &Path, plan: &[Planned], acked: &[Option<usize>]) -> Result<(), String> {
        let store = Store::open(db).map_err(|e| format!("Store::open: {e}"))?;
        let check: String = store
            .conn
            .query_row("PRAGMA integrity_check", [], |r| r.get(0))
            .map_err(|e| format!("integrity_check: {e}"))?;
        if check != "ok" {
            return Err(format!("integrity_check: {check}"));
        }
        for (p, acked) in plan.iter().zip(acked) {
            let found = match store.events_from(&p.id, 1) {
                Ok(found) => found,
                Err(e) => return Err(format!("{}: events: {e}", p.id)),
            };
            // The last whole commit the store holds (none: not even the run's creation).
            let boundaries = p.boundaries();
            let held = match found.len() {
                0 => None,
                n => Some(boundaries.iter().position(|b| *b == n).ok_or_else(|| {
                    format!("{}: {n} events, not a commit's end ({boundaries:?})", p.id)
                })?),
            };
            if *acked > held {
                return Err(format!(
                    "{}: commit {acked:?} was acknowledged, the store holds up to commit {held:?}",
                    p.id
                ));
            }
            let Some(commit) = held else {
                continue;
            };
            for (stored, planned) in found.iter().zip(p.events()) {
                let decoded = stored
                    .decode()
                    .map_err(|e| format!("{}: event {}: {e}", p.id, stored.seq))?;
                if decoded != *planned {
                    return Err(format!("{}: event {} differs", p.id, stored.seq));
                }
            }
            match verify_chain(None, &found) {
                Ok(n) if n == found.len() as u64 => {}
                other => return Err(format!("{}: chain: {other:?}", p.id)),
            }
            let run = store
                .run(&p.id)
                .map_err(|e| format!("{}: projection: {e}", p.id))?;
            if run != p.commits[commit].1 {
                return Err(format!(
                    "{}: projection differs from commit {commit}'s",
                    p.id
                ));
            }
            let problems = store
                .unsound_log_rows(&p.id)
                .and_then(|mut v| {
                    v.extend(store.projection_table_problems(&p.id)?);
                    Ok(v)
                })
                .map_err(|e| format!("{}: {e}", p.id))?;
            if !problems.is_empty() {
                return Err(format!("{}: {problems:?}", p.id));
            }
        }
        Ok(())
    }

    /// Cuts the power after every operation of one seed's scenario, three ways each.
    fn power_cuts(seed: u64) -> usize {
        let mut rng = SplitMix(seed);
        let plan = plan(&mut rng);
        let played = tempfile::tempdir().unwrap();
        let journal = play(&played.path().join("keel.db"), &plan, &mut rng, None);
        if std::env::var_os("KEEL_POWER_SHOW").is_some() {
            for op in &journal.ops {
                match op {
                    Op::Write { file, offset, data } => {
                        eprintln!("write {file} {offset} {}", data.len())
                    }
                    other => eprintln!("{other:?}"),
                }
            }
        }
        let mut files: Vec<Versions> = journal
            .files
            .iter()
            .map(|(_, bytes)| Versions::new(bytes.clone()))
            .collect();
        let names: Vec<_> = journal
            .files
            .iter()
            .map(|(p, _)| p.file_name().expect("a file's name").to_owned())
            .collect();
        let mut acked = vec![None; plan.len()];
        let mut cuts = 0;
        for at in 0..=journal.ops.len() {
            for how in 0..3 {
                let dir = tempfile::tempdir().unwrap();
                for (versions, name) in files.iter().zip(&names) {
                    std::fs::write(dir.path().join(name), versions.after_cut(how, &mut rng))
                        .unwrap();
                }
                let ways = [
                    "every write reached the disk",
                    "none since each file's sync did",
                    "some did",
                ];
                let at_cut = format!(
                    "seed {seed}: power cut after {at} operations of {} (way {how}: {})",
                    journal.ops.len(),
                    ways[how as usize]
                );
                let recovery = check(&dir.path().join("keel.db"), &plan, &acked)
                    .unwrap_or_else(|problem| panic!("{at_cut}: {problem}"));
                cuts += 1;
                // Now and then the power goes again while the store reads the files back
                // (recovers the WAL, checkpoints it as it closes), from the same files.
                if rng.chance(25) && !recovery.ops.is_empty() {
                    let again = rng.below(recovery.ops.len() as u64 + 1) as usize;
                    let how_again = rng.below(3) as u8;
                    let dir = tempfile::tempdir().unwrap();
                    for (name, bytes) in cut(&recovery, again, how_again, &mut rng) {
                        std::fs::write(dir.path().join(name), bytes).unwrap();
                    }
                    if let Err(problem) = check(&dir.path().join("keel.db"), &plan, &acked) {
                        panic!(
                            "{at_cut}, and again after {again} operations of {} of the store's \
                             reading it back (way {how_again}: {}): {problem}",
                            recovery.ops.len(),
                            ways[how_again as usize]
                        );
                    }
                    cuts += 1;
                }
            }
            match journal.ops.get(at) {
                Some(Op::Ack { run, commit }) => acked[*run] = Some(*commit),
                Some(Op::Failed { .. }) => unreachable!("no failure was asked for"),
                Some(
                    op @ (Op::Write { file, .. } | Op::Truncate { file, .. } | Op::Sync { file }),
                ) => files[*file].apply(op),
                None => {}
            }
        }
        cuts
    }

    /// Fails each write, truncate and sync of one seed's scenario in turn (one a replay), and
    /// checks the store as the next process finds it. Returns the replays and the commits
    /// that failed.
    fn io_errors(seed: u64) -> (usize, usize) {
        let mut rng = SplitMix(seed);
        let plan = plan(&mut rng);
        let clean = tempfile::tempdir().unwrap();
        let asked = play(&clean.path().join("keel.db"), &plan, &mut rng.clone(), None).asked;
        let mut failed_commits = 0;
        for fail_at in 0..asked {
            let dir = tempfile::tempdir().unwrap();
            let db = dir.path().join("keel.db");
            let journal = play(&db, &plan, &mut rng.clone(), Some(fail_at));
            assert!(
                journal.asked > fail_at,
                "seed {seed}: the failure was not reached"
            );
            let mut acked = vec![None; plan.len()];
            for op in &journal.ops {
                if let Op::Ack { run, commit } = op {
                    acked[*run] = Some(*commit);
                }
            }
            let failed = plan
                .iter()
                .zip(&acked)
                .filter(|(p, a)| a.map_or(0, |a| a + 1) < p.commits.len())
                .count();
            failed_commits += failed;
            // A failed write of the WAL, or sync of what was just written to it, is a
            // commit's (a checkpoint writes the database, and syncs the WAL before it): that
            // commit must have failed, never been acknowledged.
            let wal = |file: &usize| journal.files[*file].0.to_string_lossy().ends_with("-wal");
            let at = journal
                .ops
                .iter()
                .position(|op| matches!(op, Op::Failed { .. }));
            let before = at.and_then(|at| at.checked_sub(1)).map(|b| &journal.ops[b]);
            let commits = match (at.map(|at| &journal.ops[at]), before) {
                (
                    Some(Op::Failed {
                        file,
                        what: Failure::Write,
                    }),
                    _,
                ) => wal(file),
                (
                    Some(Op::Failed {
                        file,
                        what: Failure::Sync,
                    }),
                    Some(Op::Write { file: w, .. }),
                ) => wal(file) && wal(w),
                _ => false,
            };
            assert!(
                !commits || failed == 1,
                "seed {seed}: write, truncate or sync {fail_at} of {asked} failed a commit's, \
                 and {failed} commits failed"
            );
            // The store as the process left it had it died right after the scenario, and as
            // its connections left it once they closed (the last one checkpoints the WAL into
            // the database and removes it).
            let died = tempfile::tempdir().unwrap();
            for (name, bytes) in cut(&journal, journal.ops.len(), 0, &mut rng.clone()) {
                std::fs::write(died.path().join(name), bytes).unwrap();
            }
            for (how, db) in [("died", &died.path().join("keel.db")), ("closed", &db)] {
                if let Err(problem) = check(db, &plan, &acked) {
                    panic!(
                        "seed {seed}: write, truncate or sync {fail_at} of {asked} failed, \
                         the process {how}: {problem}"
                    );
                }
            }
        }
        (asked, failed_commits)
    }

    #[test]
    fn a_failed_write_truncate_or_sync_anywhere_fails_at_most_its_commit_and_loses_nothing_acknowledged()
     {
        let (mut replays, mut failed) = (0, 0);
        for seed in seeds() {
            let (r, f) = io_errors(seed);
            replays += r;
            failed += f;
        }
        eprintln!("{replays} replays, each with one I/O failure: {failed} commits failed");
        assert!(failed > replays / 4, "{failed} of {replays}");
    }

    /// The seeds to run: `KEEL_POWER_SEED` alone (a failure names its seed, and replays
    /// exactly), or the first `KEEL_POWER_SEEDS` (4 by default).
    fn seeds() -> std::ops::Range<u64> {
        let var = |name| std::env::var(name).ok().and_then(|s| s.parse::<u64>().ok());
        match var("KEEL_POWER_SEED") {
            Some(seed) => seed..seed + 1,
            None => 0..var("KEEL_POWER_SEEDS").unwrap_or(4),
        }
    }

    #[test]
    fn after_a_power_cut_at_any_moment_every_acknowledged_commit_is_whole_and_no_other_is_seen_in_part()
     {
        let seeds = seeds();
        let mut cuts = 0;
        for seed in seeds.clone() {
            cuts += power_cuts(seed);
        }
        eprintln!("seeds {seeds:?}: {cuts} power cuts checked");
        assert!(cuts > 100 * seeds.count(), "{cuts} cuts");
    }
}
