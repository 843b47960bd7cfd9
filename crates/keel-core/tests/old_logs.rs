//! Old logs stay readable, and the invariant checker judges them.
//!
//! `tests/logs/v1/` holds event logs written by keel with event version 1 (`make-v1.sh` says how
//! they were made; they are never regenerated). Every later keel must decode each event, find
//! its hash chain intact, fold the log without breaking an invariant, and reach the state keel
//! stored when the run ended. A change to the event vocabulary that cannot do this needs an
//! explicit migration with its own test, and a new fixture directory for the new version.
//!
//! The same logs, altered one way at a time, show that the checker finds what it is for.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use keel_core::budget::BudgetName;
use keel_core::event::{EffectStatus, Envelope, Event, EventBody, GENESIS_HASH, StepId};
use keel_core::invariant::{self, Outcome, Violation};
use keel_core::state::{RunState, StepState};
use serde_json::Value;

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/logs/v1")
}

/// The fixtures: name → (stored rows, stored projection).
fn fixtures() -> BTreeMap<String, (Vec<Value>, Value)> {
    let mut out = BTreeMap::new();
    for entry in std::fs::read_dir(dir()).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_str().unwrap().to_string();
        let Some(stem) = name.strip_suffix(".events.jsonl") else {
            continue;
        };
        let rows: Vec<Value> = std::fs::read_to_string(&path)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        let run: Value = serde_json::from_str(
            &std::fs::read_to_string(dir().join(format!("{stem}.run.json"))).unwrap(),
        )
        .unwrap();
        out.insert(stem.to_string(), (rows, run));
    }
    assert!(out.len() >= 2, "fixtures in {}", dir().display());
    out
}

/// Decodes stored rows and checks their links; [`with_run_id`] checks each hash.
fn decode(name: &str, rows: &[Value]) -> Vec<Event> {
    let mut prev = GENESIS_HASH.to_string();
    let mut events = Vec::new();
    for row in rows {
        let s = |k: &str| row[k].as_str().unwrap();
        let (seq, at, v) = (
            row["seq"].as_u64().unwrap(),
            row["at"].as_i64().unwrap(),
            u32::try_from(row["v"].as_u64().unwrap()).unwrap(),
        );
        assert_eq!(s("prev_hash"), prev, "{name}: event {seq} is linked");
        let body = EventBody::decode(v, s("body"))
            .unwrap_or_else(|e| panic!("{name}: event {seq} ({}) decodes: {e}", s("kind")));
        assert_eq!(body.kind(), s("kind"), "{name}: event {seq}");
        prev = s("hash").to_string();
        events.push(Event {
            run_id: String::new(),
            seq,
            at_ms: at,
            body,
        });
    }
    events
}

/// Sets the run id (from the stored projection) and checks every hash over the exact stored
/// bytes.
fn with_run_id(name: &str, rows: &[Value], run: &Value, mut events: Vec<Event>) -> Vec<Event> {
    let id = run["id"].as_str().unwrap().to_string();
    for (row, event) in rows.iter().zip(&mut events) {
        let s = |k: &str| row[k].as_str().unwrap();
        let computed = Envelope {
            prev_hash: s("prev_hash"),
            run_id: &id,
            seq: event.seq,
            at_ms: event.at_ms,
            version: u32::try_from(row["v"].as_u64().unwrap()).unwrap(),
            kind: s("kind"),
            body: s("body"),
        }
        .hash();
        assert_eq!(computed, s("hash"), "{name}: event {} hash", event.seq);
        event.run_id = id.clone();
    }
    events
}

fn load(name: &str) -> (Vec<Event>, Value) {
    let all = fixtures();
    let (rows, run) = &all[name];
    let events = with_run_id(name, rows, run, decode(name, rows));
    (events, run.clone())
}

/// Every field of `expected` is in `actual` with the same value; `actual` may have more
/// (fields added by a later keel).
fn contains(path: &str, actual: &Value, expected: &Value, out: &mut Vec<String>) {
    match (actual, expected) {
        (Value::Object(a), Value::Object(e)) => {
            for (k, v) in e {
                match a.get(k) {
                    Some(av) => contains(&format!("{path}.{k}"), av, v, out),
                    None => out.push(format!("{path}.{k}: missing")),
                }
            }
        }
        (Value::Array(a), Value::Array(e)) if a.len() == e.len() => {
            for (i, (av, ev)) in a.iter().zip(e).enumerate() {
                contains(&format!("{path}[{i}]"), av, ev, out);
            }
        }
        _ if actual != expected => out.push(format!("{path}: {actual} (stored: {expected})")),
        _ => {}
    }
}

/// Fields that keel-store keeps in the projection beside the fold: the lease counter, and the
/// start of the current stretch of wall time in the process that wrote it.
const STORE_FIELDS: [&str; 2] = ["lease", "active_since_ms"];

