//! A fake external service on loopback that counts applications per idempotency key.
//!
//! [`CountingService::start`] listens on `127.0.0.1:0` and serves each connection on its own
//! thread (HTTP/1.1, one request per connection, `Connection: close`). Its state lives in the
//! test process, so a test can drive it from another process (the `keel` binary) and still read
//! the counts. A client that dies mid-request (SIGKILL) only breaks its own connection: an
//! incomplete request is dropped without effect, a complete one is applied even if the response
//! cannot be written.
//!
//! Routes:
//! - `POST /apply`: applies the request under its idempotency key (the `Idempotency-Key` header,
//!   else a `key` query parameter). A key already applied is not applied again: the first
//!   response is returned again with `Idempotent-Replayed: true`. Without a key the request is
//!   applied and counted in [`CountingService::unkeyed`]. The response body is JSON:
//!   `{"application": N, "key": "..."}` where `N` numbers applications from 1.
//! - `GET /redirect`: `302` to `/apply`.
//! - `GET /big?n=BYTES`: `200` with `BYTES` bytes of `x`.
//! - `GET /status/CODE`: that status, with a short text body.
//! - `POST /v1/messages`: a model (the Anthropic Messages API's path) whose answers the test
//!   gives with [`CountingService::answer_model`]; `404` until it does.
//! - anything else: `404` (`405` for `/apply` with another method).

use std::collections::BTreeMap;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread;
use std::time::Duration;

/// Largest request head (request line and headers) the service reads.
const MAX_HEAD: usize = 64 * 1024;
/// Largest request body the service reads.
const MAX_BODY: usize = 16 * 1024 * 1024;

/// One request the service received in full.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recorded {
    /// The method, as sent (e.g. `POST`).
    pub method: String,
    /// The request target as sent, query included (e.g. `/apply?key=k1`).
    pub path: String,
    /// The headers, names as sent, in order.
    pub headers: Vec<(String, String)>,
    /// The body (lossily decoded as UTF-8).
    pub body: String,
}

impl Recorded {
    /// The first value of header `name` (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// How the model route answers a request: a status and a JSON body.
pub type ModelAnswer = Arc<dyn Fn(&Recorded) -> (u16, String) + Send + Sync>;

#[derive(Default)]
struct State {
    model: Option<ModelAnswer>,
    applications: BTreeMap<String, u32>,
    deliveries: BTreeMap<String, u32>,
    unkeyed: u32,
    applied_total: u32,
    requests: Vec<Recorded>,
    /// The first response body per key, replayed for repeats.
    responses: BTreeMap<String, String>,
}

/// The fake service. Stops accepting connections when dropped.
pub struct CountingService {
    addr: SocketAddr,
    state: Arc<Mutex<State>>,
    stop: Arc<AtomicBool>,
}

impl CountingService {
    /// Starts the service on `127.0.0.1` on a free port.
    ///
    /// # Panics
    /// If no loopback port can be bound (a broken test environment); see
    /// [`CountingService::try_start`].
    pub fn start() -> CountingService {
        match Self::try_start() {
            Ok(service) => service,
            Err(e) => panic!("cannot start the counting service on 127.0.0.1: {e}"),
        }
    }

    /// Starts the service on `127.0.0.1` on a free port.
    pub fn try_start() -> io::Result<CountingService> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        let state = Arc::new(Mutex::new(State::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let (state2, stop2) = (Arc::clone(&state), Arc::clone(&stop));
        thread::spawn(move || {
            for conn in listener.incoming() {
                if stop2.load(Ordering::SeqCst) {
                    break;
                }
                let Ok(stream) = conn else { continue };
                let state = Arc::clone(&state2);
                thread::spawn(move || {
                    // Errors only concern this connection (a client gone, a bad request).
                    let _ = serve(stream, &state);
                });
            }
        });
        Ok(CountingService { addr, state, stop })
    }

    /// The base URL, `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The address the service listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// How many times each idempotency key was applied (at most once per key).
    pub fn applications(&self) -> BTreeMap<String, u32> {
        lock(&self.state).applications.clone()
    }

    /// How many times each idempotency key was delivered (applied or replayed).
    pub fn deliveries(&self) -> BTreeMap<String, u32> {
        lock(&self.state).deliveries.clone()
    }

    /// How many applications came without any idempotency key.
    pub fn unkeyed(&self) -> u32 {
        lock(&self.state).unkeyed
    }

    /// Serves `POST /v1/messages` with `answer` from now on. It is called without the service's
    /// lock held, on the connection's own thread, so it may keep state of its own.
    pub fn answer_model(
        &self,
        answer: impl Fn(&Recorded) -> (u16, String) + Send + Sync + 'static,
    ) {
        lock(&self.state).model = Some(Arc::new(answer));
    }

    /// Every request received in full, in order of arrival.
    pub fn requests(&self) -> Vec<Recorded> {
        lock(&self.state).requests.clone()
    }
}

impl Drop for CountingService {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the accept loop so it sees the flag.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
    }
}

/// Locks the state; a panicked connection thread does not poison it for the test.
fn lock(state: &Mutex<State>) -> MutexGuard<'_, State> {
    state.lock().unwrap_or_else(|e| e.into_inner())
}

