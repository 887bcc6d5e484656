//! [`Lru`]: a worker's approximate index entries in the order of their last touch.
//!
//! Each entry is a node of a doubly linked list threaded through one vector,
//! ordered by its **key** (the time of its latest touch, ties by hash), oldest
//! at the head; a [`BlockTable`] finds a block's node. A touch with a newer key
//! moves the node in place (one with an older key changes nothing), so the list
//! holds exactly one node per block: nothing stale to skip or compact, and
//! eviction takes the head.
//!
//! Invariant: keys never decrease from head to tail. Because an entry's rank
//! depends only on the newest key it was touched with, lists that receive the
//! same touches in any order end in the same order (what replicas applying each
//! other's decisions late rely on). A touch newer than every entry (every local
//! one) goes to the tail after one comparison; an older one (a peer's, arriving
//! late) walks back from the tail to its place. Touching a prompt's blocks in
//! chain order through one [`Chain`] reads one node per block: a chain touched
//! in order before lies in that order, so the node after the last one touched
//! is the next block's, and the table is probed only where it is not (the
//! neighbours a move relinks are the nodes just moved or touched next).

use crate::kv::table::BlockTable;

/// No node.
const NIL: u32 = u32::MAX;

#[derive(Debug, Clone, Copy)]
struct Node {
    hash: u64,
    prev: u32,
    /// The next node in touch order, or in the free list for an unused node.
    next: u32,
    /// The latest touch's key.
    key: u64,
}

impl Node {
    /// Whether this node ranks after a touch of `hash` at `key`.
    fn after(&self, key: u64, hash: u64) -> bool {
        (self.key, self.hash) > (key, hash)
    }
}

/// Where a chain's next touch looks first: the node that followed the block
/// it touched last. Valid only while the [`Lru`] sees no other change (a
/// touch of another chain, a removal): start a new one after.
#[derive(Debug, Clone, Copy)]
pub struct Chain(u32);

impl Default for Chain {
    fn default() -> Self {
        Chain(NIL)
    }
}

