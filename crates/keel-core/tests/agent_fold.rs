//! The run projection for agent steps: steps grow as the driver decides, budgets for tokens, cost
//! and tool calls add up, loops are recognised, the prompt stays within its limit whatever the
//! history, and the tree a resumed step expects follows its recorded calls.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use keel_core::agent::{ModelReply, Reversibility, ToolCall, Usage};
use keel_core::budget::{BudgetLimits, BudgetName};
use keel_core::context::{Estimate, assemble};
use keel_core::contract::Contract;
use keel_core::event::{Decision, Event, EventBody, PhaseOutline, StepId};
use keel_core::fingerprint::Fingerprint;
use keel_core::run::{KEPT_AGENT_STEPS, KEPT_OBSERVATIONS, Next, Run};
use keel_core::state::RunState;
use keel_core::tools;

const CONTRACT: &str = r#"
[task]
goal = "hello.txt says hello"

[driver]
kind = "script"
script = "actions.jsonl"

[[verify]]
name = "hello"
tier = "acceptance"
run = "grep -q hello hello.txt"

[[phase]]
name = "write"
kind = "agent"
objective = "Create hello.txt."
"#;

fn tree(n: u32) -> String {
    format!("{n:040x}")
}

struct Log {
    run: Run,
}

impl Log {
    fn new() -> Log {
        let mut limits = BudgetLimits::default();
        limits.set(BudgetName::Tokens, 1000);
        let created = Event {
            run_id: "r".into(),
            seq: 1,
            at_ms: 0,
            body: EventBody::RunCreated {
                contract_hash: "c".into(),
                contract_file: "keel.toml".into(),
                workspace: "/w".into(),
                phases: vec![PhaseOutline {
                    name: "write".into(),
                    commands: vec![],
                    agent: true,
                    approval: false,
                }],
                acceptance: vec!["hello".into()],
                limits,
                base: Fingerprint {
                    tree: tree(0),
                    ..Fingerprint::default()
                },
                keel_version: "0".into(),
                driver: None,
                sandbox_off: false,
            },
        };
        let mut log = Log {
            run: Run::create(&created).unwrap(),
        };
        log.push(EventBody::CheckpointTaken {
            n: 0,
            hash: "h".into(),
            snapshot_ref: "r".into(),
            commit: "c".into(),
        });
        log.push(EventBody::StateChanged {
            from: RunState::Planned,
            to: RunState::Executing,
            reason: "go".into(),
            block: None,
        });
        log
    }

    fn push(&mut self, body: EventBody) {
        let e = Event {
            run_id: "r".into(),
            seq: self.run.seq + 1,
            at_ms: 0,
            body,
        };
        self.run.apply(&e).unwrap();
    }

    fn try_push(&mut self, body: EventBody) -> bool {
        let e = Event {
            run_id: "r".into(),
            seq: self.run.seq + 1,
            at_ms: 0,
            body,
        };
        self.run.apply(&e).is_ok()
    }

    /// One whole agent step with one allowed `write` call whose result text is `result`.
    fn step(&mut self, result: &str, signature: &str, tokens: u64) -> StepId {
        self.step_ended(result, signature, tokens, 1)
    }

    /// A step whose end is recorded `ends` times before its verification, as when keel stops
    /// between a step's end and its verification and the resumed process ends it again.
    fn step_ended(&mut self, result: &str, signature: &str, tokens: u64, ends: u32) -> StepId {
        let Next::Step(id) = self.run.next() else {
            panic!("expected a step, got {:?}", self.run.next())
        };
        self.push(EventBody::StepStarted {
            step: id,
            attempt: 1,
            command: "agent".into(),
            agent: true,
        });
        self.push(EventBody::ModelRequested {
            step: id,
            request: "req".into(),
            prompt_tokens: 10,
            context_tokens: 100,
        });
        self.push(EventBody::ModelReplied {
            step: id,
            response: "resp".into(),
            reply: ModelReply {
                text: None,
                calls: vec![ToolCall {
                    id: "1".into(),
                    name: "write".into(),
                    arguments: r#"{"path":"hello.txt","content":"x"}"#.into(),
                }],
                usage: Usage {
                    input_tokens: tokens,
                    output_tokens: 1,
                },
                stop_reason: None,
            },
            usage: Usage {
                input_tokens: tokens,
                output_tokens: 1,
            },
            cost_micro_usd: 5,
            retries: vec![],
            duration_ms: 1,
            post_tree: None,
        });
        self.push(EventBody::PolicyDecision {
            step: id,
            call: 0,
            tool: "write".into(),
            arguments: "{}".into(),
            decision: Decision::Allow,
            rule: "ok".into(),
            reversibility: Reversibility::Reversible,
            pre_tree: Some(tree(0)),
            error_fingerprint: None,
        });
        self.push(EventBody::ToolCallFinished {
            step: id,
            call: 0,
            ok: true,
            observation: result.into(),
            output: None,
            changed: vec!["hello.txt".into()],
            error_fingerprint: None,
            post_tree: Some(tree(1)),
        });
        for _ in 0..ends {
            self.push(EventBody::StepFinished {
                step: id,
                signature: Some(signature.into()),
                status: "decided".into(),
                success: true,
                duration_ms: 0,
                cpu_ms: 0,
                output: "o".into(),
                post: Fingerprint {
                    tree: tree(1),
                    ..Fingerprint::default()
                },
                files_written: 0,
                diff_files: 1,
                diff_lines: 1,
            });
        }
        self.push(EventBody::StepVerified { step: id });
        id
    }
}

