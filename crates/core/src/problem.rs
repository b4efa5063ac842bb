//! RFC 9457 problem details (contract §7).
//!
//! Every answer the filter or the store gives on its own behalf is a problem
//! document: `Content-Type: application/problem+json`, `Cache-Control:
//! no-store`, a `Link: <type>; rel="describedby"` header, `Retry-After` when
//! the client should come back, and a compact JSON body with `type` (the
//! documentation base + the kind's slug), `title`, `status` and `detail`, plus
//! `completed_at` (RFC 3339, UTC, milliseconds) and `original_status` when they
//! are known. The detail is written by the caller and must never carry
//! internals or the raw key.

use serde::Serialize;

use crate::Reply;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProblemKind {
    KeyMissing,
    KeyInvalid,
    BodyTooLarge,
    KeyReused,
    KeyExpired,
    RequestInProgress,
    OutcomeUnknown,
    ResultUnavailable,
    StoreUnavailable,
    IdentityMissing,
    /// The tenant created more new keys than the store's budget allows.
    KeyRateLimited,
    // The store's own API.
    Unauthorized,
    Forbidden,
    BadRequest,
    NotFound,
}

impl ProblemKind {
    /// Every kind, for documentation and tests.
    pub const ALL: [ProblemKind; 15] = [
        ProblemKind::KeyMissing,
        ProblemKind::KeyInvalid,
        ProblemKind::BodyTooLarge,
        ProblemKind::KeyReused,
        ProblemKind::KeyExpired,
        ProblemKind::RequestInProgress,
        ProblemKind::OutcomeUnknown,
        ProblemKind::ResultUnavailable,
        ProblemKind::StoreUnavailable,
        ProblemKind::IdentityMissing,
        ProblemKind::KeyRateLimited,
        ProblemKind::Unauthorized,
        ProblemKind::Forbidden,
        ProblemKind::BadRequest,
        ProblemKind::NotFound,
    ];

    /// Whether the same request, sent again later with the same key, can
    /// succeed: the record was busy or the store unreachable. Every other
    /// problem is final for that request.
    pub fn retryable(self) -> bool {
        matches!(
            self,
            ProblemKind::RequestInProgress | ProblemKind::StoreUnavailable | ProblemKind::KeyRateLimited
        )
    }

    /// The last segment of the problem's `type` URI.
    pub fn slug(self) -> &'static str {
        self.describe().0
    }

    pub fn status(self) -> u16 {
        self.describe().1
    }

    pub fn title(self) -> &'static str {
        self.describe().2
    }

    fn describe(self) -> (&'static str, u16, &'static str) {
        match self {
            ProblemKind::KeyMissing => ("key-missing", 400, "Idempotency-Key is missing"),
            ProblemKind::KeyInvalid => ("key-invalid", 400, "Idempotency-Key is invalid"),
            ProblemKind::BodyTooLarge => ("body-too-large", 413, "Request body is too large"),
            ProblemKind::KeyReused => (
                "key-reused",
                422,
                "Idempotency-Key was used for a different request",
            ),
            ProblemKind::KeyExpired => ("key-expired", 422, "Idempotency-Key has expired"),
            ProblemKind::RequestInProgress => (
                "request-in-progress",
                409,
                "A request with this Idempotency-Key is in progress",
            ),
            ProblemKind::OutcomeUnknown => (
                "outcome-unknown",
                409,
                "Outcome of the original request is unknown",
            ),
            ProblemKind::ResultUnavailable => (
                "result-unavailable",
                409,
                "Result of the original request is unavailable",
            ),
            ProblemKind::StoreUnavailable => ("store-unavailable", 503, "Idempotency store is unavailable"),
            ProblemKind::IdentityMissing => ("identity-missing", 400, "Caller identity is missing"),
            ProblemKind::KeyRateLimited => (
                "key-rate-limited",
                429,
                "Too many new Idempotency-Keys for this tenant",
            ),
            ProblemKind::Unauthorized => ("unauthorized", 401, "Unauthorized"),
            ProblemKind::Forbidden => ("forbidden", 403, "Forbidden"),
            ProblemKind::BadRequest => ("bad-request", 400, "Bad request"),
            ProblemKind::NotFound => ("not-found", 404, "Not found"),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    pub kind: ProblemKind,
    pub detail: String,
    /// When to come back; rendered as `Retry-After` (whole seconds, at
    /// least 1) and `retry-after-ms`.
    pub retry_after_ms: Option<u64>,
    /// Milliseconds since the epoch; rendered as RFC 3339.
    pub completed_at: Option<i64>,
    pub original_status: Option<u16>,
}

/// The body, members in the order RFC 9457 lists them.
#[derive(Serialize)]
struct Body<'a> {
    #[serde(rename = "type")]
    type_uri: &'a str,
    title: &'a str,
    status: u16,
    detail: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    completed_at: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    original_status: Option<u16>,
    /// `key-rate-limited` only: the wait in milliseconds, so the store's
    /// answer carries it to the filter inside a batch too (where a call's
    /// answer has no headers of its own).
    #[serde(skip_serializing_if = "Option::is_none")]
    retry_after_ms: Option<u64>,
}

