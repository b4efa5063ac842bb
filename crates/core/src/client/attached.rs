//! The calls a request waits for, group-committed (see the module's doc).

use std::collections::{HashMap, VecDeque};

use super::{batch_verdict, pack, weight, BatchVerdict, Bound, Flight, Owner, Transmit};
use crate::record::plus_ms;
use crate::store_call::{StoreAnswer, StoreCall};

/// The queue is full: the call was not taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Full;

struct Queued {
    owner: Owner,
    call: StoreCall,
    /// When its caller stops waiting (ms since the epoch).
    deadline: i64,
}

pub struct Attached {
    /// Beyond it a call is answered with nothing at once (the request gets
    /// `503`, `Retry-After`).
    bound: Bound,
    /// Calls waiting for the group's callout to return.
    queued: VecDeque<Queued>,
    /// Calls that travel alone (may wait in the store, or after the store
    /// refused or did not know their batch): sent at once.
    alone: VecDeque<Queued>,
    queued_bytes: usize,
    flights: HashMap<Flight, Vec<Queued>>,
    /// The group's callout in flight: what queues meanwhile goes once it returns.
    group: Option<Flight>,
    /// The store answered a batch with 404 (it predates batches).
    alone_only: bool,
    next_flight: Flight,
}

impl Attached {
    pub fn new(bound: Bound) -> Attached {
        Attached {
            bound,
            queued: VecDeque::new(),
            alone: VecDeque::new(),
            queued_bytes: 0,
            flights: HashMap::new(),
            group: None,
            alone_only: false,
            next_flight: 0,
        }
    }

    /// Takes `owner`'s call; its caller waits at most `call.timeout_ms` from `now`.
    pub fn submit(&mut self, owner: Owner, call: StoreCall, now: i64) -> Result<(), Full> {
        let w = weight(&call);
        if !self.bound.has_room(self.queued(), self.queued_bytes, w) {
            return Err(Full);
        }
        self.queued_bytes += w;
        let queued = Queued {
            owner,
            deadline: plus_ms(now, call.timeout_ms),
            call,
        };
        // A claim the store may hold travels alone, so it holds up nobody.
        if queued.call.may_wait || self.alone_only {
            self.alone.push_back(queued);
        } else {
            self.queued.push_back(queued);
        }
        Ok(())
    }

    /// The next callout to make, if any: every call that travels alone, and
    /// the group's batch unless the group's callout is in flight.
    pub fn poll_transmit(&mut self, now: i64) -> Option<Transmit> {
        let (calls, group) = match self.alone.pop_front() {
            Some(one) => (vec![one], false),
            None if self.group.is_some() || self.queued.is_empty() => return None,
            None => (pack(&mut self.queued, |q| &q.call), true),
        };
        self.queued_bytes = self
            .queued_bytes
            .saturating_sub(calls.iter().map(|q| weight(&q.call)).sum());
        let flight = self.next_flight;
        self.next_flight += 1;
        if group {
            self.group = Some(flight);
        }
        let call = match calls.as_slice() {
            [one] => one.call.clone(),
            many => {
                let refs: Vec<&StoreCall> = many.iter().map(|q| &q.call).collect();
                let mut batch = StoreCall::batch(&refs);
                // As long as the caller who waits longest still waits.
                let last = many.iter().map(|q| q.deadline).max().unwrap_or(now);
                batch.timeout_ms = u64::try_from(last.saturating_sub(now)).unwrap_or(0).max(1);
                batch
            }
        };
        self.flights.insert(flight, calls);
        Some(Transmit { flight, call })
    }

    /// Envoy refused to send `flight`: each of its calls is answered with nothing.
    pub fn refused(&mut self, flight: Flight) -> Vec<(Owner, StoreAnswer)> {
        self.answered(flight, None)
    }

    /// The answer to `flight`, split per call. A batch the store refused or
    /// did not know is sent again call by call, and answers nobody yet.
    pub fn answered(&mut self, flight: Flight, answer: StoreAnswer) -> Vec<(Owner, StoreAnswer)> {
        let Some(calls) = self.flights.remove(&flight) else {
            return Vec::new();
        };
        if self.group == Some(flight) {
            self.group = None;
        }
        let answers = match batch_verdict(answer, calls.len()) {
            BatchVerdict::Split(answers) => answers,
            verdict => {
                if matches!(verdict, BatchVerdict::Unknown) {
                    self.alone_only = true;
                    self.alone.extend(self.queued.drain(..));
                }
                for q in calls.into_iter().rev() {
                    self.queued_bytes += weight(&q.call);
                    self.alone.push_front(q);
                }
                return Vec::new();
            }
        };
        calls.into_iter().map(|q| q.owner).zip(answers).collect()
    }

    /// Calls still queued whose callers stopped waiting, answered with nothing.
    pub fn expire(&mut self, now: i64) -> Vec<(Owner, StoreAnswer)> {
        let mut expired = Vec::new();
        for queue in [&mut self.queued, &mut self.alone] {
            queue.retain(|q| {
                let late = q.deadline <= now;
                if late {
                    expired.push((q.owner, weight(&q.call)));
                }
                !late
            });
        }
        self.queued_bytes = self
            .queued_bytes
            .saturating_sub(expired.iter().map(|(_, w)| w).sum());
        expired.into_iter().map(|(owner, _)| (owner, None)).collect()
    }

    /// `owner`'s request is gone and nothing it asked for is needed any
    /// more: its calls not yet sent are dropped.
    pub fn left(&mut self, owner: Owner) {
        let mut dropped = 0;
        for queue in [&mut self.queued, &mut self.alone] {
            queue.retain(|q| {
                let gone = q.owner == owner;
                if gone {
                    dropped += weight(&q.call);
                }
                !gone
            });
        }
        self.queued_bytes = self.queued_bytes.saturating_sub(dropped);
    }

    /// When the earliest queued caller stops waiting.
    pub fn next_deadline(&self) -> Option<i64> {
        self.queued.iter().chain(&self.alone).map(|q| q.deadline).min()
    }

    /// Calls queued, not yet sent.
    pub fn queued(&self) -> usize {
        self.queued.len() + self.alone.len()
    }

    /// Bytes of calls queued, not yet sent.
    pub fn queued_bytes(&self) -> usize {
        self.queued_bytes
    }
}
