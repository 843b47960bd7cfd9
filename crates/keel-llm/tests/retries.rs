#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Retries and backoff, with a recording sleeper so nothing actually waits.

mod common;

use std::time::Duration;

use common::{config, no_sleep};
use keel_llm::{Client, LlmError, Provider};
use keel_test_support::model_server::{FakeServer, Reply};

const OK: &str = r#"{"choices":[{"message":{"role":"assistant","content":"done"},"finish_reason":"stop"}],
  "usage":{"prompt_tokens":3,"completion_tokens":1}}"#;
const RATE_LIMITED: &str = r#"{"error":{"message":"Rate limit reached for gpt-4o-mini","type":"requests","code":"rate_limit_exceeded"}}"#;

fn client(server: &FakeServer) -> Client {
    Client::new(config(Provider::OpenAi, &format!("{}/v1", server.url))).unwrap()
}

#[test]
fn a_429_then_200_is_retried_once_within_the_jitter_bounds() {
    let server = FakeServer::start(vec![Reply::json(429, RATE_LIMITED), Reply::json(200, OK)]);
    let client = client(&server);
    let mut sleeps = Vec::new();
    let exchange = client
        .send(b"{\"same\":1}", &mut no_sleep(&mut sleeps))
        .unwrap();
    assert_eq!(exchange.status, 200);
    assert_eq!(exchange.attempts, 2);
    assert_eq!(exchange.retries, vec!["429 Too Many Requests".to_string()]);
    assert_eq!(sleeps.len(), 1);
    assert!(sleeps[0] <= Duration::from_millis(100), "{:?}", sleeps[0]);
    let requests = server.requests();
    assert_eq!(requests.len(), 2);
    assert_eq!(
        requests[0].body, requests[1].body,
        "the same bytes are re-sent"
    );
    assert_eq!(
        client.parse(&exchange.body).unwrap().text.as_deref(),
        Some("done")
    );
}

#[test]
fn retry_after_overrides_the_backoff_up_to_its_cap() {
    let server = FakeServer::start(vec![
        Reply::json(429, RATE_LIMITED).with_header("retry-after", "7"),
        Reply::json(503, "").with_header("retry-after", "0.5"),
        Reply::json(200, OK),
    ]);
    let client = client(&server);
    let mut sleeps = Vec::new();
    let exchange = client.send(b"{}", &mut no_sleep(&mut sleeps)).unwrap();
    assert_eq!(exchange.attempts, 3);
    // Retry-After wins over the backoff, but never beyond backoff_max (1 s here).
    assert_eq!(
        sleeps,
        vec![Duration::from_secs(1), Duration::from_millis(500)]
    );
}

#[test]
fn retry_after_ms_is_honoured() {
    let server = FakeServer::start(vec![
        Reply::json(429, RATE_LIMITED).with_header("retry-after-ms", "250"),
        Reply::json(200, OK),
    ]);
    let mut sleeps = Vec::new();
    client(&server)
        .send(b"{}", &mut no_sleep(&mut sleeps))
        .unwrap();
    assert_eq!(sleeps, vec![Duration::from_millis(250)]);
}

