//! The web page in a real headless Chromium: it shows the pending request with its diff, a
//! click on Approve records the decision, and a worker finishes the run, which the page shows.
//! A screenshot of the inbox is kept in `target/keel-screenshots/inbox.png` (and one of the
//! finished run's timeline in `run.png`).
//!
//! Chromium is driven over the WebDriver protocol through Debian's chromedriver, with a small
//! client of our own over the blocking reqwest the workspace already has: the test needs a
//! dozen commands, and a WebDriver crate (fantoccini, thirtyfour) would bring an async stack
//! and many crates for them. Without `/usr/bin/chromium` and `/usr/bin/chromedriver` (Debian's
//! `chromium` and `chromium-driver`, which CI installs) the test says loudly that it is skipped.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use base64::Engine as _;
use common::{Server, TOKEN, Workspace};
use serde_json::{Value, json};

const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";
/// How often (and how many times) the test looks again for something the page should show.
const LOOK_EVERY: Duration = Duration::from_millis(100);
const LOOKS: usize = 900;

fn binary(var: &str, default: &str) -> PathBuf {
    std::env::var_os(var)
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(default))
}

/// Where screenshots go: `target/keel-screenshots/` of this build.
fn screenshot_dir() -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR"))
        .parent()
        .unwrap()
        .join("keel-screenshots")
}

/// chromedriver on a free loopback port, killed when dropped.
struct Driver {
    child: Child,
    url: String,
    log: PathBuf,
    _dir: tempfile::TempDir,
}

impl Driver {
    fn start(chromedriver: &Path) -> Driver {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("chromedriver.log");
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let child = Command::new(chromedriver)
            .arg(format!("--port={port}"))
            .arg(format!("--log-path={}", log.display()))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("{} does not start: {e}", chromedriver.display()));
        let driver = Driver {
            child,
            url: format!("http://127.0.0.1:{port}"),
            log,
            _dir: dir,
        };
        let ready = (0..LOOKS).any(|_| {
            let up = client()
                .get(format!("{}/status", driver.url))
                .send()
                .ok()
                .and_then(|r| r.text().ok())
                .and_then(|t| serde_json::from_str::<Value>(&t).ok())
                .is_some_and(|v| v["value"]["ready"] == true);
            if !up {
                std::thread::sleep(LOOK_EVERY);
            }
            up
        });
        assert!(
            ready,
            "chromedriver never became ready\n{}",
            driver.log_text()
        );
        driver
    }

    fn log_text(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let tail: Vec<&str> = text.lines().rev().take(40).collect();
        tail.into_iter().rev().collect::<Vec<_>>().join("\n")
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn client() -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(120))
        .build()
        .unwrap()
}

/// One browser session: the WebDriver commands this test uses.
struct Session<'a> {
    driver: &'a Driver,
    id: String,
    _profile: tempfile::TempDir,
}

