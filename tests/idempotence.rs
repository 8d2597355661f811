//! Idempotent production (`XADD ... IDMP`, Redis 8.6), against every server of the bed: the SDK's
//! `IdempotentProducer` through the bounded-publish script (a publish whose reply timed out, the entry written
//! meanwhile, is published again under the same key and the stream holds it once), and `spec.idempotence` (the
//! operator sets the stream's window once, shows what the server refused, and does not clear the server's record on
//! a restart). Where the server has no `IDMP`, the producer refuses to pretend and the policy says so.

#[macro_use]
mod common;

use std::time::{Duration, Instant};

use common::*;
use pelican::keys::bounds_key;
use pelican::worker::{IdempotenceError, IdempotentProducer, Producer, PublishError, Source};

on_every_server!(
    a_publish_retried_after_a_timeout_is_written_once_where_the_server_has_idmp,
    the_policy_sets_the_window_once_and_shows_the_duplicates_refused,
);

/// From outside the SDK (redis-py and the script file, as the bounded-streams page documents it), on Redis 8.6.3: a
/// publish that timed out while the server slept (`DEBUG SLEEP`), written once the sleep ended, and published five
/// times more: one entry with the key, six without (the baseline, the same calls without `IDMP`).
#[test]
fn a_redis_py_producer_retrying_after_a_timeout_writes_one_entry() {
    let server = Server::start_with(Flavor::Redis86, &["--enable-debug-command", "yes"]);
    let script = format!("{}/contract/scripts/bounded_publish.lua", env!("CARGO_MANIFEST_DIR"));
    for (stream, producer, expected) in [("keyed", "pod-0", 1), ("plain", "-", 6)] {
        let output = std::process::Command::new("python3")
            .arg(format!("{}/tests/python/idempotent_publish.py", env!("CARGO_MANIFEST_DIR")))
            .args([&server.url()[..], stream, producer, "order-7", &script])
            .env("PYTHONPATH", bed().var("PELICAN_PYTHONPATH"))
            .output()
            .expect("python3");
        let stdout = String::from_utf8_lossy(&output.stdout).to_string();
        assert!(output.status.success(), "{stdout}{}", String::from_utf8_lossy(&output.stderr));
        println!("{producer}: {}", stdout.lines().collect::<Vec<_>>().join("; "));
        assert_eq!(stdout.lines().next(), Some("timeout"), "the first publish timed out");
        assert!(stdout.contains(&format!("length {expected}\n")), "{stdout}");
    }
    let mut conn = server.conn();
    let info: std::collections::HashMap<String, redis::Value> =
        redis::cmd("XINFO").arg("STREAM").arg("keyed").query(&mut conn).unwrap();
    assert_eq!(redis::from_redis_value::<i64>(info["iids-duplicates"].clone()).unwrap(), 5);
}

const STREAM: &str = "{orders}:in";

fn xlen(conn: &mut redis::Connection) -> u64 {
    redis::cmd("XLEN").arg(STREAM).query(conn).unwrap()
}

/// A field of `XINFO STREAM`.
fn stream_info(conn: &mut redis::Connection, field: &str) -> i64 {
    let info: std::collections::HashMap<String, redis::Value> =
        redis::cmd("XINFO").arg("STREAM").arg(STREAM).query(conn).unwrap();
    redis::from_redis_value(info[field].clone()).unwrap()
}

