//! Multimodal precise routing against the engines' own event formats: a prompt
//! with two images is tokenized by kvpick (Qwen2-VL placeholders, SGLang pad
//! values), the engine's `BlockStored` events for that prompt are built in
//! SGLang's form (pad values inline) and vLLM's form (image token ids plus mm
//! hashes in `extra_keys`), and later requests are routed against them.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use base64::Engine as _;
use kvpick::endpoints::{Endpoint, EndpointTable, WorkerKey};
use kvpick::kvevents::vllm::Vllm;
use kvpick::kvevents::EventDecoder;
use kvpick::kvevents::Ingest;
use kvpick::multimodal::fetch::{FetchPolicy, HttpImageFetcher};
use kvpick::multimodal::hints;
use kvpick::multimodal::identity::{
    identify, is_pad_value, pad_value, url_identity, vllm_mm_uuid, IdentitySource,
};
use kvpick::multimodal::remote::{FetchLimits, FetchOutcome, KnownImages, RemoteImages};
use kvpick::multimodal::{VisionFamily, VisionPrompt};
use kvpick::request::{parse, parse_with, ApiKind, InferenceRequest, ParseOptions, TemplateInput};
use kvpick::scheduler::{PickRequest, Scheduler, SchedulerConfig};
use kvpick::tokenize::{token_ids, Tokenizer, TokenizerPool};
use rmpv::Value;
use serde_json::json;
use tokio_rustls::rustls;

const BS: usize = 16;
const MODEL: &str = "qwen-vl";

fn tokenizer() -> Tokenizer {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/qwen-vl-tokenizer");
    Tokenizer::load(dir)
        .unwrap()
        .with_vision(VisionPrompt::new(VisionFamily::Qwen2Vl))
        .unwrap()
}

/// A PNG (header and a few distinguishing bytes) as a `data:` URL.
fn png_url(w: u32, h: u32, salt: u8) -> String {
    let mut b = b"\x89PNG\r\n\x1a\n\0\0\0\x0dIHDR".to_vec();
    b.extend_from_slice(&w.to_be_bytes());
    b.extend_from_slice(&h.to_be_bytes());
    b.extend_from_slice(&[8, 6, 0, 0, 0, salt, salt, salt]);
    format!(
        "data:image/png;base64,{}",
        base64::engine::general_purpose::STANDARD.encode(&b)
    )
}

fn image(url: &str) -> serde_json::Value {
    json!({"type": "image_url", "image_url": {"url": url}})
}

fn text(t: &str) -> serde_json::Value {
    json!({"type": "text", "text": t})
}

/// Two images in the first user turn; `follow_up` adds a second turn.
fn chat(a: &str, b: &str, follow_up: Option<&str>) -> serde_json::Value {
    let mut messages = vec![json!({"role": "user", "content": [
        text("look at this picture"), image(a), text("and this"), image(b), text("compare them")
    ]})];
    if let Some(f) = follow_up {
        messages.push(json!({"role": "assistant", "content": "the cat sat on the mat."}));
        messages.push(json!({"role": "user", "content": f}));
    }
    json!({"model": MODEL, "messages": messages})
}

/// The request as the ext_proc path builds it: parsed, then tokenized.
fn request(tok: &Tokenizer, body: &serde_json::Value) -> InferenceRequest {
    let mut r = parsed(body);
    r.segments = tok.tokenize_request(&r).unwrap();
    r
}

/// A chat body parsed as the ext_proc path parses it when a tokenizer is configured.
fn parsed(body: &serde_json::Value) -> InferenceRequest {
    let options = ParseOptions {
        limits: kvpick::request::PromptLimits::NONE,
        template: true,
    };
    parse_with(
        &serde_json::to_vec(body).unwrap(),
        Some(ApiKind::Chat),
        options,
    )
    .unwrap()
}

/// What the tokenizer renders a chat body from.
fn template(body: &serde_json::Value) -> TemplateInput {
    parsed(body).template.unwrap()
}

