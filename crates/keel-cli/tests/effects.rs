//! The effect ledger against a fake external service on loopback that counts applications per
//! idempotency key. A scripted run calls it through the `http` tool (key in `Idempotency-Key`),
//! a contract tool that passes its key in an environment variable, and a contract tool that
//! takes no key. The run is killed with SIGKILL at every fault point in turn (every event
//! boundary, and inside each call: after the intended effect is recorded, while the command
//! runs, after the call and before its result is recorded), then resumed. Every time: no key was
//! applied twice; every effect recorded `done` was applied exactly once; the call without a key
//! is never made a second time: if it was interrupted, the run waits with a reconciliation
//! request naming its key, and a person's rejection lets the run finish without it.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{Fixture, fault_points, kinds, of_kind, state};
use keel_test_support::service::CountingService;
use serde_json::{Value, json};

fn script(url: &str) -> Vec<Value> {
    vec![
        json!({"tool": "http", "args": {"method": "POST", "url": format!("{url}/apply"), "body": "a"}}),
        json!({"tool": "apply_keyed", "args": {"item": "b"}}),
        json!({"calls": [
            {"tool": "http", "args": {"method": "POST", "url": format!("{url}/apply"), "body": "c"}},
            {"tool": "apply_keyed", "args": {"item": "d"}}
        ]}),
        json!({"tool": "apply_unkeyed", "args": {"item": "e"}}),
        json!({"tool": "finish", "args": {"summary": "applied"}}),
    ]
}

fn contract(script_path: &std::path::Path, url: &str) -> String {
    let port = url.rsplit(':').next().unwrap();
    format!(
        r#"
[task]
goal = "Five items are applied to the service."

[driver]
kind = "script"
script = "{script}"

[scope]
http = [{{ host = "127.0.0.1", port = {port}, methods = ["POST"] }}]

[budget]
steps = 40

[[verify]]
name = "present"
tier = "acceptance"
run = "test -f README.md"

[[phase]]
name = "apply"
kind = "agent"
objective = "Apply a, b, c, d and e."
tools = ["http", "apply_keyed", "apply_unkeyed", "finish"]
done_when = []

{apply_keyed}
[[tool]]
name = "apply_unkeyed"
description = "Apply one item to the service; it takes no key."
run = ["curl", "-sS", "-f", "-X", "POST", "--data-binary", "{{item}}", "{url}/apply"]
parameters = {{ item = {{ type = "string" }} }}
reversibility = "irreversible"
network = true
"#,
        script = script_path.display(),
        apply_keyed = common::apply_keyed_tool(url),
    )
}

struct Scenario {
    fx: Fixture,
    service: CountingService,
    _outside: tempfile::TempDir,
}

impl Scenario {
    fn new() -> Scenario {
        let service = CountingService::start();
        let outside = tempfile::tempdir().unwrap();
        let path = common::write_script(outside.path(), &script(&service.url()));
        Scenario {
            fx: Fixture::new(&contract(&path, &service.url())),
            service,
            _outside: outside,
        }
    }

    fn run_id(&self) -> Option<String> {
        self.fx.stored_run_id()
    }

    /// Every key applied at most once; the unkeyed tool applied at most once.
    fn check_at_most_once(&self, what: &str) {
        for (key, n) in self.service.applications() {
            assert_eq!(n, 1, "{what}: key {key} was applied {n} times");
        }
        assert!(
            self.service.unkeyed() <= 1,
            "{what}: the call without a key was made {} times",
            self.service.unkeyed()
        );
    }

    /// Drives the run to its end: resumes, and settles a reconciliation request by rejecting
    /// it (the call is not made again). Returns whether a reconciliation was asked for.
    fn finish(&self, id: &str, what: &str) -> bool {
        let f = &self.fx;
        let mut reconciled = false;
        for _ in 0..4 {
            let out = f.run(&["resume", id]);
            self.check_at_most_once(what);
            match out.status.code() {
                Some(0) => return reconciled,
                Some(3) => {
                    let st = f.status(id);
                    assert_eq!(state(&st), "awaiting_approval", "{what}: {st:#}");
                    let request = st["approvals"].as_array().unwrap().last().unwrap().clone();
                    let r = &request;
                    assert_eq!(r["gate"]["gate"], "reconcile", "{what}: {request:#}");
                    let key = r["gate"]["key"].as_str().unwrap();
                    assert!(
                        r["payload"].as_str().unwrap().contains(key),
                        "{what}: the payload names the key: {r:#}"
                    );
                    assert!(
                        r["payload"].as_str().unwrap().contains("curl"),
                        "{what}: the payload says what was attempted: {r:#}"
                    );
                    // The ledger shows it as unknown.
                    let effects = f.expect(&["effects", id, "--json"], 0);
                    let effects: Value = serde_json::from_slice(&effects.stdout).unwrap();
                    let e = effects
                        .as_array()
                        .unwrap()
                        .iter()
                        .find(|e| e["key"] == key)
                        .unwrap();
                    assert_eq!(e["status"], "unknown", "{what}: {effects:#}");
                    let n = r["n"].as_u64().unwrap().to_string();
                    f.expect(
                        &[
                            "reject",
                            id,
                            &n,
                            "--payload-hash",
                            r["payload_hash"].as_str().unwrap(),
                            "--reason",
                            "checked the service: leave it",
                        ],
                        0,
                    );
                    reconciled = true;
                }
                _ => panic!("{what}: resume ended unexpectedly\n{}", f.explain(&out)),
            }
        }
        panic!("{what}: the run did not finish after four resumes");
    }