#[test]
fn server_errors_and_a_dropped_connection_are_retried() {
    let server = FakeServer::start(vec![
        Reply::json(500, r#"{"error":{"message":"The server had an error"}}"#),
        Reply::json(503, "Service Unavailable"),
        Reply::Drop,
        Reply::json(200, OK),
    ]);
    let mut cfg = config(Provider::OpenAi, &format!("{}/v1", server.url));
    cfg.max_retries = 3;
    let client = Client::new(cfg).unwrap();
    let mut sleeps = Vec::new();
    let exchange = client.send(b"{}", &mut no_sleep(&mut sleeps)).unwrap();
    assert_eq!(exchange.attempts, 4);
    assert_eq!(exchange.retries.len(), 3);
    assert_eq!(exchange.retries[0], "500 Internal Server Error");
    assert_eq!(exchange.retries[1], "503 Service Unavailable");
    assert!(
        exchange.retries[2].starts_with("connection error"),
        "{}",
        exchange.retries[2]
    );
    assert_eq!(server.requests().len(), 4);
    // Exponential with full jitter: retry n waits at most min(max, base * 2^n).
    assert_eq!(sleeps.len(), 3);
    for (n, sleep) in sleeps.iter().enumerate() {
        let ceiling = Duration::from_millis(100 * (1 << n)).min(Duration::from_secs(1));
        assert!(*sleep <= ceiling, "retry {n} slept {sleep:?} > {ceiling:?}");
    }
}

#[test]
fn exhausted_retries_report_the_attempts_and_the_last_failure() {
    let server = FakeServer::start(vec![
        Reply::json(429, RATE_LIMITED),
        Reply::json(429, RATE_LIMITED),
        Reply::json(502, r#"{"error":{"message":"bad gateway upstream"}}"#),
        Reply::json(200, OK),
    ]);
    let client = client(&server); // max_retries = 2
    let mut sleeps = Vec::new();
    match client.send(b"{}", &mut no_sleep(&mut sleeps)) {
        Err(LlmError::Exhausted { attempts, last }) => {
            assert_eq!(attempts, 3);
            assert!(last.starts_with("502 Bad Gateway"), "{last}");
            assert!(last.contains("bad gateway upstream"), "{last}");
            assert!(last.contains("/v1/chat/completions"), "{last}");
        }
        other => panic!("expected Exhausted, got {other:?}"),
    }
    assert_eq!(server.requests().len(), 3);
    assert_eq!(sleeps.len(), 2, "no wait after the last attempt");
}

#[test]
fn no_retries_configured_means_one_attempt() {
    let server = FakeServer::start(vec![Reply::json(500, "{}"), Reply::json(200, OK)]);
    let mut cfg = config(Provider::OpenAi, &format!("{}/v1", server.url));
    cfg.max_retries = 0;
    let client = Client::new(cfg).unwrap();
    match client.send(b"{}", &mut |_| panic!("must not sleep")) {
        Err(LlmError::Exhausted { attempts: 1, .. }) => {}
        other => panic!("expected Exhausted after 1 attempt, got {other:?}"),
    }
    assert_eq!(server.requests().len(), 1);
}

#[test]
fn timeouts_are_retried() {
    let server = FakeServer::start(vec![Reply::Hang, Reply::Hang]);
    let mut cfg = config(Provider::OpenAi, &format!("{}/v1", server.url));
    cfg.timeout = Duration::from_millis(300);
    cfg.max_retries = 1;
    let client = Client::new(cfg).unwrap();
    let mut sleeps = Vec::new();
    match client.send(b"{}", &mut no_sleep(&mut sleeps)) {
        Err(LlmError::Exhausted { attempts, last }) => {
            assert_eq!(attempts, 2);
            assert!(last.starts_with("timeout"), "{last}");
        }
        other => panic!("expected Exhausted, got {other:?}"),
    }
    assert_eq!(sleeps.len(), 1);
}

#[test]
fn a_timeout_then_success_records_the_timeout() {
    let server = FakeServer::start(vec![Reply::Hang, Reply::json(200, OK)]);
    let mut cfg = config(Provider::OpenAi, &format!("{}/v1", server.url));
    cfg.timeout = Duration::from_millis(300);
    let client = Client::new(cfg).unwrap();
    let exchange = client.send(b"{}", &mut |_| {}).unwrap();
    assert_eq!(exchange.attempts, 2);
    assert_eq!(exchange.retries, vec!["timeout".to_string()]);
}

/// Every client of a process sends through one shared HTTP client; each must still wait as
/// long as its own configuration says, whichever was built first.
#[test]
fn clients_of_one_process_keep_their_own_timeouts() {
    let late = || Reply::Late(Duration::from_millis(800), Box::new(Reply::json(200, OK)));
    let short_server = FakeServer::start(vec![late()]);
    let long_server = FakeServer::start(vec![late()]);
    let mut short = config(Provider::OpenAi, &format!("{}/v1", short_server.url));
    short.timeout = Duration::from_millis(200);
    short.max_retries = 0;
    let short = Client::new(short).unwrap();
    let long = Client::new(config(Provider::OpenAi, &format!("{}/v1", long_server.url))).unwrap();

    let exchange = long.send(b"{}", &mut |_| {}).unwrap();
    assert_eq!((exchange.status, exchange.attempts), (200, 1));
    match short.send(b"{}", &mut |_| panic!("must not sleep")) {
        Err(LlmError::Exhausted { attempts: 1, last }) => {
            assert!(last.starts_with("timeout"), "{last}")
        }
        other => panic!("expected a timeout, got {other:?}"),
    }
}

#[test]
fn connection_refused_is_retried_then_exhausted() {
    // A port nothing listens on: bind, note the port, close.
    let port = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().port()
    };
    let client = Client::new(config(
        Provider::Anthropic,
        &format!("http://127.0.0.1:{port}"),
    ))
    .unwrap();
    let mut sleeps = Vec::new();
    match client.send(b"{}", &mut no_sleep(&mut sleeps)) {
        Err(LlmError::Exhausted { attempts, last }) => {
            assert_eq!(attempts, 3);
            assert!(last.contains("could not connect"), "{last}");
            assert!(
                last.contains(&format!("127.0.0.1:{port}/v1/messages")),
                "{last}"
            );
        }
        other => panic!("expected Exhausted, got {other:?}"),
    }
    assert_eq!(sleeps.len(), 2);
}

/// An https endpoint builds the TLS client (the system's certificates, the build's crypto
/// provider) and fails its handshake with a server that does not speak TLS: a connection
/// error, retried and reported, never a panic.
#[test]
fn an_https_endpoint_that_does_not_speak_tls_is_a_connection_error() {
    let server = FakeServer::start(vec![Reply::json(200, OK), Reply::json(200, OK)]);
    let url = server.url.replace("http://", "https://");
    let mut cfg = config(Provider::OpenAi, &format!("{url}/v1"));
    cfg.max_retries = 1;
    let client = Client::new(cfg).unwrap();
    match client.send(b"{}", &mut |_| {}) {
        Err(LlmError::Exhausted { attempts: 2, last }) => {
            assert!(last.starts_with("connection error"), "{last}");
            assert!(last.contains("https://"), "{last}");
        }
        other => panic!("expected Exhausted, got {other:?}"),
    }
}
