//! keel: the operator CLI. A thin composition root over the library.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};

mod init;
mod logging;
mod settings;
mod verify;

/// Operate keel clusters: initialise the first node over attested TLS, verify
/// a node's attestation.
///
/// Secrets never go on the command line: the init secret is read from the
/// file the settings name, and the generated master secret is written to a
/// file with mode 0600 before anything is sent.
#[derive(Parser)]
#[command(name = "keel", version, about, long_about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Create a cluster on its first node: verify the node's attestation,
    /// send it the (TPM-sealed) master secret, stream its progress, and write
    /// the admin kubeconfig.
    Init {
        /// Settings file (JSON): endpoint, Kubernetes version, measurements, EK CA, init secret file.
        #[arg(long, default_value = "keel.json")]
        settings: PathBuf,
        /// Directory for the master secret, kubeconfig, cluster ID and failure logs.
        #[arg(long, default_value = ".")]
        workspace: PathBuf,
        /// Do not wait for the Helm deployments after kubeadm (accepted for
        /// compatibility; keel installs no Helm charts yet).
        #[arg(long)]
        skip_helm_wait: bool,
        /// Seconds to keep trying while the node is not reachable yet (it
        /// may still be booting). A refused attestation is never retried.
        #[arg(long, default_value_t = 300, value_name = "SECONDS")]
        wait: u64,
    },
    /// Verify a node's attestation against the measurements and print what it attests.
    Verify {
        /// Settings file (JSON); only endpoint, measurements and EK CA are used.
        #[arg(long, default_value = "keel.json")]
        settings: PathBuf,
        /// Node to verify (host:port), instead of the settings' endpoint.
        #[arg(long)]
        endpoint: Option<String>,
        /// `json`: one JSON document naming every PCR that differs; exit
        /// status 0 only if the node verified.
        #[arg(short, long, value_enum, default_value_t = verify::Output::Text)]
        output: verify::Output,
    },
}

fn main() -> ExitCode {
    crate::logging::init(tracing::Level::WARN);
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("keel: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        match cli.command {
            Command::Init {
                settings,
                workspace,
                skip_helm_wait,
                wait,
            } => {
                init::run(
                    &settings,
                    &workspace,
                    skip_helm_wait,
                    Duration::from_secs(wait),
                )
                .await
            }
            Command::Verify {
                settings,
                endpoint,
                output,
            } => verify::run(&settings, endpoint, output).await,
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("keel: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
