//! Sessions: binding on success, timeouts, re-homing a gone worker, pinned
//! prefill ranks, signed tokens between replicas.

use super::*;

#[test]
fn session_binds_on_success_slides_and_closes() {
    let s = Scheduler::default();
    let t = both(4);
    let snap = t.snapshot();
    let t0 = Instant::now();
    let open = session("s1", Some("open"), "hello");
    let d = s.pick_at(&with_body(&open), &snap, t0).unwrap();
    let home = d.decode.key();
    assert!(s.sessions().is_empty(), "not bound before the response");
    s.finish_at(&d, Some(200), t0);
    assert_eq!(s.sessions().get("s1", t0), Some(home));
    // Middle turns stay, even against a different (unrelated, cached) prompt.
    let mut at = t0;
    for i in 0..5 {
        at += Duration::from_secs(50); // under the 60 s timeout, past it in total
        let turn = session("s1", None, &format!("turn {i}"));
        let d = s.pick_at(&with_body(&turn), &snap, at).unwrap();
        assert_eq!(d.decode.key(), home);
        s.finish_at(&d, Some(200), at);
    }
    let close = session("s1", Some("close"), "bye");
    let d = s.pick_at(&with_body(&close), &snap, at).unwrap();
    assert_eq!(d.decode.key(), home);
    assert!(s.response_headers(&d).is_none(), "no token on close");
    assert_eq!(
        s.sessions().get("s1", at),
        Some(home),
        "bound until finished"
    );
    s.finish_at(&d, Some(200), at);
    assert!(s.sessions().get("s1", at).is_none());
}

#[test]
fn failed_open_does_not_bind_and_ttl_expires() {
    let s = Scheduler::default();
    let t = both(2);
    let snap = t.snapshot();
    let t0 = Instant::now();
    let open = session("s2", Some("open"), "x");
    let d = s.pick_at(&with_body(&open), &snap, t0).unwrap();
    s.finish_at(&d, Some(503), t0);
    assert!(s.sessions().is_empty());
    let d = s.pick_at(&with_body(&open), &snap, t0).unwrap();
    s.finish_at(&d, None, t0);
    assert!(
        s.sessions().is_empty(),
        "a stream that ended early does not bind"
    );
    let d = s.pick_at(&with_body(&open), &snap, t0).unwrap();
    s.finish_at(&d, Some(200), t0);
    assert_eq!(s.maintain(&snap, t0 + Duration::from_secs(59)), 0);
    assert_eq!(s.maintain(&snap, t0 + Duration::from_secs(61)), 1);
    assert!(s.sessions().is_empty());
}

#[test]
fn gone_worker_is_repicked_and_counted() {
    let s = Scheduler::default();
    let t = both(3);
    let t0 = Instant::now();
    let open = session("s3", Some("open"), "x");
    let d = s.pick_at(&with_body(&open), &t.snapshot(), t0).unwrap();
    s.finish_at(&d, Some(200), t0);
    let gone = d.decode.endpoint().address;
    let rest: Vec<Endpoint> = t
        .snapshot()
        .endpoints
        .iter()
        .filter(|e| e.endpoint.address != gone)
        .map(|e| e.endpoint.clone())
        .collect();
    t.replace(rest);
    let turn = session("s3", None, "y");
    let d2 = s.pick_at(&with_body(&turn), &t.snapshot(), t0).unwrap();
    assert_ne!(d2.decode.endpoint().address, gone);
    assert_eq!(s.stats().session_repicks.load(Ordering::Relaxed), 1);
    s.finish_at(&d2, Some(200), t0);
    assert_eq!(s.sessions().get("s3", t0), Some(d2.decode.key()));
}

/// A session turn with its own `timeout`, or none.
fn turn_with(id: &str, action: Option<&str>, timeout: Option<u64>, text: &str) -> InferenceRequest {
    let mut sc = serde_json::json!({"session_id": id});
    if let Some(a) = action {
        sc["action"] = a.into();
    }
    if let Some(t) = timeout {
        sc["timeout"] = t.into();
    }
    body(
        &serde_json::json!({"model": "m", "prompt": text, "nvext": {"session_control": sc}})
            .to_string(),
    )
}

