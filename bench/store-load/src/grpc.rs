//! gRPC unary calls for `make bench`: a load generator that varies the
//! `idempotency-key` per call (what h2load cannot do, and wrk cannot speak
//! HTTP/2), and a trivial gRPC upstream for Envoy to forward to.
//!
//! ```text
//! idempotency-grpc-bench upstream --listen 127.0.0.1:PORT
//! idempotency-grpc-bench load --target 127.0.0.1:PORT --mode unique --prefix P ...
//! ```
//!
//! `upstream` answers every call on any path with one message frame (the
//! request's message, echoed) and the trailers `grpc-status: 0`, over
//! HTTP/2 with prior knowledge (h2c), as gRPC servers do.
//!
//! `load` sends gRPC unary calls (`content-type: application/grpc`,
//! `te: trailers`, one 5-byte length-prefixed message frame) over
//! `--streams` concurrent streams spread over `--connections` HTTP/2
//! connections, for `--warmup` seconds (not measured), then `--seconds`,
//! and prints one JSON line in the shape of `bench/lua/post.lua`'s: calls,
//! calls per second, latency percentiles (µs) and error counts. A call is
//! good when the response is a 200 whose `grpc-status` (trailers, or the
//! headers of a trailers-only answer) is 0, and with `--expect-replayed`
//! when its headers also carry `idempotent-replayed: true`; every other
//! answer counts in `err_status`. Keys, by `--mode`:
//!
//! - `unique`: a new key per call, `PREFIX-<stream>-<n>`;
//! - `pool`: keys `PREFIX-<n mod POOL>`, so after one pass every call retries a
//!   completed key (`--prime` makes that pass first, one call per key, each
//!   of which must be good);
//! - `none`: no `idempotency-key`.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{BufMut, Bytes, BytesMut};
use clap::{Parser, Subcommand, ValueEnum};
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http2::SendRequest;
use hyper::header::{HeaderMap, HeaderValue};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo};

#[derive(Parser)]
#[command(about = "gRPC unary calls for make bench: a load generator and a trivial upstream")]
struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// A gRPC server answering every unary call with its own message and `grpc-status: 0`.
    Upstream {
        /// Address to listen on.
        #[arg(long)]
        listen: SocketAddr,
        /// Runtime threads (1: as single-threaded as the HTTP scenarios' Node upstream).
        #[arg(long, default_value_t = 1)]
        threads: usize,
    },
    /// gRPC unary calls at a fixed concurrency; prints one JSON line.
    Load(Load),
}

#[derive(Parser, Clone)]
struct Load {
    /// host:port of the gRPC server (Envoy's listener).
    #[arg(long)]
    target: SocketAddr,
    /// The method's path.
    #[arg(long, default_value = "/bench.v1.Ledger/Transfer")]
    path: String,
    /// How each call's idempotency-key is chosen.
    #[arg(long, value_enum, default_value_t = Mode::Unique)]
    mode: Mode,
    /// Every key starts with it (each run its own).
    #[arg(long, default_value = "k")]
    prefix: String,
    /// Keys in `pool` mode.
    #[arg(long, default_value_t = 1000)]
    pool: u64,
    /// In `pool` mode, first one call per key (all must be good), unmeasured.
    #[arg(long)]
    prime: bool,
    /// HTTP/2 connections; the streams are spread over them.
    #[arg(long, default_value_t = 4)]
    connections: usize,
    /// Calls in flight at once (each stream makes one call after another).
    #[arg(long, default_value_t = 32)]
    streams: usize,
    /// Measured seconds.
    #[arg(long, default_value_t = 10.0)]
    seconds: f64,
    /// Unmeasured seconds first, on the same connections.
    #[arg(long, default_value_t = 2.0)]
    warmup: f64,
    /// A call is good only if its headers carry `idempotent-replayed: true`.
    #[arg(long)]
    expect_replayed: bool,
    /// A call taking longer counts as a timeout (ms).
    #[arg(long, default_value_t = 15_000)]
    timeout_ms: u64,
    /// Runtime threads (1: as wrk -t1).
    #[arg(long, default_value_t = 1)]
    threads: usize,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Mode {
    Unique,
    Pool,
    None,
}

/// One length-prefixed gRPC message frame (uncompressed).
fn message_frame(message: &[u8]) -> Bytes {
    let mut frame = BytesMut::with_capacity(5 + message.len());
    frame.put_u8(0);
    frame.put_u32(message.len() as u32);
    frame.put_slice(message);
    frame.freeze()
}

/// The request's message, a small transfer as the HTTP scenarios' JSON body.
const MESSAGE: &[u8] = b"amount=1000;currency=EUR;note=bench";

// ---------------------------------------------------------------- upstream

async fn answer(req: Request<hyper::body::Incoming>) -> Result<Response<BoxBody>, hyper::Error> {
    let body = req.into_body().collect().await?.to_bytes();
    // The first message frame of the request, echoed; an empty one if none.
    let message = body
        .get(5..)
        .and_then(|rest| {
            let len = u32::from_be_bytes([*body.get(1)?, *body.get(2)?, *body.get(3)?, *body.get(4)?]);
            rest.get(..len as usize)
        })
        .unwrap_or_default();
    let mut trailers = HeaderMap::new();
    trailers.insert("grpc-status", HeaderValue::from_static("0"));
    let body = Full::new(message_frame(message))
        .with_trailers(async move { Some(Ok::<_, std::convert::Infallible>(trailers)) })
        .boxed();
    let mut resp = Response::new(body);
    resp.headers_mut()
        .insert("content-type", HeaderValue::from_static("application/grpc"));
    Ok(resp)
}

type BoxBody = http_body_util::combinators::BoxBody<Bytes, std::convert::Infallible>;

async fn upstream(listen: SocketAddr) -> Result<(), String> {
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|e| format!("{listen}: {e}"))?;
    println!("listening on {listen}");
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(conn) => conn,
            Err(e) => {
                eprintln!("accept: {e}");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        tokio::spawn(async move {
            let served = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(stream), hyper::service::service_fn(answer))
                .await;
            if let Err(e) = served {
                eprintln!("connection: {e}");
            }
        });
    }
}

