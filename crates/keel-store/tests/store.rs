//! The store's contract, checked against the SQLite implementation: events and projections move
//! together, the chain is computed and checked, leases fence out stale writers, torn tails are
//! cut with a record.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::created;
use keel_core::event::{Event, EventBody, StepId};
use keel_core::run::Run;
use keel_store::{ChainProblem, Store, StoreError, verify_chain};

fn open() -> (tempfile::TempDir, Store) {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&dir.path().join(".keel/keel.db")).unwrap();
    (dir, store)
}

/// Appends `bodies` after the run's last event, returning the events and the new projection.
fn next(run: &Run, bodies: Vec<EventBody>) -> (Vec<Event>, Run) {
    let mut r = run.clone();
    let mut events = Vec::new();
    for body in bodies {
        let e = Event {
            run_id: r.id.clone(),
            seq: r.seq + 1,
            at_ms: 2000 + r.seq as i64,
            body,
        };
        r.apply(&e).unwrap();
        events.push(e);
    }
    (events, r)
}

fn resumed(lease: u64) -> EventBody {
    EventBody::Resumed {
        holder: "h".into(),
        lease,
        checkpoint: None,
    }
}

#[test]
fn events_and_projection_are_committed_together_with_a_chain() {
    let (_d, mut store) = open();
    let (e, run) = created("r1");
    let lease = store.create_run(&e, &run, "me", 0, 1000).unwrap();
    let (events, run2) = next(&run, vec![resumed(1), resumed(1)]);
    store.commit(&lease, &events, &run2, None, 0).unwrap();

    assert_eq!(store.run("r1").unwrap(), run2);
    let stored = store.events_from("r1", 1).unwrap();
    assert_eq!(stored.iter().map(|e| e.seq).collect::<Vec<_>>(), [1, 2, 3]);
    assert_eq!(verify_chain(None, &stored), Ok(3));
    assert_eq!(store.log_head("r1").unwrap(), (3, stored[2].hash.clone()));
    assert_eq!(stored[1].decode().unwrap(), events[0]);
}

#[test]
fn a_stale_lease_cannot_write() {
    let (_d, mut store) = open();
    let (e, run) = created("r1");
    let old = store.create_run(&e, &run, "a", 0, 1000).unwrap();
    // Another holder takes the run by force (as cancel does): the old lease is fenced out.
    let new = store
        .acquire("r1", "b", 10, 1000, true, &|_| false)
        .unwrap();
    assert!(new.token > old.token);
    let (events, run2) = next(&run, vec![resumed(1)]);
    let err = store.commit(&old, &events, &run2, None, 0).unwrap_err();
    assert!(matches!(err, StoreError::LeaseLost { .. }), "{err}");
    assert_eq!(store.log_head("r1").unwrap().0, 1, "nothing was written");
    store.commit(&new, &events, &run2, None, 0).unwrap();
}

#[test]
fn a_held_lease_is_refused_unless_expired_or_stale() {
    let (_d, mut store) = open();
    let (e, run) = created("r1");
    store.create_run(&e, &run, "a", 0, 1000).unwrap();
    let err = store
        .acquire("r1", "b", 10, 1000, false, &|_| false)
        .unwrap_err();
    assert!(matches!(err, StoreError::LeaseHeld { .. }), "{err}");
    assert!(err.to_string().contains("held by a"));
    assert!(
        err.to_string().contains("until 1970-01-01T00:00:01Z (UTC)"),
        "the lease's end as people read it: {err}"
    );
    // Expired.
    assert!(
        store
            .acquire("r1", "b", 5000, 1000, false, &|_| false)
            .is_ok()
    );
    // Held by b until 6000; a holder judged gone (a dead process) does not count.
    assert!(
        store
            .acquire("r1", "c", 5001, 1000, false, &|_| false)
            .is_err()
    );
    let lease = store
        .acquire("r1", "c", 5001, 1000, false, &|h| h == "b")
        .unwrap();
    store.release(&lease).unwrap();
    assert_eq!(store.lease_info("r1").unwrap().holder, None);
    assert!(
        store
            .acquire("r1", "d", 5002, 1000, false, &|_| false)
            .is_ok()
    );
}

#[test]
fn a_writer_that_is_behind_the_log_conflicts() {
    let (_d, mut store) = open();
    let (e, run) = created("r1");
    let lease = store.create_run(&e, &run, "a", 0, 1000).unwrap();
    let (events, run2) = next(&run, vec![resumed(1)]);
    store.commit(&lease, &events, &run2, None, 0).unwrap();
    // The same events again (a writer that did not see its own commit): refused.
    let err = store.commit(&lease, &events, &run2, None, 0).unwrap_err();
    assert!(matches!(err, StoreError::Conflict { .. }), "{err}");
}

#[test]
fn tampering_is_found_by_the_chain_check() {
    let (dir, mut store) = open();
    let (e, run) = created("r1");
    let lease = store.create_run(&e, &run, "a", 0, 1000).unwrap();
    let (events, run2) = next(&run, vec![resumed(1), resumed(1), resumed(1)]);
    store.commit(&lease, &events, &run2, None, 0).unwrap();
    drop(store);
    let db = rusqlite_open(&dir);
    keel_store::log::rewrite_stored(&db, "r1", 2, |events| {
        let e = events.iter_mut().find(|e| e.seq == 2).unwrap();
        e.body = e.body.replace("\"h\"", "\"x\"");
    })
    .unwrap();
    let store = Store::open(&dir.path().join(".keel/keel.db")).unwrap();
    let stored = store.events_from("r1", 1).unwrap();
    assert_eq!(
        verify_chain(None, &stored),
        Err(ChainProblem::Altered { seq: 2 })
    );
    // A removed event is a gap.
    keel_store::log::rewrite_stored(&db, "r1", 3, |events| events.retain(|e| e.seq != 3)).unwrap();
    let stored = store.events_from("r1", 3).unwrap();
    let anchor = store.events_from("r1", 2).unwrap()[0].clone();
    assert_eq!(
        verify_chain(Some((2, &anchor.hash)), &stored),
        Err(ChainProblem::Gap {
            expected: 3,
            found: 4
        })
    );
}

