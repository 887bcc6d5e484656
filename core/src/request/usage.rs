//! Token usage an engine reports at the end of its response (`usage.prompt_tokens`,
//! `usage.completion_tokens`), read from a bounded tail of the response body.
//!
//! OpenAI-style engines put `usage` last: at the end of a JSON response, or in the
//! final SSE chunk of a stream (with `stream_options.include_usage`; earlier chunks
//! carry `"usage": null`). Keeping only the last [`TAIL_BYTES`] of the body bounds the
//! memory per stream whatever the response's length.

use serde::Deserialize;

/// How many trailing response bytes are kept to find `usage` in.
pub const TAIL_BYTES: usize = 16 * 1024;

/// Tokens the engine counted for one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub struct Usage {
    /// Prompt (input) tokens.
    pub prompt_tokens: u64,
    /// Generated (output) tokens.
    #[serde(default)]
    pub completion_tokens: u64,
}

/// The last [`TAIL_BYTES`] of a response body and its total length.
#[derive(Debug, Default)]
pub struct ResponseTail {
    tail: Vec<u8>,
    total: u64,
}

impl ResponseTail {
    /// Appends a chunk, keeping only the last [`TAIL_BYTES`].
    pub fn push(&mut self, chunk: &[u8]) {
        self.total = self.total.saturating_add(chunk.len() as u64);
        let chunk = &chunk[chunk.len().saturating_sub(TAIL_BYTES)..];
        let keep = TAIL_BYTES - chunk.len();
        if self.tail.len() > keep {
            self.tail.drain(..self.tail.len() - keep);
        }
        self.tail.extend_from_slice(chunk);
    }

    /// Bytes seen in all.
    pub fn total(&self) -> u64 {
        self.total
    }

    /// The last non-null `usage` object in the tail, if any.
    pub fn usage(&self) -> Option<Usage> {
        const KEY: &[u8] = b"\"usage\"";
        let mut end = self.tail.len();
        while let Some(at) = find_last(&self.tail[..end], KEY) {
            let rest = &self.tail[at + KEY.len()..];
            let rest = trim_start(rest);
            if let Some(value) = rest.strip_prefix(b":") {
                let mut values =
                    serde_json::Deserializer::from_slice(trim_start(value)).into_iter::<Usage>();
                if let Some(Ok(usage)) = values.next() {
                    return Some(usage);
                }
            }
            end = at;
        }
        None
    }
}

fn find_last(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).rposition(|w| w == needle)
}

fn trim_start(bytes: &[u8]) -> &[u8] {
    let skip = bytes.iter().take_while(|b| b.is_ascii_whitespace()).count();
    &bytes[skip..]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tail_of(chunks: &[&[u8]]) -> ResponseTail {
        let mut tail = ResponseTail::default();
        for c in chunks {
            tail.push(c);
        }
        tail
    }

    #[test]
    fn reads_usage_from_a_json_response() {
        let body = br#"{"id":"x","choices":[{"text":"hi"}],"usage":{"prompt_tokens":12,"total_tokens":15,"completion_tokens":3}}"#;
        let tail = tail_of(&[&body[..20], &body[20..]]);
        assert_eq!(
            tail.usage(),
            Some(Usage {
                prompt_tokens: 12,
                completion_tokens: 3
            })
        );
        assert_eq!(tail.total(), body.len() as u64);
    }

    #[test]
    fn reads_the_final_usage_of_a_stream_past_null_ones() {
        let stream: &[&[u8]] = &[
            b"data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}],\"usage\":null}\n\n",
            b"data: {\"choices\":[],\"usage\": {\"prompt_tokens\": 7, \"completion_tokens\": 2}}\n\n",
            b"data: [DONE]\n\n",
        ];
        assert_eq!(
            tail_of(stream).usage(),
            Some(Usage {
                prompt_tokens: 7,
                completion_tokens: 2
            })
        );
        assert_eq!(tail_of(&stream[..1]).usage(), None);
    }

    #[test]
    fn tail_stays_bounded_and_keeps_the_end() {
        let mut tail = ResponseTail::default();
        let filler = vec![b'x'; 5000];
        for _ in 0..100 {
            tail.push(&filler);
        }
        tail.push(br#","usage":{"prompt_tokens":1,"completion_tokens":9}}"#);
        assert!(tail.tail.len() <= TAIL_BYTES);
        assert_eq!(tail.usage().map(|u| u.completion_tokens), Some(9));
        tail.push(&vec![b'y'; 3 * TAIL_BYTES]);
        assert_eq!(tail.tail.len(), TAIL_BYTES);
        assert_eq!(tail.usage(), None);
    }
}
