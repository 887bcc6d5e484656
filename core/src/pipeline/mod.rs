//! The request pipeline: what kvpick does to one request between the protocol
//! delivering it and the protocol answering it, with no protocol type in sight.
//!
//! 1. [`RequestHead::read`] reads the request headers (plain names and values,
//!    through [`Headers`]).
//! 2. [`Pipeline::prepare`] takes the complete body: parses it, identifies its
//!    images and, with an in-process tokenizer, leaves the [`TokenizeJob`] it
//!    waits for ([`Prepared`]).
//! 3. The request's flow ([`crate::flow`]) admits it ([`Prepared::signals`])
//!    and picks its target (the scheduler), while its protocol holds the request.
//! 4. [`outcome`] turns the decision into the headers to set and remove and the
//!    body to forward, edited once.
//!
//! Invariant: a client never picks its worker. Every routing header it sent is
//! removed or overwritten ([`RequestHead::spoofed`]), and every worker field in
//! its `nvext` is removed from the forwarded body.

mod head;
mod outcome;
mod prepare;

use std::sync::Arc;

pub use head::{
    is_routing_header, Headers, RequestHead, BOOTSTRAP_HOST_HEADER, BOOTSTRAP_PORT_HEADER,
    BOOTSTRAP_ROOM_HEADER, DESTINATION_HEADER, DP_RANK_HEADER, PREFILL_DP_RANK_HEADER,
    PREFILL_ID_HEADER, ROUTING_HEADERS, TENANT_HEADER, WORKER_ID_HEADER,
};
pub use outcome::{outcome, ForwardBody, Outcome};
pub use prepare::{Prepared, TokenizeJob, Tokenized};

use crate::multimodal::MmStats;
use crate::request::PromptLimits;
use crate::tokenize::TokenizerPool;

/// How request bodies are prepared.
#[derive(Debug, Clone)]
pub struct Pipeline {
    /// How much of a prompt a parse keeps (the scheduler hashes no more).
    limits: PromptLimits,
    /// In-process tokenizer (`--tokenizer-dir`): text prompts become token ids
    /// so their blocks match the engines' KV events.
    tokenizer: Option<TokenizerPool>,
    /// Counts images routed without a tokenizer (the tokenizer counts the others).
    mm_stats: Option<Arc<MmStats>>,
}

impl Pipeline {
    /// Parses keep `limits` of a prompt; `tokenizer` turns text into token ids.
    pub fn new(limits: PromptLimits, tokenizer: Option<TokenizerPool>) -> Self {
        Pipeline {
            limits,
            tokenizer,
            mm_stats: None,
        }
    }

    /// Also counts the images of requests prepared without a tokenizer in `stats`.
    pub fn counting_images(mut self, stats: Arc<MmStats>) -> Self {
        self.mm_stats = Some(stats);
        self
    }
}

#[cfg(test)]
mod tests;
