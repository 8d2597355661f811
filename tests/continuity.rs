//! Service continuity (SPEC 17): one team's broken, hung or deleted servers and a stalled API server do not hold up
//! the passes of anyone else's healthy policies. Each scenario runs one operator over all namespaces but only this
//! run's policies (a label selector), measures from outside (kubectl, redis) how soon healthy policies are Ready
//! and their waiting poison entries dead-lettered, and checks the ledgers: every poison entry dead-lettered exactly
//! once.

#[macro_use]
mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::*;
use futures::{StreamExt, TryStreamExt};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use pelican::api::ConsumerGroupPolicy;
use serde_json::json;

const LABEL: &str = "continuity.pelican.io/run";
const HOLD: &str = "continuity.pelican.io/hold";

async fn client() -> kube::Client {
    let config = kube::Config::from_custom_kubeconfig(
        kube::config::Kubeconfig::read_from(bed().kubeconfig()).unwrap(),
        &Default::default(),
    )
    .await
    .unwrap();
    kube::Client::try_from(config).unwrap()
}

/// A policy of this run as JSON: `url`'s server, stream `stream`, one delivery allowed, passes every second.
fn manifest(run: &str, name: &str, url: &str, stream: &str, extra: serde_json::Value) -> ConsumerGroupPolicy {
    let mut policy = json!({
        "apiVersion": "pelican.io/v1alpha1",
        "kind": "ConsumerGroupPolicy",
        "metadata": {"name": name, "labels": {LABEL: run}},
        "spec": {
            "redis": {"url": url}, "stream": stream, "group": "g", "startId": "0",
            "reclaim": {"interval": "1s", "minIdle": "1s"}, "retry": {"maxDeliveries": 1},
            "deadLetter": {"stream": format!("{stream}:dlq")},
        },
    });
    merge(&mut policy, extra);
    serde_json::from_value(policy).unwrap()
}

fn merge(into: &mut serde_json::Value, from: serde_json::Value) {
    match (into, from) {
        (serde_json::Value::Object(into), serde_json::Value::Object(from)) => {
            for (key, value) in from {
                merge(into.entry(key).or_insert(serde_json::Value::Null), value);
            }
        }
        (into, from) => *into = from,
    }
}

/// Creates the policies, 16 requests at a time.
async fn create(namespace: &str, policies: Vec<ConsumerGroupPolicy>) {
    let api: Api<ConsumerGroupPolicy> = Api::namespaced(client().await, namespace);
    futures::stream::iter(policies)
        .map(|p| {
            let api = api.clone();
            async move { api.create(&PostParams::default(), &p).await.map(|_| ()) }
        })
        .buffer_unordered(16)
        .try_collect::<Vec<_>>()
        .await
        .unwrap();
}

/// `count` policies in `namespace` whose servers are gone (closed loopback ports, `count / 20` of them).
fn gone(run: &str, prefix: &str, count: usize, extra: serde_json::Value) -> Vec<ConsumerGroupPolicy> {
    let ports: Vec<u16> = (0..count.div_ceil(20)).map(|_| free_port()).collect();
    (0..count)
        .map(|i| {
            let url = format!("redis://127.0.0.1:{}/0", ports[i % ports.len()]);
            manifest(run, &format!("{prefix}-{i}"), &url, &format!("s{i}"), extra.clone())
        })
        .collect()
}

/// Healthy policies `ok-<i>` on one server, each with a poison entry waiting: delivered once, never acknowledged.
struct Healthy {
    server: Server,
    namespace: String,
    count: usize,
    poisoned: usize,
}

impl Healthy {
    fn create(run: &str, count: usize) -> Healthy {
        let server = Server::start(Flavor::Redis);
        let namespace = namespace("healthy");
        let policies =
            (0..count).map(|i| manifest(run, &format!("ok-{i}"), &server.url(), &format!("s{i}"), json!({})));
        runtime().block_on(create(&namespace, policies.collect()));
        let mut healthy = Healthy { server, namespace, count, poisoned: 0 };
        healthy.poison();
        healthy
    }

