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

/// Why opening a secret sealed to this TPM failed.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// The TPM could not be used: its lock poisoned, the task lost, or a
    /// command failed for reasons of the TPM's own (a lost connection, a
    /// busy or failing device). The secret may be fine: asking again may
    /// succeed.
    #[error("the TPM is unavailable")]
    Tpm,
    /// The secret did not open: it is not sealed to this TPM's EK and
    /// attestation key, or it was changed.
    #[error(transparent)]
    Sealed(CredentialError),
}

/// [`open`] on the node's shared TPM, on a blocking thread; also returns
/// the digest of the TPM's EK (the one the secret was sealed to).
pub async fn open_on(
    tpm: &crate::measured::SharedTpm,
    sealed: SealedSecret,
) -> Result<(Zeroizing<Vec<u8>>, keel_verifier::ek::EkDigest), OpenError> {
    let tpm = tpm.clone();
    tokio::task::spawn_blocking(move || {
        let mut guard = tpm.lock().map_err(|_| OpenError::Tpm)?;
        let opened = open(guard.tpm(), &sealed)?;
        let own_ek = super::own_ek_digest(guard.tpm()).map_err(|_| OpenError::Tpm)?;
        Ok((opened, own_ek))
    })
    .await
    .map_err(|_| OpenError::Tpm)?
}

/// Opens a secret sealed to this TPM and its attestation key.
pub fn open(
    tpm: &mut crate::tpm::Tpm,
    sealed: &SealedSecret,
) -> Result<Zeroizing<Vec<u8>>, OpenError> {
    let ak = tpm.attestation_key().map_err(|e| {
        tracing::warn!(error = %keel_atls::ErrorChain(&e), "the attestation key is unavailable");
        OpenError::Tpm
    })?;
    let ak_name = Public::parse(&ak).map_err(|_| OpenError::Tpm)?.name;
    let credential = tpm
        .activate_credential(&sealed.credential_blob, &sealed.encrypted_seed)
        .map_err(|e| {
            tracing::warn!(error = %keel_atls::ErrorChain(&e), "credential activation failed");
            if refused_by_the_tpm(&e) {
                OpenError::Sealed(CredentialError::Open)
            } else {
                OpenError::Tpm
            }
        })?;
    open_with_credential(sealed, &credential, &ak_name).map_err(OpenError::Sealed)
}

/// Whether ActivateCredential failed on what it was given: blobs too large
/// for the command, or an error the TPM itself answered (a response code of
/// the TPM's layer: a format-one code about a parameter, handle or session,
/// or a format-zero error such as the TPM_RC_FAILURE swtpm answers for a
/// seed not encrypted to its EK). A warning (retry, lockout, memory) or an
/// error of the transport or the software stack is the TPM's own failure.
fn refused_by_the_tpm(e: &crate::tpm::TpmError) -> bool {
    match e {
        crate::tpm::TpmError::ActivateCredential(tss_esapi::Error::WrapperError(kind)) => {
            *kind == tss_esapi::WrapperErrorKind::WrongParamSize
        }
        crate::tpm::TpmError::ActivateCredential(tss_esapi::Error::Tss2Error(rc)) => {
            answered_by_the_tpm(*rc)
        }
        _ => false,
    }
}

/// Whether `rc` is an error of the TPM's own layer (layer 0), neither a
/// warning nor vendor-specific.
fn answered_by_the_tpm(rc: tss_esapi::constants::response_code::Tss2ResponseCode) -> bool {
    use tss_esapi::constants::response_code::Tss2ResponseCode;
    /// The raw code; its `Display` is the only public view of it.
    fn raw(code: &dyn std::fmt::Display) -> Option<u32> {
        let text = code.to_string();
        u32::from_str_radix(text.rsplit_once("0x")?.1, 16).ok()
    }
    const LAYER_SHIFT: u32 = 16;
    const WARNING: u32 = 0x800;
    const VENDOR: u32 = 0x400;
    match rc {
        Tss2ResponseCode::Success => false,
        Tss2ResponseCode::FormatOne(code) => raw(&code).is_some_and(|r| r >> LAYER_SHIFT == 0),
        Tss2ResponseCode::FormatZero(code) => {
            raw(&code).is_some_and(|r| r >> LAYER_SHIFT == 0 && r & (WARNING | VENDOR) == 0)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::answered_by_the_tpm;
    use tss_esapi::constants::response_code::Tss2ResponseCode;

    #[test]
    fn only_the_tpms_own_errors_count_as_its_answer() {
        for (rc, answered) in [
            (0x101, true),        // TPM_RC_FAILURE (swtpm, for a seed not to its EK)
            (0x1df, true),        // TPM_RC_INTEGRITY, parameter 1
            (0x922, false),       // TPM_RC_RETRY, a warning
            (0x921, false),       // TPM_RC_LOCKOUT, a warning
            (0x000a_000a, false), // the TCTI: I/O error
            (0x0007_0007, false), // ESYS: bad sequence
        ] {
            assert_eq!(
                answered_by_the_tpm(Tss2ResponseCode::from(rc)),
                answered,
                "{rc:#x}"
            );
        }
    }
}
