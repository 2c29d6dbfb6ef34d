//! Endorsement-key trust: the EK certificate must be issued by a configured
//! CA (for QEMU, the swtpm local CA; in a cloud, the vTPM vendor's CA) and
//! certify exactly the EK public key the document carries.
//!
//! Every configured certificate whose subject is the EK certificate's
//! issuer is a candidate (CAs are renewed under the same name, and two
//! vendors may share one); the certificate is trusted when one candidate's
//! key verifies its signature and that candidate is itself valid now and a
//! CA (basicConstraints cA=true and the keyCertSign key usage, where the
//! extensions are present). The signature must be RSA over SHA-256,
//! SHA-384 or SHA-512, or ECDSA over SHA-256 or SHA-384: a SHA-1
//! certificate is refused whoever signed it. Validity periods, the
//! certificate's and its CA's, are checked last: a refusal for the time
//! alone means every other check held.
//!
//! A node presents the same certificate in every handshake, so a trust
//! remembers (bounded) the certificates it accepted, each with the EK it
//! certifies and the time window in which both it and its CA are valid: a
//! later check of the same pair within that window skips the parsing and
//! the signature check.

use x509_parser::oid_registry::{
    Oid, OID_NIST_HASH_SHA256, OID_NIST_HASH_SHA384, OID_NIST_HASH_SHA512, OID_PKCS1_RSASSAPSS,
    OID_PKCS1_SHA1WITHRSA, OID_PKCS1_SHA256WITHRSA, OID_PKCS1_SHA384WITHRSA,
    OID_PKCS1_SHA512WITHRSA, OID_SHA1_WITH_RSA, OID_SIG_ECDSA_WITH_SHA256,
    OID_SIG_ECDSA_WITH_SHA384, OID_X509_EXT_BASIC_CONSTRAINTS,
};
use x509_parser::prelude::{FromDer, ParsedExtension, X509Certificate};
use x509_parser::public_key::PublicKey as CertKey;
use x509_parser::signature_algorithm::RsaSsaPssParams;

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};

use sha2::{Digest as _, Sha256};
use subtle::ConstantTimeEq as _;

use crate::tpm_wire::{Public, PublicKey};

/// Why an endorsement key is not trusted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EkError {
    /// The CA bundle holds no usable certificate.
    #[error("no trusted EK CA certificate configured")]
    NoAnchors,
    /// A block of the EK CA bundle is not a certificate that parses whole.
    #[error("EK CA bundle, block {index} (from 0): {reason}")]
    Bundle {
        /// Which block.
        index: usize,
        /// What is wrong with it.
        reason: String,
    },
    /// The document has no EK certificate.
    #[error("the document carries no EK certificate")]
    NoCertificate,
    /// The EK certificate does not parse.
    #[error("EK certificate does not parse")]
    Parse,
    /// No configured CA issued the EK certificate.
    #[error("EK certificate issuer {0:?} is not a trusted EK CA")]
    UntrustedIssuer(String),
    /// The certificate's signature does not verify with the key of any CA
    /// named as its issuer.
    #[error("EK certificate signature does not verify with the CA key")]
    Signature,
    /// The CA whose key signed the certificate is outside its own validity
    /// period.
    #[error("EK CA {0:?} is not valid at this time")]
    CaValidity(String),
    /// The configured certificate whose key signed the EK certificate is
    /// not a CA certificate.
    #[error("EK CA {subject:?} is not a CA certificate: {reason}")]
    NotCa {
        /// The CA certificate's subject.
        subject: String,
        /// What it lacks.
        reason: &'static str,
    },
    /// The certificate is outside its validity period.
    #[error("EK certificate is not valid at this time")]
    Validity,
    /// The certificate certifies another key than the document's EK.
    #[error("EK certificate is for another key than the endorsement key in the document")]
    KeyMismatch,
    /// The certificate is not fit to certify an endorsement key.
    #[error("EK certificate is not an endorsement key certificate: {0}")]
    NotEkCertificate(&'static str),
    /// The document's EK public area is not the RSA-2048 EK template.
    #[error("endorsement key public area is not the TCG RSA-2048 EK template: {0}")]
    Template(&'static str),
    /// The certificate is signed with an algorithm outside
    /// [`SIGNATURE_ALGORITHMS`] (SHA-1, say).
    #[error(
        "EK certificate is signed with {0}; only RSA (PKCS#1 v1.5 or PSS) with SHA-256, SHA-384 or SHA-512 and ECDSA with SHA-256 or SHA-384 are taken"
    )]
    SignatureAlgorithm(String),
    /// The certificate's outer signature algorithm is not the one its
    /// signed part names (RFC 5280, 4.1.1.2): the unsigned identifier was
    /// changed.
    #[error(
        "EK certificate names the signature algorithm {outer} outside its signed part and {signed} inside it{params}"
    )]
    AlgorithmMismatch {
        /// The algorithm beside the signature.
        outer: String,
        /// The algorithm in the signed part.
        signed: String,
        /// Said when only the algorithms' parameters differ.
        params: &'static str,
    },
}

impl EkError {
    /// Whether the refusal is of a validity period at the verification
    /// time (the EK certificate's or its CA's), which the verifier's clock
    /// decides: the certificate, its issuer and its signature were checked
    /// and passed.
    pub fn rests_on_the_clock(&self) -> bool {
        matches!(self, Self::Validity | Self::CaValidity(_))
    }
}

/// The marshalled TPMT_PUBLIC of the TCG EK Credential Profile's RSA-2048
/// EK template (L-1) up to its modulus: type RSA, nameAlg SHA-256,
/// fixedTPM | fixedParent | sensitiveDataOrigin | adminWithPolicy |
/// restricted | decrypt, authPolicy PolicySecret(TPM_RH_ENDORSEMENT),
/// AES-128-CFB, no scheme, 2048 bits, the default exponent; then the
/// modulus's size, 256.
const EK_TEMPLATE_PREFIX: [u8; 58] = [
    0x00, 0x01, // TPM_ALG_RSA
    0x00, 0x0b, // TPM_ALG_SHA256
    0x00, 0x03, 0x00, 0xb2, // objectAttributes
    0x00, 0x20, // authPolicy
    0x83, 0x71, 0x97, 0x67, 0x44, 0x84, 0xb3, 0xf8, 0x1a, 0x90, 0xcc, 0x8d, 0x46, 0xa5, 0xd7, 0x24,
    0xfd, 0x52, 0xd7, 0x6e, 0x06, 0x52, 0x0b, 0x64, 0xf2, 0xa1, 0xda, 0x1b, 0x33, 0x14, 0x69,
    0xaa, //
    0x00, 0x06, 0x00, 0x80, 0x00, 0x43, // AES, 128 bits, CFB
    0x00, 0x10, // no scheme
    0x08, 0x00, // 2048 bits
    0x00, 0x00, 0x00, 0x00, // exponent: 65537
    0x01, 0x00, // unique: 256 bytes
];

/// The certificate at the start of `nv` (an EK certificate index's
/// contents), without what follows it: some TPMs pad the index past the
/// certificate. `nv` as it is if it does not start with one.
pub fn certificate_in(nv: &[u8]) -> &[u8] {
    match X509Certificate::from_der(nv) {
        Ok((rest, _)) => &nv[..nv.len() - rest.len()],
        Err(_) => nv,
    }
}

