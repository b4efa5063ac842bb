use std::collections::VecDeque;

use super::*;
use crate::handling::Settlement;
use crate::protocol::{decode_frame, encode_batch_reply, Batch, BATCH_PATH, COMPLETE_PATH};
use crate::store_call::StoreAnswer;

fn call(len: usize) -> StoreCall {
    StoreCall {
        path: COMPLETE_PATH,
        body: vec![b'x'; len],
        timeout_ms: 1_000,
        may_wait: false,
        traces: vec![Default::default()],
    }
}

fn calls_in(t: &Transmit) -> usize {
    if t.call.path != BATCH_PATH {
        return 1;
    }
    let (meta, _) = decode_frame::<Batch>(&t.call.body).unwrap();
    meta.calls.len()
}

fn ok_batch(n: usize) -> StoreAnswer {
    let results: Vec<(u16, Vec<u8>)> = (0..n).map(|i| (200, vec![b'0' + i as u8])).collect();
    Some((200, encode_batch_reply(&results)))
}

#[test]
fn a_quiet_worker_sends_at_once_and_a_busy_one_batches() {
    let mut c = Attached::new(BOUND);
    c.submit(1, call(10), 0).unwrap();
    let first = c.poll_transmit(0).unwrap();
    assert_eq!(calls_in(&first), 1);
    for owner in 2..5 {
        c.submit(owner, call(10), 0).unwrap();
    }
    assert!(c.poll_transmit(0).is_none(), "the group's callout is in flight");
    assert_eq!(
        c.answered(first.flight, Some((200, vec![]))),
        vec![(1, Some((200, vec![])))]
    );
    let next = c.poll_transmit(1).unwrap();
    assert_eq!(calls_in(&next), 3);
    let answers = c.answered(next.flight, ok_batch(3));
    assert_eq!(answers.iter().map(|(o, _)| *o).collect::<Vec<_>>(), [2, 3, 4]);
    assert_eq!(answers[2].1, Some((200, vec![b'2'])));
}

#[test]
fn a_batch_is_bounded_by_bytes_as_well_as_count() {
    let mut queue: VecDeque<StoreCall> = (0..3).map(|_| call(4 * 1024 * 1024)).collect();
    assert_eq!(pack(&mut queue, |c| c).len(), 1);
    let mut queue: VecDeque<StoreCall> = (0..20).map(|_| call(512 * 1024)).collect();
    let first = pack(&mut queue, |c| c);
    assert!(first.len() < 20 && first.iter().map(weight).sum::<usize>() <= MAX_BATCH_BYTES);
    let mut queue: VecDeque<StoreCall> = (0..100).map(|_| call(1)).collect();
    assert_eq!(pack(&mut queue, |c| c).len(), crate::protocol::MAX_BATCH);
    // A call larger than a batch still goes, alone.
    let mut queue: VecDeque<StoreCall> = [call(MAX_BATCH_BYTES + 1)].into();
    assert_eq!(pack(&mut queue, |c| c).len(), 1);
}

#[test]
fn a_batch_refused_as_a_whole_is_sent_again_call_by_call() {
    let mut c = Attached::new(BOUND);
    c.submit(1, call(10), 0).unwrap();
    let first = c.poll_transmit(0).unwrap();
    c.submit(2, call(10), 0).unwrap();
    c.submit(3, call(10), 0).unwrap();
    c.answered(first.flight, Some((200, vec![])));
    let batch = c.poll_transmit(0).unwrap();
    assert_eq!(calls_in(&batch), 2);
    let refusal = Some((413, b"{\"detail\":\"too large\"}".to_vec()));
    assert!(
        c.answered(batch.flight, refusal).is_empty(),
        "no call's own answer"
    );
    let (a, b) = (c.poll_transmit(0).unwrap(), c.poll_transmit(0).unwrap());
    assert_eq!((calls_in(&a), calls_in(&b)), (1, 1));
    assert_eq!(
        c.answered(b.flight, Some((200, vec![7]))),
        vec![(3, Some((200, vec![7])))]
    );
}

