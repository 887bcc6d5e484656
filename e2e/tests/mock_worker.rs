//! The mock worker on its own: API shapes, sidecar checks, sessions, metrics, KV events.

use std::time::Duration;

use e2e::client::Client;
use e2e::kvcache::prefix_hashes;
use e2e::mock_worker::{chat_prompt_tokens, WorkerConfig, WorkerHandle};
use serde_json::{json, Value};
use zeromq::{Socket, SocketRecv};

async fn worker(config: WorkerConfig) -> (WorkerHandle, Client) {
    let w = WorkerHandle::start(([127, 0, 0, 1], 0).into(), config)
        .await
        .unwrap();
    let c = Client::new(w.addr());
    (w, c)
}

fn fast() -> WorkerConfig {
    WorkerConfig {
        ttft: Duration::ZERO,
        prefill_per_token: Duration::ZERO,
        itl: Duration::ZERO,
        ..WorkerConfig::default()
    }
}

fn chat(system: &str, user: &str) -> Value {
    json!({"model": "mock-model", "max_tokens": 4, "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": user}]})
}

#[tokio::test]
async fn serves_openai_shapes_streaming_and_not() {
    let (w, c) = worker(fast()).await;
    let r = c
        .post_json("/v1/chat/completions", &chat("be brief", "hi"), &[])
        .await
        .unwrap();
    assert_eq!(r.status, 200);
    let v = r.json();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["usage"]["completion_tokens"], 4);
    assert_eq!(
        v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .split(' ')
            .count(),
        4
    );

    let mut body = chat("be brief", "hi");
    body["stream"] = json!(true);
    let r = c
        .post_json("/v1/chat/completions", &body, &[])
        .await
        .unwrap();
    assert_eq!(r.headers["content-type"], "text/event-stream");
    assert!(r.text().ends_with("data: [DONE]\n\n"));
    assert_eq!(
        r.chat_text(),
        v["choices"][0]["message"]["content"],
        "same prompt, same reply"
    );

    let r = c
        .post_json(
            "/v1/completions",
            &json!({"prompt": "once upon", "max_tokens": 2}),
            &[],
        )
        .await
        .unwrap();
    assert_eq!(r.json()["object"], "text_completion");
    let models = c.get("/v1/models").await.unwrap().json();
    assert_eq!(models["data"][0]["id"], "mock-model");
    assert_eq!(c.get("/health").await.unwrap().status, 200);
    let seen = c.get("/debug/seen").await.unwrap().json();
    assert_eq!(seen["counters"]["requests"], 3);
    assert_eq!(seen["requests"][2]["path"], "/v1/completions");
    assert_eq!(seen["instance_id"], w.instance_id());
    w.set_healthy(false);
    assert_eq!(c.get("/health").await.unwrap().status, 503);
}

#[tokio::test]
async fn counts_prefix_hits_in_whole_blocks() {
    let (w, c) = worker(fast()).await;
    let system = "word ".repeat(100);
    c.post_json("/v1/chat/completions", &chat(&system, "first"), &[])
        .await
        .unwrap();
    let second = c
        .post_json("/v1/chat/completions", &chat(&system, "second"), &[])
        .await
        .unwrap();
    let msgs = chat(&system, "second")["messages"]
        .as_array()
        .unwrap()
        .clone();
    let tokens = chat_prompt_tokens(&msgs);
    // System marker + 100 words + user marker + 1 word + assistant marker; the
    // first 101 tokens are shared, so 6 full blocks of 16 hit.
    assert_eq!(
        second.json()["usage"]["prompt_tokens_details"]["cached_tokens"],
        96
    );
    let counters = w.counters();
    assert_eq!(counters.prefix_cache_hits, 96);
    assert_eq!(counters.prefix_cache_queries, 2 * tokens.len() as u64);
    let metrics = c.get("/metrics").await.unwrap().text();
    for line in [
        "vllm:prefix_cache_hits_total{model_name=\"mock-model\"} 96",
        "vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"1024\"} 1",
        "vllm:num_requests_running{model_name=\"mock-model\"} 0",
        "vllm:num_requests_waiting{model_name=\"mock-model\"} 0",
        "vllm:kv_cache_usage_perc{model_name=\"mock-model\"} ",
        "vllm:prefix_cache_queries_total{model_name=\"mock-model\"} ",
    ] {
        assert!(metrics.contains(line), "missing {line:?} in\n{metrics}");
    }
}

