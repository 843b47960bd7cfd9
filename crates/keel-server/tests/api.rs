//! The HTTP API against a server in this process and a real store holding a run stopped at an
//! approval gate: the bearer token on every request, the status codes and their messages, a
//! decision recorded exactly once however it is delivered, the live event stream.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::io::{BufRead, BufReader};
use std::sync::{Arc, Barrier};

use common::{Server, TOKEN, Workspace, get, post, send};
use serde_json::{Value, json};

/// Every endpoint, with a body a POST would take.
fn endpoints(run: &str) -> Vec<(&'static str, String, Option<String>)> {
    let reason = Some(json!({"reason": "x"}).to_string());
    vec![
        ("GET", "/api/runs".into(), None),
        ("GET", format!("/api/runs/{run}"), None),
        ("GET", format!("/api/runs/{run}/events"), None),
        ("GET", format!("/api/runs/{run}/events/stream"), None),
        ("GET", "/api/approvals".into(), None),
        ("GET", "/api/questions".into(), None),
        ("GET", "/api/openapi.json".into(), None),
        (
            "POST",
            format!("/api/runs/{run}/approvals/1"),
            Some(json!({"decision": "approve", "payload_hash": "x"}).to_string()),
        ),
        (
            "POST",
            format!("/api/runs/{run}/questions/1"),
            Some(json!({"answer": "x"}).to_string()),
        ),
        ("POST", format!("/api/runs/{run}/freeze"), reason.clone()),
        ("POST", format!("/api/runs/{run}/unfreeze"), reason.clone()),
        ("POST", format!("/api/runs/{run}/cancel"), reason),
        ("GET", "/api/no-such-endpoint".into(), None),
    ]
}

fn pending(server: &Server) -> Vec<Value> {
    let r = get(server, "/api/approvals");
    assert_eq!(r.status, 200, "{}", r.text);
    r.body.as_array().unwrap().clone()
}

fn approve(server: &Server, run: &str, hash: &str, by: &str) -> common::Reply {
    post(
        server,
        &format!("/api/runs/{run}/approvals/1"),
        &json!({"decision": "approve", "payload_hash": hash, "reason": "diff reviewed", "by": by}),
    )
}

#[test]
fn every_api_request_without_the_right_bearer_token_is_401_and_changes_nothing() {
    let w = Workspace::gated();
    let server = Server::start(&w.store);
    let before = w.kinds();
    for (method, path, body) in endpoints(&w.run) {
        for token in [None, Some("wrong-token-0123456789abcdef"), Some("")] {
            let r = send(&server, method, &path, token, body.as_deref());
            assert_eq!(r.status, 401, "{method} {path} with {token:?}: {}", r.text);
            let error = r.error();
            assert!(
                error.contains("bearer token") || error.contains("Bearer TOKEN"),
                "{error}"
            );
            assert!(r.headers.contains_key("www-authenticate"));
        }
        // Another scheme is refused too, with what to send instead.
        let r = client_with_header(&server, &path, &format!("Basic {TOKEN}"));
        assert_eq!(r.0, 401, "{path}: {}", r.1);
        assert!(r.1.contains("Bearer TOKEN"), "{}", r.1);
    }
    assert_eq!(w.kinds(), before, "a refused request wrote nothing");
    assert_eq!(w.run().approvals[0].decision, None);
}

fn client_with_header(server: &Server, path: &str, auth: &str) -> (u16, String) {
    let r = common::client()
        .get(server.url(path))
        .header("Authorization", auth)
        .send()
        .unwrap();
    (r.status().as_u16(), r.text().unwrap())
}

#[test]
fn the_page_is_served_from_the_binary_and_names_no_other_origin() {
    let w = Workspace::gated();
    let server = Server::start(&w.store);
    for (path, kind) in [
        ("/", "text/html"),
        ("/app.js", "text/javascript"),
        ("/app.css", "text/css"),
    ] {
        let r = send(&server, "GET", path, None, None);
        assert_eq!(r.status, 200, "{path}");
        let content_type = r.headers["content-type"].to_str().unwrap();
        assert!(content_type.starts_with(kind), "{path}: {content_type}");
        let policy = r.headers["content-security-policy"].to_str().unwrap();
        assert!(policy.contains("default-src 'none'"), "{policy}");
        for origin in ["http://", "https://", "//cdn", "@import"] {
            assert!(
                !r.text.contains(origin),
                "{path} refers to another origin ({origin})"
            );
        }
    }
    let page = send(&server, "GET", "/", None, None).text;
    assert!(page.contains("<title>keel</title>"));
    assert!(page.contains("/app.js") && page.contains("/app.css"));
    // The page holds no data: that comes from the API, behind the token.
    assert!(!page.contains(&w.run));
}

