//! Every call into Envoy goes through here. Host errors become `None`/`false`
//! and a log line, never a panic; untrusted header values stay bytes.

use std::borrow::Cow;
use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

use idemgate_core::config::StoreConfig;
use idemgate_core::exchange::UpstreamCall;
use idemgate_core::protocol::{FRAME_CONTENT_TYPE, PROTOCOL_HEADER, PROTOCOL_OFFER, REPLAY_MARKER};
use idemgate_core::store_call::{StoreAnswer, StoreCall};
use idemgate_core::trace::{Trace, TRACE_HEADER};
use idemgate_core::Reply;
use proxy_wasm::hostcalls;
use proxy_wasm::types::{BufferType, Bytes, LogLevel, MapType, MetricType};

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

/// `message`, named by the request it is about.
fn line(message: &str) -> Cow<'_, str> {
    ABOUT.with(|a| match a.borrow().as_deref() {
        Some(attempt) => Cow::Owned(format!("attempt {attempt}: {message}")),
        None => Cow::Borrowed(message),
    })
}

pub fn log(level: LogLevel, message: &str) {
    let _ = hostcalls::log(level, &line(message));
}

pub fn plugin_configuration() -> Option<Bytes> {
    hostcalls::get_buffer(BufferType::PluginConfiguration, 0, usize::MAX)
        .ok()
        .flatten()
}

/// Sets the root context's timer (zero stops it); `false` if Envoy refused.
pub fn set_tick_period(period: Duration) -> bool {
    let ok = hostcalls::set_tick_period(period).is_ok();
    if !ok {
        log(LogLevel::Warn, "could not set the timer");
    }
    ok
}

/// Tells Envoy that the root context, whose deletion `on_done` deferred, is
/// finished: Envoy deletes it once this call into the filter returns. Only
/// call it after `on_done` returned `false`, and once: otherwise Envoy
/// answers `NotFound`, on which the SDK panics.
pub fn done() -> bool {
    let ok = hostcalls::done().is_ok();
    if !ok {
        log(LogLevel::Warn, "could not tell Envoy the root context is done");
    }
    ok
}

/// 128 random bits, hex: names this worker's claim attempts.
pub fn random_hex() -> Option<String> {
    let mut seed = [0u8; 16];
    getrandom::getrandom(&mut seed).ok()?;
    Some(seed.iter().map(|b| format!("{b:02x}")).collect())
}

/// 64 random bits, for the store client's backoff jitter.
pub fn random_u64() -> u64 {
    let mut seed = [0u8; 8];
    let _ = getrandom::getrandom(&mut seed);
    u64::from_le_bytes(seed)
}

/// Envoy's clock, in milliseconds since the Unix epoch (0 if unreadable).
pub fn now_ms() -> i64 {
    hostcalls::get_current_time()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .and_then(|d| i64::try_from(d.as_millis()).ok())
        .unwrap_or(0)
}

pub fn counter(name: &str) -> Option<u32> {
    hostcalls::define_metric(MetricType::Counter, name).ok()
}

/// Defines the gauge `name` and sets it to `value`.
pub fn set_gauge(name: &str, value: u64) {
    let set =
        hostcalls::define_metric(MetricType::Gauge, name).and_then(|id| hostcalls::record_metric(id, value));
    if set.is_err() {
        log(LogLevel::Warn, &format!("could not set the gauge {name}"));
    }
}

pub fn increment(metric: Option<u32>) {
    if let Some(id) = metric {
        let _ = hostcalls::increment_metric(id, 1);
    }
}

pub fn request_headers() -> Vec<(String, Bytes)> {
    hostcalls::get_map_bytes(MapType::HttpRequestHeaders).unwrap_or_default()
}

pub fn request_header(name: &str) -> Option<Bytes> {
    hostcalls::get_map_value_bytes(MapType::HttpRequestHeaders, name)
        .ok()
        .flatten()
}

/// Removes every line of a request header; an error (Envoy never refuses
/// this in the request-headers callback) is logged.
pub fn remove_request_header(name: &str) {
    if hostcalls::remove_map_value(MapType::HttpRequestHeaders, name).is_err() {
        log(
            LogLevel::Error,
            &format!("could not remove request header {name}"),
        );
    }
}

