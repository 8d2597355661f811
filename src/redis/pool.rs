//! One connection per distinct server + credentials, shared by every policy that uses them.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::{Client, ClientTlsConfig, ConnectionAddr, IntoConnectionInfo, TlsCertificates, TlsMode};

use super::health::{Admission, PROBE_WAIT, Reachability, Seen};
use crate::{Error, Result};

/// Username and password read from Secrets. `Debug` never prints the password.
#[derive(Clone, Default, PartialEq, Eq, Hash)]
pub struct Credentials {
    pub username: Option<String>,
    pub password: Option<String>,
}

impl fmt::Debug for Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Credentials")
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

/// TLS material read from Secrets (PEM). `Debug` never prints the key.
#[derive(Clone, Default, PartialEq, Eq, Hash)]
pub struct Tls {
    /// CA bundle to verify the server with; the system roots when `None`.
    pub ca: Option<Vec<u8>>,
    /// Client certificate and key, for servers that require them.
    pub client_cert: Option<Vec<u8>>,
    pub client_key: Option<Vec<u8>>,
    /// Accept any server certificate (testing only; the operator warns with an Event).
    pub insecure_skip_verify: bool,
}

impl fmt::Debug for Tls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tls")
            .field("ca", &self.ca.as_ref().map(|c| c.len()))
            .field("client_cert", &self.client_cert.is_some())
            .field("client_key", &self.client_key.as_ref().map(|_| "<redacted>"))
            .field("insecure_skip_verify", &self.insecure_skip_verify)
            .finish()
    }
}

/// A server (or, in cluster mode, a seed node of the cluster; in sentinel mode, a sentinel) and the identity to use
/// on it. [`Pools::resolve`] turns a sentinel target into the primary's.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Target {
    pub url: String,
    pub credentials: Credentials,
    pub tls: Tls,
    pub cluster: bool,
    /// `url` names a sentinel that knows the primary under this name; `credentials` are the primary's.
    pub sentinel: Option<Sentinel>,
}

/// The name of a primary on a sentinel, and the sentinel's own credentials.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Sentinel {
    pub master_name: String,
    pub credentials: Credentials,
}

/// A shared connection to a standalone server or to a whole Redis Cluster: the worker SDK's [`Connection`]. Both
/// reconnect by themselves; the cluster connection follows MOVED / ASK redirections and slot migrations.
pub use crate::worker::Connection as Conn;

impl Target {
    /// A server without credentials or TLS material.
    pub fn new(url: impl Into<String>) -> Target {
        Target {
            url: url.into(),
            credentials: Credentials::default(),
            tls: Tls::default(),
            cluster: false,
            sentinel: None,
        }
    }

    /// The server address without path or credentials, for messages.
    pub fn server(&self) -> String {
        let rest = self.url.split_once("://").map_or(self.url.as_str(), |(_, rest)| rest);
        rest.split('/').next().unwrap_or(rest).to_string()
    }

    /// Identifies the pool without keeping the password or key readable in the map key.
    pub fn pool_key(&self) -> PoolKey {
        let mut hasher = DefaultHasher::new();
        self.credentials.password.hash(&mut hasher);
        self.tls.hash(&mut hasher);
        self.cluster.hash(&mut hasher);
        self.sentinel.hash(&mut hasher);
        (canonical_url(&self.url), self.credentials.username.clone(), hasher.finish())
    }

    /// The TLS certificates to present, when the URL is `rediss://`.
    fn certificates(&self) -> TlsCertificates {
        let client_tls = match (&self.tls.client_cert, &self.tls.client_key) {
            (Some(client_cert), Some(client_key)) => {
                Some(ClientTlsConfig { client_cert: client_cert.clone(), client_key: client_key.clone() })
            }
            _ => None,
        };
        TlsCertificates { client_tls, root_cert: self.tls.ca.clone() }
    }

