//! The operator API of a control plane: changes only the cluster's operator
//! may make.
//!
//! Served next to init and recovery (server-attested aTLS), once the node
//! serves joins. Each change carries a proof made with the operator key,
//! which derives from the master secret ([`keel_verifier::keys::operator_proof`]),
//! over a challenge this node issued: at most [`MAX_CHALLENGES`] are
//! outstanding, each is valid for [`CHALLENGE_TTL`] and used once, so a
//! recorded request cannot be replayed and a flood of challenges only
//! evicts the oldest. An address that sends a wrong proof waits, doubling
//! per failure.
//!
//! `SetJoinMeasurements` replaces the measurements the join service accepts:
//! the file the join service re-reads, the facts on the state disk (so a
//! reboot keeps them) and the cluster state the next tickets carry (so a
//! control plane that joins later serves the same).

use std::collections::VecDeque;
use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use keel_proto::operator::operator_service_server::{OperatorService, OperatorServiceServer};
use keel_proto::operator::{
    ChallengeRequest, ChallengeResponse, NodeStatusRequest, NodeStatusResponse, RevokeNodeRequest,
    RevokeNodeResponse, SetJoinMeasurementsRequest, SetJoinMeasurementsResponse,
};
use keel_verifier::keys::operator_proof;
use keel_verifier::measurements::Measurements;
use rand::RngCore as _;
use sha2::{Digest as _, Sha256};
use subtle::ConstantTimeEq as _;

use crate::cluster::{ClusterSlot, ClusterState, ControlPlaneFacts};
use crate::registry::{RegistryError, RegistryStore, Revocation};
use crate::throttle::FailureThrottle;

/// Challenges outstanding at once; a new one evicts the oldest.
pub const MAX_CHALLENGES: usize = 64;
/// How long a challenge is valid.
pub const CHALLENGE_TTL: Duration = Duration::from_secs(60);
/// Largest accepted request (a measurements file is a few KiB).
pub const MAX_OPERATOR_REQUEST_BYTES: usize = 128 * 1024;
/// The proof kind of `SetJoinMeasurements`.
pub const SET_JOIN_MEASUREMENTS: &str = "set-join-measurements";
/// The proof kind of `RevokeNode` (body: the node selector).
pub const REVOKE_NODE: &str = "revoke-node";
/// The proof kind of `NodeStatus` (body: empty).
pub const NODE_STATUS: &str = "node-status";

