//! A model server's answer, read as each wire format keel speaks (OpenAI-compatible, Anthropic).
#![no_main]

use keel_llm::Provider;
use keel_test_support::oracle::llm::check;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    check(Provider::OpenAi, data);
    check(Provider::Anthropic, data);
});
