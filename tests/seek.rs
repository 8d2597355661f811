//! `GroupSeek` against real servers: a replay by time of 100,000 entries counted by id, skips, shifts, an id the
//! stream does not hold, each pending handling with a ledger of the PEL, each refusal with nothing changed on the
//! server, seeks that run once across operator restarts and kills, and a record this version cannot read.

#[macro_use]
mod common;

use std::time::Duration;

use common::*;
use pelican::api::PendingHandling;
use pelican::jobs::seek::{self as seeking, Outcome, Seek, Target};
use pelican::redis::{GroupKeys, Pools};
use serde_json::Value;

on_every_server!(
    a_replay_by_time_reads_exactly_the_entries_at_or_after_it,
    skips_shifts_and_ids,
    pending_entries_are_kept_acknowledged_or_dead_lettered,
    refusals_change_nothing,
    a_seek_runs_once_whatever_happens_to_the_operator
);

fn seek(name: &str, to: &str, extra: &str) -> String {
    format!(
        "apiVersion: pelican.io/v1alpha1\nkind: GroupSeek\nmetadata:\n  name: {name}\nspec:\n  policyRef: {{name: p}}\n  \
         to: {to}\n  consumersIdleFor: 0s\n{extra}"
    )
}

/// Applies a seek and waits until it finished; its status.
fn run_seek(ns: &str, manifest: &str) -> Value {
    let name = manifest.lines().find_map(|l| l.trim().strip_prefix("name: ")).unwrap().to_string();
    let (ok, out) = kubectl_apply(ns, manifest);
    assert!(ok, "{out}");
    wait_for(&format!("seek {name} finished"), Duration::from_secs(30), || {
        let seek: Value = serde_json::from_str(&kubectl_ok(&["get", "seek", &name, "-n", ns, "-o", "json"])).unwrap();
        match seek["status"]["phase"].as_str() {
            Some("Succeeded" | "Failed") => Ok(seek["status"].clone()),
            other => Err(format!("{other:?}")),
        }
    })
}

fn failed_reason(status: &Value) -> String {
    let failed = status["conditions"].as_array().unwrap().iter().find(|c| c["type"] == "Failed").unwrap();
    assert_eq!(failed["status"], "True", "{status}");
    failed["reason"].as_str().unwrap().to_string()
}

/// (last-delivered-id, entries-read, lag) of group g.
fn position(conn: &mut redis::Connection) -> (String, Option<i64>, Option<i64>) {
    let groups = xinfo_groups(conn, "s");
    let g = groups.iter().find(|g| group_field::<String>(g, "name") == "g").unwrap();
    let optional = |field: &str| match &g[field] {
        redis::Value::Nil => None,
        value => Some(redis::from_redis_value::<i64>(value.clone()).unwrap()),
    };
    (group_field(g, "last-delivered-id"), optional("entries-read"), optional("lag"))
}

/// Reads everything the group has left, acknowledging it: the ids in order.
fn drain(conn: &mut redis::Connection, consumer: &str) -> Vec<String> {
    let mut all = Vec::new();
    loop {
        let ids = read_new(conn, "s", "g", consumer, 10_000);
        if ids.is_empty() {
            return all;
        }
        let _: i64 = redis::cmd("XACK").arg("s").arg("g").arg(&ids).query(conn).unwrap();
        all.extend(ids);
    }
}

/// Adds entries with ids `<ms>-0` for the given times.
fn publish_at(conn: &mut redis::Connection, times: impl Iterator<Item = i64>) {
    let times: Vec<i64> = times.collect();
    for chunk in times.chunks(10_000) {
        let mut pipe = redis::pipe();
        for ms in chunk {
            pipe.cmd("XADD").arg("s").arg(format!("{ms}-0")).arg("n").arg(ms).ignore();
        }
        pipe.query::<()>(conn).unwrap();
    }
}

fn server_ms(conn: &mut redis::Connection) -> i64 {
    let (seconds, micros): (i64, i64) = redis::cmd("TIME").query(conn).unwrap();
    seconds * 1000 + micros / 1000
}

fn rfc3339(ms: i64) -> String {
    k8s_openapi::jiff::Timestamp::from_millisecond(ms).unwrap().to_string()
}

