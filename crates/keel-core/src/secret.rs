//! Secrets: resolved at use, held as a secret type, scrubbed from everything keel stores.
//!
//! - [`Secret`] holds a named value. Its `Debug` and `Display` print `[secret:NAME]`, never the
//!   value; the value is reached only through [`Secret::expose`], and it is not `Serialize`, so
//!   it cannot end up in an event or a log by accident.
//! - [`Scrubber`] replaces every known secret value in text or bytes with `[secret:NAME]`: the
//!   plain value, its JSON-escaped form (so serialized JSON is scrubbed too) and, for values of
//!   at least [`BASE64_MIN_LEN`] bytes, its standard base64 forms (as in an
//!   `Authorization: Basic` header, at any alignment inside a longer encoded string).
//! - [`scan_diff`] is the `secret-scan` check: it looks at the lines a unified diff adds and
//!   reports known secret values and high-confidence credential patterns, never the value.
//!
//! Pure: no I/O, no environment reads. Resolving a secret's value is the engine's job.

use std::borrow::Cow;
use std::fmt;
use std::sync::LazyLock;

use aho_corasick::{AhoCorasick, AhoCorasickBuilder, MatchKind};
use base64::Engine as _;
use base64::engine::general_purpose::{STANDARD, STANDARD_NO_PAD};
use regex::Regex;

/// Values shorter than this (in characters) are refused: they would match everywhere.
pub const MIN_SECRET_LEN: usize = 4;

/// Values of at least this many bytes are also scrubbed in their base64 forms.
pub const BASE64_MIN_LEN: usize = 8;

/// A named secret value. `Debug` and `Display` show `[secret:NAME]`; only [`Secret::expose`]
/// gives the value.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret {
    name: String,
    value: String,
}

impl Secret {
    /// A secret called `name` with `value`.
    pub fn new(name: impl Into<String>, value: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            value: value.into(),
        }
    }

    /// The secret's name (as in `secret:NAME`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The value itself. Use it only where it is sent (a header, an environment variable).
    pub fn expose(&self) -> &str {
        &self.value
    }

    /// What is written in place of the value: `[secret:NAME]`.
    pub fn placeholder(&self) -> String {
        placeholder(&self.name)
    }
}

fn placeholder(name: &str) -> String {
    format!("[secret:{name}]")
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "[secret:{}]", self.name)
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "[secret:{}]", self.name)
    }
}

/// Why a [`Scrubber`] could not be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScrubberError {
    /// A value too short to be told apart from ordinary text.
    #[error(
        "secret {name} is shorter than {MIN_SECRET_LEN} characters; such a value cannot be scrubbed reliably from logs"
    )]
    TooShort {
        /// The secret's name.
        name: String,
    },
    /// The matcher could not be built (should not happen for any input).
    #[error("cannot build the secret scrubber: {0}")]
    Build(String),
}

/// Replaces known secret values with `[secret:NAME]` in text and bytes.
///
/// All forms of all values are searched at once; where matches overlap (one secret containing
/// another, or two overlapping in the text) the whole covered span is replaced, so no part of
/// either value survives.
#[derive(Clone, Default)]
pub struct Scrubber {
    /// `None` when there are no secrets: scrubbing is then a no-op.
    matcher: Option<AhoCorasick>,
    /// For each pattern of the matcher, the index of its secret in `names`.
    owners: Vec<usize>,
    /// Secret names, in the order given.
    names: Vec<String>,
}

impl fmt::Debug for Scrubber {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Scrubber")
            .field("secrets", &self.names)
            .finish()
    }
}

