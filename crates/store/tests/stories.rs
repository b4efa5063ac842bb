//! The story suite: written once, run against every backend. Time is a
//! manual clock, so leases and expiry are driven by values, not sleeps.

use std::sync::Arc;
use std::time::Duration;

use idemgate_core::config::{AfterExpiry, OnUnknown};
use idemgate_core::protocol::{AbandonRequest, Attempt, ClaimReply, FenceReply};
use idemgate_core::record::{Standing, State, Transition};
use idemgate_core::scope::Namespace;
use idemgate_core::scope::Scope;
use idemgate_store::backend::{
    Action, Actor, Backend, KeyHistory, Listing, Lookup, OpenRecords, Resolution, StoreError, SweepPolicy,
};
use idemgate_store::{Clock, Store};

use crate::support::*;

const T0: i64 = 1_800_000_000_000;

struct Ctx {
    store: Store,
    clock: Clock,
}

impl Ctx {
    fn new(backend: Arc<dyn Backend>) -> Ctx {
        let clock = Clock::manual(T0);
        Ctx {
            store: Store::new(backend, clock.clone()),
            clock,
        }
    }
    fn backend(&self) -> &dyn Backend {
        self.store.backend.as_ref()
    }
    fn now(&self) -> i64 {
        self.clock.now()
    }
    async fn owned(&self, req: &idemgate_core::protocol::ClaimRequest) -> u64 {
        match self.store.claim(req).await.unwrap().reply {
            ClaimReply::Owned { fence } => fence,
            other => panic!("expected Owned, got {other:?}"),
        }
    }
    async fn reply(&self, req: &idemgate_core::protocol::ClaimRequest) -> ClaimReply {
        self.store.claim(req).await.unwrap().reply
    }
    async fn sweep(&self, retention_ms: u64) -> idemgate_store::backend::SweepReport {
        self.sweep_batch(retention_ms, 100).await
    }
    async fn sweep_batch(&self, retention_ms: u64, batch: u32) -> idemgate_store::backend::SweepReport {
        self.backend()
            .sweep(
                self.now(),
                &SweepPolicy {
                    batch,
                    audit_retention_ms: retention_ms,
                },
            )
            .await
            .unwrap()
    }
    /// The newest generation of `key` (tenant `acme`), current or ended.
    async fn newest(&self, key: &str) -> Option<idemgate_store::backend::RecordInfo> {
        let lookup = Lookup {
            tenant: "acme".into(),
            key: key.into(),
            ..Default::default()
        };
        self.backend()
            .lookup(&lookup, 1)
            .await
            .unwrap()
            .records
            .into_iter()
            .next()
    }
}

async fn claim_complete_replay(b: Arc<dyn Backend>) {
    let cx = Ctx::new(b);
    let s = scope("k-replay");
    let fence = cx.owned(&claim(&s, Some(1))).await;
    assert_eq!(
        cx.store
            .complete(&complete(&s, fence, 201), b"{\"id\":1}")
            .await
            .unwrap(),
        FenceReply::Done
    );
    let completed_at = cx.now();
    cx.clock.advance(5);
    let out = cx.store.claim(&claim(&s, Some(1))).await.unwrap();
    assert_eq!(
        out.reply,
        ClaimReply::Replay {
            status: 201,
            headers: vec![("content-type".into(), "application/json".into())],
            completed_at
        }
    );
    assert_eq!(out.body, b"{\"id\":1}");
    cx.store.claim(&claim(&s, Some(1))).await.unwrap();
    let rec = &cx
        .backend()
        .lookup(
            &Lookup {
                tenant: "acme".into(),
                key: "k-replay".into(),
                ..Default::default()
            },
            10,
        )
        .await
        .unwrap()
        .records[0];
    assert_eq!(rec.replay_count, 2);
    assert_eq!(rec.state, Standing::In(State::Completed));
    assert_eq!(rec.body_len, Some(8));
    // Completing twice is refused: the record is no longer open.
    assert_eq!(
        cx.store.complete(&complete(&s, fence, 500), b"x").await.unwrap(),
        FenceReply::Stale
    );
}

/// Replays are counted off the request path; a lookup still sees every one,
/// and a key claimed afresh counts its own replays only.
async fn replay_counts_reach_the_record(b: Arc<dyn Backend>) {
    let cx = Ctx::new(b);
    let s = scope("k-count");
    let f = cx.owned(&claim(&s, Some(1))).await;
    cx.store.complete(&complete(&s, f, 201), b"v1").await.unwrap();
    let tasks: Vec<_> = (0..40)
        .map(|_| {
            let (store, req) = (cx.store.clone(), claim(&s, Some(1)));
            tokio::spawn(async move { store.claim(&req).await.unwrap() })
        })
        .collect();
    for t in tasks {
        let out = t.await.unwrap();
        assert!(matches!(out.reply, ClaimReply::Replay { status: 201, .. }));
        assert_eq!(out.body, b"v1");
    }
    assert_eq!(cx.newest("k-count").await.unwrap().replay_count, 40);
    // Replays of the old record, then the key is claimed afresh after expiry.
    cx.store.claim(&claim(&s, Some(1))).await.unwrap();
    cx.clock.advance(10_000);
    let mut new = claim(&s, Some(1));
    new.after_expiry = AfterExpiry::New;
    let f2 = cx.owned(&new).await;
    cx.store.complete(&complete(&s, f2, 200), b"v2").await.unwrap();
    let out = cx.store.claim(&claim(&s, Some(1))).await.unwrap();
    assert_eq!(out.body, b"v2");
    assert_eq!(cx.newest("k-count").await.unwrap().replay_count, 1);
}

async fn fingerprint_mismatch_in_every_state(b: Arc<dyn Backend>) {
    let cx = Ctx::new(b);
    let s = scope("k-mismatch");
    let fence = cx.owned(&claim(&s, Some(1))).await;
    assert_eq!(
        cx.reply(&claim(&s, Some(2))).await,
        ClaimReply::Mismatch,
        "in progress"
    );
    cx.clock.advance(2_000);
    assert_eq!(
        cx.reply(&claim(&s, Some(2))).await,
        ClaimReply::Mismatch,
        "lease ran out"
    );
    assert_eq!(cx.reply(&claim(&s, Some(1))).await, ClaimReply::Unknown);
    assert_eq!(
        cx.reply(&claim(&s, Some(2))).await,
        ClaimReply::Mismatch,
        "unknown"
    );
    assert_eq!(
        cx.store.complete(&complete(&s, fence, 200), b"ok").await.unwrap(),
        FenceReply::Done
    );
    assert_eq!(
        cx.reply(&claim(&s, Some(2))).await,
        ClaimReply::Mismatch,
        "completed"
    );
    cx.clock.advance(20_000);
    cx.sweep(u64::MAX / 4).await;
    assert_eq!(
        cx.reply(&claim(&s, Some(2))).await,
        ClaimReply::Mismatch,
        "archived"
    );
    // No fingerprint on either side cannot detect reuse.
    assert!(matches!(
        cx.reply(&claim(&s, None)).await,
        ClaimReply::Expired { .. }
    ));
}

async fn in_progress_answers_the_remaining_lease(b: Arc<dyn Backend>) {
    let cx = Ctx::new(b);
    let s = scope("k-inflight");
    cx.owned(&claim(&s, Some(1))).await;
    cx.clock.advance(300);
    assert_eq!(
        cx.reply(&claim(&s, Some(1))).await,
        ClaimReply::InProgress { retry_after_ms: 700 }
    );
}

async fn waiting_claim_returns_the_result(b: Arc<dyn Backend>) {
    let cx = Ctx::new(b);
    let s = scope("k-wait");
    let fence = cx.owned(&claim(&s, Some(1))).await;
    let mut waiting = claim(&s, Some(1));
    waiting.wait_ms = 10_000;
    let store = cx.store.clone();
    let waiter = tokio::spawn(async move { store.claim(&waiting).await.unwrap() });
    // Let the waiter look once and start waiting, then finish the record.
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!waiter.is_finished());
    assert_eq!(
        cx.store
            .complete(&complete(&s, fence, 202), b"done")
            .await
            .unwrap(),
        FenceReply::Done
    );
    let out = tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .unwrap()
        .unwrap();
    assert!(
        matches!(out.reply, ClaimReply::Replay { status: 202, .. }),
        "{:?}",
        out.reply
    );
    assert_eq!(out.body, b"done");

    // A wait that runs out answers in progress.
    let s2 = scope("k-wait-timeout");
    cx.owned(&claim(&s2, Some(1))).await;
    let mut short = claim(&s2, Some(1));
    short.wait_ms = 150;
    let started = std::time::Instant::now();
    assert!(matches!(cx.reply(&short).await, ClaimReply::InProgress { .. }));
    assert!(started.elapsed() >= Duration::from_millis(150));
}

async fn lease_expiry_turns_the_record_unknown(b: Arc<dyn Backend>) {
    let cx = Ctx::new(b);
    // On the claim path...
    let s = scope("k-lease-claim");
    cx.owned(&claim(&s, Some(1))).await;
    cx.clock.advance(1_000);
    assert_eq!(cx.reply(&claim(&s, Some(1))).await, ClaimReply::Unknown);
    // ...and by the sweeper.
    let s2 = scope("k-lease-sweep");
    cx.owned(&claim(&s2, Some(1))).await;
    cx.clock.advance(1_000);
    let report = cx.sweep(u64::MAX / 4).await;
    assert_eq!(report.marked_unknown, 1);
    let unknown = cx.backend().list(Listing::Unknown, cx.now(), 10).await.unwrap();
    assert_eq!(unknown.len(), 2);
    assert_eq!(cx.reply(&claim(&s2, Some(1))).await, ClaimReply::Unknown);
    // expires_at = when it became unknown + ttl.
    let rec = &cx
        .backend()
        .lookup(
            &Lookup {
                tenant: "acme".into(),
                key: "k-lease-sweep".into(),
                ..Default::default()
            },
            1,
        )
        .await
        .unwrap()
        .records[0];
    assert_eq!(rec.expires_at, Some(cx.now() + 10_000));
    // With on_unknown: release the key is claimed afresh instead.
    let mut again = claim(&s, Some(1));
    again.on_unknown = OnUnknown::Release;
    cx.owned(&again).await;
}

