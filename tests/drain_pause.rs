//! Throttling a backlog's drain on a shared Redis (issue 66): with `--drain-pause`, a pass that left part of its PEL
//! keeps its server's permit that long before the next pass, so a backlog moves at a bounded pace instead of at the
//! server's speed; a `RedisServer`'s `drainPause` sets it for the policies using that server. Seen as a user sees it:
//! the dead-letter stream's length over time.

mod common;

use std::time::{Duration, Instant};

use common::*;

/// 1,000 entries read and never acknowledged, each past the cap at its first idle (`maxDeliveries: 1`), 100 a pass:
/// with a pause of 1 s the dead-letter stream holds at most 400 of them 2.5 s after its first (passes at 0, 1, 2 s,
/// and a fourth at most), where without the pause all 1,000 move within one sweep; and all move in the end.
#[test]
fn a_backlog_drains_a_pass_per_pause_and_completely() {
    drains_a_pass_a_second("drain-pause", &["--drain-pause", "1s"], |url| (String::new(), format!("url: {url}")));
}

/// The same pace from the server's own `drainPause: 1s`, the install's `--drain-pause` left at 0; and admission refuses
/// a pause over a minute, naming the field.
#[test]
fn a_redis_servers_drain_pause_paces_its_policies() {
    drains_a_pass_a_second("server-drain-pause", &[], |url| {
        let server = format!(
            "apiVersion: pelican.io/v1alpha1\nkind: RedisServer\nmetadata:\n  name: shared\nspec:\n  url: {url}\n  \
             drainPause: 1s\n"
        );
        (server, "serverRef: {name: shared}".to_string())
    });
    let ns = namespace("server-drain-pause-max");
    let (applied, out) = kubectl_apply(
        &ns,
        "apiVersion: pelican.io/v1alpha1\nkind: RedisServer\nmetadata:\n  name: slow\nspec:\n  url: \
         redis://127.0.0.1:6379/0\n  drainPause: 2m\n",
    );
    assert!(!applied && out.contains("spec.drainPause must be at most 1m"), "{out}");
}

/// 1,000 dead letters to be, drained by the operator started with `args`, the policy connecting by what `connect`
/// gives for the server's URL: (manifests applied first, the `redis:` line of the policy).
fn drains_a_pass_a_second(prefix: &str, args: &[&str], connect: impl Fn(&str) -> (String, String)) {
    let server = Server::start(Flavor::Redis);
    let mut conn = server.conn();
    let _: () = redis::cmd("XGROUP").arg(&["CREATE", "orders", "billing", "0", "MKSTREAM"]).query(&mut conn).unwrap();
    for chunk in 0..10 {
        let mut pipe = redis::pipe();
        for n in 0..100 {
            pipe.cmd("XADD").arg("orders").arg("*").arg("n").arg(chunk * 100 + n).ignore();
        }
        let _: () = pipe.query(&mut conn).unwrap();
    }
    assert_eq!(read_new(&mut conn, "orders", "billing", "gone", 1000).len(), 1000);
    let ns = namespace(prefix);
    let _operator = Operator::start_with(&ns, args);
    let (before, redis) = connect(&server.url());
    let manifest = policy("orders", &server.url(), "orders", "billing", "  retry:\n    maxDeliveries: 1\n")
        .replace(&format!("url: {}", server.url()), &redis)
        .replace("    interval: 1s\n", "    interval: 1s\n    minIdle: 1s\n    maxPerPass: 100\n");
    let (applied, out) = kubectl_apply(&ns, &format!("{before}---\n{manifest}"));
    assert!(applied, "{out}");
    let length = |conn: &mut redis::Connection| -> usize { redis::cmd("XLEN").arg("orders:dlq").query(conn).unwrap() };
    wait_for("the first dead letters", Duration::from_secs(60), || {
        if length(&mut conn) > 0 { Ok(()) } else { Err("none yet".into()) }
    });
    let first = Instant::now();
    std::thread::sleep(Duration::from_millis(2_500));
    let moved = length(&mut conn);
    assert!(
        moved <= 400,
        "{moved} dead letters {:?} after the first: the pause did not hold the drain",
        first.elapsed()
    );
    wait_for("every entry dead-lettered", Duration::from_secs(60), || match length(&mut conn) {
        1000 => Ok(()),
        n => Err(format!("{n} of 1000")),
    });
    eprintln!(
        "1000 entries drained in {:.1} s after the first pass, 100 a pass, a pause of 1 s",
        first.elapsed().as_secs_f64()
    );
}
