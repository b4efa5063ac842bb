//! The network between the workers and the store: the store client's
//! callouts dispatched, delivered (or lost, delayed, refused, sent twice)
//! and answered, and what each answer confirms.

use super::*;

impl World {
    pub(super) fn dispatch(&mut self, worker: usize, token: u32, call: StoreCall) {
        let token = u64::from(token);
        self.tokens.insert(token, worker);
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

    pub(super) fn arrive(&mut self, token: u64) {
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
        let second = self.chances.replica.chance(0.5);
        self.far
            .call(token, c.path, c.body.clone(), &c.traces, &authorization, second);
        self.changed = true;
        self.settle();
    }

    /// Whatever the store answered by now goes back over the network.
    pub(super) fn settle(&mut self) {
        for (token, answer) in self.far.settle(self.store_clock()) {
            self.note(token, &answer);
            self.reply(token, Some(answer));
        }
    }

    /// Notes what the store confirmed in its answer to call `token`.
    pub(super) fn note(&mut self, token: u64, (status, body): &Answered) {
        let Some(c) = self.callouts.get(&token) else {
            return;
        };
        let calls = match c.path {
            BATCH_PATH => batch_parts(&c.body, *status, body).unwrap_or_default(),
            path => vec![(path.to_string(), &c.body[..], *status, &body[..])],
        };
        let mut limited = Vec::new();
        for (path, frame, status, answer) in calls {
            if let Some((attempt, theirs)) = claim_decided(&path, frame, status, answer) {
                let first = match theirs {
                    true => &mut self.owned_at,
                    false => &mut self.refused_at,
                };
                first.entry(attempt).or_insert(self.now);
            }
            self.confirmed.extend(confirmed(&path, frame, status, answer));
            if let Some(attempt) = abandon_done(&path, frame, status, answer) {
                self.abandoned.insert(attempt);
            }
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
    pub(super) fn store_clock(&self) -> i64 {
        let stepped = if self.now >= CLOCK_STEP_AT {
            self.now - self.shape.faults.clock_steps_back_ms
        } else {
            self.now
        };
        STORE_EPOCH + stepped
    }

    pub(super) fn reply(&mut self, token: u64, answer: StoreAnswer) {
        let answer = if self.chances.lose_answer.chance(self.shape.faults.lose_answer) {
            None
        } else {
            answer
        };
        let (lo, hi) = self.shape.answer_ms;
        let delay = self.chances.store.range(lo, hi);
        self.at(self.now + delay, Event::Answer(token, answer, self.now));
    }

    pub(super) fn answered(&mut self, token: u64, answer: StoreAnswer) {
        let Some(c) = self.callouts.get_mut(&token) else {
            return;
        };
        if c.answered {
            return;
        }
        c.answered = true;
        if let Some((status, body)) = &answer {
            let parts = match c.path {
                BATCH_PATH => batch_parts(&c.body, *status, body).unwrap_or_default(),
                path => vec![(path.to_string(), &c.body[..], *status, &body[..])],
            };
            for (path, frame, status, answer) in parts {
                if let Some((attempt, theirs)) = claim_decided(&path, frame, status, answer) {
                    match theirs {
                        true => self.told_theirs.insert(attempt),
                        false => self.told_not_theirs.insert(attempt),
                    };
                }
            }
        }
        let Some(worker) = self.tokens.remove(&token) else {
            return;
        };
        let (headers, size) = answer.as_ref().map_or((0, 0), |(_, body)| (1, body.len()));
        self.proxy.borrow_mut().call_response = answer.map(|(status, body)| {
            (
                vec![(":status".to_string(), status.to_string().into_bytes())],
                body,
            )
        });
        self.workers[worker].answer(token as u32, headers, size);
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

/// A claim the store decided: its attempt, and whether the store gave it
/// the key (`owned`) or told it the key is not its own (a `409`, a
/// replay, a `422`, a `429` of the store's).
fn claim_decided(path: &str, frame: &[u8], status: u16, answer: &[u8]) -> Option<(String, bool)> {
    if path != CLAIM_PATH {
        return None;
    }
    let theirs = match status {
        200 => matches!(
            decode_frame::<ClaimReply>(answer).ok()?.0,
            ClaimReply::Owned { .. }
        ),
        429 if Problem::rate_limited_wait(answer).is_some() => false,
        _ => return None,
    };
    let (req, _) = decode_frame::<ClaimRequest>(frame).ok()?;
    Some((req.attempt?.as_str().to_string(), theirs))
}

/// One call and the store's answer to it: path, frame, status, answer.
type Part<'a> = (String, &'a [u8], u16, &'a [u8]);

/// The calls of a batch and the store's answer to each.
pub(super) fn batch_parts<'a>(request: &'a [u8], status: u16, answer: &'a [u8]) -> Option<Vec<Part<'a>>> {
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

/// The attempt of an abandon the store took (`done`).
fn abandon_done(path: &str, frame: &[u8], status: u16, answer: &[u8]) -> Option<String> {
    if path != ABANDON_PATH || status != 200 || decode_frame::<FenceReply>(answer).ok()?.0 != FenceReply::Done
    {
        return None;
    }
    let (req, _) = decode_frame::<AbandonRequest>(frame).ok()?;
    Some(req.attempt.as_str().to_string())
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
                    key: scope_label(req.scope.tenant(), req.scope.key().as_str()),
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
                    key: scope_label(req.scope.tenant(), req.scope.key().as_str()),
                    fence: req.fence,
                })
            } else {
                let (req, _) = decode_frame::<FenceRequest>(frame).ok()?;
                Some(Confirmed::Released {
                    key: scope_label(req.scope.tenant(), req.scope.key().as_str()),
                    fence: req.fence,
                })
            }
        }
        _ => None,
    }
}
