//! Drivers: the decision-makers behind agent phases. keel records a driver's request before it
//! is sent and its response after, so a resumed step re-sends the recorded request rather than
//! asking a different question, and never asks again once the answer is recorded.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use keel_core::agent::{ModelReply, Prompt, ToolCall, ToolSpec, Usage};
use keel_core::context::{Estimate, TokenCount};
use serde::Deserialize;

/// What came back from one call of a driver.
#[derive(Debug, Clone)]
pub struct Exchange {
    pub response: Vec<u8>,
    /// One line per retry: why it was needed.
    pub retries: Vec<String>,
    pub duration_ms: u64,
}

/// Why a driver could not answer. The run stops `blocked` with the message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct DriverError(pub String);

/// Where a driver runs: the workspace, a place for temporary files, the run and step.
pub struct SendContext<'a> {
    /// How the run's commands are confined; a delegated program runs under it (with the
    /// network, to reach its model).
    pub confinement: &'a crate::process::Confinement,
    pub workspace: &'a Path,
    pub tmp: &'a Path,
    pub run_id: &'a str,
    pub step: String,
    /// 1-based number of this model call in the run.
    pub call_no: u64,
}

pub trait Driver {
    /// The exact bytes recorded as this step's request.
    fn request(&self, prompt: &Prompt, tools: &[ToolSpec]) -> Vec<u8>;
    /// Sends a recorded request.
    fn send(&mut self, request: &[u8], ctx: &SendContext<'_>) -> Result<Exchange, DriverError>;
    /// Reads a response; a malformed one is an error the driver is told about.
    fn parse(&self, response: &[u8]) -> Result<ModelReply, String>;
    /// What a reply's usage cost, in micro-dollars.
    fn cost(&self, usage: Usage) -> u64;
    /// Counts prompt tokens the way this driver's model does.
    fn counter(&self) -> &dyn TokenCount;
    /// A delegated program changes the workspace itself during `send`.
    fn edits_workspace(&self) -> bool {
        false
    }
    /// `send` stays inside keel's process: it reaches no program, service or person, costs
    /// nothing and can be repeated exactly, so the request need not be stored before it.
    fn local(&self) -> bool {
        false
    }
}

/// The prompt and tools as JSON: the request of drivers that have no wire format of their own.
fn prompt_json(prompt: &Prompt, tools: &[ToolSpec]) -> Vec<u8> {
    #[derive(serde::Serialize)]
    struct Request<'a> {
        system: &'a str,
        user: &'a str,
        tokens: u64,
        tools: Vec<&'a str>,
    }
    // Room for the prompt's text, its escapes and the JSON around it, so that the bytes are not
    // copied again as they grow.
    let text = prompt.system.len() + prompt.user.len();
    let mut out = Vec::with_capacity(text + text / 8 + 256);
    serde_json::to_writer(
        &mut out,
        &Request {
            system: &prompt.system,
            user: &prompt.user,
            tokens: prompt.tokens,
            tools: tools.iter().map(|t| t.name.as_str()).collect(),
        },
    )
    .map_or_else(|_| Vec::new(), |()| out)
}

/// One action of a script: tool calls, optional text, optional usage.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ScriptAction {
    #[serde(default)]
    calls: Vec<ScriptCall>,
    /// Shorthand for a single call.
    tool: Option<String>,
    args: Option<serde_json::Value>,
    /// Raw argument text instead of `args`, for replaying malformed output.
    arguments: Option<String>,
    text: Option<String>,
    #[serde(default)]
    usage: Option<Usage>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ScriptCall {
    tool: String,
    args: Option<serde_json::Value>,
    arguments: Option<String>,
}

impl ScriptCall {
    /// The call, or why the action is not one: `args` and `arguments` say the same thing two
    /// ways, and keel will not pick one of them silently.
    fn into_call(self, id: String) -> Result<ToolCall, String> {
        let arguments = match (self.arguments, self.args) {
            (Some(_), Some(_)) => {
                return Err(format!(
                    "a script action gives call `{}` both `args` and `arguments`; keep one \
                     (`args` for a JSON value, `arguments` for raw text)",
                    self.tool
                ));
            }
            (Some(raw), None) => raw,
            (None, Some(args)) => args.to_string(),
            (None, None) => "{}".to_string(),
        };
        Ok(ToolCall {
            id,
            name: self.tool,
            arguments,
        })
    }
}

/// Replays a JSONL file of actions, one per model call: for tests, demos and replaying a run.
pub struct ScriptDriver {
    path: PathBuf,
    text: String,
    /// Where each action is in `text` (lines that are not blank or `#` comments, trimmed): one
    /// allocation for the whole script, which a long run's may be a megabyte of. Found at the
    /// first model call: a resume that waits (for an answer, an approval) makes none, and
    /// indexing a long run's script was most of such a resume's time.
    lines: std::cell::OnceCell<Vec<std::ops::Range<usize>>>,
}