#[test]
fn runs_are_listed_and_shown_with_budgets_and_time_waiting_for_people() {
    let w = Workspace::gated();
    let server = Server::start(&w.store);

    let r = get(&server, "/api/runs");
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.headers["cache-control"], "no-store");
    let runs = r.body.as_array().unwrap();
    assert_eq!(runs.len(), 1);
    let run = &runs[0];
    assert_eq!(run["id"], w.run.as_str());
    assert_eq!(run["state"], "awaiting_approval");
    assert_eq!(run["phase"], "publish");
    assert_eq!(run["phase_index"], 1);
    assert_eq!(run["pending_approvals"], 1);
    assert!(run["reason"].as_str().unwrap().contains("approval"));
    assert!(run["working_ms"].as_u64().is_some());
    assert!(run["human_wait_ms"].as_u64().is_some());
    assert!(run["waiting_since_ms"].as_i64().is_some(), "{run:#}");
    let steps = &run["budgets"]["steps"];
    assert!(steps["used"].as_u64().unwrap() >= 2, "{steps}");
    assert_eq!(steps["unit"], "count");
    assert_eq!(run["budgets"]["wall_time"]["unit"], "ms");

    let r = get(&server, &format!("/api/runs/{}", w.run));
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.body["state"], "awaiting_approval");
    assert_eq!(r.body["phases"][1]["gated"], true);
    assert_eq!(r.body["approvals"][0]["n"], 1);
    assert!(r.body["checkpoints"].as_u64().unwrap() >= 1);

    // A unique prefix will do, as on the command line.
    let r = get(&server, &format!("/api/runs/{}", &w.run[..20]));
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.body["id"], w.run.as_str());
}

#[test]
fn an_unknown_run_request_or_endpoint_is_404_with_what_exists() {
    let w = Workspace::gated();
    let server = Server::start(&w.store);
    let hash = pending(&server)[0]["payload_hash"]
        .as_str()
        .unwrap()
        .to_string();
    let reason = json!({"reason": "x"});
    for r in [
        get(&server, "/api/runs/nosuchrun"),
        get(&server, "/api/runs/nosuchrun/events"),
        get(&server, "/api/runs/nosuchrun/events/stream"),
        post(
            &server,
            "/api/runs/nosuchrun/approvals/1",
            &json!({"decision": "approve", "payload_hash": hash}),
        ),
        post(
            &server,
            "/api/runs/nosuchrun/questions/1",
            &json!({"answer": "x"}),
        ),
        post(&server, "/api/runs/nosuchrun/freeze", &reason),
        post(&server, "/api/runs/nosuchrun/unfreeze", &reason),
        post(&server, "/api/runs/nosuchrun/cancel", &reason),
    ] {
        assert_eq!(r.status, 404, "{}", r.text);
        assert!(r.error().contains("no run `nosuchrun`"), "{}", r.error());
        assert!(r.error().contains("GET /api/runs"), "{}", r.error());
    }
    let r = post(
        &server,
        &format!("/api/runs/{}/approvals/9", w.run),
        &json!({"decision": "approve", "payload_hash": hash}),
    );
    assert_eq!(r.status, 404, "{}", r.text);
    assert!(r.error().contains("no approval request 9"), "{}", r.error());
    let r = post(
        &server,
        &format!("/api/runs/{}/questions/1", w.run),
        &json!({"answer": "x"}),
    );
    assert_eq!(r.status, 404, "{}", r.text);
    assert!(r.error().contains("no question 1"), "{}", r.error());

    let r = get(&server, "/api/nothing/here");
    assert_eq!(r.status, 404, "{}", r.text);
    assert!(r.error().contains("/api/nothing/here"), "{}", r.error());
    assert!(r.error().contains("openapi.json"), "{}", r.error());
    let r = send(&server, "DELETE", "/api/runs", Some(TOKEN), None);
    assert_eq!(r.status, 405, "{}", r.text);
    assert!(r.error().contains("/api/runs"), "{}", r.error());
    assert_eq!(w.run().approvals[0].decision, None);
}

