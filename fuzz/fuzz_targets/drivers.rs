//! What a driver reads: a line of a script, the record of a delegated program, and a model
//! server's answer through the model drivers of `openai` and `anthropic` contracts.
#![no_main]

use keel_test_support::oracle::drivers::check_all;

libfuzzer_sys::fuzz_target!(|data: &[u8]| check_all(data));
