//! One running redrive: resume from the record on the server, take the snapshot, move step by step at the
//! configured rate, and write the status (at most once a second, and at every change of phase).

use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::runtime::events::EventType;
use tokio::sync::watch;
use tracing::{info, warn};

use super::{Halt, Redrives};
use crate::api::{DeadLetterRedrive, DeadLetterRedriveStatus, RedrivePhase};
use crate::jobs::redrive::{self as moves, Plan, Progress};
use crate::redis::Conn;
use crate::tenancy::KeyRules;
use crate::{Error, Result};

/// Moves per step without a rate limit: one script call of this many entries is a few milliseconds on the server.
const UNLIMITED_STEP: u64 = 128;
const STATUS_EVERY: Duration = Duration::from_secs(1);
const RETRY_MAX: Duration = Duration::from_secs(30);

/// What the task needs besides the object: the connection and the plan, and the controls the reconcile holds.
pub struct Work {
    pub conn: Conn,
    pub server: String,
    /// The dead-letter stream moving now.
    pub plan: Plan,
    /// A topic on a Redis Cluster: each partition's dead-letter stream (`{<topic>:<i>}:<deadLetter.stream>`), in
    /// partition order, moved one after the other ([`drive_topic`]); empty otherwise.
    pub partitions: Vec<Plan>,
    pub rate: watch::Receiver<Option<u32>>,
    pub halt: watch::Receiver<Option<Halt>>,
}

impl Work {
    /// Lets go of every lock this redrive may hold (each partition's, on a topic).
    async fn release(&mut self) {
        let _ = moves::release(&mut self.conn, &self.server, &self.plan).await;
        for plan in &self.partitions {
            let _ = moves::release(&mut self.conn, &self.server, plan).await;
        }
    }
}

/// Runs the redrive until it finishes, fails, is halted or its object is gone. Every outcome is in the status
/// (and the record on the server) when this returns.
pub async fn run(ctx: Arc<Redrives>, redrive: Arc<DeadLetterRedrive>, mut work: Work) {
    let mut status = redrive.status.clone().unwrap_or_default();
    let mut backoff = Duration::from_secs(1);
    loop {
        match drive(&ctx, &redrive, &mut work, &mut status).await.map_err(|e| range_refused(&redrive, e)) {
            Ok(()) => return,
            Err(e) if ends_the_redrive(&e) => return fail(&ctx, &redrive, &mut work, &mut status, e).await,
            // The object is gone, or is another object of the same name now (the uid in the status patch): the
            // stream is let go, or every seek of it would be refused until another redrive ran to its end.
            Err(Error::Kube(kube::Error::Api(response))) if response.code == 404 || response.code == 409 => {
                work.release().await;
                return;
            }
            Err(e) => {
                // The server restarting, a failover, a password rotated, the API server unreachable: the record on
                // the server is exact, so the next attempt, on the policy's current target, resumes after the last
                // move.
                warn!(reason = e.reason(), error = %e, "redrive step failed; retrying");
                let _ = retrying(&ctx, &redrive, &mut status, &e).await;
                let halted = tokio::time::timeout(backoff, work.halt.changed()).await;
                let halt = *work.halt.borrow();
                if matches!(halted, Ok(Ok(()))) && halt.is_some() {
                    let _ = halted_status(&ctx, &redrive, &mut status, halt).await;
                    return;
                }
                backoff = (backoff * 2).min(RETRY_MAX);
                match ctx.reconnect(&redrive).await {
                    Ok((conn, server)) => (work.conn, work.server) = (conn, server),
                    // The server no longer admits the namespace or its keys: retrying cannot fix that.
                    Err(e) if ends_the_redrive(&e) => return fail(&ctx, &redrive, &mut work, &mut status, e).await,
                    Err(e) => {
                        warn!(error = %e, "cannot reach the policy's server; retrying")
                    }
                }
            }
        }
    }
}

