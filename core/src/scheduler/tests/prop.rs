//! Arbitrary client-supplied values through the body parser, then the
//! scheduler's `pick` and `finish`: every input is an answer or an error,
//! never a panic (overflowing timeouts, huge sizes, odd ids, many dp ranks).

use std::time::{Duration, Instant};

use proptest::prelude::*;
use serde_json::{json, Value};

use crate::endpoints::{ActiveLoad, Endpoint, EndpointTable, Role};
use crate::scheduler::*;

/// A JSON number, mostly within `0..=max`, else of any magnitude or sign, or
/// a value of the wrong type.
fn number(max: u64) -> impl Strategy<Value = Value> {
    prop_oneof![
        6 => (0..=max).prop_map(Value::from),
        1 => any::<u64>().prop_map(Value::from),
        1 => any::<i64>().prop_map(Value::from),
        1 => any::<f64>()
            .prop_map(|f| serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number)),
        1 => Just(json!(u64::MAX)),
        1 => Just(json!(1e300)),
        1 => Just(json!("18446744073709551615")),
    ]
}

fn id() -> impl Strategy<Value = String> {
    prop_oneof![
        "[a-z0-9]{1,8}",
        ".{0,40}",
        (1usize..700).prop_map(|n| "s".repeat(n)),
    ]
}

