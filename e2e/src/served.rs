//! kvpick started from command-line flags, as the `kvpick` binary starts it:
//! the flags parsed by [`Args`], the EndpointPickerConfig applied, then
//! [`kvpick::server::run_until`] on free loopback ports, in-process.
//!
//! The ports are chosen here (`--grpc-port`, `--grpc-health-port`,
//! `--metrics-port` appended to the caller's flags), so tests give only the
//! flags they are about. [`ServedKvpick::wait_ready`] waits for gRPC health
//! to answer SERVING, as a readiness probe does; [`ServedKvpick::gateway`]
//! puts a test gateway in front. Dropping it shuts kvpick down.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use clap::Parser;
use kvpick::config::Args;
use kvpick::server::ServeError;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

use crate::gateway::{GatewayConfig, GatewayError, GatewayHandle};
use crate::mock_worker::{WorkerConfig, WorkerHandle};
use crate::stack::write_endpoints;

/// Why a served kvpick did not start or become Ready.
#[derive(Debug, thiserror::Error)]
pub enum ServedError {
    /// The flags were refused.
    #[error("flags refused: {0}")]
    Flags(#[from] clap::Error),
    /// The EndpointPickerConfig was refused.
    #[error("EndpointPickerConfig refused")]
    Config(#[from] kvpick::endpoint_picker_config::EndpointPickerConfigError),
    /// kvpick stopped.
    #[error("kvpick stopped")]
    Stopped(#[source] ServeError),
    /// kvpick's task ended without an error, or panicked.
    #[error("kvpick's task ended")]
    Ended,
    /// gRPC health did not answer SERVING in time.
    #[error("not Ready within {0:?}")]
    NotReady(Duration),
}

/// A kvpick serving on loopback from its flags.
pub struct ServedKvpick {
    grpc: SocketAddr,
    health: SocketAddr,
    metrics: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<Result<(), ServeError>>,
}

/// A loopback port free at the time of asking.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port")
        .port()
}

impl ServedKvpick {
    /// Parses `flags` (after the program name) plus the ports and
    /// `--bind-address=127.0.0.1`, applies the EndpointPickerConfig they name
    /// and starts serving.
    pub fn start<S: AsRef<str>>(flags: &[S]) -> Result<ServedKvpick, ServedError> {
        let (grpc, health, metrics) = (free_port(), free_port(), free_port());
        let ports = [
            "--bind-address=127.0.0.1".to_string(),
            format!("--grpc-port={grpc}"),
            format!("--grpc-health-port={health}"),
            format!("--metrics-port={metrics}"),
        ];
        let argv = std::iter::once("kvpick")
            .chain(flags.iter().map(AsRef::as_ref))
            .chain(ports.iter().map(String::as_str));
        let mut args = Args::try_parse_from(argv)?;
        args.apply_endpoint_picker_config()?;
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(kvpick::server::run_until(args, async move {
            let _ = stopped.await;
        }));
        let at = |port| SocketAddr::from(([127, 0, 0, 1], port));
        Ok(ServedKvpick {
            grpc: at(grpc),
            health: at(health),
            metrics: at(metrics),
            stop: Some(stop),
            task,
        })
    }

    /// The ext_proc address.
    pub fn grpc(&self) -> SocketAddr {
        self.grpc
    }

    /// The Prometheus metrics address.
    pub fn metrics(&self) -> SocketAddr {
        self.metrics
    }

    /// A test gateway on a free loopback port in front of this kvpick, dialing
    /// its default TLS without verifying it (as GIE's Envoy configuration does).
    pub async fn gateway(&self) -> Result<GatewayHandle, GatewayError> {
        GatewayHandle::start(
            ([127, 0, 0, 1], 0).into(),
            GatewayConfig {
                ext_proc: format!("https://{}", self.grpc),
                ext_proc_insecure: true,
                ..GatewayConfig::default()
            },
        )
        .await
    }

    /// Waits until gRPC health answers SERVING for the whole server (`""`),
    /// or fails with why kvpick stopped.
    pub async fn wait_ready(&mut self, within: Duration) -> Result<(), ServedError> {
        let start = Instant::now();
        while start.elapsed() < within {
            if self.task.is_finished() {
                return Err(match (&mut self.task).await {
                    Ok(Err(e)) => ServedError::Stopped(e),
                    _ => ServedError::Ended,
                });
            }
            if self.serving().await {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Err(ServedError::NotReady(within))
    }

    async fn serving(&self) -> bool {
        let Ok(channel) =
            tonic::transport::Endpoint::from_shared(format!("http://{}", self.health))
                .expect("loopback URL")
                .connect()
                .await
        else {
            return false;
        };
        let answer = HealthClient::new(channel)
            .check(HealthCheckRequest {
                service: String::new(),
            })
            .await;
        matches!(answer, Ok(r) if r.get_ref().status == ServingStatus::Serving as i32)
    }
}

impl Drop for ServedKvpick {
    /// Starts the shutdown; the task drains and ends on its own.
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// `n` mock workers at their defaults on loopback, listed in `dir/endpoints.yaml`
/// (`dir` is created) for a standalone kvpick's `--endpoints-file`.
pub async fn listed_workers(dir: &Path, n: usize) -> (Vec<WorkerHandle>, PathBuf) {
    std::fs::create_dir_all(dir).unwrap();
    let mut workers = Vec::new();
    for _ in 0..n {
        workers.push(
            WorkerHandle::start(([127, 0, 0, 1], 0).into(), WorkerConfig::default())
                .await
                .unwrap(),
        );
    }
    let endpoints = dir.join("endpoints.yaml");
    let listed: Vec<_> = workers
        .iter()
        .map(|w| (w.addr(), w.instance_id()))
        .collect();
    write_endpoints(&endpoints, &listed).unwrap();
    (workers, endpoints)
}
