//! What the benchmarks share: the bed's addresses and filling streams.
#![allow(dead_code)]

use redis::aio::ConnectionLike;

/// A variable of the running test bed (`scripts/testenv up`).
pub fn bed_var(name: &str) -> String {
    let dir = std::env::var("PELICAN_TESTENV").unwrap_or_else(|_| "/tmp/pelican-testenv".into());
    let env = std::fs::read_to_string(format!("{dir}/env")).expect("the test bed is not up: run scripts/testenv up");
    env.lines()
        .find_map(|l| l.strip_prefix(&format!("export {name}=")))
        .map(str::to_string)
        .unwrap_or_else(|| panic!("{name} missing from the bed env"))
}

/// A fresh stream of `count` entries (`n` and a `body` of `body_len` bytes) with group `group` at its start.
pub async fn fill_stream(
    conn: &mut (impl ConnectionLike + Send),
    stream: &str,
    group: &str,
    count: usize,
    body_len: usize,
) {
    let _: () = redis::cmd("DEL").arg(stream).query_async(conn).await.unwrap();
    let body = "x".repeat(body_len);
    for start in (0..count).step_by(1000) {
        let mut pipe = redis::pipe();
        for n in start..(start + 1000).min(count) {
            pipe.cmd("XADD").arg(stream).arg("*").arg("n").arg(n).arg("body").arg(&body).ignore();
        }
        let _: () = pipe.query_async(conn).await.unwrap();
    }
    let _: () = redis::cmd("XGROUP").arg("CREATE").arg(stream).arg(group).arg("0").query_async(conn).await.unwrap();
}

/// Delivers every entry of the stream to `consumer` without acknowledging any: a PEL of `count` entries.
pub async fn deliver_all(conn: &mut (impl ConnectionLike + Send), stream: &str, group: &str, count: usize) {
    let mut delivered = 0;
    while delivered < count {
        let reply: redis::streams::StreamReadReply = redis::cmd("XREADGROUP")
            .arg("GROUP")
            .arg(group)
            .arg("worker")
            .arg("COUNT")
            .arg(10_000)
            .arg("STREAMS")
            .arg(stream)
            .arg(">")
            .query_async(conn)
            .await
            .unwrap();
        delivered += reply.keys.first().map_or(0, |k| k.ids.len());
    }
}
