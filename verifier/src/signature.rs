//! Detached signatures over measurements files: ECDSA P-256 with SHA-256
//! over the exact file bytes, the signature DER-encoded. This is what
//! `openssl dgst -sha256 -sign key.pem -out file.sig file` writes and
//! `openssl dgst -sha256 -verify pub.pem -signature file.sig file` checks,
//! so an operator can sign and verify with either tool.
//!
//! Keys are PEM: the public key a SubjectPublicKeyInfo (`PUBLIC KEY`), the
//! private key PKCS#8 (`PRIVATE KEY`, as `openssl genpkey` writes it). Every
//! input is bounded before it is parsed.

use p256::ecdsa::signature::{Signer as _, Verifier as _};
use p256::ecdsa::{DerSignature, SigningKey, VerifyingKey};
use p256::pkcs8::{DecodePrivateKey as _, DecodePublicKey as _, EncodePrivateKey as _};
use p256::pkcs8::{EncodePublicKey as _, LineEnding};
use sha2::{Digest as _, Sha256};
use zeroize::Zeroizing;

use crate::measurements::Measurements;

/// Largest accepted signature (a DER ECDSA P-256 signature is at most 72
/// bytes).
pub const MAX_SIGNATURE_BYTES: usize = 256;
/// Largest accepted PEM key.
pub const MAX_KEY_PEM_BYTES: usize = 4096;

/// Why a signature, or a key, was refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SignatureError {
    /// The public key is larger than [`MAX_KEY_PEM_BYTES`] or is not a PEM
    /// P-256 SubjectPublicKeyInfo.
    #[error("the signing public key is not a PEM P-256 public key (SubjectPublicKeyInfo)")]
    PublicKey,
    /// The private key is larger than [`MAX_KEY_PEM_BYTES`] or is not a PEM
    /// PKCS#8 P-256 key.
    #[error("the signing key is not a PEM PKCS#8 P-256 private key")]
    PrivateKey,
    /// The signature is empty, larger than [`MAX_SIGNATURE_BYTES`] or not a
    /// DER ECDSA signature.
    #[error("the signature is not a DER ECDSA P-256 signature")]
    Encoding,
    /// The signature does not verify with the key over these bytes.
    #[error("the signature does not verify with the configured key")]
    Mismatch,
    /// Encoding a key as PEM failed.
    #[error("encoding the key as PEM failed")]
    Encode,
}

/// `FILE.sig` for `FILE`: where the tools write, and look for, a detached
/// signature of a file.
pub fn detached_signature_path(file: &std::path::Path) -> std::path::PathBuf {
    let mut name = file.as_os_str().to_owned();
    name.push(".sig");
    std::path::PathBuf::from(name)
}

/// The public key that measurements files must be signed with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SigningPublicKey(VerifyingKey);

impl SigningPublicKey {
    /// Parses a PEM SubjectPublicKeyInfo of a P-256 key.
    pub fn from_pem(pem: &[u8]) -> Result<Self, SignatureError> {
        if pem.len() > MAX_KEY_PEM_BYTES {
            return Err(SignatureError::PublicKey);
        }
        let text = std::str::from_utf8(pem).map_err(|_| SignatureError::PublicKey)?;
        VerifyingKey::from_public_key_pem(text.trim())
            .map(Self)
            .map_err(|_| SignatureError::PublicKey)
    }

    /// The key as PEM (SubjectPublicKeyInfo, LF line endings).
    pub fn to_pem(&self) -> Result<String, SignatureError> {
        self.0
            .to_public_key_pem(LineEnding::LF)
            .map_err(|_| SignatureError::Encode)
    }

    /// SHA-256 of the key's DER SubjectPublicKeyInfo, what
    /// `openssl pkey -pubin -outform DER | sha256sum` prints.
    pub fn fingerprint(&self) -> Result<[u8; 32], SignatureError> {
        let der = self
            .0
            .to_public_key_der()
            .map_err(|_| SignatureError::Encode)?;
        Ok(Sha256::digest(der.as_bytes()).into())
    }

