//! The network side of remote image fetching ([`crate::multimodal::remote`]):
//! one HTTP/1.1 `GET` per image, over TLS (rustls, the system's roots), with the
//! rules that keep a client's image URL from making kvpick reach into the
//! cluster or the node (SSRF):
//! - `https` only, unless [`FetchPolicy::allow_http`];
//! - when [`FetchPolicy::allow_hosts`] is set, only those hosts (exact names);
//! - the host is resolved first and every address checked: loopback, private,
//!   link-local (cloud metadata), CGNAT, multicast, reserved and other
//!   non-public addresses are refused unless [`FetchPolicy::allow_private`];
//!   kvpick then connects to a checked address (no second lookup to rebind);
//! - no redirects (a 3xx is a failure), only a 200 is read, and at most
//!   [`FetchPolicy::max_bytes`] of body.
//!
//! Time and concurrency are bounded by the core's [`RemoteImages`]; the
//! connection lives inside the fetch's future, so a timeout drops it.
//!
//! [`RemoteImages`]: crate::multimodal::remote::RemoteImages

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use futures::future::BoxFuture;
use http_body_util::{BodyExt, Empty};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio_rustls::rustls::{self, pki_types::ServerName, RootCertStore};
use tokio_rustls::TlsConnector;

use crate::multimodal::remote::{FetchError, ImageFetcher, Refusal};

/// Which URLs may be fetched and how much of each.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FetchPolicy {
    /// Whether plain `http` URLs are fetched (never by default).
    pub allow_http: bool,
    /// Whether non-public addresses may be reached (never by default; for tests
    /// and trusted in-cluster image servers).
    pub allow_private: bool,
    /// Hosts that may be fetched (lowercase); empty: any public host.
    pub allow_hosts: Vec<String>,
    /// The largest image fetched, in bytes.
    pub max_bytes: usize,
}

impl Default for FetchPolicy {
    fn default() -> Self {
        FetchPolicy {
            allow_http: false,
            allow_private: false,
            allow_hosts: Vec::new(),
            max_bytes: 8 << 20,
        }
    }
}

/// Why the fetcher could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum ImageFetchSetupError {
    /// The TLS client configuration was rejected.
    #[error("TLS client configuration")]
    Tls(#[source] rustls::Error),
}

/// Fetches images over HTTP/1.1 (TLS for `https`) under a [`FetchPolicy`].
pub struct HttpImageFetcher {
    policy: FetchPolicy,
    tls: TlsConnector,
}

impl std::fmt::Debug for HttpImageFetcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpImageFetcher")
            .field("policy", &self.policy)
            .finish_non_exhaustive()
    }
}

impl HttpImageFetcher {
    /// A fetcher trusting `roots` for `https`.
    pub fn new(policy: FetchPolicy, roots: RootCertStore) -> Result<Self, ImageFetchSetupError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(ImageFetchSetupError::Tls)?
            .with_root_certificates(roots)
            .with_no_client_auth();
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(HttpImageFetcher {
            policy,
            tls: TlsConnector::from(Arc::new(config)),
        })
    }

    /// The system's trusted roots (those that parse; none is not an error: every
    /// `https` fetch then fails and is counted).
    pub fn system_roots() -> RootCertStore {
        let mut roots = RootCertStore::empty();
        roots.add_parsable_certificates(rustls_native_certs::load_native_certs().certs);
        roots
    }

    async fn get(&self, url: &str) -> Result<Vec<u8>, FetchError> {
        let target = Target::parse(url, &self.policy)?;
        let addr = self.checked_address(&target).await?;
        let tcp = TcpStream::connect(addr).await.map_err(transport)?;
        let request = http::Request::get(target.path_and_query.as_str())
            .header(http::header::HOST, target.authority.as_str())
            .header(http::header::USER_AGENT, "kvpick")
            .header(http::header::ACCEPT, "image/*")
            .body(Empty::<Bytes>::new())
            .map_err(transport)?;
        if !target.tls {
            return exchange(TokioIo::new(tcp), request, self.policy.max_bytes).await;
        }
        let name = match target.host.parse::<IpAddr>() {
            Ok(ip) => ServerName::IpAddress(ip.into()),
            Err(_) => ServerName::try_from(target.host.clone())
                .map_err(|_| FetchError::Refused(Refusal::BadUrl))?,
        };
        let tls = self.tls.connect(name, tcp).await.map_err(transport)?;
        exchange(TokioIo::new(tls), request, self.policy.max_bytes).await
    }

    /// Resolves the host and checks every address it has; the first one.
    async fn checked_address(&self, target: &Target) -> Result<SocketAddr, FetchError> {
        let addrs: Vec<SocketAddr> = match target.host.parse::<IpAddr>() {
            Ok(ip) => vec![SocketAddr::new(ip, target.port)],
            Err(_) => tokio::net::lookup_host((target.host.as_str(), target.port))
                .await
                .map_err(transport)?
                .collect(),
        };
        if !self.policy.allow_private && addrs.iter().any(|a| !is_public(a.ip())) {
            return Err(FetchError::Refused(Refusal::PrivateAddress));
        }
        addrs.first().copied().ok_or_else(|| {
            transport(std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "host has no address",
            ))
        })
    }
}

