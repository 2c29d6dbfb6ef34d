//! A validator that can be replaced at run time, e.g. when the measurements
//! file changes, without touching established connections.

use std::sync::{Arc, PoisonError, RwLock};

use crate::attestation::{ValidationError, Validator};

/// Holds the current validator and lets it be replaced while handshakes run.
///
/// Each handshake takes a snapshot of the current validator as it starts
/// ([`Validator::for_one_handshake`]) and runs on it to the end, from the
/// peer's document to its residency challenge and record: the old one or
/// the new one, never a mix. Replacing it affects the handshakes that
/// start afterwards; established connections are not touched.
///
/// Only ever give it a validator that was built successfully: the caller
/// parses and checks a new measurements file and builds the new validator
/// first, so a bad file never reaches this type and the old validator stays.
pub struct SwappableValidator<V> {
    current: RwLock<Arc<V>>,
}

impl<V> std::fmt::Debug for SwappableValidator<V> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SwappableValidator").finish_non_exhaustive()
    }
}

impl<V: Validator> SwappableValidator<V> {
    /// Starts with `validator`.
    pub fn new(validator: V) -> Self {
        Self {
            current: RwLock::new(Arc::new(validator)),
        }
    }

    /// The validator new handshakes use now.
    pub fn current(&self) -> Arc<V> {
        // The lock only guards an `Arc` swap, which cannot be left half done:
        // a poisoned lock still holds a whole value.
        self.current
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Makes `validator` the one later validations use, and returns the
    /// previous one.
    pub fn replace(&self, validator: V) -> Arc<V> {
        let mut current = self.current.write().unwrap_or_else(PoisonError::into_inner);
        std::mem::replace(&mut *current, Arc::new(validator))
    }
}

impl<V: Validator> Validator for SwappableValidator<V> {
    type Claims = V::Claims;

    fn validate(
        &self,
        document: &[u8],
        nonce: &[u8],
        user_data: &[u8],
    ) -> Result<Self::Claims, ValidationError> {
        self.current().validate(document, nonce, user_data)
    }

    fn residency_challenge(
        &self,
        claims: &Self::Claims,
    ) -> Result<Option<crate::Challenge>, ValidationError> {
        self.current().residency_challenge(claims)
    }

    fn residency_proven(&self, claims: &Self::Claims) {
        self.current().residency_proven(claims)
    }

    fn for_one_handshake(&self) -> Option<crate::DynValidator<Self::Claims>> {
        Some(self.current())
    }
}
