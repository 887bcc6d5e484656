//! `kvpick-bench replay --replicas R`: kvpick's approximate scheduler run as R
//! replicas over the same simulated fleet ([`super::replay`]), with and without
//! replica sync, in one run.
//!
//! - Requests are spread over the replicas in turn (request `i` to replica
//!   `i mod R`), as Envoy's default round-robin spreads new ext_proc streams
//!   over the EPP pods; each request's prefill-done and finish go to the
//!   replica that routed it, as they travel on its stream.
//! - Each replica is the real [`Scheduler`] over its own [`EndpointTable`]
//!   (the [`Kvpick`] policy of the replay). With sync its deltas go to a
//!   [`ReplicaSink`] as in production; after every callback each replica's
//!   deltas are encoded as one batch by the real wire codec
//!   ([`kvpick::replica_sync::codec`]) and reach every peer `delay` later,
//!   where they are decoded and applied with [`Scheduler::apply_peer`] and a
//!   [`PeerLoads`] table, as the sync's subscriber does. Every
//!   [`REPORT_EVERY`] each replica also sends its own bookings
//!   ([`Delta::Loads`]), as the sync's reporter does.
//! - A replica sees its own decisions at once: its scheduler books and
//!   records them before the next pick.
//! - Every replica has the run's tie-break seed and continues one sequence of
//!   draws: the fleet's k-th pick draws what one replica's k-th pick draws
//!   (common random numbers), so R replicas differ from one only by what each
//!   knows when it picks. With every delta applied before the next pick (a
//!   delay of 0) they route exactly as one replica.
//!
//! Deliveries due between two callbacks are applied at the start of the next
//! one, at their own due instants: nothing reads a replica's state in between.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use kvpick::replica::{Delta, PeerLoads, ReplicaId, ReplicaSink};
use kvpick::replica_sync::codec;
use serde::Serialize;

use super::markdown_table;
use super::replay::{simulate, Kvpick, PolicyFigures, ReplayConfig, RoutingPolicy, WorkerView};
use super::trace::{TraceRequest, BLOCK_TOKENS};

/// How often a replica reports its own bookings (the sync's default).
pub const REPORT_EVERY: Duration = Duration::from_millis(500);

/// A replica's deltas, held until the simulator publishes them.
#[derive(Debug, Default)]
struct Outbox(parking_lot::Mutex<Vec<Delta>>);

impl ReplicaSink for Outbox {
    fn push(&self, delta: Delta) {
        self.0.lock().push(delta);
    }
}

struct Replica {
    id: ReplicaId,
    kvpick: Kvpick,
    outbox: Arc<Outbox>,
    peers: PeerLoads,
}

/// A published batch on its way to the peers.
struct InTransit {
    from: usize,
    bytes: Vec<u8>,
}

/// R kvpick-approx replicas, synced after `delay` or not at all.
pub struct Replicated {
    replicas: Vec<Replica>,
    delay_us: Option<u64>,
    in_transit: BinaryHeap<Reverse<(u64, u64, usize)>>,
    batches: HashMap<usize, InTransit>,
    seq: u64,
    /// Request → the replica that routed it.
    owner: HashMap<usize, usize>,
    /// Tie-breaks the replicas drew so far, all together: each pick continues
    /// the one sequence (see [`kvpick::scheduler::Scheduler::set_tie_break_draws`]).
    tie_breaks: u64,
    next_report_us: u64,
    /// Deltas and wire bytes published, and decisions made.
    published: (u64, u64),
    decisions: u64,
}

