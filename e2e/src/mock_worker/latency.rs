//! The mock worker's latency histograms, as vLLM serves them:
//! `vllm:request_queue_time_seconds`, `vllm:time_to_first_token_seconds` and
//! `vllm:inter_token_latency_seconds`, with vLLM's bucket boundaries, one
//! series per engine (dp rank), in the Prometheus client's text format
//! (labels sorted, values as Python floats, cumulative buckets then `_count`
//! and `_sum`).

use std::fmt::Write;
use std::time::Duration;

/// vLLM's TTFT buckets (seconds).
const TTFT_BUCKETS: [f64; 22] = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
/// vLLM's inter-token latency buckets (seconds).
const ITL_BUCKETS: [f64; 19] = [
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];
/// vLLM's request-latency buckets, used for queue time (seconds).
const REQUEST_LATENCY_BUCKETS: [f64; 21] = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

/// One histogram series: per-bucket counts (not cumulative), count and sum.
#[derive(Debug, Clone)]
struct Histogram {
    bounds: &'static [f64],
    counts: Vec<u64>,
    count: u64,
    sum: f64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            counts: vec![0; bounds.len()],
            count: 0,
            sum: 0.0,
        }
    }

    fn observe(&mut self, d: Duration) {
        let v = d.as_secs_f64();
        if let Some(i) = self.bounds.iter().position(|b| v <= *b) {
            self.counts[i] += 1;
        }
        self.count += 1;
        self.sum += v;
    }
}

/// The three latency histograms of one engine (dp rank).
#[derive(Debug, Clone)]
pub(super) struct EngineLatency {
    queue: Histogram,
    ttft: Histogram,
    itl: Histogram,
}

impl EngineLatency {
    pub(super) fn new() -> Self {
        EngineLatency {
            queue: Histogram::new(&REQUEST_LATENCY_BUCKETS),
            ttft: Histogram::new(&TTFT_BUCKETS),
            itl: Histogram::new(&ITL_BUCKETS),
        }
    }

    /// Time a request waited for a running slot.
    pub(super) fn queued(&mut self, d: Duration) {
        self.queue.observe(d);
    }

    /// Time from a request's arrival to its first token.
    pub(super) fn first_token(&mut self, d: Duration) {
        self.ttft.observe(d);
    }

    /// Time between two output tokens.
    pub(super) fn inter_token(&mut self, d: Duration) {
        self.itl.observe(d);
    }
}

/// Which of an engine's histograms a family shows.
type SeriesOf = fn(&EngineLatency) -> &Histogram;

/// The exposition text of every engine's histograms for `model`.
pub(super) fn render(model: &str, engines: &[EngineLatency]) -> String {
    let mut out = String::new();
    let families: [(&str, &str, SeriesOf); 3] = [
        (
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            |e| &e.queue,
        ),
        (
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            |e| &e.ttft,
        ),
        (
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            |e| &e.itl,
        ),
    ];
    for (name, help, pick) in families {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} histogram");
        for (engine, e) in engines.iter().enumerate() {
            let h = pick(e);
            let mut cumulative = 0;
            for (bound, n) in h.bounds.iter().zip(&h.counts) {
                cumulative += n;
                let _ = writeln!(
                    out,
                    "{name}_bucket{{engine=\"{engine}\",le=\"{}\",model_name=\"{model}\"}} {}",
                    py_float(*bound),
                    py_float(cumulative as f64)
                );
            }
            let labels = format!("engine=\"{engine}\",model_name=\"{model}\"");
            let count = py_float(h.count as f64);
            let _ = writeln!(
                out,
                "{name}_bucket{{engine=\"{engine}\",le=\"+Inf\",model_name=\"{model}\"}} {count}"
            );
            let _ = writeln!(out, "{name}_count{{{labels}}} {count}");
            let _ = writeln!(out, "{name}_sum{{{labels}}} {}", py_float(h.sum));
        }
    }
    out
}

/// `v` as Python's `repr(float)` writes it for these magnitudes: whole
/// numbers keep a `.0`.
fn py_float(v: f64) -> String {
    if v.fract() == 0.0 && v.abs() < 1e16 {
        format!("{v:.1}")
    } else {
        format!("{v}")
    }
}
