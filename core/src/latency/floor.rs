//! The least TTFT any model a pick may read predicts for a given number of
//! uncached tokens: the least overhead plus the least prefill rate times the
//! tokens, over the pool prior (which cold workers use) and the warm workers'
//! own models. Every TTFT term is non-negative, so no prediction falls below
//! it; the pruned argmin skips candidates on it.
//!
//! Invariants: each least names the model it comes from; it moves down at
//! once when a model's coefficient falls below it, and is found again by a
//! scan only when its own model's coefficient rises or that model leaves the
//! set: amortised O(1) per update, never a scan per pick.

use super::features::{kilo, TTFT_UNCACHED};
use super::model::WorkerModel;

/// Index of the overhead term in the TTFT inputs.
const TTFT_OVERHEAD: usize = 0;
/// The TTFT coefficients the floor follows: overhead, s per uncached kilotoken.
const FOLLOWED: [usize; 2] = [TTFT_OVERHEAD, TTFT_UNCACHED];

/// A model a pick may read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Source<K> {
    /// The pool prior.
    Prior,
    /// A warm worker's own model.
    Worker(K),
}

/// The least of one coefficient and the model holding it.
#[derive(Debug, Clone, Copy)]
struct Least<K> {
    value: f64,
    from: Source<K>,
}

/// The least overhead and prefill rate over the models a pick may read.
#[derive(Debug, Clone)]
pub(crate) struct TtftFloor<K> {
    least: [Least<K>; 2],
}

impl<K: Copy + Eq> TtftFloor<K> {
    /// The floor of the prior alone.
    pub(crate) fn new(prior: &WorkerModel) -> Self {
        let c = prior.ttft_coefficients();
        TtftFloor {
            least: FOLLOWED.map(|i| Least {
                value: c[i],
                from: Source::Prior,
            }),
        }
    }

    /// `from` changed to `model` (`None`: it left the set a pick reads).
    /// Returns whether a least must be found again ([`Self::rescan`]).
    #[must_use]
    pub(crate) fn changed(&mut self, from: Source<K>, model: Option<&WorkerModel>) -> bool {
        let mut stale = false;
        for (least, i) in self.least.iter_mut().zip(FOLLOWED) {
            let value = model.map(|m| m.ttft_coefficients()[i]);
            match value {
                Some(v) if v < least.value => *least = Least { value: v, from },
                Some(v) if least.from == from => {
                    stale |= v > least.value;
                    least.value = v;
                }
                None if least.from == from => stale = true,
                _ => {}
            }
        }
        stale
    }

    /// The models the leasts come from.
    pub(crate) fn sources(&self) -> impl Iterator<Item = Source<K>> + '_ {
        self.least.iter().map(|l| l.from)
    }

    /// Finds each least again over `models` (the prior first).
    pub(crate) fn rescan<'a>(
        &mut self,
        models: impl Iterator<Item = (Source<K>, &'a WorkerModel)> + Clone,
    ) {
        for (least, i) in self.least.iter_mut().zip(FOLLOWED) {
            for (from, m) in models.clone() {
                let v = m.ttft_coefficients()[i];
                if from == Source::Prior || v < least.value {
                    *least = Least { value: v, from };
                }
            }
        }
    }

    /// The least TTFT, in seconds, of a request with `uncached_tokens` to
    /// prefill (summed as the fit's dot product begins, so rounding keeps it
    /// at or below any model's prediction).
    pub(crate) fn seconds(&self, uncached_tokens: u64) -> f64 {
        let [overhead, rate] = self.least.map(|l| l.value);
        overhead * 1.0 + rate * kilo(uncached_tokens)
    }
}
