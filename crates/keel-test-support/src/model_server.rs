//! A loopback fake model server for the drivers' tests: it answers each connection with the next
//! canned [`Reply`] and records every [`Request`] it received, so that a test asserts on exactly
//! what was sent. Used by keel-llm's client tests and by keel-cli's end-to-end driver tests.
//!
//! One request per connection (`Connection: close`), on `127.0.0.1` at a port of its own. When
//! the replies run out it answers 418 with a message saying so, so that a test fails loudly
//! instead of hanging.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use serde_json::Value;

/// A request as the server received it. Header names are lower-cased.
#[derive(Debug, Clone)]
pub struct Request {
    pub method: String,
    pub path: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Request {
    /// The value of header `name`, given in lower case.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// The body as JSON.
    ///
    /// # Panics
    /// If the body is not JSON, showing it: the test's assertion is on a JSON request.
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "the request body is not JSON ({e}): {}",
                String::from_utf8_lossy(&self.body)
            )
        })
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
    /// Answers `status` with `body` (sent as `application/json`, whatever it holds).
    pub fn json(status: u16, body: &str) -> Reply {
        Reply::Respond {
            status,
            headers: Vec::new(),
            body: body.as_bytes().to_vec(),
        }
    }

    /// Answers `status` with `body` as JSON text.
    pub fn value(status: u16, body: Value) -> Reply {
        Reply::json(status, &body.to_string())
    }

    /// The same reply with one more header (only a reply that answers has headers).
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

/// The server. It serves until the test process ends.
pub struct FakeServer {
    /// `http://127.0.0.1:PORT`, without a trailing slash.
    pub url: String,
    requests: Arc<Mutex<Vec<Request>>>,
}

impl FakeServer {
    /// Serves `replies` in order, one per connection; after them, every connection gets a 418
    /// saying the script ran out.
    ///
    /// # Panics
    /// If no loopback port can be bound (a broken test environment).
    pub fn start(replies: Vec<Reply>) -> FakeServer {
        let listener = TcpListener::bind("127.0.0.1:0")
            .unwrap_or_else(|e| panic!("cannot start the fake model server on 127.0.0.1: {e}"));
        let url = match listener.local_addr() {
            Ok(addr) => format!("http://{addr}"),
            Err(e) => panic!("the fake model server has no address: {e}"),
        };
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
                recorded
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .push(request);
                answer(stream, replies.next(), &mut hung);
            }
        });
        FakeServer { url, requests }
    }

    /// The requests received so far, in order.
    pub fn requests(&self) -> Vec<Request> {
        self.requests
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

/// Carries out `reply` on the connection `stream` (a late one after its wait); with none left,
/// a 418 that says so. A connection left hanging is kept open in `hung`.
fn answer(mut stream: TcpStream, reply: Option<Reply>, hung: &mut Vec<TcpStream>) {
    match reply {
        Some(Reply::Late(wait, inner)) => {
            std::thread::sleep(wait);
            answer(stream, Some(*inner), hung);
        }
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
