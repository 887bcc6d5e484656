//! Fuzzing on the stable toolchain: a structured, mutation-based harness.
//!
//! Four targets take untrusted bytes: the request body parser, the KV-event
//! decoder (with ingest into a real prefix index), the standalone endpoints file
//! (loaded into an endpoint table) and the engines' metrics pages. Each target has
//! a structure-aware generator (JSON bodies with the fields routing reads and
//! hostile values, msgpack event batches, endpoint YAML, Prometheus lines) and
//! shares byte mutators (flips, interesting bytes, huge and negative numbers,
//! splices, truncation) applied to its corpus in `fuzz/corpus/<target>/`.
//!
//! - `cargo test --test fuzz` replays the corpus and runs a short, seeded burst
//!   of every target (part of the normal suite).
//! - `KVPICK_FUZZ_SECS=600 nice -n 19 cargo test --test fuzz -- --ignored fuzz_body`
//!   (or `fuzz_kvevents`, `fuzz_endpoints`, `fuzz_metrics`) runs one target for
//!   that long and prints how many inputs ran. With `KVPICK_FUZZ_SAVE=1`, inputs
//!   whose outcome was not seen before (a new error, a new shape of success) are
//!   added to the corpus. A panicking input is written to `fuzz/crashes/` and the
//!   run fails.

use std::collections::HashSet;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvpick::endpoints::{EndpointTable, Engine, WorkerKey};
use kvpick::kv::index::{IndexConfig, PrefixIndex};
use kvpick::kvevents::vllm::Vllm;
use kvpick::kvevents::Ingest;
use kvpick::kvevents::{decode_seq, parse_topic, EventDecoder};
use kvpick::request::{self, ApiKind, NvExtEdit};
use kvpick::scheduler::Scheduler;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rmpv::Value as Mp;
use serde_json::{json, Value};

/// One fuzz target: runs an input and names its outcome (for corpus novelty).
struct Target {
    name: &'static str,
    run: fn(&[u8]) -> String,
    generate: fn(&mut StdRng) -> Vec<u8>,
}

const TARGETS: [Target; 4] = [
    Target {
        name: "body",
        run: run_body,
        generate: gen_body,
    },
    Target {
        name: "kvevents",
        run: run_kvevents,
        generate: gen_kvevents,
    },
    Target {
        name: "endpoints",
        run: run_endpoints,
        generate: gen_endpoints,
    },
    Target {
        name: "metrics",
        run: run_metrics,
        generate: gen_metrics,
    },
];

/// The outcome's shape: the error's kind (its text up to the first digit or
/// quote), or "ok" with a coarse summary.
fn shape<T, E: std::fmt::Display>(r: &Result<T, E>, ok: impl FnOnce(&T) -> String) -> String {
    match r {
        Ok(v) => format!("ok:{}", ok(v)),
        Err(e) => {
            let text = e.to_string();
            let cut = text
                .find(|c: char| c.is_ascii_digit() || c == '"' || c == '`')
                .unwrap_or(text.len());
            format!("err:{}", &text[..cut.min(60)])
        }
    }
}

fn run_body(input: &[u8]) -> String {
    let mut out = String::new();
    for kind in [
        None,
        Some(ApiKind::Chat),
        Some(ApiKind::Completions),
        Some(ApiKind::Responses),
    ] {
        let parsed = request::parse(input, kind);
        out += &shape(&parsed, |r| {
            format!("{}seg{}", r.segments.len().min(3), r.prompt_len().min(1))
        });
        if let Ok(r) = &parsed {
            // What routing does with a parsed body: hash its blocks, strip the
            // client's worker fields, and chain another edit on the result.
            let _ = Scheduler::default().block_hashes(r);
            let mut r = r.clone();
            if let Ok(Some(body)) = r.rewrite_body(input, &NvExtEdit::strip_client_routing()) {
                let edit = NvExtEdit::default().set("backend_instance_id", &7u64);
                let _ = r.rewrite_body(&body, &edit);
            }
        }
    }
    out
}

