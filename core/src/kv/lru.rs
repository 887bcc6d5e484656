//! [`Lru`]: a worker's approximate index entries in touch order.
//!
//! Each entry is a node of a doubly linked list threaded through one vector,
//! least recently touched at the head; a [`BlockTable`] finds a block's node. A
//! touch moves the node to the tail in place, so the list holds exactly one node
//! per block: nothing stale to skip or compact, and eviction takes the head.
//! Touching a prompt's blocks in chain order costs one table probe and one node
//! per block (the neighbours a move relinks are the nodes just moved or touched
//! next).

use crate::kv::table::BlockTable;

/// No node.
const NIL: u32 = u32::MAX;

#[derive(Debug, Clone, Copy)]
struct Node {
    hash: u64,
    prev: u32,
    /// The next node in touch order, or in the free list for an unused node.
    next: u32,
    stamp: u32,
}

/// Block hashes in touch order with the stamp of their last touch; see the module doc.
#[derive(Debug)]
pub struct Lru {
    nodes: BlockTable<u32>,
    list: Vec<Node>,
    head: u32,
    tail: u32,
    /// Unused nodes of `list`, linked through `next`.
    free: u32,
}

impl Default for Lru {
    fn default() -> Self {
        Lru {
            nodes: BlockTable::new(),
            list: Vec::new(),
            head: NIL,
            tail: NIL,
            free: NIL,
        }
    }
}

impl Lru {
    /// Entries held.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// Whether `hash` is held.
    pub fn contains(&self, hash: u64) -> bool {
        self.nodes.get(hash).is_some()
    }

    /// The stamp of `hash`'s last touch, if held.
    pub fn stamp(&self, hash: u64) -> Option<u32> {
        self.nodes.get(hash).map(|i| self.list[i as usize].stamp)
    }

    /// Makes `hash` the most recently touched entry, with `stamp`; whether it is new.
    pub fn touch(&mut self, hash: u64, stamp: u32) -> bool {
        if let Some(i) = self.nodes.get(hash) {
            self.unlink(i);
            self.list[i as usize].stamp = stamp;
            self.push_tail(i);
            return false;
        }
        let node = Node {
            hash,
            prev: NIL,
            next: NIL,
            stamp,
        };
        let i = match self.free {
            NIL => {
                self.list.push(node);
                (self.list.len() - 1) as u32
            }
            i => {
                self.free = self.list[i as usize].next;
                self.list[i as usize] = node;
                i
            }
        };
        self.nodes.insert(hash, i);
        self.push_tail(i);
        true
    }

    /// Drops `hash`; whether it was held.
    pub fn remove(&mut self, hash: u64) -> bool {
        let Some(i) = self.nodes.remove(hash) else {
            return false;
        };
        self.release(i);
        true
    }

    /// The least recently touched entry and its stamp.
    pub fn oldest(&self) -> Option<(u64, u32)> {
        let n = self.list.get(self.head as usize)?;
        Some((n.hash, n.stamp))
    }

    /// Drops the least recently touched entry; returns its hash.
    pub fn pop_oldest(&mut self) -> Option<u64> {
        let (hash, _) = self.oldest()?;
        self.nodes.remove(hash);
        self.release(self.head);
        Some(hash)
    }

    /// The hashes held, least recently touched first.
    pub fn keys(&self) -> impl Iterator<Item = u64> + '_ {
        let mut at = self.head;
        std::iter::from_fn(move || {
            let n = self.list.get(at as usize)?;
            at = n.next;
            Some(n.hash)
        })
    }

    /// Loads what touching `hashes` will read (their table slots and nodes), so
    /// that the cache misses overlap instead of queueing one behind the other.
    /// Returns the hashes not held (those a touch adds), lazily: the loads happen
    /// as the result is read, so read it to its end.
    #[must_use = "the loads happen as the result is read"]
    pub fn prefetch<'a>(
        &'a self,
        hashes: impl IntoIterator<Item = &'a u64> + 'a,
    ) -> impl Iterator<Item = &'a u64> + 'a {
        hashes
            .into_iter()
            .filter(move |&&h| match self.nodes.get(h) {
                Some(i) => {
                    std::hint::black_box(self.list[i as usize].stamp);
                    false
                }
                None => true,
            })
    }

    /// Heap bytes held.
    pub fn heap_bytes(&self) -> usize {
        self.nodes.heap_bytes() + self.list.capacity() * std::mem::size_of::<Node>()
    }

    fn unlink(&mut self, i: u32) {
        let Node { prev, next, .. } = self.list[i as usize];
        match prev {
            NIL => self.head = next,
            p => self.list[p as usize].next = next,
        }
        match next {
            NIL => self.tail = prev,
            n => self.list[n as usize].prev = prev,
        }
    }

    fn push_tail(&mut self, i: u32) {
        let tail = self.tail;
        let n = &mut self.list[i as usize];
        n.prev = tail;
        n.next = NIL;
        match tail {
            NIL => self.head = i,
            t => self.list[t as usize].next = i,
        }
        self.tail = i;
    }

    /// Unlinks node `i` (already out of the table) and puts it on the free list.
    fn release(&mut self, i: u32) {
        self.unlink(i);
        self.list[i as usize].next = self.free;
        self.free = i;
    }
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;

    use proptest::prelude::*;

    use super::*;

    #[derive(Debug, Clone)]
    enum Op {
        Touch(u64, u32),
        Remove(u64),
        PopOldest,
    }

    fn op() -> impl Strategy<Value = Op> {
        // Few distinct hashes (0 included) so that touches meet.
        let h = 0u64..10;
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
                for h in 0..10 {
                    let stamp = naive.iter().find(|(x, _)| *x == h).map(|(_, s)| *s);
                    prop_assert_eq!(lru.stamp(h), stamp);
                    prop_assert_eq!(lru.contains(h), stamp.is_some());
                }
                let all: Vec<u64> = (0..10).collect();
                let absent: Vec<u64> = lru.prefetch(&all).copied().collect();
                let want: Vec<u64> = all.iter().copied().filter(|h| !lru.contains(*h)).collect();
                prop_assert_eq!(absent, want);
            }
        }
    }

    #[test]
    fn freed_nodes_are_reused() {
        let mut lru = Lru::default();
        for round in 0..100u32 {
            for h in 1..=50u64 {
                lru.touch(h + u64::from(round) * 50, round);
            }
            while lru.len() > 50 {
                lru.pop_oldest();
            }
        }
        assert_eq!(lru.list.len(), 100);
        assert_eq!(lru.keys().count(), 50);
    }
}