fn routing_tokens(tok: &Tokenizer, body: &serde_json::Value) -> Vec<u32> {
    token_ids(&tok.tokenize_request(&parsed(body)).unwrap())
}

fn encode(v: Value) -> Vec<u8> {
    let mut buf = Vec::new();
    rmpv::encode::write_value(&mut buf, &v).unwrap();
    buf
}

fn ints(v: impl IntoIterator<Item = u64>) -> Value {
    Value::Array(v.into_iter().map(Value::from).collect())
}

/// SGLang's event for a prompt: array-like, the token ids as SGLang's radix
/// cache holds them (pad values at image positions), no `extra_keys`.
fn sglang_event(tokens: &[u32]) -> Vec<u8> {
    let full = tokens.len() / BS * BS;
    let stored = Value::Array(vec![
        Value::from("BlockStored"),
        ints((0..full / BS).map(|i| 9_000 + i as u64)),
        Value::Nil,
        ints(tokens[..full].iter().map(|&t| u64::from(t))),
        Value::from(BS as u64),
        Value::Nil,
    ]);
    encode(Value::Array(vec![
        Value::from(1.0),
        Value::Array(vec![stored]),
        Value::Nil,
    ]))
}

/// vLLM's event for a prompt: map-encoded, sha256-style byte hashes, the model's
/// image token at image positions and each block's image hashes in
/// `extra_keys` (vLLM 0.19's `[hash, offset]` pairs); the requests carry no
/// `cache_salt`, so vLLM adds none (a salted event matches only its tenant's
/// requests: `tests/kvevents.rs`). `issued` says whether the hashes are the
/// UUIDs kvpick handed vLLM or vLLM's own digests.
fn vllm_event(tokens: &[u32], image_token: u32, images: &[u64], issued: bool) -> Vec<u8> {
    let full = tokens.len() / BS * BS;
    let pads: Vec<u32> = images.iter().map(|&h| pad_value(h)).collect();
    let key = |h: u64| {
        if issued {
            vllm_mm_uuid(h)
        } else {
            // vLLM's own digest of the image: nothing kvpick knows.
            format!("{:016x}{}", h ^ 0x5555_5555_5555_5555, "ab".repeat(24))
        }
    };
    let mut extra = Vec::new();
    for block in tokens[..full].chunks(BS) {
        let mut keys: Vec<Value> = Vec::new();
        let mut seen = Vec::new();
        for (off, t) in block.iter().enumerate() {
            if let Some(i) = pads.iter().position(|p| p == t) {
                if !seen.contains(&i) {
                    seen.push(i);
                    keys.push(Value::Array(vec![
                        Value::from(key(images[i])),
                        Value::from(off as u64),
                    ]));
                }
            }
        }
        extra.push(if keys.is_empty() {
            Value::Nil
        } else {
            Value::Array(keys)
        });
    }
    let worker_tokens = tokens[..full]
        .iter()
        .map(|&t| u64::from(if is_pad_value(t) { image_token } else { t }));
    let hashes = (0..full / BS)
        .map(|i| Value::Binary([[0xAB; 24].as_slice(), &(7_000 + i as u64).to_be_bytes()].concat()))
        .collect();
    let field = |k: &str, v: Value| (Value::from(k), v);
    let stored = Value::Map(vec![
        field("type", Value::from("BlockStored")),
        field("block_hashes", Value::Array(hashes)),
        field("parent_block_hash", Value::Nil),
        field("token_ids", ints(worker_tokens)),
        field("block_size", Value::from(BS as u64)),
        field("lora_id", Value::Nil),
        field("medium", Value::from("GPU")),
        field("lora_name", Value::Nil),
        field("extra_keys", Value::Array(extra)),
    ]);
    encode(Value::Map(vec![
        field("ts", Value::from(1.0)),
        field("events", Value::Array(vec![stored])),
        field("data_parallel_rank", Value::Nil),
    ]))
}

struct Pool {
    scheduler: Scheduler,
    endpoints: EndpointTable,
    ingest: Ingest<kvpick::kv::index::PrefixIndex>,
}

