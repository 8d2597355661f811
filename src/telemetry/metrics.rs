//! Prometheus metrics: controller-runtime-compatible reconcile metrics, and per-policy series
//! that mirror the status at scrape time, labelled with namespace, policy, stream and group.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::api::ConsumerGroupPolicyStatus;
use crate::leader::Leadership;

/// The `controller` label of the reconcile metrics.
pub const CONTROLLER: &str = "consumergrouppolicy";

type Labels = Vec<(&'static str, String)>;

pub struct Metrics {
    registry: Registry,
    reconcile_total: Family<Labels, Counter>,
    reconcile_errors: Family<Labels, Counter>,
    reconcile_time: Family<Labels, Histogram>,
    pass_delay: Histogram,
    passes: Counter,
    scaler_answers: Family<Labels, Counter>,
    scaler_reads: Counter,
    seeks: Family<Labels, Counter>,
    redrives: Family<Labels, Counter>,
    servers: Arc<ServerSeries>,
    policies: Arc<PolicySeries>,
    job_failures: Arc<JobFailureSeries>,
    leader: Arc<LeaderSeries>,
    state: Arc<StateSeries>,
    in_flight: Arc<InFlightSeries>,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::default();
        let reconcile_total = Family::<Labels, Counter>::default();
        let reconcile_errors = Family::<Labels, Counter>::default();
        let reconcile_time =
            Family::<Labels, Histogram>::new_with_constructor(|| Histogram::new(exponential_buckets(0.001, 2.0, 14)));
        registry.register(
            "controller_runtime_reconcile",
            "Total number of reconciliations per controller",
            reconcile_total.clone(),
        );
        registry.register(
            "controller_runtime_reconcile_errors",
            "Total number of reconciliation errors per controller",
            reconcile_errors.clone(),
        );
        registry.register(
            "controller_runtime_reconcile_time_seconds",
            "Length of time per reconciliation per controller",
            reconcile_time.clone(),
        );
        // 1 ms .. 65 s: a pass that waits longer than its interval shows here.
        let pass_delay = Histogram::new(exponential_buckets(0.001, 2.0, 17));
        registry.register(
            "pelican_pass_delay_seconds",
            "Time a reclaim pass waited for one of its server's pass permits",
            pass_delay.clone(),
        );
        let passes = Counter::default();
        registry.register("pelican_passes", "Reclaim / dead-letter passes run", passes.clone());
        let scaler_answers = Family::<Labels, Counter>::default();
        registry.register(
            "pelican_scaler_answers",
            "Answers of KEDA's external scaler, by method and gRPC code (OK, NotFound, FailedPrecondition, ...)",
            scaler_answers.clone(),
        );
        let scaler_reads = Counter::default();
        registry.register(
            "pelican_scaler_backlog_reads",
            "Backlog reads (XINFO GROUPS + XLEN) made to answer KEDA: at most one per policy per second",
            scaler_reads.clone(),
        );
        let seeks = Family::<Labels, Counter>::default();
        registry.register(
            "pelican_seeks",
            "GroupSeeks finished, by result: Seeked, Planned (a dry run), or the reason one was refused",
            seeks.clone(),
        );
        let redrives = Family::<Labels, Counter>::default();
        registry.register(
            "pelican_redrives",
            "DeadLetterRedrives finished, by result: Complete, DryRun, AlreadyFinished, or the reason one failed",
            redrives.clone(),
        );
        let servers = Arc::new(ServerSeries::default());
        registry.register_collector(Box::new(servers.clone()));
        let policies = Arc::new(PolicySeries::default());
        registry.register_collector(Box::new(policies.clone()));
        let job_failures = Arc::new(JobFailureSeries::default());
        registry.register_collector(Box::new(job_failures.clone()));
        let leader = Arc::new(LeaderSeries::default());
        registry.register_collector(Box::new(leader.clone()));
        let state = Arc::new(StateSeries::default());
        registry.register_collector(Box::new(state.clone()));
        let in_flight = Arc::new(InFlightSeries::default());
        registry.register_collector(Box::new(in_flight.clone()));
        Metrics {
            registry,
            reconcile_total,
            reconcile_errors,
            reconcile_time,
            pass_delay,
            passes,
            scaler_answers,
            scaler_reads,
            seeks,
            redrives,
            servers,
            policies,
            job_failures,
            leader,
            state,
            in_flight,
        }
    }
}

