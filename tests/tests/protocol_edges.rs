//! HTTP/2 and chunked bodies through real Envoy: clients that speak h2c
//! (prior knowledge) and send request trailers, and request bodies with no
//! length that outgrow the policy's limit.

// Test support: failing loudly is how a test reports.
#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use e2e::report::verdict;
use e2e::{fresh_key, Harness};
use http_body_util::BodyExt;
use hyper::body::{Body, Frame};
use hyper::HeaderMap;
use hyper_util::rt::{TokioExecutor, TokioIo};

/// A request body of `data` chunks with no length announced, then
/// `trailers` if any.
struct Streamed {
    data: Vec<Bytes>,
    trailers: Option<HeaderMap>,
}

impl Body for Streamed {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if !self.data.is_empty() {
            return Poll::Ready(Some(Ok(Frame::data(self.data.remove(0)))));
        }
        Poll::Ready(self.trailers.take().map(|t| Ok(Frame::trailers(t))))
    }
}

struct Answer {
    status: u16,
    headers: HeaderMap,
    body: Bytes,
}

/// One request over a fresh connection: HTTP/2 with prior knowledge (h2c)
/// or HTTP/1.1 (the body then goes chunked).
async fn send(h: &Harness, h2: bool, path: &str, key: &str, body: Streamed) -> Answer {
    let io = TokioIo::new(
        tokio::net::TcpStream::connect(("127.0.0.1", h.port))
            .await
            .unwrap(),
    );
    let req = hyper::Request::post(format!("http://127.0.0.1:{}{path}", h.port))
        .header("content-type", "application/json")
        .header("x-tenant-id", "tenant-a")
        .header("x-user-id", "alice")
        .header("idempotency-key", key)
        .body(body)
        .unwrap();
    let resp = if h2 {
        let (mut sender, conn) = hyper::client::conn::http2::handshake(TokioExecutor::new(), io)
            .await
            .unwrap();
        tokio::spawn(conn);
        sender.send_request(req).await.unwrap()
    } else {
        let (mut sender, conn) = hyper::client::conn::http1::handshake(io).await.unwrap();
        tokio::spawn(conn);
        sender.send_request(req).await.unwrap()
    };
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    Answer {
        status,
        headers,
        body,
    }
}

fn chunks(parts: &[&str]) -> Vec<Bytes> {
    parts
        .iter()
        .map(|p| Bytes::copy_from_slice(p.as_bytes()))
        .collect()
}

fn trailers() -> HeaderMap {
    let mut t = HeaderMap::new();
    t.insert("x-checksum", "c0ffee".parse().unwrap());
    t
}

#[tokio::test(flavor = "multi_thread")]
async fn h2c_requests_with_trailers_execute_once_and_replay() {
    let _verdict = verdict(
        "protocol edge: h2c with request trailers",
        "HTTP/2 prior-knowledge clients, chunked bodies with trailers, on a streaming and a detached route",
        "—",
    );
    let h = Harness::start().await;
    for path in ["/pay", "/detached/pay"] {
        let key = fresh_key("h2c");
        let body = || Streamed {
            data: chunks(&[r#"{"amount": "#, "100}"]),
            trailers: Some(trailers()),
        };
        let first = send(&h, true, path, &key, body()).await;
        assert_eq!(first.status, 201, "{path}: {:?}", first.body);
        let again = send(&h, true, path, &key, body()).await;
        assert_eq!(again.status, 201, "{path}");
        assert_eq!(again.headers["idempotent-replayed"], "true", "{path}");
        assert_eq!(again.body, first.body, "{path}");
        // The same request over HTTP/1.1 is the same request.
        let h1 = send(&h, false, path, &key, body()).await;
        assert_eq!(h1.headers["idempotent-replayed"], "true", "{path}");
        // Another body is another request, whatever the protocol.
        let other = send(
            &h,
            true,
            path,
            &key,
            Streamed {
                data: chunks(&[r#"{"amount": 999}"#]),
                trailers: Some(trailers()),
            },
        )
        .await;
        assert_eq!(other.status, 422, "{path}");
        assert_eq!(h.upstream.executions(&key), 1, "{path}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_body_with_no_length_over_the_limit_is_refused_and_burns_nothing() {
    let _verdict = verdict(
        "protocol edge: a body with no length over the limit",
        "chunked HTTP/1.1 and HTTP/2 bodies that outgrow the policy's 64-byte limit",
        "—",
    );
    let h = Harness::start().await;
    // The policy of /small takes at most 64 bytes of request body.
    let pad = "x".repeat(40);
    for h2 in [false, true] {
        let key = fresh_key("chunked");
        let big = send(
            &h,
            h2,
            "/small",
            &key,
            Streamed {
                data: chunks(&[r#"{"pad": ""#, &pad, &pad, r#""}"#]),
                trailers: None,
            },
        )
        .await;
        assert_eq!(big.status, 413, "h2 {h2}: {:?}", big.body);
        assert_eq!(big.headers["content-type"], "application/problem+json");
        assert_eq!(h.upstream.executions(&key), 0);
        // The key was not taken: a request that fits is a first request.
        let small = send(
            &h,
            h2,
            "/small",
            &key,
            Streamed {
                data: chunks(&["{}"]),
                trailers: None,
            },
        )
        .await;
        assert_eq!(small.status, 201, "h2 {h2}: {:?}", small.body);
        assert!(small.headers.get("idempotent-replayed").is_none());
        assert_eq!(h.upstream.executions(&key), 1);
    }
}

/// A response larger than Envoy's buffer (1 MiB by default) and than the
/// policy keeps (512 KiB by default) streams to the client whole; the
/// outcome is recorded without its body, so a retry learns it succeeded.
#[tokio::test(flavor = "multi_thread")]
async fn a_response_larger_than_envoys_buffer_streams_whole_and_is_recorded() {
    let _verdict = verdict(
        "protocol edge: a response larger than Envoy's buffer",
        "responses of 1.2 and 3 MB, with and without a length",
        "—",
    );
    let h = Harness::start().await;
    for size in [1_200_000usize, 3_000_000] {
        let key = fresh_key("large");
        let first = e2e::send(
            h.post("/pay", Some(&key), "{}")
                .header("x-test-body-size", size.to_string()),
        )
        .await;
        assert_eq!(
            first.status,
            201,
            "{size}: {:?}",
            String::from_utf8_lossy(&first.body[..first.body.len().min(200)])
        );
        assert_eq!(first.body.len(), size);
        let settled = e2e::eventually(
            "the outcome to be recorded",
            std::time::Duration::from_secs(10),
            || async {
                let again = e2e::send(h.post("/pay", Some(&key), "{}")).await;
                again.problem().as_deref() == Some("result-unavailable")
                    && again.json()["original_status"] == 201
            },
        );
        settled.await;
        assert_eq!(h.upstream.executions(&key), 1);
    }
}
