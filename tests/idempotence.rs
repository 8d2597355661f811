//! Idempotent production (`XADD ... IDMP`, Redis 8.6): the SDK's `IdempotentProducer` through the bounded-publish
//! script, against every server of the bed. Where the server has `IDMP`, a publish whose reply timed out (the entry
//! written meanwhile) is published again under the same key and the stream holds it once; where it has not, the
//! producer refuses to pretend.

#[macro_use]
mod common;

use std::time::{Duration, Instant};

use common::*;
use pelican::keys::bounds_key;
use pelican::worker::{IdempotenceError, Producer, PublishError, Source};

on_every_server!(a_publish_retried_after_a_timeout_is_written_once_where_the_server_has_idmp);

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
}
