//! The last working-tree tree git built, kept with proof that nothing it was built from has
//! changed since.
//!
//! Building the tree of a working tree takes five git processes, and keel asks for it at every
//! run start, around every step that may change files and at each verification; most of the
//! time nothing has changed. So when git builds a tree, keel first takes a [`Survey`] of
//! everything the answer depends on, and keeps it with the answer:
//!
//! - every directory and entry of the working tree (but `.git` and the excluded paths), with
//!   its [`Stamp`] — identity, mode, size, modification and change time (a directory's times
//!   move when an entry is added, removed or renamed in it; a file's ctime moves with any change
//!   to it and cannot be set back by a program);
//! - the files outside the tree that decide what `git add` makes of it (configuration, ignore
//!   and attribute files; see `facts`), present or not;
//! - the commit HEAD is on (the tree keeps the ignored files HEAD tracks).
//!
//! The next request surveys again; if the survey is the same, the tree is the same, and no git
//! process starts. The proof has the same limits as git's own index, and the same answer to
//! them: a stamp taken in the same tick of the file system's clock as the survey began (or
//! later) could hide a change made just after it ("racily clean"), so a survey holding one is
//! not kept. The survey is taken before git builds the tree: a change while git runs shows as a
//! different survey next time.
//!
//! Nothing is kept — git is asked every time — when the proof cannot be had: a working tree
//! with a repository inside it (a submodule or nested repository, whose HEAD is part of the
//! tree), more than [`MAX_ENTRIES`] entries (surveying would cost more than it saves; ignored
//! build directories count, as the survey does not read ignore rules), configuration that
//! includes other files, a linked worktree, or a git that does not name its configuration files.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

use crate::facts::{Facts, Stamp, stamps};

/// More entries than this and the tree is not kept: surveying them would cost about what git's
/// processes cost.
pub(crate) const MAX_ENTRIES: usize = 20_000;

/// What one tree was built from.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Survey {
    head: Option<String>,
    watched: Vec<Option<Stamp>>,
    /// Every entry of the working tree (relative path, stamp) in a fixed order; the root's own
    /// stamp first, under the empty path.
    entries: Vec<(Box<[u8]>, Stamp)>,
}

/// Why a survey cannot prove anything.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Unprovable {
    /// Too many entries: not worth trying again in this process.
    TooLarge,
    /// Something this does not follow (a nested repository), or a file system error; asked
    /// again next time.
    Not,
}

/// A kept answer: the survey and the tree git built after it.
struct Kept {
    survey: Survey,
    tree: String,
}

/// The key of a kept answer: the git directory and the excluded paths.
type Key = (PathBuf, Vec<String>);

enum Slot {
    Kept(Arc<Kept>),
    TooLarge,
}

static KEPT: Mutex<Option<HashMap<Key, Slot>>> = Mutex::new(None);

fn with_kept<T>(f: impl FnOnce(&mut HashMap<Key, Slot>) -> T) -> T {
    f(KEPT
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .get_or_insert_with(HashMap::new))
}

/// The most working trees one process keeps an answer for: a worker that serves many
/// workspaces over days keeps the recent ones (a survey can hold 20,000 entries).
const MAX_KEPT: usize = 32;

/// Keeps `slot` for `key`, first forgetting some other working tree when `MAX_KEPT` are kept.
fn keep_slot(key: Key, slot: Slot) {
    with_kept(|kept| {
        if kept.len() >= MAX_KEPT && !kept.contains_key(&key) {
            // Any one: the one asked for next is built again by git, as it was before.
            if let Some(other) = kept.keys().next().cloned() {
                kept.remove(&other);
            }
        }
        kept.insert(key, slot);
    });
}

/// How the survey is taken.
pub(crate) struct Surveyor<'a> {
    pub root: &'a Path,
    pub git_dir: &'a Path,
    pub excludes: &'a [String],
    pub facts: &'a Facts,
}

/// The outcome of a survey: the tree when it is proven unchanged, or the survey to keep with
/// the tree git is about to build.
pub(crate) enum Lookup {
    Hit(String),
    Miss(Option<Survey>),
}

/// One lock per kept answer's key: held while git builds the tree, so that threads asking at
/// once wait for one build.
static BUILDING: Mutex<Option<HashMap<Key, Arc<Mutex<()>>>>> = Mutex::new(None);

