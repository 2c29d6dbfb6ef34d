//! Continuous attestation: every member sends fresh evidence to every
//! control plane at the cluster's interval, and each control plane keeps a
//! verdict per node.
//!
//! * [`client`]: the node's loop, one mutual aTLS connection per control
//!   plane: ask for a nonce (the control plane answers when the evidence is
//!   due), quote it, submit; a control plane also pulls the other's
//!   registry there.
//! * [`service`]: the control plane's endpoint on its join port, which
//!   validates evidence as at join time and records verdicts in the
//!   [registry](crate::registry), and marks nodes silent.
//! * [`admission`]: which peers the join port admits (joining nodes, and
//!   members of this cluster).
//! * [`hearing`]: when a control plane's silence verdicts may be acted on
//!   (not while it is cut off, or just back from an absence).

pub mod admission;
pub mod client;
pub mod hearing;
pub mod service;

use sha2::{Digest as _, Sha256};

pub use client::EvidenceClient;
pub use service::EvidenceService;

/// Longest disk UUID or Kubernetes version in a submission.
pub const MAX_FIELD_BYTES: usize = 64;
/// Intervals without evidence after which a node is silent.
pub const SILENT_AFTER: u32 = 3;

/// The user data an evidence document binds: its submission's fields.
pub fn user_data(disk_uuid: &str, kubernetes_version: &str) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(b"keel evidence v1\0");
    h.update(disk_uuid.as_bytes());
    h.update([0]);
    h.update(kubernetes_version.as_bytes());
    h.finalize().into()
}

/// The Kubernetes version this node reports in its evidence: the one its
/// version record on the state disk names (kept by every install and
/// upgrade), empty where there is none. The one place the reported
/// version is read.
pub fn reported_kubernetes_version(root: &std::path::Path) -> String {
    match crate::upgrade::NodeVersion::load(root) {
        Ok(Some(record)) => record.version.to_string(),
        _ => String::new(),
    }
}
