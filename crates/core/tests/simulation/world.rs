//! Envoy's workers, their clients, the network to the store, the store and
//! the upstream, in one process on a manual clock. Each worker carries out
//! the exchanges' steps the way the filter does (`src/driver.rs`,
//! `src/worker.rs`) and drives the same store client (`Attached`,
//! `Letters`); everything else is seeded chance.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, HashSet};
use std::rc::Rc;

use crate::store::{Claimed, MemStore};
use crate::Rng;
use idemgate_core::client::{Attached, Bound, Delivery, Flight, Letter, Letters, Owner};
use idemgate_core::config::Config;
use idemgate_core::exchange::{Exchange, Left, Origin, RequestHead, ResponseHead, Step, UpstreamAnswer};
use idemgate_core::handling::Handling;
use idemgate_core::protocol::{decode_frame, Attempt, ClaimRequest, CLAIM_PATH};
use idemgate_core::store_call::{StoreAnswer, StoreCall};
use idemgate_core::Reply;

/// The faults of one scenario, as chances per event (none by default).
#[derive(Debug, Clone, Default)]
pub struct Faults {
    pub lose_request: f64,
    pub lose_answer: f64,
    pub unavailable: f64,
    pub slow_store: f64,
    pub client_leaves: f64,
    pub upstream_lost: f64,
    /// Six seconds in, the store's clock steps back this far (an NTP step
    /// on its host; a step forward would end leases early, which the
    /// contract rules out by asking for a slewed clock).
    pub clock_steps_back_ms: i64,
    /// The store is killed once, at a moment chosen by the seed.
    pub store_restarts: bool,
    /// Something in front of the store (a rate limiter, a proxy) answers a
    /// call itself, `408`, `413` or `429` in its own words, and the store
    /// never sees it.
    pub in_front: f64,
}

#[derive(Debug, Clone)]
pub struct Scenario {
    pub config: String,
    pub keys: usize,
    pub requests: usize,
    /// Requests begin within this many milliseconds.
    pub begin_within: i64,
    /// The upstream takes this long, in milliseconds.
    pub latency: (i64, i64),
    /// Response bodies at least this many bytes...
    pub body_min: usize,
    /// ...and at most this many.
    pub body_max: usize,
    /// The store takes this long to answer a call that arrived, in milliseconds.
    pub answer_ms: (i64, i64),
    /// What each worker's queues keep at most.
    pub bound: Bound,
    pub faults: Faults,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Dir {
    Request,
    Response,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Queue {
    Attached,
    Letters,
}

struct Slot {
    ex: Exchange,
    key: usize,
    attached: bool,
    /// Waiting for the store (false) or the upstream (true), and the direction held.
    waiting: Option<(bool, Dir)>,
    exec: Option<usize>,
    /// The Envoy worker the request came to.
    worker: usize,
    /// Envoy lost the upstream's response: the client gets Envoy's 503.
    lost: bool,
    /// The policy's detached forwarding timeout.
    ex_detached_timeout: Option<u64>,
}

/// One execution of a request by the upstream.
#[derive(Debug, Clone)]
pub struct Exec {
    pub key: usize,
    pub attempt: String,
    pub start: i64,
    pub end: i64,
    pub status: u16,
    pub body: Vec<u8>,
}

/// What a client got.
#[derive(Debug, Clone)]
pub enum Got {
    /// The upstream's status, and whether it was the upstream's own answer.
    Upstream(u16, bool),
    Reply(Reply),
}

struct Callout {
    body: Vec<u8>,
    path: &'static str,
    answered: bool,
}

#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    Begin(Owner),
    Leave(Owner),
    Arrive(u64),
    /// An answer the store sent at the given time.
    Answer(u64, Option<(u16, Vec<u8>)>, i64),
    /// The store process is killed and started again.
    Restart,
    Timeout(u64),
    UpstreamDone(Owner),
    Tick,
    Sweep,
}

pub struct World {
    pub now: i64,
    rng: Rng,
    next_tick: Option<i64>,
    scenario: Scenario,
    config: Rc<Config>,
    events: BinaryHeap<Reverse<(i64, u64, Event)>>,
    seq: u64,
    slots: HashMap<Owner, Slot>,
    /// Each Envoy worker's store client; a request belongs to one worker.
    clients: Vec<Client>,
    tokens: HashMap<u64, (usize, Queue, Flight)>,
    /// When the store was restarted: answers it owed then are never sent.
    restarts: Vec<i64>,
    callouts: HashMap<u64, Callout>,
    next_token: u64,
    /// Claims the store holds (`in_flight: wait`): token, until, commit deadline.
    parked: Vec<(u64, i64, i64)>,
    pub store: MemStore,
    pub execs: Vec<Exec>,
    pub got: HashMap<Owner, Got>,
    pub attempts: HashMap<Owner, String>,
    pub request_keys: HashMap<Owner, usize>,
    pub steps: u64,
    /// The most calls a worker's queue held...
    pub max_queued: usize,
    /// ...and when it first held more than its bound.
    pub outgrown: Option<i64>,
    /// Calls a worker's full queue did not take.
    pub queue_full: usize,
    /// Attempts whose settlement the store client gave up on.
    pub gave_up: HashSet<String>,
}

/// When the store's clock steps (see [`Faults::clock_steps_back_ms`]).
const CLOCK_STEP_AT: i64 = 6_000;

/// Envoy workers: each has its own store client (queue and letters).
const WORKERS: usize = 2;
/// How long a restarted store refuses connections.
const RESTART_MS: i64 = 300;

struct Client {
    attached: Attached,
    letters: Letters,
}

fn key_name(k: usize) -> String {
    format!("key-{k}")
}

impl World {
    pub fn new(scenario: Scenario, seed: u64) -> World {
        let rng = Rng(seed.max(1));
        let config = Rc::new(Config::parse(scenario.config.as_bytes()).unwrap());
        let mut w = World {
            now: 0,
            rng,
            next_tick: None,
            config,
            events: BinaryHeap::new(),
            seq: 0,
            slots: HashMap::new(),
            clients: (0..WORKERS)
                .map(|i| Client {
                    attached: Attached::new(scenario.bound),
                    letters: Letters::new(scenario.bound, 7 + i as u64),
                })
                .collect(),
            tokens: HashMap::new(),
            restarts: Vec::new(),
            callouts: HashMap::new(),
            next_token: 0,
            parked: Vec::new(),
            store: MemStore::default(),
            execs: Vec::new(),
            got: HashMap::new(),
            attempts: HashMap::new(),
            request_keys: HashMap::new(),
            steps: 0,
            max_queued: 0,
            outgrown: None,
            queue_full: 0,
            gave_up: HashSet::new(),
            scenario,
        };
        for owner in 0..w.scenario.requests as Owner {
            let at = w.rng.range(0, w.scenario.begin_within);
            w.at(at, Event::Begin(owner));
        }
        w.at(500, Event::Sweep);
        if w.scenario.faults.store_restarts {
            let at = w.rng.range(200, w.scenario.begin_within + 2_000);
            w.at(at, Event::Restart);
        }
        w
    }

