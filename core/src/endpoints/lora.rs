//! Which LoRA adapters a worker has resident, and how many it may hold, as its
//! engine's adapter gauge says (vLLM's `vllm:lora_requests_info`).
//!
//! Adapters are kept by [`adapter_id`], a hash of the name, so a pick compares
//! integers and a worker's page cannot make kvpick hold long strings. A worker
//! controls this input: at most [`MAX_ADAPTERS`] ids are kept per worker (the
//! count of resident adapters is kept whole, so a full worker stays full).

use xxhash_rust::xxh3::xxh3_64;

/// Most adapter ids kept per worker (vLLM's `--max-loras` is usually far below).
pub const MAX_ADAPTERS: usize = 64;

/// The id of an adapter (or model) name: its xxh3-64 hash.
pub fn adapter_id(name: &str) -> u64 {
    xxh3_64(name.as_bytes())
}

/// A worker's adapter state from one scrape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoraInfo {
    /// Ids of the resident (running or waiting) adapters, sorted, deduplicated,
    /// at most [`MAX_ADAPTERS`].
    resident: Box<[u64]>,
    /// How many distinct adapters are resident (not capped).
    resident_count: usize,
    /// Adapter slots (`max_lora`).
    max_lora: u32,
    /// Id of the base model the worker serves (its metrics' `model_name`), when known.
    base_model: Option<u64>,
}

/// How well a worker fits a request's adapter, best first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoraFit {
    /// Nothing to go by: the worker exports no adapter state, or the request
    /// names the worker's base model.
    Neutral,
    /// The adapter is resident (running or waiting).
    Resident,
    /// Not resident, but a slot is free to load it.
    FreeSlot,
    /// Not resident and every slot taken: loading it waits for one to free.
    Full,
}

impl LoraInfo {
    /// The state of a worker with `resident` adapter names (running and
    /// waiting, duplicates allowed), `max_lora` slots, serving `base_model`.
    pub fn new<'a>(
        resident: impl IntoIterator<Item = &'a str>,
        max_lora: u32,
        base_model: Option<&str>,
    ) -> Self {
        let mut ids: Vec<u64> = resident
            .into_iter()
            .filter(|n| !n.is_empty())
            .map(adapter_id)
            .collect();
        ids.sort_unstable();
        ids.dedup();
        let resident_count = ids.len();
        ids.truncate(MAX_ADAPTERS);
        LoraInfo {
            resident: ids.into_boxed_slice(),
            resident_count,
            max_lora,
            base_model: base_model.map(adapter_id),
        }
    }

    /// Distinct adapters resident (not capped).
    pub fn resident_count(&self) -> usize {
        self.resident_count
    }

    /// Adapter slots.
    pub fn max_lora(&self) -> u32 {
        self.max_lora
    }

    /// How this worker fits a request for the adapter (or model) `id`.
    pub fn fit(&self, id: u64) -> LoraFit {
        if self.base_model == Some(id) {
            LoraFit::Neutral
        } else if self.resident.binary_search(&id).is_ok() {
            LoraFit::Resident
        } else if self.resident_count < self.max_lora as usize {
            LoraFit::FreeSlot
        } else {
            LoraFit::Full
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fit_orders_resident_free_slot_full_and_leaves_the_base_model_alone() {
        let one_free = LoraInfo::new(["a", "b", "a", ""], 3, Some("base"));
        assert_eq!(one_free.resident_count(), 2);
        assert_eq!(one_free.fit(adapter_id("a")), LoraFit::Resident);
        assert_eq!(one_free.fit(adapter_id("c")), LoraFit::FreeSlot);
        assert_eq!(one_free.fit(adapter_id("base")), LoraFit::Neutral);
        let full = LoraInfo::new(["a", "b"], 2, None);
        assert_eq!(full.fit(adapter_id("c")), LoraFit::Full);
        assert_eq!(full.fit(adapter_id("b")), LoraFit::Resident);
    }

    #[test]
    fn a_worker_listing_many_adapters_is_capped_but_stays_full() {
        let names: Vec<String> = (0..10_000).map(|i| format!("adapter-{i}")).collect();
        let info = LoraInfo::new(names.iter().map(String::as_str), 8, None);
        assert_eq!(info.resident.len(), MAX_ADAPTERS);
        assert_eq!(info.resident_count(), 10_000);
        assert_eq!(info.fit(adapter_id("new")), LoraFit::Full);
    }
}
