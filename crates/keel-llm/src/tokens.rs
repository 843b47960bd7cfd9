//! Counting tokens before a call, to keep a prompt within `context_tokens`.

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

/// How many counts a counter remembers, and the shortest text it remembers one for.
const MEMO_ENTRIES: usize = 8;
const MEMO_MIN_BYTES: usize = 256;

struct Bpe {
    encoding: Encoding,
    bpe: &'static CoreBPE,
    /// The counts of the texts counted most recently, by their BLAKE3 hash, least recently
    /// used first: every step's prompt counts the same harness rules and tool list again, and
    /// hashing a text costs a small fraction of encoding it.
    memo: Mutex<Vec<([u8; 32], u64)>>,
}

impl Bpe {
    fn new(encoding: Encoding, bpe: &'static CoreBPE) -> Bpe {
        Bpe {
            encoding,
            bpe,
            memo: Mutex::new(Vec::with_capacity(MEMO_ENTRIES)),
        }
    }

    fn memo(&self) -> std::sync::MutexGuard<'_, Vec<([u8; 32], u64)>> {
        // The memo holds only finished counts: one left by a thread that panicked is as good.
        self.memo
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl TokenCounter for Bpe {
    /// Special-token text such as `<|endoftext|>` is counted as ordinary text, as the APIs
    /// treat it in a message.
    fn count(&self, text: &str) -> u64 {
        if text.len() < MEMO_MIN_BYTES {
            return self.bpe.encode_ordinary(text).len() as u64;
        }
        let hash = *blake3::hash(text.as_bytes()).as_bytes();
        {
            let mut memo = self.memo();
            if let Some(i) = memo.iter().position(|(h, _)| *h == hash) {
                let entry = memo.remove(i);
                memo.push(entry);
                return entry.1;
            }
        }
        let n = self.bpe.encode_ordinary(text).len() as u64;
        let mut memo = self.memo();
        if memo.len() >= MEMO_ENTRIES {
            memo.remove(0);
        }
        memo.push((hash, n));
        n
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

    /// Remembered counts are the counts: texts counted again, in turn and after others pushed
    /// them out of the memo, count as a fresh encoding does.
    #[test]
    fn remembered_counts_equal_fresh_ones() {
        let bpe = Encoding::O200k.bpe().unwrap();
        let counter = Bpe::new(Encoding::O200k, bpe);
        let texts: Vec<String> = (0..MEMO_ENTRIES + 3)
            .map(|i| {
                format!(
                    "step {i}: {}",
                    "the harness rules say keep going. ".repeat(10 + i)
                )
            })
            .chain(["short".to_string()])
            .collect();
        let fresh = |t: &str| bpe.encode_ordinary(t).len() as u64;
        for round in 0..3 {
            for (i, t) in texts.iter().enumerate() {
                assert_eq!(counter.count(t), fresh(t), "round {round}, text {i}");
                assert_eq!(counter.count(&texts[0]), fresh(&texts[0]), "round {round}");
            }
        }
        assert!(counter.memo().len() <= MEMO_ENTRIES);
        // A text that differs from a remembered one is counted, not taken for it.
        let (a, b) = (texts[1].clone(), format!("{} and then some", texts[1]));
        let (na, nb) = (counter.count(&a), counter.count(&b));
        assert_eq!((na, nb), (fresh(&a), fresh(&b)));
        assert_ne!(na, nb);
    }

    #[test]
    fn estimate_rounds_up() {
        assert_eq!(Estimate.count(""), 0);
        assert_eq!(Estimate.count("a"), 1);
        assert_eq!(Estimate.count(&"x".repeat(32)), 11);
        assert_eq!(Estimate.count(&"x".repeat(33)), 12);
    }
}
