use std::future::Future;
use std::sync::Arc;

use futures_util::FutureExt;
use idemgate_core::config::{AfterExpiry, OnUnknown};
use idemgate_core::key::Key;
use idemgate_core::protocol::{ClaimReply, ClaimRequest, CompleteRequest, FenceRequest};
use idemgate_core::record::{Standing, State};
use idemgate_core::scope::{Namespace, Scope};

use super::*;
use crate::backend::Backend;

const T0: i64 = 1_800_000_000_000;

fn memory() -> Memory {
    Memory::new(LogIds::new(b"the memory tests' log key").unwrap())
}

fn scope(key: &str) -> Scope {
    let key = Key::try_from(key.to_string()).unwrap();
    Scope::new("acme", "alice", "payments.create", Namespace::Client, key).unwrap()
}

fn claim(key: &str) -> ClaimRequest {
    ClaimRequest {
        scope: scope(key),
        fingerprint: None,
        lease_ms: 1_000,
        ttl_ms: 10_000,
        wait_ms: 0,
        after_expiry: AfterExpiry::Reject,
        on_unknown: OnUnknown::Conflict,
        attempt: None,
        deadline_ms: 0,
        trace: Default::default(),
    }
}

/// The future's output on its first poll: a simulation polls once.
fn at_once<T>(f: impl Future<Output = T>) -> T {
    f.now_or_never().expect("completes on its first poll")
}

fn owned(m: &Memory, key: &str, now: i64) -> u64 {
    match at_once(m.claim(&claim(key), now, None)).unwrap().reply {
        ClaimReply::Owned { fence } => fence,
        other => panic!("{other:?}"),
    }
}

/// The completion of `key`'s claim under `fence`: a `201` kept whole.
fn completion(key: &str, fence: u64) -> CompleteRequest {
    CompleteRequest {
        scope: scope(key),
        fence,
        status: 201,
        headers: vec![],
        body_stored: true,
        trace: Default::default(),
    }
}

/// A few keys through their whole life: claimed, completed, replayed,
/// marked unknown, released, swept, looked up.
fn story(m: &Memory) -> KeyHistory {
    let f = owned(m, "k-1", T0);
    let done = completion("k-1", f);
    assert_eq!(
        at_once(m.complete(&done, b"ok", T0 + 1)).unwrap(),
        FenceReply::Done
    );
    let replay = at_once(m.claim(&claim("k-1"), T0 + 2, None)).unwrap();
    assert_eq!(replay.body, b"ok");
    let g = owned(m, "k-2", T0 + 3);
    let fenced = FenceRequest {
        scope: scope("k-2"),
        fence: g,
        trace: Default::default(),
    };
    assert_eq!(
        at_once(m.mark_unknown(&fenced, T0 + 4)).unwrap(),
        FenceReply::Done
    );
    let h = owned(m, "k-3", T0 + 5);
    let released = FenceRequest {
        scope: scope("k-3"),
        fence: h,
        trace: Default::default(),
    };
    assert_eq!(at_once(m.release(&released, T0 + 6)).unwrap(), FenceReply::Done);
    owned(m, "k-4", T0 + 7);
    let policy = SweepPolicy {
        batch: 10,
        audit_retention_ms: 60_000,
    };
    let swept = at_once(m.sweep(T0 + 20_000, &policy)).unwrap();
    assert_eq!((swept.marked_unknown, swept.archived), (1, 2));
    let q = Lookup {
        tenant: "acme".into(),
        key: "k-1".into(),
        ..Default::default()
    };
    at_once(m.lookup(&q, 10)).unwrap()
}

#[test]
fn every_call_completes_on_its_first_poll_and_runs_the_same_every_time() {
    let (one, two) = (memory(), memory());
    let first = story(&one);
    assert_eq!(first.records.len(), 1);
    assert_eq!(first.records[0].replay_count, 1);
    let transitions: Vec<&str> = first.events.iter().map(|e| e.transition.as_str()).collect();
    assert_eq!(transitions, ["claimed", "completed", "archived"]);
    assert_eq!(story(&two), first);
    assert!(at_once(one.open_records()).is_ok());
    assert!(at_once(one.list(Listing::Unknown, T0, 10)).is_ok());
}

/// A batch is decided in its order, each call on its own.
#[test]
fn a_batch_is_decided_in_its_order() {
    let m = memory();
    let calls: Vec<Call> = ["k-a", "k-b", "k-a"]
        .into_iter()
        .map(|k| Call::Claim {
            req: claim(k),
            deadline: None,
        })
        .collect();
    let replies: Vec<ClaimReply> = at_once(m.decide(calls, T0))
        .into_iter()
        .map(|a| match a {
            Ok(Answer::Claim(out)) => out.reply,
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(
        replies,
        [
            ClaimReply::Owned { fence: 1 },
            ClaimReply::Owned { fence: 2 },
            ClaimReply::InProgress {
                retry_after_ms: 1_000
            },
        ]
    );
}

/// Memory is never storage: no `--database-url` opens it.
#[test]
fn no_database_url_names_it() {
    let options = crate::database_url::BackendOptions::default();
    for url in ["memory:", "memory://", "mem://store"] {
        let opened = at_once(crate::database_url::open_backend(url, &options));
        assert!(
            opened.as_ref().map(|b| b.name()).is_err(),
            "{url} opened {:?}",
            opened.map(|b| b.name())
        );
    }
    let backend: Arc<dyn Backend> = Arc::new(memory());
    assert_eq!(backend.name(), "memory");
}

/// A completion under `on_unknown: conflict` is the one commit counted as
/// not durable; a snapshot put back takes everything since with it, the
/// fences drawn included, and the count of commits goes on.
#[test]
fn a_snapshot_put_back_forgets_what_came_after_it() {
    let m = memory();
    let f = owned(&m, "k-1", T0);
    assert_eq!(m.commits(), (1, 1));
    let before = m.snapshot();
    let done = completion("k-1", f);
    assert_eq!(
        at_once(m.complete(&done, b"ok", T0 + 1)).unwrap(),
        FenceReply::Done
    );
    assert_eq!(m.commits(), (2, 1));
    let released = ClaimRequest {
        on_unknown: OnUnknown::Release,
        ..claim("k-2")
    };
    let g = match at_once(m.claim(&released, T0 + 2, None)).unwrap().reply {
        ClaimReply::Owned { fence } => fence,
        other => panic!("{other:?}"),
    };
    let done = CompleteRequest {
        scope: scope("k-2"),
        fence: g,
        ..done
    };
    assert_eq!(
        at_once(m.complete(&done, b"ok", T0 + 3)).unwrap(),
        FenceReply::Done
    );
    assert_eq!(m.commits(), (4, 3));
    assert!(m.restore(before, 1000 * u64::try_from(T0 + 4).unwrap()));
    assert_eq!(m.commits(), (4, 3));
    let q = |key: &str| Lookup {
        tenant: "acme".into(),
        key: key.into(),
        ..Default::default()
    };
    let k1 = at_once(m.lookup(&q("k-1"), 10)).unwrap();
    assert_eq!(k1.records[0].state, Standing::In(State::InProgress));
    assert_eq!(k1.events.len(), 1);
    assert!(at_once(m.lookup(&q("k-2"), 10)).unwrap().records.is_empty());
    // Fences drawn since the snapshot are not drawn again.
    assert!(owned(&m, "k-3", T0 + 4) > g);
}
