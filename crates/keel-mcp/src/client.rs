//! The blocking client: a tokio runtime of one worker thread per connection, the SDK's client
//! service on it, and for stdio servers the child process (in its own process group, stderr
//! captured).

use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use rmcp::model::{CallToolRequestParams, ClientCapabilities, ClientConfig, Implementation};
use rmcp::service::{RunningService, ServiceError};
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::{RoleClient, ServiceExt as _};
use serde_json::{Map, Value};
use tokio::io::AsyncReadExt as _;
use tokio::process::{Child, ChildStderr, Command};
use tokio::runtime::Runtime;
use tokio::task::JoinHandle;

use crate::error::{describe_init_error, describe_service_error};
use crate::{CallOutcome, McpError, McpTool, ServerSpec, parse_call_result, parse_tool_list};

/// How much of a stdio server's stderr is kept.
const STDERR_TAIL_BYTES: usize = 8 * 1024;
/// How long a server whose connection failed gets to exit by itself (its exit status is then part
/// of the error) before it is killed. A server that closed its stdout is normally exiting, so this
/// is rarely waited in full.
const EXIT_GRACE: Duration = Duration::from_secs(2);
/// On `close`: how long the server gets to exit after its stdin closes, and after SIGTERM.
const CLOSE_GRACE: Duration = Duration::from_secs(2);
/// Upper bound of each wait during teardown (session close, reaping, stderr drain).
const TEARDOWN_WAIT: Duration = Duration::from_secs(2);

type Service = RunningService<RoleClient, ClientConfig>;

/// A connection to one MCP server, used from synchronous code.
///
/// Connecting performs the `initialize` handshake and lists the server's tools (all pages).
/// Calls block the calling thread; the client is `Send + Sync` and calls from several threads
/// run concurrently on the connection. A stdio server is killed (with its process group) when
/// the client is closed or dropped.
pub struct McpClient {
    name: String,
    target: String,
    tools: Vec<McpTool>,
    conn: Option<Conn>,
}

struct Conn {
    runtime: Runtime,
    service: Option<Service>,
    child: Option<StdioChild>,
}

struct StdioChild {
    child: tokio::sync::Mutex<Child>,
    pid: Option<u32>,
    stderr: Arc<Mutex<Tail>>,
    stderr_task: Mutex<Option<JoinHandle<()>>>,
}

/// The last [`STDERR_TAIL_BYTES`] of a stream.
#[derive(Default)]
struct Tail {
    bytes: Vec<u8>,
    truncated: bool,
}

impl Tail {
    fn push(&mut self, chunk: &[u8]) {
        self.bytes.extend_from_slice(chunk);
        if self.bytes.len() > STDERR_TAIL_BYTES {
            let excess = self.bytes.len() - STDERR_TAIL_BYTES;
            self.bytes.drain(..excess);
            self.truncated = true;
        }
    }

    fn render(&self) -> String {
        let text = String::from_utf8_lossy(&self.bytes);
        if self.truncated {
            // Start at a line boundary when there is one.
            let rest = text.split_once('\n').map_or(&*text, |(_, rest)| rest);
            format!("[…]\n{rest}")
        } else {
            text.into_owned()
        }
    }
}

impl std::fmt::Debug for McpClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("McpClient")
            .field("name", &self.name)
            .field("target", &self.target)
            .field("tools", &self.tools.len())
            .field("pid", &self.pid())
            .finish_non_exhaustive()
    }
}

fn describe_target(spec: &ServerSpec) -> String {
    match spec {
        ServerSpec::Stdio { command, .. } => {
            let words: Vec<String> = command
                .iter()
                .map(|w| {
                    if w.is_empty()
                        || w.contains(|c: char| c.is_whitespace() || c == '"' || c == '\'')
                    {
                        format!("{w:?}")
                    } else {
                        w.clone()
                    }
                })
                .collect();
            format!("command `{}`", words.join(" "))
        }
        ServerSpec::Http { url } => format!("URL {url}"),
    }
}

fn client_config() -> ClientConfig {
    ClientConfig::new(
        ClientCapabilities::default(),
        Implementation::new("keel", env!("CARGO_PKG_VERSION")),
    )
}

fn inside_runtime() -> bool {
    tokio::runtime::Handle::try_current().is_ok()
}

