//! Pure translation of MCP wire JSON (`tools/list` and `tools/call` results) into keel's types.
//!
//! The client serialises what the SDK received and runs it through these functions, so they are
//! the one code path, and they can be fuzzed or property-tested without a server.

use std::collections::HashSet;

use serde_json::{Map, Value};

use crate::{CallOutcome, McpTool};

/// What is wrong with a piece of server output. `at` says where (`tools[3].name`, `content[1]`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{at}: {problem}")]
pub struct ParseError {
    /// Where in the JSON the problem is.
    pub at: String,
    /// What is wrong there.
    pub problem: String,
}

impl ParseError {
    fn new(at: impl Into<String>, problem: impl Into<String>) -> Self {
        Self {
            at: at.into(),
            problem: problem.into(),
        }
    }
}

fn type_name(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Parse one tool definition (an element of `tools/list`'s `tools`).
///
/// `name` must be a non-empty string and `inputSchema` an object; `description` defaults to "".
/// Annotation hints that are absent or not booleans are `None` (a hint the server got wrong
/// counts as no hint).
pub fn parse_tool(json: &Value) -> Result<McpTool, ParseError> {
    parse_tool_at(json, "tool")
}

fn parse_tool_at(json: &Value, at: &str) -> Result<McpTool, ParseError> {
    let Value::Object(obj) = json else {
        return Err(ParseError::new(
            at,
            format!("a tool must be an object, not {}", type_name(json)),
        ));
    };
    let name = match obj.get("name") {
        Some(Value::String(s)) if !s.is_empty() => s.clone(),
        Some(Value::String(_)) => {
            return Err(ParseError::new(
                format!("{at}.name"),
                "the tool name is empty",
            ));
        }
        Some(other) => {
            return Err(ParseError::new(
                format!("{at}.name"),
                format!("the tool name must be a string, not {}", type_name(other)),
            ));
        }
        None => return Err(ParseError::new(at, "the tool has no `name`")),
    };
    let description = match obj.get("description") {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(other) => {
            return Err(ParseError::new(
                format!("{at}.description"),
                format!(
                    "tool `{name}`: the description must be a string, not {}",
                    type_name(other)
                ),
            ));
        }
    };
    let input_schema = match obj.get("inputSchema") {
        Some(schema @ Value::Object(_)) => schema.clone(),
        Some(other) => {
            return Err(ParseError::new(
                format!("{at}.inputSchema"),
                format!(
                    "tool `{name}`: the input schema must be a JSON Schema object, not {}",
                    type_name(other)
                ),
            ));
        }
        None => {
            return Err(ParseError::new(
                at,
                format!("tool `{name}` has no `inputSchema`"),
            ));
        }
    };
    let annotations = match obj.get("annotations") {
        Some(Value::Object(map)) => Some(map),
        _ => None,
    };
    let hint = |key: &str| {
        annotations
            .and_then(|a| a.get(key))
            .and_then(Value::as_bool)
    };
    Ok(McpTool {
        read_only_hint: hint("readOnlyHint"),
        destructive_hint: hint("destructiveHint"),
        idempotent_hint: hint("idempotentHint"),
        name,
        description,
        input_schema,
    })
}

/// Parse a `tools/list` result: either the result object (`{"tools": [...]}`) or the bare array
/// of tools. Tool names must be unique.
pub fn parse_tool_list(json: &Value) -> Result<Vec<McpTool>, ParseError> {
    let (items, at) = match json {
        Value::Array(items) => (items, ""),
        Value::Object(obj) => match obj.get("tools") {
            Some(Value::Array(items)) => (items, "tools"),
            Some(other) => {
                return Err(ParseError::new(
                    "tools",
                    format!("`tools` must be an array, not {}", type_name(other)),
                ));
            }
            None => return Err(ParseError::new("result", "the result has no `tools` array")),
        },
        other => {
            return Err(ParseError::new(
                "result",
                format!(
                    "a tool list must be an object with `tools` or an array, not {}",
                    type_name(other)
                ),
            ));
        }
    };
    let mut seen = HashSet::new();
    let mut tools = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let here = format!("{at}[{i}]");
        let tool = parse_tool_at(item, &here)?;
        if !seen.insert(tool.name.clone()) {
            return Err(ParseError::new(
                format!("{here}.name"),
                format!("the server lists the tool `{}` twice", tool.name),
            ));
        }
        tools.push(tool);
    }
    Ok(tools)
}

/// Parse a `tools/call` result (`{"content": [...], "isError": bool, "structuredContent": ...}`).
///
/// Text parts are joined with newlines; other parts are described (`[image/png, 1234 bytes]`).
/// A missing `content` is empty and a missing `isError` is false.
pub fn parse_call_result(json: &Value) -> Result<CallOutcome, ParseError> {
    let Value::Object(obj) = json else {
        return Err(ParseError::new(
            "result",
            format!("a tool result must be an object, not {}", type_name(json)),
        ));
    };
    let is_error = match obj.get("isError") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(other) => {
            return Err(ParseError::new(
                "isError",
                format!("`isError` must be a boolean, not {}", type_name(other)),
            ));
        }
    };
    let parts = match obj.get("content") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(items)) => items
            .iter()
            .enumerate()
            .map(|(i, block)| describe_content_at(block, &format!("content[{i}]")))
            .collect::<Result<Vec<_>, _>>()?,
        Some(other) => {
            return Err(ParseError::new(
                "content",
                format!("`content` must be an array, not {}", type_name(other)),
            ));
        }
    };
    Ok(CallOutcome {
        is_error,
        text: parts.join("\n"),
        structured: obj.get("structuredContent").cloned(),
    })
}