#[test]
fn a_malformed_request_is_400_with_a_message_that_says_what_to_send() {
    let w = Workspace::gated();
    let server = Server::start(&w.store);
    let hash = pending(&server)[0]["payload_hash"]
        .as_str()
        .unwrap()
        .to_string();
    let path = format!("/api/runs/{}/approvals/1", w.run);
    let cases: Vec<(String, String, &str)> = vec![
        (path.clone(), "{not json".into(), "not the JSON"),
        (path.clone(), "".into(), "body is empty"),
        (path.clone(), "[1, 2]".into(), "not the JSON"),
        (
            path.clone(),
            json!({"decision": "approve"}).to_string(),
            "`payload_hash` is required",
        ),
        (
            path.clone(),
            json!({"payload_hash": hash}).to_string(),
            "`decision` is required",
        ),
        (
            path.clone(),
            json!({"decision": "maybe", "payload_hash": hash}).to_string(),
            "\"approve\" or \"reject\"",
        ),
        (
            path.clone(),
            json!({"decision": "approve", "payloadHash": hash}).to_string(),
            "unknown field `payloadHash`",
        ),
        (
            format!("/api/runs/{}/approvals/first", w.run),
            json!({"decision": "approve", "payload_hash": hash}).to_string(),
            "not a request number",
        ),
        (
            format!("/api/runs/{}/approvals/0", w.run),
            json!({"decision": "approve", "payload_hash": hash}).to_string(),
            "count from 1",
        ),
        (
            format!("/api/runs/{}/freeze", w.run),
            "{\"reason\": ".into(),
            "not the JSON",
        ),
        (
            format!("/api/runs/{}/freeze", w.run),
            json!({"by": "alice"}).to_string(),
            "`reason` is required",
        ),
        (
            format!("/api/runs/{}/cancel", w.run),
            json!({"reason": "   "}).to_string(),
            "`reason` is required",
        ),
        (
            format!("/api/runs/{}/questions/1", w.run),
            json!({"text": "x"}).to_string(),
            "unknown field `text`",
        ),
    ];
    for (path, body, expected) in cases {
        let r = send(&server, "POST", &path, Some(TOKEN), Some(&body));
        assert_eq!(r.status, 400, "POST {path} {body}: {}", r.text);
        assert!(
            r.error().contains(expected),
            "POST {path} {body}: expected the error to say {expected:?}: {}",
            r.error()
        );
    }
    // Malformed JSON also says what a good body looks like.
    let r = send(&server, "POST", &path, Some(TOKEN), Some("{not json"));
    assert!(r.error().contains("\"payload_hash\""), "{}", r.error());
    // A query string that does not parse.
    let r = get(&server, &format!("/api/runs/{}/events?after=soon", w.run));
    assert_eq!(r.status, 400, "{}", r.text);
    assert!(r.error().contains("query string"), "{}", r.error());

    assert_eq!(w.count("approval_decided"), 0);
    assert_eq!(w.count("frozen"), 0);
    assert_eq!(w.run().state.as_str(), "awaiting_approval");
}

#[test]
fn pending_requests_carry_intent_payload_hash_checks_risk_and_rollback() {
    let w = Workspace::gated();
    let server = Server::start(&w.store);
    let list = pending(&server);
    assert_eq!(list.len(), 1);
    let a = &list[0];
    assert_eq!(a["run"], w.run.as_str());
    assert_eq!(a["run_state"], "awaiting_approval");
    assert_eq!(a["n"], 1);
    assert_eq!(a["phase"], "publish");
    assert!(a["intent"].as_str().unwrap().contains("publish"));
    let payload = a["payload"].as_str().unwrap();
    assert!(payload.contains("cp NOTES.md published.txt"), "{payload}");
    assert!(payload.contains("+- approval inbox"), "the diff: {payload}");
    assert_eq!(
        a["payload_hash"],
        blake3::hash(payload.as_bytes()).to_hex().as_str()
    );
    for key in ["risk", "rollback", "reversibility", "checks", "created_at"] {
        assert!(!a[key].is_null(), "no {key}: {a:#}");
    }
    assert!(a["decision"].is_null());
    assert_eq!(
        get(&server, "/api/approvals?all=true").body,
        Value::Array(list)
    );
}