    /// The ledger against the service once the run completed.
    fn check_final(&self, id: &str, what: &str) {
        let f = &self.fx;
        let st = f.status(id);
        assert_eq!(state(&st), "completed", "{what}: {st:#}");
        self.check_at_most_once(what);
        let events = f.events(id);
        let out = f.expect(&["effects", id, "--json"], 0);
        let effects: Value = serde_json::from_slice(&out.stdout).unwrap();
        let effects = effects.as_array().unwrap();
        assert_eq!(effects.len(), 5, "{what}: {effects:#?}");
        let applied = self.service.applications();
        for e in effects {
            let key = e["key"].as_str().unwrap();
            let status = e["status"].as_str().unwrap();
            match e["tool"].as_str().unwrap() {
                "apply_unkeyed" => {
                    assert_eq!(e["keyed"], false);
                    assert!(status == "done" || status == "unknown", "{what}: {e:#}");
                    if status == "done" {
                        assert_eq!(self.service.unkeyed(), 1, "{what}: done means made once");
                    }
                }
                _ => {
                    assert_eq!(e["keyed"], true, "{what}: {e:#}");
                    assert_eq!(status, "done", "{what}: a keyed effect ends done: {e:#}");
                    assert_eq!(
                        applied.get(key).copied(),
                        Some(1),
                        "{what}: effect {key} is done but was applied {:?} times",
                        applied.get(key)
                    );
                }
            }
        }
        // One intended event per effect, never two.
        assert_eq!(
            of_kind(&events, "effect_intended").len(),
            5,
            "{what}: {:?}",
            kinds(&events)
        );
        f.verify_log_ok(id);
        // The invariant checker's view: the service counts the call without a key apart.
        let audit = keel_test_support::invariants::check(&f.path(".keel/keel.db"), id).unwrap();
        let mut applied: std::collections::BTreeMap<String, u64> = applied
            .into_iter()
            .map(|(k, n)| (k, u64::from(n)))
            .collect();
        for e in audit.effects.iter().filter(|e| e.tool == "apply_unkeyed") {
            if self.service.unkeyed() > 0 {
                applied.insert(e.key.clone(), u64::from(self.service.unkeyed()));
            }
        }
        let broken = keel_core::invariant::check_applied(&audit.effects, &applied);
        assert!(broken.is_empty(), "{what}: {broken:?}");
    }
}

#[test]
fn an_uninterrupted_run_applies_each_effect_once_and_lists_them() {
    let s = Scenario::new();
    let (id, out) = s.fx.start(&[]);
    assert_eq!(out.status.code(), Some(0), "{}", s.fx.explain(&out));
    s.check_final(&id, "uninterrupted");
    assert_eq!(s.service.unkeyed(), 1);
    assert_eq!(s.service.applications().len(), 4);

    // Readable: key, class, status for every effect, and the log names them too.
    let out = s.fx.expect(&["effects", &id], 0);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("irreversible+key") && text.contains("done"),
        "{text}"
    );
    for e in of_kind(&s.fx.events(&id), "effect_intended") {
        let key = e["body"]["key"].as_str().unwrap();
        assert!(text.contains(key), "{key} missing from\n{text}");
    }
    let out = s.fx.expect(&["log", &id], 0);
    let log = String::from_utf8_lossy(&out.stdout);
    assert!(
        log.contains("effect_intended") && log.contains("DONE"),
        "{log}"
    );
}

