//! The store's clock: the database server's on PostgreSQL (every replica
//! follows it), the system's on SQLite. Tests use a manual clock so lease
//! expiry and archiving are driven by values, not by sleeping.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;

use crate::error::Result;

/// Where a followed clock reads the database server's time: any backend
/// (`Backend::database_now_us`). The clock asks nothing else of it, so it
/// needs only this and stays below the backends that read it.
#[async_trait]
pub trait DatabaseClock: Send + Sync {
    /// µs since the Unix epoch; `None` when the store's own clock is the
    /// only one.
    async fn read_us(&self) -> Result<Option<i64>>;
}

#[derive(Clone, Debug)]
pub enum Clock {
    System,
    /// The database server's clock, which every replica sharing a database
    /// follows (see [`Clock::follow`]): the microseconds to add to
    /// `monotonic_us`, so that between readings time moves with the
    /// monotonic clock and a step of the replica's own clock never counts.
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
            Clock::Followed(base) => monotonic_us().saturating_add(base.load(Ordering::Relaxed)) / 1_000,
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

/// How often a followed clock is compared with the database's again, to
/// correct the drift between the two.
pub const FOLLOW_EVERY: Duration = Duration::from_secs(1);

impl Clock {
    /// The clock of a store on `backend`: the database server's when
    /// replicas share one (PostgreSQL), so that leases, expiry and retention
    /// are judged by one clock however the replicas' own clocks drift or
    /// step; else the system clock. Followed to within half a round trip,
    /// compared again every [`FOLLOW_EVERY`] until the store stops, and
    /// corrected when a reading is `WITHIN_US` or more off.
    pub async fn follow<D: DatabaseClock + ?Sized + 'static>(backend: &Arc<D>) -> Result<Clock> {
        // The quickest of a few readings: the least room for error.
        let mut best: Option<Reading> = None;
        for _ in 0..FIRST_READINGS {
            let Some(reading) = Reading::take(backend.as_ref()).await? else {
                return Ok(Clock::System);
            };
            if best.is_none_or(|b| reading.round_trip < b.round_trip) {
                best = Some(reading);
            }
        }
        let Some(first) = best else {
            return Ok(Clock::System);
        };
        let shared = Arc::new(AtomicI64::new(first.base_us));
        let (backend, followed) = (Arc::clone(backend), Arc::downgrade(&shared));
        tokio::spawn(async move {
            let mut trusted = Trust::new(first.round_trip);
            let mut every = tokio::time::interval(FOLLOW_EVERY);
            every.tick().await;
            loop {
                every.tick().await;
                let Some(shared) = followed.upgrade() else { return };
                match Reading::take(backend.as_ref()).await {
                    Ok(Some(reading)) if trusted.admits(reading.round_trip) => {
                        if reading.corrects(shared.load(Ordering::Relaxed)) {
                            shared.store(reading.base_us, Ordering::Relaxed)
                        }
                    }
                    Ok(Some(_)) => {}
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

const FIRST_READINGS: usize = 5;

/// The database's clock minus the monotonic clock, taken at the middle of
/// the round trip that read it, and how long that round trip took: the
/// reading is off by at most half of it.
#[derive(Clone, Copy)]
struct Reading {
    base_us: i64,
    round_trip: Duration,
}

/// Readings this close to the clock followed so far are left alone: a
/// correction smaller than a reading's own error would only add noise to
/// every timestamp.
const WITHIN_US: i64 = 5_000;

impl Reading {
    async fn take<D: DatabaseClock + ?Sized>(backend: &D) -> Result<Option<Reading>> {
        let (monotonic, started) = (monotonic_us(), Instant::now());
        let Some(database) = backend.read_us().await? else {
            return Ok(None);
        };
        let round_trip = started.elapsed();
        let middle = monotonic.saturating_add(i64::try_from(round_trip.as_micros() / 2).unwrap_or(i64::MAX));
        Ok(Some(Reading {
            base_us: database.saturating_sub(middle),
            round_trip,
        }))
    }

    /// Whether the clock followed so far (`base_us`) is off enough to move.
    fn corrects(&self, base_us: i64) -> bool {
        self.base_us.saturating_sub(base_us).abs() >= WITHIN_US
    }
}

/// Which readings are worth taking: a slow one (the store paused, the
/// database busy) could be off by hundreds of milliseconds and move every
/// lease with it, so only readings about as quick as the quickest seen
/// count, unless slow ones persist (the network changed).
struct Trust {
    quickest: Duration,
    refused: u32,
}

impl Trust {
    fn new(quickest: Duration) -> Trust {
        Trust { quickest, refused: 0 }
    }

    fn admits(&mut self, round_trip: Duration) -> bool {
        let quick = round_trip <= self.quickest * 2 + Duration::from_millis(2);
        if quick || self.refused >= 10 {
            self.quickest = if quick {
                self.quickest.min(round_trip)
            } else {
                round_trip
            };
            self.refused = 0;
            true
        } else {
            self.refused += 1;
            false
        }
    }
}

/// Microseconds on the monotonic clock (since this process first asked),
/// which no setting of the system clock moves.
fn monotonic_us() -> i64 {
    static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    i64::try_from(START.get_or_init(Instant::now).elapsed().as_micros()).unwrap_or(i64::MAX)
}

/// Microseconds since the Unix epoch on the system clock.
pub fn system_now_us() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

pub fn system_now() -> i64 {
    system_now_us() / 1000
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readings_within_5_ms_of_the_clock_followed_are_left_alone() {
        let at = |base_us| Reading {
            base_us,
            round_trip: Duration::ZERO,
        };
        assert!(!at(1_004_999).corrects(1_000_000) && !at(995_001).corrects(1_000_000));
        assert!(at(1_005_000).corrects(1_000_000) && at(-4_200_000).corrects(1_000_000));
    }

    #[test]
    fn only_readings_about_as_quick_as_the_quickest_are_trusted_until_slow_ones_persist() {
        let ms = Duration::from_millis;
        let mut trust = Trust::new(ms(1));
        assert!(trust.admits(ms(3)));
        assert!(!trust.admits(ms(1_500)), "a reading across a pause");
        assert!(trust.admits(ms(1)));
        for _ in 0..10 {
            assert!(!trust.admits(ms(40)));
        }
        assert!(trust.admits(ms(40)), "the network changed");
        assert!(trust.admits(ms(60)));
    }
}
