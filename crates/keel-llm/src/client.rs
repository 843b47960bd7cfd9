//! The client: builds a request body, sends it with retries, parses the answer.

use once_cell::sync::OnceCell;
use std::time::{Duration, Instant};

use keel_core::agent::{ModelReply, Prompt, ToolSpec};
use ureq::http::header::{self, HeaderName, HeaderValue};

use crate::config::{ClientConfig, Provider, redact_url};
use crate::error::{EXCERPT_BYTES, LlmError, excerpt};
use crate::{anthropic, openai, wire};

/// A model client for one provider, endpoint, model and key. Synchronous: `send` blocks the
/// calling thread for the whole call, retries and backoff included.
pub struct Client {
    config: ClientConfig,
    http: ureq::Agent,
    /// Where requests go.
    target: String,
    /// `target` fit for messages: no credentials, query or fragment.
    endpoint: String,
    headers: Vec<(HeaderName, HeaderValue)>,
}

/// The largest answer read: a model's answer is a few kilobytes, and a server that sends more
/// than this is not answering the request.
const LARGEST_ANSWER: u64 = 64 * 1024 * 1024;

/// A successful call: the raw answer and what it took to get it.
#[derive(Debug, Clone)]
pub struct Exchange {
    /// The HTTP status of the answer (2xx).
    pub status: u16,
    /// The answer's body, as received.
    pub body: Vec<u8>,
    /// Attempts made, the successful one included.
    pub attempts: u32,
    /// One line per retry saying why the attempt before it failed: `429 Too Many Requests`,
    /// `timeout`, `connection error: …`.
    pub retries: Vec<String>,
    /// From the first attempt to the answer, backoff waits included.
    pub duration: Duration,
}

/// Why one attempt failed in a way worth retrying.
struct Retryable {
    /// Short, for `Exchange::retries`.
    line: String,
    /// With the provider's message and the endpoint, for `LlmError::Exhausted::last`.
    detail: String,
    /// What the server asked us to wait, if it said.
    retry_after: Option<Duration>,
}

enum Attempt {
    Answered { status: u16, body: Vec<u8> },
    Retry(Retryable),
}

impl Client {
    /// Checks the configuration and builds the HTTP client. Fails with `Transport` for a base
    /// URL that is not an http(s) URL, an API key that cannot be an HTTP header, or a zero
    /// timeout. Requests to a loopback address bypass any proxy set in the environment.
    pub fn new(config: ClientConfig) -> Result<Client, LlmError> {
        if config.timeout.is_zero() {
            return Err(LlmError::Transport(
                "the timeout is zero: every attempt would time out at once".to_string(),
            ));
        }
        let url = url::Url::parse(config.base_url.trim()).map_err(|e| {
            LlmError::Transport(format!(
                "the base URL {} is not a valid URL: {e}",
                redact_url(&config.base_url)
            ))
        })?;
        if url.scheme() != "http" && url.scheme() != "https" {
            return Err(LlmError::Transport(format!(
                "the base URL {} is not http or https",
                redact_url(&config.base_url)
            )));
        }
        let target = endpoint(config.provider, &url);
        let shown = redact_url(&target);
        let headers = headers(&config)?;

        let http = shared_http(is_loopback(&url));
        Ok(Client {
            config,
            http,
            target,
            endpoint: shown,
            headers,
        })
    }

    pub fn config(&self) -> &ClientConfig {
        &self.config
    }

    /// The URL requests are sent to, without credentials or query: fit for logs and artifacts.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The exact request body (JSON bytes) for this prompt and these tools. Deterministic: the
    /// same inputs give the same bytes, so a stored body can be re-sent after a crash. The API
    /// key is never in it (it goes in a header).
    pub fn build_request(&self, prompt: &Prompt, tools: &[ToolSpec]) -> Vec<u8> {
        let config = &self.config;
        match config.provider {
            Provider::OpenAi => {
                openai::build(&config.model, config.max_output_tokens, prompt, tools)
            }
            Provider::Anthropic => {
                anthropic::build(&config.model, config.max_output_tokens, prompt, tools)
            }
        }
    }