/// Ends the redrive `Failed` with `error`, releasing the stream so that the next redrive of it may start at once (or,
/// if this fails too, once it sees this one Failed).
async fn fail(
    ctx: &Redrives,
    redrive: &DeadLetterRedrive,
    work: &mut Work,
    status: &mut DeadLetterRedriveStatus,
    error: Error,
) {
    work.release().await;
    let note = error.to_string();
    warn!(reason = error.reason(), "{note}");
    let _ = ctx.finish(redrive, status, RedrivePhase::Failed, error.reason(), note).await;
}

/// Failures that retrying cannot fix, which end the redrive `Failed`: the plan itself is wrong (a target that is
/// the dead-letter stream, or in another Cluster slot; a key of another type) or the ACL user lacks a command.
/// Credentials, TLS, a failover or a server that is down are the policy's concern: the redrive waits, retries on
/// the policy's current target, and resumes once the policy's server answers. A server that no longer admits the
/// namespace or its keys ends it too: the team lost the right to move those entries.
fn ends_the_redrive(error: &Error) -> bool {
    matches!(
        error,
        Error::InvalidSpec(_)
            | Error::CrossSlot(_)
            | Error::WrongKeyType(_)
            | Error::PermissionDenied { .. }
            | Error::KeyNotAllowed { .. }
            | Error::ServerNotAllowed { .. }
            | Error::InlineConnectionDenied
    )
}

/// A range the server refuses (an id admitted before the CRD checked its 64-bit parts) is the spec's fault, not
/// the server's: retrying cannot fix it, so it ends the redrive naming the field.
fn range_refused(redrive: &DeadLetterRedrive, error: Error) -> Error {
    let Error::RedisCommand { source, .. } = &error else { return error };
    if !source.to_string().contains("Invalid stream ID") {
        return error;
    }
    let filter = redrive.spec.filter.clone().unwrap_or_default();
    let given = [("spec.filter.from", filter.from), ("spec.filter.to", filter.to)];
    let fields: Vec<String> = given.into_iter().filter_map(|(f, v)| Some(format!("{f} {:?}", v?))).collect();
    Error::InvalidSpec(format!(
        "the server refused the range {}: {source}; give ids whose parts fit in 64 bits, in a new DeadLetterRedrive",
        fields.join(" and ")
    ))
}

/// Shows why the redrive is not moving while it retries, written once per reason and message.
async fn retrying(
    ctx: &Redrives,
    redrive: &DeadLetterRedrive,
    status: &mut DeadLetterRedriveStatus,
    error: &Error,
) -> Result<()> {
    let note = format!("retrying: {error}");
    if status.conditions.iter().any(|c| c.type_ == "Reconciling" && c.message == note) {
        return Ok(());
    }
    let phase = status.phase;
    ctx.set_phase(redrive, status, phase, error.reason(), note).await
}