impl Problem {
    pub fn new(kind: ProblemKind, detail: impl Into<String>) -> Self {
        Problem {
            kind,
            detail: detail.into(),
            retry_after_ms: None,
            completed_at: None,
            original_status: None,
        }
    }
    pub fn retry_after(self, seconds: u64) -> Self {
        self.retry_after_ms(seconds.max(1).saturating_mul(1000))
    }
    pub fn retry_after_ms(mut self, ms: u64) -> Self {
        self.retry_after_ms = Some(ms.max(1));
        self
    }
    pub fn completed_at(mut self, ms: Option<i64>) -> Self {
        self.completed_at = ms;
        self
    }
    pub fn original_status(mut self, status: u16) -> Self {
        self.original_status = Some(status);
        self
    }

    // The filter's problems, worded once. Details speak to the client and
    // never carry internals or the raw key.

    pub fn key_missing(method: &str, route: &str) -> Self {
        Problem::new(
            ProblemKind::KeyMissing,
            format!("{method} {route} requires an Idempotency-Key header, e.g. Idempotency-Key: \"8e03978e-40d5-43e8-bc93-6894a57f9324\""),
        )
    }

    pub fn key_invalid(why: impl std::fmt::Display) -> Self {
        Problem::new(ProblemKind::KeyInvalid, why.to_string())
    }

    pub fn identity_missing(why: impl std::fmt::Display) -> Self {
        Problem::new(ProblemKind::IdentityMissing, why.to_string())
    }

    pub fn body_too_large(max: usize) -> Self {
        Problem::new(
            ProblemKind::BodyTooLarge,
            format!("the request body exceeds the {max}-byte limit for idempotent requests on this route"),
        )
    }

    pub fn store_unavailable() -> Self {
        Problem::new(
            ProblemKind::StoreUnavailable,
            "the idempotency store could not be reached; the request was not forwarded, retry later with the same key",
        )
        .retry_after(1)
    }

    pub fn result_unavailable(original_status: u16, completed_at: i64) -> Self {
        Problem::new(
            ProblemKind::ResultUnavailable,
            "this key's request was completed, but its response was too large to keep for replay",
        )
        .original_status(original_status)
        .completed_at(Some(completed_at))
    }

    /// Detached forwarding: the upstream answered, but with more than the
    /// route relays; the outcome is recorded without the body.
    pub fn response_too_large(original_status: u16, max: usize) -> Self {
        Problem::new(
            ProblemKind::ResultUnavailable,
            format!("the request was executed, but its response was larger than the {max} bytes this route relays"),
        )
        .original_status(original_status)
    }

