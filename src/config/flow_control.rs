//! Admission: priority queues, shedding, saturation thresholds.

use std::time::Duration;

use clap::ArgAction;

use super::duration;
use crate::admission::{AdmissionConfig, SaturationConfig};

/// Admission: priority queues, shedding, saturation thresholds.
#[derive(Debug, Clone, clap::Args)]
pub struct FlowControlFlags {
    /// Flow control: under saturation, queue requests by priority (fair across
    /// flows, with a TTL) and shed sheddable ones with 429. Off by default, as the
    /// llm-d Router's `flowControl` feature gate.
    #[arg(long, env = "KVPICK_FLOW_CONTROL", default_value_t = false,
          action = ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    pub flow_control: bool,

    /// Priority of a request naming no known InferenceObjective and carrying no
    /// `nvext.agent_hints.priority` (negative: sheddable).
    #[arg(
        long,
        env = "KVPICK_DEFAULT_PRIORITY",
        default_value_t = 0,
        allow_hyphen_values = true
    )]
    pub default_priority: i32,

    /// InferenceObjective priorities without Kubernetes (standalone), or as a base
    /// the watched objectives override: `name=priority[,name=priority...]`.
    #[arg(long, env = "KVPICK_INFERENCE_OBJECTIVES", default_value = "")]
    pub inference_objectives: String,

    /// Watch the pool namespace's InferenceObjectives (`llm-d.ai/v1alpha2` and
    /// `inference.networking.x-k8s.io/v1alpha2`) in Kubernetes pool mode.
    #[arg(long, env = "KVPICK_WATCH_INFERENCE_OBJECTIVES", default_value_t = true,
          action = ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    pub watch_inference_objectives: bool,

    /// Flow control: longest a request waits in a queue, in ms (then 429).
    /// A bare number counts milliseconds; `250ms`, `2s` also work.
    #[arg(long, env = "KVPICK_FLOW_CONTROL_TTL_MS", default_value = "60000", value_parser = duration::millis)]
    pub flow_control_ttl_ms: Duration,

    /// Flow control: most requests queued in one priority band (then 429).
    #[arg(
        long,
        env = "KVPICK_FLOW_CONTROL_MAX_BAND_REQUESTS",
        default_value_t = 5000
    )]
    pub flow_control_max_band_requests: usize,

    /// Flow control: most body bytes queued in one priority band (then 429).
    #[arg(long, env = "KVPICK_FLOW_CONTROL_MAX_BAND_BYTES", default_value_t = 256 << 20)]
    pub flow_control_max_band_bytes: usize,

    /// Saturation: engine queue length at which a worker counts as full.
    #[arg(
        long,
        env = "KVPICK_FLOW_CONTROL_QUEUE_DEPTH_THRESHOLD",
        default_value_t = 5.0
    )]
    pub flow_control_queue_depth_threshold: f64,

    /// Saturation: KV-cache usage (0..1) at which a worker counts as full.
    #[arg(
        long,
        env = "KVPICK_FLOW_CONTROL_KV_CACHE_UTIL_THRESHOLD",
        default_value_t = 0.8
    )]
    pub flow_control_kv_cache_util_threshold: f64,

    /// Saturation: requests kvpick has in flight on one worker rank at which it
    /// counts as full (0: booked load left out).
    #[arg(
        long,
        env = "KVPICK_FLOW_CONTROL_MAX_IN_FLIGHT_PER_RANK",
        default_value_t = 100
    )]
    pub flow_control_max_in_flight_per_rank: u32,

    /// Flow control: how often (ms) saturation is re-read while requests wait.
    /// A bare number counts milliseconds; `250ms`, `2s` also work.
    #[arg(
        long,
        env = "KVPICK_FLOW_CONTROL_DISPATCH_INTERVAL_MS",
        default_value = "5", value_parser = duration::millis
    )]
    pub flow_control_dispatch_interval_ms: Duration,
}

impl FlowControlFlags {
    /// The admission settings these flags describe; load older than
    /// `metrics_staleness` does not count towards saturation.
    pub fn admission(&self, metrics_staleness: Duration) -> AdmissionConfig {
        AdmissionConfig {
            enabled: self.flow_control,
            default_priority: self.default_priority,
            ttl: self.flow_control_ttl_ms,
            max_band_requests: self.flow_control_max_band_requests,
            max_band_bytes: self.flow_control_max_band_bytes,
            dispatch_interval: self
                .flow_control_dispatch_interval_ms
                .max(Duration::from_millis(1)),
            saturation: SaturationConfig {
                queue_depth_threshold: self.flow_control_queue_depth_threshold,
                kv_cache_util_threshold: self.flow_control_kv_cache_util_threshold,
                max_in_flight_per_rank: self.flow_control_max_in_flight_per_rank,
                metrics_staleness,
            },
        }
    }
}
