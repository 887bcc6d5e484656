//! LoRA affinity: a request for an adapter goes to a worker with the adapter
//! resident over one holding a little more of its prompt, then to a worker
//! with a free adapter slot over a full one; a base-model request is left to
//! the other terms, and the pruned pick agrees with `explain`'s full scoring.

use std::time::Instant;

use super::{body, both, with_body};
use crate::endpoints::{LoraInfo, Snapshot};
use crate::scheduler::*;

fn request(model: &str, text: &str) -> crate::request::InferenceRequest {
    body(&serde_json::json!({"model": model, "prompt": text}).to_string())
}

/// The decode pick for `req`, checked against `explain`'s choice.
fn pick(s: &Scheduler, req: &crate::request::InferenceRequest, snap: &Snapshot) -> usize {
    let now = Instant::now();
    let d = s.pick_at(&with_body(req), snap, now).unwrap();
    s.finish_at(&d, Some(200), now);
    let e = s.explain(&with_body(req), snap, now).unwrap();
    let chosen = e.candidates.iter().find(|c| c.chosen).unwrap();
    assert_eq!(chosen.key, d.decode.key(), "pruned pick and explain differ");
    snap.endpoints
        .iter()
        .position(|ep| ep.key(0) == d.decode.key())
        .unwrap()
}

#[test]
fn an_adapter_goes_where_it_is_resident_then_where_a_slot_is_free() {
    let s = Scheduler::default();
    let t = both(3);
    let snap = t.snapshot();
    let base = "meta-llama/Llama-3.1-8B-Instruct";
    let [a, b, c] = [0, 1, 2].map(|i| &snap.endpoints[i]);
    // A: full (2 of 2 slots) without sql-lora; B: sql-lora resident; C: a free slot.
    a.set_lora(Some(LoraInfo::new(
        ["chat-lora", "math-lora"],
        2,
        Some(base),
    )));
    b.set_lora(Some(LoraInfo::new(
        ["sql-lora", "math-lora"],
        2,
        Some(base),
    )));
    c.set_lora(Some(LoraInfo::new(["chat-lora"], 2, Some(base))));

    // A holds the whole prompt, B all but its last block.
    let text = "SELECT * FROM a_table_with_a_long_name; ".repeat(32);
    let sql = request("sql-lora", &text);
    let hashes = s.block_hashes(&sql);
    let now = Instant::now();
    s.index().insert(a.key(0), &hashes, now);
    s.index().insert(b.key(0), &hashes[..hashes.len() - 1], now);
    assert_eq!(
        pick(&s, &sql, &snap),
        1,
        "resident adapter over one more block"
    );
    let e = s.explain(&with_body(&sql), &snap, now).unwrap();
    let lora = |i: usize| e.candidates[i].terms.get("lora");
    assert_eq!(lora(1), 0.0);
    assert!(lora(0) > 0.0 && lora(2) > 0.0 && lora(2) < lora(0), "{e:?}");

    // Not resident anywhere, no prefix anywhere: the free slot wins.
    let fresh = request("new-lora", &"an unseen prompt. ".repeat(32));
    assert_eq!(pick(&s, &fresh, &snap), 2, "free slot over full workers");

    // The base model: every worker fits alike, the prompt's holder wins.
    let plain = request(base, &text);
    let plain_hashes = s.block_hashes(&plain);
    s.index().insert(a.key(0), &plain_hashes, now);
    assert_eq!(pick(&s, &plain, &snap), 0, "base-model request moved");
    let e = s.explain(&with_body(&plain), &snap, now).unwrap();
    assert!(e.candidates.iter().all(|c| c.terms.get("lora") == 0.0));
}

#[test]
fn workers_without_adapter_state_cost_nothing() {
    let s = Scheduler::default();
    let t = both(2);
    let snap = t.snapshot();
    let req = request("sql-lora", &"some prompt text. ".repeat(16));
    let e = s.explain(&with_body(&req), &snap, Instant::now()).unwrap();
    for c in &e.candidates {
        let names: Vec<&str> = c.terms.0.iter().map(|(n, _)| *n).collect();
        assert!(names.contains(&"lora"), "{names:?}");
        assert_eq!(c.terms.get("lora"), 0.0);
    }
}
