//! Polls every endpoint's Prometheus `/metrics` and stores its load in the
//! [`EndpointTable`] ([`EndpointState::set_scraped`]), parsed by the core
//! ([`parse_load`], [`parse_lora`]), and the engine's recent latency from its
//! histograms ([`EndpointState::set_engine_latency`]; the window of each
//! endpoint is kept here, from one successful scrape to the next).
//!
//! Each tick (default 50 ms) starts a scrape for every endpoint that has none in
//! flight, up to a concurrency bound; each scrape has its own timeout, so a slow or
//! dead worker only delays itself.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Limited};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use parking_lot::Mutex;
use tokio::sync::Semaphore;
use tracing::{debug, info, warn};

use crate::endpoints::{EndpointState, EndpointTable, LoraInfo, ScrapedLoad};
use crate::engine_latency::{parse_totals, EngineTotals, EngineWindow};
use crate::error_chain::ErrorChain;
use kvpick_core::scrape::{
    parse_load, parse_lora, ScrapeError, ScrapeErrors, DEFAULT_LORA_INFO_METRIC,
};

/// Largest metrics page read, in bytes.
const MAX_PAGE_BYTES: usize = 8 << 20;

/// Scraper settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScrapeConfig {
    /// Time between scrape rounds.
    pub interval: Duration,
    /// Timeout of one scrape (connect, request and body).
    pub timeout: Duration,
    /// Most scrapes in flight at once.
    pub concurrency: usize,
    /// URL path of the metrics page.
    pub path: String,
    /// Port to scrape instead of each endpoint's own port.
    pub port: Option<u16>,
    /// The LoRA adapter gauge (`None`: adapters are not read).
    pub lora_info_metric: Option<String>,
}

impl Default for ScrapeConfig {
    fn default() -> Self {
        ScrapeConfig {
            interval: Duration::from_millis(50),
            timeout: Duration::from_secs(1),
            concurrency: 64,
            path: "/metrics".to_string(),
            port: None,
            lora_info_metric: Some(DEFAULT_LORA_INFO_METRIC.to_string()),
        }
    }
}

/// HTTP client used for scraping.
pub type HttpClient = Client<HttpConnector, Empty<Bytes>>;

/// A keep-alive HTTP/1 client for scraping.
pub fn http_client() -> HttpClient {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(30))
        .build(connector)
}

/// Fetches `http://addr{path}` and returns the body text, within `timeout`.
pub async fn fetch(
    client: &HttpClient,
    addr: SocketAddr,
    path: &str,
    timeout: Duration,
) -> Result<Bytes, ScrapeError> {
    let uri: http::Uri = format!("http://{addr}{path}")
        .parse()
        .map_err(|e: http::uri::InvalidUri| ScrapeError::Http(e.to_string()))?;
    let work = async {
        let resp = client
            .get(uri)
            .await
            .map_err(|e| ScrapeError::Http(e.to_string()))?;
        if !resp.status().is_success() {
            return Err(ScrapeError::Status(resp.status().as_u16()));
        }
        let body = Limited::new(resp.into_body(), MAX_PAGE_BYTES)
            .collect()
            .await
            .map_err(|e| ScrapeError::Http(e.to_string()))?;
        Ok(body.to_bytes())
    };
    tokio::time::timeout(timeout, work)
        .await
        .map_err(|_| ScrapeError::Timeout)?
}

/// What one scrape of an endpoint read.
#[derive(Debug)]
pub struct Scraped {
    /// Its load.
    pub load: ScrapedLoad,
    /// Its LoRA adapter state.
    pub lora: Option<LoraInfo>,
    /// Its latency histograms' running totals.
    pub latency: EngineTotals,
}