fn signal_group(pid: Option<u32>, signal: Signal) {
    if let Some(pid) = pid.and_then(|p| i32::try_from(p).ok()) {
        // ESRCH (already gone) is fine.
        let _ = killpg(Pid::from_raw(pid), signal);
    }
}

fn describe_exit(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt as _;
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exited with status {code}"),
        (None, Some(signal)) => format!("was killed by signal {signal}"),
        (None, None) => format!("exited ({status})"),
    }
}

enum Stage {
    Initialize(Box<rmcp::service::ClientInitializeError>),
    ListTools(ServiceError),
}

impl McpClient {
    /// Connect to the server `name` (used in errors) as `spec` says: start it (stdio) or reach it
    /// (HTTP), perform the `initialize` handshake and list its tools, all within `timeout`.
    ///
    /// Must not be called from inside a tokio runtime (use `spawn_blocking`).
    pub fn connect(name: &str, spec: &ServerSpec, timeout: Duration) -> Result<Self, McpError> {
        let server = name.to_owned();
        if inside_runtime() {
            return Err(McpError::InsideAsyncRuntime { server });
        }
        let target = describe_target(spec);
        match spec {
            ServerSpec::Stdio { command, .. } if command.is_empty() => {
                return Err(McpError::EmptyCommand { server });
            }
            ServerSpec::Http { url }
                if !(url.starts_with("http://") || url.starts_with("https://")) =>
            {
                return Err(McpError::InvalidUrl {
                    server,
                    url: url.clone(),
                });
            }
            _ => {}
        }
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("keel-mcp")
            .enable_all()
            .build()
            .map_err(|source| McpError::Runtime {
                server: server.clone(),
                source,
            })?;
        let mut client = McpClient {
            name: server,
            target,
            tools: Vec::new(),
            conn: None,
        };
        match spec {
            ServerSpec::Stdio { command, env, cwd } => {
                client.connect_stdio(runtime, command, env, cwd, timeout)?;
            }
            ServerSpec::Http { url } => client.connect_http(runtime, url, timeout)?,
        }
        Ok(client)
    }

    fn connect_stdio(
        &mut self,
        runtime: Runtime,
        command: &[String],
        env: &[(String, String)],
        cwd: &std::path::Path,
        timeout: Duration,
    ) -> Result<(), McpError> {
        let spawn_error = |source: std::io::Error| McpError::Spawn {
            server: self.name.clone(),
            target: self.target.clone(),
            cwd: cwd.to_owned(),
            source,
        };
        let (program, args) = command
            .split_first()
            .ok_or_else(|| McpError::EmptyCommand {
                server: self.name.clone(),
            })?;
        let mut cmd = Command::new(program);
        cmd.args(args)
            .env_clear()
            .envs(env.iter().map(|(k, v)| (k, v)))
            .current_dir(cwd)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .process_group(0);
        let mut child = {
            let _enter = runtime.enter();
            cmd.spawn().map_err(spawn_error)?
        };
        let pid = child.id();
        let pipes = (child.stdout.take(), child.stdin.take(), child.stderr.take());
        let (Some(stdout), Some(stdin), Some(stderr_pipe)) = pipes else {
            signal_group(pid, Signal::SIGKILL);
            return Err(spawn_error(std::io::Error::other(
                "the child's stdin, stdout or stderr pipe is missing",
            )));
        };
        let stderr = Arc::new(Mutex::new(Tail::default()));
        let stderr_task = runtime.spawn(drain(stderr_pipe, stderr.clone()));
        let child = StdioChild {
            child: tokio::sync::Mutex::new(child),
            pid,
            stderr,
            stderr_task: Mutex::new(Some(stderr_task)),
        };
        let outcome = runtime.block_on(async move {
            tokio::time::timeout(timeout, async move {
                let service = client_config()
                    .serve((stdout, stdin))
                    .await
                    .map_err(|e| Stage::Initialize(Box::new(e)))?;
                let tools = service.list_all_tools().await.map_err(Stage::ListTools);
                Ok::<_, Stage>((service, tools))
            })
            .await
        });
        let mut conn = Conn {
            runtime,
            service: None,
            child: Some(child),
        };
        let failure = match outcome {
            Ok(Ok((service, Ok(tools)))) => {
                conn.service = Some(service);
                self.conn = Some(conn);
                return self.set_tools(&tools);
            }
            Ok(Ok((service, Err(stage)))) => {
                conn.service = Some(service);
                Ok(stage)
            }
            Ok(Err(stage)) => Ok(stage),
            Err(_elapsed) => Err(()),
        };
        let grace = if failure.is_ok() {
            EXIT_GRACE
        } else {
            Duration::ZERO
        };
        let (exit, stderr) = conn.failed_child_report(grace);
        conn.shutdown(false);
        Err(match failure {
            Ok(stage) => {
                let (what, error) = match &stage {
                    Stage::Initialize(e) => ("initialize", describe_init_error(e)),
                    Stage::ListTools(e) => ("tools/list", describe_service_error(e)),
                };
                let reason = match exit {
                    Some(exit) => format!("the server {exit} ({error})"),
                    None => error,
                };
                McpError::Handshake {
                    server: self.name.clone(),
                    target: self.target.clone(),
                    what,
                    reason,
                    stderr,
                }
            }
            Err(()) => McpError::ConnectTimeout {
                server: self.name.clone(),
                target: self.target.clone(),
                timeout,
                stderr,
            },
        })
    }

