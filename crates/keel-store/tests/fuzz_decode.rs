//! Bad input to the stored event log: `StoredEvent::decode` and `verify_chain` over events whose
//! columns were altered, torn or made up, and `CheckpointRow::decode` over arbitrary bodies.
//!
//! Each property runs 256 cases by default; set `KEEL_FUZZ_CASES` (for example
//! `KEEL_FUZZ_CASES=100000`) to run more. Nothing is written to the source tree: a failure prints
//! the smallest input it found instead of saving it.
//!
//! What is asserted:
//! - made-up events (any run, sequence number, time, version, kind, body, hashes) never pass the
//!   chain check, and decoding them never panics;
//! - changing any column of any event of a valid chain is caught, at that event;
//! - a body that was changed and then re-hashed (so the chain is intact) passes only if it
//!   decodes to an event of the kind its column names, and then it is a real event;
//! - a refusal names the run and the event;
//! - a stored `log` row (the events of a commit, packed or not, and its artifacts) whose bytes
//!   were flipped, cut, deleted or added to decodes to an error or to events, never a panic or
//!   a read past its end; decoded events that differ from the ones stored never pass the chain
//!   check.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use keel_core::event::{EVENT_VERSION, EventBody, GENESIS_HASH, StepId};
use keel_core::state::RunState;
use keel_store::{ChainProblem, CheckpointRow, StoredEvent, verify_chain};
use keel_test_support::fuzz::{self, ByteEdit};
use keel_test_support::oracle::store::{RUN, check_decode, check_log_row};
use proptest::prelude::*;
use proptest::sample::Index;

fn bodies() -> Vec<EventBody> {
    let step = StepId { phase: 0, index: 0 };
    vec![
        EventBody::Resumed {
            holder: "host:1:2".into(),
            lease: 1,
            checkpoint: None,
        },
        EventBody::StateChanged {
            from: RunState::Planned,
            to: RunState::Executing,
            reason: "started".into(),
            block: None,
        },
        EventBody::PhaseStarted {
            phase: 0,
            name: "build".into(),
        },
        EventBody::StepStarted {
            step,
            attempt: 1,
            command: "make".into(),
            agent: false,
        },
        EventBody::NoteAdded {
            step,
            text: "ünïcode and \"quotes\" and \u{0}".into(),
        },
        EventBody::Frozen {
            reason: "incident".into(),
            by: "ana".into(),
        },
    ]
}

/// Event `seq` of the run, with `body`, linked to the event whose hash is `prev`, as the store
/// writes it.
fn stored(seq: u64, prev: &str, body: &EventBody) -> StoredEvent {
    let mut e = StoredEvent {
        run_id: RUN.to_string(),
        seq,
        at_ms: 1_700_000_000_000 + seq as i64,
        version: EVENT_VERSION,
        kind: body.kind().to_string(),
        body: body.encode(),
        prev_hash: prev.to_string(),
        hash: String::new(),
    };
    e.hash = e.computed_hash();
    e
}

/// A valid chain of events, as the store writes them.
fn chain() -> Vec<StoredEvent> {
    let mut prev = GENESIS_HASH.to_string();
    let mut out = Vec::new();
    for (i, body) in bodies().iter().enumerate() {
        let e = stored(i as u64 + 1, &prev, body);
        prev = e.hash.clone();
        out.push(e);
    }
    out
}

/// Recomputes the hashes from event `from` on, as a writer that altered the log on purpose
/// would: the chain itself is intact again.
fn rehash(events: &mut [StoredEvent], from: usize) {
    for i in from..events.len() {
        if i > 0 {
            events[i].prev_hash = events[i - 1].hash.clone();
        }
        events[i].hash = events[i].computed_hash();
    }
}

/// One change to one column of a stored event.
#[derive(Debug, Clone)]
enum Column {
    RunId(String),
    Seq(u64),
    AtMs(i64),
    Version(u32),
    Kind(String),
    Body(BodyEdit),
    PrevHash(String),
    Hash(String),
}

