//! keel-server: `keel serve`, an HTTP API and a web page over one store.
//!
//! - Every `/api/*` request needs the bearer token (`Authorization: Bearer TOKEN`); without it,
//!   or with another, the answer is 401. The page itself (`/`, `/app.js`, `/app.css`) holds no
//!   data and is served without one: it takes the token from `?token=` once, keeps it in the
//!   tab's `sessionStorage`, removes it from the address bar, and asks for it when it has none.
//! - Reads and writes go through keel-store and keel-engine exactly as the CLI's do; a decision
//!   delivered here is the same `approval_decided` event as one from `keel approve`, recorded once
//!   however often and however concurrently it is delivered.
//! - The page is three files embedded in the binary: no build step, no external resource.
//!
//! Its serialisable API types ([`views`]) are its own: the wire format does not change when the
//! projection does.

mod api;
mod error;
mod views;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use axum::Router;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};

pub use error::ApiError;

/// The default address of `keel serve`: loopback only.
pub const DEFAULT_ADDR: &str = "127.0.0.1:7777";

/// What `keel serve` needs.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// The store (SQLite file) to serve.
    pub store: PathBuf,
    /// Where to listen; [`DEFAULT_ADDR`] unless told otherwise.
    pub addr: SocketAddr,
    /// The bearer token every API request must carry.
    pub token: String,
}

impl ServeConfig {
    /// A configuration on [`DEFAULT_ADDR`].
    pub fn new(store: PathBuf, token: String) -> ServeConfig {
        ServeConfig {
            store,
            addr: SocketAddr::from(([127, 0, 0, 1], 7777)),
            token,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("cannot start the server's runtime: {0}")]
    Runtime(#[source] std::io::Error),
    #[error(
        "cannot listen on {addr}: {source} (is another `keel serve` running? pick another address)"
    )]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("the server stopped: {0}")]
    Serve(#[source] std::io::Error),
    #[error(transparent)]
    Store(#[from] keel_store::StoreError),
    #[error(
        "the bearer token is too short ({0} characters): give one of at least 16, or let keel make one"
    )]
    WeakToken(usize),
    #[error("cannot make a token: reading /dev/urandom failed: {0}")]
    Token(#[source] std::io::Error),
}

/// A fresh bearer token: 32 random bytes from the kernel, in hex.
pub fn new_token() -> Result<String, ServerError> {
    use std::io::Read;
    let mut bytes = [0u8; 32];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .map_err(ServerError::Token)?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// The address of the page with the token for it to pick up (it then removes it from the
/// address bar and keeps it only in the tab's session storage).
pub fn page_url(addr: SocketAddr, token: &str) -> String {
    format!("http://{addr}/?token={token}")
}

/// What every request handler shares: where the store is, the token, and who acts.
#[derive(Clone)]
pub struct AppState {
    inner: Arc<Inner>,
}

struct Inner {
    store: PathBuf,
    token: String,
    /// The lease holder this server writes as (`host:pid:start`, like every keel process).
    holder: String,
    /// Writes from this process take turns: the store's lease keeps processes apart, but two
    /// requests here share one holder, so they would otherwise take the lease from each other.
    writes: Mutex<()>,
}

impl AppState {
    /// State for a server over the store at `store`, accepting `token`.
    pub fn new(store: &Path, token: &str) -> Result<AppState, ServerError> {
        if token.trim().len() < 16 {
            return Err(ServerError::WeakToken(token.trim().len()));
        }
        // Fail at start, not at the first request, when the store cannot be opened.
        keel_store::Store::open(store)?;
        Ok(AppState {
            inner: Arc::new(Inner {
                store: store.to_path_buf(),
                token: token.trim().to_string(),
                holder: keel_engine::Actor::current().holder,
                writes: Mutex::new(()),
            }),
        })
    }

    pub(crate) fn store_path(&self) -> &Path {
        &self.inner.store
    }

    pub(crate) fn actor(&self, by: Option<&str>) -> keel_engine::Actor {
        keel_engine::Actor {
            holder: self.inner.holder.clone(),
            by: by
                .map(str::trim)
                .filter(|b| !b.is_empty())
                .unwrap_or("http")
                .to_string(),
        }
    }

    pub(crate) fn write_turn(&self) -> MutexGuard<'_, ()> {
        match self.inner.writes.lock() {
            Ok(guard) => guard,
            // A panicked writer left nothing half-done behind the lock: the store's transaction
            // either committed or did not.
            Err(poisoned) => poisoned.into_inner(),
        }
    }
}

/// The whole application: the page, and the API behind the bearer token.
pub fn router(state: AppState) -> Router {
    let api = Router::new()
        .route("/runs", get(api::list_runs))
        .route("/runs/{id}", get(api::show_run))
        .route("/runs/{id}/events", get(api::events))
        .route("/runs/{id}/events/stream", get(api::stream))
        .route("/runs/{id}/approvals/{n}", post(api::decide))
        .route("/runs/{id}/questions/{n}", post(api::answer))
        .route("/runs/{id}/freeze", post(api::freeze))
        .route("/runs/{id}/unfreeze", post(api::unfreeze))
        .route("/runs/{id}/cancel", post(api::cancel))
        .route("/approvals", get(api::approvals))
        .route("/questions", get(api::questions))
        .route("/openapi.json", get(api::openapi))
        .fallback(api::not_found)
        .method_not_allowed_fallback(api::method_not_allowed)
        .layer(middleware::from_fn_with_state(state.clone(), require_token))
        .layer(middleware::map_response(no_store));
    Router::new()
        .route("/", get(page_html))
        .route("/app.js", get(page_js))
        .route("/app.css", get(page_css))
        .nest("/api", api)
        .fallback(api::not_found)
        .method_not_allowed_fallback(api::method_not_allowed)
        .with_state(state)
}

