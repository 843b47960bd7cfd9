#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Clients made by many threads at once share one HTTP client, built once, so that every run of
//! a process draws on one pool of kept connections. (Alone in its process, so that no other
//! test has built it first.)

mod common;

use std::sync::{Arc, Barrier};

use common::config;
use keel_llm::{Client, Provider, http_clients_built};

#[test]
fn clients_made_by_many_threads_at_once_build_one_http_client() {
    assert_eq!(http_clients_built(), 0, "nothing has built one yet");
    let threads = 16;
    let start = Arc::new(Barrier::new(threads));
    let handles: Vec<_> = (0..threads)
        .map(|_| {
            let start = start.clone();
            std::thread::spawn(move || {
                start.wait();
                Client::new(config(Provider::OpenAi, "http://127.0.0.1:9/v1")).unwrap()
            })
        })
        .collect();
    for handle in handles {
        handle.join().unwrap();
    }
    assert_eq!(
        http_clients_built(),
        1,
        "{threads} clients for loopback endpoints, made at once, share one HTTP client"
    );
    Client::new(config(Provider::OpenAi, "https://api.example.com/v1")).unwrap();
    assert_eq!(
        http_clients_built(),
        2,
        "an endpoint that is not loopback has the client that follows the proxy environment"
    );
}
