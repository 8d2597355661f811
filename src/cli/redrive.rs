//! `kubectl pelican redrive <policy>`: creates a `DeadLetterRedrive` and follows it until it is finished, printing
//! a line whenever its progress changes. The object does the work, so interrupting the command stops nothing.

use std::time::Duration;

use clap::Args;
use kube::ResourceExt;
use kube::api::{Api, PostParams};

use super::{Output, Session};
use crate::api::{
    DeadLetterRedrive, DeadLetterRedriveSpec, PolicyRef, ReasonCode, RedriveFilter, RedrivePhase, SOURCE_TARGET,
};

#[derive(Args, Debug)]
pub struct RedriveArgs {
    #[command(flatten)]
    pub(super) scope: super::Scope,
    /// The ConsumerGroupPolicy whose dead letters to redrive.
    policy: String,
    /// Only dead letters with this reason (repeat for more).
    #[arg(long = "reason")]
    reasons: Vec<String>,
    /// The most entries to move.
    #[arg(long)]
    max: Option<i64>,
    /// The most entries moved per second.
    #[arg(long)]
    rate: Option<i32>,
    /// Count what would move, move nothing.
    #[arg(long)]
    dry_run: bool,
    /// `Source` (each entry back to its source stream) or a stream name.
    #[arg(long, default_value = SOURCE_TARGET)]
    target: String,
    /// Name of the DeadLetterRedrive (default: `<policy>-redrive-` and a suffix the API server picks, so two runs
    /// in the same second never collide).
    #[arg(long)]
    name: Option<String>,
    /// Create it and return without following its progress.
    #[arg(long)]
    no_wait: bool,
}

pub(super) async fn run(session: &Session, args: RedriveArgs) -> anyhow::Result<()> {
    // The policy must exist; the error says how to list them.
    session.policy(&args.policy).await?;
    let filter = (!args.reasons.is_empty()).then(|| RedriveFilter {
        reasons: args.reasons.iter().cloned().map(ReasonCode).collect(),
        ..RedriveFilter::default()
    });
    let spec = DeadLetterRedriveSpec {
        policy_ref: PolicyRef { name: args.policy.clone() },
        target: args.target.clone(),
        filter,
        max_messages: args.max,
        rate_per_second: args.rate,
        dry_run: args.dry_run,
        suspend: false,
        ttl_seconds_after_finished: None,
    };
    let api: Api<DeadLetterRedrive> = Api::namespaced(session.client.clone(), &session.namespace);
    let mut object = DeadLetterRedrive::new(args.name.as_deref().unwrap_or_default(), spec);
    if args.name.is_none() {
        object.metadata.name = None;
        object.metadata.generate_name = Some(format!("{}-redrive-", args.policy));
    }
    let created = api.create(&PostParams::default(), &object).await?;
    let name = created.name_any();
    let table = session.scope.output == Output::Table;
    if table {
        println!("deadletterredrive.pelican.io/{} created", created.name_any());
    }
    if args.no_wait {
        if !table {
            session.print_structured(&created)?;
        }
        return Ok(());
    }
    let mut last = String::new();
    let finished = loop {
        let redrive = api.get(&name).await?;
        let status = redrive.status.clone().unwrap_or_default();
        let reason = status
            .conditions
            .iter()
            .find(|c| c.status == "True")
            .map(|c| format!("{}: {}", c.reason, c.message))
            .unwrap_or_else(|| "waiting for the operator".into());
        let line = format!(
            "{:?}\tmoved {} of {}\tskipped {}\t{reason}",
            status.phase,
            status.moved,
            status.to_move.map_or("?".into(), |n| n.to_string()),
            status.skipped
        );
        if table && line != last {
            println!("{line}");
            last = line;
        }
        // Suspended waits for a person (`spec.suspend: false`), not for the operator: following it would never end.
        if status.phase.is_finished() || status.phase == RedrivePhase::Suspended {
            break redrive;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    if !table {
        session.print_structured(&finished)?;
    }
    let status = finished.status.unwrap_or_default();
    match status.phase {
        RedrivePhase::Failed => anyhow::bail!("redrive {name} failed"),
        RedrivePhase::Suspended if table => println!(
            "redrive {name} is suspended; resume it with: kubectl patch dlr {name} -n {} --type=merge -p \
             '{{\"spec\":{{\"suspend\":false}}}}'",
            session.namespace
        ),
        _ => {}
    }
    Ok(())
}
