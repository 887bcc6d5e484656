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
use e2e::bench::overhead::{self, ServerKind};
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
    let mut servers = Vec::new();
    let mut ports = Vec::new();
    for (name, kind) in [
        ("noop", ServerKind::Noop),
        ("kvpick", ServerKind::kvpick(64)),
    ] {
        let l = rt.block_on(TcpListener::bind("127.0.0.1:0")).unwrap();
        ports.push((name, l.local_addr().unwrap().port()));
        servers.push(rt.spawn(overhead::serve(kind, l)));
    }
    let body = overhead::chat_body(32 * 1024, 0);
    let mut group = c.benchmark_group("ext_proc_32k_chat");
    group.throughput(Throughput::Elements(1));
    group.measurement_time(Duration::from_secs(5));
    for (name, port) in ports {
        let ch = rt.block_on(connect(port));
        group.bench_function(name, |b| {
            b.to_async(&rt)
                .iter(|| async { overhead::one_request(&ch, &body).await.unwrap() })
        });
    }
    group.finish();
    for s in servers {
        s.abort();
    }
}

criterion_group!(benches, ext_proc_overhead);
criterion_main!(benches);
