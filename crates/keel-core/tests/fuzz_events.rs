//! Bad input to the event decoder, `EventBody::decode`: arbitrary text, and the encodings of
//! valid events mutated in place (values swapped for wrong types, huge numbers, long strings and
//! deep nesting; keys removed, added and repeated; bytes flipped, cut and inserted; invalid
//! UTF-8 made lossy, since a stored body is text).
//!
//! Each property runs 256 cases by default; set `KEEL_FUZZ_CASES` (for example
//! `KEEL_FUZZ_CASES=100000`) to run more. Nothing is written to the source tree: a failure prints
//! the smallest input it found instead of saving it.
//!
//! What is asserted: the decoder never panics; a refusal says "event body does not decode" and
//! why; only version 1 is read, and any other version is refused with advice whatever the body;
//! and whatever it accepts is a real event: it re-encodes and decodes to the same value, and its
//! kind is the `kind` the text names. (The hash chain over stored events is exercised in
//! keel-store's `tests/fuzz_decode.rs`.)

#![allow(clippy::unwrap_used, clippy::expect_used)]

use keel_core::agent::{ModelReply, Reversibility, ToolCall, Usage};
use keel_core::budget::{BudgetLimits, BudgetName};
use keel_core::contract::Tier;
use keel_core::event::{
    ApprovalRequest, Block, BudgetStop, Check, Decision, DecodeError, EVENT_VERSION, EffectStatus,
    EventBody, Evidence, Gate, OnExpiry, PhaseOutline, StepId,
};
use keel_core::fingerprint::{Fingerprint, FingerprintChange};
use keel_core::state::RunState;
use keel_test_support::fuzz::{self, ByteEdit, apply, apply_bytes};
use keel_test_support::oracle::events::check;
use proptest::prelude::*;
use proptest::sample::Index;
use serde_json::{Value, json};

// ---- valid events --------------------------------------------------------------------------------

const STEP: StepId = StepId { phase: 0, index: 3 };

fn fingerprint() -> Fingerprint {
    Fingerprint {
        head: Some("a".repeat(40)),
        branch: Some("main".into()),
        tree: "b".repeat(40),
        lockfiles: [("Cargo.lock".to_string(), "c".repeat(64))].into(),
        commands: [("rustc --version".to_string(), "d".repeat(64))].into(),
        tools: [("git".to_string(), "2.43.0".to_string())].into(),
        keel_version: "0.1.0".into(),
    }
}

fn change() -> FingerprintChange {
    FingerprintChange {
        part: "lockfile".into(),
        key: Some("Cargo.lock".into()),
        before: Some("c".repeat(64)),
        after: None,
    }
}

