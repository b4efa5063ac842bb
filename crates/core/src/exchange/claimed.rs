//! What the store's answer to a claim means for the request: go on to the
//! upstream, replay, or answer with a problem.

use super::{Exchange, Phase, Step};
use crate::config::{FailureMode, Mode};
use crate::grpc;
use crate::handling::{Handling, Settlement};
use crate::headers::KEY_HEADER;
use crate::problem::Problem;
use crate::protocol::{decode_frame, encode_frame, ClaimReply, ReplayRequest, REPLAY_PATH};
use crate::store_call::StoreAnswer;
use crate::Reply;

impl Exchange {
    pub(super) fn claimed(&mut self, answer: StoreAnswer) -> Step {
        // A store that refused the frame with a problem of its own wrote
        // nothing; any other failure may have lost the answer to a
        // committed claim.
        let refused = self.refusal.is_some();
        // Over the tenant's budget of new keys: the store claimed nothing,
        // so there is nothing to abandon and the key stays unused.
        if let Some(wait_ms) = match &answer {
            Some((429, body)) => Problem::rate_limited_wait(body),
            _ => None,
        } {
            return self.reject(Handling::RateLimited, Problem::key_rate_limited(wait_ms));
        }
        let reply = match answer {
            Some((200, body)) => decode_frame::<ClaimReply>(&body)
                .map(|(meta, bytes)| (meta, bytes.to_vec()))
                .ok(),
            _ => None,
        };
        let Some((reply, body)) = reply else {
            // The store may have committed the claim and lost only its answer:
            // abandon it, so the retry the problem invites is a first request.
            let next = match self.policy.failure_mode() {
                FailureMode::Open => self.pass(Handling::FailOpen),
                FailureMode::Closed => self.reject(Handling::StoreError, Problem::store_unavailable()),
            };
            if refused {
                return next;
            }
            self.settlement = Some(Settlement::Abandoned);
            return match self.abandon_call() {
                Some(call) => Step::Deliver(call, Box::new(next)),
                None => next,
            };
        };
        match reply {
            ClaimReply::Owned { fence } => {
                self.handling = Handling::Owned;
                match self.upstream.take() {
                    Some(call) => {
                        self.phase = Phase::Detached { fence };
                        Step::Forward(call)
                    }
                    None => {
                        self.phase = Phase::Forwarded { fence };
                        Step::Continue
                    }
                }
            }
            ClaimReply::Replay {
                status,
                headers,
                completed_at,
            } => {
                if self.mode == Mode::Observe {
                    return self.pass(Handling::WouldReplay);
                }
                self.handling = Handling::Replayed;
                self.phase = Phase::Answered;
                let mut headers: Vec<(String, String)> = headers
                    .into_iter()
                    .filter(|(name, _)| self.policy.replays_header(name))
                    .collect();
                headers.push(("idempotent-replayed".into(), "true".into()));
                if self.policy.grpc().is_some() {
                    return self.replay_grpc(headers, &body, completed_at);
                }
                headers.extend(self.echo.clone().map(|key| (KEY_HEADER.into(), key)));
                Step::Respond(Reply {
                    status,
                    headers,
                    body,
                })
            }
            // Every other reply is answered with a problem.
            ClaimReply::ResultUnavailable {
                original_status,
                completed_at,
            } => self.reject(
                Handling::Conflict,
                Problem::result_unavailable(original_status, completed_at),
            ),
            ClaimReply::InProgress { retry_after_ms } => {
                let hint = retry_after_ms.min(self.policy.in_progress_retry_after_ms());
                self.reject(Handling::Conflict, Problem::request_in_progress(hint))
            }
            ClaimReply::Mismatch => self.reject(Handling::Mismatch, Problem::key_reused()),
            ClaimReply::Unknown => self.reject(Handling::Unknown, Problem::outcome_unknown()),
            ClaimReply::Expired { completed_at } => {
                self.reject(Handling::Expired, Problem::key_expired(completed_at))
            }
        }
    }

    /// A gRPC response cannot be a local reply (Envoy answers a gRPC call
    /// locally with a status alone): the request goes on to the store's
    /// replay route instead, which sends the stored messages and trailers.
    fn replay_grpc(&mut self, headers: Vec<(String, String)>, stored: &[u8], completed_at: i64) -> Step {
        // Stored before the policy covered gRPC: not a response to replay.
        let Some((messages, trailers)) = grpc::split_trailers(stored) else {
            return self.reject(Handling::Conflict, Problem::result_unavailable(200, completed_at));
        };
        let trailers = trailers
            .into_iter()
            .filter(|(name, _)| self.policy.replays_trailer(name))
            .collect();
        let request = ReplayRequest { headers, trailers };
        Step::Reroute(self.call(REPLAY_PATH, encode_frame(&request, messages), 0))
    }
}
