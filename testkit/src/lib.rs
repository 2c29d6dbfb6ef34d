//! Test support: swtpm instances with their own EK CA, the local component
//! mirror, and an attacker's issuer with a software attestation key.

pub mod components;
pub mod forgery;
pub mod mirror;
pub mod swtpm;
