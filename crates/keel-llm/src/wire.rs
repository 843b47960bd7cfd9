//! Small helpers shared by the two wire formats.

use serde::Serialize;
use serde_json::Value;

use crate::error::{EXCERPT_BYTES, LlmError, excerpt};

/// Serialises a request. It cannot fail for the request types here — every map key is a string
/// and no `Serialize` impl returns an error — so an error would only mean an empty body, which
/// the server refuses as a bad request, rather than a panic.
pub(crate) fn to_json<T: Serialize>(value: &T) -> Vec<u8> {
    serde_json::to_vec(value).unwrap_or_default()
}

pub(crate) fn malformed(message: String, body: &[u8]) -> LlmError {
    LlmError::Malformed {
        message,
        excerpt: excerpt(body, EXCERPT_BYTES),
    }
}

/// A non-negative integer field of an optional object; anything else counts as 0.
pub(crate) fn u64_at(object: Option<&Value>, field: &str) -> u64 {
    object
        .and_then(|o| o.get(field))
        .and_then(Value::as_u64)
        .unwrap_or(0)
}

/// The message inside an `error` value: `{"message": ..}` (OpenAI and Anthropic) or a plain
/// string (Ollama).
pub(crate) fn error_message(error: &Value) -> Option<String> {
    match error {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("message").and_then(Value::as_str).map(str::to_string),
        _ => None,
    }
}

/// The provider's message in an error body, for both providers' shapes:
/// `{"error":{"message":..}}` and `{"type":"error","error":{"message":..}}`, plus servers that
/// put a string in `error` or a top-level `message`/`detail`. `None` if there is none.
pub(crate) fn provider_message(body: &[u8]) -> Option<String> {
    let root: Value = serde_json::from_slice(body).ok()?;
    root.get("error")
        .and_then(error_message)
        .or_else(|| {
            root.get("message")
                .and_then(Value::as_str)
                .map(str::to_string)
        })
        .or_else(|| {
            root.get("detail")
                .and_then(Value::as_str)
                .map(str::to_string)
        })
        .filter(|m| !m.trim().is_empty())
}

/// The provider's error code or type (`insufficient_quota`, `rate_limit_error`, …), if any.
pub(crate) fn provider_code(body: &[u8]) -> Option<String> {
    let root: Value = serde_json::from_slice(body).ok()?;
    let error = root.get("error")?;
    error
        .get("code")
        .and_then(Value::as_str)
        .or_else(|| error.get("type").and_then(Value::as_str))
        .map(str::to_string)
}
