//! Scheduler behaviour, driven through `pick_at` / `finish_at` with a test clock.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::time::Duration;

use super::candidates::Cand;
use super::cost::pick_index;
use super::*;
use crate::endpoints::ActiveLoad;
use crate::endpoints::{Endpoint, EndpointTable, Role};
pub(super) use crate::fixtures::{
    parse as body, pool, prompt, scrape, scrape_capacity, table, with_body,
};

mod agreement;
mod health;
mod lora;
mod plugins;
mod predicted;
mod prop;
mod sessions;
mod tiers;
mod wait;

/// `n` endpoints at `10.0.0.{1..=n}:80`.
pub(super) fn both(n: usize) -> EndpointTable {
    pool(n, 80)
}

fn session(id: &str, action: Option<&str>, text: &str) -> InferenceRequest {
    let mut sc = serde_json::json!({"session_id": id, "timeout": 60});
    if let Some(a) = action {
        sc["action"] = a.into();
    }
    body(
        &serde_json::json!({"model": "m", "prompt": text, "nvext": {"session_control": sc}})
            .to_string(),
    )
}

#[test]
fn empty_pool_and_empty_subset_are_errors() {
    let s = Scheduler::default();
    let t = EndpointTable::new();
    assert_eq!(
        s.pick(&PickRequest::default(), &t.snapshot()).unwrap_err(),
        PickError::NoEndpoints
    );
    let t = table(&[("10.0.0.1:80", 1, Role::Both)]);
    let subset = vec!["10.9.9.9:80".to_string()];
    let req = PickRequest {
        subset: Some(&subset),
        ..Default::default()
    };
    assert_eq!(
        s.pick(&req, &t.snapshot()).unwrap_err(),
        PickError::SubsetEmpty
    );
}

#[test]
fn spreads_over_ranks_by_load() {
    let s = Scheduler::default();
    let t = table(&[
        ("10.0.0.1:80", 2, Role::Both),
        ("10.0.0.2:80", 1, Role::Both),
    ]);
    let snap = t.snapshot();
    let mut seen = HashSet::new();
    let mut held = Vec::new();
    for _ in 0..3 {
        let d = s.pick(&PickRequest::default(), &snap).unwrap();
        seen.insert(d.decode.key());
        held.push(d);
    }
    assert_eq!(seen.len(), 3, "three idle ranks each get one request");
    for d in &held {
        s.finish(d, Some(200));
        assert_eq!(d.decode.booked_blocks(), 0);
    }
}

#[test]
fn repeated_prompt_returns_to_its_worker() {
    let s = Scheduler::default();
    let t = both(8);
    let snap = t.snapshot();
    let long = prompt(&"the same long system prompt ".repeat(200));
    let first = s.pick(&with_body(&long), &snap).unwrap();
    assert_eq!(first.overlap_blocks, 0);
    assert!(first.prompt_blocks > 50);
    s.finish(&first, Some(200));
    for _ in 0..5 {
        let again = s.pick(&with_body(&long), &snap).unwrap();
        assert_eq!(again.decode.key(), first.decode.key());
        assert_eq!(again.overlap_blocks, again.prompt_blocks);
        s.finish(&again, Some(200));
    }
    let st = s.stats();
    assert_eq!(
        st.blocks_matched.load(Ordering::Relaxed) * 6,
        st.blocks_queried.load(Ordering::Relaxed) * 5
    );
}

/// Tenants (`x-tenant-id` > `nvext.cache_salt` > `cache_salt`) never share a
/// prefix: a tenant's prompt finds nothing of another tenant's identical one.
#[test]
fn a_salted_prompt_never_matches_another_tenants_identical_prefix() {
    let s = Scheduler::default();
    let t = both(8);
    let snap = t.snapshot();
    let text = "the same long system prompt ".repeat(200);
    let salted = |salt: serde_json::Value| {
        let mut b = serde_json::json!({"model": "m", "prompt": text});
        if let serde_json::Value::Object(m) = &mut b {
            m.extend(salt.as_object().unwrap().clone());
        }
        body(&b.to_string())
    };
    let a = salted(serde_json::json!({"cache_salt": "tenant-a"}));
    let first = s.pick(&with_body(&a), &snap).unwrap();
    s.finish(&first, Some(200));
    let again = s.pick(&with_body(&a), &snap).unwrap();
    assert_eq!(
        again.overlap_blocks, again.prompt_blocks,
        "same tenant hits"
    );
    s.finish(&again, Some(200));
    let mut by_header = salted(serde_json::json!({"cache_salt": "tenant-b"}));
    by_header.set_tenant(Some("tenant-a"));
    let same = s.pick(&with_body(&by_header), &snap).unwrap();
    assert_eq!(same.overlap_blocks, same.prompt_blocks, "the header wins");
    s.finish(&same, Some(200));
    for other in [
        salted(serde_json::json!({"cache_salt": "tenant-b"})),
        salted(serde_json::json!({"cache_salt": "tenant-a", "nvext": {"cache_salt": "tenant-c"}})),
        salted(serde_json::json!({})),
    ] {
        let d = s.pick(&with_body(&other), &snap).unwrap();
        assert_eq!(d.overlap_blocks, 0, "{:?}", other.salt);
        s.finish(&d, Some(200));
    }
}

#[test]
fn load_outweighs_overlap_when_the_holder_is_busy() {
    let s = Scheduler::default();
    let t = both(2);
    let snap = t.snapshot();
    let long = prompt(&"x".repeat(64 * 100));
    // Without scrapes the active load counts: each copy in flight costs the
    // holder 0.1 × 100 blocks against the other's 100 blocks of prefill, a tie
    // at ten copies; the twelfth goes elsewhere.
    let held: Vec<Decision> = (0..12)
        .map(|_| s.pick(&with_body(&long), &snap).unwrap())
        .collect();
    let keys: HashSet<_> = held.iter().map(|d| d.decode.key()).collect();
    assert_eq!(keys.len(), 2, "the busy holder does not get everything");
}

/// A scheduler with these decode and queue weights over two workers, and a clock.
fn load_weighted(decode: f64, queue: f64) -> (Scheduler, EndpointTable, Instant) {
    let s = Scheduler::new(SchedulerConfig {
        plugins: Plugins::with_weights(
            &TermWeights::default()
                .with(&terms::load::TERM, decode)
                .with(&terms::queue::TERM, queue),
            0.0,
        ),
        ..Default::default()
    });
    (s, both(2), Instant::now())
}

