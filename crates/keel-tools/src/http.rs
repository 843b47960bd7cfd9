//! The `http` tool: allow-listed hosts and methods, no redirects, capped responses.
//!
//! [`check`] is pure: it decides from the policy and the request alone whether the request may
//! be sent (scheme, host, port, method, headers). [`send`] checks again and then sends it with
//! a blocking client that never follows redirects (a `3xx` is returned as it is, so a redirect
//! cannot lead outside the allow-list), reads at most [`HttpPolicy::max_response_bytes`] of the
//! body, and sets `Idempotency-Key` on every request that is not `GET` or `HEAD` when the
//! engine gives a key.
//!
//! **Scope of the allow-list.** Rules are matched on the host as written in the URL (after
//! URL normalisation: lowercase names, IPv4 in dotted form, IPv6 without brackets). Names are
//! resolved by the system resolver at send time; DNS rebinding (an allowed name that resolves to
//! an internal address) is out of scope. Loopback hosts (`localhost`, `127.0.0.0/8`, `::1`) are
//! reached directly, never through a proxy from the environment.
//!
//! [`send`] uses `reqwest`'s blocking client: do not call it from inside an async runtime.

use once_cell::sync::OnceCell;
use std::fmt;
use std::io::Read;
use std::net::IpAddr;
use std::time::Duration;

use reqwest::Url;
use reqwest::header::{HeaderMap, HeaderName, HeaderValue};

/// Headers keel sets itself; a request may not set them.
const RESERVED_HEADERS: [&str; 5] = [
    "idempotency-key",
    "host",
    "content-length",
    "transfer-encoding",
    "connection",
];

/// One allow-list entry: a host, an optional port and the methods allowed on it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpRule {
    /// An exact host (`api.example.com`, `127.0.0.1`, `::1`) or a wildcard `*.example.com`,
    /// which matches any subdomain of `example.com` but not `example.com` itself.
    pub host: String,
    /// The port; `None` means the scheme's default (80 for http, 443 for https).
    pub port: Option<u16>,
    /// Allowed methods, uppercase (`["GET", "POST"]`). An empty list allows nothing.
    pub methods: Vec<String>,
}

impl HttpRule {
    fn matches_host(&self, host: &str) -> bool {
        let rule = normalize_host(&self.host);
        match rule.strip_prefix("*.") {
            Some(suffix) => host
                .strip_suffix(suffix)
                .is_some_and(|rest| rest.len() > 1 && rest.ends_with('.')),
            None => host == rule,
        }
    }

    fn matches_port(&self, port: u16, default: u16) -> bool {
        self.port.unwrap_or(default) == port
    }

    fn allows(&self, method: &str) -> bool {
        self.methods.iter().any(|m| m.eq_ignore_ascii_case(method))
    }

    fn describe_host(&self) -> String {
        match self.port {
            Some(p) => format!("{}:{p}", self.host),
            None => self.host.clone(),
        }
    }
}

/// What the `http` tool may do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpPolicy {
    /// The allow-list; a request must match one rule (host, port and method).
    pub allow: Vec<HttpRule>,
    /// Most body bytes read from a response; the rest is dropped and the response marked
    /// truncated.
    pub max_response_bytes: u64,
    /// Timeout for the whole exchange (connect, send, read).
    pub timeout: Duration,
}

/// A request the model asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpRequest {
    /// The method, uppercase (`GET`).
    pub method: String,
    /// An absolute `http` or `https` URL.
    pub url: String,
    /// Extra headers, in order.
    pub headers: Vec<(String, String)>,
    /// The body, if any.
    pub body: Option<String>,
}

/// What came back.
#[derive(Clone, PartialEq, Eq)]
pub struct HttpResponse {
    /// The status code (a `3xx` is returned as is).
    pub status: u16,
    /// Response headers, in order (values decoded lossily as UTF-8).
    pub headers: Vec<(String, String)>,
    /// At most [`HttpPolicy::max_response_bytes`] of the body.
    pub body: Vec<u8>,
    /// Whether the body was longer than the cap.
    pub truncated: bool,
}

