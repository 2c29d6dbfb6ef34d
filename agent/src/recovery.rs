//! Recovery: bringing back a control plane when no join service answers.
//!
//! A control plane that rebooted (PCR 15 zero, initialised state disk)
//! normally rejoins through another control plane. When none is left, the
//! operator's CLI validates this node over server-attested aTLS (as for
//! init), seals the init secret and the cluster's master secret to its
//! TPM and calls `Recover`. These checks come before the node lock, and
//! their refusal changes nothing:
//!
//! 1. the node is a control plane, unlocked, with an initialised state
//!    disk, and the caller's address is not waiting after wrong secrets;
//! 2. the secrets open with this TPM (they were sealed to it);
//! 3. the init secret among them matches the hash in the node's measured
//!    config, as at init. The master secret alone proves no operator: the
//!    host chooses the disk, and one who formatted it with a key derived
//!    from a master secret of their own holds a secret that opens it;
//! 4. the master secret derives this node's disk key (the disk's UUID and
//!    this TPM's EK) and that key opens the disk: a secret of another
//!    cluster is refused here, the disk untouched.
//!
//! Then the lock is taken with the cluster ID the secrets derive, the disk
//! is opened, the facts stored on it must name the same cluster ID, the
//! kubelet starts and the node serves joins again. The facts can be read
//! only from the opened disk, so what is refused there (another cluster's
//! ID: the request's measurement salt, which nothing sealed covers, is not
//! the disk's cluster's; a revoked control plane; an image the cluster no
//! longer accepts) is refused after the lock, and the node starts over
//! from a reboot. `keel recover` checks the salt against the workspace's
//! cluster ID, and the image against the workspace's record, before it
//! sends anything. The join client runs at
//! the same time: whichever takes the lock first wins, the other stops.

use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::Arc;

use keel_atls::Source;

use keel_proto::recovery::recovery_service_server::{RecoveryService, RecoveryServiceServer};
use keel_proto::recovery::{RecoverRequest, RecoverResponse, RecoverySecrets};
use keel_verifier::config::Role;
use keel_verifier::credential::CredentialError;
use prost::Message as _;
use zeroize::{Zeroize as _, Zeroizing};

use crate::attestation::credential;
use crate::disk::{DiskState, StateDisk, UnusableHeader};
use crate::disk_bindings::EkDigest;
use crate::nodelock::LockError;
use crate::provision::{DiskStep, Node, Plan, ProvisionError, Provisioner};
use crate::throttle::{FailureThrottle, PerSource, SourcePlace};
use keel_verifier::keys::{self, ClusterId, KeyService};

/// Largest accepted recovery request: its sealed secrets and salt (well
/// under 16 KiB) and up to [`crate::registry::MAX_REVOCATIONS`] revoked
/// EKs of 73 bytes each as encoded (`sha256:` and 64 hex digits), about
/// 800 KiB. The init port holds at most [`MAX_WAITING`] of them at once
/// (`node::recovery_service`).
pub const MAX_RECOVER_REQUEST_BYTES: usize = 16 * 1024 + crate::registry::MAX_REVOCATIONS * 80;

