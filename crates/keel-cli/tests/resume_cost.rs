//! Resume reads the newest checkpoint and the events after it, never the history before it: its
//! cost does not grow with the length of the log. Shown structurally: after the history before
//! the checkpoint is removed from the store, resume still continues the run to the same end.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{Fixture, fault_points, state};

fn contract(history_steps: usize) -> String {
    let steps: Vec<String> = (0..history_steps)
        .map(|i| format!("\"echo {i} >> history.txt\""))
        .collect();
    format!(
        r#"
[task]
goal = "A long history, then one more phase."

[[verify]]
name = "done"
tier = "acceptance"
run = "test -f last.txt"

[[phase]]
name = "history"
kind = "command"
run = [{}]

[[phase]]
name = "last"
kind = "command"
run = ["echo last > last.txt"]
"#,
        steps.join(", ")
    )
}

/// Kills the run right after the `history` phase's checkpoint, removes every event before that
/// checkpoint, and resumes. Returns how many events were removed.
fn resume_without_history(history_steps: usize) -> usize {
    let text = contract(history_steps);
    let points = fault_points(&text);
    // The fault point right after the commit of checkpoint 1 (the end of `history`): the second
    // "snapshot written" is followed by its "before commit" and "after commit".
    let second_snapshot = points
        .iter()
        .enumerate()
        .filter(|(_, p)| p.as_str() == "snapshot written")
        .nth(1)
        .map(|(i, _)| i + 1)
        .unwrap();
    let crash_at = second_snapshot + 2;
    assert_eq!(points[crash_at - 1], "after commit");

    let f = Fixture::new(&text);
    let (id, out) = f.start(&[("KEEL_CRASH_AT", crash_at.to_string())]);
    assert_eq!(
        out.status.code(),
        None,
        "the run was killed: {}",
        f.explain(&out)
    );
    let db = f.db();
    let checkpoint_seq: i64 = db
        .query_row(
            "SELECT seq FROM checkpoints WHERE run_id = ?1 AND n = 1",
            [&id],
            |r| r.get(0),
        )
        .unwrap();
    let before = f.stored_events(&id).len();
    f.remove_events(&id, |seq| (seq as i64) < checkpoint_seq);
    let removed = before - f.stored_events(&id).len();
    // The older checkpoint goes too: resume must not need it.
    db.execute("DELETE FROM checkpoints WHERE run_id = ?1 AND n = 0", [&id])
        .unwrap();
    drop(db);

    let out = f.expect(&["resume", &id], 0);
    assert!(String::from_utf8_lossy(&out.stdout).contains("completed"));
    let status = f.status(&id);
    assert_eq!(state(&status), "completed");
    let history = std::fs::read_to_string(f.path("history.txt")).unwrap();
    assert_eq!(
        history.lines().count(),
        history_steps,
        "no history step ran again"
    );
    removed
}

#[test]
fn resume_does_not_read_the_history_before_its_checkpoint() {
    let short = resume_without_history(2);
    let long = resume_without_history(120);
    // The long run had far more history, and resume needed none of it in either case.
    assert!(long > short * 20, "removed {long} vs {short} events");
}
