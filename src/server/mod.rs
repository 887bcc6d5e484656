//! Wiring: builds the shared state from [`Args`] and runs the listeners
//! (ext_proc, health, metrics, admin) and discovery until one of them fails.
//!
//! Beside it, what only the server uses: TLS for the ext_proc port ([`tls`]),
//! the admin gRPC service ([`admin`]) and the allocator each kvpick binary
//! installs ([`malloc`]).

pub mod admin;
pub mod malloc;
pub mod tls;

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::watch;
use tonic::transport::server::TcpIncoming;
use tonic::transport::Server;
use tracing::{info, warn};

use crate::admission::metrics::AdmissionMetrics;
use crate::admission::{AdmissionConfig, Gate, Objectives};
use crate::config::Args;
use crate::discovery;
use crate::endpoints::EndpointTable;
use crate::error_chain::ErrorChain;
use crate::extproc::metrics::ExtProcMetrics;
use crate::extproc::{ExtProcService, Shared};
use crate::flow::FlowContext;
use crate::kvevents::metrics::KvEventMetrics;
use crate::kvevents::subscriber::{IngestThread, KvEvents, SubscriberConfig};
use crate::kvevents::KvEventSink;
use crate::multimodal::MmRouting;
use crate::pipeline::Pipeline;
use crate::replica_sync::ReplicaSync;
use crate::scheduler::{Scheduler, SchedulerConfig};
use crate::telemetry::{self, Metrics};
use crate::tokenize::{TokenizeError, Tokenizer, TokenizerPool};
use tls::ServerTls;

