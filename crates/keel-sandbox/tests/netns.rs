//! As root, a command without network runs in a network namespace the caller made, kept for the
//! next command once the helper has exited by itself: one command at a time, nothing of the
//! last command left in it, and one found changed is not used. One test function: the pool is
//! the process's, and tests run in parallel.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};

use common::{Fixture, python};

/// Binds a TCP port and an abstract unix socket (both left bound at exit), tries to bring
/// loopback up, to set a network sysctl and to connect to its own port.
const SCRIPT: &str = r#"
import fcntl, os, socket, struct
print("ns", os.readlink("/proc/self/ns/net"))
t = socket.socket()
t.bind(("0.0.0.0", 47311))
t.listen()
print("tcp=bound")
u = socket.socket(socket.AF_UNIX)
u.bind("\0keel-netns-test")
u.listen()
print("unix=bound")
try:
    fcntl.ioctl(t, 0x8914, struct.pack("16sh", b"lo", 1))
    print("up=ok")
except OSError as e:
    print("up=denied", e.errno)
try:
    with open("/proc/sys/net/ipv4/ip_forward", "w") as f:
        f.write("1")
    print("sysctl=ok")
except OSError as e:
    print("sysctl=denied", e.errno)
try:
    socket.create_connection(("127.0.0.1", 47311), timeout=5)
    print("connect=ok")
except OSError as e:
    print("connect=denied", e.errno)
"#;

/// Brings loopback up in the network namespace at `argv[1]` (run as root, outside any sandbox).
const SPOIL: &str = r#"
import ctypes, fcntl, os, socket, struct, sys
libc = ctypes.CDLL(None, use_errno=True)
fd = os.open(sys.argv[1], os.O_RDONLY)
if libc.setns(fd, 0x40000000) != 0:
    raise OSError(ctypes.get_errno(), "setns")
fcntl.ioctl(socket.socket(socket.AF_INET, socket.SOCK_DGRAM), 0x8914, struct.pack("16sh", b"lo", 1))
"#;

/// Runs `script` with python in the sandbox to its end (see [`common::run_to_end`]).
fn run(f: &Fixture, script: &str, exited: bool) -> String {
    common::run_to_end(
        &f.policy(vec![python(), "-c".into(), script.into()]),
        exited,
    )
}

/// The namespace a command printed (`net:[N]`).
fn namespace(stdout: &str) -> String {
    let line = stdout.lines().find(|l| l.starts_with("ns ")).unwrap();
    line["ns ".len()..].to_string()
}

/// This process's descriptor of the namespace `ns`, as a path another process can open.
fn descriptor_of(ns: &str) -> String {
    for entry in std::fs::read_dir("/proc/self/fd").unwrap() {
        let path = entry.unwrap().path();
        if std::fs::read_link(&path).is_ok_and(|target| target.to_str() == Some(ns)) {
            let fd = path.file_name().unwrap().to_str().unwrap().to_string();
            return format!("/proc/{}/fd/{fd}", std::process::id());
        }
    }
    panic!("no descriptor of {ns} in this process");
}

#[test]
fn a_network_namespace_is_kept_for_one_command_at_a_time_and_only_as_made() {
    let f = Fixture::new();
    if !nix::unistd::geteuid().is_root() {
        eprintln!(
            "SKIPPED (most of it): not root, so each command's helper makes its network \
             namespace inside its user namespace and none is kept"
        );
        run(&f, "print('ns x')", true);
        assert_eq!(keel_sandbox::kept_network_namespaces(), 0);
        return;
    }

    // The first command gets a new namespace; it cannot bring loopback up, set a sysctl or
    // connect anywhere. Its namespace is kept.
    let first = run(&f, SCRIPT, true);
    for line in [
        "tcp=bound",
        "unix=bound",
        "up=denied 1",
        "sysctl=denied 13",
        "connect=denied 101",
    ] {
        assert!(first.lines().any(|l| l == line), "{line}: {first}");
    }
    assert_eq!(keel_sandbox::kept_network_namespaces(), 1);

    // The next command gets the same namespace, with nothing of the first left in it: the
    // port and the abstract socket bind again, and loopback is still down.
    let second = run(&f, SCRIPT, true);
    assert_eq!(namespace(&second), namespace(&first), "the kept namespace");
    for line in ["tcp=bound", "unix=bound", "connect=denied 101"] {
        assert!(second.lines().any(|l| l == line), "{line}: {second}");
    }
    assert_eq!(keel_sandbox::kept_network_namespaces(), 1);

    // Two commands at once never share one: the kept one goes to the first, the second gets a
    // new one.
    let f2 = Fixture::new();
    let policy = f2.sh("readlink /proc/self/ns/net; read line");
    let (mut cmd, mut held) = common::sandbox().command(&policy).unwrap();
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut holding = String::new();
    BufReader::new(child.stdout.as_mut().unwrap())
        .read_line(&mut holding)
        .unwrap();
    assert_eq!(holding.trim(), namespace(&first), "the kept namespace");
    assert_eq!(keel_sandbox::kept_network_namespaces(), 0);
    let meanwhile = run(&f, SCRIPT, true);
    assert_ne!(namespace(&meanwhile), holding.trim(), "shared while in use");
    assert!(meanwhile.lines().any(|l| l == "tcp=bound"), "{meanwhile}");
    assert_eq!(keel_sandbox::kept_network_namespaces(), 1);
    child.stdin.as_mut().unwrap().write_all(b"go\n").unwrap();
    assert!(child.wait().unwrap().success());
    held.helper_exited();
    drop(held);
    assert_eq!(keel_sandbox::kept_network_namespaces(), 2);

    // Without word that the helper exited by itself, the namespace is not kept.
    let (_cmd, tmp) = common::sandbox().command(&f.sh("true")).unwrap();
    assert_eq!(keel_sandbox::kept_network_namespaces(), 1);
    drop(tmp);
    assert_eq!(keel_sandbox::kept_network_namespaces(), 1);

    // A kept namespace that is not as made (loopback up) is not used: the command gets a fresh
    // one, with loopback down, and the changed one is dropped.
    let last = run(&f, SCRIPT, true);
    assert_eq!(keel_sandbox::kept_network_namespaces(), 1);
    let spoiled = namespace(&last);
    let spoil = Command::new(python())
        .args(["-c", SPOIL, &descriptor_of(&spoiled)])
        .status()
        .unwrap();
    assert!(spoil.success(), "could not bring loopback up in {spoiled}");
    let fresh = run(&f, SCRIPT, true);
    assert_ne!(namespace(&fresh), spoiled, "a changed namespace was used");
    assert!(fresh.lines().any(|l| l == "connect=denied 101"), "{fresh}");
    assert_eq!(keel_sandbox::kept_network_namespaces(), 0);
    // The private directory was still kept, the marker gone from it.
    assert!(keel_sandbox::kept_private_dirs() >= 1);
}