/// One change to a body: its bytes flipped, cut or added to, or the whole body replaced.
#[derive(Debug, Clone)]
enum BodyEdit {
    Bytes(ByteEdit),
    Replace(String),
}

fn hexish() -> impl Strategy<Value = String> {
    prop_oneof![
        "[0-9a-f]{64}",
        "[0-9a-f]{0,70}",
        ".{0,80}",
        Just(GENESIS_HASH.to_string()),
    ]
}

fn body_edit() -> impl Strategy<Value = BodyEdit> {
    prop_oneof![
        fuzz::flip().prop_map(BodyEdit::Bytes),
        fuzz::truncate().prop_map(BodyEdit::Bytes),
        (
            any::<Index>(),
            prop_oneof![
                Just(" ".to_string()),
                Just(",\"x\":1".to_string()),
                Just("\\u0000".to_string()),
                ".{1,8}"
            ]
        )
            .prop_map(|(i, s)| BodyEdit::Bytes(ByteEdit::Insert(i, s.into_bytes()))),
        prop_oneof![
            Just(String::new()),
            Just("{}".to_string()),
            Just("null".to_string()),
            Just(r#"{"kind":"frozen","reason":"r","by":"b"}"#.to_string()),
            Just(r#"{"kind":"cancelled","reason":"r","by":"b"}"#.to_string()),
            ".{0,40}",
        ]
        .prop_map(BodyEdit::Replace),
    ]
}

fn column() -> impl Strategy<Value = Column> {
    prop_oneof![
        1 => ".{0,40}".prop_map(Column::RunId),
        1 => any::<u64>().prop_map(Column::Seq),
        1 => any::<i64>().prop_map(Column::AtMs),
        1 => any::<u32>().prop_map(Column::Version),
        1 => prop_oneof![
            Just("frozen".to_string()),
            Just("cancelled".to_string()),
            Just(String::new()),
            "[a-z_]{0,20}"
        ]
        .prop_map(Column::Kind),
        3 => body_edit().prop_map(Column::Body),
        1 => hexish().prop_map(Column::PrevHash),
        1 => hexish().prop_map(Column::Hash),
    ]
}

fn edit_body(body: &str, edit: &BodyEdit) -> String {
    match edit {
        BodyEdit::Bytes(edit) => {
            let bytes = fuzz::apply_bytes(body.as_bytes().to_vec(), edit);
            // The column is text: a byte change that breaks UTF-8 is read back as SQLite gives it.
            String::from_utf8_lossy(&bytes).into_owned()
        }
        BodyEdit::Replace(s) => s.clone(),
    }
}

fn change(e: &mut StoredEvent, c: &Column) {
    match c {
        Column::RunId(s) => e.run_id = s.clone(),
        Column::Seq(n) => e.seq = *n,
        Column::AtMs(t) => e.at_ms = *t,
        Column::Version(v) => e.version = *v,
        Column::Kind(k) => e.kind = k.clone(),
        Column::Body(b) => e.body = edit_body(&e.body, b),
        Column::PrevHash(h) => e.prev_hash = h.clone(),
        Column::Hash(h) => e.hash = h.clone(),
    }
}

proptest! {
    #![proptest_config(fuzz::config())]

    #[test]
    fn a_made_up_event_never_passes_the_chain_check(
        run_id in ".{0,40}",
        seq in prop_oneof![Just(1u64), Just(0), Just(u64::MAX), any::<u64>()],
        at_ms in any::<i64>(),
        version in prop_oneof![Just(EVENT_VERSION), any::<u32>()],
        kind in prop_oneof![Just("frozen".to_string()), "[a-z_]{0,20}"],
        body in prop_oneof![
            Just(r#"{"kind":"frozen","reason":"r","by":"b"}"#.to_string()),
            proptest::collection::vec(any::<u8>(), 0..200)
                .prop_map(|b| String::from_utf8_lossy(&b).into_owned()),
        ],
        prev_hash in prop_oneof![Just(GENESIS_HASH.to_string()), hexish()],
        hash in hexish(),
    ) {
        let e = StoredEvent { run_id, seq, at_ms, version, kind, body, prev_hash, hash };
        check_decode(&e);
        // A hash is blake3 over every other column: a made-up one never matches.
        prop_assert!(verify_chain(None, [&e]).is_err());
        // Also where it would continue a log (for event 0, after the last sequence number), and
        // after the last sequence number.
        prop_assert!(verify_chain(Some((seq.wrapping_sub(1), GENESIS_HASH)), [&e]).is_err());
        prop_assert!(verify_chain(Some((u64::MAX, GENESIS_HASH)), [&e]).is_err());
    }

    #[test]
    fn any_change_to_a_stored_event_is_caught_at_that_event(
        which in any::<Index>(),
        c in column(),
    ) {
        let original = chain();
        let mut events = original.clone();
        let i = which.index(events.len());
        change(&mut events[i], &c);
        check_decode(&events[i]);
        if events[i] == original[i] {
            prop_assert_eq!(verify_chain(None, &events), Ok(events.len() as u64));
        } else {
            let problem = verify_chain(None, &events).expect_err("an altered log passed");
            prop_assert!(!problem.to_string().is_empty());
            // The first problem is the altered event, found by its sequence number.
            prop_assert_eq!(problem.seq(), events[i].seq, "{}", problem);
        }
    }

    #[test]
    fn a_rehashed_body_passes_only_as_a_real_event_of_its_kind(
        which in any::<Index>(),
        edits in proptest::collection::vec(body_edit(), 1..4),
    ) {
        let mut events = chain();
        let i = which.index(events.len());
        events[i].body = edits.iter().fold(events[i].body.clone(), |b, e| edit_body(&b, e));
        rehash(&mut events, i);
        check_decode(&events[i]);
        match verify_chain(None, &events) {
            Ok(n) => {
                prop_assert_eq!(n, events.len() as u64);
                let event = events[i].decode().expect("a verified event decodes");
                prop_assert_eq!(event.body.kind(), events[i].kind.as_str());
            }
            Err(ChainProblem::Undecodable { seq, message }) => {
                prop_assert_eq!(seq, events[i].seq);
                prop_assert!(events[i].decode().is_err());
                prop_assert!(!message.is_empty());
            }
            Err(ChainProblem::KindMismatch { seq, column, body }) => {
                prop_assert_eq!(seq, events[i].seq);
                prop_assert_ne!(column, body);
            }
            Err(other) => prop_assert!(false, "a re-hashed chain broke as {other:?}"),
        }
    }

    #[test]
    fn a_checkpoint_body_decodes_or_is_refused_naming_the_checkpoint(
        n in any::<u32>(),
        seq in any::<u64>(),
        body in prop_oneof![
            proptest::collection::vec(any::<u8>(), 0..300)
                .prop_map(|b| String::from_utf8_lossy(&b).into_owned()),
            Just("{}".to_string()),
            Just(format!("{}{}", "[".repeat(10_000), "]".repeat(10_000))),
        ],
    ) {
        let row = CheckpointRow {
            n,
            seq,
            at_ms: 0,
            hash: String::new(),
            snapshot_ref: String::new(),
            commit: String::new(),
            body,
        };
        if let Err(e) = row.decode(RUN) {
            let shown = e.to_string();
            let prefix = format!("run {RUN}, event {seq}: checkpoint {n}: ");
            prop_assert!(shown.starts_with(&prefix), "{}", shown);
            prop_assert!(shown.len() > prefix.len());
        }
    }
}

proptest! {
    #![proptest_config(fuzz::config())]

    #[test]
    fn a_damaged_log_row_is_refused_or_caught_by_the_chain_check(
        packed in any::<bool>(),
        edits in proptest::collection::vec(fuzz::byte_edit(), 1..4),
    ) {
        let events = chain();
        let encoded = keel_store::log::encode_events(&events);
        let (codec, stored) = if packed {
            keel_store::log::pack(encoded)
        } else {
            (keel_store::log::RAW, encoded)
        };
        let damaged = edits.iter().fold(stored.clone(), fuzz::apply_bytes);
        match keel_store::log::decode_events(RUN, codec, &damaged) {
            Err(message) => prop_assert!(!message.is_empty()),
            Ok(read) if read == events => {}
            Ok(read) => {
                prop_assert!(verify_chain(None, &read).is_err(), "{:?}", read);
                for e in &read {
                    check_decode(e);
                }
            }
        }
        check_log_row(&damaged);
        let blobs = vec![("a".repeat(64), 0, b"bytes".to_vec()), ("b".repeat(64), 1, damaged)];
        let (column, _) = keel_store::log::encode_blobs(&blobs);
        let cut = edits.iter().fold(column, fuzz::apply_bytes);
        check_log_row(&cut);
    }

    #[test]
    fn arbitrary_bytes_as_a_log_row_are_refused_or_read_back_exactly(
        bytes in proptest::collection::vec(any::<u8>(), 0..600),
    ) {
        check_log_row(&bytes);
    }
}

#[test]
fn a_valid_log_row_passes_the_oracle_and_reads_back_as_written() {
    // The oracle the fuzz target `log_row` shares must pass what keel writes, packed or not.
    let events = chain();
    let encoded = keel_store::log::encode_events(&events);
    check_log_row(&encoded);
    let (codec, packed) = keel_store::log::pack(encoded.clone());
    assert_ne!(
        codec,
        keel_store::log::RAW,
        "the sample chain is long enough to pack"
    );
    check_log_row(&packed);
    assert_eq!(
        keel_store::log::decode_events(RUN, codec, &packed),
        Ok(events)
    );
    let blobs = vec![("a".repeat(64), 0, b"bytes".to_vec())];
    let (column, _) = keel_store::log::encode_blobs(&blobs);
    check_log_row(&column);
}

#[test]
fn the_sample_chain_is_valid() {
    // The properties mean something only if what they change starts out valid.
    let events = chain();
    assert_eq!(verify_chain(None, &events), Ok(events.len() as u64));
    for e in &events {
        assert!(e.decode().is_ok());
    }
}

#[test]
fn a_chain_anchored_at_the_last_sequence_number_is_refused_not_an_overflow() {
    // Found by fuzzing: the check added one to the anchor, and to the sequence number of each
    // event it passed, which overflowed at `u64::MAX` (a panic in a debug build, a wrap to 0 in
    // a release one).
    let body = &bodies()[0];
    let last = stored(u64::MAX, GENESIS_HASH, body);
    // Nothing after the anchor: nothing wrong.
    assert_eq!(verify_chain(Some((u64::MAX, &last.hash)), []), Ok(0));
    // An event after it, whatever its number, has none left.
    for seq in [0, 1, u64::MAX] {
        let next = stored(seq, &last.hash, body);
        let problem = verify_chain(Some((u64::MAX, &last.hash)), [&next]).unwrap_err();
        assert_eq!(problem, ChainProblem::AfterLast { seq });
        assert_eq!(problem.seq(), seq);
        assert!(
            problem
                .to_string()
                .contains("the last sequence number there is"),
            "{problem}"
        );
    }
    // Event `u64::MAX` itself passes; one after it is refused the same way.
    assert_eq!(
        verify_chain(Some((u64::MAX - 1, GENESIS_HASH)), [&last]),
        Ok(1)
    );
    let next = stored(0, &last.hash, body);
    assert_eq!(
        verify_chain(Some((u64::MAX - 1, GENESIS_HASH)), [&last, &next]),
        Err(ChainProblem::AfterLast { seq: 0 })
    );
}
