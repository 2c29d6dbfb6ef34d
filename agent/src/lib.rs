//! The keel node agent: measures its config, serves init, runs join, and
//! binds the node's secrets to what it booted.

pub mod measurement;
pub mod tpm;
pub mod attestation;
