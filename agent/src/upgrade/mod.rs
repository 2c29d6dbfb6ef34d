//! Moving a member node to another Kubernetes version, measured and
//! reversible.
//!
//! An [`Upgrader`] runs one upgrade at a time, asked for by the operator
//! (the operator API authenticates the request first):
//!
//! 1. **Check.** The node's [`NodeVersion`] record (on its state disk) is
//!    the version it runs; the target must follow it by Kubernetes' skew
//!    policy ([`keel_installer::KubernetesVersion::upgrade_to`]: no
//!    downgrade, one minor version at most). Nothing changes on a refusal.
//! 2. **Stage.** Every component of the target version is downloaded,
//!    verified by SHA-256 and installed beside the running ones
//!    ([`Staging`]). A component that fails (unreachable, wrong hash)
//!    stops here: the staged files are removed, the node is as before.
//! 3. **Measure.** Each staged component is measured into PCR 13 with its
//!    own event (its install path, hash and URL; the description names the
//!    target version, which the digest does not cover), before anything
//!    runs it.
//! 4. **Switch** every component directory to the staged one at once,
//!    run `kubeadm upgrade apply` (the first control plane) or
//!    `kubeadm upgrade node` (the others), restart the kubelet.
//! 5. **Record** the new version on the state disk (a reboot reinstalls
//!    it); a control plane also updates its facts and the state its join
//!    service hands to joining nodes. The previous binaries are removed.
//!
//! A failure in 4 or 5 switches the directories back, measures the
//! previous components again (so the event log ends with what the node
//! runs) and restarts the kubelet: the node keeps serving at its previous
//! version, and the failure names what went wrong and whether it rolled
//! back. A failure after kubeadm's upgrade succeeded is not a rollback: the
//! binaries go back, but what kubeadm changed stays, and the failure says
//! to run the same upgrade again (the node's record still names the
//! previous version, so it is admitted). Nor is a kubeadm that failed
//! having changed the static pods' manifests or the kubelet's
//! configuration (`kubeadm_files`: a phase after its control-plane one
//! failed, which kubeadm does not undo), or one killed at its limit.
//!
//! A node that stops between 4 and 5 (power loss, a crash) finds the
//! [`Switching`] record, written before the switch, when it boots: its
//! component directories are emptied and the recorded version installed
//! into them again, so they hold that version's files and no other. If it
//! stopped once kubeadm was to run (marked beside the record, with the
//! target), the boot also says, as [`UpgradeError::AfterKubeadm`] does,
//! that kubeadm may have upgraded the node and to run the same upgrade
//! again.

mod kubeadm_files;
mod record;
mod staging;

use std::sync::Arc;
use std::time::{Duration, Instant};

use keel_installer::{Component, Installer, KubernetesVersion, UpgradeStepError};

use crate::components::StreamedProgress;
use keel_proto::operator::{UpgradePlan, UpgradeStep};
use keel_verifier::measurement::EventType;
use keel_verifier::signature::SigningPublicKey;

use crate::cluster::{change_state, ClusterSlot, FactsError};
use crate::measured::SharedTpm;
use crate::provision::{restart_kubelet, NodeEnv};
use kubeadm_files::KubeadmFiles;

pub use record::{NodeVersion, RecordError, Switching};
pub use staging::{
    check_switchable, clear as clear_switched, component_dirs, switchable, Staging, StagingError,
    STAGED_SUFFIX,
};

/// Most components an upgrade plan may list.
pub const MAX_PLAN_COMPONENTS: usize = 64;

/// How often a control plane looks at kubeadm's certificates' ends.
pub const CERTIFICATE_CHECK: Duration = Duration::from_secs(12 * 3600);
/// How soon a failed renewal of kubeadm's certificates is tried again.
pub const CERTIFICATE_RETRY: Duration = Duration::from_secs(3600);
/// The bytes of its event log a node's attestation document may carry, of
/// the [`keel_atls::cert::MAX_DOCUMENT_LEN`] that fit a handshake (the rest
/// holds the quote, the EK certificate, CPU evidence and the image's
/// signed measurements). Each upgrade adds its components' events, and a
/// rollback the previous ones again, until the node reboots; an upgrade
/// that could take the log past this is refused before anything changes.
pub const EVENT_LOG_BUDGET: usize = 32 * 1024;
// The config's two events take at most about half of the log's budget
// (their bytes; their descriptions and framing add some 200 more), leaving
// the rest to the components and to an upgrade and its rollback.
const _: () = assert!(keel_verifier::config::MAX_MEASURED_CONFIG_BYTES <= EVENT_LOG_BUDGET / 2);
/// What an event costs a document beside its description and data: its
/// digest, PCR, type and sequence number, and their framing.
const EVENT_OVERHEAD: usize = 64;