    pub fn request_in_progress(retry_after_ms: u64) -> Self {
        Problem::new(
            ProblemKind::RequestInProgress,
            "a request with this key is still being processed; retry after the indicated time",
        )
        .retry_after_ms(retry_after_ms)
    }

    pub fn key_reused() -> Self {
        Problem::new(
            ProblemKind::KeyReused,
            "this key was already used for a different request; use a new key for a new request",
        )
    }

    pub fn outcome_unknown() -> Self {
        Problem::new(
            ProblemKind::OutcomeUnknown,
            "the outcome of the request first sent with this key is unknown; reconcile before retrying with a new key",
        )
    }

    pub fn key_expired(completed_at: Option<i64>) -> Self {
        Problem::new(
            ProblemKind::KeyExpired,
            "this key has expired; if the original request must be repeated, send it with a new key",
        )
        .completed_at(completed_at)
    }

    /// The store's budget of new keys for the tenant is spent: nothing was
    /// claimed, so the same key works once the wait is over.
    pub fn key_rate_limited(retry_after_ms: u64) -> Self {
        Problem::new(
            ProblemKind::KeyRateLimited,
            "too many new idempotency keys for this tenant right now; nothing was executed, retry after the indicated time with the same key",
        )
        .retry_after_ms(retry_after_ms)
    }

    /// The wait a `key-rate-limited` problem body (the store's answer to a
    /// claim) asks for; `None` for any other body.
    pub fn rate_limited_wait(body: &[u8]) -> Option<u64> {
        let problem = Problem::read(ProblemKind::KeyRateLimited.status(), body)?;
        (problem.kind == ProblemKind::KeyRateLimited).then(|| problem.retry_after_ms.unwrap_or(1000).max(1))
    }

    /// The problem a document answered with `status` states, when it is
    /// one of ours (the store renders every refusal with [`Problem::render`]):
    /// its `type` is a documentation base followed by a kind's slug, and
    /// that kind's status, the document's `status` and the answer's agree.
    /// `None` for anything else — plain text, Envoy's `about:blank`
    /// problems, whatever a proxy or rate limiter in front of the store
    /// writes.
    pub fn read(status: u16, body: &[u8]) -> Option<Problem> {
        let v = serde_json::from_slice::<serde_json::Value>(body).ok()?;
        let type_uri = v.get("type")?.as_str()?;
        let kind = ProblemKind::ALL
            .into_iter()
            .find(|k| type_uri.ends_with(k.slug()))?;
        if kind.status() != status || v.get("status")?.as_u64()? != u64::from(status) {
            return None;
        }
        let detail = v
            .get("detail")
            .and_then(serde_json::Value::as_str)
            .unwrap_or_default();
        let mut problem = Problem::new(kind, detail);
        problem.retry_after_ms = v.get("retry_after_ms").and_then(serde_json::Value::as_u64);
        Some(problem)
    }

    /// The full response: status, `application/problem+json`, `Cache-Control:
    /// no-store`, `Link: <type>; rel="describedby"`, `Retry-After` when set.
    pub fn render(&self, doc_base: &str) -> Reply {
        let type_uri = format!("{doc_base}{}", self.kind.slug());
        let body = Body {
            type_uri: &type_uri,
            title: self.kind.title(),
            status: self.kind.status(),
            detail: &self.detail,
            completed_at: self.completed_at.map(rfc3339_utc),
            original_status: self.original_status,
            retry_after_ms: self
                .retry_after_ms
                .filter(|_| self.kind == ProblemKind::KeyRateLimited),
        };
        // Serializing strings and integers cannot fail.
        let body = serde_json::to_vec(&body).unwrap_or_default();
        let mut headers = vec![
            ("content-type".to_string(), "application/problem+json".to_string()),
            ("cache-control".to_string(), "no-store".to_string()),
            ("link".to_string(), format!("<{type_uri}>; rel=\"describedby\"")),
        ];
        // The retry hints SDKs obey besides Retry-After: Stainless-generated
        // clients read `x-should-retry` and `retry-after-ms`, Stripe's read
        // `Stripe-Should-Retry`.
        let retry = if self.kind.retryable() { "true" } else { "false" };
        headers.push(("x-should-retry".to_string(), retry.to_string()));
        headers.push(("stripe-should-retry".to_string(), retry.to_string()));
        if let Some(ms) = self.retry_after_ms {
            headers.push(("retry-after".to_string(), ms.div_ceil(1000).max(1).to_string()));
            headers.push(("retry-after-ms".to_string(), ms.to_string()));
        }
        Reply {
            status: self.kind.status(),
            headers,
            body,
        }
    }
}

