//! What the command can and cannot touch: files, hidden paths, environment, network.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::fs;
use std::io::Read;
use std::net::{TcpListener, UdpSocket};
use std::path::Path;
use std::time::Duration;

use common::{Fixture, LONG, python, run};

fn read(p: &Path) -> String {
    fs::read_to_string(p).unwrap()
}

#[test]
fn a_normal_command_works() {
    let f = Fixture::new();
    let ran = run(
        &f.sh("set -e
             echo hello > made.txt
             mkdir -p sub && echo nested > sub/n.txt
             head -c 5 /etc/passwd > /dev/null
             cat /etc/hostname > /dev/null
             echo scratch > \"$TMPDIR/t\" && cat \"$TMPDIR/t\"
             echo cwd=$(pwd)
             echo pid=$$
             ls /dev/null > /dev/null 2>&1
             echo shm > /dev/shm/keel-sandbox-test-shm && echo shm-ok"),
        LONG,
    );
    // /dev/shm is a private tmpfs: writable, and gone with the command.
    assert!(ran.stdout.contains("shm-ok"), "{ran:?}");
    assert!(!Path::new("/dev/shm/keel-sandbox-test-shm").exists());
    assert_eq!(ran.code, 0, "{ran:?}");
    assert_eq!(read(&f.ws.join("made.txt")), "hello\n");
    assert_eq!(read(&f.ws.join("sub/n.txt")), "nested\n");
    assert!(ran.stdout.contains("scratch\n"), "{ran:?}");
    assert!(
        ran.stdout.contains(&format!("cwd={}\n", f.ws.display())),
        "{ran:?}"
    );
    // The command is PID 1 of a pid namespace of its own.
    assert!(ran.stdout.contains("pid=1\n"), "{ran:?}");
    assert_eq!(ran.refusal, None);
}

#[test]
fn the_command_has_no_capabilities_and_sees_only_its_own_processes() {
    let f = Fixture::new();
    let ran = run(
        &f.sh("grep -E '^Cap(Inh|Prm|Eff|Bnd|Amb):' /proc/self/status
             grep NoNewPrivs /proc/self/status
             echo procs=$(ls /proc | grep -cE '^[0-9]+$')"),
        LONG,
    );
    assert_eq!(ran.code, 0, "{ran:?}");
    for set in ["CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"] {
        assert!(
            ran.stdout.contains(&format!("{set}:\t0000000000000000")),
            "{set} not empty: {ran:?}"
        );
    }
    assert!(ran.stdout.contains("NoNewPrivs:\t1"), "{ran:?}");
    // sh, grep/ls and the subshell: a handful, not the machine's hundreds.
    let procs: usize = ran
        .stdout
        .lines()
        .find_map(|l| l.strip_prefix("procs="))
        .unwrap()
        .parse()
        .unwrap();
    assert!(procs <= 5, "{ran:?}");
}

#[test]
fn writes_outside_the_workspace_are_refused() {
    let f = Fixture::new();
    let out = f.outside.path();
    fs::write(out.join("victim.txt"), "original").unwrap();
    fs::write(f.root.path().join("sibling.txt"), "original").unwrap();
    std::os::unix::fs::symlink(out, f.ws.join("link-out")).unwrap();
    let script = format!(
        "out={out}
         echo 1 > \"$out/new.txt\" && echo WROTE-ABS
         echo 2 > \"$out/victim.txt\" && echo WROTE-VICTIM
         echo 3 >> \"$out/victim.txt\" && echo APPENDED-VICTIM
         true > \"$out/victim.txt\" && echo TRUNCATED-VICTIM
         truncate -s 0 \"$out/victim.txt\" && echo TRUNCATE-VICTIM
         rm -f \"$out/victim.txt\"; test -e \"$out/victim.txt\" || echo REMOVED-VICTIM
         mv \"$out/victim.txt\" ./stolen.txt && echo MOVED-VICTIM
         mkdir \"$out/dir\" && echo MKDIR
         echo 4 > ../escaped.txt && echo WROTE-DOTDOT
         echo 5 > ../sibling.txt && echo WROTE-SIBLING
         echo 6 > link-out/via-link.txt && echo WROTE-SYMLINK
         echo 7 > link-out/victim.txt && echo WROTE-VICTIM-SYMLINK
         ln -s /etc/passwd \"$out/sym\" && echo SYMLINKED
         echo inside > ok.txt && echo INSIDE-OK",
        out = out.display()
    );
    let ran = run(&f.sh(&script), LONG);
    assert!(ran.stdout.contains("INSIDE-OK"), "{ran:?}");
    assert_eq!(
        ran.stdout.trim(),
        "INSIDE-OK",
        "some write outside succeeded: {ran:?}"
    );
    assert!(
        ran.stderr.contains("Permission denied"),
        "Landlock denies with EACCES: {ran:?}"
    );
    // Nothing changed on disk.
    assert_eq!(read(&out.join("victim.txt")), "original");
    assert_eq!(read(&f.root.path().join("sibling.txt")), "original");
    let mut names: Vec<_> = fs::read_dir(out)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(names, vec!["victim.txt"]);
    assert!(!f.root.path().join("escaped.txt").exists());
    assert!(!f.ws.join("stolen.txt").exists());
    assert_eq!(read(&f.ws.join("ok.txt")), "inside\n");
}

/// Landlock checks the path a file is opened by, not the inode: a hard link that is already in
/// the workspace and points to a file outside IS writable through the workspace path. The
/// sandbox cannot prevent that; the caller (keel) must refuse hard-linked files in the workspace
/// before it runs a command. This test pins the kernel's behaviour so that the caveat stays
/// true to it.
#[test]
fn a_hard_link_made_before_the_run_is_writable_which_is_why_the_caller_must_refuse_them() {
    let f = Fixture::new();
    let outside_file = f.outside.path().join("linked.txt");
    fs::write(&outside_file, "original").unwrap();
    fs::hard_link(&outside_file, f.ws.join("linked.txt")).unwrap();
    let ran = run(&f.sh("echo changed > linked.txt && echo WROTE"), LONG);
    assert_eq!(ran.code, 0, "{ran:?}");
    assert!(ran.stdout.contains("WROTE"));
    assert_eq!(read(&outside_file), "changed\n");
}

/// What the sandbox does enforce about hard links: the command cannot make one (nor move a file
/// in) from outside the writable places: LANDLOCK_ACCESS_FS_REFER refuses linking or renaming
/// a file into a hierarchy where it would gain rights (EXDEV).
#[test]
fn linking_or_moving_a_file_from_outside_into_the_workspace_is_refused() {
    let f = Fixture::new();
    let outside_file = f.outside.path().join("target.txt");
    fs::write(&outside_file, "original").unwrap();
    let script = format!(
        "ln {o} ./hl.txt && echo LINKED
         echo rc=$?
         mv {o} ./moved.txt && echo MOVED",
        o = outside_file.display()
    );
    let ran = run(&f.sh(&script), LONG);
    assert!(!ran.stdout.contains("LINKED"), "{ran:?}");
    assert!(!ran.stdout.contains("MOVED"), "{ran:?}");
    // link(2) fails with EXDEV (REFER); mv's rename fails the same way, and its fallback
    // (copy, then unlink the source) fails on the unlink outside with EACCES, and mv removes
    // its copy.
    assert!(
        ran.stderr.contains("failed to create hard link")
            && ran.stderr.contains("Invalid cross-device link"),
        "{ran:?}"
    );
    assert!(ran.stderr.contains("cannot move"), "{ran:?}");
    assert!(!f.ws.join("hl.txt").exists());
    assert!(!f.ws.join("moved.txt").exists());
    assert_eq!(read(&outside_file), "original");
    use std::os::unix::fs::MetadataExt;
    assert_eq!(fs::metadata(&outside_file).unwrap().nlink(), 1);
}

#[test]
fn hidden_files_and_directories_cannot_be_read() {
    let f = Fixture::new();
    let secrets = f.root.path().join("secrets.env");
    fs::write(&secrets, "API_KEY=sk-very-secret").unwrap();
    let vault = f.outside.path().join("vault");
    fs::create_dir(&vault).unwrap();
    fs::write(vault.join("key.pem"), "PRIVATE KEY").unwrap();
    let mut policy = f.sh(&format!(
        "cat {s}; echo cat-secrets=$?
         ls -a {v}; echo ls-vault=$?
         cat {v}/key.pem; echo cat-key=$?
         echo x > {s}; echo write-secrets=$?
         grep -r sk-very-secret {root} ; echo grep=$?",
        s = secrets.display(),
        v = vault.display(),
        root = f.root.path().display(),
    ));
    policy.hidden = vec![secrets.clone(), vault.clone()];
    let ran = run(&policy, LONG);
    assert!(!ran.stdout.contains("sk-very-secret"), "{ran:?}");
    assert!(!ran.stdout.contains("PRIVATE KEY"), "{ran:?}");
    assert!(!ran.stdout.contains("key.pem"), "{ran:?}");
    for probe in [
        "cat-secrets=1",
        "ls-vault=2",
        "cat-key=1",
        "write-secrets=2",
    ] {
        assert!(ran.stdout.contains(probe), "{probe}: {ran:?}");
    }
    assert!(ran.stderr.contains("Permission denied"), "{ran:?}");
    // Nothing changed on disk.
    assert_eq!(read(&secrets), "API_KEY=sk-very-secret");
    assert_eq!(read(&vault.join("key.pem")), "PRIVATE KEY");
}

#[test]
fn the_keel_directory_is_neither_readable_nor_writable() {
    let f = Fixture::new();
    let keel = f.ws.join(".keel");
    fs::create_dir(&keel).unwrap();
    fs::write(keel.join("store.db"), "events").unwrap();
    let mut policy = f.sh("ls .keel; echo ls=$?
         cat .keel/store.db; echo cat=$?
         echo x > .keel/store.db; echo overwrite=$?
         echo x > .keel/new; echo create=$?
         rm -rf .keel; echo rm=$?
         mv .keel gone; echo mv=$?
         test -e gone && echo GONE-EXISTS
         echo fine > other.txt");
    policy.hidden = vec![keel.clone()];
    let ran = run(&policy, LONG);
    assert!(!ran.stdout.contains("events"), "{ran:?}");
    assert!(!ran.stdout.contains("store.db"), "{ran:?}");
    for ok in ["ls=0", "cat=0", "overwrite=0", "create=0", "rm=0", "mv=0"] {
        assert!(!ran.stdout.contains(ok), "{ok}: {ran:?}");
    }
    assert!(!ran.stdout.contains("GONE-EXISTS"), "{ran:?}");
    // Nothing changed in .keel; the rest of the workspace was writable.
    let names: Vec<_> = fs::read_dir(&keel)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(names, vec!["store.db"]);
    assert_eq!(read(&keel.join("store.db")), "events");
    assert_eq!(read(&f.ws.join("other.txt")), "fine\n");
}

#[test]
fn the_environment_is_exactly_the_policys() {
    let f = Fixture::new();
    // The test's own environment has these; the command must not.
    assert!(std::env::var_os("PATH").is_some());
    // `env` itself, not python: python adds LC_CTYPE on its own (PEP 538).
    let mut policy = f.policy(vec!["/usr/bin/env".into()]);
    policy.env = vec![
        ("ONLY_THIS".into(), "yes".into()),
        ("PATH".into(), "/usr/bin:/bin".into()),
        ("TMPDIR".into(), "/should/be/replaced".into()),
    ];
    let ran = run(&policy, LONG);
    assert_eq!(ran.code, 0, "{ran:?}");
    let mut vars: Vec<&str> = ran.stdout.lines().collect();
    vars.sort();
    assert_eq!(vars.len(), 3, "exactly three variables: {ran:?}");
    assert_eq!(vars[0], "ONLY_THIS=yes");
    assert_eq!(vars[1], "PATH=/usr/bin:/bin");
    assert!(vars[2].starts_with("TMPDIR=/"), "{ran:?}");
    assert!(vars[2].ends_with("/tmp"), "{ran:?}");
    assert!(!ran.stdout.contains("/should/be/replaced"), "{ran:?}");
}

const NET_SCRIPT: &str = r#"
import socket, sys
port = int(sys.argv[1])
try:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(b"hello")
    s.close()
    print("tcp=ok")
except OSError as e:
    print("tcp=denied", e.errno, e)
try:
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    u.sendto(b"hello", ("127.0.0.1", int(sys.argv[2])))
    print("udp=ok")
except OSError as e:
    print("udp=denied", e.errno, e)
"#;

fn net_policy(f: &Fixture, network: bool, tcp: u16, udp: u16) -> keel_sandbox::Policy {
    let mut policy = f.policy(vec![
        python(),
        "-c".into(),
        NET_SCRIPT.into(),
        tcp.to_string(),
        udp.to_string(),
    ]);
    policy.network = network;
    policy
}

#[test]
fn the_network_is_denied_by_default() {
    let f = Fixture::new();
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let udp = UdpSocket::bind("127.0.0.1:0").unwrap();
    udp.set_nonblocking(true).unwrap();
    let ran = run(
        &net_policy(
            &f,
            false,
            listener.local_addr().unwrap().port(),
            udp.local_addr().unwrap().port(),
        ),
        LONG,
    );
    assert_eq!(ran.code, 0, "{ran:?}");
    // ENETUNREACH (101): the namespace's only interface, loopback, is down.
    assert!(ran.stdout.contains("tcp=denied 101"), "{ran:?}");
    assert!(ran.stdout.contains("udp=denied 101"), "{ran:?}");
    assert!(listener.accept().is_err(), "a connection arrived");
    let mut buf = [0u8; 16];
    assert!(udp.recv_from(&mut buf).is_err(), "a datagram arrived");
}

#[test]
fn the_network_is_there_when_the_policy_allows_it() {
    let f = Fixture::new();
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let udp = UdpSocket::bind("127.0.0.1:0").unwrap();
    let ran = run(
        &net_policy(
            &f,
            true,
            listener.local_addr().unwrap().port(),
            udp.local_addr().unwrap().port(),
        ),
        LONG,
    );
    assert_eq!(ran.code, 0, "{ran:?}");
    assert!(ran.stdout.contains("tcp=ok"), "{ran:?}");
    assert!(ran.stdout.contains("udp=ok"), "{ran:?}");
    let (mut conn, _) = listener.accept().unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut got = String::new();
    conn.read_to_string(&mut got).unwrap();
    assert_eq!(got, "hello");
}
