//! Replay counts, applied off the request path.
//!
//! `replay_count` is audit metadata ("why was this charged twice?"), not part
//! of any answer. A replay is served from a committed row and must not wait
//! for a durable write of its own: with `synchronous=FULL` that would be an
//! fsync per retry, and on PostgreSQL a second round trip. So a replay only
//! adds itself to this in-memory tally, and the backend applies the pending
//! counts in one batch shortly after, off the request path (SQLite: one job
//! queued to the writer; PostgreSQL: one statement on a spawned task).
//!
//! The price, accepted on purpose: increments not yet applied when the process
//! dies (crash, kill, or exit right after a replay) are lost, so a record may
//! show a few replays fewer than were served. Replays themselves are never
//! affected. Admin lookups in the same process apply the pending counts first,
//! so operators see every replay served so far; other processes (the CLI, other
//! replicas) see them once the batch is applied, normally within milliseconds.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::row_mapping::ScopeDigest;

/// A record's primary key and the fence of the completed record that was
/// replayed. The fence keeps a late increment from landing on a newer record
/// under the same key.
pub(crate) type ReplayKey = (ScopeDigest, u64);

#[derive(Default)]
pub(crate) struct ReplayTally {
    inner: Mutex<Pending>,
}

#[derive(Default)]
struct Pending {
    counts: HashMap<ReplayKey, u64>,
    /// A flush has been asked for since the last `take`.
    scheduled: bool,
}

impl ReplayTally {
    /// Counts one replay. True when the caller must schedule a flush: while
    /// one is pending, further replays only add to its batch.
    pub(crate) fn add(&self, key: ScopeDigest, fence: u64) -> bool {
        let mut p = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        *p.counts.entry((key, fence)).or_insert(0) += 1;
        !std::mem::replace(&mut p.scheduled, true)
    }

    /// Takes every pending count; the next `add` asks for a new flush.
    pub(crate) fn take(&self) -> Vec<(ReplayKey, u64)> {
        let mut p = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        p.scheduled = false;
        p.counts.drain().collect()
    }
}

/// The flush a replay asked for, until it takes the counts. Dropped without
/// taking them (its job never ran), it lets the next replay ask again: the
/// counts would otherwise wait for an operator's lookup.
pub(crate) struct AskedFlush {
    tally: Arc<ReplayTally>,
    taken: bool,
}

impl AskedFlush {
    pub(crate) fn new(tally: Arc<ReplayTally>) -> AskedFlush {
        AskedFlush { tally, taken: false }
    }

    /// [`ReplayTally::take`], by the flush that was asked for.
    pub(crate) fn take(mut self) -> Vec<(ReplayKey, u64)> {
        self.taken = true;
        self.tally.take()
    }
}

impl Drop for AskedFlush {
    fn drop(&mut self) {
        if !self.taken {
            let mut p = self.tally.inner.lock().unwrap_or_else(|e| e.into_inner());
            p.scheduled = false;
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn key(k: &str) -> ScopeDigest {
        ScopeDigest(idemgate_core::scope::digest_parts(["v1", "t", "p", "r", "u", k]))
    }

    #[test]
    fn replays_of_one_record_collapse_and_one_flush_is_asked_for_per_batch() {
        let t = ReplayTally::default();
        assert!(t.add(key("a"), 7));
        assert!(!t.add(key("a"), 7));
        assert!(!t.add(key("b"), 7));
        assert!(!t.add(key("a"), 8));
        let mut batch = t.take();
        batch.sort();
        assert_eq!(
            batch,
            vec![((key("a"), 7), 2), ((key("a"), 8), 1), ((key("b"), 7), 1)]
        );
        assert!(t.take().is_empty());
        assert!(t.add(key("a"), 7), "after a take the next replay asks again");
    }

    #[test]
    fn a_flush_that_never_ran_lets_the_next_replay_ask_again() {
        let t = Arc::new(ReplayTally::default());
        assert!(t.add(key("a"), 7));
        let asked = AskedFlush::new(Arc::clone(&t));
        assert!(!t.add(key("a"), 7), "a flush is on its way");
        drop(asked);
        assert!(
            t.add(key("b"), 7),
            "the flush never ran: the next replay asks again"
        );
        let asked = AskedFlush::new(Arc::clone(&t));
        assert_eq!(asked.take().len(), 2, "and it finds every count");
        assert!(t.add(key("a"), 7));
    }
}
