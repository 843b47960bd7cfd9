//! Property tests of the run projection: arbitrary event sequences never produce an illegal
//! state. Every event is either refused (and the run is left exactly as it was) or moves along
//! the transition tables, and the invariants below hold after each one.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use keel_core::budget::{BudgetLimits, BudgetName};
use keel_core::contract::Tier;
use keel_core::event::{Block, BudgetStop, Event, EventBody, Evidence, PhaseOutline, StepId};
use keel_core::fingerprint::Fingerprint;
use keel_core::run::Run;
use keel_core::state::{RunState, StepState};
use proptest::prelude::*;

fn fp(tree: u8) -> Fingerprint {
    Fingerprint {
        tree: format!("{tree:02x}").repeat(20),
        ..Fingerprint::default()
    }
}

fn created() -> Run {
    let mut limits = BudgetLimits::default();
    limits.set(BudgetName::Steps, 5);
    let e = Event {
        run_id: "r".into(),
        seq: 1,
        at_ms: 0,
        body: EventBody::RunCreated {
            contract_hash: "c".into(),
            contract_file: "keel.toml".into(),
            workspace: ".".into(),
            phases: vec![
                PhaseOutline {
                    name: "a".into(),
                    commands: vec!["x".into(), "y".into()],
                    agent: false,
                    approval: false,
                },
                PhaseOutline {
                    name: "b".into(),
                    commands: vec!["z".into()],
                    agent: false,
                    approval: false,
                },
            ],
            acceptance: vec!["accept".into()],
            limits,
            base: fp(0),
            keel_version: "0".into(),
            driver: None,
            sandbox_off: false,
        },
    };
    Run::create(&e).unwrap()
}

/// Evidence of the acceptance verifier `accept`.
fn acceptance(n: u32, passed: bool, tree: u8) -> EventBody {
    EventBody::EvidenceRecorded {
        evidence: Evidence {
            n,
            verifier: "accept".into(),
            tier: Tier::Acceptance,
            command: "true".into(),
            passed,
            status: "exit 0".into(),
            duration_ms: 1,
            cpu_ms: 1,
            output: "o".into(),
            tree: fp(tree).tree,
            fingerprint: "f".into(),
            step: None,
            phase: None,
            excerpt: None,
        },
    }
}

fn any_state() -> impl Strategy<Value = RunState> {
    prop::sample::select(RunState::ALL.to_vec())
}

fn any_step() -> impl Strategy<Value = StepId> {
    (0u32..3, 0u32..3).prop_map(|(phase, index)| StepId { phase, index })
}

fn any_body() -> impl Strategy<Value = EventBody> {
    prop_oneof![
        (any_state(), any_state(), any::<bool>()).prop_map(|(from, to, blocked)| {
            EventBody::StateChanged {
                from,
                to,
                reason: "r".into(),
                block: blocked.then_some(Block::Budget(BudgetStop {
                    budget: BudgetName::Steps,
                    used: 5,
                    limit: 5,
                })),
            }
        }),
        (any_step(), 1u32..4).prop_map(|(step, attempt)| EventBody::StepStarted {
            step,
            attempt,
            command: "c".into(),
            agent: false,
        }),
        (any_step(), 0u8..4, 0u64..3).prop_map(|(step, tree, files)| EventBody::StepFinished {
            signature: None,
            step,
            status: "exit 0".into(),
            success: true,
            duration_ms: 1,
            cpu_ms: 1,
            output: "o".into(),
            post: fp(tree),
            files_written: files,
            diff_files: files,
            diff_lines: files * 3,
        }),
        any_step().prop_map(|step| EventBody::StepVerified { step }),
        (any_step(), 0u8..3).prop_map(|(step, e)| EventBody::StepFailed {
            step,
            reason: "r".into(),
            error_fingerprint: format!("e{e}"),
            excerpt: String::new(),
            rolled_back: vec![],
            kept: false,
        }),
        any_step().prop_map(|step| EventBody::StepRolledBack {
            step,
            restored: vec![],
            saved_ref: None
        }),
        any_step().prop_map(|step| EventBody::StepInvalidated {
            step,
            reason: "r".into()
        }),
        (0u32..3).prop_map(|phase| EventBody::PhaseVerified { phase }),
        (0u32..5).prop_map(|n| EventBody::CheckpointTaken {
            n,
            hash: "h".into(),
            snapshot_ref: "r".into(),
            commit: "c".into()
        }),
        (1u32..8, any::<bool>(), 0u8..4).prop_map(|(n, passed, tree)| acceptance(n, passed, tree)),
        (1u64..10).prop_map(|to| EventBody::BudgetRaised {
            budget: BudgetName::Steps,
            from: Some(5),
            to,
            reason: "r".into(),
            by: "me".into()
        }),
        Just(EventBody::Resumed {
            holder: "h".into(),
            lease: 2,
            checkpoint: None
        }),
    ]
}

const COUNTERS: [BudgetName; 5] = [
    BudgetName::Steps,
    BudgetName::ToolCalls,
    BudgetName::Writes,
    BudgetName::ComputeTime,
    BudgetName::WallTime,
];

