//! A binary that is only the sandbox helper, for this crate's tests (and tools that have no
//! binary of their own to re-execute): they run `Sandbox::new(path_of_this_binary)`. keel's own
//! small helper, `keel-sandbox-helper`, is keel-cli's.

fn main() {
    keel_sandbox::helper_main("keel-sandbox-test-helper")
}
