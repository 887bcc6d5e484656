//! Passive health and load staleness as the pick sees them.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::endpoints::{Endpoint, EndpointTable, ScrapedLoad};
use crate::fixtures::with_body;
use crate::scheduler::cost::pick_index;
use crate::scheduler::terms::load;
use crate::scheduler::*;

/// A snapshot of two endpoints, 10.0.0.1:80 and 10.0.0.2:80.
fn two() -> Arc<Snapshot> {
    let t = EndpointTable::new();
    t.replace(vec![
        Endpoint::new("10.0.0.1:80".parse().unwrap()),
        Endpoint::new("10.0.0.2:80".parse().unwrap()),
    ]);
    t.snapshot()
}

fn prompt() -> InferenceRequest {
    crate::fixtures::prompt("hello there")
}

/// A pick forced onto endpoint `i` with a subset hint.
fn pick_on(
    s: &Scheduler,
    req: &PickRequest<'_>,
    snap: &Snapshot,
    i: usize,
    now: Instant,
) -> Decision {
    let only = [snap.endpoints[i].endpoint.address_string()];
    let forced = PickRequest {
        subset: Some(&only),
        ..*req
    };
    s.pick_at(&forced, snap, now).unwrap()
}

fn addr(d: &Decision) -> String {
    d.decode.endpoint().address_string()
}

#[test]
fn an_endpoint_failing_responses_sits_out_a_growing_backoff() {
    let (s, snap, body) = (Scheduler::default(), two(), prompt());
    let req = with_body(&body);
    let t0 = Instant::now();
    let mut ejected = 0;
    for _ in 0..HealthConfig::default().failures {
        // Envoy's local reply when the pod refuses connections.
        let on = pick_on(&s, &req, &snap, 0, t0);
        ejected += usize::from(s.record_response(&on, 503, t0));
        s.finish_at(&on, Some(503), t0);
    }
    assert_eq!(ejected, 1);
    for _ in 0..50 {
        let d = s
            .pick_at(&req, &snap, t0 + Duration::from_millis(900))
            .unwrap();
        assert_eq!(addr(&d), "10.0.0.2:80");
        s.finish_at(&d, Some(200), t0);
    }
    // Back on probation after 1 s; one more failure ejects it for 2 s.
    let t1 = t0 + Duration::from_secs(1);
    let probe = pick_on(&s, &req, &snap, 0, t1);
    assert!(s.record_response(&probe, 502, t1));
    s.finish_at(&probe, Some(502), t1);
    for _ in 0..20 {
        let d = s
            .pick_at(&req, &snap, t1 + Duration::from_millis(1900))
            .unwrap();
        assert_eq!(addr(&d), "10.0.0.2:80");
        s.finish_at(&d, Some(200), t1);
    }
    // Every endpoint ejected: all are tried rather than none.
    for _ in 0..3 {
        let on = pick_on(&s, &req, &snap, 1, t1);
        s.record_response(&on, 500, t1);
        s.finish_at(&on, Some(500), t1);
    }
    assert!(s.pick_at(&req, &snap, t1).is_ok());
}

#[test]
fn failed_requests_do_not_make_a_worker_look_idle() {
    // The failure's cost is its own term: it holds with the active-load term
    // weighted 0 as well.
    for decode in [load::TERM.weight.default_value(), 0.0] {
        let s = Scheduler::new(SchedulerConfig {
            plugins: Plugins::with_weights(&TermWeights::default().with(&load::TERM, decode), 0.0),
            ..Default::default()
        });
        let (snap, body) = (two(), prompt());
        let req = with_body(&body);
        let now = Instant::now();
        // One failure (below the ejection threshold) on the first endpoint.
        let failed = pick_on(&s, &req, &snap, 0, now);
        assert!(!s.record_response(&failed, 503, now));
        s.finish_at(&failed, Some(503), now);
        assert!(snap.endpoints[0].health().available(now));
        for _ in 0..50 {
            let d = s.pick_at(&req, &snap, now).unwrap();
            assert_eq!(
                addr(&d),
                "10.0.0.2:80",
                "a failing worker looked idle (load weight {decode})"
            );
            s.record_response(&d, 200, now);
            s.finish_at(&d, Some(200), now);
        }
    }
}

#[test]
fn a_stale_or_failing_scrape_makes_an_endpoint_more_expensive() {
    let (s, snap, body) = (Scheduler::default(), two(), prompt());
    let req = with_body(&body);
    let t0 = Instant::now();
    let load = |queue: f64, kv_usage: f64, at: Instant| ScrapedLoad {
        queue,
        running: 0.0,
        kv_usage,
        block_size: None,
        num_blocks: None,
        at,
    };
    // The first endpoint was idle when last scraped, then its scrapes stopped.
    snap.endpoints[0].set_scraped(load(0.0, 0.0, t0));
    let later = t0 + Duration::from_secs(30);
    snap.endpoints[1].set_scraped(load(0.5, 0.5, later));
    for _ in 0..30 {
        let d = s.pick_at(&req, &snap, later).unwrap();
        assert_eq!(addr(&d), "10.0.0.2:80", "a stale scrape looked idle");
        s.finish_at(&d, Some(200), later);
    }
    // A scrape that just failed counts the same, before the figures age out.
    snap.endpoints[0].set_scraped(load(0.0, 0.0, later));
    snap.endpoints[0].set_scrape_failed(later);
    for _ in 0..30 {
        let d = s.pick_at(&req, &snap, later).unwrap();
        assert_eq!(addr(&d), "10.0.0.2:80", "a failing scrape looked idle");
        s.finish_at(&d, Some(200), later);
    }
}

