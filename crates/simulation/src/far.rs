//! The world's far side: the store's own HTTP app ([`idemgate_store::app`]:
//! authentication, the protocol's frames, batches, problem documents, the
//! service's waits, the budget of new keys, its effects) over the database
//! ([`crate::database`]), called in-process, with its clock moved by hand.
//!
//! Every call is a future the world keeps and polls itself, on a
//! current-thread runtime whose time is paused: the database completes
//! every call on its first poll, so a call that does not finish at once is
//! one the store holds (a claim waiting for another request's outcome, a
//! slow database), and it is polled again when its waker fires. Its wakers
//! are the world's: a wake-up from the store itself (a waiting claim
//! notified by a completion) is polled at the same moment; one from the
//! runtime's timers (a wait's nap, a slow call) is found by letting the
//! runtime's time run up to the world's next event ([`Far::run_until`]),
//! which stops at the first timer that fires. The runtime's clock and the
//! store's [`Clock`] only move when the world moves them, so a scenario
//! runs the same way every time.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::Request;
use axum::Router;
use futures_util::FutureExt;
use http_body_util::BodyExt;
use idemgate_core::grpc::Metadata;
use idemgate_core::protocol::{
    ClaimRequest, FRAME_CONTENT_TYPE, PROTOCOL_HEADER, PROTOCOL_OFFER, REPLAY_PATH,
};
use idemgate_core::trace::{Trace, TRACE_HEADER};
use idemgate_store::backend::KeyHistory;
use idemgate_store::sweeper::{sweep_all, SweepSettings};
use idemgate_store::{AppState, Clock, Settings, Store};
use tower::ServiceExt;

use crate::database::loss::{Loss, Lost};
use crate::database::{Database, Limited};
use crate::scenario::Budget;

/// The store's answer: its status and body.
pub type Answered = (u16, Vec<u8>);

/// The admin token nothing in the world uses: the audit reads the database.
const ADMIN_TOKEN: &str = "the simulation's operators never log in";

/// The store process, its database and the runtime it runs on.
pub struct Far {
    rt: tokio::runtime::Runtime,
    /// The runtime's instant at the world's time 0.
    epoch: tokio::time::Instant,
    clock: Clock,
    database: Arc<Database>,
    budget: Option<Budget>,
    api_token: String,
    store: Store,
    app: Router,
    /// A second replica on the same database, its clock this many
    /// milliseconds off the first's, and the calls it is given.
    second: Option<Replica>,
    /// Calls the store is deciding, in the order they arrived.
    calls: Vec<Call>,
    /// Claims refused as late and as over budget by the store processes
    /// that are gone (restarted).
    counted: (u64, u64),
    wakes: Arc<Wakes>,
}

/// Another store process on the same database, with a clock of its own.
struct Replica {
    skew_ms: i64,
    clock: Clock,
    store: Store,
    app: Router,
}

struct Call {
    /// The world's name for the call.
    token: u64,
    woken: Arc<Flag>,
    answer: Pin<Box<dyn Future<Output = Answered>>>,
}

/// Whether any call was woken, and who to tell.
#[derive(Default)]
struct Wakes {
    any: AtomicBool,
    /// The world, while it lets the runtime's time run.
    runner: Mutex<Option<Waker>>,
}

/// One call's waker: marks it, and stops the world's wait for the runtime.
struct Flag {
    woken: AtomicBool,
    wakes: Arc<Wakes>,
}

impl Wake for Flag {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.woken.store(true, Ordering::SeqCst);
        self.wakes.any.store(true, Ordering::SeqCst);
        let runner = self
            .wakes
            .runner
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(runner) = runner {
            runner.wake();
        }
    }
}

impl Far {
    /// A store on a fresh database, its clock at `start` (the world's
    /// time 0), with `api_token` and the budget of new keys `budget`; and
    /// with `skew_ms`, a second replica whose clock is that far off.
    pub fn new(
        database: Database,
        start: i64,
        api_token: &str,
        budget: Option<Budget>,
        skew_ms: Option<i64>,
    ) -> Far {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .unwrap_or_else(|e| panic!("the store's runtime: {e}"));
        let epoch = {
            let _in = rt.enter();
            tokio::time::Instant::now()
        };
        let clock = Clock::manual(start);
        let database = Arc::new(database);
        let store = store(&database, &clock, budget);
        let app = app(store.clone(), api_token);
        let second = skew_ms.map(|skew_ms| {
            let clock = Clock::manual(start + skew_ms);
            let store = self::store(&database, &clock, budget);
            Replica {
                skew_ms,
                clock,
                app: self::app(store.clone(), api_token),
                store,
            }
        });
        Far {
            rt,
            epoch,
            clock,
            database,
            budget,
            api_token: api_token.to_string(),
            store,
            app,
            second,
            calls: Vec::new(),
            counted: (0, 0),
            wakes: Arc::default(),
        }
    }

