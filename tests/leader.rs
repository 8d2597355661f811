//! Two operator replicas with leader election on a real Lease: exactly one leads and writes; when it dies the
//! other takes over within the lease duration; the standby is ready all along.

#[macro_use]
mod common;

use std::time::{Duration, Instant};

use common::*;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::api::{Api, Patch, PatchParams};
use pelican::leader::{Elector, LEASE_DURATION_SECONDS, field_manager};

fn replica(ns: &str) -> Operator {
    Operator::start_with(ns, &["--leader-elect", "--leader-election-namespace", ns, "--log-format", "json"])
}

/// Whether the replica logged a line from the reconcile of policy `p` (its span names the policy).
fn reconciled(operator: &Operator) -> bool {
    operator.logs().contains("\"policy\":\"p\"")
}

#[test]
fn exactly_one_replica_leads_and_the_other_takes_over_when_it_dies() {
    let server = Server::start(Flavor::Redis);
    let ns = namespace("leader");
    let mut replicas = [replica(&ns), replica(&ns)];
    assert!(kubectl_apply(&ns, &policy("p", &server.url(), "s", "g", "")).0);
    wait_condition(&ns, "p", "Ready", "True", "Reconciled");

    let leader = wait_for("one replica to lead", Duration::from_secs(20), || {
        match replicas.iter().map(|r| leads(&r.metrics())).collect::<Vec<_>>()[..] {
            [true, false] => Ok(0),
            [false, true] => Ok(1),
            ref other => Err(format!("{other:?}")),
        }
    });
    let standby = 1 - leader;
    std::thread::sleep(Duration::from_secs(3));
    assert!(!leads(&replicas[standby].metrics()), "two leaders at once");
    let standby_metrics = replicas[standby].metrics();
    assert!(standby_metrics.contains("pelican_leader{lease=\"pelican-leader\"} 0"), "{standby_metrics}");
    assert!(reconciled(&replicas[leader]));
    assert!(!reconciled(&replicas[standby]), "the standby must not reconcile (no writes to Redis or the API)");
    let lease: serde_json::Value =
        serde_json::from_str(&kubectl_ok(&["get", "lease", "pelican-leader", "-n", &ns, "-o", "json"])).unwrap();
    assert!(lease["spec"]["holderIdentity"].as_str().is_some_and(|h| !h.is_empty()), "{lease}");
    assert_eq!(Operator::http_get(replicas[standby].health_port, "/readyz").0, 200, "a standby is ready");

    replicas[leader].kill9();
    let killed_at = Instant::now();
    wait_for("the standby to take over", Duration::from_secs(30), || {
        if leads(&replicas[standby].metrics()) { Ok(()) } else { Err("still standing by".into()) }
    });
    let took = killed_at.elapsed();
    eprintln!("takeover after SIGKILL took {took:?}");
    assert!(took <= Duration::from_secs(20), "took over after {took:?}; the lease lasts 15s");
    // The new leader works: a change on the server shows up in status.
    let _: String = redis::cmd("XADD").arg("s").arg("*").arg("k").arg("v").query(&mut server.conn()).unwrap();
    wait_for("the new leader to refresh status", Duration::from_secs(15), || {
        let p = get_policy(&ns, "p");
        if p["status"]["streamLength"] == 1 { Ok(()) } else { Err(p["status"].to_string()) }
    });
}

/// Two copies started by mistake (no `--leader-elect`, same namespace): the second finds the Lease held by a live
/// process, writes nothing and exits saying what runs and how to run several replicas; once the first is killed without
/// releasing its Lease, a restart of this instance takes it at once instead of after it expires.
#[test]
fn a_second_copy_without_leader_election_exits_and_a_restart_takes_over_at_once() {
    let server = Server::start(Flavor::Redis);
    let ns = namespace("copies");
    let mut first = Operator::start(&ns);
    assert!(kubectl_apply(&ns, &policy("p", &server.url(), "s", "g", "")).0);
    wait_condition(&ns, "p", "Ready", "True", "Reconciled");

    let mut second = Operator::start(&ns);
    wait_for("the second copy to exit", Duration::from_secs(30), || {
        if second.is_running() { Err(second.logs()) } else { Ok(()) }
    });
    let logs = second.logs();
    assert!(logs.contains(&format!("holds the leader Lease {ns}/pelican-leader")), "{logs}");
    assert!(logs.contains("--leader-elect"), "the error says how to run several replicas: {logs}");
    assert!(!reconciled(&second), "the second copy must write nothing: {logs}");
    assert!(first.is_running(), "{}", first.logs());
    assert!(leads(&first.metrics()));

    first.kill9();
    let restarted = Operator::start(&ns);
    wait_for("the restarted copy to lead", Duration::from_secs(30), || {
        if leads(&restarted.metrics()) { Ok(()) } else { Err(restarted.logs()) }
    });
    let logs = restarted.logs();
    assert!(logs.contains("took the Lease of a process of this instance that is gone"), "{logs}");
    let _: String = redis::cmd("XADD").arg("s").arg("*").arg("k").arg("v").query(&mut server.conn()).unwrap();
    wait_for("the restarted copy to refresh status", Duration::from_secs(15), || {
        let p = get_policy(&ns, "p");
        if p["status"]["streamLength"] == 1 { Ok(()) } else { Err(p["status"].to_string()) }
    });
}