impl Pool {
    fn new(image_token: Option<u32>) -> Pool {
        let scheduler = Scheduler::new(SchedulerConfig::default());
        let endpoints = EndpointTable::new();
        endpoints.replace(
            (1..=3)
                .map(|i| Endpoint::new(format!("10.2.0.{i}:8000").parse().unwrap()))
                .collect(),
        );
        let ingest =
            Ingest::new(Arc::clone(scheduler.index()), MODEL).with_image_token(image_token);
        Pool {
            scheduler,
            endpoints,
            ingest,
        }
    }

    fn worker(&self, i: usize) -> WorkerKey {
        self.endpoints.snapshot().endpoints[i].key(0)
    }

    fn publish(&mut self, worker: WorkerKey, payload: &[u8]) -> kvpick::kvevents::ApplyStats {
        self.ingest.set_live(worker, true);
        let batch = Vllm.decode(payload).unwrap();
        self.ingest.apply(worker, None, &batch, Instant::now())
    }

    /// (chosen worker, overlap blocks, prompt blocks).
    fn route(&self, req: &InferenceRequest) -> (WorkerKey, usize, usize) {
        let d = self
            .scheduler
            .pick(
                &PickRequest {
                    body: Some(req),
                    ..PickRequest::default()
                },
                &self.endpoints.snapshot(),
            )
            .unwrap();
        self.scheduler.finish(&d, Some(200));
        (d.decode.key(), d.overlap_blocks, d.prompt_blocks)
    }
}

/// Blocks two token streams share from the start.
fn shared_blocks(a: &[u32], b: &[u32]) -> usize {
    let same = a.iter().zip(b).take_while(|(x, y)| x == y).count();
    same / BS
}

struct Case {
    tok: Tokenizer,
    a: String,
    b: String,
    c: String,
}

fn case() -> Case {
    Case {
        tok: tokenizer(),
        // 224x224 -> 64 tokens, 112x224 -> 32 tokens (Qwen2-VL).
        a: png_url(224, 224, 1),
        b: png_url(224, 112, 2),
        c: png_url(224, 112, 3),
    }
}

fn check_routing(pool: &Pool, worker: WorkerKey, cs: &Case) {
    let first = chat(&cs.a, &cs.b, None);
    let first_tokens = routing_tokens(&cs.tok, &first);
    let stored = first_tokens.len() / BS;
    let follow_up = Some("describe both pictures in more detail please");

    // A different second image: only the blocks before it match.
    let other = chat(&cs.a, &cs.c, follow_up);
    let other_tokens = routing_tokens(&cs.tok, &other);
    let up_to = shared_blocks(&first_tokens, &other_tokens);
    assert!(up_to > 0 && up_to < stored, "{up_to} of {stored}");
    let (w, overlap, _) = pool.route(&request(&cs.tok, &other));
    assert_eq!(w, worker);
    assert_eq!(overlap, up_to, "matches only up to the different image");

    // The same images and a longer text: the engine's whole prompt matches.
    let longer = chat(&cs.a, &cs.b, follow_up);
    let (w, overlap, blocks) = pool.route(&request(&cs.tok, &longer));
    assert_eq!(w, worker, "routed to the worker holding the images");
    assert_eq!(overlap, stored, "full overlap with the stored prompt");
    assert!(blocks > stored);
}

#[test]
fn routing_tokens_carry_pad_values_for_each_image_token() {
    let cs = case();
    let toks = routing_tokens(&cs.tok, &chat(&cs.a, &cs.b, None));
    let pa = pad_value(identify(&cs.a).mm_hash);
    let pb = pad_value(identify(&cs.b).mm_hash);
    assert_eq!(toks.iter().filter(|&&t| t == pa).count(), 64);
    assert_eq!(toks.iter().filter(|&&t| t == pb).count(), 32);
    // Qwen2-VL's placeholder: vision_start, the pads, vision_end.
    let start = cs.tok.encode("<|vision_start|>", false).unwrap()[0];
    let end = cs.tok.encode("<|vision_end|>", false).unwrap()[0];
    let i = toks.iter().position(|&t| t == pa).unwrap();
    assert_eq!(toks[i - 1], start);
    assert_eq!(toks[i + 64], end);
    assert!(cs.tok.image_token_id().is_some());
}