    /// Sends a body built by [`Client::build_request`], retrying on 408, 429, 5xx, timeouts and
    /// connection errors up to `max_retries` times. `sleep` is called once before every retry
    /// with the backoff wait (the engine passes `std::thread::sleep`; tests pass a recorder).
    /// Any other non-2xx answer is `Rejected` at once. A 2xx answer is returned as it is: its
    /// body is checked by [`Client::parse`].
    pub fn send(&self, body: &[u8], sleep: &mut dyn FnMut(Duration)) -> Result<Exchange, LlmError> {
        let started = Instant::now();
        let mut retries: Vec<String> = Vec::new();
        let mut attempts: u32 = 0;
        loop {
            attempts += 1;
            let failure = match self.attempt(body)? {
                Attempt::Answered { status, body } => {
                    return Ok(Exchange {
                        status,
                        body,
                        attempts,
                        retries,
                        duration: started.elapsed(),
                    });
                }
                Attempt::Retry(failure) => failure,
            };
            let retry = attempts - 1;
            if retry >= self.config.max_retries {
                return Err(LlmError::Exhausted {
                    attempts,
                    last: failure.detail,
                });
            }
            // A server's Retry-After is honoured up to backoff_max: a server may not park keel
            // for a day.
            let wait = failure
                .retry_after
                .map(|d| d.min(self.config.backoff_max))
                .unwrap_or_else(|| {
                    backoff(
                        retry,
                        self.config.backoff_base,
                        self.config.backoff_max,
                        fastrand::f64(),
                    )
                });
            sleep(wait);
            retries.push(failure.line);
        }
    }

    /// Parses a success response body into the neutral reply. Tolerant of extra fields and of
    /// missing optional ones; `Malformed` says what required part is missing. A server that
    /// echoes the API key gets it taken out of the error: out of the message, and out of the
    /// body before its start is cut for the excerpt, so that no part of the key is shown.
    pub fn parse(&self, body: &[u8]) -> Result<ModelReply, LlmError> {
        let parsed = match self.config.provider {
            Provider::OpenAi => openai::parse(body),
            Provider::Anthropic => anthropic::parse(body),
        };
        parsed.map_err(|e| match e {
            LlmError::Malformed { message, .. } => LlmError::Malformed {
                message: self.scrub(&message),
                excerpt: excerpt(
                    self.scrub(&String::from_utf8_lossy(body)).as_bytes(),
                    EXCERPT_BYTES,
                ),
            },
            other => other,
        })
    }

    /// One attempt. `Err` only for what must not be retried.
    fn attempt(&self, body: &[u8]) -> Result<Attempt, LlmError> {
        let mut request = self
            .http
            .post(&self.target)
            .config()
            .timeout_global(Some(self.config.timeout))
            .build();
        for (name, value) in &self.headers {
            request = request.header(name, value);
        }
        let response = match request.send(body) {
            Ok(response) => response,
            Err(e) => return self.transport_failure(&e).map(Attempt::Retry),
        };
        let status = response.status();
        let retry_after = retry_after(response.headers());
        let location = response
            .headers()
            .get(header::LOCATION)
            .and_then(|v| v.to_str().ok())
            .map(redact_url);
        let answer = match response
            .into_body()
            .with_config()
            .limit(LARGEST_ANSWER)
            .read_to_vec()
        {
            Ok(bytes) => bytes,
            Err(ureq::Error::BodyExceedsLimit(_)) => {
                return Err(LlmError::Malformed {
                    message: format!(
                        "the answer (HTTP {}) is larger than {} MiB; check that the base URL is a model API (POST {})",
                        status.as_u16(),
                        LARGEST_ANSWER / (1024 * 1024),
                        self.endpoint
                    ),
                    excerpt: String::new(),
                });
            }
            Err(e) => return self.transport_failure(&e).map(Attempt::Retry),
        };
        let code = status.as_u16();
        if status.is_success() {
            return Ok(Attempt::Answered {
                status: code,
                body: answer,
            });
        }
        let provider_says = wire::provider_message(&answer)
            .map(|m| self.scrub(&m))
            .unwrap_or_else(|| {
                let text = excerpt(&answer, EXCERPT_BYTES);
                if text.trim().is_empty() {
                    "(no message)".to_string()
                } else {
                    self.scrub(&text)
                }
            });
        let out_of_quota =
            code == 429 && wire::provider_code(&answer).as_deref() == Some("insufficient_quota");
        if is_retryable(code) && !out_of_quota {
            let line = status_line(code);
            return Ok(Attempt::Retry(Retryable {
                detail: format!("{line}: {provider_says} (POST {})", self.endpoint),
                line,
                retry_after,
            }));
        }
        let advice = self.advice(code, out_of_quota, location.as_deref());
        Err(LlmError::Rejected {
            status: code,
            message: format!("{provider_says} (POST {}). {advice}", self.endpoint),
        })
    }