/// Render one content block as text: a text block is its text; anything else is a short
/// bracketed description (`[image/png, 1234 bytes]`, `[resource file:///a.txt]` followed by the
/// resource's text, `[resource link file:///b]`).
pub fn describe_content(block: &Value) -> Result<String, ParseError> {
    describe_content_at(block, "content")
}

fn describe_content_at(block: &Value, at: &str) -> Result<String, ParseError> {
    let Value::Object(obj) = block else {
        return Err(ParseError::new(
            at,
            format!(
                "a content block must be an object, not {}",
                type_name(block)
            ),
        ));
    };
    let str_field = |key: &str| obj.get(key).and_then(Value::as_str);
    let kind = match obj.get("type") {
        Some(Value::String(kind)) => kind.as_str(),
        _ => {
            return Err(ParseError::new(
                at,
                "the content block has no string `type`",
            ));
        }
    };
    Ok(match kind {
        "text" => match obj.get("text") {
            Some(Value::String(text)) => text.clone(),
            _ => {
                return Err(ParseError::new(
                    format!("{at}.text"),
                    "a text block needs a string `text`",
                ));
            }
        },
        "image" | "audio" => {
            let mime = str_field("mimeType").unwrap_or(kind);
            match str_field("data") {
                Some(data) => format!("[{mime}, {} bytes]", base64_decoded_len(data)),
                None => format!("[{mime}]"),
            }
        }
        "resource" => match obj.get("resource") {
            Some(Value::Object(resource)) => describe_resource(resource),
            _ => {
                return Err(ParseError::new(
                    format!("{at}.resource"),
                    "an embedded resource block needs a `resource` object",
                ));
            }
        },
        "resource_link" => match (str_field("uri"), str_field("mimeType")) {
            (Some(uri), Some(mime)) => format!("[resource link {uri}, {mime}]"),
            (Some(uri), None) => format!("[resource link {uri}]"),
            (None, _) => "[resource link]".to_owned(),
        },
        other => format!("[{other} content]"),
    })
}

fn describe_resource(resource: &Map<String, Value>) -> String {
    let uri = resource
        .get("uri")
        .and_then(Value::as_str)
        .unwrap_or("(no uri)");
    let mime = resource.get("mimeType").and_then(Value::as_str);
    if let Some(text) = resource.get("text").and_then(Value::as_str) {
        return format!("[resource {uri}]\n{text}");
    }
    let size = resource
        .get("blob")
        .and_then(Value::as_str)
        .map(base64_decoded_len);
    match (mime, size) {
        (Some(mime), Some(n)) => format!("[resource {uri}, {mime}, {n} bytes]"),
        (None, Some(n)) => format!("[resource {uri}, {n} bytes]"),
        (Some(mime), None) => format!("[resource {uri}, {mime}]"),
        (None, None) => format!("[resource {uri}]"),
    }
}

