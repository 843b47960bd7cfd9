//! Fixtures shared by keel's tests and benchmarks. Nothing in keel depends on this crate except
//! tests and `keel-bench`.

pub mod fuzz;
pub mod invariants;
pub mod mcp;
pub mod model_server;
pub mod priority;
pub mod rng;
pub mod service;
pub mod survey;
