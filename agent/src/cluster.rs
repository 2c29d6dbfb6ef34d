//! What a control-plane node holds once it belongs to a cluster: the keys,
//! the measurement salt and secret, and the Kubernetes setup that join
//! tickets hand out. Shared by the init server (which creates it) and the
//! join service (which serves it).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use keel_installer::{Component, KubernetesVersion, MeasuredComponent};
use keel_verifier::measurements::Measurements;
use keel_verifier::signature::{SignedMeasurements, SigningPublicKey};
use sha2::{Digest as _, Sha256};
use zeroize::Zeroizing;

use crate::paths;
use keel_verifier::keys::{self, ClusterId, KeyService};

/// A cluster this node is a control-plane member of.
#[derive(Clone)]
pub struct ClusterState {
    /// Derives every data key (disk keys, the measurement secret).
    pub keys: Arc<KeyService>,
    /// Salt of the cluster ID derivation.
    pub measurement_salt: Vec<u8>,
    /// The measurement secret (HKDF input of the cluster ID).
    pub measurement_secret: Zeroizing<Vec<u8>>,
    /// The cluster ID, extended into PCR 15 of every member.
    pub cluster_id: ClusterId,
    /// The Kubernetes version the cluster runs, that of `components`
    /// (after an image upgrade, not necessarily the patch this image's
    /// versions table pins).
    pub kubernetes_version: KubernetesVersion,
    /// The components every node installs.
    pub components: Vec<Component>,
    /// Components of other versions the operator authorised: the versions
    /// the cluster ran before an upgrade, and the target of one under way.
    /// A member's PCR 13 may show these too.
    pub authorised_components: Vec<Component>,
    /// The Kubernetes API server endpoint.
    pub api_server: SocketAddr,
    /// Directory of the cluster PKI (`etc/kubernetes/pki` under the node root).
    pub pki_dir: PathBuf,
    /// The measurements joining nodes are checked against, as sent by the
    /// operator's CLI in the init request (or received in a control-plane
    /// ticket).
    pub join_measurements: Measurements,
    /// The measurements of a new image, accepted next to
    /// `join_measurements` while it rolls out (staged by the operator).
    pub staged_measurements: Option<Measurements>,
    /// The key every image's measurements file must be signed with, from
    /// the measured node config (`None`: image upgrades are refused).
    pub measurements_key: Option<SigningPublicKey>,
    /// The signed measurements files of the accepted sets (oldest first,
    /// at most [`MAX_SIGNED_MEASUREMENTS`]): a control plane presents the
    /// one that describes its own image, so joining nodes of another
    /// image accept it.
    pub signed_measurements: Vec<SignedMeasurements>,
    /// The image rollback floor: the highest epoch of a signed file whose
    /// set became current here (at init, set by the operator, or finished
    /// after staging), or received in a control-plane ticket. No signed
    /// file below it is staged or made current (0: every file is taken).
    pub image_epoch: u64,
    /// Join endpoints (`host:port`) of the cluster's control planes, as
    /// this node knows them; tickets pass them on.
    pub control_plane_endpoints: Vec<String>,
}

impl ClusterState {
    /// Whether a member may run what `measured` records: a component of
    /// the current version, or of another version the operator authorised,
    /// with its hash at its install path.
    pub fn authorises(&self, measured: &MeasuredComponent) -> bool {
        self.components
            .iter()
            .chain(&self.authorised_components)
            .any(|c| measured.records(c))
    }

