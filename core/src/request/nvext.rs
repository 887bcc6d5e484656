//! The `nvext` extension object (Dynamo's `NvExt`, dynamo-llm 1.1.0), as far as
//! routing reads it, and its limits.
//!
//! Field names and types follow Dynamo: `session_control` (`session_id`, `action`,
//! `timeout`), `agent_hints` (`priority`, `osl`, `speculative_prefill`,
//! `latency_sensitivity`; unknown hints are ignored), `token_data`,
//! `use_raw_prompt`, `cache_salt` (the tenant salt, [`parse_salt`]), and the worker-selection fields `backend_instance_id`,
//! `decode_worker_id`, `prefill_worker_id`, `dp_rank`, `prefill_dp_rank`. The
//! worker-selection fields are read only to be removed: a client never picks its
//! worker (see [`CLIENT_WORKER_FIELDS`]).

use std::borrow::Cow;
use std::fmt;
use std::ops::Range;

use serde::de::{self, Deserializer, IgnoredAny, MapAccess, Visitor};
use serde::Deserialize;

/// Longest accepted `nvext.session_control.session_id`, in bytes. Longer ids are
/// a 400: the id is a key in the session table and in every log line.
pub const MAX_SESSION_ID_BYTES: usize = 256;

/// Shortest accepted `nvext.session_control.timeout`, in seconds.
pub const MIN_SESSION_TIMEOUT_SECS: u64 = 1;

/// Longest accepted `nvext.session_control.timeout`, in seconds (one day). A
/// session pins a worker and its KV blocks; a client cannot hold them longer.
pub const MAX_SESSION_TIMEOUT_SECS: u64 = 86_400;

/// Default session inactivity timeout in seconds (Dynamo's default).
pub const DEFAULT_SESSION_TIMEOUT_SECS: u64 = 300;

/// Body fields in `nvext` that name a worker or a rank; removed before forwarding
/// whenever the body has an `nvext` object.
pub const CLIENT_WORKER_FIELDS: &[&str] = &[
    "backend_instance_id",
    "decode_worker_id",
    "prefill_worker_id",
    "dp_rank",
    "prefill_dp_rank",
];

/// What the client asked of the session (`nvext.session_control.action`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionAction {
    /// First turn: bind the session once this request succeeds.
    Open,
    /// Last turn: unbind once this response has finished.
    Close,
}

impl SessionAction {
    /// The JSON spelling (`"open"`, `"close"`).
    pub fn as_str(self) -> &'static str {
        match self {
            SessionAction::Open => "open",
            SessionAction::Close => "close",
        }
    }
}

/// `nvext.session_control`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionControl {
    /// The client's session id (1..=[`MAX_SESSION_ID_BYTES`] bytes).
    pub session_id: String,
    /// `open`, `close`, or absent for a middle turn.
    pub action: Option<SessionAction>,
    /// Inactivity timeout in seconds, within
    /// [`MIN_SESSION_TIMEOUT_SECS`]..=[`MAX_SESSION_TIMEOUT_SECS`] when given.
    pub timeout: Option<u64>,
}

impl SessionControl {
    /// The inactivity timeout, with the default applied.
    pub fn timeout_secs(&self) -> u64 {
        self.timeout.unwrap_or(DEFAULT_SESSION_TIMEOUT_SECS)
    }
}

/// `nvext.agent_hints`: hints from agent frameworks. Unknown hints are ignored.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct AgentHints {
    /// Request priority; higher is more important.
    pub priority: Option<i32>,
    /// Expected output length in tokens.
    pub osl: Option<u32>,
    /// Prefill the predicted next-turn prefix after this turn.
    pub speculative_prefill: Option<bool>,
    /// Deprecated alias for router-only priority.
    pub latency_sensitivity: Option<f64>,
}

