//! The TPM half of sealed secrets: opening what a verifier sealed to this
//! TPM ([`open`]) and answering a key residency challenge
//! ([`answer_residency`]), both with TPM2_ActivateCredential. The pure half,
//! MakeCredential in Rust, is [`keel_verifier::credential`].

use keel_proto::attestation::{ResidencyChallenge, SealedSecret};
use keel_verifier::credential::{
    open_with_credential, CredentialError, CREDENTIAL_LEN, MAX_CHALLENGE_BYTES,
};
use keel_verifier::tpm_wire::Public;
use prost::Message;
use zeroize::Zeroizing;

/// Answers a [`residency_challenge`](keel_verifier::credential::residency_challenge)
/// with this TPM: the recovered secret.
pub fn answer_residency(
    tpm: &mut crate::tpm::Tpm,
    challenge: &[u8],
) -> Result<Zeroizing<[u8; CREDENTIAL_LEN]>, CredentialError> {
    if challenge.len() > MAX_CHALLENGE_BYTES {
        return Err(CredentialError::Open);
    }
    let challenge = ResidencyChallenge::decode(challenge).map_err(|_| CredentialError::Open)?;
    let credential = tpm
        .activate_credential(&challenge.credential_blob, &challenge.encrypted_seed)
        .map_err(|e| {
            tracing::warn!(error = %keel_atls::ErrorChain(&e), "answering a key residency challenge failed");
            CredentialError::Open
        })?;
    let mut out = Zeroizing::new([0u8; CREDENTIAL_LEN]);
    if credential.len() != CREDENTIAL_LEN {
        return Err(CredentialError::Open);
    }
    out.copy_from_slice(&credential);
    Ok(out)
}

/// Why [`open_on`] failed.
#[derive(Debug)]
pub enum OpenOnError {
    /// The TPM could not be used (its lock poisoned, the task lost).
    Tpm,
    /// The secret did not open.
    Sealed(CredentialError),
}

/// [`open`] on the node's shared TPM, on a blocking thread; also returns
/// the digest of the TPM's EK (the one the secret was sealed to).
pub async fn open_on(
    tpm: &crate::measured::SharedTpm,
    sealed: SealedSecret,
) -> Result<(Zeroizing<Vec<u8>>, keel_verifier::ek::EkDigest), OpenOnError> {
    let tpm = tpm.clone();
    tokio::task::spawn_blocking(move || {
        let mut guard = tpm.lock().map_err(|_| OpenOnError::Tpm)?;
        let opened = open(guard.tpm(), &sealed).map_err(OpenOnError::Sealed)?;
        let own_ek = super::own_ek_digest(guard.tpm()).map_err(|_| OpenOnError::Tpm)?;
        Ok((opened, own_ek))
    })
    .await
    .map_err(|_| OpenOnError::Tpm)?
}

/// Opens a secret sealed to this TPM and its attestation key.
pub fn open(
    tpm: &mut crate::tpm::Tpm,
    sealed: &SealedSecret,
) -> Result<Zeroizing<Vec<u8>>, CredentialError> {
    let ak = tpm.attestation_key().map_err(|_| CredentialError::Open)?;
    let ak_name = Public::parse(&ak).map_err(|_| CredentialError::Open)?.name;
    let credential = tpm
        .activate_credential(&sealed.credential_blob, &sealed.encrypted_seed)
        .map_err(|e| {
            tracing::warn!(error = %e, "credential activation failed");
            CredentialError::Open
        })?;
    open_with_credential(sealed, &credential, &ak_name)
}
