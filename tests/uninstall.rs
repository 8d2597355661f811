//! The uninstall key sweep (`scripts/uninstall-keys`, docs/src/installing.md "Uninstall") against keys a real
//! operator wrote: it deletes the keys of the install's policies and nothing else on a server others share, and
//! reaches a server with a password and TLS.

#[macro_use]
mod common;

use std::collections::BTreeSet;
use std::process::{Command, Output};

use common::*;
use pelican::keys::{bounds_key, errors_key, idempotence_key, legacy_keys, redrive_key, topic_key};

const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/uninstall-keys");

/// The script as a user runs it: the bed's kubectl on the PATH, the password (if any) in `REDISCLI_AUTH` only.
fn run(args: &[&str], stdin: &str, password: Option<&str>) -> Output {
    let kubectl_dir = std::path::Path::new(bed().var("PELICAN_KUBECTL")).parent().unwrap().to_path_buf();
    let path = format!("{}:{}", kubectl_dir.display(), std::env::var("PATH").unwrap_or_default());
    let mut command = Command::new(SCRIPT);
    command.args(args).env("PATH", path).env("KUBECONFIG", bed().kubeconfig()).env_remove("REDISCLI_AUTH");
    if let Some(password) = password {
        command.env("REDISCLI_AUTH", password);
    }
    let mut child = command
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    child.stdin.take().unwrap().write_all(stdin.as_bytes()).unwrap();
    child.wait_with_output().unwrap()
}

fn keys(conn: &mut redis::Connection) -> BTreeSet<String> {
    redis::cmd("KEYS").arg("*").query::<Vec<String>>(conn).unwrap().into_iter().collect()
}

