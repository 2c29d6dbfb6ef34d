//! Hooks to present hand-made certificates, for testing that peers refuse
//! them (replayed documents, moved documents, unknown extensions, no
//! attestation). Built only with the `danger` feature, which the agent and
//! the CLI never turn on (this crate's tests do): a side configured
//! with these hooks does not attest honestly. Key residency challenges still
//! go to the issuer the side was built with, if any.

use std::sync::Arc;

use rcgen::KeyPair;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::CertificateDer;
use rustls::sign::CertifiedKey;

use crate::attestation::Issuer;
use crate::cert::{self, CertError};
use crate::nonce::Nonce;

/// Makes the certificate a side presents, given the nonce its peer sent.
pub type PresentFn =
    Arc<dyn Fn(&Nonce) -> Result<Arc<CertifiedKey>, CertError> + Send + Sync + 'static>;

/// The crypto provider this crate uses (ring).
pub fn provider() -> Arc<CryptoProvider> {
    crate::provider()
}

/// What an honest side presents: a fresh key and a certificate carrying a
/// document `issuer` issued for `nonce` and that key.
pub fn attested_certificate(
    issuer: &dyn Issuer,
    nonce: &Nonce,
) -> Result<Arc<CertifiedKey>, CertError> {
    cert::issue(issuer, nonce.as_bytes())
}

/// A certificate for `key` carrying `content` in an extension under `oid`,
/// encoded the way the attestation extension is.
pub fn certificate_with_extension(
    key: KeyPair,
    oid: &[u64],
    content: &[u8],
) -> Result<Arc<CertifiedKey>, CertError> {
    cert::embed(key, content, oid)
}

/// A certificate with a fresh key and no attestation extension.
pub fn certificate_without_attestation() -> Result<Arc<CertifiedKey>, CertError> {
    cert::unattested()
}

/// The certificate `cert` with handshake signatures made by `key` instead
/// of the certificate's own key: what a side that copied another side's
/// certificate, but not its private key, can present.
pub fn certificate_without_its_key(
    cert: CertificateDer<'static>,
    key: KeyPair,
) -> Result<Arc<CertifiedKey>, CertError> {
    cert::certified_key(key, cert)
}

/// A fresh ECDSA P-256 key, as this crate makes per handshake.
pub fn generate_key() -> Result<KeyPair, CertError> {
    cert::generate_key()
}

/// The key-binding value a document for a certificate with `key` must carry.
pub fn user_data_for(key: &KeyPair) -> [u8; 32] {
    use rcgen::PublicKeyData;
    cert::user_data(&key.subject_public_key_info())
}
