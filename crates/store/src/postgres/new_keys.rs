//! The new keys of one `/v1/batch`, claimed by one set-based statement
//! ([`CLAIM_NEW`]): one transaction, so one commit (one WAL flush) for the
//! whole batch instead of one per claim. Only the claims whose key was
//! absent are decided here (Owned, with their fence); every other claim
//! goes the way it goes alone ([`Postgres::claim_pipelined`]) afterwards.

use std::collections::HashMap;

use idemgate_core::protocol::ClaimRequest;

use super::claim::Claimed;
use super::pool::{Client, On, Stmt};
use super::Postgres;
use crate::backend::{Result, StoreError};
use crate::row_mapping::{ColumnReader, KeyColumns, ScopeDigest};

#[cfg(doc)]
use super::rows::CLAIM_NEW;

impl Postgres {
    /// Inserts the records of `claims` (their keys distinct) whose key is
    /// absent, each with its `claimed` event, in one statement: the fence
    /// of each claim it inserted, by the claim's index in `claims`. The
    /// others (a key already there, or inserted meanwhile by someone else)
    /// are not in the map. An error means nothing is known of any of them
    /// (the statement is one transaction: none of them was inserted,
    /// unless the error came after its commit).
    pub(super) async fn claim_new(
        &self,
        client: &Client,
        stmt: &Stmt<'_>,
        claims: &[&ClaimRequest],
        now: i64,
    ) -> Result<HashMap<usize, u64>> {
        let keys: Vec<ScopeDigest> = claims.iter().map(|r| ScopeDigest::of(&r.scope)).collect();
        let claimed: Vec<Claimed<'_>> = claims.iter().map(|r| Claimed::of(r, now)).collect();
        let digests: Vec<&[u8]> = keys.iter().map(|k| k.as_bytes()).collect();
        let columns: Vec<[&str; 6]> = claims.iter().map(|r| KeyColumns::of(&r.scope).0).collect();
        let column = |i: usize| columns.iter().map(|c| c[i]).collect::<Vec<&str>>();
        let scope_columns: [Vec<&str>; 6] =
            [column(0), column(1), column(2), column(3), column(4), column(5)];
        let fingerprints: Vec<Option<&str>> = claimed.iter().map(|c| c.fingerprint.as_deref()).collect();
        let lease_until: Vec<i64> = claimed.iter().map(|c| c.lease_until).collect();
        let ttl_ms: Vec<i64> = claimed.iter().map(|c| c.ttl_ms).collect();
        let release: Vec<bool> = claimed.iter().map(|c| c.release).collect();
        let attempts: Vec<Option<&str>> = claimed.iter().map(|c| c.attempt).collect();
        let [v, t, p, r, n, k] = &scope_columns;
        let rows = client
            .rows(
                stmt,
                &[
                    &digests,
                    v,
                    t,
                    p,
                    r,
                    n,
                    k,
                    &fingerprints,
                    &lease_until,
                    &ttl_ms,
                    &release,
                    &now,
                    &attempts,
                ],
            )
            .await?;
        let index: HashMap<&ScopeDigest, usize> = keys.iter().enumerate().map(|(i, k)| (k, i)).collect();
        let mut owned = HashMap::with_capacity(rows.len());
        for row in &rows {
            let digest = row.optional_bytes("scope_digest")?.unwrap_or_default();
            let i = index
                .get(&ScopeDigest::from_bytes(&digest)?)
                .copied()
                .ok_or_else(|| {
                    StoreError::Corrupt("a batch's claim returned a key it was not given".into())
                })?;
            owned.insert(i, row.unsigned("fence")?);
        }
        // Logged once every row is read: the statement has committed.
        for (i, fence) in &owned {
            self.log_claimed(claims[*i], &claimed[*i], *fence, now);
        }
        Ok(owned)
    }
}