fn a_replay_by_time_reads_exactly_the_entries_at_or_after_it(flavor: Flavor) {
    let server = Server::start(flavor);
    let mut conn = server.conn();
    // 100,000 entries over an hour (one every 36 ms), two hours ago; all read and acknowledged.
    let start = server_ms(&mut conn) - 7_200_000;
    publish_at(&mut conn, (0..100_000).map(|i| start + i * 36));
    let (ns, _operator) = ready_policy("seektime", &policy("p", &server.url(), "s", "g", ""), "p");
    assert_eq!(drain(&mut conn, "c1").len(), 100_000);
    assert_eq!(position(&mut conn).2, Some(0));

    let half = start + 1_800_000;
    let expected = (0..100_000).filter(|i| start + i * 36 >= half).count() as i64;
    let to = format!("{{time: \"{}\"}}", rfc3339(half));
    let plan = run_seek(&ns, &seek("plan", &to, "  dryRun: true\n"));
    assert_eq!((plan["phase"].as_str(), plan["redelivered"].as_i64()), (Some("Succeeded"), Some(expected)), "{plan}");
    assert_eq!(position(&mut conn).2, Some(0), "a dry run moves nothing");

    let done = run_seek(&ns, &seek("replay", &to, ""));
    println!("{flavor:?} replay to {}: {done}", rfc3339(half));
    assert_eq!(done["redelivered"].as_i64(), Some(expected));
    assert_eq!(done["to"]["lag"].as_i64(), Some(expected));
    assert_eq!(done["from"]["lag"].as_i64(), Some(0));
    // The server's own lag, before anyone reads: exact.
    let (_, _, lag) = position(&mut conn);
    assert_eq!(lag, Some(expected), "XINFO GROUPS lag after the seek");
    let replayed = drain(&mut conn, "c2");
    assert_eq!(replayed.len() as i64, expected);
    assert_eq!(replayed[0], format!("{half}-0"), "the first entry at the time itself");
    assert!(replayed.iter().all(|id| id.split('-').next().unwrap().parse::<i64>().unwrap() >= half));
    let seeked = events(&ns, "Seeked");
    let on_policy = seeked.iter().find(|e| e["involvedObject"]["kind"] == "ConsumerGroupPolicy");
    println!("{flavor:?} Event on the policy: {}", on_policy.expect("a Seeked Event on the policy")["message"]);
}

fn skips_shifts_and_ids(flavor: Flavor) {
    let server = Server::start(flavor);
    let mut conn = server.conn();
    let start = server_ms(&mut conn) - 600_000;
    // Ids every 10 ms: 1,000 entries.
    publish_at(&mut conn, (0..1000).map(|i| start + i * 10));
    let (ns, _operator) = ready_policy("seekskip", &policy("p", &server.url(), "s", "g", ""), "p");
    // Read 100.
    let first = read_new(&mut conn, "s", "g", "c1", 100);
    let _: i64 = redis::cmd("XACK").arg("s").arg("g").arg(&first).query(&mut conn).unwrap();

    // Skip 50 forward: the 151st is next.
    let skip = run_seek(&ns, &seek("skip", "{shift: 50}", ""));
    assert_eq!((skip["skipped"].as_i64(), skip["to"]["lag"].as_i64()), (Some(50), Some(850)), "{skip}");
    assert_eq!(read_new(&mut conn, "s", "g", "c1", 1), [format!("{}-0", start + 1500)]);
    assert_eq!(position(&mut conn).2, Some(849));

    // Back 20: the group reads again from the 132nd.
    let back = run_seek(&ns, &seek("back", "{shift: -20}", ""));
    assert_eq!((back["redelivered"].as_i64(), back["to"]["lag"].as_i64()), (Some(20), Some(869)), "{back}");
    assert_eq!(read_new(&mut conn, "s", "g", "c1", 1), [format!("{}-0", start + 1310)]);

    // An id the stream does not hold (between two entries): the next one is read.
    let missing = format!("{}-5", start + 5000);
    let to = run_seek(&ns, &seek("id", &format!("{{id: \"{missing}\"}}"), ""));
    assert_eq!(to["to"]["lag"].as_i64(), Some(499), "{to}");
    assert_eq!(read_new(&mut conn, "s", "g", "c1", 1), [format!("{}-0", start + 5010)]);

    // Latest: everything skipped, lag 0.
    let latest = run_seek(&ns, &seek("latest", "{position: Latest}", ""));
    assert_eq!((latest["to"]["lag"].as_i64(), latest["skipped"].as_i64()), (Some(0), Some(498)), "{latest}");
    assert_eq!(position(&mut conn).2, Some(0));
    assert!(read_new(&mut conn, "s", "g", "c1", 10).is_empty());

    // Earliest: all 1,000 again, and a client's count equals the lag the server reports.
    let earliest = run_seek(&ns, &seek("earliest", "{position: Earliest}", ""));
    assert_eq!(earliest["to"]["lag"].as_i64(), Some(1000), "{earliest}");
    assert_eq!(earliest["oldestAvailable"].as_str(), Some(format!("{start}-0").as_str()));
    assert_eq!(position(&mut conn).2, Some(1000));
    assert_eq!(drain(&mut conn, "c1").len(), 1000);
}