    /// A request that got no HTTP answer: retried, unless the request itself could not be built.
    fn transport_failure(&self, e: &ureq::Error) -> Result<Retryable, LlmError> {
        let chain = self.scrub(&describe(e));
        if is_unsendable(e) {
            return Err(LlmError::Transport(format!(
                "could not build the request to {}: {chain}",
                self.endpoint
            )));
        }
        let (line, detail) = if matches!(e, ureq::Error::Timeout(_)) {
            (
                "timeout".to_string(),
                format!(
                    "timeout: no complete answer within {:?} (POST {})",
                    self.config.timeout, self.endpoint
                ),
            )
        } else if is_connect(e) {
            (
                format!("connection failed: {chain}"),
                format!("could not connect (POST {}): {chain}", self.endpoint),
            )
        } else {
            (
                format!("connection error: {chain}"),
                format!("connection error (POST {}): {chain}", self.endpoint),
            )
        };
        Ok(Retryable {
            line,
            detail,
            retry_after: None,
        })
    }

    /// A sentence telling the user what to check for a refused request.
    fn advice(&self, status: u16, out_of_quota: bool, location: Option<&str>) -> String {
        let model = &self.config.model;
        let provider = match self.config.provider {
            Provider::OpenAi => "OpenAI-compatible",
            Provider::Anthropic => "Anthropic",
        };
        if out_of_quota {
            return format!(
                "The {provider} account is out of credit or over its quota: add credit or raise the limit, then resume."
            );
        }
        match status {
            401 => format!(
                "Check the API key given to this driver (the secret the contract names for it): it is missing, wrong, revoked, or not a key for this {provider} server."
            ),
            403 => format!(
                "The API key is not allowed to do this: check its permissions, its organisation or project, and its access to model \"{model}\"."
            ),
            404 => format!(
                "Check the model name \"{model}\" (is it available to this key, or pulled on a local server?) and the base URL."
            ),
            400 | 422 => format!(
                "The server found the request invalid: check that model \"{model}\" supports tool calls and that max_output_tokens ({}) is within its limit.",
                self.config.max_output_tokens
            ),
            413 => "The request is too large for the server: lower the phase's context_tokens."
                .to_string(),
            300..=399 => format!(
                "The server redirected to {}; set base_url to the final address.",
                location.unwrap_or("(no location)")
            ),
            _ => "The server refused the request; retrying the same request will not help."
                .to_string(),
        }
    }

    /// Removes the API key from text a server or library produced.
    fn scrub(&self, text: &str) -> String {
        match self.config.api_key.as_deref() {
            Some(key) if !key.is_empty() => text.replace(key, "[redacted]"),
            _ => text.to_string(),
        }
    }
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("config", &self.config)
            .field("endpoint", &self.endpoint)
            .finish_non_exhaustive()
    }
}

