//! Throttling a backlog's drain on a shared Redis (issue 66): with `--drain-pause`, a pass that left part of its PEL
//! keeps its server's permit that long before the next pass, so a backlog moves at a bounded pace instead of at the
//! server's speed. Seen as a user sees it: the dead-letter stream's length over time.

mod common;

use std::time::{Duration, Instant};

use common::*;

/// 1,000 entries read and never acknowledged, each past the cap at its first idle (`maxDeliveries: 1`), 100 a pass:
/// with a pause of 1 s the dead-letter stream holds at most 400 of them 2.5 s after its first (passes at 0, 1, 2 s,
/// and a fourth at most), where without the pause all 1,000 move within one sweep; and all move in the end.
#[test]
fn a_backlog_drains_a_pass_per_pause_and_completely() {
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
    let ns = namespace("drain-pause");
    let _operator = Operator::start_with(&ns, &["--drain-pause", "1s"]);
    let manifest = policy("orders", &server.url(), "orders", "billing", "  retry:\n    maxDeliveries: 1\n")
        .replace("    interval: 1s\n", "    interval: 1s\n    minIdle: 1s\n    maxPerPass: 100\n");
    let (applied, out) = kubectl_apply(&ns, &manifest);
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