impl HttpResponse {
    /// The first value of header `name` (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

impl fmt::Debug for HttpResponse {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HttpResponse")
            .field("status", &self.status)
            .field("headers", &self.headers)
            .field("body", &String::from_utf8_lossy(&self.body))
            .field("truncated", &self.truncated)
            .finish()
    }
}

/// Why a request may not be sent. Messages never repeat the URL's path or query, header values
/// or the body (they may hold secrets).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HttpDenied {
    /// The URL does not parse.
    #[error("the URL is not a valid absolute URL ({reason}); give a full http:// or https:// URL")]
    BadUrl {
        /// The parser's reason.
        reason: String,
    },
    /// Not http or https.
    #[error("only http and https URLs are allowed, not {scheme}")]
    Scheme {
        /// The URL's scheme.
        scheme: String,
    },
    /// `user:password@` in the URL.
    #[error(
        "credentials in the URL (user:password@host) are not allowed; send them in an Authorization header using secret:NAME"
    )]
    Userinfo,
    /// An http(s) URL without a host.
    #[error("the URL has no host")]
    NoHost,
    /// A method that is not an uppercase token.
    #[error("method {method:?} is not valid: use an uppercase HTTP method such as GET or POST")]
    BadMethod {
        /// The method as given.
        method: String,
    },
    /// A header name that is not a valid token, or a value with a line break or NUL.
    #[error("header {name:?} is not valid: {reason}")]
    BadHeader {
        /// The header name as given.
        name: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A header keel sets itself.
    #[error("the {name} header is set by keel; remove it from the request")]
    ReservedHeader {
        /// The header name as given.
        name: String,
    },
    /// No rule allows this method on this host and port.
    #[error("{method} to {host}:{port} is not allowed: {allowed}")]
    NotAllowed {
        /// The request's method.
        method: String,
        /// The URL's host.
        host: String,
        /// The URL's port (explicit or the scheme's default).
        port: u16,
        /// What the contract does allow, as a sentence fragment.
        allowed: String,
    },
}

/// Why [`send`] failed.
#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    /// The request was refused before sending.
    #[error(transparent)]
    Denied(#[from] HttpDenied),
    /// The HTTP client could not be set up.
    #[error("cannot set up the HTTP client: {0}")]
    Client(String),
    /// Connecting, sending or receiving the head failed (or timed out).
    #[error("{method} to {host} failed: {message}")]
    Request {
        /// The request's method.
        method: String,
        /// The URL's host.
        host: String,
        /// The client's error (without the URL).
        message: String,
    },
    /// Reading the body failed (or timed out) after the status arrived.
    #[error("reading the response body from {host} failed after status {status}: {message}")]
    Body {
        /// The URL's host.
        host: String,
        /// The status that had arrived.
        status: u16,
        /// The error.
        message: String,
    },
}

/// The parts of a checked request.
struct Target {
    url: Url,
    host: String,
    port: u16,
    method: String,
}

/// Strips IPv6 brackets and lowercases.
fn normalize_host(host: &str) -> String {
    host.trim_start_matches('[')
        .trim_end_matches(']')
        .to_ascii_lowercase()
}