/// What one node does in an upgrade.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// A control plane authorises the target's components for its
    /// members' evidence; nothing is installed.
    Authorise,
    /// Upgrade with `kubeadm upgrade apply <version>`: the first control
    /// plane.
    Apply,
    /// Upgrade with `kubeadm upgrade node`: every other node.
    Node,
}

/// A checked upgrade request.
#[derive(Debug, Clone)]
pub struct Target {
    /// The pinned version.
    pub version: KubernetesVersion,
    /// Its components (the request's, or the versions table's).
    pub components: Vec<Component>,
    /// What this node does.
    pub step: Step,
}

impl Target {
    /// Checks the fields of `plan`, its components' directories switchable
    /// ([`check_switchable`]) and its list one the installer takes
    /// ([`keel_installer::check_list`]). Where `signing_key` is the cluster's
    /// measurements signing key (the node's config names it), components
    /// the plan lists (rather than the versions table's) count only with
    /// their components file signed by that key
    /// ([`crate::components::check_signed_list`]).
    pub fn parse(
        plan: UpgradePlan,
        signing_key: Option<&SigningPublicKey>,
    ) -> Result<Self, UpgradeError> {
        let entry = keel_installer::resolve(&plan.kubernetes_version)
            .map_err(|e| UpgradeError::Version(e.to_string()))?;
        let listed = plan.components.map(|c| c.components).unwrap_or_default();
        if listed.len() > MAX_PLAN_COMPONENTS {
            return Err(UpgradeError::Plan(format!(
                "more than {MAX_PLAN_COMPONENTS} components"
            )));
        }
        if let (false, Some(key)) = (listed.is_empty(), signing_key) {
            crate::components::check_signed_list(
                key,
                entry.version(),
                &plan.components_file,
                &plan.components_signature,
                &listed,
            )
            .map_err(|e| UpgradeError::Unsigned(e.to_string()))?;
        }
        let components = if listed.is_empty() {
            entry.components().to_vec()
        } else {
            listed
                .into_iter()
                .map(Component::try_from)
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| UpgradeError::Plan(format!("component: {e}")))?
        };
        // Every node would refuse to stage a plan whose directories it
        // cannot switch, or whose list the installer refuses: such a plan
        // authorises nothing either.
        keel_installer::check_list(&components).map_err(|e| UpgradeError::Plan(e.to_string()))?;
        check_switchable(&components).map_err(|e| UpgradeError::Plan(e.to_string()))?;
        let step = match UpgradeStep::try_from(plan.step) {
            Ok(UpgradeStep::Apply) => Step::Apply,
            Ok(UpgradeStep::Node) => Step::Node,
            Ok(UpgradeStep::Authorise) => Step::Authorise,
            _ => {
                return Err(UpgradeError::Plan(
                    "step must be authorise, apply or node".into(),
                ))
            }
        };
        Ok(Self {
            version: entry.version(),
            components,
            step,
        })
    }
}

/// Whether the node recorded as `current` runs `target` already: the same
/// version with the same components.
fn runs_already(current: &NodeVersion, target: &Target) -> bool {
    current.version == target.version && current.components == target.components
}

/// Whether the node recorded as `current` may move to `target`: the step
/// the skew policy allows ([`KubernetesVersion::upgrade_to`]), covering
/// every directory it runs components from ([`covers`]).
fn may_move(current: &NodeVersion, target: &Target) -> Result<(), UpgradeError> {
    current.version.upgrade_to(target.version)?;
    covers(current, target)
}

/// Whether the node recorded as `current` may take `target` in a rollout:
/// it runs it already (a rollout run again) or may move to it.
fn may_take(current: &NodeVersion, target: &Target) -> Result<(), UpgradeError> {
    if runs_already(current, target) {
        Ok(())
    } else {
        may_move(current, target)
    }
}

/// Every directory `current` runs components from is one `target`
/// installs into, so the switch covers it: one left out would keep its old
/// binaries running, measured by no event once the next boot installs the
/// recorded version.
fn covers(current: &NodeVersion, target: &Target) -> Result<(), UpgradeError> {
    let planned = staging::component_dirs(&target.components);
    match staging::component_dirs(&current.components)
        .into_iter()
        .find(|d| !planned.contains(d))
    {
        Some(dir) => Err(UpgradeError::Plan(format!(
            "it installs nothing into {dir}, which this node runs components from \
             (a components file must list every directory the running version uses)"
        ))),
        None => Ok(()),
    }
}

