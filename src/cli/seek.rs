//! `kubectl pelican seek <policy> --to-time ... | --to-id ... | --earliest | --latest | --shift N`: creates a
//! `GroupSeek`, waits until the operator has run it, and prints the plan (a dry run) or what moved.

use std::time::Duration;

use clap::{ArgGroup, Args};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::ResourceExt;
use kube::api::{Api, PostParams};

use super::{Output, Session};
use crate::api::{GroupSeek, GroupSeekSpec, PendingHandling, PolicyRef, SeekPosition, SeekTarget};

#[derive(Args, Debug)]
#[command(group(ArgGroup::new("to").required(true).args(["to_time", "to_id", "earliest", "latest", "shift"])))]
pub struct SeekArgs {
    #[command(flatten)]
    pub(super) scope: super::Scope,
    /// The ConsumerGroupPolicy whose group moves.
    policy: String,
    /// Replay from this time: RFC 3339 (`2026-12-02T09:00:00Z`) or an age before now (`-1h`, `-30m`, `-90s`).
    #[arg(long, allow_hyphen_values = true)]
    to_time: Option<String>,
    /// Move to this entry id (or the first after it).
    #[arg(long)]
    to_id: Option<String>,
    /// Move to the stream's first entry (as far back as it holds).
    #[arg(long)]
    earliest: bool,
    /// Move past the stream's last entry (skip everything there is).
    #[arg(long)]
    latest: bool,
    /// Move by this many entries: negative replays, positive skips.
    #[arg(long, allow_hyphen_values = true)]
    shift: Option<i64>,
    /// What happens to the entries pending at the move: Keep, Acknowledge or DeadLetter.
    #[arg(long, default_value = "Keep")]
    pending: String,
    /// Refuse while a consumer was active this recently (0s: do not check).
    #[arg(long, default_value = "30s")]
    consumers_idle_for: String,
    /// Print the plan, move nothing.
    #[arg(long)]
    dry_run: bool,
    /// Name of the GroupSeek (default: `<policy>-seek-` and a suffix the API server picks).
    #[arg(long)]
    name: Option<String>,
}

/// An RFC 3339 time, or `-<duration>` before `now`.
fn parse_time(text: &str, now: Timestamp) -> anyhow::Result<String> {
    if let Some(age) = text.strip_prefix('-') {
        let age = crate::api::parse_duration(age).map_err(|e| anyhow::anyhow!("--to-time {text:?}: {e}"))?;
        let at = now - SignedDuration::try_from(age)?;
        return Ok(at.to_string());
    }
    let at: Timestamp =
        text.parse().map_err(|e| anyhow::anyhow!("--to-time {text:?} is neither RFC 3339 nor -<duration> ({e})"))?;
    Ok(at.to_string())
}

fn target(args: &SeekArgs) -> anyhow::Result<SeekTarget> {
    let mut to = SeekTarget::default();
    if let Some(time) = &args.to_time {
        to.time = Some(parse_time(time, Timestamp::now())?);
    }
    to.id = args.to_id.clone();
    to.position = match (args.earliest, args.latest) {
        (true, _) => Some(SeekPosition::Earliest),
        (_, true) => Some(SeekPosition::Latest),
        _ => None,
    };
    to.shift = args.shift;
    Ok(to)
}

pub(super) async fn run(session: &Session, args: SeekArgs) -> anyhow::Result<()> {
    session.policy(&args.policy).await?;
    let pending = match args.pending.as_str() {
        "Keep" => PendingHandling::Keep,
        "Acknowledge" => PendingHandling::Acknowledge,
        "DeadLetter" => PendingHandling::DeadLetter,
        other => anyhow::bail!("--pending {other:?} is not one of Keep, Acknowledge, DeadLetter"),
    };
    let spec = GroupSeekSpec {
        policy_ref: PolicyRef { name: args.policy.clone() },
        to: target(&args)?,
        pending,
        consumers_idle_for: args.consumers_idle_for.clone(),
        dry_run: args.dry_run,
    };
    let api: Api<GroupSeek> = Api::namespaced(session.client.clone(), &session.namespace);
    let mut object = GroupSeek::new(args.name.as_deref().unwrap_or_default(), spec);
    if args.name.is_none() {
        object.metadata.name = None;
        object.metadata.generate_name = Some(format!("{}-seek-", args.policy));
    }
    let created = api.create(&PostParams::default(), &object).await?;
    let name = created.name_any();
    let table = session.scope.output == Output::Table;
    if table {
        println!("groupseek.pelican.io/{name} created");
    }
    let finished = loop {
        let seek = api.get(&name).await?;
        if seek.status.as_ref().is_some_and(|s| s.phase.is_finished()) {
            break seek;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    if !table {
        return session.print_structured(&finished).map(|_| ());
    }
    let status = finished.status.unwrap_or_default();
    let said = status.conditions.iter().find(|c| c.status == "True");
    let (reason, message) = said.map_or(("", ""), |c| (c.reason.as_str(), c.message.as_str()));
    if let (Some(from), Some(to)) = (&status.from, &status.to) {
        let lag = |l: Option<i64>| l.map_or("unknown".to_string(), |l| l.to_string());
        println!("from {} (lag {})", from.id, lag(from.lag));
        println!("to   {} (lag {})", to.id, lag(to.lag));
        println!(
            "redelivered {}, skipped {}, pending handled {}, oldest available {}",
            status.redelivered.unwrap_or(0),
            status.skipped.unwrap_or(0),
            status.pending_handled.unwrap_or(0),
            status.oldest_available.as_deref().unwrap_or("-")
        );
    }
    if !status.partitions.is_empty() {
        let rows: Vec<Vec<String>> = status
            .partitions
            .iter()
            .map(|p| {
                let counts = [p.redelivered, p.skipped, p.pending_handled].map(|n| n.to_string());
                [p.partition.to_string(), p.from.id.clone(), p.to.id.clone()].into_iter().chain(counts).collect()
            })
            .collect();
        let header = ["PARTITION", "FROM", "TO", "REDELIVERED", "SKIPPED", "PENDING-HANDLED"];
        super::render_table(std::io::stdout(), &header, &rows)?;
        println!(
            "redelivered {}, skipped {}, pending handled {}",
            status.redelivered.unwrap_or(0),
            status.skipped.unwrap_or(0),
            status.pending_handled.unwrap_or(0)
        );
    }
    println!("{:?} {reason}: {message}", status.phase);
    if status.phase == crate::api::SeekPhase::Failed {
        match status.partitions.len() {
            0 => anyhow::bail!("seek {name} was refused: nothing moved"),
            n => anyhow::bail!("seek {name} was refused after {n} partitions moved (they stay moved)"),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_time_is_rfc_3339_or_an_age_before_now() {
        let now: Timestamp = "2026-12-02T10:00:00Z".parse().unwrap();
        assert_eq!(parse_time("-1h", now).unwrap(), "2026-12-02T09:00:00Z");
        assert_eq!(parse_time("-90s", now).unwrap(), "2026-12-02T09:58:30Z");
        assert_eq!(parse_time("2026-12-01T00:00:00Z", now).unwrap(), "2026-12-01T00:00:00Z");
        assert!(parse_time("yesterday", now).unwrap_err().to_string().contains("neither RFC 3339"));
    }
}
