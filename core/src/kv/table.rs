//! [`BlockTable`]: the index's hash tables from a block hash to a small value.
//!
//! Open addressing with linear probing over one array of (key, value) slots. A
//! key's home slot is a multiply-shift of the key under a per-table random
//! multiplier and mask, so a client that can choose block hashes cannot choose
//! where they land (and pile them into one probe sequence). Removal shifts the
//! entries after the hole back (no tombstones), so probes stay short under
//! churn. Key 0 marks an empty slot; the key 0 itself is kept aside.
//!
//! Beside the slots, one **tag** byte per slot (0: empty, else seven more bits
//! of the key's hash) lets a probe test eight slots at once and read a slot
//! only where its tag matches. A key that is absent (every new block of a
//! store) is then settled from the tags alone: 1/16 of the slots' bytes, so
//! in cache where the slots of a table of millions of blocks are not.
//!
//! Writes of a batch first [`BlockTable::prefetch`] the slots and tags they will
//! need (only the tags, [`BlockTable::prefetch_tags`], for keys likely new): the
//! cache misses of a batch then overlap instead of queueing one behind the other.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};

/// One slot: `key == 0` is empty.
#[derive(Debug, Clone, Copy, Default)]
struct Slot<V> {
    key: u64,
    value: V,
}

/// A hash table from `u64` block hashes to `V`; see the module doc.
#[derive(Debug, Clone)]
pub struct BlockTable<V> {
    slots: Vec<Slot<V>>,
    /// One tag per slot, then the first [`GROUP`] tags again (so that a group
    /// read never wraps around).
    tags: Vec<u8>,
    /// `64 - log2(slots.len())`.
    shift: u32,
    len: usize,
    /// The value of key 0, which cannot live in a slot.
    zero: Option<V>,
    mul: u64,
    mask: u64,
}

impl<V: Copy + Default> Default for BlockTable<V> {
    fn default() -> Self {
        Self::new()
    }
}

/// Where a key is or would go in a [`BlockTable`] (valid until the next insert
/// or removal other than [`BlockTable::claim`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Place(usize);

impl Place {
    /// The place of key 0, which lives beside the slots.
    const ZERO: Place = Place(usize::MAX);
    /// A key's place in a table with no slots yet.
    const NONE: Place = Place(usize::MAX - 1);
}

/// Slots of the first allocation (at least [`GROUP`]).
const MIN_SLOTS: usize = 16;

/// Tags tested at once (one `u64`).
const GROUP: usize = 8;

/// The lowest bit of each byte of a group.
const LSB: u64 = 0x0101_0101_0101_0101;

/// The highest bit of each byte of a group: set in every tag but an empty slot's.
const MSB: u64 = 0x8080_8080_8080_8080;

impl<V: Copy + Default> BlockTable<V> {
    /// An empty table (allocates on first insert).
    pub fn new() -> Self {
        let mut h = RandomState::new().build_hasher();
        h.write_u64(0x6b76_7069_636b);
        let a = h.finish();
        h.write_u64(a);
        let b = h.finish();
        BlockTable {
            slots: Vec::new(),
            tags: Vec::new(),
            shift: 64,
            len: 0,
            zero: None,
            mul: a | 1,
            mask: b,
        }
    }

    /// Entries in the table.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Heap bytes held.
    pub fn heap_bytes(&self) -> usize {
        self.slots.capacity() * std::mem::size_of::<Slot<V>>() + self.tags.capacity()
    }

    /// The home slot of `key` and its tag (the seven bits of its hash below the
    /// home's, with the high bit set). The table has slots.
    fn hashed(&self, key: u64) -> (usize, u8) {
        let h = (key ^ self.mask).wrapping_mul(self.mul);
        (
            (h >> self.shift) as usize,
            0x80 | (h >> (self.shift - 7)) as u8,
        )
    }

    fn home(&self, key: u64) -> usize {
        self.hashed(key).0
    }

    fn next(&self, i: usize) -> usize {
        (i + 1) & (self.slots.len() - 1)
    }

    /// The tags of slots `i..i + GROUP` (wrapping around), the first in the low byte.
    fn group(&self, i: usize) -> u64 {
        let mut bytes = [0u8; GROUP];
        bytes.copy_from_slice(&self.tags[i..i + GROUP]);
        u64::from_le_bytes(bytes)
    }

    fn set_tag(&mut self, i: usize, tag: u8) {
        self.tags[i] = tag;
        if i < GROUP {
            let n = self.slots.len();
            self.tags[n + i] = tag;
        }
    }

