//! The private temporary directory of each command, and the directories kept for the next.
//!
//! A command's private directory (`keel-sandbox-XXXXXX` in the system's temporary directory)
//! holds its `TMPDIR` (`tmp`, the one place in it the command may write), the cover of hidden
//! files and the refusal report. Made and removed for every command, these were two directories
//! allocated and released per command; on a filesystem without a journal ext4 keeps a released
//! inode unused for a minute or more and passes over each such inode, reading it, at every
//! allocation near it, so a worker running many commands made every later file creation slower,
//! its own included (a quarter of keel's CPU in `keel-bench`'s 1,000 runs went there).
//!
//! So an ended command's directory is emptied and kept for the next command of this process
//! when, and only when, nothing of the command can remain in it: the helper exited by itself
//! (its first stage waits until every process of the command is gone), its `tmp` is still the same
//! directory (device and inode), with the mode, owner and inode flags it was made with and no
//! extended attribute (no ACL that would grant the next command's files to someone), and
//! everything the command left in it was removed. Anything else (a `tmp` it could not empty, a
//! changed mode, an attribute) and the directory is removed as before. At most [`KEPT`]
//! directories are kept; they are removed when the process exits normally (`atexit`).
//!
//! A process killed by a signal cannot remove them, nor the directory of a command it was
//! running. So the private directories are made inside a directory of the process
//! (`keel-sandboxes-XXXXXX`), whose file `lock` it holds locked (`flock`) for as long as it
//! lives; the kernel releases the lock when the process ends, however it ends. A process sweeps
//! the system's temporary directory when it makes its own: a `keel-sandboxes-` directory whose
//! `lock` it can lock belongs to no living process and is removed, with everything in it. The
//! lock is taken before the file gets its name, so a directory being made is never taken for
//! a dead one; a lock held by a process in another PID namespace holds all the same. When the
//! process's directory cannot be made, or was removed under it, private directories are made in
//! the system's temporary directory itself.

use std::fs;
use std::os::fd::OwnedFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, Once, OnceLock, PoisonError};

use crate::error::SandboxError;
use crate::netns;
use crate::{COVER_FILE, REPORT_FILE};

/// Directories kept for later commands at most (one per command that runs at the same time).
pub(crate) const KEPT: usize = 64;

/// Emptied private directories of ended commands, ready for the next.
static POOL: Mutex<Vec<Kept>> = Mutex::new(Vec::new());

/// A kept directory and what it and its `tmp` were made as.
#[derive(Debug)]
struct Kept {
    root: PathBuf,
    made: [Made; 2],
}

/// What the command must not have changed about its directory and its `tmp` (it owns both,
/// and Landlock does not restrict changing their mode or attributes) for them to be kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Made {
    dev: u64,
    ino: u64,
    mode: u32,
    uid: u32,
    gid: u32,
    flags: Option<u32>,
}

impl Made {
    fn read(tmp: &Path) -> Option<Made> {
        let meta = fs::symlink_metadata(tmp).ok()?;
        if !meta.is_dir() {
            return None;
        }
        // Inode flags (chattr's): a filesystem that has none reads as None both times.
        let flags = fs::File::open(tmp)
            .ok()
            .and_then(|dir| rustix::fs::ioctl_getflags(&dir).ok())
            .map(|flags| flags.bits());
        Some(Made {
            dev: meta.dev(),
            ino: meta.ino(),
            mode: meta.mode(),
            uid: meta.uid(),
            gid: meta.gid(),
            flags,
        })
    }
}

