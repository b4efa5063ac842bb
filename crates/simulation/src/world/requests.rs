//! A request's life on Envoy: its headers and body through the filter, the
//! router or the filter's own callout to the upstream, the response back
//! through the filter, its client leaving; and what the workers asked of
//! Envoy, carried out.

use idemgate_core::grpc::CONTENT_TYPE;
use idemgate_core::origin::{UPSTREAM_MARK, VIA_UPSTREAM};
use idemgate_core::protocol::Attempt;
use idemgate_worker::Action;

use crate::scenario::GRPC_METHOD;

use std::collections::VecDeque;

use super::*;

/// Envoy's details of a response the upstream never got, with its body.
const NEVER_REACHED: [(&str, &str); 2] = [
    ("no_healthy_upstream", "no healthy upstream"),
    (
        "upstream_reset_before_response_started{connection_failure}",
        "upstream connect error or disconnect/reset before headers. reset reason: connection failure",
    ),
];

/// Envoy's details of a response lost after the request was sent.
const LOST: &str = "upstream_reset_before_response_started{remote_reset}";

impl World {
    pub(super) fn begin(&mut self, owner: Owner) {
        let key = self.chances.clients.range(0, self.shape.keys as i64) as usize;
        let tenant = self.chances.tenants.range(0, self.shape.tenants as i64) as usize;
        let scope = tenant * self.shape.keys + key;
        let attempt = format!("a{owner}");
        // Another request under the same key: another body.
        let other = self.chances.mismatch.chance(self.shape.faults.mismatch);
        let body: &'static [u8] = if other { br#"{"amount":2}"# } else { b"{}" };
        self.other_body.insert(attempt.clone(), other);
        let line = |n: &str, v: String| (n.to_string(), v.into_bytes());
        let (path, content_type, body) = match self.shape.grpc {
            true => (GRPC_METHOD, CONTENT_TYPE, grpc::frame(body, false)),
            false => ("/pay", "application/json", body.to_vec()),
        };
        let stream = Stream {
            request_headers: vec![
                line(":method", "POST".into()),
                line(":path", path.into()),
                line(":authority", "h".into()),
                line("idempotency-key", format!("\"{}\"", key_name(key))),
                line("x-tenant", TENANTS[tenant].into()),
                line("content-type", content_type.into()),
                line("content-length", body.len().to_string()),
            ],
            request: Body::new(body.clone(), self.pieces(body.len())),
            ..Stream::default()
        };
        self.proxy.borrow_mut().streams.insert(owner, stream);
        if tenant >= self.shape.enforced {
            self.observed.insert(attempt.clone());
        }
        self.attempts.insert(owner, attempt.clone());
        self.request_keys.insert(owner, scope);
        let worker = self.serving[owner as usize % WORKERS];
        let envoy = Envoy {
            proxy: self.proxy.clone(),
            worker,
        };
        let attempt = Attempt::try_from(attempt).ok();
        let filter = Filter::new(envoy, owner, Some(self.workers[worker].clone()), attempt);
        self.slots.insert(
            owner,
            Slot {
                filter: Some(filter),
                key: scope,
                worker,
                exec: None,
                detached: None,
                lost: false,
                never_reached: false,
                rerouted: None,
                replay: None,
            },
        );
        if self.chances.clients.chance(self.shape.faults.client_leaves) {
            let after = self.chances.clients.range(0, 2_500);
            self.at(self.now + after, Event::Leave(owner));
        }
        self.callback(owner, |f| f.request_headers(false));
        self.carry_out();
        self.data(owner, false);
    }

    /// Where each piece of a body of `len` bytes ends: one piece, or (with
    /// [`Shape::chunks`]) up to three.
    fn pieces(&mut self, len: usize) -> VecDeque<usize> {
        let mut ends: Vec<usize> = Vec::new();
        if self.shape.chunks && len > 1 {
            let more = self.chances.pieces.range(0, 3);
            ends.extend((0..more).map(|_| self.chances.pieces.range(1, len as i64) as usize));
        }
        ends.push(len);
        ends.sort_unstable();
        ends.dedup();
        ends.into()
    }

