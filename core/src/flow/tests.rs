//! A request's flow driven event by event on a simulated clock, seen by a
//! recording observer.

use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::*;
use crate::admission::{AdmissionConfig, NoObserver};
use crate::endpoints::Endpoint;
use crate::scheduler::SchedulerConfig;

/// What an observer was told, in order.
#[derive(Debug, Clone, PartialEq)]
enum Seen {
    Routed(FlowId, Instant),
    FirstChunk(FlowId, Instant, usize),
    Chunk(FlowId, Instant, usize),
    Ended(FlowId, Instant, FlowEnd),
}

#[derive(Default)]
struct Recorder(Mutex<Vec<Seen>>);

impl FlowObserver for Recorder {
    fn routed(&self, flow: FlowId, _: &Decision, at: Instant) {
        self.0.lock().push(Seen::Routed(flow, at));
    }

    fn first_chunk(&self, flow: FlowId, _: &Decision, at: Instant, bytes: usize) {
        self.0.lock().push(Seen::FirstChunk(flow, at, bytes));
    }

    fn chunk(&self, flow: FlowId, _: &Decision, at: Instant, bytes: usize) {
        self.0.lock().push(Seen::Chunk(flow, at, bytes));
    }

    fn ended(&self, flow: FlowId, _: &Decision, at: Instant, end: FlowEnd) {
        self.0.lock().push(Seen::Ended(flow, at, end));
    }
}

impl Recorder {
    fn take(&self) -> Vec<Seen> {
        std::mem::take(&mut self.0.lock())
    }
}

/// Flows over a two-worker pool, admission off, seen by a recorder.
fn context() -> (Arc<FlowContext>, Arc<Recorder>) {
    let endpoints = Arc::new(EndpointTable::new());
    endpoints.replace(vec![
        Endpoint::new("10.0.0.1:8000".parse().unwrap()),
        Endpoint::new("10.0.0.2:8000".parse().unwrap()),
    ]);
    let scheduler = Arc::new(Scheduler::new(SchedulerConfig::default()));
    let pipeline = Pipeline::new(scheduler.config().prompt_limits(), None);
    let off = AdmissionConfig {
        enabled: false,
        ..AdmissionConfig::default()
    };
    let admission = Gate::new(off, Arc::default(), Arc::new(NoObserver));
    let recorder = Arc::new(Recorder::default());
    let ctx = FlowContext::new(endpoints, scheduler, pipeline, admission)
        .observed_by(Arc::clone(&recorder) as Arc<dyn FlowObserver>);
    (Arc::new(ctx), recorder)
}

fn head() -> RequestHead {
    let headers: &[(&str, &str)] = &[(":path", "/v1/completions")];
    RequestHead::read(headers, "x-session-id", "x-kvpick-session")
}

const BODY: &[u8] =
    br#"{"model":"m","prompt":"a prompt long enough to fill a block or two of bytes"}"#;

/// Requests in flight and blocks booked, over the whole pool.
fn load(ctx: &FlowContext) -> (u32, u64) {
    let snapshot = ctx.endpoints.snapshot();
    let in_flight = snapshot.endpoints.iter().map(|e| e.in_flight(0)).sum();
    let blocks = snapshot
        .endpoints
        .iter()
        .map(|e| e.active_load(0).blocks)
        .sum();
    (in_flight, blocks)
}

/// A flow with its headers at `t0` and its body routed at `t1`.
fn routed(ctx: &Arc<FlowContext>, t0: Instant, t1: Instant) -> RequestFlow {
    let mut flow = RequestFlow::new(Arc::clone(ctx));
    flow.request_headers(head(), t0);
    let step = flow.request_body(BODY.to_vec(), t1);
    assert!(matches!(step, Step::Routed(_)), "{step:?}");
    flow
}

