//! Chat templates: a Jinja environment configured like transformers' renderer
//! (Python-style `tojson` and string methods), and the OpenAI messages
//! normalised the way vLLM hands them to the template.

use minijinja::value::{Kwargs, Value as JValue, ValueKind};
use minijinja::{Environment, Error as JError, ErrorKind};
use serde_json::{Map, Value};

use super::error::TokenizeError;
use crate::request::{ChatInput, ContentPart, MessageField};

pub(super) const TEMPLATE: &str = "chat";

/// Marks where an image was in the rendered prompt (private-use characters).
pub(super) const IMAGE_MARK: &str = "\u{F8FF}kvpick-image\u{F8FF}";

/// Whether a template loops over message content parts (vLLM's "openai" content
/// format) instead of printing the content as a string.
pub(super) fn iterates_content(template: &str) -> bool {
    let t: String = template.chars().filter(|c| !c.is_whitespace()).collect();
    [
        "inmessage['content']",
        "inmessage[\"content\"]",
        "inmessage.content",
    ]
    .iter()
    .any(|p| t.contains(p))
}

/// A field kept as JSON text, as a value.
pub(super) fn json_field(field: &str, json: &str) -> Result<Value, TokenizeError> {
    serde_json::from_str(json).map_err(|source| TokenizeError::Field {
        field: field.to_string(),
        source,
    })
}

/// The OpenAI messages of a chat, with content normalized the way vLLM hands
/// it to the template, and the image URLs in order.
pub(super) fn chat_messages(
    chat: &ChatInput,
    parts_content: bool,
    placeholder: Option<&str>,
) -> Result<(Vec<Value>, Vec<String>), TokenizeError> {
    let mut images = Vec::new();
    let mut out = Vec::with_capacity(chat.messages.len());
    for m in &chat.messages {
        // Inserted in body order: a repeated key keeps its first place and last value.
        let mut message = Map::new();
        for (key, field) in &m.fields {
            let value = match field {
                MessageField::Null => Value::Null,
                MessageField::Text(t) => Value::String(t.clone()),
                MessageField::Json(j) => json_field(key, j)?,
                MessageField::Parts(parts) => {
                    normalize_parts(parts, &mut images, parts_content, placeholder)
                }
            };
            message.insert(key.clone(), value);
        }
        out.push(Value::Object(message));
    }
    Ok((out, images))
}

/// Content parts as the template gets them; image URLs are appended to `images`.
pub(super) fn normalize_parts(
    parts: &[ContentPart],
    images: &mut Vec<String>,
    parts_content: bool,
    placeholder: Option<&str>,
) -> Value {
    // Each part as text, or `None` for an image (its URL recorded).
    let items: Vec<Option<String>> = parts
        .iter()
        .map(|p| match p {
            ContentPart::Text(t) => Some(t.clone()),
            ContentPart::Image(url) => {
                images.push(url.clone());
                None
            }
        })
        .collect();
    match (parts_content, placeholder) {
        // Without a vision model an image is a marker in the text.
        (true, None) => Value::Array(
            items
                .into_iter()
                .map(|t| {
                    serde_json::json!({"type": "text", "text": t.unwrap_or_else(|| IMAGE_MARK.to_string())})
                })
                .collect(),
        ),
        (false, None) => Value::String(
            items
                .into_iter()
                .map(|t| t.unwrap_or_else(|| IMAGE_MARK.to_string()))
                .collect::<Vec<_>>()
                .join("\n"),
        ),
        // With one, the template sees image parts and emits the model's
        // placeholder itself, as vLLM's "openai" content format does.
        (true, Some(_)) => Value::Array(
            items
                .into_iter()
                .map(|t| match t {
                    Some(t) => serde_json::json!({"type": "text", "text": t}),
                    None => serde_json::json!({"type": "image"}),
                })
                .collect(),
        ),
        // String-content templates: vLLM puts one placeholder per image
        // first, then the text parts, all joined by newlines.
        (false, Some(ph)) => {
            let n = items.iter().filter(|t| t.is_none()).count();
            let text: Vec<String> = items.into_iter().flatten().collect();
            let mut all: Vec<String> = vec![ph.to_string(); n];
            all.push(text.join("\n"));
            Value::String(all.join("\n"))
        }
    }
}

/// A Jinja environment configured like transformers' chat template renderer.
pub(super) fn chat_environment(template: String) -> Result<Environment<'static>, TokenizeError> {
    let mut env = Environment::new();
    env.set_syntax(
        minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(TokenizeError::Template)?,
    );
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", |msg: String| -> Result<JValue, JError> {
        Err(JError::new(ErrorKind::InvalidOperation, msg))
    });
    env.add_function("strftime_now", |_fmt: String| -> String {
        // Keeps prompts stable for caching; templates use this for a date line.
        String::new()
    });
    env.add_filter("tojson", py_tojson);
    env.add_template_owned(TEMPLATE, template)
        .map_err(TokenizeError::Template)?;
    Ok(env)
}

/// transformers' `tojson`: `json.dumps(x, ensure_ascii=False, indent=indent)`,
/// with Python's separators (`", "` and `": "`), no HTML escaping.
pub(super) fn py_tojson(value: JValue, kwargs: Kwargs) -> Result<JValue, JError> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let _: Option<bool> = kwargs.get("ensure_ascii")?;
    let _: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let mut out = String::new();
    write_py_json(&mut out, &value, indent, 0)?;
    Ok(JValue::from_safe_string(out))
}

pub(super) fn write_py_json(
    out: &mut String,
    v: &JValue,
    indent: Option<usize>,
    level: usize,
) -> Result<(), JError> {
    let newline = |out: &mut String, level: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', n * level));
        }
    };
    let item_sep = if indent.is_some() { "," } else { ", " };
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if let Some(i) = v.as_i64().filter(|_| v.is_integer()) {
                out.push_str(&i.to_string());
            } else {
                let f = f64::try_from(v.clone()).unwrap_or(f64::NAN);
                if f.is_finite() && f.fract() == 0.0 && f.abs() < 1e16 {
                    out.push_str(&format!("{f:.1}"));
                } else {
                    out.push_str(&f.to_string());
                }
            }
        }
        ValueKind::String => {
            out.push_str(&serde_json::to_string(v.as_str().unwrap_or_default()).unwrap_or_default())
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<JValue> = v.try_iter()?.collect();
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, level + 1);
                write_py_json(out, item, indent, level + 1)?;
            }
            if !items.is_empty() {
                newline(out, level);
            }
            out.push(']');
        }
        ValueKind::Map => {
            let keys: Vec<JValue> = v.try_iter()?.collect();
            out.push('{');
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, level + 1);
                let key = k
                    .as_str()
                    .map(String::from)
                    .unwrap_or_else(|| k.to_string());
                out.push_str(&serde_json::to_string(&key).unwrap_or_default());
                out.push_str(": ");
                write_py_json(out, &v.get_item(k)?, indent, level + 1)?;
            }
            if !keys.is_empty() {
                newline(out, level);
            }
            out.push('}');
        }
        _ => out.push_str(&serde_json::to_string(&v.to_string()).unwrap_or_default()),
    }
    Ok(())
}
