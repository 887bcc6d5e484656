//! The latency models against synthetic workers whose true timing is a known
//! physical model with noise.

use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::*;

/// A simulated worker: the true per-unit costs, scaled by `slowness`.
struct TrueWorker {
    slowness: f64,
}

impl TrueWorker {
    fn ttft(&self, f: &Features) -> f64 {
        let k = |t: u64| t as f64 / 1024.0;
        self.slowness
            * (0.015
                + 0.06 * k(f.uncached_tokens)
                + 0.06 * k(f.pending_prefill_tokens)
                + 0.03 * f.waiting
                + 0.0005 * f.running.max(f.in_flight as f64))
    }

    fn tpot(&self, f: &Features) -> f64 {
        self.slowness
            * (0.008
                + 0.00015 * f.running.max(f.in_flight as f64)
                + 0.004 * f.kv_usage
                + 0.0005 * f.prompt_tokens as f64 / 1024.0)
    }

    /// One request's features and its noisy observed times (±10%).
    fn sample(&self, rng: &mut StdRng) -> (Features, Observed) {
        let prompt_tokens = rng.random_range(64..8192);
        let running = rng.random_range(0..48) as f64;
        let f = Features {
            prompt_tokens,
            uncached_tokens: (prompt_tokens as f64 * rng.random_range(0.0..1.0)) as u64,
            waiting: rng.random_range(0..6) as f64,
            running,
            kv_usage: rng.random_range(0.0..1.0),
            pending_prefill_tokens: rng.random_range(0..16_384),
            in_flight: rng.random_range(0..=running as u32),
            max_tokens: Some(256),
        };
        let mut noise = || 1.0 + rng.random_range(-0.1..0.1);
        let seen = Observed::from_secs(self.ttft(&f) * noise(), Some(self.tpot(&f) * noise()))
            .expect("positive times");
        (f, seen)
    }
}

const FAST: TrueWorker = TrueWorker { slowness: 1.0 };
const SLOW: TrueWorker = TrueWorker { slowness: 2.5 };

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Trains workers 1 (fast) and 2 (slow) on `n` requests each, interleaved.
fn trained(n: usize, rng: &mut StdRng) -> LatencyModels<u64> {
    let mut m = LatencyModels::new(LatencyConfig::default());
    for _ in 0..n {
        for (id, w) in [(1, &FAST), (2, &SLOW)] {
            let (f, seen) = w.sample(rng);
            m.observe(id, &f, &seen).unwrap();
        }
    }
    m
}

/// Median |predicted − actual| / actual over fresh noiseless requests.
fn median_errors(m: &LatencyModels<u64>, id: u64, w: &TrueWorker, rng: &mut StdRng) -> (f64, f64) {
    let (mut ttft, mut tpot) = (Vec::new(), Vec::new());
    for _ in 0..300 {
        let (f, _) = w.sample(rng);
        let p = m.predict(&id, &f);
        ttft.push((p.ttft - w.ttft(&f)).abs() / w.ttft(&f));
        tpot.push((p.tpot - w.tpot(&f)).abs() / w.tpot(&f));
    }
    (median(ttft), median(tpot))
}

#[test]
fn learns_two_workers_different_speeds() {
    let mut rng = StdRng::seed_from_u64(7);
    let m = trained(300, &mut rng);
    for (id, w) in [(1, &FAST), (2, &SLOW)] {
        let (ttft, tpot) = median_errors(&m, id, w, &mut rng);
        assert!(ttft <= 0.15, "worker {id}: median TTFT error {ttft:.3}");
        assert!(tpot <= 0.15, "worker {id}: median TPOT error {tpot:.3}");
        assert!(m.is_warm(&id));
    }
    // The coefficients read as the physical costs.
    let prefill = |id| m.worker(&id).unwrap().ttft_coefficients()[1];
    assert!(
        (prefill(1) - 0.06).abs() < 0.015,
        "fast prefill {}",
        prefill(1)
    );
    assert!(
        (prefill(2) - 0.15).abs() < 0.035,
        "slow prefill {}",
        prefill(2)
    );
    let (f, _) = FAST.sample(&mut rng);
    let (a, b) = (m.predict(&1, &f), m.predict(&2, &f));
    assert!(
        b.ttft > 2.0 * a.ttft && b.tpot > 2.0 * a.tpot,
        "{a:?} vs {b:?}"
    );
    assert!(a.recent_error < 0.15, "recent error {}", a.recent_error);
}

