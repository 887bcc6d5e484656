//! `test-apiserver`: a Kubernetes API server stand-in serving list and watch for
//! Pods and InferencePools from memory (see `e2e::apiserver`), seeded from a file.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use e2e::apiserver::{write_kubeconfig, ApiServer, Kind};

/// Serves Pods and InferencePools for kube clients, from a JSON seed file.
#[derive(Debug, Parser)]
#[command(name = "test-apiserver", version, about)]
struct Args {
    /// Listen address.
    #[arg(long, env = "TEST_APISERVER_LISTEN", default_value = "127.0.0.1:8001")]
    listen: SocketAddr,
    /// JSON file: {"pods": [Pod...], "inferencePools": [InferencePool...]}.
    #[arg(long, env = "TEST_APISERVER_SEED")]
    seed: Option<PathBuf>,
    /// Write a kubeconfig pointing at this server here.
    #[arg(long, env = "TEST_APISERVER_KUBECONFIG")]
    kubeconfig: Option<PathBuf>,
    /// Default namespace in the kubeconfig.
    #[arg(long, env = "TEST_APISERVER_NAMESPACE", default_value = "default")]
    namespace: String,
    /// Seconds between watch bookmarks.
    #[arg(long, env = "TEST_APISERVER_BOOKMARK_SECS", default_value_t = 5)]
    bookmark_secs: u64,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .init();
    let a = Args::parse();
    let server = ApiServer::start(a.listen, Duration::from_secs(a.bookmark_secs)).await?;
    if let Some(seed) = &a.seed {
        let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(seed)?)?;
        for (key, kind) in [("pods", Kind::Pod), ("inferencePools", Kind::InferencePool)] {
            for obj in v[key].as_array().into_iter().flatten() {
                server.state().apply(kind, obj.clone())?;
            }
        }
    }
    if let Some(path) = &a.kubeconfig {
        write_kubeconfig(path, &server.url(), &a.namespace)?;
    }
    println!("test-apiserver listening on {}", server.url());
    server.wait().await;
    Ok(())
}