#[test]
fn a_decision_is_recorded_once_and_a_second_delivery_is_409_naming_who_decided() {
    let w = Workspace::gated();
    let server = Server::start(&w.store);
    let hash = pending(&server)[0]["payload_hash"]
        .as_str()
        .unwrap()
        .to_string();

    let r = approve(&server, &w.run, &hash, "alice");
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.body["decision"], "approve");
    assert_eq!(r.body["by"], "alice");
    assert_eq!(r.body["via"], "http");
    let decision = w.run().approvals[0].decision.clone().unwrap();
    assert!(decision.approve);
    assert_eq!(decision.by, "alice");
    assert_eq!(decision.via, "http");
    assert_eq!(decision.reason, "diff reviewed");
    assert!(pending(&server).is_empty(), "no longer pending");
    let all = get(&server, "/api/approvals?all=true").body;
    assert_eq!(all[0]["decision"]["by"], "alice");

    // The same decision again: nothing changes, and the answer says who decided.
    let r = approve(&server, &w.run, &hash, "bob");
    assert_eq!(r.status, 409, "{}", r.text);
    assert!(
        r.error().contains("already approved by alice"),
        "{}",
        r.error()
    );
    assert_eq!(
        r.body["decided"],
        json!({"decision": "approve", "by": "alice", "same": true})
    );
    // A conflicting one: the first still counts.
    let r = post(
        &server,
        &format!("/api/runs/{}/approvals/1", w.run),
        &json!({"decision": "reject", "payload_hash": hash, "reason": "no", "by": "bob"}),
    );
    assert_eq!(r.status, 409, "{}", r.text);
    assert_eq!(r.body["decided"]["same"], false);
    // The same decision from the command line (`keel approve` calls this) changes nothing either.
    let cli = keel_engine::decide(
        &mut w.open(),
        &w.run,
        1,
        true,
        &hash,
        "ok",
        &keel_engine::Actor::current(),
        "cli",
    )
    .unwrap();
    assert!(
        matches!(cli, keel_engine::Decided::Already { same: true, ref by, .. } if by == "alice"),
        "{cli:?}"
    );
    assert_eq!(w.count("approval_decided"), 1);
    assert!(w.run().approvals[0].decision.as_ref().unwrap().approve);
}

#[test]
fn concurrent_approvals_over_http_make_one_decision_event() {
    let w = Workspace::gated();
    let server = Arc::new(Server::start(&w.store));
    let hash = pending(&server)[0]["payload_hash"]
        .as_str()
        .unwrap()
        .to_string();
    let n = 6;
    let barrier = Arc::new(Barrier::new(n));
    let threads: Vec<_> = (0..n)
        .map(|i| {
            let (server, barrier, hash, run) = (
                Arc::clone(&server),
                Arc::clone(&barrier),
                hash.clone(),
                w.run.clone(),
            );
            std::thread::spawn(move || {
                barrier.wait();
                let r = approve(&server, &run, &hash, &format!("person{i}"));
                (r.status, r.text)
            })
        })
        .collect();
    let results: Vec<(u16, String)> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    let ok: Vec<_> = results.iter().filter(|(s, _)| *s == 200).collect();
    let conflicts = results.iter().filter(|(s, _)| *s == 409).count();
    assert_eq!(ok.len(), 1, "{results:#?}");
    assert_eq!(conflicts, n - 1, "{results:#?}");
    assert_eq!(w.count("approval_decided"), 1);
    let winner: Value = serde_json::from_str(&ok[0].1).unwrap();
    assert_eq!(
        w.run().approvals[0].decision.as_ref().unwrap().by,
        winner["by"].as_str().unwrap()
    );
}