async fn drive(
    ctx: &Redrives,
    redrive: &DeadLetterRedrive,
    work: &mut Work,
    status: &mut DeadLetterRedriveStatus,
) -> Result<()> {
    if !ctx.exists(redrive) {
        return Ok(());
    }
    if !work.partitions.is_empty() {
        return drive_topic(ctx, redrive, work, status).await;
    }
    let (conn, server, plan) = (&mut work.conn, work.server.as_str(), &mut work.plan);
    let mut progress = moves::read_progress(conn, server, &plan.progress_key).await?;
    let others = progress.uid.clone().filter(|owner| *owner != plan.uid);
    if others.is_some()
        && let Some(at) = progress.finished_at
    {
        // The same manifest applied again after the object was deleted (by its TTL, or by hand): it ran.
        copy_progress(status, &progress, &Done::default());
        let note = format!(
            "a DeadLetterRedrive named {:?} already finished on this dead-letter stream at {} (moved {}); it is not \
             run again: create one with a new name to redrive again",
            redrive.name_any(),
            format_millis(at),
            progress.moved
        );
        return ctx.finish(redrive, status, RedrivePhase::Succeeded, "AlreadyFinished", note).await;
    }
    if others.is_none() && progress.finished_at.is_some() {
        copy_progress(status, &progress, &Done::default());
        return ctx.finish(redrive, status, RedrivePhase::Succeeded, "Complete", summary(redrive, status)).await;
    }
    // One redrive per dead-letter stream, decided on the server: whatever this process has seen (it may have just
    // started), a redrive moves nothing while another one holds the stream.
    if !redrive.spec.dry_run
        && let Some(owner) = take_lock(ctx, conn, server, plan).await?
    {
        let note = format!(
            "waiting for DeadLetterRedrive {}, which redrives the same dead-letter stream {:?}: one redrive runs per \
             dead-letter stream at a time",
            owner.name, plan.dead_letter
        );
        return ctx.pending(redrive, status, "Waiting", note).await;
    }
    if others.is_some() {
        // An unfinished record of an object deleted mid-run (of the same name): this object starts from its own
        // snapshot. Forgotten only once this one holds the stream's lock, so the old task moves nothing after.
        moves::forget_progress(conn, server, &plan.progress_key).await?;
        progress = Progress::default();
    }
    let until_id = match status.until_id.clone() {
        Some(until) if status.to_move.is_some() => until,
        _ => {
            let snapshot = moves::snapshot(conn, server, plan).await?;
            status.to_move = Some(snapshot.to_move as i64);
            if redrive.spec.dry_run {
                let note = format!(
                    "dry run: {} entries of {:?} would move{}; nothing was moved",
                    snapshot.to_move,
                    plan.dead_letter,
                    snapshot.until_id.as_ref().map(|id| format!(" (up to {id})")).unwrap_or_default()
                );
                status.until_id = snapshot.until_id;
                return ctx.finish(redrive, status, RedrivePhase::Succeeded, "DryRun", note).await;
            }
            // An empty range still ends with a record, so the name cannot run again later.
            let until = snapshot.until_id.unwrap_or_else(|| "0-0".into());
            status.until_id = Some(until.clone());
            status.start_time = Some(Timestamp::now().to_string());
            let note = format!(
                "moving {} entries from {:?} to {}",
                snapshot.to_move,
                plan.dead_letter,
                match &plan.target {
                    moves::Destination::Source { .. } => "their source streams".to_string(),
                    moves::Destination::Stream(s) => format!("{s:?}"),
                }
            );
            info!("{note}");
            ctx.set_phase(redrive, status, RedrivePhase::Running, "Running", note.clone()).await?;
            ctx.publish(redrive, EventType::Normal, "Started", note).await;
            until
        }
    };
    if status.phase != RedrivePhase::Running {
        let note = format!("resuming after {}", progress.last_id.as_deref().unwrap_or("the start of the range"));
        ctx.set_phase(redrive, status, RedrivePhase::Running, "Running", note).await?;
    }
    match move_range(ctx, redrive, work, status, &until_id, progress, &Done::default()).await? {
        RangeEnd::Finished => {
            let note = summary(redrive, status);
            info!("{note}");
            ctx.finish(redrive, status, RedrivePhase::Succeeded, "Complete", note).await
        }
        RangeEnd::Stopped => Ok(()),
    }
}

/// Takes the dead-letter stream's lock for this redrive (from a holder whose redrive is gone too): `None` once it
/// is this redrive's, else who holds it.
async fn take_lock(ctx: &Redrives, conn: &mut Conn, server: &str, plan: &Plan) -> Result<Option<moves::LockOwner>> {
    let mut owner = moves::claim(conn, server, plan, None).await?;
    if owner.uid != plan.uid && ctx.is_gone(&owner.uid).await {
        owner = moves::claim(conn, server, plan, Some(&owner.uid)).await?;
    }
    Ok((owner.uid != plan.uid).then_some(owner))
}

/// How a range ended: every entry of it moved or left in place (the record says finished), or the task stopped
/// (halted, no longer leading, its object gone; the status says so where it should).
enum RangeEnd {
    Finished,
    Stopped,
}

