//! `keel upgrade`: a new Kubernetes version and a new image reach a running
//! cluster.
//!
//! `keel upgrade apply` runs the phases that apply, in order, on every
//! control plane named, and prints each node's progress; `--skip-phases`
//! leaves phases out. Every phase that runs checks its input before
//! anything is sent. `keel upgrade finish` ends an image rollout.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::bail;
use clap::{Args, Subcommand, ValueEnum};

use crate::operator::Operator;
use crate::printable::printable;
use crate::registry::Registry;
use crate::settings::Settings;

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
    #[arg(long, default_value_t = 60, value_name = "SECONDS", value_parser = crate::seconds())]
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
    /// install_path, extract}); default: the versions table's. Where the
    /// settings name a measurements_signing_key, the file must be signed
    /// with it (`keel-measure sign`), as nodes take no other components.
    #[arg(long, value_name = "FILE", requires = "kubernetes")]
    pub components: Option<PathBuf>,
    /// The components file's detached signature (DER ECDSA P-256; default:
    /// FILE.sig).
    #[arg(long, value_name = "FILE", requires = "components")]
    pub components_signature: Option<PathBuf>,
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
            let image = image::load_signed(
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
            &args.cluster.settings,
            version,
            args.components.as_deref(),
            args.components_signature.as_deref(),
        )?),
        _ => None,
    };
    let image = match &args.image_measurements {
        Some(file) if runs(Phase::Image) => Some(image::load_signed(
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
    // One operator for the whole run: an endpoint answers as the same node
    // in the check and in every phase ([`Operator::connect`]).
    let settings = Settings::load(&args.cluster.settings)?;
    let operator = Operator::new(&settings, &args.cluster.workspace, args.cluster.wait())?;
    let roles = Roles::of(&operator, &args.cluster.endpoints).await?;
    every_control_plane_named(&operator, &roles).await?;
    // The image first: nodes that reboot into the new image during the
    // Kubernetes phase can join again.
    if let Some(image) = &image {
        image::stage(&operator, &roles, image, &args.cluster.workspace).await?;
    }
    if let Some(target) = &kubernetes {
        kubernetes::run(&operator, &roles, target).await?;
    }
    Ok(())
}

/// The nodes named, by the role their attested identity gives them, in
/// the order named.
pub struct Roles {
    /// The control planes' endpoints.
    pub control_planes: Vec<String>,
    /// The workers' endpoints.
    pub workers: Vec<String>,
    /// The control planes' EKs (`sha256:` and hex).
    pub control_plane_eks: BTreeSet<String>,
}

impl Roles {
    /// Connects to each of `endpoints` once and sorts it by role.
    pub(crate) async fn of(operator: &Operator, endpoints: &[String]) -> anyhow::Result<Self> {
        let mut roles = Self {
            control_planes: Vec::new(),
            workers: Vec::new(),
            control_plane_eks: BTreeSet::new(),
        };
        for endpoint in endpoints {
            let member = operator.connect(endpoint).await?;
            if member.is_control_plane() {
                roles.control_planes.push(endpoint.clone());
                roles.control_plane_eks.insert(member.ek.to_string());
            } else {
                roles.workers.push(endpoint.clone());
            }
        }
        Ok(roles)
    }
}

/// Refuses, before any phase changes anything, while a control plane named
/// knows (by its registry) an unrevoked control plane that is not named:
/// that one would neither authorise the target's components nor stage or
/// finish the new image's measurements, and would judge the upgraded nodes
/// drifted (under the `revoke` policy, revoke them). Every named control
/// plane's registry is read: a host that keeps one of them from hearing a
/// control plane does not hide it from the others'.
pub(crate) async fn every_control_plane_named(
    operator: &Operator,
    roles: &Roles,
) -> anyhow::Result<()> {
    let registries = registries_of(operator, &roles.control_planes).await?;
    refuse_unnamed_control_planes(
        &registries,
        &roles.control_plane_eks,
        0,
        "Each must take the upgrade, or it judges the upgraded nodes drifted (and, under \
         the revoke policy, revokes them), or goes on accepting the old image",
    )
}

/// Each of `endpoints` with its registry, read in turn.
pub(crate) async fn registries_of(
    operator: &Operator,
    endpoints: &[String],
) -> anyhow::Result<Vec<(String, Registry)>> {
    let mut registries = Vec::new();
    for endpoint in endpoints {
        let registry = crate::status::registry_of(operator, endpoint).await?;
        registries.push((endpoint.clone(), registry));
    }
    Ok(registries)
}

/// Refuses while `registries` know, in all, more than `unread` unrevoked
/// control planes whose EK is not in `named` (`unread`: how many named
/// control planes could not be read, which may be any of them); `why`
/// says what one left out would miss.
pub(crate) fn refuse_unnamed_control_planes(
    registries: &[(String, Registry)],
    named: &BTreeSet<String>,
    unread: usize,
    why: &str,
) -> anyhow::Result<()> {
    let found = unnamed_control_planes(registries, named);
    let distinct: BTreeSet<&String> = found.iter().flat_map(|(_, unnamed)| unnamed).collect();
    match found.first() {
        Some((endpoint, unnamed)) if distinct.len() > unread => bail!(
            "{endpoint} knows control planes not named with --endpoint: {}. {why}: name \
             every control plane, or revoke one that is gone for good; nothing was changed",
            unnamed.join(", ")
        ),
        _ => Ok(()),
    }
}

/// For each `(endpoint, registry)` (a control plane's registry) that
/// knows any: the control planes whose EK is not in `named` and that no
/// registry has revoked (revocations are one list across the cluster; a
/// registry that has not yet merged one does not count), as `name (EK)`
/// escaped for the terminal. A revocation without an EK revokes none.
fn unnamed_control_planes(
    registries: &[(String, Registry)],
    named: &BTreeSet<String>,
) -> Vec<(String, Vec<String>)> {
    let revoked: BTreeSet<&str> = registries
        .iter()
        .flat_map(|(_, registry)| &registry.revoked)
        .map(|r| r.ek.as_str())
        .filter(|ek| !ek.is_empty())
        .collect();
    registries
        .iter()
        .map(|(endpoint, registry)| {
            let unnamed = registry
                .nodes
                .values()
                .filter(|n| n.role == "control-plane")
                .filter(|n| !revoked.contains(n.ek.as_str()) && !named.contains(&n.ek))
                .map(|n| format!("{} ({})", printable(&n.name), printable(&n.ek)))
                .collect::<Vec<_>>();
            (endpoint.clone(), unnamed)
        })
        .filter(|(_, unnamed)| !unnamed.is_empty())
        .collect()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// The registry a JSON value writes.
    fn registry_of(value: serde_json::Value) -> Registry {
        serde_json::from_value(value).unwrap()
    }

    #[test]
    fn every_unrevoked_control_plane_must_be_named() {
        let ek = |b: &str| format!("sha256:{}", b.repeat(32));
        let one = |registry| vec![("cp-0:9000".to_owned(), registry)];
        let registry = registry_of(serde_json::json!({
            "nodes": {
                "a": {"name": "cp-0", "role": "control-plane", "ek": ek("aa")},
                "b": {"name": "cp-1\u{1b}[2J", "role": "control-plane", "ek": ek("bb")},
                "c": {"name": "cp-2", "role": "control-plane", "ek": ek("cc")},
                "d": {"name": "w-1", "role": "worker", "ek": ek("dd")},
            },
            "revoked": [{"ek": ek("cc")}],
        }));
        let named: BTreeSet<String> = [ek("aa")].into();
        assert_eq!(
            unnamed_control_planes(&one(registry.clone()), &named),
            [(
                "cp-0:9000".to_owned(),
                vec![format!("cp-1\\u{{1b}}[2J ({})", ek("bb"))]
            )]
        );
        let all: BTreeSet<String> = [ek("aa"), ek("bb")].into();
        assert!(unnamed_control_planes(&one(registry), &all).is_empty());
        assert!(unnamed_control_planes(&one(Registry::default()), &named).is_empty());
    }

    /// A control plane one named control plane does not know (its host
    /// keeps that one from hearing it) is found in another's registry; one
    /// that a registry has revoked counts as revoked, even where another
    /// has not merged that revocation yet.
    #[test]
    fn every_named_registry_counts_and_revocations_are_one_list() {
        let ek = |b: &str| format!("sha256:{}", b.repeat(32));
        let cp = |name: &str, e: &str| serde_json::json!({"name": name, "role": "control-plane", "ek": ek(e)});
        let named: BTreeSet<String> = [ek("aa"), ek("bb")].into();
        let first = serde_json::json!({"nodes": {"a": cp("cp-0", "aa"), "b": cp("cp-1", "bb")}});
        let second = registry_of(serde_json::json!({
            "nodes": {"a": cp("cp-0", "aa"), "b": cp("cp-1", "bb"), "x": cp("cp-x", "ee")},
        }));
        let registries = vec![
            ("cp-0:9000".to_owned(), registry_of(first.clone())),
            ("cp-1:9000".to_owned(), second.clone()),
        ];
        assert_eq!(
            unnamed_control_planes(&registries, &named),
            [("cp-1:9000".to_owned(), vec![format!("cp-x ({})", ek("ee"))])]
        );
        let mut revoking = first;
        revoking["revoked"] = serde_json::json!([{"ek": ek("ee")}]);
        let registries = vec![
            ("cp-0:9000".to_owned(), registry_of(revoking)),
            ("cp-1:9000".to_owned(), second),
        ];
        assert!(unnamed_control_planes(&registries, &named).is_empty());
    }

    /// A named control plane that could not be read may be any one the
    /// registries know: as many unnamed ones pass as named ones were not
    /// read, counted once across the registries, and no more.
    #[test]
    fn unnamed_control_planes_pass_only_for_as_many_named_ones_not_read() {
        let ek = |b: &str| format!("sha256:{}", b.repeat(32));
        let cp = |name: &str, e: &str| serde_json::json!({"name": name, "role": "control-plane", "ek": ek(e)});
        let named: BTreeSet<String> = [ek("aa")].into();
        let registry = registry_of(serde_json::json!({
            "nodes": {"a": cp("cp-0", "aa"), "b": cp("cp-1", "bb"), "c": cp("cp-2", "cc")},
        }));
        let registries = vec![
            ("cp-0:9000".to_owned(), registry.clone()),
            ("cp-0b:9000".to_owned(), registry),
        ];
        for unread in [0, 1] {
            let e = refuse_unnamed_control_planes(&registries, &named, unread, "why")
                .unwrap_err()
                .to_string();
            assert!(e.contains("not named with --endpoint"), "{e}");
        }
        refuse_unnamed_control_planes(&registries, &named, 2, "why").unwrap();
    }
}
