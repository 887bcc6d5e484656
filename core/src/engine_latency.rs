//! The engine's own latency histograms, read from its `/metrics` page: the
//! second latency signal beside what the gateway times itself.
//!
//! | figure | vLLM | SGLang |
//! | --- | --- | --- |
//! | queue time | `vllm:request_queue_time_seconds` | `sglang:queue_time_seconds` |
//! | TTFT | `vllm:time_to_first_token_seconds` | `sglang:time_to_first_token_seconds` |
//! | inter-token latency | `vllm:inter_token_latency_seconds` (older: `vllm:time_per_output_token_seconds`) | `sglang:inter_token_latency_seconds` (older: `sglang:time_per_output_token_seconds`) |
//!
//! trtllm-serve exports none of them. A page gives each histogram's running
//! totals ([`parse_totals`]: `_sum` and `_count`, summed over its series, one
//! per model or data-parallel engine); an [`EngineWindow`] turns successive
//! totals into the mean over the requests the engine finished between two
//! scrapes at least [`MIN_WINDOW`] apart ([`EngineLatency`]). Invariants: a window's figures are finite,
//! non-negative and at most [`MAX_SECONDS`]; totals that go backwards (the
//! engine restarted) start a new count instead of giving a negative mean; a
//! window without a finished request keeps the figure of the last one that
//! had any. Fixed size: no allocation per scrape beyond the parse.

use std::time::{Duration, Instant};

use crate::engine::Engine;

/// Largest mean a window reports (a larger one reads as this).
pub const MAX_SECONDS: f64 = 3600.0;

/// One histogram's running totals.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Totals {
    /// Sum of the observed seconds.
    pub sum: f64,
    /// Observations.
    pub count: f64,
}

/// The running totals of the three histograms on one page (`None`: the page
/// does not export that histogram).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EngineTotals {
    /// Time requests waited in the engine's queue.
    pub queue: Option<Totals>,
    /// Time to first token, as the engine measures it.
    pub ttft: Option<Totals>,
    /// Time between output tokens.
    pub itl: Option<Totals>,
}

/// The engine's recent latency: each figure the mean over the requests (or
/// tokens) it finished in the latest scrape interval that had any.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EngineLatency {
    /// Mean queue time, seconds.
    pub queue: Option<f64>,
    /// Mean TTFT, seconds.
    pub ttft: Option<f64>,
    /// Mean inter-token latency, seconds.
    pub itl: Option<f64>,
    /// When the latest of these windows closed.
    pub at: Option<Instant>,
}

/// Histogram base names per figure, the first found wins.
struct Names {
    queue: &'static [&'static str],
    ttft: &'static [&'static str],
    itl: &'static [&'static str],
}

fn names(engine: Engine) -> Option<Names> {
    match engine {
        Engine::Vllm => Some(Names {
            queue: &["vllm:request_queue_time_seconds"],
            ttft: &["vllm:time_to_first_token_seconds"],
            itl: &[
                "vllm:inter_token_latency_seconds",
                "vllm:time_per_output_token_seconds",
            ],
        }),
        Engine::Sglang => Some(Names {
            queue: &["sglang:queue_time_seconds"],
            ttft: &["sglang:time_to_first_token_seconds"],
            itl: &[
                "sglang:inter_token_latency_seconds",
                "sglang:time_per_output_token_seconds",
            ],
        }),
        Engine::Trtllm => None,
    }
}

