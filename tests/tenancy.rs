//! Tenancy through `RedisServer` against the real API server and real Redis 7.0 / Valkey 9.1: two teams on one
//! server, each attempt of one team on the other's keys refused before anything reaches Redis (checked by reading
//! Redis), namespaces the server does not admit, `--inline-connections=deny`, and a password rotated once for every
//! policy that uses the server.

mod common;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use common::*;
use pelican::keys;
use serde_json::Value;

/// An operator watching every namespace, for the policies labelled `pelican-test=<label>` only (the bed holds
/// other tests' policies).
fn operator(label: &str, extra: &[&str]) -> Operator {
    let selector = format!("pelican-test={label}");
    let args: Vec<&str> = ["--watch-label-selector", selector.as_str()].iter().chain(extra).copied().collect();
    Operator::launch(&args, bed().kubeconfig())
}

/// A `RedisServer` with a password Secret, labelled for the operator of `label` (which writes its status);
/// `tenants` is YAML under `spec:`.
fn server_manifest(label: &str, url: &str, password: &str, tenants: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Secret\nmetadata:\n  name: shared-auth\nstringData:\n  password: {password}\n---\n\
         apiVersion: pelican.io/v1alpha1\nkind: RedisServer\nmetadata:\n  name: shared\n  labels: {{pelican-test: \
         {label}}}\nspec:\n  url: {url}\n  passwordSecretRef: {{name: shared-auth, key: password}}\n{tenants}"
    )
}

/// [`server_manifest`] for a server without a password, admitting `namespace` to the keys `keys` (one pattern).
fn open_server_manifest(label: &str, url: &str, namespace: &str, keys: &str) -> String {
    let tenants = format!("  tenants:\n  - namespaces: [{namespace}]\n    keys: [\"{keys}\"]\n");
    server_manifest(label, url, "", &tenants).replace("  passwordSecretRef: {name: shared-auth, key: password}\n", "")
}

/// A policy on the server `platform/shared`; `extra` is YAML under `spec:`.
fn tenant_policy(name: &str, label: &str, platform: &str, stream: &str, group: &str, dlq: &str, extra: &str) -> String {
    format!(
        "apiVersion: pelican.io/v1alpha1\nkind: ConsumerGroupPolicy\nmetadata:\n  name: {name}\n  labels: \
         {{pelican-test: {label}}}\nspec:\n  redis:\n    serverRef: {{name: shared, namespace: {platform}}}\n  stream: \
         \"{stream}\"\n  group: {group}\n  startId: \"0\"\n  reclaim: {{interval: 1s, minIdle: 1s}}\n  retry: \
         {{maxDeliveries: 1}}\n  deadLetter:\n    stream: \"{dlq}\"\n{extra}"
    )
}

fn ready_message(policy: &Value) -> String {
    let conditions = policy["status"]["conditions"].as_array().cloned().unwrap_or_default();
    conditions.iter().find(|c| c["type"] == "Ready").map(|c| c["message"].as_str().unwrap_or("").to_string()).unwrap()
}

/// What a team sees of its keys on the server: stream and dead-letter lengths, groups and each group's pending
/// entries, the bounds hash.
#[derive(Debug, PartialEq)]
struct Keys {
    length: usize,
    dead_letters: usize,
    groups: Vec<String>,
    /// (id, consumer, deliveries) of each pending entry: the idle time moves by itself.
    pending: HashMap<String, Vec<(String, String, i64)>>,
    bounds: HashMap<String, String>,
}

fn keys_of(conn: &mut redis::Connection, stream: &str, dlq: &str) -> Keys {
    let mut groups = group_names(conn, stream);
    groups.sort();
    let pending = groups
        .iter()
        .map(|g| (g.clone(), pel(conn, stream, g).into_iter().map(|(id, consumer, _, n)| (id, consumer, n)).collect()))
        .collect();
    let bounds: HashMap<String, String> = redis::cmd("HGETALL").arg(keys::bounds_key(stream)).query(conn).unwrap();
    Keys { length: xrange(conn, stream).len(), dead_letters: xrange(conn, dlq).len(), groups, pending, bounds }
}