/// What the partitions already moved of a topic's redrive add to the status, from their records on the server.
#[derive(Clone, Copy, Debug, Default)]
struct Done {
    moved: u64,
    skipped: u64,
    too_large: u64,
}

impl Done {
    fn add(&mut self, progress: &Progress) {
        self.moved += progress.moved;
        self.skipped += progress.skipped;
        self.too_large += progress.too_large;
    }
}

/// Moves `work.plan`'s range up to `until_id` from `progress`, a paced step at a time, the status written at most
/// once a second (`done` added to its counts).
async fn move_range(
    ctx: &Redrives,
    redrive: &DeadLetterRedrive,
    work: &mut Work,
    status: &mut DeadLetterRedriveStatus,
    until_id: &str,
    mut progress: Progress,
    done: &Done,
) -> Result<RangeEnd> {
    let (conn, server, plan) = (&mut work.conn, work.server.as_str(), &mut work.plan);
    let mut paced = Pace::new(*work.rate.borrow());
    // The destination streams checked so far.
    let mut destinations = Vec::new();
    let mut last_write = Instant::now();
    loop {
        let halt = *work.halt.borrow();
        if let Some(halt) = halt {
            copy_progress(status, &progress, done);
            halted_status(ctx, redrive, status, Some(halt)).await?;
            return Ok(RangeEnd::Stopped);
        }
        // A deleted object's task stops (a new object of the same name runs its own).
        if !ctx.shared.leadership.may_write() || !ctx.exists(redrive) {
            return Ok(RangeEnd::Stopped);
        }
        if work.rate.has_changed().unwrap_or(false) {
            paced = Pace::new(*work.rate.borrow_and_update());
        }
        let step = moves::step(conn, server, plan, until_id, &progress, paced.budget(), &mut destinations).await?;
        progress.moved += step.moved;
        progress.skipped += step.skipped;
        progress.too_large += step.too_large;
        progress.last_id = step.last_id.clone();
        if step.finished {
            progress.finished_at = Some(Timestamp::now().as_millisecond() as u64);
            copy_progress(status, &progress, done);
            return Ok(RangeEnd::Finished);
        }
        if last_write.elapsed() >= STATUS_EVERY {
            // Admitted again on the server's current rules: a revoked namespace or key ends the redrive here, and
            // changed patterns apply to the destinations from the next step on.
            let keys = ctx.readmit(redrive).await?;
            if keys.as_ref().map(KeyRules::patterns) != plan.keys.as_ref().map(KeyRules::patterns) {
                for partition in &mut work.partitions {
                    partition.keys = keys.clone();
                }
                plan.keys = keys;
                destinations.clear();
            }
            copy_progress(status, &progress, done);
            ctx.write(redrive, status).await?;
            last_write = Instant::now();
        }
        paced.wait(step.moved).await;
    }
}