    /// The same state, also authorising `components` (a version being
    /// rolled out, or one the cluster ran before), each listed once, as
    /// the newest (a component several versions share moves up with each);
    /// past [`MAX_AUTHORISED_COMPONENTS`] or [`MAX_AUTHORISED_BYTES`] the
    /// oldest authorisations go (a member still running those would have
    /// gone through dozens of upgrades without a reboot).
    pub fn authorising(&self, components: &[Component]) -> Self {
        let mut updated = self.clone();
        for c in components {
            updated.authorised_components.retain(|a| a != c);
            updated.authorised_components.push(c.clone());
        }
        let mut bytes: usize = updated
            .authorised_components
            .iter()
            .map(authorised_bytes)
            .sum();
        let over_bytes = updated
            .authorised_components
            .iter()
            .take_while(|c| {
                let over = bytes > MAX_AUTHORISED_BYTES;
                bytes -= authorised_bytes(c);
                over
            })
            .count();
        let excess = updated
            .authorised_components
            .len()
            .saturating_sub(MAX_AUTHORISED_COMPONENTS)
            .max(over_bytes);
        if excess > 0 {
            tracing::warn!(
                dropped = excess,
                "the oldest authorised components are no longer authorised"
            );
            updated.authorised_components.drain(..excess);
        }
        updated
    }

    /// The same state running `version` with `components` (an upgrade or a
    /// rollback moved the node): the components it ran stay authorised, as
    /// members show them in PCR 13 until they reboot.
    pub fn running(&self, version: KubernetesVersion, components: &[Component]) -> Self {
        let mut updated = self.authorising(&self.components);
        updated.kubernetes_version = version;
        updated.components = components.to_vec();
        updated
    }

    /// The same state also holding `signed` (a file the operator signed),
    /// one file per set of measurements (a newer signature of a set
    /// replaces the older), the oldest dropped past
    /// [`MAX_SIGNED_MEASUREMENTS`].
    pub fn with_signed(&self, signed: SignedMeasurements) -> Self {
        let mut updated = self.clone();
        updated
            .signed_measurements
            .retain(|s| s.measurements() != signed.measurements());
        updated.signed_measurements.push(signed);
        let excess = updated
            .signed_measurements
            .len()
            .saturating_sub(MAX_SIGNED_MEASUREMENTS);
        updated.signed_measurements.drain(..excess);
        updated
    }

    /// The same state without the signed files of sets it no longer
    /// accepts (neither the current measurements nor the staged ones): a
    /// control plane of a retired image is not one joining nodes should
    /// accept.
    pub fn without_retired_signed(mut self) -> Self {
        let (current, staged) = (&self.join_measurements, &self.staged_measurements);
        self.signed_measurements
            .retain(|s| s.measurements() == current || staged.as_ref() == Some(s.measurements()));
        self
    }

    /// The signed file, of those held, that describes the image whose PCRs
    /// are `own` (its PCRs 4, 9 and 11): what this control plane presents.
    pub fn own_image(
        &self,
        own: &std::collections::BTreeMap<u32, [u8; 32]>,
    ) -> Option<&SignedMeasurements> {
        self.signed_measurements
            .iter()
            .rev()
            .find(|s| s.describes(&IMAGE_PCRS, own))
    }

    /// Whether the image whose PCRs are `own` (its PCRs 4, 9 and 11) is
    /// the current or the staged one.
    pub fn accepts_image(&self, own: &std::collections::BTreeMap<u32, [u8; 32]>) -> bool {
        self.join_measurements.describes(&IMAGE_PCRS, own)
            || self
                .staged_measurements
                .as_ref()
                .is_some_and(|staged| staged.describes(&IMAGE_PCRS, own))
    }

    /// The epoch of the signed file held for `set` (0: none held, as
    /// without a measurements signing key).
    pub fn epoch_of(&self, set: &Measurements) -> u64 {
        self.signed_measurements
            .iter()
            .rev()
            .find(|s| s.measurements() == set)
            .map_or(0, SignedMeasurements::epoch)
    }

    /// The same state with its image rollback floor at least `floor` and
    /// at least the current set's own epoch (that image was made current):
    /// how init, a control-plane ticket and the facts set it.
    pub fn with_floor(mut self, floor: u64) -> Self {
        self.image_epoch = floor
            .max(self.image_epoch)
            .max(self.epoch_of(&self.join_measurements));
        self
    }

