//! Standalone discovery: a YAML file of endpoints, reloaded when it changes.
//!
//! ```yaml
//! endpoints:
//!   - address: 127.0.0.1:8001   # ip:port, required
//!     instance_id: 7001         # optional; default: stable hash of the address
//!     dp_size: 2                # optional, 1-1024, default 1
//!     role: both                # prefill | decode | both (default)
//!     engine: vllm              # vllm (default) | sglang | trtllm
//!     kv_events_port: 5557      # optional
//!     bootstrap_port: 8998      # optional (SGLang disaggregation)
//! ```

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;
use tracing::{info, warn};

use crate::endpoints::{Endpoint, EndpointTable, Engine, Role, MAX_DP_SIZE};
use crate::error_chain::ErrorChain;

/// Why an endpoints file could not be used.
#[derive(Debug, thiserror::Error)]
pub enum FileError {
    /// The file could not be read.
    #[error("cannot read {path}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The YAML is malformed or has a bad value.
    #[error("invalid endpoints file {path}: {message}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileSpec {
    #[serde(default)]
    endpoints: Vec<EndpointSpec>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct EndpointSpec {
    address: SocketAddr,
    #[serde(default)]
    instance_id: Option<u64>,
    #[serde(default)]
    dp_size: Option<u32>,
    #[serde(default)]
    role: Role,
    #[serde(default)]
    engine: Engine,
    #[serde(default)]
    kv_events_port: Option<u16>,
    #[serde(default)]
    bootstrap_port: Option<u16>,
}

/// Parses endpoints-file YAML.
pub fn parse(text: &str) -> Result<Vec<Endpoint>, String> {
    let spec: FileSpec = serde_yaml::from_str(text).map_err(|e| e.to_string())?;
    let mut out = Vec::with_capacity(spec.endpoints.len());
    let mut ids = HashMap::with_capacity(spec.endpoints.len());
    for (i, e) in spec.endpoints.into_iter().enumerate() {
        let dp_size = e.dp_size.unwrap_or(1);
        if !(1..=MAX_DP_SIZE).contains(&dp_size) {
            return Err(format!(
                "endpoints[{i}].dp_size must be between 1 and {MAX_DP_SIZE}, got {dp_size}"
            ));
        }
        let mut ep = Endpoint::new(e.address);
        if let Some(id) = e.instance_id {
            ep.instance_id = id;
        }
        ep.dp_size = dp_size;
        ep.role = e.role;
        ep.engine = e.engine;
        ep.kv_events_port = e.kv_events_port;
        ep.bootstrap_port = e.bootstrap_port;
        // One id, one worker: two would share a KV index, a load and sessions.
        if let Some(j) = ids.insert(ep.instance_id, i) {
            return Err(format!(
                "endpoints[{i}] has instance_id {}, as endpoints[{j}] has (ids default to a hash of the address)",
                ep.instance_id
            ));
        }
        out.push(ep);
    }
    Ok(out)
}

/// Reads and parses an endpoints file.
pub fn load(path: &Path) -> Result<Vec<Endpoint>, FileError> {
    let text = std::fs::read_to_string(path).map_err(|source| FileError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    parse(&text).map_err(|message| FileError::Invalid {
        path: path.to_path_buf(),
        message,
    })
}

/// Loads `path` into `table` now (an error here is fatal), then polls it every
/// `interval` and applies changes; a broken edit keeps the last good set.
pub async fn watch(
    path: PathBuf,
    table: Arc<EndpointTable>,
    interval: Duration,
) -> Result<(), FileError> {
    let first = load(&path)?;
    info!(path = %path.display(), endpoints = first.len(), "loaded endpoints file");
    table.replace(first);
    let mut last = std::fs::read(&path).ok();
    let mut tick = tokio::time::interval(interval);
    loop {
        tick.tick().await;
        let now = std::fs::read(&path).ok();
        if now == last {
            continue;
        }
        last = now;
        match load(&path) {
            Ok(eps) => {
                info!(endpoints = eps.len(), "endpoints file changed; reloaded");
                table.replace(eps);
            }
            Err(e) => {
                warn!(error = %ErrorChain(&e), "endpoints file changed but is invalid; keeping the last set")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_all_fields_and_defaults() {
        let eps = parse(
            "endpoints:\n  - address: 127.0.0.1:8001\n    instance_id: 7001\n    dp_size: 2\n    role: prefill\n    bootstrap_port: 8998\n  - address: 127.0.0.1:8002\n",
        )
        .unwrap();
        assert_eq!(eps.len(), 2);
        assert_eq!(eps[0].instance_id, 7001);
        assert_eq!(eps[0].dp_size, 2);
        assert_eq!(eps[0].role, Role::Prefill);
        assert_eq!(eps[0].bootstrap_port, Some(8998));
        assert_eq!(eps[1].role, Role::Both);
        assert_eq!(
            eps[1].instance_id,
            crate::identity::instance_id_for("127.0.0.1:8002")
        );
    }

    #[test]
    fn rejects_bad_values() {
        assert!(parse("endpoints:\n  - address: nope\n").is_err());
        assert!(parse("endpoints:\n  - address: 1.2.3.4:1\n    dp_size: 0\n").is_err());
        // A huge dp_size would allocate per rank: refused, like the pod annotation.
        let huge = parse("endpoints:\n  - address: 1.2.3.4:1\n    dp_size: 4294967295\n");
        assert!(huge.unwrap_err().contains("between 1 and 1024"));
        assert_eq!(
            parse("endpoints:\n  - address: 1.2.3.4:1\n    dp_size: 1024\n").unwrap()[0].dp_size,
            1024
        );
        assert!(parse("endpoints:\n  - address: 1.2.3.4:1\n    colour: red\n").is_err());
    }

    #[test]
    fn rejects_duplicate_instance_ids() {
        let twice = "endpoints:\n  - address: 1.2.3.4:1\n    instance_id: 7\n  - address: 1.2.3.4:2\n    instance_id: 7\n";
        let err = parse(twice).unwrap_err();
        assert!(
            err.contains("endpoints[1] has instance_id 7, as endpoints[0]"),
            "{err}"
        );
        // The same address twice is the same default id.
        assert!(parse("endpoints:\n  - address: 1.2.3.4:1\n  - address: 1.2.3.4:1\n").is_err());
        let distinct =
            "endpoints:\n  - address: 1.2.3.4:1\n    instance_id: 7\n  - address: 1.2.3.4:2\n";
        assert_eq!(parse(distinct).unwrap().len(), 2);
    }

    #[tokio::test]
    async fn reloads_on_change_and_keeps_last_good_set() {
        let dir = std::env::temp_dir().join(format!("kvpick-file-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("endpoints.yaml");
        std::fs::write(&path, "endpoints:\n  - address: 127.0.0.1:8001\n").unwrap();
        let table = Arc::new(EndpointTable::new());
        let task = tokio::spawn(watch(
            path.clone(),
            Arc::clone(&table),
            Duration::from_millis(10),
        ));
        let wait_for = |n: usize| {
            let table = Arc::clone(&table);
            async move {
                for _ in 0..500 {
                    if table.is_synced() && table.snapshot().endpoints.len() == n {
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                panic!("endpoint count never became {n}");
            }
        };
        wait_for(1).await;
        std::fs::write(
            &path,
            "endpoints:\n  - address: 127.0.0.1:8001\n  - address: 127.0.0.1:8002\n",
        )
        .unwrap();
        wait_for(2).await;
        std::fs::write(&path, "endpoints: [").unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(table.snapshot().endpoints.len(), 2);
        task.abort();
        let _ = std::fs::remove_dir_all(&dir);
    }
}
