//! Envoy's part, simulated: the host the workers' real code
//! (`idemgate_worker`) runs on. It holds what Envoy holds of each request
//! (headers, body, the response), answers the worker's host calls from it,
//! and notes what the worker asked Envoy to do (dispatch a callout, answer
//! a client, resume a stream, set a timer) for the world to carry out;
//! and Envoy's threads, each with the worker of its configuration.

use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::rc::Rc;
use std::time::Duration;

use idemgate_core::client::Owner;
use idemgate_core::config::StoreConfig;
use idemgate_core::exchange::UpstreamCall;
use idemgate_core::store_call::{StoreAnswer, StoreCall};
use idemgate_core::Reply;
use idemgate_worker::host::{line, Bytes};
use idemgate_worker::{Host, Level, Worker};

use crate::rng::Rng;

/// A callout's answer as Envoy hands it over: its headers and body.
pub type CallResponse = (Vec<(String, Bytes)>, Vec<u8>);

/// What Envoy holds of one request.
#[derive(Default)]
pub struct Stream {
    pub request_headers: Vec<(String, Bytes)>,
    pub request: Body,
    pub response_headers: Vec<(String, Bytes)>,
    pub response: Body,
    pub response_trailers: Vec<(String, Bytes)>,
    /// The trailers reached the filter: with the whole body, the response
    /// may go on.
    pub trailers_reached: bool,
    pub code_details: String,
}

/// A body on its way through Envoy, in pieces.
#[derive(Default)]
pub struct Body {
    pub bytes: Vec<u8>,
    /// Where each piece yet to arrive ends.
    pub ends: VecDeque<usize>,
    /// Bytes arrived so far...
    pub arrived: usize,
    /// ...and those gone on past the filter: Envoy's buffer holds the rest.
    pub drained: usize,
}

impl Body {
    pub fn new(bytes: Vec<u8>, ends: VecDeque<usize>) -> Body {
        Body {
            bytes,
            ends,
            arrived: 0,
            drained: 0,
        }
    }

    fn buffered(&self, start: usize, size: usize) -> Bytes {
        slice(&self.bytes[self.drained..self.arrived], start, size)
    }
}

/// What a worker asked of Envoy, for the world to carry out.
#[derive(Debug)]
pub enum Effect {
    Store {
        worker: usize,
        token: u32,
        call: StoreCall,
    },
    Upstream {
        owner: Owner,
        token: u32,
        timeout_ms: u64,
    },
    Reply {
        owner: Owner,
        reply: Reply,
    },
    /// The request goes on to the store's replay route with this body.
    Reroute {
        owner: Owner,
        body: Vec<u8>,
    },
    Resume {
        owner: Owner,
        response: bool,
    },
    Tick {
        worker: usize,
        period: Duration,
    },
}

/// Envoy's state, shared by its workers.
pub struct Proxy {
    pub now: i64,
    /// The request later calls act on (`None`: the root context).
    pub current: Option<Owner>,
    pub streams: HashMap<Owner, Stream>,
    pub effects: Vec<Effect>,
    /// The callout being answered: its headers and body.
    pub call_response: Option<CallResponse>,
    next_token: u32,
    counters: Vec<(String, u64)>,
    /// Attempts whose letter the store client gave up on.
    pub gave_up: Vec<String>,
    /// The chance that Envoy refuses to send the filter's own upstream
    /// request (no healthy host), and its stream...
    refuse_upstream: (f64, Rng),
    /// ...and the requests it refused.
    pub refused: Vec<Owner>,
    seeds: Rng,
    trace: bool,
}

impl Proxy {
    pub fn new(refuse_upstream: (f64, Rng), seeds: Rng, trace: bool) -> Proxy {
        Proxy {
            now: 0,
            current: None,
            streams: HashMap::new(),
            effects: Vec::new(),
            call_response: None,
            next_token: 0,
            counters: Vec::new(),
            gave_up: Vec::new(),
            refuse_upstream,
            refused: Vec::new(),
            seeds,
            trace,
        }
    }

    /// The count of counter `name` (0 if never defined).
    pub fn count(&self, name: &str) -> u64 {
        self.counters.iter().find(|(n, _)| n == name).map_or(0, |c| c.1)
    }

    fn token(&mut self) -> u32 {
        self.next_token += 1;
        self.next_token
    }

