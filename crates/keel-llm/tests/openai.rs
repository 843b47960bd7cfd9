#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The OpenAI-compatible client against a loopback fake server: the exact request, and replies
//! as OpenAI, Ollama and llama.cpp write them.

mod common;

use common::{KEY, config, no_sleep, prompt, tools};
use keel_llm::{Client, LlmError, Provider, ToolCall, Usage};
use keel_test_support::model_server::{FakeServer, Reply};
use serde_json::json;

fn client(server: &FakeServer) -> Client {
    Client::new(config(Provider::OpenAi, &format!("{}/v1", server.url))).unwrap()
}

const TOOL_CALLS: &str = r#"{
  "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "gpt-4o-mini",
  "system_fingerprint": "fp_x",
  "choices": [{
    "index": 0,
    "message": {
      "role": "assistant", "content": null, "refusal": null, "annotations": [],
      "tool_calls": [
        {"id": "call_a", "type": "function", "function": {"name": "read", "arguments": "{\"path\":\"src/lib.rs\"}"}},
        {"id": "call_b", "type": "function", "function": {"name": "read", "arguments": "{\"path\": \"Cargo.toml\"}"}},
        {"id": "call_c", "type": "function", "function": {"name": "finish", "arguments": "{}"}}
      ]
    },
    "logprobs": null, "finish_reason": "tool_calls"
  }],
  "usage": {"prompt_tokens": 812, "completion_tokens": 64, "total_tokens": 876,
            "prompt_tokens_details": {"cached_tokens": 0}}
}"#;

#[test]
fn request_body_and_headers_are_exactly_as_specified() {
    let server = FakeServer::start(vec![Reply::json(200, TOOL_CALLS)]);
    let client = client(&server);
    let body = client.build_request(&prompt(), &tools());
    let mut sleeps = Vec::new();
    let exchange = client.send(&body, &mut no_sleep(&mut sleeps)).unwrap();
    assert_eq!(exchange.status, 200);
    assert_eq!(exchange.attempts, 1);
    assert!(exchange.retries.is_empty());
    assert!(sleeps.is_empty());

    let requests = server.requests();
    assert_eq!(requests.len(), 1);
    let request = &requests[0];
    assert_eq!(request.method, "POST");
    assert_eq!(request.path, "/v1/chat/completions");
    assert_eq!(
        request.header("authorization"),
        Some(format!("Bearer {KEY}").as_str())
    );
    assert_eq!(request.header("content-type"), Some("application/json"));
    assert_eq!(request.header("x-api-key"), None);
    assert_eq!(
        request.body, body,
        "send must send the built bytes unchanged"
    );
    assert!(!String::from_utf8_lossy(&request.body).contains(KEY));
    assert_eq!(
        request.json(),
        json!({
            "model": "gpt-4o-mini",
            "messages": [
                {"role": "system", "content": "You are keel's agent. Use the tools."},
                {"role": "user", "content": "Make the failing test pass."}
            ],
            "tools": [
                {"type": "function", "function": {
                    "name": "read",
                    "description": "Read a file in the workspace.",
                    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}
                }},
                {"type": "function", "function": {
                    "name": "finish",
                    "description": "Claim the task done.",
                    "parameters": {"type": "object", "properties": {}}
                }}
            ],
            "tool_choice": "auto",
            "parallel_tool_calls": true,
            "max_completion_tokens": 1024
        })
    );
}

