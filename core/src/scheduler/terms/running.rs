//! `running-requests-size-scorer`: the requests running on the candidate,
//! each counted at the term's weight in blocks. Every request of a decode
//! batch slows the others' tokens, so a worker running fewer requests serves
//! this one's tokens sooner (the llm-d Router's scorer of that name prefers
//! the fewest `num_requests_running`).
//!
//! The count is the scraped figure per rank (a suspect worker's last one),
//! and at least the requests kvpick has in flight there: a scrape shows a
//! request only after it, so the requests routed within one scrape interval
//! would otherwise all go to the worker it showed idlest. A worker never
//! scraped counts kvpick's in-flight requests. Weighted 0 by default (the
//! other load terms decide); the least cost is 0, so the bound is 0.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::{bound, Candidate, RequestCost, Scorer, TermDecl};
use crate::scheduler::plugin::{decode_params, Knob, PluginArgs, PluginError, Weight};

/// The declaration.
pub static TERM: TermDecl = TermDecl {
    name: "running",
    types: &["running-requests-size-scorer"],
    weight: Weight::Flag(Knob {
        flag: "weight-running",
        env: "KVPICK_WEIGHT_RUNNING",
        default: 0.0,
        help: "Cost weight per request running on the candidate (scraped, or in flight from kvpick when more)",
    }),
    prefill_weight: None,
    unit: false,
    build: |a| Ok(Arc::new(RunningRequests::from_config(a)?)),
};

/// The running-requests cost term.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RunningRequests {
    /// Per running request.
    pub weight: f64,
}

/// The llm-d scorer's parameters kvpick reads: none.
#[derive(Debug, Default, Serialize, Deserialize)]
struct Params {}

impl RunningRequests {
    /// The term the registry builds: the mapped weight.
    pub fn from_config(args: &mut PluginArgs<'_>) -> Result<Self, PluginError> {
        let Params {} = decode_params(args)?;
        Ok(RunningRequests {
            weight: args.weight,
        })
    }
}

impl Scorer for RunningRequests {
    fn name(&self) -> &'static str {
        TERM.name
    }

    #[inline]
    fn cost(&self, c: &Candidate<'_>, _req: &RequestCost) -> f64 {
        let scraped = c.scraped().map_or(0.0, |s| s.running / c.ranks());
        self.weight * scraped.max(c.in_flight())
    }

    fn lower_bound(&self, _new_blocks: usize, _req: &RequestCost) -> Option<f64> {
        bound(self.weight, 0.0)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;
    use crate::fixtures::{pool, prompt, scrape, with_body};
    use crate::scheduler::{Plugins, Scheduler, SchedulerConfig, TermWeights};

    /// A scheduler with the running term at `weight` (the others at their defaults).
    fn weighted(weight: f64, seed: u64) -> Scheduler {
        Scheduler::new(SchedulerConfig {
            plugins: Plugins::with_weights(&TermWeights::default().with(&TERM, weight), 0.0),
            tie_break_seed: Some(seed),
            ..SchedulerConfig::default()
        })
    }

    #[test]
    fn the_worker_running_fewer_requests_wins_once_the_term_weighs() {
        let t = pool(2, 80);
        let snap = t.snapshot();
        let now = Instant::now();
        // Scraped idle otherwise: the running requests are all that differs.
        scrape(&snap.endpoints[0], 0.0, 8.0, 0.0, now);
        scrape(&snap.endpoints[1], 0.0, 2.0, 0.0, now);
        let p = prompt("a prompt no worker holds");
        let picked = |weight: f64| -> Vec<String> {
            (0..16)
                .map(|seed| {
                    let s = weighted(weight, seed);
                    let d = s.pick_at(&with_body(&p), &snap, now).unwrap();
                    d.decode.endpoint().address_string()
                })
                .collect()
        };
        // Weighted 0 (the default), the two tie and both are picked.
        let unweighted = picked(0.0);
        assert!(
            unweighted.iter().any(|a| a == "10.0.0.1:80"),
            "{unweighted:?}"
        );
        assert!(
            unweighted.iter().any(|a| a == "10.0.0.2:80"),
            "{unweighted:?}"
        );
        assert!(picked(1.0).iter().all(|a| a == "10.0.0.2:80"));

        let e = weighted(1.0, 0)
            .explain(&with_body(&p), &snap, now)
            .unwrap();
        let cost = |a: &str| {
            let c = e.candidates.iter().find(|c| c.address == a).unwrap();
            c.terms.get(TERM.name)
        };
        assert_eq!((cost("10.0.0.1:80"), cost("10.0.0.2:80")), (8.0, 2.0));
        // Requests in flight there beyond what the scrape shows count too.
        snap.endpoints[1].add_peer_requests(0, 10);
        assert!(picked(1.0).iter().all(|a| a == "10.0.0.1:80"));
    }

    #[test]
    fn the_default_list_sums_it_at_weight_0_and_its_bound_holds() {
        let s = Scheduler::default();
        let names: Vec<&str> = s
            .plugins()
            .plugins
            .scorers
            .iter()
            .map(|x| x.name())
            .collect();
        assert!(names.contains(&TERM.name), "{names:?}");
        let t = pool(1, 80);
        let snap = t.snapshot();
        let now = Instant::now();
        scrape(&snap.endpoints[0], 0.0, 30.0, 0.0, now);
        let p = prompt("hello");
        let e = s.explain(&with_body(&p), &snap, now).unwrap();
        assert_eq!(e.candidates[0].terms.get(TERM.name), 0.0);
        let req = s.request_cost(crate::scheduler::Side::Decode, 4, None, 0);
        let term = RunningRequests { weight: 2.0 };
        assert_eq!(term.lower_bound(3, &req), Some(0.0));
        assert_eq!(RunningRequests { weight: -1.0 }.lower_bound(3, &req), None);
    }
}
