use std::net::SocketAddr;
use std::sync::Arc;

use clap::{Parser, Subcommand};
use futures::FutureExt;
use kube::CustomResourceExt;
use pelican::api::{ConsumerGroupPolicy, DeadLetterRedrive, RedisServer};
use pelican::context::{InlineConnections, Shared, Writers};
use pelican::leader::{Elector, Leadership};
use pelican::telemetry::{LogFormat, Metrics, Readiness, init_logging, serve};

#[derive(Parser)]
#[command(name = "pelican", about = "Kubernetes operator for Redis and Valkey Streams consumer groups")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the operator against the cluster of the current kubeconfig (or the in-cluster config).
    Run {
        /// Watch only this namespace (default: all namespaces).
        #[arg(long, env = "PELICAN_NAMESPACE")]
        namespace: Option<String>,
        /// Read Secrets only in these namespaces (comma-separated) while watching policies in all: what RBAC then
        /// grants with Roles there only. A policy elsewhere that references a Secret is Stalled, saying so.
        #[arg(long, value_delimiter = ',', conflicts_with = "namespace", env = "PELICAN_SECRET_NAMESPACES")]
        secret_namespaces: Vec<String>,
        #[arg(long, value_enum, default_value_t = LogFormat::Json, env = "PELICAN_LOG_FORMAT")]
        log_format: LogFormat,
        /// Where `/metrics` is served.
        #[arg(long, default_value = "0.0.0.0:8080", env = "PELICAN_METRICS_ADDR")]
        metrics_addr: SocketAddr,
        /// Where `/healthz` and `/readyz` are served.
        #[arg(long, default_value = "0.0.0.0:8081", env = "PELICAN_HEALTH_ADDR")]
        health_addr: SocketAddr,
        /// Run the controller only while holding the leader Lease (for more than one replica).
        #[arg(long, env = "PELICAN_LEADER_ELECT")]
        leader_elect: bool,
        /// Namespace of the leader Lease (default: the Pod's namespace, else `default`).
        #[arg(long, env = "POD_NAMESPACE")]
        leader_election_namespace: Option<String>,
        /// Name of the leader Lease.
        #[arg(long, default_value = "pelican-leader", env = "PELICAN_LEADER_ELECTION_LEASE")]
        leader_election_lease: String,
        /// Reconcile only the policies matching this label selector: one shard, e.g.
        /// `sharding.pelican.io/key=shard1`, and `!sharding.pelican.io/key` for the unlabelled rest. Give each shard
        /// its own --leader-election-lease.
        #[arg(long, env = "PELICAN_WATCH_LABEL_SELECTOR")]
        watch_label_selector: Option<String>,
        /// `deny`: policies must name a RedisServer (`spec.redis.serverRef`); one that gives its server inline is
        /// Stalled (InlineConnectionDenied) and nothing is written for it. `allow` (default): both.
        #[arg(long, value_enum, default_value_t = InlineConnections::Allow, env = "PELICAN_INLINE_CONNECTIONS")]
        inline_connections: InlineConnections,
        /// Serve KEDA's external scaler (gRPC) here, e.g. `0.0.0.0:9090`, while this replica leads: ScaledObjects
        /// scale a policy's consumers on its backlog, pending or lag. Off when not given.
        #[arg(long, env = "PELICAN_EXTERNAL_SCALER_ADDR")]
        external_scaler_addr: Option<SocketAddr>,
        /// How many policies are reconciled at once (0: no bound).
        #[arg(long, default_value_t = 32, env = "PELICAN_MAX_CONCURRENT_RECONCILES")]
        max_concurrent_reconciles: u16,
    },
    /// Print the CustomResourceDefinitions as YAML: all, or the one named (`consumergrouppolicies`,
    /// `deadletterredrives`, `redisservers`).
    Crd { name: Option<String> },
    /// Print the version.
    Version,
    /// The commands of `kubectl pelican` (status, dlq, redrive).
    #[command(flatten)]
    Cli(pelican::cli::Command),
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Cli(command) => pelican::cli::run(command).await?,
        Command::Crd { name } => {
            let crds = [ConsumerGroupPolicy::crd(), DeadLetterRedrive::crd(), RedisServer::crd()];
            let chosen: Vec<_> = crds
                .iter()
                .filter(|crd| name.as_deref().is_none_or(|n| crd.spec.names.plural == n))
                .map(serde_yaml::to_string)
                .collect::<Result<_, _>>()?;
            if chosen.is_empty() {
                anyhow::bail!(
                    "no CustomResourceDefinition named {name:?}: use consumergrouppolicies, deadletterredrives or redisservers"
                );
            }
            print!("{}", chosen.join("---\n"));
        }
        Command::Version => println!("pelican {}", env!("CARGO_PKG_VERSION")),
        Command::Run {
            namespace,
            secret_namespaces,
            log_format,
            metrics_addr,
            health_addr,
            leader_elect,
            leader_election_namespace,
            leader_election_lease,
            watch_label_selector,
            inline_connections,
            external_scaler_addr,
            max_concurrent_reconciles,
        } => {
            init_logging(log_format);
            let client = kube::Client::try_default().await?;
            let instance = std::env::var("POD_NAME").ok().or_else(|| std::env::var("HOSTNAME").ok());
            let (metrics, readiness) = (Arc::new(Metrics::default()), Readiness::default());
            // One shutdown signal for the controller, the HTTP endpoints and the election.
            let shutdown = shutdown_signal().shared();
            let http = serve(metrics_addr, health_addr, metrics.clone(), readiness.clone(), shutdown.clone()).await?;
            let http = tokio::spawn(http);
            tracing::info!(version = env!("CARGO_PKG_VERSION"), %metrics_addr, %health_addr, leader_elect, "starting pelican");
            if external_scaler_addr.is_some() {
                // A restarted leader's Pod keeps its labels: KEDA must not be sent here before this replica leads.
                pelican::scaler::label_pod(&client, false).await;
            }
            let settings = pelican::controller::Settings {
                namespace,
                readiness: readiness.clone(),
                label_selector: watch_label_selector,
                concurrency: max_concurrent_reconciles,
                secret_namespaces: (!secret_namespaces.is_empty()).then(|| secret_namespaces.into_iter().collect()),
            };
            if !leader_elect {
                metrics.watch_leadership("", Leadership::always());
                let secrets = settings.secret_namespaces.clone();
                let shared = Shared::new(client, instance, metrics, Leadership::always(), secrets, inline_connections);
                run_controllers(shared, settings, external_scaler_addr, shutdown).await;
                http.await?;
                tracing::info!("stopped");
                return Ok(());
            }

            let lease_namespace = leader_election_namespace.unwrap_or_else(|| "default".into());
            let identity = format!("{}-{}", instance.as_deref().unwrap_or("pelican"), std::process::id());
            let mut elector =
                Elector::start(client.clone(), &lease_namespace, &leader_election_lease, &identity).await?;
            metrics.watch_leadership(&leader_election_lease, elector.leadership());
            // A standby is ready: readiness says the process works, not that it leads.
            readiness.set_ready();
            tracing::info!(lease = %format!("{lease_namespace}/{leader_election_lease}"), identity, "waiting for the leader lease");
            tokio::select! {
                _ = shutdown.clone() => {
                    elector.release().await;
                    http.await?;
                    return Ok(());
                }
                acquired = elector.acquired() => if acquired.is_err() {
                    anyhow::bail!("the leader election task died before this replica led");
                }
            }
            let secrets = settings.secret_namespaces.clone();
            let shared = Shared::new(client, instance, metrics, elector.leadership(), secrets, inline_connections);
            let ended = elector.ended().shared();
            let stop = futures::future::select(shutdown.clone(), ended.clone()).map(|_| ()).shared();
            run_controllers(shared, settings, external_scaler_addr, stop).await;
            if let Some(why) = ended.peek() {
                // Another replica may be writing already: stop at once and let the Pod restart as a standby.
                tracing::error!(?why, "leadership ended; exiting");
                std::process::exit(1);
            }
            // Every receiver of the lease state must be gone for the lease task to release it.
            drop(ended);
            elector.release().await;
            http.await?;
            tracing::info!("stopped");
        }
    }
    Ok(())
}

/// The policy, redrive and server controllers side by side, on the same shared handles, and KEDA's external
/// scaler when asked for, until `stop`.
async fn run_controllers(
    (shared, writers): (Arc<Shared>, Writers),
    settings: pelican::controller::Settings,
    external_scaler: Option<SocketAddr>,
    stop: impl Future<Output = ()> + Clone + Send + Sync + 'static,
) {
    let (namespace, selector) = (settings.namespace.clone(), settings.label_selector.clone());
    let scaler = async {
        if let Some(addr) = external_scaler {
            pelican::scaler::serve(addr, shared.clone(), stop.clone()).await;
        }
    };
    futures::join!(
        pelican::controller::run(shared.clone(), writers, settings, stop.clone()),
        pelican::redrive::run(shared.clone(), namespace.clone(), selector.is_some(), stop.clone()),
        pelican::servers::run(shared.clone(), namespace, selector, stop.clone()),
        scaler,
    );
}

/// Resolves on SIGTERM or Ctrl-C.
async fn shutdown_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).expect("SIGTERM handler");
    tokio::select! {
        _ = term.recv() => {},
        _ = tokio::signal::ctrl_c() => {},
    }
}
