//! An OTLP/gRPC trace receiver built from the official protocol types
//! (`TraceService`): what kvpick's exporter sends its spans to in the tracing
//! test and in the overhead benchmark's tracing cells.
//!
//! It always counts the spans it receives; it keeps them only when asked
//! ([`OtlpReceiver::keeping`]), so a benchmark receiving spans for minutes holds
//! none.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value as Any;
use opentelemetry_proto::tonic::trace::v1::Span;
use parking_lot::Mutex;
use tonic::{Request, Response, Status};

/// Received spans with their resource's service name.
type Kept = Arc<Mutex<Vec<(String, Span)>>>;

/// Spans received: counted, and kept with their resource's service name when
/// the receiver keeps them.
#[derive(Clone, Default)]
pub struct OtlpReceiver {
    kept: Option<Kept>,
    received: Arc<AtomicU64>,
}

#[tonic::async_trait]
impl TraceService for OtlpReceiver {
    async fn export(
        &self,
        request: Request<ExportTraceServiceRequest>,
    ) -> Result<Response<ExportTraceServiceResponse>, Status> {
        for rs in request.into_inner().resource_spans {
            let spans = rs.scope_spans.into_iter().flat_map(|ss| ss.spans);
            let Some(kept) = &self.kept else {
                self.received
                    .fetch_add(spans.count() as u64, Ordering::Relaxed);
                continue;
            };
            let service = rs
                .resource
                .iter()
                .flat_map(|r| &r.attributes)
                .find(|kv| kv.key == "service.name")
                .and_then(|kv| match kv.value.as_ref()?.value.as_ref()? {
                    Any::StringValue(s) => Some(s.clone()),
                    _ => None,
                })
                .unwrap_or_default();
            for span in spans {
                self.received.fetch_add(1, Ordering::Relaxed);
                kept.lock().push((service.clone(), span));
            }
        }
        Ok(Response::new(ExportTraceServiceResponse::default()))
    }
}

impl OtlpReceiver {
    /// A receiver that keeps every span (a test's).
    pub fn keeping() -> Self {
        OtlpReceiver {
            kept: Some(Arc::default()),
            received: Arc::default(),
        }
    }

    /// A receiver that only counts spans (a benchmark's).
    pub fn counting() -> Self {
        OtlpReceiver::default()
    }

    /// Serves this receiver on a free port of 127.0.0.1 (on the current Tokio
    /// runtime, until it ends); returns the address.
    pub async fn start(&self) -> std::io::Result<SocketAddr> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(TraceServiceServer::new(self.clone()))
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        Ok(addr)
    }

    /// Spans received so far.
    pub fn received(&self) -> u64 {
        self.received.load(Ordering::Relaxed)
    }

    /// The spans kept so far, with their service names (none when counting).
    pub fn spans(&self) -> Vec<(String, Span)> {
        self.kept
            .as_ref()
            .map_or_else(Vec::new, |k| k.lock().clone())
    }
}
