//! The filter's API (`/v1`): frames in, frames or JSON out.
//!
//! Everything is validated here, before the backend sees it: the frame, the
//! scope (by `Scope`'s own deserializer), the bounds on times, the response
//! status and headers. Errors are problem+json; backend failures are 503
//! `store-unavailable` without internal detail.

use axum::body::{Body, Bytes};
use axum::extract::Request;
use axum::extract::State;
use axum::http::header::CONTENT_TYPE;
use axum::http::{HeaderMap, HeaderValue, StatusCode, Uri};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Extension;
use idemgate_core::problem::ProblemKind;
use idemgate_core::protocol::{
    decode_frame, encode_batch_reply, encode_frame, negotiate, split_batch, AbandonRequest, Batch,
    ClaimRequest, CompleteRequest, FenceReply, FenceRequest, ABANDON_PATH, CLAIM_PATH, COMPLETE_PATH,
    FRAME_CONTENT_TYPE, MARK_UNKNOWN_PATH, MAX_BATCH, PROTOCOL_HEADER, PROTOCOL_VERSIONS, RELEASE_PATH,
};
use idemgate_core::trace::{Trace, TRACE_HEADER};
use serde::de::DeserializeOwned;

use crate::backend::{limits, Answer, Call, Result as StoreResult, StoreError};
use crate::mesh::Caller;
use crate::problem::Refusal;
use crate::AppState;

/// Reads the whole body, refusing more than the configured limit with 413.
pub async fn read_body(state: &AppState, body: Body) -> Result<Bytes, Refusal> {
    let limit = state.settings.max_body_bytes;
    axum::body::to_bytes(body, limit).await.map_err(|e| {
        let too_large = std::error::Error::source(&e)
            .is_some_and(|s| s.is::<http_body_util::LengthLimitError>())
            || e.to_string().contains("length limit");
        if too_large {
            Refusal::new(
                ProblemKind::BodyTooLarge,
                format!("the request body is larger than {limit} bytes"),
            )
        } else {
            Refusal::bad_request("the request body could not be read")
        }
    })
}

/// A frame whose metadata is all there is (claim, release, mark-unknown).
fn bare_frame<T: DeserializeOwned>(bytes: &Bytes) -> Result<T, Refusal> {
    let (req, rest) = decode::<T>(bytes)?;
    if !rest.is_empty() {
        return Err(Refusal::bad_request(
            "this frame carries no bytes after its metadata line",
        ));
    }
    Ok(req)
}

fn decode<T: DeserializeOwned>(bytes: &Bytes) -> Result<(T, Bytes), Refusal> {
    let (meta, rest) = decode_frame::<T>(bytes).map_err(|e| Refusal::bad_request(e.to_string()))?;
    Ok((meta, bytes.slice_ref(rest)))
}

/// The client requests the `calls` calls of a request serve, from its
/// [`TRACE_HEADER`].
fn traces(headers: &HeaderMap, calls: usize) -> Vec<Trace> {
    Trace::parse_header(headers.get(TRACE_HEADER).map(HeaderValue::as_bytes), calls)
}

/// A call's answer: its status and frame.
type Answered = (StatusCode, Vec<u8>);

fn fence_reply(reply: FenceReply) -> Answered {
    let status = match reply {
        FenceReply::Done => StatusCode::OK,
        FenceReply::Stale => StatusCode::CONFLICT,
    };
    (status, encode_frame(&reply, &[]))
}

/// A call of the filter's API, decoded and validated: everything before the
/// store decides it. The record's log id is computed only when debug logs
/// are on.
struct Parsed {
    call: Call,
    path: &'static str,
    record: Option<String>,
}

/// Decodes and validates one call of the filter's API, sent alone or in a
/// batch, serving the client request `trace` names; a call on a policy
/// its `caller` does not own is refused before the store sees it.
fn parse(
    state: &AppState,
    caller: &Caller,
    path: &str,
    bytes: Bytes,
    trace: Trace,
) -> Result<Parsed, Refusal> {
    let log_id = |scope: &idemgate_core::scope::Scope| {
        caller.may_act_on(scope.route())?;
        Ok::<_, Refusal>(tracing::enabled!(tracing::Level::DEBUG).then(|| state.store.log_id(scope)))
    };
    let (call, path, record) = match path {
        CLAIM_PATH => {
            let req = ClaimRequest {
                trace,
                ..bare_frame::<ClaimRequest>(&bytes)?
            };
            req.check().map_err(Refusal::bad_request)?;
            let record = log_id(&req.scope)?;
            (Call::Claim { req, deadline: None }, CLAIM_PATH, record)
        }
        COMPLETE_PATH => {
            let (req, rest) = decode::<CompleteRequest>(&bytes)?;
            let req = CompleteRequest { trace, ..req };
            limits::response_fits(req.status, &req.headers).map_err(Refusal::bad_request)?;
            if !req.body_stored && !rest.is_empty() {
                return Err(Refusal::bad_request(
                    "body_stored is false but the frame carries bytes",
                ));
            }
            let record = log_id(&req.scope)?;
            (Call::Complete { req, body: rest }, COMPLETE_PATH, record)
        }
        RELEASE_PATH => {
            let req = FenceRequest {
                trace,
                ..bare_frame::<FenceRequest>(&bytes)?
            };
            let record = log_id(&req.scope)?;
            (Call::Release(req), RELEASE_PATH, record)
        }
        MARK_UNKNOWN_PATH => {
            let req = FenceRequest {
                trace,
                ..bare_frame::<FenceRequest>(&bytes)?
            };
            let record = log_id(&req.scope)?;
            (Call::MarkUnknown(req), MARK_UNKNOWN_PATH, record)
        }
        ABANDON_PATH => {
            let req = AbandonRequest {
                trace,
                ..bare_frame::<AbandonRequest>(&bytes)?
            };
            let record = log_id(&req.scope)?;
            (Call::Abandon(req), ABANDON_PATH, record)
        }
        _ => {
            return Err(Refusal::new(
                ProblemKind::NotFound,
                format!("{path} is not a call of /v1"),
            ))
        }
    };
    Ok(Parsed { call, path, record })
}

