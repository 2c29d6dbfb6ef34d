//! The operator API of a node: changes only the cluster's operator may make.
//!
//! Served on the init port (server-attested aTLS) of every node once it is
//! a member. Each change carries a proof made with the node's operator key
//! ([`keel_verifier::keys::OperatorKey`]: derived from the master secret
//! for this node's EK; a control plane derives its own, a worker got its
//! own sealed in its ticket) over a challenge this node issued. A
//! challenge carries its issue time and a MAC with a key this process
//! holds, so the node keeps nothing per challenge it hands out: anyone may
//! ask for challenges, and asking for many takes no one else's away. Each
//! is valid for [`CHALLENGE_TTL`] and used once (the node remembers the
//! ones spent by a valid proof until they expire), so a recorded request
//! cannot be replayed (here or on another node, whose key differs). An
//! address that sends a wrong proof waits, doubling per failure.
//! [`OperatorAuth::authorize`] is the one place these checks run.
//!
//! `SetJoinMeasurements` (control planes) replaces the measurements the
//! join service accepts: the file the join service re-reads, the facts on
//! the state disk (so a reboot keeps them) and the cluster state the next
//! tickets carry (so a control plane that joins later serves the same).
//! When the cluster has a measurements signing key, the file must carry its
//! signature, checked as a staged file's (`verify_signed`): the operator
//! key alone does not admit an image. Without a key, the proof suffices.
//!
//! An image upgrade (control planes) goes in two steps.
//! `StageImageMeasurements` adds the new image's measurements as a second
//! accepted set, so nodes of the old and the new image both join during
//! the rollout; the file must carry a detached signature by the
//! measurements signing key configured at init
//! ([`keel_verifier::signature`]), so the operator key alone (or a file an
//! attacker placed on the operator's disk) cannot admit a foreign image.
//! `FinishImageUpgrade` makes the staged set the only one. Both are kept
//! where `SetJoinMeasurements` keeps its file.
//!
//! `AdminKubeconfig` (control planes that serve their cluster) sends the
//! node's admin kubeconfig ([`crate::paths::ADMIN_CONF`]) again, for an
//! operator whose `keel init` result was lost: bounded to
//! [`MAX_ADMIN_KUBECONFIG_BYTES`], read into a buffer wiped when dropped,
//! and never logged.

use std::collections::HashMap;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use keel_proto::operator::operator_service_server::{OperatorService, OperatorServiceServer};
use keel_proto::operator::upgrade_response::Event;
use keel_proto::operator::{
    AdminKubeconfigRequest, AdminKubeconfigResponse, ChallengeRequest, ChallengeResponse,
    FinishImageUpgradeRequest, FinishImageUpgradeResponse, NodeStatusRequest, NodeStatusResponse,
    RevokeNodeRequest, RevokeNodeResponse, SetJoinMeasurementsRequest, SetJoinMeasurementsResponse,
    StageImageMeasurementsRequest, StageImageMeasurementsResponse, UpgradeDone, UpgradeFailed,
    UpgradePlan, UpgradeRequest,
};
use keel_verifier::ek::EkDigest;
use keel_verifier::keys::OperatorKey;
use keel_verifier::measurements::Measurements;
use keel_verifier::signature::{
    SignatureError, SignedMeasurements, SignedMeasurementsError, SigningPublicKey,
};
use prost::Message as _;
use rand::RngCore as _;
use subtle::ConstantTimeEq as _;
use tokio_stream::wrappers::ReceiverStream;
use zeroize::Zeroizing;

use crate::attestation::policy::write_accepted;
use crate::cluster::{change_state_then, ClusterSlot, ClusterState, FactsError};
use crate::disk_bindings::DiskBindings;
use crate::paths::ADMIN_CONF;
use crate::registry::{BoundDisk, RegistryError, RegistryStore, Revocation};
use crate::throttle::FailureThrottle;
use crate::transcript::{self, Transcript};
use crate::upgrade::{Step, UpgradeError, Upgrader};

/// How long a challenge is valid.
pub const CHALLENGE_TTL: Duration = Duration::from_secs(60);
/// Largest accepted request (a measurements file is a few KiB).
pub const MAX_OPERATOR_REQUEST_BYTES: usize = 128 * 1024;
pub use keel_proto::MAX_ADMIN_KUBECONFIG_BYTES;
pub use keel_verifier::keys::kind::{
    ADMIN_KUBECONFIG, FINISH_IMAGE_UPGRADE, NODE_STATUS, REVOKE_NODE, SET_JOIN_MEASUREMENTS,
    STAGE_IMAGE_MEASUREMENTS, UPGRADE,
};

