//! Where a workspace's repository is, asked of git once per process and workspace.
//!
//! `Git::open` asks `git rev-parse` for the top of the working tree, the git directory and the
//! index; a worker starting many runs in one workspace asked it again for each. The answer is
//! kept for plain repositories (a `.git` directory at the top) with what it depends on: the
//! identity of that `.git` directory, the stamp of its `config` (which may move the working
//! tree, `core.worktree`), and that no directory between the workspace and the top has a
//! `.git` of its own (which would be a nearer repository). Any of these changing makes the next
//! open ask git again.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};

use crate::facts::Stamp;

/// What `rev-parse` said, and what must not have changed for it to hold.
#[derive(Clone)]
pub(crate) struct Opened {
    pub root: PathBuf,
    pub git_dir: PathBuf,
    pub index_file: PathBuf,
    proof: Proof,
}

#[derive(Clone, PartialEq, Eq)]
struct Proof {
    /// Device and inode of `<root>/.git`.
    dot_git: (u64, u64),
    config: Option<Stamp>,
    /// `<dir>/.git` for every directory from the workspace up to, not including, the top: all
    /// absent.
    nearer: Vec<PathBuf>,
}

static KNOWN: Mutex<Option<HashMap<PathBuf, Opened>>> = Mutex::new(None);

fn proof(workdir: &Path, root: &Path, git_dir: &Path) -> Option<Proof> {
    let dot_git = root.join(".git");
    // Only a plain repository: its git directory is the `.git` directory at the top.
    if dot_git != git_dir {
        return None;
    }
    let stamp = Stamp::read(&dot_git).ok()??;
    let nearer: Vec<PathBuf> = workdir
        .ancestors()
        .take_while(|dir| *dir != root)
        .map(|dir| dir.join(".git"))
        .collect();
    if !workdir.starts_with(root) || nearer.iter().any(|p| p.exists()) {
        return None;
    }
    Some(Proof {
        dot_git: (stamp.dev, stamp.ino),
        config: Stamp::read(&git_dir.join("config")).ok()?,
        nearer,
    })
}

/// The kept answer for `workdir` (an absolute, canonical path), if it still holds.
pub(crate) fn lookup(workdir: &Path) -> Option<Opened> {
    let known = KNOWN
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .as_ref()?
        .get(workdir)?
        .clone();
    (proof(workdir, &known.root, &known.git_dir).as_ref() == Some(&known.proof)).then_some(known)
}

/// Keeps git's answer for `workdir` when the repository is a plain one.
pub(crate) fn keep(workdir: &Path, root: PathBuf, git_dir: PathBuf, index_file: PathBuf) {
    let Some(proof) = proof(workdir, &root, &git_dir) else {
        return;
    };
    // A configuration written in the same tick of the clock as it was read could change again
    // unseen by its stamp.
    let settled = crate::facts::clock(&git_dir)
        .is_ok_and(|now| proof.config.is_none_or(|config| !config.racy(now)));
    if !settled {
        return;
    }
    KNOWN
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .get_or_insert_with(HashMap::new)
        .insert(
            workdir.to_path_buf(),
            Opened {
                root,
                git_dir,
                index_file,
                proof,
            },
        );
}