/// The full endpoint: the API's path appended to the base URL's path, keeping any query (some
/// gateways want `?api-version=…`). For Anthropic, a base path that already ends in `/v1` is
/// taken as meaning the same as one without it.
fn endpoint(provider: Provider, base: &url::Url) -> String {
    let mut url = base.clone();
    let path = base.path().trim_end_matches('/');
    let full = match provider {
        Provider::OpenAi => format!("{path}/chat/completions"),
        Provider::Anthropic => match path.strip_suffix("/v1") {
            Some(root) => format!("{root}/v1/messages"),
            None => format!("{path}/v1/messages"),
        },
    };
    url.set_path(&full);
    url.to_string()
}

fn headers(config: &ClientConfig) -> Result<Vec<(HeaderName, HeaderValue)>, LlmError> {
    let mut headers = vec![
        (
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        ),
        (header::ACCEPT, HeaderValue::from_static("application/json")),
    ];
    let key = |value: String| {
        HeaderValue::from_str(&value)
            .map(|mut v| {
                v.set_sensitive(true);
                v
            })
            .map_err(|_| {
                LlmError::Transport(
                    "the API key contains characters an HTTP header cannot carry (a newline?)"
                        .to_string(),
                )
            })
    };
    match config.provider {
        Provider::OpenAi => {
            if let Some(api_key) = &config.api_key {
                headers.push((header::AUTHORIZATION, key(format!("Bearer {api_key}"))?));
            }
        }
        Provider::Anthropic => {
            if let Some(api_key) = &config.api_key {
                headers.push((HeaderName::from_static("x-api-key"), key(api_key.clone())?));
            }
            headers.push((
                HeaderName::from_static("anthropic-version"),
                HeaderValue::from_static(anthropic::API_VERSION),
            ));
        }
    }
    Ok(headers)
}

static HTTP_CLIENTS_BUILT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// How many HTTP clients this process has built: at most two, one that follows the proxy
/// environment and one for loopback endpoints, however many [`Client`]s were made at once.
pub fn http_clients_built() -> usize {
    HTTP_CLIENTS_BUILT.load(std::sync::atomic::Ordering::Relaxed)
}

/// The HTTP client every [`Client`] of this process sends through: one that bypasses any proxy
/// set in the environment (for loopback endpoints) and one that follows it, each built once.
/// Shared, they keep connections alive across runs; threads that ask at once wait for one of
/// them to build it. The proxy environment is read when the first client of a kind is built. A
/// request's timeout is set on the request.
///
/// ureq rather than reqwest (which keel's other HTTP callers use): its blocking client does the
/// call on the calling thread, where reqwest's hands every request to a runtime thread and
/// back. Measured on loopback, a model call took about half the CPU (see ARCHITECTURE.md).
fn shared_http(loopback: bool) -> ureq::Agent {
    static CLIENTS: [OnceCell<ureq::Agent>; 2] = [OnceCell::new(), OnceCell::new()];
    CLIENTS[usize::from(loopback)]
        .get_or_init(|| {
            let tls = ureq::tls::TlsConfig::builder()
                // The system's certificates, as the rest of keel's HTTPS uses, with the one
                // crypto provider the build already has.
                .root_certs(ureq::tls::RootCerts::PlatformVerifier)
                .unversioned_rustls_crypto_provider(std::sync::Arc::new(
                    rustls::crypto::aws_lc_rs::default_provider(),
                ))
                .build();
            let builder = ureq::Agent::config_builder()
                .tls_config(tls)
                // No agent-wide timeout: each request carries its run's own.
                .timeout_global(None)
                // Every status is an answer to read, not an error.
                .http_status_as_error(false)
                // An API does not redirect a POST anywhere useful, and following one would
                // carry the key to another host: the redirect is the answer.
                .max_redirects(0)
                .max_redirects_will_error(false)
                // As many kept connections as runs a worker drives at once, for as long as a
                // slow step may leave one idle.
                .max_idle_connections(1024)
                .max_idle_connections_per_host(1024)
                .max_idle_age(Duration::from_secs(90))
                // Each kept connection holds its buffers (128 KiB each way by default): an
                // answer's headers fit in 64 KiB (ureq's limit for them), and a request is
                // written in pieces of 32.
                .input_buffer_size(64 * 1024)
                .output_buffer_size(32 * 1024)
                .user_agent(concat!("keel/", env!("CARGO_PKG_VERSION")));
            let builder = if loopback {
                builder.proxy(None)
            } else {
                builder.proxy(ureq::Proxy::try_from_env())
            };
            HTTP_CLIENTS_BUILT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            ureq::Agent::with_parts(
                builder.build(),
                ureq::unversioned::transport::DefaultConnector::default(),
                LiteralsAsGiven::default(),
            )
        })
        .clone()
}

