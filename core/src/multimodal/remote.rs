//! Remote images by content: an optional, bounded fetch-and-hash of `http(s)`
//! image URLs, so a remote image gets the identity its bytes would have as a
//! `data:` URL and a size read from its header (then its tokens are counted and
//! the blocks after it can equal the engine's).
//!
//! The core owns the policy and the bookkeeping; the bytes come from an
//! [`ImageFetcher`] the glue implements (kvpick's is `kvpick::multimodal::fetch`, with
//! its address and scheme rules). Every fetch is bounded:
//! - time: the whole fetch, waiting for a permit included, within
//!   [`FetchLimits::timeout`];
//! - concurrency: at most [`FetchLimits::max_concurrent`] fetches at once in the
//!   process, at most [`FetchLimits::max_per_request`] distinct URLs per request;
//! - bytes: the fetcher stops at its size cap;
//! - memory: a small cache (URL → identity and size, never the bytes) of
//!   [`FetchLimits::cache_entries`] entries, each kept [`FetchLimits::cache_ttl`].
//!
//! A failure of any kind leaves the image with its URL identity (as without
//! fetching) and is counted by [`FetchOutcome`]; nothing here fails a request.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use parking_lot::Mutex;
use tokio::sync::Semaphore;

use super::dims::{image_size, ImageSize};
use super::identity::{self, ImageIdentity};
use crate::error_chain::ErrorChain;

/// Longest URL fetched; longer ones keep their URL identity.
pub const MAX_URL_BYTES: usize = 2048;

/// Why a fetcher refused a URL without fetching it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// The URL does not parse, or has no host.
    #[error("not a fetchable URL")]
    BadUrl,
    /// A scheme the policy does not allow (only `https` by default).
    #[error("scheme not allowed")]
    Scheme,
    /// A host not on the allowlist.
    #[error("host not on the allowlist")]
    Host,
    /// The host resolves to a loopback, private, link-local or otherwise
    /// non-public address.
    #[error("host resolves to a non-public address")]
    PrivateAddress,
}

/// Why fetching an image failed.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    /// The policy forbids fetching this URL.
    #[error("fetch refused")]
    Refused(#[source] Refusal),
    /// The image is larger than the fetcher's cap.
    #[error("image larger than {limit} bytes")]
    TooLarge {
        /// The cap in bytes.
        limit: usize,
    },
    /// The server answered with a status other than 200 (redirects included).
    #[error("HTTP status {0}")]
    Status(u16),
    /// Name resolution, connection, TLS or HTTP failed.
    #[error("fetch failed")]
    Transport(#[source] Box<dyn std::error::Error + Send + Sync>),
}

/// Fetches an image's bytes. Implemented by the glue; the core bounds the time.
pub trait ImageFetcher: Send + Sync {
    /// The bytes at `url`, or why not.
    fn fetch<'a>(&'a self, url: &'a str) -> BoxFuture<'a, Result<Vec<u8>, FetchError>>;
}

/// How one remote image was resolved (the metric label).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FetchOutcome {
    /// Fetched, identified by content, size read.
    Ok,
    /// Answered by the cache.
    Cached,
    /// The fetch did not finish in time.
    Timeout,
    /// Larger than the size cap.
    TooLarge,
    /// A status other than 200.
    Status,
    /// Refused by policy (scheme, host, address, URL length).
    Refused,
    /// Fetched, but not an image whose size kvpick can read.
    NotImage,
    /// Resolution, connection, TLS or HTTP failure.
    Error,
    /// Over the per-request limit of distinct URLs: not fetched.
    Limit,
}

impl FetchOutcome {
    /// Every outcome, in metric order.
    pub const ALL: [FetchOutcome; 9] = [
        FetchOutcome::Ok,
        FetchOutcome::Cached,
        FetchOutcome::Timeout,
        FetchOutcome::TooLarge,
        FetchOutcome::Status,
        FetchOutcome::Refused,
        FetchOutcome::NotImage,
        FetchOutcome::Error,
        FetchOutcome::Limit,
    ];

