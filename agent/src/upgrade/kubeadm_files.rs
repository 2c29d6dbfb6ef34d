//! What `kubeadm upgrade` leaves on a node, taken before it runs and
//! compared after it failed: whether the node was left as it was.
//!
//! kubeadm restores the static pods' manifests when its control-plane phase
//! fails, but not what later phases wrote: the kubelet's configuration, and
//! on `upgrade apply` the cluster's kubeadm configuration and addons, all
//! after the new manifests are in place. A failed kubeadm whose files
//! changed has therefore upgraded at least part of the node, and the switch
//! back of the binaries is not a rollback.

use std::path::{Path, PathBuf};

use sha2::{Digest as _, Sha256};

/// The static pods' manifests (every file in it).
const MANIFESTS: &str = "etc/kubernetes/manifests";
/// The kubelet's configuration files kubeadm writes.
const KUBELET_FILES: [&str; 2] = [
    "var/lib/kubelet/config.yaml",
    "var/lib/kubelet/kubeadm-flags.env",
];
/// Most manifests looked at; kubeadm writes four.
const MAX_MANIFESTS: usize = 64;
/// Most bytes of one file read; a manifest is a few KiB.
const MAX_FILE_BYTES: u64 = 4 << 20;

/// The files kubeadm's upgrade writes under a root, by path and SHA-256
/// (`None` where a file is absent).
#[derive(Debug, PartialEq, Eq)]
pub struct KubeadmFiles(Vec<(PathBuf, Option<[u8; 32]>)>);

impl KubeadmFiles {
    /// The files under `root` (`/` on a node) as they are now. An error
    /// (a file that cannot be read, too many or too large ones) means the
    /// state is unknown.
    pub fn now(root: &Path) -> std::io::Result<Self> {
        let mut paths: Vec<PathBuf> = KUBELET_FILES.iter().map(|f| root.join(f)).collect();
        match std::fs::read_dir(root.join(MANIFESTS)) {
            Ok(entries) => {
                for entry in entries {
                    paths.push(entry?.path());
                    if paths.len() > KUBELET_FILES.len() + MAX_MANIFESTS {
                        return Err(std::io::Error::other("too many static pod manifests"));
                    }
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        paths.sort();
        paths
            .into_iter()
            .map(|path| {
                let digest = match keel_verifier::bounded::read_regular(&path, MAX_FILE_BYTES) {
                    Ok(Some(bytes)) => Some(Sha256::digest(bytes).into()),
                    Ok(None) => return Err(std::io::Error::other("a file too large to compare")),
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
                    Err(e) => return Err(e),
                };
                Ok((path, digest))
            })
            .collect::<std::io::Result<_>>()
            .map(Self)
    }

    /// Taken off the runtime's workers.
    pub async fn now_blocking(root: &Path) -> std::io::Result<Self> {
        let root = root.to_owned();
        tokio::task::spawn_blocking(move || Self::now(&root))
            .await
            .map_err(std::io::Error::other)?
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_changed_added_or_removed_file_is_a_change() {
        let root = tempfile::tempdir().unwrap();
        let write = |path: &str, text: &str| {
            let path = root.path().join(path);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, text).unwrap();
        };
        write("etc/kubernetes/manifests/kube-apiserver.yaml", "v1.30");
        let before = KubeadmFiles::now(root.path()).unwrap();
        assert_eq!(before, KubeadmFiles::now(root.path()).unwrap());
        for (path, text) in [
            ("etc/kubernetes/manifests/kube-apiserver.yaml", "v1.31"),
            ("etc/kubernetes/manifests/etcd.yaml", "3.5"),
            ("var/lib/kubelet/config.yaml", "kind: KubeletConfiguration"),
        ] {
            let before = KubeadmFiles::now(root.path()).unwrap();
            write(path, text);
            assert_ne!(before, KubeadmFiles::now(root.path()).unwrap(), "{path}");
        }
        let before = KubeadmFiles::now(root.path()).unwrap();
        std::fs::remove_file(root.path().join("etc/kubernetes/manifests/etcd.yaml")).unwrap();
        assert_ne!(before, KubeadmFiles::now(root.path()).unwrap());
    }

    #[test]
    fn files_that_cannot_be_read_are_an_error() {
        let root = tempfile::tempdir().unwrap();
        let manifests = root.path().join(MANIFESTS);
        std::fs::create_dir_all(manifests.join("a-directory.yaml")).unwrap();
        assert!(KubeadmFiles::now(root.path()).is_err());
    }
}
