//! An attacker's issuer for tests: documents that carry a real node's
//! endorsement key and certificate, its real PCR values and event log, and a
//! quote signed by a *software* P-256 key that claims to be the attestation
//! key (same TPM attributes, another public point).
//!
//! Every field a document validator can check from the document alone is
//! right: the EK certificate chains to the trusted CA and certifies the EK,
//! the "AK" declares fixedTPM/restricted/sign, the quote verifies with it and
//! binds the handshake's nonce and key, the PCRs and the event log are the
//! real node's. Only key residency can tell: the software key is in no TPM,
//! so a credential made for the EK and its name cannot be activated. The
//! forger tries anyway by relaying the challenge to the real node's issuer
//! (whose TPM holds the EK, but not this key).

use std::sync::atomic::{AtomicUsize, Ordering};

use keel_atls::{DynIssuer, IssueError, Issuer, ResidencySecret};
use keel_proto::attestation::AttestationDocument;
use p256::ecdsa::signature::hazmat::PrehashSigner;
use p256::ecdsa::{Signature, SigningKey};
use prost::Message;
use sha2::{Digest as _, Sha256};

const ALG_NULL: u16 = 0x0010;
const ALG_ECDSA: u16 = 0x0018;
const ALG_SHA256: u16 = 0x000B;

/// Why a template document cannot be forged from.
#[derive(Debug, thiserror::Error)]
#[error("cannot forge from this document: {0}")]
pub struct ForgeryError(&'static str);

/// Issues forged documents (see the module docs).
pub struct SoftwareAk {
    template: AttestationDocument,
    key: SigningKey,
    relay: Option<DynIssuer>,
    answered: AtomicUsize,
    issued: AtomicUsize,
}

impl SoftwareAk {
    /// A forger from one genuine document of the node to impersonate (any
    /// nonce: anyone who connects to a node gets one). `relay`, if given,
    /// is the real node's issuer, to which residency challenges are passed.
    pub fn new(genuine: &[u8], relay: Option<DynIssuer>) -> Result<Self, ForgeryError> {
        let mut template = AttestationDocument::decode(genuine)
            .map_err(|_| ForgeryError("not an attestation document"))?;
        let key = SigningKey::random(&mut rand::rngs::OsRng);
        let point = key.verifying_key().to_encoded_point(false);
        let (Some(x), Some(y)) = (point.x(), point.y()) else {
            return Err(ForgeryError("software key has no affine point"));
        };
        template.ak_public = replace_ecc_point(&template.ak_public, x, y)?;
        Ok(Self {
            template,
            key,
            relay,
            answered: AtomicUsize::new(0),
            issued: AtomicUsize::new(0),
        })
    }

    /// Claims the endorsement key and certificate of another TPM: one the
    /// forger holds, whose EK certificate chains to a trusted CA (any
    /// machine of the same provider has one) but which runs other software.
    pub fn with_endorsement(mut self, ek_public: Vec<u8>, ek_certificate: Vec<u8>) -> Self {
        self.template.ek_public = ek_public;
        self.template.ek_certificate = ek_certificate;
        self
    }

    /// Gives the software key's public area an admin policy: sets
    /// adminWithPolicy and puts `auth_policy` in its authPolicy, so that a
    /// TPM holding only that public area might accept a policy session for
    /// ActivateCredential.
    pub fn with_admin_policy(mut self, auth_policy: &[u8]) -> Result<Self, ForgeryError> {
        self.template.ak_public = replace_admin_policy(&self.template.ak_public, auth_policy)?;
        Ok(self)
    }

    /// The forged attestation key's public area (marshalled TPMT_PUBLIC).
    pub fn ak_public(&self) -> &[u8] {
        &self.template.ak_public
    }

    /// Residency challenges this forger received.
    pub fn challenges_received(&self) -> usize {
        self.answered.load(Ordering::SeqCst)
    }

    /// Documents this forger issued.
    pub fn documents_issued(&self) -> usize {
        self.issued.load(Ordering::SeqCst)
    }

    /// A forged document for `nonce` and `user_data`.
    pub fn forge(&self, nonce: &[u8], user_data: &[u8]) -> Result<Vec<u8>, ForgeryError> {
        let mut doc = self.template.clone();
        doc.user_data = user_data.to_vec();
        // A batch of one: no path.
        doc.quote_batch_index = 0;
        doc.quote_batch_path.clear();
        doc.quote = replace_extra_data(&doc.quote, &qualifying_data(nonce, user_data))?;
        let prehash = Sha256::digest(&doc.quote);
        let signature: Signature = self
            .key
            .sign_prehash(&prehash)
            .map_err(|_| ForgeryError("signing failed"))?;
        let (r, s) = signature.split_bytes();
        let mut sig = Vec::with_capacity(72);
        sig.extend_from_slice(&ALG_ECDSA.to_be_bytes());
        sig.extend_from_slice(&ALG_SHA256.to_be_bytes());
        for scalar in [r.as_slice(), s.as_slice()] {
            sig.extend_from_slice(&(scalar.len() as u16).to_be_bytes());
            sig.extend_from_slice(scalar);
        }
        doc.signature = sig;
        Ok(doc.encode_to_vec())
    }
}

impl Issuer for SoftwareAk {
    fn issue(&self, nonce: &[u8], user_data: &[u8]) -> Result<Vec<u8>, IssueError> {
        self.issued.fetch_add(1, Ordering::SeqCst);
        self.forge(nonce, user_data).map_err(IssueError::new)
    }

    fn answer(&self, challenge: &[u8]) -> Result<ResidencySecret, IssueError> {
        self.answered.fetch_add(1, Ordering::SeqCst);
        match &self.relay {
            Some(real) => real.answer(challenge),
            None => Err(IssueError::new(ForgeryError("a software key is in no TPM"))),
        }
    }
}

/// The qualifying data keel's verifiers expect of a batch of one request
/// (docs/attestation.md): the root is the request's leaf.
fn qualifying_data(nonce: &[u8], user_data: &[u8]) -> [u8; 32] {
    let mut leaf = Sha256::new();
    leaf.update(b"keel-quote-leaf-v2");
    leaf.update((nonce.len() as u16).to_be_bytes());
    leaf.update(nonce);
    leaf.update(user_data);
    let mut h = Sha256::new();
    h.update(b"keel-quote-v2");
    h.update(leaf.finalize());
    h.finalize().into()
}

struct Cursor<'a> {
    buf: &'a [u8],
    at: usize,
}

