//! Partial hits: a prompt held on a lower storage tier costs its load, less
//! than a cold prefill and more than a GPU hit, in `explain` and in the
//! pruned argmin alike.

use super::*;
use crate::kv::tier::{Tier, TierBlocks};
use crate::scheduler::tiers::TierCosts;

/// Sixteen precise workers, the first four holding a 10-block prompt on the
/// GPU, only in CPU memory, only on disk, and nowhere (a pool large enough
/// that the pick finds the holders by key).
fn tiered_pool() -> (Scheduler, EndpointTable, InferenceRequest, [WorkerKey; 4]) {
    tiered_pool_at(TierCosts::default())
}

/// [`tiered_pool`] with `tier_costs`.
fn tiered_pool_at(
    tier_costs: TierCosts,
) -> (Scheduler, EndpointTable, InferenceRequest, [WorkerKey; 4]) {
    tiered_pool_with(SchedulerConfig {
        tier_costs,
        ..Default::default()
    })
}

/// [`tiered_pool`] of a scheduler with `config`.
fn tiered_pool_with(
    config: SchedulerConfig,
) -> (Scheduler, EndpointTable, InferenceRequest, [WorkerKey; 4]) {
    let s = Scheduler::new(config);
    let t = both(16);
    let snap = t.snapshot();
    for e in &snap.endpoints {
        s.index().set_precise(e.key(0), true);
    }
    let keys: [WorkerKey; 4] = std::array::from_fn(|i| snap.endpoints[i].key(0));
    let long = prompt(&"t".repeat(64 * 10));
    let hashes = s.block_hashes(&long);
    let now = Instant::now();
    for (i, k) in keys.iter().enumerate().take(3) {
        let engine: Vec<(u64, u64)> = hashes
            .iter()
            .map(|&h| (h ^ ((i as u64 + 1) << 48), h))
            .collect();
        s.index().store_engine_chain(*k, None, &engine, now);
        let tier = match i {
            0 => continue,
            1 => Tier::Cpu,
            _ => Tier::Disk,
        };
        let named: Vec<u64> = engine.iter().map(|&(e, _)| e).collect();
        s.index().store_tier_copies(*k, tier, &named, 1);
        s.index().remove_engine_blocks(*k, &named);
    }
    (s, t, long, keys)
}

#[test]
fn a_prompt_costs_least_on_the_gpu_then_cpu_then_disk_then_cold() {
    let (s, t, long, keys) = tiered_pool();
    let snap = t.snapshot();
    let e = s.explain(&with_body(&long), &snap, Instant::now()).unwrap();
    let of = |k: WorkerKey| e.candidates.iter().find(|c| c.key == k).unwrap();
    let tiers: Vec<TierBlocks> = keys.iter().map(|k| of(*k).tier_blocks).collect();
    let on = |gpu, cpu, disk| TierBlocks { gpu, cpu, disk };
    assert_eq!(
        tiers,
        vec![on(10, 0, 0), on(0, 10, 0), on(0, 0, 10), on(0, 0, 0)]
    );
    assert_eq!(of(keys[1]).overlap_blocks, 10);
    let cost: Vec<f64> = keys.iter().map(|k| of(*k).terms.total()).collect();
    assert!(
        cost[0] < cost[1] && cost[1] < cost[2] && cost[2] < cost[3],
        "{cost:?}"
    );
    let prefill: Vec<f64> = keys.iter().map(|k| of(*k).terms.get("prefill")).collect();
    assert_eq!(prefill, vec![0.0, 10.0 * 0.2, 10.0 * 0.5, 10.0]);
    assert!(of(keys[0]).chosen);
}

/// The routing pick (pruned) takes the best tier among the candidates the
/// subset hint leaves, as explain does (each pick on a fresh pool: a pick
/// credits its target with the prompt until its events say otherwise).
#[test]
fn the_pruned_pick_takes_the_best_tier_left() {
    let cases = [
        (vec![0, 1, 2, 3], 0),
        (vec![1, 2, 3], 1),
        (vec![2, 3, 1], 1),
        (vec![2, 3], 2),
        (vec![3, 2], 2),
    ];
    let cases = cases.into_iter().chain([(Vec::new(), 0)]);
    // Each case from random starts: a tie among wrongly costed candidates
    // would be broken differently.
    for (subset, want) in cases.flat_map(|c| std::iter::repeat_n(c, 6)) {
        let (s, t, long, keys) = tiered_pool();
        let snap = t.snapshot();
        let subset: Vec<String> = subset
            .into_iter()
            .map(|i| snap.endpoints[i].endpoint.address.to_string())
            .collect();
        // No hint: the whole pool.
        let req = PickRequest {
            subset: (!subset.is_empty()).then_some(&subset[..]),
            ..with_body(&long)
        };
        let d = s.pick_at(&req, &snap, Instant::now()).unwrap();
        assert_eq!(d.decode.key(), keys[want], "subset {subset:?}");
        assert_eq!(d.overlap_blocks, 10);
    }
}

/// Tier costs come from the configuration: at 1 a lower tier's block costs
/// a prefill's, at 0 a GPU hit's.
#[test]
fn tier_costs_are_configured() {
    for (cpu, disk) in [(1.0, 1.0), (0.0, 0.0)] {
        let (s, t, long, keys) = tiered_pool_at(TierCosts { cpu, disk });
        let e = s
            .explain(&with_body(&long), &t.snapshot(), Instant::now())
            .unwrap();
        let prefill = |k: WorkerKey| {
            let c = e.candidates.iter().find(|c| c.key == k).unwrap();
            c.terms.get("prefill")
        };
        assert_eq!(prefill(keys[1]), 10.0 * cpu);
        assert_eq!(prefill(keys[2]), 10.0 * disk);
    }
}

/// With `--scoring predicted` and a warm model, a lower tier's blocks cost
/// their fraction of the learned prefill time: the predicted TTFT beyond the
/// fixed overhead is 0.2 of the cold one's from CPU memory, 0.5 from disk.
#[test]
fn predicted_mode_prices_a_load_at_the_learned_prefill_rate() {
    let (s, t, long, keys) = tiered_pool_with(SchedulerConfig {
        scoring: ScoringMode::Predicted,
        ..Default::default()
    });
    let model = |ttft: [f64; 6]| {
        let mut m =
            crate::latency::WorkerModel::new(ttft, [0.01, 0.0, 0.0, 0.0], 1.0).to_snapshot();
        m.observations = 100;
        m
    };
    let l = s.latency().expect("predicted mode learns latency");
    // 50 ms overhead, 400 ms per thousand tokens to prefill.
    l.restore_prior(&model([0.05, 0.4, 0.0, 0.0, 0.0, 0.0]))
        .unwrap();
    assert!(l.is_warm());
    let e = s
        .explain(&with_body(&long), &t.snapshot(), Instant::now())
        .unwrap();
    let ttft: Vec<f64> = keys
        .iter()
        .map(|k| {
            let c = e.candidates.iter().find(|c| c.key == *k).unwrap();
            c.prediction.expect("warm").ttft - 0.05
        })
        .collect();
    assert!(ttft[0] < 1e-9, "a GPU hit prefills nothing: {ttft:?}");
    assert!(ttft[3] > 0.0);
    assert!((ttft[1] / ttft[3] - 0.2).abs() < 0.01, "{ttft:?}");
    assert!((ttft[2] / ttft[3] - 0.5).abs() < 0.01, "{ttft:?}");
    assert!(
        e.candidates
            .iter()
            .find(|c| c.key == keys[0])
            .unwrap()
            .chosen
    );
}
