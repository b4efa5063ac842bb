//! Envoy's workers, their clients, the network to the store and the
//! upstream, in one process on a manual clock, with the store's own service
//! at the far end ([`crate::far`]). Each worker is the filter's own code
//! (`idemgate_worker`) on a simulated Envoy (`world/envoy.rs`); the store
//! decides with its own code; everything else is seeded chance, each
//! source from a stream of its own.

use std::cell::RefCell;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, HashSet};
use std::rc::Rc;
use std::time::Duration;

use axum::body::Bytes;
use idemgate_core::client::Owner;
use idemgate_core::config::Config;
use idemgate_core::problem::Problem;
use idemgate_core::protocol::{
    decode_frame, split_batch, AbandonRequest, Batch, BatchReply, ClaimReply, ClaimRequest, CompleteRequest,
    FenceReply, FenceRequest, ABANDON_PATH, BATCH_PATH, CLAIM_PATH, COMPLETE_PATH, RELEASE_PATH,
};
use idemgate_core::store_call::{StoreAnswer, StoreCall};
use idemgate_core::trace::Trace;
use idemgate_core::Reply;
use idemgate_store::backend::KeyHistory;
use idemgate_worker::{Filter, Worker};

use crate::audit;
use crate::database::{Database, Limited};
use crate::far::{Answered, Far};
use crate::rng::Rng;
use crate::scenario::Shape;

mod envoy;
mod grpc;
mod network;
mod requests;
mod scopes;

pub use scopes::{scope_label, scope_of_label};

use envoy::{Body, CallResponse, Effect, Envoy, Proxy, Stream};

/// A request on Envoy, from the client's headers until nothing of it is
/// left in flight.
struct Slot {
    /// The request's context, while its client is there.
    filter: Option<Filter<Envoy>>,
    key: usize,
    /// The worker the request came to.
    worker: usize,
    exec: Option<usize>,
    /// The filter's own upstream request in flight (detached forwarding):
    /// its callout token and timeout.
    detached: Option<(u32, u64)>,
    /// Envoy lost the upstream's response: the client gets Envoy's 503.
    lost: bool,
    /// Envoy answers itself before the upstream gets the request.
    never_reached: bool,
    /// The filter rerouted the request to the store's replay route, with
    /// this body...
    rerouted: Option<Vec<u8>>,
    /// ...and the replay the route sent back, as the answer it repeats.
    replay: Option<Reply>,
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
/// way with the answer): a claim it gave, a completion or a release it did,
/// each of the scope its [`scope_label`] names.
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
    /// A worker's timer, set in the given generation of its period.
    Timer(usize, u64),
    /// The store process is killed and started again.
    Restart,
    /// Envoy goes away: every thread (true), or the one given (false).
    EnvoyGoes(bool, usize),
    /// A new configuration for every thread.
    Push,
    Timeout(u64),
    UpstreamDone(Owner),
    /// The next piece of a request's body (false) or its response's (true).
    Data(Owner, bool),
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
    replica: Rng,
    never_reached: Rng,
    mismatch: Rng,
    pieces: Rng,
    tenants: Rng,
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
            replica: s("replica"),
            never_reached: s("never_reached"),
            mismatch: s("mismatch"),
            pieces: s("pieces"),
            tenants: s("tenants"),
        }
    }
}

