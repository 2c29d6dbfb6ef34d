//! SHA-256 digests in the `sha256:<64 lowercase hex>` form the component
//! lists use. A [`Sha256Digest`] always holds a real digest: there is no empty
//! or "unknown" value, so a component cannot be installed unchecked.

use std::fmt;
use std::io::{self, Read};
use std::str::FromStr;

use sha2::{Digest as _, Sha256};

/// The algorithm prefix of the textual form.
const PREFIX: &str = "sha256:";

/// A SHA-256 digest, written `sha256:<64 lowercase hex>`.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Sha256Digest([u8; 32]);

/// Why a digest string was refused. The messages are constant: the refused
/// text is not echoed back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ParseDigestError {
    /// The string is empty: every component needs a hash.
    #[error("the hash is empty; every component needs a sha256:<hex> hash")]
    Empty,
    /// The string does not start with `sha256:`.
    #[error("the hash does not start with \"sha256:\"")]
    Algorithm,
    /// The hex part is not 64 lowercase hex digits.
    #[error("the hash is not 64 lowercase hex digits after \"sha256:\"")]
    Hex,
}

impl Sha256Digest {
    /// Wraps raw digest bytes.
    pub const fn from_bytes(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }

    /// The digest of `data`.
    pub fn of(data: &[u8]) -> Self {
        Self(Sha256::digest(data).into())
    }

    /// The digest a finished hasher holds.
    pub fn from_hasher(hasher: Sha256) -> Self {
        Self(hasher.finalize().into())
    }

    /// The raw digest bytes.
    pub const fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// The lowercase hex of the digest, without the `sha256:` prefix.
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }
}

impl FromStr for Sha256Digest {
    type Err = ParseDigestError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.is_empty() {
            return Err(ParseDigestError::Empty);
        }
        let hex_part = s.strip_prefix(PREFIX).ok_or(ParseDigestError::Algorithm)?;
        // Lowercase only: one digest, one spelling (it is measured as text).
        if hex_part.len() != 64
            || !hex_part
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        {
            return Err(ParseDigestError::Hex);
        }
        let mut bytes = [0u8; 32];
        hex::decode_to_slice(hex_part, &mut bytes).map_err(|_| ParseDigestError::Hex)?;
        Ok(Self(bytes))
    }
}

impl fmt::Display for Sha256Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{PREFIX}{}", self.to_hex())
    }
}

/// In serde, as its text form (the one spelling [`FromStr`] takes).
impl serde::Serialize for Sha256Digest {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for Sha256Digest {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = <std::borrow::Cow<'de, str>>::deserialize(deserializer)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

impl fmt::Debug for Sha256Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// A reader that hashes what it reads: whatever reads through it, the
/// digest is of exactly the bytes handed on.
pub(crate) struct HashingReader<R> {
    inner: R,
    hasher: Sha256,
}

impl<R: Read> HashingReader<R> {
    pub(crate) fn new(inner: R) -> Self {
        Self {
            inner,
            hasher: Sha256::new(),
        }
    }

    /// The digest of what was read so far.
    pub(crate) fn digest(self) -> Sha256Digest {
        Sha256Digest::from_hasher(self.hasher)
    }
}

impl<R: Read> Read for HashingReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.hasher.update(buf.get(..n).unwrap_or_default());
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const EMPTY_SHA256: &str =
        "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";

    #[test]
    fn parses_and_prints_the_canonical_form() {
        let d: Sha256Digest = EMPTY_SHA256.parse().unwrap();
        assert_eq!(d, Sha256Digest::of(b""));
        assert_eq!(d.to_string(), EMPTY_SHA256);
    }

    #[test]
    fn refuses_everything_else() {
        let upper = EMPTY_SHA256.to_uppercase().replace("SHA256:", "sha256:");
        let cases = [
            ("", ParseDigestError::Empty),
            ("sha256:", ParseDigestError::Hex),
            ("sha512:00", ParseDigestError::Algorithm),
            (
                "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
                ParseDigestError::Algorithm,
            ),
            (
                &EMPTY_SHA256[..EMPTY_SHA256.len() - 1],
                ParseDigestError::Hex,
            ),
            (&upper, ParseDigestError::Hex),
        ];
        for (input, want) in cases {
            assert_eq!(input.parse::<Sha256Digest>(), Err(want), "{input:?}");
        }
        let long = format!("{EMPTY_SHA256}0");
        assert_eq!(long.parse::<Sha256Digest>(), Err(ParseDigestError::Hex));
        let non_hex = EMPTY_SHA256.replace('e', "g");
        assert_eq!(non_hex.parse::<Sha256Digest>(), Err(ParseDigestError::Hex));
    }
}
