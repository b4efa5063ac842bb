//! The console in-process, as a browser behind the authenticating proxy
//! would use it: sign-in as the operator the proxy names, the session
//! cookie's attributes, the session bound to its operator and ended when
//! idle, CSRF on every POST, escaping of everything shown, the operator and
//! the reason kept in the history, and no key in any URL or log line.

use std::collections::HashMap;

use axum::body::Body;
use axum::http::Request;
use http_body_util::BodyExt;
use idemgate_core::protocol::{decode_frame, encode_frame, ClaimReply};
use idemgate_core::record::Transition;
use idemgate_core::scope::{Namespace, Scope};
use idemgate_store::backend::Lookup;
use idemgate_store::console::{paths, ConsoleSettings};
use idemgate_store::{app, AppState, Clock, Settings, Store};
use tower::ServiceExt;

use crate::support::*;

struct Page {
    status: u16,
    headers: axum::http::HeaderMap,
    html: String,
}

impl Page {
    fn location(&self) -> Option<&str> {
        self.headers.get("location").and_then(|v| v.to_str().ok())
    }

    fn set_cookies(&self) -> Vec<String> {
        self.headers
            .get_all("set-cookie")
            .iter()
            .filter_map(|v| v.to_str().ok())
            .map(str::to_string)
            .collect()
    }

    /// The value of the first hidden field `name`.
    fn field(&self, name: &str) -> String {
        let marker = format!(r#"name="{name}" value=""#);
        let start = self
            .html
            .find(&marker)
            .unwrap_or_else(|| panic!("no field {name} in {}", self.html))
            + marker.len();
        let len = self.html[start..].find('"').unwrap();
        self.html[start..start + len].to_string()
    }

    /// Every address the page links or posts to, and where it redirects.
    fn urls(&self) -> Vec<String> {
        let mut out: Vec<String> = self.location().map(str::to_string).into_iter().collect();
        for attr in ["href=\"", "action=\"", "src=\""] {
            let mut rest = self.html.as_str();
            while let Some(i) = rest.find(attr) {
                rest = &rest[i + attr.len()..];
                let end = rest.find('"').unwrap_or(rest.len());
                out.push(rest[..end].to_string());
            }
        }
        out
    }
}

/// A browser: a cookie jar, and the app in-process (or the real binary, for
/// [`Browser::of_process`]); every URL it was sent to or shown is kept.
struct Browser {
    state: AppState,
    process: Option<(StoreProcess, HttpClient)>,
    jar: HashMap<String, String>,
    urls: Vec<String>,
    /// What the authenticating proxy in front adds to every request.
    proxy: Vec<(&'static str, String)>,
    _dir: tempfile::TempDir,
}

impl Browser {
    /// `console` with the tests' proxy ([`behind_proxy`]), signed in there
    /// as [`ALICE`].
    async fn new(console: ConsoleSettings) -> Browser {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::new(sqlite_backend(&dir).await, Clock::System);
        let console = ConsoleSettings {
            operators: behind_proxy().operators,
            ..console
        };
        Browser {
            state: AppState::new(store, Settings::new(API, ADMIN)).with_console(console),
            process: None,
            jar: HashMap::new(),
            urls: Vec::new(),
            proxy: Vec::new(),
            _dir: dir,
        }
        .named(ALICE)
    }

    /// From now on the proxy names `operator`.
    fn named(mut self, operator: &str) -> Browser {
        self.proxy = as_operator(operator)
            .iter()
            .map(|(n, v)| (*n, v.to_string()))
            .collect();
        self
    }

    /// Against the real binary, logging at `rust_log`, on its own database
    /// (`state` is the same database, for setting records up).
    async fn of_process(rust_log: &str) -> Browser {
        let mut b = Browser::new(ConsoleSettings::default()).await;
        let url = format!("sqlite://{}", b._dir.path().join("store.db").display());
        let secret = b._dir.path().join("proxy-secret");
        std::fs::write(&secret, format!("{PROXY_SECRET}\n")).unwrap();
        let store = StoreProcess::start_with(&url, rust_log, |cmd| {
            cmd.arg("--operator-proxy-secret-file").arg(&secret);
        })
        .await;
        b.process = Some((store, client()));
        b
    }