// ---------------------------------------------------------------- load

type Sender = SendRequest<Full<Bytes>>;

async fn connect(target: SocketAddr) -> Result<Sender, String> {
    let stream = tokio::net::TcpStream::connect(target)
        .await
        .map_err(|e| format!("connect {target}: {e}"))?;
    let _ = stream.set_nodelay(true);
    let (sender, conn) = hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
        .await
        .map_err(|e| format!("handshake {target}: {e}"))?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(sender)
}

/// What became of one call.
enum Outcome {
    Good,
    /// Answered, but not as a good call: not a 200, `grpc-status` other than
    /// 0 or missing, or (with `--expect-replayed`) not a replay.
    Bad(Bad),
    /// The stream or the connection failed.
    Failed,
    Timeout,
}

enum Bad {
    HttpStatus,
    GrpcStatus,
    NotReplayed,
}

fn grpc_status(fields: &HeaderMap) -> Option<&[u8]> {
    fields.get("grpc-status").map(HeaderValue::as_bytes)
}

async fn call(sender: &mut Sender, load: &Load, key: Option<String>) -> Outcome {
    let mut req = Request::post(format!("http://{}{}", load.target, load.path))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .header("x-tenant-id", "bench")
        .header("x-user-id", "bench");
    if let Some(key) = key {
        req = req.header("idempotency-key", key);
    }
    let Ok(req) = req.body(Full::new(message_frame(MESSAGE))) else {
        return Outcome::Failed;
    };
    let exchange = async {
        if sender.ready().await.is_err() {
            return Outcome::Failed;
        }
        let Ok(resp) = sender.send_request(req).await else {
            return Outcome::Failed;
        };
        let (parts, body) = resp.into_parts();
        let Ok(collected) = body.collect().await else {
            return Outcome::Failed;
        };
        if parts.status != StatusCode::OK {
            return Outcome::Bad(Bad::HttpStatus);
        }
        // A trailers-only answer carries its status in the headers.
        let status = collected
            .trailers()
            .and_then(grpc_status)
            .or_else(|| grpc_status(&parts.headers));
        if status != Some(b"0") {
            return Outcome::Bad(Bad::GrpcStatus);
        }
        let replayed = parts
            .headers
            .get("idempotent-replayed")
            .is_some_and(|v| v.as_bytes() == b"true");
        if load.expect_replayed && !replayed {
            return Outcome::Bad(Bad::NotReplayed);
        }
        Outcome::Good
    };
    match tokio::time::timeout(Duration::from_millis(load.timeout_ms), exchange).await {
        Ok(outcome) => outcome,
        Err(_) => Outcome::Timeout,
    }
}

#[derive(Default)]
struct Tally {
    latencies_us: Vec<u64>,
    good: u64,
    http_status: u64,
    grpc_status: u64,
    not_replayed: u64,
    failed: u64,
    timeouts: u64,
    reconnects: u64,
    connect_errors: u64,
}