impl Metrics {
    /// Records one reconcile; `error` is the reason it failed, the error's condition reason (`RedisUnavailable`,
    /// `KubernetesApiError`, ...), which labels the error counter.
    pub fn reconciled(&self, took: Duration, error: Option<&'static str>) {
        let controller: Labels = vec![("controller", CONTROLLER.into())];
        let result = if error.is_some() { "error" } else { "success" };
        self.reconcile_total.get_or_create(&vec![("controller", CONTROLLER.into()), ("result", result.into())]).inc();
        if let Some(reason) = error {
            self.reconcile_errors
                .get_or_create(&vec![("controller", CONTROLLER.into()), ("reason", reason.into())])
                .inc();
        }
        self.reconcile_time.get_or_create(&controller).observe(took.as_secs_f64());
    }

    /// Marks a policy's reconcile as running until the guard is dropped, for `pelican_reconciles_in_flight`.
    pub fn reconcile_started(&self, key: PolicyKey) -> InFlight {
        self.in_flight.0.lock().expect("metrics lock").insert(key.clone(), Instant::now());
        InFlight { series: self.in_flight.clone(), key }
    }

    /// Records the start of a pass that was due `delay` ago.
    pub fn pass_started(&self, delay: Duration) {
        self.passes.inc();
        self.pass_delay.observe(delay.as_secs_f64());
    }

    /// Counts one answer of the external scaler.
    pub fn scaler_answered(&self, method: &'static str, code: &str) {
        self.scaler_answers.get_or_create(&vec![("method", method.into()), ("code", code.into())]).inc();
    }

    /// Counts one backlog read made for the external scaler.
    pub fn scaler_read(&self) {
        self.scaler_reads.inc();
    }

    /// Counts one finished seek by its result.
    pub fn seek_finished(&self, result: &str) {
        self.seeks.get_or_create(&vec![("result", result.to_string())]).inc();
    }

    /// Counts one finished redrive by its result.
    pub fn redrive_finished(&self, result: &str) {
        self.redrives.get_or_create(&vec![("result", result.to_string())]).inc();
    }

    /// `pelican_redis_server_ready` and `pelican_redis_server_policies` read the `RedisServer`s from `source` at
    /// scrape time (the leader's view; none on a replica that does not lead).
    pub fn watch_servers(&self, source: impl Fn() -> Vec<ServerSnapshot> + Send + Sync + 'static) {
        self.servers.0.set(source);
    }

    /// How much of each policy the series show from now on.
    pub fn set_detail(&self, detail: MetricsDetail) {
        *self.policies.1.lock().expect("metrics lock") = detail;
    }

    /// Publishes a policy's status as its series.
    pub fn observe_policy(&self, key: PolicyKey, snapshot: PolicySnapshot) {
        self.policies.0.lock().expect("metrics lock").insert(key, snapshot);
    }

