//! The control plane's end of continuous attestation: paces each member's
//! evidence, issues its nonces, validates what it sends as at join time and
//! keeps the verdicts in the [registry](crate::registry).
//!
//! Bounds: one nonce request waiting and one nonce outstanding per EK (a
//! new nonce replaces the old), at most [`MAX_NODES`] EKs paced. A nonce
//! request waits for its turn (up to an interval) without holding one of
//! the join port's places for requests in flight, which bound bodies being
//! read: a place held through the wait would keep members past the places'
//! count out while the others wait, until they fall silent. A nonce is
//! valid for one interval plus [`NONCE_GRACE`]; a submission is checked
//! against its nonce, its EK and its AK before anything is validated, so a
//! flood of submissions costs a lookup each and at most one validation per
//! interval per node; requests are bounded to [`MAX_EVIDENCE_REQUEST_BYTES`].
//! A control plane reads the registry one request at a time, each at least
//! [`REGISTRY_GAP`] after its last (a copy and an encoding of up to the
//! registry's bound each), so a compromised one cannot pile them up.
//!
//! The disk UUID a member reports is its claim: it is recorded (and can
//! later go into the node's revocation) only if the join service's disk
//! bindings bind it to the member's EK; a UUID bound to another EK refuses
//! the evidence, one not bound here is not recorded ([`BoundDisk`]).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use keel_installer::MeasuredComponent;
use keel_proto::attestation::AttestationDocument;
use keel_proto::evidence::evidence_service_server::{self, EvidenceServiceServer};
use keel_proto::evidence::{
    NextNonceRequest, NextNonceResponse, RegistryRequest, RegistryResponse, SubmitEvidenceRequest,
    SubmitEvidenceResponse,
};
use keel_verifier::config::{EvidenceConfig, EvidencePolicy, NodeIdentity};
use keel_verifier::measurement::EventType;
use keel_verifier::tpm_wire::Public;
use keel_verifier::validator::{ValidationError, Verified, MAX_DOCUMENT_BYTES};
use prost::Message as _;
use rand::RngCore as _;
use subtle::ConstantTimeEq as _;

use super::admission::{check_member, MemberPolicy};
use super::hearing::Hearing;
use super::{user_data, MAX_FIELD_BYTES, SILENT_AFTER};
use crate::cluster::{ClusterSlot, ClusterState};
use crate::disk_bindings::{DiskBindings, DiskBindingsError, EkDigest};
use crate::grpc::{HeldPlace, HeldUntilSent};
use crate::registry::{
    self, BoundDisk, DiskClaim, Evidence, RegistryError, RegistryStore, Revocation, Verdict,
};

/// Most EKs paced at once.
pub const MAX_NODES: usize = registry::MAX_NODES;
/// How long a nonce outlives its interval.
pub const NONCE_GRACE: Duration = Duration::from_secs(30);
/// The shortest time between the starts of two registry requests of one
/// control plane; a request that comes sooner waits (its own client pulls
/// once per evidence round, an interval apart).
pub const REGISTRY_GAP: Duration = Duration::from_secs(1);
/// Largest accepted request: a document and two short strings.
pub const MAX_EVIDENCE_REQUEST_BYTES: usize = MAX_DOCUMENT_BYTES + 4096;