async fn late_completion_with_the_current_token_resolves_unknown(b: Arc<dyn Backend>) {
    let cx = Ctx::new(b);
    let s = scope("k-late");
    let fence = cx.owned(&claim(&s, Some(1))).await;
    cx.clock.advance(5_000);
    cx.sweep(u64::MAX / 4).await;
    assert_eq!(cx.reply(&claim(&s, Some(1))).await, ClaimReply::Unknown);
    assert_eq!(
        cx.store
            .complete(&complete(&s, fence, 200), b"late")
            .await
            .unwrap(),
        FenceReply::Done
    );
    let out = cx.store.claim(&claim(&s, Some(1))).await.unwrap();
    assert!(matches!(out.reply, ClaimReply::Replay { status: 200, .. }));
    assert_eq!(out.body, b"late");

    // Once an unknown record is archived, the current fence still records
    // what happened (without the body: it never replays); nothing else
    // changes an archived record.
    let s2 = scope("k-too-late");
    let f2 = cx.owned(&claim(&s2, Some(1))).await;
    cx.store
        .mark_unknown(&crate::support::fence(&s2, f2))
        .await
        .unwrap();
    cx.clock.advance(10_000);
    assert!(cx.sweep(u64::MAX / 4).await.archived >= 1);
    assert_eq!(
        cx.store.release(&crate::support::fence(&s2, f2)).await.unwrap(),
        FenceReply::Stale
    );
    assert_eq!(
        cx.store.complete(&complete(&s2, f2, 200), b"x").await.unwrap(),
        FenceReply::Done
    );
    assert!(matches!(
        cx.store.claim(&claim(&s2, Some(1))).await.unwrap().reply,
        ClaimReply::Expired { .. }
    ));
    assert_eq!(
        cx.store.release(&crate::support::fence(&s2, f2)).await.unwrap(),
        FenceReply::Stale
    );
    assert!(!cx
        .backend()
        .resolve(&s2, &by(Action::Release), None, cx.now())
        .await
        .unwrap());
}

/// A duplicate in the lease's last millisecond waits; one at the lease's end
/// finds it run out, under both `on_unknown` modes, on the claim path and
/// for the sweeper alike; the owner's completion after a takeover is stale.
async fn a_lease_ends_at_its_last_millisecond(b: Arc<dyn Backend>) {
    let cx = Ctx::new(b);
    for on_unknown in [OnUnknown::Conflict, OnUnknown::Release] {
        let s = scope(&format!("k-edge-{on_unknown:?}"));
        let mut req = claim(&s, Some(1));
        req.on_unknown = on_unknown;
        let first = cx.owned(&req).await;
        cx.clock.advance(999);
        assert_eq!(cx.reply(&req).await, ClaimReply::InProgress { retry_after_ms: 1 });
        let early = cx.sweep(u64::MAX / 4).await;
        assert_eq!((early.marked_unknown, early.released), (0, 0));
        cx.clock.advance(1);
        match on_unknown {
            OnUnknown::Conflict => assert_eq!(cx.reply(&req).await, ClaimReply::Unknown),
            OnUnknown::Release => {
                let taken = cx.owned(&req).await;
                assert!(taken > first);
                assert_eq!(
                    cx.store
                        .complete(&complete(&s, first, 201), b"late")
                        .await
                        .unwrap(),
                    FenceReply::Stale
                );
                assert_eq!(
                    cx.store.complete(&complete(&s, taken, 201), b"ok").await.unwrap(),
                    FenceReply::Done
                );
                assert!(matches!(
                    cx.reply(&req).await,
                    ClaimReply::Replay { status: 201, .. }
                ));
            }
        }
    }
    // The sweeper at the same edge.
    let s = scope("k-edge-sweep");
    cx.owned(&claim(&s, Some(1))).await;
    cx.clock.advance(999);
    assert_eq!(cx.sweep(u64::MAX / 4).await.marked_unknown, 0);
    cx.clock.advance(1);
    assert_eq!(cx.sweep(u64::MAX / 4).await.marked_unknown, 1);
}

async fn a_superseded_token_is_refused(b: Arc<dyn Backend>) {
    let cx = Ctx::new(b);
    let s = scope("k-fence");
    let mut req = claim(&s, Some(1));
    req.on_unknown = OnUnknown::Release;
    let old = cx.owned(&req).await;
    cx.clock.advance(1_000);
    let new = cx.owned(&req).await;
    assert!(new > old, "fences come from one monotonic sequence");
    assert_eq!(
        cx.store.complete(&complete(&s, old, 200), b"old").await.unwrap(),
        FenceReply::Stale
    );
    assert_eq!(
        cx.store.release(&fence(&s, old)).await.unwrap(),
        FenceReply::Stale
    );
    assert_eq!(
        cx.store.mark_unknown(&fence(&s, old)).await.unwrap(),
        FenceReply::Stale
    );
    // Released then reclaimed: the first owner's token is dead too.
    assert_eq!(cx.store.release(&fence(&s, new)).await.unwrap(), FenceReply::Done);
    let third = cx.owned(&req).await;
    assert!(third > new);
    assert_eq!(
        cx.store
            .complete(&complete(&s, new, 200), b"stale")
            .await
            .unwrap(),
        FenceReply::Stale
    );
    assert_eq!(
        cx.store
            .complete(&complete(&s, third, 200), b"fresh")
            .await
            .unwrap(),
        FenceReply::Done
    );
    // A fence for a record that does not exist is stale.
    assert_eq!(
        cx.store
            .complete(&complete(&scope("k-none"), 1, 200), b"")
            .await
            .unwrap(),
        FenceReply::Stale
    );
}

async fn release_frees_the_key(b: Arc<dyn Backend>) {
    let cx = Ctx::new(b);
    let s = scope("k-release");
    let f = cx.owned(&claim(&s, Some(1))).await;
    assert_eq!(cx.store.release(&fence(&s, f)).await.unwrap(), FenceReply::Done);
    assert!(cx
        .backend()
        .lookup(
            &Lookup {
                tenant: "acme".into(),
                key: "k-release".into(),
                ..Default::default()
            },
            1
        )
        .await
        .unwrap()
        .records
        .iter()
        .all(|r| r.ended_at.is_some() && r.state == Standing::EndedBy(Transition::Released)));
    // Even with another fingerprint: the released request never happened.
    cx.owned(&claim(&s, Some(2))).await;
}

async fn mark_unknown_and_result_unavailable(b: Arc<dyn Backend>) {
    let cx = Ctx::new(b);
    let s = scope("k-mark");
    let f = cx.owned(&claim(&s, Some(1))).await;
    assert_eq!(
        cx.store.mark_unknown(&fence(&s, f)).await.unwrap(),
        FenceReply::Done
    );
    assert_eq!(cx.reply(&claim(&s, Some(1))).await, ClaimReply::Unknown);

    let s2 = scope("k-big");
    let f2 = cx.owned(&claim(&s2, Some(1))).await;
    let mut c = complete(&s2, f2, 200);
    c.body_stored = false;
    assert_eq!(cx.store.complete(&c, b"").await.unwrap(), FenceReply::Done);
    assert_eq!(
        cx.reply(&claim(&s2, Some(1))).await,
        ClaimReply::ResultUnavailable {
            original_status: 200,
            completed_at: cx.now()
        }
    );
}

async fn expiry_archives_then_purges(b: Arc<dyn Backend>) {
    let cx = Ctx::new(b);
    let s = scope("k-expiry");
    let f = cx.owned(&claim(&s, Some(1))).await;
    cx.store.complete(&complete(&s, f, 201), b"body").await.unwrap();
    let completed_at = cx.now();
    cx.clock.advance(9_999);
    assert_eq!(cx.sweep(60_000).await.archived, 0);
    cx.clock.advance(1);
    // Expired even before the sweeper gets to it.
    assert_eq!(
        cx.reply(&claim(&s, Some(1))).await,
        ClaimReply::Expired {
            completed_at: Some(completed_at)
        }
    );
    assert_eq!(cx.sweep(60_000).await.archived, 1);
    let rec = cx.newest("k-expiry").await.unwrap();
    assert_eq!(rec.archived_at, Some(cx.now()));
    assert_eq!(rec.body_len, None, "body dropped");
    assert_eq!(rec.status, Some(201), "metadata kept");
    assert_eq!(rec.fingerprint, Some(fp(1).to_hex()));
    assert_eq!(
        cx.reply(&claim(&s, Some(1))).await,
        ClaimReply::Expired {
            completed_at: Some(completed_at)
        }
    );
    cx.clock.advance(59_999);
    assert_eq!(cx.sweep(60_000).await.purged, 0);
    cx.clock.advance(1);
    assert_eq!(cx.sweep(60_000).await.purged, 1);
    assert!(cx.newest("k-expiry").await.is_none());
    cx.owned(&claim(&s, Some(1))).await;
}

/// A sweeper behind on its work takes the oldest first in every phase: the
/// records that expired first, the archived ones past retention longest, the
/// leases that ran out first. The keys are named so that their order by key
/// is not their order by age.
async fn the_sweeper_takes_the_oldest_due_first(b: Arc<dyn Backend>) {
    let cx = Ctx::new(b);
    let keys: Vec<String> = (0..12).map(|i| format!("k-age-{}", (i * 7) % 12)).collect();
    let retention = 60_000;

    // Expiry: completed 10 ms apart, all expired; 4 archived per pass.
    for k in &keys {
        let s = scope(k);
        let f = cx.owned(&claim(&s, Some(1))).await;
        cx.store.complete(&complete(&s, f, 201), b"body").await.unwrap();
        cx.clock.advance(10);
    }
    cx.clock.advance(10_000);
    let mut last_archived = 0;
    for pass in 0..3 {
        assert_eq!(cx.sweep_batch(retention, 4).await.archived, 4);
        for (i, k) in keys.iter().enumerate() {
            let archived = cx.newest(k).await.and_then(|r| r.archived_at);
            assert_eq!(archived.is_some(), i < 4 * (pass + 1), "{k} after pass {pass}");
        }
        last_archived = cx.now();
        cx.clock.advance(100);
    }
    // Each record of a batch has its own event, once.
    for k in &keys {
        let h = history(&cx, k).await;
        assert_eq!(transitions(&h), ["claimed", "completed", "archived"], "{k}");
    }

    // Past retention, all of them: the first archived are purged first.
    cx.clock.advance(last_archived + retention as i64 - cx.now());
    assert_eq!(cx.sweep_batch(retention, 4).await.purged, 4);
    for (i, k) in keys.iter().enumerate() {
        assert_eq!(cx.newest(k).await.is_none(), i < 4, "{k}");
    }

    // Leases: claimed 10 ms apart, all run out; the 4 oldest turn unknown.
    for k in &keys {
        cx.owned(&claim(&scope(&format!("{k}-lease")), Some(1))).await;
        cx.clock.advance(10);
    }
    cx.clock.advance(1_000);
    assert_eq!(cx.sweep_batch(retention, 4).await.marked_unknown, 4);
    for (i, k) in keys.iter().enumerate() {
        let state = cx.newest(&format!("{k}-lease")).await.map(|r| r.state);
        let expected = if i < 4 { State::Unknown } else { State::InProgress };
        assert_eq!(state, Some(Standing::In(expected)), "{k}");
        let h = history(&cx, &format!("{k}-lease")).await;
        let expected: &[&str] = if i < 4 {
            &["claimed", "lease_expired"]
        } else {
            &["claimed"]
        };
        assert_eq!(transitions(&h), expected, "{k}");
    }
}

