//! The scenarios that found a defect, each as it was found (shrunk by
//! proptest then, for the older ones, or the first scenario that found it),
//! with the audit's message then: every one must keep the contract now.
//! They are written out whole, so no change to how scenarios are drawn can
//! lose one.

use crate::database::loss::Loss;
use crate::scenario::{Budget, Faults, Knobs, Scenario, LEASE_MS, STORE_TIMEOUT_MS};

/// Each scenario, and what it found.
pub fn all() -> Vec<(&'static str, Scenario)> {
    vec![
        (
            "an abandon that met another attempt's record was answered Stale, not remembered: \
             \"generation 3 (a9) left unknown although nothing ran\"",
            Scenario {
                seed: 11677308965170384489,
                knobs: Knobs {
                    wait: true,
                    ..Knobs::default()
                },
                faults: Faults {
                    slow_store: 0.16019714306785743,
                    client_leaves: 0.509111318517555,
                    ..Faults::default()
                },
            },
        ),
        (
            "a settlement the store did not confirm was delivered again only under detached forwarding: \
             \"request 0 was answered 201 but its record ended Some(Open(Unknown))\"",
            Scenario {
                seed: 6647208780346167831,
                knobs: Knobs::default(),
                faults: Faults {
                    lose_request: 0.23539680638948673,
                    lose_answer: 0.17928971426804682,
                    ..Faults::default()
                },
            },
        ),
        (
            "on_unknown: release claimed an unknown record before its lease ran out: \
             \"key 0 executed twice at once: [(1533, 2329), (1750, 2395)]\"",
            Scenario {
                seed: 4313009321090419075,
                knobs: Knobs {
                    release_unknown: true,
                    ..Knobs::default()
                },
                faults: Faults {
                    lose_request: 0.10731281464555895,
                    unavailable: 0.1415769914827623,
                    client_leaves: 0.5558709478861736,
                    ..Faults::default()
                },
            },
        ),
        (
            "batches were bounded by count only and a batch refused as a whole gave each call the refusal: \
             \"request 3 was answered 201 but its record ended Some(Open(Unknown))\"",
            Scenario {
                seed: 4624141762910672308,
                knobs: Knobs {
                    large: true,
                    ..Knobs::default()
                },
                faults: Faults {
                    slow_store: 0.29976967320157266,
                    client_leaves: 0.3943148068209927,
                    ..Faults::default()
                },
            },
        ),
        (
            "an archived record replayed (empty) to a store whose clock stepped back before its expiry: \
             \"request 7 replayed 201 \\\"\\\" that no execution answered\"",
            Scenario {
                seed: 6848658540805981320,
                knobs: Knobs {
                    wait: true,
                    short_ttl: true,
                    ..Knobs::default()
                },
                faults: Faults {
                    clock_steps_back_ms: 1831,
                    ..Faults::default()
                },
            },
        ),
        (
            "a late completion of an unknown record that had expired meanwhile was refused: \
             \"request 1 was answered 500 but its record ended Some(Open(Unknown))\"",
            Scenario {
                seed: 1492343373279252586,
                knobs: Knobs {
                    background: true,
                    wait: true,
                    short_ttl: true,
                    ..Knobs::default()
                },
                faults: Faults {
                    lose_request: 0.18054314547755326,
                    unavailable: 0.17099396947747386,
                    slow_store: 0.009153431357824302,
                    client_leaves: 0.2236011369196434,
                    store_restarts: true,
                    ..Faults::default()
                },
            },
        ),
        (
            "an abandon that arrived after its unknown record expired was refused: \
             \"generation 3 (a5) left unknown although nothing ran\"",
            Scenario {
                seed: 17246023906521361570,
                knobs: Knobs {
                    short_ttl: true,
                    ..Knobs::default()
                },
                faults: Faults {
                    lose_request: 0.12204999271475284,
                    lose_answer: 0.18147918412355493,
                    unavailable: 0.22633072813917746,
                    client_leaves: 0.23015441658910116,
                    upstream_lost: 0.055589340435310636,
                    ..Faults::default()
                },
            },
        ),
        (
            "the worker's queue took every call while the store was slow but alive: \
             \"a worker's queue outgrew its bound at 32 ms: 172 calls\"",
            Scenario {
                seed: 1,
                knobs: Knobs {
                    flood: true,
                    ..Knobs::default()
                },
                faults: Faults::default(),
            },
        ),
        (
            "a detached timeout only had to be shorter than the lease, so the upstream outlived it and a \
             retry ran alongside: \"key 2 executed twice at once: [(692, 2773), (2699, 3751)]\" (found at \
             1,990 ms, which the policy now refuses; kept at the longest it takes)",
            Scenario {
                seed: 121,
                knobs: Knobs {
                    detached: true,
                    release_unknown: true,
                    detached_timeout_ms: LEASE_MS - STORE_TIMEOUT_MS,
                    ..Knobs::default()
                },
                faults: Faults::default(),
            },
        ),
        (
            "a settlement answered 408, 413 or 429 by something in front of the store ended as if the store \
             had decided it: \"request 2 was answered 201 but its record ended Some(Open(Unknown))\"",
            Scenario {
                seed: 7397736452244787137,
                knobs: Knobs {
                    short_ttl: true,
                    ..Knobs::default()
                },
                faults: Faults {
                    upstream_lost: 0.014586472137040942,
                    in_front: 0.245591425783675,
                    ..Faults::default()
                },
            },
        ),
        (
            "a generation a new claim replaced moved to the history with no event of its own (the reclaimed \
             event was written on the new one only): \"key-0: generation 1 (claimed by filter, marked_unknown \
             by filter): ended at 1800000002170 (unknown) with no event of its own that ended it; its events \
             leave it unknown\" (the fixed set's case 30 then)",
            Scenario {
                seed: 3763540056071146022,
                knobs: Knobs {
                    wait: true,
                    release_unknown: true,
                    detached_timeout_ms: LEASE_MS - STORE_TIMEOUT_MS,
                    ..Knobs::default()
                },
                faults: Faults {
                    lose_request: 0.02656417277364559,
                    slow_store: 0.1409276482698995,
                    client_leaves: 0.2534302029602302,
                    in_front: 0.07436480156753005,
                    ..Faults::default()
                },
            },
        ),
        (
            "a claim over its tenant's budget of new keys that met a lease that ran out was refused 429 \
             although it takes no key, leaving the record in progress and lease_expired unwritten: \"a claim \
             of key-1 was refused 429 key-rate-limited at 1800000002697, but it takes no key: its record, \
             generation 1 (in_progress, lease until 1800000002597, expires None, archived false, on_unknown \
             Conflict), answers it 409 outcome-unknown (its lease ran out: the claim turns it unknown)\" \
             (Scenario::nth(7, 14314) then)",
            Scenario {
                seed: 16959245281999491012,
                knobs: Knobs {
                    detached: true,
                    background: true,
                    new_keys: Some(Budget {
                        per_second: 2.0,
                        burst: 1,
                    }),
                    sweep_every_ms: 5_000,
                    ..Knobs::default()
                },
                faults: Faults {
                    slow_store: 0.18882376377108248,
                    client_leaves: 0.016935770274108863,
                    in_front: 0.047047664599952264,
                    ..Faults::default()
                },
            },
        ),
        (
            "an abandon that ended its attempt's record was not remembered, so a copy of that claim delivered \
             again took the key for nobody: \"generation 2 (a1) left unknown although nothing ran\" (the fixed \
             set's case 89 then)",
            Scenario {
                seed: 8653445626227465420,
                knobs: Knobs {
                    detached: true,
                    wait: true,
                    short_ttl: true,
                    ..Knobs::default()
                },
                faults: Faults {
                    lose_answer: 0.14470963323789307,
                    client_leaves: 0.3768048456259692,
                    duplicate: 0.2776719540108471,
                    duplicate_claims: 0.2776719540108471,
                    slow_database: 0.242393979411821,
                    ..Faults::default()
                },
            },
        ),
        (
            "a waiting claim the database committed later than the filter's store timeout after the look \
             that decided it left the upstream less than its timeout of the lease: \"key 0 executed twice at \
             once: [(7355, 9171), (9072, 10400)]\" (Scenario::nth(7, 9631) then)",
            Scenario {
                seed: 12258956582869190189,
                knobs: Knobs {
                    detached: true,
                    background: true,
                    wait: true,
                    release_unknown: true,
                    short_ttl: true,
                    detached_timeout_ms: LEASE_MS - STORE_TIMEOUT_MS,
                    new_keys: Some(Budget {
                        per_second: 2.0,
                        burst: 2,
                    }),
                    sweep_every_ms: 1_000,
                    ..Knobs::default()
                },
                faults: Faults {
                    lose_answer: 0.013358028284708556,
                    client_leaves: 0.2177544166866791,
                    clock_steps_back_ms: 3923,
                    slow_database: 0.2789786381749334,
                    ..Faults::default()
                },
            },
        ),
        (
            "a copy of a claim (delivered twice) that the store decided after the copy that took the key, \
             a slow database holding the first, was answered in_progress to the attempt that held the key; \
             its filter read that answer first and the key was left to nobody: \"generation 1 (a7) left \
             unknown although nothing ran\" (explore --seed 1796447230705720329 --case 274 then)",
            Scenario {
                seed: 16949003378856616254,
                knobs: Knobs {
                    detached: true,
                    background: true,
                    detached_timeout_ms: LEASE_MS - STORE_TIMEOUT_MS,
                    sweep_every_ms: 1_000,
                    ..Knobs::default()
                },
                faults: Faults {
                    lose_request: 0.016585385612243975,
                    unavailable: 0.1962820363954352,
                    client_leaves: 0.1043643780926595,
                    clock_steps_back_ms: 1083,
                    duplicate_claims: 0.10665910248392438,
                    slow_database: 0.09668033503697071,
                    ..Faults::default()
                },
            },
        ),
        (
            "an upstream that answered just inside detached forwarding's timeout (the lease less one store \
             call) after a claim whose answer took most of a store call to come back: its completion, queued \
             behind the worker's callout in flight, reached the store after the lease ran out, and under \
             on_unknown: release a retry ran the payment again: \"a4's upstream answered 201 after 1757 ms \
             (from 866 to 2623 ms), but its record ended Some(\"lease_expired\")\" (explore --seed 501852133 \
             --case 886)",
            Scenario {
                seed: 11157518478986342079,
                knobs: Knobs {
                    detached: true,
                    background: true,
                    wait: true,
                    release_unknown: true,
                    detached_timeout_ms: LEASE_MS - STORE_TIMEOUT_MS,
                    edge: true,
                    ..Knobs::default()
                },
                faults: Faults {
                    client_leaves: 0.5285491820518439,
                    ..Faults::default()
                },
            },
        ),
        (
            "a copy of a claim (delivered twice by something in front of the store) that landed after its \
             attempt had released the key (Envoy refused to reach the upstream) took the key for nobody: the \
             store remembered abandoned attempts, not released ones, and under on_unknown: conflict the key \
             was left unknown: \"generation 4 (a9) left unknown although nothing ran\" (explore --seed \
             501852133 --case 439)",
            Scenario {
                seed: 8568833797781220605,
                knobs: Knobs {
                    detached: true,
                    sweep_every_ms: 5_000,
                    ..Knobs::default()
                },
                faults: Faults {
                    lose_request: 0.1843170349416334,
                    lose_answer: 0.29708885925186734,
                    unavailable: 0.023497951643603642,
                    slow_store: 0.016614435410107396,
                    client_leaves: 0.34985312836876453,
                    clock_steps_back_ms: 2965,
                    never_reached: 0.14279395905233347,
                    in_front: 0.06849769483424063,
                    duplicate_claims: 0.1640087119288814,
                    ..Faults::default()
                },
            },
        ),
        (
            "fences drawn again after a restore from a backup (the fence counter went back with the \
             database; fences now move up to the database's clock when it opens): a late completion of a \
             generation the restore lost landed on the generation claimed after it under the same fence: \
             \"a0 never reached the upstream, but its record ended Some(\\\"completed\\\")\"",
            Scenario {
                seed: 17161135160639065978,
                knobs: Knobs {
                    detached: true,
                    background: true,
                    wait: true,
                    detached_timeout_ms: 1800,
                    new_keys: Some(Budget {
                        per_second: 0.5,
                        burst: 2,
                    }),
                    fail_open: true,
                    push: true,
                    ..Knobs::default()
                },
                faults: Faults {
                    lose_request: 0.20792082749272853,
                    client_leaves: 0.3404428310361882,
                    upstream_lost: 0.1847201807648539,
                    clock_steps_back_ms: 3960,
                    store_restarts: true,
                    database_lost: Some(Loss::Backup(2603)),
                    replica_skew_ms: Some(0),
                    never_reached: 0.21295643104987472,
                    in_front: 0.0635044008914772,
                    ..Faults::default()
                },
            },
        ),
        (
            "fences drawn again after a restore from a backup (as above): a completion of the other body \
             landed on the generation claimed after the restore under the same fence, and was replayed: \
             \"request 1 replayed 201 \\\"scope-0#0:..............\\\" that no execution answered\"",
            Scenario {
                seed: 8116083759224152380,
                knobs: Knobs {
                    detached: true,
                    after_expiry_new: true,
                    fail_open: true,
                    ..Knobs::default()
                },
                faults: Faults {
                    lose_request: 0.1790922207239999,
                    lose_answer: 0.1880365612468852,
                    slow_store: 0.09841360522196238,
                    client_leaves: 0.3532018814637866,
                    upstream_lost: 0.2610056242341724,
                    store_restarts: true,
                    database_lost: Some(Loss::Backup(1675)),
                    mismatch: 0.2686168516328702,
                    duplicate_claims: 0.05393965957024677,
                    slow_database: 0.15986594748000607,
                    ..Faults::default()
                },
            },
        ),
        (
            "an audit gap, not a defect: a release of a claim whose client left before forwarding, held up by \
             lost calls for 25 s while the lease ran out and the unknown record expired and was replaced \
             under after_expiry: new (before the sweeper archived it), was not excused where one replaced \
             after archiving was: \"a4 never reached the upstream, but its record ended Some(\\\"unknown\\\")\" \
             (explore --seed 1796688534767718903 --case 125975)",
            Scenario {
                seed: 16667318660783751227,
                knobs: Knobs {
                    detached: true,
                    short_ttl: true,
                    new_keys: Some(Budget {
                        per_second: 1.0,
                        burst: 4,
                    }),
                    sweep_every_ms: 5_000,
                    after_expiry_new: true,
                    tenants: false,
                    canary: true,
                    ..Knobs::default()
                },
                faults: Faults {
                    lose_request: 0.15726061797428514,
                    lose_answer: 0.26720307039528557,
                    client_leaves: 0.2951223758703604,
                    upstream_lost: 0.19254391955871986,
                    never_reached: 0.09010135394224805,
                    in_front: 0.15362552216250253,
                    ..Faults::default()
                },
            },
        ),
    ]
}
