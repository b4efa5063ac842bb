//! A request's life on its worker: its exchange's steps carried out as the
//! filter carries them out, its client leaving, its upstream execution.

use super::*;

impl World {
    pub(super) fn begin(&mut self, owner: Owner) {
        let key = self.chances.clients.range(0, self.shape.keys as i64) as usize;
        let policy = self.config.policy_for("POST", "h", "/pay").unwrap().clone();
        let lines = vec![(":path".to_string(), b"/pay".to_vec())];
        let attempt = format!("a{owner}");
        // Another request under the same key: another body.
        let other = self.chances.mismatch.chance(self.shape.faults.mismatch);
        let body: &'static [u8] = if other { br#"{"amount":2}"# } else { b"{}" };
        self.other_body.insert(attempt.clone(), other);
        let head = RequestHead {
            method: "POST".into(),
            path: "/pay".into(),
            key_fields: vec![key_name(key).into_bytes()],
            end_of_stream: false,
            content_length: Some(body.len() as u64),
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
            idemgate_core::config::Forwarding::Detached(d) => Some(d.upstream_timeout_ms()),
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
                never_reached: false,
            },
        );
        if self.chances.clients.chance(self.shape.faults.client_leaves) {
            let after = self.chances.clients.range(0, 2_500);
            self.at(self.now + after, Event::Leave(owner));
        }
        self.act(owner, step, Dir::Request);
        let step = match self.slots.get_mut(&owner) {
            Some(slot) => slot.ex.request_body(body, true),
            None => return,
        };
        self.act(owner, step, Dir::Request);
    }

    pub(super) fn act(&mut self, owner: Owner, step: Step, dir: Dir) {
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
            Step::Continue if slot.never_reached && slot.attached => {
                self.got.insert(owner, Got::Upstream(503, false));
                self.client_done(owner);
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
    pub(super) fn client_done(&mut self, owner: Owner) {
        self.at(self.now, Event::Leave(owner));
    }

    pub(super) fn leave(&mut self, owner: Owner) {
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

    pub(super) fn post(&mut self, worker: usize, letter: Letter) {
        // A letter pushed out of a full outbox is given up: its record's
        // lease settles it, as the contract allows.
        *self.letters_of[worker]
            .entry(letter.attempt.as_str().to_string())
            .or_default() += 1;
        if let Some(out) = self.clients[worker].letters.post(letter, self.now) {
            self.gave_up.insert(out.attempt.as_str().to_string());
            self.letter_decided(worker, out.attempt.as_str());
        }
    }

    /// One of `worker`'s letters for `attempt` is no longer its to send.
    pub(super) fn letter_decided(&mut self, worker: usize, attempt: &str) {
        if let Some(n) = self.letters_of[worker].get_mut(attempt) {
            *n -= 1;
            if *n == 0 {
                self.letters_of[worker].remove(attempt);
            }
        }
    }

    pub(super) fn start_exec(&mut self, owner: Owner) {
        if !self.slots.contains_key(&owner) {
            return;
        }
        if self.chances.never_reached.chance(self.shape.faults.never_reached) {
            // Envoy answers itself within a few milliseconds; nothing runs.
            let after = self.chances.never_reached.range(1, 10);
            if let Some(slot) = self.slots.get_mut(&owner) {
                slot.never_reached = true;
            }
            self.never_reached.insert(self.attempts[&owner].clone());
            self.at(self.now + after, Event::UpstreamDone(owner));
            return;
        }
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
        match slot.waiting {
            Some((true, dir)) => {
                slot.waiting = None;
                let timeout = slot.ex_detached_timeout.unwrap_or(0);
                let answer = if lost || (e.end - e.start) as u64 >= timeout {
                    UpstreamAnswer::Lost
                } else {
                    self.read_upstream.insert(e.attempt.clone());
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
                if !lost {
                    self.read_upstream.insert(e.attempt.clone());
                }
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

    /// Envoy's own answer to a request the upstream never got.
    fn local_reply(&mut self, owner: Owner) {
        const TEXTS: [&str; 2] = [
            "no healthy upstream",
            "upstream connect error or disconnect/reset before headers. reset reason: connection failure",
        ];
        let kind = self.chances.never_reached.range(0, 3) as usize;
        let Some(slot) = self.slots.get_mut(&owner) else {
            self.reply_unread.insert(self.attempts[&owner].clone());
            return;
        };
        match slot.waiting {
            Some((true, dir)) => {
                slot.waiting = None;
                let answer = match TEXTS.get(kind) {
                    None => UpstreamAnswer::Refused,
                    Some(text) => UpstreamAnswer::Response {
                        headers: vec![(":status".to_string(), b"503".to_vec())],
                        body_size: text.len(),
                    },
                };
                let body = TEXTS.get(kind).unwrap_or(&"").as_bytes().to_vec();
                let step = slot.ex.upstream_reply(answer, || body);
                self.act(owner, step, dir);
                self.let_go_if_done(owner);
            }
            None if slot.attached && slot.ex.owns_response() => {
                let text = TEXTS[kind % TEXTS.len()];
                let head = ResponseHead {
                    status: 503,
                    origin: Origin::NeverReached,
                    headers: Vec::new(),
                    content_length: Some(text.len() as u64),
                    end_of_stream: false,
                };
                let step = match slot.ex.response_headers(head) {
                    Step::Pause => match self.slots.get_mut(&owner) {
                        Some(slot) => slot.ex.response_body(text.as_bytes(), true),
                        None => return,
                    },
                    other => other,
                };
                self.act(owner, step, Dir::Response);
            }
            _ => {
                self.reply_unread.insert(self.attempts[&owner].clone());
            }
        }
    }

    pub(super) fn let_go_if_done(&mut self, owner: Owner) {
        if self
            .slots
            .get(&owner)
            .is_some_and(|s| !s.attached && s.waiting.is_none())
        {
            self.slots.remove(&owner);
        }
    }
}