/// Why an operator request was refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OperatorError {
    /// The node is in no cluster (yet).
    #[error("this node is in no cluster")]
    NotServing,
    /// The request is for control planes only.
    #[error("this node is not a control plane")]
    NotControlPlane,
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
    /// No measurements signing key was configured at init.
    #[error("no measurements signing key was configured at init (settings: measurements_signing_key); image upgrades are refused")]
    NoSigningKey,
    /// The new image's measurements are not signed with the cluster's key.
    #[error("the measurements file is not signed with the measurements signing key")]
    Signature(#[source] SignatureError),
    /// Staging another file of the set already in force.
    #[error(
        "these measurements are the current set, signed in another file than the one it was made \
         current with: nothing changed (push-measurements replaces the current set's file)"
    )]
    AlreadyCurrent,
    /// Finish with no image rollout in progress.
    #[error("no image measurements are staged; nothing to finish")]
    NothingStaged,
    /// Finish naming a set other than the staged one.
    #[error(
        "the staged image measurements are sha256:{}, not the sha256:{} this request finishes; \
         nothing changed (stage the intended file again, then finish it)",
        hex::encode(staged),
        hex::encode(named)
    )]
    OtherStaged {
        /// The staged set's SHA-256.
        staged: [u8; 32],
        /// The set the request names.
        named: [u8; 32],
    },
    /// A signed file below the image rollback floor: an image older than
    /// one this control plane already made current.
    #[error(
        "the measurements file's epoch {epoch} is below {floor}, the epoch of an image this \
         cluster already made current: an older image is not brought back (a file for a newer \
         image needs an epoch of at least {floor})"
    )]
    Rollback {
        /// The file's epoch.
        epoch: u64,
        /// The floor ([`ClusterState::image_epoch`]).
        floor: u64,
    },
    /// Setting a file whose epoch passes that of the staged set, which
    /// could then never be finished.
    #[error(
        "the staged image's epoch {staged} is below this file's epoch {epoch}; nothing changed \
         (finish the staged image, or stage this file instead)"
    )]
    StagedOlder {
        /// The staged set's epoch.
        staged: u64,
        /// The file's epoch.
        epoch: u64,
    },
    /// The set is staged already with a file of a higher epoch: this file
    /// would lower the floor its finish sets.
    #[error(
        "this image is staged already with a file of epoch {held}; a file of epoch {epoch} \
         would lower the rollback floor its finish sets"
    )]
    RestagedOlder {
        /// The staged file's epoch.
        held: u64,
        /// This file's epoch.
        epoch: u64,
    },
    /// The new measurements could not be stored.
    #[error("storing the measurements failed")]
    Store(#[source] anyhow::Error),
    /// The node to revoke is not known here (the caller is the operator:
    /// the selector is theirs to see).
    #[error("{0}")]
    UnknownNode(String),
    /// The node registry failed.
    #[error("the node registry failed")]
    Registry(#[source] RegistryError),
    /// The upgrade plan does not decode.
    #[error("the upgrade plan does not decode")]
    PlanDecode,
    /// The upgrade was refused before anything changed.
    #[error("upgrade refused: {0}")]
    Upgrade(#[source] UpgradeError),
    /// A control plane that does not serve its cluster yet: its init (or
    /// join, or recovery) has not finished.
    #[error(
        "this control plane has not finished its init (or join, or recovery) and serves no \
         cluster yet: its admin kubeconfig is not ready; wait until it serves (its console \
         says `serving as a control plane`) and ask again"
    )]
    NotFinished,
    /// The admin kubeconfig is not there (or not a regular file).
    #[error(
        "this control plane has no admin kubeconfig (/{ADMIN_CONF} {0}); ask another control \
         plane"
    )]
    NoKubeconfig(&'static str),
    /// The admin kubeconfig is larger than this API sends.
    #[error(
        "this control plane's admin kubeconfig (/{ADMIN_CONF}) is larger than {MAX_ADMIN_KUBECONFIG_BYTES} \
         bytes, far more than kubeadm writes: not sent; inspect the file on the node"
    )]
    KubeconfigTooLarge,
    /// Reading the admin kubeconfig failed.
    #[error("reading the admin kubeconfig (/{ADMIN_CONF}) failed")]
    ReadKubeconfig(#[source] std::io::Error),
}

impl From<FactsError> for OperatorError {
    fn from(e: FactsError) -> Self {
        Self::Store(e.into())
    }
}

impl From<&OperatorError> for tonic::Status {
    fn from(e: &OperatorError) -> Self {
        use OperatorError as E;
        let code = match e {
            E::NotServing
            | E::NotControlPlane
            | E::NoSigningKey
            | E::NothingStaged
            | E::OtherStaged { .. }
            | E::AlreadyCurrent
            | E::Rollback { .. }
            | E::StagedOlder { .. }
            | E::RestagedOlder { .. }
            | E::NotFinished
            | E::NoKubeconfig(_)
            | E::KubeconfigTooLarge => tonic::Code::FailedPrecondition,
            E::Signature(_) => tonic::Code::PermissionDenied,
            E::Challenge | E::Proof => tonic::Code::PermissionDenied,
            E::Throttled(seconds) => return keel_proto::held_back(e.to_string(), *seconds),
            E::Measurements(_) => tonic::Code::InvalidArgument,
            E::UnknownNode(_) => tonic::Code::NotFound,
            E::Registry(RegistryError::RevocationsFull { .. }) => tonic::Code::ResourceExhausted,
            E::Store(e) if matches!(e.downcast_ref(), Some(FactsError::TooLarge(_))) => {
                tonic::Code::ResourceExhausted
            }
            E::Store(_) | E::Registry(_) | E::ReadKubeconfig(_) => tonic::Code::Internal,
            E::PlanDecode => tonic::Code::InvalidArgument,
            E::Upgrade(u) => match u {
                UpgradeError::Version(_) | UpgradeError::Plan(_) => tonic::Code::InvalidArgument,
                UpgradeError::Unsigned(_) => tonic::Code::PermissionDenied,
                UpgradeError::Busy => tonic::Code::Aborted,
                UpgradeError::Facts(FactsError::TooLarge(_)) => tonic::Code::ResourceExhausted,
                _ => tonic::Code::FailedPrecondition,
            },
        };
        // The caller is the operator: causes are theirs to see.
        let message = match e {
            E::Upgrade(u) => format!("upgrade refused: {}", keel_atls::ErrorChain(u)),
            E::Store(_) | E::ReadKubeconfig(_) => keel_atls::ErrorChain(e).to_string(),
            E::Registry(full @ RegistryError::RevocationsFull { .. }) => full.to_string(),
            other => other.to_string(),
        };
        tonic::Status::new(code, message)
    }
}

/// Where a node that joined keeps the operator key its ticket carried.
#[derive(Debug, Default)]
pub struct OperatorKeySlot(Mutex<Option<OperatorKey>>);

impl OperatorKeySlot {
    /// Keeps `key` (a later ticket's replaces an earlier one's).
    pub fn set(&self, key: OperatorKey) {
        *self.0.lock().unwrap_or_else(PoisonError::into_inner) = Some(key);
    }

    /// Whether a key is kept.
    pub fn is_set(&self) -> bool {
        self.get().is_some()
    }