    /// Metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            FetchOutcome::Ok => "ok",
            FetchOutcome::Cached => "cached",
            FetchOutcome::Timeout => "timeout",
            FetchOutcome::TooLarge => "too_large",
            FetchOutcome::Status => "status",
            FetchOutcome::Refused => "refused",
            FetchOutcome::NotImage => "not_image",
            FetchOutcome::Error => "error",
            FetchOutcome::Limit => "limit",
        }
    }

    fn of(e: &FetchError) -> FetchOutcome {
        match e {
            FetchError::Refused(_) => FetchOutcome::Refused,
            FetchError::TooLarge { .. } => FetchOutcome::TooLarge,
            FetchError::Status(_) => FetchOutcome::Status,
            FetchError::Transport(_) => FetchOutcome::Error,
        }
    }
}

/// Counts of remote image resolutions by outcome: the core counts, telemetry reads.
#[derive(Debug, Default)]
pub struct FetchStats {
    counts: [AtomicU64; FetchOutcome::ALL.len()],
}

impl FetchStats {
    fn record(&self, outcome: FetchOutcome) {
        self.counts[outcome as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// Resolutions that ended in `outcome`.
    pub fn count(&self, outcome: FetchOutcome) -> u64 {
        self.counts[outcome as usize].load(Ordering::Relaxed)
    }
}

/// The bounds of remote image fetching.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FetchLimits {
    /// The longest one image may take, waiting for a permit included.
    pub timeout: Duration,
    /// Fetches running at once in the process.
    pub max_concurrent: usize,
    /// Distinct URLs fetched for one request; the rest keep URL identities.
    pub max_per_request: usize,
    /// Cached identities (0: no cache).
    pub cache_entries: usize,
    /// How long a cached identity is used.
    pub cache_ttl: Duration,
}

impl Default for FetchLimits {
    fn default() -> Self {
        FetchLimits {
            timeout: Duration::from_millis(500),
            max_concurrent: 16,
            max_per_request: 8,
            cache_entries: 1024,
            cache_ttl: Duration::from_secs(600),
        }
    }
}

/// A remote image whose bytes kvpick has seen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KnownImage {
    /// Its content identity (equal to the `data:` identity of the same bytes).
    pub identity: ImageIdentity,
    /// Its size from the header.
    pub size: ImageSize,
}

/// The remote images of one request that were fetched, by URL.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KnownImages(HashMap<String, KnownImage>);

impl KnownImages {
    /// The fetched image at `url`, if it was fetched.
    pub fn get(&self, url: &str) -> Option<&KnownImage> {
        self.0.get(url)
    }

    /// The identity of `url`: the fetched content's, else [`identity::identify`].
    pub fn identify(&self, url: &str) -> ImageIdentity {
        self.get(url)
            .map_or_else(|| identity::identify(url), |k| k.identity)
    }

    /// Whether no image was fetched.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// Whether a URL is one the fetcher is asked about (`http:` or `https:`).
pub fn is_remote(url: &str) -> bool {
    let scheme = url.split_once(':').map(|(s, _)| s);
    scheme.is_some_and(|s| s.eq_ignore_ascii_case("https") || s.eq_ignore_ascii_case("http"))
}

/// A bounded cache of fetched identities: oldest out first, entries expire.
#[derive(Debug, Default)]
struct IdentityCache {
    entries: HashMap<String, (KnownImage, Instant)>,
    order: VecDeque<String>,
}

impl IdentityCache {
    fn get(&mut self, url: &str, now: Instant) -> Option<KnownImage> {
        // An expired entry stays until it is replaced or evicted in turn.
        match self.entries.get(url) {
            Some(&(image, expires)) if expires > now => Some(image),
            _ => None,
        }
    }

    fn insert(&mut self, url: &str, image: KnownImage, expires: Instant, cap: usize) {
        if cap == 0 {
            return;
        }
        if self
            .entries
            .insert(url.to_string(), (image, expires))
            .is_none()
        {
            self.order.push_back(url.to_string());
        }
        while self.order.len() > cap {
            if let Some(old) = self.order.pop_front() {
                self.entries.remove(&old);
            }
        }
    }
}

/// Resolves the remote images of requests: fetch, hash, read the size, cache.
pub struct RemoteImages {
    fetcher: Arc<dyn ImageFetcher>,
    limits: FetchLimits,
    permits: Semaphore,
    cache: Mutex<IdentityCache>,
    stats: Arc<FetchStats>,
}

impl std::fmt::Debug for RemoteImages {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteImages")
            .field("limits", &self.limits)
            .finish_non_exhaustive()
    }
}

