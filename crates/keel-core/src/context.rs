//! Context assembly: each agent step's prompt is built afresh from the contract and the run's
//! state, never from a growing transcript, and it never exceeds the contract's `context_tokens`.
//!
//! The prompt is made of sections in a fixed order. When the whole does not fit, the least
//! important material goes first: older observations, then notes, then the plan's tail, then
//! evidence excerpts are shortened; the harness rules, the goal and the objective stay.

use std::fmt::Write as _;

use crate::agent::{Prompt, ToolSpec};
use crate::budget::BudgetName;
use crate::contract::Contract;
use crate::run::{Run, cut};

/// Counts tokens the way the driver's model does (or estimates them with a margin).
pub trait TokenCount {
    fn count(&self, text: &str) -> u64;
}

/// An estimate for models whose tokenizer keel does not have: one token per three bytes, plus
/// ten percent. English and code run at about four bytes per token, so this errs on the safe side.
pub struct Estimate;

impl TokenCount for Estimate {
    fn count(&self, text: &str) -> u64 {
        let bytes = text.len() as u64;
        bytes.div_ceil(3) + bytes.div_ceil(30)
    }
}

/// The rules every driver is given.
pub const HARNESS_RULES: &str = "\
You are the decision-maker of one step of a long-running task run by keel, a harness that owns \
the task's state, budgets and verification. You act only through the tools you are given; every \
call is checked against the contract's scope before it runs, and refused calls are shown to you.
Rules:
- Work toward the phase objective in small, verifiable steps. You see the task's state afresh \
each step: the plan, notes, recent observations and the last verification results. Keep the plan \
and notes current with the plan and note tools; nothing else is remembered.
- Stay inside the scope: write only writable paths, never forbidden ones, run only allowed commands.
- When the objective is met, call finish. keel then runs the verifiers; only passing evidence \
ends the phase. Claiming success without it achieves nothing.
- Do not repeat an approach listed under rejected paths, and do not repeat a failing action \
unchanged: the run stops when it goes round in circles.
- If the task cannot go on without a person (contradictory requirements, missing access, real \
ambiguity), call blocked with the category and the reason.";

/// Where the failing part of a long output is: the lines that say what went wrong, with a
/// little context, and the tail. At most `max_lines` lines.
pub fn compact_failure(output: &str, max_lines: usize) -> String {
    let lines: Vec<&str> = output.lines().collect();
    if lines.len() <= max_lines {
        return output.trim_end().to_string();
    }
    let is_signal = |l: &str| {
        let lower = l.to_ascii_lowercase();
        [
            "error",
            "fail",
            "panic",
            "assert",
            "expected",
            "exception",
            "traceback",
            "fatal",
        ]
        .iter()
        .any(|w| lower.contains(w))
    };
    let mut keep = vec![false; lines.len()];
    let tail = max_lines / 3;
    for k in keep.iter_mut().skip(lines.len() - tail) {
        *k = true;
    }
    let mut budget = max_lines - tail;
    for (i, line) in lines.iter().enumerate() {
        if budget == 0 {
            break;
        }
        if is_signal(line) && !keep[i] {
            let end = (i + 3).min(lines.len());
            for k in keep[i..end].iter_mut() {
                if !*k && budget > 0 {
                    *k = true;
                    budget -= 1;
                }
            }
        }
    }
    let mut out = Vec::new();
    let mut skipped = 0;
    for (i, line) in lines.iter().enumerate() {
        if keep[i] {
            if skipped > 0 {
                out.push(format!("[… {skipped} lines]"));
                skipped = 0;
            }
            out.push((*line).to_string());
        } else {
            skipped += 1;
        }
    }
    if skipped > 0 {
        out.push(format!("[… {skipped} lines]"));
    }
    out.join("\n")
}

/// The headers and the closing line of a prompt's user text.
const PLAN: &str = "\n## Plan\n";
const EVIDENCE: &str = "\n## Latest verification\n";
const REJECTED: &str = "\n## Rejected paths (do not try these again)\n";
const NOTES: &str = "\n## Notes\n";
const OBSERVATIONS: &str = "\n## Recent observations (oldest first)\n";
const CLOSING: &str = "\nDecide the next action and make it with tool calls.\n";