#[test]
fn a_holder_keeps_its_prefix_while_scraped_and_its_bookings_count_once_it_is_not() {
    // Unit weights: load and queue at full weight, so only what is counted holds them.
    let (s, t, now) = load_weighted(1.0, 1.0);
    let snap = t.snapshot();
    let long = prompt(&"x".repeat(64 * 100));
    let mut held = Vec::new();
    for i in 0..4 {
        // Fresh scrapes: the holder runs what it was sent, nothing waits.
        for e in snap.endpoints.iter() {
            let running = held
                .iter()
                .filter(|h: &&Decision| h.decode.key() == e.key(0))
                .count() as f64;
            scrape(e, 0.0, running, 0.1 * running, now);
        }
        let d = s.pick_at(&with_body(&long), &snap, now).unwrap();
        if i > 0 {
            assert_eq!(d.decode.key(), held[0].decode.key(), "pick {i}");
            assert_eq!(d.overlap_blocks, 100);
        }
        // Running: its prefill is over.
        s.prefill_done(&d);
        held.push(d);
    }
    // A queue alone leaves the holder sticky while its KV has room: the one
    // queued request counts at the blocks left to prefill there (none: all four
    // are past their prefill), not the running requests' 400 blocks.
    let _in_flight: Vec<_> = held.iter().map(Decision::begin).collect();
    let holder = held[0].decode.key();
    let scrape_holder = |queue: f64, kv: f64| {
        for e in snap.endpoints.iter() {
            match e.key(0) == holder {
                true => scrape(e, queue, 4.0, kv, now),
                false => scrape(e, 0.0, 0.0, 0.1, now),
            }
        }
    };
    scrape_holder(1.0, 0.3);
    let d = s.pick_at(&with_body(&long), &snap, now).unwrap();
    assert_eq!(d.decode.key(), holder, "queued, KV room");
    s.cancel(&d);
    // A full KV cache leaves it sticky too: the prompt is there, and a fresh
    // scrape's queue and KV usage already say what its running requests hold
    // (counting its bookings as well once scattered the saturated point's
    // prompts, BENCHMARKS.md §2).
    scrape_holder(0.0, 0.85);
    let d = s.pick_at(&with_body(&long), &snap, now).unwrap();
    assert_eq!(d.decode.key(), holder, "KV full, scraped");
    s.cancel(&d);
    // Without a fresh scrape its bookings are what kvpick knows: its 400
    // blocks of load count against the other worker's 100 blocks of prefill.
    let later = now + SchedulerConfig::default().scrape_max_age + Duration::from_millis(1);
    let d = s.pick_at(&with_body(&long), &snap, later).unwrap();
    assert_ne!(d.decode.key(), holder, "no fresh scrape");
}

#[test]
fn queued_requests_count_at_their_uncached_size() {
    let (s, t, now) = load_weighted(0.0, 1.0);
    let snap = t.snapshot();
    let long = prompt(&"x".repeat(64 * 100));
    let first = s.pick_at(&with_body(&long), &snap, now).unwrap();
    // Sent after the first (same worker) before its prefill is done.
    let only = [first.decode.endpoint().address_string()];
    let there = PickRequest {
        subset: Some(&only),
        ..with_body(&long)
    };
    let held: Vec<Decision> = std::iter::once(first)
        .chain((1..4).map(|_| s.pick_at(&there, &snap, now).unwrap()))
        .collect();
    let _in_flight: Vec<_> = held.iter().map(Decision::begin).collect();
    let holder = held[0].decode.key();
    assert!(held.iter().all(|d| d.decode.key() == holder));
    assert_eq!(
        held.iter().map(|d| d.uncached_blocks).collect::<Vec<_>>(),
        [100, 0, 0, 0]
    );
    // Two of the holder's four wait, but they are cached there: 2 × 25 blocks of
    // prefill ahead (and the first's 100 pending), not 2 × 100. The other worker waits behind one request it
    // knows nothing of (counted at this request's size) and must prefill all 100.
    for e in snap.endpoints.iter() {
        match e.key(0) == holder {
            true => scrape(e, 2.0, 2.0, 0.3, now),
            false => scrape(e, 1.0, 0.0, 0.0, now),
        }
    }
    let d = s.pick_at(&with_body(&long), &snap, now).unwrap();
    assert_eq!(d.decode.key(), holder);
    for d in &held {
        s.finish_at(d, Some(200), now);
    }
    let left = ActiveLoad {
        blocks: d.load_blocks,
        uncached: 0,
    };
    assert_eq!(d.decode.state.active_load(d.decode.rank), left);
}

/// A 4-block system prompt, a short turn under it (4 blocks more) and a new
/// conversation under it (60 blocks more): a prompt sharing only the system
/// prompt with the turn, with much more to prefill.
fn system_prompt_turn_and_new_chat() -> (String, InferenceRequest, InferenceRequest) {
    let system = "s".repeat(64 * 4);
    let turn = prompt(&format!("{system}{}", "t".repeat(64 * 4)));
    let new = prompt(&format!("{system}{}", "n".repeat(64 * 60)));
    (system, turn, new)
}

#[test]
fn a_prompt_to_prefill_does_not_join_a_queued_requests_step_for_its_system_prompt() {
    // Default weights. A short turn waits in one worker's queue; a new
    // conversation shares its 4-block system prompt and has 60 more blocks to
    // prefill. With chunked prefill its first chunk would join the step that
    // ends the queued turn's prefill, and that turn's first token would wait
    // for it (held-out trace, 4,000 blocks 0.5×: TTFT p50 716 ms against
    // llm-d's 594, BENCHMARKS.md §2).
    let s = Scheduler::default();
    let t = both(2);
    let snap = t.snapshot();
    let (system, turn, new) = system_prompt_turn_and_new_chat();
    let queued = s.pick(&with_body(&turn), &snap).unwrap();
    let _in_flight = queued.begin();
    let busy = queued.decode.key();
    let now = Instant::now();
    for e in snap.endpoints.iter() {
        let waiting = f64::from(u8::from(e.key(0) == busy));
        scrape(e, waiting, 0.0, 0.0, now);
    }
    let d = s.pick_at(&with_body(&new), &snap, now).unwrap();
    assert_ne!(d.decode.key(), busy, "joined the queued turn's step");
    s.cancel(&d);
    // A prefix worth the queued turn's delay still holds: the turn's next
    // one, all but 2 of its blocks cached there, stays.
    let next = prompt(&format!("{system}{}", "t".repeat(64 * 6)));
    let d = s.pick_at(&with_body(&next), &snap, now).unwrap();
    assert_eq!((d.decode.key(), d.overlap_blocks), (busy, 8));
}