    async fn send(&mut self, method: &str, path: &str, form: Option<&[(&str, &str)]>) -> Page {
        self.urls.push(path.to_string());
        let uri = match &self.process {
            Some((p, _)) => p.url(path),
            None => path.to_string(),
        };
        let mut req = Request::builder().method(method).uri(uri);
        for (name, value) in &self.proxy {
            req = req.header(*name, value);
        }
        if !self.jar.is_empty() {
            let cookies: Vec<String> = self.jar.iter().map(|(n, v)| format!("{n}={v}")).collect();
            req = req.header("cookie", cookies.join("; "));
        }
        let body = match form {
            Some(fields) => {
                req = req.header("content-type", "application/x-www-form-urlencoded");
                serde_urlencoded::to_string(fields).unwrap()
            }
            None => String::new(),
        };
        let (status, headers, bytes) = match &self.process {
            Some((_, c)) => {
                let resp = c
                    .request(req.body(http_body_util::Full::from(body)).unwrap())
                    .await
                    .unwrap();
                let (status, headers) = (resp.status().as_u16(), resp.headers().clone());
                (
                    status,
                    headers,
                    resp.into_body().collect().await.unwrap().to_bytes(),
                )
            }
            None => {
                let resp = app(self.state.clone())
                    .oneshot(req.body(Body::from(body)).unwrap())
                    .await
                    .unwrap();
                let (status, headers) = (resp.status().as_u16(), resp.headers().clone());
                (
                    status,
                    headers,
                    resp.into_body().collect().await.unwrap().to_bytes(),
                )
            }
        };
        let page = Page {
            status,
            headers,
            html: String::from_utf8(bytes.to_vec()).unwrap(),
        };
        for c in page.set_cookies() {
            let pair = c.split(';').next().unwrap();
            let (name, value) = pair.split_once('=').unwrap();
            if value.is_empty() {
                self.jar.remove(name);
            } else {
                self.jar.insert(name.into(), value.into());
            }
        }
        self.urls.extend(page.urls());
        page
    }

    async fn get(&mut self, path: &str) -> Page {
        self.send("GET", path, None).await
    }

    async fn post(&mut self, path: &str, form: &[(&str, &str)]) -> Page {
        self.send("POST", path, Some(form)).await
    }

    /// Signs in at the login form; its answer.
    async fn sign_in_form(&mut self) -> Page {
        let login = self.get(paths::LOGIN).await;
        assert_eq!(login.status, 200, "{}", login.html);
        let csrf = login.field("login_csrf");
        self.post(paths::LOGIN, &[("login_csrf", &csrf)]).await
    }

    /// Signs in as the operator the proxy names; the session's CSRF token.
    async fn sign_in(&mut self) -> String {
        let r = self.sign_in_form().await;
        assert_eq!((r.status, r.location()), (303, Some(paths::HOME)), "{}", r.html);
        let home = self.get(paths::HOME).await;
        assert_eq!(home.status, 200);
        home.field("csrf")
    }

    /// A record of `scope` whose outcome is unknown.
    async fn unknown_record(&self, scope: &Scope) {
        let f = self.claimed(scope).await;
        match &self.process {
            Some((p, c)) => {
                let frame = encode_frame(&fence(scope, f), &[]);
                let r = request(c, "POST", &p.url("/v1/mark-unknown"), Some(API), frame).await;
                assert_eq!(r.status, 200);
            }
            None => {
                self.state.store.mark_unknown(&fence(scope, f)).await.unwrap();
            }
        }
    }

    /// A record of `scope` in progress; its fence.
    async fn claimed(&self, scope: &Scope) -> u64 {
        let reply = match &self.process {
            Some((p, c)) => {
                let frame = encode_frame(&claim(scope, Some(1)), &[]);
                let r = request(c, "POST", &p.url("/v1/claim"), Some(API), frame).await;
                decode_frame::<ClaimReply>(&r.body).unwrap().0
            }
            None => {
                self.state
                    .store
                    .claim(&claim(scope, Some(1)))
                    .await
                    .unwrap()
                    .reply
            }
        };
        let ClaimReply::Owned { fence: f } = reply else {
            panic!("{reply:?}");
        };
        f
    }

