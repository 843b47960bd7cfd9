//! The built-in tools an agent phase may use: their names, what they tell the driver, the JSON
//! Schema of their arguments, and their reversibility class. Execution lives at the edge
//! (keel-tools and keel-engine); this is the catalogue and the argument check.

use std::sync::LazyLock;

use serde_json::{Value, json};

use crate::agent::{Reversibility, ToolSpec};

/// Every built-in tool, in the order a driver is shown them.
pub const BUILTIN: [&str; 12] = [
    "read", "list", "search", "write", "patch", "run", "http", "plan", "note", "ask", "finish",
    "blocked",
];

/// The tools of an agent phase that does not list its own: every built-in one but `http`, which
/// needs `[scope] http` rules to reach anything.
pub const DEFAULT: [&str; 11] = [
    "read", "list", "search", "write", "patch", "run", "plan", "note", "ask", "finish", "blocked",
];

/// What a `blocked` call may give as its category.
pub const BLOCKED_CATEGORIES: [&str; 4] = ["contradiction", "missing_access", "ambiguity", "other"];

fn object(properties: Value, required: &[&str]) -> Value {
    json!({
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": false,
    })
}

/// The specification of a built-in tool, `None` for another name. Built once per process: a
/// step asks for its phase's tools and each call's class, and building the schemas was a tenth
/// of a read-only step's CPU.
pub fn builtin(name: &str) -> Option<&'static ToolSpec> {
    static SPECS: LazyLock<Vec<ToolSpec>> =
        LazyLock::new(|| BUILTIN.iter().filter_map(|name| build(name)).collect());
    SPECS.iter().find(|spec| spec.name == name)
}