    fn get(&self) -> Option<OperatorKey> {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

/// The checks every operator request passes: a fresh single-use
/// challenge, a proof with this node's operator key, and the backoff of
/// addresses that sent wrong proofs.
pub struct OperatorAuth {
    own_ek: EkDigest,
    cluster: Arc<ClusterSlot>,
    joined: Arc<OperatorKeySlot>,
    challenges: Challenges,
    throttle: FailureThrottle,
}

/// Challenges made and checked without state per challenge: issue time
/// (milliseconds since this process made the key, 8 bytes), 8 random
/// bytes, and the first 16 bytes of HMAC-SHA256 over both with a key
/// that never leaves this process.
struct Challenges {
    key: zeroize::Zeroizing<[u8; 32]>,
    epoch: Instant,
    /// The MACs of challenges spent by a valid proof, with when they were
    /// spent; dropped once the challenge could no longer be valid.
    spent: Mutex<HashMap<[u8; 16], Instant>>,
}

impl Challenges {
    fn new() -> Self {
        let mut key = zeroize::Zeroizing::new([0u8; 32]);
        rand::rngs::OsRng.fill_bytes(&mut *key);
        Self {
            key,
            epoch: Instant::now(),
            spent: Mutex::new(HashMap::new()),
        }
    }

    fn mac(&self, issued_and_random: &[u8]) -> Option<[u8; 16]> {
        use hmac::Mac as _;
        let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(&*self.key).ok()?;
        mac.update(b"keel operator challenge v1\0");
        mac.update(issued_and_random);
        let mut tag = [0u8; 16];
        tag.copy_from_slice(mac.finalize().into_bytes().get(..16)?);
        Some(tag)
    }

    fn issue(&self) -> [u8; 32] {
        let mut challenge = [0u8; 32];
        let issued = u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX);
        challenge[..8].copy_from_slice(&issued.to_be_bytes());
        rand::rngs::OsRng.fill_bytes(&mut challenge[8..16]);
        // (HMAC takes any key: the MAC is always there; a challenge
        // without one would be refused.)
        let tag = self.mac(&challenge[..16]).unwrap_or_default();
        challenge[16..].copy_from_slice(&tag);
        challenge
    }

    /// The challenge's MAC if this process issued it less than
    /// [`CHALLENGE_TTL`] ago.
    fn check(&self, challenge: &[u8]) -> Option<[u8; 16]> {
        let challenge: &[u8; 32] = challenge.try_into().ok()?;
        let tag = self.mac(&challenge[..16])?;
        if !bool::from(tag.as_slice().ct_eq(&challenge[16..])) {
            return None;
        }
        let mut issued = [0u8; 8];
        issued.copy_from_slice(&challenge[..8]);
        let age = self
            .epoch
            .elapsed()
            .checked_sub(Duration::from_millis(u64::from_be_bytes(issued)))?;
        (age < CHALLENGE_TTL).then_some(tag)
    }

    /// Marks the challenge of MAC `tag` spent; false if it already was.
    fn spend(&self, tag: [u8; 16]) -> bool {
        let mut spent = self.spent.lock().unwrap_or_else(PoisonError::into_inner);
        spent.retain(|_, at| at.elapsed() < CHALLENGE_TTL);
        spent.insert(tag, Instant::now()).is_none()
    }
}

impl OperatorAuth {
    /// The checks of the node whose EK digest is `own_ek`: a control plane
    /// derives its key from the keys in `cluster`, any other member uses
    /// the key its ticket left in `joined`.
    pub fn new(own_ek: EkDigest, cluster: Arc<ClusterSlot>, joined: Arc<OperatorKeySlot>) -> Self {
        Self {
            own_ek,
            cluster,
            joined,
            challenges: Challenges::new(),
            throttle: FailureThrottle::default(),
        }
    }

    /// The same checks with another backoff for addresses that sent wrong
    /// proofs: `first` after the first, doubling up to `max` (by default
    /// 1 s and 60 s).
    pub fn with_failure_backoff(mut self, first: Duration, max: Duration) -> Self {
        self.throttle = FailureThrottle::new(first, max);
        self
    }

    /// A fresh challenge.
    pub fn challenge(&self) -> [u8; 32] {
        self.challenges.issue()
    }

    /// This node's operator key, once it is a member.
    fn key(&self) -> Option<OperatorKey> {
        let state = self.cluster.borrow().clone();
        match state {
            Some(state) => state.keys.operator_key(&self.own_ek).ok(),
            None => self.joined.get(),
        }
    }