impl<'a> Session<'a> {
    fn new(driver: &'a Driver, chromium: &Path) -> Session<'a> {
        let profile = tempfile::tempdir().unwrap();
        let args = vec![
            "--headless".to_string(),
            "--no-sandbox".into(),
            "--disable-gpu".into(),
            "--disable-background-networking".into(),
            "--disable-component-update".into(),
            "--no-first-run".into(),
            "--disable-sync".into(),
            "--disable-dev-shm-usage".into(),
            "--window-size=1440,900".into(),
            format!("--user-data-dir={}", profile.path().display()),
        ];
        let caps = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {"binary": chromium.display().to_string(), "args": args},
            "goog:loggingPrefs": {"browser": "ALL"},
        }}});
        let v = raw(
            driver,
            "POST",
            &format!("{}/session", driver.url),
            Some(caps),
        );
        let id = v["sessionId"]
            .as_str()
            .unwrap_or_else(|| panic!("no session: {v}\n{}", driver.log_text()))
            .to_string();
        Session {
            driver,
            id,
            _profile: profile,
        }
    }

    fn cmd(&self, method: &str, path: &str, body: Option<Value>) -> Value {
        let url = format!("{}/session/{}{path}", self.driver.url, self.id);
        raw(self.driver, method, &url, body)
    }

    fn goto(&self, url: &str) {
        self.cmd("POST", "/url", Some(json!({ "url": url })));
    }

    fn find_all(&self, css: &str) -> Vec<String> {
        self.cmd(
            "POST",
            "/elements",
            Some(json!({"using": "css selector", "value": css})),
        )
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e[ELEMENT].as_str().unwrap().to_string())
        .collect()
    }

    /// Waits (a bounded number of looks) for an element matching `css`.
    fn wait_for(&self, css: &str) -> String {
        for _ in 0..LOOKS {
            if let Some(e) = self.find_all(css).into_iter().next() {
                return e;
            }
            std::thread::sleep(LOOK_EVERY);
        }
        panic!(
            "the page never showed `{css}`; it shows:\n{}",
            self.script("return document.body.innerText", json!([]))
        );
    }

    /// Runs `op` on the element matching `css`, finding it again when the page re-rendered it
    /// in between (WebDriver's "stale element reference").
    fn on_fresh(&self, css: &str, method: &str, suffix: &str, body: Option<Value>) -> Value {
        for _ in 0..LOOKS {
            let element = self.wait_for(css);
            let url = format!(
                "{}/session/{}/element/{element}{suffix}",
                self.driver.url, self.id
            );
            match try_raw(method, &url, body.clone()) {
                Ok(v) => return v,
                Err(e) if e.contains("stale element") => std::thread::sleep(LOOK_EVERY),
                Err(e) => panic!("WebDriver {url} failed: {e}\n{}", self.driver.log_text()),
            }
        }
        panic!("`{css}` kept being replaced by the page");
    }

    fn text_of(&self, css: &str) -> String {
        self.on_fresh(css, "GET", "/text", None)
            .as_str()
            .unwrap()
            .to_string()
    }

    fn click_on(&self, css: &str) {
        self.on_fresh(css, "POST", "/click", Some(json!({})));
    }

    fn type_into_css(&self, css: &str, text: &str) {
        self.on_fresh(css, "POST", "/value", Some(json!({ "text": text })));
    }

    fn script(&self, script: &str, args: Value) -> Value {
        self.cmd(
            "POST",
            "/execute/sync",
            Some(json!({"script": script, "args": args})),
        )
    }

    fn screenshot(&self, path: &Path) {
        let b64 = self.cmd("GET", "/screenshot", None);
        let png = base64::engine::general_purpose::STANDARD
            .decode(b64.as_str().unwrap())
            .unwrap();
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, png).unwrap();
        // Straight to stderr, so the log of a passing run names the artifact too.
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), "screenshot: {}", path.display());
    }

    /// The browser's console messages at level SEVERE (errors), if chromedriver keeps them.
    fn console_errors(&self) -> Vec<String> {
        let url = format!("{}/session/{}/se/log", self.driver.url, self.id);
        let request = client()
            .post(url)
            .header("Content-Type", "application/json")
            .body(json!({"type": "browser"}).to_string());
        let Ok(r) = request.send() else {
            return Vec::new();
        };
        let v: Value = serde_json::from_str(&r.text().unwrap_or_default()).unwrap_or(Value::Null);
        v["value"]
            .as_array()
            .map(|entries| {
                entries
                    .iter()
                    .filter(|e| e["level"] == "SEVERE")
                    .map(|e| e["message"].as_str().unwrap_or("").to_string())
                    .collect()
            })
            .unwrap_or_default()
    }
}

impl Drop for Session<'_> {
    fn drop(&mut self) {
        let url = format!("{}/session/{}", self.driver.url, self.id);
        let _ = client().delete(url).send();
    }
}

/// A WebDriver command whose error is returned (as `error: message`), not a failure.
fn try_raw(method: &str, url: &str, body: Option<Value>) -> Result<Value, String> {
    let method = reqwest::Method::from_bytes(method.as_bytes()).map_err(|e| e.to_string())?;
    let mut request = client().request(method, url);
    if let Some(b) = body {
        request = request
            .header("Content-Type", "application/json")
            .body(b.to_string());
    }
    let response = request.send().map_err(|e| e.to_string())?;
    let status = response.status();
    let text = response.text().map_err(|e| e.to_string())?;
    let v: Value = serde_json::from_str(&text).map_err(|e| format!("{status}: {e}: {text}"))?;
    if status.is_success() {
        Ok(v["value"].clone())
    } else {
        Err(format!(
            "{}: {}",
            v["value"]["error"], v["value"]["message"]
        ))
    }
}

