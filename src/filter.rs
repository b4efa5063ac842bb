//! Envoy's request callbacks, handed to the worker's [`Filter`] of the
//! request (`crates/worker`), whose answers become proxy-wasm actions.

use idemgate_worker::Filter;
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::Action;

use crate::host::Envoy;

pub struct Request {
    filter: Filter<Envoy>,
    /// The request asked for the VM to fail in the response phase.
    #[cfg(feature = "fault-injection")]
    fail_on_response: bool,
}

impl Request {
    pub fn new(filter: Filter<Envoy>) -> Request {
        Request {
            filter,
            #[cfg(feature = "fault-injection")]
            fail_on_response: false,
        }
    }
}

fn action(action: idemgate_worker::Action) -> Action {
    match action {
        idemgate_worker::Action::Continue => Action::Continue,
        idemgate_worker::Action::Pause => Action::Pause,
    }
}

impl Context for Request {
    fn on_http_call_response(&mut self, token: u32, num_headers: usize, body_size: usize, _trailers: usize) {
        self.filter.call_response(token, num_headers, body_size);
    }

    /// A stream Envoy ends without logging it still lets go of its driver.
    fn on_done(&mut self) -> bool {
        self.filter.client_left();
        true
    }
}

impl HttpContext for Request {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        #[cfg(feature = "fault-injection")]
        {
            if crate::fault::asked("request") {
                crate::fault::fail_vm();
            }
            self.fail_on_response = crate::fault::asked("response");
        }
        action(self.filter.request_headers(end_of_stream))
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        action(self.filter.request_body(body_size, end_of_stream))
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        action(self.filter.request_trailers())
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        #[cfg(feature = "fault-injection")]
        if self.fail_on_response {
            crate::fault::fail_vm();
        }
        action(self.filter.response_headers(end_of_stream))
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        action(self.filter.response_body(body_size, end_of_stream))
    }

    fn on_http_response_trailers(&mut self, _num_trailers: usize) -> Action {
        action(self.filter.response_trailers())
    }

    fn on_log(&mut self) {
        self.filter.client_left();
    }
}
