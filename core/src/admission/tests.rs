use super::*;
use crate::endpoints::{Endpoint, InFlightGuard};

/// A pool of one worker rank that is full at `max` requests in flight.
fn pool(max: u32) -> (EndpointTable, Gate) {
    let table = EndpointTable::new();
    table.replace(vec![Endpoint::new("10.0.0.1:8000".parse().unwrap())]);
    let config = AdmissionConfig {
        ttl: Duration::from_secs(10),
        saturation: SaturationConfig {
            max_in_flight_per_rank: max,
            ..SaturationConfig::default()
        },
        ..AdmissionConfig::default()
    };
    let gate = Gate::new(config, Arc::default(), Arc::new(NoObserver));
    (table, gate)
}

fn class(priority: i32, flow: &str) -> RequestClass {
    RequestClass {
        priority,
        flow: flow.into(),
        objective: "".into(),
        model: "m".into(),
        bytes: 100,
    }
}

fn busy(snap: &Snapshot, n: usize) -> Vec<InFlightGuard> {
    (0..n).map(|_| snap.endpoints[0].begin_request(0)).collect()
}

fn ticket(v: Verdict) -> Ticket {
    match v {
        Verdict::Wait(t) => t,
        other => panic!("expected to wait, got {other:?}"),
    }
}

#[test]
fn an_idle_pool_lets_requests_through_at_once() {
    let (table, gate) = pool(2);
    let snap = table.snapshot();
    assert!(matches!(gate.admit(class(0, "a"), &snap), Verdict::Go(_)));
    assert!(matches!(gate.admit(class(-5, "a"), &snap), Verdict::Go(_)));
    assert_eq!(gate.queued(), 0);
}

#[test]
fn a_released_permit_wakes_the_dispatcher_only_while_a_request_waits() {
    use futures::FutureExt;
    let woken = |gate: &Gate| gate.inner.wake.notified().now_or_never().is_some();
    let (table, gate) = pool(2);
    let snap = table.snapshot();
    let go = |gate: &Gate| match gate.admit(class(0, "a"), &snap) {
        Verdict::Go(permit) => permit,
        other => panic!("expected to go, got {other:?}"),
    };
    // Nothing waits: the dispatcher sleeps on.
    drop(go(&gate));
    assert!(!woken(&gate));
    // The pool is full and a request waits: releasing a permit wakes it.
    let permit = go(&gate);
    let _running = busy(&snap, 1);
    let waiting = ticket(gate.admit(class(0, "b"), &snap));
    woken(&gate);
    drop(permit);
    assert!(woken(&gate));
    drop(waiting);
}

/// Frees one running slot at a time and returns the order the waiters went in.
fn drain(
    gate: &Gate,
    snap: &Snapshot,
    running: &mut Vec<InFlightGuard>,
    mut waiting: Vec<(&'static str, Ticket)>,
) -> Vec<&'static str> {
    let now = Instant::now();
    let mut order = Vec::new();
    while !waiting.is_empty() {
        running.pop();
        gate.dispatch_at(snap, now);
        let mut went = 0;
        waiting.retain_mut(|(name, t)| match t.try_verdict() {
            None => true,
            Some(Ok(permit)) => {
                running.push(snap.endpoints[0].begin_request(0));
                drop(permit);
                order.push(*name);
                went += 1;
                false
            }
            Some(Err(why)) => panic!("{name} rejected: {why}"),
        });
        assert_eq!(went, 1, "one freed slot lets exactly one request go");
    }
    order
}

#[test]
fn queued_requests_dispatch_in_priority_order_as_capacity_frees() {
    let (table, gate) = pool(2);
    let snap = table.snapshot();
    let mut running = busy(&snap, 2);
    let now = Instant::now();
    let waiting: Vec<(&str, Ticket)> = [("low", 0), ("high", 10), ("mid", 5), ("low2", 0)]
        .into_iter()
        .map(|(name, prio)| (name, ticket(gate.admit_at(class(prio, name), &snap, now))))
        .collect();
    assert_eq!(gate.queued(), 4);
    // Still saturated: nothing goes.
    gate.dispatch_at(&snap, now);
    assert_eq!(gate.queued(), 4);
    let order = drain(&gate, &snap, &mut running, waiting);
    assert_eq!(order, vec!["high", "mid", "low", "low2"]);
    assert_eq!(gate.queued(), 0);
}

#[test]
fn flows_of_one_priority_take_turns() {
    let (table, gate) = pool(1);
    let snap = table.snapshot();
    let mut running = busy(&snap, 1);
    let now = Instant::now();
    let waiting: Vec<(&str, Ticket)> = [("a1", "a"), ("a2", "a"), ("a3", "a"), ("b1", "b")]
        .into_iter()
        .map(|(name, flow)| (name, ticket(gate.admit_at(class(0, flow), &snap, now))))
        .collect();
    let order = drain(&gate, &snap, &mut running, waiting);
    assert_eq!(order, vec!["a1", "b1", "a2", "a3"]);
}

