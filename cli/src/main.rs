//! keel: the operator CLI. A thin composition root over the library.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};

mod collateral;
mod files;
mod init;
mod kubeconfig;
mod logging;
mod operator;
mod printable;
mod push;
mod reach;
mod recover;
mod registry;
mod revoke;
mod settings;
mod status;
mod upgrade;
mod verify;
mod workspace;

/// Operate keel clusters: initialise the first node over attested TLS, verify
/// a node's attestation, recover a control plane, roll out measurements,
/// revoke a node, show the nodes' attestation verdicts and fetch the admin
/// kubeconfig again.
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

/// How the operator's requests reach the control planes.
#[derive(clap::Args)]
struct OperatorArgs {
    /// Settings file (JSON); measurements and EK CA validate the nodes.
    #[arg(long, default_value = "keel.json")]
    settings: PathBuf,
    /// The workspace `keel init` wrote (master secret, cluster ID).
    #[arg(long, default_value = ".")]
    workspace: PathBuf,
    /// A control plane's init port (host:port); repeat for each.
    #[arg(long = "endpoint", required = true)]
    endpoints: Vec<String>,
    /// Seconds to keep trying while a node is not reachable.
    #[arg(long, default_value_t = 60, value_name = "SECONDS", value_parser = crate::seconds())]
    wait: u64,
}

/// The longest wait or timeout an option takes: a week, in seconds.
const MAX_SECONDS: u64 = 7 * 24 * 3600;

