//! `pelican local`: the operator's jobs for ConsumerGroupPolicy files, on a Redis without Kubernetes, for a worker
//! developer's machine (docs/src/development/local.md).
//!
//! The files are checked as `kubectl apply` would check them ([`admission`]), then each policy goes through the
//! reconcile's own phases 2 and 3 ([`crate::controller::validate_and_converge`]: validation against the other
//! policies, the group, the worker settings hash, the jobs handed to the [`Runner`], the probe), again every
//! `spec.reclaim.interval`. What is left out is what needs a cluster: Secrets (the password comes from
//! `--redis-url` or `PELICAN_REDIS_PASSWORD`), the leader Lease, status, Events (their notes are printed instead)
//! and `spec.consumers.pods`.

mod admission;

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context as _, bail};
use kube::ResourceExt;
use redis::IntoConnectionInfo;
use serde::Deserialize;
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::api::{ConsumerGroupPolicy, RedisMode};
use crate::context::policy_id;
use crate::controller::{Announcement, Claimant, Host, Observation, validate, validate_and_converge};
use crate::leader::Leadership;
use crate::redis::{Credentials, PoolKey, Pools, Sentinel, Target, Tls, Unread};
use crate::runner::{Announcer, PodWatch, Runner, Said};

pub use admission::admit_spec;

/// How soon a policy whose server did not answer is converged again.
const RETRY_AFTER: Duration = Duration::from_secs(5);

/// What `pelican local` was asked for.
pub struct Options {
    /// Policy files, and directories whose `.yaml`, `.yml` and `.json` files are read.
    pub files: Vec<PathBuf>,
    /// The server for every policy, instead of each spec's `redis.url`; may carry `user:password@`.
    pub redis_url: Option<String>,
    /// Username and password when the URL carries none (`PELICAN_REDIS_USERNAME`, `PELICAN_REDIS_PASSWORD`).
    pub credentials: Credentials,
    /// How often each group's health is printed.
    pub status_every: Duration,
}

/// Runs the policies' jobs until `stop`. Returns an error, before anything is written, when a file is refused.
pub async fn run(options: Options, stop: impl Future<Output = ()>) -> anyhow::Result<()> {
    let mut policies = load(&options.files)?;
    let mut credentials = options.credentials.clone();
    if let Some(url) = &options.redis_url {
        let (url, carried) = without_credentials(url, &options.credentials)?;
        // The server every policy is on, as if its spec named it: so the validation compares the real servers.
        for policy in &mut policies {
            let policy = Arc::make_mut(policy);
            (policy.spec.redis.url, policy.spec.redis.server_ref) = (url.clone(), None);
        }
        credentials = carried;
    }
    let targets: Vec<Target> = policies.iter().map(|p| target(p, &credentials)).collect::<anyhow::Result<_>>()?;
    // Every policy is validated against the others before any is converged, so a refused one writes nothing.
    let refused: Vec<String> = policies
        .iter()
        .zip(&targets)
        .filter_map(|(policy, target)| validate(policy, &policies, target.cluster).err().map(|e| (policy, e)))
        .map(|(policy, e)| format!("{}: {}: {e}", policy_id(policy), e.reason()))
        .collect();
    if !refused.is_empty() {
        bail!("{}", refused.join("\n"));
    }
    let (said, mut heard) = mpsc::unbounded_channel();
    let pools = Arc::new(Pools::default());
    let host = Local {
        runner: Runner::new(Leadership::always(), Announcer::Channel(said), Arc::default(), pools.clone()),
        pools,
        users: Mutex::default(),
        unread: Mutex::default(),
        // A restarted `pelican local` on the same machine is the same claimant: it takes its groups back at once.
        claimant: Claimant { id: format!("local/{}", hostname()), passive: false },
    };
    let mut schedules = vec![Schedule::default(); policies.len()];
    let mut first = true;
    tokio::pin!(stop);
    loop {
        let now = Instant::now();
        for (i, policy) in policies.iter().enumerate() {
            let Schedule { converge_at, status_at, converged } = &mut schedules[i];
            if *converge_at > now {
                continue;
            }
            match validate_and_converge(policy, &host, &targets[i], None, &policies).await {
                Ok(seen) => {
                    if !std::mem::replace(converged, true) {
                        line(&policy_id(policy), &format!("running on {}", targets[i].server()));
                    }
                    if *status_at <= now {
                        line(&policy_id(policy), &health(&seen));
                        *status_at = now + options.status_every;
                    }
                    *converge_at = now + seen.interval;
                    host.unread.lock().expect("unread lock").insert(policy_id(policy), seen.facts.unread);
                }
                // Only a person can fix it (a spec the validation refuses, a conflict, a key of the wrong type):
                // refused at the start, and a policy that fails so later stops its jobs until it heals.
                Err(e) if e.is_stalled() && first => bail!("{}: {}: {e}", policy_id(policy), e.reason()),
                Err(e) => {
                    if e.is_stalled() {
                        host.runner.stop(&policy_id(policy));
                    }
                    line(
                        &policy_id(policy),
                        &format!("{}: {e}; trying again in {}s", e.reason(), RETRY_AFTER.as_secs()),
                    );
                    *converge_at = now + RETRY_AFTER;
                }
            }
        }
        first = false;
        let next = schedules.iter().map(|s| s.converge_at).min().unwrap_or(now + RETRY_AFTER);
        tokio::select! {
            () = &mut stop => break,
            Some(said) = heard.recv() => line(&said.policy, &said_line(&said)),
            () = tokio::time::sleep_until(next) => {}
        }
    }
    for policy in &policies {
        host.runner.stop(&policy_id(policy));
    }
    println!("stopped");
    Ok(())
}

