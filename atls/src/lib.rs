//! Attested TLS: attestation documents bound to per-handshake TLS keys and
//! verifier nonces.
//!
//! Each side that attests makes a fresh P-256 key and a self-signed
//! certificate per handshake, carrying an attestation document (from an
//! [`Issuer`]) in an X.509 extension. The document binds the nonce the
//! verifying peer sent for this handshake and SHA-256 of the certificate's
//! public key, so it can be neither replayed nor moved to another key. The
//! verifying side checks the certificate and hands the document to a
//! [`Validator`]. The client's nonce travels in the ClientHello's server name,
//! the server's in the CertificateRequest ([`nonce`]).
//!
//! Modes, chosen by constructor on both sides: server-attested
//! ([`AtlsServer::server_attested`], [`AtlsClient::server_attested`]),
//! client-attested and mutual. A side that validates always has a validator:
//! there is no configuration that accepts an unvalidated peer except the
//! modes in which that peer does not attest.
//!
//! TLS 1.3 only, session resumption off on both sides, ring as the crypto
//! provider (passed per configuration; no process-wide default is installed).
//! See `README.md` for the protocol.
#![forbid(unsafe_code)]

mod attestation;
mod blocking;
pub mod cert;
mod client;
#[cfg(feature = "danger")]
pub mod danger;
mod incoming;
pub mod nonce;
mod present;
mod rate;
mod residency;
mod server;
mod stream;
mod swap;
mod verify;

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use rustls::crypto::CryptoProvider;

pub use attestation::{
    Attested, BoxError, Challenge, DynIssuer, DynValidator, ErrorChain, IssueError, Issuer,
    ResidencySecret, ValidationError, Validator, RESIDENCY_SECRET_LEN,
};
pub use cert::{PeerCertError, ATTESTATION_OID};
pub use client::{AtlsClient, BoundChannel, ConnectError};
pub use incoming::{HandshakeStats, Incoming, Source};
pub use nonce::Nonce;
pub use residency::ResidencyError;
pub use server::{AtlsServer, HandshakeError};
pub use stream::{AtlsStream, PeerInfo, Protected};
pub use swap::SwappableValidator;
pub use verify::PeerError;

/// How long a handshake may take by default, on either side.
pub const DEFAULT_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// The crypto provider of every configuration this crate builds: ring's,
/// TLS 1.3 suites only with AES-128-GCM-SHA256 first, P-256 before X25519
/// for the key exchange, and handshake signatures verified only as
/// [`HANDSHAKE_SIGNATURES`] says.
///
/// Both ends of an aTLS connection are keel's, and both speak TLS 1.3 only,
/// so the order only decides cost. ring hashes SHA-256 with the CPU's SHA
/// extensions where it has them, SHA-384 always in software (with ring's
/// default order, AES-256-GCM-SHA384 first, the key schedule and transcript
/// hash took about 5% of a join service's CPU per handshake); its P-256 is
/// assembly with a precomputed base table, and an ephemeral P-256 key
/// exchange costs half of an X25519 one (70 against 140 us here).
fn provider() -> Arc<CryptoProvider> {
    static PROVIDER: OnceLock<Arc<CryptoProvider>> = OnceLock::new();
    PROVIDER
        .get_or_init(|| {
            use rustls::crypto::ring::{cipher_suite, kx_group};
            Arc::new(CryptoProvider {
                cipher_suites: vec![
                    cipher_suite::TLS13_AES_128_GCM_SHA256,
                    cipher_suite::TLS13_AES_256_GCM_SHA384,
                    cipher_suite::TLS13_CHACHA20_POLY1305_SHA256,
                ],
                kx_groups: vec![kx_group::SECP256R1, kx_group::X25519],
                signature_verification_algorithms: HANDSHAKE_SIGNATURES,
                ..rustls::crypto::ring::default_provider()
            })
        })
        .clone()
}

/// The one handshake signature scheme this crate offers and verifies:
/// `ecdsa_secp256r1_sha256`, the only one a keel key signs with (a peer's
/// certificate key is ECDSA P-256, [`cert`] refuses any other). ring's
/// defaults would offer RSA, Ed25519 and P-384 schemes too, which no keel
/// peer uses and every such signature would fail on the key anyway.
static HANDSHAKE_SIGNATURES: rustls::crypto::WebPkiSupportedAlgorithms =
    rustls::crypto::WebPkiSupportedAlgorithms {
        all: &[webpki::ring::ECDSA_P256_SHA256],
        mapping: &[(
            rustls::SignatureScheme::ECDSA_NISTP256_SHA256,
            &[webpki::ring::ECDSA_P256_SHA256],
        )],
    };

/// The rustls error inside an I/O error from tokio-rustls, if any.
fn rustls_error(e: &std::io::Error) -> Option<&rustls::Error> {
    e.get_ref()?.downcast_ref::<rustls::Error>()
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_provider_offers_tls13_suites_with_aes_128_gcm_sha256_and_p256_first() {
        let provider = super::provider();
        let suites = &provider.cipher_suites;
        assert_eq!(
            suites.first().map(|s| s.suite()),
            Some(rustls::CipherSuite::TLS13_AES_128_GCM_SHA256)
        );
        assert!(suites.iter().all(|s| s.tls13().is_some()));
        assert_eq!(suites.len(), 3);
        let groups: Vec<_> = provider.kx_groups.iter().map(|g| g.name()).collect();
        assert_eq!(
            groups,
            [rustls::NamedGroup::secp256r1, rustls::NamedGroup::X25519]
        );
    }
}
