//! Counting tokens before a call, to keep a prompt within `context_tokens`.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use tiktoken_rs::CoreBPE;

use crate::config::Provider;

/// Counts the tokens a text takes for some model.
pub trait TokenCounter: Send + Sync {
    fn count(&self, text: &str) -> u64;
    /// What is counting: `o200k_base`, `cl100k_base`, or the estimate's description.
    fn name(&self) -> &str;
}

/// The counter for a model:
/// - OpenAI-style models: a real BPE — `cl100k_base` for `gpt-4` (not `gpt-4o`/`gpt-4.1`),
///   `gpt-3.5` and `text-embedding-*-002/3` models; `o200k_base` for everything else, which
///   covers gpt-4o, gpt-4.1, gpt-5 and the o-series, and is the closest guess for unknown
///   OpenAI-compatible (local) models.
/// - Anthropic: Anthropic's tokenizer is not public, so an estimate with a safety margin:
///   `ceil(bytes * 1.1 / 3.2)`.
///
/// The BPE tables are bundled in the binary (no download) and built once per process, on first
/// use; building one takes a noticeable fraction of a second.
pub fn token_counter(provider: Provider, model: &str) -> Box<dyn TokenCounter> {
    match provider {
        Provider::Anthropic => Box::new(Estimate),
        Provider::OpenAi => {
            let encoding = if uses_cl100k(model) {
                Encoding::Cl100k
            } else {
                Encoding::O200k
            };
            match encoding.bpe() {
                Some(bpe) => Box::new(Bpe::new(encoding, bpe)),
                // Only if the bundled tables failed to load, which they do not: count safely
                // rather than fail.
                None => Box::new(Estimate),
            }
        }
    }
}

fn uses_cl100k(model: &str) -> bool {
    let name = model
        .rsplit('/')
        .next()
        .unwrap_or(model)
        .to_ascii_lowercase();
    // `gpt-4-…` (dated snapshots, `gpt-4-turbo`) but not `gpt-4o` or `gpt-4.1`.
    name == "gpt-4"
        || name.starts_with("gpt-4-")
        || name.starts_with("gpt-3.5")
        || name.starts_with("gpt-35")
        || name.starts_with("text-embedding-ada-002")
        || name.starts_with("text-embedding-3")
}

#[derive(Clone, Copy)]
enum Encoding {
    O200k,
    Cl100k,
}

impl Encoding {
    fn name(self) -> &'static str {
        match self {
            Encoding::O200k => "o200k_base",
            Encoding::Cl100k => "cl100k_base",
        }
    }

    fn bpe(self) -> Option<&'static CoreBPE> {
        static O200K: OnceLock<Option<CoreBPE>> = OnceLock::new();
        static CL100K: OnceLock<Option<CoreBPE>> = OnceLock::new();
        match self {
            Encoding::O200k => O200K.get_or_init(|| tiktoken_rs::o200k_base().ok()),
            Encoding::Cl100k => CL100K.get_or_init(|| tiktoken_rs::cl100k_base().ok()),
        }
        .as_ref()
    }
}

/// The bytes of remembered pieces a generation of [`Pieces`] holds before it is retired.
const PIECES_GENERATION_BYTES: usize = 1 << 20;

struct Bpe {
    encoding: Encoding,
    bpe: &'static CoreBPE,
    /// The counts of pieces of texts counted before (see [`pieces`]), shared by every counter
    /// of the encoding in the process: a step's prompt is mostly the lines of the one before
    /// (the rules, the task, notes, plan, observations), and runs of one contract share theirs.
    known: &'static Mutex<Pieces>,
}

impl Bpe {
    fn new(encoding: Encoding, bpe: &'static CoreBPE) -> Bpe {
        Bpe {
            encoding,
            bpe,
            known: encoding.pieces(),
        }
    }
}

impl Encoding {
    fn pieces(self) -> &'static Mutex<Pieces> {
        static O200K: OnceLock<Mutex<Pieces>> = OnceLock::new();
        static CL100K: OnceLock<Mutex<Pieces>> = OnceLock::new();
        match self {
            Encoding::O200k => &O200K,
            Encoding::Cl100k => &CL100K,
        }
        .get_or_init(|| Mutex::new(Pieces::new(PIECES_GENERATION_BYTES)))
    }
}

