//! Checking a run's hash chain.

use keel_core::event::GENESIS_HASH;

use crate::StoredEvent;

/// The first thing wrong with a stretch of a run's log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChainProblem {
    /// Sequence numbers skip or repeat.
    Gap { expected: u64, found: u64 },
    /// An event comes after event `u64::MAX`, the last sequence number there is.
    AfterLast { seq: u64 },
    /// The event's stored hash is not the hash of its content: it was altered or torn.
    Altered { seq: u64 },
    /// The event does not link to the one before it.
    Unlinked { seq: u64 },
    /// The body does not decode.
    Undecodable { seq: u64, message: String },
    /// The stored row holding this event and the ones after it in the same commit does not
    /// decode (see `Store::for_each_event`): none of them can be read.
    Unreadable { seq: u64, message: String },
    /// The `kind` column names another kind than the body.
    KindMismatch {
        seq: u64,
        column: String,
        body: String,
    },
}

impl ChainProblem {
    pub fn seq(&self) -> u64 {
        match self {
            ChainProblem::Gap { found, .. } => *found,
            ChainProblem::AfterLast { seq }
            | ChainProblem::Altered { seq }
            | ChainProblem::Unlinked { seq }
            | ChainProblem::Undecodable { seq, .. }
            | ChainProblem::Unreadable { seq, .. }
            | ChainProblem::KindMismatch { seq, .. } => *seq,
        }
    }
}

impl std::fmt::Display for ChainProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ChainProblem::Gap { expected, found } => {
                write!(
                    f,
                    "event {found} follows where {expected} was expected: events are missing or repeated"
                )
            }
            ChainProblem::AfterLast { seq } => write!(
                f,
                "event {seq} follows event {}, the last sequence number there is: no event can follow it",
                u64::MAX
            ),
            ChainProblem::Altered { seq } => write!(
                f,
                "event {seq} does not match its hash: its content was changed or only partly written"
            ),
            ChainProblem::Unlinked { seq } => write!(
                f,
                "event {seq} does not link to the event before it: the chain is broken"
            ),
            ChainProblem::Undecodable { seq, message } => {
                write!(f, "event {seq} does not decode: {message}")
            }
            ChainProblem::Unreadable { message, .. } => f.write_str(message),
            ChainProblem::KindMismatch { seq, column, body } => write!(
                f,
                "event {seq} is stored as kind `{column}` but its body is a `{body}`"
            ),
        }
    }
}

/// Checks a contiguous stretch of events. `anchor` is the `(seq, hash)` of the event before the
/// first one, or `None` when the stretch starts at the beginning of the log. Returns the number of
/// events checked or the first problem. Nothing can follow event `u64::MAX`: an event after it
/// (or after an anchor there) is [`ChainProblem::AfterLast`].
pub fn verify_chain<'a>(
    anchor: Option<(u64, &str)>,
    events: impl IntoIterator<Item = &'a StoredEvent>,
) -> Result<u64, ChainProblem> {
    // `None` once the last sequence number has been used.
    let (mut expected, mut prev) = match anchor {
        Some((seq, hash)) => (seq.checked_add(1), hash.to_string()),
        None => (Some(1), GENESIS_HASH.to_string()),
    };
    let mut count = 0;
    for e in events {
        let Some(seq) = expected else {
            return Err(ChainProblem::AfterLast { seq: e.seq });
        };
        check_one(seq, &prev, e)?;
        prev = e.hash.clone();
        expected = seq.checked_add(1);
        count += 1;
    }
    Ok(count)
}

pub(crate) fn check_one(expected: u64, prev: &str, e: &StoredEvent) -> Result<(), ChainProblem> {
    if e.version == 0 && e.kind == crate::UNREADABLE && e.hash.is_empty() {
        return Err(ChainProblem::Unreadable {
            seq: e.seq,
            message: e.body.clone(),
        });
    }
    if e.seq != expected {
        return Err(ChainProblem::Gap {
            expected,
            found: e.seq,
        });
    }
    if e.computed_hash() != e.hash {
        return Err(ChainProblem::Altered { seq: e.seq });
    }
    if e.prev_hash != prev {
        return Err(ChainProblem::Unlinked { seq: e.seq });
    }
    match e.decode() {
        Err(err) => Err(ChainProblem::Undecodable {
            seq: e.seq,
            message: err.to_string(),
        }),
        Ok(event) if event.body.kind() != e.kind => Err(ChainProblem::KindMismatch {
            seq: e.seq,
            column: e.kind.clone(),
            body: event.body.kind().to_string(),
        }),
        Ok(_) => Ok(()),
    }
}
