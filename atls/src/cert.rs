//! Attested certificates: a fresh P-256 key and a self-signed certificate per
//! handshake, with the attestation document in a non-critical X.509
//! extension.
//!
//! The document's user data is SHA-256 of the certificate's DER
//! SubjectPublicKeyInfo ([`user_data`]), so a document only vouches for the
//! key of the certificate it was issued into: the TLS handshake signature then
//! proves the peer holds that key.
//!
//! A verifier does not check the certificate's self-signature. In TLS 1.3
//! the peer's CertificateVerify signs the transcript, which holds the whole
//! Certificate message, with the key of that certificate (rustls checks it
//! against the same certificate): only the key's holder can complete the
//! handshake with it, and the holder could self-sign any content anyway. The
//! self-signature would be a second ECDSA verification per handshake that
//! proves nothing more, so only the key type and the algorithm fields are
//! checked here.
//!
//! The extension is identified by [`ATTESTATION_OID`] and its value is a DER
//! OCTET STRING holding the document. Validity dates are not checked: freshness
//! comes from the verifier's nonce inside the document.

use std::sync::Arc;

use rcgen::{CertificateParams, CustomExtension, KeyPair, PublicKeyData, PKCS_ECDSA_P256_SHA256};
use rustls::pki_types::CertificateDer;
use rustls::sign::{CertifiedKey, Signer, SigningKey};
use rustls::{SignatureAlgorithm, SignatureScheme};
use sha2::{Digest, Sha256};
use x509_parser::der_parser::der::parse_der_octetstring;
use x509_parser::oid_registry::{
    OID_EC_P256, OID_KEY_TYPE_EC_PUBLIC_KEY, OID_SIG_ECDSA_WITH_SHA256,
};
use x509_parser::prelude::{FromDer, X509Certificate};

use crate::attestation::{IssueError, Issuer};

/// The private OID arc of keel's aTLS extensions: `1.3.9901.1`.
///
/// It is not registered with a registration authority; every keel party
/// agrees on it, and an organisation with its own enterprise number can move
/// it there (a wire change for all parties at once).
pub const OID_ARC: &[u64] = &[1, 3, 9901, 1];

/// The OID of the extension that carries the attestation document, version 1:
/// `1.3.9901.1.1`. Any other OID under [`OID_ARC`] is refused as unknown.
pub const ATTESTATION_OID: &[u64] = &[1, 3, 9901, 1, 1];

/// The largest document this crate embeds or accepts. A TLS handshake message
/// is at most 64 KiB and the certificate must fit in one.
pub const MAX_DOCUMENT_LEN: usize = 48 * 1024;

/// The key-binding value a document must carry: SHA-256 of the DER
/// SubjectPublicKeyInfo of the certificate that carries it.
pub fn user_data(subject_public_key_info: &[u8]) -> [u8; 32] {
    Sha256::digest(subject_public_key_info).into()
}

/// Makes a fresh key and a self-signed certificate carrying a document that
/// `issuer` issues for `nonce` and the new key.
pub(crate) fn issue(issuer: &dyn Issuer, nonce: &[u8]) -> Result<Arc<CertifiedKey>, CertError> {
    let _span = tracing::debug_span!("atls.certificate").entered();
    let key = generate_key()?;
    let document = issuer
        .issue(nonce, &user_data(&key.subject_public_key_info()))
        .map_err(CertError::Issue)?;
    embed(key, &document, ATTESTATION_OID)
}

/// Makes a self-signed certificate for `key` that carries `document` under
/// `oid`, ready to present in a handshake.
pub(crate) fn embed(
    key: KeyPair,
    document: &[u8],
    oid: &[u64],
) -> Result<Arc<CertifiedKey>, CertError> {
    if document.len() > MAX_DOCUMENT_LEN {
        return Err(CertError::DocumentTooLarge {
            len: document.len(),
        });
    }
    let der = self_signed(&key, Some((oid, document)))?;
    certified_key(key, der)
}

/// Makes a key and a certificate with no attestation, for a side that does
/// not attest: TLS still needs a certificate to sign the handshake with.
pub(crate) fn unattested() -> Result<Arc<CertifiedKey>, CertError> {
    let key = generate_key()?;
    let der = self_signed(&key, None)?;
    certified_key(key, der)
}

/// A fresh ECDSA P-256 key, as every handshake gets.
pub(crate) fn generate_key() -> Result<KeyPair, CertError> {
    KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256).map_err(CertError::GenerateKey)
}

