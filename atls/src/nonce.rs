//! Per-handshake nonces and how they travel inside the TLS handshake.
//!
//! - Client → server: in the ClientHello's server name (SNI), as DNS labels
//!   `<32 hex>.<32 hex>.atls`. A DNS label holds at most 63 characters, so the
//!   64 hex digits are split in two; the last label is not numeric because
//!   rustls refuses names whose last label is all digits (they look like IP
//!   addresses). The server sees the name lowercased, hence lowercase hex.
//! - Server → client: in the TLS 1.3 CertificateRequest's
//!   `certificate_authorities` extension, as one distinguished name
//!   `CN=<64 hex>`.

use rustls::crypto::SecureRandom;
use rustls::DistinguishedName;
use x509_parser::prelude::{FromDer, X509Name};

/// Length of a nonce in bytes.
pub const NONCE_LEN: usize = 32;

/// The last DNS label of a nonce carried in the SNI.
pub const SNI_SUFFIX: &str = "atls";

const HEX_LEN: usize = NONCE_LEN * 2;
const LABEL_LEN: usize = HEX_LEN / 2;

/// A fresh random value a verifier sends for one handshake; the peer's
/// attestation document must bind it.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Nonce([u8; NONCE_LEN]);

impl std::fmt::Debug for Nonce {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Nonce({})", hex::encode(self.0))
    }
}

impl Nonce {
    /// Draws a nonce from `rng` (the crypto provider's secure random source).
    pub fn generate(rng: &dyn SecureRandom) -> Result<Self, NonceError> {
        let mut bytes = [0u8; NONCE_LEN];
        rng.fill(&mut bytes).map_err(|_| NonceError::Random)?;
        Ok(Self(bytes))
    }

    /// The nonce's bytes, as handed to issuers and validators.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    /// The server name that carries this nonce in a ClientHello.
    pub fn to_server_name(&self) -> String {
        let hex = hex::encode(self.0);
        let (first, second) = hex.split_at(LABEL_LEN);
        format!("{first}.{second}.{SNI_SUFFIX}")
    }

    /// Reads a nonce from the server name of a ClientHello.
    pub fn from_server_name(name: &str) -> Result<Self, NonceError> {
        let mut labels = name.split('.');
        let (Some(first), Some(second), Some(SNI_SUFFIX), None) =
            (labels.next(), labels.next(), labels.next(), labels.next())
        else {
            return Err(NonceError::ServerNameShape);
        };
        if first.len() != LABEL_LEN || second.len() != LABEL_LEN {
            return Err(NonceError::ServerNameShape);
        }
        let mut bytes = [0u8; NONCE_LEN];
        let (a, b) = bytes.split_at_mut(NONCE_LEN / 2);
        hex::decode_to_slice(first, a).map_err(|_| NonceError::ServerNameShape)?;
        hex::decode_to_slice(second, b).map_err(|_| NonceError::ServerNameShape)?;
        Ok(Self(bytes))
    }

    /// The distinguished name `CN=<hex>` that carries this nonce in a
    /// CertificateRequest.
    pub fn to_distinguished_name(&self) -> DistinguishedName {
        // RDNSequence contents: SET { SEQUENCE { OID 2.5.4.3, UTF8String } }.
        const CN_OID: [u8; 5] = [0x06, 0x03, 0x55, 0x04, 0x03];
        let hex = hex::encode(self.0);
        let value_len = CN_OID.len() + 2 + hex.len(); // 71
        let mut der = Vec::with_capacity(value_len + 4);
        der.extend_from_slice(&[0x31, der_len(value_len + 2), 0x30, der_len(value_len)]);
        der.extend_from_slice(&CN_OID);
        der.extend_from_slice(&[0x0c, der_len(hex.len())]);
        der.extend_from_slice(hex.as_bytes());
        DistinguishedName::in_sequence(&der)
    }