/// A topic's redrive on a Cluster (SPEC 22), where each partition has a dead-letter stream of its own in its slot:
/// first every partition's range counted (its last id and count kept in its record on the server, so a restarted
/// operator moves exactly the same ranges), then each partition's moved in turn, each under its own lock and record,
/// `maxMessages` carried from one to the next. `status.partition` is the one moving; `untilId` and `lastId` are its.
async fn drive_topic(
    ctx: &Redrives,
    redrive: &DeadLetterRedrive,
    work: &mut Work,
    status: &mut DeadLetterRedriveStatus,
) -> Result<()> {
    let (conn, server) = (&mut work.conn, work.server.as_str());
    // The same manifest applied again: partition 0's record, finished by another object of this name, says so.
    let first = moves::read_progress(conn, server, &work.partitions[0].progress_key).await?;
    if let (Some(owner), Some(at)) = (&first.uid, first.finished_at)
        && *owner != work.partitions[0].uid
    {
        let note = format!(
            "a DeadLetterRedrive named {:?} already finished on these dead-letter streams at {}; it is not run again: \
             create one with a new name to redrive again",
            redrive.name_any(),
            format_millis(at),
        );
        return ctx.finish(redrive, status, RedrivePhase::Succeeded, "AlreadyFinished", note).await;
    }
    // 1. Each partition's range, once: its lock taken (one redrive per dead-letter stream), then its snapshot.
    let mut ranges = Vec::with_capacity(work.partitions.len());
    let mut left = work.plan.max_messages;
    for (index, plan) in (0u32..).zip(&mut work.partitions) {
        if let Some(range) = moves::read_range(conn, server, &plan.progress_key, &plan.uid).await? {
            left = left.map(|max| max.saturating_sub(range.to_move));
            ranges.push(range);
            continue;
        }
        if !redrive.spec.dry_run {
            if let Some(owner) = take_lock(ctx, conn, server, plan).await? {
                let note = format!(
                    "waiting for DeadLetterRedrive {}, which redrives the dead-letter stream {:?} of partition {index}: \
                     one redrive runs per dead-letter stream at a time",
                    owner.name, plan.dead_letter
                );
                return ctx.pending(redrive, status, "Waiting", note).await;
            }
            // A record of another object of this name (deleted mid-run): forgotten under the lock, so its task
            // moves nothing after.
            let progress = moves::read_progress(conn, server, &plan.progress_key).await?;
            if progress.uid.as_ref().is_some_and(|owner| *owner != plan.uid) {
                moves::forget_progress(conn, server, &plan.progress_key).await?;
            }
        }
        // `maxMessages` used up by the partitions before: an empty range, which ends at once with its record.
        let range = match left {
            Some(0) => moves::Range { until_id: "0-0".into(), to_move: 0 },
            _ => {
                plan.max_messages = left;
                let snapshot = moves::snapshot(conn, server, plan).await?;
                left = left.map(|max| max.saturating_sub(snapshot.to_move));
                let until_id = snapshot.until_id.unwrap_or_else(|| "0-0".into());
                moves::Range { until_id, to_move: snapshot.to_move }
            }
        };
        if !redrive.spec.dry_run {
            moves::record_range(conn, server, &plan.progress_key, &plan.uid, &range).await?;
        }
        ranges.push(range);
    }
    status.to_move = Some(ranges.iter().map(|r| r.to_move as i64).sum());
    if redrive.spec.dry_run {
        let note = format!(
            "dry run: {} entries of the {} partitions' dead-letter streams would move; nothing was moved",
            status.to_move.unwrap_or(0),
            ranges.len()
        );
        return ctx.finish(redrive, status, RedrivePhase::Succeeded, "DryRun", note).await;
    }
    if status.phase != RedrivePhase::Running {
        status.start_time = status.start_time.take().or_else(|| Some(Timestamp::now().to_string()));
        let note = format!(
            "moving {} entries from the dead-letter streams of {} partitions, one partition after the other",
            status.to_move.unwrap_or(0),
            ranges.len()
        );
        info!("{note}");
        ctx.set_phase(redrive, status, RedrivePhase::Running, "Running", note.clone()).await?;
        ctx.publish(redrive, EventType::Normal, "Started", note).await;
    }
    // 2. Each partition's range moved in turn; a finished one is read from its record.
    let mut done = Done::default();
    for (index, range) in (0u32..).zip(&ranges) {
        work.plan = work.partitions[index as usize].clone();
        // Its share of `maxMessages`: what its count allowed (the partitions before took the rest).
        work.plan.max_messages = work.plan.max_messages.map(|_| range.to_move.max(1));
        let progress = moves::read_progress(&mut work.conn, &work.server, &work.plan.progress_key).await?;
        if progress.finished_at.is_some() {
            done.add(&progress);
            continue;
        }
        // The lock again (ours since the count, unless a server restart lost it), as a plain redrive takes it at
        // every start.
        if let Some(owner) = take_lock(ctx, &mut work.conn, &work.server, &work.plan).await? {
            let note = format!(
                "waiting for DeadLetterRedrive {}, which redrives the dead-letter stream {:?} of partition {index}",
                owner.name, work.plan.dead_letter
            );
            return ctx.pending(redrive, status, "Waiting", note).await;
        }
        status.partition = Some(index);
        status.until_id = Some(range.until_id.clone());
        match move_range(ctx, redrive, work, status, &range.until_id, progress.clone(), &done).await? {
            RangeEnd::Finished => {
                let finished = moves::read_progress(&mut work.conn, &work.server, &work.plan.progress_key).await?;
                done.add(&finished);
            }
            RangeEnd::Stopped => return Ok(()),
        }
    }
    status.partition = None;
    let note = summary(redrive, status);
    info!("{note}");
    ctx.finish(redrive, status, RedrivePhase::Succeeded, "Complete", note).await
}

