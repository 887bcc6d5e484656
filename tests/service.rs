//! gRPC health and Prometheus exposition over loopback.

use std::sync::Arc;
use std::time::Duration;

use kvpick::endpoints::Endpoint;
use kvpick::server::{serve_health, App};
use kvpick::telemetry::{serve_metrics, RequestResult};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

async fn status(
    client: &mut HealthClient<tonic::transport::Channel>,
    service: &str,
) -> ServingStatus {
    let resp = client
        .check(HealthCheckRequest {
            service: service.to_string(),
        })
        .await
        .unwrap()
        .into_inner();
    ServingStatus::try_from(resp.status).unwrap()
}

#[tokio::test]
async fn health_turns_serving_once_endpoints_are_known() {
    let app = App::new("pool");
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(serve_health(listener, Arc::clone(&app.endpoints)));
    let ch = tonic::transport::Channel::from_shared(format!("http://127.0.0.1:{port}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut client = HealthClient::new(ch);
    // Let the reporter publish its initial statuses.
    let mut ready = false;
    for _ in 0..100 {
        if status(&mut client, "liveness").await == ServingStatus::Serving {
            ready = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(ready, "liveness never became SERVING");
    for svc in [
        "",
        "readiness",
        "envoy.service.ext_proc.v3.ExternalProcessor",
    ] {
        assert_eq!(
            status(&mut client, svc).await,
            ServingStatus::NotServing,
            "{svc:?}"
        );
    }
    app.endpoints
        .replace(vec![Endpoint::new("10.0.0.1:80".parse().unwrap())]);
    for svc in [
        "",
        "readiness",
        "envoy.service.ext_proc.v3.ExternalProcessor",
    ] {
        let mut ok = false;
        for _ in 0..100 {
            if status(&mut client, svc).await == ServingStatus::Serving {
                ok = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(ok, "{svc:?} never became SERVING");
    }
}

#[tokio::test]
async fn metrics_are_exposed_with_gie_names() {
    let app = App::new("my-pool");
    app.endpoints.replace(vec![
        Endpoint::new("10.0.0.1:80".parse().unwrap()),
        Endpoint::new("10.0.0.2:80".parse().unwrap()),
    ]);
    let snap = app.endpoints.snapshot();
    let _busy = snap.endpoints[0].begin_request(0);
    app.metrics.record_result(RequestResult::Routed);
    app.metrics.record_decision(Duration::from_micros(30));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(serve_metrics(
        listener,
        Arc::clone(&app.metrics),
        Arc::clone(&app.endpoints),
    ));
    let scrape = |accept: &'static str| async move {
        let mut stream = TcpStream::connect(addr).await.unwrap();
        let req = format!("GET /metrics HTTP/1.1\r\nhost: x\r\n{accept}connection: close\r\n\r\n");
        stream.write_all(req.as_bytes()).await.unwrap();
        let mut text = String::new();
        stream.read_to_string(&mut text).await.unwrap();
        assert!(text.starts_with("HTTP/1.1 200"), "{text}");
        text
    };
    // Prometheus asks for OpenMetrics first; a plain scraper gets GIE's format.
    let prometheus = "accept: application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1\r\n";
    let open = scrape(prometheus).await;
    assert!(open.contains("application/openmetrics-text"), "{open}");
    assert!(open.contains("# TYPE kvpick_requests counter"), "{open}");
    assert!(open.trim_end().ends_with("# EOF"), "{open}");
    let text = scrape("").await;
    assert!(text.contains("text/plain; version=0.0.4"), "{text}");
    assert!(
        text.contains("# TYPE kvpick_requests_total counter"),
        "{text}"
    );
    assert!(!text.contains("# EOF"), "{text}");
    for needle in [
        "inference_pool_ready_pods{name=\"my-pool\"} 2",
        "kvpick_requests_total{result=\"routed\"} 1",
        "inference_extension_scheduler_e2e_duration_seconds_count 1",
        "kvpick_endpoint_in_flight_requests{endpoint=\"10.0.0.1:80\",dp_rank=\"0\"} 1",
        "kvpick_endpoint_in_flight_requests{endpoint=\"10.0.0.2:80\",dp_rank=\"0\"} 0",
    ] {
        assert!(text.contains(needle), "missing {needle:?} in\n{text}");
    }
}