fn run_kvevents(input: &[u8]) -> String {
    let _ = decode_seq(input);
    let _ = parse_topic(input);
    let batch = Vllm.decode(input);
    if let Ok(b) = &batch {
        let index = Arc::new(PrefixIndex::new(IndexConfig::default()));
        let mut ingest = Ingest::new(Arc::clone(&index), "m");
        let worker = WorkerKey {
            instance_id: 1,
            dp_rank: b.dp_rank.unwrap_or(0),
        };
        ingest.set_live(worker, true);
        ingest.apply(worker, Some("m"), b, Instant::now());
        ingest.apply(worker, None, b, Instant::now());
    }
    shape(&batch, |b| format!("{}ev", b.events.len().min(4)))
}

fn run_endpoints(input: &[u8]) -> String {
    let text = String::from_utf8_lossy(input);
    let parsed = kvpick::discovery::file::parse(&text);
    if let Ok(eps) = &parsed {
        // Loading them allocates per rank: a huge dp_size must have been refused.
        let table = EndpointTable::new();
        table.replace(eps.clone());
        table.replace(Vec::new());
    }
    shape(&parsed, |e| format!("{}ep", e.len().min(3)))
}

fn run_metrics(input: &[u8]) -> String {
    let text = String::from_utf8_lossy(input);
    let mut out = String::new();
    for engine in [Engine::Vllm, Engine::Sglang, Engine::Trtllm] {
        let r = kvpick::scrape::parse_load(engine, &text, Instant::now());
        // Never panics on a worker's page, whatever its adapter labels hold.
        let _ = kvpick::scrape::parse_lora(engine, &text, kvpick::scrape::DEFAULT_LORA_INFO_METRIC);
        out += &shape(&r, |l| format!("{}", l.block_size.is_some()));
    }
    out
}

/// Values that break naive arithmetic and conversions.
const HOSTILE_NUMBERS: &[&str] = &[
    "0",
    "-1",
    "1",
    "255",
    "65536",
    "4294967295",
    "4294967296",
    "9007199254740993",
    "18446744073709551615",
    "18446744073709551616",
    "-9223372036854775808",
    "1e308",
    "-1e308",
    "1e999",
    "0.5",
    "-0.0",
    "NaN",
    "Infinity",
    "+Inf",
];

fn hostile_json(rng: &mut StdRng, depth: u32) -> Value {
    match rng.random_range(0..if depth == 0 { 6 } else { 9 }) {
        0 => Value::Null,
        1 => Value::Bool(rng.random()),
        2 => json!(rng.random::<u64>() >> rng.random_range(0..64)),
        3 => json!(-(rng.random::<i64>().abs() >> rng.random_range(0..63))),
        4 => json!(rng.random::<f64>() * 10f64.powi(rng.random_range(-5..300))),
        5 => Value::String(random_text(rng)),
        6 => Value::Array(
            (0..rng.random_range(0..4))
                .map(|_| hostile_json(rng, depth - 1))
                .collect(),
        ),
        7 => random_message(rng, depth - 1),
        _ => {
            let keys = BODY_KEYS;
            let mut m = serde_json::Map::new();
            for _ in 0..rng.random_range(0..4) {
                let k = keys[rng.random_range(0..keys.len())];
                m.insert(k.into(), hostile_json(rng, depth - 1));
            }
            Value::Object(m)
        }
    }
}

const BODY_KEYS: &[&str] = &[
    "model",
    "messages",
    "prompt",
    "input",
    "stream",
    "max_tokens",
    "nvext",
    "session_control",
    "session_id",
    "action",
    "timeout",
    "agent_hints",
    "priority",
    "token_data",
    "use_raw_prompt",
    "backend_instance_id",
    "decode_worker_id",
    "prefill_worker_id",
    "dp_rank",
    "prefill_dp_rank",
    "role",
    "content",
    "type",
    "text",
    "image_url",
    "url",
    "tools",
];