    /// A connection to the whole cluster this node belongs to.
    async fn cluster_connection(&self) -> Result<ClusterConnection> {
        let server = self.server();
        let mut builder = ClusterClient::builder(vec![self.url.as_str()])
            .connection_timeout(CONNECT_TIMEOUT)
            .response_timeout(RESPONSE_TIMEOUT)
            .retries(4);
        if let Some(user) = &self.credentials.username {
            builder = builder.username(user);
        }
        if let Some(password) = &self.credentials.password {
            builder = builder.password(password);
        }
        if self.url.starts_with("rediss://") {
            let mode = if self.tls.insecure_skip_verify { TlsMode::Insecure } else { TlsMode::Secure };
            builder = builder.tls(mode).certs(self.certificates());
        }
        let client = builder.build().map_err(|e| Error::from_redis(&server, e))?;
        client.get_async_connection().await.map_err(|e| {
            // The seed answered CLUSTER SLOTS with an error about the command itself (it quotes no key).
            if e.to_string().contains("cluster support disabled") {
                Error::NotACluster { server: server.clone() }
            } else {
                Error::from_redis(&server, e)
            }
        })
    }

    /// Why connecting failed. The connection selects the URL's database first; a server without that database
    /// answers SELECT with `ERR DB index is out of range` (a message about the SELECT itself, which quotes no key).
    fn connect_error(&self, server: &str, e: redis::RedisError) -> Error {
        if self.refused_without_client_certificate(&e) {
            return Error::TlsFailed {
                server: server.to_string(),
                detail: format!(
                    "the server ended the connection right after the TLS handshake ({e}), which is how a server that \
                     requires client certificates (tls-auth-clients yes) refuses a client without one: set \
                     tls.certSecretRef and keySecretRef"
                ),
            };
        }
        let database = self.url.rsplit_once('/').map(|(_, db)| db).filter(|db| !db.is_empty() && !db.contains(':'));
        match (database, e.detail()) {
            (Some(database), Some(detail))
                if e.code() == Some("ERR") && detail.starts_with("DB index is out of range") =>
            {
                Error::DatabaseNotFound { server: server.to_string(), database: database.to_string() }
            }
            _ => Error::from_redis(server, e),
        }
    }

    /// A TLS connection without a client certificate that the server dropped as soon as it was set up. With TLS 1.3
    /// the client's side of the handshake is done before the server checks for a certificate, so the refusal arrives
    /// as an alert (`CertificateRequired`) or a connection closed under the first command (broken pipe, reset, end of
    /// file), depending on timing, not as a handshake error.
    fn refused_without_client_certificate(&self, e: &redis::RedisError) -> bool {
        self.url.starts_with("rediss://")
            && self.tls.client_cert.is_none()
            && e.code().is_none()
            && !e.is_connection_refusal()
            && !e.is_timeout()
            && (e.is_connection_dropped()
                || e.is_unrecoverable_error() && e.is_io_error()
                || e.to_string().contains("CertificateRequired"))
    }

    /// A client for this target: credentials in the connection settings, TLS material when the URL is `rediss://`.
    fn client(&self) -> Result<Client> {
        let server = self.server();
        // A URL the client cannot read is a spec problem, never worth a retry.
        let mut info = self
            .url
            .as_str()
            .into_connection_info()
            .map_err(|e| Error::InvalidSpec(format!("spec.redis.url {:?} cannot be used: {e}", self.url)))?;
        // No CLIENT SETINFO: one command fewer for the ACL rule set, and Redis 7.0 does not know it.
        let mut settings = info.redis_settings().clone().set_skip_set_lib_name();
        if let Some(user) = &self.credentials.username {
            settings = settings.set_username(user);
        }
        if let Some(password) = &self.credentials.password {
            settings = settings.set_password(password);
        }
        info = info.set_redis_settings(settings);
        if let ConnectionAddr::TcpTls { host, port, tls_params, .. } = info.addr().clone() {
            let addr = ConnectionAddr::TcpTls { host, port, insecure: self.tls.insecure_skip_verify, tls_params };
            info = info.set_addr(addr);
            return Client::build_with_tls(info, self.certificates()).map_err(|e| Error::from_redis(&server, e));
        }
        Client::open(info).map_err(|e| Error::from_redis(&server, e))
    }
}

