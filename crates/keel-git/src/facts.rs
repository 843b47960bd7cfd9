//! What git's configuration says, asked once per repository and process and asked again only
//! when a configuration file changes.
//!
//! One `git var -l` names the system and global configuration files and the attribute files
//! git reads, and lists the configuration in effect. From it keel learns which files decide how
//! a working tree becomes a tree (configuration, ignore and attribute files outside the tree),
//! and the settings the in-process snapshot must respect. The answer is kept with the identity
//! of every configuration file it came from ([`Stamp`]); any change to one of them, or a file
//! appearing where there was none, makes the next call ask git again.

use std::collections::HashMap;
use std::fs;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

use crate::GitError;
use crate::command::Invocation;

/// A file's identity and the times of its last change, as `lstat` reports them: equal stamps
/// mean an unchanged file (ctime moves with every change of content, mode or name, and cannot
/// be set by a program), `None` a missing one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Stamp {
    pub dev: u64,
    pub ino: u64,
    pub mode: u32,
    pub size: u64,
    pub mtime_ns: i128,
    pub ctime_ns: i128,
}

impl Stamp {
    pub(crate) fn of(metadata: &fs::Metadata) -> Stamp {
        Stamp {
            dev: metadata.dev(),
            ino: metadata.ino(),
            mode: metadata.mode(),
            size: metadata.size(),
            mtime_ns: i128::from(metadata.mtime()) * 1_000_000_000
                + i128::from(metadata.mtime_nsec()),
            ctime_ns: i128::from(metadata.ctime()) * 1_000_000_000
                + i128::from(metadata.ctime_nsec()),
        }
    }

