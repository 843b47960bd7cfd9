//! A small MCP server fixture (stdio and streamable HTTP) for tests.
//!
//! Tools:
//! - `echo {text}` returns `text` (read-only);
//! - `add {a, b}` returns the sum as text and as structured content `{"sum": …}` (read-only,
//!   idempotent);
//! - `record {entry}` appends the line `entry` to the log file and returns `recorded N`, N being
//!   the number of lines in the log afterwards (not read-only, not idempotent), so a test can prove
//!   a call happened exactly once;
//! - `pixel {}` returns a one-pixel PNG image and a text part (read-only);
//! - `fail {}` returns a tool error (`isError: true`);
//! - `sleep {ms}` waits `ms` milliseconds and returns `slept`, or stops early when the client
//!   cancels the request (for timeouts and cancellation);
//! - `crash {}` (stdio only) writes a line to stderr and exits the process with status 7.
//!
//! The stdio server writes one line to stderr when it starts (`keel-mcp-fixture: serving on
//! stdio`), so clients that capture stderr have something to show.

use std::io::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, ErrorData,
    ListToolsResult, PaginatedRequestParams, ServerCapabilities, ServerConfig, Tool,
    ToolAnnotations,
};
use rmcp::service::RequestContext;
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use rmcp::{RoleServer, ServerHandler, ServiceExt as _};
use serde_json::{Map, Value, json};
use tokio_util::sync::CancellationToken;

/// The environment variable naming the log file of `record` for [`serve_stdio`].
pub const LOG_ENV: &str = "KEEL_MCP_FIXTURE_LOG";

/// The stderr line the stdio server prints when it starts.
pub const STDERR_BANNER: &str = "keel-mcp-fixture: serving on stdio";

/// A 1×1 transparent PNG (67 bytes), base64-encoded.
const PIXEL_PNG_BASE64: &str = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg==";

/// The decoded size of [`PIXEL_PNG_BASE64`].
pub const PIXEL_PNG_BYTES: usize = 70;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The fixture's MCP server handler.
#[derive(Clone, Debug)]
pub struct FixtureServer {
    log: Option<PathBuf>,
    allow_crash: bool,
    lock: Arc<Mutex<()>>,
}

impl FixtureServer {
    /// A server whose `record` appends to `log` (or fails with a tool error when `None`).
    /// `allow_crash` offers the `crash` tool, which exits the process: stdio servers only.
    pub fn new(log: Option<PathBuf>, allow_crash: bool) -> Self {
        Self {
            log,
            allow_crash,
            lock: Arc::new(Mutex::new(())),
        }
    }

    fn tools(&self) -> Vec<Tool> {
        let mut tools = vec![
            tool(
                "echo",
                "Return the given text unchanged.",
                json!({
                    "type": "object",
                    "properties": {"text": {"type": "string", "description": "The text to return."}},
                    "required": ["text"],
                }),
                ToolAnnotations::new().read_only(true),
            ),
            tool(
                "add",
                "Add two numbers.",
                json!({
                    "type": "object",
                    "properties": {
                        "a": {"type": "number"},
                        "b": {"type": "number"},
                    },
                    "required": ["a", "b"],
                }),
                ToolAnnotations::new().read_only(true).idempotent(true),
            ),
            tool(
                "record",
                "Append an entry to the fixture's log and return how many entries it holds.",
                json!({
                    "type": "object",
                    "properties": {"entry": {"type": "string"}},
                    "required": ["entry"],
                }),
                ToolAnnotations::new()
                    .read_only(false)
                    .destructive(false)
                    .idempotent(false),
            ),
            tool(
                "pixel",
                "Return a one-pixel PNG.",
                json!({"type": "object", "properties": {}}),
                ToolAnnotations::new().read_only(true),
            ),
            tool(
                "sleep",
                "Wait the given number of milliseconds, then return `slept`.",
                json!({
                    "type": "object",
                    "properties": {"ms": {"type": "integer", "minimum": 0}},
                    "required": ["ms"],
                }),
                ToolAnnotations::new().read_only(true).idempotent(true),
            ),
            tool(
                "fail",
                "Always fail with a tool error.",
                json!({"type": "object", "properties": {}}),
                ToolAnnotations::new(),
            ),
        ];
        if self.allow_crash {
            tools.push(tool(
                "crash",
                "Write to stderr and exit the server process with status 7.",
                json!({"type": "object", "properties": {}}),
                ToolAnnotations::new().destructive(true),
            ));
        }
        tools
    }

