//! The KV-cache view of the pool: prefix block hashing ([`hash`]), the index of
//! which (worker, dp rank) holds which blocks ([`index`]), and the storage tiers
//! a worker holds them on ([`tier`]).
//!
//! Approximate mode fills the index from routing decisions; precise mode fills it
//! from the engines' KV events. Both use the same block hashes and the same index.

pub mod hash;
pub mod index;
mod lru;
mod slots;
mod table;
pub mod tier;
