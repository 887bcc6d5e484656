//! [`Lru`]: a worker's approximate index entries in touch order.
//!
//! One open-addressing table (linear probing, like [`crate::kv::table::BlockTable`])
//! whose slots are the entries themselves: block hash, last-touch stamp and the
//! links of a doubly linked list in touch order (least recently touched at the
//! head), the links being slot numbers. Finding a block and moving it to the tail
//! reads one slot, not a table slot and then a node elsewhere: an insert of a long
//! prompt takes one cache miss per block here. A touch moves the entry to the tail
//! in place, so the list holds exactly one entry per block: nothing stale to skip
//! or compact, and eviction takes the head. Touching a prompt's blocks in chain
//! order relinks only neighbours just touched or touched next.
//!
//! Removal shifts the entries after the hole back (no tombstones); an entry that
//! moves has its list neighbours repointed. Growing rebuilds the table by walking
//! the list. Hash 0 marks an empty slot; its entry is kept aside ([`ZERO`]).

use crate::kv::table::{grown_slots, placement_secret};

/// No entry.
const NIL: u32 = u32::MAX;
/// The entry of hash 0, kept beside the table (0 marks an empty slot).
const ZERO: u32 = u32::MAX - 1;

/// A table slot: an entry when `hash != 0`.
#[derive(Debug, Clone, Copy, Default)]
struct Entry {
    hash: u64,
    prev: u32,
    next: u32,
    stamp: u32,
}

/// Block hashes in touch order with the stamp of their last touch; see the module doc.
#[derive(Debug)]
pub struct Lru {
    slots: Vec<Entry>,
    /// `64 - log2(slots.len())`.
    shift: u32,
    /// Placement secret: a client choosing block hashes cannot choose their slots.
    mul: u64,
    mask: u64,
    len: usize,
    /// The entry of hash 0 when `zero_held`.
    zero: Entry,
    zero_held: bool,
    head: u32,
    tail: u32,
}

impl Default for Lru {
    fn default() -> Self {
        let (mul, mask) = placement_secret();
        Lru {
            slots: Vec::new(),
            shift: 64,
            mul,
            mask,
            len: 0,
            zero: Entry::default(),
            zero_held: false,
            head: NIL,
            tail: NIL,
        }
    }
}

impl Lru {
    /// Entries held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether `hash` is held.
    pub fn contains(&self, hash: u64) -> bool {
        self.find(hash).is_some()
    }

    /// The stamp of `hash`'s last touch, if held.
    pub fn stamp(&self, hash: u64) -> Option<u32> {
        self.find(hash).map(|i| self.at(i).stamp)
    }

    /// Makes `hash` the most recently touched entry, with `stamp`; whether it is new.
    pub fn touch(&mut self, hash: u64, stamp: u32) -> bool {
        if let Some(i) = self.find(hash) {
            if i != self.tail {
                self.unlink(i);
                self.push_tail(i);
            }
            self.at_mut(i).stamp = stamp;
            return false;
        }
        self.reserve_one();
        let i = if hash == 0 {
            self.zero_held = true;
            ZERO
        } else {
            self.vacant(hash)
        };
        *self.at_mut(i) = Entry {
            hash,
            prev: NIL,
            next: NIL,
            stamp,
        };
        self.len += 1;
        self.push_tail(i);
        true
    }

    /// Drops `hash`; whether it was held.
    pub fn remove(&mut self, hash: u64) -> bool {
        match self.find(hash) {
            Some(i) => {
                self.remove_at(i);
                true
            }
            None => false,
        }
    }

    /// The least recently touched entry and its stamp.
    pub fn oldest(&self) -> Option<(u64, u32)> {
        (self.head != NIL).then(|| {
            let e = self.at(self.head);
            (e.hash, e.stamp)
        })
    }

    /// Drops the least recently touched entry; returns its hash.
    pub fn pop_oldest(&mut self) -> Option<u64> {
        let (hash, _) = self.oldest()?;
        self.remove_at(self.head);
        Some(hash)
    }