/// One spelling per server, so `redis://H:6379`, `redis://h:6379/0`, `redis://h/` and `redis://h:06379/00` are one
/// server (for ownership checks and shared connections): scheme and host in lower case, the default port 6379, the
/// database number without leading zeros (0 when absent). Anything else of the URL is kept as it is.
pub fn canonical_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_string();
    };
    let (authority, database) = rest.split_once('/').unwrap_or((rest, ""));
    let database = match database.trim_start_matches('0') {
        "" => "0",
        db => db,
    };
    let (host, port) = match authority.rsplit_once(':') {
        // `[::1]` alone: the colon is the address's, not a port's.
        Some((host, port)) if !authority.ends_with(']') => {
            (host, port.parse::<u16>().map_or(port.to_string(), |p| p.to_string()))
        }
        _ => (authority, "6379".to_string()),
    };
    format!("{}://{}:{port}/{database}", scheme.to_ascii_lowercase(), host.to_ascii_lowercase())
}

/// The URL of the sentinel a `mode: Sentinel` policy names: its URL with database 0. The database is the data
/// nodes'; a sentinel implements no `SELECT`, and a connection asked for another database fails at its first command.
fn sentinel_url(url: &str) -> String {
    let (scheme, rest) = url.split_once("://").unwrap_or(("redis", url));
    let authority = rest.split_once('/').map_or(rest, |(authority, _)| authority);
    format!("{scheme}://{authority}/0")
}

/// Which server a policy names, however its URL is spelled: the `RedisServer` it references, or the canonical URL
/// (and for `mode: Sentinel` the primary's name too: one sentinel watches many primaries). Policies on one
/// `RedisServer` are neighbours by the reference; an inline URL and a reference to the same server are not
/// compared.
pub fn server_identity(policy: &crate::api::ConsumerGroupPolicy) -> String {
    if let Some((namespace, name)) = policy.server_ref() {
        return format!("RedisServer {namespace}/{name}");
    }
    let redis = &policy.spec.redis;
    match &redis.sentinel {
        Some(sentinel) => format!("{}#{}", canonical_url(&redis.url), sentinel.master_name),
        None => canonical_url(&redis.url),
    }
}

/// Bounds on how long one command or connection attempt may block a reconcile.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(10);

/// The longest a probe of a server may take (connecting, with the client's retries, then a PING).
const PROBE_LIMIT: Duration = Duration::from_secs(15);

/// A server that did not answer within `limit`, as the probe's error.
fn no_answer(server: &str, limit: Duration) -> (String, redis::RedisError) {
    let detail = format!("no answer within {}s", limit.as_secs());
    (server.to_string(), redis::RedisError::from((redis::ErrorKind::Io, "server not answering", detail)))
}

impl From<(String, redis::RedisError)> for Error {
    fn from((server, source): (String, redis::RedisError)) -> Error {
        Error::RedisUnavailable { server, source }
    }
}

/// URL, username and a hash of the password, TLS material and mode.
pub type PoolKey = (String, Option<String>, u64);

#[derive(Default)]
pub struct Pools {
    connections: Mutex<HashMap<PoolKey, Conn>>,
    /// Connections to sentinels: few, and kept apart from the data connections that `assign` closes.
    sentinels: Mutex<HashMap<PoolKey, Conn>>,
    /// Which servers answered last time, for [`Pools::reach_primary`].
    pub reach: Reachability,
    /// What each server can do, detected once per server and version ([`Pools::features`]).
    pub features: super::features::Detected,
}

impl Pools {
    /// The target to send data commands to: `target` itself, or for a sentinel target the primary the sentinel
    /// names now (`SENTINEL GET-MASTER-ADDR-BY-NAME`), with the URL's scheme and database, the data nodes'
    /// credentials and the same TLS settings. Asked at every reconcile, so a failover yields a new target, hence a
    /// new connection for the status probe and the runner.
    pub async fn resolve(&self, target: &Target) -> Result<Target> {
        let Some(sentinel) = &target.sentinel else {
            return Ok(target.clone());
        };
        let at = Target {
            url: sentinel_url(&target.url),
            credentials: sentinel.credentials.clone(),
            sentinel: None,
            ..target.clone()
        };
        let key = at.pool_key();
        let cached = self.sentinels.lock().expect("pool lock").get(&key).cloned();
        let mut conn = match cached {
            Some(conn) => conn,
            None => {
                let conn = Conn::Single(connect_single(&at).await?);
                self.sentinels.lock().expect("pool lock").entry(key).or_insert(conn).clone()
            }
        };
        let primary: Option<(String, u16)> = redis::cmd("SENTINEL")
            .arg("GET-MASTER-ADDR-BY-NAME")
            .arg(&sentinel.master_name)
            .query_async(&mut conn)
            .await
            .map_err(|e| Error::from_redis(&at.server(), e))?;
        let Some((host, port)) = primary else {
            return Err(Error::SentinelMasterUnknown { sentinel: at.server(), master: sentinel.master_name.clone() });
        };
        let (scheme, rest) = target.url.split_once("://").unwrap_or(("redis", &target.url));
        let database = rest.split_once('/').map_or("0", |(_, db)| if db.is_empty() { "0" } else { db });
        let host = if host.contains(':') { format!("[{host}]") } else { host };
        Ok(Target { url: format!("{scheme}://{host}:{port}/{database}"), sentinel: None, ..target.clone() })
    }