    /// Accepts a request of `kind` with `body` from `peer` only with a
    /// valid `proof` for an outstanding `challenge` (which it spends).
    ///
    /// A valid proof is accepted from any address, one that is waiting
    /// after wrong proofs included: the throttle would otherwise let anyone
    /// behind the operator's address (a NAT, a load balancer) keep the
    /// operator from revoking a node by sending a wrong proof now and then.
    /// A proof costs a MAC to check, and a guess has no chance against its
    /// 256-bit key; what the throttle bounds is the failures an address
    /// gets counted and logged: a wrong proof from a waiting address is
    /// refused as throttled, neither counted nor logged.
    pub fn authorize(
        &self,
        kind: &str,
        challenge: &[u8],
        body: &[u8],
        proof: &[u8],
        peer: Option<IpAddr>,
    ) -> Result<(), OperatorError> {
        let key = self.key().ok_or(OperatorError::NotServing)?;
        // Spent only by a valid proof, at once (two copies of one request
        // racing: one is refused).
        let proven = self.challenges.check(challenge).is_some_and(|tag| {
            key.verifies(kind, challenge, body, proof) && self.challenges.spend(tag)
        });
        if proven {
            if let Some(ip) = peer {
                self.throttle.succeeded(ip);
            }
            return Ok(());
        }
        if let Some(ip) = peer {
            self.throttle
                .check(ip)
                .map_err(|wait| OperatorError::Throttled(wait.as_secs().max(1)))?;
            let (failures, wait) = self.throttle.failed(ip);
            tracing::warn!(peer = %ip, kind, failures, wait_s = wait.as_secs_f64(), "operator request refused: no valid proof");
        }
        Err(OperatorError::Proof)
    }
}

/// Checks that `body` carries a valid detached `signature` by the cluster's
/// measurements signing `key`, over exactly those bytes, and is a
/// measurements file: the one check of every signed set (staged, or
/// replacing the current one). A bad signature is `PermissionDenied`.
fn verify_signed(
    key: &SigningPublicKey,
    body: &[u8],
    signature: &[u8],
) -> Result<SignedMeasurements, OperatorError> {
    SignedMeasurements::verify(key, body, signature).map_err(|e| match e {
        SignedMeasurementsError::Signature(e) => OperatorError::Signature(e),
        other => OperatorError::Measurements(other.to_string()),
    })
}

/// Refuses `signed` if its epoch is below the image rollback floor of
/// `state`.
fn not_rolled_back(state: &ClusterState, signed: &SignedMeasurements) -> Result<(), OperatorError> {
    if signed.epoch() < state.image_epoch {
        return Err(OperatorError::Rollback {
            epoch: signed.epoch(),
            floor: state.image_epoch,
        });
    }
    Ok(())
}

/// The operator service of a node.
#[derive(Clone)]
pub struct OperatorServer {
    inner: Arc<Inner>,
    /// The join service's disk bindings: a revocation names a node's disk
    /// only if they bind it to the node's EK (`None`: never).
    disks: Option<Arc<DiskBindings>>,
}

struct Inner {
    auth: OperatorAuth,
    cluster: Arc<ClusterSlot>,
    /// The file a control plane's join service reads (`None` elsewhere).
    measurements: Option<PathBuf>,
    root: PathBuf,
    upgrader: Option<Arc<Upgrader>>,
}

impl OperatorServer {
    /// The operator service of a node checked by `auth`, whose cluster
    /// state (a control plane's) appears in `cluster`, whose join service
    /// reads `measurements` (control planes), whose facts live under
    /// `root`, and whose upgrades `upgrader` runs.
    pub fn new(
        auth: OperatorAuth,
        cluster: Arc<ClusterSlot>,
        measurements: Option<PathBuf>,
        root: PathBuf,
        upgrader: Option<Upgrader>,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                auth,
                cluster,
                measurements,
                root,
                upgrader: upgrader.map(Arc::new),
            }),
            disks: None,
        }
    }

    /// The same service, naming in a revocation the revoked node's disk
    /// when `disks` (the join service's binding store) binds it to the
    /// node's EK; without it a revocation names the EK only.
    pub fn with_disk_bindings(mut self, disks: Arc<DiskBindings>) -> Self {
        self.disks = Some(disks);
        self
    }

    /// The tonic service, requests bounded to [`MAX_OPERATOR_REQUEST_BYTES`].
    pub fn into_service(self) -> OperatorServiceServer<Self> {
        OperatorServiceServer::new(self).max_decoding_message_size(MAX_OPERATOR_REQUEST_BYTES)
    }

    /// A fresh challenge.
    pub fn challenge(&self) -> [u8; 32] {
        self.inner.auth.challenge()
    }

    /// Changes the accepted measurements of a control plane with `update`
    /// (given the state in force), one change at a time: the files the
    /// join service re-reads, the facts on the state disk and the cluster
    /// state the next tickets carry. Returns the new state.
    fn change(
        &self,
        update: impl FnOnce(&ClusterState) -> Result<ClusterState, OperatorError>,
    ) -> Result<Arc<ClusterState>, OperatorError> {
        let inner = &self.inner;
        let path = inner
            .measurements
            .as_ref()
            .ok_or(OperatorError::NotControlPlane)?;
        // The facts first, then the file the join service reads: a change
        // whose facts fail to save is not enforced meanwhile (to be undone
        // by the next reboot).
        change_state_then(&inner.cluster, &inner.root, update, |updated| {
            write_accepted(
                path,
                &updated.join_measurements,
                updated.staged_measurements.as_ref(),
            )
            .map_err(|e| OperatorError::Store(e.into()))
        })?
        .ok_or(OperatorError::NotControlPlane)
    }

    /// Replaces the join measurements, for a request from `peer`; returns
    /// the SHA-256 of the measurements now in force. A staged set stays.
    /// With a measurements signing key configured, the file must be signed
    /// with it (`verify_signed`) and its signed file replaces those of
    /// sets no longer accepted, refused below the image rollback floor or
    /// above the staged file's epoch, raising the floor to its own;
    /// without one, the operator's proof suffices (a signature sent is
    /// then ignored).
    pub fn set_join_measurements(
        &self,
        request: &SetJoinMeasurementsRequest,
        peer: Option<IpAddr>,
    ) -> Result<[u8; 32], OperatorError> {
        self.inner.auth.authorize(
            SET_JOIN_MEASUREMENTS,
            &request.challenge,
            &request.measurements,
            &request.proof,
            peer,
        )?;
        let updated = self.change(|state| {
            let staged = state.staged_measurements.clone();
            let Some(key) = &state.measurements_key else {
                let measurements = Measurements::parse(&request.measurements)
                    .map_err(|e| OperatorError::Measurements(e.to_string()))?;
                return Ok(state.with_measurements(measurements, staged));
            };
            let signed = verify_signed(key, &request.measurements, &request.signature)?;
            not_rolled_back(state, &signed)?;
            let epoch = signed.epoch();
            if let Some(staged) = &staged {
                let staged = state.epoch_of(staged);
                if staged < epoch {
                    return Err(OperatorError::StagedOlder { staged, epoch });
                }
            }
            let mut updated = state
                .with_measurements(signed.measurements().clone(), staged)
                .with_signed(signed)
                .without_retired_signed();
            updated.image_epoch = updated.image_epoch.max(epoch);
            Ok(updated)
        })?;
        let digest = updated.join_measurements.digest();
        tracing::info!(digest = %hex::encode(digest), "join measurements replaced by the operator");
        Ok(digest)
    }

    /// Stages a new image's measurements as a second accepted set, for a
    /// request from `peer`: the file must be signed with the cluster's
    /// measurements signing key, carry an epoch no lower than the image
    /// rollback floor and enforce what every set must. The current set's
    /// own file withdraws a staged set (staged and current are then the
    /// same); another file of the current set is refused. Returns
    /// the SHA-256 of the staged set and of the current one.
    pub fn stage_image_measurements(
        &self,
        request: &StageImageMeasurementsRequest,
        peer: Option<IpAddr>,
    ) -> Result<([u8; 32], [u8; 32]), OperatorError> {
        self.inner.auth.authorize(
            STAGE_IMAGE_MEASUREMENTS,
            &request.challenge,
            &request.measurements,
            &request.proof,
            peer,
        )?;
        let updated = self.change(|state| {
            let key = state
                .measurements_key
                .as_ref()
                .ok_or(OperatorError::NoSigningKey)?;
            let signed = verify_signed(key, &request.measurements, &request.signature)?;
            not_rolled_back(state, &signed)?;
            if signed.measurements() == &state.join_measurements {
                // The file the current set was made current with: the
                // rollout of any other set is withdrawn (a retry after a
                // finish changes nothing). Another file of the current set
                // would replace that one, epoch and all, without a finish.
                let held = state
                    .signed_measurements
                    .iter()
                    .any(|s| s.body() == signed.body());
                if !held {
                    return Err(OperatorError::AlreadyCurrent);
                }
                return Ok(state
                    .with_measurements(state.join_measurements.clone(), None)
                    .without_retired_signed());
            }
            let staged = signed.measurements().clone();
            // The staged set again: its file may be replaced by one of the
            // same or a higher epoch, never a lower one (the finish, which
            // names only the set, takes the floor from the file held).
            if state.staged_measurements.as_ref() == Some(&staged) {
                let held = state.epoch_of(&staged);
                if signed.epoch() < held {
                    return Err(OperatorError::RestagedOlder {
                        held,
                        epoch: signed.epoch(),
                    });
                }
            }
            // A set staged before and replaced now is retired with its
            // signed file; the current set's stays.
            Ok(state
                .with_measurements(state.join_measurements.clone(), Some(staged))
                .with_signed(signed)
                .without_retired_signed())
        })?;
        let current = updated.join_measurements.digest();
        let Some(staged) = updated
            .staged_measurements
            .as_ref()
            .map(Measurements::digest)
        else {
            tracing::info!(current = %hex::encode(current), "the current image staged by the operator: no other image is staged");
            return Ok((current, current));
        };
        tracing::info!(staged = %hex::encode(staged), current = %hex::encode(current), "new image measurements staged by the operator");
        Ok((staged, current))
    }

    /// Ends an image rollout, for a request from `peer`: the staged set
    /// becomes the only accepted set, if it is the one the request names,
    /// and its file's epoch the image rollback floor. Returns its SHA-256.
    pub fn finish_image_upgrade(
        &self,
        request: &FinishImageUpgradeRequest,
        peer: Option<IpAddr>,
    ) -> Result<[u8; 32], OperatorError> {
        self.inner.auth.authorize(
            FINISH_IMAGE_UPGRADE,
            &request.challenge,
            &request.staged_digest,
            &request.proof,
            peer,
        )?;
        let named: [u8; 32] = request.staged_digest.as_slice().try_into().map_err(|_| {
            OperatorError::Measurements("the staged set's SHA-256 must be 32 bytes".into())
        })?;
        let updated = self.change(|state| {
            let Some(staged) = state.staged_measurements.clone() else {
                // Finished already, and asked again (its file could not be
                // written the first time): the same state, written again.
                if state.join_measurements.digest() == named {
                    return Ok(state.clone());
                }
                return Err(OperatorError::NothingStaged);
            };
            let digest = staged.digest();
            if named != digest {
                return Err(OperatorError::OtherStaged {
                    staged: digest,
                    named,
                });
            }
            // Staged at or above the floor, which only a set can raise,
            // and not past a staged set: checked again all the same.
            let epoch = state.epoch_of(&staged);
            if epoch < state.image_epoch {
                return Err(OperatorError::Rollback {
                    epoch,
                    floor: state.image_epoch,
                });
            }
            // The old image's signed file goes too.
            let mut updated = state
                .with_measurements(staged, None)
                .without_retired_signed();
            updated.image_epoch = epoch;
            Ok(updated)
        })?;
        let digest = updated.join_measurements.digest();
        tracing::info!(digest = %hex::encode(digest), "image upgrade finished: the staged measurements are the only ones accepted");
        Ok(digest)
    }

    /// The node registry of this control plane (on its state disk, which
    /// is mounted once it serves a cluster).
    fn registry(&self) -> Result<Arc<RegistryStore>, OperatorError> {
        if self.inner.measurements.is_none() {
            return Err(OperatorError::NotControlPlane);
        }
        RegistryStore::shared(&self.inner.root).map_err(OperatorError::Registry)
    }

    /// Puts the node `request.node` names on the revocation list, for a
    /// request from `peer`.
    pub fn revoke_node(
        &self,
        request: &RevokeNodeRequest,
        peer: Option<IpAddr>,
    ) -> Result<Revocation, OperatorError> {
        self.inner.auth.authorize(
            REVOKE_NODE,
            &request.challenge,
            request.node.as_bytes(),
            &request.proof,
            peer,
        )?;
        let selector = request.node.clone();
        let disks = self.disks.as_deref();
        let registry = self.registry()?;
        // The disk bound to the node's EK is looked up before the
        // registry's lock is taken: the lookup may wait on the disk
        // bindings' writes, which joins and evidence must not wait behind.
        let looked_up = registry
            .snapshot_of(&selector)
            .map(|record| (BoundDisk::of_record(disks, &record), record));
        let revocation = registry.update(|r| {
            let record = match r.find(&selector) {
                Ok(record) => record.clone(),
                // An EK, whole, that no node record here names (the node
                // joined through another control plane, this one has not
                // merged it yet, or it is revoked already): revoked by
                // the EK alone, so the list goes on from here too.
                Err(RegistryError::UnknownNode(what)) => match whole_ek(&selector) {
                    Some(ek) => return r.revoke_ek(&ek, "revoked by the operator"),
                    None => return Err(RegistryError::UnknownNode(what)),
                },
                Err(e) => return Err(e),
            };
            // The record changed since the lookup (rare): looked up again.
            let disk = match &looked_up {
                Some((disk, seen)) if *seen == record => disk.clone(),
                _ => BoundDisk::of_record(disks, &record),
            };
            r.revoke(&record, disk.as_ref(), "revoked by the operator")
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
        self.inner
            .auth
            .authorize(NODE_STATUS, &request.challenge, &[], &request.proof, peer)?;
        Ok(self.registry()?.snapshot().to_json())
    }

    /// This control plane's admin kubeconfig, for a request from `peer`
    /// ([`read_admin_kubeconfig`]). A worker, and a control plane that does
    /// not serve its cluster yet, are refused before the proof is checked:
    /// neither says more than its attestation and the proof check would.
    pub fn admin_kubeconfig(
        &self,
        request: &AdminKubeconfigRequest,
        peer: Option<IpAddr>,
    ) -> Result<Zeroizing<Vec<u8>>, OperatorError> {
        if self.inner.measurements.is_none() {
            return Err(OperatorError::NotControlPlane);
        }
        if self.inner.cluster.borrow().is_none() {
            return Err(OperatorError::NotFinished);
        }
        self.inner.auth.authorize(
            ADMIN_KUBECONFIG,
            &request.challenge,
            &[],
            &request.proof,
            peer,
        )?;
        let kubeconfig = read_admin_kubeconfig(&self.inner.root)?;
        tracing::info!(
            ?peer,
            bytes = kubeconfig.len(),
            "admin kubeconfig sent to the operator"
        );
        Ok(kubeconfig)
    }
}

/// The admin kubeconfig under the node root `root` ([`ADMIN_CONF`]): a
/// regular file (a link, a FIFO or a directory is not read) of at most
/// [`MAX_ADMIN_KUBECONFIG_BYTES`], read into a buffer wiped when dropped.
/// Blocks; call it off the async runtime.
pub fn read_admin_kubeconfig(root: &Path) -> Result<Zeroizing<Vec<u8>>, OperatorError> {
    let limit = MAX_ADMIN_KUBECONFIG_BYTES as u64;
    // `read_secret` opens it through no link and reads only a regular file
    // up to the bound: its errors say which.
    crate::files::read_secret(&root.join(ADMIN_CONF), limit).map_err(|e| match e.kind() {
        // Only the bound makes an error of this kind.
        std::io::ErrorKind::Other => OperatorError::KubeconfigTooLarge,
        std::io::ErrorKind::NotFound => OperatorError::NoKubeconfig("is missing"),
        // Not a regular file, or a link (`O_NOFOLLOW`: ELOOP).
        std::io::ErrorKind::InvalidInput => OperatorError::NoKubeconfig("is not a file"),
        _ if e.raw_os_error() == Some(nix::libc::ELOOP) => {
            OperatorError::NoKubeconfig("is not a file")
        }
        _ => OperatorError::ReadKubeconfig(e),
    })
}

/// The EK `selector` names as an EK digest prints itself (`sha256:` and
/// 64 lower-case hex digits), if it is one.
pub(crate) fn whole_ek(selector: &str) -> Option<EkDigest> {
    selector
        .strip_prefix("sha256:")
        .and_then(EkDigest::from_hex)
        .filter(|ek| ek.to_string() == selector)
}

/// Runs `op` on a blocking thread: the operator's changes write and sync
/// files, and a status encodes the whole registry.
async fn off_the_runtime<T: Send + 'static>(
    server: &OperatorServer,
    op: impl FnOnce(&OperatorServer) -> Result<T, OperatorError> + Send + 'static,
) -> Result<T, OperatorError> {
    let server = server.clone();
    tokio::task::spawn_blocking(move || op(&server))
        .await
        .map_err(|_| OperatorError::Store(anyhow::anyhow!("the operator request's task failed")))?
}