    /// `pelican_state_entries{map}` reads the sizes of the operator's in-memory maps from `source` at scrape time.
    pub fn watch_state(&self, source: impl Fn() -> Vec<(&'static str, usize)> + Send + Sync + 'static) {
        self.state.0.set(source);
    }

    /// `pelican_leader{lease}` follows `leadership` from now on: 1 while this replica may write, else 0.
    pub fn watch_leadership(&self, lease: &str, leadership: Leadership) {
        *self.leader.0.lock().expect("metrics lock") = Some((lease.to_string(), leadership));
    }

    /// Drops a deleted policy's series.
    pub fn forget_policy(&self, key: &PolicyKey) {
        self.policies.0.lock().expect("metrics lock").remove(key);
        self.job_failures.0.lock().expect("metrics lock").retain(|(policy, _, _), _| policy != key);
    }

    /// Counts one failed run of a policy's job (`reclaim`, `retention`, `consumer-expiry`, `consumer-pods`) by the
    /// error's reason.
    pub fn job_failed(&self, key: PolicyKey, job: &'static str, reason: &'static str) {
        *self.job_failures.0.lock().expect("metrics lock").entry((key, job, reason)).or_default() += 1;
    }

    /// The Prometheus text exposition format (version 0.0.4).
    pub fn render(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::prometheus_text::encode(&mut out, &self.registry).expect("metrics encode");
        out
    }
}

/// Namespace and name of a policy.
pub type PolicyKey = (String, String);

/// What the series of one policy show.
#[derive(Clone, Debug, Default)]
pub struct PolicySnapshot {
    pub stream: String,
    pub group: String,
    pub ready: bool,
    pub status: ConsumerGroupPolicyStatus,
    /// Server time minus the oldest pending id's time.
    pub oldest_pending_age_seconds: Option<i64>,
    /// `spec.backlog.maxLength`, when set.
    pub backlog_max_length: Option<i64>,
}

/// Where a collector reads its values at scrape time, once the operator has told it.
struct Source<T>(Mutex<Option<Box<dyn Fn() -> T + Send + Sync>>>);

impl<T> Default for Source<T> {
    fn default() -> Self {
        Source(Mutex::new(None))
    }
}

impl<T> std::fmt::Debug for Source<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Source")
    }
}

impl<T> Source<T> {
    fn set(&self, source: impl Fn() -> T + Send + Sync + 'static) {
        *self.0.lock().expect("metrics lock") = Some(Box::new(source));
    }

    /// The values now; none before the source is set.
    fn read(&self) -> Option<T> {
        self.0.lock().expect("metrics lock").as_ref().map(|source| source())
    }
}

/// Entries of the operator's in-memory maps (tasks, connections, cached Secrets, ...): they follow the policies, so a
/// count that only grows is a leak.
#[derive(Debug, Default)]
struct StateSeries(Source<Vec<(&'static str, usize)>>);

impl Collector for StateSeries {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Some(maps) = self.0.read() else {
            return Ok(());
        };
        let mut metric = encoder.encode_descriptor(
            "pelican_state_entries",
            "Entries of the operator's in-memory maps, by map; they follow the policies and return when policies go",
            None,
            ConstGauge::new(0i64).metric_type(),
        )?;
        for (map, entries) in maps {
            let labels: Labels = vec![("map", map.to_string())];
            ConstGauge::new(entries as i64).encode(metric.encode_family(&labels)?)?;
        }
        Ok(())
    }
}

/// Whether this replica leads, read at scrape time (the Lease can be lost between two reconciles).
#[derive(Debug, Default)]
struct LeaderSeries(Mutex<Option<(String, Leadership)>>);

impl Collector for LeaderSeries {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Some((lease, leadership)) = self.0.lock().expect("metrics lock").clone() else {
            return Ok(());
        };
        let mut metric = encoder.encode_descriptor(
            "pelican_leader",
            "1 while this replica holds its leader Lease and may write (always 1 without leader election)",
            None,
            ConstGauge::new(0i64).metric_type(),
        )?;
        let labels: Labels = vec![("lease", lease)];
        ConstGauge::new(leadership.may_write() as i64).encode(metric.encode_family(&labels)?)
    }
}

/// What the series of one `RedisServer` show.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerSnapshot {
    pub namespace: String,
    pub name: String,
    /// Its `Ready` condition is True: it answers with the credentials of its spec.
    pub ready: bool,
    /// Policies that name it (`status.policies`).
    pub policies: i64,
}

/// Name, help, and the value of one server.
type ServerGauge = (&'static str, &'static str, fn(&ServerSnapshot) -> i64);

