//! keel's MCP test fixture server.
//!
//! `keel-mcp-fixture` serves on stdin/stdout (`record` logs to `$KEEL_MCP_FIXTURE_LOG`);
//! `keel-mcp-fixture --http ADDR` serves streamable HTTP at `http://ADDR/mcp` in the foreground.

use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.as_slice() {
        [] => keel_test_support::mcp::serve_stdio(),
        [flag, addr] if flag == "--http" => match addr.parse() {
            Ok(addr) => keel_test_support::mcp::serve_http(
                addr,
                std::env::var_os(keel_test_support::mcp::LOG_ENV).map(Into::into),
            ),
            Err(e) => {
                Err(format!("--http {addr}: not a socket address ({e}); try 127.0.0.1:8080").into())
            }
        },
        _ => Err("usage: keel-mcp-fixture [--http ADDR]".into()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("keel-mcp-fixture: {e}");
            ExitCode::FAILURE
        }
    }
}