struct Response {
    status: u16,
    headers: Vec<(String, String)>,
    body: Body,
}

enum Body {
    Text(String),
    /// `n` bytes of `x`, written in pieces.
    Filler(u64),
}

impl Response {
    fn text(status: u16, body: impl Into<String>) -> Self {
        Response {
            status,
            headers: vec![("Content-Type".into(), "text/plain".into())],
            body: Body::Text(body.into()),
        }
    }
}

fn serve(stream: TcpStream, state: &Mutex<State>) -> io::Result<()> {
    stream.set_read_timeout(Some(Duration::from_secs(30)))?;
    let mut reader = BufReader::new(stream.try_clone()?);
    let Some(request) = read_request(&mut reader)? else {
        return Ok(());
    };
    let response = respond(&request, state);
    write_response(stream, &response)
}

/// Reads one request; `None` if the connection closed before a complete request arrived.
fn read_request(reader: &mut BufReader<TcpStream>) -> io::Result<Option<Recorded>> {
    let mut head_len = 0;
    let mut line = String::new();
    let n = reader.read_line(&mut line)?;
    if n == 0 || !line.ends_with('\n') {
        return Ok(None);
    }
    head_len += n;
    let mut parts = line.split_whitespace();
    let (Some(method), Some(path)) = (parts.next(), parts.next()) else {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "bad request line",
        ));
    };
    let (method, path) = (method.to_owned(), path.to_owned());
    let mut headers = Vec::new();
    loop {
        let mut h = String::new();
        let n = reader.read_line(&mut h)?;
        if n == 0 || !h.ends_with('\n') {
            return Ok(None);
        }
        head_len += n;
        if head_len > MAX_HEAD {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "head too large"));
        }
        let h = h.trim_end_matches(['\r', '\n']);
        if h.is_empty() {
            break;
        }
        if let Some((name, value)) = h.split_once(':') {
            headers.push((name.trim().to_owned(), value.trim().to_owned()));
        }
    }
    let header = |name: &str| {
        headers
            .iter()
            .find(|(n, _): &&(String, String)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.clone())
    };
    let body = if header("transfer-encoding").is_some_and(|v| v.eq_ignore_ascii_case("chunked")) {
        match read_chunked(reader)? {
            Some(body) => body,
            None => return Ok(None),
        }
    } else {
        let len: usize = header("content-length")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        if len > MAX_BODY {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "body too large"));
        }
        let mut body = vec![0; len];
        if reader.read_exact(&mut body).is_err() {
            return Ok(None);
        }
        body
    };
    Ok(Some(Recorded {
        method,
        path,
        headers,
        body: String::from_utf8_lossy(&body).into_owned(),
    }))
}

fn read_chunked(reader: &mut BufReader<TcpStream>) -> io::Result<Option<Vec<u8>>> {
    let mut body = Vec::new();
    loop {
        let mut size_line = String::new();
        if reader.read_line(&mut size_line)? == 0 {
            return Ok(None);
        }
        let size_hex = size_line.trim().split(';').next().unwrap_or("");
        let size = usize::from_str_radix(size_hex, 16)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "bad chunk size"))?;
        if body.len() + size > MAX_BODY {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "body too large"));
        }
        if size == 0 {
            // Trailers, up to the empty line.
            loop {
                let mut t = String::new();
                if reader.read_line(&mut t)? == 0 || t.trim().is_empty() {
                    return Ok(Some(body));
                }
            }
        }
        let start = body.len();
        body.resize(start + size, 0);
        if reader.read_exact(&mut body[start..]).is_err() {
            return Ok(None);
        }
        let mut crlf = String::new();
        reader.read_line(&mut crlf)?;
    }
}

fn query_param(path: &str, name: &str) -> Option<String> {
    let (_, query) = path.split_once('?')?;
    query.split('&').find_map(|pair| {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        (k == name).then(|| v.to_owned())
    })
}