fn build(name: &str) -> Option<ToolSpec> {
    let (description, parameters, reversibility) = match name {
        "read" => (
            "Read a text file of the workspace, with line numbers. Use offset and limit for long files.",
            object(
                json!({
                    "path": {"type": "string", "description": "workspace-relative path"},
                    "offset": {"type": "integer", "minimum": 1, "description": "first line, 1-based"},
                    "limit": {"type": "integer", "minimum": 1, "description": "how many lines"}
                }),
                &["path"],
            ),
            Reversibility::ReadOnly,
        ),
        "list" => (
            "List files and directories of the workspace (gitignore-aware).",
            object(
                json!({
                    "path": {"type": "string", "description": "directory, default the workspace root"},
                    "depth": {"type": "integer", "minimum": 1, "maximum": 8}
                }),
                &[],
            ),
            Reversibility::ReadOnly,
        ),
        "search" => (
            "Search the workspace's files with a regular expression (gitignore-aware). Returns path:line: text.",
            object(
                json!({
                    "pattern": {"type": "string", "description": "a regular expression (Rust regex syntax)"},
                    "path": {"type": "string", "description": "limit the search to this file or directory"},
                    "max_results": {"type": "integer", "minimum": 1, "maximum": 1000}
                }),
                &["pattern"],
            ),
            Reversibility::ReadOnly,
        ),
        "write" => (
            "Write a whole file (created or replaced). Only paths inside the writable scope.",
            object(
                json!({
                    "path": {"type": "string"},
                    "content": {"type": "string"}
                }),
                &["path", "content"],
            ),
            Reversibility::Reversible,
        ),
        "patch" => (
            "Apply a unified diff (git style: --- a/path, +++ b/path, @@ hunks) to one or more files. All or nothing.",
            object(json!({"diff": {"type": "string"}}), &["diff"]),
            Reversibility::Reversible,
        ),
        "run" => (
            "Run a shell command in the workspace (only commands the contract allows), with a timeout. Returns its exit status and output.",
            object(
                json!({
                    "command": {"type": "string"},
                    "timeout_seconds": {"type": "integer", "minimum": 1, "maximum": 3600}
                }),
                &["command"],
            ),
            Reversibility::Reversible,
        ),
        "http" => (
            "Send an HTTP request to a host the contract allows. GET and HEAD change nothing; other methods are external effects, sent once with an Idempotency-Key header. Returns the status, headers and the body (capped).",
            object(
                json!({
                    "method": {"type": "string", "enum": ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE"]},
                    "url": {"type": "string", "description": "http:// or https:// URL"},
                    "headers": {"type": "object", "additionalProperties": {"type": "string"}},
                    "body": {"type": "string"}
                }),
                &["method", "url"],
            ),
            Reversibility::Irreversible,
        ),
        "plan" => (
            "Replace the current plan: the steps still to do, in order. Keep it short and current.",
            object(
                json!({"items": {"type": "array", "items": {"type": "string"}, "maxItems": 50}}),
                &["items"],
            ),
            Reversibility::ReadOnly,
        ),
        "note" => (
            "Keep a short note for later steps (facts learned, decisions). Notes survive restarts.",
            object(json!({"text": {"type": "string"}}), &["text"]),
            Reversibility::ReadOnly,
        ),
        "ask" => (
            "Ask a person a question and wait for the answer (the run pauses; the answer comes back as an observation). Use it for real ambiguity only: each question counts against the approvals budget.",
            object(json!({"question": {"type": "string"}}), &["question"]),
            Reversibility::ReadOnly,
        ),
        "finish" => (
            "Claim that the phase's objective is achieved. keel then runs the verifiers; only passing evidence ends the phase.",
            object(json!({"summary": {"type": "string"}}), &["summary"]),
            Reversibility::ReadOnly,
        ),
        "blocked" => (
            "Stop: the task cannot go on without a person (contradictory requirements, missing access, ambiguity).",
            object(
                json!({
                    "category": {"type": "string", "enum": BLOCKED_CATEGORIES},
                    "reason": {"type": "string"}
                }),
                &["category", "reason"],
            ),
            Reversibility::ReadOnly,
        ),
        _ => return None,
    };
    Some(ToolSpec {
        name: name.to_string(),
        description: description.to_string(),
        parameters,
        reversibility,
    })
}

/// Checks a value against the subset of JSON Schema the built-in tools use (`type` object,
/// string, integer, boolean, array; `properties`, `required`, `additionalProperties: false`,
/// `enum`, `minimum`, `maximum`, `items`, `maxItems`). Returns every problem, each naming where.
pub fn check_arguments(schema: &Value, value: &Value) -> Vec<String> {
    let mut problems = Vec::new();
    check(schema, value, "arguments", &mut problems);
    problems
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(n) if n.is_i64() || n.is_u64() => "an integer",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn check(schema: &Value, value: &Value, at: &str, problems: &mut Vec<String>) {
    let wanted = schema.get("type").and_then(Value::as_str);
    let ok = match wanted {
        Some("object") => value.is_object(),
        Some("string") => value.is_string(),
        Some("integer") => value.is_i64() || value.is_u64(),
        Some("number") => value.is_number(),
        Some("boolean") => value.is_boolean(),
        Some("array") => value.is_array(),
        _ => true,
    };
    if !ok {
        problems.push(format!(
            "{at} must be {}, not {}",
            match wanted {
                Some("integer") => "an integer",
                Some("number") => "a number",
                Some("array") => "an array",
                Some("object") => "an object",
                Some("boolean") => "a boolean",
                _ => "a string",
            },
            type_name(value)
        ));
        return;
    }
    if let Some(choices) = schema.get("enum").and_then(Value::as_array)
        && !choices.contains(value)
    {
        let names: Vec<String> = choices.iter().map(|c| c.to_string()).collect();
        problems.push(format!("{at} must be one of {}", names.join(", ")));
    }
    if let Some(n) = value.as_i64() {
        if let Some(min) = schema.get("minimum").and_then(Value::as_i64)
            && n < min
        {
            problems.push(format!("{at} must be at least {min}"));
        }
        if let Some(max) = schema.get("maximum").and_then(Value::as_i64)
            && n > max
        {
            problems.push(format!("{at} must be at most {max}"));
        }
    }
    if let (Some(items), Some(array)) = (schema.get("items"), value.as_array()) {
        if let Some(max) = schema.get("maxItems").and_then(Value::as_u64)
            && array.len() as u64 > max
        {
            problems.push(format!("{at} has {} items; at most {max}", array.len()));
        }
        for (i, item) in array.iter().enumerate() {
            check(items, item, &format!("{at}[{i}]"), problems);
        }
    }
    if let Some(object) = value.as_object() {
        let properties = schema.get("properties").and_then(Value::as_object);
        if let Some(required) = schema.get("required").and_then(Value::as_array) {
            for name in required.iter().filter_map(Value::as_str) {
                if !object.contains_key(name) {
                    problems.push(format!("{at}.{name} is required"));
                }
            }
        }
        for (name, v) in object {
            match properties.and_then(|p| p.get(name)) {
                Some(sub) => check(sub, v, &format!("{at}.{name}"), problems),
                None if schema
                    .get("additionalProperties")
                    .is_some_and(Value::is_object) =>
                {
                    if let Some(sub) = schema.get("additionalProperties") {
                        check(sub, v, &format!("{at}.{name}"), problems);
                    }
                }
                None if schema.get("additionalProperties") == Some(&Value::Bool(false)) => {
                    let known: Vec<&str> = properties
                        .map(|p| p.keys().map(String::as_str).collect())
                        .unwrap_or_default();
                    problems.push(format!(
                        "{at}.{name} is not an argument of this tool; its arguments are {}",
                        known.join(", ")
                    ));
                }
                None => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_builtin_has_a_spec_with_an_object_schema() {
        for name in BUILTIN {
            let spec = builtin(name).unwrap();
            assert_eq!(spec.parameters["type"], "object", "{name}");
        }
        assert!(builtin("fetch").is_none());
        let http = builtin("http").unwrap();
        assert!(
            check_arguments(
                &http.parameters,
                &json!({"method": "POST", "url": "http://x", "headers": {"a": 1}})
            )
            .contains(&"arguments.headers.a must be a string, not an integer".to_string())
        );
    }

    #[test]
    fn arguments_are_checked_against_the_schema() {
        let spec = builtin("read").unwrap();
        assert!(check_arguments(&spec.parameters, &json!({"path": "a.rs"})).is_empty());
        assert_eq!(
            check_arguments(&spec.parameters, &json!({})),
            ["arguments.path is required"]
        );
        assert_eq!(
            check_arguments(&spec.parameters, &json!({"path": 3, "offset": 0})),
            [
                "arguments.offset must be at least 1",
                "arguments.path must be a string, not an integer"
            ]
        );
        let problems = check_arguments(&spec.parameters, &json!({"path": "a", "lines": 3}));
        assert!(
            problems[0].contains("arguments.lines is not an argument"),
            "{problems:?}"
        );
        let blocked = builtin("blocked").unwrap();
        let problems = check_arguments(
            &blocked.parameters,
            &json!({"category": "tired", "reason": "x"}),
        );
        assert!(problems[0].contains("must be one of"), "{problems:?}");
        let plan = builtin("plan").unwrap();
        let problems = check_arguments(&plan.parameters, &json!({"items": ["a", 2]}));
        assert_eq!(
            problems,
            ["arguments.items[1] must be a string, not an integer"]
        );
        assert_eq!(
            check_arguments(&plan.parameters, &json!("x")),
            ["arguments must be an object, not a string"]
        );
    }
}
