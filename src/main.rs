use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use clap::{Parser, Subcommand};
use futures::FutureExt;
use kube::CustomResourceExt;
use pelican::api::{ConsumerGroupPolicy, DeadLetterRedrive, GroupSeek, RedisServer};
use pelican::context::{InlineConnections, Shared, Writers};
use pelican::leader::{Elector, Holder, LEASE_DURATION_SECONDS};
use pelican::telemetry::{LogFormat, Metrics, MetricsDetail, Readiness, init_logging, serve};
use tonic::transport::ServerTlsConfig;

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
        /// How much of each policy `/metrics` shows: `full` (every series per policy) or `essential` (per policy only
        /// the series the chart's alerts and dashboard read; the rest per namespace), for many policies.
        #[arg(long, value_enum, default_value_t = MetricsDetail::Full, env = "PELICAN_METRICS_DETAIL")]
        metrics_detail: MetricsDetail,
        /// Serve `/metrics` over TLS with the certificate of this directory (`tls.crt`, `tls.key`: a
        /// `kubernetes.io/tls` Secret mounted), read again when its files change (a renewal).
        #[arg(long, env = "PELICAN_METRICS_TLS_DIR")]
        metrics_tls_dir: Option<std::path::PathBuf>,
        /// Serve `/metrics` only to callers whose bearer token the API server authenticates (TokenReview) and allows
        /// `get` on the non-resource URL `/metrics` (SubjectAccessReview): 401 and 403 otherwise.
        #[arg(long, env = "PELICAN_METRICS_AUTH")]
        metrics_auth: bool,
        /// Where `/healthz` and `/readyz` are served.
        #[arg(long, default_value = "0.0.0.0:8081", env = "PELICAN_HEALTH_ADDR")]
        health_addr: SocketAddr,
        /// Stand by while another replica holds the leader Lease, and take over when it goes (for more than one
        /// replica). Without it the Lease is taken all the same, and a start that finds it held by a live process
        /// exits with an error: two copies never reconcile the same policies.
        #[arg(long, env = "PELICAN_LEADER_ELECT")]
        leader_elect: bool,
        /// Namespace of the leader Lease (default: the Pod's namespace, else the watched namespace, else `default`).
        #[arg(long, env = "POD_NAMESPACE")]
        leader_election_namespace: Option<String>,
        /// Name of the leader Lease (default: `pelican-leader`, and for a shard `pelican-leader-<hash of its
        /// --watch-label-selector>`).
        #[arg(long, env = "PELICAN_LEADER_ELECTION_LEASE")]
        leader_election_lease: Option<String>,
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
        /// Serve the external scaler with mutual TLS: a directory with `tls.crt`, `tls.key` and `ca.crt` (a
        /// `kubernetes.io/tls` Secret with a CA, mounted); only clients with a certificate of that CA are answered
        /// (KEDA: the trigger's `caCert`, `tlsClientCert`, `tlsClientKey`).
        #[arg(long, requires = "external_scaler_addr", env = "PELICAN_EXTERNAL_SCALER_TLS_DIR")]
        external_scaler_tls_dir: Option<std::path::PathBuf>,
        /// This install's name on the Redis servers, where it claims each group whose jobs it runs: another install
        /// on the same server (in another cluster, say) finds the claim and stands by (AnotherInstallRuns). Default:
        /// `<the cluster's kube-system namespace UID>/<the leader Lease's namespace>`, which the shards of one install
        /// share. Give a rebuilt or restored cluster's install the old name to take its groups back at once.
        #[arg(long, env = "PELICAN_INSTALL_ID")]
        install_id: Option<String>,
        /// Claim no group: run no pass and write nothing on the servers, only report each policy (Ready False,
        /// Passive, naming the install that runs it): the standby of a DR pair or a blue/green switch.
        #[arg(long, env = "PELICAN_PASSIVE")]
        passive: bool,
        /// Throttle the drain of a backlog (after an outage, on a Redis other applications share): a pass that ended
        /// before the end of its PEL keeps its server's pass permit this long before the next pass may have it, so
        /// passes take at most 100 ms / (100 ms + pause) of each of the server's two permits, e.g. `400ms` for a
        /// fifth. 0 (default): the next pass follows at once.
        #[arg(long, default_value = "0s", value_parser = humantime::parse_duration, env = "PELICAN_DRAIN_PAUSE")]
        drain_pause: std::time::Duration,
        /// How many policies are reconciled at once (0: no bound).
        #[arg(long, default_value_t = 32, env = "PELICAN_MAX_CONCURRENT_RECONCILES")]
        max_concurrent_reconciles: u16,
    },
    /// Run the operator's jobs for ConsumerGroupPolicy files on a Redis, without Kubernetes (a worker developer's
    /// machine): the files are checked as `kubectl apply` checks them, the group and the worker settings are
    /// written, and the reclaim / dead-letter / retention passes run every `spec.reclaim.interval` until Ctrl-C,
    /// printing a line for each pass that moved something and each group's health now and then.
    Local {
        /// A policy file (YAML, several documents allowed) or a directory of them; repeat for more.
        #[arg(short = 'f', long = "filename", required = true)]
        files: Vec<std::path::PathBuf>,
        /// The server for every policy instead of each spec's `redis.url` (and the only way to run a policy that
        /// names a RedisServer): `redis://[user:password@]host:port[/db]`, or `rediss://` for TLS.
        #[arg(long, env = "PELICAN_REDIS_URL")]
        redis_url: Option<String>,
        /// The username, when the URL carries none. The password, when the URL carries none, is read from the
        /// environment variable PELICAN_REDIS_PASSWORD only: a flag would show it to `ps`.
        #[arg(long, env = "PELICAN_REDIS_USERNAME")]
        redis_username: Option<String>,
        #[arg(skip = std::env::var("PELICAN_REDIS_PASSWORD").ok())]
        redis_password: Option<String>,
        /// How often each group's health (pending, oldest pending, lag, dead letters) is printed, e.g. `30s`.
        #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
        status_every: Duration,
    },
    /// Print the CustomResourceDefinitions as YAML: all, or the one named (`consumergrouppolicies`,
    /// `deadletterredrives`, `groupseeks`, `redisservers`).
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
            let crds = [ConsumerGroupPolicy::crd(), DeadLetterRedrive::crd(), GroupSeek::crd(), RedisServer::crd()];
            let chosen: Vec<_> = crds
                .iter()
                .filter(|crd| name.as_deref().is_none_or(|n| crd.spec.names.plural == n))
                .map(serde_yaml::to_string)
                .collect::<Result<_, _>>()?;
            if chosen.is_empty() {
                anyhow::bail!(
                    "no CustomResourceDefinition named {name:?}: use consumergrouppolicies, deadletterredrives, groupseeks or \
                     redisservers"
                );
            }
            print!("{}", chosen.join("---\n"));
        }
        Command::Version => println!("pelican {}", env!("CARGO_PKG_VERSION")),
        Command::Local { files, redis_url, redis_username, redis_password, status_every } => {
            // What the passes did is printed (stdout); only warnings, job failures say, are logged (stderr).
            let filter = tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
            tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).init();
            let credentials = pelican::redis::Credentials { username: redis_username, password: redis_password };
            let options = pelican::local::Options { files, redis_url, credentials, status_every };
            // The passes' spans in the messages' traces, as `pelican run` exports them.
            let traces = pelican::telemetry::traces::from_env().map_err(|e| anyhow::anyhow!("OTLP exporter: {e}"))?;
            if let Some(provider) = traces.clone() {
                pelican::telemetry::traces::install(provider);
            }
            let ran = pelican::local::run(options, shutdown_signal()).await;
            if let Some(provider) = traces {
                let _ = tokio::task::spawn_blocking(move || provider.shutdown()).await;
            }
            ran?;
        }
        Command::Run {
            namespace,
            secret_namespaces,
            log_format,
            metrics_addr,
            metrics_detail,
            metrics_tls_dir,
            metrics_auth,
            health_addr,
            leader_elect,
            leader_election_namespace,
            leader_election_lease,
            watch_label_selector,
            inline_connections,
            external_scaler_addr,
            external_scaler_tls_dir,
            install_id,
            passive,
            drain_pause,
            max_concurrent_reconciles,
        } => {
            init_logging(log_format);
            // The passes' spans in messages' traces, when an OTLP endpoint is configured.
            let traces = pelican::telemetry::traces::from_env().map_err(|e| anyhow::anyhow!("OTLP exporter: {e}"))?;
            if let Some(provider) = traces.clone() {
                pelican::telemetry::traces::install(provider);
                tracing::info!("exporting the passes' spans over OTLP");
            }
            let scaler_tls = external_scaler_tls_dir
                .map(|dir| pelican::scaler::mutual_tls(&dir))
                .transpose()
                .map_err(|e| anyhow::anyhow!("--external-scaler-tls-dir: {e}"))?;
            let external_scaler = external_scaler_addr.map(|addr| (addr, scaler_tls));
            let client = kube::Client::try_default().await?;
            let instance = std::env::var("POD_NAME").ok().or_else(|| std::env::var("HOSTNAME").ok());
            let (metrics, readiness) = (Arc::new(Metrics::default()), Readiness::default());
            metrics.set_detail(metrics_detail);
            let health = readiness.clone();
            // One shutdown signal for the controller, the HTTP endpoints and the election.
            let shutdown = shutdown_signal().shared();
            let secure = pelican::telemetry::Secure {
                tls: metrics_tls_dir
                    .map(|dir| pelican::telemetry::secure::CertificateDir::load(&dir))
                    .transpose()
                    .map_err(|e| anyhow::anyhow!("--metrics-tls-dir: {e}"))?,
                auth: metrics_auth.then(|| pelican::telemetry::secure::Authorizer::new(client.clone())),
            };
            let http = serve(metrics_addr, health_addr, metrics.clone(), readiness.clone(), secure, shutdown.clone());
            let http = http.await?;
            let http = tokio::spawn(http);
            tracing::info!(version = env!("CARGO_PKG_VERSION"), %metrics_addr, %health_addr, leader_elect, "starting pelican");
            if external_scaler.is_some() {
                // A restarted leader's Pod keeps its labels: KEDA must not be sent here before this replica leads.
                pelican::scaler::label_pod(&client, false).await;
            }
            let lease_namespace =
                leader_election_namespace.or_else(|| namespace.clone()).unwrap_or_else(|| "default".into());
            let lease_name = leader_election_lease
                .unwrap_or_else(|| pelican::leader::default_lease_name(watch_label_selector.as_deref()));
            let identity = pelican::leader::identity(instance.as_deref());
            let lease = format!("{lease_namespace}/{lease_name}");
            let claimant = pelican::controller::Claimant {
                id: match install_id {
                    Some(id) => id,
                    None => format!("{}/{lease_namespace}", pelican::leader::cluster_id(&client).await),
                },
                passive,
            };
            let settings = pelican::controller::Settings {
                namespace,
                readiness: readiness.clone(),
                label_selector: watch_label_selector,
                concurrency: max_concurrent_reconciles,
                secret_namespaces: (!secret_namespaces.is_empty()).then(|| secret_namespaces.into_iter().collect()),
                install: lease.clone(),
                claimant,
                drain_pause,
            };
            let holder = pelican::leader::live_holder(&client, &lease_namespace, &lease_name, &identity).await;
            let holder = holder.map_err(|e| anyhow::anyhow!("could not read the leader Lease {lease}: {e}"))?;
            if let (false, Some(holder)) = (leader_elect, holder) {
                anyhow::bail!("{}", already_running(&lease, &holder));
            }
            let mut elector = Elector::start(client.clone(), &lease_namespace, &lease_name, &identity).await?;
            metrics.watch_leadership(&lease_name, elector.leadership());
            if leader_elect {
                // A standby is ready: readiness says the process works, not that it leads.
                readiness.set_ready();
            }
            tracing::info!(%lease, identity, "waiting for the leader lease");
            // Without election, a start that does not get the Lease within its duration lost it to another copy
            // started at the same moment.
            let patience = Duration::from_secs(if leader_elect { u64::MAX / 4 } else { 2 * LEASE_DURATION_SECONDS });
            tokio::select! {
                _ = shutdown.clone() => {
                    elector.release().await;
                    http.await?;
                    return Ok(());
                }
                acquired = tokio::time::timeout(patience, elector.acquired()) => match acquired {
                    Ok(Ok(())) => {}
                    Ok(Err(_)) => anyhow::bail!("the leader election task died before this replica led"),
                    Err(_) => {
                        let holder = pelican::leader::live_holder(&client, &lease_namespace, &lease_name, &identity).await;
                        let holder = holder.ok().flatten().unwrap_or(Holder { identity: "another process".into(), renewed_ago: Duration::ZERO });
                        anyhow::bail!("{}", already_running(&lease, &holder));
                    }
                }
            }
            let secrets = settings.secret_namespaces.clone();
            let shared = Shared::new(client, instance, metrics, elector.leadership(), secrets, inline_connections);
            let ended = elector.ended();
            tokio::select! {
                () = run_controllers(shared, settings, external_scaler, shutdown.clone()) => {}
                why = ended => {
                    // Another replica may be writing already: exit now, without waiting for the controllers to
                    // finish what is in flight (with the API server away, a status write waits for it), and let
                    // the Pod restart as a standby. `/healthz` fails from here on, should the exit itself stall.
                    health.set_ended();
                    tracing::error!(?why, "leadership ended; exiting");
                    std::process::exit(1);
                }
            }
            elector.release().await;
            http.await?;
            if let Some(provider) = traces {
                // The spans still queued go out before the process ends (bounded by the exporter's timeout).
                let _ = tokio::task::spawn_blocking(move || provider.shutdown()).await;
            }
            tracing::info!("stopped");
        }
    }
    Ok(())
}