/// A private temporary directory for one command: writable by it, its `TMPDIR`, removed on drop,
/// or emptied and kept for the next command once the helper has exited by itself (see the
/// module and [`PrivateTmp::helper_exited`]). It also holds the helper's refusal report, and
/// the command's network namespace when the caller made it (see `netns`), kept on the same
/// condition.
#[derive(Debug)]
pub struct PrivateTmp {
    root: PathBuf,
    tmp: PathBuf,
    /// The directory and its `tmp`.
    made: [Made; 2],
    /// Whether the helper exited by itself (see [`PrivateTmp::helper_exited`]).
    ended: bool,
    /// The command's network namespace, when the caller made it.
    pub(crate) net: Option<OwnedFd>,
    /// The command's pids cgroup, when the caller made it.
    pub(crate) cgroup: Option<crate::cgroup::Taken>,
}

impl PrivateTmp {
    pub(crate) fn new() -> Result<Self, SandboxError> {
        let kept = POOL.lock().unwrap_or_else(PoisonError::into_inner).pop();
        if let Some(Kept { root, made }) = kept {
            let tmp = root.join("tmp");
            return Ok(PrivateTmp {
                root,
                tmp,
                made,
                ended: false,
                net: None,
                cgroup: None,
            });
        }
        let mut builder = tempfile::Builder::new();
        builder.prefix("keel-sandbox-");
        // In the system's temporary directory itself when the process's directory is gone (a
        // cleaner of old files in /tmp may remove it under a process that runs for days).
        let root = process_dir()
            .and_then(|dir| builder.tempdir_in(dir).ok())
            .map_or_else(|| builder.tempdir(), Ok)
            .map_err(|source| SandboxError::Io {
                what: "create the private temporary directory".into(),
                source,
            })?
            .keep();
        let tmp = root.join("tmp");
        let made = fs::create_dir(&tmp)
            .map_err(|source| SandboxError::Io {
                what: format!("create {}", tmp.display()),
                source,
            })
            .and_then(|()| match (Made::read(&root), Made::read(&tmp)) {
                (Some(root), Some(tmp)) => Ok([root, tmp]),
                _ => Err(SandboxError::Io {
                    what: format!("read what {} was made as", tmp.display()),
                    source: std::io::Error::other("not a directory after it was made"),
                }),
            });
        match made {
            Ok(made) => Ok(PrivateTmp {
                root,
                tmp,
                made,
                ended: false,
                net: None,
                cgroup: None,
            }),
            Err(e) => {
                let _ = fs::remove_dir_all(&root);
                Err(e)
            }
        }
    }

    /// Says that the helper was waited for and exited by itself (with an exit code, not killed
    /// by a signal). Its first stage exits only once every process of the command is gone, so
    /// nothing can write into the directory any more and it may be kept for the next command
    /// (and so may the command's network namespace, nothing holding a socket in it, and its
    /// cgroup, once no task is left in it).
    /// Without this, drop removes it: a helper killed with SIGKILL may leave the command's
    /// processes dying for a moment after it.
    pub fn helper_exited(&mut self) {
        self.ended = true;
    }

    /// Starts `cmd`, the command [`Sandbox::command`](crate::Sandbox::command) returned with
    /// this directory, configured by the caller (its stdio, its process group). As root under
    /// cgroup v1 it is started from the thread of this process that is in the command's cgroup,
    /// so that the helper and the command start inside it and none of them has to move in
    /// (see `cgroup`); otherwise from the calling thread. `cmd.spawn()` works too, only slower.
    pub fn spawn(&self, mut cmd: std::process::Command) -> std::io::Result<std::process::Child> {
        match &self.cgroup {
            Some(taken) => taken.spawn(cmd),
            None => cmd.spawn(),
        }
    }

    /// The command's `TMPDIR`.
    pub fn path(&self) -> &Path {
        &self.tmp
    }

    pub(crate) fn root(&self) -> &Path {
        &self.root
    }

    /// Why the sandbox refused to start the command, if it did (the helper then exited
    /// [`REFUSED_EXIT_CODE`](crate::REFUSED_EXIT_CODE)). `None` if the command started (or the
    /// helper never ran).
    pub fn refusal(&self) -> Option<String> {
        let text = fs::read_to_string(self.root.join(REPORT_FILE)).ok()?;
        let text = text.trim();
        (!text.is_empty()).then(|| text.to_string())
    }