/// Why an operator request was refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OperatorError {
    /// The node serves no cluster (yet).
    #[error("this node serves no cluster")]
    NotServing,
    /// The challenge is unknown, used or expired.
    #[error("unknown, used or expired challenge")]
    Challenge,
    /// The proof does not verify with the operator key.
    #[error("the operator proof does not verify")]
    Proof,
    /// The caller sent wrong proofs and must wait this many seconds.
    #[error("too many failed operator requests from this address; retry in {0} s")]
    Throttled(u64),
    /// The measurements are refused (the caller is the operator: the
    /// reason is theirs to see).
    #[error("invalid measurements: {0}")]
    Measurements(String),
    /// The new measurements could not be stored.
    #[error("storing the measurements failed")]
    Store(#[source] anyhow::Error),
    /// The node to revoke is not known here (the caller is the operator:
    /// the selector is theirs to see).
    #[error("{0}")]
    UnknownNode(String),
    /// The node registry failed.
    #[error("the node registry failed")]
    Registry(#[source] crate::registry::RegistryError),
}

impl From<&OperatorError> for tonic::Status {
    fn from(e: &OperatorError) -> Self {
        use OperatorError as E;
        let code = match e {
            E::NotServing => tonic::Code::FailedPrecondition,
            E::Challenge | E::Proof => tonic::Code::PermissionDenied,
            E::Throttled(_) => tonic::Code::ResourceExhausted,
            E::Measurements(_) => tonic::Code::InvalidArgument,
            E::UnknownNode(_) => tonic::Code::NotFound,
            E::Store(_) | E::Registry(_) => tonic::Code::Internal,
        };
        tonic::Status::new(code, e.to_string())
    }
}

/// The operator service of a node.
#[derive(Clone)]
pub struct OperatorServer {
    inner: Arc<Inner>,
}

struct Inner {
    cluster: Arc<ClusterSlot>,
    measurements: PathBuf,
    root: PathBuf,
    challenges: Mutex<VecDeque<([u8; 32], Instant)>>,
    throttle: FailureThrottle,
}

impl OperatorServer {
    /// The operator service of a node whose cluster state appears in
    /// `cluster`, whose join service reads `measurements`, and whose facts
    /// live under `root`.
    pub fn new(cluster: Arc<ClusterSlot>, measurements: PathBuf, root: PathBuf) -> Self {
        Self {
            inner: Arc::new(Inner {
                cluster,
                measurements,
                root,
                challenges: Mutex::new(VecDeque::new()),
                throttle: FailureThrottle::default(),
            }),
        }
    }

    /// The tonic service, requests bounded to [`MAX_OPERATOR_REQUEST_BYTES`].
    pub fn into_service(self) -> OperatorServiceServer<Self> {
        OperatorServiceServer::new(self).max_decoding_message_size(MAX_OPERATOR_REQUEST_BYTES)
    }

    /// A fresh challenge.
    pub fn challenge(&self) -> [u8; 32] {
        let mut challenge = [0u8; 32];
        rand::rngs::OsRng.fill_bytes(&mut challenge);
        let mut outstanding = self.challenges();
        let now = Instant::now();
        outstanding.retain(|(_, issued)| now.duration_since(*issued) < CHALLENGE_TTL);
        if outstanding.len() >= MAX_CHALLENGES {
            outstanding.pop_front();
        }
        outstanding.push_back((challenge, now));
        challenge
    }

    fn challenges(&self) -> std::sync::MutexGuard<'_, VecDeque<([u8; 32], Instant)>> {
        self.inner
            .challenges
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Takes `challenge` if it is outstanding and fresh: each is used once.
    fn take_challenge(&self, challenge: &[u8]) -> bool {
        let mut outstanding = self.challenges();
        let found = outstanding
            .iter()
            .position(|(c, _)| bool::from(c.as_slice().ct_eq(challenge)));
        match found.and_then(|i| outstanding.remove(i)) {
            Some((_, issued)) => issued.elapsed() < CHALLENGE_TTL,
            None => false,
        }
    }

    /// Checks an operator request of `kind` over `body` from `peer`: not
    /// throttled, a cluster served, and `proof` the operator's for a
    /// challenge this node issued (used up here). Returns the cluster state.
    fn authorise(
        &self,
        kind: &str,
        challenge: &[u8],
        body: &[u8],
        proof: &[u8],
        peer: Option<IpAddr>,
    ) -> Result<Arc<ClusterState>, OperatorError> {
        let inner = &self.inner;
        if let Some(ip) = peer {
            inner
                .throttle
                .check(ip)
                .map_err(|wait| OperatorError::Throttled(wait.as_secs().max(1)))?;
        }
        let state = inner
            .cluster
            .borrow()
            .clone()
            .ok_or(OperatorError::NotServing)?;
        let proven = self.take_challenge(challenge)
            && state
                .keys
                .operator_key()
                .ok()
                .and_then(|key| operator_proof(&key, kind, challenge, body))
                .is_some_and(|expected| bool::from(expected.as_slice().ct_eq(proof)));
        if !proven {
            if let Some(ip) = peer {
                let (failures, wait) = inner.throttle.failed(ip);
                tracing::warn!(peer = %ip, failures, wait_s = wait.as_secs_f64(), kind, "operator request refused: no valid proof");
            }
            return Err(OperatorError::Proof);
        }
        if let Some(ip) = peer {
            inner.throttle.succeeded(ip);
        }
        Ok(state)
    }

    /// Replaces the join measurements, for a request from `peer`; returns
    /// the SHA-256 of the measurements now in force.
    pub fn set_join_measurements(
        &self,
        request: &SetJoinMeasurementsRequest,
        peer: Option<IpAddr>,
    ) -> Result<[u8; 32], OperatorError> {
        let inner = &self.inner;
        let state = self.authorise(
            SET_JOIN_MEASUREMENTS,
            &request.challenge,
            &request.measurements,
            &request.proof,
            peer,
        )?;
        let measurements = Measurements::parse(&request.measurements)
            .map_err(|e| OperatorError::Measurements(e.to_string()))?;
        let json = measurements.to_json();
        crate::files::write_private(&inner.measurements, json.as_bytes())
            .map_err(|e| OperatorError::Store(e.into()))?;
        let updated = Arc::new(state.with_join_measurements(measurements));
        ControlPlaneFacts::of(&updated)
            .save(&inner.root)
            .map_err(|e| OperatorError::Store(e.into()))?;
        inner.cluster.send_replace(Some(updated));
        let digest: [u8; 32] = Sha256::digest(json.as_bytes()).into();
        tracing::info!(digest = %hex::encode(digest), path = %inner.measurements.display(), "join measurements replaced by the operator");
        Ok(digest)
    }

    /// The node registry of this control plane (on its state disk, which
    /// is mounted once it serves a cluster).
    fn registry(&self) -> Result<Arc<RegistryStore>, OperatorError> {
        RegistryStore::shared(&self.inner.root).map_err(OperatorError::Registry)
    }

    /// Puts the node `request.node` names on the revocation list, for a
    /// request from `peer`.
    pub fn revoke_node(
        &self,
        request: &RevokeNodeRequest,
        peer: Option<IpAddr>,
    ) -> Result<Revocation, OperatorError> {
        self.authorise(
            REVOKE_NODE,
            &request.challenge,
            request.node.as_bytes(),
            &request.proof,
            peer,
        )?;
        let selector = request.node.clone();
        let revocation = self.registry()?.update(|r| {
            let record = r.find(&selector)?.clone();
            r.revoke(&record, "revoked by the operator")
        });
        let revocation = revocation.map_err(|e| match e {
            RegistryError::UnknownNode(what) => OperatorError::UnknownNode(format!(
                "no node {what:?} is known to this control plane"
            )),
            other => OperatorError::Registry(other),
        })?;
        tracing::warn!(%revocation, "node revoked by the operator");
        Ok(revocation)
    }

    /// The node registry (JSON), for a request from `peer`.
    pub fn node_status(
        &self,
        request: &NodeStatusRequest,
        peer: Option<IpAddr>,
    ) -> Result<Vec<u8>, OperatorError> {
        self.authorise(NODE_STATUS, &request.challenge, &[], &request.proof, peer)?;
        Ok(self.registry()?.snapshot().to_json())
    }
}

/// Logs a refused operator request and makes the caller's status.
fn refused(e: &OperatorError) -> tonic::Status {
    tracing::warn!(error = %keel_atls::ErrorChain(e), "operator request refused");
    e.into()
}

#[tonic::async_trait]
impl OperatorService for OperatorServer {
    async fn challenge(
        &self,
        _request: tonic::Request<ChallengeRequest>,
    ) -> Result<tonic::Response<ChallengeResponse>, tonic::Status> {
        Ok(tonic::Response::new(ChallengeResponse {
            challenge: OperatorServer::challenge(self).to_vec(),
        }))
    }

    async fn set_join_measurements(
        &self,
        request: tonic::Request<SetJoinMeasurementsRequest>,
    ) -> Result<tonic::Response<SetJoinMeasurementsResponse>, tonic::Status> {
        let peer = crate::grpc::peer_ip(&request);
        match OperatorServer::set_join_measurements(self, request.get_ref(), peer) {
            Ok(digest) => Ok(tonic::Response::new(SetJoinMeasurementsResponse {
                digest: digest.to_vec(),
            })),
            Err(e) => Err(refused(&e)),
        }
    }

    async fn revoke_node(
        &self,
        request: tonic::Request<RevokeNodeRequest>,
    ) -> Result<tonic::Response<RevokeNodeResponse>, tonic::Status> {
        let peer = crate::grpc::peer_ip(&request);
        let r =
            OperatorServer::revoke_node(self, request.get_ref(), peer).map_err(|e| refused(&e))?;
        Ok(tonic::Response::new(RevokeNodeResponse {
            name: r.name,
            ek: r.ek,
            disk_uuid: r.disk_uuid,
        }))
    }

    async fn node_status(
        &self,
        request: tonic::Request<NodeStatusRequest>,
    ) -> Result<tonic::Response<NodeStatusResponse>, tonic::Status> {
        let peer = crate::grpc::peer_ip(&request);
        let registry =
            OperatorServer::node_status(self, request.get_ref(), peer).map_err(|e| refused(&e))?;
        Ok(tonic::Response::new(NodeStatusResponse { registry }))
    }
}