/// Ended generations past the retention are purged the oldest ended first,
/// whatever the order they were written in: here replicas whose clocks
/// disagree end them out of the order of their times.
async fn ended_generations_are_purged_the_oldest_first(b: Arc<dyn Backend>) {
    let cx = Ctx::new(b);
    let retention = 60_000;
    // The place of each key's release among the releases' times.
    let places = [5, 2, 7, 0, 3, 6, 1, 4];
    for (i, place) in places.iter().enumerate() {
        let s = scope(&format!("k-ended-{i}"));
        let f = cx.owned(&claim(&s, Some(1))).await;
        let released = cx.now() + 10 * place;
        assert_eq!(
            cx.backend().release(&fence(&s, f), released).await.unwrap(),
            FenceReply::Done
        );
    }
    cx.clock.advance(retention + 1_000);
    assert_eq!(cx.sweep_batch(retention as u64, 4).await.purged, 4);
    for (i, place) in places.iter().enumerate() {
        let key = format!("k-ended-{i}");
        let purged = history(&cx, &key).await.records.is_empty();
        assert_eq!(purged, *place < 4, "{key}");
    }
}

/// A batch larger than the SQLite writer's slice (100 records a phase) is
/// swept whole, each record once, and no more than the batch: 250 leases
/// run out, swept 240 at a time. On SQLite the batch is committed slice by
/// slice, so that requests queued meanwhile wait for one slice only.
async fn a_batch_larger_than_a_slice_is_swept_whole(b: Arc<dyn Backend>) {
    let cx = Ctx::new(b);
    for i in 0..250 {
        cx.owned(&claim(&scope(&format!("k-slice-{i}")), Some(1))).await;
    }
    cx.clock.advance(60_000);
    let commits = || cx.backend().writer_stages().map(|s| s.commits.get());
    let before = commits();
    assert_eq!(cx.sweep_batch(3_600_000, 240).await.marked_unknown, 240);
    if let (Some(before), Some(after)) = (before, commits()) {
        assert!(after - before >= 3, "{} commits for 240 records", after - before);
    }
    assert_eq!(cx.sweep_batch(3_600_000, 240).await.marked_unknown, 10);
    assert_eq!(cx.sweep_batch(3_600_000, 240).await.marked_unknown, 0);
    for i in [0, 99, 100, 239, 240, 249] {
        let h = history(&cx, &format!("k-slice-{i}")).await;
        assert_eq!(transitions(&h), ["claimed", "lease_expired"], "k-slice-{i}");
    }
}

async fn after_expiry_reject_or_new(b: Arc<dyn Backend>) {
    let cx = Ctx::new(b);
    let s = scope("k-after");
    let f = cx.owned(&claim(&s, Some(1))).await;
    cx.store.complete(&complete(&s, f, 200), b"v1").await.unwrap();
    cx.clock.advance(10_000);
    cx.sweep(u64::MAX / 4).await;
    assert!(matches!(
        cx.reply(&claim(&s, Some(1))).await,
        ClaimReply::Expired {
            completed_at: Some(_)
        }
    ));
    let mut new = claim(&s, Some(1));
    new.after_expiry = AfterExpiry::New;
    let f2 = cx.owned(&new).await;
    assert!(f2 > f);
    cx.store.complete(&complete(&s, f2, 200), b"v2").await.unwrap();
    let out = cx.store.claim(&claim(&s, Some(1))).await.unwrap();
    assert_eq!(out.body, b"v2");
}

async fn the_same_key_in_another_scope_is_another_record(b: Arc<dyn Backend>) {
    let cx = Ctx::new(b);
    let key = "k-shared";
    let base = scope_of("acme", "alice", "payments.create", Namespace::Client, key);
    let f = cx.owned(&claim(&base, Some(1))).await;
    cx.store
        .complete(&complete(&base, f, 200), b"acme")
        .await
        .unwrap();
    for other in [
        scope_of("globex", "alice", "payments.create", Namespace::Client, key),
        scope_of("acme", "bob", "payments.create", Namespace::Client, key),
        scope_of("acme", "alice", "refunds.create", Namespace::Client, key),
        scope_of("acme", "alice", "payments.create", Namespace::Server, key),
    ] {
        // A different fingerprint too: no 422 leaks across scopes.
        cx.owned(&claim(&other, Some(9))).await;
    }
    let all = cx
        .backend()
        .lookup(
            &Lookup {
                tenant: "acme".into(),
                key: key.into(),
                ..Default::default()
            },
            10,
        )
        .await
        .unwrap();
    assert_eq!(all.records.len(), 4);
    let one = cx
        .backend()
        .lookup(
            &Lookup {
                tenant: "acme".into(),
                key: key.into(),
                route: Some("refunds.create".into()),
                ..Default::default()
            },
            10,
        )
        .await
        .unwrap();
    assert_eq!(one.records.len(), 1);
    let out = cx.store.claim(&claim(&base, Some(1))).await.unwrap();
    assert_eq!(out.body, b"acme");
}

async fn operators_resolve_list_and_purge(b: Arc<dyn Backend>) {
    let cx = Ctx::new(b);
    let stuck = scope("k-stuck");
    let f = cx.owned(&claim(&stuck, Some(1))).await;
    cx.clock.advance(500);
    assert_eq!(
        cx.backend()
            .list(Listing::Stuck { older_than_ms: 400 }, cx.now(), 10)
            .await
            .unwrap()
            .len(),
        1
    );
    assert_eq!(
        cx.backend()
            .list(Listing::Stuck { older_than_ms: 600 }, cx.now(), 10)
            .await
            .unwrap()
            .len(),
        0
    );
    let how = by(Action::Complete {
        status: 200,
        headers: vec![("content-type".into(), "text/plain".into())],
        body: "by hand".into(),
    });
    let why = Some("the ledger shows the charge");
    assert!(cx.backend().resolve(&stuck, &how, why, cx.now()).await.unwrap());
    // The operator's answer wins over the old owner's late completion.
    assert_eq!(
        cx.store
            .complete(&complete(&stuck, f, 500), b"late")
            .await
            .unwrap(),
        FenceReply::Stale
    );
    let out = cx.store.claim(&claim(&stuck, Some(1))).await.unwrap();
    assert_eq!(out.body, b"by hand");
    assert!(
        !cx.backend()
            .resolve(&stuck, &by(Action::Release), None, cx.now())
            .await
            .unwrap(),
        "completed records are not open"
    );

    let unknown = scope("k-unknown");
    let f = cx.owned(&claim(&unknown, Some(1))).await;
    cx.store.mark_unknown(&fence(&unknown, f)).await.unwrap();
    assert!(cx
        .backend()
        .resolve(
            &unknown,
            &by(Action::Release),
            Some("never reached the bank"),
            cx.now()
        )
        .await
        .unwrap());
    cx.owned(&claim(&unknown, Some(1))).await;
    // Each reason is kept with its `resolved` event, in the history, and
    // the event names the operator who decided.
    let reasons = |h: KeyHistory| -> Vec<(String, Option<String>)> {
        h.events
            .into_iter()
            .filter(|e| e.transition == Transition::Resolved)
            .inspect(|e| assert_eq!(e.actor.as_str(), OPERATOR, "{e:?}"))
            .map(|e| (e.detail.unwrap_or_default(), e.reason))
            .collect()
    };
    let lookup = |s: &Scope| Lookup {
        tenant: s.tenant().into(),
        key: s.key().as_str().into(),
        ..Lookup::default()
    };
    let history = cx.backend().lookup(&lookup(&stuck), 10).await.unwrap();
    assert_eq!(
        reasons(history),
        [(
            "complete".to_string(),
            Some("the ledger shows the charge".to_string())
        )]
    );
    let history = cx.backend().lookup(&lookup(&unknown), 10).await.unwrap();
    assert_eq!(
        reasons(history),
        [("release".to_string(), Some("never reached the bank".to_string()))]
    );

    // An operator's purge ends whatever is current, named and with its reason.
    let purge = Resolution {
        action: Action::Purge,
        by: Actor::Named("bob@example.com".into()),
    };
    let why = Some("customer asked for erasure");
    assert!(cx.backend().resolve(&stuck, &purge, why, cx.now()).await.unwrap());
    assert!(!cx.backend().resolve(&stuck, &purge, why, cx.now()).await.unwrap());
    let history = cx.backend().lookup(&lookup(&stuck), 10).await.unwrap();
    let purged = history
        .events
        .iter()
        .find(|e| e.transition == Transition::Purged)
        .unwrap();
    assert_eq!(
        (purged.actor.as_str(), purged.reason.as_deref()),
        ("bob@example.com", why)
    );
}

/// The operator the stories' decisions name.
const OPERATOR: &str = "alice@example.com";

fn by(action: Action) -> Resolution {
    Resolution {
        action,
        by: Actor::Named(OPERATOR.into()),
    }
}

async fn sweeper_releases_when_the_policy_says_so(b: Arc<dyn Backend>) {
    let cx = Ctx::new(b);
    let s = scope("k-sweep-release");
    let mut req = claim(&s, Some(1));
    req.on_unknown = OnUnknown::Release;
    cx.owned(&req).await;
    cx.clock.advance(1_000);
    let report = cx.sweep(u64::MAX / 4).await;
    assert_eq!((report.released, report.marked_unknown), (1, 0));
    assert_eq!(cx.backend().open_records().await.unwrap(), OpenRecords::default());
    cx.owned(&claim(&s, Some(2))).await;
}

/// What the monitoring samples: unknown records count until an operator
/// resolves them, whatever time has passed (an alert on them stays on).
async fn unknown_records_stay_counted_until_resolved(b: Arc<dyn Backend>) {
    let cx = Ctx::new(b);
    let s = scope("k-watched");
    let created = cx.now();
    let f = cx.owned(&claim(&s, Some(1))).await;
    let open = cx.backend().open_records().await.unwrap();
    assert_eq!(open.oldest_in_progress, Some(created));
    assert_eq!((open.unknown, open.oldest_unknown), (0, None));
    cx.store.mark_unknown(&fence(&s, f)).await.unwrap();
    cx.clock.advance(3 * 3_600_000);
    let open = cx.backend().open_records().await.unwrap();
    assert_eq!(
        (open.oldest_in_progress, open.unknown, open.oldest_unknown),
        (None, 1, Some(created))
    );
    let how = by(Action::Release);
    assert!(cx
        .backend()
        .resolve(&s, &how, Some("refunded"), cx.now())
        .await
        .unwrap());
    assert_eq!(cx.backend().open_records().await.unwrap(), OpenRecords::default());
}