/// ureq's resolver, except that a host that is already an IP address is used as it is.
///
/// ureq resolves the host before every request, a kept connection's included, and its default
/// resolver does so in a thread of its own, started and joined each time, whenever the request
/// has a timeout (every keel request has one), so that a slow DNS lookup can be given up. For an
/// address such as `127.0.0.1` or `[::1]` there is nothing to look up: that thread was all a
/// local model's call paid for, about one a model request. Names still go through ureq's
/// resolver, with its timeout. (`ureq::unversioned` is outside ureq's semver promise: a ureq
/// upgrade that changes it fails to build here, not at run time.)
#[derive(Debug, Default)]
struct LiteralsAsGiven(ureq::unversioned::resolver::DefaultResolver);

impl ureq::unversioned::resolver::Resolver for LiteralsAsGiven {
    fn resolve(
        &self,
        uri: &ureq::http::Uri,
        config: &ureq::config::Config,
        timeout: ureq::unversioned::transport::NextTimeout,
    ) -> Result<ureq::unversioned::resolver::ResolvedSocketAddrs, ureq::Error> {
        let Some(addr) = literal_address(uri) else {
            return self.0.resolve(uri, config, timeout);
        };
        if config
            .ip_family()
            .keep_wanted(std::iter::once(addr))
            .next()
            .is_none()
        {
            // What ureq's resolver says of an address of a family the config does not want.
            return Err(ureq::Error::HostNotFound);
        }
        let mut addrs = self.empty();
        addrs.push(addr);
        Ok(addrs)
    }
}

/// The socket address of an `http`/`https` URI whose host is an IP address (IPv6 in brackets),
/// with the scheme's port when the URI gives none; `None` for a name, or anything else, which
/// ureq's own resolver then checks and resolves.
fn literal_address(uri: &ureq::http::Uri) -> Option<std::net::SocketAddr> {
    let authority = uri.authority()?;
    let port = match (authority.port_u16(), uri.scheme_str()?) {
        (Some(port), "http" | "https") => port,
        (None, "http") => 80,
        (None, "https") => 443,
        _ => return None,
    };
    let host = authority.host();
    let ip = match host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        Some(v6) => std::net::IpAddr::V6(v6.parse().ok()?),
        None => std::net::IpAddr::V4(host.parse().ok()?),
    };
    Some(std::net::SocketAddr::new(ip, port))
}

