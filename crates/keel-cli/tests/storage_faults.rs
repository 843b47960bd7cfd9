//! Storage faults, each detected and none silently repaired or panicked over:
//!
//! - a write-ahead log cut at any byte inside its last transaction's frames (a torn last write)
//!   rolls back to the transaction before it, and resume completes;
//! - a byte flipped anywhere in the database file is reported (by `verify-log`, by resume, or as
//!   SQLite's own corruption error in keel's words), never panicked over, and never completed
//!   over without a trace;
//! - a real full disk (a small tmpfs holding the store) stops the run with "database or disk is
//!   full", and once space is freed resume completes;
//! - an I/O error on a commit (`KEEL_STORE_FAULT=commit-error@N`), a commit made durable whose
//!   caller is told it failed (`commit-lost-ack@N`), and a failing artifact fsync
//!   (`artifact-fsync@N`) stop the run with an error naming the store and what failed, and a
//!   later resume reads the facts from disk and completes with no step verified twice.
//!
//! Random choices are seeded; the seed is printed (`KEEL_TEST_SEED` replays it).

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Output;

use common::{
    ALL_LETTERS, Fixture, LETTERS_CONTRACT as CONTRACT, Rng, after_step_verified, assert_no_panic,
    fault_points, killed_at, kinds, of_kind, state, stderr, stdout,
};
use serde_json::Value;

/// The run completed, every letter is in the workspace once, each step was verified exactly
/// once, and the log verifies with every invariant holding.
fn expect_completed_once(f: &Fixture, id: &str, context: &str) {
    let status = f.status(id);
    assert_eq!(state(&status), "completed", "{context}: {status:#}");
    assert_eq!(
        std::fs::read_to_string(f.path("marker.txt")).unwrap(),
        ALL_LETTERS,
        "{context}: every step's change is there once"
    );
    let events = f.events(id);
    let mut verified: BTreeMap<String, usize> = BTreeMap::new();
    for e in of_kind(&events, "step_verified") {
        *verified.entry(e["body"]["step"].to_string()).or_default() += 1;
    }
    assert_eq!(verified.len(), 4, "{context}: {:?}", kinds(&events));
    assert!(
        verified.values().all(|&n| n == 1),
        "{context}: a step was verified twice: {verified:?}"
    );
    // `verify_log_ok` also runs keel-test-support's invariant checker.
    f.verify_log_ok(id);
}

// ---------------------------------------------------------------------------------------------
// A torn last write: the WAL cut inside its last transaction
// ---------------------------------------------------------------------------------------------

/// The frames of a write-ahead log: `(offset, is_commit)` of each, and the frame size.
fn wal_frames(wal: &[u8]) -> (Vec<(u64, bool)>, u64) {
    assert!(wal.len() > 32, "the WAL holds frames");
    let page = u64::from(u32::from_be_bytes(wal[8..12].try_into().unwrap()));
    let frame = 24 + page;
    let len = wal.len() as u64;
    assert_eq!((len - 32) % frame, 0, "the WAL is made of whole frames");
    let frames = (0..(len - 32) / frame)
        .map(|i| {
            let at = 32 + i * frame;
            let size =
                u32::from_be_bytes(wal[at as usize + 4..at as usize + 8].try_into().unwrap());
            (at, size != 0)
        })
        .collect();
    (frames, frame)
}

/// Events of run `id` in a scratch copy of the database with this WAL.
fn events_with_wal(db: &Path, wal: &[u8], id: &str) -> u64 {
    let scratch = tempfile::tempdir().unwrap();
    std::fs::copy(db, scratch.path().join("keel.db")).unwrap();
    std::fs::write(scratch.path().join("keel.db-wal"), wal).unwrap();
    let conn = rusqlite::Connection::open(scratch.path().join("keel.db")).unwrap();
    common::count_events(&conn, Some(id))
}

/// Puts the store back to the killed run's files (database and WAL, no shared-memory index)
/// and the workspace back to its tree, so that another cut can be tried on the same run.
fn restore(f: &Fixture, db: &[u8], wal: &[u8], marker: &str) {
    let _ = std::fs::remove_file(f.path(".keel/keel.db-shm"));
    std::fs::write(f.path(".keel/keel.db"), db).unwrap();
    std::fs::write(f.path(".keel/keel.db-wal"), wal).unwrap();
    std::fs::write(f.path("marker.txt"), marker).unwrap();
    // The marker is the commands' work, put back as the crash left it: their noted end comes
    // after it, as it did then (a later change would be someone else's, and is kept).
    for entry in std::fs::read_dir(f.path(".keel/tmp")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "ended") {
            std::fs::write(&path, "every process of the command is gone\n").unwrap();
        }
    }
}

