//! The plugin list: a scheduler runs the terms, filters and picker it is
//! given, `explain` lists the terms by name, and a term's lower bound keeps
//! the pruned argmin exact.

use std::sync::Arc;
use std::time::Instant;

use super::{both, prompt, with_body};
use crate::endpoints::EndpointState;
use crate::scheduler::filters::{Filter, FilterContext};
use crate::scheduler::terms::{prefix::PrefixCache, Candidate, RequestCost, Scorer};
use crate::scheduler::*;

/// A term that costs `cost` on the endpoint whose last address byte is `on`,
/// nothing elsewhere, with the bound 0.
#[derive(Debug)]
struct Penalty {
    on: u8,
    cost: f64,
}

impl Scorer for Penalty {
    fn name(&self) -> &'static str {
        "penalty"
    }

    fn cost(&self, c: &Candidate<'_>, _req: &RequestCost) -> f64 {
        match c.endpoint.endpoint.address.ip() {
            std::net::IpAddr::V4(ip) if ip.octets()[3] == self.on => self.cost,
            _ => 0.0,
        }
    }

    fn lower_bound(&self, _new_blocks: usize, _req: &RequestCost) -> Option<f64> {
        Some(0.0)
    }
}

/// Drops the endpoint whose last address byte is `not`.
#[derive(Debug)]
struct Not(u8);

impl Filter for Not {
    fn name(&self) -> &'static str {
        "not-filter"
    }

    fn reason(&self) -> &'static str {
        "not_this_one"
    }

    fn admits(&self, _at: &FilterContext<'_>, ep: &EndpointState) -> bool {
        !matches!(ep.endpoint.address.ip(), std::net::IpAddr::V4(ip) if ip.octets()[3] == self.0)
    }
}

fn with(plugins: Plugins) -> Scheduler {
    Scheduler::new(SchedulerConfig {
        plugins,
        tie_break_seed: Some(7),
        ..SchedulerConfig::default()
    })
}

fn prefix_only() -> Plugins {
    Plugins {
        scorers: vec![Arc::new(PrefixCache {
            weight: 1.0,
            prefill_weight: 2.0,
        })],
        ..Plugins::default()
    }
}

#[test]
fn a_configured_term_moves_the_pick_and_explain_names_it() {
    let t = both(2);
    let snap = t.snapshot();
    let now = Instant::now();
    let p = prompt(&"a shared prefix of some length. ".repeat(16));
    // Without the penalty the prompt's holder wins its repeat.
    let s = with(prefix_only());
    let first = s.pick_at(&with_body(&p), &snap, now).unwrap();
    let again = s.pick_at(&with_body(&p), &snap, now).unwrap();
    assert_eq!(again.decode.key(), first.decode.key());

    // A penalty on the holder larger than the prompt sends it elsewhere.
    let holder = match first.decode.endpoint().address.ip() {
        std::net::IpAddr::V4(ip) => ip.octets()[3],
        _ => unreachable!(),
    };
    let mut plugins = prefix_only();
    plugins.scorers.push(Arc::new(Penalty {
        on: holder,
        cost: 1e6,
    }));
    let s = with(plugins);
    s.index()
        .insert_chain(first.decode.key(), &s.block_hashes(&p), now);
    let d = s.pick_at(&with_body(&p), &snap, now).unwrap();
    assert_ne!(d.decode.key(), first.decode.key());
    let e = s.explain(&with_body(&p), &snap, now).unwrap();
    for c in &e.candidates {
        let names: Vec<&str> = c.terms.0.iter().map(|(n, _)| *n).collect();
        assert_eq!(names, ["prefill", "penalty"]);
        let expected = if c.key == first.decode.key() {
            1e6
        } else {
            0.0
        };
        assert_eq!(c.terms.get("penalty"), expected);
        assert_eq!(c.chosen, c.key == d.decode.key());
    }
}

