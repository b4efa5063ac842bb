//! What the worker asks of its host: Envoy's host calls for the filter
//! (`src/host.rs`), the simulated Envoy's for the simulation. Every method
//! answers; a host error becomes `None`, `false` or nothing, and the host
//! logs it.

use std::borrow::Cow;
use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

use idemgate_core::client::Owner;
use idemgate_core::config::StoreConfig;
use idemgate_core::exchange::UpstreamCall;
use idemgate_core::store_call::{StoreAnswer, StoreCall};
use idemgate_core::Reply;

pub type Bytes = Vec<u8>;

/// What a request callback tells the host: go on, or hold the stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    Continue,
    Pause,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Level {
    Info,
    Warn,
    Error,
}

/// The calls the worker makes. "The request" is the one whose callback is
/// running, or the one [`Host::set_effective_context`] last named.
pub trait Host: Clone {
    /// The host's clock, in milliseconds since the Unix epoch...
    fn now_ms(&self) -> i64;
    /// ...and in microseconds.
    fn now_us(&self) -> i64;
    fn random_u64(&self) -> u64;
    fn log(&self, level: Level, message: &str);

    /// Defines a counter; `None` if the host refused.
    fn counter(&self, name: &str) -> Option<u32>;
    fn increment(&self, counter: Option<u32>);
    /// Defines a histogram; `None` if the host refused.
    fn histogram(&self, name: &str) -> Option<u32>;
    /// Records one value of a histogram.
    fn record(&self, histogram: Option<u32>, value: u64);
    /// Defines the gauge `name` and sets it to `value`.
    fn set_gauge(&self, name: &str, value: u64);

    fn request_header(&self, name: &str) -> Option<Bytes>;
    fn request_headers(&self) -> Vec<(String, Bytes)>;
    fn remove_request_header(&self, name: &str);
    /// Removes the replay route's marker from a client's request, and has
    /// the host pick its route again without it.
    fn remove_forged_replay_marker(&self);
    fn property(&self, path: &[&str]) -> Option<Bytes>;
    fn request_body(&self, start: usize, size: usize) -> Bytes;
    fn response_headers(&self) -> Vec<(String, Bytes)>;
    fn response_trailers(&self) -> Vec<(String, Bytes)>;
    fn remove_response_header(&self, name: &str);
    fn remove_response_trailer(&self, name: &str);
    /// Replaces every line of a response header with one value.
    fn set_response_header(&self, name: &str, value: &str);
    fn response_body(&self, start: usize, size: usize) -> Bytes;
    /// Sets the request's filter state `wasm.<name>` (for access logs).
    fn set_filter_state(&self, name: &str, value: &str);

    /// Answers the request itself (a reply the host cannot send resets it).
    fn send_reply(&self, reply: &Reply);
    /// Turns the held request (`held` body bytes) into `call`, on the
    /// route of its path (a reroute the host refuses resets the stream).
    fn reroute(&self, call: &StoreCall, held: usize);
    /// Makes `owner`'s request the one later calls act on: an answer for
    /// one request may arrive in another's callback.
    fn set_effective_context(&self, owner: Owner);
    fn resume_request(&self);
    fn resume_response(&self);

    /// Dispatches a store call; `None` when the host refuses it.
    fn dispatch(&self, store: &StoreConfig, call: &StoreCall) -> Option<u32>;
    /// Dispatches the filter's own upstream request (detached forwarding).
    fn dispatch_upstream(&self, call: &UpstreamCall, body: &[u8]) -> Option<u32>;
    /// The headers of the callout being answered; `None` when it has none
    /// (reset, timeout).
    fn call_response_headers(&self, num_headers: usize) -> Option<Vec<(String, Bytes)>>;
    fn call_response_body(&self, size: usize) -> Bytes;
    /// The store's answer to the callout being answered: its status and
    /// body, `None` when it has none.
    fn store_answer(&self, num_headers: usize, body_size: usize) -> StoreAnswer;
    /// Sets the timer that wakes the worker (zero stops it); `false` if
    /// the host refused.
    fn set_tick_period(&self, period: Duration) -> bool;
}

thread_local! {
    /// The claim attempt of the request being handled, if any: the id the
    /// access log, the store's event lines and the record's history carry.
    static ABOUT: RefCell<Option<Rc<str>>> = const { RefCell::new(None) };
}

/// While it lives, log lines are about the request of `attempt` (shared,
/// so that naming the request on every callback allocates nothing).
pub struct About(Option<Rc<str>>);

pub fn about(attempt: &Rc<str>) -> About {
    About(ABOUT.with(|a| a.replace(Some(Rc::clone(attempt)))))
}

impl Drop for About {
    fn drop(&mut self) {
        ABOUT.with(|a| *a.borrow_mut() = self.0.take());
    }
}

/// `message`, named by the request it is about: what a host logs.
pub fn line(message: &str) -> Cow<'_, str> {
    ABOUT.with(|a| match a.borrow().as_deref() {
        Some(attempt) => Cow::Owned(format!("attempt {attempt}: {message}")),
        None => Cow::Borrowed(message),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_name_the_request_they_are_about_while_it_is_handled() {
        assert_eq!(line("x"), "x");
        {
            let _outer = about(&Rc::from("a-1"));
            assert_eq!(line("x"), "attempt a-1: x");
            {
                let _inner = about(&Rc::from("b-2"));
                assert_eq!(line("x"), "attempt b-2: x");
            }
            assert_eq!(line("x"), "attempt a-1: x");
        }
        assert_eq!(line("x"), "x");
    }
}