/// When a policy is converged next and its health printed next, and whether it ever converged.
#[derive(Clone)]
struct Schedule {
    converge_at: Instant,
    status_at: Instant,
    converged: bool,
}

impl Default for Schedule {
    fn default() -> Schedule {
        Schedule { converge_at: Instant::now(), status_at: Instant::now(), converged: false }
    }
}

/// One line of output: the time, the policy, what happened.
fn line(policy: &str, what: &str) {
    let now = jiff::Zoned::now();
    println!("{} {policy}: {what}", now.strftime("%H:%M:%S"));
}

/// A job's announcement as a line: its Event's note, with the reason of a warning.
fn said_line(said: &Said) -> String {
    match said.type_ {
        kube::runtime::events::EventType::Warning => format!("{} ({})", said.note, said.reason),
        kube::runtime::events::EventType::Normal => said.note.clone(),
    }
}

/// The group's health as the status shows it: pending entries, the oldest, lag, dead letters, consumers.
fn health(seen: &Observation) -> String {
    let facts = &seen.facts;
    let oldest = facts.oldest_pending.as_ref().map_or_else(String::new, |o| {
        format!(" (oldest {}: idle {}s, deliveries {}, held by {})", o.id, o.idle_ms / 1000, o.deliveries, o.consumer)
    });
    let lag = facts.lag.map_or_else(|| "unknown".to_string(), |lag| lag.to_string());
    format!(
        "health: pending {}{oldest}, lag {lag}, dead letters {}, consumers {}, stream length {}",
        facts.pending, facts.dead_letter_length, facts.consumers, facts.stream_length
    )
}

/// The loop's side of the reconcile's phases: its own pools and runner, announcements printed.
struct Local {
    pools: Arc<Pools>,
    runner: Runner,
    users: Mutex<HashMap<String, PoolKey>>,
    unread: Mutex<HashMap<String, Option<Unread>>>,
    claimant: Claimant,
}

/// This machine's name, as the kernel has it.
fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname").map_or_else(|_| "localhost".into(), |n| n.trim().to_string())
}

impl Host for Local {
    fn pools(&self) -> &Arc<Pools> {
        &self.pools
    }

    fn claimant(&self) -> &Claimant {
        &self.claimant
    }

    fn runner(&self) -> &Runner {
        &self.runner
    }

    fn uses(&self, policy: &ConsumerGroupPolicy, target: &Target) {
        self.pools.assign(&self.users, &policy_id(policy), Some(target));
    }

    fn unread(&self, policy: &ConsumerGroupPolicy) -> Option<Unread> {
        self.unread.lock().expect("unread lock").get(&policy_id(policy)).cloned().flatten()
    }

    fn pods(&self) -> Option<PodWatch> {
        None
    }

    async fn announce(&self, policy: &ConsumerGroupPolicy, said: Announcement) {
        line(&policy_id(policy), &said.note);
    }
}

/// The ConsumerGroupPolicies of the files (a directory: its `.yaml`, `.yml` and `.json` files, in name order), each
/// admitted as the API server would, with its defaults; documents of other kinds are skipped, saying so.
pub fn load(paths: &[PathBuf]) -> anyhow::Result<Vec<Arc<ConsumerGroupPolicy>>> {
    let mut files = Vec::new();
    for path in paths {
        if path.is_dir() {
            let mut listed: Vec<PathBuf> = std::fs::read_dir(path)
                .with_context(|| format!("reading {}", path.display()))?
                .map(|entry| entry.map(|e| e.path()))
                .collect::<Result<_, _>>()?;
            listed.retain(|p| p.extension().is_some_and(|ext| ext == "yaml" || ext == "yml" || ext == "json"));
            listed.sort();
            files.extend(listed);
        } else {
            files.push(path.clone());
        }
    }
    let mut policies: BTreeMap<String, Arc<ConsumerGroupPolicy>> = BTreeMap::new();
    let mut refused = Vec::new();
    for file in &files {
        let text = std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
        for document in serde_yaml::Deserializer::from_str(&text) {
            let document =
                serde_json::Value::deserialize(document).with_context(|| format!("parsing {}", file.display()))?;
            match policy(file, document) {
                Ok(None) => {}
                Ok(Some(policy)) => {
                    let id = policy_id(&policy);
                    if policies.insert(id.clone(), Arc::new(policy)).is_some() {
                        refused.push(format!("{}: ConsumerGroupPolicy {id} is given twice", file.display()));
                    }
                }
                Err(e) => refused.push(e),
            }
        }
    }
    if !refused.is_empty() {
        bail!("{}", refused.join("\n"));
    }
    if policies.is_empty() {
        bail!(
            "no ConsumerGroupPolicy in {}",
            files.iter().map(|f| f.display().to_string()).collect::<Vec<_>>().join(", ")
        );
    }
    Ok(policies.into_values().collect())
}

