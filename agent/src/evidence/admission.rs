//! Who the join port admits: nodes that ask to join (PCR 15 zero, the join
//! service's policy, unchanged) and members of this cluster that send
//! evidence (the same measurements without PCR 15, the cluster's config
//! PCR, and PCR 15 the extend of exactly this cluster's ID).
//!
//! Both are judged by [`keel_verifier::validator::Validator`]; the members'
//! validator is built from the measurements the cluster state carries (the
//! ones the join service's files are written from) and rebuilt when the
//! operator replaces them. It accepts what the join service accepts: the
//! current set or, during an image rollout, the staged one
//! ([`member_validator`]), so a node that rejoined on the new image keeps
//! reporting. Key residency is proven through the join policy's validator
//! for both, so a proven AK is remembered once. Members are held to the
//! join policy's CPU evidence too (its variant, roots and collateral), on
//! every document they send, not only at the handshake.

use std::sync::{Arc, Mutex, PoisonError};

use keel_verifier::cpu::CpuTrust;
use keel_verifier::ek::EkTrust;
use keel_verifier::keys::ClusterId;
use keel_verifier::measurement::{pcr, Digest32};
use keel_verifier::measurements::{Expected, Measurements, MeasurementsError};
use keel_verifier::validator::{claimed_pcr, Validator, Verified};

use crate::attestation::policy::ReloadableValidator;
use crate::cluster::{ClusterSlot, ClusterState};

/// The validator of members' evidence, following the cluster state.
pub struct MemberPolicy {
    cluster: tokio::sync::watch::Receiver<Option<Arc<ClusterState>>>,
    ek_trust: EkTrust,
    config_pcr: Digest32,
    cpu: Arc<CpuTrust>,
    built: Mutex<Option<MemberValidator>>,
}

/// The validator members are checked with now, and the SHA-256 of the
/// measurements it was built from.
#[derive(Clone)]
pub struct MemberValidator {
    /// The validator.
    pub validator: Arc<Validator>,
    /// SHA-256 of the current join measurements (JSON) it enforces.
    pub measurements: Digest32,
    /// SHA-256 of the staged measurements (JSON) it also accepts, if any.
    pub staged: Option<Digest32>,
    /// The cluster members must be locked into.
    pub cluster_id: ClusterId,
    /// What the validator names the staged set (PCR 15 removed), as
    /// [`Verified::measurements`] reports the set a member matched.
    staged_member_set: Option<Digest32>,
}

impl MemberValidator {
    /// SHA-256 of the join measurements (JSON) `verified` matched: the
    /// staged set's if it matched that one, else the current set's.
    pub fn matched(&self, verified: &Verified) -> Digest32 {
        match (self.staged, self.staged_member_set) {
            (Some(staged), Some(named)) if verified.measurements == named => staged,
            _ => self.measurements,
        }
    }
}

/// A set of join measurements as members are held to it: PCR 15 removed
/// (a member's is checked against the cluster ID instead).
fn member_set(join: &Measurements) -> Result<Measurements, MeasurementsError> {
    Measurements::new(
        join.iter()
            .filter(|(p, _)| **p != pcr::CLUSTER_ID)
            .map(|(p, e): (&u32, &Expected)| (*p, e.clone())),
    )
}

/// The one place a members' validator is built from a cluster state: it
/// accepts a member matching the current join measurements or, during an
/// image rollout, the staged ones (what the join service accepts), each
/// without PCR 15 and with the cluster's config PCR `config_pcr` required,
/// and CPU evidence as `cpu` requires it (the join policy's).
pub fn member_validator(
    state: &ClusterState,
    ek_trust: EkTrust,
    config_pcr: Digest32,
    cpu: Arc<CpuTrust>,
) -> Result<MemberValidator, MeasurementsError> {
    let current = member_set(&state.join_measurements)?;
    let staged = state
        .staged_measurements
        .as_ref()
        .map(member_set)
        .transpose()?;
    let staged_member_set = staged.as_ref().map(Measurements::digest);
    Ok(MemberValidator {
        validator: Arc::new(
            Validator::accepting(
                current,
                staged,
                &[(pcr::CONFIG, config_pcr)],
                ek_trust,
                Arc::default(),
            )
            .with_cpu(cpu),
        ),
        measurements: state.join_measurements.digest(),
        staged: state.staged_measurements.as_ref().map(Measurements::digest),
        cluster_id: state.cluster_id,
        staged_member_set,
    })
}