impl RemoteImages {
    /// Resolution through `fetcher` within `limits`.
    pub fn new(fetcher: Arc<dyn ImageFetcher>, limits: FetchLimits) -> Self {
        RemoteImages {
            fetcher,
            permits: Semaphore::new(limits.max_concurrent.max(1)),
            limits,
            cache: Mutex::default(),
            stats: Arc::default(),
        }
    }

    /// Counts by outcome.
    pub fn stats(&self) -> &Arc<FetchStats> {
        &self.stats
    }

    /// Fetches the remote (`http:`/`https:`) URLs among `urls` (others are
    /// skipped), at most [`FetchLimits::max_per_request`] distinct ones, all at
    /// once; the result holds those whose bytes were fetched and read as an image.
    pub async fn resolve<'a>(&self, urls: impl IntoIterator<Item = &'a str>) -> KnownImages {
        let mut distinct: Vec<&str> = Vec::new();
        for url in urls.into_iter().filter(|u| is_remote(u)) {
            if !distinct.contains(&url) {
                distinct.push(url);
            }
        }
        let limit = self.limits.max_per_request;
        for _ in distinct.iter().skip(limit) {
            self.stats.record(FetchOutcome::Limit);
        }
        distinct.truncate(limit);
        let found = futures::future::join_all(
            distinct
                .into_iter()
                .map(|url| async move { self.resolve_one(url).await.map(|image| (url, image)) }),
        )
        .await;
        KnownImages(
            found
                .into_iter()
                .flatten()
                .map(|(url, image)| (url.to_string(), image))
                .collect(),
        )
    }

    async fn resolve_one(&self, url: &str) -> Option<KnownImage> {
        if let Some(image) = self.cache.lock().get(url, Instant::now()) {
            self.stats.record(FetchOutcome::Cached);
            return Some(image);
        }
        let (outcome, image) = self.fetch_one(url).await;
        self.stats.record(outcome);
        let image = image?;
        let expires = crate::time::saturating_add(Instant::now(), self.limits.cache_ttl);
        self.cache
            .lock()
            .insert(url, image, expires, self.limits.cache_entries);
        Some(image)
    }

    async fn fetch_one(&self, url: &str) -> (FetchOutcome, Option<KnownImage>) {
        if url.len() > MAX_URL_BYTES {
            return (FetchOutcome::Refused, None);
        }
        let fetch = async {
            let _permit = self.permits.acquire().await.ok();
            self.fetcher.fetch(url).await
        };
        match tokio::time::timeout(self.limits.timeout, fetch).await {
            Err(_) => (FetchOutcome::Timeout, None),
            Ok(Err(e)) => {
                tracing::debug!(url, error = %ErrorChain(&e), "image fetch failed: URL identity");
                (FetchOutcome::of(&e), None)
            }
            Ok(Ok(bytes)) => match image_size(&bytes) {
                Ok(size) => (
                    FetchOutcome::Ok,
                    Some(KnownImage {
                        identity: identity::content_identity(&bytes),
                        size,
                    }),
                ),
                Err(_) => (FetchOutcome::NotImage, None),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// PNG signature and IHDR of a 4×3 image.
    fn png() -> Vec<u8> {
        let mut b = b"\x89PNG\r\n\x1a\n\0\0\0\x0dIHDR".to_vec();
        b.extend_from_slice(&4u32.to_be_bytes());
        b.extend_from_slice(&3u32.to_be_bytes());
        b.extend_from_slice(&[8, 2, 0, 0, 0]);
        b
    }

    /// Serves fixed answers by URL and counts calls.
    #[derive(Default)]
    struct Canned {
        calls: AtomicU64,
    }

    impl ImageFetcher for Canned {
        fn fetch<'a>(&'a self, url: &'a str) -> BoxFuture<'a, Result<Vec<u8>, FetchError>> {
            self.calls.fetch_add(1, Ordering::Relaxed);
            Box::pin(async move {
                match url.rsplit('/').next() {
                    Some("a.png") => Ok(png()),
                    Some("text") => Ok(b"hello".to_vec()),
                    Some("slow") => {
                        tokio::time::sleep(Duration::from_secs(60)).await;
                        Ok(png())
                    }
                    Some("gone") => Err(FetchError::Status(404)),
                    _ => Err(FetchError::Refused(Refusal::Host)),
                }
            })
        }
    }

    fn remote(limits: FetchLimits) -> (Arc<Canned>, RemoteImages) {
        let canned = Arc::new(Canned::default());
        let r = RemoteImages::new(canned.clone(), limits);
        (canned, r)
    }

    #[tokio::test(start_paused = true)]
    async fn outcomes_are_counted_and_failures_keep_url_identity() {
        let (_, r) = remote(FetchLimits::default());
        let urls = [
            "https://h/a.png",
            "https://h/text",
            "https://h/slow",
            "https://h/gone",
            "https://other/x",
            "data:image/png;base64,iVBORw0KGgo=",
        ];
        let known = r.resolve(urls).await;
        let a = known.get("https://h/a.png").unwrap();
        assert_eq!(a.identity, identity::content_identity(&png()));
        assert_eq!((a.size.width, a.size.height), (4, 3));
        for url in &urls[1..5] {
            assert_eq!(known.identify(url), identity::url_identity(url), "{url}");
        }
        assert_eq!(known.identify(urls[5]), identity::identify(urls[5]));
        let s = r.stats();
        let counts: Vec<u64> = FetchOutcome::ALL.iter().map(|&o| s.count(o)).collect();
        // ok, cached, timeout, too_large, status, refused, not_image, error, limit
        assert_eq!(counts, [1, 0, 1, 0, 1, 1, 1, 0, 0]);
    }

    #[tokio::test]
    async fn the_cache_and_the_per_request_limit_bound_fetches() {
        let (canned, r) = remote(FetchLimits {
            max_per_request: 2,
            ..FetchLimits::default()
        });
        let url = "https://h/a.png";
        r.resolve([url, url]).await;
        r.resolve([url]).await;
        assert_eq!(canned.calls.load(Ordering::Relaxed), 1, "one fetch");
        assert_eq!(r.stats().count(FetchOutcome::Cached), 1);
        let known = r
            .resolve([
                "https://h/1/a.png",
                "https://h/2/a.png",
                "https://h/3/a.png",
            ])
            .await;
        assert!(known.get("https://h/3/a.png").is_none());
        assert_eq!(r.stats().count(FetchOutcome::Limit), 1);
        assert_eq!(canned.calls.load(Ordering::Relaxed), 3);
    }

    #[test]
    fn the_cache_holds_at_most_its_entries_and_forgets_expired_ones() {
        let image = KnownImage {
            identity: identity::content_identity(b"x"),
            size: ImageSize {
                width: 1,
                height: 1,
            },
        };
        let now = Instant::now();
        let mut c = IdentityCache::default();
        for i in 0..5 {
            c.insert(&format!("u{i}"), image, now + Duration::from_secs(1), 3);
        }
        assert_eq!(c.entries.len(), 3);
        assert!(c.get("u0", now).is_none());
        assert!(c.get("u4", now).is_some());
        assert!(c.get("u4", now + Duration::from_secs(2)).is_none());
        c.insert("u4", image, now + Duration::from_secs(9), 3);
        assert!(c.get("u4", now + Duration::from_secs(2)).is_some());
        assert_eq!(c.order.len(), 3, "a refreshed entry keeps its one place");
        c.insert("u", image, now, 0);
        assert!(!c.entries.contains_key("u"));
    }

    #[test]
    fn only_http_urls_are_remote() {
        assert!(is_remote("https://x/a.png"));
        assert!(is_remote("HTTP://x/a.png"));
        assert!(!is_remote("data:image/png;base64,AAAA"));
        assert!(!is_remote("file:///etc/passwd"));
        assert!(!is_remote("a.png"));
    }
}
