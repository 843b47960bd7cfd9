//! The contract parser, `Contract::parse`, on any text (bytes that are not UTF-8 read lossily,
//! as the property tests do: the parser takes text).
#![no_main]

use keel_test_support::oracle::contract::check;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = check(&String::from_utf8_lossy(data));
});