/// Why a member's document was refused beyond its validation.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AdmissionError {
    /// This node serves no cluster yet.
    #[error("this control plane serves no cluster yet")]
    NoCluster,
    /// The members' measurements cannot be built.
    #[error("the members' measurements")]
    Measurements(#[source] MeasurementsError),
    /// PCR 15 is not the extend of exactly this cluster's ID.
    #[error("not a member of this cluster: {0}")]
    NotMember(&'static str),
}

impl MemberPolicy {
    /// A policy following `cluster`, trusting EKs of `ek_trust`, requiring
    /// the config PCR `config_pcr` (the cluster config's) and CPU evidence
    /// as `cpu` says (the join policy's, [`ReloadableValidator::cpu`]).
    pub fn new(
        cluster: &ClusterSlot,
        ek_trust: EkTrust,
        config_pcr: Digest32,
        cpu: Arc<CpuTrust>,
    ) -> Self {
        Self {
            cluster: cluster.subscribe(),
            ek_trust,
            config_pcr,
            cpu,
            built: Mutex::new(None),
        }
    }

    /// The validator for the cluster state in force now.
    pub fn current(&self) -> Result<MemberValidator, AdmissionError> {
        let state = self
            .cluster
            .borrow()
            .clone()
            .ok_or(AdmissionError::NoCluster)?;
        let mut built = self.built.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(member) = &*built {
            let staged = state.staged_measurements.as_ref().map(Measurements::digest);
            if member.measurements == state.join_measurements.digest()
                && member.staged == staged
                && member.cluster_id == state.cluster_id
            {
                return Ok(member.clone());
            }
        }
        let member = member_validator(
            &state,
            self.ek_trust.clone(),
            self.config_pcr,
            self.cpu.clone(),
        )
        .map_err(AdmissionError::Measurements)?;
        *built = Some(member.clone());
        Ok(member)
    }
}

/// The member's PCR 15 must be the extend of exactly `cluster_id` (of any
/// role).
pub fn check_member(peer: &Verified, cluster_id: &ClusterId) -> Result<(), AdmissionError> {
    keel_verifier::validator::check_cluster_lock(peer, cluster_id)
        .map_err(AdmissionError::NotMember)
}

/// The join port's validator: the join policy for a document that claims
/// PCR 15 zero, the members' policy (a member of this cluster) for any
/// other.
pub struct PortValidator {
    join: Arc<ReloadableValidator>,
    members: Arc<MemberPolicy>,
}

impl PortValidator {
    /// Admits what `join` admits, and members by `members`.
    pub fn new(join: Arc<ReloadableValidator>, members: Arc<MemberPolicy>) -> Self {
        Self { join, members }
    }
}

impl PortValidator {
    /// The port's policy with the join policy as it is now, for one
    /// handshake.
    fn pinned(&self) -> OneHandshake {
        OneHandshake {
            join: self.join.current(),
            members: self.members.clone(),
        }
    }
}

impl keel_atls::Validator for PortValidator {
    type Claims = Verified;

    fn validate(
        &self,
        document: &[u8],
        nonce: &[u8],
        user_data: &[u8],
    ) -> Result<Verified, keel_atls::ValidationError> {
        self.pinned().validate(document, nonce, user_data)
    }

    fn residency_challenge(
        &self,
        claims: &Verified,
    ) -> Result<Option<keel_atls::Challenge>, keel_atls::ValidationError> {
        self.pinned().residency_challenge(claims)
    }

    fn residency_proven(&self, claims: &Verified) {
        self.pinned().residency_proven(claims);
    }

    /// The join policy in force as the handshake starts validates the
    /// peer, challenges it and records its proof, whatever reload lands
    /// meanwhile.
    fn for_one_handshake(&self) -> Option<keel_atls::DynValidator<Verified>> {
        Some(Arc::new(self.pinned()))
    }
}

/// [`PortValidator`] with its join policy fixed, for one handshake.
struct OneHandshake {
    join: Arc<Validator>,
    members: Arc<MemberPolicy>,
}

impl keel_atls::Validator for OneHandshake {
    type Claims = Verified;

    fn validate(
        &self,
        document: &[u8],
        nonce: &[u8],
        user_data: &[u8],
    ) -> Result<Verified, keel_atls::ValidationError> {
        // The join policy requires PCR 15 zero, and a member's PCR 15 is
        // the extend of the cluster ID: the value the document claims picks
        // the one policy that can accept it, which then checks the quote
        // over that value. A member's handshake is validated once.
        if claimed_pcr(document, pcr::CLUSTER_ID) == Some([0; 32]) {
            return Validator::validate(&self.join, document, nonce, user_data).map_err(Into::into);
        }
        let member = self
            .members
            .current()
            .map_err(keel_atls::ValidationError::rejected)?;
        let verified =
            keel_atls::Validator::validate(&*member.validator, document, nonce, user_data)?;
        check_member(&verified, &member.cluster_id)
            .map_err(keel_atls::ValidationError::rejected)?;
        Ok(verified)
    }

    fn residency_challenge(
        &self,
        claims: &Verified,
    ) -> Result<Option<keel_atls::Challenge>, keel_atls::ValidationError> {
        keel_atls::Validator::residency_challenge(&*self.join, claims)
    }

    fn residency_proven(&self, claims: &Verified) {
        keel_atls::Validator::residency_proven(&*self.join, claims);
    }
}
