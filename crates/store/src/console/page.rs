//! The console's HTML, written with `format!`: every value that comes from a
//! request or the database (tenants, keys, headers, reasons, messages) goes
//! through [`esc`]. No scripts; one stylesheet from the same origin.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use idemgate_core::problem::rfc3339_utc;
use idemgate_core::record;
use idemgate_core::scope::{Namespace, Scope};

use crate::backend::{EventInfo, KeyHistory, RecordInfo};

use super::paths;
use super::session::Current;

/// `s` with `& < > " '` replaced by character references: safe in element
/// content and in quoted attribute values.
pub fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// Milliseconds since the epoch, to the second, in UTC.
pub fn time(ms: i64) -> String {
    let t = rfc3339_utc(ms);
    // `YYYY-MM-DDThh:mm:ss.sssZ` → `YYYY-MM-DD hh:mm:ss`
    format!("{} {}", t.get(..10).unwrap_or(""), t.get(11..19).unwrap_or(""))
}

fn opt_time(ms: Option<i64>) -> String {
    ms.map(time).unwrap_or_else(|| "–".into())
}

/// A duration for people: `42s`, `3m 05s`, `2h 10m`, `4d 3h`.
pub fn age(ms: i64) -> String {
    let s = ms.max(0) / 1000;
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m {:02}s", s / 60, s % 60),
        3600..86_400 => format!("{}h {:02}m", s / 3600, s / 60 % 60),
        _ => format!("{}d {}h", s / 86_400, s / 3600 % 24),
    }
}

/// Security headers of every console page: nothing cached, no framing, no
/// referrer, no script, forms only to the console itself.
pub fn secure_headers(resp: &mut Response) {
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; \
             frame-ancestors 'none'; base-uri 'none'",
        ),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(header::REFERRER_POLICY, HeaderValue::from_static("no-referrer"));
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
}

/// A whole page. `session`: the signed-in operator's, when there is one
/// (the navigation names the operator, and its sign-out form needs the
/// session's CSRF token).
pub fn page(status: StatusCode, title: &str, session: Option<&Current>, body: &str) -> Response {
    let nav = match session {
        Some(s) => format!(
            r#"<nav><a class="brand" href="{home}">idemgate console</a><a href="{home}">Search</a><a href="{unknown}">Unknown</a><a href="{stuck}">Stuck</a><form method="post" action="{logout}" class="logout"><span class="operator" title="Signed in as">{operator}</span>{hidden}<button type="submit">Sign out</button></form></nav>"#,
            home = paths::HOME,
            unknown = paths::UNKNOWN,
            stuck = paths::STUCK,
            logout = paths::LOGOUT,
            operator = esc(s.operator.as_str()),
            hidden = csrf_field(&s.csrf),
        ),
        None => r#"<nav><span class="brand">idemgate console</span></nav>"#.to_string(),
    };
    let html = format!(
        r#"<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="referrer" content="no-referrer"><title>{title} · idemgate console</title>
<link rel="stylesheet" href="{css}"></head>
<body>{nav}<main><h1>{title}</h1>
{body}</main></body></html>
"#,
        title = esc(title),
        css = paths::CSS,
    );
    let mut resp = (status, [(header::CONTENT_TYPE, "text/html; charset=utf-8")], html).into_response();
    secure_headers(&mut resp);
    resp
}

