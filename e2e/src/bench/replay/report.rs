//! What a replay reports: per-policy and per-request figures, one run's report
//! and the matrix of runs, as JSON and markdown.

use serde::Serialize;

use super::feed::{PredictionError, WARM_UP_COMPLETIONS};
use crate::bench::{markdown_table, ratio};

/// One policy's figures.
#[derive(Debug, Clone, Serialize)]
pub struct PolicyFigures {
    /// The policy's name.
    pub name: String,
    /// Prefix hit rate (blocks), 0..1.
    pub hit_rate: f64,
    /// `hit_rate` over the pooled finite-capacity ceiling.
    pub of_achievable: f64,
    /// Mean over arrivals of max/mean in-flight.
    pub spread: f64,
    /// What `spread` would be with the same requests in flight at each sample
    /// placed as evenly as whole requests allow ([`balanced_spread`]): no
    /// policy's spread can be lower.
    pub spread_floor: f64,
    /// Median modeled TTFT.
    pub ttft_p50_ms: f64,
    /// 99th percentile modeled TTFT.
    pub ttft_p99_ms: f64,
    /// How well its latency model predicted TTFT, when it learns one.
    pub prediction_error: Option<PredictionError>,
    /// Every request's modeled TTFT, sorted (for plots).
    #[serde(skip)]
    pub ttft_ms: Vec<f64>,
    /// Every request's figures, in trace order (`--dump-requests`).
    #[serde(skip)]
    pub requests: Vec<RequestFigures>,
}

/// What happened to one request.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct RequestFigures {
    /// The worker it was routed to.
    pub worker: usize,
    /// Its arrival, simulated ms from the start.
    pub arrival_ms: f64,
    /// Requests ahead of it on that worker at arrival (queued or in prefill).
    pub ahead: usize,
    /// Their prompt tokens (cached or not).
    pub ahead_tokens: usize,
    /// Requests routed to that worker and not finished, at arrival.
    pub in_flight: usize,
    /// Mean over the workers of requests routed and not finished, at arrival.
    pub pool_in_flight: f64,
    /// Its prompt tokens.
    pub input_tokens: usize,
    /// Its prompt blocks.
    pub blocks: usize,
    /// Leading prompt blocks found cached when its prefill started.
    pub hit_blocks: usize,
    /// Leading prompt blocks in its worker's pool when it arrived.
    pub arrival_hit_blocks: usize,
    /// The most leading prompt blocks any worker's pool held when it arrived:
    /// above `arrival_hit_blocks`, the placement gave up blocks on hand.
    pub best_arrival_hit_blocks: usize,
    /// Time from arrival to its admission by the engine (its prefill's start).
    pub wait_ms: f64,
    /// Time from admission to its first token (its prefill's steps).
    pub prefill_ms: f64,
}

impl RequestFigures {
    const CSV_HEADER: &'static str = "request,worker,arrival_ms,ahead,ahead_tokens,in_flight,\
        pool_in_flight,input_tokens,blocks,hit_blocks,arrival_hit_blocks,best_arrival_hit_blocks,\
        wait_ms,prefill_ms,ttft_ms";

    fn csv_row(&self, index: usize) -> String {
        format!(
            "{index},{},{:.3},{},{},{},{:.3},{},{},{},{},{},{:.3},{:.3},{:.3}",
            self.worker,
            self.arrival_ms,
            self.ahead,
            self.ahead_tokens,
            self.in_flight,
            self.pool_in_flight,
            self.input_tokens,
            self.blocks,
            self.hit_blocks,
            self.arrival_hit_blocks,
            self.best_arrival_hit_blocks,
            self.wait_ms,
            self.prefill_ms,
            self.wait_ms + self.prefill_ms
        )
    }
}

/// Writes each run's per-request figures into `dir`, one CSV per policy and run
/// (`POLICY-BLOCKS-SPEED.csv`).
pub fn write_requests(dir: &std::path::Path, runs: &[ReplayReport]) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    for r in runs {
        for p in &r.policies {
            let file = format!("{}-{}-{}.csv", p.name, r.capacity_blocks, r.speed);
            write_policy_requests(&dir.join(file), p)?;
        }
    }
    Ok(())
}

