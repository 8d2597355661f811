//! The bed's node (`scripts/testenv node up`), for the tests that run pods: its network namespace, and loopback
//! services of the machine made reachable from the pods.

use std::process::{Child, Command, Output, Stdio};

use super::bed;

/// The node's address on its bridge, which pods reach (scripts/testenv's NODE_IP).
pub const NODE_IP: &str = "10.200.0.1";

/// The node's init process, from `$PELICAN_TESTENV/node/env`; its network namespace holds the pods' and the
/// Services' addresses.
pub fn node_pid() -> String {
    let file = format!("{}/node/env", bed().var("PELICAN_TESTENV"));
    let env = std::fs::read_to_string(&file)
        .unwrap_or_else(|_| panic!("the node is not up ({file} missing): run `scripts/testenv node up`"));
    env.lines().find_map(|l| l.strip_prefix("export PELICAN_NODE_PID=")).expect("PELICAN_NODE_PID").to_string()
}

/// Runs a command in the node's network namespace (where pod and Service addresses are reachable).
pub fn in_node(args: &[&str]) -> Output {
    Command::new("nsenter").args(["--target", &node_pid(), "--net", "--"]).args(args).output().unwrap()
}

/// A loopback port of the machine (a Redis the test started) reachable from the pods at `NODE_IP:port`: a socat
/// pair joined by a unix socket, as the bed joins the node to the API server. Stopped when dropped.
pub struct NodeForward {
    children: [Child; 2],
    _dir: tempfile::TempDir,
}

impl NodeForward {
    pub fn to_loopback(port: u16) -> NodeForward {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("forward.sock");
        let socket = socket.to_str().unwrap();
        let quiet = |c: &mut Command| {
            c.stdout(Stdio::null()).stderr(Stdio::null());
        };
        let mut machine = Command::new("socat");
        machine.args([format!("UNIX-LISTEN:{socket},fork,mode=600"), format!("TCP:127.0.0.1:{port}")]);
        quiet(&mut machine);
        let machine = machine.spawn().expect("socat (scripts/testenv node up installs it)");
        std::thread::sleep(std::time::Duration::from_millis(200));
        let mut node = Command::new("nsenter");
        node.args(["--target", &node_pid(), "--net", "--", "socat"])
            .arg(format!("TCP-LISTEN:{port},bind={NODE_IP},fork,reuseaddr"))
            .arg(format!("UNIX-CONNECT:{socket}"));
        quiet(&mut node);
        let node = node.spawn().expect("socat in the node");
        NodeForward { children: [machine, node], _dir: dir }
    }
}

impl Drop for NodeForward {
    fn drop(&mut self) {
        for child in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A Deployment `name` of the SDK's example consumer (`localhost/pelican-consumer:bed`, `scripts/image consumer`),
/// its Pods labelled `app: <name>`, restricted, with the environment `env` (REDIS_URL, STREAM, GROUP, HANDLE_MS, ...).
pub fn consumer_deployment(name: &str, replicas: u32, grace_seconds: u32, env: &[(&str, &str)]) -> String {
    let env: String = env.iter().map(|(k, v)| format!("            - {{name: {k}, value: \"{v}\"}}\n")).collect();
    format!(
        r#"apiVersion: apps/v1
kind: Deployment
metadata:
  name: {name}
spec:
  replicas: {replicas}
  selector:
    matchLabels: {{app: {name}}}
  template:
    metadata:
      labels: {{app: {name}}}
    spec:
      terminationGracePeriodSeconds: {grace_seconds}
      securityContext:
        runAsNonRoot: true
        runAsUser: 65532
        seccompProfile: {{type: RuntimeDefault}}
      containers:
        - name: consumer
          image: localhost/pelican-consumer:bed
          imagePullPolicy: Never
          env:
{env}          securityContext:
            allowPrivilegeEscalation: false
            readOnlyRootFilesystem: true
            capabilities: {{drop: [ALL]}}
"#
    )
}
