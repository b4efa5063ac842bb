//! The OpenAPI 3.1 document served at `/openapi.json`. Written by hand and
//! checked against [`crate::ROUTES`] by the HTTP tests.

use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use crate::admin;
use crate::console::paths as console;
use idemgate_core::protocol::{
    ABANDON_PATH, BATCH_PATH, CLAIM_PATH, COMPLETE_PATH, MARK_UNKNOWN_PATH, PROTOCOL_HEADER, PROTOCOL_OFFER,
    RELEASE_PATH, REPLAY_PATH,
};

fn frame_body(what: &str) -> Value {
    json!({
        "required": true,
        "content": { "application/vnd.idemgate.frame": { "schema": { "type": "string", "format": "binary" } } },
        "description": format!("A frame: one line of compact JSON ({what}), a newline, then raw bytes."),
    })
}

fn problems(codes: &[&str]) -> Value {
    let mut out = serde_json::Map::new();
    for code in codes {
        out.insert(
            (*code).to_string(),
            json!({ "description": "Problem details (RFC 9457)", "content": { "application/problem+json": { "schema": { "$ref": "#/components/schemas/Problem" } } } }),
        );
    }
    Value::Object(out)
}

fn merge(mut a: Value, b: Value) -> Value {
    if let (Some(a), Value::Object(b)) = (a.as_object_mut(), b) {
        a.extend(b);
    }
    a
}

fn api_op(summary: &str, meta: &str, ok: Value) -> Value {
    json!({ "post": {
        "summary": summary,
        "security": [{ "api": [] }],
        "parameters": [{
            "name": PROTOCOL_HEADER, "in": "header", "required": false, "schema": { "type": "string", "example": PROTOCOL_OFFER },
            "description": "The protocol versions the caller speaks, comma-separated; absent means 1. The reply's header of the same name says which one it is in; a caller sharing none gets 400.",
        }],
        "requestBody": frame_body(meta),
        "responses": merge(ok, problems(&["400", "401", "403", "413", "503"])),
    }})
}

fn fence_responses() -> Value {
    json!({
        "200": { "description": "Done", "content": { "application/vnd.idemgate.frame": { "schema": { "$ref": "#/components/schemas/FenceReply" } } } },
        "409": { "description": "Stale: the fencing token was superseded or the record is gone", "content": { "application/vnd.idemgate.frame": { "schema": { "$ref": "#/components/schemas/FenceReply" } } } },
    })
}

fn admin_get(summary: &str, params: Value) -> Value {
    json!({ "get": {
        "summary": summary,
        "security": [{ "admin": [] }],
        "parameters": params,
        "responses": merge(json!({ "200": { "description": "Records (bodies omitted)", "content": { "application/json": { "schema": { "type": "array", "items": { "$ref": "#/components/schemas/Record" } } } } } }), problems(&["400", "401", "403", "503"])),
    }})
}

fn q(name: &str, required: bool, ty: &str) -> Value {
    json!({ "name": name, "in": "query", "required": required, "schema": { "type": ty } })
}

fn admin_post(summary: &str, schema: Value, ok: &str) -> Value {
    json!({ "post": {
        "summary": summary,
        "security": [{ "admin": [] }],
        "requestBody": { "required": true, "content": { "application/json": { "schema": schema } } },
        "responses": merge(json!({ "200": { "description": ok } }), problems(&["400", "401", "403", "404", "413", "503"])),
    }})
}

/// A console page: HTML for a browser, not an API; `session`: it needs the
/// console's session.
fn console_page(method: &str, summary: &str, form: Option<&[&str]>, session: bool) -> Value {
    let mut op = json!({
        "summary": summary,
        "tags": ["console"],
        "responses": {
            "200": { "description": "An HTML page", "content": { "text/html": {} } },
            "303": { "description": "To the login page without a live session; after a sign-in or sign-out, to the next page" },
        },
    });
    if let Some(fields) = form {
        let props: serde_json::Map<String, Value> = fields
            .iter()
            .map(|f| ((*f).to_string(), json!({ "type": "string" })))
            .collect();
        op["requestBody"] = json!({ "required": true, "content": { "application/x-www-form-urlencoded": {
            "schema": { "type": "object", "properties": props } } } });
    }
    if session {
        op["security"] = json!([{ "console": [] }]);
    }
    json!({ method: op })
}