/// A reply of Envoy's own (or a refusal the filter gives in its place) as
/// the reference bootstraps' `local_reply_config` renders Envoy's local
/// replies: an `about:blank` problem with `Cache-Control: no-store`, so a
/// client sees one form whether the router or the filter's own upstream call
/// met the failure. `title` is Envoy's one-line text.
pub fn envoy_reply(status: u16, title: &str, detail: &str) -> Reply {
    let body = Body {
        type_uri: "about:blank",
        title,
        status,
        detail,
        completed_at: None,
        original_status: None,
        retry_after_ms: None,
    };
    Reply {
        status,
        headers: vec![
            ("content-type".to_string(), "application/problem+json".to_string()),
            ("cache-control".to_string(), "no-store".to_string()),
        ],
        // Serializing strings and integers cannot fail.
        body: serde_json::to_vec(&body).unwrap_or_default(),
    }
}

/// Milliseconds since the epoch as `YYYY-MM-DDThh:mm:ss.sssZ`.
pub fn rfc3339_utc(ms: i64) -> String {
    let days = ms.div_euclid(86_400_000);
    let ms_of_day = ms.rem_euclid(86_400_000);
    let (year, month, day) = civil_from_days(days);
    let (h, m, s, milli) = (
        ms_of_day / 3_600_000,
        ms_of_day / 60_000 % 60,
        ms_of_day / 1000 % 60,
        ms_of_day % 1000,
    );
    format!("{year:04}-{month:02}-{day:02}T{h:02}:{m:02}:{s:02}.{milli:03}Z")
}

