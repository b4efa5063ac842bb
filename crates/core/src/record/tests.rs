//! The record rules' unit tests: each rule at the edges of its states and
//! times.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use super::*;
use crate::key::Key;
use crate::scope::{Namespace, Scope};

fn fp(b: u8) -> Fingerprint {
    Fingerprint::try_from(format!("{b:02x}").repeat(32)).unwrap()
}

fn req(fingerprint: Option<Fingerprint>) -> ClaimRequest {
    ClaimRequest {
        scope: Scope::new(
            "t",
            "p",
            "r",
            Namespace::Client,
            Key::try_from("k".to_string()).unwrap(),
        )
        .unwrap(),
        fingerprint,
        lease_ms: 1_000,
        ttl_ms: 10_000,
        wait_ms: 0,
        after_expiry: AfterExpiry::Reject,
        on_unknown: OnUnknown::Conflict,
        attempt: None,
        deadline_ms: 0,
        trace: crate::trace::Trace::NONE,
    }
}

fn rec(state: State) -> RecordView {
    RecordView {
        state,
        fingerprint: Some(fp(1)),
        fence: 7,
        lease_until: 2_000,
        status: Some(201),
        body_stored: true,
        completed_at: if state == State::Completed {
            Some(1_500)
        } else {
            None
        },
        expires_at: if state == State::InProgress {
            None
        } else {
            Some(11_500)
        },
        archived: false,
        attempt: Some("a".into()),
    }
}

#[test]
fn no_record_means_a_fresh_claim() {
    assert_eq!(decide_claim(None, &req(Some(fp(1))), 0), ClaimDecision::Claim);
}

#[test]
fn a_different_fingerprint_is_a_mismatch_in_every_state() {
    for state in [State::InProgress, State::Completed, State::Unknown] {
        for now in [0, 1_999, 2_000, 11_500, 99_999] {
            let d = decide_claim(Some(&rec(state)), &req(Some(fp(2))), now);
            assert_eq!(
                d,
                ClaimDecision::Answer(ClaimReply::Mismatch),
                "{state:?} at {now}"
            );
        }
    }
}

#[test]
fn a_missing_fingerprint_on_either_side_matches() {
    let mut r = rec(State::Completed);
    assert!(matches!(
        decide_claim(Some(&r), &req(None), 1_600),
        ClaimDecision::Replay { .. }
    ));
    r.fingerprint = None;
    assert!(matches!(
        decide_claim(Some(&r), &req(Some(fp(9))), 1_600),
        ClaimDecision::Replay { .. }
    ));
}

#[test]
fn a_completed_record_replays_until_it_expires() {
    let r = rec(State::Completed);
    assert_eq!(
        decide_claim(Some(&r), &req(Some(fp(1))), 11_499),
        ClaimDecision::Replay {
            status: 201,
            completed_at: 1_500
        }
    );
    assert_eq!(
        decide_claim(Some(&r), &req(Some(fp(1))), 11_500),
        ClaimDecision::Answer(ClaimReply::Expired {
            completed_at: Some(1_500)
        })
    );
    let mut new = req(Some(fp(1)));
    new.after_expiry = AfterExpiry::New;
    assert_eq!(decide_claim(Some(&r), &new, 11_500), ClaimDecision::Claim);
    // An expired key is forgotten under `new`: another request is no mismatch.
    new.fingerprint = Some(fp(2));
    assert_eq!(decide_claim(Some(&r), &new, 11_500), ClaimDecision::Claim);
}

#[test]
fn a_completed_record_without_its_body_is_result_unavailable() {
    let mut r = rec(State::Completed);
    r.body_stored = false;
    assert_eq!(
        decide_claim(Some(&r), &req(Some(fp(1))), 1_600),
        ClaimDecision::Answer(ClaimReply::ResultUnavailable {
            original_status: 201,
            completed_at: 1_500
        })
    );
}

#[test]
fn an_in_progress_record_answers_the_remaining_lease() {
    let r = rec(State::InProgress);
    assert_eq!(
        decide_claim(Some(&r), &req(Some(fp(1))), 1_250),
        ClaimDecision::Answer(ClaimReply::InProgress { retry_after_ms: 750 })
    );
}

