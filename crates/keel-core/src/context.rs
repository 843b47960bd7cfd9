//! Context assembly: each agent step's prompt is built afresh from the contract and the run's
//! state, never from a growing transcript, and it never exceeds the contract's `context_tokens`.
//!
//! The prompt is made of sections in a fixed order. When the whole does not fit, the least
//! important material goes first: older observations, then notes, then the plan's tail, then
//! evidence excerpts are shortened; the harness rules, the goal and the objective stay.

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

/// Everything a prompt is made of, already selected from the run.
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
        let mut out = String::new();
        out.push_str(&self.task);
        out.push_str(&self.phase);
        if !self.plan.is_empty() {
            out.push_str("\n## Plan\n");
            for (i, item) in self.plan.iter().enumerate() {
                out.push_str(&format!("{}. {item}\n", i + 1));
            }
        }
        out.push_str(&self.budgets);
        if !self.evidence.is_empty() {
            out.push_str("\n## Latest verification\n");
            for e in &self.evidence {
                out.push_str(e);
                out.push('\n');
            }
        }
        if !self.rejected.is_empty() {
            out.push_str("\n## Rejected paths (do not try these again)\n");
            for r in &self.rejected {
                out.push_str(&format!("- {r}\n"));
            }
        }
        if !self.notes.is_empty() {
            out.push_str("\n## Notes\n");
            for n in &self.notes {
                out.push_str(&format!("- {n}\n"));
            }
        }
        if !self.observations.is_empty() {
            out.push_str("\n## Recent observations (oldest first)\n");
            for o in &self.observations {
                out.push_str(o);
                out.push('\n');
            }
        }
        out.push_str("\nDecide the next action and make it with tool calls.\n");
        out
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
        if self.plan.len() > 3 {
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
    let mut sections = Sections {
        task,
        phase: phase_text,
        plan: run.plan.clone(),
        budgets,
        evidence,
        rejected: run.rejected_paths.clone(),
        notes: run.notes.clone(),
        observations,
    };
    let tools_json = serde_json::to_string(tools).unwrap_or_default();
    let fixed = counter.count(HARNESS_RULES) + counter.count(&tools_json);
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

    #[test]
    fn the_estimate_errs_on_the_safe_side() {
        let text = "fn main() { println!(\"hello\"); }".repeat(20);
        assert!(Estimate.count(&text) >= text.len() as u64 / 4);
    }
}
