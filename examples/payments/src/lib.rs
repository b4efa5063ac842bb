//! `payments`: the demo upstream that sits behind Envoy and the idemgate filter.
//!
//! It does not know anything about idempotency keys. It executes every request
//! it receives and counts the executions per tenant, so the walkthrough can show
//! what the filter kept away from it: `GET /_demo/executions`.
//!
//! The tenant is the `x-tenant-id` header, which Envoy's `jwt_authn` sets from
//! the token's `tenant` claim after removing whatever the client sent.
//!
//! Request headers turn the knobs the walkthrough needs:
//!
//! - `x-demo-delay-ms: N`    work slowly (at most 60 s), to show 409 in progress
//! - `x-demo-status: S`      answer with status S (e.g. 500, 429) instead of 201;
//!   a 204 or 304 comes without a body or `content-length`
//! - `x-demo-outcome: O`     add `Idempotency-Control: O` (`no-store`, `uncertain`)
//! - `x-demo-body-bytes: N`  pad the answer to about N bytes (at most 4 MiB)
//!
//! `POST /v1/payment_intents` speaks Stripe's dialect, for Stripe's SDKs: a
//! form-encoded request (`amount`, `currency`, `metadata[...]`), a JSON answer
//! shaped like a Stripe object (`"object": "payment_intent"`) and Stripe's
//! error shape. Since an SDK sends form fields more easily than headers,
//! `metadata[delay_ms]` works like `x-demo-delay-ms` there. Payment intents are
//! counted as payments.

pub mod token;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use bytes::Bytes;
use serde::Serialize;
use serde_json::{json, Map, Value};

pub const DEFAULT_LISTEN: &str = "127.0.0.1:8080";
const MAX_DELAY_MS: u64 = 60_000;
const MAX_BODY_BYTES: usize = 4 * 1024 * 1024;
/// Shown as the tenant when a request arrives without `x-tenant-id`.
const NO_TENANT: &str = "-";

/// What the service executes. Each kind is counted separately.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Payment,
    /// A payment created through the Stripe-shaped route.
    PaymentIntent,
    Refund,
    Order,
    Quote,
}

impl Kind {
    fn id_prefix(self) -> &'static str {
        match self {
            Kind::Payment => "pay",
            Kind::PaymentIntent => "pi",
            Kind::Refund => "re",
            Kind::Order => "ord",
            Kind::Quote => "quo",
        }
    }
}

/// Executions of one tenant, by kind.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Counts {
    pub payments: u64,
    pub refunds: u64,
    pub orders: u64,
    pub quotes: u64,
}

impl Counts {
    fn bump(&mut self, kind: Kind) {
        let n = match kind {
            Kind::Payment | Kind::PaymentIntent => &mut self.payments,
            Kind::Refund => &mut self.refunds,
            Kind::Order => &mut self.orders,
            Kind::Quote => &mut self.quotes,
        };
        *n += 1;
    }
}

#[derive(Default)]
struct Books {
    next_id: u64,
    executions: BTreeMap<String, Counts>,
    /// Payment (and payment intent) id → (tenant, the object as answered
    /// when it was created).
    payments: HashMap<String, (String, Value)>,
}

/// The service's state: in memory, gone when the process stops.
#[derive(Clone, Default)]
pub struct Ledger {
    books: Arc<Mutex<Books>>,
}

impl Ledger {
    fn books(&self) -> MutexGuard<'_, Books> {
        // A std Mutex: nothing awaits while it is held. A poisoned lock still
        // holds consistent counters, so keep serving.
        self.books.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Executions per tenant, as `GET /_demo/executions` shows them.
    pub fn executions(&self) -> BTreeMap<String, Counts> {
        self.books().executions.clone()
    }
}

