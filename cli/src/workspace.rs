//! The operator's workspace: the files `keel init` writes and `keel recover`
//! and `keel push-measurements` read back, in one format.

use std::path::Path;

use anyhow::Context as _;
use serde::{Deserialize, Serialize};
use zeroize::Zeroizing;

use crate::settings::read_bounded;

/// The file the master secret goes to, before anything is sent.
pub const MASTER_SECRET_FILE: &str = "keel-master-secret.json";
/// The admin kubeconfig.
pub const KUBECONFIG_FILE: &str = "keel-admin.conf";
/// The cluster ID and the node's attested PCRs.
pub const ID_FILE: &str = "keel-id.json";
/// The node's logs after a failed init.
pub const FAILURE_LOG_FILE: &str = "keel-init-failure.log";
/// The image measurements the last `keel upgrade finish` made the only
/// accepted ones.
pub const IMAGE_FILE: &str = "keel-image.json";

/// [`MASTER_SECRET_FILE`] as stored: hex fields.
#[derive(Serialize, Deserialize)]
pub struct MasterSecretFile {
    /// Hex, 32 bytes.
    pub key: String,
    /// Hex, 32 bytes.
    pub salt: String,
    /// Hex, 32 bytes.
    pub measurement_salt: String,
}

/// [`ID_FILE`].
#[derive(Serialize, Deserialize)]
pub struct IdFile {
    /// The cluster ID (hex).
    pub cluster_id: String,
    /// The node `keel init` ran against.
    pub endpoint: String,
}

/// The master secret and its salts, decoded; the secret is wiped when
/// dropped.
pub struct MasterSecret {
    /// The master secret.
    pub key: Zeroizing<Vec<u8>>,
    /// The master salt.
    pub salt: Vec<u8>,
    /// The measurement salt.
    pub measurement_salt: Vec<u8>,
}

impl MasterSecret {
    /// Reads [`MASTER_SECRET_FILE`] from `workspace`.
    pub fn load(workspace: &Path) -> anyhow::Result<Self> {
        let path = workspace.join(MASTER_SECRET_FILE);
        let bytes = Zeroizing::new(
            read_bounded(&path)
                .with_context(|| format!("reading the master secret {}", path.display()))?,
        );
        let MasterSecretFile {
            key,
            salt,
            measurement_salt,
        } = serde_json::from_slice(&bytes)
            .with_context(|| format!("{} is not a master secret file", path.display()))?;
        let key = Zeroizing::new(key);
        let hex_field = |value: &str, name: &str| {
            hex::decode(value).with_context(|| format!("{}: {name} is not hex", path.display()))
        };
        Ok(Self {
            key: Zeroizing::new(hex_field(&key, "key")?),
            salt: hex_field(&salt, "salt")?,
            measurement_salt: hex_field(&measurement_salt, "measurement_salt")?,
        })
    }
}

/// Reads the cluster ID from [`ID_FILE`] in `workspace`.
pub fn cluster_id(workspace: &Path) -> anyhow::Result<Vec<u8>> {
    let path = workspace.join(ID_FILE);
    let id: IdFile = serde_json::from_slice(&read_bounded(&path)?)
        .with_context(|| format!("{} is not a cluster ID file", path.display()))?;
    hex::decode(&id.cluster_id).context("the cluster ID is not hex")
}

/// [`IMAGE_FILE`]: the set of measurements the cluster's control planes
/// accept alone since the last finished image rollout.
#[derive(Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct FinishedImage {
    /// SHA-256 of the set's canonical JSON (hex), as `keel upgrade
    /// finish` printed it.
    pub digest: String,
    /// The finished file's rollback epoch.
    pub epoch: u64,
}

impl FinishedImage {
    /// Writes the record to `workspace` (atomically).
    pub fn save(&self, workspace: &Path) -> anyhow::Result<()> {
        let body = serde_json::to_vec_pretty(self).context("encoding the image record")?;
        crate::init::write_atomic(&workspace.join(IMAGE_FILE), &body, 0o644)
    }

    /// The record in `workspace`; `None` where no image rollout was
    /// finished from it.
    pub fn load(workspace: &Path) -> anyhow::Result<Option<Self>> {
        let path = workspace.join(IMAGE_FILE);
        let body = match read_bounded(&path) {
            Ok(body) => body,
            Err(e)
                if e.downcast_ref::<std::io::Error>()
                    .is_some_and(|e| e.kind() == std::io::ErrorKind::NotFound) =>
            {
                return Ok(None)
            }
            Err(e) => return Err(e),
        };
        serde_json::from_slice(&body)
            .map(Some)
            .with_context(|| format!("{} is not an image record", path.display()))
    }

    /// Refuses `measurements` (the set the operator's settings name) unless
    /// it is the finished one: a node of a retired image is never sent the
    /// master secret because the settings still name its measurements.
    pub fn require(
        &self,
        measurements: &keel_verifier::measurements::Measurements,
    ) -> anyhow::Result<()> {
        let named = hex::encode(measurements.digest());
        if named != self.digest {
            anyhow::bail!(
                "the settings' measurements (sha256:{named}) are not the image this cluster \
                 accepts since the last `keel upgrade finish` (sha256:{}, epoch {}): point \
                 `measurements` in the settings at that image's file",
                self.digest,
                self.epoch
            );
        }
        Ok(())
    }
}