/// The tonic form of an operator result: refusals are logged with their
/// chain and sent with their code and message. A refusal as throttled, or
/// for what the node is (in no cluster, not a control plane, not serving
/// yet), costs its sender nothing, so it is logged at debug level only: a
/// flood of them must not push other events out of the journal's rate
/// limit.
fn respond<T>(
    result: Result<T, OperatorError>,
    caller: &crate::grpc::Caller,
) -> Result<tonic::Response<T>, tonic::Status> {
    match result {
        Ok(response) => {
            caller.vouch();
            Ok(tonic::Response::new(response))
        }
        Err(e) => Err(refused(&e)),
    }
}

/// Logs a refused operator request as [`respond`] says, and makes its
/// status.
fn refused(e: &OperatorError) -> tonic::Status {
    match e {
        OperatorError::Throttled(_)
        | OperatorError::NotServing
        | OperatorError::NotControlPlane
        | OperatorError::NotFinished => {
            tracing::debug!(error = %e, "operator request refused");
        }
        _ => tracing::warn!(error = %keel_atls::ErrorChain(e), "operator request refused"),
    }
    e.into()
}

impl OperatorServer {
    /// Starts the upgrade `request` from `peer` asks for, once the proof
    /// verifies and the plan passes the node's checks (nothing changed on
    /// a refusal); returns the stream of its progress, which ends with
    /// done or failed. The upgrade runs to its end even if the caller goes.
    pub async fn start_upgrade(
        &self,
        request: &UpgradeRequest,
        peer: Option<IpAddr>,
    ) -> Result<transcript::Receiver<Event>, OperatorError> {
        self.inner.auth.authorize(
            UPGRADE,
            &request.challenge,
            &request.plan,
            &request.proof,
            peer,
        )?;
        let upgrader = self
            .inner
            .upgrader
            .clone()
            .ok_or(OperatorError::NotServing)?;
        let plan =
            UpgradePlan::decode(request.plan.as_slice()).map_err(|_| OperatorError::PlanDecode)?;
        let target = upgrader.target(plan).map_err(OperatorError::Upgrade)?;
        let (log, rx) = Transcript::<Event>::new();
        if target.step == Step::Authorise {
            // It saves the facts (a write and its fsync on the state disk).
            let (authoriser, authorised) = (upgrader.clone(), target.clone());
            off_the_runtime(self, move |_| {
                authoriser
                    .authorise(&authorised)
                    .map_err(OperatorError::Upgrade)
            })
            .await?;
            let version = target.version.to_string();
            log.finish([Event::Done(UpgradeDone {
                kubernetes_version: version.clone(),
                previous_version: version,
                millis: 0,
            })])
            .await;
            return Ok(rx);
        }
        let turn = upgrader.check(&target).map_err(OperatorError::Upgrade)?;
        tracing::info!(version = %target.version, step = ?target.step, "upgrade requested by the operator");
        tokio::spawn(async move {
            let line = |l: String| log.line(l);
            let last = match upgrader.run(&target, turn, &line).await {
                Ok(done) => Event::Done(UpgradeDone {
                    kubernetes_version: done.version.to_string(),
                    previous_version: done.previous.to_string(),
                    millis: u64::try_from(done.elapsed.as_millis()).unwrap_or(u64::MAX),
                }),
                Err(failure) => {
                    let error = keel_atls::ErrorChain(&failure.error).to_string();
                    tracing::error!(%error, rolled_back = failure.rolled_back, "upgrade failed");
                    Event::Failed(UpgradeFailed {
                        error,
                        rolled_back: failure.rolled_back,
                        running_version: failure.running.map(|v| v.to_string()).unwrap_or_default(),
                        switched: failure.switched,
                    })
                }
            };
            log.finish([last]).await;
        });
        Ok(rx)
    }
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