    fn call(&self, name: &str, args: &Map<String, Value>) -> Result<CallToolResult, ErrorData> {
        match name {
            "echo" => {
                let text = string_arg(args, "text")?;
                Ok(CallToolResult::success(vec![ContentBlock::text(text)]))
            }
            "add" => {
                let a = number_arg(args, "a")?;
                let b = number_arg(args, "b")?;
                let sum = a + b;
                let mut result = CallToolResult::success(vec![ContentBlock::text(sum.to_string())]);
                result.structured_content = Some(json!({"sum": sum}));
                Ok(result)
            }
            "record" => {
                let entry = string_arg(args, "entry")?;
                Ok(match self.record(&entry) {
                    Ok(n) => {
                        CallToolResult::success(vec![ContentBlock::text(format!("recorded {n}"))])
                    }
                    Err(e) => CallToolResult::error(vec![ContentBlock::text(e)]),
                })
            }
            "pixel" => Ok(CallToolResult::success(vec![
                ContentBlock::text("a pixel"),
                ContentBlock::image(PIXEL_PNG_BASE64, "image/png"),
            ])),
            "fail" => Ok(CallToolResult::error(vec![ContentBlock::text(
                "fixture failure: the fail tool always fails",
            )])),
            "crash" if self.allow_crash => {
                eprintln!("keel-mcp-fixture: crashing on request");
                std::process::exit(7);
            }
            other => Err(ErrorData::invalid_params(
                format!("unknown tool `{other}`"),
                None,
            )),
        }
    }

    fn record(&self, entry: &str) -> Result<usize, String> {
        let Some(log) = &self.log else {
            return Err(format!(
                "record: no log file; set {LOG_ENV} or construct the fixture with a log path"
            ));
        };
        let _guard = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        append_line(log, entry).map_err(|e| format!("record: {}: {e}", log.display()))?;
        let text = std::fs::read_to_string(log)
            .map_err(|e| format!("record: reading {}: {e}", log.display()))?;
        Ok(text.lines().count())
    }
}

fn append_line(log: &Path, entry: &str) -> std::io::Result<()> {
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)?;
    writeln!(file, "{entry}")?;
    file.sync_all()
}

fn tool(
    name: &'static str,
    description: &'static str,
    schema: Value,
    ann: ToolAnnotations,
) -> Tool {
    let schema = match schema {
        Value::Object(map) => map,
        _ => Map::new(),
    };
    let mut tool = Tool::new(name, description, schema);
    tool.annotations = Some(ann);
    tool
}

fn string_arg(args: &Map<String, Value>, name: &str) -> Result<String, ErrorData> {
    match args.get(name) {
        Some(Value::String(s)) => Ok(s.clone()),
        _ => Err(ErrorData::invalid_params(
            format!("argument `{name}` must be a string"),
            None,
        )),
    }
}

fn number_arg(args: &Map<String, Value>, name: &str) -> Result<f64, ErrorData> {
    match args.get(name).and_then(Value::as_f64) {
        Some(n) => Ok(n),
        None => Err(ErrorData::invalid_params(
            format!("argument `{name}` must be a number"),
            None,
        )),
    }
}

impl ServerHandler for FixtureServer {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_instructions("keel's MCP test fixture")
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        Ok(ListToolsResult::with_all_items(self.tools()))
    }

    fn get_tool(&self, name: &str) -> Option<Tool> {
        self.tools().into_iter().find(|t| t.name == name)
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let args = request.arguments.unwrap_or_default();
        if request.name == "sleep" {
            let ms = number_arg(&args, "ms")?;
            let ms = if ms.is_finite() && ms > 0.0 {
                ms as u64
            } else {
                0
            };
            let sleep = tokio::time::sleep(std::time::Duration::from_millis(ms));
            return tokio::select! {
                () = sleep => Ok(CallToolResult::success(vec![ContentBlock::text("slept")]).into()),
                () = context.ct.cancelled() => Ok(CallToolResult::error(vec![ContentBlock::text(
                    "sleep cancelled",
                )])
                .into()),
            };
        }
        self.call(&request.name, &args).map(Into::into)
    }
}

/// Serve the fixture on stdin/stdout until stdin closes (blocking). `record` logs to the file
/// named by [`LOG_ENV`].
pub fn serve_stdio() -> Result<(), BoxError> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let log = std::env::var_os(LOG_ENV).map(PathBuf::from);
    eprintln!("{STDERR_BANNER}");
    runtime.block_on(async move {
        let running = FixtureServer::new(log, true)
            .serve(rmcp::transport::stdio())
            .await?;
        running.waiting().await?;
        Ok::<(), BoxError>(())
    })?;
    runtime.shutdown_background();
    Ok(())
}

/// Serve the fixture over streamable HTTP at `http://ADDR/mcp` in the foreground (blocking,
/// until the process is killed).
pub fn serve_http(addr: SocketAddr, log: Option<PathBuf>) -> Result<(), BoxError> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(addr).await?;
        eprintln!(
            "keel-mcp-fixture: serving on http://{}/mcp",
            listener.local_addr()?
        );
        let ct = CancellationToken::new();
        axum::serve(listener, router(log, ct)).await?;
        Ok::<(), BoxError>(())
    })
}

