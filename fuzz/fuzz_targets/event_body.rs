//! The event decoder, `EventBody::decode`, on any stored body (text, so bytes read lossily).
#![no_main]

use keel_test_support::oracle::events::check;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    check(&String::from_utf8_lossy(data));
});
