//! The verifier side: the one place an attestation document is judged.
//!
//! A document is accepted when the EK certificate chains to a trusted CA and
//! certifies the document's EK, the AK is a restricted TPM signing key, the
//! quote's signature verifies with it, the quote's qualifying data binds this
//! handshake's nonce and user data (through the root of the quoted batch,
//! recomputed from them and the document's inclusion path, [`crate::batch`]),
//! the reported PCR values match the quoted
//! digest, the agent's event log replays to those values, and every enforced
//! expected PCR matches (warn-only mismatches are logged) in one of the
//! accepted sets of measurements: the current one or, while a new image
//! rolls out, the staged one ([`Validator::accepting`]). What these checks
//! cannot prove, that the AK lives in the EK's TPM, is proven next, before
//! aTLS hands the connection to anyone: a key residency challenge made with
//! TPM2_MakeCredential to the EK and the AK's name
//! ([`keel_atls::Validator::residency_challenge`], [`crate::credential`]).
//! A validator remembers (bounded) the EK and AK pairs proven through it, so
//! later handshakes with the same AK skip the TPM round.
//!
//! The attestation variant ([`crate::cpu`]) decides whether the document
//! must also carry the CPU's evidence: for `sev-snp` and `tdx` it is
//! verified against the hardware roots next to the quote, and its
//! `report_data` must commit to the AK that signed the quote (and to this
//! handshake's nonce), so the quote is rooted in the CPU.

use std::collections::{BTreeMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};

use keel_proto::attestation::{cpu_evidence, AttestationDocument};
use prost::Message;
use sha2::{Digest as _, Sha256};

use crate::batch::{self, BatchError, InclusionPath};
use crate::cpu::{Binding, CpuClaims, CpuError, CpuTrust, Evidence};
use crate::ek::{EkError, EkTrust};
use crate::measurement::{verify_replay, Digest32, Event, EventType, ReplayError};
use crate::measurements::{Measurements, Mismatch};
use crate::quote::{qualifying_data, verify_quote, QuoteError};
use crate::signature::{SignedMeasurements, SignedMeasurementsError, SigningPublicKey};
use crate::tpm_wire::{Public, WireError};

/// Largest accepted encoded document.
pub const MAX_DOCUMENT_BYTES: usize = 256 * 1024;
/// Most events a document may carry.
const MAX_EVENTS: usize = 1024;

