//! The Idempotency-Key contract as pure logic.
//!
//! Everything the filter and the store must agree on lives here: how a key is
//! parsed, which header lines count, where a response came from, how paths
//! are normalized, which limits hold, how a record is scoped, how a request is fingerprinted, what each
//! problem looks like on the wire, how the plugin is configured, how the filter
//! talks to the store (and batches and redelivers its calls), and the per-request state machine the filter carries out.
//! Nothing in this crate does I/O or reads a clock; time is always an argument,
//! so every rule is tested with plain values.
//!
//! Each module imports only modules named before it here, and
//! `tests/layers.rs` fails when a file leads back to itself:
//!
//! - the words everything shares: [`headers`] (header names and field
//!   lines), [`handling`] (how a request was handled, what became of its
//!   record), [`key`], [`path`], [`origin`], [`jcs`], [`jwt`], and [`Reply`];
//! - what is built on them: [`limits`], [`trace`], [`scope`], [`problem`],
//!   [`grpc`], [`fingerprint`];
//! - the plugin configuration, [`config`];
//! - what follows from a policy: who the client is ([`identity`]), the
//!   frames between filter and store ([`protocol`]), what a record's state
//!   allows ([`record`]);
//! - a call to the store and what its answer says, [`store_call`];
//! - the worker's store client, [`client`], which batches and redelivers
//!   calls and never names the exchange;
//! - the per-request state machine, [`exchange`], which reads a request's
//!   head under its policy and hands the client its letters.

pub mod client;
pub mod config;
pub mod exchange;
pub mod fingerprint;
pub mod grpc;
pub mod handling;
pub mod headers;
pub mod identity;
pub mod jcs;
pub mod jwt;
pub mod key;
pub mod limits;
pub mod origin;
pub mod path;
pub mod problem;
pub mod protocol;
pub mod record;
pub mod scope;
pub mod store_call;
pub mod trace;

/// An HTTP response the filter sends itself (a replay or a problem).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}
