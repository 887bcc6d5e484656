//! A short multi-turn chat workload: a few sessions, each starting from one of a
//! few shared system prompts, each turn resending the whole conversation (as chat
//! clients and agents do), so later turns and sibling sessions share prefixes.

use serde_json::{json, Value};

use crate::client::{Client, ClientError};

/// The workload's shape.
#[derive(Debug, Clone)]
pub struct Workload {
    /// Concurrent conversations.
    pub sessions: usize,
    /// Turns per conversation.
    pub turns: usize,
    /// Distinct system prompts shared by the conversations (session `i` uses `i % n`).
    pub system_prompts: usize,
    /// Words in each system prompt.
    pub system_words: usize,
    /// Stream the replies (SSE).
    pub stream: bool,
    /// Mark the conversations with `nvext.session_control` (open, turns, close).
    pub session_control: bool,
    /// Output tokens per turn.
    pub max_tokens: u32,
    /// Run the conversations one after another instead of concurrently.
    pub sequential: bool,
}

impl Default for Workload {
    fn default() -> Self {
        Workload {
            sessions: 8,
            turns: 4,
            system_prompts: 2,
            system_words: 300,
            stream: true,
            session_control: false,
            max_tokens: 12,
            sequential: false,
        }
    }
}

/// What happened.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Outcome {
    /// Requests sent.
    pub requests: usize,
    /// Requests answered 2xx.
    pub ok: usize,
    /// Statuses of failed requests.
    pub failures: Vec<u16>,
}

const LEXICON: &[&str] = &[
    "policy",
    "request",
    "answer",
    "carefully",
    "context",
    "tool",
    "user",
    "format",
    "json",
    "safety",
    "cite",
    "sources",
    "never",
    "always",
    "brief",
    "steps",
    "plan",
    "check",
    "result",
    "agent",
    "memory",
    "task",
    "goal",
    "review",
];

/// A deterministic system prompt of `words` words.
pub fn system_prompt(index: usize, words: usize) -> String {
    let mut out = format!("You are assistant {index}.");
    let mut h = index as u64 + 1;
    for _ in 0..words {
        h = h
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        out.push(' ');
        out.push_str(LEXICON[(h >> 33) as usize % LEXICON.len()]);
    }
    out
}

/// The chat body of one turn.
pub fn chat_body(w: &Workload, session: usize, turn: usize, messages: &[Value]) -> Value {
    let mut body = json!({
        "model": "mock-model",
        "messages": messages,
        "max_tokens": w.max_tokens,
        "stream": w.stream,
    });
    if w.session_control {
        let mut sc = json!({"session_id": format!("session-{session}")});
        if turn == 0 {
            sc["action"] = json!("open");
            sc["timeout"] = json!(60);
        } else if turn + 1 == w.turns {
            sc["action"] = json!("close");
        }
        body["nvext"] = json!({"session_control": sc});
    }
    body
}

async fn conversation(
    client: &Client,
    w: &Workload,
    session: usize,
) -> Result<Outcome, ClientError> {
    let mut messages = vec![json!({
        "role": "system",
        "content": system_prompt(session % w.system_prompts.max(1), w.system_words),
    })];
    let mut out = Outcome::default();
    for turn in 0..w.turns {
        messages.push(json!({
            "role": "user",
            "content": format!("Session {session}, question {turn}: what is the next step of the plan?"),
        }));
        let reply = client
            .post_json(
                "/v1/chat/completions",
                &chat_body(w, session, turn, &messages),
                &[],
            )
            .await?;
        out.requests += 1;
        if reply.status.is_success() {
            out.ok += 1;
            messages.push(json!({"role": "assistant", "content": reply.chat_text()}));
        } else {
            out.failures.push(reply.status.as_u16());
            break;
        }
    }
    Ok(out)
}

/// Runs the workload through `client`.
pub async fn run(client: &Client, w: &Workload) -> Result<Outcome, ClientError> {
    let results = if w.sequential {
        let mut r = Vec::with_capacity(w.sessions);
        for s in 0..w.sessions {
            r.push(conversation(client, w, s).await);
        }
        r
    } else {
        futures::future::join_all((0..w.sessions).map(|s| conversation(client, w, s))).await
    };
    let mut total = Outcome::default();
    for r in results {
        let r = r?;
        total.requests += r.requests;
        total.ok += r.ok;
        total.failures.extend(r.failures);
    }
    Ok(total)
}