fn random_text(rng: &mut StdRng) -> String {
    const PIECES: &[&str] = &[
        "hello",
        " ",
        "\u{0}",
        "\u{FFFF}",
        "é",
        "😀",
        "\\",
        "\"",
        "open",
        "close",
        "user",
        "data:image/png;base64,iVBORw0KGgo=",
        "<image>",
        "system",
        "",
    ];
    let n = rng.random_range(0..6);
    let mut s: String = (0..n)
        .map(|_| PIECES[rng.random_range(0..PIECES.len())])
        .collect();
    if rng.random_ratio(1, 20) {
        s.push_str(&"x".repeat(rng.random_range(0..100_000)));
    }
    s
}

fn random_message(rng: &mut StdRng, depth: u32) -> Value {
    let content = match rng.random_range(0..3) {
        0 => Value::String(random_text(rng)),
        1 => json!([{"type": "text", "text": random_text(rng)},
                    {"type": "image_url", "image_url": {"url": random_text(rng)}}]),
        _ => hostile_json(rng, depth),
    };
    let role = ["user", "system", "assistant", "tool"][rng.random_range(0..4)];
    json!({"role": role, "content": content})
}

fn gen_body(rng: &mut StdRng) -> Vec<u8> {
    let mut body = serde_json::Map::new();
    body.insert("model".into(), json!("m"));
    if rng.random() {
        body.insert(
            "messages".into(),
            Value::Array(
                (0..rng.random_range(0..4))
                    .map(|_| random_message(rng, 2))
                    .collect(),
            ),
        );
    } else {
        body.insert("prompt".into(), hostile_json(rng, 2));
    }
    let mut sc = serde_json::Map::new();
    sc.insert("session_id".into(), hostile_json(rng, 1));
    if rng.random() {
        let action = ["open", "close", "x"][rng.random_range(0..3)];
        sc.insert("action".into(), json!(action));
    }
    if rng.random() {
        sc.insert("timeout".into(), hostile_json(rng, 0));
    }
    let mut nvext = serde_json::Map::new();
    for k in [
        "token_data",
        "backend_instance_id",
        "dp_rank",
        "agent_hints",
    ] {
        if rng.random_ratio(1, 3) {
            nvext.insert(k.into(), hostile_json(rng, 2));
        }
    }
    nvext.insert("session_control".into(), Value::Object(sc));
    body.insert("nvext".into(), Value::Object(nvext));
    for _ in 0..rng.random_range(0..3) {
        let k = BODY_KEYS[rng.random_range(0..BODY_KEYS.len())];
        body.insert(k.into(), hostile_json(rng, 3));
    }
    serde_json::to_vec(&Value::Object(body)).expect("a JSON value serialises")
}

fn hostile_mp(rng: &mut StdRng, depth: u32) -> Mp {
    match rng.random_range(0..if depth == 0 { 7 } else { 9 }) {
        0 => Mp::Nil,
        1 => Mp::from(rng.random::<u64>() >> rng.random_range(0..64)),
        2 => Mp::from(-(rng.random::<i64>().abs() >> rng.random_range(0..63))),
        3 => Mp::from(rng.random::<f64>() * 1e300),
        4 => Mp::from(
            [
                "BlockStored",
                "BlockRemoved",
                "AllBlocksCleared",
                "GPU",
                "x",
            ][rng.random_range(0..5)],
        ),
        5 => Mp::Binary((0..rng.random_range(0..40)).map(|_| rng.random()).collect()),
        6 => Mp::Boolean(rng.random()),
        7 => Mp::Array(
            (0..rng.random_range(0..6))
                .map(|_| hostile_mp(rng, depth - 1))
                .collect(),
        ),
        _ => Mp::Map(
            (0..rng.random_range(0..4))
                .map(|_| {
                    let k = [
                        "type",
                        "block_hashes",
                        "parent_block_hash",
                        "token_ids",
                        "block_size",
                        "events",
                        "ts",
                        "data_parallel_rank",
                        "medium",
                        "lora_name",
                        "extra_keys",
                    ][rng.random_range(0..11)];
                    (Mp::from(k), hostile_mp(rng, depth - 1))
                })
                .collect(),
        ),
    }
}

