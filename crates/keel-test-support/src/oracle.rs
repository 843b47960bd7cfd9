//! What each of keel's parsers of outside input must do with any input it is given: the checks
//! (oracles) that keel's property tests and its coverage-guided fuzz targets (`fuzz/`) share, so
//! that a fuzzer's input is held to exactly the promises the tests hold a generated one to.

pub mod api;
pub mod contract;
pub mod drivers;
pub mod events;
mod json;
pub mod llm;
pub mod mcp;
pub mod store;