/// Requires a document's marshalled EK public area to be the RSA-2048 EK
/// template ([`EK_TEMPLATE_PREFIX`]) with a 256-byte modulus. The EK
/// certificate certifies only the modulus, and an EK's identity
/// ([`EkDigest`]: revocation, disk bindings and keys, per-EK limits) is a
/// digest of the whole area: any other field left free would let one TPM
/// present as many EKs as it liked. A TPM's real EK, which is what
/// activates the residency credential under PolicySecret(endorsement), has
/// exactly this area.
pub fn check_template(marshalled: &[u8]) -> Result<(), EkError> {
    let Some((prefix, modulus)) = marshalled.split_at_checked(EK_TEMPLATE_PREFIX.len()) else {
        return Err(EkError::Template("shorter than the template"));
    };
    if prefix != EK_TEMPLATE_PREFIX {
        let field = match prefix
            .iter()
            .zip(EK_TEMPLATE_PREFIX)
            .position(|(a, b)| *a != b)
        {
            Some(0..=3) => "type or name algorithm",
            Some(4..=7) => "object attributes",
            Some(8..=41) => "authorization policy",
            Some(42..=49) => "symmetric algorithm or scheme",
            Some(50..=55) => "key size or exponent",
            _ => "modulus size",
        };
        return Err(EkError::Template(field));
    }
    if modulus.len() != 256 {
        return Err(EkError::Template("modulus size"));
    }
    Ok(())
}

/// The CAs trusted to issue EK certificates. Clones share the memory of
/// accepted certificates.
#[derive(Clone, Debug, Default)]
pub struct EkTrust {
    anchors: Vec<Vec<u8>>,
    accepted: Arc<Accepted>,
}

/// Certificate and EK pairs this trust accepted, with the window (Unix
/// seconds, inclusive) in which the certificate and its CA are both valid;
/// oldest first out.
#[derive(Debug, Default)]
struct Accepted(Mutex<AcceptedSet>);

#[derive(Debug, Default)]
struct AcceptedSet {
    windows: HashMap<[u8; 32], (i64, i64)>,
    order: VecDeque<[u8; 32]>,
}

impl Accepted {
    /// Most pairs remembered.
    const CAPACITY: usize = 4096;

    fn key(cert_der: &[u8], ek_modulus: &[u8]) -> [u8; 32] {
        let mut h = Sha256::new();
        h.update(b"keel-ek-accepted-v1");
        h.update((cert_der.len() as u64).to_be_bytes());
        h.update(cert_der);
        h.update(ek_modulus);
        h.finalize().into()
    }

    fn contains(&self, key: &[u8; 32], now: i64) -> bool {
        let set = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        set.windows
            .get(key)
            .is_some_and(|(from, to)| (*from..=*to).contains(&now))
    }

    fn insert(&self, key: [u8; 32], window: (i64, i64)) {
        let mut set = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        if set.windows.insert(key, window).is_none() {
            set.order.push_back(key);
            while set.order.len() > Self::CAPACITY {
                if let Some(old) = set.order.pop_front() {
                    set.windows.remove(&old);
                }
            }
        }
    }
}

impl EkTrust {
    /// Reads every certificate of a PEM bundle. The certificate that signs
    /// EK certificates must be in it (an intermediate is trusted as given).
    /// Every block must be a certificate that parses whole: the bundle is
    /// measured as written, and a block skipped here would be a CA an
    /// operator reading the bundle believes trusted and the node does not
    /// (text around the blocks is allowed, as `openssl` writes it).
    pub fn from_pem(pem: &[u8]) -> Result<Self, EkError> {
        let mut anchors: Vec<Vec<u8>> = Vec::new();
        for (index, block) in x509_parser::pem::Pem::iter_from_buffer(pem).enumerate() {
            let refuse = |reason: String| EkError::Bundle { index, reason };
            let block = block.map_err(|e| refuse(format!("not a PEM block: {e}")))?;
            if block.label != "CERTIFICATE" {
                return Err(refuse(format!(
                    "a {:?} block, not a CERTIFICATE",
                    block.label
                )));
            }
            match X509Certificate::from_der(&block.contents) {
                Ok(([], _)) => anchors.push(block.contents),
                Ok((rest, _)) => {
                    return Err(refuse(format!(
                        "{} bytes after the certificate",
                        rest.len()
                    )))
                }
                Err(_) => return Err(refuse("the certificate does not parse".into())),
            }
        }
        if anchors.is_empty() {
            return Err(EkError::NoAnchors);
        }
        Ok(Self {
            anchors,
            accepted: Arc::default(),
        })
    }

    /// Checks that `cert_der` was issued by a trusted CA that is valid now,
    /// is valid now itself and certifies `ek`. A signature algorithm not
    /// taken, or named differently outside the signed part, is refused
    /// before any CA is tried ([`EkError::SignatureAlgorithm`],
    /// [`EkError::AlgorithmMismatch`]). When no CA named as the issuer
    /// signed it and is a CA, the error is the most precise one: a CA that
    /// signed it but is no CA ([`EkError::NotCa`]), else
    /// [`EkError::Signature`], else (no CA of that name)
    /// [`EkError::UntrustedIssuer`]. A CA that signed it but is not valid
    /// now ([`EkError::CaValidity`]), like the certificate's own dates
    /// ([`EkError::Validity`]), is refused only once the certificate's
    /// profile and key held.
    pub fn verify(&self, cert_der: &[u8], ek: &Public) -> Result<(), EkError> {
        if cert_der.is_empty() {
            return Err(EkError::NoCertificate);
        }
        // The certificate alone: a TPM's index may pad it (and agents
        // before 2026-11-29 send the index as it is), and padding must not
        // make another entry of the accepted set.
        let cert_der = certificate_in(cert_der);
        let PublicKey::Rsa { modulus, .. } = &ek.key else {
            return Err(EkError::KeyMismatch);
        };
        let key = Accepted::key(cert_der, modulus);
        if self.accepted.contains(&key, crate::clock::now_signed()) {
            return Ok(());
        }
        let window = self.check(cert_der, ek)?;
        self.accepted.insert(key, window);
        Ok(())
    }

    /// The whole check of [`EkTrust::verify`]; returns the window in which
    /// the certificate and the CA that issued it are both valid.
    fn check(&self, cert_der: &[u8], ek: &Public) -> Result<(i64, i64), EkError> {
        let (_, cert) = X509Certificate::from_der(cert_der).map_err(|_| EkError::Parse)?;
        signature_algorithm(&cert)?;
        let mut refusal: Option<EkError> = None;
        // The issuer: the window of a CA valid now, else the refusal of
        // the first that signed but is not, held back until the rest held.
        let mut issuer: Option<Result<(i64, i64), EkError>> = None;
        for ca in self
            .anchors
            .iter()
            .filter_map(|der| X509Certificate::from_der(der).ok().map(|(_, c)| c))
            .filter(|ca| ca.subject() == cert.issuer())
        {
            match issued_by(&cert, &ca) {
                Ok(()) if valid_now(&ca) => {
                    issuer = Some(Ok(window(&ca)));
                    break;
                }
                Ok(()) => {
                    issuer
                        .get_or_insert_with(|| Err(EkError::CaValidity(ca.subject().to_string())));
                }
                Err(e) => {
                    if refusal
                        .as_ref()
                        .is_none_or(|r| precision(&e) > precision(r))
                    {
                        refusal = Some(e);
                    }
                }
            }
        }
        let Some(issuer) = issuer else {
            return Err(
                refusal.unwrap_or_else(|| EkError::UntrustedIssuer(cert.issuer().to_string()))
            );
        };
        endorsement_profile(&cert)?;
        let PublicKey::Rsa { modulus, .. } = &ek.key else {
            return Err(EkError::KeyMismatch);
        };
        match cert.public_key().parsed() {
            Ok(CertKey::RSA(rsa))
                if strip_zeros(rsa.modulus) == strip_zeros(modulus)
                    && strip_zeros(rsa.exponent) == RSA_DEFAULT_EXPONENT => {}
            _ => return Err(EkError::KeyMismatch),
        }
        // Last, so that a refusal for the time alone means the rest held
        // ([`EkError::rests_on_the_clock`]).
        let (ca_from, ca_to) = issuer?;
        if !valid_now(&cert) {
            return Err(EkError::Validity);
        }
        let (from, to) = window(&cert);
        Ok((from.max(ca_from), to.min(ca_to)))
    }
}

