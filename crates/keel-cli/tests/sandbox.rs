//! Escape attempts through the `run` tool of a scripted agent run, each refused by the sandbox
//! with an observation that says so, and nothing changed: writes outside the workspace (an
//! absolute path, `..`, a symlink, a new hard link), reading keel's store and the secrets file,
//! a TCP connection and a UDP datagram with the network denied, a fork bomb and a memory hog
//! stopped by the limits, and a command that ignores SIGTERM and leaves a setsid'd grandchild
//! behind, killed with it at the timeout. Then the built-in `keel:secret-scan` verifier refuses a
//! change that writes a secret's value into the workspace.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::net::{TcpListener, UdpSocket};
use std::time::Duration;

use common::{Fixture, git, kinds, state};
use serde_json::{Value, json};

fn run(command: &str, seconds: u64) -> Value {
    json!({"tool": "run", "args": {"command": command, "timeout_seconds": seconds}})
}

/// The observations of the run's `run` calls, in order.
fn observations(f: &Fixture, id: &str) -> Vec<String> {
    f.events(id)
        .iter()
        .filter(|e| e["kind"] == "tool_call_finished")
        .map(|e| e["body"]["observation"].as_str().unwrap().to_string())
        .collect()
}

#[test]
fn escape_attempts_are_refused_with_a_clear_observation_and_change_nothing() {
    let outside = tempfile::tempdir().unwrap();
    std::fs::write(outside.path().join("target.txt"), "outside original\n").unwrap();
    let o = outside.path().display().to_string();
    let outside_name = outside.path().file_name().unwrap().to_str().unwrap();
    let tcp = TcpListener::bind("127.0.0.1:0").unwrap();
    tcp.set_nonblocking(true).unwrap();
    let udp = UdpSocket::bind("127.0.0.1:0").unwrap();
    udp.set_nonblocking(true).unwrap();
    let (tcp_port, udp_port) = (
        tcp.local_addr().unwrap().port(),
        udp.local_addr().unwrap().port(),
    );
    let attempts: Vec<(&str, Value)> = vec![
        ("absolute", run(&format!("echo pwned > {o}/abs.txt"), 10)),
        (
            "dotdot",
            run(&format!("echo pwned > ../{outside_name}/dotdot.txt"), 10),
        ),
        ("symlink", run("echo pwned > link/sym.txt", 10)),
        ("append", run(&format!("echo pwned >> {o}/target.txt"), 10)),
        ("hardlink", run(&format!("ln {o}/target.txt hard.txt"), 10)),
        ("store", run("cat .keel/keel.db > /dev/null", 10)),
        ("secrets", run("cat .keel/secrets", 10)),
        (
            "tcp",
            run(
                &format!(
                    "python3 -c \"import socket; socket.create_connection(('127.0.0.1', {tcp_port}), 3)\""
                ),
                10,
            ),
        ),
        (
            "udp",
            run(
                &format!(
                    "python3 -c \"import socket; socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('127.0.0.1', {udp_port}))\""
                ),
                10,
            ),
        ),
        (
            "memory",
            run("python3 -c \"b = bytearray(2**31); print(len(b))\"", 20),
        ),
        (
            "fork bomb",
            run("bomb() { bomb | bomb & }; bomb; sleep 30", 3),
        ),
        (
            "ignores SIGTERM",
            run(
                "trap '' TERM; setsid sh -c \"trap '' TERM; sleep 4; echo late > late.txt\" & sleep 60",
                2,
            ),
        ),
    ];
    let mut script: Vec<Value> = attempts.iter().map(|(_, a)| a.clone()).collect();
    script.push(json!({"tool": "finish", "args": {"summary": "tried"}}));
    let contract = format!(
        r#"
[task]
goal = "Nothing outside the workspace changes."

[driver]
kind = "script"
script = "{script}"

[budget]
same_error = 50

[sandbox]
memory = "512MiB"
processes = 64

[[verify]]
name = "present"
tier = "acceptance"
run = "test -f README.md"

[[phase]]
name = "escape"
kind = "agent"
objective = "Try to leave the workspace."
tools = ["run", "finish"]
done_when = []
"#,
        script = outside.path().join("script.jsonl").display()
    );
    let text: Vec<String> = script.iter().map(|l| l.to_string()).collect();
    std::fs::write(outside.path().join("script.jsonl"), text.join("\n") + "\n").unwrap();
    let f = Fixture::new(&contract);
    std::os::unix::fs::symlink(outside.path(), f.path("link")).unwrap();
    git(f.root(), &["add", "link"]);
    git(f.root(), &["commit", "-q", "-m", "link"]);
    std::fs::create_dir_all(f.path(".keel")).unwrap();
    std::fs::write(f.path(".keel/secrets"), "TOKEN=s3cr3t-sandbox-value\n").unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(
        f.path(".keel/secrets"),
        std::fs::Permissions::from_mode(0o600),
    )
    .unwrap();
    let before: Vec<String> = std::fs::read_dir(outside.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
        .collect();

    let (id, out) = f.start(&[]);
    assert_eq!(out.status.code(), Some(0), "{}", f.explain(&out));
    let seen = observations(&f, &id);
    assert_eq!(
        seen.len(),
        attempts.len() + 1,
        "{:?}",
        kinds(&f.events(&id))
    );
    let refused = |what: &str, text: &str, signs: &[&str]| {
        assert!(
            signs.iter().any(|s| text.contains(s)),
            "{what}: the observation does not say it was refused ({signs:?}):\n{text}"
        );
        assert!(
            !text.starts_with("exit 0"),
            "{what}: the attempt succeeded:\n{text}"
        );
    };
    let denied = ["Permission denied", "Read-only file system"];
    for (i, (what, _)) in attempts.iter().enumerate() {
        let text = &seen[i];
        match *what {
            "absolute" | "dotdot" | "symlink" | "append" => refused(what, text, &denied),
            "hardlink" => refused(
                what,
                text,
                &["Invalid cross-device link", "Permission denied"],
            ),
            "store" | "secrets" => {
                refused(what, text, &["Permission denied", "No such file"]);
                assert!(!text.contains("s3cr3t-sandbox-value"), "{what}: {text}");
                assert!(!text.contains("SQLite format"), "{what}: {text}");
            }
            "tcp" | "udp" => refused(what, text, &["Network is unreachable", "unreachable"]),
            "memory" => refused(what, text, &["MemoryError"]),
            // The process limit stops the bomb: either the shell cannot fork the
            // final `sleep` and gives up, or the bombs keep it busy until the timeout.
            "fork bomb" => refused(
                what,
                text,
                &[
                    "timed out after",
                    "Cannot fork",
                    "Resource temporarily unavailable",
                ],
            ),
            "ignores SIGTERM" => refused(what, text, &["timed out after"]),
            other => panic!("unknown attempt {other}"),
        }
    }

    // Nothing outside changed; nothing reached the listeners.
    let after: Vec<String> = std::fs::read_dir(outside.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
        .collect();
    assert_eq!(after, before, "files appeared outside the workspace");
    assert_eq!(
        std::fs::read_to_string(outside.path().join("target.txt")).unwrap(),
        "outside original\n"
    );
    assert!(tcp.accept().is_err(), "a TCP connection got through");
    let mut buf = [0u8; 8];
    assert!(
        udp.recv_from(&mut buf).is_err(),
        "a UDP datagram got through"
    );
    assert!(!f.path("hard.txt").exists());
    // The grandchild that ignored SIGTERM and left its session died with the command.
    std::thread::sleep(Duration::from_secs(5));
    assert!(
        !f.path("late.txt").exists(),
        "a grandchild outlived the command's timeout"
    );
    assert_eq!(state(&f.status(&id)), "completed");
}

#[test]
fn the_secret_scan_verifier_refuses_a_change_that_writes_a_secret() {
    let outside = tempfile::tempdir().unwrap();
    let script = [
        json!({"tool": "run", "args": {"command": "echo \"token=$TOKEN\" > config.txt"}}),
        json!({"tool": "finish", "args": {"summary": "configured"}}),
    ];
    let path = outside.path().join("script.jsonl");
    let text: Vec<String> = script.iter().map(|l| l.to_string()).collect();
    std::fs::write(&path, text.join("\n") + "\n").unwrap();
    let f = Fixture::new(&format!(
        r#"
[task]
goal = "config.txt is written."

[driver]
kind = "script"
script = "{}"

[[verify]]
name = "no-secrets"
tier = "acceptance"
run = "keel:secret-scan"

[[phase]]
name = "configure"
kind = "agent"
objective = "Write the config."
tools = ["run", "configure", "finish"]
done_when = []

[[tool]]
name = "configure"
description = "Writes the configuration, with the token."
run = ["sh", "-c", "printf 'a\\ntoken=%s\\n' \"$TOKEN\" > config.txt"]
secrets = ["TOKEN"]
reversibility = "reversible"
"#,
        path.display()
    ));
    let out = f
        .keel()
        .args(["run", "keel.toml"])
        .env("TOKEN", "s3cr3t-scan-value-123")
        .output()
        .unwrap();
    // The `run` tool does not see TOKEN (only the tool that declares it does), so the file
    // holds an empty token: the scan passes.
    assert_eq!(out.status.code(), Some(0), "{}", f.explain(&out));
    assert_eq!(
        std::fs::read_to_string(f.path("config.txt")).unwrap(),
        "token=\n"
    );

    // A change that does add the value (through the tool that sees it) and a credential is
    // refused, naming file and line. (A value the driver writes in a call's arguments never
    // reaches the command: the recorded reply holds `[secret:TOKEN]` instead.)
    let g = Fixture::new(&std::fs::read_to_string(f.path("keel.toml")).unwrap());
    let script2 = [
        json!({"tool": "configure", "args": {}}),
        json!({"tool": "run", "args": {"command": "echo key=AKIAIOSFODNN7EXAMPLE > creds.txt"}}),
        json!({"tool": "finish", "args": {"summary": "configured"}}),
    ];
    let text: Vec<String> = script2.iter().map(|l| l.to_string()).collect();
    std::fs::write(&path, text.join("\n") + "\n").unwrap();
    let out = g
        .keel()
        .args(["run", "keel.toml"])
        .env("TOKEN", "s3cr3t-scan-value-123")
        .output()
        .unwrap();
    assert_ne!(out.status.code(), Some(0), "{}", g.explain(&out));
    let id = String::from_utf8_lossy(&out.stdout)
        .lines()
        .next()
        .unwrap()
        .strip_prefix("run ")
        .unwrap()
        .trim()
        .to_string();
    let events = g.events(&id);
    let evidence: Vec<&Value> = events
        .iter()
        .filter(|e| e["kind"] == "evidence_recorded")
        .collect();
    let last = &evidence.last().unwrap()["body"]["evidence"];
    assert_eq!(last["verifier"], "no-secrets");
    assert_eq!(last["passed"], false, "{last:#}");
    let hash = last["output"].as_str().unwrap();
    let report = String::from_utf8(g.artifact(hash)).unwrap();
    assert!(
        report.contains("config.txt:2: the value of secret TOKEN"),
        "{report}"
    );
    assert!(
        report.contains("creds.txt:1:") && report.contains("aws-access-key-id"),
        "{report}"
    );
    assert!(!report.contains("s3cr3t-scan-value-123"), "{report}");
    assert_ne!(state(&g.status(&id)), "completed");
}
