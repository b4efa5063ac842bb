//! Every operation on one key: load the record, decide its effect
//! ([`crate::effects`]), carry it out. A claim is decided by
//! [`effects::claim`]; the fence calls, abandon, the operators' changes and
//! the sweeper by theirs,
//! whose [`Write`]s [`carry_out`] makes true, as `sqlite::operations` and
//! `postgres::operations` do.

use std::sync::Arc;
use std::time::Instant;

use idemgate_core::protocol::{ClaimReply, ClaimRequest};
use idemgate_core::record::State;

use super::tables::{Journal, Tables};
use crate::backend::{ClaimOutcome, Peeked, Result, StoreError};
use crate::effects::{self, ClaimEffect, Effect, Fence, Write};
use crate::row_mapping::{encode_headers, LoadedRecord, ScopeDigest};
use crate::sealing::Seal;

/// Carries out `effect` on the record of `key` and returns its reply. The
/// tables are the caller's alone while it runs, so the record is as the
/// effect read it; a write's `durable` asks nothing of memory, which keeps
/// nothing across a restart, but is counted ([`Tables::commit`]).
pub(super) fn carry_out<R>(
    t: &mut Tables,
    journal: &mut Journal,
    key: &ScopeDigest,
    effect: Effect<'_, R>,
    now: i64,
) -> R {
    if !effect.writes.is_empty() {
        let lazy = effect
            .writes
            .iter()
            .any(|w| matches!(w, Write::Complete { durable: false, .. }));
        t.commit(!lazy);
    }
    for write in effect.writes {
        match write {
            Write::Event { by, note } => t.event(key, by, note, now, journal),
            Write::EndGeneration { last, by, note } => t.end_generation(key, last, (by, note), now, journal),
            Write::SetUnknown {
                read_with,
                expires_at,
            } => t.set_unknown(key, read_with, expires_at),
            Write::Complete {
                response,
                fence,
                expires_at,
                durable: _,
            } => {
                let fence = match fence {
                    Fence::Held(f) => f,
                    Fence::New => t.next_fence(),
                };
                if let Some(current) = t.records.get_mut(key) {
                    let r = &mut current.row;
                    current.state = State::Completed;
                    r.fence = fence;
                    r.status = Some(response.status);
                    r.headers = Some(encode_headers(response.headers));
                    r.body = response.body.map(Arc::from);
                    r.body_stored = response.body_stored;
                    r.completed_at = Some(now);
                    r.expires_at = Some(expires_at);
                    r.lease_until = now;
                }
            }
            Write::Archive => {
                if let Some(current) = t.records.get_mut(key) {
                    current.row.archived_at = Some(now);
                    current.row.body = None;
                }
            }
            // An attempt abandoned again keeps when it was first remembered.
            Write::RememberAbandon { scope: _, attempt } => {
                t.abandoned.entry((*key, attempt.to_string())).or_insert(now);
            }
        }
    }
    effect.reply
}

/// Loads the record of `key`, decides its effect with `effect_of` and carries it out.
pub(super) fn load_and_carry_out<'a, R>(
    t: &mut Tables,
    journal: &mut Journal,
    key: &ScopeDigest,
    now: i64,
    effect_of: impl FnOnce(Option<&LoadedRecord>) -> Effect<'a, R>,
) -> R {
    let effect = effect_of(t.load(key).as_ref());
    carry_out(t, journal, key, effect, now)
}

/// Whether the caller of a claim has stopped waiting. The deadline is the
/// caller's own instant, on the runtime's monotonic clock (the service's):
/// the one clock the backend reads, and only for a caller that set a
/// deadline. A simulation that pauses the runtime's time moves it.
fn past(deadline: Option<Instant>) -> bool {
    deadline.is_some_and(|d| tokio::time::Instant::now().into_std() >= d)
}

/// A claim, decided and carried out at once. A claim past its caller's
/// deadline that would write is refused ([`StoreError::Late`]): it would
/// leave a record its filter is abandoning. One that only answers or
/// replays is answered.
pub(super) fn claim(
    t: &mut Tables,
    journal: &mut Journal,
    req: &ClaimRequest,
    now: i64,
    deadline: Option<Instant>,
) -> Result<ClaimOutcome> {
    let key = ScopeDigest::of(&req.scope);
    let loaded = t.load(&key);
    let effect = effects::claim(loaded.as_ref(), req, now);
    if effect.writes() && past(deadline) {
        return Err(StoreError::Late);
    }
    match effect {
        ClaimEffect::Answer(reply) => Ok(ClaimOutcome::answer(reply)),
        ClaimEffect::Replay { status, completed_at } => {
            replay(t, &key, loaded.as_ref(), (status, completed_at))
        }
        ClaimEffect::Take { replaced, by } => {
            if let Some(replaced) = replaced {
                t.event(&key, replaced.by, None, now, journal);
                t.keep_in_history(&key, replaced.ended, now);
            }
            t.commit(true);
            let fence = t.next_fence();
            t.start_generation(req, &key, fence, now);
            t.event(&key, by, None, now, journal);
            Ok(ClaimOutcome::answer(ClaimReply::Owned { fence }))
        }
        ClaimEffect::Change(change) => Ok(carry_out(t, journal, &key, change, now)),
    }
}

/// [`crate::backend::Backend::peek`]: the claim's effect, carried out only
/// when it answers or replays (whose count is kept, as on every backend).
pub(super) fn peek(t: &mut Tables, req: &ClaimRequest, now: i64) -> Result<Peeked> {
    let key = ScopeDigest::of(&req.scope);
    let loaded = t.load(&key);
    match effects::claim(loaded.as_ref(), req, now) {
        ClaimEffect::Answer(reply) => Ok(Peeked::Answered(ClaimOutcome::answer(reply))),
        ClaimEffect::Replay { status, completed_at } => {
            replay(t, &key, loaded.as_ref(), (status, completed_at)).map(Peeked::Answered)
        }
        ClaimEffect::Take { .. } => Ok(Peeked::Takes),
        ClaimEffect::Change(_) => Ok(Peeked::Changes),
    }
}

/// Serves the stored response of the record of `key` and counts the replay.
fn replay(
    t: &mut Tables,
    key: &ScopeDigest,
    loaded: Option<&LoadedRecord>,
    (status, completed_at): (u16, i64),
) -> Result<ClaimOutcome> {
    t.count_replay(key);
    let body = t
        .records
        .get(key)
        .and_then(|c| c.row.body.as_deref().map(<[u8]>::to_vec))
        .unwrap_or_default();
    match loaded {
        // Read through the same mapping as a stored row, unsealed.
        Some(l) => l.replay(&Seal::off(), key, (status, completed_at), body),
        None => Ok(ClaimOutcome::replay(status, None, completed_at, body)),
    }
}
