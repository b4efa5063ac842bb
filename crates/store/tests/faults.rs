//! Storage faults: the database stops answering, refuses, loses its
//! connections or restarts. Every call then fails promptly (the filter
//! answers 503 `store-unavailable`), nothing that was acknowledged is lost,
//! and the store recovers on its own once the database is back.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use idemgate_core::protocol::{encode_frame, ClaimReply, ClaimRequest, FenceReply};
use idemgate_store::backend::{Backend, Listing, Outage, StoreError, SweepPolicy};
use idemgate_store::clock::system_now;
use idemgate_store::database_url::{open_backend, BackendOptions};
use idemgate_store::postgres::PgTimeouts;
use idemgate_testkit::report::verdict;
use idemgate_testkit::tmpfs::{SmallDisk, Tmpfs};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::support::*;

/// The longest a failing call may take with the default timeouts, plus
/// room for a slow test machine.
fn bound() -> Duration {
    PgTimeouts::default().call() + Duration::from_millis(500)
}

async fn pg_store(url: &str, pool_size: usize) -> Arc<dyn Backend> {
    let opts = BackendOptions {
        pg_pool_size: Some(pool_size),
        ..BackendOptions::default()
    };
    let b = open_backend(url, &opts).await.unwrap();
    b.migrate().await.unwrap();
    b
}

async fn try_claim(b: &dyn Backend, req: &ClaimRequest) -> Result<ClaimReply, StoreError> {
    b.claim(req, system_now(), None).await.map(|o| o.reply)
}

/// Claims `key` until the store answers, and returns how long that took.
async fn until_claimed(b: &dyn Backend, key: &str, within: Duration) -> Duration {
    let started = Instant::now();
    loop {
        match try_claim(b, &claim(&scope(key), Some(1))).await {
            Ok(ClaimReply::Owned { .. }) => return started.elapsed(),
            Ok(other) => panic!("a fresh key was answered {other:?}"),
            Err(e) => assert!(
                started.elapsed() < within,
                "the store did not recover within {within:?}: {e}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A port whose machine is gone: connection attempts get no answer at all
/// (its accept queue is full and nobody accepts, so the kernel drops their
/// SYNs), as when packets to a dead host are dropped.
struct Gone {
    port: u16,
    _listener: tokio::net::TcpListener,
    _queued: Vec<std::net::TcpStream>,
}

impl Gone {
    fn start() -> Gone {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let listener = socket.listen(0).unwrap();
        let addr = listener.local_addr().unwrap();
        let mut queued = Vec::new();
        while let Ok(s) = std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200)) {
            queued.push(s);
            assert!(queued.len() < 16, "the accept queue never filled");
        }
        Gone {
            port: addr.port(),
            _listener: listener,
            _queued: queued,
        }
    }
}

/// A TCP proxy that can stop forwarding: while stopped it keeps every
/// connection open and swallows what either side sends, as a network that
/// drops packets does.
struct Blackhole {
    port: u16,
    forwarding: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

impl Blackhole {
    async fn start(target_port: u16) -> Blackhole {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let forwarding = Arc::new(AtomicBool::new(true));
        let on = Arc::clone(&forwarding);
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let on = Arc::clone(&on);
                tokio::spawn(async move {
                    let Ok(server) = TcpStream::connect(("127.0.0.1", target_port)).await else {
                        return;
                    };
                    let (cr, cw) = client.into_split();
                    let (sr, sw) = server.into_split();
                    tokio::join!(pipe(cr, sw, Arc::clone(&on)), pipe(sr, cw, on));
                });
            }
        });
        Blackhole {
            port,
            forwarding,
            task,
        }
    }

    fn set_forwarding(&self, on: bool) {
        self.forwarding.store(on, Ordering::SeqCst);
    }
}

