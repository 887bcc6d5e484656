//! Mooncake-format request traces and deterministic prompts for them.
//!
//! One JSON object a line: `timestamp` (ms), `input_length` and `output_length`
//! (tokens) and `hash_ids` (one id per prompt block of the trace's block size,
//! 512 tokens in Mooncake's traces; equal leading ids mean an equal prefix). A
//! prompt is made by turning each id into a block of token ids drawn from a PRNG
//! seeded with the id, concatenating them, and cutting to `input_length`, so
//! requests share exactly the prefixes the trace says.

use std::io::Read;
use std::path::Path;

use anyhow::Context;
use kvpick::request::InferenceRequest;
use serde::{Deserialize, Serialize};

use super::SplitMix64;

/// Tokens per block of Mooncake's traces (the default block size of a replay).
pub const BLOCK_TOKENS: usize = 512;

/// The model name of replayed requests (seeds kvpick's block hashes).
pub const MODEL: &str = "mooncake-replay";

/// Token ids are drawn below this (a typical vocabulary size).
const VOCAB: u64 = 128_000;

/// One request of a trace.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
pub struct TraceRequest {
    /// Arrival in milliseconds from the start of the trace.
    pub timestamp: u64,
    /// Prompt length in tokens.
    pub input_length: usize,
    /// Generated tokens.
    pub output_length: usize,
    /// Prefix block ids, one per block of prompt tokens.
    pub hash_ids: Vec<u64>,
}

/// The public synthetic Mooncake trace (tuning trace), relative to the repo root.
pub const SYNTHETIC: &str = "../shared/data/mooncake_synthetic_trace.jsonl";

/// The held-out Mooncake conversation trace (results on it count, never tune on
/// it), where the steering repo keeps public data beside the synthetic trace. It
/// is not in this repository: a fetched data file is never committed here.
pub const CONVERSATION: &str = "../shared/data/mooncake_conversation_trace.jsonl";

/// The low-reuse trace `kvpick-bench gen-trace` writes with its defaults
/// (64-token blocks; see [`super::lowreuse`]), committed beside the bench docs.
pub const LOWREUSE: &str = "docs/bench/lowreuse.jsonl";

/// The trace file a `--trace` value names: `synthetic`, `conversation` or
/// `lowreuse`, else a path.
pub fn resolve(choice: &Path) -> &Path {
    match choice.to_str() {
        Some("synthetic") => Path::new(SYNTHETIC),
        Some("conversation") => Path::new(CONVERSATION),
        Some("lowreuse") => Path::new(LOWREUSE),
        _ => choice,
    }
}

/// Spreads requests recorded at one timestamp evenly over the interval to the
/// next recorded timestamp, keeping their order; the last group stays as it is.
///
/// A trace recorded at a coarse resolution (the Mooncake conversation trace
/// rounds arrivals to 3-second buckets, about ten requests on one millisecond)
/// makes those requests arrive at the same instant. One router sees them one
/// after another anyway; several replicas see them at once, before any delta can
/// travel, which real arrivals spread over the bucket would not do.
pub fn spread_ties(requests: &mut [TraceRequest]) {
    let mut start = 0;
    while start < requests.len() {
        let t = requests[start].timestamp;
        let end = start
            + requests[start..]
                .iter()
                .take_while(|r| r.timestamp == t)
                .count();
        if let Some(next) = requests.get(end).map(|r| r.timestamp) {
            let (k, span) = ((end - start) as u64, next - t);
            for (j, r) in requests[start..end].iter_mut().enumerate() {
                r.timestamp = t + j as u64 * span / k;
            }
        }
        start = end;
    }
}

/// Reads a trace file (gunzipped when its name ends in `.gz`); requests are
/// returned in arrival order.
pub fn load(path: &Path) -> anyhow::Result<Vec<TraceRequest>> {
    let read = || -> std::io::Result<String> {
        let file = std::fs::File::open(path)?;
        let mut text = String::new();
        match path.extension().is_some_and(|e| e == "gz") {
            true => flate2::read::GzDecoder::new(file).read_to_string(&mut text)?,
            false => std::io::BufReader::new(file).read_to_string(&mut text)?,
        };
        Ok(text)
    };
    let text = read().with_context(|| format!("reading {}", path.display()))?;
    parse(&text).with_context(|| format!("parsing {}", path.display()))
}