/// The status a halted task leaves: `Suspended` for `spec.suspend`; unchanged when the replica stops leading.
async fn halted_status(
    ctx: &Redrives,
    redrive: &DeadLetterRedrive,
    status: &mut DeadLetterRedriveStatus,
    halt: Option<Halt>,
) -> Result<()> {
    match halt {
        Some(Halt::Suspend) => {
            let note = format!("suspended after {}", status.last_id.as_deref().unwrap_or("the start of the range"));
            ctx.set_phase(redrive, status, RedrivePhase::Suspended, "Suspended", note.clone()).await?;
            ctx.publish(redrive, EventType::Normal, "Suspended", note).await;
            Ok(())
        }
        Some(Halt::Stop) | None => Ok(()),
    }
}

/// The record's counts (plus `done`, the partitions of a topic moved before) into the status.
fn copy_progress(status: &mut DeadLetterRedriveStatus, progress: &Progress, done: &Done) {
    status.moved = (done.moved + progress.moved) as i64;
    status.skipped = (done.skipped + progress.skipped) as i64;
    status.last_id = progress.last_id.clone();
    // Counted once the range is done: entries of the snapshot neither moved nor left in place as too large were
    // deleted or evicted by someone else before their turn.
    if progress.finished_at.is_some() {
        let accounted = (done.moved + done.too_large + progress.moved + progress.too_large) as i64;
        status.missing = status.to_move.map_or(0, |to_move| (to_move - accounted).max(0));
    }
}

fn summary(redrive: &DeadLetterRedrive, status: &DeadLetterRedriveStatus) -> String {
    let mut note = format!("moved {} of {} entries", status.moved, status.to_move.unwrap_or(0));
    if status.skipped > 0 {
        note.push_str(&format!(", left {} in place (filter or size)", status.skipped));
    }
    if status.missing > 0 {
        note.push_str(&format!(", {} were already gone", status.missing));
    }
    if redrive.spec.max_messages.is_some_and(|max| status.moved >= max) {
        note.push_str(" (spec.maxMessages reached)");
    }
    note
}

pub(super) fn format_millis(millis: u64) -> String {
    Timestamp::from_millisecond(millis as i64).map(|t| t.to_string()).unwrap_or_else(|_| millis.to_string())
}

/// Spaces the steps so that at most `rate` entries move per second, measured from when the rate was set.
struct Pace {
    rate: Option<u32>,
    since: Instant,
    done: u64,
}

impl Pace {
    fn new(rate: Option<u32>) -> Pace {
        Pace { rate, since: Instant::now(), done: 0 }
    }

    /// Entries per step: a tenth of a second's worth, so the pace is smooth and a change of rate applies soon.
    fn budget(&self) -> u64 {
        self.rate.map_or(UNLIMITED_STEP, |rate| (u64::from(rate) / 10).clamp(1, UNLIMITED_STEP))
    }

    async fn wait(&mut self, handled: u64) {
        self.done += handled;
        if let Some(rate) = self.rate {
            let due = self.since + Duration::from_secs_f64(self.done as f64 / f64::from(rate));
            tokio::time::sleep_until(due.into()).await;
        }
    }
}
