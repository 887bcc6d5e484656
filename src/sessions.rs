//! Sticky sessions: session id → (worker, dp rank), with a sliding inactivity TTL
//! and signed session tokens.
//!
//! The lifecycle, driven by the scheduler through [`SessionStore::pin`] (at pick
//! time) and [`SessionStore::settle`] (when the response has finished): a session
//! is bound once a turn's response succeeds, its TTL slides on every turn, and a
//! `close` turn unbinds it once its response has finished. Expired bindings are
//! reaped ([`SessionStore::reap`]).
//!
//! So that several kvpick replicas (or a restarted one) keep a session on its
//! worker, responses carry a token naming the session, the worker and an expiry,
//! signed with HMAC-SHA256 under a key shared by the replicas. Token format (ASCII):
//! `v1.<instance id>.<dp rank>.<expiry unix secs>.<hex session id>.<hex mac>`, the
//! MAC covering everything before its last dot.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use dashmap::DashMap;
use hmac::{Hmac, Mac};
use rand::RngCore;
use sha2::Sha256;

use crate::endpoints::WorkerKey;
use crate::request::{InferenceRequest, SessionAction, DEFAULT_SESSION_TIMEOUT_SECS};

type HmacSha256 = Hmac<Sha256>;

/// Token format version prefix.
const TOKEN_VERSION: &str = "v1";

/// The session turn a request belongs to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionTurn {
    /// The client's session id.
    pub id: String,
    /// `open`, `close`, or `None` for a middle turn (or a header session).
    pub action: Option<SessionAction>,
    /// Inactivity timeout.
    pub timeout: Duration,
}

impl SessionTurn {
    /// The session turn of a request: the body's `nvext.session_control`, else the
    /// session header `header_id` (a middle turn with the default timeout).
    pub fn of(body: Option<&InferenceRequest>, header_id: Option<&str>) -> Option<SessionTurn> {
        if let Some(sc) = body.and_then(|b| b.session()) {
            return Some(SessionTurn {
                id: sc.session_id.clone(),
                action: sc.action,
                timeout: Duration::from_secs(sc.timeout_secs().max(1)),
            });
        }
        header_id.map(|id| SessionTurn {
            id: id.to_string(),
            action: None,
            timeout: Duration::from_secs(DEFAULT_SESSION_TIMEOUT_SECS),
        })
    }
}

/// Where a session turn's worker stands at pick time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pin {
    /// Bound (or named by a valid token) to this ready worker.
    Ready(WorkerKey),
    /// Bound to a worker that is no longer a candidate; the binding was dropped.
    Gone,
    /// Not bound here and no valid token.
    Unbound,
}

/// One bound session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Binding {
    /// The (worker, rank) the session is pinned to.
    pub worker: WorkerKey,
    /// When the binding lapses unless another turn arrives.
    pub expires: Instant,
    /// The inactivity timeout that slides `expires` on each turn.
    pub timeout: Duration,
}

/// What a valid session token says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenClaims {
    /// The worker the session was bound to.
    pub worker: WorkerKey,
    /// Expiry, in seconds since the Unix epoch.
    pub expires_unix: u64,
}

/// The session table and the token signer.
#[derive(Debug)]
pub struct SessionStore {
    bindings: DashMap<String, Binding>,
    key: Vec<u8>,
}

/// Makes a random 32-byte signing key (used when no shared key is configured).
pub fn random_key() -> Vec<u8> {
    let mut key = vec![0u8; 32];
    rand::rng().fill_bytes(&mut key);
    key
}

impl SessionStore {
    /// An empty store signing tokens with `key` (an empty key is replaced by a random one).
    pub fn new(key: Vec<u8>) -> Self {
        let key = if key.is_empty() { random_key() } else { key };
        SessionStore {
            bindings: DashMap::new(),
            key,
        }
    }

    /// The worker `id` is bound to, if the binding has not expired at `now`.
    pub fn get(&self, id: &str, now: Instant) -> Option<WorkerKey> {
        let b = *self.bindings.get(id)?;
        if b.expires > now {
            return Some(b.worker);
        }
        self.bindings.remove_if(id, |_, v| v.expires <= now);
        None
    }