    /// The next piece of the request's body, or of its response's, reaches
    /// the filter; the rest follows a few milliseconds later.
    pub(super) fn data(&mut self, owner: Owner, response: bool) {
        let piece = {
            let mut proxy = self.proxy.borrow_mut();
            proxy.streams.get_mut(&owner).and_then(|s| {
                let body = if response { &mut s.response } else { &mut s.request };
                let end = body.ends.pop_front()?;
                body.arrived = end;
                let trailers = response && !s.response_trailers.is_empty();
                Some((end - body.drained, end == body.bytes.len(), trailers))
            })
        };
        let Some((size, last, trailers)) = piece else {
            return;
        };
        let action = self.callback(owner, |f| match response {
            true => f.response_body(size, last && !trailers),
            false => f.request_body(size, last),
        });
        let Some(action) = action else { return };
        if last && trailers {
            // The trailers follow the last piece at once.
            if action == Action::Continue {
                self.flows_on(owner, response);
            }
            self.trailers(owner);
            return;
        }
        if last
            && response
            && self
                .slots
                .get(&owner)
                .is_some_and(|s| !s.lost && s.exec.is_some())
        {
            self.read_upstream.insert(self.attempts[&owner].clone());
        }
        if action == Action::Continue {
            self.flows_on(owner, response);
        }
        if !last {
            let after = self.chances.pieces.range(1, 20);
            self.at(self.now + after, Event::Data(owner, response));
        }
    }

    /// The filter lets what Envoy buffered go on; once the whole body has,
    /// the request goes upstream, or the response to its client.
    fn flows_on(&mut self, owner: Owner, response: bool) {
        let whole = {
            let mut proxy = self.proxy.borrow_mut();
            let Some(s) = proxy.streams.get_mut(&owner) else {
                return;
            };
            let trailers_wait = response && !s.response_trailers.is_empty() && !s.trailers_reached;
            let body = if response { &mut s.response } else { &mut s.request };
            body.drained = body.arrived;
            body.arrived == body.bytes.len() && !trailers_wait
        };
        match (whole, response) {
            (false, _) => {}
            (true, false) => self.request_passed(owner),
            (true, true) => self.response_passed(owner),
        }
    }

    /// Runs one of the request's callbacks in its context (`None` once
    /// its client has left).
    fn callback(&mut self, owner: Owner, f: impl FnOnce(&mut Filter<Envoy>) -> Action) -> Option<Action> {
        let filter = self.slots.get_mut(&owner)?.filter.as_mut()?;
        self.proxy.borrow_mut().current = Some(owner);
        let action = f(filter);
        self.proxy.borrow_mut().current = None;
        Some(action)
    }

    /// The response's trailers reach the filter.
    fn trailers(&mut self, owner: Owner) {
        if let Some(s) = self.proxy.borrow_mut().streams.get_mut(&owner) {
            s.trailers_reached = true;
        }
        if self.callback(owner, |f| f.response_trailers()) == Some(Action::Continue) {
            self.flows_on(owner, true);
        }
    }

    /// The filter let the whole request go on: the router sends it upstream,
    /// or to the store's replay route where the filter rerouted it.
    fn request_passed(&mut self, owner: Owner) {
        let Some(slot) = self.slots.get_mut(&owner) else {
            return;
        };
        if let Some(body) = slot.rerouted.take() {
            self.replay(owner, body);
        } else if slot.exec.is_none() && !slot.never_reached {
            self.start_exec(owner, None);
        }
    }

    /// The store's replay route answers a rerouted request; its answer
    /// goes back through the filter as any response does.
    fn replay(&mut self, owner: Owner, body: Vec<u8>) {
        let (headers, messages, trailers) = self.far.replay(body);
        self.rerouted += 1;
        if let Some(slot) = self.slots.get_mut(&owner) {
            slot.replay = Some(grpc::replayed(headers.clone(), &messages, &trailers));
        }
        let mut head = vec![(":status".to_string(), b"200".to_vec())];
        head.extend(headers.into_iter().map(|(n, v)| (n, v.into_bytes())));
        let trailers = trailers.into_iter().map(|(n, v)| (n, v.into_bytes())).collect();
        self.deliver(owner, head, messages, trailers, VIA_UPSTREAM);
    }

    /// The whole response went on to the client.
    fn response_passed(&mut self, owner: Owner) {
        let Some(slot) = self.slots.get(&owner) else {
            return;
        };
        // Envoy's own 503 when the response was lost or never came.
        let got = match (&slot.replay, slot.exec) {
            (Some(replay), _) => Got::Reply(replay.clone()),
            (None, Some(exec)) if !slot.lost => Got::Upstream(self.execs[exec].status, true),
            _ => Got::Upstream(503, false),
        };
        self.got.insert(owner, got);
        self.client_done(owner);
    }