fn gen_event(rng: &mut StdRng) -> Mp {
    let ints = |rng: &mut StdRng, n: usize| {
        Mp::Array(
            (0..n)
                .map(|_| Mp::from(rng.random::<u64>() >> rng.random_range(0..64)))
                .collect(),
        )
    };
    match rng.random_range(0..4) {
        0 => {
            let blocks = rng.random_range(0..4);
            let bs = [0u64, 1, 16, 32, u32::MAX as u64 + 1][rng.random_range(0..5)];
            let ntok = rng.random_range(0..(blocks * 20 + 2));
            Mp::Array(vec![
                Mp::from("BlockStored"),
                ints(rng, blocks),
                if rng.random() {
                    Mp::Nil
                } else {
                    Mp::from(rng.random::<u64>())
                },
                ints(rng, ntok),
                Mp::from(bs),
                hostile_mp(rng, 0),
                hostile_mp(rng, 0),
                hostile_mp(rng, 0),
                hostile_mp(rng, 1),
            ])
        }
        1 => Mp::Array(vec![
            Mp::from("BlockRemoved"),
            ints(rng, 3),
            hostile_mp(rng, 0),
        ]),
        2 => Mp::Array(vec![Mp::from("AllBlocksCleared")]),
        _ => hostile_mp(rng, 2),
    }
}

fn gen_kvevents(rng: &mut StdRng) -> Vec<u8> {
    let events = Mp::Array(
        (0..rng.random_range(0..5))
            .map(|_| gen_event(rng))
            .collect(),
    );
    let batch = if rng.random() {
        Mp::Array(vec![Mp::from(1.5), events, hostile_mp(rng, 0)])
    } else {
        Mp::Map(vec![
            (Mp::from("ts"), hostile_mp(rng, 0)),
            (Mp::from("events"), events),
            (Mp::from("data_parallel_rank"), hostile_mp(rng, 0)),
        ])
    };
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, &batch).expect("writing to a Vec cannot fail");
    out
}

fn gen_endpoints(rng: &mut StdRng) -> Vec<u8> {
    let mut y = String::from("endpoints:\n");
    for i in 0..rng.random_range(0..4) {
        y += &format!("  - address: 10.0.0.{}:{}\n", i + 1, 8000 + i);
        for (key, values) in [
            ("instance_id", HOSTILE_NUMBERS),
            ("dp_size", HOSTILE_NUMBERS),
            ("role", &["prefill", "decode", "both", "x", "~"][..]),
            ("engine", &["vllm", "sglang", "trtllm", "[]"][..]),
            ("kv_events_port", HOSTILE_NUMBERS),
            ("bootstrap_port", HOSTILE_NUMBERS),
        ] {
            if rng.random_ratio(1, 2) {
                y += &format!("    {key}: {}\n", values[rng.random_range(0..values.len())]);
            }
        }
    }
    y.into_bytes()
}

const METRIC_NAMES: &[&str] = &[
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "vllm:cache_config_info",
    "sglang:num_queue_reqs",
    "sglang:num_running_reqs",
    "sglang:token_usage",
    "sglang:cache_config_info",
    "num_requests_waiting",
    "kv_cache_utilization",
    "trtllm_num_requests_waiting",
];

