//! A claim: decided on a reader when it only answers or replays, carried out
//! on the writer when it changes something. The reader queues that write
//! itself ([`probe`]), so the claim goes from the reader straight to the
//! writer without a trip back to the async runtime in between.

use std::sync::Arc;
use std::time::{Duration, Instant};

use idemgate_core::protocol::{ClaimReply, ClaimRequest};
use rusqlite::Connection;

use super::engine::{Durability, Engine, Job, Pending, Writer};
use super::generation::{apply_replays, event, insert_generation, to_history, Journal};
use super::operations::carry_out;
use super::rows::load_with;
use super::Logged;
use crate::backend::{Answer, ClaimOutcome, Peeked, Result, StoreError};
use crate::effects::{self, ClaimEffect};
use crate::replay_counts::{AskedFlush, ReplayTally};
use crate::row_mapping::ScopeDigest;
use crate::sealing::Seal;

/// What a reader's look at a claim's record found.
pub(super) enum Probed {
    /// Answered or replayed from the last committed state; nothing to write.
    Decided(ClaimOutcome),
    /// Queued to the writer (by the caller, with the batch's other writes).
    Write(Job, Pending<Logged>),
}

/// Looks at the claim's record on a reader connection. Answers and replays
/// change nothing the caller waits for: they are decided here, in parallel,
/// from the last committed state. A claim that must write becomes a writer
/// job: a new key inserts (unless another claim got there first), an existing
/// record is loaded and decided again on the writer, since it may have
/// changed since.
pub(super) fn probe(
    conn: &Connection,
    (engine, replays, seal): (&Engine, &Arc<ReplayTally>, &Seal),
    req: ClaimRequest,
    deadline: Option<Instant>,
    now: i64,
) -> Result<Probed> {
    let key = ScopeDigest::of(&req.scope);
    let seen = load_with(conn, &key, |loaded, body| {
        let Some(loaded) = loaded else {
            return Ok(Seen::Absent);
        };
        Ok(match effects::claim(Some(&loaded), &req, now) {
            ClaimEffect::Answer(reply) => Seen::Decided(ClaimOutcome::answer(reply)),
            ClaimEffect::Replay { status, completed_at } => {
                let outcome = loaded.replay(seal, &key, (status, completed_at), body()?)?;
                count_replay(engine, replays, key, loaded.view.fence);
                Seen::Decided(outcome)
            }
            ClaimEffect::Take { .. } | ClaimEffect::Change(_) => Seen::Changes,
        })
    })?;
    let absent = match seen {
        Seen::Decided(outcome) => return Ok(Probed::Decided(outcome)),
        Seen::Absent => true,
        Seen::Changes => false,
    };
    let (job, pending) = write_job(req, seal.clone(), deadline, now, absent);
    Ok(Probed::Write(job, pending))
}

/// [`crate::backend::Backend::peek`] on a reader: the last committed
/// state, decided by the same rules; nothing is written but a replay's count.
pub(super) fn peek(
    conn: &Connection,
    (engine, replays, seal): (&Engine, &Arc<ReplayTally>, &Seal),
    req: &ClaimRequest,
    now: i64,
) -> Result<Peeked> {
    let key = ScopeDigest::of(&req.scope);
    load_with(conn, &key, |loaded, body| {
        let Some(loaded) = loaded else {
            return Ok(Peeked::Takes);
        };
        match effects::claim(Some(&loaded), req, now) {
            ClaimEffect::Answer(reply) => Ok(Peeked::Answered(ClaimOutcome::answer(reply))),
            ClaimEffect::Replay { status, completed_at } => {
                let outcome = loaded.replay(seal, &key, (status, completed_at), body()?)?;
                count_replay(engine, replays, key, loaded.view.fence);
                Ok(Peeked::Answered(outcome))
            }
            ClaimEffect::Take { .. } => Ok(Peeked::Takes),
            ClaimEffect::Change(_) => Ok(Peeked::Changes),
        }
    })
}

/// What the reader saw.
enum Seen {
    Decided(ClaimOutcome),
    /// No record: the writer inserts one unless another claim got there first.
    Absent,
    /// A record the claim changes (takes over, turns unknown).
    Changes,
}

/// How long replay counts gather before they are applied. Their commit needs
/// no fsync, so without a pause the writer would commit a handful of counts
/// at a time, as fast as it can, and take a core from the readers serving
/// the replays.
const REPLAY_FLUSH_DELAY: Duration = Duration::from_millis(25);