/// Events of most kinds, with every nested type keel stores.
fn samples() -> Vec<EventBody> {
    let mut limits = BudgetLimits::default();
    limits.set(BudgetName::Steps, 40);
    limits.set(BudgetName::CostUsd, 1_500_000);
    vec![
        EventBody::RunCreated {
            contract_hash: "e".repeat(64),
            contract_file: "keel.toml".into(),
            workspace: "/work/repo".into(),
            phases: vec![
                PhaseOutline {
                    name: "build".into(),
                    commands: vec!["make".into()],
                    agent: false,
                    approval: true,
                },
                PhaseOutline {
                    name: "fix".into(),
                    commands: vec![],
                    agent: true,
                    approval: false,
                },
            ],
            acceptance: vec!["tests".into()],
            limits,
            base: fingerprint(),
            keel_version: "0.1.0".into(),
            driver: Some(keel_core::event::DriverChoice {
                kind: Some(keel_core::contract::DriverKind::Openai),
                model: Some("gpt-5-mini".into()),
            }),
            sandbox_off: true,
        },
        EventBody::StateChanged {
            from: RunState::Executing,
            to: RunState::Blocked,
            reason: "budget `steps` exhausted".into(),
            block: Some(Block::Budget(BudgetStop {
                budget: BudgetName::Steps,
                used: 40,
                limit: 40,
            })),
        },
        EventBody::StateChanged {
            from: RunState::Executing,
            to: RunState::Blocked,
            reason: "drift".into(),
            block: Some(Block::Drift {
                changes: vec![change()],
            }),
        },
        EventBody::Resumed {
            holder: "host:1:2".into(),
            lease: 7,
            checkpoint: Some(2),
        },
        EventBody::StepStarted {
            step: STEP,
            attempt: 1,
            command: "cargo test".into(),
            agent: true,
        },
        EventBody::ModelReplied {
            step: STEP,
            response: "f".repeat(64),
            reply: ModelReply {
                text: Some("Reading the file.".into()),
                calls: vec![ToolCall {
                    id: "call_1".into(),
                    name: "read".into(),
                    arguments: "{\"path\":\"src/lib.rs\"}".into(),
                }],
                usage: Usage {
                    input_tokens: 812,
                    output_tokens: 64,
                },
                stop_reason: Some("tool_calls".into()),
            },
            usage: Usage {
                input_tokens: 812,
                output_tokens: 64,
            },
            cost_micro_usd: 330,
            retries: vec!["429 rate limited".into()],
            duration_ms: 1200,
            post_tree: None,
        },
        EventBody::PolicyDecision {
            step: STEP,
            call: 0,
            tool: "write".into(),
            arguments: "{\"path\":\"x\"}".into(),
            decision: Decision::Deny,
            rule: "scope.forbidden".into(),
            reversibility: Reversibility::Reversible,
            pre_tree: Some("1".repeat(40)),
            error_fingerprint: Some("deny:scope".into()),
        },
        EventBody::EffectSettled {
            step: STEP,
            call: 1,
            key: "keel-0123".into(),
            status: EffectStatus::Unknown,
            detail: "interrupted".into(),
        },
        EventBody::ApprovalRequested {
            request: ApprovalRequest {
                n: 1,
                gate: Gate::Reconcile {
                    step: STEP,
                    call: 1,
                    key: "keel-0123".into(),
                },
                intent: "Deploy.".into(),
                payload: "./deploy.sh".into(),
                payload_hash: ApprovalRequest::hash_payload("./deploy.sh"),
                checks: vec![Check {
                    verifier: "tests".into(),
                    passed: true,
                    status: "exit 0".into(),
                    evidence: 3,
                }],
                risk: "production".into(),
                reversibility: Reversibility::Irreversible,
                rollback: "none".into(),
                created_at_ms: 1_700_000_000_000,
                expires_at_ms: Some(1_700_000_100_000),
                on_expiry: Some(OnExpiry::Block),
            },
        },
        EventBody::ApprovalDecided {
            n: 1,
            approve: false,
            payload_hash: "9".repeat(64),
            by: "ana".into(),
            reason: "not today".into(),
            via: "http".into(),
        },
        EventBody::EvidenceRecorded {
            evidence: Evidence {
                n: 3,
                verifier: "tests".into(),
                tier: Tier::Acceptance,
                command: "cargo test".into(),
                passed: false,
                status: "exit 101".into(),
                duration_ms: 900,
                cpu_ms: 850,
                output: "a".repeat(64),
                tree: "b".repeat(40),
                fingerprint: "c".repeat(64),
                step: Some(STEP),
                phase: Some(0),
                excerpt: Some("assertion failed".into()),
            },
        },
        EventBody::StepFinished {
            step: STEP,
            signature: Some("sig".into()),
            status: "exit 0".into(),
            success: true,
            duration_ms: 10,
            cpu_ms: 5,
            output: "a".repeat(64),
            post: fingerprint(),
            files_written: 2,
            diff_files: 3,
            diff_lines: 40,
        },
        EventBody::BudgetRaised {
            budget: BudgetName::WallTime,
            from: Some(3_600_000),
            to: 7_200_000,
            reason: "more time".into(),
            by: "ana".into(),
        },
        EventBody::Migrated {
            changes: vec![change()],
            reason: "lockfile update".into(),
            by: "ana".into(),
            fingerprint: fingerprint(),
        },
        EventBody::TailCut {
            seq: 12,
            reason: "torn write".into(),
        },
        EventBody::Cancelled {
            reason: "stop".into(),
            by: "ana".into(),
        },
    ]
}

// ---- JSON mutations -----------------------------------------------------------------------------

const KEYS: &[&str] = &[
    "kind", "step", "phase", "index", "reason", "by", "block", "cause", "reply", "usage", "calls",
    "request", "gate", "limits", "base", "n", "seq", "tree", "changes",
];

/// Values chosen to break assumptions (`fuzz::hostile`'s), numbers just past `u32`, below zero
/// and between integers, and the names of other kinds and states.
fn hostile() -> BoxedStrategy<Value> {
    let fixed = vec![json!(u64::from(u32::MAX) + 1), json!(-1), json!(0.5)];
    let names = proptest::sample::select(vec![
        "frozen",
        "cancelled",
        "state_changed",
        "run_created",
        "blocked",
        "completed",
        "budget",
        "steps",
        "cost_usd",
        "allow",
        "phase",
        "reconcile",
        "acceptance",
    ]);
    fuzz::hostile(fixed, vec![names.prop_map(Value::from).boxed()])
}

