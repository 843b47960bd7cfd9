//! Group commit: many writers share one transaction and one fsync, and each still gets the
//! result `Store::commit` would have given it.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use keel_core::budget::BudgetLimits;
use keel_core::event::{Event, EventBody, PhaseOutline};
use keel_core::fingerprint::Fingerprint;
use keel_core::run::Run;
use keel_store::{GroupCommitter, GroupError, GroupOptions, Store, StoreError, verify_chain};

fn db(dir: &tempfile::TempDir) -> std::path::PathBuf {
    dir.path().join(".keel/keel.db")
}

fn created(id: &str) -> (Event, Run) {
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
fn next(run: &Run, n: usize, holder: &str) -> (Vec<Event>, Run) {
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

/// A batch closes when it holds `n` commits (or after a generous wait): the tests decide what
/// shares a transaction without depending on timing.
fn batches_of(n: usize) -> GroupOptions {
    GroupOptions {
        max_batch: n,
        linger: Duration::from_secs(30),
        busy_timeout: None,
    }
}

#[test]
fn many_writers_land_in_order_and_chained() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = Store::open(&db(&dir)).unwrap();
    let writers = 8;
    let commits = 25;
    let mut leases = Vec::new();
    for w in 0..writers {
        let (e, run) = created(&format!("run{w}"));
        let lease = store.create_run(&e, &run, "me", 0, 60_000).unwrap();
        leases.push((lease, run));
    }
    let group = GroupCommitter::start(store, GroupOptions::default()).unwrap();
    std::thread::scope(|s| {
        for (w, (lease, run)) in leases.iter().enumerate() {
            let handle = group.handle();
            s.spawn(move || {
                let mut run = run.clone();
                for c in 0..commits {
                    // Commits of one to three events.
                    let (events, after) = next(&run, 1 + (w + c) % 3, &format!("w{w}c{c}"));
                    handle.commit(lease, &events, &after, None, 0).unwrap();
                    run = after;
                }
            });
        }
    });
    let stats = group.stats();
    assert_eq!(stats.commits, (writers * commits) as u64);
    assert!(stats.batches >= 1 && stats.batches <= stats.commits);
    let store = group.stop().unwrap();
    for w in 0..writers {
        let id = format!("run{w}");
        let stored = store.events_from(&id, 1).unwrap();
        let expected: usize = 1 + (0..commits).map(|c| 1 + (w + c) % 3).sum::<usize>();
        assert_eq!(stored.len(), expected, "every event of {id} is stored");
        assert!(
            stored
                .iter()
                .enumerate()
                .all(|(i, e)| e.seq == i as u64 + 1),
            "{id}: sequence numbers without gaps"
        );
        assert_eq!(verify_chain(None, &stored), Ok(expected as u64), "{id}");
        // Each writer's commits landed in the order it made them.
        let holders: Vec<String> = stored[1..]
            .iter()
            .map(|e| match e.decode().unwrap().body {
                EventBody::Resumed { holder, .. } => holder,
                other => panic!("unexpected {}", other.kind()),
            })
            .collect();
        let mut order: Vec<String> = holders.clone();
        order.dedup();
        let wanted: Vec<String> = (0..commits).map(|c| format!("w{w}c{c}")).collect();
        assert_eq!(order, wanted, "{id}: commits in order");
        let (last_seq, last_hash) = store.log_head(&id).unwrap();
        assert_eq!(last_seq, expected as u64);
        assert_eq!(last_hash, stored.last().unwrap().hash);
        assert_eq!(store.run(&id).unwrap().seq, expected as u64, "projection");
    }
}

#[test]
fn a_stale_writer_in_a_batch_is_refused_alone() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = Store::open(&db(&dir)).unwrap();
    let (e1, run1) = created("a");
    let (e2, run2) = created("b");
    let (e3, run3) = created("c");
    let lease1 = store.create_run(&e1, &run1, "me", 0, 60_000).unwrap();
    let stale = store.create_run(&e2, &run2, "me", 0, 60_000).unwrap();
    let lease3 = store.create_run(&e3, &run3, "me", 0, 60_000).unwrap();
    // Someone else takes run b: our token for it is stale.
    let fresh = store
        .acquire("b", "other", 1, 60_000, true, &|_| false)
        .unwrap();
    assert!(fresh.token > stale.token);

    let group = GroupCommitter::start(store, batches_of(3)).unwrap();
    let handle = group.handle();
    let (ev1, after1) = next(&run1, 2, "x");
    let (ev2, after2) = next(&run2, 2, "x");
    let (ev3, after3) = next(&run3, 1, "x");
    let p1 = handle.submit(&lease1, &ev1, &after1, None, 0);
    let p2 = handle.submit(&stale, &ev2, &after2, None, 0);
    let p3 = handle.submit(&lease3, &ev3, &after3, None, 0);
    p1.wait().unwrap();
    let refused = p2.wait().unwrap_err();
    assert!(
        matches!(refused, GroupError::Refused(StoreError::LeaseLost { .. })),
        "{refused}"
    );
    p3.wait().unwrap();
    assert_eq!(
        group.stats().batches,
        1,
        "the three commits shared one transaction"
    );

    // A writer behind the log is refused too, and the batch goes on.
    let (behind, behind_run) = next(&run1, 1, "late");
    let (ev3b, after3b) = next(&after3, 1, "y");
    let (ev1b, after1b) = next(&after1, 1, "y");
    let q1 = handle.submit(&lease1, &behind, &behind_run, None, 0);
    let q2 = handle.submit(&lease3, &ev3b, &after3b, None, 0);
    let q3 = handle.submit(&lease1, &ev1b, &after1b, None, 0);
    let conflict = q1.wait().unwrap_err();
    assert!(
        matches!(conflict, GroupError::Refused(StoreError::Conflict { .. })),
        "{conflict}"
    );
    q2.wait().unwrap();
    q3.wait().unwrap();

    let store = group.stop().unwrap();
    assert_eq!(store.log_head("a").unwrap().0, 4);
    assert_eq!(store.run("a").unwrap(), after1b);
    assert_eq!(
        store.log_head("b").unwrap().0,
        1,
        "nothing of the stale writer"
    );
    assert_eq!(store.run("b").unwrap(), run2);
    assert_eq!(store.log_head("c").unwrap().0, 3);
    for id in ["a", "b", "c"] {
        let stored = store.events_from(id, 1).unwrap();
        assert_eq!(verify_chain(None, &stored), Ok(stored.len() as u64), "{id}");
    }
}

