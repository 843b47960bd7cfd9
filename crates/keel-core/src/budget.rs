//! Budgets: every limit of the contract's `[budget]` table and what a run has used of it.
//!
//! All amounts are whole numbers in the budget's own unit (see [`Unit`]): durations in
//! milliseconds, money in micro-dollars, everything else a count. That keeps arithmetic exact and
//! lets one code path check, raise and print every budget.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// The name of a budget, as written in the contract's `[budget]` table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BudgetName {
    Tokens,
    CostUsd,
    WallTime,
    ComputeTime,
    Steps,
    ToolCalls,
    SameError,
    NoProgressSteps,
    Writes,
    NetworkRequests,
    ParallelWorkers,
    DiffLines,
    FilesChanged,
    Approvals,
}

/// The unit a budget's amounts are kept in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    Count,
    Millis,
    MicroUsd,
}

impl BudgetName {
    pub const ALL: [BudgetName; 14] = [
        BudgetName::Tokens,
        BudgetName::CostUsd,
        BudgetName::WallTime,
        BudgetName::ComputeTime,
        BudgetName::Steps,
        BudgetName::ToolCalls,
        BudgetName::SameError,
        BudgetName::NoProgressSteps,
        BudgetName::Writes,
        BudgetName::NetworkRequests,
        BudgetName::ParallelWorkers,
        BudgetName::DiffLines,
        BudgetName::FilesChanged,
        BudgetName::Approvals,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            BudgetName::Tokens => "tokens",
            BudgetName::CostUsd => "cost_usd",
            BudgetName::WallTime => "wall_time",
            BudgetName::ComputeTime => "compute_time",
            BudgetName::Steps => "steps",
            BudgetName::ToolCalls => "tool_calls",
            BudgetName::SameError => "same_error",
            BudgetName::NoProgressSteps => "no_progress_steps",
            BudgetName::Writes => "writes",
            BudgetName::NetworkRequests => "network_requests",
            BudgetName::ParallelWorkers => "parallel_workers",
            BudgetName::DiffLines => "diff_lines",
            BudgetName::FilesChanged => "files_changed",
            BudgetName::Approvals => "approvals",
        }
    }

    pub fn unit(self) -> Unit {
        match self {
            BudgetName::WallTime | BudgetName::ComputeTime => Unit::Millis,
            BudgetName::CostUsd => Unit::MicroUsd,
            _ => Unit::Count,
        }
    }

    /// Whether this version of keel enforces the budget. The others are parsed, kept in the run
    /// state and shown, and are enforced once the capability that consumes them exists
    /// (networks, workers, approvals).
    pub fn enforced(self) -> bool {
        matches!(
            self,
            BudgetName::WallTime
                | BudgetName::ComputeTime
                | BudgetName::Steps
                | BudgetName::ToolCalls
                | BudgetName::SameError
                | BudgetName::Writes
                | BudgetName::DiffLines
                | BudgetName::FilesChanged
                | BudgetName::Tokens
                | BudgetName::CostUsd
                | BudgetName::NoProgressSteps
                | BudgetName::NetworkRequests
                | BudgetName::Approvals
        )
    }

    /// Formats an amount of this budget for a person: `1h 2m`, `$0.25`, `12`.
    pub fn format_amount(self, amount: u64) -> String {
        match self.unit() {
            Unit::Count => amount.to_string(),
            Unit::Millis => format_millis(amount),
            Unit::MicroUsd => format!("${:.2}", amount as f64 / 1_000_000.0),
        }
    }

    /// Parses an amount written in this budget's unit for a person: a count, a duration
    /// (`90s`, `2h`), or dollars (`1.5`).
    pub fn parse_amount(self, text: &str) -> Result<u64, String> {
        let text = text.trim();
        match self.unit() {
            Unit::Count => text
                .parse::<u64>()
                .map_err(|_| format!("`{text}` is not a whole number")),
            Unit::Millis => humantime::parse_duration(text)
                .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
                .map_err(|e| format!("`{text}` is not a duration like `90s` or `2h`: {e}")),
            Unit::MicroUsd => {
                let dollars = text
                    .trim_start_matches('$')
                    .parse::<f64>()
                    .map_err(|_| format!("`{text}` is not an amount of dollars like `2.5`"))?;
                if !dollars.is_finite() || dollars < 0.0 {
                    return Err(format!("`{text}` is not a positive amount of dollars"));
                }
                Ok((dollars * 1_000_000.0).round() as u64)
            }
        }
    }
}

