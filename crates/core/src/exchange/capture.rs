//! Capturing an owned request's response on its way to the client, and the
//! call that records it.

use super::{Exchange, Phase, ResponseHead, Step};
use crate::config::{Forwarding, ENVOY_DEFAULT_BUFFER_LIMIT};
use crate::exchange::{Origin, Settlement};
use crate::headers::{self, Control};
use crate::limits;
use crate::protocol::{encode_frame, CompleteRequest, COMPLETE_PATH};

impl Exchange {
    /// The response headers. Only an owned request's response is captured.
    pub fn response_headers(&mut self, head: ResponseHead) -> Step {
        let Phase::Forwarded { fence } = self.phase else {
            return Step::Continue;
        };
        match head.origin {
            Origin::NeverReached => return self.settle(fence, Settlement::Released),
            Origin::LostAfterForwarding => return self.settle(fence, Settlement::MarkedUnknown),
            Origin::Upstream => {}
        }
        let control = headers::control(&head.headers);
        match control {
            Some(Control::NoStore) => return self.settle(fence, Settlement::Released),
            Some(Control::Uncertain) => return self.settle(fence, Settlement::MarkedUnknown),
            Some(Control::Store) => {}
            None if self.policy.releases_on(head.status) => return self.settle(fence, Settlement::Released),
            None => {}
        }
        let headers: Vec<(String, String)> = head
            .headers
            .into_iter()
            .filter(|(name, _)| self.policy.replays_header(name))
            .filter_map(|(name, value)| {
                String::from_utf8(value)
                    .ok()
                    .map(|v| (name.to_ascii_lowercase(), v))
            })
            .collect();
        // Headers the store would refuse: keep the outcome, not the response
        // (a retry gets result-unavailable rather than a partial replay).
        let keepable =
            headers.len() <= limits::MAX_HEADERS && headers.iter().all(|(n, v)| limits::header_fits(n, v));
        self.phase = Phase::Capturing {
            fence,
            status: head.status,
            headers: if keepable { headers } else { Vec::new() },
            body: Vec::new(),
            announced: head.content_length,
        };
        if !keepable
            || head
                .content_length
                .is_some_and(|n| n > self.policy.max_stored_body() as u64)
        {
            return self.complete(false);
        }
        if head.end_of_stream {
            return self.complete(true);
        }
        Step::Pause
    }

    /// A chunk of an owned response's body.
    pub fn response_body(&mut self, chunk: &[u8], end_of_stream: bool) -> Step {
        let kept = match &mut self.phase {
            Phase::Capturing { body, .. } => body,
            // A call about this response is in flight: hold the rest until the
            // store has recorded it, so no client can retry before that.
            Phase::Settling { .. } => return Step::Pause,
            _ => return Step::Continue,
        };
        // Too large to keep: record the outcome without the body, and let
        // the response stream on.
        if kept.len() + chunk.len() > self.policy.max_stored_body() {
            return self.complete(false);
        }
        kept.extend_from_slice(chunk);
        if end_of_stream {
            self.complete(true)
        } else {
            Step::Pause
        }
    }

    fn complete(&mut self, body_stored: bool) -> Step {
        let Phase::Capturing {
            fence,
            status,
            headers,
            body,
            announced,
        } = std::mem::replace(&mut self.phase, Phase::Done)
        else {
            return Step::Continue;
        };
        let Some(scope) = self.scope.clone() else {
            return Step::Continue;
        };
        let request = CompleteRequest {
            scope,
            fence,
            status,
            headers,
            body_stored,
        };
        let kept: &[u8] = if body_stored { &body } else { &[] };
        let call = self.call(COMPLETE_PATH, encode_frame(&request, kept), 0);
        let fits_envoys_buffer = announced.is_some_and(|n| n <= ENVOY_DEFAULT_BUFFER_LIMIT as u64);
        if !body_stored && !fits_envoys_buffer && self.policy.forwarding() == &Forwarding::Streaming {
            // A streamed body too large to keep, and maybe too large for
            // Envoy's buffer, is not held while the outcome is recorded:
            // past its buffer limit Envoy would answer the client 500 for a
            // request the upstream carried out. The worker's store client
            // delivers the outcome; a retry in the meantime is told the
            // request is in progress.
            self.settlement = Some(Settlement::Completed);
            self.phase = Phase::Done;
            return Step::Deliver(call, Box::new(Step::Continue));
        }
        self.settling(call, Settlement::Completed)
    }
}