fn gen_metrics(rng: &mut StdRng) -> Vec<u8> {
    let mut page = String::new();
    for _ in 0..rng.random_range(0..12) {
        let name = METRIC_NAMES[rng.random_range(0..METRIC_NAMES.len())];
        match rng.random_range(0..4) {
            0 => page += &format!("# TYPE {name} gauge\n"),
            1 => page += &format!("# HELP {name} {}\n", random_text(rng)),
            _ => {
                let labels = match rng.random_range(0..3) {
                    0 => String::new(),
                    1 => format!(
                        "{{engine=\"{}\",block_size=\"{}\",num_gpu_blocks=\"{}\"}}",
                        rng.random_range(0..3),
                        HOSTILE_NUMBERS[rng.random_range(0..HOSTILE_NUMBERS.len())],
                        HOSTILE_NUMBERS[rng.random_range(0..HOSTILE_NUMBERS.len())]
                    ),
                    _ => format!("{{model_name=\"{}\"}}", random_text(rng).replace('"', "")),
                };
                let v = HOSTILE_NUMBERS[rng.random_range(0..HOSTILE_NUMBERS.len())];
                page += &format!("{name}{labels} {v}\n");
            }
        }
    }
    page.into_bytes()
}

/// One mutation of `input` (with `other` to splice from).
fn mutate(rng: &mut StdRng, input: &mut Vec<u8>, other: &[u8]) {
    const INTERESTING: &[u8] =
        b"\x00\xff\x7f\x80{}[]\":,\n-.e9\xc0\xc1\xcc\xcd\xce\xcf\xd0\xdc\xdd\xde\xdf\x90\x80";
    let len = input.len();
    match rng.random_range(0..9) {
        0 if len > 0 => {
            let i = rng.random_range(0..len);
            input[i] ^= 1 << rng.random_range(0..8);
        }
        1 if len > 0 => {
            let i = rng.random_range(0..len);
            input[i] = INTERESTING[rng.random_range(0..INTERESTING.len())];
        }
        2 => {
            let i = rng.random_range(0..=len);
            let n = rng.random_range(1..8);
            let bytes: Vec<u8> = (0..n).map(|_| rng.random()).collect();
            input.splice(i..i, bytes);
        }
        3 if len > 0 => {
            let a = rng.random_range(0..len);
            let b = rng.random_range(a..=len.min(a + 64));
            input.drain(a..b);
        }
        4 if len > 0 => {
            let a = rng.random_range(0..len);
            let b = rng.random_range(a..=len.min(a + 64));
            let piece = input[a..b].to_vec();
            let at = rng.random_range(0..=len);
            input.splice(at..at, piece);
        }
        5 if !other.is_empty() => {
            let a = rng.random_range(0..other.len());
            let b = rng.random_range(a..=other.len());
            let at = rng.random_range(0..=len);
            input.splice(at..at.min(len).max(at), other[a..b].iter().copied());
        }
        6 if len > 0 => input.truncate(rng.random_range(0..len)),
        7 => {
            // Replace a run of digits with a hostile number.
            if let Some(start) = input.iter().position(|b| b.is_ascii_digit()) {
                let end = input[start..]
                    .iter()
                    .position(|b| !b.is_ascii_digit())
                    .map_or(input.len(), |e| start + e);
                let n = HOSTILE_NUMBERS[rng.random_range(0..HOSTILE_NUMBERS.len())];
                input.splice(start..end, n.bytes());
            }
        }
        _ => {
            // msgpack integer and length markers with extreme payloads.
            let at = rng.random_range(0..=len);
            let marker: &[u8] = [
                &b"\xcf\xff\xff\xff\xff\xff\xff\xff\xff"[..],
                b"\xd3\x80\x00\x00\x00\x00\x00\x00\x00",
                b"\xdd\xff\xff\xff\xff",
                b"\xdf\xff\xff\xff\xff",
                b"\xdb\xff\xff\xff\xff",
                b"\xc6\xff\xff\xff\xff",
            ][rng.random_range(0..6)];
            input.splice(at..at, marker.iter().copied());
        }
    }
}