    /// Checks a DER `signature` over exactly `message`.
    pub fn verify(&self, message: &[u8], signature: &[u8]) -> Result<(), SignatureError> {
        if signature.is_empty() || signature.len() > MAX_SIGNATURE_BYTES {
            return Err(SignatureError::Encoding);
        }
        let signature = DerSignature::try_from(signature).map_err(|_| SignatureError::Encoding)?;
        self.0
            .verify(message, &signature)
            .map_err(|_| SignatureError::Mismatch)
    }
}

/// Largest measurements file accepted with a signature.
pub const MAX_SIGNED_MEASUREMENTS_BYTES: usize = 64 * 1024;

/// Why a signed measurements file was refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SignedMeasurementsError {
    /// The file is empty or larger than [`MAX_SIGNED_MEASUREMENTS_BYTES`].
    #[error("the signed measurements file is empty or larger than {MAX_SIGNED_MEASUREMENTS_BYTES} bytes")]
    Size,
    /// The signature does not verify.
    #[error(transparent)]
    Signature(#[from] SignatureError),
    /// The file verified but is not a measurements file.
    #[error("the signed file is not a measurements file: {0}")]
    Measurements(#[from] crate::measurements::MeasurementsError),
}

/// A measurements file whose detached signature verified with the
/// measurements signing key: an image the operator vouches for. Keeps the
/// exact bytes, so the pair can be passed on and checked again elsewhere.
#[derive(Clone, Debug, PartialEq)]
pub struct SignedMeasurements {
    body: Vec<u8>,
    signature: Vec<u8>,
    measurements: Measurements,
    epoch: u64,
}

impl SignedMeasurements {
    /// Checks `signature` over exactly `body` with `key`, then parses it.
    pub fn verify(
        key: &SigningPublicKey,
        body: &[u8],
        signature: &[u8],
    ) -> Result<Self, SignedMeasurementsError> {
        if body.is_empty() || body.len() > MAX_SIGNED_MEASUREMENTS_BYTES {
            return Err(SignedMeasurementsError::Size);
        }
        key.verify(body, signature)?;
        let (measurements, epoch) = Measurements::parse_file(body)?;
        Ok(Self {
            measurements,
            epoch,
            body: body.to_vec(),
            signature: signature.to_vec(),
        })
    }

    /// The file's exact bytes.
    pub fn body(&self) -> &[u8] {
        &self.body
    }

    /// The detached signature (DER).
    pub fn signature(&self) -> &[u8] {
        &self.signature
    }

    /// The parsed set.
    pub fn measurements(&self) -> &Measurements {
        &self.measurements
    }

    /// The file's rollback epoch (0 where it names none): a control plane
    /// takes no signed file below the epoch of an image it made current.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Whether this set enforces every PCR of `pcrs` with the value `own`
    /// holds for it: the image of a node whose PCRs are `own`.
    pub fn describes(&self, pcrs: &[u32], own: &std::collections::BTreeMap<u32, [u8; 32]>) -> bool {
        self.measurements.describes(pcrs, own)
    }

    /// The wire form.
    pub fn to_proto(&self) -> keel_proto::attestation::SignedMeasurements {
        keel_proto::attestation::SignedMeasurements {
            measurements: self.body.clone(),
            signature: self.signature.clone(),
        }
    }
}

/// A private key that signs measurements files.
pub struct SigningPrivateKey(SigningKey);

impl std::fmt::Debug for SigningPrivateKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SigningPrivateKey(..)")
    }
}

impl SigningPrivateKey {
    /// A new random key.
    pub fn generate() -> Self {
        Self(SigningKey::random(&mut rand::rngs::OsRng))
    }

    /// Parses a PEM PKCS#8 P-256 private key.
    pub fn from_pem(pem: &[u8]) -> Result<Self, SignatureError> {
        if pem.len() > MAX_KEY_PEM_BYTES {
            return Err(SignatureError::PrivateKey);
        }
        let text = std::str::from_utf8(pem).map_err(|_| SignatureError::PrivateKey)?;
        SigningKey::from_pkcs8_pem(text.trim())
            .map(Self)
            .map_err(|_| SignatureError::PrivateKey)
    }

    /// The key as PEM PKCS#8 (LF line endings).
    pub fn to_pem(&self) -> Result<Zeroizing<String>, SignatureError> {
        self.0
            .to_pkcs8_pem(LineEnding::LF)
            .map_err(|_| SignatureError::Encode)
    }