impl Scrubber {
    /// A scrubber for `secrets`. Refuses values shorter than [`MIN_SECRET_LEN`] characters.
    pub fn new<'a>(secrets: impl IntoIterator<Item = &'a Secret>) -> Result<Self, ScrubberError> {
        let mut names = Vec::new();
        // (pattern, owner), longest first so the scrubber never prefers a shorter form.
        let mut patterns: Vec<(Vec<u8>, usize)> = Vec::new();
        for secret in secrets {
            if secret.value.chars().count() < MIN_SECRET_LEN {
                return Err(ScrubberError::TooShort {
                    name: secret.name.clone(),
                });
            }
            let owner = names.len();
            names.push(secret.name.clone());
            for form in forms(&secret.value) {
                if !patterns.iter().any(|(p, _)| *p == form) {
                    patterns.push((form, owner));
                }
            }
        }
        if patterns.is_empty() {
            return Ok(Self {
                matcher: None,
                owners: Vec::new(),
                names,
            });
        }
        patterns.sort_by_key(|(p, _)| std::cmp::Reverse(p.len()));
        let matcher = AhoCorasickBuilder::new()
            .match_kind(MatchKind::Standard)
            .build(patterns.iter().map(|(p, _)| p))
            .map_err(|e| ScrubberError::Build(e.to_string()))?;
        Ok(Self {
            matcher: Some(matcher),
            owners: patterns.iter().map(|(_, o)| *o).collect(),
            names,
        })
    }

    /// A scrubber that knows no secrets (scrubbing returns its input unchanged).
    pub fn empty() -> Self {
        Self::default()
    }

    /// Whether no secrets are known.
    pub fn is_empty(&self) -> bool {
        self.matcher.is_none()
    }

    /// The names of the known secrets.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.names.iter().map(String::as_str)
    }

    /// `text` with every known secret value (plain, JSON-escaped, base64) replaced by
    /// `[secret:NAME]`. Borrowed when nothing was found.
    pub fn scrub<'t>(&self, text: &'t str) -> Cow<'t, str> {
        match self.scrub_bytes(text.as_bytes()) {
            Cow::Borrowed(_) => Cow::Borrowed(text),
            // Every pattern is valid UTF-8 and so is the input, so matches start and end on
            // character boundaries and the output is valid UTF-8; the lossy path never runs.
            Cow::Owned(bytes) => Cow::Owned(match String::from_utf8(bytes) {
                Ok(s) => s,
                Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
            }),
        }
    }

    /// [`Scrubber::scrub`] for bytes (artifacts, output that need not be UTF-8).
    pub fn scrub_bytes<'t>(&self, bytes: &'t [u8]) -> Cow<'t, [u8]> {
        let spans = self.spans(bytes);
        if spans.is_empty() {
            return Cow::Borrowed(bytes);
        }
        let mut out = Vec::with_capacity(bytes.len());
        let mut at = 0;
        for span in &spans {
            out.extend_from_slice(&bytes[at..span.start]);
            for &owner in &span.owners {
                out.extend_from_slice(placeholder(&self.names[owner]).as_bytes());
            }
            at = span.end;
        }
        out.extend_from_slice(&bytes[at..]);
        Cow::Owned(out)
    }

    /// Names of the known secrets found in `bytes` (in any form), each once, in order of
    /// first appearance.
    pub fn found_in(&self, bytes: &[u8]) -> Vec<&str> {
        let mut found: Vec<usize> = Vec::new();
        for span in self.spans(bytes) {
            for owner in span.owners {
                if !found.contains(&owner) {
                    found.push(owner);
                }
            }
        }
        found.into_iter().map(|o| self.names[o].as_str()).collect()
    }

    /// Merged spans of all (overlapping) matches, in order, with the secrets they cover.
    fn spans(&self, bytes: &[u8]) -> Vec<Span> {
        let Some(matcher) = &self.matcher else {
            return Vec::new();
        };
        let mut matches: Vec<(usize, usize, usize)> = matcher
            .find_overlapping_iter(bytes)
            .map(|m| (m.start(), m.end(), self.owners[m.pattern().as_usize()]))
            .collect();
        // Longest first at equal starts, so a span is named after the longest value there.
        matches.sort_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)));
        let mut spans: Vec<Span> = Vec::new();
        for (start, end, owner) in matches {
            match spans.last_mut() {
                Some(last) if start < last.end => {
                    if end > last.end {
                        last.end = end;
                        if !last.owners.contains(&owner) {
                            last.owners.push(owner);
                        }
                    }
                }
                _ => spans.push(Span {
                    start,
                    end,
                    owners: vec![owner],
                }),
            }
        }
        spans
    }
}

struct Span {
    start: usize,
    end: usize,
    owners: Vec<usize>,
}