fn self_signed(
    key: &KeyPair,
    extension: Option<(&[u64], &[u8])>,
) -> Result<CertificateDer<'static>, CertError> {
    let mut params = CertificateParams::default();
    params.distinguished_name = rcgen::DistinguishedName::new();
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "keel aTLS");
    if let Some((oid, document)) = extension {
        params
            .custom_extensions
            .push(CustomExtension::from_oid_content(
                oid,
                der_octet_string(document),
            ));
    }
    let cert = params.self_signed(key).map_err(CertError::Sign)?;
    Ok(cert.der().clone())
}

/// `cert` ready to present, its handshake signed with `key` (the
/// certificate's own key, except in tests of the `danger` feature).
pub(crate) fn certified_key(
    key: KeyPair,
    cert: CertificateDer<'static>,
) -> Result<Arc<CertifiedKey>, CertError> {
    if key.algorithm() != &PKCS_ECDSA_P256_SHA256 {
        return Err(CertError::KeyAlgorithm);
    }
    let signer = Arc::new(HandshakeKey(Arc::new(key)));
    Ok(Arc::new(CertifiedKey::new(vec![cert], signer)))
}

/// The certificate's key as TLS signs the handshake with it: the P-256 key
/// rcgen made and signed the certificate with, used as it is. Loading it
/// again through the crypto provider's PKCS#8 parser made ring derive its
/// public key a second time per handshake (a base-point multiplication
/// and a field inversion) and left one more PKCS#8 copy of the private key
/// in freed memory. It is its own signer: ECDSA P-256 with SHA-256, the
/// signature DER-encoded as TLS wants it.
#[derive(Clone, Debug)]
struct HandshakeKey(Arc<KeyPair>);

impl SigningKey for HandshakeKey {
    fn choose_scheme(&self, offered: &[SignatureScheme]) -> Option<Box<dyn Signer>> {
        offered
            .contains(&SignatureScheme::ECDSA_NISTP256_SHA256)
            .then(|| Box::new(self.clone()) as Box<dyn Signer>)
    }

    fn algorithm(&self) -> SignatureAlgorithm {
        SignatureAlgorithm::ECDSA
    }
}

impl Signer for HandshakeKey {
    fn sign(&self, message: &[u8]) -> Result<Vec<u8>, rustls::Error> {
        rcgen::SigningKey::sign(self.0.as_ref(), message)
            .map_err(|e| rustls::Error::General(format!("signing the handshake: {e}")))
    }

    fn scheme(&self) -> SignatureScheme {
        SignatureScheme::ECDSA_NISTP256_SHA256
    }
}

/// DER OCTET STRING around `content` (definite length, any size).
fn der_octet_string(content: &[u8]) -> Vec<u8> {
    let len = content.len();
    let mut out = Vec::with_capacity(len + 6);
    out.push(0x04);
    if len < 0x80 {
        out.push(len as u8);
    } else {
        let bytes = len.to_be_bytes();
        let skip = bytes.iter().take_while(|b| **b == 0).count();
        out.push(0x80 | (bytes.len() - skip) as u8);
        out.extend_from_slice(&bytes[skip..]);
    }
    out.extend_from_slice(content);
    out
}

/// What a verifier extracts from a peer's certificate before validation.
#[derive(Debug)]
pub struct Embedded {
    /// The attestation document from the extension.
    pub document: Vec<u8>,
    /// SHA-256 of the certificate's SubjectPublicKeyInfo, recomputed here.
    pub user_data: [u8; 32],
}

/// Parses a peer's certificate, checks it is a well-formed P-256 certificate
/// signed with ecdsa-with-SHA256, and extracts the document and the
/// key-binding value.
///
/// This does not check the document (the validator's job), nor the
/// self-signature (the handshake signature proves the key; see the module
/// documentation).
pub fn extract(cert_der: &[u8]) -> Result<Embedded, PeerCertError> {
    let cert = parse(cert_der)?;
    let document = find_document(&cert)?;
    Ok(Embedded {
        document,
        user_data: user_data(cert.tbs_certificate.subject_pki.raw),
    })
}

/// The certificate's subject public key info, as [`extract`] reads it (and
/// hashes it into the user data): the handshake signature is checked
/// against these very bytes, so that no difference between two
/// certificate parsers could make the key that signed differ from the key
/// the document binds.
pub fn public_key_info(cert_der: &[u8]) -> Result<&[u8], PeerCertError> {
    Ok(parse(cert_der)?.tbs_certificate.subject_pki.raw)
}

/// The one parse of a peer's certificate: DER with nothing after it, a
/// P-256 key, signed with ecdsa-with-SHA256.
fn parse(cert_der: &[u8]) -> Result<X509Certificate<'_>, PeerCertError> {
    let (rest, cert) =
        X509Certificate::from_der(cert_der).map_err(|e| PeerCertError::Parse(e.into()))?;
    if !rest.is_empty() {
        return Err(PeerCertError::TrailingData);
    }
    check_key_and_algorithm(&cert)?;
    Ok(cert)
}

