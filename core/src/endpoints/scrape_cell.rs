//! The latest scrape of one endpoint, held inline in a sequence lock of atomics.
//!
//! Every pick reads every candidate's scrape, so the read must be cheap: no lock,
//! no allocation and no pointer to follow (an `Arc` per scrape cost a cache miss
//! per candidate). The scraper writes rarely; writers take a mutex, bump the
//! sequence to odd, store the fields and bump it to even again. A reader retries
//! while the sequence is odd or changed under it. All fields are atomics, so a
//! torn read is only ever discarded, never undefined.

use std::sync::atomic::{fence, AtomicI64, AtomicU64, Ordering};
use std::time::Instant;

use parking_lot::Mutex;

use super::{LoadFigures, ScrapedLoad};
use crate::time::Epoch;

/// The latest scrape outcome of one endpoint.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(super) struct Scrape {
    /// The last successful scrape's load.
    pub(super) load: Option<ScrapedLoad>,
    /// When the latest scrape failed, if it did (cleared by a successful one).
    pub(super) failed_at: Option<Instant>,
}

/// No value (for the optional fields).
const NONE: u64 = u64::MAX;

/// A [`Scrape`] readers copy out without locking. What every pick reads
/// ([`ScrapeCell::read_figures`]) comes first, in 48 bytes.
#[derive(Debug)]
#[repr(C)]
pub(super) struct ScrapeCell {
    seq: AtomicU64,
    queue: AtomicU64,
    running: AtomicU64,
    kv_usage: AtomicU64,
    /// `load.at` coded by [`Epoch::process`]; [`Epoch::NONE`] when no load.
    at: AtomicI64,
    failed_at: AtomicI64,
    block_size: AtomicU64,
    num_blocks: AtomicU64,
    writer: Mutex<()>,
}

impl Default for ScrapeCell {
    fn default() -> Self {
        ScrapeCell {
            seq: AtomicU64::new(0),
            queue: AtomicU64::new(0),
            running: AtomicU64::new(0),
            kv_usage: AtomicU64::new(0),
            block_size: AtomicU64::new(NONE),
            num_blocks: AtomicU64::new(NONE),
            at: AtomicI64::new(Epoch::NONE),
            failed_at: AtomicI64::new(Epoch::NONE),
            writer: Mutex::new(()),
        }
    }
}

impl ScrapeCell {
    /// The current scrape, and its `load.at` coded by [`Epoch::process`]
    /// ([`Epoch::NONE`] without a load).
    #[inline]
    pub(super) fn read(&self) -> (Scrape, i64) {
        self.consistent(Self::fields)
    }

    /// What a pick reads: the last load's figures, its `at` coded by
    /// [`Epoch::process`], and whether the latest scrape failed (no instant
    /// decoded, no optional field read).
    #[inline]
    pub(super) fn read_figures(&self) -> (Option<LoadFigures>, i64, bool) {
        self.consistent(|cell| {
            let f = |a: &AtomicU64| f64::from_bits(a.load(Ordering::Relaxed));
            let at = cell.at.load(Ordering::Relaxed);
            let figures = (at != Epoch::NONE).then(|| LoadFigures {
                queue: f(&cell.queue),
                running: f(&cell.running),
                kv_usage: f(&cell.kv_usage),
            });
            let failing = cell.failed_at.load(Ordering::Relaxed) != Epoch::NONE;
            (figures, at, failing)
        })
    }

    /// `read` of the fields, retried until no write overlapped it (the
    /// sequence was even before and unchanged after).
    #[inline]
    fn consistent<T>(&self, read: impl Fn(&Self) -> T) -> T {
        loop {
            let before = self.seq.load(Ordering::Acquire);
            if before & 1 == 0 {
                let value = read(self);
                fence(Ordering::Acquire);
                if self.seq.load(Ordering::Relaxed) == before {
                    return value;
                }
            }
            std::hint::spin_loop();
        }
    }