#[test]
fn build_request_is_deterministic() {
    let server = FakeServer::start(vec![]);
    let client = client(&server);
    let first = client.build_request(&prompt(), &tools());
    let second = client.build_request(&prompt(), &tools());
    assert_eq!(first, second);
    // The model is the first field, for a reader of stored bodies.
    assert!(first.starts_with(br#"{"model":"gpt-4o-mini","messages":"#));
}

#[test]
fn without_tools_the_tool_fields_are_left_out() {
    let server = FakeServer::start(vec![]);
    let client = client(&server);
    let mut p = prompt();
    p.system.clear();
    let body: serde_json::Value = serde_json::from_slice(&client.build_request(&p, &[])).unwrap();
    assert_eq!(
        body,
        json!({
            "model": "gpt-4o-mini",
            "messages": [{"role": "user", "content": "Make the failing test pass."}],
            "max_completion_tokens": 1024
        })
    );
}

#[test]
fn no_key_sends_no_authorization_and_trailing_slash_is_tolerated() {
    let server = FakeServer::start(vec![Reply::json(200, TOOL_CALLS)]);
    let mut cfg = config(Provider::OpenAi, &format!("{}/v1/", server.url));
    cfg.api_key = None;
    let client = Client::new(cfg).unwrap();
    let body = client.build_request(&prompt(), &tools());
    client.send(&body, &mut |_| {}).unwrap();
    let request = &server.requests()[0];
    assert_eq!(request.path, "/v1/chat/completions");
    assert_eq!(request.header("authorization"), None);
}

#[test]
fn parallel_tool_calls_and_usage_are_parsed() {
    let server = FakeServer::start(vec![]);
    let reply = client(&server).parse(TOOL_CALLS.as_bytes()).unwrap();
    assert_eq!(reply.text, None);
    assert_eq!(
        reply.calls,
        vec![
            ToolCall {
                id: "call_a".into(),
                name: "read".into(),
                arguments: r#"{"path":"src/lib.rs"}"#.into()
            },
            ToolCall {
                id: "call_b".into(),
                name: "read".into(),
                arguments: r#"{"path": "Cargo.toml"}"#.into()
            },
            ToolCall {
                id: "call_c".into(),
                name: "finish".into(),
                arguments: "{}".into()
            },
        ]
    );
    assert_eq!(
        reply.usage,
        Usage {
            input_tokens: 812,
            output_tokens: 64
        }
    );
    assert_eq!(reply.stop_reason.as_deref(), Some("tool_calls"));
}

#[test]
fn arguments_as_an_object_are_serialised_back_to_text() {
    // Ollama and llama.cpp write `arguments` as a JSON object, and may leave out the id.
    let body = r#"{"model":"llama3.1:8b","created_at":"x","choices":[{"index":0,"message":{"role":"assistant","content":"",
      "tool_calls":[{"function":{"name":"read","arguments":{"path":"a.txt"}}},
                    {"id":"x2","function":{"name":"finish"}}]},"finish_reason":"tool_calls"}],
      "usage":{"prompt_tokens":10,"completion_tokens":5}}"#;
    let server = FakeServer::start(vec![]);
    let reply = client(&server).parse(body.as_bytes()).unwrap();
    assert_eq!(reply.text, None, "empty content is no text");
    assert_eq!(reply.calls.len(), 2);
    assert_eq!(reply.calls[0].id, "call_0");
    assert_eq!(reply.calls[0].name, "read");
    assert_eq!(reply.calls[0].arguments, r#"{"path":"a.txt"}"#);
    assert_eq!(reply.calls[1].id, "x2");
    assert_eq!(
        reply.calls[1].arguments, "{}",
        "missing arguments mean none"
    );
}

#[test]
fn invalid_json_arguments_are_kept_raw() {
    let body = r#"{"choices":[{"message":{"role":"assistant","tool_calls":[
      {"id":"c1","type":"function","function":{"name":"read","arguments":"{\"path\": \"src/lib.rs\", "}}]},
      "finish_reason":"tool_calls"}]}"#;
    let server = FakeServer::start(vec![]);
    let reply = client(&server).parse(body.as_bytes()).unwrap();
    assert_eq!(reply.calls[0].arguments, r#"{"path": "src/lib.rs", "#);
    // No usage reported: zeros.
    assert_eq!(reply.usage, Usage::default());
}

#[test]
fn text_only_reply() {
    let body = r#"{"choices":[{"index":0,"message":{"role":"assistant","content":"I need more context."},
      "finish_reason":"stop"}],"usage":{"prompt_tokens":100,"completion_tokens":7,"total_tokens":107}}"#;
    let server = FakeServer::start(vec![]);
    let reply = client(&server).parse(body.as_bytes()).unwrap();
    assert_eq!(reply.text.as_deref(), Some("I need more context."));
    assert!(reply.calls.is_empty());
    assert_eq!(reply.stop_reason.as_deref(), Some("stop"));
    assert_eq!(reply.usage.input_tokens, 100);
    assert_eq!(reply.usage.output_tokens, 7);
}