fn two_teams_cannot_reach_each_others_keys(flavor: Flavor) {
    let server = Server::start_with(flavor, &["--requirepass", "platform-pw"]);
    let (platform, a, b) = (namespace("platform"), namespace("team-a"), namespace("team-b"));
    let label = a.clone();
    let _operator = operator(&label, &[]);
    let tenants = format!(
        "  tenants:\n  - namespaces: [{a}]\n    keys: [\"{{${{namespace}}}}:*\"]\n  - namespaces: [{b}]\n    keys: \
         [\"{{${{namespace}}}}:*\"]\n"
    );
    let (ok, out) = kubectl_apply(&platform, &server_manifest(&label, &server.url(), "platform-pw", &tenants));
    assert!(ok, "{out}");
    let (a_stream, a_dlq) = (format!("{{{a}}}:orders"), format!("{{{a}}}:dlq"));

    // Team A: its policy Ready on the shared server, without any Secret in its namespace.
    let p = |name: &str, stream: &str, group: &str, dlq: &str, extra: &str| {
        tenant_policy(name, &label, &platform, stream, group, dlq, extra)
    };
    assert!(kubectl_apply(&a, &p("orders", &a_stream, "a-main", &a_dlq, "  suspend: true\n")).0);
    wait_condition(&a, "orders", "Ready", "True", "Reconciled");
    // A's data: ten entries, a group of A's without a policy with five of them pending, one dead letter, a bound.
    let mut conn = server.conn();
    for n in 0..10 {
        let _: String = redis::cmd("XADD").arg(&a_stream).arg("*").arg("n").arg(n).query(&mut conn).unwrap();
    }
    let _: () = redis::cmd("XGROUP").arg("CREATE").arg(&a_stream).arg("a-adhoc").arg("0").query(&mut conn).unwrap();
    assert_eq!(read_new(&mut conn, &a_stream, "a-adhoc", "worker", 5).len(), 5);
    let _: String = redis::cmd("XADD").arg(&a_dlq).arg("*").arg("n").arg(99).query(&mut conn).unwrap();
    // A bound of A's own, on the group without a policy (A's policy, which sets none, clears its own group's).
    let _: i64 = redis::cmd("HSET").arg(keys::bounds_key(&a_stream)).arg("a-adhoc").arg(1000).query(&mut conn).unwrap();
    let before = keys_of(&mut conn, &a_stream, &a_dlq);

    // Team B, on the same server, tries each way of touching A's keys.
    let b_own = format!("{{{b}}}:jobs");
    let attempts = [
        // A bound on A's stream with a group that never reads: A's producers would be refused.
        ("bound", p("bound", &a_stream, "b-idle", &format!("{{{b}}}:x"), "  backlog: {maxLength: 1}\n"), "spec.stream"),
        // A group of A's without a policy, destroyed with its pending entries when B's policy is deleted.
        (
            "destroy",
            p("destroy", &a_stream, "a-adhoc", &format!("{{{b}}}:y"), "  deletionPolicy: Delete\n"),
            "spec.stream",
        ),
        // A's pending entries dead-lettered into a stream of B's, and A's stream trimmed.
        (
            "loot",
            p("loot", &a_stream, "a-adhoc", &format!("{{{b}}}:loot"), "  retention: {mode: Acknowledged}\n"),
            "spec.stream",
        ),
        // A's dead-letter stream as B's: a redrive of it would move A's dead letters.
        ("drain", p("drain", &b_own, "b-workers", &a_dlq, ""), "spec.deadLetter.stream"),
    ];
    for (name, manifest, _) in &attempts {
        let (ok, out) = kubectl_apply(&b, manifest);
        assert!(ok, "{name}: {out}");
    }
    for (name, _, field) in &attempts {
        let policy = wait_condition(&b, name, "Stalled", "True", "KeyNotAllowed");
        let message = ready_message(&policy);
        assert!(message.contains(field) && message.contains(&format!("{{{b}}}:*")), "{name}: {message}");
        assert_eq!(condition(&policy, "Ready"), Some(("False".into(), "KeyNotAllowed".into())));
    }
    let (ok, out) = kubectl_apply(
        &b,
        "apiVersion: pelican.io/v1alpha1\nkind: DeadLetterRedrive\nmetadata:\n  name: steal\nspec:\n  policyRef:\n    \
         name: drain\n",
    );
    assert!(ok, "{out}");
    wait_for("the redrive of A's dead letters to be refused", Duration::from_secs(30), || {
        let redrive: Value =
            serde_json::from_str(&kubectl_ok(&["get", "dlr", "steal", "-n", &b, "-o", "json"])).unwrap();
        let reasons: Vec<&str> = redrive["status"]["conditions"]
            .as_array()
            .map(|c| c.iter().filter_map(|c| c["reason"].as_str()).collect())
            .unwrap_or_default();
        match redrive["status"]["phase"].as_str() {
            Some("Pending") if reasons.contains(&"KeyNotAllowed") => Ok(()),
            _ => Err(redrive["status"].to_string()),
        }
    });
    // A redrive of B's own dead letters into A's stream: Failed, nothing added there.
    assert!(kubectl_apply(&b, &p("jobs", &b_own, "b-workers2", &format!("{b_own}:dlq"), "")).0);
    wait_condition(&b, "jobs", "Ready", "True", "Reconciled");
    let _: String = redis::cmd("XADD").arg(format!("{b_own}:dlq")).arg("*").arg("n").arg(1).query(&mut conn).unwrap();
    let (ok, out) = kubectl_apply(
        &b,
        &format!(
            "apiVersion: pelican.io/v1alpha1\nkind: DeadLetterRedrive\nmetadata:\n  name: push\nspec:\n  policyRef:\n    \
             name: jobs\n  target: \"{a_stream}\"\n"
        ),
    );
    assert!(ok, "{out}");
    let failed = wait_for("the redrive into A's stream to fail", Duration::from_secs(30), || {
        let redrive: Value =
            serde_json::from_str(&kubectl_ok(&["get", "dlr", "push", "-n", &b, "-o", "json"])).unwrap();
        match redrive["status"]["phase"].as_str() {
            Some("Failed") => Ok(redrive),
            _ => Err(redrive["status"].to_string()),
        }
    });
    assert!(failed["status"].to_string().contains("KeyNotAllowed"), "{}", failed["status"]);
    assert_eq!(xrange(&mut conn, &format!("{b_own}:dlq")).len(), 1, "B's dead letter stays");

    // The destroy attempt's policy deleted: its finalizer goes without touching the server.
    kubectl_ok(&["delete", "cgp", "destroy", "-n", &b, "--timeout=30s"]);
    // Several passes' worth of time for anything that would have run.
    std::thread::sleep(Duration::from_secs(4));
    assert_eq!(keys_of(&mut conn, &a_stream, &a_dlq), before, "team A's keys changed");
    let loot: i64 = redis::cmd("EXISTS").arg(format!("{{{b}}}:loot")).query(&mut conn).unwrap();
    assert_eq!(loot, 0, "nothing was dead-lettered into B's stream");
    println!(
        "{flavor:?}: 4 attempts KeyNotAllowed, 1 redrive Pending and 1 Failed (KeyNotAllowed); A's keys: {before:?}"
    );

    // The server's status: Ready with its version, and how many policies name it.
    let status = wait_for("the server's status to count its 5 policies", Duration::from_secs(60), || {
        let rs: Value =
            serde_json::from_str(&kubectl_ok(&["get", "redisservers", "shared", "-n", &platform, "-o", "json"]))
                .unwrap();
        match rs["status"]["policies"].as_i64() {
            Some(5) => Ok(rs["status"].clone()),
            _ => Err(rs["status"].to_string()),
        }
    });
    assert!(status["serverVersion"].as_str().is_some_and(|v| !v.is_empty()), "{status}");
    let table = kubectl_ok(&["get", "redisservers", "-n", &platform]);
    let rows = table_rows(&table);
    assert_eq!(rows[0]["URL"], server.url(), "{table}");
    assert_eq!(
        (rows[0]["MODE"].as_str(), rows[0]["READY"].as_str(), rows[0]["POLICIES"].as_str()),
        ("Standalone", "True", "5")
    );
    println!("kubectl get redisservers:\n{table}");
}