impl Tally {
    fn add(&mut self, other: Tally) {
        self.latencies_us.extend(other.latencies_us);
        self.good += other.good;
        self.http_status += other.http_status;
        self.grpc_status += other.grpc_status;
        self.not_replayed += other.not_replayed;
        self.failed += other.failed;
        self.timeouts += other.timeouts;
        self.reconnects += other.reconnects;
        self.connect_errors += other.connect_errors;
    }

    fn bad(&self) -> u64 {
        self.http_status + self.grpc_status + self.not_replayed
    }
}

/// Which keys the streams use.
struct Keys {
    mode: Mode,
    prefix: String,
    pool: u64,
    next: AtomicU64,
}

impl Keys {
    fn key(&self, stream: usize, n: u64) -> Option<String> {
        match self.mode {
            Mode::Unique => Some(format!("{}-{stream}-{n}", self.prefix)),
            Mode::Pool => {
                let i = self.next.fetch_add(1, Ordering::Relaxed) % self.pool.max(1);
                Some(format!("{}-{i}", self.prefix))
            }
            Mode::None => None,
        }
    }
}

/// Every stream makes one call after another on its connection until
/// `until`; calls that end after it are counted too (as wrk does).
async fn run(load: &Arc<Load>, senders: &[Sender], keys: Arc<Keys>, until: Instant) -> Tally {
    let mut tasks = Vec::with_capacity(load.streams);
    for s in 0..load.streams {
        let Some(sender) = senders.get(s % senders.len().max(1)).cloned() else {
            break;
        };
        let load = load.clone();
        let keys = keys.clone();
        tasks.push(tokio::spawn(async move {
            let mut sender = sender;
            let mut tally = Tally::default();
            let mut n = 0;
            while Instant::now() < until {
                if sender.is_closed() {
                    match connect(load.target).await {
                        Ok(fresh) => {
                            sender = fresh;
                            tally.reconnects += 1;
                        }
                        Err(_) => {
                            tally.connect_errors += 1;
                            tokio::time::sleep(Duration::from_millis(10)).await;
                            continue;
                        }
                    }
                }
                let t = Instant::now();
                let outcome = call(&mut sender, &load, keys.key(s, n)).await;
                n += 1;
                match outcome {
                    Outcome::Good => tally.good += 1,
                    Outcome::Bad(Bad::HttpStatus) => tally.http_status += 1,
                    Outcome::Bad(Bad::GrpcStatus) => tally.grpc_status += 1,
                    Outcome::Bad(Bad::NotReplayed) => tally.not_replayed += 1,
                    Outcome::Failed => {
                        tally.failed += 1;
                        continue;
                    }
                    Outcome::Timeout => {
                        tally.timeouts += 1;
                        continue;
                    }
                }
                tally.latencies_us.push(t.elapsed().as_micros() as u64);
            }
            tally
        }));
    }
    let mut total = Tally::default();
    for task in tasks {
        match task.await {
            Ok(tally) => total.add(tally),
            Err(_) => total.failed += 1,
        }
    }
    total
}

/// One call per key of the pool, `--streams` at a time; all must be good.
async fn prime(load: &Arc<Load>, senders: &[Sender]) -> Result<(), String> {
    let next = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for s in 0..load.streams {
        let Some(mut sender) = senders.get(s % senders.len().max(1)).cloned() else {
            break;
        };
        let (load, next) = (load.clone(), next.clone());
        tasks.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= load.pool {
                    return Ok(());
                }
                let key = format!("{}-{i}", load.prefix);
                if !matches!(call(&mut sender, &load, Some(key.clone())).await, Outcome::Good) {
                    return Err(format!("priming {key}: the call was not good"));
                }
            }
        }));
    }
    for task in tasks {
        task.await.map_err(|e| e.to_string())??;
    }
    Ok(())
}

fn percentile(sorted: &[u64], p: f64) -> u64 {
    let i = ((sorted.len() as f64 * p / 100.0) as usize).min(sorted.len().saturating_sub(1));
    sorted.get(i).copied().unwrap_or(0)
}

