//! Allocations and bytes allocated by idemgate-core per request, phase by
//! phase, for the three paths `make bench` loads: a new key (claim, forward,
//! capture, complete), a replay, and the policy lookup of an uncovered route.
//! Host-side copies (Envoy's header maps, buffers, callouts) are not in here;
//! they are listed in bench/results/profile.md.

use std::alloc::{GlobalAlloc, Layout, System};
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use idemgate_core::config::Config;
use idemgate_core::exchange::{Exchange, Origin, RequestHead, ResponseHead, Step};
use idemgate_core::protocol::{encode_frame, Attempt, ClaimReply, FenceReply};
use idemgate_core::trace::Trace;

struct Counting;
static ALLOCS: AtomicU64 = AtomicU64::new(0);
static BYTES: AtomicU64 = AtomicU64::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Relaxed);
        BYTES.fetch_add(layout.size() as u64, Relaxed);
        System.alloc(layout)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout)
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCS.fetch_add(1, Relaxed);
        BYTES.fetch_add(new_size as u64, Relaxed);
        System.realloc(ptr, layout, new_size)
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

const CONFIG: &str = r#"{
  "store": {"cluster": "idempotency_store", "authority": "store", "timeout_ms": 2000, "token": "bench-api-token"},
  "policies": [
    {"name": "bench.create", "match": {"path": {"prefix": "/pay"}},
     "tenant": {"header": "x-tenant-id"}, "principal": {"header": "x-user-id"},
     "replay_headers": ["x-payment-id"]}
  ]}"#;
const BODY: &[u8] = br#"{"amount":1000,"currency":"EUR","note":"bench"}"#;
const RESPONSE: &[u8] = br#"{"id":"pay_1234_56789","amount":1000,"currency":"EUR","status":"succeeded"}"#;
const N: u64 = 20_000;

#[derive(Default, Clone, Copy)]
struct Tally {
    allocs: u64,
    bytes: u64,
}

fn measure<T>(tally: &mut Tally, f: impl FnOnce() -> T) -> T {
    let (a, b) = (ALLOCS.load(Relaxed), BYTES.load(Relaxed));
    let out = f();
    tally.allocs += ALLOCS.load(Relaxed) - a;
    tally.bytes += BYTES.load(Relaxed) - b;
    out
}

fn head(i: u64) -> RequestHead {
    RequestHead {
        method: "POST".into(),
        path: "/pay".into(),
        key_fields: vec![format!("sq-0-{i}").into_bytes()],
        tenant: Some(b"bench".to_vec()),
        principal: Some(b"bench".to_vec()),
        fingerprint_headers: vec![],
        content_length: Some(BODY.len() as u64),
        end_of_stream: false,
        upstream: None,
        // Envoy gives every request an `x-request-id`.
        trace: Trace {
            request_id: Some(format!("0b6a4c3e-9f21-4d7a-8e55-{i:012x}")),
            trace_id: None,
        },
    }
}

/// The filter draws a request's attempt id before the exchange begins.
fn attempt(i: u64) -> Attempt {
    Attempt::try_from(format!("3f9c0a7d5e1b4c2a8d6f0e9b7a5c3d1e-{i:x}")).unwrap_or_else(|e| panic!("{e}"))
}

fn response_head() -> ResponseHead {
    let h = |n: &str, v: &str| (n.to_string(), v.as_bytes().to_vec());
    ResponseHead {
        status: 201,
        origin: Origin::Upstream,
        headers: vec![
            h("x-payment-id", "pay_1234_56789"),
            h("content-type", "application/json; charset=utf-8"),
            h("content-length", "77"),
            h("date", "Mon, 30 Nov 2026 06:00:00 GMT"),
            h("connection", "keep-alive"),
            h("keep-alive", "timeout=120"),
        ],
        content_length: Some(RESPONSE.len() as u64),
        end_of_stream: false,
    }
}

