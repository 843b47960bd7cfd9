//! The Anthropic Messages API with tool use.

use keel_core::agent::{ModelReply, Prompt, ToolCall, ToolSpec, Usage};
use serde::Serialize;
use serde_json::Value;

use crate::error::LlmError;
use crate::wire::{malformed, u64_at};

/// The API version keel is written against, sent as `anthropic-version`.
pub(crate) const API_VERSION: &str = "2023-06-01";

#[derive(Serialize)]
struct Request<'a> {
    model: &'a str,
    max_tokens: u32,
    #[serde(skip_serializing_if = "str::is_empty")]
    system: &'a str,
    messages: [Message<'a>; 1],
    #[serde(skip_serializing_if = "Vec::is_empty")]
    tools: Vec<Tool<'a>>,
}

#[derive(Serialize)]
struct Message<'a> {
    role: &'static str,
    content: &'a str,
}

#[derive(Serialize)]
struct Tool<'a> {
    name: &'a str,
    description: &'a str,
    input_schema: &'a Value,
}

/// The request body. An empty system part and an empty tool list are left out.
pub(crate) fn build(
    model: &str,
    max_output_tokens: u32,
    prompt: &Prompt,
    tools: &[ToolSpec],
) -> Vec<u8> {
    let request = Request {
        model,
        max_tokens: max_output_tokens,
        system: &prompt.system,
        messages: [Message {
            role: "user",
            content: &prompt.user,
        }],
        tools: tools
            .iter()
            .map(|t| Tool {
                name: &t.name,
                description: &t.description,
                input_schema: &t.parameters,
            })
            .collect(),
    };
    crate::wire::to_json(&request)
}

/// The reply. Text blocks are joined with newlines (an empty result is `None`); `tool_use`
/// blocks become calls whose arguments are `input` serialised to text (`"{}"` if missing);
/// other blocks (thinking, …) are skipped. `usage.input_tokens` includes prompt-cache reads and
/// writes when the server reports them, since every one of those tokens was read; a missing
/// `usage` counts as zero.
pub(crate) fn parse(body: &[u8]) -> Result<ModelReply, LlmError> {
    let root: Value = serde_json::from_slice(body)
        .map_err(|e| malformed(format!("the body is not JSON ({e})"), body))?;
    if root.get("type").and_then(Value::as_str) == Some("error") {
        let message = root
            .get("error")
            .and_then(crate::wire::error_message)
            .unwrap_or_else(|| "no message".to_string());
        return Err(malformed(format!("the body is an error: {message}"), body));
    }
    let content = root
        .get("content")
        .and_then(Value::as_array)
        .ok_or_else(|| malformed("no `content` array".to_string(), body))?;

    let mut texts = Vec::new();
    let mut calls = Vec::new();
    for block in content {
        match block.get("type").and_then(Value::as_str) {
            Some("text") => {
                if let Some(text) = block.get("text").and_then(Value::as_str)
                    && !text.is_empty()
                {
                    texts.push(text);
                }
            }
            Some("tool_use") => {
                let index = calls.len();
                calls.push(ToolCall {
                    id: block
                        .get("id")
                        .and_then(Value::as_str)
                        .filter(|s| !s.is_empty())
                        .map_or_else(|| format!("toolu_{index}"), str::to_string),
                    name: block
                        .get("name")
                        .and_then(Value::as_str)
                        .unwrap_or_default()
                        .to_string(),
                    arguments: match block.get("input") {
                        None | Some(Value::Null) => "{}".to_string(),
                        Some(input) => input.to_string(),
                    },
                });
            }
            _ => {}
        }
    }

    let usage = root.get("usage");
    Ok(ModelReply {
        text: (!texts.is_empty()).then(|| texts.join("\n")),
        calls,
        usage: Usage {
            input_tokens: u64_at(usage, "input_tokens")
                .saturating_add(u64_at(usage, "cache_creation_input_tokens"))
                .saturating_add(u64_at(usage, "cache_read_input_tokens")),
            output_tokens: u64_at(usage, "output_tokens"),
        },
        stop_reason: root
            .get("stop_reason")
            .and_then(Value::as_str)
            .map(str::to_string),
    })
}
