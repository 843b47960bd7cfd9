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

/// The tree of the commit `id` in `objects`, read from its loose object or from a pack where it
/// is stored whole: `None` when it is not a commit, is stored as a delta, or is anywhere this
/// does not read (an alternate store, a pack index of another version).
pub(crate) fn commit_tree(objects: &Path, id: &str) -> Option<String> {
    if id.len() != 40 {
        return None;
    }
    let head = match fs::File::open(objects.join(&id[..2]).join(&id[2..])) {
        // A loose object is `commit <length>\0<body>`, zlib-compressed.
        Ok(file) => {
            let mut text = inflated_start(file, 7 + 20 + 1 + 46)?;
            let nul = text.iter().position(|b| *b == 0)?;
            if !text.starts_with(b"commit ") {
                return None;
            }
            text.drain(..=nul);
            text
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => packed_commit_start(objects, id)?,
        Err(_) => return None,
    };
    // A commit's body starts `tree <40 hex>\n`.
    let line = head.strip_prefix(b"tree ")?.get(..41)?;
    let (tree, newline) = line.split_at(40);
    let tree = std::str::from_utf8(tree).ok()?;
    (newline == b"\n" && unhex(tree).is_some()).then(|| tree.to_string())
}

/// The first `len` bytes (or fewer, if the stream is shorter) of the zlib stream `reader` is at.
fn inflated_start(reader: impl Read, len: usize) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(len);
    flate2::read::ZlibDecoder::new(reader)
        .take(len as u64)
        .read_to_end(&mut out)
        .ok()?;
    Some(out)
}

/// The start of the body of commit `id` from a pack that stores it whole (type 1, not a delta).
fn packed_commit_start(objects: &Path, id: &str) -> Option<Vec<u8>> {
    let wanted = unhex(id)?;
    for entry in fs::read_dir(objects.join("pack")).ok()? {
        let path = entry.ok()?.path();
        if path.extension().is_none_or(|ext| ext != "idx") {
            continue;
        }
        let Some(offset) = pack_offset(&path, &wanted) else {
            continue;
        };
        let mut pack = io::BufReader::new(fs::File::open(path.with_extension("pack")).ok()?);
        pack.seek(SeekFrom::Start(offset)).ok()?;
        // The entry's header: type in bits 4-6 of the first byte, then the size, 7 bits a byte
        // while the top bit is set.
        let mut byte = [0u8; 1];
        pack.read_exact(&mut byte).ok()?;
        if (byte[0] >> 4) & 7 != 1 {
            return None;
        }
        while byte[0] & 0x80 != 0 {
            pack.read_exact(&mut byte).ok()?;
        }
        return inflated_start(pack, 46);
    }
    None
}

/// The offset in its pack of the object `wanted` listed in the version-2 pack index `path`.
fn pack_offset(path: &Path, wanted: &[u8; 20]) -> Option<u64> {
    let file = fs::File::open(path).ok()?;
    let position = index_position(&file, wanted)??;
    let word = |at: u64| -> Option<u32> {
        let mut word = [0u8; 4];
        file.read_exact_at(&mut word, at).ok()?;
        Some(u32::from_be_bytes(word))
    };
    // After the header and fan-out: the names (20 bytes each), their CRCs (4), their offsets
    // (4; with the top bit set, an index into the table of 8-byte offsets that follows).
    let count = u64::from(word(8 + 4 * 255)?);
    let offsets = 8 + 4 * 256 + 24 * count;
    let offset = word(offsets + 4 * position)?;
    if offset & 0x8000_0000 == 0 {
        return Some(u64::from(offset));
    }
    let mut large = [0u8; 8];
    let at = offsets + 4 * count + 8 * u64::from(offset & 0x7fff_ffff);
    file.read_exact_at(&mut large, at).ok()?;
    Some(u64::from_be_bytes(large))
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

/// Whether the version-2 pack index `path` lists `wanted`; `None` for any other version or a
/// short file.
fn in_pack_index(path: &Path, wanted: &[u8; 20]) -> Option<bool> {
    let file = fs::File::open(path).ok()?;
    Some(index_position(&file, wanted)?.is_some())
}

/// The position of `wanted` among the sorted names of the version-2 pack index `file`
/// (`\377tOc`, version 2, a fan-out table of 256 counts, then the sorted object names), reading
/// only the fan-out and the names a binary search visits: `Some(None)` when it is not there,
/// `None` for another version or a file that cannot be read.
fn index_position(file: &fs::File, wanted: &[u8; 20]) -> Option<Option<u64>> {
    let mut header = [0u8; 8];
    file.read_exact_at(&mut header, 0).ok()?;
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
        file.read_exact_at(&mut name, names + 20 * middle).ok()?;
        match name.cmp(wanted) {
            std::cmp::Ordering::Equal => return Some(Some(middle)),
            std::cmp::Ordering::Less => low = middle + 1,
            std::cmp::Ordering::Greater => high = middle,
        }
    }
    Some(None)
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

    #[test]
    fn a_commits_tree_is_read_from_its_loose_object_and_from_a_pack() {
        let dir = tempfile::tempdir().unwrap();
        let git = |args: &[&str]| {
            let out = std::process::Command::new("git")
                .args([
                    "-c",
                    "user.name=t",
                    "-c",
                    "user.email=t@t",
                    "-c",
                    "gc.auto=0",
                ])
                .args(args)
                .current_dir(dir.path())
                .output()
                .unwrap();
            assert!(out.status.success(), "{out:?}");
            String::from_utf8(out.stdout).unwrap().trim().to_string()
        };
        git(&["init", "-q"]);
        let mut commits = Vec::new();
        for n in 0..20 {
            fs::write(dir.path().join(format!("f{}", n % 3)), format!("{n}\n")).unwrap();
            git(&["add", "-A"]);
            git(&["commit", "-q", "-m", &format!("commit {n}")]);
            let id = git(&["rev-parse", "HEAD"]);
            commits.push((id.clone(), git(&["rev-parse", &format!("{id}^{{tree}}")])));
        }
        let objects = dir.path().join(".git/objects");
        let (head, head_tree) = commits.last().cloned().unwrap();
        for packed in [false, true] {
            if packed {
                git(&["gc", "-q", "--prune=now"]);
                assert!(!objects.join(&head[..2]).join(&head[2..]).exists());
            }
            for (commit, tree) in &commits {
                // A commit a pack stores as a delta is not read (None), never misread.
                let read = commit_tree(&objects, commit);
                assert!(
                    read.is_none() || read.as_ref() == Some(tree),
                    "{commit}: {read:?}"
                );
            }
            assert_eq!(commit_tree(&objects, &head), Some(head_tree.clone()));
            assert_eq!(
                commit_tree(&objects, &head_tree),
                None,
                "a tree is not a commit"
            );
            assert_eq!(commit_tree(&objects, &"0".repeat(40)), None);
        }
    }
}
