//! Bearer credentials, kept only as SHA-256 digests and compared in
//! constant time; the API's may be read from files that are re-read while
//! the store serves, so a rotation restarts nothing.
//!
//! A token file is re-read every [`RELOAD_INTERVAL`] and taken when its
//! content changed: a Kubernetes Secret volume swaps a symlink (the mtime
//! of the link's target is not always new), so the content decides, not the
//! file's times. A change that would lock every caller out (the current
//! file empty or unreadable, a token equal to the admin one) is refused and
//! the accepted tokens stay.

use std::path::PathBuf;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

/// How often the API token files are read again.
pub const RELOAD_INTERVAL: Duration = Duration::from_secs(1);

/// A credential kept only as SHA-256 digests, so comparing takes the same
/// time whatever the length or content of what the client sent. It holds a
/// second accepted token while one is being rotated.
#[derive(Clone)]
pub struct Credential(Vec<[u8; 32]>);

impl std::fmt::Debug for Credential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Credential(***)")
    }
}

impl Credential {
    pub fn new(token: &str) -> Credential {
        Credential(vec![Sha256::digest(token.as_bytes()).into()])
    }

    /// Also accepts `token` (the next one, during a rotation).
    pub fn and(mut self, token: &str) -> Credential {
        self.0.push(Sha256::digest(token.as_bytes()).into());
        self
    }

    /// Compares with every accepted token, always all of them.
    pub fn matches(&self, presented: &[u8]) -> bool {
        let digest: [u8; 32] = Sha256::digest(presented).into();
        self.0
            .iter()
            .fold(subtle::Choice::from(0), |any, accepted| {
                any | accepted.ct_eq(&digest)
            })
            .into()
    }
}

/// The files the API tokens are read from: the current one, and the slot
/// of the next one during a rotation (absent or empty between rotations).
#[derive(Debug, Clone)]
pub struct TokenFiles {
    pub current: PathBuf,
    pub next: Option<PathBuf>,
}

/// The API's credential: none (mesh identities only), tokens given once,
/// or tokens read from [`TokenFiles`] and re-read ([`ApiCredential::reload`]).
/// Clones share the tokens, so a reload reaches every request.
#[derive(Clone, Default)]
pub struct ApiCredential(Arc<Shared>);

#[derive(Default)]
struct Shared {
    loaded: RwLock<Loaded>,
    files: Option<(TokenFiles, Credential)>,
}

#[derive(Default)]
struct Loaded {
    credential: Option<Credential>,
    /// Changes with every reload taken, so a connection's remembered
    /// credential is checked again after a rotation.
    generation: u64,
    /// SHA-256 of what the files held when last taken.
    read: [u8; 32],
}

impl std::fmt::Debug for ApiCredential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ApiCredential(***)")
    }
}

impl ApiCredential {
    pub fn new(token: &str) -> ApiCredential {
        ApiCredential::of(Some(Credential::new(token)), None)
    }

    /// No token at all: only mesh identities may call the API.
    pub fn none() -> ApiCredential {
        ApiCredential::default()
    }

    /// The tokens in `files`, re-read by [`ApiCredential::reload`]; never
    /// one that `admin` accepts.
    pub fn from_files(files: TokenFiles, admin: Credential) -> Result<ApiCredential, String> {
        let (credential, read) = read_files(&files, &admin)?;
        let api = ApiCredential::of(Some(credential), Some((files, admin)));
        if let Ok(mut loaded) = api.0.loaded.write() {
            loaded.read = read;
        }
        Ok(api)
    }

    fn of(credential: Option<Credential>, files: Option<(TokenFiles, Credential)>) -> ApiCredential {
        ApiCredential(Arc::new(Shared {
            loaded: RwLock::new(Loaded {
                credential,
                ..Loaded::default()
            }),
            files,
        }))
    }

    /// A credential of its own that also accepts `token` (the next one,
    /// during a rotation); it is not re-read from files.
    pub fn and(&self, token: &str) -> ApiCredential {
        let credential = match self.credential() {
            Some(c) => c.and(token),
            None => Credential::new(token),
        };
        ApiCredential::of(Some(credential), None)
    }

    fn credential(&self) -> Option<Credential> {
        self.0.loaded.read().ok().and_then(|l| l.credential.clone())
    }

    /// Whether a token is accepted at all.
    pub fn configured(&self) -> bool {
        self.0.loaded.read().is_ok_and(|l| l.credential.is_some())
    }

    pub fn matches(&self, presented: &[u8]) -> bool {
        self.0
            .loaded
            .read()
            .is_ok_and(|l| l.credential.as_ref().is_some_and(|c| c.matches(presented)))
    }