#[test]
fn agent_steps_grow_and_account_tokens_cost_calls_and_writes() {
    let mut log = Log::new();
    let a = log.step("wrote", "s1", 100);
    let b = log.step("wrote again", "s2", 200);
    assert_eq!((a.index, b.index), (0, 1));
    let run = &log.run;
    assert_eq!(run.phases[0].steps.len(), 2);
    assert_eq!(run.used(BudgetName::Tokens), 302);
    assert_eq!(run.used(BudgetName::CostUsd), 10);
    assert_eq!(run.used(BudgetName::ToolCalls), 2);
    assert_eq!(run.used(BudgetName::Writes), 2);
    assert_eq!(run.used(BudgetName::Steps), 2);
    assert_eq!(run.model_calls, 2);
    assert_eq!(run.observations.last().unwrap().text, "wrote again");
    assert_eq!(run.fingerprint.tree, tree(1));
}

#[test]
fn a_step_may_not_skip_ahead_or_start_in_a_command_phase_way() {
    let mut log = Log::new();
    let skipped = StepId { phase: 0, index: 3 };
    assert!(!log.try_push(EventBody::StepStarted {
        step: skipped,
        attempt: 1,
        command: "agent".into(),
        agent: true,
    }));
    assert!(!log.try_push(EventBody::StepStarted {
        step: StepId { phase: 0, index: 0 },
        attempt: 1,
        command: "agent".into(),
        agent: false,
    }));
}

#[test]
fn a_tool_call_result_needs_an_allowing_decision_first() {
    let mut log = Log::new();
    let id = StepId { phase: 0, index: 0 };
    log.push(EventBody::StepStarted {
        step: id,
        attempt: 1,
        command: "agent".into(),
        agent: true,
    });
    // No reply recorded yet: no decision may be.
    assert!(!log.try_push(EventBody::PolicyDecision {
        step: id,
        call: 0,
        tool: "read".into(),
        arguments: "{}".into(),
        decision: Decision::Allow,
        rule: "ok".into(),
        reversibility: Reversibility::ReadOnly,
        pre_tree: None,
        error_fingerprint: None,
    }));
}

#[test]
fn the_same_signature_three_times_is_a_repeat_and_alternation_is_ping_pong() {
    let mut log = Log::new();
    log.step("r", "a", 1);
    log.step("r", "a", 1);
    assert_eq!(log.run.loop_detected(), None);
    log.step("r", "a", 1);
    assert_eq!(log.run.loop_detected(), Some("repeat"));

    let mut log = Log::new();
    for s in ["a", "b", "a", "b", "a"] {
        log.step("r", s, 1);
        assert_eq!(log.run.loop_detected(), None, "too early at {s}");
    }
    log.step("r", "b", 1);
    assert_eq!(log.run.loop_detected(), Some("ping_pong"));
}

/// Found by the seeded engine simulation: a step whose end was recorded again after crashes
/// between its end and its verification counted as the driver repeating itself, and the run
/// was blocked for a loop it never made. One step is one signature, however often its end is
/// recorded.
#[test]
fn a_steps_end_recorded_again_after_a_crash_is_not_a_repeat() {
    let mut log = Log::new();
    log.step("r", "a", 1);
    log.step_ended("r", "b", 1, 3);
    assert_eq!(log.run.loop_detected(), None, "{:?}", log.run.recent);
    assert_eq!(log.run.recent, ["a", "b"]);
    log.step("r", "b", 1);
    assert_eq!(log.run.loop_detected(), None);
    log.step("r", "b", 1);
    assert_eq!(log.run.loop_detected(), Some("repeat"));
}

