//! Secrets sealed to one TPM (TPM2_MakeCredential, computed in pure Rust).
//!
//! A verifier that accepted a node's attestation seals what it sends (the
//! master secret, a join ticket's keys) to the node's endorsement key *and*
//! the name of the attestation key that signed the quote. Only a TPM holding
//! that EK and that AK can run TPM2_ActivateCredential and recover the
//! 32-byte credential, which is the AEAD key of the payload. A document whose
//! quote came from a software key, or from an AK in another TPM, can pass
//! every signature check and still never read the secret.
//!
//! The same construction proves key residency in every aTLS handshake
//! ([`residency_challenge`], answered by the agent's `answer_residency`):
//! before any request or secret crosses, the verifier makes a credential for
//! the peer's EK and AK name and the peer proves it recovered it. Opening
//! and answering need the TPM and live in the agent
//! (`keel_agent::attestation::credential`).

use chacha20poly1305::aead::{Aead, KeyInit, Payload};
use chacha20poly1305::{ChaCha20Poly1305, Key, Nonce};
use hmac::{Hmac, Mac};
use keel_proto::attestation::{ResidencyChallenge, SealedSecret};
use prost::Message;
use rand::RngCore;
use sha2::Sha256;
use zeroize::Zeroizing;

use crate::rsa_oaep;
use crate::tpm_wire::{alg, Public, PublicKey};

/// Length of a credential: the AEAD key of a sealed payload, or a
/// residency challenge's secret.
pub const CREDENTIAL_LEN: usize = 32;
/// Largest accepted residency challenge (a real one is about 330 bytes).
pub const MAX_CHALLENGE_BYTES: usize = 1024;
const AAD_CONTEXT: &[u8] = b"keel-sealed-secret-v1";

/// Sealing or opening failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CredentialError {
    /// The EK is not an RSA-2048 key with AES-128-CFB, as the TCG default template makes it.
    #[error("endorsement key is not an RSA-2048 key with AES-128-CFB protection")]
    UnsupportedEk,
    /// RSA-OAEP encryption of the seed failed.
    #[error("encrypting the credential seed to the EK failed")]
    SeedEncryption,
    /// The payload could not be encrypted.
    #[error("encrypting the payload failed")]
    Encrypt,
    /// The sealed secret is malformed or was not sealed to this TPM and AK.
    #[error("the secret was not sealed to this TPM")]
    Open,
}

type HmacSha256 = Hmac<Sha256>;

/// TPM KDFa (SP 800-108 counter mode, HMAC-SHA256), `bits` long.
fn kdfa(
    key: &[u8],
    label: &str,
    context_u: &[u8],
    context_v: &[u8],
    bits: u32,
) -> Zeroizing<Vec<u8>> {
    let len = (bits as usize).div_ceil(8);
    let mut out = Zeroizing::new(Vec::with_capacity(len + 32));
    let mut counter: u32 = 1;
    while out.len() < len {
        // HMAC accepts keys of any length.
        let Ok(mut mac) = <HmacSha256 as Mac>::new_from_slice(key) else {
            break;
        };
        mac.update(&counter.to_be_bytes());
        mac.update(label.as_bytes());
        mac.update(&[0]);
        mac.update(context_u);
        mac.update(context_v);
        mac.update(&bits.to_be_bytes());
        out.extend_from_slice(&mac.finalize().into_bytes());
        counter += 1;
    }
    out.truncate(len);
    out
}

fn aes128_cfb_encrypt(key: &[u8], data: &mut [u8]) -> Result<(), CredentialError> {
    use cfb_mode::cipher::{AsyncStreamCipher, KeyIvInit};
    let enc = cfb_mode::Encryptor::<aes::Aes128>::new_from_slices(key, &[0u8; 16])
        .map_err(|_| CredentialError::Encrypt)?;
    enc.encrypt(data);
    Ok(())
}

