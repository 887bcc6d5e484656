//! SVG plots of the benchmark reports (plotters' SVG backend: no fonts, no C deps).

use std::path::Path;

use plotters::prelude::*;

use super::overhead::{OverheadReport, Tracing};
use super::replay::ReplayReport;

const SIZE: (u32, u32) = (900, 500);
const PALETTE: [RGBColor; 5] = [
    RGBColor(0x4c, 0x72, 0xb0),
    RGBColor(0xdd, 0x84, 0x52),
    RGBColor(0x55, 0xa8, 0x68),
    RGBColor(0xc4, 0x4e, 0x52),
    RGBColor(0x81, 0x72, 0xb3),
];

fn human_bytes(b: usize) -> String {
    if b >= 1024 {
        format!("{}K", (b as f64 / 1024.0).round())
    } else {
        b.to_string()
    }
}

/// The label of the category drawn at whole-number `x` (none between them).
fn category_label(labels: &[String], x: f64) -> String {
    let i = x.round();
    if (x - i).abs() < 1e-6 && i >= 0.0 {
        labels.get(i as usize).cloned().unwrap_or_default()
    } else {
        String::new()
    }
}

/// Decision latency p50/p99 of kvpick and the no-op server per cell.
pub fn overhead(report: &OverheadReport, path: &Path) -> anyhow::Result<()> {
    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE)?;
    let n = report.runs.len().max(1);
    let ymax = report
        .runs
        .iter()
        .map(|r| r.kvpick.p99_us.max(r.noop.p99_us))
        .fold(10.0, f64::max)
        * 2.0;
    let ymin = report
        .runs
        .iter()
        .map(|r| r.kvpick.p50_us.min(r.noop.p50_us))
        .fold(f64::MAX, f64::min)
        .clamp(1.0, ymax / 10.0)
        / 2.0;
    let labels: Vec<String> = report
        .runs
        .iter()
        .map(|r| match r.tracing {
            Tracing::Off => format!("{}B/{}ep", human_bytes(r.body_bytes), r.endpoints),
            t => format!(
                "{}B/{}ep/trace {}",
                human_bytes(r.body_bytes),
                r.endpoints,
                t.as_str()
            ),
        })
        .collect();
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "ext_proc decision latency: kvpick vs no-op",
            ("sans-serif", 22),
        )
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(70)
        .build_cartesian_2d(-0.5f64..(n as f64 - 0.5), (ymin..ymax).log_scale())?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(n)
        .x_label_formatter(&|x| category_label(&labels, *x))
        .x_desc("body size / endpoints")
        .y_desc("µs, log scale (last body chunk → headers answer)")
        .draw()?;
    type Pick = fn(&super::overhead::OverheadRun) -> f64;
    let series: [(&str, Pick, RGBColor); 4] = [
        ("kvpick p99", |r| r.kvpick.p99_us, PALETTE[3]),
        ("kvpick p50", |r| r.kvpick.p50_us, PALETTE[1]),
        ("no-op p99", |r| r.noop.p99_us, PALETTE[0]),
        ("no-op p50", |r| r.noop.p50_us, PALETTE[2]),
    ];
    for (name, value, color) in series {
        let points: Vec<(f64, f64)> = report
            .runs
            .iter()
            .enumerate()
            .map(|(i, r)| (i as f64, value(r)))
            .collect();
        chart
            .draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))?
            .label(name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
        chart.draw_series(
            points
                .into_iter()
                .map(move |p| Circle::new(p, 4, color.filled())),
        )?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}

/// Prefix hit rate per policy next to the ceiling.
pub fn replay_hit_rate(report: &ReplayReport, path: &Path) -> anyhow::Result<()> {
    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE)?;
    let mut names: Vec<String> = report.policies.iter().map(|p| p.name.clone()).collect();
    names.push("pooled ceiling".into());
    names.push("infinite ceiling".into());
    let mut values: Vec<f64> = report.policies.iter().map(|p| p.hit_rate * 100.0).collect();
    values.push(report.pooled_ceiling_hit_rate * 100.0);
    values.push(report.ceiling_hit_rate * 100.0);
    let n = names.len();
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!(
                "Prefix hit rate, {} workers × {} blocks ({} requests)",
                report.workers, report.capacity_blocks, report.requests
            ),
            ("sans-serif", 22),
        )
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(60)
        .build_cartesian_2d(-0.5f64..(n as f64 - 0.5), 0f64..100f64)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(n)
        .x_label_formatter(&|x| category_label(&names, *x))
        .y_desc("% of prompt blocks served from cache")
        .draw()?;
    chart.draw_series(values.iter().enumerate().map(|(i, v)| {
        let color = if i + 1 == n {
            RGBColor(0x99, 0x99, 0x99)
        } else {
            PALETTE[i % PALETTE.len()]
        };
        Rectangle::new(
            [(i as f64 - 0.35, 0.0), (i as f64 + 0.35, *v)],
            color.filled(),
        )
    }))?;
    chart.draw_series(values.iter().enumerate().map(|(i, v)| {
        Text::new(
            format!("{v:.1}%"),
            (i as f64 - 0.15, v + 3.0),
            ("sans-serif", 16),
        )
    }))?;
    root.present()?;
    Ok(())
}

