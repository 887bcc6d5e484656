//! Where the endpoint set comes from: a static file (standalone mode) or Kubernetes.

pub mod file;
