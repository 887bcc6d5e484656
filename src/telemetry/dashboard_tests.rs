//! The Grafana dashboards held against what kvpick serves.

/// Names GIE's own Grafana dashboard reads (v1.5.0, vendored), held against what kvpick
/// serves.
mod gie {
    /// Metric family names in the dashboard's queries (`_bucket`, `_count`, `_sum` and
    /// `_total` stripped, the bare `inference_pool` prefix of a regex skipped).
    fn dashboard_families(dashboard: &str) -> std::collections::BTreeSet<String> {
        let mut names = std::collections::BTreeSet::new();
        let mut rest = dashboard;
        while let Some(at) = rest.find("inference_") {
            let tail = &rest[at..];
            let len = tail
                .find(|c: char| !(c.is_ascii_lowercase() || c == '_'))
                .unwrap_or(tail.len());
            let mut name = &tail[..len];
            for suffix in ["_bucket", "_count", "_sum", "_total"] {
                name = name.strip_suffix(suffix).unwrap_or(name);
            }
            if name != "inference_pool" {
                names.insert(name.to_string());
            }
            rest = &tail[len..];
        }
        names
    }

    /// Flow-control families the dashboard reads that kvpick does not measure yet.
    const NOT_YET: [&str; 2] = [
        "inference_extension_flow_control_dispatch_cycle_duration_seconds",
        "inference_extension_flow_control_request_enqueue_duration_seconds",
    ];

    #[test]
    fn serves_every_family_gies_dashboard_reads() {
        use crate::admission::{AdmissionObserver, Outcome, RequestClass};
        use crate::endpoints::{Endpoint, ScrapedLoad};
        let dashboard = include_str!("../../tests/fixtures/gie-v1.5.0/inference_gateway.json");
        let wanted = dashboard_families(dashboard);
        assert!(wanted.len() >= 16, "{wanted:?}");
        // One request's worth of every recorder, so each family has a sample.
        let app = crate::server::App::new("pool");
        app.endpoints
            .replace(vec![Endpoint::new("10.0.0.1:8000".parse().unwrap())]);
        app.endpoints.snapshot().endpoints[0].set_scraped(ScrapedLoad {
            queue: 1.0,
            running: 1.0,
            kv_usage: 0.5,
            block_size: None,
            num_blocks: None,
            at: std::time::Instant::now(),
        });
        let class = RequestClass {
            priority: 0,
            flow: "m".into(),
            objective: "".into(),
            model: "m".into(),
            bytes: 10,
        };
        let m = &app.admission_metrics;
        m.classified(&class);
        m.left(&class, Outcome::Dispatched, std::time::Duration::ZERO);
        m.error(&class, "BadRequest");
        m.request_size(&class, 10);
        let usage = crate::request::usage::Usage {
            prompt_tokens: 3,
            completion_tokens: 4,
        };
        m.finished(&class, std::time::Duration::from_millis(5), 20, Some(usage));
        let text = app.metrics.render(&app.endpoints);
        let missing: Vec<&String> = wanted
            .iter()
            .filter(|name| !NOT_YET.contains(&name.as_str()))
            .filter(|name| !text.contains(&format!("# TYPE {name} ")))
            .collect();
        assert!(missing.is_empty(), "not served: {missing:?}\n{text}");
        for name in NOT_YET {
            assert!(
                wanted.contains(name),
                "{name} left the dashboard: drop it here"
            );
        }
    }

    /// GIE's dashboard reads counters as `x_total` and flow-control queues
    /// that must read 0 when empty: scraped in the Prometheus text format (as
    /// GIE's Go EPP serves it), with nothing queued.
    #[test]
    fn an_empty_queue_scrapes_as_zero_and_counters_as_gies_epp_names_them() {
        use crate::admission::{AdmissionObserver, RequestClass};
        let dashboard = include_str!("../../tests/fixtures/gie-v1.5.0/inference_gateway.json");
        let app = crate::server::App::new("pool");
        let class = RequestClass {
            priority: 0,
            flow: "m".into(),
            objective: "".into(),
            model: "m".into(),
            bytes: 10,
        };
        app.admission_metrics.classified(&class);
        app.admission_metrics.error(&class, "BadRequest");
        let text = crate::telemetry::prometheus_text(&app.metrics.render(&app.endpoints));
        for family in [
            "inference_extension_flow_control_queue_size",
            "inference_extension_flow_control_queue_bytes",
        ] {
            assert!(dashboard.contains(family));
            let line =
                format!("{family}{{fairness_id=\"\",priority=\"0\",inference_pool=\"pool\"}} 0");
            assert!(text.lines().any(|l| l == line), "no {line} in\n{text}");
        }
        for counter in [
            "inference_objective_request_total",
            "inference_objective_request_error_total",
        ] {
            assert!(dashboard.contains(counter));
            assert!(
                text.contains(&format!("# TYPE {counter} counter\n")),
                "{counter}\n{text}"
            );
            assert!(text.contains(&format!("# HELP {counter} ")), "{counter}");
            assert!(text.contains(&format!("\n{counter}{{")), "{counter}");
        }
        assert!(!text.contains("# EOF") && !text.contains(" unknown\n"));
        // Every family keeps its samples: only HELP and TYPE lines are renamed.
        let page = app.metrics.render(&app.endpoints);
        let samples = |t: &str| t.lines().filter(|l| !l.starts_with('#')).count();
        assert_eq!(samples(&text), samples(&page));
    }

