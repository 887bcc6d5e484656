//! A complete request body made ready to route: parsed, its images identified,
//! and the tokenization it waits for, if any.
//!
//! Nothing here edits the body: the client's routing fields are removed with
//! the decision's own edits in one pass ([`super::outcome`]).

use tracing::debug;

use crate::admission::RequestSignals;
use crate::error_chain::ErrorChain;
use crate::multimodal::hints;
use crate::multimodal::identity::identify;
use crate::multimodal::remote::KnownImages;
use crate::multimodal::MmRouting;
use crate::request::{self, InferenceRequest, RequestError, Segment, TemplateInput};
use crate::tokenize::{TokenizeError, TokenizerPool};

use super::{Pipeline, RequestHead};

/// A parsed request body, waiting for its tokens or ready to admit and route.
#[derive(Debug)]
pub struct Prepared {
    /// The parsed body; its text becomes token ids once tokenized.
    pub request: InferenceRequest,
    /// The body as the client sent it.
    pub(super) body: Vec<u8>,
    /// Identities of the request's images in prompt order: the ones routed on,
    /// and told to the chosen engine.
    pub(super) mm_hashes: Vec<u64>,
    /// The tokenization the body waits for.
    job: Option<TokenizeJob>,
}

/// A request body waiting to be tokenized before it is routed.
#[derive(Debug)]
pub struct TokenizeJob {
    pool: TokenizerPool,
    input: TemplateInput,
    /// The request's image URLs in prompt order (remote ones may be fetched).
    image_urls: Vec<String>,
}

/// A tokenized body: its segments, and the remote images fetched for it.
pub type Tokenized = (Result<Vec<Segment>, TokenizeError>, KnownImages);

impl TokenizeJob {
    /// Fetches the remote images (when on) and tokenizes the body on the
    /// tokenizer pool.
    pub async fn run(self) -> Tokenized {
        self.pool
            .tokenize_fetching(self.input, &self.image_urls)
            .await
    }
}

impl Pipeline {
    /// Parses a complete `body` (its API from `head`'s path, or its shape) and
    /// identifies its images. With a tokenizer, a body with text and a template
    /// waits for its tokens ([`Prepared::take_tokenize_job`]). A body that is
    /// not a usable request is the client's error (400).
    pub fn prepare(&self, body: Vec<u8>, head: &RequestHead) -> Result<Prepared, RequestError> {
        let options = request::ParseOptions {
            limits: self.limits,
            template: self.tokenizer.is_some(),
        };
        let mut parsed = request::parse_with(&body, head.kind, options)?;
        parsed.set_tenant(head.tenant.as_deref());
        let images: Vec<_> = image_urls(&parsed).map(identify).collect();
        if let (None, Some(stats), false) = (&self.tokenizer, &self.mm_stats, images.is_empty()) {
            // Approximate mode: the tokenizer, which counts the others, never sees it.
            images.iter().for_each(|i| stats.record_image(i.source));
            stats.record_request(MmRouting::Approximate);
        }
        let has_text = parsed
            .segments
            .iter()
            .any(|s| matches!(s, Segment::Text(_)));
        let job = match (&self.tokenizer, has_text) {
            (Some(pool), true) => parsed.template.take().map(|input| TokenizeJob {
                pool: pool.clone(),
                image_urls: image_urls(&parsed).map(String::from).collect(),
                input,
            }),
            _ => None,
        };
        Ok(Prepared {
            request: parsed,
            body,
            mm_hashes: images.iter().map(|i| i.mm_hash).collect(),
            job,
        })
    }
}

impl Prepared {
    /// Whether the body waits for its tokens before it is admitted.
    pub fn waits_for_tokens(&self) -> bool {
        self.job.is_some()
    }

    /// The tokenization the body waits for; answer with [`Prepared::tokenized`].
    pub fn take_tokenize_job(&mut self) -> Option<TokenizeJob> {
        self.job.take()
    }

    /// Takes the job's result. Without tokens (no chat template, a template
    /// error) the text segments are hashed as they are. Fetched remote images
    /// change the identities the engine is told.
    pub fn tokenized(&mut self, (tokens, fetched): Tokenized) {
        if !fetched.is_empty() {
            self.mm_hashes = hints::image_hashes(image_urls(&self.request), &fetched);
        }
        match tokens {
            Ok(segments) => {
                // The tokenizer read the whole text, not the part the parse kept.
                self.request.segments = segments;
                self.request.omitted_text_bytes = 0;
            }
            Err(e) => {
                debug!(error = %ErrorChain(&e), "tokenization failed: routing on text blocks")
            }
        }
    }

    /// The body's size as the client sent it.
    pub fn body_len(&self) -> usize {
        self.body.len()
    }

    /// What admission reads of the request.
    pub fn signals<'a>(&'a self, head: &'a RequestHead) -> RequestSignals<'a> {
        RequestSignals {
            objective: head.objective.as_deref(),
            fairness_id: head.fairness_id.as_deref(),
            hint_priority: self
                .request
                .nvext
                .agent_hints
                .as_ref()
                .and_then(|h| h.priority),
            model: &self.request.model,
            bytes: self.body.len(),
        }
    }
}

/// The image URLs of a parsed (not yet tokenized) request, in prompt order.
fn image_urls(parsed: &InferenceRequest) -> impl Iterator<Item = &str> {
    parsed.segments.iter().filter_map(|s| match s {
        Segment::Image(u) => Some(u.as_str()),
        _ => None,
    })
}
