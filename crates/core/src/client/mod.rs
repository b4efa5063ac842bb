//! The worker's store client, sans-IO: what to send to the store, when, and
//! whose answer is whose. The filter only dispatches each [`Transmit`] as a
//! callout, hands back the answer (or Envoy's refusal to send it), and tells
//! the time; a simulation drives the same machines with a manual clock.
//!
//! Two queues share one way of packing calls ([`pack`]):
//!
//! - [`Attached`]: the calls a request waits for (claims and the calls that
//!   settle their records), group-committed. A call made while the group's
//!   callout is not in flight goes at once, so a quiet worker adds no delay;
//!   calls made while it is in flight go together next, as one `/v1/batch`.
//!   The queue is bounded (count and bytes) and a queued call keeps its
//!   caller's deadline: a call that cannot be queued or waited too long is
//!   answered with nothing (the request fails closed, `503`).
//! - [`Letters`]: calls that must outlive their request (an abandoned claim,
//!   a settlement under `settle: background` or one the store did not
//!   confirm), sent again with backoff until the store itself decides them
//!   ([`crate::store_call::decided`]: an answer from something in front of
//!   it, such as a rate limiter's `429`, decides nothing), for a bounded
//!   time. They are group-committed the same way: letters due while
//!   a batch of them is in flight go together once it returns.
//!
//! A batch is bounded by count ([`MAX_BATCH`]) and bytes ([`MAX_BATCH_BYTES`]),
//! so it never exceeds the store's frame. A batch refused as a whole (any
//! 4xx other than 404, whether the store's or a proxy's `408`, `413` or
//! `429`) is sent again call by call: a refusal of the batch is never read
//! as each call's own answer.

use std::collections::VecDeque;

use crate::limits::MAX_FRAME;
use crate::protocol::MAX_BATCH;
use crate::store_call::{batch_answers, batches_unknown, StoreAnswer, StoreCall};

mod attached;
mod letters;

pub use attached::{Attached, Full};
pub use letters::{Delivery, Letter, Letters, BUDGET_MS};

/// How much a queue keeps at most: calls, and bytes of their bodies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bound {
    pub calls: usize,
    pub bytes: usize,
}

/// Each queue of a worker's client (the calls requests wait for, and the
/// letters) keeps at most this much: a store that is slow but alive cannot
/// make a worker's memory grow with the traffic.
pub const BOUND: Bound = Bound {
    calls: 4_096,
    bytes: 64 * 1024 * 1024,
};

impl Bound {
    /// Whether a queue holding `calls` calls of `bytes` bytes has room for
    /// one more of `weight` bytes.
    fn has_room(&self, calls: usize, bytes: usize, weight: usize) -> bool {
        calls < self.calls && bytes + weight <= self.bytes
    }
}

/// Whose call it is: the HTTP context id of its request.
pub type Owner = u32;

/// A callout of this client, named by the client; the host keeps its own
/// token for it.
pub type Flight = u64;

/// A callout to make now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transmit {
    pub flight: Flight,
    pub call: StoreCall,
}

/// What one call adds to a batch's metadata besides its frame, at most
/// (`{"path":"/v1/mark-unknown","len":8388608},`).
const BATCH_CALL_OVERHEAD: usize = 64;

/// The most bytes one batch carries: the store refuses a frame over
/// [`MAX_FRAME`]; the rest is room for the batch's own metadata line.
pub const MAX_BATCH_BYTES: usize = MAX_FRAME - 4 * 1024;

/// What a call weighs in a batch.
pub fn weight(call: &StoreCall) -> usize {
    call.body.len() + BATCH_CALL_OVERHEAD
}

/// Takes from the front of `queue` the calls of the next callout: at least
/// one, then as many as fit in a batch by count and bytes, skipping none
/// (order is kept).
pub fn pack<T>(queue: &mut VecDeque<T>, call: impl Fn(&T) -> &StoreCall) -> Vec<T> {
    let mut taken = Vec::new();
    let mut bytes = 0;
    while let Some(next) = queue.front() {
        let w = weight(call(next));
        let full = taken.len() >= MAX_BATCH || bytes + w > MAX_BATCH_BYTES;
        if !taken.is_empty() && full {
            break;
        }
        bytes += w;
        if let Some(next) = queue.pop_front() {
            taken.push(next);
        }
    }
    taken
}

/// How the store answered a callout that carried a batch, as a whole.
pub(crate) enum BatchVerdict {
    /// A reply for each call.
    Split(Vec<StoreAnswer>),
    /// The store predates batches (404): send every call alone from now on.
    Unknown,
    /// The batch itself was refused (another 4xx: the store's, or a 408,
    /// 413 or 429 from something in front of it): send each call alone; no
    /// call's own answer is known.
    Refused,
}

/// How to read the answer to a callout that carried `n` calls (one alone
/// is its own answer, whatever it is).
pub(crate) fn batch_verdict(answer: StoreAnswer, n: usize) -> BatchVerdict {
    match &answer {
        _ if n == 1 => BatchVerdict::Split(vec![answer]),
        _ if batches_unknown(&answer) => BatchVerdict::Unknown,
        Some((400..=499, _)) => BatchVerdict::Refused,
        _ => BatchVerdict::Split(batch_answers(answer, n)),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests;