#[test]
fn a_wal_cut_anywhere_in_its_last_transaction_rolls_back_to_the_one_before() {
    let mut rng = Rng::seeded("wal cut sweep");
    let f = Fixture::new(CONTRACT);
    let id = killed_at(&f, after_step_verified(&fault_points(CONTRACT), 2));
    // Nothing has opened the store since the kill: the WAL still holds every transaction.
    let db_path = f.path(".keel/keel.db");
    let db = std::fs::read(&db_path).unwrap();
    let wal = std::fs::read(f.path(".keel/keel.db-wal")).unwrap();
    let marker = std::fs::read_to_string(f.path("marker.txt")).unwrap();
    let (frames, frame) = wal_frames(&wal);
    let commits: Vec<u64> = frames.iter().filter(|f| f.1).map(|f| f.0).collect();
    assert!(commits.len() >= 2, "several transactions in the WAL");
    let last_commit = *commits.last().unwrap();
    assert_eq!(
        last_commit + frame,
        wal.len() as u64,
        "the WAL ends with a commit"
    );
    // The last transaction starts after the commit frame before it.
    let start = commits[commits.len() - 2] + frame;
    let end = wal.len() as u64;
    let whole = events_with_wal(&db_path, &wal, &id);
    let before = events_with_wal(&db_path, &wal[..start as usize], &id);
    assert!(before < whole, "the last transaction appended events");

    // Both edges, every frame boundary inside, and seeded offsets anywhere in between.
    let mut cuts: Vec<u64> = vec![
        start,
        start + 1,
        end - 1,
        end - frame + 24,
        end - frame + 23,
    ];
    cuts.extend((start..end).step_by(frame as usize).skip(1));
    for _ in 0..6 {
        cuts.push(rng.range(start, end));
    }
    cuts.sort_unstable();
    cuts.dedup();
    eprintln!(
        "last transaction: bytes {start}..{end} ({} frames); cuts {cuts:?}",
        (end - start) / frame
    );
    for cut in cuts {
        let context = format!("WAL cut at byte {cut} (last transaction {start}..{end})");
        restore(&f, &db, &wal[..cut as usize], &marker);
        let out = f.run(&["verify-log", &id]);
        assert_no_panic(&out, &context);
        assert_eq!(out.status.code(), Some(0), "{context}\n{}", f.explain(&out));
        let count = common::count_events(&f.db(), Some(&id));
        assert_eq!(
            count, before,
            "{context}: the store holds exactly the transactions before the torn one"
        );
        let out = f.run(&["resume", &id]);
        assert_no_panic(&out, &context);
        assert_eq!(out.status.code(), Some(0), "{context}\n{}", f.explain(&out));
        expect_completed_once(&f, &id, &context);
    }
}

// ---------------------------------------------------------------------------------------------
// A flipped byte anywhere in the database file
// ---------------------------------------------------------------------------------------------