    /// Reads a nonce from the acceptable-CA names of a CertificateRequest:
    /// exactly one of them must be `CN=<64 hex>`.
    pub fn from_distinguished_names(names: &[&[u8]]) -> Result<Self, NonceError> {
        let mut found = None;
        for der in names {
            let Some(nonce) = Self::from_distinguished_name(der) else {
                continue;
            };
            if found.replace(nonce).is_some() {
                return Err(NonceError::SeveralInCertificateRequest);
            }
        }
        found.ok_or(NonceError::MissingInCertificateRequest)
    }

    fn from_distinguished_name(der: &[u8]) -> Option<Self> {
        let (rest, name) = X509Name::from_der(der).ok()?;
        if !rest.is_empty() || name.iter_attributes().count() != 1 {
            return None;
        }
        let cn = name.iter_common_name().next()?.as_str().ok()?;
        if cn.len() != HEX_LEN {
            return None;
        }
        let mut bytes = [0u8; NONCE_LEN];
        hex::decode_to_slice(cn, &mut bytes).ok()?;
        Some(Self(bytes))
    }
}

/// One-byte DER length for the short, fixed lengths used here (< 128).
const fn der_len(len: usize) -> u8 {
    debug_assert!(len < 0x80);
    len as u8
}

/// A nonce could not be made or read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NonceError {
    /// The random source failed.
    #[error("drawing a random nonce failed")]
    Random,
    /// The ClientHello carried no server name.
    #[error("the client sent no nonce (no server name in its ClientHello)")]
    MissingServerName,
    /// The server name is not `<32 hex>.<32 hex>.atls`.
    #[error(
        "the client's server name does not carry a nonce (expected <32 hex>.<32 hex>.{SNI_SUFFIX})"
    )]
    ServerNameShape,
    /// The CertificateRequest named no `CN=<nonce>`.
    #[error("the server sent no nonce in its certificate request")]
    MissingInCertificateRequest,
    /// The CertificateRequest named several nonces.
    #[error("the server sent several nonces in its certificate request")]
    SeveralInCertificateRequest,
}

#[cfg(test)]
#[allow(clippy::expect_used)]
mod tests {
    use super::*;

    fn nonce(byte: u8) -> Nonce {
        Nonce([byte; NONCE_LEN])
    }

    #[test]
    fn server_name_round_trips_and_is_a_valid_dns_name() {
        let n = Nonce(std::array::from_fn(|i| i as u8 * 7));
        let name = n.to_server_name();
        assert!(rustls::pki_types::ServerName::try_from(name.clone()).is_ok());
        assert_eq!(Nonce::from_server_name(&name).ok(), Some(n));
    }

    #[test]
    fn malformed_server_names_are_refused() {
        let good = nonce(0xab).to_server_name();
        for bad in [
            "example.com".to_owned(),
            good.replace(".atls", ".other"),
            format!("{good}.extra"),
            good[1..].to_owned(),
            good.replace('a', "g"),
            String::new(),
        ] {
            assert!(
                matches!(
                    Nonce::from_server_name(&bad),
                    Err(NonceError::ServerNameShape)
                ),
                "{bad} was accepted"
            );
        }
    }

    #[test]
    fn distinguished_name_round_trips() {
        let n = nonce(0x5c);
        let dn = n.to_distinguished_name();
        let (_, parsed) = X509Name::from_der(dn.as_ref()).expect("valid Name");
        assert_eq!(
            parsed.to_string(),
            format!("CN={}", hex::encode([0x5c; 32]))
        );
        assert_eq!(
            Nonce::from_distinguished_names(&[dn.as_ref()]).ok(),
            Some(n)
        );
    }

    #[test]
    fn distinguished_names_need_exactly_one_nonce() {
        let a = nonce(1).to_distinguished_name();
        let b = nonce(2).to_distinguished_name();
        assert!(matches!(
            Nonce::from_distinguished_names(&[]),
            Err(NonceError::MissingInCertificateRequest)
        ));
        assert!(matches!(
            Nonce::from_distinguished_names(&[b"\x30\x00".as_slice()]),
            Err(NonceError::MissingInCertificateRequest)
        ));
        assert!(matches!(
            Nonce::from_distinguished_names(&[a.as_ref(), b.as_ref()]),
            Err(NonceError::SeveralInCertificateRequest)
        ));
    }
}