#[test]
fn a_configured_filter_drops_endpoints_and_explain_gives_its_reason() {
    let t = both(3);
    let snap = t.snapshot();
    let now = Instant::now();
    let mut plugins = Plugins::default();
    plugins.filters.push(Arc::new(Not(2)));
    let s = with(plugins);
    let p = prompt("hello");
    for _ in 0..20 {
        let d = s.pick_at(&with_body(&p), &snap, now).unwrap();
        assert_ne!(d.decode.endpoint().address_string(), "10.0.0.2:80");
        s.finish(&d, Some(200));
    }
    let e = s.explain(&with_body(&p), &snap, now).unwrap();
    for c in &e.candidates {
        let dropped = c.address == "10.0.0.2:80";
        assert_eq!(c.filtered_out, dropped.then_some("not_this_one"), "{c:?}");
        assert_eq!(c.terms.0.is_empty(), dropped);
    }
}

/// The pruned argmin's floor under `s`'s current plugin list.
fn floor(s: &Scheduler, new_blocks: usize, req: &RequestCost) -> Option<f64> {
    Scheduler::cost_floor(&s.plugins().plugins, new_blocks, req)
}

#[test]
fn the_floor_is_the_sum_of_the_terms_lower_bounds() {
    let s = Scheduler::default();
    let req = s.request_cost(Side::Decode, 10, None, 0);
    // Default weights: prefill 1 per block to prefill, every other term ≥ 0.
    assert_eq!(floor(&s, 7, &req), Some(7.0));
    let req = s.request_cost(Side::Prefill, 10, None, 0);
    assert_eq!(floor(&s, 7, &req), Some(14.0), "prefill_overlap 2");
    // A term without a bound (a negative weight) leaves no floor.
    let s = with(Plugins::with_weights(
        &TermWeights::default().with(&terms::queue::TERM, -1.0),
        0.0,
    ));
    assert_eq!(
        floor(&s, 7, &s.request_cost(Side::Decode, 10, None, 0)),
        None
    );
}

#[test]
fn every_term_is_summed_in_the_decision_costs_however_many() {
    let t = both(1);
    let snap = t.snapshot();
    let mut plugins = prefix_only();
    // Ten penalties on the one endpoint: eleven terms in all.
    plugins.scorers.extend((1..=10).map(|i| -> Arc<dyn Scorer> {
        Arc::new(Penalty {
            on: 1,
            cost: f64::from(i),
        })
    }));
    let s = with(plugins);
    let p = prompt("hello");
    for _ in 0..2 {
        let d = s.pick(&with_body(&p), &snap).unwrap();
        s.finish(&d, Some(200));
    }
    let live = s.plugins();
    let costs = &live.decision_cost;
    assert_eq!((costs.len(), costs.decisions()), (11, 2));
    for i in 1..=10 {
        assert_eq!(costs.sum(i), 2.0 * i as f64, "term {i}");
    }
}

/// A swapped-in plugin list decides the next picks, and the decision cost
/// sums of the terms both lists have carry over (by name, not position).
#[test]
fn set_plugins_swaps_the_list_and_carries_each_terms_sum() {
    let t = both(2);
    let snap = t.snapshot();
    let s = with(prefix_only());
    let p = prompt(&"a prompt of a few blocks. ".repeat(12));
    let d = s.pick(&with_body(&p), &snap).unwrap();
    s.finish(&d, Some(200));
    let before = s.plugins().decision_cost.sum(0);
    assert!(before > 0.0);

    // A penalty on endpoint 1, summed first, then the prefix term.
    let mut plugins = prefix_only();
    plugins
        .scorers
        .insert(0, Arc::new(Penalty { on: 1, cost: 1e6 }));
    s.set_plugins(plugins);
    let live = s.plugins();
    let names: Vec<&str> = live.plugins.scorers.iter().map(|x| x.name()).collect();
    assert_eq!(names, ["penalty", "prefill"]);
    assert_eq!(live.decision_cost.sum(0), 0.0);
    assert_eq!(live.decision_cost.sum(1), before);
    assert_eq!(live.decision_cost.decisions(), 1);
    for _ in 0..4 {
        let d = s.pick(&with_body(&p), &snap).unwrap();
        assert_ne!(d.decode.endpoint().address.ip().to_string(), "10.0.0.1");
        s.finish(&d, Some(200));
    }
}
