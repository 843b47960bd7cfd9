#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Requests sent by many threads at once share one HTTP client, built once: building one loads
//! every root certificate of the system and starts a thread. (Alone in its process, so that no
//! other test has built it first.)

use std::sync::{Arc, Barrier};
use std::time::Duration;

use keel_test_support::service::CountingService;
use keel_tools::http::{HttpPolicy, HttpRequest, HttpRule, clients_built, send};

#[test]
fn requests_sent_by_many_threads_at_once_build_one_http_client() {
    let svc = Arc::new(CountingService::start());
    assert_eq!(clients_built(), 0, "nothing has built one yet");
    let threads = 16;
    let start = Arc::new(Barrier::new(threads));
    let handles: Vec<_> = (0..threads)
        .map(|_| {
            let (start, svc) = (start.clone(), svc.clone());
            std::thread::spawn(move || {
                let policy = HttpPolicy {
                    allow: vec![HttpRule {
                        host: "127.0.0.1".into(),
                        port: Some(svc.addr().port()),
                        methods: vec!["GET".into()],
                    }],
                    max_response_bytes: 1024,
                    timeout: Duration::from_secs(30),
                };
                let request = HttpRequest {
                    method: "GET".into(),
                    url: format!("{}/status/200", svc.url()),
                    headers: Vec::new(),
                    body: None,
                };
                start.wait();
                send(&policy, &request, None).unwrap().status
            })
        })
        .collect();
    for handle in handles {
        assert_eq!(handle.join().unwrap(), 200);
    }
    assert_eq!(svc.requests().len(), threads);
    assert_eq!(
        clients_built(),
        1,
        "{threads} requests to a loopback host, sent at once, share one HTTP client"
    );
}