pub fn response_headers() -> Vec<(String, Bytes)> {
    hostcalls::get_map_bytes(MapType::HttpResponseHeaders).unwrap_or_default()
}

pub fn response_trailers() -> Vec<(String, Bytes)> {
    hostcalls::get_map_bytes(MapType::HttpResponseTrailers).unwrap_or_default()
}

pub fn remove_response_trailer(name: &str) {
    let _ = hostcalls::remove_map_value(MapType::HttpResponseTrailers, name);
}

pub fn remove_response_header(name: &str) {
    let _ = hostcalls::remove_map_value(MapType::HttpResponseHeaders, name);
}

/// Replaces every line of a response header with one value.
pub fn set_response_header(name: &str, value: &str) {
    if hostcalls::set_map_value(MapType::HttpResponseHeaders, name, Some(value)).is_err() {
        log(LogLevel::Warn, &format!("could not set response header {name}"));
    }
}

pub fn property(path: &[&str]) -> Option<Bytes> {
    hostcalls::get_property(path.to_vec()).ok().flatten()
}

pub fn request_body(start: usize, size: usize) -> Bytes {
    read_buffer(BufferType::HttpRequestBody, start, size)
}

pub fn response_body(start: usize, size: usize) -> Bytes {
    read_buffer(BufferType::HttpResponseBody, start, size)
}

fn read_buffer(buffer: BufferType, start: usize, size: usize) -> Bytes {
    if size == 0 {
        return Vec::new();
    }
    hostcalls::get_buffer(buffer, start, size)
        .ok()
        .flatten()
        .unwrap_or_default()
}

/// Sets the current request's filter state `wasm.<name>`, which access logs
/// read as `%FILTER_STATE(wasm.<name>:PLAIN)%`.
pub fn set_filter_state(name: &str, value: &str) {
    if hostcalls::set_property(vec![name], Some(value.as_bytes())).is_err() {
        log(LogLevel::Warn, &format!("could not set filter state {name}"));
    }
}

/// Makes the request of HTTP context `id` the one later calls act on: an
/// answer for one request may arrive in another's callback.
pub fn set_effective_context(id: u32) {
    if hostcalls::set_effective_context(id).is_err() {
        log(LogLevel::Warn, "could not switch to a request's context");
    }
}

pub fn resume_request() {
    if hostcalls::resume_http_request().is_err() {
        log(LogLevel::Warn, "could not resume the request");
    }
}

pub fn resume_response() {
    if hostcalls::resume_http_response().is_err() {
        log(LogLevel::Warn, "could not resume the response");
    }
}

pub fn send_reply(reply: &Reply) {
    let headers: Vec<(&str, &str)> = reply
        .headers
        .iter()
        .map(|(n, v)| (n.as_str(), v.as_str()))
        .collect();
    if hostcalls::send_http_response(u32::from(reply.status), headers, Some(&reply.body)).is_err() {
        log(
            LogLevel::Error,
            "could not send a local reply; resetting the stream",
        );
        let _ = hostcalls::reset_http_request();
    }
}

/// Turns the held request (`held` body bytes) into `call`, on the route
/// that matches its path: its path and body become the call's, and every
/// header of the client's is dropped but the pseudo-headers (its authority
/// picks the virtual host that holds the route), the gRPC ones, the
/// request id, and `x-forwarded-proto`, without which Envoy finds no
/// route. If Envoy refuses, the stream is reset: the request must never
/// go on to the upstream as it was.
pub fn reroute(call: &StoreCall, held: usize) {
    const KEPT: [&str; 4] = ["content-type", "te", "x-request-id", "x-forwarded-proto"];
    let mut done = set_request_header(":path", call.path);
    for (name, _) in request_headers() {
        if !name.starts_with(':') && !KEPT.contains(&name.as_str()) {
            done &= hostcalls::remove_map_value(MapType::HttpRequestHeaders, &name).is_ok();
        }
    }
    // The replay route admits only requests that carry the marker.
    done &= set_request_header(REPLAY_MARKER, "1");
    done = done
        && hostcalls::set_buffer(BufferType::HttpRequestBody, 0, held, &call.body).is_ok()
        && clear_route_cache();
    if !done {
        log(
            LogLevel::Error,
            "could not reroute a replay to the store; resetting the stream",
        );
        let _ = hostcalls::reset_http_request();
    }
}

