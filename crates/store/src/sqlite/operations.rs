//! The fence calls, abandon and the operators' changes, each one job on the
//! writer: load the record, decide its effect ([`crate::effects`]), carry it out.
//!
//! A completion is queued as a relaxed job (no fsync of its own): if its
//! commit is lost on power loss, the record is still in progress under the
//! owner's lease, turns unknown when the lease runs out, and is never run
//! again. Unless the claim's policy releases unknown outcomes
//! (`on_unknown: release`): then a lost completion would free the key for a
//! second execution, so such a completion asks for a durable commit (the
//! effect's `durable`).

use idemgate_core::scope::Scope;

use super::engine::Writer;
use super::generation::{end_generation, execute, noted_event, set_unknown, Journal};
use super::rows::load;
use super::stored::StoredAttempt;
use crate::backend::Result;
use crate::effects::{Effect, Fence, Write};
use crate::row_mapping::{encode_headers, i64_from, LoadedRecord, ScopeDigest};
use crate::sealing::Seal;
use crate::shared_statements::{ARCHIVE_RECORD, COMPLETE_RECORD, REMEMBER_ABANDON};

/// Carries out `effect` on the record of `key`, in the writer's transaction,
/// and returns its reply.
pub(super) fn carry_out<R>(
    w: &Writer<'_>,
    journal: &mut Journal,
    (key, seal): (&ScopeDigest, &Seal),
    effect: Effect<'_, R>,
    now: i64,
) -> Result<R> {
    for write in effect.writes {
        match write {
            Write::Event { by, note } => noted_event(w, key, by, note, now, journal)?,
            Write::EndGeneration { last, by, note } => {
                end_generation(w, key, last, (by, note), now, journal)?
            }
            // No guard needed: the writer is the only one that changes
            // records, so the record is as this job read it.
            Write::SetUnknown { expires_at, .. } => set_unknown(w, key, expires_at)?,
            Write::Complete {
                response,
                fence,
                expires_at,
                durable,
            } => {
                if durable {
                    w.require_durable();
                }
                let fence = match fence {
                    Fence::Held(f) => f,
                    Fence::New => w.next_fence()?,
                };
                // Sealed under the fence the record holds from now on.
                let sealed = seal.seal(key, fence, encode_headers(response.headers), response.body)?;
                let params: [&dyn rusqlite::ToSql; 8] = [
                    &i64_from(fence),
                    &response.status,
                    &sealed.headers,
                    &sealed.body.as_deref(),
                    &response.body_stored,
                    &now,
                    &expires_at,
                    &sealed.key_id,
                ];
                execute(w, COMPLETE_RECORD.sqlite(), key, &params)?;
            }
            Write::Archive => {
                execute(w, ARCHIVE_RECORD.sqlite(), key, &[&now])?;
            }
            Write::RememberAbandon { scope, attempt } => {
                let [v, t, p, r, n, k] = scope.parts();
                let attempt = StoredAttempt(Some(&attempt));
                execute(
                    w,
                    REMEMBER_ABANDON.sqlite(),
                    key,
                    &[&v, &t, &p, &r, &n, &k, &attempt, &now],
                )?;
            }
        }
    }
    Ok(effect.reply)
}

/// Loads the record of `scope`, decides its effect with `effect_of` and
/// carries it out: every operation of this module's kind is this one job.
pub(super) fn load_and_carry_out<'a, R>(
    w: &Writer<'_>,
    journal: &mut Journal,
    (scope, seal): (&Scope, &Seal),
    now: i64,
    effect_of: impl FnOnce(Option<&LoadedRecord>) -> Effect<'a, R>,
) -> Result<R> {
    let key = ScopeDigest::of(scope);
    let effect = effect_of(load(w, &key)?.as_ref());
    carry_out(w, journal, (&key, seal), effect, now)
}