/// Everything a prompt is made of, already selected from the run.
#[derive(Clone)]
struct Sections {
    task: String,
    phase: String,
    plan: Vec<String>,
    budgets: String,
    evidence: Vec<String>,
    rejected: Vec<String>,
    notes: Vec<String>,
    observations: Vec<String>,
}

impl Sections {
    fn render(&self) -> String {
        // One allocation of the exact size, and no formatting machinery: a prompt is rendered
        // a few times a step (see `fit`).
        let mut out = String::with_capacity(self.rendered_len());
        let listed = |out: &mut String, header: &str, items: &[String], bullet: &str| {
            if !items.is_empty() {
                out.push_str(header);
                for item in items {
                    out.push_str(bullet);
                    out.push_str(item);
                    out.push('\n');
                }
            }
        };
        out.push_str(&self.task);
        out.push_str(&self.phase);
        if !self.plan.is_empty() {
            out.push_str(PLAN);
            for (i, item) in self.plan.iter().enumerate() {
                // Writing into a String cannot fail.
                let _ = write!(out, "{}. ", i + 1);
                out.push_str(item);
                out.push('\n');
            }
        }
        out.push_str(&self.budgets);
        listed(&mut out, EVIDENCE, &self.evidence, "");
        listed(&mut out, REJECTED, &self.rejected, "- ");
        listed(&mut out, NOTES, &self.notes, "- ");
        listed(&mut out, OBSERVATIONS, &self.observations, "");
        out.push_str(CLOSING);
        out
    }

    /// `render().len()`, without rendering.
    fn rendered_len(&self) -> usize {
        let listed = |header: &str, items: &[String], around: usize| {
            if items.is_empty() {
                0
            } else {
                header.len() + items.iter().map(|i| i.len() + around).sum::<usize>()
            }
        };
        let plan = if self.plan.is_empty() {
            0
        } else {
            PLAN.len()
                + self
                    .plan
                    .iter()
                    .enumerate()
                    .map(|(i, item)| (i + 1).to_string().len() + 2 + item.len() + 1)
                    .sum::<usize>()
        };
        self.task.len()
            + self.phase.len()
            + plan
            + self.budgets.len()
            + listed(EVIDENCE, &self.evidence, 1)
            + listed(REJECTED, &self.rejected, 3)
            + listed(NOTES, &self.notes, 3)
            + listed(OBSERVATIONS, &self.observations, 1)
            + CLOSING.len()
    }

    /// Drops or shortens the least important material; false when nothing is left to drop.
    fn shrink(&mut self) -> bool {
        if self.observations.len() > 1 {
            self.observations.remove(0);
            return true;
        }
        if !self.notes.is_empty() {
            self.notes.remove(0);
            return true;
        }
        // Three items and a mark that the rest were cut: cut once (the mark makes four, which
        // must not count as a plan to cut again).
        if self.plan.len() > 4 {
            self.plan.truncate(3);
            self.plan.push("…".into());
            return true;
        }
        if let Some(e) = self.evidence.iter_mut().find(|e| e.len() > 400) {
            *e = cut(e, e.len() / 2);
            return true;
        }
        if let Some(o) = self.observations.first_mut().filter(|o| o.len() > 200) {
            *o = cut(o, o.len() / 2);
            return true;
        }
        if self.rejected.len() > 1 {
            self.rejected.remove(0);
            return true;
        }
        false
    }
}

/// Why no prompt could be assembled.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "context_tokens = {limit} is too small: the harness rules, the goal, the objective and the tool schemas alone take {needed} tokens; raise context_tokens in [driver]"
)]
pub struct ContextTooSmall {
    pub limit: u64,
    pub needed: u64,
}

/// Assembles the prompt of the next step of agent phase `phase` (an index into the contract).
/// `tools` are the tools offered (their schemas count toward the limit).
pub fn assemble(
    contract: &Contract,
    run: &Run,
    phase: usize,
    objective: &str,
    tools: &[ToolSpec],
    counter: &dyn TokenCount,
    limit: u64,
) -> Result<Prompt, ContextTooSmall> {
    let fixed = fixed_tokens(tools, counter);
    assemble_within(contract, run, phase, objective, fixed, counter, limit)
}

