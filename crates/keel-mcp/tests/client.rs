#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The blocking client against keel-test-support's MCP fixture, over stdio (the
//! `keel-mcp-fixture` binary) and streamable HTTP (in-process), and against servers that fail.

use std::path::Path;
use std::time::Duration;

use keel_mcp::{McpClient, McpError, ServerSpec};
use keel_test_support::mcp::{PIXEL_PNG_BYTES, STDERR_BANNER, spawn_http};
use serde_json::{Map, Value, json};

/// Generous: nothing here waits for it unless something is broken.
const TIMEOUT: Duration = Duration::from_secs(30);

/// The MCP fixture server's binary (see `keel_test_support::mcp::fixture_binary`).
fn fixture_bin() -> std::path::PathBuf {
    keel_test_support::mcp::fixture_binary().unwrap()
}

fn stdio_spec(log: &Path) -> ServerSpec {
    ServerSpec::Stdio {
        command: vec![fixture_bin().display().to_string()],
        env: vec![("KEEL_MCP_FIXTURE_LOG".to_owned(), log.display().to_string())],
        cwd: log.parent().unwrap().to_owned(),
    }
}

fn args(value: Value) -> Map<String, Value> {
    match value {
        Value::Object(map) => map,
        _ => panic!("arguments must be an object"),
    }
}

fn sh(script: &str) -> ServerSpec {
    ServerSpec::Stdio {
        command: vec!["/bin/sh".to_owned(), "-c".to_owned(), script.to_owned()],
        env: vec![],
        cwd: std::env::temp_dir(),
    }
}

fn gone(pid: u32) -> bool {
    let pid = nix::unistd::Pid::from_raw(i32::try_from(pid).unwrap());
    matches!(
        nix::sys::signal::kill(pid, None),
        Err(nix::errno::Errno::ESRCH)
    )
}

/// What both transports must do the same way.
fn exercise(client: &McpClient, log: &Path) {
    let names: Vec<&str> = client.tools().iter().map(|t| t.name.as_str()).collect();
    for expected in ["echo", "add", "record", "pixel", "sleep", "fail"] {
        assert!(
            names.contains(&expected),
            "{expected} missing from {names:?}"
        );
    }

    let echo = client.tools().iter().find(|t| t.name == "echo").unwrap();
    assert_eq!(echo.description, "Return the given text unchanged.");
    assert_eq!(echo.input_schema["type"], "object");
    assert_eq!(echo.input_schema["required"], json!(["text"]));
    assert_eq!(echo.input_schema["properties"]["text"]["type"], "string");
    assert_eq!(echo.read_only_hint, Some(true));
    assert_eq!(echo.idempotent_hint, None);

    let add = client.tools().iter().find(|t| t.name == "add").unwrap();
    assert_eq!(add.read_only_hint, Some(true));
    assert_eq!(add.idempotent_hint, Some(true));

    let record = client.tools().iter().find(|t| t.name == "record").unwrap();
    assert_eq!(record.read_only_hint, Some(false));
    assert_eq!(record.destructive_hint, Some(false));
    assert_eq!(record.idempotent_hint, Some(false));

    let fail = client.tools().iter().find(|t| t.name == "fail").unwrap();
    assert_eq!(fail.read_only_hint, None);

    let out = client
        .call("echo", args(json!({"text": "héllo\nworld"})), TIMEOUT)
        .unwrap();
    assert!(!out.is_error);
    assert_eq!(out.text, "héllo\nworld");
    assert_eq!(out.structured, None);

    let out = client
        .call("add", args(json!({"a": 2, "b": 3.5})), TIMEOUT)
        .unwrap();
    assert!(!out.is_error);
    assert_eq!(out.text, "5.5");
    assert_eq!(out.structured, Some(json!({"sum": 5.5})));

    let first = client
        .call("record", args(json!({"entry": "one"})), TIMEOUT)
        .unwrap();
    assert_eq!(first.text, "recorded 1");
    let second = client
        .call("record", args(json!({"entry": "two"})), TIMEOUT)
        .unwrap();
    assert_eq!(second.text, "recorded 2");
    assert_eq!(std::fs::read_to_string(log).unwrap(), "one\ntwo\n");

    let out = client.call("pixel", Map::new(), TIMEOUT).unwrap();
    assert_eq!(
        out.text,
        format!("a pixel\n[image/png, {PIXEL_PNG_BYTES} bytes]")
    );

    let out = client.call("fail", Map::new(), TIMEOUT).unwrap();
    assert!(out.is_error);
    assert!(out.text.contains("always fails"), "{}", out.text);

    // Unknown tool: refused locally, naming what the server has.
    let err = client.call("nope", Map::new(), TIMEOUT).unwrap_err();
    assert!(matches!(err, McpError::UnknownTool { .. }), "{err:?}");
    let msg = err.to_string();
    eprintln!("{msg}");
    assert!(msg.contains("no tool `nope`"), "{msg}");
    assert!(msg.contains("echo, add, record"), "{msg}");

    // Bad arguments: the server's JSON-RPC error, with its message.
    let err = client
        .call("add", args(json!({"a": "x", "b": 1})), TIMEOUT)
        .unwrap_err();
    assert!(matches!(err, McpError::Rpc { .. }), "{err:?}");
    assert!(err.to_string().contains("`a` must be a number"), "{err}");

    // A call that outlives its timeout is an error; the connection stays usable.
    let err = client
        .call(
            "sleep",
            args(json!({"ms": 60_000})),
            Duration::from_millis(200),
        )
        .unwrap_err();
    assert!(matches!(err, McpError::CallTimeout { .. }), "{err:?}");
    assert!(err.to_string().contains("`sleep` did not finish"), "{err}");
    let out = client
        .call("echo", args(json!({"text": "still here"})), TIMEOUT)
        .unwrap();
    assert_eq!(out.text, "still here");

    // Nothing else reached `record`.
    assert_eq!(std::fs::read_to_string(log).unwrap().lines().count(), 2);
}

