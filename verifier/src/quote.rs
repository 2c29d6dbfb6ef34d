//! Quote verification without a TPM: the attestation key's properties, the
//! ECDSA signature, the qualifying data and the PCR digest.

use std::collections::BTreeMap;

use sha2::{Digest as _, Sha256};

use crate::measurement::Digest32;
use crate::tpm_wire::{alg, attr, EcdsaSignature, Public, PublicKey, QuoteInfo, WireError};

/// Domain separator of the qualifying data.
const QUALIFYING_DATA_CONTEXT: &[u8] = b"keel-quote-v2";

/// Why a quote does not verify. Each check has its own variant.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum QuoteError {
    /// A structure does not parse.
    #[error(transparent)]
    Malformed(#[from] WireError),
    /// The AK lacks a required attribute or has a forbidden one.
    #[error("attestation key attributes: {0}")]
    AkAttributes(&'static str),
    /// The AK is not a P-256 ECDSA-SHA256 key.
    #[error("attestation key is not an ECC P-256 ECDSA-SHA256 signing key")]
    AkKeyType,
    /// The signature does not verify with the AK.
    #[error("quote signature does not verify with the attestation key")]
    Signature,
    /// The quote was made for another batch: the root recomputed from
    /// this nonce, the user data and the inclusion path is not the one it
    /// carries.
    #[error(
        "quote qualifying data does not match this nonce, user data and batch path \
         (the nonce is not in the quoted batch)"
    )]
    QualifyingData,
    /// The quoted PCR set differs from the reported values.
    #[error("quote covers PCRs {quoted:?} but values are given for {reported:?}")]
    PcrSelection {
        /// PCRs in the quote.
        quoted: Vec<u32>,
        /// PCRs with reported values.
        reported: Vec<u32>,
    },
    /// The reported PCR values do not hash to the quoted digest.
    #[error("reported PCR values do not match the quoted PCR digest")]
    PcrDigest,
}

/// The qualifying data of a quote over the batch whose tree has `root`
/// ([`crate::batch`]): `SHA-256("keel-quote-v2" || root)`.
pub fn qualifying_data(root: &Digest32) -> Digest32 {
    let mut h = Sha256::new();
    h.update(QUALIFYING_DATA_CONTEXT);
    h.update(root);
    h.finalize().into()
}

/// The TPM's PCR digest: SHA-256 over the values in ascending index order.
pub fn pcr_digest(values: &BTreeMap<u32, Digest32>) -> Digest32 {
    let mut h = Sha256::new();
    for v in values.values() {
        h.update(v);
    }
    h.finalize().into()
}

/// Checks that `ak` is fit to attest: a TPM-resident, restricted signing key.
pub fn check_ak(ak: &Public) -> Result<(), QuoteError> {
    let required = [
        (attr::FIXED_TPM, "not fixedTPM"),
        (attr::FIXED_PARENT, "not fixedParent"),
        (attr::SENSITIVE_DATA_ORIGIN, "not sensitiveDataOrigin"),
        (attr::RESTRICTED, "not restricted"),
        (attr::SIGN, "not a signing key"),
    ];
    for (bit, what) in required {
        if ak.attributes & bit == 0 {
            return Err(QuoteError::AkAttributes(what));
        }
    }
    if ak.attributes & attr::DECRYPT != 0 {
        return Err(QuoteError::AkAttributes("is also a decryption key"));
    }
    match &ak.key {
        PublicKey::Ecc {
            scheme: Some((alg::ECDSA, alg::SHA256)),
            ..
        } => Ok(()),
        _ => Err(QuoteError::AkKeyType),
    }
}

/// Verifies a quote made by `ak` over `values` for `qualifying`.
/// Returns the parsed quote.
pub fn verify_quote(
    ak: &Public,
    attest: &[u8],
    signature: &[u8],
    qualifying: &Digest32,
    values: &BTreeMap<u32, Digest32>,
) -> Result<QuoteInfo, QuoteError> {
    check_ak(ak)?;
    // Parsing the key checks that the point is on the curve.
    let key = ak.p256_key().map_err(|_| QuoteError::AkKeyType)?;
    let sig = EcdsaSignature::parse(signature)?;
    let mut fixed = [0u8; 64];
    fixed[..32].copy_from_slice(&sig.r);
    fixed[32..].copy_from_slice(&sig.s);
    // ECDSA over SHA-256(attest), as the TPM signs it.
    ring::signature::UnparsedPublicKey::new(
        &ring::signature::ECDSA_P256_SHA256_FIXED,
        key.to_encoded_point(false).as_bytes(),
    )
    .verify(attest, &fixed)
    .map_err(|_| QuoteError::Signature)?;
    let info = QuoteInfo::parse(attest)?;
    if info.extra_data.as_slice() != qualifying.as_slice() {
        return Err(QuoteError::QualifyingData);
    }
    let reported: Vec<u32> = values.keys().copied().collect();
    if info.pcrs != reported {
        return Err(QuoteError::PcrSelection {
            quoted: info.pcrs.clone(),
            reported,
        });
    }
    if info.pcr_digest.as_slice() != pcr_digest(values).as_slice() {
        return Err(QuoteError::PcrDigest);
    }
    Ok(info)
}
