//! Logs: the global tracing subscriber, text or JSON, with request spans left
//! to the trace exporter.

/// Log output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// Installs the global tracing subscriber (`RUST_LOG` filters; default
/// `default_level`), with the OpenTelemetry span layer of `traces` when tracing
/// is on. Logs leave request spans out (they are for the exporter).
pub fn init_logging(
    format: LogFormat,
    default_level: &str,
    traces: Option<&super::tracing_export::Exporter>,
) {
    use tracing_subscriber::filter::{filter_fn, FilterExt};
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    use tracing_subscriber::Layer;

    let env = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_level));
    let logs = env.and(filter_fn(|m| {
        m.target() != super::tracing_export::SPAN_TARGET
    }));
    let fmt = match format {
        LogFormat::Json => tracing_subscriber::fmt::layer()
            .json()
            .with_current_span(true)
            .boxed(),
        LogFormat::Text => tracing_subscriber::fmt::layer().boxed(),
    };
    let _ = tracing_subscriber::registry()
        .with(fmt.with_filter(logs))
        .with(traces.map(|t| t.layer()))
        .try_init();
}
