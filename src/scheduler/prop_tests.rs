//! Arbitrary client-supplied values through the body parser, then the
//! scheduler's `pick` and `finish`: every input is an answer or an error,
//! never a panic (overflowing timeouts, huge sizes, odd ids, many dp ranks).

use std::time::{Duration, Instant};

use proptest::prelude::*;
use serde_json::{json, Value};

use super::*;
use crate::endpoints::{Endpoint, EndpointTable};

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
