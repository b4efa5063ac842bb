//! The writer's queue: groups of jobs in their order, and what only the
//! writer thread may do (a WAL restart, the sync of a batch committed where
//! nobody may wait).

use std::collections::VecDeque;

use super::{Deliver, Job};

/// The most jobs a batch takes, unless its first group alone is larger.
pub(super) const MAX_BATCH: usize = 256;

/// One call's jobs, or one `/v1/batch`'s: never split across transactions.
pub(super) struct Group {
    pub(super) jobs: Vec<Job>,
    /// A request's own writes, which a caller that finds the writer idle
    /// may run on its thread ([`super::Engine::submit`]). The others wait for the
    /// writer thread: writes no request waits for, which may be long (a
    /// sweep), and a batch that found another process's write lock.
    pub(super) here: bool,
}

/// What queuing a group found.
pub(super) enum Queued {
    /// The group was empty.
    Nothing,
    /// Queued behind work only the writer thread may do.
    BehindTheWritersOwn,
    /// Queued; a caller may run it if the writer is idle.
    Ready,
}

/// The writer's queue.
#[derive(Default)]
pub(super) struct Queue {
    pub(super) groups: VecDeque<Group>,
    /// A batch run where nobody may wait left the WAL's restart to the
    /// writer thread.
    pub(super) restart_due: bool,
    /// Answers of a batch committed where nobody may wait, held until the
    /// writer thread has made that commit durable (see [`super::writer`]).
    pub(super) sync_due: Vec<Deliver>,
    /// No more jobs are taken: the engine was dropped, or the writer broke.
    pub(super) stopped: bool,
}

impl Queue {
    /// Jobs waiting for a batch.
    pub(super) fn jobs(&self) -> usize {
        self.groups.iter().map(|g| g.jobs.len()).sum()
    }

    /// Whether the writer thread has anything to do.
    pub(super) fn has_work(&self) -> bool {
        !self.groups.is_empty() || self.restart_due || !self.sync_due.is_empty()
    }

    /// Whether the writer thread has work no caller's thread may do.
    pub(super) fn writer_thread_due(&self) -> bool {
        self.restart_due || !self.sync_due.is_empty() || self.groups.iter().any(|g| !g.here)
    }

    /// The next batch: whole groups in their order, up to [`MAX_BATCH`]
    /// jobs unless the first group alone is larger; with `here_only`, only
    /// the groups a caller may run on its thread.
    pub(super) fn next_batch(&mut self, here_only: bool) -> Vec<Job> {
        let mut batch: Vec<Job> = Vec::new();
        let mut i = 0;
        while let Some(group) = self.groups.get(i) {
            if here_only && !group.here {
                i += 1;
                continue;
            }
            if !batch.is_empty() && batch.len() + group.jobs.len() > MAX_BATCH {
                break;
            }
            if let Some(group) = self.groups.remove(i) {
                batch.extend(group.jobs);
            }
        }
        batch
    }
}
