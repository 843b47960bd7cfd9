//! keel-store's SQLite VFS, `keel`: SQLite's own `unix` VFS, except that what SQLite writes to
//! a WAL file reaches the file in one `pwrite` a commit instead of two a page.
//!
//! SQLite writes each WAL frame as two writes, its 24-byte header and then its page, so a
//! commit of four pages is eight `pwrite`s before its sync. Each is a system call, and where a
//! system call is dear (a VM whose kernel entries cost microseconds) the eight cost about half
//! as much CPU as the sync itself (see "What the figures show" in docs/performance.md). Here a WAL file's
//! writes that follow one another in the file are gathered in memory and written as one, and
//! they are written before anything else is done to the file or could see it:
//!
//! - after the page of a commit frame (a frame header whose "database size after commit" field
//!   is not zero: the WAL file format), so a commit's frames are in the file before SQLite
//!   publishes them in the WAL index for other connections to read, whatever `synchronous`
//!   says (with `FULL`, as keel-store runs, its sync comes next anyway);
//! - before a sync, read, truncate, size, lock, unlock, file control or close of the file;
//! - before a write that does not follow the gathered ones, and once they reach [`MOST`] bytes.
//!
//! A write that fails when it is made is reported by the call that made it (the sync of a
//! commit, say), and what it held is dropped, as a failed `pwrite` would leave it; SQLite then
//! fails the transaction as it does for any I/O error. A process that dies with writes
//! gathered has not committed them (a commit's frames are written before the commit returns),
//! and SQLite's recovery ignores a WAL's frames after its last whole commit, as after a crash
//! in the middle of the eight writes. Every other file (the database, its `-shm` index, a
//! statement journal) is the `unix` VFS's own, untouched. The files are the same as `unix`
//! makes: a connection of any other VFS (the `sqlite3` shell, a plain rusqlite connection)
//! reads and writes the same store beside keel's.
//!
//! This is the crate's one `unsafe` code: SQLite calls these functions through C pointers.
//! The invariants it relies on are stated beside each `unsafe` block.
#![allow(unsafe_code)]

use std::ffi::{CStr, c_int, c_void};
use std::ptr;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

use rusqlite::ffi;

/// The name the VFS is registered under.
pub const NAME: &CStr = c"keel";

/// Gathered writes are written once they hold this many bytes (a large transaction's pages):
/// the `unix` VFS writes at most 128 KiB in one call (it keeps only the low 17 bits of a
/// write's length), and SQLite's own writes are at most a page, 64 KiB, so a buffer never
/// holds more than twice this.
const MOST: usize = 64 * 1024;

/// The size of a WAL frame's header (the WAL file format).
pub const FRAME_HEADER: usize = 24;

/// Bytes this process's connections of this VFS have written to WAL files, in writes that
/// succeeded: a commit's frames (a header and a page each) and a new WAL's header.
static WAL_BYTES: AtomicU64 = AtomicU64::new(0);

/// The bytes this process has written to WAL files through this VFS so far, every connection
/// and thread together (a checkpoint's writes to the database are not counted). The
/// difference over some commits, divided by a frame's size (a page and [`FRAME_HEADER`]), is
/// how many pages they wrote: what their syncs had to carry to the disk.
pub fn wal_bytes_written() -> u64 {
    WAL_BYTES.load(Ordering::Relaxed)
}

/// A WAL file as SQLite holds it: `base` first (SQLite reads only its `pMethods`), then this
/// VFS's state; the `unix` VFS's own file follows in the same allocation, at [`HEADER`].
#[repr(C)]
struct WalFile {
    base: ffi::sqlite3_file,
    inner: *mut ffi::sqlite3_file,
    /// Writes not yet made, which follow one another in the file from offset `at`.
    buf: Vec<u8>,
    at: i64,
    /// The last write gathered was a commit frame's header: its page, next, ends the commit.
    commit_header: bool,
}

/// Where the `unix` file starts in a [`WalFile`]'s allocation.
const HEADER: usize = std::mem::size_of::<WalFile>().next_multiple_of(16);

/// The `unix` VFS, found once (SQLite keeps it for the life of the process).
struct Unix(*mut ffi::sqlite3_vfs);
// SAFETY: the pointer is to SQLite's static `unix` VFS, which SQLite never changes or frees
// once it is registered; it is only read (and passed back to SQLite) from any thread.
unsafe impl Send for Unix {}
// SAFETY: as for `Send`.
unsafe impl Sync for Unix {}