/// A WebDriver command; a WebDriver error fails the test with its message.
fn raw(driver: &Driver, method: &str, url: &str, body: Option<Value>) -> Value {
    let method = reqwest::Method::from_bytes(method.as_bytes()).unwrap();
    let mut request = client().request(method, url);
    if let Some(b) = body {
        request = request
            .header("Content-Type", "application/json")
            .body(b.to_string());
    }
    let response = request
        .send()
        .unwrap_or_else(|e| panic!("{url}: {e}\n{}", driver.log_text()));
    let status = response.status();
    let text = response.text().unwrap();
    let v: Value = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("WebDriver {url} answered {status} with no JSON ({e}): {text}"));
    assert!(
        status.is_success(),
        "WebDriver {url} failed ({status}): {}\n{}",
        v["value"],
        driver.log_text()
    );
    v["value"].clone()
}

#[test]
fn the_page_shows_the_request_with_its_diff_and_approve_lets_the_worker_finish_the_run() {
    let chromium = binary("KEEL_CHROMIUM", "/usr/bin/chromium");
    let chromedriver = binary("KEEL_CHROMEDRIVER", "/usr/bin/chromedriver");
    let missing: Vec<String> = [&chromium, &chromedriver]
        .iter()
        .filter(|p| !p.exists())
        .map(|p| p.display().to_string())
        .collect();
    if !missing.is_empty() {
        // Straight to stderr: the test harness keeps `eprintln!` of a passing test to itself.
        use std::io::Write as _;
        let _ = writeln!(
            std::io::stderr(),
            "\n==================== BROWSER TEST SKIPPED ====================\n\
             {} not installed: the web page was NOT tested in a browser.\n\
             Install Debian's `chromium` and `chromium-driver` (apt-get install -y chromium \
             chromium-driver) to run it; CI does.\n\
             ==============================================================\n",
            missing.join(" and ")
        );
        return;
    }

    let w = Workspace::gated();
    let server = Server::start(&w.store);
    let driver = Driver::start(&chromedriver);
    let session = Session::new(&driver, &chromium);

    // A worker in this process, as `keel worker` would run beside `keel serve`: it drives the
    // run once the decision arrives. It holds leases under its own name.
    let stop = Arc::new(AtomicBool::new(false));
    let worker = {
        let (stop, store) = (Arc::clone(&stop), w.store.clone());
        std::thread::spawn(move || {
            let options = keel_engine::worker::WorkerOptions {
                actor: keel_engine::Actor {
                    holder: "browser-test-worker".into(),
                    by: "worker".into(),
                },
                lease_ttl_ms: 60_000,
                poll: Duration::from_millis(100),
                once: false,
            };
            keel_engine::worker::work(&store, &options, &stop, &mut keel_engine::Quiet)
        })
    };

    // Without the token the page shows no data and asks for it; a wrong one is refused.
    session.goto(&server.url("/"));
    session.type_into_css("#login #token", "not-the-token-0123456789");
    session.click_on("#login button");
    let refusal = session.text_of("#login-error:not([hidden])");
    assert!(refusal.contains("token is wrong"), "{refusal}");
    assert!(session.find_all("article[data-testid=approval]").is_empty());
    // Reading the console empties it: what the refusal logged (the browser's own notes of the
    // 401s) is not held against the page below.
    let refusals = session.console_errors();
    assert!(refusals.iter().all(|e| e.contains("401")), "{refusals:#?}");

    // The token comes once in the address; the page keeps it and drops it from the address bar.
    session.goto(&server.url(&format!("/?token={TOKEN}")));
    session.wait_for("article[data-testid=approval]");
    let url = session.script("return location.href", json!([]));
    assert!(
        !url.as_str().unwrap().contains(TOKEN),
        "the token stays out of the address bar: {url}"
    );
    session.type_into_css("#by", "oncall-alice");

    // The request as a person sees it: intent, risk, rollback, checks, and the diff.
    let text = session.text_of("article[data-testid=approval]");
    for expected in [
        "Approval request #1",
        "Run phase `publish`",
        "Risk",
        "Rollback plan",
        "Checks so far",
        "cp NOTES.md published.txt",
        "+- approval inbox",
        "NOTES.md",
        "README.md",
    ] {
        // Headings are upper-cased by the style sheet, and WebDriver reads them so.
        assert!(
            text.to_lowercase().contains(&expected.to_lowercase()),
            "the card lacks {expected:?}:\n{text}"
        );
    }
    let diff = session.script(
        "const card = document.querySelector('article[data-testid=approval]'); \
         const add = [...card.querySelectorAll('.dl.add')]; \
         const del = [...card.querySelectorAll('.dl.del')]; \
         const style = add.length ? getComputedStyle(add[0]) : null; \
         return { add: add.map(e => e.textContent), del: del.map(e => e.textContent), \
                  background: style && style.backgroundColor, \
                  font: style && getComputedStyle(add[0].querySelector('.code')).fontFamily };",
        json!([]),
    );
    let added: Vec<&str> = diff["add"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert!(
        added.iter().any(|l| l.contains("+- approval inbox")),
        "{diff:#}"
    );
    assert!(
        diff["del"]
            .as_array()
            .unwrap()
            .iter()
            .any(|l| l.as_str().unwrap().contains("-fixture")),
        "the removed README line is shown as removed: {diff:#}"
    );
    assert_ne!(diff["background"], "rgba(0, 0, 0, 0)", "{diff:#}");
    assert!(
        diff["font"].as_str().unwrap().contains("mono"),
        "the diff is monospace: {diff:#}"
    );
    session.screenshot(&screenshot_dir().join("inbox.png"));

    // Approve.
    session.click_on("article[data-testid=approval] button[data-testid=approve]");

    // The run goes on and completes; the run list shows it.
    let state_css = format!("li[data-run=\"{}\"] .pill.state", w.run);
    let mut shown = Value::Null;
    for _ in 0..LOOKS {
        shown = session.script(
            "const e = document.querySelector(arguments[0]); return e && e.dataset.state;",
            json!([state_css]),
        );
        if shown == "completed" {
            break;
        }
        std::thread::sleep(LOOK_EVERY);
    }
    let run = w.run();
    assert_eq!(
        shown, "completed",
        "the page shows {shown}; the run is {}: {}",
        run.state, run.reason
    );
    assert_eq!(run.state.as_str(), "completed");
    let decision = run.approvals[0].decision.clone().unwrap();
    assert!(decision.approve);
    assert_eq!(decision.by, "oncall-alice");
    assert_eq!(decision.via, "http");
    assert_eq!(w.count("approval_decided"), 1);
    assert_eq!(
        std::fs::read_to_string(w.path("published-count")).unwrap(),
        "published\n",
        "the gated action ran exactly once"
    );

    // The inbox is empty now, and the run's timeline tells what happened.
    session.goto(&server.url("/#/inbox"));
    session.wait_for(".empty");
    session.goto(&server.url(&format!("/#/runs/{}", w.run)));
    let mut timeline = String::new();
    for _ in 0..LOOKS {
        timeline = session
            .script(
                "const t = document.querySelector('#timeline'); return t ? t.innerText : '';",
                json!([]),
            )
            .as_str()
            .unwrap()
            .to_string();
        if timeline.contains("awaiting approval → executing") && timeline.contains("→ completed")
        {
            break;
        }
        std::thread::sleep(LOOK_EVERY);
    }
    for expected in [
        "Approval #1 requested",
        "Approval #1 approved by oncall-alice",
        "Checkpoint",
        "Verifier published (acceptance) passed",
        "→ completed",
    ] {
        assert!(
            timeline.contains(expected),
            "the timeline lacks {expected:?}:\n{timeline}"
        );
    }
    let times = session.text_of("#run-facts .times");
    assert!(
        times.contains("working") && times.contains("waiting for people"),
        "{times}"
    );
    session.script(
        "document.querySelector('#timeline [data-kind=approval_decided]')\
         .scrollIntoView({block: 'center'})",
        json!([]),
    );
    session.screenshot(&screenshot_dir().join("run.png"));
    let errors = session.console_errors();
    assert!(errors.is_empty(), "the page logged errors: {errors:#?}");

    stop.store(true, Ordering::SeqCst);
    let report = worker.join().unwrap().unwrap();
    assert_eq!(
        report.driven,
        vec![(w.run.clone(), keel_core::state::RunState::Completed)],
        "{report:?}"
    );
}
