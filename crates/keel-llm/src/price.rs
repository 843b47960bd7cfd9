//! What a model call costs.

use keel_core::agent::Usage;

/// A model's price in US dollars per million tokens.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Price {
    pub input_usd_per_mtok: f64,
    pub output_usd_per_mtok: f64,
}

/// Built-in prices: USD per million tokens, standard tier, without batch or prompt-cache
/// discounts, as published by OpenAI and Anthropic. Table written 2026-11-29; prices change, so
/// a contract's own price table takes precedence over this one.
///
/// Matched by the longest entry that is the model name or a prefix of it followed by `-` (so
/// dated snapshots like `gpt-4o-2024-08-06` or `claude-sonnet-4-20250514` match, while
/// `gpt-5.2` does not fall back to `gpt-5`'s price).
const PRICES: &[(&str, f64, f64)] = &[
    // OpenAI
    ("gpt-5", 1.25, 10.00),
    ("gpt-5-mini", 0.25, 2.00),
    ("gpt-5-nano", 0.05, 0.40),
    ("gpt-5-pro", 15.00, 120.00),
    ("gpt-5.1", 1.25, 10.00),
    ("gpt-5.4", 2.50, 15.00),
    ("gpt-4.1", 2.00, 8.00),
    ("gpt-4.1-mini", 0.40, 1.60),
    ("gpt-4.1-nano", 0.10, 0.40),
    ("gpt-4o", 2.50, 10.00),
    ("gpt-4o-mini", 0.15, 0.60),
    ("gpt-4-turbo", 10.00, 30.00),
    ("gpt-4", 30.00, 60.00),
    ("gpt-3.5-turbo", 0.50, 1.50),
    ("o1", 15.00, 60.00),
    ("o1-mini", 1.10, 4.40),
    ("o3", 2.00, 8.00),
    ("o3-mini", 1.10, 4.40),
    ("o3-pro", 20.00, 80.00),
    ("o4-mini", 1.10, 4.40),
    // Anthropic
    ("claude-opus-4", 15.00, 75.00),
    ("claude-opus-4-1", 15.00, 75.00),
    ("claude-opus-4-5", 5.00, 25.00),
    ("claude-opus-4-6", 5.00, 25.00),
    ("claude-sonnet-4", 3.00, 15.00),
    ("claude-haiku-4-5", 1.00, 5.00),
    ("claude-3-7-sonnet", 3.00, 15.00),
    ("claude-3-5-sonnet", 3.00, 15.00),
    ("claude-3-5-haiku", 0.80, 4.00),
    ("claude-3-opus", 15.00, 75.00),
    ("claude-3-haiku", 0.25, 1.25),
];

/// The built-in price of a well-known model, or `None` (local models such as Ollama's
/// `llama3.1:8b`, and models newer than the table). A router prefix such as `openai/` is
/// ignored.
pub fn default_price(model: &str) -> Option<Price> {
    let name = model
        .rsplit('/')
        .next()
        .unwrap_or(model)
        .to_ascii_lowercase();
    PRICES
        .iter()
        .filter(|(prefix, _, _)| {
            name == *prefix
                || name
                    .strip_prefix(prefix)
                    .is_some_and(|rest| rest.starts_with('-'))
        })
        .max_by_key(|(prefix, _, _)| prefix.len())
        .map(|&(_, input, output)| Price {
            input_usd_per_mtok: input,
            output_usd_per_mtok: output,
        })
}

/// The cost of `usage` at `price`, in millionths of a US dollar, rounded to the nearest one.
/// (A price per million tokens is exactly the price per token in micro-dollars.) Negative or
/// non-finite prices count as zero.
pub fn cost_micro_usd(price: Price, usage: Usage) -> u64 {
    let per_token = |p: f64| if p.is_finite() && p > 0.0 { p } else { 0.0 };
    let micro = usage.input_tokens as f64 * per_token(price.input_usd_per_mtok)
        + usage.output_tokens as f64 * per_token(price.output_usd_per_mtok);
    // `as` saturates: a cost beyond u64 (not reachable with real prices) stays at the maximum.
    micro.round() as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn price(model: &str) -> Option<(f64, f64)> {
        default_price(model).map(|p| (p.input_usd_per_mtok, p.output_usd_per_mtok))
    }

    #[test]
    fn longest_prefix_at_a_dash_boundary_wins() {
        assert_eq!(price("gpt-4o"), Some((2.50, 10.00)));
        assert_eq!(price("gpt-4o-2024-08-06"), Some((2.50, 10.00)));
        assert_eq!(price("gpt-4o-mini-2024-07-18"), Some((0.15, 0.60)));
        assert_eq!(price("gpt-4.1-nano"), Some((0.10, 0.40)));
        assert_eq!(price("gpt-4-0613"), Some((30.00, 60.00)));
        assert_eq!(price("gpt-5-mini"), Some((0.25, 2.00)));
        assert_eq!(price("o3-mini"), Some((1.10, 4.40)));
        assert_eq!(price("o3-2025-04-16"), Some((2.00, 8.00)));
        assert_eq!(price("claude-3-5-haiku-20241022"), Some((0.80, 4.00)));
        assert_eq!(price("claude-sonnet-4-20250514"), Some((3.00, 15.00)));
        assert_eq!(price("claude-sonnet-4-5"), Some((3.00, 15.00)));
        assert_eq!(price("claude-opus-4-20250514"), Some((15.00, 75.00)));
        assert_eq!(price("claude-opus-4-5-20251101"), Some((5.00, 25.00)));
        assert_eq!(price("openai/gpt-4o-mini"), Some((0.15, 0.60)));
        assert_eq!(price("GPT-4o"), Some((2.50, 10.00)));
    }

    #[test]
    fn unknown_and_local_models_have_no_price() {
        for model in [
            "llama3.1:8b",
            "qwen2.5-coder:7b",
            "gpt-oss:20b",
            "gpt-5.2",
            "gpt-4oops",
            "",
        ] {
            assert_eq!(default_price(model), None, "{model}");
        }
    }

    #[test]
    fn cost_rounds_to_micro_dollars() {
        let p = Price {
            input_usd_per_mtok: 0.15,
            output_usd_per_mtok: 0.60,
        };
        let usage = |i, o| Usage {
            input_tokens: i,
            output_tokens: o,
        };
        assert_eq!(cost_micro_usd(p, usage(0, 0)), 0);
        assert_eq!(cost_micro_usd(p, usage(1_000_000, 0)), 150_000);
        assert_eq!(cost_micro_usd(p, usage(3, 1)), 1); // 0.45 + 0.6
        let bad = Price {
            input_usd_per_mtok: f64::NAN,
            output_usd_per_mtok: -1.0,
        };
        assert_eq!(cost_micro_usd(bad, usage(10, 10)), 0);
    }
}
