//! The neutral vocabulary between keel and a decision-maker: what a tool looks like to a driver,
//! the prompt keel assembles, and the reply a driver gives. Provider formats (OpenAI, Anthropic)
//! are translated to and from these types at the edge (keel-llm).

use serde::{Deserialize, Serialize};

/// What undoing a tool's effect takes (DESIGN.md §9).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Reversibility {
    /// Changes nothing.
    ReadOnly,
    /// Changes only the workspace: undone by restoring a checkpoint.
    Reversible,
    /// Has a compensation that undoes it.
    Compensatable,
    /// Cannot be undone.
    Irreversible,
}

impl Reversibility {
    pub fn as_str(self) -> &'static str {
        match self {
            Reversibility::ReadOnly => "read_only",
            Reversibility::Reversible => "reversible",
            Reversibility::Compensatable => "compensatable",
            Reversibility::Irreversible => "irreversible",
        }
    }
}

impl std::fmt::Display for Reversibility {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A tool as a driver sees it: a name, what it does, and the JSON Schema of its arguments.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolSpec {
    pub name: String,
    pub description: String,
    /// A JSON Schema of an object: the tool's arguments.
    pub parameters: serde_json::Value,
    pub reversibility: Reversibility,
}

/// The prompt keel assembles afresh for each step: harness rules as the system part, the state
/// of the task as the user part. `tokens` is its size as counted for the driver's model.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Prompt {
    pub system: String,
    pub user: String,
    pub tokens: u64,
}

/// One tool call as the driver asked for it. `arguments` is the raw JSON text the model wrote:
/// keel parses and validates it, so malformed output is refused, not lost.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolCall {
    /// The provider's id for the call (echoed back by some APIs), or keel's own.
    pub id: String,
    pub name: String,
    pub arguments: String,
}

/// Tokens a model call used.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Usage {
    pub input_tokens: u64,
    pub output_tokens: u64,
}

/// A driver's answer: tool calls to make (possibly none) and any text it wrote besides.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelReply {
    pub text: Option<String>,
    pub calls: Vec<ToolCall>,
    pub usage: Usage,
    /// Why the model stopped (`tool_calls`, `stop`, `length`, `end_turn`, …), as reported.
    pub stop_reason: Option<String>,
}
