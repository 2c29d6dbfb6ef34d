//! How a side makes the certificate it presents in one handshake.

use std::sync::Arc;

use rustls::crypto::CryptoProvider;
use rustls::sign::CertifiedKey;

use crate::attestation::DynIssuer;
use crate::cert::{self, CertError};
use crate::danger::PresentFn;
use crate::nonce::Nonce;

/// The certificate source of one side.
#[derive(Clone)]
pub(crate) enum Presenter {
    /// A fresh key and a certificate with a document from the issuer.
    Attest(DynIssuer),
    /// A fresh key and a certificate without attestation (a server whose
    /// clients do not validate it).
    Unattested,
    /// A certificate made by test code (see [`crate::danger`]).
    Custom(PresentFn),
}

impl Presenter {
    /// The certificate for a handshake in which the peer sent `nonce`.
    pub(crate) fn present(
        &self,
        nonce: &Nonce,
        provider: &CryptoProvider,
    ) -> Result<Arc<CertifiedKey>, CertError> {
        match self {
            Self::Attest(issuer) => cert::issue(issuer.as_ref(), nonce.as_bytes(), provider),
            Self::Unattested => cert::unattested(provider),
            Self::Custom(present) => present(nonce),
        }
    }
}
