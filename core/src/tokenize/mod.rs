//! In-process tokenization, so request blocks match the blocks engines report in
//! KV events.
//!
//! [`Tokenizer::load`] reads a HuggingFace model directory: `tokenizer.json` (the
//! `tokenizers` crate) and the chat template (`chat_template.jinja`, or
//! `chat_template` in `tokenizer_config.json`). Chat requests are rendered the way
//! vLLM renders them with transformers' Jinja settings (`trim_blocks`,
//! `lstrip_blocks`, loop controls, `raise_exception`, `strftime_now`, a Python-style
//! `tojson`, Python string methods) with `messages`, `tools`,
//! `add_generation_prompt: true`, the special tokens (`bos_token`, `eos_token`, …)
//! and the request's `chat_template_kwargs`; the result is tokenized without
//! special tokens. Completion prompts are tokenized with special tokens (BOS).
//! `nvext.use_raw_prompt` needs nothing: as in Dynamo, a completions prompt is
//! tokenized as is and a chat body (no raw prompt) still gets its template.
//!
//! Images: each image part is replaced by a marker while rendering; the rendered
//! text is split at the markers and the result is `Tokens, Image, Tokens, …`, so
//! blocks after an image are chained to that image's hash and the text before it
//! tokenizes exactly as the engine's.
//!
//! The tokenizer renders from what the one pass over the body kept for it
//! ([`TemplateInput`], parsed with [`ParseOptions::template`](crate::request::ParseOptions)):
//! the body is not read again. Only the small JSON fields the template may print
//! as they are (`tools`, `chat_template_kwargs`, a message's `name`,
//! `tool_call_id`, `tool_calls`, …) are read from their kept JSON text.
//!
//! Files: [`load`] reads the model directory, [`template`] is the Jinja
//! environment and the messages it renders, [`pool`] runs tokenization off the
//! async threads.
//!
//! [`TokenizerPool`] runs tokenization on tokio's blocking threads behind a
//! semaphore, so a 200 KB prompt never stalls the async threads serving other
//! streams, and at most `threads` prompts are tokenized at once.

mod error;
mod load;
mod pool;
mod template;
#[cfg(test)]
mod tests;
mod tokenizer;

pub use error::TokenizeError;
pub use pool::TokenizerPool;
pub use tokenizer::{token_ids, TokenizedImage, Tokenizer};
