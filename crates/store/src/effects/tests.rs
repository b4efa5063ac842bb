use idemgate_core::key::Key;
use idemgate_core::record::RecordView;
use idemgate_core::scope::Namespace;

use super::*;

const NOW: i64 = 100_000;

fn loaded(state: State) -> LoadedRecord {
    LoadedRecord {
        view: RecordView {
            state,
            fingerprint: None,
            fence: 7,
            lease_until: 2_000,
            status: (state == State::Completed).then_some(201),
            body_stored: state == State::Completed,
            completed_at: (state == State::Completed).then_some(1_000),
            expires_at: (state != State::InProgress).then_some(50_000),
            archived: false,
            attempt: Some("a".into()),
        },
        ttl_ms: 10_000,
        headers_column: None,
        response_key: None,
        release_on_unknown: false,
    }
}

fn archived(state: State) -> LoadedRecord {
    let mut l = loaded(state);
    l.view.archived = true;
    l
}

fn releasing(state: State) -> LoadedRecord {
    let mut l = loaded(state);
    l.release_on_unknown = true;
    l
}

fn scope() -> Scope {
    Scope::new(
        "t",
        "p",
        "r",
        Namespace::Client,
        Key::try_from("k".to_string()).unwrap(),
    )
    .unwrap()
}

fn completion(fence: u64) -> CompleteRequest {
    CompleteRequest {
        scope: scope(),
        fence,
        status: 201,
        headers: vec![("a".into(), "b".into())],
        body_stored: true,
        trace: Default::default(),
    }
}

