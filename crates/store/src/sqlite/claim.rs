//! A claim: decided on a reader when it only answers or replays, carried out
//! on the writer when it changes something.

use std::sync::Arc;
use std::time::Instant;

use idemgate_core::protocol::{ClaimReply, ClaimRequest};
use idemgate_core::record::{self, ClaimDecision, Transition};
use rusqlite::Connection;

use super::generation::{event, insert_generation, next_fence, set_unknown, to_history, Journal};
use super::rows::load_with;
use super::Sqlite;
use crate::backend::{actor, ClaimOutcome, Result, StoreError};
use crate::columns::KeyColumns;

/// What a reader's look at a claim's record found.
enum Probe {
    /// An answer that changes nothing.
    Answer(ClaimReply),
    /// A replay of the completed record with this fence.
    Replay(ClaimOutcome, u64),
    /// No record: the writer inserts one unless another claim got there first.
    Absent,
    /// A record the writer must change (take over, turn unknown): it loads
    /// and decides again, since the record may have changed since.
    Write,
}

impl Sqlite {
    pub(super) async fn claim_record(
        &self,
        req: &ClaimRequest,
        now: i64,
        deadline: Option<Instant>,
    ) -> Result<ClaimOutcome> {
        // Answers and replays change nothing the caller waits for: they are
        // decided on a reader, in parallel, from the last committed state.
        // One copy of the request, shared by the reader's and the writer's job.
        let req = Arc::new(req.clone());
        let shared = Arc::clone(&req);
        let probe = self
            .engine
            .read(move |conn| {
                let probe = &*shared;
                load_with(conn, &KeyColumns::of(&probe.scope), |loaded, body| {
                    let Some(loaded) = loaded else {
                        return Ok(Probe::Absent);
                    };
                    Ok(match record::decide_claim(Some(&loaded.view), probe, now) {
                        ClaimDecision::Answer(reply) => Probe::Answer(reply),
                        ClaimDecision::Replay { status, completed_at } => {
                            let outcome = ClaimOutcome::replay(status, loaded.headers, completed_at, body()?);
                            Probe::Replay(outcome, loaded.view.fence)
                        }
                        ClaimDecision::Claim | ClaimDecision::BecomeUnknown => Probe::Write,
                    })
                })
            })
            .await?;
        let absent = match probe {
            Probe::Answer(reply) => return Ok(ClaimOutcome::answer(reply)),
            Probe::Replay(outcome, fence) => {
                self.count_replay(KeyColumns::of(&req.scope).owned(), fence);
                return Ok(outcome);
            }
            Probe::Absent => true,
            Probe::Write => false,
        };
        self.write_logged(move |conn, journal| {
            // Nobody waits for this claim any more: committing it would only
            // leave a record that its filter is abandoning.
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(StoreError::Late);
            }
            if absent {
                if let Some(fence) = claim_absent(conn, &req, now, journal)? {
                    return Ok(ClaimOutcome::answer(ClaimReply::Owned { fence }));
                }
            }
            claim_on_writer(conn, &req, now, journal)
        })
        .await
    }
}

/// A new key's claim, on the writer, when a reader saw no record: one insert
/// that does nothing if a record appeared since, which is exactly when
/// `decide_claim` would no longer say `Claim` unconditionally. `None` sends
/// the claim through [`claim_on_writer`]; the fence it took then goes unused,
/// which is harmless: fences only need to grow.
fn claim_absent(
    conn: &Connection,
    req: &ClaimRequest,
    now: i64,
    journal: &mut Journal,
) -> Result<Option<u64>> {
    let key = KeyColumns::of(&req.scope);
    let fence = next_fence(conn)?;
    if !insert_generation(conn, req, &key, fence, now, false)? {
        return Ok(None);
    }
    event(
        conn,
        &key,
        (Transition::Claimed, actor::FILTER, None),
        now,
        journal,
    )?;
    Ok(Some(fence))
}

/// Read, decide with the shared rules, write: only ever called on the writer.
fn claim_on_writer(
    conn: &Connection,
    req: &ClaimRequest,
    now: i64,
    journal: &mut Journal,
) -> Result<ClaimOutcome> {
    let key = KeyColumns::of(&req.scope);
    let (loaded, decision, body) = load_with(conn, &key, |loaded, body| {
        let decision = record::decide_claim(loaded.as_ref().map(|l| &l.view), req, now);
        let body = match decision {
            ClaimDecision::Replay { .. } => body()?,
            _ => Vec::new(),
        };
        Ok((loaded, decision, body))
    })?;
    match decision {
        ClaimDecision::Answer(reply) => Ok(ClaimOutcome::answer(reply)),
        ClaimDecision::Claim => {
            // The generation it replaces keeps its row in the history.
            let transition = match &loaded {
                Some(old) => {
                    let ended = record::ended_as(old.view.state, Transition::Reclaimed);
                    to_history(conn, &key, ended, now)?;
                    Transition::Reclaimed
                }
                None => Transition::Claimed,
            };
            let fence = next_fence(conn)?;
            insert_generation(conn, req, &key, fence, now, true)?;
            event(conn, &key, (transition, actor::FILTER, None), now, journal)?;
            Ok(ClaimOutcome::answer(ClaimReply::Owned { fence }))
        }
        ClaimDecision::Replay { status, completed_at } => {
            let sql = concat!(
                "UPDATE idempotency_records SET replay_count = replay_count + 1 WHERE ",
                key_where!()
            );
            super::generation::execute(conn, sql, &key, &[])?;
            let headers = loaded.and_then(|l| l.headers);
            Ok(ClaimOutcome::replay(status, headers, completed_at, body))
        }
        ClaimDecision::BecomeUnknown => {
            let ttl_ms = loaded.map(|l| l.ttl_ms).unwrap_or(0);
            set_unknown(conn, &key, record::unknown_expiry(now, ttl_ms))?;
            let by = (Transition::LeaseExpired, actor::FILTER, Some("unknown"));
            event(conn, &key, by, now, journal)?;
            Ok(ClaimOutcome {
                reply: ClaimReply::Unknown,
                body: Vec::new(),
                became_unknown: true,
            })
        }
    }
}