/// The byte strings under which `value` may appear: plain, JSON-escaped, base64.
fn forms(value: &str) -> Vec<Vec<u8>> {
    let mut out = vec![value.as_bytes().to_vec()];
    let mut push = |form: Vec<u8>| {
        if form.len() >= MIN_SECRET_LEN && !out.contains(&form) {
            out.push(form);
        }
    };
    push(json_escaped(value).into_bytes());
    let bytes = value.as_bytes();
    if bytes.len() >= BASE64_MIN_LEN {
        // The whole value encoded on its own, padding included.
        push(STANDARD.encode(bytes).into_bytes());
        // Inside a longer encoded string (`user:password`), the value's encoding depends on its
        // offset modulo 3: for each offset keep only the characters that depend on the value
        // alone.
        for offset in 0..3usize {
            let mut buf = vec![0u8; offset];
            buf.extend_from_slice(bytes);
            let encoded = STANDARD_NO_PAD.encode(&buf);
            let first = (8 * offset).div_ceil(6);
            let last = 8 * (offset + bytes.len()) / 6; // exclusive
            if let Some(core) = encoded.as_bytes().get(first..last) {
                push(core.to_vec());
            }
        }
    }
    out
}

/// `value` as it appears inside a JSON string (serde_json's escaping, without the quotes).
fn json_escaped(value: &str) -> String {
    let quoted = serde_json::Value::String(value.to_owned()).to_string();
    quoted
        .strip_prefix('"')
        .and_then(|s| s.strip_suffix('"'))
        .map_or_else(|| value.to_owned(), str::to_owned)
}

// ---------------------------------------------------------------------------------------------
// secret-scan
// ---------------------------------------------------------------------------------------------

/// What a [`Finding`] found. Never the value itself.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum FindingKind {
    /// The value of a known secret (by name), in any form the scrubber knows.
    KnownSecret(String),
    /// Something shaped like a credential: the pattern's name (e.g. `aws-access-key-id`).
    Pattern(&'static str),
}

/// An added line of a diff that holds a secret.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Finding {
    /// The file, as named by the diff's `+++ b/…` header.
    pub path: String,
    /// The line number in the new file (1-based).
    pub line: u32,
    /// What was found.
    pub kind: FindingKind,
}

impl fmt::Display for Finding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.kind {
            FindingKind::KnownSecret(name) => write!(
                f,
                "{}:{}: the value of secret {name} is written into the file; remove it and read it from the environment instead",
                self.path, self.line
            ),
            FindingKind::Pattern(kind) => write!(
                f,
                "{}:{}: this line looks like a credential ({kind}); remove it, or move it to the secrets file",
                self.path, self.line
            ),
        }
    }
}

/// Credential patterns: (name, regex, whether the token must look random).
const PATTERNS: [(&str, &str, bool); 8] = [
    ("aws-access-key-id", r"\bAKIA[0-9A-Z]{16}\b", false),
    ("github-token", r"\bgh[pousr]_[A-Za-z0-9]{36,255}\b", false),
    (
        "github-fine-grained-token",
        r"\bgithub_pat_[A-Za-z0-9]{22}_[A-Za-z0-9]{59}\b",
        false,
    ),
    (
        "slack-token",
        r"\bxox[baprs]-[0-9]{6,}-[0-9A-Za-z]{6,}(?:-[0-9A-Za-z]+)*",
        false,
    ),
    (
        "private-key",
        r"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----",
        false,
    ),
    ("anthropic-api-key", r"\bsk-ant-[A-Za-z0-9_-]{32,}", true),
    ("openai-api-key", r"\bsk-[A-Za-z0-9_-]{40,}", true),
    ("google-api-key", r"\bAIza[0-9A-Za-z_-]{35}", false),
];

static COMPILED: LazyLock<Vec<(&'static str, Regex, bool)>> = LazyLock::new(|| {
    // The patterns are constants (a unit test checks they all compile).
    PATTERNS
        .iter()
        .filter_map(|&(name, re, random)| Regex::new(re).ok().map(|r| (name, r, random)))
        .collect()
});

/// Whether a token looks like a generated key rather than a word: it has a digit, an uppercase
/// and a lowercase letter.
fn looks_random(token: &str) -> bool {
    token.bytes().any(|b| b.is_ascii_digit())
        && token.bytes().any(|b| b.is_ascii_uppercase())
        && token.bytes().any(|b| b.is_ascii_lowercase())
}

/// The pattern names that match `line`, each once.
fn patterns_in(line: &str) -> Vec<&'static str> {
    let mut out: Vec<&'static str> = Vec::new();
    for (name, re, random) in COMPILED.iter() {
        let hit = re.find_iter(line).any(|m| {
            let token = m.as_str();
            // An Anthropic key is reported as such, not also as an OpenAI-style key.
            if *name == "openai-api-key" && token.starts_with("sk-ant-") {
                return false;
            }
            !random || looks_random(token)
        });
        if hit {
            out.push(name);
        }
    }
    out
}

