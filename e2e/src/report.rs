//! The per-worker table the demo prints.

use crate::mock_worker::Counters;

/// One worker's row: its address, instance id and counters.
#[derive(Debug, Clone)]
pub struct WorkerRow {
    /// `ip:port`.
    pub address: String,
    /// Instance id.
    pub instance_id: u64,
    /// The worker's own counters.
    pub counters: Counters,
}

fn pct(x: f64) -> String {
    format!("{:.1}%", 100.0 * x)
}

/// A Markdown table: requests, prefix-cache hit rate (from the workers' own
/// counters) and share of traffic per worker, with a total row.
pub fn markdown_table(rows: &[WorkerRow]) -> String {
    let total_requests: u64 = rows.iter().map(|r| r.counters.requests).sum();
    let mut out = String::from(
        "| worker | instance id | requests | share of traffic | prefix-cache hit rate | cached / prompt tokens |\n\
         | --- | ---: | ---: | ---: | ---: | ---: |\n",
    );
    let share = |n: u64| {
        if total_requests == 0 {
            0.0
        } else {
            n as f64 / total_requests as f64
        }
    };
    let mut all = Counters::default();
    for r in rows {
        let c = &r.counters;
        out.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} / {} |\n",
            r.address,
            r.instance_id,
            c.requests,
            pct(share(c.requests)),
            pct(c.hit_rate()),
            c.prefix_cache_hits,
            c.prefix_cache_queries
        ));
        all.requests += c.requests;
        all.prefix_cache_hits += c.prefix_cache_hits;
        all.prefix_cache_queries += c.prefix_cache_queries;
    }
    out.push_str(&format!(
        "| **all** | | {} | {} | {} | {} / {} |\n",
        all.requests,
        pct(share(all.requests)),
        pct(all.hit_rate()),
        all.prefix_cache_hits,
        all.prefix_cache_queries
    ));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_shares_and_totals() {
        let row = |requests, hits, queries| WorkerRow {
            address: "127.0.0.1:1".into(),
            instance_id: 7,
            counters: Counters {
                requests,
                prefix_cache_hits: hits,
                prefix_cache_queries: queries,
                ..Counters::default()
            },
        };
        let t = markdown_table(&[row(3, 50, 100), row(1, 0, 0)]);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 5);
        assert_eq!(
            lines[2],
            "| 127.0.0.1:1 | 7 | 3 | 75.0% | 50.0% | 50 / 100 |"
        );
        assert_eq!(lines[3], "| 127.0.0.1:1 | 7 | 1 | 25.0% | 0.0% | 0 / 0 |");
        assert_eq!(lines[4], "| **all** | | 4 | 100.0% | 50.0% | 50 / 100 |");
    }
}