#[test]
fn two_teams_on_one_server_cannot_reach_each_others_keys_redis() {
    two_teams_cannot_reach_each_others_keys(Flavor::Redis);
}

#[test]
fn two_teams_on_one_server_cannot_reach_each_others_keys_valkey() {
    two_teams_cannot_reach_each_others_keys(Flavor::Valkey);
}

#[test]
fn a_namespace_the_server_does_not_admit_is_refused_and_deny_mode_refuses_inline_policies() {
    let server = Server::start_with(Flavor::Redis, &["--requirepass", "platform-pw"]);
    let (platform, team, other) = (namespace("platform"), namespace("admitted"), namespace("stranger"));
    let label = team.clone();
    let _operator = operator(&label, &["--inline-connections=deny"]);
    let tenants = format!("  tenants:\n  - namespaces: [{team}]\n    keys: [\"*\"]\n");
    assert!(kubectl_apply(&platform, &server_manifest(&label, &server.url(), "platform-pw", &tenants)).0);
    let manifest = tenant_policy("p", &label, &platform, "s", "g", "s:dlq", "");
    assert!(kubectl_apply(&other, &manifest).0);
    let refused = wait_condition(&other, "p", "Stalled", "True", "ServerNotAllowed");
    assert!(ready_message(&refused).contains(&format!("does not admit namespace \"{other}\"")), "{refused}");
    // In the admitted namespace the same policy is Ready: the refused one, though older, owns nothing (were it the
    // owner, a namespace could block another's group with a policy it may not use).
    assert!(kubectl_apply(&team, &manifest).0);
    wait_condition(&team, "p", "Ready", "True", "Reconciled");

    // An inline policy under --inline-connections=deny: Stalled, and no group on the server.
    let inline = policy("inline", &server.url(), "inline-stream", "g", "")
        .replace("  name: inline\n", &format!("  name: inline\n  labels: {{pelican-test: {label}}}\n"));
    assert!(kubectl_apply(&team, &inline).0);
    let denied = wait_condition(&team, "inline", "Stalled", "True", "InlineConnectionDenied");
    assert!(ready_message(&denied).contains("spec.redis.serverRef"), "{denied}");
    let mut conn = server.conn();
    let exists: i64 = redis::cmd("EXISTS").arg("inline-stream").query(&mut conn).unwrap();
    assert_eq!(exists, 0, "nothing written for an inline policy in deny mode");

    // Admission: serverRef and an inline URL together are refused, naming both.
    let both = manifest.replace("    serverRef:", &format!("    url: {}\n    serverRef:", server.url()));
    let (ok, out) = kubectl_apply(&team, &both.replace("name: p\n", "name: both\n"));
    assert!(!ok && out.contains("spec.redis.serverRef and the inline connection"), "{out}");
    let neither = manifest
        .replace(&format!("    serverRef: {{name: shared, namespace: {platform}}}\n"), "")
        .replace("  redis:\n", "  redis: {}\n");
    let (ok, out) = kubectl_apply(&team, &neither.replace("name: p\n", "name: neither\n"));
    assert!(!ok && out.contains("spec.redis needs serverRef"), "{out}");
}

