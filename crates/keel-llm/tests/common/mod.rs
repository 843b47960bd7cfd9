//! What the client's tests share: the loopback fake model server (keel-test-support's, which
//! answers each connection with the next canned reply and records every request, so tests assert
//! on the exact request), the test key, a configuration, a prompt and tools.

#![allow(dead_code)]

use std::time::Duration;

use keel_core::agent::Reversibility;
use keel_llm::{ClientConfig, Prompt, Provider, ToolSpec};
use serde_json::json;

pub const KEY: &str = "sk-test-SECRET-0123456789";

/// A configuration for tests: the test key, generous timeout, two retries, 100 ms–1 s backoff.
pub fn config(provider: Provider, base_url: &str) -> ClientConfig {
    ClientConfig {
        provider,
        base_url: base_url.to_string(),
        model: match provider {
            Provider::OpenAi => "gpt-4o-mini".to_string(),
            Provider::Anthropic => "claude-sonnet-4-20250514".to_string(),
        },
        api_key: Some(KEY.to_string()),
        max_output_tokens: 1024,
        timeout: Duration::from_secs(10),
        max_retries: 2,
        backoff_base: Duration::from_millis(100),
        backoff_max: Duration::from_secs(1),
    }
}

pub fn prompt() -> Prompt {
    Prompt {
        system: "You are keel's agent. Use the tools.".to_string(),
        user: "Make the failing test pass.".to_string(),
        tokens: 17,
    }
}

pub fn tools() -> Vec<ToolSpec> {
    vec![
        ToolSpec {
            name: "read".to_string(),
            description: "Read a file in the workspace.".to_string(),
            parameters: json!({
                "type": "object",
                "properties": {"path": {"type": "string"}},
                "required": ["path"],
            }),
            reversibility: Reversibility::ReadOnly,
        },
        ToolSpec {
            name: "finish".to_string(),
            description: "Claim the task done.".to_string(),
            parameters: json!({"type": "object", "properties": {}}),
            reversibility: Reversibility::Reversible,
        },
    ]
}

/// A sleeper that records the waits it was asked for and does not wait.
pub fn no_sleep(record: &mut Vec<Duration>) -> impl FnMut(Duration) + '_ {
    move |d| record.push(d)
}
