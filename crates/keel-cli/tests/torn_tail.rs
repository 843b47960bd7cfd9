//! Storage damage: a torn last write is cut back to the last whole event (logged as `tail_cut`)
//! and the run goes on; damage anywhere else makes `verify-log` fail naming the event, and resume
//! refuse (exit 5) without writing anything, however often it is asked. A write-ahead log cut in
//! the middle of its last frame rolls back to the last whole transaction.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::Path;

use common::{
    ALL_LETTERS, Fixture, LETTERS_CONTRACT as CONTRACT, after_step_verified, fault_points,
    killed_at, kinds, state, stderr, stdout,
};
use serde_json::Value;

/// The first fault point after the `n`th (1-based) checkpoint's commit.
fn after_checkpoint(points: &[String], n: usize) -> u64 {
    let snapshot = points
        .iter()
        .enumerate()
        .filter(|(_, p)| *p == "snapshot written")
        .nth(n - 1)
        .map(|(i, _)| i)
        .unwrap_or_else(|| panic!("fewer than {n} checkpoints in {points:?}"));
    let commit = points
        .iter()
        .enumerate()
        .skip(snapshot)
        .find(|(_, p)| *p == "after commit")
        .map(|(i, _)| i)
        .unwrap();
    commit as u64 + 1
}

/// A killed run whose log ends with the `step_verified` of step `k`.
fn killed_after_step(f: &Fixture, k: usize) -> String {
    let n = after_step_verified(&fault_points(CONTRACT), k);
    let id = killed_at(f, n);
    let (_, seq) = counts(f, &id);
    assert_eq!(row(f, &id, seq).kind, "step_verified");
    id
}

/// `(number of events, highest sequence number)` of a run, read from the store directly.
fn counts(f: &Fixture, id: &str) -> (u64, u64) {
    let events = f.stored_events(id);
    (events.len() as u64, events.last().map_or(0, |e| e.seq))
}

fn rows(f: &Fixture, id: &str) -> Vec<keel_store::StoredEvent> {
    f.stored_events(id)
}

fn row(f: &Fixture, id: &str, seq: u64) -> keel_store::StoredEvent {
    rows(f, id)
        .into_iter()
        .find(|r| r.seq == seq)
        .unwrap_or_else(|| panic!("no event {seq}"))
}

/// Cuts an event's body in half, as a torn write would leave it.
fn garble(f: &Fixture, id: &str, seq: u64) {
    f.tamper(id, seq, |e| {
        let mut half = e.body.len() / 2;
        while !e.body.is_char_boundary(half) {
            half -= 1;
        }
        e.body.truncate(half);
    });
}

fn set_hash(f: &Fixture, id: &str, seq: u64, hash: &str) {
    f.tamper(id, seq, |e| e.hash = hash.to_string());
}

/// Replaces an event's body and gives it the hash that body would have: the event is
/// consistent in itself, and only the chain can tell.
fn rewrite_with_hash(f: &Fixture, id: &str, seq: u64, body: &str) {
    f.tamper(id, seq, |e| {
        e.body = body.to_string();
        e.hash = e.computed_hash();
    });
}

/// The sequence number of the newest checkpoint's `checkpoint_taken` event.
fn newest_checkpoint_event(f: &Fixture, id: &str) -> u64 {
    let seq: u64 = f
        .db()
        .query_row(
            "SELECT seq FROM checkpoints WHERE run_id = ?1 ORDER BY n DESC LIMIT 1",
            [id],
            |r| r.get(0),
        )
        .unwrap();
    seq + 1
}

/// verify-log fails (exit 5), says DAMAGED and names `needle` (an event number phrase).
fn expect_damaged(f: &Fixture, id: &str, needle: &str) {
    let out = f.expect(&["verify-log", id], 5);
    let text = stdout(&out);
    assert!(
        text.contains("DAMAGED") && text.contains(needle),
        "verify-log should report DAMAGED and `{needle}`\n{}",
        f.explain(&out)
    );
    let out = f.expect(&["verify-log", id, "--json"], 5);
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    let problems = report["problems"].as_array().unwrap();
    assert!(
        problems
            .iter()
            .any(|p| p.as_str().unwrap_or("").contains(needle)),
        "verify-log --json problems should name `{needle}`: {report}"
    );
}

