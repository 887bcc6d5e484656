//! Tiered KV end to end: client → test gateway → kvpick (precise, vLLM KV
//! events with `medium`) → three mock workers with a CPU offload tier. One
//! worker holds a prompt on its GPU, one only in CPU memory (its GPU evicted
//! it to the offload tier), one not at all: the CPU holder costs less than the
//! cold worker and more than the GPU holder, and routing follows.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use e2e::client::Client;
use e2e::gateway::{GatewayConfig, GatewayHandle};
use e2e::mock_worker::{SeenRequest, WorkerConfig};
use e2e::stack::{Precise, Stack, StackOptions};
use kvpick::kv::tier::TierBlocks;
use kvpick::scheduler::{Explanation, PickRequest};
use serde_json::{json, Value};

const MODEL: &str = "mock-model";

/// A completion of token ids.
fn ids(prompt: &[u32]) -> Value {
    json!({"model": MODEL, "max_tokens": 1, "prompt": prompt})
}

async fn stack() -> Stack {
    Stack::start(StackOptions {
        workers: 3,
        worker: WorkerConfig {
            // 16 GPU blocks of 16 tokens: a 256-token prompt evicts all.
            num_blocks: 16,
            cpu_offload_blocks: 64,
            ..StackOptions::default().worker
        },
        precise: Some(Precise {
            tokenizer_dir: PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../tests/fixtures/tokenizer"),
            vision: None,
            engine: "vllm",
            model: MODEL.into(),
        }),
        ..StackOptions::default()
    })
    .await
    .expect("stack starts")
}

/// What kvpick would decide for `body` now, and why.
fn explain(s: &Stack, body: &Value) -> Explanation {
    let parsed = kvpick::request::parse(body.to_string().as_bytes(), None).unwrap();
    let req = PickRequest {
        body: Some(&parsed),
        ..PickRequest::default()
    };
    let snapshot = s.kvpick.endpoints().snapshot();
    s.kvpick
        .scheduler()
        .explain(&req, &snapshot, Instant::now())
        .unwrap()
}

/// The (tier blocks, cost) explain gives worker `i`.
fn scored(s: &Stack, e: &Explanation, i: usize) -> (TierBlocks, f64) {
    let id = s.workers[i].instance_id();
    let c = e
        .candidates
        .iter()
        .find(|c| c.key.instance_id == id)
        .expect("every worker is a candidate");
    (c.tier_blocks, c.terms.total())
}

/// The request `id` as the worker that served it saw it, and that worker.
fn served(s: &Stack, id: &str) -> (usize, SeenRequest) {
    s.workers
        .iter()
        .enumerate()
        .find_map(|(i, w)| {
            let seen = w.seen().requests;
            let r = seen
                .into_iter()
                .find(|r| r.request_id.as_deref() == Some(id))?;
            Some((i, r))
        })
        .unwrap_or_else(|| panic!("no worker saw {id}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cpu_tier_holder_beats_a_cold_worker_and_loses_to_a_gpu_holder() {
    let s = stack().await;
    let (gpu, cpu, cold) = (0, 1, 2);
    let prompt: Vec<u32> = (1000..1192).collect(); // 12 blocks
    let filler: Vec<u32> = (5000..5256).collect(); // a whole GPU pool
    let direct = |i: usize, body: Value| {
        let c = Client::new(s.workers[i].addr());
        async move {
            let r = c.post_json("/v1/completions", &body, &[]).await.unwrap();
            assert_eq!(r.status, 200, "{}", r.text());
        }
    };
    // Straight to the workers: the GPU holder keeps the prompt; the CPU
    // holder's GPU evicts it to its offload tier for the filler.
    direct(gpu, ids(&prompt)).await;
    direct(cpu, ids(&prompt)).await;
    direct(cpu, ids(&filler)).await;
    // The workers' KV events reach kvpick's index.
    let on = |gpu, cpu, disk| TierBlocks { gpu, cpu, disk };
    let deadline = Instant::now() + Duration::from_secs(10);
    let e = loop {
        let e = explain(&s, &ids(&prompt));
        let tiers = [gpu, cpu, cold].map(|i| scored(&s, &e, i).0);
        if tiers == [on(12, 0, 0), on(0, 12, 0), on(0, 0, 0)] {
            break e;
        }
        assert!(Instant::now() < deadline, "events never arrived: {tiers:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let [g, c, k] = [gpu, cpu, cold].map(|i| scored(&s, &e, i).1);
    assert!(g < c && c < k, "GPU {g}, CPU {c}, cold {k}");

    // The whole pool: the GPU holder wins.
    let r = s
        .client()
        .post_json("/v1/completions", &ids(&prompt), &[("x-request-id", "p1")])
        .await
        .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    let (at, seen) = served(&s, "p1");
    assert_eq!(at, gpu, "the GPU holder beats the CPU holder");
    assert_eq!(seen.hit_tokens, 192);

    // A gateway whose subset hint leaves the CPU holder and the cold worker:
    // the prompt goes to the CPU holder, which loads it from its CPU tier.
    let subset = GatewayHandle::start(
        ([127, 0, 0, 1], 0).into(),
        GatewayConfig {
            ext_proc: format!("http://{}", s.kvpick.addr()),
            fallback: s.workers.iter().map(|w| w.addr()).collect(),
            subset: Some(vec![
                s.workers[cpu].addr().to_string(),
                s.workers[cold].addr().to_string(),
            ]),
            ..GatewayConfig::default()
        },
    )
    .await
    .unwrap();
    let r = Client::new(subset.addr())
        .post_json("/v1/completions", &ids(&prompt), &[("x-request-id", "p2")])
        .await
        .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    let (at, seen) = served(&s, "p2");
    assert_eq!(at, cpu, "the CPU holder beats the cold worker");
    assert_eq!((seen.hit_tokens, seen.cpu_hit_tokens), (0, 192));
}
