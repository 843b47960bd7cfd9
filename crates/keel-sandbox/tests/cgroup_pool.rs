//! As root, a command's pids cgroup is made by the caller and kept for the next command once
//! the helper has exited by itself and no task is left in it, with the next command's limit;
//! otherwise it is removed. One test function in a file of its own: the kept cgroups are the
//! process's, and any other test with a process limit would take them.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{Fixture, forks_script, python, run_to_end};
use std::path::PathBuf;

/// The name of the command's cgroup, from what `cat /proc/self/cgroup` printed.
fn name_of(stdout: &str) -> Option<String> {
    let line = stdout.lines().find(|l| l.contains("keel-"))?;
    Some(line.rsplit('/').next()?.to_string())
}

/// How many tasks of this process are in the kept cgroup `dir` while no command runs: its
/// holder thread under cgroup v1 (which starts the commands' helpers inside the cgroup, see
/// keel-sandbox's `cgroup`), none under v2 (no `tasks` file).
fn held(dir: &std::path::Path) -> u64 {
    let Ok(tasks) = std::fs::read_to_string(dir.join("tasks")) else {
        return 0;
    };
    let tids: Vec<&str> = tasks.split_whitespace().collect();
    for tid in &tids {
        assert!(
            std::path::Path::new("/proc/self/task").join(tid).exists(),
            "task {tid} in {} is not a thread of this process",
            dir.display()
        );
    }
    tids.len() as u64
}

/// `pids.max` of `dir` for a command limited to `limit` tasks of its own: the helper's first
/// stage is there too, and under cgroup v1 the holder.
fn pids_max(dir: &std::path::Path, limit: u64) -> String {
    (limit + 1 + held(dir)).to_string()
}

/// The cgroup `name`'s directory, if it exists.
fn dir_of(name: &str) -> Option<PathBuf> {
    [
        "/sys/fs/cgroup/pids",
        "/sys/fs/cgroup/unified",
        "/sys/fs/cgroup",
    ]
    .iter()
    .map(|base| PathBuf::from(base).join(name))
    .find(|dir| dir.join("pids.max").exists())
}

#[test]
fn the_per_command_cgroup_is_kept_for_the_next_command_or_removed() {
    let f = Fixture::new();
    let mut policy = f.sh("cat /proc/self/cgroup");
    policy.limits.processes = Some(8);
    let first = run_to_end(&policy, false);
    let Some(name) = name_of(&first) else {
        eprintln!("SKIPPED: the command ran in no keel cgroup (not root): {first}");
        assert_eq!(keel_sandbox::kept_cgroups(), 0);
        return;
    };
    // Without word that the helper exited by itself, the cgroup is removed, not kept.
    assert_eq!(dir_of(&name), None, "{name} is still there");
    assert_eq!(keel_sandbox::kept_cgroups(), 0);

    // Exited by itself: kept, and the next command runs in it, with its own limit.
    let second = run_to_end(&policy, true);
    let kept = dir_of(&name_of(&second).unwrap()).expect("the cgroup was kept");
    assert_eq!(keel_sandbox::kept_cgroups(), 1);
    policy.limits.processes = Some(5);
    let third = run_to_end(&policy, true);
    assert_eq!(
        dir_of(&name_of(&third).unwrap()),
        Some(kept.clone()),
        "{third}"
    );
    assert_eq!(
        std::fs::read_to_string(kept.join("pids.max"))
            .unwrap()
            .trim(),
        pids_max(&kept, 5)
    );
    assert_eq!(keel_sandbox::kept_cgroups(), 1);
    if kept.starts_with("/sys/fs/cgroup/pids") {
        assert_eq!(
            held(&kept),
            1,
            "under cgroup v1 a holder thread stays in the kept cgroup"
        );
    }

    // The limit holds in a kept cgroup: python and 3 children make 4.
    let mut forks = f.policy(vec![python(), "-c".into(), forks_script(50)]);
    forks.limits.processes = Some(4);
    let forked = run_to_end(&forks, true);
    assert!(forked.contains("fork refused 11"), "{forked}");
    assert!(forked.contains("children 3"), "{forked}");
    assert_eq!(
        std::fs::read_to_string(kept.join("pids.max"))
            .unwrap()
            .trim(),
        pids_max(&kept, 4)
    );
    assert_eq!(keel_sandbox::kept_cgroups(), 1);

    // A command without a process limit gets none.
    let mut unlimited = f.sh("cat /proc/self/cgroup");
    unlimited.limits.processes = None;
    let free = run_to_end(&unlimited, true);
    assert_eq!(name_of(&free), None, "{free}");
    assert_eq!(keel_sandbox::kept_cgroups(), 1);
}

#[test]
fn the_kept_cgroup_is_removed_when_the_process_exits() {
    let f = Fixture::new();
    let stdout = common::run_one(&f.ws);
    let Some(name) = name_of(&stdout) else {
        eprintln!("SKIPPED: the command ran in no keel cgroup (not root): {stdout}");
        return;
    };
    assert!(stdout.contains("cgroups kept 1"), "{stdout}");
    let base = [
        "/sys/fs/cgroup/pids",
        "/sys/fs/cgroup/unified",
        "/sys/fs/cgroup",
    ];
    for dir in base.iter().map(|b| PathBuf::from(b).join(&name)) {
        assert!(
            !dir.exists(),
            "{} is left after the process exited",
            dir.display()
        );
    }
}