/// Why an upgrade was refused or failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum UpgradeError {
    /// The target version is not supported.
    #[error("{0}")]
    Version(String),
    /// The plan is malformed.
    #[error("invalid upgrade plan: {0}")]
    Plan(String),
    /// The plan's own components lack a valid signature of their file.
    #[error("{0}")]
    Unsigned(String),
    /// Another upgrade, or a renewal of kubeadm's certificates, runs on
    /// this node.
    #[error(
        "an upgrade (or a renewal of kubeadm's certificates) is already running on this node; \
         try again once it is done"
    )]
    Busy,
    /// Only a control plane authorises components.
    #[error("only a control plane authorises the components of a version")]
    NotControlPlane,
    /// The node records no version (it is no member, or has no state disk).
    #[error("this node records no Kubernetes version; it cannot be upgraded")]
    NoRecord,
    /// An earlier upgrade's switch was not finished (its switching back
    /// failed); the next boot installs the recorded version again.
    #[error(
        "an earlier upgrade left {0} half switched; reboot the node (it installs its recorded \
         version into them again), then upgrade"
    )]
    Unfinished(String),
    /// The skew policy refuses the step.
    #[error(transparent)]
    Step(#[from] UpgradeStepError),
    /// The record could not be read or written.
    #[error("the node's version record")]
    Record(#[source] RecordError),
    /// Staging or switching directories failed.
    #[error("staging the components")]
    Staging(#[source] StagingError),
    /// The installer could not be set up.
    #[error("setting up the installer")]
    Installer(#[source] keel_installer::InstallError),
    /// A component of the target version could not be installed.
    #[error("installing component {name} of Kubernetes {version}")]
    Install {
        /// The target version.
        version: KubernetesVersion,
        /// The component's short name.
        name: String,
        /// The cause.
        #[source]
        source: Box<keel_installer::InstallError>,
    },
    /// Measuring a component failed.
    #[error("measuring the components")]
    Measure(#[source] crate::measured::MeasuredLogError),
    /// The TPM handle is poisoned or its task failed.
    #[error("the TPM is unavailable")]
    Tpm,
    /// A step run off the runtime stopped before it finished (it
    /// panicked).
    #[error("a step of the upgrade stopped before it finished")]
    Stopped,
    /// kubeadm refused or failed.
    #[error("kubeadm upgrade")]
    Kubeadm(#[source] crate::kubeadm::KubeadmError),
    /// The kubelet did not restart.
    #[error("restarting the kubelet")]
    Kubelet(#[source] crate::provision::ProvisionError),
    /// A control plane's facts could not be updated.
    #[error("updating the control-plane facts")]
    Facts(#[source] FactsError),
    /// The upgrade's measurements, with a rollback's, would take the
    /// node's event log past what an attestation document carries: every
    /// handshake of the node would then fail. A reboot empties the log of
    /// earlier upgrades.
    #[error(
        "this node's event log holds {used} bytes; the upgrade and a rollback would add up to \
         {adding}, past the {budget} of it an attestation carries: reboot the node (it \
         measures only what it runs), then upgrade it"
    )]
    EventLogFull {
        /// The log's bytes now.
        used: usize,
        /// What the upgrade and a rollback would add.
        adding: usize,
        /// [`EVENT_LOG_BUDGET`].
        budget: usize,
    },
    /// As [`UpgradeError::EventLogFull`], but even the log of a fresh boot
    /// (the config, the identity, the running components) leaves no room:
    /// the plan's components, or the node's config, are too large.
    #[error(
        "this upgrade's measurements, with a rollback's, would add {adding} bytes to an event \
         log of at least {fresh} even after a reboot, past the {budget} of it an attestation \
         carries: the plan lists too many components (or too long URLs), or the node's config \
         is too large"
    )]
    PlanTooLarge {
        /// The log's bytes after a reboot, about.
        fresh: usize,
        /// What the upgrade and a rollback would add.
        adding: usize,
        /// [`EVENT_LOG_BUDGET`].
        budget: usize,
    },
    /// A step after kubeadm's upgrade failed. kubeadm's changes (the
    /// static pods' manifests, the kubelet's config, the cluster's kubeadm
    /// config on the first control plane) are not undone by switching the
    /// binaries back: running the same upgrade again finishes it.
    #[error(
        "kubeadm had upgraded this node to Kubernetes {version} (its manifests and \
         configuration stay so); run the same upgrade again to finish it"
    )]
    AfterKubeadm {
        /// The version kubeadm upgraded to.
        version: KubernetesVersion,
        /// What failed after it.
        #[source]
        source: Box<UpgradeError>,
    },
    /// kubeadm failed after it changed the static pods' manifests or the
    /// kubelet's configuration (a phase after its control-plane one, which
    /// it does not undo): switching the binaries back does not undo them
    /// either.
    #[error(
        "kubeadm failed after changing this node's static pods or kubelet configuration \
         for Kubernetes {version} (they stay so); run the same upgrade again to finish it"
    )]
    KubeadmChanged {
        /// The version kubeadm upgraded to.
        version: KubernetesVersion,
        /// kubeadm's failure.
        #[source]
        source: Box<UpgradeError>,
    },
    /// As [`UpgradeError::KubeadmChanged`], but whether kubeadm changed
    /// them could not be told: the files could not be read before or
    /// after it.
    #[error(
        "kubeadm failed, and whether it changed this node's static pods or kubelet \
         configuration for Kubernetes {version} could not be told ({look}); check them, or \
         run the same upgrade again to finish it"
    )]
    KubeadmMayHaveChanged {
        /// The version kubeadm upgraded to.
        version: KubernetesVersion,
        /// Why the files could not be read.
        look: String,
        /// kubeadm's failure.
        #[source]
        source: Box<UpgradeError>,
    },
}