static UNIX: OnceLock<Result<Unix, c_int>> = OnceLock::new();

/// Registers the VFS (once per process) and returns its name, or SQLite's error code.
pub fn name() -> Result<&'static CStr, c_int> {
    match UNIX.get_or_init(register) {
        Ok(_) => Ok(NAME),
        Err(code) => Err(*code),
    }
}

fn register() -> Result<Unix, c_int> {
    // SAFETY: `sqlite3_vfs_find` initialises SQLite if needed and returns a pointer to a
    // registered VFS or null; the `unix` one is static. The copy made of it is leaked, so it
    // lives as long as the process, as `sqlite3_vfs_register` requires.
    unsafe {
        let unix = ffi::sqlite3_vfs_find(c"unix".as_ptr());
        if unix.is_null() {
            return Err(ffi::SQLITE_ERROR);
        }
        let mut vfs = *unix;
        let size = usize::try_from((*unix).szOsFile).map_err(|_| ffi::SQLITE_ERROR)?;
        vfs.szOsFile = c_int::try_from(HEADER + BELOW + size).map_err(|_| ffi::SQLITE_ERROR)?;
        vfs.zName = NAME.as_ptr();
        vfs.pNext = ptr::null_mut();
        vfs.xOpen = Some(open);
        // Every other method is `unix`'s own, called with this VFS's pointer: `unix`'s use
        // only what the copy holds unchanged (`pAppData`, `mxPathname`), and `open` passes
        // `unix`'s own pointer on.
        let vfs = Box::leak(Box::new(vfs));
        match ffi::sqlite3_vfs_register(vfs, 0) {
            ffi::SQLITE_OK => Ok(Unix(unix)),
            code => Err(code),
        }
    }
}

fn unix() -> *mut ffi::sqlite3_vfs {
    match UNIX.get() {
        Some(Ok(unix)) => unix.0,
        // `open` is only reached through the registered VFS, which exists only once
        // `register` succeeded.
        _ => ptr::null_mut(),
    }
}

/// `xOpen`: a WAL file is wrapped; any other file is the `unix` VFS's own.
unsafe extern "C" fn open(
    _vfs: *mut ffi::sqlite3_vfs,
    name: ffi::sqlite3_filename,
    file: *mut ffi::sqlite3_file,
    flags: c_int,
    out_flags: *mut c_int,
) -> c_int {
    let unix = unix();
    // SAFETY: `unix` is null or SQLite's static `unix` VFS (see `Unix`).
    let Some(unix_open) = (unsafe { unix.as_ref() }).and_then(|u| u.xOpen) else {
        return ffi::SQLITE_CANTOPEN;
    };
    if flags & ffi::SQLITE_OPEN_WAL == 0 {
        // SAFETY: SQLite gave `file` this VFS's `szOsFile` bytes, more than `unix` needs (and
        // in tests, a recorder over it); the other arguments are SQLite's own, unchanged.
        return unsafe { open_below(unix_open, unix, name, file, flags, out_flags) };
    }
    // SAFETY: SQLite gave `file` `HEADER + BELOW + unix's szOsFile` bytes, zeroed and aligned
    // for any C struct (as a `WalFile` is), owned by this file until `close`. The `unix` file
    // (in tests, a recorder over it) is opened in the bytes after `HEADER`; the `WalFile` is
    // written only once that succeeded, so a failed open leaves `pMethods` null (zeroed), as
    // SQLite expects, and nothing to drop.
    unsafe {
        let inner = file.cast::<u8>().add(HEADER).cast::<ffi::sqlite3_file>();
        let rc = open_below(unix_open, unix, name, inner, flags, out_flags);
        if rc != ffi::SQLITE_OK {
            return rc;
        }
        ptr::write(
            file.cast::<WalFile>(),
            WalFile {
                base: ffi::sqlite3_file {
                    pMethods: &WAL_METHODS,
                },
                inner,
                buf: Vec::new(),
                at: 0,
                commit_header: false,
            },
        );
    }
    ffi::SQLITE_OK
}

/// `unix`'s `xOpen`.
type OpenFn = unsafe extern "C" fn(
    *mut ffi::sqlite3_vfs,
    ffi::sqlite3_filename,
    *mut ffi::sqlite3_file,
    c_int,
    *mut c_int,
) -> c_int;

