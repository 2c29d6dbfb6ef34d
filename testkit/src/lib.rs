//! Test support: swtpm instances with their own EK CA, the local component
//! mirror, a stand-in for systemd's notification socket, an attacker's
//! issuer with a software attestation key, a container check for nodes,
//! log capture, and generated AMD-like and Intel-like roots of trust for
//! the hardware variants.

pub mod amd;
pub mod components;
pub mod container;
pub mod forgery;
pub mod intel;
pub mod logs;
pub mod mirror;
pub mod notify;
pub mod swtpm;

/// The lowest port [`free_port`] hands out.
const FIRST_FREE_PORT: u32 = 10_000;

/// The first port of the kernel's ephemeral range (32768 if unreadable).
fn ephemeral_start() -> u32 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse().ok())
        .unwrap_or(32_768)
}

/// A TCP port free on every local address at the time of asking (bound on
/// `0.0.0.0` and released), for a server a test starts next.
///
/// Chosen from 10000 up to below the kernel's ephemeral range
/// (`ip_local_port_range`), never twice in one process (swtpm's port pairs
/// included). A port the kernel picks for a bind to port 0 comes from the
/// ephemeral range, from which every outgoing connection of the tests
/// running beside takes its local port too: one of them could hold it by
/// the time the server binds.
pub fn free_port() -> std::io::Result<u16> {
    free_ports(1)
}

/// The first of `count` consecutive ports that were free a moment ago on
/// every local address, handed out as [`free_port`] hands out one.
pub(crate) fn free_ports(count: u16) -> std::io::Result<u16> {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    static START: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    let count = u32::from(count.max(1));
    let span = ephemeral_start().saturating_sub(FIRST_FREE_PORT + count);
    if span < 1000 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::AddrInUse,
            "fewer than 1000 ports below the ephemeral range",
        ));
    }
    let start = *START.get_or_init(|| rand::random::<u32>() % span);
    for _ in 0..span / count {
        let offset = NEXT.fetch_add(count, Ordering::Relaxed);
        let first = FIRST_FREE_PORT + (start + offset) % span;
        let all_free = (first..first + count).all(|port| {
            u16::try_from(port)
                .is_ok_and(|port| std::net::TcpListener::bind(("0.0.0.0", port)).is_ok())
        });
        if let (true, Ok(first)) = (all_free, u16::try_from(first)) {
            return Ok(first);
        }
    }
    Err(std::io::Error::new(
        std::io::ErrorKind::AddrInUse,
        "no free port below the ephemeral range",
    ))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    #[test]
    fn free_ports_are_distinct_bindable_and_below_the_ephemeral_range() {
        let ports: Vec<u16> = (0..50).map(|_| super::free_port().unwrap()).collect();
        let distinct: std::collections::BTreeSet<_> = ports.iter().collect();
        assert_eq!(distinct.len(), ports.len(), "{ports:?}");
        let pair = super::free_ports(2).unwrap();
        assert!(!ports.contains(&pair) && !ports.contains(&(pair + 1)));
        std::net::TcpListener::bind(("0.0.0.0", pair + 1)).unwrap();
        for port in ports {
            let port_number = u32::from(port);
            assert!(
                (super::FIRST_FREE_PORT..super::ephemeral_start()).contains(&port_number),
                "{port}"
            );
            std::net::TcpListener::bind(("0.0.0.0", port)).unwrap();
        }
    }
}
