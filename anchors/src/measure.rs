//! Small measuring helpers shared by the subcommands.

use std::time::Duration;

/// Resident set size of this process in bytes (Linux `/proc/self/statm`).
pub fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    pages * 4096
}

/// CPU time all threads of this process have run, in nanoseconds (the first
/// field of each `/proc/self/task/*/schedstat`). On a machine shared with other
/// jobs, an index applying events on 2 threads gets a bigger share of the cores
/// than one applying them on 1; blocks per CPU-second is what the index costs,
/// whatever share it got.
pub fn process_cpu_ns() -> u64 {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    tasks
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum()
}

/// The calling thread's scheduler counters (`/proc/thread-self/schedstat`): CPU
/// time run, time spent runnable but waiting for a core (updated when the thread
/// is switched in, so a reader sees every wait before its read), times switched in.
#[derive(Debug, Clone, Copy, Default)]
pub struct SchedStat {
    pub cpu_ns: u64,
    pub run_delay_ns: u64,
    pub slices: u64,
}

impl SchedStat {
    /// The calling thread's counters now (zeros where unreadable).
    pub fn now() -> Self {
        let text = std::fs::read_to_string("/proc/thread-self/schedstat").unwrap_or_default();
        let mut f = text.split_whitespace().map(|x| x.parse().unwrap_or(0));
        SchedStat {
            cpu_ns: f.next().unwrap_or(0),
            run_delay_ns: f.next().unwrap_or(0),
            slices: f.next().unwrap_or(0),
        }
    }

    /// Counters accrued since `earlier`.
    pub fn since(self, earlier: SchedStat) -> SchedStat {
        SchedStat {
            cpu_ns: self.cpu_ns.saturating_sub(earlier.cpu_ns),
            run_delay_ns: self.run_delay_ns.saturating_sub(earlier.run_delay_ns),
            slices: self.slices.saturating_sub(earlier.slices),
        }
    }
}

/// The `q` quantile (0..=1) of `samples` in microseconds (sorts them).
pub fn quantile_us(samples: &mut [Duration], q: f64) -> f64 {
    if samples.is_empty() {
        return 0.0;
    }
    samples.sort_unstable();
    let i = ((samples.len() - 1) as f64 * q).round() as usize;
    samples[i].as_secs_f64() * 1e6
}

/// SplitMix64: a tiny deterministic generator and mixer for workloads.
#[derive(Debug, Clone)]
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    /// The next pseudo-random value.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        mix(self.0)
    }

    /// A value in `0..n`.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
}

/// SplitMix64's finalizer.
pub fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}