    fn at(&mut self, time: i64, event: Event) {
        self.seq += 1;
        self.events.push(Reverse((time, self.seq, event)));
    }

    fn chance(&mut self, p: f64) -> bool {
        p > 0.0 && self.rng.unit() < p
    }

    /// Runs until nothing is left to happen.
    pub fn run(&mut self) {
        while let Some(Reverse((time, _, event))) = self.events.pop() {
            self.now = time;
            self.steps += 1;
            self.handle(event);
            self.pump();
            let bound = self.scenario.bound;
            for c in &self.clients {
                self.max_queued = self.max_queued.max(c.attached.queued());
                if c.attached.queued() > bound.calls || c.attached.queued_bytes() > bound.bytes {
                    self.outgrown.get_or_insert(self.now);
                }
            }
        }
    }

    fn handle(&mut self, event: Event) {
        match event {
            Event::Begin(owner) => self.begin(owner),
            Event::Leave(owner) => self.leave(owner),
            Event::Arrive(token) => self.arrive(token),
            // A store killed before its answer left never sends it: the
            // filter's callout times out instead.
            Event::Answer(token, answer, sent) => {
                if !self.restarts.iter().any(|r| (sent..self.now).contains(r)) {
                    self.answered(token, answer);
                }
            }
            Event::Restart => {
                self.restarts.push(self.now);
                // Claims it held are forgotten with their connections.
                self.parked.clear();
            }
            Event::Timeout(token) => self.answered(token, None),
            Event::UpstreamDone(owner) => self.upstream_done(owner),
            Event::Tick => {
                self.wake_parked();
                if self.next_tick.is_some_and(|t| t <= self.now) {
                    self.next_tick = None;
                }
            }
            Event::Sweep => {
                self.store.sweep(self.store_clock());
                self.wake_parked();
                // Often while clients come and go, then seldom until every
                // letter has had its time.
                let next = if self.now < 30_000 { 500 } else { 10_000 };
                if self.now < 400_000 {
                    self.at(self.now + next, Event::Sweep);
                }
            }
        }
    }