impl Drop for Blackhole {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn pipe(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    on: Arc<AtomicBool>,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if on.load(Ordering::SeqCst) && to.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    let _ = to.shutdown().await;
}

fn port_of(url: &str) -> u16 {
    let after = url.split("127.0.0.1:").nth(1).unwrap();
    after.split('/').next().unwrap().parse().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_pool_exhaustion_fails_promptly_instead_of_hanging() {
    let _verdict = verdict(
        "storage fault: PostgreSQL pool exhausted",
        "the store on PostgreSQL, a pool of 2, claims while another session locks the records table",
        "every pooled connection waits on a lock; calls fail within the bound, then recover once it is released",
    );
    let cluster = shared_cluster();
    let url = cluster.fresh_database().await;
    let b = pg_store(&url, 2).await;
    // Another session locks the table: every statement of the store waits.
    let (locker, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    locker
        .batch_execute("BEGIN; LOCK TABLE idempotency_records IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();

    // Eight slow calls on two connections: two wait for the lock until their
    // statement times out, the others for a connection until the pool's wait does.
    let started = Instant::now();
    let calls = (0..8).map(|i| {
        let b = Arc::clone(&b);
        tokio::spawn(async move {
            let req = claim(&scope(&format!("k-exhaust-{i}")), Some(1));
            let out = tokio::time::timeout(Duration::from_secs(10), try_claim(&*b, &req)).await;
            (out, started.elapsed())
        })
    });
    let mut statement_timeouts = 0;
    for call in futures_util::future::join_all(calls).await {
        let (out, took) = call.unwrap();
        let out = out.expect("a call hung on an exhausted pool");
        let Err(StoreError::Unavailable { outage, source }) = out else {
            panic!("{out:?}")
        };
        // The server cancelled the statement: a timeout, not a failure.
        if source.to_string().contains("statement timeout") {
            assert_eq!(outage, Outage::Timeout, "{source}");
            statement_timeouts += 1;
        }
        assert!(took < bound(), "a call failed only after {took:?}");
    }
    // The calls that had a connection were stopped by the server.
    assert!(
        statement_timeouts >= 1,
        "no statement was cancelled by statement_timeout"
    );

    locker.batch_execute("ROLLBACK").await.unwrap();
    let took = until_claimed(&*b, "k-exhaust-after", bound()).await;
    eprintln!("pool exhaustion: recovered {took:?} after the lock went");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blackholed_postgres_fails_within_the_bound_and_recovers_when_it_forwards_again() {
    let _verdict = verdict(
        "storage fault: PostgreSQL blackholed",
        "the store on PostgreSQL through a TCP proxy, claims and completions before, during and after",
        "the proxy stops forwarding (no reset, no answer); calls fail within the bound, nothing acknowledged is lost, recovery once it forwards again",
    );
    let cluster = shared_cluster();
    let url = cluster.fresh_database().await;
    let proxy = Blackhole::start(port_of(&url)).await;
    let via_proxy = url.replace(&format!(":{}/", port_of(&url)), &format!(":{}/", proxy.port));
    let b = pg_store(&via_proxy, 4).await;

    let done = scope("k-hole-done");
    let ClaimReply::Owned { fence } = try_claim(&*b, &claim(&done, Some(1))).await.unwrap() else {
        panic!("not owned")
    };
    let completed = b
        .complete(&complete(&done, fence, 201), b"kept", system_now())
        .await;
    assert_eq!(completed.unwrap(), FenceReply::Done);

    proxy.set_forwarding(false);
    for i in 0..6 {
        let started = Instant::now();
        let out = tokio::time::timeout(
            Duration::from_secs(10),
            try_claim(&*b, &claim(&scope(&format!("k-hole-{i}")), Some(1))),
        )
        .await
        .expect("a call hung behind the blackhole");
        assert!(matches!(out, Err(StoreError::Unavailable { .. })), "{out:?}");
        assert!(
            started.elapsed() < bound(),
            "failed only after {:?}",
            started.elapsed()
        );
    }
    let fenced = tokio::time::timeout(
        Duration::from_secs(10),
        b.release(&crate::support::fence(&scope("k-hole-x"), 1), system_now()),
    )
    .await
    .expect("a release hung behind the blackhole");
    assert!(fenced.is_err());
    // An operator's listing too.
    let started = Instant::now();
    let listed = tokio::time::timeout(
        Duration::from_secs(10),
        b.list(Listing::Unknown, system_now(), 10),
    )
    .await
    .expect("a listing hung behind the blackhole");
    assert!(listed.is_err());
    assert!(
        started.elapsed() < bound(),
        "failed only after {:?}",
        started.elapsed()
    );

    proxy.set_forwarding(true);
    let took = until_claimed(&*b, "k-hole-after", bound() * 2).await;
    eprintln!("blackhole: recovered {took:?} after forwarding resumed");
    let reply = try_claim(&*b, &claim(&done, Some(1))).await.unwrap();
    assert!(
        matches!(reply, ClaimReply::Replay { status: 201, .. }),
        "{reply:?}"
    );
    let policy = SweepPolicy {
        batch: 100,
        audit_retention_ms: 1_000,
    };
    b.sweep(system_now(), &policy).await.unwrap();
}

/// What traffic was told: claims acknowledged as owned, and of those the
/// ones whose completion was acknowledged.
#[derive(Default)]
struct Acknowledged {
    claimed: Vec<String>,
    completed: Vec<String>,
}

/// Claims and completes `n` keys named `prefix-i`, counting what succeeded.
async fn traffic(b: Arc<dyn Backend>, prefix: String, n: usize) -> Acknowledged {
    let mut acked = Acknowledged::default();
    for i in 0..n {
        let key = format!("{prefix}-{i}");
        let s = scope(&key);
        let Ok(ClaimReply::Owned { fence }) = try_claim(&*b, &claim(&s, Some(1))).await else {
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        acked.claimed.push(key.clone());
        if let Ok(FenceReply::Done) = b.complete(&complete(&s, fence, 201), b"done", system_now()).await {
            acked.completed.push(key);
        }
    }
    acked
}

/// Every acknowledged claim is still there (never claimable again: that
/// would run it twice), and every acknowledged completion replays — unless
/// the database crashed: a completion commits without waiting for its WAL
/// flush, so a crash may undo it and the record turns unknown instead
/// (docs/contract.md §5).
async fn nothing_acknowledged_is_lost(b: &dyn Backend, acked: &Acknowledged, crashed: bool) {
    for key in &acked.claimed {
        let reply = try_claim(b, &claim(&scope(key), Some(1))).await.unwrap();
        assert_kept(key, &reply, acked.completed.contains(key) && !crashed);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terminated_postgres_connections_lose_nothing_acknowledged() {
    let _verdict = verdict(
        "storage fault: PostgreSQL connections terminated",
        "4 clients, 600 claims and completions on PostgreSQL",
        "pg_terminate_backend of the store's connections 5 times mid-traffic; nothing acknowledged is lost",
    );
    let cluster = shared_cluster();
    let url = cluster.fresh_database().await;
    let b = pg_store(&url, 4).await;
    let (admin, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);

    let workers: Vec<_> = (0..4)
        .map(|w| tokio::spawn(traffic(Arc::clone(&b), format!("k-term-{w}"), 150)))
        .collect();
    for _ in 0..5 {
        tokio::time::sleep(Duration::from_millis(60)).await;
        admin
            .batch_execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                 WHERE datname = current_database() AND pid <> pg_backend_pid()",
            )
            .await
            .unwrap();
    }
    let mut all = Acknowledged::default();
    for w in workers {
        let acked = w.await.unwrap();
        all.claimed.extend(acked.claimed);
        all.completed.extend(acked.completed);
    }
    assert!(
        all.completed.len() > 100,
        "too little traffic got through: {}",
        all.completed.len()
    );
    let took = until_claimed(&*b, "k-term-after", bound()).await;
    eprintln!("terminated connections: next call answered after {took:?}");
    nothing_acknowledged_is_lost(&*b, &all, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_postgres_loses_nothing_acknowledged_and_the_store_recovers() {
    let _verdict = verdict(
        "storage fault: PostgreSQL crashed and restarted",
        "2 clients, 300 claims and completions on PostgreSQL",
        "an immediate stop and restart of the server mid-traffic; nothing acknowledged is lost, the store recovers without a restart",
    );
    let cluster = Arc::new(pg::PgCluster::start());
    let url = cluster.fresh_database().await;
    let b = pg_store(&url, 4).await;

    let workers: Vec<_> = (0..2)
        .map(|w| tokio::spawn(traffic(Arc::clone(&b), format!("k-restart-{w}"), 150)))
        .collect();
    tokio::time::sleep(Duration::from_millis(150)).await;
    let restarted = Arc::clone(&cluster);
    tokio::task::spawn_blocking(move || restarted.crash_and_restart())
        .await
        .unwrap();
    let restarted_at = Instant::now();
    let mut all = Acknowledged::default();
    for w in workers {
        let acked = w.await.unwrap();
        all.claimed.extend(acked.claimed);
        all.completed.extend(acked.completed);
    }
    let took = until_claimed(&*b, "k-restart-after", bound()).await;
    eprintln!(
        "server restart: next call answered {took:?} after trying ({:?} after the server was back)",
        restarted_at.elapsed()
    );
    nothing_acknowledged_is_lost(&*b, &all, true).await;
}

/// Claims and completes `key` over HTTP, noting what was acknowledged.
/// Every answer is 200 or 503: a failure is never anything but "unavailable".
async fn http_traffic(
    c: &HttpClient,
    p: &StoreProcess,
    key: &str,
    body: &[u8],
    acked: &mut Acknowledged,
) -> bool {
    let s = scope(key);
    let (status, reply) = http_claim(c, p, &claim(&s, Some(1))).await;
    assert!(status == 200 || status == 503, "claim {key}: {status}");
    let Some(ClaimReply::Owned { fence }) = reply else {
        assert!(reply.is_none(), "claim {key}: {reply:?}");
        return false;
    };
    acked.claimed.push(key.to_string());
    let (status, reply) = http_complete(c, p, &s, fence, body).await;
    assert!(status == 200 || status == 503, "complete {key}: {status}");
    if reply == Some(FenceReply::Done) {
        acked.completed.push(key.to_string());
        return true;
    }
    false
}

/// What a claim of an acknowledged key finds: its replay when its completion
/// was acknowledged (and kept), else at least the claim.
fn assert_kept(key: &str, reply: &ClaimReply, completed: bool) {
    if completed {
        assert!(
            matches!(reply, ClaimReply::Replay { status: 201, .. }),
            "{key}: {reply:?}"
        );
    } else {
        assert!(
            matches!(
                reply,
                ClaimReply::Replay { .. } | ClaimReply::InProgress { .. } | ClaimReply::Unknown
            ),
            "{key}: an acknowledged claim was lost: {reply:?}"
        );
    }
}

/// Over HTTP: see [`nothing_acknowledged_is_lost`].
async fn http_nothing_acknowledged_is_lost(c: &HttpClient, p: &StoreProcess, acked: &Acknowledged) {
    for key in &acked.claimed {
        let (status, reply) = http_claim(c, p, &claim(&scope(key), Some(1))).await;
        assert_eq!(status, 200, "{key}");
        assert_kept(key, &reply.unwrap(), acked.completed.contains(key));
    }
}

/// Claims fresh keys over HTTP until one is owned; how long that took.
async fn http_until_claimed(c: &HttpClient, p: &StoreProcess, prefix: &str, within: Duration) -> Duration {
    let started = Instant::now();
    for i in 0.. {
        let (status, reply) = http_claim(c, p, &claim(&scope(&format!("{prefix}-{i}")), Some(1))).await;
        if status == 200 {
            assert!(matches!(reply, Some(ClaimReply::Owned { .. })), "{reply:?}");
            return started.elapsed();
        }
        assert_eq!(status, 503);
        assert!(
            started.elapsed() < within,
            "the store did not recover within {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    unreachable!()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_fails_sqlite_writes_closed_and_the_store_recovers_once_space_is_freed() {
    let verdict = verdict(
        "storage fault: SQLite disk full (store)",
        "the store on SQLite on a 6 MiB tmpfs, claims with 48 KiB bodies",
        "the disk filled mid-traffic; writes fail closed (503) without undoing another job of the batch, nothing acknowledged is lost, recovery once space is freed",
    );
    let test = "faults::a_full_disk_fails_sqlite_writes_closed_and_the_store_recovers_once_space_is_freed";
    let disk = match SmallDisk::mount("6m", test) {
        Tmpfs::Here(disk) => disk,
        // It passed there (had it failed, so would this run): `passed`.
        Tmpfs::RanInUserNamespace => return,
        Tmpfs::Unavailable(why) => return verdict.skip(&why),
    };
    let c = client();
    let p = StoreProcess::start(&format!("sqlite://{}", disk.path("store.db").display())).await;
    let body = vec![b'x'; 48 * 1024];
    let mut acked = Acknowledged::default();
    assert!(http_traffic(&c, &p, "k-full-before", &body, &mut acked).await);

    disk.fill("filler");
    let mut failed = 0;
    for i in 0..300 {
        if !http_traffic(&c, &p, &format!("k-full-{i}"), &body, &mut acked).await {
            failed += 1;
        }
        if failed >= 10 {
            break;
        }
    }
    assert!(failed >= 10, "the full disk never refused a write");
    // Reads go on: a completed record still replays.
    let (status, reply) = http_claim(&c, &p, &claim(&scope("k-full-before"), Some(1))).await;
    assert_eq!(status, 200);
    assert!(
        matches!(reply, Some(ClaimReply::Replay { status: 201, .. })),
        "{reply:?}"
    );

    disk.free("filler");
    let took = http_until_claimed(&c, &p, "k-full-after", Duration::from_secs(5)).await;
    eprintln!("disk full: recovered {took:?} after space was freed ({failed} calls refused)");
    http_nothing_acknowledged_is_lost(&c, &p, &acked).await;
    assert!(http_traffic(&c, &p, "k-full-later", &body, &mut acked).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_sqlite_writer_holding_the_lock_gets_503_within_the_busy_timeout_then_the_store_recovers() {
    let _verdict = verdict(
        "storage fault: a second SQLite writer holds the lock",
        "the store on SQLite, claims while another connection holds BEGIN IMMEDIATE",
        "the write lock held by another process; 503 within the busy timeout, recovery once it lets go, nothing acknowledged is lost",
    );
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store.db");
    let c = client();
    let p = StoreProcess::start(&format!("sqlite://{}", path.display())).await;
    let mut acked = Acknowledged::default();
    assert!(http_traffic(&c, &p, "k-busy-before", b"kept", &mut acked).await);

    let other = rusqlite::Connection::open(&path).unwrap();
    other.execute_batch("BEGIN IMMEDIATE").unwrap();
    let started = Instant::now();
    let (status, _) = http_claim(&c, &p, &claim(&scope("k-busy-0"), Some(1))).await;
    let took = started.elapsed();
    assert_eq!(status, 503);
    // The writer's busy timeout is 5 s.
    assert!(took < Duration::from_secs(7), "answered only after {took:?}");
    eprintln!("second writer: 503 after {took:?}");
    // Reads are not blocked by it.
    let (status, reply) = http_claim(&c, &p, &claim(&scope("k-busy-before"), Some(1))).await;
    assert_eq!(status, 200);
    assert!(matches!(reply, Some(ClaimReply::Replay { .. })), "{reply:?}");

    other.execute_batch("ROLLBACK").unwrap();
    let took = http_until_claimed(&c, &p, "k-busy-after", Duration::from_secs(2)).await;
    eprintln!("second writer: recovered {took:?} after it let go");
    http_nothing_acknowledged_is_lost(&c, &p, &acked).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_postgres_timeout_flags_reach_the_pool_and_the_server() {
    let _verdict = verdict(
        "storage fault: PostgreSQL timeouts configured",
        "the store process with --pg-statement-timeout-ms, --pg-wait-timeout-ms, --pg-connect-timeout-ms",
        "a statement longer than the timeout is cancelled by the server; the pool gives up waiting",
    );
    let cluster = shared_cluster();
    let url = cluster.fresh_database().await;
    let port = free_port();
    let bin = std::path::Path::new(env!("CARGO_BIN_EXE_idempotency-store"));
    let mut serve = idemgate_testkit::store::serve(bin, port, &url, API, ADMIN, "warn");
    serve.args(["--pg-statement-timeout-ms", "100", "--pg-wait-timeout-ms", "50"]);
    serve.args([
        "--pg-connect-timeout-ms",
        "200",
        "--pg-pool-size",
        "2",
        "--no-sweeper",
    ]);
    let log = std::env::temp_dir().join(format!("idempotency-store-test-{port}.log"));
    let store = Proc::spawn("store", &mut serve, log);
    let c = client();
    let ready = format!("http://127.0.0.1:{port}/readyz");
    eventually("the store to be ready", Duration::from_secs(30), || {
        let (c, ready) = (c.clone(), ready.clone());
        async move { matches!(c.get(ready.parse().unwrap()).await, Ok(r) if r.status() == 200) }
    })
    .await;

    let (locker, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    locker
        .batch_execute("BEGIN; LOCK TABLE idempotency_records IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();
    let claim_url = format!("http://127.0.0.1:{port}/v1/claim");
    let started = Instant::now();
    let r = request(
        &c,
        "POST",
        &claim_url,
        Some(API),
        encode_frame(&claim(&scope("k-flags"), Some(1)), b""),
    )
    .await;
    let took = started.elapsed();
    assert_eq!(r.status, 503);
    // The defaults (750 ms statement timeout) would take far longer.
    assert!(took < Duration::from_millis(500), "answered after {took:?}");
    locker.batch_execute("ROLLBACK").await.unwrap();
    let r = request(
        &c,
        "POST",
        &claim_url,
        Some(API),
        encode_frame(&claim(&scope("k-flags"), Some(1)), b""),
    )
    .await;
    assert_eq!(r.status, 200);
    assert!(store.log().contains("statement timeout"), "{}", store.log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_multi_host_url_whose_first_host_is_gone_reaches_the_next_within_the_bound() {
    let _verdict = verdict(
        "storage fault: the first host of a multi-host URL is gone",
        "the store on a two-host PostgreSQL URL (target_session_attrs=read-write) whose first host drops every connection attempt",
        "packets to the first host dropped (a full accept queue); the store reaches the second host within the connect timeout per host",
    );
    let cluster = shared_cluster();
    let url = cluster.fresh_database().await;
    let gone = Gone::start();
    let port = port_of(&url);
    let both = format!(
        "{}?target_session_attrs=read-write",
        url.replace(
            &format!("127.0.0.1:{port}/"),
            &format!("127.0.0.1:{},127.0.0.1:{port}/", gone.port)
        )
    );
    let b = pg_store(&both, 2).await;
    let within = PgTimeouts::default().connect * 2 + bound();
    let took = until_claimed(&*b, "k-gone-first", within).await;
    eprintln!("first host gone: claimed after {took:?}");
}

/// A multi-host URL that says nothing about the session it wants, its
/// first host a streaming hot standby: the standby accepts connections and
/// refuses every write, so a store that kept the first host to answer would
/// fail every claim there (or, worse, answer lookups from a copy that lags).
/// The store passes the standby over and writes on the primary, with the
/// URL as the command line takes it and in the key-value form the library
/// also takes; `inspect`, whose sessions are read-only, reads the primary
/// too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_multi_host_url_naming_a_standby_first_writes_on_the_primary() {
    let _verdict = verdict(
        "storage fault: the first host of a multi-host URL is a standby",
        "the store on a two-host PostgreSQL URL without target_session_attrs, a streaming hot standby first and its primary second",
        "the standby accepts connections and refuses writes; the store claims, completes and replays on the primary",
    );
    let primary = pg::PgCluster::start();
    let url = primary.fresh_database().await;
    let db = url.rsplit('/').next().unwrap().to_string();
    // The schema before the base backup: the standby starts with it.
    drop(pg_store(&url, 1).await);
    let standby = tokio::task::block_in_place(|| pg::PgCluster::standby_of(&primary, &[]));
    assert_eq!(standby.query("SELECT pg_is_in_recovery()"), "t");

    let forms = [
        format!(
            "postgres://idem@127.0.0.1:{},127.0.0.1:{}/{db}",
            standby.port, primary.port
        ),
        format!(
            "host=127.0.0.1,127.0.0.1 port={},{} user=idem dbname={db}",
            standby.port, primary.port
        ),
    ];
    for (n, both) in forms.iter().enumerate() {
        let b: Arc<dyn Backend> = if both.starts_with("postgres://") {
            pg_store(both, 2).await
        } else {
            let log_ids = idemgate_store::log_ids::LogIds::random().unwrap();
            let session = idemgate_store::postgres::PgSession::default();
            let pg = idemgate_store::postgres::Postgres::connect_with(
                both,
                2,
                PgTimeouts::default(),
                session,
                log_ids,
                idemgate_store::sealing::Seal::off(),
            );
            Arc::new(pg.unwrap())
        };
        let s = scope(&format!("k-standby-first-{n}"));
        let fence = match try_claim(&*b, &claim(&s, Some(1))).await {
            Ok(ClaimReply::Owned { fence }) => fence,
            other => panic!("{both}: a fresh key was answered {other:?}"),
        };
        let done = b.complete(&complete(&s, fence, 201), b"paid", system_now()).await;
        assert!(
            matches!(done, Ok(FenceReply::Done)),
            "{both}: the completion was answered {done:?}"
        );
        match try_claim(&*b, &claim(&s, Some(1))).await {
            Ok(ClaimReply::Replay { .. }) => {}
            other => panic!("{both}: the retry was answered {other:?}"),
        }
    }
    assert_eq!(
        primary.query_in(
            &db,
            "SELECT count(*) FROM idempotency_records WHERE response_status = 201"
        ),
        "2",
        "the completions are not on the primary"
    );

    let bin = std::path::Path::new(env!("CARGO_BIN_EXE_idempotency-store"));
    let (ok, out, err) = idemgate_testkit::store::run(
        bin,
        &forms[0],
        &["inspect", "--tenant", "acme", "--key", "k-standby-first-0"],
    );
    assert!(ok, "inspect on the two-host URL: {err}");
    assert!(out.contains("completed"), "{out}");

    // A URL may not ask a writing command for a session that need not
    // take writes; `inspect` may, to read a standby knowingly.
    let on_standby = format!("postgres://idem@127.0.0.1:{}/{db}", standby.port);
    let (ok, _, err) =
        idemgate_testkit::store::run(bin, &format!("{on_standby}?target_session_attrs=any"), &["sweep"]);
    assert!(!ok && err.contains("target_session_attrs"), "{err}");
    let (ok, _, err) = idemgate_testkit::store::run(bin, &on_standby, &["inspect", "--unknown"]);
    assert!(!ok && err.contains("does not allow writes"), "{err}");
    let (ok, _, err) = idemgate_testkit::store::run(
        bin,
        &format!("{on_standby}?target_session_attrs=any"),
        &["inspect", "--unknown"],
    );
    assert!(ok, "inspect on the standby, asked for: {err}");
}
