//! How records are named in logs (contract §9): never by their raw key, and
//! not by a bare digest either. A bare SHA-256 of the scope can be reversed
//! for low-entropy keys (order numbers, counters) by hashing guesses, since
//! tenant and route are in the same log line. The name is instead the first
//! 12 hex digits of an HMAC-SHA256 of the scope's encoding under a secret
//! that only the store holds: without it, a log line says nothing about the
//! key.
//!
//! Request fingerprints reach event log lines the same way: a fingerprint is
//! a bare SHA-256 of method, route, path and body, so whoever reads the logs
//! could confirm a guessed low-entropy body (an amount, an account id) by
//! hashing it. A line carries instead 12 hex digits of an HMAC of the
//! fingerprint under the same secret, with a label in front that keeps the
//! two names apart (see [`LogIds::of_fingerprint`]). The admin API and
//! `inspect`, which are not logs, still show the stored fingerprint.
//!
//! The secret comes from `--log-key-file`; without one, `serve` derives it
//! from the admin credential, which every replica already shares and which
//! outlives restarts, so the same record has the same name in every
//! replica's log and in the admin API (see [`LogIds::from_admin_credential`]).

use hmac::{Hmac, Mac};
use idemgate_core::scope::Scope;
use sha2::Sha256;

type HmacSha256 = Hmac<Sha256>;

/// What a fingerprint's name hashes before the fingerprint. A scope's
/// encoding starts with a zero byte (the high byte of the length of a
/// component of at most 255 bytes); this label does not, so no fingerprint's
/// name is ever computed over the same bytes as a record's.
const FINGERPRINT_LABEL: &[u8] = b"idemgate log fingerprint v1\0";

/// The shortest log key accepted from a file, in bytes.
pub const MIN_KEY_LEN: usize = 16;

/// Names records in logs, the admin API and the console: a keyed hash.
#[derive(Clone)]
pub struct LogIds {
    /// Keyed once; each id clones this state and adds the scope.
    mac: HmacSha256,
}

impl std::fmt::Debug for LogIds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LogIds(<secret>)")
    }
}

impl LogIds {
    /// Keyed with `key` (at least [`MIN_KEY_LEN`] bytes).
    pub fn new(key: &[u8]) -> Result<LogIds, String> {
        if key.len() < MIN_KEY_LEN {
            return Err(format!(
                "the log key has {} bytes; it needs at least {MIN_KEY_LEN} (e.g. `head -c 32 /dev/urandom | base64`)",
                key.len()
            ));
        }
        let mac = HmacSha256::new_from_slice(key).map_err(|e| format!("the log key: {e}"))?;
        Ok(LogIds { mac })
    }

    /// Keyed with the contents of `path` (a trailing newline is ignored).
    pub fn from_file(path: &std::path::Path) -> Result<LogIds, String> {
        let bytes = std::fs::read(path)
            .map_err(|e| format!("cannot read the log key file {}: {e}", path.display()))?;
        let end = bytes
            .iter()
            .rposition(|b| *b != b'\n' && *b != b'\r')
            .map_or(0, |i| i + 1);
        LogIds::new(&bytes[..end]).map_err(|e| format!("{}: {e}", path.display()))
    }

    /// Keyed with a secret derived from the admin credential (an HMAC of a
    /// fixed label under it): stable across restarts and the same on every
    /// replica started with that credential. Whoever holds the admin
    /// credential can compute ids, but can read the records anyway.
    pub fn from_admin_credential(admin_token: &str) -> Result<LogIds, String> {
        let mut mac = HmacSha256::new_from_slice(admin_token.as_bytes())
            .map_err(|e| format!("the admin credential: {e}"))?;
        mac.update(b"idemgate log id key v1");
        LogIds::new(&mac.finalize().into_bytes())
    }

    /// Keyed with 32 random bytes: ids that match nothing outside this process.
    pub fn random() -> Result<LogIds, String> {
        let mut key = [0u8; 32];
        getrandom::fill(&mut key).map_err(|e| format!("no random bytes for the log key: {e}"))?;
        LogIds::new(&key)
    }

    /// The record's name: 12 hex digits of the HMAC of [`Scope::encode`].
    pub fn of(&self, scope: &Scope) -> String {
        let mut mac = self.mac.clone();
        mac.update(&scope.encode());
        short(&mac.finalize().into_bytes())
    }

    /// The name of a request fingerprint in a log line: 12 hex digits of the
    /// HMAC of a label and the fingerprint as stored (its 64 hex digits),
    /// under the same secret as [`LogIds::of`]. Equal fingerprints have equal
    /// names under one secret, so lines about one request still correlate.
    pub fn of_fingerprint(&self, fingerprint: &str) -> String {
        let mut mac = self.mac.clone();
        mac.update(FINGERPRINT_LABEL);
        mac.update(fingerprint.as_bytes());
        short(&mac.finalize().into_bytes())
    }
}