    fn connect_http(
        &mut self,
        runtime: Runtime,
        url: &str,
        timeout: Duration,
    ) -> Result<(), McpError> {
        let outcome = runtime.block_on(async {
            let transport = StreamableHttpClientTransport::from_uri(url);
            tokio::time::timeout(timeout, async move {
                let service = client_config()
                    .serve(transport)
                    .await
                    .map_err(|e| Stage::Initialize(Box::new(e)))?;
                let tools = service.list_all_tools().await.map_err(Stage::ListTools);
                Ok::<_, Stage>((service, tools))
            })
            .await
        });
        let mut conn = Conn {
            runtime,
            service: None,
            child: None,
        };
        let error = match outcome {
            Ok(Ok((service, Ok(tools)))) => {
                conn.service = Some(service);
                self.conn = Some(conn);
                return self.set_tools(&tools);
            }
            Ok(Ok((service, Err(stage)))) => {
                conn.service = Some(service);
                self.stage_error(stage)
            }
            Ok(Err(stage)) => self.stage_error(stage),
            Err(_elapsed) => McpError::ConnectTimeout {
                server: self.name.clone(),
                target: self.target.clone(),
                timeout,
                stderr: String::new(),
            },
        };
        conn.shutdown(false);
        Err(error)
    }

    fn stage_error(&self, stage: Stage) -> McpError {
        match stage {
            Stage::Initialize(e) => {
                let mut reason = describe_init_error(&e);
                if let Some(challenge) = e.auth_challenge() {
                    reason.push_str(&format!(
                        "; the server wants authorization ({challenge}), which keel does not do"
                    ));
                }
                self.handshake_error("initialize", reason)
            }
            Stage::ListTools(e) => self.handshake_error("tools/list", describe_service_error(&e)),
        }
    }

    fn handshake_error(&self, what: &'static str, reason: String) -> McpError {
        McpError::Handshake {
            server: self.name.clone(),
            target: self.target.clone(),
            what,
            reason,
            stderr: String::new(),
        }
    }

    fn set_tools(&mut self, tools: &[rmcp::model::Tool]) -> Result<(), McpError> {
        let parsed = serde_json::to_value(tools)
            .map_err(|e| crate::ParseError {
                at: "tools".to_owned(),
                problem: format!("could not re-encode the tool list: {e}"),
            })
            .and_then(|json| parse_tool_list(&json));
        match parsed {
            Ok(tools) => {
                self.tools = tools;
                Ok(())
            }
            Err(source) => {
                if let Some(conn) = self.conn.take() {
                    conn.shutdown(false);
                }
                Err(McpError::InvalidResponse {
                    server: self.name.clone(),
                    target: self.target.clone(),
                    what: "tool list".to_owned(),
                    source,
                })
            }
        }
    }

    /// The server's name, as given to [`McpClient::connect`].
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The server's tools, as listed at connect.
    pub fn tools(&self) -> &[McpTool] {
        &self.tools
    }