#[test]
fn a_new_worker_predicts_from_the_pool_prior() {
    let mut rng = StdRng::seed_from_u64(11);
    let mut m = trained(300, &mut rng);
    let (f, seen) = FAST.sample(&mut rng);
    let cold = m.predict(&3, &f);
    assert_eq!(cold.observations, 0);
    assert!(!m.is_warm(&3));
    assert_eq!(cold.ttft, m.prior().predict(&f).ttft);
    // The prior learned from both workers: between the fast and the slow one.
    let (fast, slow) = (FAST.ttft(&f), SLOW.ttft(&f));
    assert!(
        cold.ttft > fast && cold.ttft < slow,
        "prior {} not within [{fast}, {slow}]",
        cold.ttft
    );
    // Its coefficients are the pool's mean costs (1.75× the fast worker's).
    assert_eq!(m.prior().observations(), 600);
    let waiting = m.prior().ttft_coefficients()[3];
    assert!(
        (waiting - 0.0525).abs() < 0.015,
        "prior wait per request {waiting}"
    );
    // Its first observation starts its own model from the prior.
    m.observe(3, &f, &seen).unwrap();
    assert_eq!(m.observations(&3), 1);
    let (g, _) = FAST.sample(&mut rng);
    let own = m.predict(&3, &g).ttft;
    let prior = m.prior().predict(&g).ttft;
    assert!(
        (own - prior).abs() / prior < 0.5,
        "own {own}, prior {prior}"
    );
}

#[test]
fn cold_workers_are_not_warm_until_enough_observations() {
    let mut rng = StdRng::seed_from_u64(3);
    let mut m = LatencyModels::new(LatencyConfig {
        warm_observations: 5,
        ..LatencyConfig::default()
    });
    for i in 0..5 {
        assert!(!m.is_warm(&9), "warm after {i}");
        let (f, seen) = FAST.sample(&mut rng);
        m.observe(9, &f, &seen).unwrap();
    }
    assert!(m.is_warm(&9));
}

#[test]
fn state_stays_bounded_under_a_flood_of_workers() {
    let mut rng = StdRng::seed_from_u64(5);
    let mut m = LatencyModels::new(LatencyConfig {
        max_workers: 64,
        ..LatencyConfig::default()
    });
    for id in 0..20_000u64 {
        let (f, seen) = FAST.sample(&mut rng);
        m.observe(id, &f, &seen).unwrap();
        assert!(m.len() <= 64);
    }
    assert_eq!(m.len(), 64);
    assert!(m.worker(&19_999).is_some(), "the newest stays");
    assert!(m.worker(&0).is_none(), "the oldest went");
    m.retain(|id| id % 2 == 0);
    assert_eq!(m.len(), 32);
    assert!(m.worker(&19_999).is_none());
}