/// Why kvpick stopped.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// A listener could not bind.
    #[error("cannot listen on {addr}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The I/O error.
        source: std::io::Error,
    },
    /// TLS set-up failed.
    #[error(transparent)]
    Tls(#[from] tls::TlsError),
    /// The gRPC server failed.
    #[error("gRPC server failed")]
    Grpc(#[from] tonic::transport::Error),
    /// The replica-sync URL is not usable.
    #[error(transparent)]
    ReplicaSync(#[from] crate::replica_sync::resp::RespError),
    /// The metrics server failed.
    #[error("metrics server failed")]
    Metrics(#[source] std::io::Error),
    /// Kubernetes discovery was misconfigured or stopped.
    #[error("Kubernetes discovery failed")]
    Kube(#[from] crate::discovery::kube::KubeError),
    /// The endpoints file could not be watched.
    #[error("file discovery failed")]
    File(#[from] crate::discovery::file::FileError),
    /// The kubeconfig file could not be read or used.
    #[error("cannot use the kubeconfig")]
    Kubeconfig(#[from] kube::config::KubeconfigError),
    /// No in-cluster or local Kubernetes configuration was found.
    #[error("no Kubernetes configuration found")]
    InferConfig(#[from] kube::config::InferConfigError),
    /// The Kubernetes client could not be built from its configuration.
    #[error("cannot build the Kubernetes client")]
    KubeClient(#[from] kube::Error),
    /// The session key file could not be read.
    #[error("cannot read session key file {path}")]
    SessionKey {
        /// The file.
        path: std::path::PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The tokenizer directory could not be loaded.
    #[error("cannot load the tokenizer")]
    Tokenizer(#[from] TokenizeError),
    /// The remote image fetcher could not be set up.
    #[error("cannot set up image fetching")]
    ImageFetch(#[from] crate::multimodal::fetch::ImageFetchSetupError),
    /// `--inference-objectives` is malformed.
    #[error(transparent)]
    Objectives(#[from] crate::admission::priority::ObjectiveSpecError),
    /// No endpoint source was configured.
    #[error(
        "no endpoint source: pass --pool-name NAME, --endpoint-selector K=V --endpoint-target-ports P, \
         or --endpoints-file FILE (standalone mode)"
    )]
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
    /// The ext_proc server's metrics.
    pub extproc_metrics: Arc<ExtProcMetrics>,
    /// In-process tokenizer for text prompts, when configured.
    pub tokenizer: Option<TokenizerPool>,
    /// Admission and flow control (off until [`App::set_admission`] turns it on).
    pub admission: Gate,
    /// Flow-control and objective metrics.
    pub admission_metrics: Arc<AdmissionMetrics>,
    /// Failed metrics scrapes by reason.
    pub scrape_errors: Arc<crate::scrape::ScrapeErrors>,
    /// Multimodal counters (the tokenizer's, or the stream's without one).
    pub mm_stats: Arc<crate::multimodal::MmStats>,
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
        crate::scheduler::metrics::SchedulerMetrics::register(&metrics, Arc::clone(&scheduler));
        if let Some(learner) = scheduler.latency() {
            crate::scheduler::latency_metrics::LatencyMetrics::register(
                &metrics,
                pool,
                Arc::clone(learner),
            );
        }
        let extproc_metrics = ExtProcMetrics::register(&metrics);
        let admission_metrics = AdmissionMetrics::register(&metrics, pool);
        let off = AdmissionConfig {
            enabled: false,
            ..AdmissionConfig::default()
        };
        let admission = Gate::new(off, Arc::default(), admission_metrics.clone());
        admission_metrics.watch(&admission);
        let scrape_errors = Arc::<crate::scrape::ScrapeErrors>::default();
        crate::scrape::ScrapeMetrics::register(&metrics, Arc::clone(&scrape_errors));
        App {
            endpoints: Arc::new(EndpointTable::new()),
            scheduler,
            metrics,
            extproc_metrics,
            tokenizer: None,
            admission,
            admission_metrics,
            scrape_errors,
            mm_stats: Arc::default(),
        }
    }

    /// Sets up admission with `config` over `objectives`.
    pub fn set_admission(&mut self, config: AdmissionConfig, objectives: Arc<Objectives>) {
        self.admission = Gate::new(config, objectives, self.admission_metrics.clone());
        self.admission_metrics.watch(&self.admission);
    }

    /// Runs the flow-control dispatcher until the task is dropped.
    pub fn spawn_admission(&self) -> tokio::task::JoinHandle<()> {
        tokio::spawn(self.admission.clone().run(Arc::clone(&self.endpoints)))
    }

    /// Starts precise mode: the KV-event ingest thread feeding the scheduler's
    /// prefix index, and a task keeping one subscriber per (worker, dp rank) of
    /// the endpoint table (checked every `every`); subscribers come and go with
    /// the endpoint set. [`KvEventsTask::shutdown`] stops them and joins the
    /// ingest thread; dropping the task stops them without waiting.
    pub fn spawn_kv_events(&self, config: SubscriberConfig, every: Duration) -> KvEventsTask {
        let metrics = KvEventMetrics::register(&self.metrics);
        let sink: Arc<dyn KvEventSink> = Arc::clone(&self.scheduler) as _;
        let (events, ingest) = KvEvents::start(sink, metrics, config);
        KvEventsTask {
            follow: tokio::spawn(events.follow(Arc::clone(&self.endpoints), every)),
            ingest: Some(ingest),
        }
    }

    /// Starts replica sync: the scheduler's decisions go to the stream, peers'
    /// come back from it (see [`crate::replica_sync`]). Stops when dropped.
    pub fn spawn_replica_sync(&self, config: crate::replica_sync::SyncConfig) -> ReplicaSync {
        ReplicaSync::start(
            config,
            Arc::clone(&self.scheduler),
            Arc::clone(&self.endpoints),
            crate::replica_sync::SyncMetrics::register(&self.metrics),
        )
    }

    /// Starts polling the `EndpointPickerConfig` file `source`, swapping each
    /// valid change into the scheduler ([`crate::scheduler::reload`]).
    pub fn spawn_config_reload(
        &self,
        source: crate::scheduler::reload::ConfigSource,
    ) -> tokio::task::JoinHandle<()> {
        let metrics = crate::scheduler::reload::ReloadMetrics::register(&self.metrics);
        tokio::spawn(crate::scheduler::reload::watch(
            source,
            Arc::clone(&self.scheduler),
            metrics,
            crate::scheduler::reload::RELOAD_POLL_INTERVAL,
        ))
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
        let pipeline = Pipeline::new(
            self.scheduler.config().prompt_limits(),
            self.tokenizer.clone(),
        )
        .counting_images(Arc::clone(&self.mm_stats));
        let mut flow = FlowContext::new(
            Arc::clone(&self.endpoints),
            Arc::clone(&self.scheduler),
            pipeline,
            self.admission.clone(),
        );
        if let Some(learner) = self.scheduler.latency() {
            flow = flow.observed_by(Arc::clone(learner) as _);
        }
        ExtProcService::new(Shared {
            flow: Arc::new(flow),
            metrics: Arc::clone(&self.metrics),
            extproc_metrics: Arc::clone(&self.extproc_metrics),
            admission_metrics: Some(Arc::clone(&self.admission_metrics)),
            body_budget: crate::extproc::budget::BodyBudget::new(config.body_budget_bytes),
            config,
        })
    }
}

/// Serves ext_proc on `listener`, with TLS when `tls` is set.
pub async fn serve_ext_proc(
    listener: TcpListener,
    service: ExtProcService,
    tls: Option<ServerTls>,
) -> Result<(), ServeError> {
    serve_ext_proc_until(listener, service, tls, std::future::pending()).await
}

/// [`serve_ext_proc`] until `shutdown` completes: then the listener closes (new
/// connections are refused), open connections get a GOAWAY (no new streams),
/// and this returns once every open stream has finished. With TLS, the
/// certificate reload ([`ServerTls::watch`]) runs until then too.
pub async fn serve_ext_proc_until(
    listener: TcpListener,
    service: ExtProcService,
    tls: Option<ServerTls>,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServeError> {
    let router = Server::builder()
        .max_concurrent_streams(Some(MAX_CONCURRENT_STREAMS))
        .http2_keepalive_interval(Some(Duration::from_secs(30)))
        .add_service(service.into_server());
    match tls {
        None => {
            router
                .serve_with_incoming_shutdown(incoming(listener), shutdown)
                .await?
        }
        Some(tls) => {
            let serve = router.serve_with_incoming_shutdown(tls.incoming(listener), shutdown);
            tokio::select! {
                r = serve => r?,
                () = tls.watch() => {}
            }
        }
    }
    Ok(())
}

/// Serves gRPC health on `listener` (plaintext).
pub async fn serve_health(
    listener: TcpListener,
    table: Arc<EndpointTable>,
) -> Result<(), ServeError> {
    serve_health_until(listener, table, watch::channel(false).1).await
}

/// [`serve_health`], turning every service but `liveness` NOT_SERVING once
/// `draining` turns true (and serving that answer until dropped).
pub async fn serve_health_until(
    listener: TcpListener,
    table: Arc<EndpointTable>,
    draining: watch::Receiver<bool>,
) -> Result<(), ServeError> {
    let (reporter, service) = tonic_health::server::health_reporter();
    let server = Server::builder()
        .add_service(service)
        .serve_with_incoming(incoming(listener));
    tokio::select! {
        r = server => r?,
        () = telemetry::drive_health(reporter, table, draining) => {}
    }
    Ok(())
}

/// Completes on SIGTERM (what Kubernetes sends) or SIGINT (Ctrl-C).
pub async fn shutdown_signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::error!(error = %ErrorChain(&e), "cannot listen for SIGTERM");
                std::future::pending::<()>().await
            }
        }
    };
    tokio::select! {
        () = term => info!("SIGTERM received"),
        r = tokio::signal::ctrl_c() => match r {
            Ok(()) => info!("SIGINT received"),
            Err(e) => {
                tracing::error!(error = %ErrorChain(&e), "cannot listen for SIGINT");
                std::future::pending::<()>().await
            }
        },
    }
}

/// Accepted connections with TCP_NODELAY: Nagle's algorithm plus delayed ACKs would
/// add ~40 ms to every small gRPC message.
/// Serves the admin gRPC service on `listener` (plaintext; never returns
/// without one).
pub async fn serve_admin(
    listener: Option<TcpListener>,
    admin: admin::Admin,
) -> Result<(), ServeError> {
    match listener {
        Some(l) => Ok(Server::builder()
            .add_service(admin.into_server())
            .serve_with_incoming(incoming(l))
            .await?),
        None => std::future::pending().await,
    }
}

fn incoming(listener: TcpListener) -> TcpIncoming {
    TcpIncoming::from(listener).with_nodelay(Some(true))
}

async fn bind(addr: SocketAddr) -> Result<TcpListener, ServeError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| ServeError::Bind { addr, source })
}

/// How often the KV-event subscribers are matched to the endpoint set.
const KV_EVENTS_FOLLOW_INTERVAL: Duration = Duration::from_secs(1);

/// How often the scheduler's upkeep runs.
const MAINTENANCE_INTERVAL: Duration = Duration::from_secs(10);

/// The session token key: from `--session-key-file`, else `--session-key`, else
/// random (with a warning: replicas will not honour each other's tokens).
fn session_key(args: &Args) -> Result<Vec<u8>, ServeError> {
    if let Some(path) = &args.sessions.session_key_file {
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
    if let Some(key) = args.sessions.session_key.as_ref().filter(|k| !k.is_empty()) {
        return Ok(key.as_bytes().to_vec());
    }
    tracing::warn!(
        "no session key configured (--session-key-file): using a random per-process key; \
         other replicas and restarts will not honour this replica's session tokens"
    );
    Ok(crate::sessions::random_key())
}

/// Where the endpoint set comes from, as the flags choose it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EndpointSource {
    /// `--endpoints-file`: a static YAML file.
    File(std::path::PathBuf),
    /// `--pool-name` or `--endpoint-selector`: Kubernetes.
    Kube {
        /// Namespace of the pool and its pods.
        namespace: String,
        /// Pool or selector.
        source: discovery::kube::Source,
    },
}

impl EndpointSource {
    /// The source `args` select: an endpoints file, a pool or a selector (the
    /// flags allow one; see [`Args`]).
    pub fn from_args(args: &Args) -> Result<EndpointSource, ServeError> {
        if let Some(path) = &args.discovery.endpoints_file {
            return Ok(EndpointSource::File(path.clone()));
        }
        let source = match (&args.discovery.pool_name, &args.discovery.endpoint_selector) {
            (Some(name), _) if !name.trim().is_empty() => discovery::kube::Source::Pool {
                name: name.trim().to_string(),
                group: discovery::kube::PoolGroup::parse(&args.discovery.pool_group)?,
            },
            (_, Some(selector)) if !selector.trim().is_empty() => {
                discovery::kube::Source::selector(
                    selector,
                    args.discovery
                        .endpoint_target_ports
                        .as_deref()
                        .unwrap_or_default(),
                )?
            }
            _ => return Err(ServeError::NoSource),
        };
        Ok(EndpointSource::Kube {
            namespace: args.discovery.namespace(),
            source,
        })
    }
}

async fn kube_client(args: &Args) -> Result<kube::Client, ServeError> {
    let config = match &args.discovery.kubeconfig {
        Some(path) => {
            let kubeconfig = kube::config::Kubeconfig::read_from(path)?;
            kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default()).await?
        }
        None => kube::Config::infer().await?,
    };
    Ok(kube::Client::try_from(config)?)
}

/// The multimodal routing mode the flags allow.
fn mm_routing(args: &Args) -> MmRouting {
    MmRouting::for_config(
        args.multimodal.tokenizer_dir.is_some(),
        args.multimodal.mm_model_family.is_some(),
    )
}

/// Says at start-up how images will be routed, and why not better.
/// The remote image fetcher `--mm-fetch` asks for, when multimodal routing is
/// exact (elsewhere an image's size and content cannot change its blocks'
/// match with the engine's, and nothing is fetched).
fn remote_images(
    args: &Args,
    exact: bool,
) -> Result<Option<Arc<crate::multimodal::remote::RemoteImages>>, ServeError> {
    let Some((policy, limits)) = args.image_fetch.config() else {
        return Ok(None);
    };
    if !exact {
        warn!("--mm-fetch has no effect without --tokenizer-dir and --mm-model-family: remote images keep their URL identity");
        return Ok(None);
    }
    if policy.allow_private || policy.allow_http {
        warn!(
            allow_private = policy.allow_private,
            allow_http = policy.allow_http,
            "image fetching may reach plain-http or non-public addresses"
        );
    }
    info!(
        ?policy,
        ?limits,
        "fetching remote images to identify them by content"
    );
    let fetcher = crate::multimodal::fetch::HttpImageFetcher::new(
        policy,
        crate::multimodal::fetch::HttpImageFetcher::system_roots(),
    )?;
    Ok(Some(Arc::new(
        crate::multimodal::remote::RemoteImages::new(Arc::new(fetcher), limits),
    )))
}

fn log_mm_routing(args: &Args, image_token: Option<u32>) {
    let mode = mm_routing(args);
    let family = args.multimodal.mm_model_family.map(|f| f.as_str());
    match mode {
        MmRouting::Exact => info!(
            mode = mode.as_str(),
            family,
            ?image_token,
            "multimodal routing: exact (image tokens carry SGLang pad values; vLLM image blocks are matched through extra_keys)"
        ),
        MmRouting::TextOnly => warn!(
            mode = mode.as_str(),
            "multimodal routing: text-only (no --mm-model-family): blocks after an image never match engine blocks"
        ),
        MmRouting::Approximate if family.is_some() => warn!(
            mode = mode.as_str(),
            family,
            "multimodal routing: approximate (--mm-model-family needs --tokenizer-dir): images are kvpick-only blocks"
        ),
        MmRouting::Approximate => info!(
            mode = mode.as_str(),
            "multimodal routing: approximate (no tokenizer): images are kvpick-only blocks keyed by content"
        ),
    }
    if mode == MmRouting::Exact && image_token.is_none() {
        warn!(
            family,
            "the image token is not a single token of this tokenizer: vLLM image blocks cannot be matched (SGLang's can)"
        );
    }
}

/// Runs kvpick as configured by `args` until a component fails or SIGTERM/SIGINT
/// arrives (then drains: see [`run_until`]).
pub async fn run(args: Args) -> Result<(), ServeError> {
    run_until(args, shutdown_signal()).await
}

/// Runs kvpick until a component fails or `shutdown` completes. On shutdown,
/// readiness turns NOT_SERVING, the ext_proc listener closes and open
/// connections take no new streams; open streams may finish until
/// `--drain-timeout-ms`, then whatever is left is dropped and this returns Ok.
/// Every task kvpick starts is owned here and stops when this returns.
pub async fn run_until(
    args: Args,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServeError> {
    let source = EndpointSource::from_args(&args)?;
    let pool = args.discovery.pool();
    let mut app = App::with_scheduler(&pool, args.scheduler(session_key(&args)?));
    let replica_sync = args
        .replica_sync
        .config(&pool)?
        .map(|c| app.spawn_replica_sync(c));
    let vision = args.multimodal.vision_prompt();
    let mut image_token = None;
    if let Some(dir) = &args.multimodal.tokenizer_dir {
        let mut tokenizer = Tokenizer::load(dir)?;
        if let Some(v) = vision.clone() {
            tokenizer = tokenizer.with_vision(v)?;
        }
        image_token = tokenizer.image_token_id();
        info!(dir = %dir.display(), ?tokenizer, "tokenizing requests in-process");
        tokenizer = tokenizer.with_mm_stats(Arc::clone(&app.mm_stats));
        let exact = tokenizer.has_vision();
        let mut pool = TokenizerPool::new(tokenizer, args.multimodal.tokenizer_threads);
        if let Some(remote) = remote_images(&args, exact)? {
            crate::multimodal::metrics::ImageFetchMetrics::register(
                &app.metrics,
                Arc::clone(remote.stats()),
            );
            pool = pool.with_remote_images(remote);
        }
        app.tokenizer = Some(pool);
    } else {
        remote_images(&args, false)?;
    }
    crate::multimodal::metrics::MultimodalMetrics::register(
        &app.metrics,
        Arc::clone(&app.mm_stats),
        mm_routing(&args),
    );
    let static_objectives =
        crate::admission::priority::parse_objectives(&args.flow_control.inference_objectives)?;
    let objectives = Arc::new(Objectives::new(static_objectives.clone()));
    app.set_admission(args.admission(), Arc::clone(&objectives));
    let _admission = AbortOnDrop(app.spawn_admission());
    log_mm_routing(&args, image_token);
    let _maintenance = AbortOnDrop(app.spawn_maintenance(MAINTENANCE_INTERVAL));
    let _config_reload = args
        .endpoint_picker_config_source()
        .map(|source| AbortOnDrop(app.spawn_config_reload(source)));
    // Dropped on an early return (its ingest thread then ends on its own);
    // shut down and joined after a drain.
    let kv_events = args.kv_events.subscriber().map(|mut c| {
        c.image_token = image_token;
        app.spawn_kv_events(c, KV_EVENTS_FOLLOW_INTERVAL)
    });
    app.metrics.set_scrape_staleness(args.scrape_staleness());
    let table = Arc::clone(&app.endpoints);
    let mut _objective_watch: Option<AbortOnDrop> = None;
    let discovery: Pin<Box<dyn Future<Output = Result<(), ServeError>> + Send>> = match source {
        EndpointSource::File(path) => Box::pin(async move {
            Ok(discovery::file::watch(path, table, Duration::from_secs(1)).await?)
        }),
        EndpointSource::Kube { namespace, source } => {
            let client = kube_client(&args).await?;
            if let (true, discovery::kube::Source::Pool { name, group }) =
                (args.flow_control.watch_inference_objectives, &source)
            {
                let pool = discovery::objective::PoolRef {
                    name: name.clone(),
                    group: match group {
                        discovery::kube::PoolGroup::V1 => discovery::pool::GROUP_V1,
                        discovery::kube::PoolGroup::V1Alpha2 => discovery::pool::GROUP_V1ALPHA2,
                    }
                    .to_string(),
                };
                _objective_watch = Some(AbortOnDrop(tokio::spawn(discovery::objective::run(
                    client.clone(),
                    namespace.clone(),
                    pool,
                    static_objectives,
                    objectives,
                ))));
            }
            Box::pin(
                async move { Ok(discovery::kube::run(client, &namespace, source, table).await?) },
            )
        }
    };
    let scrape = crate::scrape::run(
        args.scrape_config(),
        Arc::clone(&app.endpoints),
        Arc::clone(&app.scrape_errors),
    );
    let tls = tls::ext_proc(
        args.tls.secure_serving,
        args.tls.cert_path.as_deref(),
        args.tls.client_ca_path.as_deref(),
    )?
    .map(|tls| {
        let tls = tls.handshake_timeout(args.tls.tls_handshake_timeout_ms);
        match args.tls.cert_reload_interval() {
            Some(every) => tls.reload_every(every),
            None => tls,
        }
    });
    if let Some(tls) = &tls {
        tls::TlsMetrics::register(&app.metrics, tls.stats());
        if args.tls.enable_cert_reload && !tls.reloads() {
            warn!("--enable-cert-reload with neither --cert-path nor --client-ca-path: a self-signed certificate is never reloaded");
        }
    }
    let grpc = bind(SocketAddr::new(
        args.server.bind_address,
        args.server.grpc_port,
    ))
    .await?;
    let health = bind(SocketAddr::new(
        args.server.bind_address,
        args.server.grpc_health_port,
    ))
    .await?;
    let metrics = bind(SocketAddr::new(
        args.server.bind_address,
        args.telemetry.metrics_port,
    ))
    .await?;
    info!(
        %pool,
        grpc = args.server.grpc_port,
        health = args.server.grpc_health_port,
        metrics = args.telemetry.metrics_port,
        tls = args.tls.secure_serving,
        mtls = args.tls.client_ca_path.is_some(),
        cert_reload = args.tls.enable_cert_reload,
        "kvpick listening"
    );
    let admin = match args.telemetry.admin_port {
        0 => None,
        port => {
            let addr = SocketAddr::new(args.telemetry.admin_address, port);
            info!(%addr, "admin gRPC (Explain) listening");
            Some(bind(addr).await?)
        }
    };
    let admin_service = admin::Admin::new(
        Arc::clone(&app.scheduler),
        Arc::clone(&app.endpoints),
        app.tokenizer.clone(),
    );
    let service = app.ext_proc(args.ext_proc());
    let (drain_tx, draining) = watch::channel(false);
    let mut stop = draining.clone();
    let ext_proc = serve_ext_proc_until(grpc, service, tls, async move {
        let _ = stop.wait_for(|d| *d).await;
    });
    tokio::pin!(ext_proc);
    // Everything but ext_proc: runs until it fails (never, normally).
    let others = async {
        tokio::select! {
            r = async {
                // A replica serves health (and so turns Ready) once its warm start is over.
                if let Some(sync) = &replica_sync {
                    sync.wait_ready().await;
                }
                serve_health_until(health, Arc::clone(&app.endpoints), draining).await
            } => r,
            r = telemetry::serve_metrics(metrics, Arc::clone(&app.metrics), Arc::clone(&app.endpoints)) => r.map_err(ServeError::Metrics),
            r = discovery => r,
            () = scrape => Ok(()),
            r = serve_admin(admin, admin_service) => r,
        }
    };
    tokio::pin!(others);
    tokio::select! {
        r = &mut ext_proc => return r,
        r = &mut others => return r,
        () = shutdown => {}
    }
    let deadline = args.server.drain_timeout_ms;
    let open = app.extproc_metrics.streams.get();
    info!(
        open_streams = open,
        ?deadline,
        "shutting down: readiness NOT_SERVING, draining ext_proc streams"
    );
    drain_tx.send_replace(true);
    tokio::select! {
        r = &mut ext_proc => {
            r?;
            info!("every ext_proc stream finished; exiting");
        }
        r = &mut others => r?,
        () = tokio::time::sleep(deadline) => {
            tracing::warn!(
                open_streams = app.extproc_metrics.streams.get(),
                "drain deadline passed; closing the remaining streams"
            );
        }
    }
    if let Some(k) = kv_events {
        k.shutdown().await;
    }
    Ok(())
}

/// Precise mode's running parts ([`App::spawn_kv_events`]): the task following
/// the endpoint set (it owns the subscribers) and the ingest thread.
pub struct KvEventsTask {
    follow: tokio::task::JoinHandle<()>,
    ingest: Option<IngestThread>,
}

impl KvEventsTask {
    /// Stops every subscriber, then waits for the ingest thread to apply what
    /// they queued and end (it ends when the last sender of its queue is gone).
    pub async fn shutdown(mut self) {
        self.follow.abort();
        let _ = (&mut self.follow).await;
        if let Some(ingest) = self.ingest.take() {
            ingest.join().await;
        }
    }
}

impl Drop for KvEventsTask {
    /// Stops the subscribers without waiting: the ingest thread then ends on its
    /// own once their queue closes.
    fn drop(&mut self) {
        self.follow.abort();
    }
}

/// Aborts a background task when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[test]
    fn a_stop_error_prints_each_cause_once() {
        let io = || std::io::Error::other("address in use");
        let chain = |e: &ServeError| ErrorChain(e).to_string();
        assert_eq!(
            chain(&ServeError::Metrics(io())),
            "metrics server failed: address in use"
        );
        let bind = ServeError::Bind {
            addr: "0.0.0.0:9002".parse().unwrap(),
            source: io(),
        };
        assert_eq!(
            chain(&bind),
            "cannot listen on 0.0.0.0:9002: address in use"
        );
        let tokenizer = ServeError::Tokenizer(TokenizeError::Io {
            path: "tokenizer.json".into(),
            source: io(),
        });
        assert_eq!(
            chain(&tokenizer),
            "cannot load the tokenizer: cannot read tokenizer.json: address in use"
        );
    }

    fn source(argv: &[&str]) -> Result<EndpointSource, ServeError> {
        EndpointSource::from_args(&Args::try_parse_from(argv).unwrap())
    }

    #[test]
    fn flags_choose_the_endpoint_source() {
        assert!(matches!(
            source(&["kvpick", "--endpoints-file", "e.yaml"]),
            Ok(EndpointSource::File(_))
        ));
        // With a file, `--pool-name` names the pool and is no second source.
        assert!(matches!(
            source(&["kvpick", "--endpoints-file", "e.yaml", "--pool-name", "p"]),
            Ok(EndpointSource::File(_))
        ));
        // Two sources are refused, not resolved by precedence.
        for two in [
            &["--endpoints-file", "e.yaml", "--endpoint-selector", "app=x"],
            &["--pool-name", "p", "--endpoint-selector", "app=x"],
        ] {
            let argv = std::iter::once("kvpick").chain(two.iter().copied());
            let err = Args::try_parse_from(argv).unwrap_err();
            assert_eq!(err.kind(), clap::error::ErrorKind::ArgumentConflict);
        }
        match source(&["kvpick", "--pool-name", "p", "--pool-namespace", "team"]).unwrap() {
            EndpointSource::Kube { namespace, source } => {
                assert_eq!(namespace, "team");
                assert!(matches!(source, discovery::kube::Source::Pool { .. }));
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            source(&[
                "kvpick",
                "--pool-namespace",
                "team",
                "--endpoint-selector",
                "app=x",
                "--endpoint-target-ports",
                "8000"
            ]),
            Ok(EndpointSource::Kube {
                source: discovery::kube::Source::Selector(_),
                ..
            })
        ));
        assert!(matches!(
            source(&["kvpick", "--endpoint-selector", "app=x"]),
            Err(ServeError::Kube(_))
        ));
        assert!(matches!(
            source(&["kvpick", "--pool-name", "p", "--pool-group", "example.com"]),
            Err(ServeError::Kube(_))
        ));
        assert!(matches!(source(&["kvpick"]), Err(ServeError::NoSource)));
    }
}