#[derive(Debug, Default)]
struct ServerSeries(Source<Vec<ServerSnapshot>>);

impl Collector for ServerSeries {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let servers = self.0.read().unwrap_or_default();
        if servers.is_empty() {
            return Ok(());
        }
        let series: [ServerGauge; 2] = [
            ("pelican_redis_server_ready", "1 when the RedisServer's Ready condition is True", |s| s.ready as i64),
            ("pelican_redis_server_policies", "Policies that name the RedisServer", |s| s.policies),
        ];
        for (name, help, value) in series {
            let mut metric = encoder.encode_descriptor(name, help, None, ConstGauge::new(0i64).metric_type())?;
            for server in &servers {
                let labels: Labels = vec![("namespace", server.namespace.clone()), ("server", server.name.clone())];
                ConstGauge::new(value(server)).encode(metric.encode_family(&labels)?)?;
            }
        }
        Ok(())
    }
}

/// Name, help, and the value of one policy (no series when `None`).
type Series = (&'static str, &'static str, fn(&PolicySnapshot) -> Option<i64>);

/// How much of each policy `/metrics` shows (`pelican run --metrics-detail`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum MetricsDetail {
    /// Every series per policy (labels namespace, policy, stream, group).
    #[default]
    Full,
    /// Per policy only the series the chart's alerts and dashboard read (at most 14); the rest summed
    /// (ages: their maximum) per namespace, with the `namespace` label only.
    Essential,
}

/// The per-policy series the chart's alerts and dashboard read: kept per policy with `--metrics-detail essential`.
pub const ESSENTIAL: [&str; 14] = [
    "pelican_policy_ready",
    "pelican_group_pending",
    "pelican_group_oldest_pending_age_seconds",
    "pelican_group_lag",
    "pelican_group_lag_seconds",
    "pelican_group_backlog",
    "pelican_group_backlog_max_length",
    "pelican_stream_length",
    "pelican_dead_letter_stream_length",
    "pelican_group_consuming",
    "pelican_dead_lettered",
    "pelican_requeued",
    "pelican_publish_rejected",
    "pelican_trimmed",
];

/// Series whose per-namespace value is the largest of its policies' (an age), not their sum.
const TAKE_MAX: [&str; 2] = ["pelican_group_oldest_pending_idle_seconds", "pelican_group_drain_seconds"];

#[derive(Debug, Default)]
struct PolicySeries(Mutex<BTreeMap<PolicyKey, PolicySnapshot>>, Mutex<MetricsDetail>);

impl PolicySeries {
    /// The series of `name` for every policy: (labels, value). Per policy, or per namespace (and the extra labels)
    /// where `--metrics-detail essential` leaves the name out of [`ESSENTIAL`].
    fn series<T: Copy + std::ops::Add<Output = T> + PartialOrd>(
        &self,
        name: &str,
        policies: &BTreeMap<PolicyKey, PolicySnapshot>,
        values: impl Fn(&PolicySnapshot) -> Vec<(Labels, T)>,
    ) -> Vec<(Labels, T)> {
        let per_policy = *self.1.lock().expect("metrics lock") == MetricsDetail::Full || ESSENTIAL.contains(&name);
        let mut out = Vec::new();
        let mut by_namespace: BTreeMap<Labels, T> = BTreeMap::new();
        for ((namespace, policy), p) in policies {
            for (extra, value) in values(p) {
                if per_policy {
                    let mut labels: Labels = vec![
                        ("namespace", namespace.clone()),
                        ("policy", policy.clone()),
                        ("stream", p.stream.clone()),
                        ("group", p.group.clone()),
                    ];
                    labels.extend(extra);
                    out.push((labels, value));
                } else {
                    let mut labels: Labels = vec![("namespace", namespace.clone())];
                    labels.extend(extra);
                    let take_max = TAKE_MAX.contains(&name);
                    by_namespace
                        .entry(labels)
                        .and_modify(|v| *v = if take_max { if value > *v { value } else { *v } } else { *v + value })
                        .or_insert(value);
                }
            }
        }
        out.extend(by_namespace);
        out
    }
}

