//! OpenAI Chat Completions with tools, as spoken by OpenAI and by compatible servers (Ollama,
//! vLLM, llama.cpp server).

use keel_core::agent::{ModelReply, Prompt, ToolCall, ToolSpec, Usage};
use serde::Serialize;
use serde_json::Value;

use crate::error::LlmError;
use crate::wire::{malformed, u64_at};

#[derive(Serialize)]
struct Request<'a> {
    model: &'a str,
    messages: Vec<Message<'a>>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    tools: Vec<Tool<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_choice: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    parallel_tool_calls: Option<bool>,
    /// `max_completion_tokens`, not the older `max_tokens`: OpenAI's reasoning models (o-series,
    /// gpt-5) refuse `max_tokens` with a 400, while vLLM and current llama.cpp accept the new
    /// name. A server that does not know it ignores it, which leaves a local model's output
    /// uncapped — it costs time there, not money — instead of failing every call.
    max_completion_tokens: u32,
}

#[derive(Serialize)]
struct Message<'a> {
    role: &'static str,
    content: &'a str,
}

#[derive(Serialize)]
struct Tool<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    function: Function<'a>,
}

#[derive(Serialize)]
struct Function<'a> {
    name: &'a str,
    description: &'a str,
    parameters: &'a Value,
}

/// The request body. An empty system part is left out, and so are `tools`, `tool_choice` and
/// `parallel_tool_calls` when there are no tools (OpenAI refuses an empty `tools` array and a
/// `tool_choice` without tools).
pub(crate) fn build(
    model: &str,
    max_output_tokens: u32,
    prompt: &Prompt,
    tools: &[ToolSpec],
) -> Vec<u8> {
    let mut messages = Vec::with_capacity(2);
    if !prompt.system.is_empty() {
        messages.push(Message {
            role: "system",
            content: &prompt.system,
        });
    }
    messages.push(Message {
        role: "user",
        content: &prompt.user,
    });
    let tools: Vec<Tool<'_>> = tools
        .iter()
        .map(|t| Tool {
            kind: "function",
            function: Function {
                name: &t.name,
                description: &t.description,
                parameters: &t.parameters,
            },
        })
        .collect();
    let has_tools = !tools.is_empty();
    let request = Request {
        model,
        messages,
        tools,
        tool_choice: has_tools.then_some("auto"),
        parallel_tool_calls: has_tools.then_some(true),
        max_completion_tokens: max_output_tokens,
    };
    crate::wire::to_json(&request)
}

/// The reply in `choices[0]`. Tolerant of extra fields and of what compatible servers do
/// differently:
/// - `content` may be a string, null, or an array of `{"type":"text","text":..}` parts; an empty
///   text is `None`. A `refusal` stands in for missing content.
/// - `function.arguments` is kept as the raw text the model wrote, even if it is not valid JSON;
///   servers that send it as a JSON object (Ollama, llama.cpp) get it serialised back to text; a
///   missing or null `arguments` is `"{}"` (a call without arguments).
/// - A call without an `id` gets `call_{index}`; one without a name keeps an empty name, so keel
///   refuses it as an unknown tool and tells the model, rather than losing the whole reply.
/// - A missing `usage` (or field of it) counts as zero tokens: some servers do not report usage.
pub(crate) fn parse(body: &[u8]) -> Result<ModelReply, LlmError> {
    let root: Value = serde_json::from_slice(body)
        .map_err(|e| malformed(format!("the body is not JSON ({e})"), body))?;
    if let Some(error) = root.get("error").filter(|e| !e.is_null()) {
        let message = crate::wire::error_message(error).unwrap_or_else(|| error.to_string());
        return Err(malformed(format!("the body is an error: {message}"), body));
    }
    let choice = root
        .get("choices")
        .and_then(Value::as_array)
        .and_then(|c| c.first())
        .ok_or_else(|| malformed("no `choices[0]`".to_string(), body))?;
    let message = choice
        .get("message")
        .filter(|m| m.is_object())
        .ok_or_else(|| malformed("no `choices[0].message` object".to_string(), body))?;

    let text =
        content_text(message.get("content")).or_else(|| content_text(message.get("refusal")));

    let mut calls = Vec::new();
    if let Some(list) = message.get("tool_calls").filter(|v| !v.is_null()) {
        let list = list.as_array().ok_or_else(|| {
            malformed(
                "`choices[0].message.tool_calls` is not an array".to_string(),
                body,
            )
        })?;
        for (index, call) in list.iter().enumerate() {
            calls.push(tool_call(index, call));
        }
    }

    let usage = root.get("usage");
    Ok(ModelReply {
        text,
        calls,
        usage: Usage {
            input_tokens: u64_at(usage, "prompt_tokens"),
            output_tokens: u64_at(usage, "completion_tokens"),
        },
        stop_reason: choice
            .get("finish_reason")
            .and_then(Value::as_str)
            .map(str::to_string),
    })
}

fn content_text(content: Option<&Value>) -> Option<String> {
    let text = match content? {
        Value::String(s) => s.clone(),
        Value::Array(parts) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect::<Vec<_>>()
            .join(""),
        _ => return None,
    };
    (!text.is_empty()).then_some(text)
}

fn tool_call(index: usize, call: &Value) -> ToolCall {
    let function = call.get("function");
    let id = call
        .get("id")
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty())
        .map_or_else(|| format!("call_{index}"), str::to_string);
    let name = function
        .and_then(|f| f.get("name"))
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string();
    let arguments = match function.and_then(|f| f.get("arguments")) {
        Some(Value::String(raw)) => raw.clone(),
        None | Some(Value::Null) => "{}".to_string(),
        Some(other) => other.to_string(),
    };
    ToolCall {
        id,
        name,
        arguments,
    }
}
