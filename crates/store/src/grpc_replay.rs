//! The replay route of gRPC responses (`/idemgate.v1.Store/Replay`).
//!
//! Envoy answers a gRPC call locally with a status alone, so the filter
//! cannot replay a stored response's messages itself: it sends the
//! response it read from the store here, on a route of Envoy's to this
//! service over HTTP/2, and this sends it back as it came: headers,
//! message frames, trailers. It reads and writes nothing, so it needs no
//! credential: whoever calls it gets back only what they sent. Envoy's
//! route to it requires a header only the filter's reroutes carry
//! (`REPLAY_MARKER`), and this sends back only gRPC responses
//! (`grpc::replay_refusal`): it can never reflect a page or a cookie on the
//! API's origin.

use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use http_body_util::{BodyExt, Full};
use idemgate_core::grpc;
use idemgate_core::protocol::{decode_frame, ReplayRequest};

/// The largest replay: a stored body plus its metadata line.
const MAX_REPLAY: usize = idemgate_core::limits::MAX_FRAME;

pub async fn serve(body: Body) -> Response {
    let Ok(frame) = axum::body::to_bytes(body, MAX_REPLAY).await else {
        return status_only(grpc::code::RESOURCE_EXHAUSTED, "replay too large");
    };
    let Ok((request, messages)) = decode_frame::<ReplayRequest>(&frame) else {
        return status_only(grpc::code::INTERNAL, "not a replay frame");
    };
    if let Some(refusal) = grpc::replay_refusal(&request.headers, messages) {
        return status_only(grpc::code::INTERNAL, refusal);
    }
    let (Some(headers), Some(trailers)) = (fields(&request.headers), fields(&request.trailers)) else {
        return status_only(grpc::code::INTERNAL, "a stored field is not a header");
    };
    let body = Full::new(Bytes::copy_from_slice(messages))
        .with_trailers(async move { Some(Ok::<_, std::convert::Infallible>(trailers)) });
    (StatusCode::OK, headers, Body::new(body)).into_response()
}

fn fields(list: &[(String, String)]) -> Option<HeaderMap> {
    let mut map = HeaderMap::new();
    for (name, value) in list {
        let name = HeaderName::from_bytes(name.as_bytes()).ok()?;
        map.append(name, HeaderValue::from_str(value).ok()?);
    }
    Some(map)
}

/// A trailers-only gRPC answer.
fn status_only(code: u8, message: &str) -> Response {
    let mut headers = HeaderMap::new();
    headers.insert("content-type", HeaderValue::from_static(grpc::CONTENT_TYPE));
    headers.insert("grpc-status", HeaderValue::from(u16::from(code)));
    if let Ok(message) = HeaderValue::from_str(message) {
        headers.insert("grpc-message", message);
    }
    (StatusCode::OK, headers).into_response()
}