    #[test]
    fn the_accept_header_picks_the_exposition_format() {
        use crate::telemetry::wants_openmetrics;
        let prometheus = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";
        assert!(wants_openmetrics(Some(prometheus)));
        assert!(wants_openmetrics(Some("application/openmetrics-text")));
        assert!(!wants_openmetrics(None));
        assert!(!wants_openmetrics(Some("*/*")));
        assert!(!wants_openmetrics(Some("text/plain;version=0.0.4")));
        assert!(!wants_openmetrics(Some(
            "application/openmetrics-text;q=0.3,text/plain;q=0.9"
        )));
        assert!(!wants_openmetrics(Some("application/openmetrics-text;q=0")));
    }

    #[test]
    fn serves_build_info_and_llm_d_core_names() {
        let app = crate::server::App::new("pool");
        let text = app.metrics.render(&app.endpoints);
        for name in [
            "inference_extension_info",
            "llm_d_epp_info",
            "kvpick_scrape_errors",
            "llm_d_epp_datalayer_poll_errors",
            "llm_d_epp_datalayer_extract_errors",
        ] {
            assert!(
                text.contains(&format!("# TYPE {name} ")),
                "{name} not served"
            );
        }
        assert!(text.contains(&format!(
            "inference_extension_info{{commit=\"{}\",build_ref=\"{}\"}} 1",
            option_env!("KVPICK_GIT_COMMIT").unwrap_or("unknown"),
            env!("CARGO_PKG_VERSION")
        )));
    }
}

/// kvpick's own Grafana dashboard (`charts/kvpick/dashboards/kvpick.json`) held
/// against a live scrape: every series name and label its PromQL reads is one
/// kvpick serves, so the dashboard cannot rot.
mod kvpick {
    use std::collections::BTreeSet;

    const DASHBOARD: &str = include_str!("../../charts/kvpick/dashboards/kvpick.json");

    /// Every panel query of the dashboard.
    fn queries() -> Vec<String> {
        let d: serde_json::Value = serde_json::from_str(DASHBOARD).expect("the dashboard is JSON");
        d["panels"]
            .as_array()
            .expect("panels")
            .iter()
            .flat_map(|p| p["targets"].as_array().cloned().unwrap_or_default())
            .map(|t| {
                t["expr"]
                    .as_str()
                    .expect("every target has an expr")
                    .to_string()
            })
            .collect()
    }

    /// Series names a query reads and the labels it names (in matchers and in
    /// `by`/`ignoring`/`without`/`on`). A series name is an identifier outside
    /// matchers, ranges and groupings that is neither a call nor a keyword.
    fn names_and_labels(q: &str) -> (BTreeSet<String>, BTreeSet<String>) {
        let ident = regex::Regex::new(r"[a-zA-Z_][a-zA-Z0-9_:]*").unwrap();
        let grouping = regex::Regex::new(r"\b(?:by|ignoring|without|on)\s*\(([^)]*)\)").unwrap();
        let matcher = regex::Regex::new(r"\{([^}]*)\}").unwrap();
        let range = regex::Regex::new(r"\[[^\]]*\]").unwrap();
        let label = regex::Regex::new(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)").unwrap();
        let mut labels = BTreeSet::new();
        for c in grouping.captures_iter(q) {
            labels.extend(ident.find_iter(&c[1]).map(|m| m.as_str().to_string()));
        }
        for c in matcher.captures_iter(q) {
            labels.extend(label.captures_iter(&c[1]).map(|l| l[1].to_string()));
        }
        let bare = grouping.replace_all(q, " ");
        let bare = matcher.replace_all(&bare, " ");
        let bare = range.replace_all(&bare, " ");
        const KEYWORDS: [&str; 7] = [
            "group_left",
            "group_right",
            "bool",
            "offset",
            "and",
            "or",
            "unless",
        ];
        let names = ident
            .find_iter(&bare)
            .filter(|m| !bare[m.end()..].trim_start().starts_with('('))
            .map(|m| m.as_str())
            .filter(|n| !KEYWORDS.contains(n))
            .map(str::to_string)
            .collect();
        (names, labels)
    }

