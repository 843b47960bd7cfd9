//! Bad input to keel's MCP parsers: what a server says to `tools/list` and `tools/call` goes
//! through `parse_tool`, `parse_tool_list` and `parse_call_result`, and a server may say anything.
//!
//! Each property runs 256 cases by default; set `KEEL_FUZZ_CASES` (for example
//! `KEEL_FUZZ_CASES=100000`) to run more. Nothing is written to the source tree: a failure prints
//! the smallest input it found instead of saving it.
//!
//! What is asserted, for arbitrary JSON, for arbitrary bytes and for valid server output mutated
//! in place (values swapped for wrong types, huge numbers, long strings and deep nesting; keys
//! removed and added; bytes flipped, cut and inserted):
//! - no parser panics;
//! - a parser accepts exactly what the MCP shapes allow (checked against a plain restatement of
//!   them below), so garbage is never taken for a tool or a result;
//! - what it accepts is what the server sent (names, schemas, hints, flags, texts);
//! - an error says where (`tools[3].name`, a place that exists in the input) and what is wrong.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashSet;

use base64::Engine as _;
use keel_mcp::{ParseError, base64_decoded_len, parse_call_result, parse_tool, parse_tool_list};
use keel_test_support::fuzz::{self, ByteEdit, JsonSize, apply, apply_bytes, nested};
use proptest::prelude::*;
use proptest::sample::Index;
use serde_json::{Value, json};

// ---- JSON generators and mutations ------------------------------------------------------------

/// Keys that matter to the parsers, so that random objects hit them often.
const KEYS: &[&str] = &[
    "name",
    "description",
    "inputSchema",
    "annotations",
    "readOnlyHint",
    "destructiveHint",
    "idempotentHint",
    "tools",
    "content",
    "isError",
    "structuredContent",
    "type",
    "text",
    "resource",
    "data",
    "mimeType",
];

/// `fuzz::hostile`'s values (strings up to 200,000 characters, arrays 120 deep), the extremes of
/// `i64` and of floating point, blank strings, and the names of content block types.
fn hostile() -> BoxedStrategy<Value> {
    let fixed = vec![json!(i64::MIN), json!(-0.0), json!(" ")];
    let finite = any::<f64>()
        .prop_filter("JSON has no NaN or infinity", |f| f.is_finite())
        .prop_map(Value::from);
    let blocks =
        proptest::sample::select(&["text", "image", "audio", "resource", "resource_link"][..]);
    let other = vec![finite.boxed(), blocks.prop_map(Value::from).boxed()];
    fuzz::hostile_sized(200_000, 120, fixed, other)
}

/// Arbitrary JSON of modest size.
fn any_json() -> BoxedStrategy<Value> {
    let finite = any::<f64>()
        .prop_filter("finite", |f| f.is_finite())
        .prop_map(Value::from);
    let size = JsonSize {
        depth: 5,
        branch: 8,
        items: 0..6,
        keys: 0..6,
    };
    fuzz::any_json(KEYS, finite.boxed(), size)
}

/// A structure-aware change, each kind of change equally likely.
fn edit() -> impl Strategy<Value = fuzz::Edit> {
    fuzz::edit_weighted([1, 1, 1, 1], fuzz::key(KEYS), hostile())
}

/// Bytes that mean something to a JSON reader, with closing brackets and `null`.
const TOKENS: &[&[u8]] = &[
    b"\xff",
    b"\xc3",
    b"\x00",
    b"\"\\ud800\"",
    b"1e99999",
    b"-123456789012345678901234567890",
    b"[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[",
    b",",
    b"}",
    b"]",
    b"\"",
    b"null",
];

fn byte_edit() -> BoxedStrategy<ByteEdit> {
    fuzz::byte_edit_with(TOKENS, vec![Just(ByteEdit::DuplicateFirstKey).boxed()])
}

// ---- valid server output ----------------------------------------------------------------------

fn tool_list() -> Value {
    json!({
        "tools": [
            {
                "name": "read_file",
                "description": "Read a file.",
                "inputSchema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
                "annotations": {"readOnlyHint": true, "destructiveHint": false, "idempotentHint": true}
            },
            {"name": "write_file", "inputSchema": {"type": "object"}, "annotations": {"destructiveHint": true}},
            {"name": "ns.tool-2", "description": null, "inputSchema": {}}
        ],
        "nextCursor": null
    })
}