    /// One more poison entry on every stream.
    fn poison(&mut self) {
        let mut conn = self.server.conn();
        for i in 0..self.count {
            let stream = format!("s{i}");
            let _: redis::Value = redis::cmd("XGROUP")
                .arg("CREATE")
                .arg(&stream)
                .arg("g")
                .arg("0")
                .arg("MKSTREAM")
                .query(&mut conn)
                .unwrap_or(redis::Value::Nil);
            let _: String =
                redis::cmd("XADD").arg(&stream).arg("*").arg("n").arg(self.poisoned).query(&mut conn).unwrap();
            assert_eq!(read_new(&mut conn, &stream, "g", "w", 10).len(), 1);
        }
        self.poisoned += 1;
    }

    /// Waits until every policy is Ready; how long that took since `since`.
    fn ready(&self, since: Instant, timeout: Duration) -> Duration {
        wait_all_ready(&self.namespace, self.count, timeout);
        since.elapsed()
    }

    /// Waits until every poison entry so far is dead-lettered; how long since `since`. Then checks the ledger.
    fn dead_lettered(&self, since: Instant, timeout: Duration) -> Duration {
        let mut conn = self.server.conn();
        let mut took = Duration::ZERO;
        for i in 0..self.count {
            let dlq = format!("s{i}:dlq");
            wait_for(&format!("{} poison entries of s{i} dead-lettered", self.poisoned), timeout, || {
                let len: usize = redis::cmd("XLEN").arg(&dlq).query(&mut conn).unwrap();
                if len >= self.poisoned { Ok(()) } else { Err(format!("{len} dead-lettered")) }
            });
            took = took.max(since.elapsed());
        }
        for i in 0..self.count {
            let (dead, open) = failover_ledger(&mut conn, &format!("s{i}"), &format!("s{i}:dlq"), "g");
            assert_eq!((dead, open), (self.poisoned, 0), "s{i}: each poison entry dead-lettered exactly once");
        }
        took
    }
}

/// The operator over all namespaces, for this run's policies only.
fn operator(run: &str) -> Operator {
    let selector = format!("{LABEL}={run}");
    Operator::launch(&["--watch-label-selector", &selector, "--log-format", "json"], bed().kubeconfig())
}

fn run_id() -> String {
    namespace("run").trim_start_matches("run-").to_string()
}

/// What a run leaves: its policies are deleted and the finalizers that held some of them released, so that later
/// operators watching all namespaces (the node tests') do not meet them.
struct Leftovers(Vec<String>);

impl Drop for Leftovers {
    fn drop(&mut self) {
        runtime().block_on(async {
            for namespace in &self.0 {
                let api: Api<ConsumerGroupPolicy> = Api::namespaced(client().await, namespace);
                let _ = api.delete_collection(&DeleteParams::default(), &ListParams::default()).await;
                let names: Vec<String> = match api.list_metadata(&ListParams::default()).await {
                    Ok(list) => list.items.into_iter().filter_map(|p| p.metadata.name).collect(),
                    Err(_) => continue,
                };
                let release = json!({"metadata": {"finalizers": null}});
                futures::stream::iter(names)
                    .for_each_concurrent(16, |name| {
                        let (api, release) = (api.clone(), release.clone());
                        async move {
                            let _ = api.patch(&name, &PatchParams::default(), &Patch::Merge(&release)).await;
                        }
                    })
                    .await;
            }
        });
    }
}

