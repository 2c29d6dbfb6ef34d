//! The two roles aTLS is generic over: an [`Issuer`] that produces attestation
//! documents and a [`Validator`] that checks them, plus what a successful
//! validation yields ([`Attested`]) and the key-residency [`Challenge`] a
//! validator sends before anything trusts the document's signing key.
//!
//! Both traits are synchronous on purpose: a real issuer talks to a TPM and a
//! real validator may read certificates and replay event logs. This crate runs
//! them off the async workers (see [`crate::blocking`]).

use std::error::Error as StdError;
use std::sync::Arc;

use zeroize::Zeroizing;

/// Length of the secret a residency challenge hides.
pub const RESIDENCY_SECRET_LEN: usize = 32;

/// The secret of a residency challenge, as the prover recovers it.
pub type ResidencySecret = Zeroizing<[u8; RESIDENCY_SECRET_LEN]>;

/// A boxed error from an issuer or validator implementation.
pub type BoxError = Box<dyn StdError + Send + Sync + 'static>;

/// Produces attestation documents, e.g. a TPM quote with its evidence.
///
/// A document must bind both inputs: `nonce` is the fresh value the verifying
/// peer sent for this handshake, `user_data` is SHA-256 of the
/// SubjectPublicKeyInfo of the certificate that will carry the document.
pub trait Issuer: Send + Sync + 'static {
    /// Returns an opaque attestation document over `nonce` and `user_data`.
    ///
    /// Called once per handshake in which this side attests; may block.
    fn issue(&self, nonce: &[u8], user_data: &[u8]) -> Result<Vec<u8>, IssueError>;

    /// Recovers the secret of a residency challenge a validator made for the
    /// key that signed this side's documents (for a TPM:
    /// TPM2_ActivateCredential with the endorsement and attestation keys).
    /// Only the holder of that key can; may block.
    fn answer(&self, challenge: &[u8]) -> Result<ResidencySecret, IssueError>;
}

/// Checks attestation documents and says what they establish.
///
/// Implementations must check that the document is genuine (signed by a key
/// they trust), that it binds exactly `nonce` (the value this side sent for the
/// handshake) and `user_data` (SHA-256 of the presenting certificate's
/// SubjectPublicKeyInfo, recomputed by this crate from the certificate), and
/// that what it reports is acceptable.
pub trait Validator: Send + Sync + 'static {
    /// What a successful validation establishes about the peer, e.g. its
    /// attestation key and measured values. Handed to the application in
    /// [`Attested::claims`].
    type Claims: Send + Sync + 'static;

    /// Validates `document` for this handshake; may block.
    fn validate(
        &self,
        document: &[u8],
        nonce: &[u8],
        user_data: &[u8],
    ) -> Result<Self::Claims, ValidationError>;

    /// A challenge that only the holder of the key behind `claims` can
    /// answer, proving that key lives where the document says (for a TPM:
    /// TPM2_MakeCredential to the certified endorsement key and the
    /// attestation key's name). `None` only when this validator has already
    /// seen that exact key proven ([`Validator::residency_proven`]). No
    /// connection is handed to the application before the answer checks out.
    fn residency_challenge(
        &self,
        claims: &Self::Claims,
    ) -> Result<Option<Challenge>, ValidationError>;

    /// Called once the peer answered this validator's challenge for
    /// `claims` correctly; a validator may remember the proof, bounded.
    fn residency_proven(&self, claims: &Self::Claims);

    /// The validator that checks one handshake's peer, from its document
    /// to its residency record. `None` (the default): this one. A validator
    /// that may be replaced meanwhile ([`crate::SwappableValidator`]) gives
    /// the one in force as the handshake starts, so that no handshake is
    /// validated by one and challenged by another.
    fn for_one_handshake(&self) -> Option<DynValidator<Self::Claims>> {
        None
    }
}

impl<V: Validator + ?Sized> Validator for Arc<V> {
    type Claims = V::Claims;

    fn validate(
        &self,
        document: &[u8],
        nonce: &[u8],
        user_data: &[u8],
    ) -> Result<Self::Claims, ValidationError> {
        (**self).validate(document, nonce, user_data)
    }

    fn residency_challenge(
        &self,
        claims: &Self::Claims,
    ) -> Result<Option<Challenge>, ValidationError> {
        (**self).residency_challenge(claims)
    }