#[test]
fn absurd_observations_are_refused_and_change_nothing() {
    let mut rng = StdRng::seed_from_u64(13);
    let mut m = trained(100, &mut rng);
    let (good, seen) = FAST.sample(&mut rng);
    let before = (m.snapshot(&1), m.prior_snapshot(), m.len());
    let bad_features = [
        Features {
            prompt_tokens: 0,
            uncached_tokens: 0,
            ..good
        },
        Features {
            uncached_tokens: good.prompt_tokens + 1,
            ..good
        },
        Features {
            kv_usage: f64::NAN,
            ..good
        },
        Features {
            kv_usage: 1.5,
            ..good
        },
        Features {
            running: -1.0,
            ..good
        },
        Features {
            waiting: f64::INFINITY,
            ..good
        },
        Features {
            prompt_tokens: u64::MAX,
            uncached_tokens: u64::MAX,
            ..good
        },
    ];
    for f in &bad_features {
        assert!(m.observe(1, f, &seen).is_err(), "accepted {f:?}");
        assert!(m.observe(77, f, &seen).is_err(), "accepted {f:?}");
    }
    let bad_times = [
        Observed {
            ttft: Duration::ZERO,
            tpot: None,
        },
        Observed {
            ttft: Duration::from_secs(100_000),
            tpot: None,
        },
        Observed {
            ttft: seen.ttft,
            tpot: Some(Duration::ZERO),
        },
        Observed {
            ttft: seen.ttft,
            tpot: Some(Duration::from_secs(3600)),
        },
    ];
    for t in &bad_times {
        assert!(m.observe(1, &good, t).is_err(), "accepted {t:?}");
    }
    assert_eq!(Observed::from_secs(-0.5, None), None);
    assert_eq!(Observed::from_secs(f64::NAN, None), None);
    assert_eq!(Observed::from_secs(0.1, Some(f64::INFINITY)), None);
    assert_eq!((m.snapshot(&1), m.prior_snapshot(), m.len()), before);
    // Bad figures at prediction time give finite predictions.
    let p = m.predict(
        &1,
        &Features {
            waiting: f64::NAN,
            running: f64::NEG_INFINITY,
            kv_usage: f64::INFINITY,
            ..good
        },
    );
    assert!(p.ttft.is_finite() && p.tpot.is_finite() && p.ttft > 0.0);
    // The model still predicts as well as before.
    let (ttft, _) = median_errors(&m, 1, &FAST, &mut rng);
    assert!(ttft <= 0.15, "median TTFT error {ttft:.3}");
}

/// A worker that runs at most [`SLOTS`] requests at once, each for
/// [`DECODE_SECS`]: a request that finds every slot taken waits for
/// `DECODE_SECS / SLOTS` per request ahead of it beyond the slots.
const SLOTS: f64 = 16.0;
const DECODE_SECS: f64 = 8.0;

fn slotted_ttft(f: &Features) -> f64 {
    let k = |t: u64| t as f64 / 1024.0;
    let beyond = (f.running + f.waiting + 1.0 - SLOTS).max(0.0);
    0.02 + 0.08 * k(f.uncached_tokens) + beyond * DECODE_SECS / SLOTS
}

/// A request on the slotted worker: a queue only once every slot is taken.
fn slotted_sample(rng: &mut StdRng) -> (Features, Observed) {
    let prompt_tokens = rng.random_range(256..4096);
    let running = rng.random_range(8..=SLOTS as u32) as f64;
    let waiting = match running >= SLOTS {
        true => rng.random_range(0..6) as f64,
        false => 0.0,
    };
    let f = Features {
        prompt_tokens,
        uncached_tokens: (prompt_tokens as f64 * rng.random_range(0.2..1.0)) as u64,
        waiting,
        running,
        in_flight: (running + waiting) as u32,
        ..Features::default()
    };
    let seen = Observed::from_secs(slotted_ttft(&f) * (1.0 + rng.random_range(-0.1..0.1)), None)
        .expect("positive times");
    (f, seen)
}

#[test]
fn a_worker_with_every_slot_taken_is_predicted_to_make_a_new_request_wait() {
    let mut rng = StdRng::seed_from_u64(23);
    let mut m = LatencyModels::new(LatencyConfig::default());
    for _ in 0..400 {
        let (f, seen) = slotted_sample(&mut rng);
        m.observe(1, &f, &seen).unwrap();
    }
    // The capacity is the running count a queue formed beside.
    assert_eq!(m.worker(&1).unwrap().slots(), SLOTS);
    // One slot free against none (no queue yet on either): the second waits
    // for a running request to finish, half a second here.
    let free = Features {
        prompt_tokens: 2048,
        uncached_tokens: 2048,
        running: SLOTS - 1.0,
        in_flight: SLOTS as u32 - 1,
        ..Features::default()
    };
    let full = Features {
        running: SLOTS,
        in_flight: SLOTS as u32,
        ..free
    };
    let (a, b) = (m.predict(&1, &free).ttft, m.predict(&1, &full).ttft);
    for (f, p) in [(&free, a), (&full, b)] {
        let want = slotted_ttft(f);
        assert!((p - want).abs() / want < 0.15, "{p} against {want}");
    }
    assert!(b - a > 0.4, "free slot {a} s, none {b} s");
    // And the fit's median error over the worker's traffic.
    let errors = (0..300)
        .map(|_| {
            let (f, _) = slotted_sample(&mut rng);
            (m.predict(&1, &f).ttft - slotted_ttft(&f)).abs() / slotted_ttft(&f)
        })
        .collect();
    assert!(median(errors) <= 0.1);
}

