//! A `log` row's columns as a disk or a hand could leave them: the events under every codec, and
//! the artifacts.
#![no_main]

use keel_test_support::oracle::store::check_log_row;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    check_log_row(data);
});