/// The signature algorithms an EK certificate may be signed with,
/// RSASSA-PSS only with one of [`PSS_HASHES`]. SHA-1 is left out: chosen-prefix
/// collisions for it are practical, so a SHA-1 signature over a
/// certificate a CA issued may as well be over one it did not; and the
/// check's SHA-1 path takes RSA keys of 1024 bits.
const SIGNATURE_ALGORITHMS: [&Oid<'static>; 6] = [
    &OID_PKCS1_SHA256WITHRSA,
    &OID_PKCS1_SHA384WITHRSA,
    &OID_PKCS1_SHA512WITHRSA,
    &OID_PKCS1_RSASSAPSS,
    &OID_SIG_ECDSA_WITH_SHA256,
    &OID_SIG_ECDSA_WITH_SHA384,
];

/// The hashes an RSASSA-PSS signature of an EK certificate may use (its
/// parameters name the hash; without one, RFC 4055 makes it SHA-1).
const PSS_HASHES: [&Oid<'static>; 3] = [
    &OID_NIST_HASH_SHA256,
    &OID_NIST_HASH_SHA384,
    &OID_NIST_HASH_SHA512,
];

/// Refuses a certificate whose signature algorithm is not one of
/// [`SIGNATURE_ALGORITHMS`], or is not the one its signed part names (RFC
/// 5280, 4.1.1.2), before any key is tried on it.
fn signature_algorithm(cert: &X509Certificate<'_>) -> Result<(), EkError> {
    let algorithm = &cert.signature_algorithm.algorithm;
    let signed = &cert.tbs_certificate.signature;
    if *signed != cert.signature_algorithm {
        return Err(EkError::AlgorithmMismatch {
            outer: algorithm.to_id_string(),
            signed: signed.algorithm.to_id_string(),
            params: if signed.algorithm == *algorithm {
                " (with other parameters)"
            } else {
                ""
            },
        });
    }
    if *algorithm == OID_PKCS1_RSASSAPSS {
        let hash = cert
            .signature_algorithm
            .parameters
            .as_ref()
            .and_then(|any| RsaSsaPssParams::try_from(any).ok())
            .map(|params| {
                let hash = params.hash_algorithm_oid();
                (PSS_HASHES.contains(&hash), hash.to_id_string())
            });
        return match hash {
            Some((true, _)) => Ok(()),
            Some((false, hash)) => Err(EkError::SignatureAlgorithm(format!(
                "RSASSA-PSS with the hash {hash}"
            ))),
            None => Err(EkError::SignatureAlgorithm(
                "RSASSA-PSS without parameters that parse".to_owned(),
            )),
        };
    }
    if SIGNATURE_ALGORITHMS.contains(&algorithm) {
        return Ok(());
    }
    let name = if *algorithm == OID_PKCS1_SHA1WITHRSA || *algorithm == OID_SHA1_WITH_RSA {
        format!("RSA with SHA-1 ({algorithm})")
    } else {
        format!("the algorithm {algorithm}")
    };
    Err(EkError::SignatureAlgorithm(name))
}

/// 65537, big-endian: the exponent of the EK template (0 in its area).
const RSA_DEFAULT_EXPONENT: &[u8] = &[0x01, 0x00, 0x01];

/// tcg-kp-EKCertificate (TCG EK Credential Profile): the one extended key
/// usage an EK certificate names, where it names one.
const TCG_KP_EK_CERTIFICATE: &[u64] = &[2, 23, 133, 8, 1];

/// Refuses a certificate that could not be an EK's, whatever signed it: a
/// CA certificate, one whose key usage excludes key encipherment (an EK's
/// only use; a TLS server's RSA key, say, may carry only
/// digitalSignature), or one whose extended key usage names any purpose
/// but tcg-kp-EKCertificate (a TLS server's or client's certificate names
/// serverAuth or clientAuth, and may allow key encipherment too). A
/// certificate of a key whose private half exists outside a TPM would let
/// software answer the residency challenge.
fn endorsement_profile(cert: &X509Certificate<'_>) -> Result<(), EkError> {
    match cert.get_extension_unique(&OID_X509_EXT_BASIC_CONSTRAINTS) {
        Err(_) => {
            return Err(EkError::NotEkCertificate(
                "basicConstraints appears more than once",
            ))
        }
        Ok(None) => {}
        Ok(Some(ext)) => match ext.parsed_extension() {
            ParsedExtension::BasicConstraints(bc) if !bc.ca => {}
            ParsedExtension::BasicConstraints(_) => {
                return Err(EkError::NotEkCertificate("it is a CA certificate"))
            }
            _ => return Err(EkError::NotEkCertificate("basicConstraints does not parse")),
        },
    }
    match cert.extended_key_usage() {
        Err(_) => {
            return Err(EkError::NotEkCertificate(
                "extendedKeyUsage does not parse or appears more than once",
            ))
        }
        Ok(None) => {}
        Ok(Some(eku)) => {
            let eku = eku.value;
            let ek_oid = x509_parser::der_parser::oid::Oid::from(TCG_KP_EK_CERTIFICATE)
                .map_err(|_| EkError::NotEkCertificate("extendedKeyUsage"))?;
            let named = [
                eku.any,
                eku.server_auth,
                eku.client_auth,
                eku.code_signing,
                eku.email_protection,
                eku.time_stamping,
                eku.ocsp_signing,
            ];
            if named.into_iter().any(|n| n) || eku.other.iter().any(|oid| *oid != ek_oid) {
                return Err(EkError::NotEkCertificate(
                    "extendedKeyUsage names a purpose other than tcg-kp-EKCertificate",
                ));
            }
        }
    }
    match cert.key_usage() {
        Err(_) => Err(EkError::NotEkCertificate(
            "keyUsage does not parse or appears more than once",
        )),
        Ok(Some(usage)) if !usage.value.key_encipherment() => {
            Err(EkError::NotEkCertificate("keyUsage lacks keyEncipherment"))
        }
        Ok(_) => Ok(()),
    }
}

/// Whether `cert` is valid at [`crate::clock::now`].
fn valid_now(cert: &X509Certificate<'_>) -> bool {
    let (from, to) = window(cert);
    (from..=to).contains(&crate::clock::now_signed())
}

/// The validity period of `cert` in Unix seconds, inclusive.
fn window(cert: &X509Certificate<'_>) -> (i64, i64) {
    let validity = cert.validity();
    (
        validity.not_before.timestamp(),
        validity.not_after.timestamp(),
    )
}

/// Whether `ca` issued `cert` and may: its key verifies the signature and
/// it is a CA. Its validity period is the caller's to check, after the
/// certificate's own checks.
fn issued_by(cert: &X509Certificate<'_>, ca: &X509Certificate<'_>) -> Result<(), EkError> {
    cert.verify_signature(Some(ca.public_key()))
        .map_err(|_| EkError::Signature)?;
    let not_ca = |reason| EkError::NotCa {
        subject: ca.subject().to_string(),
        reason,
    };
    match ca.get_extension_unique(&OID_X509_EXT_BASIC_CONSTRAINTS) {
        Err(_) => return Err(not_ca("basicConstraints appears more than once")),
        Ok(None) => {}
        Ok(Some(ext)) => match ext.parsed_extension() {
            ParsedExtension::BasicConstraints(bc) if bc.ca => {}
            ParsedExtension::BasicConstraints(_) => {
                return Err(not_ca("basicConstraints has cA=false"))
            }
            _ => return Err(not_ca("basicConstraints does not parse")),
        },
    }
    match ca.key_usage() {
        Err(_) => Err(not_ca("keyUsage does not parse or appears more than once")),
        Ok(Some(usage)) if !usage.value.key_cert_sign() => {
            Err(not_ca("keyUsage lacks keyCertSign"))
        }
        Ok(_) => Ok(()),
    }
}

/// How much an issuer refusal says: a CA whose key signed the certificate
/// but cannot vouch for it says more than a key that did not sign it.
fn precision(e: &EkError) -> u8 {
    match e {
        EkError::NotCa { .. } => 2,
        EkError::Signature => 1,
        _ => 0,
    }
}

