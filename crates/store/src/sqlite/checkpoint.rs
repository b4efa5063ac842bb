//! The WAL's checkpoints, off the writer's commits. SQLite's own automatic
//! checkpoint runs inside the COMMIT that crosses its threshold and holds up
//! every caller of that batch; here a checkpointer thread copies the WAL into
//! the database as it grows, and the writer only finishes the job, after
//! answering its batch, so that the WAL starts over.

use std::cell::Cell;
use std::sync::{mpsc, Arc, Mutex};

use prometheus_client::metrics::counter::Counter;
use rusqlite::Connection;

use super::errors::unavailable;
use crate::backend::{Result, StoreError};

/// The writer nudges the checkpointer each time the WAL has grown by this
/// many frames (pages) since the last nudge, and only then does it copy:
/// a checkpoint syncs the WAL and the database file, two syncs beside the
/// commits' one per batch, so one per hundred batches or so (a claim
/// writes about nine frames), never one per batch as a timer would run
/// while claims trickle in. Measured against 256 (`profile.md` §11): a
/// quarter of the checkpoints, and 2–10% more claims a second...
const NUDGE_FRAMES: u64 = 1_024;

/// ...and past this many (16 MiB of 4 KiB pages), copies what is left
/// itself, so that its next transaction starts the WAL over.
pub(super) const RESTART_FRAMES: u64 = 4_000;

thread_local! {
    /// Frames in the WAL after the last commit of a writer on this thread
    /// (its WAL hook, which runs on the committing thread), until taken.
    static WAL_FRAMES: Cell<Option<u64>> = const { Cell::new(None) };
}

fn count_wal_frames(_: &rusqlite::hooks::Wal, frames: std::ffi::c_int) -> rusqlite::Result<()> {
    WAL_FRAMES.with(|f| f.set(Some(u64::try_from(frames).unwrap_or(0))));
    Ok(())
}

/// `PRAGMA wal_checkpoint(PASSIVE)`: copies what it can of the WAL into the
/// database without waiting for the writer or any reader.
fn checkpoint(conn: &Connection) -> rusqlite::Result<()> {
    conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(()))
}

/// `PRAGMA wal_checkpoint(RESTART)`, on the writer: waits (at most the busy
/// timeout) for the checkpointer and for readers on older snapshots, copies
/// the rest of the WAL, and makes the next transaction start it over.
/// Whether it did (false: something still held it). Not TRUNCATE: the WAL
/// keeps its size, so a commit overwrites blocks the file already has, and
/// its sync need not also record the file's growth.
fn restart(conn: &Connection) -> rusqlite::Result<bool> {
    conn.query_row("PRAGMA wal_checkpoint(RESTART)", [], |r| r.get::<_, i64>(0))
        .map(|busy| busy == 0)
}

/// Copies committed WAL frames into the database on its own thread, so that
/// nobody waits for the copy, each time the writer nudges it. Ends with the
/// writer. A WAL left short of a nudge when the writes stop stays as it is:
/// readers find its pages through the WAL's index, and SQLite copies it when
/// the last connection closes.
fn checkpointer_loop(
    conn: &Connection,
    (nudges, turn): (&mpsc::Receiver<()>, &Mutex<()>),
    checkpoints: &Counter,
) {
    while nudges.recv().is_ok() {
        // The writer's restart waits for this round, never the reverse.
        let Ok(_turn) = turn.lock() else { return };
        match checkpoint(conn) {
            Ok(()) => {
                checkpoints.inc();
            }
            Err(e) => tracing::warn!("sqlite: checkpoint: {e}"),
        }
    }
}

/// The writer's side of the checkpoints. The WAL only starts over once a
/// checkpoint has copied all of it, which one running beside a busy writer
/// never does: the checkpointer copies most of it, and past
/// [`RESTART_FRAMES`] the writer copies the rest, after its batch's callers
/// have their answers.
pub(super) struct Checkpoints {
    nudge: mpsc::SyncSender<()>,
    /// Frames in the WAL after the writer's last commit.
    frames: u64,
    nudged_at: u64,
    /// Held by whoever checkpoints: SQLite would answer a checkpoint that
    /// meets another with "busy" at once, and a restart that keeps missing
    /// the checkpointer's rounds lets the WAL grow without bound.
    turn: Arc<Mutex<()>>,
    /// Checkpoints run, by either side.
    checkpoints: Counter,
}

impl Checkpoints {
    /// Takes the checkpoints off `writer`'s commits and starts the
    /// checkpointer on its own connection; `checkpoints` counts the
    /// checkpoints either side runs.
    pub(super) fn start(
        writer: &Connection,
        checkpointer: Connection,
        checkpoints: Counter,
    ) -> Result<Checkpoints> {
        writer
            .execute_batch("PRAGMA wal_autocheckpoint=0")
            .map_err(unavailable)?;
        writer.wal_hook(Some(count_wal_frames));
        let (nudge, nudges) = mpsc::sync_channel(1);
        let turn = Arc::new(Mutex::new(()));
        let theirs = Arc::clone(&turn);
        let counted = checkpoints.clone();
        std::thread::Builder::new()
            .name("sqlite-checkpointer".into())
            .spawn(move || checkpointer_loop(&checkpointer, (&nudges, &theirs), &counted))
            .map_err(|e| StoreError::internal(format!("cannot start the sqlite checkpointer: {e}")))?;
        Ok(Checkpoints {
            nudge,
            frames: 0,
            nudged_at: 0,
            turn,
            checkpoints,
        })
    }

    /// After each commit of the writer, on the thread that committed, once
    /// its batch's callers have their answers. `may_wait`: this thread may
    /// wait for a restart (the writer thread); if not, and one is due, says
    /// so (true), to be done by one that may.
    pub(super) fn after_commit(&mut self, conn: &Connection, may_wait: bool) -> bool {
        if let Some(frames) = WAL_FRAMES.with(Cell::take) {
            self.frames = frames;
        }
        let frames = self.frames;
        if frames >= RESTART_FRAMES {
            if !may_wait {
                return true;
            }
            // Tried again after the next commit if it could not be done now.
            let Ok(_turn) = self.turn.lock() else { return false };
            let restarted = restart(conn);
            if restarted.is_ok() {
                self.checkpoints.inc();
            }
            match restarted {
                Ok(true) => {
                    self.frames = 0;
                    self.nudged_at = 0;
                }
                Ok(false) => {}
                Err(e) => tracing::warn!("sqlite: checkpoint: {e}"),
            }
        } else if frames >= self.nudged_at + NUDGE_FRAMES {
            // Full: a nudge is already waiting.
            let _ = self.nudge.try_send(());
            self.nudged_at = frames;
        } else if frames < self.nudged_at {
            // The WAL started over.
            self.nudged_at = 0;
        }
        false
    }
}

#[cfg(test)]
mod tests;