fn valid_token(s: &str) -> bool {
    !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

/// Whether `policy` allows `request`. Pure: nothing is resolved or sent.
pub fn check(policy: &HttpPolicy, request: &HttpRequest) -> Result<(), HttpDenied> {
    target(policy, request).map(|_| ())
}

fn target(policy: &HttpPolicy, request: &HttpRequest) -> Result<Target, HttpDenied> {
    let method = request.method.as_str();
    if !valid_token(method) || method.bytes().any(|b| b.is_ascii_lowercase()) {
        return Err(HttpDenied::BadMethod {
            method: method.to_owned(),
        });
    }
    let url = Url::parse(request.url.trim()).map_err(|e| HttpDenied::BadUrl {
        reason: e.to_string(),
    })?;
    let default_port = match url.scheme() {
        "http" => 80,
        "https" => 443,
        other => {
            return Err(HttpDenied::Scheme {
                scheme: other.to_owned(),
            });
        }
    };
    if !url.username().is_empty() || url.password().is_some() {
        return Err(HttpDenied::Userinfo);
    }
    let host = normalize_host(url.host_str().ok_or(HttpDenied::NoHost)?);
    if host.is_empty() {
        return Err(HttpDenied::NoHost);
    }
    let port = url.port_or_known_default().unwrap_or(default_port);
    for (name, value) in &request.headers {
        if !valid_token(name) {
            return Err(HttpDenied::BadHeader {
                name: name.clone(),
                reason: "a header name is letters, digits and - (no spaces or colons)",
            });
        }
        if value.bytes().any(|b| b == b'\r' || b == b'\n' || b == 0) {
            return Err(HttpDenied::BadHeader {
                name: name.clone(),
                reason: "its value contains a line break or NUL",
            });
        }
        if RESERVED_HEADERS
            .iter()
            .any(|r| r.eq_ignore_ascii_case(name))
        {
            return Err(HttpDenied::ReservedHeader { name: name.clone() });
        }
    }
    let on_host: Vec<&HttpRule> = policy
        .allow
        .iter()
        .filter(|r| r.matches_host(&host))
        .collect();
    let on_port: Vec<&HttpRule> = on_host
        .iter()
        .copied()
        .filter(|r| r.matches_port(port, default_port))
        .collect();
    if on_port.iter().any(|r| r.allows(method)) {
        return Ok(Target {
            url,
            host,
            port,
            method: method.to_owned(),
        });
    }
    let allowed = if !on_host.is_empty() {
        let parts: Vec<String> = on_host
            .iter()
            .map(|r| {
                let methods = if r.methods.is_empty() {
                    "nothing".to_owned()
                } else {
                    r.methods.join(", ")
                };
                format!("{methods} on {}", r.describe_host())
            })
            .collect();
        format!("the contract allows {}", parts.join("; "))
    } else if policy.allow.is_empty() {
        "the contract allows no HTTP requests".to_owned()
    } else {
        let hosts: Vec<String> = policy.allow.iter().map(HttpRule::describe_host).collect();
        format!(
            "the contract allows no requests to {host}, only to {}",
            hosts.join(", ")
        )
    };
    Err(HttpDenied::NotAllowed {
        method: method.to_owned(),
        host,
        port,
        allowed,
    })
}

static CLIENTS_BUILT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// How many HTTP clients this process has built: at most two, one that follows the proxy
/// environment and one for loopback hosts, however many requests were sent at once.
pub fn clients_built() -> usize {
    CLIENTS_BUILT.load(std::sync::atomic::Ordering::Relaxed)
}

/// The HTTP client every request of this process goes through: one that bypasses any proxy set
/// in the environment (for loopback hosts) and one that follows it, each built once, by one
/// thread while others that ask at once wait for it. Building one loads the system's root
/// certificates and starts a thread; shared, they also keep connections alive. The proxy
/// environment is read when the first of a kind is built; each request carries its policy's
/// timeout. Redirects are never followed.
fn shared_client(loopback: bool) -> Result<reqwest::blocking::Client, reqwest::Error> {
    static CLIENTS: [OnceCell<reqwest::blocking::Client>; 2] = [OnceCell::new(), OnceCell::new()];
    CLIENTS[usize::from(loopback)]
        .get_or_try_init(|| {
            let builder = reqwest::blocking::Client::builder()
                .redirect(reqwest::redirect::Policy::none())
                .timeout(None);
            let built = if loopback {
                builder.no_proxy().build()
            } else {
                builder.build()
            }?;
            CLIENTS_BUILT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Ok(built)
        })
        .cloned()
}

fn is_loopback(host: &str) -> bool {
    host == "localhost"
        || host.ends_with(".localhost")
        || host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// Sends `request` if `policy` allows it. Redirects are not followed; the body is read up to
/// the cap; `Idempotency-Key: idempotency_key` is sent on every method but `GET` and `HEAD`.
pub fn send(
    policy: &HttpPolicy,
    request: &HttpRequest,
    idempotency_key: Option<&str>,
) -> Result<HttpResponse, HttpError> {
    let target = target(policy, request)?;
    let client = shared_client(is_loopback(&target.host))
        .map_err(|e| HttpError::Client(e.without_url().to_string()))?;

    let mut headers = HeaderMap::new();
    for (name, value) in &request.headers {
        let bad = |reason| HttpDenied::BadHeader {
            name: name.clone(),
            reason,
        };
        let name = HeaderName::from_bytes(name.as_bytes()).map_err(|_| bad("not a header name"))?;
        let value = HeaderValue::from_str(value).map_err(|_| bad("not a valid header value"))?;
        headers.append(name, value);
    }
    if let Some(key) = idempotency_key
        && target.method != "GET"
        && target.method != "HEAD"
    {
        let value = HeaderValue::from_str(key).map_err(|_| HttpDenied::BadHeader {
            name: "Idempotency-Key".to_owned(),
            reason: "the idempotency key is not a valid header value",
        })?;
        headers.insert(HeaderName::from_static("idempotency-key"), value);
    }
    let method = reqwest::Method::from_bytes(target.method.as_bytes()).map_err(|_| {
        HttpDenied::BadMethod {
            method: target.method.clone(),
        }
    })?;
    let mut builder = client
        .request(method, target.url)
        .timeout(policy.timeout)
        .headers(headers);
    if let Some(body) = &request.body {
        builder = builder.body(body.clone());
    }
    let response = builder.send().map_err(|e| HttpError::Request {
        method: target.method.clone(),
        host: format!("{}:{}", target.host, target.port),
        message: error_chain(e),
    })?;

    let status = response.status().as_u16();
    let headers = response
        .headers()
        .iter()
        .map(|(n, v)| {
            (
                n.as_str().to_owned(),
                String::from_utf8_lossy(v.as_bytes()).into_owned(),
            )
        })
        .collect();
    let cap = policy.max_response_bytes;
    let mut body = Vec::new();
    response
        .take(cap.saturating_add(1))
        .read_to_end(&mut body)
        .map_err(|e| HttpError::Body {
            host: format!("{}:{}", target.host, target.port),
            status,
            message: e.to_string(),
        })?;
    let truncated = body.len() as u64 > cap;
    if truncated {
        body.truncate(usize::try_from(cap).unwrap_or(usize::MAX));
    }
    Ok(HttpResponse {
        status,
        headers,
        body,
        truncated,
    })
}

/// The error and its sources, without the URL (whose query may hold a secret).
fn error_chain(e: reqwest::Error) -> String {
    let e = e.without_url();
    let mut message = e.to_string();
    let mut source = std::error::Error::source(&e);
    while let Some(s) = source {
        message.push_str(": ");
        message.push_str(&s.to_string());
        source = s.source();
    }
    message
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn rule(host: &str, port: Option<u16>, methods: &[&str]) -> HttpRule {
        HttpRule {
            host: host.into(),
            port,
            methods: methods.iter().map(|m| (*m).to_owned()).collect(),
        }
    }

    fn policy(allow: Vec<HttpRule>) -> HttpPolicy {
        HttpPolicy {
            allow,
            max_response_bytes: 1024,
            timeout: Duration::from_secs(5),
        }
    }

    fn req(method: &str, url: &str) -> HttpRequest {
        HttpRequest {
            method: method.into(),
            url: url.into(),
            headers: Vec::new(),
            body: None,
        }
    }

    #[test]
    fn denial_names_the_missing_rule() {
        let p = policy(vec![rule("api.example.com", None, &["GET"])]);
        assert_eq!(check(&p, &req("GET", "https://api.example.com/v1")), Ok(()));
        let err = check(&p, &req("POST", "https://api.example.com/v1")).unwrap_err();
        assert_eq!(
            err.to_string(),
            "POST to api.example.com:443 is not allowed: the contract allows GET on api.example.com"
        );
        // No port in the rule: the scheme's default port, whichever the scheme.
        assert_eq!(check(&p, &req("GET", "http://api.example.com/v1")), Ok(()));
        let err = check(&p, &req("GET", "https://api.example.com:8443/v1")).unwrap_err();
        assert!(
            matches!(err, HttpDenied::NotAllowed { port: 8443, .. }),
            "{err}"
        );
        let err = check(&p, &req("GET", "https://evil.com/?q=secret-value")).unwrap_err();
        let msg = err.to_string();
        assert_eq!(
            msg,
            "GET to evil.com:443 is not allowed: the contract allows no requests to evil.com, only to api.example.com"
        );
    }

    #[test]
    fn wildcards_ports_and_normalisation() {
        let p = policy(vec![
            rule("*.example.com", None, &["GET"]),
            rule("127.0.0.1", Some(8080), &["GET", "POST"]),
            rule("::1", Some(9000), &["GET"]),
        ]);
        assert!(check(&p, &req("GET", "https://a.example.com/")).is_ok());
        assert!(check(&p, &req("GET", "https://A.B.Example.COM/")).is_ok());
        assert!(check(&p, &req("GET", "https://example.com/")).is_err());
        assert!(check(&p, &req("GET", "https://badexample.com/")).is_err());
        assert!(check(&p, &req("GET", "https://a.example.com:8443/")).is_err());
        assert!(check(&p, &req("POST", "http://127.0.0.1:8080/x")).is_ok());
        assert!(check(&p, &req("POST", "http://127.0.0.1:8081/x")).is_err());
        // Another spelling of 127.0.0.1 is normalised by the URL parser.
        assert!(check(&p, &req("GET", "http://2130706433:8080/")).is_ok());
        assert!(check(&p, &req("GET", "http://[::1]:9000/")).is_ok());
    }

    #[test]
    fn malformed_requests_are_refused() {
        let p = policy(vec![rule("h.test", None, &["GET"])]);
        assert!(matches!(
            check(&p, &req("GET", "ftp://h.test/")),
            Err(HttpDenied::Scheme { .. })
        ));
        assert!(matches!(
            check(&p, &req("GET", "file:///etc/passwd")),
            Err(HttpDenied::Scheme { .. })
        ));
        assert!(matches!(
            check(&p, &req("GET", "/relative")),
            Err(HttpDenied::BadUrl { .. })
        ));
        assert_eq!(
            check(&p, &req("GET", "https://user:pw@h.test/")),
            Err(HttpDenied::Userinfo)
        );
        assert_eq!(
            check(&p, &req("GET", "https://user@h.test/")),
            Err(HttpDenied::Userinfo)
        );
        assert!(matches!(
            check(&p, &req("get", "https://h.test/")),
            Err(HttpDenied::BadMethod { .. })
        ));
        for (name, value) in [
            ("Bad Name", "v"),
            ("X", "a\r\nInjected: 1"),
            ("", "v"),
            ("Idempotency-Key", "mine"),
            ("host", "other.test"),
        ] {
            let mut r = req("GET", "https://h.test/");
            r.headers.push((name.into(), value.into()));
            let err = check(&p, &r).unwrap_err();
            assert!(!err.to_string().contains("Injected"), "{err}");
            assert!(
                matches!(
                    err,
                    HttpDenied::BadHeader { .. } | HttpDenied::ReservedHeader { .. }
                ),
                "{err}"
            );
        }
        let err = check(&policy(vec![]), &req("GET", "https://h.test/")).unwrap_err();
        assert!(err.to_string().contains("allows no HTTP requests"), "{err}");
    }
}