#[test]
fn a_routed_request_is_observed_from_its_decision_to_its_end_on_the_flows_clock() {
    let (ctx, seen) = context();
    let t0 = Instant::now();
    let at = |ms: u64| t0 + Duration::from_millis(ms);
    let mut flow = routed(&ctx, t0, at(2));
    let id = flow.id;
    assert_eq!(seen.take(), [Seen::Routed(id, at(2))]);
    assert_eq!(load(&ctx).0, 1, "counted in flight once routed");
    assert!(load(&ctx).1 > 0, "its blocks are booked");

    let start = flow.response_headers(Some(200), true, at(40)).unwrap();
    assert!(!start.ejected);
    assert_eq!(start.headers, None, "no session, no token");
    flow.response_chunk(b"data: one\n\n", at(55));
    flow.response_chunk(b"", at(56));
    flow.response_chunk(b"data: two\n\n", at(70));
    let done = flow.finish(at(90)).unwrap();

    assert_eq!(done.took, Duration::from_millis(90));
    assert_eq!(done.tail.total(), 22);
    assert_eq!(
        seen.take(),
        [
            Seen::FirstChunk(id, at(55), 11),
            Seen::Chunk(id, at(70), 11),
            Seen::Ended(id, at(90), FlowEnd::Finished { status: Some(200) }),
        ]
    );
    assert_eq!(load(&ctx), (0, 0), "the end releases the request");
}

#[test]
fn every_event_is_reported_once_and_a_dropped_flow_is_cancelled() {
    let (ctx, seen) = context();
    let t0 = Instant::now();
    let at = |ms: u64| t0 + Duration::from_millis(ms);

    // Repeated response headers, two first-looking chunks, and both the
    // trailers and the end of the stream finishing the request.
    let mut flow = routed(&ctx, t0, at(1));
    let id = flow.id;
    assert!(flow.response_headers(Some(200), true, at(10)).is_some());
    assert!(flow.response_headers(Some(500), true, at(11)).is_none());
    flow.response_chunk(b"a", at(20));
    flow.response_chunk(b"b", at(21));
    assert!(flow.finish(at(30)).is_some());
    assert!(flow.finish(at(31)).is_none());
    flow.cancel(at(32));
    drop(flow);
    assert_eq!(
        seen.take(),
        [
            Seen::Routed(id, at(1)),
            Seen::FirstChunk(id, at(20), 1),
            Seen::Chunk(id, at(21), 1),
            Seen::Ended(id, at(30), FlowEnd::Finished { status: Some(200) }),
        ]
    );
    assert_eq!(load(&ctx), (0, 0));

    // A stream that goes away mid-response: cancelled, once, and released.
    let mut flow = routed(&ctx, t0, at(40));
    let dropped = flow.id;
    assert_ne!(dropped, id);
    flow.response_chunk(b"partial", at(50));
    drop(flow);
    let seen = seen.take();
    assert_eq!(seen.len(), 3, "{seen:?}");
    assert!(matches!(
        seen[2],
        Seen::Ended(f, _, FlowEnd::Cancelled) if f == dropped
    ));
    assert_eq!(load(&ctx), (0, 0), "a dropped flow leaves nothing booked");
}

#[test]
fn a_body_after_a_decision_on_the_headers_replaces_it_and_counts_once() {
    let (ctx, seen) = context();
    let t0 = Instant::now();
    let at = |ms: u64| t0 + Duration::from_millis(ms);
    let mut flow = RequestFlow::new(Arc::clone(&ctx));
    flow.request_headers(head(), t0);
    let Step::Routed(first) = flow.route_on_headers(at(200)) else {
        panic!("not routed on its headers");
    };
    assert!(!first.replaced);
    let Step::Routed(second) = flow.request_body(BODY.to_vec(), at(300)) else {
        panic!("the body was not routed");
    };
    assert!(second.replaced);
    let (in_flight, booked) = load(&ctx);
    assert_eq!(in_flight, 1, "one request in flight, not two");
    assert_eq!(booked, flow.decision().unwrap().decode_load().blocks);
    flow.finish(at(400));
    let id = flow.id;
    assert_eq!(
        seen.take(),
        [
            Seen::Routed(id, at(200)),
            Seen::Routed(id, at(300)),
            Seen::Ended(id, at(400), FlowEnd::Finished { status: None }),
        ]
    );
    assert_eq!(load(&ctx), (0, 0));
}

