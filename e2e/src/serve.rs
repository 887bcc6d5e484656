//! Serving an axum router on a listener so that stopping it also cuts every open
//! connection (a killed process does that; `axum::serve` would keep them alive).

use std::net::SocketAddr;

use axum::Router;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::task::{JoinHandle, JoinSet};
use tower::ServiceExt;

/// A running server; dropping it (or [`Server::stop`]) closes the listener and every connection.
pub struct Server {
    addr: SocketAddr,
    task: JoinHandle<()>,
}

impl Server {
    /// Serves `router` on `listener` (HTTP/1.1).
    pub fn start(listener: TcpListener, router: Router) -> Server {
        let addr = listener
            .local_addr()
            .expect("a bound listener has an address");
        let task = tokio::spawn(async move {
            let mut conns = JoinSet::new();
            loop {
                tokio::select! {
                    accepted = listener.accept() => {
                        let Ok((stream, _)) = accepted else { continue };
                        let _ = stream.set_nodelay(true);
                        let router = router.clone();
                        conns.spawn(async move {
                            let service = hyper::service::service_fn(move |req| {
                                router.clone().oneshot(req)
                            });
                            let _ = hyper::server::conn::http1::Builder::new()
                                .serve_connection(TokioIo::new(stream), service)
                                .await;
                        });
                    }
                    Some(_) = conns.join_next(), if !conns.is_empty() => {}
                }
            }
        });
        Server { addr, task }
    }

    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops accepting and drops every open connection.
    pub fn stop(&self) {
        self.task.abort();
    }

    /// Waits until the server stops (it only stops when aborted).
    pub async fn wait(mut self) {
        let _ = (&mut self.task).await;
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A task aborted when this is dropped.
pub struct AbortOnDrop(pub JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// An HTTP client connector with `TCP_NODELAY` (without it, small requests wait
/// on Nagle's algorithm and delayed ACKs).
pub fn nodelay_connector() -> hyper_util::client::legacy::connect::HttpConnector {
    let mut c = hyper_util::client::legacy::connect::HttpConnector::new();
    c.set_nodelay(true);
    c
}