/// Parses trace text (JSON lines; blank lines skipped); sorts by arrival, stably.
pub fn parse(text: &str) -> anyhow::Result<Vec<TraceRequest>> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let r: TraceRequest =
            serde_json::from_str(line).with_context(|| format!("line {}", i + 1))?;
        out.push(r);
    }
    out.sort_by_key(|r| r.timestamp);
    Ok(out)
}

/// The `block` deterministic token ids of block `hash_id`.
pub fn block_tokens(hash_id: u64, block: usize) -> Vec<u32> {
    let mut g = SplitMix64::new(hash_id ^ 0x6b76_7069_636b);
    (0..block).map(|_| g.below(VOCAB) as u32).collect()
}

/// The prompt token ids of a request whose blocks hold `block` tokens: its
/// blocks' tokens, cut to `input_length` (never longer than its blocks).
pub fn prompt_tokens(r: &TraceRequest, block: usize) -> Vec<u32> {
    let mut out = Vec::with_capacity(r.hash_ids.len() * block);
    for &id in &r.hash_ids {
        out.extend(block_tokens(id, block));
    }
    out.truncate(r.input_length);
    out
}

/// A request's body as kvpick parses it: a streamed completion of its token-id
/// prompt (blocks of `block` tokens) for [`MODEL`].
pub fn body(r: &TraceRequest, block: usize) -> InferenceRequest {
    super::completion_of_tokens(MODEL, prompt_tokens(r, block))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_orders_by_arrival() {
        let t = parse(
            r#"{"timestamp": 5, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]}

{"timestamp": 1, "input_length": 512, "output_length": 9, "hash_ids": [1]}"#,
        )
        .unwrap();
        assert_eq!(t.len(), 2);
        assert_eq!(t[0].timestamp, 1);
        assert_eq!(t[1].hash_ids, vec![1, 2]);
        assert!(parse("{\"timestamp\": 1}").is_err());
    }

    #[test]
    fn trace_names_resolve_beside_the_repository_and_paths_stay_paths() {
        assert_eq!(resolve(Path::new("synthetic")), Path::new(SYNTHETIC));
        assert_eq!(resolve(Path::new("conversation")), Path::new(CONVERSATION));
        assert_eq!(resolve(Path::new("x.jsonl")), Path::new("x.jsonl"));
    }

    #[test]
    fn a_gzipped_trace_is_read_gunzipped() {
        let path =
            std::env::temp_dir().join(format!("kvpick-trace-{}.jsonl.gz", std::process::id()));
        let mut gz = flate2::write::GzEncoder::new(
            std::fs::File::create(&path).unwrap(),
            flate2::Compression::fast(),
        );
        std::io::Write::write_all(
            &mut gz,
            b"{\"timestamp\": 5, \"input_length\": 600, \"output_length\": 2, \"hash_ids\": [0, 1]}\n",
        )
        .unwrap();
        gz.finish().unwrap();
        let t = load(&path);
        std::fs::remove_file(&path).unwrap();
        let t = t.unwrap();
        assert_eq!(t.len(), 1);
        assert_eq!(t[0].hash_ids, vec![0, 1]);
    }

    #[test]
    fn shared_ids_give_shared_prefixes() {
        let a = TraceRequest {
            timestamp: 0,
            input_length: 700,
            output_length: 1,
            hash_ids: vec![10, 11],
        };
        let b = TraceRequest {
            hash_ids: vec![10, 12],
            input_length: 1024,
            ..a.clone()
        };
        let (ta, tb) = (prompt_tokens(&a, 512), prompt_tokens(&b, 512));
        assert_eq!(ta.len(), 700);
        assert_eq!(tb.len(), 1024);
        assert_eq!(ta[..512], tb[..512]);
        assert_ne!(ta[512..700], tb[512..700]);
        assert_eq!(block_tokens(10, 512), block_tokens(10, 512));
        assert_eq!(prompt_tokens(&a, 64).len(), 128, "cut to its blocks");
    }

    #[test]
    fn ties_are_spread_over_the_gap_to_the_next_timestamp() {
        let at = |t| TraceRequest {
            timestamp: t,
            input_length: 1,
            output_length: 1,
            hash_ids: vec![],
        };
        let mut rs = vec![
            at(0),
            at(0),
            at(0),
            at(3000),
            at(3000),
            at(3001),
            at(4000),
            at(4000),
        ];
        spread_ties(&mut rs);
        let ts: Vec<u64> = rs.iter().map(|r| r.timestamp).collect();
        assert_eq!(ts, [0, 1000, 2000, 3000, 3000, 3001, 4000, 4000]);
    }
}