#[test]
fn ttl_expiry_rejects_with_its_reason() {
    let (table, gate) = pool(1);
    let snap = table.snapshot();
    let _running = busy(&snap, 1);
    let now = Instant::now();
    let mut t = ticket(gate.admit_at(class(0, "a"), &snap, now));
    gate.dispatch_at(&snap, now + Duration::from_secs(9));
    assert!(t.try_verdict().is_none());
    gate.dispatch_at(&snap, now + Duration::from_secs(10));
    let why = t.try_verdict().unwrap().unwrap_err();
    assert_eq!(why, Rejection::TtlExpired);
    assert_eq!(why.reason(), "rejected-ttl-expired");
    assert_eq!(gate.queued(), 0);
}

#[test]
fn a_dropped_ticket_leaves_its_queue_at_once() {
    let (table, gate) = pool(1);
    let snap = table.snapshot();
    let running = busy(&snap, 1);
    let t = ticket(gate.admit(class(3, "a"), &snap));
    let mut other = ticket(gate.admit(class(0, "b"), &snap));
    assert_eq!(gate.queued(), 2);
    drop(t);
    assert_eq!(gate.queued(), 1);
    assert_eq!(gate.levels()[0].flow, "b");
    // The freed slot goes to the request still waiting.
    drop(running);
    gate.dispatch_at(&snap, Instant::now());
    assert!(matches!(other.try_verdict(), Some(Ok(_))));
}

#[test]
fn sheddable_requests_are_rejected_at_once_when_saturated() {
    let (table, gate) = pool(1);
    let snap = table.snapshot();
    let _running = busy(&snap, 1);
    match gate.admit(class(-1, "a"), &snap) {
        Verdict::Reject(why) => assert_eq!(why.reason(), "rejected-saturated"),
        other => panic!("{other:?}"),
    }
    assert_eq!(gate.queued(), 0);
    assert!((gate.last_saturation() - 1.0).abs() < 1e-9);
}

#[test]
fn a_band_never_holds_more_than_its_byte_budget() {
    let (table, mut gate) = pool(1);
    Arc::get_mut(&mut gate.inner).unwrap().config.max_band_bytes = 250;
    let snap = table.snapshot();
    let _running = busy(&snap, 1);
    let _a = ticket(gate.admit(class(0, "a"), &snap));
    let _b = ticket(gate.admit(class(0, "b"), &snap));
    assert!(matches!(
        gate.admit(class(0, "c"), &snap),
        Verdict::Reject(Rejection::QueueFull)
    ));
    // Another priority has its own budget.
    let _d = ticket(gate.admit(class(1, "c"), &snap));
    let bytes: usize = gate.levels().iter().map(|l| l.bytes).sum();
    assert_eq!(bytes, 300);
}

#[test]
fn a_pool_without_endpoints_is_never_queued() {
    let table = EndpointTable::new();
    let gate = Gate::new(
        AdmissionConfig::default(),
        Arc::default(),
        Arc::new(NoObserver),
    );
    assert!(matches!(
        gate.admit(class(-1, "a"), &table.snapshot()),
        Verdict::Go(_)
    ));
}

#[test]
fn permits_count_until_routed_so_a_burst_does_not_overshoot() {
    let (table, gate) = pool(2);
    let snap = table.snapshot();
    let running = busy(&snap, 2);
    let now = Instant::now();
    let mut tickets: Vec<Ticket> = (0..4)
        .map(|_| ticket(gate.admit_at(class(0, "a"), &snap, now)))
        .collect();
    drop(running);
    gate.dispatch_at(&snap, now);
    let permits: Vec<Permit> = tickets
        .iter_mut()
        .filter_map(|t| t.try_verdict().and_then(Result::ok))
        .collect();
    assert_eq!(permits.len(), 2, "two slots freed, two dispatched");
    assert_eq!(gate.queued(), 2);
}

#[test]
fn switched_off_everything_goes_at_once() {
    let (table, mut gate) = pool(1);
    Arc::get_mut(&mut gate.inner).unwrap().config.enabled = false;
    let snap = table.snapshot();
    let _running = busy(&snap, 5);
    assert!(matches!(gate.admit(class(-1, "a"), &snap), Verdict::Go(_)));
}

#[tokio::test]
async fn the_dispatcher_lets_a_waiter_go_when_load_drops() {
    let (table, gate) = pool(1);
    let table = Arc::new(table);
    let snap = table.snapshot();
    let running = busy(&snap, 1);
    let mut t = ticket(gate.admit(class(0, "a"), &snap));
    let driver = tokio::spawn(gate.clone().run(Arc::clone(&table)));
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert!(t.try_verdict().is_none());
    drop(running);
    let verdict = tokio::time::timeout(Duration::from_secs(2), t.wait()).await;
    assert!(matches!(verdict, Ok(Ok(_))));
    driver.abort();
}