/// The tokens every prompt of a phase with `tools` carries whatever the run's state: the
/// harness rules and the tools' specifications as the driver is given them.
pub fn fixed_tokens(tools: &[ToolSpec], counter: &dyn TokenCount) -> u64 {
    let tools_json = serde_json::to_string(tools).unwrap_or_default();
    counter.count(HARNESS_RULES) + counter.count(&tools_json)
}

/// [`assemble`] with the phase's [`fixed_tokens`] counted beforehand (they are the same at
/// every step of the phase).
pub fn assemble_within(
    contract: &Contract,
    run: &Run,
    phase: usize,
    objective: &str,
    fixed: u64,
    counter: &dyn TokenCount,
    limit: u64,
) -> Result<Prompt, ContextTooSmall> {
    let phase_name = contract.phases.get(phase).map_or("", |p| p.name.as_str());
    let mut task = format!("## Task\nGoal: {}\n", contract.task.goal);
    if !contract.task.out_of_scope.is_empty() {
        task.push_str("Out of scope (do not change):\n");
        for item in &contract.task.out_of_scope {
            task.push_str(&format!("- {item}\n"));
        }
    }
    let scope = &contract.scope;
    let list = |v: &[String], all: &str| {
        if v.is_empty() {
            all.to_string()
        } else {
            v.join(", ")
        }
    };
    task.push_str(&format!(
        "Scope: writable {}; forbidden {}; commands {}.\n",
        list(&scope.writable, "everything"),
        list(&scope.forbidden, "nothing"),
        list(&scope.commands, "any"),
    ));
    // The step being decided is already started (and counted) when its prompt is assembled.
    let step_no = run
        .phases
        .get(phase)
        .map_or(0, |p| p.step_count().max(1) as u64);
    let phase_text = format!(
        "\n## Phase {}/{}: {phase_name} (step {step_no})\nObjective: {objective}\n",
        phase + 1,
        contract.phases.len()
    );
    let mut budgets = String::from("\n## Budgets left\n");
    for b in BudgetName::ALL {
        if let Some(limit) = run.limits.get(b)
            && b != BudgetName::ParallelWorkers
        {
            let used = run.used(b);
            budgets.push_str(&format!(
                "{b}: {} of {} left\n",
                b.format_amount(limit.saturating_sub(used)),
                b.format_amount(limit)
            ));
        }
    }
    let evidence = run
        .evidence
        .values()
        .map(|e| {
            let mut line = format!(
                "- {} ({}): {} — {}",
                e.verifier,
                e.tier,
                if e.passed { "passed" } else { "FAILED" },
                e.status
            );
            if let (false, Some(excerpt)) = (e.passed, &e.excerpt) {
                line.push_str(&format!("\n```\n{excerpt}\n```"));
            }
            line
        })
        .collect();
    let observations = run
        .observations
        .iter()
        .map(|o| {
            format!(
                "[step {}] {}({}) → {}{}",
                o.step,
                o.tool,
                o.arguments,
                if o.ok { "" } else { "FAILED: " },
                o.text
            )
        })
        .collect();
    let sections = Sections {
        task,
        phase: phase_text,
        plan: run.plan.clone(),
        budgets,
        evidence,
        rejected: run.rejected_paths.clone(),
        notes: run.notes.clone(),
        observations,
    };
    fit(sections, fixed, counter, limit)
}