/// A claim delivered twice (a proxy in front of the store that sent it
/// again) may land after its own copy took the key, or be decided before
/// it (a slow database): whichever answer reaches the filter first, it
/// is the key's, never "someone else holds it" while nobody else does.
#[test]
fn a_copy_of_the_claim_that_holds_the_key_is_answered_owned() {
    let r = rec(State::InProgress);
    let mut copy = req(Some(fp(1)));
    copy.attempt = Some(crate::protocol::Attempt::try_from("a".to_string()).unwrap());
    assert_eq!(
        decide_claim(Some(&r), &copy, 1_250),
        ClaimDecision::Answer(ClaimReply::Owned { fence: 7 })
    );
    // Another attempt still waits for the lease.
    copy.attempt = Some(crate::protocol::Attempt::try_from("b".to_string()).unwrap());
    assert_eq!(
        decide_claim(Some(&r), &copy, 1_250),
        ClaimDecision::Answer(ClaimReply::InProgress { retry_after_ms: 750 })
    );
}

#[test]
fn a_lease_that_ran_out_turns_unknown_or_is_claimed_afresh() {
    let r = rec(State::InProgress);
    assert_eq!(
        decide_claim(Some(&r), &req(Some(fp(1))), 2_000),
        ClaimDecision::BecomeUnknown
    );
    let mut release = req(Some(fp(1)));
    release.on_unknown = OnUnknown::Release;
    assert_eq!(decide_claim(Some(&r), &release, 2_000), ClaimDecision::Claim);
}

#[test]
fn an_unknown_record_conflicts_unless_the_policy_releases_it() {
    let r = rec(State::Unknown);
    assert_eq!(
        decide_claim(Some(&r), &req(Some(fp(1))), 3_000),
        ClaimDecision::Answer(ClaimReply::Unknown)
    );
    let mut release = req(Some(fp(1)));
    release.on_unknown = OnUnknown::Release;
    assert_eq!(decide_claim(Some(&r), &release, 3_000), ClaimDecision::Claim);
    // Marked unknown early, the upstream may still act until the lease ends.
    assert_eq!(
        decide_claim(Some(&r), &release, 1_500),
        ClaimDecision::Answer(ClaimReply::InProgress { retry_after_ms: 500 })
    );
    assert_eq!(
        decide_claim(Some(&r), &req(Some(fp(1))), 11_500),
        ClaimDecision::Answer(ClaimReply::Expired { completed_at: None })
    );
}

#[test]
fn an_archived_record_never_replays_whatever_the_clock() {
    let mut r = rec(State::Completed);
    r.archived = true;
    assert_eq!(
        decide_claim(Some(&r), &req(Some(fp(1))), 1_600),
        ClaimDecision::Answer(ClaimReply::Expired {
            completed_at: Some(1_500)
        })
    );
    let mut new = req(Some(fp(1)));
    new.after_expiry = AfterExpiry::New;
    assert_eq!(decide_claim(Some(&r), &new, 1_600), ClaimDecision::Claim);
}

#[test]
fn an_abandon_is_remembered_unless_its_attempt_holds_the_record() {
    use AbandonDecision::*;
    assert_eq!(decide_abandon(None, "a"), Remember);
    let open = rec(State::InProgress);
    assert_eq!(decide_abandon(Some(&open), "a"), End);
    assert_eq!(decide_abandon(Some(&open), "b"), Remember);
    assert_eq!(decide_abandon(Some(&rec(State::Unknown)), "a"), End);
    assert_eq!(decide_abandon(Some(&rec(State::Completed)), "a"), Settled);
    assert_eq!(decide_abandon(Some(&rec(State::Completed)), "b"), Remember);
    // Its lease ran out and it expired before the abandon arrived.
    let mut archived = rec(State::Unknown);
    archived.archived = true;
    assert_eq!(decide_abandon(Some(&archived), "a"), End);
}

#[test]
fn only_the_current_fence_completes_an_open_record() {
    assert!(may_fence(State::InProgress, 7, 7));
    assert!(may_fence(State::Unknown, 7, 7));
    assert!(!may_fence(State::InProgress, 8, 7));
    assert!(!may_fence(State::Completed, 7, 7));
}

