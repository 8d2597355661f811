//! Where the SDK's connections come from: one server, a Redis Cluster (its keys share the stream's slot, so every
//! script runs on one node), or the primary a sentinel names, asked again after a failover.

use std::future::Future;
use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::{Client, Cmd, IntoConnectionInfo, Pipeline, RedisConnectionInfo, RedisFuture, RedisResult, Value};

/// A connection of the SDK. Both kinds reconnect by themselves; the cluster one follows MOVED / ASK.
#[derive(Clone)]
pub enum Connection {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

impl ConnectionLike for Connection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Connection::Single(c) => c.req_packed_command(cmd),
            Connection::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Connection::Single(c) => c.req_packed_commands(cmd, offset, count),
            Connection::Cluster(c) => c.req_packed_commands(cmd, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Connection::Single(c) => c.get_db(),
            Connection::Cluster(c) => c.get_db(),
        }
    }
}

/// What to connect to.
#[derive(Clone)]
pub enum Source {
    /// One server (or a primary whose address never changes).
    Server(Client),
    /// Any nodes of a Redis Cluster; the rest are discovered.
    Cluster(ClusterClient),
    /// A sentinel, the name it monitors the primary under, and how to log in to the primary (database, user,
    /// password). The primary is asked for at connect time and again after a read fails.
    Sentinel { sentinel: Client, master_name: String, primary: RedisConnectionInfo },
}

/// How long a connection waits for a reply, and whether it resends a command after reconnecting.
#[derive(Clone, Copy)]
pub(crate) struct Timeouts {
    pub response: Duration,
    pub retries: usize,
}

impl Source {
    /// A new connection of this source's kind; for a sentinel, to the primary it names now.
    pub(crate) async fn connect(&self, timeouts: Timeouts) -> RedisResult<Connection> {
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(Duration::from_secs(5)))
            .set_response_timeout(Some(timeouts.response))
            .set_number_of_retries(timeouts.retries);
        match self {
            Source::Server(client) => {
                Ok(Connection::Single(ConnectionManager::new_with_config(client.clone(), config).await?))
            }
            Source::Cluster(client) => Ok(Connection::Cluster(client.get_async_connection().await?)),
            Source::Sentinel { sentinel, master_name, primary } => {
                let client = primary_client(sentinel, master_name, primary).await?;
                Ok(Connection::Single(ConnectionManager::new_with_config(client, config).await?))
            }
        }
    }

    /// Whether a failed read may mean the primary moved: only a sentinel source can find out where to.
    pub(crate) fn follows_failovers(&self) -> bool {
        matches!(self, Source::Sentinel { .. })
    }
}

/// The primary `master_name` as the sentinel names it now (`SENTINEL GET-MASTER-ADDR-BY-NAME`).
async fn primary_client(sentinel: &Client, master_name: &str, primary: &RedisConnectionInfo) -> RedisResult<Client> {
    let mut conn = sentinel.get_multiplexed_async_connection().await?;
    let address: Option<(String, u16)> =
        redis::cmd("SENTINEL").arg("GET-MASTER-ADDR-BY-NAME").arg(master_name).query_async(&mut conn).await?;
    let (host, port) = address.ok_or_else(|| {
        redis::RedisError::from((
            redis::ErrorKind::InvalidClientConfig,
            "the sentinel knows no primary by that name",
            master_name.to_string(),
        ))
    })?;
    let host = if host.contains(':') { format!("[{host}]") } else { host };
    let info = format!("redis://{host}:{port}").into_connection_info()?.set_redis_settings(primary.clone());
    Client::open(info)
}

/// Sends an idempotent write (an XACK, the terminal ACK script, a give-back, a last error: each means the same done
/// twice) and sends it once more when the connection broke under it. The first command after a fault broke a
/// connection fails with it ("broken pipe") and the connection reconnects for the next; without the second try an
/// outcome that met the fault only on its way out would stay pending and be run again. The other libraries' clients
/// resend such a command by themselves.
pub(crate) async fn write_again_if_broken<T, Fut>(
    conn: &Connection,
    write: impl Fn(Connection) -> Fut,
) -> RedisResult<T>
where
    Fut: Future<Output = RedisResult<T>>,
{
    match write(conn.clone()).await {
        Err(e) if broken(&e) => write(conn.clone()).await,
        written => written,
    }
}

/// Whether `e` is a connection that broke under the command (not a timeout: a slow server may still write it).
pub(crate) fn broken(e: &redis::RedisError) -> bool {
    e.is_connection_dropped() || (e.is_io_error() && !e.is_timeout())
}