#[test]
fn sglang_events_with_pad_values_route_two_image_prompts() {
    let cs = case();
    let mut pool = Pool::new(None);
    let worker = pool.worker(1);
    let tokens = routing_tokens(&cs.tok, &chat(&cs.a, &cs.b, None));
    let stats = pool.publish(worker, &sglang_event(&tokens));
    assert_eq!(stats.stored_blocks as usize, tokens.len() / BS);
    check_routing(&pool, worker, &cs);
}

#[test]
fn vllm_events_with_extra_keys_route_two_image_prompts() {
    let cs = case();
    let image_token = cs.tok.image_token_id().unwrap();
    let mut pool = Pool::new(Some(image_token));
    let worker = pool.worker(2);
    let tokens = routing_tokens(&cs.tok, &chat(&cs.a, &cs.b, None));
    let images = [identify(&cs.a).mm_hash, identify(&cs.b).mm_hash];
    let stats = pool.publish(worker, &vllm_event(&tokens, image_token, &images, true));
    assert_eq!(stats.stored_blocks as usize, tokens.len() / BS);
    assert!(stats.mm_blocks >= 6, "{stats:?}");
    assert_eq!(stats.mm_native_blocks + stats.mm_unmapped_blocks, 0);
    check_routing(&pool, worker, &cs);
}

#[test]
fn vllm_native_hashes_match_only_the_text_before_the_first_image() {
    let cs = case();
    let image_token = cs.tok.image_token_id().unwrap();
    let mut pool = Pool::new(Some(image_token));
    let worker = pool.worker(0);
    let first = chat(&cs.a, &cs.b, None);
    let tokens = routing_tokens(&cs.tok, &first);
    let images = [identify(&cs.a).mm_hash, identify(&cs.b).mm_hash];
    // vLLM ignored kvpick's UUIDs and hashed the images itself.
    let stats = pool.publish(worker, &vllm_event(&tokens, image_token, &images, false));
    assert!(stats.mm_native_blocks > 0);
    let before_image = tokens.iter().position(|&t| is_pad_value(t)).unwrap() / BS;
    let overlaps = pool.scheduler.index().lookup(
        &pool.scheduler.block_hashes(&request(&cs.tok, &first)),
        &[worker],
        Instant::now(),
    );
    assert_eq!(overlaps, vec![before_image]);
}

#[test]
fn vllm_events_without_the_image_token_are_unmapped() {
    let cs = case();
    let image_token = cs.tok.image_token_id().unwrap();
    let mut pool = Pool::new(None);
    let worker = pool.worker(0);
    let tokens = routing_tokens(&cs.tok, &chat(&cs.a, &cs.b, None));
    let images = [identify(&cs.a).mm_hash, identify(&cs.b).mm_hash];
    let stats = pool.publish(worker, &vllm_event(&tokens, image_token, &images, true));
    assert_eq!(stats.mm_unmapped_blocks, stats.mm_blocks);
    assert!(stats.mm_blocks > 0);
}

// ---- Remote images fetched by content (`--mm-fetch`) ----------------------

/// A local image server: `/cat.png` (the bytes given), `/big.png` (over any
/// small cap, with a length), `/stream.png` (the same without a length),
/// `/slow.png` (answers after 10 s), `/moved` (a redirect). Counts requests.
struct ImageServer {
    addr: std::net::SocketAddr,
    hits: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
    /// The CA-less self-signed certificate a TLS server presents.
    cert: Option<rustls::pki_types::CertificateDer<'static>>,
}

impl Drop for ImageServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl ImageServer {
    async fn start(cat: Vec<u8>) -> ImageServer {
        ImageServer::serve(cat, None).await
    }

