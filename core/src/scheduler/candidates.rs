//! The candidates of one pick: the (endpoint, rank)s a request may go to, read
//! from the snapshot where the pick needs them rather than listed up front.
//!
//! A candidate serves the side being picked (decode, or prefill) and every
//! filter of the scheduler admits it ([`super::filters`]): the subset hint, a
//! body for prefill-only workers, passive health. A yielding filter (passive
//! health) is set aside when it would leave no decode candidate: then every
//! endpoint the others admit is tried rather than none. Which of those two
//! holds is settled once per pick ([`Pool::new`]), usually at the first
//! endpoint. Filters with nothing to drop for the request are left out of the
//! pick at its start, so they cost nothing per endpoint.

use std::net::SocketAddr;
use std::sync::Arc;

use super::filters::{Filter, FilterContext};
use super::terms::Side;
use super::{PickError, PickRequest, Target};
use crate::endpoints::{EndpointState, Snapshot, WorkerKey};

/// One candidate (worker, rank).
#[derive(Clone, Copy)]
pub(super) struct Cand<'a> {
    pub(super) ep: &'a Arc<EndpointState>,
    pub(super) rank: u32,
    pub(super) key: WorkerKey,
}

impl Cand<'_> {
    /// The decision's target for this candidate.
    pub(super) fn target(&self) -> Target {
        Target {
            state: Arc::clone(self.ep),
            rank: self.rank,
        }
    }
}

/// Most filters one scheduler runs (one bit each in a pick's masks).
pub const MAX_FILTERS: usize = 64;

/// The filters of a list that apply to one pick, one bit per place.
#[derive(Clone, Copy)]
struct Active<'f> {
    filters: &'f [Arc<dyn Filter>],
    mask: u64,
}

impl<'f> Active<'f> {
    /// Whether every filter of the set admits `ep`.
    #[inline]
    fn admit(&self, at: &FilterContext<'_>, ep: &EndpointState) -> bool {
        self.find(|f| !f.admits(at, ep)).is_none()
    }

    /// The first filter of the set for which `pred` holds.
    #[inline]
    fn find(&self, mut pred: impl FnMut(&dyn Filter) -> bool) -> Option<&'f dyn Filter> {
        let mut m = self.mask;
        while m != 0 {
            let f = &*self.filters[m.trailing_zeros() as usize];
            if pred(f) {
                return Some(f);
            }
            m &= m - 1;
        }
        None
    }
}

/// The endpoints one request may go to.
pub(super) struct Pool<'s, 'r> {
    snapshot: &'s Snapshot,
    req: &'r PickRequest<'r>,
    /// The subset hint's addresses, sorted.
    subset: Option<Vec<SocketAddr>>,
    /// The pick's instant, coded by [`Epoch::process`](crate::time::Epoch::process).
    now: i64,
    /// Filters that never yield and apply to the request.
    strict: Active<'r>,
    /// Yielding filters that apply, unless they left no decode candidate.
    yielding: Active<'r>,
}

impl<'s, 'r> Pool<'s, 'r> {
    /// The pool of `req` in `snapshot` at `now` under `filters`; errors when
    /// the subset hint names no endpoint or no decode candidate exists.
    pub(super) fn new(
        req: &'r PickRequest<'r>,
        snapshot: &'s Snapshot,
        now: i64,
        filters: &'r [Arc<dyn Filter>],
    ) -> Result<Self, PickError> {
        let subset = parsed_subset(req.subset);
        if let Some(s) = &subset {
            if !s.iter().any(|a| snapshot.by_address(a).is_some()) {
                return Err(PickError::SubsetEmpty);
            }
        }
        let mut pool = Pool {
            snapshot,
            req,
            subset,
            now,
            strict: Active { filters, mask: 0 },
            yielding: Active { filters, mask: 0 },
        };
        let at = pool.context();
        let (mut strict, mut yielding) = (0, 0);
        for (i, f) in filters.iter().enumerate().take(MAX_FILTERS) {
            if f.applies(&at) {
                *(if f.yields() {
                    &mut yielding
                } else {
                    &mut strict
                }) |= 1 << i;
            }
        }
        pool.strict.mask = strict;
        pool.yielding.mask = yielding;
        let up = |pool: &Self, side| snapshot.endpoints.iter().any(|e| pool.open(e, side));
        if !up(&pool, Side::Decode) {
            // No decode candidate, unless the yielding filters dropped
            // everything the request could use: then they are set aside.
            if pool.yielding.mask == 0 || up(&pool, Side::Prefill) {
                return Err(PickError::NoDecodeEndpoint);
            }
            pool.yielding.mask = 0;
            if !up(&pool, Side::Decode) {
                return Err(PickError::NoDecodeEndpoint);
            }
        }
        Ok(pool)
    }

