//! The console's sessions: an operator the trusted authenticating proxy
//! names ([`crate::auth::Operator`]) signs in at the login form and gets a
//! random session token in an `HttpOnly`, `SameSite=Strict` cookie; the
//! session belongs to that operator, and every request on it must come
//! from the proxy naming the same one. Each session has its own CSRF token, which every form carries in
//! a hidden field and every POST must return; it is compared in constant
//! time. Sessions live in this process's memory (bounded, idle and absolute
//! lifetimes), keyed by the SHA-256 of their token, so a lookup reveals
//! nothing about the tokens held.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use axum::http::HeaderMap;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::auth::Operator;

/// The session cookie.
pub const SESSION_COOKIE: &str = "idemgate_console";
/// The login form's own cookie: the form's hidden field must repeat it
/// (double submit), so no other site can sign a browser in.
pub const LOGIN_COOKIE: &str = "idemgate_console_login";

/// A session unused for this long ends, unless configured otherwise
/// ([`ConsoleSettings::idle`]).
pub const IDLE: Duration = Duration::from_secs(15 * 60);
/// No session lasts longer than this.
pub const LIFETIME: Duration = Duration::from_secs(12 * 60 * 60);
/// At most this many sessions at once; a new one evicts the least recently used.
pub const MAX_SESSIONS: usize = 256;

/// How operators are served: the console, and where the identity of the
/// operator behind a console or admin request comes from.
#[derive(Debug, Clone)]
pub struct ConsoleSettings {
    /// Serve `/admin/console` at all.
    pub enabled: bool,
    /// Mark cookies `Secure`: set it when browsers reach the store over TLS
    /// (a terminating proxy or the mesh's ingress).
    pub secure_cookies: bool,
    /// Who names operators (the console's sessions and the admin API's
    /// changes both need one).
    pub operators: crate::auth::OperatorSource,
    /// A session unused for this long ends.
    pub idle: Duration,
}

impl Default for ConsoleSettings {
    fn default() -> Self {
        ConsoleSettings {
            enabled: true,
            secure_cookies: false,
            operators: crate::auth::OperatorSource::default(),
            idle: IDLE,
        }
    }
}

/// 32 random bytes from the operating system, as 64 hex digits.
pub fn random_token() -> Option<String> {
    let mut bytes = [0u8; 32];
    match getrandom::fill(&mut bytes) {
        Ok(()) => Some(bytes.iter().map(|b| format!("{b:02x}")).collect()),
        Err(e) => {
            tracing::error!(error = %e, "console: no randomness for a token");
            None
        }
    }
}

/// Whether two tokens are equal, in time independent of where they differ.
pub fn same_token(a: &str, b: &str) -> bool {
    !a.is_empty() && bool::from(a.as_bytes().ct_eq(b.as_bytes()))
}

struct Session {
    csrf: String,
    operator: Operator,
    created: Instant,
    last_seen: Instant,
}

/// A live session as a handler sees it.
#[derive(Debug, Clone)]
pub struct Current {
    /// The value every form of this session carries.
    pub csrf: String,
    /// Who signed in: the actor of what the session changes.
    pub operator: Operator,
}

/// What a request's session cookie names.
#[derive(Debug, Clone)]
pub enum Found {
    /// No session cookie, or one naming no session this process knows.
    None,
    /// A session that was alive and has now ended: idle too long, or past
    /// its lifetime.
    Ended,
    Live(Current),
}

#[derive(Default)]
pub struct Sessions {
    by_digest: Mutex<HashMap<[u8; 32], Session>>,
}