#[tokio::test]
async fn rejects_requests_routed_to_another_worker() {
    let (w, c) = worker(fast()).await;
    let other = (w.instance_id() + 1).to_string();
    let r = c
        .post_json(
            "/v1/chat/completions",
            &chat("s", "u"),
            &[("x-worker-instance-id", &other)],
        )
        .await
        .unwrap();
    assert_eq!(r.status, 421);
    assert_eq!(r.json()["error"]["type"], "misdirected_request");
    let mine = w.instance_id().to_string();
    let r = c
        .post_json(
            "/v1/chat/completions",
            &chat("s", "u"),
            &[("x-worker-instance-id", &mine), ("x-dp-rank", "1")],
        )
        .await
        .unwrap();
    assert_eq!(r.status, 400, "rank 1 of a dp-size-1 worker");
    let seen = w.seen();
    assert_eq!(
        (
            seen.counters.misdirected,
            seen.counters.errors,
            seen.counters.requests
        ),
        (1, 2, 0)
    );
    assert_eq!(
        seen.requests[0].worker_instance_id.as_deref(),
        Some(other.as_str())
    );
}

#[tokio::test]
async fn sessions_open_continue_close_and_free_blocks() {
    let (w, c) = worker(fast()).await;
    let turn = |action: Option<&str>, text: &str| {
        let mut b = chat(&"context ".repeat(64), text);
        let mut sc = json!({"session_id": "s1"});
        if let Some(a) = action {
            sc["action"] = json!(a);
        }
        b["nvext"] = json!({"session_control": sc});
        b
    };
    let mut early = chat(&"unrelated ".repeat(64), "early");
    early["nvext"] = json!({"session_control": {"session_id": "s1"}});
    let r = c
        .post_json("/v1/chat/completions", &early, &[])
        .await
        .unwrap();
    assert_eq!(r.status, 200, "an unknown session's turn is served");
    assert!(w.seen().requests[0].session_unknown, "without isolation");
    assert_eq!(w.counters().sessions_unknown, 1);
    assert_eq!(
        c.post_json("/v1/chat/completions", &turn(Some("open"), "a"), &[])
            .await
            .unwrap()
            .status,
        200
    );
    assert_eq!(
        c.post_json("/v1/chat/completions", &turn(None, "b"), &[])
            .await
            .unwrap()
            .status,
        200
    );
    assert_eq!(w.seen().sessions, vec!["s1"]);
    let used_before_close = w.counters().blocks_used;
    assert_eq!(
        c.post_json("/v1/chat/completions", &turn(Some("close"), "c"), &[])
            .await
            .unwrap()
            .status,
        200
    );
    let after = w.counters();
    assert_eq!(
        (
            after.sessions_open,
            after.sessions_opened,
            after.sessions_closed
        ),
        (0, 1, 1)
    );
    assert!(after.session_blocks_freed > 0);
    assert!(
        after.blocks_used < used_before_close,
        "closing freed the session's blocks"
    );
    let r = c
        .post_json("/v1/chat/completions", &turn(None, "d"), &[])
        .await
        .unwrap();
    assert_eq!(r.status, 200);
    assert!(
        w.seen().requests.last().unwrap().session_unknown,
        "closed sessions are gone"
    );
}

#[tokio::test]
async fn sessions_expire_after_their_timeout() {
    let (w, c) = worker(fast()).await;
    let turn = |action: Option<&str>, timeout: Option<u64>, text: &str| {
        let mut b = chat(&"context ".repeat(64), text);
        let mut sc = json!({"session_id": "short"});
        if let Some(a) = action {
            sc["action"] = json!(a);
        }
        if let Some(t) = timeout {
            sc["timeout"] = json!(t);
        }
        b["nvext"] = json!({"session_control": sc});
        b
    };
    let post = |b: Value| {
        let c = &c;
        async move {
            c.post_json("/v1/chat/completions", &b, &[])
                .await
                .unwrap()
                .status
        }
    };
    assert_eq!(post(turn(Some("open"), Some(1), "a")).await, 200);
    // A middle turn's timeout does not change the session's.
    assert_eq!(post(turn(None, Some(3600), "b")).await, 200);
    assert!(!w.seen().requests[1].session_unknown);
    tokio::time::sleep(std::time::Duration::from_millis(1300)).await;
    assert_eq!(post(turn(None, None, "c")).await, 200);
    let seen = w.seen();
    assert!(seen.requests[2].session_unknown, "expired after 1 s idle");
    assert_eq!(seen.counters.sessions_expired, 1);
    assert!(seen.sessions.is_empty());
}

