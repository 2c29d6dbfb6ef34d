//! PCR extension and the modelled events behind a predicted value.

use std::fmt;

use sha2::{Digest as _, Sha256};

/// A SHA-256 digest: a PCR value or an event digest.
pub type Digest = [u8; 32];

/// One measurement into a PCR: `digest` was extended, for `description`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Event {
    /// What was measured, for humans (e.g. `UKI section .linux (content)`).
    pub description: String,
    /// The extended digest.
    pub digest: Digest,
}

impl Event {
    /// An event measuring `data` (its SHA-256 is extended).
    pub fn of_data(description: impl Into<String>, data: &[u8]) -> Self {
        Self {
            description: description.into(),
            digest: Sha256::digest(data).into(),
        }
    }

    /// An event extending a digest computed elsewhere.
    pub fn of_digest(description: impl Into<String>, digest: Digest) -> Self {
        Self {
            description: description.into(),
            digest,
        }
    }
}

impl fmt::Display for Event {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", hex::encode(self.digest), self.description)
    }
}

/// `SHA-256(pcr || digest)`: the TPM's extend operation.
pub fn extend(pcr: &Digest, digest: &Digest) -> Digest {
    let mut hash = Sha256::new();
    hash.update(pcr);
    hash.update(digest);
    hash.finalize().into()
}

/// The value of a PCR that starts at zero and is extended with `events` in
/// order.
pub fn replay(events: &[Event]) -> Digest {
    events
        .iter()
        .fold([0u8; 32], |pcr, event| extend(&pcr, &event.digest))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replay_of_nothing_is_zero() {
        assert_eq!(replay(&[]), [0u8; 32]);
    }

    #[test]
    fn replay_extends_in_order() {
        let a = Event::of_data("a", b"a");
        let b = Event::of_data("b", b"b");
        let ab = replay(&[a.clone(), b.clone()]);
        assert_eq!(ab, extend(&extend(&[0; 32], &a.digest), &b.digest));
        assert_ne!(ab, replay(&[b, a]));
    }

    #[test]
    fn extend_matches_a_known_value() {
        // SHA-256 of 64 zero bytes: extending zero with zero.
        assert_eq!(
            hex::encode(extend(&[0; 32], &[0; 32])),
            "f5a5fd42d16a20302798ef6ed309979b43003d2320d9f0e8ea9831a92759fb4b"
        );
    }
}
