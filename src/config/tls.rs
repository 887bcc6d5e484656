//! TLS of the ext_proc port: certificates, client CAs, reloads.

use std::path::PathBuf;
use std::time::Duration;

use clap::ArgAction;

use super::duration;

/// TLS of the ext_proc port: certificates, client CAs, reloads.
#[derive(Debug, Clone, clap::Args)]
pub struct TlsFlags {
    /// Serve ext_proc over TLS (`--secure-serving=false` for plaintext).
    #[arg(long, env = "KVPICK_SECURE_SERVING", default_value_t = true,
          action = ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    pub secure_serving: bool,

    /// PEM file of CA certificates: when set, ext_proc clients must present a
    /// certificate signed by one of them (mutual TLS), others are refused.
    #[arg(long, env = "KVPICK_CLIENT_CA_PATH")]
    pub client_ca_path: Option<PathBuf>,

    /// Directory with `tls.crt` and `tls.key`; without it a self-signed
    /// certificate is made at start-up.
    #[arg(long, env = "KVPICK_CERT_PATH")]
    pub cert_path: Option<PathBuf>,

    /// Reload `tls.crt`/`tls.key` (and `--client-ca-path`) when they change:
    /// new handshakes get the new certificate, open connections keep theirs;
    /// an invalid or half-written set is refused with a warning.
    #[arg(long, env = "KVPICK_ENABLE_CERT_RELOAD", default_value_t = false,
          action = ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    pub enable_cert_reload: bool,

    /// With `--enable-cert-reload`: how often the certificate files are read
    /// for changes (ms).
    /// A bare number counts milliseconds; `250ms`, `2s` also work.
    #[arg(long, env = "KVPICK_CERT_RELOAD_INTERVAL_MS", default_value = "5000", value_parser = duration::positive_millis)]
    pub cert_reload_interval_ms: Duration,

    /// Longest a client may take to finish its TLS handshake on the ext_proc
    /// port (ms); handshakes run concurrently.
    /// A bare number counts milliseconds; `250ms`, `2s` also work.
    #[arg(long, env = "KVPICK_TLS_HANDSHAKE_TIMEOUT_MS", default_value = "10000", value_parser = duration::positive_millis)]
    pub tls_handshake_timeout_ms: Duration,
}

impl TlsFlags {
    /// How often to look for changed certificate files, if at all.
    pub fn cert_reload_interval(&self) -> Option<Duration> {
        self.enable_cert_reload
            .then_some(self.cert_reload_interval_ms)
    }
}