/// The `secret-scan` check: the lines `unified_diff` adds that hold a known secret value (in
/// any form `known` scrubs) or a high-confidence credential pattern. Removed and context lines
/// are not looked at. Findings name the file, the line in the new file and the kind, never the
/// value.
pub fn scan_diff(unified_diff: &str, known: &Scrubber) -> Vec<Finding> {
    let mut findings = Vec::new();
    let mut path: Option<String> = None;
    // Lines left in the current hunk (old side, new side) and the next new-file line number.
    let mut old_left: u64 = 0;
    let mut new_left: u64 = 0;
    let mut new_line: u64 = 0;
    for raw in unified_diff.lines() {
        if old_left > 0 || new_left > 0 {
            match raw.as_bytes().first() {
                Some(b'+') => {
                    if let Some(p) = &path {
                        scan_line(&raw[1..], p, new_line, known, &mut findings);
                    }
                    new_line += 1;
                    new_left = new_left.saturating_sub(1);
                }
                Some(b'-') => old_left = old_left.saturating_sub(1),
                Some(b'\\') => {} // "\ No newline at end of file"
                _ => {
                    // Context (an empty line is context whose leading space was stripped).
                    new_line += 1;
                    old_left = old_left.saturating_sub(1);
                    new_left = new_left.saturating_sub(1);
                }
            }
            continue;
        }
        if let Some(rest) = raw.strip_prefix("+++ ") {
            path = new_path(rest);
        } else if raw.starts_with("diff ") {
            path = None;
        } else if let Some((old, new, start)) = hunk_header(raw) {
            old_left = old;
            new_left = new;
            new_line = start;
        }
    }
    findings
}

fn scan_line(line: &str, path: &str, number: u64, known: &Scrubber, out: &mut Vec<Finding>) {
    let line_no = u32::try_from(number).unwrap_or(u32::MAX);
    let mut push = |kind: FindingKind| {
        let finding = Finding {
            path: path.to_owned(),
            line: line_no,
            kind,
        };
        if !out.contains(&finding) {
            out.push(finding);
        }
    };
    for name in known.found_in(line.as_bytes()) {
        push(FindingKind::KnownSecret(name.to_owned()));
    }
    for name in patterns_in(line) {
        push(FindingKind::Pattern(name));
    }
}

/// The path of a `+++ ` header, without `b/`, quotes or a trailing timestamp; `None` for
/// `/dev/null` (a deleted file).
fn new_path(rest: &str) -> Option<String> {
    let rest = rest.split('\t').next().unwrap_or(rest).trim_end();
    let rest = rest
        .strip_prefix('"')
        .and_then(|r| r.strip_suffix('"'))
        .unwrap_or(rest);
    if rest == "/dev/null" {
        return None;
    }
    Some(rest.strip_prefix("b/").unwrap_or(rest).to_owned())
}

