//! `kubectl pelican status [policy]`: one line per policy from its status; for one policy, its conditions and the
//! oldest pending entries read from the server.

use std::collections::HashMap;

use clap::Args;
use kube::ResourceExt;
use kube::api::{Api, ListParams};
use serde::Serialize;

use super::{Session, age, cell, name_of, now_millis, print_table};
use crate::api::{ConsumerGroupPolicy, ConsumerGroupPolicyStatus};
use crate::keys::{owners_key, partition_stream};
use crate::redis::{Conn, id_millis};

#[derive(Args, Debug)]
pub struct StatusArgs {
    #[command(flatten)]
    pub(super) scope: super::Scope,
    /// One policy (all of the namespace when absent).
    policy: Option<String>,
    /// The policies of every namespace.
    #[arg(short = 'A', long, conflicts_with = "policy")]
    all_namespaces: bool,
    /// How many of the oldest pending entries to show for one policy.
    #[arg(long, default_value_t = 5)]
    pending: usize,
}

/// What `-o json|yaml` prints for each policy.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct PolicyReport {
    namespace: String,
    name: String,
    stream: String,
    group: String,
    ready: String,
    reason: String,
    message: String,
    #[serde(flatten)]
    status: ConsumerGroupPolicyStatus,
    /// Read from the server for a single policy.
    #[serde(skip_serializing_if = "Option::is_none")]
    oldest_pending: Option<Vec<PendingEntry>>,
    /// Why the oldest pending entries could not be read (the server unreachable, say); the rest is the status.
    #[serde(skip_serializing_if = "Option::is_none")]
    oldest_pending_error: Option<String>,
    /// A topic's partitions as the server has them now, for a single policy.
    #[serde(skip_serializing_if = "Option::is_none")]
    partitions: Option<Vec<PartitionReport>>,
}

/// One partition of a topic: its stream, the member that owns it (none while it moves), its pending entries.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct PartitionReport {
    partition: u32,
    stream: String,
    owner: Option<String>,
    pending: i64,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct PendingEntry {
    /// The partition's stream, on a topic.
    #[serde(skip_serializing_if = "Option::is_none")]
    stream: Option<String>,
    id: String,
    consumer: String,
    idle_seconds: i64,
    deliveries: i64,
    age_seconds: Option<i64>,
}

pub(super) async fn run(session: &Session, args: StatusArgs) -> anyhow::Result<()> {
    let policies = match &args.policy {
        Some(name) => vec![session.policy(name).await?],
        None if args.all_namespaces => {
            Api::<ConsumerGroupPolicy>::all(session.client.clone()).list(&ListParams::default()).await?.items
        }
        None => session.policies().list(&ListParams::default()).await?.items,
    };
    let mut reports: Vec<PolicyReport> = policies.iter().map(report).collect();
    if let (Some(policy), Some(report)) = (args.policy.as_ref().and(policies.first()), reports.first_mut()) {
        // The Kubernetes status is shown whatever the server does: that is when people look.
        match from_the_server(session, policy, args.pending).await {
            Ok((entries, partitions)) => (report.oldest_pending, report.partitions) = (Some(entries), partitions),
            Err(e) => report.oldest_pending_error = Some(format!("{e:#}")),
        }
    }
    if args.policy.is_some() {
        let report = reports.pop().expect("one policy");
        if !session.print_structured(&report)? {
            print_one(&report)?;
        }
        return Ok(());
    }
    if session.print_structured(&reports)? {
        return Ok(());
    }
    if reports.is_empty() {
        eprintln!("No ConsumerGroupPolicy found in namespace {:?}.", session.namespace);
        return Ok(());
    }
    let all = args.all_namespaces;
    let mut header = vec![
        "NAME",
        "READY",
        "REASON",
        "PENDING",
        "OLDEST",
        "LAG",
        "LAG-AGE",
        "CONSUMING",
        "DEAD-LETTERED",
        "CONSUMERS",
        "PARTITIONS",
    ];
    if all {
        header.insert(0, "NAMESPACE");
    }
    let rows: Vec<Vec<String>> = reports
        .iter()
        .map(|r| {
            let s = &r.status;
            let oldest = s.oldest_pending_id.as_deref().and_then(id_millis).map(|ms| age((now_millis() - ms) / 1000));
            let consuming = s.conditions.iter().find(|c| c.type_ == crate::api::CONSUMING).map(|c| c.reason.clone());
            let mut row = vec![
                r.name.clone(),
                r.ready.clone(),
                r.reason.clone(),
                cell(s.pending),
                cell(oldest),
                cell(s.lag),
                lag_age(s),
                cell(consuming),
                cell(s.totals.as_ref().map(|t| t.dead_lettered)),
                cell(s.consumers),
                cell(s.partitions.as_ref().map(|p| p.count)),
            ];
            if all {
                row.insert(0, r.namespace.clone());
            }
            row
        })
        .collect();
    print_table(&header, &rows)
}