pub fn app(ledger: Ledger) -> Router {
    Router::new()
        .route("/v1/payments", post(|s, h, b| execute(s, Kind::Payment, h, b)))
        .route("/v1/payments/{id}", get(|s, p, h| show(s, Kind::Payment, p, h)))
        .route(
            "/v1/payment_intents",
            post(|s, h, b| execute(s, Kind::PaymentIntent, h, b)),
        )
        .route(
            "/v1/payment_intents/{id}",
            get(|s, p, h| show(s, Kind::PaymentIntent, p, h)),
        )
        .route("/v1/refunds", post(|s, h, b| execute(s, Kind::Refund, h, b)))
        .route("/v1/orders", post(|s, h, b| execute(s, Kind::Order, h, b)))
        .route("/v1/quotes", post(|s, h, b| execute(s, Kind::Quote, h, b)))
        .route("/_demo/executions", get(executions))
        .with_state(ledger)
}

/// Serves [`app`] on `listener` until `shutdown` completes.
pub async fn serve(
    listener: tokio::net::TcpListener,
    ledger: Ledger,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, app(ledger))
        .with_graceful_shutdown(shutdown)
        .await
}

fn header<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|v| !v.is_empty())
}

fn tenant_of(headers: &HeaderMap) -> String {
    header(headers, "x-tenant-id").unwrap_or(NO_TENANT).to_string()
}

fn error(kind: Kind, status: StatusCode, detail: &str) -> Response {
    if carries_no_content(status) {
        // No body, and so no `content-length` either (RFC 9110 §8.6, §15.3.5,
        // §15.4.5): Envoy refuses such a response as a protocol error.
        return status.into_response();
    }
    let body = if kind == Kind::PaymentIntent {
        // Stripe's error shape, which its SDKs turn into their exceptions.
        let kind = if status.is_server_error() {
            "api_error"
        } else {
            "invalid_request_error"
        };
        json!({"error": {"type": kind, "message": detail}})
    } else {
        json!({"status": status.as_u16(), "detail": detail})
    };
    (status, Json(body)).into_response()
}

/// Statuses whose response has no content: 1xx, `204 No Content` and
/// `304 Not Modified`.
fn carries_no_content(status: StatusCode) -> bool {
    status.is_informational() || status == StatusCode::NO_CONTENT || status == StatusCode::NOT_MODIFIED
}

/// How long to work: `x-demo-delay-ms`, or a payment intent's
/// `metadata[delay_ms]`.
fn delay_ms(kind: Kind, headers: &HeaderMap, body: &[u8]) -> u64 {
    let form = || {
        form_urlencoded::parse(body)
            .find(|(name, _)| name == "metadata[delay_ms]")
            .map(|(_, value)| value.into_owned())
    };
    header(headers, "x-demo-delay-ms")
        .map(str::to_string)
        .or_else(|| (kind == Kind::PaymentIntent).then(form).flatten())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .unwrap_or(0)
}

async fn execute(State(ledger): State<Ledger>, kind: Kind, headers: HeaderMap, body: Bytes) -> Response {
    let tenant = tenant_of(&headers);
    // Counted, and numbered, when the work starts: a caller that gives up
    // while we are slow does not undo what we do, and ids follow arrival order.
    let id = {
        let mut books = ledger.books();
        books.executions.entry(tenant.clone()).or_default().bump(kind);
        books.next_id += 1;
        format!("{}_{:04}", kind.id_prefix(), books.next_id)
    };

    let delay = delay_ms(kind, &headers, &body);
    if delay > 0 {
        tokio::time::sleep(Duration::from_millis(delay.min(MAX_DELAY_MS))).await;
    }
    let (mut response, created) = answer(&ledger, kind, id, &tenant, &headers, &body);
    if let Some(outcome) = header(&headers, "x-demo-outcome").and_then(|v| HeaderValue::from_str(v).ok()) {
        response.headers_mut().insert("idempotency-control", outcome);
    }
    let status = response.status().as_u16();
    println!(
        "{kind:?} for tenant={tenant} -> {status} {}",
        created.unwrap_or_default()
    );
    response
}