/// The run completed with every letter written once, its log verifies, and it holds exactly
/// one `tail_cut` at `cut_seq` with nothing missing around it.
fn expect_completed_after_cut(f: &Fixture, id: &str, cut_seq: u64) {
    assert_eq!(state(&f.status(id)), "completed");
    f.verify_log_ok(id);
    assert_eq!(
        std::fs::read_to_string(f.path("marker.txt")).unwrap(),
        ALL_LETTERS,
        "every step's change is in the workspace exactly once"
    );
    let events = f.events(id);
    let cuts: Vec<&Value> = events.iter().filter(|e| e["kind"] == "tail_cut").collect();
    assert_eq!(cuts.len(), 1, "one tail_cut: {:?}", kinds(&events));
    assert_eq!(
        cuts[0]["seq"], cut_seq,
        "the tail_cut takes the torn event's place"
    );
    assert_eq!(cuts[0]["body"]["seq"], cut_seq);
    let seqs: Vec<u64> = events.iter().map(|e| e["seq"].as_u64().unwrap()).collect();
    let contiguous: Vec<u64> = (1..=seqs.len() as u64).collect();
    assert_eq!(seqs, contiguous, "sequence numbers stay contiguous");
    let text = stdout(&f.expect(&["log", id], 0));
    assert!(
        text.contains("tail_cut"),
        "the text log shows the cut\n{text}"
    );
}

#[test]
fn a_garbled_last_event_is_cut_and_the_run_completes() {
    let f = Fixture::new(CONTRACT);
    let id = killed_after_step(&f, 2);
    let (count, last) = counts(&f, &id);
    garble(&f, &id, last);
    expect_damaged(&f, &id, &format!("event {last}"));

    let out = f.expect(&["resume", &id], 0);
    assert!(stdout(&out).contains("completed"), "{}", f.explain(&out));
    expect_completed_after_cut(&f, &id, last);
    // The events before the torn one are untouched.
    let after = rows(&f, &id);
    assert!(after.len() as u64 > count);
    assert_eq!(after[last as usize - 1].kind, "tail_cut");
}

#[test]
fn a_last_event_with_an_altered_hash_is_cut_and_the_run_completes() {
    let f = Fixture::new(CONTRACT);
    let id = killed_after_step(&f, 2);
    let (_, last) = counts(&f, &id);
    let before = row(&f, &id, last - 1);
    set_hash(&f, &id, last, &"f".repeat(64));
    expect_damaged(&f, &id, &format!("event {last}"));

    f.expect(&["resume", &id], 0);
    expect_completed_after_cut(&f, &id, last);
    assert_eq!(
        row(&f, &id, last - 1),
        before,
        "the last whole event is kept as it was"
    );
    assert_eq!(row(&f, &id, last).prev_hash, before.hash);
}

#[test]
fn an_undecodable_last_event_with_a_matching_hash_is_cut() {
    let f = Fixture::new(CONTRACT);
    let id = killed_after_step(&f, 1);
    let (_, last) = counts(&f, &id);
    rewrite_with_hash(&f, &id, last, "{\"kind\":\"step_ver");
    expect_damaged(&f, &id, &format!("event {last}"));

    f.expect(&["resume", &id], 0);
    expect_completed_after_cut(&f, &id, last);
}

#[test]
fn a_torn_checkpoint_event_falls_back_to_the_previous_checkpoint() {
    let f = Fixture::new(CONTRACT);
    // Killed right after checkpoint 1 (the end of phase one) was committed, with the events
    // stored after it in the same commit; the log is made to end torn in that event.
    let id = killed_at(&f, after_checkpoint(&fault_points(CONTRACT), 2));
    let last = newest_checkpoint_event(&f, &id);
    assert_eq!(row(&f, &id, last).kind, "checkpoint_taken");
    f.remove_events(&id, |seq| seq > last);
    garble(&f, &id, last);

    f.expect(&["resume", &id], 0);
    expect_completed_after_cut(&f, &id, last);
    let out = f.expect(&["checkpoints", &id, "--json"], 0);
    let checkpoints: Value = serde_json::from_slice(&out.stdout).unwrap();
    let ns: Vec<u64> = checkpoints
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["n"].as_u64().unwrap())
        .collect();
    assert_eq!(ns, [0, 1, 2], "checkpoint 1 is taken again after the cut");
}