    /// The images this state accepts and its rollback floor, as a control
    /// plane's tickets carry them.
    pub fn image_state(&self) -> ImageState {
        ImageState {
            join: self.join_measurements.clone(),
            staged: self.staged_measurements.clone(),
            signed: self.signed_measurements.clone(),
            floor: self.image_epoch,
        }
    }

    /// The same state with the images of `issuer` (a control plane's
    /// rejoin ticket) where the issuer's floor is above this state's: the
    /// state disk held an older image state (the host wrote an earlier
    /// copy back, or this control plane was down while an image rollout
    /// finished), and with it this control plane would admit an image the
    /// cluster retired. A floor at or below this one changes nothing, so
    /// an issuer with an older state cannot take this one back. Returns
    /// whether the issuer's images were taken.
    pub fn with_newer_image(self, issuer: ImageState) -> (Self, bool) {
        if issuer.floor <= self.image_epoch {
            return (self, false);
        }
        let mut updated = self.with_measurements(issuer.join, issuer.staged);
        updated.signed_measurements = issuer.signed;
        (updated.with_floor(issuer.floor), true)
    }

    /// The same state with other accepted measurements: `join_measurements`
    /// and, during an image rollout, `staged_measurements`.
    pub fn with_measurements(
        &self,
        join_measurements: Measurements,
        staged_measurements: Option<Measurements>,
    ) -> Self {
        Self {
            join_measurements,
            staged_measurements,
            ..self.clone()
        }
    }
}

/// The images a control plane's join services accept and its image
/// rollback floor ([`ClusterState::image_state`]).
#[derive(Clone, Debug)]
pub struct ImageState {
    /// The current measurements.
    pub join: Measurements,
    /// A new image's measurements during its rollout.
    pub staged: Option<Measurements>,
    /// The signed measurements files of the accepted sets, checked with
    /// the node config's key.
    pub signed: Vec<SignedMeasurements>,
    /// The rollback floor ([`ClusterState::image_epoch`]).
    pub floor: u64,
}

impl std::fmt::Debug for ClusterState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterState")
            .field("cluster_id", &hex::encode(self.cluster_id))
            .field("kubernetes_version", &self.kubernetes_version.to_string())
            .field("api_server", &self.api_server)
            .finish_non_exhaustive()
    }
}

/// Most signed measurements files a control plane keeps: the current and
/// the staged image's, and the ones before them.
pub const MAX_SIGNED_MEASUREMENTS: usize = 4;

/// Most components of other versions a cluster state authorises (a
/// version is 6-10 components; the ticket of a joining control plane
/// carries them all).
pub const MAX_AUTHORISED_COMPONENTS: usize = 512;
/// Most bytes the authorised components may take (their URLs, an inline
/// one's data included, hashes and paths): they are in the facts and in
/// every control-plane ticket, both bounded in size, and an upgrade plan
/// brings at most 128 KiB of them.
pub const MAX_AUTHORISED_BYTES: usize = 256 * 1024;

/// What `c` adds to the authorised components' size: its URL, its path
/// and its hash (`sha256:` and 64 hex digits).
fn authorised_bytes(c: &Component) -> usize {
    c.url().len() + c.install_path().as_str().len() + 7 + 64
}

/// The PCRs that tell one image from another: the UKI, the kernel command
/// line and initrd, the UKI's sections.
pub const IMAGE_PCRS: [u32; 3] = [4, 9, 11];

/// The image PCRs ([`IMAGE_PCRS`]) of the TPM `measured`.
fn image_pcrs(
    measured: &mut crate::measured::MeasuredTpm,
) -> Result<std::collections::BTreeMap<u32, [u8; 32]>, String> {
    measured
        .tpm()
        .pcr_read(&IMAGE_PCRS)
        .map_err(|e| keel_atls::ErrorChain(&e).to_string())
}

