//! The runs, lineages and block table behind the lock: slots, splits and
//! merges, the walk a lookup makes, and the writes of both modes.

use std::borrow::Cow;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use super::overlaps::Levels;
use super::state::{Inner, Lineage, Loc, Run, Worker};
use crate::keys::WorkerKey;
use crate::kv::slots::SlotSet;
use crate::kv::tier::{self, Tier};

impl Inner {
    /// The slot of `key`, allocating one if needed.
    pub(super) fn slot(&mut self, key: WorkerKey) -> u32 {
        if let Some(s) = self.names.slots.get(&key) {
            return *s;
        }
        let slot = match self.free_slots.pop() {
            Some(s) => s,
            None => {
                self.workers.push(Worker::default());
                (self.workers.len() - 1) as u32
            }
        };
        let lower = tier::tier_of(key) != Tier::Gpu;
        self.tier_slots += usize::from(lower);
        self.workers[slot as usize] = Worker {
            key: Some(key),
            oldest: u32::MAX,
            // A lower tier is fed by KV events alone.
            precise: lower,
            span: 1,
            ..Default::default()
        };
        let names = Arc::make_mut(&mut self.names);
        names.slots.insert(key, slot);
        let keys = &mut names.keys;
        if keys.len() <= slot as usize {
            keys.resize(slot as usize + 1, None);
        }
        keys[slot as usize] = Some(key);
        slot
    }

    /// Sets `slot`'s oldest approximate stamp, keeping `expiring` in step.
    pub(super) fn set_oldest(&mut self, slot: u32, oldest: u32) {
        let w = &mut self.workers[slot as usize];
        if w.oldest == oldest {
            return;
        }
        if w.oldest != u32::MAX {
            self.expiring.remove(&(w.oldest, slot));
        }
        if oldest != u32::MAX {
            self.expiring.insert((oldest, slot));
        }
        w.oldest = oldest;
    }

    /// After `slot`'s approximate entries or capacity changed: records its
    /// oldest stamp, none for a worker whose capacity is known (its entries do
    /// not expire).
    pub(super) fn settle_lru(&mut self, slot: u32) {
        let w = &self.workers[slot as usize];
        let oldest = match w.capacity {
            Some(_) => u32::MAX,
            None => w
                .recency
                .oldest()
                .map_or(u32::MAX, |(_, k)| self.clock.stamp_of(k)),
        };
        self.set_oldest(slot, oldest);
    }

    /// Loads what an approximate insert of `chunk` by `worker` will touch, under
    /// the read lock (the cache misses are then taken while lookups can still
    /// run, and the write lock is held for less): its LRU nodes, and the global
    /// slots of only the blocks its LRU does not hold yet (the insert adds
    /// holders for those alone; a repeated prompt's blocks are mostly held).
    pub(super) fn warm_insert(&self, worker: WorkerKey, chunk: &[u64]) {
        match self.names.slots.get(&worker) {
            Some(&slot) => {
                let absent = self.workers[slot as usize].recency.prefetch(chunk);
                self.blocks.prefetch(absent);
            }
            None => self.blocks.prefetch(chunk),
        }
    }

    /// The run covering `loc`.
    pub(super) fn run_at(&self, loc: Loc) -> Option<u32> {
        let run = match *self.only_run.get(loc.lineage as usize)? {
            u32::MAX => {
                let pieces = &self.lineages[loc.lineage as usize].pieces;
                let k = pieces.partition_point(|r| self.runs[*r as usize].start <= loc.pos);
                *pieces.get(k.checked_sub(1)?)?
            }
            run => run,
        };
        let r = &self.runs[run as usize];
        (r.start <= loc.pos && loc.pos < r.end()).then_some(run)
    }

    /// The block at `loc`.
    pub(super) fn hash_at(&self, loc: Loc) -> Option<u64> {
        let r = &self.runs[self.run_at(loc)? as usize];
        r.hashes.get((loc.pos - r.start) as usize).copied()
    }

    /// The run and location of block `hash`, if it has a table entry.
    pub(super) fn find(&self, hash: u64) -> Option<(u32, Loc)> {
        let loc = self.blocks.get(hash)?;
        Some((self.run_at(loc)?, loc))
    }

    /// [`Inner::find`] for a block a lookup expects to find.
    pub(super) fn find_likely(&self, hash: u64) -> Option<(u32, Loc)> {
        let loc = self.blocks.get_likely_present(hash)?;
        Some((self.run_at(loc)?, loc))
    }