#[test]
fn a_cut_tail_is_removed_and_recorded() {
    let (_d, mut store) = open();
    let (e, run) = created("r1");
    let lease = store.create_run(&e, &run, "a", 0, 1000).unwrap();
    let (events, run2) = next(&run, vec![resumed(1), resumed(1)]);
    store.commit(&lease, &events, &run2, None, 0).unwrap();
    // Rebuild without event 3 and record the cut in its place.
    let (_, without) = next(&run, vec![resumed(1)]);
    let (cut, rebuilt) = next(
        &without,
        vec![EventBody::TailCut {
            seq: 3,
            reason: "torn".into(),
        }],
    );
    store.cut_tail(&lease, 3, &cut, &rebuilt, 0).unwrap();
    let stored = store.events_from("r1", 1).unwrap();
    assert_eq!(stored.len(), 3);
    assert_eq!(stored[2].kind, "tail_cut");
    assert_eq!(verify_chain(None, &stored), Ok(3));
    assert_eq!(store.run("r1").unwrap(), rebuilt);
}

#[test]
fn projections_follow_the_events() {
    let (dir, mut store) = open();
    let (e, run) = created("r1");
    let lease = store.create_run(&e, &run, "a", 0, 1000).unwrap();
    let step = StepId { phase: 0, index: 0 };
    let (events, run2) = next(
        &run,
        vec![
            EventBody::StateChanged {
                from: keel_core::state::RunState::Planned,
                to: keel_core::state::RunState::Executing,
                reason: "go".into(),
                block: None,
            },
            EventBody::StepStarted {
                step,
                attempt: 1,
                command: "true".into(),
                agent: false,
            },
        ],
    );
    store.commit(&lease, &events, &run2, None, 0).unwrap();
    drop(store);
    let db = rusqlite_open(&dir);
    let (state, steps_used): (String, i64) = db
        .query_row(
            "SELECT r.state, b.used FROM runs r JOIN budgets b ON b.run_id = r.id AND b.name = 'steps'",
            [],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .unwrap();
    assert_eq!((state.as_str(), steps_used), ("executing", 1));
    let step_state: String = db
        .query_row(
            "SELECT state FROM steps WHERE phase = 0 AND idx = 0",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(step_state, "in_progress");
}

#[test]
fn runs_resolve_by_unique_prefix() {
    let (_d, mut store) = open();
    for id in ["abc1", "abc2", "xyz"] {
        let (e, run) = created(id);
        store.create_run(&e, &run, "a", 0, 1000).unwrap();
    }
    assert_eq!(store.resolve_run("x").unwrap(), "xyz");
    assert_eq!(store.resolve_run("abc1").unwrap(), "abc1");
    assert!(matches!(
        store.resolve_run("abc"),
        Err(StoreError::AmbiguousRun { .. })
    ));
    assert!(matches!(
        store.resolve_run("q"),
        Err(StoreError::NoSuchRun(_))
    ));
    assert_eq!(store.runs().unwrap().len(), 3);
}

#[test]
fn a_new_store_has_keels_page_size_and_a_store_made_with_another_keeps_it() {
    let page_size = |path: &std::path::Path| -> i64 {
        rusqlite::Connection::open(path)
            .unwrap()
            .pragma_query_value(None, "page_size", |r| r.get(0))
            .unwrap()
    };
    let (dir, mut store) = open();
    let (e, run) = created("r1");
    store.create_run(&e, &run, "me", 0, 1000).unwrap();
    drop(store);
    assert_eq!(
        page_size(&dir.path().join(".keel/keel.db")),
        keel_store::PAGE_SIZE
    );

    // A store an earlier keel made, with SQLite's default of 4 KB.
    let old = tempfile::tempdir().unwrap();
    let path = old.path().join("keel.db");
    {
        let conn = rusqlite::Connection::open(&path).unwrap();
        conn.pragma_update(None, "page_size", 4096).unwrap();
        conn.pragma_update(None, "journal_mode", "WAL").unwrap();
    }
    assert_eq!(page_size(&path), 4096);
    let mut store = Store::open(&path).unwrap();
    let lease = store.create_run(&e, &run, "me", 0, 1000).unwrap();
    let (events, run2) = next(&run, vec![resumed(1), resumed(1)]);
    store.commit(&lease, &events, &run2, None, 0).unwrap();
    drop(store);
    assert_eq!(
        page_size(&path),
        4096,
        "an existing store keeps its page size"
    );
    let store = Store::open(&path).unwrap();
    assert_eq!(store.run("r1").unwrap(), run2);
    let stored = store.events_from("r1", 1).unwrap();
    assert_eq!(verify_chain(None, &stored), Ok(3));
}

#[test]
fn a_store_from_a_newer_keel_is_refused() {
    let (dir, store) = open();
    drop(store);
    rusqlite_open(&dir)
        .pragma_update(None, "user_version", 99)
        .unwrap();
    let err = Store::open(&dir.path().join(".keel/keel.db"))
        .err()
        .unwrap();
    assert!(err.to_string().contains("upgrade keel"), "{err}");
}

fn rusqlite_open(dir: &tempfile::TempDir) -> rusqlite::Connection {
    rusqlite::Connection::open(dir.path().join(".keel/keel.db")).unwrap()
}

#[test]
fn like_wildcards_in_a_prefix_match_themselves_only() {
    let (_d, mut store) = open();
    let (e, run) = created("abc");
    store.create_run(&e, &run, "a", 0, 1000).unwrap();
    for prefix in ["_", "%", "a_c", "", "  "] {
        assert!(
            matches!(store.resolve_run(prefix), Err(StoreError::NoSuchRun(_))),
            "`{prefix}` matched a run"
        );
    }
}

/// Threads of one process storing the same bytes at once each get the blob; none finds its
/// temporary file taken by another (found by keel-bench driving many runs in one process).
#[test]
fn the_same_artifact_stored_by_many_threads_at_once_is_stored_for_each() {
    let dir = tempfile::tempdir().unwrap();
    let artifacts = std::sync::Arc::new(keel_store::Artifacts::new(dir.path().join("artifacts")));
    let threads: Vec<_> = (0..8)
        .map(|_| {
            let artifacts = artifacts.clone();
            std::thread::spawn(move || {
                (0..40)
                    .map(|i| artifacts.put(format!("the same bytes {i}").as_bytes()))
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    for t in threads {
        for result in t.join().unwrap() {
            let hash = result.expect("every put succeeds");
            assert!(artifacts.verify(&hash).unwrap());
        }
    }
    let leftovers: Vec<_> = walk(dir.path())
        .into_iter()
        .filter(|p| p.ends_with(".tmp"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

fn walk(dir: &std::path::Path) -> Vec<String> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let path = entry.path();
        if path.is_dir() {
            out.extend(walk(&path));
        } else {
            out.push(path.display().to_string());
        }
    }
    out
}

/// The stored projection as written, and the sequence number its row says it reaches.
fn stored_projection(conn: &rusqlite::Connection, id: &str) -> (Run, u64) {
    let (json, seq): (String, u64) = conn
        .query_row(
            "SELECT body, seq FROM projections WHERE run_id = ?1",
            [id],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .unwrap();
    (serde_json::from_str(&json).unwrap(), seq)
}

/// The sequence number the stored projection holds, and the one its row says it reaches.
fn raw_projection(dir: &std::path::Path, id: &str) -> (u64, u64) {
    let conn = rusqlite::Connection::open(dir.join(".keel/keel.db")).unwrap();
    let (run, seq) = stored_projection(&conn, id);
    (run.seq, seq)
}

#[test]
fn the_projection_is_rewritten_now_and_then_and_reads_fold_the_events_after_it() {
    let (d, mut store) = open();
    let (e, mut run) = created("r1");
    let lease = store.create_run(&e, &run, "me", 0, 1000).unwrap();
    let mut lagged = false;
    let mut caught_up = false;
    for _ in 0..200 {
        let (events, next_run) = next(&run, vec![resumed(1)]);
        store.commit(&lease, &events, &next_run, None, 0).unwrap();
        run = next_run;
        // Every read sees the run as committed, whatever the stored projection reaches.
        assert_eq!(store.run("r1").unwrap(), run);
        let (projected, projection_seq) = raw_projection(d.path(), "r1");
        assert_eq!(
            projected, projection_seq,
            "projection_seq names what it holds"
        );
        if projection_seq < run.seq {
            lagged = true;
        } else if lagged {
            caught_up = true;
        }
        assert!(
            run.seq - projection_seq <= 64 + 1,
            "the projection trails by {} events",
            run.seq - projection_seq
        );
    }
    assert!(lagged, "the projection was rewritten on every commit");
    assert!(caught_up, "the projection was never rewritten");
}

#[test]
fn a_damaged_event_after_the_projection_ends_the_fold_there() {
    let (d, mut store) = open();
    let (e, run) = created("r1");
    let lease = store.create_run(&e, &run, "me", 0, 1000).unwrap();
    let (events, run2) = next(&run, vec![resumed(1)]);
    store.commit(&lease, &events, &run2, None, 0).unwrap();
    let (events, run3) = next(&run2, vec![resumed(1), resumed(1)]);
    store.commit(&lease, &events, &run3, None, 0).unwrap();
    // The projection was written with the run and trails it now.
    assert!(raw_projection(d.path(), "r1").1 < run3.seq - 1);
    let conn = rusqlite::Connection::open(d.path().join(".keel/keel.db")).unwrap();
    keel_store::log::rewrite_stored(&conn, "r1", run3.seq, |events| {
        events.last_mut().unwrap().body = "{".into();
    })
    .unwrap();
    let read = store.run("r1").unwrap();
    assert_eq!(read.seq, run3.seq - 1, "folded up to the damaged event");
}

/// Commits one artifact with a step's events and returns its hash.
fn commit_artifact(store: &mut Store, id: &str, bytes: &[u8]) -> String {
    let (e, run) = created(id);
    let lease = store.create_run(&e, &run, "me", 0, 1000).unwrap();
    let hash = store.put_artifact(bytes).unwrap();
    let (events, run2) = next(&run, vec![resumed(1)]);
    store.commit(&lease, &events, &run2, None, 0).unwrap();
    hash
}

/// The codec and stored bytes of an artifact kept in the log row of the commit that stored it,
/// and that row's id.
fn stored_blob(dir: &tempfile::TempDir, hash: &str) -> (i64, Vec<u8>) {
    let (_, codec, bytes) = stored_blob_row(dir, hash);
    (codec, bytes)
}

fn stored_blob_row(dir: &tempfile::TempDir, hash: &str) -> (i64, i64, Vec<u8>) {
    let conn = rusqlite_open(dir);
    let mut stmt = conn
        .prepare("SELECT id, blobs FROM log WHERE blobs IS NOT NULL")
        .unwrap();
    let rows: Vec<(i64, Vec<u8>)> = stmt
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    for (id, blobs) in rows {
        for (h, codec, bytes) in keel_store::log::decode_blobs(&blobs).unwrap() {
            if h == hash {
                return (id, codec, bytes);
            }
        }
    }
    panic!("no stored blob {hash}")
}

/// A step's request, the kind of artifact that fills the store: text that repeats itself.
fn request_like() -> Vec<u8> {
    (0..300)
        .map(|i| format!("{{\"role\":\"tool\",\"content\":\"note {i}: the build passes\"}}\n"))
        .collect::<String>()
        .into_bytes()
}

#[test]
fn a_compressible_artifact_is_stored_compressed_and_read_back_whole() {
    let (dir, mut store) = open();
    let text = request_like();
    let hash = commit_artifact(&mut store, "r1", &text);
    let (codec, bytes) = stored_blob(&dir, &hash);
    assert_eq!(codec, keel_store::log::LZ4, "stored as one LZ4 frame");
    assert!(
        bytes.len() * 3 < text.len(),
        "{} of {}",
        bytes.len(),
        text.len()
    );
    assert_eq!(store.read_artifact(&hash, usize::MAX).unwrap(), text);
    assert_eq!(store.read_artifact(&hash, 10).unwrap(), &text[..10]);
    assert!(store.verify_artifact(&hash).unwrap());
    // A short one is kept as it is.
    let short = commit_artifact(&mut store, "r2", b"exit 0");
    assert_eq!(stored_blob(&dir, &short), (0, b"exit 0".to_vec()));
    assert_eq!(store.read_artifact(&short, usize::MAX).unwrap(), b"exit 0");
}

#[test]
fn a_damaged_compressed_artifact_is_reported_and_never_returned() {
    let (dir, mut store) = open();
    let hash = commit_artifact(&mut store, "r1", &request_like());
    let (row, codec, mut bytes) = stored_blob_row(&dir, &hash);
    bytes.truncate(bytes.len() / 2);
    let (blobs, _) = keel_store::log::encode_blobs(&[(hash.clone(), codec, bytes)]);
    rusqlite_open(&dir)
        .execute(
            "UPDATE log SET blobs = ?2 WHERE id = ?1",
            rusqlite::params![row, blobs],
        )
        .unwrap();
    let err = store.read_artifact(&hash, usize::MAX).unwrap_err();
    assert!(
        matches!(&err, StoreError::DamagedBlob { hash: h, .. } if *h == hash),
        "{err}"
    );
    assert!(err.to_string().contains("keel verify-log"), "{err}");
    assert!(!store.verify_artifact(&hash).unwrap());
}

/// A run's requests: the same instructions (words that repeat little, as prose does), then a
/// window of notes that moves on by one each step.
fn requests(n: usize) -> Vec<Vec<u8>> {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut word = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let words = [
            "plan", "verify", "budget", "scope", "tool", "step", "phase", "lease",
        ];
        format!("{}{} ", words[(x % 8) as usize], x % 1000)
    };
    let instructions: String = (0..600).map(|_| word()).collect();
    let notes: Vec<String> = (0..n + 40)
        .map(|_| (0..12).map(|_| word()).collect())
        .collect();
    (0..n)
        .map(|step| {
            let mut text = format!("{{\"system\":\"{instructions}\",\"notes\":[");
            for note in &notes[step..step + 40] {
                text.push_str(&format!("\"{note}\","));
            }
            text.push_str("]}");
            text.into_bytes()
        })
        .collect()
}

#[test]
fn a_series_of_alike_requests_is_stored_against_a_base_and_read_back_whole() {
    let (dir, mut store) = open();
    let (e, run) = created("r1");
    let lease = store.create_run(&e, &run, "me", 0, 1000).unwrap();
    let mut run = run;
    let later = requests(13);
    let requests = &later[..12];
    let mut hashes = Vec::new();
    for (step, request) in requests.iter().enumerate() {
        hashes.push(store.put_artifact_in("r1/request", request).unwrap());
        // Read back while waiting for its commit, as the engine may.
        assert_eq!(
            &store
                .read_run_artifact("r1", &hashes[step], usize::MAX)
                .unwrap(),
            request
        );
        let (events, next_run) = next(&run, vec![resumed(1)]);
        store.commit(&lease, &events, &next_run, None, 0).unwrap();
        run = next_run;
    }
    let (codec, first) = stored_blob(&dir, &hashes[0]);
    assert_eq!(
        codec,
        keel_store::log::LZ4,
        "the first is stored alone: the base"
    );
    for (hash, request) in hashes.iter().zip(requests).skip(1) {
        let (codec, stored) = stored_blob(&dir, hash);
        assert_eq!(codec, keel_store::log::LZ4_BASED);
        assert!(
            stored.len() * 3 < first.len(),
            "{} against {}",
            stored.len(),
            first.len()
        );
        assert_eq!(&store.read_artifact(hash, usize::MAX).unwrap(), request);
        assert_eq!(
            &store.read_run_artifact("r1", hash, 100).unwrap(),
            &request[..100]
        );
        assert!(store.verify_artifact(hash).unwrap());
    }
    let all: std::collections::BTreeSet<String> = hashes.iter().cloned().collect();
    assert_eq!(
        store.unsound_run_artifacts("r1", &all).unwrap(),
        Vec::<String>::new()
    );

    // One that compresses far better than the base is judged by the estimate from the base's
    // ratio, and kept against it within a third of that estimate; it reads back whole.
    let repetitive = b"something else entirely, ".repeat(200);
    let hash = store.put_artifact_in("r1/request", &repetitive).unwrap();
    let (events, next_run) = next(&run, vec![resumed(1)]);
    store.commit(&lease, &events, &next_run, None, 0).unwrap();
    let run = next_run;
    let (codec, stored) = stored_blob(&dir, &hash);
    assert_eq!(codec, keel_store::log::LZ4_BASED);
    let estimate = first.len() * repetitive.len() / requests[0].len();
    assert!(
        stored.len() * 3 <= estimate,
        "{} against {estimate}",
        stored.len()
    );
    assert_eq!(store.read_artifact(&hash, usize::MAX).unwrap(), repetitive);

    // A request unlike the base (the same words backwards: as compressible, little in common)
    // is stored alone, and is the base of those after it.
    let other: Vec<u8> = requests[5].iter().rev().copied().collect();
    let hash = store.put_artifact_in("r1/request", &other).unwrap();
    let (events, next_run) = next(&run, vec![resumed(1)]);
    store.commit(&lease, &events, &next_run, None, 0).unwrap();
    assert_eq!(stored_blob(&dir, &hash).0, keel_store::log::LZ4);

    // Another connection (a resumed run) starts the series afresh: its first is stored alone.
    let mut again = Store::open(&dir.path().join(".keel/keel.db")).unwrap();
    let lease = again
        .acquire("r1", "me", 5000, 1000, false, &|_| false)
        .unwrap();
    let run = again.run("r1").unwrap();
    let hash = again.put_artifact_in("r1/request", &requests[3]).unwrap();
    assert_eq!(hash, hashes[3]);
    let fresh = again.put_artifact_in("r1/request", &later[12]).unwrap();
    let (events, next_run) = next(&run, vec![resumed(lease.token)]);
    again.commit(&lease, &events, &next_run, None, 0).unwrap();
    assert_eq!(
        keel_store::log::decode_blobs(&latest_blobs(&dir))
            .unwrap()
            .iter()
            .map(|b| (b.0.clone(), b.1))
            .collect::<Vec<_>>(),
        vec![
            (hashes[3].clone(), keel_store::log::LZ4),
            (fresh, keel_store::log::LZ4_BASED)
        ],
    );
}

/// The `blobs` column of the newest log row that has one.
fn latest_blobs(dir: &tempfile::TempDir) -> Vec<u8> {
    rusqlite_open(dir)
        .query_row(
            "SELECT blobs FROM log WHERE blobs IS NOT NULL ORDER BY id DESC LIMIT 1",
            [],
            |r| r.get(0),
        )
        .unwrap()
}

#[test]
fn a_damaged_base_is_damage_of_every_request_stored_against_it() {
    let (dir, mut store) = open();
    let (e, run) = created("r1");
    let lease = store.create_run(&e, &run, "me", 0, 1000).unwrap();
    let requests = requests(2);
    let base = store.put_artifact_in("r1/request", &requests[0]).unwrap();
    let based = store.put_artifact_in("r1/request", &requests[1]).unwrap();
    let (events, run2) = next(&run, vec![resumed(1)]);
    store.commit(&lease, &events, &run2, None, 0).unwrap();
    assert_eq!(stored_blob(&dir, &based).0, keel_store::log::LZ4_BASED);
    assert_eq!(
        store.read_artifact(&based, usize::MAX).unwrap(),
        requests[1]
    );

    // One byte of the base's frame changed: the base and the request against it are unsound.
    let (row, codec, mut bytes) = stored_blob_row(&dir, &base);
    let (_, based_codec, based_bytes) = stored_blob_row(&dir, &based);
    let at = bytes.len() / 2;
    bytes[at] ^= 0x20;
    let (blobs, _) = keel_store::log::encode_blobs(&[
        (base.clone(), codec, bytes),
        (based.clone(), based_codec, based_bytes.clone()),
    ]);
    rusqlite_open(&dir)
        .execute(
            "UPDATE log SET blobs = ?2 WHERE id = ?1",
            rusqlite::params![row, blobs],
        )
        .unwrap();
    assert!(!store.verify_artifact(&based).unwrap());
    let all = [base.clone(), based.clone()].into_iter().collect();
    let mut bad = store.unsound_run_artifacts("r1", &all).unwrap();
    bad.sort();
    let mut expected = vec![base.clone(), based.clone()];
    expected.sort();
    assert_eq!(bad, expected);

    // The base gone from the row: the request against it says which base it misses.
    let (blobs, _) = keel_store::log::encode_blobs(&[(based.clone(), based_codec, based_bytes)]);
    rusqlite_open(&dir)
        .execute(
            "UPDATE log SET blobs = ?2 WHERE id = ?1",
            rusqlite::params![row, blobs],
        )
        .unwrap();
    let err = store.read_artifact(&based, usize::MAX).unwrap_err();
    assert!(
        matches!(&err, StoreError::DamagedBlob { hash: h, .. } if *h == based)
            && err.to_string().contains(&base),
        "{err}"
    );
}

#[test]
fn a_contract_is_stored_with_the_run_that_names_it_and_only_once() {
    let (dir, mut store) = open();
    let contracts = |dir: &tempfile::TempDir| -> i64 {
        rusqlite_open(dir)
            .query_row("SELECT count(*) FROM contracts", [], |r| r.get(0))
            .unwrap()
    };
    store.put_contract("c1", "keel.toml", "[task]").unwrap();
    // Waiting for the commit that creates the run: not stored yet.
    assert_eq!(store.contract("c1").unwrap(), None);
    assert_eq!(contracts(&dir), 0);
    let (e, run) = created("r1");
    store.create_run(&e, &run, "a", 0, 1000).unwrap();
    assert_eq!(
        store.contract("c1").unwrap(),
        Some(("keel.toml".to_string(), "[task]".to_string()))
    );
    // A second run of the same contract finds it stored and writes nothing more.
    store.put_contract("c1", "keel.toml", "[task]").unwrap();
    let (e, run) = created("r2");
    store.create_run(&e, &run, "a", 0, 1000).unwrap();
    assert_eq!(contracts(&dir), 1);
    // A creation that is refused (the run exists) leaves the contract waiting for the next.
    store.put_contract("c2", "other.toml", "[task] x").unwrap();
    let (e, run) = created("r1");
    assert!(store.create_run(&e, &run, "a", 0, 1000).is_err());
    assert_eq!(store.contract("c2").unwrap(), None);
    let (e, run) = created("r3");
    store.create_run(&e, &run, "a", 0, 1000).unwrap();
    assert!(store.contract("c2").unwrap().is_some());
}

#[test]
fn the_last_events_and_the_release_of_the_lease_are_one_commit() {
    let (_d, mut store) = open();
    let (e, run) = created("r1");
    let lease = store.create_run(&e, &run, "a", 0, 1000).unwrap();
    assert_eq!(store.lease_info("r1").unwrap().holder.as_deref(), Some("a"));
    let (events, run2) = next(&run, vec![resumed(1)]);
    store
        .commit_and_release(&lease, &events, &run2, None)
        .unwrap();
    assert_eq!(store.log_head("r1").unwrap().0, 2);
    let info = store.lease_info("r1").unwrap();
    assert_eq!((info.holder, info.until_ms), (None, 0));
    // Another holder takes it at once; the old lease can neither write nor release it.
    let new = store
        .acquire("r1", "b", 10, 1000, false, &|_| false)
        .unwrap();
    let (more, run3) = next(&run2, vec![resumed(2)]);
    let err = store
        .commit_and_release(&lease, &more, &run3, None)
        .unwrap_err();
    assert!(matches!(err, StoreError::LeaseLost { .. }), "{err}");
    assert_eq!(store.lease_info("r1").unwrap().holder.as_deref(), Some("b"));
    // With nothing to append, it gives the lease back alone.
    store.commit_and_release(&new, &[], &run2, None).unwrap();
    assert_eq!(store.lease_info("r1").unwrap().holder, None);
    assert_eq!(store.log_head("r1").unwrap().0, 2);
}

/// Found when `keel run` and a `keel status` polling for it opened a new store at the same
/// moment: both read schema version 0 before either wrote, and the second to take the write
/// lock created the tables again ("table contracts already exists"), so `keel run` failed
/// before it started its run. Each migration now reads the version again under the lock.
#[test]
fn processes_opening_a_new_store_at_once_all_open_it() {
    for round in 0..20 {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keel.db");
        let start = std::sync::Barrier::new(6);
        let opened: Vec<Result<(), String>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..6)
                .map(|_| {
                    s.spawn(|| {
                        start.wait();
                        Store::open(&path).map(drop).map_err(|e| e.to_string())
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for r in opened {
            assert_eq!(r, Ok(()), "round {round}");
        }
        let store = Store::open(&path).unwrap();
        assert!(
            matches!(store.resolve_run("none"), Err(StoreError::NoSuchRun(_))),
            "the schema is whole"
        );
    }
}

/// A run of one agent phase, created and executing in `store`: its lease and projection.
fn executing_agent_run(store: &mut Store, id: &str) -> (keel_store::Lease, Run) {
    let (mut e, _) = created(id);
    if let EventBody::RunCreated { phases, .. } = &mut e.body {
        phases[0].commands.clear();
        phases[0].agent = true;
    }
    let run = Run::create(&e).unwrap();
    let lease = store.create_run(&e, &run, "me", 0, 1000).unwrap();
    let (events, executing) = next(
        &run,
        vec![
            EventBody::CheckpointTaken {
                n: 0,
                hash: "h".into(),
                snapshot_ref: "r".into(),
                commit: "c".into(),
            },
            EventBody::StateChanged {
                from: keel_core::state::RunState::Planned,
                to: keel_core::state::RunState::Executing,
                reason: "go".into(),
                block: None,
            },
        ],
    );
    store.commit(&lease, &events, &executing, None, 0).unwrap();
    (lease, executing)
}

/// One whole agent step in as few events as a step can have: started and failed. (With
/// the projection written every 64 events plus half the steps it holds, steps this short are
/// more than it keeps between two writes.)
fn agent_step(run: &Run) -> (Vec<Event>, Run) {
    let keel_core::run::Next::Step(step) = run.next() else {
        panic!("expected a step, got {:?}", run.next())
    };
    next(
        run,
        vec![
            EventBody::StepStarted {
                step,
                attempt: 1,
                command: format!("agent step {}", step.index),
                agent: true,
            },
            EventBody::StepFailed {
                step,
                reason: "refused".into(),
                error_fingerprint: format!("e{}", step.index),
                excerpt: String::new(),
                rolled_back: vec![],
                kept: true,
            },
        ],
    )
}

/// The stored projection and its `seq`, and the `budgets` and `steps` rows of run `id`.
#[allow(clippy::type_complexity)]
fn projection_and_tables(
    dir: &std::path::Path,
    id: &str,
) -> (
    Run,
    u64,
    Vec<(String, u64, Option<u64>)>,
    std::collections::BTreeMap<u32, (String, u32)>,
) {
    let conn = rusqlite::Connection::open(dir.join(".keel/keel.db")).unwrap();
    let (projection, seq) = stored_projection(&conn, id);
    let budgets = conn
        .prepare("SELECT name, used, lim FROM budgets WHERE run_id = ?1 ORDER BY name")
        .unwrap()
        .query_map([id], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
        .unwrap()
        .collect::<Result<Vec<_>, _>>()
        .unwrap();
    let steps = conn
        .prepare("SELECT idx, state, attempts FROM steps WHERE run_id = ?1 AND phase = 0")
        .unwrap()
        .query_map([id], |r| Ok((r.get(0)?, (r.get(1)?, r.get(2)?))))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    (projection, seq, budgets, steps)
}

/// The `steps` and `budgets` tables describe the run as of its stored projection: they are
/// written with it (not at every commit, which would write two more pages a step), and every
/// agent step's row is written before the projection lets the step go, so that the table still
/// holds every step the run has had, whichever process wrote it.
#[test]
fn the_steps_and_budgets_rows_are_written_with_the_projection_and_before_a_step_is_let_go() {
    let (d, mut store) = open();
    let (lease, mut run) = executing_agent_run(&mut store, "r1");
    let mut lagged = 0;
    for n in 0..120 {
        if n == 50 {
            // A new process knows nothing of what the last wrote: it reads the rows back.
            drop(store);
            store = Store::open(&d.path().join(".keel/keel.db")).unwrap();
        }
        let (events, after) = agent_step(&run);
        store.commit(&lease, &events, &after, None, 0).unwrap();
        run = after;
        let (projection, seq, budgets, steps) = projection_and_tables(d.path(), "r1");
        assert_eq!(projection.seq, seq);
        if seq < run.seq {
            lagged += 1;
        }
        // The budgets' rows are the stored projection's.
        let expected: Vec<(String, u64, Option<u64>)> = {
            let mut b: Vec<_> = keel_core::budget::BudgetName::ALL
                .iter()
                .map(|n| {
                    (
                        n.as_str().to_string(),
                        projection.used(*n),
                        projection.limits.get(*n),
                    )
                })
                .collect();
            b.sort();
            b
        };
        assert_eq!(budgets, expected, "after step {}", run.seq);
        // The steps the stored projection holds have its rows; every step it let go has a row,
        // settled (these steps fail).
        let phase = &projection.phases[0];
        for (i, s) in phase.held_steps() {
            assert_eq!(
                steps.get(&i),
                Some(&(s.state.as_str().to_string(), s.attempts)),
                "step {i}"
            );
        }
        for i in 0..phase.earlier {
            assert_eq!(
                steps.get(&i).map(|(s, _)| s.as_str()),
                Some("failed"),
                "step {i} was let go"
            );
        }
        // The run, read back, is the run as committed whatever the tables reach.
        assert_eq!(store.run("r1").unwrap(), run);
        assert_eq!(
            store.projection_table_problems("r1").unwrap(),
            Vec::<String>::new()
        );
    }
    assert!(run.phases[0].earlier > 60, "the projection let steps go");
    assert!(lagged > 60, "the rows were written at every commit");
    // Every step the run let go has its row.
    let (_, _, _, steps) = projection_and_tables(d.path(), "r1");
    for i in 0..run.phases[0].earlier {
        assert_eq!(steps.get(&i).map(|(s, _)| s.as_str()), Some("failed"));
    }
    // A change of state writes the projection and the rows as they are now.
    let (events, done) = next(
        &run,
        vec![EventBody::StateChanged {
            from: keel_core::state::RunState::Executing,
            to: keel_core::state::RunState::Verifying,
            reason: "finish".into(),
            block: None,
        }],
    );
    store.commit(&lease, &events, &done, None, 0).unwrap();
    let (projection, seq, budgets, steps) = projection_and_tables(d.path(), "r1");
    assert_eq!((projection.seq, seq), (done.seq, done.seq));
    let used_steps = budgets.iter().find(|(n, _, _)| n == "steps").map(|b| b.1);
    assert_eq!(used_steps, Some(120));
    assert_eq!(steps.len(), 120);
    assert!(steps.values().all(|(s, a)| s == "failed" && *a == 1));
}

/// The check of the projection tables finds a row that does not hold what the projection says,
/// and a let-go step whose row is missing.
#[test]
fn a_projection_table_row_that_differs_is_found() {
    let (d, mut store) = open();
    let (lease, mut run) = executing_agent_run(&mut store, "r1");
    for _ in 0..60 {
        let (events, after) = agent_step(&run);
        store.commit(&lease, &events, &after, None, 0).unwrap();
        run = after;
    }
    assert!(store.projection_table_problems("r1").unwrap().is_empty());
    let conn = rusqlite::Connection::open(d.path().join(".keel/keel.db")).unwrap();
    conn.execute(
        "UPDATE budgets SET used = used + 1 WHERE run_id = 'r1' AND name = 'steps'",
        [],
    )
    .unwrap();
    conn.execute("DELETE FROM steps WHERE run_id = 'r1' AND idx = 3", [])
        .unwrap();
    let problems = store.projection_table_problems("r1").unwrap();
    assert_eq!(problems.len(), 2, "{problems:?}");
    assert!(problems[0].starts_with("budget steps:"), "{problems:?}");
    assert!(problems[1].starts_with("step 0.3: let go"), "{problems:?}");
}

/// The ids of run `id`'s log rows by their links, newest first, as stored.
fn linked_rows(db: &rusqlite::Connection, id: &str) -> Vec<i64> {
    let mut out = Vec::new();
    let mut next: Option<i64> = db
        .query_row("SELECT last_log FROM runs WHERE id = ?1", [id], |r| {
            r.get(0)
        })
        .unwrap();
    while let Some(row) = next {
        out.push(row);
        next = db
            .query_row("SELECT prev FROM log WHERE id = ?1", [row], |r| r.get(0))
            .unwrap();
    }
    out
}

#[test]
fn runs_committing_by_turns_each_find_their_own_rows_by_their_links() {
    let (dir, mut store) = open();
    let mut runs = Vec::new();
    for id in ["r1", "r2", "r3"] {
        let (e, run) = created(id);
        let lease = store.create_run(&e, &run, "me", 0, 1000).unwrap();
        runs.push((lease, run));
    }
    // Their commits alternate, each of one to three events, so their rows interleave.
    for round in 0..6 {
        for (i, (lease, run)) in runs.iter_mut().enumerate() {
            let n = 1 + (round + i) % 3;
            let (events, next_run) = next(run, (0..n).map(|_| resumed(1)).collect());
            store.commit(lease, &events, &next_run, None, 0).unwrap();
            *run = next_run;
        }
    }
    let db = rusqlite_open(&dir);
    let indexes: i64 = db
        .query_row(
            "SELECT count(*) FROM sqlite_schema WHERE type = 'index' AND tbl_name = 'log'",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(indexes, 0, "a commit writes no index of the log");
    for (lease, run) in &runs {
        let id = &lease.run_id;
        let stored = store.events_from(id, 1).unwrap();
        assert_eq!(
            stored.iter().map(|e| e.seq).collect::<Vec<_>>(),
            (1..=run.seq).collect::<Vec<_>>()
        );
        assert_eq!(verify_chain(None, &stored), Ok(run.seq));
        assert!(stored.iter().all(|e| &e.run_id == id));
        assert_eq!(store.events_from(id, 7).unwrap(), stored[6..]);
        assert_eq!(store.event(id, 5).unwrap().as_ref(), Some(&stored[4]));
        assert_eq!(store.event(id, run.seq + 1).unwrap(), None);
        // The links reach every row of the run, newest first, and no other run's.
        let linked = linked_rows(&db, id);
        let mut all: Vec<i64> = db
            .prepare("SELECT id FROM log WHERE run_id = ?1 ORDER BY id DESC")
            .unwrap()
            .query_map([id], |r| r.get(0))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap();
        assert_eq!(linked, all);
        all.sort();
        assert_eq!(all.len(), 7, "its creation and six commits");
        assert!(store.unsound_log_rows(id).unwrap().is_empty());
    }
}

/// A store with run `r1` in four log rows: events 1, 2-3, 4-5 and 6-7.
fn four_rows_of_r1() -> tempfile::TempDir {
    let (dir, mut store) = open();
    let (e, run) = created("r1");
    let lease = store.create_run(&e, &run, "me", 0, 1000).unwrap();
    let mut run = run;
    for _ in 0..3 {
        let (events, next_run) = next(&run, vec![resumed(1), resumed(1)]);
        store.commit(&lease, &events, &next_run, None, 0).unwrap();
        run = next_run;
    }
    dir
}

#[test]
fn a_broken_link_of_the_log_is_damage_where_the_events_go_missing_not_a_shorter_log() {
    let dir = four_rows_of_r1();
    let (e2, other) = created("r2");
    let mut store = Store::open(&dir.path().join(".keel/keel.db")).unwrap();
    store.create_run(&e2, &other, "me", 0, 1000).unwrap();
    drop(store);
    let db = rusqlite_open(&dir);
    // Rows of events 1, 2-3, 4-5, 6-7; the third names a row that is not there.
    let rows = linked_rows(&db, "r1");
    assert_eq!(rows.len(), 4);
    db.execute("UPDATE log SET prev = 9999 WHERE id = ?1", [rows[1]])
        .unwrap();
    let store = Store::open(&dir.path().join(".keel/keel.db")).unwrap();
    let stored = store.events_from("r1", 1).unwrap();
    assert_eq!(stored[0].seq, 1);
    assert_eq!(stored[0].kind, keel_store::UNREADABLE);
    assert!(
        stored[0].body.contains(
            "the log's row of events 4-5 names row 9999 as the one before it, which is not there"
        ),
        "{}",
        stored[0].body
    );
    assert_eq!(
        stored[1..].iter().map(|e| e.seq).collect::<Vec<_>>(),
        [4, 5, 6, 7]
    );
    assert!(matches!(
        verify_chain(None, &stored),
        Err(ChainProblem::Unreadable { seq: 1, .. })
    ));
    let bad = store.unsound_log_rows("r1").unwrap();
    assert_eq!(bad.len(), 1, "{bad:?}");
    assert!(bad[0].contains("names row 9999"), "{bad:?}");
    // What comes after the break reads as it is; the events before it are damage.
    assert_eq!(store.events_from("r1", 5).unwrap()[0].seq, 5);
    assert_eq!(
        store.event("r1", 2).unwrap().unwrap().kind,
        keel_store::UNREADABLE
    );

    // A link to another run's row, or to a newer row, is as broken.
    let first_read_after_linking = |prev: i64| {
        db.execute(
            "UPDATE log SET prev = ?2 WHERE id = ?1",
            rusqlite::params![rows[1], prev],
        )
        .unwrap();
        store.events_from("r1", 1).unwrap().remove(0)
    };
    let theirs: i64 = db
        .query_row("SELECT last_log FROM runs WHERE id = 'r2'", [], |r| {
            r.get(0)
        })
        .unwrap();
    for (prev, why) in [
        (theirs, "which is another run's"),
        (rows[0], "which is not older"),
    ] {
        let first = first_read_after_linking(prev);
        assert!(first.body.contains(why), "{}", first.body);
    }

    // A run whose newest link skips its newest row: the log reads shorter, and the check of
    // its rows finds the row left out.
    first_read_after_linking(rows[2]);
    db.execute("UPDATE runs SET last_log = ?1 WHERE id = 'r1'", [rows[1]])
        .unwrap();
    let bad = store.unsound_log_rows("r1").unwrap();
    assert_eq!(
        bad,
        [
            "1 of the log's 4 rows of this run are not linked from its newest: their events are not read"
        ]
    );

    // The run's own link to a row that is not there: none of its events can be found.
    db.execute(
        "UPDATE log SET prev = ?2 WHERE id = ?1",
        rusqlite::params![rows[1], rows[2]],
    )
    .unwrap();
    db.execute("UPDATE runs SET last_log = 9999 WHERE id = 'r1'", [])
        .unwrap();
    let stored = store.events_from("r1", 1).unwrap();
    assert_eq!(stored.len(), 1);
    assert!(
        stored[0]
            .body
            .contains("the run names row 9999 as its log's newest, which is not there"),
        "{}",
        stored[0].body
    );
}

#[test]
fn a_log_row_removed_whole_leaves_a_gap_and_the_rows_before_it_linked() {
    let dir = four_rows_of_r1();
    let db = rusqlite_open(&dir);
    // The row of events 4-5 in the middle, then the newest, of 6-7.
    for seq in [4, 6] {
        assert!(keel_store::log::rewrite_stored(&db, "r1", seq, |events| events.clear()).unwrap());
    }
    assert_eq!(linked_rows(&db, "r1").len(), 2);
    let store = Store::open(&dir.path().join(".keel/keel.db")).unwrap();
    let stored = store.events_from("r1", 1).unwrap();
    assert_eq!(stored.iter().map(|e| e.seq).collect::<Vec<_>>(), [1, 2, 3]);
    assert_eq!(verify_chain(None, &stored), Ok(3));
    assert!(!keel_store::log::rewrite_stored(&db, "r1", 4, |_| {}).unwrap());
}

#[test]
fn a_read_of_the_log_sees_one_snapshot_while_another_connection_cuts_it() {
    let (dir, mut store) = open();
    let (e, run) = created("r1");
    let lease = store.create_run(&e, &run, "me", 0, 1000).unwrap();
    let mut runs = vec![run.clone()];
    for _ in 0..3 {
        let last = runs.last().unwrap().clone();
        let (events, next_run) = next(&last, vec![resumed(1), resumed(1)]);
        store.commit(&lease, &events, &next_run, None, 0).unwrap();
        runs.push(next_run);
    }
    // The cut of events 4 on, made by another connection while the first reads the log, after
    // it has followed the links and read the first row.
    let mut other = Store::open(&dir.path().join(".keel/keel.db")).unwrap();
    let (cut, rebuilt) = next(
        &runs[1],
        vec![EventBody::TailCut {
            seq: 4,
            reason: "torn".into(),
        }],
    );
    let mut read = Vec::new();
    let mut cut_made = false;
    store
        .for_each_event("r1", 1, |e| {
            if !cut_made {
                other.cut_tail(&lease, 4, &cut, &rebuilt, 0).unwrap();
                cut_made = true;
            }
            read.push(e);
            Ok(())
        })
        .unwrap();
    assert_eq!(
        read.iter().map(|e| e.seq).collect::<Vec<_>>(),
        (1..=7).collect::<Vec<_>>(),
        "the read goes on in the log as it was when it began"
    );
    assert_eq!(verify_chain(None, &read), Ok(7));
    let after = store.events_from("r1", 1).unwrap();
    assert_eq!(
        after.iter().map(|e| e.seq).collect::<Vec<_>>(),
        [1, 2, 3, 4]
    );
    assert_eq!(after[3].kind, "tail_cut");
}
