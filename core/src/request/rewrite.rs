//! Rewriting a body's `nvext` object without touching the rest of the body.
//!
//! The parse pass records where `nvext` sits ([`NvExt::span`](super::NvExt));
//! a rewrite reads only that object's entries (keys decoded, so escaped spellings
//! match; every duplicate of a key is seen) and splices the new object in. The
//! prompt is copied once, as bytes, and never parsed again.

use std::borrow::Cow;
use std::fmt;

use serde::de::{Deserializer, MapAccess, Visitor};
use serde::Serialize;
use serde_json::value::RawValue;

use super::nvext::{Key, SessionAction, CLIENT_WORKER_FIELDS};
use super::{parse::parse_nvext, InferenceRequest, RequestError};

/// Edits to the `nvext` object of a request body.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct NvExtEdit {
    remove: Vec<Cow<'static, str>>,
    set: Vec<(String, String)>,
    session_action: Option<SessionAction>,
    session_timeout: Option<u64>,
}

impl NvExtEdit {
    /// The edit every forwarded body gets: remove the fields that name a worker
    /// or a rank ([`CLIENT_WORKER_FIELDS`]).
    pub fn strip_client_routing() -> Self {
        NvExtEdit {
            remove: CLIENT_WORKER_FIELDS
                .iter()
                .map(|f| Cow::Borrowed(*f))
                .collect(),
            ..Default::default()
        }
    }

    /// Also removes `field` (every copy of it).
    pub fn remove(mut self, field: impl Into<Cow<'static, str>>) -> Self {
        self.remove.push(field.into());
        self
    }

    /// Also sets `field` to `value` (replacing every copy of it); creates `nvext`
    /// when the body has none.
    pub fn set(mut self, field: impl Into<String>, value: &impl Serialize) -> Self {
        // Serializing plain data into a String cannot fail; a value that fails
        // (a map with non-string keys) is written as null.
        let json = serde_json::to_string(value).unwrap_or_else(|_| "null".into());
        self.set.push((field.into(), json));
        self
    }

    /// Also sets `nvext.session_control.action` (when the body has a
    /// `session_control`).
    pub fn session_action(mut self, action: SessionAction) -> Self {
        self.session_action = Some(action);
        self
    }

    /// Also sets `nvext.session_control.timeout` (when the body has a
    /// `session_control`).
    pub fn session_timeout(mut self, secs: u64) -> Self {
        self.session_timeout = Some(secs);
        self
    }

    fn drops(&self, key: &str) -> bool {
        self.remove.iter().any(|r| r == key) || self.set.iter().any(|(k, _)| k == key)
    }
}

impl InferenceRequest {
    /// Applies `edit` to `body` (the body this request was parsed from). Returns
    /// the new body, or `None` when nothing changed; on a change, the request's
    /// `nvext` span and fields follow the new body, so edits can chain.
    pub fn rewrite_body(
        &mut self,
        body: &[u8],
        edit: &NvExtEdit,
    ) -> Result<Option<Vec<u8>>, RequestError> {
        let (out, start, len) = match self.nvext.span.clone() {
            Some(span) => {
                let json = std::str::from_utf8(&body[span.clone()])
                    .map_err(|e| RequestError::InvalidJson(e.to_string()))?;
                let Some(new) = edit_object(json, edit)? else {
                    return Ok(None);
                };
                let mut out = Vec::with_capacity(body.len() - json.len() + new.len());
                out.extend_from_slice(&body[..span.start]);
                out.extend_from_slice(new.as_bytes());
                out.extend_from_slice(&body[span.end..]);
                (out, span.start, new.len())
            }
            None if edit.set.is_empty() => return Ok(None),
            None => {
                // Insert `"nvext":{...}` before the body's closing brace.
                let close = body
                    .iter()
                    .rposition(|b| *b == b'}')
                    .ok_or_else(|| RequestError::InvalidJson("no closing brace".into()))?;
                let new = edit_object("{}", edit)?.unwrap_or_else(|| "{}".into());
                let mut out = Vec::with_capacity(body.len() + new.len() + 10);
                out.extend_from_slice(&body[..close]);
                out.extend_from_slice(b",\"nvext\":");
                let start = out.len();
                out.extend_from_slice(new.as_bytes());
                out.extend_from_slice(&body[close..]);
                (out, start, new.len())
            }
        };
        let new = std::str::from_utf8(&out[start..start + len]).unwrap_or("{}");
        let mut nv = parse_nvext(new)?;
        nv.span = Some(start..start + len);
        self.names_worker = nv.names_worker();
        self.nvext = nv;
        Ok(Some(out))
    }
}

/// The entries of a JSON object in order, duplicates kept, keys decoded.
fn entries(json: &str) -> Result<Vec<(Cow<'_, str>, &RawValue)>, RequestError> {
    struct V;
    impl<'de> Visitor<'de> for V {
        type Value = Vec<(Cow<'de, str>, &'de RawValue)>;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("an object")
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            let mut out = Vec::new();
            while let Some(Key(k)) = map.next_key::<Key>()? {
                out.push((k, map.next_value()?));
            }
            Ok(out)
        }
    }
    serde_json::Deserializer::from_str(json)
        .deserialize_map(V)
        .map_err(|e| RequestError::Field {
            field: "nvext".into(),
            reason: e.to_string(),
        })
}

fn push_entry(out: &mut String, key: &str, raw: &str) {
    if out.len() > 1 {
        out.push(',');
    }
    out.push_str(&serde_json::to_string(key).unwrap_or_default());
    out.push(':');
    out.push_str(raw);
}

/// `json` (an object) with `edit` applied, or `None` if unchanged.
fn edit_object(json: &str, edit: &NvExtEdit) -> Result<Option<String>, RequestError> {
    let mut changed = false;
    let mut out = String::with_capacity(json.len() + 64);
    out.push('{');
    for (key, raw) in entries(json)? {
        if edit.drops(&key) {
            changed = true;
            continue;
        }
        let edits_session = edit.session_action.is_some() || edit.session_timeout.is_some();
        match key.as_ref() {
            "session_control" if edits_session && raw.get() != "null" => {
                let mut sc = String::from("{");
                for (k, v) in entries(raw.get())? {
                    let replaced = match k.as_ref() {
                        "action" => edit.session_action.is_some(),
                        "timeout" => edit.session_timeout.is_some(),
                        _ => false,
                    };
                    if !replaced {
                        push_entry(&mut sc, &k, v.get());
                    }
                }
                if let Some(action) = edit.session_action {
                    push_entry(&mut sc, "action", &format!("\"{}\"", action.as_str()));
                }
                if let Some(secs) = edit.session_timeout {
                    push_entry(&mut sc, "timeout", &secs.to_string());
                }
                sc.push('}');
                changed = true;
                push_entry(&mut out, &key, &sc);
            }
            _ => push_entry(&mut out, &key, raw.get()),
        }
    }
    for (key, raw) in &edit.set {
        changed = true;
        push_entry(&mut out, key, raw);
    }
    out.push('}');
    Ok(changed.then_some(out))
}
