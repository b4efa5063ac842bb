//! Envoy's workers, their clients, the network to the store and the
//! upstream, in one process on a manual clock, with the store's own service
//! at the far end ([`crate::far`]). Each worker carries out the exchanges'
//! steps the way the filter does (`src/driver.rs`, `src/worker.rs`) and
//! drives the same store client (`Attached`, `Letters`); the store decides
//! with its own code; everything else is seeded chance, each source from a
//! stream of its own.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, HashSet};
use std::rc::Rc;

use axum::body::Bytes;
use idemgate_core::client::{Attached, Delivery, Flight, Letter, Letters, Owner};
use idemgate_core::config::Config;
use idemgate_core::exchange::{Exchange, Left, Origin, RequestHead, ResponseHead, Step, UpstreamAnswer};
use idemgate_core::handling::Handling;
use idemgate_core::problem::Problem;
use idemgate_core::protocol::{
    decode_frame, split_batch, Attempt, Batch, BatchReply, ClaimReply, ClaimRequest, CompleteRequest,
    FenceReply, FenceRequest, BATCH_PATH, CLAIM_PATH, COMPLETE_PATH, RELEASE_PATH,
};
use idemgate_core::store_call::{StoreAnswer, StoreCall};
use idemgate_core::trace::Trace;
use idemgate_core::Reply;
use idemgate_store::backend::KeyHistory;

use crate::audit;
use crate::database::{Database, Limited};
use crate::far::{Answered, Far};
use crate::rng::Rng;
use crate::scenario::Shape;

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

/// What the store confirmed, as it answered (before the network had its
/// way with the answer): a claim it gave, a completion or a release it did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Confirmed {
    Owned { key: String, fence: u64 },
    Completed { key: String, fence: u64 },
    Released { key: String, fence: u64 },
}

struct Callout {
    /// Shared with the store's copy of the call: a large body is not copied.
    body: Bytes,
    path: &'static str,
    traces: Vec<Trace>,
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

/// The world's sources of chance, each a stream of its own: a source added
/// later leaves the others' draws as they were.
struct Chances {
    clients: Rng,
    upstream: Rng,
    store: Rng,
    lose_request: Rng,
    lose_answer: Rng,
    unavailable: Rng,
    slow_store: Rng,
    in_front: Rng,
    duplicate: Rng,
    network: Rng,
}

impl Chances {
    fn new(seed: u64) -> Chances {
        let s = |name| Rng::stream(seed, name);
        Chances {
            clients: s("clients"),
            upstream: s("upstream"),
            store: s("store"),
            lose_request: s("lose_request"),
            lose_answer: s("lose_answer"),
            unavailable: s("unavailable"),
            slow_store: s("slow_store"),
            in_front: s("in_front"),
            duplicate: s("duplicate"),
            network: s("network"),
        }
    }
}

pub struct World {
    pub now: i64,
    chances: Chances,
    next_tick: Option<i64>,
    pub shape: Shape,
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
    far: Far,
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
    /// What the store confirmed.
    pub confirmed: Vec<Confirmed>,
    /// Each claim the store refused over budget (`429`), and what it met.
    pub limited: Vec<Limited>,
    /// A `429` of the store's own to a claim it never looked at.
    pub unlooked: Option<String>,
    /// Each key's history as last read, to find what was overwritten since.
    seen: HashMap<usize, KeyHistory>,
    /// The first change to a key's history that was not an addition.
    pub overwritten: Option<String>,
    /// Whether the store may have changed a history since it was last read.
    changed: bool,
    /// The store still held calls when nothing else was left to happen.
    pub stuck: bool,
    /// Print what happens, as it happens (`SIMULATION_TRACE=1`).
    trace: bool,
}

/// When the store's clock steps (see [`crate::scenario::Faults::clock_steps_back_ms`]).
const CLOCK_STEP_AT: i64 = 6_000;

/// Envoy workers: each has its own store client (queue and letters).
const WORKERS: usize = 2;
/// How long a restarted store refuses connections.
const RESTART_MS: i64 = 300;
/// The store's clock at the world's time 0.
const STORE_EPOCH: i64 = 1_800_000_000_000;

struct Client {
    attached: Attached,
    letters: Letters,
}

pub fn key_name(k: usize) -> String {
    format!("key-{k}")
}

impl World {
    pub fn new(shape: Shape, seed: u64) -> World {
        let mut chances = Chances::new(seed);
        let config = Rc::new(shape.config.clone());
        let database = Database::new(shape.faults.slow_database, Rng::stream(seed, "database"));
        let authorization = config.store().authorization().to_string();
        let token = authorization.trim_start_matches("Bearer ").to_string();
        let far = Far::new(database, STORE_EPOCH, &token, shape.budgets);
        let mut begins: Vec<i64> = (0..shape.requests)
            .map(|_| chances.clients.range(0, shape.begin_within))
            .collect();
        let restart = shape
            .faults
            .store_restarts
            .then(|| Rng::stream(seed, "restart").range(200, shape.begin_within + 2_000));
        let mut w = World {
            now: 0,
            chances,
            next_tick: None,
            config,
            events: BinaryHeap::new(),
            seq: 0,
            slots: HashMap::new(),
            clients: (0..WORKERS)
                .map(|i| Client {
                    attached: Attached::new(shape.bound),
                    letters: Letters::new(shape.bound, 7 + i as u64),
                })
                .collect(),
            tokens: HashMap::new(),
            restarts: Vec::new(),
            callouts: HashMap::new(),
            next_token: 0,
            far,
            execs: Vec::new(),
            got: HashMap::new(),
            attempts: HashMap::new(),
            request_keys: HashMap::new(),
            steps: 0,
            max_queued: 0,
            outgrown: None,
            queue_full: 0,
            gave_up: HashSet::new(),
            confirmed: Vec::new(),
            limited: Vec::new(),
            unlooked: None,
            seen: HashMap::new(),
            overwritten: None,
            changed: false,
            stuck: false,
            trace: std::env::var_os("SIMULATION_TRACE").is_some(),
            shape,
        };
        for (owner, at) in begins.drain(..).enumerate() {
            w.at(at, Event::Begin(owner as Owner));
        }
        w.at(w.shape.sweep_every_ms, Event::Sweep);
        if let Some(at) = restart {
            w.at(at, Event::Restart);
        }
        w
    }