    /// The same over TLS, with a self-signed certificate for 127.0.0.1.
    async fn start_tls(cat: Vec<u8>) -> ImageServer {
        let key = rcgen::generate_simple_self_signed(vec!["127.0.0.1".into()]).unwrap();
        let cert = key.cert.der().clone();
        let config = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(
            vec![cert.clone()],
            rustls::pki_types::PrivateKeyDer::Pkcs8(key.signing_key.serialize_der().into()),
        )
        .unwrap();
        let mut server =
            ImageServer::serve(cat, Some(tokio_rustls::TlsAcceptor::from(Arc::new(config)))).await;
        server.cert = Some(cert);
        server
    }

    async fn serve(cat: Vec<u8>, tls: Option<tokio_rustls::TlsAcceptor>) -> ImageServer {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let hits = Arc::new(AtomicUsize::new(0));
        let counted = Arc::clone(&hits);
        let task = tokio::spawn(async move {
            let mut conns = tokio::task::JoinSet::new();
            while let Ok((sock, _)) = listener.accept().await {
                counted.fetch_add(1, Ordering::SeqCst);
                let cat = cat.clone();
                match tls.clone() {
                    None => conns.spawn(serve_image(sock, cat)),
                    Some(tls) => conns.spawn(async move {
                        if let Ok(sock) = tls.accept(sock).await {
                            serve_image(sock, cat).await;
                        }
                    }),
                };
            }
        });
        ImageServer {
            addr,
            hits,
            task,
            cert: None,
        }
    }

    fn url(&self, path: &str) -> String {
        let scheme = if self.cert.is_some() { "https" } else { "http" };
        format!("{scheme}://{}{path}", self.addr)
    }

    fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }
}

async fn serve_image(
    mut sock: impl tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    cat: Vec<u8>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        match sock.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => head.extend_from_slice(&buf[..n]),
        }
    }
    let head = String::from_utf8_lossy(&head);
    let path = head.split_whitespace().nth(1).unwrap_or("/").to_string();
    let big = [cat.clone(), vec![0; 64 << 10]].concat();
    let (status, length, body) = match path.as_str() {
        "/cat.png" => ("200 OK", true, cat),
        "/big.png" => ("200 OK", true, big),
        "/stream.png" => ("200 OK", false, big),
        "/slow.png" => {
            tokio::time::sleep(std::time::Duration::from_secs(10)).await;
            ("200 OK", true, cat)
        }
        "/moved" => ("302 Found", true, Vec::new()),
        _ => ("404 Not Found", true, Vec::new()),
    };
    let mut out = format!("HTTP/1.1 {status}\r\nlocation: /cat.png\r\nconnection: close\r\n");
    if length {
        out.push_str(&format!("content-length: {}\r\n", body.len()));
    }
    out.push_str("\r\n");
    let _ = sock.write_all(out.as_bytes()).await;
    let _ = sock.write_all(&body).await;
    let _ = sock.shutdown().await;
}

/// PNG header bytes of a `w`×`h` picture and its `data:` URL.
fn png_bytes(w: u32, h: u32, salt: u8) -> (Vec<u8>, String) {
    let url = png_url(w, h, salt);
    let b64 = url.split_once(',').unwrap().1;
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(b64)
        .unwrap();
    (bytes, url)
}

/// The test's explicit opt-in to plain http on loopback (never the default).
fn loopback_policy() -> FetchPolicy {
    FetchPolicy {
        allow_http: true,
        allow_private: true,
        ..FetchPolicy::default()
    }
}

fn remote_images(policy: FetchPolicy, limits: FetchLimits) -> Arc<RemoteImages> {
    remote_images_trusting(policy, limits, rustls::RootCertStore::empty())
}

fn remote_images_trusting(
    policy: FetchPolicy,
    limits: FetchLimits,
    roots: rustls::RootCertStore,
) -> Arc<RemoteImages> {
    let fetcher = HttpImageFetcher::new(policy, roots).unwrap();
    Arc::new(RemoteImages::new(Arc::new(fetcher), limits))
}