#[test]
fn only_the_claiming_attempt_abandons_and_never_a_completion() {
    assert!(may_abandon(State::InProgress, Some("a"), "a"));
    assert!(may_abandon(State::Unknown, Some("a"), "a"));
    assert!(!may_abandon(State::InProgress, Some("a"), "b"));
    assert!(!may_abandon(State::InProgress, None, "a"));
    assert!(!may_abandon(State::Completed, Some("a"), "a"));
}

#[test]
fn transitions_round_trip_and_name_how_a_generation_ended() {
    for t in Transition::ALL {
        assert_eq!(Transition::parse(t.as_str()), Some(t));
    }
    assert_eq!(
        ended_as(State::InProgress, Transition::Abandoned).as_str(),
        "abandoned"
    );
    assert_eq!(
        ended_as(State::Completed, Transition::Reclaimed).as_str(),
        "completed"
    );
    assert_eq!(
        ended_as(State::Unknown, Transition::Reclaimed).as_str(),
        "unknown"
    );
    assert_eq!(
        ended_as(State::InProgress, Transition::LeaseExpired).as_str(),
        "lease_expired"
    );
    assert_eq!(
        ended_as(State::InProgress, Transition::Reclaimed).as_str(),
        "lease_expired"
    );
    assert_eq!(
        ended_as(State::Unknown, Transition::Resolved).as_str(),
        "released"
    );
}

#[test]
fn time_arithmetic_saturates() {
    assert_eq!(remaining_ms(5, 10), 0);
    assert_eq!(plus_ms(i64::MAX - 1, u64::MAX), i64::MAX);
    assert_eq!(completion_expiry(1_000, 500), 1_500);
    assert_eq!(unknown_expiry(1_000, 500), 1_500);
    assert_eq!(lease_until(1_000, 10), 1_010);
}

#[test]
fn an_open_record_is_one_a_fence_call_may_act_on_until_it_is_archived() {
    for s in State::ALL {
        assert_eq!(is_open(s, false), may_fence(s, 7, 7), "{s:?}");
        assert!(!is_open(s, true), "{s:?}");
    }
    assert!(is_open(State::Unknown, false));
    assert!(!is_open(State::Completed, false));
}

#[test]
fn states_round_trip_through_their_column_spelling() {
    // A state added to the enum is a compile error here until `ALL` lists it.
    for s in State::ALL {
        match s {
            State::InProgress | State::Completed | State::Unknown => {}
        }
    }
    assert_eq!(State::ALL.len(), 3);
    for s in State::ALL {
        assert_eq!(State::parse(s.as_str()), Some(s));
    }
    assert_eq!(State::parse("released"), None);
}

#[test]
fn a_generations_state_column_reads_back_as_it_was_written() {
    for s in State::ALL {
        assert_eq!(Standing::parse(s.as_str()), Some(Standing::In(s)));
    }
    for ended in Standing::endings() {
        assert_eq!(Standing::parse(ended.as_str()), Some(ended));
    }
    // A transition that never ends a generation is no value of the column.
    assert_eq!(Standing::parse("claimed"), None);
    assert_eq!(Standing::parse("resolved"), None);
    assert_eq!(
        Standing::parse("released"),
        Some(Standing::EndedBy(Transition::Released))
    );
    assert_eq!(Standing::parse(""), None);
}

#[test]
fn the_enums_serialize_as_their_column_spelling() {
    for s in State::ALL {
        let json = serde_json::to_string(&s).unwrap();
        assert_eq!(json, format!("\"{}\"", s.as_str()));
        assert_eq!(serde_json::from_str::<State>(&json).unwrap(), s);
        assert_eq!(s.to_string(), s.as_str());
    }
    for t in Transition::ALL {
        let json = serde_json::to_string(&t).unwrap();
        assert_eq!(json, format!("\"{}\"", t.as_str()));
        assert_eq!(serde_json::from_str::<Transition>(&json).unwrap(), t);
        assert_eq!(t.to_string(), t.as_str());
    }
    for e in Standing::endings() {
        let json = serde_json::to_string(&e).unwrap();
        assert_eq!(serde_json::from_str::<Standing>(&json).unwrap(), e);
    }
    assert!(serde_json::from_str::<State>("\"released\"").is_err());
    assert!(serde_json::from_str::<Transition>("\"finished\"").is_err());
}
