//! Where things live on a node, in one place.
//!
//! Paths under the node root are relative: they are joined to the root,
//! `/` on a node and a temporary directory in host tests. Files of the
//! agent's work directory (`/run/keel` on a node, on the tmpfs: they last
//! one boot) are names within it.

/// Where a node keeps what it runs: a tmpfs, in guest memory, that the
/// agent mounts before it opens the state disk. The components are
/// installed in it ([`BIN_DIR`], [`MEMORY_BINDS`]) from verified bytes at
/// every boot, so a node never runs code from the disk, whose sectors the
/// host can write back to an earlier ciphertext (LUKS2 here has no
/// integrity or freshness) after the code was hashed.
pub const STATE_TMPFS: &str = "/run/state";
/// Where the opened state disk is mounted on a node: inside
/// [`STATE_TMPFS`].
pub const STATE_MOUNT: &str = "/run/state/disk";
/// Directories of the state disk bind-mounted over the paths Kubernetes
/// and the container runtime use, which the read-only image provides as
/// empty mount points (those under the volatile `/var` are created). Each
/// is created on the disk at every mount where it is missing, so a disk
/// made before a directory was added here gets it at its next boot.
/// `/var/lib/etcd` is etcd's data directory on a control plane (kubeadm's
/// `etcd.local.dataDir`, its default): on the tmpfs `/var` a control plane
/// would lose its etcd member at every reboot.
pub const STATE_BINDS: [(&str, &str); 5] = [
    ("kubernetes", "/etc/kubernetes"),
    ("kubelet", "/var/lib/kubelet"),
    ("cni-net.d", "/etc/cni/net.d"),
    ("containerd", "/var/lib/containerd"),
    ("etcd", "/var/lib/etcd"),
];
/// Directories of [`STATE_BINDS`] (on the disk) that only root may enter:
/// mode 0700, set at every mount. etcd's data directory, as kubeadm
/// creates it and etcd expects it (it warns about any other mode).
pub const PRIVATE_STATE_DIRS: [&str; 1] = ["etcd"];
/// Directories of [`STATE_TMPFS`] bind-mounted over the paths components
/// install into besides [`BIN_DIR`]: the CNI plugins and kubeadm's
/// patches, installed again at every boot.
pub const MEMORY_BINDS: [(&str, &str); 2] =
    [("cni", "/opt/cni"), ("opt-kubernetes", "/opt/kubernetes")];
/// Services started once the state disk is mounted: containerd keeps its
/// images, snapshots and metadata in `/var/lib/containerd`, on the disk.
/// The image does not start it at boot, and its unit refuses to start
/// unless that directory is a mount point.
pub const STATE_SERVICES: [&str; 1] = ["containerd.service"];
/// Where components install their binaries on a node (see the versions
/// table): in [`STATE_TMPFS`], in memory.
pub const BIN_DIR: &str = "/run/state/bin";
/// Where the installer keeps the verified downloaded components (named by
/// their hash), so that a reboot installs them again without a download:
/// on the state disk.
pub const KEPT_COMPONENTS: &str = "/run/state/disk/kept";

/// The kubelet's client certificate, key and the cluster CA.
pub const KUBELET_PKI_DIR: &str = "var/lib/kubelet/pki";
/// The cluster PKI of a control plane.
pub const CONTROL_PLANE_PKI_DIR: &str = "etc/kubernetes/pki";
/// The admin kubeconfig kubeadm writes.
pub const ADMIN_CONF: &str = "etc/kubernetes/admin.conf";
/// A control plane's node registry: verdicts of the members' evidence and
/// the revocation list, on its state disk (see the registry module); its
/// journal is beside it.
pub const NODE_REGISTRY: &str = "etc/kubernetes/keel/registry.json";
/// A control plane's disk bindings (the EK each disk joined with), on its
/// state disk, so that they outlive a reboot (see the disk_bindings
/// module); their journal is beside them.
pub const DISK_BINDINGS: &str = "etc/kubernetes/keel/disk-bindings.json";
/// A control plane's facts about its cluster, on its state disk (see
/// `ControlPlaneFacts` in the cluster module).
pub const CONTROL_PLANE_FACTS: &str = "etc/kubernetes/keel/control-plane.json";
/// The Kubernetes version a node runs and its components, on its state
/// disk (see `NodeVersion` in the upgrade module).
pub const NODE_VERSION: &str = "etc/kubernetes/keel/node-version.json";
/// The component directories an upgrade is switching, from just before the
/// switch until the version record names what they hold (see `Switching`
/// in the upgrade module).
pub const UPGRADE_SWITCHING: &str = "etc/kubernetes/keel/upgrade-switching.json";
/// The version kubeadm is upgrading a node to, from just before an
/// upgrade runs kubeadm until its switch record goes (see
/// `Switching::kubeadm_starts` in the upgrade module).
pub const UPGRADE_KUBEADM: &str = "etc/kubernetes/keel/upgrade-kubeadm.json";
/// kubeadm's patches directory; kubeadm requires it to exist, even empty.
pub const PATCHES_DIR: &str = "opt/kubernetes/patches";

/// The agent's event log (work directory).
pub const EVENT_LOG: &str = "eventlog.jsonl";
/// The `kubeadm init` configuration (work directory).
pub const KUBEADM_INIT_CONFIG: &str = "kubeadm-init.yaml";
/// The `kubeadm join` configuration (work directory).
pub const KUBEADM_JOIN_CONFIG: &str = "kubeadm-join.yaml";
/// The kubeconfig of `kubeadm join`'s file discovery, which holds the
/// kubelet's client key (work directory, removed after the run).
pub const KUBEADM_DISCOVERY_CONFIG: &str = "kubeadm-discovery.conf";
/// One configuration per `kubeadm token create`, removed after it ran
/// (work directory).
pub const TOKEN_CONFIG_DIR: &str = "join-tokens";
/// The measurements the join service checks joining nodes against (work
/// directory, unless the agent is told otherwise).
pub const JOIN_MEASUREMENTS: &str = "join-measurements.json";

#[cfg(test)]
mod tests {
    use super::*;

    /// What Kubernetes keeps and a node needs after a reboot is on the
    /// state disk, not the tmpfs `/var` or the read-only root: the
    /// kubelet's and kubeadm's files, the container runtime's, and a
    /// control plane's etcd data (kubeadm's default `dataDir`, which the
    /// generated `ClusterConfiguration` keeps).
    #[test]
    fn the_state_disk_holds_what_kubernetes_keeps() {
        for path in [
            "/etc/kubernetes",
            "/var/lib/kubelet",
            "/var/lib/etcd",
            "/var/lib/containerd",
            "/etc/cni/net.d",
        ] {
            assert!(
                STATE_BINDS.iter().any(|(_, target)| *target == path),
                "{path} is not bound from the state disk"
            );
        }
        for dir in PRIVATE_STATE_DIRS {
            assert!(
                STATE_BINDS.iter().any(|(inside, _)| *inside == dir),
                "{dir}"
            );
        }
        assert!(STATE_BINDS
            .iter()
            .any(|(inside, target)| PRIVATE_STATE_DIRS.contains(inside)
                && *target == "/var/lib/etcd"));
    }
}