/// The rows the run's facts are made of: events, checkpoints and the contract texts. `Err` when
/// SQLite cannot read them.
fn facts(db: &Path, id: &str) -> Result<Vec<String>, String> {
    let conn =
        rusqlite::Connection::open_with_flags(db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
            .map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    for sql in [
        "SELECT CAST(first_seq || '|' || last_seq || '|' || codec || '|' || hex(events) || '|' || hex(coalesce(blobs, '')) AS BLOB) FROM log WHERE run_id = ?1 ORDER BY last_seq",
        "SELECT CAST(n || '|' || seq || '|' || hash || '|' || body AS BLOB) FROM checkpoints WHERE run_id = ?1 ORDER BY n",
        "SELECT CAST(hash || '|' || source AS BLOB) FROM contracts WHERE ?1 IS NOT NULL ORDER BY hash",
    ] {
        let mut stmt = conn.prepare(sql).map_err(|e| e.to_string())?;
        let rows = stmt
            .query_map([id], |r| r.get::<_, Vec<u8>>(0))
            .map_err(|e| e.to_string())?;
        for r in rows {
            out.push(String::from_utf8_lossy(&r.map_err(|e| e.to_string())?).into_owned());
        }
    }
    Ok(out)
}

/// keel stopped with an error in words: non-zero, `error:` on stderr, no panic.
fn expect_clear_error(out: &Output, context: &str) {
    assert_no_panic(out, context);
    let err = stderr(out);
    assert!(
        err.contains("error:") && err.trim().len() > "error:".len(),
        "{context}: keel failed without saying why ({:?})\n{err}\n--- stdout\n{}",
        out.status,
        stdout(out)
    );
}

#[test]
fn a_flipped_byte_anywhere_in_the_database_is_reported_never_completed_over() {
    let mut rng = Rng::seeded("database byte flips");
    let f = Fixture::new(CONTRACT);
    let id = killed_at(&f, after_step_verified(&fault_points(CONTRACT), 3));
    let db_path = f.path(".keel/keel.db");
    // Fold the WAL into the database file, so that the file holds every page.
    {
        let conn = rusqlite::Connection::open(&db_path).unwrap();
        conn.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()))
            .unwrap();
    }
    let _ = std::fs::remove_file(f.path(".keel/keel.db-wal"));
    let _ = std::fs::remove_file(f.path(".keel/keel.db-shm"));
    let pristine = std::fs::read(&db_path).unwrap();
    let pristine_facts = facts(&db_path, &id).unwrap();
    let marker = std::fs::read_to_string(f.path("marker.txt")).unwrap();
    let page = u16::from_be_bytes(pristine[16..18].try_into().unwrap()) as usize;
    let page = if page == 1 { 65536 } else { page };
    let pages = pristine.len() / page;

    let mut outcomes: BTreeMap<&str, usize> = BTreeMap::new();
    for trial in 0..20 {
        // One flip per page-sized region, anywhere in it: headers, cells, free space.
        let offset = rng.range(0, pristine.len() as u64) as usize;
        let mask = rng.range(1, 256) as u8;
        let context = format!(
            "trial {trial}: byte {offset} (page {} of {pages}) xor {mask:#04x}",
            offset / page + 1
        );
        let _ = std::fs::remove_file(f.path(".keel/keel.db-wal"));
        let _ = std::fs::remove_file(f.path(".keel/keel.db-shm"));
        let mut damaged = pristine.clone();
        damaged[offset] ^= mask;
        std::fs::write(&db_path, &damaged).unwrap();
        std::fs::write(f.path("marker.txt"), &marker).unwrap();
        let now = facts(&db_path, &id);
        let log_damaged = now != Ok(pristine_facts.clone());
        let changed_fact = match &now {
            Ok(rows) => rows
                .iter()
                .zip(&pristine_facts)
                .find(|(a, b)| a != b)
                .map(|(a, _)| a.chars().take(120).collect::<String>())
                .unwrap_or_else(|| {
                    format!("{} rows instead of {}", rows.len(), pristine_facts.len())
                }),
            Err(e) => e.clone(),
        };

        let verify = f.run(&["verify-log", &id]);
        assert_no_panic(&verify, &context);
        match verify.status.code() {
            Some(0) => assert!(
                !log_damaged,
                "{context}: the run's facts changed ({changed_fact}) and verify-log says the log is whole\n{}",
                f.explain(&verify)
            ),
            Some(5) => assert!(stdout(&verify).contains("DAMAGED"), "{context}"),
            _ => expect_clear_error(&verify, &context),
        }

        let resume = f.run(&["resume", &id]);
        assert_no_panic(&resume, &context);
        let outcome = match resume.status.code() {
            Some(0) => {
                // Completed: the damage was outside the run's facts (a projection, rebuilt from
                // the log), or it was a torn last event cut with a logged `tail_cut`, or it lies
                // before the newest checkpoint, which resume does not read, and verify-log still
                // reports it.
                let events = f.events(&id);
                assert_eq!(state(&f.status(&id)), "completed", "{context}");
                let cut = !of_kind(&events, "tail_cut").is_empty();
                let still_reported = f.run(&["verify-log", &id]).status.code() != Some(0);
                assert!(
                    !log_damaged || cut || still_reported,
                    "{context}: resume completed over damage to the run's facts without a trace\n{}",
                    f.explain(&resume)
                );
                if !log_damaged {
                    assert_eq!(
                        std::fs::read_to_string(f.path("marker.txt")).unwrap(),
                        ALL_LETTERS,
                        "{context}"
                    );
                }
                if cut {
                    "completed after a logged tail cut"
                } else if log_damaged {
                    "completed; damage before the checkpoint still reported"
                } else {
                    "completed; the run's facts were intact"
                }
            }
            Some(5) => {
                assert!(
                    stderr(&resume).contains("damaged"),
                    "{context}\n{}",
                    f.explain(&resume)
                );
                "refused: damaged log"
            }
            Some(3 | 4) => {
                // A verdict on the run instead of an error: only acceptable when the damage
                // changed the run's facts, and the reason must be stated.
                eprintln!("{context}: stopped as\n{}", f.explain(&resume));
                assert!(
                    log_damaged,
                    "{context}: a flip outside the run's facts changed its outcome\n{}",
                    f.explain(&resume)
                );
                "stopped waiting or blocked"
            }
            _ => {
                expect_clear_error(&resume, &context);
                eprintln!("{context}:\n{}", f.explain(&resume));
                "stopped with an error"
            }
        };
        eprintln!("{context}: {outcome}");
        *outcomes.entry(outcome).or_default() += 1;
    }
    eprintln!("outcomes: {outcomes:?}");
}