    /// Its public key.
    pub fn public_key(&self) -> SigningPublicKey {
        SigningPublicKey(*self.0.verifying_key())
    }

    /// A DER signature over exactly `message`.
    pub fn sign(&self, message: &[u8]) -> Vec<u8> {
        let signature: DerSignature = self.0.sign(message);
        signature.as_bytes().to_vec()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_signature_verifies_only_over_the_same_bytes_with_the_same_key() {
        let key = SigningPrivateKey::generate();
        let public = key.public_key();
        let file = b"{\"4\": \"00\"}\n";
        let signature = key.sign(file);
        public.verify(file, &signature).unwrap();

        // One byte more (a trailing newline), one byte changed.
        let mut longer = file.to_vec();
        longer.push(b'\n');
        assert!(matches!(
            public.verify(&longer, &signature),
            Err(SignatureError::Mismatch)
        ));
        let mut flipped = file.to_vec();
        flipped[2] ^= 1;
        assert!(matches!(
            public.verify(&flipped, &signature),
            Err(SignatureError::Mismatch)
        ));
        // Another key.
        let other = SigningPrivateKey::generate().public_key();
        assert!(matches!(
            other.verify(file, &signature),
            Err(SignatureError::Mismatch)
        ));
        // Not a signature: empty, garbage, too large, truncated.
        for bad in [
            Vec::new(),
            b"not a signature".to_vec(),
            vec![0x30; MAX_SIGNATURE_BYTES + 1],
            signature[..signature.len() - 1].to_vec(),
        ] {
            assert!(matches!(
                public.verify(file, &bad),
                Err(SignatureError::Encoding)
            ));
        }
    }

    /// The epoch is the one inside the signed bytes: changing it breaks
    /// the signature.
    #[test]
    fn a_signed_files_epoch_is_part_of_what_was_signed() {
        let key = SigningPrivateKey::generate();
        let set = Measurements::new(
            crate::measurements::REQUIRED_PCRS
                .map(|p| (p, crate::measurements::Expected::enforced([p as u8; 32]))),
        )
        .unwrap();
        let body = set.to_json_with_epoch(5).into_bytes();
        let signature = key.sign(&body);
        let signed = SignedMeasurements::verify(&key.public_key(), &body, &signature).unwrap();
        assert_eq!((signed.epoch(), signed.measurements()), (5, &set));
        let raised = set.to_json_with_epoch(6).into_bytes();
        assert!(matches!(
            SignedMeasurements::verify(&key.public_key(), &raised, &signature),
            Err(SignedMeasurementsError::Signature(SignatureError::Mismatch))
        ));
        let none = set.to_json().into_bytes();
        let signed =
            SignedMeasurements::verify(&key.public_key(), &none, &key.sign(&none)).unwrap();
        assert_eq!(signed.epoch(), 0);
    }

    #[test]
    fn keys_round_trip_through_pem_and_bad_pem_is_refused() {
        let key = SigningPrivateKey::generate();
        let again = SigningPrivateKey::from_pem(key.to_pem().unwrap().as_bytes()).unwrap();
        assert_eq!(again.public_key(), key.public_key());
        let pem = key.public_key().to_pem().unwrap();
        assert!(pem.starts_with("-----BEGIN PUBLIC KEY-----"));
        let public = SigningPublicKey::from_pem(pem.as_bytes()).unwrap();
        assert_eq!(public, key.public_key());
        assert_eq!(
            public.fingerprint().unwrap(),
            key.public_key().fingerprint().unwrap()
        );

        // A private key where a public one belongs and the reverse; junk;
        // a key too large to be one.
        assert!(SigningPublicKey::from_pem(key.to_pem().unwrap().as_bytes()).is_err());
        assert!(SigningPrivateKey::from_pem(pem.as_bytes()).is_err());
        assert!(SigningPublicKey::from_pem(b"-----BEGIN PUBLIC KEY-----\n").is_err());
        let mut padded = pem.clone().into_bytes();
        padded.extend(std::iter::repeat_n(b'\n', MAX_KEY_PEM_BYTES));
        assert!(matches!(
            SigningPublicKey::from_pem(&padded),
            Err(SignatureError::PublicKey)
        ));
    }
}
