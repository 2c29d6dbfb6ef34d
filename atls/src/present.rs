//! How a side makes the certificate it presents in one handshake.

use std::sync::Arc;

use rustls::sign::CertifiedKey;

use crate::attestation::DynIssuer;
use crate::cert::{self, CertError};
#[cfg(feature = "danger")]
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
    /// A certificate made by test code (the `danger` feature); residency
    /// challenges go to the issuer the side had before, if any.
    #[cfg(feature = "danger")]
    Custom(PresentFn, Option<DynIssuer>),
}

impl Presenter {
    /// The issuer that answers key residency challenges for the documents
    /// this side presents; `None` when it presents no genuine attestation.
    pub(crate) fn prover(&self) -> Option<DynIssuer> {
        match self {
            Self::Attest(issuer) => Some(issuer.clone()),
            #[cfg(feature = "danger")]
            Self::Custom(_, prover) => prover.clone(),
            Self::Unattested => None,
        }
    }

    /// The certificate for a handshake in which the peer sent `nonce`.
    pub(crate) fn present(&self, nonce: &Nonce) -> Result<Arc<CertifiedKey>, CertError> {
        match self {
            Self::Attest(issuer) => cert::issue(issuer.as_ref(), nonce.as_bytes()),
            Self::Unattested => cert::unattested(),
            #[cfg(feature = "danger")]
            Self::Custom(present, _) => present(nonce),
        }
    }
}
