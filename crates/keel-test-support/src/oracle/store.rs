//! The stored log's decoders' oracle: what `StoredEvent::decode`, `log::decode_events` and
//! `log::decode_blobs` must do with whatever bytes a `log` row holds after a disk or a hand
//! damaged it. Shared by keel-store's property tests (`tests/fuzz_decode.rs`) and the
//! coverage-guided fuzz target `log_row` (`fuzz/`): decoding never panics or reads past the end;
//! a refusal says why and names the run and the event; what decodes re-encodes to the same thing.
//!
//! Each check panics with what it found, as a test's assertion does.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use keel_core::event::{EVENT_VERSION, EventBody};
use keel_store::StoredEvent;
use keel_store::log::{self, LZ4, LZ4_BASED, RAW, ZSTD};

/// The run every decoded event is read as.
pub const RUN: &str = "0190a5b2-7c3d-7e4f-8a9b-0c1d2e3f4a5b";

/// Decoding never panics; a refusal names the run and the event.
pub fn check_decode(e: &StoredEvent) {
    match e.decode() {
        Ok(event) => {
            assert_eq!(event.run_id, e.run_id);
            assert_eq!(event.seq, e.seq);
            assert_eq!(
                EventBody::decode(EVENT_VERSION, &event.body.encode()).as_ref(),
                Ok(&event.body)
            );
        }
        Err(err) => {
            let shown = err.to_string();
            assert!(
                shown.starts_with(&format!("run {}, event {}: ", e.run_id, e.seq)),
                "{shown}"
            );
            assert!(shown.len() > format!("run {}, event {}: ", e.run_id, e.seq).len());
        }
    }
}

/// Reads `bytes` as a `log` row's `events` column under every codec, and as its `blobs` column,
/// and checks what comes back: a refusal says why; events that decode are decoded as events of
/// [`RUN`], each decodes or is refused naming itself ([`check_decode`]), and they encode to
/// bytes that decode to them again; artifacts that decode encode to a column that decodes to
/// them again.
pub fn check_log_row(bytes: &[u8]) {
    for codec in [RAW, LZ4, LZ4_BASED, ZSTD, -1, 200] {
        match log::decode_events(RUN, codec, bytes) {
            Err(message) => assert!(!message.trim().is_empty(), "a refusal that says nothing"),
            Ok(events) => {
                for e in &events {
                    assert_eq!(e.run_id, RUN);
                    check_decode(e);
                }
                let again = log::encode_events(&events);
                assert_eq!(
                    log::decode_events(RUN, RAW, &again).as_ref(),
                    Ok(&events),
                    "codec {codec}: the events decoded do not survive encoding"
                );
            }
        }
    }
    match log::decode_blobs(bytes) {
        Err(message) => assert!(!message.trim().is_empty(), "a refusal that says nothing"),
        Ok(blobs) => {
            let (column, _) = log::encode_blobs(&blobs);
            assert_eq!(log::decode_blobs(&column).as_ref(), Ok(&blobs));
        }
    }
}
