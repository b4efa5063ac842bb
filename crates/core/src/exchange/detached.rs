//! Detached forwarding: the filter's own upstream request, and what the
//! client is told once the store has recorded its answer.

use super::{Exchange, Phase, ResponseHead, Step, UpstreamAnswer};
use crate::config::Forwarding;
use crate::handling::Settlement;
use crate::headers;
use crate::origin;
use crate::problem::{envoy_reply, Problem};
use crate::Reply;

impl Exchange {
    /// The answer to the filter's own upstream request (after
    /// [`Step::Forward`]). It is recorded by the same rules as a response
    /// through the router, then relayed to the client as it came (or as a
    /// problem when it is larger than the route relays) once the store has
    /// settled the record. `read_body` is called at most once, and not for
    /// an upstream's body over `max_response_body`.
    pub fn upstream_reply(&mut self, answer: UpstreamAnswer, read_body: impl FnOnce() -> Vec<u8>) -> Step {
        let Phase::Detached { fence } = self.phase else {
            return Step::Continue;
        };
        self.phase = Phase::Forwarded { fence };
        let max = match self.policy.forwarding() {
            Forwarding::Detached(detached) => detached.max_response_body(),
            Forwarding::Streaming => 0,
        };
        let step = match answer {
            UpstreamAnswer::Refused => {
                // Envoy refuses a callout for more than an unhealthy cluster
                // (an unknown one, a full pending queue): say only what is sure.
                self.relay = Some(self.with_key(envoy_reply(
                    503,
                    "upstream unavailable",
                    "the request could not be sent to the upstream; nothing was executed, retry with the same key",
                )));
                self.settle(fence, Settlement::Released)
            }
            UpstreamAnswer::Lost => {
                self.relay = Some(self.problem(Problem::outcome_unknown()));
                self.settle(fence, Settlement::MarkedUnknown)
            }
            UpstreamAnswer::Response { headers, body_size } => {
                let status = headers::status(&headers);
                let relayed = headers::relayed(&headers);
                let marked = headers::only(&headers, origin::UPSTREAM_MARK).is_some();
                // Envoy's own replies are a line of text, read whatever the limit.
                let body = (body_size <= max || !marked).then(read_body);
                let head = ResponseHead {
                    status,
                    origin: origin::of_callout(marked, body.as_deref().unwrap_or_default()),
                    headers: headers.into_iter().filter(|(n, _)| !n.starts_with(':')).collect(),
                    content_length: Some(body_size as u64),
                    end_of_stream: body_size == 0,
                };
                let step = match self.response_headers(head) {
                    Step::Pause => self.response_body(body.as_deref().unwrap_or_default(), true),
                    step => step,
                };
                let released = self.settling_as() == Some(Settlement::Released);
                self.relay = Some(match body {
                    // Envoy's own reply (no healthy host, timeout, reset),
                    // in the form its local replies take on the router's path.
                    Some(body) if !marked => {
                        let text = String::from_utf8_lossy(&body);
                        let title: String = text.trim().chars().take(200).collect();
                        self.with_key(envoy_reply(status, &title, &title))
                    }
                    Some(body) => Reply {
                        status,
                        headers: relayed,
                        body,
                    },
                    None if released => self.with_key(envoy_reply(
                        status,
                        "response too large to relay",
                        &format!("the upstream answered {status} without acting on the request, and its response was larger than the {max} bytes this route relays; nothing was stored, retry with the same key"),
                    )),
                    None => self.problem(Problem::response_too_large(status, max)),
                });
                step
            }
        };
        let relay = |ex: &mut Exchange| ex.relay.take().map_or(Step::Continue, Step::Respond);
        match step {
            call @ Step::Call(_) => call,
            // settle: background
            Step::Deliver(call, _) => Step::Deliver(call, Box::new(relay(self))),
            _ => relay(self),
        }
    }
}