/// This node's image: the PCRs 4, 9 and 11 of its TPM.
pub async fn own_image(
    tpm: &crate::measured::SharedTpm,
) -> Result<std::collections::BTreeMap<u32, [u8; 32]>, String> {
    let tpm = tpm.clone();
    tokio::task::spawn_blocking(move || {
        let mut measured = tpm
            .lock()
            .map_err(|_| "the TPM handle is poisoned".to_owned())?;
        image_pcrs(&mut measured)
    })
    .await
    .map_err(|e| e.to_string())?
}

/// Where the cluster state appears once the node has one.
pub type ClusterSlot = tokio::sync::watch::Sender<Option<Arc<ClusterState>>>;

/// Changes the cluster state in `slot` with `update`, one change at a time
/// (a lock of the changes is held throughout, so two changes never start
/// from the same state): `update` sees the state in force and returns the
/// new one, or refuses; the new state's facts go on the state disk under
/// `root` before anything reading `slot` sees it. Readers are not held up
/// by the disk: they see the state in force until the new one is saved.
/// `Ok(None)` where the node has no cluster state (it is not a control
/// plane); nothing changes on an error. Every change of a state in the
/// slot goes through here; only the first state is put there directly.
pub fn change_state<E: From<FactsError>>(
    slot: &ClusterSlot,
    root: &Path,
    update: impl FnOnce(&ClusterState) -> Result<ClusterState, E>,
) -> Result<Option<Arc<ClusterState>>, E> {
    change_state_then(slot, root, update, |_| Ok(()))
}

/// [`change_state`], and then, under the same turn and once the facts
/// are saved, `then` over the new state (a file derived from it). If
/// `then` fails, the new state stays (it is on the disk) and its error is
/// returned: what `then` writes may lag the facts until the change is
/// made again, never lead them.
pub fn change_state_then<E: From<FactsError>>(
    slot: &ClusterSlot,
    root: &Path,
    update: impl FnOnce(&ClusterState) -> Result<ClusterState, E>,
    then: impl FnOnce(&ClusterState) -> Result<(), E>,
) -> Result<Option<Arc<ClusterState>>, E> {
    static CHANGES: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _turn = CHANGES
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let Some(state) = slot.borrow().clone() else {
        return Ok(None);
    };
    let updated = Arc::new(update(&state)?);
    ControlPlaneFacts::of(&updated).save(root)?;
    slot.send_replace(Some(updated.clone()));
    then(&updated)?;
    Ok(Some(updated))
}

/// Keeps this control plane's attestation documents presenting the signed
/// measurements of its own image ([`ClusterState::own_image`]) as its
/// cluster state changes, so joining nodes of another image accept it.
/// Runs until `slot` is dropped.
pub async fn present_own_image(slot: &ClusterSlot, tpm: crate::measured::SharedTpm) {
    let mut states = slot.subscribe();
    loop {
        let state = states.borrow_and_update().clone();
        if let Some(state) = state {
            let tpm = tpm.clone();
            let presented = tokio::task::spawn_blocking(move || {
                let mut measured = tpm
                    .lock()
                    .map_err(|_| "the TPM handle is poisoned".to_owned())?;
                let own = image_pcrs(&mut measured)?;
                let image = state.own_image(&own).map(SignedMeasurements::to_proto);
                let digest = image
                    .as_ref()
                    .map(|i| hex::encode(Sha256::digest(&i.measurements)));
                measured.present_image(image);
                Ok::<_, String>(digest)
            })
            .await;
            match presented {
                Ok(Ok(Some(digest))) => {
                    tracing::info!(file_sha256 = %digest, "presenting the signed measurements of this node's image")
                }
                Ok(Ok(None)) => {
                    tracing::debug!("no signed measurements describe this node's image")
                }
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, "cannot present this node's signed image measurements")
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot present this node's signed image measurements")
                }
            }
        }
        if states.changed().await.is_err() {
            return;
        }
    }
}

