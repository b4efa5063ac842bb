//! The worker's store client for calls that must outlive their request: an
//! abandoned claim, a record marked unknown after the client left. A request
//! posts the call here and goes on (or ends); the root context sends it from
//! its timer, so the store's answer comes back to the root even when the
//! request is gone (the SDK drops answers to a context that no longer exists),
//! and sends it again until the store has answered. A store that is down for a
//! while therefore still hears of every claim given up meanwhile, as soon as
//! it is back.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use idemgate_core::config::StoreConfig;
use idemgate_core::exchange::{batch_answers, batches_unknown, decided, Settlement, StoreAnswer, StoreCall};
use idemgate_core::protocol::MAX_BATCH;
use proxy_wasm::types::LogLevel;

use crate::host;

/// The first send waits only for the next timer tick.
const SOON: Duration = Duration::from_millis(5);
/// Between two sends of a call the store did not answer.
const RETRY: Duration = Duration::from_millis(200);
/// About five minutes of retries; after that the store's lease settles the record.
const MAX_TRIES: u32 = 1_500;
/// Calls kept waiting at most; beyond that the oldest is given up (and logged).
const MAX_WAITING: usize = 4_096;

struct Letter {
    call: StoreCall,
    /// What the call settles, counted when the store confirms it.
    settles: Settlement,
    /// The policy of the request it settles (a label of that count).
    policy: String,
    tries: u32,
}

#[derive(Default)]
pub struct Outbox {
    waiting: VecDeque<Letter>,
    /// Callouts in flight and the letters each carries, in order.
    in_flight: HashMap<u32, Vec<Letter>>,
    /// The store answered a batch with 404 (it predates batches): letters
    /// travel alone from then on.
    alone_only: bool,
    /// The root's timer period: zero (off) while there is nothing to send
    /// or to hear.
    period: Duration,
}

impl Outbox {
    /// Queues a call; it is sent on the root's next tick.
    pub fn post(&mut self, call: StoreCall, settles: Settlement, policy: &str) {
        if self.waiting.len() >= MAX_WAITING {
            self.waiting.pop_front();
            host::log(
                LogLevel::Warn,
                "store client: too many calls waiting for the store; the oldest was given up",
            );
        }
        self.waiting.push_back(Letter {
            call,
            settles,
            policy: policy.to_string(),
            tries: 0,
        });
        self.set_period(SOON);
    }

    /// The root's timer: sends everything waiting (together, as batches),
    /// then slows the timer down for retries, or stops it when nothing is
    /// left. Returns the policies of the calls given up, one per call.
    pub fn tick(&mut self, store: &StoreConfig) -> Vec<String> {
        let mut given_up = Vec::new();
        while !self.waiting.is_empty() {
            let size = if self.alone_only { 1 } else { MAX_BATCH };
            let letters: Vec<Letter> = self.waiting.drain(..self.waiting.len().min(size)).collect();
            let calls: Vec<&StoreCall> = letters.iter().map(|l| &l.call).collect();
            let token = host::dispatch_together(store, &calls);
            match token {
                Some(token) => {
                    self.in_flight.insert(token, letters);
                }
                None => {
                    // Refused by Envoy (no healthy store host): try again later.
                    for letter in letters {
                        if let Some(policy) = self.retry(letter) {
                            given_up.push(policy);
                        }
                    }
                    break;
                }
            }
        }
        let idle = self.waiting.is_empty() && self.in_flight.is_empty();
        self.set_period(if idle { Duration::ZERO } else { RETRY });
        given_up
    }

    fn set_period(&mut self, period: Duration) {
        if self.period != period && host::set_tick_period(period) {
            self.period = period;
        }
    }

    /// The store's answer to one of our callouts, for each letter it
    /// carried. Any answer from the store itself (done, stale, or a refusal
    /// of the frame) ends a letter and is returned with what it settles; no
    /// answer or an unavailable store means sending it again (unless it was
    /// the last try). `None` if the callout is not ours.
    pub fn answered(
        &mut self,
        token: u32,
        answer: StoreAnswer,
    ) -> Option<Vec<(Settlement, String, StoreAnswer)>> {
        let letters = self.in_flight.remove(&token)?;
        if letters.len() > 1 && batches_unknown(&answer) {
            self.alone_only = true;
            self.waiting.extend(letters);
            self.set_period(SOON);
            return Some(Vec::new());
        }
        let answers = if letters.len() > 1 {
            batch_answers(answer, letters.len())
        } else {
            vec![answer]
        };
        let mut ended = Vec::new();
        for (letter, answer) in letters.into_iter().zip(answers) {
            if decided(&answer) {
                ended.push((letter.settles, letter.policy, answer));
            } else if let Some((settles, policy)) = self.retry_or_end(letter) {
                ended.push((settles, policy, answer));
            }
        }
        Some(ended)
    }

    /// Queues a letter again; when it has had all its tries, what it settles
    /// and its policy instead.
    fn retry_or_end(&mut self, mut letter: Letter) -> Option<(Settlement, String)> {
        letter.tries += 1;
        if letter.tries >= MAX_TRIES {
            host::log(
                LogLevel::Warn,
                &format!(
                    "store client: {} not delivered after {} tries; the record's lease will settle it",
                    letter.call.path, letter.tries
                ),
            );
            return Some((letter.settles, letter.policy));
        }
        self.waiting.push_back(letter);
        None
    }

    /// Queues a letter again; the policy of one that had all its tries.
    fn retry(&mut self, letter: Letter) -> Option<String> {
        self.retry_or_end(letter).map(|(_, policy)| policy)
    }
}