fn format_millis(ms: u64) -> String {
    if ms < 1000 {
        return format!("{ms}ms");
    }
    let secs = ms / 1000;
    let (h, m, s) = (secs / 3600, (secs / 60) % 60, secs % 60);
    match (h, m, s) {
        // Under a minute the milliseconds show, so an overrun is never rounded away.
        (0, 0, s) if !ms.is_multiple_of(1000) => format!("{s}.{:03}s", ms % 1000),
        (0, 0, s) => format!("{s}s"),
        (0, m, 0) => format!("{m}m"),
        (0, m, s) => format!("{m}m {s}s"),
        (h, 0, 0) => format!("{h}h"),
        (h, m, _) => format!("{h}h {m}m"),
    }
}

impl fmt::Display for BudgetName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for BudgetName {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        BudgetName::ALL
            .into_iter()
            .find(|b| b.as_str() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = BudgetName::ALL.iter().map(|b| b.as_str()).collect();
                format!("`{s}` is not a budget; budgets are: {}", names.join(", "))
            })
    }
}

/// The limits of a run. A budget that is absent is unlimited.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BudgetLimits(pub BTreeMap<BudgetName, u64>);

impl BudgetLimits {
    pub fn get(&self, name: BudgetName) -> Option<u64> {
        self.0.get(&name).copied()
    }
    pub fn set(&mut self, name: BudgetName, limit: u64) {
        self.0.insert(name, limit);
    }
}

/// Parses a budget raise as written on the command line: `steps=+5`, `wall_time=+30m`,
/// `cost_usd=+1.50`. Only raises exist: nothing lowers or silently resets a budget.
pub fn parse_raise(spec: &str) -> Result<(BudgetName, u64), String> {
    let Some((name, amount)) = spec.split_once('=') else {
        return Err(format!(
            "`{spec}` is not a budget raise; write NAME=+AMOUNT, for example steps=+10 or wall_time=+30m"
        ));
    };
    let name: BudgetName = name.trim().parse()?;
    let Some(amount) = amount.trim().strip_prefix('+') else {
        return Err(format!(
            "`{spec}`: a raise starts with `+` (for example {name}=+{}); budgets only go up",
            if name.unit() == Unit::Millis {
                "30m"
            } else {
                "10"
            }
        ));
    };
    let by = name.parse_amount(amount)?;
    if by == 0 {
        return Err(format!(
            "`{spec}` raises by nothing; give an amount above zero"
        ));
    }
    Ok((name, by))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raises_parse_in_each_unit() {
        assert_eq!(parse_raise("steps=+5"), Ok((BudgetName::Steps, 5)));
        assert_eq!(
            parse_raise("wall_time=+2m"),
            Ok((BudgetName::WallTime, 120_000))
        );
        assert_eq!(
            parse_raise("cost_usd=+1.5"),
            Ok((BudgetName::CostUsd, 1_500_000))
        );
    }

    #[test]
    fn bad_raises_say_what_to_write() {
        assert!(parse_raise("steps").unwrap_err().contains("NAME=+AMOUNT"));
        assert!(
            parse_raise("steps=5")
                .unwrap_err()
                .contains("starts with `+`")
        );
        assert!(
            parse_raise("steps=-5")
                .unwrap_err()
                .contains("starts with `+`")
        );
        assert!(
            parse_raise("stepz=+5")
                .unwrap_err()
                .contains("budgets are:")
        );
        assert!(parse_raise("steps=+0").unwrap_err().contains("above zero"));
        assert!(
            parse_raise("wall_time=+soon")
                .unwrap_err()
                .contains("duration")
        );
    }

    #[test]
    fn amounts_print_for_people() {
        assert_eq!(BudgetName::WallTime.format_amount(90_000), "1m 30s");
        assert_eq!(BudgetName::WallTime.format_amount(1_034), "1.034s");
        assert_eq!(BudgetName::WallTime.format_amount(1_000), "1s");
        assert_eq!(BudgetName::WallTime.format_amount(3_600_000), "1h");
        assert_eq!(BudgetName::CostUsd.format_amount(2_500_000), "$2.50");
        assert_eq!(BudgetName::Steps.format_amount(7), "7");
    }
}
