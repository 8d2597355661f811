//! Pelican: a Kubernetes operator for Redis and Valkey Streams consumer groups.
//!
//! The `operator` feature (default) holds everything Kubernetes; without it the crate is the key naming shared by
//! workers and the operator.

mod command_docs;
pub mod keys;
pub mod topic;
pub mod worker;

#[cfg(feature = "operator")]
pub mod api;
#[cfg(feature = "operator")]
pub mod cli;
#[cfg(feature = "operator")]
pub mod context;
#[cfg(feature = "operator")]
pub mod controller;
#[cfg(feature = "operator")]
mod error;
#[cfg(feature = "operator")]
pub mod jobs;
#[cfg(feature = "operator")]
pub mod leader;
#[cfg(feature = "operator")]
pub mod local;
#[cfg(feature = "operator")]
pub mod redis;
#[cfg(feature = "operator")]
pub mod redrive;
#[cfg(feature = "operator")]
pub mod runner;
#[cfg(feature = "operator")]
pub mod scaler;
#[cfg(feature = "operator")]
pub mod seek;
#[cfg(feature = "operator")]
pub mod servers;
#[cfg(feature = "operator")]
pub mod telemetry;
#[cfg(feature = "operator")]
pub mod tenancy;

#[cfg(feature = "operator")]
pub use error::{Error, Result};

/// The Rust snippets of the book compile: `cargo test --doc` builds them as doctests.
#[cfg(doctest)]
mod book {
    #[doc = include_str!("../docs/src/workers.md")]
    mod workers {}
    #[doc = include_str!("../docs/src/bounded-streams.md")]
    mod bounded_streams {}
    #[doc = include_str!("../docs/src/policy.md")]
    mod policy {}
}