impl ImageFetcher for HttpImageFetcher {
    fn fetch<'a>(&'a self, url: &'a str) -> BoxFuture<'a, Result<Vec<u8>, FetchError>> {
        Box::pin(self.get(url))
    }
}

fn transport(e: impl std::error::Error + Send + Sync + 'static) -> FetchError {
    FetchError::Transport(Box::new(e))
}

/// A URL the policy allows, taken apart.
#[derive(Debug)]
struct Target {
    tls: bool,
    /// Lowercase, without IPv6 brackets.
    host: String,
    port: u16,
    /// `host[:port]` as the URL has it (the `Host` header).
    authority: String,
    path_and_query: String,
}

impl Target {
    fn parse(url: &str, policy: &FetchPolicy) -> Result<Target, FetchError> {
        let refused = FetchError::Refused;
        let uri: http::Uri = url.parse().map_err(|_| refused(Refusal::BadUrl))?;
        let tls = match uri.scheme_str() {
            Some(s) if s.eq_ignore_ascii_case("https") => true,
            Some(s) if s.eq_ignore_ascii_case("http") && policy.allow_http => false,
            _ => return Err(refused(Refusal::Scheme)),
        };
        let authority = uri.authority().ok_or(refused(Refusal::BadUrl))?;
        if authority.as_str().contains('@') {
            // Credentials in the URL are never sent on a client's behalf.
            return Err(refused(Refusal::BadUrl));
        }
        let host = authority
            .host()
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_ascii_lowercase();
        if host.is_empty() {
            return Err(refused(Refusal::BadUrl));
        }
        if !policy.allow_hosts.is_empty() && !policy.allow_hosts.contains(&host) {
            return Err(refused(Refusal::Host));
        }
        Ok(Target {
            tls,
            port: authority.port_u16().unwrap_or(if tls { 443 } else { 80 }),
            authority: authority.as_str().to_string(),
            path_and_query: uri.path_and_query().map_or("/", |p| p.as_str()).to_string(),
            host,
        })
    }
}

/// Sends `request` on a fresh HTTP/1.1 connection over `io` and reads a 200's
/// body, at most `max_bytes`. The connection is driven alongside and ends with
/// this future.
async fn exchange<IO>(
    io: IO,
    request: http::Request<Empty<Bytes>>,
    max_bytes: usize,
) -> Result<Vec<u8>, FetchError>
where
    IO: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let (mut sender, connection) = hyper::client::conn::http1::handshake(io)
        .await
        .map_err(transport)?;
    let read = async move {
        let response = sender.send_request(request).await.map_err(transport)?;
        if response.status() != http::StatusCode::OK {
            return Err(FetchError::Status(response.status().as_u16()));
        }
        let declared = response
            .headers()
            .get(http::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
        if declared.is_some_and(|n| n > max_bytes as u64) {
            return Err(FetchError::TooLarge { limit: max_bytes });
        }
        let mut body = response.into_body();
        let mut out = Vec::new();
        while let Some(frame) = body.frame().await {
            if let Ok(data) = frame.map_err(transport)?.into_data() {
                if out.len() + data.len() > max_bytes {
                    return Err(FetchError::TooLarge { limit: max_bytes });
                }
                out.extend_from_slice(&data);
            }
        }
        Ok(out)
    };
    // The connection future ends once the response is read and `sender` is
    // dropped (or the peer closes); a read error ends both.
    let (result, _) = tokio::join!(read, connection);
    result
}

