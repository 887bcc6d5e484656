//! Recursive least squares with exponential forgetting and non-negative
//! coefficients: the fitter behind each latency model.
//!
//! The fit keeps the unconstrained least-squares estimate `theta` and predicts
//! with its projection onto the non-negative orthant, `coef` (each coefficient
//! is a physical cost: seconds per token, per request). The projection is
//! taken in the fit's own metric, `p`'s inverse, in which the windowed squared
//! error of any coefficients is their distance from `theta`: a coefficient
//! held at 0 moves the ones its input is correlated with by what the data
//! says they make up for it. Zeroing it alone would not: when an input is
//! nearly constant in the window (a full worker's running count), the fit
//! splits one level between it and the overhead, and a negative overhead
//! cut to 0 leaves the other's share, biasing every prediction by it.
//! Feeding the projection back into the recursion would desynchronise it
//! from `p` and can diverge while there are fewer informative observations
//! than terms; the estimate itself converges to the non-negative truth when
//! the physics holds.
//!
//! Invariants: `theta` is finite; `coef` is finite and non-negative, `theta`
//! itself when it is; `p` (the inverse information matrix) is finite,
//! symmetric, and its trace never exceeds [`MAX_TRACE`], so long stretches of
//! uninformative inputs cannot wind it up. An update costs O(D²) multiply-adds
//! per coefficient the projection holds at 0 (O(D³) at worst) and allocates
//! nothing.

use serde::{Deserialize, Serialize};

/// Largest trace of `p`: bounds how far one observation can move the fit.
pub const MAX_TRACE: f64 = 1.0e4;
/// Least share of `p`'s trace a coefficient's own variance must have for
/// holding it at 0 to move the others (below it, the division is noise).
const INFORMED: f64 = 1.0e-12;
/// Largest magnitude of a shared fit's estimate: no physical cost comes near
/// an hour per input unit, so a peer's fit past it is refused as absurd.
pub const MAX_SHARED_COEFFICIENT: f64 = 3600.0;

/// One least-squares fit of `y ≈ theta · x` over `D` inputs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rls<const D: usize> {
    theta: [f64; D],
    coef: [f64; D],
    p: [[f64; D]; D],
}

impl<const D: usize> Rls<D> {
    /// A fit starting at `theta` (negative entries clamp to 0) with
    /// `variance` on each coefficient: larger moves faster on the first
    /// observations.
    pub fn new(theta: [f64; D], variance: f64) -> Self {
        let mut p = [[0.0; D]; D];
        for (i, row) in p.iter_mut().enumerate() {
            row[i] = variance;
        }
        let mut r = Rls {
            theta,
            coef: [0.0; D],
            p,
        };
        r.project();
        r.cap_trace();
        r
    }

    /// The same coefficients with a fresh `variance` (a new worker starting
    /// from the pool's fit).
    pub fn restart(&self, variance: f64) -> Self {
        Rls::new(self.coef, variance)
    }

    /// The coefficients (non-negative).
    pub fn coefficients(&self) -> &[f64; D] {
        &self.coef
    }

    /// `coefficients · x`.
    pub fn predict(&self, x: &[f64; D]) -> f64 {
        self.coef.iter().zip(x).map(|(c, x)| c * x).sum()
    }

    /// Folds in one observation `y` at inputs `x`, forgetting old ones by
    /// `lambda` in `(0, 1]`. The caller checked that `x` and `y` are finite.
    pub fn update(&mut self, x: &[f64; D], y: f64, lambda: f64) {
        let mut px = [0.0; D];
        for (i, row) in self.p.iter().enumerate() {
            px[i] = row.iter().zip(x).map(|(p, x)| p * x).sum();
        }
        let denom = lambda + x.iter().zip(&px).map(|(x, px)| x * px).sum::<f64>();
        if !(denom.is_finite() && denom > 0.0) {
            return;
        }
        let err = y - self.theta.iter().zip(x).map(|(t, x)| t * x).sum::<f64>();
        let before = *self;
        for i in 0..D {
            self.theta[i] += px[i] / denom * err;
            for j in 0..D {
                self.p[i][j] = (self.p[i][j] - px[i] * px[j] / denom) / lambda;
            }
        }
        for i in 0..D {
            for j in 0..i {
                let m = 0.5 * (self.p[i][j] + self.p[j][i]);
                self.p[i][j] = m;
                self.p[j][i] = m;
            }
        }
        self.project();
        self.cap_trace();
        if !self.is_sound() {
            *self = before;
        }
    }

