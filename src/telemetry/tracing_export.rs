//! OpenTelemetry traces: one span per ext_proc request, exported over OTLP/gRPC.
//!
//! Off unless `--tracing` (the llm-d Router's flag) is given; then configured by
//! the standard variables: `OTEL_EXPORTER_OTLP_ENDPOINT` /
//! `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` (default `http://localhost:4317`),
//! `OTEL_EXPORTER_OTLP_HEADERS`, `OTEL_EXPORTER_OTLP_TIMEOUT`,
//! `OTEL_SERVICE_NAME` (default `kvpick`), `OTEL_RESOURCE_ATTRIBUTES`,
//! `OTEL_TRACES_SAMPLER` / `OTEL_TRACES_SAMPLER_ARG` (default
//! `parentbased_traceidratio` at 0.1), `OTEL_BSP_*` (the export queue), and
//! `OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none` to turn it off again.
//!
//! Invariants:
//! - Off, nothing here runs on the request path: [`RequestSpan::start`] is one
//!   relaxed load and returns `None`, and the stream skips every hook on `None`.
//! - A request's span continues the W3C `traceparent` / `tracestate` of its
//!   headers (a missing or malformed one starts a new trace), and the forwarded
//!   request carries the span's own context ([`RequestSpan::forward_headers`]).
//! - Sampling is bounded (a ratio, parent-based by default) and so is the export
//!   queue (`OTEL_BSP_MAX_QUEUE_SIZE`, 2048 spans): past it spans are dropped,
//!   never buffered without bound, and export never blocks a request.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use envoy_types::pb::envoy::config::core::v3::HeaderMap;
use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::{Status, TracerProvider as _};
use opentelemetry::KeyValue;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider};
use opentelemetry_sdk::Resource;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::filter::Targets;
use tracing_subscriber::Layer;

use crate::scheduler::{CostTerms, Decision};

/// The `tracing` target of request spans: only these reach the exporter, and
/// the log output leaves them out.
pub const SPAN_TARGET: &str = "kvpick::trace";

/// Whether request spans are made (an exporter is running).
static ON: AtomicBool = AtomicBool::new(false);

/// Default `OTEL_TRACES_SAMPLER_ARG`: one trace in ten, unless the caller's
/// trace was sampled (the llm-d Router's default ratio).
pub const DEFAULT_RATIO: f64 = 0.1;

/// Why tracing could not start.
#[derive(Debug, thiserror::Error)]
pub enum TraceConfigError {
    /// An `OTEL_*` variable has a value kvpick does not support.
    #[error("{var}={value}: {why}")]
    Env {
        /// The variable.
        var: &'static str,
        /// Its value.
        value: String,
        /// What is wrong with it.
        why: &'static str,
    },
    /// The OTLP exporter could not be built.
    #[error("cannot build the OTLP/gRPC span exporter")]
    Exporter(#[source] opentelemetry_otlp::ExporterBuildError),
}

/// Tracing as configured: `None` when off.
#[derive(Debug, Clone)]
pub struct TraceSettings {
    /// How traces are sampled.
    pub sampler: Sampler,
}

impl TraceSettings {
    /// The settings for the `--tracing` flag and the process environment.
    pub fn from_env(flag: Option<bool>) -> Result<Option<TraceSettings>, TraceConfigError> {
        Self::from_vars(flag, |name| std::env::var(name).ok())
    }