#[test]
fn killed_at_every_boundary_no_effect_is_applied_twice() {
    let probe = Scenario::new();
    let points = fault_points(&std::fs::read_to_string(probe.fx.path("keel.toml")).unwrap());
    drop(probe);
    assert!(points.len() > 30, "{points:?}");
    for want in ["effect intended", "tool call made", "command running"] {
        assert!(
            points.iter().any(|p| p == want),
            "no `{want}` in {points:?}"
        );
    }
    let mut reconciliations = 0;
    for (i, point) in points.iter().enumerate() {
        let n = i + 1;
        let what = format!("killed at point {n} ({point})");
        let s = Scenario::new();
        let (_, out) = {
            let mut cmd = s.fx.keel();
            cmd.args(["run", "keel.toml"])
                .env("KEEL_CRASH_AT", n.to_string());
            let out = cmd.output().unwrap();
            (String::new(), out)
        };
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(
            out.status.signal(),
            Some(9),
            "{what}: {}",
            s.fx.explain(&out)
        );
        s.check_at_most_once(&what);
        let Some(id) = s.run_id() else {
            continue;
        };
        if s.finish(&id, &what) {
            reconciliations += 1;
        }
        s.check_final(&id, &what);
    }
    assert!(
        reconciliations > 0,
        "no kill left the call without a key interrupted"
    );
}

/// Writes `lines` as the driver script in `dir` and returns a contract whose `publish` tool
/// (irreversible, appends its item to published.txt) waits for a person before each call.
fn gated_publish(dir: &std::path::Path, lines: &[Value]) -> String {
    let path = common::write_script(dir, lines);
    format!(
        r#"
[task]
goal = "Publish."

[driver]
kind = "script"
script = "{}"

[approvals]
require = ["irreversible"]

[[verify]]
name = "present"
tier = "acceptance"
run = "test -f README.md"

[[phase]]
name = "publish"
kind = "agent"
objective = "Publish the items."
tools = ["publish", "finish"]
done_when = []

[[tool]]
name = "publish"
description = "Publish one item."
run = ["sh", "-c", "echo \"$0\" >> published.txt", "{{item}}"]
parameters = {{ item = {{ type = "string" }} }}
"#,
        path.display()
    )
}

#[test]
fn calls_of_a_class_the_contract_names_wait_for_a_person() {
    let outside = tempfile::tempdir().unwrap();
    let lines = [
        json!({"tool": "publish", "args": {"item": "x"}}),
        json!({"tool": "publish", "args": {"item": "y"}}),
        json!({"tool": "finish", "args": {"summary": "published"}}),
    ];
    let f = Fixture::new(&gated_publish(outside.path(), &lines));
    let (id, out) = f.start(&[]);
    assert_eq!(out.status.code(), Some(3), "{}", f.explain(&out));
    assert!(
        !f.path("published.txt").exists(),
        "nothing runs before approval"
    );

    let decide = |verb: &str, reason: &str| {
        let st = f.status(&id);
        assert_eq!(state(&st), "awaiting_approval", "{st:#}");
        let r = st["approvals"].as_array().unwrap().last().unwrap().clone();
        assert_eq!(r["gate"]["gate"], "tool_call", "{r:#}");
        let payload = r["payload"].as_str().unwrap();
        assert!(
            payload.contains("publish") && payload.contains("keel-"),
            "{payload}"
        );
        let n = r["n"].as_u64().unwrap().to_string();
        let hash = r["payload_hash"].as_str().unwrap().to_string();
        f.expect(
            &[verb, &id, &n, "--payload-hash", &hash, "--reason", reason],
            0,
        );
    };
    decide("approve", "x is fine");
    let out = f.run(&["resume", &id]);
    assert_eq!(out.status.code(), Some(3), "{}", f.explain(&out));
    assert_eq!(
        std::fs::read_to_string(f.path("published.txt")).unwrap(),
        "x\n"
    );
    decide("reject", "not y");
    f.expect(&["resume", &id], 0);
    // The rejected call never ran; the driver was told why.
    assert_eq!(
        std::fs::read_to_string(f.path("published.txt")).unwrap(),
        "x\n"
    );
    let events = f.events(&id);
    let denied: Vec<&Value> = of_kind(&events, "policy_decision")
        .into_iter()
        .filter(|e| e["body"]["decision"] == "deny")
        .collect();
    assert_eq!(denied.len(), 1, "{:?}", kinds(&events));
    assert!(
        denied[0]["body"]["rule"]
            .as_str()
            .unwrap()
            .contains("a person rejected this call"),
        "{denied:?}"
    );
    let out = f.expect(&["effects", &id, "--json"], 0);
    let effects: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(effects.as_array().unwrap().len(), 1, "{effects:#}");
    assert_eq!(effects[0]["status"], "done");
    f.verify_log_ok(&id);
}

