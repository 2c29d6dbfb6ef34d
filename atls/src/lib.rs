//! Attested TLS: attestation documents bound to per-handshake TLS keys and verifier nonces.