impl Collector for PolicySeries {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let policies = self.0.lock().expect("metrics lock");
        let gauges: [Series; 13] = [
            ("pelican_group_pending", "Entries in the group's PEL", |p| p.status.pending),
            ("pelican_group_oldest_pending_age_seconds", "Age of the oldest pending entry, from its id", |p| {
                p.oldest_pending_age_seconds
            }),
            ("pelican_group_oldest_pending_idle_seconds", "Idle time of the oldest pending entry", |p| {
                p.status.oldest_pending_idle_seconds
            }),
            ("pelican_group_lag", "Entries not yet delivered to the group (absent when unknown)", |p| p.status.lag),
            ("pelican_group_lag_seconds", "Age of the oldest entry not yet delivered to the group (0: none)", |p| {
                p.status.lag_seconds
            }),
            (
                "pelican_group_drain_seconds",
                "Seconds until the backlog is gone at the rate it shrank over the window (absent while it does not)",
                |p| p.status.drain_seconds,
            ),
            ("pelican_group_consumers", "Consumers of the group", |p| p.status.consumers),
            (
                "pelican_group_backlog",
                "Entries the group has not acknowledged: lag + pending, or XLEN + pending when the lag is unknown",
                |p| p.status.backlog,
            ),
            ("pelican_group_backlog_max_length", "spec.backlog.maxLength of the group (absent when unbounded)", |p| {
                p.backlog_max_length
            }),
            ("pelican_stream_length", "Entries in the source stream", |p| p.status.stream_length),
            ("pelican_dead_letter_stream_length", "Entries in the dead-letter stream", |p| p.status.dead_letter_length),
            ("pelican_policy_ready", "1 when the policy's Ready condition is True", |p| Some(p.ready as i64)),
            (
                "pelican_idempotent_message_ids",
                "Message ids the server remembers for idempotent production on the stream (XINFO STREAM iids-tracked)",
                |p| p.status.idempotence.as_ref().map(|i| i.message_ids),
            ),
        ];
        for (name, help, value) in gauges {
            let mut metric = encoder.encode_descriptor(name, help, None, ConstGauge::new(0i64).metric_type())?;
            for (labels, v) in self.series(name, &policies, |p| value(p).map(|v| (vec![], v)).into_iter().collect()) {
                ConstGauge::new(v).encode(metric.encode_family(&labels)?)?;
            }
        }
        let counters: [Series; 9] = [
            ("pelican_dead_lettered", "Messages moved to the dead-letter stream", |p| Some(totals(p)?.dead_lettered)),
            ("pelican_requeued", "Messages requeued to the tail of the stream", |p| Some(totals(p)?.requeued)),
            ("pelican_reassigned", "Messages claimed for a live consumer", |p| Some(totals(p)?.reassigned)),
            ("pelican_payload_deleted", "PEL entries dropped because their payload was gone", |p| {
                Some(totals(p)?.payload_deleted)
            }),
            ("pelican_consumers_expired", "Inactive consumers deleted", |p| Some(totals(p)?.consumers_expired)),
            ("pelican_dead_letter_evicted", "Dead-letter entries dropped by spec.deadLetter.maxLen", |p| {
                Some(totals(p)?.dead_letter_evicted)
            }),
            ("pelican_publish_rejected", "Bounded publishes refused because the group's backlog was full", |p| {
                Some(totals(p)?.publish_rejected)
            }),
            ("pelican_trimmed", "Entries trimmed from the stream by spec.retention", |p| Some(totals(p)?.trimmed)),
            (
                "pelican_idempotent_duplicates",
                "Idempotent publishes the server refused as duplicates of the stream (XINFO STREAM iids-duplicates)",
                |p| p.status.idempotence.as_ref().map(|i| i.duplicates),
            ),
        ];
        for (name, help, value) in counters {
            let mut metric = encoder.encode_descriptor(name, help, None, ConstCounter::new(0u64).metric_type())?;
            let values = |p: &PolicySnapshot| value(p).map(|v| (vec![], v.max(0) as u64)).into_iter().collect();
            for (labels, v) in self.series(name, &policies, values) {
                ConstCounter::new(v).encode(metric.encode_family(&labels)?)?;
            }
        }
        let name = "pelican_group_entries_per_second";
        let mut metric = encoder.encode_descriptor(
            name,
            "Entries per second over the window, by kind: added to the stream, read and acknowledged by the group",
            None,
            ConstGauge::new(0f64).metric_type(),
        )?;
        let rates = |p: &PolicySnapshot| {
            let Some(rates) = p.status.rates else { return vec![] };
            [("added", Some(rates.added)), ("read", rates.read), ("acknowledged", rates.acknowledged)]
                .into_iter()
                .filter_map(|(kind, rate)| Some((vec![("kind", kind.to_string())], rate?)))
                .collect()
        };
        for (labels, rate) in self.series(name, &policies, rates) {
            ConstGauge::new(rate).encode(metric.encode_family(&labels)?)?;
        }
        let name = "pelican_group_consuming";
        let mut metric = encoder.encode_descriptor(
            name,
            "1, labelled with the Consuming condition's reason (Progressing, NoConsumers, NotProgressing, ...)",
            None,
            ConstGauge::new(0i64).metric_type(),
        )?;
        let verdicts = |p: &PolicySnapshot| {
            let verdict = p.status.conditions.iter().find(|c| c.type_ == crate::api::CONSUMING);
            verdict.map(|v| (vec![("reason", v.reason.clone())], 1i64)).into_iter().collect()
        };
        for (labels, v) in self.series(name, &policies, verdicts) {
            ConstGauge::new(v).encode(metric.encode_family(&labels)?)?;
        }
        let name = "pelican_terminal_acks";
        let mut metric = encoder.encode_descriptor(
            name,
            "Messages ended as terminal, by reason code",
            None,
            ConstCounter::new(0u64).metric_type(),
        )?;
        let acks = |p: &PolicySnapshot| {
            p.status.terminal_acks.iter().map(|a| (vec![("reason", a.reason.clone())], a.count.max(0) as u64)).collect()
        };
        for (labels, v) in self.series(name, &policies, acks) {
            ConstCounter::new(v).encode(metric.encode_family(&labels)?)?;
        }
        Ok(())
    }
}

