//! TLS for the ext_proc port: a certificate from `--cert-path`, or a self-signed
//! one made at start-up (as the GIE EPP does with `--secure-serving`); with
//! `--client-ca-path`, mutual TLS: clients must present a certificate that chains
//! to one of that file's CAs, and the handshake fails for any other.
//!
//! Each handshake takes the rustls config current at that moment from an
//! [`ArcSwap`]. With `--enable-cert-reload`, [`ServerTls::watch`] reads the
//! files again every interval: a changed set that parses, whose key matches its
//! certificate and whose CA bundle holds a CA, replaces that config for new
//! handshakes (open connections keep the one they were made with); anything
//! else (a half-written pair, garbage, a missing file) is refused with a
//! warning and the current config stays.

use std::convert::Infallible;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use futures::Stream;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::MetricType;
use sha2::{Digest, Sha256};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;
use tokio_rustls::rustls::pki_types::pem::{self, PemObject};
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::server::{VerifierBuilderError, WebPkiClientVerifier};
use tokio_rustls::rustls::{self, RootCertStore, ServerConfig};
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;
use tracing::{debug, info, warn};

use crate::error_chain::ErrorChain;
use crate::telemetry::Metrics;

/// Why TLS could not be set up, or why changed files were not taken.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// The certificate directory lacks `tls.crt` or `tls.key`.
    #[error("cannot read {file}")]
    Read {
        /// The missing or unreadable file.
        file: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A file is not the PEM it should be (no certificate, no private key).
    #[error("{file} is not valid PEM")]
    Pem {
        /// The file.
        file: String,
        /// What the PEM parser found wrong.
        source: pem::Error,
    },
    /// rustls refused the certificate and key (a key that does not match the
    /// certificate, as when a rotation has written one file but not the other).
    #[error("{cert} with {key} is not a usable certificate and key")]
    Identity {
        /// The certificate file.
        cert: String,
        /// The key file.
        key: String,
        /// rustls' reason.
        source: rustls::Error,
    },
    /// The client CA bundle holds no usable CA.
    #[error("{file} is not a usable client CA bundle")]
    ClientCa {
        /// The file.
        file: String,
        /// rustls' reason.
        source: VerifierBuilderError,
    },
    /// Generating the self-signed certificate failed.
    #[error("cannot generate a self-signed certificate")]
    Generate(#[from] rcgen::Error),
    /// `--client-ca-path` was given with `--secure-serving=false`.
    #[error("--client-ca-path needs TLS: it cannot be used with --secure-serving=false")]
    ClientCaWithoutTls,
}

/// The handshakes one listener runs at once; past this, accepting waits.
const MAX_PENDING_HANDSHAKES: usize = 1024;

/// How long accepting pauses after the listener fails (out of descriptors).
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(50);

/// The bound on one TLS handshake unless [`ServerTls::handshake_timeout`] sets another.
const DEFAULT_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// The ext_proc port's TLS: the rustls config new handshakes use, and where it
/// is reloaded from.
#[derive(Debug, Clone)]
pub struct ServerTls {
    current: Arc<ArcSwap<ServerConfig>>,
    source: Arc<Source>,
    reload_every: Option<Duration>,
    handshake_timeout: Duration,
    stats: Arc<ReloadStats>,
}

/// The ext_proc port's TLS, or `None` for plaintext: the certificate in
/// `cert_dir` (else a self-signed one) and, with `client_ca`, client
/// certificates required and verified against that PEM bundle.
pub fn ext_proc(
    secure: bool,
    cert_dir: Option<&Path>,
    client_ca: Option<&Path>,
) -> Result<Option<ServerTls>, TlsError> {
    if !secure {
        return match client_ca {
            Some(_) => Err(TlsError::ClientCaWithoutTls),
            None => Ok(None),
        };
    }
    let identity = match cert_dir {
        Some(dir) => Identity::Files {
            cert: dir.join("tls.crt"),
            key: dir.join("tls.key"),
        },
        None => {
            let (cert, key) = generate(&["localhost"])?;
            Identity::SelfSigned { cert, key }
        }
    };
    ServerTls::load(Source::new(identity, client_ca)).map(Some)
}

/// A self-signed certificate (and its PEM, so tests can trust it) for `names`.
pub fn self_signed(names: &[&str]) -> Result<(ServerTls, String), TlsError> {
    let (cert, key) = generate(names)?;
    let identity = Identity::SelfSigned {
        cert: cert.clone(),
        key,
    };
    Ok((ServerTls::load(Source::new(identity, None))?, cert))
}

/// (certificate PEM, key PEM) of a new self-signed certificate for `names`.
fn generate(names: &[&str]) -> Result<(String, String), TlsError> {
    let names: Vec<String> = names.iter().map(|s| s.to_string()).collect();
    let cert = rcgen::generate_simple_self_signed(names)?;
    Ok((cert.cert.pem(), cert.signing_key.serialize_pem()))
}

impl ServerTls {
    fn load(source: Source) -> Result<Self, TlsError> {
        let contents = source.read()?;
        let config = contents.server_config(&source)?;
        source.set_seen(contents.digest());
        Ok(ServerTls {
            current: Arc::new(ArcSwap::from_pointee(config)),
            source: Arc::new(source),
            reload_every: None,
            handshake_timeout: DEFAULT_HANDSHAKE_TIMEOUT,
            stats: Arc::default(),
        })
    }

    /// Reads the certificate files (and the client CA) again every `interval`
    /// while [`Self::watch`] runs. A self-signed certificate is never reloaded.
    pub fn reload_every(mut self, interval: Duration) -> Self {
        self.reload_every = Some(interval);
        self
    }

    /// Whether [`Self::watch`] reloads anything: an interval is set and there
    /// are files (certificate or client CA) to read.
    pub fn reloads(&self) -> bool {
        self.reload_every.is_some() && self.source.has_files()
    }

    /// Bounds each handshake: a client that has not finished by then is dropped.
    pub fn handshake_timeout(mut self, timeout: Duration) -> Self {
        self.handshake_timeout = timeout;
        self
    }

    /// The reload counts (shared by every clone).
    pub fn stats(&self) -> Arc<ReloadStats> {
        Arc::clone(&self.stats)
    }

    /// Reloads the certificate files whenever they change, every interval set
    /// with [`Self::reload_every`]; never completes (pending forever when there
    /// is nothing to reload). Drop it to stop.
    pub async fn watch(&self) {
        let Some(every) = self.reload_every.filter(|_| self.reloads()) else {
            return std::future::pending().await;
        };
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        loop {
            tick.tick().await;
            self.check();
        }
    }

    /// Takes the files' contents if they changed since the last look and are
    /// valid; counts and logs either way. Reads are a few KiB of local files.
    fn check(&self) {
        let source = &self.source;
        let read = source.read();
        let digest = match &read {
            Ok(contents) => contents.digest(),
            Err(e) => Sha256::digest(ErrorChain(e).to_string()).into(),
        };
        if !source.set_seen(digest) {
            return;
        }
        match read.and_then(|contents| contents.server_config(source)) {
            Ok(config) => {
                self.current.store(Arc::new(config));
                self.stats.reloaded.fetch_add(1, Ordering::Relaxed);
                info!(source = ?source.identity, client_ca = ?source.client_ca, "ext_proc TLS certificate reloaded");
            }
            Err(e) => {
                self.stats.rejected.fetch_add(1, Ordering::Relaxed);
                warn!(
                    error = %ErrorChain(&e),
                    "ext_proc TLS files changed but are not usable; keeping the current certificate"
                );
            }
        }
    }

    /// The connections accepted on `listener`, each once its TLS handshake has
    /// finished. Handshakes run concurrently (owned here: dropping the stream
    /// closes the listener and aborts them), each bounded by the handshake
    /// timeout; a failed or timed-out handshake is logged at debug and dropped.
    pub fn incoming(
        &self,
        listener: TcpListener,
    ) -> impl Stream<Item = Result<TlsStream<TcpStream>, Infallible>> + Send + 'static {
        let state = (listener, JoinSet::new(), self.clone());
        futures::stream::unfold(state, |(listener, mut handshakes, tls)| async move {
            loop {
                tokio::select! {
                    accepted = listener.accept(), if handshakes.len() < MAX_PENDING_HANDSHAKES => match accepted {
                        Ok((tcp, _)) => {
                            // Nagle would delay small gRPC frames; a failure here changes nothing else.
                            let _ = tcp.set_nodelay(true);
                            handshakes.spawn(tls.handshake(tcp));
                        }
                        Err(e) => {
                            debug!(error = %ErrorChain(&e), "ext_proc accept failed");
                            tokio::time::sleep(ACCEPT_ERROR_PAUSE).await;
                        }
                    },
                    Some(done) = handshakes.join_next() => {
                        if let Ok(Some(stream)) = done {
                            return Some((Ok(stream), (listener, handshakes, tls)));
                        }
                    }
                }
            }
        })
    }

    /// One handshake with the config current now, or `None` (logged).
    fn handshake(
        &self,
        tcp: TcpStream,
    ) -> impl std::future::Future<Output = Option<TlsStream<TcpStream>>> {
        let acceptor = TlsAcceptor::from(self.current.load_full());
        let timeout = self.handshake_timeout;
        async move {
            match tokio::time::timeout(timeout, acceptor.accept(tcp)).await {
                Ok(Ok(stream)) => Some(stream),
                Ok(Err(e)) => {
                    debug!(error = %ErrorChain(&e), "ext_proc TLS handshake failed");
                    None
                }
                Err(_) => {
                    debug!(?timeout, "ext_proc TLS handshake timed out");
                    None
                }
            }
        }
    }
}