#[test]
fn a_request_that_is_never_routed_reports_nothing_and_books_nothing() {
    let (ctx, seen) = context();
    let now = Instant::now();
    let mut flow = RequestFlow::new(Arc::clone(&ctx));
    flow.request_headers(head(), now);
    let step = flow.request_body(b"{\"model\":".to_vec(), now);
    assert!(matches!(step, Step::Refused(Refusal::BadRequest(_))));
    assert!(flow.response_headers(Some(200), true, now).is_none());
    flow.response_chunk(b"x", now);
    assert!(flow.finish(now).is_none());
    drop(flow);

    ctx.endpoints.replace(Vec::new());
    let mut flow = RequestFlow::new(Arc::clone(&ctx));
    flow.request_headers(head(), now);
    let step = flow.request_body(BODY.to_vec(), now);
    assert!(matches!(step, Step::Refused(Refusal::NoEndpoint(_))));
    drop(flow);
    assert_eq!(seen.take(), []);
}

/// Flows over a two-worker pool in predicted mode, the learner observing.
fn learning() -> (Arc<FlowContext>, Arc<crate::latency::Learner>) {
    let endpoints = Arc::new(EndpointTable::new());
    endpoints.replace(vec![
        Endpoint::new("10.0.0.1:8000".parse().unwrap()),
        Endpoint::new("10.0.0.2:8000".parse().unwrap()),
    ]);
    let scheduler = Arc::new(Scheduler::new(SchedulerConfig {
        scoring: crate::scheduler::ScoringMode::Predicted,
        ..SchedulerConfig::default()
    }));
    let learner = Arc::clone(scheduler.latency().unwrap());
    let pipeline = Pipeline::new(scheduler.config().prompt_limits(), None);
    let off = AdmissionConfig {
        enabled: false,
        ..AdmissionConfig::default()
    };
    let admission = Gate::new(off, Arc::default(), Arc::new(NoObserver));
    let ctx = FlowContext::new(endpoints, scheduler, pipeline, admission)
        .observed_by(Arc::clone(&learner) as Arc<dyn FlowObserver>);
    (Arc::new(ctx), learner)
}

#[test]
fn the_learner_learns_streamed_requests_through_the_flow_and_forgets_every_ended_one() {
    let (ctx, learner) = learning();
    let t0 = Instant::now();
    let ms = |n: u64| t0 + Duration::from_millis(n);
    let streamed = br#"{"model":"m","stream":true,"prompt":"a prompt long enough to fill a block or two of bytes"}"#;
    let mut flow = RequestFlow::new(Arc::clone(&ctx));
    flow.request_headers(head(), t0);
    assert!(matches!(
        flow.request_body(streamed.to_vec(), t0),
        Step::Routed(_)
    ));
    assert!(flow.decision().unwrap().latency_features.is_some());
    assert_eq!(learner.following(), 1);
    flow.response_headers(Some(200), true, ms(40));
    flow.response_chunk(b"data: a", ms(50));
    flow.response_chunk(b"data: b", ms(60));
    flow.finish(ms(70));
    assert_eq!(learner.following(), 0);
    assert_eq!(learner.workers(), 1, "one streamed request learned");

    // Not streamed: followed by nobody, learned from by nobody.
    let mut flow = RequestFlow::new(Arc::clone(&ctx));
    flow.request_headers(head(), t0);
    assert!(matches!(
        flow.request_body(BODY.to_vec(), t0),
        Step::Routed(_)
    ));
    assert!(flow.decision().unwrap().latency_features.is_none());
    assert_eq!(learner.following(), 0);
    flow.response_chunk(b"{}", ms(50));
    flow.finish(ms(60));

    // Streamed, then cancelled before any chunk: followed until its end, no lesson.
    let mut flow = RequestFlow::new(Arc::clone(&ctx));
    flow.request_headers(head(), t0);
    flow.request_body(streamed.to_vec(), t0);
    assert_eq!(learner.following(), 1);
    drop(flow);
    assert_eq!(learner.following(), 0);
    let learned: u64 = learner.errors().0.iter().map(|(_, c)| c).sum();
    assert_eq!(learned, 0, "a cold prior predicts nothing to score");
    assert_eq!(learner.fallbacks(), 3);
}

