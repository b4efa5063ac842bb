//! The calls of one `/v1/batch` on one connection: every claim's and
//! completion's statement is sent at once, pipelined (tokio-postgres sends
//! queries that are awaited together without waiting for each answer), so
//! the batch costs about one round trip instead of one per call. The claims
//! of new keys go first as one set-based statement ([`CLAIM_NEW`]): one
//! transaction, so one commit for all of them instead of one each; it
//! answers every claim whose key was absent (Owned), and every other claim
//! (its key there, the same key earlier in the batch, or the statement
//! failed) is sent next, each its own [`CLAIM`] as when the batch held no
//! new keys. Every other statement is its own transaction, so one call's
//! failure never fails or undoes another's. What needs more than one
//! statement (a claim that takes over or turns an existing record unknown,
//! a claim that lost a race, the locked release, mark-unknown and abandon)
//! then goes the way it goes when sent alone, each on its own connection.

use std::collections::HashSet;
use std::time::Instant;

use futures_util::future::{join, join_all};
use idemgate_core::protocol::{ClaimReply, ClaimRequest};

use super::operations::COMPLETE;
use super::pool::On;
use super::rows::{CLAIM, CLAIM_NEW};
use super::Postgres;
use crate::backend::{Answer, Backend, Call, ClaimOutcome, Outage, Result, StoreError};
use crate::columns::ScopeDigest;

impl Postgres {
    pub(super) async fn decide_batch(&self, calls: Vec<Call>, now: i64) -> Vec<Result<Answer>> {
        let one_statement = |c: &Call| matches!(c, Call::Claim { .. } | Call::Complete { .. });
        let pipelined = if calls.iter().filter(|c| one_statement(c)).count() > 1 {
            let limit = self.connections.timeouts.call();
            match tokio::time::timeout(limit, self.pipelined(&calls, now)).await {
                Ok(answers) => answers,
                Err(_) => calls
                    .iter()
                    .map(|_| {
                        Some(Err(StoreError::unavailable(
                            Outage::Timeout,
                            format!("postgres did not answer within {} ms", limit.as_millis()),
                        )))
                    })
                    .collect(),
            }
        } else {
            calls.iter().map(|_| None).collect()
        };
        let rest = calls.into_iter().zip(pipelined).map(|(call, done)| async move {
            match done {
                Some(answer) => answer,
                None => match call {
                    Call::Claim { req, deadline } => self.claim(&req, now, deadline).await.map(Answer::Claim),
                    Call::Complete { req, body } => self.complete(&req, &body, now).await.map(Answer::Fence),
                    Call::Release(req) => self.release(&req, now).await.map(Answer::Fence),
                    Call::MarkUnknown(req) => self.mark_unknown(&req, now).await.map(Answer::Fence),
                    Call::Abandon(req) => self.abandon(&req, now).await.map(Answer::Fence),
                },
            }
        });
        join_all(rest).await
    }

    /// The answers the pipelined statements settled; `None` for the calls
    /// that go on alone (all of them if the connection cannot be had).
    async fn pipelined(&self, calls: &[Call], now: i64) -> Vec<Option<Result<Answer>>> {
        let none = || calls.iter().map(|_| None).collect();
        let Ok(client) = self.connections.client().await else {
            return none();
        };
        let prepared = async {
            let claim = client.prepare(&CLAIM).await?;
            let complete = client.prepare(&COMPLETE).await?;
            Ok::<_, StoreError>((claim, complete))
        };
        let (claim, complete) = match prepared.await {
            Ok(prepared) => prepared,
            Err(e) => {
                tracing::warn!("postgres: a batch goes call by call: {e}");
                return none();
            }
        };
        // The claims that may be new keys, claimed together (if two or more).
        let mut together = new_key_claims(calls);
        let claim_new = if together.len() > 1 {
            match client.prepare(&CLAIM_NEW).await {
                Ok(stmt) => Some(stmt),
                Err(e) => {
                    tracing::warn!("postgres: a batch's claims go one by one: {e}");
                    together.clear();
                    None
                }
            }
        } else {
            together.clear();
            None
        };
        // A claim whose caller gave up meanwhile is not sent: it goes on
        // alone, which refuses it.
        let sent = Instant::now();
        together.retain(|(i, _)| match &calls[*i] {
            Call::Claim { deadline, .. } => !deadline.is_some_and(|d| sent >= d),
            _ => false,
        });
        let waits = claim_new.is_some();
        let (client, claim, complete) = (&client, &claim, &complete);
        // First round: the set-based claim, sent first, and with it every
        // statement that does not wait for its answer. `None`: a claim,
        // which waits for it (then meets the records it inserted).
        let first = calls.iter().map(|call| async move {
            match call {
                Call::Claim { .. } if waits => None,
                Call::Claim { req, deadline } => {
                    Some(self.claim_alone(client, claim, req, now, *deadline).await)
                }
                Call::Complete { req, body } => Some(Some(
                    self.complete_on(client, complete, req, body, now)
                        .await
                        .map(Answer::Fence),
                )),
                Call::Release(_) | Call::MarkUnknown(_) | Call::Abandon(_) => Some(None),
            }
        });
        let new_keys = async {
            let Some(stmt) = claim_new.as_ref().filter(|_| !together.is_empty()) else {
                return Default::default();
            };
            let reqs: Vec<&ClaimRequest> = together.iter().map(|(_, req)| *req).collect();
            match self.claim_new(client, stmt, &reqs, now).await {
                Ok(owned) => owned
                    .into_iter()
                    .map(|(k, fence)| (together[k].0, fence))
                    .collect(),
                Err(e) => {
                    tracing::warn!("postgres: a batch's new keys go one by one: {e}");
                    std::collections::HashMap::new()
                }
            }
        };
        let (owned, first) = join(new_keys, join_all(first)).await;
        // Second round: the claims the set-based statement did not answer,
        // each the way it goes when the batch holds no new keys.
        let owned = &owned;
        let second = calls
            .iter()
            .zip(first)
            .enumerate()
            .map(|(i, (call, settled))| async move {
                if let Some(answer) = settled {
                    return answer;
                }
                let Call::Claim { req, deadline } = call else {
                    return None;
                };
                match owned.get(&i) {
                    Some(&fence) => Some(Ok(Answer::Claim(ClaimOutcome::answer(ClaimReply::Owned {
                        fence,
                    })))),
                    None => self.claim_alone(client, claim, req, now, *deadline).await,
                }
            });
        join_all(second).await
    }

    /// [`Postgres::claim_pipelined`] as a batch's answer.
    async fn claim_alone(
        &self,
        client: &super::pool::Client,
        stmt: &super::pool::Stmt<'_>,
        req: &ClaimRequest,
        now: i64,
        deadline: Option<Instant>,
    ) -> Option<Result<Answer>> {
        self.claim_pipelined(client, stmt, req, now, deadline)
            .await
            .map(|out| out.map(Answer::Claim))
    }
}

/// The claims of `calls` that [`CLAIM_NEW`] may decide, with their index:
/// not past their caller's deadline (those are refused, not sent), and
/// each key only once (a second claim of the same key goes alone, after
/// the first has been decided, and meets its record).
fn new_key_claims(calls: &[Call]) -> Vec<(usize, &ClaimRequest)> {
    let now = Instant::now();
    let mut seen = HashSet::new();
    calls
        .iter()
        .enumerate()
        .filter_map(|(i, call)| match call {
            Call::Claim { req, deadline } if !deadline.is_some_and(|d| now >= d) => {
                seen.insert(ScopeDigest::of(&req.scope)).then_some((i, req))
            }
            _ => None,
        })
        .collect()
}