#[test]
fn a_store_without_batches_gets_every_call_alone() {
    let mut c = Attached::new(BOUND);
    c.submit(1, call(10), 0).unwrap();
    let first = c.poll_transmit(0).unwrap();
    c.submit(2, call(10), 0).unwrap();
    c.submit(3, call(10), 0).unwrap();
    c.answered(first.flight, Some((200, vec![])));
    let batch = c.poll_transmit(0).unwrap();
    assert!(c.answered(batch.flight, Some((404, vec![]))).is_empty());
    c.submit(4, call(10), 0).unwrap();
    let sent: Vec<usize> = std::iter::from_fn(|| c.poll_transmit(0))
        .map(|t| calls_in(&t))
        .collect();
    assert_eq!(sent, [1, 1, 1]);
}

#[test]
fn the_queue_is_bounded_and_a_queued_call_keeps_its_callers_deadline() {
    let mut c = Attached::new(BOUND);
    c.submit(1, call(10), 0).unwrap();
    let _in_flight = c.poll_transmit(0).unwrap();
    for owner in 0..BOUND.calls as u32 {
        c.submit(owner, call(1), 0).unwrap();
    }
    assert_eq!(c.submit(9, call(1), 0), Err(Full));
    let mut big = Attached::new(BOUND);
    big.submit(1, call(1), 0).unwrap();
    let _in_flight = big.poll_transmit(0).unwrap();
    let mut n = 0;
    while big.submit(n, call(4 * 1024 * 1024), 0).is_ok() {
        n += 1;
    }
    assert!(big.queued_bytes() <= BOUND.bytes && n < 20, "{n}");
    assert_eq!(c.next_deadline(), Some(1_000));
    assert!(c.expire(999).is_empty());
    assert_eq!(c.expire(1_000).len(), BOUND.calls);
    assert_eq!(c.queued(), 0);
}

#[test]
fn the_calls_of_a_request_that_left_are_not_sent() {
    let mut c = Attached::new(BOUND);
    c.submit(1, call(10), 0).unwrap();
    let first = c.poll_transmit(0).unwrap();
    c.submit(2, call(10), 0).unwrap();
    c.submit(3, call(10), 0).unwrap();
    c.left(2);
    c.answered(first.flight, Some((200, vec![])));
    let next = c.poll_transmit(0).unwrap();
    assert_eq!(calls_in(&next), 1);
    assert_eq!(
        c.answered(next.flight, Some((200, vec![]))),
        vec![(3, Some((200, vec![])))]
    );
}

fn letter(len: usize) -> Letter {
    Letter {
        call: call(len),
        settles: Settlement::Completed,
        policy: "p".into(),
        attempt: crate::protocol::Attempt::try_from("a1".to_string()).unwrap(),
    }
}

#[test]
fn a_letter_is_sent_again_with_growing_backoff_until_the_store_decides() {
    let mut l = Letters::new(BOUND, 7);
    l.post(letter(10), 0);
    let mut now = 0;
    let mut gaps = Vec::new();
    for _ in 0..6 {
        let t = l.poll_transmit(now).unwrap();
        assert!(l.answered(t.flight, Some((503, vec![])), now).is_empty());
        let due = l.next_due().unwrap();
        gaps.push(due - now);
        assert!(l.poll_transmit(due - 1).is_none());
        now = due;
    }
    assert!(
        gaps.windows(2).all(|w| w[1] >= w[0] / 2) && gaps[5] > gaps[0] * 4,
        "{gaps:?}"
    );
    let t = l.poll_transmit(now).unwrap();
    let ended = l.answered(t.flight, done(), now);
    assert_eq!(ended, vec![(letter(10), Delivery::Decided(done()))]);
    assert!(l.is_idle());
}

