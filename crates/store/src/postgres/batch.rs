//! The calls of one `/v1/batch` on one connection: every claim's and
//! completion's statement is sent at once, pipelined (tokio-postgres sends
//! queries that are awaited together without waiting for each answer), so
//! the batch costs about one round trip instead of one per call. Each
//! statement is its own transaction, so one call's failure never fails or
//! undoes another's. What needs more than one statement (a claim that takes
//! over or turns an existing record unknown, a claim that lost a race, the
//! locked release, mark-unknown and abandon) then goes the way it goes when
//! sent alone, each on its own connection.

use futures_util::future::join_all;

use super::operations::COMPLETE;
use super::pool::unavailable;
use super::rows::CLAIM;
use super::Postgres;
use crate::backend::{Answer, Backend, Call, Result, StoreError};

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
                        Some(Err(StoreError::Unavailable(format!(
                            "postgres did not answer within {} ms",
                            limit.as_millis()
                        ))))
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
            let claim = client.prepare_cached(&CLAIM).await?;
            let complete = client.prepare_cached(&COMPLETE).await?;
            Ok::<_, tokio_postgres::Error>((claim, complete))
        };
        let (claim, complete) = match prepared.await {
            Ok(prepared) => prepared,
            Err(e) => {
                tracing::warn!("postgres: a batch goes call by call: {}", unavailable(e));
                return none();
            }
        };
        let each = calls.iter().map(|call| {
            let (client, claim, complete) = (&client, &claim, &complete);
            async move {
                match call {
                    Call::Claim { req, deadline } => self
                        .claim_pipelined(client, claim, req, now, *deadline)
                        .await
                        .map(|out| out.map(Answer::Claim)),
                    Call::Complete { req, body } => Some(
                        self.complete_on(client, complete, req, body, now)
                            .await
                            .map(Answer::Fence),
                    ),
                    Call::Release(_) | Call::MarkUnknown(_) | Call::Abandon(_) => None,
                }
            }
        });
        join_all(each).await
    }
}