#[test]
fn a_failed_batch_is_reported_to_every_writer_and_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let path = db(&dir);
    let mut store = Store::open(&path).unwrap();
    let mut runs = Vec::new();
    for id in ["a", "b", "c"] {
        let (e, run) = created(id);
        let lease = store.create_run(&e, &run, "me", 0, 60_000).unwrap();
        runs.push((lease, run));
    }
    let group = GroupCommitter::start(
        store,
        GroupOptions {
            busy_timeout: Some(Duration::from_millis(20)),
            ..batches_of(3)
        },
    )
    .unwrap();
    // Another process holds the write lock: the batch's transaction cannot begin.
    let other = rusqlite::Connection::open(&path).unwrap();
    other.execute_batch("BEGIN IMMEDIATE").unwrap();
    let handle = group.handle();
    let pending: Vec<_> = runs
        .iter()
        .map(|(lease, run)| {
            let (events, after) = next(run, 1, "x");
            handle.submit(lease, &events, &after, None, 0)
        })
        .collect();
    for p in pending {
        let err = p.wait().unwrap_err();
        assert!(
            matches!(err, GroupError::Batch { size: 3, .. }),
            "every writer hears of the failed batch: {err}"
        );
    }
    other.execute_batch("ROLLBACK").unwrap();

    // Nothing was written, and the committer goes on working: the same commits, sent again,
    // land.
    let pending: Vec<_> = runs
        .iter()
        .map(|(lease, run)| {
            let (events, after) = next(run, 1, "again");
            handle.submit(lease, &events, &after, None, 0)
        })
        .collect();
    for p in pending {
        p.wait().unwrap();
    }
    let store = group.stop().unwrap();
    for id in ["a", "b", "c"] {
        let stored = store.events_from(id, 1).unwrap();
        assert_eq!(
            stored.len(),
            2,
            "{id}: the run's first event and the resent one"
        );
        assert!(matches!(
            stored[1].decode().unwrap().body,
            EventBody::Resumed { ref holder, .. } if holder == "again"
        ));
    }
}