    /// Gives block `hash` at `loc` a table entry.
    pub(super) fn index_block(&mut self, hash: u64, loc: Loc) {
        if let Some(run) = self.run_at(loc) {
            self.runs[run as usize].indexed = true;
            self.blocks.insert(hash, loc);
        }
    }

    /// Block `hash` if it sits right after `prev`.
    pub(super) fn successor(&self, prev: Loc, hash: u64) -> Option<(u32, Loc)> {
        let loc = Loc {
            lineage: prev.lineage,
            pos: prev.pos + 1,
        };
        let run = self.run_at(loc)?;
        let r = &self.runs[run as usize];
        (r.hashes[(loc.pos - r.start) as usize] == hash).then_some((run, loc))
    }

    /// Where block `hash` is: right after `prev` when given, else by its table entry.
    pub(super) fn locate(&self, prev: Option<Loc>, hash: u64) -> Option<(u32, Loc)> {
        prev.and_then(|p| self.successor(p, hash))
            .or_else(|| self.find(hash))
    }

    /// Drops one precise reference of `slot` to each block; a block loses the
    /// holder when its last reference goes and no approximate entry keeps it.
    pub(super) fn release_precise(
        &mut self,
        slot: u32,
        blocks: &[(u64, Loc)],
        entries: &AtomicUsize,
    ) {
        let mut gone = Vec::new();
        let w = &mut self.workers[slot as usize];
        for &(h, loc) in blocks {
            if let Some(n) = w.extra.get_mut(&h) {
                *n -= 1;
                if *n == 0 {
                    w.extra.remove(&h);
                }
                continue;
            }
            if !w.precise {
                w.precise_held.remove(&h);
                if w.recency.contains(h) {
                    // An approximate entry remains: the holder stays for it.
                    continue;
                }
            }
            gone.push((h, loc));
        }
        self.remove_holder_runs(&gone, slot, entries);
    }

    pub(super) fn new_lineage(&mut self) -> u32 {
        self.free_lineages.pop().unwrap_or_else(|| {
            self.lineages.push(Lineage { pieces: Vec::new() });
            self.only_run.push(u32::MAX);
            (self.lineages.len() - 1) as u32
        })
    }

    /// Stores `run` and lists it among its lineage's pieces.
    pub(super) fn new_run(&mut self, run: Run) -> u32 {
        let id = match self.free_runs.pop() {
            Some(r) => {
                self.runs[r as usize] = run;
                r
            }
            None => {
                self.runs.push(run);
                (self.runs.len() - 1) as u32
            }
        };
        let (k, l) = self.piece_of(id);
        self.lineages[l as usize].pieces.insert(k, id);
        self.settle_lineage(l);
        id
    }

    /// Where `run` goes (or is) among its lineage's pieces, and the lineage.
    pub(super) fn piece_of(&self, run: u32) -> (usize, u32) {
        let r = &self.runs[run as usize];
        let pieces = &self.lineages[r.lineage as usize].pieces;
        let k = pieces.partition_point(|p| self.runs[*p as usize].start < r.start);
        (k, r.lineage)
    }

    /// Takes `run` out of its lineage's pieces (freeing an emptied lineage).
    pub(super) fn unlist(&mut self, run: u32) {
        let (k, l) = self.piece_of(run);
        let pieces = &mut self.lineages[l as usize].pieces;
        debug_assert_eq!(pieces.get(k), Some(&run));
        pieces.remove(k);
        if pieces.is_empty() {
            pieces.shrink_to_fit();
            self.free_lineages.push(l);
        }
        self.settle_lineage(l);
    }

    /// Records in `only_run` whether lineage `l` has one run.
    pub(super) fn settle_lineage(&mut self, l: u32) {
        self.only_run[l as usize] = match self.lineages[l as usize].pieces.as_slice() {
            [run] => *run,
            _ => u32::MAX,
        };
    }

    /// Forgets `run` (no holder left) and its blocks' table entries.
    pub(super) fn free_run(&mut self, run: u32) {
        self.unlist(run);
        let r = std::mem::take(&mut self.runs[run as usize]);
        if r.indexed {
            self.blocks.prefetch(&r.hashes);
            for h in &r.hashes {
                self.blocks.remove(*h);
            }
        } else if let Some(h) = r.hashes.front() {
            self.blocks.remove(*h);
        }
        self.free_runs.push(run);
    }

