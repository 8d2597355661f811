//! Everything that talks to Redis/Valkey: shared connections, group administration and the status probe.

mod backlog;
pub mod features;
mod group;
mod health;
pub mod pager;
mod pool;
pub(crate) mod reply;

pub use backlog::{Backlog, Readings, probe_backlog};
pub use features::Features;
pub use group::{
    Claim, Destroyed, GroupFacts, GroupKeys, GroupSetup, OldestPending, PassMinIdle, ServerInfo, TopicSettings, Unread,
    agree_idempotence, claim_group, describe_topic, destroy_group, ensure_group, id_millis, probe_group,
    publish_settings, set_bound, slot_primaries, withdraw_idempotence,
};
pub use pool::{Conn, Credentials, PoolKey, Pools, Sentinel, Target, Tls, canonical_url, server_identity};