/// Writes one run's per-request figures to `path` as CSV.
pub fn write_policy_requests(path: &std::path::Path, p: &PolicyFigures) -> std::io::Result<()> {
    let mut csv = String::from(RequestFigures::CSV_HEADER);
    csv.push('\n');
    for (i, q) in p.requests.iter().enumerate() {
        csv.push_str(&q.csv_row(i));
        csv.push('\n');
    }
    std::fs::write(path, csv)
}

/// The replay report.
#[derive(Debug, Clone, Serialize)]
pub struct ReplayReport {
    /// The trace replayed.
    pub trace: String,
    /// Requests replayed.
    pub requests: usize,
    /// Simulated workers.
    pub workers: usize,
    /// Pool size per worker in blocks.
    pub capacity_blocks: usize,
    /// Tokens per block.
    pub block_tokens: usize,
    /// Each worker's speed (empty: all at 1).
    pub worker_speeds: Vec<f64>,
    /// Arrival-rate multiple.
    pub speed: f64,
    /// Hit rate of an infinite cache shared by all workers.
    pub ceiling_hit_rate: f64,
    /// Hit rate of one LRU cache of `workers × capacity_blocks` blocks.
    pub pooled_ceiling_hit_rate: f64,
    /// The trace on the fleet as one engine.
    pub one_engine: OneEngine,
    /// One entry per policy.
    pub policies: Vec<PolicyFigures>,
}

impl ReplayReport {
    /// The report as a Markdown table.
    pub fn markdown(&self) -> String {
        let mut rows: Vec<Vec<String>> = self
            .policies
            .iter()
            .map(|p| {
                vec![
                    p.name.clone(),
                    format!("{:.1}%", p.hit_rate * 100.0),
                    format!("{:.2}", p.of_achievable),
                    format!("{:.2}", p.spread),
                    format!("{:.2}", p.spread_floor),
                    format!("{:.0}", p.ttft_p50_ms),
                    format!("{:.0}", p.ttft_p99_ms),
                ]
            })
            .collect();
        rows.push(vec![
            format!(
                "ceiling (one pooled LRU cache of {} blocks)",
                self.workers * self.capacity_blocks
            ),
            format!("{:.1}%", self.pooled_ceiling_hit_rate * 100.0),
            "1.00".into(),
            "–".into(),
            "–".into(),
            "–".into(),
            "–".into(),
        ]);
        let mut one = vec![format!(
            "one engine with the fleet's KV and compute ({} blocks)",
            self.workers * self.capacity_blocks
        )];
        one.extend(self.one_engine.cells(self));
        rows.push(one);
        rows.push(vec![
            "ceiling (infinite shared cache)".into(),
            format!("{:.1}%", self.ceiling_hit_rate * 100.0),
            "–".into(),
            "–".into(),
            "–".into(),
            "–".into(),
            "–".into(),
        ]);
        format!(
            "{} requests at {}× speed, {} workers, {} blocks of {} tokens per worker\n\n{}",
            self.requests,
            self.speed,
            self.workers,
            self.capacity_blocks,
            self.block_tokens,
            markdown_table(
                &[
                    "policy",
                    "prefix hit rate",
                    "fraction of achievable",
                    "spread (max/mean in-flight)",
                    "spread floor (even placement)",
                    "TTFT p50 ms",
                    "TTFT p99 ms",
                ],
                &rows,
            )
        )
    }
}

/// The replays of several (capacity, speed) pairs, all policies in each.
#[derive(Debug, Clone, Serialize)]
pub struct MatrixReport {
    /// The trace replayed.
    pub trace: String,
    /// One report per (capacity, speed).
    pub runs: Vec<ReplayReport>,
}

/// Policies kvpick is held against in the criteria (when present in a run).
const PEERS: [&str; 2] = ["dynamo", "llm-d"];