/// The running totals of the latency histograms on a metrics page of
/// `engine`. Reads only the `_sum` and `_count` lines of the histograms it
/// knows; a malformed or non-finite value is skipped.
pub fn parse_totals(engine: Engine, text: &str) -> EngineTotals {
    let Some(n) = names(engine) else {
        return EngineTotals::default();
    };
    // (sum, count) per candidate name, in table order.
    let mut found: [[Totals; 2]; 3] = Default::default();
    let mut seen = [[false; 2]; 3];
    let figures = [n.queue, n.ttft, n.itl];
    for line in text.lines() {
        let line = line.trim_start();
        if !(line.starts_with("vllm:") || line.starts_with("sglang:")) {
            continue;
        }
        let end = line
            .find(|c: char| c == '{' || c.is_whitespace())
            .unwrap_or(line.len());
        let name = &line[..end];
        let (base, is_sum) = match (name.strip_suffix("_sum"), name.strip_suffix("_count")) {
            (Some(b), _) => (b, true),
            (_, Some(b)) => (b, false),
            _ => continue,
        };
        let Some((f, c)) = figures
            .iter()
            .enumerate()
            .find_map(|(f, cands)| cands.iter().position(|n| *n == base).map(|c| (f, c)))
        else {
            continue;
        };
        let Some(v) = sample_value(&line[end..]) else {
            continue;
        };
        let t = &mut found[f][c];
        if is_sum {
            t.sum += v;
        } else {
            t.count += v;
        }
        seen[f][c] = true;
    }
    let pick = |f: usize| (0..2).find(|c| seen[f][*c]).map(|c| found[f][c]);
    EngineTotals {
        queue: pick(0),
        ttft: pick(1),
        itl: pick(2),
    }
}

/// The value of a sample line after its name: past the labels (which may
/// hold spaces and braces inside quotes), the first field.
fn sample_value(rest: &str) -> Option<f64> {
    let after_labels = match rest.strip_prefix('{') {
        Some(labels) => {
            let mut quoted = false;
            let mut escaped = false;
            let close = labels.char_indices().find_map(|(i, ch)| {
                match (quoted, escaped, ch) {
                    (true, true, _) => escaped = false,
                    (true, false, '\\') => escaped = true,
                    (_, false, '"') => quoted = !quoted,
                    (false, _, '}') => return Some(i),
                    _ => {}
                }
                None
            })?;
            &labels[close + 1..]
        }
        None => rest,
    };
    let v: f64 = after_labels.split_whitespace().next()?.parse().ok()?;
    (v.is_finite() && v >= 0.0).then_some(v)
}

/// Shortest window: scrapes come every few tens of milliseconds, and a mean
/// over so short a spell is one or two requests.
pub const MIN_WINDOW: Duration = Duration::from_secs(1);

/// One endpoint's totals at the start of the open window, turning successive
/// scrapes into windows of at least [`MIN_WINDOW`].
#[derive(Debug, Clone, Copy, Default)]
pub struct EngineWindow {
    /// Totals when the open window began, per figure.
    base: EngineTotals,
    /// When the open window began.
    since: Option<Instant>,
    latest: EngineLatency,
}