impl Cursor<'_> {
    fn skip(&mut self, n: usize) -> Result<(), ForgeryError> {
        if self.at + n > self.buf.len() {
            return Err(ForgeryError("truncated structure"));
        }
        self.at += n;
        Ok(())
    }

    fn u16(&mut self) -> Result<u16, ForgeryError> {
        let b = self
            .buf
            .get(self.at..self.at + 2)
            .ok_or(ForgeryError("truncated structure"))?;
        self.at += 2;
        Ok(u16::from_be_bytes([b[0], b[1]]))
    }

    fn skip_tpm2b(&mut self) -> Result<(), ForgeryError> {
        let n = usize::from(self.u16()?);
        self.skip(n)
    }
}

/// A TPMT_PUBLIC of an ECC key with its point replaced.
fn replace_ecc_point(public: &[u8], x: &[u8], y: &[u8]) -> Result<Vec<u8>, ForgeryError> {
    let mut c = Cursor { buf: public, at: 0 };
    c.skip(2 + 2 + 4)?; // type, nameAlg, objectAttributes
    c.skip_tpm2b()?; // authPolicy
    if c.u16()? != ALG_NULL {
        c.skip(4)?; // symmetric key bits and mode
    }
    if c.u16()? != ALG_NULL {
        c.skip(2)?; // scheme hash
    }
    c.skip(2 + 2)?; // curve, KDF
    let point_at = c.at;
    let mut out = public[..point_at].to_vec();
    for coordinate in [x, y] {
        out.extend_from_slice(&(coordinate.len() as u16).to_be_bytes());
        out.extend_from_slice(coordinate);
    }
    Ok(out)
}

/// A TPMT_PUBLIC with adminWithPolicy set and its authPolicy replaced.
fn replace_admin_policy(public: &[u8], auth_policy: &[u8]) -> Result<Vec<u8>, ForgeryError> {
    const ADMIN_WITH_POLICY: u32 = 1 << 7;
    let mut c = Cursor { buf: public, at: 0 };
    c.skip(2 + 2)?; // type, nameAlg
    let attributes_at = c.at;
    c.skip(4)?;
    c.skip_tpm2b()?; // authPolicy
    let policy_len =
        u16::try_from(auth_policy.len()).map_err(|_| ForgeryError("policy too long"))?;
    let mut attributes = [0u8; 4];
    attributes.copy_from_slice(&public[attributes_at..attributes_at + 4]);
    let attributes = u32::from_be_bytes(attributes) | ADMIN_WITH_POLICY;
    let mut out = public[..attributes_at].to_vec();
    out.extend_from_slice(&attributes.to_be_bytes());
    out.extend_from_slice(&policy_len.to_be_bytes());
    out.extend_from_slice(auth_policy);
    out.extend_from_slice(&public[c.at..]);
    Ok(out)
}

/// A TPMS_ATTEST with its extraData (qualifying data) replaced.
fn replace_extra_data(attest: &[u8], extra: &[u8; 32]) -> Result<Vec<u8>, ForgeryError> {
    let mut c = Cursor { buf: attest, at: 0 };
    c.skip(4 + 2)?; // magic, type
    c.skip_tpm2b()?; // qualifiedSigner
    let start = c.at;
    c.skip_tpm2b()?; // extraData
    let mut out = attest[..start].to_vec();
    out.extend_from_slice(&32u16.to_be_bytes());
    out.extend_from_slice(extra);
    out.extend_from_slice(&attest[c.at..]);
    Ok(out)
}
