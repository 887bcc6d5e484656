//! `kvpick-bench gen-trace`: a public, seeded generator of low-reuse chat
//! traffic in Mooncake's trace format, small hash blocks.
//!
//! The traffic class: short multi-turn chats whose prompts are about 2k tokens,
//! few turns per chat, and little reuse between chats (one small system prompt
//! shared by all). Where prefix savings are this small, a router that chases
//! them pays in queueing; this trace is what kvpick is tuned to balance on.
//!
//! Model (every draw from one [`SplitMix64`] seeded with `--seed`):
//! - chats start as a Poisson process of `chat_rate` chats per second;
//! - a chat has 1 turn, and after each turn another with probability
//!   `follow_up`, at most `max_turns` (defaults 0.35 and 4: 1.5 turns a chat);
//! - turn 1's prompt is the shared system prompt (`system_tokens`, default 128)
//!   plus a user message uniform in `first_user` (default 1,200–2,800 tokens,
//!   so prompts average ~2.1k tokens); a later turn's prompt is the previous
//!   prompt, the previous answer and a new user message uniform in
//!   `next_user` (default 100–500);
//! - outputs are uniform in `output` (default 50–350 tokens);
//! - a later turn arrives the previous answer's think time after the previous
//!   turn, exponential with mean `think_s` (default 20 s);
//! - `hash_ids` at `block_tokens` (default 64) per block: the system prompt's
//!   full blocks carry the same ids in every chat, a later turn repeats its
//!   previous prompt's full blocks and every other block is new. The answer's
//!   tokens are new blocks in the next prompt (an engine caches prompts).
//!
//! Invariants: the same flags give the same file; `hash_ids` has
//! `ceil(input_length / block_tokens)` ids; timestamps are sorted.

use std::io::Write;
use std::path::PathBuf;

use super::trace::TraceRequest;
use super::SplitMix64;

/// Flags of `kvpick-bench gen-trace`.
#[derive(Debug, Clone, clap::Args)]
pub struct GenTraceArgs {
    /// Where to write the trace (JSON lines).
    #[arg(long)]
    pub out: PathBuf,
    /// Seed of every draw.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Chats in the trace.
    #[arg(long, default_value_t = 1500)]
    pub chats: usize,
    /// New chats per second (Poisson).
    #[arg(long, default_value_t = 4.0)]
    pub chat_rate: f64,
    /// Probability of another turn after each turn.
    #[arg(long, default_value_t = 0.35)]
    pub follow_up: f64,
    /// Most turns of a chat.
    #[arg(long, default_value_t = 4)]
    pub max_turns: usize,
    /// Mean think time between a chat's turns, seconds (exponential).
    #[arg(long, default_value_t = 20.0)]
    pub think_s: f64,
    /// Tokens of the system prompt every chat shares.
    #[arg(long, default_value_t = 128)]
    pub system_tokens: usize,
    /// Tokens of a chat's first user message, `MIN,MAX` (uniform).
    #[arg(long, value_delimiter = ',', default_value = "1200,2800")]
    pub first_user: Vec<usize>,
    /// Tokens of a later user message, `MIN,MAX` (uniform).
    #[arg(long, value_delimiter = ',', default_value = "100,500")]
    pub next_user: Vec<usize>,
    /// Output tokens of a turn, `MIN,MAX` (uniform).
    #[arg(long, value_delimiter = ',', default_value = "50,350")]
    pub output: Vec<usize>,
    /// Tokens per hash block.
    #[arg(long, default_value_t = 64)]
    pub block_tokens: usize,
}