/// The answer, and the id if something was created under it.
fn answer(
    ledger: &Ledger,
    kind: Kind,
    id: String,
    tenant: &str,
    headers: &HeaderMap,
    body: &[u8],
) -> (Response, Option<String>) {
    if let Some(forced) = header(headers, "x-demo-status") {
        let response = match forced
            .parse::<u16>()
            .ok()
            .and_then(|s| StatusCode::from_u16(s).ok())
        {
            Some(status) => error(kind, status, "answered as asked by x-demo-status"),
            None => error(
                kind,
                StatusCode::BAD_REQUEST,
                "x-demo-status must be an HTTP status such as 500",
            ),
        };
        return (response, None);
    }
    let created = match kind {
        Kind::PaymentIntent => payment_intent(&id, body),
        _ => created(kind, &id, body),
    };
    let mut created = match created {
        Ok(created) => created,
        Err(detail) => return (error(kind, StatusCode::BAD_REQUEST, &detail), None),
    };
    if let Some(size) = header(headers, "x-demo-body-bytes").and_then(|v| v.parse::<usize>().ok()) {
        created.insert(
            "padding".into(),
            Value::String("x".repeat(size.min(MAX_BODY_BYTES))),
        );
    }
    let created = Value::Object(created);
    if matches!(kind, Kind::Payment | Kind::PaymentIntent) {
        ledger
            .books()
            .payments
            .insert(id.clone(), (tenant.to_string(), created.clone()));
    }
    // Stripe answers a create with 200.
    let status = if kind == Kind::PaymentIntent {
        StatusCode::OK
    } else {
        StatusCode::CREATED
    };
    let mut response = (status, Json(created)).into_response();
    if kind == Kind::Payment {
        if let Ok(location) = HeaderValue::from_str(&format!("/v1/payments/{id}")) {
            response.headers_mut().insert("location", location);
        }
    }
    (response, Some(id))
}

/// The created object of a JSON route: its id, the fields of its kind from
/// the request, `"status": "succeeded"`.
fn created(kind: Kind, id: &str, body: &[u8]) -> Result<Map<String, Value>, String> {
    let Ok(Value::Object(request)) = serde_json::from_slice::<Value>(body) else {
        return Err("the body must be a JSON object".into());
    };
    let field = |name: &str| request.get(name).cloned().unwrap_or(Value::Null);
    let mut created = Map::new();
    created.insert("id".into(), Value::String(id.into()));
    match kind {
        Kind::Payment | Kind::Quote | Kind::PaymentIntent => {
            created.insert("amount".into(), field("amount"));
            created.insert("currency".into(), field("currency"));
        }
        Kind::Refund => {
            created.insert("payment".into(), field("payment"));
            created.insert("amount".into(), field("amount"));
        }
        Kind::Order => {
            created.insert("items".into(), field("items"));
        }
    }
    created.insert("status".into(), Value::String("succeeded".into()));
    Ok(created)
}

/// A payment intent from a form-encoded request, as Stripe's API answers
/// one: `amount` (an integer in the currency's smallest unit) and
/// `currency` are required, `metadata[name]` fields are kept, others ignored.
fn payment_intent(id: &str, body: &[u8]) -> Result<Map<String, Value>, String> {
    let (mut amount, mut currency, mut metadata) = (None, None, Map::new());
    for (name, value) in form_urlencoded::parse(body) {
        if let Some(field) = name.strip_prefix("metadata[").and_then(|n| n.strip_suffix(']')) {
            metadata.insert(field.into(), Value::String(value.into_owned()));
            continue;
        }
        match &*name {
            "amount" => {
                let n = value
                    .parse::<i64>()
                    .map_err(|_| format!("Invalid integer: {value}"))?;
                amount = Some(n);
            }
            "currency" => currency = Some(value.to_ascii_lowercase()),
            _ => {}
        }
    }
    let amount = amount.ok_or("Missing required param: amount.")?;
    let currency = currency.ok_or("Missing required param: currency.")?;
    let mut created = Map::new();
    created.insert("id".into(), Value::String(id.into()));
    created.insert("object".into(), Value::String("payment_intent".into()));
    created.insert("amount".into(), Value::from(amount));
    created.insert("currency".into(), Value::String(currency));
    created.insert("metadata".into(), Value::Object(metadata));
    created.insert("status".into(), Value::String("succeeded".into()));
    Ok(created)
}

