//! The command line for people: `kubectl pelican status | dlq | redrive | seek`, also `pelican status
//! | dlq | redrive | seek`. It works from the user's kubeconfig and reads the policy's Secrets with the user's own
//! permissions, so it can do exactly what the user could do with `kubectl` and `redis-cli`.

mod dlq;
mod redrive;
mod seek;
mod status;

use std::io::Write;

use clap::{Args, Subcommand, ValueEnum};
use kube::api::Api;
use kube::{Client, ResourceExt};
use serde::Serialize;

use crate::api::ConsumerGroupPolicy;
use crate::redis::{Conn, Pools, Target};

/// Where to look and how to print; shared by every command.
#[derive(Args, Clone, Debug)]
pub struct Scope {
    /// Namespace of the policies (default: the kubeconfig context's).
    #[arg(short, long)]
    pub namespace: Option<String>,
    /// `table` (default), `json` or `yaml`.
    #[arg(short, long, value_enum, default_value_t = Output::Table)]
    pub output: Output,
    /// Reach the policy's Redis at this address instead of the one its spec names (which often resolves only inside
    /// the cluster), e.g. a `kubectl port-forward svc/redis 6379` running beside: `--redis-address 127.0.0.1:6379`.
    /// The policy's Secrets and TLS settings still apply; for a Sentinel policy, give the primary's address. Not for
    /// a Redis Cluster (it redirects to each node's own address).
    #[arg(long, value_name = "HOST:PORT", value_parser = parse_address)]
    pub redis_address: Option<String>,
}

/// `host:port`, `[v6]:port`.
fn parse_address(address: &str) -> Result<String, String> {
    let (host, port) = address.rsplit_once(':').ok_or("expected HOST:PORT, e.g. 127.0.0.1:6379")?;
    if host.is_empty() || host.contains('/') || host.contains('@') {
        return Err(format!("{host:?} is not a host name or address (expected HOST:PORT, e.g. 127.0.0.1:6379)"));
    }
    port.parse::<u16>().map_err(|_| format!("{port:?} is not a port (expected HOST:PORT, e.g. 127.0.0.1:6379)"))?;
    Ok(address.to_string())
}

