#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The `http` tool against a loopback service: only allowed requests leave, redirects are not
//! followed, bodies are capped, and the idempotency key travels with every write.

use std::time::Duration;

use keel_test_support::service::CountingService;
use keel_tools::http::{HttpDenied, HttpError, HttpPolicy, HttpRequest, HttpRule, check, send};

fn policy(service: &CountingService, methods: &[&str]) -> HttpPolicy {
    HttpPolicy {
        allow: vec![HttpRule {
            host: "127.0.0.1".into(),
            port: Some(service.addr().port()),
            methods: methods.iter().map(|m| (*m).to_owned()).collect(),
        }],
        max_response_bytes: 64 * 1024,
        timeout: Duration::from_secs(30),
    }
}

fn req(method: &str, url: String) -> HttpRequest {
    HttpRequest {
        method: method.into(),
        url,
        headers: Vec::new(),
        body: None,
    }
}

#[test]
fn allowed_get_is_sent() {
    let svc = CountingService::start();
    let p = policy(&svc, &["GET"]);
    let mut r = req("GET", format!("{}/status/200", svc.url()));
    r.headers.push(("X-Trace".into(), "t-1".into()));
    let resp = send(&p, &r, Some("ignored-on-get")).unwrap();
    assert_eq!(resp.status, 200);
    assert_eq!(resp.body, b"status 200\n");
    assert!(!resp.truncated);
    assert_eq!(resp.header("content-type"), Some("text/plain"));
    let seen = svc.requests();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].method, "GET");
    assert_eq!(seen[0].path, "/status/200");
    assert_eq!(seen[0].header("x-trace"), Some("t-1"));
    // No idempotency key on a GET.
    assert_eq!(seen[0].header("idempotency-key"), None);
}

#[test]
fn post_is_denied_when_only_get_is_allowed_and_nothing_is_sent() {
    let svc = CountingService::start();
    let p = policy(&svc, &["GET"]);
    let mut r = req("POST", format!("{}/apply", svc.url()));
    r.body = Some("payload".into());
    let denied = check(&p, &r).unwrap_err();
    let port = svc.addr().port();
    assert_eq!(
        denied.to_string(),
        format!(
            "POST to 127.0.0.1:{port} is not allowed: the contract allows GET on 127.0.0.1:{port}"
        )
    );
    let err = send(&p, &r, Some("k1")).unwrap_err();
    assert!(
        matches!(err, HttpError::Denied(HttpDenied::NotAllowed { .. })),
        "{err}"
    );
    // A GET afterwards is the only thing the service ever saw.
    send(&p, &req("GET", format!("{}/status/204", svc.url())), None).unwrap();
    let seen = svc.requests();
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert_eq!(seen[0].method, "GET");
    assert!(svc.applications().is_empty());
    assert_eq!(svc.unkeyed(), 0);
}

#[test]
fn idempotency_key_arrives_on_post_and_a_repeat_is_not_applied_twice() {
    let svc = CountingService::start();
    let p = policy(&svc, &["POST"]);
    let mut r = req("POST", format!("{}/apply", svc.url()));
    r.headers
        .push(("Content-Type".into(), "application/json".into()));
    r.body = Some(r#"{"amount": 5}"#.into());
    let first = send(&p, &r, Some("run-1/step-3/call-0")).unwrap();
    let again = send(&p, &r, Some("run-1/step-3/call-0")).unwrap();
    assert_eq!(first.status, 200);
    assert_eq!(again.status, 200);
    assert_eq!(first.body, again.body);
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    let seen = svc.requests();
    assert_eq!(
        seen[0].header("idempotency-key"),
        Some("run-1/step-3/call-0")
    );
    assert_eq!(seen[0].body, r#"{"amount": 5}"#);
    assert_eq!(svc.applications().get("run-1/step-3/call-0"), Some(&1));
    assert_eq!(svc.deliveries().get("run-1/step-3/call-0"), Some(&2));
    // Without a key nothing is added.
    send(&p, &r, None).unwrap();
    assert_eq!(svc.unkeyed(), 1);
    assert_eq!(svc.requests()[2].header("idempotency-key"), None);
}

#[test]
fn a_redirect_is_returned_not_followed() {
    let svc = CountingService::start();
    let p = policy(&svc, &["GET", "POST"]);
    let resp = send(&p, &req("GET", format!("{}/redirect", svc.url())), None).unwrap();
    assert_eq!(resp.status, 302);
    assert_eq!(resp.header("location"), Some("/apply"));
    let seen = svc.requests();
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert_eq!(seen[0].path, "/redirect");
}

#[test]
fn a_large_response_is_truncated_at_the_cap() {
    let svc = CountingService::start();
    let mut p = policy(&svc, &["GET"]);
    p.max_response_bytes = 1000;
    let big = send(
        &p,
        &req("GET", format!("{}/big?n=5000000", svc.url())),
        None,
    )
    .unwrap();
    assert_eq!(big.status, 200);
    assert_eq!(big.body.len(), 1000);
    assert!(big.truncated);
    // Exactly at the cap is not truncated.
    let exact = send(&p, &req("GET", format!("{}/big?n=1000", svc.url())), None).unwrap();
    assert_eq!(exact.body.len(), 1000);
    assert!(!exact.truncated);
}

#[test]
fn wrong_host_and_userinfo_are_refused_before_anything_is_sent() {
    let svc = CountingService::start();
    let p = policy(&svc, &["GET", "POST"]);
    let port = svc.addr().port();
    // Same service, but under a host name the rule does not name.
    let err = send(
        &p,
        &req("GET", format!("http://localhost:{port}/status/200")),
        None,
    )
    .unwrap_err();
    assert!(
        err.to_string()
            .starts_with(&format!("GET to localhost:{port} is not allowed")),
        "{err}"
    );
    let err = send(
        &p,
        &req(
            "GET",
            format!("http://user:hunter2@127.0.0.1:{port}/status/200"),
        ),
        None,
    )
    .unwrap_err();
    assert!(
        matches!(err, HttpError::Denied(HttpDenied::Userinfo)),
        "{err}"
    );
    assert!(!err.to_string().contains("hunter2"));
    let mut r = req("POST", format!("{}/apply", svc.url()));
    r.headers.push(("Idempotency-Key".into(), "mine".into()));
    assert!(matches!(
        send(&p, &r, None),
        Err(HttpError::Denied(HttpDenied::ReservedHeader { .. }))
    ));
    assert!(svc.requests().is_empty());
}

#[test]
fn a_refused_connection_is_a_request_error_without_the_url() {
    // A port nothing listens on (bound, then released).
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let free = listener.local_addr().unwrap().port();
    drop(listener);
    let p = HttpPolicy {
        allow: vec![HttpRule {
            host: "127.0.0.1".into(),
            port: Some(free),
            methods: vec!["GET".into()],
        }],
        max_response_bytes: 10,
        timeout: Duration::from_secs(10),
    };
    let url = format!("http://127.0.0.1:{free}/x?token=abc123secret");
    match send(&p, &req("GET", url), None) {
        Err(HttpError::Request { message, host, .. }) => {
            assert_eq!(host, format!("127.0.0.1:{free}"));
            assert!(!message.contains("abc123secret"), "{message}");
        }
        other => panic!("expected a request error, got {other:?}"),
    }
}