fn a_publish_retried_after_a_timeout_is_written_once_where_the_server_has_idmp(flavor: Flavor) {
    let server = Server::start(flavor);
    let mut conn = server.conn();
    // A bounded group, so the publish goes through the backlog check as well.
    let _: () = redis::cmd("XGROUP")
        .arg("CREATE")
        .arg(STREAM)
        .arg("billing")
        .arg("0")
        .arg("MKSTREAM")
        .query(&mut conn)
        .unwrap();
    let _: () = redis::cmd("HSET").arg(bounds_key(STREAM)).arg("billing").arg(100).query(&mut conn).unwrap();
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let source = Source::Server(redis::Client::open(server.url()).unwrap());
    let connect = || Producer::connect_with_timeout(&source, STREAM, Duration::from_millis(300));
    let producer = runtime.block_on(async { connect().await.unwrap().idempotent("orders-0").await });
    if flavor != Flavor::Redis86 {
        let error = producer.err().expect("a server without XADD IDMP refuses an idempotent producer");
        assert!(matches!(error, IdempotenceError::Unsupported), "{error:?}");
        assert!(error.to_string().contains("no XADD ... IDMP (Redis 8.6 or later)"), "{error}");
        assert_eq!(xlen(&mut conn), 0);
        return;
    }
    let producer = producer.unwrap();
    let empty = runtime.block_on(async { connect().await.unwrap().idempotent("").await });
    assert!(matches!(empty, Err(IdempotenceError::EmptyProducerId)));

    // A producer that has been publishing (the script is cached on the server: a first call's EVALSHA would be
    // answered NOSCRIPT and its body never sent once the caller gave up).
    let zeroth = runtime.block_on(producer.publish("order-0", &[("order", "0")])).unwrap();

    // The server holds every write for 3 s: the publish times out with its entry queued on the server, which
    // writes it once the pause ends; the producer cannot tell.
    let _: () = redis::cmd("CLIENT").arg("PAUSE").arg(3000).arg("WRITE").query(&mut conn).unwrap();
    let started = Instant::now();
    let unknown = runtime.block_on(producer.publish("order-1", &[("order", "1"), ("amount", "30")])).unwrap_err();
    assert!(matches!(unknown, PublishError::OutcomeUnknown(_)), "{unknown:?}");
    assert!(started.elapsed() < Duration::from_secs(3), "the timeout, not the pause, ended the call");
    let _: () = redis::cmd("CLIENT").arg("UNPAUSE").query(&mut conn).unwrap();
    wait_for("the timed-out publish written by the server", Duration::from_secs(10), || {
        let n = xlen(&mut conn);
        if n == 2 { Ok(()) } else { Err(format!("{n} entries")) }
    });
    let entries: Vec<(String, Vec<String>)> =
        redis::cmd("XRANGE").arg(STREAM).arg("-").arg("+").query(&mut conn).unwrap();
    assert_eq!(entries[0].0, zeroth);
    let first = &entries[1];
    assert_eq!(first.1, ["order", "1", "amount", "30"]);

    // Published again five times, as a producer retrying after OutcomeUnknown does: one entry, its id each time.
    for _ in 0..5 {
        let id = runtime.block_on(producer.publish("order-1", &[("order", "1"), ("amount", "30")])).unwrap();
        assert_eq!(id, first.0);
    }
    assert_eq!(xlen(&mut conn), 2);
    assert_eq!(stream_info(&mut conn, "iids-duplicates"), 5);
    assert_eq!(stream_info(&mut conn, "iids-added"), 2);

    // Another message, and the same message id under another producer: new entries.
    let second = runtime.block_on(producer.publish("order-2", &[("order", "2")])).unwrap();
    let other = runtime.block_on(async { connect().await.unwrap().idempotent("orders-1").await }).unwrap();
    let third = runtime.block_on(other.publish("order-1", &[("order", "1")])).unwrap();
    assert!(first.0 < second && second < third, "{:?} {second} {third}", first.0);
    assert_eq!(xlen(&mut conn), 4);
    assert_eq!(stream_info(&mut conn, "pids-tracked"), 2);

    // A batch through the batch script: a message already published, a new one, and the new one again.
    let order: &[(&str, &str)] = &[("order", "3")];
    let batch = [("order-1", order), ("order-3", order), ("order-3", order)];
    let published = runtime.block_on(producer.publish_batch(&batch)).unwrap();
    assert_eq!(published.refused, None);
    assert_eq!(published.ids[0], first.0, "the message published before answers its first entry's id");
    assert!(published.ids[1] > third && published.ids[2] == published.ids[1], "{:?}", published.ids);
    assert_eq!(xlen(&mut conn), 5);
}