#[test]
fn the_learner_learns_a_ttft_at_the_first_chunk_and_nothing_from_an_error_body() {
    let (ctx, learner) = learning();
    let t0 = Instant::now();
    let ms = |n: u64| t0 + Duration::from_millis(n);
    let streamed = br#"{"model":"m","stream":true,"prompt":"a prompt long enough to fill a block or two of bytes"}"#;
    let routed = || {
        let mut flow = RequestFlow::new(Arc::clone(&ctx));
        flow.request_headers(head(), t0);
        flow.request_body(streamed.to_vec(), t0);
        flow
    };
    // A failing upstream's error body is no first token.
    let mut failed = routed();
    failed.response_headers(Some(503), true, ms(5));
    failed.response_chunk(b"{\"error\":\"overloaded\"}", ms(6));
    failed.finish(ms(7));
    assert_eq!(learner.workers(), 0, "an error teaches nothing");
    // Served: its TTFT is known at the first chunk, long before its end.
    let mut flow = routed();
    flow.response_headers(Some(200), true, ms(40));
    flow.response_chunk(b"data: a", ms(50));
    assert_eq!(learner.workers(), 1, "learned at the first chunk");
    assert_eq!(learner.following(), 1, "still followed for its decode pace");
    flow.response_chunk(b"data: b", ms(60));
    flow.finish(ms(70));
    assert_eq!(learner.following(), 0);
}

#[test]
fn a_sheddable_request_no_warm_worker_can_serve_in_time_is_shed_and_books_nothing() {
    let (ctx, learner) = learning();
    // Both workers warm, each predicted at 0.5 s to first token.
    let mut slow = crate::latency::WorkerModel::new([0.5, 0.0, 0.0, 0.0, 0.0, 0.0], [0.01; 4], 1.0)
        .to_snapshot();
    slow.observations = 100;
    learner.restore_prior(&slow).unwrap();
    for ep in &ctx.endpoints.snapshot().endpoints {
        learner.restore(ep.key(0), &slow).unwrap();
    }
    let t0 = Instant::now();
    let with_slo = |ttft_ms: &'static str| {
        let headers: &[(&str, &str)] = &[(":path", "/v1/completions"), ("x-slo-ttft-ms", ttft_ms)];
        RequestHead::read(headers, "x-session-id", "x-kvpick-session")
    };
    let sheddable = br#"{"model":"m","prompt":"a prompt long enough to fill a block or two of bytes","nvext":{"agent_hints":{"priority":-1}}}"#;

    let mut flow = RequestFlow::new(Arc::clone(&ctx));
    flow.request_headers(with_slo("100"), t0);
    assert!(matches!(
        flow.request_body(sheddable.to_vec(), t0),
        Step::Refused(Refusal::Shed(Rejection::SloUnreachable))
    ));
    assert_eq!(load(&ctx), (0, 0), "a shed request books nothing");
    assert_eq!(learner.slo_sheds(), 1);

    // Met somewhere, or not sheddable: routed.
    let mut flow = RequestFlow::new(Arc::clone(&ctx));
    flow.request_headers(with_slo("900"), t0);
    assert!(matches!(
        flow.request_body(sheddable.to_vec(), t0),
        Step::Routed(_)
    ));
    let mut flow = RequestFlow::new(Arc::clone(&ctx));
    flow.request_headers(with_slo("100"), t0);
    assert!(matches!(
        flow.request_body(BODY.to_vec(), t0),
        Step::Routed(_)
    ));
    assert_eq!(learner.slo_sheds(), 1);
}
