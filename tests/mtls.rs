//! Mutual TLS on the ext_proc port (`--client-ca-path`): a client certificate
//! signed by the configured CA is served; no certificate, or a self-signed one,
//! is refused.

use std::path::Path;

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    processing_request::Request, HttpHeaders, ProcessingRequest,
};
use kvpick::endpoints::Endpoint;
use kvpick::extproc::ExtProcConfig;
use kvpick::server::{serve_ext_proc, App};
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose,
};
use tokio::net::TcpListener;
use tokio_stream::StreamExt;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};

type Ca = CertifiedIssuer<'static, KeyPair>;

fn new_ca() -> Ca {
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap()
}

/// (certificate PEM, key PEM) for `name`, signed by `ca` or self-signed.
fn leaf(name: &str, usage: ExtendedKeyUsagePurpose, ca: Option<&Ca>) -> (String, String) {
    let key = KeyPair::generate().unwrap();
    let mut params = CertificateParams::new(vec![name.to_string()]).unwrap();
    params.extended_key_usages = vec![usage];
    let cert = match ca {
        Some(ca) => params.signed_by(&key, ca).unwrap(),
        None => params.self_signed(&key).unwrap(),
    };
    (cert.pem(), key.serialize_pem())
}

/// Serves ext_proc with the server certificate in `dir` and client certificates
/// checked against `dir/ca.crt`, as `--cert-path` and `--client-ca-path` do.
async fn serve(dir: &Path) -> u16 {
    let tls = kvpick::tls::ext_proc(true, Some(dir), Some(&dir.join("ca.crt")))
        .unwrap()
        .unwrap();
    let app = App::new("mtls");
    app.endpoints
        .replace(vec![Endpoint::new("10.0.0.1:8000".parse().unwrap())]);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(serve_ext_proc(
        listener,
        app.ext_proc(ExtProcConfig::default()),
        Some(tls),
    ));
    port
}

/// Whether a client with `identity` gets a routing answer from the server.
async fn routed(port: u16, ca_pem: &str, identity: Option<(String, String)>) -> bool {
    let mut tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(ca_pem))
        .domain_name("localhost");
    if let Some((cert, key)) = identity {
        tls = tls.identity(Identity::from_pem(cert, key));
    }
    let Ok(ch) = Channel::from_shared(format!("https://127.0.0.1:{port}"))
        .unwrap()
        .tls_config(tls)
        .unwrap()
        .connect()
        .await
    else {
        return false;
    };
    let headers = [(":method", "GET"), (":path", "/v1/models")]
        .iter()
        .map(|(k, v)| HeaderValue {
            key: k.to_string(),
            value: String::new(),
            raw_value: v.as_bytes().to_vec(),
        })
        .collect();
    let request = ProcessingRequest {
        request: Some(Request::RequestHeaders(HttpHeaders {
            headers: Some(HeaderMap { headers }),
            end_of_stream: true,
            ..Default::default()
        })),
        ..Default::default()
    };
    let Ok(answers) = ExternalProcessorClient::new(ch)
        .process(tokio_stream::iter([request]))
        .await
    else {
        return false;
    };
    matches!(answers.into_inner().next().await, Some(Ok(_)))
}

#[tokio::test]
async fn only_clients_with_a_certificate_from_the_client_ca_are_served() {
    let dir = std::env::temp_dir().join(format!("kvpick-mtls-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let ca = new_ca();
    let (server_cert, server_key) =
        leaf("localhost", ExtendedKeyUsagePurpose::ServerAuth, Some(&ca));
    std::fs::write(dir.join("tls.crt"), server_cert).unwrap();
    std::fs::write(dir.join("tls.key"), server_key).unwrap();
    std::fs::write(dir.join("ca.crt"), ca.pem()).unwrap();
    let port = serve(&dir).await;

    let signed = leaf("gateway", ExtendedKeyUsagePurpose::ClientAuth, Some(&ca));
    assert!(
        routed(port, &ca.pem(), Some(signed)).await,
        "a client certificate signed by the CA is served"
    );
    assert!(
        !routed(port, &ca.pem(), None).await,
        "a client without a certificate is refused"
    );
    let self_signed = leaf("gateway", ExtendedKeyUsagePurpose::ClientAuth, None);
    assert!(
        !routed(port, &ca.pem(), Some(self_signed)).await,
        "a self-signed client certificate is refused"
    );
    let other_ca = new_ca();
    let foreign = leaf(
        "gateway",
        ExtendedKeyUsagePurpose::ClientAuth,
        Some(&other_ca),
    );
    assert!(
        !routed(port, &ca.pem(), Some(foreign)).await,
        "a certificate from another CA is refused"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_client_ca_without_tls_is_a_start_up_error() {
    assert!(matches!(
        kvpick::tls::ext_proc(false, None, Some(Path::new("ca.crt"))),
        Err(kvpick::tls::TlsError::ClientCaWithoutTls)
    ));
    assert!(matches!(kvpick::tls::ext_proc(false, None, None), Ok(None)));
}
