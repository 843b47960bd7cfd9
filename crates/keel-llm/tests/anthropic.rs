#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The Anthropic client against a loopback fake server.

mod common;

use common::{KEY, config, prompt, tools};
use keel_llm::{Client, LlmError, Provider, ToolCall, Usage};
use keel_test_support::model_server::{FakeServer, Reply};
use serde_json::json;

fn client(server: &FakeServer) -> Client {
    Client::new(config(Provider::Anthropic, &server.url)).unwrap()
}

const TOOL_USE: &str = r#"{
  "id": "msg_01", "type": "message", "role": "assistant", "model": "claude-sonnet-4-20250514",
  "content": [
    {"type": "text", "text": "I'll read both files."},
    {"type": "tool_use", "id": "toolu_a", "name": "read", "input": {"path": "src/lib.rs"}},
    {"type": "tool_use", "id": "toolu_b", "name": "read", "input": {"path": "Cargo.toml"}}
  ],
  "stop_reason": "tool_use", "stop_sequence": null,
  "usage": {"input_tokens": 1200, "output_tokens": 88, "service_tier": "standard"}
}"#;

#[test]
fn request_body_and_headers_are_exactly_as_specified() {
    let server = FakeServer::start(vec![Reply::json(200, TOOL_USE)]);
    let client = client(&server);
    let body = client.build_request(&prompt(), &tools());
    let exchange = client.send(&body, &mut |_| {}).unwrap();
    assert_eq!(exchange.status, 200);
    assert_eq!(exchange.attempts, 1);

    let requests = server.requests();
    assert_eq!(requests.len(), 1);
    let request = &requests[0];
    assert_eq!(request.method, "POST");
    assert_eq!(request.path, "/v1/messages");
    assert_eq!(request.header("x-api-key"), Some(KEY));
    assert_eq!(request.header("anthropic-version"), Some("2023-06-01"));
    assert_eq!(request.header("content-type"), Some("application/json"));
    assert_eq!(request.header("authorization"), None);
    assert_eq!(request.body, body);
    assert!(!String::from_utf8_lossy(&request.body).contains(KEY));
    assert_eq!(
        request.json(),
        json!({
            "model": "claude-sonnet-4-20250514",
            "max_tokens": 1024,
            "system": "You are keel's agent. Use the tools.",
            "messages": [{"role": "user", "content": "Make the failing test pass."}],
            "tools": [
                {"name": "read", "description": "Read a file in the workspace.",
                 "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}},
                {"name": "finish", "description": "Claim the task done.",
                 "input_schema": {"type": "object", "properties": {}}}
            ]
        })
    );
    assert_eq!(
        body,
        client.build_request(&prompt(), &tools()),
        "deterministic"
    );
}

#[test]
fn a_base_url_ending_in_v1_reaches_the_same_endpoint() {
    let server = FakeServer::start(vec![Reply::json(200, TOOL_USE)]);
    let client = Client::new(config(Provider::Anthropic, &format!("{}/v1/", server.url))).unwrap();
    client.send(b"{}", &mut |_| {}).unwrap();
    assert_eq!(server.requests()[0].path, "/v1/messages");
}

#[test]
fn text_and_parallel_tool_uses_are_parsed() {
    let server = FakeServer::start(vec![]);
    let reply = client(&server).parse(TOOL_USE.as_bytes()).unwrap();
    assert_eq!(reply.text.as_deref(), Some("I'll read both files."));
    assert_eq!(
        reply.calls,
        vec![
            ToolCall {
                id: "toolu_a".into(),
                name: "read".into(),
                arguments: r#"{"path":"src/lib.rs"}"#.into()
            },
            ToolCall {
                id: "toolu_b".into(),
                name: "read".into(),
                arguments: r#"{"path":"Cargo.toml"}"#.into()
            },
        ]
    );
    assert_eq!(
        reply.usage,
        Usage {
            input_tokens: 1200,
            output_tokens: 88
        }
    );
    assert_eq!(reply.stop_reason.as_deref(), Some("tool_use"));
}

#[test]
fn text_only_reply_with_thinking_and_cache_usage() {
    let body = r#"{"type":"message","content":[
        {"type":"thinking","thinking":"hmm","signature":"s"},
        {"type":"text","text":"First part."},{"type":"text","text":"Second part."}],
      "stop_reason":"end_turn",
      "usage":{"input_tokens":10,"cache_creation_input_tokens":100,"cache_read_input_tokens":1000,"output_tokens":5}}"#;
    let server = FakeServer::start(vec![]);
    let reply = client(&server).parse(body.as_bytes()).unwrap();
    assert_eq!(reply.text.as_deref(), Some("First part.\nSecond part."));
    assert!(reply.calls.is_empty());
    assert_eq!(reply.stop_reason.as_deref(), Some("end_turn"));
    assert_eq!(reply.usage.input_tokens, 1110);
    assert_eq!(reply.usage.output_tokens, 5);
}

