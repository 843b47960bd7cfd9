//! keel's sandbox helper: a small binary that only confines a command (see keel-sandbox). keel
//! starts it, when it sits beside the `keel` binary and is of the same build, instead of
//! re-executing itself: its start costs a fraction of keel's (far fewer pages to map and
//! relocations to apply).

fn main() {
    keel_sandbox::helper_main("keel-sandbox-helper")
}