#[test]
fn a_prefill_kvpick_routed_counts_before_the_scrape_shows_it_queued() {
    // Both workers scraped idle a moment ago; since then kvpick sent a short
    // turn to one of them, whose prefill is pending. A new conversation
    // sharing its system prompt must not join that prefill's step on the
    // strength of the old scrape (AISimulate, low-reuse chats at 16×, a scrape
    // every 50 ms: TTFT p99 234 ms against 113 when it did).
    let s = Scheduler::default();
    let t = both(2);
    let snap = t.snapshot();
    let now = Instant::now();
    for e in snap.endpoints.iter() {
        scrape(e, 0.0, 0.0, 0.0, now);
    }
    let (_, turn, new) = system_prompt_turn_and_new_chat();
    let first = s.pick_at(&with_body(&turn), &snap, now).unwrap();
    let _in_flight = first.begin();
    let d = s.pick_at(&with_body(&new), &snap, now).unwrap();
    assert_ne!(
        d.decode.key(),
        first.decode.key(),
        "joined the pending prefill"
    );
}

#[test]
fn prefill_done_releases_the_booked_uncached_blocks_once() {
    let s = Scheduler::default();
    let t = table(&[
        ("10.0.0.1:80", 1, Role::Prefill),
        ("10.0.1.1:80", 1, Role::Decode),
    ]);
    let snap = t.snapshot();
    let (a, b) = (prompt(&"a".repeat(64 * 100)), prompt(&"b".repeat(64 * 60)));
    let first = s.pick(&with_body(&a), &snap).unwrap();
    let second = s.pick(&with_body(&b), &snap).unwrap();
    let (d, p) = (&first.decode, first.prefill.as_ref().unwrap());
    let load = |t: &Target| t.state.active_load(t.rank);
    let both = |x: fn(&Decision) -> ActiveLoad| ActiveLoad {
        blocks: x(&first).blocks + x(&second).blocks,
        uncached: x(&first).uncached + x(&second).uncached,
    };
    assert_eq!((first.uncached_blocks, second.uncached_blocks), (100, 60));
    assert_eq!(load(d), both(Decision::decode_load));
    assert_eq!(load(p).uncached, 160);
    // The first's prefill is over: its uncached blocks go, once, on both ranks;
    // the second's stay, and so does the first's booked prompt and output.
    for _ in 0..2 {
        s.prefill_done(&first);
        assert_eq!(load(d).uncached, 60);
        assert_eq!(load(p).uncached, 60);
        assert_eq!(load(d).blocks, both(Decision::decode_load).blocks);
    }
    // Finishing it releases the rest without taking the second's uncached part.
    s.finish(&first, Some(200));
    assert_eq!(load(d), second.decode_load());
    assert_eq!(load(p), second.prefill_load());
    // A decision withdrawn before its prefill releases all it booked.
    s.cancel(&second);
    assert_eq!(load(d), ActiveLoad::default());
    assert_eq!(load(p), ActiveLoad::default());
}

#[test]
fn a_worker_with_a_prefill_pending_costs_its_blocks_until_prefill_done() {
    let s = Scheduler::default();
    let t = both(2);
    let snap = t.snapshot();
    let long = prompt(&"x".repeat(64 * 110));
    // 100 blocks: the long prompt's first `n`, then 100 - n of its own.
    let shares = |n: usize, c: &str| prompt(&("x".repeat(64 * n) + &c.repeat(64 * (100 - n))));
    let first = s.pick(&with_body(&long), &snap).unwrap();
    let holder = first.decode.key();
    // The holder costs the blocks to prefill, 11 of active load (no scrape) and
    // 0.05 per block of the first's 110 pending beyond the shared prefix (that
    // part becomes hits there). Sharing 16: 84 + 11 + 4.7 = 99.7, under the
    // idle worker's 100 (all 110 pending would make it 100.5).
    let d = s.pick(&with_body(&shares(16, "w")), &snap).unwrap();
    assert_eq!(d.decode.key(), holder, "shared prefix pending");
    s.cancel(&d);
    // Sharing 15: 85 + 11 + 4.75 = 100.75, more than the idle worker's 100.
    let d = s.pick(&with_body(&shares(15, "y")), &snap).unwrap();
    assert_ne!(d.decode.key(), holder, "prefill pending");
    s.cancel(&d);
    // Its prefill done, the holder's 72 + 11 win over the other's 85 (it now
    // holds the first 15); with the first's blocks still pending (+4.1) the
    // holder would cost 87.1.
    s.prefill_done(&first);
    let d = s.pick(&with_body(&shares(28, "z")), &snap).unwrap();
    assert_eq!(d.decode.key(), holder, "prefill done");
    assert_eq!(d.overlap_blocks, 28);
}

#[test]
fn distinct_prompts_spread_out() {
    let s = Scheduler::default();
    let t = both(4);
    let snap = t.snapshot();
    let mut count: HashMap<WorkerKey, usize> = HashMap::new();
    let mut held = Vec::new();
    for i in 0..40 {
        let p = prompt(&format!("{i} distinct prompt {}", "y".repeat(500)));
        let d = s.pick(&with_body(&p), &snap).unwrap();
        *count.entry(d.decode.key()).or_default() += 1;
        held.push(d);
    }
    assert_eq!(count.len(), 4);
    assert!(count.values().all(|c| *c == 10), "{count:?}");
}

#[test]
fn only_the_leading_prefix_blocks_are_hashed_recorded_and_matched() {
    let s = Scheduler::new(SchedulerConfig {
        max_prefix_blocks: 8,
        ..Default::default()
    });
    let t = both(1);
    let snap = t.snapshot();
    let head = "h".repeat(64 * 8);
    let first = prompt(&format!("{head}{}", "a".repeat(64 * 12)));
    let d = s.pick(&with_body(&first), &snap).unwrap();
    assert_eq!(d.prompt_blocks, 8);
    // The whole prompt is still booked as load.
    assert_eq!(d.load_blocks, 20);
    assert_eq!(s.index().len(), 8);
    s.finish(&d, Some(200));
    // Another prompt with the same 8 leading blocks matches all that is hashed.
    let second = prompt(&format!("{head}{}", "b".repeat(64 * 30)));
    let d = s.pick(&with_body(&second), &snap).unwrap();
    assert_eq!((d.prompt_blocks, d.overlap_blocks), (8, 8));
}

