//! A budget of new keys per tenant: how many claims that take a key (a new
//! record, or a new generation of an old one) a tenant may make, as a token
//! bucket refilled at a steady rate up to a burst. Replays, conflicts,
//! completions and every other call cost nothing: a claim is charged when it
//! is sent to the database and given back unless it took the key.
//!
//! Each replica keeps its own buckets, in memory: with several replicas a
//! tenant may take up to the budget from each. Divide the budget by the
//! number of replicas to bound the total.

use std::collections::HashMap;
use std::sync::Mutex;

/// Buckets tracked at most; beyond it, full buckets (tenants that have not
/// spent anything lately) are forgotten, which changes nothing for them.
const MAX_TRACKED: usize = 100_000;

/// The budget and every tenant's bucket.
#[derive(Debug)]
pub struct Budgets {
    /// New keys per second, per tenant.
    rate_per_sec: f64,
    /// The most a tenant may take at once.
    burst: f64,
    /// A std Mutex: nothing awaits while it is held.
    buckets: Mutex<HashMap<String, Bucket>>,
}

#[derive(Debug, Clone, Copy)]
struct Bucket {
    tokens: f64,
    /// Milliseconds since the epoch when `tokens` was right.
    at: i64,
}

impl Budgets {
    /// `rate_per_sec` new keys a second per tenant, at most `burst` at once.
    pub fn new(rate_per_sec: f64, burst: u32) -> Result<Budgets, String> {
        if !rate_per_sec.is_finite() || rate_per_sec <= 0.0 {
            return Err(format!(
                "the rate of new keys per tenant must be a positive number, not {rate_per_sec}"
            ));
        }
        if burst == 0 {
            return Err("the burst of new keys per tenant must be at least 1".into());
        }
        Ok(Budgets {
            rate_per_sec,
            burst: f64::from(burst),
            buckets: Mutex::default(),
        })
    }

    fn refilled(&self, bucket: Bucket, now: i64) -> Bucket {
        let elapsed_ms = now.saturating_sub(bucket.at).max(0);
        // Milliseconds fit an f64 exactly for any realistic interval.
        #[allow(clippy::cast_precision_loss)]
        let earned = elapsed_ms as f64 / 1000.0 * self.rate_per_sec;
        Bucket {
            tokens: (bucket.tokens + earned).min(self.burst),
            at: now.max(bucket.at),
        }
    }

    /// Takes one new key from `tenant`'s budget at `now` (milliseconds since
    /// the epoch); when it is spent, how many milliseconds until one is back.
    pub fn take(&self, tenant: &str, now: i64) -> Result<(), u64> {
        let mut buckets = self.buckets.lock().unwrap_or_else(|e| e.into_inner());
        if buckets.len() >= MAX_TRACKED && !buckets.contains_key(tenant) {
            buckets.retain(|_, b| self.refilled(*b, now).tokens < self.burst);
        }
        let full = Bucket {
            tokens: self.burst,
            at: now,
        };
        let bucket = buckets.entry(tenant.to_string()).or_insert(full);
        *bucket = self.refilled(*bucket, now);
        if bucket.tokens >= 1.0 {
            bucket.tokens -= 1.0;
            return Ok(());
        }
        let wait_ms = ((1.0 - bucket.tokens) / self.rate_per_sec * 1000.0).ceil();
        // At most 1000 / rate ms: far inside u64.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        Err((wait_ms as u64).max(1))
    }

    /// Gives back a key taken for a claim that did not take one.
    pub fn give_back(&self, tenant: &str) {
        let mut buckets = self.buckets.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(b) = buckets.get_mut(tenant) {
            b.tokens = (b.tokens + 1.0).min(self.burst);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T0: i64 = 1_800_000_000_000;

    #[test]
    fn a_tenant_takes_its_burst_then_waits_for_the_rate() {
        let b = Budgets::new(2.0, 3).unwrap();
        for _ in 0..3 {
            assert_eq!(b.take("acme", T0), Ok(()));
        }
        assert_eq!(b.take("acme", T0), Err(500));
        assert_eq!(b.take("acme", T0 + 200), Err(300));
        assert_eq!(b.take("acme", T0 + 500), Ok(()));
        assert_eq!(b.take("acme", T0 + 500), Err(500));
        // Another tenant has its own budget.
        assert_eq!(b.take("globex", T0 + 500), Ok(()));
        // Idle time refills up to the burst, never beyond.
        for _ in 0..3 {
            assert_eq!(b.take("acme", T0 + 60_000), Ok(()));
        }
        assert!(b.take("acme", T0 + 60_000).is_err());
    }

    #[test]
    fn a_key_given_back_can_be_taken_again() {
        let b = Budgets::new(0.1, 1).unwrap();
        assert_eq!(b.take("acme", T0), Ok(()));
        assert_eq!(b.take("acme", T0), Err(10_000));
        b.give_back("acme");
        assert_eq!(b.take("acme", T0), Ok(()));
        // Giving back never exceeds the burst.
        b.give_back("acme");
        b.give_back("acme");
        assert_eq!(b.take("acme", T0), Ok(()));
        assert!(b.take("acme", T0).is_err());
    }

    #[test]
    fn a_clock_going_back_earns_nothing() {
        let b = Budgets::new(1.0, 1).unwrap();
        assert_eq!(b.take("acme", T0), Ok(()));
        assert!(b.take("acme", T0 - 5_000).is_err());
    }

    #[test]
    fn nonsense_budgets_are_refused() {
        assert!(Budgets::new(0.0, 1).is_err());
        assert!(Budgets::new(-1.0, 1).is_err());
        assert!(Budgets::new(f64::NAN, 1).is_err());
        assert!(Budgets::new(1.0, 0).is_err());
    }
}
