//! keel-mcp's errors. Each names the server and its command or URL, and says what failed.

use std::path::PathBuf;
use std::time::Duration;

use crate::ParseError;

/// Something went wrong talking to an MCP server.
///
/// `target` is `command `prog arg…`` for a stdio server or `URL http://…` for an HTTP one.
/// `stderr` is the last few KB a stdio server wrote to its stderr (empty otherwise).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum McpError {
    /// The stdio spec has no program.
    #[error("MCP server `{server}`: the command is empty; give the program and its arguments")]
    EmptyCommand {
        /// The server's name.
        server: String,
    },

    /// The HTTP spec's URL is not `http://` or `https://`.
    #[error(
        "MCP server `{server}`: `{url}` is not an HTTP URL; give one like http://127.0.0.1:8080/mcp"
    )]
    InvalidUrl {
        /// The server's name.
        server: String,
        /// The URL given.
        url: String,
    },

    /// The client's own async runtime could not be built.
    #[error("MCP server `{server}`: could not start the client's async runtime: {source}")]
    Runtime {
        /// The server's name.
        server: String,
        /// Why.
        source: std::io::Error,
    },

    /// The blocking client was used on a thread that runs a tokio runtime.
    #[error(
        "MCP server `{server}`: the blocking MCP client was called from inside an async runtime; \
         call it from a plain thread (for example through tokio::task::spawn_blocking)"
    )]
    InsideAsyncRuntime {
        /// The server's name.
        server: String,
    },

    /// The stdio server's program could not be started.
    #[error(
        "MCP server `{server}`: could not start {target} in {cwd}: {source}; check that the \
         program exists, is executable and is on the PATH given in the server's env"
    )]
    Spawn {
        /// The server's name.
        server: String,
        /// The command.
        target: String,
        /// The working directory.
        cwd: PathBuf,
        /// Why.
        source: std::io::Error,
    },

    /// The server did not complete the `initialize` handshake or the tool listing.
    #[error("MCP server `{server}` ({target}): {what} failed: {reason}{}", stderr_section(.stderr))]
    Handshake {
        /// The server's name.
        server: String,
        /// Its command or URL.
        target: String,
        /// `initialize` or `tools/list`.
        what: &'static str,
        /// What went wrong (for a stdio server, including how it exited if it did).
        reason: String,
        /// The tail of its stderr.
        stderr: String,
    },

    /// The handshake and tool listing took longer than the connect timeout.
    #[error(
        "MCP server `{server}` ({target}) did not answer `initialize` and `tools/list` within \
         {timeout:?}; check that it is an MCP server for this transport{}",
        stderr_section(.stderr)
    )]
    ConnectTimeout {
        /// The server's name.
        server: String,
        /// Its command or URL.
        target: String,
        /// The timeout.
        timeout: Duration,
        /// The tail of its stderr.
        stderr: String,
    },

    /// The server sent something keel cannot use.
    #[error("MCP server `{server}` ({target}) sent an invalid {what}: {source}")]
    InvalidResponse {
        /// The server's name.
        server: String,
        /// Its command or URL.
        target: String,
        /// `tool list` or `result for tool `x``.
        what: String,
        /// The problem.
        source: ParseError,
    },

    /// The tool is not in the server's tool list.
    #[error("MCP server `{server}` has no tool `{tool}`; it offers: {available}")]
    UnknownTool {
        /// The server's name.
        server: String,
        /// The tool asked for.
        tool: String,
        /// The server's tools, comma-separated (or `no tools`).
        available: String,
    },

    /// The server answered the call with a JSON-RPC error (the tool did not run, or crashed).
    #[error(
        "MCP server `{server}` ({target}) refused the call to `{tool}`: error {code}: {message}"
    )]
    Rpc {
        /// The server's name.
        server: String,
        /// Its command or URL.
        target: String,
        /// The tool.
        tool: String,
        /// The JSON-RPC error code.
        code: i32,
        /// The server's message.
        message: String,
    },

    /// The call did not complete: the connection broke or the server died.
    #[error("MCP server `{server}` ({target}): calling `{tool}` failed: {reason}{}", stderr_section(.stderr))]
    Call {
        /// The server's name.
        server: String,
        /// Its command or URL.
        target: String,
        /// The tool.
        tool: String,
        /// What went wrong (for a stdio server, including how it exited if it did).
        reason: String,
        /// The tail of its stderr.
        stderr: String,
    },

    /// The call took longer than its timeout (a cancellation was sent to the server).
    #[error(
        "MCP server `{server}` ({target}): `{tool}` did not finish within {timeout:?}; the call \
         was cancelled (the tool may still have had effects)"
    )]
    CallTimeout {
        /// The server's name.
        server: String,
        /// Its command or URL.
        target: String,
        /// The tool.
        tool: String,
        /// The timeout.
        timeout: Duration,
    },

    /// The client was closed.
    #[error("MCP server `{server}`: the client is closed")]
    Closed {
        /// The server's name.
        server: String,
    },
}

fn stderr_section(stderr: &str) -> String {
    let trimmed = stderr.trim_end();
    if trimmed.is_empty() {
        String::new()
    } else {
        format!("\n--- the server's stderr (last lines) ---\n{trimmed}")
    }
}

/// `error` and its sources, joined with ": " (sources whose text the message already holds are
/// skipped). Looks through the SDK's HTTP client error, which hides its cause.
pub(crate) fn chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut next = deeper(error);
    while let Some(e) = next {
        let part = e.to_string();
        if !text.contains(&part) {
            text.push_str(": ");
            text.push_str(&part);
        }
        next = deeper(e);
    }
    text
}

type HttpError = rmcp::transport::streamable_http_client::StreamableHttpError<reqwest::Error>;

fn deeper<'a>(
    error: &'a (dyn std::error::Error + 'static),
) -> Option<&'a (dyn std::error::Error + 'static)> {
    if let Some(HttpError::Client(inner)) = error.downcast_ref::<HttpError>() {
        return Some(inner);
    }
    error.source()
}

/// A handshake error without the SDK's type names.
pub(crate) fn describe_init_error(error: &rmcp::service::ClientInitializeError) -> String {
    use rmcp::service::ClientInitializeError as E;
    match error {
        E::TransportError { error, context } => format!("{context}: {}", chain(&*error.error)),
        E::JsonRpcError(data) => format!(
            "the server answered with error {}: {}",
            data.code.0, data.message
        ),
        other => chain(other),
    }
}

/// A request error without the SDK's type names.
pub(crate) fn describe_service_error(error: &rmcp::service::ServiceError) -> String {
    use rmcp::service::ServiceError as E;
    match error {
        E::TransportSend(error) => chain(&*error.error),
        E::McpError(data) => format!(
            "the server answered with error {}: {}",
            data.code.0, data.message
        ),
        E::TransportClosed => "the connection closed".to_owned(),
        other => chain(other),
    }
}
