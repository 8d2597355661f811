//! `pelican local`: a worker developer's Redis, no cluster. The operator's jobs run from a policy file, as the
//! developer sees them: the output lines, the settings hash, the entry requeued and then dead-lettered.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::*;

const PASSWORD: &str = "local-s3cret";

/// The policy a developer would apply, in a file of its own.
fn policy_file(dir: &tempfile::TempDir, name: &str, url: &str, extra: &str) -> std::path::PathBuf {
    let yaml = format!(
        "apiVersion: pelican.io/v1alpha1\nkind: ConsumerGroupPolicy\nmetadata:\n  name: {name}\n  namespace: apps\n\
         spec:\n  redis:\n    url: {url}\n  stream: orders\n  group: billing\n  startId: \"0\"\n  reclaim:\n    \
         interval: 1s\n    minIdle: 1s\n  retry:\n    maxDeliveries: 2\n  deadLetter:\n    stream: orders:dlq\n{extra}"
    );
    let path = dir.path().join(format!("{name}.yaml"));
    std::fs::write(&path, yaml).unwrap();
    path
}

fn pelican(args: &[&str]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_pelican"));
    command.args(args).env_remove("PELICAN_REDIS_URL").env_remove("PELICAN_REDIS_PASSWORD");
    command
}

/// The running `pelican local` and the lines it printed so far.
struct Running {
    child: Child,
    lines: mpsc::Receiver<String>,
    seen: Vec<String>,
}

impl Running {
    fn start(mut command: Command) -> Running {
        let mut child = command.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
        let (sender, lines) = mpsc::channel();
        let stdout = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = sender.send(line);
            }
        });
        Running { child, lines, seen: Vec::new() }
    }

    /// The first line printed from now on that contains every one of `parts`.
    fn line_with(&mut self, parts: &[&str], timeout: Duration) -> String {
        let deadline = Instant::now() + timeout;
        while let Some(left) = deadline.checked_duration_since(Instant::now()) {
            let Ok(line) = self.lines.recv_timeout(left) else { break };
            self.seen.push(line.clone());
            if parts.iter().all(|p| line.contains(p)) {
                return line;
            }
        }
        panic!("no line with {parts:?} within {timeout:?}; printed:\n{}", self.seen.join("\n"));
    }

    /// Ctrl-C, and what it printed until it exited.
    fn interrupt(mut self) -> (std::process::ExitStatus, Vec<String>) {
        let pid = self.child.id().to_string();
        assert!(Command::new("kill").args(["-INT", &pid]).status().unwrap().success());
        let deadline = Instant::now() + Duration::from_secs(10);
        let status = loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                break status;
            }
            assert!(Instant::now() < deadline, "pelican local did not stop on Ctrl-C");
            std::thread::sleep(Duration::from_millis(50));
        };
        self.seen.extend(self.lines.try_iter());
        (status, self.seen)
    }
}

fn read_one(conn: &mut redis::Connection, consumer: &str) -> Option<(String, Vec<(String, String)>)> {
    let reply: redis::streams::StreamReadReply = redis::cmd("XREADGROUP")
        .arg(&["GROUP", "billing", consumer, "COUNT", "1", "STREAMS", "orders", ">"])
        .query(conn)
        .unwrap();
    let entry = reply.keys.into_iter().next()?.ids.into_iter().next()?;
    let fields =
        entry.map.iter().map(|(k, v)| (k.clone(), redis::from_redis_value_ref::<String>(v).unwrap())).collect();
    Some((entry.id, fields))
}

fn field<'a>(fields: &'a [(String, String)], name: &str) -> Option<&'a str> {
    fields.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
}

/// Issue 65: a worker that never acknowledges, on a Redis with a password and no cluster. `pelican local` creates the
/// group, writes the settings workers read, requeues the entry once and dead-letters it at `maxDeliveries: 2`,
/// saying so on its output, which never shows the password.
#[test]
fn an_entry_never_acknowledged_is_requeued_then_dead_lettered() {
    let server = Server::start_with(Flavor::Redis, &["--requirepass", PASSWORD]);
    let mut conn = server.conn();
    let original: String = redis::cmd("XADD").arg(&["orders", "*", "job", "42"]).query(&mut conn).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let file = policy_file(&dir, "orders", &server.url(), "");
    let mut command = pelican(&["local", "-f", file.to_str().unwrap(), "--status-every", "1s"]);
    command.env("PELICAN_REDIS_PASSWORD", PASSWORD);
    let mut local = Running::start(command);

    local.line_with(&["apps/orders", "created group \"billing\" on stream \"orders\""], Duration::from_secs(20));
    local.line_with(&["apps/orders: health: pending 0"], Duration::from_secs(10));
    let settings: Vec<(String, String)> =
        redis::cmd("HGETALL").arg(pelican::keys::settings_key("orders", "billing")).query(&mut conn).unwrap();
    assert_eq!(field(&settings, "maxDeliveries"), Some("2"), "{settings:?}");
    assert_eq!(field(&settings, "minIdleMs"), Some("1000"), "{settings:?}");

    // The first delivery, never acknowledged: requeued as a copy that says where it came from.
    let (id, fields) = read_one(&mut conn, "worker-1").expect("the entry is delivered");
    assert_eq!((id.as_str(), field(&fields, "job")), (original.as_str(), Some("42")));
    local.line_with(&["apps/orders: pass: requeued 1"], Duration::from_secs(20));
    let (copy, fields) = read_one(&mut conn, "worker-1").expect("the requeued copy is delivered");
    assert_eq!(field(&fields, "pelican-origin-id"), Some(original.as_str()), "{fields:?}");
    assert_eq!(field(&fields, "job"), Some("42"));

    // The second delivery, never acknowledged either: the cap.
    local.line_with(&["apps/orders: pass: dead-lettered 1", "(DeadLettered)"], Duration::from_secs(20));
    let dead = xrange(&mut conn, "orders:dlq");
    assert_eq!(dead.len(), 1, "{dead:?}");
    let text = |bytes: &[u8]| String::from_utf8_lossy(bytes).into_owned();
    let letter: Vec<(String, String)> = dead[0].1.iter().map(|(k, v)| (text(k), text(v))).collect();
    let letter = &letter;
    assert_eq!(field(letter, "job"), Some("42"));
    assert_eq!(field(letter, "pelican-source-stream"), Some("orders"));
    assert_eq!(field(letter, "pelican-source-id"), Some(copy.as_str()));
    assert_eq!(field(letter, "pelican-origin-id"), Some(original.as_str()));
    assert_eq!(field(letter, "pelican-group"), Some("billing"));
    assert_eq!(field(letter, "pelican-consumer"), Some("worker-1"));
    assert_eq!(field(letter, "pelican-deliveries"), Some("2"));
    assert_eq!(field(letter, "pelican-reason"), Some("MaxDeliveriesExceeded"));
    local.line_with(&["apps/orders: health: pending 0", "dead letters 1"], Duration::from_secs(10));

    let (status, printed) = local.interrupt();
    assert!(status.success(), "{status}");
    assert_eq!(printed.last().map(String::as_str), Some("stopped"));
    assert!(printed.iter().all(|line| !line.contains(PASSWORD)), "the password was printed:\n{}", printed.join("\n"));
}