/// Splits `text` where both encodings' pre-tokenizer patterns always end a piece, so the tokens
/// of the whole are the sum of the tokens of the parts: right after a line feed that is followed
/// by a character that is neither whitespace nor `/`. No alternative of either pattern can run
/// across such a place: a run of letters, digits or of other symbols never holds a line feed
/// (the optional first character of a word excludes it); symbols take line feeds after them
/// (`[\r\n]*`, in o200k also `/`) and whitespace runs take whitespace, none of which follows;
/// and a piece that ends the part (`\s++$`, the end of text for cl100k) is the whitespace run
/// ending in that line feed, which the whole text splits the same way. The patterns look ahead
/// only, so what follows the place is split alike alone or in the whole.
/// `tests::pieces_count_as_the_whole` checks this against both encodings on random text.
fn pieces(text: &str) -> impl Iterator<Item = &str> {
    let mut rest = text;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let mut from = 0;
        let cut = loop {
            match rest[from..].find('\n') {
                None => break rest.len(),
                Some(i) => {
                    let after = from + i + 1;
                    match rest[after..].chars().next() {
                        None => break rest.len(),
                        Some(c) if !c.is_whitespace() && c != '/' => break after,
                        Some(_) => from = after,
                    }
                }
            }
        };
        let (piece, tail) = rest.split_at(cut);
        rest = tail;
        Some(piece)
    })
}

/// Remembered token counts of pieces, in two generations: a piece is looked up in the newer,
/// then in the older (and moved to the newer); once the newer holds `generation_bytes` of
/// pieces it becomes the older and the older is dropped. So the memory is bounded and the
/// pieces still in use stay.
struct Pieces {
    newer: HashMap<Box<str>, u32>,
    older: HashMap<Box<str>, u32>,
    newer_bytes: usize,
    generation_bytes: usize,
}

impl Pieces {
    fn new(generation_bytes: usize) -> Pieces {
        Pieces {
            newer: HashMap::new(),
            older: HashMap::new(),
            newer_bytes: 0,
            generation_bytes,
        }
    }

    fn get(&mut self, piece: &str) -> Option<u32> {
        if let Some(&n) = self.newer.get(piece) {
            return Some(n);
        }
        let (key, n) = self.older.remove_entry(piece)?;
        self.insert_key(key, n);
        Some(n)
    }

    fn insert(&mut self, piece: &str, n: u32) {
        if !self.newer.contains_key(piece) {
            self.insert_key(piece.into(), n);
        }
    }

    fn insert_key(&mut self, key: Box<str>, n: u32) {
        if self.newer_bytes + key.len() > self.generation_bytes {
            self.older = std::mem::take(&mut self.newer);
            self.newer_bytes = 0;
        }
        self.newer_bytes += key.len();
        self.newer.insert(key, n);
    }

    fn lock(known: &Mutex<Pieces>) -> std::sync::MutexGuard<'_, Pieces> {
        // Pieces holds only finished counts: one left by a thread that panicked is as good.
        known
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl TokenCounter for Bpe {
    /// Special-token text such as `<|endoftext|>` is counted as ordinary text, as the APIs
    /// treat it in a message. The count is exact: the text's [`pieces`] are counted (or
    /// remembered) one by one, and their sum is the whole's.
    fn count(&self, text: &str) -> u64 {
        let mut total = 0u64;
        let mut unknown = Vec::new();
        {
            let mut known = Pieces::lock(self.known);
            for piece in pieces(text) {
                match known.get(piece) {
                    Some(n) => total += u64::from(n),
                    None => unknown.push(piece),
                }
            }
        }
        if unknown.is_empty() {
            return total;
        }
        let counted: Vec<(&str, usize)> = unknown
            .into_iter()
            .map(|piece| (piece, self.bpe.encode_ordinary(piece).len()))
            .collect();
        let mut known = Pieces::lock(self.known);
        for (piece, n) in counted {
            total += n as u64;
            // A piece of more than 4 billion tokens is counted, not remembered.
            if let Ok(n) = u32::try_from(n) {
                known.insert(piece, n);
            }
        }
        total
    }

    fn name(&self) -> &str {
        self.encoding.name()
    }
}

/// `ceil(bytes / 3.2 * 1.1)`, that is `ceil(bytes * 11 / 32)`: English text runs near 4 bytes a
/// token and code nearer 3, so this errs on the side of more tokens.
struct Estimate;

impl TokenCounter for Estimate {
    fn count(&self, text: &str) -> u64 {
        (text.len() as u64).saturating_mul(11).div_ceil(32)
    }