/// `fuzz::byte_edit`'s edits, and another kind put first.
fn byte_edit() -> BoxedStrategy<ByteEdit> {
    fuzz::byte_edit_with(
        fuzz::JSON_TOKENS,
        vec![
            Just(ByteEdit::RepeatFirstPair).boxed(),
            proptest::sample::select(vec!["frozen", "cancelled", "resumed", "tail_cut"])
                .prop_map(ByteEdit::KindFirst)
                .boxed(),
        ],
    )
}

// ---- properties ---------------------------------------------------------------------------------

proptest! {
    #![proptest_config(fuzz::config())]

    #[test]
    fn arbitrary_text_never_panics_the_decoder(
        text in prop_oneof![any::<String>(), "[{}\\[\\]\":,a-z_0-9 -]{0,200}"],
    ) {
        check(&text);
    }

    #[test]
    fn arbitrary_bytes_never_decode_to_garbage(bytes in proptest::collection::vec(any::<u8>(), 0..400)) {
        check(&String::from_utf8_lossy(&bytes));
    }

    #[test]
    fn a_mutated_event_decodes_to_a_real_event_or_is_refused(
        which in any::<Index>(),
        edits in proptest::collection::vec(fuzz::edit(fuzz::key(KEYS), hostile()), 1..4),
    ) {
        let samples = samples();
        let sample = &samples[which.index(samples.len())];
        let json: Value = serde_json::from_str(&sample.encode()).unwrap();
        let mutated = edits.iter().fold(json, apply);
        check(&mutated.to_string());
    }

    #[test]
    fn mutated_bytes_of_an_event_decode_to_a_real_event_or_are_refused(
        which in any::<Index>(),
        edits in proptest::collection::vec(byte_edit(), 1..4),
    ) {
        let samples = samples();
        let sample = &samples[which.index(samples.len())];
        let bytes = edits.iter().fold(sample.encode().into_bytes(), apply_bytes);
        check(&String::from_utf8_lossy(&bytes));
    }
}

#[test]
fn every_sample_round_trips_exactly() {
    for sample in samples() {
        let text = sample.encode();
        assert_eq!(EventBody::decode(EVENT_VERSION, &text), Ok(sample.clone()));
        check(&text);
    }
}

#[test]
fn a_body_nested_past_the_limit_is_refused_not_a_crash() {
    let deep = format!(
        "{{\"kind\":\"tail_cut\",\"seq\":1,\"reason\":{}\"x\"{}}}",
        "[".repeat(100_000),
        "]".repeat(100_000)
    );
    assert!(matches!(
        EventBody::decode(EVENT_VERSION, &deep),
        Err(DecodeError::Body(_))
    ));
}

#[test]
fn a_repeated_key_in_an_event_body_is_refused() {
    // Which of two `kind`s (or two reasons) would count is not a question the decoder answers.
    for text in [
        r#"{"kind":"frozen","kind":"cancelled","reason":"r","by":"b"}"#,
        r#"{"kind":"cancelled","reason":"r","reason":"s","by":"b"}"#,
    ] {
        let err = EventBody::decode(EVENT_VERSION, text).unwrap_err();
        assert!(err.to_string().contains("duplicate field"), "{err}");
    }
}

#[test]
fn an_unknown_key_in_an_event_body_is_refused() {
    // keel never writes a key its own vocabulary lacks, so a version-1 body with one is not
    // keel's: dropping the key would decode an event other than the one the hash covers.
    let text = r#"{"kind":"cancelled","reason":"r","by":"b","unknown":1}"#;
    let err = EventBody::decode(EVENT_VERSION, text).unwrap_err();
    assert!(err.to_string().contains("unknown field `unknown`"), "{err}");
    // So is one inside a nested part of the body.
    let nested = r#"{"kind":"step_verified","step":{"phase":0,"index":1,"unknown":1}}"#;
    let err = EventBody::decode(EVENT_VERSION, nested).unwrap_err();
    assert!(err.to_string().contains("unknown field `unknown`"), "{err}");
    // The same bodies without it are events.
    assert_eq!(
        EventBody::decode(
            EVENT_VERSION,
            r#"{"kind":"step_verified","step":{"phase":0,"index":1}}"#
        ),
        Ok(EventBody::StepVerified {
            step: StepId { phase: 0, index: 1 }
        })
    );
    let known = r#"{"kind":"cancelled","reason":"r","by":"b"}"#;
    assert_eq!(
        EventBody::decode(EVENT_VERSION, known),
        Ok(EventBody::Cancelled {
            reason: "r".into(),
            by: "b".into()
        })
    );
}