/// Howard Hinnant's `civil_from_days`: days since 1970-01-01 to a proleptic
/// Gregorian (year, month, day).
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str = "https://idemgate.dev/problems/";

    macro_rules! kind {
        ($name:ident, $kind:expr, $slug:expr => $status:expr) => {
            #[test]
            fn $name() {
                let reply = Problem::new($kind, "why").render(BASE);
                assert_eq!(($kind.slug(), $kind.status()), ($slug, $status));
                assert_eq!(reply.status, $status);
                let body: serde_json::Value = serde_json::from_slice(&reply.body).unwrap();
                assert_eq!(body["type"], format!("{BASE}{}", $slug));
                assert_eq!(body["status"], $status);
                assert_eq!(body["title"], $kind.title());
                assert_eq!(body["detail"], "why");
                assert_eq!(
                    header(&reply, "link"),
                    Some(format!("<{BASE}{}>; rel=\"describedby\"", $slug).as_str())
                );
            }
        };
    }

    fn header<'a>(reply: &'a Reply, name: &str) -> Option<&'a str> {
        reply
            .headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    kind!(key_missing_is_a_400, ProblemKind::KeyMissing, "key-missing" => 400);
    kind!(key_invalid_is_a_400, ProblemKind::KeyInvalid, "key-invalid" => 400);
    kind!(body_too_large_is_a_413, ProblemKind::BodyTooLarge, "body-too-large" => 413);
    kind!(key_reused_is_a_422, ProblemKind::KeyReused, "key-reused" => 422);
    kind!(key_expired_is_a_422, ProblemKind::KeyExpired, "key-expired" => 422);
    kind!(request_in_progress_is_a_409, ProblemKind::RequestInProgress, "request-in-progress" => 409);
    kind!(outcome_unknown_is_a_409, ProblemKind::OutcomeUnknown, "outcome-unknown" => 409);
    kind!(result_unavailable_is_a_409, ProblemKind::ResultUnavailable, "result-unavailable" => 409);
    kind!(store_unavailable_is_a_503, ProblemKind::StoreUnavailable, "store-unavailable" => 503);
    kind!(identity_missing_is_a_400, ProblemKind::IdentityMissing, "identity-missing" => 400);
    kind!(key_rate_limited_is_a_429, ProblemKind::KeyRateLimited, "key-rate-limited" => 429);

    #[test]
    fn a_rate_limited_body_carries_its_wait_and_only_it_does() {
        let limited = Problem::key_rate_limited(1500).render(BASE);
        let body: serde_json::Value = serde_json::from_slice(&limited.body).unwrap();
        assert_eq!(body["retry_after_ms"], 1500);
        assert_eq!(Problem::rate_limited_wait(&limited.body), Some(1500));
        let busy = Problem::request_in_progress(1500).render(BASE);
        let body: serde_json::Value = serde_json::from_slice(&busy.body).unwrap();
        assert!(body.get("retry_after_ms").is_none(), "{body}");
        assert_eq!(Problem::rate_limited_wait(&busy.body), None);
        assert_eq!(Problem::rate_limited_wait(b"not json"), None);
    }

    #[test]
    fn only_a_problem_of_ours_is_read_as_one() {
        let refused =
            Problem::new(ProblemKind::BodyTooLarge, "over 8 MiB").render("https://store.example/p/");
        let read = Problem::read(413, &refused.body).unwrap();
        assert_eq!(
            (read.kind, read.detail.as_str()),
            (ProblemKind::BodyTooLarge, "over 8 MiB")
        );
        // Whatever base the store was given, with a slash or without.
        let unslashed = Problem::new(ProblemKind::BadRequest, "no").render("https://store.example/p");
        let read = Problem::read(400, &unslashed.body).map(|p| p.kind);
        assert_eq!(read, Some(ProblemKind::BadRequest));
        // Another status than the document's is not its answer.
        assert_eq!(Problem::read(400, &refused.body), None);
        // Envoy's own replies, and what proxies and rate limiters write.
        let envoy = envoy_reply(413, "Payload Too Large", "request body too large");
        assert_eq!(Problem::read(413, &envoy.body), None);
        assert_eq!(Problem::read(429, b"local_rate_limited"), None);
        assert_eq!(Problem::read(408, b""), None);
        let foreign = br#"{"type":"https://proxy.example/too-many","status":429,"detail":"slow down"}"#;
        assert_eq!(Problem::read(429, foreign), None);
    }
    kind!(unauthorized_is_a_401, ProblemKind::Unauthorized, "unauthorized" => 401);
    kind!(forbidden_is_a_403, ProblemKind::Forbidden, "forbidden" => 403);
    kind!(bad_request_is_a_400, ProblemKind::BadRequest, "bad-request" => 400);
    kind!(not_found_is_a_404, ProblemKind::NotFound, "not-found" => 404);

    #[test]
    fn every_reply_is_uncacheable_problem_json() {
        for kind in ProblemKind::ALL {
            let reply = Problem::new(kind, "d").render(BASE);
            assert_eq!(header(&reply, "content-type"), Some("application/problem+json"));
            assert_eq!(header(&reply, "cache-control"), Some("no-store"));
            assert_eq!(header(&reply, "retry-after"), None);
        }
    }

    #[test]
    fn slugs_are_unique() {
        let mut slugs: Vec<_> = ProblemKind::ALL.iter().map(|k| k.slug()).collect();
        slugs.sort_unstable();
        slugs.dedup();
        assert_eq!(slugs.len(), ProblemKind::ALL.len());
    }

    #[test]
    fn the_body_is_compact_json_with_type_first() {
        let reply = Problem::new(ProblemKind::KeyMissing, "send one").render("https://d/");
        assert_eq!(
            String::from_utf8(reply.body).unwrap(),
            r#"{"type":"https://d/key-missing","title":"Idempotency-Key is missing","status":400,"detail":"send one"}"#
        );
    }

    #[test]
    fn retry_after_is_sent_and_at_least_one_second() {
        let reply = Problem::new(ProblemKind::RequestInProgress, "wait")
            .retry_after(0)
            .render(BASE);
        assert_eq!(header(&reply, "retry-after"), Some("1"));
        let reply = Problem::new(ProblemKind::StoreUnavailable, "later")
            .retry_after(7)
            .render(BASE);
        assert_eq!(header(&reply, "retry-after"), Some("7"));
        assert_eq!(header(&reply, "retry-after-ms"), Some("7000"));
        let reply = Problem::new(ProblemKind::RequestInProgress, "soon")
            .retry_after_ms(250)
            .render(BASE);
        assert_eq!(header(&reply, "retry-after"), Some("1"));
        assert_eq!(header(&reply, "retry-after-ms"), Some("250"));
    }

    #[test]
    fn every_problem_tells_sdks_whether_to_retry() {
        for kind in ProblemKind::ALL {
            let reply = Problem::new(kind, "d").render(BASE);
            let want = if matches!(
                kind,
                ProblemKind::RequestInProgress | ProblemKind::StoreUnavailable | ProblemKind::KeyRateLimited
            ) {
                "true"
            } else {
                "false"
            };
            assert_eq!(header(&reply, "x-should-retry"), Some(want), "{kind:?}");
            assert_eq!(header(&reply, "stripe-should-retry"), Some(want), "{kind:?}");
        }
    }

    #[test]
    fn result_unavailable_carries_original_status_and_completion_time() {
        let reply = Problem::new(ProblemKind::ResultUnavailable, "too big")
            .original_status(201)
            .completed_at(Some(1_796_017_200_123))
            .render(BASE);
        let body: serde_json::Value = serde_json::from_slice(&reply.body).unwrap();
        assert_eq!(body["original_status"], 201);
        assert_eq!(body["completed_at"], "2026-11-30T05:40:00.123Z");
    }

    #[test]
    fn absent_optional_members_are_left_out() {
        let reply = Problem::new(ProblemKind::KeyExpired, "old")
            .completed_at(None)
            .render(BASE);
        let body: serde_json::Value = serde_json::from_slice(&reply.body).unwrap();
        assert!(body.get("completed_at").is_none());
        assert!(body.get("original_status").is_none());
    }

    macro_rules! time {
        ($name:ident, $ms:expr => $want:expr) => {
            #[test]
            fn $name() {
                assert_eq!(rfc3339_utc($ms), $want);
            }
        };
    }

    time!(the_epoch_is_1970, 0 => "1970-01-01T00:00:00.000Z");
    time!(a_time_before_the_epoch_counts_back, -1 => "1969-12-31T23:59:59.999Z");
    time!(a_leap_day_is_rendered, 951_782_400_000 => "2000-02-29T00:00:00.000Z");
    time!(the_day_after_a_leap_day_is_march, 951_868_800_000 => "2000-03-01T00:00:00.000Z");
    time!(the_end_of_a_year_is_rendered, 1_704_067_199_999 => "2023-12-31T23:59:59.999Z");
    time!(a_date_in_2026_is_rendered, 1_796_017_200_123 => "2026-11-30T05:40:00.123Z");
    time!(the_year_2100_is_not_a_leap_year, 4_107_542_400_000 => "2100-03-01T00:00:00.000Z");
}