    /// The target to write to and a connection to it: [`Pools::resolve`], then [`Pools::get`]; for a sentinel
    /// target, only once the server the sentinel named answers `ROLE` as a primary. A sentinel can name a primary
    /// that was demoted meanwhile (its answer is older than the failover); writing there would fail with READONLY,
    /// or, on a primary that is about to be demoted, be lost.
    pub async fn connect_primary(&self, target: &Target) -> Result<(Target, Conn)> {
        let primary = self.resolve(target).await?;
        let mut conn = self.get(&primary).await?;
        if let Some(sentinel) = &target.sentinel {
            let role: Vec<redis::Value> =
                redis::cmd("ROLE").query_async(&mut conn).await.map_err(|e| Error::from_redis(&primary.server(), e))?;
            let role = match role.first() {
                Some(redis::Value::BulkString(role)) => String::from_utf8_lossy(role).into_owned(),
                Some(redis::Value::SimpleString(role)) => role.clone(),
                _ => "unknown".to_string(),
            };
            if role != "master" {
                return Err(Error::NotPrimary { server: primary.server(), master: sentinel.master_name.clone(), role });
            }
        }
        Ok((primary, conn))
    }

    /// [`Pools::connect_primary`] for a reconcile, which many policies of one server may run at once: when the
    /// server is known down, the error the last probe saw, at once; when nobody knows, after one probe for all of
    /// them (run on its own task; [`Error::Deferred`] when it takes longer than [`PROBE_WAIT`]). A server that
    /// cannot be reached on the way (connection or command) is recorded as down.
    pub async fn reach_primary(self: &Arc<Self>, target: &Target) -> Result<(Target, Conn)> {
        let key = target.server();
        let probe = match self.reach.admit(&key) {
            Admission::Go => None,
            Admission::Down { server, error, .. } => return Err(Error::RedisUnavailable { server, source: error }),
            Admission::Wait(probe) => Some(probe),
            Admission::Probe(send) => {
                let (pools, probed, probe) = (self.clone(), target.clone(), send.subscribe());
                tokio::spawn(async move {
                    let outcome = match tokio::time::timeout(PROBE_LIMIT, pools.ping_primary(&probed)).await {
                        Ok(outcome) => outcome,
                        Err(_) => Err(no_answer(&probed.server(), PROBE_LIMIT)),
                    };
                    let _ = send.send(Some(pools.reach.record(&probed.server(), outcome)));
                });
                Some(probe)
            }
        };
        if let Some(mut probe) = probe {
            match tokio::time::timeout(PROBE_WAIT, probe.wait_for(Option::is_some)).await {
                Ok(Ok(seen)) => {
                    if let Some(Seen::Down { server, error, .. }) = seen.clone() {
                        return Err(Error::RedisUnavailable { server, source: error });
                    }
                }
                _ => return Err(Error::Deferred(format!("the first probe of {key} is under way"))),
            }
        }
        let connected = self.connect_primary(target).await;
        if let Err(e) = &connected {
            self.saw(target, e);
        }
        connected
    }

    /// Records a server as down after `error`, when it says so (a refused, dropped or timed-out connection) and
    /// the server was not known down already: a reconcile that failed at once on a server known down must not
    /// push its next probe further away (its policies would then never see it back).
    pub fn saw(&self, target: &Target, error: &Error) {
        let key = target.server();
        if let Error::RedisUnavailable { server, source } = error
            && self.reach.retry_at(&key).is_none()
        {
            self.reach.record(&key, Err((server.clone(), source.clone())));
        }
    }