/// Why a document was refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ValidationError {
    /// Larger than [`MAX_DOCUMENT_BYTES`].
    #[error("attestation document is larger than {MAX_DOCUMENT_BYTES} bytes")]
    TooLarge,
    /// Not a document.
    #[error("attestation document does not decode")]
    Decode(#[source] prost::DecodeError),
    /// A field is malformed.
    #[error("attestation document: {0}")]
    Field(&'static str),
    /// A TPM structure is malformed.
    #[error(transparent)]
    Wire(#[from] WireError),
    /// The quote batch's inclusion path is malformed or out of bounds.
    #[error("attestation document: {0}")]
    BatchPath(#[from] BatchError),
    /// The EK is not trusted.
    #[error("endorsement key not trusted: {0}")]
    Endorsement(#[from] EkError),
    /// The quote does not verify.
    #[error("quote rejected: {0}")]
    Quote(#[from] QuoteError),
    /// The event log does not replay to the quoted PCRs.
    #[error("event log rejected: {0}")]
    EventLog(#[from] ReplayError),
    /// Enforced PCRs differ from the expected values.
    #[error("measurements do not match: {}", list(.0))]
    Measurements(Vec<Mismatch>),
    /// The user data in the document differs from what the channel expects.
    #[error("attestation document user data does not match the channel")]
    UserData,
    /// The CPU evidence is missing, does not verify or does not bind the AK.
    #[error("CPU evidence rejected: {0}")]
    Cpu(#[from] CpuError),
    /// The PCRs match no accepted set, and the signed measurements of its
    /// image the document carries do not verify.
    #[error("the image measurements the peer presents are refused: {0}")]
    SignedImage(#[from] SignedMeasurementsError),
}

impl ValidationError {
    /// Whether the document was refused for a validity period at the
    /// verification time alone: an EK certificate or CA, a certificate of
    /// the CPU vendor's chain, a revocation list or collateral outside its
    /// window. The verifier's clock decides that, and a host can set a
    /// confidential VM's clock, so such a refusal says more about the
    /// verifier's clock (or a certificate that expired) than about what
    /// the peer runs. [`Validator::validate`] reports it only once every
    /// other check passed: the quote, the event log, the user data and the
    /// measurements (of the CPU vendor's checks, those the failing one
    /// comes before did).
    pub fn rests_on_the_clock(&self) -> bool {
        match self {
            Self::Endorsement(e) => e.rests_on_the_clock(),
            Self::Cpu(e) => e.rests_on_the_clock(),
            _ => false,
        }
    }
}

fn list(m: &[Mismatch]) -> String {
    m.iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

/// What a verifier knows after accepting a document.
#[derive(Clone, Debug)]
pub struct Verified {
    /// The endorsement key (RSA-2048), for sealing secrets.
    pub ek: Public,
    /// The attestation key; its name seals secrets to it.
    pub ak: Public,
    /// The quoted PCR values.
    pub pcrs: BTreeMap<u32, Digest32>,
    /// The agent's event log, replayed and checked.
    pub events: Vec<Event>,
    /// Warn-only PCRs that differed.
    pub warnings: Vec<Mismatch>,
    /// Which accepted set the peer matched: its [`Measurements::digest`]
    /// as given to the validator (before any required values were added).
    pub measurements: Digest32,
    /// The verified CPU evidence (`None` for the `vtpm` variant).
    pub cpu: Option<CpuClaims>,
}

impl Verified {
    /// The node name and role of the peer's replayed node-identity event:
    /// `None` when the log has none, more than one (the agent measures its
    /// identity once; a second is not its own) or it does not parse.
    pub fn identity(&self) -> Option<crate::config::NodeIdentity> {
        self.measured(EventType::NodeIdentity)
    }

    /// The cluster part of the peer's node config, from its replayed
    /// config event (what its PCR 12 measures): `None` when the log has
    /// none, more than one or it does not parse.
    pub fn cluster_config(&self) -> Option<crate::config::ClusterConfig> {
        self.measured(EventType::NodeConfig)
    }

    /// The data of the log's one event of `kind`, parsed.
    fn measured<T: serde::de::DeserializeOwned>(&self, kind: EventType) -> Option<T> {
        let mut of_kind = self.events.iter().filter(|e| e.event_type == kind);
        let event = of_kind.next()?;
        if of_kind.next().is_some() {
            return None;
        }
        serde_json::from_slice(&event.data).ok()
    }
}

/// EK and AK pairs whose residency was proven, oldest first out.
#[derive(Debug, Default)]
pub struct ProvenKeys {
    inner: Mutex<ProvenSet>,
}

#[derive(Debug, Default)]
struct ProvenSet {
    members: HashSet<[u8; 32]>,
    order: VecDeque<[u8; 32]>,
}

impl ProvenKeys {
    /// Most pairs remembered; the oldest is forgotten first (and proven
    /// again at its next handshake).
    pub const CAPACITY: usize = 4096;

    fn key(verified: &Verified) -> [u8; 32] {
        let mut h = Sha256::new();
        h.update(b"keel-proven-ak-v1");
        h.update((verified.ek.name.len() as u32).to_be_bytes());
        h.update(&verified.ek.name);
        h.update(&verified.ak.name);
        h.finalize().into()
    }

    fn contains(&self, verified: &Verified) -> bool {
        let set = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        set.members.contains(&Self::key(verified))
    }

    fn insert(&self, verified: &Verified) {
        let key = Self::key(verified);
        let mut set = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        if set.members.insert(key) {
            set.order.push_back(key);
            while set.order.len() > Self::CAPACITY {
                if let Some(old) = set.order.pop_front() {
                    set.members.remove(&old);
                }
            }
        }
    }
}

/// One set of measurements a validator accepts, with its name.
#[derive(Clone, Debug)]
struct AcceptedSet {
    measurements: Measurements,
    digest: Digest32,
}

impl AcceptedSet {
    fn new(measurements: Measurements, required: &[(u32, Digest32)]) -> Self {
        let digest = measurements.digest();
        let mut measurements = measurements;
        for (pcr, value) in required {
            measurements.require(*pcr, *value);
        }
        Self {
            measurements,
            digest,
        }
    }

    /// The mismatches of `pcrs` with this set: warn-only ones, then
    /// enforced ones.
    fn mismatches(&self, pcrs: &BTreeMap<u32, Digest32>) -> (Vec<Mismatch>, Vec<Mismatch>) {
        self.measurements
            .compare(pcrs)
            .into_iter()
            .partition(|m| m.warn_only)
    }
}

/// A verifier's policy: the accepted measurements (one set, or two while a
/// new image rolls out) and the trusted EK CAs.
#[derive(Clone, Debug)]
pub struct Validator {
    current: AcceptedSet,
    staged: Option<AcceptedSet>,
    ek_trust: EkTrust,
    cpu: Arc<CpuTrust>,
    proven: Arc<ProvenKeys>,
    enforce: bool,
    signed_images: Option<SignedImages>,
}

/// Images the operator vouches for: a peer whose PCRs match no accepted set
/// is accepted when its document carries a measurements file signed with
/// `key` that its PCRs match, with `required` values added.
#[derive(Clone, Debug)]
struct SignedImages {
    key: SigningPublicKey,
    required: Vec<(u32, Digest32)>,
}

impl Validator {
    /// A validator with these expectations.
    pub fn new(measurements: Measurements, ek_trust: EkTrust) -> Self {
        Self::with_proven_keys(measurements, ek_trust, Arc::default())
    }

    /// A validator that shares its memory of proven keys with others (e.g.
    /// the successive validators of a reloaded measurements file).
    pub fn with_proven_keys(
        measurements: Measurements,
        ek_trust: EkTrust,
        proven: Arc<ProvenKeys>,
    ) -> Self {
        Self::accepting(measurements, None, &[], ek_trust, proven)
    }

    /// A validator that accepts a peer matching `current` or, if given,
    /// `staged` (the measurements of a new image during its rollout), each
    /// with the `required` values added (e.g. PCR 15 = zero): the same
    /// checks for both sets, only the expected values differ. Shares its
    /// memory of proven keys like [`Validator::with_proven_keys`].
    pub fn accepting(
        current: Measurements,
        staged: Option<Measurements>,
        required: &[(u32, Digest32)],
        ek_trust: EkTrust,
        proven: Arc<ProvenKeys>,
    ) -> Self {
        Self {
            current: AcceptedSet::new(current, required),
            staged: staged.map(|s| AcceptedSet::new(s, required)),
            ek_trust,
            cpu: Arc::default(),
            proven,
            enforce: true,
            signed_images: None,
        }
    }

    /// The same validator, also accepting a peer of another image whose
    /// document carries that image's measurements signed with `key` and
    /// whose PCRs match them, with the `required` values added (e.g. this
    /// node's own config PCR). A set given to the validator is always
    /// tried first; the signed one only when none matches. What a join
    /// client needs during an image rollout: the join service may run the
    /// old image or the new one.
    pub fn with_signed_images(self, key: SigningPublicKey, required: &[(u32, Digest32)]) -> Self {
        Self {
            signed_images: Some(SignedImages {
                key,
                required: required.to_vec(),
            }),
            ..self
        }
    }

    /// The same validator with this attestation variant and CPU trust
    /// (the default is the `vtpm` variant, which needs no CPU evidence).
    pub fn with_cpu(self, cpu: Arc<CpuTrust>) -> Self {
        Self { cpu, ..self }
    }

    /// A validator for diagnostics only (`keel verify -o json`): every
    /// check runs, key residency included, but measurement mismatches are
    /// returned in [`Verified::warnings`] instead of refusing the document,
    /// so a refused node can be reported PCR by PCR. Never use it to decide
    /// whether to send a peer anything.
    pub fn diagnostic(measurements: Measurements, ek_trust: EkTrust) -> Self {
        Self {
            enforce: false,
            ..Self::new(measurements, ek_trust)
        }
    }

    /// The current expected measurements (required values included).
    pub fn measurements(&self) -> &Measurements {
        &self.current.measurements
    }

    /// The staged measurements also accepted, if any (required values
    /// included).
    pub fn staged(&self) -> Option<&Measurements> {
        self.staged.as_ref().map(|s| &s.measurements)
    }

    /// Validates an encoded document for a handshake's `nonce` and `user_data`.
    pub fn validate(
        &self,
        document: &[u8],
        nonce: &[u8],
        user_data: &[u8],
    ) -> Result<Verified, ValidationError> {
        match self.validate_but_for_the_clock(document, nonce, user_data)? {
            (_, Some(refusal)) => Err(refusal),
            (verified, None) => Ok(verified),
        }
    }

    /// Like [`Validator::validate`], except that a refusal that rests on
    /// the clock alone ([`ValidationError::rests_on_the_clock`]) comes
    /// beside what every other check established, for a caller that still
    /// has checks of its own to run before it may call the refusal one of
    /// the clock (continuous attestation: the cluster lock, the components,
    /// the node's identity). The document is refused all the same: a
    /// [`Verified`] that comes with a refusal is never to be trusted, and
    /// its CPU claims are missing when the refusal is theirs. Every `Err`
    /// is a refusal that does not rest on the clock.
    pub fn validate_but_for_the_clock(
        &self,
        document: &[u8],
        nonce: &[u8],
        user_data: &[u8],
    ) -> Result<(Verified, Option<ValidationError>), ValidationError> {
        let _span = tracing::debug_span!("attest.validate").entered();
        if document.len() > MAX_DOCUMENT_BYTES {
            return Err(ValidationError::TooLarge);
        }
        // A batch leaf encodes the nonce's length in 16 bits: a longer one
        // would be ambiguous. The verifier's own nonces are 32 bytes.
        if nonce.len() > batch::MAX_NONCE_BYTES {
            return Err(ValidationError::Field("nonce longer than 65535 bytes"));
        }
        let doc = AttestationDocument::decode(document).map_err(ValidationError::Decode)?;
        crate::ek::check_template(&doc.ek_public)?;
        let ek = Public::parse(&doc.ek_public)?;
        // A refusal for a validity period alone is held until the other
        // checks ran: one of them failing is the refusal reported, so a
        // refusal that rests on the clock means that the rest held.
        let mut untimely: Option<ValidationError> = None;
        match tracing::debug_span!("attest.validate.ek_certificate")
            .in_scope(|| self.ek_trust.verify(&doc.ek_certificate, &ek))
        {
            Err(e) if e.rests_on_the_clock() => untimely = Some(e.into()),
            checked => checked?,
        }
        let ak = Public::parse(&doc.ak_public)?;
        let pcrs = pcr_values(&doc)?;
        // The quote covers a batch: the root recomputed from this nonce,
        // the document's user data and its path must be the quoted one, so
        // a nonce outside the batch, or a path or user data moved between
        // leaves, fails here.
        let path = InclusionPath::new(doc.quote_batch_index, &doc.quote_batch_path)?;
        let root = path.root(&batch::leaf(nonce, &doc.user_data)?);
        tracing::debug_span!("attest.validate.quote").in_scope(|| {
            verify_quote(
                &ak,
                &doc.quote,
                &doc.signature,
                &qualifying_data(&root),
                &pcrs,
            )
        })?;
        let evidence = doc.cpu_evidence.as_ref().map(cpu_evidence).transpose()?;
        // The guest binding commits to the batch root, which holds the nonce.
        let cpu = match self.cpu.verify(
            evidence.as_ref(),
            &doc.ak_public,
            &root,
            crate::clock::now(),
        ) {
            Err(e) if e.rests_on_the_clock() => {
                untimely.get_or_insert(e.into());
                None
            }
            checked => checked?,
        };
        // Checked after the quote, against the document's own user data: a
        // replayed document fails on its nonce, a moved one on its key.
        if doc.user_data != user_data {
            return Err(ValidationError::UserData);
        }
        let events = events(&doc)?;
        verify_replay(&events, &pcrs)?;
        let (measurements, warnings) = match self.matching_set(&pcrs) {
            Ok((set, warnings)) => (set.digest, warnings),
            Err(refused) => self.signed_image(&doc, &pcrs).unwrap_or(Err(refused))?,
        };
        if untimely.is_none() {
            for w in &warnings {
                tracing::warn!(pcr = w.pcr, "warn-only measurement differs: {w}");
            }
        }
        let verified = Verified {
            ek,
            ak,
            pcrs,
            events,
            warnings,
            measurements,
            cpu,
        };
        Ok((verified, untimely))
    }
}

impl Validator {
    /// The first accepted set (current, then staged) whose enforced values
    /// all match, with its warn-only mismatches; otherwise the current
    /// set's mismatches. A diagnostic validator takes the current set with
    /// every mismatch as a warning when no set matches.
    fn matching_set(
        &self,
        pcrs: &BTreeMap<u32, Digest32>,
    ) -> Result<(&AcceptedSet, Vec<Mismatch>), ValidationError> {
        let split = |set: &AcceptedSet| set.mismatches(pcrs);
        let (current_warnings, current_enforced) = split(&self.current);
        if current_enforced.is_empty() {
            return Ok((&self.current, current_warnings));
        }
        if let Some(staged) = &self.staged {
            let (warnings, enforced) = split(staged);
            if enforced.is_empty() {
                return Ok((staged, warnings));
            }
        }
        if !self.enforce {
            let mut all = current_warnings;
            all.extend(current_enforced);
            all.sort_by_key(|m| m.pcr);
            return Ok((&self.current, all));
        }
        Err(ValidationError::Measurements(current_enforced))
    }
}

impl Validator {
    /// Judges the signed image measurements `doc` carries, if this
    /// validator accepts signed images and the document carries some:
    /// `None` otherwise. The set's digest and warn-only mismatches when
    /// the signature verifies and every enforced value matches.
    fn signed_image(
        &self,
        doc: &AttestationDocument,
        pcrs: &BTreeMap<u32, Digest32>,
    ) -> Option<Result<(Digest32, Vec<Mismatch>), ValidationError>> {
        let images = self.signed_images.as_ref()?;
        let presented = doc.image_measurements.as_ref()?;
        Some((|| {
            let signed = SignedMeasurements::verify(
                &images.key,
                &presented.measurements,
                &presented.signature,
            )?;
            let set = AcceptedSet::new(signed.measurements().clone(), &images.required);
            let (warnings, enforced) = set.mismatches(pcrs);
            if !enforced.is_empty() {
                return Err(ValidationError::Measurements(enforced));
            }
            Ok((set.digest, warnings))
        })())
    }
}

fn cpu_evidence(e: &keel_proto::attestation::CpuEvidence) -> Result<Evidence, ValidationError> {
    let binding = match cpu_evidence::Binding::try_from(e.binding) {
        Ok(cpu_evidence::Binding::Guest) => Binding::Guest,
        Ok(cpu_evidence::Binding::AzureHcl) => Binding::AzureHcl,
        Err(_) => return Err(ValidationError::Field("unknown CPU evidence binding")),
    };
    Ok(Evidence {
        binding,
        report: e.report.clone(),
        certificate: e.certificate.clone(),
    })
}

/// Whether a validated peer's replayed node identity names the
/// control-plane role. Its image and cluster lock are the same on every
/// node of a cluster: only this tells a control plane from a worker, so
/// whoever trusts a peer to serve control-plane state (join tickets,
/// registries, recovery) checks it.
pub fn check_control_plane(peer: &Verified) -> Result<(), &'static str> {
    let identities = peer
        .events
        .iter()
        .filter(|e| e.event_type == EventType::NodeIdentity)
        .count();
    if identities != 1 {
        return Err("its event log holds no single node identity");
    }
    match peer.identity() {
        Some(identity) if identity.role == crate::config::Role::ControlPlane => Ok(()),
        Some(_) => Err("its measured node identity is not a control plane"),
        None => Err("its event log holds no node identity that parses"),
    }
}

/// The value `document` claims for PCR `index`, read without checking
/// anything: only to pick which of two policies validates the document
/// (validation then checks the quote over that very value). `None` when the
/// document is too large or malformed, or names no such PCR.
pub fn claimed_pcr(document: &[u8], index: u32) -> Option<Digest32> {
    if document.len() > MAX_DOCUMENT_BYTES {
        return None;
    }
    let doc = AttestationDocument::decode(document).ok()?;
    let claimed = doc.pcrs.iter().find(|v| v.index == index)?;
    claimed.digest.as_slice().try_into().ok()
}

/// Whether a validated peer is locked into exactly `cluster_id`: its log
/// has exactly one cluster-ID event, naming `cluster_id`, and its PCR 15 is
/// that event's single extend. Returns what is wrong otherwise.
pub fn check_cluster_lock(peer: &Verified, cluster_id: &[u8; 32]) -> Result<(), &'static str> {
    use crate::measurement::{event_digest, extend, pcr};
    let locks: Vec<_> = peer
        .events
        .iter()
        .filter(|e| e.event_type == EventType::ClusterId)
        .collect();
    let [event] = locks.as_slice() else {
        return Err("not locked into exactly one cluster");
    };
    if event.data.as_slice() != cluster_id.as_slice() {
        return Err("locked into another cluster");
    }
    let expected = extend(
        &[0; 32],
        &event_digest(event.seq, EventType::ClusterId, cluster_id),
    );
    if peer.pcrs.get(&pcr::CLUSTER_ID) != Some(&expected) {
        return Err("PCR 15 is not the extend of the cluster ID");
    }
    Ok(())
}

fn pcr_values(doc: &AttestationDocument) -> Result<BTreeMap<u32, Digest32>, ValidationError> {
    let mut out = BTreeMap::new();
    for v in &doc.pcrs {
        let digest: Digest32 = v
            .digest
            .as_slice()
            .try_into()
            .map_err(|_| ValidationError::Field("PCR value is not 32 bytes"))?;
        if v.index >= 24 || out.insert(v.index, digest).is_some() {
            return Err(ValidationError::Field("PCR index out of range or repeated"));
        }
    }
    Ok(out)
}

fn events(doc: &AttestationDocument) -> Result<Vec<Event>, ValidationError> {
    if doc.event_log.len() > MAX_EVENTS {
        return Err(ValidationError::Field("too many events"));
    }
    doc.event_log
        .iter()
        .map(|e| {
            Ok(Event {
                seq: e.seq,
                pcr: e.pcr,
                digest: e
                    .digest
                    .as_slice()
                    .try_into()
                    .map_err(|_| ValidationError::Field("event digest is not 32 bytes"))?,
                event_type: EventType::parse(&e.event_type)
                    .ok_or(ValidationError::Field("unknown event type"))?,
                description: e.description.clone(),
                data: e.data.clone(),
            })
        })
        .collect()
}

/// The aTLS kind of a refusal: a document that does not parse is
/// malformed, a wrong key binding or nonce is named as such, anything else
/// is rejected.
impl From<ValidationError> for keel_atls::ValidationError {
    fn from(e: ValidationError) -> Self {
        match e {
            ValidationError::TooLarge
            | ValidationError::Decode(_)
            | ValidationError::Field(_)
            | ValidationError::Wire(_)
            | ValidationError::BatchPath(_) => Self::malformed(e),
            ValidationError::UserData => Self::KeyBindingMismatch,
            ValidationError::Quote(QuoteError::QualifyingData) => Self::NonceMismatch,
            other => Self::rejected(other),
        }
    }
}

impl keel_atls::Validator for Validator {
    type Claims = Verified;

    fn validate(
        &self,
        document: &[u8],
        nonce: &[u8],
        user_data: &[u8],
    ) -> Result<Verified, keel_atls::ValidationError> {
        Validator::validate(self, document, nonce, user_data).map_err(Into::into)
    }

    fn residency_challenge(
        &self,
        claims: &Verified,
    ) -> Result<Option<keel_atls::Challenge>, keel_atls::ValidationError> {
        if self.proven.contains(claims) {
            return Ok(None);
        }
        let (message, secret) = crate::credential::residency_challenge(&claims.ek, &claims.ak.name)
            .map_err(keel_atls::ValidationError::rejected)?;
        Ok(Some(keel_atls::Challenge::new(message, secret)))
    }

    fn residency_proven(&self, claims: &Verified) {
        self.proven.insert(claims);
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::panic)]
mod tests {
    use super::*;
    use crate::measurements::{Expected, REQUIRED_PCRS};

    fn set(value: u8) -> Measurements {
        Measurements::new(REQUIRED_PCRS.map(|p| (p, Expected::enforced([value; 32])))).unwrap()
    }

    fn pcrs(value: u8, pcr15: u8) -> BTreeMap<u32, Digest32> {
        let mut pcrs: BTreeMap<u32, Digest32> =
            REQUIRED_PCRS.iter().map(|p| (*p, [value; 32])).collect();
        pcrs.insert(15, [pcr15; 32]);
        pcrs
    }

    #[test]
    fn a_claimed_pcr_is_read_only_from_a_well_formed_document() {
        use keel_proto::attestation::PcrValue;
        let doc = |pcrs: Vec<PcrValue>| AttestationDocument {
            pcrs,
            ..AttestationDocument::default()
        };
        let value = |index, digest: Vec<u8>| PcrValue { index, digest };
        let encoded = doc(vec![value(4, vec![1; 32]), value(15, vec![0; 32])]).encode_to_vec();
        assert_eq!(claimed_pcr(&encoded, 15), Some([0; 32]));
        assert_eq!(claimed_pcr(&encoded, 4), Some([1; 32]));
        assert_eq!(claimed_pcr(&encoded, 12), None);
        let short = doc(vec![value(15, vec![0; 31])]).encode_to_vec();
        assert_eq!(claimed_pcr(&short, 15), None);
        assert_eq!(claimed_pcr(b"\xff\xff\xff", 15), None);
        // Past the size bound nothing is read.
        let big = [encoded.as_slice(), &vec![0; MAX_DOCUMENT_BYTES]].concat();
        assert_eq!(claimed_pcr(&big, 15), None);
    }

    #[test]
    fn a_nonce_longer_than_its_length_field_is_refused_before_anything_else() {
        let validator = Validator::new(set(1), EkTrust::default());
        let long = vec![7; usize::from(u16::MAX) + 1];
        assert!(matches!(
            validator.validate(b"", &long, b""),
            Err(ValidationError::Field(f)) if f.contains("nonce")
        ));
        // Of the length field's size, the document is what fails.
        let longest = vec![7; usize::from(u16::MAX)];
        assert!(matches!(
            validator.validate(b"\xff", &longest, b""),
            Err(ValidationError::Decode(_))
        ));
    }

    #[test]
    fn a_peer_matches_the_current_or_the_staged_set_and_the_required_values_bind_both() {
        let (old, new) = (set(1), set(2));
        let required = [(15, [0; 32])];
        let only_old = Validator::accepting(
            old.clone(),
            None,
            &required,
            EkTrust::default(),
            Arc::default(),
        );
        let both = Validator::accepting(
            old.clone(),
            Some(new.clone()),
            &required,
            EkTrust::default(),
            Arc::default(),
        );

        // The old image: accepted by both, named by the old set's digest
        // (without the required values).
        let (matched, _) = only_old.matching_set(&pcrs(1, 0)).unwrap();
        assert_eq!(matched.digest, old.digest());
        assert_eq!(
            both.matching_set(&pcrs(1, 0)).unwrap().0.digest,
            old.digest()
        );
        // The new image: only while the new set is staged.
        let Err(ValidationError::Measurements(m)) = only_old.matching_set(&pcrs(2, 0)) else {
            panic!("a node of the new image was accepted before staging");
        };
        assert_eq!(m.iter().map(|m| m.pcr).collect::<Vec<_>>(), REQUIRED_PCRS);
        assert_eq!(
            both.matching_set(&pcrs(2, 0)).unwrap().0.digest,
            new.digest()
        );
        // PCR 15 must be zero in either set; a mix of both images matches
        // neither.
        assert!(both.matching_set(&pcrs(1, 7)).is_err());
        assert!(both.matching_set(&pcrs(2, 7)).is_err());
        let mut mixed = pcrs(1, 0);
        mixed.insert(4, [2; 32]);
        assert!(both.matching_set(&mixed).is_err());

        // A diagnostic validator reports every difference from the current
        // set instead of refusing.
        let diagnostic = Validator::diagnostic(old.clone(), EkTrust::default());
        let (_, warnings) = diagnostic.matching_set(&pcrs(3, 0)).unwrap();
        assert_eq!(
            warnings.iter().map(|m| m.pcr).collect::<Vec<_>>(),
            REQUIRED_PCRS
        );
    }
}