    /// Sets `coef` to the least-squares estimate with non-negative entries
    /// (the projection onto physical costs, in the metric of `p`'s inverse):
    /// the most negative coefficient is held at 0 and the others take their
    /// estimate given it (the conditional mean), until none is negative.
    /// Each coefficient is held at most once, so at most `D` rounds.
    fn project(&mut self) {
        let mut c = self.theta;
        let mut p = self.p;
        let trace: f64 = (0..D).map(|i| p[i][i]).sum();
        let mut held = [false; D];
        while let Some(i) = (0..D)
            .filter(|&i| !held[i] && c[i] < 0.0)
            .min_by(|&a, &b| c[a].total_cmp(&c[b]))
        {
            held[i] = true;
            let pii = p[i][i];
            // An input the window says nothing about moves nothing else.
            if pii > trace * INFORMED && pii.is_finite() {
                let col: [f64; D] = std::array::from_fn(|j| p[j][i]);
                let shift = c[i] / pii;
                for j in 0..D {
                    c[j] -= col[j] * shift;
                    for k in 0..D {
                        p[j][k] -= col[j] * col[k] / pii;
                    }
                }
            }
            c[i] = 0.0;
        }
        for (out, v) in self.coef.iter_mut().zip(c) {
            *out = match v.is_finite() {
                true => v.max(0.0),
                false => 0.0,
            };
        }
    }

    /// Scales `p` down so its trace stays within [`MAX_TRACE`].
    fn cap_trace(&mut self) {
        let trace: f64 = (0..D).map(|i| self.p[i][i]).sum();
        if trace > MAX_TRACE {
            let s = MAX_TRACE / trace;
            for row in &mut self.p {
                for v in row {
                    *v *= s;
                }
            }
        }
    }

    /// Finite estimate; finite, symmetric `p` with a non-negative diagonal
    /// and a bounded trace.
    fn is_sound(&self) -> bool {
        let trace: f64 = (0..D).map(|i| self.p[i][i]).sum();
        self.theta.iter().all(|t| t.is_finite())
            && (0..D).all(|i| {
                self.p[i][i] >= 0.0
                    && (0..D).all(|j| self.p[i][j].is_finite() && self.p[i][j] == self.p[j][i])
            })
            && trace <= MAX_TRACE * (1.0 + 1e-9)
    }

    /// The fit as plain vectors, for sharing between replicas.
    pub fn to_snapshot(&self) -> RlsSnapshot {
        RlsSnapshot {
            theta: self.theta.to_vec(),
            p: self.p.iter().flat_map(|r| r.iter().copied()).collect(),
        }
    }

    /// A fit from a snapshot, or `None` when its sizes are wrong, it breaks
    /// an invariant, or an estimate is past [`MAX_SHARED_COEFFICIENT`] (a
    /// peer's bad data never becomes the model).
    pub fn from_snapshot(s: &RlsSnapshot) -> Option<Self> {
        if s.theta.len() != D
            || s.p.len() != D * D
            || s.theta.iter().any(|t| t.abs() > MAX_SHARED_COEFFICIENT)
        {
            return None;
        }
        let mut r = Rls {
            theta: [0.0; D],
            coef: [0.0; D],
            p: [[0.0; D]; D],
        };
        r.theta.copy_from_slice(&s.theta);
        for (i, row) in r.p.iter_mut().enumerate() {
            row.copy_from_slice(&s.p[i * D..(i + 1) * D]);
        }
        r.project();
        r.is_sound().then_some(r)
    }
}

