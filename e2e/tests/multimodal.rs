//! Multimodal precise routing end to end: client → test gateway → kvpick
//! (tokenizer + Qwen2-VL vision model, KV events) → 4 mock SGLang workers in
//! pad_value mode, which publish `BlockStored` token ids with pad values at
//! image positions.

use std::path::PathBuf;

use base64::Engine as _;
use e2e::mock_vision::MockVision;
use e2e::mock_worker::{SeenRequest, WorkerConfig};
use e2e::stack::{Precise, Stack, StackOptions};
use kvpick::multimodal::{VisionFamily, VisionPrompt};
use serde_json::{json, Value};

fn tokenizer_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/qwen-vl-tokenizer")
}

fn vision() -> VisionPrompt {
    VisionPrompt::new(VisionFamily::Qwen2Vl)
}

/// A PNG header as a `data:` URL; `salt` makes the image distinct.
fn png_url(w: u32, h: u32, salt: u8) -> String {
    let mut b = b"\x89PNG\r\n\x1a\n\0\0\0\x0dIHDR".to_vec();
    b.extend_from_slice(&w.to_be_bytes());
    b.extend_from_slice(&h.to_be_bytes());
    b.extend_from_slice(&[8, 6, 0, 0, 0, salt, salt]);
    format!(
        "data:image/png;base64,{}",
        base64::engine::general_purpose::STANDARD.encode(&b)
    )
}

async fn stack() -> Stack {
    Stack::start(StackOptions {
        worker: slow_prefill(WorkerConfig {
            vision: Some(MockVision::load(&tokenizer_dir(), vision()).expect("mock vision")),
            ..StackOptions::default().worker
        }),
        precise: Some(Precise {
            tokenizer_dir: tokenizer_dir(),
            vision: Some(vision()),
            engine: "sglang",
            model: "mock-model".into(),
        }),
        ..StackOptions::default()
    })
    .await
    .expect("stack starts")
}

fn slow_prefill(mut w: WorkerConfig) -> WorkerConfig {
    // Long enough that a first turn is still in flight when the other is routed.
    w.ttft = std::time::Duration::from_millis(100);
    w
}

fn seen(s: &Stack, id: &str) -> SeenRequest {
    s.workers
        .iter()
        .flat_map(|w| w.seen().requests)
        .find(|r| r.request_id.as_deref() == Some(id))
        .unwrap_or_else(|| panic!("no worker saw {id}"))
}

/// Two conversations, each with two images in its first turn and a short
/// second turn: the second turns land on the workers that hold their images and
/// the workers count almost every prompt token as cached.
#[tokio::test]
async fn second_turns_of_image_conversations_hit_the_workers_caches() {
    let s = stack().await;
    let c = s.client();
    // 448x448 and 448x224 are 256 and 128 Qwen2-VL tokens.
    let conversations = [
        ("a", png_url(448, 448, 1), png_url(448, 224, 2)),
        ("b", png_url(448, 448, 3), png_url(448, 224, 4)),
    ];
    let first_turn = |x: &str, y: &str| {
        vec![json!({"role": "user", "content": [
            {"type": "text", "text": "look at this picture"},
            {"type": "image_url", "image_url": {"url": x}},
            {"type": "text", "text": "and this"},
            {"type": "image_url", "image_url": {"url": y}},
            {"type": "text", "text": "compare them"},
        ]})]
    };
    // Both first turns at once: load spreads them over two workers, so a second
    // turn only finds its images where its first turn went.
    let send = |name: &'static str, messages: Vec<Value>| {
        let c = c.clone();
        async move {
            let body = json!({"model": "mock-model", "max_tokens": 8, "messages": messages});
            let id = format!("{name}1");
            let r = c
                .post_json(
                    "/v1/chat/completions",
                    &body,
                    &[("x-request-id", id.as_str())],
                )
                .await
                .unwrap();
            assert_eq!(r.status, 200, "{}", r.text());
            let mut messages = messages;
            messages.push(json!({"role": "assistant", "content": r.chat_text()}));
            messages
        }
    };
    let (a, b) = (&conversations[0], &conversations[1]);
    let (ha, hb) = tokio::join!(
        send(a.0, first_turn(&a.1, &a.2)),
        send(b.0, first_turn(&b.1, &b.2))
    );
    let histories = vec![ha, hb];
    assert_ne!(
        seen(&s, "a1").worker_instance_id,
        seen(&s, "b1").worker_instance_id,
        "concurrent first turns spread over two workers"
    );
    // The workers' events reach kvpick's index.
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let (mut hits, mut queried) = (0, 0);
    for ((name, _, _), mut messages) in conversations.iter().zip(histories) {
        messages.push(json!({"role": "user", "content": "describe both pictures"}));
        let body = json!({"model": "mock-model", "max_tokens": 8, "messages": messages});
        let id = format!("{name}2");
        let r = c
            .post_json(
                "/v1/chat/completions",
                &body,
                &[("x-request-id", id.as_str())],
            )
            .await
            .unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        let first = seen(&s, &format!("{name}1"));
        let second = seen(&s, &id);
        assert_eq!(second.image_tokens, 384, "two images, 256 + 128 tokens");
        assert!(
            first.mm_hashes_given && second.mm_hashes_given,
            "kvpick hands SGLang the hashes it routed with"
        );
        assert_eq!(
            second.worker_instance_id, first.worker_instance_id,
            "the second turn goes where the images are cached"
        );
        hits += second.hit_tokens;
        queried += second.queried_tokens;
    }
    let rate = hits as f64 / queried as f64;
    eprintln!("second-turn hit rate: {rate:.3} ({hits}/{queried} tokens)");
    assert!(rate >= 0.9, "second-turn hit rate {rate:.3} < 0.9");
}
