//! A binary that is only the sandbox helper, for this crate's tests (and tools that have no
//! binary of their own to re-execute): they run `Sandbox::new(path_of_this_binary)`. keel's own
//! small helper, `keel-sandbox-helper`, is keel-cli's.
//!
//! With `--run-one <workspace>` it is instead a program that runs `cat /proc/self/cgroup` in
//! the sandbox in `<workspace>` (started with `PrivateTmp::spawn`, as keel starts its
//! commands), prints the command's `TMPDIR`, what is kept, and exits normally: the tests see that
//! the private directory and the cgroup kept for a next command are removed when the process
//! exits.

fn main() {
    let mut args = std::env::args().skip(1);
    if args.next().as_deref() == Some("--run-one") {
        let workspace = args.next().unwrap_or_default();
        std::process::exit(run_one(&workspace));
    }
    keel_sandbox::helper_main("keel-sandbox-test-helper")
}

fn run_one(workspace: &str) -> i32 {
    let Ok(exe) = std::env::current_exe() else {
        return 2;
    };
    let policy = keel_sandbox::Policy {
        workspace: workspace.into(),
        writable: Vec::new(),
        hidden: Vec::new(),
        network: false,
        limits: keel_sandbox::Limits::default(),
        env: vec![("PATH".into(), "/usr/bin:/bin".into())],
        argv: vec!["cat".into(), "/proc/self/cgroup".into()],
    };
    let ran = keel_sandbox::Sandbox::new(exe)
        .command(&policy)
        .and_then(|(cmd, mut tmp)| {
            let io = |source| keel_sandbox::SandboxError::Io {
                what: "run cat".into(),
                source,
            };
            let status = tmp.spawn(cmd).and_then(|mut c| c.wait()).map_err(io)?;
            if status.code().is_some() {
                tmp.helper_exited();
            }
            Ok((status, tmp))
        });
    match ran {
        Ok((status, tmp)) if status.success() => {
            println!("{}", tmp.path().display());
            drop(tmp);
            println!("kept {}", keel_sandbox::kept_private_dirs());
            println!("cgroups kept {}", keel_sandbox::kept_cgroups());
            0
        }
        Ok((status, _)) => {
            eprintln!("cat ended {status}");
            1
        }
        Err(e) => {
            eprintln!("{e}");
            1
        }
    }
}