fn body() -> impl Strategy<Value = Vec<u8>> {
    (
        id(),
        prop::option::of(prop_oneof![Just("open"), Just("close"), Just("other")]),
        prop::option::of(number(u64::from(u32::MAX))),
        prop::option::of(number(u64::from(u32::MAX))),
        prop::option::of(number(100)),
        prop::option::of(number(u64::MAX)),
        prop::bool::ANY,
        ".{0,300}",
    )
        .prop_map(
            |(sid, action, timeout, osl, priority, worker, chat, text)| {
                let set = |object: &mut Value, key: &str, value: Option<Value>| {
                    if let Some(v) = value {
                        object[key] = v;
                    }
                };
                let (mut sc, mut hints, mut nvext) =
                    (json!({"session_id": sid}), json!({}), json!({}));
                set(&mut sc, "action", action.map(Value::from));
                set(&mut sc, "timeout", timeout);
                set(&mut hints, "osl", osl);
                set(&mut hints, "priority", priority);
                set(&mut nvext, "backend_instance_id", worker);
                nvext["session_control"] = sc;
                nvext["agent_hints"] = hints;
                let mut b = if chat {
                    json!({"model": "m", "messages": [{"role": "user", "content": text}]})
                } else {
                    json!({"model": "m", "prompt": text})
                };
                b["nvext"] = nvext;
                serde_json::to_vec(&b).unwrap()
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn arbitrary_client_values_never_panic_the_parser_or_the_scheduler(
        bodies in prop::collection::vec(body(), 1..6),
        dp_sizes in prop::collection::vec(1u32..=crate::endpoints::MAX_DP_SIZE, 1..4),
        header_id in prop::option::of(id()),
        token in prop::option::of(".{0,200}"),
        steps in prop::collection::vec((any::<u64>(), prop::option::of(any::<u16>())), 6),
        cap in 1u64..100_000,
    ) {
        let s = Scheduler::new(SchedulerConfig {
            max_request_load_blocks: cap,
            ..Default::default()
        });
        let t = EndpointTable::new();
        t.replace(
            dp_sizes
                .iter()
                .enumerate()
                .map(|(i, &dp)| {
                    let mut e = Endpoint::new(format!("10.0.0.{}:80", i + 1).parse().unwrap());
                    e.dp_size = dp;
                    e
                })
                .collect(),
        );
        let snap = t.snapshot();
        let t0 = Instant::now();
        for (body, (secs, status)) in bodies.iter().zip(steps.iter().cycle()) {
            let now = crate::time::saturating_add(t0, Duration::from_secs(*secs));
            let Ok(parsed) = crate::request::parse(body, None) else {
                continue;
            };
            let req = PickRequest {
                body: Some(&parsed),
                session_id: header_id.as_deref(),
                session_token: token.as_deref(),
                ..Default::default()
            };
            let d = s.pick_at(&req, &snap, now).unwrap();
            prop_assert!(d.load_blocks + d.decode_blocks <= cap);
            let _ = s.response_headers(&d);
            let _ = s.record_response(&d, status.unwrap_or(200), now);
            s.finish_at(&d, *status, now);
            s.maintain(&snap, now);
        }
    }
}

/// One endpoint of an arbitrary pool: whether it shares the previous one's
/// instance id, data-parallel ranks, role, consecutive failures (3 eject it),
/// a scrape (queue, running, KV usage), and per rank its booked load (half of
/// it pending prefill) and the
/// prompt blocks it holds in the index (when the case's share of holders
/// keeps it) and provisionally.
#[derive(Debug, Clone)]
struct PoolMember {
    twin: bool,
    dp: u32,
    role: Role,
    failures: u32,
    scrape: Option<(f64, f64, f64)>,
    ranks: Vec<(u64, usize, usize)>,
}

fn pool_member(depth: usize) -> impl Strategy<Value = PoolMember> {
    let rank = (
        prop_oneof![2 => Just(0u64), 2 => 1u64..8, 2 => 8u64..60, 1 => 60u64..400],
        prop_oneof![3 => Just(0usize), 2 => 1..=depth],
        prop_oneof![6 => Just(0usize), 1 => 1..=depth],
    );
    (
        prop::bool::weighted(0.03),
        prop_oneof![5 => Just(1u32), 1 => 2u32..=3],
        prop_oneof![8 => Just(Role::Both), 1 => Just(Role::Decode), 1 => Just(Role::Prefill)],
        prop_oneof![6 => Just(0u32), 1 => 1u32..=3],
        prop::option::of((0.0..8.0f64, 0.0..8.0f64, 0.0..1.0f64)),
        prop::collection::vec(rank, 3),
    )
        .prop_map(|(twin, dp, role, failures, scrape, ranks)| PoolMember {
            twin,
            dp,
            role,
            failures,
            scrape,
            ranks,
        })
}

/// The least total cost `explain` finds among the open candidates of one side.
fn least_explained(all: &[CandidateScore], prefill: bool) -> Option<f64> {
    all.iter()
        .filter(|c| c.prefill == prefill && c.filtered_out.is_none())
        .map(|c| c.terms.total())
        .min_by(f64::total_cmp)
}

/// The least decode cost of each address but `except`, ascending (a
/// data-parallel endpoint counts its best rank).
fn ranked_addresses(all: &[CandidateScore], except: &str) -> Vec<f64> {
    let mut best: Vec<(&str, f64)> = Vec::new();
    for c in all
        .iter()
        .filter(|c| !c.prefill && c.filtered_out.is_none())
    {
        let cost = c.terms.total();
        match best.iter_mut().find(|(a, _)| *a == c.address) {
            Some((_, b)) => *b = b.min(cost),
            None if c.address != except => best.push((&c.address, cost)),
            None => {}
        }
    }
    let mut costs: Vec<f64> = best.into_iter().map(|(_, c)| c).collect();
    costs.sort_by(f64::total_cmp);
    costs
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(192))]

    /// Whatever the pool (its size, shared instance ids, roles, ranks, health,
    /// scrapes, load and which prompt blocks each rank holds in the index or
    /// provisionally, a subset hint or none), the pick's decode and prefill targets cost exactly
    /// the least `explain` finds by scoring every candidate, its fallbacks the
    /// next least of the other addresses in order, and a pick fails
    /// exactly when `explain` does, with the same error.
    #[test]
    fn a_pick_costs_the_least_of_every_candidate(
        members in prop::collection::vec(pool_member(24), 1..160),
        subset in prop::option::of(prop::collection::vec(0usize..200, 0..6)),
        ttl_expired in prop::bool::ANY,
        held_share in 1u64..=8,
        coarse_blocks in prop::bool::ANY,
        max_endpoints in 1usize..=4,
    ) {
        // Token blocks of 1,024 tokens bring the pending-wait thresholds within
        // the case: every non-holder of the 24-block prompt is long (24
        // blocks), and a holder's wait beyond 128 blocks counts in full while
        // some rank has nothing pending.
        let token_block = if coarse_blocks { 1024 } else { SchedulerConfig::default().token_block };
        let s = Scheduler::new(SchedulerConfig { token_block, max_endpoints, ..Default::default() });
        let t = EndpointTable::new();
        let addr = |i: usize| format!("10.0.{}.{}:80", i / 256, i % 256);
        t.replace(
            members
                .iter()
                .enumerate()
                .map(|(i, m)| {
                    let mut e = Endpoint::new(addr(i).parse().unwrap());
                    if m.twin && i > 0 {
                        e.instance_id = crate::identity::instance_id_for(&addr(i - 1));
                    }
                    e.dp_size = m.dp;
                    e.role = m.role;
                    e
                })
                .collect(),
        );
        let snap = t.snapshot();
        let text: String = (0..24).map(|i| format!("{i:>63} ")).collect();
        let p = crate::request::parse(
            serde_json::to_vec(&json!({"model": "m", "prompt": text})).unwrap().as_slice(),
            None,
        )
        .unwrap();
        let hashes = s.block_hashes(&p);
        let now = Instant::now();
        let health = crate::health::HealthConfig::default();
        // Addresses sort as their numbers: the snapshot keeps the members' order.
        for (ep, m) in snap.endpoints.iter().zip(&members) {
            for _ in 0..m.failures {
                ep.health().record(crate::health::Outcome::Failure, now, &health);
            }
            if let Some((queue, running, kv_usage)) = m.scrape {
                super::scrape(ep, queue, running, kv_usage, now);
            }
            for (rank, &(load, held, provisional)) in m.ranks.iter().take(m.dp as usize).enumerate() {
                let key = ep.key(rank as u32);
                ep.book(rank as u32, ActiveLoad { blocks: load, uncached: load / 2 });
                // Only some of the ranks that would hold: sparse holders make
                // small levels, found by key; dense ones are read in order.
                if held > 0 && (load + held as u64) % 8 < held_share {
                    // Entries an hour old, when the test lets them expire.
                    let at = if ttl_expired && load % 2 == 1 {
                        now.checked_sub(Duration::from_secs(3600)).unwrap_or(now)
                    } else {
                        now
                    };
                    s.index().insert(key, &hashes[..held.min(hashes.len())], at);
                }
                if provisional > 0 {
                    s.provisional.insert(key, &hashes[..provisional.min(hashes.len())], now);
                }
            }
        }
        let subset: Option<Vec<String>> = subset.map(|v| v.iter().map(|&i| addr(i)).collect());
        let req = PickRequest {
            body: Some(&p),
            subset: subset.as_deref(),
            ..Default::default()
        };
        let explained = s.explain(&req, &snap, now);
        let picked = s.pick_at(&req, &snap, now);
        match (explained, picked) {
            (Ok(e), Ok(d)) => {
                let cost_of = |t: &Target, prefill: bool| {
                    let address = t.endpoint().address_string();
                    e.candidates
                        .iter()
                        .find(|c| {
                            (c.key, c.prefill) == (t.key(), prefill)
                                && c.address == address
                                && c.filtered_out.is_none()
                        })
                        .map(|c| c.terms.total())
                };
                let least = least_explained(&e.candidates, false).unwrap();
                let chosen = cost_of(&d.decode, false);
                prop_assert!(
                    chosen.is_some_and(|c| (c - least).abs() < 1e-9),
                    "decode {} costs {chosen:?}, least {least}", d.decode.key()
                );
                // Fallbacks: the next best addresses, in cost order, as many
                // as there are up to `max_endpoints - 1`.
                let others = ranked_addresses(&e.candidates, &d.decode.endpoint().address_string());
                let fallbacks: Vec<Option<f64>> =
                    d.fallbacks.iter().map(|f| cost_of(f, false)).collect();
                prop_assert_eq!(fallbacks.len(), others.len().min(max_endpoints - 1));
                for (got, want) in fallbacks.iter().zip(&others) {
                    prop_assert!(
                        got.is_some_and(|c| (c - want).abs() < 1e-9),
                        "fallbacks cost {fallbacks:?}, the next best {others:?}"
                    );
                }
                match (least_explained(&e.candidates, true), &d.prefill) {
                    (None, None) => {}
                    (Some(least), Some(p)) => {
                        let chosen = cost_of(p, true);
                        prop_assert!(
                            chosen.is_some_and(|c| (c - least).abs() < 1e-9),
                            "prefill {} costs {chosen:?}, least {least}", p.key()
                        );
                    }
                    (least, p) => prop_assert!(false, "prefill {p:?}, least {least:?}"),
                }
            }
            (Err(a), Err(b)) => prop_assert_eq!(a, b),
            (e, d) => prop_assert!(false, "explain {e:?}, pick {d:?}"),
        }
    }
}