/// Bytes a file's allocation holds, besides `unix`'s file and a [`WalFile`], for what tests
/// put between them: a recorder of what reaches `unix` (see `power`). None outside tests.
#[cfg(not(test))]
const BELOW: usize = 0;
#[cfg(test)]
const BELOW: usize = power::SIZE;

/// Opens the file keel's own methods sit over: `unix`'s, or in a test that records what
/// reaches the disk, a recorder over `unix`'s.
///
/// # Safety
/// As `unix`'s `xOpen`, with `BELOW` more bytes at `file` than `unix` needs.
unsafe fn open_below(
    unix_open: OpenFn,
    unix: *mut ffi::sqlite3_vfs,
    name: ffi::sqlite3_filename,
    file: *mut ffi::sqlite3_file,
    flags: c_int,
    out_flags: *mut c_int,
) -> c_int {
    #[cfg(test)]
    if power::recording() {
        // SAFETY: as this function's contract states.
        return unsafe { power::open(unix_open, unix, name, file, flags, out_flags) };
    }
    // SAFETY: as this function's contract states.
    unsafe { unix_open(unix, name, file, flags, out_flags) }
}

/// The methods of a file type whose module defines one function of each name (`close`,
/// `read`, ...): the version-3 table SQLite calls them through.
macro_rules! io_methods {
    () => {
        ffi::sqlite3_io_methods {
            iVersion: 3,
            xClose: Some(close),
            xRead: Some(read),
            xWrite: Some(write),
            xTruncate: Some(truncate),
            xSync: Some(sync),
            xFileSize: Some(file_size),
            xLock: Some(lock),
            xUnlock: Some(unlock),
            xCheckReservedLock: Some(check_reserved_lock),
            xFileControl: Some(file_control),
            xSectorSize: Some(sector_size),
            xDeviceCharacteristics: Some(device_characteristics),
            xShmMap: Some(shm_map),
            xShmLock: Some(shm_lock),
            xShmBarrier: Some(shm_barrier),
            xShmUnmap: Some(shm_unmap),
            xFetch: Some(fetch),
            xUnfetch: Some(unfetch),
        }
    };
}

static WAL_METHODS: ffi::sqlite3_io_methods = io_methods!();

/// The wrapper `T` (a [`WalFile`], or in tests a recorder) SQLite passes to one of its methods.
///
/// # Safety
/// `file` must be a `T` that its `open` wrote and its `close` has not closed: SQLite calls
/// these methods only on such a file, one call at a time (a file belongs to one connection,
/// and a connection is used by one thread at a time: rusqlite's `Connection` is not `Sync`).
unsafe fn wrapper<'a, T>(file: *mut ffi::sqlite3_file) -> &'a mut T {
    // SAFETY: as the function's contract states.
    unsafe { &mut *file.cast::<T>() }
}

/// The methods of the file a wrapper sits over, opened by the `xOpen` below it.
fn methods_of(inner: *mut ffi::sqlite3_file) -> &'static ffi::sqlite3_io_methods {
    // SAFETY: a wrapper's `inner` was opened by the `xOpen` below it, which set `pMethods` to
    // its static methods (`unix`'s, or a test recorder's); it stays open until the wrapper's
    // `close`.
    unsafe { &*(*inner).pMethods }
}

/// Writes the gathered writes, in one write; forgets them whatever the outcome.
fn flush(w: &mut WalFile) -> c_int {
    if w.buf.is_empty() {
        return ffi::SQLITE_OK;
    }
    #[cfg(test)]
    if tests::FAIL_NEXT_WRITE.with(|f| f.replace(false)) {
        w.buf.clear();
        w.commit_header = false;
        return ffi::SQLITE_IOERR_WRITE;
    }
    let rc = match (methods_of(w.inner).xWrite, c_int::try_from(w.buf.len())) {
        // SAFETY: `inner` is open; the buffer is valid for its length during the call.
        (Some(write), Ok(n)) => unsafe { write(w.inner, w.buf.as_ptr().cast(), n, w.at) },
        _ => ffi::SQLITE_IOERR_WRITE,
    };
    #[cfg(test)]
    tests::WAL_WRITES.with(|c| c.set(c.get() + 1));
    if rc == ffi::SQLITE_OK {
        WAL_BYTES.fetch_add(w.buf.len() as u64, Ordering::Relaxed);
    }
    w.buf.clear();
    w.commit_header = false;
    rc
}