    /// Binds (or re-binds) `id` to `worker` until `now + timeout`.
    pub fn bind(&self, id: &str, worker: WorkerKey, timeout: Duration, now: Instant) {
        self.bindings.insert(
            id.to_string(),
            Binding {
                worker,
                expires: now + timeout,
                timeout,
            },
        );
    }

    /// Slides the TTL of a live binding to `now + timeout`; false if there is none.
    pub fn touch(&self, id: &str, timeout: Duration, now: Instant) -> bool {
        match self.bindings.get_mut(id) {
            Some(mut b) if b.expires > now => {
                b.timeout = timeout;
                b.expires = now + timeout;
                true
            }
            _ => false,
        }
    }

    /// Removes the binding of `id`; true if there was one.
    pub fn unbind(&self, id: &str) -> bool {
        self.bindings.remove(id).is_some()
    }

    /// The binding of `id`, expired or not.
    pub fn binding(&self, id: &str) -> Option<Binding> {
        self.bindings.get(id).map(|b| *b)
    }

    /// The worker a turn is pinned to. `is_ready` says whether a worker can take
    /// the turn. A live binding to a ready worker slides its TTL; one to a gone
    /// worker is dropped. Without a binding, a valid signed token (from another
    /// replica, or this one before a restart) is adopted as the binding.
    pub fn pin(
        &self,
        turn: &SessionTurn,
        token: Option<&str>,
        is_ready: impl Fn(WorkerKey) -> bool,
        now: Instant,
    ) -> Pin {
        if let Some(bound) = self.get(&turn.id, now) {
            if is_ready(bound) {
                self.touch(&turn.id, turn.timeout, now);
                return Pin::Ready(bound);
            }
            self.unbind(&turn.id);
            return Pin::Gone;
        }
        let Some(claims) = token.and_then(|t| self.verify(t, &turn.id, SystemTime::now())) else {
            return Pin::Unbound;
        };
        if is_ready(claims.worker) {
            self.bind(&turn.id, claims.worker, turn.timeout, now);
            Pin::Ready(claims.worker)
        } else {
            Pin::Gone
        }
    }

    /// A routed turn has finished on `worker` with HTTP `status` (if a response
    /// arrived): `close` unbinds; a success binds (the opening turn, or a turn of a
    /// session this replica did not know) and slides the TTL.
    pub fn settle(&self, turn: &SessionTurn, worker: WorkerKey, status: Option<u16>, now: Instant) {
        if turn.action == Some(SessionAction::Close) {
            self.unbind(&turn.id);
        } else if status.is_some_and(|c| (200..300).contains(&c)) {
            self.bind(&turn.id, worker, turn.timeout, now);
        }
    }

    /// The signed token a successful response of `turn` carries (none for `close`).
    pub fn turn_token(&self, turn: &SessionTurn, worker: WorkerKey) -> Option<String> {
        if turn.action == Some(SessionAction::Close) {
            return None;
        }
        Some(self.token(&turn.id, worker, SystemTime::now() + turn.timeout))
    }

    /// Removes every binding expired at `now`; returns how many went.
    pub fn reap(&self, now: Instant) -> usize {
        let before = self.bindings.len();
        self.bindings.retain(|_, b| b.expires > now);
        before.saturating_sub(self.bindings.len())
    }

    /// Bindings held (including expired ones not yet reaped).
    pub fn len(&self) -> usize {
        self.bindings.len()
    }

    /// Whether no session is bound.
    pub fn is_empty(&self) -> bool {
        self.bindings.is_empty()
    }

    fn mac(&self, payload: &str) -> HmacSha256 {
        // HMAC accepts keys of any length.
        let mut mac = HmacSha256::new_from_slice(&self.key).expect("HMAC takes any key length");
        mac.update(payload.as_bytes());
        mac
    }

    /// A signed token naming session `id`, `worker` and an expiry.
    pub fn token(&self, id: &str, worker: WorkerKey, expires: SystemTime) -> String {
        let exp = expires
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs();
        let payload = format!(
            "{TOKEN_VERSION}.{}.{}.{exp}.{}",
            worker.instance_id,
            worker.dp_rank,
            hex(id.as_bytes())
        );
        let sig = self.mac(&payload).finalize().into_bytes();
        format!("{payload}.{}", hex(&sig))
    }

