//! Loading a HuggingFace model directory: `tokenizer.json`, the chat template
//! and the special tokens the template prints.

use std::path::Path;
use std::sync::Arc;

use serde_json::{Map, Value};

use super::error::TokenizeError;
use super::template::{chat_environment, iterates_content};
use super::tokenizer::Tokenizer;

fn read(path: &Path) -> Result<Option<String>, TokenizeError> {
    match std::fs::read_to_string(path) {
        Ok(s) => Ok(Some(s)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(TokenizeError::Io {
            path: path.display().to_string(),
            source,
        }),
    }
}

/// A special token in `tokenizer_config.json`: a string or an AddedToken object.
fn token_text(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(String::from),
        _ => None,
    }
}

impl Tokenizer {
    /// Loads `tokenizer.json` and the chat template from a model directory.
    pub fn load(dir: impl AsRef<Path>) -> Result<Self, TokenizeError> {
        let dir = dir.as_ref();
        let path = dir.join("tokenizer.json");
        let json = read(&path)?.ok_or_else(|| TokenizeError::Io {
            path: path.display().to_string(),
            source: std::io::ErrorKind::NotFound.into(),
        })?;
        let inner: tokenizers::Tokenizer = json.parse().map_err(TokenizeError::Load)?;
        let config: Map<String, Value> = match read(&dir.join("tokenizer_config.json"))? {
            Some(s) => serde_json::from_str(&s).map_err(TokenizeError::Config)?,
            None => Map::new(),
        };
        let template = match read(&dir.join("chat_template.jinja"))? {
            Some(t) => Some(t),
            None => match config.get("chat_template") {
                Some(Value::String(t)) => Some(t.clone()),
                // A list of named templates: use "default" (or the first).
                Some(Value::Array(list)) => list
                    .iter()
                    .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                    .or_else(|| list.first())
                    .and_then(|t| t.get("template"))
                    .and_then(Value::as_str)
                    .map(String::from),
                _ => None,
            },
        };
        let mut special = Map::new();
        for key in [
            "bos_token",
            "eos_token",
            "unk_token",
            "pad_token",
            "sep_token",
            "cls_token",
            "mask_token",
        ] {
            if let Some(t) = config.get(key).and_then(token_text) {
                special.insert(key.to_string(), Value::String(t));
            }
        }
        let parts_content = template.as_deref().is_some_and(iterates_content);
        let env = template.map(chat_environment).transpose()?;
        Ok(Tokenizer {
            inner,
            env,
            special,
            parts_content,
            vision: None,
            mm_stats: Arc::default(),
        })
    }
}
