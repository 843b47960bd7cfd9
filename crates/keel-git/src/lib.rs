//! keel-git: the `git` command-line program wrapped with typed errors.
//!
//! keel needs a few facts and actions from the git repository a run works in: the parts of the
//! environment fingerprint (HEAD, branch, a tree id of the whole working tree), snapshots of the
//! working tree as commits on `refs/keel/<run>/<n>`, the size of a change between two trees, the
//! changed paths, and putting the working tree's files back to a recorded tree.
//!
//! Invariants:
//! - Nothing here touches the user's index, HEAD or branch. Trees of the working tree are built
//!   in a temporary index file (`GIT_INDEX_FILE`) in the git directory, removed afterwards.
//! - The paths given as `exclude` to [`Git::open`] (keel's own files, e.g. `.keel`) never enter a
//!   tree, a diff or a restore.
//! - git runs with a fixed environment (`LC_ALL=C`, no prompts, no pager, no hooks, no commit
//!   signing, no replace refs, no redirection through `GIT_DIR` and friends); paths are read
//!   with `-z`, so spaces, newlines and non-ASCII names are handled.
//! - The user's own conversion rules (`.gitattributes`, `core.autocrlf`, `core.fileMode`) apply
//!   as they do to the user's own `git add` and `git checkout`, so a tree of a clean checkout is
//!   HEAD's tree and a diff against HEAD is what `git diff HEAD` shows.
//! - No libgit2. git's own program builds trees, diffs and restores. Three answers keel gives
//!   itself, each only where it knows the repository well enough and with git's behaviour as
//!   the reference: a snapshot's commit object and loose ref (`object`), the last working-tree
//!   tree while a survey of the working tree's stamps proves nothing changed (`treecache`), and
//!   where a workspace's repository is (`opened`). Anything else is asked of git.
//!
//! Paths are reported as UTF-8 strings; a path that is not valid UTF-8 is reported lossily.

mod command;
mod error;
mod facts;
mod object;
mod opened;
pub mod spawn;
mod treecache;

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use command::Invocation;
pub use error::GitError;

/// How many git processes this process has started so far: what a step costs in processes,
/// for the benchmark.
pub fn processes() -> u64 {
    command::PROCESSES.load(std::sync::atomic::Ordering::Relaxed)
}

/// A git working tree, opened once and then asked for facts and snapshots.
#[derive(Debug, Clone)]
pub struct Git {
    /// Top of the working tree, as git reports it.
    root: PathBuf,
    /// The (per-worktree) git directory: where temporary index files go.
    git_dir: PathBuf,
    /// The user's index file; only ever read, to reuse its file stat data.
    index_file: PathBuf,
    /// Paths relative to `root`, normalised, that keel's own files live in.
    excludes: Vec<String>,
    /// Syncs of the repository's file system asked for by new trees and snapshots (see
    /// `sync_objects`), shared by this value's clones.
    syncs: std::sync::Arc<AtomicU64>,
    /// What [`Git::pin`] knows is kept, shared by this value's clones.
    pins: std::sync::Arc<std::sync::Mutex<Pins>>,
}

/// Objects that git's garbage collection keeps for keel: what each pin ref points at, and the
/// trees of the snapshots this value wrote (their refs keep them).
#[derive(Debug, Default)]
struct Pins {
    refs: std::collections::HashMap<String, String>,
    snapshot_trees: std::collections::HashSet<String>,
}

/// The size of the change between two trees.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Diff {
    /// Number of paths that differ (one per entry of `changes`).
    pub files_changed: u64,
    /// Lines added over all text files; binary files add nothing.
    pub lines_added: u64,
    /// Lines removed over all text files; binary files add nothing.
    pub lines_removed: u64,
    /// Every differing path, in git's order (sorted by path).
    pub changes: Vec<Change>,
}

/// One path that differs between two trees.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Change {
    /// git's status letter: `A` added, `M` modified (content or mode), `D` deleted, `T` type
    /// changed (file, symlink, submodule). Renames are not detected: a rename is `D` plus `A`.
    pub status: char,
    /// Path relative to the top of the working tree, `/`-separated.
    pub path: String,
}

/// What `ls-files -v` said of a temporary index.
#[derive(Default)]
struct Listing {
    flagged: bool,
    excluded: bool,
}

/// File mode of a submodule entry (a commit inside a tree).
const GITLINK_MODE: &str = "160000";

impl Git {
    /// Opens the repository whose working tree contains `workdir`. `exclude` are paths relative
    /// to the working tree root (e.g. ".keel") that keel's own files live in: they never enter
    /// trees, diffs, or restores.
    pub fn open(workdir: &Path, exclude: &[String]) -> Result<Git, GitError> {
        let metadata = fs::metadata(workdir).map_err(|source| GitError::Io {
            action: "open the workspace directory",
            path: workdir.to_path_buf(),
            source,
        })?;
        if !metadata.is_dir() {
            return Err(GitError::InvalidArgument {
                what: "workspace directory",
                value: workdir.display().to_string(),
                reason: "not a directory",
            });
        }
        // A repository opened before in this process, unchanged since: no process. Threads
        // opening one at once (a worker starting many runs) wait for one to ask git.
        let canonical = fs::canonicalize(workdir).ok();
        let known = || {
            let known = canonical.as_deref().and_then(opened::lookup)?;
            let git = Git {
                root: known.root,
                git_dir: known.git_dir,
                index_file: known.index_file,
                excludes: Vec::new(),
                syncs: Default::default(),
                pins: Default::default(),
            };
            remove_orphaned_indexes(&git.git_dir);
            Some(git.with_excludes(exclude))
        };
        static ASKING: std::sync::Mutex<()> = std::sync::Mutex::new(());
        let _asking = match known_or_turn(&ASKING, known) {
            Ok(git) => return git,
            Err(turn) => turn,
        };
        // One git process answers all three: the top of the working tree, the git directory
        // and the index file (relative to the directory git ran in).
        let dirs = Invocation::new(workdir).args([
            "rev-parse",
            "--show-toplevel",
            "--absolute-git-dir",
            "--git-path",
            "index",
        ]);
        let output = dirs.output()?;
        let stderr = String::from_utf8_lossy(&output.stderr);
        if !output.status.success() {
            return Err(if stderr.contains("not a git repository") {
                GitError::NotARepository {
                    path: workdir.to_path_buf(),
                }
            } else if stderr.contains("must be run in a work tree") {
                GitError::NoWorkTree {
                    path: workdir.to_path_buf(),
                }
            } else {
                dirs.failed(&output)
            });
        }
        const EXPECTED: &str = "the top of the working tree, the git directory and the index path";
        let text = dirs.text(output.stdout, EXPECTED)?;
        let lines: Vec<&str> = text.lines().collect();
        let [root, git_dir, index_file] = lines[..] else {
            // Older gits print no top (and succeed) inside the .git directory.
            if lines.len() == 2 {
                return Err(GitError::NoWorkTree {
                    path: workdir.to_path_buf(),
                });
            }
            return Err(dirs.unexpected(EXPECTED, text));
        };
        if root.is_empty() {
            return Err(GitError::NoWorkTree {
                path: workdir.to_path_buf(),
            });
        }
        let git = Git {
            root: PathBuf::from(root),
            git_dir: PathBuf::from(git_dir),
            index_file: workdir.join(index_file),
            excludes: Vec::new(),
            syncs: Default::default(),
            pins: Default::default(),
        };
        if let Some(canonical) = &canonical {
            opened::keep(
                canonical,
                git.root.clone(),
                git.git_dir.clone(),
                git.index_file.clone(),
            );
        }
        remove_orphaned_indexes(&git.git_dir);
        git.with_excludes(exclude)
    }

