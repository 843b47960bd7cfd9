//! Resolving `secret:NAME` from the environment or the secrets file, at the moment of use.
//!
//! A name is looked up in the environment first (the variable of that name), then in the
//! secrets file. The secrets file holds `NAME=value` lines (an optional leading `export `,
//! `#` comment lines, blank lines, and an optional pair of double quotes around the value, kept
//! verbatim inside them; unquoted values are trimmed). It must not be accessible to group or
//! others, since it holds credentials in clear.
//!
//! Errors never contain a value or the content of a line of the secrets file: a malformed line
//! is reported by file and line number only.

use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use keel_core::secret::Secret;

/// Why secrets could not be resolved.
#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    /// Neither the environment nor the secrets file has the name.
    #[error("secret {name} is not set: export {name}=... or add it to {}", where_to_add(.file.as_deref()))]
    NotSet {
        /// The secret's name.
        name: String,
        /// The secrets file that was consulted, if any.
        file: Option<PathBuf>,
    },
    /// The secrets file can be read (or written) by other users.
    #[error(
        "secrets file {} is accessible to other users (mode {mode:04o}): run chmod 600 {}",
        .file.display(), .file.display()
    )]
    Permissions {
        /// The secrets file.
        file: PathBuf,
        /// Its permission bits.
        mode: u32,
    },
    /// A line of the secrets file is not `NAME=value`, a comment or blank.
    #[error("{}:{line}: {reason}; lines of a secrets file are NAME=value, # comments or blank", .file.display())]
    Malformed {
        /// The secrets file.
        file: PathBuf,
        /// The 1-based line number.
        line: usize,
        /// What is wrong (never the line's content).
        reason: &'static str,
    },
    /// A name is defined twice in the secrets file.
    #[error("{}:{second}: secret {name} is already defined on line {first}; keep one of them", .file.display())]
    Duplicate {
        /// The secrets file.
        file: PathBuf,
        /// The name.
        name: String,
        /// The line of the first definition.
        first: usize,
        /// The line of the second one.
        second: usize,
    },
    /// The secrets file could not be read.
    #[error("cannot read secrets file {}: {source}", .file.display())]
    Read {
        /// The secrets file.
        file: PathBuf,
        /// The underlying error.
        source: io::Error,
    },
}

fn where_to_add(file: Option<&Path>) -> String {
    match file {
        Some(f) => f.display().to_string(),
        None => "a secrets file".to_owned(),
    }
}

/// Resolves each of `names`: from `env` (the variable of that name), else from the secrets
/// `file` (when given and present). The secrets file is read, and its permissions checked,
/// only if a name is missing from the environment.
pub fn resolve(
    names: &[String],
    env: &dyn Fn(&str) -> Option<String>,
    file: Option<&Path>,
) -> Result<Vec<Secret>, SecretError> {
    let mut from_file: Option<BTreeMap<String, String>> = None;
    let mut out = Vec::with_capacity(names.len());
    for name in names {
        if let Some(value) = env(name) {
            out.push(Secret::new(name.clone(), value));
            continue;
        }
        let entries = match &from_file {
            Some(entries) => entries,
            None => from_file.insert(match file {
                Some(path) => load(path)?,
                None => BTreeMap::new(),
            }),
        };
        match entries.get(name) {
            Some(value) => out.push(Secret::new(name.clone(), value.clone())),
            None => {
                return Err(SecretError::NotSet {
                    name: name.clone(),
                    file: file.map(Path::to_path_buf),
                });
            }
        }
    }
    Ok(out)
}

/// The entries of the secrets file at `path`; empty when it does not exist.
fn load(path: &Path) -> Result<BTreeMap<String, String>, SecretError> {
    let read_err = |source| SecretError::Read {
        file: path.to_path_buf(),
        source,
    };
    let meta = match fs::metadata(path) {
        Ok(meta) => meta,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(BTreeMap::new()),
        Err(e) => return Err(read_err(e)),
    };
    let mode = meta.permissions().mode() & 0o7777;
    if mode & 0o077 != 0 {
        return Err(SecretError::Permissions {
            file: path.to_path_buf(),
            mode,
        });
    }
    let text = fs::read_to_string(path).map_err(read_err)?;
    parse(&text, path)
}

/// Parses the secrets file's text (`path` is only for errors).
fn parse(text: &str, path: &Path) -> Result<BTreeMap<String, String>, SecretError> {
    let mut entries: BTreeMap<String, (usize, String)> = BTreeMap::new();
    for (index, raw) in text.lines().enumerate() {
        let line_no = index + 1;
        let malformed = |reason| SecretError::Malformed {
            file: path.to_path_buf(),
            line: line_no,
            reason,
        };
        let line = raw.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let line = line.strip_prefix("export ").map_or(line, str::trim_start);
        let Some((name, value)) = line.split_once('=') else {
            return Err(malformed("there is no `=`"));
        };
        let name = name.trim();
        if !valid_name(name) {
            return Err(malformed(
                "the name before `=` must be letters, digits and `_`, not starting with a digit",
            ));
        }
        let value = value.trim();
        let value = if let Some(inner) = value.strip_prefix('"') {
            match inner.strip_suffix('"') {
                Some(inner) => inner,
                None => return Err(malformed("the value's opening `\"` is never closed")),
            }
        } else {
            value
        };
        if let Some((first, _)) = entries.get(name) {
            return Err(SecretError::Duplicate {
                file: path.to_path_buf(),
                name: name.to_owned(),
                first: *first,
                second: line_no,
            });
        }
        entries.insert(name.to_owned(), (line_no, value.to_owned()));
    }
    Ok(entries.into_iter().map(|(k, (_, v))| (k, v)).collect())
}

