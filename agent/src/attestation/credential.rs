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
    let credential = match tpm.activate_credential(&sealed.credential_blob, &sealed.encrypted_seed)
    {
        Ok(credential) => credential,
        Err(e) => {
            tracing::warn!(error = %keel_atls::ErrorChain(&e), "credential activation failed");
            return Err(match refused_by_the_tpm(&e) {
                Refusal::Blobs => OpenError::Sealed(CredentialError::Open),
                // A failure mode answers every command so: told apart by
                // the TPM's self-test result.
                Refusal::Failure if !tpm.failing() => OpenError::Sealed(CredentialError::Open),
                Refusal::Failure | Refusal::Device => OpenError::Tpm,
            });
        }
    };
    open_with_credential(sealed, &credential, &ak_name).map_err(OpenError::Sealed)
}

/// What an ActivateCredential failure says about the secret.
#[derive(Debug, PartialEq, Eq)]
enum Refusal {
    /// The blobs: too large for the command, or refused by the TPM in a
    /// response about one of the command's parameters, handles or
    /// sessions (a format-one code of the TPM's layer).
    Blobs,
    /// TPM_RC_FAILURE: what swtpm answers for a seed not encrypted to its
    /// EK, and what a TPM in failure mode answers to everything.
    Failure,
    /// Anything else: a warning (retry, lockout, memory), another error,
    /// the transport or the software stack. The TPM's own failure.
    Device,
}

/// Sorts an ActivateCredential failure ([`Refusal`]).
fn refused_by_the_tpm(e: &crate::tpm::TpmError) -> Refusal {
    match e {
        crate::tpm::TpmError::ActivateCredential(tss_esapi::Error::WrapperError(
            tss_esapi::WrapperErrorKind::WrongParamSize,
        )) => Refusal::Blobs,
        crate::tpm::TpmError::ActivateCredential(tss_esapi::Error::Tss2Error(rc)) => {
            refusal_of(*rc)
        }
        _ => Refusal::Device,
    }
}

/// [`Refusal`] of a response code.
fn refusal_of(rc: tss_esapi::constants::response_code::Tss2ResponseCode) -> Refusal {
    use tss_esapi::constants::response_code::Tss2ResponseCode;
    /// The raw code; its `Display` is the only public view of it.
    fn raw(code: &dyn std::fmt::Display) -> Option<u32> {
        let text = code.to_string();
        u32::from_str_radix(text.rsplit_once("0x")?.1, 16).ok()
    }
    /// TPM_RC_FAILURE (TPM_RC_VER1 + 1), of the TPM's layer.
    const FAILURE: u32 = 0x101;
    const LAYER_SHIFT: u32 = 16;
    match rc {
        Tss2ResponseCode::FormatOne(code) if raw(&code).is_some_and(|r| r >> LAYER_SHIFT == 0) => {
            Refusal::Blobs
        }
        Tss2ResponseCode::FormatZero(code) if raw(&code) == Some(FAILURE) => Refusal::Failure,
        _ => Refusal::Device,
    }
}

#[cfg(test)]
mod tests {
    use super::{refusal_of, Refusal};
    use tss_esapi::constants::response_code::Tss2ResponseCode;

    #[test]
    fn response_codes_sort_into_refusals() {
        for (rc, refusal) in [
            (0x1df, Refusal::Blobs),               // TPM_RC_INTEGRITY, parameter 1
            (0x084, Refusal::Blobs),               // TPM_RC_VALUE
            (0x101, Refusal::Failure),             // TPM_RC_FAILURE
            (0x100, Refusal::Device),              // TPM_RC_INITIALIZE
            (0x130, Refusal::Device),              // TPM_RC_REBOOT
            (0x922, Refusal::Device),              // TPM_RC_RETRY, a warning
            (0x921, Refusal::Device),              // TPM_RC_LOCKOUT, a warning
            (0x000a_000a, Refusal::Device),        // the TCTI: I/O error
            (0x0007_0007, Refusal::Device),        // ESYS: bad sequence
            (0x0007_0080 | 0x1f, Refusal::Device), // a format-one shape outside the TPM's layer
        ] {
            assert_eq!(refusal_of(Tss2ResponseCode::from(rc)), refusal, "{rc:#x}");
        }
    }
}
