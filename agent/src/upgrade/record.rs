//! The Kubernetes version a node runs, kept on its state disk.
//!
//! Written whenever components are installed (init, join, an upgrade), read
//! by an upgrade (the version it starts from) and after a reboot (the node
//! installs and measures the same components again, so PCR 13 shows what it
//! runs). Nothing secret: every join ticket carries the same facts.

use std::path::{Path, PathBuf};

use keel_installer::{Component, KubernetesVersion};

use crate::files::{remove_durably, write_private, WriteFileError};
use crate::paths;

/// Largest record read.
const MAX_RECORD_BYTES: u64 = 1024 * 1024;

/// The version a node runs and the components it installed for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeVersion {
    /// The Kubernetes version, that of `components`.
    pub version: KubernetesVersion,
    /// The components, in install order.
    pub components: Vec<Component>,
}

#[derive(serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Stored {
    kubernetes_version: String,
    components: Vec<Component>,
}

/// Why the record could not be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RecordError {
    /// Reading the file failed.
    #[error("reading {path:?}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The file does not parse.
    #[error("the node's version record is invalid: {0}")]
    Invalid(String),
    /// Writing the file failed.
    #[error("writing the node's version record")]
    Write(#[from] WriteFileError),
    /// The upgrade's switch record does not parse or names a directory no
    /// switch may touch.
    #[error("the upgrade switch record (upgrade-switching.json) is invalid: {0}")]
    InvalidSwitch(String),
    /// Writing the upgrade's switch record failed.
    #[error("writing the upgrade switch record")]
    WriteSwitch(#[source] WriteFileError),
    /// The mark that kubeadm was starting (beside the switch record) does
    /// not parse.
    #[error("the upgrade's kubeadm mark (upgrade-kubeadm.json) is invalid: {0}")]
    InvalidKubeadmMark(String),
    /// Writing the mark that kubeadm is starting failed.
    #[error("writing the upgrade's kubeadm mark")]
    WriteKubeadmMark(#[source] WriteFileError),
    /// Removing the upgrade's switch record failed.
    #[error("removing the upgrade switch record {path:?}")]
    RemoveSwitch {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

impl NodeVersion {
    /// The record under the node `root`; `None` where there is none (a
    /// node without a state disk, or one provisioned before records).
    pub fn load(root: &Path) -> Result<Option<Self>, RecordError> {
        let Some(bytes) = read_bounded(&root.join(paths::NODE_VERSION))? else {
            return Ok(None);
        };
        let stored: Stored =
            serde_json::from_slice(&bytes).map_err(|e| RecordError::Invalid(e.to_string()))?;
        let version = stored
            .kubernetes_version
            .parse()
            .map_err(|_| RecordError::Invalid("kubernetes_version".into()))?;
        Ok(Some(Self {
            version,
            components: stored.components,
        }))
    }

    /// Writes the record under the node `root` (mode 0600, atomically).
    pub fn save(&self, root: &Path) -> Result<(), RecordError> {
        let stored = Stored {
            kubernetes_version: self.version.to_string(),
            components: self.components.clone(),
        };
        let json =
            serde_json::to_vec_pretty(&stored).map_err(|e| RecordError::Invalid(e.to_string()))?;
        write_private(&root.join(paths::NODE_VERSION), &json)?;
        Ok(())
    }
}

/// The bytes of the record at `path`, `None` if there is none; at most
/// [`MAX_RECORD_BYTES`].
fn read_bounded(path: &Path) -> Result<Option<Vec<u8>>, RecordError> {
    use std::io::Read as _;
    let read = |source| RecordError::Read {
        path: path.to_owned(),
        source,
    };
    let file = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(read(e)),
    };
    let mut bytes = Vec::new();
    file.take(MAX_RECORD_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(read)?;
    if bytes.len() as u64 > MAX_RECORD_BYTES {
        return Err(RecordError::Invalid("larger than 1 MiB".into()));
    }
    Ok(Some(bytes))
}

/// The component directories an upgrade switches, recorded on the state
/// disk just before the switch and removed once the version record names
/// what they hold (or they were switched back). Found after a reboot, it
/// says the node stopped in between: the directories may hold the new
/// version while the record names the old one, and reinstalling the old
/// one file by file would leave the new version's other files (an
/// archive's) in place, unmeasured. They are emptied and installed again
/// from the record instead.
///
/// Just before kubeadm runs, the target version is marked beside the
/// record ([`Switching::kubeadm_starts`]): found after a reboot, that mark
/// says kubeadm may have upgraded the node's manifests and configuration,
/// which installing the recorded version again does not undo. The mark is
/// a file of its own so that the record stays what earlier agents read
/// (they refuse a field they do not know, and an image may be rolled
/// back): an earlier agent ignores the mark and settles the switch as it
/// always did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Switching {
    /// The directories, as install paths name them (`/run/state/bin`).
    pub directories: Vec<String>,
}

#[derive(serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct StoredSwitching {
    directories: Vec<String>,
}

/// The mark that kubeadm is starting. Unknown fields are allowed: a later
/// agent may add some, and the version is all this one needs.
#[derive(serde::Serialize, serde::Deserialize)]
struct StoredKubeadmMark {
    kubernetes_version: String,
}

impl Switching {
    /// Records, durably, that `directories` are being switched. A kubeadm
    /// mark left by an earlier switch (an earlier agent settled it, and
    /// removed only the record) goes first: it is not this switch's.
    pub fn begin(root: &Path, directories: Vec<String>) -> Result<(), RecordError> {
        let mark = root.join(paths::UPGRADE_KUBEADM);
        remove_durably(&mark).map_err(|source| RecordError::RemoveSwitch { path: mark, source })?;
        let json = serde_json::to_vec(&StoredSwitching { directories })
            .map_err(|e| RecordError::InvalidSwitch(e.to_string()))?;
        write_private(&root.join(paths::UPGRADE_SWITCHING), &json).map_err(RecordError::WriteSwitch)
    }

    /// The switch a node stopped in, if any. Every directory must be one
    /// a switch may touch ([`super::staging::switchable`]).
    pub fn load(root: &Path) -> Result<Option<Self>, RecordError> {
        let path = root.join(paths::UPGRADE_SWITCHING);
        let Some(bytes) = read_bounded(&path)? else {
            return Ok(None);
        };
        let stored: StoredSwitching = serde_json::from_slice(&bytes)
            .map_err(|e| RecordError::InvalidSwitch(e.to_string()))?;
        if let Some(dir) = stored
            .directories
            .iter()
            .find(|d| !super::staging::switchable(d))
        {
            return Err(RecordError::InvalidSwitch(format!(
                "it names {dir:?}, which is no component directory"
            )));
        }
        Ok(Some(Self {
            directories: stored.directories,
        }))
    }

    /// Records, durably, that kubeadm is about to upgrade the node to
    /// `version`, in the switch [`begin`](Self::begin) recorded.
    pub fn kubeadm_starts(root: &Path, version: KubernetesVersion) -> Result<(), RecordError> {
        let json = serde_json::to_vec(&StoredKubeadmMark {
            kubernetes_version: version.to_string(),
        })
        .map_err(|e| RecordError::InvalidKubeadmMark(e.to_string()))?;
        write_private(&root.join(paths::UPGRADE_KUBEADM), &json)
            .map_err(RecordError::WriteKubeadmMark)
    }

    /// The version kubeadm was about to upgrade the node to
    /// ([`kubeadm_starts`](Self::kubeadm_starts)), if the switch got that
    /// far. Meaningful only beside a switch record: the mark goes before
    /// it ([`end`](Self::end)).
    pub fn kubeadm_started(root: &Path) -> Result<Option<KubernetesVersion>, RecordError> {
        let Some(bytes) = read_bounded(&root.join(paths::UPGRADE_KUBEADM))? else {
            return Ok(None);
        };
        let stored: StoredKubeadmMark = serde_json::from_slice(&bytes)
            .map_err(|e| RecordError::InvalidKubeadmMark(e.to_string()))?;
        stored
            .kubernetes_version
            .parse()
            .map(Some)
            .map_err(|_| RecordError::InvalidKubeadmMark("kubernetes_version".into()))
    }

    /// Removes the record, durably: the directories hold what the version
    /// record names. The kubeadm mark goes first, so none is left that the
    /// next switch could be taken for.
    pub fn end(root: &Path) -> Result<(), RecordError> {
        for file in [paths::UPGRADE_KUBEADM, paths::UPGRADE_SWITCHING] {
            let path = root.join(file);
            remove_durably(&path).map_err(|source| RecordError::RemoveSwitch { path, source })?;
        }
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_record_round_trips_and_a_bad_one_is_refused() {
        let root = tempfile::tempdir().unwrap();
        assert_eq!(NodeVersion::load(root.path()).unwrap(), None);
        let entry = keel_installer::resolve("v1.30").unwrap();
        let record = NodeVersion {
            version: entry.version(),
            components: entry.components().to_vec(),
        };
        record.save(root.path()).unwrap();
        assert_eq!(NodeVersion::load(root.path()).unwrap(), Some(record));

        let path = root.path().join(paths::NODE_VERSION);
        std::fs::write(&path, br#"{"kubernetes_version":"1.30","components":[]}"#).unwrap();
        assert!(matches!(
            NodeVersion::load(root.path()),
            Err(RecordError::Invalid(_))
        ));
    }

    #[test]
    fn a_kubeadm_mark_lives_beside_the_switch_record_and_goes_with_it() {
        let root = tempfile::tempdir().unwrap();
        let root = root.path();
        let dirs = vec!["/run/state/bin".to_owned()];
        let version = keel_installer::resolve("v1.31").unwrap().version();
        Switching::begin(root, dirs.clone()).unwrap();
        assert_eq!(Switching::kubeadm_started(root).unwrap(), None);
        Switching::kubeadm_starts(root, version).unwrap();
        assert_eq!(Switching::kubeadm_started(root).unwrap(), Some(version));
        // The record is as earlier agents wrote and read it.
        let record = std::fs::read(root.join(paths::UPGRADE_SWITCHING)).unwrap();
        assert_eq!(record, br#"{"directories":["/run/state/bin"]}"#);
        Switching::end(root).unwrap();
        assert_eq!(Switching::load(root).unwrap(), None);
        assert_eq!(Switching::kubeadm_started(root).unwrap(), None);

        // A mark an earlier agent left behind is not the next switch's.
        Switching::kubeadm_starts(root, version).unwrap();
        Switching::begin(root, dirs).unwrap();
        assert_eq!(Switching::kubeadm_started(root).unwrap(), None);

        // A later agent's field is no reason to lose the version.
        std::fs::write(
            root.join(paths::UPGRADE_KUBEADM),
            br#"{"kubernetes_version":"v1.31.13","later":true}"#,
        )
        .unwrap();
        assert_eq!(
            Switching::kubeadm_started(root).unwrap(),
            Some("v1.31.13".parse().unwrap())
        );
        std::fs::write(root.join(paths::UPGRADE_KUBEADM), b"{").unwrap();
        assert!(matches!(
            Switching::kubeadm_started(root),
            Err(RecordError::InvalidKubeadmMark(_))
        ));
    }
}