fn valid_name(name: &str) -> bool {
    let mut chars = name.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use std::io::Write;

    fn secrets_file(text: &str, mode: u32) -> tempfile::NamedTempFile {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(text.as_bytes()).unwrap();
        fs::set_permissions(f.path(), fs::Permissions::from_mode(mode)).unwrap();
        f
    }

    fn names(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| (*s).to_owned()).collect()
    }

    fn no_env(_: &str) -> Option<String> {
        None
    }

    #[test]
    fn environment_first_then_file() {
        let f = secrets_file(
            "# credentials\n\nAPI_TOKEN=from-file\nexport DB_PASSWORD = \"  spaced # not a comment \"\n",
            0o600,
        );
        let env = |n: &str| (n == "API_TOKEN").then(|| "from-env".to_owned());
        let got = resolve(&names(&["API_TOKEN", "DB_PASSWORD"]), &env, Some(f.path())).unwrap();
        assert_eq!(got[0].name(), "API_TOKEN");
        assert_eq!(got[0].expose(), "from-env");
        assert_eq!(got[1].name(), "DB_PASSWORD");
        assert_eq!(got[1].expose(), "  spaced # not a comment ");
    }

    #[test]
    fn missing_name_says_how_to_set_it() {
        let f = secrets_file("OTHER=x\n", 0o600);
        let err = resolve(&names(&["API_TOKEN"]), &no_env, Some(f.path())).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "secret API_TOKEN is not set: export API_TOKEN=... or add it to {}",
                f.path().display()
            )
        );
        let err = resolve(&names(&["API_TOKEN"]), &no_env, None).unwrap_err();
        assert!(matches!(err, SecretError::NotSet { .. }));
        // A secrets file that does not exist is simply empty.
        let dir = tempfile::tempdir().unwrap();
        let absent = dir.path().join("secrets");
        let err = resolve(&names(&["X"]), &no_env, Some(&absent)).unwrap_err();
        assert!(err.to_string().contains("add it to"), "{err}");
    }

    #[test]
    fn readable_by_others_is_refused() {
        for mode in [0o644, 0o640, 0o604, 0o601] {
            let f = secrets_file("API_TOKEN=from-file\n", mode);
            let err = resolve(&names(&["API_TOKEN"]), &no_env, Some(f.path())).unwrap_err();
            let msg = err.to_string();
            assert!(matches!(err, SecretError::Permissions { .. }), "{msg}");
            assert!(
                msg.contains(&format!("chmod 600 {}", f.path().display())),
                "{msg}"
            );
            assert!(!msg.contains("from-file"));
        }
        let f = secrets_file("API_TOKEN=from-file\n", 0o400);
        assert!(resolve(&names(&["API_TOKEN"]), &no_env, Some(f.path())).is_ok());
    }

    #[test]
    fn file_untouched_when_everything_is_in_the_environment() {
        let f = secrets_file("this line is broken\n", 0o644);
        let env = |_: &str| Some("value-from-env".to_owned());
        let got = resolve(&names(&["A"]), &env, Some(f.path())).unwrap();
        assert_eq!(got[0].expose(), "value-from-env");
        assert!(resolve(&[], &no_env, Some(f.path())).unwrap().is_empty());
    }

    #[test]
    fn malformed_lines_name_file_and_line_but_not_content() {
        let cases = [
            ("OK=1\n\nhunter2-no-equals\n", 3),
            ("# c\n9BAD=hunter2\n", 2),
            ("A=\"hunter2\n", 1),
            ("=hunter2\n", 1),
        ];
        for (text, line) in cases {
            let f = secrets_file(text, 0o600);
            let err = resolve(&names(&["OK"]), &no_env, Some(f.path())).unwrap_err();
            let msg = err.to_string();
            match err {
                SecretError::Malformed { line: l, .. } => assert_eq!(l, line, "{msg}"),
                other => panic!("unexpected {other:?}"),
            }
            assert!(
                msg.starts_with(&format!("{}:{line}: ", f.path().display())),
                "{msg}"
            );
            assert!(!msg.contains("hunter2"), "{msg}");
        }
    }

    #[test]
    fn duplicates_are_refused() {
        let f = secrets_file("A=one1\nB=two2\nA=three\n", 0o600);
        let err = resolve(&names(&["A"]), &no_env, Some(f.path())).unwrap_err();
        assert!(matches!(
            err,
            SecretError::Duplicate {
                first: 1,
                second: 3,
                ..
            }
        ));
        assert!(!err.to_string().contains("three"));
    }
}