/// Why a recovery request was refused, or failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RecoveryError {
    /// Only a control plane holds the master secret.
    #[error("only a control plane is recovered; a worker rejoins")]
    NotControlPlane,
    /// The node has no state disk, a fresh one, or one whose set-up
    /// never finished.
    #[error("this node has no initialised state disk")]
    NoInitialisedDisk,
    /// The node is already locked (rejoined, or recovered).
    #[error("the node is already part of a cluster")]
    Locked,
    /// A request field is invalid.
    #[error("invalid request: {0}")]
    InvalidRequest(&'static str),
    /// The secrets were not sealed to this node's TPM.
    #[error("the secrets are not sealed to this node's TPM")]
    Sealed(#[source] CredentialError),
    /// The request carries no init secret: a `keel recover` older than
    /// this node sends the master secret alone.
    #[error("the request carries no init secret (keel recover is older than this node)")]
    NoInitSecret,
    /// The init secret does not match the hash in the node's measured
    /// config, or the config names none.
    #[error("the init secret does not match this node's measured config")]
    WrongInitSecret,
    /// The master secret does not open this node's disk.
    #[error("the master secret does not open this node's state disk")]
    WrongSecret,
    /// The caller sent wrong secrets and must wait this many seconds.
    #[error("too many failed recovery requests from this address; retry in {0} s")]
    Throttled(u64),
    /// The TPM or the disk could not be used.
    #[error("the node's TPM or disk is unavailable")]
    Unavailable,
    /// The state disk's LUKS header is damaged (both copies): nothing to
    /// open until its header is restored from a backup.
    #[error("this node's state disk carries a damaged LUKS header: restore it from a backup, or recover another control plane")]
    DiskDamaged,
    /// The state disk carries a LUKS header keel cannot use
    /// ([`crate::disk::UnusableHeader::Foreign`]): no keel cluster's
    /// data to open there.
    #[error("this node's state disk carries a LUKS header keel cannot use (LUKS1, or no UUID or label it can read): recover another control plane")]
    DiskForeign,
    /// Taking the lock failed for another reason.
    #[error("taking the node lock failed")]
    Lock(#[source] LockError),
    /// The node's config does not give what a control plane needs (its
    /// measurements signing key).
    #[error("the node's config: {0}")]
    Config(String),
    /// The node has no network route to take the address its API server
    /// would advertise from.
    #[error("the node has no network route to take the address it would advertise from")]
    NoAddress(#[source] crate::address::NoRoute),
    /// The work after the lock failed; the node reboots.
    #[error("recovery failed after the node lock; the node reboots")]
    Provision(#[source] ProvisionError),
    /// The recovery task ended without its result (it panicked).
    #[error("an internal task failed")]
    Internal,
    /// [`MAX_WAITING`] requests are running or waiting already.
    #[error("other recovery requests are being handled; retry")]
    Busy,
    /// A request from the same address is still running or waiting (one
    /// whose caller went away included).
    #[error("a recovery request from this address is still being handled; retry when it ends")]
    SourceBusy,
}

impl From<&RecoveryError> for tonic::Status {
    /// Refusals map to gRPC codes with their fixed text; causes stay in the
    /// node's log.
    fn from(e: &RecoveryError) -> Self {
        use RecoveryError as E;
        let code = match e {
            E::NotControlPlane
            | E::NoInitialisedDisk
            | E::Locked
            | E::Config(_)
            | E::DiskDamaged
            | E::DiskForeign => tonic::Code::FailedPrecondition,
            E::InvalidRequest(_) | E::Sealed(_) | E::NoInitSecret => tonic::Code::InvalidArgument,
            E::WrongInitSecret => tonic::Code::Unauthenticated,
            E::WrongSecret => tonic::Code::PermissionDenied,
            E::Throttled(seconds) => return keel_proto::held_back(e.to_string(), *seconds),
            E::Unavailable | E::Lock(_) | E::NoAddress(_) | E::Busy | E::SourceBusy => {
                tonic::Code::Unavailable
            }
            // What the node found on its own disk and TPM that rules it
            // out: the operator's to see (no secret in these texts).
            E::Provision(
                inner @ (ProvisionError::ImageNotAccepted
                | ProvisionError::OtherCluster { .. }
                | ProvisionError::Revoked(_)
                | ProvisionError::Renamed(_)),
            ) => {
                return tonic::Status::failed_precondition(format!(
                    "{e}: {}",
                    keel_atls::ErrorChain(inner)
                ))
            }
            E::Provision(_) | E::Internal => tonic::Code::Internal,
        };
        tonic::Status::new(code, e.to_string())
    }
}

/// The recovery service of a node.
#[derive(Clone)]
pub struct RecoveryServer {
    inner: Arc<Inner>,
}

struct Inner {
    node: Node,
    throttle: FailureThrottle,
    one_at_a_time: tokio::sync::Mutex<()>,
    /// A permit per request running or waiting for its turn.
    waiting: Arc<tokio::sync::Semaphore>,
    /// The sources with a request running or waiting: one each, so a few
    /// addresses cannot hold every place while the operator's waits.
    sources: PerSource,
}

/// Most recovery requests running or waiting for their turn at once.
pub const MAX_WAITING: usize = 4;

/// Opened recovery secrets, wiped when dropped.
struct SecretsGuard(RecoverySecrets);

impl Drop for SecretsGuard {
    fn drop(&mut self) {
        self.0.master_secret.zeroize();
        self.0.master_salt.zeroize();
        self.0.init_secret.zeroize();
    }
}

/// A request that passed every check.
struct Accepted {
    keys: KeyService,
    cluster_id: ClusterId,
    disk_key: Zeroizing<Vec<u8>>,
    own_ek: EkDigest,
    /// The EKs the operator's workspace revoked.
    revoked: Vec<EkDigest>,
}

impl RecoveryServer {
    /// The recovery service of this node; a recovered node hands its
    /// cluster state to `cluster`.
    pub fn new(node: Node) -> Self {
        Self {
            inner: Arc::new(Inner {
                node,
                throttle: FailureThrottle::default(),
                one_at_a_time: tokio::sync::Mutex::new(()),
                waiting: Arc::new(tokio::sync::Semaphore::new(MAX_WAITING)),
                sources: PerSource::default(),
            }),
        }
    }

    /// The place of `peer`'s request among those running or waiting;
    /// `SourceBusy` while it has one. A request of no known address takes none.
    fn place_for(&self, peer: Option<IpAddr>) -> Result<Option<SourcePlace>, RecoveryError> {
        peer.map(|peer| {
            self.inner
                .sources
                .claim(Source::of_ip(peer))
                .ok_or(RecoveryError::SourceBusy)
        })
        .transpose()
    }

    /// The tonic service, requests bounded to [`MAX_RECOVER_REQUEST_BYTES`]
    /// and answers to what `keel recover` reads.
    pub fn into_service(self) -> RecoveryServiceServer<Self> {
        RecoveryServiceServer::new(self)
            .max_decoding_message_size(MAX_RECOVER_REQUEST_BYTES)
            .max_encoding_message_size(keel_proto::MAX_RECOVER_RESPONSE_BYTES)
    }

    /// Runs one recovery request from `peer`, on a task of its own: a
    /// caller that goes away (a reset stream, the server's request
    /// timeout) stops neither the check, so a refusal is counted against
    /// its address and the TPM is not free for the next one before it
    /// ends, nor the work after the node lock, which ends serving or
    /// failing (the node reboots) whatever became of the request. The
    /// node's role, lock and the peer's backoff are checked before the task
    /// starts, the state disk first in the task (before the TPM opens
    /// anything); at most [`MAX_WAITING`] requests wait for their turn,
    /// one per source (an IPv6 source by its /64); past that, `Busy`.
    pub async fn recover(
        &self,
        request: RecoverRequest,
        peer: Option<IpAddr>,
    ) -> Result<ClusterId, RecoveryError> {
        self.refusal(peer)?;
        let place = self.place_for(peer)?;
        let waiting = Arc::clone(&self.inner.waiting)
            .try_acquire_owned()
            .map_err(|_| RecoveryError::Busy)?;
        let this = self.clone();
        tokio::spawn(async move {
            let (_waiting, _place) = (waiting, place);
            this.run(request, peer).await
        })
        .await
        .map_err(|_| RecoveryError::Internal)?
    }

    /// What refuses a request from `peer` now, before any TPM work: the
    /// node's role, its lock, its disk, the peer's backoff. Returns the
    /// state disk.
    fn refusal(&self, peer: Option<IpAddr>) -> Result<StateDisk, RecoveryError> {
        let inner = &self.inner;
        if inner.node.config.node.role != Role::ControlPlane {
            return Err(RecoveryError::NotControlPlane);
        }
        if inner.node.lock.is_locked() {
            return Err(RecoveryError::Locked);
        }
        let disk = inner
            .node
            .env
            .state_disk
            .clone()
            .ok_or(RecoveryError::NoInitialisedDisk)?;
        if let Some(ip) = peer {
            inner
                .throttle
                .check(ip)
                .map_err(|wait| RecoveryError::Throttled(wait.as_secs().max(1)))?;
        }
        Ok(disk)
    }

    /// [`RecoveryServer::recover`], on the caller's task: one request at a
    /// time, checked again once it has its turn (a request before it may
    /// have locked the node or failed from the same address).
    async fn run(
        &self,
        request: RecoverRequest,
        peer: Option<IpAddr>,
    ) -> Result<ClusterId, RecoveryError> {
        let inner = &self.inner;
        let _one = inner.one_at_a_time.lock().await;
        let disk = self.refusal(peer)?;
        let accepted = match self.accept(request, disk.clone()).await {
            Ok(a) => a,
            Err(e) => {
                // Every refusal of what the caller sent is throttled: a
                // request that decodes wrong has cost the TPM as much as
                // one with a wrong secret.
                if let (
                    Some(ip),
                    RecoveryError::WrongSecret
                    | RecoveryError::WrongInitSecret
                    | RecoveryError::NoInitSecret
                    | RecoveryError::Sealed(_)
                    | RecoveryError::InvalidRequest(_),
                ) = (peer, &e)
                {
                    let (failures, wait) = inner.throttle.failed(ip);
                    tracing::warn!(peer = %ip, failures, wait_s = wait.as_secs_f64(), "recovery refused: {e}");
                }
                return Err(e);
            }
        };
        if let Some(ip) = peer {
            inner.throttle.succeeded(ip);
        }
        // Read before the lock: what the config lacks is no reason to
        // reboot.
        let signing_key = inner
            .node
            .config
            .cluster
            .signing_key()
            .map_err(|e| RecoveryError::Config(e.to_string()))?;
        // Checked before the lock too (the restore refuses it after): a
        // node with no route to advertise an address on refuses, untouched.
        inner
            .node
            .env
            .advertise_address
            .resolve()
            .map_err(RecoveryError::NoAddress)?;
        let (lock, run_dir) = (inner.node.lock.clone(), inner.node.env.work_dir.clone());
        let cluster_id = accepted.cluster_id;
        let taken = tokio::task::spawn_blocking(move || {
            crate::resume::take_lock(&lock, cluster_id, &run_dir)
        })
        .await
        .map_err(|_| RecoveryError::Unavailable)?;
        let log = |line: String| tracing::info!(target: "keel_agent::provision", "{line}");
        let p = Provisioner::new(&inner.node.env, &inner.node.tpm, &log);
        match taken {
            Ok(()) => {}
            Err(LockError::AlreadyLocked) => return Err(RecoveryError::Locked),
            // A failed record may still have extended PCR 15: then the node
            // is locked for good with nothing served, and starts over from
            // a reboot, as after any failure past the lock.
            Err(e) if e.left_locked() => {
                let error = ProvisionError::Lock(keel_atls::ErrorChain(&e).to_string());
                p.fail(&error).await;
                return Err(RecoveryError::Lock(e));
            }
            Err(e) => return Err(RecoveryError::Lock(e)),
        }
        tracing::info!(cluster_id = %hex::encode(accepted.cluster_id), "node locked for recovery");
        let result = async {
            p.prepare(Plan {
                disk: DiskStep::Open {
                    key: accepted.disk_key,
                },
                files: Vec::new(),
                components: None,
            })
            .await?;
            // What the operator revoked while this control plane was down
            // holds here before it serves anyone.
            record_revocations(inner.node.env.root().to_owned(), accepted.revoked).await?;
            // A control plane revoked before every control plane went down
            // stays revoked: its own registry, now readable, says so.
            p.refuse_revoked_or_renamed(&accepted.own_ek, &inner.node.config.node)
                .await?;
            let state = p.restore_control_plane(accepted.keys, signing_key)?;
            // The lock came from the request's measurement salt, which
            // nothing sealed covers: it must name the disk's cluster.
            if state.cluster_id != accepted.cluster_id {
                return Err(ProvisionError::OtherCluster {
                    locked: hex::encode(accepted.cluster_id),
                    recorded: hex::encode(state.cluster_id),
                });
            }
            p.refuse_unaccepted_image(&state).await?;
            p.reinstall_recorded().await?;
            p.start_kubelet().await?;
            p.serve_as_control_plane(state, &inner.node.cluster).await
        }
        .await;
        match result {
            Ok(()) => {
                tracing::info!(cluster_id = %hex::encode(accepted.cluster_id), "recovered the cluster");
                Ok(accepted.cluster_id)
            }
            Err(e) => {
                p.fail(&e).await;
                Err(RecoveryError::Provision(e))
            }
        }
    }

    /// Checks the init secret of opened `secrets` against the node's
    /// measured config (memory-hard, off the runtime's workers; requests
    /// take their turn one at a time already).
    async fn check_init_secret(
        &self,
        secrets: SecretsGuard,
    ) -> Result<SecretsGuard, RecoveryError> {
        if secrets.0.init_secret.is_empty() {
            return Err(RecoveryError::NoInitSecret);
        }
        let hash = self.inner.node.config.cluster.init_secret_hash.clone();
        let (secrets, matches) = tokio::task::spawn_blocking(move || {
            let matches =
                keel_verifier::init_secret::matches_any_form(&hash, &secrets.0.init_secret);
            (secrets, matches)
        })
        .await
        .map_err(|_| RecoveryError::Internal)?;
        if !matches {
            return Err(RecoveryError::WrongInitSecret);
        }
        Ok(secrets)
    }

    /// Every check before the lock; changes nothing.
    async fn accept(
        &self,
        request: RecoverRequest,
        disk: StateDisk,
    ) -> Result<Accepted, RecoveryError> {
        // An unfinished set-up holds no cluster to recover (and the next
        // start would reset it). Checked before the TPM opens anything: a
        // request to a node with no cluster on its disk costs no TPM work.
        let inspected = tokio::task::spawn_blocking(move || {
            disk.inspect().map(|state| match state {
                DiskState::Member { uuid } => Some((disk, uuid)),
                DiskState::Fresh | DiskState::Unfinished { .. } => None,
            })
        })
        .await
        .map_err(|_| RecoveryError::Unavailable)?
        .map_err(|e| {
            tracing::warn!(error = %keel_atls::ErrorChain(&e), "inspecting the state disk failed");
            match e.unusable_header() {
                Some(UnusableHeader::Damaged) => RecoveryError::DiskDamaged,
                Some(UnusableHeader::Foreign) => RecoveryError::DiskForeign,
                None => RecoveryError::Unavailable,
            }
        })?;
        let (disk, uuid) = inspected.ok_or(RecoveryError::NoInitialisedDisk)?;
        if request.revoked_eks.len() > crate::registry::MAX_REVOCATIONS {
            return Err(RecoveryError::InvalidRequest(
                "more revoked EKs than a revocation list holds",
            ));
        }
        let revoked = request
            .revoked_eks
            .iter()
            .map(|ek| crate::operator::whole_ek(ek))
            .collect::<Option<Vec<_>>>()
            .ok_or(RecoveryError::InvalidRequest(
                "a revoked EK is not sha256: and 64 lower-case hex digits",
            ))?;
        let sealed = request
            .secrets
            .ok_or(RecoveryError::InvalidRequest("sealed secrets missing"))?;
        let (opened, own_ek) = credential::open_on(&self.inner.node.tpm, sealed)
            .await
            .map_err(|e| match e {
                credential::OpenError::Tpm => RecoveryError::Unavailable,
                credential::OpenError::Sealed(e) => RecoveryError::Sealed(e),
            })?;
        // Decoded into the guard, so that what a decode that fails partway
        // filled in is wiped too.
        let mut secrets = SecretsGuard(RecoverySecrets::default());
        secrets
            .0
            .merge(opened.as_slice())
            .map_err(|_| RecoveryError::InvalidRequest("sealed secrets do not decode"))?;
        let secrets = self.check_init_secret(secrets).await?;
        let keys = KeyService::new(&secrets.0.master_secret, &secrets.0.master_salt)
            .map_err(|_| RecoveryError::InvalidRequest("master secret or salt length"))?;
        drop(secrets);
        let measurement_secret = keys
            .measurement_secret()
            .map_err(|_| RecoveryError::InvalidRequest("master secret"))?;
        let cluster_id = keys::cluster_id(&measurement_secret, &request.measurement_salt)
            .map_err(|_| RecoveryError::InvalidRequest("measurement salt length"))?;
        let disk_key = keys
            .disk_key(&uuid, &own_ek)
            .map_err(|_| RecoveryError::Unavailable)?;
        let key = disk_key.clone();
        let opens = tokio::task::spawn_blocking(move || {
            disk.cryptsetup.key_matches(&disk.device, &key)
        })
        .await
        .map_err(|_| RecoveryError::Unavailable)?
        .map_err(|e| {
            tracing::warn!(error = %keel_atls::ErrorChain(&e), "testing the disk key failed");
            RecoveryError::Unavailable
        })?;
        if !opens {
            return Err(RecoveryError::WrongSecret);
        }
        Ok(Accepted {
            keys,
            cluster_id,
            disk_key,
            own_ek,
            revoked,
        })
    }
}

#[tonic::async_trait]
impl RecoveryService for RecoveryServer {
    async fn recover(
        &self,
        request: tonic::Request<RecoverRequest>,
    ) -> Result<tonic::Response<RecoverResponse>, tonic::Status> {
        let caller = crate::grpc::Caller::of(&request);
        // Held open throughout: the recovery runs on whatever becomes of
        // the request, and its answer is the operator's only report.
        let _open = caller.protect();
        // The request is whole: from here this service's own places
        // (`MAX_WAITING`, one per source) bound it, not the port's.
        if let Some(place) = request.extensions().get::<crate::grpc::HeldPlace>() {
            place.release();
        }
        match RecoveryServer::recover(self, request.into_inner(), caller.ip()).await {
            Ok(cluster_id) => {
                // The answer must reach the operator after the guard drops.
                caller.vouch();
                Ok(tonic::Response::new(RecoverResponse {
                    cluster_id: cluster_id.to_vec(),
                }))
            }
            // Refusals that cost the sender nothing are logged at debug
            // level only (see the init server).
            Err(
                e @ (RecoveryError::Throttled(_) | RecoveryError::Busy | RecoveryError::SourceBusy),
            ) => {
                tracing::debug!(error = %e, "recovery refused");
                Err((&e).into())
            }
            Err(e) => {
                tracing::warn!(error = %keel_atls::ErrorChain(&e), "recovery refused");
                Err((&e).into())
            }
        }
    }
}

/// Puts the EKs the operator's workspace revoked (`keel recover` sends
/// them) on the revocation list of the registry under `root`
/// ([`crate::registry::Registry::revoke_ek`]). One revoked already stays as
/// it is.
async fn record_revocations(root: PathBuf, revoked: Vec<EkDigest>) -> Result<(), ProvisionError> {
    if revoked.is_empty() {
        return Ok(());
    }
    tokio::task::spawn_blocking(move || {
        let store = crate::registry::RegistryStore::shared(&root)?;
        store.update(|r| {
            for ek in &revoked {
                r.revoke_ek(ek, "revoked by the operator (carried by keel recover)")?;
            }
            Ok(())
        })?;
        tracing::warn!(
            eks = revoked.len(),
            "the operator's revocations recorded before serving"
        );
        Ok(())
    })
    .await
    .map_err(ProvisionError::Blocking)?
    .map_err(ProvisionError::Registry)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// A request with the most revoked EKs a revocation list holds, and
    /// secrets and salt larger than any the CLI makes, is within the
    /// decoding bound: a workspace that revoked thousands of nodes can
    /// still recover its cluster. (The first bound, 64 KiB, refused one
    /// past about 890 EKs before the handler ran.)
    #[test]
    fn a_request_with_a_full_revocation_list_fits_the_decoding_bound() {
        let request = RecoverRequest {
            secrets: Some(keel_proto::attestation::SealedSecret {
                credential_blob: vec![1; 128],
                encrypted_seed: vec![2; 512],
                ciphertext: vec![3; 4096],
                nonce: vec![4; 12],
            }),
            measurement_salt: vec![5; 512],
            revoked_eks: (0..crate::registry::MAX_REVOCATIONS)
                .map(|i| format!("sha256:{i:064x}"))
                .collect(),
        };
        assert!(
            request.encoded_len() + 5 <= MAX_RECOVER_REQUEST_BYTES,
            "{} bytes",
            request.encoded_len()
        );
    }
}