/// How often changed certificate files were taken or refused.
#[derive(Debug, Default)]
pub struct ReloadStats {
    reloaded: AtomicU64,
    rejected: AtomicU64,
}

impl ReloadStats {
    /// Changed files that replaced the certificate.
    pub fn reloaded(&self) -> u64 {
        self.reloaded.load(Ordering::Relaxed)
    }

    /// Changed files that were refused (the certificate was kept).
    pub fn rejected(&self) -> u64 {
        self.rejected.load(Ordering::Relaxed)
    }
}

/// Where the server certificate and key come from.
enum Identity {
    /// `tls.crt` and `tls.key` in `--cert-path`, read again on reload.
    Files { cert: PathBuf, key: PathBuf },
    /// Made at start-up (certificate PEM, key PEM); never changes.
    SelfSigned { cert: String, key: String },
}

impl std::fmt::Debug for Identity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Identity::Files { cert, .. } => write!(f, "{}", cert.display()),
            Identity::SelfSigned { .. } => f.write_str("self-signed"),
        }
    }
}

/// Where a TLS config is loaded from.
#[derive(Debug)]
struct Source {
    identity: Identity,
    client_ca: Option<PathBuf>,
    /// The digest of the contents last looked at.
    seen: parking_lot::Mutex<[u8; 32]>,
}

