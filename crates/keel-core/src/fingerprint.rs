//! The environment fingerprint: the facts about the workspace and its surroundings that a run's
//! progress depends on. Resume compares the fingerprint recorded at the last step boundary with
//! one taken now, and never continues silently when they differ.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

/// What keel knows of the environment at one instant. Collected by the engine; compared here.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Fingerprint {
    /// The commit HEAD points at, `None` on an unborn branch.
    pub head: Option<String>,
    /// The checked-out branch, `None` when HEAD is detached.
    pub branch: Option<String>,
    /// The git tree of the whole working tree as it is on disk (tracked and untracked files,
    /// not ignored ones, without keel's own directory): the dirty-tree hash.
    pub tree: String,
    /// blake3 of each lockfile that is present, by path relative to the workspace.
    pub lockfiles: BTreeMap<String, String>,
    /// The contract's `fingerprint` commands: blake3 of each one's output and exit status.
    pub commands: BTreeMap<String, String>,
    /// Versions of the tools keel itself relies on (git).
    pub tools: BTreeMap<String, String>,
    /// The version of keel that took the fingerprint.
    pub keel_version: String,
}

/// One difference between two fingerprints, in words a person can act on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FingerprintChange {
    /// Which part changed: `head`, `branch`, `tree`, `lockfile`, `command`, `tool`, `keel_version`.
    pub part: String,
    /// The lockfile path, command or tool name, when the part has several members.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    pub before: Option<String>,
    pub after: Option<String>,
}

impl fmt::Display for FingerprintChange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let show = |v: &Option<String>| match v {
            Some(v) => short(v),
            None => "(none)".to_string(),
        };
        let what = match (self.part.as_str(), &self.key) {
            ("head", _) => "HEAD".to_string(),
            ("branch", _) => "the branch".to_string(),
            ("tree", Some(files)) => format!("the working tree ({files})"),
            ("tree", None) => "the working tree".to_string(),
            ("lockfile", Some(path)) => format!("lockfile {path}"),
            ("command", Some(cmd)) => format!("the output of fingerprint command `{cmd}`"),
            ("tool", Some(tool)) => format!("the version of {tool}"),
            ("keel_version", _) => "keel's version".to_string(),
            (part, Some(key)) => format!("{part} {key}"),
            (part, None) => part.to_string(),
        };
        write!(
            f,
            "{what} changed: {} -> {}",
            show(&self.before),
            show(&self.after)
        )
    }
}

fn short(v: &str) -> String {
    let is_hash = v.len() >= 40 && v.bytes().all(|b| b.is_ascii_hexdigit());
    if is_hash {
        v[..12].to_string()
    } else {
        v.to_string()
    }
}

impl Fingerprint {
    /// blake3 of the canonical JSON encoding: what evidence records as its environment.
    pub fn hash(&self) -> String {
        // Serialising a struct of strings and BTreeMaps cannot fail; an empty string would
        // still be a (useless but harmless) distinct hash input.
        let json = serde_json::to_string(self).unwrap_or_default();
        blake3::hash(json.as_bytes()).to_hex().to_string()
    }

    /// Every difference from `before` to `self`. `tree` changes name no files: the engine asks
    /// git for the paths and fills `key` for a person.
    pub fn changes_since(&self, before: &Fingerprint) -> Vec<FingerprintChange> {
        let mut out = Vec::new();
        let mut single = |part: &str, b: &Option<String>, a: &Option<String>| {
            if b != a {
                out.push(FingerprintChange {
                    part: part.to_string(),
                    key: None,
                    before: b.clone(),
                    after: a.clone(),
                });
            }
        };
        single("head", &before.head, &self.head);
        single("branch", &before.branch, &self.branch);
        single("tree", &Some(before.tree.clone()), &Some(self.tree.clone()));
        single(
            "keel_version",
            &Some(before.keel_version.clone()),
            &Some(self.keel_version.clone()),
        );
        map_changes(&mut out, "lockfile", &before.lockfiles, &self.lockfiles);
        map_changes(&mut out, "command", &before.commands, &self.commands);
        map_changes(&mut out, "tool", &before.tools, &self.tools);
        out
    }
}

fn map_changes(
    out: &mut Vec<FingerprintChange>,
    part: &str,
    before: &BTreeMap<String, String>,
    after: &BTreeMap<String, String>,
) {
    let keys: std::collections::BTreeSet<&String> = before.keys().chain(after.keys()).collect();
    for key in keys {
        let (b, a) = (before.get(key), after.get(key));
        if b != a {
            out.push(FingerprintChange {
                part: part.to_string(),
                key: Some(key.clone()),
                before: b.cloned(),
                after: a.cloned(),
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fp() -> Fingerprint {
        Fingerprint {
            head: Some("a".repeat(40)),
            branch: Some("main".into()),
            tree: "b".repeat(40),
            lockfiles: [("Cargo.lock".to_string(), "c".repeat(64))].into(),
            commands: BTreeMap::new(),
            tools: [("git".to_string(), "git version 2".to_string())].into(),
            keel_version: "0.1.0".into(),
        }
    }

    #[test]
    fn equal_fingerprints_have_no_changes() {
        assert!(fp().changes_since(&fp()).is_empty());
        assert_eq!(fp().hash(), fp().hash());
    }

    #[test]
    fn every_changed_part_is_named() {
        let before = fp();
        let mut after = fp();
        after.head = Some("d".repeat(40));
        after.lockfiles.insert("Cargo.lock".into(), "e".repeat(64));
        after
            .commands
            .insert("psql -c 'select 1'".into(), "f".repeat(64));
        let changes = after.changes_since(&before);
        let parts: Vec<&str> = changes.iter().map(|c| c.part.as_str()).collect();
        assert_eq!(parts, ["head", "lockfile", "command"]);
        assert_eq!(
            changes[1].to_string(),
            format!(
                "lockfile Cargo.lock changed: {} -> {}",
                "c".repeat(12),
                "e".repeat(12)
            )
        );
        assert!(changes[2].to_string().contains("(none) ->"));
        assert_ne!(before.hash(), after.hash());
    }
}