    /// The slot holding `key` (not 0; the table has slots), else the first
    /// empty slot of its probe sequence, where it would go.
    #[inline]
    fn search(&self, key: u64) -> Result<usize, usize> {
        let (mut i, tag) = self.hashed(key);
        let wanted = LSB * u64::from(tag);
        let last = self.slots.len() - 1;
        loop {
            let g = self.group(i);
            let empty = !g & MSB;
            let mut hits = hits(g, wanted);
            if empty != 0 {
                // The probe sequence ends at the first empty slot.
                hits &= empty ^ (empty - 1);
            }
            while hits != 0 {
                let j = (i + hits.trailing_zeros() as usize / 8) & last;
                if self.slots[j].key == key {
                    return Ok(j);
                }
                hits &= hits - 1;
            }
            if empty != 0 {
                return Err((i + empty.trailing_zeros() as usize / 8) & last);
            }
            i = (i + GROUP) & last;
        }
    }

    /// The slot holding `key` (not 0), if any.
    fn find(&self, key: u64) -> Option<usize> {
        if self.slots.is_empty() {
            return None;
        }
        self.search(key).ok()
    }

    /// The value of `key`.
    pub fn get(&self, key: u64) -> Option<V> {
        if key == 0 {
            return self.zero;
        }
        self.find(key).map(|i| self.slots[i].value)
    }

    /// [`BlockTable::get`] of a key likely present: walks the slots from the
    /// key's home without the tags. A present key sits at most a few slots past
    /// its home, mostly in the home's cache line, so this reads one line where
    /// the tags would add a second.
    pub fn get_likely_present(&self, key: u64) -> Option<V> {
        if key == 0 || self.slots.is_empty() {
            return self.get(key);
        }
        let mut i = self.home(key);
        loop {
            let slot = &self.slots[i];
            if slot.key == key {
                return Some(slot.value);
            }
            if slot.key == 0 {
                return None;
            }
            i = self.next(i);
        }
    }

    /// Makes room for `additional` more entries without growing in between.
    #[inline]
    pub fn reserve(&mut self, additional: usize) {
        let need = self.len + additional;
        // At most 3/4 full.
        if need * 4 > self.slots.len() * 3 {
            self.grow(need);
        }
    }

    /// Rehashes into the smallest power-of-two array holding `need` entries at
    /// most 3/4 full.
    #[cold]
    #[inline(never)]
    fn grow(&mut self, need: usize) {
        let mut n = self.slots.len().max(MIN_SLOTS);
        while need * 4 > n * 3 {
            n *= 2;
        }
        let old = std::mem::replace(&mut self.slots, vec![Slot::default(); n]);
        self.tags = vec![0; n + GROUP];
        self.shift = 64 - n.trailing_zeros();
        for s in old.into_iter().filter(|s| s.key != 0) {
            let (mut i, tag) = self.hashed(s.key);
            while self.tags[i] != 0 {
                i = self.next(i);
            }
            self.slots[i] = s;
            self.set_tag(i, tag);
        }
    }

    /// Writes `key` with `value` into the empty slot `i`.
    fn fill(&mut self, i: usize, key: u64, value: V) {
        self.slots[i] = Slot { key, value };
        let tag = self.hashed(key).1;
        self.set_tag(i, tag);
        self.len += 1;
    }

    /// Sets `key` to `value`; returns the value it replaced.
    pub fn insert(&mut self, key: u64, value: V) -> Option<V> {
        if key == 0 {
            let old = self.zero.replace(value);
            self.len += usize::from(old.is_none());
            return old;
        }
        self.reserve(1);
        match self.search(key) {
            Ok(i) => Some(std::mem::replace(&mut self.slots[i].value, value)),
            Err(i) => {
                self.fill(i, key, value);
                None
            }
        }
    }

    /// Adds `key` with `value` unless it is there; returns whether it was added.
    pub fn insert_new(&mut self, key: u64, value: V) -> bool {
        if key == 0 {
            if self.zero.is_some() {
                return false;
            }
            self.zero = Some(value);
            self.len += 1;
            return true;
        }
        self.reserve(1);
        match self.search(key) {
            Ok(_) => false,
            Err(i) => {
                self.fill(i, key, value);
                true
            }
        }
    }

    /// Where `key` is (with its value), else where it would go: a [`Place`] for
    /// [`BlockTable::claim`] and [`BlockTable::set`], so that a key first looked
    /// up and later given its value is probed once.
    pub fn place(&self, key: u64) -> Result<(Place, V), Place> {
        if key == 0 {
            return self.zero.map(|v| (Place::ZERO, v)).ok_or(Place::ZERO);
        }
        if self.slots.is_empty() {
            return Err(Place::NONE);
        }
        match self.search(key) {
            Ok(i) => Ok((Place(i), self.slots[i].value)),
            Err(i) => Err(Place(i)),
        }
    }