/// One Secret for every policy on a server: the password rotated on the server breaks them all (their connections
/// killed), and the new one written once into the server's Secret heals them all without touching any policy.
#[test]
fn a_password_rotated_in_the_servers_secret_reaches_every_policy() {
    let count: usize = std::env::var("PELICAN_ROTATION_POLICIES").ok().and_then(|n| n.parse().ok()).unwrap_or(1000);
    let server = Server::start_with(Flavor::Redis, &["--requirepass", "old-pw"]);
    let (platform, team) = (namespace("platform"), namespace("rotation"));
    let label = team.clone();
    let _operator = operator(&label, &[]);
    let tenants = format!("  tenants:\n  - namespaces: [{team}]\n    keys: [\"*\"]\n");
    assert!(kubectl_apply(&platform, &server_manifest(&label, &server.url(), "old-pw", &tenants)).0);
    let manifests: Vec<String> = (0..count)
        .map(|i| {
            tenant_policy(
                &format!("p{i}"),
                &label,
                &platform,
                &format!("{{s{i}}}:in"),
                "g",
                &format!("{{s{i}}}:dlq"),
                "",
            )
            .replace("interval: 1s", "interval: 30s")
        })
        .collect();
    let start = Instant::now();
    for chunk in manifests.chunks(250) {
        let (ok, out) = kubectl_apply(&team, &chunk.join("---\n"));
        assert!(ok, "{out}");
    }
    wait_all_ready(&team, count, Duration::from_secs(600));
    println!("{count} policies on one RedisServer Ready in {:.1}s", start.elapsed().as_secs_f64());

    let mut admin = server.conn();
    let _: () = redis::cmd("CONFIG").arg("SET").arg("requirepass").arg("new-pw").query(&mut admin).unwrap();
    let _: i64 =
        redis::cmd("CLIENT").arg("KILL").arg("TYPE").arg("normal").arg("SKIPME").arg("yes").query(&mut admin).unwrap();
    // Each policy finds out at its next look (interval 30s): all Stalled AuthenticationFailed.
    wait_for("every policy to see the old password refused", Duration::from_secs(180), || {
        let path = "jsonpath={.items[*].status.conditions[?(@.type==\"Ready\")].reason}";
        let reasons = kubectl_ok(&["get", "cgp", "-n", &team, "-o", path]);
        let failed = reasons.split_whitespace().filter(|r| *r == "AuthenticationFailed").count();
        if failed == count { Ok(()) } else { Err(format!("{failed} of {count}")) }
    });
    let generations = kubectl_ok(&["get", "cgp", "-n", &team, "-o", "jsonpath={.items[*].metadata.generation}"]);
    let start = Instant::now();
    kubectl_ok(&["patch", "secret", "shared-auth", "-n", &platform, "-p", r#"{"stringData":{"password":"new-pw"}}"#]);
    wait_all_ready(&team, count, Duration::from_secs(300));
    let healed = start.elapsed();
    println!("password rotated in the server's Secret: {count} policies Ready again in {:.1}s", healed.as_secs_f64());
    let after = kubectl_ok(&["get", "cgp", "-n", &team, "-o", "jsonpath={.items[*].metadata.generation}"]);
    assert_eq!(generations, after, "no policy was touched");
    assert!(after.split_whitespace().all(|g| g == "1"));
    // A thousand policies whose server is about to stop would keep every operator watching all namespaces later in
    // the same bed (the chart's, in tests/node.rs) busy failing to reach it.
    kubectl_ok(&["delete", "namespace", &team, &platform, "--wait=false"]);
}

/// `examples/tenancy/`: the platform's server and two teams, applied as a user would (the namespaces and the
/// server's address filled in), each team's policy Ready and the server counting both.
#[test]
fn the_tenancy_example_gets_ready() {
    let server = Server::start_with(Flavor::Valkey, &["--requirepass", "change-me"]);
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/tenancy");
    let (platform, billing, shipping) = (namespace("platform"), namespace("billing"), namespace("shipping"));
    let label = billing.clone();
    let _operator = operator(&label, &[]);
    let fill = |file: &str| {
        let text = std::fs::read_to_string(format!("{dir}/{file}")).unwrap();
        // Namespaces exist already (random names, so that runs do not collide); the rest is applied as written.
        let text: Vec<&str> = text.split("\n---\n").filter(|doc| !doc.contains("kind: Namespace")).collect();
        text.join("\n---\n")
            .replace("redis.platform.svc:6379", &format!("127.0.0.1:{}", server.port))
            .replace("namespace: platform", &format!("namespace: {platform}"))
            .replace("billing", &billing)
            .replace("shipping", &shipping)
            .replace("  namespace: ", "  labels: {pelican-test: LABEL}\n  namespace: ")
            .replace("LABEL", &label)
    };
    // The operator's user as examples/acl/pelican-shared.acl writes it, for these two teams; its commands are
    // pelican.acl's.
    let acl = |file: &str| {
        let text = std::fs::read_to_string(format!("{}/examples/acl/{file}", env!("CARGO_MANIFEST_DIR"))).unwrap();
        text.lines().find(|l| l.starts_with("user ")).unwrap().to_string()
    };
    let (shared, single) = (acl("pelican-shared.acl"), acl("pelican.acl"));
    let commands = |line: &str| line[line.find("resetchannels").unwrap()..].to_string();
    assert_eq!(commands(&shared), commands(&single), "pelican-shared.acl grants what pelican.acl grants");
    let rules =
        shared.replace("{billing}", &format!("{{{billing}}}")).replace("{shipping}", &format!("{{{shipping}}}"));
    let mut conn = server.conn();
    let mut setuser = redis::cmd("ACL");
    setuser.arg("SETUSER").arg("pelican");
    for rule in rules.split_whitespace().skip(2) {
        setuser.arg(rule.replace(">CHANGE-ME", ">change-me"));
    }
    let _: () = setuser.query(&mut conn).unwrap();
    for file in ["platform.yaml", "billing.yaml", "shipping.yaml"] {
        let out = kubectl(&["apply", "-f", "-"], Some(&fill(file)));
        assert!(out.status.success(), "{file}: {}", String::from_utf8_lossy(&out.stderr));
    }
    wait_condition(&billing, "invoices", "Ready", "True", "Reconciled");
    wait_condition(&shipping, "parcels", "Ready", "True", "Reconciled");
    assert_eq!(group_names(&mut conn, &format!("{{{billing}}}:invoices")), vec!["invoicer".to_string()]);
    wait_for("the server to count both policies", Duration::from_secs(60), || {
        let policies =
            kubectl_ok(&["get", "redisservers", "shared-redis", "-n", &platform, "-o", "jsonpath={.status.policies}"]);
        if policies == "2" { Ok(()) } else { Err(policies) }
    });
}

/// `kubectl pelican` as a team member who may read policies and the server object but not the server's Secrets:
/// `status` works from the Kubernetes status; `dlq`, which reads the server, says which permission is missing.
#[test]
fn kubectl_pelican_says_which_permission_a_team_lacks_for_the_servers_secrets() {
    let server = Server::start_with(Flavor::Valkey, &["--requirepass", "platform-pw"]);
    let (platform, team) = (namespace("platform"), namespace("team"));
    let label = team.clone();
    let _operator = operator(&label, &[]);
    let tenants = format!("  tenants:\n  - namespaces: [{team}]\n    keys: [\"*\"]\n");
    assert!(kubectl_apply(&platform, &server_manifest(&label, &server.url(), "platform-pw", &tenants)).0);
    assert!(kubectl_apply(&team, &tenant_policy("orders", &label, &platform, "orders", "g", "orders:dlq", "")).0);
    wait_condition(&team, "orders", "Ready", "True", "Reconciled");

    // A ServiceAccount of the team: policies in its namespace, the server object in the platform's, no Secrets.
    let rbac = format!(
        "apiVersion: v1\nkind: ServiceAccount\nmetadata:\n  name: dev\n  namespace: {team}\n---\n\
         apiVersion: rbac.authorization.k8s.io/v1\nkind: Role\nmetadata:\n  name: policies\n  namespace: {team}\n\
         rules:\n- apiGroups: [pelican.io]\n  resources: [consumergrouppolicies, deadletterredrives]\n  verbs: [get, list]\n---\n\
         apiVersion: rbac.authorization.k8s.io/v1\nkind: RoleBinding\nmetadata:\n  name: dev\n  namespace: {team}\n\
         roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: Role, name: policies}}\n\
         subjects: [{{kind: ServiceAccount, name: dev, namespace: {team}}}]\n---\n\
         apiVersion: rbac.authorization.k8s.io/v1\nkind: Role\nmetadata:\n  name: servers\n  namespace: {platform}\n\
         rules:\n- apiGroups: [pelican.io]\n  resources: [redisservers]\n  verbs: [get]\n---\n\
         apiVersion: rbac.authorization.k8s.io/v1\nkind: RoleBinding\nmetadata:\n  name: dev\n  namespace: {platform}\n\
         roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: Role, name: servers}}\n\
         subjects: [{{kind: ServiceAccount, name: dev, namespace: {team}}}]\n"
    );
    let out = kubectl(&["apply", "-f", "-"], Some(&rbac));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let token = kubectl_ok(&["create", "token", "dev", "-n", &team]);
    let admin = std::fs::read_to_string(bed().kubeconfig()).unwrap();
    let admin_token = admin.lines().find_map(|l| l.trim().strip_prefix("token: ")).unwrap().to_string();
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("dev.kubeconfig");
    std::fs::write(&kubeconfig, admin.replace(&admin_token, token.trim())).unwrap();

    let plugin = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_kubectl-pelican"))
            .args(args)
            .env("KUBECONFIG", &kubeconfig)
            .output()
            .unwrap();
        (
            out.status.success(),
            format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)),
        )
    };
    let (ok, status) = plugin(&["status", "-n", &team]);
    assert!(ok && status.contains("orders"), "{status}");
    let (ok, dlq) = plugin(&["dlq", "orders", "-n", &team]);
    assert!(!ok, "{dlq}");
    assert!(
        dlq.contains(&format!("get` on secrets in namespace {platform}")) && dlq.contains("kubectl pelican status"),
        "{dlq}"
    );
    assert!(!dlq.contains("platform-pw"), "{dlq}");
    println!("$ kubectl pelican dlq orders (as {team}:dev)\n{dlq}");
}

