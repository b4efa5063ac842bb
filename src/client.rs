//! The worker's store client for the requests' own calls (claims and the
//! calls that settle their records), group-committed: a call made while the
//! group's callout is not in flight is sent at once, so a quiet worker adds
//! no delay; calls made while it is in flight wait for it and then go
//! together as one batch (`/v1/batch`), so a busy worker makes one store
//! callout for many requests. A claim the store may hold (`in_flight: wait`)
//! travels alone, so it holds up nobody.

use std::collections::HashMap;

use idemgate_core::config::StoreConfig;
use idemgate_core::exchange::{batch_answers, batches_unknown, StoreAnswer, StoreCall};
use idemgate_core::protocol::MAX_BATCH;
use proxy_wasm::types::LogLevel;

use crate::host;

/// Whose call it is: the HTTP context id of its request.
pub type Owner = u32;

/// Calls and the answers they got, to hand to their owners.
pub type Answers = Vec<(Owner, StoreAnswer)>;

/// A callout in flight and the calls it carries, in order.
struct Flight {
    owners: Vec<Owner>,
    /// The calls of a batch, kept to send them alone should the store not
    /// know batches; `None` for a call sent alone.
    batch: Option<Vec<StoreCall>>,
    /// The group's callout: its return sends what queued up meanwhile.
    group: bool,
}

#[derive(Default)]
pub struct StoreClient {
    queued: Vec<(Owner, StoreCall)>,
    flights: HashMap<u32, Flight>,
    /// The group's callout is in flight, or its answers are being handed
    /// out: calls made meanwhile queue for the next batch.
    busy: bool,
    /// The store answered a batch with 404 (it predates batches): every
    /// call travels alone from then on.
    alone_only: bool,
}

impl StoreClient {
    /// Sends `call` now or queues it; `false` when Envoy refused to send it
    /// (no healthy store host).
    pub fn submit(&mut self, store: &StoreConfig, owner: Owner, call: StoreCall) -> bool {
        if call.may_wait || self.alone_only {
            return self.send(store, vec![(owner, call)], false);
        }
        if self.busy {
            self.queued.push((owner, call));
            return true;
        }
        self.busy = self.send(store, vec![(owner, call)], true);
        self.busy
    }

    /// Sends one call alone, or several as a batch; `false` if Envoy refused.
    fn send(&mut self, store: &StoreConfig, calls: Vec<(Owner, StoreCall)>, group: bool) -> bool {
        let (owners, calls): (Vec<Owner>, Vec<StoreCall>) = calls.into_iter().unzip();
        let token = host::dispatch_together(store, &calls.iter().collect::<Vec<_>>());
        let batch = (calls.len() > 1).then_some(calls);
        match token {
            Some(token) => {
                self.flights.insert(token, Flight { owners, batch, group });
                true
            }
            None => false,
        }
    }

    /// The answer to callout `token`, split per call; `None` if the callout
    /// is not this client's.
    pub fn answered(&mut self, token: u32, answer: impl FnOnce() -> StoreAnswer) -> Option<(Answers, bool)> {
        let flight = self.flights.remove(&token)?;
        let answer = answer();
        let answers = match flight.batch {
            Some(calls) if batches_unknown(&answer) => {
                host::log(
                    LogLevel::Warn,
                    "the store does not know /v1/batch (an older version); sending every call alone",
                );
                self.alone_only = true;
                self.queued.splice(0..0, flight.owners.iter().copied().zip(calls));
                Vec::new()
            }
            Some(_) => flight
                .owners
                .iter()
                .copied()
                .zip(batch_answers(answer, flight.owners.len()))
                .collect(),
            None => flight
                .owners
                .first()
                .map(|o| vec![(*o, answer)])
                .unwrap_or_default(),
        };
        Some((answers, flight.group))
    }

    /// After the group's callout returned and its answers were handed out:
    /// sends what queued up meanwhile, and returns the calls Envoy refused
    /// to send, answered with nothing.
    pub fn flush(&mut self, store: &StoreConfig) -> Answers {
        let mut refused = Vec::new();
        if self.alone_only {
            for (owner, call) in std::mem::take(&mut self.queued) {
                if !self.send(store, vec![(owner, call)], false) {
                    refused.push((owner, None));
                }
            }
            self.busy = false;
            return refused;
        }
        let next: Vec<(Owner, StoreCall)> = self.queued.drain(..self.queued.len().min(MAX_BATCH)).collect();
        let owners: Vec<Owner> = next.iter().map(|(o, _)| *o).collect();
        self.busy = !next.is_empty() && self.send(store, next, true);
        if !self.busy {
            refused.extend(owners.into_iter().map(|o| (o, None)));
        }
        refused
    }
}