pub fn csrf_field(csrf: &str) -> String {
    format!(r#"<input type="hidden" name="csrf" value="{}">"#, esc(csrf))
}

/// A message box: `kind` is `ok` or `error`.
pub fn notice(kind: &str, text: &str) -> String {
    format!(r#"<p class="notice {kind}" role="status">{}</p>"#, esc(text))
}

/// The hidden fields naming one record's scope: how a record is opened
/// without its key in any URL.
fn scope_fields(scope: &Scope) -> String {
    let field =
        |name: &str, value: &str| format!(r#"<input type="hidden" name="{name}" value="{}">"#, esc(value));
    [
        field("tenant", scope.tenant()),
        field("principal", scope.principal()),
        field("route", scope.route()),
        field("namespace", scope.namespace().as_str()),
        field("key", scope.key().as_str()),
    ]
    .concat()
}

/// A button that opens the record's history (a POST carrying its scope).
fn open_button(scope: &Scope, csrf: &str) -> String {
    format!(
        r#"<form method="post" action="{}" class="inline">{}{}<button type="submit" class="open">Open</button></form>"#,
        paths::HISTORY,
        csrf_field(csrf),
        scope_fields(scope)
    )
}

/// The sign-in form of `operator`, as the authenticating proxy named them.
pub fn login(message: Option<&str>, login_csrf: &str, operator: &str) -> String {
    format!(
        r#"{notice}<form method="post" action="{action}" class="card narrow" id="sign-in">
<input type="hidden" name="login_csrf" value="{csrf}">
<p>Your identity provider signed you in as <strong class="operator">{operator}</strong>. Every change you make in the console is kept in the records' history under this name.</p>
<button type="submit">Sign in as {operator}</button></form>"#,
        notice = message.map(|m| notice("error", m)).unwrap_or_default(),
        action = paths::LOGIN,
        csrf = esc(login_csrf),
        operator = esc(operator),
    )
}

/// Why there is no sign-in form: the request names no operator the store
/// believes.
pub fn no_operator(message: &str) -> String {
    format!(
        r#"{}<p class="hint">The console takes the operator's identity from the authenticating proxy in front of it (for example oauth2-proxy's <code>X-Forwarded-Email</code>); the shared admin credential names nobody. Open the console through that proxy.</p>"#,
        notice("error", message)
    )
}

pub fn search(csrf: &str, message: Option<&str>) -> String {
    format!(
        r#"{notice}<form method="post" action="{action}" class="card narrow" id="search">{hidden}
<label for="tenant">Tenant</label><input id="tenant" name="tenant" required>
<label for="key">Idempotency-Key</label><input id="key" name="key" required autocomplete="off">
<details><summary>Narrow down</summary>
<label for="principal">Principal</label><input id="principal" name="principal" placeholder="any">
<label for="route">Route (policy name)</label><input id="route" name="route" placeholder="any">
</details>
<button type="submit">Look up</button></form>
<p class="hint">The key travels in the form's body, never in the address bar. Every generation of the key and every event is shown, archived ones included.</p>
<p><a href="{unknown}">Records whose outcome is unknown</a> · <a href="{stuck}">Records stuck in progress</a></p>"#,
        notice = message.map(|m| notice("error", m)).unwrap_or_default(),
        action = paths::HISTORY,
        hidden = csrf_field(csrf),
        unknown = paths::UNKNOWN,
        stuck = paths::STUCK,
    )
}

fn scope_cells(scope: &Scope) -> String {
    format!(
        "<td>{}</td><td>{}</td><td>{}</td><td class=\"key\"><code>{}</code></td>",
        esc(scope.tenant()),
        esc(scope.principal()),
        esc(scope.route()),
        esc(scope.key().as_str())
    )
}

/// The unknown or stuck records, oldest first, each with its age.
pub fn listing(records: &[RecordInfo], now: i64, csrf: &str, stuck: bool, limit: u32) -> String {
    if records.is_empty() {
        return notice(
            "ok",
            if stuck {
                "No record is stuck in progress for that long."
            } else {
                "No record's outcome is unknown."
            },
        );
    }
    let mut rows = String::new();
    for r in records {
        let last = if stuck {
            let left = r.lease_until - now;
            if left >= 0 {
                format!("lease ends in {}", age(left))
            } else {
                format!("lease ran out {} ago", age(-left))
            }
        } else {
            match r.expires_at {
                Some(at) => format!("archived in {}", age(at - now)),
                None => "–".into(),
            }
        };
        rows.push_str(&format!(
            r#"<tr data-record="{id}"><td class="age">{age}</td>{scope}<td>{created}</td><td>{last}</td><td>{open}</td></tr>"#,
            id = esc(&r.log_id),
            age = age(now - r.created_at),
            scope = scope_cells(&r.scope),
            created = time(r.created_at),
            last = esc(&last),
            open = open_button(&r.scope, csrf),
        ));
    }
    let more = if records.len() >= limit as usize {
        notice(
            "ok",
            &format!("Showing the oldest {limit}; resolve some to see more."),
        )
    } else {
        String::new()
    };
    format!(
        r#"<table class="records"><thead><tr><th>Age</th><th>Tenant</th><th>Principal</th><th>Route</th><th>Key</th><th>Claimed</th><th>{what}</th><th></th></tr></thead>
<tbody>{rows}</tbody></table>{more}"#,
        what = if stuck { "Lease" } else { "Expiry" },
    )
}

/// The form of the stuck list: how old counts as stuck.
pub fn stuck_filter(older_than_s: u64) -> String {
    format!(
        r#"<form method="get" action="{}" class="filter"><label for="older_than_s">In progress for at least</label>
<input id="older_than_s" name="older_than_s" type="number" min="0" value="{older_than_s}"> seconds <button type="submit">Show</button></form>"#,
        paths::STUCK
    )
}

fn headers_text(headers: &[(String, String)]) -> String {
    headers
        .iter()
        .map(|(n, v)| format!("{n}: {v}"))
        .collect::<Vec<_>>()
        .join("\n")
}

fn generations_table(records: &[&RecordInfo]) -> String {
    let mut rows = String::new();
    for r in records {
        let state = match r.ended_at {
            None if r.archived_at.is_some() => format!("{} (archived)", r.state),
            None => format!("{} (current)", r.state),
            Some(_) => format!("ended: {}", r.state),
        };
        let response = match r.status {
            Some(s) => {
                let body = match (r.body_stored, r.body_len) {
                    (true, Some(n)) => format!("{n} bytes stored"),
                    (true, None) => "body archived".into(),
                    (false, _) => "body not stored".into(),
                };
                format!(
                    "<strong>{s}</strong> · {body}<pre>{}</pre>",
                    esc(&headers_text(r.headers.as_deref().unwrap_or_default()))
                )
            }
            None => "–".into(),
        };
        rows.push_str(&format!(
            r#"<tr class="state-{class}"><td>{generation}</td><td>{state}</td><td>{fence}</td><td>{created}</td><td>{completed}</td><td>{expires}</td><td>{ended}</td><td>{response}</td><td>{replays}</td><td><code>{attempt}</code></td></tr>"#,
            class = esc(r.state.as_str()),
            generation = r.generation,
            state = esc(&state),
            fence = r.fence,
            created = time(r.created_at),
            completed = opt_time(r.completed_at),
            expires = opt_time(r.expires_at),
            ended = opt_time(r.ended_at),
            replays = r.replay_count,
            attempt = esc(r.attempt.as_deref().unwrap_or("–")),
        ));
    }
    format!(
        r#"<table class="generations"><thead><tr><th>Generation</th><th>State</th><th>Fence</th><th>Claimed</th><th>Completed</th><th>Expires</th><th>Ended</th><th>Response</th><th>Replays</th><th>Attempt</th></tr></thead><tbody>{rows}</tbody></table>"#
    )
}

fn events_table(events: &[&EventInfo]) -> String {
    let mut rows = String::new();
    for e in events {
        rows.push_str(&format!(
            r#"<tr class="event-{transition}"><td>{at}</td><td>{generation}</td><td><strong>{transition}</strong></td><td>{actor}</td><td>{detail}</td><td>{status}</td><td>{fence}</td><td>{since}</td><td class="reason">{reason}</td></tr>"#,
            at = time(e.at),
            generation = e.generation,
            transition = esc(e.transition.as_str()),
            actor = esc(e.actor.as_str()),
            detail = esc(e.detail.as_deref().unwrap_or("")),
            status = e.status.map(|s| s.to_string()).unwrap_or_default(),
            fence = e.fence,
            since = age(e.duration_ms),
            reason = esc(e.reason.as_deref().unwrap_or("")),
        ));
    }
    format!(
        r#"<table class="events"><thead><tr><th>At (UTC)</th><th>Generation</th><th>Transition</th><th>Actor</th><th>Detail</th><th>Status</th><th>Fence</th><th>Since claim</th><th>Reason</th></tr></thead><tbody>{rows}</tbody></table>"#
    )
}

/// The two ways to resolve an open record, each with its required reason.
fn resolve_forms(scope: &Scope, csrf: &str) -> String {
    format!(
        r#"<section class="resolve"><h3>Resolve</h3>
<p class="hint">Look the operation up downstream first. If it happened, store the response it produced: retries replay it. If it did not, release the key: the next retry executes.</p>
<div class="forms">
<form method="post" action="{action}" class="card" id="complete">{hidden}{scope}<input type="hidden" name="action" value="complete">
<h4>It happened: store its response</h4>
<label for="status">Status</label><input id="status" name="status" type="number" min="100" max="599" value="200" required>
<label for="headers">Headers (one <code>name: value</code> per line)</label><textarea id="headers" name="headers" rows="2">content-type: application/json</textarea>
<label for="body">Body</label><textarea id="body" name="body" rows="3"></textarea>
<label for="complete-reason">Reason (kept in the history)</label><textarea id="complete-reason" name="reason" rows="2" required></textarea>
<button type="submit">Store this response</button></form>
<form method="post" action="{action}" class="card" id="release">{hidden}{scope}<input type="hidden" name="action" value="release">
<h4>It did not happen: release the key</h4>
<label for="release-reason">Reason (kept in the history)</label><textarea id="release-reason" name="reason" rows="2" required></textarea>
<button type="submit" class="danger">Release the key</button></form>
</div></section>"#,
        action = paths::RESOLVE,
        hidden = csrf_field(csrf),
        scope = scope_fields(scope),
    )
}

/// Every record a lookup found, grouped by scope: its generations, its
/// events, and the resolve forms when its current generation is open.
pub fn history(h: &KeyHistory, csrf: &str, banner: Option<String>) -> String {
    let mut out = banner.unwrap_or_default();
    if h.records.is_empty() && h.events.is_empty() {
        out.push_str(&notice(
            "error",
            "No record with this tenant and key (never claimed, or purged after the audit retention).",
        ));
        return out;
    }
    let mut scopes: Vec<&Scope> = Vec::new();
    for s in h
        .records
        .iter()
        .map(|r| &r.scope)
        .chain(h.events.iter().map(|e| &e.scope))
    {
        if !scopes.contains(&s) {
            scopes.push(s);
        }
    }
    for scope in scopes {
        let records: Vec<&RecordInfo> = h.records.iter().filter(|r| &r.scope == scope).collect();
        let events: Vec<&EventInfo> = h.events.iter().filter(|e| &e.scope == scope).collect();
        let current = records.iter().find(|r| r.ended_at.is_none());
        // Named as the logs name it (the history is labelled by the store).
        let id = records
            .first()
            .map(|r| r.log_id.as_str())
            .or_else(|| events.first().map(|e| e.log_id.as_str()))
            .unwrap_or("");
        // The resolve forms only where a resolution would be taken: the
        // record rule the store's resolve asks, not a list of state names.
        let open = current.is_some_and(|r| {
            r.state
                .state()
                .is_some_and(|s| record::is_open(s, r.archived_at.is_some()))
        });
        let state = current
            .map(|r| r.state.as_str())
            .unwrap_or("none (the key is free)");
        out.push_str(&format!(
            r#"<section class="record" data-record="{id}"><h2>Record <code>{id}</code> <span class="badge state-{class}">{state}</span></h2>
<dl class="scope"><dt>Tenant</dt><dd>{tenant}</dd><dt>Principal</dt><dd>{principal}</dd><dt>Route</dt><dd>{route}</dd><dt>Namespace</dt><dd>{ns}</dd><dt>Key</dt><dd><code>{key}</code></dd></dl>
<h3>Generations</h3>{generations}<h3>Events</h3>{events}{resolve}</section>"#,
            id = esc(id),
            class = esc(current.map(|r| r.state.as_str()).unwrap_or("none")),
            state = esc(state),
            tenant = esc(scope.tenant()),
            principal = esc(scope.principal()),
            route = esc(scope.route()),
            ns = if scope.namespace() == Namespace::Server {
                "server keys"
            } else {
                "client keys"
            },
            key = esc(scope.key().as_str()),
            generations = generations_table(&records),
            events = events_table(&events),
            resolve = if open { resolve_forms(scope, csrf) } else { String::new() },
        ));
    }
    out
}

/// The stylesheet: plain, readable, printable.
pub const CSS: &str = r#"
:root { --fg: #1d2430; --muted: #5b6577; --line: #d9dee7; --bg: #f6f7f9; --accent: #1f5fbf; --bad: #b3261e; --ok: #1e7a3c; --warn: #9a6700; }
* { box-sizing: border-box; }
body { margin: 0; font: 14px/1.45 system-ui, -apple-system, "Segoe UI", "DejaVu Sans", sans-serif; color: var(--fg); background: var(--bg); }
nav { display: flex; gap: 18px; align-items: center; padding: 10px 24px; background: #18202c; }
nav a, nav .brand { color: #e8edf5; text-decoration: none; }
nav .brand { font-weight: 700; margin-right: 12px; }
nav .logout { margin-left: auto; display: flex; gap: 10px; align-items: center; }
nav .operator { color: #b8c4d6; }
nav .logout button { margin: 0; background: transparent; border: 1px solid #6b7891; color: #e8edf5; padding: 3px 10px; }
main { padding: 16px 24px 40px; max-width: 1400px; }
h1 { font-size: 20px; margin: 6px 0 14px; }
h2 { font-size: 17px; margin: 0 0 8px; }
h3 { font-size: 14px; margin: 16px 0 6px; text-transform: uppercase; letter-spacing: .04em; color: var(--muted); }
h4 { margin: 0 0 8px; font-size: 14px; }
code, pre, td.key { font-family: "DejaVu Sans Mono", ui-monospace, monospace; font-size: 12.5px; }
pre { margin: 4px 0 0; white-space: pre-wrap; color: var(--muted); }
.card { background: #fff; border: 1px solid var(--line); border-radius: 6px; padding: 14px 16px; }
.narrow { max-width: 460px; }
label { display: block; font-weight: 600; margin: 10px 0 3px; }
input, textarea { width: 100%; padding: 6px 8px; border: 1px solid #b8c0cc; border-radius: 4px; font: inherit; }
input[type=number] { width: 120px; }
details { margin-top: 10px; }
button { margin-top: 12px; padding: 6px 14px; border: 0; border-radius: 4px; background: var(--accent); color: #fff; font: inherit; cursor: pointer; }
button.danger { background: var(--bad); }
button.open { margin: 0; padding: 2px 10px; }
td { line-height: 1.6; }
form.inline { display: inline; }
form.filter { margin-bottom: 12px; }
form.filter label { display: inline; }
form.filter button { margin: 0 0 0 6px; }
.hint { color: var(--muted); font-size: 13px; }
.notice { padding: 8px 12px; border-radius: 4px; border: 1px solid var(--line); background: #fff; }
.notice.ok { border-color: #9fd3b0; background: #eef9f1; color: var(--ok); }
.notice.error { border-color: #efb1ac; background: #fdf0ef; color: var(--bad); }
table { border-collapse: collapse; width: 100%; background: #fff; border: 1px solid var(--line); }
th, td { text-align: left; padding: 5px 8px; border-bottom: 1px solid var(--line); vertical-align: top; }
th { background: #eef1f5; font-weight: 600; font-size: 12.5px; }
td.age { font-weight: 600; white-space: nowrap; }
td.reason { max-width: 360px; white-space: pre-wrap; }
section.record { background: #fff; border: 1px solid var(--line); border-radius: 6px; padding: 14px 16px; margin-bottom: 18px; }
section.record table { border: 1px solid var(--line); }
dl.scope { display: grid; grid-template-columns: max-content 1fr; gap: 2px 14px; margin: 0; }
dl.scope dt { color: var(--muted); }
dl.scope dd { margin: 0; word-break: break-all; }
.badge { font-size: 12px; padding: 2px 8px; border-radius: 10px; background: #e4e8ee; vertical-align: middle; }
.badge.state-unknown { background: #fbe9c5; color: var(--warn); }
.badge.state-in_progress { background: #dde8fb; color: var(--accent); }
.badge.state-completed { background: #dcf2e3; color: var(--ok); }
tr.event-resolved td { background: #f3f8ff; }
.forms { display: grid; grid-template-columns: 1fr 1fr; gap: 16px; }
"#;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escaping_covers_markup_and_both_quotes() {
        assert_eq!(
            esc(r#"<script>alert("x")</script>&'"#),
            "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;&amp;&#39;"
        );
    }

    #[test]
    fn ages_read_like_people_say_them() {
        assert_eq!(age(-5), "0s");
        assert_eq!(age(42_000), "42s");
        assert_eq!(age(185_000), "3m 05s");
        assert_eq!(age(7_800_000), "2h 10m");
        assert_eq!(age(356_400_000), "4d 3h");
        assert_eq!(time(0), "1970-01-01 00:00:00");
    }
}
