//! A loopback fake model server: answers each connection with the next canned reply and records
//! every request it received, so tests assert on the exact request.

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use keel_core::agent::Reversibility;
use keel_llm::{ClientConfig, Prompt, Provider, ToolSpec};
use serde_json::{Value, json};

pub const KEY: &str = "sk-test-SECRET-0123456789";

/// A request as the server received it. Header names are lower-cased.
#[derive(Debug, Clone)]
pub struct Request {
    pub method: String,
    pub path: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Request {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap()
    }
}

/// What the server does with one connection.
pub enum Reply {
    /// Answers with this status, extra headers and body.
    Respond {
        status: u16,
        headers: Vec<(String, String)>,
        body: Vec<u8>,
    },
    /// Reads the request, then closes the connection without answering.
    Drop,
    /// Reads the request, then never answers (the connection stays open).
    Hang,
    /// Reads the request, waits this long, then answers as the inner reply does.
    Late(Duration, Box<Reply>),
}

impl Reply {
    pub fn json(status: u16, body: &str) -> Reply {
        Reply::Respond {
            status,
            headers: Vec::new(),
            body: body.as_bytes().to_vec(),
        }
    }

    pub fn with_header(self, name: &str, value: &str) -> Reply {
        match self {
            Reply::Respond {
                status,
                mut headers,
                body,
            } => {
                headers.push((name.to_string(), value.to_string()));
                Reply::Respond {
                    status,
                    headers,
                    body,
                }
            }
            other => other,
        }
    }
}

pub struct FakeServer {
    /// `http://127.0.0.1:PORT`, no trailing slash.
    pub url: String,
    requests: Arc<Mutex<Vec<Request>>>,
}

impl FakeServer {
    /// Serves `replies` in order, one per connection; after them, every connection gets a 418
    /// saying the script ran out (so a test fails loudly instead of hanging).
    pub fn start(replies: Vec<Reply>) -> FakeServer {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let requests = Arc::new(Mutex::new(Vec::new()));
        let recorded = Arc::clone(&requests);
        std::thread::spawn(move || {
            let mut replies = replies.into_iter();
            let mut hung: Vec<TcpStream> = Vec::new();
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { continue };
                let Some(request) = read_request(&mut stream) else {
                    continue;
                };
                recorded.lock().unwrap().push(request);
                let mut reply = replies.next();
                while let Some(Reply::Late(wait, inner)) = reply {
                    std::thread::sleep(wait);
                    reply = Some(*inner);
                }
                match reply {
                    Some(Reply::Late(..)) => unreachable!("unwrapped above"),
                    Some(Reply::Respond {
                        status,
                        headers,
                        body,
                    }) => respond(&mut stream, status, &headers, &body),
                    Some(Reply::Drop) => drop(stream),
                    Some(Reply::Hang) => hung.push(stream),
                    None => respond(
                        &mut stream,
                        418,
                        &[],
                        br#"{"error":{"message":"fake server: no canned reply left"}}"#,
                    ),
                }
            }
        });
        FakeServer { url, requests }
    }

    pub fn requests(&self) -> Vec<Request> {
        self.requests.lock().unwrap().clone()
    }
}

fn read_request(stream: &mut TcpStream) -> Option<Request> {
    let mut reader = BufReader::new(stream.try_clone().ok()?);
    let mut line = String::new();
    reader.read_line(&mut line).ok()?;
    let mut parts = line.split_whitespace();
    let method = parts.next()?.to_string();
    let path = parts.next()?.to_string();
    let mut headers = Vec::new();
    loop {
        let mut line = String::new();
        reader.read_line(&mut line).ok()?;
        let line = line.trim_end();
        if line.is_empty() {
            break;
        }
        let (name, value) = line.split_once(':')?;
        headers.push((name.trim().to_ascii_lowercase(), value.trim().to_string()));
    }
    let length: usize = headers
        .iter()
        .find(|(n, _)| n == "content-length")
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or(0);
    let mut body = vec![0; length];
    reader.read_exact(&mut body).ok()?;
    Some(Request {
        method,
        path,
        headers,
        body,
    })
}

fn respond(stream: &mut TcpStream, status: u16, headers: &[(String, String)], body: &[u8]) {
    let mut head = format!(
        "HTTP/1.1 {status} Canned\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n",
        body.len()
    );
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str("\r\n");
    let _ = stream.write_all(head.as_bytes());
    let _ = stream.write_all(body);
    let _ = stream.flush();
}

/// A configuration for tests: the test key, generous timeout, two retries, 100 ms–1 s backoff.
pub fn config(provider: Provider, base_url: &str) -> ClientConfig {
    ClientConfig {
        provider,
        base_url: base_url.to_string(),
        model: match provider {
            Provider::OpenAi => "gpt-4o-mini".to_string(),
            Provider::Anthropic => "claude-sonnet-4-20250514".to_string(),
        },
        api_key: Some(KEY.to_string()),
        max_output_tokens: 1024,
        timeout: Duration::from_secs(10),
        max_retries: 2,
        backoff_base: Duration::from_millis(100),
        backoff_max: Duration::from_secs(1),
    }
}

pub fn prompt() -> Prompt {
    Prompt {
        system: "You are keel's agent. Use the tools.".to_string(),
        user: "Make the failing test pass.".to_string(),
        tokens: 17,
    }
}

pub fn tools() -> Vec<ToolSpec> {
    vec![
        ToolSpec {
            name: "read".to_string(),
            description: "Read a file in the workspace.".to_string(),
            parameters: json!({
                "type": "object",
                "properties": {"path": {"type": "string"}},
                "required": ["path"],
            }),
            reversibility: Reversibility::ReadOnly,
        },
        ToolSpec {
            name: "finish".to_string(),
            description: "Claim the task done.".to_string(),
            parameters: json!({"type": "object", "properties": {}}),
            reversibility: Reversibility::Reversible,
        },
    ]
}

/// A sleeper that records the waits it was asked for and does not wait.
pub fn no_sleep(record: &mut Vec<Duration>) -> impl FnMut(Duration) + '_ {
    move |d| record.push(d)
}