/// What a control plane keeps on its state disk about its cluster, so that
/// after a reboot (rejoin or recovery) it can serve joins again with only
/// the master secret from outside. Nothing secret: the cluster ID is public
/// (PCR 15), the rest is what every join ticket carries.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ControlPlaneFacts {
    /// The cluster ID (hex).
    pub cluster_id: String,
    /// The measurement salt (hex).
    pub measurement_salt: String,
    /// The Kubernetes version the cluster runs (`vX.Y.Z`).
    pub kubernetes_version: String,
    /// The components every node installs.
    pub components: Vec<Component>,
    /// Components of other authorised versions.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub authorised_components: Vec<Component>,
    /// The measurements joining nodes are checked against (JSON document).
    pub join_measurements: serde_json::Value,
    /// The measurements of a new image also accepted while it rolls out
    /// (JSON document).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub staged_measurements: Option<serde_json::Value>,
    /// The signed measurements files of the accepted sets (the key is the
    /// node config's).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub signed_measurements: Vec<SignedFile>,
    /// The image rollback floor ([`ClusterState::image_epoch`]; absent: 0).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub image_epoch: u64,
    /// Join endpoints of the cluster's control planes.
    pub control_plane_endpoints: Vec<String>,
}

/// A signed measurements file as the facts keep it.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SignedFile {
    /// The file (UTF-8 JSON, kept byte for byte).
    pub measurements: String,
    /// The signature (hex DER).
    pub signature: String,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

fn measurements_json(m: &Measurements) -> serde_json::Value {
    serde_json::from_str(&m.to_json()).unwrap_or(serde_json::Value::Null)
}

/// Largest facts file read.
const MAX_FACTS_BYTES: u64 = 4 * 1024 * 1024;

/// Why the control-plane facts could not be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FactsError {
    /// Reading or writing the file failed.
    #[error("control-plane facts {path:?}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// Writing the file failed.
    #[error("writing the control-plane facts")]
    Write(#[from] crate::files::WriteFileError),
    /// The file does not parse or a field is invalid.
    #[error("the control-plane facts are invalid: {0}")]
    Invalid(String),
    /// The facts would be larger than a control plane reads back: the
    /// change is not made.
    #[error(
        "the control-plane facts would take {0} bytes, more than the 4 MiB a control plane \
         reads back; nothing changed"
    )]
    TooLarge(usize),
    /// The facts belong to another cluster than the secrets.
    #[error("the control-plane facts are of cluster {stored}, the secrets derive {derived}")]
    OtherCluster {
        /// The stored cluster ID (hex).
        stored: String,
        /// The cluster ID the secrets derive (hex).
        derived: String,
    },
}

impl ControlPlaneFacts {
    /// The facts of `state`.
    pub fn of(state: &ClusterState) -> Self {
        Self {
            cluster_id: hex::encode(state.cluster_id),
            measurement_salt: hex::encode(&state.measurement_salt),
            kubernetes_version: state.kubernetes_version.to_string(),
            components: state.components.clone(),
            authorised_components: state.authorised_components.clone(),
            join_measurements: measurements_json(&state.join_measurements),
            staged_measurements: state.staged_measurements.as_ref().map(measurements_json),
            signed_measurements: state
                .signed_measurements
                .iter()
                .map(|s| SignedFile {
                    measurements: String::from_utf8_lossy(s.body()).into_owned(),
                    signature: hex::encode(s.signature()),
                })
                .collect(),
            image_epoch: state.image_epoch,
            control_plane_endpoints: state.control_plane_endpoints.clone(),
        }
    }