/// 2,000 policies on servers that are gone, 1,000 of them deleted in a namespace being deleted, and three healthy
/// policies: at a start the healthy ones are Ready, and their poison entries dead-lettered, within 10 s; the
/// broken ones all say why, and the deleted ones let go of Pelican's finalizer; after a restart the next poison
/// entries are dead-lettered within 10 s too.
#[test]
fn healthy_policies_keep_their_pace_beside_two_thousand_broken_ones() {
    let run = run_id();
    let (broken, dying) = (namespace("broken"), namespace("dying"));
    let _leftovers = Leftovers(vec![broken.clone(), dying.clone()]);
    let start = Instant::now();
    runtime().block_on(async {
        create(&broken, gone(&run, "gone", 1000, json!({}))).await;
        let held =
            json!({"metadata": {"finalizers": ["pelican.io/cleanup", HOLD]}, "spec": {"deletionPolicy": "Delete"}});
        create(&dying, gone(&run, "dying", 1000, held)).await;
        let api: Api<ConsumerGroupPolicy> = Api::namespaced(client().await, &dying);
        api.delete_collection(&DeleteParams::default(), &ListParams::default()).await.unwrap();
    });
    kubectl_ok(&["delete", "namespace", &dying, "--wait=false"]);
    eprintln!("2,000 broken policies created in {:?}", start.elapsed());
    let mut healthy = Healthy::create(&run, 3);

    let started = Instant::now();
    let mut first = operator(&run);
    let ready = healthy.ready(started, Duration::from_secs(60));
    let dead = healthy.dead_lettered(started, Duration::from_secs(60));
    eprintln!("start beside 2,000 broken policies: healthy Ready after {ready:?}, poison dead-lettered after {dead:?}");
    let path = "jsonpath={.items[*].status.conditions[?(@.type==\"Ready\")].reason}";
    let said = wait_for("every broken policy to say why", Duration::from_secs(120), || {
        let reasons = kubectl_ok(&["get", "cgp", "-n", &broken, "-o", path]);
        let unavailable = reasons.split_whitespace().filter(|r| *r == "RedisUnavailable").count();
        if unavailable == 1000 {
            Ok(started.elapsed())
        } else {
            Err(format!("{unavailable} of 1000 say RedisUnavailable"))
        }
    });
    let released = wait_for("the deleted policies to let go of Pelican's finalizer", Duration::from_secs(120), || {
        let finalizers = kubectl_ok(&["get", "cgp", "-n", &dying, "-o", "jsonpath={.items[*].metadata.finalizers}"]);
        let holding = finalizers.matches("pelican.io/cleanup").count();
        if holding == 0 { Ok(started.elapsed()) } else { Err(format!("{holding} still hold it")) }
    });
    eprintln!("every broken policy said why after {said:?}; the deleted ones were released after {released:?}");
    first.kill9();

    healthy.poison();
    let restarted = Instant::now();
    let _second = operator(&run);
    let again = healthy.dead_lettered(restarted, Duration::from_secs(60));
    eprintln!("restart beside 2,000 broken policies: the next poison entries dead-lettered after {again:?}");
    assert!(ready <= Duration::from_secs(10), "healthy policies Ready after {ready:?}, more than 10 s");
    assert!(dead <= Duration::from_secs(10), "poison dead-lettered after {dead:?}, more than 10 s");
    assert!(again <= Duration::from_secs(10), "after a restart, poison dead-lettered after {again:?}, more than 10 s");
}

/// Servers that accept connections and never answer (the process is wedged, a firewall holds the packets).
struct Hung {
    ports: Vec<u16>,
    _stop: Arc<AtomicBool>,
}

impl Hung {
    fn start(count: usize) -> Hung {
        let stop = Arc::new(AtomicBool::new(false));
        let ports = (0..count)
            .map(|_| {
                let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
                let port = listener.local_addr().unwrap().port();
                let stop = stop.clone();
                std::thread::spawn(move || {
                    let mut held = vec![];
                    for connection in listener.incoming() {
                        if stop.load(Ordering::Relaxed) {
                            return;
                        }
                        held.push(connection);
                    }
                });
                port
            })
            .collect();
        Hung { ports, _stop: stop }
    }
}