    /// A scrape (the Prometheus text format, as Prometheus reads it) with a
    /// sample in every family the dashboard reads: one endpoint routed to,
    /// KV-event, replica-sync and latency-model metrics registered, a flow-control outcome
    /// and a KV-event reset counted.
    fn live_scrape() -> String {
        use crate::admission::{AdmissionObserver, Outcome, RequestClass};
        use crate::endpoints::Endpoint;
        use crate::scheduler::PickRequest;
        let app = crate::server::App::new("pool");
        app.endpoints
            .replace(vec![Endpoint::new("10.0.0.1:8000".parse().unwrap())]);
        let decision = app
            .scheduler
            .pick(&PickRequest::default(), &app.endpoints.snapshot())
            .unwrap();
        let _in_flight = decision.begin();
        let class = RequestClass {
            priority: 0,
            flow: "m".into(),
            objective: "".into(),
            model: "m".into(),
            bytes: 10,
        };
        app.admission_metrics.classified(&class);
        app.admission_metrics
            .left(&class, Outcome::Dispatched, std::time::Duration::ZERO);
        let kv = crate::kvevents::metrics::KvEventMetrics::register(&app.metrics);
        kv.reset(
            crate::keys::WorkerKey {
                instance_id: 1,
                dp_rank: 0,
            },
            crate::kvevents::queue::ResetReason::Gap,
        );
        crate::replica_sync::SyncMetrics::register(&app.metrics);
        crate::scheduler::latency_metrics::LatencyMetrics::register(
            &app.metrics,
            "pool",
            std::sync::Arc::new(crate::latency::Learner::new(Default::default())),
        );
        crate::telemetry::prometheus_text(&app.metrics.render(&app.endpoints))
    }

    /// What `q` reads that `text` does not serve: series names, and labels on
    /// none of the query's series; and the series it reads.
    fn unserved(q: &str, text: &str) -> (Vec<String>, BTreeSet<String>) {
        let (names, labels) = names_and_labels(q);
        let samples: Vec<&str> = text
            .lines()
            .filter(|l| !l.starts_with('#'))
            .filter(|l| {
                names.iter().any(|n| {
                    l.strip_prefix(n.as_str())
                        .is_some_and(|rest| rest.starts_with(['{', ' ']))
                })
            })
            .collect();
        let mut missing: Vec<String> = names
            .iter()
            .filter(|n| !samples.iter().any(|l| l.starts_with(n.as_str())))
            .map(|n| format!("series {n}"))
            .collect();
        missing.extend(
            labels
                .iter()
                .filter(|l| !samples.iter().any(|s| s.contains(&format!("{l}=\""))))
                .map(|l| format!("label {l}")),
        );
        (missing, names)
    }

    #[test]
    fn every_series_and_label_the_kvpick_dashboard_reads_is_served() {
        let text = live_scrape();
        let queries = queries();
        assert!(queries.len() >= 12, "{queries:?}");
        let mut read = BTreeSet::new();
        for q in &queries {
            let (missing, names) = unserved(q, &text);
            assert!(!names.is_empty(), "no series in {q}");
            assert!(
                missing.is_empty(),
                "{q} reads {missing:?}, not served:\n{text}"
            );
            read.extend(names);
        }
        // The figures the dashboard exists for.
        for family in [
            "kvpick_prefix_blocks_matched_total",
            "kvpick_decision_cost_blocks_total",
            "kvpick_endpoint_in_flight_requests",
            "kvpick_session_repicks_total",
            "kvpick_kv_events_ingest_lag_seconds_bucket",
            "kvpick_kv_events_resets_total",
            "inference_extension_flow_control_request_queue_duration_seconds_count",
            "kvpick_replica_sync_applied_deltas_total",
            "kvpick_latency_prediction_error_ratio_bucket",
            "kvpick_latency_fallback_decisions_total",
        ] {
            assert!(read.contains(family), "no panel reads {family}");
        }
    }

    #[test]
    fn the_check_catches_a_name_or_label_kvpick_does_not_serve() {
        let text = live_scrape();
        let q = "sum by (pod) (rate(kvpick_prefix_blocks_hit_total[5m])) + sum(kvpick_decisions_total{tenant=\"a\"})";
        let (missing, _) = unserved(q, &text);
        assert_eq!(
            missing,
            [
                "series kvpick_prefix_blocks_hit_total",
                "label pod",
                "label tenant"
            ]
        );
        let (missing, _) = unserved("sum by (term) (kvpick_decision_cost_blocks_total)", &text);
        assert!(missing.is_empty(), "{missing:?}");
    }
}