fn report(policy: &ConsumerGroupPolicy) -> PolicyReport {
    let ready = policy.condition(crate::api::READY);
    PolicyReport {
        namespace: policy.namespace().unwrap_or_default(),
        name: name_of(policy),
        stream: policy.spec.stream.clone(),
        group: policy.spec.group.clone(),
        ready: ready.map_or("Unknown".into(), |c| c.status.clone()),
        reason: ready.map_or("-".into(), |c| c.reason.clone()),
        message: ready.map_or(String::new(), |c| c.message.clone()),
        status: policy.status.clone().unwrap_or_default(),
        oldest_pending: None,
        oldest_pending_error: None,
        partitions: None,
    }
}

/// What only the server knows: the oldest pending entries (of every partition, on a topic: `count` read from each,
/// the oldest `count` kept) and a topic's partitions with their owners.
async fn from_the_server(
    session: &Session,
    policy: &ConsumerGroupPolicy,
    count: usize,
) -> anyhow::Result<(Vec<PendingEntry>, Option<Vec<PartitionReport>>)> {
    let (mut conn, server) = session.connect(policy).await?;
    let (stream, group) = (&policy.spec.stream, &policy.spec.group);
    let Some(n) = policy.spec.partitions else {
        return Ok((oldest_pending(&mut conn, &server, stream, group, count, false).await?, None));
    };
    let owners: HashMap<u32, String> = redis::cmd("HGETALL")
        .arg(owners_key(stream, group))
        .query_async(&mut conn)
        .await
        .map_err(|e| crate::Error::from_redis(&server, e))?;
    let (mut oldest, mut partitions) = (Vec::new(), Vec::new());
    for partition in 0..n {
        let stream = partition_stream(stream, partition);
        let summary: (i64, redis::Value, redis::Value, redis::Value) = redis::cmd("XPENDING")
            .arg(&stream)
            .arg(group)
            .query_async(&mut conn)
            .await
            .map_err(|e| crate::Error::from_redis(&server, e))?;
        if summary.0 > 0 {
            oldest.extend(oldest_pending(&mut conn, &server, &stream, group, count, true).await?);
        }
        partitions.push(PartitionReport {
            partition,
            stream,
            owner: owners.get(&partition).cloned(),
            pending: summary.0,
        });
    }
    oldest.sort_by_key(|entry| std::cmp::Reverse(entry.age_seconds));
    oldest.truncate(count);
    Ok((oldest, Some(partitions)))
}

/// The `count` oldest pending entries of `stream` (named in each when `named`: a topic's partition).
async fn oldest_pending(
    conn: &mut Conn,
    server: &str,
    stream: &str,
    group: &str,
    count: usize,
    named: bool,
) -> anyhow::Result<Vec<PendingEntry>> {
    if count == 0 {
        return Ok(Vec::new());
    }
    let entries: Vec<(String, String, i64, i64)> = redis::cmd("XPENDING")
        .arg(stream)
        .arg(group)
        .arg("-")
        .arg("+")
        .arg(count)
        .query_async(conn)
        .await
        .map_err(|e| crate::Error::from_redis(server, e))?;
    let now = now_millis();
    Ok(entries
        .into_iter()
        .map(|(id, consumer, idle_ms, deliveries)| PendingEntry {
            stream: named.then(|| stream.to_string()),
            age_seconds: id_millis(&id).map(|ms| (now - ms) / 1000),
            id,
            consumer,
            idle_seconds: idle_ms.max(0) / 1000,
            deliveries,
        })
        .collect())
}

/// The server's newer features, comma-separated (`-` when none were found).
fn server_features(s: &crate::api::ConsumerGroupPolicyStatus) -> String {
    let names: Vec<&str> = s.server_features.iter().map(|f| f.0.as_str()).collect();
    if names.is_empty() { "-".into() } else { names.join(", ") }
}

/// How old the oldest unread entry is now, from its time in the status (`0s`: nothing unread).
fn lag_age(s: &crate::api::ConsumerGroupPolicyStatus) -> String {
    let unread = s.oldest_unread_time.as_deref().and_then(|t| t.parse::<k8s_openapi::jiff::Timestamp>().ok());
    match (unread, s.lag_seconds) {
        (Some(at), _) => age((now_millis() - at.as_millisecond()) / 1000),
        (None, Some(_)) => age(0),
        (None, None) => "-".into(),
    }
}