fn check_key_and_algorithm(cert: &X509Certificate<'_>) -> Result<(), PeerCertError> {
    let spki = cert.public_key();
    let curve = spki
        .algorithm
        .parameters
        .as_ref()
        .and_then(|p| p.as_oid().ok());
    if spki.algorithm.algorithm != OID_KEY_TYPE_EC_PUBLIC_KEY || curve != Some(OID_EC_P256) {
        return Err(PeerCertError::UnsupportedKey);
    }
    if cert.signature_algorithm.algorithm != OID_SIG_ECDSA_WITH_SHA256
        || cert.tbs_certificate.signature.algorithm != OID_SIG_ECDSA_WITH_SHA256
    {
        return Err(PeerCertError::UnsupportedSignatureAlgorithm);
    }
    Ok(())
}

fn find_document(cert: &X509Certificate<'_>) -> Result<Vec<u8>, PeerCertError> {
    let ours = x509_parser::der_parser::Oid::from(ATTESTATION_OID)
        .map_err(|_| PeerCertError::ExtensionMissing)?;
    let arc =
        x509_parser::der_parser::Oid::from(OID_ARC).map_err(|_| PeerCertError::ExtensionMissing)?;
    let mut found = None;
    for ext in cert.extensions() {
        if ext.oid == ours {
            if found.replace(ext.value).is_some() {
                return Err(PeerCertError::DuplicateExtension);
            }
        } else if ext.oid.starts_with(&arc) {
            return Err(PeerCertError::UnknownExtensionOid(ext.oid.to_id_string()));
        } else if ext.critical {
            // RFC 5280, 4.2: a critical extension the reader does not
            // process makes the certificate unacceptable. keel's own
            // certificates mark none critical.
            return Err(PeerCertError::UnknownCriticalExtension(
                ext.oid.to_id_string(),
            ));
        }
    }
    let value = found.ok_or(PeerCertError::ExtensionMissing)?;
    let (rest, octets) = parse_der_octetstring(value).map_err(|_| PeerCertError::ExtensionValue)?;
    let document = octets
        .as_slice()
        .map_err(|_| PeerCertError::ExtensionValue)?;
    if !rest.is_empty() {
        return Err(PeerCertError::ExtensionValue);
    }
    if document.len() > MAX_DOCUMENT_LEN {
        return Err(PeerCertError::DocumentTooLarge {
            len: document.len(),
        });
    }
    Ok(document.to_vec())
}

