//! Integration tests of the store: one binary (ripgrep style).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod cli;
mod concurrency;
mod console;
mod crash;
mod faults;
mod http;
mod metrics;
mod migration;
mod stories;
mod support;
mod tls;