#[test]
fn a_decision_for_another_payload_is_refused_and_says_the_payload_changed() {
    let w = Workspace::gated();
    let server = Server::start(&w.store);
    let current = pending(&server)[0]["payload_hash"]
        .as_str()
        .unwrap()
        .to_string();
    let stale = blake3::hash(b"what the payload was before")
        .to_hex()
        .to_string();
    let r = approve(&server, &w.run, &stale, "alice");
    assert_eq!(r.status, 409, "{}", r.text);
    assert!(r.error().contains("the payload changed"), "{}", r.error());
    assert_eq!(r.body["payload_hash"], current.as_str());
    assert_eq!(w.count("approval_decided"), 0);
    assert_eq!(w.run().approvals[0].decision, None);
    // The current hash still works afterwards.
    assert_eq!(approve(&server, &w.run, &current, "alice").status, 200);
}

#[test]
fn a_rejection_needs_a_reason_and_is_recorded_with_it() {
    let w = Workspace::gated();
    let server = Server::start(&w.store);
    let hash = pending(&server)[0]["payload_hash"]
        .as_str()
        .unwrap()
        .to_string();
    let path = format!("/api/runs/{}/approvals/1", w.run);
    for body in [
        json!({"decision": "reject", "payload_hash": hash}),
        json!({"decision": "reject", "payload_hash": hash, "reason": "  "}),
    ] {
        let r = post(&server, &path, &body);
        assert_eq!(r.status, 400, "{}", r.text);
        assert!(
            r.error().contains("a rejection needs a reason"),
            "{}",
            r.error()
        );
    }
    assert_eq!(w.count("approval_decided"), 0);
    let r = post(
        &server,
        &path,
        &json!({"decision": "reject", "payload_hash": hash, "reason": "wrong release", "by": "carol"}),
    );
    assert_eq!(r.status, 200, "{}", r.text);
    let d = w.run().approvals[0].decision.clone().unwrap();
    assert!(!d.approve);
    assert_eq!(
        (d.by.as_str(), d.reason.as_str()),
        ("carol", "wrong release")
    );
}

#[test]
fn a_question_is_answered_once() {
    let w = Workspace::asking();
    let server = Server::start(&w.store);
    let r = get(&server, "/api/questions");
    assert_eq!(r.status, 200, "{}", r.text);
    let list = r.body.as_array().unwrap();
    assert_eq!(list.len(), 1, "{}", r.text);
    assert_eq!(list[0]["n"], 1);
    assert_eq!(
        list[0]["question"],
        "Which database should the migration target?"
    );
    assert_eq!(list[0]["run_state"], "waiting");
    let path = format!("/api/runs/{}/questions/1", w.run);

    let r = post(&server, &path, &json!({"answer": "  "}));
    assert_eq!(r.status, 400, "{}", r.text);
    let r = post(&server, &path, &json!({"answer": "staging", "by": "dana"}));
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.body["decision"], "answer");
    let answer = w.run().questions[0].answer.clone().unwrap();
    assert_eq!(
        (
            answer.text.as_str(),
            answer.by.as_str(),
            answer.via.as_str()
        ),
        ("staging", "dana", "http")
    );
    let r = post(
        &server,
        &path,
        &json!({"answer": "production", "by": "eve"}),
    );
    assert_eq!(r.status, 409, "{}", r.text);
    assert!(
        r.error().contains("already answered by dana"),
        "{}",
        r.error()
    );
    assert_eq!(w.count("question_answered"), 1);
    assert!(
        get(&server, "/api/questions")
            .body
            .as_array()
            .unwrap()
            .is_empty()
    );
    assert_eq!(
        get(&server, "/api/questions?all=true").body[0]["answer"]["text"],
        "staging"
    );
}

