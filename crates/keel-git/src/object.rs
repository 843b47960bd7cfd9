//! Writing a snapshot in keel's own process: a commit object and a loose ref, in git's formats.
//!
//! A snapshot was two git processes (`commit-tree`, `update-ref`), and with many runs in one
//! process each git process cost more than everything else the checkpoint did (most of it in
//! the dynamic loader). Both are small and fully specified formats, so keel writes them itself
//! when the repository is the plain kind it knows:
//!
//! - a commit is a zlib-compressed loose object `objects/<2 hex>/<38 hex>` named by the SHA-1 of
//!   `commit <length>\0<body>`, written to a temporary file (`tmp_obj_…`, which `git prune`
//!   removes if keel dies first) and renamed into place, read-only, as git does;
//! - a ref is `<git dir>/<refname>` holding the id, written through `<refname>.lock` (created
//!   exclusively, so a git or keel writing the same ref at the same time fails rather than
//!   interleaves) and renamed over the ref.
//!
//! Whatever this module does not know is left to git, whose behaviour is the reference: a
//! SHA-256 repository, a linked worktree (its refs live in the common directory), reftable refs,
//! shared-repository permissions, reflogs (`core.logAllRefUpdates=always`, or a reflog the ref
//! already has), a tree or parent not found loose or in a pack index (an alternate object store,
//! say), a name that conflicts with a packed ref. Like git's own defaults (`core.fsync`), neither
//! file is fsynced.

use std::fs;
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{FileExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use sha1::{Digest, Sha1};

/// The body of a commit object as `git commit-tree` writes it with keel's fixed identity.
pub(crate) fn commit_body(tree: &str, parent: Option<&str>, message: &str, secs: u64) -> Vec<u8> {
    let mut body = format!("tree {tree}\n");
    if let Some(parent) = parent {
        body.push_str(&format!("parent {parent}\n"));
    }
    let ident = format!("keel <keel@localhost> {secs} +0000");
    body.push_str(&format!("author {ident}\ncommitter {ident}\n\n"));
    body.push_str(message);
    body.into_bytes()
}

/// The SHA-1 object id of an object of `kind` with `body`.
pub(crate) fn object_id(kind: &str, body: &[u8]) -> String {
    let mut hasher = Sha1::new();
    hasher.update(format!("{kind} {}\0", body.len()).as_bytes());
    hasher.update(body);
    hex(&hasher.finalize())
}

fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(bytes.len() * 2);
    for byte in bytes {
        out.push(DIGITS[usize::from(byte >> 4)] as char);
        out.push(DIGITS[usize::from(byte & 0xf)] as char);
    }
    out
}

/// Writes a loose object of `kind` into `objects` (a repository's object directory) and returns
/// its id. An object that is already there is left as it is.
pub(crate) fn write_loose(objects: &Path, kind: &str, body: &[u8]) -> io::Result<String> {
    let id = object_id(kind, body);
    let dir = objects.join(&id[..2]);
    let path = dir.join(&id[2..]);
    if fs::symlink_metadata(&path).is_ok() {
        return Ok(id);
    }
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let temp = dir.join(format!(
        "tmp_obj_keel_{}_{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    let written = (|| {
        let file = create_new_in(&temp)?;
        let mut encoder = flate2::write::ZlibEncoder::new(file, flate2::Compression::default());
        encoder.write_all(format!("{kind} {}\0", body.len()).as_bytes())?;
        encoder.write_all(body)?;
        let file = encoder.finish()?;
        file.set_permissions(fs::Permissions::from_mode(0o444))?;
        fs::rename(&temp, &path)
    })();
    if written.is_err() {
        let _ = fs::remove_file(&temp);
    }
    written.map(|()| id)
}

/// Whether the object `id` is in `objects` as a loose object or in one of its packs: `Some`
/// when that is known for certain, `None` when only git can tell (a pack index of a version
/// this does not read, an unreadable file). An object in an alternate store reads as absent.
pub(crate) fn present(objects: &Path, id: &str) -> Option<bool> {
    if id.len() != 40 {
        return None;
    }
    if fs::symlink_metadata(objects.join(&id[..2]).join(&id[2..])).is_ok() {
        return Some(true);
    }
    let wanted = unhex(id)?;
    let packs = match fs::read_dir(objects.join("pack")) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Some(false),
        Err(_) => return None,
    };
    for entry in packs {
        let path = entry.ok()?.path();
        if path.extension().is_some_and(|ext| ext == "idx") && in_pack_index(&path, &wanted)? {
            return Some(true);
        }
    }
    Some(false)
}

fn unhex(id: &str) -> Option<[u8; 20]> {
    let mut out = [0u8; 20];
    for (i, pair) in id.as_bytes().chunks(2).enumerate() {
        let digit = |b: u8| (b as char).to_digit(16);
        let value = digit(pair[0])? * 16 + digit(*pair.get(1)?)?;
        *out.get_mut(i)? = u8::try_from(value).ok()?;
    }
    Some(out)
}