/// `pelican_job_failures_total{namespace, policy, task, reason}` (`task`, not `job`: that is Prometheus' own target
/// label): kept per policy so that a deleted policy's series go with it.
#[derive(Debug, Default)]
struct JobFailureSeries(Mutex<BTreeMap<(PolicyKey, &'static str, &'static str), u64>>);

impl Collector for JobFailureSeries {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let failures = self.0.lock().expect("metrics lock");
        let mut metric = encoder.encode_descriptor(
            "pelican_job_failures",
            "Failed runs of a policy's jobs (reclaim, retention, consumer-expiry, consumer-pods), by the error's reason",
            None,
            ConstCounter::new(0u64).metric_type(),
        )?;
        for (((namespace, policy), job, reason), count) in failures.iter() {
            let labels: Labels = vec![
                ("namespace", namespace.clone()),
                ("policy", policy.clone()),
                ("task", job.to_string()),
                ("reason", reason.to_string()),
            ];
            ConstCounter::new(*count).encode(metric.encode_family(&labels)?)?;
        }
        Ok(())
    }
}

/// A reconcile in flight; dropping it ends it.
pub struct InFlight {
    series: Arc<InFlightSeries>,
    key: PolicyKey,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.series.0.lock().expect("metrics lock").remove(&self.key);
    }
}