/// A file `kubectl apply` would refuse is refused with the API server's messages, and nothing runs.
#[test]
fn a_policy_the_api_server_would_refuse_is_refused_with_its_message() {
    let dir = tempfile::tempdir().unwrap();
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let file = policy_file(&dir, "bad", &format!("redis://127.0.0.1:{closed}/0"), "").to_str().unwrap().to_string();
    let text = std::fs::read_to_string(&file).unwrap().replace("maxDeliveries: 2", "maxDeliveries: 0");
    std::fs::write(&file, text.replace("stream: orders:dlq", "stream: orders")).unwrap();
    let out = pelican(&["local", "-f", &file]).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("The ConsumerGroupPolicy \"bad\" is invalid"), "{stderr}");
    assert!(
        stderr.contains(
            "spec.retry.maxDeliveries: Invalid value: 0: spec.retry.maxDeliveries in body should be greater than or equal to 1"
        ),
        "{stderr}"
    );
    assert!(stderr.contains("spec.deadLetter.stream must differ from spec.stream"), "{stderr}");
}

/// Two files that claim one group: refused with the controller's message before anything is written.
#[test]
fn two_policies_of_one_group_are_refused_as_the_controller_refuses_them() {
    let dir = tempfile::tempdir().unwrap();
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let url = format!("redis://127.0.0.1:{closed}/0");
    policy_file(&dir, "first", &url, "");
    policy_file(&dir, "second", &url, "");
    let out = pelican(&["local", "-f", dir.path().to_str().unwrap()]).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains(
            "apps/second: ResourceConflict: stream \"orders\" group \"billing\" on this server is already managed by \
             ConsumerGroupPolicy apps/first"
        ),
        "{stderr}"
    );
}

/// SPEC 23: with `OTEL_EXPORTER_OTLP_ENDPOINT` set, `pelican local` puts its passes into the messages' traces as the
/// operator does: an entry published inside a trace and never acknowledged shows, in Jaeger, its requeue and then its
/// dead letter, each a child of the context the entry carries.
#[test]
#[ignore = "needs Jaeger: eval \"$(scripts/testenv jaeger)\", then --ignored (scripts/test runs it)"]
fn the_passes_join_the_traces_of_the_messages_they_move() {
    let jaeger = Jaeger::start();
    let server = Server::start(Flavor::Redis);
    let mut conn = server.conn();
    let (trace, parent) = ("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7");
    let _: String = redis::cmd("XADD")
        .arg(&["orders", "*", "job", "42", "traceparent", &format!("00-{trace}-{parent}-01")])
        .query(&mut conn)
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let file = policy_file(&dir, "orders", &server.url(), "");
    let mut command = pelican(&["local", "-f", file.to_str().unwrap()]);
    command.env("OTEL_EXPORTER_OTLP_ENDPOINT", jaeger.otlp_endpoint()).env("OTEL_SERVICE_NAME", "pelican-local");
    let mut local = Running::start(command);
    local.line_with(&["created group \"billing\""], Duration::from_secs(20));
    read_one(&mut conn, "worker-1").expect("the entry is delivered");
    local.line_with(&["apps/orders: pass: requeued 1"], Duration::from_secs(20));
    read_one(&mut conn, "worker-1").expect("the requeued copy is delivered");
    local.line_with(&["apps/orders: pass: dead-lettered 1"], Duration::from_secs(20));
    let (status, _) = local.interrupt();
    assert!(status.success(), "{status}");

    let expected = ["pelican-local: requeue orders", "pelican-local: dead letter orders"];
    let found = wait_for("the passes' spans in Jaeger", Duration::from_secs(20), || {
        let found = jaeger.trace(trace).ok_or("no such trace yet")?;
        if found.outline() == expected { Ok(found) } else { Err(format!("{:?}", found.outline())) }
    });
    for span in &found.spans {
        assert_eq!(span.parent.as_deref(), Some(parent), "{} continues the entry's context", span.name);
        assert_eq!(span.tag("messaging.consumer.group.name"), Some("billing"));
    }
    assert_eq!(found.spans[1].tag("pelican.reason"), Some("MaxDeliveriesExceeded"));
}