/// Why a second copy does not start, and what to do instead.
fn already_running(lease: &str, holder: &Holder) -> String {
    format!(
        "another Pelican ({}) holds the leader Lease {lease}, renewed {}s ago: it reconciles the policies this one \
         would, and two copies would write status and Events twice and run every pass twice. Stop the other copy, or \
         run every replica with --leader-elect (the chart's leaderElection.enabled) so that one leads and the others \
         stand by; a shard needs its own --watch-label-selector (and Lease)",
        holder.identity,
        holder.renewed_ago.as_secs()
    )
}

/// The policy, redrive, seek and server controllers side by side, on the same shared handles, and KEDA's external
/// scaler when asked for, until `stop`.
async fn run_controllers(
    (shared, writers): (Arc<Shared>, Writers),
    settings: pelican::controller::Settings,
    external_scaler: Option<(SocketAddr, Option<ServerTlsConfig>)>,
    stop: impl Future<Output = ()> + Clone + Send + Sync + 'static,
) {
    let (namespace, selector) = (settings.namespace.clone(), settings.label_selector.clone());
    let claimant = settings.claimant.clone();
    let scaler = async {
        if let Some((addr, tls)) = external_scaler {
            pelican::scaler::serve(addr, tls, shared.clone(), stop.clone()).await;
        }
    };
    futures::join!(
        pelican::controller::run(shared.clone(), writers, settings, stop.clone()),
        pelican::redrive::run(shared.clone(), namespace.clone(), selector.is_some(), claimant.clone(), stop.clone()),
        pelican::seek::run(shared.clone(), namespace.clone(), selector.is_some(), claimant, stop.clone()),
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