    /// Carries out what the workers asked of Envoy, until they ask nothing.
    pub(super) fn carry_out(&mut self) {
        let refused = std::mem::take(&mut self.proxy.borrow_mut().refused);
        for owner in refused {
            self.never_reached.insert(self.attempts[&owner].clone());
        }
        loop {
            let effects = std::mem::take(&mut self.proxy.borrow_mut().effects);
            if effects.is_empty() {
                return;
            }
            for effect in effects {
                self.effect(effect);
            }
        }
    }

    fn effect(&mut self, effect: Effect) {
        match effect {
            Effect::Store { worker, token, call } => self.dispatch(worker, token, call),
            Effect::Upstream {
                owner,
                token,
                timeout_ms,
            } => self.start_exec(owner, Some((token, timeout_ms))),
            Effect::Reply { owner, reply } => {
                if self.slots.get(&owner).is_some_and(|s| s.filter.is_some()) {
                    let reply = match self.shape.grpc {
                        true => grpc::problem(&reply),
                        false => reply,
                    };
                    self.got.insert(owner, Got::Reply(reply));
                    self.client_done(owner);
                }
            }
            Effect::Reroute { owner, body } => {
                if let Some(slot) = self.slots.get_mut(&owner) {
                    slot.rerouted = Some(body);
                }
            }
            Effect::Resume { owner, response } => {
                if self.slots.contains_key(&owner) {
                    self.flows_on(owner, response);
                }
            }
            Effect::Tick { worker, period } => {
                let set = self.timers[worker].1 + 1;
                self.timers[worker] = (period, set);
                if !period.is_zero() {
                    self.at(self.now + period.as_millis() as i64, Event::Timer(worker, set));
                }
            }
        }
    }

    /// A worker's timer fires (the root's `on_tick`) while its period stands.
    pub(super) fn timer(&mut self, worker: usize, set: u64) {
        let (period, current) = self.timers[worker];
        if set != current || period.is_zero() {
            return;
        }
        self.workers[worker].pump();
        if self.timers[worker].1 == set {
            self.at(self.now + period.as_millis() as i64, Event::Timer(worker, set));
        }
    }

    /// The client has its answer; the stream ends (Envoy's `on_log`).
    pub(super) fn client_done(&mut self, owner: Owner) {
        self.at(self.now, Event::Leave(owner));
    }

    /// The client is gone: Envoy logs the stream and deletes its context.
    /// The filter's own upstream request outlives it.
    pub(super) fn leave(&mut self, owner: Owner) {
        if self
            .callback(owner, |f| {
                f.client_left();
                Action::Continue
            })
            .is_none()
        {
            return;
        }
        let Some(slot) = self.slots.get_mut(&owner) else {
            return;
        };
        slot.filter = None;
        if slot.detached.is_none() {
            self.slots.remove(&owner);
        }
    }