    /// A probe: the primary connected (or its connection reused) and a PING answered in time. Errors other than
    /// the server's being unreachable (credentials, TLS) say it answers: the reconcile reports them itself.
    async fn ping_primary(&self, target: &Target) -> std::result::Result<(), (String, redis::RedisError)> {
        let ping = async {
            // A refused connection is an answer at once, where the client would retry it for seconds.
            if matches!(target.url.split_once("://"), Some(("redis" | "rediss", _))) {
                let server = target.server();
                let connected = tokio::time::timeout(CONNECT_TIMEOUT, tokio::net::TcpStream::connect(&server)).await;
                match connected {
                    Ok(Ok(_)) => {}
                    Ok(Err(e)) => return Err(Error::RedisUnavailable { server, source: e.into() }),
                    Err(_) => return Err(no_answer(&server, CONNECT_TIMEOUT).into()),
                }
            }
            let (primary, mut conn) = self.connect_primary(target).await?;
            let ping = tokio::time::timeout(CONNECT_TIMEOUT, redis::cmd("PING").query_async::<()>(&mut conn)).await;
            match ping {
                Ok(answer) => answer.map_err(|e| Error::from_redis(&primary.server(), e)),
                Err(_) => Err(no_answer(&primary.server(), CONNECT_TIMEOUT).into()),
            }
        };
        match ping.await {
            Err(Error::RedisUnavailable { server, source }) => Err((server, source)),
            _ => Ok(()),
        }
    }

    /// What answers at `target` (the primary, for a sentinel target), on a connection of its own that is closed
    /// afterwards: the check of a `RedisServer` object, which is no user of the pooled connections.
    pub async fn probe(&self, target: &Target) -> Result<super::ServerInfo> {
        let primary = self.resolve(target).await?;
        let server = primary.server();
        let mut conn = if primary.cluster {
            Conn::Cluster(primary.cluster_connection().await?)
        } else {
            Conn::Single(connect_single(&primary).await?)
        };
        let info: String =
            redis::cmd("INFO").arg("server").query_async(&mut conn).await.map_err(|e| Error::from_redis(&server, e))?;
        Ok(super::ServerInfo::parse(&info))
    }

    /// A multiplexed connection to `target` (a server, or a whole cluster), created on first use. It reconnects by
    /// itself after a server restart; a credential change in a Secret yields a new target and so a new connection.
    pub async fn get(&self, target: &Target) -> Result<Conn> {
        let key = target.pool_key();
        if let Some(conn) = self.connections.lock().expect("pool lock").get(&key) {
            return Ok(conn.clone());
        }
        let conn = if target.cluster {
            Conn::Cluster(target.cluster_connection().await?)
        } else {
            Conn::Single(connect_single(target).await?)
        };
        let mut map = self.connections.lock().expect("pool lock");
        Ok(map.entry(key).or_insert(conn).clone())
    }

    /// What the server behind `conn` can do: detected once per server, and again after `forget_features` (its
    /// version changed).
    pub async fn features(&self, conn: &mut Conn, server: &str) -> Result<super::Features> {
        if let Some(known) = self.features.get(server) {
            return Ok(known);
        }
        let detected = super::features::detect(conn, server).await?;
        self.features.insert(server, detected.clone());
        Ok(detected)
    }

    /// Drops a connection so the next `get` dials again (after an authentication failure, say).
    pub fn forget(&self, target: &Target) {
        self.connections.lock().expect("pool lock").remove(&target.pool_key());
    }

    /// Records that `user` (a policy) now connects with `target`, and closes the connection it used before when no
    /// user needs it any more (the credentials a Secret no longer holds, the primary before a failover). Only that
    /// one: a connection another policy has just dialed and not yet recorded is in use already, and closing it would
    /// make the next policy dial a second one beside it.
    pub fn assign<U: Eq + Hash + Clone>(&self, users: &Mutex<HashMap<U, PoolKey>>, user: &U, target: Option<&Target>) {
        let mut users = users.lock().expect("pool users lock");
        let now = target.map(Target::pool_key);
        let before = match &now {
            Some(key) => users.insert(user.clone(), key.clone()),
            None => users.remove(user),
        };
        if let Some(before) = before
            && Some(&before) != now.as_ref()
            && !users.values().any(|key| *key == before)
        {
            self.connections.lock().expect("pool lock").remove(&before);
        }
    }

