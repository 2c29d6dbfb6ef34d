//! What a control-plane node holds once it belongs to a cluster: the keys,
//! the measurement salt and secret, and the Kubernetes setup that join
//! tickets hand out. Shared by the init server (which creates it) and the
//! join service (which serves it).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use keel_installer::{Component, KubernetesVersion};
use keel_verifier::measurements::Measurements;
use zeroize::Zeroizing;

use crate::key_service::{ClusterId, KeyService};

/// A cluster this node is a control-plane member of.
pub struct ClusterState {
    /// Derives every data key (disk keys, the measurement secret).
    pub keys: Arc<KeyService>,
    /// Salt of the cluster ID derivation.
    pub measurement_salt: Vec<u8>,
    /// The measurement secret (HKDF input of the cluster ID).
    pub measurement_secret: Zeroizing<Vec<u8>>,
    /// The cluster ID, extended into PCR 15 of every member.
    pub cluster_id: ClusterId,
    /// The pinned Kubernetes version.
    pub kubernetes_version: KubernetesVersion,
    /// The components every node installs.
    pub components: Vec<Component>,
    /// The Kubernetes API server endpoint.
    pub api_server: SocketAddr,
    /// Directory of the cluster PKI (`etc/kubernetes/pki` under the node root).
    pub pki_dir: PathBuf,
    /// The measurements joining nodes are checked against, as sent by the
    /// operator's CLI in the init request.
    pub join_measurements: Measurements,
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

/// Where the cluster state appears once the node has one.
pub type ClusterSlot = tokio::sync::watch::Sender<Option<Arc<ClusterState>>>;
