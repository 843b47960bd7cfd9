//! MCP (Model Context Protocol) tool sources for keel: a blocking client over the official Rust
//! SDK (`rmcp`), for servers reached over stdio (a child process) or streamable HTTP.
//!
//! keel's engine is synchronous, so [`McpClient`] owns a small tokio runtime (one worker thread)
//! and blocks on it. Each client is one server connection; its tools are listed once, at connect.
//! Tool names are namespaced by keel as `server.tool` ([`qualified`], [`split_qualified`]).
//!
//! The JSON translation is pure and separate ([`parse_tool_list`], [`parse_call_result`]).

mod client;
mod error;
mod parse;

use std::path::PathBuf;

pub use client::McpClient;
pub use error::McpError;
pub use parse::{
    ParseError, base64_decoded_len, describe_content, parse_call_result, parse_tool,
    parse_tool_list,
};

/// How to reach an MCP server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ServerSpec {
    /// A child process speaking MCP on its stdin/stdout.
    Stdio {
        /// The program and its arguments (no shell).
        command: Vec<String>,
        /// The complete environment of the child (nothing is inherited).
        env: Vec<(String, String)>,
        /// The child's working directory.
        cwd: PathBuf,
    },
    /// A streamable-HTTP MCP endpoint, e.g. `http://127.0.0.1:8080/mcp`.
    Http {
        /// The endpoint URL (`http://` or `https://`).
        url: String,
    },
}

/// A tool a server offers.
#[derive(Debug, Clone, PartialEq)]
pub struct McpTool {
    /// The tool's name on its server (not qualified).
    pub name: String,
    /// Its description ("" when the server gives none).
    pub description: String,
    /// The JSON Schema (an object) of its arguments.
    pub input_schema: serde_json::Value,
    /// `annotations.readOnlyHint`, if the server gave it.
    pub read_only_hint: Option<bool>,
    /// `annotations.destructiveHint`, if the server gave it.
    pub destructive_hint: Option<bool>,
    /// `annotations.idempotentHint`, if the server gave it.
    pub idempotent_hint: Option<bool>,
}

/// The result of a tool call that reached the tool.
#[derive(Debug, Clone, PartialEq)]
pub struct CallOutcome {
    /// The server marked the result as a tool error (`isError`).
    pub is_error: bool,
    /// The text content parts joined with newlines; other parts described like
    /// `[image/png, 1234 bytes]`.
    pub text: String,
    /// `structuredContent`, if the server gave it.
    pub structured: Option<serde_json::Value>,
}

/// The separator between a server name and a tool name in a qualified tool name.
pub const QUALIFIER: char = '.';

/// `server.tool`, the name keel gives a server's tool.
pub fn qualified(server: &str, tool: &str) -> String {
    format!("{server}{QUALIFIER}{tool}")
}

/// Split `server.tool` at the first `.` (a server name has no `.`; a tool name may). `None` when
/// there is no `.` or either side is empty.
pub fn split_qualified(name: &str) -> Option<(&str, &str)> {
    let (server, tool) = name.split_once(QUALIFIER)?;
    if server.is_empty() || tool.is_empty() {
        return None;
    }
    Some((server, tool))
}

/// Whether `name` can be a server name: 1 to 64 ASCII letters, digits, `_` or `-` (so it never
/// contains the qualifier and a qualified name splits back unambiguously).
pub fn valid_server_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    #[test]
    fn qualify_and_split() {
        assert_eq!(qualified("fs", "read"), "fs.read");
        assert_eq!(split_qualified("fs.read"), Some(("fs", "read")));
        assert_eq!(split_qualified("fs.read.v2"), Some(("fs", "read.v2")));
        assert_eq!(split_qualified("read"), None);
        assert_eq!(split_qualified(".read"), None);
        assert_eq!(split_qualified("fs."), None);
        assert_eq!(split_qualified(""), None);
    }

    #[test]
    fn split_inverts_qualified_for_valid_server_names() {
        for server in ["a", "my-server", "s_1"] {
            for tool in ["t", "t.x", "a.b.c", "x-y"] {
                assert!(valid_server_name(server));
                assert_eq!(
                    split_qualified(&qualified(server, tool)),
                    Some((server, tool))
                );
            }
        }
    }

    #[test]
    fn server_names() {
        assert!(valid_server_name("github"));
        assert!(!valid_server_name(""));
        assert!(!valid_server_name("a.b"));
        assert!(!valid_server_name("a b"));
        assert!(!valid_server_name(&"x".repeat(65)));
    }
}