    /// The same repository with other excluded paths (relative to the working tree root): no
    /// git process is started.
    pub fn with_excludes(&self, exclude: &[String]) -> Result<Git, GitError> {
        let mut excludes = exclude
            .iter()
            .map(|path| normalize_exclude(path))
            .collect::<Result<Vec<_>, _>>()?;
        excludes.sort();
        excludes.dedup();
        Ok(Git {
            excludes,
            ..self.clone()
        })
    }

    /// Top of the working tree.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Commit id HEAD points at, or `None` when the branch is unborn (no commits yet).
    pub fn head(&self) -> Result<Option<String>, GitError> {
        // Read it from the files when they say it plainly: a detached HEAD's id, or the id in
        // the branch's loose ref file (as rev-parse would, without asking whether the commit is
        // present). A packed or unborn branch, a linked worktree (whose branches live in the
        // common directory) or anything unusual is asked of git.
        match read_head_file(&self.git_dir) {
            Some(HeadFile::Detached(id)) => return Ok(Some(id)),
            Some(HeadFile::Branch(target)) => {
                if let Some(id) = read_loose_ref(&self.git_dir, &target) {
                    return Ok(Some(id));
                }
            }
            None => {}
        }
        // rev-parse rather than `resolve`: a HEAD whose commit is missing from the object store
        // is a broken repository, and must fail later rather than pass for an unborn branch.
        let rev_parse = self.git().args(["rev-parse", "-q", "--verify", "HEAD"]);
        let output = rev_parse.output()?;
        match output.status.code() {
            Some(0) => {
                let id = rev_parse.text(output.stdout, "a commit id")?;
                if is_object_id(&id) {
                    Ok(Some(id))
                } else {
                    Err(rev_parse.unexpected("a commit id", id))
                }
            }
            Some(1) => Ok(None),
            _ => Err(rev_parse.failed(&output)),
        }
    }

    /// Short name of the checked-out branch (also when it is unborn), `None` when HEAD is
    /// detached.
    pub fn branch(&self) -> Result<Option<String>, GitError> {
        let Some(target) = self.symbolic_head()? else {
            return Ok(None);
        };
        Ok(Some(match target.strip_prefix("refs/heads/") {
            Some(short) => short.to_string(),
            None => target,
        }))
    }

    /// Tree id of the working tree as it is on disk: tracked and untracked files, not ignored
    /// ones, minus the excluded paths. Built in a temporary index file; the user's index is
    /// only read (to reuse its stat data, so unchanged files are not hashed again).
    pub fn worktree_tree(&self) -> Result<String, GitError> {
        Ok(self.worktree_tree_and_head()?.0)
    }

    /// [`Git::worktree_tree`] and the commit HEAD pointed at when the tree was built on it
    /// (what [`Git::head`] would say), from the same git processes.
    ///
    /// When nothing the last tree was built from has changed since (proven by a survey of the
    /// working tree's stamps, see `treecache`), that tree is the answer and no git process
    /// starts. A tree git builds is synced to the disk before it is returned (see
    /// `sync_objects`).
    pub fn worktree_tree_and_head(&self) -> Result<(String, Option<String>), GitError> {
        let facts = self.tree_facts()?;
        let surveyor = facts.as_deref().map(|facts| treecache::Surveyor {
            root: &self.root,
            git_dir: &self.git_dir,
            excludes: &self.excludes,
            facts,
        });
        let Some(surveyor) = surveyor else {
            return self.build_worktree_tree();
        };
        let head = self.head()?;
        match surveyor.lookup(head.clone()) {
            treecache::Lookup::Hit(tree) => return Ok((tree, head)),
            treecache::Lookup::Miss(None) => return self.build_worktree_tree(),
            treecache::Lookup::Miss(Some(_)) => {}
        }
        // Threads of one process asking at once for the same working tree's tree (a worker
        // starting many runs in one workspace) wait for one of them to build it, and then find
        // it kept, instead of each starting git's five processes.
        let turn = surveyor.building();
        let _building = turn
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let head = self.head()?;
        // Surveyed again: the build waited for may have kept the answer, and what is kept must
        // be surveyed before the build that it goes with.
        let survey = match surveyor.lookup(head.clone()) {
            treecache::Lookup::Hit(tree) => return Ok((tree, head)),
            treecache::Lookup::Miss(survey) => survey,
        };
        let (tree, head) = self.build_worktree_tree()?;
        if let Some(survey) = survey {
            surveyor.keep(survey, &tree, &head);
        }
        Ok((tree, head))
    }

    /// The configuration facts a kept working-tree tree depends on, or `None` when no tree may
    /// be kept: a linked worktree (whose configuration and ignore files are partly in the common
    /// directory), configuration that includes other files, or a git that does not name its
    /// configuration files.
    fn tree_facts(&self) -> Result<Option<std::sync::Arc<facts::Facts>>, GitError> {
        if fs::symlink_metadata(self.git_dir.join("commondir")).is_ok() {
            return Ok(None);
        }
        Ok(facts::facts(&self.root, &self.git_dir)?.filter(|facts| !facts.includes))
    }

    /// The working-tree tree built by git in a temporary index, and the HEAD it was built on.
    fn build_worktree_tree(&self) -> Result<(String, Option<String>), GitError> {
        let index = TempIndex::new(&self.git_dir);
        let (head, excluded_present) = self.read_head_into(&index)?;
        if excluded_present {
            self.remove_excluded(&index)?;
        }
        let mut add = self
            .git()
            .index_file(&index.path)
            .args(["add", "-A", "--", "."]);
        // An exclude pathspec that names an ignored path makes `git add` fail ("paths are
        // ignored"); ignored paths stay out of the tree anyway, so only the others are named.
        for exclude in self.unignored_excludes()? {
            add = add.arg(format!(":(exclude,top,literal){exclude}"));
        }
        add.run()?;
        let tree = self.write_tree(&index)?;
        self.sync_objects("sync the working tree's new objects to the disk in")?;
        Ok((tree, head))
    }