/// A payment (or payment intent) is visible only to the tenant that made it.
async fn show(
    State(ledger): State<Ledger>,
    kind: Kind,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    let tenant = tenant_of(&headers);
    let ours = id
        .strip_prefix(kind.id_prefix())
        .is_some_and(|rest| rest.starts_with('_'));
    match ledger.books().payments.get(&id) {
        Some((owner, payment)) if ours && *owner == tenant => Json(payment.clone()).into_response(),
        _ if kind == Kind::PaymentIntent => error(
            kind,
            StatusCode::NOT_FOUND,
            &format!("No such payment_intent: '{id}'"),
        ),
        _ => error(kind, StatusCode::NOT_FOUND, "no such payment"),
    }
}

async fn executions(State(ledger): State<Ledger>) -> Json<BTreeMap<String, Counts>> {
    Json(ledger.executions())
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use axum::http::Request;
    use http_body_util::BodyExt;
    use tower::ServiceExt;

    async fn call(ledger: &Ledger, req: Request<Body>) -> (StatusCode, HeaderMap, Value) {
        let res = app(ledger.clone()).oneshot(req).await.unwrap();
        let (parts, body) = res.into_parts();
        let bytes = body.collect().await.unwrap().to_bytes();
        (
            parts.status,
            parts.headers,
            serde_json::from_slice(&bytes).unwrap_or(Value::Null),
        )
    }

    fn post(path: &str, tenant: &str) -> axum::http::request::Builder {
        Request::post(path)
            .header("x-tenant-id", tenant)
            .header("content-type", "application/json")
    }

    #[tokio::test]
    async fn a_payment_is_created_with_an_id_a_location_and_its_amount() {
        let ledger = Ledger::default();
        let body = r#"{"amount": 4200, "currency": "EUR"}"#;
        let (status, headers, json) = call(
            &ledger,
            post("/v1/payments", "tenant-a").body(Body::from(body)).unwrap(),
        )
        .await;
        assert_eq!(status, StatusCode::CREATED);
        assert_eq!(json["amount"], 4200);
        assert_eq!(json["currency"], "EUR");
        let id = json["id"].as_str().unwrap();
        assert_eq!(headers["location"], format!("/v1/payments/{id}").as_str());
        assert_eq!(ledger.executions()["tenant-a"].payments, 1);
    }

    #[tokio::test]
    async fn a_payment_is_visible_to_its_tenant_only() {
        let ledger = Ledger::default();
        let body = r#"{"amount": 1, "currency": "EUR"}"#;
        let (_, _, json) = call(
            &ledger,
            post("/v1/payments", "tenant-a").body(Body::from(body)).unwrap(),
        )
        .await;
        let path = format!("/v1/payments/{}", json["id"].as_str().unwrap());
        let get = |tenant: &str| {
            Request::get(&path)
                .header("x-tenant-id", tenant)
                .body(Body::empty())
                .unwrap()
        };
        assert_eq!(call(&ledger, get("tenant-a")).await.0, StatusCode::OK);
        assert_eq!(call(&ledger, get("tenant-b")).await.0, StatusCode::NOT_FOUND);
    }

    #[tokio::test]
    async fn knobs_force_a_status_and_an_idempotency_control_header() {
        let ledger = Ledger::default();
        let req = post("/v1/refunds", "tenant-b")
            .header("x-demo-status", "429")
            .header("x-demo-outcome", "no-store")
            .body(Body::from("{}"))
            .unwrap();
        let (status, headers, _) = call(&ledger, req).await;
        assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(headers["idempotency-control"], "no-store");
        assert_eq!(ledger.executions()["tenant-b"].refunds, 1);
    }

    #[tokio::test]
    async fn executions_are_counted_per_tenant_and_kind() {
        let ledger = Ledger::default();
        for (path, tenant) in [("/v1/orders", "a"), ("/v1/orders", "a"), ("/v1/quotes", "b")] {
            call(&ledger, post(path, tenant).body(Body::from("{}")).unwrap()).await;
        }
        let req = Request::get("/_demo/executions").body(Body::empty()).unwrap();
        let (status, _, json) = call(&ledger, req).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(
            json,
            json!({"a": {"payments": 0, "refunds": 0, "orders": 2, "quotes": 0},
                                "b": {"payments": 0, "refunds": 0, "orders": 0, "quotes": 1}})
        );
    }

    fn form(path: &str, tenant: &str) -> axum::http::request::Builder {
        Request::post(path)
            .header("x-tenant-id", tenant)
            .header("content-type", "application/x-www-form-urlencoded")
    }

    #[tokio::test]
    async fn a_payment_intent_is_created_from_a_form_as_a_stripe_object() {
        let ledger = Ledger::default();
        let body = "amount=4200&currency=EUR&metadata%5Border%5D=1001&confirm=true";
        let (status, _, json) = call(
            &ledger,
            form("/v1/payment_intents", "tenant-a")
                .body(Body::from(body))
                .unwrap(),
        )
        .await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(
            json,
            json!({"id": "pi_0001", "object": "payment_intent", "amount": 4200, "currency": "eur",
                   "metadata": {"order": "1001"}, "status": "succeeded"})
        );
        // Counted as a payment, and shown to its tenant on Stripe's path only.
        assert_eq!(ledger.executions()["tenant-a"].payments, 1);
        let get = |path: &str| {
            Request::get(path)
                .header("x-tenant-id", "tenant-a")
                .body(Body::empty())
                .unwrap()
        };
        let (status, _, shown) = call(&ledger, get("/v1/payment_intents/pi_0001")).await;
        assert_eq!((status, shown), (StatusCode::OK, json));
        let (status, _, _) = call(&ledger, get("/v1/payments/pi_0001")).await;
        assert_eq!(status, StatusCode::NOT_FOUND);
    }

    #[tokio::test]
    async fn a_payment_intent_without_an_amount_is_a_stripe_error() {
        let ledger = Ledger::default();
        let (status, _, json) = call(
            &ledger,
            form("/v1/payment_intents", "a")
                .body(Body::from("currency=eur"))
                .unwrap(),
        )
        .await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        assert_eq!(json["error"]["type"], "invalid_request_error");
        assert_eq!(json["error"]["message"], "Missing required param: amount.");
    }

    #[tokio::test]
    async fn metadata_delay_ms_slows_a_payment_intent_down() {
        let ledger = Ledger::default();
        let started = std::time::Instant::now();
        let body = "amount=1&currency=eur&metadata%5Bdelay_ms%5D=300";
        let (status, _, _) = call(
            &ledger,
            form("/v1/payment_intents", "a").body(Body::from(body)).unwrap(),
        )
        .await;
        assert_eq!(status, StatusCode::OK);
        assert!(started.elapsed() >= Duration::from_millis(300));
    }

    /// Sends `request` to [`serve`] over a real connection and returns the
    /// raw response: what hyper writes on the wire, which the router alone
    /// does not show (it adds `content-length` from the body).
    async fn on_the_wire(request: &'static str) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(serve(listener, Ledger::default(), std::future::pending()));
        let response = tokio::task::spawn_blocking(move || {
            use std::io::{Read, Write};
            let mut stream = std::net::TcpStream::connect(addr).unwrap();
            stream.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            stream.write_all(request.as_bytes()).unwrap();
            let mut response = Vec::new();
            stream.read_to_end(&mut response).unwrap();
            String::from_utf8(response).unwrap()
        })
        .await
        .unwrap();
        server.abort();
        response
    }

    #[tokio::test]
    async fn a_forced_204_has_neither_a_body_nor_a_content_length() {
        // RFC 9110 §8.6: no Content-Length in a 204; Envoy refuses one that
        // has it as a protocol error.
        let response = on_the_wire(
            "POST /v1/payments HTTP/1.1\r\nhost: payments\r\nx-tenant-id: a\r\n\
             x-demo-status: 204\r\nx-demo-outcome: no-store\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}",
        )
        .await;
        let (head, body) = response.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.1 204"), "{response}");
        let head = head.to_ascii_lowercase();
        assert!(!head.contains("content-length"), "{response}");
        assert!(!head.contains("transfer-encoding"), "{response}");
        assert!(head.contains("idempotency-control: no-store"), "{response}");
        assert_eq!(body, "");
    }

    #[tokio::test]
    async fn a_body_that_is_not_json_is_a_400() {
        let ledger = Ledger::default();
        let (status, _, _) = call(
            &ledger,
            post("/v1/payments", "a").body(Body::from("nope")).unwrap(),
        )
        .await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
    }
}
