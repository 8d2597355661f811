//! `kubectl pelican ...`: kubectl runs any `kubectl-<name>` on the PATH as `kubectl <name>`. The commands are
//! those of `pelican status | dlq | redrive | seek`.

use clap::Parser;

/// Pelican for people: the health of consumer groups, their dead letters, redrives and seeks.
#[derive(Parser)]
#[command(name = "kubectl pelican")]
struct Plugin {
    #[command(subcommand)]
    command: pelican::cli::Command,
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let plugin = Plugin::parse();
    match pelican::cli::run(plugin.command).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
