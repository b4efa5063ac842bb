//! The store's clock. Tests use a manual clock so lease expiry and archiving
//! are driven by values, not by sleeping.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

#[derive(Clone, Debug)]
pub enum Clock {
    System,
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

pub fn system_now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}