#[test]
fn freeze_unfreeze_and_cancel_are_recorded_with_who_and_why() {
    let w = Workspace::gated();
    let server = Server::start(&w.store);
    let base = format!("/api/runs/{}", w.run);

    let r = post(
        &server,
        &format!("{base}/freeze"),
        &json!({"reason": "investigating an alert", "by": "frank"}),
    );
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.body["frozen"], true);
    assert!(w.run().frozen);
    assert_eq!(get(&server, "/api/runs").body[0]["frozen"], true);

    let r = post(
        &server,
        &format!("{base}/unfreeze"),
        &json!({"reason": "alert resolved", "by": "frank"}),
    );
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.body["frozen"], false);
    assert!(!w.run().frozen);

    let r = post(
        &server,
        &format!("{base}/cancel"),
        &json!({"reason": "wrong task", "by": "grace"}),
    );
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.body["state"], "failed");
    assert!(
        r.body["reason"]
            .as_str()
            .unwrap()
            .contains("cancelled by grace")
    );

    // A finished run takes no hold, no second cancel and no decision.
    for what in ["freeze", "cancel"] {
        let r = post(
            &server,
            &format!("{base}/{what}"),
            &json!({"reason": "again"}),
        );
        assert_eq!(r.status, 409, "{what}: {}", r.text);
        assert!(r.error().contains("is failed"), "{}", r.error());
    }
    let hash = w.run().approvals[0].request.payload_hash.clone();
    let r = approve(&server, &w.run, &hash, "alice");
    assert_eq!(r.status, 409, "{}", r.text);

    let kinds = w.kinds();
    for kind in ["frozen", "unfrozen", "cancelled"] {
        assert_eq!(kinds.iter().filter(|k| *k == kind).count(), 1, "{kinds:?}");
    }
    assert_eq!(w.count("approval_decided"), 0);
}

#[test]
fn the_event_log_is_read_in_pages_after_a_sequence_number() {
    let w = Workspace::gated();
    let server = Server::start(&w.store);
    let r = get(&server, &format!("/api/runs/{}/events", w.run));
    assert_eq!(r.status, 200, "{}", r.text);
    let events = r.body["events"].as_array().unwrap();
    let total = w.kinds().len();
    assert_eq!(events.len(), total);
    assert_eq!(events[0]["seq"], 1);
    assert_eq!(events[0]["kind"], "run_created");
    assert_eq!(events[0]["body"]["kind"], "run_created");
    assert!(events[0]["hash"].as_str().unwrap().len() == 64);
    assert_eq!(r.body["more"], false);
    assert_eq!(r.body["last_seq"], total);
    assert!(
        events.iter().any(|e| e["kind"] == "approval_requested"
            && e["body"]["request"]["payload_hash"].is_string())
    );

    let r = get(
        &server,
        &format!("/api/runs/{}/events?after=2&limit=3", w.run),
    );
    let seqs: Vec<u64> = r.body["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["seq"].as_u64().unwrap())
        .collect();
    assert_eq!(seqs, vec![3, 4, 5]);
    assert_eq!(r.body["more"], true);
    assert_eq!(r.body["last_seq"], 5);

    let r = get(
        &server,
        &format!("/api/runs/{}/events?after={total}", w.run),
    );
    assert!(r.body["events"].as_array().unwrap().is_empty());
    assert_eq!(r.body["last_seq"], total);
    assert_eq!(r.body["more"], false);
}

/// One server-sent event.
#[derive(Debug, Default)]
struct Sse {
    event: Option<String>,
    id: Option<String>,
    data: String,
}

/// Reads the next server-sent event (skipping keep-alive comments); `None` at the end.
fn next_sse(reader: &mut impl BufRead) -> Option<Sse> {
    let mut sse = Sse::default();
    let mut any = false;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap() == 0 {
            return any.then_some(sse);
        }
        let line = line.trim_end_matches(['\r', '\n']);
        if line.is_empty() {
            if any {
                return Some(sse);
            }
            continue;
        }
        if line.starts_with(':') {
            continue;
        }
        let (field, value) = line.split_once(':').unwrap_or((line, ""));
        let value = value.strip_prefix(' ').unwrap_or(value).to_string();
        any = true;
        match field {
            "event" => sse.event = Some(value),
            "id" => sse.id = Some(value),
            "data" => {
                if !sse.data.is_empty() {
                    sse.data.push('\n');
                }
                sse.data.push_str(&value);
            }
            _ => {}
        }
    }
}