impl ScriptDriver {
    pub fn load(path: &Path) -> Result<ScriptDriver, DriverError> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            DriverError(format!(
                "cannot read the driver script {}: {e}",
                path.display()
            ))
        })?;
        Ok(ScriptDriver {
            path: path.to_path_buf(),
            text,
            lines: std::cell::OnceCell::new(),
        })
    }

    fn lines(&self) -> &[std::ops::Range<usize>] {
        self.lines.get_or_init(|| {
            let mut lines = Vec::new();
            let mut start = 0;
            for line in self.text.split_inclusive('\n') {
                let trimmed = line.trim();
                if !trimmed.is_empty() && !trimmed.starts_with('#') {
                    let offset = start + (line.len() - line.trim_start().len());
                    lines.push(offset..offset + trimmed.len());
                }
                start += line.len();
            }
            lines
        })
    }
}

impl Driver for ScriptDriver {
    fn local(&self) -> bool {
        true
    }

    fn request(&self, prompt: &Prompt, tools: &[ToolSpec]) -> Vec<u8> {
        prompt_json(prompt, tools)
    }

    fn send(&mut self, _request: &[u8], ctx: &SendContext<'_>) -> Result<Exchange, DriverError> {
        let index = usize::try_from(ctx.call_no.saturating_sub(1)).unwrap_or(usize::MAX);
        let lines = self.lines();
        match lines.get(index).and_then(|r| self.text.get(r.clone())) {
            Some(line) => Ok(Exchange {
                response: line.as_bytes().to_vec(),
                retries: Vec::new(),
                duration_ms: 0,
            }),
            None => Err(DriverError(format!(
                "the driver script {} has {} actions and this is model call {}: the script is used up",
                self.path.display(),
                lines.len(),
                ctx.call_no
            ))),
        }
    }

    fn parse(&self, response: &[u8]) -> Result<ModelReply, String> {
        // serde would also read an action from an array, by position; nobody writes one so.
        if response.trim_ascii_start().first() != Some(&b'{') {
            return Err(
                "a script action is not valid: it must be a JSON object like \
                 {\"tool\": \"read\", \"args\": {\"path\": \"src/lib.rs\"}}"
                    .to_string(),
            );
        }
        let action: ScriptAction = serde_json::from_slice(response)
            .map_err(|e| format!("a script action is not valid: {e}"))?;
        let mut calls: Vec<ToolCall> = action
            .calls
            .into_iter()
            .enumerate()
            .map(|(i, c)| c.into_call(format!("call-{i}")))
            .collect::<Result<_, _>>()?;
        match action.tool {
            Some(tool) => {
                let shorthand = ScriptCall {
                    tool,
                    args: action.args,
                    arguments: action.arguments,
                };
                calls.push(shorthand.into_call(format!("call-{}", calls.len()))?);
            }
            // Arguments for no tool would otherwise be dropped without a word.
            None if action.args.is_some() || action.arguments.is_some() => {
                return Err(
                    "a script action has `args` or `arguments` but no `tool`; name the tool \
                     they are for"
                        .to_string(),
                );
            }
            None => {}
        }
        Ok(ModelReply {
            text: action.text,
            calls,
            usage: action.usage.unwrap_or_default(),
            stop_reason: Some("script".into()),
        })
    }

    fn cost(&self, _usage: Usage) -> u64 {
        0
    }

    fn counter(&self) -> &dyn TokenCount {
        &Estimate
    }
}

/// A delegated program (for example a coding agent's command line): keel writes the prompt to
/// a file, runs the program in the workspace, and judges the result itself. Each run is one step;
/// a run that exits 0 is taken as a claim that the phase is done, which the verifiers judge.
pub struct CommandDriver {
    command: String,
    timeout: Duration,
}

impl CommandDriver {
    pub fn new(command: &str, timeout_ms: u64) -> CommandDriver {
        CommandDriver {
            command: command.to_string(),
            timeout: Duration::from_millis(timeout_ms),
        }
    }
}

/// How much of a delegated program's output its response keeps.
const COMMAND_TAIL: usize = 4000;

impl Driver for CommandDriver {
    fn request(&self, prompt: &Prompt, _tools: &[ToolSpec]) -> Vec<u8> {
        format!("{}\n\n{}", prompt.system, prompt.user).into_bytes()
    }