    /// The store process is killed and started again on the same database:
    /// the calls it was deciding are gone with their connections, and what
    /// it kept in memory (the budgets' buckets, waiting claims) with them.
    /// The database loses what `loss` takes, if anything (its server
    /// crashed or failed over, or it was restored from a backup, as the
    /// store restarted): what was lost, with how many of the store's
    /// `confirmed` answers came before.
    pub fn restart(&mut self, loss: Option<Loss>, confirmed: usize) -> Option<Lost> {
        let lost = {
            let _in = self.rt.enter();
            self.database.lose(loss, self.now(), confirmed)
        };
        self.calls.clear();
        self.counted = self.refused();
        self.store = store(&self.database, &self.clock, self.budget);
        self.app = app(self.store.clone(), &self.api_token);
        if let Some(r) = &mut self.second {
            r.store = store(&self.database, &r.clock, self.budget);
            r.app = app(r.store.clone(), &self.api_token);
        }
        lost
    }

    /// Claims the store refused so far: as late (past their caller's
    /// deadline), and as over their tenant's budget of new keys.
    pub fn refused(&self) -> (u64, u64) {
        let mut refused = self.counted;
        for store in std::iter::once(&self.store).chain(self.second.as_ref().map(|r| &r.store)) {
            refused.0 += store.metrics.late_claims.get();
            refused.1 += store.metrics.rate_limited_claims.get();
        }
        refused
    }

    /// Whether the store is still deciding a call.
    pub fn busy(&self) -> bool {
        !self.calls.is_empty()
    }

    /// A call reaches the store: `POST path` with `body`, as the filter
    /// sends it (its headers, `host::dispatch`'s). Its answer, if the store
    /// gives it at once, comes out of the next [`Far::settle`].
    /// `second`: the second replica takes it, if there is one.
    pub fn call(
        &mut self,
        token: u64,
        path: &str,
        body: Bytes,
        traces: &[Trace],
        authorization: &str,
        second: bool,
    ) {
        let mut req = Request::post(path)
            .header("authorization", authorization)
            .header("content-type", FRAME_CONTENT_TYPE)
            .header(PROTOCOL_HEADER, PROTOCOL_OFFER);
        if let Some(trace) = Trace::header(traces) {
            req = req.header(TRACE_HEADER, trace);
        }
        let req = req
            .body(Body::from(body))
            .unwrap_or_else(|e| panic!("a store call the world cannot send: {e}"));
        let app = match (&self.second, second) {
            (Some(r), true) => r.app.clone(),
            _ => self.app.clone(),
        };
        let answer = Box::pin(async move {
            let Ok(resp) = app.oneshot(req).await;
            let (parts, body) = resp.into_parts();
            let body = body
                .collect()
                .await
                .map(|b| b.to_bytes().to_vec())
                .unwrap_or_default();
            (parts.status.as_u16(), body)
        });
        let woken = Arc::new(Flag {
            woken: AtomicBool::new(true),
            wakes: Arc::clone(&self.wakes),
        });
        self.calls.push(Call { token, woken, answer });
    }

    /// The store's gRPC replay route, as Envoy's router reaches it for a
    /// call the filter rerouted there: the headers, messages and trailers
    /// it sends back. It reads nothing, so it answers at once.
    pub fn replay(&self, body: Vec<u8>) -> (Metadata, Vec<u8>, Metadata) {
        let req = Request::post(REPLAY_PATH)
            .header("content-type", FRAME_CONTENT_TYPE)
            .body(Body::from(body))
            .unwrap_or_else(|e| panic!("a replay the world cannot send: {e}"));
        let app = self.app.clone();
        let _in = self.rt.enter();
        let answer = async move {
            let Ok(resp) = app.oneshot(req).await;
            let (parts, body) = resp.into_parts();
            let collected = body.collect().await.ok();
            let fields = |map: Option<&axum::http::HeaderMap>| -> Metadata {
                map.into_iter()
                    .flatten()
                    .map(|(n, v)| (n.to_string(), String::from_utf8_lossy(v.as_bytes()).into_owned()))
                    .collect()
            };
            let trailers = fields(collected.as_ref().and_then(|c| c.trailers()));
            let body = collected.map(|c| c.to_bytes().to_vec()).unwrap_or_default();
            (fields(Some(&parts.headers)), body, trailers)
        };
        match answer.now_or_never() {
            Some(answer) => answer,
            None => panic!("the store's replay route did not answer at once"),
        }
    }