#[tokio::test]
async fn publishes_vllm_kv_events_for_stored_blocks() {
    let (w, c) = worker(WorkerConfig {
        kv_events_port: Some(0),
        ..fast()
    })
    .await;
    let mut sub = zeromq::SubSocket::new();
    sub.connect(&format!("tcp://127.0.0.1:{}", w.kv_events_port().unwrap()))
        .await
        .unwrap();
    sub.subscribe("").await.unwrap();
    // The subscription reaches the publisher asynchronously; retry with fresh prompts.
    let mut got = None;
    for i in 0..50 {
        let body = chat(&format!("prompt {i} ").repeat(20), "q");
        c.post_json("/v1/chat/completions", &body, &[])
            .await
            .unwrap();
        if let Ok(Ok(m)) = tokio::time::timeout(Duration::from_millis(50), sub.recv()).await {
            got = Some((m, body));
            break;
        }
    }
    let (msg, body) = got.expect("no KV events");
    assert_eq!(msg.len(), 3);
    let seq = u64::from_be_bytes(msg.get(1).unwrap()[..].try_into().unwrap());
    let batch = rmpv::decode::read_value(&mut &msg.get(2).unwrap()[..]).unwrap();
    let events = batch.as_array().unwrap()[1].as_array().unwrap();
    let stored = events
        .iter()
        .map(|e| e.as_array().unwrap())
        .find(|e| e[0].as_str() == Some("BlockStored"))
        .expect("a BlockStored event");
    let tokens = chat_prompt_tokens(body["messages"].as_array().unwrap());
    let expected = prefix_hashes(&tokens, 16);
    let hashes: Vec<u64> = stored[1]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| h.as_u64().unwrap())
        .collect();
    if seq == 0 {
        assert_eq!(hashes, expected, "first batch stores the whole prompt");
        assert!(stored[2].is_nil(), "no parent for the first block");
    }
    assert_eq!(stored[3].as_array().unwrap().len(), hashes.len() * 16);
    assert_eq!(stored[4].as_u64(), Some(16));
}

#[tokio::test]
async fn each_dp_rank_has_its_own_cache() {
    let (w, c) = worker(WorkerConfig {
        dp_size: 2,
        ..fast()
    })
    .await;
    let id = w.instance_id().to_string();
    let body = chat(&"shared ".repeat(64), "q");
    let send = |rank: &'static str| {
        let (c, id, body) = (c.clone(), id.clone(), body.clone());
        async move {
            c.post_json(
                "/v1/chat/completions",
                &body,
                &[("x-worker-instance-id", &id), ("x-dp-rank", rank)],
            )
            .await
            .unwrap()
            .json()["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap()
        }
    };
    assert_eq!(send("0").await, 0);
    assert_eq!(send("1").await, 0, "rank 1 has not seen the prompt");
    assert_eq!(send("1").await, 64);
    assert_eq!(w.seen().requests[2].dp_rank.as_deref(), Some("1"));
}

/// One engine's series of histogram `name`: the `le` labels with their
/// cumulative counts, then `_count` and `_sum`.
struct Series {
    buckets: Vec<(String, f64)>,
    count: f64,
    sum: f64,
}

