//! Sticky sessions: session id → (decode worker, rank) and, in disaggregated
//! pools, the prefill (worker, rank), with an inactivity timeout, a bounded table
//! and signed session tokens.
//!
//! The lifecycle follows Dynamo's `nvext.session_control` (PR #7665, dynamo-llm
//! 1.1.0 nvext; see `docs/scheduling.md`), driven by the scheduler through
//! [`SessionStore::pin`] (at pick time) and [`SessionStore::settle`] (when the
//! response has finished):
//! - the inactivity timeout comes from the `open` turn (default 300 s) and is kept
//!   by the binding; middle turns slide the expiry by that timeout, whatever
//!   `timeout` they carry;
//! - a session is bound once a turn's response succeeds; `close` unbinds once its
//!   response has finished (or its stream was dropped, as Dynamo's deferred close);
//! - when the bound worker is gone, the turn is re-homed ([`Pin::Rehome`]): the
//!   scheduler picks a new worker and the request becomes an `open` carrying the
//!   session's timeout, so the new worker's sidecar opens the engine session.
//!
//! Client-supplied timeouts are clamped to [`MAX_TIMEOUT`] and every deadline is
//! computed with checked arithmetic. The table holds at most
//! [`SessionConfig::max_entries`] sessions; past that the least recently used one
//! is evicted (and counted).
//!
//! So that several kvpick replicas (or a restarted one) keep a session on its
//! worker, responses carry a token naming the session, its workers, its timeout
//! and an expiry, signed with HMAC-SHA256 under a key shared by the replicas. The
//! token lifetime is capped server-side ([`SessionConfig::token_max_lifetime`]).
//! Token format (ASCII), the MAC covering everything before its last dot:
//! `v2.<instance id>.<dp rank>.<prefill instance id|->.<prefill dp rank|->.<expiry
//! unix secs>.<timeout secs>.<hex session id>.<hex mac>`.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use hmac::{Hmac, Mac};
use parking_lot::Mutex;
use rand::RngCore;
use sha2::Sha256;

use crate::endpoints::WorkerKey;
use crate::request::{
    InferenceRequest, SessionAction, DEFAULT_SESSION_TIMEOUT_SECS, MAX_SESSION_TIMEOUT_SECS,
};

type HmacSha256 = Hmac<Sha256>;

/// Token format version prefix.
const TOKEN_VERSION: &str = "v2";

/// The longest inactivity timeout a session can hold (one day); longer requested
/// timeouts are clamped here.
pub const MAX_TIMEOUT: Duration = Duration::from_secs(MAX_SESSION_TIMEOUT_SECS);

/// The default inactivity timeout (Dynamo's default, 300 s).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(DEFAULT_SESSION_TIMEOUT_SECS);

/// `now + d`, or `now + MAX_TIMEOUT` when that overflows (never panics).
fn deadline(now: Instant, d: Duration) -> Instant {
    now.checked_add(d)
        .or_else(|| now.checked_add(MAX_TIMEOUT))
        .unwrap_or(now)
}

/// `now + d` in wall-clock time, saturating the same way as [`deadline`].
fn wall_deadline(now: SystemTime, d: Duration) -> SystemTime {
    now.checked_add(d)
        .or_else(|| now.checked_add(MAX_TIMEOUT))
        .unwrap_or(now)
}

/// A client-requested timeout in seconds, clamped to `1..=MAX_TIMEOUT`.
pub fn clamp_timeout(secs: u64) -> Duration {
    Duration::from_secs(secs.clamp(1, MAX_TIMEOUT.as_secs()))
}

/// Session table settings.
#[derive(Debug, Clone)]
pub struct SessionConfig {
    /// HMAC key for session tokens (empty: a random per-process key).
    pub key: Vec<u8>,
    /// Most sessions held; past it the least recently used one is evicted.
    pub max_entries: usize,
    /// Longest a session token stays valid after the turn that issued it.
    pub token_max_lifetime: Duration,
}