/// 200 policies on 20 servers that accept connections and never answer: healthy policies beside them dead-letter
/// their poison entries after a restart within max(3x the time without them, that time + 10 s).
#[test]
fn hung_neighbours_cost_their_own_policies_only() {
    let run = run_id();
    let mut healthy = Healthy::create(&run, 3);
    let started = Instant::now();
    let mut alone = operator(&run);
    let without = healthy.dead_lettered(started, Duration::from_secs(60));
    alone.kill9();

    let hung = Hung::start(20);
    let neighbours = namespace("hung");
    let _leftovers = Leftovers(vec![neighbours.clone()]);
    let policies = (0..200)
        .map(|i| {
            let url = format!("redis://127.0.0.1:{}/0", hung.ports[i % hung.ports.len()]);
            manifest(&run, &format!("hung-{i}"), &url, &format!("s{i}"), json!({}))
        })
        .collect();
    runtime().block_on(create(&neighbours, policies));
    healthy.poison();
    let restarted = Instant::now();
    let operator = operator(&run);
    let beside = healthy.dead_lettered(restarted, Duration::from_secs(60));
    eprintln!("poison dead-lettered after a start: {without:?} alone, {beside:?} beside 200 hung neighbours");
    let bound = (without * 3).max(without + Duration::from_secs(10));
    assert!(beside <= bound, "beside hung neighbours {beside:?}, more than {bound:?}");
    let path = "jsonpath={.items[*].status.conditions[?(@.type==\"Ready\")].reason}";
    wait_for("the hung neighbours to say they are unavailable", Duration::from_secs(90), || {
        let reasons = kubectl_ok(&["get", "cgp", "-n", &neighbours, "-o", path]);
        let unavailable = reasons.split_whitespace().filter(|r| *r == "RedisUnavailable").count();
        if unavailable == 200 { Ok(()) } else { Err(format!("{unavailable} of 200 say RedisUnavailable")) }
    });
    let metrics = operator.metrics();
    assert!(metrics.contains("pelican_reconciles_in_flight{age=\"<1s\"}"), "{metrics}");
}

/// A TCP proxy in front of the API server that can stall: bytes stay where they are until it resumes, as they do
/// while the API server is SIGSTOPped.
struct StallProxy {
    port: u16,
    stalled: Arc<AtomicBool>,
}

impl StallProxy {
    fn start(upstream: String) -> StallProxy {
        use std::io::{Read, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let stalled = Arc::new(AtomicBool::new(false));
        let gate = stalled.clone();
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { continue };
                let Ok(server) = std::net::TcpStream::connect(&upstream) else { continue };
                for (mut from, mut to) in [(client.try_clone().unwrap(), server.try_clone().unwrap()), (server, client)]
                {
                    let gate = gate.clone();
                    std::thread::spawn(move || {
                        let mut buffer = [0u8; 16384];
                        loop {
                            let n = match from.read(&mut buffer) {
                                Ok(0) | Err(_) => break,
                                Ok(n) => n,
                            };
                            while gate.load(Ordering::Relaxed) {
                                std::thread::sleep(Duration::from_millis(20));
                            }
                            if to.write_all(&buffer[..n]).is_err() {
                                break;
                            }
                        }
                        let _ = to.shutdown(std::net::Shutdown::Both);
                    });
                }
            }
        });
        StallProxy { port, stalled }
    }
}