/// Defect (issue 48.14): a second install in another namespace elects on its own Lease, so both ran passes and wrote
/// status and nothing said so (the troubleshooting page even advised another namespace). Each install now writes its
/// name (its Lease) in `status.operator`; one that finds another's name after writing its own says so: a Warning Event
/// `AnotherPelican` on the policy and a warning in its log, from both installs.
#[test]
fn a_second_install_in_another_namespace_is_named_on_the_policy_and_in_both_logs() {
    let server = Server::start(Flavor::Redis);
    let ns = namespace("twoinstalls");
    let elsewhere = namespace("twoinstalls-other");
    let first = Operator::start(&ns);
    assert!(kubectl_apply(&ns, &policy("p", &server.url(), "s", "g", "")).0);
    wait_condition(&ns, "p", "Ready", "True", "Reconciled");
    assert_eq!(get_policy(&ns, "p")["status"]["operator"], format!("{ns}/pelican-leader"));

    let second = Operator::start_with(&ns, &["--leader-election-namespace", &elsewhere]);
    let warned = |operator: &Operator, other: &str| {
        operator.logs().contains(&format!("another Pelican install (leader Lease {other}) wrote this policy's status"))
    };
    wait_for("both installs to name the other", Duration::from_secs(60), || {
        match (warned(&first, &format!("{elsewhere}/pelican-leader")), warned(&second, &format!("{ns}/pelican-leader")))
        {
            (true, true) => Ok(()),
            seen => Err(format!("{seen:?}")),
        }
    });
    let events = events(&ns, "AnotherPelican");
    let event = events.first().unwrap_or_else(|| panic!("no AnotherPelican Event in {ns}"));
    assert_eq!(event["type"], "Warning");
    assert_eq!(event["involvedObject"]["name"], "p");
    let message = event["message"].as_str().unwrap();
    assert!(message.contains("Uninstall one, or split the policies"), "{message}");
    let operator = get_policy(&ns, "p")["status"]["operator"].as_str().unwrap().to_string();
    assert!([format!("{ns}/pelican-leader"), format!("{elsewhere}/pelican-leader")].contains(&operator), "{operator}");
}

#[test]
fn sigterm_releases_the_lease_and_a_standby_takes_over() {
    let ns = namespace("handover");
    let first = replica(&ns);
    wait_for("the first replica to lead", Duration::from_secs(20), || {
        if leads(&first.metrics()) { Ok(()) } else { Err(first.logs()) }
    });
    let second = replica(&ns);
    std::thread::sleep(Duration::from_secs(2));
    assert!(!leads(&second.metrics()));
    let holder = || {
        let lease = kubectl_ok(&["get", "lease", "pelican-leader", "-n", &ns, "-o", "json"]);
        let lease: serde_json::Value = serde_json::from_str(&lease).unwrap();
        lease["spec"]["holderIdentity"].as_str().unwrap_or_default().to_string()
    };
    let first_identity = holder();
    assert!(!first_identity.is_empty());
    let status = std::process::Command::new("kill").arg("-TERM").arg(first.pid().to_string()).status().unwrap();
    assert!(status.success());
    let start = Instant::now();
    // The Lease object itself says the first replica let go, long before the 15 s lease could expire.
    wait_for("the first replica to release the Lease", Duration::from_secs(5), || {
        let now = holder();
        if now != first_identity { Ok(()) } else { Err(format!("still held by {now}")) }
    });
    wait_for("the second replica to lead", Duration::from_secs(20), || {
        if leads(&second.metrics()) { Ok(()) } else { Err("waiting".into()) }
    });
    let took = start.elapsed();
    eprintln!("handover after SIGTERM took {took:?}");
    assert!(first.logs().contains("released the leader lease"), "{}", first.logs());
    assert!(took <= Duration::from_secs(15), "handover took {took:?}, more than the lease duration");
}