fn event(by: By<'static>) -> Write<'static> {
    Write::Event { by, note: None }
}

fn end(last: State, by: By<'static>) -> Write<'static> {
    Write::EndGeneration { last, by, note: None }
}

#[test]
fn a_completion_under_the_current_fence_stores_the_response_of_an_open_record() {
    let req = completion(7);
    for state in [State::InProgress, State::Unknown] {
        let effect = complete(Some(&loaded(state)), &req, Some(b"ok"), NOW);
        assert_eq!(effect.reply, FenceReply::Done);
        assert_eq!(
            effect.writes,
            vec![
                Write::Complete {
                    response: Response {
                        status: 201,
                        headers: &req.headers,
                        body: Some(b"ok"),
                        body_stored: true,
                    },
                    fence: Fence::Held(7),
                    expires_at: NOW + 10_000,
                    durable: false,
                },
                event((Transition::Completed, &Actor::Filter, None)),
            ]
        );
    }
    let effect = complete(Some(&releasing(State::InProgress)), &req, None, NOW);
    assert!(matches!(effect.writes[0], Write::Complete { durable: true, .. }));
}

#[test]
fn a_fence_call_on_a_settled_archived_superseded_or_missing_record_is_stale() {
    let (req, other) = (completion(7), completion(8));
    let cases = [
        (Some(loaded(State::Completed)), &req),
        (Some(archived(State::Unknown)), &req),
        (Some(archived(State::InProgress)), &req),
        (Some(loaded(State::InProgress)), &other),
        (None, &req),
    ];
    for (l, req) in &cases {
        let l = l.as_ref();
        let stale = Effect::only(FenceReply::Stale);
        // An archived unknown record still takes a late completion (below).
        if !l.is_some_and(|l| l.view.archived && l.view.state == State::Unknown) {
            assert_eq!(complete(l, req, Some(b"x"), NOW), stale);
        }
        assert_eq!(release(l, &scope(), req.fence), stale);
        assert_eq!(mark_unknown(l, req.fence, NOW), stale);
    }
}

#[test]
fn a_late_completion_of_an_archived_unknown_record_is_recorded_without_its_body() {
    let req = completion(7);
    let effect = complete(Some(&archived(State::Unknown)), &req, Some(b"x"), NOW);
    assert_eq!(effect.reply, FenceReply::Done);
    assert!(matches!(
        &effect.writes[0],
        Write::Complete { response, .. } if response.body.is_none() && !response.body_stored
    ));
}

#[test]
fn release_ends_the_generation_and_mark_unknown_turns_it_unknown_once() {
    let s = scope();
    for state in [State::InProgress, State::Unknown] {
        let by = (Transition::Released, &Actor::Filter, None);
        // Its attempt is remembered as an abandoned one is: a copy of its
        // claim that lands afterwards is ended by the sweeper.
        let remembered = Write::RememberAbandon {
            scope: &s,
            attempt: "a".into(),
        };
        assert_eq!(
            release(Some(&loaded(state)), &s, 7),
            Effect::of(FenceReply::Done, vec![end(state, by), remembered])
        );
    }
    assert_eq!(
        mark_unknown(Some(&loaded(State::InProgress)), 7, NOW),
        Effect::of(
            FenceReply::Done,
            vec![
                Write::SetUnknown {
                    read_with: (7, State::InProgress),
                    expires_at: NOW + 10_000,
                },
                event((Transition::MarkedUnknown, &Actor::Filter, None)),
            ]
        )
    );
    assert_eq!(
        mark_unknown(Some(&loaded(State::Unknown)), 7, NOW),
        Effect::only(FenceReply::Done)
    );
}

#[test]
fn an_abandon_ends_its_own_open_claim_and_remembers_every_attempt() {
    let s = scope();
    let by = (Transition::Abandoned, &Actor::Filter, None);
    let open = loaded(State::InProgress);
    // Remembered also when it ended its claim: a copy of that claim may
    // still land.
    let remembered = Write::RememberAbandon {
        scope: &s,
        attempt: "a".into(),
    };
    assert_eq!(
        abandon(Some(&open), &s, "a"),
        Effect::of(
            FenceReply::Done,
            vec![end(State::InProgress, by), remembered.clone()]
        )
    );
    let remember = Effect::of(
        FenceReply::Done,
        vec![Write::RememberAbandon {
            scope: &s,
            attempt: "b".into(),
        }],
    );
    assert_eq!(abandon(Some(&open), &s, "b"), remember);
    assert_eq!(abandon(None, &s, "b"), remember);
    let stale = Effect::only(FenceReply::Stale);
    assert_eq!(abandon(Some(&loaded(State::Completed)), &s, "a"), stale);
    // Unknown only because its lease ran out, and since archived: it never ran.
    assert_eq!(
        abandon(Some(&archived(State::Unknown)), &s, "a"),
        Effect::of(FenceReply::Done, vec![end(State::Unknown, by), remembered])
    );
}

#[test]
fn an_operator_resolves_only_an_open_record() {
    let alice = Actor::Named("alice@example.com".into());
    let by = |action| Resolution {
        action,
        by: alice.clone(),
    };
    let release_it = by(Action::Release);
    let complete_it = by(Action::Complete {
        status: 200,
        headers: vec![],
        body: "done".into(),
    });
    for how in [&release_it, &complete_it] {
        assert_eq!(resolve(None, how, None, NOW), Effect::only(false));
        for l in [loaded(State::Completed), archived(State::Unknown)] {
            assert_eq!(resolve(Some(&l), how, None, NOW), Effect::only(false));
        }
    }
    let unknown = loaded(State::Unknown);
    assert_eq!(
        resolve(Some(&unknown), &release_it, Some("why"), NOW),
        Effect::of(
            true,
            vec![Write::EndGeneration {
                last: State::Unknown,
                by: (Transition::Resolved, &alice, Some("release")),
                note: Some("why"),
            }]
        )
    );
    let effect = resolve(Some(&unknown), &complete_it, Some("why"), NOW);
    assert!(effect.reply);
    assert_eq!(
        effect.writes,
        vec![
            Write::Complete {
                response: Response {
                    status: 200,
                    headers: &[],
                    body: Some(b"done"),
                    body_stored: true,
                },
                fence: Fence::New,
                expires_at: NOW + 10_000,
                durable: false,
            },
            Write::Event {
                by: (Transition::Resolved, &alice, Some("complete")),
                note: Some("why"),
            },
        ]
    );
}

#[test]
fn a_purge_ends_whatever_is_there() {
    // An operator's purge names the operator and keeps the reason.
    let how = Resolution {
        action: Action::Purge,
        by: Actor::Named("bob@example.com".into()),
    };
    assert_eq!(resolve(None, &how, Some("gdpr"), NOW), Effect::only(false));
    for l in [loaded(State::Completed), archived(State::Unknown)] {
        assert_eq!(
            resolve(Some(&l), &how, Some("gdpr"), NOW),
            Effect::of(
                true,
                vec![Write::EndGeneration {
                    last: l.view.state,
                    by: (Transition::Purged, &how.by, None),
                    note: Some("gdpr"),
                }]
            )
        );
    }
}

#[test]
fn the_sweeper_releases_or_turns_unknown_as_the_claim_said_and_archives_what_expired() {
    let swept = |l: &LoadedRecord, due| sweep(Some(l), due, NOW);
    let open = loaded(State::InProgress);
    assert_eq!(
        swept(&open, Due::LeaseRanOut),
        Effect::of(
            Some(Swept::MarkedUnknown),
            vec![
                Write::SetUnknown {
                    read_with: (7, State::InProgress),
                    expires_at: NOW + 10_000,
                },
                event((Transition::LeaseExpired, &Actor::Sweeper, Some("unknown"))),
            ]
        )
    );
    let by = (Transition::LeaseExpired, &Actor::Sweeper, Some("released"));
    assert_eq!(
        swept(&releasing(State::InProgress), Due::LeaseRanOut),
        Effect::of(Some(Swept::Released), vec![end(State::InProgress, by)])
    );
    let by = (Transition::Abandoned, &Actor::Sweeper, None);
    assert_eq!(
        swept(&open, Due::LandedAbandoned),
        Effect::of(Some(Swept::Abandoned), vec![end(State::InProgress, by)])
    );
    assert_eq!(
        swept(&loaded(State::Completed), Due::Expired),
        Effect::of(
            Some(Swept::Archived),
            vec![
                Write::Archive,
                event((Transition::Archived, &Actor::Sweeper, None))
            ]
        )
    );
    assert_eq!(sweep(None, Due::Expired, NOW), Effect::only(None));
    let mut report = SweepReport::default();
    for s in [
        Swept::Released,
        Swept::MarkedUnknown,
        Swept::Abandoned,
        Swept::Archived,
    ] {
        s.count(&mut report);
    }
    assert_eq!(report.total(), 4);
}

fn claiming(on_unknown: idemgate_core::config::OnUnknown) -> ClaimRequest {
    ClaimRequest {
        scope: scope(),
        fingerprint: None,
        lease_ms: 1_000,
        ttl_ms: 10_000,
        wait_ms: 0,
        after_expiry: idemgate_core::config::AfterExpiry::Reject,
        on_unknown,
        attempt: None,
        deadline_ms: 0,
        trace: Default::default(),
    }
}

#[test]
fn a_claim_takes_a_free_key_and_a_spent_lease_as_its_policy_says() {
    use idemgate_core::config::OnUnknown;
    let conflict = claiming(OnUnknown::Conflict);
    let claimed = (Transition::Claimed, &Actor::Filter, None);
    assert_eq!(
        claim(None, &conflict, NOW),
        ClaimEffect::Take {
            replaced: None,
            by: claimed
        }
    );
    assert!(claim(None, &conflict, NOW).writes());
    // The lease (until 2 000) ran out: turned unknown, or taken over.
    let open = loaded(State::InProgress);
    let unknown = ClaimEffect::Change(Effect::of(
        ClaimOutcome {
            reply: ClaimReply::Unknown,
            body: Vec::new(),
            became_unknown: true,
        },
        vec![
            Write::SetUnknown {
                read_with: (7, State::InProgress),
                expires_at: NOW + 10_000,
            },
            event((Transition::LeaseExpired, &Actor::Filter, Some("unknown"))),
        ],
    ));
    assert_eq!(claim(Some(&open), &conflict, NOW), unknown);
    assert_eq!(
        claim(Some(&open), &claiming(OnUnknown::Release), NOW),
        ClaimEffect::Take {
            replaced: Some(Replaced {
                ended: Standing::EndedBy(Transition::LeaseExpired),
                by: (Transition::LeaseExpired, &Actor::Filter, Some("released")),
            }),
            by: (Transition::Claimed, &Actor::Filter, None),
        }
    );
    // Inside the lease, and a completed record: answered, nothing written.
    let early = claim(Some(&open), &conflict, 1_500);
    assert_eq!(
        early,
        ClaimEffect::Answer(ClaimReply::InProgress { retry_after_ms: 500 })
    );
    assert!(!early.writes());
    let replay = claim(Some(&loaded(State::Completed)), &conflict, 20_000);
    assert_eq!(
        replay,
        ClaimEffect::Replay {
            status: 201,
            completed_at: 1_000
        }
    );
    assert!(!replay.writes());
}