#[tokio::test]
async fn images_are_fetched_over_tls_from_servers_the_roots_trust() {
    let (cat, cat_data_url) = png_bytes(224, 224, 7);
    let server = ImageServer::start_tls(cat).await;
    let url = server.url("/cat.png");
    assert!(url.starts_with("https://127.0.0.1:"));
    // Loopback is allowed here only because this test says so; http is not.
    let policy = FetchPolicy {
        allow_private: true,
        ..FetchPolicy::default()
    };
    let mut roots = rustls::RootCertStore::empty();
    roots.add(server.cert.clone().unwrap()).unwrap();
    let trusting = remote_images_trusting(policy.clone(), FetchLimits::default(), roots);
    let known = trusting.resolve([url.as_str()]).await;
    assert_eq!(known.identify(&url), identify(&cat_data_url));
    assert_eq!(trusting.stats().count(FetchOutcome::Ok), 1);

    // A certificate the roots do not trust: the handshake fails, URL identity.
    let untrusting = remote_images(policy, FetchLimits::default());
    let known = untrusting.resolve([url.as_str()]).await;
    assert_eq!(known.identify(&url), url_identity(&url));
    assert_eq!(untrusting.stats().count(FetchOutcome::Error), 1);
    assert_eq!(server.hits(), 2);
}

#[tokio::test]
async fn a_fetched_image_routes_like_the_same_bytes_sent_as_a_data_url() {
    let cs = case();
    let (cat, cat_data_url) = png_bytes(224, 224, 7);
    let server = ImageServer::start(cat).await;
    let cat_url = server.url("/cat.png");
    let follow_up = Some("describe both pictures in more detail please");

    // The engine (SGLang) cached the conversation whose first image came inline.
    let mut pool = Pool::new(None);
    let worker = pool.worker(1);
    let stored = routing_tokens(&cs.tok, &chat(&cat_data_url, &cs.b, None));
    pool.publish(worker, &sglang_event(&stored));

    // The next turn names the same picture by URL.
    let body = chat(&cat_url, &cs.b, follow_up);
    let raw = bytes::Bytes::from(serde_json::to_vec(&body).unwrap());
    let urls = [cat_url.clone(), cs.b.clone()];
    let routed = |tokens: Vec<kvpick::request::Segment>| {
        let mut r = parse(&raw, Some(ApiKind::Chat)).unwrap();
        r.segments = tokens;
        pool.route(&r)
    };

    // Without fetching, the URL's identity and unknown size end the match there.
    let plain = TokenizerPool::new(tokenizer(), 1);
    let (tokens, fetched) = plain.tokenize_fetching(template(&body), &urls).await;
    assert!(fetched.is_empty());
    let before_image = shared_blocks(&stored, &token_ids(&tokens.unwrap()));
    assert!(before_image < stored.len() / BS);

    // Fetched: the content identity of the data: URL, the same tokens, full overlap.
    let remote = remote_images(loopback_policy(), FetchLimits::default());
    let fetching = TokenizerPool::new(tokenizer(), 1).with_remote_images(Arc::clone(&remote));
    let (tokens, fetched) = fetching.tokenize_fetching(template(&body), &urls).await;
    assert_eq!(fetched.identify(&cat_url), identify(&cat_data_url));
    assert_eq!(fetched.identify(&cat_url).source, IdentitySource::Content);
    let tokens = tokens.unwrap();
    assert_eq!(
        token_ids(&tokens),
        routing_tokens(&cs.tok, &chat(&cat_data_url, &cs.b, follow_up)),
        "the routing tokens of the data: URL body, pad values included"
    );
    let (w, overlap, _) = routed(tokens);
    assert_eq!((w, overlap), (worker, stored.len() / BS));
    // The engine is told the same identity (SGLang's `mm_hashes`).
    assert_eq!(
        hints::image_hashes(urls.iter().map(String::as_str), &fetched),
        vec![identify(&cat_data_url).mm_hash, identify(&cs.b).mm_hash]
    );
    assert_eq!(remote.stats().count(FetchOutcome::Ok), 1);
    assert_eq!(server.hits(), 1);
}