fn is_loopback(url: &url::Url) -> bool {
    let Some(host) = url.host_str() else {
        return false;
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    host.eq_ignore_ascii_case("localhost")
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// 408 Request Timeout, 429 Too Many Requests, and every 5xx (Anthropic's 529 Overloaded
/// included) are worth another try.
fn is_retryable(status: u16) -> bool {
    status == 408 || status == 429 || (500..=599).contains(&status)
}

fn status_line(status: u16) -> String {
    let reason = match status {
        529 => Some("Overloaded"),
        _ => ureq::http::StatusCode::from_u16(status)
            .ok()
            .and_then(|s| s.canonical_reason()),
    };
    match reason {
        Some(reason) => format!("{status} {reason}"),
        None => status.to_string(),
    }
}

/// The wait a server asks for: `retry-after-ms` (milliseconds, sent by OpenAI) or `retry-after`
/// in seconds (fractions allowed). The HTTP-date form and nonsense are ignored (backoff applies).
fn retry_after(headers: &ureq::http::HeaderMap) -> Option<Duration> {
    let number = |name: &str| -> Option<f64> {
        let value: f64 = headers.get(name)?.to_str().ok()?.trim().parse().ok()?;
        (value.is_finite() && value >= 0.0).then_some(value)
    };
    if let Some(ms) = number("retry-after-ms") {
        return Duration::try_from_secs_f64(ms / 1000.0).ok();
    }
    Duration::try_from_secs_f64(number("retry-after")?).ok()
}

/// The wait before retry `retry` (0 for the first): uniform in `[0, min(max, base * 2^retry)]`
/// ("full jitter"), with `unit` uniform in `[0, 1)`.
pub(crate) fn backoff(retry: u32, base: Duration, max: Duration, unit: f64) -> Duration {
    let factor = 2u32.saturating_pow(retry.min(31));
    let ceiling = base.saturating_mul(factor).min(max);
    ceiling.mul_f64(unit.clamp(0.0, 1.0))
}

/// Whether `error` says the request could not be made at all (a URL or header ureq cannot send,
/// a TLS set-up that cannot work), which no retry fixes.
fn is_unsendable(error: &ureq::Error) -> bool {
    matches!(
        error,
        ureq::Error::Http(_)
            | ureq::Error::BadUri(_)
            | ureq::Error::InvalidProxyUrl
            | ureq::Error::Pem(_)
            | ureq::Error::Tls(_)
            | ureq::Error::TlsRequired
    )
}

/// Whether `error` happened before a connection was made: the host not found, the connection
/// refused or unreachable, a proxy that would not connect.
fn is_connect(error: &ureq::Error) -> bool {
    use std::io::ErrorKind as K;
    match error {
        ureq::Error::HostNotFound
        | ureq::Error::ConnectionFailed
        | ureq::Error::ConnectProxyFailed(_) => true,
        ureq::Error::Io(e) => matches!(
            e.kind(),
            K::ConnectionRefused
                | K::AddrNotAvailable
                | K::NetworkUnreachable
                | K::HostUnreachable
                | K::NetworkDown
        ),
        _ => false,
    }
}

/// What went wrong, in words: ureq's errors carry no URL (the callers show a redacted one) and
/// no chain of causes beyond an I/O error's own.
fn describe(error: &ureq::Error) -> String {
    match error {
        ureq::Error::Timeout(_) => "timed out".to_string(),
        ureq::Error::Io(e) if is_connect(error) => format!("error connecting: {e}"),
        ureq::Error::Io(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
            format!("the server closed the connection: {e}")
        }
        ureq::Error::Io(e) => format!("error sending the request or reading the answer: {e}"),
        e if is_connect(e) => format!("error connecting: {e}"),
        e => e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use ureq::unversioned::resolver::Resolver;
    use ureq::unversioned::transport::{NextTimeout, time};

    fn resolve_with(
        config: &ureq::config::Config,
        uri: &str,
        after: time::Duration,
    ) -> Result<Vec<std::net::SocketAddr>, ureq::Error> {
        let timeout = NextTimeout {
            after,
            reason: ureq::Timeout::Resolve,
            per_read: None,
            per_write: None,
        };
        let addrs = LiteralsAsGiven::default().resolve(&uri.parse().unwrap(), config, timeout)?;
        Ok(addrs.to_vec())
    }

    /// An IP address is the address: taken as it is, with the scheme's port when none is
    /// given, even with no time left to resolve anything (ureq's resolver would start a thread
    /// and wait for it; with no time left it gives up).
    #[test]
    fn ip_address_hosts_are_used_as_given_with_no_lookup() {
        let config = ureq::Agent::config_builder().build();
        let none_left = time::Duration::Exact(Duration::ZERO);
        for (uri, expected) in [
            ("http://127.0.0.1:8080/v1/chat", "127.0.0.1:8080"),
            ("http://10.1.2.3/v1", "10.1.2.3:80"),
            ("https://192.0.2.7/v1/messages", "192.0.2.7:443"),
            ("https://[::1]:11434/v1", "[::1]:11434"),
            ("http://[2001:db8::5]/", "[2001:db8::5]:80"),
        ] {
            let addrs = resolve_with(&config, uri, none_left).unwrap();
            assert_eq!(addrs, vec![expected.parse().unwrap()], "{uri}");
        }
    }

    /// Names (and anything that is not a plain `http`/`https` IP address) go to ureq's own
    /// resolver, its timeout included.
    #[test]
    fn names_are_resolved_by_ureq() {
        for uri in [
            "http://localhost:9/",
            "https://api.openai.com/v1",
            "http://127.0.0.1.example:80/",
            "socks5://127.0.0.1:1080",
        ] {
            assert_eq!(literal_address(&uri.parse().unwrap()), None, "{uri}");
        }
        let config = ureq::Agent::config_builder().build();
        let addrs = resolve_with(
            &config,
            "http://localhost:9/",
            time::Duration::from_secs(30),
        )
        .expect("localhost resolves");
        assert!(!addrs.is_empty());
        assert!(
            addrs.iter().all(|a| a.ip().is_loopback() && a.port() == 9),
            "{addrs:?}"
        );
    }

    /// An address of a family the config does not want is refused, as ureq's resolver refuses
    /// it.
    #[test]
    fn an_ip_address_of_an_unwanted_family_is_not_found() {
        let v4_only = ureq::Agent::config_builder()
            .ip_family(ureq::config::IpFamily::Ipv4Only)
            .build();
        let forever = time::Duration::NotHappening;
        assert!(matches!(
            resolve_with(&v4_only, "http://[::1]:8080/", forever),
            Err(ureq::Error::HostNotFound)
        ));
        assert_eq!(
            resolve_with(&v4_only, "http://127.0.0.1:8080/", forever).unwrap(),
            vec!["127.0.0.1:8080".parse().unwrap()]
        );
    }

    #[test]
    fn backoff_doubles_up_to_the_cap_with_full_jitter() {
        let base = Duration::from_millis(100);
        let max = Duration::from_secs(1);
        assert_eq!(backoff(0, base, max, 1.0), Duration::from_millis(100));
        assert_eq!(backoff(1, base, max, 1.0), Duration::from_millis(200));
        assert_eq!(backoff(3, base, max, 1.0), Duration::from_millis(800));
        assert_eq!(backoff(4, base, max, 1.0), max);
        assert_eq!(backoff(1000, base, max, 1.0), max);
        assert_eq!(backoff(2, base, max, 0.5), Duration::from_millis(200));
        assert_eq!(backoff(2, base, max, 0.0), Duration::ZERO);
    }

    #[test]
    fn endpoints_append_the_api_path() {
        let at = |provider, base: &str| endpoint(provider, &url::Url::parse(base).unwrap());
        assert_eq!(
            at(Provider::Anthropic, "https://api.anthropic.com"),
            "https://api.anthropic.com/v1/messages"
        );
        assert_eq!(
            at(Provider::Anthropic, "https://api.anthropic.com/v1/"),
            "https://api.anthropic.com/v1/messages"
        );
        assert_eq!(
            at(Provider::OpenAi, "http://127.0.0.1:11434/v1"),
            "http://127.0.0.1:11434/v1/chat/completions"
        );
        assert_eq!(
            at(
                Provider::OpenAi,
                "https://gw.example.com/openai/v1/?api-version=2"
            ),
            "https://gw.example.com/openai/v1/chat/completions?api-version=2"
        );
        assert_eq!(
            at(Provider::OpenAi, "http://localhost:8080"),
            "http://localhost:8080/chat/completions"
        );
    }

    #[test]
    fn retryable_statuses() {
        for code in [408, 429, 500, 502, 503, 504, 529] {
            assert!(is_retryable(code), "{code}");
        }
        for code in [400, 401, 403, 404, 409, 413, 422] {
            assert!(!is_retryable(code), "{code}");
        }
        assert_eq!(status_line(429), "429 Too Many Requests");
        assert_eq!(status_line(529), "529 Overloaded");
    }
}
