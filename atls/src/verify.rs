//! The rustls certificate verifiers that run aTLS validation inside the
//! handshake, one instance per handshake.
//!
//! Both directions share [`PeerCheck`]: it holds the nonce this side sent and
//! the validator snapshot for this handshake, checks the presented
//! certificate ([`cert::extract`]), runs the validator, and keeps the outcome
//! so the connection code can report the precise reason of a failure, or hand
//! the validated [`Attested`] peer to the application. The TLS 1.3
//! handshake signature is checked against the subject public key info that
//! the same parser read from the same certificate and hashed into the user
//! data ([`cert::public_key_info`]), which proves the peer holds the key
//! the document is bound to.

use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, ServerName, SubjectPublicKeyInfoDer, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{CertificateError, DigitallySignedStruct, DistinguishedName, SignatureScheme};

use crate::attestation::{Attested, DynValidator, ValidationError};
use crate::cert::{self, PeerCertError};
use crate::nonce::Nonce;

/// Why a peer's certificate was not accepted.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PeerError {
    /// The peer sent intermediates: an attested certificate stands alone.
    #[error("the peer sent a certificate chain; aTLS expects one self-signed certificate")]
    UnexpectedChain,
    /// The certificate is not a well-formed attested certificate.
    #[error(transparent)]
    Certificate(#[from] PeerCertError),
    /// The validator refused the attestation document.
    #[error(transparent)]
    Validation(#[from] ValidationError),
}

impl PeerError {
    /// The TLS alert this failure sends: `bad_certificate` for a malformed
    /// certificate, `access_denied` for a document the validator refused.
    fn to_rustls(&self) -> rustls::Error {
        rustls::Error::InvalidCertificate(match self {
            Self::Validation(_) => CertificateError::ApplicationVerificationFailure,
            Self::UnexpectedChain | Self::Certificate(_) => CertificateError::BadEncoding,
        })
    }
}

type Outcome<C> = Result<Arc<Attested<C>>, PeerError>;

/// Validation of one peer certificate in one handshake.
pub(crate) struct PeerCheck<C> {
    validator: DynValidator<C>,
    nonce: Nonce,
    outcome: Mutex<Option<Outcome<C>>>,
}

impl<C: Send + Sync + 'static> PeerCheck<C> {
    /// The check of one handshake's peer, by `validator` as it is now
    /// ([`crate::Validator::for_one_handshake`]): the validator that
    /// validates the peer is the one that challenges it.
    pub(crate) fn new(validator: DynValidator<C>, nonce: Nonce) -> Self {
        Self {
            validator: validator.for_one_handshake().unwrap_or(validator),
            nonce,
            outcome: Mutex::new(None),
        }
    }

    /// The validator of this handshake.
    pub(crate) fn validator(&self) -> &DynValidator<C> {
        &self.validator
    }

    pub(crate) fn nonce(&self) -> &Nonce {
        &self.nonce
    }

    /// The outcome of the check, if rustls ran it.
    pub(crate) fn take(&self) -> Option<Outcome<C>> {
        self.outcome
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
    }

    fn verify(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
    ) -> Result<(), rustls::Error> {
        let outcome = self.run(end_entity, intermediates);
        let result = match &outcome {
            Ok(_) => Ok(()),
            Err(e) => Err(e.to_rustls()),
        };
        *self.outcome.lock().unwrap_or_else(PoisonError::into_inner) = Some(outcome);
        result
    }

    fn run(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
    ) -> Outcome<C> {
        if !intermediates.is_empty() {
            return Err(PeerError::UnexpectedChain);
        }
        let embedded =
            tracing::debug_span!("atls.peer_certificate").in_scope(|| cert::extract(end_entity))?;
        let claims = crate::blocking::run(|| {
            self.validator.validate(
                &embedded.document,
                self.nonce.as_bytes(),
                &embedded.user_data,
            )
        })?;
        Ok(Arc::new(Attested::new(embedded.document, claims)))
    }
}

fn tls13_signature(
    provider: &CryptoProvider,
    message: &[u8],
    cert: &CertificateDer<'_>,
    dss: &DigitallySignedStruct,
) -> Result<HandshakeSignatureValid, rustls::Error> {
    let spki = cert::public_key_info(cert)
        .map_err(|_| rustls::Error::InvalidCertificate(CertificateError::BadEncoding))?;
    rustls::crypto::verify_tls13_signature_with_raw_key(
        message,
        &SubjectPublicKeyInfoDer::from(spki),
        dss,
        &provider.signature_verification_algorithms,
    )
}

fn no_tls12() -> rustls::Error {
    rustls::Error::PeerIncompatible(rustls::PeerIncompatible::Tls12NotOfferedOrEnabled)
}

/// The client's verifier of the server's certificate.
pub(crate) struct ServerVerifier<C> {
    provider: Arc<CryptoProvider>,
    /// `None`: this client does not validate the server (client-attested
    /// mode); the handshake signature is still checked.
    check: Option<Arc<PeerCheck<C>>>,
    /// Let the handshake finish when the check fails (the failure stays in
    /// the check's outcome and the client refuses the connection after the
    /// handshake): in mutual mode, so that the server also judges this
    /// client and its log names its own reason.
    defer_refusal: bool,
}