/// The number of bytes a base64 string decodes to (whitespace ignored, padding optional), without
/// decoding it.
pub fn base64_decoded_len(data: &str) -> usize {
    let significant = data
        .bytes()
        .filter(|b| !b.is_ascii_whitespace() && *b != b'=')
        .count();
    significant / 4 * 3 + (significant % 4 * 3) / 4
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;
    use serde_json::json;

    #[test]
    fn base64_lengths() {
        assert_eq!(base64_decoded_len(""), 0);
        assert_eq!(base64_decoded_len("YQ=="), 1);
        assert_eq!(base64_decoded_len("YQ"), 1);
        assert_eq!(base64_decoded_len("YWI="), 2);
        assert_eq!(base64_decoded_len("YWJj"), 3);
        assert_eq!(base64_decoded_len("YWJj\nZA=="), 4);
    }

    #[test]
    fn tool_with_annotations() {
        let tool = parse_tool(&json!({
            "name": "echo",
            "description": "Echo.",
            "inputSchema": {"type": "object"},
            "annotations": {"readOnlyHint": true, "idempotentHint": "yes"}
        }))
        .unwrap();
        assert_eq!(tool.name, "echo");
        assert_eq!(tool.description, "Echo.");
        assert_eq!(tool.input_schema, json!({"type": "object"}));
        assert_eq!(tool.read_only_hint, Some(true));
        assert_eq!(tool.destructive_hint, None);
        assert_eq!(
            tool.idempotent_hint, None,
            "a non-boolean hint counts as none"
        );
    }

    #[test]
    fn tool_list_forms_and_errors() {
        let one = json!({"name": "a", "inputSchema": {"type": "object"}});
        assert_eq!(parse_tool_list(&json!([one.clone()])).unwrap().len(), 1);
        assert_eq!(
            parse_tool_list(&json!({"tools": [one.clone()]}))
                .unwrap()
                .len(),
            1
        );
        assert_eq!(parse_tool_list(&json!({"tools": []})).unwrap().len(), 0);

        let dup = parse_tool_list(&json!({"tools": [one.clone(), one]})).unwrap_err();
        assert_eq!(dup.at, "tools[1].name");
        assert!(dup.problem.contains("`a` twice"), "{dup}");

        let no_schema = parse_tool_list(&json!({"tools": [{"name": "b"}]})).unwrap_err();
        assert_eq!(
            no_schema.to_string(),
            "tools[0]: tool `b` has no `inputSchema`"
        );

        let bad_name = parse_tool_list(&json!([{"name": 3, "inputSchema": {}}])).unwrap_err();
        assert_eq!(bad_name.at, "[0].name");

        assert!(parse_tool_list(&json!({"tools": {}})).is_err());
        assert!(parse_tool_list(&json!({})).is_err());
        assert!(parse_tool_list(&json!("x")).is_err());
    }

    #[test]
    fn call_result_text_and_other_parts() {
        let outcome = parse_call_result(&json!({
            "content": [
                {"type": "text", "text": "hello"},
                {"type": "image", "data": "YWJj", "mimeType": "image/png"},
                {"type": "audio", "data": "YQ==", "mimeType": "audio/wav"},
                {"type": "resource", "resource": {"uri": "file:///a.txt", "text": "body"}},
                {"type": "resource", "resource": {"uri": "file:///b.bin", "blob": "YWI=", "mimeType": "application/octet-stream"}},
                {"type": "resource_link", "uri": "file:///c", "name": "c"},
                {"type": "hologram"}
            ],
            "structuredContent": {"k": 1}
        }))
        .unwrap();
        assert!(!outcome.is_error);
        assert_eq!(
            outcome.text,
            "hello\n[image/png, 3 bytes]\n[audio/wav, 1 bytes]\n[resource file:///a.txt]\nbody\n\
             [resource file:///b.bin, application/octet-stream, 2 bytes]\n[resource link file:///c]\n\
             [hologram content]"
        );
        assert_eq!(outcome.structured, Some(json!({"k": 1})));
    }

    #[test]
    fn call_result_defaults_and_errors() {
        let empty = parse_call_result(&json!({})).unwrap();
        assert_eq!(
            empty,
            CallOutcome {
                is_error: false,
                text: String::new(),
                structured: None
            }
        );
        let err = parse_call_result(
            &json!({"isError": true, "content": [{"type": "text", "text": "no"}]}),
        )
        .unwrap();
        assert!(err.is_error);
        assert_eq!(err.text, "no");

        assert_eq!(
            parse_call_result(&json!({"content": [{"type": "text"}]}))
                .unwrap_err()
                .at,
            "content[0].text"
        );
        assert_eq!(
            parse_call_result(&json!({"content": [7]})).unwrap_err().at,
            "content[0]"
        );
        assert_eq!(
            parse_call_result(&json!({"isError": "yes"}))
                .unwrap_err()
                .at,
            "isError"
        );
        assert!(parse_call_result(&json!([])).is_err());
    }
}