#[test]
fn denials_are_violations_and_count_toward_same_error() {
    let mut log = Log::new();
    let id = StepId { phase: 0, index: 0 };
    log.push(EventBody::StepStarted {
        step: id,
        attempt: 1,
        command: "agent".into(),
        agent: true,
    });
    log.push(EventBody::ModelReplied {
        step: id,
        response: "r".into(),
        reply: ModelReply {
            text: None,
            calls: vec![],
            usage: Usage::default(),
            stop_reason: None,
        },
        usage: Usage::default(),
        cost_micro_usd: 0,
        retries: vec![],
        duration_ms: 0,
        post_tree: None,
    });
    for call in 0..2 {
        log.push(EventBody::PolicyDecision {
            step: id,
            call,
            tool: "write".into(),
            arguments: r#"{"path":"../x"}"#.into(),
            decision: Decision::Deny,
            rule: "escapes".into(),
            reversibility: Reversibility::Reversible,
            pre_tree: None,
            error_fingerprint: Some("fp".into()),
        });
    }
    assert_eq!(log.run.violations, 2);
    assert_eq!(log.run.used(BudgetName::SameError), 2);
    assert!(
        log.run
            .observations
            .iter()
            .any(|o| o.text == "DENIED: escapes")
    );
    // A reply without calls tells the driver so.
    assert!(log.run.observations[0].text.contains("no tool call"));
}

#[test]
fn observations_are_bounded() {
    let mut log = Log::new();
    for i in 0..40 {
        log.step(&format!("result {i}"), &format!("s{i}"), 1);
    }
    assert_eq!(log.run.observations.len(), KEPT_OBSERVATIONS);
    assert_eq!(log.run.observations.last().unwrap().text, "result 39");
}

#[test]
fn a_resumed_step_expects_the_tree_its_recorded_calls_left() {
    let mut log = Log::new();
    let id = StepId { phase: 0, index: 0 };
    log.push(EventBody::StepStarted {
        step: id,
        attempt: 1,
        command: "agent".into(),
        agent: true,
    });
    assert_eq!(log.run.expected_tree(), (tree(0), None));
    log.push(EventBody::ModelRequested {
        step: id,
        request: "q".into(),
        prompt_tokens: 1,
        context_tokens: 10,
    });
    // Asked but not answered: a delegated program may have been at work; back to the start.
    assert_eq!(log.run.expected_tree(), (tree(0), Some(tree(0))));
    log.push(EventBody::ModelReplied {
        step: id,
        response: "r".into(),
        reply: ModelReply {
            text: None,
            calls: vec![],
            usage: Usage::default(),
            stop_reason: None,
        },
        usage: Usage::default(),
        cost_micro_usd: 0,
        retries: vec![],
        duration_ms: 0,
        post_tree: None,
    });
    let allow = |call, pre: u32| EventBody::PolicyDecision {
        step: id,
        call,
        tool: "write".into(),
        arguments: "{}".into(),
        decision: Decision::Allow,
        rule: "ok".into(),
        reversibility: Reversibility::Reversible,
        pre_tree: Some(tree(pre)),
        error_fingerprint: None,
    };
    log.push(allow(0, 0));
    // Allowed, not finished: roll back to its own start.
    assert_eq!(log.run.expected_tree(), (tree(0), Some(tree(0))));
    log.push(EventBody::ToolCallFinished {
        step: id,
        call: 0,
        ok: true,
        observation: "wrote".into(),
        output: None,
        changed: vec!["a".into()],
        error_fingerprint: None,
        post_tree: Some(tree(7)),
    });
    assert_eq!(log.run.expected_tree(), (tree(7), None));
    log.push(allow(1, 7));
    assert_eq!(log.run.expected_tree(), (tree(7), Some(tree(7))));
}

#[test]
fn a_finish_claim_is_verified_next_and_a_failure_clears_it() {
    let mut log = Log::new();
    let id = StepId { phase: 0, index: 0 };
    log.push(EventBody::StepStarted {
        step: id,
        attempt: 1,
        command: "agent".into(),
        agent: true,
    });
    log.push(EventBody::FinishClaimed {
        step: id,
        summary: "done".into(),
    });
    log.push(EventBody::StepFinished {
        step: id,
        signature: Some("s".into()),
        status: "decided".into(),
        success: true,
        duration_ms: 0,
        cpu_ms: 0,
        output: "o".into(),
        post: Fingerprint::default(),
        files_written: 0,
        diff_files: 0,
        diff_lines: 0,
    });
    log.push(EventBody::StepVerified { step: id });
    assert_eq!(log.run.next(), Next::VerifyPhase(0));
    log.push(EventBody::VerificationFailed {
        phase: 0,
        verifier: "hello".into(),
        evidence: 1,
        error_fingerprint: "fp".into(),
    });
    assert_eq!(log.run.next(), Next::Step(StepId { phase: 0, index: 1 }));
    assert_eq!(log.run.used(BudgetName::SameError), 1);
}