    /// Creates a commit of `tree` (with parent `parent` if given) with `message`, and points
    /// `refname` at it, creating or moving it. The author and committer are always
    /// "keel <keel@localhost>"; no signing, no hooks. Returns the commit id.
    ///
    /// When `parent`'s own tree is `tree` (nothing changed since that commit), no commit is
    /// made: `refname` points at `parent`, which is then the snapshot, and `message` is not
    /// kept (keel's log has it). A checkpoint of a clean working tree writes no object.
    ///
    /// `refname` must be a full ref name under `refs/` and not the checked-out branch: a
    /// snapshot never moves the user's HEAD or branch.
    ///
    /// The tree is then kept by the ref: [`Git::pin`] need not pin it again.
    pub fn snapshot(
        &self,
        tree: &str,
        parent: Option<&str>,
        message: &str,
        refname: &str,
    ) -> Result<String, GitError> {
        let commit = self.write_snapshot(tree, parent, message, refname)?;
        self.pins
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .snapshot_trees
            .insert(tree.to_string());
        Ok(commit)
    }

    fn write_snapshot(
        &self,
        tree: &str,
        parent: Option<&str>,
        message: &str,
        refname: &str,
    ) -> Result<String, GitError> {
        check_rev("tree", tree)?;
        if let Some(parent) = parent {
            check_rev("parent", parent)?;
        }
        if !refname.starts_with("refs/") {
            return Err(GitError::InvalidArgument {
                what: "snapshot ref name",
                value: refname.to_string(),
                reason: "must be a full ref name under refs/, e.g. refs/keel/<run>/<n>",
            });
        }
        if self.symbolic_head()?.as_deref() == Some(refname) {
            return Err(GitError::InvalidArgument {
                what: "snapshot ref name",
                value: refname.to_string(),
                reason: "is the checked-out branch; a snapshot never moves it",
            });
        }

        // keel writes the commit and the ref itself where the repository is the plain kind
        // it knows (see `object`); git does everything else.
        let commit = match self.in_process_snapshot(tree, parent, message)? {
            Some(commit) => commit,
            None => {
                // Whatever git cannot tell here, commit-tree reports in its own words below.
                if let Some(parent) = parent
                    && let Ok(Some(parent_tree)) = self.resolve(&format!("{parent}^{{tree}}"))
                    && parent_tree == tree
                {
                    self.update_ref(refname, parent)?;
                    return Ok(parent.to_string());
                }
                let mut commit_tree = self
                    .git()
                    .args(["commit-tree", tree])
                    .env("GIT_AUTHOR_NAME", "keel")
                    .env("GIT_AUTHOR_EMAIL", "keel@localhost")
                    .env("GIT_COMMITTER_NAME", "keel")
                    .env("GIT_COMMITTER_EMAIL", "keel@localhost")
                    .stdin(message.as_bytes().to_vec());
                if let Some(parent) = parent {
                    commit_tree = commit_tree.args(["-p", parent]);
                }
                let commit = commit_tree.run_line("a commit id")?;
                if !is_object_id(&commit) {
                    return Err(commit_tree.unexpected("a commit id", commit));
                }
                self.update_ref(refname, &commit)?;
                self.sync_objects("sync the snapshot's objects to the disk in")?;
                return Ok(commit);
            }
        };
        if !object::write_ref(&self.git_dir, refname, &commit) {
            self.update_ref(refname, &commit)?;
        }
        if parent != Some(commit.as_str()) {
            self.sync_objects("sync the snapshot's objects to the disk in")?;
        }
        Ok(commit)
    }

    /// Puts the objects keel had git write on the disk: a new working-tree tree's trees and
    /// blobs (`git add` and `write-tree`), a snapshot's commit and its ref. git syncs no loose
    /// object by default, and keel's events name these (a step's starting tree, which rollback
    /// and resume restore; a checkpoint's snapshot): an event synced with the store must never
    /// outlive the objects it names after a power cut. One `syncfs` of the repository's file
    /// system, which also writes out whatever else on it is dirty (a build's output in the
    /// working tree): made only when git built a tree or a snapshot wrote a commit, never for a
    /// tree proven unchanged (see `treecache`) or a snapshot of an unchanged tree.
    /// `action` says which, in the error.
    fn sync_objects(&self, action: &'static str) -> Result<(), GitError> {
        let io = |source| GitError::Io {
            action,
            path: self.git_dir.clone(),
            source,
        };
        let dir = fs::File::open(&self.git_dir).map_err(io)?;
        nix::unistd::syncfs(&dir).map_err(|errno| io(std::io::Error::from(errno)))?;
        self.syncs.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// The syncs new working-tree trees and snapshots have asked for through this value or its
    /// clones (see [`Git::worktree_tree`] and [`Git::snapshot`]).
    pub fn object_syncs(&self) -> u64 {
        self.syncs.load(Ordering::Relaxed)
    }

    /// The snapshot commit of `tree`, written by keel itself; `None` when git must write it:
    /// a repository or object this does not know well enough (see `object`).
    fn in_process_snapshot(
        &self,
        tree: &str,
        parent: Option<&str>,
        message: &str,
    ) -> Result<Option<String>, GitError> {
        if !is_object_id(tree) || !self.plain_files()? {
            return Ok(None);
        }
        // As commit-tree does, name only objects that are there (a tree of a cached answer
        // may have been pruned since; a parent may be in an alternate store only git reads).
        let objects = self.git_dir.join("objects");
        let known = |id: &str| object::present(&objects, id) == Some(true);
        if !known(tree) || parent.is_some_and(|p| !is_object_id(p) || !known(p)) {
            return Ok(None);
        }
        if let Some(parent) = parent
            && object::commit_tree(&objects, parent).as_deref() == Some(tree)
        {
            return Ok(Some(parent.to_string()));
        }
        let secs = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |elapsed| elapsed.as_secs());
        let body = object::commit_body(tree, parent, message, secs);
        object::write_loose(&objects, "commit", &body)
            .map(Some)
            .map_err(|source| GitError::Io {
                action: "write a snapshot commit into",
                path: objects,
                source,
            })
    }