    fn begin(&mut self, owner: Owner) {
        let key = self.rng.range(0, self.scenario.keys as i64) as usize;
        let policy = self.config.policy_for("POST", "h", "/pay").unwrap().clone();
        let lines = vec![(":path".to_string(), b"/pay".to_vec())];
        let attempt = format!("a{owner}");
        let head = RequestHead {
            method: "POST".into(),
            path: "/pay".into(),
            key_fields: vec![key_name(key).into_bytes()],
            end_of_stream: false,
            content_length: Some(2),
            upstream: idemgate_core::exchange::upstream_call(&policy, Some("upstream"), &lines),
            ..RequestHead::default()
        };
        let (ex, step) = Exchange::begin(
            self.config.clone(),
            policy,
            head,
            Attempt::try_from(attempt.clone()).unwrap(),
        );
        self.attempts.insert(owner, attempt);
        self.request_keys.insert(owner, key);
        let ex_detached_timeout = match self.config.policies()[0].forwarding() {
            idemgate_core::config::Forwarding::Detached(d) => Some(d.timeout_ms()),
            idemgate_core::config::Forwarding::Streaming => None,
        };
        self.slots.insert(
            owner,
            Slot {
                ex,
                key,
                attached: true,
                waiting: None,
                exec: None,
                worker: owner as usize % WORKERS,
                lost: false,
                ex_detached_timeout,
            },
        );
        if self.chance(self.scenario.faults.client_leaves) {
            let after = self.rng.range(0, 2_500);
            self.at(self.now + after, Event::Leave(owner));
        }
        self.act(owner, step, Dir::Request);
        let step = match self.slots.get_mut(&owner) {
            Some(slot) => slot.ex.request_body(b"{}", true),
            None => return,
        };
        self.act(owner, step, Dir::Request);
    }

    fn act(&mut self, owner: Owner, step: Step, dir: Dir) {
        let Some(slot) = self.slots.get_mut(&owner) else {
            return;
        };
        match step {
            Step::Pause => {}
            Step::Continue if dir == Dir::Request => {
                // Through Envoy's router: the upstream gets the request.
                if slot.ex.handling() == Handling::Owned && slot.exec.is_none() {
                    self.start_exec(owner);
                }
            }
            Step::Continue => {
                if let Some(exec) = slot.exec.filter(|_| slot.attached) {
                    let status = if slot.lost { 503 } else { self.execs[exec].status };
                    self.got.insert(owner, Got::Upstream(status, !slot.lost));
                    self.client_done(owner);
                }
            }
            Step::Respond(reply) => {
                if slot.attached {
                    self.got.insert(owner, Got::Reply(reply));
                    self.client_done(owner);
                }
            }
            Step::Deliver(call, next) => {
                let (worker, letter) = (slot.worker, slot.ex.letter(call));
                self.post(worker, letter);
                self.act(owner, *next, dir);
            }
            Step::Call(call) => {
                if self.clients[slot.worker]
                    .attached
                    .submit(owner, call, self.now)
                    .is_err()
                {
                    self.queue_full += 1;
                    let next = slot.ex.store_reply(None);
                    self.act(owner, next, dir);
                } else {
                    slot.waiting = Some((false, dir));
                }
            }
            Step::Forward(_) => {
                slot.waiting = Some((true, dir));
                self.start_exec(owner);
            }
            Step::Reroute(_) => panic!("no simulated policy covers gRPC"),
        }
    }

    /// The client has its answer; the stream ends (Envoy's `on_log`).
    fn client_done(&mut self, owner: Owner) {
        self.at(self.now, Event::Leave(owner));
    }

    fn leave(&mut self, owner: Owner) {
        let Some(slot) = self.slots.get_mut(&owner) else {
            return;
        };
        if !slot.attached {
            return;
        }
        slot.attached = false;
        let Left::Ended(letter) = slot.ex.client_left(slot.waiting.is_some()) else {
            return;
        };
        let worker = slot.worker;
        if let Some(letter) = letter {
            self.post(worker, letter);
        }
        self.slots.remove(&owner);
        self.clients[worker].attached.left(owner);
    }

    fn post(&mut self, worker: usize, letter: Letter) {
        // A letter pushed out of a full outbox is given up: its record's
        // lease settles it, as the contract allows.
        if let Some(out) = self.clients[worker].letters.post(letter, self.now) {
            self.gave_up.insert(out.attempt.as_str().to_string());
        }
    }

