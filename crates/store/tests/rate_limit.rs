//! The budget of new keys per tenant, through the HTTP API: only claims
//! that take a key are counted; one over the budget gets a 429 problem with
//! its wait, claims nothing, and the same key works once the wait is over.

use std::sync::Arc;

use idemgate_core::protocol::{
    decode_frame, encode_batch, encode_frame, split_batch, BatchReply, ClaimReply, BATCH_PATH,
};
use idemgate_store::backend::Backend;
use idemgate_store::budget::Budgets;
use idemgate_store::{AppState, Clock, Settings, Store};

use crate::support::*;

const T0: i64 = 1_800_000_000_000;

struct Api {
    state: AppState,
    clock: Clock,
}

struct Answer {
    status: u16,
    retry_after: Option<String>,
    body: Vec<u8>,
}

impl Answer {
    fn reply(&self) -> ClaimReply {
        assert_eq!(self.status, 200, "{}", String::from_utf8_lossy(&self.body));
        decode_frame::<ClaimReply>(&self.body).unwrap().0
    }

    fn assert_rate_limited(&self, wait_ms: u64) {
        assert_eq!(self.status, 429, "{}", String::from_utf8_lossy(&self.body));
        let problem: serde_json::Value = serde_json::from_slice(&self.body).unwrap();
        assert!(
            problem["type"].as_str().unwrap().ends_with("/key-rate-limited"),
            "{problem}"
        );
        assert_eq!(problem["status"], 429);
        assert_eq!(problem["retry_after_ms"], wait_ms);
    }
}

impl Api {
    /// One new key a second per tenant, two at once.
    fn new(backend: Arc<dyn Backend>) -> Api {
        let clock = Clock::manual(T0);
        let store = Store::new(backend, clock.clone()).with_budgets(Budgets::new(1.0, 2).unwrap());
        Api {
            state: AppState::new(store, Settings::new(API, ADMIN)),
            clock,
        }
    }

    async fn post(&self, path: &str, token: &str, body: Vec<u8>) -> Answer {
        let (status, headers, body) = post_in_process(&self.state, path, token, body).await;
        let retry_after = headers
            .get("retry-after")
            .map(|v| v.to_str().unwrap().to_string());
        Answer {
            status,
            retry_after,
            body,
        }
    }

    async fn claim(&self, tenant: &str, key: &str, fingerprint: u8) -> Answer {
        let s = scope_of(
            tenant,
            "alice",
            "payments.create",
            idemgate_core::scope::Namespace::Client,
            key,
        );
        self.post("/v1/claim", API, encode_frame(&claim(&s, Some(fingerprint)), b""))
            .await
    }

    async fn owned(&self, tenant: &str, key: &str) -> u64 {
        match self.claim(tenant, key, 1).await.reply() {
            ClaimReply::Owned { fence } => fence,
            other => panic!("expected Owned, got {other:?}"),
        }
    }

    /// How many records the admin API finds for the tenant's key.
    async fn records(&self, tenant: &str, key: &str) -> usize {
        let q = format!(r#"{{"tenant": "{tenant}", "key": "{key}"}}"#).into_bytes();
        let a = self.post("/admin/v1/records/lookup", ADMIN, q).await;
        assert_eq!(a.status, 200);
        let history: serde_json::Value = serde_json::from_slice(&a.body).unwrap();
        history["records"].as_array().unwrap().len()
    }
}

async fn budget_story(backend: Arc<dyn Backend>) {
    let api = Api::new(backend);
    // The burst: two new keys.
    let fence = api.owned("acme", "k1").await;
    api.owned("acme", "k2").await;
    // The third waits a second; nothing was claimed.
    let limited = api.claim("acme", "k3", 1).await;
    limited.assert_rate_limited(1000);
    assert_eq!(limited.retry_after.as_deref(), Some("1"));
    assert_eq!(
        api.records("acme", "k3").await,
        0,
        "a limited claim wrote a record"
    );
    assert_eq!(api.state.store.metrics.rate_limited_claims.get(), 1);

    // Over budget, what takes no key is answered as usual: a completion, its
    // replay, a conflict, a mismatch.
    let done = complete(&scope("k1"), fence, 201);
    let a = api
        .post("/v1/complete", API, encode_frame(&done, b"{\"id\":1}"))
        .await;
    assert_eq!(a.status, 200);
    let replay = api.claim("acme", "k1", 1).await;
    assert!(matches!(replay.reply(), ClaimReply::Replay { status: 201, .. }));
    assert!(replay.body.ends_with(b"{\"id\":1}"));
    assert!(matches!(
        api.claim("acme", "k2", 1).await.reply(),
        ClaimReply::InProgress { .. }
    ));
    assert_eq!(api.claim("acme", "k1", 2).await.reply(), ClaimReply::Mismatch);
    // Another tenant has a budget of its own.
    api.owned("globex", "k3").await;

    // In a batch, the limited claim gets its own 429; the others are decided.
    let (k3, k1) = (
        encode_frame(&claim(&scope("k3"), Some(1)), b""),
        encode_frame(&claim(&scope("k1"), Some(1)), b""),
    );
    let calls: [(&str, &[u8]); 2] = [("/v1/claim", &k3), ("/v1/claim", &k1)];
    let a = api.post(BATCH_PATH, API, encode_batch(&calls)).await;
    assert_eq!(a.status, 200);
    let (meta, rest) = decode_frame::<BatchReply>(&a.body).unwrap();
    let parts = split_batch(meta.results.iter().map(|r| r.len), rest).unwrap();
    let first = Answer {
        status: meta.results[0].status,
        retry_after: None,
        body: parts[0].to_vec(),
    };
    first.assert_rate_limited(1000);
    assert_eq!(meta.results[1].status, 200);
    assert!(matches!(
        decode_frame::<ClaimReply>(parts[1]).unwrap().0,
        ClaimReply::Replay { .. }
    ));

    // Replays and conflicts spent nothing: after half a second the wait is
    // half as long; after a second, the same key is claimed.
    api.clock.advance(500);
    api.claim("acme", "k3", 1).await.assert_rate_limited(500);
    api.clock.advance(500);
    api.owned("acme", "k3").await;
    api.claim("acme", "k4", 1).await.assert_rate_limited(1000);

    // A claim charged while the budget lasts but answered without taking a
    // key (here a replay) gives its key back.
    api.clock.advance(1000);
    assert!(matches!(
        api.claim("acme", "k1", 1).await.reply(),
        ClaimReply::Replay { .. }
    ));
    api.owned("acme", "k4").await;
    api.claim("acme", "k5", 1).await.assert_rate_limited(1000);
    assert_eq!(api.state.store.metrics.rate_limited_claims.get(), 5);

    // A claim that may wait for an in-flight record is limited the same way.
    let waiting = |key: &str| {
        let mut c = claim(&scope(key), Some(1));
        c.wait_ms = 50;
        encode_frame(&c, b"")
    };
    api.post("/v1/claim", API, waiting("k5"))
        .await
        .assert_rate_limited(1000);
    let a = api.post("/v1/claim", API, waiting("k1")).await;
    assert!(matches!(a.reply(), ClaimReply::Replay { .. }));
    assert_eq!(api.records("acme", "k5").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_over_its_budget_of_new_keys_gets_429_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    budget_story(sqlite_backend(&dir).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_over_its_budget_of_new_keys_gets_429_on_postgres() {
    let cluster = shared_cluster();
    let url = cluster.fresh_database().await;
    budget_story(pg_backend(&url).await).await;
}
