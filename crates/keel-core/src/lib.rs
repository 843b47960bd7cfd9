//! keel-core: the pure domain of keel. No I/O, no async runtime, no clock: time is passed in.
//!
//! - [`contract`]: the task contract, parsed in two phases (raw TOML, then a validated type).
//! - [`state`]: run and step state machines as transition tables.
//! - [`event`]: the versioned event vocabulary and the hash chain.
//! - [`run`]: the run projection as a fold over events, budget checks, and the next move.
//! - [`checkpoint`], [`fingerprint`], [`budget`], [`errorfp`]: the models they use.

pub mod agent;
pub mod budget;
pub mod checkpoint;
pub mod context;
pub mod contract;
pub mod effect;
pub mod errorfp;
pub mod event;
pub mod fingerprint;
pub mod invariant;
pub mod run;
pub mod secret;
pub mod state;
pub mod time;
pub mod tools;

/// keel's version, recorded in fingerprints and run_created events.
pub const KEEL_VERSION: &str = env!("CARGO_PKG_VERSION");