    /// The upstream gets the request: through the router, or as the
    /// filter's own callout (its token and timeout).
    pub(super) fn start_exec(&mut self, owner: Owner, detached: Option<(u32, u64)>) {
        let Some(slot) = self.slots.get_mut(&owner) else {
            return;
        };
        slot.detached = detached;
        if self.chances.never_reached.chance(self.shape.faults.never_reached) {
            // Envoy answers itself within a few milliseconds; nothing runs.
            let after = self.chances.never_reached.range(1, 10);
            slot.never_reached = true;
            self.never_reached.insert(self.attempts[&owner].clone());
            self.at(self.now + after, Event::UpstreamDone(owner));
            return;
        }
        let n = self.execs.len();
        let upstream = &mut self.chances.upstream;
        let status = match upstream.range(0, 20) {
            0 => 422,
            1 => 500,
            _ => 201,
        };
        let size = upstream.range(self.shape.body_min as i64, self.shape.body_max as i64 + 1) as usize;
        let mut body = format!("scope-{}#{n}:", slot.key).into_bytes();
        body.resize(size.max(body.len()), b'.');
        let (lo, hi) = self.shape.latency;
        let latency = upstream.range(lo, hi);
        // Envoy gives up on the filter's own upstream call at its timeout.
        let answer_after = match detached {
            Some((_, timeout)) => latency.min(timeout as i64),
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

    pub(super) fn upstream_done(&mut self, owner: Owner) {
        let lost = self.chances.upstream.chance(self.shape.faults.upstream_lost);
        let Some(slot) = self.slots.get_mut(&owner) else {
            // Envoy's own reply finds nobody (the client left, Envoy went away).
            if self.never_reached.contains(&self.attempts[&owner]) {
                self.reply_unread.insert(self.attempts[&owner].clone());
            }
            return;
        };
        if slot.never_reached {
            self.local_reply(owner);
            return;
        }
        let Some(exec) = slot.exec else { return };
        let e = self.execs[exec].clone();
        match slot.detached.take() {
            Some((token, timeout)) => {
                let answer = match lost || (e.end - e.start) as u64 >= timeout {
                    true => None,
                    false => {
                        self.read_upstream.insert(e.attempt.clone());
                        let headers = vec![
                            (":status".to_string(), e.status.to_string().into_bytes()),
                            (UPSTREAM_MARK.to_string(), b"1".to_vec()),
                        ];
                        Some((headers, e.body))
                    }
                };
                self.callout_answered(owner, token, answer);
            }
            None => {
                slot.lost = lost;
                let (status, details) = match lost {
                    true => (503, LOST),
                    false => (e.status, VIA_UPSTREAM),
                };
                self.respond(owner, status, details, e.body);
            }
        }
    }

    /// Envoy's own answer to a request the upstream never got.
    fn local_reply(&mut self, owner: Owner) {
        let (details, text) = NEVER_REACHED[self.chances.never_reached.range(0, 2) as usize];
        let Some(slot) = self.slots.get_mut(&owner) else {
            return;
        };
        match slot.detached.take() {
            Some((token, _)) => {
                let headers = vec![(":status".to_string(), b"503".to_vec())];
                self.callout_answered(owner, token, Some((headers, text.as_bytes().to_vec())));
            }
            None => {
                if !self.respond(owner, 503, details, text.as_bytes().to_vec()) {
                    self.reply_unread.insert(self.attempts[&owner].clone());
                }
            }
        }
    }

    /// The answer to the filter's own upstream request, to its worker;
    /// `None`: Envoy lost it or timed it out.
    fn callout_answered(&mut self, owner: Owner, token: u32, answer: Option<CallResponse>) {
        let Some(slot) = self.slots.get(&owner) else {
            return;
        };
        let worker = slot.worker;
        let (headers, size) = answer.as_ref().map_or((0, 0), |(h, b)| (h.len(), b.len()));
        self.proxy.borrow_mut().call_response = answer;
        self.workers[worker].answer(token, headers, size);
        if self.slots.get(&owner).is_some_and(|s| s.filter.is_none()) {
            self.slots.remove(&owner);
        }
    }

    /// The response through the filter to a client still there; whether
    /// there was one. On a gRPC call the upstream's answer is a message and
    /// a status in trailers, and Envoy's own (`details` not
    /// [`VIA_UPSTREAM`]) a status alone, in the headers.
    fn respond(&mut self, owner: Owner, status: u16, details: &str, body: Vec<u8>) -> bool {
        let (headers, body, trailers) = match (self.shape.grpc, details == VIA_UPSTREAM) {
            (false, _) => {
                let head = |n: &str, v: String| (n.to_string(), v.into_bytes());
                let headers = vec![
                    head(":status", status.to_string()),
                    head("content-length", body.len().to_string()),
                ];
                (headers, body, Vec::new())
            }
            (true, true) => {
                // Every other execution's answer is compressed.
                let compressed = self
                    .slots
                    .get(&owner)
                    .and_then(|s| s.exec)
                    .is_some_and(|n| n % 2 == 1);
                grpc::upstream_answer(status, &body, compressed)
            }
            (true, false) => grpc::envoy_answer(),
        };
        self.deliver(owner, headers, body, trailers, details)
    }

    /// A response's headers, body and trailers, through the filter.
    fn deliver(
        &mut self,
        owner: Owner,
        headers: Vec<(String, Vec<u8>)>,
        body: Vec<u8>,
        trailers: Vec<(String, Vec<u8>)>,
        details: &str,
    ) -> bool {
        // A gRPC status alone ends the stream with the headers.
        let headers_only = self.shape.grpc && body.is_empty() && trailers.is_empty();
        let ends = self.pieces(body.len());
        if let Some(stream) = self.proxy.borrow_mut().streams.get_mut(&owner) {
            stream.response_headers = headers;
            stream.code_details = details.to_string();
            stream.response = Body::new(body, ends);
            stream.response_trailers = trailers;
        }
        let Some(action) = self.callback(owner, |f| f.response_headers(headers_only)) else {
            return false;
        };
        self.carry_out();
        match headers_only {
            true if action == Action::Continue => self.flows_on(owner, true),
            true => {}
            false => self.data(owner, true),
        }
        true
    }
}
