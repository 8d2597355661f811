//! How far behind a group is in seconds, its rates, and the `Consuming` verdict, against real servers, with a
//! producer and a consumer the test paces itself (threads that publish and read a set number of entries a second).
//! Every figure is compared with the test's own computation from `XINFO GROUPS`, `XRANGE` and what it published
//! and read.

#[macro_use]
mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::*;
use serde_json::Value;

on_every_server!(lag_seconds_is_the_age_of_the_oldest_unread_entry, consuming_follows_the_consumers);

/// The server's clock, in milliseconds.
fn server_ms(conn: &mut redis::Connection) -> i64 {
    let (seconds, micros): (i64, i64) = redis::cmd("TIME").query(conn).unwrap();
    seconds * 1000 + micros / 1000
}

/// The test's own computation: the first entry after the group's `last-delivered-id`, its id's time, and its age
/// in seconds on the server's clock (0 when nothing is unread).
fn client_lag(conn: &mut redis::Connection, stream: &str, group: &str) -> (Option<i64>, f64) {
    let groups = xinfo_groups(conn, stream);
    let group = groups.iter().find(|g| group_field::<String>(g, "name") == group).unwrap();
    let last: String = group_field(group, "last-delivered-id");
    let next: Vec<(String, Vec<(String, String)>)> =
        redis::cmd("XRANGE").arg(stream).arg(format!("({last}")).arg("+").arg("COUNT").arg(1).query(conn).unwrap();
    let now = server_ms(conn);
    match next.first() {
        None => (None, 0.0),
        Some((id, _)) => {
            let ms: i64 = id.split('-').next().unwrap().parse().unwrap();
            (Some(ms), (now - ms) as f64 / 1000.0)
        }
    }
}

