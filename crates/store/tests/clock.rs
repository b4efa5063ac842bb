//! Store replicas sharing one PostgreSQL database judge leases by one clock,
//! the database server's, however their own clocks disagree: a replica whose
//! clock runs 5 s ahead (libfaketime), or has just stepped, must not take
//! over a claim whose lease the database's clock says is still running.

use idemgate_core::config::OnUnknown;
use idemgate_core::protocol::{ClaimReply, ClaimRequest};
use idemgate_testkit::report::verdict;

use crate::support::*;

/// Debian's libfaketime (package `faketime`).
fn libfaketime() -> String {
    let found = std::fs::read_dir("/usr/lib")
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.path().join("faketime/libfaketime.so.1"))
        .find(|p| p.exists());
    match found {
        Some(p) => p.display().to_string(),
        None => panic!("libfaketime not found: apt-get install faketime (scripts/setup.sh does)"),
    }
}

/// The time a store's HTTP server stamps on its answers (`date`), in seconds
/// since the Unix epoch: its process's own clock.
async fn date_of(store: &StoreProcess) -> i64 {
    let resp = client()
        .request(
            hyper::Request::get(store.url("/healthz"))
                .body(http_body_util::Full::new(bytes::Bytes::new()))
                .unwrap(),
        )
        .await
        .unwrap();
    let date = resp.headers()["date"].to_str().unwrap().to_string();
    let out = std::process::Command::new("date")
        .args(["-d", &date, "+%s"])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
}

async fn claim_on(store: &StoreProcess, req: &ClaimRequest) -> ClaimReply {
    claim_over_http(&client(), store, req).await.0
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_whose_clocks_disagree_judge_leases_by_the_databases_clock() {
    let _verdict = verdict(
        "time: replicas whose clocks differ",
        "two store replicas on one PostgreSQL database, a claim on each and its duplicate on the other while the lease runs, under both on_unknown modes",
        "one replica's clock 5 s ahead (faketime); leases judged by the database's clock",
    );
    let cluster = shared_cluster();
    let url = cluster.fresh_database().await;
    let on_time = StoreProcess::start(&url).await;
    let lib = libfaketime();
    let ahead = StoreProcess::start_with(&url, "warn", |cmd| {
        cmd.env("LD_PRELOAD", &lib)
            .env("FAKETIME", "+5s")
            .env("DONT_FAKE_MONOTONIC", "1");
    })
    .await;
    let skew = date_of(&ahead).await - date_of(&on_time).await;
    assert!(
        (4..=6).contains(&skew),
        "the replica's own clock is {skew} s off, not 5"
    );

    for on_unknown in [OnUnknown::Release, OnUnknown::Conflict] {
        let mut req = claim(&scope(&format!("k-skew-{on_unknown:?}")), Some(1));
        req.lease_ms = 3_000;
        req.on_unknown = on_unknown;
        assert!(matches!(claim_on(&on_time, &req).await, ClaimReply::Owned { .. }));
        // By the replica's own clock the lease ran out 2 s ago; by the
        // database's it has about 3 s to go.
        match claim_on(&ahead, &req).await {
            ClaimReply::InProgress { retry_after_ms } => {
                assert!(
                    (1..=3_000).contains(&retry_after_ms),
                    "{on_unknown:?}: {retry_after_ms}"
                )
            }
            other => panic!("{on_unknown:?}: a replica 5 s ahead answered {other:?} while the lease runs"),
        }
        // And the other way round: the replica ahead claims, the one on time
        // sees the same lease.
        let mut req = claim(&scope(&format!("k-skew-back-{on_unknown:?}")), Some(1));
        req.lease_ms = 3_000;
        req.on_unknown = on_unknown;
        assert!(matches!(claim_on(&ahead, &req).await, ClaimReply::Owned { .. }));
        match claim_on(&on_time, &req).await {
            ClaimReply::InProgress { retry_after_ms } => {
                assert!(
                    (1..=3_000).contains(&retry_after_ms),
                    "{on_unknown:?}: {retry_after_ms}"
                )
            }
            other => panic!("{on_unknown:?}: {other:?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_whose_clock_steps_mid_run_judges_leases_by_the_databases_clock_at_once() {
    let _verdict = verdict(
        "time: a replica's clock steps mid-run",
        "two store replicas on one PostgreSQL database; a claim on one, its duplicate on the other right after that one's clock stepped, under both on_unknown modes",
        "the replica's clock stepped +5 s and back (faketime, its offset read from a file at every call); leases judged by the database's clock, carried between readings by the monotonic clock",
    );
    let cluster = shared_cluster();
    let url = cluster.fresh_database().await;
    let dir = tempfile::tempdir().unwrap();
    let offset = dir.path().join("faketime");
    std::fs::write(&offset, "+0").unwrap();
    let on_time = StoreProcess::start(&url).await;
    let lib = libfaketime();
    let stepping = StoreProcess::start_with(&url, "warn", |cmd| {
        cmd.env("LD_PRELOAD", &lib)
            .env("FAKETIME_TIMESTAMP_FILE", &offset)
            .env("FAKETIME_NO_CACHE", "1")
            .env("DONT_FAKE_MONOTONIC", "1");
    })
    .await;

    for on_unknown in [OnUnknown::Release, OnUnknown::Conflict] {
        let mut req = claim(&scope(&format!("k-step-{on_unknown:?}")), Some(1));
        req.lease_ms = 3_000;
        req.on_unknown = on_unknown;
        assert!(matches!(claim_on(&on_time, &req).await, ClaimReply::Owned { .. }));
        std::fs::write(&offset, "+5s").unwrap();
        let skew = date_of(&stepping).await - date_of(&on_time).await;
        assert!((4..=6).contains(&skew), "the step did not take: {skew} s");
        // Before the replica reads the database's clock again: by its own
        // clock the lease ran out 2 s ago.
        match claim_on(&stepping, &req).await {
            ClaimReply::InProgress { retry_after_ms } => {
                assert!(
                    (1..=3_000).contains(&retry_after_ms),
                    "{on_unknown:?}: {retry_after_ms}"
                )
            }
            other => panic!("{on_unknown:?}: a replica whose clock just stepped answered {other:?}"),
        }
        std::fs::write(&offset, "+0").unwrap();
    }
}