    /// Closes the connections to sentinels no target in `sentinels` names (by canonical URL): a sentinel is
    /// connected to only while a policy uses it.
    pub fn retain_sentinels<'a>(&self, sentinels: impl IntoIterator<Item = &'a str>) {
        let used: HashSet<String> = sentinels.into_iter().map(|url| canonical_url(&sentinel_url(url))).collect();
        self.sentinels.lock().expect("pool lock").retain(|(url, _, _), _| used.contains(url));
    }

    /// Number of distinct server + credential pairs connected.
    pub fn len(&self) -> usize {
        self.connections.lock().expect("pool lock").len()
    }

    /// Number of sentinels connected.
    pub fn sentinels(&self) -> usize {
        self.sentinels.lock().expect("pool lock").len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A connection to one server that reconnects by itself.
async fn connect_single(target: &Target) -> Result<ConnectionManager> {
    let server = target.server();
    let config = ConnectionManagerConfig::new()
        .set_connection_timeout(Some(CONNECT_TIMEOUT))
        .set_response_timeout(Some(RESPONSE_TIMEOUT))
        .set_number_of_retries(2)
        .set_max_delay(Duration::from_secs(2));
    let manager = ConnectionManager::new_with_config(target.client()?, config)
        .await
        .map_err(|e| target.connect_error(&server, e))?;
    if target.url.starts_with("rediss://") && target.tls.client_cert.is_none() {
        // A server that requires a client certificate drops the connection once it is set up (TLS 1.3): find out
        // here, where it can be told apart from a server that is down.
        let mut probe = manager.clone();
        redis::cmd("PING").query_async::<()>(&mut probe).await.map_err(|e| target.connect_error(&server, e))?;
    }
    Ok(manager)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_output_never_shows_the_password() {
        let creds = Credentials { username: Some("app".into()), password: Some("hunter2".into()) };
        let tls = Tls { client_key: Some(b"-----BEGIN PRIVATE KEY----- secret".to_vec()), ..Tls::default() };
        let shown = format!("{:?}", Target { credentials: creds, tls, ..Target::new("redis://h:1") });
        assert!(!shown.contains("PRIVATE KEY"), "{shown}");
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(shown.contains("<redacted>"));
    }

    #[test]
    fn one_server_has_one_canonical_url() {
        let one = canonical_url("redis://cache.apps.svc:6379/0");
        for spelling in [
            "redis://Cache.Apps.svc:6379/0",
            "redis://cache.apps.svc",
            "redis://cache.apps.svc/",
            "REDIS://cache.apps.svc:06379/00",
        ] {
            assert_eq!(canonical_url(spelling), one, "{spelling}");
        }
        assert_ne!(canonical_url("redis://cache.apps.svc/1"), one);
        assert_ne!(canonical_url("rediss://cache.apps.svc/0"), one);
        assert_eq!(canonical_url("redis://[::1]/3"), "redis://[::1]:6379/3");
        assert_eq!(canonical_url("redis://[::1]:7000"), "redis://[::1]:7000/0");
    }

    /// Issue 66.2: the sentinel was asked over a connection to the policy's database, and a sentinel has no
    /// `SELECT`; the database is the data nodes' (tests/sentinel.rs has a policy on database 3 Ready).
    #[test]
    fn the_sentinel_is_asked_on_database_0_whatever_the_data_nodes_use() {
        assert_eq!(sentinel_url("redis://sentinel.apps:26379/1"), "redis://sentinel.apps:26379/0");
        assert_eq!(sentinel_url("rediss://sentinel.apps:26379"), "rediss://sentinel.apps:26379/0");
        assert_eq!(sentinel_url("redis://[::1]:26379/15"), "redis://[::1]:26379/0");
        assert_eq!(canonical_url(&sentinel_url("redis://s:26379/1")), canonical_url("redis://s:26379"));
    }

    #[test]
    fn server_is_host_and_port() {
        let t = Target::new("rediss://cache.apps.svc:6380/2");
        assert_eq!(t.server(), "cache.apps.svc:6380");
    }
}
