//! Replicas without shared state (`agreement.rs`): two schedulers with their
//! own tables and their own tie-break draws, nothing synced between them.

use std::collections::HashMap;

use super::*;
use crate::scheduler::agreement::{prompt_key, weight};

/// A scheduler of `workers` endpoints whose random tie-breaks draw from `seed`.
fn replica(workers: usize, seed: u64) -> (Scheduler, EndpointTable) {
    let s = Scheduler::new(SchedulerConfig {
        tie_break_seed: Some(seed),
        ..Default::default()
    });
    (s, both(workers))
}

/// Turn `turn` of conversation `c`: its system prompt, then a question per turn.
fn turn(c: usize, turn: usize) -> InferenceRequest {
    let mut text = format!("You are assistant {c}. ") + &"Answer briefly and well. ".repeat(30);
    for t in 0..=turn {
        text += &format!("Conversation {c}, question {t}: and then? Answer {t}. ");
    }
    prompt(&text)
}

/// Conversation `c`'s turn 0 routed by `a`, turn 1 by `b`: whether they met.
fn next_turn_meets(
    a: &(Scheduler, EndpointTable),
    b: &(Scheduler, EndpointTable),
    c: usize,
) -> bool {
    let now = Instant::now();
    let first =
        a.0.pick_at(&with_body(&turn(c, 0)), &a.1.snapshot(), now)
            .unwrap();
    a.0.finish_at(&first, Some(200), now);
    let next =
        b.0.pick_at(&with_body(&turn(c, 1)), &b.1.snapshot(), now)
            .unwrap();
    b.0.finish_at(&next, Some(200), now);
    first.decode.key() == next.decode.key()
}

#[test]
fn replicas_without_shared_state_agree_on_a_conversations_next_turn() {
    let (a, b) = (replica(4, 1), replica(4, 2));
    a.0.set_shared_state(false);
    b.0.set_shared_state(false);
    let mut per_worker: HashMap<WorkerKey, usize> = HashMap::new();
    for c in 0..64 {
        assert!(next_turn_meets(&a, &b, c), "conversation {c} split");
        let now = Instant::now();
        let d =
            b.0.pick_at(&with_body(&turn(c, 1)), &b.1.snapshot(), now)
                .unwrap();
        *per_worker.entry(d.decode.key()).or_default() += 1;
        b.0.finish_at(&d, Some(200), now);
    }
    // The hash spreads conversations over every worker.
    assert_eq!(per_worker.len(), 4, "{per_worker:?}");
}

#[test]
fn with_shared_state_the_tie_break_stays_random() {
    let (a, b) = (replica(4, 1), replica(4, 2));
    let met = (0..64).filter(|&c| next_turn_meets(&a, &b, c)).count();
    assert!(met < 48, "{met} of 64 met without a shared index");
}

#[test]
fn a_worker_loaded_beyond_the_margin_loses_its_conversations() {
    let (s, t) = replica(4, 1);
    s.set_shared_state(false);
    let snap = t.snapshot();
    let now = Instant::now();
    let req = turn(7, 0);
    let chosen = s.pick_at(&with_body(&req), &snap, now).unwrap();
    s.finish_at(&chosen, Some(200), now);
    // A little load on the agreed worker keeps the conversation there...
    let held = s.pick_at(&with_body(&turn(8, 0)), &snap, now).unwrap();
    let little = ActiveLoad {
        blocks: chosen.load_blocks,
        uncached: chosen.load_blocks,
    };
    chosen.decode.state.book(chosen.decode.rank, little);
    let other = prompt("another prompt");
    let again = s.pick_at(&with_body(&other), &snap, now).unwrap();
    s.finish_at(&again, Some(200), now);
    s.finish_at(&held, Some(200), now);
    let fresh = Scheduler::new(SchedulerConfig::default());
    fresh.set_shared_state(false);
    let d = fresh.pick_at(&with_body(&req), &snap, now).unwrap();
    assert_eq!(d.decode.key(), chosen.decode.key());
    fresh.finish_at(&d, Some(200), now);
    // ...much more pushes it away.
    let heavy = ActiveLoad {
        blocks: 40 * chosen.load_blocks,
        uncached: 40 * chosen.load_blocks,
    };
    chosen.decode.state.book(chosen.decode.rank, heavy);
    let d = fresh.pick_at(&with_body(&req), &snap, now).unwrap();
    assert_ne!(d.decode.key(), chosen.decode.key());
}

/// The pruned pick takes what scoring every candidate takes: the highest
/// rendezvous weight within the margin of the least cost.
#[test]
fn the_pruned_pick_is_the_agreed_choice_over_every_candidate() {
    let (s, t) = replica(16, 3);
    s.set_shared_state(false);
    let snap = t.snapshot();
    let now = Instant::now();
    // Some holders of conversations' prefixes, and uneven load.
    for c in 0..24 {
        let d = s.pick_at(&with_body(&turn(c, 0)), &snap, now).unwrap();
        if c % 3 != 0 {
            s.finish_at(&d, Some(200), now);
        }
    }
    // New conversations (no holder: every candidate within the load terms of
    // the others), then their next turns (a holder).
    for c in 100..124 {
        for depth in 0..2 {
            let req = turn(c, depth);
            let hashes = s.block_hashes(&req);
            let key = prompt_key(&hashes).unwrap();
            let e = s.explain(&with_body(&req), &snap, now).unwrap();
            let least = e
                .candidates
                .iter()
                .map(|c| c.terms.total())
                .fold(f64::INFINITY, f64::min);
            let margin = AGREEMENT_MARGIN * e.load_blocks as f64;
            let want = e
                .candidates
                .iter()
                .filter(|c| c.terms.total() <= least + margin)
                .max_by_key(|c| weight(key, c.key))
                .unwrap()
                .key;
            let d = s.pick_at(&with_body(&req), &snap, now).unwrap();
            assert_eq!(d.decode.key(), want, "conversation {c}, turn {depth}");
            s.finish_at(&d, Some(200), now);
        }
    }
}
