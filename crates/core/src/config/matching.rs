//! Which policy covers a request: method, host and the normalized path.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Matcher {
    /// Upper-case methods; empty means the default `POST` and `PATCH`.
    pub methods: Vec<String>,
    pub host: Option<String>,
    /// Compared with the request's normalized path ([`crate::path::normalize`]);
    /// exact and template patterns are stored normalized.
    pub path: PathMatch,
    /// Compare paths ignoring ASCII case (patterns are stored lower-case).
    pub ignore_case: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum PathMatch {
    Exact(String),
    Prefix(String),
    /// `/v1/accounts/{id}/charges`: each `{…}` matches one non-empty segment.
    Template(String),
}

impl Matcher {
    pub fn matches(&self, method: &str, host: &str, path: &str) -> bool {
        let method_ok = if self.methods.is_empty() {
            method == "POST" || method == "PATCH"
        } else {
            self.methods.iter().any(|m| m == method)
        };
        let host_ok = match &self.host {
            None => true,
            Some(h) => {
                let bare = host.rsplit_once(':').map_or(host, |(h, port)| {
                    if port.bytes().all(|b| b.is_ascii_digit()) {
                        h
                    } else {
                        host
                    }
                });
                h.eq_ignore_ascii_case(host) || h.eq_ignore_ascii_case(bare)
            }
        };
        method_ok && host_ok && self.path.matches(&self.normal_path(path))
    }

    /// The request's path as this policy sees it: normalized, and lower-case
    /// if the policy ignores case.
    fn normal_path(&self, path: &str) -> String {
        let normal = crate::path::normalize(path);
        if self.ignore_case {
            normal.to_ascii_lowercase()
        } else {
            normal
        }
    }

    /// The path with query that is fingerprinted: every spelling of the same
    /// resource is the same request, so a retry in another spelling replays.
    pub fn fingerprint_path(&self, path: &str) -> String {
        format!("{}{}", self.normal_path(path), crate::path::query(path))
    }
}

impl PathMatch {
    fn matches(&self, path: &str) -> bool {
        match self {
            PathMatch::Exact(p) => path == p,
            // A normalized path has no trailing slash, so `/v1/payments/`
            // must also cover `/v1/payments` itself.
            PathMatch::Prefix(p) => {
                path.starts_with(p.as_str()) || (p.len() > 1 && p.strip_suffix('/') == Some(path))
            }
            PathMatch::Template(t) => {
                let mut want = t.split('/');
                let mut got = path.split('/');
                loop {
                    match (want.next(), got.next()) {
                        (None, None) => return true,
                        (Some(w), Some(g)) if w.starts_with('{') && w.ends_with('}') => {
                            if g.is_empty() {
                                return false;
                            }
                        }
                        (Some(w), Some(g)) if w == g => {}
                        _ => return false,
                    }
                }
            }
        }
    }
}
