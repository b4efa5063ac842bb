//! Calls that must outlive their request, sent until the store decides them
//! (see the module's doc).

use std::collections::{HashMap, VecDeque};

use super::{batch_verdict, pack, weight, BatchVerdict, Bound, Flight, Transmit};
use crate::handling::Settlement;
use crate::protocol::Attempt;
use crate::record::plus_ms;
use crate::store_call::{decided, StoreAnswer, StoreCall};

/// The first retry waits this long, each further one twice as long...
const BACKOFF_FIRST_MS: u64 = 200;
/// ...up to this.
const BACKOFF_MAX_MS: u64 = 10_000;
/// How long a letter is sent again: past it, the record's lease settles it.
pub const BUDGET_MS: u64 = 5 * 60 * 1000;

/// A call to deliver, and what it settles (counted once the store decides).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Letter {
    pub call: StoreCall,
    pub settles: Settlement,
    /// The policy of the request it settles (a label of that count).
    pub policy: String,
    /// The claim attempt it settles: what a warning about it names.
    pub attempt: Attempt,
}

/// How a letter ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Delivery {
    /// The store decided it; its answer (which may be a refusal or stale).
    Decided(StoreAnswer),
    /// Not delivered within [`BUDGET_MS`], or pushed out by newer letters.
    GaveUp,
}

struct Posted {
    letter: Letter,
    tries: u32,
    due: i64,
    give_up_at: i64,
    /// Its batch was refused as a whole: it travels alone.
    alone: bool,
}

pub struct Letters {
    /// Letters waiting kept at most; beyond it the oldest is given up.
    bound: Bound,
    waiting: VecDeque<Posted>,
    bytes: usize,
    flights: HashMap<Flight, Vec<Posted>>,
    /// The batch in flight: letters due meanwhile go together once it
    /// returns, as the group's calls do.
    batch: Option<Flight>,
    alone_only: bool,
    next_flight: Flight,
    /// Jitter for the backoff, so the workers of a proxy that lost the
    /// store do not all come back at once.
    jitter: u64,
}

impl Letters {
    /// `seed` makes the backoff's jitter; any value but 0.
    pub fn new(bound: Bound, seed: u64) -> Letters {
        Letters {
            bound,
            waiting: VecDeque::new(),
            bytes: 0,
            flights: HashMap::new(),
            batch: None,
            alone_only: false,
            next_flight: 0,
            jitter: seed.max(1),
        }
    }

    /// Posts a letter, due at once. Returns the letter given up to make
    /// room, if the outbox was full.
    pub fn post(&mut self, letter: Letter, now: i64) -> Option<Letter> {
        let mut pushed_out = None;
        if !self
            .bound
            .has_room(self.waiting.len(), self.bytes, weight(&letter.call))
        {
            pushed_out = self.waiting.pop_front().map(|p| {
                self.bytes = self.bytes.saturating_sub(weight(&p.letter.call));
                p.letter
            });
        }
        self.bytes += weight(&letter.call);
        self.waiting.push_back(Posted {
            letter,
            tries: 0,
            due: now,
            give_up_at: plus_ms(now, BUDGET_MS),
            alone: false,
        });
        pushed_out
    }

    /// The next callout to make: a due letter that travels alone, or the
    /// due letters packed in order unless a batch of them is in flight.
    pub fn poll_transmit(&mut self, now: i64) -> Option<Transmit> {
        let (mut due, later): (VecDeque<Posted>, VecDeque<Posted>) =
            self.waiting.drain(..).partition(|p| p.due <= now);
        self.waiting = later;
        let alone = due.iter().position(|p| self.travels_alone(p));
        let letters = match alone {
            Some(i) => due.remove(i).into_iter().collect(),
            None if self.batch.is_some() => Vec::new(),
            None => pack(&mut due, |p| &p.letter.call),
        };
        // What was not sent goes first next time.
        for p in due.into_iter().rev() {
            self.waiting.push_front(p);
        }
        if letters.is_empty() {
            return None;
        }
        self.bytes = self
            .bytes
            .saturating_sub(letters.iter().map(|p| weight(&p.letter.call)).sum());
        let flight = self.next_flight;
        self.next_flight += 1;
        if alone.is_none() {
            self.batch = Some(flight);
        }
        let call = match letters.as_slice() {
            [one] => one.letter.call.clone(),
            many => StoreCall::batch(&many.iter().map(|p| &p.letter.call).collect::<Vec<_>>()),
        };
        self.flights.insert(flight, letters);
        Some(Transmit { flight, call })
    }

    /// Envoy refused to send `flight`: its letters wait for their next try.
    pub fn refused(&mut self, flight: Flight, now: i64) -> Vec<(Letter, Delivery)> {
        self.answered(flight, None, now)
    }

    /// The store's answer to `flight`: letters the store decided end; the
    /// others wait for their next try, or end when their time is up.
    pub fn answered(&mut self, flight: Flight, answer: StoreAnswer, now: i64) -> Vec<(Letter, Delivery)> {
        let Some(letters) = self.flights.remove(&flight) else {
            return Vec::new();
        };
        if self.batch == Some(flight) {
            self.batch = None;
        }
        let answers = match batch_verdict(answer, letters.len()) {
            BatchVerdict::Split(answers) => answers,
            verdict => {
                self.alone_only |= matches!(verdict, BatchVerdict::Unknown);
                for mut p in letters.into_iter().rev() {
                    p.alone = true;
                    p.due = now;
                    self.bytes += weight(&p.letter.call);
                    self.waiting.push_front(p);
                }
                return Vec::new();
            }
        };
        let mut ended = Vec::new();
        for (mut p, answer) in letters.into_iter().zip(answers) {
            if decided(&answer) {
                ended.push((p.letter, Delivery::Decided(answer)));
            } else if now >= p.give_up_at {
                ended.push((p.letter, Delivery::GaveUp));
            } else {
                p.tries += 1;
                p.due = plus_ms(now, self.backoff(p.tries));
                self.bytes += weight(&p.letter.call);
                self.waiting.push_back(p);
            }
        }
        ended
    }

    /// Exponential, with jitter: between half and all of the step.
    fn backoff(&mut self, tries: u32) -> u64 {
        let step = BACKOFF_FIRST_MS
            .saturating_mul(1 << tries.saturating_sub(1).min(16))
            .min(BACKOFF_MAX_MS);
        // xorshift64
        self.jitter ^= self.jitter << 13;
        self.jitter ^= self.jitter >> 7;
        self.jitter ^= self.jitter << 17;
        step / 2 + self.jitter % (step / 2 + 1)
    }

    /// When the next letter is due that can go then (`None`: nothing
    /// waits, or only for the batch in flight, whose answer sends it).
    pub fn next_due(&self) -> Option<i64> {
        self.waiting
            .iter()
            .filter(|p| self.batch.is_none() || self.travels_alone(p))
            .map(|p| p.due)
            .min()
    }

    /// A letter that goes alone, and so does not wait for the batch in flight.
    fn travels_alone(&self, p: &Posted) -> bool {
        self.alone_only || p.alone
    }

    /// Nothing waits and nothing is in flight.
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.flights.is_empty()
    }

    /// Letters waiting or in flight.
    pub fn len(&self) -> usize {
        self.waiting.len() + self.flights.values().map(Vec::len).sum::<usize>()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The attempts whose letters wait or are in flight.
    pub fn attempts(&self) -> impl Iterator<Item = &Attempt> {
        let flying = self.flights.values().flatten();
        self.waiting.iter().chain(flying).map(|p| &p.letter.attempt)
    }
}