    /// Points keel's ref `refname` (under `refs/keel/`) at the object `id`, a tree most often,
    /// so that git's garbage collection keeps it: a tree a run may have to put the working tree
    /// back to (the one an interrupted step or call started from) is otherwise reachable from
    /// nothing, and `git gc` prunes such objects once they are two weeks old. Nothing is
    /// written when the ref already points there (asked of this value's memory, then of the
    /// ref's file), or when it is the tree of a snapshot this value wrote (its ref keeps it).
    /// The ref is not synced: the object is (see `sync_objects`), and a pin lost
    /// with the power matters only if git also prunes the object before the run resumes.
    pub fn pin(&self, refname: &str, id: &str) -> Result<(), GitError> {
        if !refname.starts_with("refs/keel/") || refname.contains("..") {
            return Err(GitError::InvalidArgument {
                what: "ref name",
                value: refname.to_string(),
                reason: "only keel's own refs (refs/keel/…) are pinned",
            });
        }
        check_rev("object", id)?;
        let mut pins = self
            .pins
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if pins.refs.get(refname).map(String::as_str) == Some(id)
            || pins.snapshot_trees.contains(id)
        {
            return Ok(());
        }
        let plain = is_object_id(id) && self.plain_files()?;
        let on_disk = plain
            && fs::read_to_string(self.git_dir.join(refname)).is_ok_and(|text| text.trim() == id);
        if !on_disk {
            let in_process = plain && object::write_ref(&self.git_dir, refname, id);
            if !in_process {
                self.git()
                    .args(["update-ref", "--no-deref", "-m", "keel: pin"])
                    .dies_with_keel()
                    .args([refname, id])
                    .run()?;
            }
        }
        pins.refs.insert(refname.to_string(), id.to_string());
        Ok(())
    }

    /// Whether keel may write objects and refs itself, as the plain files `object` writes: not
    /// in a linked worktree (its objects and refs are in the common directory), not with
    /// reftable refs (not loose files), and only in a SHA-1 repository without shared
    /// permissions or a reflog for every ref (which git would keep).
    fn plain_files(&self) -> Result<bool, GitError> {
        let plain = |name: &str| fs::symlink_metadata(self.git_dir.join(name)).is_err();
        if !plain("commondir") || !plain("reftable") {
            return Ok(false);
        }
        Ok(facts::facts(&self.root, &self.git_dir)?
            .is_some_and(|f| f.sha1 && !f.log_all_ref_updates && !f.shared_repository))
    }

    /// `git update-ref` of `refname` to `commit`, killed if keel dies.
    fn update_ref(&self, refname: &str, commit: &str) -> Result<(), GitError> {
        // --no-deref: if refname is a symbolic ref, replace it rather than move its target.
        self.git()
            .args(["update-ref", "--no-deref", "-m", "keel: snapshot"])
            .dies_with_keel()
            .args([refname, commit])
            .run()?;
        Ok(())
    }