impl Replicated {
    /// `replicas` replicas over `cfg`'s fleet; synced with propagation delay
    /// `sync` when given.
    pub fn new(cfg: &ReplayConfig, replicas: usize, sync: Option<Duration>) -> Self {
        let replicas = (0..replicas.max(1))
            .map(|i| {
                let kvpick = Kvpick::new(cfg, false);
                let outbox = Arc::new(Outbox::default());
                if sync.is_some() {
                    kvpick.scheduler().set_replica_sink(outbox.clone());
                }
                Replica {
                    id: i as ReplicaId + 1,
                    kvpick,
                    outbox,
                    // The sync's lease and peer bound; nothing expires here
                    // (every delta is delivered, reports keep leases fresh).
                    peers: PeerLoads::new(Duration::from_secs(5), 1_024),
                }
            })
            .collect();
        Replicated {
            replicas,
            delay_us: sync.map(|d| d.as_micros() as u64),
            in_transit: BinaryHeap::new(),
            batches: HashMap::new(),
            seq: 0,
            owner: HashMap::new(),
            tie_breaks: 0,
            next_report_us: REPORT_EVERY.as_micros() as u64,
            published: (0, 0),
            decisions: 0,
        }
    }

    /// Applies every batch due by `now_us`, in order, each at its due instant.
    fn deliver(&mut self, now_us: u64) {
        while let Some(&Reverse((at, seq, _))) = self.in_transit.peek() {
            if at > now_us {
                break;
            }
            self.in_transit.pop();
            let batch = self.batches.remove(&(seq as usize)).expect("queued batch");
            let decoded = codec::decode(&batch.bytes).expect("own encoding decodes");
            for (j, r) in self.replicas.iter().enumerate() {
                if j == batch.from {
                    continue;
                }
                let now = r.kvpick.at(at);
                let snapshot = r.kvpick.snapshot();
                for d in &decoded.deltas {
                    r.kvpick.scheduler().apply_peer(
                        decoded.from,
                        d.clone(),
                        &r.peers,
                        snapshot,
                        true,
                        now,
                    );
                }
            }
        }
    }

    /// Publishes each replica's pending deltas (and its report when due) as
    /// one batch, due at the peers `delay` after `now_us`.
    fn publish(&mut self, now_us: u64) {
        let Some(delay) = self.delay_us else {
            return;
        };
        let report = now_us >= self.next_report_us;
        if report {
            self.next_report_us = now_us + REPORT_EVERY.as_micros() as u64;
        }
        for (i, r) in self.replicas.iter().enumerate() {
            if report {
                let own = r.peers.own(r.kvpick.snapshot());
                r.outbox.push(Delta::Loads(own));
            }
            let deltas = std::mem::take(&mut *r.outbox.0.lock());
            if deltas.is_empty() {
                continue;
            }
            let bytes = codec::encode(r.id, now_us, &deltas);
            self.published.0 += deltas.len() as u64;
            self.published.1 += bytes.len() as u64;
            self.seq += 1;
            self.in_transit
                .push(Reverse((now_us + delay, self.seq, self.seq as usize)));
            self.batches
                .insert(self.seq as usize, InTransit { from: i, bytes });
        }
    }

    /// Wire bytes published per decision so far.
    pub fn bytes_per_decision(&self) -> f64 {
        self.published.1 as f64 / self.decisions.max(1) as f64
    }
}

impl RoutingPolicy for Replicated {
    fn name(&self) -> String {
        let r = self.replicas.len();
        match (r, self.delay_us) {
            (1, _) => "kvpick-approx".into(),
            (_, Some(_)) => format!("kvpick-approx ×{r} synced"),
            (_, None) => format!("kvpick-approx ×{r} unsynced"),
        }
    }

    fn route(
        &mut self,
        id: usize,
        request: &TraceRequest,
        workers: &[WorkerView],
        now_us: u64,
    ) -> usize {
        self.deliver(now_us);
        let i = id % self.replicas.len();
        self.owner.insert(id, i);
        self.decisions += 1;
        let r = &mut self.replicas[i].kvpick;
        r.scheduler().set_tie_break_draws(self.tie_breaks);
        let w = r.route(id, request, workers, now_us);
        self.tie_breaks = r.scheduler().tie_break_draws();
        self.publish(now_us);
        w
    }

    fn prefill_done(&mut self, id: usize, now_us: u64) {
        self.deliver(now_us);
        if let Some(&i) = self.owner.get(&id) {
            self.replicas[i].kvpick.prefill_done(id, now_us);
        }
        self.publish(now_us);
    }

