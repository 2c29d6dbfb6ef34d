//! The provisioning pipeline: what a node does once it holds the node lock.
//!
//! Init, join and rejoin (and whatever else makes a locked node a working
//! member) run the same steps through one [`Provisioner`], in this order,
//! stopping at the first failure:
//!
//! 1. **State disk**: a fresh disk is formatted (LUKS2) with the key for a
//!    new UUID, an initialised one is opened with its key; on a node it is
//!    then mounted and bound over the Kubernetes directories.
//! 2. **Private files** (the kubelet's certificate and key, the cluster CA,
//!    control-plane PKI), written atomically with mode 0600 under the node
//!    root.
//! 3. **Components**: installed (verified by SHA-256) and measured into
//!    PCR 13, in order; the version and its components are recorded on the
//!    state disk ([`NodeVersion`]), and after a reboot installed and
//!    measured again from that record ([`Provisioner::reinstall_recorded`]).
//! 4. **Kubernetes**: [`Provisioner::kubeadm_init`] (returning the admin
//!    kubeconfig), [`Provisioner::kubeadm_join`], or, for a node whose disk
//!    already holds its setup, [`Provisioner::start_kubelet`].
//!
//! Steps 1 to 3 are a [`Plan`] run by [`Provisioner::prepare`].
//!
//! 5. **Control plane** (init, control-plane join, rejoin, recovery): its
//!    facts go on the state disk.
//! 6. **Finish**: a disk set up in this boot is labelled finished
//!    ([`Provisioner::finish`]); a boot that finds one still labelled
//!    unfinished resets it and starts over.
//! 7. **Serving**: a control plane hands its cluster state to the join
//!    service. [`Provisioner::serve_as_control_plane`] runs steps 5 to 7.
//!
//! A failure is fatal for this boot: PCR 15 already carries the cluster ID,
//! so the node cannot start over. [`Provisioner::fail`] marks a disk that
//! was formatted in this boot for reset (a disk that held data before is
//! left alone) and schedules the reboot; the caller reports the error.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use keel_installer::{Component, Installer, InstallerConfig, KubernetesVersion};
use zeroize::Zeroizing;

use crate::address::AdvertiseAddress;
use crate::cluster::{ClusterSlot, ClusterState, ControlPlaneFacts, FactsError};
use crate::components::{install_and_measure, InstallComponentsError};
use crate::disk::{DiskError, StateDisk};
use crate::files::{write_private, TransientFile, WriteFileError};
use crate::kubeadm::{ConfigError, Discovery, InitConfig, JoinConfig, Kubeadm, KubeadmError};
use crate::measured::SharedTpm;
use crate::paths;
use crate::reboot::{self, RebootPolicy};
use crate::upgrade::{
    clear_switched, component_dirs, NodeVersion, RecordError, StagingError, Switching,
};
use keel_verifier::keys::KeyService;

/// How long `systemctl start kubelet` may take.
const KUBELET_START_TIMEOUT: Duration = Duration::from_secs(60);

/// Where and how this node does the work after the lock.
#[derive(Clone, Debug)]
pub struct NodeEnv {
    /// The installer's settings (root, mirror, retries).
    pub installer: InstallerConfig,
    /// How kubeadm runs; its `root` is the node root.
    pub kubeadm: Kubeadm,
    /// The agent's work directory: kubeadm configurations, token files,
    /// disk bindings, join measurements.
    pub work_dir: PathBuf,
    /// The address the API server and kubelet advertise.
    pub advertise_address: AdvertiseAddress,
    /// The state disk, if the node has one.
    pub state_disk: Option<StateDisk>,
    /// How the kubelet starts when the node's setup is already on its disk.
    pub kubelet: KubeletStart,
    /// After a fatal failure.
    pub reboot: RebootPolicy,
}

impl NodeEnv {
    /// The node root (`/` on a node).
    pub fn root(&self) -> &Path {
        &self.kubeadm.root
    }

    /// `relative` under the node root.
    pub fn under_root(&self, relative: &str) -> PathBuf {
        self.root().join(relative)
    }