/// Runs the server on `listener` until `shutdown` completes.
pub async fn serve_on(
    listener: tokio::net::TcpListener,
    state: AppState,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), ServerError> {
    axum::serve(listener, router(state))
        .with_graceful_shutdown(shutdown)
        .await
        .map_err(ServerError::Serve)
}

/// `keel serve`: listens on `config.addr` until SIGINT or SIGTERM. Blocks.
pub fn serve(config: ServeConfig) -> Result<(), ServerError> {
    serve_with_ready(config, |_| {})
}

/// Like [`serve`], calling `ready` with the bound address once the server listens (useful when
/// the configured port is 0).
pub fn serve_with_ready(
    config: ServeConfig,
    ready: impl FnOnce(SocketAddr),
) -> Result<(), ServerError> {
    let state = AppState::new(&config.store, &config.token)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(ServerError::Runtime)?;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(config.addr)
            .await
            .map_err(|source| ServerError::Bind {
                addr: config.addr,
                source,
            })?;
        let addr = listener.local_addr().map_err(ServerError::Serve)?;
        ready(addr);
        serve_on(listener, state, shutdown_signal()).await
    })
}

async fn shutdown_signal() {
    let interrupt = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        () = interrupt => {}
        () = terminate => {}
    }
}

/// Checks `Authorization: Bearer TOKEN` on every API request.
async fn require_token(State(state): State<AppState>, request: Request, next: Next) -> Response {
    let given = request
        .headers()
        .get(header::AUTHORIZATION)
        .map(|v| v.to_str().unwrap_or(""));
    let refusal = match given {
        None => Some(
            "this API needs the bearer token that `keel serve` printed: send the header \
             `Authorization: Bearer TOKEN`",
        ),
        Some(value) => match value.split_once(' ') {
            Some((scheme, token))
                if scheme.eq_ignore_ascii_case("bearer")
                    && same_secret(token.trim(), &state.inner.token) =>
            {
                None
            }
            Some((scheme, _)) if scheme.eq_ignore_ascii_case("bearer") => Some(
                "the bearer token is wrong: use the one `keel serve` printed at start (a restarted \
                 server without --token has a new one)",
            ),
            _ => Some(
                "the Authorization header must be `Bearer TOKEN`, with the token `keel serve` printed",
            ),
        },
    };
    match refusal {
        None => next.run(request).await,
        Some(message) => {
            let mut response = ApiError::unauthorized(message).into_response();
            response.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer realm=\"keel\""),
            );
            response
        }
    }
}

/// Compares a secret without stopping at the first differing byte.
fn same_secret(given: &str, expected: &str) -> bool {
    let (a, b) = (given.as_bytes(), expected.as_bytes());
    let mut diff = a.len() ^ b.len();
    for (i, byte) in b.iter().enumerate() {
        diff |= usize::from(a.get(i).copied().unwrap_or(0) ^ byte);
    }
    diff == 0
}

async fn no_store(mut response: Response) -> Response {
    response
        .headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response
}

const PAGE_HTML: &str = include_str!("page/index.html");
const PAGE_JS: &str = include_str!("page/app.js");
const PAGE_CSS: &str = include_str!("page/app.css");

/// The page's own files only: no other origin, no inline script.
const PAGE_POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
     connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; \
     frame-ancestors 'none'";

fn page_file(content_type: &'static str, body: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CONTENT_SECURITY_POLICY, PAGE_POLICY),
            (header::REFERRER_POLICY, "no-referrer"),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
        .into_response()
}

async fn page_html() -> Response {
    page_file("text/html; charset=utf-8", PAGE_HTML)
}

async fn page_js() -> Response {
    page_file("text/javascript; charset=utf-8", PAGE_JS)
}

async fn page_css() -> Response {
    page_file("text/css; charset=utf-8", PAGE_CSS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_compare_equal_only_when_equal() {
        assert!(same_secret("abc", "abc"));
        assert!(!same_secret("abd", "abc"));
        assert!(!same_secret("ab", "abc"));
        assert!(!same_secret("abcd", "abc"));
        assert!(!same_secret("", "abc"));
    }

    #[test]
    fn a_short_token_is_refused_before_anything_starts() {
        let err = AppState::new(Path::new("/nonexistent/keel.db"), " short ")
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains("too short (5 characters)"), "{err}");
    }

    #[test]
    fn an_address_in_use_is_refused_with_advice() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap_or_else(|e| panic!("{e}"));
        let addr = taken.local_addr().unwrap_or_else(|e| panic!("{e}"));
        let config = ServeConfig {
            store: dir.path().join("keel.db"),
            addr,
            token: "0123456789abcdef0123".into(),
        };
        let err = serve(config)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains(&format!("cannot listen on {addr}")), "{err}");
        assert!(err.contains("another `keel serve`"), "{err}");
    }

    #[test]
    fn tokens_are_64_hex_digits_and_differ() {
        let a = new_token().unwrap_or_default();
        let b = new_token().unwrap_or_default();
        assert_eq!(a.len(), 64);
        assert!(a.chars().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(a, b);
    }
}