/// Scrapes one endpoint once.
pub async fn scrape_one(
    client: &HttpClient,
    state: &EndpointState,
    config: &ScrapeConfig,
) -> Result<Scraped, ScrapeError> {
    let ep = &state.endpoint;
    let addr = SocketAddr::new(ep.address.ip(), config.port.unwrap_or(ep.address.port()));
    let page = fetch(client, addr, &config.path, config.timeout).await?;
    let text = std::str::from_utf8(&page).map_err(|e| ScrapeError::Parse(e.to_string()))?;
    let load = parse_load(ep.engine, text, Instant::now())?;
    let lora = config
        .lora_info_metric
        .as_deref()
        .and_then(|m| parse_lora(ep.engine, text, m));
    Ok(Scraped {
        load,
        lora,
        latency: parse_totals(ep.engine, text),
    })
}

/// Per-endpoint bookkeeping: whether a scrape is in flight, whether the last
/// failed, and the engine's latency totals at the last success.
#[derive(Debug, Default, Clone, Copy)]
struct Track {
    busy: bool,
    failing: bool,
    latency: EngineWindow,
}

/// Scrapes every endpoint of `table` forever, as `config` says, counting failures in
/// `errors`. The scrapes in flight belong to this future: dropping it cancels them.
pub async fn run(config: ScrapeConfig, table: Arc<EndpointTable>, errors: Arc<ScrapeErrors>) {
    let client = http_client();
    let permits = Arc::new(Semaphore::new(config.concurrency.max(1)));
    let tracks: Arc<Mutex<HashMap<SocketAddr, Track>>> = Arc::default();
    let config = Arc::new(config);
    let mut tick = tokio::time::interval(config.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    info!(interval = ?config.interval, timeout = ?config.timeout, "scraping endpoint metrics");
    let mut scrapes = tokio::task::JoinSet::new();
    loop {
        tick.tick().await;
        while let Some(done) = scrapes.try_join_next() {
            if let Err(e) = done {
                warn!(error = %ErrorChain(&e), "a metrics scrape task failed");
            }
        }
        let snapshot = table.snapshot();
        {
            // Forget endpoints that left the table (and are not being scraped).
            let mut t = tracks.lock();
            t.retain(|addr, track| {
                track.busy
                    || snapshot
                        .endpoints
                        .iter()
                        .any(|e| e.endpoint.address == *addr)
            });
        }
        for state in &snapshot.endpoints {
            let addr = state.endpoint.address;
            if tracks.lock().get(&addr).is_some_and(|t| t.busy) {
                continue;
            }
            let Ok(permit) = Arc::clone(&permits).try_acquire_owned() else {
                break;
            };
            tracks.lock().entry(addr).or_default().busy = true;
            let (client, config, tracks, state, errors) = (
                client.clone(),
                Arc::clone(&config),
                Arc::clone(&tracks),
                Arc::clone(state),
                Arc::clone(&errors),
            );
            scrapes.spawn(async move {
                let result = scrape_one(&client, &state, &config).await;
                let mut t = tracks.lock();
                let track = t.entry(addr).or_default();
                track.busy = false;
                match result {
                    Ok(Scraped {
                        load,
                        lora,
                        latency,
                    }) => {
                        state.set_engine_latency(track.latency.advance(latency, load.at));
                        state.set_lora(lora);
                        state.set_scraped(load);
                        if track.failing {
                            info!(endpoint = %addr, "metrics scrape recovered");
                        }
                        track.failing = false;
                    }
                    Err(e) => {
                        errors.record(e.reason());
                        state.set_scrape_failed(std::time::Instant::now());
                        if !track.failing {
                            warn!(endpoint = %addr, error = %ErrorChain(&e), "metrics scrape failed");
                        } else {
                            debug!(endpoint = %addr, error = %ErrorChain(&e), "metrics scrape failed");
                        }
                        track.failing = true;
                    }
                }
                drop(permit);
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoints::{Endpoint, Engine};
    use kvpick_core::scrape::ScrapeFailure;
    use tokio::net::TcpListener;

    const VLLM: &str = include_str!("../../tests/fixtures/vllm_metrics.txt");
    const SGLANG: &str = include_str!("../../tests/fixtures/sglang_metrics.txt");

    /// Serves `page` at `/metrics` on a loopback port; returns its address.
    async fn serve_page(page: &'static str) -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let app =
            axum::Router::new().route("/metrics", axum::routing::get(move || async move { page }));
        tokio::spawn(async move { axum::serve(listener, app).await });
        addr
    }

    /// Accepts connections and never answers.
    async fn serve_nothing() -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((sock, _)) = listener.accept().await {
                held.push(sock);
            }
        });
        addr
    }

    #[tokio::test]
    async fn scrapes_live_workers_while_one_hangs() {
        let vllm = serve_page(VLLM).await;
        let sglang = serve_page(SGLANG).await;
        let hung = serve_nothing().await;
        let mut sg = Endpoint::new(sglang);
        sg.engine = Engine::Sglang;
        let table = Arc::new(EndpointTable::new());
        table.replace(vec![Endpoint::new(vllm), sg, Endpoint::new(hung)]);
        let config = ScrapeConfig {
            interval: Duration::from_millis(10),
            timeout: Duration::from_secs(30),
            concurrency: 8,
            ..Default::default()
        };
        let task = tokio::spawn(run(config, Arc::clone(&table), Arc::default()));
        let snap = table.snapshot();
        let by_addr = |a: SocketAddr| {
            snap.endpoints
                .iter()
                .find(|e| e.endpoint.address == a)
                .unwrap()
        };
        let fresh = |a: SocketAddr| by_addr(a).scraped(Instant::now(), Duration::from_secs(5));
        let mut ok = false;
        for _ in 0..300 {
            if fresh(vllm).is_some() && fresh(sglang).is_some() {
                ok = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(ok, "live workers were not scraped while another hangs");
        assert_eq!(fresh(vllm).unwrap().running, 7.0);
        let lora = by_addr(vllm)
            .lora()
            .expect("the fixture's adapters were not stored");
        assert_eq!((lora.resident_count(), lora.max_lora()), (2, 4));
        assert_eq!(fresh(sglang).unwrap().kv_usage, 0.62);
        assert!(fresh(hung).is_none());
        // Rounds keep coming for the live workers although the hung scrape is pending.
        let first = fresh(vllm).unwrap().at;
        let mut advanced = false;
        for _ in 0..300 {
            if fresh(vllm).unwrap().at > first {
                advanced = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(advanced, "scraping stalled behind the hung worker");
        task.abort();
    }

    #[tokio::test]
    async fn dropping_the_scrape_loop_cancels_its_scrapes_in_flight() {
        use tokio::io::AsyncReadExt;
        // A worker that accepts the scrape, never answers, and reports when the
        // scraper hangs up.
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let hung = listener.local_addr().unwrap();
        let (accepted_tx, accepted) = tokio::sync::oneshot::channel();
        let (closed_tx, closed) = tokio::sync::oneshot::channel();
        let worker = tokio::spawn(async move {
            let (mut sock, _) = listener.accept().await.unwrap();
            let _ = accepted_tx.send(());
            let mut buf = [0u8; 1024];
            while matches!(sock.read(&mut buf).await, Ok(n) if n > 0) {}
            let _ = closed_tx.send(());
        });
        let table = Arc::new(EndpointTable::new());
        table.replace(vec![Endpoint::new(hung)]);
        let config = ScrapeConfig {
            interval: Duration::from_millis(10),
            timeout: Duration::from_secs(60),
            ..Default::default()
        };
        let scraping = tokio::spawn(run(config, table, Arc::default()));
        accepted.await.unwrap();
        scraping.abort();
        let _ = scraping.await;
        // Detached, the scrape would hold its connection until its 60 s timeout.
        tokio::time::timeout(Duration::from_secs(5), closed)
            .await
            .expect("the scrape outlived its loop")
            .unwrap();
        worker.await.unwrap();
    }

    #[tokio::test]
    async fn failed_scrapes_are_counted_by_reason() {
        let live = serve_page(VLLM).await;
        let not_metrics = serve_page("this is not a metrics page {").await;
        let closed = TcpListener::bind("127.0.0.1:0")
            .await
            .unwrap()
            .local_addr()
            .unwrap();
        let table = Arc::new(EndpointTable::new());
        table.replace(vec![
            Endpoint::new(live),
            Endpoint::new(not_metrics),
            Endpoint::new(closed),
        ]);
        let config = ScrapeConfig {
            interval: Duration::from_millis(10),
            ..Default::default()
        };
        let errors = Arc::<ScrapeErrors>::default();
        let task = tokio::spawn(run(config, table, Arc::clone(&errors)));
        let counted = |f| errors.count(f) > 0;
        for _ in 0..500 {
            if counted(ScrapeFailure::Connect)
                && (counted(ScrapeFailure::Parse) || counted(ScrapeFailure::MissingMetric))
            {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        task.abort();
        assert!(
            counted(ScrapeFailure::Connect),
            "refused connection not counted"
        );
        assert!(
            counted(ScrapeFailure::Parse) || counted(ScrapeFailure::MissingMetric),
            "unreadable page not counted"
        );
        assert!(!counted(ScrapeFailure::Status) && !counted(ScrapeFailure::Timeout));
    }

    #[tokio::test]
    async fn fetch_times_out_and_reports_status() {
        let client = http_client();
        let hung = serve_nothing().await;
        let err = fetch(&client, hung, "/metrics", Duration::from_millis(100)).await;
        assert!(matches!(err, Err(ScrapeError::Timeout)));
        let live = serve_page(VLLM).await;
        let err = fetch(&client, live, "/nope", Duration::from_secs(5)).await;
        assert!(matches!(err, Err(ScrapeError::Status(404))));
    }
}

/// Measurements for `docs/discovery.md`; run with
/// `cargo test --release --lib scrape::poll::measure -- --ignored --nocapture`.
#[cfg(test)]
mod measure {
    use super::*;
    use crate::endpoints::Engine;
    use kvpick_core::scrape::normalise_line;

    const VLLM: &str = include_str!("../../tests/fixtures/vllm_metrics.txt");

    /// CPU time this thread has used, from `/proc/thread-self/schedstat`.
    fn thread_cpu() -> Duration {
        let text = std::fs::read_to_string("/proc/thread-self/schedstat").unwrap();
        Duration::from_nanos(text.split_whitespace().next().unwrap().parse().unwrap())
    }

    #[test]
    #[ignore = "measurement, not a check"]
    fn scrape_cost_per_endpoint() {
        // The worker runs on its own thread so only the scraper's CPU is counted.
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
                tx.send(listener.local_addr().unwrap()).unwrap();
                let app =
                    axum::Router::new().route("/metrics", axum::routing::get(|| async { VLLM }));
                axum::serve(listener, app).await.unwrap();
            });
        });
        let addr = rx.recv().unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let table = EndpointTable::new();
        table.replace(vec![crate::endpoints::Endpoint::new(addr)]);
        let state = Arc::clone(&table.snapshot().endpoints[0]);
        let config = ScrapeConfig::default();
        let client = http_client();
        const N: u32 = 2000;
        rt.block_on(async {
            for _ in 0..100 {
                scrape_one(&client, &state, &config).await.unwrap();
            }
            for round in 0..3 {
                let t = thread_cpu();
                for _ in 0..N {
                    fetch(&client, addr, "/metrics", config.timeout).await.unwrap();
                }
                let get = (thread_cpu() - t) / N;
                let t = thread_cpu();
                for _ in 0..N {
                    scrape_one(&client, &state, &config).await.unwrap();
                }
                let scrape = (thread_cpu() - t) / N;
                let t = thread_cpu();
                for _ in 0..N {
                    parse_load(Engine::Vllm, VLLM, Instant::now()).unwrap();
                }
                let parse = (thread_cpu() - t) / N;
                let t = thread_cpu();
                for _ in 0..N / 20 {
                    let lines = VLLM.lines().map(|l| Ok(normalise_line(l)));
                    prometheus_parse::Scrape::parse(lines).unwrap();
                }
                let full = (thread_cpu() - t) / (N / 20);
                println!(
                    "round {round}: page {} bytes; CPU per plain GET {get:?}, per GET+parse {scrape:?}, \
                     parse alone {parse:?}, parsing every line (unfiltered) {full:?}",
                    VLLM.len()
                );
            }
        });
    }
}
