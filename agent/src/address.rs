//! The address a node advertises to the cluster (API server, kubelet).

use std::net::{IpAddr, Ipv4Addr, UdpSocket};

/// How a node finds the address it advertises.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AdvertiseAddress {
    /// Always this address (tests, fixed setups).
    Fixed(IpAddr),
    /// The source address of the kernel's route toward this peer, looked up
    /// when needed: the agent starts before the network is configured, and
    /// init or join only happen once a peer has reached the node or been
    /// reached by it.
    Toward(IpAddr),
}

impl AdvertiseAddress {
    /// The address now. A route lookup that fails (no network yet) yields
    /// the loopback address and logs why.
    pub fn resolve(&self) -> IpAddr {
        match *self {
            Self::Fixed(ip) => ip,
            Self::Toward(peer) => match source_address(peer) {
                Ok(ip) => ip,
                Err(e) => {
                    tracing::warn!(%peer, error = %e, "no route to the peer; advertising the loopback address");
                    IpAddr::V4(Ipv4Addr::LOCALHOST)
                }
            },
        }
    }
}

/// The source address the kernel picks for a route to `peer` (a UDP
/// connect sends nothing).
fn source_address(peer: IpAddr) -> std::io::Result<IpAddr> {
    let unspecified: IpAddr = match peer {
        IpAddr::V4(_) => Ipv4Addr::UNSPECIFIED.into(),
        IpAddr::V6(_) => std::net::Ipv6Addr::UNSPECIFIED.into(),
    };
    let socket = UdpSocket::bind((unspecified, 0))?;
    socket.connect((peer, 9))?;
    Ok(socket.local_addr()?.ip())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn fixed_is_returned_as_is() {
        let ip: IpAddr = "10.1.2.3".parse().unwrap();
        assert_eq!(AdvertiseAddress::Fixed(ip).resolve(), ip);
    }

    #[test]
    fn route_to_loopback_uses_loopback() {
        let lo = IpAddr::V4(Ipv4Addr::LOCALHOST);
        assert_eq!(AdvertiseAddress::Toward(lo).resolve(), lo);
    }
}
