//! Where the endpoints come from: a file, an InferencePool, or a pod selector.

use std::path::PathBuf;

/// Where the endpoints come from: a file, an InferencePool, or a pod selector.
#[derive(Debug, Clone, clap::Args)]
pub struct DiscoveryFlags {
    /// Standalone mode: a YAML file of endpoints, reloaded when it changes.
    #[arg(long, env = "KVPICK_ENDPOINTS_FILE")]
    pub endpoints_file: Option<PathBuf>,

    /// Name of the InferencePool to serve (Kubernetes mode).
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
    #[arg(long, env = "KVPICK_ENDPOINT_SELECTOR")]
    pub endpoint_selector: Option<String>,

    /// With `--endpoint-selector`: the pods' serving ports, `port[,port...]`.
    #[arg(long, env = "KVPICK_ENDPOINT_TARGET_PORTS")]
    pub endpoint_target_ports: Option<String>,

    /// Kubeconfig file; default: in-cluster config, then `KUBECONFIG`, then `~/.kube/config`.
    #[arg(long, env = "KVPICK_KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
}

impl DiscoveryFlags {
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