/// Defect: key patterns were matched with the `glob` crate while the API documents Redis ACL semantics (`[^_]` was
/// no negation, `\` no escape, `**` refused). The matcher now agrees with a real server's `ACL DRYRUN` on every pair
/// of this table, on Redis and on Valkey.
#[test]
fn key_patterns_match_as_the_servers_acl_does() {
    let patterns = [
        "team-a:[^_]*",
        "team-a:*",
        r"a\*b",
        "**",
        "a**b",
        "[a-c]x",
        "[c-a]x",
        r"[\]]",
        "[abc",
        "[^abc",
        "?x",
        "a?",
        r"\",
        r"x\",
        "[a-]",
        "[]a]",
        "*:orders",
        "{team}:*",
        "team*",
        "team-*",
        "[!a]*",
        r"a[\-]b",
        "*a*b*c*",
        "[",
        "[^]",
        r"[\",
        "*?*",
        "a[b-]",
        "*[xyz]",
    ];
    let keys = [
        "team-a:_internal",
        "team-a:orders",
        "a*b",
        "axb",
        "ab",
        "bx",
        "]",
        "a",
        "c",
        "d",
        "xx",
        r"\",
        r"x\",
        "-",
        "a-",
        "team-b:orders",
        "{team}:x",
        "!x",
        "a-b",
        "aXbYc",
        "team-a:",
        "[",
        "^",
        "cx",
        "dx",
        "abc",
        "a]",
        "zz",
        "ax",
    ];
    for flavor in [Flavor::Redis, Flavor::Valkey] {
        let server = Server::start(flavor);
        let mut conn = server.conn();
        let mut disagree = Vec::new();
        for pattern in patterns {
            let _: () = redis::cmd("ACL")
                .arg("SETUSER")
                .arg("tenant")
                .arg("reset")
                .arg("on")
                .arg("nopass")
                .arg(format!("~{pattern}"))
                .arg("+@all")
                .query(&mut conn)
                .unwrap();
            for key in keys {
                let reply: String =
                    redis::cmd("ACL").arg("DRYRUN").arg("tenant").arg("GET").arg(key).query(&mut conn).unwrap();
                let server_admits = reply == "OK";
                if server_admits != pelican::tenancy::key_matches(pattern.as_bytes(), key.as_bytes()) {
                    disagree.push(format!("{pattern:?} {key:?}: the server says {reply:?}"));
                }
            }
        }
        assert!(
            disagree.is_empty(),
            "{flavor:?}: {} of {} pairs differ:\n{}",
            disagree.len(),
            patterns.len() * keys.len(),
            disagree.join("\n")
        );
    }
}

