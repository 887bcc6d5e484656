//! The admin gRPC service `kvpick.admin.v1.Admin` (`proto/kvpick/admin/v1/admin.proto`):
//! `Explain` scores every candidate for a request body as the pick would
//! ([`Scheduler::explain`]) without routing it or booking anything.
//!
//! It listens on its own port (`--admin-port`, off by default), on loopback
//! unless `--admin-address` says otherwise, never on the ext_proc port.
//! `kvpick explain FILE` is its client.
//!
//! The messages are hand-written prost types (no protoc or build script); the
//! test `messages_match_the_proto` checks every field number and wire type
//! against the `.proto` file, and the service and client are written against
//! tonic's codegen API the way `tonic-build` would generate them.

use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use tonic::codegen::{http, BoxFuture, Service, StdError};

use crate::endpoints::EndpointTable;
use crate::pipeline::{Pipeline, RequestHead};
use crate::request::ApiKind;
use crate::scheduler::{Explanation, PickRequest, Scheduler};
use crate::tokenize::TokenizerPool;

/// `ExplainRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ExplainRequest {
    /// The request body.
    #[prost(bytes = "vec", tag = "1")]
    pub body: Vec<u8>,
    /// The request path; empty: the body's shape decides the API.
    #[prost(string, tag = "2")]
    pub path: String,
    /// A session id as the session header carries it.
    #[prost(string, tag = "3")]
    pub session_id: String,
    /// Addresses the gateway would restrict the choice to.
    #[prost(string, repeated, tag = "4")]
    pub subset: Vec<String>,
}

/// `Term`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Term {
    /// The term's name.
    #[prost(string, tag = "1")]
    pub name: String,
    /// Its weighted cost.
    #[prost(double, tag = "2")]
    pub cost: f64,
}

/// `Candidate`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Candidate {
    /// `ip:port`.
    #[prost(string, tag = "1")]
    pub address: String,
    /// The worker's instance id.
    #[prost(uint64, tag = "2")]
    pub instance_id: u64,
    /// Data-parallel rank.
    #[prost(uint32, tag = "3")]
    pub dp_rank: u32,
    /// `decode` or `prefill`.
    #[prost(string, tag = "4")]
    pub role: String,
    /// Why it sits out; empty when scored.
    #[prost(string, tag = "5")]
    pub filtered_out: String,
    /// Leading prompt blocks it holds.
    #[prost(uint64, tag = "6")]
    pub overlap_blocks: u64,
    /// The sum of the terms.
    #[prost(double, tag = "11")]
    pub cost: f64,
    /// The session is bound to it.
    #[prost(bool, tag = "12")]
    pub session_pinned: bool,
    /// The pick would take it.
    #[prost(bool, tag = "13")]
    pub chosen: bool,
    /// The weighted cost terms, in summing order.
    #[prost(message, repeated, tag = "14")]
    pub terms: Vec<Term>,
    /// What its load terms come from: `scraped`, `suspect`, `unscraped`.
    #[prost(string, tag = "15")]
    pub load_source: String,
    /// `overlap_blocks` is a guess its KV events have not confirmed.
    #[prost(bool, tag = "16")]
    pub overlap_guessed: bool,
    /// Its predicted latency there, when latency is learned and warm.
    #[prost(message, optional, tag = "17")]
    pub prediction: Option<Prediction>,
    /// The engine's own recent latency, when scraped.
    #[prost(message, optional, tag = "18")]
    pub engine: Option<EngineLatency>,
    /// Of `overlap_blocks`, those on the GPU.
    #[prost(uint64, tag = "19")]
    pub gpu_blocks: u64,
    /// Of `overlap_blocks`, those in CPU memory and not on the GPU.
    #[prost(uint64, tag = "20")]
    pub cpu_blocks: u64,
    /// Of `overlap_blocks`, those on disk only.
    #[prost(uint64, tag = "21")]
    pub disk_blocks: u64,
}