impl MatrixReport {
    /// All runs in one table, then the routing criteria for each kvpick policy.
    pub fn markdown(&self) -> String {
        let mut rows = Vec::new();
        for r in &self.runs {
            for p in &r.policies {
                rows.push(vec![
                    r.capacity_blocks.to_string(),
                    format!("{}×", r.speed),
                    p.name.clone(),
                    format!("{:.1}%", p.hit_rate * 100.0),
                    format!("{:.2}", p.of_achievable),
                    format!("{:.2}", p.spread),
                    format!("{:.2}", p.spread_floor),
                    format!("{:.0}", p.ttft_p50_ms),
                    format!("{:.0}", p.ttft_p99_ms),
                    p.prediction_error
                        .map_or("–".into(), |e| format!("{:.3}", e.median)),
                ]);
            }
            rows.push(vec![
                r.capacity_blocks.to_string(),
                format!("{}×", r.speed),
                "ceiling: pooled LRU / infinite".into(),
                format!(
                    "{:.1}% / {:.1}%",
                    r.pooled_ceiling_hit_rate * 100.0,
                    r.ceiling_hit_rate * 100.0
                ),
                "1.00".into(),
                "–".into(),
                "–".into(),
                "–".into(),
                "–".into(),
                "–".into(),
            ]);
            let mut one = vec![
                r.capacity_blocks.to_string(),
                format!("{}×", r.speed),
                "one engine with the fleet's KV and compute".into(),
            ];
            one.extend(r.one_engine.cells(r));
            one.push("–".into());
            rows.push(one);
        }
        let head = self.runs.first().map_or(String::new(), |r| {
            format!(
                "{}: {} requests, {} workers{}, blocks of {} tokens; pred. error: median \
                 |predicted − actual| / actual TTFT of the decisions after the first {} first \
                 tokens\n\n",
                self.trace,
                r.requests,
                r.workers,
                match r.worker_speeds.is_empty() {
                    true => String::new(),
                    false => format!(" at speeds {:?}", r.worker_speeds),
                },
                r.block_tokens,
                WARM_UP_COMPLETIONS
            )
        });
        let mut out = head
            + &markdown_table(
                &[
                    "blocks per worker",
                    "speed",
                    "policy",
                    "prefix hit rate",
                    "fraction of achievable",
                    "spread",
                    "spread floor",
                    "TTFT p50 ms",
                    "TTFT p99 ms",
                    "pred. error",
                ],
                &rows,
            );
        out.push_str(&self.ratios());
        let mut crit = Vec::new();
        for r in &self.runs {
            for k in r.policies.iter().filter(|p| p.name.starts_with("kvpick")) {
                let others: Vec<&PolicyFigures> = r
                    .policies
                    .iter()
                    .filter(|p| !p.name.starts_with("kvpick"))
                    .collect();
                let peers: Vec<&&PolicyFigures> = others
                    .iter()
                    .filter(|p| PEERS.contains(&p.name.as_str()))
                    .collect();
                let mark = |ok: bool| if ok { "yes" } else { "**no**" }.to_string();
                crit.push(vec![
                    r.capacity_blocks.to_string(),
                    format!("{}×", r.speed),
                    k.name.clone(),
                    mark(k.of_achievable >= 0.85),
                    mark(peers.iter().all(|p| k.hit_rate > p.hit_rate)),
                    mark(
                        others
                            .iter()
                            .filter(|p| p.name == "round-robin" || PEERS.contains(&p.name.as_str()))
                            .all(|p| {
                                k.ttft_p50_ms <= p.ttft_p50_ms && k.ttft_p99_ms <= p.ttft_p99_ms
                            }),
                    ),
                    mark(k.spread <= 1.3),
                    match k.spread_floor <= 1.3 {
                        true => format!("yes ({:.2})", k.spread_floor),
                        false => format!("no ({:.2})", k.spread_floor),
                    },
                    match r.one_engine.of_pooled_ceiling(r) {
                        f if f >= 0.85 => format!("yes ({f:.2})"),
                        f => format!("no ({f:.2})"),
                    },
                ]);
            }
        }
        out.push_str("\nCriteria (peers: ");
        out.push_str(&PEERS.join(", "));
        out.push_str(", where present)\n\n");
        out.push_str(&markdown_table(
            &[
                "blocks per worker",
                "speed",
                "policy",
                "hit ≥ 0.85 of pooled ceiling",
                "hit above peers",
                "TTFT p50 and p99 ≤ round robin and peers",
                "spread ≤ 1.3",
                "1.3 reachable (spread floor)",
                "0.85 reached by one engine",
            ],
            &crit,
        ));
        out
    }
}