fn console_paths(paths: &mut serde_json::Map<String, Value>) {
    let mut add = |path: &str, op: Value| {
        let entry = paths.entry(path.to_string()).or_insert_with(|| json!({}));
        if let (Some(e), Value::Object(op)) = (entry.as_object_mut(), op) {
            e.extend(op);
        }
    };
    let scope: &[&str] = &["csrf", "tenant", "principal", "route", "namespace", "key"];
    add(
        console::HOME,
        console_page("get", "Console: the key search form", None, true),
    );
    add(
        console::LOGIN,
        console_page(
            "get",
            "Console: the login form of the operator the trusted proxy names (none without one; ?ended after an idle session); sets the login form's cookie",
            None,
            false,
        ),
    );
    add(
        console::LOGIN,
        console_page(
            "post",
            "Console: sign in as the operator the trusted authenticating proxy names (X-Forwarded-Email by default); sets the session cookie (HttpOnly, SameSite=Strict)",
            Some(&["login_csrf"]),
            false,
        ),
    );
    add(
        console::LOGOUT,
        console_page("post", "Console: end the session", Some(&["csrf"]), true),
    );
    add(
        console::UNKNOWN,
        console_page(
            "get",
            "Console: records whose outcome is unknown, with their age",
            None,
            true,
        ),
    );
    add(
        console::STUCK,
        console_page(
            "get",
            "Console: records in progress for longer than older_than_s",
            None,
            true,
        ),
    );
    add(
        console::HISTORY,
        console_page(
            "post",
            "Console: every generation and event of a tenant's key; the key travels in the form, never in the URL",
            Some(scope),
            true,
        ),
    );
    let mut resolve: Vec<&str> = scope.to_vec();
    resolve.extend(["action", "status", "headers", "body", "reason"]);
    add(
        console::RESOLVE,
        console_page(
            "post",
            "Console: complete an open record with a response, or release it, with a required reason",
            Some(&resolve),
            true,
        ),
    );
    add(
        console::CSS,
        json!({ "get": { "summary": "Console: its stylesheet", "tags": ["console"],
            "responses": { "200": { "description": "CSS", "content": { "text/css": {} } } } } }),
    );
}

