//! The JSON bodies of the HTTP API's POST endpoints, through keel's router in this process over
//! a run waiting at its approval gate. An input is an endpoint's name (`decide`, `answer`,
//! `freeze`, `unfreeze`, `cancel`), a newline, then the body.
#![no_main]

use keel_test_support::oracle::api::InProcess;

thread_local! {
    // One workspace and router for the whole campaign: making a run takes git and a store. An
    // accepted request changes the run (frozen, cancelled); later inputs are judged on the
    // same rules.
    static ROUTER: InProcess = InProcess::gated();
}

libfuzzer_sys::fuzz_target!(|data: &[u8]| ROUTER.with(|r| r.check_input(data)));
