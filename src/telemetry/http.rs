//! The `/metrics` endpoint: the registry rendered as OpenMetrics, or as the
//! Prometheus text format Go's `promhttp` serves, as the scraper's `Accept` asks.

use std::sync::Arc;

use axum::routing::get;
use axum::Router;
use tokio::net::TcpListener;

use super::registry::Metrics;
use crate::endpoints::EndpointTable;

/// Content type of the OpenMetrics text exposition.
pub const OPENMETRICS_CONTENT_TYPE: &str =
    "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Content type of the Prometheus text format, as GIE's Go EPP serves it.
pub const PROMETHEUS_TEXT_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Whether a scraper's `Accept` header prefers OpenMetrics to the Prometheus
/// text format (Prometheus itself lists OpenMetrics first). Without the
/// header, or without OpenMetrics in it, the text format is served, as Go's
/// `promhttp` does.
pub fn wants_openmetrics(accept: Option<&str>) -> bool {
    let (mut openmetrics, mut text) = (0.0f32, 0.0f32);
    for range in accept.unwrap_or_default().split(',') {
        let mut parts = range.split(';').map(str::trim);
        let media = parts.next().unwrap_or_default().to_ascii_lowercase();
        let q = parts
            .find_map(|p| p.strip_prefix("q="))
            .and_then(|q| q.parse::<f32>().ok())
            .unwrap_or(1.0);
        match media.as_str() {
            "application/openmetrics-text" => openmetrics = openmetrics.max(q),
            "text/plain" => text = text.max(q),
            _ => {}
        }
    }
    openmetrics > 0.0 && openmetrics >= text
}

/// An OpenMetrics page in the Prometheus text format (0.0.4) as Go's client
/// writes it: a counter family `x` (samples `x_total`) is named `x_total` in
/// its `# HELP` and `# TYPE` lines, `unknown` types are `untyped`, and the
/// `# UNIT` and `# EOF` lines go.
pub fn prometheus_text(openmetrics: &str) -> String {
    let mut out = String::with_capacity(openmetrics.len() + 256);
    let mut counters = std::collections::HashSet::new();
    for line in openmetrics.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            if let Some((name, "counter")) = rest.split_once(' ') {
                counters.insert(name);
            }
        }
    }
    for line in openmetrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let meta = ["# HELP ", "# TYPE "]
            .into_iter()
            .find_map(|p| line.strip_prefix(p).map(|rest| (p, rest)));
        match meta.and_then(|(p, rest)| Some((p, rest.split_once(' ')?))) {
            Some((p, (name, tail))) if counters.contains(name) => {
                out.push_str(&format!("{p}{name}_total {tail}\n"));
            }
            Some(("# TYPE ", (name, "unknown"))) => {
                out.push_str(&format!("# TYPE {name} untyped\n"));
            }
            _ => {
                out.push_str(line);
                out.push('\n');
            }
        }
    }
    out
}

/// Serves `/metrics` on `listener` until the task is dropped: OpenMetrics when
/// the scraper's `Accept` prefers it, else the Prometheus text format
/// ([`wants_openmetrics`]).
pub async fn serve_metrics(
    listener: TcpListener,
    metrics: Arc<Metrics>,
    table: Arc<EndpointTable>,
) -> std::io::Result<()> {
    let app = Router::new().route(
        "/metrics",
        get(move |headers: http::HeaderMap| {
            let page = metrics.render(&table);
            let accept = headers
                .get(http::header::ACCEPT)
                .and_then(|v| v.to_str().ok());
            let (content_type, body) = if wants_openmetrics(accept) {
                (OPENMETRICS_CONTENT_TYPE, page)
            } else {
                (PROMETHEUS_TEXT_CONTENT_TYPE, prometheus_text(&page))
            };
            async move { ([(http::header::CONTENT_TYPE, content_type)], body) }
        }),
    );
    axum::serve(listener, app).await
}
