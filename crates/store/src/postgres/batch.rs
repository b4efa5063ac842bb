//! The calls of one `/v1/batch` on one connection: every claim's and
//! completion's statement is sent at once, pipelined (tokio-postgres sends
//! queries that are awaited together without waiting for each answer), so
//! the batch costs about one round trip instead of one per call. The claims
//! of new keys go first as one set-based statement ([`CLAIM_NEW`]): one
//! transaction, so one commit for all of them instead of one each; it
//! answers every claim whose key was absent (Owned), and every other claim
//! (its key there, the same key earlier in the batch, or the statement
//! failed) is sent next, each its own [`CLAIM`] as when the batch held no
//! new keys. The completions go the same way: all of them in one
//! [`COMPLETE`], then each one it did not answer (the same key earlier in
//! the batch, or the statement failed) on its own. Every other statement
//! is its own transaction, so one call's failure never fails or undoes
//! another's beyond its set's, whose calls are then sent one by one. What
//! needs more than one statement (a claim that takes over or turns an
//! existing record unknown, a claim that lost a race, the locked release,
//! mark-unknown and abandon), and a claim past its caller's deadline, then
//! goes the way it goes when sent alone, each on its own connection.

use std::collections::{HashMap, HashSet};
use std::time::Instant;

use futures_util::future::{join3, join_all};
use idemgate_core::protocol::{ClaimReply, ClaimRequest, CompleteRequest};
use idemgate_core::scope::Scope;

use super::claim::past;
use super::operations::COMPLETE;
use super::pool::On;
use super::rows::{CLAIM, CLAIM_NEW};
use super::Postgres;
use crate::backend::{Answer, Backend, Call, ClaimOutcome, Outage, Result, StoreError};
use crate::row_mapping::ScopeDigest;

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
        // A claim whose caller gave up meanwhile is not sent to a statement
        // that inserts: it goes on alone, which answers it from the record
        // as committed, or refuses it if its effect writes.
        together.retain(|(i, _)| match &calls[*i] {
            Call::Claim { deadline, .. } => !past(*deadline),
            _ => false,
        });
        let waits = claim_new.is_some();
        let (client, claim, complete) = (&client, &claim, &complete);
        // The completions, each key once: together if two or more.
        let completions = distinct_keys(calls, |call| match call {
            Call::Complete { req, body } => Some((&req.scope, (req, body.as_ref()))),
            _ => None,
        });
        let alone = match completions.as_slice() {
            [(i, _)] => Some(*i),
            _ => None,
        };
        // First round: the set-based statements, sent first, and every
        // statement that does not wait for their answers. `None`: a claim,
        // which waits for the set-based claim (then meets the records it
        // inserted), or a completion the set-based one answers or that
        // follows one of the same key.
        let first = calls.iter().enumerate().map(|(i, call)| async move {
            match call {
                Call::Claim { .. } if waits => None,
                Call::Claim { req, deadline } => {
                    Some(self.claim_alone(client, claim, req, now, *deadline).await)
                }
                Call::Complete { req, body } if alone == Some(i) => Some(Some(
                    self.complete_one(client, complete, req, body, now)
                        .await
                        .map(Answer::Fence),
                )),
                Call::Complete { .. } => None,
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
                    HashMap::new()
                }
            }
        };
        let completed = async {
            if completions.len() < 2 {
                return HashMap::new();
            }
            let list: Vec<(&CompleteRequest, &[u8])> = completions.iter().map(|(_, c)| *c).collect();
            match self.complete_all(client, complete, &list, now).await {
                Ok(replies) => completions.iter().map(|(i, _)| *i).zip(replies).collect(),
                Err(e) => {
                    tracing::warn!("postgres: a batch's completions go one by one: {e}");
                    HashMap::new()
                }
            }
        };
        let (owned, completed, first) = join3(new_keys, completed, join_all(first)).await;
        // Second round: the claims and completions the set-based statements
        // did not answer, each the way it goes alone.
        let (owned, completed) = (&owned, &completed);
        let second = calls
            .iter()
            .zip(first)
            .enumerate()
            .map(|(i, (call, settled))| async move {
                if let Some(answer) = settled {
                    return answer;
                }
                match call {
                    Call::Claim { req, deadline } => match owned.get(&i) {
                        Some(&fence) => Some(Ok(Answer::Claim(ClaimOutcome::answer(ClaimReply::Owned {
                            fence,
                        })))),
                        None => self.claim_alone(client, claim, req, now, *deadline).await,
                    },
                    Call::Complete { req, body } => {
                        let reply = match completed.get(&i) {
                            Some(&reply) => Ok(reply),
                            None => self.complete_one(client, complete, req, body, now).await,
                        };
                        Some(reply.map(Answer::Fence))
                    }
                    Call::Release(_) | Call::MarkUnknown(_) | Call::Abandon(_) => None,
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
/// each key only once (a second claim of the same key goes alone, after
/// the first has been decided, and meets its record).
fn new_key_claims(calls: &[Call]) -> Vec<(usize, &ClaimRequest)> {
    distinct_keys(calls, |call| match call {
        Call::Claim { req, .. } => Some((&req.scope, req)),
        _ => None,
    })
}

/// What `pick` takes of `calls`, with its index, each key only once.
fn distinct_keys<'c, T>(
    calls: &'c [Call],
    pick: impl Fn(&'c Call) -> Option<(&'c Scope, T)>,
) -> Vec<(usize, T)> {
    let mut seen = HashSet::new();
    calls
        .iter()
        .enumerate()
        .filter_map(|(i, call)| {
            let (scope, taken) = pick(call)?;
            seen.insert(ScopeDigest::of(scope)).then_some((i, taken))
        })
        .collect()
}