/// `pelican_reconciles_in_flight{age}` and the slowest of them by policy: a reconcile that hangs shows here while it
/// hangs, not only in the duration histogram once it ends.
#[derive(Debug, Default)]
struct InFlightSeries(Mutex<HashMap<PolicyKey, Instant>>);

impl InFlightSeries {
    const AGES: [(&'static str, Duration); 4] = [
        ("<1s", Duration::from_secs(1)),
        ("1s-10s", Duration::from_secs(10)),
        ("10s-30s", Duration::from_secs(30)),
        (">30s", Duration::MAX),
    ];
    /// How many of the longest-running reconciles are named.
    const SLOWEST: usize = 5;
}

impl Collector for InFlightSeries {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let running = self.0.lock().expect("metrics lock");
        let mut ages: Vec<(Duration, &PolicyKey)> = running.iter().map(|(key, at)| (at.elapsed(), key)).collect();
        let mut metric = encoder.encode_descriptor(
            "pelican_reconciles_in_flight",
            "Reconciles running now, by how long they have been running",
            None,
            ConstGauge::new(0i64).metric_type(),
        )?;
        let mut below = Duration::ZERO;
        for (label, limit) in Self::AGES {
            let count = ages.iter().filter(|(age, _)| *age >= below && *age < limit).count();
            ConstGauge::new(count as i64).encode(metric.encode_family(&vec![("age", label.to_string())])?)?;
            below = limit;
        }
        ages.sort_by_key(|(age, _)| std::cmp::Reverse(*age));
        let mut metric = encoder.encode_descriptor(
            "pelican_reconcile_running_seconds",
            "How long the longest-running reconciles (at most five) have been running, by policy",
            None,
            ConstGauge::new(0f64).metric_type(),
        )?;
        for (age, (namespace, policy)) in ages.into_iter().take(Self::SLOWEST) {
            let labels: Labels = vec![("namespace", namespace.clone()), ("policy", policy.clone())];
            ConstGauge::new(age.as_secs_f64()).encode(metric.encode_family(&labels)?)?;
        }
        Ok(())
    }
}