/// What resume must do with damage that is not the last event: refuse with exit 5, name the
/// event, write no event, and go on refusing.
fn expect_resume_refused(f: &Fixture, id: &str, event: u64) {
    let before = rows(f, id);
    let state_before = state(&f.status(id)).to_string();
    for attempt in 1..=2 {
        let out = f.expect(&["resume", id], 5);
        let err = stderr(&out);
        assert!(
            err.contains("damaged") && err.contains(&format!("event {event}")),
            "resume attempt {attempt} should say the log is damaged at event {event}\n{}",
            f.explain(&out)
        );
        assert_eq!(
            rows(f, id),
            before,
            "resume attempt {attempt} must not change the log (no silent repair)"
        );
        assert_eq!(state(&f.status(id)), state_before);
        expect_damaged(f, id, &format!("event {event}"));
    }
    assert!(!f.events(id).iter().any(|e| e["kind"] == "tail_cut"));
}

#[test]
fn a_damaged_event_in_the_middle_after_the_checkpoint_stops_resume() {
    let f = Fixture::new(CONTRACT);
    let id = killed_after_step(&f, 3);
    let (_, last) = counts(&f, &id);
    let damaged = last - 2;
    assert!(
        damaged > newest_checkpoint_event(&f, &id),
        "the damage lies after the newest checkpoint"
    );
    garble(&f, &id, damaged);
    expect_resume_refused(&f, &id, damaged);
}

#[test]
fn an_altered_hash_in_the_middle_stops_resume() {
    let f = Fixture::new(CONTRACT);
    let id = killed_after_step(&f, 3);
    let (_, last) = counts(&f, &id);
    let damaged = last - 3;
    assert!(damaged > newest_checkpoint_event(&f, &id));
    set_hash(&f, &id, damaged, &"0".repeat(64));
    expect_resume_refused(&f, &id, damaged);
}

#[test]
fn a_rewritten_event_with_a_recomputed_hash_breaks_the_chain() {
    let f = Fixture::new(CONTRACT);
    let id = killed_after_step(&f, 3);
    let (_, last) = counts(&f, &id);
    // The second to last event becomes a different, well-formed event with its own valid hash;
    // the last event no longer links to it.
    let damaged = last - 1;
    assert!(damaged > newest_checkpoint_event(&f, &id));
    let r = row(&f, &id, damaged);
    assert_eq!(r.kind, "step_finished");
    let forged = r.body.replacen("\"exit 0\"", "\"exit 7\"", 1);
    assert_ne!(forged, r.body);
    rewrite_with_hash(&f, &id, damaged, &forged);
    expect_resume_refused(&f, &id, last);
}

#[test]
fn a_damaged_checkpoint_event_after_the_checkpoint_stops_resume() {
    let f = Fixture::new(CONTRACT);
    let id = killed_after_step(&f, 2);
    let damaged = newest_checkpoint_event(&f, &id);
    assert_eq!(row(&f, &id, damaged).kind, "checkpoint_taken");
    let (_, last) = counts(&f, &id);
    assert!(damaged < last);
    garble(&f, &id, damaged);
    expect_resume_refused(&f, &id, damaged);
}

#[test]
fn a_damaged_event_before_a_checkpoint_fails_verify_log() {
    let f = Fixture::new(CONTRACT);
    let (id, out) = f.start(&[]);
    assert_eq!(out.status.code(), Some(0), "{}", f.explain(&out));
    f.verify_log_ok(&id);
    let checkpoint_events: Vec<u64> = rows(&f, &id)
        .iter()
        .filter(|r| r.kind == "checkpoint_taken")
        .map(|r| r.seq)
        .collect();
    assert!(checkpoint_events.len() >= 3);
    // An event of phase one, before checkpoint 1 (and 2).
    let damaged = checkpoint_events[0] + 3;
    assert!(damaged < checkpoint_events[1]);
    garble(&f, &id, damaged);
    expect_damaged(&f, &id, &format!("event {damaged}"));

    // The same with the chain broken at the very first event.
    let f = Fixture::new(CONTRACT);
    let (id, _) = f.start(&[]);
    set_hash(&f, &id, 1, &"e".repeat(64));
    expect_damaged(&f, &id, "event 1");
}

