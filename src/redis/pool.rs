//! One connection per distinct server + credentials, shared by every policy that uses them (SPEC section 5).

use std::collections::HashMap;
use std::fmt;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::Mutex;
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{Client, IntoConnectionInfo};

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

/// A server and the identity to use on it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Target {
    pub url: String,
    pub credentials: Credentials,
}

impl Target {
    /// The server address without path or credentials, for messages.
    pub fn server(&self) -> String {
        let rest = self.url.split_once("://").map_or(self.url.as_str(), |(_, rest)| rest);
        rest.split('/').next().unwrap_or(rest).to_string()
    }

    /// Identifies the pool without keeping the password readable in the map key.
    fn pool_key(&self) -> PoolKey {
        let mut hasher = DefaultHasher::new();
        self.credentials.password.hash(&mut hasher);
        (self.url.clone(), self.credentials.username.clone(), hasher.finish())
    }
}

/// Bounds on how long one command or connection attempt may block a reconcile.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(10);

/// URL, username and a hash of the password.
type PoolKey = (String, Option<String>, u64);

#[derive(Default)]
pub struct Pools {
    connections: Mutex<HashMap<PoolKey, ConnectionManager>>,
}

impl Pools {
    /// A multiplexed connection to `target`, created on first use. The manager reconnects by itself after a
    /// server restart; a credential change in a Secret yields a new target and so a new connection.
    pub async fn get(&self, target: &Target) -> Result<ConnectionManager> {
        let key = target.pool_key();
        if let Some(conn) = self.connections.lock().expect("pool lock").get(&key) {
            return Ok(conn.clone());
        }
        let server = target.server();
        let mut info = target.url.as_str().into_connection_info().map_err(|e| Error::from_redis(&server, e))?;
        let mut settings = info.redis_settings().clone();
        if let Some(user) = &target.credentials.username {
            settings = settings.set_username(user);
        }
        if let Some(password) = &target.credentials.password {
            settings = settings.set_password(password);
        }
        info = info.set_redis_settings(settings);
        let client = Client::open(info).map_err(|e| Error::from_redis(&server, e))?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(CONNECT_TIMEOUT))
            .set_response_timeout(Some(RESPONSE_TIMEOUT))
            .set_number_of_retries(2)
            .set_max_delay(Duration::from_secs(2));
        let conn =
            ConnectionManager::new_with_config(client, config).await.map_err(|e| Error::from_redis(&server, e))?;
        let mut map = self.connections.lock().expect("pool lock");
        Ok(map.entry(key).or_insert(conn).clone())
    }

    /// Drops a connection so the next `get` dials again (after an authentication failure, say).
    pub fn forget(&self, target: &Target) {
        self.connections.lock().expect("pool lock").remove(&target.pool_key());
    }

    /// Number of distinct server + credential pairs connected.
    pub fn len(&self) -> usize {
        self.connections.lock().expect("pool lock").len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_output_never_shows_the_password() {
        let creds = Credentials { username: Some("app".into()), password: Some("hunter2".into()) };
        let shown = format!("{:?}", Target { url: "redis://h:1".into(), credentials: creds });
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(shown.contains("<redacted>"));
    }

    #[test]
    fn server_is_host_and_port() {
        let t = Target { url: "rediss://cache.apps.svc:6380/2".into(), credentials: Credentials::default() };
        assert_eq!(t.server(), "cache.apps.svc:6380");
    }
}
