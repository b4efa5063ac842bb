//! The worker's store client on Envoy: dispatches what the core's
//! [`Client`] asks to send, remembers which callout token is which flight,
//! and runs the root's timer while anything waits.

use std::collections::HashMap;
use std::time::Duration;

use idemgate_core::client::{Answered, Client, Flight, BOUND};
use idemgate_core::config::StoreConfig;
use idemgate_core::exchange::StoreAnswer;

use crate::host;

/// The timer never waits longer than this while something is queued.
const MAX_TICK: Duration = Duration::from_secs(1);
/// Nor shorter than this (a letter waits for company this long).
const MIN_TICK: Duration = Duration::from_millis(idemgate_core::client::LINGER_MS);

pub struct StoreClient {
    pub client: Client,
    tokens: HashMap<u32, Flight>,
    /// The root's timer period: zero (off) while nothing waits.
    period: Duration,
}

impl StoreClient {
    pub fn new() -> StoreClient {
        StoreClient {
            client: Client::new(BOUND, host::random_u64()),
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

    /// The store's answer to callout `token`, if it is this client's.
    pub fn answered(&mut self, token: u32, answer: impl FnOnce() -> StoreAnswer) -> Option<Answered> {
        let flight = self.tokens.remove(&token)?;
        Some(self.client.answered(flight, answer(), host::now_ms()))
    }

    /// Sends everything the client has ready. Calls whose callers stopped
    /// waiting, and calls Envoy refused to send, come back answered with
    /// nothing; letters that ran out of time come back given up.
    pub fn pump(&mut self, store: &StoreConfig, now: i64) -> Answered {
        let mut out = Answered {
            answers: self.client.attached.expire(now),
            ended: Vec::new(),
        };
        while let Some(t) = self.client.poll_transmit(now) {
            match host::dispatch(store, &t.call) {
                Some(token) => {
                    self.tokens.insert(token, t.flight);
                }
                None => {
                    // Envoy has no store host now: what is still queued is
                    // tried again at the next pump.
                    let refused = self.client.answered(t.flight, None, now);
                    out.answers.extend(refused.answers);
                    out.ended.extend(refused.ended);
                    break;
                }
            }
        }
        self.set_timer(now);
        out
    }

    /// The timer wakes the client when the next letter is due or the next
    /// queued caller stops waiting; it is off while nothing waits.
    fn set_timer(&mut self, now: i64) {
        let period = self.client.next_due().map_or(Duration::ZERO, |at| {
            let ms = u64::try_from(at.saturating_sub(now)).unwrap_or(0);
            Duration::from_millis(ms).clamp(MIN_TICK, MAX_TICK)
        });
        if self.period != period && host::set_tick_period(period) {
            self.period = period;
        }
    }
}