    fn start_exec(&mut self, owner: Owner) {
        let Some(slot) = self.slots.get_mut(&owner) else {
            return;
        };
        let n = self.execs.len();
        let status = match self.rng.range(0, 20) {
            0 => 422,
            1 => 500,
            _ => 201,
        };
        let size =
            self.rng
                .range(self.scenario.body_min as i64, self.scenario.body_max as i64 + 1) as usize;
        let mut body = format!("{}#{n}:", key_name(slot.key)).into_bytes();
        body.resize(size.max(body.len()), b'.');
        let (lo, hi) = self.scenario.latency;
        let latency = self.rng.range(lo, hi);
        // Envoy gives up on the filter's own upstream call at its timeout.
        let answer_after = match slot.ex_detached_timeout {
            Some(timeout) => latency.min(timeout as i64),
            None => latency,
        };
        slot.exec = Some(n);
        self.execs.push(Exec {
            key: slot.key,
            attempt: self.attempts[&owner].clone(),
            start: self.now,
            end: self.now + latency,
            status,
            body,
        });
        self.at(self.now + answer_after, Event::UpstreamDone(owner));
    }

    fn upstream_done(&mut self, owner: Owner) {
        let lost = self.chance(self.scenario.faults.upstream_lost);
        let Some(slot) = self.slots.get_mut(&owner) else {
            return;
        };
        let Some(exec) = slot.exec else { return };
        let e = self.execs[exec].clone();
        match slot.waiting {
            Some((true, dir)) => {
                slot.waiting = None;
                let timeout = slot.ex_detached_timeout.unwrap_or(0);
                let answer = if lost || (e.end - e.start) as u64 >= timeout {
                    UpstreamAnswer::Lost
                } else {
                    let headers = vec![
                        (":status".to_string(), e.status.to_string().into_bytes()),
                        (idemgate_core::origin::UPSTREAM_MARK.to_string(), b"1".to_vec()),
                    ];
                    UpstreamAnswer::Response {
                        headers,
                        body_size: e.body.len(),
                    }
                };
                let body = e.body.clone();
                let step = slot.ex.upstream_reply(answer, || body);
                self.act(owner, step, dir);
                self.let_go_if_done(owner);
            }
            None if slot.attached && slot.ex.owns_response() => {
                slot.lost = lost;
                let head = ResponseHead {
                    status: if lost { 503 } else { e.status },
                    origin: if lost {
                        Origin::LostAfterForwarding
                    } else {
                        Origin::Upstream
                    },
                    headers: Vec::new(),
                    content_length: Some(e.body.len() as u64),
                    end_of_stream: false,
                };
                let step = slot.ex.response_headers(head);
                let step = match step {
                    Step::Pause => match self.slots.get_mut(&owner) {
                        Some(slot) => slot.ex.response_body(&e.body, true),
                        None => return,
                    },
                    other => other,
                };
                self.act(owner, step, Dir::Response);
            }
            _ => {}
        }
    }

    fn let_go_if_done(&mut self, owner: Owner) {
        if self
            .slots
            .get(&owner)
            .is_some_and(|s| !s.attached && s.waiting.is_none())
        {
            self.slots.remove(&owner);
        }
    }

    fn pump(&mut self) {
        for worker in 0..WORKERS {
            self.pump_worker(worker);
        }
        let due = self
            .clients
            .iter()
            .flat_map(|c| [c.letters.next_due(), c.attached.next_deadline()])
            .flatten()
            .min();
        if let Some(due) = due {
            let due = due.max(self.now + 1);
            if self.next_tick.is_none_or(|t| t > due) {
                self.next_tick = Some(due);
                self.at(due, Event::Tick);
            }
        }
    }

    fn pump_worker(&mut self, worker: usize) {
        loop {
            let expired = self.clients[worker].attached.expire(self.now);
            let mut any = !expired.is_empty();
            for (owner, answer) in expired {
                self.hand_out(owner, answer);
            }
            while let Some(t) = self.clients[worker].attached.poll_transmit(self.now) {
                any = true;
                self.dispatch((worker, Queue::Attached, t.flight), t.call);
            }
            while let Some(t) = self.clients[worker].letters.poll_transmit(self.now) {
                any = true;
                self.dispatch((worker, Queue::Letters, t.flight), t.call);
            }
            if !any {
                return;
            }
        }
    }