fn attempt(a: &str) -> Option<Attempt> {
    Some(Attempt::try_from(a.to_string()).unwrap())
}

/// An attempt id of the shape a filter draws (SQLite keeps it as bytes;
/// other ids, like `a1`, as text).
fn filter_id(n: u64) -> String {
    format!("5ca1ab1e5ca1ab1e5ca1ab1e5ca1ab1e-{n:x}")
}

fn abandon(s: &Scope, a: &str) -> AbandonRequest {
    AbandonRequest {
        scope: s.clone(),
        attempt: Attempt::try_from(a.to_string()).unwrap(),
        trace: Default::default(),
    }
}

async fn history(cx: &Ctx, key: &str) -> KeyHistory {
    let q = Lookup {
        tenant: "acme".into(),
        key: key.into(),
        ..Default::default()
    };
    cx.backend().lookup(&q, 100).await.unwrap()
}

fn transitions(h: &KeyHistory) -> Vec<&str> {
    h.events.iter().map(|e| e.transition.as_str()).collect()
}

async fn an_abandoned_claim_frees_the_key_and_nothing_else(b: Arc<dyn Backend>) {
    let cx = Ctx::new(b);
    let s = scope("k-abandon");
    let mut first = claim(&s, Some(1));
    first.attempt = attempt(&filter_id(1));
    cx.owned(&first).await;
    // Another attempt's abandon leaves this one's record alone.
    cx.store.abandon(&abandon(&s, &filter_id(2))).await.unwrap();
    let mut other = claim(&s, Some(1));
    other.attempt = attempt(&filter_id(3));
    assert!(matches!(cx.reply(&other).await, ClaimReply::InProgress { .. }));
    assert_eq!(
        cx.store.abandon(&abandon(&s, &filter_id(1))).await.unwrap(),
        FenceReply::Done
    );
    // The retry the 503 invited is a first request.
    let mut retry = claim(&s, Some(1));
    retry.attempt = attempt("a3");
    let fence = cx.owned(&retry).await;
    cx.store.complete(&complete(&s, fence, 201), b"ok").await.unwrap();
    // A completion is never abandoned.
    assert_eq!(
        cx.store.abandon(&abandon(&s, "a3")).await.unwrap(),
        FenceReply::Stale
    );
    assert!(matches!(cx.reply(&retry).await, ClaimReply::Replay { .. }));
    let h = history(&cx, "k-abandon").await;
    assert_eq!(transitions(&h), ["claimed", "abandoned", "claimed", "completed"]);
    assert_eq!(h.records.len(), 2);
    assert_eq!(
        (h.records[1].state.as_str(), h.records[1].attempt.clone()),
        ("abandoned", Some(filter_id(1)))
    );
}

async fn an_abandon_that_arrives_first_releases_the_claim_when_it_lands(b: Arc<dyn Backend>) {
    let cx = Ctx::new(b);
    let s = scope("k-abandon-early");
    assert_eq!(
        cx.store.abandon(&abandon(&s, &filter_id(0x1f))).await.unwrap(),
        FenceReply::Done
    );
    let mut late = claim(&s, Some(1));
    late.attempt = attempt(&filter_id(0x1f));
    cx.owned(&late).await;
    assert_eq!(cx.sweep(60_000).await.abandoned, 1);
    let mut retry = claim(&s, Some(1));
    retry.attempt = attempt(&filter_id(0x20));
    cx.owned(&retry).await;
    // The sweeper leaves the new attempt alone.
    assert_eq!(cx.sweep(60_000).await.abandoned, 0);
    assert_eq!(
        transitions(&history(&cx, "k-abandon-early").await),
        ["claimed", "abandoned", "claimed"]
    );
}

/// A waiting retry whose client left while another attempt held the key:
/// its abandon meets the other attempt's record, and its claim lands only
/// once that attempt released the key. The claim is then released, never
/// left owned by nobody (which would answer the next retry
/// `outcome-unknown` although nothing ran).
async fn an_abandon_that_meets_another_attempts_record_releases_its_claim_when_it_lands(b: Arc<dyn Backend>) {
    let cx = Ctx::new(b);
    let s = scope("k-abandon-other");
    let mut a = claim(&s, Some(1));
    a.attempt = attempt("a1");
    let held = cx.owned(&a).await;
    assert_eq!(
        cx.store.abandon(&abandon(&s, "a2")).await.unwrap(),
        FenceReply::Done,
        "remembered"
    );
    cx.store.release(&fence(&s, held)).await.unwrap();
    let mut waiting = claim(&s, Some(1));
    waiting.attempt = attempt("a2");
    cx.owned(&waiting).await;
    assert_eq!(cx.sweep(60_000).await.abandoned, 1);
    let mut retry = claim(&s, Some(1));
    retry.attempt = attempt("a3");
    cx.owned(&retry).await;
    assert_eq!(
        transitions(&history(&cx, "k-abandon-other").await),
        ["claimed", "released", "claimed", "abandoned", "claimed"]
    );
}

/// A copy of a claim (delivered twice by something in front of the store)
/// that lands after its attempt released the key (the upstream, or Envoy
/// before reaching it, refused) takes the key for nobody: the release
/// remembers its attempt as an abandon does, and the sweeper ends the copy's
/// claim, never leaving it to turn unknown with nothing run.
async fn a_copy_of_a_claim_landing_after_its_release_is_ended_by_the_sweeper(b: Arc<dyn Backend>) {
    let cx = Ctx::new(b);
    let s = scope("k-release-copy");
    let mut first = claim(&s, Some(1));
    first.attempt = attempt("a1");
    let held = cx.owned(&first).await;
    cx.store.release(&fence(&s, held)).await.unwrap();
    cx.owned(&first).await;
    assert_eq!(cx.sweep(60_000).await.abandoned, 1);
    let mut retry = claim(&s, Some(1));
    retry.attempt = attempt("a2");
    cx.owned(&retry).await;
    assert_eq!(
        transitions(&history(&cx, "k-release-copy").await),
        ["claimed", "released", "claimed", "abandoned", "claimed"]
    );
}

/// A claim whose answer was lost, its lease run out and its record archived
/// before the filter's abandon got through: nothing ran, so the abandon still
/// frees the key and the retry the 503 invited is a first request.
async fn an_abandon_after_the_record_was_archived_still_frees_the_key(b: Arc<dyn Backend>) {
    let cx = Ctx::new(b);
    let s = scope("k-abandon-archived");
    let mut lost = claim(&s, Some(1));
    lost.attempt = attempt("a1");
    cx.owned(&lost).await;
    cx.clock.advance(1_000);
    assert_eq!(cx.sweep(60_000).await.marked_unknown, 1);
    cx.clock.advance(10_000);
    assert_eq!(cx.sweep(60_000).await.archived, 1);
    assert_eq!(
        cx.store.abandon(&abandon(&s, "a1")).await.unwrap(),
        FenceReply::Done
    );
    let mut retry = claim(&s, Some(1));
    retry.attempt = attempt("a2");
    cx.owned(&retry).await;
}

/// A completion held up until its record's lease ran out and the unknown
/// record expired: it is still recorded (status and time, no body), so the
/// history says what happened, and the archived record still never replays.
async fn a_completion_after_the_unknown_record_was_archived_is_recorded_without_its_body(
    b: Arc<dyn Backend>,
) {
    let cx = Ctx::new(b);
    let s = scope("k-complete-archived");
    let fence = cx.owned(&claim(&s, Some(1))).await;
    cx.clock.advance(1_000);
    assert_eq!(cx.sweep(60_000).await.marked_unknown, 1);
    cx.clock.advance(10_000);
    assert_eq!(cx.sweep(60_000).await.archived, 1);
    assert_eq!(
        cx.store
            .complete(&complete(&s, fence, 201), b"late")
            .await
            .unwrap(),
        FenceReply::Done
    );
    let rec = cx.newest("k-complete-archived").await.unwrap();
    assert_eq!(
        (rec.state.as_str(), rec.status, rec.body_len),
        ("completed", Some(201), None)
    );
    assert!(rec.archived_at.is_some());
    assert_eq!(
        cx.reply(&claim(&s, Some(1))).await,
        ClaimReply::Expired {
            completed_at: Some(cx.now())
        }
    );
}

/// A replica whose clock is behind sees an archived record before its
/// expiry: archived is history, and it never replays (the body is gone).
async fn an_archived_record_never_replays(b: Arc<dyn Backend>) {
    let cx = Ctx::new(b);
    let s = scope("k-archived");
    let f = cx.owned(&claim(&s, Some(1))).await;
    cx.store.complete(&complete(&s, f, 201), b"body").await.unwrap();
    let completed_at = cx.now();
    cx.clock.advance(10_000);
    assert_eq!(cx.sweep(60_000).await.archived, 1);
    let behind = completed_at + 5_000;
    let out = cx
        .backend()
        .claim(&claim(&s, Some(1)), behind, None)
        .await
        .unwrap();
    assert_eq!(
        out.reply,
        ClaimReply::Expired {
            completed_at: Some(completed_at)
        }
    );
    let mut new = claim(&s, Some(1));
    new.after_expiry = AfterExpiry::New;
    let out = cx.backend().claim(&new, behind, None).await.unwrap();
    assert!(matches!(out.reply, ClaimReply::Owned { .. }), "{:?}", out.reply);
}

async fn a_claim_past_its_callers_deadline_is_not_committed(b: Arc<dyn Backend>) {
    let cx = Ctx::new(b);
    let s = scope("k-late");
    let passed = std::time::Instant::now();
    let out = cx
        .backend()
        .claim(&claim(&s, Some(1)), cx.now(), Some(passed))
        .await;
    assert!(matches!(out, Err(StoreError::Late)), "{out:?}");
    assert!(history(&cx, "k-late").await.records.is_empty());
    cx.owned(&claim(&s, Some(1))).await;
}

