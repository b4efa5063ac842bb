//! `kill -9` the real binary between claim and complete, restart it on the
//! same database: the claim is still there and turns unknown after its lease;
//! a completed record survives.

use std::time::Duration;

use idemgate_core::protocol::{decode_frame, encode_frame, ClaimReply, ClaimRequest};

use crate::support::*;

async fn claim_over_http(c: &HttpClient, p: &StoreProcess, req: &ClaimRequest) -> (ClaimReply, Vec<u8>) {
    let r = request(c, "POST", &p.url("/v1/claim"), Some(API), encode_frame(req, b"")).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    let (reply, bytes) = decode_frame::<ClaimReply>(&r.body).unwrap();
    (reply, bytes.to_vec())
}

async fn crash_and_restart(url: &str) {
    let c = client();
    let mut p = StoreProcess::start(url).await;
    let open = scope("k-crash-open");
    let mut open_req = claim(&open, Some(1));
    open_req.lease_ms = 1_500;
    let (reply, _) = claim_over_http(&c, &p, &open_req).await;
    assert!(matches!(reply, ClaimReply::Owned { .. }), "{reply:?}");

    let done = scope("k-crash-done");
    let (reply, _) = claim_over_http(&c, &p, &claim(&done, Some(1))).await;
    let ClaimReply::Owned { fence } = reply else {
        panic!("{reply:?}")
    };
    let r = request(
        &c,
        "POST",
        &p.url("/v1/complete"),
        Some(API),
        encode_frame(&complete(&done, fence, 201), b"kept"),
    )
    .await;
    assert_eq!(r.status, 200);

    p.kill9();
    let p = StoreProcess::start(url).await;

    let (reply, body) = claim_over_http(&c, &p, &claim(&done, Some(1))).await;
    assert!(
        matches!(reply, ClaimReply::Replay { status: 201, .. }),
        "{reply:?}"
    );
    assert_eq!(body, b"kept");

    let (reply, _) = claim_over_http(&c, &p, &open_req).await;
    assert!(
        matches!(reply, ClaimReply::InProgress { .. } | ClaimReply::Unknown),
        "the claim survived: {reply:?}"
    );
    eventually(
        "the crashed owner's record to turn unknown",
        Duration::from_secs(15),
        || {
            let (c, p, req) = (&c, &p, &open_req);
            async move { claim_over_http(c, p, req).await.0 == ClaimReply::Unknown }
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_store_keeps_its_records_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    crash_and_restart(&format!("sqlite://{}", dir.path().join("store.db").display())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_store_keeps_its_records_on_postgres() {
    let cluster = pg::PgCluster::start();
    crash_and_restart(&cluster.fresh_database().await).await;
}
