//! What a client is configured with: which API, where, which model, and how hard to try.

use std::time::Duration;

/// The wire format a model server speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Provider {
    /// OpenAI Chat Completions with tools: OpenAI itself and compatible servers (Ollama, vLLM,
    /// llama.cpp server, …).
    OpenAi,
    /// Anthropic Messages API with tool use.
    Anthropic,
}

impl Provider {
    pub fn as_str(self) -> &'static str {
        match self {
            Provider::OpenAi => "openai",
            Provider::Anthropic => "anthropic",
        }
    }
}

impl std::fmt::Display for Provider {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Everything a [`crate::Client`] needs. `Debug` is written by hand so that the API key never
/// appears in logs or panic messages.
#[derive(Clone)]
pub struct ClientConfig {
    pub provider: Provider,
    /// Without the endpoint path: OpenAI-compatible servers are sent `POST {base}/chat/completions`
    /// (so the base usually ends in `/v1`), Anthropic `POST {base}/v1/messages`.
    pub base_url: String,
    pub model: String,
    /// The resolved secret value. Sent only as a header (`Authorization: Bearer` or
    /// `x-api-key`), never in a body, an error message or `Debug` output. `None` for local
    /// servers that need no key.
    pub api_key: Option<String>,
    /// The cap on output tokens (`max_completion_tokens` / `max_tokens`).
    pub max_output_tokens: u32,
    /// For one attempt: connecting, sending and reading the whole answer.
    pub timeout: Duration,
    /// Retries after the first attempt, on 408, 429, 5xx, timeouts and connection errors.
    pub max_retries: u32,
    /// Backoff before retry `n` (from 0) is uniform in `[0, min(backoff_max, backoff_base * 2^n)]`
    /// ("full jitter"); a `Retry-After` header from the server overrides it.
    pub backoff_base: Duration,
    pub backoff_max: Duration,
}

impl ClientConfig {
    /// The public endpoint of each provider, in the form `base_url` expects.
    pub fn default_base_url(provider: Provider) -> &'static str {
        match provider {
            Provider::OpenAi => "https://api.openai.com/v1",
            Provider::Anthropic => "https://api.anthropic.com",
        }
    }
}

impl std::fmt::Debug for ClientConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientConfig")
            .field("provider", &self.provider)
            .field("base_url", &redact_url(&self.base_url))
            .field("model", &self.model)
            .field("api_key", &self.api_key.as_ref().map(|_| Redacted))
            .field("max_output_tokens", &self.max_output_tokens)
            .field("timeout", &self.timeout)
            .field("max_retries", &self.max_retries)
            .field("backoff_base", &self.backoff_base)
            .field("backoff_max", &self.backoff_max)
            .finish()
    }
}

struct Redacted;

impl std::fmt::Debug for Redacted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<redacted>")
    }
}

/// A URL fit for an error message or a log: without user info, query or fragment, where people
/// sometimes put keys. Text that does not parse as a URL is not shown at all.
pub(crate) fn redact_url(url: &str) -> String {
    match url::Url::parse(url) {
        // `scheme:anything` parses too, with the whole rest as an opaque path: not shown.
        Ok(mut parsed) if !parsed.cannot_be_a_base() => {
            // Both setters only fail for URLs that cannot have credentials; nothing to strip then.
            let _ = parsed.set_username("");
            let _ = parsed.set_password(None);
            parsed.set_query(None);
            parsed.set_fragment(None);
            parsed.to_string()
        }
        _ => "<not a valid URL>".to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_lose_credentials_and_queries() {
        assert_eq!(
            redact_url("https://user:pw@example.com/v1?key=sk-1#x"),
            "https://example.com/v1"
        );
        assert_eq!(redact_url("user:sk-1@nowhere"), "<not a valid URL>");
    }
}