#[test]
fn stdio_fixture_lists_and_calls_tools() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("record.log");
    let client = McpClient::connect("fixture", &stdio_spec(&log), TIMEOUT).unwrap();
    assert_eq!(client.name(), "fixture");
    assert!(client.pid().is_some());
    assert!(client.tools().iter().any(|t| t.name == "crash"));
    exercise(&client, &log);
    let pid = client.pid().unwrap();
    client.close();
    assert!(gone(pid), "the server {pid} outlived close()");
}

#[test]
fn http_fixture_lists_and_calls_tools() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("record.log");
    let server = spawn_http(log.clone()).unwrap();
    assert!(server.url().starts_with("http://127.0.0.1:"));
    let spec = ServerSpec::Http {
        url: server.url().to_owned(),
    };
    let client = McpClient::connect("web", &spec, TIMEOUT).unwrap();
    assert_eq!(client.pid(), None);
    assert!(!client.tools().iter().any(|t| t.name == "crash"));
    exercise(&client, &log);
    client.close();

    // A second session sees the same log.
    let client = McpClient::connect("web", &spec, TIMEOUT).unwrap();
    let out = client
        .call("record", args(json!({"entry": "three"})), TIMEOUT)
        .unwrap();
    assert_eq!(out.text, "recorded 3");
    drop(client);
    drop(server);
}

#[test]
fn dropping_the_client_kills_the_stdio_server() {
    let dir = tempfile::tempdir().unwrap();
    let client =
        McpClient::connect("fixture", &stdio_spec(&dir.path().join("log")), TIMEOUT).unwrap();
    let pid = client.pid().unwrap();
    assert!(!gone(pid));
    drop(client);
    assert!(gone(pid), "the server {pid} outlived its client");
}