    /// Removes the lock file of ref `refname` left by a git that died while moving it (a
    /// `<ref>.lock` beside it), so the next update can go ahead. Only for refs the caller alone
    /// writes — keel's own `refs/keel/<run>/…`, written only by the holder of the run's lease —
    /// because a live git's lock would be taken from it too. Returns whether there was one.
    pub fn clear_ref_lock(&self, refname: &str) -> Result<bool, GitError> {
        if !refname.starts_with("refs/keel/") || refname.contains("..") {
            return Err(GitError::InvalidArgument {
                what: "ref name",
                value: refname.to_string(),
                reason: "only keel's own refs (refs/keel/…) may have their lock cleared",
            });
        }
        let lock = self.git_dir.join(format!("{refname}.lock"));
        match fs::remove_file(&lock) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
            Err(source) => Err(GitError::Io {
                action: "remove a stale ref lock",
                path: lock,
                source,
            }),
        }
    }

    /// Full object id `rev` names, or `None` if it names nothing that exists. Any revision
    /// syntax git understands (`HEAD`, `refs/keel/r/1`, `HEAD:path`, an abbreviated id).
    pub fn resolve(&self, rev: &str) -> Result<Option<String>, GitError> {
        if rev.is_empty() || rev.contains(['\n', '\r', '\0']) {
            return Err(GitError::InvalidArgument {
                what: "revision",
                value: rev.to_string(),
                reason: "must be non-empty and on one line",
            });
        }
        // One answer for the one name (`lookup` checks the count).
        match self.lookup(&[rev])?.pop() {
            Some(Lookup::Found(id)) => Ok(Some(id)),
            Some(Lookup::Missing) | None => Ok(None),
            Some(Lookup::Ambiguous) => Err(GitError::InvalidArgument {
                what: "revision",
                value: rev.to_string(),
                reason: "is an ambiguous abbreviated object id",
            }),
        }
    }

    /// Size of the change between two tree-ish (tree or commit ids): files changed, lines added
    /// and removed (binary files count as changed files with 0 lines), and the paths with a
    /// status letter. Excluded paths are left out. The same object id on both sides is an empty
    /// diff without asking git (nor whether the object exists).
    pub fn diff(&self, from: &str, to: &str) -> Result<Diff, GitError> {
        let (entries, lines_added, lines_removed) = self.diff_tree(from, to, true)?;
        Ok(Diff {
            files_changed: entries.len() as u64,
            lines_added,
            lines_removed,
            changes: entries
                .into_iter()
                .map(|entry| Change {
                    status: entry.status,
                    path: entry.path,
                })
                .collect(),
        })
    }

    /// The unified diff (git's patch format, binary files named but not shown) between two
    /// tree-ish, for a person to read: what an approval request shows.
    pub fn diff_text(&self, from: &str, to: &str) -> Result<String, GitError> {
        check_rev("tree", from)?;
        check_rev("tree", to)?;
        if from == to && is_object_id(from) {
            return Ok(String::new());
        }
        let mut diff = self.git().args([
            "diff-tree",
            "-r",
            "-p",
            "--no-commit-id",
            "--no-renames",
            "--no-ext-diff",
            "--no-textconv",
            "--no-color",
            from,
            to,
        ]);
        if !self.excludes.is_empty() {
            diff = diff.args(["--", "."]).args(
                self.excludes
                    .iter()
                    .map(|e| format!(":(exclude,top,literal){e}")),
            );
        }
        let out = diff.run()?;
        Ok(String::from_utf8_lossy(&out).into_owned())
    }

    /// Makes the files of the working tree equal to `tree`: writes every file of the tree that
    /// differs on disk, deletes untracked (non-ignored, non-excluded) files not in it. Ignored
    /// and excluded files stay. Does not move HEAD or the branch and leaves the user's index
    /// content as it was (its stat data goes stale; git refreshes it). Returns the paths it
    /// changed, sorted.
    ///
    /// Submodules (gitlinks) are left as they are.
    pub fn restore_worktree(&self, tree: &str) -> Result<Vec<String>, GitError> {
        self.restore_where(tree, |_| true)
    }

    /// Like [`Git::restore_worktree`], but only for `paths` (workspace-relative): each is made
    /// as it is in `tree` (written, or deleted when `tree` does not have it); every other file is
    /// left alone. Returns the paths it changed.
    pub fn restore_paths(&self, tree: &str, paths: &[String]) -> Result<Vec<String>, GitError> {
        self.restore_where(tree, |p| paths.iter().any(|q| q == p))
    }

    fn restore_where(
        &self,
        tree: &str,
        wanted: impl Fn(&str) -> bool,
    ) -> Result<Vec<String>, GitError> {
        check_rev("tree", tree)?;
        let current = self.worktree_tree()?;

        // The target without excluded paths, in an index that checkout-index can write from.
        let index = TempIndex::new(&self.git_dir);
        if let Err(error) = self
            .git()
            .index_file(&index.path)
            .args(["read-tree", tree])
            .run()
        {
            return Err(self.objects_missing(tree, self.missing_below(tree), error));
        }
        self.remove_excluded(&index)?;
        let target = self.write_tree(&index)?;

        let (entries, _, _) = self.diff_tree(&current, &target, false)?;
        // Every file to be written must be there before anything is deleted: checkout-index
        // stops at the first object it cannot read, and the working tree would be left half
        // put back.
        let needed = entries
            .iter()
            .filter(|entry| entry.writes_a_file() && wanted(&entry.path));
        let missing = self.missing_blobs(needed)?;
        if !missing.is_empty() {
            return Err(GitError::ObjectsMissing {
                tree: tree.to_string(),
                repo: self.root.clone(),
                missing,
            });
        }
        let mut changed = Vec::new();
        let mut to_write = Vec::new();
        // Deletions first, so that a directory that becomes a file (or the reverse) is free.
        for entry in &entries {
            if entry.submodule() || !wanted(&entry.path) {
                continue;
            }
            if entry.status == 'D' {
                if self.delete_file(&entry.path)? {
                    changed.push(entry.path.clone());
                }
            } else {
                to_write.push(entry.path.clone());
            }
        }
        if !to_write.is_empty() {
            let mut paths = Vec::new();
            for path in &to_write {
                paths.extend_from_slice(path.as_bytes());
                paths.push(0);
            }
            self.git()
                .index_file(&index.path)
                .args(["checkout-index", "--force", "-z", "--stdin"])
                .dies_with_keel()
                .stdin(paths)
                .run()?;
            changed.extend(to_write);
        }
        changed.sort();
        Ok(changed)
    }

    /// What putting the working tree back from tree `from` to tree `tree` would need that the
    /// repository lacks: each file's object that is missing, with its path, and each tree the
    /// comparison could not read. Empty when nothing is missing. A repository that lost objects
    /// (deleted by hand, pruned while nothing named them, lost with the disk) is found here,
    /// before anything is changed, rather than halfway through a restore.
    pub fn missing_for_restore(
        &self,
        from: &str,
        tree: &str,
    ) -> Result<Vec<MissingObject>, GitError> {
        match self.diff_tree(from, tree, false) {
            Ok((entries, _, _)) => {
                self.missing_blobs(entries.iter().filter(|entry| entry.writes_a_file()))
            }
            Err(error) => match self.objects_missing(tree, self.missing_below(tree), error) {
                GitError::ObjectsMissing { missing, .. } => Ok(missing),
                error => Err(error),
            },
        }
    }

    /// The entries' objects that the repository does not have (one `cat-file` for all).
    fn missing_blobs<'e>(
        &self,
        entries: impl Iterator<Item = &'e RawEntry>,
    ) -> Result<Vec<MissingObject>, GitError> {
        let entries: Vec<&RawEntry> = entries.collect();
        if entries.is_empty() {
            return Ok(Vec::new());
        }
        for entry in &entries {
            check_rev("object", &entry.new_id)?;
        }
        let ids: Vec<&str> = entries.iter().map(|entry| entry.new_id.as_str()).collect();
        let found = self.lookup(&ids)?;
        Ok(entries
            .iter()
            .zip(found)
            .filter(|(_, found)| *found == Lookup::Missing)
            .map(|(entry, _)| MissingObject {
                path: Some(entry.path.clone()),
                id: entry.new_id.clone(),
            })
            .collect())
    }

    /// Each of `names` (one line each) looked up with one `git cat-file --batch-check`, which
    /// reads them from stdin (no option injection) and checks that each object exists
    /// (`rev-parse --verify` does not for a full hex id).
    fn lookup(&self, names: &[&str]) -> Result<Vec<Lookup>, GitError> {
        let mut input = Vec::new();
        for name in names {
            input.extend_from_slice(name.as_bytes());
            input.push(b'\n');
        }
        let check = self
            .git()
            .args(["cat-file", "--batch-check=%(objectname)"])
            .stdin(input);
        let output = check.run()?;
        let output = String::from_utf8_lossy(&output);
        let lines: Vec<&str> = output.lines().collect();
        if lines.len() != names.len() {
            return Err(check.unexpected("a line for each object", output.into_owned()));
        }
        names
            .iter()
            .zip(lines)
            .map(|(name, line)| {
                if is_object_id(line) {
                    Ok(Lookup::Found(line.to_string()))
                } else if line == format!("{name} missing") {
                    Ok(Lookup::Missing)
                } else if line == format!("{name} ambiguous") {
                    Ok(Lookup::Ambiguous)
                } else {
                    Err(check.unexpected("an object id or \"missing\"", line.to_string()))
                }
            })
            .collect()
    }

    /// Every object below `tree` the repository does not have, as `git rev-list` finds them
    /// (`--missing=print`); paths are not known this way. Asked only once git has failed to
    /// read the tree, to say why.
    fn missing_below(&self, tree: &str) -> Result<Vec<MissingObject>, GitError> {
        check_rev("tree", tree)?;
        let output = self
            .git()
            .args(["rev-list", "--objects", "--missing=print", tree])
            .run()?;
        Ok(String::from_utf8_lossy(&output)
            .lines()
            .filter_map(|line| line.strip_prefix('?'))
            .map(|id| MissingObject {
                path: None,
                id: id.to_string(),
            })
            .collect())
    }

    /// `ObjectsMissing` when `missing` names objects, else git's own `error`.
    fn objects_missing(
        &self,
        tree: &str,
        missing: Result<Vec<MissingObject>, GitError>,
        error: GitError,
    ) -> GitError {
        match missing {
            Ok(missing) if !missing.is_empty() => GitError::ObjectsMissing {
                tree: tree.to_string(),
                repo: self.root.clone(),
                missing,
            },
            _ => error,
        }
    }

    /// `git --version`, trimmed: "git version 2.47.3". Asked once per process: keel runs the
    /// same git binary (found once, see [`spawn::program_path`]) for as long as it lives.
    pub fn version(&self) -> Result<String, GitError> {
        static VERSION: std::sync::OnceLock<String> = std::sync::OnceLock::new();
        if let Some(version) = VERSION.get() {
            return Ok(version.clone());
        }
        let version = self.git().arg("--version").run_line("a version line")?;
        Ok(VERSION.get_or_init(|| version).clone())
    }

    /// Id of the empty tree (for diffs from an unborn HEAD); the object is written, so any git
    /// command can read it.
    pub fn empty_tree(&self) -> Result<String, GitError> {
        let mktree = self.git().arg("mktree").stdin(Vec::new());
        let id = mktree.run_line("a tree id")?;
        if is_object_id(&id) {
            Ok(id)
        } else {
            Err(mktree.unexpected("a tree id", id))
        }
    }

    fn git(&self) -> Invocation<'_> {
        Invocation::new(&self.root)
    }

    /// The ref HEAD points at ("refs/heads/main"), or `None` when HEAD is detached.
    fn symbolic_head(&self) -> Result<Option<String>, GitError> {
        match read_head_file(&self.git_dir) {
            Some(HeadFile::Branch(target)) => return Ok(Some(target)),
            Some(HeadFile::Detached(_)) => return Ok(None),
            None => {}
        }
        let symbolic_ref = self.git().args(["symbolic-ref", "-q", "HEAD"]);
        let output = symbolic_ref.output()?;
        match output.status.code() {
            Some(0) => Ok(Some(symbolic_ref.text(output.stdout, "a ref name")?)),
            Some(1) => Ok(None),
            _ => Err(symbolic_ref.failed(&output)),
        }
    }

    /// Fills `index` with HEAD's tree (nothing when HEAD is unborn). Returns HEAD, and whether
    /// the index may hold an excluded path (when it is not known, it may).
    ///
    /// Fast path: start from a copy of the user's index and merge HEAD into it with
    /// `read-tree -m`, which keeps the stat data of entries whose content matches HEAD, so
    /// `git add` does not hash unchanged files again. That copy would also carry
    /// assume-unchanged and skip-worktree bits, which make `git add` blind to changes on disk;
    /// if any entry has one (or the merge fails), start again from HEAD's tree alone.
    fn read_head_into(&self, index: &TempIndex) -> Result<(Option<String>, bool), GitError> {
        let Some(head) = self.head()? else {
            return Ok((None, false));
        };
        if index.copy_from(&self.index_file)? {
            let merge = self
                .git()
                .index_file(&index.path)
                .args(["read-tree", "-m", head.as_str()])
                .output()?;
            if merge.status.success() {
                let listing = self.listing(index)?;
                if !listing.flagged {
                    return Ok((Some(head), listing.excluded));
                }
            }
            index.remove()?;
        }
        self.git()
            .index_file(&index.path)
            .args(["read-tree", head.as_str()])
            .run()?;
        Ok((Some(head), !self.excludes.is_empty()))
    }

    /// What the entries of `index` say: whether any is marked assume-unchanged or
    /// skip-worktree, and whether any is an excluded path or under one.
    fn listing(&self, index: &TempIndex) -> Result<Listing, GitError> {
        let listing = self
            .git()
            .index_file(&index.path)
            .args(["ls-files", "-v", "-z"])
            .run()?;
        let mut out = Listing::default();
        // Each entry is "<tag> <path>\0": a lowercase tag is assume-unchanged, S skip-worktree.
        for entry in listing.split(|byte| *byte == 0).filter(|e| !e.is_empty()) {
            let tag = entry[0];
            out.flagged |= tag.is_ascii_lowercase() || tag == b'S';
            let path = entry.get(2..).unwrap_or_default();
            out.excluded |= self.excludes.iter().any(|e| {
                let e = e.as_bytes();
                path == e || (path.starts_with(e) && path.get(e.len()) == Some(&b'/'))
            });
        }
        Ok(out)
    }

    /// The excluded paths that .gitignore (or another ignore source) does not already ignore.
    fn unignored_excludes(&self) -> Result<Vec<&String>, GitError> {
        if self.excludes.is_empty() {
            return Ok(Vec::new());
        }
        let mut input = Vec::new();
        for exclude in &self.excludes {
            input.extend_from_slice(exclude.as_bytes());
            input.push(0);
        }
        let check = self
            .git()
            .args(["check-ignore", "--no-index", "-z", "--stdin"])
            .stdin(input);
        let output = check.output()?;
        // Exit 0: some are ignored (listed); 1: none is; anything else is an error.
        let ignored: Vec<&[u8]> = match output.status.code() {
            Some(0) => output.stdout.split(|b| *b == 0).collect(),
            Some(1) => Vec::new(),
            _ => return Err(check.failed(&output)),
        };
        Ok(self
            .excludes
            .iter()
            .filter(|e| !ignored.contains(&e.as_bytes()))
            .collect())
    }

    /// Drops the excluded paths from `index`.
    fn remove_excluded(&self, index: &TempIndex) -> Result<(), GitError> {
        if self.excludes.is_empty() || !index.path.exists() {
            return Ok(());
        }
        self.git()
            .index_file(&index.path)
            .args(["rm", "--cached", "-r", "-f", "-q", "--ignore-unmatch", "--"])
            .args(
                self.excludes
                    .iter()
                    .map(|exclude| format!(":(top,literal){exclude}")),
            )
            .run()?;
        Ok(())
    }

    fn write_tree(&self, index: &TempIndex) -> Result<String, GitError> {
        let write_tree = self.git().index_file(&index.path).arg("write-tree");
        let id = write_tree.run_line("a tree id")?;
        if is_object_id(&id) {
            Ok(id)
        } else {
            Err(write_tree.unexpected("a tree id", id))
        }
    }

    /// Raw diff entries between two tree-ish, and the line counts when `numstat` is set.
    fn diff_tree(
        &self,
        from: &str,
        to: &str,
        numstat: bool,
    ) -> Result<(Vec<RawEntry>, u64, u64), GitError> {
        check_rev("tree", from)?;
        check_rev("tree", to)?;
        if from == to && is_object_id(from) {
            // One object on both sides: nothing changed, and no git process is needed to say
            // so (a run that changed nothing asks this at every checkpoint).
            return Ok((Vec::new(), 0, 0));
        }
        let mut diff_tree = self.git().args([
            "diff-tree",
            "-r",
            "-z",
            "--no-commit-id",
            "--no-renames",
            "--no-ext-diff",
            "--no-textconv",
            "--raw",
        ]);
        if numstat {
            diff_tree = diff_tree.arg("--numstat");
        }
        diff_tree = diff_tree.args([from, to]);
        if !self.excludes.is_empty() {
            diff_tree = diff_tree.args(["--", "."]).args(
                self.excludes
                    .iter()
                    .map(|exclude| format!(":(exclude,top,literal){exclude}")),
            );
        }
        let output = diff_tree.run()?;
        parse_diff_tree(&output).map_err(|detail| {
            diff_tree.unexpected(detail, String::from_utf8_lossy(&output).into_owned())
        })
    }

    /// Deletes the file (or symlink) at `path` and then its parent directories that became
    /// empty. Returns whether something was deleted.
    fn delete_file(&self, path: &str) -> Result<bool, GitError> {
        let full = self.root.join(path);
        // A file "under" a symlinked directory is not in the working tree (git never records
        // one), and deleting through the link would reach outside it.
        if self.has_symlink_parent(path) {
            return Ok(false);
        }
        match fs::symlink_metadata(&full) {
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Ok(false),
            Err(source) => {
                return Err(GitError::Io {
                    action: "inspect",
                    path: full,
                    source,
                });
            }
            // A directory here is not the file the tree recorded (a race with another writer);
            // leave it rather than delete a directory of unknown content.
            Ok(metadata) if metadata.is_dir() => return Ok(false),
            Ok(_) => {}
        }
        fs::remove_file(&full).map_err(|source| GitError::Io {
            action: "delete",
            path: full.clone(),
            source,
        })?;
        let mut dir = full.parent();
        while let Some(current) = dir {
            if current == self.root || fs::remove_dir(current).is_err() {
                break;
            }
            dir = current.parent();
        }
        Ok(true)
    }

    fn has_symlink_parent(&self, path: &str) -> bool {
        let mut prefix = self.root.clone();
        let components: Vec<&str> = path.split('/').collect();
        let Some((_, parents)) = components.split_last() else {
            return false;
        };
        parents.iter().any(|component| {
            prefix.push(component);
            fs::symlink_metadata(&prefix).is_ok_and(|m| m.file_type().is_symlink())
        })
    }
}

