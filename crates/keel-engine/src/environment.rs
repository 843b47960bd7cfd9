//! Collecting the environment fingerprint of a workspace.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use keel_core::contract::Contract;
use keel_core::fingerprint::Fingerprint;
use keel_git::Git;

use crate::EngineError;

/// How long a contract's `fingerprint` command may take.
const FINGERPRINT_TIMEOUT: Duration = Duration::from_secs(60);
/// Command output up to this size is kept as it is (a person reads it in a drift report);
/// longer output is kept as its hash.
const INLINE_OUTPUT: usize = 120;

pub struct Environment {
    pub git: Git,
    pub workspace: PathBuf,
    pub tmp: PathBuf,
    /// How the run's commands are confined (off until the contract is known).
    pub confinement: crate::process::Confinement,
    git_version: Option<String>,
}

impl Environment {
    pub fn new(git: Git, workspace: PathBuf, tmp: PathBuf) -> Environment {
        Environment {
            git,
            confinement: crate::process::Confinement::off(&workspace),
            workspace,
            tmp,
            git_version: None,
        }
    }

    pub fn fingerprint(&mut self, contract: &Contract) -> Result<Fingerprint, EngineError> {
        // HEAD as the tree was built on it: one git process fewer than asking again.
        let (tree, head) = self.git.worktree_tree_and_head()?;
        self.fingerprint_of(contract, tree, head)
    }

    /// [`Environment::fingerprint`] with the working tree's id the caller has just computed
    /// (building it is the most expensive part; a step that needs it anyway passes it on).
    pub fn fingerprint_with_tree(
        &mut self,
        contract: &Contract,
        tree: String,
    ) -> Result<Fingerprint, EngineError> {
        let head = self.git.head()?;
        self.fingerprint_of(contract, tree, head)
    }

    fn fingerprint_of(
        &mut self,
        contract: &Contract,
        tree: String,
        head: Option<String>,
    ) -> Result<Fingerprint, EngineError> {
        let git_version = match &self.git_version {
            Some(v) => v.clone(),
            None => {
                let v = self.git.version()?;
                self.git_version = Some(v.clone());
                v
            }
        };
        let mut lockfiles = BTreeMap::new();
        for name in &contract.workspace.lockfiles {
            let path = self.workspace.join(name);
            match std::fs::read(&path) {
                Ok(bytes) => {
                    lockfiles.insert(name.clone(), blake3::hash(&bytes).to_hex().to_string());
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(EngineError::io(&path, e)),
            }
        }
        let mut commands = BTreeMap::new();
        for command in &contract.workspace.fingerprint {
            commands.insert(command.clone(), self.command_fact(command)?);
        }
        Ok(Fingerprint {
            head,
            branch: self.git.branch()?,
            tree,
            lockfiles,
            commands,
            tools: [("git".to_string(), git_version)].into(),
            keel_version: keel_core::KEEL_VERSION.to_string(),
        })
    }

    fn command_fact(&self, command: &str) -> Result<String, EngineError> {
        let out = self
            .tmp
            .join(format!("fingerprint-{}.out", std::process::id()));
        // A fact query (a database's schema version, a tool's version): it may need the network.
        let outcome = self
            .confinement
            .run(
                crate::process::Program::Shell(command),
                &[],
                &out,
                FINGERPRINT_TIMEOUT,
                None,
                Some(true),
            )
            .map_err(|e| EngineError::io(&out, e))?;
        let bytes = std::fs::read(&out).map_err(|e| EngineError::io(&out, e))?;
        let _ = std::fs::remove_file(&out);
        let text = String::from_utf8_lossy(&bytes);
        let text = text.trim();
        let shown = if text.len() <= INLINE_OUTPUT && !text.contains('\n') {
            text.to_string()
        } else {
            format!("blake3:{}", &blake3::hash(text.as_bytes()).to_hex()[..16])
        };
        Ok(if outcome.success {
            shown
        } else {
            format!("{} ({})", shown, outcome.status)
        })
    }
}

/// Paths relative to the repository root that keel's own files occupy (the store directory when
/// it lies inside the workspace): never part of a tree, a diff or a restore.
pub fn keel_excludes(repo_root: &Path, store_dir: &Path) -> Vec<String> {
    let root = repo_root
        .canonicalize()
        .unwrap_or_else(|_| repo_root.to_path_buf());
    let dir = store_dir
        .canonicalize()
        .unwrap_or_else(|_| store_dir.to_path_buf());
    match dir.strip_prefix(&root) {
        Ok(rel) if !rel.as_os_str().is_empty() => vec![rel.to_string_lossy().into_owned()],
        _ => Vec::new(),
    }
}
