//! Active-active replicas against a real `redis-server`: turns of
//! one conversation sent to alternating replicas stay on the conversation's
//! worker as with one replica; peers see each other's in-flight load; a sync
//! server killed mid-run fails no request and the replicas converge once it is
//! back; a restarted replica loads the shared state before it is Ready; with
//! the server killed, three alternating replicas still keep a conversation on
//! its worker without unbalancing the workers; standalone replicas started
//! from their flags with the endpoints file at different paths find each
//! other by pool name, given or the default.
//!
//! Skipped (with a message) when `redis-server` is not installed, unless
//! `KVPICK_REQUIRE_SYNC_SERVER=1` (CI), which makes that a failure.

use std::path::Path;
use std::time::{Duration, Instant};

use e2e::client::Client;
use e2e::mock_worker::WorkerConfig;
use e2e::replicas::{RedisServer, Replicas};
use e2e::workload::system_prompt;
use serde_json::{json, Value};

const WORKERS: usize = 4;
const CONVERSATIONS: usize = 40;
const TURNS: usize = 4;

fn worker() -> WorkerConfig {
    WorkerConfig {
        ttft: Duration::from_millis(2),
        prefill_per_token: Duration::from_micros(2),
        itl: Duration::from_micros(200),
        ..WorkerConfig::default()
    }
}

/// One conversation: its messages so far.
struct Conversation {
    id: usize,
    messages: Vec<Value>,
}

impl Conversation {
    fn new(id: usize) -> Self {
        Conversation {
            id,
            messages: vec![json!({"role": "system", "content": system_prompt(id, 300)})],
        }
    }

    /// Sends turn `turn` through `client`; returns whether it succeeded.
    async fn turn(&mut self, client: &Client, turn: usize) -> bool {
        self.messages.push(json!({
            "role": "user",
            "content": format!("Conversation {}, question {turn}: and then?", self.id),
        }));
        let body = json!({"model": "mock-model", "messages": self.messages, "max_tokens": 8});
        let rid = request_id(self.id, turn);
        let reply = client
            .post_json("/v1/chat/completions", &body, &[("x-request-id", &rid)])
            .await;
        match reply {
            Ok(r) if r.status.is_success() => {
                self.messages
                    .push(json!({"role": "assistant", "content": r.chat_text()}));
                true
            }
            _ => false,
        }
    }
}

fn request_id(conversation: usize, turn: usize) -> String {
    format!("conv-{conversation}-turn-{turn}")
}

/// `CONVERSATIONS` conversations with ids from `first`.
fn conversations(first: usize) -> Vec<Conversation> {
    (first..first + CONVERSATIONS)
        .map(Conversation::new)
        .collect()
}

/// Share of follow-up turns served by the worker of the conversation's previous turn.
fn same_worker_rate(r: &Replicas, first: usize) -> f64 {
    same_worker_rate_of(r, first..first + CONVERSATIONS)
}

/// Sends turns `turns` of every conversation, the conversations concurrently,
/// turn `t` of conversation `c` through the replica `replica(c, t)`. Returns
/// the failed requests.
async fn converse(
    r: &Replicas,
    convs: &mut [Conversation],
    turns: std::ops::Range<usize>,
    replica: impl Fn(usize, usize) -> usize,
) -> usize {
    let mut failed = 0;
    for t in turns {
        let sent = futures::future::join_all(convs.iter_mut().map(|c| {
            let client = r.client(replica(c.id, t));
            async move { c.turn(&client, t).await }
        }))
        .await;
        failed += sent.iter().filter(|ok| !**ok).count();
    }
    failed
}

/// [`same_worker_rate`] of the conversations `ids`.
fn same_worker_rate_of(r: &Replicas, ids: std::ops::Range<usize>) -> f64 {
    let (mut same, mut follow_ups) = (0, 0);
    for c in ids {
        for t in 1..TURNS {
            let prev = r.served_by(&request_id(c, t - 1));
            let this = r.served_by(&request_id(c, t));
            follow_ups += 1;
            if prev.is_some() && prev == this {
                same += 1;
            }
        }
    }
    same as f64 / follow_ups as f64
}

