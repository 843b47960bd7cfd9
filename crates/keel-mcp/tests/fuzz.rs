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
//!   them in `keel_test_support::oracle::mcp`), so garbage is never taken for a tool or a result;
//! - what it accepts is what the server sent (names, schemas, hints, flags, texts);
//! - an error says where (`tools[3].name`, a place that exists in the input) and what is wrong.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use base64::Engine as _;
use keel_mcp::{base64_decoded_len, parse_call_result, parse_tool_list};
use keel_test_support::fuzz::{self, ByteEdit, JsonSize, apply, apply_bytes, nested};
use keel_test_support::oracle::mcp::check_all;
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