    /// Splits `run` before absolute position `at` (strictly inside it), moving the
    /// shorter side to a new run; returns (left, right) run ids. Positions stay,
    /// so no table entry moves; the right side's first block gets one.
    pub(super) fn split(&mut self, run: u32, at: u32) -> (u32, u32) {
        let r = &mut self.runs[run as usize];
        let left_len = (at - r.start) as usize;
        let (holders, lineage, indexed) = (r.holders.clone(), r.lineage, r.indexed);
        let (left, right) = if left_len <= r.hashes.len() - left_len {
            let hashes: VecDeque<u64> = r.hashes.drain(..left_len).collect();
            let start = r.start;
            r.start = at;
            let id = self.new_run(Run {
                start,
                hashes,
                holders,
                lineage,
                indexed,
            });
            (id, run)
        } else {
            let hashes = r.hashes.split_off(left_len);
            r.hashes.shrink_to_fit();
            let id = self.new_run(Run {
                start: at,
                hashes,
                holders,
                lineage,
                indexed,
            });
            (run, id)
        };
        let first = self.runs[right as usize].hashes[0];
        self.blocks.insert(first, Loc { lineage, pos: at });
        (left, right)
    }

    /// The run holding exactly positions `from..to` of `run`, splitting as needed.
    pub(super) fn isolate(&mut self, mut run: u32, from: u32, to: u32) -> u32 {
        if from > self.runs[run as usize].start {
            run = self.split(run, from).1;
        }
        if to < self.runs[run as usize].end() {
            run = self.split(run, to).0;
        }
        run
    }

    /// Appends run `right` to the run ending with block `prev` when it is the next
    /// piece of the same lineage with the same holders and not the longer one
    /// (writes cut into chunks would otherwise leave a shared prefix in pieces).
    pub(super) fn merge_after(&mut self, prev: Loc, right: u32) {
        let Some(left) = self.run_at(prev) else {
            return;
        };
        let (l, r) = (&self.runs[left as usize], &self.runs[right as usize]);
        if left == right
            || l.lineage != r.lineage
            || prev.pos + 1 != l.end()
            || r.start != l.end()
            || r.hashes.len() > l.hashes.len()
            || l.holders != r.holders
        {
            return;
        }
        self.unlist(right);
        let moved = std::mem::take(&mut self.runs[right as usize]);
        let l = &mut self.runs[left as usize];
        if !(l.indexed || moved.indexed) {
            // Its first block no longer starts a run.
            self.blocks.remove(moved.hashes[0]);
        }
        l.indexed |= moved.indexed;
        l.hashes.extend(moved.hashes);
        self.free_runs.push(right);
    }

    /// The longest stretch of `hashes` (from its start) lying at consecutive
    /// positions of `run`, starting at `loc`.
    pub(super) fn stretch(&self, run: u32, loc: Loc, hashes: &[u64]) -> usize {
        let r = &self.runs[run as usize];
        let i = (loc.pos - r.start) as usize;
        hashes
            .iter()
            .zip(r.hashes.range(i..))
            .take_while(|(a, b)| a == b)
            .count()
    }

    /// Adds `slot` as holder of each block of `chain` (in chain order, following
    /// block `prev`: (hash, location)), creating the missing blocks; pushes each
    /// block's location and whether `slot` held it already to `placed` (a block
    /// twice in `chain` is held the second time). With `index_all` every block of
    /// `chain` gets a table entry, else only the first of each run.
    pub(super) fn add_holder_runs(
        &mut self,
        chain: &[u64],
        prev: Option<(u64, Loc)>,
        slot: u32,
        index_all: bool,
        placed: &mut Vec<(Loc, bool)>,
        entries: &AtomicUsize,
    ) {
        let index_all = index_all || !self.chained;
        // Where the previous block of the chain lives (checked: it may have gone
        // while the lock was let go between chunks).
        let mut prev: Option<Loc> = prev.and_then(|(h, l)| {
            (self.hash_at(l) == Some(h))
                .then_some(l)
                .or_else(|| self.blocks.get(h))
        });
        let mut i = 0;
        while i < chain.len() {
            match self.locate(prev, chain[i]) {
                Some((run, loc)) => {
                    let n = self.stretch(run, loc, &chain[i..]);
                    let held = self.runs[run as usize].holders.contains(slot);
                    let mid = if held {
                        run
                    } else {
                        let mid = self.isolate(run, loc.pos, loc.pos + n as u32);
                        self.runs[mid as usize].holders.insert(slot);
                        entries.fetch_add(n, Ordering::Relaxed);
                        mid
                    };
                    if index_all && self.chained && !held {
                        self.runs[mid as usize].indexed = true;
                        for (k, h) in chain[i..i + n].iter().enumerate() {
                            let pos = loc.pos + k as u32;
                            self.blocks.insert(*h, Loc { pos, ..loc });
                        }
                    }
                    placed.extend((0..n as u32).map(|k| {
                        let pos = loc.pos + k;
                        (Loc { pos, ..loc }, held)
                    }));
                    let last = Loc {
                        pos: loc.pos + n as u32 - 1,
                        ..loc
                    };
                    if !held {
                        if let Some(p) = prev {
                            self.merge_after(p, mid);
                        }
                    }
                    i += n;
                    prev = Some(last);
                }
                None => {
                    let (n, loc) = self.add_new_blocks(&chain[i..], prev, slot, index_all, entries);
                    placed.extend((0..n as u32).map(|k| {
                        let pos = loc.pos + k;
                        (Loc { pos, ..loc }, false)
                    }));
                    i += n;
                    prev = Some(Loc {
                        pos: loc.pos + n as u32 - 1,
                        ..loc
                    });
                }
            }
        }
    }