/// What a [`Source`] held at one read.
struct Contents {
    cert: Vec<u8>,
    key: Vec<u8>,
    client_ca: Option<Vec<u8>>,
}

impl Source {
    fn new(identity: Identity, client_ca: Option<&Path>) -> Self {
        Source {
            identity,
            client_ca: client_ca.map(Path::to_path_buf),
            seen: Default::default(),
        }
    }

    /// Whether anything here comes from a file that can change.
    fn has_files(&self) -> bool {
        matches!(self.identity, Identity::Files { .. }) || self.client_ca.is_some()
    }

    /// The (certificate, key) labels errors name.
    fn labels(&self) -> (&Path, &Path) {
        match &self.identity {
            Identity::Files { cert, key } => (cert, key),
            Identity::SelfSigned { .. } => (Path::new("self-signed"), Path::new("self-signed")),
        }
    }

    /// Records `digest` as the contents last looked at; false if it already was.
    fn set_seen(&self, digest: [u8; 32]) -> bool {
        let mut seen = self.seen.lock();
        let changed = *seen != digest;
        *seen = digest;
        changed
    }

    fn read(&self) -> Result<Contents, TlsError> {
        let (cert, key) = match &self.identity {
            Identity::Files { cert, key } => (read(cert)?, read(key)?),
            Identity::SelfSigned { cert, key } => (cert.clone().into(), key.clone().into()),
        };
        Ok(Contents {
            cert,
            key,
            client_ca: self.client_ca.as_deref().map(read).transpose()?,
        })
    }
}