    /// Empties the directory for the next command; false when it must be removed instead.
    fn reset(&self) -> bool {
        if !self.ended {
            return false;
        }
        for (dir, made) in [&self.root, &self.tmp].into_iter().zip(self.made) {
            if Made::read(dir) != Some(made) || has_attributes(dir) {
                return false;
            }
        }
        let Ok(entries) = fs::read_dir(&self.root) else {
            return false;
        };
        for entry in entries {
            let Ok(entry) = entry else {
                return false;
            };
            let name = entry.file_name();
            if name == "tmp" {
                continue;
            }
            // Stage 1 makes only these, outside the command's reach.
            if (name != COVER_FILE && name != REPORT_FILE && name != netns::SPOILED)
                || fs::remove_file(entry.path()).is_err()
            {
                return false;
            }
        }
        empty(&self.tmp)
    }
}

/// Whether `path` has any extended attribute (an ACL is one), or it cannot be told. Any at all:
/// on a system that labels every file (SELinux) no directory is kept, and each is removed as
/// before, rather than tell which labels a command may have changed.
fn has_attributes(path: &Path) -> bool {
    // An empty list is 0 bytes long; a list longer than the buffer is an error (ERANGE).
    let mut names = [0u8; 256];
    !matches!(rustix::fs::listxattr(path, &mut names[..]), Ok(0))
}

/// Removes everything in the directory `dir` (not following symbolic links); false if
/// anything is left.
fn empty(dir: &Path) -> bool {
    let Ok(entries) = fs::read_dir(dir) else {
        return false;
    };
    for entry in entries {
        let Ok(entry) = entry else {
            return false;
        };
        let path = entry.path();
        let removed = match entry.file_type() {
            Ok(kind) if kind.is_dir() => fs::remove_dir_all(&path),
            Ok(_) => fs::remove_file(&path),
            Err(e) => Err(e),
        };
        if removed.is_err() {
            return false;
        }
    }
    true
}

impl Drop for PrivateTmp {
    fn drop(&mut self) {
        if let Some(net) = self.net.take()
            && self.ended
            && !self.root.join(netns::SPOILED).exists()
        {
            netns::keep(net);
        }
        if let Some(taken) = self.cgroup.take() {
            if self.ended {
                crate::cgroup::give_back(taken);
            } else {
                crate::cgroup::abandon(taken);
            }
        }
        if self.reset() {
            let mut pool = POOL.lock().unwrap_or_else(PoisonError::into_inner);
            if pool.len() < KEPT {
                pool.push(Kept {
                    root: std::mem::take(&mut self.root),
                    made: self.made,
                });
                drop(pool);
                remove_kept_at_exit();
                return;
            }
        }
        let _ = fs::remove_dir_all(&self.root);
    }
}

/// The name of the lock file in a process's directory.
const LOCK: &str = "lock";

/// This process's directory (see [`process_dir`]) and its locked `lock`, open for as long as
/// the process lives (the file is closed on exec, so no command inherits the lock).
static PROCESS_DIR: OnceLock<Option<(PathBuf, fs::File)>> = OnceLock::new();

/// This process's directory for its commands' private directories, made (after a sweep of the
/// directories of processes that are gone) the first time one is needed; `None` when it cannot
/// be made, and the private directories are made in the system's temporary directory itself.
fn process_dir() -> Option<&'static Path> {
    PROCESS_DIR
        .get_or_init(|| {
            let base = std::env::temp_dir();
            sweep(&base);
            let made = make_process_dir(&base);
            if made.is_some() {
                remove_kept_at_exit();
            }
            made
        })
        .as_ref()
        .map(|(dir, _)| dir.as_path())
}