fn series(metrics: &str, name: &str, engine: u32) -> Series {
    let value = |l: &str| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap();
    let engine = format!("engine=\"{engine}\"");
    let mut s = Series {
        buckets: Vec::new(),
        count: f64::NAN,
        sum: f64::NAN,
    };
    for l in metrics.lines().filter(|l| l.contains(&engine)) {
        if let Some(rest) = l.strip_prefix(&format!("{name}_bucket{{")) {
            let le = rest
                .split("le=\"")
                .nth(1)
                .unwrap()
                .split('"')
                .next()
                .unwrap();
            s.buckets.push((le.to_string(), value(l)));
        } else if l.starts_with(&format!("{name}_count{{")) {
            s.count = value(l);
        } else if l.starts_with(&format!("{name}_sum{{")) {
            s.sum = value(l);
        }
    }
    s
}

fn streamed(prompt: &str, max_tokens: u32) -> Value {
    json!({"model": "mock-model", "max_tokens": max_tokens, "stream": true,
           "messages": [{"role": "user", "content": prompt}]})
}

#[tokio::test]
async fn serves_vllm_latency_histograms_from_its_simulated_timing() {
    let (_w, c) = worker(WorkerConfig {
        ttft: Duration::from_millis(30),
        prefill_per_token: Duration::ZERO,
        itl: Duration::from_millis(5),
        max_running: 1,
        ..WorkerConfig::default()
    })
    .await;
    // Two at once on one slot: the second waits for the first.
    let (first, second) = (streamed("first", 4), streamed("second", 4));
    let (a, b) = tokio::join!(
        c.post_json("/v1/chat/completions", &first, &[]),
        c.post_json("/v1/chat/completions", &second, &[]),
    );
    assert_eq!(
        (a.unwrap().status.as_u16(), b.unwrap().status.as_u16()),
        (200, 200)
    );
    let metrics = c.get("/metrics").await.unwrap().text();
    // vLLM's bucket boundaries, in its exposition format.
    let les = |s: &Series| s.buckets.iter().map(|b| b.0.clone()).collect::<Vec<_>>();
    let bounds = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let ttft = series(&metrics, "vllm:time_to_first_token_seconds", 0);
    assert_eq!(
        les(&ttft),
        bounds(&[
            "0.001", "0.005", "0.01", "0.02", "0.04", "0.06", "0.08", "0.1", "0.25", "0.5", "0.75",
            "1.0", "2.5", "5.0", "7.5", "10.0", "20.0", "40.0", "80.0", "160.0", "640.0", "2560.0",
            "+Inf"
        ])
    );
    let itl = series(&metrics, "vllm:inter_token_latency_seconds", 0);
    assert_eq!(
        les(&itl),
        bounds(&[
            "0.01", "0.025", "0.05", "0.075", "0.1", "0.15", "0.2", "0.3", "0.4", "0.5", "0.75",
            "1.0", "2.5", "5.0", "7.5", "10.0", "20.0", "40.0", "80.0", "+Inf"
        ])
    );
    let queue = series(&metrics, "vllm:request_queue_time_seconds", 0);
    assert_eq!(
        les(&queue),
        bounds(&[
            "0.3", "0.5", "0.8", "1.0", "1.5", "2.0", "2.5", "5.0", "10.0", "15.0", "20.0", "30.0",
            "40.0", "50.0", "60.0", "120.0", "240.0", "480.0", "960.0", "1920.0", "7680.0", "+Inf"
        ])
    );
    for (name, kind) in [
        ("vllm:time_to_first_token_seconds", "histogram"),
        ("vllm:inter_token_latency_seconds", "histogram"),
        ("vllm:request_queue_time_seconds", "histogram"),
    ] {
        assert!(metrics.contains(&format!("# TYPE {name} {kind}\n")));
    }
    assert!(metrics.contains(
        "vllm:time_to_first_token_seconds_bucket{engine=\"0\",le=\"0.001\",model_name=\"mock-model\"} 0.0\n"
    ));
    for s in [&ttft, &itl, &queue] {
        assert!(s.buckets.windows(2).all(|w| w[0].1 <= w[1].1), "cumulative");
        assert_eq!(s.buckets.last().unwrap().1, s.count, "+Inf is the count");
    }
    // Two requests: two queue times (one waited a whole first request), two
    // first tokens (the second after the first's 30 ms + 3 × 5 ms), 3 gaps each.
    assert_eq!((queue.count, ttft.count, itl.count), (2.0, 2.0, 6.0));
    assert!(queue.sum >= 0.045, "queue sum {}", queue.sum);
    assert!(ttft.sum >= 0.030 + 0.075, "ttft sum {}", ttft.sum);
    assert!(itl.sum >= 6.0 * 0.005, "itl sum {}", itl.sum);
    assert_eq!(ttft.buckets[1].1, 0.0, "no TTFT under 5 ms");
}