#[test]
fn middle_turn_without_timeout_keeps_the_open_timeout() {
    let s = Scheduler::default();
    let t = both(8);
    let snap = t.snapshot();
    let t0 = Instant::now();
    let open = turn_with("agent", Some("open"), Some(3600), "plan");
    let d = s.pick_at(&with_body(&open), &snap, t0).unwrap();
    let home = d.decode.key();
    s.finish_at(&d, Some(200), t0);
    // A middle turn without `timeout`, then one with another timeout: neither
    // changes the session's 3600 s.
    let mut at = t0 + Duration::from_secs(10);
    for timeout in [None, Some(5)] {
        let mid = turn_with("agent", None, timeout, "tool call");
        let d = s.pick_at(&with_body(&mid), &snap, at).unwrap();
        assert_eq!(d.decode.key(), home);
        s.finish_at(&d, Some(200), at);
        assert_eq!(
            s.sessions().binding("agent").unwrap().timeout,
            Duration::from_secs(3600)
        );
        at += Duration::from_secs(10);
    }
    // A ten-minute pause on a tool call keeps the worker.
    at += Duration::from_secs(600);
    assert_eq!(s.maintain(&snap, at), 0);
    let next = turn_with("agent", None, None, "after the tool");
    let d = s.pick_at(&with_body(&next), &snap, at).unwrap();
    assert_eq!(d.decode.key(), home);
    assert!(!d.session.as_ref().unwrap().rehomed);
}

#[test]
fn session_timeout_defaults_to_300_seconds() {
    let s = Scheduler::default();
    let t = both(2);
    let snap = t.snapshot();
    let t0 = Instant::now();
    let open = turn_with("d", Some("open"), None, "x");
    let d = s.pick_at(&with_body(&open), &snap, t0).unwrap();
    s.finish_at(&d, Some(200), t0);
    assert_eq!(
        s.sessions().binding("d").unwrap().timeout,
        Duration::from_secs(300)
    );
    assert_eq!(s.maintain(&snap, t0 + Duration::from_secs(299)), 0);
    assert_eq!(s.maintain(&snap, t0 + Duration::from_secs(301)), 1);
}

#[test]
fn huge_session_timeout_does_not_panic() {
    let s = Scheduler::default();
    let t = both(2);
    let snap = t.snapshot();
    let t0 = Instant::now();
    // The parser answers 400 to such a timeout; the scheduler must not panic
    // on one anyway (a body built by other code, a replica with other limits).
    let huge = |id: &str, action: Option<&str>| {
        let mut b = turn_with(id, action, Some(60), "x");
        if let Some(sc) = b.nvext.session_control.as_mut() {
            sc.timeout = Some(u64::MAX);
        }
        b
    };
    for action in [Some("open"), None, None, Some("close")] {
        let turn = huge("big", action);
        let d = s.pick_at(&with_body(&turn), &snap, t0).unwrap();
        assert!(s.response_headers(&d).is_some() || action == Some("close"));
        s.finish_at(&d, Some(200), t0);
        s.maintain(&snap, t0);
    }
    let open = huge("big2", Some("open"));
    let d = s.pick_at(&with_body(&open), &snap, t0).unwrap();
    s.finish_at(&d, Some(200), t0);
    let held = s.sessions().binding("big2").unwrap();
    assert_eq!(held.timeout, crate::sessions::MAX_TIMEOUT, "clamped");
    assert_eq!(
        s.maintain(
            &snap,
            t0 + crate::sessions::MAX_TIMEOUT + Duration::from_secs(1)
        ),
        1,
        "a clamped session is reaped"
    );
}

#[test]
fn close_on_a_dropped_stream_unbinds() {
    let s = Scheduler::default();
    let t = both(2);
    let snap = t.snapshot();
    let t0 = Instant::now();
    let open = turn_with("c", Some("open"), None, "x");
    let d = s.pick_at(&with_body(&open), &snap, t0).unwrap();
    s.finish_at(&d, Some(200), t0);
    let close = turn_with("c", Some("close"), None, "y");
    let d = s.pick_at(&with_body(&close), &snap, t0).unwrap();
    // The client went away before any response: the close still unbinds (the
    // sidecar closes the engine session when the request is dropped).
    s.finish_at(&d, None, t0);
    assert!(s.sessions().is_empty());
    assert_eq!(d.decode.booked_blocks(), 0);
}

