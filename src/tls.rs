//! TLS for the ext_proc port: a certificate from `--cert-path`, or a self-signed
//! one made at start-up (as the GIE EPP does with `--secure-serving`); with
//! `--client-ca-path`, mutual TLS: clients must present a certificate that chains
//! to one of that file's CAs, and the handshake fails for any other.

use std::path::Path;

use tonic::transport::{Certificate, Identity, ServerTlsConfig};

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
    /// `--client-ca-path` was given with `--secure-serving=false`.
    #[error("--client-ca-path needs TLS: it cannot be used with --secure-serving=false")]
    ClientCaWithoutTls,
}

fn read(file: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(file).map_err(|source| TlsError::Read {
        file: file.display().to_string(),
        source,
    })
}

/// The ext_proc port's TLS, or `None` for plaintext: the certificate in
/// `cert_dir` (else a self-signed one) and, with `client_ca`, client
/// certificates required and verified against that PEM bundle.
pub fn ext_proc(
    secure: bool,
    cert_dir: Option<&Path>,
    client_ca: Option<&Path>,
) -> Result<Option<ServerTlsConfig>, TlsError> {
    if !secure {
        return match client_ca {
            Some(_) => Err(TlsError::ClientCaWithoutTls),
            None => Ok(None),
        };
    }
    let config = match cert_dir {
        Some(dir) => from_dir(dir)?,
        None => self_signed(&["localhost"])?.0,
    };
    Ok(Some(match client_ca {
        Some(file) => require_client_certs(config, file)?,
        None => config,
    }))
}

/// `config` requiring a client certificate signed by a CA in the PEM file `ca`.
pub fn require_client_certs(
    config: ServerTlsConfig,
    ca: &Path,
) -> Result<ServerTlsConfig, TlsError> {
    Ok(config
        .client_ca_root(Certificate::from_pem(read(ca)?))
        .client_auth_optional(false))
}

/// Server TLS from `dir/tls.crt` and `dir/tls.key`.
pub fn from_dir(dir: &Path) -> Result<ServerTlsConfig, TlsError> {
    let identity = Identity::from_pem(read(&dir.join("tls.crt"))?, read(&dir.join("tls.key"))?);
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