    /// The stamp of `path` (not followed if it is a symbolic link); `None` when there is none.
    pub(crate) fn read(path: &Path) -> Result<Option<Stamp>, std::io::Error> {
        match fs::symlink_metadata(path) {
            Ok(metadata) => Ok(Some(Stamp::of(&metadata))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) if e.kind() == std::io::ErrorKind::NotADirectory => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Whether the file may have changed in the same tick of the file system's clock as `now`
    /// (or later): such a stamp does not prove the file unchanged since, as git's "racily
    /// clean" entries do not.
    pub(crate) fn racy(&self, now_ns: i128) -> bool {
        self.mtime_ns >= now_ns || self.ctime_ns >= now_ns
    }
}

/// The file system's clock now, read from a probe file of this process in `dir`: one byte
/// written to it moves its modification time to now (or leaves it in the same tick), so a
/// change made after this has a later stamp, or one in the same tick. The file is created once
/// per process and directory and kept open (creating one per reading made threads queue on the
/// directory); `Git::open` removes the probes of processes that are gone.
pub(crate) fn clock(dir: &Path) -> Result<i128, std::io::Error> {
    static PROBES: Mutex<Option<HashMap<PathBuf, Arc<fs::File>>>> = Mutex::new(None);
    let known = PROBES
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .get_or_insert_with(HashMap::new)
        .get(dir)
        .cloned();
    let probe = match known {
        Some(probe) => probe,
        None => {
            let path = dir.join(format!("keel-probe-{}", std::process::id()));
            let probe = Arc::new(
                fs::File::options()
                    .create(true)
                    .truncate(false)
                    .write(true)
                    .open(path)?,
            );
            PROBES
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .get_or_insert_with(HashMap::new)
                .insert(dir.to_path_buf(), probe.clone());
            probe
        }
    };
    probe.write_all_at(b"x", 0)?;
    let stamp = Stamp::of(&probe.metadata()?);
    Ok(stamp.mtime_ns.min(stamp.ctime_ns))
}

/// The stamps of `paths`, in order.
pub(crate) fn stamps(paths: &[PathBuf]) -> Option<Vec<Option<Stamp>>> {
    paths.iter().map(|p| Stamp::read(p).ok()).collect()
}

/// What git's configuration says for one repository.
#[derive(Debug)]
pub(crate) struct Facts {
    /// Files outside the working tree that decide what `git add` makes of it: configuration,
    /// the global and repository ignore and attribute files (each may be absent).
    pub watched: Vec<PathBuf>,
    /// The configuration includes other files (`include.path`, `includeIf`): which files
    /// decide it is not known, so nothing is assumed unchanged.
    pub includes: bool,
    /// `core.logAllRefUpdates=always`: every ref update keeps a reflog, which git writes.
    pub log_all_ref_updates: bool,
    /// `core.sharedRepository` is set: new files get a group's permissions, which git sets.
    pub shared_repository: bool,
    /// Objects are named by SHA-1 (`extensions.objectFormat` is unset or `sha1`).
    pub sha1: bool,
    /// The configuration files the answer came from, and their stamps then.
    sources: Vec<PathBuf>,
    source_stamps: Vec<Option<Stamp>>,
}

/// The facts of the repository whose git directory is `git_dir`, from the last answer while
/// no configuration file has changed since, else from a new `git var -l` run in `root`.
/// `None` when git's answer lacks what this needs (a git older than 2.42 does not name its
/// configuration files).
pub(crate) fn facts(root: &Path, git_dir: &Path) -> Result<Option<Arc<Facts>>, GitError> {
    static KNOWN: Mutex<Option<HashMap<PathBuf, Arc<Facts>>>> = Mutex::new(None);
    // Held while git is asked: threads asking at once (a worker starting many runs) wait for
    // one answer instead of each starting a process.
    static ASKING: Mutex<()> = Mutex::new(());
    let known = || {
        KNOWN
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get_or_insert_with(HashMap::new)
            .get(git_dir)
            .filter(|known| stamps(&known.sources).as_ref() == Some(&known.source_stamps))
            .cloned()
    };
    let _asking = match crate::known_or_turn(&ASKING, known) {
        Ok(known) => return Ok(Some(known)),
        Err(turn) => turn,
    };
    // The stamps are taken before git reads the files: a change while it runs shows next time.
    let Ok(now) = clock(git_dir) else {
        return Ok(None);
    };
    let mut sources = vec![git_dir.join("config"), git_dir.join("config.worktree")];
    let before = stamps(&sources);
    let listing = Invocation::new(root).args(["var", "-l"]).run()?;
    let Some(mut facts) = parse(&String::from_utf8_lossy(&listing), root, git_dir) else {
        return Ok(None);
    };
    let Some(mut source_stamps) = before else {
        return Ok(None);
    };
    let Some(more) = stamps(&facts.sources) else {
        return Ok(None);
    };
    sources.append(&mut facts.sources);
    source_stamps.extend(more);
    facts.sources = sources;
    facts.source_stamps = source_stamps;
    let facts = Arc::new(facts);
    // A file changed in the same tick of the clock as git was asked may have changed again
    // unseen by its stamp: such an answer is used once, not kept.
    if facts
        .source_stamps
        .iter()
        .flatten()
        .any(|stamp| stamp.racy(now))
    {
        return Ok(Some(facts));
    }
    KNOWN
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .get_or_insert_with(HashMap::new)
        .insert(git_dir.to_path_buf(), facts.clone());
    Ok(Some(facts))
}

/// Reads `git var -l`: `GIT_CONFIG_SYSTEM=`, `GIT_CONFIG_GLOBAL=` (one line per file),
/// `GIT_ATTR_SYSTEM=`, `GIT_ATTR_GLOBAL=`, then the configuration as `key=value` lines with
/// lower-case section and key names.
fn parse(listing: &str, root: &Path, git_dir: &Path) -> Option<Facts> {
    let home = std::env::var_os("HOME").map(PathBuf::from);
    let mut sources = Vec::new();
    let mut watched = vec![
        git_dir.join("config"),
        git_dir.join("config.worktree"),
        git_dir.join("info").join("exclude"),
        git_dir.join("info").join("attributes"),
    ];
    let mut named_config = false;
    let mut excludes_file = None;
    let mut attributes_file = None;
    let mut facts = Facts {
        watched: Vec::new(),
        includes: false,
        log_all_ref_updates: false,
        shared_repository: false,
        sha1: true,
        sources: Vec::new(),
        source_stamps: Vec::new(),
    };
    for line in listing.lines() {
        let Some((key, value)) = line.split_once('=') else {
            continue;
        };
        match key {
            "GIT_CONFIG_SYSTEM" | "GIT_CONFIG_GLOBAL" => {
                named_config = true;
                sources.push(PathBuf::from(value));
            }
            "GIT_ATTR_SYSTEM" | "GIT_ATTR_GLOBAL" => watched.push(PathBuf::from(value)),
            "core.excludesfile" => excludes_file = Some(value.to_string()),
            "core.attributesfile" => attributes_file = Some(value.to_string()),
            "core.logallrefupdates" => {
                facts.log_all_ref_updates = value.eq_ignore_ascii_case("always");
            }
            "core.sharedrepository" => {
                facts.shared_repository =
                    !matches!(value.to_ascii_lowercase().as_str(), "umask" | "false" | "0");
            }
            "extensions.objectformat" => facts.sha1 = value.eq_ignore_ascii_case("sha1"),
            _ if key.starts_with("include.") || key.starts_with("includeif.") => {
                facts.includes = true;
            }
            _ => {}
        }
    }
    if !named_config {
        return None;
    }
    // The global ignore file: core.excludesFile, else $XDG_CONFIG_HOME/git/ignore, else
    // ~/.config/git/ignore.
    let excludes = match excludes_file {
        Some(value) => expand(&value, root, home.as_deref()),
        None => match std::env::var_os("XDG_CONFIG_HOME").filter(|x| !x.is_empty()) {
            Some(xdg) => Some(PathBuf::from(xdg).join("git").join("ignore")),
            None => home
                .as_ref()
                .map(|h| h.join(".config").join("git").join("ignore")),
        },
    };
    match excludes {
        Some(path) => watched.push(path),
        None => facts.includes = true,
    }
    if let Some(value) = attributes_file {
        match expand(&value, root, home.as_deref()) {
            Some(path) => watched.push(path),
            None => facts.includes = true,
        }
    }
    watched.extend(sources.iter().cloned());
    facts.watched = watched;
    facts.sources = sources;
    Some(facts)
}

/// A path setting as git reads it: `~/` is the home directory, a relative path is relative to
/// the directory git runs in. `None` for a form this does not follow (`~user/`, `%(prefix)/`).
fn expand(value: &str, root: &Path, home: Option<&Path>) -> Option<PathBuf> {
    if let Some(rest) = value.strip_prefix("~/") {
        return Some(home?.join(rest));
    }
    if value.starts_with('~') || value.starts_with("%(") {
        return None;
    }
    Some(root.join(value))
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn the_listing_names_the_files_and_settings_that_matter() {
        let listing = "GIT_COMMITTER_IDENT=a <b> 1 +0000\n\
            GIT_ATTR_SYSTEM=/etc/gitattributes\n\
            GIT_ATTR_GLOBAL=/home/u/.config/git/attributes\n\
            GIT_CONFIG_SYSTEM=/etc/gitconfig\n\
            GIT_CONFIG_GLOBAL=/home/u/.config/git/config\n\
            GIT_CONFIG_GLOBAL=/home/u/.gitconfig\n\
            core.excludesfile=ignores\n\
            core.logallrefupdates=always\n\
            core.sharedrepository=umask\n\
            user.name=x=y\n";
        let facts = parse(listing, Path::new("/r"), Path::new("/r/.git")).unwrap();
        assert!(facts.watched.contains(&PathBuf::from("/r/ignores")));
        assert!(
            facts
                .watched
                .contains(&PathBuf::from("/r/.git/info/exclude"))
        );
        assert!(facts.watched.contains(&PathBuf::from("/home/u/.gitconfig")));
        assert!(facts.watched.contains(&PathBuf::from("/etc/gitattributes")));
        assert_eq!(facts.sources.len(), 3);
        assert!(facts.log_all_ref_updates);
        assert!(!facts.shared_repository && !facts.includes && facts.sha1);
    }

    #[test]
    fn includes_and_unknown_path_forms_are_noticed_and_an_old_git_is_refused() {
        let base = "GIT_CONFIG_SYSTEM=/etc/gitconfig\n";
        let with = |extra: &str| parse(&format!("{base}{extra}"), Path::new("/r"), Path::new("/g"));
        assert!(with("include.path=other\n").unwrap().includes);
        assert!(with("includeif.gitdir:/x/.path=y\n").unwrap().includes);
        assert!(with("core.excludesfile=~bob/ignore\n").unwrap().includes);
        assert!(!with("core.bare=false\n").unwrap().includes);
        assert!(!with("extensions.objectformat=sha256\n").unwrap().sha1);
        assert!(
            with("core.sharedrepository=group\n")
                .unwrap()
                .shared_repository
        );
        assert!(parse("core.bare=false\n", Path::new("/r"), Path::new("/g")).is_none());
    }
}