impl Contents {
    fn digest(&self) -> [u8; 32] {
        let mut h = Sha256::new();
        for part in [Some(&self.cert), Some(&self.key), self.client_ca.as_ref()] {
            let part = part.map_or(&[][..], Vec::as_slice);
            h.update((part.len() as u64).to_le_bytes());
            h.update(part);
        }
        h.finalize().into()
    }

    fn server_config(&self, source: &Source) -> Result<ServerConfig, TlsError> {
        let ca = match (&source.client_ca, &self.client_ca) {
            (Some(f), Some(pem)) => Some((f.as_path(), pem.as_slice())),
            _ => None,
        };
        let (cert_file, key_file) = source.labels();
        server_config((cert_file, &self.cert), (key_file, &self.key), ca)
    }
}

fn read(file: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(file).map_err(|source| TlsError::Read {
        file: file.display().to_string(),
        source,
    })
}

fn pem_error(file: &Path) -> impl FnOnce(pem::Error) -> TlsError + '_ {
    move |source| TlsError::Pem {
        file: file.display().to_string(),
        source,
    }
}

/// A rustls server config (TLS 1.2 and 1.3, ALPN h2) from PEM contents, each
/// given with the file it came from (for errors).
fn server_config(
    (cert_file, cert): (&Path, &[u8]),
    (key_file, key): (&Path, &[u8]),
    client_ca: Option<(&Path, &[u8])>,
) -> Result<ServerConfig, TlsError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let chain = CertificateDer::pem_slice_iter(cert)
        .collect::<Result<Vec<_>, _>>()
        .map_err(pem_error(cert_file))?;
    if chain.is_empty() {
        return Err(pem_error(cert_file)(pem::Error::NoItemsFound));
    }
    let key = PrivateKeyDer::from_pem_slice(key).map_err(pem_error(key_file))?;
    let builder = ServerConfig::builder_with_provider(Arc::clone(&provider))
        .with_safe_default_protocol_versions()
        .map_err(|source| TlsError::Identity {
            cert: cert_file.display().to_string(),
            key: key_file.display().to_string(),
            source,
        })?;
    let builder = match client_ca {
        None => builder.with_no_client_auth(),
        Some((file, pem)) => {
            let mut roots = RootCertStore::empty();
            for ca in CertificateDer::pem_slice_iter(pem) {
                // A certificate rustls cannot use as a root is skipped; none at all is refused below.
                let _ = roots.add(ca.map_err(pem_error(file))?);
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .map_err(|source| TlsError::ClientCa {
                    file: file.display().to_string(),
                    source,
                })?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let mut config = builder
        .with_single_cert(chain, key)
        .map_err(|source| TlsError::Identity {
            cert: cert_file.display().to_string(),
            key: key_file.display().to_string(),
            source,
        })?;
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(config)
}

/// Renders [`ReloadStats`] (`kvpick_tls_reloads_total{result}`).
#[derive(Debug)]
pub struct TlsMetrics {
    stats: Arc<ReloadStats>,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ReloadResultLabels {
    result: &'static str,
}

impl Collector for TlsMetrics {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let mut family = encoder.encode_descriptor(
            "kvpick_tls_reloads",
            "Changed ext_proc certificate files (--enable-cert-reload), by result: reloaded (new handshakes use them) or rejected (invalid or half-written; the current certificate was kept)",
            None,
            MetricType::Counter,
        )?;
        for (result, n) in [
            ("reloaded", self.stats.reloaded()),
            ("rejected", self.stats.rejected()),
        ] {
            ConstCounter::new(n).encode(family.encode_family(&ReloadResultLabels { result })?)?;
        }
        Ok(())
    }
}

impl TlsMetrics {
    /// Registers the certificate reload counts into kvpick's registry, read at scrape time.
    pub fn register(metrics: &Metrics, stats: Arc<ReloadStats>) {
        metrics.register(|r| r.register_collector(Box::new(TlsMetrics { stats })));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair(name: &str) -> (String, String) {
        generate(&[name]).unwrap()
    }

    #[test]
    fn a_key_that_does_not_match_its_certificate_is_refused() {
        let (cert, _) = pair("a");
        let (_, other_key) = pair("b");
        let p = Path::new("x");
        let r = server_config((p, cert.as_bytes()), (p, other_key.as_bytes()), None);
        assert!(matches!(r, Err(TlsError::Identity { .. })), "{r:?}");
        let (cert, key) = pair("a");
        let config = server_config((p, cert.as_bytes()), (p, key.as_bytes()), None).unwrap();
        assert_eq!(config.alpn_protocols, vec![b"h2".to_vec()]);
    }

    #[test]
    fn garbage_truncated_or_empty_pem_is_refused() {
        let (cert, key) = pair("a");
        let p = Path::new("x");
        for (c, k) in [
            ("", key.as_str()),
            ("not a certificate", key.as_str()),
            (&cert[..cert.len() / 2], key.as_str()),
            (cert.as_str(), ""),
            (cert.as_str(), &key[..key.len() / 2]),
        ] {
            let r = server_config((p, c.as_bytes()), (p, k.as_bytes()), None);
            assert!(r.is_err(), "accepted cert {c:?} key {k:?}");
        }
        let r = server_config(
            (p, cert.as_bytes()),
            (p, key.as_bytes()),
            Some((p, b"no CA here")),
        );
        assert!(matches!(r, Err(TlsError::ClientCa { .. })), "{r:?}");
    }

    #[test]
    fn only_changed_contents_are_looked_at_again_and_a_bad_change_keeps_the_config() {
        let dir = std::env::temp_dir().join(format!("kvpick-tls-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (cert, key) = pair("a");
        std::fs::write(dir.join("tls.crt"), &cert).unwrap();
        std::fs::write(dir.join("tls.key"), &key).unwrap();
        let files = Identity::Files {
            cert: dir.join("tls.crt"),
            key: dir.join("tls.key"),
        };
        let tls = ServerTls::load(Source::new(files, None)).unwrap();
        let first = tls.current.load_full();

        tls.check();
        assert_eq!((tls.stats.reloaded(), tls.stats.rejected()), (0, 0));
        assert!(Arc::ptr_eq(&first, &tls.current.load_full()));

        let (new_cert, new_key) = pair("b");
        std::fs::write(dir.join("tls.crt"), &new_cert).unwrap();
        tls.check();
        tls.check();
        assert_eq!((tls.stats.reloaded(), tls.stats.rejected()), (0, 1));
        assert!(Arc::ptr_eq(&first, &tls.current.load_full()));

        std::fs::write(dir.join("tls.key"), &new_key).unwrap();
        tls.check();
        assert_eq!((tls.stats.reloaded(), tls.stats.rejected()), (1, 1));
        assert!(!Arc::ptr_eq(&first, &tls.current.load_full()));

        std::fs::remove_file(dir.join("tls.key")).unwrap();
        tls.check();
        tls.check();
        assert_eq!((tls.stats.reloaded(), tls.stats.rejected()), (1, 2));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_self_signed_server_reloads_its_client_ca() {
        let dir = std::env::temp_dir().join(format!("kvpick-tls-unit-ca-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let ca_file = dir.join("ca.crt");
        let (first_ca, _) = pair("ca-1");
        std::fs::write(&ca_file, &first_ca).unwrap();
        let tls = ext_proc(true, None, Some(&ca_file))
            .unwrap()
            .unwrap()
            .reload_every(Duration::from_millis(10));
        assert!(tls.reloads());
        let first = tls.current.load_full();
        std::fs::write(&ca_file, "not a CA").unwrap();
        tls.check();
        assert_eq!((tls.stats.reloaded(), tls.stats.rejected()), (0, 1));
        assert!(Arc::ptr_eq(&first, &tls.current.load_full()));
        let (second_ca, _) = pair("ca-2");
        std::fs::write(&ca_file, &second_ca).unwrap();
        tls.check();
        assert_eq!((tls.stats.reloaded(), tls.stats.rejected()), (1, 1));
        assert!(!Arc::ptr_eq(&first, &tls.current.load_full()));
        // Nothing to reload without files.
        let (plain, _) = self_signed(&["localhost"]).unwrap();
        assert!(!plain.reload_every(Duration::from_millis(10)).reloads());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