fn digest(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

impl Sessions {
    /// A new session of `operator`: its cookie token and its CSRF token.
    /// Sessions idle for `idle` are dropped on the way.
    pub fn open(&self, operator: &Operator, idle: Duration) -> Option<(String, Current)> {
        let token = random_token()?;
        let csrf = random_token()?;
        let now = Instant::now();
        let mut map = self.by_digest.lock().unwrap_or_else(|e| e.into_inner());
        map.retain(|_, s| alive(s, now, idle));
        while map.len() >= MAX_SESSIONS {
            let oldest = map.iter().min_by_key(|(_, s)| s.last_seen).map(|(k, _)| *k);
            match oldest {
                Some(k) => map.remove(&k),
                None => break,
            };
        }
        map.insert(
            digest(&token),
            Session {
                csrf: csrf.clone(),
                operator: operator.clone(),
                created: now,
                last_seen: now,
            },
        );
        Some((
            token,
            Current {
                csrf,
                operator: operator.clone(),
            },
        ))
    }

    /// The session the request's cookie names: alive if used within `idle`
    /// (using it keeps it alive), else ended and forgotten.
    pub fn find(&self, headers: &HeaderMap, idle: Duration) -> Found {
        self.find_at(headers, idle, Instant::now())
    }

    fn find_at(&self, headers: &HeaderMap, idle: Duration, now: Instant) -> Found {
        let Some(token) = cookie(headers, SESSION_COOKIE) else {
            return Found::None;
        };
        let mut map = self.by_digest.lock().unwrap_or_else(|e| e.into_inner());
        let key = digest(&token);
        match map.get_mut(&key) {
            Some(s) if alive(s, now, idle) => {
                s.last_seen = now;
                Found::Live(Current {
                    csrf: s.csrf.clone(),
                    operator: s.operator.clone(),
                })
            }
            Some(_) => {
                map.remove(&key);
                Found::Ended
            }
            None => Found::None,
        }
    }

    /// The live session the request's cookie names, if any.
    pub fn current(&self, headers: &HeaderMap, idle: Duration) -> Option<Current> {
        match self.find(headers, idle) {
            Found::Live(c) => Some(c),
            Found::None | Found::Ended => None,
        }
    }

    /// Ends the session the request's cookie names.
    pub fn close(&self, headers: &HeaderMap) {
        if let Some(token) = cookie(headers, SESSION_COOKIE) {
            let mut map = self.by_digest.lock().unwrap_or_else(|e| e.into_inner());
            map.remove(&digest(&token));
        }
    }

    /// How many sessions are open (expired ones not yet dropped included).
    pub fn len(&self) -> usize {
        self.by_digest.lock().map(|m| m.len()).unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

fn alive(s: &Session, now: Instant, idle: Duration) -> bool {
    now.duration_since(s.last_seen) < idle && now.duration_since(s.created) < LIFETIME
}

/// The value of cookie `name` in the request's `Cookie` headers.
pub fn cookie(headers: &HeaderMap, name: &str) -> Option<String> {
    headers
        .get_all(axum::http::header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(n, _)| *n == name)
        .map(|(_, v)| v.trim().to_string())
}

/// A `Set-Cookie` value for the console's path; `None` deletes the cookie.
pub fn set_cookie(name: &str, value: Option<&str>, secure: bool) -> String {
    let mut c = match value {
        Some(v) => format!("{name}={v}"),
        None => format!("{name}=; Max-Age=0"),
    };
    c.push_str("; Path=");
    c.push_str(super::BASE);
    c.push_str("; HttpOnly; SameSite=Strict");
    if secure {
        c.push_str("; Secure");
    }
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_cookie(value: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(axum::http::header::COOKIE, value.parse().unwrap());
        h
    }

    fn alice() -> Operator {
        Operator::named("alice@example.com").unwrap()
    }

    #[test]
    fn a_session_is_found_by_its_cookie_and_ends_on_close() {
        let sessions = Sessions::default();
        let (token, opened) = sessions.open(&alice(), IDLE).unwrap();
        assert_eq!(token.len(), 64);
        assert_ne!(token, opened.csrf);
        let h = with_cookie(&format!("other=1; {SESSION_COOKIE}={token}"));
        let current = sessions.current(&h, IDLE).unwrap();
        assert_eq!((current.csrf, current.operator), (opened.csrf, alice()));
        assert!(sessions
            .current(&with_cookie(&format!("{SESSION_COOKIE}=x{token}")), IDLE)
            .is_none());
        sessions.close(&h);
        assert!(sessions.current(&h, IDLE).is_none());
    }

    #[test]
    fn an_idle_session_ends() {
        let sessions = Sessions::default();
        let (token, _) = sessions.open(&alice(), IDLE).unwrap();
        let h = with_cookie(&format!("{SESSION_COOKIE}={token}"));
        let idle = Duration::from_millis(50);
        let opened = Instant::now();
        let at = |ms| opened + Duration::from_millis(ms);
        assert!(sessions.current(&h, idle).is_some());
        assert!(matches!(sessions.find_at(&h, idle, at(30)), Found::Live(_)));
        // Used within the limit: kept alive, the limit counts from here.
        assert!(matches!(sessions.find_at(&h, idle, at(60)), Found::Live(_)));
        assert!(matches!(sessions.find_at(&h, idle, at(120)), Found::Ended));
        // Ended for good, whatever the limit now.
        assert!(matches!(sessions.find(&h, IDLE), Found::None));
    }

    #[test]
    fn sessions_are_bounded() {
        let sessions = Sessions::default();
        for _ in 0..MAX_SESSIONS + 10 {
            sessions.open(&alice(), IDLE).unwrap();
        }
        assert_eq!(sessions.len(), MAX_SESSIONS);
    }

    #[test]
    fn tokens_compare_whole() {
        assert!(same_token("abc", "abc"));
        assert!(!same_token("abc", "abd"));
        assert!(!same_token("abc", "abcd"));
        assert!(!same_token("", ""));
    }

    #[test]
    fn cookies_stay_on_the_console_path_and_out_of_scripts() {
        let c = set_cookie(SESSION_COOKIE, Some("t"), false);
        assert_eq!(
            c,
            "idemgate_console=t; Path=/admin/console; HttpOnly; SameSite=Strict"
        );
        assert!(set_cookie(SESSION_COOKIE, None, true).ends_with("; Secure"));
    }
}
