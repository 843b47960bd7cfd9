//! Network namespaces kept for the next command, when keel runs as root.
//!
//! A command without network gets a network namespace whose only interface, loopback, is
//! down. Made with every command and released after it, such a namespace is most of what a
//! short command costs the machine: the kernel registers a loopback device and the sysctl
//! tables of every protocol for each new namespace (`copy_net_ns`), and tears them down in a
//! worker afterwards (`cleanup_net`); in `keel-bench`'s 1,000 runs the two were 7% of all the
//! CPU the machine spent.
//!
//! So, as root, the caller makes them itself (a short-lived thread unshares a network namespace
//! and the process keeps a descriptor of it) and hands one to each command without network;
//! once the command's helper has exited by itself (its first stage exits only when every
//! process of the command is gone, so nothing holds a socket there any more) the namespace is
//! kept for the next command of this process, at most [`KEPT`](crate::private::KEPT) of them.
//! One command at a time uses a namespace, never two at once: two commands never share a port
//! or an abstract unix socket.
//!
//! What a command could leave behind in it, it cannot: it has no capabilities in it (none at
//! all), so it cannot bring an interface up, add one, or set a route or a filter, and Landlock
//! refuses it every write under `/proc/sys`; with no interface up it cannot open a connection,
//! so no socket outlives its processes. The counters under `/proc/net` do carry over (how many
//! datagrams could not be routed, say); they are no new channel between commands, whose reads
//! the sandbox does not restrict anyway (a command reads the workspace another wrote). Stage 1
//! still checks, before it uses a kept namespace, that loopback is its only interface and is
//! down; if not (or if it cannot enter the namespace at all), it makes a fresh one for the
//! command and leaves [`SPOILED`] in the private directory, and the caller drops that namespace
//! instead of keeping it.
//!
//! Not as root, the helper makes a user namespace, and the network namespace must belong to it:
//! each command gets a fresh one as before.

use std::fs::File;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::PathBuf;
use std::sync::{Mutex, PoisonError};

use nix::sched::{CloneFlags, unshare};

use crate::private::KEPT;

/// The marker stage 1 leaves in the private directory when it could not enter the namespace it
/// was given or found it not as made (it ran the command in a fresh one): the caller drops it.
pub(crate) const SPOILED: &str = "net-spoiled";

/// Kept namespaces, ready for the next command.
static POOL: Mutex<Vec<OwnedFd>> = Mutex::new(Vec::new());

/// A network namespace for one command: a kept one, or a new one. `None` when one cannot be
/// made here (not root, or the kernel refuses): the helper then makes the command's own, as it
/// would without a pool, and reports whatever is wrong.
pub(crate) fn take() -> Option<OwnedFd> {
    if !nix::unistd::geteuid().is_root() {
        return None;
    }
    let kept = POOL.lock().unwrap_or_else(PoisonError::into_inner).pop();
    kept.or_else(make)
}

/// Keeps `net` for a later command. Only for a namespace whose command has ended with every
/// process of it (the helper exited by itself) and that stage 1 did not find spoiled.
pub(crate) fn keep(net: OwnedFd) {
    let mut pool = POOL.lock().unwrap_or_else(PoisonError::into_inner);
    if pool.len() < KEPT {
        pool.push(net);
    }
}

/// Where the helper opens the namespace `net` of this process.
pub(crate) fn path(net: &OwnedFd) -> PathBuf {
    PathBuf::from(format!(
        "/proc/{}/fd/{}",
        std::process::id(),
        net.as_raw_fd()
    ))
}

/// A new network namespace: a thread of its own unshares it (this changes only that thread's
/// namespace, and the thread ends right after), and the descriptor keeps it.
fn make() -> Option<OwnedFd> {
    let made = std::thread::Builder::new()
        .name("keel-netns".into())
        .spawn(|| {
            unshare(CloneFlags::CLONE_NEWNET).ok()?;
            File::open("/proc/thread-self/ns/net")
                .ok()
                .map(OwnedFd::from)
        })
        .ok()?
        .join();
    made.ok().flatten()
}

/// How many namespaces are kept now (for tests).
#[doc(hidden)]
pub fn kept() -> usize {
    POOL.lock().unwrap_or_else(PoisonError::into_inner).len()
}
