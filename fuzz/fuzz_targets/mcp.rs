//! What an MCP server answers to `tools/list` and `tools/call`, through keel's parsers of them
//! (which take JSON: bytes that are not JSON never reach them).
#![no_main]

use keel_test_support::oracle::mcp::check_all;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Ok(value) = serde_json::from_slice::<serde_json::Value>(data) {
        check_all(&value);
    }
});