/// A 4k-token prompt, half of it cached, at a worker with every slot taken and
/// four requests waiting.
fn full_worker() -> Features {
    Features {
        prompt_tokens: 4096,
        uncached_tokens: 2048,
        waiting: 4.0,
        running: SLOTS,
        in_flight: SLOTS as u32 + 4,
        ..Features::default()
    }
}

#[test]
fn delay_added_to_others_is_the_prefill_at_the_pool_rate_as_the_slots_fill() {
    let mut rng = StdRng::seed_from_u64(17);
    let mut m = trained(300, &mut rng);
    for _ in 0..300 {
        let (f, seen) = slotted_sample(&mut rng);
        m.observe(3, &f, &seen).unwrap();
    }
    let full = full_worker();
    // 2 kilotokens at the pool's learned prefill rate, once per slot at a
    // full worker.
    let rate = m.prior().prefill_rate();
    assert!(rate > 0.0);
    let p = m.predict(&3, &full);
    let expected = rate * 2.0 * SLOTS;
    assert!(
        (p.queued_delay - expected).abs() <= 1e-9 * expected,
        "{} vs {expected}",
        p.queued_delay
    );
    // With half the slots taken (this request included) a quarter of that
    // per request there.
    let half = Features {
        waiting: 0.0,
        running: SLOTS / 2.0 - 1.0,
        in_flight: SLOTS as u32 / 2 - 1,
        ..full
    };
    let h = m.predict(&3, &half).queued_delay;
    let expected = rate * 2.0 * (SLOTS / 2.0 - 1.0) * 0.25;
    assert!((h - expected).abs() <= 1e-9 * expected, "{h} vs {expected}");
    // An idle worker is delayed nothing.
    let idle = Features {
        running: 0.0,
        in_flight: 0,
        ..half
    };
    assert_eq!(m.predict(&3, &idle).queued_delay, 0.0);
    assert!(p.decode_slowdown > 0.0);
    assert!(
        p.e2e(&Features {
            max_tokens: Some(100),
            ..full
        }) > Some(p.ttft)
    );
}

#[test]
fn a_queue_beyond_the_slots_is_priced_in_the_wait_not_as_delay_added_to_it() {
    let mut rng = StdRng::seed_from_u64(23);
    let mut m = LatencyModels::<u64>::new(LatencyConfig::default());
    for _ in 0..300 {
        let (f, seen) = slotted_sample(&mut rng);
        m.observe(3, &f, &seen).unwrap();
    }
    assert_eq!(m.worker(&3).map(WorkerModel::slots), Some(SLOTS));
    assert_eq!(m.prior().slots(), SLOTS);
    let full = full_worker();
    let deep = Features {
        waiting: 400.0,
        in_flight: SLOTS as u32 + 400,
        ..full
    };
    // A prefill there holds the requests in the slots beside it; the 400
    // queued beyond them are admitted as the ones ahead of them leave,
    // whatever it costs. Their wait is this request's own.
    let expected = m.prior().prefill_rate() * 2.0 * SLOTS;
    let close = |a: f64| (a - expected).abs() <= 1e-9 * expected;
    let (at_full, at_deep) = (m.predict(&3, &full), m.predict(&3, &deep));
    assert!(close(at_full.queued_delay), "{}", at_full.queued_delay);
    assert!(close(at_deep.queued_delay), "{}", at_deep.queued_delay);
    assert!(
        at_deep.ttft > at_full.ttft + 100.0,
        "{} s behind 400 queued, {} s behind 4",
        at_deep.ttft,
        at_full.ttft
    );
    // A worker never seen at its limit counts the requests it stalls at
    // the pool's capacity, as its peers do, not as none.
    for _ in 0..40 {
        let (f, _) = slotted_sample(&mut rng);
        let f = Features {
            running: 8.0,
            waiting: 0.0,
            in_flight: 8,
            ..f
        };
        let seen = Observed::from_secs(slotted_ttft(&f), None).unwrap();
        m.observe(4, &f, &seen).unwrap();
    }
    assert_eq!(m.worker(&4).map(WorkerModel::slots), Some(0.0));
    let unknown = m.predict(&4, &full).queued_delay;
    let expected = m.prior().prefill_rate() * 2.0 * SLOTS;
    assert!(
        (unknown - expected).abs() <= 1e-9 * expected,
        "{unknown} vs {expected}"
    );
}