#[test]
fn missing_usage_and_input_are_tolerated() {
    let body = r#"{"content":[{"type":"tool_use","id":"t1","name":"finish"}]}"#;
    let server = FakeServer::start(vec![]);
    let reply = client(&server).parse(body.as_bytes()).unwrap();
    assert_eq!(reply.calls[0].arguments, "{}");
    assert_eq!(reply.usage, Usage::default());
    assert_eq!(reply.stop_reason, None);
    assert_eq!(reply.text, None);
}

#[test]
fn malformed_bodies() {
    let server = FakeServer::start(vec![]);
    let client = client(&server);
    for (body, says) in [
        ("not json at all", "not JSON"),
        (r#"{"type":"message"}"#, "content"),
        (
            r#"{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}"#,
            "Overloaded",
        ),
    ] {
        match client.parse(body.as_bytes()) {
            Err(LlmError::Malformed { message, excerpt }) => {
                assert!(message.contains(says), "{message} should say {says}");
                assert_eq!(excerpt, body);
            }
            other => panic!("expected Malformed for {body}, got {other:?}"),
        }
    }
}

#[test]
fn bad_key_is_rejected_without_retry() {
    let error = r#"{"type":"error","error":{"type":"authentication_error","message":"invalid x-api-key"},"request_id":"req_1"}"#;
    let server = FakeServer::start(vec![Reply::json(401, error), Reply::json(200, TOOL_USE)]);
    let client = client(&server);
    match client.send(&client.build_request(&prompt(), &tools()), &mut |_| {}) {
        Err(LlmError::Rejected { status, message }) => {
            assert_eq!(status, 401);
            assert!(message.contains("invalid x-api-key"), "{message}");
            assert!(message.contains("Check the API key"), "{message}");
            assert!(!message.contains(KEY));
        }
        other => panic!("expected Rejected, got {other:?}"),
    }
    assert_eq!(server.requests().len(), 1);
}

#[test]
fn unknown_model_is_rejected() {
    let error =
        r#"{"type":"error","error":{"type":"not_found_error","message":"model: claude-9"}}"#;
    let server = FakeServer::start(vec![Reply::json(404, error)]);
    let client = client(&server);
    match client.send(b"{}", &mut |_| {}) {
        Err(LlmError::Rejected {
            status: 404,
            message,
        }) => {
            assert!(message.contains("model: claude-9"), "{message}")
        }
        other => panic!("expected Rejected, got {other:?}"),
    }
    assert_eq!(server.requests().len(), 1);
}

#[test]
fn overloaded_529_is_retried() {
    let overloaded =
        r#"{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}"#;
    let server = FakeServer::start(vec![
        Reply::json(529, overloaded),
        Reply::json(200, TOOL_USE),
    ]);
    let client = client(&server);
    let exchange = client.send(b"{}", &mut |_| {}).unwrap();
    assert_eq!(exchange.attempts, 2);
    assert_eq!(exchange.retries, vec!["529 Overloaded".to_string()]);
}
