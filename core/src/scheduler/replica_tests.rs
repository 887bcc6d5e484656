//! Two schedulers over two endpoint tables of the same pool, one replica's
//! deltas applied to the other as the sync glue does.

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use super::tests::{both, prompt, with_body};
use super::*;
use crate::endpoints::EndpointTable;
use crate::keys::WorkerKey;
use crate::replica::{Delta, PeerLoads, ReplicaSink};

/// Keeps every delta pushed.
#[derive(Debug, Default)]
struct Collect(Mutex<Vec<Delta>>);

impl ReplicaSink for Collect {
    fn push(&self, delta: Delta) {
        self.0.lock().push(delta);
    }
}

impl Collect {
    fn take(&self) -> Vec<Delta> {
        std::mem::take(&mut *self.0.lock())
    }
}

struct Replica {
    scheduler: Scheduler,
    table: EndpointTable,
    sink: Arc<Collect>,
    peers: PeerLoads,
}

fn replica(workers: usize) -> Replica {
    let r = Replica {
        scheduler: Scheduler::default(),
        table: both(workers),
        sink: Arc::default(),
        peers: PeerLoads::new(Duration::from_secs(5), 8),
    };
    assert!(r.scheduler.set_replica_sink(r.sink.clone()));
    r
}

/// Applies `from`'s pending deltas to `to`.
fn sync(from: &Replica, id: u64, to: &Replica, now: Instant) {
    let snap = to.table.snapshot();
    for d in from.sink.take() {
        to.scheduler.apply_peer(id, d, &to.peers, &snap, true, now);
    }
}

fn loads(r: &Replica) -> Vec<(ActiveLoad, u32)> {
    r.table
        .snapshot()
        .endpoints
        .iter()
        .map(|e| (e.active_load(0), e.in_flight(0)))
        .collect()
}

#[test]
fn a_peers_prompt_and_booking_steer_the_follow_up_to_the_same_worker() {
    let (a, b) = (replica(8), replica(8));
    let now = Instant::now();
    let first = prompt(&"turn one of a long conversation. ".repeat(40));
    let d = a
        .scheduler
        .pick_at(&with_body(&first), &a.table.snapshot(), now)
        .unwrap();
    let _in_flight = d.begin();
    sync(&a, 1, &b, now);
    // B sees A's booking: same load and in-flight count on the same worker.
    assert_eq!(loads(&a), loads(&b));
    let follow = prompt(&format!(
        "{}{}",
        "turn one of a long conversation. ".repeat(40),
        "and turn two."
    ));
    let e = b
        .scheduler
        .pick_at(&with_body(&follow), &b.table.snapshot(), now)
        .unwrap();
    assert_eq!(e.decode.key(), d.decode.key());
    assert!(e.overlap_blocks > 0);
    // A's release reaches B; B's own booking stays until it finishes.
    drop(_in_flight);
    a.scheduler.finish_at(&d, Some(200), now);
    sync(&a, 1, &b, now);
    let own = b.peers.own(&b.table.snapshot());
    assert_eq!(own.len(), 1);
    assert_eq!(own[0].load, e.decode_load());
    b.scheduler.finish_at(&e, Some(200), now);
    assert!(loads(&b)
        .iter()
        .all(|(l, n)| *l == ActiveLoad::default() && *n == 0));
}

#[test]
fn a_silent_peer_loses_its_bookings_after_the_lease() {
    let (a, b) = (replica(4), replica(4));
    let now = Instant::now();
    let d = a
        .scheduler
        .pick_at(&with_body(&prompt("hello there")), &a.table.snapshot(), now)
        .unwrap();
    sync(&a, 7, &b, now);
    assert!(loads(&b).iter().any(|(l, _)| l.blocks > 0));
    assert_eq!(b.peers.expire(now + Duration::from_secs(4)), 0);
    assert_eq!(b.peers.expire(now + Duration::from_secs(5)), 1);
    assert!(loads(&b)
        .iter()
        .all(|(l, n)| *l == ActiveLoad::default() && *n == 0));
    // A late release from the expired peer takes nothing.
    a.scheduler.finish_at(&d, Some(200), now);
    sync(&a, 7, &b, now);
    assert!(loads(&b)
        .iter()
        .all(|(l, n)| *l == ActiveLoad::default() && *n == 0));
}

#[test]
fn a_loads_report_replaces_what_lost_deltas_left_behind() {
    let (a, b) = (replica(4), replica(4));
    let now = Instant::now();
    let d = a
        .scheduler
        .pick_at(
            &with_body(&prompt("lost release")),
            &a.table.snapshot(),
            now,
        )
        .unwrap();
    sync(&a, 3, &b, now);
    a.scheduler.finish_at(&d, Some(200), now);
    a.sink.take(); // the release is lost
    assert!(loads(&b).iter().any(|(l, _)| l.blocks > 0));
    let report = Delta::Loads(a.peers.own(&a.table.snapshot()));
    b.scheduler
        .apply_peer(3, report, &b.peers, &b.table.snapshot(), true, now);
    assert!(loads(&b)
        .iter()
        .all(|(l, n)| *l == ActiveLoad::default() && *n == 0));
    assert_eq!(b.peers.peers(), 1);
}

#[test]
fn releases_never_take_more_than_the_peer_booked() {
    let (a, b) = (replica(1), replica(1));
    let now = Instant::now();
    let mine = b
        .scheduler
        .pick_at(&with_body(&prompt("b's own")), &b.table.snapshot(), now)
        .unwrap();
    let before = loads(&b);
    let snap = b.table.snapshot();
    let worker = mine.decode.key();
    b.scheduler.apply_peer(
        9,
        Delta::Release {
            worker,
            load: ActiveLoad {
                blocks: 1 << 40,
                uncached: 1 << 40,
            },
            requests: 5,
        },
        &b.peers,
        &snap,
        true,
        now,
    );
    assert_eq!(loads(&b), before);
    drop(a);
}