/// A worker scraped with 32 engine blocks of 64 tokens holds 2,048 tokens. A
/// prompt of token ids hashes in blocks of `token_block` (64) tokens, so the
/// approximate LRU keeps 32 of them: a second prompt of 2,048 tokens evicts the
/// first. Text hashes in blocks of `byte_block` bytes (about 16 tokens), 128 of
/// them: both prompts of 512 tokens' worth stay. (Counted in text blocks, the
/// bound kept 128 blocks of token ids: 8,192 tokens on a worker holding 2,048.)
#[test]
fn the_lru_bound_counts_the_engines_tokens_in_blocks_of_the_prompts_kind() {
    let s = Scheduler::new(SchedulerConfig {
        token_block: 64,
        ..Default::default()
    });
    let t = both(1);
    let snap = t.snapshot();
    let now = Instant::now();
    scrape_capacity(&snap.endpoints[0], 64, Some(32), now);
    let tokens = |from: u32| {
        body(
            &serde_json::json!({"model": "m", "prompt": (from..from + 2048).collect::<Vec<_>>()})
                .to_string(),
        )
    };
    let text = |c: &str| prompt(&c.repeat(64 * 32));
    let route = |b: &InferenceRequest| {
        let d = s.pick_at(&with_body(b), &snap, now).unwrap();
        s.finish_at(&d, Some(200), now);
        d
    };
    let (first, second) = (tokens(0), tokens(100_000));
    assert_eq!(route(&first).prompt_blocks, 32);
    route(&second);
    assert_eq!(
        route(&first).overlap_blocks,
        0,
        "the first prompt outlived the engine's cache"
    );
    let (a, b) = (text("a"), text("b"));
    assert_eq!(route(&a).prompt_blocks, 32);
    route(&b);
    assert_eq!(route(&a).overlap_blocks, 32);
}

/// An engine under no pressure keeps a prefix however long it sits unused: once
/// the scrape gives the engine's capacity, its LRU bound alone ages kvpick's
/// approximate entries, and a prompt back after longer than the TTL (900 s)
/// still finds its worker. Without the capacity the TTL stands in for it.
#[test]
fn a_prefix_outlives_the_ttl_on_an_engine_whose_capacity_is_scraped() {
    let overlap_after_the_ttl = |num_blocks: Option<u64>| {
        let s = Scheduler::default();
        let t = both(2);
        let snap = t.snapshot();
        let scrape_at = |at: Instant| {
            for e in &snap.endpoints {
                scrape_capacity(e, 16, num_blocks, at);
            }
        };
        let a = prompt(&"a".repeat(64 * 32));
        let now = Instant::now();
        scrape_at(now);
        let first = s.pick_at(&with_body(&a), &snap, now).unwrap();
        s.finish_at(&first, Some(200), now);
        let later = now + crate::kv::index::DEFAULT_TTL + Duration::from_secs(100);
        s.maintain(&snap, later);
        scrape_at(later);
        let again = s.pick_at(&with_body(&a), &snap, later).unwrap();
        assert_eq!(again.prompt_blocks, 32);
        (
            again.overlap_blocks,
            first.decode.key() == again.decode.key(),
        )
    };
    assert_eq!(overlap_after_the_ttl(Some(1000)), (32, true));
    assert_eq!(overlap_after_the_ttl(None).0, 0, "the TTL applies");
}

#[test]
fn a_body_parsed_with_the_token_limit_routes_and_weighs_like_the_whole_body() {
    let s = Scheduler::new(SchedulerConfig {
        max_prefix_blocks: 4,
        ..Default::default()
    });
    assert_eq!(s.config().prompt_limits().tokens, 64);
    let ids: Vec<u32> = (0..1000).collect();
    let json = serde_json::json!({"model": "m", "prompt": ids}).to_string();
    let whole = body(&json);
    let capped =
        crate::request::parse_capped(json.as_bytes(), None, s.config().prompt_limits()).unwrap();
    assert_eq!(capped.omitted_tokens, 1000 - 64);
    assert_eq!(s.block_hashes(&capped), s.block_hashes(&whole));
    let (a, b) = (s.prompt_blocks(&capped), s.prompt_blocks(&whole));
    assert_eq!(
        (a.uncached(0), a.uncached(4)),
        (b.uncached(0), b.uncached(4))
    );
    assert_eq!(a.uncached(0), 63); // ceil(1000 / 16)
    let t = both(1);
    let snap = t.snapshot();
    let (d1, d2) = (
        s.pick(&with_body(&capped), &snap).unwrap(),
        s.pick(&with_body(&whole), &snap).unwrap(),
    );
    assert_eq!(d1.load_blocks, d2.load_blocks);
}

/// A long text prompt is kept only as far as it is hashed: the rest is
/// counted, and the request hashes, weighs and routes as the whole one does.
#[test]
fn a_body_parsed_with_the_text_limit_routes_and_weighs_like_the_whole_body() {
    let s = Scheduler::new(SchedulerConfig {
        max_prefix_blocks: 4,
        ..Default::default()
    });
    let limit = s.config().prompt_limits().text_bytes;
    assert_eq!(limit, 4 * s.config().byte_block);
    let long: String = (0..1000).map(|i| format!("w{i} é ")).collect();
    let json = serde_json::json!({"model": "m", "messages": [
        {"role": "system", "content": long},
        {"role": "user", "content": "and then?"},
    ]})
    .to_string();
    let whole = body(&json);
    let capped =
        crate::request::parse_capped(json.as_bytes(), None, s.config().prompt_limits()).unwrap();
    let [crate::request::Segment::Text(kept)] = capped.segments.as_slice() else {
        panic!("one text segment: {:?}", capped.segments);
    };
    assert!(
        kept.len() <= limit && kept.len() > limit - 4,
        "{}",
        kept.len()
    );
    assert_eq!(capped.prompt_len(), whole.prompt_len());
    assert_eq!(s.block_hashes(&capped), s.block_hashes(&whole));
    let (a, b) = (s.prompt_blocks(&capped), s.prompt_blocks(&whole));
    assert_eq!(
        (a.uncached(0), a.uncached(4)),
        (b.uncached(0), b.uncached(4))
    );
    let t = both(1);
    let snap = t.snapshot();
    let (d1, d2) = (
        s.pick(&with_body(&capped), &snap).unwrap(),
        s.pick(&with_body(&whole), &snap).unwrap(),
    );
    assert_eq!(d1.load_blocks, d2.load_blocks);
}