/// The deadline refuses only a claim that would commit something
/// ([`Backend::claim`]): past its caller's deadline, a claim that answers
/// (a record in progress, another request's fingerprint) or replays is
/// answered as it would be in time, while one that would turn an expired
/// lease unknown or take the key over is refused and leaves the record as
/// it was.
async fn a_late_claim_is_refused_only_when_it_would_write(b: Arc<dyn Backend>) {
    /// `req` with a deadline that has passed.
    async fn late(
        cx: &Ctx,
        req: &idemgate_core::protocol::ClaimRequest,
    ) -> Result<idemgate_store::backend::ClaimOutcome, StoreError> {
        let passed = std::time::Instant::now();
        cx.backend().claim(req, cx.now(), Some(passed)).await
    }
    let cx = Ctx::new(b);
    let s = scope("k-late-answers");
    let f = cx.owned(&claim(&s, Some(1))).await;
    let out = late(&cx, &claim(&s, Some(1))).await.unwrap();
    assert_eq!(
        out.reply,
        ClaimReply::InProgress {
            retry_after_ms: 1_000
        }
    );
    let out = late(&cx, &claim(&s, Some(2))).await.unwrap();
    assert_eq!(out.reply, ClaimReply::Mismatch);
    cx.store.complete(&complete(&s, f, 201), b"kept").await.unwrap();
    let out = late(&cx, &claim(&s, Some(1))).await.unwrap();
    assert!(
        matches!(out.reply, ClaimReply::Replay { status: 201, .. }),
        "{:?}",
        out.reply
    );
    assert_eq!(out.body, b"kept");

    // The lease runs out: a claim on time would turn the record unknown,
    // or take the key under `on_unknown: release`.
    let u = scope("k-late-unknown");
    let f = cx.owned(&claim(&u, Some(1))).await;
    cx.clock.advance(1_000);
    let out = late(&cx, &claim(&u, Some(1))).await;
    assert!(matches!(out, Err(StoreError::Late)), "{out:?}");
    let mut release = claim(&u, Some(1));
    release.on_unknown = OnUnknown::Release;
    let out = late(&cx, &release).await;
    assert!(matches!(out, Err(StoreError::Late)), "{out:?}");
    let h = history(&cx, "k-late-unknown").await;
    let gens: Vec<(u64, &str)> = h
        .records
        .iter()
        .map(|r| (r.generation, r.state.as_str()))
        .collect();
    assert_eq!(gens, [(f, "in_progress")]);
    assert_eq!(transitions(&h), ["claimed"]);
    // On time, the same claim turns it unknown.
    assert_eq!(cx.reply(&claim(&u, Some(1))).await, ClaimReply::Unknown);
}

async fn a_new_generation_keeps_the_old_one_and_its_events(b: Arc<dyn Backend>) {
    let cx = Ctx::new(b);
    let s = scope("k-generations");
    // After expiry, with after_expiry: new.
    let mut req = claim(&s, Some(1));
    req.after_expiry = AfterExpiry::New;
    let first = cx.owned(&req).await;
    cx.store
        .complete(&complete(&s, first, 201), b"one")
        .await
        .unwrap();
    cx.clock.advance(10_000);
    assert_eq!(cx.sweep(60_000).await.archived, 1);
    req.fingerprint = Some(fp(2));
    let second = cx.owned(&req).await;
    // After a lease that ran out, with on_unknown: release.
    cx.clock.advance(1_000);
    req.on_unknown = OnUnknown::Release;
    let third = cx.owned(&req).await;
    assert!(first < second && second < third);
    let h = history(&cx, "k-generations").await;
    let gens: Vec<(u64, &str, Option<i64>)> = h
        .records
        .iter()
        .map(|r| (r.generation, r.state.as_str(), r.status.map(i64::from)))
        .collect();
    assert_eq!(
        gens,
        [
            (third, "in_progress", None),
            (second, "lease_expired", None),
            (first, "completed", Some(201))
        ]
    );
    assert_eq!(
        h.records[2].fingerprint,
        Some(fp(1).to_hex()),
        "the first request's evidence"
    );
    assert!(h.records[2].archived_at.is_some());
    assert_eq!(
        transitions(&h),
        [
            "claimed",
            "completed",
            "archived",
            "reclaimed",
            "claimed",
            "lease_expired",
            "claimed"
        ]
    );
    let fences: Vec<u64> = h.events.iter().map(|e| e.generation).collect();
    assert_eq!(fences, [first, first, first, first, second, second, third]);
    // Released generations stay too.
    cx.store.release(&fence(&s, third)).await.unwrap();
    let h = history(&cx, "k-generations").await;
    assert_eq!(h.records.len(), 3);
    assert_eq!(h.records[0].state, Standing::EndedBy(Transition::Released));
    assert_eq!(transitions(&h).last(), Some(&"released"));
}

/// A generation that a new claim replaces ends with an event of its own,
/// recorded on it before it moves to the history: its lease ran out (an
/// owner that never settled, under `on_unknown: release`), or it was
/// reclaimed (an unknown outcome, or an expired key under `after_expiry:
/// new`). The new generation begins with `claimed`, as every generation
/// does, so each one's events tell its whole life.
async fn a_replaced_generation_ends_with_an_event_of_its_own(b: Arc<dyn Backend>) {
    let cx = Ctx::new(b);
    let s = scope("k-replaced");
    let mut req = claim(&s, Some(1));
    req.on_unknown = OnUnknown::Release;
    // In progress until its lease ran out.
    let first = cx.owned(&req).await;
    cx.clock.advance(1_000);
    let second = cx.owned(&req).await;
    // Marked unknown, then claimed again once its lease ran out.
    cx.store.mark_unknown(&fence(&s, second)).await.unwrap();
    cx.clock.advance(1_000);
    let third = cx.owned(&req).await;
    // Completed, expired and archived, then claimed again as new.
    cx.store
        .complete(&complete(&s, third, 201), b"one")
        .await
        .unwrap();
    cx.clock.advance(10_000);
    assert_eq!(cx.sweep(60_000).await.archived, 1);
    req.after_expiry = AfterExpiry::New;
    let fourth = cx.owned(&req).await;
    let h = history(&cx, "k-replaced").await;
    let events: Vec<(u64, &str, &Actor, Option<&str>)> = h
        .events
        .iter()
        .map(|e| (e.generation, e.transition.as_str(), &e.actor, e.detail.as_deref()))
        .collect();
    let filter = &Actor::Filter;
    assert_eq!(
        events,
        [
            (first, "claimed", filter, None),
            (first, "lease_expired", filter, Some("released")),
            (second, "claimed", filter, None),
            (second, "marked_unknown", filter, None),
            (second, "reclaimed", filter, None),
            (third, "claimed", filter, None),
            (third, "completed", filter, None),
            (third, "archived", &Actor::Sweeper, None),
            (third, "reclaimed", filter, None),
            (fourth, "claimed", filter, None),
        ]
    );
    let gens: Vec<(u64, &str)> = h
        .records
        .iter()
        .map(|r| (r.generation, r.state.as_str()))
        .collect();
    assert_eq!(
        gens,
        [
            (fourth, "in_progress"),
            (third, "completed"),
            (second, "unknown"),
            (first, "lease_expired")
        ]
    );
    // Each ended generation's last event is the one that ended it, dated
    // when it left for the history.
    for g in h.records.iter().filter(|r| r.ended_at.is_some()) {
        let last = h.events.iter().rev().find(|e| e.generation == g.generation);
        assert_eq!(last.map(|e| e.at), g.ended_at, "generation {}", g.generation);
    }
}

/// The budget of new keys limits only claims that take a key: a claim over
/// budget that meets a lease that ran out turns the record unknown
/// (`lease_expired`) and is answered `Unknown`, as it is without a budget,
/// whether it waits (`Store::claim`) or not (`Store::decide`); a new key is
/// refused.
async fn a_claim_over_budget_still_turns_a_lease_that_ran_out_unknown(b: Arc<dyn Backend>) {
    let clock = Clock::manual(T0);
    let budgets = idemgate_store::budget::Budgets::new(0.001, 2).unwrap();
    let cx = Ctx {
        store: Store::new(b, clock.clone()).with_budgets(budgets),
        clock,
    };
    let (waits, decided) = (scope("k-budget-waits"), scope("k-budget-decided"));
    cx.owned(&claim(&waits, Some(1))).await;
    cx.owned(&claim(&decided, Some(1))).await;
    cx.clock.advance(1_000);
    let new = cx.store.claim(&claim(&scope("k-budget-new"), Some(1))).await;
    assert!(matches!(new, Err(StoreError::RateLimited { .. })), "{new:?}");
    assert_eq!(cx.reply(&claim(&waits, Some(1))).await, ClaimReply::Unknown);
    let call = idemgate_store::backend::Call::Claim {
        req: claim(&decided, Some(1)),
        deadline: None,
    };
    let answer = cx.store.decide(vec![call]).await.pop().unwrap().unwrap();
    assert!(
        matches!(&answer, idemgate_store::backend::Answer::Claim(o) if o.reply == ClaimReply::Unknown),
        "{answer:?}"
    );
    for key in ["k-budget-waits", "k-budget-decided"] {
        let h = history(&cx, key).await;
        assert_eq!(transitions(&h), ["claimed", "lease_expired"], "{key}");
        assert_eq!(h.records[0].state, Standing::In(State::Unknown), "{key}");
    }
}

/// An abandon remembers its attempt even when it ended that attempt's
/// record: a copy of the claim that lands afterwards (a proxy in front of
/// the store that delivered it twice) is released by the sweeper like any
/// claim that lands after its abandon, never left owned by nobody, and
/// the retry the 503 invited is a first request.
async fn a_claim_delivered_again_after_its_abandon_is_released(b: Arc<dyn Backend>) {
    let cx = Ctx::new(b);
    let s = scope("k-twice");
    let mut req = claim(&s, Some(1));
    req.attempt = attempt(&filter_id(1));
    let first = cx.owned(&req).await;
    assert_eq!(
        cx.store.abandon(&abandon(&s, &filter_id(1))).await.unwrap(),
        FenceReply::Done
    );
    let again = cx.owned(&req).await;
    assert!(again > first);
    cx.clock.advance(1);
    assert_eq!(cx.sweep(60_000).await.abandoned, 1);
    let h = history(&cx, "k-twice").await;
    assert_eq!(transitions(&h), ["claimed", "abandoned", "claimed", "abandoned"]);
    let mut retry = claim(&s, Some(1));
    retry.attempt = attempt(&filter_id(2));
    cx.owned(&retry).await;
}