#[test]
fn the_prompt_stays_within_its_limit_however_long_the_history() {
    let contract = Contract::parse("keel.toml", CONTRACT).unwrap();
    let specs: Vec<_> = tools::BUILTIN
        .iter()
        .filter_map(|t| tools::builtin(t).cloned())
        .collect();
    let mut log = Log::new();
    let mut sizes = Vec::new();
    for i in 0..120 {
        let long = format!("line {i}\n").repeat(200);
        log.step(&long, &format!("s{i}"), 1);
        log.push(EventBody::NoteAdded {
            step: StepId { phase: 0, index: i },
            text: "a fact worth keeping ".repeat(20),
        });
        let prompt = assemble(
            &contract,
            &log.run,
            0,
            "Create hello.txt.",
            &specs,
            &Estimate,
            6000,
        )
        .unwrap();
        assert!(prompt.tokens <= 6000, "step {i}: {} tokens", prompt.tokens);
        assert!(prompt.user.contains("Create hello.txt."));
        assert!(prompt.user.contains("hello.txt says hello"));
        sizes.push(prompt.tokens);
    }
    let early: u64 = sizes[10..30].iter().sum::<u64>() / 20;
    let late: u64 = sizes[100..120].iter().sum::<u64>() / 20;
    assert!(
        late <= early + early / 10,
        "the prompt grew from {early} to {late} tokens"
    );
}

#[test]
fn a_limit_too_small_for_the_essentials_is_an_error_that_says_so() {
    let contract = Contract::parse("keel.toml", CONTRACT).unwrap();
    let specs: Vec<_> = tools::BUILTIN
        .iter()
        .filter_map(|t| tools::builtin(t).cloned())
        .collect();
    let log = Log::new();
    let err = assemble(&contract, &log.run, 0, "o", &specs, &Estimate, 100).unwrap_err();
    assert!(err.to_string().contains("raise context_tokens"), "{err}");
}

#[test]
fn a_long_agent_phase_keeps_a_bounded_projection_and_counts_every_step() {
    let mut log = Log::new();
    log.run.limits.set(BudgetName::Tokens, 1_000_000);
    let mut sizes = Vec::new();
    for i in 0..300u32 {
        let id = log.step("wrote", &format!("s{i}"), 1);
        assert_eq!(id.index, i, "every step gets the next index");
        if i == 99 || i == 299 {
            sizes.push(serde_json::to_string(&log.run).unwrap().len());
        }
    }
    let phase = &log.run.phases[0];
    assert_eq!(phase.step_count(), 300);
    assert_eq!(phase.steps.len(), KEPT_AGENT_STEPS);
    assert_eq!(phase.earlier, 300 - KEPT_AGENT_STEPS as u32);
    assert_eq!(
        log.run.next(),
        Next::Step(StepId {
            phase: 0,
            index: 300
        })
    );
    // The steps held are the newest, each found by its index in the phase; older ones are not.
    assert!(
        log.run
            .step(StepId {
                phase: 0,
                index: 299
            })
            .is_some()
    );
    assert!(log.run.step(StepId { phase: 0, index: 0 }).is_none());
    let held: Vec<u32> = phase.held_steps().map(|(i, _)| i).collect();
    assert_eq!(held.first(), Some(&(300 - KEPT_AGENT_STEPS as u32)));
    assert_eq!(held.last(), Some(&299));
    assert_eq!(log.run.used(BudgetName::Steps), 300);
    // The projection does not grow with the steps.
    assert!(
        sizes[1] <= sizes[0] + 200,
        "projection at step 100: {} bytes, at step 300: {} bytes",
        sizes[0],
        sizes[1]
    );
    // An event about a step the projection let go is refused, not applied somewhere else.
    assert!(!log.try_push(EventBody::StepInvalidated {
        step: StepId { phase: 0, index: 3 },
        reason: "x".into(),
    }));
    // A fold from a serialized copy continues the same way.
    let copy: Run = serde_json::from_str(&serde_json::to_string(&log.run).unwrap()).unwrap();
    assert_eq!(copy, log.run);
}
