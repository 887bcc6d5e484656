//! The inference engine a worker runs: it selects the metric names a scrape
//! reads and the KV-event format a worker publishes.

use serde::Deserialize;

/// The inference engine a worker runs; selects metric names when scraping.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Engine {
    /// vLLM (the default).
    #[default]
    Vllm,
    /// SGLang.
    Sglang,
    /// TensorRT-LLM's `trtllm-serve`.
    Trtllm,
}

impl Engine {
    /// Parses an `inference.networking.k8s.io/engine-type` value; unknown values are `None`.
    pub fn parse(s: &str) -> Option<Engine> {
        match s.trim().to_ascii_lowercase().as_str() {
            "vllm" | "" => Some(Engine::Vllm),
            "sglang" => Some(Engine::Sglang),
            "trtllm" | "trt-llm" | "tensorrt-llm" => Some(Engine::Trtllm),
            _ => None,
        }
    }
}
