//! TLS on the ext_proc port. Mutual TLS (`--client-ca-path`): a client
//! certificate signed by the configured CA is served; no certificate, or a
//! self-signed one, is refused. Certificate reload (`--enable-cert-reload`):
//! rotated files reach new handshakes while open connections keep working, a
//! broken replacement keeps the old certificate, the client CA rotates too.
//! Handshakes run concurrently, each bounded by a timeout. The built binary
//! reloads with `--enable-cert-reload` and counts it in `/metrics`.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

#[allow(dead_code)] // each test binary uses a part of it
mod support;

use envoy_client::message::RequestHeaders;
use envoy_client::EnvoyStream;
use kvpick::endpoints::Endpoint;
use kvpick::extproc::ExtProcConfig;
use kvpick::server::tls::{ReloadStats, ServerTls};
use kvpick::server::{serve_ext_proc, App};
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose,
};
use support::{free_port, Child};
use tokio::io::AsyncReadExt;
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, ServerName};
use tokio_rustls::rustls::{self, ClientConfig, RootCertStore};
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

fn server_leaf(ca: &Ca) -> (String, String) {
    leaf("localhost", ExtendedKeyUsagePurpose::ServerAuth, Some(ca))
}

fn client_leaf(ca: &Ca) -> (String, String) {
    leaf("gateway", ExtendedKeyUsagePurpose::ClientAuth, Some(ca))
}

/// A fresh directory for one test's certificate files.
fn cert_dir(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvpick-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A fresh directory holding a server certificate for `localhost` signed by a new CA.
fn served_cert(test: &str) -> (PathBuf, Ca, (String, String)) {
    let dir = cert_dir(test);
    let ca = new_ca();
    let pair = server_leaf(&ca);
    write_pair(&dir, &pair);
    (dir, ca, pair)
}

/// Writes the server certificate and key as a rotation would (each file
/// replaced whole).
fn write_pair(dir: &Path, (cert, key): &(String, String)) {
    replace(&dir.join("tls.crt"), cert);
    replace(&dir.join("tls.key"), key);
}

fn replace(file: &Path, contents: &str) {
    let tmp = file.with_extension("tmp");
    std::fs::write(&tmp, contents).unwrap();
    std::fs::rename(&tmp, file).unwrap();
}

/// Serves ext_proc with the server certificate in `dir` and, with `mtls`,
/// client certificates checked against `dir/ca.crt`, as `--cert-path` and
/// `--client-ca-path` do; `configure` sets reload and timeouts. Returns the
/// port and the reload counts.
async fn serve_with(
    dir: &Path,
    mtls: bool,
    configure: impl FnOnce(ServerTls) -> ServerTls,
) -> (u16, Arc<ReloadStats>) {
    let ca = mtls.then(|| dir.join("ca.crt"));
    let tls = kvpick::server::tls::ext_proc(true, Some(dir), ca.as_deref())
        .unwrap()
        .unwrap();
    let stats = tls.stats();
    let app = App::new("mtls");
    app.endpoints
        .replace(vec![Endpoint::new("10.0.0.1:8000".parse().unwrap())]);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(serve_ext_proc(
        listener,
        app.ext_proc(ExtProcConfig::default()),
        Some(configure(tls)),
    ));
    (port, stats)
}

/// [`serve_with`] reloading the files every 20 ms.
async fn serve_reloading(dir: &Path, mtls: bool) -> (u16, Arc<ReloadStats>) {
    serve_with(dir, mtls, |tls| tls.reload_every(Duration::from_millis(20))).await
}

/// Waits until `count` (a reload counter) reaches `n`.
async fn until(what: &str, n: u64, count: impl Fn() -> u64) {
    for _ in 0..500 {
        if count() >= n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("{what} never reached {n} (at {})", count());
}

/// A TLS channel to `port` trusting `ca_pem`, with `identity` as client certificate.
async fn connect(port: u16, ca_pem: &str, identity: Option<(String, String)>) -> Option<Channel> {
    let mut tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(ca_pem))
        .domain_name("localhost");
    if let Some((cert, key)) = identity {
        tls = tls.identity(Identity::from_pem(cert, key));
    }
    Channel::from_shared(format!("https://127.0.0.1:{port}"))
        .unwrap()
        .tls_config(tls)
        .unwrap()
        .connect()
        .await
        .ok()
}

/// Whether a client with `identity` gets a routing answer from the server.
async fn routed(port: u16, ca_pem: &str, identity: Option<(String, String)>) -> bool {
    let Some(ch) = connect(port, ca_pem, identity).await else {
        return false;
    };
    let get = RequestHeaders::get("/v1/models").build();
    let Ok(mut s) = EnvoyStream::open(&ch, get, support::ANSWER_TIMEOUT).await else {
        return false;
    };
    s.recv().await.is_ok()
}

/// The leaf certificate (DER) a new handshake on `port` is shown, checked
/// against `ca_pems`, with ALPN h2 agreed.
async fn presented(port: u16, ca_pems: &[&str]) -> Vec<u8> {
    let mut roots = RootCertStore::empty();
    for pem in ca_pems {
        roots
            .add(CertificateDer::from_pem_slice(pem.as_bytes()).unwrap())
            .unwrap();
    }
    let mut config =
        ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
    config.alpn_protocols = vec![b"h2".to_vec()];
    let tcp = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    let stream = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(ServerName::try_from("localhost").unwrap(), tcp)
        .await
        .unwrap();
    let (_, session) = stream.get_ref();
    assert_eq!(session.alpn_protocol(), Some(&b"h2"[..]));
    session.peer_certificates().unwrap()[0].to_vec()
}

fn der(pem: &str) -> Vec<u8> {
    CertificateDer::from_pem_slice(pem.as_bytes())
        .unwrap()
        .to_vec()
}

#[tokio::test]
async fn only_clients_with_a_certificate_from_the_client_ca_are_served() {
    let (dir, ca, _) = served_cert("mtls");
    replace(&dir.join("ca.crt"), &ca.pem());
    let (port, _) = serve_with(&dir, true, |tls| tls).await;

    let signed = client_leaf(&ca);
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
        kvpick::server::tls::ext_proc(false, None, Some(Path::new("ca.crt"))),
        Err(kvpick::server::tls::TlsError::ClientCaWithoutTls)
    ));
    assert!(matches!(
        kvpick::server::tls::ext_proc(false, None, None),
        Ok(None)
    ));
}