#[test]
fn snapshots_carry_a_model_to_another_replica() {
    let mut rng = StdRng::seed_from_u64(19);
    let warm = trained(200, &mut rng);
    let mut cold = LatencyModels::<u64>::new(LatencyConfig::default());
    let wire = serde_json::to_string(&warm.snapshot(&2).unwrap()).unwrap();
    let snap: WorkerSnapshot = serde_json::from_str(&wire).unwrap();
    cold.restore(2, &snap).unwrap();
    cold.restore_prior(&warm.prior_snapshot()).unwrap();
    let (f, _) = SLOW.sample(&mut rng);
    // JSON carries each float to within an ulp.
    let same = |a: Prediction, b: Prediction| {
        let close = |x: f64, y: f64| (x - y).abs() <= 1e-12 * y.abs().max(1e-9);
        close(a.ttft, b.ttft)
            && close(a.tpot, b.tpot)
            && close(a.queued_delay, b.queued_delay)
            && close(a.decode_slowdown, b.decode_slowdown)
            && a.observations == b.observations
    };
    assert!(same(cold.predict(&2, &f), warm.predict(&2, &f)));
    assert!(cold.is_warm(&2));
    assert!(same(cold.prior().predict(&f), warm.prior().predict(&f)));
    // A malformed or smaller snapshot changes nothing.
    let mut bad = snap.clone();
    bad.ttft.p[1] = f64::NAN;
    assert_eq!(cold.restore(2, &bad), Err(Rejected::Malformed));
    assert_eq!(cold.restore(5, &bad), Err(Rejected::Malformed));
    let fewer = warm.snapshot(&1).map(|s| WorkerSnapshot {
        observations: 1,
        ..s
    });
    cold.restore(2, &fewer.unwrap()).unwrap();
    assert!(same(cold.predict(&2, &f), warm.predict(&2, &f)));
    assert_eq!(cold.len(), 1);
}

#[test]
fn a_timeline_yields_ttft_and_the_pace_of_later_chunks() {
    let t0 = Instant::now();
    let ms = |n| t0 + Duration::from_millis(n);
    let mut t = Timeline::new(t0);
    assert_eq!(t.finish(Ended::Status(200)), None, "no body yet");
    t.chunk(ms(5), 0);
    t.chunk(ms(40), 120);
    for i in 1..=10 {
        t.chunk(ms(40 + 10 * i), 80);
    }
    let seen = t.finish(Ended::Status(200)).unwrap();
    assert_eq!(seen.ttft, Duration::from_millis(40));
    assert_eq!(seen.tpot, Some(Duration::from_millis(10)));
    assert_eq!(t.finish(Ended::Cancelled), Some(seen));
    assert_eq!(t.finish(Ended::Status(503)), None);
    let mut one = Timeline::new(t0);
    one.chunk(ms(30), 10);
    assert_eq!(one.finish(Ended::Status(200)).unwrap().tpot, None);
}

#[test]
fn absurd_shared_models_are_refused() {
    let mut rng = StdRng::seed_from_u64(23);
    let warm = trained(200, &mut rng);
    let snap = warm.snapshot(&2).unwrap();
    let mut m = LatencyModels::<u64>::new(LatencyConfig::default());
    let mut forever = snap.clone();
    forever.observations = u64::MAX;
    let mut huge = snap.clone();
    huge.tpot.theta[0] = 1.0e9;
    let mut error = snap.clone();
    error.recent_error = f64::INFINITY;
    for bad in [forever, huge, error] {
        assert_eq!(m.restore(2, &bad), Err(Rejected::Malformed));
        assert_eq!(m.restore_prior(&bad), Err(Rejected::Malformed));
    }
    assert!(m.is_empty());
    assert_eq!(m.prior().observations(), 0);
}