/// Defect: Pelican's own keys escaped the patterns. A tenant admitted to `a.*` could name stream `a.{team-b}`, whose
/// counters, bounds and errors keys are `{team-b}:pelican:...`, team-b's key space. Such a policy is Stalled
/// `KeyNotAllowed` naming the key, and nothing of it reaches Redis.
#[test]
fn a_stream_whose_hash_tag_is_another_teams_is_refused_for_pelicans_own_keys() {
    let server = Server::start(Flavor::Redis);
    let (platform, team) = (namespace("platform"), namespace("tagged"));
    let label = team.clone();
    let _operator = operator(&label, &[]);
    assert!(kubectl_apply(&platform, &open_server_manifest(&label, &server.url(), &team, "a.*")).0);
    let stolen = tenant_policy("stolen", &label, &platform, "a.{team-b}", "g", "a.{team-b}:dlq", "");
    assert!(kubectl_apply(&team, &stolen).0);
    let refused = wait_condition(&team, "stolen", "Stalled", "True", "KeyNotAllowed");
    let message = ready_message(&refused);
    assert!(
        message.contains("{team-b}:pelican:a.{team-b}:g:totals") && message.contains("hash tag {team-b}"),
        "{message}"
    );
    let fine = tenant_policy("fine", &label, &platform, "a.orders", "g", "a.orders.dlq", "");
    assert!(kubectl_apply(&team, &fine).0);
    wait_condition(&team, "fine", "Ready", "True", "Reconciled");
    let mut conn = server.conn();
    let exists: i64 = redis::cmd("EXISTS").arg("a.{team-b}").query(&mut conn).unwrap();
    assert_eq!(exists, 0, "nothing written for the refused policy");
}