unsafe extern "C" fn write(
    file: *mut ffi::sqlite3_file,
    data: *const c_void,
    amount: c_int,
    offset: i64,
) -> c_int {
    // SAFETY: see `wrapper`.
    let w = unsafe { wrapper::<WalFile>(file) };
    let Ok(len) = usize::try_from(amount) else {
        return ffi::SQLITE_IOERR_WRITE;
    };
    if len == 0 {
        return ffi::SQLITE_OK;
    }
    // SAFETY: SQLite passes `amount` readable bytes at `data` for the call's length.
    let bytes = unsafe { std::slice::from_raw_parts(data.cast::<u8>(), len) };
    let ends_commit = w.commit_header;
    let follows = i64::try_from(w.buf.len())
        .ok()
        .and_then(|n| w.at.checked_add(n))
        .is_some_and(|end| end == offset);
    if !w.buf.is_empty() && (!follows || w.buf.len() + len > MOST) {
        let rc = flush(w);
        if rc != ffi::SQLITE_OK {
            return rc;
        }
    }
    if w.buf.is_empty() {
        w.at = offset;
    }
    w.buf.extend_from_slice(bytes);
    if ends_commit || w.buf.len() >= MOST {
        return flush(w);
    }
    w.commit_header = len == FRAME_HEADER && bytes[4..8] != [0; 4];
    ffi::SQLITE_OK
}

/// Forwards a method to the `unix` file after writing the gathered writes.
macro_rules! flushed {
    ($name:ident, $method:ident, ($($arg:ident: $ty:ty),*)) => {
        unsafe extern "C" fn $name(file: *mut ffi::sqlite3_file $(, $arg: $ty)*) -> c_int {
            // SAFETY: see `wrapper`.
            let w = unsafe { wrapper::<WalFile>(file) };
            let rc = flush(w);
            if rc != ffi::SQLITE_OK {
                return rc;
            }
            match methods_of(w.inner).$method {
                // SAFETY: `inner` is open; the arguments are SQLite's, passed on unchanged.
                Some(f) => unsafe { f(w.inner $(, $arg)*) },
                None => ffi::SQLITE_MISUSE,
            }
        }
    };
}

/// Forwards a method of a wrapper (`$wrapper`, with the file below it in `inner`) to the file
/// below it as it is.
macro_rules! forwarded {
    ($wrapper:ty: $name:ident, $method:ident, ($($arg:ident: $ty:ty),*), $default:expr) => {
        unsafe extern "C" fn $name(file: *mut ffi::sqlite3_file $(, $arg: $ty)*) -> c_int {
            // SAFETY: see `wrapper`.
            let w = unsafe { wrapper::<$wrapper>(file) };
            match methods_of(w.inner).$method {
                // SAFETY: `inner` is open; the arguments are SQLite's, passed on unchanged.
                Some(f) => unsafe { f(w.inner $(, $arg)*) },
                None => $default,
            }
        }
    };
}

flushed!(read, xRead, (buf: *mut c_void, amount: c_int, offset: i64));
flushed!(truncate, xTruncate, (size: i64));
flushed!(sync, xSync, (flags: c_int));
flushed!(file_size, xFileSize, (size: *mut i64));
flushed!(lock, xLock, (level: c_int));
flushed!(unlock, xUnlock, (level: c_int));
flushed!(file_control, xFileControl, (op: c_int, arg: *mut c_void));
flushed!(fetch, xFetch, (offset: i64, amount: c_int, pp: *mut *mut c_void));
forwarded!(WalFile: check_reserved_lock, xCheckReservedLock, (out: *mut c_int), ffi::SQLITE_MISUSE);
forwarded!(WalFile: sector_size, xSectorSize, (), 4096);
forwarded!(WalFile: device_characteristics, xDeviceCharacteristics, (), 0);
forwarded!(WalFile: shm_map, xShmMap, (page: c_int, size: c_int, extend: c_int, pp: *mut *mut c_void), ffi::SQLITE_IOERR_SHMMAP);
forwarded!(WalFile: shm_lock, xShmLock, (offset: c_int, n: c_int, flags: c_int), ffi::SQLITE_IOERR_SHMLOCK);
forwarded!(WalFile: shm_unmap, xShmUnmap, (delete: c_int), ffi::SQLITE_OK);
forwarded!(WalFile: unfetch, xUnfetch, (offset: i64, p: *mut c_void), ffi::SQLITE_OK);