    /// The stdio server's process id (also its process group id); `None` for HTTP.
    pub fn pid(&self) -> Option<u32> {
        self.conn.as_ref()?.child.as_ref()?.pid
    }

    /// Call `tool` (its unqualified name) with `arguments`, waiting at most `timeout`.
    ///
    /// A tool error (`isError`) is an `Ok` outcome with `is_error` set; an `Err` means the tool
    /// is unknown, the server refused the call (JSON-RPC error), the connection broke or the
    /// call timed out (then the server is sent a cancellation). Must not be called from inside
    /// a tokio runtime.
    pub fn call(
        &self,
        tool: &str,
        arguments: Map<String, Value>,
        timeout: Duration,
    ) -> Result<CallOutcome, McpError> {
        let server = self.name.clone();
        if inside_runtime() {
            return Err(McpError::InsideAsyncRuntime { server });
        }
        let Some(conn) = &self.conn else {
            return Err(McpError::Closed { server });
        };
        let Some(service) = &conn.service else {
            return Err(McpError::Closed { server });
        };
        if !self.tools.iter().any(|t| t.name == tool) {
            let names: Vec<&str> = self.tools.iter().map(|t| t.name.as_str()).collect();
            return Err(McpError::UnknownTool {
                server,
                tool: tool.to_owned(),
                available: if names.is_empty() {
                    "no tools".to_owned()
                } else {
                    names.join(", ")
                },
            });
        }
        let mut params = CallToolRequestParams::new(tool.to_owned());
        params.arguments = Some(arguments);
        let peer = service.peer().clone();
        let outcome = conn
            .runtime
            .block_on(async move { tokio::time::timeout(timeout, peer.call_tool(params)).await });
        let call_error = |reason: String| {
            let (exit, stderr) = conn.child_report();
            McpError::Call {
                server: self.name.clone(),
                target: self.target.clone(),
                tool: tool.to_owned(),
                reason: match exit {
                    Some(exit) => format!("the server {exit} ({reason})"),
                    None => reason,
                },
                stderr,
            }
        };
        match outcome {
            Err(_elapsed) => Err(McpError::CallTimeout {
                server,
                target: self.target.clone(),
                tool: tool.to_owned(),
                timeout,
            }),
            Ok(Ok(result)) => serde_json::to_value(&result)
                .map_err(|e| crate::ParseError {
                    at: "result".to_owned(),
                    problem: format!("could not re-encode the result: {e}"),
                })
                .and_then(|json| parse_call_result(&json))
                .map_err(|source| McpError::InvalidResponse {
                    server,
                    target: self.target.clone(),
                    what: format!("result for tool `{tool}`"),
                    source,
                }),
            Ok(Err(ServiceError::McpError(e))) => Err(McpError::Rpc {
                server,
                target: self.target.clone(),
                tool: tool.to_owned(),
                code: e.code.0,
                message: e.message.into_owned(),
            }),
            Ok(Err(ServiceError::UnexpectedResponse)) => Err(call_error(
                "the server answered with something other than a tool result (keel supports \
                 neither input requests nor tasks)"
                    .to_owned(),
            )),
            Ok(Err(e)) => Err(call_error(describe_service_error(&e))),
        }
    }

    /// Close the connection: end the session; for a stdio server, close its stdin, give it two
    /// seconds to exit, then SIGTERM it (two more seconds) and SIGKILL its process group.
    /// Dropping the client instead SIGKILLs the process group at once.
    pub fn close(mut self) {
        if let Some(conn) = self.conn.take() {
            conn.shutdown(true);
        }
    }
}

impl Drop for McpClient {
    fn drop(&mut self) {
        if let Some(conn) = self.conn.take() {
            conn.shutdown(false);
        }
    }
}

async fn drain(mut pipe: ChildStderr, tail: Arc<Mutex<Tail>>) {
    let mut buf = [0u8; 4096];
    loop {
        match pipe.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => tail
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(&buf[..n]),
        }
    }
}

