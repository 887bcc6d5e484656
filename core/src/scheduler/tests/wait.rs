//! The wait behind pending prefills: counted at `PENDING_PREFILL_WEIGHT` a
//! block, in full for a long prompt, and in full beyond
//! `MAX_WAIT_BESIDE_IDLE_TOKENS` while a rank has nothing pending.

use std::time::Instant;

use super::{both, prompt, scrape, with_body};
use crate::endpoints::ActiveLoad;
use crate::scheduler::*;

/// 512-token blocks (2,048 bytes of text each): long from 48 blocks to
/// prefill, the wait beside an idle rank counting in full beyond 256.
fn scheduler() -> Scheduler {
    Scheduler::new(SchedulerConfig {
        token_block: 512,
        byte_block: 2048,
        ..Default::default()
    })
}

/// `shared` blocks of the 350-block prompt `x`, then `own` blocks of `c`.
fn text(shared: usize, own: usize, c: &str) -> InferenceRequest {
    prompt(&("x".repeat(2048 * shared) + &c.repeat(2048 * own)))
}

#[test]
fn thresholds_are_tokens_in_the_configured_blocks() {
    let s = scheduler();
    let (idle, busy) = (s.pending_wait(1), s.pending_wait(0));
    let near = |a: f64, b: f64| (a - b).abs() < 1e-9;
    assert!(near(busy.weigh(100.0, 47), 5.0));
    assert!(
        near(busy.weigh(100.0, 48), 100.0),
        "a long prompt waits in full"
    );
    assert!(near(idle.weigh(256.0, 10), 12.8));
    assert!(
        near(idle.weigh(300.0, 10), 12.8 + 44.0),
        "beyond 256 beside an idle rank"
    );
    assert!(
        near(busy.weigh(300.0, 10), 15.0),
        "no idle rank: all at 0.05"
    );
    assert_eq!(idle.weigh(0.0, 0), 0.0);
    let default = Scheduler::default().pending_wait(1);
    assert!(
        near(default.weigh(100.0, 1535), 5.0),
        "16-token blocks: long from 1,536"
    );
    assert!(near(default.weigh(100.0, 1536), 100.0));
    assert!(near(default.weigh(8192.0, 0), 0.05 * 8192.0));
    assert!(near(default.weigh(8193.0, 0), 0.05 * 8192.0 + 1.0));
}

#[test]
fn the_pending_weight_is_configurable_within_zero_and_one() {
    let with = |w: f64| {
        Scheduler::new(SchedulerConfig {
            token_block: 512,
            pending_prefill_weight: w,
            ..Default::default()
        })
        .pending_wait(0)
    };
    assert!((with(1.0).weigh(100.0, 10) - 100.0).abs() < 1e-9);
    assert!((with(0.5).weigh(100.0, 10) - 50.0).abs() < 1e-9);
    assert!(
        (with(7.0).weigh(100.0, 10) - 100.0).abs() < 1e-9,
        "at most 1"
    );
    assert_eq!(with(-1.0).weigh(100.0, 10), 0.0, "never below zero");
}

#[test]
fn a_short_prompt_leaves_a_long_wait_only_while_another_rank_is_idle() {
    let s = scheduler();
    let t = both(2);
    let snap = t.snapshot();
    let now = Instant::now();
    for ep in &snap.endpoints {
        scrape(ep, 0.0, 0.0, 0.0, now);
    }
    let first = s
        .pick_at(&with_body(&text(350, 0, "x")), &snap, now)
        .unwrap();
    let holder = first.decode.key();
    let other = snap.endpoints.iter().find(|e| e.key(0) != holder).unwrap();
    assert_eq!(snap.idle_ranks(true), 1);

    // 30 blocks held of 40: 10 to prefill behind 320 pending beyond them.
    // Beside the idle worker: 10 + 0.05 × 256 + 64 = 86.8 > 40.
    let short = text(30, 10, "s");
    let explained = s.explain(&with_body(&short), &snap, now).unwrap();
    let at_holder = explained.candidates.iter().find(|c| c.key == holder);
    assert!((at_holder.unwrap().terms.get("prefill") - 86.8).abs() < 1e-9);
    let d = s.pick_at(&with_body(&short), &snap, now).unwrap();
    assert_ne!(d.decode.key(), holder, "the idle worker starts at once");
    // Withdrawn, and what it recorded there forgotten: the other worker
    // holds nothing again.
    let forget = |d: &Decision| {
        s.cancel(d);
        s.index().clear_worker(d.decode.key());
    };
    forget(&d);

    // The other worker has a prefill pending too: 10 + 0.05 × 320 = 26 beats
    // its 40 + 0.05 × 2.
    other.book(
        0,
        ActiveLoad {
            blocks: 2,
            uncached: 2,
        },
    );
    assert_eq!(snap.idle_ranks(true), 0);
    let d = s.pick_at(&with_body(&short), &snap, now).unwrap();
    assert_eq!(d.decode.key(), holder, "no idle worker: the hits win");
    s.cancel(&d);

    // A long prompt (50 blocks to prefill there) waits in full, idle worker
    // or not: 50 + 320 against 80 + 2.
    let d = s
        .pick_at(&with_body(&text(30, 50, "l")), &snap, now)
        .unwrap();
    assert_ne!(d.decode.key(), holder, "a long prompt leaves the queue");
    forget(&d);
    other.release(
        0,
        ActiveLoad {
            blocks: 2,
            uncached: 2,
        },
    );
    s.prefill_done(&first);
    assert_eq!(snap.idle_ranks(true), 2);
    let d = s
        .pick_at(&with_body(&text(30, 50, "l")), &snap, now)
        .unwrap();
    assert_eq!(d.decode.key(), holder, "its prefill done, the holder wins");
}