    fn dispatch(&mut self, flight: (usize, Queue, Flight), call: StoreCall) {
        let token = self.next_token;
        self.next_token += 1;
        self.tokens.insert(token, flight);
        let f = self.scenario.faults.clone();
        self.at(self.now + call.timeout_ms.max(1) as i64, Event::Timeout(token));
        if !self.chance(f.lose_request) {
            let delay = if self.chance(f.slow_store) {
                call.timeout_ms as i64 + 50
            } else {
                self.rng.range(0, 20)
            };
            self.at(self.now + delay, Event::Arrive(token));
        }
        self.callouts.insert(
            token,
            Callout {
                body: call.body,
                path: call.path,
                answered: false,
            },
        );
    }

    fn arrive(&mut self, token: u64) {
        let down = self
            .restarts
            .iter()
            .any(|r| (*r..r + RESTART_MS).contains(&self.now));
        if down || self.chance(self.scenario.faults.unavailable) {
            self.reply(token, Some((503, Vec::new())));
            return;
        }
        if self.chance(self.scenario.faults.in_front) {
            let status = [408, 413, 429][self.rng.range(0, 3) as usize];
            self.reply(token, Some((status, b"local_rate_limited".to_vec())));
            return;
        }
        let Some(c) = self.callouts.get(&token) else {
            return;
        };
        let (path, body) = (c.path, c.body.clone());
        let now = self.store_clock();
        match self.store.call(path, &body, now, false) {
            Claimed::Answer(status, bytes) => self.reply(token, Some((status, bytes))),
            Claimed::Wait => {
                let req = decode_frame::<ClaimRequest>(&body).unwrap().0;
                self.parked.push((
                    token,
                    self.now + req.wait_ms as i64,
                    self.now + req.deadline_ms as i64,
                ));
                self.at(self.now + req.wait_ms as i64, Event::Tick);
            }
        }
        self.wake_parked();
    }

    /// Claims the store holds are decided again after every change.
    fn wake_parked(&mut self) {
        let parked = std::mem::take(&mut self.parked);
        for (token, until, deadline) in parked {
            let body = self.callouts[&token].body.clone();
            let now = self.store_clock();
            match self.store.call(CLAIM_PATH, &body, now, self.now >= until) {
                _ if self.now >= deadline => self.reply(token, Some((503, Vec::new()))),
                Claimed::Answer(status, bytes) => self.reply(token, Some((status, bytes))),
                Claimed::Wait => self.parked.push((token, until, deadline)),
            }
        }
    }

    /// The store's clock.
    fn store_clock(&self) -> i64 {
        if self.now >= CLOCK_STEP_AT {
            self.now - self.scenario.faults.clock_steps_back_ms
        } else {
            self.now
        }
    }

    fn reply(&mut self, token: u64, answer: StoreAnswer) {
        let answer = if self.chance(self.scenario.faults.lose_answer) {
            None
        } else {
            answer
        };
        let (lo, hi) = self.scenario.answer_ms;
        let delay = self.rng.range(lo, hi);
        self.at(self.now + delay, Event::Answer(token, answer, self.now));
    }

    fn answered(&mut self, token: u64, answer: StoreAnswer) {
        let Some(c) = self.callouts.get_mut(&token) else {
            return;
        };
        if c.answered {
            return;
        }
        c.answered = true;
        let Some((worker, queue, flight)) = self.tokens.remove(&token) else {
            return;
        };
        match queue {
            Queue::Attached => {
                for (owner, answer) in self.clients[worker].attached.answered(flight, answer) {
                    self.hand_out(owner, answer);
                }
            }
            Queue::Letters => {
                for (letter, delivery) in self.clients[worker].letters.answered(flight, answer, self.now) {
                    assert!(
                        !matches!(delivery, Delivery::GaveUp),
                        "a letter was given up: {}",
                        letter.call.path
                    );
                }
            }
        }
    }

    fn hand_out(&mut self, owner: Owner, answer: StoreAnswer) {
        let Some(slot) = self.slots.get_mut(&owner) else {
            return;
        };
        let Some((false, dir)) = slot.waiting else { return };
        slot.waiting = None;
        let step = slot.ex.store_reply(answer);
        self.act(owner, step, dir);
        self.let_go_if_done(owner);
    }

    /// Letters and queues all empty, no store call pending.
    pub fn quiet(&self) -> bool {
        self.clients
            .iter()
            .all(|c| c.letters.is_idle() && c.attached.queued() == 0)
            && self.parked.is_empty()
    }
}