    fn residency_proven(&self, claims: &Self::Claims) {
        (**self).residency_proven(claims)
    }

    fn for_one_handshake(&self) -> Option<DynValidator<Self::Claims>> {
        (**self).for_one_handshake()
    }
}

impl<I: Issuer + ?Sized> Issuer for Arc<I> {
    fn issue(&self, nonce: &[u8], user_data: &[u8]) -> Result<Vec<u8>, IssueError> {
        (**self).issue(nonce, user_data)
    }

    fn answer(&self, challenge: &[u8]) -> Result<ResidencySecret, IssueError> {
        (**self).answer(challenge)
    }
}

/// A key-residency challenge: the message the peer's issuer must answer, and
/// the secret only the holder of the attested key can recover from it.
pub struct Challenge {
    message: Vec<u8>,
    secret: ResidencySecret,
}

impl Challenge {
    /// A challenge whose `message` hides `secret`.
    pub fn new(message: Vec<u8>, secret: ResidencySecret) -> Self {
        Self { message, secret }
    }

    /// What goes to the peer.
    pub fn message(&self) -> &[u8] {
        &self.message
    }

    pub(crate) fn secret(&self) -> &[u8; RESIDENCY_SECRET_LEN] {
        &self.secret
    }
}

impl std::fmt::Debug for Challenge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Challenge")
            .field("message_len", &self.message.len())
            .finish_non_exhaustive()
    }
}

/// A validator as the TLS configurations hold it.
pub type DynValidator<C> = Arc<dyn Validator<Claims = C>>;

/// An issuer as the TLS configurations hold it.
pub type DynIssuer = Arc<dyn Issuer>;

/// The peer of a connection, validated: the document it presented and what the
/// validator established from it.
#[derive(Debug)]
pub struct Attested<C> {
    document: Vec<u8>,
    claims: C,
    validated: std::time::Instant,
}

impl<C> Attested<C> {
    pub(crate) fn new(document: Vec<u8>, claims: C) -> Self {
        Self {
            document,
            claims,
            validated: std::time::Instant::now(),
        }
    }

    /// How long ago the validator judged the document: the claims are the
    /// policy of that moment, which a long-lived connection outlives.
    pub fn age(&self) -> std::time::Duration {
        self.validated.elapsed()
    }

    /// The attestation document exactly as the peer presented it.
    pub fn document(&self) -> &[u8] {
        &self.document
    }

    /// What the validator established from the document.
    pub fn claims(&self) -> &C {
        &self.claims
    }
}

/// An issuer could not produce a document.
#[derive(Debug, thiserror::Error)]
#[error("issuing the attestation document failed")]
pub struct IssueError(#[source] BoxError);

impl IssueError {
    /// Wraps the issuer's own error.
    pub fn new(source: impl Into<BoxError>) -> Self {
        Self(source.into())
    }
}

/// Why a validator refused a document.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ValidationError {
    /// The document binds another nonce: it was made for another handshake
    /// (a replay).
    #[error("nonce mismatch: the document was issued for another handshake")]
    NonceMismatch,
    /// The document binds another key: it was moved from another certificate.
    #[error("key binding mismatch: the document was issued for another TLS key")]
    KeyBindingMismatch,
    /// The document could not be decoded.
    #[error("malformed attestation document")]
    Malformed(#[source] BoxError),
    /// The document is well formed and fresh but not acceptable: untrusted
    /// signer, bad signature, unexpected measurements, ...
    #[error("attestation document rejected")]
    Rejected(#[source] BoxError),
}

impl ValidationError {
    /// A decoding failure with the validator's own error as source.
    pub fn malformed(source: impl Into<BoxError>) -> Self {
        Self::Malformed(source.into())
    }

    /// A policy or trust failure with the validator's own error as source.
    pub fn rejected(source: impl Into<BoxError>) -> Self {
        Self::Rejected(source.into())
    }
}

/// Displays an error with its whole `source()` chain as `a: b: c`, for logs.
pub struct ErrorChain<'a>(pub &'a (dyn StdError + 'static));

impl std::fmt::Display for ErrorChain<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)?;
        let mut next = self.0.source();
        while let Some(e) = next {
            write!(f, ": {e}")?;
            next = e.source();
        }
        Ok(())
    }
}