    /// Which tokens are accepted: a new number after every reload taken.
    pub fn generation(&self) -> u64 {
        self.0.loaded.read().map_or(0, |l| l.generation)
    }

    pub fn reloads(&self) -> bool {
        self.0.files.is_some()
    }

    /// Reads the token files again and takes what changed: `Ok(true)` when
    /// the accepted tokens changed, `Err` when the files are refused (the
    /// accepted tokens stay).
    pub fn reload(&self) -> Result<bool, String> {
        let Some((files, admin)) = &self.0.files else {
            return Ok(false);
        };
        let (credential, read) = read_files(files, admin)?;
        let mut loaded = self
            .0
            .loaded
            .write()
            .map_err(|_| "the API credential's lock is poisoned".to_string())?;
        if loaded.read == read {
            return Ok(false);
        }
        *loaded = Loaded {
            credential: Some(credential),
            generation: loaded.generation.wrapping_add(1),
            read,
        };
        Ok(true)
    }

    /// Re-reads the token files every [`RELOAD_INTERVAL`] until `stop`.
    pub async fn watch(self, mut stop: tokio::sync::watch::Receiver<bool>) {
        let mut every = tokio::time::interval(RELOAD_INTERVAL);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = every.tick() => {}
                _ = stop.changed() => return,
            }
            match self.reload() {
                Ok(true) => tracing::info!("the API token files changed: the store accepts their tokens now"),
                Ok(false) => {}
                Err(why) => {
                    tracing::warn!(%why, "the API token files were not taken; the accepted tokens stay")
                }
            }
        }
    }
}

/// The tokens `files` hold now, and a digest of what was read.
fn read_files(files: &TokenFiles, admin: &Credential) -> Result<(Credential, [u8; 32]), String> {
    let read = |path: &PathBuf| match std::fs::read_to_string(path) {
        Ok(text) => Ok(text.trim_end_matches(['\r', '\n']).to_string()),
        Err(e) => Err(format!("cannot read {}: {e}", path.display())),
    };
    let current = read(&files.current)?;
    if current.is_empty() {
        return Err(format!("{} is empty", files.current.display()));
    }
    // The next token's slot may be absent or empty between rotations.
    let next = match &files.next {
        Some(path) if path.exists() => read(path)?,
        _ => String::new(),
    };
    if admin.matches(current.as_bytes()) || (!next.is_empty() && admin.matches(next.as_bytes())) {
        return Err("an API token equals the admin token".into());
    }
    let mut digest = Sha256::new();
    digest.update(current.as_bytes());
    digest.update([0]);
    digest.update(next.as_bytes());
    let mut credential = Credential::new(&current);
    if !next.is_empty() {
        credential = credential.and(&next);
    }
    Ok((credential, digest.finalize().into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reload_takes_changed_files_and_refuses_a_lockout() {
        let dir = tempfile::tempdir().unwrap();
        let files = TokenFiles {
            current: dir.path().join("current"),
            next: Some(dir.path().join("next")),
        };
        std::fs::write(&files.current, "one\n").unwrap();
        let api = ApiCredential::from_files(files.clone(), Credential::new("admin")).unwrap();
        assert!(api.matches(b"one") && !api.matches(b"two"));
        assert_eq!(api.reload(), Ok(false));
        std::fs::write(files.next.as_ref().unwrap(), "two").unwrap();
        assert_eq!(api.reload(), Ok(true));
        assert!(api.matches(b"one") && api.matches(b"two"));
        let generation = api.generation();
        std::fs::write(&files.current, "").unwrap();
        assert!(api.reload().is_err());
        std::fs::write(&files.current, "admin").unwrap();
        assert!(api.reload().is_err());
        std::fs::remove_file(&files.current).unwrap();
        assert!(api.reload().is_err());
        assert!(api.matches(b"one") && api.matches(b"two"));
        assert_eq!(api.generation(), generation);
        std::fs::write(&files.current, "two").unwrap();
        std::fs::write(files.next.as_ref().unwrap(), "").unwrap();
        assert_eq!(api.reload(), Ok(true));
        assert!(!api.matches(b"one") && api.matches(b"two"));
        assert_ne!(api.generation(), generation);
    }

    #[test]
    fn a_credential_given_once_is_not_re_read() {
        let api = ApiCredential::new("one").and("two");
        assert!(api.matches(b"one") && api.matches(b"two"));
        assert!(!api.reloads());
        assert_eq!(api.reload(), Ok(false));
        assert!(!ApiCredential::none().configured());
        assert!(!ApiCredential::none().matches(b""));
    }
}