    /// Creates the leading blocks of `chain` that the index does not have yet
    /// (`chain[0]` is known to be new), held by `slot`: right after `prev` when
    /// that ends its lineage (appended to its run when `slot` alone holds it, else
    /// a new run there), else as a new lineage. Returns how many and where the
    /// first went.
    pub(super) fn add_new_blocks(
        &mut self,
        chain: &[u64],
        prev: Option<Loc>,
        slot: u32,
        index_all: bool,
        entries: &AtomicUsize,
    ) -> (usize, Loc) {
        let after = prev.and_then(|p| {
            let run = self.run_at(p)?;
            let r = &self.runs[run as usize];
            let last = self.lineages[r.lineage as usize].pieces.last() == Some(&run);
            (last && p.pos + 1 == r.end()).then_some((run, r.lineage, p.pos + 1))
        });
        let (run, loc) = match after {
            Some((run, lineage, pos)) if self.runs[run as usize].holders.is_only(slot) => {
                (run, Loc { lineage, pos })
            }
            _ => {
                let loc = match after {
                    Some((_, lineage, pos)) => Loc { lineage, pos },
                    None => Loc {
                        lineage: self.new_lineage(),
                        pos: 0,
                    },
                };
                let run = self.new_run(Run {
                    start: loc.pos,
                    hashes: VecDeque::with_capacity(chain.len()),
                    holders: SlotSet::one(slot),
                    lineage: loc.lineage,
                    indexed: index_all,
                });
                // The first block of a run always has an entry.
                self.blocks.insert(chain[0], loc);
                (run, loc)
            }
        };
        let n = if index_all {
            // Up to the first block met again (a repeat in `chain`, or a known one).
            self.blocks.reserve(chain.len());
            self.blocks.prefetch(chain);
            let mut n = 0u32;
            for h in chain {
                let at = Loc {
                    pos: loc.pos + n,
                    ..loc
                };
                if !self.blocks.insert_new(*h, at) && self.blocks.get(*h) != Some(at) {
                    break;
                }
                n += 1;
            }
            self.runs[run as usize].indexed = true;
            n as usize
        } else {
            // Chained: a block after a new one can only exist as some run's first
            // block, which has an entry.
            1 + chain[1..]
                .iter()
                .take_while(|h| self.blocks.get(**h).is_none())
                .count()
        };
        self.runs[run as usize].hashes.extend(&chain[..n]);
        entries.fetch_add(n, Ordering::Relaxed);
        (n, loc)
    }

    /// Removes `slot` as holder of each of these blocks (found by their table
    /// entries) it holds.
    pub(super) fn remove_hashes(&mut self, hashes: &[u64], slot: u32, entries: &AtomicUsize) {
        let blocks: Vec<(u64, Loc)> = hashes
            .iter()
            .filter_map(|h| self.blocks.get(*h).map(|l| (*h, l)))
            .collect();
        self.remove_holder_runs(&blocks, slot, entries);
    }