impl Default for SessionConfig {
    fn default() -> Self {
        SessionConfig {
            key: Vec::new(),
            max_entries: 100_000,
            token_max_lifetime: Duration::from_secs(3600),
        }
    }
}

/// The session turn a request belongs to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionTurn {
    /// The client's session id.
    pub id: String,
    /// `open`, `close`, or `None` for a middle turn (or a header session).
    pub action: Option<SessionAction>,
    /// The session's inactivity timeout: the `open` turn's (clamped) or the
    /// default; once pinned, the timeout the binding holds.
    pub timeout: Duration,
    /// The session's worker was gone and this turn goes to a new one: the request
    /// must be forwarded as an `open` carrying [`SessionTurn::timeout`].
    pub rehomed: bool,
}

impl SessionTurn {
    /// The session turn of a request: the body's `nvext.session_control`, else the
    /// session header `header_id` (a middle turn). Only an `open` turn's `timeout`
    /// counts (Dynamo: "only used with action open").
    pub fn of(body: Option<&InferenceRequest>, header_id: Option<&str>) -> Option<SessionTurn> {
        if let Some(sc) = body.and_then(|b| b.session()) {
            let timeout = match sc.action {
                Some(SessionAction::Open) => clamp_timeout(sc.timeout_secs()),
                _ => DEFAULT_TIMEOUT,
            };
            return Some(SessionTurn {
                id: sc.session_id.clone(),
                action: sc.action,
                timeout,
                rehomed: false,
            });
        }
        header_id.map(|id| SessionTurn {
            id: id.to_string(),
            action: None,
            timeout: DEFAULT_TIMEOUT,
            rehomed: false,
        })
    }
}

/// Where a session turn's workers stand at pick time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pin {
    /// Bound (or named by a valid token) to this ready decode rank, and to this
    /// prefill rank in disaggregated pools (the scheduler checks it is ready).
    Ready {
        /// The decode (worker, rank).
        decode: WorkerKey,
        /// The prefill (worker, rank), if the session has one.
        prefill: Option<WorkerKey>,
    },
    /// Bound to a decode rank that is no longer a candidate: the binding was
    /// dropped and the turn is re-homed (see [`SessionTurn::rehomed`]).
    Rehome,
    /// Not bound here and no valid token.
    Unbound,
}

/// One bound session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Binding {
    /// The decode (worker, rank) the session is pinned to.
    pub worker: WorkerKey,
    /// The prefill (worker, rank), in disaggregated pools.
    pub prefill: Option<WorkerKey>,
    /// When the binding lapses unless another turn arrives.
    pub expires: Instant,
    /// The inactivity timeout that slides `expires` on each turn.
    pub timeout: Duration,
}

/// What a valid session token says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenClaims {
    /// The decode worker the session was bound to.
    pub worker: WorkerKey,
    /// The prefill worker, in disaggregated pools.
    pub prefill: Option<WorkerKey>,
    /// The session's inactivity timeout.
    pub timeout: Duration,
    /// Expiry, in seconds since the Unix epoch.
    pub expires_unix: u64,
}

#[derive(Debug)]
struct Entry {
    binding: Binding,
    /// Position in the LRU order.
    stamp: u64,
}

/// The bindings and their least-recently-used order.
#[derive(Debug, Default)]
struct Table {
    map: HashMap<Arc<str>, Entry>,
    /// stamp → id, oldest first.
    lru: BTreeMap<u64, Arc<str>>,
    next: u64,
}

impl Table {
    fn stamp(&mut self) -> u64 {
        self.next += 1;
        self.next
    }

    fn remove(&mut self, id: &str) -> Option<Binding> {
        let e = self.map.remove(id)?;
        self.lru.remove(&e.stamp);
        Some(e.binding)
    }

    /// Marks `id` as just used.
    fn touch(&mut self, id: &str) {
        let stamp = self.stamp();
        if let Some((k, e)) = self.map.get_key_value(id) {
            let k = k.clone();
            let old = e.stamp;
            self.lru.remove(&old);
            self.lru.insert(stamp, k);
            if let Some(e) = self.map.get_mut(id) {
                e.stamp = stamp;
            }
        }
    }

