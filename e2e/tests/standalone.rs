//! Standalone mode started as a GIE chart starts its EPP: the reference EPP's
//! flags (pool name, namespace, group, log encoder, EndpointPickerConfig,
//! leader election, verbosity) plus `--endpoints-file` start kvpick, and it
//! serves over its default TLS (self-signed, not verified, as GIE's Envoy
//! configuration dials the EPP).

use std::time::Duration;

use e2e::client::Client;
use e2e::served::{listed_workers, ServedKvpick};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gie_reference_epp_flags_with_an_endpoints_file_start_and_serve() {
    let dir = std::env::temp_dir().join(format!("kvpick-gie-flags-{}", std::process::id()));
    let (workers, endpoints) = listed_workers(&dir, 2).await;
    let config = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/fixtures/gie-v1.5.0/chart-default-plugins.yaml"
    );
    let endpoints_flag = format!("--endpoints-file={}", endpoints.display());
    let mut kvpick = ServedKvpick::start(&[
        "--pool-name",
        "llama",
        "--pool-namespace",
        "team",
        "--pool-group",
        "inference.networking.k8s.io",
        "--zap-encoder",
        "json",
        "--config-file",
        config,
        "--ha-enable-leader-election",
        "--tracing=false",
        "--metrics-endpoint-auth=false",
        "--v",
        "3",
        &endpoints_flag,
    ])
    .expect("the flags start kvpick");
    kvpick.wait_ready(Duration::from_secs(20)).await.unwrap();

    let gateway = kvpick.gateway().await.unwrap();
    let body = json!({
        "model": "mock-model",
        "messages": [{"role": "user", "content": "Which worker?"}],
        "max_tokens": 4,
    });
    let reply = Client::new(gateway.addr())
        .post_json("/v1/chat/completions", &body, &[("x-request-id", "gie-1")])
        .await
        .unwrap();
    assert!(
        reply.status.is_success(),
        "{}: {}",
        reply.status,
        reply.text()
    );
    let served: Vec<_> = workers
        .iter()
        .filter(|w| {
            w.seen()
                .requests
                .iter()
                .any(|r| r.request_id.as_deref() == Some("gie-1"))
        })
        .collect();
    assert_eq!(served.len(), 1, "one worker served the request");
    let page = Client::new(kvpick.metrics())
        .get("/metrics")
        .await
        .unwrap()
        .text();
    assert!(
        page.contains(r#"inference_pool_ready_pods{name="llama"} 2"#),
        "{page}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