    fn stream(&self) -> Option<&Stream> {
        self.streams.get(&self.current?)
    }

    fn owner(&self, what: &str) -> Owner {
        self.current
            .unwrap_or_else(|| panic!("{what} with no request context"))
    }
}

/// One worker's handle on Envoy.
#[derive(Clone)]
pub struct Envoy {
    pub proxy: Rc<RefCell<Proxy>>,
    pub worker: usize,
}

impl Envoy {
    fn with<T>(&self, f: impl FnOnce(&mut Proxy) -> T) -> T {
        f(&mut self.proxy.borrow_mut())
    }
}

fn slice(bytes: &[u8], start: usize, size: usize) -> Bytes {
    let start = start.min(bytes.len());
    bytes[start..(start + size).min(bytes.len())].to_vec()
}

impl Host for Envoy {
    fn now_ms(&self) -> i64 {
        self.with(|p| p.now)
    }

    fn now_us(&self) -> i64 {
        self.now_ms() * 1_000
    }

    fn random_u64(&self) -> u64 {
        self.with(|p| p.seeds.range(1, i64::MAX) as u64)
    }

    fn log(&self, level: Level, message: &str) {
        let line = line(message);
        if level == Level::Warn && message.starts_with("the store could not be reached in time") {
            if let Some(attempt) = line.strip_prefix("attempt ").and_then(|l| l.split(':').next()) {
                self.with(|p| p.gave_up.push(attempt.to_string()));
            }
        }
        if self.with(|p| p.trace) {
            println!("        worker {}: {level:?} {line}", self.worker);
        }
    }

    fn counter(&self, name: &str) -> Option<u32> {
        self.with(|p| {
            let id = match p.counters.iter().position(|(n, _)| n == name) {
                Some(id) => id,
                None => {
                    p.counters.push((name.to_string(), 0));
                    p.counters.len() - 1
                }
            };
            u32::try_from(id).ok()
        })
    }

    fn increment(&self, counter: Option<u32>) {
        self.with(|p| {
            if let Some(c) = counter.and_then(|id| p.counters.get_mut(id as usize)) {
                c.1 += 1;
            }
        });
    }

    fn histogram(&self, _name: &str) -> Option<u32> {
        None
    }

    fn record(&self, _histogram: Option<u32>, _value: u64) {}

    fn set_gauge(&self, _name: &str, _value: u64) {}

    fn request_header(&self, name: &str) -> Option<Bytes> {
        self.with(|p| {
            let stream = p.stream()?;
            let line = stream.request_headers.iter().find(|(n, _)| n == name)?;
            Some(line.1.clone())
        })
    }

    fn request_headers(&self) -> Vec<(String, Bytes)> {
        self.with(|p| p.stream().map(|s| s.request_headers.clone()).unwrap_or_default())
    }

    fn remove_request_header(&self, name: &str) {
        self.with(|p| {
            if let Some(s) = p.current.and_then(|o| p.streams.get_mut(&o)) {
                s.request_headers.retain(|(n, _)| n != name);
            }
        });
    }

    fn remove_forged_replay_marker(&self) {}

    fn property(&self, path: &[&str]) -> Option<Bytes> {
        match path {
            ["xds", "cluster_name"] => Some(b"upstream".to_vec()),
            ["response", "code_details"] => {
                self.with(|p| Some(p.stream()?.code_details.clone().into_bytes()))
            }
            _ => None,
        }
    }

    fn request_body(&self, start: usize, size: usize) -> Bytes {
        self.with(|p| {
            p.stream()
                .map(|s| s.request.buffered(start, size))
                .unwrap_or_default()
        })
    }

    fn response_headers(&self) -> Vec<(String, Bytes)> {
        self.with(|p| p.stream().map(|s| s.response_headers.clone()).unwrap_or_default())
    }

    fn response_trailers(&self) -> Vec<(String, Bytes)> {
        self.with(|p| {
            p.stream()
                .map(|s| s.response_trailers.clone())
                .unwrap_or_default()
        })
    }

    fn remove_response_header(&self, _name: &str) {}

    fn remove_response_trailer(&self, _name: &str) {}

    fn set_response_header(&self, _name: &str, _value: &str) {}

    fn response_body(&self, start: usize, size: usize) -> Bytes {
        self.with(|p| {
            p.stream()
                .map(|s| s.response.buffered(start, size))
                .unwrap_or_default()
        })
    }

