//! The whole path on one machine, in-process: kvpick in standalone mode (ext_proc
//! plus the endpoints-file watcher), mock workers and the test gateway, all on
//! 127.0.0.1 ephemeral ports. Tests and the demo start it with [`Stack::start`].

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kvpick::endpoints::EndpointTable;
use kvpick::extproc::ExtProcConfig;
use kvpick::server::App;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::{JoinHandle, JoinSet};

use crate::gateway::{BodyMode, FailureMode, GatewayConfig, GatewayHandle};
use crate::mock_worker::{WorkerConfig, WorkerHandle};

/// Why the stack could not start or change.
#[derive(Debug, thiserror::Error)]
pub enum StackError {
    /// File or socket I/O.
    #[error("i/o failed")]
    Io(#[from] std::io::Error),
    /// A worker failed to start.
    #[error(transparent)]
    Worker(#[from] crate::mock_worker::WorkerError),
    /// The gateway failed to start.
    #[error(transparent)]
    Gateway(#[from] crate::gateway::GatewayError),
    /// The self-signed certificate could not be made.
    #[error(transparent)]
    Tls(#[from] kvpick::server::tls::TlsError),
    /// The precise-mode tokenizer could not be loaded.
    #[error(transparent)]
    Tokenizer(#[from] kvpick::tokenize::TokenizeError),
    /// The replica-sync URL is not usable.
    #[error(transparent)]
    ReplicaSync(#[from] kvpick::replica_sync::resp::RespError),
    /// kvpick did not load the expected endpoints in time.
    #[error("kvpick did not pick up {0} endpoints in time")]
    NotSynced(usize),
}

/// Writes a standalone endpoints file (atomically: readers never see half a file).
pub fn write_endpoints(path: &Path, endpoints: &[(SocketAddr, u64)]) -> std::io::Result<()> {
    let plain: Vec<_> = endpoints.iter().map(|&(a, id)| (a, id, None)).collect();
    write_endpoints_with_roles(path, &plain)
}

/// One endpoints-file entry: address, instance id, optional `(role, engine)`.
pub type EndpointEntry<'a> = (SocketAddr, u64, Option<(&'a str, &'a str)>);

/// [`write_endpoints`] with an optional `(role, engine)` per endpoint.
pub fn write_endpoints_with_roles(
    path: &Path,
    endpoints: &[EndpointEntry<'_>],
) -> std::io::Result<()> {
    let mut yaml = String::from("endpoints:\n");
    for (addr, id, role) in endpoints {
        yaml.push_str(&format!("  - address: {addr}\n    instance_id: {id}\n"));
        if let Some((role, engine)) = role {
            yaml.push_str(&format!("    role: {role}\n    engine: {engine}\n"));
        }
    }
    if endpoints.is_empty() {
        yaml = "endpoints: []\n".into();
    }
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, yaml)?;
    std::fs::rename(&tmp, path)
}

/// An endpoints-file entry: address, instance id, and optionally the engine type
/// and KV-event port.
pub type EventsEntry<'a> = (SocketAddr, u64, Option<(&'a str, u16)>);

/// [`write_endpoints`] with, per endpoint, the engine type and KV-event port.
pub fn write_endpoints_with_events(
    path: &Path,
    endpoints: &[EventsEntry<'_>],
) -> std::io::Result<()> {
    let mut yaml = String::from("endpoints:\n");
    for (addr, id, events) in endpoints {
        yaml.push_str(&format!("  - address: {addr}\n    instance_id: {id}\n"));
        if let Some((engine, port)) = events {
            yaml.push_str(&format!(
                "    engine: {engine}\n    kv_events_port: {port}\n"
            ));
        }
    }
    if endpoints.is_empty() {
        yaml = "endpoints: []\n".into();
    }
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, yaml)?;
    std::fs::rename(&tmp, path)
}

/// Starts `n` workers on one port, each on its own loopback address
/// (`127.0.0.1`, `127.0.0.2`, …), as pods of one InferencePool have one target
/// port on distinct pod IPs.
pub async fn start_workers_on_one_port(
    n: usize,
    config: &WorkerConfig,
) -> Result<Vec<WorkerHandle>, StackError> {
    let mut last = None;
    for _attempt in 0..20 {
        let first = WorkerHandle::start(([127, 0, 0, 1], 0).into(), config.clone()).await?;
        let port = first.addr().port();
        let mut workers = vec![first];
        for i in 1..n {
            let addr: SocketAddr = ([127, 0, 0, 1 + i as u8], port).into();
            match WorkerHandle::start(addr, config.clone()).await {
                Ok(w) => workers.push(w),
                Err(e) => {
                    last = Some(e);
                    break;
                }
            }
        }
        if workers.len() == n {
            return Ok(workers);
        }
    }
    Err(last.map_or(StackError::NotSynced(n), StackError::Worker))
}

/// kvpick running in-process behind a TCP front that can be cut like a killed
/// process (every open connection drops), and restarted on the same address
/// with fresh state.
pub struct Kvpick {
    addr: SocketAddr,
    tls: Option<kvpick::server::tls::ServerTls>,
    precise: Option<Precise>,
    endpoints_file: PathBuf,
    poll: Duration,
    app: App,
    tasks: Vec<JoinHandle<()>>,
    /// Precise mode's subscribers and ingest thread.
    events: Option<kvpick::server::KvEventsTask>,
    /// The replica-sync server URL, if this kvpick is one of several replicas.
    replica_sync: Option<String>,
    /// Replica sync's tasks.
    sync: Option<kvpick::replica_sync::ReplicaSync>,
    /// Settings a test varies.
    tuning: Tuning,
}

/// kvpick settings an end-to-end test varies (the rest are the defaults).
#[derive(Debug, Clone, Copy)]
pub struct Tuning {
    /// `--max-endpoints`: the pick and its fallbacks.
    pub max_endpoints: usize,
    /// `--conformance-test-hooks`.
    pub conformance_test_hooks: bool,
    /// `--scoring`.
    pub scoring: kvpick::scheduler::ScoringMode,
}

impl Default for Tuning {
    fn default() -> Self {
        Tuning {
            max_endpoints: 1,
            conformance_test_hooks: false,
            scoring: kvpick::scheduler::ScoringMode::Heuristic,
        }
    }
}

impl Kvpick {
    /// Starts kvpick reading `endpoints_file`, listening on `addr` (port 0: any).
    /// With `tls`, ext_proc is served over TLS.
    pub async fn start(
        addr: SocketAddr,
        endpoints_file: PathBuf,
        poll: Duration,
        tls: Option<kvpick::server::tls::ServerTls>,
    ) -> Result<Kvpick, StackError> {
        Self::start_with(addr, endpoints_file, poll, tls, None, Tuning::default()).await
    }

    /// [`Kvpick::start`], in precise mode when `precise` is given, with `tuning`.
    pub async fn start_with(
        addr: SocketAddr,
        endpoints_file: PathBuf,
        poll: Duration,
        tls: Option<kvpick::server::tls::ServerTls>,
        precise: Option<Precise>,
        tuning: Tuning,
    ) -> Result<Kvpick, StackError> {
        let mut k = Kvpick {
            addr,
            tls,
            precise,
            endpoints_file,
            poll,
            app: App::new("e2e"),
            tasks: Vec::new(),
            events: None,
            replica_sync: None,
            sync: None,
            tuning,
        };
        k.launch(TcpListener::bind(addr).await?).await?;
        Ok(k)
    }

    /// Starts one kvpick replica sharing routing state through the Redis
    /// server at `sync_url`; returns once its warm start is over (Ready).
    pub async fn start_replica(
        endpoints_file: PathBuf,
        poll: Duration,
        sync_url: &str,
    ) -> Result<Kvpick, StackError> {
        Self::start_replica_with(endpoints_file, poll, sync_url, Tuning::default()).await
    }

    /// [`Kvpick::start_replica`] with `tuning`.
    pub async fn start_replica_with(
        endpoints_file: PathBuf,
        poll: Duration,
        sync_url: &str,
        tuning: Tuning,
    ) -> Result<Kvpick, StackError> {
        let mut k = Kvpick {
            addr: ([127, 0, 0, 1], 0).into(),
            tls: None,
            precise: None,
            endpoints_file,
            poll,
            app: App::new("e2e"),
            tasks: Vec::new(),
            events: None,
            replica_sync: Some(sync_url.to_string()),
            sync: None,
            tuning,
        };
        k.launch(TcpListener::bind(k.addr).await?).await?;
        Ok(k)
    }

    /// Replica sync's state (peers, metrics), when this kvpick is a replica.
    pub fn replica_sync(&self) -> Option<&kvpick::replica_sync::ReplicaSync> {
        self.sync.as_ref()
    }

    /// The routing core.
    pub fn scheduler(&self) -> &Arc<kvpick::scheduler::Scheduler> {
        &self.app.scheduler
    }

    /// Starts a fresh kvpick behind `front` (replacing any state), and with
    /// replica sync waits for its warm start.
    async fn launch(&mut self, front: TcpListener) -> Result<(), StackError> {
        self.addr = front.local_addr()?;
        let mut app = App::with_scheduler(
            "e2e",
            kvpick::scheduler::SchedulerConfig {
                max_endpoints: self.tuning.max_endpoints,
                scoring: self.tuning.scoring,
                ..Default::default()
            },
        );
        let mut events = None;
        if let Some(p) = &self.precise {
            let mut tok = kvpick::tokenize::Tokenizer::load(&p.tokenizer_dir)?;
            if let Some(v) = p.vision.clone() {
                tok = tok.with_vision(v)?;
            }
            let image_token = tok.image_token_id();
            app.tokenizer = Some(kvpick::tokenize::TokenizerPool::new(tok, 2));
            events = Some(app.spawn_kv_events(
                kvpick::kvevents::subscriber::SubscriberConfig {
                    model: p.model.clone(),
                    image_token,
                    retry_delay: Duration::from_millis(50),
                    ..Default::default()
                },
                Duration::from_millis(50),
            ));
        }
        let sync = match &self.replica_sync {
            Some(url) => {
                let mut c = kvpick::replica_sync::SyncConfig::new(url, "e2e")?;
                c.lease = Duration::from_secs(2);
                c.report_every = Duration::from_millis(200);
                c.warm_start_timeout = Duration::from_secs(5);
                c.models_every = Duration::from_millis(200);
                Some(app.spawn_replica_sync(c))
            }
            None => None,
        };
        let inner = TcpListener::bind("127.0.0.1:0").await?;
        let inner_addr = inner.local_addr()?;
        let service = app.ext_proc(ExtProcConfig {
            conformance_test_hooks: self.tuning.conformance_test_hooks,
            ..ExtProcConfig::default()
        });
        let tls = self.tls.clone();
        let grpc = tokio::spawn(async move {
            if let Err(e) = kvpick::server::serve_ext_proc(inner, service, tls).await {
                tracing::error!(error = %e, "kvpick ext_proc server stopped");
            }
        });
        let table = Arc::clone(&app.endpoints);
        let path = self.endpoints_file.clone();
        let poll = self.poll;
        let discovery = tokio::spawn(async move {
            if let Err(e) = kvpick::discovery::file::watch(path, table, poll).await {
                tracing::error!(error = %e, "kvpick file discovery stopped");
            }
        });
        if let Some(s) = &sync {
            // Ready only after loading the shared state (or the bound).
            s.wait_ready().await;
        }
        let proxy = tokio::spawn(tcp_front(front, inner_addr));
        self.app = app;
        self.tasks = vec![grpc, discovery, proxy];
        self.events = events;
        self.sync = sync;
        Ok(())
    }

    /// The ext_proc address the gateway dials.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The live endpoint table.
    pub fn endpoints(&self) -> &Arc<EndpointTable> {
        &self.app.endpoints
    }

    /// Waits until kvpick's table holds exactly `n` endpoints.
    pub async fn wait_for_endpoints(&self, n: usize) -> Result<(), StackError> {
        for _ in 0..400 {
            let t = &self.app.endpoints;
            if t.is_synced() && t.snapshot().endpoints.len() == n {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        Err(StackError::NotSynced(n))
    }

    /// Waits until `n` worker ranks are in precise mode (their KV-event streams
    /// are connected).
    pub async fn wait_for_precise(&self, n: usize) -> Result<(), StackError> {
        for _ in 0..400 {
            let snap = self.app.endpoints.snapshot();
            let idx = self.app.scheduler.index();
            let live = snap
                .endpoints
                .iter()
                .filter(|e| idx.is_precise(e.key(0)))
                .count();
            if live >= n {
                // Subscribed is not yet receiving (ZMQ's slow joiner): settle.
                tokio::time::sleep(Duration::from_millis(200)).await;
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        Err(StackError::NotSynced(n))
    }

    /// Kills kvpick: the listener and every open ext_proc connection close.
    pub async fn stop(&mut self) {
        for t in self.tasks.drain(..) {
            t.abort();
            let _ = t.await;
        }
        if let Some(events) = self.events.take() {
            events.shutdown().await;
        }
        self.sync = None;
    }

    /// Starts a fresh kvpick (new state) on the same address.
    pub async fn restart(&mut self) -> Result<(), StackError> {
        self.stop().await;
        let front = TcpListener::bind(self.addr).await?;
        self.launch(front).await
    }
}

impl Kvpick {
    /// Cancels kvpick's tasks without waiting for them.
    fn abort(&self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl Drop for Kvpick {
    fn drop(&mut self) {
        self.abort();
    }
}

/// Forwards every connection on `front` to `to`; aborting the task cuts them all.
async fn tcp_front(front: TcpListener, to: SocketAddr) {
    let mut conns = JoinSet::new();
    loop {
        tokio::select! {
            accepted = front.accept() => {
                let Ok((mut down, _)) = accepted else { continue };
                let _ = down.set_nodelay(true);
                conns.spawn(async move {
                    if let Ok(mut up) = TcpStream::connect(to).await {
                        let _ = up.set_nodelay(true);
                        let _ = tokio::io::copy_bidirectional(&mut down, &mut up).await;
                    }
                });
            }
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
}

/// How to build a [`Stack`].
#[derive(Debug, Clone)]
pub struct StackOptions {
    /// Number of mock workers.
    pub workers: usize,
    /// Settings of every worker (instance ids are left to the bound address).
    pub worker: WorkerConfig,
    /// Worker `i` runs at `speeds[i]` ([`WorkerConfig::speed`]) where given.
    pub speeds: Vec<f64>,
    /// The gateway's body mode.
    pub body_mode: BodyMode,
    /// The gateway's failure mode; fail-open falls back to the workers.
    pub failure_mode: FailureMode,
    /// How often kvpick polls the endpoints file.
    pub poll: Duration,
    /// Serve ext_proc over TLS with a self-signed certificate the gateway trusts.
    pub tls: bool,
    /// With `tls`: the gateway skips certificate verification instead of trusting it.
    pub tls_insecure: bool,
    /// The gateway sends a subset hint naming the workers at these indices.
    pub subset: Option<Vec<usize>>,
    /// kvpick in precise mode (the workers publish KV events).
    pub precise: Option<Precise>,
    /// `(role, engine)` of each worker in the endpoints file (disaggregated
    /// pools); empty lists no roles.
    pub roles: Vec<(&'static str, &'static str)>,
    /// kvpick's settings.
    pub tuning: Tuning,
}

/// kvpick in precise mode: requests tokenized in-process, KV events from every
/// worker (started with a publisher), endpoints listed with their engine.
#[derive(Debug, Clone)]
pub struct Precise {
    /// The model's tokenizer directory.
    pub tokenizer_dir: PathBuf,
    /// The vision model, for exact multimodal routing.
    pub vision: Option<kvpick::multimodal::VisionPrompt>,
    /// The workers' engine type (`vllm`, `sglang`).
    pub engine: &'static str,
    /// The model name requests carry (event blocks are keyed under it).
    pub model: String,
}

impl Default for StackOptions {
    fn default() -> Self {
        StackOptions {
            workers: 4,
            worker: WorkerConfig {
                ttft: Duration::from_millis(2),
                prefill_per_token: Duration::from_micros(2),
                itl: Duration::from_micros(200),
                ..WorkerConfig::default()
            },
            speeds: Vec::new(),
            body_mode: BodyMode::FullDuplex,
            failure_mode: FailureMode::Close,
            poll: Duration::from_millis(20),
            tls: false,
            tls_insecure: false,
            subset: None,
            precise: None,
            roles: Vec::new(),
            tuning: Tuning::default(),
        }
    }
}

/// client → test gateway → kvpick → mock workers.
pub struct Stack {
    dir: PathBuf,
    /// The standalone endpoints file kvpick watches.
    pub endpoints_file: PathBuf,
    /// The workers, in start order.
    pub workers: Vec<WorkerHandle>,
    /// kvpick.
    pub kvpick: Kvpick,
    /// The gateway.
    pub gateway: GatewayHandle,
}

static NEXT_DIR: AtomicU64 = AtomicU64::new(0);

impl Stack {
    /// Starts everything and waits until kvpick knows every worker.
    pub async fn start(opts: StackOptions) -> Result<Stack, StackError> {
        let dir = std::env::temp_dir().join(format!(
            "kvpick-e2e-{}-{}",
            std::process::id(),
            NEXT_DIR.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir)?;
        let local: SocketAddr = ([127, 0, 0, 1], 0).into();
        let mut workers = Vec::with_capacity(opts.workers);
        let mut worker_config = opts.worker.clone();
        if opts.precise.is_some() && worker_config.kv_events_port.is_none() {
            worker_config.kv_events_port = Some(0);
        }
        for i in 0..opts.workers {
            let config = WorkerConfig {
                speed: opts.speeds.get(i).copied().unwrap_or(worker_config.speed),
                ..worker_config.clone()
            };
            workers.push(WorkerHandle::start(local, config).await?);
        }
        // Decode workers' sidecars reach the pool's prefill workers.
        let role = |i: usize| opts.roles.get(i).map(|r| r.0);
        let prefill_peers: Vec<_> = (0..workers.len())
            .filter(|&i| role(i) == Some("prefill"))
            .map(|i| (workers[i].instance_id(), workers[i].addr()))
            .collect();
        for (i, w) in workers.iter().enumerate() {
            if role(i) == Some("decode") {
                w.set_prefill_peers(prefill_peers.iter().copied());
            }
        }
        let endpoints_file = dir.join("endpoints.yaml");
        if opts.precise.is_some() {
            let engine = opts.precise.as_ref().map(|p| p.engine);
            let listed: Vec<_> = workers
                .iter()
                .map(|w| {
                    let events = engine.zip(w.kv_events_port());
                    (w.addr(), w.instance_id(), events)
                })
                .collect();
            write_endpoints_with_events(&endpoints_file, &listed)?;
        } else {
            let listed: Vec<_> = workers
                .iter()
                .enumerate()
                .map(|(i, w)| (w.addr(), w.instance_id(), opts.roles.get(i).copied()))
                .collect();
            write_endpoints_with_roles(&endpoints_file, &listed)?;
        }
        let (tls, ca) = match opts.tls {
            true => {
                let (tls, pem) = kvpick::server::tls::self_signed(&["localhost"])?;
                (Some(tls), Some(pem))
            }
            false => (None, None),
        };
        let scheme = if opts.tls { "https" } else { "http" };
        let kvpick = Kvpick::start_with(
            local,
            endpoints_file.clone(),
            opts.poll,
            tls,
            opts.precise.clone(),
            opts.tuning,
        )
        .await?;
        kvpick.wait_for_endpoints(workers.len()).await?;
        if opts.precise.is_some() {
            kvpick.wait_for_precise(workers.len()).await?;
        }
        let gateway = GatewayHandle::start(
            local,
            GatewayConfig {
                ext_proc: format!("{scheme}://{}", kvpick.addr()),
                ext_proc_ca: ca.filter(|_| !opts.tls_insecure),
                ext_proc_insecure: opts.tls_insecure,
                body_mode: opts.body_mode,
                failure_mode: opts.failure_mode,
                fallback: workers.iter().map(WorkerHandle::addr).collect(),
                message_timeout: Duration::from_secs(2),
                subset: opts
                    .subset
                    .as_ref()
                    .map(|ix| ix.iter().map(|&i| workers[i].addr().to_string()).collect()),
                ..GatewayConfig::default()
            },
        )
        .await?;
        Ok(Stack {
            dir,
            endpoints_file,
            workers,
            kvpick,
            gateway,
        })
    }

    /// Lists only the workers at `indices` in the endpoints file and waits until
    /// kvpick has reloaded it.
    pub async fn set_endpoints(&self, indices: &[usize]) -> Result<(), StackError> {
        let listed: Vec<(SocketAddr, u64)> = indices
            .iter()
            .map(|&i| (self.workers[i].addr(), self.workers[i].instance_id()))
            .collect();
        write_endpoints(&self.endpoints_file, &listed)?;
        self.kvpick.wait_for_endpoints(listed.len()).await
    }

    /// A client of the gateway.
    pub fn client(&self) -> crate::client::Client {
        crate::client::Client::new(self.gateway.addr())
    }

    /// The index of the worker with this instance id.
    pub fn worker_index(&self, instance_id: u64) -> Option<usize> {
        self.workers
            .iter()
            .position(|w| w.instance_id() == instance_id)
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        // Stop kvpick first so its file watcher never sees the endpoints file vanish.
        self.kvpick.abort();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
