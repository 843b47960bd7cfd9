//! `[scope]`: which paths a run may write and which commands it may run, as compiled globs.

use globset::{Glob, GlobBuilder, GlobSet, GlobSetBuilder};

/// The contract's `[scope]`, with its globs compiled.
///
/// Path globs are matched against the whole path relative to the workspace root, written with
/// `/` (a leading `./` is ignored). In them `*` and `?` never cross a `/`; `**` does, so
/// `src/**` is everything under `src` and `**/*.rs` is every Rust file. Command globs are matched
/// against the whole command line, and there `*` matches anything, `/` included, so
/// `git diff *` allows `git diff src/lib.rs`.
///
/// The `Vec<String>` fields are the patterns as written, for display; the matching methods use
/// the compiled sets built from them by [`Contract::parse`](super::Contract::parse).
#[derive(Debug, Clone)]
pub struct Scope {
    pub writable: Vec<String>,
    pub forbidden: Vec<String>,
    pub commands: Vec<String>,
    /// Whether commands may use the network.
    pub network: bool,
    /// What the `http` tool may reach.
    pub http: Vec<HttpRule>,
    writable_set: GlobSet,
    forbidden_set: GlobSet,
    commands_set: GlobSet,
}

/// One allow rule of the `http` tool: a host (exact, or `*.example.com`), an optional port,
/// the methods (uppercase).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpRule {
    pub host: String,
    pub port: Option<u16>,
    pub methods: Vec<String>,
}

impl Default for Scope {
    /// No `[scope]` table: everything writable, nothing forbidden, every command, no network.
    fn default() -> Self {
        Scope {
            writable: Vec::new(),
            forbidden: Vec::new(),
            commands: Vec::new(),
            network: false,
            http: Vec::new(),
            writable_set: GlobSet::empty(),
            forbidden_set: GlobSet::empty(),
            commands_set: GlobSet::empty(),
        }
    }
}

impl Scope {
    /// Builds a scope from globs that have each been checked with [`path_glob`] or
    /// [`command_glob`]. Fails with globset's reason only if a set cannot be built.
    pub(super) fn from_globs(
        writable: Vec<(String, Glob)>,
        forbidden: Vec<(String, Glob)>,
        commands: Vec<(String, Glob)>,
        network: bool,
    ) -> Result<Scope, globset::Error> {
        fn split(globs: Vec<(String, Glob)>) -> Result<(Vec<String>, GlobSet), globset::Error> {
            let mut builder = GlobSetBuilder::new();
            let mut patterns = Vec::with_capacity(globs.len());
            for (pattern, glob) in globs {
                builder.add(glob);
                patterns.push(pattern);
            }
            Ok((patterns, builder.build()?))
        }
        let (writable, writable_set) = split(writable)?;
        let (forbidden, forbidden_set) = split(forbidden)?;
        let (commands, commands_set) = split(commands)?;
        Ok(Scope {
            writable,
            forbidden,
            commands,
            network,
            http: Vec::new(),
            writable_set,
            forbidden_set,
            commands_set,
        })
    }

    /// Whether `path` matches a `writable` glob. An empty `writable` list makes every path
    /// writable. This does not look at `forbidden`; [`Scope::allows_write`] checks both.
    pub fn is_writable(&self, path: &str) -> bool {
        self.writable.is_empty() || self.writable_set.is_match(normalize(path))
    }

    /// Whether `path` matches a `forbidden` glob. An empty `forbidden` list forbids nothing.
    pub fn is_forbidden(&self, path: &str) -> bool {
        self.forbidden_set.is_match(normalize(path))
    }

    /// Whether the run may write `path`: writable and not forbidden.
    pub fn allows_write(&self, path: &str) -> bool {
        self.is_writable(path) && !self.is_forbidden(path)
    }

    /// Whether the command line `cmd` (leading and trailing whitespace ignored) matches a
    /// `commands` glob. An empty `commands` list allows every command.
    pub fn command_allowed(&self, cmd: &str) -> bool {
        self.commands.is_empty() || self.commands_set.is_match(cmd.trim())
    }
}

fn normalize(path: &str) -> &str {
    let mut path = path;
    while let Some(rest) = path.strip_prefix("./") {
        path = rest;
    }
    path
}

/// Compiles a path glob: `*` and `?` do not match `/`.
pub(super) fn path_glob(pattern: &str) -> Result<Glob, globset::Error> {
    GlobBuilder::new(pattern).literal_separator(true).build()
}

/// Compiles a command-line glob: `*` matches anything.
pub(super) fn command_glob(pattern: &str) -> Result<Glob, globset::Error> {
    GlobBuilder::new(pattern).literal_separator(false).build()
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn scope(writable: &[&str], forbidden: &[&str], commands: &[&str]) -> Scope {
        let paths = |ps: &[&str]| -> Vec<(String, Glob)> {
            ps.iter()
                .map(|p| (p.to_string(), path_glob(p).unwrap()))
                .collect()
        };
        let commands = commands
            .iter()
            .map(|p| (p.to_string(), command_glob(p).unwrap()))
            .collect();
        Scope::from_globs(paths(writable), paths(forbidden), commands, false).unwrap()
    }

    #[test]
    fn empty_scope_allows_everything_but_the_network() {
        let s = Scope::default();
        assert!(s.is_writable("src/main.rs"));
        assert!(!s.is_forbidden("src/main.rs"));
        assert!(s.allows_write("anything/at/all"));
        assert!(s.command_allowed("rm -rf /"));
        assert!(!s.network);
    }

    #[test]
    fn writable_globs_match_whole_relative_paths() {
        let s = scope(&["src/**", "tests/*.rs", "README.md"], &[], &[]);
        assert!(s.is_writable("src/lib.rs"));
        assert!(s.is_writable("src/a/b/c.rs"));
        assert!(s.is_writable("./src/lib.rs"));
        assert!(s.is_writable("tests/it.rs"));
        assert!(!s.is_writable("tests/sub/it.rs"), "* must not cross /");
        assert!(s.is_writable("README.md"));
        assert!(!s.is_writable("docs/README.md"));
        assert!(!s.is_writable("Cargo.toml"));
    }

    #[test]
    fn forbidden_wins_over_writable() {
        let s = scope(&["**"], &["Cargo.lock", ".github/**"], &[]);
        assert!(s.is_writable("Cargo.lock"));
        assert!(s.is_forbidden("Cargo.lock"));
        assert!(!s.allows_write("Cargo.lock"));
        assert!(!s.allows_write(".github/workflows/ci.yml"));
        assert!(s.allows_write("src/lib.rs"));
        assert!(!s.is_forbidden("sub/Cargo.lock"));
    }

    #[test]
    fn double_star_prefix_matches_any_directory() {
        let s = scope(&[], &["**/*.pem"], &[]);
        assert!(s.is_forbidden("key.pem"));
        assert!(s.is_forbidden("a/b/key.pem"));
        assert!(!s.is_forbidden("a/b/key.pem.txt"));
    }

    #[test]
    fn command_globs_match_whole_command_lines() {
        let s = scope(&[], &[], &["cargo *", "git diff *", "ls"]);
        assert!(s.command_allowed("cargo test --quiet"));
        assert!(
            s.command_allowed("git diff src/lib.rs"),
            "* crosses / in commands"
        );
        assert!(s.command_allowed("  ls "));
        assert!(!s.command_allowed("ls -la"));
        assert!(!s.command_allowed("git push"));
        assert!(!s.command_allowed("cargo"), "`cargo *` needs the space");
        assert!(!s.command_allowed("rm -rf /"));
    }
}