    fn finished(&mut self, id: usize, now_us: u64) {
        self.deliver(now_us);
        if let Some(i) = self.owner.remove(&id) {
            self.replicas[i].kvpick.finished(id, now_us);
        }
        self.publish(now_us);
    }
}

/// Replica settings of a replay.
#[derive(Debug, Clone)]
pub struct ReplicaConfig {
    /// Replica counts (1 is the baseline, always run).
    pub replicas: Vec<usize>,
    /// Propagation delay of a synced delta.
    pub delay: Duration,
    /// Tie-break seeds: each runs the whole cell, and a figure is the mean
    /// over them (a ratio: of each seed's ratio to one replica of that seed).
    pub seeds: Vec<u64>,
    /// Where to write every run's per-request figures
    /// (`POLICY-BLOCKS-SPEED-sSEED.csv`), if anywhere.
    pub dump_requests: Option<std::path::PathBuf>,
}

/// One policy's figures beside the one-replica baseline, means over the seeds.
#[derive(Debug, Clone, Serialize)]
pub struct ReplicaFigures {
    /// Replicas.
    pub replicas: usize,
    /// Whether they were synced.
    pub synced: bool,
    /// Prefix hit rate, 0..1.
    pub hit_rate: f64,
    /// TTFT p50, ms.
    pub ttft_p50_ms: f64,
    /// TTFT p99, ms.
    pub ttft_p99_ms: f64,
    /// `hit_rate` over one replica's (mean of each seed's ratio).
    pub hit_ratio: f64,
    /// `ttft_p50_ms` over one replica's (mean of each seed's ratio).
    pub p50_ratio: f64,
    /// `ttft_p99_ms` over one replica's (mean of each seed's ratio).
    pub p99_ratio: f64,
    /// Largest over smallest TTFT p50 and p99 of the seeds' runs: how far the
    /// figure moves with the tie-breaks alone.
    pub seed_spread: (f64, f64),
    /// Each seed's (hit, p50, p99) ratios, in the order of the seeds.
    pub per_seed: Vec<(f64, f64, f64)>,
    /// Wire bytes published per decision (0 unsynced).
    pub bytes_per_decision: f64,
}

/// One (trace, capacity, speed) cell.
#[derive(Debug, Clone, Serialize)]
pub struct ReplicaCell {
    /// The trace.
    pub trace: String,
    /// Pool size per worker in blocks.
    pub capacity_blocks: usize,
    /// Arrival-rate multiple.
    pub speed: f64,
    /// One replica first, then each count synced and unsynced.
    pub figures: Vec<ReplicaFigures>,
}

/// The replica matrix.
#[derive(Debug, Clone, Serialize)]
pub struct ReplicaReport {
    /// Simulated workers.
    pub workers: usize,
    /// Propagation delay of synced deltas, ms.
    pub delay_ms: f64,
    /// The tie-break seeds every cell ran.
    pub seeds: Vec<u64>,
    /// The cells.
    pub cells: Vec<ReplicaCell>,
}

/// The targets for synced replicas: hit rate ≥ 0.98× and TTFT p50 and
/// p99 ≤ 1.05× one replica's.
pub fn meets_target(f: &ReplicaFigures) -> bool {
    f.hit_ratio >= 0.98 && f.p50_ratio <= 1.05 && f.p99_ratio <= 1.05
}