    fn name(&self) -> &str {
        "estimate: ceil(bytes / 3.2 * 1.1)"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_families_pick_their_encoding() {
        for model in ["gpt-4", "gpt-4-0613", "gpt-4-turbo", "gpt-3.5-turbo"] {
            assert!(uses_cl100k(model), "{model}");
        }
        for model in [
            "gpt-4o",
            "gpt-4o-mini",
            "gpt-4.1",
            "gpt-5",
            "o3",
            "llama3.1:8b",
        ] {
            assert!(!uses_cl100k(model), "{model}");
        }
    }

    /// Remembered counts are the counts: texts counted again, in turn and after newer pieces
    /// retired the generation that held them, count as a fresh encoding of the whole does.
    #[test]
    fn remembered_counts_equal_fresh_ones() {
        let bpe = Encoding::O200k.bpe().unwrap();
        let known: &'static Mutex<Pieces> = Box::leak(Box::new(Mutex::new(Pieces::new(64))));
        let counter = Bpe {
            encoding: Encoding::O200k,
            bpe,
            known,
        };
        let texts: Vec<String> = (0..12)
            .map(|i| {
                format!(
                    "step {i}:\n{}",
                    "the harness rules say keep going.\n".repeat(3 + i)
                )
            })
            .chain(["short".to_string(), String::new()])
            .collect();
        let fresh = |t: &str| bpe.encode_ordinary(t).len() as u64;
        for round in 0..3 {
            for (i, t) in texts.iter().enumerate() {
                assert_eq!(counter.count(t), fresh(t), "round {round}, text {i}");
                assert_eq!(counter.count(&texts[0]), fresh(&texts[0]), "round {round}");
            }
        }
        let held = Pieces::lock(known);
        assert!(held.newer_bytes <= 64, "{}", held.newer_bytes);
        assert!(!held.older.is_empty(), "a generation was retired");
        drop(held);
        // A text that differs from a remembered one is counted, not taken for it.
        let (a, b) = (texts[1].clone(), format!("{} and then some", texts[1]));
        let (na, nb) = (counter.count(&a), counter.count(&b));
        assert_eq!((na, nb), (fresh(&a), fresh(&b)));
        assert_ne!(na, nb);
    }

    #[test]
    fn pieces_cut_after_a_line_feed_before_a_non_space() {
        fn cut(t: &str) -> Vec<&str> {
            pieces(t).collect()
        }
        assert_eq!(cut("a\nb\n"), ["a\n", "b\n"]);
        assert_eq!(cut("a\n b\n\nc"), ["a\n b\n\n", "c"]);
        assert_eq!(cut("a.\n/b\n\u{a0}c\nd"), ["a.\n/b\n\u{a0}c\n", "d"]);
        assert_eq!(cut(""), Vec::<&str>::new());
        assert_eq!(pieces("x\ny\n z").collect::<String>(), "x\ny\n z");
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]
        /// The sum of the pieces' counts is the whole's, in both encodings, for text made of
        /// what could break it: line feeds and carriage returns next to spaces, tabs, Unicode
        /// spaces, slashes, symbols, contractions, digits, letters of several scripts.
        #[test]
        fn pieces_count_as_the_whole(parts in proptest::collection::vec(
            proptest::sample::select(vec![
                "\n", "\n", "\n", "\r\n", "\r", " ", "  ", "\t", "\u{a0}", "\u{2028}",
                "/", "//", ".", "...", "'s", "'LL", "-", "```", "{\"a\": 1}", "(x)", "→",
                "word", "Word", "WORDS", "éclair", "日本語", "данные", "🙂", "7", "2026", "x1",
                "fn main()", "  indented", "\n\n", " \n", "\n ", "/\n", "\n/",
            ]),
            0..60,
        )) {
            let text: String = parts.concat();
            for encoding in [Encoding::O200k, Encoding::Cl100k] {
                let bpe = encoding.bpe().unwrap();
                let whole = bpe.encode_ordinary(&text).len() as u64;
                let summed: u64 = pieces(&text)
                    .map(|p| bpe.encode_ordinary(p).len() as u64)
                    .sum();
                proptest::prop_assert_eq!(summed, whole, "{} on {:?}", encoding.name(), text);
                proptest::prop_assert_eq!(Bpe::new(encoding, bpe).count(&text), whole);
            }
        }
    }

    #[test]
    fn estimate_rounds_up() {
        assert_eq!(Estimate.count(""), 0);
        assert_eq!(Estimate.count("a"), 1);
        assert_eq!(Estimate.count(&"x".repeat(32)), 11);
        assert_eq!(Estimate.count(&"x".repeat(33)), 12);
    }
}