fn corpus_dir(target: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/corpus")
        .join(target)
}

fn corpus(target: &str) -> Vec<Vec<u8>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(corpus_dir(target))
        .map(|d| d.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default();
    files.sort();
    files.iter().filter_map(|p| std::fs::read(p).ok()).collect()
}

/// Runs `input`, saving it to `fuzz/crashes/` and failing if it panics.
fn run_checked(t: &Target, input: &[u8]) -> String {
    match catch_unwind(AssertUnwindSafe(|| (t.run)(input))) {
        Ok(outcome) => outcome,
        Err(_) => {
            let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fuzz/crashes");
            let _ = std::fs::create_dir_all(&dir);
            let path = dir.join(format!("{}-{:016x}", t.name, fnv(input)));
            let _ = std::fs::write(&path, input);
            panic!(
                "{} panicked on the input saved as {}",
                t.name,
                path.display()
            );
        }
    }
}

fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Fuzzes `t` for `budget` (or `max_inputs`); returns how many inputs ran.
fn fuzz(t: &Target, seed: u64, budget: Duration, max_inputs: u64, save: bool) -> u64 {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut pool = corpus(t.name);
    let mut seen: HashSet<String> = pool.iter().map(|i| run_checked(t, i)).collect();
    let started = Instant::now();
    let mut ran = 0u64;
    while ran < max_inputs && started.elapsed() < budget {
        let mut input = if pool.is_empty() || rng.random_ratio(1, 3) {
            (t.generate)(&mut rng)
        } else {
            pool[rng.random_range(0..pool.len())].clone()
        };
        let other = if pool.is_empty() {
            Vec::new()
        } else {
            pool[rng.random_range(0..pool.len())].clone()
        };
        for _ in 0..rng.random_range(0..4) {
            mutate(&mut rng, &mut input, &other);
        }
        let outcome = run_checked(t, &input);
        ran += 1;
        if seen.insert(outcome) && input.len() <= 64 << 10 {
            if save && pool.len() < 400 {
                let dir = corpus_dir(t.name);
                let _ = std::fs::create_dir_all(&dir);
                let _ = std::fs::write(dir.join(format!("{:016x}", fnv(&input))), &input);
            }
            pool.push(input);
        }
    }
    ran
}

#[test]
fn corpus_replays_and_a_short_burst_runs_without_panics() {
    for t in &TARGETS {
        let inputs = corpus(t.name);
        assert!(!inputs.is_empty(), "no corpus for {}", t.name);
        for input in &inputs {
            run_checked(t, input);
        }
        fuzz(t, 13, Duration::from_secs(60), 300, false);
    }
}

fn long_run(name: &str) {
    let t = TARGETS.iter().find(|t| t.name == name).expect("a target");
    let secs = std::env::var("KVPICK_FUZZ_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(600);
    let save = std::env::var_os("KVPICK_FUZZ_SAVE").is_some();
    let seed = rand::rng().random();
    let started = Instant::now();
    let ran = fuzz(t, seed, Duration::from_secs(secs), u64::MAX, save);
    println!(
        "fuzz {name}: {ran} inputs in {:.0?}, 0 panics (seed {seed})",
        started.elapsed()
    );
}

#[test]
#[ignore = "long fuzz run: KVPICK_FUZZ_SECS seconds"]
fn fuzz_body() {
    long_run("body");
}

#[test]
#[ignore = "long fuzz run: KVPICK_FUZZ_SECS seconds"]
fn fuzz_kvevents() {
    long_run("kvevents");
}

#[test]
#[ignore = "long fuzz run: KVPICK_FUZZ_SECS seconds"]
fn fuzz_endpoints() {
    long_run("endpoints");
}

#[test]
#[ignore = "long fuzz run: KVPICK_FUZZ_SECS seconds"]
fn fuzz_metrics() {
    long_run("metrics");
}
