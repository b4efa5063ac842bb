//! A call to the store and what its answer says: the one shape of every
//! call the filter makes to the store (a claim, a settlement, a batch of
//! them), and how an answer reads, for the exchange that made the call and
//! for the store client that delivers it again.

use crate::problem::Problem;
use crate::protocol::{decode_frame, encode_batch, split_batch, BatchReply, FenceReply, BATCH_PATH};
use crate::trace::Trace;

/// A `POST` to the store: the filter adds `:authority`, `authorization` and
/// `content-type` from the [`crate::config::StoreConfig`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreCall {
    pub path: &'static str,
    pub body: Vec<u8>,
    pub timeout_ms: u64,
    /// The store may hold the call for a while (a claim with `in_flight:
    /// wait`): it travels alone, never in a batch other calls would wait for.
    pub may_wait: bool,
    /// The client request each call of it serves, in order (one for a call
    /// alone): sent in [`crate::trace::TRACE_HEADER`].
    pub traces: Vec<Trace>,
}

impl StoreCall {
    /// Several calls as one `/v1/batch` call, allowed as long as the
    /// slowest of them.
    pub fn batch(calls: &[&StoreCall]) -> StoreCall {
        let frames: Vec<(&str, &[u8])> = calls.iter().map(|c| (c.path, c.body.as_slice())).collect();
        StoreCall {
            path: BATCH_PATH,
            body: encode_batch(&frames),
            timeout_ms: calls.iter().map(|c| c.timeout_ms).max().unwrap_or(0),
            may_wait: false,
            traces: calls.iter().flat_map(|c| c.traces.iter().cloned()).collect(),
        }
    }
}

/// Whether the store answered a batch as one that predates batches.
pub fn batches_unknown(answer: &StoreAnswer) -> bool {
    matches!(answer, Some((404, _)))
}

/// The store's answer to a call: status and body, or no answer at all (reset,
/// timeout, dispatch failure).
pub type StoreAnswer = Option<(u16, Vec<u8>)>;

/// Whether the store itself decided a settlement (complete, release,
/// mark-unknown, abandon): it answered with its fence frame (done, or a
/// stale fence) or refused the call with a final problem of its own. Only
/// that ends the call; anything else means it should be sent again: no
/// answer, an unavailable store, and any answer the store did not write —
/// a `408`, `413` or `429` from a proxy or rate limiter in front of it
/// says nothing about the record.
pub fn decided(answer: &StoreAnswer) -> bool {
    matches!(answer, Some((_, body)) if decode_frame::<FenceReply>(body).is_ok()) || refusal(answer).is_some()
}

/// Whether the store confirmed a complete, release or mark-unknown call.
pub fn settled(answer: &StoreAnswer) -> bool {
    matches!(answer, Some((200, body)) if decode_frame::<FenceReply>(body).ok().map(|(reply, _)| reply) == Some(FenceReply::Done))
}

/// The store refused the frame itself (a limit, the credential, the API
/// version) with a problem of its own that is final: a deployment error,
/// not an outage. A problem it asks to be retried on (`key-rate-limited`,
/// `store-unavailable`) is none, nor is its stale fence (a frame), nor any
/// answer it did not write: `(status, detail)`.
pub fn refusal(answer: &StoreAnswer) -> Option<(u16, String)> {
    let (status, body) = answer.as_ref()?;
    let problem = Problem::read(*status, body).filter(|p| !p.kind.retryable())?;
    Some((*status, problem.detail))
}

/// Each call's answer from the answer to a batch of `n` calls. A batch
/// answered as a whole (no answer, an unavailable store, a reply that does
/// not match the batch) gives every call that same answer, so each fails
/// closed exactly as it would have alone. (A batch refused with a `4xx`
/// is not split: [`crate::client`] sends its calls again one by one.)
pub fn batch_answers(answer: StoreAnswer, n: usize) -> Vec<StoreAnswer> {
    let split = |body: &[u8]| {
        let (meta, bytes) = decode_frame::<BatchReply>(body).ok()?;
        let parts = split_batch(meta.results.iter().map(|r| r.len), bytes).ok()?;
        (parts.len() == n).then(|| {
            meta.results
                .iter()
                .zip(parts)
                .map(|(r, part)| Some((r.status, part.to_vec())))
                .collect()
        })
    };
    match &answer {
        Some((200, body)) => split(body).unwrap_or_else(|| vec![None; n]),
        _ => vec![answer; n],
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::encode_batch_reply;

    #[test]
    fn a_batch_answer_is_split_per_call_or_given_whole_to_each() {
        let reply = encode_batch_reply(&[(200, b"a".to_vec()), (409, b"b".to_vec())]);
        assert_eq!(
            batch_answers(Some((200, reply.clone())), 2),
            vec![Some((200, b"a".to_vec())), Some((409, b"b".to_vec()))]
        );
        // A reply that does not match the batch: nothing is known of any call.
        assert_eq!(batch_answers(Some((200, reply)), 3), vec![None, None, None]);
        assert_eq!(batch_answers(Some((200, b"junk".to_vec())), 2), vec![None, None]);
        // The batch answered as a whole: each call gets that answer.
        assert_eq!(batch_answers(None, 2), vec![None, None]);
        let refused = Some((401, b"{}".to_vec()));
        assert_eq!(batch_answers(refused.clone(), 2), vec![refused.clone(), refused]);
    }
}