impl From<FactsError> for UpgradeError {
    fn from(e: FactsError) -> Self {
        Self::Facts(e)
    }
}

/// A node that runs the target version now.
#[derive(Debug, Clone, Copy)]
pub struct Upgraded {
    /// The version it ran before.
    pub previous: KubernetesVersion,
    /// The version it runs now.
    pub version: KubernetesVersion,
    /// How long the upgrade took.
    pub elapsed: std::time::Duration,
}

/// A failed upgrade: why, whether the node switched back, what it runs.
#[derive(Debug)]
pub struct UpgradeFailure {
    /// What went wrong.
    pub error: UpgradeError,
    /// The node had switched to the new binaries.
    pub switched: bool,
    /// The node is back at its previous version: binaries switched back,
    /// measured, recorded and running, and kubeadm had not upgraded it.
    pub rolled_back: bool,
    /// The version the node runs (`None` if it is not known).
    pub running: Option<KubernetesVersion>,
}

impl From<UpgradeError> for UpgradeFailure {
    fn from(error: UpgradeError) -> Self {
        Self {
            error,
            switched: false,
            rolled_back: false,
            running: None,
        }
    }
}

/// Runs the upgrades of one node (clones share its turn).
#[derive(Clone)]
pub struct Upgrader {
    env: NodeEnv,
    tpm: SharedTpm,
    cluster: Arc<ClusterSlot>,
    signing_key: Option<SigningPublicKey>,
    running: Arc<tokio::sync::Mutex<()>>,
}