    /// Inserts or replaces; returns how many sessions were evicted to make room.
    fn insert(&mut self, id: &str, binding: Binding, max: usize) -> u64 {
        if let Some(e) = self.map.get_mut(id) {
            e.binding = binding;
            self.touch(id);
            return 0;
        }
        let mut evicted = 0;
        while self.map.len() >= max.max(1) {
            let Some((_, oldest)) = self.lru.pop_first() else {
                break;
            };
            self.map.remove(&oldest);
            evicted += 1;
        }
        let stamp = self.stamp();
        let key: Arc<str> = Arc::from(id);
        self.lru.insert(stamp, key.clone());
        self.map.insert(key, Entry { binding, stamp });
        evicted
    }
}

/// The session table and the token signer.
#[derive(Debug)]
pub struct SessionStore {
    table: Mutex<Table>,
    config: SessionConfig,
    evictions: AtomicU64,
}

/// Makes a random 32-byte signing key (used when no shared key is configured).
pub fn random_key() -> Vec<u8> {
    let mut key = vec![0u8; 32];
    rand::rng().fill_bytes(&mut key);
    key
}

impl SessionStore {
    /// An empty store with default bounds signing tokens with `key` (an empty key
    /// is replaced by a random one).
    pub fn new(key: Vec<u8>) -> Self {
        Self::with_config(SessionConfig {
            key,
            ..SessionConfig::default()
        })
    }

    /// An empty store with `config`.
    pub fn with_config(mut config: SessionConfig) -> Self {
        if config.key.is_empty() {
            config.key = random_key();
        }
        SessionStore {
            table: Mutex::new(Table::default()),
            config,
            evictions: AtomicU64::new(0),
        }
    }

    /// Sessions evicted because the table was full.
    pub fn evictions(&self) -> u64 {
        self.evictions.load(Ordering::Relaxed)
    }

    /// The decode worker `id` is bound to, if the binding has not expired at `now`.
    pub fn get(&self, id: &str, now: Instant) -> Option<WorkerKey> {
        self.live(id, now).map(|b| b.worker)
    }

    /// The live binding of `id` at `now`; an expired one is dropped.
    fn live(&self, id: &str, now: Instant) -> Option<Binding> {
        let mut t = self.table.lock();
        let b = t.map.get(id)?.binding;
        if b.expires > now {
            return Some(b);
        }
        t.remove(id);
        None
    }

    /// Binds (or re-binds) `id` to `worker` (and `prefill`) until `now + timeout`
    /// (`timeout` clamped to [`MAX_TIMEOUT`]).
    pub fn bind(
        &self,
        id: &str,
        worker: WorkerKey,
        prefill: Option<WorkerKey>,
        timeout: Duration,
        now: Instant,
    ) {
        let timeout = timeout.min(MAX_TIMEOUT);
        let binding = Binding {
            worker,
            prefill,
            expires: deadline(now, timeout),
            timeout,
        };
        let evicted = self
            .table
            .lock()
            .insert(id, binding, self.config.max_entries);
        if evicted > 0 {
            self.evictions.fetch_add(evicted, Ordering::Relaxed);
        }
    }

    /// Slides a live binding to `now + its timeout`; false if there is none.
    pub fn touch(&self, id: &str, now: Instant) -> bool {
        let mut t = self.table.lock();
        match t.map.get_mut(id) {
            Some(e) if e.binding.expires > now => {
                e.binding.expires = deadline(now, e.binding.timeout);
                t.touch(id);
                true
            }
            _ => false,
        }
    }

    /// Removes the binding of `id`; true if there was one.
    pub fn unbind(&self, id: &str) -> bool {
        self.table.lock().remove(id).is_some()
    }

    /// The binding of `id`, expired or not.
    pub fn binding(&self, id: &str) -> Option<Binding> {
        self.table.lock().map.get(id).map(|e| e.binding)
    }