    /// The next stretch of `blocks` from `*at`: consecutive locations of one run,
    /// each still holding its hash, as (run, first location, length); a location
    /// no longer holding its hash is skipped. Moves `*at` past what it returns.
    fn next_stretch(&self, blocks: &[(u64, Loc)], at: &mut usize) -> Option<(u32, Loc, usize)> {
        while let Some(&(h, loc)) = blocks.get(*at) {
            let Some(run) = self.run_at(loc).filter(|_| self.hash_at(loc) == Some(h)) else {
                *at += 1;
                continue;
            };
            let r = &self.runs[run as usize];
            let n = blocks[*at..]
                .iter()
                .zip(r.hashes.range((loc.pos - r.start) as usize..))
                .enumerate()
                .take_while(|&(k, (&(h, l), &held))| {
                    l.lineage == loc.lineage && l.pos == loc.pos + k as u32 && h == held
                })
                .count();
            *at += n;
            return Some((run, loc, n));
        }
        None
    }

    /// Removes `slot` as holder of each block (hash, location) it holds; blocks
    /// left with no holder are forgotten. A location no longer holding its hash
    /// is skipped.
    pub(super) fn remove_holder_runs(
        &mut self,
        blocks: &[(u64, Loc)],
        slot: u32,
        entries: &AtomicUsize,
    ) {
        let mut at = 0;
        while let Some((run, loc, n)) = self.next_stretch(blocks, &mut at) {
            if !self.runs[run as usize].holders.contains(slot) {
                continue;
            }
            let mid = self.isolate(run, loc.pos, loc.pos + n as u32);
            let r = &mut self.runs[mid as usize];
            r.holders.remove(slot);
            entries.fetch_sub(n, Ordering::Relaxed);
            if r.holders.is_empty() {
                self.free_run(mid);
            }
        }
    }

    /// Adds `slot` as holder of each block (hash, location) where it is,
    /// consecutive locations a stretch at a time; a location no longer
    /// holding its hash is skipped. Returns how many blocks `slot` newly holds.
    pub(super) fn add_holder_at(
        &mut self,
        blocks: &[(u64, Loc)],
        slot: u32,
        entries: &AtomicUsize,
    ) -> usize {
        let mut added = 0;
        let mut at = 0;
        while let Some((run, loc, n)) = self.next_stretch(blocks, &mut at) {
            if self.runs[run as usize].holders.contains(slot) {
                continue;
            }
            let mid = self.isolate(run, loc.pos, loc.pos + n as u32);
            self.runs[mid as usize].holders.insert(slot);
            entries.fetch_add(n, Ordering::Relaxed);
            added += n;
            if let Some(prev) = loc.pos.checked_sub(1) {
                self.merge_after(Loc { pos: prev, ..loc }, mid);
            }
        }
        added
    }

    /// Walks `hashes` run by run: returns the holder sets of the first block
    /// shrinking at run boundaries, each (set, leading blocks its members hold),
    /// every set a subset of the one before.
    pub(super) fn walk(&self, hashes: &[u64]) -> Levels {
        let mut levels = Levels::new();
        let Some((mut run, mut loc)) = hashes.first().and_then(|h| self.find_likely(*h)) else {
            return levels;
        };
        // Borrowed until a boundary narrows it: most walks never copy a set but
        // the last.
        let mut active = Cow::Borrowed(&self.runs[run as usize].holders);
        let mut i = 1usize;
        while i < hashes.len() {
            let r = &self.runs[run as usize];
            let off = ((loc.pos + 1 - r.start) as usize).min(r.hashes.len());
            // The run after this one if the prompt follows it to its end, found
            // (and its first blocks loaded) before this run is compared: the two
            // chains of cache misses then overlap instead of queueing.
            let end = i + r.hashes.len() - off;
            let ahead = hashes.get(end).and_then(|h| self.find_likely(*h));
            if let Some((next, _)) = ahead {
                std::hint::black_box(self.runs[next as usize].hashes.front().copied());
            }
            let same = hashes[i..]
                .iter()
                .zip(r.hashes.range(off..))
                .take_while(|(a, b)| a == b)
                .count();
            i += same;
            if i == hashes.len() {
                break;
            }
            // The next block starts a run (or is unknown).
            let found = if i == end {
                ahead
            } else {
                self.find_likely(hashes[i])
            };
            let Some((next, at)) = found else {
                break;
            };
            if next != run {
                if let Some(kept) = active.narrowed_by(&self.runs[next as usize].holders) {
                    levels.push((
                        std::mem::replace(&mut active, Cow::Owned(kept)).into_owned(),
                        i as u32,
                    ));
                    if active.is_empty() {
                        return levels;
                    }
                }
            }
            run = next;
            loc = at;
            i += 1;
        }
        levels.push((active.into_owned(), i as u32));
        levels
    }
}
