//! Counting tokens before a call, to keep a prompt within `context_tokens`.

use std::sync::OnceLock;

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
                Some(bpe) => Box::new(Bpe { encoding, bpe }),
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

struct Bpe {
    encoding: Encoding,
    bpe: &'static CoreBPE,
}

impl TokenCounter for Bpe {
    /// Special-token text such as `<|endoftext|>` is counted as ordinary text, as the APIs
    /// treat it in a message.
    fn count(&self, text: &str) -> u64 {
        self.bpe.encode_ordinary(text).len() as u64
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

    #[test]
    fn estimate_rounds_up() {
        assert_eq!(Estimate.count(""), 0);
        assert_eq!(Estimate.count("a"), 1);
        assert_eq!(Estimate.count(&"x".repeat(32)), 11);
        assert_eq!(Estimate.count(&"x".repeat(33)), 12);
    }
}
