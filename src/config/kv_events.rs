//! Following the engines' KV events (precise prefix mode).

use clap::ArgAction;

use crate::kvevents::subscriber::SubscriberConfig;

/// Following the engines' KV events (precise prefix mode).
#[derive(Debug, Clone, clap::Args)]
pub struct KvEventFlags {
    /// Follow the workers' KV events (precise prefix mode) where engines publish them.
    #[arg(long, env = "KVPICK_KV_EVENTS", default_value_t = true,
          action = ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    pub kv_events: bool,

    /// Engine KV-event PUB port when a pod has no `kvpick.io/kv-events-port`
    /// annotation (data-parallel rank r publishes on port + r, as vLLM does).
    #[arg(long, env = "KVPICK_KV_EVENTS_PORT", default_value_t = 5557)]
    pub kv_events_port: u16,

    /// Engine KV-event replay (ROUTER) port, to recover missed batches after a
    /// sequence gap (rank-offset like the PUB port). Without it a gap resets the worker.
    #[arg(long, env = "KVPICK_KV_EVENTS_REPLAY_PORT")]
    pub kv_events_replay_port: Option<u16>,

    /// Model name that KV-event blocks are keyed under when the event topic
    /// (`kv@<pod>@<model>`) does not name one: the `model` clients send.
    #[arg(long, env = "KVPICK_KV_EVENTS_MODEL", default_value = "")]
    pub kv_events_model: String,

    /// Largest KV-event message accepted from an engine, all frames together; a
    /// publisher that declares a larger one is disconnected (and its worker reset).
    #[arg(long, env = "KVPICK_KV_EVENTS_MAX_MESSAGE_BYTES",
          default_value_t = crate::kvevents::subscriber::DEFAULT_MAX_MESSAGE_BYTES)]
    pub kv_events_max_message_bytes: usize,

    /// Bytes of KV-event batches queued for the ingest thread, all workers
    /// together (raised to one largest message if lower); past it the worker
    /// holding the most loses its queued batches and is reset.
    #[arg(long, env = "KVPICK_KV_EVENTS_MAX_QUEUED_BYTES",
          default_value_t = crate::kvevents::subscriber::DEFAULT_MAX_QUEUED_BYTES)]
    pub kv_events_max_queued_bytes: usize,
}

impl KvEventFlags {
    /// KV-event subscriber settings, or `None` when `--kv-events=false`.
    pub fn subscriber(&self) -> Option<SubscriberConfig> {
        self.kv_events.then(|| SubscriberConfig {
            port: self.kv_events_port,
            replay_port: self.kv_events_replay_port,
            model: self.kv_events_model.clone(),
            max_message_bytes: self.kv_events_max_message_bytes,
            max_queued_bytes: self.kv_events_max_queued_bytes,
            ..SubscriberConfig::default()
        })
    }
}
