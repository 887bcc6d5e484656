//! Wiring: builds the shared state from [`Args`] and runs the listeners
//! (ext_proc, health, metrics) and discovery until one of them fails.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Server, ServerTlsConfig};
use tracing::info;

use crate::config::Args;
use crate::discovery;
use crate::endpoints::EndpointTable;
use crate::extproc::{ExtProcService, Shared};
use crate::scheduler::{Scheduler, SchedulerConfig};
use crate::telemetry::{self, Metrics};

/// Why kvpick stopped.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// A listener could not bind.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The I/O error.
        source: std::io::Error,
    },
    /// TLS set-up failed.
    #[error(transparent)]
    Tls(#[from] crate::tls::TlsError),
    /// The gRPC server failed.
    #[error("gRPC server: {0}")]
    Grpc(#[from] tonic::transport::Error),
    /// The metrics server failed.
    #[error("metrics server: {0}")]
    Metrics(std::io::Error),
    /// Discovery failed.
    #[error("discovery: {0}")]
    Discovery(String),
    /// The session key file could not be read.
    #[error("session key file {path}: {source}")]
    SessionKey {
        /// The file.
        path: std::path::PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// No endpoint source was configured.
    #[error("no endpoint source: pass --endpoints-file FILE (standalone mode)")]
    NoSource,
}

/// Concurrent HTTP/2 streams allowed per ext_proc connection (Envoy multiplexes
/// every request of a gateway over few connections).
const MAX_CONCURRENT_STREAMS: u32 = 100_000;

/// Everything the picker shares between its tasks.
pub struct App {
    /// The live endpoint set.
    pub endpoints: Arc<EndpointTable>,
    /// The routing core.
    pub scheduler: Arc<Scheduler>,
    /// Metrics.
    pub metrics: Arc<Metrics>,
}

impl App {
    /// Fresh state for a pool named `pool`, with default scheduler settings.
    pub fn new(pool: &str) -> Self {
        Self::with_scheduler(pool, SchedulerConfig::default())
    }

    /// Fresh state for a pool named `pool`, scheduling with `scheduler`.
    pub fn with_scheduler(pool: &str, scheduler: SchedulerConfig) -> Self {
        let scheduler = Arc::new(Scheduler::new(scheduler));
        let metrics = Arc::new(Metrics::new(pool));
        metrics.register_scheduler(Arc::clone(&scheduler));
        App {
            endpoints: Arc::new(EndpointTable::new()),
            scheduler,
            metrics,
        }
    }

    /// Runs the scheduler's periodic upkeep (session reaping, index expiry,
    /// forgetting gone workers) every `every`, until the task is dropped.
    pub fn spawn_maintenance(&self, every: Duration) -> tokio::task::JoinHandle<()> {
        let scheduler = Arc::clone(&self.scheduler);
        let endpoints = Arc::clone(&self.endpoints);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let reaped = scheduler.maintain(&endpoints.snapshot(), std::time::Instant::now());
                if reaped > 0 {
                    tracing::debug!(reaped, "expired sessions reaped");
                }
            }
        })
    }

    /// The ext_proc service over this state.
    pub fn ext_proc(&self, config: crate::extproc::ExtProcConfig) -> ExtProcService {
        ExtProcService::new(Shared {
            endpoints: Arc::clone(&self.endpoints),
            scheduler: Arc::clone(&self.scheduler),
            metrics: Arc::clone(&self.metrics),
            config,
        })
    }
}

/// Serves ext_proc on `listener`, with TLS when `tls` is set.
pub async fn serve_ext_proc(
    listener: TcpListener,
    service: ExtProcService,
    tls: Option<ServerTlsConfig>,
) -> Result<(), ServeError> {
    let mut builder = Server::builder()
        .max_concurrent_streams(Some(MAX_CONCURRENT_STREAMS))
        .http2_keepalive_interval(Some(Duration::from_secs(30)));
    if let Some(tls) = tls {
        builder = builder.tls_config(tls)?;
    }
    builder
        .add_service(service.into_server())
        .serve_with_incoming(incoming(listener))
        .await?;
    Ok(())
}

