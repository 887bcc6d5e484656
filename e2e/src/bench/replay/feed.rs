//! Feeds a scheduler's latency models ([`Learner`]) from a simulator, as the
//! gateway's request flow feeds them: at each completion, the features the
//! decision kept and the times the response path would have shown.
//!
//! What a simulator reports is what a gateway sees: the decision instant (the
//! arrival, the pick is immediate), the first token (the first response
//! chunk) and the last one (the end of the stream), and the output tokens (one
//! chunk each). TTFT is arrival to first token, learned at the first token as
//! the gateway's learner does; the decode time per token is first to last
//! token over the tokens after the first, as the gateway's
//! [`Timeline`](kvpick::latency::Timeline) folds chunks, learned at the end.
//! Nothing the engine knows and the gateway does not (its queue order, step
//! times) is read.
//!
//! Prediction quality is measured on the decisions themselves: each followed
//! request keeps the TTFT predicted for it on its worker at decision time, and
//! once [`WARM_UP_COMPLETIONS`] requests have completed, each first token adds
//! |predicted − actual| / actual to the errors ([`PredictionError`]).
//! Invariant: a request is followed from its decision to its end, or until its
//! decision carried no features (heuristic scoring); nothing else is kept.

use std::collections::HashMap;
use std::hash::Hash;
use std::time::Instant;

use kvpick::endpoints::WorkerKey;
use kvpick::latency::{Features, Learner};
use kvpick::scheduler::Decision;
use serde::Serialize;

use crate::bench::{quantile, sorted};

/// Completions before prediction errors count: the pool prior warms at 32
/// observations and each worker's own model at 32 of its own, so with 8
/// workers the models have seen their first observations by then.
pub const WARM_UP_COMPLETIONS: usize = 200;

/// One followed request.
#[derive(Debug, Clone, Copy)]
struct Followed {
    worker: WorkerKey,
    features: Features,
    decided: Instant,
    /// The TTFT predicted at decision time, when the pool prior was warm.
    predicted_ttft: Option<f64>,
    first_token: Option<Instant>,
}

/// A simulator's feed of one scheduler's [`Learner`], requests keyed by `K`.
#[derive(Debug)]
pub struct LatencyFeed<K> {
    followed: HashMap<K, Followed>,
    completions: usize,
    errors: Vec<f64>,
    learned: u64,
}

impl<K> Default for LatencyFeed<K> {
    fn default() -> Self {
        LatencyFeed {
            followed: HashMap::new(),
            completions: 0,
            errors: Vec::new(),
            learned: 0,
        }
    }
}

/// Median |predicted − actual| / actual TTFT over the requests completed after
/// warm-up with a prediction at decision time.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct PredictionError {
    /// The median relative error.
    pub median: f64,
    /// Requests it is the median of.
    pub samples: usize,
    /// First tokens learned from.
    pub learned: u64,
}

impl<K: Copy + Eq + Hash> LatencyFeed<K> {
    /// Request `id` was routed by `decision` at `at`; `learner` is the
    /// scheduler's (none: heuristic scoring, nothing to feed).
    pub fn routed(&mut self, id: K, decision: &Decision, learner: Option<&Learner>, at: Instant) {
        let (Some(learner), Some(features)) = (learner, decision.latency_features) else {
            return;
        };
        let worker = decision.decode.key();
        self.followed.insert(
            id,
            Followed {
                worker,
                features,
                decided: at,
                predicted_ttft: learner.predict(&worker, &features).map(|p| p.ttft),
                first_token: None,
            },
        );
    }

    /// Request `id`'s first token came out at `at`: `learner` learns its TTFT.
    pub fn first_token(&mut self, id: K, at: Instant, learner: &Learner) {
        let Some(f) = self.followed.get_mut(&id) else {
            return;
        };
        if f.first_token.is_some() {
            return;
        }
        f.first_token = Some(at);
        self.completions += 1;
        let ttft = at.saturating_duration_since(f.decided);
        let actual = ttft.as_secs_f64();
        if let Some(p) = f.predicted_ttft {
            if self.completions > WARM_UP_COMPLETIONS && actual > 0.0 {
                self.errors.push((p - actual).abs() / actual);
            }
        }
        // A zero time (a simulator's instant step) is refused by the model.
        learner.learn_first_token(f.worker, &f.features, ttft);
        self.learned += 1;
    }

    /// Request `id` ended at `at` after `output_tokens` tokens: `learner`
    /// learns its decode pace.
    pub fn finished(&mut self, id: K, at: Instant, output_tokens: usize, learner: &Learner) {
        let Some(f) = self.followed.remove(&id) else {
            return;
        };
        let (Some(first), true) = (f.first_token, output_tokens > 1) else {
            return;
        };
        let gaps = u32::try_from(output_tokens - 1).unwrap_or(u32::MAX);
        learner.learn_decode(
            f.worker,
            &f.features,
            at.saturating_duration_since(first) / gaps,
        );
    }

    /// The prediction error so far (`None` before any counted completion).
    pub fn error(&self) -> Option<PredictionError> {
        if self.errors.is_empty() {
            return None;
        }
        let errors = sorted(self.errors.clone());
        Some(PredictionError {
            median: quantile(&errors, 0.5),
            samples: errors.len(),
            learned: self.learned,
        })
    }
}