#[tokio::test]
async fn runs_at_a_configured_speed() {
    // Long enough that a busy machine's scheduling noise (tens of
    // milliseconds) stays small beside a quarter of these times.
    let config = |speed| WorkerConfig {
        ttft: Duration::from_millis(400),
        prefill_per_token: Duration::from_millis(1),
        itl: Duration::from_millis(40),
        speed,
        ..WorkerConfig::default()
    };
    let (_slow, slow) = worker(config(1.0)).await;
    let (_fast, fast) = worker(config(4.0)).await;
    let prompt = "word ".repeat(200);
    for c in [&slow, &fast] {
        for i in 0..3 {
            let r = c
                .post_json(
                    "/v1/chat/completions",
                    &streamed(&format!("{i} {prompt}"), 6),
                    &[],
                )
                .await
                .unwrap();
            assert_eq!(r.status, 200);
        }
    }
    let mean = |c: &Client, name: &'static str| {
        let c = c.clone();
        async move {
            let s = series(&c.get("/metrics").await.unwrap().text(), name, 0);
            s.sum / s.count
        }
    };
    let ttft = "vllm:time_to_first_token_seconds";
    let itl = "vllm:inter_token_latency_seconds";
    let (slow_ttft, fast_ttft) = (mean(&slow, ttft).await, mean(&fast, ttft).await);
    let (slow_itl, fast_itl) = (mean(&slow, itl).await, mean(&fast, itl).await);
    // At speed 1: 400 ms + 1 ms per uncached token (> 200); at speed 4, a quarter.
    assert!(slow_ttft >= 0.600, "slow TTFT {slow_ttft}");
    assert!(fast_ttft >= 0.150, "fast TTFT {fast_ttft}");
    assert!(
        slow_ttft > 2.5 * fast_ttft,
        "TTFT {slow_ttft} at speed 1 vs {fast_ttft} at speed 4"
    );
    assert!(slow_itl >= 0.040 && fast_itl >= 0.010);
    assert!(
        slow_itl > 2.0 * fast_itl,
        "ITL {slow_itl} at speed 1 vs {fast_itl} at speed 4"
    );
    for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
        let r = WorkerHandle::start(([127, 0, 0, 1], 0).into(), config(bad)).await;
        assert!(
            matches!(r, Err(e2e::mock_worker::WorkerError::Speed(_))),
            "speed {bad} accepted"
        );
    }
}

/// A completion of token ids `prompt`, one token out.
fn ids(prompt: &[u32]) -> Value {
    json!({"model": "mock-model", "max_tokens": 1, "prompt": prompt})
}

/// The offload tier's timing: a prompt the GPU evicted is loaded back from
/// the CPU tier, faster than its cold prefill, slower than a GPU hit. The
/// simulated times are long enough that a busy machine's scheduling noise
/// (tens of milliseconds) cannot reorder them.
#[tokio::test]
async fn an_offloaded_prompt_loads_faster_than_a_cold_prefill_slower_than_a_gpu_hit() {
    let (w, c) = worker(WorkerConfig {
        num_blocks: 16,
        cpu_offload_blocks: 64,
        prefill_per_token: Duration::from_millis(2),
        cpu_load_per_token: Duration::from_micros(400),
        ..fast()
    })
    .await;
    let prompt: Vec<u32> = (1000..1192).collect(); // 12 blocks
    let filler: Vec<u32> = (5000..5256).collect(); // the whole GPU pool
    let timed = |body: Value| {
        let c = c.clone();
        async move {
            let start = std::time::Instant::now();
            let r = c.post_json("/v1/completions", &body, &[]).await.unwrap();
            assert_eq!(r.status, 200, "{}", r.text());
            start.elapsed()
        }
    };
    let cold = timed(ids(&prompt)).await;
    timed(ids(&filler)).await;
    let from_cpu = timed(ids(&prompt)).await;
    let from_gpu = timed(ids(&prompt)).await;
    let seen = w.seen().requests;
    let split: Vec<(usize, usize)> = seen
        .iter()
        .map(|r| (r.hit_tokens, r.cpu_hit_tokens))
        .collect();
    assert_eq!(split, vec![(0, 0), (0, 0), (0, 192), (192, 0)]);
    // 192 tokens: 384 ms of prefill cold, 77 ms of load from the CPU tier.
    assert!(cold >= Duration::from_millis(384), "cold {cold:?}");
    assert!(from_cpu >= Duration::from_millis(76), "CPU {from_cpu:?}");
    assert!(from_cpu < cold / 2, "CPU {from_cpu:?} vs cold {cold:?}");
    assert!(from_gpu < from_cpu, "GPU {from_gpu:?} vs CPU {from_cpu:?}");
    assert_eq!(w.counters().cpu_hit_tokens, 192);
}