/// Issue 66.4: the documented sweep deleted `*:pelican:*` on the whole server (another install's state, an
/// application key holding `:pelican:`) and its `redis-cli` had no password or TLS. Two policies of this install (a
/// stream and a topic of 2 partitions) reconciled by the operator, beside keys of another install on the same server
/// (another group of the same stream, a group named `workers:b`, another stream) and an application key: the sweep
/// over TLS with a password leaves exactly the others' keys, and their fields in the hashes a stream's groups share.
#[test]
fn the_sweep_deletes_this_installs_keys_only_over_tls_with_a_password() {
    let mut server = Server::start_tls(Flavor::Redis, "server", false);
    let orders = policy("orders", &server.url(), "orders", "workers", "");
    let topic = policy("events", &server.url(), "events", "g", "  partitions: 2\n");
    let (ns, operator) = ready_policy("uninstall", &format!("{orders}---\n{topic}"), "orders");
    wait_condition(&ns, "events", "Ready", "True", "Reconciled");

    let list = run(&["list", "-n", &ns], "", None);
    assert!(list.status.success(), "{}", String::from_utf8_lossy(&list.stderr));
    let listed = String::from_utf8(list.stdout).unwrap();
    let lines: Vec<Vec<&str>> = listed.lines().map(|l| l.split('\t').collect()).collect();
    let url = server.url();
    let mut summary: Vec<_> = lines.iter().map(|c| (c[0].to_string(), c[1], c[2], c[3], c[4], c[5])).collect();
    summary.sort();
    let expected = [
        (format!("{ns}/events"), url.as_str(), "events", "g", "events:dlq", "2"),
        (format!("{ns}/orders"), url.as_str(), "orders", "workers", "orders:dlq", "0"),
    ];
    assert_eq!(summary, expected, "{listed}");
    let orders_uid = lines.iter().find(|c| c[2] == "orders").unwrap()[6].to_string();

    kubectl_ok(&["delete", "cgp", "--all", "-n", &ns, "--timeout=30s"]);
    drop(operator);
    let mut conn = server.conn();
    let written = keys(&mut conn);
    for key in ["{orders}:pelican:orders:workers:settings", "{events:0}:pelican:{events:0}:g:settings"] {
        assert!(written.contains(key), "the operator wrote {key}: {written:?}");
    }
    // What the operator writes only in passes, redrives and the 0.1 upgrade, of this install.
    let _: () = redis::pipe()
        .hset(errors_key("orders", "workers"), "1-0", "boom")
        .hset(redrive_key("orders:dlq", &ns, "again"), "last", "1-0")
        .hset("{orders:dlq}:pelican:orders:dlq:redrive-lock", "name", format!("{ns}/again"))
        .hset(redrive_key("events:dlq", &ns, "replay"), "last", "1-0")
        .hset(&legacy_keys("orders", "workers")[0], "acked", 1)
        .hset(bounds_key("orders"), "workers", 10)
        .hset(idempotence_key("orders"), &orders_uid, "5000")
        .query(&mut conn)
        .unwrap();
    // Another install's: another group of the same stream (and of the topic's partition), a group whose name
    // extends ours, another stream, a redrive of another namespace on our dead-letter stream.
    let others = [
        "{orders}:pelican:orders:audit:settings",
        "{events:0}:pelican:{events:0}:audit:settings",
        "{orders}:pelican:orders:workers:b:settings",
        "{payments}:pelican:payments:workers:settings",
        "{orders:dlq}:pelican:orders:dlq:redrive:other/again",
        "app:pelican:cache",
    ];
    for key in others {
        let _: () = redis::cmd("HSET").arg(key).arg("f").arg("v").query(&mut conn).unwrap();
    }
    let _: () = redis::pipe()
        .hset(bounds_key("orders"), "audit", 20)
        .hset(idempotence_key("orders"), "uid-of-another-policy", "5000")
        .query(&mut conn)
        .unwrap();
    let _: () = redis::cmd("CONFIG").arg("SET").arg("requirepass").arg("sweep-pw").query(&mut conn).unwrap();
    let mut conn = redis::Client::open(format!("redis://:sweep-pw@127.0.0.1:{}/0", server.port))
        .unwrap()
        .get_connection()
        .unwrap();
    let before = keys(&mut conn);

    let tls_port = server.tls_port.unwrap().to_string();
    let ca = tls_file("ca.crt");
    let over_tls = ["sweep", "--batch", "2", "-h", "127.0.0.1", "-p", &tls_port, "--tls", "--cacert", &ca];
    let refused = run(&over_tls, &listed, None);
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success() && stderr.contains("NOAUTH"), "without the password: {stderr}");
    assert_eq!(keys(&mut conn), before, "nothing deleted without the password");

    let mut dry_run = over_tls.to_vec();
    dry_run.insert(1, "--dry-run");
    let listed_only = run(&dry_run, &listed, Some("sweep-pw"));
    let would = String::from_utf8_lossy(&listed_only.stdout);
    assert!(listed_only.status.success(), "{would}{}", String::from_utf8_lossy(&listed_only.stderr));
    assert!(would.contains("would unlink {orders}:pelican:orders:workers:settings\n"), "{would}");
    assert_eq!(keys(&mut conn), before, "nothing deleted by a dry run");

    let swept = run(&over_tls, &listed, Some("sweep-pw"));
    let stdout = String::from_utf8_lossy(&swept.stdout);
    println!("scripts/uninstall-keys sweep:\n{stdout}");
    assert!(swept.status.success(), "{stdout}{}", String::from_utf8_lossy(&swept.stderr));
    assert!(stdout.contains("scripts/uninstall-keys: 2 policies swept"), "{stdout}");
    assert!(stdout.contains(&format!("{ns}/orders: ")) && stdout.contains("2 hash fields removed"), "{stdout}");

    let mut left: BTreeSet<String> = others.iter().map(|k| k.to_string()).collect();
    left.extend([bounds_key("orders"), idempotence_key("orders"), topic_key("events")]);
    left.extend(["orders", "{events:0}", "{events:1}"].map(String::from));
    assert_eq!(keys(&mut conn), left, "the streams, the others' keys and the topic's (producers read it) are left");
    let bounds: Vec<String> = redis::cmd("HKEYS").arg(bounds_key("orders")).query(&mut conn).unwrap();
    assert_eq!(bounds, ["audit"]);
    let windows: Vec<String> = redis::cmd("HKEYS").arg(idempotence_key("orders")).query(&mut conn).unwrap();
    assert_eq!(windows, ["uid-of-another-policy"]);
    server.stop();
}
