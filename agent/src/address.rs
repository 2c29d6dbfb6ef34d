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

/// A route lookup found no route toward its peer (no network yet, or no
/// route that reaches the peer): there is no address to advertise but the
/// loopback address, which no other node reaches.
#[derive(Debug, thiserror::Error)]
#[error("no network route toward {peer} to take the address this node advertises from")]
pub struct NoRoute {
    /// The peer the lookup routed toward.
    pub peer: IpAddr,
    /// Why the kernel found no route.
    #[source]
    pub source: std::io::Error,
}

impl AdvertiseAddress {
    /// The address now, or why there is none: a node never advertises
    /// the loopback address in place of one it has no route for.
    pub fn resolve(&self) -> Result<IpAddr, NoRoute> {
        match *self {
            Self::Fixed(ip) => Ok(ip),
            Self::Toward(peer) => source_address(peer).map_err(|source| NoRoute { peer, source }),
        }
    }
}

impl AdvertiseAddress {
    /// The address a node creating a cluster for `operator` (the address
    /// its init request came from) advertises: as [`Self::resolve`], but
    /// when the configured lookup finds no route (a node without a default
    /// route), the source of the route toward the operator, who reached
    /// the node that way. `None` when neither has a route: the cluster
    /// would advertise the loopback address, which no other node reaches.
    pub fn resolve_for_init(&self, operator: Option<IpAddr>) -> Option<IpAddr> {
        let peer = match *self {
            Self::Fixed(ip) => return Some(ip),
            Self::Toward(peer) => peer,
        };
        if let Ok(ip) = source_address(peer) {
            return Some(ip);
        }
        let operator = operator?;
        match source_address(operator) {
            Ok(ip) => {
                tracing::info!(%peer, %operator, advertise = %ip, "no route toward the configured peer; advertising the address toward the operator");
                Some(ip)
            }
            Err(e) => {
                tracing::warn!(%peer, %operator, error = %e, "no route toward the configured peer or the operator");
                None
            }
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
        assert_eq!(AdvertiseAddress::Fixed(ip).resolve().unwrap(), ip);
    }

    /// A broadcast address stands in for a peer without a route: a UDP
    /// socket without `SO_BROADCAST` cannot connect to it.
    const NO_ROUTE: IpAddr = IpAddr::V4(Ipv4Addr::BROADCAST);

    #[test]
    fn init_falls_back_to_the_route_toward_the_operator() {
        let lo = IpAddr::V4(Ipv4Addr::LOCALHOST);
        assert!(source_address(NO_ROUTE).is_err());
        assert_eq!(
            AdvertiseAddress::Toward(NO_ROUTE).resolve_for_init(Some(lo)),
            Some(lo)
        );
        // No route and no operator address to route toward: nothing.
        assert_eq!(
            AdvertiseAddress::Toward(NO_ROUTE).resolve_for_init(None),
            None
        );
        assert_eq!(
            AdvertiseAddress::Toward(NO_ROUTE).resolve_for_init(Some(NO_ROUTE)),
            None
        );
        // A route that works is taken as configured.
        assert_eq!(
            AdvertiseAddress::Toward(lo).resolve_for_init(Some(NO_ROUTE)),
            Some(lo)
        );
        let fixed: IpAddr = "10.1.2.3".parse().unwrap();
        assert_eq!(
            AdvertiseAddress::Fixed(fixed).resolve_for_init(None),
            Some(fixed)
        );
    }

    #[test]
    fn route_to_loopback_uses_loopback() {
        let lo = IpAddr::V4(Ipv4Addr::LOCALHOST);
        assert_eq!(AdvertiseAddress::Toward(lo).resolve().unwrap(), lo);
    }

    #[test]
    fn no_route_is_no_address() {
        let e = AdvertiseAddress::Toward(NO_ROUTE).resolve().unwrap_err();
        assert_eq!(e.peer, NO_ROUTE);
    }
}