fn pending_entries_are_kept_acknowledged_or_dead_lettered(flavor: Flavor) {
    let server = Server::start(flavor);
    let mut conn = server.conn();
    let start = server_ms(&mut conn) - 600_000;
    publish_at(&mut conn, (0..30).map(|i| start + i * 1000));
    let (ns, _operator) = ready_policy("seekpending", &policy("p", &server.url(), "s", "g", ""), "p");
    let held = |conn: &mut redis::Connection| pel(conn, "s", "g").into_iter().map(|e| e.0).collect::<Vec<_>>();

    // Keep: five pending stay pending.
    let five = read_new(&mut conn, "s", "g", "c1", 5);
    let keep = run_seek(&ns, &seek("keep", "{position: Earliest}", "  pending: Keep\n"));
    assert_eq!(keep["pendingHandled"].as_i64(), Some(0), "{keep}");
    assert_eq!(held(&mut conn), five);

    // Acknowledge: gone from the PEL, nowhere else.
    let ack = run_seek(&ns, &seek("ack", "{position: Earliest}", "  pending: Acknowledge\n"));
    assert_eq!(ack["pendingHandled"].as_i64(), Some(5), "{ack}");
    assert!(held(&mut conn).is_empty());
    let dead_letters: usize = redis::cmd("XLEN").arg("s:dlq").query(&mut conn).unwrap();
    assert_eq!(dead_letters, 0);

    // DeadLetter: each pending entry once in the dead-letter stream, reason Seek, and out of the PEL.
    let seven = read_new(&mut conn, "s", "g", "c2", 7);
    let dead = run_seek(&ns, &seek("dead", "{position: Latest}", "  pending: DeadLetter\n"));
    assert_eq!(dead["pendingHandled"].as_i64(), Some(7), "{dead}");
    assert!(held(&mut conn).is_empty());
    let letters = xrange(&mut conn, "s:dlq");
    let field = |entry: &RawEntry, name: &str| {
        entry.1.iter().find(|(k, _)| k == name.as_bytes()).map(|(_, v)| String::from_utf8_lossy(v).to_string())
    };
    let sources: Vec<String> = letters.iter().filter_map(|e| field(e, "pelican-source-id")).collect();
    assert_eq!(sources, seven, "each pending entry dead-lettered once");
    assert!(letters.iter().all(|e| field(e, "pelican-reason").as_deref() == Some("Seek")));
    let policy = wait_for("totals.deadLettered 7", Duration::from_secs(30), || {
        let policy = get_policy(&ns, "p");
        let n = policy["status"]["totals"]["deadLettered"].as_i64();
        if n == Some(7) { Ok(policy) } else { Err(format!("{n:?}")) }
    });
    println!("{flavor:?} totals after the DeadLetter seek: {}", policy["status"]["totals"]);
}

fn refusals_change_nothing(flavor: Flavor) {
    let server = Server::start(flavor);
    let mut conn = server.conn();
    let start = server_ms(&mut conn) - 600_000;
    publish_at(&mut conn, (0..100).map(|i| start + i * 1000));
    let (ns, _operator) = ready_policy("seekrefused", &policy("p", &server.url(), "s", "g", ""), "p");
    let _ = read_new(&mut conn, "s", "g", "worker-7", 10);
    let before = position(&mut conn);

    // A consumer active within consumersIdleFor (the default, 30s): named.
    let manifest = seek("busy", "{position: Earliest}", "").replace("  consumersIdleFor: 0s\n", "");
    let busy = run_seek(&ns, &manifest);
    assert_eq!(failed_reason(&busy), "ConsumersActive");
    let message = &busy["conditions"].as_array().unwrap().iter().find(|c| c["type"] == "Failed").unwrap()["message"];
    assert!(message.as_str().unwrap().contains("worker-7"), "{message}");

    // A time ahead of the server's clock.
    let future = format!("{{time: \"{}\"}}", rfc3339(server_ms(&mut conn) + 3_600_000));
    assert_eq!(failed_reason(&run_seek(&ns, &seek("future", &future, ""))), "TargetInFuture");

    // Older than what the stream still holds, once it was trimmed.
    let _: i64 = redis::cmd("XTRIM").arg("s").arg("MINID").arg(format!("{}-0", start + 5000)).query(&mut conn).unwrap();
    let old = format!("{{time: \"{}\"}}", rfc3339(start));
    let beyond = run_seek(&ns, &seek("old", &old, ""));
    assert_eq!(failed_reason(&beyond), "BeyondRetention");
    assert!(beyond["conditions"].to_string().contains(&format!("{}-0", start + 5000)), "{beyond}");
    assert_eq!(failed_reason(&run_seek(&ns, &seek("tooback", "{shift: -500}", ""))), "BeyondRetention");
    assert_eq!(position(&mut conn), before, "refused seeks moved nothing");

    // A policy that is not Ready: its server is gone.
    let gone = format!("redis://127.0.0.1:{}/0", free_port());
    let (ok, out) = kubectl_apply(&ns, &policy("broken", &gone, "s2", "g", ""));
    assert!(ok, "{out}");
    wait_condition(&ns, "broken", "Ready", "False", "RedisUnavailable");
    let manifest = seek("notready", "{position: Earliest}", "").replace("{name: p}", "{name: broken}");
    assert_eq!(failed_reason(&run_seek(&ns, &manifest)), "PolicyNotReady");
    assert_eq!(position(&mut conn), before);
}