#[test]
fn gone_worker_rehomes_the_session_as_an_open_with_its_timeout() {
    let s = Scheduler::default();
    let t = both(3);
    let t0 = Instant::now();
    let open = turn_with("r", Some("open"), Some(1200), "x");
    let d = s.pick_at(&with_body(&open), &t.snapshot(), t0).unwrap();
    assert!(!d.session.as_ref().unwrap().rehomed);
    s.finish_at(&d, Some(200), t0);
    let gone = d.decode.endpoint().address;
    t.replace(
        t.snapshot()
            .endpoints
            .iter()
            .filter(|e| e.endpoint.address != gone)
            .map(|e| e.endpoint.clone())
            .collect(),
    );
    let mid = turn_with("r", None, None, "y");
    let d2 = s.pick_at(&with_body(&mid), &t.snapshot(), t0).unwrap();
    let turn = d2.session.clone().unwrap();
    assert!(turn.rehomed, "forwarded as an open");
    assert_eq!(turn.timeout, Duration::from_secs(1200));
    assert_eq!(s.stats().session_rehomes.load(Ordering::Relaxed), 1);
    s.finish_at(&d2, Some(200), t0);
    // The following turns stick to the new worker, not re-homed again.
    for i in 0..5 {
        let next = turn_with("r", None, None, &format!("z{i}"));
        let d3 = s.pick_at(&with_body(&next), &t.snapshot(), t0).unwrap();
        assert_eq!(d3.decode.key(), d2.decode.key());
        assert!(!d3.session.as_ref().unwrap().rehomed);
        s.finish_at(&d3, Some(200), t0);
    }
    assert_eq!(
        s.sessions().binding("r").unwrap().timeout,
        Duration::from_secs(1200)
    );
    assert_eq!(s.stats().session_rehomes.load(Ordering::Relaxed), 1);
}

#[test]
fn disaggregated_session_pins_the_prefill_rank() {
    let s = Scheduler::default();
    let t = table(&[
        ("10.0.1.1:80", 2, Role::Prefill),
        ("10.0.1.2:80", 2, Role::Prefill),
        ("10.0.2.1:80", 1, Role::Decode),
        ("10.0.2.2:80", 1, Role::Decode),
    ]);
    let snap = t.snapshot();
    let t0 = Instant::now();
    let open = turn_with("pd", Some("open"), None, "first");
    let d = s.pick_at(&with_body(&open), &snap, t0).unwrap();
    let prefill = d.prefill.as_ref().unwrap().key();
    s.finish_at(&d, Some(200), t0);
    // Unrelated prompts and load on the pinned prefill rank do not move it.
    let mut held = Vec::new();
    for i in 0..20 {
        let mid = turn_with(
            "pd",
            None,
            None,
            &format!("turn {i} {}", "q".repeat(i * 64)),
        );
        let d2 = s.pick_at(&with_body(&mid), &snap, t0).unwrap();
        assert_eq!(d2.decode.key(), d.decode.key());
        assert_eq!(d2.prefill.as_ref().unwrap().key(), prefill);
        held.push(d2);
    }
    for d2 in &held {
        s.finish_at(d2, Some(200), t0);
    }
    assert_eq!(s.sessions().binding("pd").unwrap().prefill, Some(prefill));
}

#[test]
fn signed_token_moves_sessions_between_replicas() {
    let key = b"shared secret".to_vec();
    let cfg = || SchedulerConfig {
        session_key: key.clone(),
        ..Default::default()
    };
    let (a, b) = (Scheduler::new(cfg()), Scheduler::new(cfg()));
    let stranger = Scheduler::default(); // other key
    let t = both(8);
    let snap = t.snapshot();
    let open = session("s4", Some("open"), "x");
    let d = a.pick(&with_body(&open), &snap).unwrap();
    a.finish(&d, Some(200));
    let headers = a.response_headers(&d).unwrap();
    assert_eq!(headers[0].0, "x-kvpick-session");
    let token = headers[0].1.clone();
    let turn = session("s4", None, "y");
    let req = PickRequest {
        body: Some(&turn),
        session_token: Some(&token),
        ..Default::default()
    };
    for _ in 0..5 {
        let d2 = b.pick(&req, &snap).unwrap();
        assert_eq!(d2.decode.key(), d.decode.key());
        b.finish(&d2, Some(200));
    }
    // A replica with another key, or a token for another session, ignores it.
    let other = session("s5", None, "y");
    let picks: HashSet<_> = (0..30)
        .map(|_| {
            let d3 = stranger.pick(&req, &snap).unwrap();
            stranger.finish(&d3, None);
            let mismatched = PickRequest {
                body: Some(&other),
                session_token: Some(&token),
                ..Default::default()
            };
            let d4 = b.pick(&mismatched, &snap).unwrap();
            b.finish(&d4, None);
            (d3.decode.key(), d4.decode.key())
        })
        .collect();
    assert!(picks.iter().map(|p| p.0).collect::<HashSet<_>>().len() > 1);
    assert!(picks.iter().map(|p| p.1).collect::<HashSet<_>>().len() > 1);
}

#[test]
fn header_session_id_sticks() {
    let s = Scheduler::default();
    let t = both(8);
    let snap = t.snapshot();
    let req = PickRequest {
        session_id: Some("hdr"),
        ..Default::default()
    };
    let d = s.pick(&req, &snap).unwrap();
    s.finish(&d, Some(200));
    for _ in 0..5 {
        let d2 = s.pick(&req, &snap).unwrap();
        assert_eq!(d2.decode.key(), d.decode.key());
        s.finish(&d2, Some(200));
    }
}