/// Found by the seeded engine simulation: keel stored a call's "needs approval" decision, was
/// killed before the approval request was stored, and on resume went round its loop forever
/// (the call waited for a request that did not exist). The request is now made on resume, and
/// a move that records nothing stops the run with an error instead of spinning.
#[test]
fn killed_between_a_calls_need_for_approval_and_its_request_it_asks_on_resume() {
    let outside = tempfile::tempdir().unwrap();
    let lines = [
        json!({"tool": "publish", "args": {"item": "x"}}),
        json!({"tool": "finish", "args": {"summary": "published"}}),
    ];
    let contract = gated_publish(outside.path(), &lines);
    // The fault points of the first process, up to the request; the kill goes where the
    // decision to ask is stored and the request is not.
    let twin = Fixture::new(&contract);
    let trace = outside.path().join("trace");
    let (_, out) = twin.start(&[("KEEL_FAULT_TRACE", trace.display().to_string())]);
    assert_eq!(out.status.code(), Some(3), "{}", twin.explain(&out));
    let points: Vec<String> = std::fs::read_to_string(&trace)
        .unwrap()
        .lines()
        .map(|l| l.split_once(' ').unwrap().1.to_string())
        .collect();
    let at = points
        .iter()
        .position(|p| p == "policy decided")
        .expect("the call's decision is a fault point")
        + 1;

    let f = Fixture::new(&contract);
    let (id, out) = f.start(&[("KEEL_CRASH_AT", at.to_string())]);
    assert_eq!(out.status.code(), None, "killed: {}", f.explain(&out));
    let events = f.events(&id);
    let decided = of_kind(&events, "policy_decision");
    assert_eq!(decided.len(), 1, "{:?}", kinds(&events));
    assert_eq!(decided[0]["body"]["decision"], "needs_approval");
    assert!(of_kind(&events, "approval_requested").is_empty());

    let out = f.run(&["resume", &id]);
    assert_eq!(out.status.code(), Some(3), "{}", f.explain(&out));
    let st = f.status(&id);
    assert_eq!(state(&st), "awaiting_approval", "{st:#}");
    let requests = st["approvals"].as_array().unwrap();
    assert_eq!(requests.len(), 1, "{st:#}");
    assert_eq!(requests[0]["gate"]["gate"], "tool_call");
    assert!(!f.path("published.txt").exists(), "nothing ran unapproved");
    let hash = requests[0]["payload_hash"].as_str().unwrap().to_string();
    f.expect(
        &[
            "approve",
            &id,
            "1",
            "--payload-hash",
            &hash,
            "--reason",
            "ok",
        ],
        0,
    );
    f.expect(&["resume", &id], 0);
    assert_eq!(
        std::fs::read_to_string(f.path("published.txt")).unwrap(),
        "x\n"
    );
    f.verify_log_ok(&id);
}