    type UpgradeStream =
        ReceiverStream<Result<keel_proto::operator::UpgradeResponse, tonic::Status>>;

    async fn upgrade(
        &self,
        request: tonic::Request<UpgradeRequest>,
    ) -> Result<tonic::Response<Self::UpgradeStream>, tonic::Status> {
        let caller = crate::grpc::Caller::of(&request);
        let _open = caller.protect();
        match self.start_upgrade(request.get_ref(), caller.ip()).await {
            Ok(rx) => {
                caller.vouch();
                Ok(tonic::Response::new(ReceiverStream::new(rx)))
            }
            // Refused as every other operator request is: a flood of
            // unproven ones is not logged each at warn level.
            Err(e) => Err(refused(&e)),
        }
    }

    async fn set_join_measurements(
        &self,
        request: tonic::Request<SetJoinMeasurementsRequest>,
    ) -> Result<tonic::Response<SetJoinMeasurementsResponse>, tonic::Status> {
        let caller = crate::grpc::Caller::of(&request);
        let _open = caller.protect();
        let peer = caller.ip();
        let request = request.into_inner();
        respond(
            off_the_runtime(self, move |s| s.set_join_measurements(&request, peer))
                .await
                .map(|digest| SetJoinMeasurementsResponse {
                    digest: digest.to_vec(),
                }),
            &caller,
        )
    }