/// A TCP proxy in front of the API server whose connections the test can cut, to isolate one replica.
struct Proxy {
    port: u16,
    cut: std::sync::Arc<std::sync::atomic::AtomicBool>,
    streams: std::sync::Arc<std::sync::Mutex<Vec<std::net::TcpStream>>>,
}

impl Proxy {
    fn start(upstream: String) -> Proxy {
        use std::net::{Shutdown, TcpListener, TcpStream};
        use std::sync::atomic::Ordering;
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let cut = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let streams = std::sync::Arc::new(std::sync::Mutex::new(Vec::<TcpStream>::new()));
        let (cut2, streams2) = (cut.clone(), streams.clone());
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { continue };
                if cut2.load(Ordering::Relaxed) {
                    let _ = client.shutdown(Shutdown::Both);
                    continue;
                }
                let Ok(server) = TcpStream::connect(&upstream) else { continue };
                let mut list = streams2.lock().unwrap();
                list.push(client.try_clone().unwrap());
                list.push(server.try_clone().unwrap());
                for (mut from, mut to) in [(client.try_clone().unwrap(), server.try_clone().unwrap()), (server, client)]
                {
                    std::thread::spawn(move || {
                        let _ = std::io::copy(&mut from, &mut to);
                        let _ = to.shutdown(Shutdown::Both);
                    });
                }
            }
        });
        Proxy { port, cut, streams }
    }

    /// From now on nothing gets through: open connections are closed, new ones are closed at once.
    fn cut(&self) {
        self.cut.store(true, std::sync::atomic::Ordering::Relaxed);
        for stream in self.streams.lock().unwrap().drain(..) {
            let _ = stream.shutdown(std::net::Shutdown::Both);
        }
    }
}

/// When each JSON log line with `message` was written.
fn times_of(operator: &Operator, message: &str) -> Vec<k8s_openapi::jiff::Timestamp> {
    operator
        .logs()
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter(|line| line["message"].as_str().is_some_and(|m| m.starts_with(message)))
        .filter_map(|line| line["timestamp"].as_str()?.parse().ok())
        .collect()
}

/// A leader cut off from the API server cannot renew its lease and is never told it lost it. It must stop
/// writing to Redis before the standby can lead: the ledger of passes (from both replicas' logs) shows no pass on
/// the old leader after the new one acquired the lease.
#[test]
fn a_leader_cut_off_from_the_api_server_stops_its_passes_before_the_standby_leads() {
    let server = Server::start(Flavor::Redis);
    let ns = namespace("cutoff");
    let kubeconfig_text = std::fs::read_to_string(bed().kubeconfig()).unwrap();
    let upstream = kubeconfig_text.lines().find_map(|l| l.trim().strip_prefix("server: https://")).unwrap().to_string();
    let proxy = Proxy::start(upstream.clone());
    let dir = tempfile::tempdir().unwrap();
    let isolated = dir.path().join("kubeconfig");
    std::fs::write(&isolated, kubeconfig_text.replace(&upstream, &format!("127.0.0.1:{}", proxy.port))).unwrap();
    let args = ["--namespace", &ns, "--leader-elect", "--leader-election-namespace", &ns, "--log-format", "json"];
    let mut first = Operator::launch(&args, isolated.to_str().unwrap());
    wait_for("the first replica to lead", Duration::from_secs(20), || {
        if leads(&first.metrics()) { Ok(()) } else { Err(first.logs()) }
    });
    let second = replica(&ns);
    // Work that keeps passes busy: a consumer that takes every message and never acknowledges it.
    let manifest = policy("p", &server.url(), "s", "g", "  retry:\n    maxDeliveries: 100000\n")
        .replace("    interval: 1s\n", "    interval: 1s\n    minIdle: 1s\n");
    assert!(kubectl_apply(&ns, &manifest).0);
    wait_condition(&ns, "p", "Ready", "True", "Reconciled");
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let producer = {
        let (stop, mut conn) = (stop.clone(), server.conn());
        std::thread::spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let _: String = redis::cmd("XADD").arg("s").arg("*").arg("n").arg(1).query(&mut conn).unwrap();
                read_new(&mut conn, "s", "g", "never-acks", 100);
                std::thread::sleep(Duration::from_millis(100));
            }
        })
    };
    wait_for("passes on the first replica", Duration::from_secs(20), || {
        if times_of(&first, "pass: requeued").is_empty() { Err("none yet".into()) } else { Ok(()) }
    });

    proxy.cut();
    let cut_at = Instant::now();
    wait_for("the second replica to lead", Duration::from_secs(40), || {
        if leads(&second.metrics()) { Ok(()) } else { Err("standing by".into()) }
    });
    eprintln!("the standby led {:?} after the cut", cut_at.elapsed());
    wait_for("passes on the second replica", Duration::from_secs(20), || {
        if times_of(&second, "pass: requeued").is_empty() { Err("none yet".into()) } else { Ok(()) }
    });
    // Long enough for a leader that retries its failed API writes with backoff (1, 2, 4, 8, 16 s) to pass again.
    std::thread::sleep(Duration::from_secs(20));
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    producer.join().unwrap();

    let led_at = times_of(&second, "acquired the leader lease")[0];
    let old_passes = times_of(&first, "reclaim pass");
    let last_old = *old_passes.iter().max().unwrap();
    eprintln!(
        "ledger: {} passes on the old leader, the last at {last_old}; the new leader acquired the lease at {led_at} \
         ({} ms later)",
        old_passes.len(),
        led_at.duration_since(last_old).as_millis()
    );
    assert!(last_old < led_at, "the old leader passed at {last_old}, after the new one led at {led_at}");
    assert!(!first.is_running(), "the isolated leader exits once it may no longer write");
    assert!(first.logs().contains("leadership ended"), "{}", first.logs());
}