#[test]
fn http_requests_are_allow_listed_counted_and_carry_the_key() {
    let service = CountingService::start();
    let url = service.url();
    let port = url.rsplit(':').next().unwrap().to_string();
    let outside = tempfile::tempdir().unwrap();
    let path = outside.path().join("script.jsonl");
    let lines = [
        // Not allowed: DELETE, and another host.
        json!({"tool": "http", "args": {"method": "DELETE", "url": format!("{url}/apply")}}),
        json!({"tool": "http", "args": {"method": "GET", "url": "http://example.com/"}}),
        json!({"tool": "http", "args": {"method": "POST", "url": format!("{url}/apply"), "body": "x"}}),
        json!({"tool": "http", "args": {"method": "GET", "url": format!("{url}/big?n=10")}}),
        // Over the network_requests budget of 2: denied before it is sent.
        json!({"tool": "http", "args": {"method": "GET", "url": format!("{url}/big?n=10")}}),
        json!({"tool": "finish", "args": {"summary": "done"}}),
    ];
    let text: Vec<String> = lines.iter().map(|l| l.to_string()).collect();
    std::fs::write(&path, text.join("\n") + "\n").unwrap();
    let f = Fixture::new(&format!(
        r#"
[task]
goal = "One item is applied."

[driver]
kind = "script"
script = "{}"

[scope]
http = [{{ host = "127.0.0.1", port = {port}, methods = ["GET", "POST"] }}]

[budget]
network_requests = 2

[[verify]]
name = "present"
tier = "acceptance"
run = "test -f README.md"

[[phase]]
name = "call"
kind = "agent"
objective = "Apply one item."
tools = ["http", "finish"]
done_when = []
"#,
        path.display()
    ));
    let (id, out) = f.start(&[]);
    assert_eq!(out.status.code(), Some(0), "{}", f.explain(&out));
    let events = f.events(&id);
    let decisions: Vec<(String, String)> = of_kind(&events, "policy_decision")
        .iter()
        .map(|e| {
            (
                e["body"]["decision"].as_str().unwrap().to_string(),
                e["body"]["rule"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    assert_eq!(decisions.len(), 6, "{decisions:?}");
    assert_eq!(decisions[0].0, "deny");
    assert!(decisions[0].1.contains("DELETE"), "{decisions:?}");
    assert_eq!(decisions[1].0, "deny");
    assert!(decisions[1].1.contains("example.com"), "{decisions:?}");
    assert_eq!(decisions[2].0, "allow");
    assert_eq!(decisions[3].0, "allow");
    assert_eq!(decisions[4].0, "deny");
    assert!(
        decisions[4]
            .1
            .contains("budget `network_requests` exhausted"),
        "{decisions:?}"
    );
    // Only the allowed requests reached the service; the POST carried its effect key.
    let requests = service.requests();
    assert_eq!(requests.len(), 2, "{requests:?}");
    let key = of_kind(&events, "effect_intended")[0]["body"]["key"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(requests[0].header("Idempotency-Key"), Some(key.as_str()));
    assert_eq!(
        requests[1].header("Idempotency-Key"),
        None,
        "GET has no key"
    );
    assert_eq!(service.applications().get(&key), Some(&1));
    let st = f.status(&id);
    assert_eq!(st["budgets"]["network_requests"]["used"], 2, "{st:#}");
    // The GET is read-only: no effect; the POST is one, done.
    let out = f.expect(&["effects", &id, "--json"], 0);
    let effects: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(effects.as_array().unwrap().len(), 1, "{effects:#}");
    assert_eq!(effects[0]["status"], "done");
}

/// Found by the seeded engine simulation. A call's request that nobody decided in time counts
/// as rejected, as the README says: the driver is told no and works on (keel used to block the
/// run). And the decision by expiry is stored in the same commit as what it leads to: it used to
/// be a commit of its own, and a run found with the decision but not the next state was taken
/// for one a person had rejected, so a failed commit between the two changed how the run ended.
/// Each commit of the resume that finds the request expired fails here in turn; every run ends
/// as the one without a fault does.
#[test]
fn an_expired_call_request_counts_as_rejected_and_the_driver_works_on() {
    let outside = tempfile::tempdir().unwrap();
    let lines = [
        json!({"tool": "publish", "args": {"item": "x"}}),
        json!({"tool": "finish", "args": {"summary": "nothing was published"}}),
    ];
    let contract = gated_publish(outside.path(), &lines).replace(
        "require = [\"irreversible\"]",
        "require = [\"irreversible\"]\nexpires = \"1ms\"",
    );
    let ends_as_it_should = |f: &Fixture, id: &str, what: &str| {
        let status = f.status(id);
        assert_eq!(state(&status), "completed", "{what}: {status:#}");
        assert_eq!(
            status["approvals"][0]["decision"]["via"], "expiry",
            "{what}"
        );
        assert!(!f.path("published.txt").exists(), "{what}: the call ran");
        let events = f.events(id);
        let decided = of_kind(&events, "approval_decided");
        assert_eq!(decided.len(), 1, "{what}: decided once");
        // The driver was told no: the call's decision names the rejection by expiry.
        let told = of_kind(&events, "policy_decision");
        assert!(
            told.iter().any(|e| {
                let body = e.to_string();
                body.contains("a person rejected this call") && body.contains("deadline")
            }),
            "{what}: {told:#?}"
        );
        f.verify_log_ok(id);
    };
    let trace = outside.path().join("commits");
    let twin = Fixture::new(&contract);
    let (id, out) = twin.start(&[]);
    assert_eq!(out.status.code(), Some(3), "{}", twin.explain(&out));
    let out = twin
        .keel()
        .args(["resume", &id])
        .env("KEEL_STORE_FAULT_TRACE", &trace)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", twin.explain(&out));
    ends_as_it_should(&twin, &id, "without a fault");
    let commits = common::traced(&trace, "commit");
    assert!(commits >= 2, "the resume commits {commits} times");
    for n in 1..=commits {
        for fault in ["commit-error", "commit-lost-ack"] {
            let what = format!("{fault}@{n}");
            let f = Fixture::new(&contract);
            let (id, _) = f.start(&[]);
            let out = f
                .keel()
                .args(["resume", &id])
                .env("KEEL_STORE_FAULT", &what)
                .output()
                .unwrap();
            common::assert_no_panic(&out, &what);
            let out = f.run(&["resume", &id]);
            common::assert_no_panic(&out, &what);
            ends_as_it_should(&f, &id, &what);
        }
    }
}