/// Runs one cell: for each seed, one replica, then each count of `rc` synced
/// and unsynced; figures are means over the seeds.
pub fn cell(
    trace_name: &str,
    trace: &[TraceRequest],
    cfg: &ReplayConfig,
    rc: &ReplicaConfig,
) -> ReplicaCell {
    let run = |cfg: &ReplayConfig, replicas: usize, sync: Option<Duration>| {
        let mut p = Replicated::new(cfg, replicas, sync);
        let started = std::time::Instant::now();
        let f = simulate(&mut p, trace, cfg);
        if let Some(dir) = &rc.dump_requests {
            let name = f.name.replace(" ×", "-x").replace(' ', "-");
            let file = format!(
                "{name}-{}-{}-s{}.csv",
                cfg.capacity_blocks, cfg.speed, cfg.seed
            );
            if let Err(e) = std::fs::create_dir_all(dir)
                .and_then(|()| crate::bench::replay::write_policy_requests(&dir.join(&file), &f))
            {
                eprintln!("replay: {file} not written: {e}");
            }
        }
        eprintln!(
            "replay: {} on {trace_name} at {} blocks, {}×, seed {} done in {:.1} s (hit rate {:.3})",
            f.name,
            cfg.capacity_blocks,
            cfg.speed,
            cfg.seed,
            started.elapsed().as_secs_f64(),
            f.hit_rate
        );
        (f, p.bytes_per_decision())
    };
    // The runs of the cell: one replica, then each count synced and unsynced.
    let mut kinds = vec![(1, None)];
    for &r in rc.replicas.iter().filter(|&&r| r > 1) {
        kinds.push((r, Some(rc.delay)));
        kinds.push((r, None));
    }
    let seeds: &[u64] = match rc.seeds.is_empty() {
        true => std::slice::from_ref(&cfg.seed),
        false => &rc.seeds,
    };
    // runs[kind][seed]
    let mut runs: Vec<Vec<(PolicyFigures, f64)>> = vec![Vec::new(); kinds.len()];
    for &seed in seeds {
        let cfg = ReplayConfig {
            seed,
            ..cfg.clone()
        };
        for (k, &(replicas, sync)) in kinds.iter().enumerate() {
            runs[k].push(run(&cfg, replicas, sync));
        }
    }
    let one = &runs[0];
    let figures = kinds
        .iter()
        .zip(&runs)
        .map(|(&(replicas, sync), runs)| {
            let per_seed: Vec<(f64, f64, f64)> = runs
                .iter()
                .zip(one)
                .map(|((f, _), (o, _))| {
                    (
                        relative(f.hit_rate, o.hit_rate),
                        relative(f.ttft_p50_ms, o.ttft_p50_ms),
                        relative(f.ttft_p99_ms, o.ttft_p99_ms),
                    )
                })
                .collect();
            ReplicaFigures {
                replicas,
                synced: sync.is_some(),
                hit_rate: mean(runs.iter().map(|(f, _)| f.hit_rate)),
                ttft_p50_ms: mean(runs.iter().map(|(f, _)| f.ttft_p50_ms)),
                ttft_p99_ms: mean(runs.iter().map(|(f, _)| f.ttft_p99_ms)),
                hit_ratio: mean(per_seed.iter().map(|r| r.0)),
                p50_ratio: mean(per_seed.iter().map(|r| r.1)),
                p99_ratio: mean(per_seed.iter().map(|r| r.2)),
                seed_spread: (
                    spread(runs.iter().map(|(f, _)| f.ttft_p50_ms)),
                    spread(runs.iter().map(|(f, _)| f.ttft_p99_ms)),
                ),
                per_seed,
                bytes_per_decision: mean(runs.iter().map(|(_, b)| *b)),
            }
        })
        .collect();
    ReplicaCell {
        trace: trace_name.to_string(),
        capacity_blocks: cfg.capacity_blocks,
        speed: cfg.speed,
        figures,
    }
}

fn mean(xs: impl Iterator<Item = f64>) -> f64 {
    let (sum, n) = xs.fold((0.0, 0usize), |(s, n), x| (s + x, n + 1));
    sum / n.max(1) as f64
}

/// Largest over smallest (1 for a single value).
fn spread(xs: impl Iterator<Item = f64> + Clone) -> f64 {
    let max = xs.clone().fold(f64::NEG_INFINITY, f64::max);
    let min = xs.fold(f64::INFINITY, f64::min);
    relative(max, min)
}

/// `a / b` where `0 / 0` is 1 (the same) and `a / 0` infinite.
fn relative(a: f64, b: f64) -> f64 {
    if b == 0.0 {
        if a == 0.0 {
            1.0
        } else {
            f64::INFINITY
        }
    } else {
        a / b
    }
}