    fn at(&mut self, time: i64, event: Event) {
        self.seq += 1;
        self.events.push(Reverse((time, self.seq, event)));
    }

    /// Runs until nothing is left to happen.
    pub fn run(&mut self) {
        loop {
            let next = self.events.peek().map(|Reverse((t, _, _))| *t);
            let until = match next {
                Some(t) => t,
                // Only the store is left: its waits end within a minute.
                None if self.far.busy() => self.now + 60_000,
                None => break,
            };
            // The store's own timers first: a claim it holds wakes at its time.
            if let Some(t) = self.far.run_until(until) {
                self.now = self.now.max(t);
                if self.trace {
                    println!("{:>7} the store's timers", self.now);
                }
                self.steps += 1;
                self.settle();
                self.pump();
                self.watch_queues();
                continue;
            }
            let Some(Reverse((time, _, event))) = self.events.pop() else {
                self.stuck = true;
                break;
            };
            self.now = time;
            self.steps += 1;
            if self.trace {
                println!("{time:>7} {}", self.told(&event));
            }
            self.handle(event);
            self.pump();
            self.watch_queues();
        }
        self.look_at_histories();
    }

    /// An event as the trace prints it.
    fn told(&self, event: &Event) -> String {
        let call = |token: &u64| {
            self.callouts
                .get(token)
                .map(|c| {
                    format!(
                        "{} {}",
                        c.path,
                        String::from_utf8_lossy(&c.body[..c.body.len().min(160)])
                    )
                })
                .unwrap_or_default()
        };
        match event {
            Event::Arrive(token) => format!("arrive #{token} {}", call(token)),
            Event::Answer(token, Some((status, body)), _) => format!(
                "answer #{token} {status} {}",
                String::from_utf8_lossy(&body[..body.len().min(160)])
            ),
            other => format!("{other:?}"),
        }
    }