#[test]
fn scraped_load_counts_only_while_fresh() {
    let cfg = SchedulerConfig {
        scrape_max_age: Duration::from_secs(5),
        ..Default::default()
    };
    let s = Scheduler::new(cfg);
    let t = both(2);
    let snap = t.snapshot();
    let now = Instant::now();
    let busy = &snap.endpoints[0];
    scrape(busy, 20.0, 30.0, 0.9, now);
    for _ in 0..10 {
        let d = s.pick_at(&PickRequest::default(), &snap, now).unwrap();
        assert_eq!(d.decode.key(), snap.endpoints[1].key(0));
        s.finish_at(&d, Some(200), now);
    }
    // Once stale, the scrape is suspect: the busy worker does not turn cheap
    // (a hung or dead pod stops answering scrapes).
    let later = now + Duration::from_secs(6);
    let picked: HashSet<_> = (0..40)
        .map(|_| {
            let d = s.pick_at(&PickRequest::default(), &snap, later).unwrap();
            s.finish_at(&d, Some(200), later);
            d.decode.key()
        })
        .collect();
    assert_eq!(picked, HashSet::from([snap.endpoints[1].key(0)]));
}

#[test]
fn osl_adds_expected_decode_blocks_to_the_booked_load() {
    let s = Scheduler::new(SchedulerConfig {
        default_osl_tokens: 64,
        ..Default::default()
    });
    let t = both(1);
    let snap = t.snapshot();
    let hinted = body(
        r#"{"model":"m","prompt":"x","nvext":{"agent_hints":{"osl":1600,"priority":5,"unknown_hint":true}}}"#,
    );
    let d = s.pick(&with_body(&hinted), &snap).unwrap();
    let per_block = SchedulerConfig::default().token_block as u64;
    assert_eq!(d.decode_blocks, 1600_u64.div_ceil(per_block));
    assert_eq!(d.decode.booked_blocks(), d.load_blocks + d.decode_blocks);
    let plain = prompt("x");
    let d2 = s.pick(&with_body(&plain), &snap).unwrap();
    assert_eq!(d2.decode_blocks, 64_u64.div_ceil(per_block), "the default");
    s.finish(&d, Some(200));
    s.finish(&d2, Some(200));
    assert_eq!(d.decode.booked_blocks(), 0);
}

#[test]
fn dp_ranks_are_separate_caches() {
    let s = Scheduler::default();
    let t = table(&[("10.0.0.1:80", 4, Role::Both)]);
    let snap = t.snapshot();
    let long = prompt(&"z".repeat(64 * 20));
    let d = s.pick(&with_body(&long), &snap).unwrap();
    s.finish(&d, Some(200));
    let d2 = s.pick(&with_body(&long), &snap).unwrap();
    assert_eq!(d2.decode.rank, d.decode.rank);
    let others: Vec<WorkerKey> = (0..4)
        .filter(|r| *r != d.decode.rank)
        .map(|r| snap.endpoints[0].key(r))
        .collect();
    let hashes = s.block_hashes(&long);
    assert!(s
        .index()
        .lookup(&hashes, &others, Instant::now())
        .iter()
        .all(|c| *c == 0));
}

#[test]
fn disaggregated_pool_picks_prefill_by_overlap() {
    let s = Scheduler::default();
    let mut eps = Vec::new();
    for i in 1..=3 {
        let mut e = Endpoint::new(format!("10.0.0.{i}:80").parse().unwrap());
        e.role = Role::Prefill;
        e.bootstrap_port = Some(8998);
        eps.push(e);
    }
    let mut d = Endpoint::new("10.0.1.1:80".parse().unwrap());
    d.role = Role::Decode;
    eps.push(d);
    let t = EndpointTable::new();
    t.replace(eps);
    let snap = t.snapshot();
    let long = prompt(&"p".repeat(64 * 50));
    let first = s.pick(&with_body(&long), &snap).unwrap();
    let pf = first.prefill.as_ref().unwrap().key();
    assert_eq!(first.decode.endpoint().role, Role::Decode);
    assert!(first.bootstrap_room.is_some_and(|r| r < 1 << 63));
    s.finish(&first, Some(200));
    for _ in 0..3 {
        let d = s.pick(&with_body(&long), &snap).unwrap();
        assert_eq!(d.prefill.as_ref().unwrap().key(), pf);
        s.finish(&d, Some(200));
    }
    let only_prefill = table(&[("10.0.0.1:80", 1, Role::Prefill)]);
    assert_eq!(
        s.pick(&PickRequest::default(), &only_prefill.snapshot())
            .unwrap_err(),
        PickError::NoDecodeEndpoint
    );
}

#[test]
fn precise_workers_get_no_approximate_entries() {
    let s = Scheduler::default();
    let t = both(1);
    let snap = t.snapshot();
    let key = snap.endpoints[0].key(0);
    s.index().set_precise(key, true);
    let long = prompt(&"q".repeat(64 * 10));
    let d = s.pick(&with_body(&long), &snap).unwrap();
    s.finish(&d, Some(200));
    assert!(s.index().is_empty());
}

/// A scheduler with a 10 s provisional TTL over `n` precise workers.
fn precise_pool(n: usize) -> (Scheduler, EndpointTable) {
    let s = Scheduler::new(SchedulerConfig {
        provisional_ttl: Duration::from_secs(10),
        ..Default::default()
    });
    let t = both(n);
    for e in &t.snapshot().endpoints {
        s.index().set_precise(e.key(0), true);
    }
    (s, t)
}

/// The worker `key` of `snap`'s first rank, other than `not`.
fn other_worker(snap: &Snapshot, not: WorkerKey) -> WorkerKey {
    snap.endpoints
        .iter()
        .map(|e| e.key(0))
        .find(|k| *k != not)
        .unwrap()
}