/// The API server stalls for 30 s (past the 15 s lease): the operator stops, says so and exits (its `/healthz`
/// fails if it cannot); restarted like a kubelet would, it leads again once the API server is back and passes
/// resume within 30 s of its return; every poison entry is dead-lettered exactly once.
#[test]
fn after_the_api_server_stalls_the_operator_exits_and_its_restart_resumes_passes() {
    let run = run_id();
    let healthy = Healthy::create(&run, 1);
    let kubeconfig_text = std::fs::read_to_string(bed().kubeconfig()).unwrap();
    let upstream = kubeconfig_text.lines().find_map(|l| l.trim().strip_prefix("server: https://")).unwrap().to_string();
    let proxy = StallProxy::start(upstream.clone());
    let dir = tempfile::tempdir().unwrap();
    let through_proxy = dir.path().join("kubeconfig");
    std::fs::write(&through_proxy, kubeconfig_text.replace(&upstream, &format!("127.0.0.1:{}", proxy.port))).unwrap();
    let selector = format!("{LABEL}={run}");
    let args = ["--watch-label-selector", selector.as_str(), "--log-format", "json"];
    let launch = || Operator::launch(&args, through_proxy.to_str().unwrap());
    let mut first = launch();
    healthy.dead_lettered(Instant::now(), Duration::from_secs(60));

    // A producer whose every message a consumer takes and never acknowledges: each is dead-lettered after 1 s.
    let stop = Arc::new(AtomicBool::new(false));
    let producer = {
        let (stop, mut conn) = (stop.clone(), healthy.server.conn());
        std::thread::spawn(move || {
            let mut added = vec![];
            let mut n = 1;
            while !stop.load(Ordering::Relaxed) {
                let id: String = redis::cmd("XADD").arg("s0").arg("*").arg("n").arg(n).query(&mut conn).unwrap();
                read_new(&mut conn, "s0", "g", "w", 100);
                added.push((Instant::now(), id));
                n += 1;
                std::thread::sleep(Duration::from_millis(200));
            }
            added
        })
    };
    std::thread::sleep(Duration::from_secs(3));
    proxy.stalled.store(true, Ordering::Relaxed);
    let stalled_at = Instant::now();
    let exited = wait_for("the operator to exit once its lease ran out", Duration::from_secs(40), || {
        if first.is_running() { Err("still running".into()) } else { Ok(stalled_at.elapsed()) }
    });
    assert!(first.logs().contains("leadership ended; exiting"), "{}", first.logs());
    eprintln!("the operator exited {exited:?} after the API server stalled");
    // The kubelet's restart: the new process waits for the API server like anyone else.
    let second = launch();
    std::thread::sleep(Duration::from_secs(30).saturating_sub(stalled_at.elapsed()));
    proxy.stalled.store(false, Ordering::Relaxed);
    let back = Instant::now();
    let back_ms = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis();
    let mut conn = healthy.server.conn();
    let resumed = wait_for("a pass after the API server's return", Duration::from_secs(60), || {
        // A dead-letter entry written after the return (its id is the server's clock when it was written).
        let dead: Vec<(String, Vec<Vec<u8>>)> =
            redis::cmd("XREVRANGE").arg("s0:dlq").arg("+").arg("-").arg("COUNT").arg(1).query(&mut conn).unwrap();
        let newest = dead.first().and_then(|(id, _)| id.split_once('-').map(|(ms, _)| ms.parse::<u128>().unwrap()));
        match newest {
            Some(ms) if ms > back_ms => Ok(back.elapsed()),
            _ => Err("no dead-lettering since the return".into()),
        }
    });
    eprintln!("passes resumed {resumed:?} after the API server came back (stalled 30 s)");
    stop.store(true, Ordering::Relaxed);
    let added = producer.join().unwrap();
    wait_for("every message dead-lettered", Duration::from_secs(30), || {
        let len: usize = redis::cmd("XLEN").arg("s0:dlq").query(&mut conn).unwrap();
        if len == added.len() + 1 { Ok(()) } else { Err(format!("{len} of {}", added.len() + 1)) }
    });
    let (dead, open) = failover_ledger(&mut conn, "s0", "s0:dlq", "g");
    assert_eq!((dead, open), (added.len() + 1, 0), "each message dead-lettered exactly once");
    assert!(exited <= Duration::from_secs(25), "the operator exited {exited:?} after the stall, past its lease");
    assert!(resumed <= Duration::from_secs(30), "passes resumed {resumed:?} after the API server's return");
    drop(second);
}

/// Sends a signal to a test server's process (`STOP`, `CONT`).
fn signal(server: &Server, name: &str) {
    let pid = server.child.as_ref().unwrap().id().to_string();
    assert!(std::process::Command::new("kill").args([&format!("-{name}"), &pid]).status().unwrap().success());
}