/// Block hashes ordered by the key of their latest touch; see the module doc.
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

    /// The key of `hash`'s latest touch, if held.
    pub fn key(&self, hash: u64) -> Option<u64> {
        self.nodes.get(hash).map(|i| self.list[i as usize].key)
    }

    /// The newest entry's key.
    pub fn newest_key(&self) -> Option<u64> {
        self.list.get(self.tail as usize).map(|n| n.key)
    }

    /// Records a touch of `hash` at `key`: it ranks by its newest touch, so an
    /// older key than it holds changes nothing. Whether it is new.
    pub fn touch(&mut self, hash: u64, key: u64) -> bool {
        self.touch_chain(hash, key, &mut Chain::default())
    }

    /// [`Lru::touch`] of the block after the one `chain` touched last.
    pub fn touch_chain(&mut self, hash: u64, key: u64, chain: &mut Chain) -> bool {
        let guess = chain.0;
        if self
            .list
            .get(guess as usize)
            .is_some_and(|n| n.hash == hash)
        {
            // A live node's successor is live, and a hash has one node.
            chain.0 = self.list[guess as usize].next;
            self.renew(guess, key);
            return false;
        }
        // One probe finds the node, or where a new one's entry goes.
        self.nodes.reserve(1);
        let at = match self.nodes.place(hash) {
            Ok((_, i)) => {
                chain.0 = self.list[i as usize].next;
                self.renew(i, key);
                return false;
            }
            Err(at) => at,
        };
        chain.0 = NIL;
        let node = Node {
            hash,
            prev: NIL,
            next: NIL,
            key,
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
        let at = self.nodes.claim(at, hash);
        self.nodes.set(at, i);
        self.place(i);
        true
    }

    /// Moves node `i` to its rank for a touch at `key`, if newer than its own.
    fn renew(&mut self, i: u32, key: u64) {
        if self.list[i as usize].key < key {
            self.unlink(i);
            self.list[i as usize].key = key;
            self.place(i);
        }
    }

    /// Drops `hash`; whether it was held.
    pub fn remove(&mut self, hash: u64) -> bool {
        let Some(i) = self.nodes.remove(hash) else {
            return false;
        };
        self.release(i);
        true
    }

    /// The least recently touched entry and its key.
    pub fn oldest(&self) -> Option<(u64, u64)> {
        let n = self.list.get(self.head as usize)?;
        Some((n.hash, n.key))
    }

    /// Drops the least recently touched entry; returns its hash.
    #[inline]
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

    /// Loads what touching the chain `hashes` in order will read (their nodes,
    /// and table slots where the chain's order breaks), so that the cache
    /// misses overlap instead of queueing one behind the other. Returns the
    /// hashes not held (those a touch adds), lazily: the loads happen as the
    /// result is read, so read it to its end.
    #[must_use = "the loads happen as the result is read"]
    pub fn prefetch<'a>(
        &'a self,
        hashes: impl IntoIterator<Item = &'a u64> + 'a,
    ) -> impl Iterator<Item = &'a u64> + 'a {
        let mut guess = NIL;
        hashes.into_iter().filter(move |&&h| {
            let found = match self.list.get(guess as usize) {
                Some(n) if n.hash == h => Some(guess),
                _ => self.nodes.get(h),
            };
            guess = found.map_or(NIL, |i| std::hint::black_box(self.list[i as usize].next));
            found.is_none()
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

    /// Links unlinked node `i` after the last node that does not rank after it:
    /// at the tail at once for the newest touch (every local one).
    #[inline]
    fn place(&mut self, i: u32) {
        let Node { key, hash, .. } = self.list[i as usize];
        let tail = self.tail;
        if tail == NIL || !self.list[tail as usize].after(key, hash) {
            let n = &mut self.list[i as usize];
            n.prev = tail;
            n.next = NIL;
            match tail {
                NIL => self.head = i,
                t => self.list[t as usize].next = i,
            }
            self.tail = i;
            return;
        }
        let mut prev = self.list[tail as usize].prev;
        while prev != NIL && self.list[prev as usize].after(key, hash) {
            prev = self.list[prev as usize].prev;
        }
        let next = match prev {
            NIL => std::mem::replace(&mut self.head, i),
            p => std::mem::replace(&mut self.list[p as usize].next, i),
        };
        match next {
            NIL => self.tail = i,
            n => self.list[n as usize].prev = i,
        }
        let n = &mut self.list[i as usize];
        n.prev = prev;
        n.next = next;
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
        Touch(u64, u64),
        /// Touches through one [`Chain`].
        Chain(Vec<(u64, u64)>),
        Remove(u64),
        PopOldest,
    }

    fn op() -> impl Strategy<Value = Op> {
        // Few distinct hashes (0 included) so that touches meet.
        let h = 0u64..10;
        prop_oneof![
            // Few distinct keys too, so that ties are broken by hash.
            4 => (h.clone(), 0u64..8).prop_map(|(h, k)| Op::Touch(h, k)),
            2 => prop::collection::vec((h.clone(), 0u64..8), 1..8).prop_map(Op::Chain),
            1 => h.prop_map(Op::Remove),
            1 => Just(Op::PopOldest),
        ]
    }

    proptest! {
        /// Against a naive list sorted by (key, hash) of each entry's newest
        /// touch: same order, keys and answers.
        #[test]
        fn lru_agrees_with_a_naive_list(ops in prop::collection::vec(op(), 1..200)) {
            let mut lru = Lru::default();
            let mut naive: VecDeque<(u64, u64)> = VecDeque::new();
            let naive_touch = |naive: &mut VecDeque<(u64, u64)>, h: u64, k: u64| {
                let held = naive.iter().position(|(x, _)| *x == h);
                let key = match held {
                    Some(p) => naive.remove(p).unwrap().1.max(k),
                    None => k,
                };
                let at = naive.partition_point(|&(x, y)| (y, x) <= (key, h));
                naive.insert(at, (h, key));
                held.is_none()
            };
            for op in ops {
                match op {
                    Op::Touch(h, k) => {
                        let new = naive_touch(&mut naive, h, k);
                        prop_assert_eq!(lru.touch(h, k), new);
                    }
                    Op::Chain(touches) => {
                        let mut chain = Chain::default();
                        for (h, k) in touches {
                            let new = naive_touch(&mut naive, h, k);
                            prop_assert_eq!(lru.touch_chain(h, k, &mut chain), new);
                        }
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
                prop_assert_eq!(lru.newest_key(), naive.back().map(|(_, k)| *k));
                let keys: Vec<u64> = lru.keys().collect();
                let want: Vec<u64> = naive.iter().map(|(h, _)| *h).collect();
                prop_assert_eq!(keys, want);
                for h in 0..10 {
                    let key = naive.iter().find(|(x, _)| *x == h).map(|(_, k)| *k);
                    prop_assert_eq!(lru.key(h), key);
                    prop_assert_eq!(lru.contains(h), key.is_some());
                }
                let all: Vec<u64> = (0..10).collect();
                let absent: Vec<u64> = lru.prefetch(&all).copied().collect();
                let want: Vec<u64> = all.iter().copied().filter(|h| !lru.contains(*h)).collect();
                prop_assert_eq!(absent, want);
            }
        }
    }

    #[test]
    fn the_same_touches_in_any_order_give_the_same_order() {
        let touches = [(1, 5), (2, 3), (3, 5), (1, 2), (4, 9), (2, 7), (5, 1)];
        let mut first = Lru::default();
        let mut reversed = Lru::default();
        for &(h, k) in &touches {
            first.touch(h, k);
        }
        for &(h, k) in touches.iter().rev() {
            reversed.touch(h, k);
        }
        let order: Vec<u64> = first.keys().collect();
        assert_eq!(order, vec![5, 1, 3, 2, 4]);
        assert_eq!(order, reversed.keys().collect::<Vec<_>>());
    }

    #[test]
    fn freed_nodes_are_reused() {
        let mut lru = Lru::default();
        for round in 0..100u32 {
            for h in 1..=50u64 {
                lru.touch(h + u64::from(round) * 50, u64::from(round));
            }
            while lru.len() > 50 {
                lru.pop_oldest();
            }
        }
        assert_eq!(lru.list.len(), 100);
        assert_eq!(lru.keys().count(), 50);
    }
}