/// This node's one upgrade, held from the check that admits it
/// ([`Upgrader::check`]) to the end of its run: a second request is
/// refused as busy before it is answered, not after.
pub struct UpgradeTurn(#[allow(dead_code)] tokio::sync::OwnedMutexGuard<()>);

impl Upgrader {
    /// The upgrader of the node `env`, measuring into `tpm`; a control
    /// plane's cluster state is in `cluster`.
    pub fn new(env: NodeEnv, tpm: SharedTpm, cluster: Arc<ClusterSlot>) -> Self {
        Self {
            env,
            tpm,
            cluster,
            signing_key: None,
            running: Arc::new(tokio::sync::Mutex::new(())),
        }
    }

    /// With the cluster's measurements signing key (the node's config
    /// names it): a plan's own components need their file signed with it.
    pub fn with_signing_key(mut self, key: Option<SigningPublicKey>) -> Self {
        self.signing_key = key;
        self
    }

    /// The checked target of `plan` ([`Target::parse`] with this node's
    /// signing key).
    pub fn target(&self, plan: UpgradePlan) -> Result<Target, UpgradeError> {
        Target::parse(plan, self.signing_key.as_ref())
    }

    /// On a control plane: authorises the components of `target` for its
    /// members' evidence (state, facts), before any node switches to them.
    /// Only a target this control plane could move to itself (or runs
    /// already, for a rollout run again) is authorised: a downgrade, a
    /// skipped minor version or a plan that leaves out a directory it runs
    /// components from, which every node would refuse, authorises nothing.
    pub fn authorise(&self, target: &Target) -> Result<(), UpgradeError> {
        // An upgrade running here now is one, not one left half switched
        // (whose record this would find and call for a reboot).
        let _turn = self.turn()?;
        let current = self.current()?;
        may_take(&current, target)?;
        change_state(&self.cluster, self.env.root(), |state| {
            Ok::<_, UpgradeError>(state.authorising(&target.components))
        })?
        .ok_or(UpgradeError::NotControlPlane)?;
        tracing::info!(version = %target.version, "components of the target version authorised");
        Ok(())
    }

    /// Whether this node may move to `target` now: it records a version
    /// that `target` may follow, and runs no other upgrade. Returns the
    /// turn to [`run`](Self::run) it in.
    pub fn check(&self, target: &Target) -> Result<UpgradeTurn, UpgradeError> {
        let turn = self.turn()?;
        let current = self.current()?;
        may_take(&current, target)?;
        Ok(turn)
    }

    /// Renews kubeadm's certificates on this control plane when the first
    /// of them is due ([`Kubeadm::renew_certificates_if_due`]), in this
    /// node's upgrade turn: kubeadm's upgrade renews them itself, and the
    /// two must not write them at once. `None` when none was due, or an
    /// upgrade runs now.
    ///
    /// [`Kubeadm::renew_certificates_if_due`]: crate::kubeadm::Kubeadm::renew_certificates_if_due
    pub async fn renew_certificates_if_due(
        &self,
        now: std::time::SystemTime,
    ) -> Result<Option<crate::kubeadm::certs::Ending>, crate::kubeadm::certs::RenewalError> {
        let Ok(_turn) = self.turn() else {
            return Ok(None);
        };
        self.env.kubeadm.renew_certificates_if_due(now).await
    }

    /// Looks at kubeadm's certificates a minute after it starts and then
    /// every [`CERTIFICATE_CHECK`], renewing them when due
    /// ([`Self::renew_certificates_if_due`]); a failed renewal is tried
    /// again after [`CERTIFICATE_RETRY`]. Runs until dropped.
    pub async fn renew_certificates_forever(self) {
        tokio::time::sleep(Duration::from_secs(60)).await;
        loop {
            let pause = match self
                .renew_certificates_if_due(std::time::SystemTime::now())
                .await
            {
                Ok(_) => CERTIFICATE_CHECK,
                Err(e) => {
                    tracing::error!(
                        error = %keel_atls::ErrorChain(&e),
                        retry_in_s = CERTIFICATE_RETRY.as_secs(),
                        "renewing kubeadm's certificates failed"
                    );
                    CERTIFICATE_RETRY
                }
            };
            tokio::time::sleep(pause).await;
        }
    }

    /// This node's upgrade turn, unless an upgrade runs here now.
    fn turn(&self) -> Result<UpgradeTurn, UpgradeError> {
        self.running
            .clone()
            .try_lock_owned()
            .map(UpgradeTurn)
            .map_err(|_| UpgradeError::Busy)
    }

    /// The version this node runs, if no earlier switch is unfinished: a
    /// new upgrade would overwrite the record of the directories that
    /// switch left, and a rollback of it would leave them as they are.
    fn current(&self) -> Result<NodeVersion, UpgradeError> {
        let root = self.env.root();
        if let Some(switching) = Switching::load(root).map_err(UpgradeError::Record)? {
            return Err(UpgradeError::Unfinished(switching.directories.join(", ")));
        }
        NodeVersion::load(root)
            .map_err(UpgradeError::Record)?
            .ok_or(UpgradeError::NoRecord)
    }

    /// Moves this node to `target` in `turn`, reporting each step to `log`.
    pub async fn run(
        &self,
        target: &Target,
        turn: UpgradeTurn,
        log: &(dyn Fn(String) + Sync),
    ) -> Result<Upgraded, UpgradeFailure> {
        let _turn = turn;
        if target.step == Step::Authorise {
            return Err(UpgradeError::Plan("authorising installs nothing".into()).into());
        }
        let root = self.env.root();
        let current = self.current()?;
        let failure = |error, switched, rolled_back| UpgradeFailure {
            error,
            switched,
            rolled_back,
            running: Some(current.version),
        };
        // A rollout run again (after a node of it failed) reaches nodes it
        // already moved: done, with nothing changed.
        if runs_already(&current, target) {
            log(format!(
                "already runs Kubernetes {} with these components: nothing to do",
                target.version
            ));
            return Ok(Upgraded {
                previous: current.version,
                version: target.version,
                elapsed: std::time::Duration::ZERO,
            });
        }
        may_move(&current, target).map_err(|e| failure(e, false, false))?;
        self.log_room(&current, target)
            .await
            .map_err(|e| failure(e, false, false))?;
        let started = Instant::now();
        log(format!(
            "upgrading from Kubernetes {} to {} ({} components)",
            current.version,
            target.version,
            target.components.len()
        ));

        // 2. Stage: nothing the node runs changes.
        let (mut staging, staged) = Staging::prepare(root, &target.components)
            .map_err(|e| failure(UpgradeError::Staging(e), false, false))?;
        // From here until the record names the new version (or the
        // directories are back), a reboot finds the switch unfinished.
        let staged_ok = self.stage(target, &staged, log).await.and_then(|()| {
            Switching::begin(root, staging.directories()).map_err(UpgradeError::Record)
        });
        // 3. Measure before anything runs them.
        let note = upgrade_note(target.version);
        let measured = match staged_ok {
            Ok(()) => self.measure(&target.components, &note).await,
            Err(error) => Err(error),
        };
        if let Err(error) = measured {
            // Nothing switched: the staged files and any switch record go.
            if let Err(e) = staging.discard() {
                tracing::warn!(error = %keel_atls::ErrorChain(&e), "removing the staged components failed");
            }
            if let Err(e) = Switching::end(root) {
                tracing::warn!(error = %keel_atls::ErrorChain(&e), "removing the switch record failed");
            }
            return Err(failure(error, false, false));
        }
        log(format!(
            "{} components verified and measured into PCR 13",
            target.components.len()
        ));

        // 4 and 5; any failure switches back.
        match self.switch_and_apply(target, &mut staging, log).await {
            Ok(()) => {
                if let Err(e) = staging.discard() {
                    tracing::warn!(error = %keel_atls::ErrorChain(&e), "removing the previous components failed");
                }
                // The version is recorded: a reboot installs the target's
                // kept components, never the previous ones.
                match Installer::new(self.env.installer.clone()) {
                    Ok(installer) => installer.keep_only_copies_of(&target.components).await,
                    Err(e) => {
                        tracing::warn!(error = %keel_atls::ErrorChain(&e), "the previous kept components stay")
                    }
                }
                log(format!(
                    "upgraded to Kubernetes {} in {:.1} s",
                    target.version,
                    started.elapsed().as_secs_f64()
                ));
                Ok(Upgraded {
                    previous: current.version,
                    version: target.version,
                    elapsed: started.elapsed(),
                })
            }
            Err(error) => {
                log(format!("upgrade failed: {}", keel_atls::ErrorChain(&error)));
                // After kubeadm's upgrade, switching the binaries back does
                // not undo it: the node is not rolled back, whatever the
                // switch back does. Nor after a kubeadm that failed having
                // changed the node, or killed at its limit: it may have
                // been midway.
                let applied = matches!(
                    error,
                    UpgradeError::AfterKubeadm { .. }
                        | UpgradeError::KubeadmChanged { .. }
                        | UpgradeError::KubeadmMayHaveChanged { .. }
                        | UpgradeError::Kubeadm(crate::kubeadm::KubeadmError::Timeout { .. })
                );
                let rolled_back = self.roll_back(&current, staging, log).await && !applied;
                Err(failure(error, true, rolled_back))
            }
        }
    }

    async fn stage(
        &self,
        target: &Target,
        staged: &[Component],
        log: &(dyn Fn(String) + Sync),
    ) -> Result<(), UpgradeError> {
        let installer =
            Installer::new(self.env.installer.clone()).map_err(UpgradeError::Installer)?;
        for component in staged {
            installer
                .install_among(component, staged, &StreamedProgress::new(log))
                .await
                .map_err(|source| UpgradeError::Install {
                    version: target.version,
                    name: component.name().to_owned(),
                    source: Box::new(source),
                })?;
        }
        Ok(())
    }

    /// Refuses an upgrade from `current` to `target` whose events, with
    /// those of a rollback, would take the event log past
    /// [`EVENT_LOG_BUDGET`].
    async fn log_room(&self, current: &NodeVersion, target: &Target) -> Result<(), UpgradeError> {
        let adding: usize = component_events(&target.components, &upgrade_note(target.version))
            .iter()
            .chain(&component_events(
                &current.components,
                &rollback_note(current.version),
            ))
            .map(|(description, data)| event_bytes(description, data))
            .sum();
        let tpm = SharedTpm::clone(&self.tpm);
        // The whole log's bytes, and its components' among them.
        let (used, components) = tokio::task::spawn_blocking(move || {
            let tpm = tpm.lock().map_err(|_| UpgradeError::Tpm)?;
            Ok::<_, UpgradeError>(tpm.events().iter().fold((0, 0), |(all, components), e| {
                let bytes = event_bytes(&e.description, &e.data);
                let component = if e.event_type == EventType::Component {
                    bytes
                } else {
                    0
                };
                (all + bytes, components + component)
            }))
        })
        .await
        .map_err(|_| UpgradeError::Tpm)??;
        // After a reboot: everything but the components, and the running
        // components once (as a rejoin measures them, without a note).
        let running: usize = current
            .components
            .iter()
            .map(|c| event_bytes(&c.description(), &c.measurement_record()))
            .sum();
        let fresh = used - components + running;
        if fresh.saturating_add(adding) > EVENT_LOG_BUDGET {
            return Err(UpgradeError::PlanTooLarge {
                fresh,
                adding,
                budget: EVENT_LOG_BUDGET,
            });
        }
        if used.saturating_add(adding) > EVENT_LOG_BUDGET {
            return Err(UpgradeError::EventLogFull {
                used,
                adding,
                budget: EVENT_LOG_BUDGET,
            });
        }
        Ok(())
    }

    /// Measures `components` (as they are installed: their own install
    /// paths) into PCR 13, each event noting `note`.
    async fn measure(&self, components: &[Component], note: &str) -> Result<(), UpgradeError> {
        let events = component_events(components, note);
        let tpm = SharedTpm::clone(&self.tpm);
        tokio::task::spawn_blocking(move || {
            let mut tpm = tpm.lock().map_err(|_| UpgradeError::Tpm)?;
            for (description, record) in events {
                tpm.record(EventType::Component, description, record)
                    .map_err(UpgradeError::Measure)?;
            }
            Ok(())
        })
        .await
        .map_err(|_| UpgradeError::Tpm)?
    }

    async fn switch_and_apply(
        &self,
        target: &Target,
        staging: &mut Staging,
        log: &(dyn Fn(String) + Sync),
    ) -> Result<(), UpgradeError> {
        let carried = staging
            .carry_network_plugins()
            .map_err(UpgradeError::Staging)?;
        if carried > 0 {
            log(format!(
                "kept {carried} file(s) a network plugin put beside the CNI plugins"
            ));
        }
        staging.switch().map_err(UpgradeError::Staging)?;
        log("switched to the new components".into());
        let mut on_line = |line: &str| log(line.to_owned());
        let kubeadm = &self.env.kubeadm;
        // The new version's patches, switched in with its components.
        let patches = self.env.patches_dir();
        // From here until the record names the target, a reboot must say
        // that kubeadm may have upgraded the node: installing the recorded
        // version again puts its binaries back, not kubeadm's changes.
        let (root, version) = (self.env.root().to_path_buf(), target.version);
        off_the_runtime(move || {
            Switching::kubeadm_starts(&root, version).map_err(UpgradeError::Record)
        })
        .await?;
        let before = KubeadmFiles::now_blocking(&kubeadm.root).await;
        let ran = match target.step {
            Step::Apply => {
                log(format!("running kubeadm upgrade apply {}", target.version));
                kubeadm
                    .upgrade_apply(target.version, &patches, &mut on_line)
                    .await
            }
            Step::Node | Step::Authorise => {
                log("running kubeadm upgrade node".into());
                kubeadm.upgrade_node(&patches, &mut on_line).await
            }
        };
        if let Err(error) = ran {
            let timed_out = matches!(error, crate::kubeadm::KubeadmError::Timeout { .. });
            let after = KubeadmFiles::now_blocking(&kubeadm.root).await;
            let source = Box::new(UpgradeError::Kubeadm(error));
            let version = target.version;
            return Err(match (before, after) {
                _ if timed_out => *source,
                (Ok(before), Ok(after)) if before == after => *source,
                (Ok(_), Ok(_)) => UpgradeError::KubeadmChanged { version, source },
                (Err(e), _) | (_, Err(e)) => UpgradeError::KubeadmMayHaveChanged {
                    version,
                    look: keel_atls::ErrorChain(&e).to_string(),
                    source,
                },
            });
        }
        let applied = |error| UpgradeError::AfterKubeadm {
            version: target.version,
            source: Box::new(error),
        };
        restart_kubelet(&self.env.kubelet)
            .await
            .map_err(|e| applied(UpgradeError::Kubelet(e)))?;
        log("kubelet restarted".into());
        let record = NodeVersion {
            version: target.version,
            components: target.components.clone(),
        };
        self.save_record(&record).await.map_err(applied)?;
        self.follow_on_control_plane(&record)
            .await
            .map_err(applied)?;
        crate::provision::durable().await;
        // The upgrade is done either way: a record left behind only makes
        // the next boot install this version afresh.
        if let Err(e) = Switching::end(self.env.root()) {
            tracing::warn!(error = %keel_atls::ErrorChain(&e), "removing the switch record failed");
        }
        Ok(())
    }

    /// Saves `record` as the version this node runs.
    async fn save_record(&self, record: &NodeVersion) -> Result<(), UpgradeError> {
        let record = record.clone();
        let root = self.env.root().to_path_buf();
        off_the_runtime(move || record.save(&root).map_err(UpgradeError::Record)).await
    }

    /// A control plane's facts and join service move to `record`'s
    /// version, so the nodes that join from now on install it.
    async fn follow_on_control_plane(&self, record: &NodeVersion) -> Result<(), UpgradeError> {
        let record = record.clone();
        let cluster = self.cluster.clone();
        let root = self.env.root().to_path_buf();
        off_the_runtime(move || {
            change_state(&cluster, &root, |state| {
                Ok::<_, UpgradeError>(state.running(record.version, &record.components))
            })?;
            Ok(())
        })
        .await
    }

    /// Switches back to `previous` after a failure; returns whether the
    /// node runs it again.
    async fn roll_back(
        &self,
        previous: &NodeVersion,
        mut staging: Staging,
        log: &(dyn Fn(String) + Sync),
    ) -> bool {
        if let Err(e) = staging.switch_back() {
            log(format!(
                "switching back failed: {}; the node needs attention",
                keel_atls::ErrorChain(&e)
            ));
            return false;
        }
        let note = rollback_note(previous.version);
        // The event log must end with what the node runs: unmeasured, the
        // rollback is not complete.
        let measured = succeeded(
            self.measure(&previous.components, &note).await,
            "measuring the previous components",
            log,
        );
        let saved = succeeded(
            self.save_record(previous).await,
            "writing the previous version's record",
            log,
        );
        if saved {
            crate::provision::durable().await;
            if let Err(e) = Switching::end(self.env.root()) {
                tracing::warn!(error = %keel_atls::ErrorChain(&e), "removing the switch record failed");
            }
        }
        // The kubelet the switch started runs the other version's binary:
        // restarted from what the directories hold now, whether or not the
        // record could be written.
        let restarted = succeeded(
            restart_kubelet(&self.env.kubelet).await,
            "restarting the kubelet",
            log,
        );
        let restored = measured && saved && restarted;
        succeeded(
            self.follow_on_control_plane(previous).await,
            "restoring the control-plane facts",
            log,
        );
        if let Err(e) = staging.discard() {
            tracing::warn!(error = %keel_atls::ErrorChain(&e), "removing the staged components failed");
        }
        crate::provision::durable().await;
        log(format!(
            "switched back to Kubernetes {}{}{}",
            previous.version,
            if saved {
                ""
            } else {
                " (writing its version record failed)"
            },
            if restarted {
                ""
            } else {
                " (restarting the kubelet failed)"
            }
        ));
        restored
    }
}

/// Whether a step of a rollback succeeded; a failure is told to the
/// operator's stream as `what` failing, with its causes.
fn succeeded<E: std::error::Error + 'static>(
    result: Result<(), E>,
    what: &str,
    log: &(dyn Fn(String) + Sync),
) -> bool {
    match result {
        Ok(()) => true,
        Err(e) => {
            log(format!("{what} failed: {}", keel_atls::ErrorChain(&e)));
            false
        }
    }
}

/// Runs `op` on a blocking thread: the records and the facts are written
/// and synced to the state disk (the facts under the process's one turn
/// of cluster changes), and a slow disk must hold up no runtime worker.
async fn off_the_runtime<T: Send + 'static>(
    op: impl FnOnce() -> Result<T, UpgradeError> + Send + 'static,
) -> Result<T, UpgradeError> {
    tokio::task::spawn_blocking(op)
        .await
        .map_err(|_| UpgradeError::Stopped)?
}

/// What an upgrade's events note.
fn upgrade_note(version: KubernetesVersion) -> String {
    format!("Kubernetes {version}")
}

/// What a rollback's events note.
fn rollback_note(version: KubernetesVersion) -> String {
    format!("rollback to Kubernetes {version}")
}

/// The events (description, data) measuring `components`, each noting
/// `note`.
fn component_events(components: &[Component], note: &str) -> Vec<(String, Vec<u8>)> {
    components
        .iter()
        .map(|c| {
            (
                format!("{} ({note})", c.description()),
                c.measurement_record(),
            )
        })
        .collect()
}

/// What one event costs an attestation document, about.
fn event_bytes(description: &str, data: &[u8]) -> usize {
    description.len() + data.len() + EVENT_OVERHEAD
}