/// `EngineLatency`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct EngineLatency {
    /// Mean queue time, seconds.
    #[prost(double, optional, tag = "1")]
    pub queue_seconds: Option<f64>,
    /// Mean TTFT as the engine measures it, seconds.
    #[prost(double, optional, tag = "2")]
    pub ttft_seconds: Option<f64>,
    /// Mean inter-token latency, seconds.
    #[prost(double, optional, tag = "3")]
    pub itl_seconds: Option<f64>,
    /// Predicted TTFT minus `ttft_seconds`.
    #[prost(double, optional, tag = "4")]
    pub ttft_gap_seconds: Option<f64>,
    /// Seconds since the window closed.
    #[prost(double, optional, tag = "5")]
    pub age_seconds: Option<f64>,
}

/// `Prediction`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Prediction {
    /// Time to first token, in seconds.
    #[prost(double, tag = "1")]
    pub ttft_seconds: f64,
    /// Time per output token, in seconds.
    #[prost(double, tag = "2")]
    pub tpot_seconds: f64,
    /// The worker's recent mean |error| / actual TTFT.
    #[prost(double, tag = "3")]
    pub recent_error: f64,
    /// Observations behind its own model (0: the pool prior).
    #[prost(uint64, tag = "4")]
    pub observations: u64,
}

/// `ExplainResponse`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ExplainResponse {
    /// Prompt hash blocks.
    #[prost(uint64, tag = "1")]
    pub prompt_blocks: u64,
    /// Load the request would book.
    #[prost(uint64, tag = "2")]
    pub load_blocks: u64,
    /// The session the request names.
    #[prost(string, tag = "3")]
    pub session_id: String,
    /// Decode candidates first, then prefill ones.
    #[prost(message, repeated, tag = "4")]
    pub candidates: Vec<Candidate>,
}

/// The gRPC path of `Explain`.
pub const EXPLAIN_PATH: &str = "/kvpick.admin.v1.Admin/Explain";

/// What `Explain` reads.
pub struct Admin {
    scheduler: Arc<Scheduler>,
    endpoints: Arc<EndpointTable>,
    pipeline: Pipeline,
}

impl Admin {
    /// The service over the routing state (and the tokenizer, so precise-mode
    /// requests are prepared as the ext_proc path prepares them, remote images
    /// fetched when it fetches them).
    pub fn new(
        scheduler: Arc<Scheduler>,
        endpoints: Arc<EndpointTable>,
        tokenizer: Option<TokenizerPool>,
    ) -> Self {
        let pipeline = Pipeline::new(scheduler.config().prompt_limits(), tokenizer);
        Admin {
            scheduler,
            endpoints,
            pipeline,
        }
    }

    /// The tonic service.
    pub fn into_server(self) -> AdminServer {
        AdminServer(Arc::new(self))
    }

    /// Answers one `Explain`.
    pub async fn explain(&self, req: ExplainRequest) -> Result<ExplainResponse, tonic::Status> {
        let head = RequestHead {
            kind: ApiKind::from_path(&req.path),
            path: req.path,
            ..Default::default()
        };
        let mut prepared = self
            .pipeline
            .prepare(req.body, &head)
            .map_err(|e| tonic::Status::invalid_argument(e.to_string()))?;
        if let Some(job) = prepared.take_tokenize_job() {
            prepared.tokenized(job.run().await);
        }
        let snapshot = self.endpoints.snapshot();
        let pick = PickRequest {
            body: Some(&prepared.request),
            subset: (!req.subset.is_empty()).then_some(req.subset.as_slice()),
            session_id: (!req.session_id.is_empty()).then_some(req.session_id.as_str()),
            session_token: None,
            slo: Default::default(),
            sheddable: false,
        };
        let explained = self
            .scheduler
            .explain(&pick, &snapshot, Instant::now())
            .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
        Ok(response(explained))
    }
}

