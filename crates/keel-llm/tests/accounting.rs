#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Cost, token counting, configuration checks and secrecy of the key.

mod common;

use std::time::Duration;

use common::{KEY, config};
use keel_llm::{
    Client, ClientConfig, LlmError, Price, Provider, Usage, cost_micro_usd, default_price,
    token_counter,
};

#[test]
fn cost_is_computed_from_a_price() {
    let price = Price {
        input_usd_per_mtok: 2.50,
        output_usd_per_mtok: 10.00,
    };
    let usage = Usage {
        input_tokens: 12_000,
        output_tokens: 800,
    };
    // 12,000 * $2.50/M + 800 * $10/M = $0.03 + $0.008 = $0.038
    assert_eq!(cost_micro_usd(price, usage), 38_000);
    assert_eq!(default_price("gpt-4o"), Some(price));
    let mini = default_price("gpt-4o-mini").unwrap();
    assert_eq!(cost_micro_usd(mini, usage), 2_280); // 1800 + 480
    assert_eq!(default_price("llama3.2:3b"), None);
}

#[test]
fn bpe_counts_as_tiktoken_does() {
    let o200k = token_counter(Provider::OpenAi, "gpt-4o");
    assert_eq!(o200k.name(), "o200k_base");
    assert_eq!(o200k.count("hello world"), 2);
    assert_eq!(o200k.count(""), 0);
    let cl100k = token_counter(Provider::OpenAi, "gpt-4-0613");
    assert_eq!(cl100k.name(), "cl100k_base");
    assert_eq!(cl100k.count("hello world"), 2);
    // The example in OpenAI's cookbook "How to count tokens with tiktoken".
    assert_eq!(cl100k.count("tiktoken is great!"), 6);
    // Unknown OpenAI-compatible models (local servers) default to o200k_base.
    assert_eq!(
        token_counter(Provider::OpenAi, "qwen2.5-coder:7b").name(),
        "o200k_base"
    );
    assert_eq!(
        token_counter(Provider::OpenAi, "gpt-5-mini").name(),
        "o200k_base"
    );
}

#[test]
fn anthropic_estimate_has_a_safety_margin() {
    let counter = token_counter(Provider::Anthropic, "claude-sonnet-4-20250514");
    assert!(counter.name().starts_with("estimate"));
    for text in [
        "hello world",
        "fn main() { println!(\"{}\", 1 + 2); }",
        &"The quick brown fox jumps over the lazy dog. ".repeat(100),
        "日本語のテキスト",
    ] {
        let bytes = text.len() as u64;
        assert!(counter.count(text) >= bytes.div_ceil(4), "{text}");
        assert!(counter.count(text) >= bytes * 10 / 32, "{text}");
    }
}

#[test]
fn debug_of_a_config_and_a_client_does_not_show_the_key() {
    let mut cfg = config(
        Provider::OpenAi,
        "https://user:pass@api.example.com/v1?api-key=q",
    );
    let shown = format!("{cfg:?}");
    assert!(!shown.contains(KEY), "{shown}");
    assert!(shown.contains("<redacted>"), "{shown}");
    assert!(!shown.contains("pass"), "{shown}");
    assert!(!shown.contains("api-key=q"), "{shown}");
    let client = Client::new(cfg.clone()).unwrap();
    let shown = format!("{client:?}");
    assert!(!shown.contains(KEY), "{shown}");
    assert_eq!(
        client.endpoint(),
        "https://api.example.com/v1/chat/completions"
    );
    cfg.api_key = None;
    assert!(format!("{cfg:?}").contains("api_key: None"));
}

#[test]
fn default_base_urls() {
    assert_eq!(
        ClientConfig::default_base_url(Provider::OpenAi),
        "https://api.openai.com/v1"
    );
    assert_eq!(
        ClientConfig::default_base_url(Provider::Anthropic),
        "https://api.anthropic.com"
    );
    // Both can be built into clients (https needs the TLS backend compiled in).
    for provider in [Provider::OpenAi, Provider::Anthropic] {
        let client = Client::new(config(provider, ClientConfig::default_base_url(provider)));
        assert!(client.is_ok(), "{client:?}");
    }
}

#[test]
fn bad_configurations_are_transport_errors_without_the_key() {
    let mut bad_url = config(Provider::OpenAi, "not a url");
    bad_url.api_key = Some(KEY.to_string());
    let mut ftp = config(Provider::OpenAi, "ftp://example.com");
    ftp.api_key = None;
    let mut bad_key = config(Provider::Anthropic, "https://api.anthropic.com");
    bad_key.api_key = Some(format!("{KEY}\nX-Injected: 1"));
    let mut zero = config(Provider::OpenAi, "http://127.0.0.1:1/v1");
    zero.timeout = Duration::ZERO;
    for cfg in [bad_url, ftp, bad_key, zero] {
        match Client::new(cfg) {
            Err(LlmError::Transport(message)) => assert!(!message.contains(KEY), "{message}"),
            other => panic!("expected Transport, got {other:?}"),
        }
    }
}