impl ReplicaReport {
    /// Every cell's rows, the ratios to one replica and the target check.
    pub fn markdown(&self) -> String {
        let mut rows = Vec::new();
        for c in &self.cells {
            for f in &c.figures {
                let sync = match (f.replicas, f.synced) {
                    (1, _) => "–",
                    (_, true) => "on",
                    (_, false) => "off",
                };
                let target = match (f.replicas, f.synced) {
                    (1, _) => "–".to_string(),
                    (_, true) if meets_target(f) => "yes".into(),
                    (_, true) => "**no**".into(),
                    (_, false) if meets_target(f) => "(met)".into(),
                    (_, false) => "(missed)".into(),
                };
                rows.push(vec![
                    c.trace.clone(),
                    c.capacity_blocks.to_string(),
                    format!("{}×", c.speed),
                    f.replicas.to_string(),
                    sync.into(),
                    format!("{:.1}%", f.hit_rate * 100.0),
                    format!("{:.3}", f.hit_ratio),
                    format!("{:.0}", f.ttft_p50_ms),
                    format!("{:.3}", f.p50_ratio),
                    format!("{:.0}", f.ttft_p99_ms),
                    format!("{:.3}", f.p99_ratio),
                    format!("{:.2} / {:.2}", f.seed_spread.0, f.seed_spread.1),
                    format!("{:.0}", f.bytes_per_decision),
                    target,
                ]);
            }
        }
        format!(
            "{} workers, blocks of {} tokens; requests to replicas in turn; synced deltas reach \
             peers after {} ms; tie-break seeds {:?} (figures: means over them; ratios: mean of \
             each seed's ratio to one replica of that seed; seed spread: largest over smallest \
             TTFT p50 / p99 of the seeds' runs); target (sync on): hit ≥ 0.98×, TTFT p50 and \
             p99 ≤ 1.05×\n\n{}",
            self.workers,
            BLOCK_TOKENS,
            self.delay_ms,
            self.seeds,
            markdown_table(
                &[
                    "trace",
                    "blocks per worker",
                    "speed",
                    "replicas",
                    "sync",
                    "hit rate",
                    "× one",
                    "TTFT p50 ms",
                    "× one",
                    "TTFT p99 ms",
                    "× one",
                    "seed spread p50 / p99",
                    "bytes per decision",
                    "target",
                ],
                &rows,
            )
        )
    }
}

#[cfg(test)]
mod tests {
    use super::super::trace;
    use super::*;

    /// Conversations re-sent with a growing tail, so each turn's best worker is
    /// the previous turn's: spread over replicas without sync, turns lose it.
    /// Five conversations, so that request `i`'s replica `i mod R` changes
    /// from one turn of a conversation to the next.
    fn conversations() -> Vec<TraceRequest> {
        crate::bench::replay::fixtures::conversations(5, 12, 6, true, 1_500)
    }

    fn cfg() -> ReplayConfig {
        crate::bench::replay::fixtures::config(4, 64)
    }

    #[test]
    fn one_replica_is_the_replays_kvpick_approx() {
        let t = conversations();
        let one = simulate(&mut Replicated::new(&cfg(), 1, None), &t, &cfg());
        let plain = simulate(&mut Kvpick::new(&cfg(), false), &t, &cfg());
        assert_eq!(one.ttft_ms, plain.ttft_ms);
        assert_eq!(one.hit_rate, plain.hit_rate);
    }

    #[test]
    fn synced_replicas_route_as_one_and_unsynced_lose_hits() {
        let t = conversations();
        let c = cell(
            "t",
            &t,
            &cfg(),
            &ReplicaConfig {
                replicas: vec![2, 4],
                delay: Duration::from_millis(1),
                seeds: vec![1, 2],
                dump_requests: None,
            },
        );
        assert_eq!(c.figures.len(), 5);
        for f in &c.figures[1..] {
            match f.synced {
                true => {
                    assert!(meets_target(f), "{f:?}");
                    assert!(f.bytes_per_decision > 0.0);
                }
                false => assert!(f.hit_ratio < 0.95 && f.p50_ratio > 1.2, "{f:?}"),
            }
        }
        for f in &c.figures {
            assert_eq!(f.per_seed.len(), 2);
            let mean_p50 = (f.per_seed[0].1 + f.per_seed[1].1) / 2.0;
            assert!((f.p50_ratio - mean_p50).abs() < 1e-12, "{f:?}");
        }
        let md = ReplicaReport {
            workers: 4,
            delay_ms: 1.0,
            seeds: vec![1, 2],
            cells: vec![c],
        }
        .markdown();
        assert!(md.contains("| t | 64 | 1× | 4 | on |"), "{md}");
    }