#[test]
fn every_old_log_decodes_keeps_every_invariant_and_reaches_the_stored_state() {
    for (name, (rows, run)) in fixtures() {
        let events = with_run_id(&name, &rows, &run, decode(&name, &rows));
        let audit = invariant::check(&events).unwrap_or_else(|v| {
            panic!(
                "{name}: {}",
                v.iter()
                    .map(Violation::to_string)
                    .collect::<Vec<_>>()
                    .join("\n")
            )
        });
        let mut folded = serde_json::to_value(&audit.run).unwrap();
        let mut stored = run.clone();
        for field in STORE_FIELDS {
            folded.as_object_mut().unwrap().remove(field);
            stored.as_object_mut().unwrap().remove(field);
        }
        let mut differences = Vec::new();
        contains("run", &folded, &stored, &mut differences);
        assert!(
            differences.is_empty(),
            "{name}: the fold of the old log differs from the state keel stored:\n{}",
            differences.join("\n")
        );
    }
}

/// Every kind of event in keel's vocabulary, as `EventBody` declares it: read from serde's
/// answer to a kind it does not know, which lists every kind it does, so that a kind added to
/// the enum is in this list without anyone remembering to add it.
fn vocabulary() -> std::collections::BTreeSet<String> {
    let unknown = serde_json::from_str::<EventBody>(r#"{"kind": "no_such_kind"}"#)
        .expect_err("no event has that kind")
        .to_string();
    let (_, listed) = unknown
        .split_once("expected one of ")
        .unwrap_or_else(|| panic!("serde lists the known kinds: {unknown}"));
    let kinds: std::collections::BTreeSet<String> = listed
        .split(',')
        .filter_map(|k| {
            let k = k.trim();
            let k = k.split(" at line").next().unwrap_or(k);
            k.strip_prefix('`')?.strip_suffix('`').map(str::to_string)
        })
        .collect();
    assert!(
        kinds.contains("run_created") && kinds.len() > 30,
        "{kinds:?}"
    );
    kinds
}

/// Kinds this version of keel never writes, so that no log it wrote can hold one: a verified
/// step whose environment changed is not invalidated, the run stops `blocked` on the drift
/// until a person migrates it (`drift_detected`, `migrated`). The fold and the invariant
/// checker still know the kind (`a_verified_step_run_again_without_invalidation_is_found`).
const NEVER_WRITTEN: [&str; 1] = ["step_invalidated"];

#[test]
fn the_fixtures_cover_the_vocabulary() {
    let mut kinds = std::collections::BTreeSet::new();
    for (name, (rows, run)) in fixtures() {
        for e in with_run_id(&name, &rows, &run, decode(&name, &rows)) {
            kinds.insert(e.body.kind().to_string());
        }
    }
    let missing: Vec<String> = vocabulary()
        .into_iter()
        .filter(|k| !kinds.contains(k) && !NEVER_WRITTEN.contains(&k.as_str()))
        .collect();
    assert!(
        missing.is_empty(),
        "no fixture log has a {missing:?} event: a kind keel writes needs a log that holds it \
         (a new fixture in tests/logs/, made as make-v1.sh says), or a place in NEVER_WRITTEN \
         with the reason keel never writes it"
    );
    for kind in NEVER_WRITTEN {
        assert!(vocabulary().contains(kind), "`{kind}` is no longer a kind");
        assert!(
            !kinds.contains(kind),
            "a fixture holds `{kind}`, which NEVER_WRITTEN says keel never writes"
        );
    }
}

#[test]
fn the_agent_fixture_ends_completed_with_its_effect_done() {
    let (events, _) = load("agent");
    let audit = invariant::check(&events).unwrap();
    assert_eq!(audit.run.state, RunState::Completed);
    // The write (reversible) and the `record` tool (irreversible, keyed): both done.
    let tools: Vec<(&str, EffectStatus)> = audit
        .effects
        .iter()
        .map(|e| (e.tool.as_str(), e.status))
        .collect();
    assert_eq!(
        tools,
        [
            ("write", EffectStatus::Done),
            ("record", EffectStatus::Done)
        ]
    );
    let outcome = Outcome::of(&audit);
    assert!(outcome.differences(&outcome).is_empty());
    // Applied once: consistent. Applied twice, or not at all though done: both reported.
    let write = audit.effects[0].key.clone();
    let key = audit.effects[1].key.clone();
    let once = BTreeMap::from([(write.clone(), 1), (key.clone(), 1)]);
    assert!(invariant::check_applied(&audit.effects, &once).is_empty());
    let rules = |applied: BTreeMap<String, u64>| -> Vec<&'static str> {
        invariant::check_applied(&audit.effects, &applied)
            .iter()
            .map(|v| v.rule)
            .collect()
    };
    assert_eq!(
        rules(BTreeMap::from([(write.clone(), 1), (key.clone(), 2)])),
        ["effect_applied_twice", "effect_done_not_applied"]
    );
    assert_eq!(
        rules(BTreeMap::from([(write.clone(), 1)])),
        ["effect_done_not_applied"]
    );
    assert_eq!(
        rules(BTreeMap::from([
            (write, 1),
            (key, 1),
            ("keel-other".into(), 1)
        ])),
        ["effect_unknown"]
    );
}

