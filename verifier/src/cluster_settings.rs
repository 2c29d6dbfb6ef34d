//! The cluster settings an init request carries, checked alike by the CLI
//! (before it makes a master secret for a request the node would refuse)
//! and by the node: the cluster name, the service CIDR and the API server
//! certificate's extra names.

use std::net::IpAddr;

/// The service CIDR of a request that names none.
pub const DEFAULT_SERVICE_CIDR: &str = "10.96.0.0/12";

/// Longest cluster name.
const MAX_CLUSTER_NAME: usize = 63;

/// A cluster setting that a node refuses.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SettingsError {
    /// The cluster name is not a DNS label ([`is_dns_label`]).
    #[error("cluster name {0:?} is not 1-63 characters of a-z, 0-9 and '-' that begin and end with a letter or digit")]
    ClusterName(String),
    /// The service CIDR is not `address/prefix`.
    #[error("service CIDR {0:?} is not an address/prefix CIDR")]
    ServiceCidr(String),
    /// A certificate SAN is neither an IP address nor a DNS name.
    #[error("API server certificate SAN {0:?} is neither an IP address nor a DNS name")]
    CertSan(String),
}

/// Checks a Kubernetes cluster name: a DNS label, as kubeadm takes it.
pub fn check_cluster_name(name: &str) -> Result<(), SettingsError> {
    if name.len() <= MAX_CLUSTER_NAME && is_dns_label(name) {
        Ok(())
    } else {
        Err(SettingsError::ClusterName(name.to_owned()))
    }
}

/// Checks the service CIDR and the API server certificate's extra names.
pub fn check_cluster_network(
    service_cidr: &str,
    cert_sans: &[String],
) -> Result<(), SettingsError> {
    if !is_cidr(service_cidr) {
        return Err(SettingsError::ServiceCidr(service_cidr.to_owned()));
    }
    match cert_sans.iter().find(|san| !is_cert_san(san)) {
        Some(san) => Err(SettingsError::CertSan(san.clone())),
        None => Ok(()),
    }
}

/// Whether `s` is a lower-case DNS name (RFC 1123 labels) of at most 253
/// characters.
pub fn is_dns_name(s: &str) -> bool {
    !s.is_empty() && s.len() <= 253 && s.split('.').all(is_dns_label)
}

/// Whether `s` is one lower-case DNS label (RFC 1123): 1-63 characters of
/// a-z, 0-9 and '-' that begin and end with a letter or digit. Node and
/// cluster names must be one: kubeadm and the kubelet refuse others.
pub fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && !s.starts_with('-')
        && !s.ends_with('-')
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}

/// Whether `s` is `address/prefix` with a prefix in decimal without
/// leading zeros that fits the address.
pub fn is_cidr(s: &str) -> bool {
    let Some((addr, prefix)) = s.split_once('/') else {
        return false;
    };
    let Ok(addr) = addr.parse::<IpAddr>() else {
        return false;
    };
    let canonical = !prefix.is_empty()
        && prefix.bytes().all(|b| b.is_ascii_digit())
        && (prefix == "0" || !prefix.starts_with('0'));
    let max = if addr.is_ipv4() { 32 } else { 128 };
    canonical && prefix.parse::<u8>().is_ok_and(|bits| bits <= max)
}

/// Whether `s` can name the API server in its certificate: an IP address,
/// a DNS name, or a wildcard (`*.` and a DNS name).
pub fn is_cert_san(s: &str) -> bool {
    s.parse::<IpAddr>().is_ok() || is_dns_name(s.strip_prefix("*.").unwrap_or(s))
}

/// Whether `s` is `host:port` that kubeadm and a kubeconfig take for the
/// API server: the host a lower-case DNS name, an IPv4 address or a
/// bracketed IPv6 address.
pub fn is_endpoint(s: &str) -> bool {
    s.parse::<std::net::SocketAddr>().is_ok()
        || s.rsplit_once(':')
            .is_some_and(|(host, port)| port.parse::<u16>().is_ok() && is_dns_name(host))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cluster_names() {
        check_cluster_name("keel").unwrap();
        check_cluster_name(&"a".repeat(63)).unwrap();
        check_cluster_name("a-0").unwrap();
        // kubeadm refuses a name that begins or ends with '-' only after
        // the node locked.
        for bad in [
            "",
            "Prod",
            "a_b",
            "a.b",
            &"a".repeat(64),
            "prod-",
            "-prod",
            "-",
        ] {
            assert_eq!(
                check_cluster_name(bad),
                Err(SettingsError::ClusterName(bad.to_owned()))
            );
        }
    }

    #[test]
    fn networks() {
        check_cluster_network(DEFAULT_SERVICE_CIDR, &[]).unwrap();
        check_cluster_network(
            "fd00::/108",
            &["10.0.0.1".into(), "api.example".into(), "*.example".into()],
        )
        .unwrap();
        for bad in [
            "10.96.0.0",
            "10.96.0.0/33",
            "10.96.0.0/012",
            "x/12",
            "10.96.0.0/",
        ] {
            assert_eq!(
                check_cluster_network(bad, &[]),
                Err(SettingsError::ServiceCidr(bad.to_owned()))
            );
        }
        assert_eq!(
            check_cluster_network(DEFAULT_SERVICE_CIDR, &["a name".into()]),
            Err(SettingsError::CertSan("a name".into()))
        );
    }
}