    /// kubeadm's patches directory ([`paths::PATCHES_DIR`]).
    pub fn patches_dir(&self) -> PathBuf {
        self.under_root(paths::PATCHES_DIR)
    }

    /// The control-plane PKI directory ([`paths::CONTROL_PLANE_PKI_DIR`]).
    pub fn pki_dir(&self) -> PathBuf {
        self.under_root(paths::CONTROL_PLANE_PKI_DIR)
    }
}

/// What the flows that make this node a member (init, join, recovery)
/// need of it: its measured config, its TPM, its node lock, where it
/// provisions, and where a control plane's cluster state goes (its join
/// service waits there).
#[derive(Clone)]
pub struct Node {
    /// The measured node config.
    pub config: keel_verifier::config::NodeConfig,
    /// The TPM and its event log.
    pub tpm: SharedTpm,
    /// The one-way switch into a cluster.
    pub lock: Arc<crate::nodelock::NodeLock>,
    /// Where and how the work after the lock happens.
    pub env: NodeEnv,
    /// The cluster state of a control plane, once it has one.
    pub cluster: Arc<ClusterSlot>,
    /// The operator key a joined node's ticket carried (a control plane
    /// derives its own from the cluster state).
    pub operator_key: Arc<crate::operator::OperatorKeySlot>,
}

/// How the kubelet is started when the node's setup is on its disk.
#[derive(Clone, Debug)]
pub enum KubeletStart {
    /// `systemctl start kubelet.service` (a node).
    Systemd,
    /// Runs this program with `--version` and requires success (host tests:
    /// the stand-in kubelet does nothing more).
    Program(PathBuf),
}

/// What to do with the state disk.
pub enum DiskStep {
    /// Format it as a new LUKS2 volume with this UUID and key.
    SetUp {
        /// The new volume's UUID (the key is derived for it).
        uuid: String,
        /// The volume key.
        key: Zeroizing<Vec<u8>>,
    },
    /// Open the existing volume with this key.
    Open {
        /// The volume key.
        key: Zeroizing<Vec<u8>>,
    },
}

/// The node's base after the lock: disk, files, components.
pub struct Plan {
    /// The state disk (skipped where the node has none).
    pub disk: DiskStep,
    /// Files to write under the node root (path relative to the root).
    pub files: Vec<(PathBuf, Zeroizing<Vec<u8>>)>,
    /// Components to install and measure, for this Kubernetes version.
    pub components: Option<(KubernetesVersion, Vec<Component>)>,
}