impl MatrixReport {
    /// Each kvpick policy's TTFT p50 and p99 over the least of that figure
    /// among the other policies of the same run, their geometric means over
    /// the runs, and the runs where a ratio is above 1.05.
    pub fn ratios(&self) -> String {
        let mut names: Vec<&str> = Vec::new();
        for r in &self.runs {
            for p in r.policies.iter().filter(|p| p.name.starts_with("kvpick")) {
                if !names.contains(&p.name.as_str()) {
                    names.push(&p.name);
                }
            }
        }
        let held: [fn(&PolicyFigures) -> f64; 2] = [|p| p.ttft_p50_ms, |p| p.ttft_p99_ms];
        let mut rows = Vec::new();
        let mut logs = vec![[0.0f64; 2]; names.len()];
        let mut over = vec![[0usize; 2]; names.len()];
        let mut counted = vec![0usize; names.len()];
        for r in &self.runs {
            let mut row = vec![r.capacity_blocks.to_string(), format!("{}×", r.speed)];
            for (i, name) in names.iter().enumerate() {
                let k = r.policies.iter().find(|p| p.name == *name);
                for (j, get) in held.iter().enumerate() {
                    let best = r
                        .policies
                        .iter()
                        .filter(|p| !p.name.starts_with("kvpick"))
                        .map(get)
                        .fold(f64::INFINITY, f64::min);
                    match k
                        .map(|k| get(k) / best)
                        .filter(|x| x.is_finite() && *x > 0.0)
                    {
                        Some(x) => {
                            logs[i][j] += x.ln();
                            over[i][j] += usize::from(x > 1.05);
                            counted[i] += usize::from(j == 0);
                            row.push(format!("{x:.2}"));
                        }
                        None => row.push("–".into()),
                    }
                }
            }
            rows.push(row);
        }
        let mut mean = vec!["**geometric mean**".to_string(), String::new()];
        let mut above = vec!["runs above 1.05×".to_string(), String::new()];
        for (i, _) in names.iter().enumerate() {
            for j in 0..2 {
                let n = counted[i].max(1) as f64;
                mean.push(format!("**{:.3}**", (logs[i][j] / n).exp()));
                above.push(format!("{} of {}", over[i][j], counted[i]));
            }
        }
        rows.push(mean);
        rows.push(above);
        let mut head = vec!["blocks per worker".to_string(), "speed".to_string()];
        for name in &names {
            head.push(format!("{name} TTFT p50"));
            head.push(format!("{name} TTFT p99"));
        }
        let head: Vec<&str> = head.iter().map(String::as_str).collect();
        format!(
            "\nRatios to the best other policy (the least TTFT p50, p99 among the policies \
             not named kvpick in the same run)\n\n{}",
            markdown_table(&head, &rows)
        )
    }
}

/// The trace on the fleet as one engine: its hit rate and TTFT.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct OneEngine {
    /// Prefix hit rate (blocks), 0..1.
    pub hit_rate: f64,
    /// Median modeled TTFT.
    pub ttft_p50_ms: f64,
    /// 99th percentile modeled TTFT.
    pub ttft_p99_ms: f64,
}

impl OneEngine {
    /// Its hit rate over `report`'s pooled ceiling (0 when that is 0).
    pub fn of_pooled_ceiling(&self, report: &ReplayReport) -> f64 {
        ratio(self.hit_rate, report.pooled_ceiling_hit_rate)
    }

    /// Its cells in a table of policies: hit rate, fraction of the pooled
    /// ceiling, no spreads, TTFT p50 and p99.
    pub(super) fn cells(&self, report: &ReplayReport) -> [String; 6] {
        [
            format!("{:.1}%", self.hit_rate * 100.0),
            format!("{:.2}", self.of_pooled_ceiling(report)),
            "–".into(),
            "–".into(),
            format!("{:.0}", self.ttft_p50_ms),
            format!("{:.0}", self.ttft_p99_ms),
        ]
    }
}