fn idempotent_producer(runtime: &tokio::runtime::Runtime, url: &str, producer_id: &str) -> IdempotentProducer {
    let source = Source::Server(redis::Client::open(url).unwrap());
    runtime
        .block_on(async { Producer::connect_to(&source, STREAM).await.unwrap().idempotent(producer_id).await.unwrap() })
}

/// `status.idempotence.<field>` of the policy, once the status shows it.
fn shown(ns: &str, field: &str) -> Option<i64> {
    get_policy(ns, "p")["status"]["idempotence"][field].as_i64()
}

fn the_policy_sets_the_window_once_and_shows_the_duplicates_refused(flavor: Flavor) {
    let server = Server::start(flavor);
    let mut conn = server.conn();
    let manifest =
        policy("p", &server.url(), STREAM, "billing", "  idempotence:\n    duration: 10m\n    maxSize: 1000\n");
    let (ns, operator) = ready_policy("idmp", &manifest, "p");
    if flavor != Flavor::Redis86 {
        let policy = wait_condition(&ns, "p", "Idempotent", "False", "ServerWithoutIdmp");
        let said =
            policy["status"]["conditions"].as_array().unwrap().iter().find(|c| c["type"] == "Idempotent").unwrap();
        println!("{flavor:?}: Idempotent False: {}", said["message"]);
        assert!(said["message"].as_str().unwrap().contains("no XADD ... IDMP (Redis 8.6 or later)"), "{said}");
        assert!(policy["status"]["idempotence"].is_null());
        return;
    }
    wait_condition(&ns, "p", "Idempotent", "True", "WindowApplied");
    assert_eq!((stream_info(&mut conn, "idmp-duration"), stream_info(&mut conn, "idmp-maxsize")), (600, 1000));
    wait_for("the IdempotenceWindowSet Event", Duration::from_secs(30), || {
        let set = events(&ns, "IdempotenceWindowSet");
        if set.is_empty() { Err("none".into()) } else { Ok(()) }
    });

    // One message published three times: one entry, two duplicates refused, shown in status and metrics.
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let producer = idempotent_producer(&runtime, &server.url(), "pod-0");
    let ids: Vec<String> =
        (0..3).map(|_| runtime.block_on(producer.publish("order-1", &[("order", "1")])).unwrap()).collect();
    assert!(ids.iter().all(|id| *id == ids[0]), "{ids:?}");
    wait_for("status.idempotence.duplicates 2", Duration::from_secs(30), || match shown(&ns, "duplicates") {
        Some(2) => Ok(()),
        other => Err(format!("{other:?}")),
    });
    let status = get_policy(&ns, "p")["status"]["idempotence"].clone();
    println!("status.idempotence: {status}");
    assert_eq!((shown(&ns, "durationSeconds"), shown(&ns, "maxSize")), (Some(600), Some(1000)));
    assert_eq!((shown(&ns, "producers"), shown(&ns, "messageIds"), shown(&ns, "added")), (Some(1), Some(1), Some(1)));
    wait_for("pelican_idempotent_duplicates_total 2", Duration::from_secs(30), || {
        let metrics = operator.metrics();
        let line = metrics.lines().find(|l| l.starts_with("pelican_idempotent_duplicates_total{")).unwrap_or("");
        if line.ends_with(" 2") { Ok(()) } else { Err(line.to_string()) }
    });

    // A restarted operator finds the window in place and leaves the server's record alone: the retry after the
    // restart is still refused.
    drop(operator);
    let operator = Operator::start(&ns);
    wait_for("the restarted operator's first look", Duration::from_secs(60), || {
        let metrics = operator.metrics();
        if metrics.contains("pelican_idempotent_message_ids{") { Ok(()) } else { Err("no series yet".into()) }
    });
    assert_eq!(stream_info(&mut conn, "iids-tracked"), 1, "XCFGSET ran again and cleared the record");
    let again = runtime.block_on(producer.publish("order-1", &[("order", "1")])).unwrap();
    assert_eq!(again, ids[0]);
    assert_eq!((xlen(&mut conn), stream_info(&mut conn, "iids-duplicates")), (1, 3));

    // A changed window is set once more (and says that the record was cleared).
    kubectl_ok(&["patch", "cgp", "p", "-n", &ns, "--type=merge", "-p", r#"{"spec":{"idempotence":{"maxSize":2000}}}"#]);
    wait_for("idmp-maxsize 2000", Duration::from_secs(30), || match stream_info(&mut conn, "idmp-maxsize") {
        2000 => Ok(()),
        other => Err(other.to_string()),
    });
    assert_eq!(stream_info(&mut conn, "iids-tracked"), 0);
    drop(operator);
}

/// Defect (issue 57.11): two policies of one stream that name its server differently (here `127.0.0.1` and
/// `localhost`) do not see each other as neighbours, so each put its own window in place at every reconcile:
/// `XCFGSET` back and forth, each time clearing the server's record, and a retried publish duplicated. They now
/// agree on the server (the longest duration, the largest size): the window is set once and the record kept.
#[test]
fn two_policies_naming_one_server_differently_agree_on_one_window() {
    let server = Server::start(Flavor::Redis86);
    let mut conn = server.conn();
    let first = policy("p", &server.url(), STREAM, "billing", "  idempotence:\n    duration: 10m\n    maxSize: 1000\n");
    let (ns, _operator) = ready_policy("idmpnames", &first, "p");
    let other_url = server.url().replace("127.0.0.1", "localhost");
    let second = policy("q", &other_url, STREAM, "shipping", "  idempotence:\n    duration: 5m\n    maxSize: 2000\n")
        .replace(&format!("\"{STREAM}:dlq\""), "\"{orders}:dlq-shipping\"");
    assert!(kubectl_apply(&ns, &second).0);
    for name in ["p", "q"] {
        let policy = wait_condition(&ns, name, "Idempotent", "True", "WindowApplied");
        let said =
            policy["status"]["conditions"].as_array().unwrap().iter().find(|c| c["type"] == "Idempotent").cloned();
        println!("{name}: {}", said.unwrap()["message"]);
    }
    wait_for("the window 600 s, 2000 ids", Duration::from_secs(30), || {
        match (stream_info(&mut conn, "idmp-duration"), stream_info(&mut conn, "idmp-maxsize")) {
            (600, 2000) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    });
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let producer = idempotent_producer(&runtime, &server.url(), "pod-0");
    let id = runtime.block_on(producer.publish("order-1", &[("order", "1")])).unwrap();
    // Both policies reconcile every second: several rounds each.
    std::thread::sleep(Duration::from_secs(6));
    assert_eq!(stream_info(&mut conn, "iids-tracked"), 1, "XCFGSET ran again and cleared the record");
    assert_eq!(runtime.block_on(producer.publish("order-1", &[("order", "1")])).unwrap(), id);
    assert_eq!(xlen(&mut conn), 1);
    assert_eq!((stream_info(&mut conn, "idmp-duration"), stream_info(&mut conn, "idmp-maxsize")), (600, 2000));
    let set = events(&ns, "IdempotenceWindowSet");
    assert!(set.len() <= 2, "the window set {} times: {set:?}", set.len());
}

/// Defect (issue 57.13): an operator user without `+command|docs` (the features then unknown) made `Idempotent`
/// say `ServerWithoutIdmp` on Redis 8.6. The stream's own `XINFO STREAM` fields tell it: the window is applied.
#[test]
fn without_command_docs_the_window_is_still_applied_where_the_server_has_idmp() {
    let server = Server::start(Flavor::Redis86);
    let mut conn = server.conn();
    let path = format!("{}/examples/acl/pelican.acl", env!("CARGO_MANIFEST_DIR"));
    let file = std::fs::read_to_string(path).unwrap();
    let line = file.lines().find(|l| l.starts_with("user ")).unwrap();
    let mut setuser = redis::cmd("ACL");
    setuser.arg("SETUSER").arg("pelican").arg("reset");
    for rule in line.split_whitespace().skip(2) {
        match rule {
            "+command|docs" => {}
            ">CHANGE-ME" => _ = setuser.arg(">pelican-pw"),
            "~STREAM" | "~DEAD_LETTER_STREAM" | "~{T}:pelican:*" | "~{D}:pelican:*" => _ = setuser.arg("~{orders}*"),
            rule => _ = setuser.arg(rule),
        }
    }
    let _: () = setuser.arg("+xcfgset").query(&mut conn).unwrap();
    let secret = "apiVersion: v1\nkind: Secret\nmetadata:\n  name: redis-acl\nstringData:\n  username: pelican\n  password: pelican-pw\n";
    let refs = "    usernameSecretRef: {name: redis-acl, key: username}\n    passwordSecretRef: {name: redis-acl, key: password}\n";
    let manifest =
        policy("p", &server.url(), STREAM, "billing", "  idempotence:\n    duration: 10m\n    maxSize: 1000\n")
            .replacen("  stream:", &format!("{refs}  stream:"), 1);
    let (ns, _operator) = ready_policy("idmpacl", &format!("{secret}---\n{manifest}"), "p");
    let policy = wait_condition(&ns, "p", "Idempotent", "True", "WindowApplied");
    assert!(policy["status"]["serverFeatures"].as_array().is_none_or(|f| f.is_empty()), "{}", policy["status"]);
    assert_eq!((stream_info(&mut conn, "idmp-duration"), stream_info(&mut conn, "idmp-maxsize")), (600, 1000));
}

/// A topic's window (SPEC 22) is each partition's: set on every partition, and an idempotent topic producer's message
/// published three times is one entry in its partition, the duplicates summed in the topic's status.
#[test]
fn a_topics_window_is_set_on_every_partition() {
    let server = Server::start(Flavor::Redis86);
    let mut conn = server.conn();
    let extra = "  partitions: 3\n  idempotence:\n    duration: 10m\n    maxSize: 1000\n";
    let (ns, _operator) = ready_policy("idmptopic", &policy("p", &server.url(), "t", "billing", extra), "p");
    wait_condition(&ns, "p", "Idempotent", "True", "WindowApplied");
    for i in 0..3 {
        let info: std::collections::HashMap<String, redis::Value> =
            redis::cmd("XINFO").arg("STREAM").arg(pelican::keys::partition_stream("t", i)).query(&mut conn).unwrap();
        let field = |name: &str| redis::from_redis_value::<i64>(info[name].clone()).unwrap();
        assert_eq!((field("idmp-duration"), field("idmp-maxsize")), (600, 1000), "partition {i}");
    }
    let said = wait_for("the IdempotenceWindowSet Event", Duration::from_secs(30), || {
        let set = events(&ns, "IdempotenceWindowSet");
        if set.is_empty() { Err("none".into()) } else { Ok(set) }
    });
    assert_eq!(said.len(), 1, "said once for the topic: {said:?}");
    assert!(said[0]["message"].as_str().unwrap().contains("3 of the 3 partitions of topic \"t\""), "{}", said[0]);

    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let source = Source::Server(redis::Client::open(server.url()).unwrap());
    let producer = runtime.block_on(async {
        pelican::worker::TopicProducer::connect_to(&source, "t").await.unwrap().idempotent("pod-0").await.unwrap()
    });
    let published: Vec<(u32, String)> = (0..3)
        .map(|_| runtime.block_on(producer.publish(Some(b"user-7"), "order-1", &[("order", "1")])).unwrap())
        .collect();
    assert!(published.iter().all(|p| *p == published[0]), "{published:?}");
    wait_for("status.idempotence.duplicates 2", Duration::from_secs(30), || match shown(&ns, "duplicates") {
        Some(2) => Ok(()),
        other => Err(format!("{other:?}")),
    });
    assert_eq!((shown(&ns, "durationSeconds"), shown(&ns, "added")), (Some(600), Some(1)));
}
