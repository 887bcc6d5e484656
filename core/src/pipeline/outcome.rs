//! What the answer to a routed request carries: the headers to set and to
//! remove, and the body to forward.
//!
//! The body gets one edit of its `nvext` object ([`NvExtEdit`], spliced in
//! place, the rest of the body copied as bytes): the client's worker fields
//! removed; for a re-homed session turn, `open` with the session's timeout; for
//! an SGLang worker, the image hashes (`mm_hashes`). vLLM's image hashes sit on
//! the image parts themselves (and SGLang's go into a body without an `nvext`
//! object), so those are written on the result ([`hints::rewrite_body`]).

use std::borrow::Cow;
use std::sync::LazyLock;

use crate::endpoints::Engine;
use crate::multimodal::hints::{self, HintFormat};
use crate::request::{NvExtEdit, RequestError, SessionAction};
use crate::scheduler::Decision;
use crate::sessions::SessionTurn;

use super::head::{
    BOOTSTRAP_HOST_HEADER, BOOTSTRAP_PORT_HEADER, BOOTSTRAP_ROOM_HEADER, DESTINATION_HEADER,
    DP_RANK_HEADER, PREFILL_DP_RANK_HEADER, PREFILL_ID_HEADER, WORKER_ID_HEADER,
};
use super::{Prepared, RequestHead};

/// The edit every forwarded body gets, built once.
static STRIP_CLIENT_ROUTING: LazyLock<NvExtEdit> = LazyLock::new(NvExtEdit::strip_client_routing);

/// The answer to a routed request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    /// The destination header's value: the decode endpoint's `ip:port`, then
    /// its fallbacks', comma-separated in cost order (GIE's protocol: the
    /// gateway tries them in turn when retrying).
    pub destination: String,
    /// Headers to set, each overwriting the client's: the routing headers, then
    /// `content-length` when the body changed.
    pub set_headers: Vec<(&'static str, String)>,
    /// Routing headers the client sent that kvpick does not set: removed.
    pub remove_headers: Vec<String>,
    /// The body to forward; `None` for a request routed on its headers alone.
    pub body: Option<ForwardBody>,
}

/// The body a routed request is forwarded with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ForwardBody {
    /// Its bytes.
    pub bytes: Vec<u8>,
    /// Whether they differ from the client's.
    pub changed: bool,
}

/// The answer carrying `decision` for a request with headers `head` and, unless
/// it was routed on its headers alone, body `prepared`. Fails (the client's
/// error, 400) only when the body's `nvext` cannot be rewritten.
pub fn outcome(
    decision: &Decision,
    head: &RequestHead,
    prepared: Option<Prepared>,
) -> Result<Outcome, RequestError> {
    let destination = destinations(decision);
    let mut set_headers = routing_headers(decision, &destination);
    let remove_headers = head
        .spoofed
        .iter()
        .filter(|name| !set_headers.iter().any(|(k, _)| k == name))
        .cloned()
        .collect();
    let body = prepared.map(|p| forward_body(p, decision)).transpose()?;
    if let Some(b) = body.as_ref().filter(|b| b.changed) {
        set_headers.push(("content-length", b.bytes.len().to_string()));
    }
    Ok(Outcome {
        destination,
        set_headers,
        remove_headers,
        body,
    })
}

/// The decode endpoint's address, then its fallbacks', comma-separated.
fn destinations(decision: &Decision) -> String {
    let mut list = decision.decode.endpoint().address_string();
    for f in &decision.fallbacks {
        list.push(',');
        list.push_str(&f.endpoint().address_string());
    }
    list
}

/// The routing headers carrying `decision`; `destination` lists its endpoints.
fn routing_headers(d: &Decision, destination: &str) -> Vec<(&'static str, String)> {
    let decode = d.decode.endpoint();
    let mut set = vec![
        (DESTINATION_HEADER, destination.to_string()),
        (WORKER_ID_HEADER, decode.instance_id.to_string()),
        (DP_RANK_HEADER, d.decode.rank.to_string()),
    ];
    if let Some(p) = &d.prefill {
        set.push((PREFILL_ID_HEADER, p.endpoint().instance_id.to_string()));
        set.push((PREFILL_DP_RANK_HEADER, p.rank.to_string()));
        if let (Some(port), Some(room)) = (d.bootstrap_port, d.bootstrap_room) {
            set.push((BOOTSTRAP_HOST_HEADER, p.endpoint().address.ip().to_string()));
            set.push((BOOTSTRAP_PORT_HEADER, port.to_string()));
            set.push((BOOTSTRAP_ROOM_HEADER, room.to_string()));
        }
    }
    set
}

/// The client's body with the decision's edits applied.
fn forward_body(prepared: Prepared, decision: &Decision) -> Result<ForwardBody, RequestError> {
    let Prepared {
        mut request,
        body,
        mm_hashes,
        ..
    } = prepared;
    let hints = match decision.decode.endpoint().engine {
        _ if mm_hashes.is_empty() => None,
        Engine::Sglang => Some(HintFormat::Sglang),
        Engine::Vllm => Some(HintFormat::Vllm),
        Engine::Trtllm => None,
    };
    // A re-homed session turn goes to its new worker as an `open` carrying the
    // session's timeout, so that worker's sidecar opens the engine session
    // (Dynamo's session contract; see [`crate::sessions`]).
    let reopen: Option<&SessionTurn> = decision
        .session
        .as_ref()
        .filter(|turn| turn.rehomed && request.session().is_some());
    let hints_in_nvext = hints == Some(HintFormat::Sglang) && request.nvext.span.is_some();
    let edit = match (reopen, hints_in_nvext) {
        (None, false) => Cow::Borrowed(&*STRIP_CLIENT_ROUTING),
        _ => {
            let mut edit = NvExtEdit::strip_client_routing();
            if let Some(turn) = reopen {
                edit = edit
                    .session_action(SessionAction::Open)
                    .session_timeout(turn.timeout.as_secs());
            }
            if hints_in_nvext {
                edit = edit.set(hints::SGLANG_FIELD, &hints::sglang_mm_hashes(&mm_hashes));
            }
            Cow::Owned(edit)
        }
    };
    let (mut bytes, mut changed) = match request.rewrite_body(&body, &edit)? {
        Some(edited) => (edited, true),
        None => (body, false),
    };
    if let Some(format) = hints.filter(|_| !hints_in_nvext) {
        if let Some(hinted) = hints::rewrite_body(&bytes, format, &mm_hashes) {
            bytes = hinted;
            changed = true;
        }
    }
    Ok(ForwardBody { bytes, changed })
}