impl Surveyor<'_> {
    fn key(&self) -> Key {
        (self.git_dir.to_path_buf(), self.excludes.to_vec())
    }

    /// The lock that one build of this working tree's tree holds at a time.
    pub(crate) fn building(&self) -> Arc<Mutex<()>> {
        let mut all = BUILDING.lock().unwrap_or_else(PoisonError::into_inner);
        let all = all.get_or_insert_with(HashMap::new);
        // Keys of working trees no one builds any more go, as kept answers do.
        if all.len() >= MAX_KEPT {
            all.retain(|_, lock| Arc::strong_count(lock) > 1);
        }
        all.entry(self.key()).or_default().clone()
    }

    /// Surveys the working tree and answers from the kept tree when nothing has changed.
    /// `head` is the commit HEAD is on now.
    pub(crate) fn lookup(&self, head: Option<String>) -> Lookup {
        let key = self.key();
        let kept = match with_kept(|kept| match kept.get(&key) {
            Some(Slot::TooLarge) => None,
            Some(Slot::Kept(k)) => Some(Some(k.clone())),
            None => Some(None),
        }) {
            None => return Lookup::Miss(None),
            Some(kept) => kept,
        };
        let survey = match self.survey(head) {
            Ok(survey) => survey,
            Err(Unprovable::TooLarge) => {
                keep_slot(key, Slot::TooLarge);
                return Lookup::Miss(None);
            }
            Err(Unprovable::Not) => return Lookup::Miss(None),
        };
        if let Some(kept) = kept
            && kept.survey == survey
            // A tree nothing refers to may have been pruned since (after two weeks, by default).
            && crate::object::present(&self.git_dir.join("objects"), &kept.tree) == Some(true)
        {
            return Lookup::Hit(kept.tree.clone());
        }
        Lookup::Miss(Some(survey))
    }

    /// Keeps `tree`, which git built after `survey` was taken, if HEAD is where the survey saw
    /// it.
    pub(crate) fn keep(&self, survey: Survey, tree: &str, head: &Option<String>) {
        if survey.head != *head {
            return;
        }
        let kept = Arc::new(Kept {
            survey,
            tree: tree.to_string(),
        });
        keep_slot(self.key(), Slot::Kept(kept));
    }

    /// The survey of now; an error when it cannot prove anything.
    fn survey(&self, head: Option<String>) -> Result<Survey, Unprovable> {
        let now = crate::facts::clock(self.git_dir).map_err(|_| Unprovable::Not)?;
        let watched = stamps(&self.facts.watched).ok_or(Unprovable::Not)?;
        let mut entries = Vec::new();
        let root = fs::symlink_metadata(self.root).map_err(|_| Unprovable::Not)?;
        entries.push((Box::<[u8]>::default(), Stamp::of(&root)));
        self.walk(self.root, &[], &mut entries)?;
        let racy = entries
            .iter()
            .map(|(_, stamp)| stamp)
            .chain(watched.iter().flatten())
            .any(|stamp| stamp.racy(now));
        if racy {
            return Err(Unprovable::Not);
        }
        Ok(Survey {
            head,
            watched,
            entries,
        })
    }

    fn walk(
        &self,
        dir: &Path,
        relative: &[u8],
        entries: &mut Vec<(Box<[u8]>, Stamp)>,
    ) -> Result<(), Unprovable> {
        let mut names: Vec<_> = fs::read_dir(dir)
            .map_err(|_| Unprovable::Not)?
            .map(|entry| entry.map(|e| e.file_name()))
            .collect::<Result<_, _>>()
            .map_err(|_| Unprovable::Not)?;
        names.sort();
        if !relative.is_empty() && names.iter().any(|name| name == OsStr::new(".git")) {
            // A repository inside the working tree: the tree records its HEAD.
            return Err(Unprovable::Not);
        }
        for name in names {
            if relative.is_empty() && name == OsStr::new(".git") {
                continue;
            }
            let mut path = relative.to_vec();
            if !path.is_empty() {
                path.push(b'/');
            }
            path.extend_from_slice(name.as_bytes());
            if self.excluded(&path) {
                continue;
            }
            if entries.len() >= MAX_ENTRIES {
                return Err(Unprovable::TooLarge);
            }
            let full = dir.join(&name);
            let metadata = fs::symlink_metadata(&full).map_err(|_| Unprovable::Not)?;
            entries.push((path.clone().into_boxed_slice(), Stamp::of(&metadata)));
            if metadata.is_dir() {
                self.walk(&full, &path, entries)?;
            }
        }
        Ok(())
    }

    fn excluded(&self, path: &[u8]) -> bool {
        self.excludes.iter().any(|e| {
            let e = e.as_bytes();
            path == e || (path.starts_with(e) && path.get(e.len()) == Some(&b'/'))
        })
    }
}