#[test]
fn a_learner_shares_every_model_in_turn_and_adopts_only_newer_ones() {
    use crate::keys::WorkerKey;
    let key = |i: u64| WorkerKey {
        instance_id: i,
        dp_rank: 0,
    };
    let mut rng = StdRng::seed_from_u64(29);
    let a = Learner::new(LatencyConfig::default());
    assert!(
        a.shared(None, 2).is_none(),
        "nothing learned, nothing shared"
    );
    for i in 0..5 {
        for _ in 0..8 * (i + 1) {
            let (f, seen) = FAST.sample(&mut rng);
            a.learn(key(i), &f, &seen);
        }
    }
    // Two at a time, in key order, wrapping round.
    let mut seen = Vec::new();
    let mut after = None;
    for _ in 0..3 {
        let (prior, workers) = a.shared(after, 2).unwrap();
        assert_eq!(prior.observations, 120);
        assert!(workers.len() <= 2);
        after = workers.last().map(|(k, _)| *k);
        seen.extend(workers.iter().map(|(k, _)| k.instance_id));
    }
    assert_eq!(seen, [0, 1, 2, 3, 4, 0]);

    let b = Learner::new(LatencyConfig::default());
    let (prior, workers) = a.shared(None, 8).unwrap();
    b.restore_shared(&prior, workers.iter());
    assert!(b.is_warm());
    assert_eq!(b.workers(), 5);
    let (f, _) = FAST.sample(&mut rng);
    assert_eq!(b.predict(&key(4), &f), a.predict(&key(4), &f));
    // B learns more of worker 4; A's older copy, heard again, is not adopted.
    for _ in 0..3 {
        let (f, seen) = FAST.sample(&mut rng);
        b.learn(key(4), &f, &seen);
    }
    let before = b.predict(&key(4), &f);
    b.restore_shared(&prior, workers.iter());
    assert_eq!(b.predict(&key(4), &f), before);
    assert_eq!(before.unwrap().observations, 43);
    // A malformed model is refused and counted; the rest are applied.
    let mut bad = workers[0].1.clone();
    bad.ttft.theta.pop();
    b.restore_shared(&prior, [(key(0), bad)].iter());
    assert_eq!(b.refused_shared(), 1);
}

/// The least overhead plus the least prefill rate times `uncached_tokens`,
/// over the prior and the warm workers' models, by a scan; and the least TTFT
/// they predict.
fn scanned_floor(m: &LatencyModels<u32>, uncached_tokens: u64) -> (f64, f64) {
    let keys = m.keys();
    let models = keys
        .iter()
        .filter(|k| m.is_warm(k))
        .filter_map(|k| m.worker(k))
        .chain([m.prior()]);
    let least = |i: usize| {
        models
            .clone()
            .map(|w| w.ttft_coefficients()[i])
            .fold(f64::INFINITY, f64::min)
    };
    let f = Features {
        prompt_tokens: uncached_tokens.max(1),
        uncached_tokens,
        ..Features::default()
    };
    let predicted = models
        .clone()
        .map(|w| w.predict(&f).ttft)
        .fold(f64::INFINITY, f64::min);
    (
        least(0) + least(1) * uncached_tokens as f64 / 1024.0,
        predicted,
    )
}

