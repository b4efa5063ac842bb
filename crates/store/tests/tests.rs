//! Integration tests of the store: one binary (ripgrep style).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod backup;
mod cli;
mod clock;
mod concurrency;
mod console;
mod crash;
mod faults;
mod http;
mod layers;
mod log_ids;
mod metrics;
mod migration;
mod pgbouncer;
mod planner;
mod rate_limit;
mod roles;
mod sealing;
mod stories;
mod support;
mod sweeper;
mod tls;
