//! Sets of worker slots (dense `u32` numbers the index gives each (worker, rank)):
//! a sorted list while small, a bitset once the bitset is no bigger than the list.
//!
//! The prefix index keeps one set per run of blocks and intersects a shrinking
//! active set with it at each run boundary, so a lookup costs per run, not per
//! holder of each block.

use smallvec::{smallvec, SmallVec};

/// A set of slots.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum SlotSet {
    /// Sorted, distinct; up to four slots inline (most runs have one holder, and
    /// a lookup copies its first run's set), more on the heap.
    Few(SmallVec<[u32; 4]>),
    /// One bit per slot; `len` bits set.
    Many { words: Vec<u64>, len: u32 },
}

/// Lists at least this long may turn into a bitset.
const MIN_BITSET: usize = 64;

impl Default for SlotSet {
    fn default() -> Self {
        SlotSet::Few(SmallVec::new())
    }
}

impl SlotSet {
    /// The set holding only `slot`.
    pub(crate) fn one(slot: u32) -> Self {
        SlotSet::Few(smallvec![slot])
    }

    pub(crate) fn len(&self) -> usize {
        match self {
            SlotSet::Few(v) => v.len(),
            SlotSet::Many { len, .. } => *len as usize,
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub(crate) fn contains(&self, slot: u32) -> bool {
        match self {
            SlotSet::Few(v) => v.binary_search(&slot).is_ok(),
            SlotSet::Many { words, .. } => words
                .get(slot as usize / 64)
                .is_some_and(|w| w & (1 << (slot % 64)) != 0),
        }
    }

    /// Whether the set is exactly `{slot}`.
    pub(crate) fn is_only(&self, slot: u32) -> bool {
        matches!(self, SlotSet::Few(v) if v.as_slice() == [slot])
    }

    /// Adds `slot`; false if it was there.
    pub(crate) fn insert(&mut self, slot: u32) -> bool {
        let added = match self {
            SlotSet::Few(v) => match v.binary_search(&slot) {
                Ok(_) => false,
                Err(i) => {
                    v.insert(i, slot);
                    true
                }
            },
            SlotSet::Many { words, len } => {
                let i = slot as usize / 64;
                if words.len() <= i {
                    words.resize(i + 1, 0);
                }
                let bit = 1 << (slot % 64);
                let added = words[i] & bit == 0;
                words[i] |= bit;
                *len += u32::from(added);
                added
            }
        };
        self.reshape();
        added
    }

    /// Removes `slot`; false if it was not there.
    pub(crate) fn remove(&mut self, slot: u32) -> bool {
        let removed = match self {
            SlotSet::Few(v) => match v.binary_search(&slot) {
                Ok(i) => {
                    v.remove(i);
                    true
                }
                Err(_) => false,
            },
            SlotSet::Many { words, len } => {
                let i = slot as usize / 64;
                let bit = 1 << (slot % 64);
                let removed = words.get(i).is_some_and(|w| w & bit != 0);
                if removed {
                    words[i] &= !bit;
                    *len -= 1;
                }
                removed
            }
        };
        self.reshape();
        removed
    }

    /// Picks the smaller representation.
    fn reshape(&mut self) {
        match self {
            SlotSet::Few(v) if v.len() >= MIN_BITSET => {
                let words_needed = *v.last().expect("non-empty") as usize / 64 + 1;
                // A bitset of `words_needed` u64 against a list of `len` u32.
                if words_needed * 2 <= v.len() {
                    let mut words = vec![0u64; words_needed];
                    for s in v.iter() {
                        words[*s as usize / 64] |= 1 << (s % 64);
                    }
                    *self = SlotSet::Many {
                        words,
                        len: v.len() as u32,
                    };
                }
            }
            SlotSet::Many { words, len }
                if (*len as usize) < MIN_BITSET / 2 || words.len() > *len as usize =>
            {
                *self = SlotSet::Few(iter_bits(words).collect());
            }
            _ => {}
        }
    }

    /// The slots, ascending.
    #[cfg(test)]
    pub(crate) fn iter(&self) -> Box<dyn Iterator<Item = u32> + '_> {
        match self {
            SlotSet::Few(v) => Box::new(v.iter().copied()),
            SlotSet::Many { words, .. } => Box::new(iter_bits(words)),
        }
    }

    /// The slots of this set that `other` holds too, or `None` when that is all
    /// of them (then nothing is allocated).
    pub(crate) fn narrowed_by(&self, other: &SlotSet) -> Option<SlotSet> {
        let all = match (self, other) {
            (SlotSet::Few(a), _) => a.iter().all(|s| other.contains(*s)),
            (SlotSet::Many { words: a, .. }, SlotSet::Many { words: b, .. }) => a
                .iter()
                .enumerate()
                .all(|(i, x)| x & !b.get(i).copied().unwrap_or(0) == 0),
            (SlotSet::Many { len, .. }, SlotSet::Few(b)) => {
                b.iter().filter(|s| self.contains(**s)).count() == *len as usize
            }
        };
        (!all).then(|| self.intersection(other))
    }

    /// The slots in both sets.
    pub(crate) fn intersection(&self, other: &SlotSet) -> SlotSet {
        match (self, other) {
            (SlotSet::Few(a), _) => {
                SlotSet::Few(a.iter().copied().filter(|s| other.contains(*s)).collect())
            }
            (SlotSet::Many { .. }, SlotSet::Few(b)) => {
                SlotSet::Few(b.iter().copied().filter(|s| self.contains(*s)).collect())
            }
            (SlotSet::Many { words: a, .. }, SlotSet::Many { words: b, .. }) => {
                let words: Vec<u64> = a.iter().zip(b).map(|(x, y)| x & y).collect();
                let len = words.iter().map(|w| w.count_ones()).sum();
                let mut set = SlotSet::Many { words, len };
                set.reshape();
                set
            }
        }
    }
}

fn iter_bits(words: &[u64]) -> impl Iterator<Item = u32> + '_ {
    words.iter().enumerate().flat_map(|(i, w)| {
        let mut bits = *w;
        std::iter::from_fn(move || {
            (bits != 0).then(|| {
                let b = bits.trailing_zeros();
                bits &= bits - 1;
                (i * 64) as u32 + b
            })
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeSet;

    proptest! {
        #[test]
        fn slot_set_agrees_with_btreeset(
            ops in prop::collection::vec((any::<bool>(), 0u32..300), 0..400),
            other in prop::collection::btree_set(0u32..300, 0..200),
        ) {
            let mut set = SlotSet::default();
            let mut model = BTreeSet::new();
            for (add, s) in ops {
                if add {
                    prop_assert_eq!(set.insert(s), model.insert(s));
                } else {
                    prop_assert_eq!(set.remove(s), model.remove(&s));
                }
                prop_assert_eq!(set.len(), model.len());
            }
            prop_assert_eq!(set.iter().collect::<Vec<_>>(), model.iter().copied().collect::<Vec<_>>());
            let mut o = SlotSet::default();
            for s in &other {
                o.insert(*s);
            }
            let kept: BTreeSet<u32> = model.intersection(&other).copied().collect();
            prop_assert_eq!(set.narrowed_by(&o).is_none(), model.is_subset(&other));
            prop_assert_eq!(o.narrowed_by(&set).is_none(), other.is_subset(&model));
            // A subset of the set, in whichever shape it takes.
            let sub = set.intersection(&o);
            prop_assert!(sub.narrowed_by(&set).is_none());
            prop_assert_eq!(set.narrowed_by(&sub).is_none(), sub.len() == set.len());
            for both in [
                set.intersection(&o),
                o.intersection(&set),
                set.narrowed_by(&o).unwrap_or_else(|| set.clone()),
                o.narrowed_by(&set).unwrap_or_else(|| o.clone()),
            ] {
                prop_assert_eq!(both.len(), kept.len());
                prop_assert_eq!(both.iter().collect::<BTreeSet<_>>(), kept.clone());
            }
        }
    }
}