#[test]
fn a_deleted_event_in_the_middle_is_reported_as_a_gap() {
    let f = Fixture::new(CONTRACT);
    let id = killed_after_step(&f, 3);
    let (count, last) = counts(&f, &id);
    let missing = last - 2;
    assert!(missing > newest_checkpoint_event(&f, &id));
    f.remove_events(&id, |seq| seq == missing);
    assert_eq!(counts(&f, &id), (count - 1, last));
    let gap = format!("event {} follows where {missing} was expected", missing + 1);
    expect_damaged(&f, &id, &gap);
    expect_resume_refused(&f, &id, missing + 1);

    // A gap before the newest checkpoint of a completed run is found by verify-log too.
    let f = Fixture::new(CONTRACT);
    let (id, _) = f.start(&[]);
    f.remove_events(&id, |seq| seq == 5);
    expect_damaged(&f, &id, "event 6 follows where 5 was expected");
}

fn events_in_copy(db: &Path, wal: &Path, id: &str) -> u64 {
    let scratch = tempfile::tempdir().unwrap();
    std::fs::copy(db, scratch.path().join("keel.db")).unwrap();
    std::fs::copy(wal, scratch.path().join("keel.db-wal")).unwrap();
    let conn = rusqlite::Connection::open(scratch.path().join("keel.db")).unwrap();
    let mut stmt = conn
        .prepare("SELECT codec, events FROM log WHERE run_id = ?1")
        .unwrap();
    stmt.query_map([id], |r| Ok((r.get::<_, i64>(0)?, r.get::<_, Vec<u8>>(1)?)))
        .unwrap()
        .map(|row| {
            let (codec, bytes) = row.unwrap();
            keel_store::log::decode_events(id, codec, &bytes)
                .unwrap()
                .len() as u64
        })
        .sum()
}

#[test]
fn a_wal_cut_in_its_last_frame_rolls_back_to_the_last_whole_transaction() {
    let f = Fixture::new(CONTRACT);
    let id = killed_at(&f, after_step_verified(&fault_points(CONTRACT), 2));
    // Nothing has opened the store since the kill, so the write-ahead log still holds the
    // run's transactions and its last frame is the commit of the last one.
    let db = f.path(".keel/keel.db");
    let wal = f.path(".keel/keel.db-wal");
    let bytes = std::fs::read(&wal).unwrap();
    assert!(bytes.len() > 32, "the WAL holds frames");
    let page = u64::from(u32::from_be_bytes(bytes[8..12].try_into().unwrap()));
    let frame = 24 + page;
    let len = bytes.len() as u64;
    assert_eq!((len - 32) % frame, 0, "the WAL is made of whole frames");
    assert!((len - 32) / frame >= 2);
    let whole = events_in_copy(&db, &wal, &id);

    let cut = len - page / 2;
    std::fs::OpenOptions::new()
        .write(true)
        .open(&wal)
        .unwrap()
        .set_len(cut)
        .unwrap();

    f.verify_log_ok(&id);
    let (after_cut, last) = counts(&f, &id);
    assert!(
        after_cut < whole,
        "the torn last transaction is gone ({after_cut} events of {whole} remain)"
    );
    assert_eq!(after_cut, last);

    f.expect(&["resume", &id], 0);
    assert_eq!(state(&f.status(&id)), "completed");
    f.verify_log_ok(&id);
    assert_eq!(
        std::fs::read_to_string(f.path("marker.txt")).unwrap(),
        ALL_LETTERS
    );
}

#[test]
fn a_torn_completion_event_is_cut_on_resume() {
    // The last write of a finished run is the one that says `completed`. If it is torn, the log
    // no longer says the run completed: resume must notice, cut it and finish the run again
    // (status may not go on showing `completed` on the strength of a torn event).
    let f = Fixture::new(CONTRACT);
    let (id, out) = f.start(&[]);
    assert_eq!(out.status.code(), Some(0), "{}", f.explain(&out));
    let (_, last) = counts(&f, &id);
    assert_eq!(row(&f, &id, last).kind, "state_changed");
    garble(&f, &id, last);
    expect_damaged(&f, &id, &format!("event {last}"));

    let out = f.expect(&["resume", &id], 0);
    assert!(stdout(&out).contains("completed"), "{}", f.explain(&out));
    expect_completed_after_cut(&f, &id, last);
}

