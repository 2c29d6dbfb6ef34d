//! Test support: swtpm instances with their own EK CA, the local component
//! mirror, a stand-in for systemd's notification socket, an attacker's
//! issuer with a software attestation key, and a container check for nodes,
//! and generated AMD-like and Intel-like roots of trust for the hardware
//! variants.

pub mod amd;
pub mod components;
pub mod container;
pub mod forgery;
pub mod intel;
pub mod mirror;
pub mod notify;
pub mod swtpm;

/// A TCP port free on every local address at the time of asking (bound on
/// `0.0.0.0` and released), for a server a test starts next.
pub fn free_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind("0.0.0.0:0")?
        .local_addr()?
        .port())
}
