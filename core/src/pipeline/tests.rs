//! The pipeline from headers and body to the answer's headers and body.

use std::sync::Arc;

use super::*;
use crate::endpoints::{Endpoint, EndpointTable, Engine};
use crate::multimodal::identity::{identify, IdentitySource};
use crate::multimodal::{MmRouting, MmStats};
use crate::request::{PromptLimits, Segment};
use crate::scheduler::{Decision, PickRequest, Scheduler, SchedulerConfig};

fn pick(engine: Engine, prepared: Option<&Prepared>) -> Decision {
    let table = EndpointTable::new();
    let mut e = Endpoint::new("10.0.0.1:8000".parse().unwrap());
    e.engine = engine;
    table.replace(vec![e]);
    let scheduler = Scheduler::new(SchedulerConfig::default());
    let req = PickRequest {
        body: prepared.map(|p| &p.request),
        ..Default::default()
    };
    scheduler.pick(&req, &table.snapshot()).unwrap()
}

fn chat_head() -> RequestHead {
    let headers: &[(&str, &str)] = &[
        (":path", "/v1/chat/completions"),
        ("x-dp-rank", "3"),
        ("x-prefill-instance-id", "9"),
    ];
    RequestHead::read(headers, "x-session-id", "x-kvpick-session")
}

/// A chat body with an image, worker fields in `nvext`, and spacing a
/// re-serialization would not keep.
const CHAT: &str = r#"{ "model": "m",
  "messages": [{"role": "user", "content": [
    {"type": "text", "text": "what is this?"},
    {"type": "image_url", "image_url": {"url": "https://img.example/a.png"}}]}],
  "nvext": {"backend_instance_id": 7, "dp_rank": 1, "agent_hints": {"priority": 2}} }"#;

#[test]
fn a_body_that_is_not_a_request_is_refused_and_nothing_is_counted() {
    let stats = Arc::new(MmStats::default());
    let pipeline = Pipeline::new(PromptLimits::NONE, None).counting_images(Arc::clone(&stats));
    assert!(pipeline
        .prepare(b"{\"model\":".to_vec(), &chat_head())
        .is_err());
    assert_eq!(stats.requests(MmRouting::Approximate), 0);
}

#[test]
fn without_a_tokenizer_images_are_identified_and_counted_and_nothing_waits() {
    let stats = Arc::new(MmStats::default());
    let pipeline = Pipeline::new(PromptLimits::NONE, None).counting_images(Arc::clone(&stats));
    let head = chat_head();
    let prepared = pipeline.prepare(CHAT.as_bytes().to_vec(), &head).unwrap();
    assert!(!prepared.waits_for_tokens());
    assert_eq!(
        prepared.mm_hashes,
        [identify("https://img.example/a.png").mm_hash]
    );
    assert_eq!(stats.images(IdentitySource::Url), 1);
    assert_eq!(stats.requests(MmRouting::Approximate), 1);
    let signals = prepared.signals(&head);
    assert_eq!(signals.hint_priority, Some(2));
    assert_eq!(signals.bytes, CHAT.len());
}

#[test]
fn one_edit_strips_the_client_worker_fields_and_tells_sglang_its_image_hashes() {
    let head = chat_head();
    let prepared = Pipeline::new(PromptLimits::NONE, None)
        .prepare(CHAT.as_bytes().to_vec(), &head)
        .unwrap();
    let hash = prepared.mm_hashes[0];
    let decision = pick(Engine::Sglang, Some(&prepared));
    let out = outcome(&decision, &head, Some(prepared)).unwrap();

    let body = out.body.expect("a body to forward");
    assert!(body.changed);
    let text = String::from_utf8(body.bytes.clone()).unwrap();
    // Outside `nvext` the client's bytes are forwarded as they came.
    let untouched = &CHAT[..CHAT.find("\"nvext\"").unwrap()];
    assert!(text.starts_with(untouched), "{text}");
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(
        v["nvext"],
        serde_json::json!({
            "agent_hints": {"priority": 2},
            "mm_hashes": crate::multimodal::hints::sglang_mm_hashes(&[hash]),
        })
    );

    assert_eq!(out.destination, "10.0.0.1:8000");
    let set: Vec<&str> = out.set_headers.iter().map(|(k, _)| *k).collect();
    assert_eq!(
        set,
        [
            DESTINATION_HEADER,
            WORKER_ID_HEADER,
            DP_RANK_HEADER,
            "content-length"
        ]
    );
    assert_eq!(
        out.set_headers.last().unwrap().1,
        body.bytes.len().to_string()
    );
    // The client's rank is overwritten; its prefill id, which kvpick does not set, removed.
    assert_eq!(out.remove_headers, ["x-prefill-instance-id"]);
}

#[test]
fn vllm_gets_its_image_hashes_on_the_parts_and_an_unchanged_body_keeps_its_length() {
    let head = chat_head();
    let pipeline = Pipeline::new(PromptLimits::NONE, None);
    let prepared = pipeline.prepare(CHAT.as_bytes().to_vec(), &head).unwrap();
    let decision = pick(Engine::Vllm, Some(&prepared));
    let out = outcome(&decision, &head, Some(prepared)).unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.body.unwrap().bytes).unwrap();
    assert!(v["messages"][0]["content"][1]["uuid"].is_string());
    assert_eq!(
        v["nvext"],
        serde_json::json!({"agent_hints": {"priority": 2}})
    );

    let plain = br#"{"model":"m", "messages": [{"role":"user","content":"hi"}]}"#.to_vec();
    let prepared = pipeline.prepare(plain.clone(), &head).unwrap();
    let decision = pick(Engine::Vllm, Some(&prepared));
    let out = outcome(&decision, &head, Some(prepared)).unwrap();
    assert_eq!(
        out.body,
        Some(ForwardBody {
            bytes: plain,
            changed: false
        })
    );
    assert!(out.set_headers.iter().all(|(k, _)| *k != "content-length"));
}

#[test]
fn a_request_routed_on_its_headers_has_no_body() {
    let head = chat_head();
    let decision = pick(Engine::Vllm, None);
    let out = outcome(&decision, &head, None).unwrap();
    assert_eq!(out.body, None);
    assert_eq!(
        out.set_headers[0],
        (DESTINATION_HEADER, out.destination.clone())
    );
}

/// A tokenizer reads the whole text, not the prefix the parse kept, so the
/// tokenized prompt counts no omitted text on top of its tokens.
#[tokio::test]
async fn tokenized_text_counts_no_omitted_text() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tokenizer");
    let pool =
        crate::tokenize::TokenizerPool::new(crate::tokenize::Tokenizer::load(dir).unwrap(), 1);
    let limits = PromptLimits {
        text_bytes: 16,
        ..PromptLimits::NONE
    };
    let long = "lorem ipsum dolor sit amet ".repeat(20);
    let body = serde_json::json!({"model": "m", "messages": [{"role": "user", "content": long}]});
    let mut prepared = Pipeline::new(limits, Some(pool))
        .prepare(body.to_string().into_bytes(), &chat_head())
        .unwrap();
    assert!(prepared.request.omitted_text_bytes > 0);
    let job = prepared
        .take_tokenize_job()
        .expect("text waits for its tokens");
    prepared.tokenized(job.run().await);
    assert!(matches!(prepared.request.segments.as_slice(), [Segment::Tokens(t)] if t.len() > 100));
    assert_eq!(prepared.request.omitted_text_bytes, 0);
}
