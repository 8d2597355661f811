//! Everything that talks to Redis/Valkey: shared connections, group administration and the status probe.

mod backlog;
pub mod features;
mod group;
mod health;
mod pool;
pub(crate) mod reply;

pub use backlog::{Backlog, Readings, probe_backlog};
pub use features::Features;
pub use group::{
    Destroyed, GroupFacts, GroupKeys, GroupSetup, OldestPending, ServerInfo, Unread, destroy_group, ensure_group,
    id_millis, probe_group, set_bound, set_idempotence, set_settings,
};
pub use pool::{Conn, Credentials, PoolKey, Pools, Sentinel, Target, Tls, canonical_url, server_identity};
