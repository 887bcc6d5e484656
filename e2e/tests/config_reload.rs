//! Live EndpointPickerConfig: kvpick serving two mock workers through the
//! test gateway while its `--config-file` is edited. A weight edit flips
//! which worker wins within 2 s, with no request lost meanwhile; an invalid
//! edit changes no decision and is counted.
//!
//! The flip: one worker holds the prompt's prefix but cannot load its LoRA
//! adapter (its slots are full), the other has the adapter resident. With
//! `lora-affinity-scorer` at a tenth of the prefix scorer's weight, the
//! prefix holder is cheaper; at ten times it, the adapter holder is.

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use e2e::client::Client;
use e2e::gateway::GatewayHandle;
use e2e::mock_worker::WorkerHandle;
use e2e::served::{listed_workers, ServedKvpick};
use serde_json::json;

/// The adapter every probe asks for.
const ADAPTER: &str = "sql-lora";

/// An EndpointPickerConfig weighing the prefix scorer `prefix` and the LoRA
/// scorer `lora`.
fn config(prefix: u32, lora: u32) -> String {
    format!(
        "apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: prefix-cache-scorer
- type: lora-affinity-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: prefix-cache-scorer
    weight: {prefix}
  - pluginRef: lora-affinity-scorer
    weight: {lora}
  - pluginRef: max-score-picker
"
    )
}