    async fn stage_image_measurements(
        &self,
        request: tonic::Request<StageImageMeasurementsRequest>,
    ) -> Result<tonic::Response<StageImageMeasurementsResponse>, tonic::Status> {
        let caller = crate::grpc::Caller::of(&request);
        let _open = caller.protect();
        let peer = caller.ip();
        let request = request.into_inner();
        respond(
            off_the_runtime(self, move |s| s.stage_image_measurements(&request, peer))
                .await
                .map(|(staged, current)| StageImageMeasurementsResponse {
                    staged_digest: staged.to_vec(),
                    current_digest: current.to_vec(),
                }),
            &caller,
        )
    }

    async fn finish_image_upgrade(
        &self,
        request: tonic::Request<FinishImageUpgradeRequest>,
    ) -> Result<tonic::Response<FinishImageUpgradeResponse>, tonic::Status> {
        let caller = crate::grpc::Caller::of(&request);
        let _open = caller.protect();
        let peer = caller.ip();
        let request = request.into_inner();
        respond(
            off_the_runtime(self, move |s| s.finish_image_upgrade(&request, peer))
                .await
                .map(|digest| FinishImageUpgradeResponse {
                    digest: digest.to_vec(),
                }),
            &caller,
        )
    }

    async fn revoke_node(
        &self,
        request: tonic::Request<RevokeNodeRequest>,
    ) -> Result<tonic::Response<RevokeNodeResponse>, tonic::Status> {
        let caller = crate::grpc::Caller::of(&request);
        let _open = caller.protect();
        let peer = caller.ip();
        let request = request.into_inner();
        respond(
            off_the_runtime(self, move |s| s.revoke_node(&request, peer))
                .await
                .map(|r| RevokeNodeResponse {
                    name: r.name,
                    ek: r.ek,
                    disk_uuid: r.disk_uuid,
                }),
            &caller,
        )
    }

    async fn node_status(
        &self,
        request: tonic::Request<NodeStatusRequest>,
    ) -> Result<tonic::Response<NodeStatusResponse>, tonic::Status> {
        let caller = crate::grpc::Caller::of(&request);
        let _open = caller.protect();
        let peer = caller.ip();
        let request = request.into_inner();
        respond(
            off_the_runtime(self, move |s| s.node_status(&request, peer))
                .await
                // The registry's times are on this clock: the operator
                // counts their ages from it.
                .map(|registry| NodeStatusResponse {
                    registry,
                    served_at: crate::registry::now(),
                }),
            &caller,
        )
    }

    async fn admin_kubeconfig(
        &self,
        request: tonic::Request<AdminKubeconfigRequest>,
    ) -> Result<tonic::Response<AdminKubeconfigResponse>, tonic::Status> {
        let caller = crate::grpc::Caller::of(&request);
        let _open = caller.protect();
        let peer = caller.ip();
        let request = request.into_inner();
        respond(
            off_the_runtime(self, move |s| s.admin_kubeconfig(&request, peer))
                .await
                // Moved out, not copied: the wiped buffer is left empty.
                .map(|mut kubeconfig| AdminKubeconfigResponse {
                    kubeconfig: std::mem::take(&mut *kubeconfig),
                }),
            &caller,
        )
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;
    use keel_testkit::logs::Captured;
    use keel_verifier::keys::KeyService;
    use keel_verifier::measurements::{Expected, REQUIRED_PCRS};

    /// A control plane's cluster state, keys and all (no TPM needed: the
    /// operator API only derives this node's operator key from it).
    fn state() -> ClusterState {
        ClusterState {
            keys: Arc::new(KeyService::new(&[1; 32], &[2; 32]).unwrap()),
            measurement_salt: vec![3; 32],
            measurement_secret: Zeroizing::new(vec![4; 32]),
            cluster_id: [5; 32],
            kubernetes_version: keel_installer::resolve("v1.30").unwrap().version(),
            components: Vec::new(),
            authorised_components: Vec::new(),
            api_server: "192.0.2.1:6443".parse().unwrap(),
            pki_dir: PathBuf::from("etc/kubernetes/pki"),
            join_measurements: Measurements::new(
                REQUIRED_PCRS
                    .iter()
                    .map(|&pcr| (pcr, Expected::enforced([6; 32]))),
            )
            .unwrap(),
            staged_measurements: None,
            measurements_key: None,
            signed_measurements: Vec::new(),
            image_epoch: 0,
            control_plane_endpoints: Vec::new(),
        }
    }

    /// A node's operator service with its root in `root`: a control plane
    /// (serving its cluster once `slot` holds a state) or a worker.
    fn server(root: &Path, slot: &Arc<ClusterSlot>, control_plane: bool) -> OperatorServer {
        let hour = Duration::from_secs(3600);
        let auth = OperatorAuth::new(own_ek(), slot.clone(), Arc::default())
            .with_failure_backoff(hour, hour);
        let measurements = control_plane.then(|| root.join("work/join-measurements.json"));
        OperatorServer::new(auth, slot.clone(), measurements, root.to_owned(), None)
    }

    fn own_ek() -> EkDigest {
        EkDigest::of_marshalled(b"this node's EK")
    }

    /// A request for the kubeconfig on a fresh challenge of `server`, proven
    /// with `key`.
    fn request(server: &OperatorServer, key: &OperatorKey) -> AdminKubeconfigRequest {
        let challenge = server.challenge();
        AdminKubeconfigRequest {
            challenge: challenge.to_vec(),
            proof: key.prove(ADMIN_KUBECONFIG, &challenge, &[]).to_vec(),
        }
    }

    fn code(e: &OperatorError) -> tonic::Code {
        tonic::Status::from(e).code()
    }

    fn write_kubeconfig(root: &Path, content: &[u8]) {
        let path = root.join(ADMIN_CONF);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, content).unwrap();
    }

    /// Anyone who reaches the init port may send `Upgrade` with a junk
    /// proof, again and again: each refusal is logged at debug level, as
    /// for every other operator request, so that a flood of them does not
    /// push the node's other events out of the journal's rate limit.
    #[tokio::test]
    async fn an_unproven_upgrade_is_refused_without_a_warning() {
        let dir = tempfile::tempdir().unwrap();
        let server = server(dir.path(), &Arc::new(ClusterSlot::new(None)), true);
        let (captured, _default) = Captured::debug_log();
        for _ in 0..3 {
            let request = tonic::Request::new(UpgradeRequest {
                challenge: server.challenge().to_vec(),
                proof: vec![0; 32],
                ..Default::default()
            });
            assert!(OperatorService::upgrade(&server, request).await.is_err());
        }
        let log = captured.text();
        assert!(log.contains("operator request refused"), "{log}");
        assert!(!log.contains("WARN"), "{log}");
    }

