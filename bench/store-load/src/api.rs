//! The store's HTTP API in-process, and the claim+complete, `/v1/batch` and replay measurements through it.

use std::sync::Arc;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use idemgate_core::protocol::{
    decode_frame, encode_batch, encode_frame, split_batch, BatchReply, ClaimReply, CLAIM_PATH, COMPLETE_PATH,
};
use idemgate_core::scope::Scope;
use idemgate_store::backend::Backend;
use idemgate_store::sweeper::SweepSettings;
use idemgate_store::{AppState, Clock, Store};

use crate::{completion, expect_replay, measure, measure_n, request, scope, Args, Report};

pub(crate) type Post = Arc<
    dyn Fn(
            &'static str,
            Vec<u8>,
        ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<Bytes, String>> + Send>>
        + Send
        + Sync,
>;

/// Starts the HTTP API on a free port and returns a client posting to it.
pub(crate) async fn serve(backend: Arc<dyn Backend>) -> Result<Post, String> {
    let store = Store::new(backend, Clock::System);
    let sweep = SweepSettings {
        enabled: false,
        ..SweepSettings::default()
    };
    let settings = idemgate_store::Settings {
        max_body_bytes: 1 << 20,
        sweep,
        ..idemgate_store::Settings::new("bench-api", "bench-admin")
    };
    let state = AppState::new(store, settings);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| e.to_string())?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    tokio::spawn(idemgate_store::run(listener, None, state, std::future::pending()));
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    Ok(Arc::new(move |path: &'static str, body: Vec<u8>| {
        let client = client.clone();
        Box::pin(async move {
            let req = hyper::Request::post(format!("http://{addr}{path}"))
                .header("authorization", "Bearer bench-api")
                .body(Full::new(Bytes::from(body)))
                .map_err(|e| e.to_string())?;
            let resp = client.request(req).await.map_err(|e| e.to_string())?;
            resp.into_body()
                .collect()
                .await
                .map(|b| b.to_bytes())
                .map_err(|e| e.to_string())
        })
    }))
}

pub(crate) async fn http(post: Post, args: &Args) -> Result<Report, String> {
    measure(args.concurrency, args.seconds, move |w, i| {
        let post = post.clone();
        async move {
            let s = scope("http", w, i)?;
            let body = post("/v1/claim", encode_frame(&request(s.clone()), b"")).await?;
            let (reply, _) = decode_frame::<ClaimReply>(&body).map_err(|e| e.to_string())?;
            let ClaimReply::Owned { fence } = reply else {
                return Err(format!("unexpected {reply:?}"));
            };
            let c = completion(s, fence);
            post("/v1/complete", encode_frame(&c, b"{\"ok\":true}")).await?;
            Ok(())
        }
    })
    .await
}

/// The replies of a `/v1/batch` answer, each with its status.
fn batch_replies(body: &[u8]) -> Result<Vec<(u16, Vec<u8>)>, String> {
    let (meta, bytes) = decode_frame::<BatchReply>(body).map_err(|e| e.to_string())?;
    let parts = split_batch(meta.results.iter().map(|r| r.len), bytes).map_err(|e| e.to_string())?;
    Ok(meta
        .results
        .iter()
        .zip(parts)
        .map(|(r, b)| (r.status, b.to_vec()))
        .collect())
}

/// N new keys per iteration: their claims in one `/v1/batch`, then their
/// completes in another (what a busy filter worker sends).
pub(crate) async fn http_batch(post: Post, args: &Args) -> Result<Report, String> {
    let n = args.batch;
    measure_n(args.concurrency, args.seconds, n, move |w, i| {
        let post = post.clone();
        async move {
            let scopes = (0..n as u64)
                .map(|j| scope("batch", w, i * n as u64 + j))
                .collect::<Result<Vec<_>, _>>()?;
            let frames: Vec<Vec<u8>> = scopes
                .iter()
                .map(|s| encode_frame(&request(s.clone()), b""))
                .collect();
            let calls: Vec<(&str, &[u8])> = frames.iter().map(|f| (CLAIM_PATH, f.as_slice())).collect();
            let replies = batch_replies(&post("/v1/batch", encode_batch(&calls)).await?)?;
            let mut frames = Vec::with_capacity(n);
            for (s, (status, frame)) in scopes.into_iter().zip(replies) {
                let (reply, _) = decode_frame::<ClaimReply>(&frame).map_err(|e| format!("{status}: {e}"))?;
                let ClaimReply::Owned { fence } = reply else {
                    return Err(format!("unexpected {reply:?}"));
                };
                let c = completion(s, fence);
                frames.push(encode_frame(&c, b"{\"ok\":true}"));
            }
            let calls: Vec<(&str, &[u8])> = frames.iter().map(|f| (COMPLETE_PATH, f.as_slice())).collect();
            let replies = batch_replies(&post("/v1/batch", encode_batch(&calls)).await?)?;
            match replies.iter().find(|(status, _)| *status != 200) {
                Some((status, body)) => Err(format!("complete: {status} {}", String::from_utf8_lossy(body))),
                None => Ok(()),
            }
        }
    })
    .await
}

pub(crate) async fn http_replay(post: Post, keys: Arc<Vec<Scope>>, args: &Args) -> Result<Report, String> {
    measure(args.concurrency, args.seconds, move |w, _| {
        let post = post.clone();
        let keys = keys.clone();
        async move {
            let s = keys.get(w).cloned().ok_or("no key")?;
            let body = post("/v1/claim", encode_frame(&request(s), b"")).await?;
            let (reply, _) = decode_frame::<ClaimReply>(&body).map_err(|e| e.to_string())?;
            expect_replay(&reply)
        }
    })
    .await
}