    /// Adds `key` with the default value at `place`, where [`BlockTable::place`]
    /// last found it missing (no write since but other claims, and room
    /// [`BlockTable::reserve`]d for every claim); returns where it now is.
    #[inline]
    pub fn claim(&mut self, place: Place, key: u64) -> Place {
        if key == 0 {
            debug_assert!(place == Place::ZERO && self.zero.is_none());
            self.zero = Some(V::default());
            self.len += 1;
            return Place::ZERO;
        }
        if place == Place::NONE {
            // The table had no array: make one and probe again.
            self.reserve(1);
            return match self.place(key) {
                Err(p) => self.claim(p, key),
                Ok((p, _)) => p,
            };
        }
        debug_assert!(self.slots[place.0].key == 0 && (self.len + 1) * 4 <= self.slots.len() * 3);
        self.fill(place.0, key, V::default());
        place
    }

    /// Sets the value at `place` (a key's place from [`BlockTable::place`] or
    /// [`BlockTable::claim`], with no insert or removal since).
    pub fn set(&mut self, place: Place, value: V) {
        match place {
            Place::ZERO => self.zero = Some(value),
            Place(i) => self.slots[i].value = value,
        }
    }

    /// Removes `key`; returns its value.
    pub fn remove(&mut self, key: u64) -> Option<V> {
        if key == 0 {
            let old = self.zero.take();
            if old.is_some() {
                self.len -= 1;
            }
            return old;
        }
        let mut hole = self.find(key)?;
        let value = self.slots[hole].value;
        self.len -= 1;
        // Shift back every later entry of the cluster whose home is not in
        // (hole, j]: it may then sit in the hole and stay reachable.
        let mask = self.slots.len() - 1;
        let mut j = hole;
        loop {
            j = self.next(j);
            let k = self.slots[j].key;
            if k == 0 {
                break;
            }
            let home = self.home(k);
            if (j.wrapping_sub(home) & mask) >= (j.wrapping_sub(hole) & mask) {
                self.slots[hole] = self.slots[j];
                let tag = self.tags[j];
                self.set_tag(hole, tag);
                hole = j;
            }
        }
        self.slots[hole] = Slot::default();
        self.set_tag(hole, 0);
        Some(value)
    }

    /// Loads the home slots of `keys` and their tags, so that the writes that
    /// follow find them in cache: the misses overlap instead of queueing. For
    /// keys likely present, or whose slots will be written.
    pub fn prefetch<'a>(&self, keys: impl IntoIterator<Item = &'a u64>) {
        if self.slots.is_empty() {
            return;
        }
        let mut acc = 0u64;
        for &k in keys {
            let i = self.home(k);
            acc ^= self.slots[i].key ^ u64::from(self.tags[i]);
        }
        std::hint::black_box(acc);
    }

    /// [`BlockTable::prefetch`] of the tags alone, for keys likely absent and
    /// only looked up (a chained store's new blocks): their tags settle them
    /// without reading a slot.
    pub fn prefetch_tags<'a>(&self, keys: impl IntoIterator<Item = &'a u64>) {
        if self.slots.is_empty() {
            return;
        }
        let mut acc = 0u8;
        for &k in keys {
            acc ^= self.tags[self.home(k)];
        }
        std::hint::black_box(acc);
    }

    /// The values, in no particular order.
    pub fn values(&self) -> impl Iterator<Item = V> + '_ {
        self.zero
            .into_iter()
            .chain(self.slots.iter().filter(|s| s.key != 0).map(|s| s.value))
    }
}

