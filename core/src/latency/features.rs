//! What the latency model reads and learns from: a routed request's features at
//! decision time, and what the response path showed (its [`Timeline`]).
//!
//! Features enter the model in fixed units (tokens in thousands, counts as
//! they are, KV usage as a fraction) so the coefficients read as physical
//! costs: seconds per thousand uncached tokens, per waiting request, and so on.
//! An observation is checked before it reaches a model: a non-finite, negative
//! or absurd figure is refused with a [`Rejected`] reason.

use std::time::{Duration, Instant};

/// Tokens per feature unit: token counts enter the model in thousands.
const TOKENS_PER_UNIT: f64 = 1024.0;
/// Largest prompt an observation may name (tokens).
pub const MAX_PROMPT_TOKENS: u64 = 16 << 20;
/// Longest TTFT an observation may report.
pub const MAX_TTFT: Duration = Duration::from_secs(3600);
/// Longest per-token decode time an observation may report.
pub const MAX_TPOT: Duration = Duration::from_secs(60);
/// Most output tokens a request's expected output counts for (a larger
/// `max_tokens` or hint reads as this).
pub const MAX_OUTPUT_TOKENS: u32 = 1 << 20;
/// Largest queue, running or in-flight count an observation may name.
pub const MAX_REQUESTS: f64 = 1.0e6;

/// A routed request on its chosen worker, at decision time.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Features {
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// Tokens to prefill after the worker's cached prefix.
    pub uncached_tokens: u64,
    /// Requests waiting in the engine's queue (scraped).
    pub waiting: f64,
    /// Requests running in the engine (scraped).
    pub running: f64,
    /// KV-cache usage in `[0, 1]` (scraped).
    pub kv_usage: f64,
    /// Prefill tokens kvpick sent there that have not produced a first token.
    pub pending_prefill_tokens: u64,
    /// Requests kvpick has in flight there.
    pub in_flight: u32,
    /// The request's `max_tokens`, when it gives one.
    pub max_tokens: Option<u32>,
}

/// Inputs of the TTFT fit: overhead, prefill per uncached kilotoken, wait per
/// pending prefill kilotoken, per waiting request, per running request, per
/// request that finds no free sequence slot ([`Features::slot_queue`]).
pub const TTFT_TERMS: usize = 6;
/// Inputs of the decode fit: base per-token time, slowdown per running
/// request, per unit of KV usage, per prompt kilotoken (attention context).
pub const TPOT_TERMS: usize = 4;

/// Index of the uncached-tokens term in the TTFT inputs.
pub(crate) const TTFT_UNCACHED: usize = 1;
/// Index of the running-requests term in the decode inputs.
pub(crate) const TPOT_RUNNING: usize = 1;

impl Features {
    /// Running requests there: the scrape or kvpick's own count, whichever is
    /// larger (the scrape lags, kvpick's count misses other replicas).
    pub fn load(&self) -> f64 {
        clean(self.running).max(self.in_flight as f64)
    }

    /// Requests there, running or waiting: the scrape's running plus
    /// waiting, or kvpick's own in-flight count, whichever is larger (the
    /// scrape lags the requests sent since).
    pub fn occupancy(&self) -> f64 {
        (clean(self.running) + clean(self.waiting)).max(self.in_flight as f64)
    }

    /// Requests, this one included, that find no free sequence slot on a
    /// worker that runs at most `slots` at once: each waits for a running
    /// request to finish. 0 when `slots` is unknown (below 1).
    pub fn slot_queue(&self, slots: f64) -> f64 {
        match slots >= 1.0 {
            true => (self.occupancy() + 1.0 - slots).max(0.0),
            false => 0.0,
        }
    }

    /// The TTFT inputs on a worker that runs at most `slots` requests at
    /// once (0: not known).
    pub fn ttft_inputs(&self, slots: f64) -> [f64; TTFT_TERMS] {
        [
            1.0,
            kilo(self.uncached_tokens),
            kilo(self.pending_prefill_tokens),
            clean(self.waiting),
            self.load(),
            self.slot_queue(slots),
        ]
    }

    /// The decode inputs.
    pub fn tpot_inputs(&self) -> [f64; TPOT_TERMS] {
        [
            1.0,
            self.load(),
            clean(self.kv_usage).min(1.0),
            kilo(self.prompt_tokens),
        ]
    }