fn response(e: Explanation) -> ExplainResponse {
    ExplainResponse {
        prompt_blocks: e.prompt_blocks as u64,
        load_blocks: e.load_blocks,
        session_id: e.session_id.unwrap_or_default(),
        candidates: e
            .candidates
            .into_iter()
            .map(|c| Candidate {
                engine: c.engine.map(|e| EngineLatency {
                    queue_seconds: e.queue,
                    ttft_seconds: e.ttft,
                    itl_seconds: e.itl,
                    ttft_gap_seconds: c.ttft_gap(),
                    age_seconds: e.at.map(|at| at.elapsed().as_secs_f64()),
                }),
                address: c.address,
                instance_id: c.key.instance_id,
                dp_rank: c.key.dp_rank,
                role: if c.prefill { "prefill" } else { "decode" }.into(),
                filtered_out: c.filtered_out.unwrap_or_default().into(),
                overlap_blocks: c.overlap_blocks as u64,
                gpu_blocks: c.tier_blocks.gpu as u64,
                cpu_blocks: c.tier_blocks.cpu as u64,
                disk_blocks: c.tier_blocks.disk as u64,
                cost: c.terms.total(),
                terms: c
                    .terms
                    .0
                    .iter()
                    .map(|&(name, cost)| Term {
                        name: name.into(),
                        cost,
                    })
                    .collect(),
                session_pinned: c.session_pinned,
                chosen: c.chosen,
                load_source: c.load_source.as_str().into(),
                overlap_guessed: c.overlap_guessed,
                prediction: c.prediction.map(|p| Prediction {
                    ttft_seconds: p.ttft,
                    tpot_seconds: p.tpot,
                    recent_error: p.recent_error,
                    observations: p.observations,
                }),
            })
            .collect(),
    }
}

/// An answer as JSON (proto field names), for `kvpick explain`.
pub fn to_json(r: &ExplainResponse) -> serde_json::Value {
    let candidates: Vec<serde_json::Value> = r
        .candidates
        .iter()
        .map(|c| {
            let terms: Vec<serde_json::Value> = c
                .terms
                .iter()
                .map(|t| serde_json::json!({"name": t.name, "cost": t.cost}))
                .collect();
            serde_json::json!({
                "address": c.address, "instance_id": c.instance_id, "dp_rank": c.dp_rank,
                "role": c.role, "filtered_out": c.filtered_out,
                "overlap_blocks": c.overlap_blocks,
                "tier_blocks": {
                    "gpu": c.gpu_blocks, "cpu": c.cpu_blocks, "disk": c.disk_blocks,
                },
                "terms": terms, "cost": c.cost,
                "session_pinned": c.session_pinned, "chosen": c.chosen,
                "load_source": c.load_source, "overlap_guessed": c.overlap_guessed,
                "prediction": c.prediction.as_ref().map(|p| serde_json::json!({
                    "ttft_seconds": p.ttft_seconds, "tpot_seconds": p.tpot_seconds,
                    "recent_error": p.recent_error, "observations": p.observations,
                })),
                "engine": c.engine.as_ref().map(|e| serde_json::json!({
                    "queue_seconds": e.queue_seconds, "ttft_seconds": e.ttft_seconds,
                    "itl_seconds": e.itl_seconds, "ttft_gap_seconds": e.ttft_gap_seconds,
                    "age_seconds": e.age_seconds,
                })),
            })
        })
        .collect();
    serde_json::json!({
        "prompt_blocks": r.prompt_blocks,
        "load_blocks": r.load_blocks,
        "session_id": r.session_id,
        "candidates": candidates,
    })
}

/// The `kvpick.admin.v1.Admin` gRPC service (as `tonic-build` would generate it).
#[derive(Clone)]
pub struct AdminServer(Arc<Admin>);

impl tonic::server::NamedService for AdminServer {
    const NAME: &'static str = "kvpick.admin.v1.Admin";
}

struct ExplainCall(Arc<Admin>);

impl tonic::server::UnaryService<ExplainRequest> for ExplainCall {
    type Response = ExplainResponse;
    type Future = BoxFuture<tonic::Response<ExplainResponse>, tonic::Status>;