/// The window's rates and the drain time, in words.
fn rates(s: &crate::api::ConsumerGroupPolicyStatus) -> String {
    let Some(rates) = s.rates else {
        return "- (a window of samples is being taken)".into();
    };
    let per_second = |rate: Option<f64>| rate.map_or("?".into(), |r| format!("{r}/s"));
    let drain = match s.drain_seconds {
        Some(0) => "nothing to drain".to_string(),
        Some(seconds) => format!("drained in about {}", age(seconds)),
        None => "the backlog is not shrinking".to_string(),
    };
    format!(
        "added {}, read {}, acknowledged {}; {drain}",
        per_second(Some(rates.added)),
        per_second(rates.read),
        per_second(rates.acknowledged)
    )
}

/// The count, and the consumers whose Pod is gone (`spec.consumers.pods`) when there are any.
fn consumers(s: &crate::api::ConsumerGroupPolicyStatus) -> String {
    match &s.consumers_without_pod {
        Some(gone) if !gone.is_empty() => {
            format!(
                "{} ({} without a Pod, retried and removed: {})",
                cell(s.consumers),
                gone.len(),
                gone.iter().map(|c| c.0.as_str()).collect::<Vec<_>>().join(", ")
            )
        }
        _ => cell(s.consumers),
    }
}

fn print_one(report: &PolicyReport) -> anyhow::Result<()> {
    let s = &report.status;
    let totals = s.totals.clone().unwrap_or_default();
    let stream = match &s.partitions {
        Some(p) => format!(
            "{} (a topic of {} partitions, {} with the group; group {}, {} members)",
            report.stream, p.count, p.with_group, report.group, p.members
        ),
        None => format!("{} (group {})", report.stream, report.group),
    };
    let lines = [
        ("Policy", format!("{}/{}", report.namespace, report.name)),
        ("Stream", stream),
        ("Server", cell(s.server_version.as_ref())),
        ("Server features", server_features(s)),
        ("Ready", format!("{} {}: {}", report.ready, report.reason, report.message)),
        ("Pending", cell(s.pending)),
        ("Lag", format!("{} (the oldest unread entry: {})", cell(s.lag), lag_age(s))),
        ("Rates", rates(s)),
        ("Consumers", consumers(s)),
        ("Stream length", cell(s.stream_length)),
        ("Dead letters", cell(s.dead_letter_length)),
        (
            "Totals",
            format!(
                "dead-lettered {}, requeued {}, reassigned {}, payload deleted {}, consumers expired {}",
                totals.dead_lettered,
                totals.requeued,
                totals.reassigned,
                totals.payload_deleted,
                totals.consumers_expired
            ),
        ),
        ("Last pass", cell(s.last_pass_time.as_ref())),
    ];
    let rows: Vec<Vec<String>> = lines.into_iter().map(|(k, v)| vec![format!("{k}:"), v]).collect();
    let mut out = tabwriter::TabWriter::new(std::io::stdout()).padding(2);
    use std::io::Write;
    for row in rows {
        writeln!(out, "{}", row.join("\t"))?;
    }
    out.flush()?;
    println!("\nConditions:");
    let conditions: Vec<Vec<String>> = s
        .conditions
        .iter()
        .map(|c| vec![c.type_.clone(), c.status.clone(), c.reason.clone(), c.message.clone()])
        .collect();
    print_table(&["TYPE", "STATUS", "REASON", "MESSAGE"], &conditions)?;
    if let Some(error) = &report.oldest_pending_error {
        println!("\nOldest pending entries:\nnot read from the server: {error}");
        return Ok(());
    }
    if let Some(partitions) = &report.partitions {
        println!("\nPartitions:");
        let rows: Vec<Vec<String>> = partitions
            .iter()
            .map(|p| {
                let owner = p.owner.clone().unwrap_or_else(|| "(none: moving or no member)".into());
                vec![p.partition.to_string(), p.stream.clone(), owner, p.pending.to_string()]
            })
            .collect();
        print_table(&["PARTITION", "STREAM", "OWNER", "PENDING"], &rows)?;
    }
    let pending = report.oldest_pending.as_deref().unwrap_or_default();
    println!("\nOldest pending entries:");
    if pending.is_empty() {
        println!("none");
        return Ok(());
    }
    let rows: Vec<Vec<String>> = pending
        .iter()
        .map(|p| {
            vec![
                p.stream.as_ref().map_or(p.id.clone(), |stream| format!("{stream} {}", p.id)),
                p.consumer.clone(),
                age(p.idle_seconds),
                p.deliveries.to_string(),
                cell(p.age_seconds.map(age)),
            ]
        })
        .collect();
    print_table(&["ID", "CONSUMER", "IDLE", "DELIVERIES", "AGE"], &rows)
}