fn a_seek_runs_once_whatever_happens_to_the_operator(flavor: Flavor) {
    let server = Server::start(flavor);
    let mut conn = server.conn();
    let start = server_ms(&mut conn) - 600_000;
    publish_at(&mut conn, (0..200).map(|i| start + i * 1000));
    let (ns, mut operator) = ready_policy("seekonce", &policy("p", &server.url(), "s", "g", ""), "p");
    let mut random = Lcg(u64::from(std::process::id()));
    for round in 0..10 {
        // The group at the end; the seek moves it back to entry 100 + round.
        drain(&mut conn, "c1");
        let before = position(&mut conn).0;
        let target = format!("{}-0", start + (100 + round) * 1000);
        let name = format!("once-{round}");
        let (ok, out) = kubectl_apply(&ns, &seek(&name, &format!("{{id: \"{target}\"}}"), ""));
        assert!(ok, "{out}");
        // Killed at a random moment around the seek, and started again.
        std::thread::sleep(Duration::from_millis(random.next_in(0, 400)));
        operator.kill9();
        let moved = position(&mut conn).0;
        let planned = format!("{}-18446744073709551615", start + (100 + round) * 1000 - 1);
        assert!(
            moved == before || moved == planned,
            "round {round}: the group at {moved}, neither {before} nor {planned}"
        );
        operator = Operator::start(&ns);
        let status = wait_for(&format!("{name} finished"), Duration::from_secs(30), || {
            let seek: Value =
                serde_json::from_str(&kubectl_ok(&["get", "seek", &name, "-n", &ns, "-o", "json"])).unwrap();
            match seek["status"]["phase"].as_str() {
                Some("Succeeded") => Ok(seek["status"].clone()),
                other => Err(format!("{other:?}")),
            }
        });
        let (id, _, lag) = position(&mut conn);
        assert_eq!(status["to"]["id"].as_str(), Some(planned.as_str()), "{status}");
        assert_eq!(id, planned, "round {round}: the group is where the plan says");
        assert_eq!(lag, Some(100 - round), "round {round}");
        assert_eq!(status["redelivered"].as_i64(), Some(100 - round));
        let when = if moved == before { "before" } else { "after" };
        println!("{flavor:?} round {round}: killed {when} the move; Succeeded once, at {planned}");
    }
    // A restart with every seek finished runs none of them again: the group stays where a client moved it.
    drain(&mut conn, "c1");
    let end = position(&mut conn);
    operator.kill9();
    let _again = Operator::start(&ns);
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(position(&mut conn), end, "a finished seek ran again");
    let records: usize = redis::cmd("HLEN").arg("{s}:pelican:s:g:seeks").query(&mut conn).unwrap();
    assert_eq!(records, 10, "one record per seek");
}

