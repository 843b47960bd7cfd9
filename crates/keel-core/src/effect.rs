//! The effect ledger as a list: every external effect a run intended, with its key, class,
//! status and compensation, read from the events (the projection keeps only the step in
//! progress).

use serde::Serialize;

use crate::agent::Reversibility;
use crate::event::{EffectStatus, EventBody, StepId};

/// One external effect of a run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Effect {
    pub key: String,
    pub step: StepId,
    pub call: u32,
    pub tool: String,
    pub class: Reversibility,
    pub keyed: bool,
    pub status: EffectStatus,
    /// What was attempted.
    pub payload: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub compensation: Option<String>,
    /// The last settlement's words (the first line of the outcome, or why it is unknown).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub detail: String,
    /// The sequence numbers of the `effect_intended` event and of the last settlement.
    pub intended_seq: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub settled_seq: Option<u64>,
}

/// The effects of a run, in the order they were intended, from its events (`seq`, body).
pub fn ledger<'a>(events: impl IntoIterator<Item = (u64, &'a EventBody)>) -> Vec<Effect> {
    let mut out: Vec<Effect> = Vec::new();
    for (seq, body) in events {
        match body {
            EventBody::EffectIntended {
                step,
                call,
                key,
                tool,
                class,
                keyed,
                payload,
                compensation,
            } => out.push(Effect {
                key: key.clone(),
                step: *step,
                call: *call,
                tool: tool.clone(),
                class: *class,
                keyed: *keyed,
                status: EffectStatus::Intended,
                payload: payload.clone(),
                compensation: compensation.clone(),
                detail: String::new(),
                intended_seq: seq,
                settled_seq: None,
            }),
            EventBody::EffectSettled {
                key,
                status,
                detail,
                ..
            } => {
                if let Some(e) = out.iter_mut().rev().find(|e| e.key == *key) {
                    e.status = *status;
                    e.detail = detail.clone();
                    e.settled_seq = Some(seq);
                }
            }
            _ => {}
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ledger_follows_each_key_to_its_last_status() {
        let step = StepId { phase: 0, index: 0 };
        let intended = |call: u32, key: &str| EventBody::EffectIntended {
            step,
            call,
            key: key.into(),
            tool: "notify".into(),
            class: Reversibility::Irreversible,
            keyed: false,
            payload: "notify.sh hi".into(),
            compensation: None,
        };
        let settled = |call: u32, key: &str, status| EventBody::EffectSettled {
            step,
            call,
            key: key.into(),
            status,
            detail: String::new(),
        };
        let events = [
            intended(0, "k0"),
            settled(0, "k0", EffectStatus::Done),
            intended(1, "k1"),
            settled(1, "k1", EffectStatus::Unknown),
            settled(1, "k1", EffectStatus::Done),
            intended(2, "k2"),
        ];
        let ledger = ledger(events.iter().enumerate().map(|(i, e)| (i as u64 + 1, e)));
        let got: Vec<(&str, EffectStatus, Option<u64>)> = ledger
            .iter()
            .map(|e| (e.key.as_str(), e.status, e.settled_seq))
            .collect();
        assert_eq!(
            got,
            [
                ("k0", EffectStatus::Done, Some(2)),
                ("k1", EffectStatus::Done, Some(5)),
                ("k2", EffectStatus::Intended, None),
            ]
        );
    }
}