    fn watch_queues(&mut self) {
        let bound = self.shape.bound;
        for c in &self.clients {
            self.max_queued = self.max_queued.max(c.attached.queued());
            if c.attached.queued() > bound.calls || c.attached.queued_bytes() > bound.bytes {
                self.outgrown.get_or_insert(self.now);
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
                self.far.restart();
            }
            Event::Timeout(token) => self.answered(token, None),
            Event::UpstreamDone(owner) => self.upstream_done(owner),
            Event::Tick => {
                if self.next_tick.is_some_and(|t| t <= self.now) {
                    self.next_tick = None;
                }
            }
            Event::Sweep => {
                if self.far.sweep(self.store_clock()) {
                    self.changed = true;
                }
                self.settle();
                // Read again only what may have changed since.
                if std::mem::take(&mut self.changed) {
                    self.look_at_histories();
                }
                // Often while clients come and go, then seldom until every
                // letter has had its time.
                let next = if self.now < 30_000 {
                    self.shape.sweep_every_ms
                } else {
                    10_000
                };
                if self.now < 400_000 {
                    self.at(self.now + next, Event::Sweep);
                }
            }
        }
    }

    /// Reads every key's history and keeps the first change to one that
    /// was not an addition ([`audit::overwritten`]).
    fn look_at_histories(&mut self) {
        for key in 0..self.shape.keys {
            let now = self.far.history(&key_name(key));
            if let Some(before) = self.seen.get(&key) {
                if let (None, Some(what)) = (&self.overwritten, audit::overwritten(before, &now)) {
                    self.overwritten = Some(format!("{} at {} ms: {what}", key_name(key), self.now));
                }
            }
            self.seen.insert(key, now);
        }
    }

    /// Every key's history as the store keeps it now.
    pub fn histories(&self) -> Vec<(String, KeyHistory)> {
        (0..self.shape.keys)
            .map(|k| (key_name(k), self.far.history(&key_name(k))))
            .collect()
    }

    /// Claims the store refused: as late, and as over budget.
    pub fn refused(&self) -> (u64, u64) {
        self.far.refused()
    }