/// `v` without its leading zero bytes (a big-endian integer's minimal form).
pub(crate) fn strip_zeros(v: &[u8]) -> &[u8] {
    let first = v.iter().position(|&b| b != 0).unwrap_or(v.len());
    &v[first..]
}

/// SHA-256 over an endorsement key's marshalled TPMT_PUBLIC: the digest
/// part of the EK's TPM name (nameAlg SHA-256). Every field of the public
/// area is covered, the RSA modulus included; the TPM recreates the same
/// area from its endorsement seed, so the digest is stable across reboots.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct EkDigest([u8; 32]);

impl EkDigest {
    /// The digest of a marshalled TPMT_PUBLIC.
    pub fn of_marshalled(public: &[u8]) -> Self {
        Self(Sha256::digest(public).into())
    }

    /// The digest of a parsed EK: the same value as [`EkDigest::of_marshalled`]
    /// of the bytes it was parsed from (its name minus the algorithm ID).
    pub fn of_public(ek: &Public) -> Self {
        let mut digest = [0u8; 32];
        match ek.name.get(2..) {
            Some(tail) if tail.len() == digest.len() => digest.copy_from_slice(tail),
            // A parsed Public's name is always nameAlg || SHA-256 (32 bytes);
            // should that change, hash the whole name rather than guess.
            _ => digest = Sha256::digest(&ek.name).into(),
        }
        Self(digest)
    }

    /// The digest's bytes.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// Compares in constant time.
    pub fn ct_eq(&self, other: &Self) -> bool {
        self.0.ct_eq(&other.0).into()
    }

    /// Parses 64 hex digits.
    pub fn from_hex(text: &str) -> Option<Self> {
        let mut digest = [0u8; 32];
        hex::decode_to_slice(text, &mut digest).ok()?;
        Some(Self(digest))
    }
}

impl std::fmt::Display for EkDigest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "sha256:{}", hex::encode(self.0))
    }
}