/// The `nvext` extension object.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct NvExt {
    /// Where the `nvext` object sits in the body it was parsed from (the span of
    /// its JSON value); `None` when the body has none. The body rewrite uses it.
    pub span: Option<Range<usize>>,
    /// Sticky-session control.
    pub session_control: Option<SessionControl>,
    /// Hints from agent frameworks.
    pub agent_hints: Option<AgentHints>,
    /// Pre-tokenized prompt.
    pub token_data: Option<Vec<u32>>,
    /// Bypass the chat template.
    pub use_raw_prompt: Option<bool>,
    /// The tenant's cache salt (non-empty).
    pub cache_salt: Option<String>,
    /// Worker the client asked for. Never honoured; removed from the body.
    pub backend_instance_id: Option<u64>,
    /// Decode worker the client asked for. Never honoured; removed from the body.
    pub decode_worker_id: Option<u64>,
    /// Prefill worker the client asked for. Never honoured; removed from the body.
    pub prefill_worker_id: Option<u64>,
    /// Decode DP rank the client asked for. Never honoured; removed from the body.
    pub dp_rank: Option<u32>,
    /// Prefill DP rank the client asked for. Never honoured; removed from the body.
    pub prefill_dp_rank: Option<u32>,
}

impl NvExt {
    /// Whether the client named a worker or rank (the rewrite removes them).
    pub fn names_worker(&self) -> bool {
        self.backend_instance_id.is_some()
            || self.decode_worker_id.is_some()
            || self.prefill_worker_id.is_some()
            || self.dp_rank.is_some()
            || self.prefill_dp_rank.is_some()
    }
}

/// An object key: borrowed from the body unless it had escapes (so
/// `"backend\u005finstance_id"` is still `backend_instance_id`).
pub(super) struct Key<'a>(pub Cow<'a, str>);

impl<'de> Deserialize<'de> for Key<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Key<'de>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Borrowed(v)))
            }
            fn visit_str<E>(self, v: &str) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Owned(v.to_string())))
            }
            fn visit_string<E>(self, v: String) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Owned(v)))
            }
        }
        d.deserialize_str(V)
    }
}

/// Reads the `nvext` object. Errors carry the field (relative to `nvext`) in
/// `path`, set before the failing value is read.
pub(super) struct NvExtVisitor<'p> {
    pub path: &'p mut Vec<&'static str>,
}

fn once<E: de::Error, T>(slot: &Option<T>, name: &'static str) -> Result<(), E> {
    if slot.is_some() {
        return Err(E::custom(format_args!("duplicate field `{name}`")));
    }
    Ok(())
}

impl<'de> Visitor<'de> for NvExtVisitor<'_> {
    type Value = NvExt;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<NvExt, A::Error> {
        let mut nv = NvExt::default();
        while let Some(Key(key)) = map.next_key::<Key>()? {
            match key.as_ref() {
                "session_control" => {
                    self.path.push("session_control");
                    once(&nv.session_control, "session_control")?;
                    nv.session_control = map.next_value_seed(SessionSeed {
                        path: &mut *self.path,
                    })?;
                }
                "agent_hints" => {
                    self.path.push("agent_hints");
                    once(&nv.agent_hints, "agent_hints")?;
                    nv.agent_hints = map.next_value()?;
                }
                "token_data" => {
                    self.path.push("token_data");
                    once(&nv.token_data, "token_data")?;
                    nv.token_data = map.next_value()?;
                }
                "use_raw_prompt" => {
                    self.path.push("use_raw_prompt");
                    once(&nv.use_raw_prompt, "use_raw_prompt")?;
                    nv.use_raw_prompt = map.next_value()?;
                }
                "cache_salt" => {
                    self.path.push("cache_salt");
                    once(&nv.cache_salt, "cache_salt")?;
                    nv.cache_salt = parse_salt(&mut map)?;
                }
                // Worker fields may repeat: every copy is removed from the body.
                "backend_instance_id" => {
                    self.path.push("backend_instance_id");
                    nv.backend_instance_id =
                        map.next_value::<Option<u64>>()?.or(nv.backend_instance_id);
                }
                "decode_worker_id" => {
                    self.path.push("decode_worker_id");
                    nv.decode_worker_id = map.next_value::<Option<u64>>()?.or(nv.decode_worker_id);
                }
                "prefill_worker_id" => {
                    self.path.push("prefill_worker_id");
                    nv.prefill_worker_id =
                        map.next_value::<Option<u64>>()?.or(nv.prefill_worker_id);
                }
                "dp_rank" => {
                    self.path.push("dp_rank");
                    nv.dp_rank = map.next_value::<Option<u32>>()?.or(nv.dp_rank);
                }
                "prefill_dp_rank" => {
                    self.path.push("prefill_dp_rank");
                    nv.prefill_dp_rank = map.next_value::<Option<u32>>()?.or(nv.prefill_dp_rank);
                }
                _ => {
                    map.next_value::<IgnoredAny>()?;
                    continue;
                }
            }
            self.path.pop();
        }
        Ok(nv)
    }
}