/// `@@ -a,b +c,d @@` → (b, d, c). A missing count means 1.
fn hunk_header(line: &str) -> Option<(u64, u64, u64)> {
    let rest = line.strip_prefix("@@ -")?;
    let (ranges, _) = rest.split_once(" @@")?;
    let (old, new) = ranges.split_once(" +")?;
    let count = |range: &str| -> Option<(u64, u64)> {
        match range.split_once(',') {
            Some((start, n)) => Some((start.parse().ok()?, n.parse().ok()?)),
            None => Some((range.parse().ok()?, 1)),
        }
    };
    let (_, old_count) = count(old)?;
    let (new_start, new_count) = count(new)?;
    Some((old_count, new_count, new_start))
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn scrubber(secrets: &[(&str, &str)]) -> Scrubber {
        let secrets: Vec<Secret> = secrets.iter().map(|(n, v)| Secret::new(*n, *v)).collect();
        Scrubber::new(&secrets).unwrap()
    }

    #[test]
    fn debug_and_display_never_show_the_value() {
        let s = Secret::new("API_TOKEN", "hunter2-very-secret");
        assert_eq!(format!("{s:?}"), "[secret:API_TOKEN]");
        assert_eq!(s.to_string(), "[secret:API_TOKEN]");
        assert!(!format!("{:?}", vec![s.clone()]).contains("hunter2"));
        assert_eq!(s.expose(), "hunter2-very-secret");
        assert_eq!(s.name(), "API_TOKEN");
        let sc = Scrubber::new([&s]).unwrap();
        assert!(!format!("{sc:?}").contains("hunter2"));
    }

    #[test]
    fn plain_values_are_replaced_everywhere() {
        let sc = scrubber(&[("TOKEN", "abc123xyz")]);
        assert_eq!(
            sc.scrub("a abc123xyz b abc123xyzabc123xyz"),
            "a [secret:TOKEN] b [secret:TOKEN][secret:TOKEN]"
        );
        assert!(matches!(sc.scrub("nothing here"), Cow::Borrowed(_)));
    }

    #[test]
    fn empty_scrubber_is_a_no_op() {
        let sc = Scrubber::new([]).unwrap();
        assert!(sc.is_empty());
        assert!(matches!(sc.scrub("anything"), Cow::Borrowed("anything")));
        assert!(matches!(sc.scrub_bytes(b"\xffx"), Cow::Borrowed(_)));
        assert!(Scrubber::empty().found_in(b"x").is_empty());
    }

    #[test]
    fn short_values_are_refused_with_the_name() {
        let secrets = [Secret::new("OK", "long enough"), Secret::new("PIN", "123")];
        let err = Scrubber::new(&secrets).unwrap_err();
        assert_eq!(
            err.to_string(),
            "secret PIN is shorter than 4 characters; such a value cannot be scrubbed reliably from logs"
        );
        // Four characters (not bytes) is the limit.
        assert!(Scrubber::new(&[Secret::new("A", "ééé")]).is_err());
        assert!(Scrubber::new(&[Secret::new("A", "abcd")]).is_ok());
    }

    #[test]
    fn json_escaped_values_are_replaced_in_serialized_json() {
        let value = "pa\"ss\nwo\\rd\u{1}";
        let sc = scrubber(&[("PW", value)]);
        let json = serde_json::json!({ "env": { "PW": value }, "msg": format!("x{value}y") });
        let text = json.to_string();
        assert!(text.contains("pa\\\"ss\\nwo\\\\rd\\u0001"));
        let scrubbed = sc.scrub(&text);
        assert!(!scrubbed.contains("pa\\\"ss"), "{scrubbed}");
        let back: serde_json::Value = serde_json::from_str(&scrubbed).unwrap();
        assert_eq!(back["env"]["PW"], "[secret:PW]");
        assert_eq!(back["msg"], "x[secret:PW]y");
        // The plain form still works in the same scrubber.
        assert_eq!(sc.scrub(&format!("<{value}>")), "<[secret:PW]>");
    }

    #[test]
    fn base64_forms_are_replaced() {
        let sc = scrubber(&[("PASS", "correct-horse-battery")]);
        let whole = STANDARD.encode("correct-horse-battery");
        assert_eq!(sc.scrub(&format!("x {whole} y")), "x [secret:PASS] y");
        // Inside a Basic credential, at each of the three alignments.
        for user in ["u", "us", "use", "user"] {
            let header = format!(
                "Authorization: Basic {}",
                STANDARD.encode(format!("{user}:correct-horse-battery"))
            );
            let scrubbed = sc.scrub(&header);
            assert!(scrubbed.contains("[secret:PASS]"), "{user}: {scrubbed}");
            // No run of 8 characters of the encoded value survives.
            let encoded = STANDARD_NO_PAD.encode("correct-horse-battery");
            for w in encoded.as_bytes().windows(8) {
                assert!(!scrubbed.as_bytes().windows(8).any(|x| x == w));
            }
        }
        // Short values are not scrubbed in base64 (too many false positives).
        let short = scrubber(&[("S", "abcdefg")]);
        let enc = STANDARD.encode("abcdefg");
        assert_eq!(short.scrub(&enc), enc);
    }

    #[test]
    fn overlapping_secrets_scrub_fully() {
        // One containing the other: the longer name wins.
        let sc = scrubber(&[("SHORT", "password"), ("LONG", "password123")]);
        assert_eq!(sc.scrub("x password123 y"), "x [secret:LONG] y");
        assert_eq!(sc.scrub("x password y"), "x [secret:SHORT] y");
        // Overlapping in the text: nothing of either survives.
        let sc = scrubber(&[("A", "abcdefgh"), ("B", "efghijkl")]);
        let out = sc.scrub("<abcdefghijkl>");
        assert_eq!(out, "<[secret:A][secret:B]>");
        // Same value under two names is replaced once.
        let sc = scrubber(&[("A", "samevalue"), ("B", "samevalue")]);
        assert_eq!(sc.scrub("samevalue"), "[secret:A]");
    }

    #[test]
    fn bytes_with_invalid_utf8_around_a_secret() {
        let sc = scrubber(&[("K", "s3cr3t-key")]);
        let mut input = vec![0xff, 0xfe, b'a'];
        input.extend_from_slice(b"s3cr3t-key");
        input.extend_from_slice(&[0xc3, 0x28, 0x80]);
        let out = sc.scrub_bytes(&input);
        let mut expected = vec![0xff, 0xfe, b'a'];
        expected.extend_from_slice(b"[secret:K]");
        expected.extend_from_slice(&[0xc3, 0x28, 0x80]);
        assert_eq!(out.as_ref(), expected.as_slice());
        assert!(matches!(sc.scrub_bytes(&[0xff, 0xfe]), Cow::Borrowed(_)));
    }

    #[test]
    fn unicode_values_scrub_on_char_boundaries() {
        let sc = scrubber(&[("U", "clé-secrète")]);
        assert_eq!(sc.scrub("é clé-secrète é"), "é [secret:U] é");
    }

    // ---- secret-scan ----

    fn diff_adding(path: &str, line: &str) -> String {
        format!(
            "diff --git a/{path} b/{path}\n--- a/{path}\n+++ b/{path}\n@@ -1,2 +1,3 @@\n ctx\n+{line}\n ctx2\n"
        )
    }

    fn kinds(findings: &[Finding]) -> Vec<FindingKind> {
        findings.iter().map(|f| f.kind.clone()).collect()
    }

    #[test]
    fn all_patterns_compile() {
        assert_eq!(COMPILED.len(), PATTERNS.len());
    }

    #[test]
    fn each_pattern_is_found() {
        let cases = [
            ("key = \"AKIAIOSFODNN7EXAMPLE\"", "aws-access-key-id"),
            (
                "token: ghp_aBcDeFgHiJkLmNoPqRsTuVwXyZ0123456789",
                "github-token",
            ),
            ("t=gho_aBcDeFgHiJkLmNoPqRsTuVwXyZ0123456789", "github-token"),
            ("t=ghs_aBcDeFgHiJkLmNoPqRsTuVwXyZ0123456789", "github-token"),
            ("t=ghu_aBcDeFgHiJkLmNoPqRsTuVwXyZ0123456789", "github-token"),
            (
                &format!(
                    "t=github_pat_{}_{}",
                    "A1b2C3d4E5f6G7h8I9j0K1",
                    "x".repeat(59)
                ),
                "github-fine-grained-token",
            ),
            (
                "SLACK=xoxb-123456789012-1234567890123-AbCdEfGhIjKlMnOpQrStUvWx",
                "slack-token",
            ),
            ("-----BEGIN RSA PRIVATE KEY-----", "private-key"),
            ("-----BEGIN OPENSSH PRIVATE KEY-----", "private-key"),
            ("-----BEGIN PRIVATE KEY-----", "private-key"),
            (
                "OPENAI_API_KEY=sk-proj-Ab3dEf6hIj9kLmN0pQrStUvWxYz12345678901234",
                "openai-api-key",
            ),
            (
                "key: sk-ant-api03-Ab3dEf6hIj9kLmN0pQrStUvWxYz1234567890_-abcd",
                "anthropic-api-key",
            ),
            (
                "GOOGLE=AIzaSyA1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q",
                "google-api-key",
            ),
        ];
        for (line, kind) in cases {
            let findings = scan_diff(&diff_adding("src/config.rs", line), &Scrubber::empty());
            assert_eq!(
                kinds(&findings),
                vec![FindingKind::Pattern(kind)],
                "line: {line}"
            );
            assert_eq!(findings[0].path, "src/config.rs");
            assert_eq!(findings[0].line, 2);
            // The finding never carries the value.
            let shown = format!("{:?} {}", findings[0], findings[0]);
            let token = line.split(['=', ' ', '"']).next_back().unwrap_or(line);
            if token.len() > 12 {
                assert!(!shown.contains(token), "{shown}");
            }
        }
    }

    #[test]
    fn removed_and_context_lines_are_ignored() {
        let diff = "\
--- a/x.env
+++ b/x.env
@@ -1,2 +1,2 @@
 AKIAIOSFODNN7EXAMPLE
-OLD=AKIAIOSFODNN7EXAMPLF
+NEW=nothing-to-see
";
        assert!(scan_diff(diff, &Scrubber::empty()).is_empty());
    }

    #[test]
    fn line_numbers_across_hunks_and_files() {
        let diff = "\
diff --git a/a.txt b/a.txt
index 1111111..2222222 100644
--- a/a.txt
+++ b/a.txt
@@ -1,3 +1,4 @@
 one
-two
+AKIAIOSFODNN7EXAMPLE
+three
 four
@@ -10,2 +11,3 @@ fn context()
 ten
+-----BEGIN EC PRIVATE KEY-----
 eleven
\\ No newline at end of file
diff --git a/new.txt b/new.txt
new file mode 100644
--- /dev/null
+++ b/new.txt
@@ -0,0 +1,3 @@
+hello
+++ AKIAABCDEFGHIJKLMNOP
+
diff --git a/gone.txt b/gone.txt
deleted file mode 100644
--- a/gone.txt
+++ /dev/null
@@ -1 +0,0 @@
-AKIAABCDEFGHIJKLMNOP
";
        let findings = scan_diff(diff, &Scrubber::empty());
        assert_eq!(
            findings,
            vec![
                Finding {
                    path: "a.txt".into(),
                    line: 2,
                    kind: FindingKind::Pattern("aws-access-key-id"),
                },
                Finding {
                    path: "a.txt".into(),
                    line: 12,
                    kind: FindingKind::Pattern("private-key"),
                },
                Finding {
                    path: "new.txt".into(),
                    line: 2,
                    kind: FindingKind::Pattern("aws-access-key-id"),
                },
            ]
        );
    }

    #[test]
    fn known_secrets_are_found_in_any_form() {
        let sc = scrubber(&[("DB_PASSWORD", "tr0ub4dor&3-horse")]);
        let plain = scan_diff(
            &diff_adding("db.toml", "password = \"tr0ub4dor&3-horse\""),
            &sc,
        );
        assert_eq!(
            kinds(&plain),
            vec![FindingKind::KnownSecret("DB_PASSWORD".into())]
        );
        let b64 = STANDARD.encode("admin:tr0ub4dor&3-horse");
        let basic = scan_diff(
            &diff_adding("curl.sh", &format!("-H 'Authorization: Basic {b64}'")),
            &sc,
        );
        assert_eq!(
            kinds(&basic),
            vec![FindingKind::KnownSecret("DB_PASSWORD".into())]
        );
        assert!(!format!("{plain:?}").contains("tr0ub4dor"));
    }

    #[test]
    fn ordinary_diffs_and_lookalikes_find_nothing() {
        let lines = [
            "fn main() { println!(\"hello\"); }",
            "let sk = \"sk-test\";",
            "// see sk-learn for details",
            "name = \"sk-learn-compatible-estimator-interface-version-two\"",
            "task-runner-aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
            "AKIA is a prefix; AKIA123 is too short",
            "ghp_short",
            "xoxb-token-goes-here",
            "-----BEGIN PUBLIC KEY-----",
            "-----BEGIN CERTIFICATE-----",
            "sk-ant-example",
            "AIza",
        ];
        let sc = scrubber(&[("TOKEN", "definitely-not-in-the-diff")]);
        for line in lines {
            let findings = scan_diff(&diff_adding("src/lib.rs", line), &sc);
            assert!(findings.is_empty(), "{line}: {findings:?}");
        }
    }

    #[test]
    fn hunk_headers_parse() {
        assert_eq!(hunk_header("@@ -1,3 +1,4 @@"), Some((3, 4, 1)));
        assert_eq!(hunk_header("@@ -5 +7 @@ fn x()"), Some((1, 1, 7)));
        assert_eq!(hunk_header("@@ -0,0 +1,2 @@"), Some((0, 2, 1)));
        assert_eq!(hunk_header("@@ nonsense"), None);
        assert_eq!(new_path("b/a b.txt\t2024-01-01"), Some("a b.txt".into()));
        assert_eq!(new_path("\"b/q.txt\""), Some("q.txt".into()));
        assert_eq!(new_path("/dev/null"), None);
    }
}