    /// What the filters read about this pick.
    fn context(&self) -> FilterContext<'_> {
        FilterContext {
            req: self.req,
            subset: self.subset.as_deref(),
            now: self.now,
        }
    }

    /// Whether `ep` could take `side` of the request, yielding filters aside.
    #[inline]
    fn serves(&self, ep: &EndpointState, side: Side) -> bool {
        ep.serves_decode() == (side == Side::Decode) && self.strict.admit(&self.context(), ep)
    }

    /// Whether `ep` is a candidate for `side`.
    #[inline]
    fn open(&self, ep: &EndpointState, side: Side) -> bool {
        self.serves(ep, side) && self.yielding.admit(&self.context(), ep)
    }

    /// Why `ep` sits out of this pick (the reason of the first filter that
    /// drops it), or `None` when it is a candidate of its side.
    pub(super) fn filtered_out(&self, ep: &EndpointState) -> Option<&'static str> {
        let at = self.context();
        let drops = |f: &dyn Filter| !f.admits(&at, ep);
        self.strict
            .find(drops)
            .or_else(|| self.yielding.find(drops))
            .map(|f| f.reason())
    }

    /// Ranks of `side` with no prefill pending, in the whole snapshot (health
    /// and the subset hint aside; see [`Snapshot::idle_ranks`]).
    pub(super) fn idle_ranks(&self, side: Side) -> u64 {
        self.snapshot.idle_ranks(side == Side::Decode)
    }

    /// How many endpoints the snapshot holds.
    pub(super) fn endpoints(&self) -> usize {
        self.snapshot.endpoints.len()
    }

    /// Whether some endpoint of the snapshot serves prefill only, so the
    /// request may have a prefill candidate (else none is looked for).
    pub(super) fn has_prefill_workers(&self) -> bool {
        self.snapshot.has_prefill_only()
    }

    /// Whether [`Pool::get`] answers without a pass over the pool (no two
    /// endpoints share an instance id).
    pub(super) fn direct(&self) -> bool {
        self.snapshot.unique_instances()
    }

    /// The candidate for `side` named `key`, if it is one.
    pub(super) fn get(&self, key: WorkerKey, side: Side) -> Option<Cand<'s>> {
        let found = |ep: &'s Arc<EndpointState>| {
            (key.dp_rank < ep.ranks() && self.open(ep, side)).then_some(Cand {
                ep,
                rank: key.dp_rank,
                key,
            })
        };
        self.named(key.instance_id).find_map(found)
    }

    /// The endpoints with `instance_id`: the snapshot's map answers when no two
    /// endpoints share an id ([`Pool::direct`]), else a pass over the pool.
    fn named(&self, instance_id: u64) -> impl Iterator<Item = &'s Arc<EndpointState>> + '_ {
        let snapshot = self.snapshot;
        let (one, scan) = match self.direct() {
            true => (snapshot.by_instance(instance_id), &snapshot.endpoints[..0]),
            false => (None, &snapshot.endpoints[..]),
        };
        one.into_iter().chain(
            scan.iter()
                .filter(move |e| e.endpoint.instance_id == instance_id),
        )
    }

    /// Whether `key` is a live decode worker the subset hint leaves out (a
    /// session bound there keeps its binding while the turn goes elsewhere).
    pub(super) fn outside_subset(&self, key: WorkerKey) -> bool {
        self.subset.is_some()
            && self.named(key.instance_id).any(|e| {
                e.serves_decode() && key.dp_rank < e.ranks() && e.health().available_at(self.now)
            })
    }

    /// Every endpoint of the snapshot, in order.
    pub(super) fn snapshot(&self) -> &'s Snapshot {
        self.snapshot
    }

    /// Every candidate for `side`, starting at the endpoint `start` picks
    /// and wrapping around.
    pub(super) fn iter_from(&self, side: Side, start: u64) -> impl Iterator<Item = Cand<'s>> + '_ {
        let all = &self.snapshot.endpoints;
        let from = if all.is_empty() {
            0
        } else {
            start as usize % all.len()
        };
        all[from..]
            .iter()
            .chain(&all[..from])
            .filter(move |e| self.open(e, side))
            .flat_map(|ep| {
                (0..ep.ranks()).map(move |rank| Cand {
                    ep,
                    rank,
                    key: ep.key(rank),
                })
            })
    }

    /// Every candidate for `side`, in snapshot order.
    pub(super) fn iter(&self, side: Side) -> impl Iterator<Item = Cand<'s>> + '_ {
        self.iter_from(side, 0)
    }
}

/// The subset hint's addresses, parsed and sorted once per pick (an entry that
/// is no socket address matches no endpoint).
fn parsed_subset(subset: Option<&[String]>) -> Option<Vec<SocketAddr>> {
    subset.map(|s| {
        let mut addrs: Vec<SocketAddr> = s.iter().filter_map(|a| a.parse().ok()).collect();
        addrs.sort_unstable();
        addrs
    })
}