    /// The workers a turn is pinned to. `is_ready` says whether a decode rank can
    /// take the turn. A live binding to a ready rank slides its expiry by the
    /// binding's timeout (an `open` turn replaces that timeout); one to a gone
    /// rank is dropped and the turn re-homed. Without a binding, a valid signed
    /// token (from another replica, or this one before a restart) is adopted.
    /// Sets `turn.timeout` to the session's timeout and `turn.rehomed`.
    pub fn pin(
        &self,
        turn: &mut SessionTurn,
        token: Option<&str>,
        is_ready: impl Fn(WorkerKey) -> bool,
        now: Instant,
    ) -> Pin {
        let reopen = turn.action == Some(SessionAction::Open);
        let known = match self.live(&turn.id, now) {
            Some(b) => Some((b.worker, b.prefill, b.timeout, true)),
            None => token
                .and_then(|t| self.verify(t, &turn.id, SystemTime::now()))
                .map(|c| (c.worker, c.prefill, c.timeout, false)),
        };
        let Some((worker, prefill, timeout, local)) = known else {
            return Pin::Unbound;
        };
        if !reopen {
            turn.timeout = timeout;
        }
        if !is_ready(worker) {
            if local {
                self.unbind(&turn.id);
            }
            // A closing turn needs no engine session on the new worker.
            turn.rehomed = turn.action != Some(SessionAction::Close);
            return Pin::Rehome;
        }
        self.bind(&turn.id, worker, prefill, turn.timeout, now);
        Pin::Ready {
            decode: worker,
            prefill,
        }
    }

    /// A routed turn has finished on `worker` (and `prefill`) with HTTP `status`
    /// (if a response arrived): `close` unbinds, whether or not the response
    /// completed; a success binds (the opening turn, a re-homed turn, or a turn
    /// of a session this replica did not know) and slides the expiry by the
    /// session's timeout.
    pub fn settle(
        &self,
        turn: &SessionTurn,
        worker: WorkerKey,
        prefill: Option<WorkerKey>,
        status: Option<u16>,
        now: Instant,
    ) {
        if turn.action == Some(SessionAction::Close) {
            self.unbind(&turn.id);
        } else if status.is_some_and(|c| (200..300).contains(&c)) {
            self.bind(&turn.id, worker, prefill, turn.timeout, now);
        }
    }

    /// The signed token a successful response of `turn` carries (none for
    /// `close`); valid for the session's timeout, at most the configured cap.
    pub fn turn_token(
        &self,
        turn: &SessionTurn,
        worker: WorkerKey,
        prefill: Option<WorkerKey>,
    ) -> Option<String> {
        if turn.action == Some(SessionAction::Close) {
            return None;
        }
        let life = turn.timeout.min(self.config.token_max_lifetime);
        let expires = wall_deadline(SystemTime::now(), life);
        Some(self.token(&turn.id, worker, prefill, turn.timeout, expires))
    }

    /// Removes every binding expired at `now`; returns how many went.
    pub fn reap(&self, now: Instant) -> usize {
        let mut t = self.table.lock();
        let expired: Vec<Arc<str>> = t
            .map
            .iter()
            .filter(|(_, e)| e.binding.expires <= now)
            .map(|(k, _)| k.clone())
            .collect();
        for id in &expired {
            t.remove(id);
        }
        expired.len()
    }

    /// Bindings held (including expired ones not yet reaped).
    pub fn len(&self) -> usize {
        self.table.lock().map.len()
    }