/// A claim delivered twice (a proxy in front of the store that sent it
/// again, or a copy decided after its twin under a slow database): the copy
/// of the claim whose attempt holds the key is answered as its twin was,
/// `owned` with the same fence, whichever answer reaches the filter first;
/// nothing changes, and another attempt still waits for the lease.
async fn a_copy_of_the_claim_that_holds_the_key_is_answered_owned(b: Arc<dyn Backend>) {
    let cx = Ctx::new(b);
    let s = scope("k-copy");
    let mut req = claim(&s, Some(1));
    req.attempt = attempt(&filter_id(1));
    let fence = cx.owned(&req).await;
    cx.clock.advance(300);
    assert_eq!(cx.reply(&req).await, ClaimReply::Owned { fence });
    let mut other = claim(&s, Some(1));
    other.attempt = attempt(&filter_id(2));
    assert_eq!(
        cx.reply(&other).await,
        ClaimReply::InProgress { retry_after_ms: 700 }
    );
    let h = history(&cx, "k-copy").await;
    assert_eq!(transitions(&h), ["claimed"]);
    // The copy settles as its twin: its completion stores the response.
    assert_eq!(
        cx.store
            .complete(&complete(&s, fence, 201), b"paid")
            .await
            .unwrap(),
        FenceReply::Done
    );
    assert!(matches!(
        cx.reply(&other).await,
        ClaimReply::Replay { status: 201, .. }
    ));
}

async fn purge_removes_only_what_is_past_retention(b: Arc<dyn Backend>) {
    let cx = Ctx::new(b);
    let old = scope("k-retention-old");
    let f = cx.owned(&claim(&old, Some(1))).await;
    cx.store.release(&fence(&old, f)).await.unwrap();
    cx.clock.advance(30_000);
    let young = scope("k-retention-young");
    let f = cx.owned(&claim(&young, Some(1))).await;
    cx.store.release(&fence(&young, f)).await.unwrap();
    cx.clock.advance(30_000);
    // The old generation and its events are 60 s old, the young ones 30 s.
    let report = cx.sweep(45_000).await;
    assert_eq!((report.purged, report.events_purged), (1, 2));
    let h = history(&cx, "k-retention-old").await;
    assert!(h.records.is_empty() && h.events.is_empty(), "{h:?}");
    let h = history(&cx, "k-retention-young").await;
    assert_eq!((h.records.len(), h.events.len()), (1, 2));
}

/// The conditions some statements state in SQL (`conditions.rs`): a fence
/// call acts only on an open, unarchived record, a completion expires
/// `ttl_ms` after it, and the sweeper never abandons a completed record.
async fn the_rules_stated_in_sql_hold(b: Arc<dyn Backend>) {
    let cx = Ctx::new(b);
    // Fenceable: a completed record refuses every fence call, even its own fence.
    let s = scope("k-sql-completed");
    let fence = cx.owned(&claim(&s, Some(1))).await;
    cx.store.complete(&complete(&s, fence, 201), b"ok").await.unwrap();
    let completed_at = cx.now();
    assert_eq!(
        cx.store.complete(&complete(&s, fence, 500), b"x").await.unwrap(),
        FenceReply::Stale
    );
    assert_eq!(
        cx.store.release(&crate::support::fence(&s, fence)).await.unwrap(),
        FenceReply::Stale
    );
    assert_eq!(
        cx.store
            .mark_unknown(&crate::support::fence(&s, fence))
            .await
            .unwrap(),
        FenceReply::Stale
    );
    // Completion expiry: `ttl_ms` (10 s) after completion.
    let rec = &history(&cx, "k-sql-completed").await.records[0];
    assert_eq!(rec.expires_at, Some(completed_at + 10_000));
    // Fenceable: an unknown record that was archived takes a late completion
    // (recorded without its body), once.
    let u = scope("k-sql-archived");
    let fence = cx.owned(&claim(&u, Some(1))).await;
    cx.store
        .mark_unknown(&crate::support::fence(&u, fence))
        .await
        .unwrap();
    cx.clock.advance(10_000);
    assert_eq!(cx.sweep(u64::MAX / 4).await.archived, 2);
    assert_eq!(
        cx.store
            .complete(&complete(&u, fence, 201), b"late")
            .await
            .unwrap(),
        FenceReply::Done
    );
    assert_eq!(
        cx.store
            .complete(&complete(&u, fence, 201), b"again")
            .await
            .unwrap(),
        FenceReply::Stale
    );
    let rec = &history(&cx, "k-sql-archived").await.records[0];
    assert_eq!(
        (rec.state.as_str(), rec.archived_at.is_some(), rec.body_len),
        ("completed", true, None)
    );
    // Abandonable: a claim that landed under an abandoned attempt and was
    // completed stays completed.
    let c = scope("k-sql-abandoned");
    cx.store.abandon(&abandon(&c, "a1")).await.unwrap();
    let mut landed = claim(&c, Some(1));
    landed.attempt = attempt("a1");
    let fence = cx.owned(&landed).await;
    cx.store.complete(&complete(&c, fence, 201), b"ok").await.unwrap();
    assert_eq!(cx.sweep(u64::MAX / 4).await.abandoned, 0);
    assert!(matches!(cx.reply(&landed).await, ClaimReply::Replay { .. }));
}

/// The calls of a batch are decided together (one SQLite transaction, one
/// pipelined PostgreSQL connection) and each on its own: the same key twice
/// has one owner, a claim past its caller's deadline is refused without
/// touching its neighbours, and every other call is carried out.
async fn a_batch_decides_each_call_on_its_own(b: Arc<dyn Backend>) {
    use idemgate_store::backend::{Answer, Call};
    let cx = Ctx::new(b);
    let done = scope("k-batch-done");
    let f_done = cx.owned(&claim(&done, Some(1))).await;
    let gone = scope("k-batch-release");
    let f_gone = cx.owned(&claim(&gone, Some(1))).await;
    let new = scope("k-batch-new");
    let late = scope("k-batch-late");
    let body = |b: &'static [u8]| bytes::Bytes::from_static(b);
    let calls = vec![
        Call::Claim {
            req: claim(&new, Some(1)),
            deadline: None,
        },
        Call::Complete {
            req: complete(&done, f_done, 201),
            body: body(b"ok"),
        },
        Call::Claim {
            req: claim(&new, Some(1)),
            deadline: None,
        },
        Call::Claim {
            req: claim(&late, Some(1)),
            deadline: Some(std::time::Instant::now()),
        },
        Call::Release(fence(&gone, f_gone)),
        Call::Complete {
            req: complete(&done, f_done + 1_000, 500),
            body: body(b"stale"),
        },
        Call::Complete {
            req: complete(&done, f_done, 202),
            body: body(b"twice"),
        },
    ];
    let answers = cx.backend().decide(calls, cx.now()).await;
    let claimed = |i: usize| match &answers[i] {
        Ok(Answer::Claim(out)) => out.reply.clone(),
        other => panic!("call {i}: {other:?}"),
    };
    let owners = [claimed(0), claimed(2)]
        .iter()
        .filter(|r| matches!(r, ClaimReply::Owned { .. }))
        .count();
    assert_eq!(owners, 1, "{answers:?}");
    assert!(
        matches!(answers[1], Ok(Answer::Fence(FenceReply::Done))),
        "{answers:?}"
    );
    assert!(matches!(answers[3], Err(StoreError::Late)), "{answers:?}");
    assert!(
        matches!(answers[4], Ok(Answer::Fence(FenceReply::Done))),
        "{answers:?}"
    );
    assert!(
        matches!(answers[5], Ok(Answer::Fence(FenceReply::Stale))),
        "{answers:?}"
    );
    assert!(
        matches!(answers[6], Ok(Answer::Fence(FenceReply::Stale))),
        "the same completion twice in a batch: {answers:?}"
    );
    // What the batch did is there; the late claim left nothing behind.
    let replay = cx.store.claim(&claim(&done, Some(1))).await.unwrap();
    assert!(matches!(replay.reply, ClaimReply::Replay { status: 201, .. }));
    assert_eq!(replay.body, b"ok");
    cx.owned(&claim(&gone, Some(1))).await;
    cx.owned(&claim(&late, Some(1))).await;
}

/// A batch of new keys: each is answered Owned, with fences that increase
/// along the batch, and its record has exactly one `claimed` event (its
/// fence, fingerprint and attempt). The same key twice in the batch has one
/// owner, the other claim meets its record in progress; a completed key
/// among new ones is replayed.
async fn a_batch_of_new_keys_claims_each_once(b: Arc<dyn Backend>) {
    use idemgate_store::backend::{Answer, Call};
    let cx = Ctx::new(b);
    let done = scope("k-new-batch-done");
    let f_done = cx.owned(&claim(&done, Some(7))).await;
    cx.store
        .complete(&complete(&done, f_done, 201), b"kept")
        .await
        .unwrap();
    let keys: Vec<String> = (0..5).map(|i| format!("k-new-batch-{i}")).collect();
    let claim_of = |i: usize| {
        let mut req = claim(&scope(&keys[i]), Some(u8::try_from(i).unwrap()));
        req.attempt = attempt(&format!("a{i}"));
        Call::Claim { req, deadline: None }
    };
    let mut calls: Vec<Call> = (0..5).map(claim_of).collect();
    let mut again = claim(&scope(&keys[1]), Some(1));
    again.attempt = attempt("b1");
    calls.push(Call::Claim {
        req: again,
        deadline: None,
    });
    calls.push(Call::Claim {
        req: claim(&done, Some(7)),
        deadline: None,
    });
    // A copy of a claim (delivered twice) is its attempt's own.
    calls.push(claim_of(1));
    let answers = cx.backend().decide(calls, cx.now()).await;
    let replies: Vec<ClaimReply> = answers
        .iter()
        .map(|a| match a {
            Ok(Answer::Claim(out)) => out.reply.clone(),
            other => panic!("{other:?}"),
        })
        .collect();
    let fences: Vec<u64> = replies[..5]
        .iter()
        .map(|r| match r {
            ClaimReply::Owned { fence } => *fence,
            other => panic!("a new key: {other:?} in {replies:?}"),
        })
        .collect();
    assert!(fences.windows(2).all(|w| w[0] < w[1]), "{fences:?}");
    assert!(fences[0] > f_done, "{fences:?} after {f_done}");
    assert!(
        matches!(replies[5], ClaimReply::InProgress { .. }),
        "the same key again: {replies:?}"
    );
    assert_eq!(replies[7], ClaimReply::Owned { fence: fences[1] }, "{replies:?}");
    assert!(
        matches!(replies[6], ClaimReply::Replay { status: 201, .. }),
        "{replies:?}"
    );
    match &answers[6] {
        Ok(Answer::Claim(out)) => assert_eq!(out.body, b"kept"),
        other => panic!("{other:?}"),
    }
    for (i, key) in keys.iter().enumerate() {
        let h = history(&cx, key).await;
        assert_eq!(h.records.len(), 1, "{key}: {h:?}");
        let rec = &h.records[0];
        assert_eq!(
            (rec.state.as_str(), rec.fence, rec.attempt.as_deref()),
            ("in_progress", fences[i], Some(format!("a{i}").as_str())),
            "{key}"
        );
        assert_eq!(transitions(&h), ["claimed"], "{key}");
        let ev = &h.events[0];
        assert_eq!(
            (ev.fence, ev.generation, ev.attempt.as_deref(), ev.actor.as_str()),
            (fences[i], fences[i], Some(format!("a{i}").as_str()), "filter"),
            "{key}"
        );
        let expected_fp = fp(u8::try_from(i).unwrap()).to_hex();
        assert_eq!(ev.fingerprint.as_deref(), Some(expected_fp.as_str()), "{key}");
        assert_eq!(rec.fingerprint.as_deref(), Some(expected_fp.as_str()), "{key}");
    }
    // The owners hold their keys: each completes with its fence.
    for (key, f) in keys.iter().zip(&fences) {
        assert_eq!(
            cx.store
                .complete(&complete(&scope(key), *f, 200), b"ok")
                .await
                .unwrap(),
            FenceReply::Done
        );
    }
}