#[test]
fn a_missing_last_event_is_cut_back_to_the_last_whole_event() {
    // The last event is gone altogether (the projection still counts it): the log ends at the
    // last whole event, and the run goes on from there.
    let f = Fixture::new(CONTRACT);
    let id = killed_after_step(&f, 2);
    let (count, last) = counts(&f, &id);
    f.remove_events(&id, |seq| seq == last);
    assert_eq!(counts(&f, &id), (count - 1, last - 1));

    let out = f.expect(&["resume", &id], 0);
    assert!(stdout(&out).contains("completed"), "{}", f.explain(&out));
    assert_eq!(state(&f.status(&id)), "completed");
    f.verify_log_ok(&id);
    assert_eq!(
        std::fs::read_to_string(f.path("marker.txt")).unwrap(),
        ALL_LETTERS
    );
    let seqs: Vec<u64> = f
        .events(&id)
        .iter()
        .map(|e| e["seq"].as_u64().unwrap())
        .collect();
    assert_eq!(seqs, (1..=seqs.len() as u64).collect::<Vec<_>>());
}

#[test]
fn a_damaged_newest_checkpoint_falls_back_to_an_older_one() {
    let f = Fixture::new(CONTRACT);
    // Killed after step 4 (phase two) was verified: checkpoints 0 and 1 exist.
    let id = killed_after_step(&f, 4);
    let newest: u32 = f
        .db()
        .query_row(
            "SELECT max(n) FROM checkpoints WHERE run_id = ?1",
            [&id],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(newest, 1);
    f.db()
        .execute(
            "UPDATE checkpoints SET body = body || ' ' WHERE run_id = ?1 AND n = 1",
            [&id],
        )
        .unwrap();
    expect_damaged(&f, &id, "checkpoint 1");

    f.expect(&["resume", &id], 0);
    assert_eq!(state(&f.status(&id)), "completed");
    let events = f.events(&id);
    let resumed: Vec<&Value> = events.iter().filter(|e| e["kind"] == "resumed").collect();
    assert_eq!(
        resumed.last().unwrap()["body"]["checkpoint"],
        0,
        "resumed from the newest checkpoint that is intact"
    );
    assert_eq!(
        std::fs::read_to_string(f.path("marker.txt")).unwrap(),
        ALL_LETTERS
    );
    // The damaged checkpoint is not silently repaired: verify-log goes on reporting it.
    expect_damaged(&f, &id, "checkpoint 1");
}

#[test]
fn an_altered_kind_column_fails_verify_log() {
    // `kind` is stored beside the body (and shown by `keel log`); it must agree with the body
    // the hash covers, or the log shows an event that never happened.
    let f = Fixture::new(CONTRACT);
    let (id, out) = f.start(&[]);
    assert_eq!(out.status.code(), Some(0), "{}", f.explain(&out));
    assert_eq!(row(&f, &id, 5).kind, "phase_started");
    f.tamper(&id, 5, |e| e.kind = "migrated".into());
    expect_damaged(&f, &id, "event 5");
}

#[test]
fn a_damaged_run_projection_is_rebuilt_from_the_log() {
    // The runs row is a projection of the log: when it is unreadable, verify-log reports it (as
    // damage, exit 5, not as an internal error) and resume rebuilds it from the checkpoint and
    // the events after it.
    let f = Fixture::new(CONTRACT);
    let id = killed_after_step(&f, 2);
    f.db()
        .execute("UPDATE projections SET body = '{' WHERE run_id = ?1", [&id])
        .unwrap();
    let out = f.expect(&["verify-log", &id], 5);
    assert!(stdout(&out).contains("DAMAGED"), "{}", f.explain(&out));

    let out = f.expect(&["resume", &id], 0);
    assert!(stdout(&out).contains("completed"), "{}", f.explain(&out));
    assert_eq!(state(&f.status(&id)), "completed");
    f.verify_log_ok(&id);
    assert_eq!(
        std::fs::read_to_string(f.path("marker.txt")).unwrap(),
        ALL_LETTERS
    );
}

#[test]
fn a_changed_artifact_fails_verify_log() {
    let f = Fixture::new(CONTRACT);
    let (id, out) = f.start(&[]);
    assert_eq!(out.status.code(), Some(0), "{}", f.explain(&out));
    // A verifier's output is kept with the events that name it: one changed byte there is
    // found too.
    let evidence = &f.status(&id)["evidence"][0];
    let small = evidence["output"].as_str().unwrap().to_string();
    let db = f.db();
    let (row, blobs): (i64, Vec<u8>) = db
        .query_row(
            "SELECT id, blobs FROM log WHERE run_id = ?1 AND instr(blob_hashes, ?2) > 0",
            rusqlite::params![id, small],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .unwrap();
    let mut decoded = keel_store::log::decode_blobs(&blobs).unwrap();
    let blob = decoded.iter_mut().find(|(h, _, _)| *h == small).unwrap();
    assert_eq!(blob.1, 0, "a short output is kept as it is");
    blob.2.push(b'!');
    let (changed, _) = keel_store::log::encode_blobs(&decoded);
    db.execute(
        "UPDATE log SET blobs = ?2 WHERE id = ?1",
        rusqlite::params![row, changed],
    )
    .unwrap();
    expect_damaged(&f, &id, &format!("artifact {small}"));

    // A command's output is a file of its own.
    let f = Fixture::new(CONTRACT);
    let (id, out) = f.start(&[]);
    assert_eq!(out.status.code(), Some(0), "{}", f.explain(&out));
    let finished = f
        .events(&id)
        .into_iter()
        .find(|e| e["kind"] == "step_finished")
        .unwrap();
    let hash = finished["body"]["output"].as_str().unwrap().to_string();
    let path = f.path(&format!(".keel/artifacts/{}/{hash}", &hash[..2]));
    assert!(path.exists(), "artifact at {}", path.display());
    let mut perms = std::fs::metadata(&path).unwrap().permissions();
    #[allow(clippy::permissions_set_readonly_false)]
    perms.set_readonly(false);
    std::fs::set_permissions(&path, perms).unwrap();
    let mut text = std::fs::read(&path).unwrap();
    text.extend_from_slice(b"appended later\n");
    std::fs::write(&path, text).unwrap();
    expect_damaged(&f, &id, &format!("artifact {hash}"));
}

/// The `log` row (a commit of the run) holding event `seq`: its id and first and last events.
fn commit_row(f: &Fixture, id: &str, seq: u64) -> (i64, u64, u64) {
    f.db()
        .query_row(
            "SELECT id, first_seq, last_seq FROM log WHERE run_id = ?1 AND first_seq <= ?2 \
             AND last_seq >= ?2",
            rusqlite::params![id, seq],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )
        .unwrap()
}

/// Makes a commit's stored events unreadable: its compressed frame cut in half.
fn tear_commit(f: &Fixture, row: i64) {
    let changed = f
        .db()
        .execute(
            "UPDATE log SET codec = 1, events = substr(events, 1, length(events) / 2) \
             WHERE id = ?1",
            [row],
        )
        .unwrap();
    assert_eq!(changed, 1);
}

#[test]
fn an_unreadable_last_commit_is_cut_back_to_the_commit_before() {
    let f = Fixture::new(CONTRACT);
    let id = killed_after_step(&f, 2);
    let (_, last) = counts(&f, &id);
    let (row, first, end) = commit_row(&f, &id, last);
    assert_eq!(end, last);
    let before: Vec<_> = rows(&f, &id)
        .into_iter()
        .filter(|e| e.seq < first)
        .collect();
    tear_commit(&f, row);
    expect_damaged(
        &f,
        &id,
        &format!("event {first} and the events stored with it"),
    );

    f.expect(&["resume", &id], 0);
    // The whole torn commit goes: the tail_cut takes its first event's place.
    expect_completed_after_cut(&f, &id, first);
    assert_eq!(
        rows(&f, &id)[..before.len()],
        before[..],
        "the commits before it are kept as they were"
    );
}

#[test]
fn an_unreadable_commit_in_the_middle_stops_resume() {
    let f = Fixture::new(CONTRACT);
    let id = killed_after_step(&f, 3);
    let (_, last) = counts(&f, &id);
    let checkpoint = newest_checkpoint_event(&f, &id);
    // A commit after the checkpoint's and before the last.
    let (row, first, end) = commit_row(&f, &id, last);
    let (middle, middle_first, _) = commit_row(&f, &id, first - 1);
    assert!(middle != row && end == last);
    assert!(
        middle_first > checkpoint,
        "the damage lies after the newest checkpoint"
    );
    tear_commit(&f, middle);
    expect_resume_refused(&f, &id, middle_first);
}
