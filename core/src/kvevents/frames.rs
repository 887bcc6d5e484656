//! The frames around a KV-event payload: vLLM and SGLang publish each batch as a
//! ZMQ multipart `(topic, seq, payload)`, `seq` an 8-byte big-endian counter per
//! publisher.

use super::event::DecodeError;

/// A topic of the form `kv@<pod>@<model>`; other topics (vLLM's default is empty)
/// give `None`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topic {
    /// The pod (or worker) name.
    pub pod: String,
    /// The model name.
    pub model: String,
}

/// Parses a `kv@<pod>@<model>` topic; the model may itself contain `@`.
pub fn parse_topic(topic: &[u8]) -> Option<Topic> {
    let s = std::str::from_utf8(topic).ok()?;
    let rest = s.strip_prefix("kv@")?;
    let (pod, model) = rest.split_once('@')?;
    Some(Topic {
        pod: pod.to_string(),
        model: model.to_string(),
    })
}

/// Reads the 8-byte big-endian sequence frame. vLLM's replay end marker (-1) reads
/// as `u64::MAX`.
pub fn decode_seq(frame: &[u8]) -> Result<u64, DecodeError> {
    let b: [u8; 8] = frame
        .try_into()
        .map_err(|_| DecodeError::SeqLength(frame.len()))?;
    Ok(u64::from_be_bytes(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topic_forms() {
        assert_eq!(
            parse_topic(b"kv@pod-1@org/model@v2"),
            Some(Topic {
                pod: "pod-1".into(),
                model: "org/model@v2".into()
            })
        );
        assert_eq!(parse_topic(b""), None);
        assert_eq!(parse_topic(b"other"), None);
    }

    #[test]
    fn seq_forms() {
        assert_eq!(decode_seq(&7u64.to_be_bytes()).unwrap(), 7);
        assert_eq!(decode_seq(&(-1i64).to_be_bytes()).unwrap(), u64::MAX);
        assert!(matches!(decode_seq(b"abc"), Err(DecodeError::SeqLength(3))));
    }
}