impl Conn {
    /// After a failed handshake: let the child exit by itself for up to `grace` (so its own exit
    /// status is reported), kill its group if it does not, and collect its stderr.
    fn failed_child_report(&self, grace: Duration) -> (Option<String>, String) {
        let Some(child) = &self.child else {
            return (None, String::new());
        };
        let exit = self.runtime.block_on(async {
            let mut guard = child.child.lock().await;
            if let Ok(Ok(status)) = tokio::time::timeout(grace, guard.wait()).await {
                return Some(describe_exit(status));
            }
            signal_group(child.pid, Signal::SIGKILL);
            match tokio::time::timeout(TEARDOWN_WAIT, guard.wait()).await {
                // It had exited by itself after all (a status, not our signal).
                Ok(Ok(status)) if status.code().is_some() => Some(describe_exit(status)),
                _ => None,
            }
        });
        self.drain_stderr(child);
        (exit, child.stderr_text())
    }

    /// During a call that failed: how the child exited, if it has, and its stderr so far.
    fn child_report(&self) -> (Option<String>, String) {
        let Some(child) = &self.child else {
            return (None, String::new());
        };
        let exit = self.runtime.block_on(async {
            let mut guard = child.child.lock().await;
            // A child whose pipe broke is usually exiting; give it a moment.
            match tokio::time::timeout(EXIT_GRACE, guard.wait()).await {
                Ok(Ok(status)) => Some(describe_exit(status)),
                _ => None,
            }
        });
        if exit.is_some() {
            self.drain_stderr(child);
        }
        (exit, child.stderr_text())
    }

    fn drain_stderr(&self, child: &StdioChild) {
        let task = child
            .stderr_task
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(task) = task {
            let _ = self
                .runtime
                .block_on(async move { tokio::time::timeout(TEARDOWN_WAIT, task).await });
        }
    }

    /// Tear down: close the session, stop the child (gracefully or at once), reap it, stop the
    /// runtime. Never blocks for long; from inside an async runtime it only kills.
    fn shutdown(mut self, graceful: bool) {
        let pid = self.child.as_ref().and_then(|c| c.pid);
        let service = self.service.take();
        if inside_runtime() {
            signal_group(pid, Signal::SIGKILL);
            {
                let _enter = self.runtime.enter();
                drop(service);
                drop(self.child.take());
            }
            self.runtime.shutdown_background();
            return;
        }
        if !graceful {
            signal_group(pid, Signal::SIGKILL);
        }
        let child = self.child.take();
        self.runtime.block_on(async {
            if let Some(service) = service {
                // Closes the child's stdin, or ends the HTTP session.
                let _ = tokio::time::timeout(TEARDOWN_WAIT, service.cancel()).await;
            }
            if let Some(child) = &child {
                let mut guard = child.child.lock().await;
                if graceful
                    && tokio::time::timeout(CLOSE_GRACE, guard.wait())
                        .await
                        .is_err()
                {
                    signal_group(pid, Signal::SIGTERM);
                    let _ = tokio::time::timeout(CLOSE_GRACE, guard.wait()).await;
                }
                // Whatever is left of the group (the leader, or processes it started).
                signal_group(pid, Signal::SIGKILL);
                let _ = tokio::time::timeout(TEARDOWN_WAIT, guard.wait()).await;
            }
        });
        {
            let _enter = self.runtime.enter();
            drop(child);
        }
        self.runtime.shutdown_background();
    }
}

impl StdioChild {
    fn stderr_text(&self) -> String {
        self.stderr
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .render()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    #[test]
    fn tail_keeps_the_end() {
        let mut tail = Tail::default();
        tail.push(b"first line\n");
        assert_eq!(tail.render(), "first line\n");
        let long = "x".repeat(STDERR_TAIL_BYTES);
        tail.push(long.as_bytes());
        tail.push(b"\nlast line\n");
        let text = tail.render();
        assert!(text.starts_with("[…]\n"), "{text:.40}");
        assert!(text.ends_with("last line\n"));
        assert!(!text.contains("first line"));
    }

    #[test]
    fn targets() {
        let spec = ServerSpec::Stdio {
            command: vec!["npx".into(), "-y".into(), "a b".into()],
            env: vec![],
            cwd: ".".into(),
        };
        assert_eq!(describe_target(&spec), "command `npx -y \"a b\"`");
        let spec = ServerSpec::Http {
            url: "http://x/mcp".into(),
        };
        assert_eq!(describe_target(&spec), "URL http://x/mcp");
    }

    #[test]
    fn client_is_send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<McpClient>();
    }
}
