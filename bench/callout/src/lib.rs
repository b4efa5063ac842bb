//! A trivial proxy-wasm filter for the callout microbenchmark of `make bench`:
//! on request headers it makes `calls` sequential `dispatch_http_call`s (a
//! `GET` of `path` on `cluster`), then resumes the request. Nothing else: no
//! header map copies, no body buffering, no store protocol, so Envoy's CPU
//! per request at 0, 1 and 2 calls differs by the callouts alone.
//!
//! With `"new_key": true` it makes its calls where idemgate makes a new
//! key's two, and nothing of idemgate's work around them: one `POST` of the
//! request's body once the body is whole (the request waits for its answer),
//! one `POST` of the response's body once that is whole (the response waits).
//! Its Envoy CPU less that of no calls is what the shape of a new key costs
//! Envoy (two paused streams, both bodies buffered and copied into the VM
//! and out in a call, two callouts after the gaps between them); idemgate's
//! less this one is the filter's own work.
//!
//! Plugin configuration (JSON): `{"calls": 2, "cluster": "callout_sink",
//! "path": "/", "authority": "sink", "timeout_ms": 2000, "new_key": false}`;
//! every field but `calls` has that default.

use std::rc::Rc;
use std::time::Duration;

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel};
use serde::Deserialize;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    pub calls: u32,
    #[serde(default = "default_cluster")]
    pub cluster: String,
    #[serde(default = "default_path")]
    pub path: String,
    #[serde(default = "default_authority")]
    pub authority: String,
    #[serde(default = "default_timeout_ms")]
    pub timeout_ms: u64,
    /// The calls of a new key (see the crate's doc); `calls` is then 2.
    #[serde(default)]
    pub new_key: bool,
}

fn default_cluster() -> String {
    "callout_sink".into()
}
fn default_path() -> String {
    "/".into()
}
fn default_authority() -> String {
    "sink".into()
}
fn default_timeout_ms() -> u64 {
    2000
}

impl Settings {
    /// The plugin configuration; an empty one means no calls.
    pub fn parse(bytes: &[u8]) -> Result<Settings, String> {
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return serde_json::from_str(r#"{"calls": 0}"#).map_err(|e| e.to_string());
        }
        serde_json::from_slice(bytes).map_err(|e| format!("callout bench configuration: {e}"))
    }
}

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Warn);
    proxy_wasm::set_root_context(|_| Box::new(Root { settings: None }));
}}

struct Root {
    settings: Option<Rc<Settings>>,
}

impl Context for Root {}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        let bytes = self.get_plugin_configuration().unwrap_or_default();
        match Settings::parse(&bytes) {
            Ok(s) => {
                self.settings = Some(Rc::new(s));
                true
            }
            Err(e) => {
                proxy_wasm::hostcalls::log(LogLevel::Error, &e).ok();
                false
            }
        }
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Request {
            settings: self.settings.clone(),
            left: self.settings.as_ref().map_or(0, |s| s.calls),
            waiting: false,
            holds_response: false,
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct Request {
    settings: Option<Rc<Settings>>,
    /// Calls still to make.
    left: u32,
    /// A call is in flight: the request (body included) waits.
    waiting: bool,
    /// The call in flight holds the response (`new_key`'s second).
    holds_response: bool,
}

impl Request {
    fn new_key(&self) -> bool {
        self.settings.as_ref().is_some_and(|s| s.new_key)
    }

    /// A new key's call: the body is held until whole, then copied into the
    /// VM (`read`) and sent; its stream waits for the answer.
    fn call_when_whole(&mut self, size: usize, end_of_stream: bool, response: bool, read: Read) -> Action {
        if !end_of_stream {
            return Action::Pause;
        }
        self.holds_response = response;
        let body = read(self, 0, size).unwrap_or_default();
        paused(self.next_call(Some(&body)))
    }

    /// Dispatches the next call if one is left (a `POST` of `body` if
    /// given): `true` when one is in flight.
    fn next_call(&mut self, body: Option<&[u8]>) -> bool {
        let Some(s) = self.settings.clone() else {
            return false;
        };
        if self.left == 0 {
            return false;
        }
        self.left -= 1;
        let headers = vec![
            (":method", if body.is_some() { "POST" } else { "GET" }),
            (":path", s.path.as_str()),
            (":authority", s.authority.as_str()),
        ];
        let timeout = Duration::from_millis(s.timeout_ms.max(1));
        match self.dispatch_http_call(&s.cluster, headers, body, vec![], timeout) {
            Ok(_) => {
                self.waiting = true;
                true
            }
            Err(e) => {
                proxy_wasm::hostcalls::log(LogLevel::Warn, &format!("callout refused: {e:?}")).ok();
                false
            }
        }
    }
}

/// How a held body is read out of Envoy: `(start, size)`.
type Read = fn(&Request, usize, usize) -> Option<Vec<u8>>;

fn paused(wait: bool) -> Action {
    if wait {
        Action::Pause
    } else {
        Action::Continue
    }
}

impl Context for Request {
    fn on_http_call_response(&mut self, _token: u32, _headers: usize, _body: usize, _trailers: usize) {
        self.waiting = false;
        if self.holds_response {
            self.resume_http_response();
        } else if self.new_key() || !self.next_call(None) {
            self.resume_http_request();
        }
    }
}

impl HttpContext for Request {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        if self.new_key() {
            return paused(!end_of_stream);
        }
        paused(self.next_call(None))
    }

    /// Headers stop iteration (`allow_on_headers_stop_iteration`, as for
    /// idemgate), so the body is held here until the calls are done.
    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if self.new_key() {
            return self.call_when_whole(body_size, end_of_stream, false, Self::get_http_request_body);
        }
        paused(self.waiting)
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        paused(self.new_key() && !end_of_stream)
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if self.new_key() {
            return self.call_when_whole(body_size, end_of_stream, true, Self::get_http_response_body);
        }
        Action::Continue
    }
}

#[cfg(test)]
mod tests {
    use super::Settings;

    #[test]
    fn configuration() {
        let s = Settings::parse(br#"{"calls": 2}"#).unwrap_or_else(|e| unreachable!("{e}"));
        assert_eq!(
            (s.calls, s.cluster.as_str(), s.path.as_str()),
            (2, "callout_sink", "/")
        );
        assert_eq!(
            Settings::parse(b" ").map(|s| (s.calls, s.new_key)),
            Ok((0, false))
        );
        let k = Settings::parse(br#"{"calls": 2, "new_key": true}"#).map(|s| s.new_key);
        assert_eq!(k, Ok(true));
        assert!(Settings::parse(br#"{"calls": 1, "clusetr": "x"}"#).is_err());
    }
}