    /// Polls every call that was woken, again until none is, with the
    /// store's clock at `store_now`: the answers the store gave, in the
    /// order it gave them.
    pub fn settle(&mut self, store_now: i64) -> Vec<(u64, Answered)> {
        self.set_clock(store_now);
        let _in = self.rt.enter();
        let mut answers = Vec::new();
        loop {
            self.wakes.any.store(false, Ordering::SeqCst);
            let mut polled = false;
            let mut i = 0;
            while i < self.calls.len() {
                let call = &mut self.calls[i];
                if !call.woken.woken.swap(false, Ordering::SeqCst) {
                    i += 1;
                    continue;
                }
                polled = true;
                let waker = Waker::from(Arc::clone(&call.woken));
                match call.answer.as_mut().poll(&mut Context::from_waker(&waker)) {
                    Poll::Ready(answer) => {
                        let call = self.calls.remove(i);
                        answers.push((call.token, answer));
                    }
                    Poll::Pending => i += 1,
                }
            }
            if !polled {
                return answers;
            }
        }
    }

    /// Lets the runtime's time run up to the world's `until` (milliseconds
    /// since its start): the time at which a call the store holds was
    /// woken first, if one was by then.
    pub fn run_until(&mut self, until: i64) -> Option<i64> {
        let target = self.epoch + Duration::from_millis(until.max(0).unsigned_abs());
        let wakes = Arc::clone(&self.wakes);
        let woke = self.rt.block_on(async move {
            let sleep = tokio::time::sleep_until(target);
            let mut sleep = std::pin::pin!(sleep);
            std::future::poll_fn(|cx| {
                *wakes.runner.lock().unwrap_or_else(PoisonError::into_inner) = Some(cx.waker().clone());
                if wakes.any.load(Ordering::SeqCst) {
                    return Poll::Ready(true);
                }
                sleep.as_mut().poll(cx).map(|()| wakes.any.load(Ordering::SeqCst))
            })
            .await
        });
        *self.wakes.runner.lock().unwrap_or_else(PoisonError::into_inner) = None;
        woke.then(|| self.now())
    }

    /// The runtime's time, in the world's milliseconds.
    fn now(&self) -> i64 {
        let _in = self.rt.enter();
        let elapsed = tokio::time::Instant::now().saturating_duration_since(self.epoch);
        i64::try_from(elapsed.as_millis()).unwrap_or(i64::MAX)
    }

    fn set_clock(&self, store_now: i64) {
        self.clock.advance(store_now - self.clock.now());
        if let Some(r) = &self.second {
            r.clock.advance(store_now + r.skew_ms - r.clock.now());
        }
    }

    /// One pass of the store's sweeper, as its background job runs it
    /// (which also wakes the claims waiting in this process): whether it
    /// changed anything.
    pub fn sweep(&mut self, store_now: i64) -> bool {
        self.set_clock(store_now);
        let _in = self.rt.enter();
        let policy = SweepSettings::default().policy();
        match sweep_all(&self.store, &policy).now_or_never() {
            Some(Ok(report)) => report.total() > 0,
            other => panic!("the sweeper did not pass at once: {other:?}"),
        }
    }

    /// Every generation and event of `tenant`'s `key`, as the store keeps them.
    pub fn history(&self, tenant: &str, key: &str) -> KeyHistory {
        self.database.history(tenant, key)
    }

    /// The last look the store took at `req` over budget.
    pub fn looked_at(&self, req: &ClaimRequest) -> Option<Limited> {
        self.database.looked_at(req)
    }
}

fn store(database: &Arc<Database>, clock: &Clock, budget: Option<Budget>) -> Store {
    let backend: Arc<dyn idemgate_store::Backend> = Arc::clone(database) as _;
    let store = Store::new(backend, clock.clone());
    match budget.map(Budget::budgets) {
        None => store,
        Some(Ok(budgets)) => store.with_budgets(budgets),
        Some(Err(e)) => panic!("a budget the scenario let through: {e}"),
    }
}

fn app(store: Store, api_token: &str) -> Router {
    idemgate_store::app(AppState::new(store, Settings::new(api_token, ADMIN_TOKEN)))
}