fn totals(p: &PolicySnapshot) -> Option<&crate::api::Totals> {
    p.status.totals.as_ref()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::{TerminalAckCount, Totals};

    /// `--metrics-detail essential`: the alerts' and the dashboard's series per policy, the rest per namespace
    /// (summed; ages at their largest); `full` again shows every series per policy.
    #[test]
    fn essential_detail_keeps_what_alerts_read_per_policy_and_sums_the_rest_per_namespace() {
        let metrics = Metrics::default();
        for (name, consumers, idle, evicted) in [("a", 2, 30, 1), ("b", 3, 90, 4)] {
            let status = ConsumerGroupPolicyStatus {
                pending: Some(7),
                consumers: Some(consumers),
                oldest_pending_idle_seconds: Some(idle),
                totals: Some(Totals { dead_lettered: 1, dead_letter_evicted: evicted, ..Totals::default() }),
                terminal_acks: vec![TerminalAckCount { reason: "Invalid".into(), count: 5 }],
                ..Default::default()
            };
            let snapshot = PolicySnapshot {
                stream: "s".into(),
                group: "g".into(),
                ready: true,
                status,
                oldest_pending_age_seconds: Some(idle),
                backlog_max_length: None,
            };
            metrics.observe_policy(("apps".into(), name.into()), snapshot);
        }
        let full = metrics.render();
        metrics.set_detail(MetricsDetail::Essential);
        let essential = metrics.render();
        let a = r#"namespace="apps",policy="a",stream="s",group="g""#;
        for text in [&full, &essential] {
            assert!(text.contains(&format!("pelican_group_pending{{{a}}} 7")), "{text}");
            assert!(text.contains(&format!("pelican_dead_lettered_total{{{a}}} 1")), "{text}");
            assert!(text.contains(&format!("pelican_policy_ready{{{a}}} 1")), "{text}");
        }
        assert!(full.contains(&format!("pelican_group_consumers{{{a}}} 2")), "{full}");
        assert!(!essential.contains(&format!("pelican_group_consumers{{{a}}}")), "{essential}");
        assert!(essential.contains(r#"pelican_group_consumers{namespace="apps"} 5"#), "{essential}");
        assert!(essential.contains(r#"pelican_dead_letter_evicted_total{namespace="apps"} 5"#), "{essential}");
        assert!(essential.contains(r#"pelican_group_oldest_pending_idle_seconds{namespace="apps"} 90"#), "{essential}");
        assert!(
            essential.contains(r#"pelican_terminal_acks_total{namespace="apps",reason="Invalid"} 10"#),
            "{essential}"
        );
        let series = |text: &str| text.lines().filter(|l| l.starts_with("pelican_")).count();
        assert!(series(&essential) < series(&full), "{} vs {}", series(&essential), series(&full));
        metrics.set_detail(MetricsDetail::Full);
        assert_eq!(metrics.render(), full);
    }

    #[test]
    fn series_mirror_the_status() {
        let metrics = Metrics::default();
        let status = ConsumerGroupPolicyStatus {
            pending: Some(42),
            lag: None,
            totals: Some(Totals { dead_lettered: 12, ..Totals::default() }),
            terminal_acks: vec![TerminalAckCount { reason: "RecordNotFound".into(), count: 40 }],
            ..Default::default()
        };
        let snapshot = PolicySnapshot {
            stream: "s".into(),
            group: "g".into(),
            ready: true,
            status,
            oldest_pending_age_seconds: None,
            backlog_max_length: Some(500),
        };
        metrics.observe_policy(("apps".into(), "p".into()), snapshot);
        metrics.watch_leadership("pelican-leader", Leadership::always());
        metrics.reconciled(Duration::from_millis(3), None);
        metrics.reconciled(Duration::from_millis(3), Some("RedisUnavailable"));
        let text = metrics.render();
        let labels = r#"namespace="apps",policy="p",stream="s",group="g""#;
        assert!(text.contains(&format!("pelican_group_pending{{{labels}}} 42")), "{text}");
        assert!(text.contains(&format!("pelican_dead_lettered_total{{{labels}}} 12")), "{text}");
        assert!(
            text.contains(&format!(r#"pelican_terminal_acks_total{{{labels},reason="RecordNotFound"}} 40"#)),
            "{text}"
        );
        assert!(!text.contains("pelican_group_lag{"), "unknown lag must be absent, not 0:\n{text}");
        assert!(text.contains(&format!("pelican_group_backlog_max_length{{{labels}}} 500")), "{text}");
        assert!(text.contains(r#"pelican_leader{lease="pelican-leader"} 1"#), "{text}");
        metrics.watch_servers(|| {
            let server = |name: &str, ready| ServerSnapshot {
                namespace: "platform".into(),
                name: name.into(),
                ready,
                policies: 3,
            };
            vec![server("shared", true), server("down", false)]
        });
        metrics.redrive_finished("Complete");
        let text = metrics.render();
        assert!(text.contains(r#"pelican_redis_server_ready{namespace="platform",server="down"} 0"#), "{text}");
        assert!(text.contains(r#"pelican_redis_server_ready{namespace="platform",server="shared"} 1"#), "{text}");
        assert!(text.contains(r#"pelican_redis_server_policies{namespace="platform",server="down"} 3"#), "{text}");
        assert!(text.contains(r#"pelican_redrives_total{result="Complete"} 1"#), "{text}");
        let errors = r#"controller_runtime_reconcile_errors_total{controller="consumergrouppolicy",reason="RedisUnavailable"} 1"#;
        assert!(text.contains(errors), "{text}");
        assert!(
            text.contains(r#"controller_runtime_reconcile_total{controller="consumergrouppolicy",result="success"} 1"#),
            "{text}"
        );

        metrics.forget_policy(&("apps".into(), "p".into()));
        assert!(!metrics.render().contains("pelican_group_pending{"));
    }
}