fn router(log: Option<PathBuf>, ct: CancellationToken) -> axum::Router {
    let config = StreamableHttpServerConfig::default().with_cancellation_token(ct);
    let service: StreamableHttpService<FixtureServer, LocalSessionManager> =
        StreamableHttpService::new(
            move || Ok(FixtureServer::new(log.clone(), false)),
            Default::default(),
            config,
        );
    axum::Router::new().nest_service("/mcp", service)
}

/// A streamable-HTTP fixture server on loopback, in a background thread with its own runtime.
/// Dropping it stops the server.
#[derive(Debug)]
pub struct HttpFixture {
    url: String,
    addr: SocketAddr,
    ct: CancellationToken,
    thread: Option<JoinHandle<()>>,
}

impl HttpFixture {
    /// The MCP endpoint, `http://127.0.0.1:PORT/mcp`.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The address the server listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for HttpFixture {
    fn drop(&mut self) {
        self.ct.cancel();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Start the fixture over streamable HTTP on `127.0.0.1:0`; `record` appends to `log`.
pub fn spawn_http(log: PathBuf) -> std::io::Result<HttpFixture> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let std_listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    std_listener.set_nonblocking(true)?;
    let addr = std_listener.local_addr()?;
    let listener = {
        let _enter = runtime.enter();
        tokio::net::TcpListener::from_std(std_listener)?
    };
    let ct = CancellationToken::new();
    let app = router(Some(log), ct.child_token());
    let stop = ct.clone();
    let thread = std::thread::Builder::new()
        .name("keel-mcp-http-fixture".to_owned())
        .spawn(move || {
            runtime.block_on(async move {
                tokio::select! {
                    _ = axum::serve(listener, app) => {}
                    () = stop.cancelled() => {}
                }
            });
            runtime.shutdown_background();
        })?;
    Ok(HttpFixture {
        url: format!("http://{addr}/mcp"),
        addr,
        ct,
        thread: Some(thread),
    })
}

/// The path of the `keel-mcp-fixture` binary, next to the running test executable
/// (`target/<profile>/`). `cargo test --workspace` (or `-p keel-test-support`) builds it; when it
/// is missing, or older than the fixture's sources, it is built once here with the same cargo,
/// profile and target directory. (Not unconditionally: a `cargo build -p keel-test-support`
/// resolves features differently from a workspace build and would recompile shared
/// dependencies.)
pub fn fixture_binary() -> Result<std::path::PathBuf, String> {
    use std::path::Path;
    static BIN: std::sync::OnceLock<Result<std::path::PathBuf, String>> =
        std::sync::OnceLock::new();
    BIN.get_or_init(|| {
        let exe = std::env::current_exe().map_err(|e| format!("current_exe: {e}"))?;
        // target/<profile>/deps/<test>-HASH
        let profile_dir = exe
            .parent()
            .and_then(Path::parent)
            .ok_or("the test executable is not in target/<profile>/deps")?
            .to_owned();
        let target_dir = profile_dir
            .parent()
            .ok_or("the profile directory has no parent")?
            .to_owned();
        let bin = profile_dir.join(format!("keel-mcp-fixture{}", std::env::consts::EXE_SUFFIX));
        let support = Path::new(env!("CARGO_MANIFEST_DIR"));
        let modified = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
        let newest_source = ["src/mcp.rs", "src/bin/keel-mcp-fixture.rs", "Cargo.toml"]
            .iter()
            .filter_map(|f| modified(&support.join(f)))
            .max();
        let fresh = match (modified(&bin), newest_source) {
            (Some(built), Some(source)) => built >= source,
            (Some(_), None) => true,
            (None, _) => false,
        };
        if !fresh {
            let cargo = std::env::var_os("CARGO")
                .or_else(|| option_env!("CARGO").map(Into::into))
                .unwrap_or_else(|| "cargo".into());
            let mut cmd = std::process::Command::new(cargo);
            cmd.args([
                "build",
                "--quiet",
                "-p",
                "keel-test-support",
                "--bin",
                "keel-mcp-fixture",
            ])
            .env("CARGO_TARGET_DIR", &target_dir)
            .current_dir(support);
            if profile_dir.file_name().is_some_and(|n| n == "release") {
                cmd.arg("--release");
            }
            let status = cmd
                .status()
                .map_err(|e| format!("cannot run cargo to build keel-mcp-fixture: {e}"))?;
            if !status.success() || !bin.exists() {
                return Err(format!(
                    "building keel-mcp-fixture failed ({status}); {} is missing",
                    bin.display()
                ));
            }
        }
        Ok(bin)
    })
    .clone()
}