#[test]
fn the_ttft_floor_follows_learning_sharing_eviction_and_departures() {
    let mut rng = StdRng::seed_from_u64(11);
    let mut m = LatencyModels::<u32>::new(LatencyConfig {
        max_workers: 6,
        warm_observations: 4,
        ..LatencyConfig::default()
    });
    let coefficients = |rng: &mut StdRng| -> [f64; TTFT_TERMS] {
        std::array::from_fn(|_| match rng.random_range(0..4) {
            0 => 0.0,
            _ => rng.random_range(0.0..1.0),
        })
    };
    for step in 0..4000 {
        let worker = rng.random_range(0..10u32);
        match rng.random_range(0..10) {
            0 => {
                let mut s =
                    WorkerModel::new(coefficients(&mut rng), [0.01; TPOT_TERMS], 1.0).to_snapshot();
                s.observations = m.observations(&worker) + rng.random_range(1..6);
                m.restore(worker, &s).unwrap();
            }
            1 => {
                let mut s =
                    WorkerModel::new(coefficients(&mut rng), [0.01; TPOT_TERMS], 1.0).to_snapshot();
                s.observations = m.prior().observations() + 1;
                m.restore_prior(&s).unwrap();
            }
            2 => {
                let gone = rng.random_range(0..10u32);
                m.retain(|k| *k != gone);
            }
            _ => {
                let tokens = rng.random_range(1..8192u64);
                let f = Features {
                    prompt_tokens: tokens,
                    uncached_tokens: rng.random_range(0..=tokens),
                    waiting: rng.random_range(0.0..4.0),
                    ..Features::default()
                };
                let ttft = Duration::from_secs_f64(rng.random_range(0.001..3.0));
                m.observe_first_token(worker, &f, ttft).unwrap();
            }
        }
        for tokens in [0, 1, 700, 16_384] {
            let kept = m.ttft_floor(tokens);
            let (scanned, predicted) = scanned_floor(&m, tokens);
            assert_eq!(kept, scanned, "step {step}, {tokens} tokens");
            assert!(kept <= predicted, "step {step}: {kept} above {predicted}");
        }
    }
}

#[test]
fn a_worker_not_confirmed_at_its_limit_counts_its_stall_at_the_pools_largest_capacity() {
    let mut rng = StdRng::seed_from_u64(29);
    let mut m = LatencyModels::<u64>::new(LatencyConfig::default());
    // One worker peaks at 70 running without a queue: the prior's largest
    // running count never has one beside it, so the prior confirms nothing.
    let peak = Features {
        prompt_tokens: 1024,
        uncached_tokens: 1024,
        running: 70.0,
        in_flight: 70,
        ..Features::default()
    };
    m.observe(5, &peak, &Observed::from_secs(0.2, None).unwrap())
        .unwrap();
    // Two workers confirm different running counts with a queue beside them
    // (as where the KV pool binds, each at its own peak), a third none.
    for _ in 0..300 {
        for (id, cap) in [(1, SLOTS), (2, 40.0), (4, 8.0)] {
            let (f, _) = slotted_sample(&mut rng);
            let running = rng.random_range(cap as u32 / 2..=cap as u32) as f64;
            let waiting = match running >= cap && id != 4 {
                true => rng.random_range(0..6) as f64,
                false => 0.0,
            };
            let f = Features {
                running,
                waiting,
                in_flight: (running + waiting) as u32,
                ..f
            };
            let beyond = (running + waiting + 1.0 - cap).max(0.0);
            let ttft = 0.02 + 0.08 * f.uncached_tokens as f64 / 1024.0 + beyond * 0.5;
            let seen = Observed::from_secs(ttft, None).unwrap();
            m.observe(id, &f, &seen).unwrap();
        }
    }
    assert_eq!(m.prior().slots(), 0.0);
    assert_eq!(m.worker(&1).map(WorkerModel::slots), Some(SLOTS));
    assert_eq!(m.worker(&2).map(WorkerModel::slots), Some(40.0));
    assert_eq!(m.worker(&4).map(WorkerModel::slots), Some(0.0));
    assert_eq!(m.pool_slots(), 40.0);
    // At 44 requests there, a 2-kilotoken prefill holds every slot of a
    // confirmed worker; the unconfirmed one and one without a model count
    // the pool's 40, not none.
    let loaded = Features {
        prompt_tokens: 4096,
        uncached_tokens: 2048,
        running: 40.0,
        waiting: 4.0,
        in_flight: 44,
        ..Features::default()
    };
    let rate = m.prior().prefill_rate();
    assert!(rate > 0.0);
    for (id, slots) in [(1, SLOTS), (2, 40.0), (4, 40.0), (9, 40.0)] {
        let d = m.predict(&id, &loaded).queued_delay;
        let expected = rate * 2.0 * slots;
        assert!(
            (d - expected).abs() <= 1e-9 * expected,
            "worker {id}: {d} vs {expected}"
        );
    }
}
