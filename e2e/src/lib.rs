//! kvpick's end-to-end suite: a mock vLLM worker with its sidecar, an
//! Envoy-behaving test gateway, a test Kubernetes API server, and helpers that
//! start the whole stack in-process for tests and the demo.

pub mod apiserver;
pub mod bench;
pub mod client;
pub mod gateway;
pub mod kv_events;
pub mod kvcache;
pub mod mock_vision;
pub mod mock_worker;
pub mod otlp;
pub mod replicas;
pub mod report;
pub mod serve;
pub mod served;
pub mod stack;
pub mod tokenizer;
pub mod workload;
