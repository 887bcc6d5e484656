//! `--scoring predicted`: the heuristic decides while the pool prior is cold,
//! a cold worker is predicted by the prior, and latency objectives place a
//! request on a worker predicted to meet them; whatever the learned models,
//! the pruned pick costs the least of every candidate.

use std::sync::Arc;
use std::time::Instant;

use proptest::prelude::*;

use super::{both, prompt, scrape, with_body};
use crate::endpoints::ActiveLoad;
use crate::latency::{Features, Learner, Observed, WorkerModel};
use crate::scheduler::*;

fn predicted() -> Scheduler {
    Scheduler::new(SchedulerConfig {
        scoring: ScoringMode::Predicted,
        tie_break_seed: Some(7),
        ..Default::default()
    })
}

/// A model with these coefficients, as if fitted on 100 observations.
fn fitted(ttft: [f64; 6], tpot: [f64; 4]) -> crate::latency::WorkerSnapshot {
    let mut s = WorkerModel::new(ttft, tpot, 1.0).to_snapshot();
    s.observations = 100;
    s
}

fn learner(s: &Scheduler) -> &Arc<Learner> {
    s.latency().expect("predicted mode learns latency")
}

#[test]
fn a_cold_pool_prior_leaves_the_pick_to_the_heuristic_and_counts_it() {
    let now = Instant::now();
    let loaded = || {
        let table = both(3);
        let snap = table.snapshot();
        scrape(&snap.endpoints[0], 4.0, 8.0, 0.9, now);
        scrape(&snap.endpoints[1], 0.0, 1.0, 0.1, now);
        scrape(&snap.endpoints[2], 1.0, 3.0, 0.5, now);
        table
    };
    let body = prompt(&"a".repeat(4096));
    let heuristic = Scheduler::new(SchedulerConfig {
        tie_break_seed: Some(7),
        ..Default::default()
    });
    let s = predicted();
    assert!(!learner(&s).is_warm());
    let (want, want_terms) = heuristic
        .pick_with_terms(&with_body(&body), &loaded().snapshot(), now)
        .unwrap();
    let (got, got_terms) = s
        .pick_with_terms(&with_body(&body), &loaded().snapshot(), now)
        .unwrap();
    assert_eq!(got.decode.key(), want.decode.key());
    assert!((got_terms.total() - want_terms.total()).abs() < 1e-9);
    assert!((got_terms.get("predicted") - want_terms.total()).abs() < 1e-9);
    assert_eq!(learner(&s).fallbacks(), 1);
    assert!(
        got.latency_features.is_none(),
        "not streamed: nothing to learn"
    );
}

#[test]
fn a_cold_worker_is_predicted_by_the_warm_pool_prior() {
    let s = predicted();
    let l = learner(&s);
    let table = both(2);
    let snap = table.snapshot();
    let (a, b) = (snap.endpoints[0].key(0), snap.endpoints[1].key(0));
    let f = Features {
        prompt_tokens: 2048,
        uncached_tokens: 2048,
        ..Features::default()
    };
    let seen = Observed::from_secs(0.4, Some(0.02)).unwrap();
    for _ in 0..40 {
        l.learn(a, &f, &seen);
    }
    assert!(l.is_warm());
    let slow = Observed::from_secs(2.0, Some(0.1)).unwrap();
    for _ in 0..5 {
        l.learn(b, &f, &slow);
    }
    assert_eq!(l.predict(&b, &f).unwrap().observations, 5);
    l.restore_prior(&fitted(
        [0.9, 0.0, 0.0, 0.0, 0.0, 0.0],
        [0.05, 0.0, 0.0, 0.0],
    ))
    .unwrap();
    let from_prior = l.predict(&b, &f).unwrap();
    assert!((from_prior.ttft - 0.9).abs() < 1e-9, "{from_prior:?}");
    let own = l.predict(&a, &f).unwrap();
    assert!((own.ttft - 0.4).abs() < 0.05, "{own:?}");
}

/// Worker 1 starts fast but slows the requests running there; worker 2 is
/// slow to start and idle.
fn slo_pool(s: &Scheduler) -> (crate::endpoints::EndpointTable, Instant) {
    let table = both(2);
    let snap = table.snapshot();
    let now = Instant::now();
    let l = learner(s);
    l.restore_prior(&fitted(
        [0.05, 0.1, 0.0, 0.0, 0.0, 0.0],
        [0.01, 0.0, 0.0, 0.0],
    ))
    .unwrap();
    let (fast, slow) = (snap.endpoints[0].key(0), snap.endpoints[1].key(0));
    l.restore(
        fast,
        &fitted([0.05, 0.05, 0.0, 0.0, 0.0, 0.0], [0.01, 0.001, 0.0, 0.0]),
    )
    .unwrap();
    l.restore(
        slow,
        &fitted([0.1, 0.2, 0.0, 0.0, 0.0, 0.0], [0.01, 0.001, 0.0, 0.0]),
    )
    .unwrap();
    scrape(&snap.endpoints[0], 0.0, 4.0, 0.2, now);
    scrape(&snap.endpoints[1], 0.0, 0.0, 0.0, now);
    (table, now)
}

