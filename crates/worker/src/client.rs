//! The worker's store client on Envoy: dispatches what the core's queues
//! ([`Attached`] for the calls a request waits for, [`Letters`] for the calls
//! that outlive it) ask to send, remembers which callout token is which
//! flight, and runs the root's timer while anything waits.

use std::collections::HashMap;
use std::time::Duration;

use idemgate_core::client::{Attached, Bound, Delivery, Flight, Letter, Letters, Owner};
use idemgate_core::config::StoreConfig;
use idemgate_core::store_call::StoreAnswer;

use crate::host::Host;

/// The timer never waits longer than this while something is queued.
const MAX_TICK: Duration = Duration::from_secs(1);
/// Nor shorter than this.
const MIN_TICK: Duration = Duration::from_millis(5);

/// Which queue a callout came from.
#[derive(Clone, Copy)]
pub enum Queue {
    Attached,
    Letters,
}

/// What a pump handed back: answers for waiting requests, and letters
/// that ended.
#[derive(Default)]
pub struct Pumped {
    pub answers: Vec<(Owner, StoreAnswer)>,
    pub ended: Vec<(Letter, Delivery)>,
}

pub struct StoreClient {
    pub attached: Attached,
    pub letters: Letters,
    /// Each callout in flight: its queue, its flight, and when it was sent
    /// (µs).
    tokens: HashMap<u32, (Queue, Flight, i64)>,
    /// The root's timer period: zero (off) while nothing waits.
    period: Duration,
}

impl StoreClient {
    pub fn new(host: &impl Host, bound: Bound) -> StoreClient {
        StoreClient {
            attached: Attached::new(bound),
            letters: Letters::new(bound, host.random_u64()),
            tokens: HashMap::new(),
            period: Duration::ZERO,
        }
    }

    /// Store callouts sent and not yet answered.
    pub fn in_flight(&self) -> usize {
        self.tokens.len()
    }

    /// The root's timer is off: nothing queued waits for it.
    pub fn timer_off(&self) -> bool {
        self.period.is_zero()
    }

    /// Which queue's flight callout `token` is, if it is this client's,
    /// and when it was sent (µs).
    pub fn take(&mut self, token: u32) -> Option<(Queue, Flight, i64)> {
        self.tokens.remove(&token)
    }

    /// Sends everything the queues have ready. Calls whose callers stopped
    /// waiting, and calls Envoy refused to send, come back answered with
    /// nothing; letters that ran out of time come back given up.
    pub fn pump(&mut self, host: &impl Host, store: &StoreConfig, now: i64) -> Pumped {
        let mut out = Pumped {
            answers: self.attached.expire(now),
            ended: Vec::new(),
        };
        while let Some(t) = self.attached.poll_transmit(now) {
            match host.dispatch(store, &t.call) {
                Some(token) => {
                    self.tokens
                        .insert(token, (Queue::Attached, t.flight, host.now_us()));
                }
                None => out.answers.extend(self.attached.refused(t.flight)),
            }
        }
        while let Some(t) = self.letters.poll_transmit(now) {
            match host.dispatch(store, &t.call) {
                Some(token) => {
                    self.tokens
                        .insert(token, (Queue::Letters, t.flight, host.now_us()));
                }
                None => {
                    // Envoy has no store host now: the rest waits too.
                    out.ended.extend(self.letters.refused(t.flight, now));
                    break;
                }
            }
        }
        self.set_timer(host, now);
        out
    }

    /// The timer wakes the client when the next letter is due or the next
    /// queued caller stops waiting; it is off while nothing waits.
    fn set_timer(&mut self, host: &impl Host, now: i64) {
        let next = [self.letters.next_due(), self.attached.next_deadline()]
            .into_iter()
            .flatten()
            .min();
        let period = next.map_or(Duration::ZERO, |at| {
            let ms = u64::try_from(at.saturating_sub(now)).unwrap_or(0);
            Duration::from_millis(ms).clamp(MIN_TICK, MAX_TICK)
        });
        if self.period != period && host.set_tick_period(period) {
            self.period = period;
        }
    }
}