#[test]
fn a_prompt_routed_to_a_precise_worker_counts_there_until_its_events_or_ttl() {
    let (s, t) = precise_pool(8);
    let snap = t.snapshot();
    let now = Instant::now();
    let long = prompt(&"q".repeat(64 * 10));
    // In flight (no response yet), no KV event yet: the worker it went to is
    // credited with the prompt, and the requests that guess attracts go there.
    let first = s.pick_at(&with_body(&long), &snap, now).unwrap();
    let mut attracted = Vec::new();
    for i in [3, 6, 9] {
        let at = now + Duration::from_secs(i);
        let d = s.pick_at(&with_body(&long), &snap, at).unwrap();
        assert_eq!(d.decode.key(), first.decode.key());
        assert_eq!(d.overlap_blocks, 10);
        attracted.push(d);
    }
    assert!(s.index().is_empty(), "the precise index holds only events");
    // They did not renew it: the TTL runs from the first routing.
    let later = now + Duration::from_secs(10);
    s.maintain(&snap, later);
    let d = s.explain(&with_body(&long), &snap, later).unwrap();
    assert!(
        d.candidates.iter().all(|c| c.overlap_blocks == 0),
        "a guess renewed by the requests it attracted"
    );
}

#[test]
fn by_default_a_guess_outlives_a_deep_queue() {
    // A saturated fleet queues a request for tens of seconds before its
    // prefill (TTFT p50 ~30 s on the tuning trace, 1,000 blocks, 2x): its
    // guess must still attract the prompt's next requests then, or they
    // scatter and every worker computes the prefix again.
    let s = Scheduler::new(SchedulerConfig {
        tie_break_seed: Some(7),
        ..Default::default()
    });
    let t = both(8);
    let snap = t.snapshot();
    for e in &snap.endpoints {
        s.index().set_precise(e.key(0), true);
    }
    let now = Instant::now();
    let long = prompt(&"d".repeat(64 * 10));
    let first = s.pick_at(&with_body(&long), &snap, now).unwrap();
    let queued = now + Duration::from_secs(60);
    s.maintain(&snap, queued);
    let d = s.pick_at(&with_body(&long), &snap, queued).unwrap();
    assert_eq!(
        (d.decode.key(), d.overlap_blocks),
        (first.decode.key(), 10),
        "the guess expired while its request was still queued"
    );
}

#[test]
fn a_confirmed_holder_beats_a_guess_at_equal_cost() {
    let (s, t) = precise_pool(2);
    let snap = t.snapshot();
    let now = Instant::now();
    let long = prompt(&"g".repeat(64 * 10));
    let hashes = s.block_hashes(&long);
    let first = s.pick_at(&with_body(&long), &snap, now).unwrap();
    s.finish_at(&first, Some(500), now);
    let guessed_key = first.decode.key();
    // The other worker's engine reports the whole prompt.
    let confirmed = other_worker(&snap, guessed_key);
    let engine: Vec<(u64, u64)> = hashes.iter().map(|&h| (h ^ 0xE, h)).collect();
    s.index().store_engine_chain(confirmed, None, &engine, now);
    for _ in 0..40 {
        let d = s.pick_at(&with_body(&long), &snap, now).unwrap();
        assert_eq!(d.overlap_blocks, 10);
        assert_eq!(d.decode.key(), confirmed, "a guess won a tie");
        s.finish_at(&d, Some(200), now);
    }
    let e = s.explain(&with_body(&long), &snap, now).unwrap();
    let chosen: Vec<WorkerKey> = e
        .candidates
        .iter()
        .filter(|c| c.chosen)
        .map(|c| c.key)
        .collect();
    assert_eq!(
        chosen,
        vec![confirmed],
        "explain prefers the confirmed holder too"
    );
}

#[test]
fn a_guess_its_events_do_not_confirm_is_dropped_after_the_response_began() {
    let (s, t) = precise_pool(4);
    let snap = t.snapshot();
    let now = Instant::now();
    let bound = s.config().provisional_confirm;
    let long = prompt(&"u".repeat(64 * 10));
    let hashes = s.block_hashes(&long);
    let d = s.pick_at(&with_body(&long), &snap, now).unwrap();
    let worker = d.decode.key();
    let overlap = |at| {
        s.explain(&with_body(&long), &snap, at)
            .unwrap()
            .candidates
            .iter()
            .find(|c| c.key == worker)
            .map_or(0, |c| c.overlap_blocks)
    };
    // Queued for a while: the guess stands until the response begins.
    let began = now + Duration::from_secs(5);
    assert_eq!(overlap(began), 10);
    s.prefill_done_at(&d, began);
    assert_eq!(overlap(began + bound - Duration::from_millis(1)), 10);
    assert_eq!(
        overlap(began + bound),
        0,
        "an unconfirmed guess outlived its bound"
    );
    s.finish_at(&d, Some(200), began + bound);
    // The same prompt again, and this time its engine reports it in time: the
    // blocks are held for real, the bound takes nothing away.
    let d = s.pick_at(&with_body(&long), &snap, began + bound).unwrap();
    let worker = d.decode.key();
    s.prefill_done_at(&d, began + bound);
    let engine: Vec<(u64, u64)> = hashes.iter().map(|&h| (h ^ 0xE, h)).collect();
    s.index()
        .store_engine_chain(worker, None, &engine, began + bound);
    s.settle_provisional(worker, &hashes);
    let e = s
        .explain(&with_body(&long), &snap, began + 3 * bound)
        .unwrap();
    let held = e.candidates.iter().find(|c| c.key == worker).unwrap();
    assert_eq!(held.overlap_blocks, 10);
    s.finish_at(&d, Some(200), began + bound);

    // A request that ends without a response (cancelled, reset) starts the bound at its end.
    let other = prompt(&"v".repeat(64 * 10));
    let d = s.pick_at(&with_body(&other), &snap, now).unwrap();
    let ended = now + Duration::from_secs(1);
    s.finish_at(&d, None, ended);
    let e = |at| s.explain(&with_body(&other), &snap, at).unwrap();
    assert!(e(ended).candidates.iter().any(|c| c.overlap_blocks == 10));
    assert!(e(ended + bound)
        .candidates
        .iter()
        .all(|c| c.overlap_blocks == 0));
}

