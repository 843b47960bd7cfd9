//! Runs and events for the store's tests: a run's creation, and events any run may append.

use keel_core::budget::BudgetLimits;
use keel_core::event::{Event, EventBody, PhaseOutline};
use keel_core::fingerprint::Fingerprint;
use keel_core::run::Run;

/// The `run_created` event of a run `id` of one command phase, and the run it makes.
///
/// # Panics
/// If keel-core refuses the event: this fixture no longer matches what a run is.
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
    let run = Run::create(&e).unwrap_or_else(|err| panic!("the fixture's run: {err}"));
    (e, run)
}

/// A `resumed` record (which any run may append) after `run`'s last event, naming `holder`.
pub fn resumed(run: &Run, holder: &str) -> Event {
    Event {
        run_id: run.id.clone(),
        seq: run.seq + 1,
        at_ms: 2000 + run.seq as i64,
        body: EventBody::Resumed {
            holder: holder.into(),
            lease: 1,
            checkpoint: None,
        },
    }
}

/// `n` [`resumed`] events after the run's last one, and the projection after them.
///
/// # Panics
/// If keel-core refuses one: this fixture no longer matches what a run may append.
pub fn next(run: &Run, n: usize, holder: &str) -> (Vec<Event>, Run) {
    let mut r = run.clone();
    let mut events = Vec::new();
    for _ in 0..n {
        let e = resumed(&r, holder);
        r.apply(&e)
            .unwrap_or_else(|err| panic!("the fixture's event: {err}"));
        events.push(e);
    }
    (events, r)
}