impl GenTraceArgs {
    /// The trace these flags describe, in arrival order.
    pub fn generate(&self) -> anyhow::Result<Vec<TraceRequest>> {
        let range = |name: &str, v: &[usize]| -> anyhow::Result<(usize, usize)> {
            match v {
                [lo, hi] if lo <= hi => Ok((*lo, *hi)),
                _ => anyhow::bail!("--{name} takes MIN,MAX with MIN <= MAX, got {v:?}"),
            }
        };
        let first_user = range("first-user", &self.first_user)?;
        let next_user = range("next-user", &self.next_user)?;
        let output = range("output", &self.output)?;
        anyhow::ensure!(self.block_tokens > 0, "--block-tokens must be positive");
        anyhow::ensure!(self.chat_rate > 0.0, "--chat-rate must be positive");
        anyhow::ensure!(
            (0.0..=1.0).contains(&self.follow_up),
            "--follow-up is a probability"
        );
        let block = self.block_tokens;
        let mut g = SplitMix64::new(self.seed);
        let uniform = |g: &mut SplitMix64, (lo, hi): (usize, usize)| {
            lo + g.below((hi - lo + 1) as u64) as usize
        };
        // Ids 0.. are the system prompt's full blocks; fresh ids follow.
        let system_blocks = (self.system_tokens / block) as u64;
        let mut next_id = system_blocks;
        let mut out = Vec::new();
        let mut start_ms = 0.0;
        for _ in 0..self.chats {
            start_ms += exponential(&mut g, 1000.0 / self.chat_rate);
            let mut at_ms = start_ms;
            // The previous turn's prompt: its length and its hash ids.
            let mut prev: Option<(usize, usize, Vec<u64>)> = None;
            for turn in 0..self.max_turns.max(1) {
                if turn > 0 {
                    if unit(&mut g) >= self.follow_up {
                        break;
                    }
                    at_ms += exponential(&mut g, self.think_s * 1000.0);
                }
                let (input_length, mut hash_ids) = match &prev {
                    None => (
                        self.system_tokens + uniform(&mut g, first_user),
                        (0..system_blocks).collect::<Vec<u64>>(),
                    ),
                    Some((len, answer, ids)) => (
                        len + answer + uniform(&mut g, next_user),
                        ids[..len / block].to_vec(),
                    ),
                };
                while hash_ids.len() < input_length.div_ceil(block) {
                    hash_ids.push(next_id);
                    next_id += 1;
                }
                let output_length = uniform(&mut g, output);
                out.push(TraceRequest {
                    timestamp: at_ms as u64,
                    input_length,
                    output_length,
                    hash_ids: hash_ids.clone(),
                });
                prev = Some((input_length, output_length, hash_ids));
            }
        }
        out.sort_by_key(|r| r.timestamp);
        Ok(out)
    }

    /// Generates the trace and writes it to `--out`; returns how many requests.
    pub fn write(&self) -> anyhow::Result<usize> {
        let trace = self.generate()?;
        let mut f = std::io::BufWriter::new(std::fs::File::create(&self.out)?);
        for r in &trace {
            serde_json::to_writer(&mut f, r)?;
            f.write_all(b"\n")?;
        }
        f.flush()?;
        Ok(trace.len())
    }
}

/// A draw uniform in `[0, 1)`.
fn unit(g: &mut SplitMix64) -> f64 {
    (g.next_u64() >> 11) as f64 / (1u64 << 53) as f64
}

/// A draw exponential with `mean`.
fn exponential(g: &mut SplitMix64, mean: f64) -> f64 {
    -mean * (1.0 - unit(g)).ln()
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: GenTraceArgs,
    }

    fn args(extra: &[&str]) -> GenTraceArgs {
        let mut argv = vec!["gen", "--out", "x.jsonl", "--chats", "400"];
        argv.extend_from_slice(extra);
        Cli::parse_from(argv).args
    }

    #[test]
    fn chats_share_only_the_system_prompt_and_turns_their_history() {
        let t = args(&[]).generate().unwrap();
        assert!(t.windows(2).all(|w| w[0].timestamp <= w[1].timestamp));
        let mean = t.iter().map(|r| r.input_length).sum::<usize>() as f64 / t.len() as f64;
        assert!((1900.0..2600.0).contains(&mean), "mean prompt {mean}");
        let turns = t.len() as f64 / 400.0;
        assert!((1.3..1.7).contains(&turns), "turns a chat {turns}");
        for r in &t {
            assert_eq!(r.hash_ids.len(), r.input_length.div_ceil(64));
            assert_eq!(r.hash_ids[..2], [0, 1], "the shared system prompt");
        }
        // Reuse: a block seen before is either the system prompt's or a chat's
        // own history; the infinite-cache ceiling stays low.
        let ceiling = super::super::replay::ceiling_hit_rate(&t);
        assert!((0.05..0.45).contains(&ceiling), "ceiling {ceiling}");
        let follow = t.iter().find(|r| r.input_length > 3000).unwrap();
        let earlier = t
            .iter()
            .filter(|r| r.timestamp < follow.timestamp)
            .map(|r| {
                r.hash_ids
                    .iter()
                    .zip(&follow.hash_ids)
                    .take_while(|(a, b)| a == b)
                    .count()
            })
            .max()
            .unwrap();
        assert!(earlier > 2, "a follow-up repeats its previous prompt");
    }

    #[test]
    fn the_same_flags_give_the_same_trace_and_seeds_differ() {
        assert_eq!(args(&[]).generate().unwrap(), args(&[]).generate().unwrap());
        assert_ne!(
            args(&[]).generate().unwrap(),
            args(&["--seed", "2"]).generate().unwrap()
        );
    }

    #[test]
    fn bad_ranges_are_refused() {
        let e = args(&["--output", "9,3"]).generate().unwrap_err();
        assert!(e.to_string().contains("--output"), "{e}");
        assert!(args(&["--block-tokens", "0"]).generate().is_err());
    }
}