/// An object a restore needs that the repository does not have.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MissingObject {
    /// Where in the tree it is; `None` when git could only name the object.
    pub path: Option<String>,
    pub id: String,
}

impl std::fmt::Display for MissingObject {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.path {
            Some(path) => write!(f, "{path} (object {})", self.id),
            None => write!(f, "object {}", self.id),
        }
    }
}

/// `missing` as a short list for a message: the first five, then how many more.
pub fn list_missing(missing: &[MissingObject]) -> String {
    const SHOWN: usize = 5;
    let mut list: Vec<String> = missing
        .iter()
        .take(SHOWN)
        .map(ToString::to_string)
        .collect();
    if missing.len() > SHOWN {
        list.push(format!("and {} more", missing.len() - SHOWN));
    }
    list.join(", ")
}

/// What `git cat-file --batch-check` says of one name.
#[derive(Debug, PartialEq, Eq)]
enum Lookup {
    Found(String),
    Missing,
    Ambiguous,
}

/// One record of `git diff-tree --raw`.
#[derive(Debug)]
struct RawEntry {
    old_mode: String,
    new_mode: String,
    /// The object on the `to` side (all zeros for a deletion).
    new_id: String,
    status: char,
    path: String,
}

impl RawEntry {
    /// A submodule on either side: a restore leaves it as it is.
    fn submodule(&self) -> bool {
        self.old_mode == GITLINK_MODE || self.new_mode == GITLINK_MODE
    }