/// The answer to a call, as its status and frame.
fn answered(path: &str, record: Option<&str>, answer: StoreResult<Answer>) -> Result<Answered, Refusal> {
    let record = record.unwrap_or("-");
    match answer? {
        Answer::Claim(outcome) => {
            tracing::debug!(record, reply = ?outcome.reply, "claim");
            Ok((StatusCode::OK, encode_frame(&outcome.reply, &outcome.body)))
        }
        Answer::Fence(reply) => {
            tracing::debug!(record, ?reply, path, "fence call");
            Ok(fence_reply(reply))
        }
    }
}

/// One call sent alone: `POST` to its path.
pub async fn single(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    uri: Uri,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, Refusal> {
    let bytes = read_body(&state, body).await?;
    let trace = traces(&headers, 1).pop().unwrap_or_default();
    let parsed = parse(&state, &caller, uri.path(), bytes, trace)?;
    let answer = state
        .store
        .decide(vec![parsed.call])
        .await
        .pop()
        .unwrap_or_else(|| Err(StoreError::internal("the call went unanswered")));
    let (status, frame) = answered(parsed.path, parsed.record.as_deref(), answer)?;
    Ok((status, [(CONTENT_TYPE, FRAME_CONTENT_TYPE)], frame).into_response())
}

/// Several calls in one request (`/v1/batch`), each decided on its own: a
/// refused or failed call answers with its own problem, as it would alone,
/// and never fails or undoes another. The store decides the valid ones
/// together (on SQLite: looked at on one reader, written in one
/// transaction).
pub async fn batch(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, Refusal> {
    let bytes = read_body(&state, body).await?;
    let (meta, rest) = decode::<Batch>(&bytes)?;
    if meta.calls.is_empty() || meta.calls.len() > MAX_BATCH {
        return Err(Refusal::bad_request(format!(
            "a batch carries 1 to {MAX_BATCH} calls"
        )));
    }
    let frames = split_batch(meta.calls.iter().map(|c| c.len), &rest)
        .map_err(|e| Refusal::bad_request(e.to_string()))?;
    let traces = traces(&headers, meta.calls.len());
    let parsed: Vec<Result<Parsed, Refusal>> = meta
        .calls
        .iter()
        .zip(frames)
        .zip(traces)
        .map(|((c, frame), trace)| parse(&state, &caller, &c.path, rest.slice_ref(frame), trace))
        .collect();
    let mut labels = Vec::with_capacity(parsed.len());
    let mut calls = Vec::with_capacity(parsed.len());
    let mut results: Vec<Option<Result<Answered, Refusal>>> = Vec::with_capacity(parsed.len());
    for p in parsed {
        match p {
            Ok(Parsed { call, path, record }) => {
                labels.push((results.len(), path, record));
                calls.push(call);
                results.push(None);
            }
            Err(refusal) => results.push(Some(Err(refusal))),
        }
    }
    let answers = if calls.is_empty() {
        Vec::new()
    } else {
        state.store.decide(calls).await
    };
    for ((i, path, record), answer) in labels.into_iter().zip(answers) {
        results[i] = Some(answered(path, record.as_deref(), answer));
    }
    let results: Vec<(u16, Vec<u8>)> = results
        .into_iter()
        .map(
            |r| match r.unwrap_or_else(|| Err(StoreError::internal("a call went unanswered").into())) {
                Ok((status, frame)) => (status.as_u16(), frame),
                Err(refusal) => refusal.render(&state.settings.doc_base),
            },
        )
        .collect();
    Ok(([(CONTENT_TYPE, FRAME_CONTENT_TYPE)], encode_batch_reply(&results)).into_response())
}

/// Answers a `/v1` call in the highest protocol version both sides speak
/// and names it; a caller sharing none with this store is refused before
/// its call is read.
pub async fn speak_protocol(req: Request, next: Next) -> Result<Response, Refusal> {
    let offered = match req.headers().get(PROTOCOL_HEADER).map(|v| v.to_str()) {
        None => None,
        Some(Ok(v)) => Some(v),
        Some(Err(_)) => return Err(Refusal::bad_request(format!("{PROTOCOL_HEADER} is not ASCII"))),
    };
    let version = negotiate(offered, PROTOCOL_VERSIONS).map_err(Refusal::bad_request)?;
    let mut resp = next.run(req).await;
    resp.headers_mut()
        .insert(PROTOCOL_HEADER, HeaderValue::from(version));
    Ok(resp)
}

pub async fn healthz() -> &'static str {
    "ok"
}

/// 200 only when the database answers and the schema is in place.
pub async fn readyz(State(state): State<AppState>) -> Response {
    match state.store.backend.ping().await {
        Ok(()) => (StatusCode::OK, "ready").into_response(),
        Err(e) => {
            tracing::warn!(error = %e, "not ready");
            (StatusCode::SERVICE_UNAVAILABLE, "database not ready").into_response()
        }
    }
}

pub async fn not_found() -> Refusal {
    Refusal::new(ProblemKind::NotFound, "no such endpoint; see /openapi.json")
}