    fn send(&mut self, request: &[u8], ctx: &SendContext<'_>) -> Result<Exchange, DriverError> {
        // Outside keel's store, which a confined program cannot see; readable by this user only.
        let prompt = tempfile::Builder::new()
            .prefix(&format!("keel-{}-prompt-{}-", ctx.run_id, ctx.call_no))
            .suffix(".md")
            .tempfile()
            .and_then(|mut f| {
                use std::io::Write;
                f.write_all(request)?;
                f.flush()?;
                Ok(f)
            })
            .map_err(|e| {
                DriverError(format!("cannot write the prompt to a temporary file: {e}"))
            })?;
        let prompt_file = prompt.path().to_path_buf();
        let out = ctx
            .tmp
            .join(format!("{}-delegate-{}.log", ctx.run_id, ctx.call_no));
        let started = Instant::now();
        let env = [
            ("KEEL_PROMPT_FILE", prompt_file.display().to_string()),
            ("KEEL_RUN_ID", ctx.run_id.to_string()),
            ("KEEL_STEP", ctx.step.clone()),
        ];
        let outcome = ctx
            .confinement
            .run(
                crate::process::Program::Shell(&self.command),
                &env,
                &out,
                self.timeout,
                None,
                Some(true),
            )
            .map_err(|e| {
                DriverError(format!(
                    "cannot run the driver command `{}`: {e}",
                    self.command
                ))
            })?;
        let text = std::fs::read(&out).unwrap_or_default();
        let _ = std::fs::remove_file(&out);
        drop(prompt);
        let text = String::from_utf8_lossy(&text);
        let tail = keel_core::run::cut(
            text.get(text.len().saturating_sub(COMMAND_TAIL)..)
                .unwrap_or(&text),
            COMMAND_TAIL,
        );
        let response = serde_json::json!({
            "command": self.command,
            "status": outcome.status,
            "success": outcome.success,
            "output_tail": tail,
        });
        Ok(Exchange {
            response: serde_json::to_vec(&response).unwrap_or_default(),
            retries: Vec::new(),
            duration_ms: u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
        })
    }

    fn parse(&self, response: &[u8]) -> Result<ModelReply, String> {
        let v: serde_json::Value = serde_json::from_slice(response)
            .map_err(|e| format!("the delegated command's record does not decode: {e}"))?;
        // Only what `send` writes is a record: anything else would read as a run that claimed
        // nothing, and a damaged record must not pass for one.
        let status = v.get("status").and_then(serde_json::Value::as_str);
        let success = v.get("success").and_then(serde_json::Value::as_bool);
        let tail = match v.get("output_tail") {
            None | Some(serde_json::Value::Null) => Some(""),
            Some(tail) => tail.as_str(),
        };
        let (Some(status), Some(success), Some(tail)) = (status, success, tail) else {
            return Err(
                "the delegated command's record is not one keel writes: it needs a string \
                 `status`, a boolean `success` and a string `output_tail`"
                    .to_string(),
            );
        };
        let calls = if success {
            vec![ToolCall {
                id: "delegate".into(),
                name: "finish".into(),
                arguments: serde_json::json!({
                    "summary": format!("the delegated command ended with {status}")
                })
                .to_string(),
            }]
        } else {
            Vec::new()
        };
        Ok(ModelReply {
            text: Some(format!("the delegated command ended with {status}\n{tail}")),
            calls,
            usage: Usage::default(),
            stop_reason: Some(status.to_string()),
        })
    }

    fn cost(&self, _usage: Usage) -> u64 {
        0
    }

    fn counter(&self) -> &dyn TokenCount {
        &Estimate
    }

    fn edits_workspace(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_script_is_its_lines_but_blank_ones_and_comments_trimmed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.jsonl");
        std::fs::write(
            &path,
            "# a comment\n\n  {\"tool\": \"a\"}  \r\n\t{\"tool\": \"b\"}\n   \n{}",
        )
        .unwrap();
        let d = ScriptDriver::load(&path).unwrap();
        let lines: Vec<&str> = d.lines().iter().map(|r| &d.text[r.clone()]).collect();
        assert_eq!(lines, [r#"{"tool": "a"}"#, r#"{"tool": "b"}"#, "{}"]);
    }

    #[test]
    fn script_actions_parse_in_every_form() {
        let d = ScriptDriver {
            path: "s.jsonl".into(),
            text: String::new(),
            lines: std::cell::OnceCell::new(),
        };
        let r = d
            .parse(br#"{"tool": "read", "args": {"path": "a"}}"#)
            .unwrap();
        assert_eq!(r.calls[0].name, "read");
        assert_eq!(r.calls[0].arguments, r#"{"path":"a"}"#);
        let r = d
            .parse(br#"{"calls": [{"tool": "note", "args": {"text": "x"}}, {"tool": "write", "arguments": "{not json"}], "usage": {"input_tokens": 5, "output_tokens": 2}}"#)
            .unwrap();
        assert_eq!(r.calls.len(), 2);
        assert_eq!(r.calls[1].arguments, "{not json");
        assert_eq!(r.usage.input_tokens, 5);
        assert!(d.parse(b"{\"toll\": 1}").is_err());
    }
}