impl EngineWindow {
    /// Folds in the totals scraped at `at`; returns the engine's recent
    /// latency (see the module doc).
    pub fn advance(&mut self, now: EngineTotals, at: Instant) -> EngineLatency {
        let closes = self
            .since
            .is_none_or(|s| at.saturating_duration_since(s) >= MIN_WINDOW);
        let mut fresh = false;
        for (base, now, figure) in [
            (&mut self.base.queue, now.queue, &mut self.latest.queue),
            (&mut self.base.ttft, now.ttft, &mut self.latest.ttft),
            (&mut self.base.itl, now.itl, &mut self.latest.itl),
        ] {
            let Some(now) = now else {
                // The page stopped exporting it: its figure goes too.
                *base = None;
                *figure = None;
                continue;
            };
            let Some(prev) = *base else {
                // First seen: the baseline.
                *base = Some(now);
                continue;
            };
            if now.count < prev.count || now.sum < prev.sum {
                // The engine restarted and counts from zero again.
                *base = Some(Totals::default());
            }
            if !closes {
                continue;
            }
            let prev = base.unwrap_or_default();
            let delta = Totals {
                sum: now.sum - prev.sum,
                count: now.count - prev.count,
            };
            *base = Some(now);
            if delta.count >= 1.0 {
                *figure = Some((delta.sum / delta.count).clamp(0.0, MAX_SECONDS));
                fresh = true;
            }
        }
        if closes {
            self.since = Some(at);
        }
        if fresh {
            self.latest.at = Some(at);
        }
        self.latest
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAGE: &str = r#"# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="m"} 3.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 0.6
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 4.0
vllm:time_to_first_token_seconds_sum{engine="1",model_name="m {odd} \"label\""} 0.4
vllm:time_to_first_token_seconds_count{engine="1",model_name="m {odd} \"label\""} 1.0
vllm:request_queue_time_seconds_sum{engine="0"} 1.5
vllm:request_queue_time_seconds_count{engine="0"} 5
vllm:time_per_output_token_seconds_sum{engine="0"} 9
vllm:time_per_output_token_seconds_count{engine="0"} 9
vllm:inter_token_latency_seconds_sum{engine="0"} 0.2
vllm:inter_token_latency_seconds_count{engine="0"} 20
vllm:num_requests_running{engine="0"} 3
"#;

    fn totals(sum: f64, count: f64) -> Option<Totals> {
        Some(Totals { sum, count })
    }

    #[test]
    fn a_vllm_page_gives_each_histograms_totals_over_its_series() {
        let t = parse_totals(Engine::Vllm, PAGE);
        assert_eq!(t.ttft, totals(1.0, 5.0), "both engines summed");
        assert_eq!(t.queue, totals(1.5, 5.0));
        assert_eq!(t.itl, totals(0.2, 20.0), "the current name wins");
        assert_eq!(parse_totals(Engine::Trtllm, PAGE), EngineTotals::default());
        assert_eq!(parse_totals(Engine::Sglang, PAGE), EngineTotals::default());
    }

    #[test]
    fn sglang_names_and_bad_lines() {
        let page = "sglang:time_to_first_token_seconds_sum{model_name=\"m\"} 2\n\
                    sglang:time_to_first_token_seconds_count{model_name=\"m\"} 4\n\
                    sglang:queue_time_seconds_sum{model_name=\"m\"} NaN\n\
                    sglang:queue_time_seconds_count{model_name=\"m\"} -3\n\
                    sglang:queue_time_seconds_sum{model_name=\"m\"\n\
                    sglang:time_per_output_token_seconds_sum 1\n\
                    sglang:time_per_output_token_seconds_count 10\n";
        let t = parse_totals(Engine::Sglang, page);
        assert_eq!(t.ttft, totals(2.0, 4.0));
        assert_eq!(t.queue, None, "nothing valid");
        assert_eq!(t.itl, totals(1.0, 10.0), "the older name when alone");
    }

    #[test]
    fn windows_are_the_mean_of_the_deltas_and_survive_resets_and_quiet_spells() {
        let t0 = Instant::now();
        let at = |s: u64| t0 + std::time::Duration::from_secs(s);
        let page = |ttft: Option<Totals>| EngineTotals {
            ttft,
            ..EngineTotals::default()
        };
        let mut w = EngineWindow::default();
        let first = w.advance(page(totals(100.0, 1000.0)), at(0));
        assert_eq!(first.ttft, None, "the first scrape is a baseline");
        assert_eq!(first.at, None);
        let l = w.advance(page(totals(103.0, 1010.0)), at(1));
        assert!((l.ttft.unwrap() - 0.3).abs() < 1e-9);
        assert_eq!(l.at, Some(at(1)));
        // A scrape within the minimum window leaves it open.
        let soon = at(1) + MIN_WINDOW / 2;
        assert_eq!(w.advance(page(totals(200.0, 1011.0)), soon), l);
        let l = w.advance(page(totals(200.0, 1011.0)), at(1) + MIN_WINDOW);
        assert!((l.ttft.unwrap() - 97.0).abs() < 1e-9, "{l:?}");
        // Nothing finished: the last window stands.
        let quiet = w.advance(page(totals(200.0, 1011.0)), at(2) + MIN_WINDOW);
        assert_eq!(quiet, l);
        // The engine restarted: its new totals are the window.
        let reset = w.advance(page(totals(1.0, 2.0)), at(4));
        assert!((reset.ttft.unwrap() - 0.5).abs() < 1e-9);
        // An absurd mean is bounded.
        let huge = w.advance(page(totals(1.0e12, 3.0)), at(6));
        assert_eq!(huge.ttft, Some(MAX_SECONDS));
        // The histogram leaves the page: the figure goes.
        assert_eq!(w.advance(page(None), at(8)).ttft, None);
    }
}