    /// Whether no session is bound.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn mac(&self, payload: &str) -> HmacSha256 {
        // HMAC accepts keys of any length.
        let mut mac =
            HmacSha256::new_from_slice(&self.config.key).expect("HMAC takes any key length");
        mac.update(payload.as_bytes());
        mac
    }

    /// A signed token naming session `id`, its workers and timeout, and an expiry.
    pub fn token(
        &self,
        id: &str,
        worker: WorkerKey,
        prefill: Option<WorkerKey>,
        timeout: Duration,
        expires: SystemTime,
    ) -> String {
        let exp = expires
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs();
        let (pi, pr) = match prefill {
            Some(p) => (p.instance_id.to_string(), p.dp_rank.to_string()),
            None => ("-".to_string(), "-".to_string()),
        };
        let payload = format!(
            "{TOKEN_VERSION}.{}.{}.{pi}.{pr}.{exp}.{}.{}",
            worker.instance_id,
            worker.dp_rank,
            timeout.as_secs(),
            hex(id.as_bytes())
        );
        let sig = self.mac(&payload).finalize().into_bytes();
        format!("{payload}.{}", hex(&sig))
    }

    /// Checks a token for session `id` at wall-clock `now`: `None` when it is
    /// malformed, forged (bad MAC), expired, names another session, or expires
    /// further ahead than this replica's token lifetime cap allows.
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
        let prefill = match (parts.next()?, parts.next()?) {
            ("-", "-") => None,
            (i, r) => Some(WorkerKey {
                instance_id: i.parse().ok()?,
                dp_rank: r.parse().ok()?,
            }),
        };
        let expires_unix: u64 = parts.next()?.parse().ok()?;
        let timeout = clamp_timeout(parts.next()?.parse().ok()?);
        let sid = unhex(parts.next()?)?;
        if parts.next().is_some() || sid != id.as_bytes() {
            return None;
        }
        let now_unix = now.duration_since(UNIX_EPOCH).unwrap_or_default().as_secs();
        // One second of slack for the rounding of `exp` and clock steps.
        let latest = now_unix
            .saturating_add(self.config.token_max_lifetime.as_secs())
            .saturating_add(1);
        if expires_unix <= now_unix || expires_unix > latest {
            return None;
        }
        Some(TokenClaims {
            worker: WorkerKey {
                instance_id,
                dp_rank,
            },
            prefill,
            timeout,
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

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    #[test]
    fn ttl_slides_by_the_binding_timeout_and_expires() {
        let s = SessionStore::new(b"k".to_vec());
        let t = Instant::now();
        s.bind("a", w(1, 0), None, secs(10), t);
        assert_eq!(s.get("a", t + secs(9)), Some(w(1, 0)));
        assert!(s.touch("a", t + secs(9)));
        assert_eq!(s.get("a", t + secs(18)), Some(w(1, 0)));
        assert_eq!(s.get("a", t + secs(19)), None);
        assert!(s.is_empty(), "an expired binding is dropped on read");
        assert!(!s.touch("a", t + secs(20)));
    }

    #[test]
    fn reap_removes_only_expired() {
        let s = SessionStore::new(b"k".to_vec());
        let t = Instant::now();
        s.bind("short", w(1, 0), None, secs(5), t);
        s.bind("long", w(2, 1), Some(w(7, 0)), secs(50), t);
        assert_eq!(s.reap(t + secs(6)), 1);
        assert_eq!(s.len(), 1);
        assert_eq!(s.binding("long").unwrap().prefill, Some(w(7, 0)));
        assert!(s.unbind("long"));
        assert!(!s.unbind("long"));
    }

    #[test]
    fn huge_timeouts_are_clamped_and_never_overflow() {
        let s = SessionStore::new(b"k".to_vec());
        let t = Instant::now();
        assert_eq!(clamp_timeout(u64::MAX), MAX_TIMEOUT);
        assert_eq!(clamp_timeout(0), secs(1));
        s.bind("a", w(1, 0), None, Duration::MAX, t);
        assert_eq!(s.binding("a").unwrap().timeout, MAX_TIMEOUT);
        assert!(s.touch("a", t + secs(1)));
        assert_eq!(
            s.reap(t + MAX_TIMEOUT + secs(2)),
            1,
            "a clamped session is reaped"
        );
        assert_eq!(deadline(t, Duration::MAX), t + MAX_TIMEOUT);
        let turn = SessionTurn {
            id: "a".into(),
            action: None,
            timeout: Duration::MAX,
            rehomed: false,
        };
        assert!(s.turn_token(&turn, w(1, 0), None).is_some());
    }

    #[test]
    fn table_is_bounded_and_evicts_the_least_recently_used() {
        let s = SessionStore::with_config(SessionConfig {
            key: b"k".to_vec(),
            max_entries: 3,
            ..SessionConfig::default()
        });
        let t = Instant::now();
        for id in ["a", "b", "c"] {
            s.bind(id, w(1, 0), None, secs(60), t);
        }
        assert!(s.touch("a", t), "a is now the most recently used");
        s.bind("d", w(2, 0), None, secs(60), t);
        assert_eq!(s.len(), 3);
        assert_eq!(s.evictions(), 1);
        assert!(s.binding("b").is_none(), "the least recently used went");
        assert!(s.binding("a").is_some() && s.binding("d").is_some());
        // Re-binding a held id evicts nothing.
        s.bind("d", w(3, 0), None, secs(60), t);
        assert_eq!(s.evictions(), 1);
        for i in 0..1000 {
            s.bind(&format!("flood-{i}"), w(1, 0), None, secs(60), t);
        }
        assert_eq!(s.len(), 3);
        assert_eq!(s.evictions(), 1001);
    }

    #[test]
    fn token_lifetime_is_capped_server_side() {
        let s = SessionStore::with_config(SessionConfig {
            key: b"k".to_vec(),
            token_max_lifetime: secs(600),
            ..SessionConfig::default()
        });
        let turn = SessionTurn {
            id: "s".into(),
            action: Some(SessionAction::Open),
            timeout: MAX_TIMEOUT,
            rehomed: false,
        };
        let now = SystemTime::now();
        let tok = s.turn_token(&turn, w(1, 0), None).unwrap();
        let c = s.verify(&tok, "s", now).unwrap();
        let now_unix = now.duration_since(UNIX_EPOCH).unwrap().as_secs();
        assert!(c.expires_unix <= now_unix + 601, "expiry capped at 600 s");
        assert_eq!(c.timeout, MAX_TIMEOUT, "the session keeps its timeout");
        assert!(s.verify(&tok, "s", now + secs(602)).is_none());
        // A token minted (with the same key) for longer than the cap is refused.
        let long = s.token("s", w(1, 0), None, secs(60), now + secs(86_400));
        assert!(s.verify(&long, "s", now).is_none());
    }

    #[test]
    fn tokens_verify_and_reject_forgeries() {
        let s = SessionStore::new(b"secret".to_vec());
        let now = SystemTime::now();
        let exp = now + secs(60);
        let tok = s.token("sess.1", w(42, 3), Some(w(9, 1)), secs(120), exp);
        let c = s.verify(&tok, "sess.1", now).unwrap();
        assert_eq!(c.worker, w(42, 3));
        assert_eq!(c.prefill, Some(w(9, 1)));
        assert_eq!(c.timeout, secs(120));
        // Another session id, expired, other key, tampered worker.
        assert!(s.verify(&tok, "sess.2", now).is_none());
        assert!(s.verify(&tok, "sess.1", exp + secs(1)).is_none());
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

    #[test]
    fn pin_rehomes_a_gone_worker_with_the_session_timeout() {
        let s = SessionStore::new(b"k".to_vec());
        let t = Instant::now();
        s.bind("s", w(1, 0), None, secs(3600), t);
        let mut turn = SessionTurn {
            id: "s".into(),
            action: None,
            timeout: DEFAULT_TIMEOUT,
            rehomed: false,
        };
        assert_eq!(s.pin(&mut turn, None, |_| false, t), Pin::Rehome);
        assert!(turn.rehomed);
        assert_eq!(turn.timeout, secs(3600));
        assert!(s.is_empty());
        // A closing turn is re-picked but not re-opened.
        s.bind("s", w(1, 0), None, secs(3600), t);
        let mut close = SessionTurn {
            action: Some(SessionAction::Close),
            ..turn.clone()
        };
        close.rehomed = false;
        assert_eq!(s.pin(&mut close, None, |_| false, t), Pin::Rehome);
        assert!(!close.rehomed);
    }
}