/// The offload tier publishes as vLLM's CPU offloading connector: the copy
/// (`BlockStored`, `medium: "CPU"`, engine hashes only) before the GPU's
/// eviction of the same blocks.
#[tokio::test]
async fn an_offload_tier_publishes_cpu_copies_before_the_gpu_evicts() {
    let (w, c) = worker(WorkerConfig {
        num_blocks: 16,
        cpu_offload_blocks: 64,
        kv_events_port: Some(0),
        ..fast()
    })
    .await;
    let mut sub = zeromq::SubSocket::new();
    sub.connect(&format!("tcp://127.0.0.1:{}", w.kv_events_port().unwrap()))
        .await
        .unwrap();
    sub.subscribe("").await.unwrap();
    // The subscription reaches the publisher asynchronously: one-block
    // prompts until an event arrives.
    for i in 0..50u32 {
        c.post_json("/v1/completions", &ids(&[i; 16]), &[])
            .await
            .unwrap();
        if let Ok(Ok(_)) = tokio::time::timeout(Duration::from_millis(50), sub.recv()).await {
            break;
        }
    }
    let prompt: Vec<u32> = (1000..1064).collect();
    let held = prefix_hashes(&prompt, 16);
    c.post_json("/v1/completions", &ids(&prompt), &[])
        .await
        .unwrap();
    let filler: Vec<u32> = (5000..5256).collect();
    c.post_json("/v1/completions", &ids(&filler), &[])
        .await
        .unwrap();
    let mut events: Vec<Vec<Value>> = Vec::new();
    while let Ok(Ok(m)) = tokio::time::timeout(Duration::from_millis(300), sub.recv()).await {
        let raw = rmpv::decode::read_value(&mut &m.get(2).unwrap()[..]).unwrap();
        for e in raw.as_array().unwrap()[1].as_array().unwrap() {
            events.push(
                e.as_array()
                    .unwrap()
                    .iter()
                    .map(|v| match v {
                        rmpv::Value::String(s) => json!(s.as_str()),
                        rmpv::Value::Integer(i) => json!(i.as_u64()),
                        rmpv::Value::Array(a) => {
                            json!(a.iter().map(|x| x.as_u64()).collect::<Vec<_>>())
                        }
                        _ => Value::Null,
                    })
                    .collect(),
            );
        }
    }
    let hashes = |e: &[Value]| -> Vec<u64> {
        e[1].as_array()
            .unwrap()
            .iter()
            .filter_map(Value::as_u64)
            .collect()
    };
    let holds_prompt = |e: &[Value]| held.iter().all(|h| hashes(e).contains(h));
    let copied = events
        .iter()
        .position(|e| e[0] == "BlockStored" && e[6] == "CPU" && holds_prompt(e));
    let evicted = events
        .iter()
        .position(|e| e[0] == "BlockRemoved" && e[2] == "GPU" && holds_prompt(e));
    let (Some(copied), Some(evicted)) = (copied, evicted) else {
        panic!("no CPU copy or GPU eviction of the prompt in {events:?}");
    };
    assert!(copied < evicted, "the copy comes first");
    let copy = &events[copied];
    assert!(copy[2].is_null(), "no parent");
    assert_eq!(copy[3], json!(Vec::<u64>::new()), "no tokens");
    assert_eq!(copy[4], json!(16));
}