#[test]
fn a_ttft_objective_places_the_request_on_a_worker_predicted_to_meet_it() {
    let s = predicted();
    let (table, now) = slo_pool(&s);
    let snap = table.snapshot();
    // 4,096 bytes: 1,024 tokens, none cached; 64 output tokens expected.
    let mut body = prompt(&"q".repeat(4096));
    body.nvext.agent_hints = Some(crate::request::AgentHints {
        osl: Some(64),
        ..Default::default()
    });
    let plain = s.explain(&with_body(&body), &snap, now).unwrap();
    let ttft = |e: &Explanation, i: usize| e.candidates[i].prediction.unwrap().ttft;
    assert!((ttft(&plain, 0) - 0.1).abs() < 1e-6);
    assert!((ttft(&plain, 1) - 0.3).abs() < 1e-6);
    assert!(
        plain.candidates[1].chosen,
        "without an objective the idle worker costs less"
    );
    let with_slo = PickRequest {
        slo: Slo {
            ttft: Some(0.2),
            tpot: None,
        },
        ..with_body(&body)
    };
    let d = s.pick_at(&with_slo, &snap, now).unwrap();
    assert_eq!(d.decode.key(), snap.endpoints[0].key(0));
}

#[test]
fn objectives_change_nothing_without_predictions() {
    let s = Scheduler::new(SchedulerConfig {
        tie_break_seed: Some(7),
        ..Default::default()
    });
    let table = both(2);
    let snap = table.snapshot();
    let now = Instant::now();
    scrape(&snap.endpoints[0], 0.0, 4.0, 0.2, now);
    scrape(&snap.endpoints[1], 0.0, 0.0, 0.0, now);
    let body = prompt(&"q".repeat(4096));
    let plain = s.explain(&with_body(&body), &snap, now).unwrap();
    let with_slo = PickRequest {
        slo: Slo {
            ttft: Some(0.001),
            tpot: Some(0.001),
        },
        ..with_body(&body)
    };
    let slo = s.explain(&with_slo, &snap, now).unwrap();
    assert_eq!(plain, slo);
    assert!(slo.candidates.iter().all(|c| c.prediction.is_none()));
}

/// A sheddable pick with a TTFT objective of `ttft` seconds.
fn sheddable_with(body: &crate::request::InferenceRequest, ttft: f64) -> PickRequest<'_> {
    PickRequest {
        slo: Slo {
            ttft: Some(ttft),
            tpot: None,
        },
        sheddable: true,
        ..with_body(body)
    }
}

#[test]
fn a_sheddable_request_no_warm_worker_can_serve_in_time_is_refused_and_counted() {
    let s = predicted();
    let (table, now) = slo_pool(&s);
    let snap = table.snapshot();
    // Predicted TTFT: 0.1 s on the fast worker, 0.3 s on the slow one.
    let body = prompt(&"q".repeat(4096));
    let late = sheddable_with(&body, 0.05);
    assert_eq!(
        s.pick_at(&late, &snap, now).unwrap_err(),
        PickError::SloUnreachable
    );
    assert_eq!(learner(&s).slo_sheds(), 1);
    for ep in &snap.endpoints {
        assert_eq!(
            ep.active_load(0).blocks,
            0,
            "a refused request books nothing"
        );
    }
    // One worker meets it: placed there.
    let met = s.pick_at(&sheddable_with(&body, 0.2), &snap, now).unwrap();
    assert_eq!(met.decode.key(), snap.endpoints[0].key(0));
    // Not sheddable: placed by headroom, on the least overshoot.
    let kept = PickRequest {
        sheddable: false,
        ..late
    };
    let d = s.pick_at(&kept, &snap, now).unwrap();
    assert_eq!(d.decode.key(), snap.endpoints[0].key(0));
    assert_eq!(learner(&s).slo_sheds(), 1);
}

#[test]
fn a_sheddable_request_is_not_refused_on_cold_models_or_without_predictions() {
    let now = Instant::now();
    let body = prompt(&"q".repeat(4096));
    // The pool prior is warm and predicts a miss, but no worker has a model
    // of its own: the cold workers get the benefit of the doubt.
    let s = predicted();
    learner(&s)
        .restore_prior(&fitted(
            [0.5, 0.0, 0.0, 0.0, 0.0, 0.0],
            [0.01, 0.0, 0.0, 0.0],
        ))
        .unwrap();
    let table = both(2);
    assert!(s
        .pick_at(&sheddable_with(&body, 0.05), &table.snapshot(), now)
        .is_ok());
    // The heuristic reads no objective.
    let heuristic = Scheduler::default();
    assert!(heuristic
        .pick_at(&sheddable_with(&body, 0.001), &both(2).snapshot(), now)
        .is_ok());
    assert_eq!(learner(&s).slo_sheds(), 0);
}