fn main() {
    let config = Rc::new(Config::parse(CONFIG.as_bytes()).unwrap_or_else(|e| panic!("config: {e:?}")));
    let owned = encode_frame(&ClaimReply::Owned { fence: 7 }, b"");
    let done = encode_frame(&FenceReply::Done, b"");
    let replay = encode_frame(
        &ClaimReply::Replay {
            status: 201,
            headers: vec![
                ("content-type".into(), "application/json; charset=utf-8".into()),
                ("x-payment-id".into(), "pay_1234_56789".into()),
            ],
            completed_at: 1_790_000_000_000,
        },
        RESPONSE,
    );

    // Phases of a new key, then of a replay; inputs are built outside the counted sections.
    let names = [
        "lookup (policy_for + Rc clone)",
        "begin (key, identity, scope, fingerprint setup)",
        "request body + claim frame",
        "claim reply: owned",
        "response headers (filter, capture)",
        "response body + complete frame",
        "complete reply",
        "drop exchange",
    ];
    let mut new_key = [Tally::default(); 8];
    let mut replayed = [Tally::default(); 5];
    let mut uncovered = Tally::default();
    let mut frames = (0usize, 0usize);
    for i in 0..N {
        let (h, a, rh, o, d) = (
            head(i),
            attempt(i),
            response_head(),
            Some((200, owned.clone())),
            Some((200, done.clone())),
        );
        let policy = measure(&mut new_key[0], || {
            config.policy_for("POST", "h", "/pay").cloned()
        });
        let Some(policy) = policy else { panic!("no policy") };
        let (mut ex, step) = measure(&mut new_key[1], || Exchange::begin(config.clone(), policy, h, a));
        assert_eq!(step, Step::Pause);
        let step = measure(&mut new_key[2], || ex.request_body(BODY, true));
        if let Step::Call(c) = &step {
            frames.0 = c.body.len();
        }
        drop(step);
        let step = measure(&mut new_key[3], || ex.store_reply(o));
        assert_eq!(step, Step::Continue);
        let step = measure(&mut new_key[4], || ex.response_headers(rh));
        assert_eq!(step, Step::Pause);
        let step = measure(&mut new_key[5], || ex.response_body(RESPONSE, true));
        if let Step::Call(c) = &step {
            frames.1 = c.body.len();
        }
        drop(step);
        let step = measure(&mut new_key[6], || ex.store_reply(d));
        assert_eq!(step, Step::Continue);
        measure(&mut new_key[7], || drop(ex));

        let (h, a, r) = (head(i), attempt(i), Some((200, replay.clone())));
        let policy = measure(&mut replayed[0], || {
            config.policy_for("POST", "h", "/pay").cloned()
        });
        let Some(policy) = policy else { panic!("no policy") };
        let (mut ex, _) = measure(&mut replayed[1], || Exchange::begin(config.clone(), policy, h, a));
        let step = measure(&mut replayed[2], || ex.request_body(BODY, true));
        drop(step);
        let step = measure(&mut replayed[3], || ex.store_reply(r));
        assert!(matches!(step, Step::Respond(_)));
        measure(&mut replayed[4], || {
            drop(step);
            drop(ex)
        });

        let miss = measure(&mut uncovered, || {
            config.policy_for("POST", "h", "/free").is_none()
        });
        assert!(miss);
    }
    let per = |t: &Tally| (t.allocs as f64 / N as f64, t.bytes as f64 / N as f64);
    println!("idemgate-core allocations per request (mean of {N}; allocs + reallocs, bytes requested)\n");
    println!("| path / phase | allocations | bytes |\n|---|--:|--:|");
    let mut total = Tally::default();
    for (name, t) in names.iter().zip(&new_key) {
        let (a, b) = per(t);
        println!("| new key: {name} | {a:.1} | {b:.0} |");
        total.allocs += t.allocs;
        total.bytes += t.bytes;
    }
    let (a, b) = per(&total);
    println!("| **new key, total** | **{a:.1}** | **{b:.0}** |");
    let rnames = [
        "lookup",
        "begin",
        "request body + claim frame",
        "claim reply: replay (decode, headers, body)",
        "drop",
    ];
    let mut total = Tally::default();
    for (name, t) in rnames.iter().zip(&replayed) {
        let (a, b) = per(t);
        println!("| replay: {name} | {a:.1} | {b:.0} |");
        total.allocs += t.allocs;
        total.bytes += t.bytes;
    }
    let (a, b) = per(&total);
    println!("| **replay, total** | **{a:.1}** | **{b:.0}** |");
    let (a, b) = per(&uncovered);
    println!("| uncovered route: policy lookup | {a:.1} | {b:.0} |");
    println!(
        "\nclaim frame {} bytes, complete frame {} bytes",
        frames.0, frames.1
    );
    pieces(&config);
}