    /// Replaces the scrape with `f` of the current one.
    pub(super) fn update(&self, f: impl FnOnce(Scrape) -> Scrape) {
        let _writer = self.writer.lock();
        // The only writer: the fields are stable.
        let next = f(self.fields().0);
        let seq = self.seq.load(Ordering::Relaxed);
        self.seq.store(seq.wrapping_add(1), Ordering::Relaxed);
        fence(Ordering::Release);
        let load = next.load;
        let bits = |v: Option<f64>| v.unwrap_or(0.0).to_bits();
        self.queue
            .store(bits(load.map(|l| l.queue)), Ordering::Relaxed);
        self.running
            .store(bits(load.map(|l| l.running)), Ordering::Relaxed);
        self.kv_usage
            .store(bits(load.map(|l| l.kv_usage)), Ordering::Relaxed);
        self.block_size.store(
            load.and_then(|l| l.block_size).map_or(NONE, u64::from),
            Ordering::Relaxed,
        );
        self.num_blocks.store(
            load.and_then(|l| l.num_blocks).unwrap_or(NONE),
            Ordering::Relaxed,
        );
        let epoch = Epoch::process();
        self.at
            .store(epoch.encode_opt(load.map(|l| l.at)), Ordering::Relaxed);
        self.failed_at
            .store(epoch.encode_opt(next.failed_at), Ordering::Relaxed);
        self.seq.store(seq.wrapping_add(2), Ordering::Release);
    }

    /// The fields as they are now, with `load.at`'s code (consistent only under
    /// the sequence check).
    #[inline]
    fn fields(&self) -> (Scrape, i64) {
        let f = |a: &AtomicU64| f64::from_bits(a.load(Ordering::Relaxed));
        let opt = |a: &AtomicU64| Some(a.load(Ordering::Relaxed)).filter(|v| *v != NONE);
        let epoch = Epoch::process();
        let at_code = self.at.load(Ordering::Relaxed);
        let load = epoch.decode(at_code).map(|at| ScrapedLoad {
            queue: f(&self.queue),
            running: f(&self.running),
            kv_usage: f(&self.kv_usage),
            block_size: opt(&self.block_size).map(|v| v as u32),
            num_blocks: opt(&self.num_blocks),
            at,
        });
        let scrape = Scrape {
            load,
            failed_at: epoch.decode(self.failed_at.load(Ordering::Relaxed)),
        };
        (scrape, at_code)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;

    fn load(x: f64, at: Instant) -> ScrapedLoad {
        ScrapedLoad {
            queue: x,
            running: 2.0 * x,
            kv_usage: x / 10.0,
            block_size: Some(16),
            num_blocks: Some(1000 + x as u64),
            at,
        }
    }

    #[test]
    fn a_scrape_reads_back_as_written_with_instants_either_side_of_the_origin() {
        let earlier = Instant::now();
        let cell = ScrapeCell::default();
        assert_eq!(cell.read().0, Scrape::default());
        let later = Instant::now() + Duration::from_secs(3);
        for at in [earlier, later] {
            let s = Scrape {
                load: Some(load(3.0, at)),
                failed_at: None,
            };
            cell.update(|_| s);
            assert_eq!(cell.read().0, s);
        }
        cell.update(|s| Scrape {
            failed_at: Some(earlier),
            ..s
        });
        let read = cell.read().0;
        assert_eq!(read.failed_at, Some(earlier));
        assert_eq!(read.load, Some(load(3.0, later)));
        let bare = ScrapedLoad {
            block_size: None,
            num_blocks: None,
            ..load(1.0, later)
        };
        cell.update(|_| Scrape {
            load: Some(bare),
            failed_at: None,
        });
        assert_eq!(cell.read().0.load, Some(bare));
    }

    #[test]
    fn readers_never_see_a_torn_scrape() {
        let cell = Arc::new(ScrapeCell::default());
        let at = Instant::now();
        let writer = {
            let cell = Arc::clone(&cell);
            std::thread::spawn(move || {
                for i in 0..20_000u32 {
                    let x = f64::from(i);
                    cell.update(|_| Scrape {
                        load: Some(load(x, at)),
                        failed_at: None,
                    });
                }
            })
        };
        let mut seen = 0;
        while !writer.is_finished() || seen == 0 {
            if let Some(l) = cell.read().0.load {
                // Every field comes from the same write.
                assert_eq!(l, load(l.queue, at));
                seen += 1;
            }
            if let (Some(f), _, failing) = cell.read_figures() {
                assert_eq!(f, LoadFigures::from(&load(f.queue, at)));
                assert!(!failing);
            }
        }
        writer.join().unwrap();
    }
}
