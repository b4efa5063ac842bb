//! The reconciliation console: server-rendered pages on the admin surface
//! (`/admin/console`) for the operator's side of `outcome-unknown`: look a
//! key up, list unknown and stuck records with their age, read a record's
//! generations and events, and resolve it (complete it with the response
//! that really happened, or release it) with a reason kept in the history.
//!
//! It makes the admin API's own calls ([`admin::find`], [`admin::list`],
//! [`admin::resolve_record`]): no rule is written twice. The operator is
//! the one the trusted authenticating proxy names ([`crate::auth::Identified`]):
//! a sign-in opens a session of that operator ([`mod@session`]), every request
//! on it must come from the proxy naming the same operator, and the
//! operator is the actor of every change made in it. A session ends after
//! [`ConsoleSettings::idle`] without use. Every POST form carries the
//! session's CSRF token. Keys travel only in form bodies (a
//! record is opened by a POST carrying its scope), never in a URL, and
//! nothing here logs a key, a form or a reason.

mod form;
pub mod page;
pub mod session;

use axum::body::Body;
use axum::extract::{RawQuery, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;

use crate::admin;
use crate::auth::Identified;
use crate::backend::{Action, Listing, Lookup};
use crate::problem::Refusal;
use crate::AppState;
use form::{lookup_of, resolution_of, Form};
use session::{cookie, random_token, same_token, set_cookie, Current, Found, LOGIN_COOKIE, SESSION_COOKIE};

pub use session::{ConsoleSettings, Sessions};

/// Where the console lives; its cookies are scoped to this path.
pub const BASE: &str = "/admin/console";

/// The console's pages.
pub mod paths {
    pub const HOME: &str = "/admin/console";
    pub const LOGIN: &str = "/admin/console/login";
    /// The login page, saying the session ended (idle too long).
    pub const LOGIN_ENDED: &str = "/admin/console/login?ended";
    pub const LOGOUT: &str = "/admin/console/logout";
    pub const UNKNOWN: &str = "/admin/console/unknown";
    pub const STUCK: &str = "/admin/console/stuck";
    /// POST: a tenant and key (and optionally the rest of a scope).
    pub const HISTORY: &str = "/admin/console/history";
    pub const RESOLVE: &str = "/admin/console/resolve";
    pub const CSS: &str = "/admin/console/console.css";
}

/// Every console route, as (method, path).
pub const ROUTES: &[(&str, &str)] = &[
    ("get", paths::HOME),
    ("get", paths::LOGIN),
    ("post", paths::LOGIN),
    ("post", paths::LOGOUT),
    ("get", paths::UNKNOWN),
    ("get", paths::STUCK),
    ("post", paths::HISTORY),
    ("post", paths::RESOLVE),
    ("get", paths::CSS),
];

/// The console's routes (none when it is disabled).
pub fn router(state: &AppState) -> Router<AppState> {
    if !state.settings.console.enabled {
        return Router::new();
    }
    Router::new()
        .route(paths::HOME, get(home))
        .route(paths::LOGIN, get(login_form).post(login))
        .route(paths::LOGOUT, post(logout))
        .route(paths::UNKNOWN, get(unknown))
        .route(paths::STUCK, get(stuck))
        .route(paths::HISTORY, post(history))
        .route(paths::RESOLVE, post(resolve))
        .route(paths::CSS, get(css))
}

fn redirect(to: &'static str) -> Response {
    let mut resp = (StatusCode::SEE_OTHER, [(header::LOCATION, to)]).into_response();
    page::secure_headers(&mut resp);
    resp
}

fn with_cookie(mut resp: Response, cookie: &str) -> Response {
    if let Ok(v) = HeaderValue::from_str(cookie) {
        resp.headers_mut().append(header::SET_COOKIE, v);
    }
    resp
}

fn status_of(r: &Refusal) -> StatusCode {
    StatusCode::from_u16(r.problem().kind.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
}

fn refused(r: &Refusal, session: Option<&Current>) -> Response {
    let p = r.problem();
    page::page(
        status_of(r),
        p.kind.title(),
        session,
        &page::notice("error", &p.detail),
    )
}

fn no_randomness() -> Response {
    page::page(
        StatusCode::SERVICE_UNAVAILABLE,
        "Unavailable",
        None,
        &page::notice("error", "The store could not draw a random token; try again."),
    )
}

/// The page for a request whose operator identity the store does not
/// believe (see [`crate::auth::identify`]).
fn untrusted(why: &str) -> Response {
    page::page(
        StatusCode::FORBIDDEN,
        "Identity refused",
        None,
        &page::no_operator(why),
    )
}

/// Why a request has no session to use, and so which page it gets.
enum NoSession {
    /// Its operator identity is not believed ([`crate::auth::identify`]).
    Untrusted(&'static str),
    /// To the login page.
    SignIn,
    /// To the login page, saying the session ended.
    Ended,
}

impl NoSession {
    fn answer(self) -> Response {
        match self {
            NoSession::Untrusted(why) => untrusted(why),
            NoSession::SignIn => redirect(paths::LOGIN),
            NoSession::Ended => redirect(paths::LOGIN_ENDED),
        }
    }
}

/// The request's live session, if the proxy names the operator it belongs
/// to.
fn session(state: &AppState, identified: &Identified, headers: &HeaderMap) -> Result<Current, NoSession> {
    let idle = state.settings.console.idle;
    match (state.sessions.find(headers, idle), identified) {
        (_, Identified::Refused(why)) => Err(NoSession::Untrusted(why)),
        (Found::Live(s), Identified::Operator(o)) if s.operator == *o => Ok(s),
        (Found::Live(_), _) => {
            // The proxy no longer names the session's operator (signed out
            // there, or someone else): the session is over.
            tracing::warn!("console: a session used without its operator's identity was closed");
            state.sessions.close(headers);
            Err(NoSession::SignIn)
        }
        (Found::Ended, _) => {
            tracing::info!("console: a session ended (idle or past its lifetime)");
            Err(NoSession::Ended)
        }
        (Found::None, _) => Err(NoSession::SignIn),
    }
}

/// The session and its form, if the request has a live session and the form
/// carries that session's CSRF token; otherwise the answer to give.
async fn checked(
    state: &AppState,
    identified: &Identified,
    headers: &HeaderMap,
    body: Body,
) -> Result<(Current, Form), Response> {
    let session = session(state, identified, headers).map_err(NoSession::answer)?;
    let form = Form::read(state, body)
        .await
        .map_err(|r| refused(&r, Some(&session)))?;
    if !same_token(form.get("csrf"), &session.csrf) {
        tracing::warn!("console: a form without this session's CSRF token was refused");
        return Err(page::page(
            StatusCode::FORBIDDEN,
            "Form refused",
            Some(&session),
            &page::notice(
                "error",
                "This form did not come from this console session (or the session changed). Open the page again and resubmit.",
            ),
        ));
    }
    Ok((session, form))
}

pub async fn css() -> Response {
    let mut resp = ([(header::CONTENT_TYPE, "text/css; charset=utf-8")], page::CSS).into_response();
    page::secure_headers(&mut resp);
    resp
}

pub async fn home(State(state): State<AppState>, identified: Identified, headers: HeaderMap) -> Response {
    let s = match session(&state, &identified, &headers) {
        Ok(s) => s,
        Err(away) => return away.answer(),
    };
    page::page(
        StatusCode::OK,
        "Look a key up",
        Some(&s),
        &page::search(&s.csrf, None),
    )
}

/// The login page. Without an operator identity the store believes it has
/// no form. Its form carries the browser's login token, the one in its
/// login cookie: kept when the browser has one (two tabs, a reload, a
/// failed attempt all stay valid), drawn afresh otherwise.
fn login_page(
    state: &AppState,
    identified: &Identified,
    headers: &HeaderMap,
    status: StatusCode,
    message: Option<&str>,
) -> Response {
    let operator = match identified {
        Identified::Operator(o) => o,
        Identified::Refused(why) => return untrusted(why),
        Identified::Nobody => {
            return page::page(
                StatusCode::UNAUTHORIZED,
                "Sign in",
                None,
                &page::no_operator("This request names no operator."),
            )
        }
    };
    let kept =
        cookie(headers, LOGIN_COOKIE).filter(|t| t.len() == 64 && t.bytes().all(|b| b.is_ascii_hexdigit()));
    let Some(token) = kept.or_else(random_token) else {
        return no_randomness();
    };
    let resp = page::page(
        status,
        "Sign in",
        None,
        &page::login(message, &token, operator.as_str()),
    );
    with_cookie(
        resp,
        &set_cookie(LOGIN_COOKIE, Some(&token), state.settings.console.secure_cookies),
    )
}

pub async fn login_form(
    State(state): State<AppState>,
    identified: Identified,
    headers: HeaderMap,
    RawQuery(query): RawQuery,
) -> Response {
    if session(&state, &identified, &headers).is_ok() {
        return redirect(paths::HOME);
    }
    let idle = state.settings.console.idle.as_secs();
    let limit = match idle % 60 {
        0 => format!("{} minutes", idle / 60),
        _ => format!("{idle} seconds"),
    };
    let ended = format!("Your session ended after {limit} without activity. Sign in again to go on.");
    let message = (query.as_deref() == Some("ended")).then_some(ended.as_str());
    login_page(&state, &identified, &headers, StatusCode::OK, message)
}

pub async fn login(
    State(state): State<AppState>,
    identified: Identified,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let form = match Form::read(&state, body).await {
        Ok(f) => f,
        Err(r) => return refused(&r, None),
    };
    let expected = cookie(&headers, LOGIN_COOKIE).unwrap_or_default();
    if !same_token(form.get("login_csrf"), &expected) {
        tracing::warn!(
            cookie = !expected.is_empty(),
            field = !form.get("login_csrf").is_empty(),
            "console: a sign-in that did not come from the login form was refused"
        );
        return login_page(
            &state,
            &identified,
            &headers,
            StatusCode::FORBIDDEN,
            Some("This sign-in did not come from this browser's login form; try again."),
        );
    }
    let Identified::Operator(operator) = &identified else {
        return login_page(&state, &identified, &headers, StatusCode::UNAUTHORIZED, None);
    };
    let settings = &state.settings.console;
    let Some((session, _)) = state.sessions.open(operator, settings.idle) else {
        return no_randomness();
    };
    tracing::info!(operator = %operator.as_str(), "console: an operator signed in");
    let secure = settings.secure_cookies;
    let resp = with_cookie(
        redirect(paths::HOME),
        &set_cookie(SESSION_COOKIE, Some(&session), secure),
    );
    with_cookie(resp, &set_cookie(LOGIN_COOKIE, None, secure))
}

pub async fn logout(
    State(state): State<AppState>,
    identified: Identified,
    headers: HeaderMap,
    body: Body,
) -> Response {
    if let Err(resp) = checked(&state, &identified, &headers, body).await {
        return resp;
    }
    state.sessions.close(&headers);
    let secure = state.settings.console.secure_cookies;
    with_cookie(redirect(paths::LOGIN), &set_cookie(SESSION_COOKIE, None, secure))
}

const LIST_LIMIT: u32 = 200;

pub async fn unknown(State(state): State<AppState>, identified: Identified, headers: HeaderMap) -> Response {
    let s = match session(&state, &identified, &headers) {
        Ok(s) => s,
        Err(away) => return away.answer(),
    };
    match admin::list(&state, Listing::Unknown, Some(LIST_LIMIT)).await {
        Ok(records) => {
            let now = state.store.clock.now();
            let body = format!(
                "<p class=\"hint\">Clients retrying these keys get <code>409 outcome-unknown</code> until each is resolved. Oldest first.</p>{}",
                page::listing(&records, now, &s.csrf, false, LIST_LIMIT)
            );
            page::page(StatusCode::OK, "Unknown outcomes", Some(&s), &body)
        }
        Err(r) => refused(&r, Some(&s)),
    }
}

pub async fn stuck(
    State(state): State<AppState>,
    identified: Identified,
    headers: HeaderMap,
    RawQuery(query): RawQuery,
) -> Response {
    let s = match session(&state, &identified, &headers) {
        Ok(s) => s,
        Err(away) => return away.answer(),
    };
    let older_than_s = query
        .and_then(|q| serde_urlencoded::from_str::<Vec<(String, String)>>(&q).ok())
        .and_then(|q| q.into_iter().find(|(n, _)| n == "older_than_s"))
        .and_then(|(_, v)| v.trim().parse::<u64>().ok())
        .unwrap_or(admin::DEFAULT_STUCK_AFTER_MS / 1000);
    let which = Listing::Stuck {
        older_than_ms: older_than_s.saturating_mul(1000),
    };
    match admin::list(&state, which, Some(LIST_LIMIT)).await {
        Ok(records) => {
            let now = state.store.clock.now();
            let body = format!(
                "{}{}",
                page::stuck_filter(older_than_s),
                page::listing(&records, now, &s.csrf, true, LIST_LIMIT)
            );
            page::page(StatusCode::OK, "Stuck in progress", Some(&s), &body)
        }
        Err(r) => refused(&r, Some(&s)),
    }
}

/// A history page of `lookup`, `banner` above it.
async fn history_page(
    state: &AppState,
    s: &Current,
    lookup: &Lookup,
    banner: (StatusCode, String),
) -> Response {
    match admin::find(state, lookup, None).await {
        Ok(h) => page::page(
            banner.0,
            "Key history",
            Some(s),
            &page::history(&h, &s.csrf, Some(banner.1)),
        ),
        Err(r) if lookup.tenant.is_empty() || lookup.key.is_empty() => page::page(
            status_of(&r),
            "Look a key up",
            Some(s),
            &page::search(&s.csrf, Some(&r.problem().detail)),
        ),
        Err(r) => refused(&r, Some(s)),
    }
}

pub async fn history(
    State(state): State<AppState>,
    identified: Identified,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let (s, form) = match checked(&state, &identified, &headers, body).await {
        Ok(v) => v,
        Err(resp) => return resp,
    };
    history_page(&state, &s, &lookup_of(&form), (StatusCode::OK, String::new())).await
}

pub async fn resolve(
    State(state): State<AppState>,
    identified: Identified,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let (s, form) = match checked(&state, &identified, &headers, body).await {
        Ok(v) => v,
        Err(resp) => return resp,
    };
    let scope = match admin::scope_of(
        form.get("tenant"),
        form.get("principal"),
        form.get("route"),
        form.get("namespace"),
        form.get("key"),
    ) {
        Ok(scope) => scope,
        Err(e) => return refused(&Refusal::bad_request(e), Some(&s)),
    };
    let lookup = Lookup {
        tenant: scope.tenant().to_string(),
        key: scope.key().as_str().to_string(),
        route: Some(scope.route().to_string()),
        principal: Some(scope.principal().to_string()),
        namespace: Some(scope.namespace()),
    };
    let (how, reason) = match resolution_of(&form) {
        Ok(v) => v,
        Err(e) => {
            let banner = (StatusCode::BAD_REQUEST, page::notice("error", &e));
            return history_page(&state, &s, &lookup, banner).await;
        }
    };
    let banner = match admin::resolve_record(&state, &scope, &how, Some(&reason), &s.operator).await {
        Ok(()) => {
            let done = match &how {
                Action::Complete { status, .. } => format!(
                    "Resolved: the record is completed with status {status}. Retries with this key now replay this response."
                ),
                Action::Release | Action::Purge => {
                    "Resolved: the key is released. The next retry with this key executes the request.".into()
                }
            };
            (StatusCode::OK, page::notice("ok", &done))
        }
        Err(r) => (status_of(&r), page::notice("error", &r.problem().detail)),
    };
    history_page(&state, &s, &lookup, banner).await
}