fn respond(request: &Recorded, state: &Mutex<State>) -> Response {
    let mut st = lock(state);
    st.requests.push(request.clone());
    let route = request.path.split('?').next().unwrap_or("");
    match (request.method.as_str(), route) {
        ("POST", "/v1/messages") => match st.model.clone() {
            Some(answer) => {
                drop(st);
                let (status, body) = answer(request);
                let mut r = json_response(body);
                r.status = status;
                r
            }
            None => Response::text(404, "no model here: the test gave no answers\n"),
        },
        ("POST", "/apply") => {
            let key = request
                .header("idempotency-key")
                .map(str::to_owned)
                .or_else(|| query_param(&request.path, "key"))
                .filter(|k| !k.is_empty());
            match key {
                None => {
                    st.unkeyed += 1;
                    let body = apply(&mut st, None);
                    json_response(body)
                }
                Some(key) => {
                    *st.deliveries.entry(key.clone()).or_insert(0) += 1;
                    if let Some(first) = st.responses.get(&key) {
                        let mut r = json_response(first.clone());
                        r.headers
                            .push(("Idempotent-Replayed".into(), "true".into()));
                        return r;
                    }
                    *st.applications.entry(key.clone()).or_insert(0) += 1;
                    let body = apply(&mut st, Some(&key));
                    st.responses.insert(key, body.clone());
                    json_response(body)
                }
            }
        }
        (_, "/apply") => Response::text(405, "method not allowed\n"),
        ("GET", "/redirect") => {
            let mut r = Response::text(302, "see /apply\n");
            r.headers.push(("Location".into(), "/apply".into()));
            r
        }
        ("GET", "/big") => {
            let n = query_param(&request.path, "n")
                .and_then(|n| n.parse().ok())
                .unwrap_or(0);
            Response {
                status: 200,
                headers: vec![("Content-Type".into(), "application/octet-stream".into())],
                body: Body::Filler(n),
            }
        }
        ("GET", r) if r.starts_with("/status/") => match r["/status/".len()..].parse::<u16>() {
            Ok(code) if (100..1000).contains(&code) => {
                Response::text(code, format!("status {code}\n"))
            }
            _ => Response::text(400, "bad status code\n"),
        },
        _ => Response::text(404, "not found\n"),
    }
}

/// Numbers one more application and returns its response body.
fn apply(st: &mut State, key: Option<&str>) -> String {
    st.applied_total += 1;
    serde_json::json!({ "application": st.applied_total, "key": key }).to_string()
}

fn json_response(body: String) -> Response {
    Response {
        status: 200,
        headers: vec![("Content-Type".into(), "application/json".into())],
        body: Body::Text(body),
    }
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        201 => "Created",
        204 => "No Content",
        301 => "Moved Permanently",
        302 => "Found",
        304 => "Not Modified",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        409 => "Conflict",
        429 => "Too Many Requests",
        500 => "Internal Server Error",
        502 => "Bad Gateway",
        503 => "Service Unavailable",
        _ => "Status",
    }
}