    /// [`TraceSettings::from_env`] over the variables `var` reads.
    pub fn from_vars(
        flag: Option<bool>,
        var: impl Fn(&str) -> Option<String>,
    ) -> Result<Option<TraceSettings>, TraceConfigError> {
        let bad = |var: &'static str, value: String, why| TraceConfigError::Env { var, value, why };
        if flag != Some(true)
            || var("OTEL_SDK_DISABLED").is_some_and(|v| v.trim().eq_ignore_ascii_case("true"))
        {
            return Ok(None);
        }
        match var("OTEL_TRACES_EXPORTER").as_deref().map(str::trim) {
            None | Some("") | Some("otlp") => {}
            Some("none") => return Ok(None),
            Some(other) => {
                return Err(bad(
                    "OTEL_TRACES_EXPORTER",
                    other.into(),
                    "kvpick exports `otlp` (or `none`)",
                ))
            }
        }
        for name in [
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
            "OTEL_EXPORTER_OTLP_PROTOCOL",
        ] {
            if let Some(p) = var(name).filter(|p| !p.trim().is_empty() && p.trim() != "grpc") {
                return Err(bad(name, p, "kvpick exports OTLP over gRPC only (`grpc`)"));
            }
        }
        let ratio = match var("OTEL_TRACES_SAMPLER_ARG") {
            None => DEFAULT_RATIO,
            Some(arg) => match arg.trim().parse::<f64>() {
                Ok(r) if (0.0..=1.0).contains(&r) => r,
                _ => {
                    return Err(bad(
                        "OTEL_TRACES_SAMPLER_ARG",
                        arg,
                        "expected a ratio from 0 to 1",
                    ))
                }
            },
        };
        let parent_based = |root: Sampler| Sampler::ParentBased(Box::new(root));
        let sampler = match var("OTEL_TRACES_SAMPLER").as_deref().map(str::trim) {
            None | Some("") | Some("parentbased_traceidratio") => {
                parent_based(Sampler::TraceIdRatioBased(ratio))
            }
            Some("traceidratio") => Sampler::TraceIdRatioBased(ratio),
            Some("parentbased_always_on") => parent_based(Sampler::AlwaysOn),
            Some("parentbased_always_off") => parent_based(Sampler::AlwaysOff),
            Some("always_on") => Sampler::AlwaysOn,
            Some("always_off") => Sampler::AlwaysOff,
            Some(other) => return Err(bad(
                "OTEL_TRACES_SAMPLER",
                other.into(),
                "expected always_on, always_off, traceidratio or parentbased_{always_on,always_off,traceidratio}",
            )),
        };
        Ok(Some(TraceSettings { sampler }))
    }
}

/// The running OTLP exporter. Request spans are made while it lives; dropping
/// it stops them and flushes what is queued.
pub struct Exporter {
    provider: SdkTracerProvider,
}

impl Exporter {
    /// Starts exporting (inside a Tokio runtime: the gRPC client runs there).
    pub fn start(settings: &TraceSettings) -> Result<Exporter, TraceConfigError> {
        use opentelemetry_otlp::WithTonicConfig;
        let endpoint = std::env::var("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
            .or_else(|_| std::env::var("OTEL_EXPORTER_OTLP_ENDPOINT"))
            .unwrap_or_default();
        let mut builder = opentelemetry_otlp::SpanExporter::builder().with_tonic();
        if endpoint.trim_start().starts_with("https://") {
            // The system's roots, over rustls with ring (as every other client here).
            builder = builder
                .with_tls_config(tonic::transport::ClientTlsConfig::new().with_native_roots());
        }
        let exporter = builder.build().map_err(TraceConfigError::Exporter)?;
        let mut resource = Resource::builder();
        if std::env::var_os("OTEL_SERVICE_NAME").is_none() {
            resource = resource.with_service_name("kvpick");
        }
        let provider = SdkTracerProvider::builder()
            .with_batch_exporter(exporter)
            .with_sampler(settings.sampler.clone())
            .with_resource(
                resource
                    .with_attribute(KeyValue::new("service.version", env!("CARGO_PKG_VERSION")))
                    .build(),
            )
            .build();
        ON.store(true, Ordering::Relaxed);
        Ok(Exporter { provider })
    }

    /// The `tracing` layer that turns request spans into OpenTelemetry spans
    /// (request spans only: logs stay logs).
    pub fn layer<S>(&self) -> impl Layer<S>
    where
        S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    {
        let tracer = self.provider.tracer("kvpick");
        tracing_opentelemetry::layer()
            .with_tracer(tracer)
            .with_tracked_inactivity(false)
            .with_filter(Targets::new().with_target(SPAN_TARGET, tracing::Level::INFO))
    }

    /// Sends what is queued now.
    pub fn flush(&self) {
        if let Err(e) = self.provider.force_flush() {
            tracing::warn!(error = %e, "flushing OpenTelemetry spans failed");
        }
    }
}

impl Drop for Exporter {
    fn drop(&mut self) {
        ON.store(false, Ordering::Relaxed);
        if let Err(e) = self.provider.shutdown() {
            tracing::warn!(error = %e, "shutting down the OpenTelemetry exporter failed");
        }
    }
}

/// Whether request spans are made.
#[inline]
pub fn enabled() -> bool {
    ON.load(Ordering::Relaxed)
}

/// The span of one ext_proc request (request headers to the end of the
/// stream); it ends, and is exported, when dropped.
pub struct RequestSpan {
    span: tracing::Span,
    queued_at: Option<Instant>,
}

/// Reads a W3C trace context from Envoy's request headers.
struct EnvoyHeaders<'a>(Option<&'a HeaderMap>);

impl Extractor for EnvoyHeaders<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        let h = self
            .0?
            .headers
            .iter()
            .find(|h| h.key.eq_ignore_ascii_case(key))?;
        match h.raw_value.is_empty() {
            true => Some(&h.value),
            false => std::str::from_utf8(&h.raw_value).ok(),
        }
    }

    fn keys(&self) -> Vec<&str> {
        self.0.map_or_else(Vec::new, |m| {
            m.headers.iter().map(|h| h.key.as_str()).collect()
        })
    }
}