#[test]
fn dropping_the_client_kills_the_server_process_group() {
    // The server starts a grandchild in its group; both must go.
    let dir = tempfile::tempdir().unwrap();
    let pidfile = dir.path().join("grandchild.pid");
    let spec = ServerSpec::Stdio {
        command: vec![
            "/bin/sh".to_owned(),
            "-c".to_owned(),
            format!(
                "sleep 600 & echo $! > '{}'; exec '{}'",
                pidfile.display(),
                fixture_bin().display()
            ),
        ],
        env: vec![],
        cwd: dir.path().to_owned(),
    };
    let client = McpClient::connect("grouped", &spec, TIMEOUT).unwrap();
    let grandchild: u32 = std::fs::read_to_string(&pidfile)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert!(!gone(grandchild));
    drop(client);
    // The grandchild is not our child, so init reaps it; wait for that without a deadline
    // assertion (kill(0) succeeds on a zombie until it is reaped).
    while !gone(grandchild) {
        let stat = std::fs::read_to_string(format!("/proc/{grandchild}/stat")).unwrap_or_default();
        if stat.split_whitespace().nth(2) == Some("Z") || stat.is_empty() {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_missing_command_is_a_clear_error() {
    let spec = ServerSpec::Stdio {
        command: vec![
            "/nonexistent/keel-mcp-server".to_owned(),
            "--flag".to_owned(),
        ],
        env: vec![],
        cwd: std::env::temp_dir(),
    };
    let err = McpClient::connect("ghost", &spec, TIMEOUT).unwrap_err();
    assert!(matches!(err, McpError::Spawn { .. }), "{err:?}");
    let msg = err.to_string();
    eprintln!("{msg}");
    assert!(msg.contains("MCP server `ghost`"), "{msg}");
    assert!(msg.contains("/nonexistent/keel-mcp-server --flag"), "{msg}");
    assert!(msg.contains("No such file"), "{msg}");
}

#[test]
fn an_empty_command_is_a_clear_error() {
    let spec = ServerSpec::Stdio {
        command: vec![],
        env: vec![],
        cwd: std::env::temp_dir(),
    };
    let err = McpClient::connect("empty", &spec, TIMEOUT).unwrap_err();
    assert!(matches!(err, McpError::EmptyCommand { .. }), "{err:?}");
}

#[test]
fn a_server_that_exits_at_once_reports_its_status_and_stderr() {
    let err = McpClient::connect(
        "quitter",
        &sh("echo 'quitter: missing API token' >&2; exit 3"),
        TIMEOUT,
    )
    .unwrap_err();
    assert!(matches!(err, McpError::Handshake { .. }), "{err:?}");
    let msg = err.to_string();
    eprintln!("{msg}");
    assert!(msg.contains("MCP server `quitter`"), "{msg}");
    assert!(msg.contains("/bin/sh -c"), "{msg}");
    assert!(msg.contains("initialize failed"), "{msg}");
    assert!(msg.contains("exited with status 3"), "{msg}");
    assert!(msg.contains("quitter: missing API token"), "{msg}");
}

#[test]
fn a_server_that_writes_garbage_is_an_error_not_a_panic() {
    let dir = tempfile::tempdir().unwrap();
    let pidfile = dir.path().join("sleep.pid");
    let script = format!(
        "echo '{{not json'; echo 'garbage: hello' >&2; sleep 600 & echo $! > '{}'; wait",
        pidfile.display()
    );
    let err = McpClient::connect("garbage", &sh(&script), Duration::from_millis(1500)).unwrap_err();
    assert!(
        matches!(
            err,
            McpError::ConnectTimeout { .. } | McpError::Handshake { .. }
        ),
        "{err:?}"
    );
    let msg = err.to_string();
    eprintln!("{msg}");
    assert!(msg.contains("garbage: hello"), "{msg}");
    // The whole group was killed.
    if let Ok(pid) = std::fs::read_to_string(&pidfile) {
        let pid: u32 = pid.trim().parse().unwrap();
        while !gone(pid) {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            if stat.split_whitespace().nth(2) == Some("Z") || stat.is_empty() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

#[test]
fn a_server_that_dies_during_a_call_reports_its_status_and_stderr() {
    let dir = tempfile::tempdir().unwrap();
    let client =
        McpClient::connect("crasher", &stdio_spec(&dir.path().join("log")), TIMEOUT).unwrap();
    let err = client.call("crash", Map::new(), TIMEOUT).unwrap_err();
    assert!(matches!(err, McpError::Call { .. }), "{err:?}");
    let msg = err.to_string();
    eprintln!("{msg}");
    assert!(msg.contains("MCP server `crasher`"), "{msg}");
    assert!(msg.contains("calling `crash` failed"), "{msg}");
    assert!(msg.contains("exited with status 7"), "{msg}");
    assert!(msg.contains("crashing on request"), "{msg}");
    assert!(msg.contains(STDERR_BANNER), "{msg}");

    // Later calls fail cleanly too.
    let err = client
        .call("echo", args(json!({"text": "x"})), TIMEOUT)
        .unwrap_err();
    assert!(matches!(err, McpError::Call { .. }), "{err:?}");
}

#[test]
fn an_http_url_with_nothing_listening_is_a_clear_error() {
    // A port that was free a moment ago.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("http://127.0.0.1:{port}/mcp");
    let err =
        McpClient::connect("nobody", &ServerSpec::Http { url: url.clone() }, TIMEOUT).unwrap_err();
    assert!(matches!(err, McpError::Handshake { .. }), "{err:?}");
    let msg = err.to_string();
    eprintln!("{msg}");
    assert!(msg.contains("MCP server `nobody`"), "{msg}");
    assert!(msg.contains(&url), "{msg}");
    assert!(msg.contains("initialize failed"), "{msg}");
    assert!(msg.contains("Connection refused"), "{msg}");
}

#[test]
fn a_non_http_url_is_refused() {
    let err = McpClient::connect(
        "odd",
        &ServerSpec::Http {
            url: "ftp://127.0.0.1/mcp".to_owned(),
        },
        TIMEOUT,
    )
    .unwrap_err();
    assert!(matches!(err, McpError::InvalidUrl { .. }), "{err:?}");
}

#[test]
fn the_blocking_client_refuses_to_run_inside_an_async_runtime() {
    let dir = tempfile::tempdir().unwrap();
    let spec = stdio_spec(&dir.path().join("log"));
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let err = runtime
        .block_on(async { McpClient::connect("nested", &spec, TIMEOUT) })
        .unwrap_err();
    assert!(
        matches!(err, McpError::InsideAsyncRuntime { .. }),
        "{err:?}"
    );
    assert!(err.to_string().contains("spawn_blocking"), "{err}");
}

#[test]
fn calls_from_several_threads_share_one_connection() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("log");
    let client = McpClient::connect("shared", &stdio_spec(&log), TIMEOUT).unwrap();
    std::thread::scope(|s| {
        for i in 0..4 {
            let client = &client;
            s.spawn(move || {
                let out = client
                    .call("record", args(json!({"entry": format!("t{i}")})), TIMEOUT)
                    .unwrap();
                assert!(out.text.starts_with("recorded "), "{}", out.text);
            });
        }
    });
    assert_eq!(std::fs::read_to_string(&log).unwrap().lines().count(), 4);
}
