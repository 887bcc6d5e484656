//! The Gateway API Inference Extension's reference endpoint picker as a bench
//! peer: `gie-epp` (`sigs.k8s.io/gateway-api-inference-extension/cmd/epp`,
//! pinned, installed by `e2e/peers/install-gie-epp.sh`) run beside kvpick on
//! the same mock workers.
//!
//! The peer runs with its default `EndpointPickerConfig` (queue 2, KV
//! utilization 2, approximate prefix 3, max-score picker), discovering its
//! pool as in a cluster: it watches an InferencePool (v1) and the Pods it
//! selects through a test API server ([`crate::apiserver`]) started here and
//! seeded with the pool and one Ready pod per mock worker, and scrapes each
//! worker's vLLM `/metrics` at its default interval. (Its standalone mode,
//! `--endpoint-selector`, cannot start in this version: it builds its endpoint
//! pool from the empty `--pool-name` and stops with "name must not be empty".)
//! Everything listens on and talks to loopback addresses only: the workers on
//! distinct 127.77.x.y addresses ([`loopback_worker`]) and one shared port, the
//! peer's gRPC, health and metrics ports on 127.0.0.1. The ext_proc port is
//! plaintext (`--secure-serving=false`, as kvpick's), and its own tracing and
//! pprof are off, as kvpick's tracing is in the cells it is compared in.
//!
//! Absent binary: [`installed`] is `None` and callers skip the peer with a
//! message, so nothing here needs Go to build or test.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use tokio::process::Command;

use super::ext_proc_client::{chat_body, connect, one_request};
use super::server_process::ServerProcess;
use crate::apiserver::{inference_pool, pod, write_kubeconfig, ApiServer, Kind};
use crate::mock_worker::{WorkerConfig, WorkerHandle};

/// Environment variable naming the peer binary (default: [`default_path`]).
pub const BIN_ENV: &str = "KVPICK_PEER_EPP";

/// Environment variable that turns a missing peer into a failure in tests.
pub const REQUIRE_ENV: &str = "KVPICK_REQUIRE_PEER_EPP";

/// The module and version the install script pins (what the figures name).
pub const PINNED: &str = "sigs.k8s.io/gateway-api-inference-extension/cmd/epp@v1.5.0";

/// Namespace and pod label value of the seeded pool.
const NAMESPACE: &str = "default";
const POOL: &str = "bench";

/// How long the peer may take to discover the pool and answer a first pick.
const READY_TIMEOUT: Duration = Duration::from_secs(60);
/// How long one readiness request may wait for its answer.
const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(2);

/// Where the install script puts the binary.
pub fn default_path() -> Option<PathBuf> {
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".cache")))?;
    Some(cache.join("kvpick-peers/bin/gie-epp"))
}

/// The installed peer binary: `$KVPICK_PEER_EPP`, else [`default_path`], if it exists.
pub fn installed() -> Option<PathBuf> {
    std::env::var_os(BIN_ENV)
        .map(PathBuf::from)
        .or_else(default_path)
        .filter(|p| p.is_file())
}

/// The loopback address of mock worker `i`: 127.77.(i / 250).(i % 250 + 1),
/// so up to 62,500 workers share one port on distinct addresses, as pods do.
pub fn loopback_worker(i: usize) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(
        127,
        77,
        u8::try_from(i / 250).expect("at most 62,500 workers"),
        (i % 250 + 1) as u8,
    ))
}

/// Mock vLLM workers on [`loopback_worker`] addresses and one port.
pub struct Fleet {
    workers: Vec<WorkerHandle>,
    port: u16,
}

impl Fleet {
    /// Starts `n` mock workers serving `model` on one free port.
    pub async fn start(n: usize, model: &str) -> anyhow::Result<Self> {
        let mut workers: Vec<WorkerHandle> = Vec::with_capacity(n);
        let mut port = 0;
        for i in 0..n {
            let config = WorkerConfig {
                model: model.into(),
                ..WorkerConfig::default()
            };
            let addr = SocketAddr::new(loopback_worker(i), port);
            workers.push(
                WorkerHandle::start(addr, config)
                    .await
                    .with_context(|| format!("mock worker on {addr}"))?,
            );
            port = workers[i].addr().port();
        }
        Ok(Fleet { workers, port })
    }