unsafe extern "C" fn shm_barrier(file: *mut ffi::sqlite3_file) {
    // SAFETY: see `wrapper`.
    let w = unsafe { wrapper::<WalFile>(file) };
    if let Some(f) = methods_of(w.inner).xShmBarrier {
        // SAFETY: `inner` is open.
        unsafe { f(w.inner) }
    }
}

/// `xClose`: writes what is gathered, closes the `unix` file and drops this VFS's state.
unsafe extern "C" fn close(file: *mut ffi::sqlite3_file) -> c_int {
    // SAFETY: see `wrapper`. This is the file's last call: its state is dropped here, once.
    let w = unsafe { wrapper::<WalFile>(file) };
    let flushed = flush(w);
    let closed = match methods_of(w.inner).xClose {
        // SAFETY: `inner` is open; SQLite does not use it again.
        Some(f) => unsafe { f(w.inner) },
        None => ffi::SQLITE_OK,
    };
    // SAFETY: `buf` was written by `open` and is not used again; `pMethods` is cleared so
    // that the file reads as closed.
    unsafe { ptr::drop_in_place(&mut w.buf) };
    w.base.pMethods = ptr::null();
    if flushed != ffi::SQLITE_OK {
        flushed
    } else {
        closed
    }
}

#[cfg(test)]
mod power;

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use rusqlite::{Connection, OpenFlags};
    use std::cell::Cell;

    thread_local! {
        /// Writes that reached a WAL file on this thread.
        pub(crate) static WAL_WRITES: Cell<u64> = const { Cell::new(0) };
        /// The next write to a WAL file on this thread fails, as a full disk makes it fail.
        pub(crate) static FAIL_NEXT_WRITE: Cell<bool> = const { Cell::new(false) };
    }

    fn writes() -> u64 {
        WAL_WRITES.with(Cell::get)
    }

    fn open(path: &std::path::Path, synchronous: &str) -> Connection {
        let conn = Connection::open_with_flags_and_vfs(path, OpenFlags::default(), name().unwrap())
            .unwrap();
        conn.pragma_update(None, "journal_mode", "WAL").unwrap();
        conn.pragma_update(None, "synchronous", synchronous)
            .unwrap();
        conn
    }

    #[test]
    fn a_commit_of_several_pages_reaches_the_wal_in_one_write() {
        let dir = tempfile::tempdir().unwrap();
        let conn = open(&dir.path().join("db"), "FULL");
        conn.execute_batch(
            "CREATE TABLE t (id INTEGER PRIMARY KEY, body BLOB); CREATE TABLE u (x);",
        )
        .unwrap();
        for i in 0..20 {
            let before = writes();
            // Two tables and a row larger than a page: five pages or more in one commit.
            conn.execute_batch("BEGIN").unwrap();
            conn.execute("INSERT INTO t (body) VALUES (?1)", [vec![i as u8; 6000]])
                .unwrap();
            conn.execute("INSERT INTO u VALUES (?1)", [i]).unwrap();
            conn.execute_batch("COMMIT").unwrap();
            assert_eq!(writes() - before, 1, "commit {i}");
        }
        let frames: i64 = conn
            .query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |r| r.get(1))
            .unwrap();
        assert!(frames >= 4 * 20, "the commits wrote {frames} frames");
    }

    /// Every byte a commit adds to the WAL is counted (other tests' connections may add to the
    /// same count meanwhile, never take from it).
    #[test]
    fn the_bytes_written_to_the_wal_count_each_commit_s_frames() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("db");
        let conn = open(&path, "FULL");
        // No checkpoint: the WAL only grows, by the frames each commit writes.
        conn.execute_batch(
            "PRAGMA wal_autocheckpoint = 0; CREATE TABLE t (id INTEGER PRIMARY KEY, body BLOB);",
        )
        .unwrap();
        let page: u64 = conn
            .pragma_query_value(None, "page_size", |r| r.get(0))
            .unwrap();
        let wal = dir.path().join("db-wal");
        let wal_len = || std::fs::metadata(&wal).map_or(0, |m| m.len());
        for i in 0..5u8 {
            let (counted, len) = (wal_bytes_written(), wal_len());
            conn.execute(
                "INSERT INTO t (body) VALUES (?1)",
                [vec![i; 3 * page as usize]],
            )
            .unwrap();
            let (counted, grew) = (wal_bytes_written() - counted, wal_len() - len);
            assert!(
                grew >= 3 * (page + FRAME_HEADER as u64),
                "commit {i}: the WAL grew by {grew} bytes"
            );
            assert!(
                counted >= grew,
                "commit {i}: {counted} bytes counted, the WAL grew by {grew}"
            );
        }
    }

    #[test]
    fn each_commit_is_seen_at_once_by_other_connections_whatever_synchronous_says() {
        for synchronous in ["OFF", "NORMAL", "FULL"] {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("db");
            let writer = open(&path, synchronous);
            writer
                .execute_batch("CREATE TABLE t (id INTEGER PRIMARY KEY, body BLOB)")
                .unwrap();
            let reader = open(&path, synchronous);
            // A connection of SQLite's own VFS, as another program would open the store.
            let plain = Connection::open(&path).unwrap();
            for i in 1..=50i64 {
                writer
                    .execute(
                        "INSERT INTO t (id, body) VALUES (?1, ?2)",
                        rusqlite::params![i, vec![7u8; 3000]],
                    )
                    .unwrap();
                for conn in [&reader, &plain] {
                    let (n, last): (i64, i64) = conn
                        .query_row("SELECT count(*), max(id) FROM t", [], |r| {
                            Ok((r.get(0)?, r.get(1)?))
                        })
                        .unwrap();
                    assert_eq!((n, last), (i, i), "synchronous = {synchronous}");
                }
            }
        }
    }

    #[test]
    fn large_transactions_and_checkpoints_keep_every_row() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("db");
        {
            let conn = open(&path, "FULL");
            // Checkpoints every 100 pages: several run between and inside the transactions.
            conn.pragma_update(None, "wal_autocheckpoint", 100).unwrap();
            conn.execute_batch("CREATE TABLE t (id INTEGER PRIMARY KEY, body BLOB)")
                .unwrap();
            // Past the buffer's bound in one transaction, and past the automatic checkpoint.
            for round in 0..6i64 {
                let tx = conn.unchecked_transaction().unwrap();
                for i in 0..300i64 {
                    tx.execute(
                        "INSERT INTO t (id, body) VALUES (?1, ?2)",
                        rusqlite::params![round * 1000 + i, vec![(i % 251) as u8; 1500]],
                    )
                    .unwrap();
                }
                tx.commit().unwrap();
            }
            conn.execute("DELETE FROM t WHERE id % 3 = 0", []).unwrap();
        }
        for conn in [open(&path, "FULL"), Connection::open(&path).unwrap()] {
            let check: String = conn
                .query_row("PRAGMA integrity_check", [], |r| r.get(0))
                .unwrap();
            assert_eq!(check, "ok");
            let (n, sum): (i64, i64) = conn
                .query_row("SELECT count(*), sum(length(body)) FROM t", [], |r| {
                    Ok((r.get(0)?, r.get(1)?))
                })
                .unwrap();
            assert_eq!(n, 1200);
            assert_eq!(sum, 1200 * 1500);
        }
    }

    #[test]
    fn a_failed_write_fails_its_commit_and_the_next_commit_goes_on_from_the_last_good_one() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("db");
        let conn = open(&path, "FULL");
        conn.execute_batch("CREATE TABLE t (id INTEGER PRIMARY KEY, body BLOB)")
            .unwrap();
        conn.execute("INSERT INTO t VALUES (1, 'kept')", [])
            .unwrap();
        FAIL_NEXT_WRITE.with(|f| f.set(true));
        let err = conn
            .execute("INSERT INTO t VALUES (2, 'lost')", [])
            .unwrap_err();
        assert_eq!(
            err.sqlite_error_code(),
            Some(rusqlite::ErrorCode::SystemIoFailure),
            "{err}"
        );
        assert!(
            !FAIL_NEXT_WRITE.with(Cell::get),
            "the failure was not reached"
        );
        conn.execute("INSERT INTO t VALUES (3, 'after')", [])
            .unwrap();
        drop(conn);
        for conn in [open(&path, "FULL"), Connection::open(&path).unwrap()] {
            let ids: Vec<i64> = conn
                .prepare("SELECT id FROM t ORDER BY id")
                .unwrap()
                .query_map([], |r| r.get(0))
                .unwrap()
                .collect::<Result<_, _>>()
                .unwrap();
            assert_eq!(ids, [1, 3]);
            let check: String = conn
                .query_row("PRAGMA integrity_check", [], |r| r.get(0))
                .unwrap();
            assert_eq!(check, "ok");
        }
    }
}