#[test]
fn a_commit_after_stop_is_reported_not_lost() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = Store::open(&db(&dir)).unwrap();
    let (e, run) = created("a");
    let lease = store.create_run(&e, &run, "me", 0, 60_000).unwrap();
    let group = GroupCommitter::start(store, GroupOptions::default()).unwrap();
    let handle = group.handle();
    let store = group.stop().unwrap();
    let (events, after) = next(&run, 1, "x");
    let err = handle.commit(&lease, &events, &after, None, 0).unwrap_err();
    assert!(matches!(err, GroupError::Stopped { .. }), "{err}");
    assert_eq!(store.log_head("a").unwrap().0, 1);
}

/// The group remembers the rows it wrote, as `Store::commit` does, and writes only those that
/// changed: the stored rows still follow every commit, after a refused one, and after another
/// connection took the lease and wrote.
#[test]
fn rows_written_through_the_group_follow_every_commit() {
    use keel_core::budget::BudgetName;
    let dir = tempfile::tempdir().unwrap();
    let path = db(&dir);
    let mut store = Store::open(&path).unwrap();
    let (e, run) = created("r");
    let lease = store.create_run(&e, &run, "me", 0, 60_000).unwrap();
    let raise = |run: &Run, to: u64| -> (Vec<Event>, Run) {
        let mut r = run.clone();
        let e = Event {
            run_id: r.id.clone(),
            seq: r.seq + 1,
            at_ms: 3000 + r.seq as i64,
            body: EventBody::BudgetRaised {
                budget: BudgetName::Steps,
                from: r.limits.get(BudgetName::Steps),
                to,
                reason: "more".into(),
                by: "person".into(),
            },
        };
        r.apply(&e).unwrap();
        (vec![e], r)
    };
    let stored_limit = |path: &std::path::Path| -> Option<u64> {
        let conn = rusqlite::Connection::open(path).unwrap();
        conn.query_row(
            "SELECT lim FROM budgets WHERE run_id = 'r' AND name = 'steps'",
            [],
            |r| r.get(0),
        )
        .unwrap()
    };
    let group = GroupCommitter::start(store, batches_of(1)).unwrap();
    let mut run = run;
    for to in [10, 20, 30] {
        let (events, after) = raise(&run, to);
        group
            .handle()
            .commit(&lease, &events, &after, None, 0)
            .unwrap();
        run = after;
        assert_eq!(stored_limit(&path), Some(to));
    }
    // A stale commit (an old projection) is refused and changes nothing remembered.
    let (events, _) = raise(&created("r").1, 99);
    assert!(
        group
            .handle()
            .commit(&lease, &events, &run, None, 0)
            .is_err()
    );
    let (events, after) = raise(&run, 40);
    group
        .handle()
        .commit(&lease, &events, &after, None, 0)
        .unwrap();
    run = after;
    assert_eq!(stored_limit(&path), Some(40));
    let store = group.stop().unwrap();

    // Another connection takes the lease and writes; the group, started again, sees a new token.
    let mut other = Store::open(&path).unwrap();
    let lease2 = other
        .acquire("r", "someone", 0, 60_000, true, &|_| false)
        .unwrap();
    let (events, after) = raise(&run, 50);
    other.commit(&lease2, &events, &after, None, 0).unwrap();
    run = after;
    let group = GroupCommitter::start(store, batches_of(1)).unwrap();
    let (events, after) = raise(&run, 60);
    group
        .handle()
        .commit(&lease2, &events, &after, None, 0)
        .unwrap();
    assert_eq!(stored_limit(&path), Some(60));
    group.stop().unwrap();
}