    /// The workers' addresses.
    pub fn addrs(&self) -> Vec<SocketAddr> {
        self.workers.iter().map(WorkerHandle::addr).collect()
    }

    /// The port every worker listens on.
    pub fn port(&self) -> u16 {
        self.port
    }
}

/// A free TCP port on 127.0.0.1 (bound, then released).
fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// A running peer with the API server it discovers the pool from.
pub struct PeerEpp {
    /// The peer's process (its ext_proc port on 127.0.0.1).
    pub process: ServerProcess,
    _api: ApiServer,
    dir: ScratchDir,
}

/// A directory removed when dropped (the peer's kubeconfig and log).
struct ScratchDir(PathBuf);

impl ScratchDir {
    fn new(port: u16) -> std::io::Result<Self> {
        let dir =
            std::env::temp_dir().join(format!("kvpick-peer-epp-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        Ok(ScratchDir(dir))
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

impl PeerEpp {
    /// Starts `exe` over the workers at `addrs` (all on `port`) and waits until
    /// it answers a pick.
    pub async fn start(exe: &Path, addrs: &[SocketAddr], port: u16) -> anyhow::Result<Self> {
        let api = ApiServer::start("127.0.0.1:0".parse()?, Duration::from_secs(5)).await?;
        let pool = inference_pool(NAMESPACE, POOL, &[("app", POOL)], &[port], "gie-epp", 9002);
        api.state().apply(Kind::InferencePool, pool)?;
        for (i, addr) in addrs.iter().enumerate() {
            let p = pod(
                NAMESPACE,
                &format!("{POOL}-{i}"),
                &addr.ip().to_string(),
                true,
                &[("app", POOL)],
                &[],
            );
            api.state().apply(Kind::Pod, p)?;
        }
        let grpc = free_port()?;
        let dir = ScratchDir::new(grpc)?;
        let kubeconfig = dir.0.join("kubeconfig");
        write_kubeconfig(&kubeconfig, &api.url(), NAMESPACE)?;
        let mut command = Command::new(exe);
        command
            .env("KUBECONFIG", &kubeconfig)
            .args([
                format!("--pool-name={POOL}"),
                format!("--pool-namespace={NAMESPACE}"),
                format!("--grpc-port={grpc}"),
                format!("--grpc-health-port={}", free_port()?),
                format!("--metrics-port={}", free_port()?),
                "--secure-serving=false".into(),
                "--metrics-endpoint-auth=false".into(),
                "--tracing=false".into(),
                "--enable-pprof=false".into(),
                "--v=0".into(),
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::from(std::fs::File::create(dir.0.join("stderr"))?));
        let process = ServerProcess::foreign(command, grpc)?;
        let peer = PeerEpp {
            process,
            _api: api,
            dir,
        };
        peer.wait_ready().await?;
        Ok(peer)
    }

    /// Retries one small request until the peer picks (it has discovered the
    /// pods and scraped them), or fails with its log's last lines.
    async fn wait_ready(&self) -> anyhow::Result<()> {
        let body = chat_body(1024, 0);
        let started = Instant::now();
        loop {
            // One attempt waits briefly: a request that arrives before the
            // peer has discovered its pods is held in its queue, not refused.
            let attempt = async {
                let ch = connect(self.process.port).await?;
                one_request(&ch, &body).await
            };
            let picked = match tokio::time::timeout(ATTEMPT_TIMEOUT, attempt).await {
                Ok(picked) => picked,
                Err(_) => Err(anyhow::anyhow!("no answer within {ATTEMPT_TIMEOUT:?}")),
            };
            match picked {
                Ok(_) => return Ok(()),
                Err(e) if started.elapsed() > READY_TIMEOUT => {
                    let log =
                        std::fs::read_to_string(self.dir.0.join("stderr")).unwrap_or_default();
                    let tail: Vec<&str> = log
                        .lines()
                        .rev()
                        .filter(|l| !l.contains("\"level\":\"info\""))
                        .take(20)
                        .collect();
                    bail!(
                        "the peer EPP did not pick within {READY_TIMEOUT:?}: {e:#}\n{}",
                        tail.into_iter().rev().collect::<Vec<_>>().join("\n")
                    );
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(250)).await,
            }
        }
    }
}
