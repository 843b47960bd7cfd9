//! Fixtures for keel-server's tests: a git workspace with a run stopped at an approval gate (or
//! waiting for an answer; keel-test-support's `workspace`), a server in this process on a free
//! loopback port, and a small HTTP client that returns the status and the JSON body.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::path::Path;

use serde_json::Value;

pub const TOKEN: &str = "test-token-0123456789abcdef";

pub use keel_test_support::workspace::Workspace;

/// A keel server in this process, on a free loopback port, stopped when dropped.
pub struct Server {
    pub addr: SocketAddr,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Server {
    pub fn start(store: &Path) -> Server {
        let state = keel_server::AppState::new(store, TOKEN).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async move {
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
                tx.send(listener.local_addr().unwrap()).unwrap();
                keel_server::serve_on(listener, state, async {
                    let _ = stopped.await;
                })
                .await
                .unwrap();
            });
        });
        let addr = rx.recv().expect("the server starts");
        Server {
            addr,
            shutdown: Some(stop),
            thread: Some(thread),
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(stop) = self.shutdown.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// What came back: the status, the body as JSON (or as a string when it is not JSON), and the
/// headers.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub body: Value,
    pub text: String,
    pub headers: reqwest::header::HeaderMap,
}

impl Reply {
    pub fn error(&self) -> &str {
        self.body["error"]
            .as_str()
            .unwrap_or_else(|| panic!("expected an error body, got {} {}", self.status, self.text))
    }
}

pub fn client() -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder()
        .timeout(std::time::Duration::from_secs(60))
        .build()
        .unwrap()
}

/// Sends a request with `token` (none: no Authorization header) and `body` (raw text).
pub fn send(
    server: &Server,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<&str>,
) -> Reply {
    let method = reqwest::Method::from_bytes(method.as_bytes()).unwrap();
    let mut request = client().request(method, server.url(path));
    if let Some(t) = token {
        request = request.header("Authorization", format!("Bearer {t}"));
    }
    if let Some(b) = body {
        request = request
            .header("Content-Type", "application/json")
            .body(b.to_string());
    }
    let response = request.send().unwrap();
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let text = response.text().unwrap();
    let body = serde_json::from_str(&text).unwrap_or(Value::String(text.clone()));
    Reply {
        status,
        body,
        text,
        headers,
    }
}

pub fn get(server: &Server, path: &str) -> Reply {
    send(server, "GET", path, Some(TOKEN), None)
}

pub fn post(server: &Server, path: &str, body: &Value) -> Reply {
    send(server, "POST", path, Some(TOKEN), Some(&body.to_string()))
}
