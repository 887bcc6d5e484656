//! Several kvpick replicas of one pool against a real `redis-server`: the
//! server process (killed and restarted on the same port at will), the
//! workers, one gateway per replica (as Envoy spreads ext_proc streams over
//! EPP pods, a client picks the replica by picking the gateway). Replicas run
//! in-process on kvpick's library parts ([`Replicas::start`]) or from
//! command-line flags as the binary runs them ([`Replicas::start_served`]).
//!
//! `redis-server` comes from the machine (Debian's `redis-server` package).
//! [`RedisServer::start`] returns `None` when it is absent, unless
//! `KVPICK_REQUIRE_SYNC_SERVER=1` (CI sets it), which makes that a failure.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::gateway::{GatewayConfig, GatewayHandle};
use crate::mock_worker::{WorkerConfig, WorkerHandle};
use crate::served::{ServedError, ServedKvpick};
use crate::stack::{write_endpoints, Kvpick, StackError};

/// A `redis-server` child process on a loopback port.
pub struct RedisServer {
    port: u16,
    dir: PathBuf,
    child: Option<Child>,
}

impl RedisServer {
    /// Starts `redis-server` on a free loopback port (no persistence). `None`
    /// when the binary is absent and `KVPICK_REQUIRE_SYNC_SERVER` is not `1`.
    pub async fn start() -> Option<RedisServer> {
        let found = Command::new("redis-server")
            .arg("--version")
            .stdout(Stdio::null())
            .status()
            .is_ok();
        if !found {
            assert!(
                std::env::var("KVPICK_REQUIRE_SYNC_SERVER").as_deref() != Ok("1"),
                "KVPICK_REQUIRE_SYNC_SERVER=1 but redis-server is not installed (apt-get install redis-server)"
            );
            eprintln!("skipped: redis-server is not installed (apt-get install redis-server)");
            return None;
        }
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("free port")
            .port();
        let dir = std::env::temp_dir().join(format!("kvpick-redis-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("redis dir");
        let mut s = RedisServer {
            port,
            dir,
            child: None,
        };
        s.restart().await;
        Some(s)
    }

    /// `redis://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Whether the server holds `key` (asked with `redis-cli`).
    pub fn has_key(&self, key: &str) -> bool {
        let out = Command::new("redis-cli")
            .args(["-p", &self.port.to_string(), "EXISTS", key])
            .output()
            .expect("run redis-cli");
        String::from_utf8_lossy(&out.stdout).trim() == "1"
    }

    /// The server process's id while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Kills the server (SIGKILL: every connection drops, the stream is lost).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts a fresh server on the same port (empty: nothing persisted) and
    /// waits until it accepts connections.
    pub async fn restart(&mut self) {
        self.kill();
        let child = Command::new("redis-server")
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(&self.dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn redis-server");
        self.child = Some(child);
        for _ in 0..500 {
            if tokio::net::TcpStream::connect(("127.0.0.1", self.port))
                .await
                .is_ok()
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("redis-server did not listen on port {}", self.port);
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Why [`Replicas::start_served`] failed.
#[derive(Debug, thiserror::Error)]
pub enum ServedStartError {
    /// A worker, a gateway or a file.
    #[error(transparent)]
    Stack(#[from] StackError),
    /// A replica.
    #[error(transparent)]
    Served(#[from] ServedError),
}

impl From<std::io::Error> for ServedStartError {
    fn from(e: std::io::Error) -> Self {
        ServedStartError::Stack(e.into())
    }
}

static NEXT_DIR: AtomicU64 = AtomicU64::new(0);

/// Workers, and kvpick replicas each behind its own gateway.
pub struct Replicas {
    /// The endpoints file every replica watches.
    pub endpoints_file: PathBuf,
    /// The workers.
    pub workers: Vec<WorkerHandle>,
    /// The replicas started in-process from library parts.
    pub kvpicks: Vec<Kvpick>,
    /// The replicas started from command-line flags.
    pub served: Vec<ServedKvpick>,
    /// One gateway per replica.
    pub gateways: Vec<GatewayHandle>,
    dir: PathBuf,
}

impl Replicas {
    /// Starts `workers` workers and `replicas` kvpick replicas, synced through
    /// `sync_url` when given, each waiting until it knows every worker.
    pub async fn start(
        workers: usize,
        worker: WorkerConfig,
        replicas: usize,
        sync_url: Option<&str>,
    ) -> Result<Replicas, StackError> {
        let dir = std::env::temp_dir().join(format!(
            "kvpick-replicas-{}-{}",
            std::process::id(),
            NEXT_DIR.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir)?;
        let local: SocketAddr = ([127, 0, 0, 1], 0).into();
        let mut ws = Vec::with_capacity(workers);
        for _ in 0..workers {
            ws.push(WorkerHandle::start(local, worker.clone()).await?);
        }
        let endpoints_file = dir.join("endpoints.yaml");
        let listed: Vec<_> = ws.iter().map(|w| (w.addr(), w.instance_id())).collect();
        write_endpoints(&endpoints_file, &listed)?;
        let poll = Duration::from_millis(20);
        let mut kvpicks = Vec::with_capacity(replicas);
        let mut gateways = Vec::with_capacity(replicas);
        for _ in 0..replicas {
            let k = match sync_url {
                Some(url) => Kvpick::start_replica(endpoints_file.clone(), poll, url).await?,
                None => Kvpick::start(local, endpoints_file.clone(), poll, None).await?,
            };
            k.wait_for_endpoints(workers).await?;
            gateways.push(
                GatewayHandle::start(
                    local,
                    GatewayConfig {
                        ext_proc: format!("http://{}", k.addr()),
                        fallback: ws.iter().map(WorkerHandle::addr).collect(),
                        message_timeout: Duration::from_secs(2),
                        ..GatewayConfig::default()
                    },
                )
                .await?,
            );
            kvpicks.push(k);
        }
        Ok(Replicas {
            endpoints_file,
            workers: ws,
            kvpicks,
            served: Vec::new(),
            gateways,
            dir,
        })
    }

    /// Starts `workers` workers and `replicas` kvpick replicas from flags,
    /// each with an endpoints file of its own (same contents, a different
    /// path, as on two hosts): replica `i` runs with `flags(i, its file)`
    /// (which should include `--secure-serving=false`) and is waited for
    /// until Ready.
    pub async fn start_served(
        workers: usize,
        worker: WorkerConfig,
        replicas: usize,
        flags: impl Fn(usize, &Path) -> Vec<String>,
    ) -> Result<Replicas, ServedStartError> {
        let dir = std::env::temp_dir().join(format!(
            "kvpick-served-{}-{}",
            std::process::id(),
            NEXT_DIR.fetch_add(1, Ordering::Relaxed)
        ));
        let local: SocketAddr = ([127, 0, 0, 1], 0).into();
        let mut ws = Vec::with_capacity(workers);
        for _ in 0..workers {
            ws.push(
                WorkerHandle::start(local, worker.clone())
                    .await
                    .map_err(StackError::from)?,
            );
        }
        let listed: Vec<_> = ws.iter().map(|w| (w.addr(), w.instance_id())).collect();
        let mut served = Vec::with_capacity(replicas);
        let mut gateways = Vec::with_capacity(replicas);
        for i in 0..replicas {
            let file = dir.join(format!("host-{i}")).join("endpoints.yaml");
            std::fs::create_dir_all(file.parent().expect("a parent"))?;
            write_endpoints(&file, &listed)?;
            let mut k = ServedKvpick::start(&flags(i, &file))?;
            k.wait_ready(Duration::from_secs(20)).await?;
            gateways.push(
                GatewayHandle::start(
                    local,
                    GatewayConfig {
                        ext_proc: format!("http://{}", k.grpc()),
                        message_timeout: Duration::from_secs(2),
                        ..GatewayConfig::default()
                    },
                )
                .await
                .map_err(StackError::from)?,
            );
            served.push(k);
        }
        Ok(Replicas {
            endpoints_file: dir.join("host-0").join("endpoints.yaml"),
            workers: ws,
            kvpicks: Vec::new(),
            served,
            gateways,
            dir,
        })
    }

    /// A client of replica `i`'s gateway.
    pub fn client(&self, i: usize) -> crate::client::Client {
        crate::client::Client::new(self.gateways[i].addr())
    }

    /// The worker index that served the request with `x-request-id: id`.
    pub fn served_by(&self, id: &str) -> Option<usize> {
        self.workers.iter().position(|w| {
            w.seen()
                .requests
                .iter()
                .any(|r| r.request_id.as_deref() == Some(id))
        })
    }

    /// Each replica's (booked blocks, in-flight requests) per worker, in
    /// worker order.
    pub fn loads(&self) -> Vec<Vec<(u64, u32)>> {
        self.kvpicks
            .iter()
            .map(|k| {
                let snap = k.endpoints().snapshot();
                self.workers
                    .iter()
                    .map(|w| {
                        snap.by_instance(w.instance_id())
                            .map_or((0, 0), |e| (e.active_load(0).blocks, e.in_flight(0)))
                    })
                    .collect()
            })
            .collect()
    }
}

impl Drop for Replicas {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
