//! What the exchange asks of the filter, and what the upstream answers the
//! filter's own request.

use crate::client::Letter;
use crate::store_call::StoreCall;
use crate::Reply;

/// What the filter must do next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Let the stream go on (resume it if it was held).
    Continue,
    /// Hold the stream: more input is needed.
    Pause,
    /// Send this to the store and hold the stream until its reply arrives.
    Call(StoreCall),
    /// Answer the client locally; the exchange is over.
    Respond(Reply),
    /// Send the filter's own request to the upstream (detached forwarding),
    /// with the request body Envoy buffered, and hold the stream until its
    /// answer arrives.
    Forward(UpstreamCall),
    /// Send the request on to the store's replay route instead of the
    /// upstream: its headers become the store call's (path, authority,
    /// content type, nothing of the client's), its body the call's body.
    Reroute(StoreCall),
    /// Hand this call to the worker's store client, which sends it whether or
    /// not the request is still there and retries it until the store answers;
    /// then carry out the next step.
    Deliver(StoreCall, Box<Step>),
}

/// What becomes of an exchange whose client has left.
#[derive(Debug, PartialEq, Eq)]
pub enum Left {
    /// Its upstream request or its outcome's store call is in flight.
    GoesOn,
    /// It is over; the letter, if any, settles what it left open.
    Ended(Option<Letter>),
}

/// The filter's own request to the upstream: the request's headers as the
/// filter received them (minus hop-by-hop ones), to the route's cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpstreamCall {
    pub cluster: String,
    pub headers: Vec<(String, String)>,
    pub timeout_ms: u64,
}

/// What came back for an [`UpstreamCall`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UpstreamAnswer {
    /// Envoy refused to send it (no healthy host): nothing was executed.
    Refused,
    /// The call was reset after its response started, or the response
    /// outgrew Envoy's buffer: the upstream may have acted.
    Lost,
    /// A response, from the upstream or from Envoy on its behalf; the body
    /// is read only when the exchange asks for it.
    Response {
        headers: Vec<(String, Vec<u8>)>,
        body_size: usize,
    },
}
