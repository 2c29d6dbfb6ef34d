//! `keel upgrade`: a new Kubernetes version and a new image reach a running
//! cluster.
//!
//! `keel upgrade apply` runs the phases that apply, in order, on every
//! control plane named, and prints each node's progress; `--skip-phases`
//! leaves phases out. Every phase that runs checks its input before
//! anything is sent. `keel upgrade finish` ends an image rollout.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::bail;
use clap::{Args, Subcommand, ValueEnum};

pub mod image;
pub mod kubernetes;

/// The `keel upgrade` commands.
#[derive(Debug, Subcommand)]
pub enum UpgradeCommand {
    /// Upgrade the cluster. Kubernetes phase: every node named moves to
    /// the new version (control planes first, one at a time, then workers;
    /// a node that fails switches back to its previous binaries). Image
    /// phase: the new image's signed measurements become a second set every
    /// control plane's join service accepts, so nodes of the old and the
    /// new image both join until `keel upgrade finish`.
    Apply(ApplyArgs),
    /// End an image rollout on every control plane named: the staged
    /// measurements, if they are the file named, become the only ones
    /// accepted; nodes of the old image no longer join.
    Finish(FinishArgs),
}

/// The cluster an upgrade command talks to.
#[derive(Debug, Args)]
pub struct Cluster {
    /// Settings file (JSON); measurements and EK CA validate the control
    /// planes, `measurements_signing_key` checks new image measurements.
    #[arg(long, default_value = "keel.json")]
    pub settings: PathBuf,
    /// The workspace `keel init` wrote (master secret, cluster ID).
    #[arg(long, default_value = ".")]
    pub workspace: PathBuf,
    /// A node's init port (host:port); repeat for each. The image phase
    /// and `finish` use the control planes; the Kubernetes phase every
    /// node, the first control plane named running `kubeadm upgrade apply`.
    #[arg(long = "endpoint", required = true)]
    pub endpoints: Vec<String>,
    /// Seconds to keep trying while a node is not reachable.
    #[arg(long, default_value_t = 60, value_name = "SECONDS")]
    pub wait: u64,
}

impl Cluster {
    /// How long to keep trying an unreachable node.
    pub fn wait(&self) -> Duration {
        Duration::from_secs(self.wait)
    }
}

/// `keel upgrade finish`.
#[derive(Debug, Args)]
pub struct FinishArgs {
    /// The cluster.
    #[command(flatten)]
    pub cluster: Cluster,
    /// The new image's measurements file, as given to `keel upgrade apply`:
    /// a control plane where another set is staged refuses, and keeps it.
    #[arg(long, value_name = "FILE")]
    pub image_measurements: PathBuf,
    /// Its detached signature (DER ECDSA P-256; default: FILE.sig).
    #[arg(long, value_name = "FILE")]
    pub image_measurements_signature: Option<PathBuf>,
}

/// `keel upgrade apply`.
#[derive(Debug, Args)]
pub struct ApplyArgs {
    /// The cluster.
    #[command(flatten)]
    pub cluster: Cluster,
    /// The new image's measurements file (`keel-measure --signing-key`).
    #[arg(long, value_name = "FILE")]
    pub image_measurements: Option<PathBuf>,
    /// Its detached signature (DER ECDSA P-256; default: FILE.sig).
    #[arg(long, value_name = "FILE", requires = "image_measurements")]
    pub image_measurements_signature: Option<PathBuf>,
    /// The Kubernetes version to upgrade to (`vX.Y` or its pinned
    /// `vX.Y.Z`): the next minor version at most, never an older one.
    #[arg(long, value_name = "VERSION")]
    pub kubernetes: Option<String>,
    /// The components of that version (JSON list of {url, hash,
    /// install_path, extract}); default: the versions table's.
    #[arg(long, value_name = "FILE", requires = "kubernetes")]
    pub components: Option<PathBuf>,
    /// Phases to leave out (comma-separated or repeated), even when their
    /// input is given; a phase whose input is not given does not run.
    #[arg(long, value_enum, value_delimiter = ',')]
    pub skip_phases: Vec<Phase>,
}

/// A phase of `keel upgrade apply`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Phase {
    /// The Kubernetes version.
    Kubernetes,
    /// The node image (its measurements).
    Image,
}

/// Runs `keel upgrade`.
pub async fn run(command: UpgradeCommand) -> anyhow::Result<()> {
    match command {
        UpgradeCommand::Apply(mut args) => {
            args.cluster.endpoints = crate::operator::distinct(&args.cluster.endpoints);
            apply(args).await
        }
        UpgradeCommand::Finish(mut args) => {
            args.cluster.endpoints = crate::operator::distinct(&args.cluster.endpoints);
            let image = image::SignedMeasurements::load(
                &args.cluster.settings,
                &args.image_measurements,
                args.image_measurements_signature.as_deref(),
            )?;
            image::finish(&args.cluster, &image).await
        }
    }
}

async fn apply(args: ApplyArgs) -> anyhow::Result<()> {
    // A phase runs when its input is given and it is not skipped. Every
    // phase's input is checked before any node is contacted.
    let runs = |phase| !args.skip_phases.contains(&phase);
    let kubernetes = match &args.kubernetes {
        Some(version) if runs(Phase::Kubernetes) => Some(kubernetes::Target::new(
            version,
            args.components.as_deref(),
        )?),
        _ => None,
    };
    let image = match &args.image_measurements {
        Some(file) if runs(Phase::Image) => Some(image::SignedMeasurements::load(
            &args.cluster.settings,
            file,
            args.image_measurements_signature.as_deref(),
        )?),
        _ => None,
    };
    if image.is_none() && kubernetes.is_none() {
        bail!(
            "nothing to do: give --kubernetes <VERSION> and/or --image-measurements FILE \
             (a phase named in --skip-phases does not run)"
        );
    }
    // The image first: nodes that reboot into the new image during the
    // Kubernetes phase can join again.
    if let Some(image) = &image {
        image::stage(&args.cluster, image).await?;
    }
    if let Some(target) = &kubernetes {
        kubernetes::run(&args.cluster, target).await?;
    }
    Ok(())
}
