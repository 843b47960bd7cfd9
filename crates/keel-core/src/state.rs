//! The state machines of a run and of its steps, written as transition tables.
//!
//! The harness makes every transition; a driver never does. A transition that is not in the table
//! is a bug and fails loudly with [`TransitionError`].

use std::fmt;

use serde::{Deserialize, Serialize};

/// Where a run is. `completed` and `failed` are terminal; `blocked` ends activity until a person
/// acts (raises a budget, migrates after drift, fixes what a verifier found).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RunState {
    Planned,
    Executing,
    Verifying,
    AwaitingApproval,
    Waiting,
    Blocked,
    Completed,
    Failed,
}

impl RunState {
    pub const ALL: [RunState; 8] = [
        RunState::Planned,
        RunState::Executing,
        RunState::Verifying,
        RunState::AwaitingApproval,
        RunState::Waiting,
        RunState::Blocked,
        RunState::Completed,
        RunState::Failed,
    ];

    /// The run state transition table. Reads like the diagram in DESIGN.md §3.
    pub fn can_become(self, to: RunState) -> bool {
        use RunState::*;
        matches!(
            (self, to),
            (Planned, Executing | AwaitingApproval | Blocked | Failed)
                | (
                    Executing,
                    Verifying | AwaitingApproval | Waiting | Blocked | Failed
                )
                | (
                    Verifying,
                    Executing | Completed | AwaitingApproval | Blocked | Failed
                )
                | (AwaitingApproval, Executing | Verifying | Blocked | Failed)
                | (Waiting, Executing | Verifying | Blocked | Failed)
                | (Blocked, Executing | Verifying | Failed)
        )
    }

    pub fn is_terminal(self) -> bool {
        matches!(self, RunState::Completed | RunState::Failed)
    }

    /// A person has to act before the run goes on.
    pub fn needs_human(self) -> bool {
        matches!(
            self,
            RunState::AwaitingApproval | RunState::Waiting | RunState::Blocked
        )
    }

    pub fn as_str(self) -> &'static str {
        match self {
            RunState::Planned => "planned",
            RunState::Executing => "executing",
            RunState::Verifying => "verifying",
            RunState::AwaitingApproval => "awaiting_approval",
            RunState::Waiting => "waiting",
            RunState::Blocked => "blocked",
            RunState::Completed => "completed",
            RunState::Failed => "failed",
        }
    }
}

impl fmt::Display for RunState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Where a step is. A failed or invalidated step can be started again (a retry); a verified step
/// only leaves `verified` through a logged invalidation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StepState {
    NotStarted,
    InProgress,
    Verified,
    Failed,
    Invalidated,
}

impl StepState {
    pub const ALL: [StepState; 5] = [
        StepState::NotStarted,
        StepState::InProgress,
        StepState::Verified,
        StepState::Failed,
        StepState::Invalidated,
    ];

    /// The step state transition table.
    pub fn can_become(self, to: StepState) -> bool {
        use StepState::*;
        matches!(
            (self, to),
            (NotStarted | Failed | Invalidated, InProgress)
                | (InProgress, Verified | Failed)
                | (Verified, Invalidated)
        )
    }

    pub fn as_str(self) -> &'static str {
        match self {
            StepState::NotStarted => "not_started",
            StepState::InProgress => "in_progress",
            StepState::Verified => "verified",
            StepState::Failed => "failed",
            StepState::Invalidated => "invalidated",
        }
    }
}

impl fmt::Display for StepState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An attempted transition that the tables do not allow.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransitionError {
    #[error("illegal run transition {from} -> {to}")]
    Run { from: RunState, to: RunState },
    #[error("illegal transition of step {step}: {from} -> {to}")]
    Step {
        step: String,
        from: StepState,
        to: StepState,
    },
    #[error("the run is frozen: nothing may change it until it is unfrozen")]
    Frozen,
}

pub fn check_run(from: RunState, to: RunState) -> Result<(), TransitionError> {
    if from.can_become(to) {
        Ok(())
    } else {
        Err(TransitionError::Run { from, to })
    }
}

pub fn check_step(step: &str, from: StepState, to: StepState) -> Result<(), TransitionError> {
    if from.can_become(to) {
        Ok(())
    } else {
        Err(TransitionError::Step {
            step: step.to_string(),
            from,
            to,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn terminal_states_have_no_way_out() {
        for from in [RunState::Completed, RunState::Failed] {
            for to in RunState::ALL {
                assert!(!from.can_become(to), "{from} -> {to} must be illegal");
            }
        }
    }

    #[test]
    fn completed_is_reached_only_from_verifying() {
        for from in RunState::ALL {
            assert_eq!(
                from.can_become(RunState::Completed),
                from == RunState::Verifying,
                "{from} -> completed"
            );
        }
    }

    #[test]
    fn a_verified_step_leaves_only_by_invalidation() {
        for to in StepState::ALL {
            assert_eq!(
                StepState::Verified.can_become(to),
                to == StepState::Invalidated,
                "verified -> {to}"
            );
        }
    }

    #[test]
    fn no_state_becomes_itself() {
        for s in RunState::ALL {
            assert!(!s.can_become(s));
        }
        for s in StepState::ALL {
            assert!(!s.can_become(s));
        }
    }
}