#[tokio::test]
async fn rotated_files_reach_new_handshakes_while_an_open_stream_keeps_working() {
    let (dir, old_ca, old) = served_cert("tls-rotate");
    let next_ca = new_ca();
    let (port, stats) = serve_reloading(&dir, false).await;
    let both = [old_ca.pem(), next_ca.pem()];
    let both = [both[0].as_str(), both[1].as_str()];
    assert_eq!(presented(port, &both).await, der(&old.0));

    // An ext_proc stream open on a connection made with the old certificate.
    let ch = connect(port, &old_ca.pem(), None).await.unwrap();
    let stream = support::open_routed_stream(&ch).await;

    let new = server_leaf(&next_ca);
    write_pair(&dir, &new);
    until("reloads", 1, || stats.reloaded()).await;
    assert_eq!(
        presented(port, &both).await,
        der(&new.0),
        "a new handshake is shown the new certificate"
    );
    assert!(routed(port, &next_ca.pem(), None).await, "new CA trusted");
    assert!(
        !routed(port, &old_ca.pem(), None).await,
        "the old certificate is no longer shown"
    );

    // The stream opened before the rotation goes on, on its old connection:
    // its response headers are answered and it ends cleanly.
    support::finish_stream(stream).await;
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn a_broken_replacement_keeps_the_old_certificate() {
    let (dir, ca, old) = served_cert("tls-broken");
    let (port, stats) = serve_reloading(&dir, false).await;
    let ca_pem = ca.pem();

    // Half a rotation: the new certificate next to the old key.
    let new = server_leaf(&ca);
    replace(&dir.join("tls.crt"), &new.0);
    until("rejections", 1, || stats.rejected()).await;
    assert_eq!(presented(port, &[&ca_pem]).await, der(&old.0));
    // A truncated certificate.
    replace(&dir.join("tls.crt"), &new.0[..new.0.len() / 2]);
    until("rejections", 2, || stats.rejected()).await;
    assert_eq!(presented(port, &[&ca_pem]).await, der(&old.0));
    // No key at all.
    std::fs::remove_file(dir.join("tls.key")).unwrap();
    until("rejections", 3, || stats.rejected()).await;
    assert_eq!(presented(port, &[&ca_pem]).await, der(&old.0));
    assert_eq!(stats.reloaded(), 0);

    // The rotation completes: the new pair is taken.
    write_pair(&dir, &new);
    until("reloads", 1, || stats.reloaded()).await;
    assert_eq!(presented(port, &[&ca_pem]).await, der(&new.0));
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn a_rotated_client_ca_admits_its_clients_and_refuses_the_old_ones() {
    let (dir, server_ca, _) = served_cert("tls-client-ca");
    let (old_ca, new_ca) = (new_ca(), new_ca());
    replace(&dir.join("ca.crt"), &old_ca.pem());
    let (port, stats) = serve_reloading(&dir, true).await;
    let trust = server_ca.pem();
    assert!(routed(port, &trust, Some(client_leaf(&old_ca))).await);
    assert!(!routed(port, &trust, Some(client_leaf(&new_ca))).await);

    // A CA file with no CA in it is refused: the old CA still admits.
    replace(&dir.join("ca.crt"), "not a CA bundle\n");
    until("rejections", 1, || stats.rejected()).await;
    assert!(routed(port, &trust, Some(client_leaf(&old_ca))).await);

    replace(&dir.join("ca.crt"), &new_ca.pem());
    until("reloads", 1, || stats.reloaded()).await;
    assert!(
        routed(port, &trust, Some(client_leaf(&new_ca))).await,
        "a client of the new CA is served"
    );
    assert!(
        !routed(port, &trust, Some(client_leaf(&old_ca))).await,
        "a client of the old CA is refused"
    );
    assert!(!routed(port, &trust, None).await);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn a_client_that_never_finishes_its_handshake_holds_up_no_one_and_is_dropped() {
    let (dir, ca, pair) = served_cert("tls-slow");
    let timeout = Duration::from_secs(4);
    let (port, _) = serve_with(&dir, false, |tls| tls.handshake_timeout(timeout)).await;

    // Connects and says nothing: its handshake waits for a ClientHello.
    let mut silent = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    let opened = tokio::time::Instant::now();
    let shown = tokio::time::timeout(Duration::from_secs(2), presented(port, &[&ca.pem()]))
        .await
        .expect("a handshake finishes while another is stalled");
    assert_eq!(shown, der(&pair.0));

    let mut buf = [0u8; 1];
    let read = tokio::time::timeout(3 * timeout, silent.read(&mut buf))
        .await
        .expect("the stalled connection is closed");
    assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
    assert!(
        opened.elapsed() >= timeout - Duration::from_millis(100),
        "closed after the handshake timeout, not before"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// The body of `GET /metrics` on `port` (HTTP/1.0: the server closes when done).
async fn metrics_page(port: u16) -> String {
    use tokio::io::AsyncWriteExt;
    let mut tcp = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    tcp.write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")
        .await
        .unwrap();
    let mut page = String::new();
    tcp.read_to_string(&mut page).await.unwrap();
    page
}

#[tokio::test]
async fn the_binary_reloads_its_certificate_with_enable_cert_reload() {
    let (dir, ca, old) = served_cert("tls-binary");
    let endpoints = dir.join("endpoints.yaml");
    std::fs::write(&endpoints, "endpoints:\n  - address: 127.0.0.1:9\n").unwrap();
    let (grpc, health, metrics) = (free_port(), free_port(), free_port());
    let mut child = Child(
        std::process::Command::new(env!("CARGO_BIN_EXE_kvpick"))
            .arg("--endpoints-file")
            .arg(&endpoints)
            .arg("--cert-path")
            .arg(&dir)
            .args([
                "--bind-address=127.0.0.1",
                "--kv-events=false",
                "--enable-cert-reload",
                "--cert-reload-interval-ms=50",
                &format!("--grpc-port={grpc}"),
                &format!("--grpc-health-port={health}"),
                &format!("--metrics-port={metrics}"),
            ])
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    let started = std::time::Instant::now();
    while TcpStream::connect(("127.0.0.1", grpc)).await.is_err() {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "kvpick never listened"
        );
        assert!(child.0.try_wait().unwrap().is_none(), "kvpick exited early");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let ca_pem = ca.pem();
    assert_eq!(presented(grpc, &[&ca_pem]).await, der(&old.0));

    let new = server_leaf(&ca);
    write_pair(&dir, &new);
    let rotated = std::time::Instant::now();
    while presented(grpc, &[&ca_pem]).await != der(&new.0) {
        assert!(
            rotated.elapsed() < Duration::from_secs(10),
            "the new certificate never reached a handshake"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(routed(grpc, &ca_pem, None).await);
    let page = metrics_page(metrics).await;
    assert!(
        page.contains(r#"kvpick_tls_reloads_total{result="reloaded"} 1"#),
        "{page}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