/// The high bit of each byte of group `g` equal to the tag repeated in
/// `wanted` (and a few more, where a borrow crosses a byte: every hit is
/// checked against its slot's key).
fn hits(g: u64, wanted: u64) -> u64 {
    let x = g ^ wanted;
    x.wrapping_sub(LSB) & !x & MSB
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use proptest::prelude::*;

    use super::*;

    #[derive(Debug, Clone)]
    enum Op {
        Insert(u64, u32),
        InsertNew(u64, u32),
        Remove(u64),
        Get(u64),
        /// A batch looked up and claimed place by place, then given values.
        Claim(Vec<(u64, u32)>),
    }

    /// Keys from a small range (so operations meet) plus 0 and colliding ones.
    fn key() -> impl Strategy<Value = u64> {
        prop_oneof![0u64..64, Just(0), Just(u64::MAX), any::<u64>()]
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (key(), any::<u32>()).prop_map(|(k, v)| Op::Insert(k, v)),
            (key(), any::<u32>()).prop_map(|(k, v)| Op::InsertNew(k, v)),
            key().prop_map(Op::Remove),
            key().prop_map(Op::Get),
            proptest::collection::vec((key(), any::<u32>()), 0..80).prop_map(Op::Claim),
        ]
    }

    /// Applies `ops` to `t` and to a `HashMap`, checking that they agree.
    fn agrees_with_hash_map(mut t: BlockTable<u32>, ops: Vec<Op>) -> Result<(), TestCaseError> {
        let mut m = HashMap::new();
        for op in ops {
            match op {
                Op::Insert(k, v) => prop_assert_eq!(t.insert(k, v), m.insert(k, v)),
                Op::InsertNew(k, v) => {
                    let added = !m.contains_key(&k);
                    if added {
                        m.insert(k, v);
                    }
                    prop_assert_eq!(t.insert_new(k, v), added);
                }
                Op::Remove(k) => prop_assert_eq!(t.remove(k), m.remove(&k)),
                Op::Get(k) => {
                    prop_assert_eq!(t.get(k), m.get(&k).copied());
                    prop_assert_eq!(t.get_likely_present(k), m.get(&k).copied());
                }
                Op::Claim(batch) => {
                    t.reserve(batch.len());
                    let mut places = Vec::new();
                    for &(k, v) in &batch {
                        let place = match t.place(k) {
                            Ok((place, old)) => {
                                prop_assert_eq!(Some(old), m.get(&k).copied());
                                place
                            }
                            Err(place) => {
                                prop_assert!(!m.contains_key(&k));
                                m.insert(k, 0);
                                t.claim(place, k)
                            }
                        };
                        places.push((place, k, v));
                    }
                    for (place, k, v) in places {
                        t.set(place, v);
                        m.insert(k, v);
                    }
                }
            }
            prop_assert_eq!(t.len(), m.len());
        }
        for (k, v) in &m {
            prop_assert_eq!(t.get(*k), Some(*v));
            prop_assert_eq!(t.get_likely_present(*k), Some(*v));
        }
        let mut values: Vec<u32> = t.values().collect();
        let mut expected: Vec<u32> = m.values().copied().collect();
        values.sort_unstable();
        expected.sort_unstable();
        prop_assert_eq!(values, expected);
        Ok(())
    }

    /// Keys whose hash under multiplier 1 and mask 0 (the key itself) puts them
    /// in few homes with few tags: long clusters, wrapping around the end of
    /// the slots, of keys whose tags match but not their keys.
    fn crowded_key() -> impl Strategy<Value = u64> {
        (0u64..4, 0u64..2, 1u64..6)
            .prop_map(|(home, tag, low)| (home.wrapping_sub(1) << 62) | (tag << 50) | low)
    }

    fn crowded_op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (crowded_key(), any::<u32>()).prop_map(|(k, v)| Op::Insert(k, v)),
            crowded_key().prop_map(Op::Remove),
            crowded_key().prop_map(Op::Get),
            proptest::collection::vec((crowded_key(), any::<u32>()), 0..12).prop_map(Op::Claim),
        ]
    }

    proptest! {
        #[test]
        fn table_agrees_with_hash_map(ops in proptest::collection::vec(op(), 1..400)) {
            agrees_with_hash_map(BlockTable::new(), ops)?;
        }

        #[test]
        fn table_agrees_with_hash_map_when_homes_and_tags_collide(
            ops in proptest::collection::vec(crowded_op(), 1..200),
        ) {
            let t = BlockTable { mul: 1, mask: 0, ..BlockTable::new() };
            agrees_with_hash_map(t, ops)?;
        }
    }

    #[test]
    fn removal_keeps_every_other_key_of_a_full_cluster_reachable() {
        let mut t = BlockTable::<u64>::new();
        for k in 1..=10_000u64 {
            t.insert(k, k * 2);
        }
        for k in (1..=10_000u64).step_by(3) {
            assert_eq!(t.remove(k), Some(k * 2));
        }
        for k in 1..=10_000u64 {
            let expected = (k % 3 != 1).then_some(k * 2);
            assert_eq!(t.get(k), expected, "key {k}");
        }
        assert_eq!(t.len(), 10_000 - 3_334);
    }

    #[test]
    fn two_tables_place_the_same_keys_differently() {
        // Placement depends on a per-table secret, not on the keys alone.
        let (a, b) = (BlockTable::<u8>::new(), BlockTable::<u8>::new());
        assert!(a.mul != b.mul || a.mask != b.mask);
    }
}
