//! X of the bench's latency floor: what one round trip between two
//! processes over loopback TCP costs this machine, with nothing else done
//! on either side. The process starts a copy of itself (`--echo PORT`) that
//! sends back every byte it reads; one byte goes back and forth, each time
//! through both kernels' TCP stacks and two wake-ups. Every call of a
//! request's path (Envoy to the store, the store to its database, the
//! filter's callouts) pays at least this.
//!
//!   idempotency-pingpong [--round-trips N] [--warmup N]
//!
//! Prints one JSON line: round trips, p50, p99 and mean in µs.
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::Command;
use std::time::{Duration, Instant};

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let [flag, port] = args.as_slice() {
        if flag == "--echo" {
            return echo(port.parse()?);
        }
    }
    let (mut round_trips, mut warmup) = (20_000usize, 2_000usize);
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let value = it.next().ok_or(format!("{flag} needs a value"))?.parse()?;
        match flag.as_str() {
            "--round-trips" => round_trips = value,
            "--warmup" => warmup = value,
            _ => return Err(format!("unknown flag {flag}; flags: --round-trips N, --warmup N").into()),
        }
    }
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let port = listener.local_addr()?.port();
    let mut child = Command::new(std::env::current_exe()?)
        .args(["--echo", &port.to_string()])
        .spawn()?;
    let (mut peer, _) = listener.accept()?;
    peer.set_nodelay(true)?;
    let mut byte = [0u8; 1];
    let mut times = Vec::with_capacity(round_trips);
    for i in 0..warmup + round_trips {
        let start = Instant::now();
        peer.write_all(&byte)?;
        peer.read_exact(&mut byte)?;
        if i >= warmup {
            times.push(start.elapsed());
        }
    }
    drop(peer);
    child.wait()?;
    times.sort();
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    let at = |q: f64| times.get(((times.len() as f64 * q) as usize).min(times.len().saturating_sub(1)));
    let mean = times.iter().map(|d| us(*d)).sum::<f64>() / times.len().max(1) as f64;
    println!(
        "{{\"round_trips\":{},\"p50_us\":{:.1},\"p99_us\":{:.1},\"mean_us\":{:.1}}}",
        times.len(),
        at(0.5).map_or(0.0, |d| us(*d)),
        at(0.99).map_or(0.0, |d| us(*d)),
        mean
    );
    Ok(())
}

/// The other process: every byte read is written back, until the other end closes.
fn echo(port: u16) -> Result<()> {
    let mut peer = TcpStream::connect(("127.0.0.1", port))?;
    peer.set_nodelay(true)?;
    let mut byte = [0u8; 1];
    loop {
        match peer.read(&mut byte)? {
            0 => return Ok(()),
            _ => peer.write_all(&byte)?,
        }
    }
}