#[test]
fn peer_session_bindings_pin_turns_here() {
    let (a, b) = (replica(8), replica(8));
    let now = Instant::now();
    let open = crate::request::parse(
        br#"{"model":"m","prompt":"hi","nvext":{"session_control":{"session_id":"s1","action":"open","timeout":60}}}"#,
        None,
    )
    .unwrap();
    let d = a
        .scheduler
        .pick_at(&with_body(&open), &a.table.snapshot(), now)
        .unwrap();
    a.scheduler.finish_at(&d, Some(200), now);
    sync(&a, 1, &b, now);
    assert_eq!(b.scheduler.sessions().get("s1", now), Some(d.decode.key()));
    let close = crate::request::parse(
        br#"{"model":"m","prompt":"bye","nvext":{"session_control":{"session_id":"s1","action":"close"}}}"#,
        None,
    )
    .unwrap();
    let e = a
        .scheduler
        .pick_at(&with_body(&close), &a.table.snapshot(), now)
        .unwrap();
    a.scheduler.finish_at(&e, Some(200), now);
    sync(&a, 1, &b, now);
    assert_eq!(b.scheduler.sessions().get("s1", now), None);
}

/// Under capacity pressure (24 blocks a worker), three replicas route
/// conversations whose deltas reach each peer at different delays (replica 0
/// every 2nd pick, replica 1 every 3rd, replica 2 only at the end, its peers'
/// backlogs in the reverse order): deltas cross in flight and land long after
/// decisions made since. Once every delta has arrived, every replica holds the
/// same approximate entries for every worker, in the same LRU order.
#[test]
fn indexes_converge_whatever_order_and_delay_deltas_arrive_in() {
    let rs = [replica(4), replica(4), replica(4)];
    let keys: Vec<WorkerKey> = rs[0]
        .table
        .snapshot()
        .endpoints
        .iter()
        .map(|e| e.key(0))
        .collect();
    for r in &rs {
        for &k in &keys {
            r.scheduler.index().set_capacity(k, 24, Instant::now());
        }
    }
    let start = Instant::now();
    // pending[to]: (sender, delta) not yet delivered to `to`, oldest first.
    let mut pending: [Vec<(u64, Delta)>; 3] = Default::default();
    let deliver = |to: usize, deltas: Vec<(u64, Delta)>, now: Instant| {
        let r = &rs[to];
        let snap = r.table.snapshot();
        for (from, d) in deltas {
            r.scheduler.apply_peer(from, d, &r.peers, &snap, true, now);
        }
    };
    for step in 0..60u64 {
        // 0.3 s apart: several picks share a second, others do not.
        let now = start + Duration::from_millis(300 * step);
        let i = (step % 3) as usize;
        let (conversation, turn) = ((step * 5) % 7, step / 7);
        let text = format!(
            "conversation {conversation} opens with a long shared preamble. {}",
            format!("turn {turn} adds more words. ").repeat(turn as usize + 1)
        );
        let d = rs[i]
            .scheduler
            .pick_at(&with_body(&prompt(&text)), &rs[i].table.snapshot(), now)
            .unwrap();
        rs[i].scheduler.finish_at(&d, Some(200), now);
        for d in rs[i].sink.take() {
            for (to, queue) in pending.iter_mut().enumerate() {
                if to != i {
                    queue.push((i as u64 + 1, d.clone()));
                }
            }
        }
        for (to, every) in [(0, 2), (1, 3)] {
            if step % every == 0 {
                deliver(to, std::mem::take(&mut pending[to]), now);
            }
        }
    }
    let end = start + Duration::from_secs(30);
    let [to_0, to_1, mut to_2] = pending;
    deliver(0, to_0, end);
    deliver(1, to_1, end);
    to_2.sort_by_key(|(from, _)| std::cmp::Reverse(*from));
    deliver(2, to_2, end);

    let entries = |r: &Replica| -> Vec<Vec<u64>> {
        keys.iter()
            .map(|&k| r.scheduler.index().approximate_entries(k))
            .collect()
    };
    let first = entries(&rs[0]);
    assert!(
        first.iter().filter(|e| e.len() == 24).count() >= 2,
        "{first:?}"
    );
    for r in &rs[1..] {
        assert_eq!(entries(r), first);
    }
}

/// A peer's key far in the future (a skewed clock, a corrupt entry) ranks at
/// most a minute ahead: its entries expire a minute after their TTL at most,
/// and this replica's own touches are not dragged past its clock for longer.
#[test]
fn a_far_future_peer_key_is_cut_to_a_minute_ahead() {
    let r = replica(1);
    let key = r.table.snapshot().endpoints[0].key(0);
    let now = Instant::now();
    let (snap, index) = (r.table.snapshot(), r.scheduler.index());
    let peer = Delta::Prompt {
        worker: key,
        hashes: vec![1, 2],
        at: u64::MAX - 5,
    };
    r.scheduler.apply_peer(9, peer, &r.peers, &snap, true, now);
    assert_eq!(index.lookup(&[1, 2], &[key], now), vec![2]);
    let expired = now + crate::kv::index::DEFAULT_TTL + Duration::from_secs(62);
    assert_eq!(index.lookup(&[1, 2], &[key], expired), vec![0]);
    index.purge_expired(expired);
    assert!(index.approximate_entries(key).is_empty());
}