#[test]
fn one_infinite_cost_never_poisons_the_softmax() {
    let mut rng = rand::rng();
    let mut hits = [0usize; 3];
    for _ in 0..3000 {
        hits[pick_index(&[1.0, 2.0, f64::INFINITY], 0.5, &mut rng)] += 1;
    }
    assert_eq!(hits[2], 0, "{hits:?}");
    assert!(hits[0] > hits[1] && hits[1] > 0, "{hits:?}");
    for _ in 0..100 {
        let i = pick_index(&[f64::NAN, 3.0, f64::INFINITY], 1.0, &mut rng);
        assert_eq!(i, 1);
    }
}

#[test]
fn one_request_books_at_most_the_per_request_cap() {
    let cap = 100;
    let s = Scheduler::new(SchedulerConfig {
        max_request_load_blocks: cap,
        ..Default::default()
    });
    let snap = two();
    // An output-length hint of u32::MAX tokens: uncapped, ~268M blocks booked on
    // one worker by one request.
    let hinted = crate::request::parse(
        br#"{"model": "m", "prompt": "x", "nvext": {"agent_hints": {"osl": 4294967295}}}"#,
        None,
    )
    .unwrap();
    let d = s
        .pick_at(&with_body(&hinted), &snap, Instant::now())
        .unwrap();
    assert_eq!(d.load_blocks + d.decode_blocks, cap);
    assert_eq!(d.decode.booked_blocks(), cap);
    // A prompt larger than the cap books the cap, and no output on top.
    let long = format!(r#"{{"model": "m", "prompt": "{}"}}"#, "y".repeat(64 * 1000));
    let long = crate::request::parse(long.as_bytes(), None).unwrap();
    let d2 = pick_on(&s, &with_body(&long), &snap, 0, Instant::now());
    assert_eq!((d2.load_blocks, d2.decode_blocks), (cap, 0));
    s.finish(&d, Some(200));
    s.finish(&d2, Some(200));
    assert_eq!(d.decode.booked_blocks(), 0);
    assert_eq!(d2.decode.booked_blocks(), 0);
}

#[test]
fn a_subset_hint_cannot_move_or_rebind_another_callers_session() {
    let s = Scheduler::default();
    let snap = two();
    let t0 = Instant::now();
    let body = |action: &str| {
        let mut sc = serde_json::json!({"session_id": "victim"});
        if !action.is_empty() {
            sc["action"] = action.into();
        }
        let json =
            serde_json::json!({"model": "m", "prompt": "hi", "nvext": {"session_control": sc}});
        crate::request::parse(json.to_string().as_bytes(), None).unwrap()
    };
    let open = body("open");
    let home = pick_on(&s, &with_body(&open), &snap, 0, t0);
    s.finish_at(&home, Some(200), t0);
    assert_eq!(s.sessions().get("victim", t0), Some(home.decode.key()));

    // Another caller names the other worker in a subset hint, with the victim's
    // session id, and forges a successful response.
    for action in ["open", ""] {
        let turn = body(action);
        let d = pick_on(&s, &with_body(&turn), &snap, 1, t0);
        assert_ne!(d.decode.key(), home.decode.key());
        assert!(d.session.is_none(), "the turn went without the session");
        assert!(
            s.response_headers(&d).is_none(),
            "no token for the other worker"
        );
        s.finish_at(&d, Some(200), t0);
        assert_eq!(
            s.sessions().get("victim", t0),
            Some(home.decode.key()),
            "{action}: the session stays on its worker"
        );
    }
}

#[test]
fn a_worker_never_scraped_costs_its_bookings_not_a_full_cache() {
    let s = Scheduler::default();
    let snap = two();
    let t0 = Instant::now();
    let body = crate::request::parse(
        serde_json::json!({"model": "m", "prompt": "e".repeat(64 * 38)})
            .to_string()
            .as_bytes(),
        None,
    )
    .unwrap();
    let req = with_body(&body);
    let hashes = s.block_hashes(&body);
    for e in &snap.endpoints {
        s.index().insert(e.key(0), &hashes, t0);
    }
    // The first is scraped and nearly idle; the second serves no /metrics.
    snap.endpoints[0].set_scraped(ScrapedLoad {
        queue: 0.0,
        running: 0.0,
        kv_usage: 0.05,
        block_size: None,
        num_blocks: None,
        at: t0,
    });
    snap.endpoints[1].set_scrape_failed(t0);
    let explained = s.explain(&req, &snap, t0).unwrap();
    let [scraped, unscraped] = &explained.candidates[..] else {
        panic!("two candidates")
    };
    assert_eq!(unscraped.overlap_blocks, scraped.overlap_blocks);
    use crate::scheduler::terms::LoadSource;
    assert_eq!(
        (scraped.load_source, unscraped.load_source),
        (LoadSource::Scraped, LoadSource::Unscraped),
        "explain says where each candidate's load comes from"
    );
    assert_eq!(
        (
            unscraped.terms.get("queue"),
            unscraped.terms.get("kv_usage")
        ),
        (0.0, 0.0)
    );
    assert!(
        unscraped.terms.total() <= scraped.terms.total(),
        "an unscraped worker costed as full: {unscraped:?} vs {scraped:?}"
    );
    assert!(unscraped.chosen);
    // One request at a time: the unscraped worker is not avoided.
    let mut to_unscraped = 0;
    for _ in 0..20 {
        let d = s.pick_at(&req, &snap, t0).unwrap();
        to_unscraped += usize::from(addr(&d) == "10.0.0.2:80");
        s.finish_at(&d, Some(200), t0);
    }
    assert_eq!(to_unscraped, 20, "the idle unscraped worker was avoided");
}