/// Serves gRPC health on `listener` (plaintext).
pub async fn serve_health(
    listener: TcpListener,
    table: Arc<EndpointTable>,
) -> Result<(), ServeError> {
    let (reporter, service) = tonic_health::server::health_reporter();
    tokio::spawn(telemetry::drive_health(reporter, table));
    Server::builder()
        .add_service(service)
        .serve_with_incoming(incoming(listener))
        .await?;
    Ok(())
}

/// Accepted connections with TCP_NODELAY: Nagle's algorithm plus delayed ACKs would
/// add ~40 ms to every small gRPC message.
fn incoming(listener: TcpListener) -> TcpIncoming {
    TcpIncoming::from(listener).with_nodelay(Some(true))
}

async fn bind(addr: SocketAddr) -> Result<TcpListener, ServeError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| ServeError::Bind { addr, source })
}

/// How often the scheduler's upkeep runs.
const MAINTENANCE_INTERVAL: Duration = Duration::from_secs(10);

/// The session token key: from `--session-key-file`, else `--session-key`, else
/// random (with a warning: replicas will not honour each other's tokens).
fn session_key(args: &Args) -> Result<Vec<u8>, ServeError> {
    if let Some(path) = &args.session_key_file {
        let bytes = std::fs::read(path).map_err(|source| ServeError::SessionKey {
            path: path.clone(),
            source,
        })?;
        let key = bytes.trim_ascii().to_vec();
        if !key.is_empty() {
            return Ok(key);
        }
        tracing::warn!(path = %path.display(), "session key file is empty");
    }
    if let Some(key) = args.session_key.as_ref().filter(|k| !k.is_empty()) {
        return Ok(key.as_bytes().to_vec());
    }
    tracing::warn!(
        "no session key configured (--session-key-file): using a random per-process key; \
         other replicas and restarts will not honour this replica's session tokens"
    );
    Ok(crate::sessions::random_key())
}

/// Runs kvpick as configured by `args` until a component fails.
pub async fn run(args: Args) -> Result<(), ServeError> {
    let app = App::with_scheduler(&pool_label(&args), args.scheduler(session_key(&args)?));
    let _maintenance = AbortOnDrop(app.spawn_maintenance(MAINTENANCE_INTERVAL));
    let discovery = match &args.endpoints_file {
        Some(path) => {
            let path = path.clone();
            let table = Arc::clone(&app.endpoints);
            tokio::spawn(async move {
                discovery::file::watch(path, table, Duration::from_secs(1))
                    .await
                    .map_err(|e| ServeError::Discovery(e.to_string()))
            })
        }
        None => return Err(ServeError::NoSource),
    };
    let tls = if args.secure_serving {
        Some(match &args.cert_path {
            Some(dir) => crate::tls::from_dir(dir)?,
            None => crate::tls::self_signed(&["localhost"])?.0,
        })
    } else {
        None
    };
    let grpc = bind(SocketAddr::new(args.bind_address, args.grpc_port)).await?;
    let health = bind(SocketAddr::new(args.bind_address, args.grpc_health_port)).await?;
    let metrics = bind(SocketAddr::new(args.bind_address, args.metrics_port)).await?;
    info!(
        grpc = args.grpc_port,
        health = args.grpc_health_port,
        metrics = args.metrics_port,
        tls = args.secure_serving,
        "kvpick listening"
    );
    let service = app.ext_proc(args.ext_proc());
    tokio::select! {
        r = serve_ext_proc(grpc, service, tls) => r,
        r = serve_health(health, Arc::clone(&app.endpoints)) => r,
        r = telemetry::serve_metrics(metrics, Arc::clone(&app.metrics), Arc::clone(&app.endpoints)) => r.map_err(ServeError::Metrics),
        r = discovery => r.map_err(|e| ServeError::Discovery(e.to_string()))?,
    }
}

/// Aborts a background task when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

fn pool_label(args: &Args) -> String {
    args.endpoints_file
        .as_ref()
        .map(|p| p.display().to_string())
        .unwrap_or_default()
}