/// Cumulative distribution of modeled TTFT per policy (log time axis).
pub fn replay_ttft(report: &ReplayReport, path: &Path) -> anyhow::Result<()> {
    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE)?;
    let xmax = report
        .policies
        .iter()
        .filter_map(|p| p.ttft_ms.last().copied())
        .fold(10.0, f64::max)
        * 1.2;
    let xmin = report
        .policies
        .iter()
        .filter_map(|p| p.ttft_ms.first().copied())
        .fold(f64::MAX, f64::min)
        .clamp(1.0, xmax / 10.0);
    let mut chart = ChartBuilder::on(&root)
        .caption("Modeled TTFT, cumulative", ("sans-serif", 22))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(60)
        .build_cartesian_2d((xmin..xmax).log_scale(), 0f64..1f64)?;
    chart
        .configure_mesh()
        .x_desc("TTFT (ms, log scale)")
        .y_desc("fraction of requests")
        .draw()?;
    for (i, p) in report.policies.iter().enumerate() {
        let color = PALETTE[i % PALETTE.len()];
        let n = p.ttft_ms.len().max(1) as f64;
        let points: Vec<(f64, f64)> = p
            .ttft_ms
            .iter()
            .enumerate()
            .map(|(k, t)| (t.max(xmin), (k + 1) as f64 / n))
            .collect();
        chart
            .draw_series(LineSeries::new(points, color.stroke_width(2)))?
            .label(p.name.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::overhead::{OverheadRun, ServerFigures};
    use crate::bench::replay::{OneEngine, PolicyFigures};

    #[test]
    fn plots_render_labelled_svg() {
        let dir = std::env::temp_dir().join(format!("kvpick-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let fig = |p50_us, p99_us| ServerFigures {
            p50_us,
            p99_us,
            rps: 1.0,
            peak_rss_mib: 20.0,
            cpu_us_per_request: 50.0,
        };
        let overhead_report = OverheadReport {
            runs: vec![OverheadRun {
                body_bytes: 1024,
                endpoints: 8,
                tracing: Tracing::Off,
                spans_exported: 0,
                kvpick: fig(150.0, 400.0),
                noop: fig(100.0, 300.0),
                p99_ratio: 4.0 / 3.0,
                throughput_ratio: 1.0,
                cpu_ratio: 1.0,
                peer: None,
                peer_cpu_ratio: None,
                idle: None,
            }],
        };
        let policy = |name: &str, hit_rate| PolicyFigures {
            name: name.into(),
            hit_rate,
            of_achievable: hit_rate / 0.55,
            spread: 1.5,
            spread_floor: 1.0,
            ttft_p50_ms: 100.0,
            ttft_p99_ms: 900.0,
            prediction_error: None,
            ttft_ms: vec![50.0, 100.0, 900.0],
            requests: Vec::new(),
        };
        let replay_report = ReplayReport {
            trace: "t".into(),
            requests: 3,
            workers: 2,
            capacity_blocks: 10,
            block_tokens: 512,
            worker_speeds: Vec::new(),
            speed: 1.0,
            ceiling_hit_rate: 0.6,
            pooled_ceiling_hit_rate: 0.55,
            one_engine: OneEngine::default(),
            policies: vec![policy("round-robin", 0.1), policy("kvpick-precise", 0.5)],
        };
        overhead(&overhead_report, &dir.join("o.svg")).unwrap();
        replay_hit_rate(&replay_report, &dir.join("h.svg")).unwrap();
        replay_ttft(&replay_report, &dir.join("t.svg")).unwrap();
        let h = std::fs::read_to_string(dir.join("h.svg")).unwrap();
        assert!(h.starts_with("<svg"));
        assert!(h.contains("kvpick-precise") && h.contains("50.0%"));
        let o = std::fs::read_to_string(dir.join("o.svg")).unwrap();
        assert!(o.contains("1K") && o.contains("no-op p99"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