/// Replaces `path`'s content in one step (a rename), as a ConfigMap update does.
fn replace(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// Index of the worker that served request `id`.
fn served_by(workers: &[WorkerHandle], id: &str) -> usize {
    let served: Vec<usize> = (0..workers.len())
        .filter(|&i| {
            workers[i]
                .seen()
                .requests
                .iter()
                .any(|r| r.request_id.as_deref() == Some(id))
        })
        .collect();
    assert_eq!(served.len(), 1, "request {id} served by {served:?}");
    served[0]
}

/// Sends the probe prompt as request `id`; the worker that served it.
async fn probe(client: &Client, workers: &[WorkerHandle], prompt: &str, id: &str) -> usize {
    let body = json!({"model": ADAPTER, "max_tokens": 2,
                      "messages": [{"role": "user", "content": prompt}]});
    let r = client
        .post_json("/v1/chat/completions", &body, &[("x-request-id", id)])
        .await
        .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    served_by(workers, id)
}

/// The value of `kvpick_config_reloads_total{result=...}` on the page (0 when absent).
fn reloads(page: &str, result: &str) -> u64 {
    let series = format!("kvpick_config_reloads_total{{result=\"{result}\"}} ");
    page.lines()
        .find_map(|l| l.strip_prefix(series.as_str()))
        .map_or(0, |v| v.trim().parse().unwrap())
}

/// kvpick serving two workers through the gateway under `config(10, 1)`,
/// after a first probe made one of them the prompt's holder.
struct Fixture {
    dir: std::path::PathBuf,
    workers: Vec<WorkerHandle>,
    _kvpick: ServedKvpick,
    gateway: GatewayHandle,
    client: Client,
    metrics: Client,
    config_file: std::path::PathBuf,
    prompt: String,
    /// The prefix holder, without the adapter.
    holder: usize,
    /// The adapter holder.
    other: usize,
}

impl Fixture {
    async fn start(name: &str) -> Fixture {
        let dir = std::env::temp_dir().join(format!("kvpick-{name}-{}", std::process::id()));
        let (workers, endpoints) = listed_workers(&dir, 2).await;
        let config_file = dir.join("epp.yaml");
        replace(&config_file, &config(10, 1));
        let mut kvpick = ServedKvpick::start(&[
            format!("--endpoints-file={}", endpoints.display()),
            format!("--config-file={}", config_file.display()),
            "--scrape-interval-ms=20".to_string(),
        ])
        .expect("kvpick starts");
        kvpick.wait_ready(Duration::from_secs(20)).await.unwrap();
        let gateway = kvpick.gateway().await.unwrap();
        let client = Client::new(gateway.addr());
        let metrics = Client::new(kvpick.metrics());
        let prompt = "Summarise the quarterly sales table by region. ".repeat(40);

        // The first probe makes its worker the prefix holder; then its adapter
        // slots fill and the other worker loads the adapter.
        let holder = probe(&client, &workers, &prompt, "seed").await;
        let other = 1 - holder;
        workers[holder].set_lora(1, &["chat-lora"]);
        workers[other].set_lora(1, &[ADAPTER]);
        tokio::time::sleep(Duration::from_millis(300)).await;
        for i in 0..5 {
            let id = format!("before-{i}");
            assert_eq!(probe(&client, &workers, &prompt, &id).await, holder, "{id}");
        }
        Fixture {
            dir,
            workers,
            _kvpick: kvpick,
            gateway,
            client,
            metrics,
            config_file,
            prompt,
            holder,
            other,
        }
    }

    /// Probes as `{tag}-{i}` for `within`, each to be served by `worker`.
    async fn probes_stay_on(&self, worker: usize, tag: &str, within: Duration) {
        let start = Instant::now();
        let mut i = 0;
        while start.elapsed() < within {
            let id = format!("{tag}-{i}");
            assert_eq!(
                probe(&self.client, &self.workers, &self.prompt, &id).await,
                worker,
                "{id}"
            );
            i += 1;
        }
    }

    /// `(applied, invalid)` reloads counted so far.
    async fn reloads(&self) -> (u64, u64) {
        let page = self.metrics.get("/metrics").await.unwrap().text();
        (reloads(&page, "applied"), reloads(&page, "invalid"))
    }

    /// Makes the config file invalid: a profile names a plugin the list does
    /// not define.
    fn break_config(&self) {
        replace(
            &self.config_file,
            &config(10, 1).replace("pluginRef: max-score-picker", "pluginRef: no-such-plugin"),
        );
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_edited_weight_flips_the_decision_within_two_seconds_and_drops_nothing() {
    let f = Fixture::start("config-reload-flip").await;
    // Background traffic of other prompts across both edits: none may fail.
    let stop = Arc::new(AtomicBool::new(false));
    let sent = Arc::new(AtomicU64::new(0));
    let background = {
        let (stop, sent, client) = (
            Arc::clone(&stop),
            Arc::clone(&sent),
            Client::new(f.gateway.addr()),
        );
        tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let n = sent.fetch_add(1, Ordering::Relaxed);
                let body = json!({"model": "mock-model", "max_tokens": 4, "stream": true,
                                  "messages": [{"role": "user", "content": format!("background {n}")}]});
                let r = client
                    .post_json("/v1/chat/completions", &body, &[])
                    .await
                    .unwrap();
                assert_eq!(r.status, 200, "background {n}: {}", r.text());
            }
        })
    };

    replace(&f.config_file, &config(1, 10));
    let edited = Instant::now();
    let mut i = 0;
    loop {
        let id = format!("after-{i}");
        if probe(&f.client, &f.workers, &f.prompt, &id).await == f.other {
            break;
        }
        assert!(
            edited.elapsed() < Duration::from_secs(2),
            "the weight edit did not change the decision within 2 s"
        );
        i += 1;
    }
    f.probes_stay_on(f.other, "applied", Duration::from_millis(300))
        .await;

    // An invalid edit after it keeps the edited config.
    f.break_config();
    f.probes_stay_on(f.other, "invalid", Duration::from_millis(1_500))
        .await;
    assert_eq!(f.reloads().await, (1, 1));

    stop.store(true, Ordering::Relaxed);
    background.await.expect("no background request failed");
    assert!(sent.load(Ordering::Relaxed) > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalid_edit_changes_no_decision_and_is_counted() {
    let f = Fixture::start("config-reload-invalid").await;
    f.break_config();
    f.probes_stay_on(f.holder, "invalid", Duration::from_millis(1_500))
        .await;
    assert_eq!(f.reloads().await, (0, 1));
}