/// A serialisable [`Rls`]: coefficients and the row-major `p`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RlsSnapshot {
    /// The unconstrained estimate.
    pub theta: Vec<f64>,
    /// Inverse information matrix, row-major.
    pub p: Vec<f64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recovers_exact_coefficients() {
        let mut r = Rls::<2>::new([0.0, 0.0], 100.0);
        for i in 0..200 {
            let x = [1.0, (i % 17) as f64];
            r.update(&x, 0.5 + 0.25 * x[1], 1.0);
        }
        assert!(
            (r.coefficients()[0] - 0.5).abs() < 1e-3,
            "{:?}",
            r.coefficients()
        );
        assert!(
            (r.coefficients()[1] - 0.25).abs() < 1e-3,
            "{:?}",
            r.coefficients()
        );
    }

    #[test]
    fn coefficients_stay_non_negative() {
        let mut r = Rls::<2>::new([0.1, 0.1], 100.0);
        for i in 0..100 {
            let x = [1.0, (i % 9) as f64];
            r.update(&x, 5.0 - 0.5 * x[1], 1.0);
        }
        assert!(
            r.coefficients().iter().all(|c| *c >= 0.0),
            "{:?}",
            r.coefficients()
        );
        assert_eq!(r.coefficients()[1], 0.0, "the negative slope projects to 0");
        // With the slope at 0, the least-squares intercept is the mean of y.
        let mean = 5.0 - 0.5 * 4.0;
        assert!(
            (r.predict(&[1.0, 0.0]) - mean).abs() < 0.05,
            "the intercept is fitted given the slope: {:?}",
            r.coefficients()
        );
    }

    #[test]
    fn a_coefficient_held_at_zero_moves_the_correlated_ones() {
        // An input nearly constant in the window (a full worker's running
        // count, 14 to 16) and a rise with it steep enough that the
        // unconstrained fit puts the overhead below 0.
        let mut r = Rls::<2>::new([0.02, 0.001], 10.0);
        let y = |n: f64| 0.02 * n - 0.2;
        for i in 0..300 {
            let n = 14.0 + (i % 3) as f64;
            r.update(&[1.0, n], y(n), 0.98);
        }
        assert!(r.theta[0] < -0.1, "{:?}", r.theta);
        assert_eq!(r.coefficients()[0], 0.0);
        for n in [14.0, 15.0, 16.0] {
            let p = r.predict(&[1.0, n]);
            assert!(
                (p - y(n)).abs() < 0.25 * y(n),
                "at {n}: {p} for {} ({:?})",
                y(n),
                r.coefficients()
            );
        }
    }

    #[test]
    fn covariance_stays_bounded_without_excitation() {
        let mut r = Rls::<3>::new([0.0; 3], 1.0);
        for _ in 0..100_000 {
            r.update(&[1.0, 0.0, 0.0], 1.0, 0.9);
        }
        assert!(r.is_sound());
        let trace: f64 = (0..3).map(|i| r.p[i][i]).sum();
        assert!(trace <= MAX_TRACE * (1.0 + 1e-9));
    }

    #[test]
    fn snapshots_round_trip_and_bad_ones_are_refused() {
        let mut r = Rls::<2>::new([0.2, 0.3], 10.0);
        r.update(&[1.0, 2.0], 1.0, 0.99);
        let s = r.to_snapshot();
        assert_eq!(Rls::<2>::from_snapshot(&s), Some(r));
        assert_eq!(Rls::<3>::from_snapshot(&s), None, "wrong size");
        let mut bad = s.clone();
        bad.theta[0] = f64::NAN;
        assert_eq!(Rls::<2>::from_snapshot(&bad), None);
        let mut bad = s;
        bad.p[1] = 1.0;
        assert_eq!(Rls::<2>::from_snapshot(&bad), None, "asymmetric");
    }
}