    /// The hashes held, least recently touched first.
    pub fn keys(&self) -> impl Iterator<Item = u64> + '_ {
        let mut at = self.head;
        std::iter::from_fn(move || {
            if at == NIL {
                return None;
            }
            let e = self.at(at);
            at = e.next;
            Some(e.hash)
        })
    }

    /// Loads what touching `hashes` will read (their slots), so that the cache
    /// misses overlap instead of queueing one behind the other. Returns the hashes
    /// not held (those a touch adds), lazily: the loads happen as the result is
    /// read, so read it to its end.
    #[must_use = "the loads happen as the result is read"]
    pub fn prefetch<'a>(
        &'a self,
        hashes: impl IntoIterator<Item = &'a u64> + 'a,
    ) -> impl Iterator<Item = &'a u64> + 'a {
        hashes.into_iter().filter(move |&&h| self.find(h).is_none())
    }

    /// Heap bytes held.
    pub fn heap_bytes(&self) -> usize {
        self.slots.capacity() * std::mem::size_of::<Entry>()
    }

    fn at(&self, i: u32) -> &Entry {
        match i {
            ZERO => &self.zero,
            i => &self.slots[i as usize],
        }
    }

    fn at_mut(&mut self, i: u32) -> &mut Entry {
        match i {
            ZERO => &mut self.zero,
            i => &mut self.slots[i as usize],
        }
    }

    fn home(&self, hash: u64) -> usize {
        ((hash ^ self.mask).wrapping_mul(self.mul) >> self.shift) as usize
    }

    fn wrap(&self) -> usize {
        self.slots.len() - 1
    }

    /// The entry of `hash`, if held.
    fn find(&self, hash: u64) -> Option<u32> {
        if hash == 0 {
            return self.zero_held.then_some(ZERO);
        }
        if self.slots.is_empty() {
            return None;
        }
        let mut i = self.home(hash);
        loop {
            match self.slots[i].hash {
                h if h == hash => return Some(i as u32),
                0 => return None,
                _ => i = (i + 1) & self.wrap(),
            }
        }
    }

    /// The empty slot where `hash` (not 0, not held) goes; there is room.
    fn vacant(&self, hash: u64) -> u32 {
        let mut i = self.home(hash);
        while self.slots[i].hash != 0 {
            i = (i + 1) & self.wrap();
        }
        i as u32
    }

    /// Makes room for one more entry (at most 3/4 of the slots used), rebuilding
    /// the table in list order when it grows.
    fn reserve_one(&mut self) {
        let Some(n) = grown_slots(self.slots.len(), self.len + 1) else {
            return;
        };
        let old = std::mem::replace(&mut self.slots, vec![Entry::default(); n]);
        self.shift = 64 - n.trailing_zeros();
        let mut at = std::mem::replace(&mut self.head, NIL);
        self.tail = NIL;
        while at != NIL {
            let e = match at {
                ZERO => self.zero,
                i => old[i as usize],
            };
            let i = match at {
                ZERO => ZERO,
                _ => self.vacant(e.hash),
            };
            *self.at_mut(i) = Entry { next: NIL, ..e };
            self.push_tail(i);
            at = e.next;
        }
    }

    /// Drops the entry at `i`: out of the list, and its slot emptied by shifting
    /// back every later entry of the cluster whose home is not in (hole, j], each
    /// moved entry's neighbours repointed at its new slot.
    fn remove_at(&mut self, i: u32) {
        self.unlink(i);
        self.len -= 1;
        if i == ZERO {
            self.zero_held = false;
            return;
        }
        let wrap = self.wrap();
        let mut hole = i as usize;
        let mut j = hole;
        loop {
            j = (j + 1) & wrap;
            let h = self.slots[j].hash;
            if h == 0 {
                break;
            }
            let home = self.home(h);
            if (j.wrapping_sub(home) & wrap) >= (j.wrapping_sub(hole) & wrap) {
                self.slots[hole] = self.slots[j];
                self.relink(hole as u32);
                hole = j;
            }
        }
        self.slots[hole] = Entry::default();
    }

    /// Points the list neighbours of the entry at `i` (just moved there) at it.
    fn relink(&mut self, i: u32) {
        let Entry { prev, next, .. } = *self.at(i);
        self.link_around(prev, next, i, i);
    }

    fn unlink(&mut self, i: u32) {
        let Entry { prev, next, .. } = *self.at(i);
        self.link_around(prev, next, next, prev);
    }

    /// Sets the next link of `prev` (the head when `NIL`) to `after_prev` and the
    /// previous link of `next` (the tail when `NIL`) to `before_next`.
    fn link_around(&mut self, prev: u32, next: u32, after_prev: u32, before_next: u32) {
        match prev {
            NIL => self.head = after_prev,
            p => self.at_mut(p).next = after_prev,
        }
        match next {
            NIL => self.tail = before_next,
            n => self.at_mut(n).prev = before_next,
        }
    }

    fn push_tail(&mut self, i: u32) {
        let tail = self.tail;
        let e = self.at_mut(i);
        e.prev = tail;
        e.next = NIL;
        match tail {
            NIL => self.head = i,
            t => self.at_mut(t).next = i,
        }
        self.tail = i;
    }
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;

    use proptest::prelude::*;

    use super::*;

    const HASHES: u64 = 40;

    #[derive(Debug, Clone)]
    enum Op {
        Touch(u64, u32),
        Remove(u64),
        PopOldest,
    }

    fn op() -> impl Strategy<Value = Op> {
        // Few distinct hashes (0 included) so that touches meet, enough that the
        // table grows twice and probe clusters form (removals shift entries).
        let h = 0u64..HASHES;
        prop_oneof![
            4 => (h.clone(), any::<u32>()).prop_map(|(h, s)| Op::Touch(h, s)),
            1 => h.prop_map(Op::Remove),
            1 => Just(Op::PopOldest),
        ]
    }

    proptest! {
        /// Against a naive list (oldest first): same order, stamps and answers.
        #[test]
        fn lru_agrees_with_a_naive_list(ops in prop::collection::vec(op(), 1..200)) {
            let mut lru = Lru::default();
            let mut naive: VecDeque<(u64, u32)> = VecDeque::new();
            for op in ops {
                match op {
                    Op::Touch(h, s) => {
                        let held = naive.iter().position(|(x, _)| *x == h);
                        if let Some(p) = held {
                            naive.remove(p);
                        }
                        naive.push_back((h, s));
                        prop_assert_eq!(lru.touch(h, s), held.is_none());
                    }
                    Op::Remove(h) => {
                        let held = naive.iter().position(|(x, _)| *x == h);
                        if let Some(p) = held {
                            naive.remove(p);
                        }
                        prop_assert_eq!(lru.remove(h), held.is_some());
                    }
                    Op::PopOldest => {
                        prop_assert_eq!(lru.pop_oldest(), naive.pop_front().map(|(h, _)| h));
                    }
                }
                prop_assert_eq!(lru.len(), naive.len());
                prop_assert_eq!(lru.oldest(), naive.front().copied());
                let keys: Vec<u64> = lru.keys().collect();
                let want: Vec<u64> = naive.iter().map(|(h, _)| *h).collect();
                prop_assert_eq!(keys, want);
                for h in 0..HASHES {
                    let stamp = naive.iter().find(|(x, _)| *x == h).map(|(_, s)| *s);
                    prop_assert_eq!(lru.stamp(h), stamp);
                    prop_assert_eq!(lru.contains(h), stamp.is_some());
                }
                let all: Vec<u64> = (0..HASHES).collect();
                let absent: Vec<u64> = lru.prefetch(&all).copied().collect();
                let want: Vec<u64> = all.iter().copied().filter(|h| !lru.contains(*h)).collect();
                prop_assert_eq!(absent, want);
            }
        }
    }

    #[test]
    fn churn_keeps_the_table_size() {
        let mut lru = Lru::default();
        for round in 0..100u32 {
            for h in 1..=50u64 {
                lru.touch(h + u64::from(round) * 50, round);
            }
            while lru.len() > 50 {
                lru.pop_oldest();
            }
        }
        // At most 100 entries at once: 256 slots keep them ≤ 3/4 full.
        assert_eq!(lru.slots.len(), 256);
        assert_eq!(lru.keys().count(), 50);
    }
}
