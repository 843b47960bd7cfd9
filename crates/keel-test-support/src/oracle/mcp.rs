//! keel's MCP parsers' oracle: what `parse_tool`, `parse_tool_list` and `parse_call_result` must
//! do with whatever a server says. Shared by keel-mcp's property tests (`tests/fuzz.rs`) and the
//! coverage-guided fuzz target `mcp` (`fuzz/`):
//! - a parser accepts exactly what the MCP shapes allow (checked against a plain restatement of
//!   them below), so garbage is never taken for a tool or a result;
//! - what it accepts is what the server sent (names, schemas, hints, flags, texts);
//! - an error says where (`tools[3].name`, a place that exists in the input) and what is wrong.
//!
//! Each check panics with what it found, as a test's assertion does.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashSet;

use keel_mcp::{ParseError, parse_call_result, parse_tool, parse_tool_list};
use serde_json::Value;

// ---- what the MCP shapes allow, restated ------------------------------------------------------

/// A tool: an object with a non-empty string `name`, an object `inputSchema`, and a `description`
/// that is a string, null or absent.
fn is_valid_tool(v: &Value) -> bool {
    let Some(obj) = v.as_object() else {
        return false;
    };
    obj.get("name")
        .and_then(Value::as_str)
        .is_some_and(|n| !n.is_empty())
        && obj.get("inputSchema").is_some_and(Value::is_object)
        && obj
            .get("description")
            .is_none_or(|d| d.is_null() || d.is_string())
}

fn list_items(v: &Value) -> Option<&Vec<Value>> {
    match v {
        Value::Array(items) => Some(items),
        Value::Object(obj) => obj.get("tools").and_then(Value::as_array),
        _ => None,
    }
}

fn is_valid_tool_list(v: &Value) -> bool {
    let Some(items) = list_items(v) else {
        return false;
    };
    let mut names = HashSet::new();
    items
        .iter()
        .all(|t| is_valid_tool(t) && names.insert(t["name"].as_str().unwrap_or_default()))
}

fn is_valid_block(b: &Value) -> bool {
    let Some(obj) = b.as_object() else {
        return false;
    };
    match obj.get("type").and_then(Value::as_str) {
        None => false,
        Some("text") => obj.get("text").is_some_and(Value::is_string),
        Some("resource") => obj.get("resource").is_some_and(Value::is_object),
        Some(_) => true,
    }
}

fn is_valid_call_result(v: &Value) -> bool {
    let Some(obj) = v.as_object() else {
        return false;
    };
    obj.get("isError")
        .is_none_or(|e| e.is_null() || e.is_boolean())
        && match obj.get("content") {
            None | Some(Value::Null) => true,
            Some(Value::Array(blocks)) => blocks.iter().all(is_valid_block),
            Some(_) => false,
        }
}

// ---- checks -----------------------------------------------------------------------------------

/// `at` names a place in `input`: the node itself, or (for a required key that is missing) the
/// object that lacks it. `root` is what the parser calls the whole input.
fn assert_points_into(input: &Value, err: &ParseError, root: &str) {
    assert!(
        !err.problem.trim().is_empty(),
        "an error without a problem: {err:?}"
    );
    assert!(
        !err.at.trim().is_empty(),
        "an error without a place: {err:?}"
    );
    let path = err
        .at
        .strip_prefix(root)
        .or_else(|| err.at.strip_prefix("result"))
        .unwrap_or(&err.at);
    // `tools[3].name` → ["tools", 3, "name"]; `[0]` → [0].
    let mut node = Some(input);
    let mut parent_is_object = false;
    for part in path.split('.').filter(|p| !p.is_empty()) {
        let (name, rest) = part.split_once('[').unwrap_or((part, ""));
        if !name.is_empty() {
            parent_is_object = node.is_some_and(Value::is_object);
            node = node.and_then(|n| n.get(name));
        }
        for index in rest.split('[').filter(|s| !s.is_empty()) {
            let i: usize = index.trim_end_matches(']').parse().unwrap_or_else(|_| {
                panic!("`{}` has an index that is not a number", err.at);
            });
            parent_is_object = false;
            node = node.and_then(|n| n.get(i));
        }
    }
    assert!(
        node.is_some() || parent_is_object,
        "the error names `{}`, which is not in the input: {err}\ninput: {input}",
        err.at
    );
}

fn check_tool(input: &Value) {
    match parse_tool(input) {
        Ok(tool) => {
            assert!(
                is_valid_tool(input),
                "accepted a tool that is not one: {input}"
            );
            assert_eq!(tool.name, input["name"].as_str().unwrap());
            assert_eq!(tool.input_schema, input["inputSchema"]);
            assert_eq!(
                tool.description,
                input["description"].as_str().unwrap_or_default()
            );
            let hint = |k: &str| input["annotations"].get(k).and_then(Value::as_bool);
            let annotated = input.get("annotations").is_some_and(Value::is_object);
            let hint = |k: &str| if annotated { hint(k) } else { None };
            assert_eq!(tool.read_only_hint, hint("readOnlyHint"));
            assert_eq!(tool.destructive_hint, hint("destructiveHint"));
            assert_eq!(tool.idempotent_hint, hint("idempotentHint"));
        }
        Err(err) => {
            assert!(
                !is_valid_tool(input),
                "refused a valid tool ({err}): {input}"
            );
            assert_points_into(input, &err, "tool");
        }
    }
}

fn check_tool_list(input: &Value) {
    match parse_tool_list(input) {
        Ok(tools) => {
            assert!(
                is_valid_tool_list(input),
                "accepted a tool list that is not one: {input}"
            );
            let items = list_items(input).unwrap();
            assert_eq!(tools.len(), items.len());
            for (tool, item) in tools.iter().zip(items) {
                assert_eq!(Ok(tool.clone()), parse_tool(item));
            }
        }
        Err(err) => {
            assert!(
                !is_valid_tool_list(input),
                "refused a valid tool list ({err}): {input}"
            );
            assert_points_into(input, &err, "result");
        }
    }
}

fn check_call_result(input: &Value) {
    match parse_call_result(input) {
        Ok(outcome) => {
            assert!(
                is_valid_call_result(input),
                "accepted a call result that is not one: {input}"
            );
            assert_eq!(
                outcome.is_error,
                input["isError"].as_bool().unwrap_or(false)
            );
            assert_eq!(outcome.structured.as_ref(), input.get("structuredContent"));
            let blocks = input["content"].as_array().cloned().unwrap_or_default();
            for block in &blocks {
                if let Some(text) = block["text"].as_str().filter(|_| block["type"] == "text") {
                    assert!(
                        outcome.text.contains(text),
                        "the text {text:?} of a block is lost: {:?}",
                        outcome.text
                    );
                }
            }
            if blocks.iter().all(|b| b["type"] == "text") {
                let joined: Vec<&str> =
                    blocks.iter().map(|b| b["text"].as_str().unwrap()).collect();
                assert_eq!(outcome.text, joined.join("\n"));
            }
        }
        Err(err) => {
            assert!(
                !is_valid_call_result(input),
                "refused a valid call result ({err}): {input}"
            );
            assert_points_into(input, &err, "result");
        }
    }
}

/// Reads `input` as a tool, a `tools/list` answer and a `tools/call` result (and each item of a
/// list as a tool), and checks each parse against what the MCP shapes allow.
pub fn check_all(input: &Value) {
    check_tool(input);
    check_tool_list(input);
    check_call_result(input);
    if let Some(items) = list_items(input) {
        for item in items {
            check_tool(item);
        }
    }
}