#[test]
fn garbage_after_200_is_malformed() {
    let server = FakeServer::start(vec![Reply::json(200, "<html>502 Bad Gateway</html>")]);
    let client = client(&server);
    let exchange = client
        .send(&client.build_request(&prompt(), &tools()), &mut |_| {})
        .unwrap();
    match client.parse(&exchange.body) {
        Err(LlmError::Malformed { message, excerpt }) => {
            assert!(message.contains("not JSON"), "{message}");
            assert_eq!(excerpt, "<html>502 Bad Gateway</html>");
        }
        other => panic!("expected Malformed, got {other:?}"),
    }
    for (body, missing) in [
        (r#"{"id":"x"}"#, "choices[0]"),
        (r#"{"choices":[]}"#, "choices[0]"),
        (
            r#"{"choices":[{"finish_reason":"stop"}]}"#,
            "choices[0].message",
        ),
        (
            r#"{"error":{"message":"upstream failed"}}"#,
            "upstream failed",
        ),
    ] {
        match client.parse(body.as_bytes()) {
            Err(LlmError::Malformed { message, .. }) => {
                assert!(
                    message.contains(missing),
                    "{message} should mention {missing}"
                )
            }
            other => panic!("expected Malformed for {body}, got {other:?}"),
        }
    }
}

#[test]
fn a_long_garbage_body_is_excerpted() {
    let server = FakeServer::start(vec![]);
    let body = "x".repeat(5000);
    match client(&server).parse(body.as_bytes()) {
        Err(LlmError::Malformed { excerpt, .. }) => {
            assert!(excerpt.len() <= 304, "{}", excerpt.len());
            assert!(excerpt.ends_with('…'));
        }
        other => panic!("expected Malformed, got {other:?}"),
    }
}

#[test]
fn bad_key_is_rejected_without_retry() {
    let error = r#"{"error":{"message":"Incorrect API key provided: sk-test-***6789. You can find your API key at https://platform.openai.com/account/api-keys.","type":"invalid_request_error","param":null,"code":"invalid_api_key"}}"#;
    let server = FakeServer::start(vec![Reply::json(401, error), Reply::json(200, TOOL_CALLS)]);
    let client = client(&server);
    let mut sleeps = Vec::new();
    let result = client.send(
        &client.build_request(&prompt(), &tools()),
        &mut no_sleep(&mut sleeps),
    );
    match result {
        Err(LlmError::Rejected { status, message }) => {
            assert_eq!(status, 401);
            assert!(message.contains("Incorrect API key provided"), "{message}");
            assert!(message.contains("Check the API key"), "{message}");
            assert!(message.contains("/v1/chat/completions"), "{message}");
            assert!(!message.contains(KEY));
        }
        other => panic!("expected Rejected, got {other:?}"),
    }
    assert_eq!(server.requests().len(), 1, "a 401 is not retried");
    assert!(sleeps.is_empty());
}

#[test]
fn unknown_model_is_rejected() {
    let error = r#"{"error":{"message":"The model `gpt-9` does not exist or you do not have access to it.","type":"invalid_request_error","param":null,"code":"model_not_found"}}"#;
    let server = FakeServer::start(vec![Reply::json(404, error)]);
    let client = client(&server);
    match client.send(&client.build_request(&prompt(), &tools()), &mut |_| {}) {
        Err(LlmError::Rejected { status, message }) => {
            assert_eq!(status, 404);
            assert!(
                message.contains("The model `gpt-9` does not exist"),
                "{message}"
            );
            assert!(
                message.contains("Check the model name \"gpt-4o-mini\""),
                "{message}"
            );
        }
        other => panic!("expected Rejected, got {other:?}"),
    }
    assert_eq!(server.requests().len(), 1);
}

#[test]
fn ollama_string_errors_are_read() {
    let server = FakeServer::start(vec![Reply::json(
        404,
        r#"{"error":"model \"qwen3:99b\" not found, try pulling it first"}"#,
    )]);
    let client = client(&server);
    match client.send(b"{}", &mut |_| {}) {
        Err(LlmError::Rejected {
            status: 404,
            message,
        }) => {
            assert!(message.contains("try pulling it first"), "{message}")
        }
        other => panic!("expected Rejected, got {other:?}"),
    }
}

#[test]
fn out_of_quota_429_is_rejected_not_retried() {
    let error = r#"{"error":{"message":"You exceeded your current quota, please check your plan and billing details.","type":"insufficient_quota","param":null,"code":"insufficient_quota"}}"#;
    let server = FakeServer::start(vec![Reply::json(429, error), Reply::json(200, TOOL_CALLS)]);
    let client = client(&server);
    match client.send(b"{}", &mut |_| {}) {
        Err(LlmError::Rejected { status, message }) => {
            assert_eq!(status, 429);
            assert!(message.contains("exceeded your current quota"), "{message}");
            assert!(message.contains("out of credit"), "{message}");
        }
        other => panic!("expected Rejected, got {other:?}"),
    }
    assert_eq!(server.requests().len(), 1);
}

#[test]
fn a_key_echoed_by_a_server_is_scrubbed_from_errors() {
    let error = format!(r#"{{"error":{{"message":"key {KEY} is not valid"}}}}"#);
    let server = FakeServer::start(vec![Reply::json(403, &error)]);
    let client = client(&server);
    let err = client.send(b"{}", &mut |_| {}).unwrap_err();
    let shown = format!("{err} {err:?}");
    assert!(!shown.contains(KEY), "{shown}");
    assert!(shown.contains("key [redacted] is not valid"), "{shown}");
}

#[test]
fn a_redirect_is_not_followed_and_the_error_says_where_it_points() {
    // A second server the redirect points at: it must never see the request (it would carry
    // the key to another host).
    let elsewhere = FakeServer::start(vec![Reply::json(200, TOOL_CALLS)]);
    let server = FakeServer::start(vec![Reply::json(307, "").with_header(
        "location",
        &format!("{}/v2/chat/completions?token=abc", elsewhere.url),
    )]);
    let client = client(&server);
    match client.send(b"{}", &mut |_| panic!("a redirect is not retried")) {
        Err(LlmError::Rejected { status, message }) => {
            assert_eq!(status, 307);
            assert!(
                message.contains("set base_url to the final address"),
                "{message}"
            );
            assert!(
                message.contains(&format!("{}/v2/chat/completions", elsewhere.url)),
                "{message}"
            );
            assert!(
                !message.contains("token=abc"),
                "the query is not shown: {message}"
            );
        }
        other => panic!("expected Rejected, got {other:?}"),
    }
    assert_eq!(server.requests().len(), 1);
    assert!(elsewhere.requests().is_empty(), "the redirect was followed");
}