/// A topic on a shared server (SPEC 22): the server must admit each partition `{t:<i>}` and Pelican's keys in its
/// slot, the topic's own keys and the dead-letter stream. Admitted `{t}:*` (the topic's own keys) but no partition,
/// it is refused naming partition 0; once the server admits `{t*` it is Ready, the group on every partition.
#[test]
fn a_topic_on_a_shared_server_needs_every_partition_admitted() {
    let server = Server::start(Flavor::Redis);
    let (platform, team) = (namespace("platform"), namespace("topics"));
    let label = team.clone();
    let _operator = operator(&label, &[]);
    let admitting = |keys: &str| {
        let tenants = format!("  tenants:\n  - namespaces: [{team}]\n    keys: [{keys}, \"t:dlq\"]\n");
        server_manifest(&label, &server.url(), "", &tenants)
            .replace("  passwordSecretRef: {name: shared-auth, key: password}\n", "")
    };
    assert!(kubectl_apply(&platform, &admitting("\"{t}:*\"")).0);
    let topic = tenant_policy("topic", &label, &platform, "t", "g", "t:dlq", "  partitions: 4\n");
    assert!(kubectl_apply(&team, &topic).0);
    let refused = wait_condition(&team, "topic", "Stalled", "True", "KeyNotAllowed");
    let message = ready_message(&refused);
    assert!(message.contains("spec.stream (partition 0)") && message.contains("{t:0}"), "{message}");
    let mut conn = server.conn();
    let exists: i64 = redis::cmd("EXISTS").arg("{t:0}").arg("{t}:pelican:t:topic").query(&mut conn).unwrap();
    assert_eq!(exists, 0, "nothing written for the refused topic");

    assert!(kubectl_apply(&platform, &admitting("\"{t*\"")).0);
    wait_condition(&team, "topic", "Ready", "True", "Reconciled");
    for i in 0..4 {
        assert_eq!(group_names(&mut conn, &pelican::keys::partition_stream("t", i)), ["g"], "partition {i}");
    }
}

/// Defect: a `RedisServer` change stalled the namespace's policies, but a running `DeadLetterRedrive` kept moving
/// with the keys admitted when it started. Revoked mid-redrive (`ratePerSecond: 1`), it ends `Failed`
/// `ServerNotAllowed` within seconds and moves nothing more.
#[test]
fn revoking_the_namespace_ends_its_running_redrive() {
    let server = Server::start(Flavor::Redis);
    let (platform, team) = (namespace("platform"), namespace("revoked"));
    let label = team.clone();
    let _operator = operator(&label, &[]);
    let admit = |who: &str| assert!(kubectl_apply(&platform, &open_server_manifest(&label, &server.url(), who, "*")).0);
    admit(&team);
    assert!(kubectl_apply(&team, &tenant_policy("p", &label, &platform, "s", "g", "s:dlq", "")).0);
    wait_condition(&team, "p", "Ready", "True", "Reconciled");
    let mut conn = server.conn();
    for n in 0..100 {
        let _: String = redis::cmd("XADD")
            .arg("s:dlq")
            .arg("*")
            .arg("n")
            .arg(n)
            .arg("pelican-source-stream")
            .arg("s")
            .arg("pelican-reason")
            .arg("MaxDeliveriesExceeded")
            .query(&mut conn)
            .unwrap();
    }
    let redrive = "apiVersion: pelican.io/v1alpha1\nkind: DeadLetterRedrive\nmetadata:\n  name: r\nspec:\n  policyRef:\n    \
                   name: p\n  ratePerSecond: 1\n";
    assert!(kubectl_apply(&team, redrive).0);
    let redrive_status = || -> Value {
        serde_json::from_str::<Value>(&kubectl_ok(&["get", "dlr", "r", "-n", &team, "-o", "json"])).unwrap()["status"]
            .clone()
    };
    wait_for("the redrive to move", Duration::from_secs(30), || {
        let status = redrive_status();
        if status["moved"].as_i64().unwrap_or(0) >= 2 { Ok(()) } else { Err(status.to_string()) }
    });

    admit("somebody-else");
    let revoked_at = Instant::now();
    let status = wait_for("the redrive to fail", Duration::from_secs(20), || {
        let status = redrive_status();
        if status["phase"] == "Failed" { Ok(status) } else { Err(status.to_string()) }
    });
    println!("redrive Failed {:?} after the revocation", revoked_at.elapsed());
    let failed = status["conditions"].as_array().unwrap().iter().find(|c| c["type"] == "Failed").unwrap().clone();
    assert_eq!(failed["reason"], "ServerNotAllowed", "{status}");
    let moved = |conn: &mut redis::Connection| redis::cmd("XLEN").arg("s").query::<i64>(conn).unwrap();
    let at_failure = moved(&mut conn);
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(moved(&mut conn), at_failure, "entries moved after the redrive failed");
    assert!(at_failure < 20, "{at_failure} moved at 1 per second: the redrive went on after the revocation");
}