    /// What [`refused`] logs for `e`, at debug level and above.
    fn refusal_log(e: &OperatorError) -> String {
        let (captured, default) = Captured::debug_log();
        refused(e);
        drop(default);
        captured.text()
    }

    /// A flood against a member: its first wrong proof is a warning, and
    /// every request while the address is throttled (or the node cannot
    /// serve it) is logged at debug level, whatever the caller sends.
    #[test]
    fn only_the_first_refusals_of_a_flood_are_warnings() {
        let log = refusal_log(&OperatorError::Proof);
        assert!(
            log.contains("WARN") && log.contains("operator request refused"),
            "{log}"
        );
        for quiet in [
            OperatorError::Throttled(5),
            OperatorError::NotServing,
            OperatorError::NotControlPlane,
            OperatorError::NotFinished,
        ] {
            let log = refusal_log(&quiet);
            assert!(
                log.contains("DEBUG") && log.contains("operator request refused"),
                "{log}"
            );
            assert!(!log.contains("WARN"), "{quiet}: {log}");
        }
    }

    #[test]
    fn the_operator_gets_the_admin_kubeconfig_and_no_one_else_does() {
        let dir = tempfile::tempdir().unwrap();
        let slot = Arc::new(ClusterSlot::new(None));
        let server = server(dir.path(), &slot, true);
        let state = state();
        let key = state.keys.operator_key(&own_ek()).unwrap();
        write_kubeconfig(dir.path(), b"apiVersion: v1\nkind: Config\n");

        // Not serving yet (init under way): refused with what to do,
        // whatever the proof.
        let e = server
            .admin_kubeconfig(&request(&server, &key), None)
            .unwrap_err();
        assert_eq!(code(&e), tonic::Code::FailedPrecondition, "{e}");
        assert!(e.to_string().contains("has not finished its init"), "{e}");
        slot.send_replace(Some(Arc::new(state.clone())));

        // The operator's proof: the file, as it is on the node.
        let sent = server
            .admin_kubeconfig(&request(&server, &key), None)
            .unwrap();
        assert_eq!(sent.as_slice(), b"apiVersion: v1\nkind: Config\n");

        // Another node's key, a proof for another kind, a replayed request.
        let other = state
            .keys
            .operator_key(&EkDigest::of_marshalled(b"another EK"))
            .unwrap();
        let e = server
            .admin_kubeconfig(&request(&server, &other), None)
            .unwrap_err();
        assert!(matches!(e, OperatorError::Proof), "{e}");
        assert_eq!(code(&e), tonic::Code::PermissionDenied);
        let challenge = server.challenge();
        let status_proof = AdminKubeconfigRequest {
            challenge: challenge.to_vec(),
            proof: key.prove(NODE_STATUS, &challenge, &[]).to_vec(),
        };
        let e = server.admin_kubeconfig(&status_proof, None).unwrap_err();
        assert!(matches!(e, OperatorError::Proof), "{e}");
        let once = request(&server, &key);
        server.admin_kubeconfig(&once, None).unwrap();
        let e = server.admin_kubeconfig(&once, None).unwrap_err();
        assert!(matches!(e, OperatorError::Proof), "{e}");
    }

    #[test]
    fn a_missing_or_oversized_kubeconfig_is_refused_and_its_content_never_shown() {
        let dir = tempfile::tempdir().unwrap();
        let slot = Arc::new(ClusterSlot::new(Some(Arc::new(state()))));
        let server = server(dir.path(), &slot, true);
        let key = state().keys.operator_key(&own_ek()).unwrap();

        let e = server
            .admin_kubeconfig(&request(&server, &key), None)
            .unwrap_err();
        assert_eq!(code(&e), tonic::Code::FailedPrecondition, "{e}");
        assert_eq!(
            tonic::Status::from(&e).message(),
            "this control plane has no admin kubeconfig (/etc/kubernetes/admin.conf is \
             missing); ask another control plane"
        );

        // At the bound: sent; one byte more: refused, without its content.
        let mut big = vec![b'k'; MAX_ADMIN_KUBECONFIG_BYTES];
        write_kubeconfig(dir.path(), &big);
        let sent = server
            .admin_kubeconfig(&request(&server, &key), None)
            .unwrap();
        assert_eq!(sent.len(), MAX_ADMIN_KUBECONFIG_BYTES);
        big.push(b'k');
        write_kubeconfig(dir.path(), &big);
        let e = server
            .admin_kubeconfig(&request(&server, &key), None)
            .unwrap_err();
        assert!(matches!(e, OperatorError::KubeconfigTooLarge), "{e}");
        assert_eq!(code(&e), tonic::Code::FailedPrecondition);
        let message = tonic::Status::from(&e).message().to_owned();
        assert!(message.contains("larger than 65536 bytes"), "{message}");
        assert!(!message.contains("kkk"), "{message}");

        // Something other than a file in its place is not read.
        let path = dir.path().join(ADMIN_CONF);
        std::fs::remove_file(&path).unwrap();
        std::fs::create_dir(&path).unwrap();
        let e = read_admin_kubeconfig(dir.path()).unwrap_err();
        assert!(matches!(e, OperatorError::NoKubeconfig(_)), "{e}");
        std::fs::remove_dir(&path).unwrap();
        std::os::unix::fs::symlink(dir.path().join("elsewhere"), &path).unwrap();
        let e = read_admin_kubeconfig(dir.path()).unwrap_err();
        assert!(e.to_string().contains("is not a file"), "{e}");
    }

    #[test]
    fn a_worker_has_no_admin_kubeconfig_to_send() {
        let dir = tempfile::tempdir().unwrap();
        let slot = Arc::new(ClusterSlot::new(None));
        let server = server(dir.path(), &slot, false);
        write_kubeconfig(dir.path(), b"apiVersion: v1\n");
        let key = state().keys.operator_key(&own_ek()).unwrap();
        let e = server
            .admin_kubeconfig(&request(&server, &key), None)
            .unwrap_err();
        assert!(matches!(e, OperatorError::NotControlPlane), "{e}");
        assert_eq!(code(&e), tonic::Code::FailedPrecondition);
    }
}