    /// Checks a token for session `id` at wall-clock `now`: `None` when it is
    /// malformed, forged (bad MAC), expired, or names another session.
    pub fn verify(&self, token: &str, id: &str, now: SystemTime) -> Option<TokenClaims> {
        let (payload, sig) = token.rsplit_once('.')?;
        let sig = unhex(sig)?;
        self.mac(payload).verify_slice(&sig).ok()?;
        let mut parts = payload.split('.');
        if parts.next()? != TOKEN_VERSION {
            return None;
        }
        let instance_id = parts.next()?.parse().ok()?;
        let dp_rank = parts.next()?.parse().ok()?;
        let expires_unix: u64 = parts.next()?.parse().ok()?;
        let sid = unhex(parts.next()?)?;
        if parts.next().is_some() || sid != id.as_bytes() {
            return None;
        }
        let now_unix = now.duration_since(UNIX_EPOCH).unwrap_or_default().as_secs();
        if expires_unix <= now_unix {
            return None;
        }
        Some(TokenClaims {
            worker: WorkerKey {
                instance_id,
                dp_rank,
            },
            expires_unix,
        })
    }
}

fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(DIGITS[usize::from(b >> 4)] as char);
        s.push(DIGITS[usize::from(b & 15)] as char);
    }
    s
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if s.len() % 2 != 0 {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(i: u64, r: u32) -> WorkerKey {
        WorkerKey {
            instance_id: i,
            dp_rank: r,
        }
    }

    #[test]
    fn ttl_slides_and_expires() {
        let s = SessionStore::new(b"k".to_vec());
        let t = Instant::now();
        let ttl = Duration::from_secs(10);
        s.bind("a", w(1, 0), ttl, t);
        assert_eq!(s.get("a", t + Duration::from_secs(9)), Some(w(1, 0)));
        assert!(s.touch("a", ttl, t + Duration::from_secs(9)));
        assert_eq!(s.get("a", t + Duration::from_secs(18)), Some(w(1, 0)));
        assert_eq!(s.get("a", t + Duration::from_secs(19)), None);
        assert!(s.is_empty(), "an expired binding is dropped on read");
        assert!(!s.touch("a", ttl, t + Duration::from_secs(20)));
    }

    #[test]
    fn reap_removes_only_expired() {
        let s = SessionStore::new(b"k".to_vec());
        let t = Instant::now();
        s.bind("short", w(1, 0), Duration::from_secs(5), t);
        s.bind("long", w(2, 1), Duration::from_secs(50), t);
        assert_eq!(s.reap(t + Duration::from_secs(6)), 1);
        assert_eq!(s.len(), 1);
        assert_eq!(s.binding("long").unwrap().worker, w(2, 1));
        assert!(s.unbind("long"));
        assert!(!s.unbind("long"));
    }

    #[test]
    fn tokens_verify_and_reject_forgeries() {
        let s = SessionStore::new(b"secret".to_vec());
        let now = SystemTime::now();
        let exp = now + Duration::from_secs(60);
        let tok = s.token("sess.1", w(42, 3), exp);
        let c = s.verify(&tok, "sess.1", now).unwrap();
        assert_eq!(c.worker, w(42, 3));
        // Another session id, expired, other key, tampered worker.
        assert!(s.verify(&tok, "sess.2", now).is_none());
        assert!(s
            .verify(&tok, "sess.1", exp + Duration::from_secs(1))
            .is_none());
        let other = SessionStore::new(b"other".to_vec());
        assert!(other.verify(&tok, "sess.1", now).is_none());
        let tampered = tok.replacen(".42.", ".43.", 1);
        assert!(s.verify(&tampered, "sess.1", now).is_none());
        assert!(s.verify("garbage", "sess.1", now).is_none());
        assert!(s.verify("", "sess.1", now).is_none());
        // Replicas sharing the key accept each other's tokens.
        let replica = SessionStore::new(b"secret".to_vec());
        assert_eq!(replica.verify(&tok, "sess.1", now), Some(c));
    }
}
