//! Capturing an owned request's response on its way to the client, and the
//! call that records it.

use super::{Exchange, Phase, ResponseHead, Step};
use crate::config::{Forwarding, ENVOY_DEFAULT_BUFFER_LIMIT};
use crate::grpc;
use crate::handling::Settlement;
use crate::headers::{self, Control};
use crate::limits;
use crate::origin::Origin;
use crate::protocol::{start_frame, CompleteRequestRef, COMPLETE_PATH};

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
        let grpc = self.policy.grpc().is_some();
        match control {
            Some(Control::NoStore) => return self.settle(fence, Settlement::Released),
            Some(Control::Uncertain) => return self.settle(fence, Settlement::MarkedUnknown),
            Some(Control::Store) => {}
            None if !grpc && self.policy.releases_on(head.status) => {
                return self.settle(fence, Settlement::Released)
            }
            None => {}
        }
        // A gRPC response with a status already in its headers (trailers-only)
        // is over; otherwise its status comes in the trailers.
        let trailers_only = grpc && head.end_of_stream;
        if trailers_only {
            if let Some(settles) = self.grpc_settles(control, &head.headers) {
                return self.settle(fence, settles);
            }
        }
        let trailers = if trailers_only {
            self.kept_trailers(&head.headers)
        } else {
            Vec::new()
        };
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
        let keepable = limits::response_fits(head.status, &headers).is_ok();
        let headers = if keepable { headers } else { Vec::new() };
        let max = self.policy.max_stored_body();
        let too_large = head.content_length.is_some_and(|n| n > max as u64);
        // A body that may be kept goes straight into the complete call's
        // frame, behind its metadata; there is room for what it announced.
        let frame = if trailers_only || (keepable && !too_large) {
            let room = head.content_length.map_or(0, |n| n.min(max as u64) as usize);
            match self.complete_frame(fence, head.status, &headers, true, room) {
                Some(frame) => frame,
                None => return Step::Continue,
            }
        } else {
            Vec::new()
        };
        self.phase = Phase::Capturing {
            fence,
            status: head.status,
            headers,
            body_at: frame.len(),
            frame,
            announced: head.content_length,
            control,
        };
        if trailers_only {
            return self.complete_grpc(trailers);
        }
        if !keepable || too_large {
            return self.complete(false);
        }
        if head.end_of_stream {
            return self.complete(true);
        }
        Step::Pause
    }

    /// A chunk of an owned response's body.
    pub fn response_body(&mut self, chunk: &[u8], end_of_stream: bool) -> Step {
        let (frame, body_at) = match &mut self.phase {
            Phase::Capturing { frame, body_at, .. } => (frame, *body_at),
            // A call about this response is in flight: hold the rest until the
            // store has recorded it, so no client can retry before that.
            Phase::Settling { .. } => return Step::Pause,
            _ => return Step::Continue,
        };
        // Too large to keep: record the outcome without the body, and let
        // the response stream on.
        if frame.len() - body_at + chunk.len() > self.policy.max_stored_body() {
            return self.complete(false);
        }
        frame.extend_from_slice(chunk);
        match end_of_stream {
            false => Step::Pause,
            // A gRPC response that ends without trailers has no status.
            true if self.policy.grpc().is_some() => self.response_trailers(&[]),
            true => self.complete(true),
        }
    }

    /// An owned response's trailers. A gRPC response is decided by its
    /// status here; any other response's trailers just end it.
    pub fn response_trailers(&mut self, trailers: &[(String, Vec<u8>)]) -> Step {
        let (Some(_), Phase::Capturing { fence, control, .. }) = (self.policy.grpc(), &self.phase) else {
            return self.response_body(&[], true);
        };
        let (fence, control) = (*fence, Control::safest(*control, headers::control(trailers)));
        if let Some(settles) = self.grpc_settles(control, trailers) {
            return self.settle(fence, settles);
        }
        let kept = self.kept_trailers(trailers);
        self.complete_grpc(kept)
    }

    /// What a gRPC response's status (in `fields`) and `Idempotency-Control`
    /// do to the record; `None`: store it. A response without a status is
    /// broken off: nobody knows whether the server acted.
    fn grpc_settles(&self, control: Option<Control>, fields: &[(String, Vec<u8>)]) -> Option<Settlement> {
        let policy = self.policy.grpc()?;
        match control {
            Some(Control::Store) => None,
            Some(Control::NoStore) => Some(Settlement::Released),
            Some(Control::Uncertain) => Some(Settlement::MarkedUnknown),
            None => match grpc::status(fields) {
                Some(code) => policy.settles(code),
                None => Some(Settlement::MarkedUnknown),
            },
        }
    }

    /// The trailers a replay sends back.
    fn kept_trailers(&self, fields: &[(String, Vec<u8>)]) -> Vec<(String, String)> {
        fields
            .iter()
            .filter(|(name, _)| self.policy.replays_trailer(name))
            .filter_map(|(name, value)| {
                let value = String::from_utf8(value.clone()).ok()?;
                Some((name.to_ascii_lowercase(), value))
            })
            .collect()
    }

    /// Stores a gRPC response: its messages, then its trailers as
    /// gRPC-Web's trailer frame.
    fn complete_grpc(&mut self, trailers: Vec<(String, String)>) -> Step {
        let Phase::Capturing { frame, body_at, .. } = &mut self.phase else {
            return Step::Continue;
        };
        grpc::append_trailers(frame, &trailers);
        if frame.len() - *body_at > self.policy.max_stored_body() {
            return self.complete(false);
        }
        self.complete(true)
    }

    fn complete(&mut self, body_stored: bool) -> Step {
        let Phase::Capturing {
            fence,
            status,
            headers,
            frame,
            announced,
            ..
        } = std::mem::replace(&mut self.phase, Phase::Done)
        else {
            return Step::Continue;
        };
        let frame = match body_stored {
            true => frame,
            false => match self.complete_frame(fence, status, &headers, false, 0) {
                Some(frame) => frame,
                None => return Step::Continue,
            },
        };
        let call = self.call(COMPLETE_PATH, frame, 0);
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

    /// The complete call's frame up to its body, with room for `room` bytes
    /// of it.
    fn complete_frame(
        &self,
        fence: u64,
        status: u16,
        headers: &[(String, String)],
        body_stored: bool,
        room: usize,
    ) -> Option<Vec<u8>> {
        let request = CompleteRequestRef {
            scope: self.scope_ref()?,
            fence,
            status,
            headers,
            body_stored,
        };
        Some(start_frame(&request, room))
    }
}
