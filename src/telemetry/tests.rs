//! The registry rendered: scheduler, pool and endpoint families.

use std::sync::Arc;
use std::time::Duration;

use super::*;
use crate::endpoints::EndpointTable;
use crate::endpoints::{Endpoint, ScrapedLoad};
use crate::scheduler::{PickRequest, Scheduler, SchedulerConfig};

#[test]
fn renders_scheduler_metrics() {
    let metrics = Metrics::new("pool");
    let scheduler = Arc::new(Scheduler::new(SchedulerConfig::default()));
    crate::scheduler::metrics::SchedulerMetrics::register(&metrics, Arc::clone(&scheduler));
    let table = EndpointTable::new();
    table.replace(vec![crate::endpoints::Endpoint::new(
        "10.0.0.1:80".parse().unwrap(),
    )]);
    let body = crate::request::parse(
        format!(r#"{{"model":"m","prompt":"{}"}}"#, "a".repeat(64 * 3)).as_bytes(),
        None,
    )
    .unwrap();
    let req = PickRequest {
        body: Some(&body),
        ..Default::default()
    };
    for _ in 0..2 {
        let d = scheduler.pick(&req, &table.snapshot()).unwrap();
        scheduler.finish(&d, Some(200));
    }
    let text = metrics.render(&table);
    for line in [
        "kvpick_prefix_blocks_queried_total 6",
        "kvpick_prefix_blocks_matched_total 3",
        "kvpick_session_repicks_total 0",
        "kvpick_session_rehomes_total 0",
        "kvpick_session_evictions_total 0",
        "kvpick_prefix_precise_dropped_blocks_total 0",
        "kvpick_prefix_index_entries 3",
        "kvpick_session_bindings 0",
        "kvpick_scheduler_stage_duration_seconds_count{stage=\"lookup\"} 2",
        "kvpick_scheduler_stage_duration_seconds_bucket{le=\"+Inf\",stage=\"hash\"} 2",
    ] {
        assert!(text.contains(line), "missing {line:?} in\n{text}");
    }
}

fn ep(addr: &str, pod: &str) -> Endpoint {
    let mut e = Endpoint::new(addr.parse().unwrap());
    e.name = pod.to_string();
    e
}

fn gauge_line<'a>(text: &'a str, prefix: &str) -> &'a str {
    text.lines()
        .find(|l| l.starts_with(prefix))
        .unwrap_or_else(|| panic!("no {prefix} in\n{text}"))
}

#[test]
fn pool_gauges_use_fresh_scrapes_only() {
    let table = EndpointTable::new();
    table.replace(vec![
        ep("10.0.0.1:8000", "ns/a"),
        ep("10.0.0.1:8001", "ns/a"),
        ep("10.0.0.2:8000", "ns/b"),
        ep("10.0.0.3:8000", "ns/c"),
    ]);
    let snap = table.snapshot();
    let now = std::time::Instant::now();
    let load = |queue: f64, kv: f64, at| ScrapedLoad {
        queue,
        running: 0.0,
        kv_usage: kv,
        block_size: None,
        num_blocks: None,
        at,
    };
    snap.endpoints[0].set_scraped(load(2.0, 0.2, now));
    snap.endpoints[1].set_scraped(load(4.0, 0.4, now));
    snap.endpoints[2].set_scraped(load(6.0, 0.6, now));
    // Stale: ignored.
    snap.endpoints[3].set_scraped(load(100.0, 1.0, now - Duration::from_secs(10)));
    let metrics = Metrics::new("pool");
    let text = metrics.render(&table);
    assert!(gauge_line(&text, "inference_pool_ready_pods{").ends_with(" 3"));
    let kv: f64 = gauge_line(&text, "inference_pool_average_kv_cache_utilization{")
        .rsplit(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!((kv - 0.4).abs() < 1e-9, "{kv}");
    assert!(gauge_line(&text, "inference_pool_average_queue_size{").ends_with(" 4.0"));
    assert!(gauge_line(
        &text,
        "inference_pool_per_pod_queue_size{name=\"pool\",model_server_pod=\"a\"}"
    )
    .ends_with(" 6.0"));
    assert!(!text.contains("model_server_pod=\"c\""));
}

/// llm-d Router v0.10.0's pool gauges carry the same figures under its names.
#[test]
fn llm_d_pool_gauges_follow_fresh_scrapes() {
    let table = EndpointTable::new();
    table.replace(vec![
        ep("10.0.0.1:8000", "ns/a"),
        ep("10.0.0.2:8000", "ns/b"),
        ep("10.0.0.3:8000", "ns/c"),
    ]);
    let snap = table.snapshot();
    let now = std::time::Instant::now();
    let load = |queue: f64, running: f64, kv: f64, at| ScrapedLoad {
        queue,
        running,
        kv_usage: kv,
        block_size: None,
        num_blocks: None,
        at,
    };
    snap.endpoints[0].set_scraped(load(2.0, 1.0, 0.25, now));
    snap.endpoints[1].set_scraped(load(6.0, 5.0, 0.75, now));
    snap.endpoints[2].set_scraped(load(100.0, 100.0, 1.0, now - Duration::from_secs(10)));
    let metrics = Metrics::new("pool");
    let text = metrics.render(&table);
    let value = |prefix: &str| -> f64 {
        gauge_line(&text, prefix)
            .rsplit(' ')
            .next()
            .unwrap()
            .parse()
            .unwrap()
    };
    assert_eq!(
        value("llm_d_epp_average_kv_cache_utilization{name=\"pool\"}"),
        0.5
    );
    assert_eq!(value("llm_d_epp_average_queue_size{name=\"pool\"}"), 4.0);
    assert_eq!(
        value("llm_d_epp_average_running_requests{name=\"pool\"}"),
        3.0
    );
    assert_eq!(
        value("llm_d_epp_per_endpoint_queue_size{name=\"pool\",model_server_endpoint=\"b\"}"),
        6.0
    );
    assert!(!text.contains("model_server_endpoint=\"c\""));
    // An endpoint that leaves the pool leaves the per-endpoint family.
    table.replace(vec![ep("10.0.0.1:8000", "ns/a")]);
    table.snapshot().endpoints[0].set_scraped(load(2.0, 1.0, 0.25, now));
    let text = metrics.render(&table);
    assert!(!text.contains("model_server_endpoint=\"b\""), "{text}");
}
