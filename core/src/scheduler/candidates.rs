//! The candidates of one pick: the (endpoint, rank)s a request may go to, read
//! from the snapshot where the pick needs them rather than listed up front.
//!
//! A candidate serves the side being picked (decode, or prefill for a request
//! with a body), is in the subset hint if there is one, and is not passively
//! ejected, unless every endpoint the request could use is ejected: then all
//! of them are tried rather than none. Which of those two holds is settled once
//! per pick ([`Pool::new`]), usually at the first endpoint.

use std::net::SocketAddr;
use std::sync::Arc;

use super::cost::Cand;
use super::{FilteredOut, PickError, PickRequest};
use crate::endpoints::{EndpointState, Snapshot, WorkerKey};

/// Which list of candidates: decode (destination) or prefill workers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Side {
    Decode,
    Prefill,
}

/// The endpoints one request may go to.
pub(super) struct Pool<'s, 'r> {
    snapshot: &'s Snapshot,
    req: &'r PickRequest<'r>,
    /// The subset hint's addresses, sorted.
    subset: Option<Vec<SocketAddr>>,
    /// The pick's instant, coded by [`Epoch::process`](crate::time::Epoch::process).
    now: i64,
    /// Every endpoint the request could use is ejected: all of them are tried.
    all_ejected: bool,
}

impl<'s, 'r> Pool<'s, 'r> {
    /// The pool of `req` in `snapshot` at `now`; errors when the subset hint
    /// names no endpoint or no decode candidate exists.
    pub(super) fn new(
        req: &'r PickRequest<'r>,
        snapshot: &'s Snapshot,
        now: i64,
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
            all_ejected: false,
        };
        let up = |side| {
            snapshot
                .endpoints
                .iter()
                .any(|e| pool.serves(e, side) && e.health().available_at(now))
        };
        if !up(Side::Decode) {
            // No decode candidate, unless nothing the request could use is up.
            if up(Side::Prefill) {
                return Err(PickError::NoDecodeEndpoint);
            }
            pool.all_ejected = true;
            if !snapshot
                .endpoints
                .iter()
                .any(|e| pool.serves(e, Side::Decode))
            {
                return Err(PickError::NoDecodeEndpoint);
            }
        }
        Ok(pool)
    }

    /// Whether `ep` could take `side` of the request, whatever its health.
    fn serves(&self, ep: &EndpointState, side: Side) -> bool {
        excluded(self.req, self.subset.as_deref(), ep).is_none()
            && ep.serves_decode() == (side == Side::Decode)
    }

    /// Whether `ep` is a candidate for `side`.
    fn open(&self, ep: &EndpointState, side: Side) -> bool {
        self.serves(ep, side) && (self.all_ejected || ep.health().available_at(self.now))
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
pub(super) fn parsed_subset(subset: Option<&[String]>) -> Option<Vec<SocketAddr>> {
    subset.map(|s| {
        let mut addrs: Vec<SocketAddr> = s.iter().filter_map(|a| a.parse().ok()).collect();
        addrs.sort_unstable();
        addrs
    })
}

/// Why `ep` can take no part in `req` whatever its health: outside the subset
/// hint (`subset`, from [`parsed_subset`]), or prefill-only with no body.
pub(super) fn excluded(
    req: &PickRequest<'_>,
    subset: Option<&[SocketAddr]>,
    ep: &EndpointState,
) -> Option<FilteredOut> {
    if subset.is_some_and(|s| s.binary_search(&ep.endpoint.address).is_err()) {
        Some(FilteredOut::NotInSubset)
    } else if !ep.serves_decode() && req.body.is_none() {
        Some(FilteredOut::NoBody)
    } else {
        None
    }
}