fn call_results() -> Vec<Value> {
    vec![
        json!({"content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "world"}], "isError": false}),
        json!({"isError": true, "content": [{"type": "text", "text": "no such file"}]}),
        json!({
            "content": [
                {"type": "image", "data": "YWJj", "mimeType": "image/png"},
                {"type": "audio", "data": "YQ==", "mimeType": "audio/wav"},
                {"type": "resource", "resource": {"uri": "file:///a.txt", "text": "body"}},
                {"type": "resource", "resource": {"uri": "file:///b", "blob": "YWI=", "mimeType": "application/octet-stream"}},
                {"type": "resource_link", "uri": "file:///c", "name": "c"}
            ],
            "structuredContent": {"rows": [1, 2, 3]}
        }),
        json!({}),
    ]
}

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

fn check_all(input: &Value) {
    check_tool(input);
    check_tool_list(input);
    check_call_result(input);
    if let Some(items) = list_items(input) {
        for item in items {
            check_tool(item);
        }
    }
}

// ---- properties -------------------------------------------------------------------------------

proptest! {
    #![proptest_config(fuzz::config())]

    #[test]
    fn arbitrary_json_is_parsed_exactly_as_the_shapes_allow(v in any_json()) {
        check_all(&v);
    }

    #[test]
    fn arbitrary_bytes_never_panic_and_never_become_a_tool(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        if let Ok(v) = serde_json::from_slice::<Value>(&bytes) {
            check_all(&v);
        }
    }

    #[test]
    fn a_mutated_tool_list_is_parsed_exactly_as_the_shapes_allow(
        edits in proptest::collection::vec(edit(), 1..4),
    ) {
        let v = edits.iter().fold(tool_list(), apply);
        check_all(&v);
    }

    #[test]
    fn a_mutated_call_result_is_parsed_exactly_as_the_shapes_allow(
        which in any::<Index>(),
        edits in proptest::collection::vec(edit(), 1..4),
    ) {
        let samples = call_results();
        let sample = samples[which.index(samples.len())].clone();
        let v = edits.iter().fold(sample, apply);
        check_all(&v);
    }

    #[test]
    fn mutated_bytes_of_valid_output_are_parsed_exactly_as_the_shapes_allow(
        which in any::<Index>(),
        edits in proptest::collection::vec(byte_edit(), 1..4),
    ) {
        let mut samples = call_results();
        samples.push(tool_list());
        let sample = serde_json::to_vec(&samples[which.index(samples.len())]).unwrap();
        let bytes = edits.iter().fold(sample, apply_bytes);
        if let Ok(v) = serde_json::from_slice::<Value>(&bytes) {
            check_all(&v);
        }
    }

    #[test]
    fn the_size_of_base64_data_is_the_size_of_what_it_encodes(
        data in proptest::collection::vec(any::<u8>(), 0..300),
        padded in any::<bool>(),
        wrap in 1usize..80,
    ) {
        let engine = if padded {
            base64::engine::general_purpose::STANDARD
        } else {
            base64::engine::general_purpose::STANDARD_NO_PAD
        };
        let text = engine.encode(&data);
        // Servers wrap long base64 lines; the wrapping is not data.
        let wrapped: String = text
            .as_bytes()
            .chunks(wrap)
            .map(|c| std::str::from_utf8(c).unwrap())
            .collect::<Vec<_>>()
            .join("\n");
        prop_assert_eq!(base64_decoded_len(&text), data.len());
        prop_assert_eq!(base64_decoded_len(&wrapped), data.len());
    }
}

#[test]
fn every_valid_sample_is_accepted() {
    // The mutation properties mean something only if what they start from is valid.
    assert!(parse_tool_list(&tool_list()).is_ok());
    for sample in call_results() {
        assert!(parse_call_result(&sample).is_ok(), "{sample}");
    }
}

#[test]
fn a_tool_list_nested_past_the_json_limit_is_refused_not_a_crash() {
    let deep = format!(
        "{{\"tools\": {}{}}}",
        "[".repeat(100_000),
        "]".repeat(100_000)
    );
    // serde_json stops at its recursion limit; what reaches the parser is never that deep.
    assert!(serde_json::from_str::<Value>(&deep).is_err());
    let v = json!({"tools": [nested(100)]});
    let err = parse_tool_list(&v).unwrap_err();
    assert_eq!(err.at, "tools[0]");
}
