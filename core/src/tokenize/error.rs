//! Why a tokenizer could not be loaded or a request not tokenized.

use crate::multimodal::routing::ExpandError;

/// Why a tokenizer could not be loaded or a request not tokenized.
#[derive(Debug, thiserror::Error)]
pub enum TokenizeError {
    /// A file could not be read.
    #[error("cannot read {path}")]
    Io {
        /// The file.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// `tokenizer.json` is not a tokenizer the `tokenizers` crate can load.
    #[error("cannot load tokenizer.json")]
    Load(#[source] tokenizers::Error),
    /// `tokenizer_config.json` is not valid JSON.
    #[error("tokenizer_config.json is not valid JSON")]
    Config(#[source] serde_json::Error),
    /// The chat template does not compile or failed to render.
    #[error("chat template failed")]
    Template(#[source] minijinja::Error),
    /// A chat request arrived but the model has no chat template.
    #[error("the model directory has no chat template")]
    NoTemplate,
    /// A field kept as JSON text is not JSON (the parse kept it from a valid body).
    #[error("request field `{field}`")]
    Field {
        /// The field.
        field: String,
        /// Why it does not read.
        #[source]
        source: serde_json::Error,
    },
    /// The request was parsed without [`ParseOptions::template`](crate::request::ParseOptions).
    #[error("the request was parsed without its template input")]
    NoTemplateInput,
    /// Encoding failed.
    #[error("encoding failed")]
    Encode(#[source] tokenizers::Error),
    /// The vision model's image token is not a single token id, or encodes to none.
    #[error("vision: image token {0:?} is not one token")]
    ImageToken(String),
    /// A prompt's image tokens do not pair with its images.
    #[error("vision: the prompt's image tokens do not pair with its images")]
    ImagePairing(#[source] ExpandError),
    /// The tokenizer's task pool is closed (the process is shutting down).
    #[error("tokenization pool closed")]
    Closed(#[source] tokio::sync::AcquireError),
    /// The blocking tokenization task panicked or was cancelled.
    #[error("tokenization task failed")]
    Task(#[source] tokio::task::JoinError),
}