#[test]
fn a_letter_is_given_up_when_its_time_is_spent_and_never_before() {
    let mut l = Letters::new(BOUND, 1);
    l.post(letter(10), 0);
    let mut now = 0;
    let mut tries = 0;
    loop {
        let t = l.poll_transmit(now).unwrap();
        tries += 1;
        let ended = l.answered(t.flight, None, now);
        if !ended.is_empty() {
            assert_eq!(ended, vec![(letter(10), Delivery::GaveUp)]);
            break;
        }
        now = l.next_due().unwrap();
    }
    assert!(
        now >= BUDGET_MS as i64 && now < BUDGET_MS as i64 + 10_000,
        "{now}"
    );
    assert!(tries < 100, "backoff, not a tight loop: {tries}");
}

#[test]
fn letters_refused_as_a_batch_travel_alone() {
    let mut l = Letters::new(BOUND, 1);
    for _ in 0..3 {
        l.post(letter(10), 0);
    }
    let t = l.poll_transmit(0).unwrap();
    assert_eq!(calls_in(&t), 3);
    assert!(l.answered(t.flight, Some((413, vec![])), 0).is_empty());
    let sent: Vec<usize> = std::iter::from_fn(|| l.poll_transmit(0))
        .map(|t| calls_in(&t))
        .collect();
    assert_eq!(sent, [1, 1, 1]);
}

#[test]
fn large_letters_are_batched_within_the_frame() {
    let mut l = Letters::new(BOUND, 1);
    for _ in 0..4 {
        l.post(letter(3 * 1024 * 1024), 0);
    }
    let first = l.poll_transmit(0).unwrap();
    assert_eq!(calls_in(&first), 2);
    assert!(l.poll_transmit(0).is_none());
    assert_eq!(l.answered(first.flight, done_batch(2), 0).len(), 2);
    assert_eq!(calls_in(&l.poll_transmit(0).unwrap()), 2);
}

#[test]
fn letters_posted_while_a_batch_of_them_is_in_flight_go_together_once_it_returns() {
    let mut l = Letters::new(BOUND, 1);
    l.post(letter(10), 0);
    let first = l.poll_transmit(0).unwrap();
    assert_eq!(calls_in(&first), 1, "a quiet worker sends at once");
    for _ in 0..3 {
        l.post(letter(10), 1);
    }
    assert!(l.poll_transmit(1).is_none());
    assert_eq!(l.next_due(), None, "the answer sends them, not the timer");
    assert_eq!(l.answered(first.flight, done(), 2).len(), 1);
    let next = l.poll_transmit(2).unwrap();
    assert_eq!(calls_in(&next), 3);
    assert!(l.poll_transmit(2).is_none());
}

#[test]
fn a_letter_that_travels_alone_does_not_wait_for_the_batch_in_flight() {
    let mut l = Letters::new(BOUND, 1);
    for _ in 0..2 {
        l.post(letter(10), 0);
    }
    let refused = l.poll_transmit(0).unwrap();
    assert!(l.answered(refused.flight, Some((413, vec![])), 0).is_empty());
    l.post(letter(10), 0);
    let sent: Vec<usize> = std::iter::from_fn(|| l.poll_transmit(0))
        .map(|t| calls_in(&t))
        .collect();
    assert_eq!(sent, [1, 1, 1], "two alone, then the new one as the batch");
    l.post(letter(10), 0);
    assert!(l.poll_transmit(0).is_none(), "the batch of one is in flight");
}

#[test]
fn a_batch_names_the_request_of_each_of_its_calls_in_order() {
    let traced = |id: &str| {
        let mut c = call(8);
        c.traces = vec![crate::trace::Trace {
            request_id: Some(id.into()),
            trace_id: None,
        }];
        c
    };
    let (a, b) = (traced("a"), traced("b"));
    let batch = StoreCall::batch(&[&a, &b]);
    let ids: Vec<_> = batch.traces.iter().map(|t| t.request_id.as_deref()).collect();
    assert_eq!(ids, [Some("a"), Some("b")]);
}