/// The rules the checker reports for an altered log.
fn broken(events: &[Event]) -> Vec<&'static str> {
    match invariant::check(events) {
        Ok(_) => Vec::new(),
        Err(v) => v.iter().map(|v| v.rule).collect(),
    }
}

fn renumber(events: &mut [Event]) {
    for (i, e) in events.iter_mut().enumerate() {
        e.seq = i as u64 + 1;
    }
}

#[test]
fn a_gap_in_the_sequence_is_found() {
    let (mut events, _) = load("agent");
    let removed = events.remove(events.len() / 2);
    let rules = broken(&events);
    assert!(
        rules.contains(&"sequence"),
        "{rules:?} after removing {removed:?}"
    );
}

#[test]
fn an_event_after_the_terminal_state_is_found() {
    let (mut events, _) = load("agent");
    let last = events.last().unwrap().clone();
    events.push(Event {
        seq: last.seq + 1,
        body: EventBody::NoteAdded {
            step: StepId { phase: 1, index: 0 },
            text: "late".into(),
        },
        ..last
    });
    assert_eq!(broken(&events), ["after_terminal"]);
}

#[test]
fn an_illegal_or_misplaced_transition_is_found() {
    let (mut events, _) = load("agent");
    let i = events
        .iter()
        .position(|e| matches!(e.body, EventBody::StateChanged { .. }))
        .unwrap();
    if let EventBody::StateChanged { from, to, .. } = &mut events[i].body {
        *from = RunState::Completed;
        *to = RunState::Executing;
    }
    let rules = broken(&events);
    assert!(rules.contains(&"transition"), "{rules:?}");
}

#[test]
fn a_limit_raised_without_a_person_is_found() {
    let (mut events, _) = load("agent");
    let i = events
        .iter()
        .position(|e| matches!(e.body, EventBody::BudgetRaised { .. }))
        .expect("the agent fixture raises a budget");
    if let EventBody::BudgetRaised { by, .. } = &mut events[i].body {
        by.clear();
    }
    assert_eq!(broken(&events), ["limit_changed"]);
    // Raising a different budget than the one whose limit changes is also found.
    let (mut events, _) = load("agent");
    if let EventBody::BudgetRaised { budget, .. } = &mut events[i].body {
        *budget = BudgetName::Tokens;
    }
    let rules = broken(&events);
    assert!(
        rules.contains(&"limit_changed") || rules.contains(&"fold"),
        "{rules:?}"
    );
}

#[test]
fn a_verified_step_run_again_without_invalidation_is_found() {
    let (mut events, _) = load("agent");
    // The command phase's step is verified early; a later, second start of it is not allowed
    // to take the verification away silently.
    let first = StepId { phase: 0, index: 0 };
    let verified = events
        .iter()
        .position(|e| matches!(&e.body, EventBody::StepVerified { step } if *step == first))
        .unwrap();
    let started = events[..verified]
        .iter()
        .rev()
        .find(|e| matches!(&e.body, EventBody::StepStarted { step, .. } if *step == first))
        .unwrap()
        .clone();
    let at = events.len() - 3;
    events.insert(at, started);
    renumber(&mut events);
    let rules = broken(&events);
    assert!(
        !rules.is_empty(),
        "a verified step started again is refused"
    );
    // And where a log says why, losing the verification is fine by the checker's rule.
    let (events, _) = load("agent");
    let audit = invariant::check(&events).unwrap();
    assert!(audit.verified_steps.contains(&first));
    assert_eq!(audit.run.step(first).unwrap().state, StepState::Verified);
}

#[test]
fn an_effect_settled_twice_or_without_intent_is_found() {
    let (mut events, _) = load("agent");
    let settled = events
        .iter()
        .position(|e| matches!(e.body, EventBody::EffectSettled { .. }))
        .unwrap();
    let copy = events[settled].clone();
    // Intended again under the same key.
    let intended = events
        .iter()
        .position(|e| matches!(e.body, EventBody::EffectIntended { .. }))
        .unwrap();
    let again = events[intended].clone();
    events.insert(settled + 1, again);
    renumber(&mut events);
    assert!(broken(&events).contains(&"effect_intended_twice"));
    // Settled under a key never intended.
    let (mut events, _) = load("agent");
    let mut stray = copy;
    if let EventBody::EffectSettled { key, .. } = &mut stray.body {
        *key = "keel-00000000000000000000000000000000".into();
    }
    events.insert(settled + 1, stray);
    renumber(&mut events);
    assert!(broken(&events).contains(&"effect_settled_unintended"));
}
