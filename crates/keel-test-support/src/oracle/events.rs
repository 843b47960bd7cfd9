//! The event decoder's oracle, `EventBody::decode`: what any text it is given must come back as.
//! Shared by keel-core's property tests (`tests/fuzz_events.rs`) and the coverage-guided fuzz
//! target `event_body` (`fuzz/`): a refusal says "event body does not decode" and why; only
//! version 1 is read, any other version is refused whatever the body; whatever is accepted is a
//! real event (it re-encodes and decodes to the same value, and its kind is the `kind` the text
//! names); the envelope type round-trips what it accepts.
//!
//! Each check panics with what it found, as a test's assertion does.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use keel_core::event::{DecodeError, EVENT_VERSION, Event, EventBody};
use serde_json::Value;

/// Decodes `text` as a version-1 body and checks whatever comes back.
pub fn check(text: &str) {
    match EventBody::decode(EVENT_VERSION, text) {
        Ok(body) => {
            // A real event: its encoding decodes to the same value, and encoding is stable.
            let encoded = body.encode();
            assert!(!encoded.is_empty());
            assert_eq!(
                EventBody::decode(EVENT_VERSION, &encoded).as_ref(),
                Ok(&body),
                "re-encoding changed the event decoded from {text}"
            );
            assert_eq!(
                EventBody::decode(EVENT_VERSION, &encoded).unwrap().encode(),
                encoded
            );
            // Its kind is the one the text names, whatever else the text holds.
            let named: Value = serde_json::from_str(text).unwrap();
            assert_eq!(
                named.get("kind").and_then(Value::as_str),
                Some(body.kind()),
                "the text names another kind than the event it decoded to: {text}"
            );
        }
        Err(DecodeError::Body(message)) => {
            assert!(!message.trim().is_empty(), "a refusal without a reason");
            let shown = DecodeError::Body(message).to_string();
            assert!(shown.starts_with("event body does not decode: "), "{shown}");
        }
        Err(other) => panic!("version 1 was refused as a version: {other}"),
    }
    // Any other version is refused as such, whatever the body.
    for version in [0, 2, u32::MAX] {
        assert_eq!(
            EventBody::decode(version, text),
            Err(DecodeError::Version(version))
        );
    }
    // The envelope type decodes or refuses without a panic, and what it accepts round-trips.
    if let Ok(event) = serde_json::from_str::<Event>(text) {
        let again: Event = serde_json::from_str(&serde_json::to_string(&event).unwrap()).unwrap();
        assert_eq!(again, event);
    }
}
