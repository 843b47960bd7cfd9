//! The sandbox helper entered the wrong way, after a thread started: the tests run it to see
//! that the helper refuses (stage 2 is a fork of stage 1, sound only with one thread) instead
//! of forking.

fn main() {
    let _idle = std::thread::spawn(|| std::thread::sleep(std::time::Duration::from_secs(60)));
    keel_sandbox::enter_if_helper();
    eprintln!("keel-sandbox-threaded-helper: not a helper invocation");
    std::process::exit(2);
}
