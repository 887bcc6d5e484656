//! `kvpick-bench`: overhead against a no-op ext_proc server, routing quality on a
//! replayed trace against simulated workers, and index scale. Each subcommand
//! returns a serialisable report that prints as a Markdown table or one JSON object.

pub mod agreement;
pub mod ext_proc_client;
pub mod flood;
pub mod instructions;
pub mod lowreuse;
pub mod noop;
pub mod overhead;
pub mod overload;
pub mod peer_epp;
pub mod plot;
pub mod replay;
pub mod replicas;
pub mod scale;
pub mod server_process;
pub mod sim;
pub mod sync;
pub mod trace;

use std::time::Duration;

use kvpick::request::{ApiKind, InferenceRequest, NvExt, Segment};

/// A streamed `/v1/completions` request of `tokens` for `model`, as kvpick
/// parses one: the prompt every simulated and scaled workload sends.
pub fn completion_of_tokens(model: &str, tokens: Vec<u32>) -> InferenceRequest {
    InferenceRequest {
        kind: ApiKind::Completions,
        model: model.to_string(),
        segments: vec![Segment::Tokens(tokens)],
        stream: true,
        nvext: NvExt::default(),
        salt: None,
        names_worker: false,
        omitted_tokens: 0,
        omitted_text_bytes: 0,
        max_output_tokens: None,
        template: None,
    }
}

/// `a / b`, or 0 when `b` is 0 (nothing measured).
pub fn ratio(a: f64, b: f64) -> f64 {
    if b == 0.0 {
        0.0
    } else {
        a / b
    }
}

/// The `p`-quantile (0..=1) of `sorted` by nearest rank; 0 for an empty slice.
pub fn quantile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = (p.clamp(0.0, 1.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Sorts `values` in place (NaN-free) and returns them.
pub fn sorted(mut values: Vec<f64>) -> Vec<f64> {
    values.sort_by(|a, b| a.total_cmp(b));
    values
}

/// Microseconds of a duration as a float.
pub fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// Renders a Markdown table.
pub fn markdown_table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut out = format!("| {} |\n", header.join(" | "));
    out.push_str(&format!(
        "|{}\n",
        header.iter().map(|_| " --- |").collect::<String>()
    ));
    for r in rows {
        out.push_str(&format!("| {} |\n", r.join(" | ")));
    }
    out
}

/// A Markdown table with one row per item.
pub fn table_of<T>(header: &[&str], items: &[T], row: impl Fn(&T) -> Vec<String>) -> String {
    markdown_table(header, &items.iter().map(row).collect::<Vec<_>>())
}

/// A deterministic 64-bit generator (SplitMix64): the same seed gives the same
/// sequence on every machine.
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    /// A generator seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        SplitMix64(seed)
    }

    /// The next value.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A value in `0..n` (`n` > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_by_nearest_rank() {
        let v = sorted((1..=100).rev().map(f64::from).collect());
        assert_eq!(quantile(&v, 0.5), 50.0);
        assert_eq!(quantile(&v, 0.99), 99.0);
        assert_eq!(quantile(&v, 1.0), 100.0);
        assert_eq!(quantile(&v, 0.0), 1.0);
        assert_eq!(quantile(&[], 0.5), 0.0);
    }

    #[test]
    fn splitmix_is_deterministic_and_seed_dependent() {
        let a: Vec<u64> = {
            let mut g = SplitMix64::new(7);
            (0..4).map(|_| g.next_u64()).collect()
        };
        let mut g = SplitMix64::new(7);
        assert_eq!(a, (0..4).map(|_| g.next_u64()).collect::<Vec<_>>());
        let mut h = SplitMix64::new(8);
        assert_ne!(a[0], h.next_u64());
    }

    #[test]
    fn table_has_header_rule_and_rows() {
        let t = markdown_table(&["a", "b"], &[vec!["1".into(), "2".into()]]);
        assert_eq!(t, "| a | b |\n| --- | --- |\n| 1 | 2 |\n");
    }
}