/// The record as the effects see it, rebuilt from what an operator sees.
fn as_loaded(r: &idemgate_store::backend::RecordInfo) -> idemgate_store::row_mapping::LoadedRecord {
    use idemgate_core::fingerprint::Fingerprint;
    use idemgate_core::record::RecordView;
    idemgate_store::row_mapping::LoadedRecord {
        view: RecordView {
            state: r.state.state().unwrap(),
            fingerprint: r.fingerprint.clone().map(|h| Fingerprint::try_from(h).unwrap()),
            fence: r.fence,
            lease_until: r.lease_until,
            status: r.status,
            body_stored: r.body_stored,
            completed_at: r.completed_at,
            expires_at: r.expires_at,
            archived: r.archived_at.is_some(),
            attempt: r.attempt.clone(),
        },
        ttl_ms: r.ttl_ms,
        headers_column: None,
        response_key: None,
        release_on_unknown: r.on_unknown == OnUnknown::Release,
    }
}

/// Completes `req` and checks that the store did what [`effects::complete`]
/// decides for the record as it was: the same reply, and either the decided
/// completion and its event or nothing at all.
async fn complete_as_decided(cx: &Ctx, key: &str, req: &idemgate_core::protocol::CompleteRequest) {
    use idemgate_store::effects::{self, Fence, Write};
    let body: &[u8] = b"decided";
    let before = history(cx, key).await;
    let loaded = as_loaded(&before.records[0]);
    let effect = effects::complete(Some(&loaded), req, req.body_stored.then_some(body), cx.now());
    let reply = cx.store.complete(req, body).await.unwrap();
    assert_eq!(reply, effect.reply, "{key}");
    let after = history(cx, key).await;
    match effect.writes.as_slice() {
        [] => assert_eq!(after, before, "{key}"),
        [Write::Complete {
            response,
            fence: Fence::Held(fence),
            expires_at,
            ..
        }, Write::Event { by, .. }] => {
            let (was, now) = (&before.records[0], &after.records[0]);
            assert_eq!(now.state, Standing::In(State::Completed), "{key}");
            assert_eq!(now.fence, *fence, "{key}");
            assert_eq!(now.status, Some(response.status), "{key}");
            assert_eq!(now.headers.as_deref(), Some(response.headers), "{key}");
            assert_eq!(now.body_stored, response.body_stored, "{key}");
            assert_eq!(now.completed_at, Some(cx.now()), "{key}");
            assert_eq!(now.lease_until, cx.now(), "{key}");
            assert_eq!(now.expires_at, Some(*expires_at), "{key}");
            assert_eq!(
                (now.generation, now.archived_at),
                (was.generation, was.archived_at),
                "{key}"
            );
            assert_eq!(after.events.len(), before.events.len() + 1, "{key}");
            let event = after.events.last().unwrap();
            assert_eq!(
                (
                    event.transition.as_str(),
                    event.actor.as_str(),
                    event.detail.as_deref()
                ),
                (by.0.as_str(), by.1.as_str(), by.2),
                "{key}"
            );
            assert_eq!(
                (event.at, event.fence, event.status),
                (cx.now(), *fence, Some(response.status))
            );
            if response.body_stored {
                let replay = cx.store.claim(&claim(&req.scope, Some(1))).await.unwrap();
                assert_eq!(replay.body, body, "{key}");
            }
        }
        other => panic!("{key}: a completion decided as {other:?}"),
    }
}

/// A completion comes to what its effect says in every state it can meet:
/// on PostgreSQL it is one statement that reads nothing first, on SQLite
/// the effect carried out.
async fn a_completion_comes_to_what_its_effect_says(b: Arc<dyn Backend>) {
    let cx = Ctx::new(b);
    // In progress, under each `on_unknown` (release asks for a durable commit).
    let s = scope("k-effect-open");
    let f = cx.owned(&claim(&s, Some(1))).await;
    cx.clock.advance(5);
    complete_as_decided(&cx, "k-effect-open", &complete(&s, f, 201)).await;
    let s = scope("k-effect-release");
    let mut releasing = claim(&s, Some(1));
    releasing.on_unknown = OnUnknown::Release;
    let f = cx.owned(&releasing).await;
    let mut unstored = complete(&s, f, 202);
    unstored.body_stored = false;
    complete_as_decided(&cx, "k-effect-release", &unstored).await;
    // Unknown: a late completion under the current fence resolves it.
    let s = scope("k-effect-unknown");
    let f = cx.owned(&claim(&s, Some(1))).await;
    cx.store.mark_unknown(&fence(&s, f)).await.unwrap();
    cx.clock.advance(5);
    complete_as_decided(&cx, "k-effect-unknown", &complete(&s, f, 200)).await;
    // Completed: its own fence again changes nothing.
    let s = scope("k-effect-completed");
    let f = cx.owned(&claim(&s, Some(1))).await;
    cx.store.complete(&complete(&s, f, 201), b"first").await.unwrap();
    cx.clock.advance(5);
    complete_as_decided(&cx, "k-effect-completed", &complete(&s, f, 500)).await;
    // A superseded fence changes nothing.
    let s = scope("k-effect-stale");
    let f = cx.owned(&claim(&s, Some(1))).await;
    complete_as_decided(&cx, "k-effect-stale", &complete(&s, f + 1_000, 201)).await;
    complete_as_decided(&cx, "k-effect-stale", &complete(&s, f.saturating_sub(1), 201)).await;
    // Archived (unknown, then past its expiry): the late completion is
    // recorded for the history, without its body.
    let s = scope("k-effect-archived");
    let f = cx.owned(&claim(&s, Some(1))).await;
    cx.store.mark_unknown(&fence(&s, f)).await.unwrap();
    cx.clock.advance(10_000);
    assert!(cx.sweep(u64::MAX / 4).await.archived >= 1);
    complete_as_decided(&cx, "k-effect-archived", &complete(&s, f, 201)).await;
}

/// The in-memory backend the simulation runs on, empty.
fn memory_backend() -> Arc<dyn Backend> {
    let ids = idemgate_store::log_ids::LogIds::new(b"the memory stories' log key").unwrap();
    Arc::new(idemgate_store::memory::Memory::new(ids))
}

/// One test per story and backend, so a failing story hides none of the
/// others: `stories::sqlite::NAME`, `stories::memory::NAME`,
/// `stories::postgres::NAME` and `stories::pgbouncer::NAME`. The PostgreSQL
/// ones share a throwaway cluster (and PgBouncer), each in a fresh database.
/// Every story runs in memory too: it has no files, no durability and no
/// sealing at rest, and no story is about any of them.
macro_rules! stories {
    ($($name:ident),* $(,)?) => {
        mod memory {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(super::memory_backend()).await;
                }
            )*
        }

        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let dir = tempfile::tempdir().unwrap();
                    super::$name(crate::support::sqlite_backend(&dir).await).await;
                }
            )*
        }

        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let cluster = crate::support::shared_cluster();
                    let url = cluster.fresh_database().await;
                    super::$name(crate::support::pg_backend(&url).await).await;
                }
            )*
        }

        // Through PgBouncer in transaction mode (the store set up for it):
        // statements unnamed, each transaction bounding its own statements.
        mod pgbouncer {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let Some(bounced) = crate::support::shared_bouncer() else {
                        return;
                    };
                    let url = bounced.fresh_database().await;
                    let seal = idemgate_store::sealing::Seal::off();
                    super::$name(crate::support::bounced_backend(&url, seal).await).await;
                }
            )*
        }

        // The same stories with stored responses sealed at rest: sealing
        // changes nothing a caller or an operator sees.
        mod sealed_sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let dir = tempfile::tempdir().unwrap();
                    let seal = crate::support::seal(crate::support::KEY_A);
                    super::$name(crate::support::sqlite_backend_sealed(&dir, seal).await).await;
                }
            )*
        }

        mod sealed_postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let cluster = crate::support::shared_cluster();
                    let url = cluster.fresh_database().await;
                    let seal = crate::support::seal(crate::support::KEY_A);
                    super::$name(crate::support::backend_at(&url, seal).await).await;
                }
            )*
        }
    };
}

stories!(
    claim_complete_replay,
    replay_counts_reach_the_record,
    fingerprint_mismatch_in_every_state,
    in_progress_answers_the_remaining_lease,
    waiting_claim_returns_the_result,
    lease_expiry_turns_the_record_unknown,
    a_lease_ends_at_its_last_millisecond,
    late_completion_with_the_current_token_resolves_unknown,
    a_superseded_token_is_refused,
    release_frees_the_key,
    mark_unknown_and_result_unavailable,
    expiry_archives_then_purges,
    the_sweeper_takes_the_oldest_due_first,
    ended_generations_are_purged_the_oldest_first,
    a_batch_larger_than_a_slice_is_swept_whole,
    after_expiry_reject_or_new,
    the_same_key_in_another_scope_is_another_record,
    operators_resolve_list_and_purge,
    sweeper_releases_when_the_policy_says_so,
    unknown_records_stay_counted_until_resolved,
    an_abandoned_claim_frees_the_key_and_nothing_else,
    an_abandon_that_arrives_first_releases_the_claim_when_it_lands,
    a_copy_of_a_claim_landing_after_its_release_is_ended_by_the_sweeper,
    an_abandon_that_meets_another_attempts_record_releases_its_claim_when_it_lands,
    an_archived_record_never_replays,
    an_abandon_after_the_record_was_archived_still_frees_the_key,
    a_completion_after_the_unknown_record_was_archived_is_recorded_without_its_body,
    a_claim_past_its_callers_deadline_is_not_committed,
    a_late_claim_is_refused_only_when_it_would_write,
    a_new_generation_keeps_the_old_one_and_its_events,
    a_replaced_generation_ends_with_an_event_of_its_own,
    a_claim_over_budget_still_turns_a_lease_that_ran_out_unknown,
    a_claim_delivered_again_after_its_abandon_is_released,
    a_copy_of_the_claim_that_holds_the_key_is_answered_owned,
    purge_removes_only_what_is_past_retention,
    the_rules_stated_in_sql_hold,
    a_batch_decides_each_call_on_its_own,
    a_batch_of_new_keys_claims_each_once,
    a_completion_comes_to_what_its_effect_says,
);