/// Whether an address is publicly routable: not loopback, private (RFC 1918,
/// IPv6 unique local), link-local (incl. 169.254.169.254), CGNAT, unspecified,
/// multicast, broadcast, documentation, benchmarking or reserved. IPv4 inside
/// IPv6 (mapped, NAT64) is judged as IPv4.
pub fn is_public(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(a) => {
            let o = a.octets();
            !(a.is_private()
                || a.is_loopback()
                || a.is_link_local()
                || a.is_unspecified()
                || a.is_broadcast()
                || a.is_documentation()
                || a.is_multicast()
                || o[0] == 0
                || (o[0] == 100 && (o[1] & 0xc0) == 64)
                || (o[0] == 192 && o[1] == 0 && o[2] == 0)
                || (o[0] == 198 && (o[1] & 0xfe) == 18)
                || o[0] >= 240)
        }
        IpAddr::V6(a) => {
            if let Some(v4) = a.to_ipv4_mapped() {
                return is_public(IpAddr::V4(v4));
            }
            let s = a.segments();
            if s[0] == 0x64 && s[1] == 0xff9b && s[2..6] == [0; 4] {
                let [.., hi, lo] = s;
                let v4 = std::net::Ipv4Addr::from((u32::from(hi) << 16) | u32::from(lo));
                return is_public(IpAddr::V4(v4));
            }
            !(a.is_loopback()
                || a.is_unspecified()
                || a.is_multicast()
                || s[..6] == [0; 6]
                || (s[0] & 0xfe00) == 0xfc00
                || (s[0] & 0xffc0) == 0xfe80
                || (s[0] == 0x2001 && s[1] == 0x0db8))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_public_addresses_pass() {
        for private in [
            "127.0.0.1",
            "10.1.2.3",
            "172.16.0.1",
            "192.168.1.1",
            "169.254.169.254",
            "100.64.0.1",
            "0.0.0.0",
            "255.255.255.255",
            "224.0.0.1",
            "240.0.0.1",
            "::1",
            "::",
            "fd00::1",
            "fe80::1",
            "::ffff:10.0.0.1",
            "::ffff:127.0.0.1",
            "64:ff9b::a9fe:a9fe",
            "2001:db8::1",
            "ff02::1",
        ] {
            assert!(!is_public(private.parse().unwrap()), "{private}");
        }
        for public in ["1.1.1.1", "8.8.8.8", "2606:4700::1111", "::ffff:8.8.8.8"] {
            assert!(is_public(public.parse().unwrap()), "{public}");
        }
    }

    fn refusal(url: &str, policy: &FetchPolicy) -> Option<Refusal> {
        match Target::parse(url, policy) {
            Err(FetchError::Refused(r)) => Some(r),
            Err(e) => panic!("{url}: {e}"),
            Ok(_) => None,
        }
    }

    #[test]
    fn urls_are_checked_before_any_lookup() {
        let p = FetchPolicy::default();
        assert_eq!(refusal("https://img.example/a.png", &p), None);
        assert_eq!(
            refusal("http://img.example/a.png", &p),
            Some(Refusal::Scheme)
        );
        assert_eq!(
            refusal("ftp://img.example/a.png", &p),
            Some(Refusal::Scheme)
        );
        assert_eq!(
            refusal("https://u:p@img.example/a", &p),
            Some(Refusal::BadUrl)
        );
        assert_eq!(refusal("not a url", &p), Some(Refusal::BadUrl));
        let only = FetchPolicy {
            allow_hosts: vec!["img.example".into()],
            allow_http: true,
            ..FetchPolicy::default()
        };
        assert_eq!(refusal("http://IMG.example:8080/a", &only), None);
        assert_eq!(
            refusal("https://evil.example/a", &only),
            Some(Refusal::Host)
        );
        let t = Target::parse("https://[::1]:8443/a?b=c", &p).unwrap();
        assert_eq!((t.host.as_str(), t.port), ("::1", 8443));
        assert_eq!(t.path_and_query, "/a?b=c");
        assert_eq!(t.authority, "[::1]:8443");
    }
}