#[test]
fn a_provisional_entry_ends_when_events_speak_of_its_blocks() {
    let (s, t) = precise_pool(2);
    let snap = t.snapshot();
    let now = Instant::now();
    let long = prompt(&"p".repeat(64 * 10));
    let hashes = s.block_hashes(&long);
    let first = s.pick_at(&with_body(&long), &snap, now).unwrap();
    s.finish_at(&first, Some(200), now);
    let worker = first.decode.key();
    let cand = Cand {
        ep: &first.decode.state,
        rank: first.decode.rank,
        key: worker,
    };
    let overlap = |at| s.overlaps(&hashes, at).map_or(0, |o| o.get(&cand).blocks());
    assert_eq!(overlap(now), 10);
    // Events about the last four blocks: the first six stay provisional.
    s.settle_provisional(worker, &hashes[6..]);
    assert_eq!(overlap(now), 6);
    // The other worker's events leave this worker's entries alone.
    let other = snap
        .endpoints
        .iter()
        .map(|e| e.key(0))
        .find(|k| *k != worker)
        .unwrap();
    s.settle_provisional(other, &hashes);
    assert_eq!(overlap(now), 6);
    s.settle_provisional(worker, &hashes);
    assert_eq!(overlap(now), 0, "well within the TTL");
}

#[test]
fn maintain_forgets_gone_workers() {
    let s = Scheduler::default();
    let t = both(2);
    let long = prompt(&"r".repeat(64 * 10));
    let d = s.pick(&with_body(&long), &t.snapshot()).unwrap();
    s.finish(&d, Some(200));
    assert_eq!(s.index().len(), 10);
    s.maintain(&t.snapshot(), Instant::now());
    assert_eq!(s.index().len(), 10);
    t.replace(Vec::new());
    s.maintain(&t.snapshot(), Instant::now());
    assert!(s.index().is_empty());
}

#[test]
fn tie_break_is_uniform_and_temperature_samples() {
    let mut rng = rand::rng();
    let mut hits = [0usize; 3];
    for _ in 0..3000 {
        hits[pick_index(&[1.0, 1.0, 5.0], 0.0, &mut rng)] += 1;
    }
    assert_eq!(hits[2], 0);
    assert!(hits[0] > 1200 && hits[1] > 1200, "{hits:?}");
    // Eight ties after a worse cost and before a better-by-less-than-epsilon one.
    let costs = [3.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0 - 1e-12, 2.0];
    let mut hits = [0usize; 10];
    for _ in 0..8000 {
        hits[pick_index(&costs, 0.0, &mut rng)] += 1;
    }
    assert_eq!((hits[0], hits[9]), (0, 0), "{hits:?}");
    assert!(
        hits[1..9].iter().all(|h| (800..1200).contains(h)),
        "{hits:?}"
    );
    let mut hits = [0usize; 2];
    for _ in 0..3000 {
        hits[pick_index(&[0.0, 1.0], 1.0, &mut rng)] += 1;
    }
    // p(1) = e^-1 / (1 + e^-1) ≈ 0.27.
    assert!(hits[1] > 600 && hits[1] < 1050, "{hits:?}");
}

#[test]
fn stage_latencies_are_recorded() {
    let s = Scheduler::default();
    let t = both(2);
    let d = s.pick(&with_body(&prompt("hello")), &t.snapshot()).unwrap();
    s.finish(&d, Some(200));
    for stage in Stage::ALL {
        let h = s.stats().stage(stage).snapshot();
        assert_eq!(h.count, 1, "{}", stage.name());
        assert_eq!(h.buckets.len(), LATENCY_BUCKETS.len() + 1);
        assert_eq!(h.buckets.iter().map(|b| b.1).sum::<u64>(), 1);
    }
}

#[test]
fn sglang_prefill_without_bootstrap_annotation_gets_the_default_port() {
    use crate::endpoints::Engine;
    let pool = |engine: Engine, annotated: Option<u16>| {
        let mut p = Endpoint::new("10.0.0.1:80".parse().unwrap());
        p.role = Role::Prefill;
        p.engine = engine;
        p.bootstrap_port = annotated;
        let mut d = Endpoint::new("10.0.1.1:80".parse().unwrap());
        d.role = Role::Decode;
        let t = EndpointTable::new();
        t.replace(vec![p, d]);
        t
    };
    let body = prompt("x");
    let s = Scheduler::default();
    let d = s
        .pick(&with_body(&body), &pool(Engine::Sglang, None).snapshot())
        .unwrap();
    assert_eq!(d.bootstrap_port, Some(DEFAULT_SGLANG_BOOTSTRAP_PORT));
    assert!(d.bootstrap_room.is_some());
    // The annotation overrides; other engines get no default.
    let d = s
        .pick(
            &with_body(&body),
            &pool(Engine::Sglang, Some(9000)).snapshot(),
        )
        .unwrap();
    assert_eq!(d.bootstrap_port, Some(9000));
    let d = s
        .pick(&with_body(&body), &pool(Engine::Vllm, None).snapshot())
        .unwrap();
    assert_eq!((d.bootstrap_port, d.bootstrap_room), (None, None));
    // The flag changes (or disables) the default.
    let s = Scheduler::new(SchedulerConfig {
        sglang_bootstrap_port: Some(18998),
        ..Default::default()
    });
    let d = s
        .pick(&with_body(&body), &pool(Engine::Sglang, None).snapshot())
        .unwrap();
    assert_eq!(d.bootstrap_port, Some(18998));
    let s = Scheduler::new(SchedulerConfig {
        sglang_bootstrap_port: None,
        ..Default::default()
    });
    let d = s
        .pick(&with_body(&body), &pool(Engine::Sglang, None).snapshot())
        .unwrap();
    assert_eq!(d.bootstrap_port, None);
}

