//! `kubectl pelican dlq <policy>`: the dead-letter stream grouped by reason and source stream, then its oldest
//! entries with their ids, delivery counts, age and a payload preview (`--no-payload` leaves values out).

use std::collections::BTreeMap;

use clap::Args;
use redis::streams::{StreamId, StreamRangeReply};
use serde::Serialize;

use super::{Session, age, cell, now_millis, print_table};
use crate::redis::id_millis;
use crate::redis::pager::Pager;

/// The most entries one XRANGE reads while grouping ([`Pager`] reads fewer of large entries).
const PAGE: usize = 1000;
/// Characters of payload shown per entry in a table.
const PREVIEW: usize = 60;
/// Characters of the last error shown per entry in a table (the whole text in `-o json|yaml`).
const LAST_ERROR: usize = 40;

#[derive(Args, Debug)]
pub struct DlqArgs {
    #[command(flatten)]
    pub(super) scope: super::Scope,
    /// The ConsumerGroupPolicy whose dead-letter stream to show.
    policy: String,
    /// How many entries to list, oldest first.
    #[arg(long, default_value_t = 20)]
    limit: usize,
    /// Leave payload values out (they may hold personal data).
    #[arg(long)]
    no_payload: bool,
    /// Group at most this many entries (the newest beyond it are not counted).
    #[arg(long, default_value_t = 1_000_000)]
    scan: usize,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Report {
    policy: String,
    dead_letter_stream: String,
    length: u64,
    /// Entries grouped; less than `length` when `--scan` stopped the count.
    counted: u64,
    groups: Vec<Group>,
    entries: Vec<Entry>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Group {
    reason: String,
    source: String,
    count: u64,
    oldest_id: String,
    newest_id: String,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Entry {
    id: String,
    reason: Option<String>,
    source: Option<String>,
    source_id: Option<String>,
    deliveries: Option<String>,
    group: Option<String>,
    consumer: Option<String>,
    /// Why the message's last delivery failed, as its worker recorded it (`pelican-last-error`).
    last_error: Option<String>,
    age_seconds: Option<i64>,
    /// The application's fields (Pelican's `pelican-*` metadata left out); absent with `--no-payload`.
    #[serde(skip_serializing_if = "Option::is_none")]
    payload: Option<BTreeMap<String, String>>,
}

pub(super) async fn run(session: &Session, args: DlqArgs) -> anyhow::Result<()> {
    let policy = session.policy(&args.policy).await?;
    let stream = policy.spec.dead_letter.stream.clone();
    let (mut conn, server) = session.connect(&policy).await?;
    let redis_err = |e| crate::Error::from_redis(&server, e);
    let length: u64 = redis::cmd("XLEN").arg(&stream).query_async(&mut conn).await.map_err(redis_err)?;
    let mut groups: BTreeMap<(String, String), Group> = BTreeMap::new();
    let mut entries = Vec::new();
    let (mut start, mut counted) = ("-".to_string(), 0u64);
    let mut pager = Pager::new(PAGE);
    while (counted as usize) < args.scan {
        let count = pager.count().min(args.scan - counted as usize);
        let page: StreamRangeReply = redis::cmd("XRANGE")
            .arg(&stream)
            .arg(&start)
            .arg("+")
            .arg("COUNT")
            .arg(count)
            .query_async(&mut conn)
            .await
            .map_err(redis_err)?;
        pager.saw(&page.ids);
        for entry in &page.ids {
            counted += 1;
            let reason = text(entry, "pelican-reason").unwrap_or_else(|| "-".into());
            let source = text(entry, "pelican-source-stream").unwrap_or_else(|| "-".into());
            let group = groups.entry((reason.clone(), source.clone())).or_insert_with(|| Group {
                reason,
                source,
                count: 0,
                oldest_id: entry.id.clone(),
                newest_id: String::new(),
            });
            group.count += 1;
            group.newest_id = entry.id.clone();
            if entries.len() < args.limit {
                entries.push(describe(entry, !args.no_payload));
            }
        }
        match page.ids.last() {
            Some(last) if page.ids.len() == count => start = format!("({}", last.id),
            _ => break,
        }
    }
    let report = Report {
        policy: args.policy.clone(),
        dead_letter_stream: stream,
        length,
        counted,
        groups: groups.into_values().collect(),
        entries,
    };
    if session.print_structured(&report)? {
        return Ok(());
    }
    println!(
        "Dead-letter stream {:?} of policy {}: {} entries",
        report.dead_letter_stream, report.policy, report.length
    );
    if report.counted < report.length {
        println!("(grouped the oldest {} only: --scan raises the limit)", report.counted);
    }
    if report.length == 0 {
        return Ok(());
    }
    println!();
    let rows: Vec<Vec<String>> = report
        .groups
        .iter()
        .map(|g| {
            vec![
                cell(Some(&g.reason)),
                cell(Some(&g.source)),
                g.count.to_string(),
                g.oldest_id.clone(),
                g.newest_id.clone(),
            ]
        })
        .collect();
    print_table(&["REASON", "SOURCE", "COUNT", "OLDEST", "NEWEST"], &rows)?;
    println!();
    let mut header = vec!["ID", "REASON", "SOURCE", "DELIVERIES", "AGE", "LAST-ERROR"];
    if !args.no_payload {
        header.push("PAYLOAD");
    }
    let rows: Vec<Vec<String>> = report
        .entries
        .iter()
        .map(|e| {
            let mut row = vec![
                e.id.clone(),
                cell(e.reason.as_ref()),
                cell(e.source.as_ref()),
                cell(e.deliveries.as_ref()),
                cell(e.age_seconds.map(age)),
                e.last_error.as_deref().map_or_else(|| "-".to_string(), |t| one_line(t, LAST_ERROR)),
            ];
            if let Some(payload) = &e.payload {
                row.push(preview(payload));
            }
            row
        })
        .collect();
    print_table(&header, &rows)?;
    if report.length as usize > report.entries.len() {
        println!("... {} more (--limit)", report.length as usize - report.entries.len());
    }
    Ok(())
}

fn text(entry: &StreamId, field: &str) -> Option<String> {
    entry.get::<String>(field)
}

fn describe(entry: &StreamId, with_payload: bool) -> Entry {
    let payload = with_payload.then(|| {
        entry
            .map
            .iter()
            .filter(|(k, _)| !k.starts_with("pelican-"))
            .map(|(k, v)| {
                let value = match v {
                    redis::Value::BulkString(bytes) => String::from_utf8_lossy(bytes).into_owned(),
                    other => format!("{other:?}"),
                };
                (k.clone(), value)
            })
            .collect()
    });
    Entry {
        id: entry.id.clone(),
        reason: text(entry, "pelican-reason"),
        source: text(entry, "pelican-source-stream"),
        source_id: text(entry, "pelican-source-id"),
        deliveries: text(entry, "pelican-deliveries"),
        group: text(entry, "pelican-group"),
        consumer: text(entry, "pelican-consumer"),
        last_error: text(entry, "pelican-last-error"),
        // The dead-letter id is the time the entry was dead-lettered.
        age_seconds: id_millis(&entry.id).map(|ms| (now_millis() - ms) / 1000),
        payload,
    }
}

/// `k=v k=v`, control characters escaped, cut at [`PREVIEW`] characters.
fn preview(payload: &BTreeMap<String, String>) -> String {
    let text = payload.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(" ");
    one_line(&text, PREVIEW)
}

/// `text` on one line (control characters escaped), cut at `max` characters with an ellipsis.
fn one_line(text: &str, max: usize) -> String {
    let text = super::escape_controls(text);
    if text.chars().count() > max { format!("{}…", text.chars().take(max - 1).collect::<String>()) } else { text }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 66: what a worker wrote reaches the terminal escaped, in every column, never as an escape sequence.
    #[test]
    fn worker_written_cells_are_escaped() {
        let written = "Gone\x1b[2J\x1b]0;pwned\x07";
        assert_eq!(cell(Some(written)), "Gone\\u{1b}[2J\\u{1b}]0;pwned\\u{7}");
        assert_eq!(one_line(written, LAST_ERROR), "Gone\\u{1b}[2J\\u{1b}]0;pwned\\u{7}");
    }

    #[test]
    fn previews_are_short_and_on_one_line() {
        let payload = BTreeMap::from([("a".to_string(), "x\ny".to_string()), ("b".to_string(), "z".repeat(100))]);
        let shown = preview(&payload);
        assert!(shown.starts_with("a=x\\ny b=zzz"), "{shown}");
        assert_eq!(shown.chars().count(), PREVIEW);
        assert!(shown.ends_with('…'));
    }
}