impl<C> ServerVerifier<C> {
    pub(crate) fn new(
        provider: Arc<CryptoProvider>,
        check: Option<Arc<PeerCheck<C>>>,
        defer_refusal: bool,
    ) -> Self {
        Self {
            provider,
            check,
            defer_refusal,
        }
    }
}

impl<C> fmt::Debug for ServerVerifier<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServerVerifier")
            .field("validates", &self.check.is_some())
            .field("defer_refusal", &self.defer_refusal)
            .finish_non_exhaustive()
    }
}

impl<C: Send + Sync + 'static> ServerCertVerifier for ServerVerifier<C> {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        if let Some(check) = &self.check {
            match check.verify(end_entity, intermediates) {
                // Recorded in the check's outcome; the client refuses later.
                Err(_) if self.defer_refusal => {}
                result => result?,
            }
        }
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        _message: &[u8],
        _cert: &CertificateDer<'_>,
        _dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        Err(no_tls12())
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        tls13_signature(&self.provider, message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// The server's verifier of the client's certificate. It also carries the
/// server's nonce to the client, as the only acceptable-CA name.
pub(crate) struct ClientVerifier<C> {
    provider: Arc<CryptoProvider>,
    check: Arc<PeerCheck<C>>,
    hints: Vec<DistinguishedName>,
}

impl<C: Send + Sync + 'static> ClientVerifier<C> {
    pub(crate) fn new(provider: Arc<CryptoProvider>, check: Arc<PeerCheck<C>>) -> Self {
        let hints = vec![check.nonce().to_distinguished_name()];
        Self {
            provider,
            check,
            hints,
        }
    }
}

impl<C> fmt::Debug for ClientVerifier<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClientVerifier").finish_non_exhaustive()
    }
}

impl<C: Send + Sync + 'static> ClientCertVerifier for ClientVerifier<C> {
    fn offer_client_auth(&self) -> bool {
        true
    }

    fn client_auth_mandatory(&self) -> bool {
        true
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &self.hints
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        self.check.verify(end_entity, intermediates)?;
        Ok(ClientCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        _message: &[u8],
        _cert: &CertificateDer<'_>,
        _dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        Err(no_tls12())
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        tls13_signature(&self.provider, message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use p256::ecdsa::signature::hazmat::PrehashSigner as _;
    use p256::pkcs8::DecodePrivateKey as _;
    use ring::signature::{EcdsaKeyPair, ECDSA_P256_SHA256_ASN1_SIGNING};
    use rustls::internal::msgs::codec::Codec as _;
    use sha2::Digest as _;

    /// A handshake signature as it arrives on the wire.
    fn signed(scheme: SignatureScheme, signature: &[u8]) -> DigitallySignedStruct {
        let mut wire = u16::from(scheme).to_be_bytes().to_vec();
        wire.extend_from_slice(&u16::try_from(signature.len()).unwrap().to_be_bytes());
        wire.extend_from_slice(signature);
        DigitallySignedStruct::read_bytes(&wire).unwrap()
    }

    #[test]
    fn only_p256_with_sha256_is_offered_and_verified() {
        let key = cert::generate_key().unwrap();
        let pkcs8 = key.serialize_der();
        let certified = cert::embed(key, b"document", cert::ATTESTATION_OID).unwrap();
        let cert = &certified.cert[0];
        let rng = ring::rand::SystemRandom::new();
        let sha256 = EcdsaKeyPair::from_pkcs8(&ECDSA_P256_SHA256_ASN1_SIGNING, &pkcs8, &rng)
            .unwrap()
            .sign(&rng, b"transcript")
            .unwrap();
        let provider = crate::provider();
        let good = signed(SignatureScheme::ECDSA_NISTP256_SHA256, sha256.as_ref());
        assert!(tls13_signature(&provider, b"transcript", cert, &good).is_ok());
        assert!(tls13_signature(&provider, b"transcripT", cert, &good).is_err());
        // The same key hashing with SHA-384, under the scheme TLS 1.3 ties
        // to P-384: refused.
        let p256_key = p256::ecdsa::SigningKey::from_pkcs8_der(&pkcs8).unwrap();
        let over_sha384: p256::ecdsa::Signature = p256_key
            .sign_prehash(&sha2::Sha384::digest(b"transcript"))
            .unwrap();
        let sha384 = signed(
            SignatureScheme::ECDSA_NISTP384_SHA384,
            over_sha384.to_der().as_bytes(),
        );
        assert!(tls13_signature(&provider, b"transcript", cert, &sha384).is_err());
        assert_eq!(
            provider
                .signature_verification_algorithms
                .supported_schemes(),
            [SignatureScheme::ECDSA_NISTP256_SHA256]
        );
    }
}