    /// Checks the figures an observation is learned from.
    pub fn check(&self) -> Result<(), Rejected> {
        if self.prompt_tokens == 0 {
            return Err(Rejected::NoPrompt);
        }
        if self.prompt_tokens > MAX_PROMPT_TOKENS
            || self.pending_prefill_tokens > MAX_PROMPT_TOKENS * 1024
        {
            return Err(Rejected::Absurd("token count"));
        }
        if self.uncached_tokens > self.prompt_tokens {
            return Err(Rejected::Absurd("more uncached tokens than prompt tokens"));
        }
        for (name, v) in [("waiting", self.waiting), ("running", self.running)] {
            if !(v.is_finite() && (0.0..=MAX_REQUESTS).contains(&v)) {
                return Err(Rejected::Absurd(name));
            }
        }
        if !(self.kv_usage.is_finite() && (0.0..=1.0).contains(&self.kv_usage)) {
            return Err(Rejected::Absurd("kv usage"));
        }
        if self.in_flight as f64 > MAX_REQUESTS {
            return Err(Rejected::Absurd("in flight"));
        }
        Ok(())
    }
}

/// `tokens` in model units.
pub(super) fn kilo(tokens: u64) -> f64 {
    tokens as f64 / TOKENS_PER_UNIT
}

/// A count or fraction for prediction: non-finite or negative reads as 0,
/// so a bad scrape can skew a prediction but never poison it.
fn clean(v: f64) -> f64 {
    if v.is_finite() && v > 0.0 {
        v.min(MAX_REQUESTS)
    } else {
        0.0
    }
}

/// What the response path showed for one request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Observed {
    /// Time from the decision to the first response chunk.
    pub ttft: Duration,
    /// Mean time per later chunk, when there were any.
    pub tpot: Option<Duration>,
}

impl Observed {
    /// Checks the times.
    pub fn check(&self) -> Result<(), Rejected> {
        if self.ttft.is_zero() || self.ttft > MAX_TTFT {
            return Err(Rejected::Absurd("ttft"));
        }
        if let Some(t) = self.tpot {
            if t.is_zero() || t > MAX_TPOT {
                return Err(Rejected::Absurd("tpot"));
            }
        }
        Ok(())
    }

    /// From seconds, as a simulator or a peer reports them: `None` when a
    /// figure is negative or not finite.
    pub fn from_secs(ttft: f64, tpot: Option<f64>) -> Option<Observed> {
        let d = |s: f64| Duration::try_from_secs_f64(s).ok();
        Some(Observed {
            ttft: d(ttft)?,
            tpot: match tpot {
                Some(t) => Some(d(t)?),
                None => None,
            },
        })
    }
}

/// How a response ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    /// The upstream answered with this HTTP status and the body finished.
    Status(u16),
    /// The client or the gateway went away first.
    Cancelled,
}

/// The instants of one streamed response, folded as they arrive into an
/// [`Observed`]: the first body chunk marks TTFT, later chunks the decode pace.
/// Fixed size; no allocation. For streamed responses only: a non-streamed body
/// arrives whole at the end, so its first chunk marks the end, not the first
/// token.
#[derive(Debug, Clone, Copy)]
pub struct Timeline {
    decided: Instant,
    first: Option<Instant>,
    last: Option<Instant>,
    later_chunks: u32,
}

impl Timeline {
    /// A response routed at `decided`.
    pub fn new(decided: Instant) -> Self {
        Timeline {
            decided,
            first: None,
            last: None,
            later_chunks: 0,
        }
    }

    /// A body chunk of `bytes` arrived at `at` (empty chunks carry no token).
    pub fn chunk(&mut self, at: Instant, bytes: usize) {
        if bytes == 0 {
            return;
        }
        match self.first {
            None => self.first = Some(at),
            Some(_) => {
                self.later_chunks = self.later_chunks.saturating_add(1);
                self.last = Some(at);
            }
        }
    }

    /// Time from the decision to the first chunk, once it came.
    pub fn ttft(&self) -> Option<Duration> {
        self.first
            .map(|f| f.saturating_duration_since(self.decided))
    }

    /// The observation, once the response `ended`: `None` for an error status
    /// or a response that never sent a body chunk. A cancelled stream still
    /// reports what it showed.
    pub fn finish(&self, ended: Ended) -> Option<Observed> {
        if matches!(ended, Ended::Status(s) if !(200..300).contains(&s)) {
            return None;
        }
        let first = self.first?;
        let tpot = match (self.last, self.later_chunks) {
            (Some(last), n) if n > 0 => Some(last.saturating_duration_since(first) / n),
            _ => None,
        };
        Some(Observed {
            ttft: first.saturating_duration_since(self.decided),
            tpot,
        })
    }
}

/// Why an observation was not learned from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Rejected {
    /// The request named no prompt tokens.
    #[error("observation names no prompt tokens")]
    NoPrompt,
    /// A figure is negative, not finite, or past its bound.
    #[error("observation has an absurd {0}")]
    Absurd(&'static str),
    /// A shared model failed its checks.
    #[error("shared latency model is malformed")]
    Malformed,
}