/// The store's confirmation of a settlement, as it frames it.
fn done() -> StoreAnswer {
    Some((
        200,
        crate::protocol::encode_frame(&crate::protocol::FenceReply::Done, &[]),
    ))
}

/// The store's answer to a batch of `n` settlements, each confirmed.
fn done_batch(n: usize) -> StoreAnswer {
    let results: Vec<(u16, Vec<u8>)> = (0..n).filter_map(|_| done()).collect();
    Some((200, encode_batch_reply(&results)))
}

/// Answers to a settlement from something in front of the store: a rate
/// limiter's plain text, a proxy's bare timeout, Envoy's own problem.
fn not_the_stores() -> Vec<StoreAnswer> {
    let envoy = crate::problem::envoy_reply(413, "Payload Too Large", "request body too large");
    vec![
        Some((429, b"local_rate_limited".to_vec())),
        Some((408, Vec::new())),
        Some((413, envoy.body)),
    ]
}

#[test]
fn a_letter_answered_by_something_in_front_of_the_store_is_sent_again() {
    for answer in not_the_stores() {
        let mut l = Letters::new(BOUND, 3);
        l.post(letter(10), 0);
        let t = l.poll_transmit(0).unwrap();
        assert!(l.answered(t.flight, answer.clone(), 0).is_empty(), "{answer:?}");
        let due = l.next_due().expect("sent again");
        assert!(due > 0, "after a backoff: {answer:?}");
        let again = l.poll_transmit(due).unwrap();
        assert_eq!(again.call, t.call);
        assert_eq!(
            l.answered(again.flight, done(), due),
            vec![(letter(10), Delivery::Decided(done()))]
        );
    }
}

#[test]
fn a_letter_the_store_refuses_itself_ends_on_that_refusal() {
    let problem = crate::problem::Problem::new(crate::problem::ProblemKind::BodyTooLarge, "too large");
    let refused = Some((413, problem.render("https://store.example/problems/").body));
    let mut l = Letters::new(BOUND, 3);
    l.post(letter(10), 0);
    let t = l.poll_transmit(0).unwrap();
    assert_eq!(
        l.answered(t.flight, refused.clone(), 0),
        vec![(letter(10), Delivery::Decided(refused))]
    );
}

#[test]
fn a_batch_answered_429_as_a_whole_is_not_read_as_each_calls_answer() {
    let limited = Some((429, b"local_rate_limited".to_vec()));
    let mut c = Attached::new(BOUND);
    c.submit(1, call(10), 0).unwrap();
    let first = c.poll_transmit(0).unwrap();
    c.submit(2, call(10), 0).unwrap();
    c.submit(3, call(10), 0).unwrap();
    c.answered(first.flight, done());
    let batch = c.poll_transmit(0).unwrap();
    assert_eq!(calls_in(&batch), 2);
    assert!(c.answered(batch.flight, limited.clone()).is_empty());
    let (a, b) = (c.poll_transmit(0).unwrap(), c.poll_transmit(0).unwrap());
    assert_eq!((calls_in(&a), calls_in(&b)), (1, 1));

    let mut l = Letters::new(BOUND, 1);
    for _ in 0..3 {
        l.post(letter(10), 0);
    }
    let t = l.poll_transmit(0).unwrap();
    assert_eq!(calls_in(&t), 3);
    assert!(l.answered(t.flight, limited, 0).is_empty(), "no letter ends");
    let sent: Vec<Transmit> = std::iter::from_fn(|| l.poll_transmit(0)).collect();
    assert_eq!(sent.iter().map(calls_in).collect::<Vec<_>>(), [1, 1, 1]);
    for t in sent {
        assert_eq!(l.answered(t.flight, done(), 0).len(), 1);
    }
    assert!(l.is_idle());
}