#[test]
fn the_expected_output_is_the_hint_else_the_output_cap_bounded() {
    let s = predicted();
    let (table, now) = slo_pool(&s);
    let streamed = |extra: &str| {
        let json = format!(
            r#"{{"model":"m","prompt":"{}","stream":true{extra}}}"#,
            "q".repeat(64)
        );
        crate::request::parse(json.as_bytes(), None).unwrap()
    };
    let features = |b: &crate::request::InferenceRequest| {
        let d = s.pick_at(&with_body(b), &table.snapshot(), now).unwrap();
        s.cancel_at(&d, now);
        d.latency_features.unwrap().max_tokens
    };
    assert_eq!(features(&streamed("")), None);
    assert_eq!(features(&streamed(r#","max_tokens":300"#)), Some(300));
    assert_eq!(
        features(&streamed(
            r#","max_tokens":300,"max_completion_tokens":200"#
        )),
        Some(200)
    );
    assert_eq!(
        features(&streamed(
            r#","max_tokens":300,"nvext":{"agent_hints":{"osl":50}}"#
        )),
        Some(50),
        "the hint estimates the output; the cap only bounds it"
    );
    assert_eq!(
        features(&streamed(r#","max_tokens":99999999999"#)),
        Some(crate::latency::features::MAX_OUTPUT_TOKENS)
    );
    for bad in [
        r#""max_tokens":-1"#,
        r#""max_tokens":1.5"#,
        r#""max_tokens":"9""#,
        r#""max_tokens":null"#,
        r#""max_tokens":0"#,
    ] {
        assert_eq!(features(&streamed(&format!(",{bad}"))), None, "{bad}");
    }
}

/// A learned coefficient: often exactly 0 (the fit's projection), else up to
/// 2, or tiny (costs a hair apart, so a bound a hair too high shows).
fn coefficient() -> impl Strategy<Value = f64> {
    prop_oneof![1 => Just(0.0), 2 => 0.0..2.0f64, 1 => 1e-7..1e-4f64]
}

/// A model's TTFT and decode coefficients.
fn coefficients() -> impl Strategy<Value = ([f64; 6], [f64; 4])> {
    (
        prop::array::uniform6(coefficient()),
        prop::array::uniform4(coefficient()),
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    /// Whatever the learned models (warm or predicted by the prior), the
    /// prefixes held, the load, the expected output and the TTFT objective,
    /// the pruned pick's decode target costs exactly the least `explain`
    /// finds by scoring every candidate: the predicted term's lower bound
    /// never exceeds a candidate's cost.
    #[test]
    fn a_predicted_pick_costs_the_least_of_every_candidate(
        prior in coefficients(),
        // Per worker: its model, whether that is warm (else the prior
        // predicts it), the prompt blocks it holds, its booked load, its scrape.
        members in prop::collection::vec(
            (coefficients(), prop::bool::weighted(0.7),
             prop_oneof![Just(0usize), Just(24), 1usize..=24],
             prop_oneof![Just(0u64), 1u64..40],
             prop::option::of((0.0..8.0f64, 0.0..8.0f64, 0.0..1.0f64))),
            1..48,
        ),
        // Every worker predicted by the prior: the bound is met exactly.
        all_cold in prop::bool::weighted(0.3),
        osl in prop::option::of(1u32..512),
        ttft_slo in prop::option::of(0.0..3.0f64),
    ) {
        let s = predicted();
        let l = learner(&s);
        l.restore_prior(&fitted(prior.0, prior.1)).unwrap();
        let table = both(members.len());
        let snap = table.snapshot();
        let now = Instant::now();
        let text: String = (0..24).map(|i| format!("{i:>63} ")).collect();
        let mut body = prompt(&text);
        body.nvext.agent_hints = osl.map(|osl| crate::request::AgentHints {
            osl: Some(osl),
            ..Default::default()
        });
        let hashes = s.block_hashes(&body);
        for (ep, m) in snap.endpoints.iter().zip(&members) {
            let ((ttft, tpot), warm, held, load, scraped) = m;
            let key = ep.key(0);
            let mut model = fitted(*ttft, *tpot);
            if !warm || all_cold {
                model.observations = 5;
            }
            l.restore(key, &model).unwrap();
            ep.book(0, ActiveLoad { blocks: *load, uncached: load / 2 });
            if *held > 0 {
                s.index().insert(key, &hashes[..(*held).min(hashes.len())], now);
            }
            if let Some((queue, running, kv_usage)) = scraped {
                scrape(ep, *queue, *running, *kv_usage, now);
            }
        }
        let req = PickRequest {
            slo: Slo { ttft: ttft_slo, tpot: None },
            ..with_body(&body)
        };
        let explained = s.explain(&req, &snap, now).unwrap();
        let least = explained
            .candidates
            .iter()
            .filter(|c| !c.prefill && c.filtered_out.is_none())
            .map(|c| c.terms.total())
            .min_by(f64::total_cmp)
            .unwrap();
        let d = s.pick_at(&req, &snap, now).unwrap();
        let chosen = explained
            .candidates
            .iter()
            .find(|c| !c.prefill && c.key == d.decode.key())
            .map(|c| c.terms.total());
        prop_assert!(
            chosen.is_some_and(|c| (c - least).abs() < 1e-9),
            "decode {} costs {chosen:?}, least {least}", d.decode.key()
        );
    }
}