/// `url` with its host and port replaced by `address`, its scheme, user and database kept.
fn with_address(url: &str, address: &str) -> String {
    let (scheme, rest) = url.split_once("://").unwrap_or(("redis", url));
    let (authority, path) = rest.find('/').map_or((rest, ""), |slash| rest.split_at(slash));
    let user = authority.rsplit_once('@').map_or(String::new(), |(user, _)| format!("{user}@"));
    format!("{scheme}://{user}{address}{path}")
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Output {
    Table,
    Json,
    Yaml,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// The numbers and conditions of one policy or all, with the oldest pending entries.
    Status(status::StatusArgs),
    /// The dead letters of a policy, grouped by reason and source, with a payload preview.
    Dlq(dlq::DlqArgs),
    /// Create a DeadLetterRedrive for a policy and follow its progress.
    Redrive(redrive::RedriveArgs),
    /// Create a GroupSeek for a policy (replay from a time or an id, or skip forward) and print what it did.
    Seek(seek::SeekArgs),
}

/// Runs one command; the error is printed by the caller.
pub async fn run(command: Command) -> anyhow::Result<()> {
    let scope = match &command {
        Command::Status(args) => args.scope.clone(),
        Command::Dlq(args) => args.scope.clone(),
        Command::Redrive(args) => args.scope.clone(),
        Command::Seek(args) => args.scope.clone(),
    };
    let config = kube::Config::infer().await?;
    let namespace = scope.namespace.clone().unwrap_or_else(|| config.default_namespace.clone());
    let client = Client::try_from(config)?;
    let session = Session { client, namespace, scope, pools: Pools::default() };
    match command {
        Command::Status(args) => status::run(&session, args).await,
        Command::Dlq(args) => dlq::run(&session, args).await,
        Command::Redrive(args) => redrive::run(&session, args).await,
        Command::Seek(args) => seek::run(&session, args).await,
    }
}

struct Session {
    client: Client,
    namespace: String,
    scope: Scope,
    pools: Pools,
}

impl Session {
    fn policies(&self) -> Api<ConsumerGroupPolicy> {
        Api::namespaced(self.client.clone(), &self.namespace)
    }

    async fn policy(&self, name: &str) -> anyhow::Result<ConsumerGroupPolicy> {
        self.policies().get_opt(name).await?.ok_or_else(|| {
            anyhow::anyhow!(
                "ConsumerGroupPolicy {name:?} not found in namespace {:?} (kubectl get cgp -n {0} lists them)",
                self.namespace
            )
        })
    }

    /// A connection to the policy's server with its own Secrets (read with the user's permissions).
    async fn connect(&self, policy: &ConsumerGroupPolicy) -> anyhow::Result<(Conn, String)> {
        let target = crate::context::read_target(policy, &self.client).await?;
        let target = match &self.scope.redis_address {
            None => self.pools.resolve(&target).await?,
            Some(_) if target.cluster => anyhow::bail!(
                "--redis-address cannot reach a Redis Cluster: it redirects each key to its node's own address; run \
                 the command where the nodes' addresses resolve (e.g. `kubectl run` a pod in the cluster)"
            ),
            Some(address) => Target { url: with_address(&target.url, address), sentinel: None, ..target },
        };
        let conn = self.pools.get(&target).await?;
        Ok((conn, target.server()))
    }

    /// Prints `value` as JSON or YAML when asked for, and says whether it did.
    fn print_structured(&self, value: &impl Serialize) -> anyhow::Result<bool> {
        let text = match self.scope.output {
            Output::Table => return Ok(false),
            Output::Json => serde_json::to_string_pretty(value)? + "\n",
            Output::Yaml => serde_yaml::to_string(value)?,
        };
        std::io::stdout().write_all(text.as_bytes())?;
        Ok(true)
    }
}

/// Aligned columns, as kubectl prints them.
fn print_table(header: &[&str], rows: &[Vec<String>]) -> anyhow::Result<()> {
    render_table(std::io::stdout(), header, rows)
}

/// The table, every cell with its control characters escaped: what a worker, a producer or a stream's name put in a
/// cell (an error text, a reason, a source stream) can neither break the table's columns (a tab, a newline) nor send
/// the terminal escape sequences (ESC) that would rewrite what the operator of the cluster sees.
fn render_table(out: impl std::io::Write, header: &[&str], rows: &[Vec<String>]) -> anyhow::Result<()> {
    let mut table = tabwriter::TabWriter::new(out).padding(3);
    writeln!(table, "{}", header.join("\t"))?;
    for row in rows {
        let cells: Vec<String> = row.iter().map(|cell| escape_controls(cell)).collect();
        writeln!(table, "{}", cells.join("\t"))?;
    }
    table.flush()?;
    Ok(())
}

/// `text` with its control characters escaped (`\n`, `\t`, `\u{1b}`).
fn escape_controls(text: &str) -> String {
    text.chars().flat_map(|c| if c.is_control() { c.escape_default().collect::<Vec<_>>() } else { vec![c] }).collect()
}

/// `45s`, `12m`, `3h`, `5d`: the short ages kubectl shows.
fn age(seconds: i64) -> String {
    let s = seconds.max(0);
    match s {
        0..120 => format!("{s}s"),
        120..7_200 => format!("{}m", s / 60),
        7_200..172_800 => format!("{}h", s / 3_600),
        _ => format!("{}d", s / 86_400),
    }
}

fn now_millis() -> i64 {
    k8s_openapi::jiff::Timestamp::now().as_millisecond()
}

/// A table cell: `-` for nothing; control characters escaped, since some cells hold what workers wrote (a dead
/// letter's reason, its source stream) and a terminal would obey an escape sequence in them.
fn cell(value: Option<impl ToString>) -> String {
    value.map_or_else(|| "-".to_string(), |v| escape_controls(&v.to_string()))
}

fn name_of(policy: &ConsumerGroupPolicy) -> String {
    policy.name_any()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ages_read_like_kubectl() {
        assert_eq!(age(-3), "0s");
        assert_eq!(age(119), "119s");
        assert_eq!(age(120), "2m");
        assert_eq!(age(7_199), "119m");
        assert_eq!(age(7_200), "2h");
        assert_eq!(age(200_000), "2d");
    }

    #[test]
    fn a_cell_can_neither_break_the_table_nor_reach_the_terminal() {
        let rows = vec![vec!["1-0".to_string(), "Gone\x1b[2J\x1b[31mFAKE".to_string(), "a\tb\nc".to_string()]];
        let mut out = Vec::new();
        render_table(&mut out, &["ID", "REASON", "SOURCE"], &rows).unwrap();
        let out = String::from_utf8(out).unwrap();
        assert!(!out.contains('\x1b'), "{out:?}");
        assert_eq!(out.lines().count(), 2, "{out:?}");
        assert!(out.contains("Gone\\u{1b}[2J\\u{1b}[31mFAKE"), "{out:?}");
        assert!(out.contains("a\\tb\\nc"), "{out:?}");
    }

    #[test]
    fn an_address_replaces_host_and_port_only() {
        assert_eq!(with_address("redis://redis.apps.svc:6379/2", "127.0.0.1:7000"), "redis://127.0.0.1:7000/2");
        assert_eq!(with_address("rediss://app@redis.apps.svc:6380", "[::1]:7000"), "rediss://app@[::1]:7000");
        assert_eq!(with_address("redis://redis:6379/", "localhost:1"), "redis://localhost:1/");
        assert!(parse_address("127.0.0.1:6379").is_ok());
        assert!(parse_address("[::1]:6379").is_ok());
        assert!(parse_address("127.0.0.1").unwrap_err().contains("HOST:PORT"));
        assert!(parse_address("redis://x:6379").unwrap_err().contains("not a host"));
        assert!(parse_address("x:port").unwrap_err().contains("not a port"));
    }
}