/// The claims of a batch's new keys are one PostgreSQL transaction: their
/// records and `claimed` events carry one transaction id (`xmin`), so the
/// batch costs one commit, not one per key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_of_new_keys_commits_once_on_postgres() {
    let cluster = pg::PgCluster::start();
    let b = pg_backend(&cluster.url("postgres")).await;
    let answers = b.decide(new_claims("k-one-tx", 16), T0).await;
    assert_eq!(owners(&answers), 16, "{answers:?}");
    let transactions = |table: &str| {
        cluster.query(&format!(
            "SELECT count(*) || ' ' || count(DISTINCT xmin::text) FROM {table} WHERE generation IN \
             (SELECT generation FROM idempotency_records WHERE idem_key LIKE 'k-one-tx-%')"
        ))
    };
    assert_eq!(transactions("idempotency_records"), "16 1", "records");
    assert_eq!(transactions("idempotency_events"), "16 1", "events");
    assert_eq!(
        cluster.query(
            "SELECT count(DISTINCT r.xmin::text) FROM idempotency_records r JOIN idempotency_events e \
             ON e.generation = r.generation WHERE r.idem_key LIKE 'k-one-tx-%' AND r.xmin::text = e.xmin::text"
        ),
        "1",
        "a record and its event commit together"
    );
}

/// A claim whose caller's deadline passes while it waits for its record's
/// lock is decided again from the locked row, and refused if that effect
/// writes: here the lease it would turn unknown. Another session holds the
/// record's row lock past the deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_whose_deadline_passes_under_the_lock_commits_nothing_on_postgres() {
    let cluster = shared_cluster();
    let url = cluster.fresh_database().await;
    let b = pg_backend(&url).await;
    let s = scope("k-late-locked");
    let req = claim(&s, Some(1));
    let Ok(ClaimReply::Owned { .. }) = b.claim(&req, T0, None).await.map(|o| o.reply) else {
        panic!("not owned")
    };
    let (locker, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    locker
        .batch_execute("BEGIN; SELECT 1 FROM idempotency_records WHERE idem_key = 'k-late-locked' FOR UPDATE")
        .await
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_millis(100);
    let claimed = tokio::spawn({
        let (b, req) = (Arc::clone(&b), req.clone());
        async move { b.claim(&req, T0 + 1_000, Some(deadline)).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    locker.batch_execute("ROLLBACK").await.unwrap();
    let out = claimed.await.unwrap();
    assert!(matches!(out, Err(StoreError::Late)), "{out:?}");
    let q = Lookup {
        tenant: "acme".into(),
        key: "k-late-locked".into(),
        ..Default::default()
    };
    let h = b.lookup(&q, 10).await.unwrap();
    assert_eq!(h.records.len(), 1, "{h:?}");
    assert_eq!(h.records[0].state, Standing::In(State::InProgress));
    assert_eq!(transitions(&h), ["claimed"]);
}

/// When the set-based statement fails as a whole, every claim of the
/// batch is still answered, each by its own statement: here the table
/// refuses any statement that inserts more than one record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_whose_set_based_claim_fails_claims_one_by_one_on_postgres() {
    let cluster = pg::PgCluster::start();
    let b = pg_backend(&cluster.url("postgres")).await;
    one_record_at_a_time(&cluster, "INSERT");
    let answers = b.decide(new_claims("k-fallback", 4), T0).await;
    assert_eq!(owners(&answers), 4, "{answers:?}");
    assert_eq!(
        cluster.query(
            "SELECT count(*) || ' ' || count(DISTINCT xmin::text) FROM idempotency_records \
             WHERE idem_key LIKE 'k-fallback-%'"
        ),
        "4 4"
    );
}

/// A batch's completions are one PostgreSQL transaction as well: their
/// records and `completed` events carry one transaction id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_of_completions_commits_once_on_postgres() {
    let cluster = pg::PgCluster::start();
    let b = pg_backend(&cluster.url("postgres")).await;
    use idemgate_store::backend::{Answer, Call};
    let owned = b.decide(new_claims("k-one-done", 16), T0).await;
    let mut calls = completions("k-one-done", &owned);
    // One of them under a superseded fence: stale, and the others done.
    if let Some(Call::Complete { req, .. }) = calls.get_mut(5) {
        req.fence += 1_000;
    }
    let answers = b.decide(calls, T0 + 1).await;
    assert_eq!(done(&answers), 15, "{answers:?}");
    assert!(
        matches!(answers[5], Ok(Answer::Fence(FenceReply::Stale))),
        "{answers:?}"
    );
    assert_eq!(
        cluster.query(
            "SELECT count(*) || ' ' || count(DISTINCT xmin::text) FROM idempotency_records \
             WHERE idem_key LIKE 'k-one-done-%' AND state = 'completed'"
        ),
        "15 1",
        "records"
    );
    assert_eq!(
        cluster.query(
            "SELECT count(*) || ' ' || count(DISTINCT e.xmin::text) FROM idempotency_events e \
             JOIN idempotency_records r ON e.generation = r.generation \
             WHERE r.idem_key LIKE 'k-one-done-%' AND e.transition = 'completed' AND e.xmin::text = r.xmin::text"
        ),
        "15 1",
        "a record and its completion's event commit together"
    );
}

/// When the set-based completion fails as a whole, every completion of the
/// batch is still made, each by its own statement: here the table refuses
/// any statement that updates more than one record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_whose_set_based_completion_fails_completes_one_by_one_on_postgres() {
    let cluster = pg::PgCluster::start();
    let b = pg_backend(&cluster.url("postgres")).await;
    let owned = b.decide(new_claims("k-done-alone", 4), T0).await;
    one_record_at_a_time(&cluster, "UPDATE");
    let answers = b.decide(completions("k-done-alone", &owned), T0 + 1).await;
    assert_eq!(done(&answers), 4, "{answers:?}");
    assert_eq!(
        cluster.query(
            "SELECT count(*) || ' ' || count(DISTINCT xmin::text) FROM idempotency_records \
             WHERE idem_key LIKE 'k-done-alone-%' AND state = 'completed'"
        ),
        "4 4"
    );
}

/// A batch's completions wait for the WAL flush if any one of their claims
/// releases unknown outcomes, and only then (the WAL writer comes by every
/// 10 s here, so a commit that did not wait leaves its WAL unwritten).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_of_completions_is_durable_if_one_releases_unknown_on_postgres() {
    use idemgate_store::backend::Call;
    let cluster = pg::PgCluster::start_with(&[("wal_writer_delay", "10000ms")]);
    let b = pg_backend(&cluster.url("postgres")).await;
    let mut claims = new_claims("k-flush", 4);
    if let Some(Call::Claim { req, .. }) = claims.get_mut(2) {
        req.on_unknown = OnUnknown::Release;
    }
    let owned = b.decide(claims, T0).await;
    let mut calls = completions("k-flush", &owned).into_iter();
    let written = || cluster.query("SELECT pg_current_wal_lsn() >= pg_current_wal_insert_lsn()");
    let relaxed: Vec<_> = calls.by_ref().take(2).collect();
    assert_eq!(done(&b.decide(relaxed, T0 + 1).await), 2);
    assert_eq!(
        written(),
        "f",
        "completions that release nothing waited for the flush"
    );
    // The releasing one last: the whole transaction waits all the same.
    let durable: Vec<_> = calls.rev().collect();
    assert_eq!(done(&b.decide(durable, T0 + 2).await), 2);
    assert_eq!(
        written(),
        "t",
        "a completion that releases unknown outcomes did not wait for the flush"
    );
}

/// The completions of the claims `owned` answered (of `new_claims(prefix, _)`).
fn completions(
    prefix: &str,
    owned: &[idemgate_store::backend::Result<idemgate_store::backend::Answer>],
) -> Vec<idemgate_store::backend::Call> {
    owned
        .iter()
        .enumerate()
        .filter_map(|(i, a)| match a {
            Ok(idemgate_store::backend::Answer::Claim(out)) => match out.reply {
                ClaimReply::Owned { fence } => Some(idemgate_store::backend::Call::Complete {
                    req: complete(&scope(&format!("{prefix}-{i}")), fence, 201),
                    body: bytes::Bytes::from_static(b"ok"),
                }),
                _ => None,
            },
            _ => None,
        })
        .collect()
}

/// How many of `answers` are Done.
fn done(answers: &[idemgate_store::backend::Result<idemgate_store::backend::Answer>]) -> usize {
    answers
        .iter()
        .filter(|a| matches!(a, Ok(idemgate_store::backend::Answer::Fence(FenceReply::Done))))
        .count()
}

/// Makes the records' table refuse any statement that writes (`on`:
/// `INSERT` or `UPDATE`) more than one record.
fn one_record_at_a_time(cluster: &pg::PgCluster, on: &str) {
    cluster.query(&format!(
        "CREATE FUNCTION one_at_a_time() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN \
           IF (SELECT count(*) FROM written) > 1 THEN RAISE EXCEPTION 'one record at a time'; END IF; \
           RETURN NULL; END $$; \
         CREATE TRIGGER one_at_a_time AFTER {on} ON idempotency_records \
           REFERENCING NEW TABLE AS written FOR EACH STATEMENT EXECUTE FUNCTION one_at_a_time()"
    ));
}

/// Claims of `n` new keys `prefix-0`, `prefix-1`, ...
fn new_claims(prefix: &str, n: usize) -> Vec<idemgate_store::backend::Call> {
    (0..n)
        .map(|i| idemgate_store::backend::Call::Claim {
            req: claim(&scope(&format!("{prefix}-{i}")), Some(1)),
            deadline: None,
        })
        .collect()
}

/// How many of `answers` are Owned, their fences distinct.
fn owners(answers: &[idemgate_store::backend::Result<idemgate_store::backend::Answer>]) -> usize {
    let fences: std::collections::BTreeSet<u64> = answers
        .iter()
        .filter_map(|a| match a {
            Ok(idemgate_store::backend::Answer::Claim(out)) => match out.reply {
                ClaimReply::Owned { fence } => Some(fence),
                _ => None,
            },
            _ => None,
        })
        .collect();
    fences.len()
}
