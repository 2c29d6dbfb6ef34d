//! Attestation on the node: the document it presents, issued from the TPM
//! (with the CPU's evidence for the hardware variants, [`cpu`]),
//! the TPM half of sealed secrets, and the verifier's reloadable policy.
//! How a document is checked is [`keel_verifier`]'s.

pub mod cpu;
pub mod credential;
pub mod issuer;
pub mod policy;

use keel_verifier::ek::EkDigest;

use crate::tpm::{Tpm, TpmError};

/// The digest of this node's own endorsement key: what a disk key is bound
/// to ([`keel_verifier::keys::disk_key_id`]).
pub fn own_ek_digest(tpm: &mut Tpm) -> Result<EkDigest, TpmError> {
    Ok(EkDigest::of_marshalled(&tpm.ek_public()?))
}

/// [`own_ek_digest`] of the node's shared TPM, its lock taken even if a
/// panicked task poisoned it (as [`crate::measured::shutdown`] does):
/// reading the EK changes nothing.
pub fn shared_own_ek_digest(tpm: &crate::measured::SharedTpm) -> Result<EkDigest, TpmError> {
    let mut guard = tpm
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    own_ek_digest(guard.tpm())
}
