//! Where the endpoint set comes from: a static file (standalone mode) or Kubernetes
//! (an InferencePool and its Pods, or a plain label selector).

pub mod file;
pub mod kube;
pub mod objective;
pub mod pods;
pub mod pool;