/// Making this side's certificate failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CertError {
    /// Generating the per-handshake key failed.
    #[error("generating the TLS key failed")]
    GenerateKey(#[source] rcgen::Error),
    /// The issuer failed.
    #[error(transparent)]
    Issue(IssueError),
    /// The document does not fit into a handshake message.
    #[error("the attestation document is {len} bytes, more than the {MAX_DOCUMENT_LEN} that fit a handshake")]
    DocumentTooLarge {
        /// The document's length.
        len: usize,
    },
    /// Signing the certificate failed.
    #[error("signing the certificate failed")]
    Sign(#[source] rcgen::Error),
    /// The key is not the ECDSA P-256 key a handshake is signed with.
    #[error("the TLS key is not an ECDSA P-256 key")]
    KeyAlgorithm,
}

/// A peer's certificate is not an acceptable attested certificate.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PeerCertError {
    /// The certificate is not valid DER X.509.
    #[error("malformed certificate")]
    Parse(#[source] x509_parser::error::X509Error),
    /// Bytes follow the certificate.
    #[error("malformed certificate: trailing data")]
    TrailingData,
    /// The key is not ECDSA P-256.
    #[error("the certificate key is not ECDSA P-256")]
    UnsupportedKey,
    /// The signature is not ecdsa-with-SHA256.
    #[error("the certificate is not signed with ecdsa-with-SHA256")]
    UnsupportedSignatureAlgorithm,
    /// No extension carries an attestation document.
    #[error("attestation extension missing: the peer presented no attestation")]
    ExtensionMissing,
    /// An extension under keel's arc that this version does not know.
    #[error("unknown attestation extension OID {0}")]
    UnknownExtensionOid(String),
    /// A critical extension this verifier does not process.
    #[error("unknown critical extension {0}")]
    UnknownCriticalExtension(String),
    /// The attestation extension appears twice.
    #[error("the attestation extension appears more than once")]
    DuplicateExtension,
    /// The extension value is not a DER OCTET STRING.
    #[error("the attestation extension's value is not a DER OCTET STRING")]
    ExtensionValue,
    /// The document is larger than any this crate issues.
    #[error("the attestation document is {len} bytes, more than the {MAX_DOCUMENT_LEN} accepted")]
    DocumentTooLarge {
        /// The document's length.
        len: usize,
    },
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    fn cert_der(key: &KeyPair, oid: &[u64], document: &[u8]) -> Vec<u8> {
        self_signed(key, Some((oid, document))).unwrap().to_vec()
    }

    fn p256() -> KeyPair {
        KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256).unwrap()
    }

    #[test]
    fn extract_returns_the_document_and_the_key_binding() {
        let key = p256();
        let document = vec![7u8; 300]; // long-form DER length
        let embedded = extract(&cert_der(&key, ATTESTATION_OID, &document)).unwrap();
        assert_eq!(embedded.document, document);
        assert_eq!(
            embedded.user_data,
            user_data(&key.subject_public_key_info())
        );
    }

    #[test]
    fn other_key_types_are_refused() {
        let key = KeyPair::generate_for(&rcgen::PKCS_ED25519).unwrap();
        let der = self_signed(&key, Some((ATTESTATION_OID, b"doc"))).unwrap();
        assert!(matches!(extract(&der), Err(PeerCertError::UnsupportedKey)));
    }

    #[test]
    fn extension_problems_are_named() {
        let key = p256();
        let der = self_signed(&key, None).unwrap();
        assert!(matches!(
            extract(&der),
            Err(PeerCertError::ExtensionMissing)
        ));

        let der = cert_der(&key, &[1, 2, 3, 4], b"doc");
        assert!(matches!(
            extract(&der),
            Err(PeerCertError::ExtensionMissing)
        ));

        match extract(&cert_der(&key, &[1, 3, 9901, 1, 7], b"doc")) {
            Err(PeerCertError::UnknownExtensionOid(oid)) => assert_eq!(oid, "1.3.9901.1.7"),
            other => panic!("{other:?}"),
        }

        let mut params = CertificateParams::default();
        params
            .custom_extensions
            .push(CustomExtension::from_oid_content(
                ATTESTATION_OID,
                b"raw".to_vec(),
            ));
        let der = params.self_signed(&key).unwrap().der().to_vec();
        assert!(matches!(extract(&der), Err(PeerCertError::ExtensionValue)));
    }

    #[test]
    fn an_unknown_critical_extension_is_refused_and_a_non_critical_one_ignored() {
        let key = p256();
        let with_extra = |critical: bool| {
            let mut params = CertificateParams::default();
            params
                .custom_extensions
                .push(CustomExtension::from_oid_content(
                    ATTESTATION_OID,
                    der_octet_string(b"doc"),
                ));
            let mut extra = CustomExtension::from_oid_content(&[1, 2, 3, 4], vec![0x05, 0x00]);
            extra.set_criticality(critical);
            params.custom_extensions.push(extra);
            params.self_signed(&key).unwrap().der().to_vec()
        };
        assert_eq!(extract(&with_extra(false)).unwrap().document, b"doc");
        match extract(&with_extra(true)) {
            Err(PeerCertError::UnknownCriticalExtension(oid)) => assert_eq!(oid, "1.2.3.4"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn oversized_documents_are_refused_when_embedding() {
        let result = embed(p256(), &vec![0; MAX_DOCUMENT_LEN + 1], ATTESTATION_OID);
        assert!(matches!(result, Err(CertError::DocumentTooLarge { .. })));
    }

    #[test]
    fn the_handshake_key_signs_with_the_certificates_key() {
        let key = p256();
        let spki = key.subject_public_key_info();
        let certified = embed(key, b"document", ATTESTATION_OID).unwrap();
        assert!(certified
            .key
            .choose_scheme(&[SignatureScheme::ED25519])
            .is_none());
        let signer = certified
            .key
            .choose_scheme(&[
                SignatureScheme::ED25519,
                SignatureScheme::ECDSA_NISTP256_SHA256,
            ])
            .unwrap();
        let signature = signer.sign(b"transcript").unwrap();
        let (_, cert) = X509Certificate::from_der(&certified.cert[0]).unwrap();
        assert_eq!(cert.public_key().raw, &spki[..]);
        let public = ring::signature::UnparsedPublicKey::new(
            &ring::signature::ECDSA_P256_SHA256_ASN1,
            &cert.public_key().subject_public_key.data,
        );
        public.verify(b"transcript", &signature).unwrap();
        assert!(public.verify(b"transcripT", &signature).is_err());
    }

    #[test]
    fn a_key_of_another_algorithm_is_not_presented() {
        let key = KeyPair::generate_for(&rcgen::PKCS_ED25519).unwrap();
        assert!(matches!(
            embed(key, b"document", ATTESTATION_OID),
            Err(CertError::KeyAlgorithm)
        ));
    }
}
