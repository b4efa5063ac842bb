//! An open-loop HTTP/1.1 load generator for `make bench`: `POST`s at a fixed
//! offered rate, whatever pace the answers come back at. wrk keeps N
//! requests in flight and so slows down with the server it measures; at a
//! fixed rate every stack is asked for the same work per second, and the CPU
//! each process spends per request compares like for like.
//!
//! ```text
//! idempotency-paced-load --url http://127.0.0.1:PORT/pay --rate 300 --seconds 10 --prefix P
//! ```
//!
//! Each request is the body and headers of `bench/lua/post.lua` with a new
//! `Idempotency-Key` (`PREFIX-<n>`), sent at its due time (start + n / rate)
//! on a kept-alive connection of a pool that opens more while answers are
//! outstanding. Latency counts from the due time, so a request that waited
//! for a connection or a late timer is charged for it. After `--warmup`
//! seconds (unmeasured) it sends for `--seconds`, waits up to 5 s for the
//! outstanding answers and prints one JSON line in the shape of post.lua's,
//! plus `offered_rps` and `cpu_ms`: its own user and system CPU time during
//! the measured seconds (`/proc/self/stat`), so that a bench can count the
//! load generator's share. It runs on one thread, as `wrk -t1` does.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use clap::Parser;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

const BODY: &str = r#"{"amount":1000,"currency":"EUR","note":"bench"}"#;

#[derive(Parser)]
#[command(about = "POSTs new idempotency keys at a fixed offered rate (open loop)")]
struct Args {
    /// Where to send (http://host:port/path).
    #[arg(long)]
    url: String,
    /// Requests per second offered.
    #[arg(long)]
    rate: f64,
    /// Seconds measured.
    #[arg(long, default_value_t = 10)]
    seconds: u64,
    /// Seconds sent before, not measured.
    #[arg(long, default_value_t = 2)]
    warmup: u64,
    /// Keys are PREFIX-N, N counting from 0 (the warm-up's PREFIX-warm-N).
    #[arg(long)]
    prefix: String,
}

#[derive(Default)]
struct Outcomes {
    latencies_us: Mutex<Vec<u64>>,
    non_2xx: AtomicU64,
    errors: AtomicU64,
    done: AtomicU64,
}

/// User and system CPU time of this process so far, in milliseconds.
fn cpu_ms() -> u64 {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return 0;
    };
    // The command name (field 2) may hold spaces: count fields after its ')'.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let fields: Vec<u64> = rest
        .split_whitespace()
        .skip(11) // fields 3-13
        .take(2) // utime, stime
        .filter_map(|f| f.parse().ok())
        .collect();
    // In clock ticks of USER_HZ, which Linux fixes at 100 on x86 and ARM.
    fields.iter().sum::<u64>() * 10
}

type Http = Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>;

async fn send(client: Http, url: hyper::Uri, key: String) -> Result<u16, String> {
    let req = hyper::Request::post(url)
        .header("content-type", "application/json")
        .header("x-tenant-id", "bench")
        .header("x-user-id", "bench")
        .header("idempotency-key", key)
        .body(Full::new(Bytes::from_static(BODY.as_bytes())))
        .map_err(|e| e.to_string())?;
    let resp = client.request(req).await.map_err(|e| e.to_string())?;
    let status = resp.status().as_u16();
    resp.into_body().collect().await.map_err(|e| e.to_string())?;
    Ok(status)
}

/// Sends `PREFIX-<n>` at start + n / rate for `seconds`; returns how many
/// were sent and when sending ended.
async fn offer(
    client: &Http,
    url: &hyper::Uri,
    args: &Args,
    prefix: &str,
    seconds: u64,
    out: &Arc<Outcomes>,
) -> u64 {
    let start = tokio::time::Instant::now();
    let end = start + Duration::from_secs(seconds);
    let mut n = 0u64;
    loop {
        let due = start + Duration::from_secs_f64(n as f64 / args.rate);
        if due >= end {
            return n;
        }
        tokio::time::sleep_until(due).await;
        let (client, url, out) = (client.clone(), url.clone(), out.clone());
        let key = format!("{prefix}-{n}");
        tokio::spawn(async move {
            let result = send(client, url, key).await;
            let us = due.elapsed().as_micros() as u64;
            match result {
                Ok(status) if (200..300).contains(&status) => {
                    if let Ok(mut l) = out.latencies_us.lock() {
                        l.push(us);
                    }
                }
                Ok(_) => {
                    out.non_2xx.fetch_add(1, Ordering::Relaxed);
                }
                Err(_) => {
                    out.errors.fetch_add(1, Ordering::Relaxed);
                }
            }
            out.done.fetch_add(1, Ordering::Relaxed);
        });
        n += 1;
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), String> {
    let args = Args::parse();
    if args.rate.is_nan() || args.rate <= 0.0 {
        return Err("--rate must be above 0".into());
    }
    let url: hyper::Uri = args.url.parse().map_err(|e| format!("--url: {e}"))?;
    let client: Http = Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(30))
        .build_http();
    let warm = Arc::new(Outcomes::default());
    let sent = offer(
        &client,
        &url,
        &args,
        &format!("{}-warm", args.prefix),
        args.warmup,
        &warm,
    )
    .await;
    drain(&warm, sent).await;
    let out = Arc::new(Outcomes::default());
    let (cpu0, t0) = (cpu_ms(), Instant::now());
    let sent = offer(&client, &url, &args, &args.prefix, args.seconds, &out).await;
    let seconds = t0.elapsed().as_secs_f64();
    drain(&out, sent).await;
    let cpu = cpu_ms().saturating_sub(cpu0);
    let mut lat = out.latencies_us.lock().map(|l| l.clone()).unwrap_or_default();
    lat.sort_unstable();
    let pct = |p: f64| {
        lat.get(((lat.len() as f64 * p) as usize).min(lat.len().saturating_sub(1)))
            .copied()
            .unwrap_or(0)
    };
    let mean = if lat.is_empty() {
        0.0
    } else {
        lat.iter().sum::<u64>() as f64 / lat.len() as f64
    };
    let (non_2xx, errors, done) = (
        out.non_2xx.load(Ordering::Relaxed),
        out.errors.load(Ordering::Relaxed),
        out.done.load(Ordering::Relaxed),
    );
    let requests = lat.len() as u64 + non_2xx;
    println!(
        "{{\"requests\":{requests},\"seconds\":{seconds:.3},\"rps\":{:.1},\"offered_rps\":{:.1},\"p50_us\":{},\
         \"p99_us\":{},\"p999_us\":{},\"mean_us\":{mean:.1},\"max_us\":{},\"err_connect\":{errors},\"err_read\":0,\
         \"err_write\":0,\"err_status\":{non_2xx},\"err_timeout\":{},\"cpu_ms\":{cpu}}}",
        requests as f64 / seconds,
        sent as f64 / seconds,
        pct(0.50),
        pct(0.99),
        pct(0.999),
        lat.last().copied().unwrap_or(0),
        sent.saturating_sub(done),
    );
    Ok(())
}

/// Waits up to 5 s for the answers to the `sent` requests.
async fn drain(out: &Outcomes, sent: u64) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while out.done.load(Ordering::Relaxed) < sent && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