/// Parses a number of seconds for a wait or a timeout, at most
/// [`MAX_SECONDS`] (a larger one would overflow the clock's deadline).
fn seconds() -> clap::builder::RangedU64ValueParser<u64> {
    clap::value_parser!(u64).range(..=MAX_SECONDS)
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
        #[arg(long, default_value_t = 300, value_name = "SECONDS", value_parser = crate::seconds())]
        wait: u64,
        /// Seconds the init request may take on the node, from sending it
        /// to its result (component downloads, kubeadm). Past it the CLI
        /// stops waiting; the node may still finish, and its console shows
        /// where it stands.
        #[arg(long, default_value_t = 3600, value_name = "SECONDS", value_parser = crate::seconds())]
        timeout: u64,
    },
    /// Make a new init secret: 32 random bytes (as 64 hex digits) written
    /// to FILE with mode 0600, never over an existing file. Prints the value
    /// for the node config's `cluster.init_secret_hash` (an argon2id hash
    /// with a fresh salt); name FILE as `init_secret_file` in the settings
    /// of `keel init`.
    InitSecret {
        /// Where to write the secret.
        #[arg(value_name = "FILE")]
        out: PathBuf,
    },
    /// Fill the CPU collateral cache (SEV-SNP VCEKs, ASK and ASVK chains
    /// and their revocation lists; TDX collateral) from
    /// AMD's KDS or Intel's PCS, once, for the evidence of a node: the
    /// only network access keel makes for CPU evidence.
    Collateral {
        #[command(subcommand)]
        command: collateral::CollateralCommand,
    },
    /// Verify a node's attestation against the measurements and print what it attests.
    Verify {
        /// Settings file (JSON); only endpoint, measurements, EK CA, attestation and
        /// collateral are used.
        #[arg(long, default_value = "keel.json")]
        settings: PathBuf,
        /// Node to verify (host:port), instead of the settings' endpoint.
        #[arg(long)]
        endpoint: Option<String>,
        /// `json`: one JSON document naming every PCR that differs; exit
        /// status 0 only if the node verified.
        #[arg(short, long, value_enum, default_value_t = verify::Output::Text)]
        output: verify::Output,
        /// The node must be locked into exactly this cluster (hex cluster
        /// ID): one cluster-ID event naming it, PCR 15 its extend.
        #[arg(long, value_name = "ID")]
        cluster_id: Option<String>,
        /// Seconds to keep trying while the node is not reachable yet (it
        /// may still be booting or bringing its network up). A refused
        /// attestation is never retried.
        #[arg(long, default_value_t = 60, value_name = "SECONDS", value_parser = crate::seconds())]
        wait: u64,
    },
    /// Put nodes on every named control plane's revocation list: no join
    /// ticket, no rejoin ticket, no disk key for their EKs and disks. A
    /// running node keeps the key it has until it reboots. Name every
    /// control plane with --endpoint (control planes being revoked need
    /// not be): each node is looked up in all their registries and revoked
    /// by its EK; a name or disk that means two nodes revokes nothing.
    Revoke {
        /// The node: its name, its disk UUID, or its EK hash (`sha256:` and
        /// hex, the hex alone, or its first 8 or more hex digits, as
        /// `keel status` shows them). Several are revoked together: a
        /// compromised control plane with the control-plane records it made
        /// up, none of which answers, say.
        #[arg(required = true, num_args = 1..)]
        nodes: Vec<String>,
        #[command(flatten)]
        to: OperatorArgs,
    },
    /// Each named control plane's view of the nodes: verdict of their
    /// continuous attestation, time of the last evidence, reason, and the
    /// revocation list.
    Status {
        #[command(flatten)]
        to: OperatorArgs,
        /// `json`: one document with each control plane's registry.
        #[arg(short, long, value_enum, default_value_t = verify::Output::Text)]
        output: verify::Output,
    },
    /// Fetch the cluster's admin kubeconfig again from a control plane and
    /// write it to the workspace's keel-admin.conf (mode 0600).
    ///
    /// Use it when `keel init` lost its result after the node finished (the
    /// connection broke, or --timeout passed: the workspace then holds the
    /// master secret and keel-id.json but no kubeconfig), or when the
    /// workspace lost its copy. The control planes named are asked in turn,
    /// each attested as a member of the workspace's cluster; the first that
    /// answers sends its own admin kubeconfig. A control plane that has not
    /// finished its init (or join, or recovery) refuses: ask again once its
    /// console says `serving as a control plane`. A keel-admin.conf already
    /// in the workspace is kept unless --force.
    Kubeconfig {
        #[command(flatten)]
        to: OperatorArgs,
        /// Replace a keel-admin.conf the workspace holds (by default one
        /// there is kept and nothing is fetched).
        #[arg(long)]
        force: bool,
    },
    /// Replace the measurements every join service accepts: for each
    /// control plane named, verify it is a member of the workspace's cluster,
    /// then send the file with a proof made from the master secret (which
    /// itself never leaves this machine). Name every control plane.
    PushMeasurements {
        /// Settings file (JSON); measurements and EK CA validate the nodes.
        #[arg(long, default_value = "keel.json")]
        settings: PathBuf,
        /// The workspace `keel init` wrote (master secret, cluster ID).
        #[arg(long, default_value = ".")]
        workspace: PathBuf,
        /// The new measurements file.
        #[arg(long)]
        file: PathBuf,
        /// Its detached signature by the measurements signing key (DER
        /// ECDSA P-256; default: FILE.sig). Required when the settings name
        /// a measurements_signing_key.
        #[arg(long, value_name = "FILE")]
        signature: Option<PathBuf>,
        /// A control plane's init port (host:port); repeat for each.
        #[arg(long = "endpoint", required = true)]
        endpoints: Vec<String>,
        /// Seconds to keep trying while a node is not reachable.
        #[arg(long, default_value_t = 60, value_name = "SECONDS", value_parser = crate::seconds())]
        wait: u64,
    },
    /// Upgrade a running cluster: `apply` moves every node named to another
    /// Kubernetes version and stages a new image's signed measurements on
    /// every control plane; `finish` ends the image rollout.
    Upgrade {
        #[command(subcommand)]
        command: upgrade::UpgradeCommand,
    },
    /// Bring back a control plane when no join service answers (every
    /// control plane was down): verify the node's attestation (it must be
    /// outside any cluster, PCR 15 zero), seal the master secret from the
    /// workspace and the init secret (the settings' init_secret_file) to
    /// its TPM and send them. The node checks the init secret against its
    /// measured config, opens its own state disk, locks to the cluster ID
    /// stored there and serves joins again; the other nodes then rejoin
    /// through it.
    Recover {
        /// Settings file (JSON); endpoint, measurements, EK CA, init secret
        /// file, attestation and collateral are used.
        #[arg(long, default_value = "keel.json")]
        settings: PathBuf,
        /// The node's init port (host:port), instead of the settings' endpoint.
        #[arg(long)]
        endpoint: Option<String>,
        /// The workspace `keel init` wrote (it holds the master secret).
        #[arg(long, default_value = ".")]
        workspace: PathBuf,
        /// `json`: one JSON document with the endpoint and the cluster ID.
        #[arg(short, long, value_enum, default_value_t = verify::Output::Text)]
        output: verify::Output,
        /// Seconds to keep trying while the node is not reachable yet.
        #[arg(long, default_value_t = 300, value_name = "SECONDS", value_parser = crate::seconds())]
        wait: u64,
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
                timeout,
            } => {
                init::run(
                    &settings,
                    &workspace,
                    skip_helm_wait,
                    Duration::from_secs(wait),
                    Duration::from_secs(timeout.max(1)),
                )
                .await
            }
            Command::Verify {
                settings,
                endpoint,
                output,
                cluster_id,
                wait,
            } => {
                verify::run(
                    &settings,
                    endpoint,
                    output,
                    cluster_id.as_deref(),
                    Duration::from_secs(wait),
                )
                .await
            }
            Command::Revoke { nodes, to } => {
                revoke::run(
                    &to.settings,
                    &to.workspace,
                    &nodes,
                    &operator::distinct(&to.endpoints),
                    Duration::from_secs(to.wait),
                )
                .await
            }
            Command::Status { to, output } => {
                status::run(
                    &to.settings,
                    &to.workspace,
                    &operator::distinct(&to.endpoints),
                    output,
                    Duration::from_secs(to.wait),
                )
                .await
            }
            Command::Kubeconfig { to, force } => {
                kubeconfig::run(
                    &to.settings,
                    &to.workspace,
                    &operator::distinct(&to.endpoints),
                    force,
                    Duration::from_secs(to.wait),
                )
                .await
            }
            Command::PushMeasurements {
                settings,
                workspace,
                file,
                signature,
                endpoints,
                wait,
            } => {
                push::run(
                    &settings,
                    &workspace,
                    &file,
                    signature.as_deref(),
                    &operator::distinct(&endpoints),
                    Duration::from_secs(wait),
                )
                .await
            }
            Command::Upgrade { command } => upgrade::run(command).await,
            Command::Collateral { command } => collateral::run(command).await,
            Command::InitSecret { out } => {
                let hash = init::new_init_secret(&out)?;
                eprintln!(
                    "init secret written to {} (mode 0600); its hash for the node config's \
                     cluster.init_secret_hash:",
                    out.display()
                );
                println!("{hash}");
                Ok(())
            }
            Command::Recover {
                settings,
                endpoint,
                workspace,
                output,
                wait,
            } => {
                recover::run(
                    &settings,
                    endpoint,
                    &workspace,
                    output,
                    Duration::from_secs(wait),
                )
                .await
            }
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("keel: error: {}", printable::error_chain(&e));
            ExitCode::FAILURE
        }
    }
}
