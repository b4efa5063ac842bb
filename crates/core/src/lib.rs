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
//!
//! Each module below is declared with one line saying what it holds.

// The worker's store client, sans-IO: what to send to the store and when, batched and redelivered.
pub mod client;
// The plugin configuration: JSON from Envoy, parsed raw, then validated into a `Config`.
pub mod config;
// The per-request state machine: a request's head read under its policy, the client handed its letters.
pub mod exchange;
// Request fingerprints: SHA-256 over an unambiguous encoding of the request (contract §3).
pub mod fingerprint;
// gRPC unary calls: what a status means for the record, trailers kept, the filter's answers as statuses.
pub mod grpc;
// How a request was handled and what became of its record: the words of the filter's metrics.
pub mod handling;
// Header names and field lines: which count, when an identity header is ambiguous, `Idempotency-Control`.
pub mod headers;
// Who is asking: the tenant and principal a policy names, read from the request, as its key's scope.
pub mod identity;
// RFC 8785 JSON canonicalization, for the fingerprints of JSON bodies.
pub mod jcs;
// JWT claims as identity: the payload `jwt_authn` verified, read from dynamic metadata.
pub mod jwt;
// The `Idempotency-Key` header: one field line, its value parsed into a key (contract §1).
pub mod key;
// The bounds the filter and the store agree on (contract §5).
pub mod limits;
// Where a response came from, told from Envoy's `response.code_details` (contract §5).
pub mod origin;
// Path normalization for policy matching and fingerprints (contract §4).
pub mod path;
// RFC 9457 problem details: every answer the filter or the store gives on its own behalf (contract §7).
pub mod problem;
// The filter ↔ store wire protocol (`/v1`): frames of one JSON line and raw bytes.
pub mod protocol;
// A record's lifecycle rules, which the store carries out (contract §4–§6).
pub mod record;
// A record's identity: the scope its key lives in, never the bare key (contract §2).
pub mod scope;
// A call to the store (a claim, a settlement, a batch of them) and what its answer says.
pub mod store_call;
// Which client request a store call serves: its `x-request-id` and trace id, for the store's logs.
pub mod trace;

/// An HTTP response the filter sends itself (a replay or a problem).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}
