//! Fixtures for keel-server's tests: a git workspace with a run stopped at an approval gate (or
//! waiting for an answer), a server in this process on a free loopback port, and a small HTTP
//! client that returns the status and the JSON body.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde_json::Value;

pub const TOKEN: &str = "test-token-0123456789abcdef";

pub use keel_test_support::git;

/// A contract whose second phase waits for a person's approval.
pub const GATED: &str = r#"
[task]
goal = "The release note is published."

[[verify]]
name = "published"
tier = "acceptance"
run = "test -f published.txt"

[[phase]]
name = "write"
kind = "command"
run = ["printf 'Release 1.4\n\n- faster resume\n- approval inbox\n' > NOTES.md", "printf 'fixture v2\n' > README.md"]

[[phase]]
name = "publish"
kind = "command"
approval = true
run = ["cp NOTES.md published.txt; echo published >> published-count"]
"#;

/// A contract whose agent phase asks a question first.
pub const ASKING: &str = r#"
[task]
goal = "src/out.txt names the database."

[driver]
kind = "script"
script = "actions.jsonl"

[scope]
writable = ["src/**"]

[[verify]]
name = "out"
tier = "acceptance"
run = "test -f src/out.txt"

[[phase]]
name = "work"
kind = "agent"
objective = "Ask which database to use, then write it to src/out.txt."
tools = ["ask", "write", "finish"]
done_when = []
"#;

/// A workspace, its store and one run started in it.
pub struct Workspace {
    pub dir: tempfile::TempDir,
    pub store: PathBuf,
    pub run: String,
}

impl Workspace {
    /// A git repository with one commit, `contract` as keel.toml, and a run of it started and
    /// stopped where a person has to act.
    pub fn new(contract: &str, files: &[(&str, &str)]) -> Workspace {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        git(root, &["init", "-q", "-b", "main"]);
        std::fs::write(root.join("README.md"), "fixture\n").unwrap();
        std::fs::write(root.join(".gitignore"), ".keel/\n").unwrap();
        for (path, text) in files {
            std::fs::write(root.join(path), text).unwrap();
        }
        git(root, &["add", "-A"]);
        git(root, &["commit", "-q", "-m", "init"]);
        let contract_path = root.join("keel.toml");
        // These runs are driven in this test process, which cannot be keel's sandbox helper (the
        // `keel` binary is; its tests cover the sandbox). The contract says so explicitly, and it
        // is recorded in the run's first event.
        let contract = format!("{contract}\n[sandbox]\nmode = \"off\"\n");
        std::fs::write(&contract_path, contract).unwrap();
        let store = root.join(".keel/keel.db");
        let mut s = keel_store::Store::open(&store).unwrap();
        let run_id = keel_engine::new_run_id();
        let run = keel_engine::start(
            &mut s,
            keel_engine::NewRun {
                contract_path: &contract_path,
                contract: keel_engine::load_contract(&contract_path).unwrap(),
                run_id: &run_id,
                choice: &Default::default(),
                detach: false,
            },
            &keel_engine::Actor::current(),
            &mut keel_engine::Quiet,
            &mut |_| {},
        )
        .unwrap();
        assert!(
            run.state.needs_human(),
            "the run should wait for a person, but it is {}: {}",
            run.state,
            run.reason
        );
        Workspace {
            dir,
            store,
            run: run_id,
        }
    }

    /// A run stopped at its approval gate.
    pub fn gated() -> Workspace {
        Workspace::new(GATED, &[])
    }

    /// A run waiting for the answer to question 1.
    pub fn asking() -> Workspace {
        let actions = r#"{"tool": "ask", "args": {"question": "Which database should the migration target?"}}
{"tool": "write", "args": {"path": "src/out.txt", "content": "staging\n"}}
{"tool": "finish", "args": {"summary": "written"}}
"#;
        Workspace::new(ASKING, &[("actions.jsonl", actions)])
    }

    pub fn path(&self, rel: &str) -> PathBuf {
        self.dir.path().join(rel)
    }

    pub fn open(&self) -> keel_store::Store {
        keel_store::Store::open(&self.store).unwrap()
    }

    pub fn run(&self) -> keel_core::run::Run {
        self.open().run(&self.run).unwrap()
    }

    /// The kinds of the run's events, in order.
    pub fn kinds(&self) -> Vec<String> {
        self.open()
            .events_from(&self.run, 1)
            .unwrap()
            .into_iter()
            .map(|e| e.kind)
            .collect()
    }

    pub fn count(&self, kind: &str) -> usize {
        self.kinds().iter().filter(|k| *k == kind).count()
    }
}

/// A keel server in this process, on a free loopback port, stopped when dropped.
pub struct Server {
    pub addr: SocketAddr,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Server {
    pub fn start(store: &Path) -> Server {
        let state = keel_server::AppState::new(store, TOKEN).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async move {
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
                tx.send(listener.local_addr().unwrap()).unwrap();
                keel_server::serve_on(listener, state, async {
                    let _ = stopped.await;
                })
                .await
                .unwrap();
            });
        });
        let addr = rx.recv().expect("the server starts");
        Server {
            addr,
            shutdown: Some(stop),
            thread: Some(thread),
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(stop) = self.shutdown.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// What came back: the status, the body as JSON (or as a string when it is not JSON), and the
/// headers.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub body: Value,
    pub text: String,
    pub headers: reqwest::header::HeaderMap,
}

impl Reply {
    pub fn error(&self) -> &str {
        self.body["error"]
            .as_str()
            .unwrap_or_else(|| panic!("expected an error body, got {} {}", self.status, self.text))
    }
}

pub fn client() -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder()
        .timeout(std::time::Duration::from_secs(60))
        .build()
        .unwrap()
}

/// Sends a request with `token` (none: no Authorization header) and `body` (raw text).
pub fn send(
    server: &Server,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<&str>,
) -> Reply {
    let method = reqwest::Method::from_bytes(method.as_bytes()).unwrap();
    let mut request = client().request(method, server.url(path));
    if let Some(t) = token {
        request = request.header("Authorization", format!("Bearer {t}"));
    }
    if let Some(b) = body {
        request = request
            .header("Content-Type", "application/json")
            .body(b.to_string());
    }
    let response = request.send().unwrap();
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let text = response.text().unwrap();
    let body = serde_json::from_str(&text).unwrap_or(Value::String(text.clone()));
    Reply {
        status,
        body,
        text,
        headers,
    }
}

pub fn get(server: &Server, path: &str) -> Reply {
    send(server, "GET", path, Some(TOKEN), None)
}

pub fn post(server: &Server, path: &str, body: &Value) -> Reply {
    send(server, "POST", path, Some(TOKEN), Some(&body.to_string()))
}