/// This process's directory if it was made, without making it.
fn process_dir_made() -> Option<&'static Path> {
    PROCESS_DIR.get()?.as_ref().map(|(dir, _)| dir.as_path())
}

/// Makes `keel-sandboxes-XXXXXX` (mode 0711) in `base` with its `lock` locked: the lock is taken on a file
/// of another name, which is then renamed `lock`, so that no sweep finds it unlocked.
fn make_process_dir(base: &Path) -> Option<(PathBuf, fs::File)> {
    // Others may pass through it (a helper that drops to another user reaches its command's
    // directory), not list it.
    let dir = tempfile::Builder::new()
        .prefix("keel-sandboxes-")
        .permissions(std::os::unix::fs::PermissionsExt::from_mode(0o711))
        .tempdir_in(base)
        .ok()?
        .keep();
    let locked = (|| -> std::io::Result<fs::File> {
        let unnamed = dir.join("lock.new");
        let file = fs::File::create(&unnamed)?;
        rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive)?;
        fs::rename(&unnamed, dir.join(LOCK))?;
        Ok(file)
    })();
    match locked {
        Ok(file) => Some((dir, file)),
        Err(_) => {
            let _ = fs::remove_dir_all(&dir);
            None
        }
    }
}

/// Removes the `keel-sandboxes-` directories in `base` whose `lock` this process can lock:
/// their processes are gone. A directory without a `lock` (one being made) is left alone.
fn sweep(base: &Path) {
    let Ok(entries) = fs::read_dir(base) else {
        return;
    };
    for entry in entries.flatten() {
        if !entry
            .file_name()
            .to_str()
            .is_some_and(|name| name.starts_with("keel-sandboxes-"))
        {
            continue;
        }
        let dir = entry.path();
        let Ok(lock) = fs::File::open(dir.join(LOCK)) else {
            continue;
        };
        if rustix::fs::flock(&lock, rustix::fs::FlockOperation::NonBlockingLockExclusive).is_ok() {
            let _ = fs::remove_dir_all(&dir);
        }
    }
}

/// Removes the kept directories; the pool is empty afterwards. Called at exit.
fn remove_kept() {
    // At exit a thread may still hold the lock (the process is ending under it): leave the
    // directories then rather than wait.
    let kept = match POOL.try_lock() {
        Ok(mut pool) => std::mem::take(&mut *pool),
        Err(std::sync::TryLockError::Poisoned(pool)) => std::mem::take(&mut *pool.into_inner()),
        Err(std::sync::TryLockError::WouldBlock) => return,
    };
    for Kept { root, .. } in kept {
        let _ = fs::remove_dir_all(root);
    }
    // The process's directory too, when nothing but its lock is left in it (a command still
    // running at exit keeps it, and a later sweep removes it).
    if let Some(dir) = process_dir_made() {
        let only_lock = fs::read_dir(dir).is_ok_and(|entries| {
            entries
                .flatten()
                .all(|e| e.file_name().to_str() == Some(LOCK))
        });
        if only_lock {
            let _ = fs::remove_dir_all(dir);
        }
    }
    crate::cgroup::remove_kept();
}

/// Registers [`remove_kept`] (which also removes the kept cgroups) with `atexit`, once.
pub(crate) fn remove_kept_at_exit() {
    static REGISTERED: Once = Once::new();
    extern "C" fn at_exit() {
        // Nothing may unwind out of an `extern "C"` function.
        let _ = std::panic::catch_unwind(remove_kept);
    }
    REGISTERED.call_once(|| {
        // SAFETY: `at_exit` takes no arguments, returns nothing and never unwinds; atexit only
        // stores the pointer, to a function that lives as long as the program.
        #[allow(unsafe_code)]
        let _ = unsafe { nix::libc::atexit(at_exit) };
    });
}

/// How many directories are kept now (for tests).
#[doc(hidden)]
pub fn kept() -> usize {
    POOL.lock().unwrap_or_else(PoisonError::into_inner).len()
}