impl std::fmt::Debug for EkDigest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use rcgen::{
        BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer,
        KeyPair, KeyUsagePurpose, PublicKeyData, SignatureAlgorithm,
    };
    use time::{Duration, OffsetDateTime};

    /// The public half of an RSA-2048 EK: only certificates are checked
    /// here, so a made-up modulus (exponent 65537) stands in for a TPM's key.
    struct FakeEk {
        rsa_public_key: Vec<u8>,
        modulus: Vec<u8>,
    }

    impl FakeEk {
        fn new(seed: u8) -> Self {
            Self::with_exponent(seed, &[0x01, 0x00, 0x01])
        }

        fn with_exponent(seed: u8, exponent: &[u8]) -> Self {
            let mut modulus = vec![seed; 256];
            modulus[0] = 0xc5;
            modulus[255] |= 1;
            // RSAPublicKey ::= SEQUENCE { modulus INTEGER, publicExponent INTEGER }
            let mut body = vec![0x02, 0x82, 0x01, 0x01, 0x00];
            body.extend_from_slice(&modulus);
            body.extend_from_slice(&[0x02, u8::try_from(exponent.len()).unwrap()]);
            body.extend_from_slice(exponent);
            let len = u16::try_from(body.len()).unwrap().to_be_bytes();
            let mut rsa_public_key = vec![0x30, 0x82, len[0], len[1]];
            rsa_public_key.extend_from_slice(&body);
            Self {
                rsa_public_key,
                modulus,
            }
        }

        fn public(&self) -> Public {
            Public {
                name_alg: 0x000b,
                attributes: 0,
                symmetric: None,
                key: PublicKey::Rsa {
                    bits: 2048,
                    exponent: 0,
                    modulus: self.modulus.clone(),
                },
                name: Vec::new(),
            }
        }
    }

    impl PublicKeyData for FakeEk {
        fn der_bytes(&self) -> &[u8] {
            &self.rsa_public_key
        }

        fn algorithm(&self) -> &'static SignatureAlgorithm {
            &rcgen::PKCS_RSA_SHA256
        }
    }

    /// A CA certificate and its key.
    struct Ca {
        params: CertificateParams,
        key: KeyPair,
        pem: String,
    }

    const NAME: &str = "vTPM EK CA";

    /// A CA named `NAME`, valid now, cA=true and keyCertSign, then `shape`d.
    fn ca(shape: impl FnOnce(&mut CertificateParams)) -> Ca {
        ca_with_key(KeyPair::generate().unwrap(), shape)
    }

    fn ca_with_key(key: KeyPair, shape: impl FnOnce(&mut CertificateParams)) -> Ca {
        let params = ca_params(shape);
        let pem = params.self_signed(&key).unwrap().pem();
        Ca { params, key, pem }
    }

    /// What [`ca`] makes a CA certificate of.
    fn ca_params(shape: impl FnOnce(&mut CertificateParams)) -> CertificateParams {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.distinguished_name.push(DnType::CommonName, NAME);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let now = OffsetDateTime::now_utc();
        params.not_before = now - Duration::days(30);
        params.not_after = now + Duration::days(365);
        shape(&mut params);
        params
    }

    fn expired(params: &mut CertificateParams) {
        let now = OffsetDateTime::now_utc();
        params.not_before = now - Duration::days(400);
        params.not_after = now - Duration::days(1);
    }

    impl Ca {
        /// An EK certificate for `ek` signed by this CA's key.
        fn issue(&self, ek: &FakeEk) -> Vec<u8> {
            self.issue_with(ek, |_| {})
        }

        fn issue_with(&self, ek: &FakeEk, shape: impl FnOnce(&mut CertificateParams)) -> Vec<u8> {
            let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
            params.is_ca = IsCa::ExplicitNoCa;
            params.key_usages = vec![KeyUsagePurpose::KeyEncipherment];
            shape(&mut params);
            let issuer = Issuer::from_params(&self.params, &self.key);
            params.signed_by(ek, &issuer).unwrap().der().to_vec()
        }
    }

    fn trust(cas: &[&Ca]) -> EkTrust {
        let bundle: String = cas.iter().map(|c| c.pem.as_str()).collect();
        EkTrust::from_pem(bundle.as_bytes()).unwrap()
    }

    /// An RSA-2048 CA key that signs PKCS#1 v1.5 with SHA-256, as rcgen
    /// asks of `sha256WithRSAEncryption`.
    struct RsaCaKey {
        key: rsa::RsaPrivateKey,
        public: Vec<u8>,
    }

    impl PublicKeyData for RsaCaKey {
        fn der_bytes(&self) -> &[u8] {
            &self.public
        }

        fn algorithm(&self) -> &'static SignatureAlgorithm {
            &rcgen::PKCS_RSA_SHA256
        }
    }

    impl rcgen::SigningKey for RsaCaKey {
        fn sign(&self, msg: &[u8]) -> Result<Vec<u8>, rcgen::Error> {
            Ok(pkcs1_v15(
                &self.key,
                &SHA256_DIGEST_INFO,
                &Sha256::digest(msg),
            ))
        }
    }

    /// The DER DigestInfo before a SHA-256 digest (RFC 8017, 9.2).
    const SHA256_DIGEST_INFO: [u8; 19] = [
        0x30, 0x31, 0x30, 0x0d, 0x06, 0x09, 0x60, 0x86, 0x48, 0x01, 0x65, 0x03, 0x04, 0x02, 0x01,
        0x05, 0x00, 0x04, 0x20,
    ];
    /// The DER DigestInfo before a SHA-1 digest.
    const SHA1_DIGEST_INFO: [u8; 15] = [
        0x30, 0x21, 0x30, 0x09, 0x06, 0x05, 0x2b, 0x0e, 0x03, 0x02, 0x1a, 0x05, 0x00, 0x04, 0x14,
    ];

    /// An RSASSA-PKCS1-v1_5 signature by `key` of `digest` after its
    /// DigestInfo `prefix`.
    fn pkcs1_v15(key: &rsa::RsaPrivateKey, prefix: &[u8], digest: &[u8]) -> Vec<u8> {
        key.sign(
            rsa::Pkcs1v15Sign::new_unprefixed(),
            &[prefix, digest].concat(),
        )
        .unwrap()
    }

    /// `cert` (signed `sha256WithRSAEncryption` by `key`) as `key` would
    /// have signed it with SHA-1: both algorithm identifiers
    /// `sha1WithRSAEncryption` (an OID of the same length), the signature
    /// made again over the changed TBSCertificate.
    fn signed_again_with_sha1(cert: &[u8], key: &rsa::RsaPrivateKey) -> Vec<u8> {
        use sha1::Digest as _;
        const SHA256_WITH_RSA: [u8; 11] = [
            0x06, 0x09, 0x2a, 0x86, 0x48, 0x86, 0xf7, 0x0d, 0x01, 0x01, 0x0b,
        ];
        let mut der = cert.to_vec();
        let at: Vec<usize> = der
            .windows(SHA256_WITH_RSA.len())
            .enumerate()
            .filter(|(_, w)| *w == SHA256_WITH_RSA)
            .map(|(i, _)| i)
            .collect();
        assert_eq!(at.len(), 2, "the TBSCertificate's and the outer identifier");
        for i in at {
            der[i + SHA256_WITH_RSA.len() - 1] = 0x05; // 1.2.840.113549.1.1.5
        }
        let tbs = X509Certificate::from_der(&der)
            .unwrap()
            .1
            .tbs_certificate
            .as_ref()
            .to_vec();
        let signature = pkcs1_v15(key, &SHA1_DIGEST_INFO, &sha1::Sha1::digest(&tbs));
        // The signature ends the certificate; RSA-2048 keeps its length.
        let end = der.len();
        der[end - signature.len()..].copy_from_slice(&signature);
        der
    }

    /// `sha256WithRSAEncryption` (NULL parameters), as rcgen writes it.
    const SHA256_WITH_RSA_ID: [u8; 15] = [
        0x30, 0x0d, 0x06, 0x09, 0x2a, 0x86, 0x48, 0x86, 0xf7, 0x0d, 0x01, 0x01, 0x0b, 0x05, 0x00,
    ];
    /// RSASSA-PSS with no parameters: RFC 4055's defaults, SHA-1 among
    /// them. The same length as [`SHA256_WITH_RSA_ID`].
    const PSS_DEFAULTS_ID: [u8; 15] = [
        0x30, 0x0d, 0x06, 0x09, 0x2a, 0x86, 0x48, 0x86, 0xf7, 0x0d, 0x01, 0x01, 0x0a, 0x30, 0x00,
    ];
    /// RSASSA-PSS with SHA-256, MGF1 with SHA-256, a salt of 32 bytes.
    const PSS_SHA256_ID: [u8; 67] = [
        0x30, 0x41, 0x06, 0x09, 0x2a, 0x86, 0x48, 0x86, 0xf7, 0x0d, 0x01, 0x01, 0x0a, 0x30, 0x34,
        0xa0, 0x0f, 0x30, 0x0d, 0x06, 0x09, 0x60, 0x86, 0x48, 0x01, 0x65, 0x03, 0x04, 0x02, 0x01,
        0x05, 0x00, 0xa1, 0x1c, 0x30, 0x1a, 0x06, 0x09, 0x2a, 0x86, 0x48, 0x86, 0xf7, 0x0d, 0x01,
        0x01, 0x08, 0x30, 0x0d, 0x06, 0x09, 0x60, 0x86, 0x48, 0x01, 0x65, 0x03, 0x04, 0x02, 0x01,
        0x05, 0x00, 0xa2, 0x03, 0x02, 0x01, 0x20,
    ];

    /// `der` with each of the `count` occurrences of `from` replaced by `to`.
    fn replaced(der: &[u8], from: &[u8], to: &[u8], count: usize) -> Vec<u8> {
        let mut out = Vec::with_capacity(der.len());
        let (mut rest, mut found) = (der, 0);
        while let Some(at) = rest.windows(from.len()).position(|w| w == from) {
            out.extend_from_slice(&rest[..at]);
            out.extend_from_slice(to);
            rest = &rest[at + from.len()..];
            found += 1;
        }
        out.extend_from_slice(rest);
        assert_eq!(found, count);
        out
    }

    /// A DER element of `tag` around `content` (definite length).
    fn tlv(tag: u8, content: &[u8]) -> Vec<u8> {
        let len = u16::try_from(content.len()).unwrap().to_be_bytes();
        let mut out = match content.len() {
            0..0x80 => vec![tag, len[1]],
            0x80..0x100 => vec![tag, 0x81, len[1]],
            _ => vec![tag, 0x82, len[0], len[1]],
        };
        out.extend_from_slice(content);
        out
    }

    /// `cert` (signed `sha256WithRSAEncryption` by `key`) as `key` would
    /// have signed it with RSASSA-PSS over SHA-256: both identifiers
    /// [`PSS_SHA256_ID`], the signature made again.
    fn signed_again_with_pss_sha256(cert: &[u8], key: &rsa::RsaPrivateKey) -> Vec<u8> {
        use rsa::signature::{RandomizedSigner as _, SignatureEncoding as _};
        let (_, parsed) = X509Certificate::from_der(cert).unwrap();
        let tbs = parsed.tbs_certificate.as_ref();
        assert_eq!(
            tbs[..2],
            [0x30, 0x82],
            "a TBSCertificate of 256 bytes or more"
        );
        let tbs = tlv(
            0x30,
            &replaced(&tbs[4..], &SHA256_WITH_RSA_ID, &PSS_SHA256_ID, 1),
        );
        let signature = rsa::pss::SigningKey::<sha2::Sha256>::new(key.clone())
            .sign_with_rng(&mut rand::rngs::OsRng, &tbs)
            .to_vec();
        let bits = tlv(0x03, &[&[0][..], &signature].concat());
        tlv(0x30, &[tbs, PSS_SHA256_ID.to_vec(), bits].concat())
    }

    #[test]
    fn a_certificate_with_sha1_an_unlisted_algorithm_or_a_changed_identifier_is_refused() {
        use rsa::pkcs1::EncodeRsaPublicKey as _;
        let key = rsa::RsaPrivateKey::new(&mut rand::rngs::OsRng, 2048).unwrap();
        let public = key
            .to_public_key()
            .to_pkcs1_der()
            .unwrap()
            .as_bytes()
            .to_vec();
        let key = RsaCaKey { key, public };
        let ca_params = ca_params(|_| {});
        let pem = ca_params.self_signed(&key).unwrap().pem();
        let rsa_trust = EkTrust::from_pem(pem.as_bytes()).unwrap();
        let ek = FakeEk::new(1);
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![KeyUsagePurpose::KeyEncipherment];
        let issuer = Issuer::from_params(&ca_params, &key);
        let sha256 = params.signed_by(&ek, &issuer).unwrap().der().to_vec();
        // With SHA-256 this CA's certificate is taken.
        rsa_trust.verify(&sha256, &ek.public()).unwrap();

        let sha1 = signed_again_with_sha1(&sha256, &key.key);
        // The CA's key did sign it: only the algorithm is wrong.
        let ca_der = x509_parser::pem::parse_x509_pem(pem.as_bytes())
            .unwrap()
            .1
            .contents;
        let (_, ca_cert) = X509Certificate::from_der(&ca_der).unwrap();
        let (_, parsed) = X509Certificate::from_der(&sha1).unwrap();
        parsed.verify_signature(Some(ca_cert.public_key())).unwrap();
        let refused = rsa_trust.verify(&sha1, &ek.public()).unwrap_err();
        assert!(
            matches!(&refused, EkError::SignatureAlgorithm(name) if name.contains("SHA-1")),
            "{refused}"
        );

        // Only the unsigned identifier changed: it must name what the
        // signed part names.
        let mut outer_only = sha256.clone();
        let end = outer_only.len();
        let outer = end - 256 - 5 - 15 + 12;
        assert_eq!(
            outer_only[outer], 0x0b,
            "sha256WithRSAEncryption's last byte"
        );
        outer_only[outer] = 0x0c; // sha384WithRSAEncryption
        let refused = rsa_trust.verify(&outer_only, &ek.public()).unwrap_err();
        assert!(
            matches!(
                &refused,
                EkError::AlgorithmMismatch { outer, signed, params: "" }
                    if outer == "1.2.840.113549.1.1.12" && signed == "1.2.840.113549.1.1.11"
            ),
            "{refused}"
        );
        // Only the unsigned parameters changed: NULL became an empty
        // OCTET STRING, of the same length.
        let mut params_only = sha256.clone();
        assert_eq!(params_only[outer + 1..outer + 3], [0x05, 0x00], "NULL");
        params_only[outer + 1] = 0x04;
        let refused = rsa_trust.verify(&params_only, &ek.public()).unwrap_err();
        assert!(
            matches!(
                &refused,
                EkError::AlgorithmMismatch { outer, signed, params: " (with other parameters)" }
                    if outer == signed
            ),
            "{refused}"
        );

        // RSASSA-PSS over SHA-256 is taken; without parameters (SHA-1 by
        // RFC 4055) it is refused before any key is tried.
        let pss = signed_again_with_pss_sha256(&sha256, &key.key);
        rsa_trust.verify(&pss, &ek.public()).unwrap();
        let pss_sha1 = replaced(&sha256, &SHA256_WITH_RSA_ID, &PSS_DEFAULTS_ID, 2);
        let refused = rsa_trust.verify(&pss_sha1, &ek.public()).unwrap_err();
        assert!(
            matches!(&refused, EkError::SignatureAlgorithm(name)
                if name == "RSASSA-PSS with the hash 1.3.14.3.2.26"),
            "{refused}"
        );

        // An Ed25519 CA: a sound signature, but not one an EK CA makes.
        let ed_ca = ca_with_key(KeyPair::generate_for(&rcgen::PKCS_ED25519).unwrap(), |_| {});
        let ed = ed_ca.issue(&ek);
        let refused = trust(&[&ed_ca]).verify(&ed, &ek.public()).unwrap_err();
        assert!(
            matches!(&refused, EkError::SignatureAlgorithm(name) if name.contains("1.3.101.112")),
            "{refused}"
        );
    }

    #[test]
    fn a_certificate_from_a_valid_ca_is_accepted() {
        let ek = FakeEk::new(1);
        let ca = ca(|_| {});
        let cert = ca.issue(&ek);
        trust(&[&ca]).verify(&cert, &ek.public()).unwrap();
        // ... for its own key only.
        assert_eq!(
            trust(&[&ca]).verify(&cert, &FakeEk::new(2).public()),
            Err(EkError::KeyMismatch)
        );
        // ... padded as a TPM's index may pad it, as one entry of the
        // accepted set: each length of padding is not checked afresh.
        let trust = trust(&[&ca]);
        for padding in 0..5 {
            let padded = [cert.as_slice(), &vec![0xff; padding]].concat();
            assert_eq!(certificate_in(&padded), cert.as_slice());
            trust.verify(&padded, &ek.public()).unwrap();
        }
        assert_eq!(trust.accepted.0.lock().unwrap().order.len(), 1);
    }

    #[test]
    fn a_certificate_that_could_not_be_an_eks_is_refused() {
        let ek = FakeEk::new(1);
        let ca = ca(|_| {});
        let trust = trust(&[&ca]);
        let as_ca = ca.issue_with(&ek, |p| {
            p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
            p.key_usages = vec![
                KeyUsagePurpose::KeyEncipherment,
                KeyUsagePurpose::KeyCertSign,
            ];
        });
        assert_eq!(
            trust.verify(&as_ca, &ek.public()),
            Err(EkError::NotEkCertificate("it is a CA certificate"))
        );
        let signing_only = ca.issue_with(&ek, |p| {
            p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        });
        assert_eq!(
            trust.verify(&signing_only, &ek.public()),
            Err(EkError::NotEkCertificate("keyUsage lacks keyEncipherment"))
        );
        // The template's exponent is 65537; a certificate of the same
        // modulus with another exponent certifies another key.
        let other_exponent = FakeEk::with_exponent(1, &[0x03]);
        let cert = ca.issue(&other_exponent);
        assert_eq!(
            trust.verify(&cert, &other_exponent.public()),
            Err(EkError::KeyMismatch)
        );
        // Without a key usage extension the certificate says nothing
        // against it.
        let unrestricted = ca.issue_with(&ek, |p| p.key_usages = Vec::new());
        trust.verify(&unrestricted, &ek.public()).unwrap();
        // Attacker's move: a TLS certificate of a software RSA key from a
        // CA the EK trust names, which allows key encipherment as RSA TLS
        // certificates do.
        for purpose in [
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
            ExtendedKeyUsagePurpose::Any,
            ExtendedKeyUsagePurpose::Other(vec![1, 3, 6, 1, 4, 1, 99999, 1]),
        ] {
            let tls = ca.issue_with(&ek, |p| {
                p.key_usages = vec![
                    KeyUsagePurpose::DigitalSignature,
                    KeyUsagePurpose::KeyEncipherment,
                ];
                p.extended_key_usages = vec![
                    ExtendedKeyUsagePurpose::Other(TCG_KP_EK_CERTIFICATE.to_vec()),
                    purpose.clone(),
                ];
            });
            assert_eq!(
                trust.verify(&tls, &ek.public()),
                Err(EkError::NotEkCertificate(
                    "extendedKeyUsage names a purpose other than tcg-kp-EKCertificate"
                )),
                "{purpose:?}"
            );
        }
        // tcg-kp-EKCertificate alone, as swtpm's and TPM vendors' EK
        // certificates name it.
        let marked = ca.issue_with(&ek, |p| {
            p.extended_key_usages = vec![ExtendedKeyUsagePurpose::Other(
                TCG_KP_EK_CERTIFICATE.to_vec(),
            )];
        });
        trust.verify(&marked, &ek.public()).unwrap();
    }

    #[test]
    fn only_the_rsa_2048_ek_template_is_taken() {
        let mut template = EK_TEMPLATE_PREFIX.to_vec();
        template.extend_from_slice(&[0xc5; 256]);
        check_template(&template).unwrap();
        let parsed = Public::parse(&template).unwrap();
        assert!(matches!(
            parsed.key,
            PublicKey::Rsa {
                bits: 2048,
                exponent: 0,
                ..
            }
        ));
        for (at, field) in [
            (1, "type or name algorithm"),
            (7, "object attributes"),
            (20, "authorization policy"),
            (45, "symmetric algorithm or scheme"),
            (55, "key size or exponent"),
        ] {
            let mut other = template.clone();
            other[at] ^= 0x04;
            assert_eq!(check_template(&other), Err(EkError::Template(field)));
        }
        let mut longer = template.clone();
        longer.push(0);
        assert_eq!(
            check_template(&longer),
            Err(EkError::Template("modulus size"))
        );
        assert_eq!(
            check_template(&template[..100]),
            Err(EkError::Template("modulus size"))
        );
        assert_eq!(
            check_template(&template[..20]),
            Err(EkError::Template("shorter than the template"))
        );
    }

    #[test]
    fn an_accepted_certificate_is_remembered_for_its_own_key_and_trust_only() {
        let ek = FakeEk::new(1);
        let issuer = ca(|_| {});
        let cert = issuer.issue(&ek);
        let trusted = trust(&[&issuer]);
        trusted.verify(&cert, &ek.public()).unwrap();
        assert_eq!(trusted.accepted.0.lock().unwrap().windows.len(), 1);
        // Again, from memory (and from a clone, which shares it).
        trusted.verify(&cert, &ek.public()).unwrap();
        trusted.clone().verify(&cert, &ek.public()).unwrap();
        // Another key with the accepted certificate is checked in full.
        assert_eq!(
            trusted.verify(&cert, &FakeEk::new(2).public()),
            Err(EkError::KeyMismatch)
        );
        // A trust of another CA does not share the memory.
        let other = ca(|_| {});
        assert_eq!(
            trust(&[&other]).verify(&cert, &ek.public()),
            Err(EkError::Signature)
        );
        // Refusals are not remembered.
        let lapsed = issuer.issue_with(&ek, expired);
        assert_eq!(
            trusted.verify(&lapsed, &ek.public()),
            Err(EkError::Validity)
        );
        assert_eq!(trusted.accepted.0.lock().unwrap().windows.len(), 1);
    }

    #[test]
    fn of_two_cas_with_one_name_the_one_that_signed_is_used() {
        let ek = FakeEk::new(1);
        let first = ca(|_| {});
        let second = ca(|_| {});
        let cert = second.issue(&ek);
        trust(&[&first, &second])
            .verify(&cert, &ek.public())
            .unwrap();
        trust(&[&second, &first])
            .verify(&cert, &ek.public())
            .unwrap();
        // The namesake alone does not verify it.
        assert_eq!(
            trust(&[&first]).verify(&cert, &ek.public()),
            Err(EkError::Signature)
        );
    }

    #[test]
    fn an_expired_ca_is_refused_even_though_it_signed() {
        let ek = FakeEk::new(1);
        let old = ca(expired);
        let cert = old.issue(&ek);
        let refused = |cas: &[&Ca]| trust(cas).verify(&cert, &ek.public());
        let validity = Err(EkError::CaValidity(format!("CN={NAME}")));
        assert_eq!(refused(&[&old]), validity);
        // A valid namesake with another key does not save it, and the error
        // names the expired CA rather than the namesake's signature.
        let other = ca(|_| {});
        assert_eq!(refused(&[&other, &old]), validity);
        assert_eq!(refused(&[&old, &other]), validity);
        // A CA not yet valid is refused the same way.
        let future = ca(|p| {
            let now = OffsetDateTime::now_utc();
            p.not_before = now + Duration::days(1);
            p.not_after = now + Duration::days(400);
        });
        let cert = future.issue(&ek);
        assert_eq!(
            trust(&[&future]).verify(&cert, &ek.public()),
            Err(EkError::CaValidity(format!("CN={NAME}")))
        );
    }

    #[test]
    fn a_renewed_ca_with_the_same_key_keeps_its_certificates_trusted() {
        let ek = FakeEk::new(1);
        let key = KeyPair::generate().unwrap();
        let renewed = ca_with_key(KeyPair::from_pem(&key.serialize_pem()).unwrap(), |_| {});
        let old = ca_with_key(key, expired);
        let cert = old.issue(&ek);
        trust(&[&old, &renewed])
            .verify(&cert, &ek.public())
            .unwrap();
    }

    #[test]
    fn a_certificate_that_is_not_a_ca_is_no_anchor() {
        let ek = FakeEk::new(1);
        type Shape = fn(&mut CertificateParams);
        let cases: [(&str, Shape); 2] = [
            ("cA=false", |p| p.is_ca = IsCa::ExplicitNoCa),
            ("no keyCertSign", |p| {
                p.is_ca = IsCa::NoCa;
                p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
            }),
        ];
        for (case, shape) in cases {
            let leaf = ca(shape);
            let cert = leaf.issue(&ek);
            let err = trust(&[&leaf]).verify(&cert, &ek.public()).unwrap_err();
            assert!(
                matches!(&err, EkError::NotCa { subject, .. } if subject == &format!("CN={NAME}")),
                "{case}: {err:?}"
            );
            // A real CA of the same name that did not sign does not help.
            let other = ca(|_| {});
            let err = trust(&[&other, &leaf])
                .verify(&cert, &ek.public())
                .unwrap_err();
            assert!(matches!(err, EkError::NotCa { .. }), "{case}: {err:?}");
        }
        // Without either extension (an old v1-style CA) nothing says it is
        // not a CA: accepted.
        let bare = ca(|p| {
            p.is_ca = IsCa::NoCa;
            p.key_usages = Vec::new();
        });
        let cert = bare.issue(&ek);
        trust(&[&bare]).verify(&cert, &ek.public()).unwrap();
    }

    /// A bundle is measured as written; one with a block the node would
    /// skip (a key, a CRL, a damaged certificate, bytes after one) would
    /// trust less than an operator reading it believes. Refused whole; text
    /// around the blocks, as `openssl x509 -text` writes it, is not a block.
    #[test]
    fn a_bundle_with_a_block_that_is_no_whole_certificate_is_refused() {
        let good = ca(|_| {});
        let with_text = format!(
            "subject=CN = {NAME}\nissuer=CN = {NAME}\n{}\n# end\n",
            good.pem
        );
        EkTrust::from_pem(with_text.as_bytes()).unwrap();
        let block = |label: &str, der: &[u8]| {
            use base64::Engine as _;
            let body = base64::engine::general_purpose::STANDARD.encode(der);
            format!("-----BEGIN {label}-----\n{body}\n-----END {label}-----\n")
        };
        let der = x509_parser::pem::Pem::iter_from_buffer(good.pem.as_bytes())
            .next()
            .unwrap()
            .unwrap()
            .contents;
        let mut trailing = der.clone();
        trailing.extend_from_slice(&[0x05, 0x00]);
        for (extra, expected) in [
            (block("PRIVATE KEY", &der), "not a CERTIFICATE"),
            (
                block("CERTIFICATE", &der[..der.len() - 10]),
                "does not parse",
            ),
            (block("CERTIFICATE", &trailing), "2 bytes after"),
            (
                "-----BEGIN CERTIFICATE-----\n!!!\n-----END CERTIFICATE-----\n".into(),
                "not a PEM block",
            ),
        ] {
            let bundle = format!("{}{extra}", good.pem);
            match EkTrust::from_pem(bundle.as_bytes()) {
                Err(EkError::Bundle { index: 1, reason }) => {
                    assert!(reason.contains(expected), "{reason}")
                }
                other => panic!("{extra}: {:?}", other.map(|_| ())),
            }
        }
    }

    /// A refusal for the time alone is one where every other check held
    /// ([`EkError::rests_on_the_clock`]): an expired certificate of
    /// another key is refused for the key, and an expired CA that is no
    /// CA for what it is.
    #[test]
    fn a_refusal_for_the_time_comes_last_and_rests_on_the_clock() {
        let ek = FakeEk::new(1);
        let issuing = ca(|_| {});
        let lapsed = issuing.issue_with(&ek, expired);
        let refused = trust(&[&issuing])
            .verify(&lapsed, &ek.public())
            .unwrap_err();
        assert_eq!(refused, EkError::Validity);
        assert!(refused.rests_on_the_clock());
        let moved = trust(&[&issuing])
            .verify(&lapsed, &FakeEk::new(2).public())
            .unwrap_err();
        assert_eq!(moved, EkError::KeyMismatch);
        assert!(!moved.rests_on_the_clock());
        let old = ca(expired);
        let refused = trust(&[&old])
            .verify(&old.issue(&ek), &ek.public())
            .unwrap_err();
        assert!(refused.rests_on_the_clock(), "{refused:?}");
        let not_a_ca = ca(|p| {
            expired(p);
            p.is_ca = IsCa::ExplicitNoCa;
        });
        let refused = trust(&[&not_a_ca])
            .verify(&not_a_ca.issue(&ek), &ek.public())
            .unwrap_err();
        assert!(matches!(refused, EkError::NotCa { .. }), "{refused:?}");
        assert!(!refused.rests_on_the_clock());
        let stranger = trust(&[&ca(|_| {})])
            .verify(&lapsed, &ek.public())
            .unwrap_err();
        assert_eq!(stranger, EkError::Signature);
        assert!(!stranger.rests_on_the_clock());
    }

    /// A CA named `name`, valid now, cA=true and keyCertSign, then
    /// `shape`d, whose certificate `root` signed.
    fn intermediate(root: &Ca, name: &str, shape: impl FnOnce(&mut CertificateParams)) -> Ca {
        let key = KeyPair::generate().unwrap();
        let params = ca_params(|p| {
            p.distinguished_name = rcgen::DistinguishedName::new();
            p.distinguished_name.push(DnType::CommonName, name);
            shape(p);
        });
        let issuer = Issuer::from_params(&root.params, &root.key);
        let pem = params.signed_by(&key, &issuer).unwrap().pem();
        Ca { params, key, pem }
    }

    impl Ca {
        /// This CA's own certificate, DER.
        fn der(&self) -> Vec<u8> {
            x509_parser::pem::parse_x509_pem(self.pem.as_bytes())
                .unwrap()
                .1
                .contents
        }
    }

    /// EK certificates are public: a member may present one an expired CA
    /// issued for another TPM. Refused for the key, as from a valid CA.
    #[test]
    fn an_expired_ca_does_not_hide_that_its_certificate_is_for_another_key() {
        let ek = FakeEk::new(1);
        let old = ca(expired);
        let refused = trust(&[&old])
            .verify(&old.issue(&ek), &FakeEk::new(2).public())
            .unwrap_err();
        assert_eq!(refused, EkError::KeyMismatch);
        assert!(!refused.rests_on_the_clock());
        // Nor that the certificate could not be an EK's.
        let tls = old.issue_with(&ek, |p| {
            p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        });
        let refused = trust(&[&old]).verify(&tls, &ek.public()).unwrap_err();
        assert!(
            matches!(refused, EkError::NotEkCertificate(_)),
            "{refused:?}"
        );
        assert!(!refused.rests_on_the_clock());
        // A CA not yet valid, and one among valid namesakes, the same way.
        let future = ca(|p| {
            let now = OffsetDateTime::now_utc();
            p.not_before = now + Duration::days(1);
            p.not_after = now + Duration::days(400);
        });
        assert_eq!(
            trust(&[&future]).verify(&future.issue(&ek), &FakeEk::new(2).public()),
            Err(EkError::KeyMismatch)
        );
        let other = ca(|_| {});
        assert_eq!(
            trust(&[&other, &old]).verify(&old.issue(&ek), &FakeEk::new(2).public()),
            Err(EkError::KeyMismatch)
        );
    }

    /// A self-signed root verifies with its own key and is a CA: presented
    /// as an EK certificate, an expired one is refused for being a CA, not
    /// for its dates.
    #[test]
    fn an_expired_root_presented_as_the_ek_certificate_is_refused_for_what_it_is() {
        let ek = FakeEk::new(1);
        let old = ca(expired);
        let other = ca(|_| {});
        for cas in [&[&old][..], &[&other, &old], &[&old, &other]] {
            let refused = trust(cas).verify(&old.der(), &ek.public()).unwrap_err();
            assert_eq!(refused, EkError::NotEkCertificate("it is a CA certificate"));
            assert!(!refused.rests_on_the_clock());
        }
    }

    /// An intermediate issued by an expired root, itself expired: presented
    /// as an EK certificate it is refused for being a CA, and an EK
    /// certificate it issued for another TPM for the key.
    #[test]
    fn an_expired_intermediate_presented_as_the_ek_certificate_is_refused_for_what_it_is() {
        let ek = FakeEk::new(1);
        let root = ca(expired);
        let middle = intermediate(&root, "vTPM EK intermediate CA", expired);
        let trust = trust(&[&root, &middle]);
        let refused = trust.verify(&middle.der(), &ek.public()).unwrap_err();
        assert_eq!(refused, EkError::NotEkCertificate("it is a CA certificate"));
        assert!(!refused.rests_on_the_clock());
        let refused = trust
            .verify(&middle.issue(&ek), &FakeEk::new(2).public())
            .unwrap_err();
        assert_eq!(refused, EkError::KeyMismatch);
        assert!(!refused.rests_on_the_clock());
    }

    /// When everything but the CA's dates holds, the refusal is the CA's
    /// validity, and it rests on the clock.
    #[test]
    fn an_expired_ca_of_a_sound_certificate_for_the_key_is_refused_for_the_time() {
        let ek = FakeEk::new(1);
        let old = ca(expired);
        let refused = trust(&[&old])
            .verify(&old.issue(&ek), &ek.public())
            .unwrap_err();
        assert_eq!(refused, EkError::CaValidity(format!("CN={NAME}")));
        assert!(refused.rests_on_the_clock());
        // The certificate expired as well: still the time alone.
        let refused = trust(&[&old])
            .verify(&old.issue_with(&ek, expired), &ek.public())
            .unwrap_err();
        assert!(refused.rests_on_the_clock(), "{refused:?}");
        // Through an expired intermediate.
        let root = ca(|_| {});
        let middle = intermediate(&root, "vTPM EK intermediate CA", expired);
        let refused = trust(&[&root, &middle])
            .verify(&middle.issue(&ek), &ek.public())
            .unwrap_err();
        assert_eq!(
            refused,
            EkError::CaValidity("CN=vTPM EK intermediate CA".to_owned())
        );
        assert!(refused.rests_on_the_clock());
    }

    #[test]
    fn no_ca_of_that_name_or_an_expired_certificate_is_refused() {
        let ek = FakeEk::new(1);
        let issuing = ca(|_| {});
        let stranger = ca(|p| {
            p.distinguished_name = rcgen::DistinguishedName::new();
            p.distinguished_name.push(DnType::CommonName, "another CA");
        });
        let cert = issuing.issue(&ek);
        let err = trust(&[&stranger]).verify(&cert, &ek.public()).unwrap_err();
        assert!(matches!(err, EkError::UntrustedIssuer(_)), "{err:?}");

        let old_cert = issuing.issue_with(&ek, expired);
        assert_eq!(
            trust(&[&issuing]).verify(&old_cert, &ek.public()),
            Err(EkError::Validity)
        );
        // Not yet valid either (a CA's key can sign ahead).
        let early_cert = issuing.issue_with(&ek, |p| {
            let now = OffsetDateTime::now_utc();
            p.not_before = now + Duration::days(1);
            p.not_after = now + Duration::days(30);
        });
        assert_eq!(
            trust(&[&issuing]).verify(&early_cert, &ek.public()),
            Err(EkError::Validity)
        );
        assert_eq!(
            trust(&[&issuing]).verify(&[], &ek.public()),
            Err(EkError::NoCertificate)
        );
    }

    #[test]
    fn the_ek_digest_is_the_sha256_of_the_marshalled_public_area() {
        // A TPMT_PUBLIC: ECC, SHA-256 name, attributes, empty policy, no
        // symmetric, no scheme, P-256, no KDF, 1-byte coordinates.
        let bytes = [
            0x00, 0x23, 0x00, 0x0b, 0x00, 0x04, 0x00, 0x72, 0x00, 0x00, 0x00, 0x10, 0x00, 0x10,
            0x00, 0x03, 0x00, 0x10, 0x00, 0x01, 0x05, 0x00, 0x01, 0x06,
        ];
        let public = Public::parse(&bytes).unwrap();
        let digest = EkDigest::of_public(&public);
        assert_eq!(digest, EkDigest::of_marshalled(&bytes));
        assert_eq!(*digest.as_bytes(), <[u8; 32]>::from(Sha256::digest(bytes)));
        assert!(digest.ct_eq(&EkDigest::of_marshalled(&bytes)));
        assert!(!digest.ct_eq(&EkDigest::of_marshalled(&[1])));
        assert!(digest.to_string().starts_with("sha256:"));
    }
}
