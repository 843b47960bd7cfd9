//! Runs and events for the store's tests.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use keel_core::budget::BudgetLimits;
use keel_core::event::{Event, EventBody, PhaseOutline};
use keel_core::fingerprint::Fingerprint;
use keel_core::run::Run;

pub fn db(dir: &tempfile::TempDir) -> std::path::PathBuf {
    dir.path().join(".keel/keel.db")
}

pub fn created(id: &str) -> (Event, Run) {
    let e = Event {
        run_id: id.into(),
        seq: 1,
        at_ms: 1000,
        body: EventBody::RunCreated {
            contract_hash: "c".repeat(64),
            contract_file: "keel.toml".into(),
            workspace: "/w".into(),
            phases: vec![PhaseOutline {
                name: "p".into(),
                commands: vec!["true".into()],
                agent: false,
                approval: false,
            }],
            acceptance: vec!["a".into()],
            limits: BudgetLimits::default(),
            base: Fingerprint::default(),
            keel_version: "0".into(),
            driver: None,
            sandbox_off: false,
        },
    };
    let run = Run::create(&e).unwrap();
    (e, run)
}

/// `n` events after the run's last one (each a `resumed` record, which any run may append), and
/// the projection after them.
pub fn next(run: &Run, n: usize, holder: &str) -> (Vec<Event>, Run) {
    let mut r = run.clone();
    let mut events = Vec::new();
    for _ in 0..n {
        let e = Event {
            run_id: r.id.clone(),
            seq: r.seq + 1,
            at_ms: 2000 + r.seq as i64,
            body: EventBody::Resumed {
                holder: holder.into(),
                lease: 1,
                checkpoint: None,
            },
        };
        r.apply(&e).unwrap();
        events.push(e);
    }
    (events, r)
}
