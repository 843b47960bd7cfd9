//! keel-llm: thin, synchronous model clients of keel's own.
//!
//! - [`Client`] speaks OpenAI-compatible Chat Completions with tools (OpenAI, Ollama, vLLM,
//!   llama.cpp server) and the Anthropic Messages API with tool use. It works in three separate
//!   steps so that keel can store each one: [`Client::build_request`] makes the exact request
//!   body (deterministic), [`Client::send`] sends those bytes with retries and backoff, and
//!   [`Client::parse`] turns the answer into keel's neutral [`ModelReply`].
//! - [`default_price`] and [`cost_micro_usd`] account for what a call cost.
//! - [`token_counter`] counts prompt tokens before a call.
//!
//! Invariants: the API key only ever travels in a request header; it is not in request bodies,
//! error messages or `Debug` output. Nothing here touches the store or the clock beyond
//! measuring a call's duration; waits go through the caller's `sleep`.

mod anthropic;
mod client;
mod config;
mod error;
mod openai;
mod price;
mod tokens;
mod wire;

pub use client::{Client, Exchange, http_clients_built};
pub use config::{ClientConfig, Provider};
pub use error::LlmError;
pub use keel_core::agent::{ModelReply, Prompt, ToolCall, ToolSpec, Usage};
pub use price::{Price, cost_micro_usd, default_price};
pub use tokens::{TokenCounter, token_counter};
