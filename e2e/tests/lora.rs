//! LoRA affinity end to end: client → test gateway → kvpick (scraping the
//! mock workers' `vllm:lora_requests_info`) → 4 mock workers. A request for an
//! adapter lands on the worker with it resident, then on one with a free slot.

use std::sync::Arc;
use std::time::Duration;

use e2e::stack::{Stack, StackOptions};
use kvpick::scrape::{run, ScrapeConfig};
use serde_json::json;

/// Requests each worker has served so far.
fn counts(s: &Stack) -> Vec<u64> {
    s.workers.iter().map(|w| w.counters().requests).collect()
}

/// Sends `n` distinct prompts for `model`, each answered 200.
async fn send(s: &Stack, model: &str, n: usize) {
    for i in 0..n {
        let body = json!({"model": model, "max_tokens": 2,
                          "messages": [{"role": "user", "content": format!("{model} question {i}")}]});
        let r = s
            .client()
            .post_json("/v1/chat/completions", &body, &[])
            .await
            .unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
    }
}

#[tokio::test]
async fn adapter_requests_follow_the_scraped_lora_gauge() {
    let s = Stack::start(StackOptions::default())
        .await
        .expect("stack starts");
    // Every worker's two slots are taken, worker 1's by sql-lora among them;
    // worker 2 has a slot free.
    for (i, w) in s.workers.iter().enumerate() {
        match i {
            1 => w.set_lora(2, &["sql-lora", "chat-lora"]),
            2 => w.set_lora(2, &["chat-lora"]),
            _ => w.set_lora(2, &["chat-lora", "math-lora"]),
        }
    }
    let table = Arc::clone(s.kvpick.endpoints());
    let scraping = tokio::spawn(run(
        ScrapeConfig {
            interval: Duration::from_millis(20),
            ..ScrapeConfig::default()
        },
        Arc::clone(&table),
        Arc::default(),
    ));
    let mut scraped = false;
    for _ in 0..300 {
        if table
            .snapshot()
            .endpoints
            .iter()
            .all(|e| e.lora().is_some())
        {
            scraped = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(scraped, "the workers' adapter gauges were not scraped");

    send(&s, "sql-lora", 8).await;
    assert_eq!(
        counts(&s),
        [0, 8, 0, 0],
        "sql-lora away from its resident worker"
    );
    send(&s, "new-lora", 6).await;
    assert_eq!(counts(&s), [0, 8, 6, 0], "new-lora away from the free slot");
    scraping.abort();
}
