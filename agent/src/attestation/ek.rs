//! Endorsement-key trust: the EK certificate must be issued by a configured
//! CA (for QEMU, the swtpm local CA; in a cloud, the vTPM vendor's CA) and
//! certify exactly the EK public key the document carries.

use x509_parser::prelude::{FromDer, X509Certificate};
use x509_parser::public_key::PublicKey as CertKey;

use super::tpm_wire::{Public, PublicKey};

/// Why an endorsement key is not trusted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EkError {
    /// The CA bundle holds no usable certificate.
    #[error("no trusted EK CA certificate configured")]
    NoAnchors,
    /// The document has no EK certificate.
    #[error("the document carries no EK certificate")]
    NoCertificate,
    /// The EK certificate does not parse.
    #[error("EK certificate does not parse")]
    Parse,
    /// No configured CA issued the EK certificate.
    #[error("EK certificate issuer {0:?} is not a trusted EK CA")]
    UntrustedIssuer(String),
    /// The certificate's signature does not verify with the CA's key.
    #[error("EK certificate signature does not verify with the CA key")]
    Signature,
    /// The certificate is outside its validity period.
    #[error("EK certificate is not valid at this time")]
    Validity,
    /// The certificate certifies another key than the document's EK.
    #[error("EK certificate is for another key than the endorsement key in the document")]
    KeyMismatch,
}

/// The CAs trusted to issue EK certificates.
#[derive(Clone, Debug, Default)]
pub struct EkTrust {
    anchors: Vec<Vec<u8>>,
}

impl EkTrust {
    /// Reads every certificate of a PEM bundle. The certificate that signs
    /// EK certificates must be in it (an intermediate is trusted as given).
    pub fn from_pem(pem: &[u8]) -> Result<Self, EkError> {
        let anchors: Vec<Vec<u8>> = x509_parser::pem::Pem::iter_from_buffer(pem)
            .filter_map(Result::ok)
            .filter(|p| p.label == "CERTIFICATE")
            .filter(|p| X509Certificate::from_der(&p.contents).is_ok())
            .map(|p| p.contents)
            .collect();
        if anchors.is_empty() {
            return Err(EkError::NoAnchors);
        }
        Ok(Self { anchors })
    }

    /// Checks that `cert_der` was issued by a trusted CA, is valid now and
    /// certifies `ek`.
    pub fn verify(&self, cert_der: &[u8], ek: &Public) -> Result<(), EkError> {
        if cert_der.is_empty() {
            return Err(EkError::NoCertificate);
        }
        let (_, cert) = X509Certificate::from_der(cert_der).map_err(|_| EkError::Parse)?;
        let issuer = self
            .anchors
            .iter()
            .filter_map(|der| X509Certificate::from_der(der).ok().map(|(_, c)| c))
            .find(|ca| ca.subject() == cert.issuer())
            .ok_or_else(|| EkError::UntrustedIssuer(cert.issuer().to_string()))?;
        cert.verify_signature(Some(issuer.public_key()))
            .map_err(|_| EkError::Signature)?;
        if !cert.validity().is_valid() {
            return Err(EkError::Validity);
        }
        let PublicKey::Rsa { modulus, .. } = &ek.key else {
            return Err(EkError::KeyMismatch);
        };
        match cert.public_key().parsed() {
            Ok(CertKey::RSA(rsa)) if strip_zeros(rsa.modulus) == strip_zeros(modulus) => Ok(()),
            _ => Err(EkError::KeyMismatch),
        }
    }
}

fn strip_zeros(v: &[u8]) -> &[u8] {
    let first = v.iter().position(|&b| b != 0).unwrap_or(v.len());
    &v[first..]
}
