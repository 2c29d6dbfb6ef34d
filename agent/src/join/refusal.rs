//! Why the join service refuses a ticket, and what the joining node is
//! told: a fixed text per kind of refusal; causes (kubeadm's output, file
//! errors, binding details) stay in the service's log.

use keel_verifier::credential::CredentialError;
use keel_verifier::keys::DiskKeyError;

use super::kubelet::{self, SignCsrError};
use crate::disk_bindings::{DiskBindingRefusal, DiskBindingsError};

/// Why a ticket was refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum JoinServiceError {
    /// The connection carries no validated attestation.
    #[error("the peer is not attested")]
    NotAttested,
    /// A request field is invalid.
    #[error("invalid request: {0}")]
    InvalidRequest(&'static str),
    /// The disk UUID is malformed.
    #[error("invalid disk UUID")]
    DiskUuid(#[source] DiskKeyError),
    /// The request does not match the peer's measured identity.
    #[error("the request does not match the node's measured identity: {0}")]
    Identity(&'static str),
    /// The kubelet CSR was refused.
    #[error("the kubelet CSR was refused")]
    Csr(#[source] kubelet::CsrError),
    /// Signing the kubelet certificate failed.
    #[error("signing the kubelet certificate failed")]
    Sign(#[source] rcgen::Error),
    /// Too many tickets are being issued.
    #[error("the join service is busy; retry later")]
    Busy,
    /// Registering the bootstrap token with the cluster failed.
    #[error("registering the bootstrap token failed")]
    Token(#[source] super::tokens::TokenError),
    /// Reading a control-plane file failed.
    #[error("reading control-plane file {name}")]
    ControlPlaneFile {
        /// The file, relative to the PKI directory.
        name: &'static str,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The secrets could not be sealed to the peer's TPM.
    #[error("sealing the ticket to the node's TPM failed")]
    Seal(#[source] CredentialError),
    /// Deriving a key failed.
    #[error("deriving a key failed")]
    Derive,
    /// The disk is bound to another TPM, or the peer's TPM has as many
    /// disks bound as it may. The peer gets this fixed message; the cause,
    /// logged locally, says which.
    #[error("the state disk is not bound to this node's TPM")]
    DiskNotBound(#[source] DiskBindingRefusal),
    /// The disk binding store failed: nothing was issued.
    #[error("the disk binding store is unavailable")]
    DiskBindings(#[source] DiskBindingsError),
    /// The peer is already locked into a cluster (PCR 15 is not zero): a
    /// member sends evidence on this port, it gets no ticket.
    #[error("the node is already locked into a cluster")]
    Member,
    /// The revocation list names the peer's EK.
    #[error("the node is revoked: {0}")]
    Revoked(crate::registry::Revocation),
    /// The revocation list names this control plane itself: a peer revoked
    /// it (its evidence drifted, or the operator revoked it), and it issues
    /// no ticket, so the node asks another control plane.
    #[error("this control plane is revoked: {0}")]
    ServiceRevoked(crate::registry::Revocation),
    /// The connection's handshake is older than the ticket window (its
    /// age in seconds): the peer must connect again to be judged now.
    #[error("the connection's attestation is {0} s old")]
    StaleHandshake(u64),
    /// The measurements the peer matched at its handshake (this digest)
    /// are no longer accepted: the image was withdrawn since.
    #[error("the measurements the node was admitted by ({0}) are no longer accepted")]
    Withdrawn(String),
    /// Another node of the cluster, not revoked, holds the peer's node
    /// name ([`RegistryError::NameTaken`](crate::registry::RegistryError::NameTaken)).
    #[error("the node name is taken")]
    NameTaken(#[source] crate::registry::RegistryError),
    /// The peer's EK holds another name or role than it asks under
    /// ([`RegistryError::Renamed`](crate::registry::RegistryError::Renamed)).
    #[error("the node asks under another name or role than it joined with")]
    Renamed(#[source] crate::registry::RegistryError),
    /// Another node of the cluster, not revoked, is recorded with the
    /// disk the peer asks a ticket for
    /// ([`RegistryError::DiskHeld`](crate::registry::RegistryError::DiskHeld)).
    #[error("the disk is recorded for another node")]
    DiskHeld(#[source] crate::registry::RegistryError),
    /// The node registry failed: nothing was issued.
    #[error("the node registry is unavailable")]
    Registry(#[source] crate::registry::RegistryError),
    /// A node of this control plane's own image asked for a bootstrap
    /// token (no file discovery), which its agent never does.
    #[error("a node of this control plane's image asked for a bootstrap token")]
    TokenDowngrade,
    /// A bootstrap token was asked of a control plane whose own image the
    /// cluster no longer accepts.
    #[error("this control plane's image is retired; it issues no bootstrap token")]
    TokensRetired,
    /// A control plane's earlier ticket, which carries the registry, is
    /// still being sent to it: one at a time per EK.
    #[error("an earlier ticket with the registry is still being sent to this node")]
    RegistryUnsent,
}

impl From<SignCsrError> for JoinServiceError {
    fn from(e: SignCsrError) -> Self {
        match e {
            SignCsrError::Csr(e) => Self::Csr(e),
            SignCsrError::Sign(e) => Self::Sign(e),
        }
    }
}

impl JoinServiceError {
    /// The refusal for a registry check or record of a peer's EK and
    /// identity.
    pub(crate) fn from_identity_check(e: crate::registry::RegistryError) -> Self {
        use crate::registry::RegistryError as R;
        match e {
            R::Revoked(revocation) => Self::Revoked(*revocation),
            taken @ R::NameTaken { .. } => Self::NameTaken(taken),
            renamed @ R::Renamed { .. } => Self::Renamed(renamed),
            held @ R::DiskHeld { .. } => Self::DiskHeld(held),
            other => Self::Registry(other),
        }
    }

    /// What the peer is told: a fixed text per kind of refusal. Causes
    /// (kubeadm's output, file errors, binding details) stay in the
    /// service's log.
    pub fn peer_message(&self) -> &'static str {
        use JoinServiceError as E;
        match self {
            E::NotAttested => "the peer is not attested",
            E::InvalidRequest(what) => what,
            E::DiskUuid(_) => "invalid disk UUID",
            E::Identity(_) => "the request does not match the node's measured identity",
            E::Csr(_) => "the kubelet CSR was refused",
            E::Sign(_) => "signing the kubelet certificate failed",
            E::Busy => "the join service is busy; retry later",
            E::Token(_) => "registering the bootstrap token failed",
            E::ControlPlaneFile { .. } => "reading the control-plane files failed",
            E::Seal(CredentialError::UnsupportedEk) => "the node's EK type is not supported",
            E::Seal(_) => "sealing the ticket to the node's TPM failed",
            E::Derive => "deriving a key failed",
            E::DiskNotBound(_) | E::DiskHeld(_) => "the state disk is not bound to this node's TPM",
            E::DiskBindings(_) => "the disk binding store is unavailable",
            E::Member => "the node is already locked into a cluster",
            E::Revoked(_) => "the node is revoked: its EK is on the cluster's revocation list",
            E::ServiceRevoked(_) => {
                "this control plane is revoked and issues no tickets; ask another"
            }
            E::Withdrawn(_) => "the node's image is no longer accepted by the cluster",
            E::NameTaken(_) => "another node of the cluster holds this node's name",
            E::Renamed(_) => {
                "the node's TPM joined the cluster under another name or role; a node keeps its name"
            }
            E::StaleHandshake(_) => {
                "the connection's attestation is too old for a ticket; connect again"
            }
            E::Registry(_) => "the node registry is unavailable",
            E::TokenDowngrade => {
                "a node of this image joins with file discovery; no bootstrap token is issued to it"
            }
            E::TokensRetired => {
                "this control plane runs an image the cluster retired and issues no bootstrap \
                 token; ask another"
            }
            E::RegistryUnsent => {
                "an earlier ticket of this node is still being sent; read it or cancel it first"
            }
        }
    }
}

impl From<&JoinServiceError> for tonic::Status {
    /// The one map from ticket refusals to gRPC codes; the peer gets
    /// [`JoinServiceError::peer_message`], the service's log the full chain.
    fn from(e: &JoinServiceError) -> Self {
        use JoinServiceError as E;
        let code = match e {
            E::NotAttested => tonic::Code::Unauthenticated,
            E::InvalidRequest(_) | E::DiskUuid(_) | E::Csr(_) => tonic::Code::InvalidArgument,
            E::Identity(_)
            | E::DiskNotBound(_)
            | E::DiskHeld(_)
            | E::Revoked(_)
            | E::Withdrawn(_)
            | E::NameTaken(_)
            | E::Renamed(_)
            | E::TokenDowngrade => tonic::Code::PermissionDenied,
            E::Member | E::StaleHandshake(_) => tonic::Code::FailedPrecondition,
            E::RegistryUnsent => tonic::Code::ResourceExhausted,
            E::Seal(CredentialError::UnsupportedEk) => tonic::Code::FailedPrecondition,
            E::Busy | E::Token(_) | E::ServiceRevoked(_) | E::TokensRetired => {
                tonic::Code::Unavailable
            }
            E::Sign(_)
            | E::ControlPlaneFile { .. }
            | E::Seal(_)
            | E::Derive
            | E::DiskBindings(_)
            | E::Registry(_) => tonic::Code::Internal,
        };
        tonic::Status::new(code, e.peer_message())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    const DISK: &str = "0a1b2c3d-0000-4000-8000-00000000000a";

    #[test]
    fn status_codes() {
        let code = |e: JoinServiceError| tonic::Status::from(&e).code();
        assert_eq!(
            code(JoinServiceError::NotAttested),
            tonic::Code::Unauthenticated
        );
        assert_eq!(
            code(JoinServiceError::Identity("x")),
            tonic::Code::PermissionDenied
        );
        assert_eq!(
            code(JoinServiceError::Csr(kubelet::CsrError::Signature)),
            tonic::Code::InvalidArgument
        );
        assert_eq!(code(JoinServiceError::Busy), tonic::Code::Unavailable);
        assert_eq!(
            code(JoinServiceError::TokenDowngrade),
            tonic::Code::PermissionDenied
        );
        let not_bound = JoinServiceError::DiskNotBound(DiskBindingRefusal::OtherEk {
            uuid: DISK.into(),
            bound: keel_verifier::ek::EkDigest::of_marshalled(b"bound"),
            peer: keel_verifier::ek::EkDigest::of_marshalled(b"peer"),
        });
        let status = tonic::Status::from(&not_bound);
        assert_eq!(status.code(), tonic::Code::PermissionDenied);
        // The peer learns nothing about the binding: not the disk, not the
        // EK it is bound to.
        assert!(!status.message().contains(DISK), "{}", status.message());
        let bound = keel_verifier::ek::EkDigest::of_marshalled(b"bound").to_string();
        assert!(
            !status.message().contains(&bound[7..]),
            "{}",
            status.message()
        );
        assert_eq!(
            code(JoinServiceError::DiskBindings(DiskBindingsError::Full)),
            tonic::Code::Internal
        );
        // kubeadm's output stays in the service's log.
        use crate::kubeadm::KubeadmError;
        use std::os::unix::process::ExitStatusExt as _;
        let token = JoinServiceError::Token(super::super::tokens::TokenError::Kubeadm(
            std::sync::Arc::new(KubeadmError::Failed {
                command: "token",
                status: std::process::ExitStatus::from_raw(256),
                last_lines: vec!["error: etcd at 10.0.0.7:2379 refused abcdef.<redacted>".into()],
            }),
        ));
        let status = tonic::Status::from(&token);
        assert_eq!(status.code(), tonic::Code::Unavailable);
        assert_eq!(status.message(), "registering the bootstrap token failed");
    }
}