#[tokio::test]
async fn remote_images_breaking_the_fetch_rules_keep_their_url_identity() {
    let (cat, _) = png_bytes(224, 224, 7);
    let server = ImageServer::start(cat).await;
    let port = server.addr.port();
    let check = |remote: &RemoteImages, known: &KnownImages, url: &str, outcome| {
        assert_eq!(known.identify(url), url_identity(url), "{url}");
        assert_eq!(remote.stats().count(outcome), 1, "{url}");
    };

    // Defaults: https only, public addresses only; nothing reaches the server.
    let remote = remote_images(FetchPolicy::default(), FetchLimits::default());
    let https_loopback = format!("https://127.0.0.1:{port}/cat.png");
    let https_localhost = format!("https://localhost:{port}/cat.png");
    let http = server.url("/cat.png");
    let known = remote.resolve([http.as_str()]).await;
    check(&remote, &known, &http, FetchOutcome::Refused);
    let known = remote.resolve([https_loopback.as_str()]).await;
    assert_eq!(
        known.identify(&https_loopback),
        url_identity(&https_loopback)
    );
    let known = remote.resolve([https_localhost.as_str()]).await;
    assert_eq!(
        known.identify(&https_localhost),
        url_identity(&https_localhost)
    );
    assert_eq!(remote.stats().count(FetchOutcome::Refused), 3);
    let http_only = FetchPolicy {
        allow_http: true,
        ..FetchPolicy::default()
    };
    let remote = remote_images(http_only, FetchLimits::default());
    let known = remote.resolve([http.as_str()]).await;
    check(&remote, &known, &http, FetchOutcome::Refused);
    let listed = FetchPolicy {
        allow_hosts: vec!["img.example".into()],
        ..loopback_policy()
    };
    let remote = remote_images(listed, FetchLimits::default());
    let known = remote.resolve([http.as_str()]).await;
    check(&remote, &known, &http, FetchOutcome::Refused);
    assert_eq!(server.hits(), 0, "refused before connecting");

    // Allowed to connect, but over the size cap, too slow, or redirected.
    let capped = FetchPolicy {
        max_bytes: 4096,
        ..loopback_policy()
    };
    let limits = FetchLimits {
        timeout: std::time::Duration::from_millis(300),
        ..FetchLimits::default()
    };
    let remote = remote_images(capped.clone(), limits);
    let big = server.url("/big.png");
    let known = remote.resolve([big.as_str()]).await;
    check(&remote, &known, &big, FetchOutcome::TooLarge);
    let stream = server.url("/stream.png");
    let remote = remote_images(capped.clone(), limits);
    let known = remote.resolve([stream.as_str()]).await;
    check(&remote, &known, &stream, FetchOutcome::TooLarge);
    let slow = server.url("/slow.png");
    let started = Instant::now();
    let known = remote.resolve([slow.as_str()]).await;
    assert!(started.elapsed() < std::time::Duration::from_secs(5));
    check(&remote, &known, &slow, FetchOutcome::Timeout);
    let moved = server.url("/moved");
    let known = remote.resolve([moved.as_str()]).await;
    check(&remote, &known, &moved, FetchOutcome::Status);
    assert_eq!(remote.stats().count(FetchOutcome::Ok), 0);
    assert_eq!(server.hits(), 4);
}

#[tokio::test]
async fn the_fetch_cache_answers_a_repeat_without_a_second_fetch() {
    let (cat, cat_data_url) = png_bytes(224, 224, 7);
    let server = ImageServer::start(cat).await;
    let remote = remote_images(loopback_policy(), FetchLimits::default());
    let url = server.url("/cat.png");
    let first = remote.resolve([url.as_str()]).await;
    let again = remote.resolve([url.as_str(), url.as_str()]).await;
    assert_eq!(first, again);
    assert_eq!(again.identify(&url), identify(&cat_data_url));
    assert_eq!(server.hits(), 1, "one fetch");
    assert_eq!(remote.stats().count(FetchOutcome::Ok), 1);
    assert_eq!(remote.stats().count(FetchOutcome::Cached), 1);
}