/// Why a request was refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EvidenceError {
    /// The connection carries no validated attestation.
    #[error("the peer is not attested")]
    NotAttested,
    /// This control plane has no cluster yet, or its measurements are unusable.
    #[error("the evidence service is not ready")]
    NotReady(#[source] super::admission::AdmissionError),
    /// The peer is not a member of this cluster.
    #[error("the peer is not a member of this cluster")]
    NotMember(#[source] super::admission::AdmissionError),
    /// The revocation list names the peer.
    #[error("the node is revoked: {0}")]
    Revoked(Revocation),
    /// The peer already waits for a nonce, or too many nodes are paced.
    #[error("a nonce request of this node is already waiting, or too many nodes")]
    Busy,
    /// A registry request of the peer is already in flight.
    #[error("a registry request of this control plane is already in flight")]
    RegistryBusy,
    /// The nonce is not the one this control plane issued to this EK.
    #[error("the nonce was not issued to this node, was used or expired")]
    NonceNotIssued,
    /// The evidence comes from another EK or AK than the connection's.
    #[error("the evidence is not from the TPM key proven on this connection")]
    UnknownKey,
    /// A field is invalid.
    #[error("invalid request: {0}")]
    InvalidRequest(&'static str),
    /// The reported disk is bound to another node's TPM.
    #[error("the reported disk is bound to another node's TPM")]
    DiskNotBound,
    /// The disk bindings could not be read.
    #[error("the disk bindings could not be read")]
    DiskBindings(#[source] DiskBindingsError),
    /// Only control planes may read the registry.
    #[error("only control planes read the registry")]
    NotControlPlane,
    /// The registry failed.
    #[error("the node registry failed")]
    Registry(#[source] RegistryError),
}

/// What a revoked node is told when its evidence is refused (the
/// evidence client recognises it).
pub const REVOKED_MESSAGE: &str = "the node is revoked: its EK is on the cluster's revocation list";

impl From<&EvidenceError> for tonic::Status {
    /// The one map from evidence refusals to gRPC codes; the peer gets a
    /// fixed text, the log the full chain.
    fn from(e: &EvidenceError) -> Self {
        use EvidenceError as E;
        let (code, message) = match e {
            E::NotAttested => (tonic::Code::Unauthenticated, "the peer is not attested"),
            E::NotReady(_) => (
                tonic::Code::Unavailable,
                "the evidence service is not ready",
            ),
            E::NotMember(_) => (
                tonic::Code::PermissionDenied,
                "not a member of this cluster",
            ),
            E::Revoked(_) => (tonic::Code::PermissionDenied, REVOKED_MESSAGE),
            E::Busy => (
                tonic::Code::ResourceExhausted,
                "a nonce request is already waiting",
            ),
            E::RegistryBusy => (
                tonic::Code::ResourceExhausted,
                "a registry request of this control plane is already in flight",
            ),
            E::NonceNotIssued => (
                tonic::Code::PermissionDenied,
                "the nonce was not issued to this node, was used or expired",
            ),
            E::UnknownKey => (
                tonic::Code::PermissionDenied,
                "the evidence is not from the TPM key proven on this connection",
            ),
            E::InvalidRequest(what) => (tonic::Code::InvalidArgument, *what),
            E::DiskNotBound => (
                tonic::Code::PermissionDenied,
                "the state disk is not bound to this node's TPM",
            ),
            E::DiskBindings(_) => (tonic::Code::Internal, "the disk bindings failed"),
            E::NotControlPlane => (
                tonic::Code::PermissionDenied,
                "only control planes read the registry",
            ),
            E::Registry(_) => (tonic::Code::Internal, "the node registry failed"),
        };
        tonic::Status::new(code, message)
    }
}

/// The pace of one EK's evidence, and of its registry requests.
#[derive(Default)]
struct Pace {
    waiting: bool,
    nonce: Option<([u8; 32], Instant)>,
    last: Option<Instant>,
    /// A registry request is in flight.
    reading: bool,
    /// When its last registry request started.
    last_read: Option<Instant>,
}

impl Pace {
    /// Whether this pace binds nothing any more at `now`: no request of
    /// its EK in flight, and its nonce, its last evidence and its last
    /// registry request all at least `idle` old (past the nonce's life and
    /// every gap), so forgetting it changes no answer.
    fn is_idle(&self, now: Instant, idle: Duration) -> bool {
        !self.waiting
            && !self.reading
            && [self.nonce.map(|(_, at)| at), self.last, self.last_read]
                .into_iter()
                .flatten()
                .all(|at| now.saturating_duration_since(at) >= idle)
    }
}

/// Whether `paces` has room for one more EK, forgetting idle ones
/// ([`Pace::is_idle`]) when it is full: members come and go over a
/// control plane's life (replaced VMs, each with a new EK), and a table
/// that only grew would refuse every new member once it held
/// [`MAX_NODES`].
fn make_room(paces: &mut HashMap<[u8; 32], Pace>, now: Instant, idle: Duration) -> bool {
    if paces.len() >= MAX_NODES {
        paces.retain(|_, pace| !pace.is_idle(now, idle));
    }
    paces.len() < MAX_NODES
}

/// The evidence service of a control plane.
#[derive(Clone)]
pub struct EvidenceService {
    inner: Arc<Inner>,
}

struct Inner {
    members: Arc<MemberPolicy>,
    cluster: tokio::sync::watch::Receiver<Option<Arc<ClusterState>>>,
    registry: Arc<RegistryStore>,
    disks: Arc<DiskBindings>,
    config: EvidenceConfig,
    /// This control plane's own EK: its evidence to itself is not hearing
    /// the cluster.
    own_ek: EkDigest,
    hearing: Mutex<Hearing>,
    paces: Mutex<HashMap<[u8; 32], Pace>>,
    /// The last sweep (Unix seconds) that held back the `revoke` policy
    /// for too many drifted nodes, and for too many silent ones.
    held_back_at: Mutex<HeldBackAt>,
}

/// When a sweep last held the policy back, per kind of failure; see
/// [`HeldBackAt::revocable`].
#[derive(Clone, Copy, Default)]
struct HeldBackAt {
    drifted: Option<u64>,
    silent: Option<u64>,
}

impl HeldBackAt {
    /// Whether the policy may revoke `record` (drifted or silent): not if
    /// a sweep held its kind back since its verdict. A node left to the
    /// operator while too many failed at once stays so once the fault
    /// clears; the others clear at their next reports, one by one, and
    /// the last few would otherwise be revoked at once.
    fn revocable(self, record: &registry::NodeRecord) -> bool {
        let held_at = match record.verdict {
            Verdict::Silent => self.silent,
            _ => self.drifted,
        };
        held_at.is_none_or(|held| record.verdict_at > held)
    }
}

/// Waits until `due`, if any.
async fn sleep_until(due: Option<Instant>) {
    if let Some(due) = due {
        tokio::time::sleep_until(due.into()).await;
    }
}

/// Clears a mark of an EK's pace (its waiting nonce request, its registry
/// request in flight) when the request ends, answered or not.
struct Waiting {
    service: EvidenceService,
    ek: [u8; 32],
    mark: fn(&mut Pace) -> &mut bool,
}

impl Drop for Waiting {
    fn drop(&mut self) {
        if let Some(p) = self.service.paces().get_mut(&self.ek) {
            *(self.mark)(p) = false;
        }
    }
}

impl EvidenceService {
    /// The service of a control plane whose cluster appears in `cluster`,
    /// judging members by `members`, keeping verdicts in `registry`, and
    /// recording only disks that `disks` (its join service's binding
    /// store) binds to the reporting member's EK.
    pub fn new(
        cluster: &ClusterSlot,
        members: Arc<MemberPolicy>,
        registry: Arc<RegistryStore>,
        disks: Arc<DiskBindings>,
        config: EvidenceConfig,
        own_ek: EkDigest,
    ) -> Self {
        let hearing = Hearing::new(registry::now(), config.interval());
        Self {
            inner: Arc::new(Inner {
                members,
                cluster: cluster.subscribe(),
                registry,
                disks,
                config,
                own_ek,
                hearing: Mutex::new(hearing),
                paces: Mutex::new(HashMap::new()),
                held_back_at: Mutex::default(),
            }),
        }
    }

    /// The tonic service, requests bounded to [`MAX_EVIDENCE_REQUEST_BYTES`].
    pub fn into_service(self) -> EvidenceServiceServer<Self> {
        EvidenceServiceServer::new(self).max_decoding_message_size(MAX_EVIDENCE_REQUEST_BYTES)
    }

    /// The registry this service records in.
    pub fn registry(&self) -> &Arc<RegistryStore> {
        &self.inner.registry
    }

    fn paces(&self) -> MutexGuard<'_, HashMap<[u8; 32], Pace>> {
        self.inner
            .paces
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// The peer's EK, once it is a member that is not revoked.
    fn admit(&self, peer: &Verified) -> Result<EkDigest, EvidenceError> {
        let member = self
            .inner
            .members
            .current()
            .map_err(EvidenceError::NotReady)?;
        check_member(peer, &member.cluster_id).map_err(EvidenceError::NotMember)?;
        let ek = EkDigest::of_public(&peer.ek);
        match self.inner.registry.revocation(&ek) {
            Some(revocation) => Err(EvidenceError::Revoked(revocation)),
            None => Ok(ek),
        }
    }

    /// Waits until `peer`'s next evidence is due and returns its nonce.
    pub async fn next_nonce(&self, peer: &Verified) -> Result<[u8; 32], EvidenceError> {
        self.next_nonce_in(peer, None).await
    }

    /// [`Self::next_nonce`] for a request holding `place` on the port,
    /// given up once its turn is marked: the wait lasts up to an interval,
    /// and places held through it would leave a cluster with more members
    /// than places falling silent. The waits are bounded here instead: one
    /// per EK, of at most [`MAX_NODES`] EKs paced, each a member that is
    /// not revoked.
    async fn next_nonce_in(
        &self,
        peer: &Verified,
        place: Option<&HeldPlace>,
    ) -> Result<[u8; 32], EvidenceError> {
        let ek = *self.admit(peer)?.as_bytes();
        let (_waiting, due) = self.take_turn(
            ek,
            |p| &mut p.waiting,
            |p| p.last,
            self.inner.config.interval(),
            EvidenceError::Busy,
        )?;
        if let Some(place) = place {
            place.release();
        }
        sleep_until(due).await;
        let mut nonce = [0u8; 32];
        rand::rngs::OsRng.fill_bytes(&mut nonce);
        if let Some(pace) = self.paces().get_mut(&ek) {
            pace.nonce = Some((nonce, Instant::now()));
        }
        Ok(nonce)
    }

    /// Marks a request of `ek` in flight (the mark `busy`; `refused` if
    /// one is already) and waits until `gap` after the time `last` of its
    /// pace. The guard returned ends the mark when the request ends,
    /// answered or not.
    async fn wait_turn(
        &self,
        ek: [u8; 32],
        busy: fn(&mut Pace) -> &mut bool,
        last: fn(&Pace) -> Option<Instant>,
        gap: Duration,
        refused: EvidenceError,
    ) -> Result<Waiting, EvidenceError> {
        let (turn, due) = self.take_turn(ek, busy, last, gap, refused)?;
        sleep_until(due).await;
        Ok(turn)
    }

    /// Marks a request of `ek` in flight as [`Self::wait_turn`] does;
    /// returns the mark's guard and when the turn is due (`None`: now).
    /// At most [`MAX_NODES`] EKs are paced; idle ones make room for a new
    /// one.
    fn take_turn(
        &self,
        ek: [u8; 32],
        busy: fn(&mut Pace) -> &mut bool,
        last: fn(&Pace) -> Option<Instant>,
        gap: Duration,
        refused: EvidenceError,
    ) -> Result<(Waiting, Option<Instant>), EvidenceError> {
        let due = {
            let mut paces = self.paces();
            let idle = self.inner.config.interval() + NONCE_GRACE;
            if !paces.contains_key(&ek) && !make_room(&mut paces, Instant::now(), idle) {
                return Err(EvidenceError::Busy);
            }
            let pace = paces.entry(ek).or_default();
            let mark = busy(pace);
            if *mark {
                return Err(refused);
            }
            *mark = true;
            last(pace).map(|last| last + gap)
        };
        let turn = Waiting {
            service: self.clone(),
            ek,
            mark: busy,
        };
        Ok((turn, due))
    }

    /// Takes `nonce` if it is the one outstanding for `ek` and fresh.
    fn take_nonce(&self, ek: &[u8; 32], nonce: &[u8]) -> bool {
        let ttl = self.inner.config.interval() + NONCE_GRACE;
        let mut paces = self.paces();
        let Some(pace) = paces.get_mut(ek) else {
            return false;
        };
        match pace.nonce {
            Some((issued, at)) if bool::from(issued.as_slice().ct_eq(nonce)) => {
                pace.nonce = None;
                pace.last = Some(Instant::now());
                at.elapsed() < ttl
            }
            _ => false,
        }
    }

    /// Checks and records `peer`'s evidence; returns its verdict.
    pub async fn submit(
        &self,
        peer: &Verified,
        request: SubmitEvidenceRequest,
    ) -> Result<Verdict, EvidenceError> {
        let ek = self.admit(peer)?;
        if request.disk_uuid.len() > MAX_FIELD_BYTES
            || request.kubernetes_version.len() > MAX_FIELD_BYTES
        {
            return Err(EvidenceError::InvalidRequest(
                "disk UUID or version too long",
            ));
        }
        // Each empty or of its shape: neither then holds the NUL that
        // separates them in the user data, so one document binds one pair.
        let disk_shaped = request.disk_uuid.is_empty()
            || keel_verifier::keys::disk_id(&request.disk_uuid).is_ok();
        let version_shaped = request.kubernetes_version.is_empty()
            || request
                .kubernetes_version
                .parse::<keel_installer::KubernetesVersion>()
                .is_ok();
        if !disk_shaped || !version_shaped {
            return Err(EvidenceError::InvalidRequest(
                "disk UUID or Kubernetes version malformed",
            ));
        }
        if request.document.len() > MAX_DOCUMENT_BYTES {
            return Err(EvidenceError::InvalidRequest("evidence too large"));
        }
        if let Some(revocation) = self.inner.registry.revocation(&ek) {
            return Err(EvidenceError::Revoked(revocation));
        }
        if !self.take_nonce(ek.as_bytes(), &request.nonce) {
            return Err(EvidenceError::NonceNotIssued);
        }
        // Only evidence signed by the AK proven for this connection's EK
        // can be held against the node.
        let doc = AttestationDocument::decode(request.document.as_slice())
            .map_err(|_| EvidenceError::InvalidRequest("the evidence does not decode"))?;
        let ak = Public::parse(&doc.ak_public).map_err(|_| EvidenceError::UnknownKey)?;
        if !EkDigest::of_marshalled(&doc.ek_public).ct_eq(&ek) || ak.name != peer.ak.name {
            return Err(EvidenceError::UnknownKey);
        }
        let disk = self.bound_disk(ek, request.disk_uuid.clone()).await?;
        let member = self
            .inner
            .members
            .current()
            .map_err(EvidenceError::NotReady)?;
        let cluster = self.inner.cluster.borrow().clone();
        let identity = crate::join::service::measured_identity(peer).ok();
        let (name, role) = identity
            .as_ref()
            .map(|i| (i.name.clone(), i.role.as_str().to_owned()))
            .unwrap_or_default();
        let disk_uuid = request.disk_uuid.clone();
        let version = request.kubernetes_version.clone();
        let started = Instant::now();
        let current = member.measurements;
        let (matched, failure, failure_on_clock) = tokio::task::spawn_blocking(move || {
            let data = user_data(&disk_uuid, &version);
            // A refusal for a date alone is the node's failure only once
            // this service's own checks passed too: a wrong cluster lock,
            // component or identity is a drift of the node's own.
            match member.validator.validate_but_for_the_clock(
                &request.document,
                &request.nonce,
                &data,
            ) {
                Ok((verified, untimely)) => {
                    let own = judge(&verified, &member.cluster_id, cluster.as_deref())
                        .or_else(|| identity_failure(identity.as_ref(), &verified));
                    let matched = match untimely {
                        Some(_) => member.measurements,
                        None => member.matched(&verified),
                    };
                    let (failure, on_clock) = recorded_failure(own, untimely);
                    (matched, failure, on_clock)
                }
                Err(e) => (member.measurements, Some(e.to_string()), false),
            }
        })
        .await
        .unwrap_or_else(|_| (current, Some("the validation task failed".into()), false));
        let measurements = hex::encode(matched);
        let evidence = Evidence {
            ek,
            disk,
            name,
            role,
            kubernetes_version: request.kubernetes_version,
            measurements,
            failure,
            failure_on_clock,
        };
        let drift_stands = self.inner.config.drift_stands();
        let (previous, record) = self
            .store(move |s| {
                s.update(|r| {
                    let previous = r.record_holding_drift(&evidence, drift_stands)?;
                    let record = r.nodes().get(&evidence.ek.to_string()).cloned();
                    Ok((previous, record))
                })
            })
            .await?;
        let Some(record) = record else {
            return Err(EvidenceError::Registry(RegistryError::Full));
        };
        if !ek.ct_eq(&self.inner.own_ek) {
            self.hearing().heard(registry::now());
        }
        tracing::debug!(node = %record.name.escape_debug(), ek = %ek, ms = started.elapsed().as_secs_f64() * 1e3, "evidence checked");
        if record.verdict == Verdict::Drifted {
            tracing::warn!(
                node = %record.name.escape_debug(),
                ek = %ek,
                disk = %record.disk_uuid.escape_debug(),
                reason = %record.reason.as_deref().unwrap_or("").escape_debug(),
                on_clock = record.on_clock,
                "node drifted: its evidence failed validation"
            );
        } else if previous != Some(Verdict::Trusted) {
            tracing::info!(node = %record.name.escape_debug(), ek = %ek, "node trusted: its evidence validated");
        }
        Ok(record.verdict)
    }

    /// The disk `uuid` reported by the member of `ek`, if the disk bindings
    /// bind it to that EK; refused if they bind it to another (logged with
    /// both EK digests). When the bindings cannot be read, no disk is
    /// recorded and the evidence is still taken (logged): a store error
    /// must not turn every member silent, and under the `revoke` policy
    /// revoke them all.
    async fn bound_disk(
        &self,
        ek: EkDigest,
        uuid: String,
    ) -> Result<Option<BoundDisk>, EvidenceError> {
        let disks = self.inner.disks.clone();
        let checked = tokio::task::spawn_blocking(move || BoundDisk::check(&disks, &ek, &uuid))
            .await
            .map_err(|_| DiskBindingsError::Task)
            .and_then(|claim| claim);
        let claim = match checked {
            Ok(claim) => claim,
            Err(e) => {
                tracing::error!(
                    ek = %ek,
                    error = %keel_atls::ErrorChain(&e),
                    "the disk bindings could not be read; the evidence is recorded without its disk"
                );
                return Ok(None);
            }
        };
        match claim {
            DiskClaim::Bound(disk) => Ok(Some(disk)),
            DiskClaim::OtherEk(bound) => {
                tracing::warn!(
                    ek = %ek,
                    disk_bound_to = %bound,
                    "evidence refused: it reports a disk bound to another EK"
                );
                Err(EvidenceError::DiskNotBound)
            }
            _ => Ok(None),
        }
    }

    /// Revokes the node of `record` by policy (with its disk only if bound
    /// to its EK, [`BoundDisk::of_record`]), unless its verdict changed
    /// since the sweep read it.
    async fn apply_policy(&self, record: &registry::NodeRecord) -> Result<(), EvidenceError> {
        let reason = format!(
            "policy revoke: {}: {}",
            record.verdict.as_str(),
            record.reason.as_deref().unwrap_or("")
        );
        let record = record.clone();
        let disks = self.inner.disks.clone();
        let revocation = self
            .store(move |s| {
                let disk = BoundDisk::of_record(Some(&disks), &record);
                s.update(|r| {
                    let now = r.nodes().get(&record.ek).map(|n| (n.verdict, n.verdict_at));
                    if now != Some((record.verdict, record.verdict_at)) {
                        return Ok(None);
                    }
                    r.revoke(&record, disk.as_ref(), &reason).map(Some)
                })
            })
            .await?;
        if let Some(revocation) = revocation {
            tracing::warn!(%revocation, "node revoked by policy");
        }
        Ok(())
    }

    /// Marks silent the nodes that sent nothing for three intervals (counted
    /// from this service's start, or its return from an absence, at the
    /// earliest; [`Hearing`]); returns how many. Under the `revoke` policy,
    /// then revokes every node drifted for an interval and a half, or
    /// silent for an interval since it was marked, that no revocation
    /// covers, unless that kind is most of the nodes
    /// ([`registry::Standing::too_many`]), and silent ones only while this
    /// control plane hears the cluster: not only those just marked, but
    /// also those whose revocation failed to be written before (a full
    /// disk, a restart in between) and those another control plane's
    /// registry reported. A control plane whose own EK its registry
    /// revokes revokes no one.
    pub async fn sweep(&self) -> Result<usize, EvidenceError> {
        let grace = self.inner.config.interval() * SILENT_AFTER;
        let now = registry::now();
        let sweep = self.hearing().sweep(now, grace);
        if let Some(away) = sweep.away {
            tracing::warn!(
                away_s = away,
                "this control plane did not sweep for a while (paused, stopped, or its clock jumped): silence is counted from now"
            );
        }
        let since = sweep.counting_from;
        let own_ek = self.inner.own_ek;
        let (marked, written) = self
            .store(move |s| Ok(s.mark_silent(now, grace, since, &own_ek)))
            .await?;
        for record in &marked {
            tracing::warn!(
                node = %record.name.escape_debug(),
                ek = %record.ek,
                disk = %record.disk_uuid.escape_debug(),
                reason = %record.reason.as_deref().unwrap_or("").escape_debug(),
                "node silent"
            );
        }
        // A control plane that another revoked judges no one: its view may
        // be cut off from the cluster, and it is to be replaced.
        let revoked_here = self
            .store(move |s| Ok(s.revocation(&own_ek).is_some()))
            .await?;
        if self.inner.config.policy == EvidencePolicy::Revoke && !revoked_here {
            let (pending, standing, own_failing) = self
                .store(move |s| {
                    let registry = s.snapshot();
                    let own = registry
                        .nodes()
                        .get(&own_ek.to_string())
                        .filter(|r| r.verdict.fails())
                        .cloned();
                    Ok((
                        registry.failing_unrevoked(&own_ek),
                        registry.standing(&own_ek),
                        own,
                    ))
                })
                .await?;
            if let Some(own) = own_failing {
                tracing::error!(
                    verdict = own.verdict.as_str(),
                    reason = %own.reason.as_deref().unwrap_or("").escape_debug(),
                    "this control plane's own evidence fails; its policy does not revoke it: its peers do, or, if it is the only control plane, revoke or replace it by hand"
                );
            }
            // Drifted or silent nodes, each kind on its own, are revoked
            // only while they are not most of the cluster (a fault of this
            // control plane's view or inputs is likelier), and only once
            // their verdict held a while (a drift [`EvidenceConfig::drift_hold`], a
            // silence an interval after marking): by then every member has
            // reported under the same conditions, so a fault that turns
            // them all is seen as one before any is revoked.
            let drift_held = standing.too_many(standing.drifted);
            let silence_held = standing.too_many(standing.silent);
            for (held, count, kind) in [
                (drift_held, standing.drifted, "drifted"),
                (silence_held, standing.silent, "silent"),
            ] {
                if held {
                    held_back(&standing, count, kind);
                }
            }
            let held_back_at = {
                let mut at = self
                    .inner
                    .held_back_at
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner);
                if drift_held {
                    at.drifted = Some(now);
                }
                if silence_held {
                    at.silent = Some(now);
                }
                *at
            };
            // With other control planes, silence is judged on a view that
            // includes theirs: the registry of each that is not silent here
            // merged within the grace period (a host that lets a peer's
            // evidence reach this control plane but not its registry pulls
            // must not make the nodes only that peer hears look silent).
            let view_current = self
                .inner
                .registry
                // Judged now, not at the sweep's start: a merge that
                // landed while the sweep waited for the registry is not
                // one from the future.
                .view_current(&self.inner.own_ek, registry::now().max(now), grace);
            let may_revoke_silent = sweep.may_revoke_silent && view_current && !silence_held;
            // A drift that rests on this control plane's clock alone (a
            // certificate, revocation list or collateral outside its window
            // at this time, the rest of the evidence held) is for the
            // operator: a host that set this clock ahead, or back, would
            // otherwise choose whom the policy revokes.
            let (on_clock, pending): (Vec<_>, Vec<_>) = pending
                .into_iter()
                .partition(|r| r.verdict == Verdict::Drifted && r.on_clock);
            for record in &on_clock {
                tracing::error!(
                    node = %record.name.escape_debug(),
                    ek = %record.ek,
                    reason = %record.reason.as_deref().unwrap_or("").escape_debug(),
                    "not revoked by policy: the node's evidence fails only for a validity period at this control plane's time (check its clock, fetch the collateral again; an expired certificate of the node is for the operator): revoke it by hand (keel revoke) if it is lost"
                );
            }
            let drift_hold = self.inner.config.drift_hold().as_secs();
            let (since_held_back, pending): (Vec<_>, Vec<_>) = pending
                .into_iter()
                .partition(|r| !held_back_at.revocable(r));
            if !since_held_back.is_empty() {
                tracing::warn!(
                    count = since_held_back.len(),
                    "not revoked by policy: nodes whose verdict dates from while too many nodes failed at once; revoke by hand (keel revoke) what is really lost"
                );
            }
            let (revocable, held): (Vec<_>, Vec<_>) =
                pending.into_iter().partition(|r| match r.verdict {
                    Verdict::Silent => {
                        may_revoke_silent && self.hearing().marked_long_enough(r.verdict_at, now)
                    }
                    _ => !drift_held && now.saturating_sub(r.verdict_at) >= drift_hold,
                });
            let silent_held = held.iter().filter(|r| r.verdict == Verdict::Silent).count();
            if silent_held > 0 && !(sweep.may_revoke_silent && view_current) {
                tracing::warn!(
                    silent = silent_held,
                    grace_s = grace.as_secs(),
                    peers = standing.peers,
                    peers_merged = view_current,
                    "silent nodes not revoked: this control plane has not heard other members, or merged another control plane's registry, throughout the grace period (cut off, back from an absence, or its peers are down: revoke a control plane that is gone for good)"
                );
            }
            for record in &revocable {
                // One failure does not keep the others unrevoked.
                if let Err(e) = self.apply_policy(record).await {
                    tracing::error!(
                        node = %record.name.escape_debug(),
                        ek = %record.ek,
                        error = %keel_atls::ErrorChain(&e),
                        "revoking a node by policy failed; the next sweep tries again"
                    );
                }
            }
        }
        written.map_err(EvidenceError::Registry)?;
        Ok(marked.len())
    }

    fn hearing(&self) -> MutexGuard<'_, Hearing> {
        self.inner
            .hearing
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Sweeps every interval until the task is dropped.
    pub async fn sweep_forever(self) {
        let mut tick = tokio::time::interval(self.inner.config.interval());
        loop {
            tick.tick().await;
            if let Err(e) = self.sweep().await {
                tracing::error!(error = %keel_atls::ErrorChain(&e), "marking silent nodes failed");
            }
        }
    }

    /// The registry, for a peer that is a control plane of this cluster;
    /// copied and encoded (up to the registry's bound) on a blocking
    /// thread. A control plane this registry revokes gets the revocation
    /// list alone: no other control plane takes its evidence, so this is
    /// how it learns that it is revoked (and stops issuing tickets) and
    /// which nodes were revoked since; of the other nodes it learns
    /// nothing.
    ///
    /// The answer comes with the request's in-flight mark: put in the
    /// response ([`HeldUntilSent`]), it lasts until the answer was sent,
    /// so that a caller that does not read its answers has one in memory
    /// at a time, not one more each second.
    pub async fn registry_for(
        &self,
        peer: &Verified,
    ) -> Result<(Vec<u8>, HeldUntilSent), EvidenceError> {
        let (ek, revoked) = match self.admit(peer) {
            Ok(ek) => (ek, false),
            Err(EvidenceError::Revoked(_)) => (EkDigest::of_public(&peer.ek), true),
            Err(e) => return Err(e),
        };
        let ek = *ek.as_bytes();
        keel_verifier::validator::check_control_plane(peer)
            .map_err(|_| EvidenceError::NotControlPlane)?;
        let reading = self
            .wait_turn(
                ek,
                |p| &mut p.reading,
                |p| p.last_read,
                REGISTRY_GAP,
                EvidenceError::RegistryBusy,
            )
            .await?;
        if let Some(pace) = self.paces().get_mut(&ek) {
            pace.last_read = Some(Instant::now());
        }
        // The mark goes with the copy, not with the call: a caller that
        // gives up on the call cannot start another copy while this one
        // runs, nor one that reads it.
        self.store(move |s| {
            let registry = if revoked {
                s.revocations().to_json()
            } else {
                s.snapshot().to_json()
            };
            Ok((registry, HeldUntilSent::new(reading)))
        })
        .await
    }

    /// Runs `op` on the registry store on a blocking thread (it writes
    /// the file).
    async fn store<T: Send + 'static>(
        &self,
        op: impl FnOnce(&RegistryStore) -> Result<T, RegistryError> + Send + 'static,
    ) -> Result<T, EvidenceError> {
        let registry = self.inner.registry.clone();
        tokio::task::spawn_blocking(move || op(&registry))
            .await
            .map_err(|_| EvidenceError::Registry(RegistryError::Task))?
            .map_err(EvidenceError::Registry)
    }
}

/// Logs that the `revoke` policy held back its revocations of `kind`
/// nodes this sweep: `count` of them is too many at once.
fn held_back(standing: &registry::Standing, count: usize, kind: &str) {
    tracing::error!(
        kind,
        count,
        unrevoked = standing.unrevoked,
        "not revoked by policy: more than half of the nodes are {kind} at once, likelier a fault of this control plane's view or inputs (a partition, stale CPU collateral, wrong measurements) than that many nodes compromised; revoke by hand (keel revoke) what is really lost"
    );
}

/// The failure a member's evidence is recorded with, and whether it rests
/// on the clock: this service's own checks (`own`: the cluster lock, the
/// components, the identity) come first, so that a refusal for a date
/// alone (`untimely`, [`ValidationError::rests_on_the_clock`])
/// is the record's only when the node failed nothing else.
fn recorded_failure(
    own: Option<String>,
    untimely: Option<ValidationError>,
) -> (Option<String>, bool) {
    match (own, untimely) {
        (Some(failure), _) => (Some(failure), false),
        (None, Some(refusal)) => (Some(refusal.to_string()), true),
        (None, None) => (None, false),
    }
}

/// What validation does not cover: PCR 15 names exactly this cluster, and
/// PCR 13 grew only by authorised components. `None` if both hold.
fn judge(
    verified: &Verified,
    cluster_id: &[u8; 32],
    cluster: Option<&ClusterState>,
) -> Option<String> {
    if let Err(e) = check_member(verified, cluster_id) {
        return Some(format!("PCR 15: {e}"));
    }
    for event in verified
        .events
        .iter()
        .filter(|e| e.event_type == EventType::Component)
    {
        // Read strictly (each field once, no other), and held to an
        // authorised component's hash at that component's path: authorised
        // bytes installed as another binary are not authorised.
        match MeasuredComponent::parse(&event.data) {
            Some(m) if cluster.is_some_and(|c| c.authorises(&m)) => {}
            Some(m) => {
                return Some(format!(
                    "PCR 13: component {} at {} is not of an authorised version",
                    m.hash,
                    m.install_path.escape_debug()
                ))
            }
            None => return Some("PCR 13: a component event does not read as one".into()),
        }
    }
    None
}

/// The validated claims of the peer of `request`.
fn peer_claims<T>(
    request: &tonic::Request<T>,
) -> Result<Arc<keel_atls::Attested<Verified>>, EvidenceError> {
    crate::grpc::attested_peer(request).ok_or(EvidenceError::NotAttested)
}

/// The identity event is in PCR 13, which no measurement pins: evidence
/// whose log names no single identity (a second identity event, or one that
/// does not parse), or another than the connection's handshake named (an
/// event added after it), drifts. `handshake` is the handshake's identity.
fn identity_failure(handshake: Option<&NodeIdentity>, verified: &Verified) -> Option<String> {
    match (handshake, verified.identity()) {
        (Some(then), Some(now)) if *then == now => None,
        (Some(_), Some(_)) => Some("PCR 13: the node identity differs from its handshake's".into()),
        _ => Some("PCR 13: the event log names no single node identity".into()),
    }
}

/// Logs a refusal and maps it. Refusals decided before any validation (a
/// peer that is no member, revoked, busy or without a nonce) are logged at
/// debug: any peer that completes a handshake can ask again and again,
/// and at warn its requests would crowd the journal's rate limit and
/// drop the events an operator needs (drifts, revocations). The rest
/// cost the peer a nonce each, or are this control plane's own failures.
fn refused(what: &str, e: &EvidenceError) -> tonic::Status {
    use EvidenceError as E;
    match e {
        // What an operator should see (a revoked node still knocking, a
        // worker asking for registries), at most once a minute at warn.
        E::Revoked(_) | E::NotControlPlane if SIGNS.admit(Instant::now()) => {
            tracing::warn!(error = %keel_atls::ErrorChain(e), "{what} refused (such refusals are logged at warn once a minute)")
        }
        E::NotAttested
        | E::NotMember(_)
        | E::Revoked(_)
        | E::Busy
        | E::RegistryBusy
        | E::NonceNotIssued
        | E::NotControlPlane => {
            tracing::debug!(error = %keel_atls::ErrorChain(e), "{what} refused")
        }
        _ => tracing::warn!(error = %keel_atls::ErrorChain(e), "{what} refused"),
    }
    e.into()
}

/// When a refusal that is a sign for the operator was last logged at warn.
static SIGNS: OncePerMinute = OncePerMinute(std::sync::Mutex::new(None));

/// Admits one event a minute (on the monotonic clock, which the host
/// cannot step).
struct OncePerMinute(std::sync::Mutex<Option<Instant>>);

impl OncePerMinute {
    /// Whether an event at `now` is the first in a minute; if so, it is
    /// the last admitted from now on.
    fn admit(&self, now: Instant) -> bool {
        let mut last = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if last.is_some_and(|last| now.saturating_duration_since(last) < Duration::from_secs(60)) {
            return false;
        }
        *last = Some(now);
        true
    }
}

#[tonic::async_trait]
impl evidence_service_server::EvidenceService for EvidenceService {
    async fn next_nonce(
        &self,
        request: tonic::Request<NextNonceRequest>,
    ) -> Result<tonic::Response<NextNonceResponse>, tonic::Status> {
        let peer = peer_claims(&request).map_err(|e| refused("nonce request", &e))?;
        let place = request.extensions().get::<HeldPlace>();
        let nonce = self
            .next_nonce_in(peer.claims(), place)
            .await
            .map_err(|e| refused("nonce request", &e))?;
        Ok(tonic::Response::new(NextNonceResponse {
            nonce: nonce.to_vec(),
            interval_seconds: self.inner.config.interval().as_secs() as u32,
        }))
    }

    async fn submit(
        &self,
        request: tonic::Request<SubmitEvidenceRequest>,
    ) -> Result<tonic::Response<SubmitEvidenceResponse>, tonic::Status> {
        let peer = peer_claims(&request).map_err(|e| refused("evidence", &e))?;
        let verdict = EvidenceService::submit(self, peer.claims(), request.into_inner())
            .await
            .map_err(|e| refused("evidence", &e))?;
        Ok(tonic::Response::new(SubmitEvidenceResponse {
            verdict: verdict.as_str().to_owned(),
        }))
    }

    async fn registry(
        &self,
        request: tonic::Request<RegistryRequest>,
    ) -> Result<tonic::Response<RegistryResponse>, tonic::Status> {
        let peer = peer_claims(&request).map_err(|e| refused("registry request", &e))?;
        let (registry, reading) = self
            .registry_for(peer.claims())
            .await
            .map_err(|e| refused("registry request", &e))?;
        let mut answer = tonic::Response::new(RegistryResponse {
            registry,
            served_at: crate::registry::now(),
        });
        answer.extensions_mut().insert(reading);
        Ok(answer)
    }
}

#[cfg(test)]
mod tests {
    use super::OncePerMinute;

    /// A node whose evidence fails on a date alone, and also fails this
    /// service's own checks (a component, the cluster lock), drifted for
    /// those: a drift that rests on the clock is never left to the
    /// operator for a node that failed anything else.
    #[test]
    fn a_failure_of_the_services_own_checks_is_never_one_of_the_clock() {
        use super::recorded_failure;
        use keel_verifier::ek::EkError;
        use keel_verifier::validator::ValidationError;
        let untimely = || Some(ValidationError::Endorsement(EkError::Validity));
        assert!(untimely().is_some_and(|e| e.rests_on_the_clock()));
        let own = Some("PCR 13: a component no version of the cluster lists".to_owned());
        assert_eq!(
            recorded_failure(own.clone(), untimely()),
            (own.clone(), false)
        );
        assert_eq!(recorded_failure(own.clone(), None), (own, false));
        let (failure, on_clock) = recorded_failure(None, untimely());
        assert!(on_clock && failure.is_some_and(|f| f.contains("not valid")));
        assert_eq!(recorded_failure(None, None), (None, false));
    }

    /// A full pace table forgets the EKs whose paces bind nothing (their
    /// nonces expired, their gaps past, nothing in flight) to pace a new
    /// member, and keeps every pace that still binds.
    #[test]
    fn a_full_pace_table_forgets_idle_members() {
        use super::{make_room, Pace, MAX_NODES};
        use std::collections::HashMap;
        use std::time::{Duration, Instant};
        let idle = Duration::from_secs(90);
        let start = Instant::now();
        let now = start + Duration::from_secs(1000);
        let ek = |i: usize| {
            let mut ek = [0u8; 32];
            ek[..8].copy_from_slice(&(i as u64).to_be_bytes());
            ek
        };
        let mut paces: HashMap<[u8; 32], Pace> = (0..MAX_NODES)
            .map(|i| {
                let pace = Pace {
                    last: Some(now - Duration::from_secs(60)),
                    ..Pace::default()
                };
                (ek(i), pace)
            })
            .collect();
        assert!(!make_room(&mut paces, now, idle), "every pace still binds");
        assert_eq!(paces.len(), MAX_NODES);

        // Gone quiet long ago: its last evidence, its last registry
        // request and its nonce all older than the idle time.
        paces.insert(
            ek(0),
            Pace {
                last: Some(start),
                last_read: Some(start),
                nonce: Some(([7; 32], start)),
                ..Pace::default()
            },
        );
        // Quiet as long, but its nonce request is in flight.
        paces.insert(
            ek(1),
            Pace {
                waiting: true,
                last: Some(start),
                ..Pace::default()
            },
        );
        // Its last evidence long ago, its nonce fresh.
        paces.insert(
            ek(2),
            Pace {
                last: Some(start),
                nonce: Some(([7; 32], now - Duration::from_secs(10))),
                ..Pace::default()
            },
        );
        assert!(make_room(&mut paces, now, idle));
        assert_eq!(paces.len(), MAX_NODES - 1);
        assert!(!paces.contains_key(&ek(0)));
        assert!(paces.contains_key(&ek(1)) && paces.contains_key(&ek(2)));
    }

    #[test]
    fn a_sign_is_logged_at_warn_once_a_minute() {
        use std::time::{Duration, Instant};
        let signs = OncePerMinute(std::sync::Mutex::new(None));
        let start = Instant::now();
        let at = |s: u64| start + Duration::from_secs(s);
        assert!(signs.admit(at(0)));
        assert!(!signs.admit(at(0)));
        assert!(!signs.admit(at(59)));
        assert!(signs.admit(at(60)));
        assert!(!signs.admit(at(61)));
    }
}
