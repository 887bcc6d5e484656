//! Learned latency end to end: two mock workers, one eight times slower,
//! behind kvpick in `--scoring predicted` mode. After a warm-up the heuristic
//! makes while the models are cold, the slow worker gets few requests, and
//! the TTFT the client sees beats round robin over the same workers.

use std::time::Duration;

use e2e::mock_worker::WorkerConfig;
use e2e::stack::{Stack, StackOptions, Tuning};
use kvpick::scheduler::ScoringMode;
use serde_json::json;

/// Concurrent clients.
const CLIENTS: usize = 2;

fn body(i: usize) -> serde_json::Value {
    json!({
        "model": "m",
        "stream": true,
        "max_tokens": 4,
        "messages": [{"role": "user", "content": format!("request {i}: {}", "words ".repeat(50))}],
    })
}

/// Sends requests `from..from + n` from [`CLIENTS`] clients, each to the
/// address `to(i)` picks (the gateway, or a worker directly); the TTFT of each.
async fn send(
    to: impl Fn(usize) -> std::net::SocketAddr + Clone + Send + 'static,
    from: usize,
    n: usize,
) -> Vec<Duration> {
    let mut clients = tokio::task::JoinSet::new();
    for c in 0..CLIENTS {
        let to = to.clone();
        clients.spawn(async move {
            let mut ttfts = Vec::new();
            for i in (from + c..from + n).step_by(CLIENTS) {
                let client = e2e::client::Client::new(to(i));
                let r = client
                    .post_json("/v1/chat/completions", &body(i), &[])
                    .await
                    .unwrap();
                assert_eq!(r.status, 200, "{}", r.text());
                ttfts.push(r.first_chunk.expect("a streamed reply"));
            }
            ttfts
        });
    }
    let mut all = Vec::new();
    while let Some(t) = clients.join_next().await {
        all.extend(t.unwrap());
    }
    all
}

fn p50(mut d: Vec<Duration>) -> Duration {
    d.sort();
    d[d.len() / 2]
}

/// Two mock workers with base TTFT `ttft`, the first at 4×, the second at
/// half speed, behind kvpick in `--scoring predicted` mode.
async fn two_speed_predicted_stack(ttft: Duration) -> Stack {
    Stack::start(StackOptions {
        workers: 2,
        worker: WorkerConfig {
            ttft,
            prefill_per_token: Duration::from_micros(20),
            itl: Duration::from_millis(2),
            ..WorkerConfig::default()
        },
        speeds: vec![4.0, 0.5],
        tuning: Tuning {
            scoring: ScoringMode::Predicted,
            ..Tuning::default()
        },
        ..StackOptions::default()
    })
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn predicted_scoring_learns_the_slow_worker_and_beats_round_robin() {
    let stack = two_speed_predicted_stack(Duration::from_millis(40)).await;
    let gateway = stack.gateway.addr();
    let workers: Vec<_> = stack.workers.iter().map(|w| w.addr()).collect();
    let served = |stack: &Stack| -> Vec<u64> {
        stack
            .workers
            .iter()
            .map(|w| w.counters().requests)
            .collect()
    };
    let learner = stack.kvpick.scheduler().latency().unwrap().clone();

    // Warm-up: the heuristic decides until the models have seen enough.
    send(move |_| gateway, 0, 96).await;
    assert!(learner.is_warm(), "the streamed replies taught the models");
    assert_eq!(learner.workers(), 2);
    assert!(learner.fallbacks() > 0);
    let warm = served(&stack);

    let predicted = send(move |_| gateway, 1000, 96).await;
    let after = served(&stack);
    let (fast, slow) = (after[0] - warm[0], after[1] - warm[1]);
    eprintln!("after warm-up: fast worker {fast}, slow worker {slow}");
    assert!(
        slow * 3 < fast,
        "the slow worker still gets {slow} of {} requests",
        fast + slow
    );

    // Round robin over the same workers, straight to them (no gateway hop).
    let round_robin = send(move |i| workers[i % 2], 2000, 96).await;
    let (p, rr) = (p50(predicted), p50(round_robin));
    assert!(p < rr, "TTFT p50 predicted {p:?}, round robin {rr:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn explain_shows_the_engines_recent_latency_beside_the_prediction() {
    let stack = two_speed_predicted_stack(Duration::from_millis(20)).await;
    let scrape = tokio::spawn(kvpick::scrape::run(
        kvpick::scrape::ScrapeConfig::default(),
        std::sync::Arc::clone(stack.kvpick.endpoints()),
        std::sync::Arc::default(),
    ));
    let gateway = stack.gateway.addr();
    // Both workers serve during the warm-up (the heuristic spreads it); the
    // windows close a second after the first scrape.
    send(move |_| gateway, 0, 64).await;
    tokio::time::sleep(Duration::from_millis(1300)).await;
    send(move |_| gateway, 64, 64).await;
    tokio::time::sleep(Duration::from_millis(1300)).await;

    let prompt = kvpick::request::parse(body(9999).to_string().as_bytes(), None).unwrap();
    let explained = stack
        .kvpick
        .scheduler()
        .explain(
            &kvpick::scheduler::PickRequest {
                body: Some(&prompt),
                ..Default::default()
            },
            &stack.kvpick.endpoints().snapshot(),
            std::time::Instant::now(),
        )
        .unwrap();
    scrape.abort();
    let engine_ttft = |worker: usize| {
        let address = stack.workers[worker].addr().to_string();
        let c = explained
            .candidates
            .iter()
            .find(|c| c.address == address)
            .expect("every worker is a candidate");
        let e = c.engine.expect("the engine's histograms were scraped");
        assert!(e.queue.is_some() && e.itl.is_some(), "{e:?}");
        assert!(c.ttft_gap().is_some(), "prediction and engine side by side");
        e.ttft.unwrap()
    };
    let (fast, slow) = (engine_ttft(0), engine_ttft(1));
    eprintln!("engine TTFT: fast {fast:.4} s, slow {slow:.4} s");
    assert!(slow > fast, "the slow engine reports the slower TTFT");
}