    /// With every delta applied before the next pick and one tie-break
    /// sequence, R synced replicas hold what one replica holds at every pick
    /// (index entries under capacity pressure, bookings, in-flight counts) and
    /// so route every request as it does.
    #[test]
    fn synced_replicas_without_delay_route_exactly_as_one() {
        // 24 blocks per worker: conversations of up to 18 blocks evict each other.
        let cfg = crate::bench::replay::fixtures::config(4, 24);
        let t = conversations();
        let one = simulate(&mut Replicated::new(&cfg, 1, None), &t, &cfg);
        for r in [2, 3, 4] {
            let synced = simulate(
                &mut Replicated::new(&cfg, r, Some(Duration::ZERO)),
                &t,
                &cfg,
            );
            assert_eq!(synced.ttft_ms, one.ttft_ms, "{r} replicas");
            assert_eq!(synced.hit_rate, one.hit_rate, "{r} replicas");
        }
    }

    /// Under capacity pressure (evictions on every worker), with deltas that
    /// arrive before the next decision (1 ms) or cross in flight (4 s): once
    /// every delta has arrived, every replica's index answers the same for
    /// every prompt of the run.
    #[test]
    fn indexes_converge_once_every_delta_arrived() {
        for delay in [Duration::from_millis(1), Duration::from_secs(4)] {
            indexes_converge_with(delay);
        }
    }

    fn indexes_converge_with(delay: Duration) {
        let cfg = crate::bench::replay::fixtures::config(4, 24);
        let t = conversations();
        let mut p = Replicated::new(&cfg, 3, Some(delay));
        simulate(&mut p, &t, &cfg);
        p.deliver(u64::MAX);
        let end_us = t.last().expect("a request").timestamp + 10_000_000;
        let answers = |r: &Replica| -> Vec<Vec<usize>> {
            let k = &r.kvpick;
            let keys: Vec<_> = k.snapshot().endpoints.iter().map(|e| e.key(0)).collect();
            t.iter()
                .map(|q| {
                    let h = k
                        .scheduler()
                        .block_hashes(&trace::body(q, cfg.block_tokens));
                    k.scheduler().index().lookup(&h, &keys, k.at(end_us))
                })
                .collect()
        };
        let first = answers(&p.replicas[0]);
        assert!(first.iter().flatten().any(|&n| n > 0), "{first:?}");
        for r in &p.replicas[1..] {
            assert_eq!(answers(r), first, "{delay:?}");
        }
    }

    /// A delay longer than the gap between turns (7.5 s): a follow-up routed
    /// before its previous turn's prompt reached its replica cannot use it.
    #[test]
    fn a_long_propagation_delay_costs_hits() {
        let t = conversations();
        let hit =
            |delay| simulate(&mut Replicated::new(&cfg(), 2, Some(delay)), &t, &cfg()).hit_rate;
        let (slow, fast) = (hit(Duration::from_secs(10)), hit(Duration::from_millis(1)));
        assert!(slow < fast - 0.05, "{slow} vs {fast}");
    }

    /// Bookings travel too: after the replay every replica's load is zero and
    /// every peer table empty of bookings.
    #[test]
    fn bookings_and_releases_cancel_out_on_every_replica() {
        let t = conversations();
        let mut p = Replicated::new(&cfg(), 3, Some(Duration::from_millis(1)));
        simulate(&mut p, &t, &cfg());
        p.deliver(u64::MAX);
        for r in &p.replicas {
            for e in &r.kvpick.snapshot().endpoints {
                assert_eq!(e.in_flight(0), 0);
                assert_eq!(e.active_load(0), Default::default());
            }
            assert!(r.peers.own(r.kvpick.snapshot()).is_empty());
        }
    }
}
