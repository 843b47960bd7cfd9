//! A binary that is only the sandbox helper: what the tests (and tools that have no binary of
//! their own to re-execute) run as `Sandbox::new(path_of_this_binary)`.

fn main() {
    keel_sandbox::enter_if_helper();
    eprintln!("keel-sandbox-helper: not a helper invocation (run it through Sandbox::command)");
    std::process::exit(2);
}
