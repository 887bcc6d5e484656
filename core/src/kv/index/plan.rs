//! Planning one chunk of a precise store under the read lock: what each block
//! is for its worker, before the write lock is taken.

use super::state::{Inner, Loc, StorePlan};
use crate::kv::table::BlockTable;

impl StorePlan {
    /// Plans `chunk` for a worker whose engine map is `map` and cap `limit`: a
    /// block already stored under its engine hash is kept for the chain's
    /// context, an engine hash naming another block releases that one.
    pub(super) fn make(
        &mut self,
        g: &Inner,
        map: &mut BlockTable<Loc>,
        chunk: &[(u64, u64)],
        limit: usize,
    ) {
        self.chain.clear();
        self.mapped.clear();
        self.released.clear();
        self.released_here.clear();
        self.stopped = None;
        // One bit per `engine % 1024` of the engine hashes mapped in this chunk
        // (1,024 bits for [`WRITE_CHUNK`] hashes: a repeat is rarely suspected
        // wrongly, and a suspected one is checked).
        let mut in_chunk = [0u64; 16];
        for (i, &(engine, hash)) in chunk.iter().enumerate() {
            let (word, bit) = ((engine >> 6) as usize % 16, 1u64 << (engine % 64));
            let earlier = if in_chunk[word] & bit != 0 {
                self.mapped
                    .iter()
                    .rev()
                    .copied()
                    .find(|&(j, _)| chunk[j].0 == engine)
            } else {
                None
            };
            let place = match earlier {
                Some((j, _)) if chunk[j].1 == hash => {
                    self.chain.push(hash);
                    continue;
                }
                Some((j, place)) => {
                    self.released_here.push(j);
                    place
                }
                None => match map.place(engine) {
                    Ok((place, l)) => {
                        match g.hash_at(l) {
                            Some(h) if h == hash => {
                                self.chain.push(hash);
                                continue;
                            }
                            Some(h) => self.released.push((h, l)),
                            None => {}
                        }
                        place
                    }
                    Err(_) if map.len() >= limit => {
                        self.stopped = Some(i);
                        break;
                    }
                    // Claimed now (one probe per block), its location set after the write.
                    Err(place) => map.claim(place, engine),
                },
            };
            in_chunk[word] |= bit;
            self.mapped.push((i, place));
            self.chain.push(hash);
        }
    }
}