/// The fullest prompt of `sections` within `limit`: what shrinking one piece at a time and
/// counting after each would find (dropping least important material first), with far fewer
/// counts. Each cut is one more call of [`Sections::shrink`]; a prompt's tokens fall as cuts
/// are made, so the fewest cuts that fit are found by search: a first guess from the text's
/// length (tokens run in proportion to it), then outwards in doubling strides until a cut that
/// fits and one that does not bracket the answer, then halving between them. Every count is
/// exact, and the prompt returned was counted as it is.
fn fit(
    sections: Sections,
    fixed: u64,
    counter: &dyn TokenCount,
    limit: u64,
) -> Result<Prompt, ContextTooSmall> {
    let first = sections.render();
    let tokens = fixed + counter.count(&first);
    if tokens <= limit {
        return Ok(Prompt {
            system: HARNESS_RULES.to_string(),
            user: first,
            tokens,
        });
    }
    // The length of the text after each number of cuts (cuts and lengths are cheap; renders
    // and counts are not).
    let mut lengths = vec![first.len()];
    let mut walk = sections.clone();
    while walk.shrink() {
        lengths.push(walk.rendered_len());
    }
    let last = lengths.len() - 1;
    let mut counted: Vec<Option<(u64, String)>> = vec![None; lengths.len()];
    counted[0] = Some((tokens, first));
    let mut count = |k: usize| -> u64 {
        counted[k]
            .get_or_insert_with(|| {
                let mut state = sections.clone();
                for _ in 0..k {
                    state.shrink();
                }
                let text = state.render();
                (fixed + counter.count(&text), text)
            })
            .0
    };
    // The guess: the first state whose length, at the first state's tokens per byte, fits.
    let per_byte = tokens.saturating_sub(fixed) as f64 / lengths[0].max(1) as f64;
    let room = limit.saturating_sub(fixed) as f64;
    let guess = (1..=last)
        .find(|&k| lengths[k] as f64 * per_byte <= room)
        .unwrap_or(last);
    // Whether anything fits, when the guess does not: the state with everything cut that can
    // be (cuts only shorten the text, so if the guess fits, so does that state).
    if count(guess) > limit {
        let needed = count(last);
        if needed > limit {
            return Err(ContextTooSmall { limit, needed });
        }
    }
    // `over` does not fit (state 0 does not), `within` does (the last does); the answer is in
    // (over, within].
    let (mut over, mut within) = if count(guess) <= limit {
        let mut within = guess;
        let mut stride = 1;
        loop {
            let k = within.saturating_sub(stride);
            if count(k) > limit {
                break (k, within);
            }
            within = k;
            stride *= 2;
        }
    } else {
        let mut over = guess;
        let mut stride = 1;
        loop {
            let k = (over + stride).min(last);
            if count(k) <= limit {
                break (over, k);
            }
            over = k;
            stride *= 2;
        }
    };
    while within - over > 1 {
        let middle = over + (within - over) / 2;
        if count(middle) <= limit {
            within = middle;
        } else {
            over = middle;
        }
    }
    count(within);
    let (tokens, user) = counted.swap_remove(within).unwrap_or_default();
    Ok(Prompt {
        system: HARNESS_RULES.to_string(),
        user,
        tokens,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_failure_keeps_its_error_lines_and_tail() {
        let mut text: Vec<String> = (0..500).map(|i| format!("compiling crate {i}")).collect();
        text[200] = "error[E0308]: mismatched types".into();
        text[201] = "  --> src/lib.rs:3:5".into();
        text.push("test result: FAILED. 1 passed; 1 failed".into());
        let compact = compact_failure(&text.join("\n"), 20);
        assert!(compact.lines().count() <= 24, "{compact}");
        assert!(compact.contains("error[E0308]: mismatched types"));
        assert!(compact.contains("src/lib.rs:3:5"));
        assert!(compact.ends_with("test result: FAILED. 1 passed; 1 failed"));
        assert!(compact.contains("[… "));
    }

    #[test]
    fn short_output_is_kept_whole() {
        assert_eq!(compact_failure("a\nb\n", 10), "a\nb");
    }

    /// The search as it was: one cut at a time, counting after each.
    fn fit_one_cut_at_a_time(
        mut sections: Sections,
        fixed: u64,
        counter: &dyn TokenCount,
        limit: u64,
    ) -> Result<Prompt, ContextTooSmall> {
        loop {
            let user = sections.render();
            let tokens = fixed + counter.count(&user);
            if tokens <= limit {
                return Ok(Prompt {
                    system: HARNESS_RULES.to_string(),
                    user,
                    tokens,
                });
            }
            if !sections.shrink() {
                return Err(ContextTooSmall {
                    limit,
                    needed: tokens,
                });
            }
        }
    }

    /// Counts words and counts the calls.
    struct Words(std::cell::Cell<u64>);

    impl TokenCount for Words {
        fn count(&self, text: &str) -> u64 {
            self.0.set(self.0.get() + 1);
            text.split_whitespace().count() as u64
        }
    }

    fn items(lengths: &[usize], word: &str) -> Vec<String> {
        lengths
            .iter()
            .enumerate()
            .map(|(i, n)| format!("{word}{i} {}", "w ".repeat(*n)))
            .collect()
    }

    proptest::proptest! {
        #[test]
        fn the_search_finds_what_one_cut_at_a_time_finds_with_fewer_counts(
            observations in proptest::collection::vec(0usize..60, 0..40),
            notes in proptest::collection::vec(0usize..40, 0..20),
            plan in proptest::collection::vec(0usize..10, 0..12),
            evidence in proptest::collection::vec(0usize..300, 0..3),
            rejected in proptest::collection::vec(0usize..20, 0..4),
            fixed in 0u64..50,
            limit in 0u64..2500,
        ) {
            let sections = Sections {
                task: "## Task\nGoal: g\n".into(),
                phase: "\n## Phase 1/1: p (step 3)\nObjective: o\n".into(),
                plan: items(&plan, "plan"),
                budgets: "\n## Budgets left\nsteps: 3 of 9 left\n".into(),
                evidence: items(&evidence, "evidence"),
                rejected: items(&rejected, "rejected"),
                notes: items(&notes, "note"),
                observations: items(&observations, "observation"),
            };
            proptest::prop_assert_eq!(sections.rendered_len(), sections.render().len());
            let states = {
                let mut walk = sections.clone();
                let mut n = 1usize;
                while walk.shrink() {
                    n += 1;
                }
                n
            };
            let (searched, linear) = (Words(0.into()), Words(0.into()));
            let found = fit(sections.clone(), fixed, &searched, limit);
            let wanted = fit_one_cut_at_a_time(sections, fixed, &linear, limit);
            proptest::prop_assert_eq!(&found, &wanted);
            if let Ok(prompt) = &found {
                proptest::prop_assert!(prompt.tokens <= limit);
            }
            // The first state, the last, and strides out and halvings back: a few counts per
            // doubling of the number of states, however many cuts the answer is.
            let doublings = u64::from(usize::BITS - states.leading_zeros());
            proptest::prop_assert!(
                searched.0.get() <= 3 + 2 * doublings,
                "{} counts for {} states", searched.0.get(), states
            );
        }
    }

    /// Found by the property test below: a plan was cut to three items and a mark, which made
    /// four, which was cut again, for ever; so a prompt that could not fit with a plan of more
    /// than three items never returned.
    #[test]
    fn a_prompt_that_cannot_fit_with_a_long_plan_is_refused_not_cut_for_ever() {
        let sections = Sections {
            task: "## Task\nGoal: g\n".into(),
            phase: String::new(),
            plan: items(&[3; 10], "plan"),
            budgets: String::new(),
            evidence: Vec::new(),
            rejected: Vec::new(),
            notes: Vec::new(),
            observations: Vec::new(),
        };
        let err = fit_one_cut_at_a_time(sections.clone(), 0, &Words(0.into()), 2).unwrap_err();
        assert_eq!(err.limit, 2);
        assert_eq!(fit(sections, 0, &Words(0.into()), 2), Err(err));
    }

    #[test]
    fn a_prompt_far_over_the_limit_takes_a_few_counts_not_one_per_cut() {
        let sections = Sections {
            task: "## Task\nGoal: g\n".into(),
            phase: String::new(),
            plan: Vec::new(),
            budgets: String::new(),
            evidence: Vec::new(),
            rejected: Vec::new(),
            notes: items(&[30; 40], "note"),
            observations: items(&[30; 60], "observation"),
        };
        let (searched, linear) = (Words(0.into()), Words(0.into()));
        let found = fit(sections.clone(), 10, &searched, 400);
        assert_eq!(found, fit_one_cut_at_a_time(sections, 10, &linear, 400));
        assert!(linear.0.get() > 80, "{}", linear.0.get());
        assert!(searched.0.get() <= 8, "{} counts", searched.0.get());
    }

    #[test]
    fn the_estimate_errs_on_the_safe_side() {
        let text = "fn main() { println!(\"hello\"); }".repeat(20);
        assert!(Estimate.count(&text) >= text.len() as u64 / 4);
    }
}