    async fn state_of(&self, scope: &Scope) -> Option<String> {
        let lookup = Lookup {
            tenant: scope.tenant().into(),
            key: scope.key().as_str().into(),
            ..Lookup::default()
        };
        let h = self.state.store.backend.lookup(&lookup, 10).await.unwrap();
        h.records
            .into_iter()
            .find(|r| r.ended_at.is_none())
            .map(|r| r.state.to_string())
    }
}

fn scope_form<'a>(scope: &'a Scope, csrf: &'a str) -> Vec<(&'a str, &'a str)> {
    vec![
        ("csrf", csrf),
        ("tenant", scope.tenant()),
        ("principal", scope.principal()),
        ("route", scope.route()),
        ("namespace", scope.namespace().as_str()),
        ("key", scope.key().as_str()),
    ]
}

#[tokio::test]
async fn console_pages_need_a_session() {
    let mut b = Browser::new(ConsoleSettings::default()).await;
    for path in [paths::HOME, paths::UNKNOWN, paths::STUCK] {
        let r = b.get(path).await;
        assert_eq!((r.status, r.location()), (303, Some(paths::LOGIN)), "{path}");
    }
    for path in [paths::HISTORY, paths::RESOLVE, paths::LOGOUT] {
        let r = b.post(path, &[("tenant", "acme"), ("key", "k")]).await;
        assert_eq!((r.status, r.location()), (303, Some(paths::LOGIN)), "{path}");
    }
    b.jar.insert("idemgate_console".into(), "f".repeat(64));
    let r = b.get(paths::UNKNOWN).await;
    assert_eq!((r.status, r.location()), (303, Some(paths::LOGIN)));
    // The admin API's bearer credential is no session.
    let req = Request::get(paths::UNKNOWN)
        .header("authorization", format!("Bearer {ADMIN}"))
        .body(Body::empty())
        .unwrap();
    let resp = app(b.state.clone()).oneshot(req).await.unwrap();
    assert_eq!(resp.status(), 303);
    let css = b.get(paths::CSS).await;
    assert_eq!(css.status, 200);
    assert_eq!(css.headers["content-type"], "text/css; charset=utf-8");
}

#[tokio::test]
async fn signing_in_takes_the_operator_the_proxy_names() {
    let mut b = Browser::new(ConsoleSettings::default()).await;
    let login = b.get(paths::LOGIN).await;
    assert_eq!(login.status, 200);
    assert!(
        login.html.contains("Sign in as alice@example.com"),
        "{}",
        login.html
    );
    assert!(
        !login.html.contains("type=\"password\""),
        "no shared credential to type"
    );
    let login_cookie = login.set_cookies().join("\n");
    assert!(
        login_cookie.contains("idemgate_console_login=")
            && login_cookie.contains("HttpOnly")
            && login_cookie.contains("SameSite=Strict"),
        "{login_cookie}"
    );
    for (name, value) in [
        ("content-security-policy", "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"),
        ("x-frame-options", "DENY"),
        ("cache-control", "no-store"),
        ("referrer-policy", "no-referrer"),
    ] {
        assert_eq!(login.headers[name], value, "{name}");
    }
    assert!(!login.html.contains("<script"));

    // Without the login form's own token (another site's form): refused.
    let forged = b.post(paths::LOGIN, &[("login_csrf", "x")]).await;
    assert_eq!(forged.status, 403);
    assert!(!b.jar.contains_key("idemgate_console"));
    let mut other = Browser::new(ConsoleSettings::default()).await;
    let stolen = other.get(paths::LOGIN).await.field("login_csrf");
    let r = b.post(paths::LOGIN, &[("login_csrf", &stolen)]).await;
    assert_eq!(r.status, 403);

    // No identity (not through the proxy): no form, no session, whatever
    // credential the form carries.
    let own = b.get(paths::LOGIN).await.field("login_csrf");
    let proxy = std::mem::take(&mut b.proxy);
    let nobody = b.get(paths::LOGIN).await;
    assert_eq!(nobody.status, 401);
    assert!(!nobody.html.contains("login_csrf"), "{}", nobody.html);
    assert!(nobody.html.contains("names no operator"));
    let r = b
        .post(paths::LOGIN, &[("login_csrf", &own), ("token", ADMIN)])
        .await;
    assert_eq!(r.status, 401);
    assert!(!b.jar.contains_key("idemgate_console"));
    // The proxy's header without the proxy's secret: refused.
    b.proxy = vec![("x-forwarded-email", ALICE.to_string())];
    let forged = b.post(paths::LOGIN, &[("login_csrf", &own)]).await;
    assert_eq!(forged.status, 403);
    assert!(
        forged.html.contains("trusted authenticating proxy"),
        "{}",
        forged.html
    );
    assert!(!b.jar.contains_key("idemgate_console"));
    b.proxy = proxy;

    let ok = b.sign_in_form().await;
    assert_eq!((ok.status, ok.location()), (303, Some(paths::HOME)));
    let cookies = ok.set_cookies();
    let session = cookies
        .iter()
        .find(|c| c.starts_with("idemgate_console="))
        .unwrap();
    assert!(
        session.ends_with("; Path=/admin/console; HttpOnly; SameSite=Strict"),
        "{session}"
    );
    assert!(cookies
        .iter()
        .any(|c| c.starts_with("idemgate_console_login=; Max-Age=0")));
    let home = b.get(paths::HOME).await;
    assert_eq!(home.status, 200);
    assert!(home
        .html
        .contains(r#"<span class="operator" title="Signed in as">alice@example.com</span>"#));
    assert_eq!(b.get(paths::LOGIN).await.location(), Some(paths::HOME));

    // Behind TLS the deployer asks for Secure cookies.
    let mut tls = Browser::new(ConsoleSettings {
        secure_cookies: true,
        ..ConsoleSettings::default()
    })
    .await;
    let login = tls.get(paths::LOGIN).await;
    assert!(login.set_cookies()[0].ends_with("; Secure"));
    let r = tls.sign_in_form().await;
    assert!(r.set_cookies().iter().all(|c| c.ends_with("; Secure")));
}

#[tokio::test]
async fn a_second_login_page_keeps_the_first_ones_form_valid() {
    let mut b = Browser::new(ConsoleSettings::default()).await;
    let first = b.get(paths::LOGIN).await.field("login_csrf");
    let wrong = b.post(paths::LOGIN, &[("login_csrf", "typo")]).await;
    assert_eq!(wrong.field("login_csrf"), first);
    let second = b.get(paths::LOGIN).await.field("login_csrf");
    assert_eq!(first, second, "another tab or a reload");
    let r = b.post(paths::LOGIN, &[("login_csrf", &first)]).await;
    assert_eq!((r.status, r.location()), (303, Some(paths::HOME)));
    // A session's sign-in token is spent: the next sign-in draws a new one.
    b.jar.remove("idemgate_console");
    assert_ne!(b.get(paths::LOGIN).await.field("login_csrf"), first);
}

/// A session is its operator's: used without the proxy naming that same
/// operator, it ends.
#[tokio::test]
async fn a_session_belongs_to_the_operator_who_opened_it() {
    let mut b = Browser::new(ConsoleSettings::default()).await;
    b.sign_in().await;
    let kept = b.jar.clone();
    // Someone else behind the proxy, with alice's cookie.
    b = b.named("bob@example.com");
    let r = b.get(paths::HOME).await;
    assert_eq!((r.status, r.location()), (303, Some(paths::LOGIN)));
    b = b.named(ALICE);
    b.jar = kept.clone();
    assert_eq!(
        b.get(paths::HOME).await.location(),
        Some(paths::LOGIN),
        "closed for good"
    );

    // The cookie sent without the proxy (straight to the store).
    b.sign_in().await;
    let kept = b.jar.clone();
    let proxy = std::mem::take(&mut b.proxy);
    assert_eq!(b.get(paths::UNKNOWN).await.location(), Some(paths::LOGIN));
    b.proxy = proxy;
    b.jar = kept;
    assert_eq!(b.get(paths::UNKNOWN).await.location(), Some(paths::LOGIN));

    // A forged identity is refused outright.
    b.sign_in().await;
    b.proxy = vec![("x-forwarded-email", ALICE.to_string())];
    assert_eq!(b.get(paths::HOME).await.status, 403);
}

/// A session unused for the idle limit ends: the next page is the login
/// page saying so, and a form posted on it changes nothing.
#[tokio::test]
async fn an_idle_session_ends() {
    let idle = std::time::Duration::from_millis(300);
    let mut b = Browser::new(ConsoleSettings {
        idle,
        ..ConsoleSettings::default()
    })
    .await;
    let csrf = b.sign_in().await;
    let s = scope("k-idle");
    b.unknown_record(&s).await;
    // Used within the limit, it lives on.
    for _ in 0..3 {
        tokio::time::sleep(idle / 2).await;
        assert_eq!(b.get(paths::HOME).await.status, 200);
    }
    tokio::time::sleep(idle + idle / 2).await;
    let mut form = scope_form(&s, &csrf);
    form.extend([("action", "release"), ("reason", "never charged")]);
    let r = b.post(paths::RESOLVE, &form).await;
    assert_eq!((r.status, r.location()), (303, Some(paths::LOGIN_ENDED)));
    assert_eq!(b.state_of(&s).await.as_deref(), Some("unknown"));
    let login = b.get(paths::LOGIN_ENDED).await;
    assert!(login.html.contains("Your session ended"), "{}", login.html);
    assert_eq!(b.get(paths::HOME).await.location(), Some(paths::LOGIN));
    // Signing in again opens a new session.
    let csrf = b.sign_in().await;
    let mut form = scope_form(&s, &csrf);
    form.extend([("action", "release"), ("reason", "never charged")]);
    assert_eq!(b.post(paths::RESOLVE, &form).await.status, 200);
    assert_eq!(b.state_of(&s).await, None);
}

#[tokio::test]
async fn every_post_needs_the_sessions_csrf_token() {
    let mut b = Browser::new(ConsoleSettings::default()).await;
    let csrf = b.sign_in().await;
    let s = scope("k-csrf");
    b.unknown_record(&s).await;
    let mut other = Browser::new(ConsoleSettings::default()).await;
    let others = other.sign_in().await;
    assert_ne!(csrf, others);

    let mut resolve: Vec<(&str, &str)> = vec![
        ("action", "release"),
        ("reason", "the bank never saw it"),
        ("tenant", s.tenant()),
        ("principal", s.principal()),
        ("route", s.route()),
        ("namespace", "u"),
        ("key", s.key().as_str()),
    ];
    // No token, another session's token, a token one character off.
    let last = if csrf.ends_with('0') { '1' } else { '0' };
    let off = format!("{}{last}", &csrf[..csrf.len() - 1]);
    for token in [None, Some(others.as_str()), Some(off.as_str()), Some("")] {
        let mut form = resolve.clone();
        if let Some(t) = token {
            form.push(("csrf", t));
        }
        let r = b.post(paths::RESOLVE, &form).await;
        assert_eq!(r.status, 403, "{token:?}: {}", r.html);
        assert_eq!(b.state_of(&s).await.as_deref(), Some("unknown"));
        let r = b.post(paths::HISTORY, &form).await;
        assert_eq!(r.status, 403);
        let r = b.post(paths::LOGOUT, &form).await;
        assert_eq!(r.status, 403);
    }
    // Still signed in: the refused sign-out did nothing.
    assert_eq!(b.get(paths::HOME).await.status, 200);

    // A reason is required.
    resolve.push(("csrf", &csrf));
    let mut no_reason = resolve.clone();
    no_reason[1] = ("reason", "  ");
    let r = b.post(paths::RESOLVE, &no_reason).await;
    assert_eq!(r.status, 400);
    assert!(r.html.contains("a reason is required"), "{}", r.html);
    assert_eq!(b.state_of(&s).await.as_deref(), Some("unknown"));

    let r = b.post(paths::RESOLVE, &resolve).await;
    assert_eq!(r.status, 200, "{}", r.html);
    assert!(r.html.contains("the key is released"), "{}", r.html);
    assert!(r.html.contains("the bank never saw it"));
    assert_eq!(b.state_of(&s).await, None);
    // Resolving again: nothing open any more.
    let again = b.post(paths::RESOLVE, &resolve).await;
    assert_eq!(again.status, 404);

    // Signing out ends the session on the server, not only in the browser.
    let kept = b.jar.clone();
    let r = b.post(paths::LOGOUT, &[("csrf", &csrf)]).await;
    assert_eq!((r.status, r.location()), (303, Some(paths::LOGIN)));
    b.jar = kept;
    assert_eq!(b.get(paths::HOME).await.location(), Some(paths::LOGIN));
}

#[tokio::test]
async fn a_completion_is_stored_and_its_reason_kept() {
    let mut b = Browser::new(ConsoleSettings::default()).await;
    let csrf = b.sign_in().await;
    let s = scope("k-complete");
    b.unknown_record(&s).await;
    let listed = b.get(paths::UNKNOWN).await;
    assert!(listed.html.contains("k-complete"));
    let mut form = scope_form(&s, &csrf);
    let opened = b.post(paths::HISTORY, &form).await;
    assert!(opened.html.contains(r#"id="complete""#), "{}", opened.html);
    form.extend([
        ("action", "complete"),
        ("status", "201"),
        (
            "headers",
            "Content-Type: application/json\r\nx-payment-id: pay_9\r\n",
        ),
        ("body", "{\"id\":\r\n \"pay_9\"}"),
        ("reason", "ledger: charge ch_9 succeeded"),
    ]);
    let r = b.post(paths::RESOLVE, &form).await;
    assert_eq!(r.status, 200, "{}", r.html);
    assert!(r.html.contains("completed with status 201"));
    assert!(
        !r.html.contains(r#"id="complete""#),
        "a completed record has no resolve form"
    );
    let out = b.state.store.claim(&claim(&s, Some(1))).await.unwrap();
    assert_eq!(out.body, b"{\"id\":\n \"pay_9\"}");
    let ClaimReply::Replay { status, headers, .. } = out.reply else {
        panic!("{:?}", out.reply);
    };
    assert_eq!(status, 201);
    assert_eq!(
        headers,
        [
            ("content-type".to_string(), "application/json".to_string()),
            ("x-payment-id".to_string(), "pay_9".to_string())
        ]
    );
    let h = b
        .state
        .store
        .backend
        .lookup(
            &Lookup {
                tenant: "acme".into(),
                key: "k-complete".into(),
                ..Lookup::default()
            },
            10,
        )
        .await
        .unwrap();
    let resolved = h
        .events
        .iter()
        .find(|e| e.transition == Transition::Resolved)
        .unwrap();
    assert_eq!(resolved.actor.as_str(), ALICE, "the operator the proxy named");
    assert_eq!(resolved.reason.as_deref(), Some("ledger: charge ch_9 succeeded"));

    // A bad status or header is refused before anything is written.
    let t = scope("k-bad");
    b.unknown_record(&t).await;
    let mut bad = scope_form(&t, &csrf);
    bad.extend([("action", "complete"), ("status", "abc"), ("reason", "r")]);
    assert_eq!(b.post(paths::RESOLVE, &bad).await.status, 400);
    bad[7] = ("status", "200");
    bad.push(("headers", "no colon here"));
    assert_eq!(b.post(paths::RESOLVE, &bad).await.status, 400);
    assert_eq!(b.state_of(&t).await.as_deref(), Some("unknown"));
}

#[tokio::test]
async fn everything_shown_is_escaped() {
    let mut b = Browser::new(ConsoleSettings::default()).await;
    let csrf = b.sign_in().await;
    let s = scope_of(
        "<script>alert('t')</script>",
        "\"><img src=x onerror=alert(1)>",
        "payments.create",
        Namespace::Client,
        "<b>k'&</b>",
    );
    b.unknown_record(&s).await;
    let mut form = scope_form(&s, &csrf);
    form.extend([
        ("action", "complete"),
        ("status", "200"),
        ("headers", "x-note: <i onmouseover=alert(2)>"),
        ("reason", "</td><script>alert(3)</script>"),
    ]);
    let pages = [
        b.get(paths::UNKNOWN).await,
        b.post(paths::HISTORY, &scope_form(&s, &csrf)).await,
        b.post(paths::RESOLVE, &form).await,
    ];
    for p in &pages {
        assert_eq!(p.status, 200, "{}", p.html);
        for raw in ["<script>", "<img", "<b>", "<i ", "</td><script"] {
            assert!(!p.html.contains(raw), "{raw} unescaped in {}", p.html);
        }
        assert!(p.html.contains("&lt;script&gt;alert(&#39;t&#39;)&lt;/script&gt;"));
        assert!(p.html.contains("&lt;b&gt;k&#39;&amp;&lt;/b&gt;"));
    }
    let resolved = &pages[2].html;
    assert!(resolved.contains("&lt;i onmouseover=alert(2)&gt;"), "{resolved}");
    assert!(resolved.contains("&lt;/td&gt;&lt;script&gt;alert(3)&lt;/script&gt;"));
}

/// The real binary, logging everything (every crate, every level).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_key_reaches_a_url_or_the_log() {
    let mut b = Browser::of_process("trace").await;
    let csrf = b.sign_in().await;
    let key = "secret-key-7f3a9c";
    let s = scope(key);
    b.unknown_record(&s).await;
    b.claimed(&scope("secret-key-stuck")).await;
    b.get(paths::HOME).await;
    b.get(paths::UNKNOWN).await;
    b.get(&format!("{}?older_than_s=0", paths::STUCK)).await;
    b.post(
        paths::HISTORY,
        &[("csrf", &csrf), ("tenant", "acme"), ("key", key)],
    )
    .await;
    let mut form = scope_form(&s, &csrf);
    form.extend([("action", "release"), ("reason", "not charged")]);
    b.post(paths::RESOLVE, &form).await;
    form.retain(|(n, _)| *n != "csrf");
    b.post(paths::RESOLVE, &form).await;
    b.post(paths::LOGOUT, &[("csrf", &csrf)]).await;
    assert!(b.urls.len() > 10);
    for url in &b.urls {
        assert!(!url.contains("secret-key"), "a key in a URL: {url}");
    }
    // Opening a record by URL is not a thing.
    let query = format!("{}?tenant=acme&key=in-a-url", paths::HISTORY);
    assert_eq!(b.get(&query).await.status, 405);
    b.urls.pop();
    let log = b.process.as_ref().unwrap().0.log();
    assert!(
        log.contains("signed in") && log.contains("resolved by an operator"),
        "{log}"
    );
    assert!(log.contains("DEBUG"), "debug lines are logged too");
    assert!(!log.contains("secret-key"), "a key in the log:\n{log}");
    assert!(!log.contains("not charged"), "a reason in the log:\n{log}");
    assert!(!log.contains(ADMIN), "the credential in the log:\n{log}");
    assert!(
        !log.contains(PROXY_SECRET),
        "the proxy's secret in the log:\n{log}"
    );
    assert!(!log.contains(&csrf), "a CSRF token in the log:\n{log}");
}

#[tokio::test]
async fn the_console_can_be_switched_off() {
    let mut b = Browser::new(ConsoleSettings {
        enabled: false,
        ..ConsoleSettings::default()
    })
    .await;
    assert_eq!(b.get(paths::LOGIN).await.status, 404);
    assert_eq!(b.get(paths::HOME).await.status, 404);
}
