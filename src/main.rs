use clap::{Parser, Subcommand};
use kube::CustomResourceExt;
use pelican::api::ConsumerGroupPolicy;
use pelican::telemetry::{LogFormat, init_logging};

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
        Command::Run { namespace, log_format } => {
            init_logging(log_format);
            let client = kube::Client::try_default().await?;
            let instance = std::env::var("POD_NAME").ok().or_else(|| std::env::var("HOSTNAME").ok());
            let settings = pelican::controller::Settings { namespace, instance };
            tracing::info!(version = env!("CARGO_PKG_VERSION"), "starting pelican");
            pelican::controller::run(client, settings, shutdown_signal()).await;
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