/// TPM2_MakeCredential for an RSA EK: returns (credential blob, encrypted seed).
fn make_credential(
    ek: &Public,
    ak_name: &[u8],
    credential: &[u8; CREDENTIAL_LEN],
) -> Result<(Vec<u8>, Vec<u8>), CredentialError> {
    let PublicKey::Rsa {
        bits: 2048,
        exponent,
        modulus,
    } = &ek.key
    else {
        return Err(CredentialError::UnsupportedEk);
    };
    if ek.symmetric != Some((alg::AES, 128, alg::CFB)) {
        return Err(CredentialError::UnsupportedEk);
    }
    let exponent = if *exponent == 0 { 65537 } else { *exponent };

    let mut rng = rand::rngs::OsRng;
    let mut seed = Zeroizing::new([0u8; 32]);
    rng.fill_bytes(seed.as_mut());
    let encrypted_seed =
        rsa_oaep::encrypt(&mut rng, modulus, exponent, b"IDENTITY\0", seed.as_ref())
            .map_err(|_| CredentialError::SeedEncryption)?;

    let sym_key = kdfa(seed.as_ref(), "STORAGE", ak_name, &[], 128);
    let mut enc_identity = Zeroizing::new(Vec::with_capacity(2 + CREDENTIAL_LEN));
    enc_identity.extend_from_slice(&(CREDENTIAL_LEN as u16).to_be_bytes());
    enc_identity.extend_from_slice(credential);
    aes128_cfb_encrypt(&sym_key, &mut enc_identity)?;

    let hmac_key = kdfa(seed.as_ref(), "INTEGRITY", &[], &[], 256);
    let mut mac =
        <HmacSha256 as Mac>::new_from_slice(&hmac_key).map_err(|_| CredentialError::Encrypt)?;
    mac.update(&enc_identity);
    mac.update(ak_name);
    let outer_hmac = mac.finalize().into_bytes();

    let mut blob = Vec::with_capacity(2 + outer_hmac.len() + enc_identity.len());
    blob.extend_from_slice(&(outer_hmac.len() as u16).to_be_bytes());
    blob.extend_from_slice(&outer_hmac);
    blob.extend_from_slice(&enc_identity);
    Ok((blob, encrypted_seed.to_vec()))
}

/// A key-residency challenge for the TPM holding `ek` and the AK named
/// `ak_name`: the encoded [`ResidencyChallenge`] and the secret only that
/// TPM recovers from it (TPM2_ActivateCredential).
pub fn residency_challenge(
    ek: &Public,
    ak_name: &[u8],
) -> Result<(Vec<u8>, Zeroizing<[u8; CREDENTIAL_LEN]>), CredentialError> {
    let mut secret = Zeroizing::new([0u8; CREDENTIAL_LEN]);
    rand::rngs::OsRng.fill_bytes(secret.as_mut());
    let (credential_blob, encrypted_seed) = make_credential(ek, ak_name, &secret)?;
    let message = ResidencyChallenge {
        credential_blob,
        encrypted_seed,
    }
    .encode_to_vec();
    Ok((message, secret))
}

fn aad(ak_name: &[u8]) -> Vec<u8> {
    [AAD_CONTEXT, ak_name].concat()
}

/// Seals `payload` to the TPM holding `ek` and the AK named `ak_name`.
pub fn seal(ek: &Public, ak_name: &[u8], payload: &[u8]) -> Result<SealedSecret, CredentialError> {
    let mut credential = Zeroizing::new([0u8; CREDENTIAL_LEN]);
    rand::rngs::OsRng.fill_bytes(credential.as_mut());
    let (credential_blob, encrypted_seed) = make_credential(ek, ak_name, &credential)?;
    let mut nonce = [0u8; 12];
    rand::rngs::OsRng.fill_bytes(&mut nonce);
    let cipher = ChaCha20Poly1305::new(Key::from_slice(credential.as_ref()));
    let ciphertext = cipher
        .encrypt(
            Nonce::from_slice(&nonce),
            Payload {
                msg: payload,
                aad: &aad(ak_name),
            },
        )
        .map_err(|_| CredentialError::Encrypt)?;
    Ok(SealedSecret {
        credential_blob,
        encrypted_seed,
        ciphertext,
        nonce: nonce.to_vec(),
    })
}

/// Decrypts a sealed payload with the credential the TPM recovered.
pub fn open_with_credential(
    sealed: &SealedSecret,
    credential: &[u8],
    ak_name: &[u8],
) -> Result<Zeroizing<Vec<u8>>, CredentialError> {
    if credential.len() != CREDENTIAL_LEN || sealed.nonce.len() != 12 {
        return Err(CredentialError::Open);
    }
    let cipher = ChaCha20Poly1305::new(Key::from_slice(credential));
    cipher
        .decrypt(
            Nonce::from_slice(&sealed.nonce),
            Payload {
                msg: &sealed.ciphertext,
                aad: &aad(ak_name),
            },
        )
        .map(Zeroizing::new)
        .map_err(|_| CredentialError::Open)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn kdfa_matches_the_tpm_spec_shape() {
        // Deterministic, length as asked, label-sensitive.
        let a = kdfa(b"key", "STORAGE", b"name", &[], 128);
        assert_eq!(a.len(), 16);
        assert_eq!(*a, *kdfa(b"key", "STORAGE", b"name", &[], 128));
        assert_ne!(*a, kdfa(b"key", "INTEGRITY", b"name", &[], 128)[..]);
        assert_eq!(kdfa(b"key", "INTEGRITY", &[], &[], 256).len(), 32);
    }
}