/// Collects the headers a trace context is written to.
struct Forwarded(Vec<(&'static str, String)>);

impl Injector for Forwarded {
    fn set(&mut self, key: &str, value: String) {
        // The W3C propagator writes only these two.
        let key = match key {
            "traceparent" => "traceparent",
            "tracestate" => "tracestate",
            _ => return,
        };
        self.0.push((key, value));
    }
}

/// Longest client-given string (a session id) an attribute carries.
const MAX_ATTRIBUTE_CHARS: usize = 128;

impl RequestSpan {
    /// The span of a request with these headers, child of the trace they carry;
    /// `None` when tracing is off.
    #[inline]
    pub fn start(headers: Option<&HeaderMap>, path: &str) -> Option<Box<RequestSpan>> {
        if !enabled() {
            return None;
        }
        Some(Self::start_traced(headers, path))
    }

    #[cold]
    fn start_traced(headers: Option<&HeaderMap>, path: &str) -> Box<RequestSpan> {
        let parent = TraceContextPropagator::new().extract(&EnvoyHeaders(headers));
        let span = tracing::info_span!(
            target: SPAN_TARGET,
            parent: None,
            "kvpick.route",
            otel.kind = "server",
        );
        // Fails only on a span already started; this one is new.
        let _ = span.set_parent(parent);
        span.set_attribute("url.path", truncate(path, 256));
        Box::new(RequestSpan {
            span,
            queued_at: None,
        })
    }

    /// Flow control queued the request.
    pub fn queued(&mut self) {
        self.queued_at = Some(Instant::now());
    }

    /// Flow control let the request go (or shed it) after its wait.
    pub fn admitted(&mut self) {
        if let Some(at) = self.queued_at.take() {
            let ms = at.elapsed().as_secs_f64() * 1e3;
            self.span.set_attribute("kvpick.admission.wait_ms", ms);
        }
    }

    /// The request was routed: the decision and the chosen decode rank's cost.
    pub fn routed(&self, decision: &Decision, terms: &CostTerms) {
        let s = &self.span;
        let decode = decision.decode.endpoint();
        s.set_attribute("kvpick.outcome", "routed");
        s.set_attribute("kvpick.worker.address", decode.address.to_string());
        s.set_attribute("kvpick.worker.instance_id", decode.instance_id as i64);
        s.set_attribute("kvpick.worker.dp_rank", i64::from(decision.decode.rank));
        if let Some(p) = &decision.prefill {
            s.set_attribute("kvpick.prefill.address", p.endpoint().address.to_string());
            s.set_attribute(
                "kvpick.prefill.instance_id",
                p.endpoint().instance_id as i64,
            );
            s.set_attribute("kvpick.prefill.dp_rank", i64::from(p.rank));
        }
        s.set_attribute("kvpick.prefix.prompt_blocks", decision.prompt_blocks as i64);
        s.set_attribute(
            "kvpick.prefix.overlap_blocks",
            decision.overlap_blocks as i64,
        );
        for (name, cost) in &terms.0 {
            s.set_attribute(format!("kvpick.cost.{name}"), *cost);
        }
        s.set_attribute("kvpick.cost.total", terms.total());
        if let Some(turn) = &decision.session {
            s.set_attribute("kvpick.session.id", truncate(&turn.id, MAX_ATTRIBUTE_CHARS));
            if let Some(action) = turn.action {
                s.set_attribute("kvpick.session.action", action.as_str());
            }
            s.set_attribute("kvpick.session.rehomed", turn.rehomed);
        }
    }

    /// kvpick answered the request itself with `status` (it was not routed).
    pub fn rejected(&self, status: u16, message: &str) {
        let outcome = match status {
            400 => "bad_request",
            408 => "body_timeout",
            413 => "body_too_large",
            429 => "shed",
            503 => "no_endpoint",
            _ => "rejected",
        };
        self.span.set_attribute("kvpick.outcome", outcome);
        self.span
            .set_attribute("http.response.status_code", i64::from(status));
        if status >= 500 {
            self.span.set_status(Status::error(truncate(message, 256)));
        }
    }

    /// Flow control shed the request for `reason` (GIE's dropped-reason).
    pub fn shed(&self, reason: &'static str) {
        self.span
            .set_attribute("kvpick.admission.shed_reason", reason);
    }

    /// The worker's response status.
    pub fn response(&self, status: u16) {
        self.span
            .set_attribute("http.response.status_code", i64::from(status));
        if status >= 500 {
            self.span.set_status(Status::error("worker answered 5xx"));
        }
    }

    /// The headers that carry this span's context to the worker (`traceparent`,
    /// and `tracestate` when the caller's trace had one).
    pub fn forward_headers(&self) -> Vec<(&'static str, String)> {
        let mut out = Forwarded(Vec::with_capacity(2));
        TraceContextPropagator::new().inject_context(&self.span.context(), &mut out);
        out.0
    }
}

/// At most `max` characters of `s`.
fn truncate(s: &str, max: usize) -> String {
    match s.char_indices().nth(max) {
        Some((i, _)) => s[..i].to_string(),
        None => s.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(
        flag: Option<bool>,
        vars: &[(&str, &str)],
    ) -> Result<Option<TraceSettings>, TraceConfigError> {
        TraceSettings::from_vars(flag, |name| {
            vars.iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| v.to_string())
        })
    }

    #[test]
    fn off_unless_the_flag_says_on() {
        assert!(settings(None, &[]).unwrap().is_none());
        assert!(
            settings(Some(false), &[("OTEL_TRACES_SAMPLER", "always_on")])
                .unwrap()
                .is_none()
        );
        assert!(settings(Some(true), &[("OTEL_SDK_DISABLED", "true")])
            .unwrap()
            .is_none());
        assert!(settings(Some(true), &[("OTEL_TRACES_EXPORTER", "none")])
            .unwrap()
            .is_none());
    }

    #[test]
    fn sampling_is_a_parent_based_ratio_by_default() {
        let s = settings(Some(true), &[]).unwrap().unwrap();
        assert_eq!(
            format!("{:?}", s.sampler),
            format!(
                "{:?}",
                Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(DEFAULT_RATIO)))
            )
        );
        let s = settings(
            Some(true),
            &[
                ("OTEL_TRACES_SAMPLER", "traceidratio"),
                ("OTEL_TRACES_SAMPLER_ARG", "0.25"),
            ],
        )
        .unwrap()
        .unwrap();
        assert_eq!(format!("{:?}", s.sampler), "TraceIdRatioBased(0.25)");
    }

    #[test]
    fn unsupported_settings_are_clear_errors() {
        for (var, value, says) in [
            ("OTEL_TRACES_SAMPLER_ARG", "1.5", "ratio from 0 to 1"),
            ("OTEL_TRACES_SAMPLER", "jaeger_remote", "expected always_on"),
            ("OTEL_TRACES_EXPORTER", "zipkin", "`otlp`"),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf", "gRPC only"),
        ] {
            let e = settings(Some(true), &[(var, value)])
                .unwrap_err()
                .to_string();
            assert!(e.starts_with(&format!("{var}={value}: ")), "{e}");
            assert!(e.contains(says), "{e}");
        }
    }

    #[test]
    fn off_makes_no_span() {
        assert!(!enabled());
        assert!(RequestSpan::start(None, "/v1/completions").is_none());
    }

    #[test]
    fn truncates_on_char_boundaries() {
        assert_eq!(truncate("héllo", 2), "hé");
        assert_eq!(truncate("hi", 5), "hi");
    }
}
