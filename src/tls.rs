//! TLS for the ext_proc port: a certificate from `--cert-path`, or a self-signed
//! one made at start-up (as the GIE EPP does with `--secure-serving`).

use std::path::Path;

use tonic::transport::{Identity, ServerTlsConfig};

/// Why TLS could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// The certificate directory lacks `tls.crt` or `tls.key`.
    #[error("cannot read {file}: {source}")]
    Read {
        /// The missing or unreadable file.
        file: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// Generating the self-signed certificate failed.
    #[error("cannot generate a self-signed certificate: {0}")]
    Generate(#[from] rcgen::Error),
}

/// Server TLS from `dir/tls.crt` and `dir/tls.key`.
pub fn from_dir(dir: &Path) -> Result<ServerTlsConfig, TlsError> {
    let read = |name: &str| {
        let file = dir.join(name);
        std::fs::read(&file).map_err(|source| TlsError::Read {
            file: file.display().to_string(),
            source,
        })
    };
    let identity = Identity::from_pem(read("tls.crt")?, read("tls.key")?);
    Ok(ServerTlsConfig::new().identity(identity))
}

/// A self-signed certificate (and its PEM, so tests can trust it) for `names`.
pub fn self_signed(names: &[&str]) -> Result<(ServerTlsConfig, String), TlsError> {
    let names: Vec<String> = names.iter().map(|s| s.to_string()).collect();
    let cert = rcgen::generate_simple_self_signed(names)?;
    let cert_pem = cert.cert.pem();
    let identity = Identity::from_pem(&cert_pem, cert.signing_key.serialize_pem());
    Ok((ServerTlsConfig::new().identity(identity), cert_pem))
}