/// A record of the seek on the server that this version cannot read (another version's format, or written by hand):
/// the seek fails `UnexpectedReply` naming the key and field, and moves nothing.
#[test]
fn a_record_this_version_cannot_read_fails_the_seek_naming_it() {
    let server = Server::start(Flavor::Redis);
    let mut conn = server.conn();
    let start = server_ms(&mut conn) - 600_000;
    publish_at(&mut conn, (0..10).map(|i| start + i * 1000));
    let ns = namespace("seekrecord");
    let _operator = Operator::start(&ns);
    // The seek first: its policy does not exist yet, so it waits, and its uid is known before it can run.
    let (ok, out) = kubectl_apply(&ns, &seek("odd", "{position: Earliest}", ""));
    assert!(ok, "{out}");
    let path = "jsonpath={.status.conditions[?(@.type==\"Reconciling\")].reason}";
    wait_for("the seek to wait for its policy", Duration::from_secs(30), || {
        let reason = kubectl_ok(&["get", "seek", "odd", "-n", &ns, "-o", path]);
        if reason == "PolicyNotFound" { Ok(()) } else { Err(reason) }
    });
    let field = format!("{ns}/odd");
    let _: i64 =
        redis::cmd("HSET").arg("{s}:pelican:s:g:seeks").arg(&field).arg(r#"{"moved":12}"#).query(&mut conn).unwrap();
    let (ok, out) = kubectl_apply(&ns, &policy("p", &server.url(), "s", "g", ""));
    assert!(ok, "{out}");
    let status = wait_for("seek odd finished", Duration::from_secs(30), || {
        let seek: Value = serde_json::from_str(&kubectl_ok(&["get", "seek", "odd", "-n", &ns, "-o", "json"])).unwrap();
        match seek["status"]["phase"].as_str() {
            Some("Succeeded" | "Failed") => Ok(seek["status"].clone()),
            other => Err(format!("{other:?}")),
        }
    });
    assert_eq!(failed_reason(&status), "UnexpectedReply", "{status}");
    let message = status["conditions"].as_array().unwrap().iter().find(|c| c["type"] == "Failed").unwrap()["message"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(message.contains(&format!("field {field} of {{s}}:pelican:s:g:seeks")), "{message}");
    assert_eq!(position(&mut conn).0, "0-0", "the group stays where the policy created it");
    println!("{message}");
}

/// Defect (issue 48.1): a seek counted the entries after the old and the new position, and handled the PEL, in one
/// script call, holding a server every team shares for as long as the stream is long (0.85 s for a dry run over
/// 1,000,000 entries here; 3.1 s on the issue's machine). Now every call is bounded: no command of the seeks reaches
/// the server's SLOWLOG at 200 ms, and the counts are exact (the lag a client counts).
#[test]
fn a_seek_over_a_million_entries_holds_the_server_milliseconds_at_a_time() {
    let server = Server::start(Flavor::Redis);
    let mut conn = server.conn();
    let start = server_ms(&mut conn) - 7_200_000;
    publish_at(&mut conn, (0..1_000_000).map(|i| start + i * 5));
    let (ns, _operator) = ready_policy("seekmillion", &policy("p", &server.url(), "s", "g", ""), "p");
    let _: () = redis::cmd("CONFIG").arg("SET").arg("slowlog-log-slower-than").arg(200_000).query(&mut conn).unwrap();
    let _: () = redis::cmd("SLOWLOG").arg("RESET").query(&mut conn).unwrap();
    // The entries after an id, as a client counts them: XRANGE pages.
    let after = |conn: &mut redis::Connection, id: &str| -> i64 {
        let (mut from, mut n) = (format!("({id}"), 0);
        loop {
            let page = xrange_page(conn, "s", &from, 10_000);
            n += page.len() as i64;
            match page.last() {
                Some(last) if page.len() == 10_000 => from = format!("({last}"),
                _ => return n,
            }
        }
    };

    // A plan from the group's start (0-0, nothing read) to the 250,001st entry: 250,000 skipped, nothing moved.
    let quarter = format!("{}-0", start + 250_000 * 5);
    let plan = run_seek(&ns, &seek("plan", &format!("{{id: \"{quarter}\"}}"), "  dryRun: true\n"));
    assert_eq!((plan["skipped"].as_i64(), plan["to"]["lag"].as_i64()), (Some(250_000), Some(750_000)), "{plan}");
    assert_eq!(position(&mut conn).0, "0-0", "a dry run moves nothing");
    // 600,000 forward, by walking them.
    let shift = run_seek(&ns, &seek("forward", "{shift: 600000}", ""));
    let (id, _, lag) = position(&mut conn);
    assert_eq!((shift["to"]["lag"].as_i64(), lag), (Some(400_000), Some(400_000)), "{shift}");
    assert_eq!(after(&mut conn, &id), 400_000, "the lag a client counts");
    // Back to a time: 900,000 to read again.
    let time = format!("{{time: \"{}\"}}", rfc3339(start + 100_000 * 5));
    let back = run_seek(&ns, &seek("back", &time, ""));
    let (id, _, lag) = position(&mut conn);
    assert_eq!((back["redelivered"].as_i64(), lag), (Some(500_000), Some(900_000)), "{back}");
    assert_eq!(after(&mut conn, &id), 900_000, "the lag a client counts");
    let slow: Vec<redis::Value> = redis::cmd("SLOWLOG").arg("GET").arg(100).query(&mut conn).unwrap();
    assert!(slow.is_empty(), "commands slower than 200 ms while seeking: {slow:?}");

    // The id the time seek reports (a sequence above 2^53) as a target: exact, not an invalid id retried forever.
    let exact = run_seek(&ns, &seek("exact", &format!("{{id: \"{id}\"}}"), "  dryRun: true\n"));
    assert_eq!((exact["phase"].as_str(), exact["to"]["lag"].as_i64()), (Some("Succeeded"), Some(900_000)), "{exact}");
    assert!(exact["to"]["id"].as_str().unwrap().ends_with("-18446744073709551614"), "{exact}");
}

/// Defect (issue 48.6): the server's record was keyed by uid, so the same manifest deleted and applied again moved
/// the group a second time (a skip to Latest then skipped what arrived since). The record is keyed by name now.
#[test]
fn the_same_seek_applied_again_after_a_delete_moves_nothing() {
    let server = Server::start(Flavor::Redis);
    let mut conn = server.conn();
    let start = server_ms(&mut conn) - 600_000;
    publish_at(&mut conn, (0..10).map(|i| start + i * 1000));
    let (ns, _operator) = ready_policy("seekagain", &policy("p", &server.url(), "s", "g", ""), "p");
    let manifest = seek("skip", "{position: Latest}", "");
    assert_eq!(run_seek(&ns, &manifest)["skipped"].as_i64(), Some(10));
    publish_at(&mut conn, (10..15).map(|i| start + i * 1000));
    kubectl_ok(&["delete", "seek", "skip", "-n", &ns]);
    let again = run_seek(&ns, &manifest);
    assert_eq!(again["phase"].as_str(), Some("Succeeded"), "{again}");
    let complete = again["conditions"].as_array().unwrap().iter().find(|c| c["type"] == "Complete").unwrap();
    assert_eq!(complete["reason"], "AlreadyFinished", "{again}");
    assert!(complete["message"].as_str().unwrap().contains("another name"), "{complete}");
    assert_eq!(position(&mut conn).2, Some(5), "the five entries that came after the first skip are still to read");
    assert_eq!(read_new(&mut conn, "s", "g", "c1", 10).len(), 5);
}

/// Defect (issue 48.11): a DeadLetter seek of a requeued copy wrote Pelican's fields twice (the copy's and its
/// own: a dict reader saw the copy's id and its count) and dropped the last error. Now as the reclaim writes it.
#[test]
fn a_seek_dead_letters_a_requeued_copy_as_the_reclaim_does() {
    let server = Server::start(Flavor::Redis);
    let mut conn = server.conn();
    let (ns, _operator) = ready_policy("seekcopy", &policy("p", &server.url(), "s", "g", ""), "p");
    let copy: String = redis::cmd("XADD")
        .arg("s")
        .arg("*")
        .arg("order")
        .arg("7")
        .arg("pelican-origin-id")
        .arg("1-1")
        .arg("pelican-deliveries")
        .arg("2")
        .query(&mut conn)
        .unwrap();
    assert_eq!(read_new(&mut conn, "s", "g", "c1", 1), std::slice::from_ref(&copy));
    let _: i64 = redis::cmd("HSET").arg("{s}:pelican:s:g:errors").arg(&copy).arg("timeout").query(&mut conn).unwrap();
    let dead = run_seek(&ns, &seek("dead", "{position: Latest}", "  pending: DeadLetter\n"));
    assert_eq!(dead["pendingHandled"].as_i64(), Some(1), "{dead}");
    let letters = xrange(&mut conn, "s:dlq");
    assert_eq!(letters.len(), 1);
    let fields: Vec<(String, String)> = letters[0]
        .1
        .iter()
        .map(|(k, v)| (String::from_utf8_lossy(k).to_string(), String::from_utf8_lossy(v).to_string()))
        .collect();
    let named = |name: &str| fields.iter().filter(|(k, _)| k == name).map(|(_, v)| v.as_str()).collect::<Vec<_>>();
    assert_eq!(named("pelican-origin-id"), ["1-1"], "{fields:?}");
    assert_eq!(named("pelican-deliveries"), ["3"], "{fields:?}");
    assert_eq!(named("pelican-source-id"), [copy.as_str()], "{fields:?}");
    assert_eq!(named("pelican-last-error"), ["timeout"], "{fields:?}");
    assert_eq!(named("order"), ["7"], "{fields:?}");
}

/// Defect (issue 48.7): a time before 1970 was sent to the server as a negative id and retried forever.
#[test]
fn a_target_no_stream_id_can_be_fails_naming_the_field() {
    let server = Server::start(Flavor::Redis);
    let (ns, _operator) = ready_policy("seekbadid", &policy("p", &server.url(), "s", "g", ""), "p");
    let early = run_seek(&ns, &seek("early", "{time: \"1969-12-31T23:00:00Z\"}", "  dryRun: true\n"));
    assert_eq!(failed_reason(&early), "InvalidSpec");
    assert!(early["conditions"].to_string().contains("spec.to.time"), "{early}");
    let huge = run_seek(&ns, &seek("huge", "{id: \"5-18446744073709551616\"}", "  dryRun: true\n"));
    assert_eq!(failed_reason(&huge), "InvalidSpec");
    assert!(huge["conditions"].to_string().contains("spec.to.id"), "{huge}");
}

/// One seek run through the library (no operator), with the number of script calls it took.
fn seek_directly(server: &Server, target: Target, idle_ms: u64) -> (Outcome, usize) {
    let calls = std::cell::Cell::new(1);
    let seek = Seek {
        name: "ns/direct".into(),
        uid: "uid-1".into(),
        target,
        pending: PendingHandling::Keep,
        idle_ms,
        dry_run: true,
        dead_letter_max_len: None,
    };
    let keys = GroupKeys { stream: "s", group: "g", dead_letter: "s-dlq" };
    let outcome = runtime().block_on(async {
        let mut conn = Pools::default().get(&pelican::redis::Target::new(server.url())).await.unwrap();
        seeking::run(&mut conn, "test", &keys, &seek, || {
            calls.set(calls.get() + 1);
            true
        })
        .await
        .unwrap()
    });
    (outcome, calls.get())
}

/// Defect (issue 57, cost): the check of active consumers listed every consumer inside the script (twice in a dry
/// run): 300,000 consumers held Redis 7.0 1.3 s. Past `CONSUMERS_LISTED_MAX` the seek is refused, saying why.
#[test]
fn a_seek_lists_the_consumers_it_checks_only_while_there_are_few() {
    for flavor in [Flavor::Redis, Flavor::Valkey] {
        let server = Server::start(flavor);
        let mut conn = server.conn();
        let _: () =
            redis::cmd("XGROUP").arg("CREATE").arg("s").arg("g").arg("0").arg("MKSTREAM").query(&mut conn).unwrap();
        let mut pipe = redis::pipe();
        for n in 0..=pelican::jobs::CONSUMERS_LISTED_MAX {
            pipe.cmd("XGROUP").arg("CREATECONSUMER").arg("s").arg("g").arg(format!("c-{n}")).ignore();
        }
        let _: () = pipe.query(&mut conn).unwrap();
        let (outcome, _) = seek_directly(&server, Target::Earliest, 30_000);
        let Outcome::Refused { reason, message } = outcome else { panic!("{flavor:?}: {outcome:?}") };
        assert_eq!(reason, "TooManyConsumers", "{flavor:?}: {message}");
        assert!(message.contains("1001 consumers") && message.contains("consumersIdleFor: 0s"), "{message}");
        // Without the check, the seek plans as ever.
        let (outcome, _) = seek_directly(&server, Target::Earliest, 0);
        assert!(matches!(outcome, Outcome::Done(_)), "{flavor:?}: {outcome:?}");
    }
}

/// Defect (issue 57, cost): a seek's first read was 64 entries whatever their size (a walk over 1 MB entries held
/// the server 176 ms in one call). It now reads one entry first, then what READ_BYTES (2 MB) holds.
#[test]
fn a_seek_walks_large_entries_a_budget_at_a_time() {
    let server = Server::start(Flavor::Redis);
    let mut conn = server.conn();
    let _: () = redis::cmd("XGROUP").arg("CREATE").arg("s").arg("g").arg("0").arg("MKSTREAM").query(&mut conn).unwrap();
    let megabyte = vec![b'x'; 1 << 20];
    let ids: Vec<String> = (0..20)
        .map(|_| redis::cmd("XADD").arg("s").arg("*").arg("body").arg(&megabyte).query(&mut conn).unwrap())
        .collect();
    // The entries after the target are counted by walking them: 18 MB.
    let (outcome, calls) = seek_directly(&server, Target::Id(ids[2].clone()), 0);
    let Outcome::Done(plan) = outcome else { panic!("{outcome:?}") };
    assert_eq!(plan.to.lag, Some(18));
    assert!(calls >= 8, "18 MB walked in {calls} calls: more than 2 MB a call");
}

/// (last-delivered-id, lag) of group g on `stream`.
fn position_of(conn: &mut impl redis::ConnectionLike, stream: &str) -> (String, Option<i64>) {
    let groups = xinfo_groups(conn, stream);
    let g = groups.iter().find(|g| group_field::<String>(g, "name") == "g").unwrap();
    let lag = match &g["lag"] {
        redis::Value::Nil => None,
        value => Some(redis::from_redis_value::<i64>(value.clone()).unwrap()),
    };
    (group_field(g, "last-delivered-id"), lag)
}

/// A topic's seek moves the group of every partition (SPEC 22): each partition planned first, so a consumer active on
/// one refuses the whole seek with nothing moved; the status lists each partition; an id (of one stream) is refused.
#[test]
fn a_topic_seek_moves_every_partition_or_none_and_lists_each() {
    let server = Server::start(Flavor::Redis);
    let (ns, _operator) = ready_policy("seektopic", &policy("p", &server.url(), "s", "g", "  partitions: 4\n"), "p");
    let mut conn = server.conn();
    // Partition i holds i + 2 entries, all read and acknowledged by a consumer that is then removed.
    let streams: Vec<String> = (0..4).map(|i| pelican::keys::partition_stream("s", i)).collect();
    for (i, stream) in streams.iter().enumerate() {
        for _ in 0..i + 2 {
            let _: String = redis::cmd("XADD").arg(stream).arg("*").arg("n").arg(i).query(&mut conn).unwrap();
        }
        let ids = read_new(&mut conn, stream, "g", "c", 100);
        let _: i64 = redis::cmd("XACK").arg(stream).arg("g").arg(&ids).query(&mut conn).unwrap();
        let _: i64 = redis::cmd("XGROUP").arg("DELCONSUMER").arg(stream).arg("g").arg("c").query(&mut conn).unwrap();
    }

    // A consumer reading partition 2 just now: a seek that wants consumers idle for an hour moves no partition.
    let _: String = redis::cmd("XADD").arg(&streams[2]).arg("*").arg("n").arg(2).query(&mut conn).unwrap();
    let busy = read_new(&mut conn, &streams[2], "g", "busy", 1);
    let _: i64 = redis::cmd("XACK").arg(&streams[2]).arg("g").arg(&busy).query(&mut conn).unwrap();
    let before: Vec<_> = streams.iter().map(|s| position_of(&mut conn, s)).collect();
    let refused = run_seek(&ns, &seek("skip", "{position: Latest}", "").replace("0s", "1h"));
    assert_eq!(failed_reason(&refused), "ConsumersActive", "{refused}");
    let text = refused["conditions"].to_string();
    assert!(text.contains("partition 2:") && text.contains("busy") && text.contains("no partition moved"), "{text}");
    assert_eq!(streams.iter().map(|s| position_of(&mut conn, s)).collect::<Vec<_>>(), before, "nothing moved");

    // Back to the earliest entry: each partition replays all it holds (2, 3, 5 and 5 entries).
    let done = run_seek(&ns, &seek("back", "{position: Earliest}", ""));
    assert_eq!(done["phase"], "Succeeded", "{done}");
    let each = done["partitions"].as_array().unwrap();
    let replayed: Vec<(i64, i64, i64)> = each
        .iter()
        .map(|p| {
            (p["partition"].as_i64().unwrap(), p["redelivered"].as_i64().unwrap(), p["to"]["lag"].as_i64().unwrap())
        })
        .collect();
    assert_eq!(replayed, [(0, 2, 2), (1, 3, 3), (2, 5, 5), (3, 5, 5)], "{done}");
    assert_eq!((done["redelivered"].as_i64(), done["from"].is_null()), (Some(15), true), "{done}");
    for (stream, (_, _, lag)) in streams.iter().zip(&replayed) {
        assert_eq!(position_of(&mut conn, stream), ("0-0".to_string(), Some(*lag)), "{stream}");
    }
    println!("the topic's seek: {}", done["conditions"]);

    // The same manifest again after a delete: every partition says it moved before, and none moves again.
    kubectl_ok(&["delete", "seek", "back", "-n", &ns]);
    let _ = read_new(&mut conn, &streams[0], "g", "c", 100);
    let again = run_seek(&ns, &seek("back", "{position: Earliest}", ""));
    let succeeded = again["conditions"].as_array().unwrap().iter().find(|c| c["type"] == "Complete").unwrap().clone();
    assert_eq!(succeeded["reason"], "AlreadyFinished", "{again}");
    assert_eq!(again["partitions"].as_array().map(Vec::len), Some(4), "{again}");
    assert_eq!(position_of(&mut conn, &streams[0]).1, Some(0), "partition 0 was read since and not moved again");

    let by_id = run_seek(&ns, &seek("byid", "{id: \"5-0\"}", ""));
    assert_eq!(failed_reason(&by_id), "InvalidSpec");
    let said = by_id["conditions"].to_string();
    assert!(said.contains("topic of 4 partitions") && said.contains("by time, position or shift"), "{said}");
}

/// On a Cluster each partition's pending entries are dead-lettered into its own dead-letter stream, in its slot.
#[test]
fn on_a_cluster_a_topic_seek_dead_letters_each_partitions_pending_in_its_slot() {
    let cluster = Cluster::start(Flavor::Redis);
    let manifest = policy("p", &cluster.url(), "s", "g", "  partitions: 6\n").replacen(
        "  stream:",
        "    mode: Cluster\n  stream:",
        1,
    );
    let (ns, _operator) = ready_policy("seekcluster", &manifest, "p");
    let mut conn = cluster.conn();
    let streams: Vec<String> = (0..6).map(|i| pelican::keys::partition_stream("s", i)).collect();
    for stream in &streams {
        let _: String = redis::cmd("XADD").arg(stream).arg("*").arg("n").arg(1).query(&mut conn).unwrap();
        let _: redis::Value = redis::cmd("XREADGROUP")
            .arg("GROUP")
            .arg("g")
            .arg("w")
            .arg("STREAMS")
            .arg(stream)
            .arg(">")
            .query(&mut conn)
            .unwrap();
    }
    let done = run_seek(&ns, &seek("skip", "{position: Latest}", "  pending: DeadLetter\n"));
    assert_eq!((done["phase"].as_str(), done["pendingHandled"].as_i64()), (Some("Succeeded"), Some(6)), "{done}");
    for stream in &streams {
        let letters = xrange(&mut conn, &format!("{stream}:s:dlq"));
        assert_eq!(letters.len(), 1, "{stream}'s dead letters");
        let pending: (i64, redis::Value, redis::Value, redis::Value) =
            redis::cmd("XPENDING").arg(stream).arg("g").query(&mut conn).unwrap();
        assert_eq!(pending.0, 0, "{stream}'s PEL");
    }
}
