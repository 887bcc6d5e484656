//! Per-request overhead of a full chat request through kvpick's ext_proc server
//! over loopback gRPC, next to the no-op ext_proc server (same tonic stack) in the
//! same run.
//!
//! Each iteration is one Envoy-style FULL_DUPLEX_STREAMED request
//! ([`e2e::bench::overhead::one_request`]): request headers, a 32 KB chat body, the
//! held headers answer, the body streamed back, and the response path to its end.
//! The no-op server answers a fixed endpoint and does no parsing or scheduling, so
//! the ratio between the two is kvpick's own cost.

use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use e2e::bench::{noop, overhead};
use kvpick::endpoints::Endpoint;
use kvpick::extproc::ExtProcConfig;
use kvpick::server::{serve_ext_proc, App};
use tokio::net::TcpListener;
use tokio::runtime::Runtime;
use tonic::transport::Channel;

async fn connect(port: u16) -> Channel {
    Channel::from_shared(format!("http://127.0.0.1:{port}"))
        .unwrap()
        .connect()
        .await
        .unwrap()
}

fn ext_proc_overhead(c: &mut Criterion) {
    let rt = Runtime::new().unwrap();
    let (kv_port, noop_port) = rt.block_on(async {
        let app = App::new("bench");
        app.endpoints.replace(
            (0..64)
                .map(|i| Endpoint::new(format!("10.0.0.{}:8000", i + 1).parse().unwrap()))
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
        tokio::spawn(noop::serve(l));
        (kv_port, noop_port)
    });
    let body = overhead::chat_body(32 * 1024, 0);
    let mut group = c.benchmark_group("ext_proc_32k_chat");
    group.throughput(Throughput::Elements(1));
    group.measurement_time(Duration::from_secs(5));
    for (name, port) in [("noop", noop_port), ("kvpick", kv_port)] {
        let ch = rt.block_on(connect(port));
        group.bench_function(name, |b| {
            b.to_async(&rt)
                .iter(|| async { overhead::one_request(&ch, &body).await.unwrap() })
        });
    }
    group.finish();
}

criterion_group!(benches, ext_proc_overhead);
criterion_main!(benches);