/// Looks `wanted` up in a version-2 pack index (`\377tOc`, version 2, a fan-out table of 256
/// counts, then the sorted object names), reading only the fan-out and the names a binary
/// search visits. `None` for any other version or a short file.
fn in_pack_index(path: &Path, wanted: &[u8; 20]) -> Option<bool> {
    let mut file = fs::File::open(path).ok()?;
    let mut header = [0u8; 8];
    file.read_exact(&mut header).ok()?;
    if header != [0xff, b't', b'O', b'c', 0, 0, 0, 2] {
        return None;
    }
    let first = usize::from(wanted[0]);
    let count_at = |i: usize| -> Option<u64> {
        let mut word = [0u8; 4];
        file.read_exact_at(&mut word, 8 + 4 * i as u64).ok()?;
        Some(u64::from(u32::from_be_bytes(word)))
    };
    let (mut low, mut high) = (
        if first == 0 { 0 } else { count_at(first - 1)? },
        count_at(first)?,
    );
    let names = 8 + 4 * 256;
    let mut name = [0u8; 20];
    while low < high {
        let middle = low + (high - low) / 2;
        file.seek(SeekFrom::Start(names + 20 * middle)).ok()?;
        file.read_exact(&mut name).ok()?;
        match name.cmp(wanted) {
            std::cmp::Ordering::Equal => return Some(true),
            std::cmp::Ordering::Less => low = middle + 1,
            std::cmp::Ordering::Greater => high = middle,
        }
    }
    Some(false)
}

/// Points the loose ref `refname` (a full name under `refs/`) of `git_dir` at `id`, as
/// `git update-ref --no-deref` would in a repository without reflogs for it. False when it did
/// not: something git must decide (a conflict with a packed ref, a reflog to keep) or a file
/// operation that failed (a lock held, a file where a directory must be), which git then
/// reports in its own words.
pub(crate) fn write_ref(git_dir: &Path, refname: &str, id: &str) -> bool {
    if fs::symlink_metadata(git_dir.join("logs").join(refname)).is_ok()
        || packed_conflict(git_dir, refname).unwrap_or(true)
    {
        return false;
    }
    let path = git_dir.join(refname);
    let lock = lock_path(&path);
    let Ok(mut file) = create_new_in(&lock) else {
        return false;
    };
    let written = file
        .write_all(format!("{id}\n").as_bytes())
        .and_then(|()| fs::rename(&lock, &path));
    if written.is_err() {
        let _ = fs::remove_file(&lock);
    }
    written.is_ok()
}

/// Creates the new file `path`, and its directory first if that is missing (asked only then:
/// a `mkdir` of a directory that is there costs a path lookup under the parent's lock).
fn create_new_in(path: &Path) -> io::Result<fs::File> {
    let create = || fs::File::options().write(true).create_new(true).open(path);
    match create() {
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            if let Some(parent) = path.parent() {
                fs::create_dir_all(parent)?;
            }
            create()
        }
        other => other,
    }
}

fn lock_path(path: &Path) -> PathBuf {
    let mut lock = path.as_os_str().to_os_string();
    lock.push(".lock");
    PathBuf::from(lock)
}

/// Whether a packed ref is a directory of `refname` (`refs/keel` for `refs/keel/r/1`) or lies
/// under it: git refuses such an update, and says why.
fn packed_conflict(git_dir: &Path, refname: &str) -> io::Result<bool> {
    let text = match fs::read(git_dir.join("packed-refs")) {
        Ok(text) => text,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(e),
    };
    let under = format!("{refname}/");
    Ok(text.split(|b| *b == b'\n').any(|line| {
        // "<id> <name>" lines; "# pack-refs with: …" is the header, "^<id>" a peeled tag.
        if line.starts_with(b"#") || line.starts_with(b"^") {
            return false;
        }
        let Some(name) = line.splitn(2, |b| *b == b' ').nth(1) else {
            return false;
        };
        name.starts_with(under.as_bytes())
            || (refname.as_bytes().starts_with(name)
                && refname.as_bytes().get(name.len()) == Some(&b'/'))
    }))
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn object_ids_are_git_s() {
        // `printf 'hello\n' | git hash-object --stdin`
        assert_eq!(
            object_id("blob", b"hello\n"),
            "ce013625030ba8dba906f756967f9e9ca394464a"
        );
        // The empty tree.
        assert_eq!(
            object_id("tree", b""),
            "4b825dc642cb6eb9a060e54bf8d69288fbee4904"
        );
    }

    #[test]
    fn ids_that_are_not_hex_are_not_looked_up() {
        assert_eq!(unhex(&"g".repeat(40)), None);
        assert_eq!(present(Path::new("/nonexistent"), "abc"), None);
    }

    #[test]
    fn packed_refs_that_are_a_directory_of_the_name_or_under_it_conflict() {
        let dir = tempfile::tempdir().unwrap();
        let z = "0".repeat(40);
        fs::write(
            dir.path().join("packed-refs"),
            format!("# pack-refs with: peeled fully-peeled sorted\n{z} refs/keel/r\n^{z}\n{z} refs/heads/main\n"),
        )
        .unwrap();
        assert!(packed_conflict(dir.path(), "refs/keel/r/1").unwrap());
        assert!(packed_conflict(dir.path(), "refs/heads").unwrap());
        assert!(!packed_conflict(dir.path(), "refs/keel/rr/1").unwrap());
        assert!(!packed_conflict(dir.path(), "refs/heads/main").unwrap());
        assert!(!packed_conflict(dir.path(), "refs/keel/s/1").unwrap());
    }
}