/// Why the work after the lock failed (fatal for this boot).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ProvisionError {
    /// The node lock was not recorded, yet PCR 15 changed.
    #[error("taking the node lock: {0}")]
    Lock(String),
    /// A state-disk operation failed.
    #[error("state disk")]
    Disk(#[source] DiskError),
    /// Writing a file failed.
    #[error("writing a file")]
    WriteFile(#[from] WriteFileError),
    /// Creating a directory failed.
    #[error("creating {path:?}")]
    CreateDir {
        /// The directory.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The installer could not be set up.
    #[error("setting up the installer")]
    Installer(#[source] keel_installer::InstallError),
    /// Installing the components failed.
    #[error("installing the components")]
    Install(#[source] InstallComponentsError),
    /// The kubeadm configuration is invalid.
    #[error("kubeadm configuration")]
    KubeadmConfig(#[source] ConfigError),
    /// kubeadm failed.
    #[error("running kubeadm")]
    Kubeadm(#[source] KubeadmError),
    /// Starting the kubelet failed.
    #[error("starting the kubelet: {0}")]
    Kubelet(String),
    /// A blocking task did not complete.
    #[error("a blocking task failed")]
    Blocking(#[source] tokio::task::JoinError),
    /// The control plane's facts could not be recorded or restored.
    #[error("control-plane facts")]
    Facts(#[source] FactsError),
    /// The node registry could not be read or written.
    #[error("the node registry")]
    Registry(#[source] crate::registry::RegistryError),
    /// The node's version record could not be written or read.
    #[error("the node's version record")]
    Record(#[source] crate::upgrade::RecordError),
    /// A member's state disk without a version record: what it runs cannot
    /// be installed and measured again (the disk was altered).
    #[error("the state disk has no version record: the components it runs cannot be installed and measured again")]
    NoRecord,
    /// The node's own registry revokes it.
    #[error("this node is on its cluster's revocation list: {0}")]
    Revoked(String),
    /// The node's own registry holds its EK under another name or role
    /// than its config gives: its host renamed it.
    #[error("this node's registry refuses its identity")]
    Renamed(#[source] crate::registry::RegistryError),
    /// Reading this node's TPM failed.
    #[error("reading this node's TPM")]
    Tpm(#[source] crate::tpm::TpmError),
    /// The node's image is neither the current nor the staged one of the
    /// cluster state it would restore.
    #[error(
        "this node's image (PCRs 4, 9 and 11) is neither its cluster's current nor its staged \
         image: a control plane of a retired image is not recovered; boot it from the current image"
    )]
    ImageNotAccepted,
    /// Reading the node's image PCRs failed.
    #[error("reading this node's image PCRs: {0}")]
    ImagePcrs(String),
    /// The state disk's facts are of another cluster than the one the
    /// node was locked to (a recovery with another measurement salt).
    #[error("the node was locked to cluster {locked}, but its state disk holds cluster {recorded}: the measurement salt is not this cluster's")]
    OtherCluster {
        /// The cluster ID the node was locked to (hex).
        locked: String,
        /// The cluster ID its facts record (hex).
        recorded: String,
    },
    /// The directories of an interrupted upgrade could not be emptied.
    #[error("emptying the component directories of an interrupted upgrade")]
    Switched(#[source] StagingError),
    /// A control plane has no route to take the address its API server
    /// advertises from: it would serve the loopback address to the nodes
    /// that join through it.
    #[error("this control plane has no address to advertise its API server on")]
    NoAddress(#[source] crate::address::NoRoute),
}

/// Runs plans for one node, reporting each step to a log sink.
pub struct Provisioner<'a> {
    env: &'a NodeEnv,
    tpm: &'a SharedTpm,
    log: &'a (dyn Fn(String) + Sync),
    /// A fresh disk was formatted in this boot and its set-up is not
    /// finished yet: a failure marks it for reset. A disk that held the
    /// node's data before, or one finished, is never reset by a failure.
    formatted: AtomicBool,
}

impl<'a> Provisioner<'a> {
    /// A provisioner for the node `env` measuring into `tpm`; each step and
    /// each kubeadm output line goes to `log`.
    pub fn new(env: &'a NodeEnv, tpm: &'a SharedTpm, log: &'a (dyn Fn(String) + Sync)) -> Self {
        Self {
            env,
            tpm,
            log,
            formatted: AtomicBool::new(false),
        }
    }

    /// Steps 1 to 3: the state disk, the files, the components. Stops at
    /// the first failure.
    pub async fn prepare(&self, plan: Plan) -> Result<(), ProvisionError> {
        self.state_disk(plan.disk).await?;
        self.write_files(&plan.files)?;
        if let Some((version, components)) = &plan.components {
            self.install(*version, components).await?;
        }
        Ok(())
    }

    /// Step 4 of a new cluster: `kubeadm init`; returns the admin kubeconfig.
    pub async fn kubeadm_init(
        &self,
        config: &InitConfig,
    ) -> Result<Zeroizing<Vec<u8>>, ProvisionError> {
        let config_file = self.write_config(paths::KUBEADM_INIT_CONFIG, config.to_yaml())?;
        (self.log)(format!("advertising {}", config.advertise_address));
        (self.log)("running kubeadm init".into());
        let mut on_line = |line: &str| (self.log)(line.to_owned());
        let result = self
            .env
            .kubeadm
            .init(config_file.path(), &mut on_line)
            .await;
        drop(config_file);
        let kubeconfig = result.map_err(ProvisionError::Kubeadm)?;
        durable().await;
        Ok(kubeconfig)
    }

    /// Writes `files` (paths relative to the node root), each private.
    fn write_files(&self, files: &[(PathBuf, Zeroizing<Vec<u8>>)]) -> Result<(), WriteFileError> {
        let root = self.env.root();
        files
            .iter()
            .try_for_each(|(relative, data)| write_private(&root.join(relative), data))
    }

    /// Step 4 of a join: `kubeadm join` (bounded retries). `files` are the
    /// plan's: the reset between attempts removes them, and they are
    /// written again before each retry.
    pub async fn kubeadm_join(
        &self,
        config: &JoinConfig,
        files: &[(PathBuf, Zeroizing<Vec<u8>>)],
    ) -> Result<(), ProvisionError> {
        // File discovery's kubeconfig first (it holds the kubelet's key),
        // then the configuration that names it; both removed after the run.
        let discovery = match &config.discovery {
            Discovery::File { path, kubeconfig } => {
                let file = kubeconfig
                    .render(&config.api_server_endpoint, &config.node_name)
                    .map_err(ProvisionError::KubeadmConfig)?;
                Some(TransientFile::write(path.clone(), file.as_bytes())?)
            }
            Discovery::Token { .. } => None,
        };
        let config_file = self.write_config(paths::KUBEADM_JOIN_CONFIG, config.to_yaml())?;
        (self.log)("running kubeadm join".into());
        let mut on_line = |line: &str| (self.log)(line.to_owned());
        let mut restore = || self.write_files(files);
        let result = self
            .env
            .kubeadm
            .join(config_file.path(), &mut restore, &mut on_line)
            .await;
        drop((config_file, discovery));
        result.map_err(ProvisionError::Kubeadm)?;
        durable().await;
        Ok(())
    }

    /// Step 4 of a node whose setup is on its disk: start the kubelet.
    pub async fn start_kubelet(&self) -> Result<(), ProvisionError> {
        start_kubelet(&self.env.kubelet).await?;
        (self.log)("kubelet started".into());
        Ok(())
    }

    /// Steps 5 to 7 of a control plane: records its facts on the state disk,
    /// finishes a disk set up in this boot ([`Provisioner::finish`]), then
    /// hands its cluster state to the join service (through `slot`): once
    /// it serves, nothing of the set-up can fail or be undone any more.
    pub async fn serve_as_control_plane(
        &self,
        state: ClusterState,
        slot: &ClusterSlot,
    ) -> Result<(), ProvisionError> {
        ControlPlaneFacts::of(&state)
            .save(self.env.root())
            .map_err(ProvisionError::Facts)?;
        self.finish().await?;
        let record = crate::resume::ResumeRecord::of_control_plane(&state);
        slot.send_replace(Some(Arc::new(state)));
        crate::resume::keep(record, &self.env.work_dir);
        (self.log)("serving as a control plane".into());
        Ok(())
    }

    /// Refuses a control plane whose own registry (on its opened state
    /// disk) revokes `own_ek`: a revocation stands when every control
    /// plane went down, and when the agent restarted. Refuses it too where
    /// that registry holds `own_ek` under another name or role than
    /// `identity` (its host renamed it: a recovery, which no peer checks,
    /// would serve the cluster under a name it never joined with).
    pub async fn refuse_revoked_or_renamed(
        &self,
        own_ek: &crate::disk_bindings::EkDigest,
        identity: &keel_verifier::config::NodeIdentity,
    ) -> Result<(), ProvisionError> {
        let path = self.env.root().join(paths::NODE_REGISTRY);
        let registry =
            tokio::task::spawn_blocking(move || crate::registry::Registry::on_disk(&path))
                .await
                .map_err(ProvisionError::Blocking)?
                .map_err(ProvisionError::Registry)?;
        if let Some(revocation) = registry.revocation(own_ek) {
            return Err(ProvisionError::Revoked(revocation.to_string()));
        }
        registry
            .check_own_identity(own_ek, &identity.name, identity.role.as_str())
            .map_err(ProvisionError::Renamed)
    }

    /// Refuses a control plane whose own image (PCRs 4, 9 and 11) `state`
    /// neither runs nor stages: a recovery has no peer whose join service
    /// checks the node's image, and would otherwise serve the cluster from
    /// an image the operator retired (an older epoch's).
    pub async fn refuse_unaccepted_image(
        &self,
        state: &ClusterState,
    ) -> Result<(), ProvisionError> {
        let own = crate::cluster::own_image(self.tpm)
            .await
            .map_err(ProvisionError::ImagePcrs)?;
        if state.accepts_image(&own) {
            Ok(())
        } else {
            Err(ProvisionError::ImageNotAccepted)
        }
    }

    /// A control plane's cluster state after a reboot: the facts on its
    /// (opened) state disk with the cluster's `keys`, which must derive the
    /// stored cluster ID, and its config's `measurements_key`. The version
    /// is the one the node's record names, which the boot installs: an
    /// upgrade that stopped between its record and the facts left the
    /// facts at the version before. Refused when the node has no route to
    /// take the address its API server advertises from.
    pub fn restore_control_plane(
        &self,
        keys: impl Into<Arc<KeyService>>,
        measurements_key: Option<keel_verifier::signature::SigningPublicKey>,
    ) -> Result<ClusterState, ProvisionError> {
        let advertise_address = self
            .env
            .advertise_address
            .resolve()
            .map_err(ProvisionError::NoAddress)?;
        let api_server =
            SocketAddr::new(advertise_address, crate::kubeadm::config::API_SERVER_PORT);
        let state = ControlPlaneFacts::load(self.env.root())
            .and_then(|facts| {
                facts.into_state(
                    keys.into(),
                    measurements_key,
                    api_server,
                    self.env.pki_dir(),
                )
            })
            .map_err(ProvisionError::Facts)?;
        // An unreadable record fails the reinstall that follows.
        match crate::upgrade::NodeVersion::load(self.env.root()) {
            Ok(Some(record))
                if record.version != state.kubernetes_version
                    || record.components != state.components =>
            {
                (self.log)(format!(
                    "the control-plane facts name Kubernetes {}, the node's record {}: \
                     serving {}",
                    state.kubernetes_version, record.version, record.version
                ));
                Ok(state.running(record.version, &record.components))
            }
            _ => Ok(state),
        }
    }

    /// The last step of a provisioning that set up a fresh disk: once
    /// everything before is on disk, the disk's header is labelled
    /// finished ([`crate::disk::StateDisk::finish`]). Until then a boot
    /// after a crash or power cut finds the set-up unfinished and resets
    /// the disk instead of rejoining with a node that never got its setup.
    /// From then on the disk is a member's: a later failure leaves it
    /// alone. Does nothing for a disk this boot did not set up, or twice.
    pub async fn finish(&self) -> Result<(), ProvisionError> {
        let Some(disk) = self.env.state_disk.clone() else {
            return Ok(());
        };
        if !self.formatted.load(Ordering::SeqCst) {
            return Ok(());
        }
        durable().await;
        tokio::task::spawn_blocking(move || disk.finish())
            .await
            .map_err(ProvisionError::Blocking)?
            .map_err(ProvisionError::Disk)?;
        self.formatted.store(false, Ordering::SeqCst);
        (self.log)("state disk set-up finished".into());
        Ok(())
    }

    /// After a fatal failure: marks a disk formatted in this boot for reset
    /// (an existing one keeps its data) and schedules the reboot, logging
    /// each consequence. Returns whether the node reboots.
    pub async fn fail(&self, error: &ProvisionError) -> bool {
        tracing::error!(error = %keel_atls::ErrorChain(error), "provisioning failed after the node lock");
        let reset = if self.formatted.load(Ordering::SeqCst) {
            self.env.state_disk.as_ref()
        } else {
            None
        };
        for line in reboot::reset_node(reset, self.env.reboot, Some(&self.env.work_dir)).await {
            (self.log)(line);
        }
        matches!(self.env.reboot, RebootPolicy::After(_))
    }

    async fn state_disk(&self, step: DiskStep) -> Result<(), ProvisionError> {
        let Some(disk) = self.env.state_disk.clone() else {
            (self.log)("no state disk configured; skipping disk encryption".into());
            return Ok(());
        };
        let device = disk.device.display().to_string();
        let memory = disk.mount.as_ref().map(|m| m.memory.display().to_string());
        let (what, mounted) = match step {
            DiskStep::SetUp { uuid, key } => {
                (self.log)(format!("setting up the state disk {device}"));
                let formatting = disk.clone();
                let key = Arc::new(key);
                let format_key = key.clone();
                tokio::task::spawn_blocking(move || formatting.format(&uuid, &format_key))
                    .await
                    .map_err(ProvisionError::Blocking)?
                    .map_err(ProvisionError::Disk)?;
                // Only a disk formatted here is reset after a failure: a
                // format that failed (the device in use, say, or not the
                // disk meant) leaves the device as it was.
                self.formatted.store(true, Ordering::SeqCst);
                let mounted = tokio::task::spawn_blocking(move || disk.fill(&key))
                    .await
                    .map_err(ProvisionError::Blocking)?
                    .map_err(ProvisionError::Disk)?;
                ("set up (LUKS2)", mounted)
            }
            DiskStep::Open { key } => {
                (self.log)(format!("opening the state disk {device}"));
                let mounted = tokio::task::spawn_blocking(move || disk.unlock(&key))
                    .await
                    .map_err(ProvisionError::Blocking)?
                    .map_err(ProvisionError::Disk)?;
                ("opened (LUKS2)", mounted)
            }
        };
        (self.log)(match mounted {
            Some(at) => format!(
                "state disk {what}, mounted at {}; components run from memory ({}, tmpfs)",
                at.display(),
                memory.unwrap_or_default()
            ),
            None => format!("state disk {what}; key verified, not mounted here"),
        });
        Ok(())
    }

    async fn install(
        &self,
        version: KubernetesVersion,
        components: &[Component],
    ) -> Result<(), ProvisionError> {
        (self.log)(format!(
            "installing {} components for Kubernetes {version}",
            components.len()
        ));
        let installer =
            Installer::new(self.env.installer.clone()).map_err(ProvisionError::Installer)?;
        let progress = crate::components::StreamedProgress::new(self.log);
        install_and_measure(&installer, self.tpm, components, &progress)
            .await
            .map_err(ProvisionError::Install)?;
        installer.keep_only_copies_of(components).await;
        // kubeadm requires the patches directory even when no component
        // put a patch there.
        let patches = self.env.patches_dir();
        std::fs::create_dir_all(&patches).map_err(|source| ProvisionError::CreateDir {
            path: patches,
            source,
        })?;
        let record = NodeVersion {
            version,
            components: components.to_vec(),
        };
        record
            .save(self.env.root())
            .map_err(ProvisionError::Record)?;
        Ok(())
    }

    /// After a reboot (rejoin, recovery): installs and measures again the
    /// components the node's version record on its opened state disk names,
    /// so PCR 13 shows what the node runs (files already in place with
    /// their hash are not fetched again). A disk without a record is
    /// refused ([`ProvisionError::NoRecord`]).
    pub async fn reinstall_recorded(&self) -> Result<(), ProvisionError> {
        let root = self.env.root();
        match NodeVersion::load(root).map_err(ProvisionError::Record)? {
            Some(record) => {
                (self.log)(format!("state disk records Kubernetes {}", record.version));
                let under = |path: &str| self.env.under_root(path.trim_start_matches('/'));
                let (disk, kept) = (under(paths::STATE_MOUNT), under(paths::KEPT_COMPONENTS));
                let components = record.components.clone();
                let taken = tokio::task::spawn_blocking(move || {
                    take_over_earlier_layout(&disk, &kept, &components)
                })
                .await
                .map_err(ProvisionError::Blocking)?;
                if taken {
                    (self.log)(
                        "the state disk had an earlier release's layout: its components became kept copies"
                            .into(),
                    );
                }
                let interrupted = match Switching::load(root) {
                    Ok(found) => found,
                    // Unreadable: the recorded version's own directories
                    // are emptied, never a directory the file names.
                    Err(e @ RecordError::InvalidSwitch(_)) => {
                        (self.log)(format!("{e}; emptying the recorded version's directories"));
                        Some(Switching {
                            directories: component_dirs(&record.components),
                        })
                    }
                    Err(e) => return Err(ProvisionError::Record(e)),
                };
                if let Some(switching) = &interrupted {
                    (self.log)(format!(
                        "an upgrade stopped while switching {}: installing Kubernetes {} into them afresh",
                        switching.directories.join(", "),
                        record.version
                    ));
                    self.warn_if_kubeadm_started(record.version);
                    clear_switched(root, &switching.directories)
                        .map_err(ProvisionError::Switched)?;
                }
                self.install(record.version, &record.components).await?;
                if interrupted.is_some() {
                    durable().await;
                    Switching::end(root).map_err(ProvisionError::Record)?;
                }
                Ok(())
            }
            // A member's disk always has one (a join or init installs
            // before the disk is finished): without it nothing would be
            // installed into memory, and the kubelet's unit, finding no
            // binary, would be skipped as if it had started.
            None => Err(ProvisionError::NoRecord),
        }
    }

    /// For a switch an upgrade left unfinished: if kubeadm was about to
    /// run to another version than the `recorded` one, says (at error
    /// level, and in the provisioning log) that it may have upgraded the
    /// node, as a failure after kubeadm does
    /// ([`crate::upgrade::UpgradeError::AfterKubeadm`]): installing the
    /// recorded version again undoes none of kubeadm's changes, and the
    /// record, naming the previous version, admits the same upgrade again.
    fn warn_if_kubeadm_started(&self, recorded: KubernetesVersion) {
        let line = match Switching::kubeadm_started(self.env.root()) {
            Ok(None) => return,
            // The record names the target already: the upgrade got past
            // kubeadm and recorded it; the node installs it.
            Ok(Some(target)) if target == recorded => return,
            Ok(Some(target)) => format!(
                "the upgrade had started kubeadm: kubeadm may have upgraded this node to \
                 Kubernetes {target} (its manifests and configuration stay so, while Kubernetes \
                 {recorded} is installed again); run the same upgrade again to finish it"
            ),
            Err(e) => format!(
                "the upgrade had started kubeadm ({}): kubeadm may have upgraded this node \
                 (its manifests and configuration stay so, while Kubernetes {recorded} is \
                 installed again); run the same upgrade again to finish it",
                keel_atls::ErrorChain(&e)
            ),
        };
        tracing::error!("{line}");
        (self.log)(line);
    }

    /// Writes a kubeadm configuration (it carries the bootstrap token) into
    /// the work directory.
    fn write_config(
        &self,
        name: &str,
        yaml: Result<Zeroizing<String>, ConfigError>,
    ) -> Result<TransientFile, ProvisionError> {
        let yaml = yaml.map_err(ProvisionError::KubeadmConfig)?;
        Ok(TransientFile::write(
            self.env.work_dir.join(name),
            yaml.as_bytes(),
        )?)
    }
}

/// Directories at the top of a state disk of an earlier release that held
/// components: `bin` (the single files) and its staged twin, `cni` and
/// `opt-kubernetes` (bound over `/opt/cni` and `/opt/kubernetes`), and
/// `archives` (the kept archives).
const EARLIER_COMPONENT_DIRS: [&str; 5] =
    ["bin", "bin.keel-next", "cni", "opt-kubernetes", "archives"];

/// Takes over a state disk (mounted at `disk`) of an earlier release: what
/// of its component directories `components` (the recorded version) names
/// is moved into `kept` as a kept copy, hashed when it is used like every
/// kept copy, so a node whose image is replaced needs no mirror to come
/// back; then those directories are removed, as nothing runs from the disk
/// now. A directory a move out of failed stays (logged): it may hold the
/// only copy. Moves only out of those directories themselves (never
/// through a symlink in their place, or a name with a `/`). Returns whether
/// the disk had any of them. Blocks.
fn take_over_earlier_layout(disk: &Path, kept: &Path, components: &[Component]) -> bool {
    let earlier: Vec<PathBuf> = EARLIER_COMPONENT_DIRS
        .iter()
        .map(|d| disk.join(d))
        .filter(|d| std::fs::symlink_metadata(d).is_ok_and(|m| m.is_dir()))
        .collect();
    if earlier.is_empty() {
        return false;
    }
    if let Err(e) = std::fs::create_dir_all(kept) {
        tracing::warn!(dir = %kept.display(), error = %e, "cannot make the kept components' directory; the earlier release's components stay");
        return true;
    }
    let bin = format!("{}/", paths::BIN_DIR);
    let mut stay: Vec<&Path> = Vec::new();
    for component in components {
        let Some(name) = keel_installer::kept_name(component) else {
            continue;
        };
        let to = kept.join(&name);
        if to.exists() {
            continue;
        }
        // An earlier release kept its archives under the same names.
        let candidates: Vec<PathBuf> = if component.extract() {
            vec![disk.join("archives").join(&name)]
        } else {
            match component.install_path().as_str().strip_prefix(&bin) {
                Some(file) if !file.contains('/') => {
                    vec![
                        disk.join("bin").join(file),
                        disk.join("bin.keel-next").join(file),
                    ]
                }
                _ => continue,
            }
        };
        let from = candidates.into_iter().find(|p| {
            p.parent()
                .is_some_and(|dir| earlier.iter().any(|e| e == dir))
                && std::fs::symlink_metadata(p).is_ok_and(|m| m.is_file())
        });
        let Some(from) = from else {
            continue;
        };
        if let Err(e) = std::fs::rename(&from, &to) {
            tracing::warn!(from = %from.display(), error = %e, "cannot keep an earlier release's component");
            if let Some(dir) = earlier.iter().find(|e| Some(e.as_path()) == from.parent()) {
                stay.push(dir);
            }
        }
    }
    for dir in &earlier {
        if stay.contains(&dir.as_path()) {
            tracing::warn!(dir = %dir.display(), "an earlier release's component directory stays: a component in it could not be kept");
        } else if let Err(e) = std::fs::remove_dir_all(dir) {
            tracing::warn!(dir = %dir.display(), error = %e, "cannot remove an earlier release's component directory");
        }
    }
    true
}

/// Flushes every file system: what kubeadm wrote (it does not sync its
/// kubeconfigs) and the agent's own changes reach the state disk before the
/// node reports them done, so a power loss right after loses nothing.
pub async fn durable() {
    if let Err(e) = tokio::task::spawn_blocking(rustix::fs::sync).await {
        tracing::warn!(error = %e, "flushing the file systems failed");
    }
}

async fn start_kubelet(how: &KubeletStart) -> Result<(), ProvisionError> {
    kubelet_service(how, "start").await
}

/// Restarts the kubelet (after its binary or configuration changed).
pub async fn restart_kubelet(how: &KubeletStart) -> Result<(), ProvisionError> {
    kubelet_service(how, "restart").await
}

/// `systemctl <verb> kubelet.service`, or the host tests' program.
async fn kubelet_service(how: &KubeletStart, verb: &str) -> Result<(), ProvisionError> {
    let mut command = match how {
        KubeletStart::Systemd => {
            let mut c = tokio::process::Command::new("systemctl");
            c.args([verb, "kubelet.service"]);
            c
        }
        KubeletStart::Program(program) => {
            let mut c = tokio::process::Command::new(program);
            c.arg("--version");
            c
        }
    };
    let status = tokio::time::timeout(KUBELET_START_TIMEOUT, command.kill_on_drop(true).status())
        .await
        .map_err(|_| ProvisionError::Kubelet("did not start within 60 s".into()))?
        .map_err(|e| ProvisionError::Kubelet(e.to_string()))?;
    if status.success() {
        Ok(())
    } else {
        Err(ProvisionError::Kubelet(format!("exited with {status}")))
    }
}
