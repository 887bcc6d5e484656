//! gRPC health: the services kvpick answers for and how their status follows
//! the endpoint set and shutdown.

use std::sync::Arc;

use tonic_health::server::HealthReporter;
use tonic_health::ServingStatus;

use crate::endpoints::EndpointTable;

/// Health service names kvpick answers for.
pub const HEALTH_SERVICES: &[&str] = &[
    "",
    "readiness",
    "inference-extension",
    "envoy.service.ext_proc.v3.ExternalProcessor",
];

/// Drives gRPC health: `liveness` is SERVING from the start (the process works);
/// `""`, `readiness` and the ext_proc service turn SERVING once the endpoint set
/// is known and stay so (a lost API server keeps serving from the last state),
/// and NOT_SERVING for good once `draining` turns true (shutdown). Returns never.
pub async fn drive_health(
    reporter: HealthReporter,
    table: Arc<EndpointTable>,
    mut draining: tokio::sync::watch::Receiver<bool>,
) {
    reporter
        .set_service_status("liveness", ServingStatus::Serving)
        .await;
    for svc in HEALTH_SERVICES {
        reporter
            .set_service_status(*svc, ServingStatus::NotServing)
            .await;
    }
    let mut synced = table.subscribe_synced();
    tokio::select! {
        synced_ok = async { synced.wait_for(|s| *s).await.is_ok() } => {
            if synced_ok {
                for svc in HEALTH_SERVICES {
                    reporter
                        .set_service_status(*svc, ServingStatus::Serving)
                        .await;
                }
            }
        }
        _ = async { draining.wait_for(|d| *d).await.is_ok() } => {}
    }
    // Err: the sender is gone, so no shutdown will ever be announced.
    let drained = draining.wait_for(|d| *d).await.is_ok();
    if drained {
        for svc in HEALTH_SERVICES {
            reporter
                .set_service_status(*svc, ServingStatus::NotServing)
                .await;
        }
    }
    std::future::pending().await
}