/// Counts a replay served from a reader. The first replay since the last
/// flush queues, a moment later, one job that applies every pending count
/// with the writer's next batch; nobody waits for it, and it needs no fsync
/// of its own.
fn count_replay(engine: &Engine, replays: &Arc<ReplayTally>, key: ScopeDigest, fence: u64) {
    if !replays.add(key, fence) {
        return;
    }
    let (engine, asked) = (engine.clone(), AskedFlush::new(Arc::clone(replays)));
    let flush = move || {
        engine.write_detached("replay counts", Durability::Relaxed, move |w| {
            apply_replays(w, asked.take())
        })
    };
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) => drop(runtime.spawn(async move {
            tokio::time::sleep(REPLAY_FLUSH_DELAY).await;
            flush();
        })),
        Err(_) => flush(),
    }
}

/// The writer job of a claim; `absent` when a reader saw no record.
pub(super) fn write_job(
    req: ClaimRequest,
    seal: Seal,
    deadline: Option<Instant>,
    now: i64,
    absent: bool,
) -> (Job, Pending<Logged>) {
    Engine::job(Durability::Durable, move |w| {
        // Nobody waits for this claim any more: it is answered if its effect
        // writes nothing, and refused otherwise, since committing it would
        // only leave a record that its filter is abandoning.
        let late = deadline.is_some_and(|d| Instant::now() >= d);
        let mut journal = Journal::new();
        let key = ScopeDigest::of(&req.scope);
        if absent && !late {
            if let Some(fence) = claim_absent(w, &req, &key, now, &mut journal)? {
                let answer = Answer::Claim(ClaimOutcome::answer(ClaimReply::Owned { fence }));
                return Ok((answer, journal));
            }
        }
        let outcome = claim_on_writer(w, (&req, &seal), &key, (now, late), &mut journal)?;
        Ok((Answer::Claim(outcome), journal))
    })
}

/// A new key's claim, on the writer, when a reader saw no record: one insert
/// that does nothing if a record appeared since, which is exactly when
/// `decide_claim` would no longer say `Claim` unconditionally. `None` sends
/// the claim through [`claim_on_writer`]; the fence it took then goes unused,
/// which is harmless: fences only need to grow.
fn claim_absent(
    w: &Writer<'_>,
    req: &ClaimRequest,
    key: &ScopeDigest,
    now: i64,
    journal: &mut Journal,
) -> Result<Option<u64>> {
    // What a claim does to an absent record: a generation, `claimed`.
    let ClaimEffect::Take { by, .. } = effects::claim(None, req, now) else {
        return Ok(None);
    };
    let fence = w.next_fence()?;
    if !insert_generation(w, req, key, fence, now, false)? {
        return Ok(None);
    }
    event(w, key, by, now, journal)?;
    Ok(Some(fence))
}

/// Read, decide with the shared rules ([`effects::claim`]), carry it out:
/// only ever called on the writer. `late`: past its caller's deadline, an
/// effect that writes is refused.
fn claim_on_writer(
    w: &Writer<'_>,
    (req, seal): (&ClaimRequest, &Seal),
    key: &ScopeDigest,
    (now, late): (i64, bool),
    journal: &mut Journal,
) -> Result<ClaimOutcome> {
    let (loaded, effect, body) = load_with(w, key, |loaded, body| {
        let effect = effects::claim(loaded.as_ref(), req, now);
        let body = match effect {
            ClaimEffect::Replay { .. } => body()?,
            _ => Vec::new(),
        };
        Ok((loaded, effect, body))
    })?;
    if effect.writes() && late {
        return Err(StoreError::Late);
    }
    match effect {
        ClaimEffect::Answer(reply) => Ok(ClaimOutcome::answer(reply)),
        ClaimEffect::Take { replaced, by } => {
            if let Some(replaced) = replaced {
                event(w, key, replaced.by, now, journal)?;
                to_history(w, key, replaced.ended, now)?;
            }
            let fence = w.next_fence()?;
            insert_generation(w, req, key, fence, now, true)?;
            event(w, key, by, now, journal)?;
            Ok(ClaimOutcome::answer(ClaimReply::Owned { fence }))
        }
        ClaimEffect::Replay { status, completed_at } => {
            let sql = concat!(
                "UPDATE idempotency_records SET replay_count = replay_count + 1 WHERE ",
                key_where!()
            );
            super::generation::execute(w, sql, key, &[])?;
            match loaded {
                Some(l) => l.replay(seal, key, (status, completed_at), body),
                None => Ok(ClaimOutcome::replay(status, None, completed_at, body)),
            }
        }
        ClaimEffect::Change(change) => carry_out(w, journal, (key, seal), change, now),
    }
}
