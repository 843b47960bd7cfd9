//! The model drivers: keel-llm's clients behind the [`Driver`] trait.

use std::time::Duration;

use keel_core::agent::{ModelReply, Prompt, ToolSpec, Usage};
use keel_core::context::TokenCount;
use keel_core::contract::{Driver as DriverConfig, DriverKind};
use keel_llm::{Client, ClientConfig, LlmError, Price, Provider, TokenCounter};

use crate::EngineError;
use crate::driver::{Driver, DriverError, Exchange, SendContext};

struct Counter(Box<dyn TokenCounter>);

impl TokenCount for Counter {
    fn count(&self, text: &str) -> u64 {
        self.0.count(text)
    }
}

pub struct LlmDriver {
    client: Client,
    price: Option<Price>,
    counter: Counter,
    /// The secret's reference and value, to scrub from anything stored.
    secret: Option<(String, String)>,
}

/// Resolves `secret:NAME` from the environment, now, into memory only.
fn resolve_secret(reference: &str) -> Result<String, EngineError> {
    let name = reference.strip_prefix("secret:").unwrap_or(reference);
    std::env::var(name).map_err(|_| {
        EngineError::Usage(format!(
            "the driver's api_key names secret {name}, but the environment has no {name}; set it (it is read when the run starts and never stored)"
        ))
    })
}

pub fn make(
    kind: DriverKind,
    model: &str,
    d: &DriverConfig,
) -> Result<Box<dyn Driver>, EngineError> {
    let provider = match kind {
        DriverKind::Anthropic => Provider::Anthropic,
        _ => Provider::OpenAi,
    };
    let api_key = d.api_key.as_deref().map(resolve_secret).transpose()?;
    let secret = d.api_key.clone().zip(api_key.clone());
    let config = ClientConfig {
        provider,
        base_url: d
            .base_url
            .clone()
            .unwrap_or_else(|| ClientConfig::default_base_url(provider).to_string()),
        model: model.to_string(),
        api_key,
        max_output_tokens: u32::try_from(d.max_output_tokens).unwrap_or(u32::MAX),
        timeout: Duration::from_millis(d.timeout_ms),
        max_retries: d.max_retries,
        backoff_base: Duration::from_millis(d.retry_backoff_ms),
        backoff_max: Duration::from_secs(60),
    };
    let client = Client::new(config).map_err(|e| EngineError::Usage(e.to_string()))?;
    let price = match d.price {
        Some((input, output)) => Some(Price {
            input_usd_per_mtok: input as f64 / 1_000_000.0,
            output_usd_per_mtok: output as f64 / 1_000_000.0,
        }),
        None => keel_llm::default_price(model),
    };
    Ok(Box::new(LlmDriver {
        client,
        price,
        counter: Counter(keel_llm::token_counter(provider, model)),
        secret,
    }))
}

impl LlmDriver {
    /// A server that echoes the key back must not get it into the store.
    fn scrub(&self, bytes: Vec<u8>) -> Vec<u8> {
        match &self.secret {
            Some((name, value)) if !value.is_empty() => {
                let text = String::from_utf8_lossy(&bytes);
                if text.contains(value.as_str()) {
                    text.replace(value.as_str(), &format!("[{name}]"))
                        .into_bytes()
                } else {
                    bytes
                }
            }
            _ => bytes,
        }
    }
}

impl Driver for LlmDriver {
    fn request(&self, prompt: &Prompt, tools: &[ToolSpec]) -> Vec<u8> {
        self.client
            .build_request(prompt, &crate::mcp::wire_specs(tools))
    }

    fn send(&mut self, request: &[u8], _ctx: &SendContext<'_>) -> Result<Exchange, DriverError> {
        let mut sleep = |d: Duration| std::thread::sleep(d);
        match self.client.send(request, &mut sleep) {
            Ok(x) => Ok(Exchange {
                response: self.scrub(x.body),
                retries: x.retries,
                duration_ms: u64::try_from(x.duration.as_millis()).unwrap_or(u64::MAX),
            }),
            Err(e @ LlmError::Rejected { .. }) => Err(DriverError(format!(
                "{e}{}",
                self.secret
                    .as_ref()
                    .map(|(name, _)| format!(" (the key is {name})"))
                    .unwrap_or_default()
            ))),
            Err(e) => Err(DriverError(e.to_string())),
        }
    }

    fn parse(&self, response: &[u8]) -> Result<ModelReply, String> {
        self.client.parse(response).map_err(|e| e.to_string())
    }

    fn cost(&self, usage: Usage) -> u64 {
        self.price.map_or(0, |p| keel_llm::cost_micro_usd(p, usage))
    }

    fn counter(&self) -> &dyn TokenCount {
        &self.counter
    }
}
