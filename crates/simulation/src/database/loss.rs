//! What the database may lose of what it committed, as the contract allows
//! (`docs/contract.md`, §5 "A completion the store did not wait for may be
//! lost with the database" and "A restore from a backup loses everything
//! after the backup"), played on the in-memory backend: the database keeps
//! its tables as each commit left them, over the longest window a loss
//! reaches back, and puts back the ones the loss returns to.

use std::collections::{BTreeSet, VecDeque};
use std::time::Duration;

use idemgate_core::record::Transition;
use idemgate_store::backend::{EventInfo, KeyHistory, RecordInfo};
use idemgate_store::memory::{Memory, Snapshot};
use tokio::time::Instant;

/// How the database loses what it committed, when the store restarts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Loss {
    /// The server crashes or fails over: the completions it committed
    /// without waiting for durability (`on_unknown: conflict`) and had not
    /// yet flushed are gone. A commit is flushed by any durable commit
    /// after it (the log is written in order) and by the log writer within
    /// [`FLUSHED_WITHIN_MS`].
    Unflushed,
    /// A failover to an asynchronous standby this many milliseconds behind
    /// the primary: everything committed within them is gone, claims too.
    Standby(i64),
    /// A restore from a backup taken this many milliseconds before:
    /// everything committed since is gone.
    Backup(i64),
}

/// PostgreSQL's log writer flushes a lazy commit within about three times
/// `wal_writer_delay` (200 ms by default).
pub const FLUSHED_WITHIN_MS: i64 = 600;
/// The longest any loss reaches back: a backup's age at most.
pub const HORIZON_MS: i64 = 5_000;

/// What a loss took: each key's history just before and just after it.
#[derive(Debug, Clone)]
pub struct Lost {
    pub loss: Loss,
    /// The world's time of the loss (the store restarted with it).
    pub at: i64,
    /// How many of the store's confirmations it had given by then.
    pub confirmed: usize,
    pub keys: Vec<(String, KeyHistory, KeyHistory)>,
    /// The abandons the database had remembered that the loss took (an
    /// abandon that ends no generation leaves no event): each key and
    /// attempt.
    pub abandons: Vec<(String, String)>,
}

impl Lost {
    fn of<'a>(&'a self, key: &str) -> Option<(&'a KeyHistory, &'a KeyHistory)> {
        self.keys
            .iter()
            .find(|(k, _, _)| k == key)
            .map(|(_, before, after)| (before, after))
    }

    /// The generations of `key` that are gone: their claims were lost.
    pub fn claims(&self, key: &str) -> Vec<&RecordInfo> {
        let Some((before, after)) = self.of(key) else {
            return Vec::new();
        };
        before
            .records
            .iter()
            .filter(|g| {
                !after
                    .records
                    .iter()
                    .any(|a| a.generation == g.generation && a.attempt == g.attempt)
            })
            .collect()
    }

    /// The events of `key` that are gone (the loss puts back an earlier
    /// state, so they are the last ones it had).
    pub fn events(&self, key: &str) -> &[EventInfo] {
        match self.of(key) {
            Some((before, after)) => before.events.get(after.events.len()..).unwrap_or_default(),
            None => &[],
        }
    }

    /// Whether `attempt`'s claim of `key` was lost.
    pub fn claim_of(&self, key: &str, attempt: &str) -> bool {
        self.claims(key)
            .iter()
            .any(|g| g.attempt.as_deref() == Some(attempt))
    }

    /// Whether `attempt`'s abandon of `key` was lost.
    pub fn abandon_of(&self, key: &str, attempt: &str) -> bool {
        self.abandons.iter().any(|(k, a)| k == key && a == attempt)
    }

    /// Whether a transition of `attempt`'s generation of `key` after its
    /// claim was lost (its claim was kept).
    pub fn transition_of(&self, key: &str, attempt: &str) -> bool {
        self.events(key)
            .iter()
            .any(|e| e.attempt.as_deref() == Some(attempt) && e.transition != Transition::Claimed)
    }
}

/// The tables as each commit within the horizon left them, oldest first:
/// when, whether durable (it flushed all before it), and the tables. The
/// first is the state the horizon begins with.
pub(super) struct Kept {
    /// Until the store restarts: a scenario's one loss comes with it.
    on: bool,
    after: VecDeque<(Option<Instant>, bool, u64, Snapshot)>,
    commits: (u64, u64),
    /// Every key a claim named, to read back what a loss took.
    pub(super) keys: BTreeSet<String>,
    /// Each abandon that committed: the commit's number, its key and attempt.
    pub(super) abandons: Vec<(u64, String, String)>,
}

impl Kept {
    pub(super) fn new(memory: &Memory) -> Kept {
        Kept {
            on: true,
            after: VecDeque::from([(None, true, memory.commits().0, memory.snapshot())]),
            commits: memory.commits(),
            keys: BTreeSet::new(),
            abandons: Vec::new(),
        }
    }

    /// Keeps the tables if `memory` committed since it was last looked at;
    /// `abandon`, the key and attempt of the abandon it was asked for.
    pub(super) fn note(&mut self, memory: &Memory, abandon: Option<(String, String)>) {
        let commits = memory.commits();
        if !self.on || commits == self.commits {
            return;
        }
        if let Some((key, attempt)) = abandon {
            self.abandons.push((commits.0, key, attempt));
        }
        let durable = commits.1 > self.commits.1;
        self.commits = commits;
        let now = Instant::now();
        self.after
            .push_back((Some(now), durable, commits.0, memory.snapshot()));
        let horizon = Duration::from_millis(HORIZON_MS.unsigned_abs());
        while self
            .after
            .get(1)
            .and_then(|a| a.0)
            .is_some_and(|t| t + horizon <= now)
        {
            self.after.pop_front();
        }
    }

    /// The tables `loss` goes back to now, unless it takes nothing, and
    /// the abandons it takes; nothing is kept from here on.
    pub(super) fn back(&mut self, loss: Option<Loss>) -> Option<(Snapshot, Vec<(String, String)>)> {
        self.on = false;
        let after = std::mem::take(&mut self.after);
        let now = Instant::now();
        let loss = loss?;
        let older = |t: &Option<Instant>, ms: i64| {
            t.is_none_or(|t| t + Duration::from_millis(ms.unsigned_abs()) <= now)
        };
        let back = after.iter().rposition(|(t, durable, _, _)| match loss {
            Loss::Unflushed => *durable || older(t, FLUSHED_WITHIN_MS),
            Loss::Standby(ms) | Loss::Backup(ms) => older(t, ms),
        })?;
        let last = after.len() - 1;
        let (_, _, commit, snapshot) = after.into_iter().nth(back).filter(|_| back < last)?;
        let abandons = std::mem::take(&mut self.abandons)
            .into_iter()
            .filter(|(at, _, _)| *at > commit)
            .map(|(_, key, attempt)| (key, attempt))
            .collect();
        Some((snapshot, abandons))
    }
}