/// Where the claim step's allocations go, piece by piece.
fn pieces(config: &Rc<Config>) {
    use idemgate_core::fingerprint::Fingerprinter;
    use idemgate_core::key::Key;
    use idemgate_core::protocol::{ClaimRequest, ClaimRequestRef, FingerprintHex};
    use idemgate_core::scope::{Namespace, Scope};
    let policy = config
        .policy_for("POST", "h", "/pay")
        .cloned()
        .unwrap_or_else(|| panic!("policy"));
    let mut t = [Tally::default(); 5];
    for i in 0..N {
        let key = Key::try_from(format!("sq-0-{i}")).unwrap_or_else(|e| panic!("{e}"));
        let scope = Scope::new("bench", "bench", "bench.create", Namespace::Client, key)
            .unwrap_or_else(|e| panic!("{e:?}"));
        let mut fp = measure(&mut t[0], || {
            Fingerprinter::new(&policy.fingerprint(), "POST", &policy.name(), "/pay", &[])
        });
        let fingerprint = measure(&mut t[1], || {
            fp.push(BODY);
            fp.finish()
        });
        let attempt = attempt(i);
        let owned = measure(&mut t[2], || {
            let request = ClaimRequest {
                scope: scope.clone(),
                fingerprint,
                lease_ms: policy.lease_ms(),
                ttl_ms: policy.ttl_ms(),
                wait_ms: 0,
                after_expiry: policy.after_expiry(),
                on_unknown: policy.on_unknown(),
                attempt: Some(attempt.clone()),
                deadline_ms: 2_000,
                trace: Trace::NONE,
            };
            encode_frame(&request, &[])
        });
        let frame = measure(&mut t[3], || {
            let request = ClaimRequestRef {
                scope: (&scope).into(),
                fingerprint: fingerprint.map(FingerprintHex),
                lease_ms: policy.lease_ms(),
                ttl_ms: policy.ttl_ms(),
                wait_ms: 0,
                after_expiry: policy.after_expiry(),
                on_unknown: policy.on_unknown(),
                attempt: Some(attempt.as_str()),
                deadline_ms: 2_000,
            };
            encode_frame(&request, &[])
        });
        assert_eq!(owned, frame);
        // What the filter's glue hands to dispatch_http_call: borrowed from the config.
        let headers = measure(&mut t[4], || {
            vec![
                (":method", "POST"),
                (":path", "/v1/claim"),
                (":authority", config.store().authority()),
                ("authorization", config.store().authorization()),
                ("content-type", "application/vnd.idemgate.frame"),
            ]
        });
        drop((owned, frame, headers));
    }
    println!("\nclaim step, piece by piece:\n\n| piece | allocations | bytes |\n|---|--:|--:|");
    let names = [
        "Fingerprinter::new",
        "fingerprint push + finish (JSON body: parse, canonicalize, hash)",
        "claim frame from an owned ClaimRequest (scope and attempt cloned; encode_frame)",
        "claim frame from a borrowed ClaimRequestRef, as the exchange writes it (encode_frame)",
        "store call headers (borrowed from the config)",
    ];
    for (name, x) in names.iter().zip(&t) {
        println!(
            "| {name} | {:.1} | {:.0} |",
            x.allocs as f64 / N as f64,
            x.bytes as f64 / N as f64
        );
    }
}
