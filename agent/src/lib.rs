//! The keel node agent: measures its config, serves init, runs join, and
//! binds the node's secrets to what it booted.

pub mod attestation;
pub mod config;
pub mod measured;
pub mod measurement;
pub mod systemd;
pub mod tpm;
