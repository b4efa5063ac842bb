//! One call of the filter's API, validated, as a backend decides it, and
//! its answer. The column mapping builds a replay's answer, so these sit
//! below both it and the [`Backend`](crate::backend::Backend) trait.

use idemgate_core::protocol::{
    AbandonRequest, ClaimReply, ClaimRequest, CompleteRequest, FenceReply, FenceRequest,
};
use idemgate_core::trace::Trace;

/// A claim's verdict plus the stored body for a replay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimOutcome {
    pub reply: ClaimReply,
    pub body: Vec<u8>,
    /// The claim found an expired lease and turned the record `unknown`.
    pub became_unknown: bool,
}

impl ClaimOutcome {
    pub fn answer(reply: ClaimReply) -> ClaimOutcome {
        ClaimOutcome {
            reply,
            body: Vec::new(),
            became_unknown: false,
        }
    }

    /// A completed record served again.
    pub fn replay(
        status: u16,
        headers: Option<Vec<(String, String)>>,
        completed_at: i64,
        body: Vec<u8>,
    ) -> ClaimOutcome {
        ClaimOutcome {
            reply: ClaimReply::Replay {
                status,
                headers: headers.unwrap_or_default(),
                completed_at,
            },
            body,
            became_unknown: false,
        }
    }
}

/// What a claim would do, looked at without writing anything
/// ([`Backend::peek`](crate::backend::Backend::peek)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Peeked {
    /// Its answer: it writes nothing but a replay's count.
    Answered(ClaimOutcome),
    /// It would take the key: a new record, or a new generation of one.
    Takes,
    /// It would change the record without taking the key: turn a lease
    /// that ran out unknown.
    Changes,
}

impl Peeked {
    /// The answer, when the claim writes nothing.
    pub fn answered(self) -> Option<ClaimOutcome> {
        match self {
            Peeked::Answered(outcome) => Some(outcome),
            Peeked::Takes | Peeked::Changes => None,
        }
    }
}

/// One call of the filter's API, validated, as a backend decides it.
#[derive(Debug, Clone)]
pub enum Call {
    /// `deadline`: the caller stops waiting then (see [`Backend::claim`](crate::backend::Backend::claim)).
    Claim {
        req: ClaimRequest,
        deadline: Option<std::time::Instant>,
    },
    /// `body` is stored only when `req.body_stored`.
    Complete {
        req: CompleteRequest,
        body: bytes::Bytes,
    },
    Release(FenceRequest),
    MarkUnknown(FenceRequest),
    Abandon(AbandonRequest),
}

impl Call {
    /// The client request the call serves, named on its event lines.
    pub fn trace(&self) -> &Trace {
        match self {
            Call::Claim { req, .. } => &req.trace,
            Call::Complete { req, .. } => &req.trace,
            Call::Release(req) | Call::MarkUnknown(req) => &req.trace,
            Call::Abandon(req) => &req.trace,
        }
    }
}

/// A call's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    Claim(ClaimOutcome),
    /// Complete, release, mark-unknown and abandon.
    Fence(FenceReply),
}