#[test]
fn the_event_stream_sends_the_log_then_new_events_live_and_ends_with_the_run() {
    let w = Workspace::gated();
    let server = Server::start(&w.store);
    let total = w.kinds().len() as u64;
    let response = common::client()
        .get(server.url(&format!("/api/runs/{}/events/stream?after=1", w.run)))
        .header("Authorization", format!("Bearer {TOKEN}"))
        .send()
        .unwrap();
    assert_eq!(response.status(), 200);
    assert!(
        response.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream")
    );
    let mut reader = BufReader::new(response);

    // What the log holds already, from after=1 on, in order.
    for seq in 2..=total {
        let sse = next_sse(&mut reader).expect("an event");
        assert_eq!(sse.event, None, "{sse:?}");
        assert_eq!(sse.id.as_deref(), Some(seq.to_string().as_str()));
        let event: Value = serde_json::from_str(&sse.data).unwrap();
        assert_eq!(event["seq"], seq);
    }
    // Something happens now: the stream delivers it.
    let r = post(
        &server,
        &format!("/api/runs/{}/freeze", w.run),
        &json!({"reason": "look at it", "by": "hal"}),
    );
    assert_eq!(r.status, 200, "{}", r.text);
    let sse = next_sse(&mut reader).expect("the freeze");
    let event: Value = serde_json::from_str(&sse.data).unwrap();
    assert_eq!(event["kind"], "frozen");
    assert_eq!(event["body"]["by"], "hal");
    assert_eq!(event["seq"], total + 1);

    // The run ends: its last events, then `end`, then the stream closes.
    let r = post(
        &server,
        &format!("/api/runs/{}/cancel", w.run),
        &json!({"reason": "done looking"}),
    );
    assert_eq!(r.status, 200, "{}", r.text);
    let mut kinds = Vec::new();
    let end = loop {
        let sse = next_sse(&mut reader).expect("events until the end");
        if sse.event.as_deref() == Some("end") {
            break sse;
        }
        let event: Value = serde_json::from_str(&sse.data).unwrap();
        kinds.push(event["kind"].as_str().unwrap().to_string());
    };
    assert_eq!(kinds, vec!["cancelled", "state_changed"]);
    let end: Value = serde_json::from_str(&end.data).unwrap();
    assert_eq!(end["state"], "failed");
    assert!(next_sse(&mut reader).is_none(), "the stream closes");

    // Last-Event-ID resumes after the event it names.
    let response = common::client()
        .get(server.url(&format!("/api/runs/{}/events/stream", w.run)))
        .header("Authorization", format!("Bearer {TOKEN}"))
        .header("Last-Event-ID", (total + 2).to_string())
        .send()
        .unwrap();
    let mut reader = BufReader::new(response);
    let sse = next_sse(&mut reader).unwrap();
    assert_eq!(sse.id.as_deref(), Some((total + 3).to_string().as_str()));
    assert_eq!(next_sse(&mut reader).unwrap().event.as_deref(), Some("end"));
}

#[test]
fn the_openapi_description_covers_every_endpoint() {
    let w = Workspace::gated();
    let server = Server::start(&w.store);
    let r = get(&server, "/api/openapi.json");
    assert_eq!(r.status, 200, "{}", r.text);
    assert!(r.body["openapi"].as_str().unwrap().starts_with("3."));
    assert_eq!(
        r.body["components"]["securitySchemes"]["bearer"]["scheme"],
        "bearer"
    );
    let paths = r.body["paths"].as_object().unwrap();
    for (path, method) in [
        ("/api/runs", "get"),
        ("/api/runs/{id}", "get"),
        ("/api/runs/{id}/events", "get"),
        ("/api/runs/{id}/events/stream", "get"),
        ("/api/approvals", "get"),
        ("/api/questions", "get"),
        ("/api/runs/{id}/approvals/{n}", "post"),
        ("/api/runs/{id}/questions/{n}", "post"),
        ("/api/runs/{id}/freeze", "post"),
        ("/api/runs/{id}/unfreeze", "post"),
        ("/api/runs/{id}/cancel", "post"),
        ("/api/openapi.json", "get"),
    ] {
        let op = &paths[path][method];
        assert!(op.is_object(), "{method} {path} is not described");
        assert!(op["responses"]["401"].is_object(), "{method} {path}: 401");
    }
    let decide = &paths["/api/runs/{id}/approvals/{n}"]["post"]["responses"];
    for code in ["200", "400", "404", "409"] {
        assert!(decide[code].is_object(), "decide: {code}");
    }
    // Every schema it refers to exists.
    let text = r.text.clone();
    for part in text.split("\"#/components/schemas/").skip(1) {
        let name = &part[..part.find('"').unwrap()];
        assert!(
            r.body["components"]["schemas"][name].is_object(),
            "schema {name} is referred to but missing"
        );
    }
}