/// A Redis SIGSTOPped for 40 s: another server's policy keeps its dead-lettering latency throughout; the stopped
/// server's own policies say Ready False `RedisUnavailable` within 30 s and are Ready again within 30 s of SIGCONT.
#[test]
fn a_stopped_server_costs_its_own_policies_only() {
    let run = run_id();
    let other = Healthy::create(&run, 1);
    let stopped = Server::start(Flavor::Redis);
    let own = namespace("stopped");
    let policies = (0..5).map(|i| manifest(&run, &format!("st-{i}"), &stopped.url(), &format!("s{i}"), json!({})));
    runtime().block_on(create(&own, policies.collect()));
    let _operator = operator(&run);
    wait_all_ready(&own, 5, Duration::from_secs(60));
    other.dead_lettered(Instant::now(), Duration::from_secs(60));

    // On the other server: a message every 200 ms that a consumer takes and never acknowledges, and a watcher that
    // notes when each one shows up in the dead-letter stream.
    let stop = Arc::new(AtomicBool::new(false));
    let produced = Arc::new(std::sync::Mutex::new(std::collections::HashMap::<String, Instant>::new()));
    let producer = {
        let (stop, produced, mut conn) = (stop.clone(), produced.clone(), other.server.conn());
        std::thread::spawn(move || {
            let mut n = 1;
            while !stop.load(Ordering::Relaxed) {
                let _: String = redis::cmd("XADD").arg("s0").arg("*").arg("n").arg(n).query(&mut conn).unwrap();
                produced.lock().unwrap().insert(n.to_string(), Instant::now());
                read_new(&mut conn, "s0", "g", "w", 100);
                n += 1;
                std::thread::sleep(Duration::from_millis(200));
            }
        })
    };
    let watcher = {
        let (stop, mut conn) = (stop.clone(), other.server.conn());
        std::thread::spawn(move || {
            let (mut seen, mut after) = (std::collections::HashMap::<String, Instant>::new(), "-".to_string());
            while !stop.load(Ordering::Relaxed) {
                let entries: Vec<(String, Vec<Vec<u8>>)> =
                    redis::cmd("XRANGE").arg("s0:dlq").arg(&after).arg("+").query(&mut conn).unwrap();
                for (id, flat) in entries {
                    if let Some(pair) = flat.chunks(2).find(|p| p[0] == b"n") {
                        seen.entry(String::from_utf8_lossy(&pair[1]).into_owned()).or_insert_with(Instant::now);
                    }
                    after = format!("({id}");
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            seen
        })
    };
    std::thread::sleep(Duration::from_secs(10));
    signal(&stopped, "STOP");
    let stopped_at = Instant::now();
    let path = "jsonpath={.items[*].status.conditions[?(@.type==\"Ready\")].reason}";
    let unavailable = wait_for("the stopped server's policies to say so", Duration::from_secs(60), || {
        let reasons = kubectl_ok(&["get", "cgp", "-n", &own, "-o", path]);
        let count = reasons.split_whitespace().filter(|r| *r == "RedisUnavailable").count();
        if count == 5 { Ok(stopped_at.elapsed()) } else { Err(format!("{count} of 5 say RedisUnavailable")) }
    });
    std::thread::sleep(Duration::from_secs(40).saturating_sub(stopped_at.elapsed()));
    signal(&stopped, "CONT");
    let continued_at = Instant::now();
    wait_all_ready(&own, 5, Duration::from_secs(60));
    let recovered = continued_at.elapsed();
    std::thread::sleep(Duration::from_secs(3));
    stop.store(true, Ordering::Relaxed);
    producer.join().unwrap();
    let seen = watcher.join().unwrap();

    let produced = produced.lock().unwrap();
    let latency = |from: Instant, to: Instant| {
        let window = produced.iter().filter(|(_, at)| **at >= from && **at < to);
        let latencies: Vec<Duration> =
            window.map(|(n, at)| seen.get(n).map_or(Duration::MAX, |s| s.duration_since(*at))).collect();
        (latencies.len(), latencies.into_iter().max().unwrap_or_default())
    };
    let (before_count, before) = latency(stopped_at - Duration::from_secs(10), stopped_at);
    let (during_count, during) = latency(stopped_at, continued_at);
    eprintln!(
        "the other server's dead-lettering latency: at most {before:?} over {before_count} messages before the stop, \
         {during:?} over {during_count} while the server was stopped; the stopped server's policies said \
         RedisUnavailable {unavailable:?} after the stop and were Ready {recovered:?} after SIGCONT"
    );
    let mut conn = other.server.conn();
    wait_for("every message dead-lettered", Duration::from_secs(30), || {
        let (dead, open) = failover_ledger(&mut conn, "s0", "s0:dlq", "g");
        if open == 0 { Ok(dead) } else { Err(format!("{open} not yet")) }
    });
    assert!(during <= before + Duration::from_secs(2), "latency {during:?} while another server was stopped");
    assert!(unavailable <= Duration::from_secs(30), "RedisUnavailable only {unavailable:?} after the stop");
    assert!(recovered <= Duration::from_secs(30), "Ready again only {recovered:?} after SIGCONT");
}