    fn set_filter_state(&self, _name: &str, _value: &str) {}

    fn send_reply(&self, reply: &Reply) {
        self.with(|p| {
            let owner = p.owner("a reply");
            p.effects.push(Effect::Reply {
                owner,
                reply: reply.clone(),
            });
        });
    }

    fn reroute(&self, call: &StoreCall, _held: usize) {
        self.with(|p| {
            let owner = p.owner("a reroute");
            p.effects.push(Effect::Reroute {
                owner,
                body: call.body.clone(),
            });
        });
    }

    fn set_effective_context(&self, owner: Owner) {
        self.with(|p| p.current = Some(owner));
    }

    fn resume_request(&self) {
        self.with(|p| {
            let owner = p.owner("a resumed request");
            p.effects.push(Effect::Resume {
                owner,
                response: false,
            });
        });
    }

    fn resume_response(&self) {
        self.with(|p| {
            let owner = p.owner("a resumed response");
            p.effects.push(Effect::Resume {
                owner,
                response: true,
            });
        });
    }

    fn dispatch(&self, _store: &StoreConfig, call: &StoreCall) -> Option<u32> {
        self.with(|p| {
            let token = p.token();
            p.effects.push(Effect::Store {
                worker: self.worker,
                token,
                call: call.clone(),
            });
            Some(token)
        })
    }

    fn dispatch_upstream(&self, call: &UpstreamCall, _body: &[u8]) -> Option<u32> {
        self.with(|p| {
            let owner = p.owner("an upstream request");
            let (chance, rng) = &mut p.refuse_upstream;
            if rng.chance(*chance) {
                p.refused.push(owner);
                return None;
            }
            let token = p.token();
            p.effects.push(Effect::Upstream {
                owner,
                token,
                timeout_ms: call.timeout_ms,
            });
            Some(token)
        })
    }

    fn call_response_headers(&self, num_headers: usize) -> Option<Vec<(String, Bytes)>> {
        if num_headers == 0 {
            return None;
        }
        self.with(|p| p.call_response.as_ref().map(|r| r.0.clone()))
    }

    fn call_response_body(&self, size: usize) -> Bytes {
        self.with(|p| {
            p.call_response
                .as_ref()
                .map(|r| slice(&r.1, 0, size))
                .unwrap_or_default()
        })
    }

    fn store_answer(&self, num_headers: usize, body_size: usize) -> StoreAnswer {
        let headers = self.call_response_headers(num_headers)?;
        let status = headers.iter().find(|(n, _)| n == ":status")?;
        let status = std::str::from_utf8(&status.1).ok()?.parse().ok()?;
        Some((status, self.call_response_body(body_size)))
    }

    fn set_tick_period(&self, period: Duration) -> bool {
        self.with(|p| {
            p.effects.push(Effect::Tick {
                worker: self.worker,
                period,
            })
        });
        true
    }
}

impl super::World {
    /// A worker for one of Envoy's threads, on the configuration.
    pub(super) fn set_up(&mut self, thread: usize) -> usize {
        let worker = self.workers.len();
        let envoy = Envoy {
            proxy: self.proxy.clone(),
            worker,
        };
        let bound = self.shape.bound;
        self.workers
            .push(Rc::new(Worker::bounded(envoy, self.config.clone(), bound)));
        self.threads.push(thread);
        self.timers.push((Duration::ZERO, 0));
        worker
    }

    /// One of Envoy's threads (or its VM) goes away and comes back empty:
    /// its requests, its queued and in-flight store calls (a call already
    /// on the wire may still land; its answer finds nobody) and its
    /// letters are lost, and new requests find a fresh worker.
    pub(super) fn envoy_goes(&mut self, thread: usize) {
        let gone: Vec<usize> = (0..self.workers.len())
            .filter(|w| self.threads[*w] == thread)
            .collect();
        for &worker in &gone {
            if self.gone.insert(worker) {
                self.envoy_lost.extend(self.workers[worker].held());
            }
            self.timers[worker] = (Duration::ZERO, self.timers[worker].1 + 1);
        }
        self.slots.retain(|_, s| !gone.contains(&s.worker));
        self.tokens.retain(|_, w| !gone.contains(w));
        self.serving[thread] = self.set_up(thread);
    }
}