// ---------------------------------------------------------------------------------------------
// A real full disk
// ---------------------------------------------------------------------------------------------

/// Runs `script` (sh) in a private mount namespace, where it may mount a tmpfs. `None` when this
/// machine cannot make one (no unshare, no permission).
fn in_mount_namespace(script: &str, env: &[(&str, String)]) -> Option<Output> {
    use std::os::unix::fs::MetadataExt;
    let root = std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0);
    let mut cmd = std::process::Command::new("unshare");
    if root {
        cmd.arg("-m");
    } else {
        cmd.args(["-U", "-r", "-m"]);
    }
    cmd.args(["sh", "-c", script]);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.env_remove("KEEL_STORE")
        .env_remove("KEEL_CRASH_AT")
        .env_remove("KEEL_FAULT_TRACE");
    let probe = std::process::Command::new("unshare")
        .args(if root {
            vec!["-m"]
        } else {
            vec!["-U", "-r", "-m"]
        })
        .args([
            "sh",
            "-c",
            "d=$(mktemp -d) && mount -t tmpfs -o size=64k tmpfs \"$d\"",
        ])
        .output()
        .ok()?;
    if !probe.status.success() {
        eprintln!(
            "SKIPPED: cannot mount a tmpfs in a private mount namespace here: {}",
            String::from_utf8_lossy(&probe.stderr)
        );
        return None;
    }
    Some(cmd.output().expect("unshare runs"))
}

/// A phase whose last step fills the store's disk (once), leaving `free_kib` KiB, right before
/// the phase's verification and checkpoint.
fn full_disk_contract(mnt: &Path, free_kib: u64) -> String {
    let m = mnt.display();
    format!(
        r#"
[task]
goal = "Write the letters a to d into marker.txt."

[[verify]]
name = "letters"
tier = "acceptance"
run = "test -s marker.txt"

[[phase]]
name = "one"
kind = "command"
run = [
  "echo a >> marker.txt",
  "echo b >> marker.txt",
  "echo c >> marker.txt; if [ ! -e {m}/filled ]; then touch {m}/filled; head -c 64M /dev/zero > {m}/filler 2>/dev/null; truncate -s -{free_kib}K {m}/filler; fi; true",
]

[[phase]]
name = "two"
kind = "command"
run = ["echo d >> marker.txt"]

[sandbox]
mode = "off"
"#
    )
}

