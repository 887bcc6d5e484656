//! [`Snapshot::idle_ranks`] against a pass over the set's ranks, under booking,
//! release and endpoints leaving or changing.

use proptest::prelude::*;

use super::*;

fn endpoint(i: u8, dp_size: u32, role: Role) -> Endpoint {
    Endpoint {
        dp_size,
        role,
        ..Endpoint::new(SocketAddr::from(([10, 0, 0, i], 8000)))
    }
}

fn load(blocks: u64, uncached: u64) -> ActiveLoad {
    ActiveLoad { blocks, uncached }
}

/// Ranks of `snap`'s endpoints on one side with nothing booked to prefill,
/// read rank by rank.
fn scanned(snap: &Snapshot, serves_decode: bool) -> u64 {
    snap.endpoints
        .iter()
        .filter(|e| e.serves_decode() == serves_decode)
        .flat_map(|e| (0..e.ranks()).map(move |r| e.active_load(r).uncached))
        .filter(|u| *u == 0)
        .count() as u64
}

#[test]
fn idle_ranks_follow_booking_release_and_removal() {
    let table = EndpointTable::new();
    table.replace(vec![
        endpoint(1, 2, Role::Both),
        endpoint(2, 1, Role::Decode),
        endpoint(3, 1, Role::Prefill),
    ]);
    let snap = table.snapshot();
    let [a, b, p] = [0, 1, 2].map(|i| Arc::clone(&snap.endpoints[i]));
    assert_eq!((snap.idle_ranks(true), snap.idle_ranks(false)), (3, 1));

    a.book(1, load(8, 5));
    b.book(0, load(4, 0));
    assert_eq!(
        snap.idle_ranks(true),
        2,
        "a decode-only load is not pending"
    );
    p.book(0, load(3, 3));
    assert_eq!((snap.idle_ranks(true), snap.idle_ranks(false)), (2, 0));
    a.release(1, load(0, 4));
    assert_eq!(snap.idle_ranks(true), 2);
    a.release(1, load(8, 1));
    assert_eq!(snap.idle_ranks(true), 3);
    a.book(7, load(1, 1));
    assert_eq!(snap.idle_ranks(true), 3, "a rank out of range is ignored");

    // The pending decode worker leaves: its rank stops counting at once, and
    // releasing its load later moves nothing.
    b.book(0, load(2, 2));
    assert_eq!(snap.idle_ranks(true), 2);
    table.replace(vec![
        endpoint(1, 2, Role::Both),
        endpoint(3, 1, Role::Prefill),
    ]);
    let after = table.snapshot();
    assert_eq!((after.idle_ranks(true), after.idle_ranks(false)), (2, 0));
    b.release(0, load(6, 2));
    b.book(0, load(1, 1));
    assert_eq!(after.idle_ranks(true), 2);

    // The prefill worker changes (one more rank): a new state, idle; the old
    // one's pending rank is gone with it.
    table.replace(vec![
        endpoint(1, 2, Role::Both),
        endpoint(3, 2, Role::Prefill),
    ]);
    let changed = table.snapshot();
    assert_eq!(changed.idle_ranks(false), 2);
    p.release(0, load(3, 3));
    assert_eq!(changed.idle_ranks(false), 2);
    changed.endpoints[1].book(1, load(1, 1));
    assert_eq!(changed.idle_ranks(false), 1);
    assert_eq!(Snapshot::default().idle_ranks(true), 0);
}

/// One change to the table or its load.
#[derive(Debug, Clone)]
enum Op {
    /// Books on (endpoint of the current set, rank).
    Book(usize, u32, u64, u64),
    /// Releases on (any state ever made, rank).
    Release(usize, u32, u64, u64),
    /// A new set: (address, dp size, prefill-only) of each endpoint.
    Replace(Vec<(u8, u32, bool)>),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..8usize, 0..4u32, 0..4u64, 0..4u64).prop_map(|(e, r, b, u)| Op::Book(e, r, b, u)),
        4 => (0..32usize, 0..4u32, 0..4u64, 0..4u64).prop_map(|(e, r, b, u)| Op::Release(e, r, b, u)),
        1 => prop::collection::vec((0..8u8, 1..4u32, prop::bool::weighted(0.25)), 0..6)
            .prop_map(Op::Replace),
    ]
}

proptest! {
    #[test]
    fn idle_ranks_equal_a_scan_of_the_set(ops in prop::collection::vec(op(), 1..80)) {
        let table = EndpointTable::new();
        let mut states: Vec<Arc<EndpointState>> = Vec::new();
        for op in ops {
            match op {
                Op::Book(e, rank, blocks, uncached) => {
                    let snap = table.snapshot();
                    if let Some(ep) = snap.endpoints.get(e % snap.endpoints.len().max(1)) {
                        ep.book(rank, load(blocks, uncached));
                    }
                }
                Op::Release(e, rank, blocks, uncached) => {
                    if let Some(ep) = states.get(e % states.len().max(1)) {
                        ep.release(rank, load(blocks, uncached));
                    }
                }
                Op::Replace(set) => {
                    let set = set
                        .into_iter()
                        .map(|(i, dp, prefill)| {
                            let role = if prefill { Role::Prefill } else { Role::Both };
                            endpoint(i, dp, role)
                        })
                        .collect();
                    table.replace(set);
                    for ep in &table.snapshot().endpoints {
                        if !states.iter().any(|s| Arc::ptr_eq(s, ep)) {
                            states.push(Arc::clone(ep));
                        }
                    }
                }
            }
            let snap = table.snapshot();
            for side in [true, false] {
                prop_assert_eq!(snap.idle_ranks(side), scanned(&snap, side));
            }
        }
    }
}
