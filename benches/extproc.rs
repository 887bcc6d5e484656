//! Per-request overhead of a full chat request through the ext_proc server over
//! loopback gRPC, next to a no-op ext_proc server on the same tonic stack.
//!
//! Both servers see the same Envoy-style FULL_DUPLEX_STREAMED exchange: request
//! headers, a 32 KB body, the held headers answer, the body streamed back. The no-op
//! server answers with a fixed endpoint and does no parsing or scheduling, so the
//! ratio between the two is kvpick's own cost.

use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use envoy_types::pb::envoy::config::core::v3::HeaderValueOption;
use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    body_mutation, processing_request, processing_response, BodyMutation, BodyResponse,
    CommonResponse, HeaderMutation, HeadersResponse, HttpBody, HttpHeaders, ProcessingRequest,
    ProcessingResponse, ProtocolConfiguration, StreamedBodyResponse,
};
use futures::StreamExt;
use kvpick::endpoints::Endpoint;
use kvpick::extproc::ExtProcConfig;
use kvpick::server::{serve_ext_proc, App};
use tokio::net::TcpListener;
use tokio::runtime::Runtime;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Channel, Server};
use tonic::{Request, Response, Status, Streaming};

/// A no-op EPP: waits for the end of the body, answers a fixed endpoint, echoes the body.
#[derive(Clone)]
struct Noop;

type Out =
    std::pin::Pin<Box<dyn futures::Stream<Item = Result<ProcessingResponse, Status>> + Send>>;

#[tonic::async_trait]
impl ExternalProcessor for Noop {
    type ProcessStream = Out;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Out>, Status> {
        let mut inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(16);
        tokio::spawn(async move {
            let mut body = Vec::new();
            while let Some(Ok(msg)) = inbound.next().await {
                if let Some(processing_request::Request::RequestBody(b)) = msg.request {
                    body.extend_from_slice(&b.body);
                    if b.end_of_stream {
                        let header = HeaderValueOption {
                            header: Some(HeaderValue {
                                key: "x-gateway-destination-endpoint".into(),
                                raw_value: b"10.0.0.1:8000".to_vec(),
                                ..Default::default()
                            }),
                            ..Default::default()
                        };
                        let headers = ProcessingResponse {
                            response: Some(processing_response::Response::RequestHeaders(
                                HeadersResponse {
                                    response: Some(CommonResponse {
                                        header_mutation: Some(HeaderMutation {
                                            set_headers: vec![header],
                                            ..Default::default()
                                        }),
                                        clear_route_cache: true,
                                        ..Default::default()
                                    }),
                                },
                            )),
                            ..Default::default()
                        };
                        let _ = tx.send(Ok(headers)).await;
                        let chunks: Vec<&[u8]> = body.chunks(62_000).collect();
                        for (i, c) in chunks.iter().enumerate() {
                            let msg = ProcessingResponse {
                                response: Some(processing_response::Response::RequestBody(
                                    BodyResponse {
                                        response: Some(CommonResponse {
                                            body_mutation: Some(BodyMutation {
                                                mutation: Some(
                                                    body_mutation::Mutation::StreamedResponse(
                                                        StreamedBodyResponse {
                                                            body: c.to_vec(),
                                                            end_of_stream: i + 1 == chunks.len(),
                                                            ..Default::default()
                                                        },
                                                    ),
                                                ),
                                            }),
                                            ..Default::default()
                                        }),
                                    },
                                )),
                                ..Default::default()
                            };
                            let _ = tx.send(Ok(msg)).await;
                        }
                        return;
                    }
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

fn chat_body(bytes: usize) -> Vec<u8> {
    let words: String = (0..)
        .map(|i| format!("token{} ", i % 1000))
        .take_while({
            let mut n = 0;
            move |w: &String| {
                n += w.len();
                n < bytes
            }
        })
        .collect();
    serde_json::to_vec(&serde_json::json!({
        "model": "llama",
        "messages": [{"role": "system", "content": "You are helpful."},
                     {"role": "user", "content": words}],
        "stream": true
    }))
    .unwrap()
}

/// One Envoy-style full-duplex request; returns when the whole body came back.
async fn one_request(ch: &Channel, body: &[u8]) {
    let (tx, rx) = mpsc::channel(8);
    let mut responses = ExternalProcessorClient::new(ch.clone())
        .process(ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    let headers = [(":method", "POST"), (":path", "/v1/chat/completions")]
        .iter()
        .map(|(k, v)| HeaderValue {
            key: k.to_string(),
            raw_value: v.as_bytes().to_vec(),
            ..Default::default()
        })
        .collect();
    tx.send(ProcessingRequest {
        request: Some(processing_request::Request::RequestHeaders(HttpHeaders {
            headers: Some(HeaderMap { headers }),
            ..Default::default()
        })),
        protocol_config: Some(ProtocolConfiguration {
            request_body_mode: BodySendMode::FullDuplexStreamed as i32,
            response_body_mode: BodySendMode::FullDuplexStreamed as i32,
            ..Default::default()
        }),
        ..Default::default()
    })
    .await
    .unwrap();
    tx.send(ProcessingRequest {
        request: Some(processing_request::Request::RequestBody(HttpBody {
            body: body.to_vec(),
            end_of_stream: true,
            ..Default::default()
        })),
        ..Default::default()
    })
    .await
    .unwrap();
    while let Some(Ok(msg)) = responses.next().await {
        if let Some(processing_response::Response::RequestBody(b)) = msg.response {
            let eos = matches!(
                b.response
                    .and_then(|c| c.body_mutation)
                    .and_then(|m| m.mutation),
                Some(body_mutation::Mutation::StreamedResponse(
                    StreamedBodyResponse {
                        end_of_stream: true,
                        ..
                    }
                ))
            );
            if eos {
                return;
            }
        }
    }
    panic!("server ended the stream before echoing the body");
}

async fn connect(port: u16) -> Channel {
    Channel::from_shared(format!("http://127.0.0.1:{port}"))
        .unwrap()
        .connect()
        .await
        .unwrap()
}

fn overhead(c: &mut Criterion) {
    let rt = Runtime::new().unwrap();
    let (kv_port, noop_port) = rt.block_on(async {
        let app = App::new("bench");
        app.endpoints.replace(
            (0..64)
                .map(|i| {
                    Endpoint::new(
                        format!("10.0.{}.{}:8000", i / 250, i % 250 + 1)
                            .parse()
                            .unwrap(),
                    )
                })
                .collect(),
        );
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let kv_port = l.local_addr().unwrap().port();
        tokio::spawn(serve_ext_proc(
            l,
            app.ext_proc(ExtProcConfig::default()),
            None,
        ));
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let noop_port = l.local_addr().unwrap().port();
        tokio::spawn(
            Server::builder()
                .add_service(ExternalProcessorServer::new(Noop))
                .serve_with_incoming(TcpIncoming::from(l).with_nodelay(Some(true))),
        );
        (kv_port, noop_port)
    });
    let body = chat_body(32 * 1024);
    let mut group = c.benchmark_group("ext_proc_32k_chat");
    group.throughput(Throughput::Elements(1));
    group.measurement_time(Duration::from_secs(5));
    for (name, port) in [("noop", noop_port), ("kvpick", kv_port)] {
        let ch = rt.block_on(connect(port));
        group.bench_function(name, |b| b.to_async(&rt).iter(|| one_request(&ch, &body)));
    }
    group.finish();
}

criterion_group!(benches, overhead);
criterion_main!(benches);
