//! Tokenization on a bounded pool of tokio's blocking threads: at most
//! `threads` prompts at once, never on the async threads.

use std::sync::Arc;

use tokio::sync::Semaphore;

use super::error::TokenizeError;
use super::tokenizer::Tokenizer;
use crate::multimodal::remote::{KnownImages, RemoteImages};
use crate::request::{Segment, TemplateInput};

/// Tokenization on a bounded pool of blocking threads.
#[derive(Debug, Clone)]
pub struct TokenizerPool {
    tokenizer: Arc<Tokenizer>,
    permits: Arc<Semaphore>,
    /// Fetches remote images before tokenizing (`--mm-fetch`).
    remote: Option<Arc<RemoteImages>>,
}

impl TokenizerPool {
    /// A pool tokenizing at most `threads` requests at once.
    pub fn new(tokenizer: Tokenizer, threads: usize) -> Self {
        TokenizerPool {
            tokenizer: Arc::new(tokenizer),
            permits: Arc::new(Semaphore::new(threads.max(1))),
            remote: None,
        }
    }

    /// Fetches remote images through `remote` before tokenizing
    /// ([`Self::tokenize_fetching`]).
    pub fn with_remote_images(mut self, remote: Arc<RemoteImages>) -> Self {
        self.remote = Some(remote);
        self
    }

    /// The tokenizer itself (for synchronous use in tests and tools).
    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.tokenizer
    }

    /// Tokenizes a request's template input off the async threads. The
    /// result replaces the request's text segments: token ids, with image
    /// segments where images were.
    pub async fn tokenize(&self, input: TemplateInput) -> Result<Vec<Segment>, TokenizeError> {
        self.tokenize_known(input, KnownImages::default()).await
    }

    /// [`Self::tokenize`], first fetching the remote images among `image_urls`
    /// when fetching is on (and the tokenizer has a vision model to size them
    /// with); the fetched images are returned with the tokens, for the hints
    /// that tell the engine the same identities.
    pub async fn tokenize_fetching(
        &self,
        input: TemplateInput,
        image_urls: &[String],
    ) -> (Result<Vec<Segment>, TokenizeError>, KnownImages) {
        let known = match &self.remote {
            Some(remote) if self.tokenizer.has_vision() => {
                remote.resolve(image_urls.iter().map(String::as_str)).await
            }
            _ => KnownImages::default(),
        };
        let tokens = self.tokenize_known(input, known.clone()).await;
        (tokens, known)
    }

    async fn tokenize_known(
        &self,
        input: TemplateInput,
        known: KnownImages,
    ) -> Result<Vec<Segment>, TokenizeError> {
        let _permit = self
            .permits
            .acquire()
            .await
            .map_err(TokenizeError::Closed)?;
        let tok = Arc::clone(&self.tokenizer);
        tokio::task::spawn_blocking(move || tok.tokenize_input(&input, &known))
            .await
            .map_err(TokenizeError::Task)?
    }
}