/// Two replicas that start together (a `helm install` of two) both find the Lease free and both apply their lock,
/// as kube-lease-manager does, with server-side apply and no force. The one that applies second must get a conflict;
/// under one field manager for all replicas its apply silently overwrote the first, both believed they led, and the
/// one not named in the Lease exited when it learned so ten seconds later.
#[tokio::test]
async fn a_replica_that_saw_the_lease_free_cannot_take_it_from_the_one_that_locked_it() {
    let ns = namespace("together");
    let client = client().await;
    let mut first = Elector::start(client.clone(), &ns, "pelican-leader", "replica-a").await.unwrap();
    tokio::time::timeout(Duration::from_secs(10), first.acquired()).await.unwrap().unwrap();

    let leases: Api<Lease> = Api::namespaced(client, &ns);
    let second = PatchParams::apply(&field_manager("replica-b"));
    let applied = leases.patch("pelican-leader", &second, &Patch::Apply(lock("replica-b"))).await;
    assert!(
        matches!(&applied, Err(kube::Error::Api(e)) if e.code == 409),
        "the second replica's lock was not refused: {:?}",
        applied.map(|lease| lease.spec)
    );
    let holder = leases.get("pelican-leader").await.unwrap().spec.unwrap().holder_identity;
    assert_eq!(holder.as_deref(), Some("replica-a"));
    first.release().await;
}

/// Upgrading from a release whose replicas all applied their lock as field manager "pelican": a Lease its leader
/// left locked (killed, so never released) is taken by a replica of this release once it expires, not refused
/// for good as another manager's fields.
#[tokio::test]
async fn a_lease_locked_by_the_previous_release_is_taken_once_it_expires() {
    let ns = namespace("upgrade");
    let client = client().await;
    let leases: Api<Lease> = Api::namespaced(client.clone(), &ns);
    leases.patch("pelican-leader", &PatchParams::apply("pelican"), &Patch::Apply(lock("old-replica"))).await.unwrap();

    let locked = Instant::now();
    let mut new = Elector::start(client, &ns, "pelican-leader", "new-replica").await.unwrap();
    tokio::time::timeout(Duration::from_secs(40), new.acquired())
        .await
        .expect("the expired lease was not taken")
        .unwrap();
    let waited = locked.elapsed();
    println!("the previous release's lease taken after {:.1}s", waited.as_secs_f64());
    assert!(waited >= Duration::from_secs(LEASE_DURATION_SECONDS), "taken before it expired: {waited:?}");
    let holder = leases.get("pelican-leader").await.unwrap().spec.unwrap().holder_identity;
    assert_eq!(holder.as_deref(), Some("new-replica"));
    new.release().await;
}

async fn client() -> kube::Client {
    let kubeconfig = kube::config::Kubeconfig::read_from(bed().kubeconfig()).unwrap();
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default()).await.unwrap();
    kube::Client::try_from(config).unwrap()
}

/// A lock on the Lease as kube-lease-manager applies it (server-side apply, no force), held by `holder` from now.
fn lock(holder: &str) -> serde_json::Value {
    let now = MicroTime(k8s_openapi::jiff::Timestamp::now());
    serde_json::json!({
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": "pelican-leader"},
        "spec": {"holderIdentity": holder, "acquireTime": now, "renewTime": now, "leaseDurationSeconds": LEASE_DURATION_SECONDS},
    })
}
