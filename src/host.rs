//! Every call into Envoy goes through here. Host errors become `None`/`false`
//! and a log line, never a panic; untrusted header values stay bytes.

use std::time::Duration;

use idemgate_core::config::StoreConfig;
use idemgate_core::exchange::UpstreamCall;
use idemgate_core::protocol::{FRAME_CONTENT_TYPE, PROTOCOL_HEADER, PROTOCOL_OFFER, REPLAY_MARKER};
use idemgate_core::store_call::{StoreAnswer, StoreCall};
use idemgate_core::trace::{Trace, TRACE_HEADER};
use idemgate_core::Reply;
use idemgate_worker::host::{line, Bytes, Host, Level};
use proxy_wasm::hostcalls;
use proxy_wasm::types::{BufferType, LogLevel, MapType, MetricType};

pub fn log(level: LogLevel, message: &str) {
    let _ = hostcalls::log(level, &line(message));
}

pub fn plugin_configuration() -> Option<Bytes> {
    hostcalls::get_buffer(BufferType::PluginConfiguration, 0, usize::MAX)
        .ok()
        .flatten()
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

/// Envoy's clock, since the Unix epoch (`None` if unreadable).
fn since_epoch() -> Option<Duration> {
    hostcalls::get_current_time()
        .ok()?
        .duration_since(std::time::UNIX_EPOCH)
        .ok()
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

/// Envoy no longer picks the route again when a filter changes headers
/// (envoyproxy/envoy#36671): its `clear_route_cache` function asks it to.
fn clear_route_cache() -> bool {
    hostcalls::call_foreign_function("clear_route_cache", None).is_ok()
}

fn set_request_header(name: &str, value: &str) -> bool {
    hostcalls::set_map_value(MapType::HttpRequestHeaders, name, Some(value)).is_ok()
}

/// Envoy, through its host calls.
#[derive(Clone, Copy)]
pub struct Envoy;

impl Host for Envoy {
    fn log(&self, level: Level, message: &str) {
        let level = match level {
            Level::Info => LogLevel::Info,
            Level::Warn => LogLevel::Warn,
            Level::Error => LogLevel::Error,
        };
        log(level, message);
    }

    /// Sets the root context's timer (zero stops it); `false` if Envoy refused.
    fn set_tick_period(&self, period: Duration) -> bool {
        let ok = hostcalls::set_tick_period(period).is_ok();
        if !ok {
            log(LogLevel::Warn, "could not set the timer");
        }
        ok
    }

    /// 64 random bits, for the store client's backoff jitter.
    fn random_u64(&self) -> u64 {
        let mut seed = [0u8; 8];
        let _ = getrandom::getrandom(&mut seed);
        u64::from_le_bytes(seed)
    }

    /// Envoy's clock, in milliseconds since the Unix epoch (0 if unreadable).
    fn now_ms(&self) -> i64 {
        since_epoch()
            .and_then(|d| i64::try_from(d.as_millis()).ok())
            .unwrap_or(0)
    }

    fn now_us(&self) -> i64 {
        since_epoch()
            .and_then(|d| i64::try_from(d.as_micros()).ok())
            .unwrap_or(0)
    }

    fn counter(&self, name: &str) -> Option<u32> {
        hostcalls::define_metric(MetricType::Counter, name).ok()
    }

    /// Defines the gauge `name` and sets it to `value`.
    fn set_gauge(&self, name: &str, value: u64) {
        let set = hostcalls::define_metric(MetricType::Gauge, name)
            .and_then(|id| hostcalls::record_metric(id, value));
        if set.is_err() {
            log(LogLevel::Warn, &format!("could not set the gauge {name}"));
        }
    }

    fn increment(&self, metric: Option<u32>) {
        if let Some(id) = metric {
            let _ = hostcalls::increment_metric(id, 1);
        }
    }

    fn histogram(&self, name: &str) -> Option<u32> {
        hostcalls::define_metric(MetricType::Histogram, name).ok()
    }

    fn record(&self, histogram: Option<u32>, value: u64) {
        if let Some(id) = histogram {
            let _ = hostcalls::record_metric(id, value);
        }
    }

    fn request_headers(&self) -> Vec<(String, Bytes)> {
        hostcalls::get_map_bytes(MapType::HttpRequestHeaders).unwrap_or_default()
    }

    fn request_header(&self, name: &str) -> Option<Bytes> {
        hostcalls::get_map_value_bytes(MapType::HttpRequestHeaders, name)
            .ok()
            .flatten()
    }

    /// Removes every line of a request header; an error (Envoy never refuses
    /// this in the request-headers callback) is logged.
    fn remove_request_header(&self, name: &str) {
        if hostcalls::remove_map_value(MapType::HttpRequestHeaders, name).is_err() {
            log(
                LogLevel::Error,
                &format!("could not remove request header {name}"),
            );
        }
    }

    fn response_headers(&self) -> Vec<(String, Bytes)> {
        hostcalls::get_map_bytes(MapType::HttpResponseHeaders).unwrap_or_default()
    }

    fn response_trailers(&self) -> Vec<(String, Bytes)> {
        hostcalls::get_map_bytes(MapType::HttpResponseTrailers).unwrap_or_default()
    }

    fn remove_response_trailer(&self, name: &str) {
        let _ = hostcalls::remove_map_value(MapType::HttpResponseTrailers, name);
    }

    fn remove_response_header(&self, name: &str) {
        let _ = hostcalls::remove_map_value(MapType::HttpResponseHeaders, name);
    }

    /// Replaces every line of a response header with one value.
    fn set_response_header(&self, name: &str, value: &str) {
        if hostcalls::set_map_value(MapType::HttpResponseHeaders, name, Some(value)).is_err() {
            log(LogLevel::Warn, &format!("could not set response header {name}"));
        }
    }

    fn property(&self, path: &[&str]) -> Option<Bytes> {
        hostcalls::get_property(path.to_vec()).ok().flatten()
    }

    fn request_body(&self, start: usize, size: usize) -> Bytes {
        read_buffer(BufferType::HttpRequestBody, start, size)
    }

    fn response_body(&self, start: usize, size: usize) -> Bytes {
        read_buffer(BufferType::HttpResponseBody, start, size)
    }

    /// Sets the current request's filter state `wasm.<name>`, which access logs
    /// read as `%FILTER_STATE(wasm.<name>:PLAIN)%`.
    fn set_filter_state(&self, name: &str, value: &str) {
        if hostcalls::set_property(vec![name], Some(value.as_bytes())).is_err() {
            log(LogLevel::Warn, &format!("could not set filter state {name}"));
        }
    }

    /// Makes the request of HTTP context `id` the one later calls act on: an
    /// answer for one request may arrive in another's callback.
    fn set_effective_context(&self, id: u32) {
        if hostcalls::set_effective_context(id).is_err() {
            log(LogLevel::Warn, "could not switch to a request's context");
        }
    }

    fn resume_request(&self) {
        if hostcalls::resume_http_request().is_err() {
            log(LogLevel::Warn, "could not resume the request");
        }
    }

    fn resume_response(&self) {
        if hostcalls::resume_http_response().is_err() {
            log(LogLevel::Warn, "could not resume the response");
        }
    }

    fn send_reply(&self, reply: &Reply) {
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
    fn reroute(&self, call: &StoreCall, held: usize) {
        const KEPT: [&str; 4] = ["content-type", "te", "x-request-id", "x-forwarded-proto"];
        let mut done = set_request_header(":path", call.path);
        for (name, _) in self.request_headers() {
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

    /// Removes the replay route's marker from a client's request, and has
    /// Envoy pick that request's route again without it: only the filter's own
    /// reroutes reach the store's replay route.
    fn remove_forged_replay_marker(&self) {
        if self.request_header(REPLAY_MARKER).is_none() {
            return;
        }
        self.remove_request_header(REPLAY_MARKER);
        if !clear_route_cache() {
            log(
                LogLevel::Error,
                "a client's request carried the replay marker and its route could not be picked again; resetting the stream",
            );
            let _ = hostcalls::reset_http_request();
        }
    }

    /// Dispatches a store call; `None` when Envoy refuses it (unknown cluster, no
    /// healthy host), which the caller treats as an unreachable store.
    fn dispatch(&self, store: &StoreConfig, call: &StoreCall) -> Option<u32> {
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
    fn dispatch_upstream(&self, call: &UpstreamCall, body: &[u8]) -> Option<u32> {
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
    fn call_response_headers(&self, num_headers: usize) -> Option<Vec<(String, Bytes)>> {
        if num_headers == 0 {
            return None;
        }
        hostcalls::get_map_bytes(MapType::HttpCallResponseHeaders).ok()
    }

    fn call_response_body(&self, size: usize) -> Bytes {
        read_buffer(BufferType::HttpCallResponseBody, 0, size)
    }

    /// Reads the store's reply inside `on_http_call_response`. No headers means
    /// the call was reset or timed out; asking for a header then would panic.
    fn store_answer(&self, num_headers: usize, body_size: usize) -> StoreAnswer {
        if num_headers == 0 {
            return None;
        }
        let status = hostcalls::get_map_value_bytes(MapType::HttpCallResponseHeaders, ":status")
            .ok()
            .flatten()?;
        let status = std::str::from_utf8(&status).ok()?.parse::<u16>().ok()?;
        Some((status, self.call_response_body(body_size)))
    }
}
