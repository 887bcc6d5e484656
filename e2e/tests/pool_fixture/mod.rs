//! The fixture of the discovery and passive-health tests: workers on
//! 127.0.0.1..n sharing one port, as the pods of one InferencePool in the test
//! API server; kvpick discovering them through kube-rs (a real kubeconfig file,
//! `kube::Config`, watchers) and serving ext_proc; the test gateway in front.

use std::sync::Arc;
use std::time::Duration;

use e2e::apiserver::{seed_pool, write_kubeconfig, ApiServer};
use e2e::client::{Client, ClientError, Reply};
use e2e::gateway::{GatewayConfig, GatewayHandle};
use e2e::mock_worker::{WorkerConfig, WorkerHandle};
use e2e::stack::start_workers_on_one_port;
use kvpick::discovery::kube::{PoolGroup, Source};
use kvpick::endpoints::EndpointTable;
use kvpick::extproc::ExtProcConfig;
use kvpick::server::App;
use serde_json::json;
use tokio::net::TcpListener;
use tokio::task::JoinSet;

/// The running pool: dropping it stops discovery and ext_proc.
pub struct PoolStack {
    /// The workers, pods `vllm-0`.. of pool `vllm` in namespace `inference`.
    pub workers: Vec<WorkerHandle>,
    /// The API server (`take` it to stop it: discovery keeps its last view).
    pub api: Option<ApiServer>,
    /// kvpick's state.
    pub app: App,
    /// A client of the gateway.
    pub client: Client,
    _gateway: GatewayHandle,
    _kvpick: JoinSet<()>,
}

impl PoolStack {
    /// Starts `n` workers with `worker`, the API server listing them as ready
    /// pods, kvpick (once it sees all `n`) and the gateway.
    pub async fn start(n: usize, worker: &WorkerConfig) -> PoolStack {
        let workers = start_workers_on_one_port(n, worker).await.unwrap();
        let port = workers[0].addr().port();
        let listed: Vec<_> = workers
            .iter()
            .map(|w| (w.addr(), w.instance_id()))
            .collect();
        let api = ApiServer::start(([127, 0, 0, 1], 0).into(), Duration::from_millis(200))
            .await
            .unwrap();
        seed_pool(api.state(), "inference", "vllm", port, &listed).unwrap();
        let dir = std::env::temp_dir().join(format!("kvpick-e2e-pool-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let kubeconfig = dir.join("kubeconfig");
        write_kubeconfig(&kubeconfig, &api.url(), "inference").unwrap();
        let config = kube::Config::from_custom_kubeconfig(
            kube::config::Kubeconfig::read_from(&kubeconfig).unwrap(),
            &Default::default(),
        )
        .await
        .unwrap();
        let kube_client = kube::Client::try_from(config).unwrap();
        let _ = std::fs::remove_dir_all(&dir);

        let app = App::new("vllm");
        let mut kvpick = JoinSet::new();
        let table = Arc::clone(&app.endpoints);
        kvpick.spawn(async move {
            let pool = Source::Pool {
                name: "vllm".into(),
                group: PoolGroup::V1,
            };
            let r = kvpick::discovery::kube::run(kube_client, "inference", pool, table).await;
            eprintln!("kvpick discovery stopped: {r:?}");
        });
        wait_for(&app.endpoints, n).await;
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let ext_proc = listener.local_addr().unwrap();
        let service = app.ext_proc(ExtProcConfig::default());
        kvpick.spawn(async move {
            let r = kvpick::server::serve_ext_proc(listener, service, None).await;
            eprintln!("kvpick ext_proc stopped: {r:?}");
        });
        let gateway = GatewayHandle::start(
            ([127, 0, 0, 1], 0).into(),
            GatewayConfig {
                ext_proc: format!("http://{ext_proc}"),
                ..GatewayConfig::default()
            },
        )
        .await
        .unwrap();
        PoolStack {
            workers,
            api: Some(api),
            app,
            client: Client::new(gateway.addr()),
            _gateway: gateway,
            _kvpick: kvpick,
        }
    }

    /// Waits until kvpick has synced and lists `n` endpoints.
    pub async fn wait_for(&self, n: usize) {
        wait_for(&self.app.endpoints, n).await
    }
}

async fn wait_for(table: &Arc<EndpointTable>, n: usize) {
    for _ in 0..500 {
        if table.is_synced() && table.snapshot().endpoints.len() == n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!(
        "kvpick never saw {n} endpoints (has {})",
        table.snapshot().endpoints.len()
    );
}

/// Sends chat request `i` (a prompt of its own) through the gateway.
pub async fn chat(client: &Client, i: usize) -> Result<Reply, ClientError> {
    let body = json!({"model": "m", "max_tokens": 2,
                      "messages": [{"role": "user", "content": format!("question {i}")}]});
    client.post_json("/v1/chat/completions", &body, &[]).await
}