#[test]
fn a_full_disk_stops_the_run_with_a_clear_error_and_resume_completes_once_space_is_freed() {
    let keel = common::keel_bin();
    for free_kib in [0u64, 24, 64, 160] {
        let outside = tempfile::tempdir().unwrap();
        let mnt = outside.path().join("store");
        let saved = outside.path().join("saved");
        std::fs::create_dir_all(&mnt).unwrap();
        std::fs::create_dir_all(&saved).unwrap();
        let f = Fixture::new(&full_disk_contract(&mnt, free_kib));
        // Everything happens inside one namespace: the tmpfs lives as long as it does. The
        // outputs and a copy of the store are left outside for the checks.
        let script = r#"
set -u
mount -t tmpfs -o size=1536k tmpfs "$MNT" || exit 77
cd "$WS"
"$KEEL" --store "$MNT/keel.db" run keel.toml > "$SAVED/run.out" 2> "$SAVED/run.err"
echo $? > "$SAVED/run.code"
id=$(sed -n 's/^run //p' "$SAVED/run.out" | head -n 1)
echo "$id" > "$SAVED/id"
"$KEEL" --store "$MNT/keel.db" status "$id" --json > "$SAVED/full-status.json" 2>&1
rm -f "$MNT/filler"
"$KEEL" --store "$MNT/keel.db" verify-log "$id" > "$SAVED/verify.out" 2>&1
echo $? > "$SAVED/verify.code"
"$KEEL" --store "$MNT/keel.db" resume "$id" > "$SAVED/resume.out" 2> "$SAVED/resume.err"
echo $? > "$SAVED/resume.code"
cp -a "$MNT/keel.db" "$SAVED/" && { cp -a "$MNT/keel.db-wal" "$SAVED/" 2>/dev/null; true; }
cp -a "$MNT/artifacts" "$SAVED/" 2>/dev/null
true
"#;
        let Some(out) = in_mount_namespace(
            script,
            &[
                ("MNT", mnt.display().to_string()),
                ("WS", f.root().display().to_string()),
                ("SAVED", saved.display().to_string()),
                ("KEEL", keel.display().to_string()),
            ],
        ) else {
            return;
        };
        if out.status.code() == Some(77) {
            eprintln!("SKIPPED: the tmpfs could not be mounted: {}", stderr(&out));
            return;
        }
        let read = |name: &str| std::fs::read_to_string(saved.join(name)).unwrap_or_default();
        let context = format!(
            "disk full with {free_kib} KiB left\n--- run stdout\n{}\n--- run stderr\n{}\n--- status while full\n{}\n--- resume\n{}{}\n--- script\n{}",
            read("run.out"),
            read("run.err"),
            read("full-status.json"),
            read("resume.out"),
            read("resume.err"),
            stderr(&out)
        );
        let run_code: i32 = read("run.code").trim().parse().unwrap();
        let run_err = read("run.err");
        assert!(
            !run_err.contains("panicked") && run_code != 101 && run_code < 128,
            "{context}"
        );
        let id = read("id").trim().to_string();
        assert!(!id.is_empty(), "{context}");
        let full = run_code != 0;
        if full {
            assert_eq!(
                run_code, 1,
                "an internal error, not a verdict on the run: {context}"
            );
            assert!(
                run_err.contains("database or disk is full")
                    || run_err.contains("No space left on device"),
                "the error says the disk is full: {context}"
            );
            assert!(
                run_err.contains(&mnt.display().to_string()),
                "and where: {context}"
            );
        } else {
            eprintln!("with {free_kib} KiB left the run needed no more space: {context}");
        }
        assert_eq!(
            read("verify.code").trim(),
            "0",
            "no partial state: {context}"
        );
        assert_eq!(read("resume.code").trim(), "0", "{context}");
        // Check the store the namespace left behind, with the workspace as it is.
        let store = saved.join("keel.db");
        let status: Value = serde_json::from_slice(
            &f.keel()
                .args(["--store", store.to_str().unwrap(), "status", &id, "--json"])
                .output()
                .unwrap()
                .stdout,
        )
        .unwrap();
        assert_eq!(state(&status), "completed", "{context}");
        assert_eq!(
            std::fs::read_to_string(f.path("marker.txt")).unwrap(),
            ALL_LETTERS,
            "{context}"
        );
        let log: Value = serde_json::from_slice(
            &f.keel()
                .args(["--store", store.to_str().unwrap(), "log", &id, "--json"])
                .output()
                .unwrap()
                .stdout,
        )
        .unwrap();
        let events = log.as_array().unwrap();
        let verified = of_kind(events, "step_verified");
        assert_eq!(verified.len(), 4, "each step verified once: {context}");
        if let Err(e) = keel_test_support::invariants::check(&store, &id) {
            panic!("{e}\n{context}");
        }
        eprintln!(
            "disk full with {free_kib} KiB left: {}",
            if full {
                run_err.lines().next().unwrap_or("").to_string()
            } else {
                "no error".to_string()
            }
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Injected I/O errors: KEEL_STORE_FAULT
// ---------------------------------------------------------------------------------------------

/// How many commits and artifact writes a whole run of `contract` makes (from a twin run with
/// `KEEL_STORE_FAULT_TRACE`).
fn store_writes(contract: &str) -> (u64, u64) {
    let f = Fixture::new(contract);
    let outside = tempfile::tempdir().unwrap();
    let trace = outside.path().join("trace");
    let (_, out) = f.start(&[("KEEL_STORE_FAULT_TRACE", trace.display().to_string())]);
    assert_eq!(out.status.code(), Some(0), "{}", f.explain(&out));
    let count = |what: &str| common::traced(&trace, what) as u64;
    (count("commit"), count("artifact"))
}

/// Runs the contract with `fault` injected and checks how keel stopped. Returns the run id (if
/// the run was created) and the number of events the store holds afterwards.
fn run_with_fault(f: &Fixture, fault: &str, names: &[&str]) -> (Option<String>, u64) {
    let out = f
        .keel()
        .args(["run", "keel.toml"])
        .env("KEEL_STORE_FAULT", fault)
        .output()
        .unwrap();
    let context = format!("KEEL_STORE_FAULT={fault}");
    assert_no_panic(&out, &context);
    assert_eq!(out.status.code(), Some(1), "{context}\n{}", f.explain(&out));
    let err = stderr(&out);
    for name in names {
        assert!(
            err.contains(name),
            "{context}: the error should name `{name}`\n{}",
            f.explain(&out)
        );
    }
    let id = stdout(&out)
        .lines()
        .next()
        .and_then(|l| l.strip_prefix("run "))
        .map(|s| s.trim().to_string());
    let events = if f.path(".keel/keel.db").exists() {
        common::count_events(&f.db(), None)
    } else {
        0
    };
    (id, events)
}

/// After a fault: resume (or a new run, if none was created) completes, each step verified once.
fn resume_completes(f: &Fixture, id: Option<String>, context: &str) {
    let id = match id {
        Some(id) => {
            let out = f.run(&["resume", &id]);
            assert_no_panic(&out, context);
            assert_eq!(out.status.code(), Some(0), "{context}\n{}", f.explain(&out));
            id
        }
        None => {
            // The run was never created: nothing is in the store, and a new run goes through.
            let runs: u64 = f
                .db()
                .query_row("SELECT count(*) FROM runs", [], |r| r.get(0))
                .unwrap_or(0);
            assert_eq!(runs, 0, "{context}: no half-created run");
            let (id, out) = f.start(&[]);
            assert_eq!(out.status.code(), Some(0), "{context}\n{}", f.explain(&out));
            id
        }
    };
    expect_completed_once(f, &id, context);
}

#[test]
fn a_commit_that_fails_or_loses_its_acknowledgement_stops_the_run_and_resume_completes() {
    let mut rng = Rng::seeded("commit faults");
    let (commits, _) = store_writes(CONTRACT);
    assert!(commits > 10, "{commits} commits");
    // The first commit (the run's creation), the last (its completion), and a seeded sample.
    let mut ns = vec![1, 2, commits];
    while ns.len() < 7 {
        ns.push(rng.range(3, commits));
    }
    ns.sort_unstable();
    ns.dedup();
    eprintln!("{commits} commits in a whole run; faults at {ns:?}");
    for n in ns {
        let store = ".keel/keel.db";
        let f = Fixture::new(CONTRACT);
        let (id, failed) = run_with_fault(
            &f,
            &format!("commit-error@{n}"),
            &[store, "disk I/O error", "fsync", "commit-error"],
        );
        let g = Fixture::new(CONTRACT);
        let (lost_id, durable) = run_with_fault(
            &g,
            &format!("commit-lost-ack@{n}"),
            &[store, "disk I/O error", "fsync", "commit-lost-ack"],
        );
        // The caller cannot tell the two apart; the disk can: the failed commit left nothing,
        // the one whose acknowledgement was lost is there.
        assert!(
            durable > failed,
            "commit {n}: {durable} events after a lost acknowledgement, {failed} after a failed commit"
        );
        assert_eq!(id.is_some(), n > 1);
        // A lost acknowledgement of the run's creation: keel could not say the id, but the run
        // is in the store (`keel status` lists it) and resumes like any other.
        let lost_id = lost_id.or_else(|| {
            g.db()
                .query_row("SELECT id FROM runs", [], |r| r.get(0))
                .ok()
        });
        assert!(lost_id.is_some(), "commit-lost-ack@{n}: the run is durable");
        resume_completes(&f, id, &format!("commit-error@{n}"));
        resume_completes(&g, lost_id, &format!("commit-lost-ack@{n}"));
    }
}

#[test]
fn a_failing_artifact_fsync_stops_the_run_and_resume_completes() {
    let (_, artifacts) = store_writes(CONTRACT);
    assert!(artifacts >= 3, "{artifacts} artifact writes");
    for n in [1, artifacts / 2 + 1, artifacts] {
        let f = Fixture::new(CONTRACT);
        let fault = format!("artifact-fsync@{n}");
        let (id, _) = run_with_fault(&f, &fault, &[".keel/artifacts", "fsync failed", &fault]);
        let id = id.expect("the run exists");
        // No half-written blob is left under a hash name.
        for entry in walk(&f.path(".keel/artifacts")) {
            let name = entry.file_name().unwrap().to_string_lossy().into_owned();
            assert!(!name.ends_with(".tmp"), "{fault}: {name} left behind");
        }
        resume_completes(&f, Some(id.clone()), &fault);
        f.expect(&["verify-log", &id], 0);
    }
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}

#[test]
fn a_damaged_contract_text_is_reported_and_never_run() {
    // The run's contract is stored as its exact text under its hash, and resume runs that text:
    // a changed byte in it must be found, not obeyed (here it would rename the verifier's file).
    let f = Fixture::new(CONTRACT);
    let id = killed_at(&f, after_step_verified(&fault_points(CONTRACT), 2));
    let changed = f
        .db()
        .execute(
            "UPDATE contracts SET source = replace(source, 'test -s marker.txt', 'test -s marker.txx')",
            [],
        )
        .unwrap();
    assert_eq!(changed, 1);
    let out = f.expect(&["verify-log", &id], 5);
    assert!(
        stdout(&out).contains("DAMAGED") && stdout(&out).contains("contract"),
        "{}",
        f.explain(&out)
    );
    let before = f.events(&id).len();
    for _ in 0..2 {
        let out = f.expect(&["resume", &id], 5);
        let err = stderr(&out);
        assert!(
            err.contains("damaged") && err.contains("contract does not match its hash"),
            "{}",
            f.explain(&out)
        );
        assert_eq!(f.events(&id).len(), before, "nothing was written");
    }
}

/// A flipped byte can leave a stored text invalid UTF-8 (found by the byte-flip test: `keel log`
/// failed with a conversion error, exit 1). The text is read with the damage replaced, so the
/// hash chain names the event as altered: `verify-log` reports it (exit 5), and the commands
/// that only show the run still show it.
#[test]
fn an_event_that_is_no_longer_utf8_is_reported_as_damaged_not_a_read_error() {
    let f = Fixture::new(CONTRACT);
    let (id, out) = f.start(&[]);
    assert_eq!(out.status.code(), Some(0), "{}", f.explain(&out));
    // The row holding event 5, written back uncompressed with one byte of its body made 0xFF.
    let db = f.db();
    let (row, codec, bytes): (i64, i64, Vec<u8>) = db
        .query_row(
            "SELECT id, codec, events FROM log WHERE run_id = ?1 AND first_seq <= 5 \
             AND last_seq >= 5",
            [&id],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )
        .unwrap();
    let events = keel_store::log::decode_events(&id, codec, &bytes).unwrap();
    let body = &events.iter().find(|e| e.seq == 5).unwrap().body;
    let mut raw = keel_store::log::encode_events(&events);
    let at = raw
        .windows(body.len())
        .position(|w| w == body.as_bytes())
        .unwrap();
    raw[at + 5] = 0xFF;
    let n = db
        .execute(
            "UPDATE log SET codec = 0, events = ?2 WHERE id = ?1",
            rusqlite::params![row, raw],
        )
        .unwrap();
    assert_eq!(n, 1);
    drop(db);
    let out = f.run(&["verify-log", &id]);
    assert_no_panic(&out, "verify-log");
    assert_eq!(out.status.code(), Some(5), "{}", f.explain(&out));
    assert!(stdout(&out).contains("DAMAGED"), "{}", f.explain(&out));
    assert!(stdout(&out).contains('5'), "{}", f.explain(&out));
    for args in [["log", &id], ["status", &id]] {
        let out = f.run(&args);
        assert_no_panic(&out, "show");
        assert_eq!(out.status.code(), Some(0), "{args:?}\n{}", f.explain(&out));
    }
}

/// The store's database file with its write-ahead log folded in, so that the file holds every
/// page, and the WAL files removed.
fn folded_database(f: &Fixture) -> Vec<u8> {
    f.db()
        .query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()))
        .unwrap();
    let _ = std::fs::remove_file(f.path(".keel/keel.db-wal"));
    let _ = std::fs::remove_file(f.path(".keel/keel.db-shm"));
    std::fs::read(f.path(".keel/keel.db")).unwrap()
}

/// Found by the byte-flip test (byte 36868 xor 0xd7, the cell count in the header of the page
/// holding the `checkpoints` table): the run's checkpoint row vanished with no read error,
/// `verify-log` said "0 checkpoints" and ok, and resume rebuilt the run from the log's start.
/// Rebuilding from the log is right (a checkpoint only saves reading), but the lost row is
/// damage and must be reported: every checkpoint the log took has its row.
#[test]
fn a_checkpoint_row_lost_with_a_damaged_page_header_is_reported() {
    let f = Fixture::new(CONTRACT);
    let id = killed_at(&f, after_step_verified(&fault_points(CONTRACT), 3));
    let count = |f: &Fixture| -> i64 {
        f.db()
            .query_row(
                "SELECT count(*) FROM checkpoints WHERE run_id = ?1",
                [&id],
                |r| r.get(0),
            )
            .unwrap()
    };
    assert!(
        count(&f) >= 1,
        "the scenario takes a checkpoint by its third step"
    );
    let (root, page): (i64, i64) = f
        .db()
        .query_row(
            "SELECT rootpage, (SELECT page_size FROM pragma_page_size) FROM sqlite_master \
             WHERE name = 'checkpoints'",
            [],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .unwrap();
    let mut db = folded_database(&f);
    let header = (root - 1) as usize * page as usize;
    // A leaf page (of a table without rowid, stored as an index b-tree) that now claims no cells.
    assert_eq!(
        db[header], 0x0a,
        "the checkpoints table fits in one leaf page"
    );
    db[header + 3] = 0;
    db[header + 4] = 0;
    std::fs::write(f.path(".keel/keel.db"), &db).unwrap();
    assert_eq!(
        count(&f),
        0,
        "the damaged page hides the row without a read error"
    );

    let out = f.expect(&["verify-log", &id], 5);
    assert!(
        stdout(&out).contains("DAMAGED")
            && stdout(&out).contains("checkpoint 0 was taken in the log but its row is missing"),
        "{}",
        f.explain(&out)
    );
    let resume = f.run(&["resume", &id]);
    assert_no_panic(&resume, "resume");
    let again = f.run(&["verify-log", &id]);
    assert_no_panic(&again, "verify-log after resume");
    assert_ne!(
        again.status.code(),
        Some(0),
        "the lost row is still reported after resume ({:?})\n{}",
        resume.status,
        f.explain(&again)
    );
}

/// Found by the byte-flip test (400 trials, one byte in a row of the `log` table): the serial
/// type of the `blobs` column of a row that holds no blobs was changed so that the row "extends
/// off the end of the page". No read of such a row touches that column, so `verify-log` said ok
/// over a row SQLite cannot read whole. It now reads every row's `blobs` and checks that a row
/// holds blobs exactly when it names some.
#[test]
fn a_log_row_whose_unused_blobs_column_is_damaged_is_reported() {
    let f = Fixture::new(CONTRACT);
    let id = killed_at(&f, after_step_verified(&fault_points(CONTRACT), 3));
    let pristine = folded_database(&f);
    let db_path = f.path(".keel/keel.db");
    let blobs_read = |f: &Fixture| -> rusqlite::Result<Vec<bool>> {
        let db = f.db();
        let mut q = db.prepare("SELECT blobs IS NULL FROM log WHERE run_id = ?1")?;
        q.query_map([&id], |r| r.get(0))?.collect()
    };
    let events_read = |f: &Fixture| -> rusqlite::Result<usize> {
        let db = f.db();
        let mut q = db.prepare(
            "SELECT first_seq, last_seq, codec, events FROM log WHERE run_id = ?1 ORDER BY last_seq",
        )?;
        Ok(q.query_map([&id], |r| r.get::<_, Vec<u8>>(3))?.count())
    };
    assert!(blobs_read(&f).is_ok() && events_read(&f).is_ok());

    // A row's record header ends with the serial type of `blobs` (0, NULL, in a row with no
    // blobs) just before its body, which starts with the run id. Claim a 57-byte blob there,
    // in the first place where that leaves the events readable and the `blobs` column not.
    let run_id = id.as_bytes();
    let damaged = (1..pristine.len() - run_id.len())
        .filter(|&at| pristine[at - 1] == 0 && pristine[at..].starts_with(run_id))
        .find(|&at| {
            let mut db = pristine.clone();
            db[at - 1] = 0x7e;
            std::fs::write(&db_path, &db).unwrap();
            blobs_read(&f).is_err() && events_read(&f).is_ok()
        });
    assert!(
        damaged.is_some(),
        "no log row of the run holds the run id after its header"
    );

    let out = f.expect(&["verify-log", &id], 5);
    assert!(
        stdout(&out).contains("DAMAGED") && stdout(&out).contains("cannot be read"),
        "{}",
        f.explain(&out)
    );

    // A readable `blobs` in a row that names none is damage too.
    std::fs::write(&db_path, &pristine).unwrap();
    let changed = f
        .db()
        .execute(
            "UPDATE log SET blobs = x'00' WHERE id = (SELECT min(id) FROM log WHERE run_id = ?1)",
            [&id],
        )
        .unwrap();
    assert_eq!(changed, 1);
    let out = f.expect(&["verify-log", &id], 5);
    assert!(
        stdout(&out).contains("holds blobs but names none"),
        "{}",
        f.explain(&out)
    );
}
