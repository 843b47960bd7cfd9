//! A lease holder on this machine holds nothing once its process is gone: exited and reaped, or
//! exited and not yet reaped (a zombie, as a process killed under a parent that does not wait
//! for it is).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use keel_engine::{Actor, holder_is_stale};

/// `state` (field 3) and the start time (field 22) of a process.
fn stat(pid: u32) -> Option<(String, String)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    Some((fields[0].to_string(), fields[19].to_string()))
}

/// The holder string a keel process `pid` on this machine writes in a lease.
fn holder_of(pid: u32, start: &str) -> String {
    let ours = Actor::current().holder;
    let host = ours.rsplitn(3, ':').nth(2).unwrap().to_string();
    format!("{host}:{pid}:{start}")
}

#[test]
fn a_holder_that_exited_holds_nothing_even_before_it_is_reaped() {
    assert!(
        !holder_is_stale(&Actor::current().holder),
        "this process is alive"
    );
    let mut child = std::process::Command::new("sleep")
        .arg("30")
        .spawn()
        .unwrap();
    let pid = child.id();
    let (_, start) = stat(pid).unwrap();
    let holder = holder_of(pid, &start);
    assert!(!holder_is_stale(&holder), "a live holder holds its lease");
    assert!(
        holder_is_stale(&holder_of(pid, &format!("{start}1"))),
        "a new process that reuses the pid is not the holder"
    );

    child.kill().unwrap();
    // Not waited for: the child stays a zombie until `wait` below.
    let mut zombie = false;
    for _ in 0..2000 {
        if stat(pid).is_some_and(|(state, _)| state == "Z") {
            zombie = true;
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    assert!(zombie, "the killed child becomes a zombie");
    assert!(holder_is_stale(&holder), "a zombie holds nothing");
    child.wait().unwrap();
    assert!(holder_is_stale(&holder), "nor does a reaped process");
    assert!(
        !holder_is_stale(&format!("another-machine:{pid}:{start}")),
        "a holder on another machine is not judged from here"
    );
}