/// Reads a `cache_salt` value: a non-empty string, or `null` for none. vLLM
/// refuses an empty salt, so kvpick does too (rather than hash as unsalted a
/// request the engine would reject).
pub(super) fn parse_salt<'de, A: MapAccess<'de>>(map: &mut A) -> Result<Option<String>, A::Error> {
    match map.next_value::<Option<Key>>()? {
        Some(Key(s)) if s.is_empty() => Err(de::Error::custom("must be a non-empty string")),
        salt => Ok(salt.map(|Key(s)| s.into_owned())),
    }
}

struct SessionSeed<'p> {
    path: &'p mut Vec<&'static str>,
}

impl<'de> de::DeserializeSeed<'de> for SessionSeed<'_> {
    type Value = Option<SessionControl>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_option(self)
    }
}

impl<'de> Visitor<'de> for SessionSeed<'_> {
    type Value = Option<SessionControl>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an object with `session_id`")
    }

    fn visit_none<E>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_map(self)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut id: Option<String> = None;
        let mut action: Option<Option<SessionAction>> = None;
        let mut timeout: Option<Option<u64>> = None;
        while let Some(Key(key)) = map.next_key::<Key>()? {
            match key.as_ref() {
                "session_id" => {
                    self.path.push("session_id");
                    once(&id, "session_id")?;
                    let v: String = map.next_value()?;
                    if v.is_empty() {
                        return Err(de::Error::custom("must not be empty"));
                    }
                    if v.len() > MAX_SESSION_ID_BYTES {
                        return Err(de::Error::custom(format_args!(
                            "is {} bytes; at most {MAX_SESSION_ID_BYTES} are accepted",
                            v.len()
                        )));
                    }
                    id = Some(v);
                }
                "action" => {
                    self.path.push("action");
                    once(&action, "action")?;
                    let v: Option<Key> = map.next_value()?;
                    action = Some(match v.as_ref().map(|k| k.0.as_ref()) {
                        None => None,
                        Some("open") => Some(SessionAction::Open),
                        Some("close") => Some(SessionAction::Close),
                        Some(other) => {
                            return Err(de::Error::custom(format_args!(
                                "`{other}` is not `open` or `close`"
                            )))
                        }
                    });
                }
                "timeout" => {
                    self.path.push("timeout");
                    once(&timeout, "timeout")?;
                    let v: Option<u64> = map.next_value()?;
                    if let Some(t) = v {
                        if !(MIN_SESSION_TIMEOUT_SECS..=MAX_SESSION_TIMEOUT_SECS).contains(&t) {
                            return Err(de::Error::custom(format_args!(
                                "{t} s is outside {MIN_SESSION_TIMEOUT_SECS}..={MAX_SESSION_TIMEOUT_SECS} s"
                            )));
                        }
                    }
                    timeout = Some(v);
                }
                _ => {
                    map.next_value::<IgnoredAny>()?;
                    continue;
                }
            }
            self.path.pop();
        }
        let Some(session_id) = id else {
            self.path.push("session_id");
            return Err(de::Error::custom("missing"));
        };
        Ok(Some(SessionControl {
            session_id,
            action: action.flatten(),
            timeout: timeout.flatten(),
        }))
    }
}