/// Waits until every replica reports the same load on every worker (and returns
/// how long it took), or panics after `within`.
async fn converged(r: &Replicas, within: Duration) -> Duration {
    let start = Instant::now();
    loop {
        let loads = r.loads();
        if loads.windows(2).all(|w| w[0] == w[1]) {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < within,
            "replicas did not converge within {within:?}: {loads:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn no_load(r: &Replicas, within: Duration) {
    let start = Instant::now();
    while r.loads().iter().flatten().any(|&l| l != (0, 0)) {
        assert!(
            start.elapsed() < within,
            "load left behind: {:?}",
            r.loads()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn alternating_replicas_keep_follow_ups_on_the_conversations_worker() {
    let Some(redis) = RedisServer::start().await else {
        return;
    };
    let one = Replicas::start(WORKERS, worker(), 1, None).await.unwrap();
    assert_eq!(
        converse(&one, &mut conversations(0), 0..TURNS, |_, _| 0).await,
        0
    );
    let baseline = same_worker_rate(&one, 0);

    let two = Replicas::start(WORKERS, worker(), 2, Some(&redis.url()))
        .await
        .unwrap();
    // Consecutive turns of each conversation go to alternating replicas.
    let alternate = |c: usize, t: usize| (c + t) % 2;
    assert_eq!(
        converse(&two, &mut conversations(0), 0..TURNS, alternate).await,
        0
    );
    let synced = same_worker_rate(&two, 0);
    eprintln!("same-worker rate of follow-ups: one replica {baseline:.2}, two synced replicas alternating {synced:.2}");
    assert!(
        synced >= 0.95 * baseline,
        "two synced replicas {synced:.2} < 0.95 x one replica {baseline:.2}"
    );
    // After the traffic stops both replicas report the same (no) in-flight load.
    no_load(&two, Duration::from_secs(5)).await;
    converged(&two, Duration::from_secs(1)).await;
}

/// Requests held on the workers (slow first token) while `check` runs.
async fn hold_requests(r: &Replicas, via: usize, n: usize) -> Vec<tokio::task::JoinHandle<bool>> {
    (0..n)
        .map(|i| {
            let client = r.client(via);
            tokio::spawn(async move {
                let mut c = Conversation::new(10_000 + i);
                c.turn(&client, 0).await
            })
        })
        .collect()
}

fn slow_worker() -> WorkerConfig {
    WorkerConfig {
        ttft: Duration::from_millis(1500),
        ..worker()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn peers_see_each_others_in_flight_load() {
    let Some(redis) = RedisServer::start().await else {
        return;
    };
    let r = Replicas::start(WORKERS, slow_worker(), 2, Some(&redis.url()))
        .await
        .unwrap();
    let held = hold_requests(&r, 0, 8).await;
    // Replica 0 books them as it routes; replica 1 hears of them while they run.
    let start = Instant::now();
    while r.loads()[0].iter().map(|l| l.1).sum::<u32>() < 8 {
        assert!(start.elapsed() < Duration::from_secs(1));
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let took = converged(&r, Duration::from_millis(500)).await;
    eprintln!("peer saw 8 in-flight requests after {took:?}");
    assert_eq!(r.loads()[1].iter().map(|l| l.1).sum::<u32>(), 8);
    for h in held {
        assert!(h.await.unwrap());
    }
    no_load(&r, Duration::from_secs(2)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_sync_server_killed_mid_run_fails_nothing_and_replicas_converge_after_restart() {
    let Some(mut redis) = RedisServer::start().await else {
        return;
    };
    let r = Replicas::start(WORKERS, worker(), 2, Some(&redis.url()))
        .await
        .unwrap();
    let alternate = |c: usize, t: usize| (c + t) % 2;
    let mut convs = conversations(0);
    let mut failed = converse(&r, &mut convs, 0..1, alternate).await;
    redis.kill();
    failed += converse(&r, &mut convs, 1..TURNS, alternate).await;
    assert_eq!(failed, 0, "requests failed while the sync server was down");
    for k in &r.kvpicks {
        let m = k.replica_sync().unwrap();
        assert!(m.peers.peers() <= 1);
    }
    // Load routed by replica 0 while the server is down is not seen by replica 1...
    let slow = Replicas::start(WORKERS, slow_worker(), 2, Some(&redis.url())).await;
    assert!(
        slow.is_ok(),
        "replicas become Ready even without their sync server"
    );
    let slow = slow.unwrap();
    let held = hold_requests(&slow, 0, 6).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_ne!(slow.loads()[0], slow.loads()[1]);
    // ...until the server is back: then they converge within 5 s.
    redis.restart().await;
    let took = converged(&slow, Duration::from_secs(5)).await;
    eprintln!("replicas converged {took:?} after the sync server restarted");
    assert_eq!(slow.loads()[1].iter().map(|l| l.1).sum::<u32>(), 6);
    for h in held {
        assert!(h.await.unwrap());
    }
    no_load(&slow, Duration::from_secs(3)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_restarted_replica_loads_the_shared_state_before_ready() {
    let Some(redis) = RedisServer::start().await else {
        return;
    };
    let mut r = Replicas::start(WORKERS, worker(), 2, Some(&redis.url()))
        .await
        .unwrap();
    // Replica 0 routes the first two turns; replica 1 restarts (empty state)
    // and takes the last two.
    let mut convs = conversations(0);
    assert_eq!(converse(&r, &mut convs, 0..2, |_, _| 0).await, 0);
    r.kvpicks[1].restart().await.unwrap();
    // Ready (restart returned) after replaying the stream, not at the bound.
    let m = &r.kvpicks[1].replica_sync().unwrap().metrics;
    assert!(
        m.warm_start_entries() > 0,
        "Ready before loading the shared state"
    );
    assert_eq!(m.warm_start_timeouts(), 0, "Ready only at the bound");
    assert_eq!(converse(&r, &mut convs, 2..TURNS, |_, _| 1).await, 0);
    // Its first decisions (turn 2 of each conversation) use the loaded state.
    let first = (0..CONVERSATIONS)
        .filter(|&c| {
            let prev = r.served_by(&request_id(c, 1));
            prev.is_some() && prev == r.served_by(&request_id(c, 2))
        })
        .count() as f64
        / CONVERSATIONS as f64;
    let rate = same_worker_rate(&r, 0);
    eprintln!("same-worker rate across a replica restart: first decisions {first:.2}, all follow-ups {rate:.2}");
    assert!(
        first >= 0.95,
        "restarted replica's first decisions ignored the shared state: {first:.2}"
    );
    assert!(
        rate >= 0.95,
        "restarted replica routed without the shared state: {rate:.2}"
    );
}

/// Conversations in the outage test: enough that the hash's spread of them
/// over the workers is even within the bound below.
const OUTAGE_CONVERSATIONS: usize = 160;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_the_sync_server_killed_alternating_replicas_still_agree_and_stay_balanced() {
    let Some(mut redis) = RedisServer::start().await else {
        return;
    };
    let r = Replicas::start(WORKERS, worker(), 3, Some(&redis.url()))
        .await
        .unwrap();
    redis.kill();
    // Every replica has seen its sync fail before the first turn.
    let start = Instant::now();
    while r
        .kvpicks
        .iter()
        .any(|k| k.replica_sync().unwrap().metrics.errors() == 0)
    {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "no replica noticed"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Consecutive turns of each conversation go to the next replica.
    let mut convs: Vec<_> = (0..OUTAGE_CONVERSATIONS).map(Conversation::new).collect();
    let failed = converse(&r, &mut convs, 0..TURNS, |c, t| (c + t) % 3).await;
    assert_eq!(failed, 0, "requests failed while the sync server was down");
    let rate = same_worker_rate_of(&r, 0..OUTAGE_CONVERSATIONS);
    let shares: Vec<usize> = r.workers.iter().map(|w| w.seen().requests.len()).collect();
    let (least, most) = (*shares.iter().min().unwrap(), *shares.iter().max().unwrap());
    eprintln!("sync server down, 3 replicas alternating: same-worker rate of follow-ups {rate:.2}, requests per worker {shares:?}");
    assert!(rate >= 0.8, "follow-ups left their worker: {rate:.2}");
    assert!(
        most as f64 <= 1.5 * least as f64,
        "unbalanced: requests per worker {shares:?}"
    );
}

/// Same-worker rate of follow-ups with one in-process replica.
async fn one_replica_rate() -> f64 {
    let one = Replicas::start(WORKERS, worker(), 1, None).await.unwrap();
    assert_eq!(
        converse(&one, &mut conversations(0), 0..TURNS, |_, _| 0).await,
        0
    );
    same_worker_rate(&one, 0)
}

/// Two replicas started from flags, synced through `redis`, each reading the
/// endpoints from a file at its own path, with `--pool-name pool` when given:
/// conversations alternate between them. Returns the same-worker rate of
/// follow-ups and each replica's metrics page.
async fn alternate_standalone(redis: &RedisServer, pool: Option<&str>) -> (f64, Vec<String>) {
    let url = redis.url();
    let flags = |_: usize, file: &Path| {
        let mut f = vec![
            "--secure-serving=false".to_string(),
            "--kv-events=false".to_string(),
            format!("--endpoints-file={}", file.display()),
            format!("--replica-sync={url}"),
        ];
        f.extend(pool.map(|p| format!("--pool-name={p}")));
        f
    };
    let two = Replicas::start_served(WORKERS, worker(), 2, flags)
        .await
        .unwrap();
    let alternate = |c: usize, t: usize| (c + t) % 2;
    assert_eq!(
        converse(&two, &mut conversations(0), 0..TURNS, alternate).await,
        0
    );
    let mut pages = Vec::new();
    for k in &two.served {
        let page = Client::new(k.metrics()).get("/metrics").await.unwrap();
        pages.push(page.text());
    }
    (same_worker_rate(&two, 0), pages)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn standalone_replicas_with_different_file_paths_and_one_pool_name_route_as_one() {
    let Some(redis) = RedisServer::start().await else {
        return;
    };
    let baseline = one_replica_rate().await;
    let (rate, pages) = alternate_standalone(&redis, Some("chat")).await;
    eprintln!("same-worker rate of follow-ups: one replica {baseline:.2}, two standalone replicas named `chat` alternating {rate:.2}");
    assert!(
        rate >= 0.95 * baseline,
        "replicas named alike {rate:.2} < 0.95 x one replica {baseline:.2}"
    );
    // The name labels the pool's metrics and keys the sync stream.
    for page in &pages {
        assert!(
            page.contains(r#"inference_pool_ready_pods{name="chat"} 4"#),
            "{page}"
        );
    }
    assert!(redis.has_key("kvpick:chat:sync"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn standalone_replicas_with_different_file_paths_and_no_pool_name_share_the_default_pool() {
    let Some(redis) = RedisServer::start().await else {
        return;
    };
    let baseline = one_replica_rate().await;
    let (rate, pages) = alternate_standalone(&redis, None).await;
    eprintln!("same-worker rate of follow-ups: one replica {baseline:.2}, two unnamed standalone replicas alternating {rate:.2}");
    assert!(
        rate >= 0.95 * baseline,
        "unnamed standalone replicas {rate:.2} < 0.95 x one replica {baseline:.2}"
    );
    for page in &pages {
        assert!(
            page.contains(&format!(
                r#"inference_pool_ready_pods{{name="{}"}} 4"#,
                kvpick::config::DEFAULT_STANDALONE_POOL
            )),
            "{page}"
        );
    }
}