#[test]
fn an_uncached_image_costs_its_tokens_in_prefill_not_one_block() {
    // No tokenizer: the image stays one hash block, but prefilling it costs its
    // 576 tokens (36 blocks of 16), as load already counts.
    let s = Scheduler::default();
    let t = both(2);
    let snap = t.snapshot();
    let image = body(
        &serde_json::json!({"model": "m", "messages": [{"role": "user", "content": [
            {"type": "text", "text": "p".repeat(128)},
            {"type": "image_url", "image_url": {"url": "https://img.example/cat.png"}},
            {"type": "text", "text": "q".repeat(64)},
        ]}]})
        .to_string(),
    );
    let first = s.pick(&with_body(&image), &snap).unwrap();
    s.finish(&first, Some(200));
    let holder = first.decode.key();
    // The holder gets 20 blocks of other load in flight.
    let only_holder = vec![first.decode.endpoint().address.to_string()];
    let other = prompt(&"o".repeat(64 * 20));
    let busy = s
        .pick(
            &PickRequest {
                body: Some(&other),
                subset: Some(&only_holder),
                ..Default::default()
            },
            &snap,
        )
        .unwrap();
    assert_eq!(busy.decode.key(), holder);
    // Elsewhere the image must be prefilled again (36 blocks + text) — more than
    // the holder's 20 blocks of load, so the image goes back to its holder.
    let again = s.pick(&with_body(&image), &snap).unwrap();
    assert_eq!(
        again.decode.key(),
        holder,
        "the cached image is worth its tokens"
    );
    assert_eq!(again.overlap_blocks, again.prompt_blocks);
}

#[test]
fn a_pool_read_in_order_still_finds_its_least_costly_holder() {
    // Every worker holds the prompt (one level of the whole pool, read in
    // order from a random endpoint); all but one carry 3 blocks, that one 1:
    // each pick takes it, wherever the read starts.
    let s = Scheduler::default();
    let t = both(8);
    let snap = t.snapshot();
    let p = prompt(&"x".repeat(640));
    let hashes = s.block_hashes(&p);
    let now = Instant::now();
    for (i, ep) in snap.endpoints.iter().enumerate() {
        s.index().insert(ep.key(0), &hashes, now);
        let blocks = if i == 5 { 1 } else { 3 };
        ep.book(
            0,
            ActiveLoad {
                blocks,
                uncached: 0,
            },
        );
    }
    for _ in 0..32 {
        let d = s.pick_at(&with_body(&p), &snap, now).unwrap();
        assert_eq!(d.decode.key(), snap.endpoints[5].key(0));
        s.finish_at(&d, Some(200), now);
    }
}

/// With `max_endpoints` above 1 a decision lists fallbacks: other addresses
/// than its decode target (a data-parallel endpoint once), a session turn
/// still on its bound worker; the default lists none.
#[test]
fn fallbacks_name_other_addresses_and_a_session_keeps_its_worker() {
    let t = table(&[
        ("10.0.0.1:80", 2, Role::Both),
        ("10.0.0.2:80", 1, Role::Both),
        ("10.0.0.3:80", 1, Role::Both),
    ]);
    let snap = t.snapshot();
    let one = Scheduler::default();
    let d = one.pick(&PickRequest::default(), &snap).unwrap();
    assert!(d.fallbacks.is_empty());
    let s = Scheduler::new(SchedulerConfig {
        max_endpoints: 3,
        ..Default::default()
    });
    let addresses = |d: &Decision| -> Vec<String> {
        std::iter::once(&d.decode)
            .chain(&d.fallbacks)
            .map(|t| t.endpoint().address_string())
            .collect()
    };
    for _ in 0..8 {
        let d = s.pick(&PickRequest::default(), &snap).unwrap();
        let mut all = addresses(&d);
        all.sort();
        assert_eq!(all, ["10.0.0.1:80", "10.0.0.2:80", "10.0.0.3:80"]);
        s.finish(&d, Some(200));
    }
    let open = s
        .pick(&with_body(&session("s", Some("open"), "hi")), &snap)
        .unwrap();
    s.finish(&open, Some(200));
    for _ in 0..4 {
        // Load elsewhere or not, the turn stays; its fallbacks are the others.
        let held = s.pick(&PickRequest::default(), &snap).unwrap();
        let turn = s
            .pick(&with_body(&session("s", None, "hi again")), &snap)
            .unwrap();
        assert_eq!(turn.decode.key(), open.decode.key());
        let all = addresses(&turn);
        assert_eq!(all.len(), 3);
        assert!(!all[1..].contains(&all[0]), "{all:?}");
        s.finish(&turn, Some(200));
        s.finish(&held, Some(200));
    }
}

/// The per-term decision cost sums (`kvpick_decision_cost_blocks_total`) are
/// the chosen ranks' costs as `explain` scores them, term by term: the pruned
/// argmin's winner (with and without fallbacks) and a session's pinned rank.
#[test]
fn decision_cost_sums_are_the_chosen_ranks_terms() {
    for max_endpoints in [1, 3] {
        let s = Scheduler::new(SchedulerConfig {
            max_endpoints,
            ..Default::default()
        });
        let t = table(&[
            ("10.0.0.1:80", 2, Role::Both),
            ("10.0.0.2:80", 1, Role::Both),
            ("10.0.0.3:80", 1, Role::Both),
        ]);
        let snap = t.snapshot();
        let t0 = Instant::now();
        let shared = "a system prompt every request shares ".repeat(40);
        let names: Vec<&str> = s
            .plugins()
            .plugins
            .scorers
            .iter()
            .map(|x| x.name())
            .collect();
        let mut expected = vec![0.0; names.len()];
        let mut held = Vec::new();
        let bodies: Vec<InferenceRequest> = (0..6)
            .map(|i| prompt(&format!("{shared} question {i} {}", "x".repeat(i * 300))))
            .chain([
                session("s", Some("open"), &shared),
                session("s", None, &format!("{shared} again")),
            ])
            .collect();
        for body in &bodies {
            let req = with_body(body);
            let explained = s.explain(&req, &snap, t0).unwrap();
            let d = s.pick_at(&req, &snap, t0).unwrap();
            let chosen = explained
                .candidates
                .iter()
                .find(|c| !c.prefill && c.key == d.decode.key())
                .expect("the chosen rank is explained");
            for (sum, name) in expected.iter_mut().zip(&names) {
                *sum += chosen.terms.get(name);
            }
            held.push(d);
        }
        let live = s.plugins();
        let costs = &live.decision_cost;
        assert_eq!(costs.decisions(), bodies.len() as u64);
        assert!(expected.iter().any(|c| *c > 0.0), "{expected:?}");
        for (i, want) in expected.iter().enumerate() {
            let got = costs.sum(i);
            assert!(
                (got - want).abs() < 1e-6,
                "max_endpoints {max_endpoints}, term {}: {got} != {want}",
                names[i]
            );
        }
        for d in &held {
            s.finish(d, Some(200));
        }
    }
}
