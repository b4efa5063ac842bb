//! The store's disk fills up mid-traffic, through the real Envoy: clients get
//! `503 store-unavailable` with `Retry-After` (fail closed), nothing executes
//! twice, and service resumes once space is freed, without restarting Envoy
//! or the store.

// Test support: failing loudly is how a test reports.
#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

use e2e::report::verdict;
use idemgate_testkit::tmpfs::{SmallDisk, Tmpfs};
use std::time::{Duration, Instant};

use e2e::stack::{Database, Options, Stack};
use e2e::{fresh_key, send};

const PAYMENT: &str = r#"{"amount": 4200, "currency": "EUR"}"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_under_the_store_gets_503s_and_service_resumes_once_space_is_freed() {
    let verdict = verdict(
        "storage fault: SQLite disk full (through Envoy)",
        "Envoy and the store on a 32 MiB tmpfs, payments before, during and after",
        "the disk filled mid-traffic; 503 store-unavailable with Retry-After, nothing executes twice, service resumes without restarts",
    );
    let test =
        "storage_faults::a_full_disk_under_the_store_gets_503s_and_service_resumes_once_space_is_freed";
    let disk = match SmallDisk::mount("32m", test) {
        Tmpfs::Here(disk) => disk,
        // It passed there (had it failed, so would this run): `passed`.
        Tmpfs::RanInUserNamespace => return,
        Tmpfs::Unavailable(why) => return verdict.skip(&why),
    };
    let mut stack = Stack::start(Options::new("envoy/e2e.yaml", Database::Sqlite, 1)).await;
    // The store again, on the small disk; Envoy stays up throughout.
    stack.kill_store(0);
    stack.database_url = format!("sqlite://{}", disk.path("store.db").display());
    stack.start_store(0);
    stack.wait_store(0).await;

    let before = fresh_key("full-before");
    assert_eq!(send(stack.post("/pay", Some(&before), PAYMENT)).await.status, 201);

    // Four clients send payments throughout; the disk fills under them.
    let stop = std::sync::atomic::AtomicBool::new(false);
    let client = |c: usize| {
        let (stack, stop) = (&stack, &stop);
        async move {
            let (mut executed, mut refused) = (Vec::new(), Vec::new());
            for i in 0..2_000 {
                if stop.load(std::sync::atomic::Ordering::SeqCst) {
                    break;
                }
                let key = fresh_key(&format!("full-{c}-{i}"));
                let a = send(stack.post("/pay", Some(&key), PAYMENT)).await;
                match (a.status, a.problem().as_deref()) {
                    (201, _) => executed.push(key),
                    (503, Some("store-unavailable")) => {
                        assert!(
                            a.header("retry-after").is_some(),
                            "a 503 without Retry-After: {a:?}"
                        );
                        refused.push(key);
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                    _ => panic!("unexpected answer while the disk fills: {a:?}"),
                }
            }
            (executed, refused)
        }
    };
    let filling = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        disk.fill("filler");
        tokio::time::sleep(Duration::from_secs(2)).await;
        stop.store(true, std::sync::atomic::Ordering::SeqCst);
    };
    let (a, b, c, d, ()) = tokio::join!(client(0), client(1), client(2), client(3), filling);
    let (mut executed, mut refused) = (Vec::new(), Vec::new());
    for (e, r) in [a, b, c, d] {
        executed.extend(e);
        refused.extend(r);
    }
    assert!(
        refused.len() >= 10,
        "the full disk refused only {} requests",
        refused.len()
    );
    for key in &refused {
        assert_eq!(
            stack.upstream.executions(key),
            0,
            "a refused request was executed"
        );
    }

    disk.free("filler");
    let freed = Instant::now();
    let mut recovered = None;
    for key in &refused {
        // Each refused request, retried with its key, executes exactly once.
        loop {
            let a = send(stack.post("/pay", Some(key), PAYMENT)).await;
            match (a.status, a.problem().as_deref()) {
                (201, _) => break,
                (503, Some("store-unavailable")) if freed.elapsed() < Duration::from_secs(10) => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                _ => panic!("unexpected answer after space was freed: {a:?}"),
            }
        }
        recovered.get_or_insert_with(|| freed.elapsed());
        assert_eq!(stack.upstream.executions(key), 1);
    }
    eprintln!(
        "disk full through Envoy: {} executed, {} refused; served again {:?} after space was freed",
        executed.len(),
        refused.len(),
        recovered.unwrap_or_default()
    );
    // What executed before and while the disk was full never runs again. It
    // replays, unless the disk refused its completion after the upstream had
    // answered: the client got that answer, and the record stays in progress
    // until its lease turns it unknown (docs/contract.md §5).
    let mut unrecorded = 0;
    for key in executed.iter().chain([&before]) {
        let a = send(stack.post("/pay", Some(key), PAYMENT)).await;
        match (a.status, a.problem().as_deref()) {
            (201, _) => assert_eq!(a.header("idempotent-replayed"), Some("true"), "{key}: {a:?}"),
            (409, Some("request-in-progress" | "outcome-unknown")) => unrecorded += 1,
            _ => panic!("{key}: {a:?}"),
        }
        assert_eq!(stack.upstream.executions(key), 1, "{key} executed twice");
    }
    eprintln!("of those executed, {unrecorded} had their completion refused by the full disk");
}