    /// A restore writes this path's file from `new_id`.
    fn writes_a_file(&self) -> bool {
        self.status != 'D' && !self.submodule()
    }
}

/// Parses `diff-tree -z --raw [--numstat]` output: raw records
/// (`:<mode> <mode> <id> <id> <status>\0<path>\0`) then numstat records
/// (`<added>\t<removed>\t<path>\0`, `-` for binary files).
fn parse_diff_tree(output: &[u8]) -> Result<(Vec<RawEntry>, u64, u64), &'static str> {
    let mut entries = Vec::new();
    let (mut added, mut removed) = (0u64, 0u64);
    let mut fields = output.split(|byte| *byte == 0);
    while let Some(field) = fields.next() {
        if field.is_empty() {
            continue;
        }
        if let Some(header) = field.strip_prefix(b":") {
            let header = String::from_utf8_lossy(header);
            let parts: Vec<&str> = header.split(' ').collect();
            let [old_mode, new_mode, _, new_id, status] = parts.as_slice() else {
                return Err("raw diff records");
            };
            let status = status.chars().next().ok_or("a status letter")?;
            let path = fields.next().ok_or("a path after a raw diff record")?;
            entries.push(RawEntry {
                old_mode: (*old_mode).to_string(),
                new_mode: (*new_mode).to_string(),
                new_id: (*new_id).to_string(),
                status,
                path: String::from_utf8_lossy(path).into_owned(),
            });
        } else {
            let mut parts = field.splitn(3, |byte| *byte == b'\t');
            let (Some(plus), Some(minus), Some(_path)) = (parts.next(), parts.next(), parts.next())
            else {
                return Err("numstat records");
            };
            added += parse_count(plus)?;
            removed += parse_count(minus)?;
        }
    }
    Ok((entries, added, removed))
}

fn parse_count(field: &[u8]) -> Result<u64, &'static str> {
    if field == b"-" {
        return Ok(0); // binary
    }
    std::str::from_utf8(field)
        .ok()
        .and_then(|text| text.parse().ok())
        .ok_or("line counts")
}

/// What a plain `HEAD` file says.
enum HeadFile {
    /// `ref: <target>`, a full ref name under `refs/`.
    Branch(String),
    /// A commit id.
    Detached(String),
}

/// HEAD as its file in `git_dir` (a linked worktree's own) says it, when it says it plainly: a
/// regular file of one line, `ref: refs/…` or a commit id. `None` for anything else — a
/// reftable repository's placeholder (`refs/heads/.invalid`), a HEAD that is a symbolic link
/// to a branch's file (as old gits could write), a form this does not know — which the caller
/// asks git about.
fn read_head_file(git_dir: &Path) -> Option<HeadFile> {
    let text = read_plain_file(&git_dir.join("HEAD"))?;
    let line = text.strip_suffix('\n').unwrap_or(&text);
    if let Some(target) = line.strip_prefix("ref: ") {
        let plain = target.starts_with("refs/")
            && target != "refs/heads/.invalid"
            && !target.contains(|c: char| c.is_whitespace() || c.is_control())
            && !target
                .split('/')
                .any(|part| part.is_empty() || part == "." || part == "..");
        plain.then(|| HeadFile::Branch(target.to_string()))
    } else {
        is_object_id(line).then(|| HeadFile::Detached(line.to_string()))
    }
}

/// The id a loose ref file holds (`<git_dir>/<refname>`, one line), or `None` when there is no
/// such regular file or it holds something else (a symbolic ref, say).
fn read_loose_ref(git_dir: &Path, refname: &str) -> Option<String> {
    let text = read_plain_file(&git_dir.join(refname))?;
    let line = text.strip_suffix('\n').unwrap_or(&text);
    is_object_id(line).then(|| line.to_string())
}

