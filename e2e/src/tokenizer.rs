//! A deterministic toy tokenizer: words and single punctuation marks become tokens,
//! each mapped to an id by hashing, so equal text always gives equal ids.

/// Ids below this are reserved for the chat-template markers.
pub const FIRST_WORD_ID: u32 = 1_000;
/// Size of the word-id space above [`FIRST_WORD_ID`].
pub const VOCAB: u32 = 100_000;

/// Splits `text` into tokens (runs of alphanumerics, or one punctuation character;
/// whitespace separates) and maps each to an id.
pub fn encode(text: &str) -> Vec<u32> {
    let mut out = Vec::new();
    let mut word = String::new();
    for c in text.chars() {
        if c.is_alphanumeric() || c == '_' {
            word.push(c);
            continue;
        }
        if !word.is_empty() {
            out.push(word_id(&word));
            word.clear();
        }
        if !c.is_whitespace() {
            out.push(word_id(c.encode_utf8(&mut [0; 4])));
        }
    }
    if !word.is_empty() {
        out.push(word_id(&word));
    }
    out
}

/// The id of one word (64-bit FNV-1a folded into the vocabulary).
pub fn word_id(word: &str) -> u32 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in word.as_bytes() {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    FIRST_WORD_ID + (h % u64::from(VOCAB)) as u32
}

/// The template marker starting a chat message of `role` (`system`, `user`, `assistant`, other).
pub fn role_marker(role: &str) -> u32 {
    match role {
        "system" => 1,
        "user" => 2,
        "assistant" => 3,
        "tool" => 4,
        _ => 5,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_words_and_punctuation_deterministically() {
        let a = encode("Hello, world! hello");
        assert_eq!(a.len(), 5);
        assert_eq!(a, encode("Hello ,world !  hello"));
        assert_ne!(a[0], a[4], "case matters");
        assert_eq!(a[1], word_id(","));
        assert!(a.iter().all(|&t| t >= FIRST_WORD_ID));
        assert!(encode("  ").is_empty());
    }
}