    fn call(&mut self, request: tonic::Request<ExplainRequest>) -> Self::Future {
        let admin = Arc::clone(&self.0);
        Box::pin(async move {
            admin
                .explain(request.into_inner())
                .await
                .map(tonic::Response::new)
        })
    }
}

impl<B> Service<http::Request<B>> for AdminServer
where
    B: tonic::codegen::Body + Send + 'static,
    B::Error: Into<StdError> + Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = std::convert::Infallible;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        if req.uri().path() != EXPLAIN_PATH {
            return Box::pin(async { Ok(tonic::Status::unimplemented("").into_http()) });
        }
        let admin = Arc::clone(&self.0);
        Box::pin(async move {
            let mut grpc = tonic::server::Grpc::new(tonic_prost::ProstCodec::default());
            Ok(grpc.unary(ExplainCall(admin), req).await)
        })
    }
}

/// Why `kvpick explain` failed.
#[derive(Debug, thiserror::Error)]
pub enum ExplainClientError {
    /// Connecting failed (or the address is not a URI).
    #[error("connecting to the admin port")]
    Connect(#[source] tonic::transport::Error),
    /// The call failed.
    #[error("Explain")]
    Call(#[source] tonic::Status),
}

/// Calls `Explain` on the admin service at `endpoint` (`http://host:port`).
pub async fn call_explain(
    endpoint: String,
    req: ExplainRequest,
) -> Result<ExplainResponse, ExplainClientError> {
    let channel = tonic::transport::Endpoint::from_shared(endpoint)
        .map_err(ExplainClientError::Connect)?
        .connect()
        .await
        .map_err(ExplainClientError::Connect)?;
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.map_err(ExplainClientError::Connect)?;
    grpc.unary(
        tonic::Request::new(req),
        http::uri::PathAndQuery::from_static(EXPLAIN_PATH),
        tonic_prost::ProstCodec::default(),
    )
    .await
    .map(tonic::Response::into_inner)
    .map_err(ExplainClientError::Call)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request;
    use prost::Message;

    /// `(field number, wire type)` of each field of `message` in the `.proto`.
    fn proto_fields(message: &str) -> Vec<(u64, u64)> {
        let proto = include_str!("../../proto/kvpick/admin/v1/admin.proto");
        let body = proto
            .split(&format!("message {message} {{"))
            .nth(1)
            .unwrap()
            .split('}')
            .next()
            .unwrap();
        body.lines()
            .map(|l| l.trim())
            .filter(|l| !l.starts_with("//") && !l.starts_with("reserved") && l.ends_with(';'))
            .map(|l| {
                let words: Vec<&str> = l.split_whitespace().collect();
                let ty = if words[0] == "repeated" || words[0] == "optional" {
                    words[1]
                } else {
                    words[0]
                };
                let number = l.rsplit('=').next().unwrap().trim_end_matches(';').trim();
                let wire = match ty {
                    "uint64" | "uint32" | "bool" => 0,
                    "double" => 1,
                    _ => 2,
                };
                (number.parse().unwrap(), wire)
            })
            .collect()
    }

    /// `(field number, wire type)` of each field in an encoding.
    fn wire_fields(mut b: &[u8]) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        while !b.is_empty() {
            let key = prost::encoding::decode_varint(&mut b).unwrap();
            let (number, wire) = (key >> 3, key & 7);
            match wire {
                0 => drop(prost::encoding::decode_varint(&mut b).unwrap()),
                1 => b = &b[8..],
                _ => {
                    let n = prost::encoding::decode_varint(&mut b).unwrap() as usize;
                    b = &b[n..];
                }
            }
            out.push((number, wire));
        }
        out
    }

    fn chat(text: &str) -> Vec<u8> {
        serde_json::to_vec(&kvpick_core::fixtures::chat("m", text)).unwrap()
    }

    #[tokio::test]
    async fn explain_scores_every_candidate_over_grpc_without_booking() {
        use crate::endpoints::Endpoint;
        let app = crate::server::App::new("t");
        app.endpoints.replace(
            (1..=3)
                .map(|i| Endpoint::new(format!("10.0.0.{i}:8000").parse().unwrap()))
                .collect(),
        );
        let snapshot = app.endpoints.snapshot();
        let key = |i: usize| snapshot.endpoints[i].key(0);
        // One earlier request of this conversation ran on some worker.
        let first = "the same long system prompt, over and over again. ".repeat(8);
        let parsed = request::parse(&chat(&first), None).unwrap();
        let d = app
            .scheduler
            .pick(
                &PickRequest {
                    body: Some(&parsed),
                    ..PickRequest::default()
                },
                &snapshot,
            )
            .unwrap();
        app.scheduler.finish(&d, Some(200));
        let holder = d.decode.key();

        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let admin = Admin::new(Arc::clone(&app.scheduler), Arc::clone(&app.endpoints), None);
        let server = tokio::spawn(crate::server::serve_admin(Some(listener), admin));
        let endpoint = format!("http://{addr}");
        let ask = |body: Vec<u8>, session_id: &str, subset: Vec<String>| {
            call_explain(
                endpoint.clone(),
                ExplainRequest {
                    body,
                    path: "/v1/chat/completions".into(),
                    session_id: session_id.into(),
                    subset,
                },
            )
        };

        let longer = format!("{first} and a question at the end");
        let a = ask(chat(&longer), "", Vec::new()).await.unwrap();
        assert_eq!(a.candidates.len(), 3);
        let chosen: Vec<&Candidate> = a.candidates.iter().filter(|c| c.chosen).collect();
        assert_eq!(chosen.len(), 1);
        assert_eq!(
            chosen[0].instance_id, holder.instance_id,
            "the worker holding the prefix"
        );
        assert_eq!(chosen[0].overlap_blocks, d.prompt_blocks as u64);
        for c in &a.candidates {
            let names: Vec<&str> = c.terms.iter().map(|t| t.name.as_str()).collect();
            assert_eq!(
                names,
                [
                    "prefill",
                    "decode_load",
                    "queue",
                    "kv_usage",
                    "lora",
                    "running",
                    "failures"
                ]
            );
            let terms: f64 = c.terms.iter().map(|t| t.cost).sum();
            assert!((c.cost - terms).abs() < 1e-9);
            assert_eq!(c.role, "decode");
            assert!(c.filtered_out.is_empty());
            if !c.chosen {
                assert_eq!(c.overlap_blocks, 0);
                assert!(c.cost > chosen[0].cost);
            }
        }

        // Nothing was booked or indexed: the same question, the same answer,
        // no load anywhere, and a new prompt still matches nowhere.
        assert_eq!(ask(chat(&longer), "", Vec::new()).await.unwrap(), a);
        let snapshot = app.endpoints.snapshot();
        assert!(snapshot
            .endpoints
            .iter()
            .all(|e| e.active_load(0).blocks == 0));
        let fresh = chat(&"an unseen prompt about something else. ".repeat(8));
        for _ in 0..2 {
            let b = ask(fresh.clone(), "", Vec::new()).await.unwrap();
            assert!(b.candidates.iter().all(|c| c.overlap_blocks == 0));
        }

        // A bound session wins over the prefix; a subset leaves the others out.
        let other = (0..3).map(key).find(|k| *k != holder).unwrap();
        app.scheduler.sessions().bind(
            "s1",
            other,
            None,
            std::time::Duration::from_secs(60),
            Instant::now(),
        );
        let s = ask(chat(&longer), "s1", Vec::new()).await.unwrap();
        let pinned = s.candidates.iter().find(|c| c.chosen).unwrap();
        assert!(pinned.session_pinned);
        assert_eq!(pinned.instance_id, other.instance_id);
        assert_eq!(s.session_id, "s1");
        let only = snapshot.endpoints[0].endpoint.address_string();
        let sub = ask(chat(&longer), "", vec![only.clone()]).await.unwrap();
        for c in &sub.candidates {
            assert_eq!(c.chosen, c.address == only);
            assert_eq!(c.filtered_out.is_empty(), c.address == only);
        }
        match ask(b"{".to_vec(), "", Vec::new()).await {
            Err(ExplainClientError::Call(s)) => {
                assert_eq!(s.code(), tonic::Code::InvalidArgument)
            }
            other => panic!("{other:?}"),
        }
        server.abort();
    }

    #[tokio::test]
    async fn with_a_tokenizer_explain_hashes_token_blocks_like_the_ext_proc_path() {
        use crate::endpoints::Endpoint;
        use crate::tokenize::{token_ids, Tokenizer};
        let app = crate::server::App::new("t");
        app.endpoints
            .replace(vec![Endpoint::new("10.0.0.1:8000".parse().unwrap())]);
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer");
        let tokenizer = Tokenizer::load(&dir).unwrap();
        let body = chat(&"a b c d e f g h ".repeat(40));
        let options = request::ParseOptions {
            limits: request::PromptLimits::NONE,
            template: true,
        };
        let parsed = request::parse_with(&body, Some(ApiKind::Chat), options).unwrap();
        let tokens = token_ids(&tokenizer.tokenize_request(&parsed).unwrap());
        let token_block = app.scheduler.config().token_block;
        let ask = |tokenizer| {
            let admin = Admin::new(
                Arc::clone(&app.scheduler),
                Arc::clone(&app.endpoints),
                tokenizer,
            );
            let body = body.clone();
            async move {
                admin
                    .explain(ExplainRequest {
                        body,
                        path: "/v1/chat/completions".into(),
                        ..ExplainRequest::default()
                    })
                    .await
                    .unwrap()
            }
        };
        let precise = ask(Some(TokenizerPool::new(tokenizer, 1))).await;
        assert_eq!(precise.prompt_blocks as usize, tokens.len() / token_block);
        let bytes = ask(None).await;
        assert_ne!(
            bytes.prompt_blocks, precise.prompt_blocks,
            "byte blocks without it"
        );
    }

    #[test]
    fn messages_match_the_proto() {
        let candidate = Candidate {
            address: "a".into(),
            instance_id: 1,
            dp_rank: 1,
            role: "decode".into(),
            filtered_out: "ejected".into(),
            overlap_blocks: 1,
            terms: vec![Term {
                name: "prefill".into(),
                cost: 1.0,
            }],
            cost: 1.0,
            session_pinned: true,
            chosen: true,
            load_source: "unscraped".into(),
            overlap_guessed: true,
            prediction: Some(Prediction {
                ttft_seconds: 0.1,
                tpot_seconds: 0.01,
                recent_error: 0.1,
                observations: 1,
            }),
            engine: Some(EngineLatency {
                queue_seconds: Some(0.1),
                ttft_seconds: Some(0.2),
                itl_seconds: Some(0.01),
                ttft_gap_seconds: Some(0.05),
                age_seconds: Some(1.0),
            }),
            gpu_blocks: 1,
            cpu_blocks: 1,
            disk_blocks: 1,
        };
        let request = ExplainRequest {
            body: b"{}".to_vec(),
            path: "/".into(),
            session_id: "s".into(),
            subset: vec!["a".into()],
        };
        let response = ExplainResponse {
            prompt_blocks: 1,
            load_blocks: 1,
            session_id: "s".into(),
            candidates: vec![candidate.clone()],
        };
        let cases = [
            ("Term", candidate.terms[0].encode_to_vec()),
            ("Candidate", candidate.encode_to_vec()),
            (
                "Prediction",
                candidate.prediction.clone().unwrap().encode_to_vec(),
            ),
            (
                "EngineLatency",
                candidate.engine.clone().unwrap().encode_to_vec(),
            ),
            ("ExplainRequest", request.encode_to_vec()),
            ("ExplainResponse", response.encode_to_vec()),
        ];
        for (name, bytes) in cases {
            assert_eq!(wire_fields(&bytes), proto_fields(name), "{name}");
        }
    }
}