/// A `RedisServer`'s conditions in the kstatus shape, as a policy's: `Stalled` when only a person can fix it (its
/// Secret missing), `Reconciling` while it is retried (nothing listening), `Ready` when it answers; and a Warning
/// Event `InsecureSkipVerify` on the server when its spec turns certificate checks off.
#[test]
fn a_servers_conditions_say_whether_a_person_must_act_and_insecure_tls_warns() {
    let tls = Server::start_tls(Flavor::Redis, "server", false);
    let platform = namespace("server-conditions");
    let label = platform.clone();
    let operator = operator(&label, &[]);
    let server = |name: &str, url: &str, extra: &str| {
        format!(
            "apiVersion: pelican.io/v1alpha1\nkind: RedisServer\nmetadata:\n  name: {name}\n  labels: {{pelican-test: \
             {label}}}\nspec:\n  url: {url}\n{extra}"
        )
    };
    let manifests = [
        server("no-secret", "redis://127.0.0.1:1/0", "  passwordSecretRef: {name: missing, key: password}\n"),
        server("nobody-home", &format!("redis://127.0.0.1:{}/0", free_port()), ""),
        server("insecure", &tls.tls_url(), "  tls:\n    insecureSkipVerify: true\n"),
    ];
    assert!(kubectl_apply(&platform, &manifests.join("---\n")).0);
    let conditions = |name: &str| {
        let rs: Value =
            serde_json::from_str(&kubectl_ok(&["get", "redisservers", name, "-n", &platform, "-o", "json"])).unwrap();
        let mut said: Vec<(String, String, String)> = rs["status"]["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|c| {
                let field = |f: &str| c[f].as_str().unwrap_or_default().to_string();
                (field("type"), field("status"), field("reason"))
            })
            .collect();
        said.sort();
        said
    };
    let expect = |name: &str, ready: &str, reconciling: &str, stalled: &str, reason: &str| {
        let want: Vec<(String, String, String)> =
            [("Ready", ready), ("Reconciling", reconciling), ("Stalled", stalled)]
                .iter()
                .map(|(t, s)| (t.to_string(), s.to_string(), reason.to_string()))
                .collect();
        wait_for(&format!("{name}'s conditions"), Duration::from_secs(60), || {
            let said = conditions(name);
            if said == want { Ok(()) } else { Err(format!("{said:?}")) }
        });
        println!("{name}: Ready {ready}, Reconciling {reconciling}, Stalled {stalled}, reason {reason}");
    };
    expect("no-secret", "False", "False", "True", "SecretNotFound");
    expect("nobody-home", "False", "True", "False", "RedisUnavailable");
    expect("insecure", "True", "False", "False", "Reconciled");
    // On /metrics, for the alert PelicanRedisServerNotReady: one series per server, from its Ready condition.
    for (name, ready) in [("no-secret", 0), ("nobody-home", 0), ("insecure", 1)] {
        let line = format!("pelican_redis_server_ready{{namespace=\"{platform}\",server=\"{name}\"}} {ready}");
        wait_for(&line, Duration::from_secs(10), || {
            let metrics = operator.metrics();
            if metrics.contains(&line) { Ok(()) } else { Err(metrics) }
        });
    }
    let warning = wait_for("an InsecureSkipVerify event on the server", Duration::from_secs(10), || {
        events(&platform, "InsecureSkipVerify").into_iter().next().ok_or_else(|| "none".to_string())
    });
    assert_eq!(warning["type"], "Warning");
    assert_eq!(warning["involvedObject"]["kind"], "RedisServer", "{warning}");
    assert_eq!(warning["involvedObject"]["name"], "insecure", "{warning}");
    let stalled = events(&platform, "SecretNotFound");
    assert!(
        stalled.iter().any(|e| e["involvedObject"]["name"] == "no-secret" && e["type"] == "Warning"),
        "{stalled:?}"
    );
}
