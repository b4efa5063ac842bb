//! The bounds the filter and the store agree on (contract §5).
//!
//! The store refuses a frame beyond these with a 4xx; the filter's
//! configuration refuses the settings that would produce one, so a store 4xx
//! at run time means the two were deployed with different limits (or a wrong
//! credential), never that a policy asked for too much.

use crate::headers::is_header_name;

/// Longest lease a claim may ask for (`lease_seconds`).
pub const MAX_LEASE_MS: u64 = 24 * 60 * 60 * 1000;
/// Longest a record may be kept (`ttl_seconds`).
pub const MAX_TTL_MS: u64 = 366 * 24 * 60 * 60 * 1000;
/// Longest the store holds a claim waiting for a result (`wait_max_ms`).
pub const MAX_WAIT_MS: u64 = 60 * 1000;
/// Longest a claim's caller may say it waits for the answer (`deadline_ms`).
/// The filter sends its claim call's timeout: `store.timeout_ms`, plus
/// `wait_max_ms` under `in_flight: wait`.
pub const MAX_DEADLINE_MS: u64 = 2 * MAX_WAIT_MS;
/// Most response header lines a completion may store.
pub const MAX_HEADERS: usize = 64;
/// Longest header name: the header-name rule's own bound, defined with the
/// rule in [`crate::headers`].
pub use crate::headers::MAX_HEADER_NAME;
pub const MAX_HEADER_VALUE: usize = 8 * 1024;
/// Most bytes of names and values the stored headers of one response hold
/// together: escaped to JSON and sealed, they stay well inside the
/// database's bound on the column (1 MiB). Envoy's own default limit on a
/// response's headers is 60 KiB.
pub const MAX_STORED_HEADER_BYTES: usize = 256 * 1024;
/// Largest response body a policy may keep for replay (`max_stored_body`).
pub const MAX_STORED_BODY: usize = 4 * 1024 * 1024;
/// Largest frame the store accepts by default: the largest stored body plus
/// its metadata line (scope, and up to [`MAX_HEADERS`] headers of the longest
/// allowed size, JSON-escaped) with room to spare.
pub const MAX_FRAME: usize = 8 * 1024 * 1024;

/// Whether a response's status and headers may be stored as they are: the
/// store refuses a completion that breaks this, and the filter completes
/// without the response instead of sending one.
pub fn response_fits(status: u16, headers: &[(String, String)]) -> Result<(), String> {
    if !(100..=599).contains(&status) {
        return Err("status must be between 100 and 599".into());
    }
    if headers.len() > MAX_HEADERS {
        return Err(format!("at most {MAX_HEADERS} headers"));
    }
    if let Some((name, _)) = headers.iter().find(|(n, v)| !header_fits(n, v)) {
        return Err(format!(
            "header {name:?} is not a valid HTTP token, or its value is too long or contains control characters"
        ));
    }
    let bytes: usize = headers.iter().map(|(n, v)| n.len() + v.len()).sum();
    if bytes > MAX_STORED_HEADER_BYTES {
        return Err(format!(
            "the headers hold {bytes} bytes, at most {MAX_STORED_HEADER_BYTES} are stored"
        ));
    }
    Ok(())
}

/// Whether a response header may be stored as it is.
pub fn header_fits(name: &str, value: &str) -> bool {
    is_header_name(name)
        && value.len() <= MAX_HEADER_VALUE
        && !value.bytes().any(|b| (b < 0x20 && b != b'\t') || b == 0x7f)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_largest_frame_holds_the_largest_stored_response() {
        // Every header value escaped to twice its length, plus name and quotes.
        let headers = MAX_HEADERS * (MAX_HEADER_NAME + 2 * MAX_HEADER_VALUE + 8);
        let scope = 4 * 255 * 6 + 1024;
        assert!(MAX_STORED_BODY + headers + scope < MAX_FRAME);
    }

    #[test]
    fn headers_that_fit_and_that_do_not() {
        assert!(header_fits("content-type", "application/json"));
        assert!(header_fits("link", "<a>;\trel=x"));
        assert!(!header_fits("", "x"));
        assert!(!header_fits("a b", "x"));
        assert!(!header_fits(&"n".repeat(MAX_HEADER_NAME + 1), "x"));
        assert!(!header_fits("x", &"v".repeat(MAX_HEADER_VALUE + 1)));
        assert!(!header_fits("x", "a\u{1}b"));
        assert!(!header_fits("x", "a\u{7f}b"));
    }

    #[test]
    fn a_response_fits_by_status_count_each_header_and_their_total() {
        let header = |i: usize| (format!("x-{i}"), "v".repeat(MAX_HEADER_VALUE - 8));
        assert!(response_fits(201, &[("etag".into(), "\"1\"".into())]).is_ok());
        assert!(response_fits(99, &[]).is_err());
        assert!(response_fits(600, &[]).is_err());
        let many: Vec<_> = (0..=MAX_HEADERS)
            .map(|i| (format!("x-{i}"), "v".into()))
            .collect();
        assert!(response_fits(200, &many).is_err());
        let fits = MAX_STORED_HEADER_BYTES / MAX_HEADER_VALUE;
        assert!(response_fits(200, &(0..fits).map(header).collect::<Vec<_>>()).is_ok());
        let over: Vec<_> = (0..fits + 1).map(header).collect();
        assert!(over.len() <= MAX_HEADERS);
        assert!(response_fits(200, &over).unwrap_err().contains("at most 262144"));
    }
}
