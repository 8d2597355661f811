use std::net::SocketAddr;
use std::sync::Arc;

use clap::{Parser, Subcommand};
use futures::FutureExt;
use kube::CustomResourceExt;
use pelican::api::ConsumerGroupPolicy;
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
        #[arg(long, value_enum, default_value_t = LogFormat::Json, env = "PELICAN_LOG_FORMAT")]
        log_format: LogFormat,
        /// Where `/metrics` is served.
        #[arg(long, default_value = "0.0.0.0:8080", env = "PELICAN_METRICS_ADDR")]
        metrics_addr: SocketAddr,
        /// Where `/healthz` and `/readyz` are served.
        #[arg(long, default_value = "0.0.0.0:8081", env = "PELICAN_HEALTH_ADDR")]
        health_addr: SocketAddr,
    },
    /// Print the ConsumerGroupPolicy CustomResourceDefinition as YAML.
    Crd,
    /// Print the version.
    Version,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Crd => print!("{}", serde_yaml::to_string(&ConsumerGroupPolicy::crd())?),
        Command::Version => println!("pelican {}", env!("CARGO_PKG_VERSION")),
        Command::Run { namespace, log_format, metrics_addr, health_addr } => {
            init_logging(log_format);
            let client = kube::Client::try_default().await?;
            let instance = std::env::var("POD_NAME").ok().or_else(|| std::env::var("HOSTNAME").ok());
            let (metrics, readiness) = (Arc::new(Metrics::default()), Readiness::default());
            // One shutdown signal for the controller and the HTTP endpoints.
            let shutdown = shutdown_signal().shared();
            let http = serve(metrics_addr, health_addr, metrics.clone(), readiness.clone(), shutdown.clone()).await?;
            let http = tokio::spawn(http);
            let settings = pelican::controller::Settings { namespace, instance, metrics, readiness };
            tracing::info!(version = env!("CARGO_PKG_VERSION"), %metrics_addr, %health_addr, "starting pelican");
            pelican::controller::run(client, settings, shutdown).await;
            http.await?;
            tracing::info!("stopped");
        }
    }
    Ok(())
}

/// Resolves on SIGTERM or Ctrl-C.
async fn shutdown_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).expect("SIGTERM handler");
    tokio::select! {
        _ = term.recv() => {},
        _ = tokio::signal::ctrl_c() => {},
    }
}