pub struct World {
    pub now: i64,
    chances: Chances,
    pub shape: Shape,
    config: Rc<Config>,
    events: BinaryHeap<Reverse<(i64, u64, Event)>>,
    seq: u64,
    slots: HashMap<Owner, Slot>,
    /// Envoy, shared by its workers.
    proxy: Rc<RefCell<Proxy>>,
    /// Every worker a configuration of Envoy's threads set up, each with
    /// its store client; a request belongs to one...
    workers: Vec<Rc<Worker<Envoy>>>,
    /// ...and each to one of Envoy's threads...
    threads: Vec<usize>,
    /// ...whose newest takes its new requests.
    serving: Vec<usize>,
    /// The workers that went away with their thread.
    gone: HashSet<usize>,
    /// Each worker's timer: its period, and how often it was set.
    timers: Vec<(Duration, u64)>,
    /// Which worker each store callout in flight is of.
    tokens: HashMap<u64, usize>,
    /// When the store was restarted: answers it owed then are never sent.
    restarts: Vec<i64>,
    callouts: HashMap<u64, Callout>,
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
    /// gRPC replays the filter rerouted to the store's replay route.
    pub rerouted: usize,
    pub queue_full: usize,
    /// Attempts whose upstream's answer the filter read whole.
    pub read_upstream: HashSet<String>,
    /// Attempts whose settlement the store client gave up on.
    pub gave_up: HashSet<String>,
    /// Attempts whose exchange, store calls or letters were lost when
    /// Envoy (or their worker's VM) went away.
    pub envoy_lost: HashSet<String>,
    /// Attempts Envoy answered itself before the upstream got them...
    pub never_reached: HashSet<String>,
    /// ...and those whose filter never read that answer (its client had
    /// left a streaming request, or Envoy went away): to the filter the
    /// request was forwarded and its outcome is unknown.
    pub reply_unread: HashSet<String>,
    /// Whether each attempt's request carried the other body.
    pub other_body: HashMap<String, bool>,
    /// The attempts the policy observes (observe mode, or a canary's other
    /// side): forwarded whatever the store says.
    pub observed: HashSet<String>,
    /// What the store confirmed.
    pub confirmed: Vec<Confirmed>,
    /// Attempts whose filter read that the store gave them the key...
    pub told_theirs: HashSet<String>,
    /// ...and those whose filter read an answer of the store's that the
    /// key is not theirs (a `409`, a replay, a `422`, a `429`)...
    pub told_not_theirs: HashSet<String>,
    /// ...when the store first gave an attempt such an answer...
    pub refused_at: HashMap<String, i64>,
    /// ...and when it first answered one that the key is theirs.
    pub owned_at: HashMap<String, i64>,
    /// Attempts whose abandon the store took.
    pub abandoned: HashSet<String>,
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
    /// What the database lost when the store restarted.
    pub lost: Option<crate::database::loss::Lost>,
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

pub fn key_name(k: usize) -> String {
    format!("key-{k}")
}

/// The tenants of a policy that names them; an anonymous one's is everyone.
const TENANTS: [&str; 2] = ["t0", "t1"];

impl World {
    pub fn new(shape: Shape, seed: u64) -> World {
        let mut chances = Chances::new(seed);
        let config = Rc::new(shape.config.clone());
        let database = Database::new(shape.faults.slow_database, Rng::stream(seed, "database"));
        let authorization = config.store().authorization().to_string();
        let token = authorization.trim_start_matches("Bearer ").to_string();
        let far = Far::new(
            database,
            STORE_EPOCH,
            &token,
            shape.budgets,
            shape.faults.replica_skew_ms,
        );
        let mut begins: Vec<i64> = (0..shape.requests)
            .map(|_| chances.clients.range(0, shape.begin_within))
            .collect();
        let restart = shape
            .faults
            .store_restarts
            .then(|| Rng::stream(seed, "restart").range(200, shape.begin_within + 2_000));
        let envoy_goes = shape.faults.envoy_restarts.then(|| {
            let mut r = Rng::stream(seed, "envoy_restart");
            let at = r.range(100, shape.begin_within + 2_000);
            let every = r.chance(0.5);
            (at, Event::EnvoyGoes(every, r.range(0, WORKERS as i64) as usize))
        });
        let trace = std::env::var_os("SIMULATION_TRACE").is_some();
        let refuse = (
            shape.faults.never_reached / 3.0,
            Rng::stream(seed, "refuse_upstream"),
        );
        let proxy = Rc::new(RefCell::new(Proxy::new(
            refuse,
            Rng::stream(seed, "seeds"),
            trace,
        )));
        let mut w = World {
            now: 0,
            chances,
            config,
            events: BinaryHeap::new(),
            seq: 0,
            slots: HashMap::new(),
            proxy,
            workers: Vec::new(),
            threads: Vec::new(),
            serving: Vec::new(),
            gone: HashSet::new(),
            timers: Vec::new(),
            tokens: HashMap::new(),
            restarts: Vec::new(),
            callouts: HashMap::new(),
            far,
            execs: Vec::new(),
            got: HashMap::new(),
            attempts: HashMap::new(),
            request_keys: HashMap::new(),
            steps: 0,
            max_queued: 0,
            outgrown: None,
            queue_full: 0,
            rerouted: 0,
            gave_up: HashSet::new(),
            envoy_lost: HashSet::new(),
            never_reached: HashSet::new(),
            reply_unread: HashSet::new(),
            other_body: HashMap::new(),
            observed: HashSet::new(),
            read_upstream: HashSet::new(),
            confirmed: Vec::new(),
            told_theirs: HashSet::new(),
            abandoned: HashSet::new(),
            told_not_theirs: HashSet::new(),
            refused_at: HashMap::new(),
            owned_at: HashMap::new(),
            limited: Vec::new(),
            unlooked: None,
            seen: HashMap::new(),
            overwritten: None,
            changed: false,
            stuck: false,
            lost: None,
            trace,
            shape,
        };
        w.serving = (0..WORKERS).map(|thread| w.set_up(thread)).collect();
        if w.shape.push {
            let at = Rng::stream(seed, "push").range(100, w.shape.begin_within + 1_000);
            w.at(at, Event::Push);
        }
        for (owner, at) in begins.drain(..).enumerate() {
            w.at(at, Event::Begin(owner as Owner));
        }
        w.at(w.shape.sweep_every_ms, Event::Sweep);
        if let Some(at) = restart {
            w.at(at, Event::Restart);
        }
        if let Some((at, event)) = envoy_goes {
            w.at(at, event);
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
                continue;
            }
            let Some(Reverse((time, _, event))) = self.events.pop() else {
                self.stuck = true;
                break;
            };
            self.now = time;
            self.proxy.borrow_mut().now = time;
            self.steps += 1;
            if self.trace {
                println!("{time:>7} {}", self.told(&event));
            }
            self.handle(event);
            self.carry_out();
            self.watch_queues();
        }
        let proxy = self.proxy.borrow();
        self.gave_up.extend(proxy.gave_up.iter().cloned());
        self.queue_full = proxy.count("idemgate.store_queue_full_total") as usize;
        drop(proxy);
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
                        String::from_utf8_lossy(&c.body[..c.body.len().min(460)])
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
        for worker in &self.workers {
            let (calls, bytes) = worker.queued();
            self.max_queued = self.max_queued.max(calls);
            if calls > bound.calls || bytes > bound.bytes {
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
            // A loss of the database's is no overwrite: the audit judges
            // what it took; what it kept is watched from here on.
            Event::Restart => {
                self.restarts.push(self.now);
                self.look_at_histories();
                self.lost = self
                    .far
                    .restart(self.shape.faults.database_lost, self.confirmed.len());
                self.seen.clear();
                self.look_at_histories();
            }
            Event::EnvoyGoes(every, one) => {
                for thread in 0..WORKERS {
                    if every || thread == one {
                        self.envoy_goes(thread);
                    }
                }
            }
            Event::Push => {
                for thread in 0..WORKERS {
                    self.serving[thread] = self.set_up(thread);
                }
            }
            Event::Timeout(token) => self.answered(token, None),
            Event::UpstreamDone(owner) => self.upstream_done(owner),
            Event::Data(owner, response) => self.data(owner, response),
            Event::Timer(worker, set) => self.timer(worker, set),
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

    /// Claims the store refused: as late, and as over budget.
    pub fn refused(&self) -> (u64, u64) {
        self.far.refused()
    }

    /// Nothing left on any worker, no store call pending.
    pub fn quiet(&self) -> bool {
        let drained = |w: usize| self.gone.contains(&w) || self.workers[w].drained();
        (0..self.workers.len()).all(drained) && !self.far.busy()
    }
}