async fn load(load: Load) -> Result<(), String> {
    let load = Arc::new(load);
    let mut senders = Vec::with_capacity(load.connections);
    for _ in 0..load.connections.max(1) {
        senders.push(connect(load.target).await?);
    }
    if load.prime && load.mode == Mode::Pool {
        let mut priming = (*load).clone();
        priming.expect_replayed = false;
        prime(&Arc::new(priming), &senders).await?;
    }
    let keys = |phase: &str| {
        Arc::new(Keys {
            mode: load.mode,
            prefix: format!("{}{phase}", load.prefix),
            pool: load.pool,
            next: AtomicU64::new(0),
        })
    };
    if load.warmup > 0.0 {
        // Warm-up keys are new ones of their own, except in pool mode (the
        // replays stay those of the completed keys).
        let phase = if load.mode == Mode::Pool { "" } else { "-warm" };
        run(
            &load,
            &senders,
            keys(phase),
            Instant::now() + Duration::from_secs_f64(load.warmup),
        )
        .await;
    }
    let start = Instant::now();
    let mut tally = run(
        &load,
        &senders,
        keys(""),
        start + Duration::from_secs_f64(load.seconds),
    )
    .await;
    let seconds = start.elapsed().as_secs_f64();
    tally.latencies_us.sort_unstable();
    let lat = &tally.latencies_us;
    let requests = lat.len();
    let mean = if requests > 0 {
        lat.iter().sum::<u64>() as f64 / requests as f64
    } else {
        0.0
    };
    println!(
        "{{\"requests\":{requests},\"seconds\":{seconds:.3},\"rps\":{:.1},\"p50_us\":{},\"p99_us\":{},\
         \"p999_us\":{},\"mean_us\":{mean:.1},\"max_us\":{},\"err_connect\":{},\"err_read\":{},\
         \"err_write\":0,\"err_status\":{},\"err_timeout\":{},\"good\":{},\"grpc_not_ok\":{},\
         \"not_replayed\":{},\"http_not_200\":{},\"reconnects\":{},\"connections\":{},\"streams\":{}}}",
        requests as f64 / seconds.max(1e-9),
        percentile(lat, 50.0),
        percentile(lat, 99.0),
        percentile(lat, 99.9),
        lat.last().copied().unwrap_or(0),
        tally.connect_errors,
        tally.failed,
        tally.bad(),
        tally.timeouts,
        tally.good,
        tally.grpc_status,
        tally.not_replayed,
        tally.http_status,
        tally.reconnects,
        load.connections,
        load.streams,
    );
    Ok(())
}

fn runtime(threads: usize) -> Result<tokio::runtime::Runtime, String> {
    let mut builder = if threads <= 1 {
        tokio::runtime::Builder::new_current_thread()
    } else {
        let mut b = tokio::runtime::Builder::new_multi_thread();
        b.worker_threads(threads);
        b
    };
    builder.enable_all().build().map_err(|e| e.to_string())
}

fn main() -> Result<(), String> {
    match Args::parse().command {
        Command::Upstream { listen, threads } => runtime(threads)?.block_on(upstream(listen)),
        Command::Load(args) => runtime(args.threads)?.block_on(load(args)),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use super::*;

    #[test]
    fn a_message_frame_is_uncompressed_and_length_prefixed() {
        assert_eq!(&message_frame(b"abc")[..], b"\0\0\0\0\x03abc");
        assert_eq!(&message_frame(b"")[..], b"\0\0\0\0\0");
    }

    #[test]
    fn percentiles_of_sorted_latencies() {
        let lat: Vec<u64> = (1..=1000).collect();
        assert_eq!(percentile(&lat, 50.0), 501);
        assert_eq!(percentile(&lat, 99.0), 991);
        assert_eq!(percentile(&lat, 99.9), 1000);
        assert_eq!(percentile(&[], 50.0), 0);
    }

    #[test]
    fn keys_by_mode() {
        let keys = |mode| Keys {
            mode,
            prefix: "p".into(),
            pool: 3,
            next: AtomicU64::new(0),
        };
        assert_eq!(keys(Mode::Unique).key(2, 7).as_deref(), Some("p-2-7"));
        let pool = keys(Mode::Pool);
        let got: Vec<_> = (0..4).filter_map(|n| pool.key(0, n)).collect();
        assert_eq!(got, ["p-0", "p-1", "p-2", "p-0"]);
        assert_eq!(keys(Mode::None).key(0, 0), None);
    }

    /// The load generator against the upstream: every call good, none replayed.
    #[test]
    fn the_load_generator_reads_the_upstreams_trailers() {
        let rt = runtime(1).unwrap();
        rt.block_on(async {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            let addr = listener.local_addr().unwrap();
            drop(listener);
            tokio::spawn(upstream(addr));
            tokio::time::sleep(Duration::from_millis(100)).await;
            let load = Load::parse_from(["load", "--target", &addr.to_string()]);
            let mut sender = connect(load.target).await.unwrap();
            assert!(matches!(
                call(&mut sender, &load, Some("k".into())).await,
                Outcome::Good
            ));
            let replayed = Load::parse_from(["load", "--target", &addr.to_string(), "--expect-replayed"]);
            assert!(matches!(
                call(&mut sender, &replayed, Some("k".into())).await,
                Outcome::Bad(Bad::NotReplayed)
            ));
        });
    }
}