fn write_response(mut stream: TcpStream, response: &Response) -> io::Result<()> {
    let len = match &response.body {
        Body::Text(t) => t.len() as u64,
        Body::Filler(n) => *n,
    };
    let no_body = response.status == 204 || response.status == 304 || response.status < 200;
    let mut head = format!(
        "HTTP/1.1 {} {}\r\n",
        response.status,
        reason(response.status)
    );
    for (name, value) in &response.headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    if !no_body {
        head.push_str(&format!("Content-Length: {len}\r\n"));
    }
    head.push_str("Connection: close\r\n\r\n");
    stream.write_all(head.as_bytes())?;
    if !no_body {
        match &response.body {
            Body::Text(t) => stream.write_all(t.as_bytes())?,
            Body::Filler(n) => {
                let chunk = [b'x'; 8192];
                let mut left = *n;
                while left > 0 {
                    let k = left.min(chunk.len() as u64) as usize;
                    stream.write_all(&chunk[..k])?;
                    left -= k as u64;
                }
            }
        }
    }
    stream.flush()?;
    let _ = stream.shutdown(std::net::Shutdown::Write);
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    /// Sends `request` raw and returns (status, head, body).
    fn raw(service: &CountingService, request: &str) -> (u16, String, Vec<u8>) {
        let mut s = TcpStream::connect(service.addr()).unwrap();
        s.write_all(request.as_bytes()).unwrap();
        let mut out = Vec::new();
        s.read_to_end(&mut out).unwrap();
        let split = out.windows(4).position(|w| w == b"\r\n\r\n").unwrap();
        let head = String::from_utf8(out[..split].to_vec()).unwrap();
        let status = head.split(' ').nth(1).unwrap().parse().unwrap();
        (status, head, out[split + 4..].to_vec())
    }

    fn post(service: &CountingService, target: &str, key: Option<&str>) -> (u16, String, Vec<u8>) {
        let key = key.map_or(String::new(), |k| format!("Idempotency-Key: {k}\r\n"));
        raw(
            service,
            &format!("POST {target} HTTP/1.1\r\nHost: x\r\n{key}Content-Length: 5\r\n\r\nhello"),
        )
    }

    #[test]
    fn keyed_applications_are_applied_once_and_replayed() {
        let svc = CountingService::start();
        let (s1, h1, b1) = post(&svc, "/apply", Some("k1"));
        let (s2, h2, b2) = post(&svc, "/apply", Some("k1"));
        let (_, _, b3) = post(&svc, "/apply?key=k2", None);
        assert_eq!((s1, s2), (200, 200));
        assert!(!h1.contains("Idempotent-Replayed"));
        assert!(h2.contains("Idempotent-Replayed: true"));
        assert_eq!(b1, b2);
        let v: serde_json::Value = serde_json::from_slice(&b1).unwrap();
        assert_eq!(v["application"], 1);
        assert_eq!(v["key"], "k1");
        let v3: serde_json::Value = serde_json::from_slice(&b3).unwrap();
        assert_eq!(v3["application"], 2);
        assert_eq!(
            svc.applications(),
            BTreeMap::from([("k1".into(), 1), ("k2".into(), 1)])
        );
        assert_eq!(
            svc.deliveries(),
            BTreeMap::from([("k1".into(), 2), ("k2".into(), 1)])
        );
        assert_eq!(svc.unkeyed(), 0);
        let reqs = svc.requests();
        assert_eq!(reqs.len(), 3);
        assert_eq!(reqs[0].method, "POST");
        assert_eq!(reqs[0].path, "/apply");
        assert_eq!(reqs[0].header("idempotency-key"), Some("k1"));
        assert_eq!(reqs[0].body, "hello");
        assert_eq!(reqs[2].path, "/apply?key=k2");
    }

    #[test]
    fn unkeyed_applications_are_counted_each_time() {
        let svc = CountingService::start();
        post(&svc, "/apply", None);
        post(&svc, "/apply", None);
        assert_eq!(svc.unkeyed(), 2);
        assert!(svc.applications().is_empty());
        let (status, _, _) = raw(&svc, "GET /apply HTTP/1.1\r\nHost: x\r\n\r\n");
        assert_eq!(status, 405);
        assert_eq!(svc.unkeyed(), 2);
    }

    #[test]
    fn chunked_bodies_are_read() {
        let svc = CountingService::start();
        let (status, _, _) = raw(
            &svc,
            "POST /apply HTTP/1.1\r\nHost: x\r\nIdempotency-Key: c\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n",
        );
        assert_eq!(status, 200);
        assert_eq!(svc.requests()[0].body, "abcde");
    }

    #[test]
    fn redirect_big_and_status_routes() {
        let svc = CountingService::start();
        let (status, head, _) = raw(&svc, "GET /redirect HTTP/1.1\r\nHost: x\r\n\r\n");
        assert_eq!(status, 302);
        assert!(head.contains("Location: /apply"));
        let (status, _, body) = raw(&svc, "GET /big?n=100000 HTTP/1.1\r\nHost: x\r\n\r\n");
        assert_eq!(status, 200);
        assert_eq!(body.len(), 100_000);
        assert!(body.iter().all(|&b| b == b'x'));
        let (status, _, _) = raw(&svc, "GET /status/503 HTTP/1.1\r\nHost: x\r\n\r\n");
        assert_eq!(status, 503);
        let (status, _, _) = raw(&svc, "GET /nope HTTP/1.1\r\nHost: x\r\n\r\n");
        assert_eq!(status, 404);
        assert!(svc.url().starts_with("http://127.0.0.1:"));
    }

    #[test]
    fn broken_clients_do_not_break_the_service() {
        let svc = CountingService::start();
        // A client that dies mid-head and one that dies mid-body: nothing is applied.
        {
            let mut s = TcpStream::connect(svc.addr()).unwrap();
            s.write_all(b"POST /apply HTTP/1.1\r\nIdempotency-Key: half")
                .unwrap();
        }
        {
            let mut s = TcpStream::connect(svc.addr()).unwrap();
            s.write_all(
                b"POST /apply HTTP/1.1\r\nIdempotency-Key: k\r\nContent-Length: 10\r\n\r\nabc",
            )
            .unwrap();
        }
        // A client that sends a whole request and leaves before reading: it is applied.
        {
            let mut s = TcpStream::connect(svc.addr()).unwrap();
            s.write_all(b"GET /big?n=10000000 HTTP/1.1\r\n\r\n")
                .unwrap();
        }
        // Still serving, and the half requests had no effect.
        let (status, _, _) = post(&svc, "/apply", Some("after"));
        assert_eq!(status, 200);
        assert_eq!(svc.applications(), BTreeMap::from([("after".into(), 1)]));
    }
}
