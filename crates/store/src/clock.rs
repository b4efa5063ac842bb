//! The store's clock: the database server's on PostgreSQL (every replica
//! follows it), the system's on SQLite. Tests use a manual clock so lease
//! expiry and archiving are driven by values, not by sleeping.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::backend::{Backend, Result};

#[derive(Clone, Debug)]
pub enum Clock {
    System,
    /// The system clock corrected by this many milliseconds: the offset to
    /// the database server's clock, which every replica sharing a database
    /// follows (see [`Clock::follow`]).
    Followed(Arc<AtomicI64>),
    /// Milliseconds since the epoch, moved by hand.
    Manual(Arc<AtomicI64>),
}

impl Clock {
    pub fn manual(start_ms: i64) -> Clock {
        Clock::Manual(Arc::new(AtomicI64::new(start_ms)))
    }

    /// Milliseconds since the Unix epoch.
    pub fn now(&self) -> i64 {
        match self {
            Clock::System => system_now(),
            Clock::Followed(offset) => system_now().saturating_add(offset.load(Ordering::Relaxed)),
            Clock::Manual(ms) => ms.load(Ordering::SeqCst),
        }
    }

    /// Moves a manual clock forward; no effect on the system clock.
    pub fn advance(&self, ms: i64) {
        if let Clock::Manual(at) = self {
            at.fetch_add(ms, Ordering::SeqCst);
        }
    }
}

/// How often a followed clock is compared with the database's again: a
/// replica's own clock stepping counts for at most this long.
pub const FOLLOW_EVERY: Duration = Duration::from_secs(1);

impl Clock {
    /// The clock of a store on `backend`: the database server's when
    /// replicas share one (PostgreSQL), so that leases, expiry and retention
    /// are judged by one clock however the replicas' own clocks drift or
    /// step; else the system clock. Followed to within half a round trip,
    /// compared again every [`FOLLOW_EVERY`] until the store stops.
    pub async fn follow(backend: &Arc<dyn Backend>) -> Result<Clock> {
        let Some(offset) = offset_to(backend.as_ref()).await? else {
            return Ok(Clock::System);
        };
        let shared = Arc::new(AtomicI64::new(offset));
        let (backend, followed) = (Arc::clone(backend), Arc::downgrade(&shared));
        tokio::spawn(async move {
            let mut every = tokio::time::interval(FOLLOW_EVERY);
            every.tick().await;
            loop {
                every.tick().await;
                let Some(shared) = followed.upgrade() else { return };
                match offset_to(backend.as_ref()).await {
                    Ok(Some(offset)) => shared.store(offset, Ordering::Relaxed),
                    Ok(None) => return,
                    // Keep the last offset: the database is unreachable, and
                    // so is everything the clock would be used for.
                    Err(e) => tracing::debug!("clock: the database's time is unavailable: {e}"),
                }
            }
        });
        Ok(Clock::Followed(shared))
    }
}

/// The database's clock minus the system clock, taken at the middle of the
/// round trip that read it.
async fn offset_to(backend: &dyn Backend) -> Result<Option<i64>> {
    let before = system_now();
    let Some(database) = backend.database_now().await? else {
        return Ok(None);
    };
    let after = system_now();
    Ok(Some(database - before - (after - before) / 2))
}

pub fn system_now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}