    fn begin(&mut self, owner: Owner) {
        let key = self.chances.clients.range(0, self.shape.keys as i64) as usize;
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
        if self.chances.clients.chance(self.shape.faults.client_leaves) {
            let after = self.chances.clients.range(0, 2_500);
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
        let upstream = &mut self.chances.upstream;
        let status = match upstream.range(0, 20) {
            0 => 422,
            1 => 500,
            _ => 201,
        };
        let size = upstream.range(self.shape.body_min as i64, self.shape.body_max as i64 + 1) as usize;
        let mut body = format!("{}#{n}:", key_name(slot.key)).into_bytes();
        body.resize(size.max(body.len()), b'.');
        let (lo, hi) = self.shape.latency;
        let latency = upstream.range(lo, hi);
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
        let lost = self.chances.upstream.chance(self.shape.faults.upstream_lost);
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
        let f = self.shape.faults.clone();
        self.at(self.now + call.timeout_ms.max(1) as i64, Event::Timeout(token));
        if !self.chances.lose_request.chance(f.lose_request) {
            let delay = if self.chances.slow_store.chance(f.slow_store) {
                call.timeout_ms as i64 + 50
            } else {
                self.chances.network.range(0, 20)
            };
            self.at(self.now + delay, Event::Arrive(token));
            let twice = match carries_claim(&call) {
                true => f.duplicate_claims,
                false => f.duplicate,
            };
            if self.chances.duplicate.chance(twice) {
                let again = self.chances.duplicate.range(0, 300);
                self.at(self.now + delay + again, Event::Arrive(token));
            }
        }
        self.callouts.insert(
            token,
            Callout {
                body: Bytes::from(call.body),
                path: call.path,
                traces: call.traces,
                answered: false,
            },
        );
    }

    fn arrive(&mut self, token: u64) {
        let down = self
            .restarts
            .iter()
            .any(|r| (*r..r + RESTART_MS).contains(&self.now));
        if down || self.chances.unavailable.chance(self.shape.faults.unavailable) {
            self.reply(token, Some((503, Vec::new())));
            return;
        }
        if self.chances.in_front.chance(self.shape.faults.in_front) {
            let status = self.chances.in_front.pick(&[408, 413, 429]);
            self.reply(token, Some((status, b"local_rate_limited".to_vec())));
            return;
        }
        let Some(c) = self.callouts.get(&token) else {
            return;
        };
        let authorization = self.config.store().authorization().to_string();
        self.far
            .call(token, c.path, c.body.clone(), &c.traces, &authorization);
        self.changed = true;
        self.settle();
    }

    /// Whatever the store answered by now goes back over the network.
    fn settle(&mut self) {
        for (token, answer) in self.far.settle(self.store_clock()) {
            self.note(token, &answer);
            self.reply(token, Some(answer));
        }
    }

    /// Notes what the store confirmed in its answer to call `token`.
    fn note(&mut self, token: u64, (status, body): &Answered) {
        let Some(c) = self.callouts.get(&token) else {
            return;
        };
        let calls = match c.path {
            BATCH_PATH => batch_parts(&c.body, *status, body).unwrap_or_default(),
            path => vec![(path.to_string(), &c.body[..], *status, &body[..])],
        };
        let mut limited = Vec::new();
        for (path, frame, status, answer) in calls {
            self.confirmed.extend(confirmed(&path, frame, status, answer));
            if path == CLAIM_PATH
                && Problem::rate_limited_wait(answer)
                    .filter(|_| status == 429)
                    .is_some()
            {
                limited.extend(decode_frame::<ClaimRequest>(frame).ok().map(|(req, _)| req));
            }
        }
        for req in limited {
            match self.far.looked_at(&req) {
                Some(looked) => self.limited.push(looked),
                None => {
                    let what = format!(
                        "the store refused a claim of {} over budget without looking at it",
                        req.scope.key().as_str()
                    );
                    self.unlooked.get_or_insert(what);
                }
            }
        }
    }

    /// The store's clock.
    fn store_clock(&self) -> i64 {
        let stepped = if self.now >= CLOCK_STEP_AT {
            self.now - self.shape.faults.clock_steps_back_ms
        } else {
            self.now
        };
        STORE_EPOCH + stepped
    }

    fn reply(&mut self, token: u64, answer: StoreAnswer) {
        let answer = if self.chances.lose_answer.chance(self.shape.faults.lose_answer) {
            None
        } else {
            answer
        };
        let (lo, hi) = self.shape.answer_ms;
        let delay = self.chances.store.range(lo, hi);
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
            && !self.far.busy()
    }
}

/// Whether a store call is a claim, or a batch with one.
fn carries_claim(call: &StoreCall) -> bool {
    match call.path {
        CLAIM_PATH => true,
        BATCH_PATH => decode_frame::<Batch>(&call.body)
            .map(|(meta, _)| meta.calls.iter().any(|c| c.path == CLAIM_PATH))
            .unwrap_or(true),
        _ => false,
    }
}

/// One call and the store's answer to it: path, frame, status, answer.
type Part<'a> = (String, &'a [u8], u16, &'a [u8]);

/// The calls of a batch and the store's answer to each.
fn batch_parts<'a>(request: &'a [u8], status: u16, answer: &'a [u8]) -> Option<Vec<Part<'a>>> {
    if status != 200 {
        return None;
    }
    let (meta, bytes) = decode_frame::<Batch>(request).ok()?;
    let frames = split_batch(meta.calls.iter().map(|c| c.len), bytes).ok()?;
    let (reply, rbytes) = decode_frame::<BatchReply>(answer).ok()?;
    let answers = split_batch(reply.results.iter().map(|r| r.len), rbytes).ok()?;
    Some(
        meta.calls
            .iter()
            .zip(frames)
            .zip(reply.results.iter().zip(answers))
            .map(|((c, f), (r, a))| (c.path.clone(), f, r.status, a))
            .collect(),
    )
}

/// What one call's answer confirms, if anything.
fn confirmed(path: &str, frame: &[u8], status: u16, answer: &[u8]) -> Option<Confirmed> {
    if status != 200 {
        return None;
    }
    match path {
        CLAIM_PATH => {
            let (req, _) = decode_frame::<ClaimRequest>(frame).ok()?;
            match decode_frame::<ClaimReply>(answer).ok()?.0 {
                ClaimReply::Owned { fence } => Some(Confirmed::Owned {
                    key: req.scope.key().as_str().to_string(),
                    fence,
                }),
                _ => None,
            }
        }
        COMPLETE_PATH | RELEASE_PATH => {
            if decode_frame::<FenceReply>(answer).ok()?.0 != FenceReply::Done {
                return None;
            }
            if path == COMPLETE_PATH {
                let (req, _) = decode_frame::<CompleteRequest>(frame).ok()?;
                Some(Confirmed::Completed {
                    key: req.scope.key().as_str().to_string(),
                    fence: req.fence,
                })
            } else {
                let (req, _) = decode_frame::<FenceRequest>(frame).ok()?;
                Some(Confirmed::Released {
                    key: req.scope.key().as_str().to_string(),
                    fence: req.fence,
                })
            }
        }
        _ => None,
    }
}