/// A gauge of the policy `policy` (with `label="value"` when given), from the operator's `/metrics`.
fn gauge(metrics: &str, name: &str, policy: &str, label: Option<(&str, &str)>) -> Option<f64> {
    let policy = format!("policy=\"{policy}\"");
    let label = label.map(|(k, v)| format!("{k}=\"{v}\""));
    metrics
        .lines()
        .filter(|l| l.starts_with(&format!("{name}{{")) && l.contains(&policy))
        .find(|l| label.as_ref().is_none_or(|label| l.contains(label.as_str())))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

fn rfc3339_second(ms: i64) -> String {
    k8s_openapi::jiff::Timestamp::from_second(ms.div_euclid(1000)).unwrap().to_string()
}

/// Waits until the operator's lag in seconds agrees with the test's computation within 1 s, and the status names
/// the same oldest unread entry (its time, to the second); returns the figures of that look.
fn agrees(operator: &Operator, ns: &str, conn: &mut redis::Connection, what: &str) -> (f64, f64, Value) {
    wait_for(&format!("lag seconds to agree ({what})"), Duration::from_secs(30), || {
        let (_, before) = client_lag(conn, "s", "g");
        let metric = gauge(&operator.metrics(), "pelican_group_lag_seconds", "p", None).ok_or("no series")?;
        let policy = get_policy(ns, "p");
        let (next, after) = client_lag(conn, "s", "g");
        let status = &policy["status"];
        let unread = status["oldestUnreadTime"].as_str().map(str::to_string);
        let status_seconds = status["lagSeconds"].as_i64().unwrap_or(-1) as f64;
        // The gauge was read between the test's two computations; the status is rewritten when it moves a tenth.
        let in_time = metric >= before - 1.0 && metric <= after + 1.0;
        let same_entry = unread == next.map(rfc3339_second);
        let status_close = (status_seconds - after).abs() <= (after / 10.0).max(1.0) + 1.0;
        if in_time && same_entry && status_close {
            Ok((metric, after, status.clone()))
        } else {
            Err(format!(
                "metric {metric} vs client {before:.1}..{after:.1}; status {unread:?} {status_seconds} vs {next:?}"
            ))
        }
    })
}

fn lag_seconds_is_the_age_of_the_oldest_unread_entry(flavor: Flavor) {
    let server = Server::start(flavor);
    let mut conn = server.conn();
    // 60 entries 10 s apart, the oldest ten minutes old, none read yet.
    let now = server_ms(&mut conn);
    let ids: Vec<String> = (0..60).map(|i| format!("{}-0", now - 600_000 + i * 10_000)).collect();
    for id in &ids {
        let _: String = redis::cmd("XADD").arg("s").arg(id).arg("n").arg(1).query(&mut conn).unwrap();
    }
    let (ns, operator) = ready_policy("lagseconds", &policy("p", &server.url(), "s", "g", ""), "p");

    let (metric, client, _) = agrees(&operator, &ns, &mut conn, "nothing read");
    println!("{flavor:?} nothing read: pelican_group_lag_seconds {metric}, client {client:.1}");
    assert!((599.0..700.0).contains(&client));
    let wide = kubectl_ok(&["get", "cgp", "p", "-n", &ns, "-o", "wide"]);
    println!("$ kubectl get cgp -o wide\n{wide}");
    let rows = table_rows(&wide);
    assert!(rows[0]["LAG-AGE"].ends_with('m'), "{wide}");

    // Ten read and acknowledged: the eleventh is the oldest unread.
    let read = read_new(&mut conn, "s", "g", "worker", 10);
    let _: i64 = redis::cmd("XACK").arg("s").arg("g").arg(&read).query(&mut conn).unwrap();
    let (metric, client, _) = agrees(&operator, &ns, &mut conn, "ten read");
    println!("{flavor:?} ten read: {metric} vs {client:.1}");
    assert!((499.0..600.0).contains(&client));

    // The next unread entry deleted: the one after it counts.
    let _: i64 = redis::cmd("XDEL").arg("s").arg(&ids[10]).query(&mut conn).unwrap();
    let (metric, client, _) = agrees(&operator, &ns, &mut conn, "the next one deleted");
    println!("{flavor:?} after XDEL of the next unread entry: {metric} vs {client:.1}");
    assert!((489.0..590.0).contains(&client));

    // Trimmed up to the twentieth: the twentieth is the oldest unread.
    let _: i64 = redis::cmd("XTRIM").arg("s").arg("MINID").arg(&ids[20]).query(&mut conn).unwrap();
    let (metric, client, _) = agrees(&operator, &ns, &mut conn, "trimmed");
    println!("{flavor:?} after XTRIM MINID: {metric} vs {client:.1}");
    assert!((399.0..500.0).contains(&client));

    // Everything read: 0, and no oldest unread entry.
    while !read_new(&mut conn, "s", "g", "worker", 100).is_empty() {}
    let (metric, client, status) = agrees(&operator, &ns, &mut conn, "caught up");
    println!("{flavor:?} caught up: {metric} vs {client:.1}");
    assert_eq!((metric, client), (0.0, 0.0));
    assert!(status.get("oldestUnreadTime").is_none() && status["lagSeconds"] == 0, "{status}");
}

/// Entries a second for a paced thread: 0 stops it, [`UNPACED`] lets it go as fast as it can.
const UNPACED: u64 = u64::MAX;

/// Runs `step(n)` every 100 ms with the number of entries due since the last step at `rate` a second, until `stop`.
fn paced(rate: Arc<AtomicU64>, stop: Arc<AtomicBool>, mut step: impl FnMut(u64) + Send + 'static) {
    std::thread::spawn(move || {
        let mut owed = 0.0;
        while !stop.load(Ordering::SeqCst) {
            let tick = Instant::now();
            match rate.load(Ordering::SeqCst) {
                0 => owed = 0.0,
                UNPACED => step(1_000),
                per_second => {
                    owed += per_second as f64 / 10.0;
                    let due = owed.floor();
                    owed -= due;
                    if due > 0.0 {
                        step(due as u64);
                    }
                }
            }
            std::thread::sleep(Duration::from_millis(100).saturating_sub(tick.elapsed()));
        }
    });
}

fn consuming(ns: &str) -> (String, String, String) {
    let policy = get_policy(ns, "p");
    let conditions = policy["status"]["conditions"].as_array().cloned().unwrap_or_default();
    let c = conditions.iter().find(|c| c["type"] == "Consuming").cloned().unwrap_or(Value::Null);
    let text = |k: &str| c[k].as_str().unwrap_or_default().to_string();
    (text("status"), text("reason"), text("lastTransitionTime"))
}

/// Waits for the `Consuming` reason; returns how long it took.
fn wait_verdict(ns: &str, reason: &str, within: Duration) -> Duration {
    let start = Instant::now();
    wait_for(&format!("Consuming {reason}"), within, || {
        let (status, now, _) = consuming(ns);
        if now == reason { Ok(()) } else { Err(format!("{status} {now}")) }
    });
    start.elapsed()
}

fn backlog(conn: &mut redis::Connection) -> i64 {
    let groups = xinfo_groups(conn, "s");
    let lag: i64 = group_field(&groups[0], "lag");
    let pending: i64 = group_field(&groups[0], "pending");
    lag + pending
}

fn consuming_follows_the_consumers(flavor: Flavor) {
    let server = Server::start(flavor);
    let (ns, operator) = ready_policy("consuming", &policy("p", &server.url(), "s", "g", ""), "p");
    // A window is five samples one interval (1 s) apart; "within two windows" is ten samples.
    let two_windows = Duration::from_secs(10);

    let stop = Arc::new(AtomicBool::new(false));
    let (produce, consume) = (Arc::new(AtomicU64::new(40)), Arc::new(AtomicU64::new(UNPACED)));
    let (produced, consumed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let mut producer = server.conn();
    let count = produced.clone();
    paced(produce.clone(), stop.clone(), move |n| {
        let mut pipe = redis::pipe();
        for _ in 0..n {
            pipe.cmd("XADD").arg("s").arg("*").arg("n").arg(1).ignore();
        }
        pipe.query::<()>(&mut producer).unwrap();
        count.fetch_add(n, Ordering::SeqCst);
    });
    let mut consumer = server.conn();
    let count = consumed.clone();
    paced(consume.clone(), stop.clone(), move |n| {
        let ids = read_new(&mut consumer, "s", "g", "c1", n as usize);
        if !ids.is_empty() {
            let _: i64 = redis::cmd("XACK").arg("s").arg("g").arg(&ids).query(&mut consumer).unwrap();
            count.fetch_add(ids.len() as u64, Ordering::SeqCst);
        }
    });

    // A steady load the consumer keeps up with: Progressing, and it stays so for ten windows (40 s).
    wait_verdict(&ns, "Progressing", Duration::from_secs(30));
    let (_, _, since) = consuming(&ns);
    let (start, produced_before, consumed_before) =
        (Instant::now(), produced.load(Ordering::SeqCst), consumed.load(Ordering::SeqCst));
    let mut looks = 0;
    while start.elapsed() < Duration::from_secs(40) {
        let (status, reason, transition) = consuming(&ns);
        assert_eq!((status.as_str(), reason.as_str(), &transition), ("True", "Progressing", &since), "flapped");
        looks += 1;
        std::thread::sleep(Duration::from_millis(500));
    }
    let seconds = start.elapsed().as_secs_f64();
    let added = (produced.load(Ordering::SeqCst) - produced_before) as f64 / seconds;
    let acked = (consumed.load(Ordering::SeqCst) - consumed_before) as f64 / seconds;
    let metrics = operator.metrics();
    let rate = |kind| gauge(&metrics, "pelican_group_entries_per_second", "p", Some(("kind", kind))).unwrap();
    let (op_added, op_read, op_acked) = (rate("added"), rate("read"), rate("acknowledged"));
    println!(
        "{flavor:?} steady, {looks} looks over ten windows, Progressing throughout; rates: added {op_added}/s \
         (test {added:.1}), read {op_read}/s, acknowledged {op_acked}/s (test {acked:.1})"
    );
    for (operator, test) in [(op_added, added), (op_read, acked), (op_acked, acked)] {
        assert!((operator - test).abs() <= test / 10.0, "{operator} vs {test}");
    }
    let status = get_policy(&ns, "p")["status"].clone();
    assert!(status["rates"]["added"].as_f64().is_some(), "{status}");

    // The consumer stops: NotProgressing.
    consume.store(0, Ordering::SeqCst);
    let took = wait_verdict(&ns, "NotProgressing", two_windows);
    println!("{flavor:?} consumer stopped: NotProgressing after {took:.1?}");
    // Gone altogether: NoConsumers.
    std::thread::sleep(Duration::from_millis(300));
    let mut conn = server.conn();
    let _: i64 = redis::cmd("XGROUP").arg("DELCONSUMER").arg("s").arg("g").arg("c1").query(&mut conn).unwrap();
    let took = wait_verdict(&ns, "NoConsumers", two_windows);
    println!("{flavor:?} consumer deleted: NoConsumers after {took:.1?}");
    // Back, slower than the producer (10 a second against 40): FallingBehind.
    consume.store(10, Ordering::SeqCst);
    let took = wait_verdict(&ns, "FallingBehind", two_windows);
    println!("{flavor:?} consumer at 10/s against 40/s: FallingBehind after {took:.1?}");

    // The producer stops after a burst of 2,000, and the consumer drains at 100 a second: Progressing again, and a
    // drain time that comes true within a fifth.
    produce.store(0, Ordering::SeqCst);
    let mut burst = redis::pipe();
    for _ in 0..2000 {
        burst.cmd("XADD").arg("s").arg("*").arg("n").arg(1).ignore();
    }
    burst.query::<()>(&mut conn).unwrap();
    consume.store(100, Ordering::SeqCst);
    let took = wait_verdict(&ns, "Progressing", two_windows);
    println!("{flavor:?} draining at 100/s: Progressing after {took:.1?}");
    std::thread::sleep(Duration::from_secs(5));
    let (predicted, asked) = wait_for("a drain time", Duration::from_secs(10), || {
        let metric = gauge(&operator.metrics(), "pelican_group_drain_seconds", "p", None);
        metric.map(|m| (m, Instant::now())).ok_or_else(|| "no series".to_string())
    });
    let left = backlog(&mut conn);
    wait_for("the backlog drained", Duration::from_secs(120), || {
        if backlog(&mut conn) == 0 { Ok(()) } else { Err(format!("{}", backlog(&mut conn))) }
    });
    let drained = asked.elapsed().as_secs_f64();
    println!("{flavor:?} drainSeconds {predicted} with {left} left; drained in {drained:.1} s");
    assert!((predicted - drained).abs() <= drained / 5.0, "predicted {predicted}, took {drained:.1}");
    stop.store(true, Ordering::SeqCst);

    for reason in ["NotProgressing", "NoConsumers", "FallingBehind", "Progressing"] {
        let events = events(&ns, reason);
        assert!(!events.is_empty(), "no {reason} Event");
        println!("Event {reason}: {}", events[0]["message"].as_str().unwrap_or_default());
    }
}