/// Envoy no longer picks the route again when a filter changes headers
/// (envoyproxy/envoy#36671): its `clear_route_cache` function asks it to.
fn clear_route_cache() -> bool {
    hostcalls::call_foreign_function("clear_route_cache", None).is_ok()
}

/// Removes the replay route's marker from a client's request, and has
/// Envoy pick that request's route again without it: only the filter's own
/// reroutes reach the store's replay route.
pub fn remove_forged_replay_marker() {
    if request_header(REPLAY_MARKER).is_none() {
        return;
    }
    remove_request_header(REPLAY_MARKER);
    if !clear_route_cache() {
        log(
            LogLevel::Error,
            "a client's request carried the replay marker and its route could not be picked again; resetting the stream",
        );
        let _ = hostcalls::reset_http_request();
    }
}

fn set_request_header(name: &str, value: &str) -> bool {
    hostcalls::set_map_value(MapType::HttpRequestHeaders, name, Some(value)).is_ok()
}

/// Dispatches a store call; `None` when Envoy refuses it (unknown cluster, no
/// healthy host), which the caller treats as an unreachable store.
pub fn dispatch(store: &StoreConfig, call: &StoreCall) -> Option<u32> {
    let trace = Trace::header(&call.traces);
    let mut headers = vec![
        (":method", "POST"),
        (":path", call.path),
        (":authority", store.authority()),
        ("authorization", store.authorization()),
        ("content-type", FRAME_CONTENT_TYPE),
        (PROTOCOL_HEADER, PROTOCOL_OFFER),
    ];
    headers.extend(trace.as_deref().map(|t| (TRACE_HEADER, t)));
    let timeout = Duration::from_millis(call.timeout_ms.max(1));
    match hostcalls::dispatch_http_call(store.cluster(), headers, Some(&call.body), vec![], timeout) {
        Ok(token) => Some(token),
        Err(status) => {
            log(
                LogLevel::Warn,
                &format!("store call to cluster {} refused: {status:?}", store.cluster()),
            );
            None
        }
    }
}

/// Dispatches the filter's own upstream request (detached forwarding);
/// `None` when Envoy refuses it (no healthy host, unknown cluster).
pub fn dispatch_upstream(call: &UpstreamCall, body: &[u8]) -> Option<u32> {
    let headers: Vec<(&str, &str)> = call
        .headers
        .iter()
        .map(|(n, v)| (n.as_str(), v.as_str()))
        .collect();
    let timeout = Duration::from_millis(call.timeout_ms.max(1));
    match hostcalls::dispatch_http_call(&call.cluster, headers, Some(body), vec![], timeout) {
        Ok(token) => Some(token),
        Err(status) => {
            log(
                LogLevel::Warn,
                &format!("upstream call to cluster {} refused: {status:?}", call.cluster),
            );
            None
        }
    }
}

/// A callout's response headers inside `on_http_call_response`; `None` when
/// it has none (reset, failure): asking for them then would fail.
pub fn call_response_headers(num_headers: usize) -> Option<Vec<(String, Bytes)>> {
    if num_headers == 0 {
        return None;
    }
    hostcalls::get_map_bytes(MapType::HttpCallResponseHeaders).ok()
}

pub fn call_response_body(size: usize) -> Bytes {
    read_buffer(BufferType::HttpCallResponseBody, 0, size)
}

/// Reads the store's reply inside `on_http_call_response`. No headers means
/// the call was reset or timed out; asking for a header then would panic.
pub fn store_answer(num_headers: usize, body_size: usize) -> StoreAnswer {
    if num_headers == 0 {
        return None;
    }
    let status = hostcalls::get_map_value_bytes(MapType::HttpCallResponseHeaders, ":status")
        .ok()
        .flatten()?;
    let status = std::str::from_utf8(&status).ok()?.parse::<u16>().ok()?;
    Some((status, call_response_body(body_size)))
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
