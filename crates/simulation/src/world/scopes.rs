//! The scopes of a run (a tenant and a key) and their histories as the
//! store keeps them.

use super::*;

/// How the run names a scope: its key, with its tenant unless everyone's.
pub fn scope_label(tenant: &str, key: &str) -> String {
    match tenant {
        idemgate_core::scope::EVERYONE => key.to_string(),
        tenant => format!("{tenant}/{key}"),
    }
}

/// The tenant and the key a [`scope_label`] names.
pub fn scope_of_label(label: &str) -> (&str, &str) {
    label
        .split_once('/')
        .unwrap_or((idemgate_core::scope::EVERYONE, label))
}

impl World {
    /// Reads every scope's history and keeps the first change to one that
    /// was not an addition ([`audit::overwritten`]).
    pub(super) fn look_at_histories(&mut self) {
        for scope in 0..self.shape.keys * self.shape.tenants {
            let now = self.history(scope);
            if let Some(before) = self.seen.get(&scope) {
                if let (None, Some(what)) = (&self.overwritten, audit::overwritten(before, &now)) {
                    self.overwritten = Some(format!("{} at {} ms: {what}", self.scope_name(scope), self.now));
                }
            }
            self.seen.insert(scope, now);
        }
    }

    /// Every scope's history as the store keeps it now.
    pub fn histories(&self) -> Vec<(String, KeyHistory)> {
        (0..self.shape.keys * self.shape.tenants)
            .map(|s| (self.scope_name(s), self.history(s)))
            .collect()
    }

    /// The tenant and the key of scope `s` (its tenant's number times the
    /// keys, plus its key's).
    pub(super) fn scope(&self, s: usize) -> (&'static str, String) {
        let tenant = match self.shape.tenants {
            1 => idemgate_core::scope::EVERYONE,
            _ => TENANTS[s / self.shape.keys],
        };
        (tenant, key_name(s % self.shape.keys))
    }

    pub fn scope_name(&self, s: usize) -> String {
        let (tenant, key) = self.scope(s);
        scope_label(tenant, &key)
    }

    pub(super) fn history(&self, s: usize) -> KeyHistory {
        let (tenant, key) = self.scope(s);
        self.far.history(tenant, &key)
    }
}