/// One document: a ConsumerGroupPolicy admitted and defaulted, `None` for another kind, or why it is refused.
fn policy(file: &Path, mut document: serde_json::Value) -> Result<Option<ConsumerGroupPolicy>, String> {
    if document.is_null() {
        return Ok(None);
    }
    let (kind, api_version) =
        (document["kind"].as_str().unwrap_or_default(), document["apiVersion"].as_str().unwrap_or_default());
    let name = document["metadata"]["name"].as_str().unwrap_or_default().to_string();
    if kind != "ConsumerGroupPolicy" || !api_version.starts_with("pelican.io/") {
        println!("{}: skipped {kind} {name:?}: `pelican local` runs ConsumerGroupPolicies only", file.display());
        return Ok(None);
    }
    let refuse = |what: String| Err(format!("{}: The ConsumerGroupPolicy {name:?} is invalid: {what}", file.display()));
    if api_version != "pelican.io/v1alpha1" {
        return refuse(format!("apiVersion {api_version:?}: this pelican knows pelican.io/v1alpha1"));
    }
    if name.is_empty() {
        return refuse("metadata.name: Required value: name is required".into());
    }
    if let Err(errors) = admit_spec(&mut document["spec"]) {
        return refuse(errors.join(", "));
    }
    // What the API server keeps of a new object: no status, and the namespace kubectl gives it.
    document.as_object_mut().map(|d| d.remove("status"));
    let mut policy: ConsumerGroupPolicy =
        serde_json::from_value(document).map_err(|e| format!("{}: {name}: {e}", file.display()))?;
    let namespace = policy.namespace().unwrap_or_else(|| "default".into());
    policy.metadata.uid = Some(format!("local:{namespace}/{name}"));
    policy.metadata.namespace = Some(namespace);
    Ok(Some(policy))
}

/// `--redis-url` split into a URL without credentials (never printed with them) and the credentials it carried, or
/// else those of the environment.
fn without_credentials(url: &str, credentials: &Credentials) -> anyhow::Result<(String, Credentials)> {
    let info = url.into_connection_info().map_err(|e| anyhow::anyhow!("--redis-url: {e}"))?;
    let (scheme, rest) = url.split_once("://").context("--redis-url: redis://host:port or rediss://host:port")?;
    let (authority, path) = rest.split_once('/').map_or((rest, ""), |(a, p)| (a, p));
    let host = authority.rsplit_once('@').map_or(authority, |(_, host)| host);
    let bare = if path.is_empty() { format!("{scheme}://{host}") } else { format!("{scheme}://{host}/{path}") };
    let settings = info.redis_settings();
    let carried = Credentials {
        username: settings.username().map(str::to_string),
        password: settings.password().map(str::to_string),
    };
    let credentials =
        if carried.password.is_some() || carried.username.is_some() { carried } else { credentials.clone() };
    Ok((bare, credentials))
}

/// The server to run a policy's jobs on, the spec's inline `url` (`--redis-url` put there), with the credentials
/// given to `pelican local` (a Secret has no value without a cluster).
fn target(policy: &ConsumerGroupPolicy, credentials: &Credentials) -> anyhow::Result<Target> {
    let redis = &policy.spec.redis;
    if let Some(server) = &redis.server_ref {
        bail!(
            "{}: spec.redis.serverRef names the RedisServer {:?}, which only a cluster resolves: give --redis-url",
            policy_id(policy),
            server
        );
    }
    let tls =
        Tls { insecure_skip_verify: redis.tls.as_ref().is_some_and(|t| t.insecure_skip_verify), ..Tls::default() };
    let sentinel = redis
        .sentinel
        .as_ref()
        .filter(|_| redis.mode == RedisMode::Sentinel)
        .map(|s| Sentinel { master_name: s.master_name.clone(), credentials: Credentials::default() });
    let (url, credentials) = (redis.url.clone(), credentials.clone());
    Ok(Target { url, credentials, tls, cluster: redis.mode == RedisMode::Cluster, sentinel })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_in_the_url_are_taken_out_of_it() {
        let none = Credentials::default();
        let (url, carried) = without_credentials("redis://app:s%40cret@127.0.0.1:6380/2", &none).unwrap();
        assert_eq!(url, "redis://127.0.0.1:6380/2");
        assert_eq!((carried.username.as_deref(), carried.password.as_deref()), (Some("app"), Some("s@cret")));
        let env = Credentials { username: None, password: Some("from-env".into()) };
        let (url, used) = without_credentials("redis://127.0.0.1:6379", &env).unwrap();
        assert_eq!((url.as_str(), used), ("redis://127.0.0.1:6379", env));
    }
}