    /// Writes the facts under the node root (mode 0600, atomically).
    pub fn save(&self, root: &Path) -> Result<(), FactsError> {
        let json =
            serde_json::to_vec_pretty(self).map_err(|e| FactsError::Invalid(e.to_string()))?;
        // Never a file [`load`](Self::load) refuses: the control plane
        // could not restore its cluster after a reboot.
        if json.len() as u64 > MAX_FACTS_BYTES {
            return Err(FactsError::TooLarge(json.len()));
        }
        crate::files::write_private(&root.join(paths::CONTROL_PLANE_FACTS), &json)?;
        Ok(())
    }

    /// Reads the facts from under the node root.
    pub fn load(root: &Path) -> Result<Self, FactsError> {
        use std::io::Read as _;
        let path = root.join(paths::CONTROL_PLANE_FACTS);
        let io = |source| FactsError::Io {
            path: path.clone(),
            source,
        };
        let mut bytes = Vec::new();
        std::fs::File::open(&path)
            .map_err(io)?
            .take(MAX_FACTS_BYTES + 1)
            .read_to_end(&mut bytes)
            .map_err(io)?;
        if bytes.len() as u64 > MAX_FACTS_BYTES {
            return Err(FactsError::Invalid("larger than 4 MiB".into()));
        }
        serde_json::from_slice(&bytes).map_err(|e| FactsError::Invalid(e.to_string()))
    }

    /// The cluster state these facts describe, with the control plane's
    /// `keys` and its config's `measurements_key`; the cluster ID the keys
    /// derive must be the stored one, and every signed file must verify
    /// with the key (the facts are on the encrypted state disk, checked
    /// all the same).
    pub fn into_state(
        self,
        keys: Arc<KeyService>,
        measurements_key: Option<SigningPublicKey>,
        api_server: SocketAddr,
        pki_dir: PathBuf,
    ) -> Result<ClusterState, FactsError> {
        let invalid = |what: &str| FactsError::Invalid(what.to_owned());
        let measurement_salt =
            hex::decode(&self.measurement_salt).map_err(|_| invalid("measurement salt"))?;
        let measurement_secret = keys
            .measurement_secret()
            .map_err(|_| invalid("measurement secret"))?;
        let cluster_id = keys::cluster_id(&measurement_secret, &measurement_salt)
            .map_err(|_| invalid("measurement salt"))?;
        if hex::encode(cluster_id) != self.cluster_id {
            return Err(FactsError::OtherCluster {
                stored: self.cluster_id,
                derived: hex::encode(cluster_id),
            });
        }
        // The version the cluster runs, with the components the facts
        // carry: not looked up in this image's versions table, which may
        // pin another patch of the minor since an image upgrade.
        let version: KubernetesVersion = self
            .kubernetes_version
            .parse()
            .map_err(|_| invalid("Kubernetes version"))?;
        let join_measurements = Measurements::parse(self.join_measurements.to_string().as_bytes())
            .map_err(|_| invalid("join measurements"))?;
        let staged_measurements = self
            .staged_measurements
            .map(|m| Measurements::parse(m.to_string().as_bytes()))
            .transpose()
            .map_err(|_| invalid("staged measurements"))?;
        let signed_measurements = match &measurements_key {
            Some(key) => self
                .signed_measurements
                .iter()
                .map(|f| {
                    let signature =
                        hex::decode(&f.signature).map_err(|_| invalid("signed measurements"))?;
                    SignedMeasurements::verify(key, f.measurements.as_bytes(), &signature)
                        .map_err(|_| invalid("signed measurements"))
                })
                .collect::<Result<Vec<_>, _>>()?,
            None => Vec::new(),
        };
        Ok(ClusterState {
            keys,
            measurement_salt,
            measurement_secret,
            cluster_id,
            kubernetes_version: version,
            components: self.components,
            authorised_components: self.authorised_components,
            api_server,
            pki_dir,
            join_measurements,
            staged_measurements,
            measurements_key,
            signed_measurements,
            image_epoch: 0,
            control_plane_endpoints: self.control_plane_endpoints,
        }
        .with_floor(self.image_epoch))
    }
}