/// The first 6 bytes of a tag, in hex.
fn short(tag: &[u8]) -> String {
    tag.iter().take(6).map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use idemgate_core::key::Key;
    use idemgate_core::scope::Namespace;
    use sha2::Digest;

    fn scope(key: &str) -> Scope {
        Scope::new(
            "acme",
            "*",
            "payments.create",
            Namespace::Client,
            Key::try_from(key.to_string()).unwrap(),
        )
        .unwrap()
    }

    fn bare_digest(s: &Scope) -> String {
        hex(&Sha256::digest(s.encode()))
    }

    fn hex(bytes: &[u8]) -> String {
        bytes.iter().take(6).map(|b| format!("{b:02x}")).collect()
    }

    #[test]
    fn a_low_entropy_key_cannot_be_recovered_from_its_log_id_without_the_secret() {
        let ids = LogIds::new(b"0123456789abcdef0123456789abcdef").unwrap();
        let logged = ids.of(&scope("1042"));
        assert_eq!(logged.len(), 12);
        assert!(logged.bytes().all(|b| b.is_ascii_hexdigit()));
        // An attacker who knows tenant and route (they are in the same log
        // line) hashes every short numeric key: no guess matches, whether
        // hashed bare or as the scope digest the store uses as primary key.
        for guess in 0..10_000 {
            let s = scope(&guess.to_string());
            assert_ne!(bare_digest(&s), logged, "bare digest of {guess}");
            assert_ne!(hex(&s.digest()), logged, "scope digest of {guess}");
            assert_ne!(
                hex(&Sha256::digest(guess.to_string())),
                logged,
                "digest of the key {guess}"
            );
        }
        // With the secret, the id is reproducible.
        assert_eq!(
            LogIds::new(b"0123456789abcdef0123456789abcdef")
                .unwrap()
                .of(&scope("1042")),
            logged
        );
        // Another secret names the record differently.
        assert_ne!(
            LogIds::new(b"fedcba9876543210fedcba9876543210")
                .unwrap()
                .of(&scope("1042")),
            logged
        );
    }

    #[test]
    fn two_stores_reading_the_same_key_file_give_the_same_ids() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("log.key");
        std::fs::write(&path, "c2VjcmV0LXNoYXJlZC1ieS1yZXBsaWNhcw==\n").unwrap();
        let a = LogIds::from_file(&path).unwrap();
        let b = LogIds::from_file(&path).unwrap();
        assert_eq!(a.of(&scope("k-1")), b.of(&scope("k-1")));
        assert_ne!(a.of(&scope("k-1")), a.of(&scope("k-2")));
        // The trailing newline is not part of the key.
        let bare = LogIds::new(b"c2VjcmV0LXNoYXJlZC1ieS1yZXBsaWNhcw==").unwrap();
        assert_eq!(bare.of(&scope("k-1")), a.of(&scope("k-1")));
    }

    #[test]
    fn replicas_sharing_the_admin_credential_give_the_same_ids() {
        let a = LogIds::from_admin_credential("admin-credential").unwrap();
        let b = LogIds::from_admin_credential("admin-credential").unwrap();
        let other = LogIds::from_admin_credential("another-credential").unwrap();
        assert_eq!(a.of(&scope("k")), b.of(&scope("k")));
        assert_ne!(a.of(&scope("k")), other.of(&scope("k")));
    }

    #[test]
    fn a_short_or_missing_key_file_is_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("short.key");
        std::fs::write(&path, "short\n").unwrap();
        let err = LogIds::from_file(&path).unwrap_err();
        assert!(err.contains("at least 16"), "{err}");
        let err = LogIds::from_file(&dir.path().join("absent")).unwrap_err();
        assert!(err.contains("cannot read the log key file"), "{err}");
    }

    #[test]
    fn a_fingerprint_is_named_by_a_keyed_hash_apart_from_record_names() {
        let ids = LogIds::new(b"0123456789abcdef0123456789abcdef").unwrap();
        // The fingerprint of a low-entropy body.
        let of_body =
            |body: &str| -> String { Sha256::digest(body).iter().map(|b| format!("{b:02x}")).collect() };
        let fingerprint = of_body(r#"{"amount":4200}"#);
        let logged = ids.of_fingerprint(&fingerprint);
        assert_eq!(logged.len(), 12);
        assert!(logged.bytes().all(|b| b.is_ascii_hexdigit()));
        assert!(!fingerprint.contains(&logged));
        // Without the secret, hashing guessed amounts matches nothing.
        for amount in 0..10_000 {
            let guess = of_body(&format!(r#"{{"amount":{amount}}}"#));
            assert_ne!(&guess[..12], logged, "amount {amount}");
        }
        // Reproducible under the secret, another under another secret.
        assert_eq!(ids.of_fingerprint(&fingerprint), logged);
        let other = LogIds::new(b"fedcba9876543210fedcba9876543210").unwrap();
        assert_ne!(other.of_fingerprint(&fingerprint), logged);
        assert_ne!(ids.of_fingerprint(&of_body("{}")), logged);
        // Never a record's name: the label keeps the two hashes apart, even
        // over bytes that are a scope's encoding.
        let s = scope("1042");
        let encoded = String::from_utf8(s.encode()).unwrap();
        assert_ne!(ids.of_fingerprint(&encoded), ids.of(&s));
        assert_ne!(ids.of_fingerprint(&fingerprint), ids.of(&s));
        assert_ne!(FINGERPRINT_LABEL[0], 0);
        assert_eq!(s.encode()[0], 0);
    }

    #[test]
    fn random_keys_differ() {
        let (a, b) = (LogIds::random().unwrap(), LogIds::random().unwrap());
        assert_ne!(a.of(&scope("k")), b.of(&scope("k")));
    }
}