pub fn document() -> Value {
    let mut paths = serde_json::Map::new();
    let plain = |summary: &str, ct: &str| json!({ "get": { "summary": summary, "responses": { "200": { "description": "OK", "content": { ct: {} } } } } });
    paths.insert(
        "/healthz".into(),
        plain("Liveness: the process answers", "text/plain"),
    );
    paths.insert(
        "/readyz".into(),
        json!({ "get": { "summary": "Readiness: 200 only once the database is usable", "responses": { "200": { "description": "ready" }, "503": { "description": "database not ready" } } } }),
    );
    paths.insert(
        "/metrics".into(),
        plain("Prometheus metrics", "application/openmetrics-text"),
    );
    paths.insert("/openapi.json".into(), plain("This document", "application/json"));
    let mut claim = api_op(
        "Claim a key, or learn what happened to it; may wait up to wait_ms for an in-flight record",
        "ClaimRequest",
        json!({ "200": { "description": "A frame: ClaimReply metadata, then the stored body for a replay", "content": { "application/vnd.idemgate.frame": { "schema": { "$ref": "#/components/schemas/ClaimReply" } } } } }),
    );
    if let Some(responses) = claim
        .pointer_mut("/post/responses")
        .and_then(Value::as_object_mut)
    {
        responses.insert(
            "429".into(),
            json!({ "description": "key-rate-limited: the claim would take a key beyond its tenant's budget of new keys; nothing was claimed (retry_after_ms in the body, Retry-After)", "content": { "application/problem+json": { "schema": { "$ref": "#/components/schemas/Problem" } } } }),
        );
    }
    paths.insert(CLAIM_PATH.into(), claim);
    paths.insert(
        COMPLETE_PATH.into(),
        api_op(
            "Store the upstream's response (bytes = body); requires the current fence",
            "CompleteRequest",
            fence_responses(),
        ),
    );
    paths.insert(
        RELEASE_PATH.into(),
        api_op(
            "Give the key back; requires the current fence",
            "FenceRequest",
            fence_responses(),
        ),
    );
    paths.insert(
        MARK_UNKNOWN_PATH.into(),
        api_op(
            "Declare the outcome unknown; requires the current fence",
            "FenceRequest",
            fence_responses(),
        ),
    );
    paths.insert(
        ABANDON_PATH.into(),
        api_op(
            "Release a claim its filter gave up before forwarding anything, if it is still open under that attempt",
            "AbandonRequest",
            fence_responses(),
        ),
    );
    paths.insert(
        BATCH_PATH.into(),
        api_op(
            "Several of the calls above in one request, each decided on its own as if sent alone (at most 64): metadata Batch, then the calls' frames back to back; the reply's metadata is BatchReply, then each call's reply (frame or problem) back to back",
            "Batch",
            json!({ "200": { "description": "A frame: BatchReply metadata, then the calls' replies in order", "content": { "application/vnd.idemgate.frame": { "schema": { "$ref": "#/components/schemas/BatchReply" } } } } }),
        ),
    );
    paths.insert(
        REPLAY_PATH.into(),
        json!({ "post": {
            "summary": "Send a stored gRPC response back as it came (Envoy's replay route for gRPC policies): ReplayRequest metadata, then the message frames; answered over HTTP/2 with those headers, frames and trailers. Reads and writes nothing, so it takes no credential",
            "requestBody": frame_body("ReplayRequest"),
            "responses": { "200": { "description": "The stored gRPC response (application/grpc), its trailers as HTTP/2 trailers; a frame that is not a replay gets a trailers-only gRPC status" } },
        }}),
    );
    paths.insert(
        admin::LOOKUP_PATH.into(),
        admin_post(
            "Every generation (archived and ended ones included) and every event of a tenant's key; the key travels in the body, never in the URL",
            json!({ "type": "object", "required": ["tenant", "key"], "additionalProperties": false, "properties": {
                "tenant": { "type": "string" },
                "key": { "type": "string" },
                "route": { "type": "string" },
                "principal": { "type": "string" },
                "namespace": { "enum": ["u", "s"] },
                "limit": { "type": "integer" } } }),
            "The key's generations (`records`) and events (`events`)",
        ),
    );
    paths.insert(
        admin::UNKNOWN_PATH.into(),
        admin_get(
            "Records whose outcome is unknown",
            json!([q("limit", false, "integer")]),
        ),
    );
    paths.insert(
        admin::STUCK_PATH.into(),
        admin_get(
            "Records in progress for longer than older_than_ms (default 300000)",
            json!([q("older_than_ms", false, "integer"), q("limit", false, "integer")]),
        ),
    );
    paths.insert(
        admin::RESOLVE_PATH.into(),
        admin_post(
            "Resolve an in-progress or unknown record: complete it with a response, or release it. Needs the operator identity header from the trusted authenticating proxy (403 without); the operator is the event's actor",
            json!({ "type": "object", "required": ["scope", "action", "reason"], "properties": {
                "scope": { "$ref": "#/components/schemas/Scope" },
                "action": { "enum": ["complete", "release"] },
                "reason": { "type": "string", "minLength": 1, "maxLength": admin::MAX_REASON_BYTES, "description": "Why; kept with the resolved event in the history. Required (400 without)" },
                "status": { "type": "integer" },
                "headers": { "type": "array", "items": { "type": "array", "items": { "type": "string" }, "minItems": 2, "maxItems": 2 } },
                "body": { "type": "string" } } }),
            "{\"changed\": true}",
        ),
    );
    paths.insert(
        admin::PURGE_PATH.into(),
        admin_post("Delete a record whatever its state. Needs the operator identity header from the trusted authenticating proxy (403 without); the operator is the event's actor", json!({ "type": "object", "required": ["scope", "reason"], "properties": { "scope": { "$ref": "#/components/schemas/Scope" },
            "reason": { "type": "string", "minLength": 1, "maxLength": admin::MAX_REASON_BYTES, "description": "Why; kept with the purged event in the history. Required (400 without)" } } }), "{\"changed\": true}"),
    );
    paths.insert(
        admin::SWEEP_PATH.into(),
        json!({ "post": { "summary": "Run the sweeper now (expire leases, archive, purge)", "security": [{ "admin": [] }],
            "responses": merge(json!({ "200": { "description": "Rows changed", "content": { "application/json": { "schema": { "$ref": "#/components/schemas/SweepReport" } } } } }), problems(&["401", "403", "503"])) } }),
    );
    console_paths(&mut paths);
    json!({
        "openapi": "3.1.0",
        "info": { "title": "idemgate store", "version": env!("CARGO_PKG_VERSION"),
            "description": "Claims, leases, fencing tokens and replay for the idemgate Envoy filter. Timestamps are milliseconds since the Unix epoch." },
        "paths": Value::Object(paths),
        "components": {
            "securitySchemes": {
                "api": { "type": "http", "scheme": "bearer", "description": "IDEMGATE_API_TOKEN" },
                "admin": { "type": "http", "scheme": "bearer", "description": "IDEMGATE_ADMIN_TOKEN; changes (resolve, purge) also need the operator identity header (--operator-header, default X-Forwarded-Email), believed only from --operator-trusted-peers or with the proxy's secret (--operator-proxy-secret-header)" },
                "console": { "type": "apiKey", "in": "cookie", "name": crate::console::session::SESSION_COOKIE,
                    "description": "The console's session of the operator the trusted authenticating proxy names (every request on it must carry the same identity); it ends after --console-idle-minutes without use; every POST form also carries the session's CSRF token (field csrf)" }
            },
            "schemas": schemas(),
        }
    })
}

/// The wire's types, derived from the types the store reads and writes
/// them with, and the store's own answers.
fn schemas() -> Value {
    let mut schemas = idemgate_core::protocol::component_schemas();
    let own = json!({
                "Record": { "type": "object", "description": "Everything stored about a record except its body; log_id is the record's keyed-hash name in the logs, response_key the id of the key that sealed its stored response (null: plaintext)" },
                "SweepReport": { "type": "object", "properties": { "marked_unknown": { "type": "integer" }, "released": { "type": "integer" }, "abandoned": { "type": "integer" }, "archived": { "type": "integer" }, "purged": { "type": "integer" }, "events_purged": { "type": "integer" }, "unreadable": { "type": "integer" }, "failed_phases": { "type": "integer" } } },
                "Problem": { "type": "object", "properties": { "type": { "type": "string" }, "title": { "type": "string" }, "status": { "type": "integer" }, "detail": { "type": "string" }, "retry_after_ms": { "type": "integer", "description": "key-rate-limited only: the wait in milliseconds" } } }
    });
    if let Value::Object(own) = own {
        schemas.extend(own);
    }
    Value::Object(schemas)
}

pub async fn serve() -> Response {
    Json(document()).into_response()
}
