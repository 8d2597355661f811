//! The `RedisServer` controller: each server object's status says whether the server answers with the object's
//! credentials, what it runs, and how many policies use it. What the policies do with a server (admission, the
//! connection, following its changes) is the policy controller's; this one only looks and reports.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::jiff::Timestamp;
use kube::api::Api;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::watcher;
use kube::{Resource, ResourceExt};
use tracing::{instrument, warn};

use crate::api::{RedisServer, RedisServerStatus};
use crate::context::Shared;
use crate::context::conditions::{Verdict, verdict_conditions};
use crate::telemetry::ServerSnapshot;
use crate::{Error, Result};

/// How often a server is looked at again (its policies count, whether it still answers).
const RECHECK: Duration = Duration::from_secs(30);
/// How soon a replica that may not write (yet) looks again.
const NOT_LEADING_RECHECK: Duration = Duration::from_secs(1);

/// Runs the controller until `shutdown` resolves: servers of `namespace`, or of all namespaces. An operator that
/// serves one shard (`label_selector`) writes the status of the servers with its shard's label only, and counts its
/// own policies there: two shards writing one server's status would undo each other's counts. (Every shard
/// resolves every server for its policies.)
pub async fn run(
    shared: Arc<Shared>,
    namespace: Option<String>,
    label_selector: Option<String>,
    shutdown: impl Future<Output = ()> + Send + Sync + 'static,
) {
    let api: Api<RedisServer> = match &namespace {
        Some(ns) => Api::namespaced(shared.client.clone(), ns),
        None => Api::all(shared.client.clone()),
    };
    let mut config = watcher::Config::default();
    if let Some(selector) = &label_selector {
        config = config.labels(selector);
    }
    let controller = Controller::new(api, config);
    // The servers whose status this operator writes (its shard's), as the leader's series.
    let (servers, leadership) = (controller.store(), shared.leadership.clone());
    shared.metrics.watch_servers(move || if leadership.may_write() { snapshots(&servers.state()) } else { vec![] });
    controller.graceful_shutdown_on(shutdown).run(reconcile, error_policy, shared).for_each(|_| async {}).await;
}

#[instrument(skip_all, fields(namespace = server.namespace().unwrap_or_default(), server = server.name_any()))]
async fn reconcile(server: Arc<RedisServer>, shared: Arc<Shared>) -> Result<Action> {
    if !shared.leadership.may_write() {
        return Ok(Action::requeue(NOT_LEADING_RECHECK));
    }
    let previous = server.status.clone().unwrap_or_default();
    let reference = Some((server.namespace().unwrap_or_default(), server.name_any()));
    let policies = shared.policies.state().iter().filter(|p| p.server_ref() == reference).count() as i64;
    let (verdict, version) = match check(&server, &shared).await {
        Ok(info) => {
            let note = format!("{info} answers with the credentials of the spec; {policies} policies use it");
            (Verdict::Ready(note), Some(info.to_string()))
        }
        Err(e) => (
            Verdict::Failed { reason: e.reason(), message: on_a_server(&e.to_string()), stalled: e.is_stalled() },
            previous.server_version.clone(),
        ),
    };
    let generation = server.meta().generation;
    let next = RedisServerStatus {
        conditions: verdict_conditions(&previous.conditions, verdict, generation, Timestamp::now()),
        observed_generation: generation,
        server_version: version,
        policies,
    };
    if next != previous {
        shared.apply_status(server.as_ref(), &next).await?;
        let insecure =
            server.spec.tls.as_ref().is_some_and(|t| t.insecure_skip_verify).then_some("spec.tls.insecureSkipVerify");
        let conditions = (&previous.conditions[..], &next.conditions[..]);
        shared.announce_ready(&server.object_ref(&()), "Check", conditions, insecure).await;
    }
    Ok(Action::requeue(RECHECK))
}

/// The series of the servers as their status says (the watch's view of what the leader wrote).
fn snapshots(servers: &[Arc<RedisServer>]) -> Vec<ServerSnapshot> {
    servers
        .iter()
        .map(|server| {
            let status = server.status.clone().unwrap_or_default();
            ServerSnapshot {
                namespace: server.namespace().unwrap_or_default(),
                name: server.name_any(),
                ready: status.conditions.iter().any(|c| c.type_ == "Ready" && c.status == "True"),
                policies: status.policies,
            }
        })
        .collect()
}

/// The server's Secrets resolve, and it answers `INFO server` with them.
async fn check(server: &RedisServer, shared: &Shared) -> Result<crate::redis::ServerInfo> {
    let target = shared.server_target(server).await?;
    let info = shared.pools.probe(&target).await?;
    if !info.is_supported() {
        return Err(Error::UnsupportedServerVersion { server: target.server(), version: info.to_string() });
    }
    Ok(info)
}

fn error_policy(server: Arc<RedisServer>, error: &Error, _shared: Arc<Shared>) -> Action {
    warn!(namespace = server.namespace(), server = server.name_any(), reason = error.reason(), error = %error, "server status failed; retrying");
    Action::requeue(RECHECK)
}

/// An error's message as a `RedisServer`'s condition says it: the connection errors name the policy's fields
/// (`spec.redis.url`, `spec.redis.tls`, `spec.redis.sentinel.masterName`), which a RedisServer has one level up
/// (`spec.url`, `spec.tls`, `spec.sentinel.masterName`).
fn on_a_server(message: &str) -> String {
    message.replace("spec.redis.", "spec.")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_servers_conditions_name_its_own_fields() {
        let error = Error::NotACluster { server: "redis://r:6379".into() };
        let message = on_a_server(&error.to_string());
        assert!(message.starts_with("spec.mode is Cluster"), "{message}");
        assert!(message.contains("point spec.url at a cluster node"), "{message}");
        assert!(!message.contains("spec.redis"), "{message}");
    }
}