fn check_invariants(before: &Run, after: &Run) -> Result<(), TestCaseError> {
    prop_assert!(
        before.state == after.state || before.state.can_become(after.state),
        "run moved {} -> {} outside the table",
        before.state,
        after.state
    );
    prop_assert!(
        !before.state.is_terminal(),
        "an event followed a terminal state"
    );
    for (p, (pb, pa)) in before.phases.iter().zip(&after.phases).enumerate() {
        for (i, (sb, sa)) in pb.steps.iter().zip(&pa.steps).enumerate() {
            prop_assert!(
                sb.state == sa.state || sb.state.can_become(sa.state),
                "step {}.{} moved {} -> {} outside the table",
                p + 1,
                i + 1,
                sb.state,
                sa.state
            );
        }
    }
    let in_progress: Vec<StepId> = after
        .phases
        .iter()
        .enumerate()
        .flat_map(|(p, ph)| {
            ph.steps.iter().enumerate().filter_map(move |(i, s)| {
                (s.state == StepState::InProgress).then_some(StepId {
                    phase: p as u32,
                    index: i as u32,
                })
            })
        })
        .collect();
    prop_assert_eq!(
        in_progress,
        after.in_progress.iter().map(|p| p.step).collect::<Vec<_>>(),
        "steps in progress and the in-progress record disagree"
    );
    for b in COUNTERS {
        prop_assert!(after.used(b) >= before.used(b), "{} went down", b);
    }
    prop_assert!(after.cursor as usize <= after.phases.len());
    for phase in &after.phases[..after.cursor as usize] {
        prop_assert!(phase.verified, "a phase behind the cursor is not verified");
    }
    if after.state == RunState::Completed {
        let e = after.evidence.get("accept");
        prop_assert!(
            e.is_some_and(|e| e.passed && e.tree == after.fingerprint.tree),
            "completed without passing acceptance evidence for the current tree"
        );
    }
    prop_assert_eq!(after.state == RunState::Blocked, after.block.is_some());
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn arbitrary_event_sequences_never_produce_an_illegal_state(
        bodies in prop::collection::vec(any_body(), 1..60)
    ) {
        let mut run = created();
        for (i, body) in bodies.into_iter().enumerate() {
            let event = Event { run_id: "r".into(), seq: run.seq + 1, at_ms: i as i64, body };
            let before = run.clone();
            match run.apply(&event) {
                Ok(()) => {
                    prop_assert_eq!(run.seq, before.seq + 1);
                    check_invariants(&before, &run)?;
                }
                Err(_) => prop_assert_eq!(&run, &before, "a refused event changed the run"),
            }
        }
    }

    #[test]
    fn events_out_of_sequence_are_refused(gap in 2u64..100) {
        let mut run = created();
        let event = Event {
            run_id: "r".into(),
            seq: run.seq + gap,
            at_ms: 0,
            body: EventBody::Resumed { holder: "h".into(), lease: 1, checkpoint: None },
        };
        prop_assert!(run.apply(&event).is_err());
    }
}

/// A sequence that drives the run all the way, to show the generator's space contains the
/// legal path and that `completed` needs the evidence.
#[test]
fn the_legal_path_reaches_completed_only_with_evidence() {
    let mut run = created();
    let push = |run: &mut Run, body: EventBody| {
        let e = Event {
            run_id: "r".into(),
            seq: run.seq + 1,
            at_ms: 0,
            body,
        };
        run.apply(&e)
    };
    let step = |phase, index| StepId { phase, index };
    let change = |from, to| EventBody::StateChanged {
        from,
        to,
        reason: "r".into(),
        block: None,
    };
    let checkpoint = |n| EventBody::CheckpointTaken {
        n,
        hash: "h".into(),
        snapshot_ref: "r".into(),
        commit: "c".into(),
    };
    push(&mut run, checkpoint(0)).unwrap();
    push(&mut run, change(RunState::Planned, RunState::Executing)).unwrap();
    for s in [step(0, 0), step(0, 1), step(1, 0)] {
        if s.phase == 1 && run.cursor == 0 {
            push(&mut run, EventBody::PhaseVerified { phase: 0 }).unwrap();
            push(&mut run, checkpoint(1)).unwrap();
        }
        push(
            &mut run,
            EventBody::StepStarted {
                step: s,
                attempt: 1,
                command: "c".into(),
                agent: false,
            },
        )
        .unwrap();
        push(
            &mut run,
            EventBody::StepFinished {
                signature: None,
                step: s,
                status: "exit 0".into(),
                success: true,
                duration_ms: 1,
                cpu_ms: 1,
                output: "o".into(),
                post: fp(1),
                files_written: 1,
                diff_files: 1,
                diff_lines: 1,
            },
        )
        .unwrap();
        push(&mut run, EventBody::StepVerified { step: s }).unwrap();
    }
    push(&mut run, EventBody::PhaseVerified { phase: 1 }).unwrap();
    push(&mut run, checkpoint(2)).unwrap();
    push(&mut run, change(RunState::Executing, RunState::Verifying)).unwrap();
    // No evidence yet: completion is refused.
    assert!(push(&mut run, change(RunState::Verifying, RunState::Completed)).is_err());
    // Failing evidence, and passing evidence for another tree, do not count.
    push(&mut run, acceptance(1, false, 1)).unwrap();
    assert!(push(&mut run, change(RunState::Verifying, RunState::Completed)).is_err());
    push(&mut run, acceptance(2, true, 3)).unwrap();
    assert!(push(&mut run, change(RunState::Verifying, RunState::Completed)).is_err());
    push(&mut run, acceptance(3, true, 1)).unwrap();
    push(&mut run, change(RunState::Verifying, RunState::Completed)).unwrap();
    assert_eq!(run.state, RunState::Completed);
    assert!(
        push(
            &mut run,
            EventBody::Resumed {
                holder: "h".into(),
                lease: 3,
                checkpoint: None
            }
        )
        .is_err()
    );
}