/// The text of a small regular file (not through a symbolic link), or `None`.
fn read_plain_file(path: &Path) -> Option<String> {
    let regular = fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_file());
    regular.then(|| fs::read_to_string(path).ok()).flatten()
}

/// A 40 (SHA-1) or 64 (SHA-256) digit lowercase hex object id.
fn is_object_id(text: &str) -> bool {
    matches!(text.len(), 40 | 64) && text.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// Refuses a revision argument git would read as an option.
fn check_rev(what: &'static str, rev: &str) -> Result<(), GitError> {
    if rev.is_empty() || rev.starts_with('-') || rev.contains('\0') {
        return Err(GitError::InvalidArgument {
            what,
            value: rev.to_string(),
            reason: "must be a non-empty revision not starting with '-'",
        });
    }
    Ok(())
}

/// "./.keel/" → ".keel"; refuses absolute paths, `..`, and the empty path (which would exclude
/// everything).
fn normalize_exclude(path: &str) -> Result<String, GitError> {
    let invalid = |reason| GitError::InvalidArgument {
        what: "exclude path",
        value: path.to_string(),
        reason,
    };
    if path.starts_with('/') {
        return Err(invalid("must be relative to the top of the working tree"));
    }
    let mut parts = Vec::new();
    for part in path.split('/') {
        match part {
            "" | "." => {}
            ".." => return Err(invalid("must not contain `..`")),
            part => parts.push(part),
        }
    }
    if parts.is_empty() {
        return Err(invalid("must name a path inside the working tree"));
    }
    Ok(parts.join("/"))
}

/// Single flight: what `known` gives, or else this thread's turn to ask git (the lock held
/// while it asks), `known` asked again once the turn is had, as another thread may have asked
/// meanwhile. Threads asking at once (a worker starting many runs) start one process.
pub(crate) fn known_or_turn<T>(
    asking: &std::sync::Mutex<()>,
    known: impl Fn() -> Option<T>,
) -> Result<T, std::sync::MutexGuard<'_, ()>> {
    if let Some(answer) = known() {
        return Ok(answer);
    }
    let turn = asking
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    match known() {
        Some(answer) => Ok(answer),
        None => Err(turn),
    }
}

/// Removes the temporary index files (and their locks) and clock probes left by a keel process
/// that is gone: their name carries the pid, and a pid with no process behind it left them.
/// Best effort, once per process and git directory: a worker opening a workspace for each of
/// many runs listed its git directory each time, beside other runs' writes to it.
fn remove_orphaned_indexes(git_dir: &Path) {
    static SWEPT: std::sync::Mutex<Option<std::collections::HashSet<PathBuf>>> =
        std::sync::Mutex::new(None);
    let first = SWEPT
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .get_or_insert_with(Default::default)
        .insert(git_dir.to_path_buf());
    if !first {
        return;
    }
    let Ok(entries) = fs::read_dir(git_dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(rest) = name.to_str().and_then(|n| {
            n.strip_prefix("keel-index-")
                .or(n.strip_prefix("keel-probe-"))
        }) else {
            continue;
        };
        let pid = rest.split('-').next().unwrap_or("");
        let alive = !pid.is_empty() && Path::new("/proc").join(pid).exists();
        if !alive {
            let _ = fs::remove_file(entry.path());
        }
    }
}

/// A temporary index file in the git directory, deleted (with any lock git left) on drop.
struct TempIndex {
    path: PathBuf,
}

impl TempIndex {
    fn new(git_dir: &Path) -> TempIndex {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |elapsed| elapsed.as_nanos());
        let name = format!(
            "keel-index-{}-{}-{}",
            std::process::id(),
            nanos,
            COUNTER.fetch_add(1, Ordering::Relaxed)
        );
        TempIndex {
            path: git_dir.join(name),
        }
    }

    /// Copies `source` here with its modification time (git judges "racily clean" entries
    /// against the index file's mtime). Returns false when `source` does not exist.
    fn copy_from(&self, source: &Path) -> Result<bool, GitError> {
        let io = |action, path: &Path| {
            let path = path.to_path_buf();
            move |source| GitError::Io {
                action,
                path,
                source,
            }
        };
        let modified = match fs::metadata(source) {
            Ok(metadata) => metadata
                .modified()
                .map_err(io("read the mtime of", source))?,
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Ok(false),
            Err(err) => return Err(io("read", source)(err)),
        };
        match fs::copy(source, &self.path) {
            Ok(_) => {}
            // The user's git replaced or removed its index meanwhile: start from HEAD alone.
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Ok(false),
            Err(err) => return Err(io("copy the index to", &self.path)(err)),
        }
        fs::File::options()
            .write(true)
            .open(&self.path)
            .and_then(|file| file.set_modified(modified))
            .map_err(io("set the mtime of", &self.path))?;
        Ok(true)
    }

    fn remove(&self) -> Result<(), GitError> {
        match fs::remove_file(&self.path) {
            Ok(()) => Ok(()),
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(source) => Err(GitError::Io {
                action: "delete the temporary index",
                path: self.path.clone(),
                source,
            }),
        }
    }
}

impl Drop for TempIndex {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.path);
        let mut lock = self.path.clone().into_os_string();
        lock.push(".lock");
        let _ = fs::remove_file(lock);
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn exclude_paths_are_normalised_and_checked() {
        assert_eq!(
            normalize_exclude("./.keel/").ok(),
            Some(".keel".to_string())
        );
        assert_eq!(normalize_exclude("a//b").ok(), Some("a/b".to_string()));
        assert!(normalize_exclude("/abs").is_err());
        assert!(normalize_exclude("../up").is_err());
        assert!(normalize_exclude("./").is_err());
    }

    #[test]
    fn diff_tree_output_is_parsed_with_binary_and_odd_paths() {
        let z = "0".repeat(40);
        let output = format!(
            ":100644 100644 {z} {z} M\0a b\0:000000 100644 {z} {z} A\0bin\0\
             :100644 000000 {z} {z} D\0tab\there\x003\t1\ta b\0-\t-\tbin\x000\t2\ttab\there\0"
        );
        let (entries, added, removed) = parse_diff_tree(output.as_bytes()).unwrap();
        let summary: Vec<(char, &str)> = entries
            .iter()
            .map(|entry| (entry.status, entry.path.as_str()))
            .collect();
        assert_eq!(summary, [('M', "a b"), ('A', "bin"), ('D', "tab\there")]);
        assert_eq!((added, removed), (3, 3));
    }

    #[test]
    fn object_ids_are_recognised() {
        assert!(is_object_id(&"a".repeat(40)));
        assert!(is_object_id(&"0".repeat(64)));
        assert!(!is_object_id("HEAD missing"));
        assert!(!is_object_id(&"A".repeat(40)));
    }
}
