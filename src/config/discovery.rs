//! Where the endpoints come from: a file, an InferencePool, or a pod selector;
//! and the pool's name, which keys its replicas' shared state, labels its
//! metrics and appears in its logs.

use std::path::PathBuf;

/// The pool's name in standalone mode when `--pool-name` is not given: the
/// same on every replica, however its endpoints file's path is spelled.
pub const DEFAULT_STANDALONE_POOL: &str = "standalone";

/// Where the endpoints come from: a file, an InferencePool, or a pod selector.
#[derive(Debug, Clone, clap::Args)]
pub struct DiscoveryFlags {
    /// Standalone mode: a YAML file of endpoints, reloaded when it changes.
    /// The pool is named by `--pool-name`, not by the file's path.
    #[arg(long, env = "KVPICK_ENDPOINTS_FILE")]
    pub endpoints_file: Option<PathBuf>,

    /// Name of the InferencePool to serve (Kubernetes mode). With
    /// `--endpoints-file`, the pool's name only (default `standalone`):
    /// replicas on one `--replica-sync` server with the same name share their
    /// routing state. It also labels the pool's metrics.
    #[arg(long, env = "KVPICK_POOL_NAME")]
    pub pool_name: Option<String>,

    /// Namespace of the pool (or of the selected pods); when unset or `default`,
    /// the `NAMESPACE` environment variable, then `default`.
    #[arg(long, env = "KVPICK_POOL_NAMESPACE")]
    pub pool_namespace: Option<String>,

    /// API group of the InferencePool: `inference.networking.k8s.io` (v1) or
    /// `inference.networking.x-k8s.io` (v1alpha2).
    #[arg(
        long,
        env = "KVPICK_POOL_GROUP",
        default_value = crate::discovery::pool::GROUP_V1
    )]
    pub pool_group: String,

    /// Without an InferencePool: select pods by `key=value[,key=value...]`.
    #[arg(long, env = "KVPICK_ENDPOINT_SELECTOR", conflicts_with_all = ["endpoints_file", "pool_name"])]
    pub endpoint_selector: Option<String>,

    /// With `--endpoint-selector`: the pods' serving ports, `port[,port...]`.
    #[arg(long, env = "KVPICK_ENDPOINT_TARGET_PORTS")]
    pub endpoint_target_ports: Option<String>,

    /// Kubeconfig file; default: in-cluster config, then `KUBECONFIG`, then `~/.kube/config`.
    #[arg(long, env = "KVPICK_KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
}

impl DiscoveryFlags {
    /// The pool's name: `--pool-name` when given (trimmed, not empty); else in
    /// standalone mode [`DEFAULT_STANDALONE_POOL`], with a selector the
    /// selector as given.
    pub fn pool(&self) -> String {
        let given = |s: &Option<String>| {
            s.as_deref()
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(str::to_string)
        };
        given(&self.pool_name)
            .or_else(|| {
                self.endpoints_file
                    .as_ref()
                    .map(|_| DEFAULT_STANDALONE_POOL.to_string())
            })
            .or_else(|| given(&self.endpoint_selector))
            .unwrap_or_default()
    }

    /// The namespace to watch (see [`resolve_namespace`]).
    pub fn namespace(&self) -> String {
        let env = std::env::var("NAMESPACE").ok();
        resolve_namespace(self.pool_namespace.as_deref(), env.as_deref())
    }
}

/// The pool namespace as the GIE EPP resolves it: the flag unless unset or
/// `default`, then the `NAMESPACE` environment variable, then `default`.
pub fn resolve_namespace(flag: Option<&str>, env_namespace: Option<&str>) -> String {
    let flag = flag.map(str::trim).filter(|s| !s.is_empty());
    match (flag, env_namespace.map(str::trim).filter(|s| !s.is_empty())) {
        (Some(f), _) if f != "default" => f.to_string(),
        (_, Some(env)) => env.to_string(),
        (f, None) => f.unwrap_or("default").to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn pool(argv: &[&str]) -> String {
        let args = crate::config::Args::try_parse_from(
            std::iter::once("kvpick").chain(argv.iter().copied()),
        );
        args.unwrap().discovery.pool()
    }

    #[test]
    fn the_pool_is_named_by_the_flag_never_by_the_files_path() {
        for path in ["e.yaml", "./e.yaml", "/etc/kvpick/e.yaml"] {
            assert_eq!(pool(&["--endpoints-file", path]), DEFAULT_STANDALONE_POOL);
            assert_eq!(
                pool(&["--endpoints-file", path, "--pool-name", " chat "]),
                "chat"
            );
        }
        assert_eq!(
            pool(&["--endpoints-file", "e.yaml", "--pool-name", ""]),
            DEFAULT_STANDALONE_POOL
        );
        assert_eq!(
            pool(&["--pool-name", "llama", "--pool-namespace", "team"]),
            "llama"
        );
        assert_eq!(pool(&["--endpoint-selector", "app=x"]), "app=x");
    }

    #[test]
    fn namespace_resolution_follows_gie() {
        assert_eq!(resolve_namespace(Some("team"), Some("other")), "team");
        assert_eq!(resolve_namespace(None, Some("other")), "other");
        assert_eq!(resolve_namespace(Some("default"), Some("other")), "other");
        assert_eq!(resolve_namespace(Some("default"), None), "default");
        assert_eq!(resolve_namespace(None, None), "default");
        assert_eq!(resolve_namespace(Some(""), Some(" ")), "default");
    }
}
