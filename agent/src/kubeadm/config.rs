//! kubeadm configuration files: `InitConfiguration` + `ClusterConfiguration`
//! for `kubeadm init`, `JoinConfiguration` for `kubeadm join`.
//!
//! The API version follows the Kubernetes version: `kubeadm.k8s.io/v1beta3`
//! for v1.30 (v1beta4 arrived in v1.31), `kubeadm.k8s.io/v1beta4` from v1.31
//! on (v1beta3 is deprecated there). The one difference the generated files
//! touch is the shape of extra arguments: a map in v1beta3, a list of
//! `{name, value}` in v1beta4.
//!
//! The cluster's keys and certificates are ECDSA P-256, not kubeadm's
//! default RSA-2048 (`encryptionAlgorithm: ECDSA-P256` in v1beta4, the
//! `PublicKeysECDSA` feature gate in v1beta3): the join service signs a
//! kubelet certificate with the cluster CA for every ticket, and an
//! RSA-2048 signature costs that ticket about as much again as all of its
//! P-256 work. A CA kubeadm made RSA (a cluster from before this setting)
//! is still read and used (`join::service`).
//!
//! A join finds and trusts the cluster through kubeadm's file discovery: a
//! kubeconfig with the API server, the cluster CA and the node's client
//! certificate and key, all from the join ticket ([`Discovery::File`]).
//! The kubelet's TLS bootstrap then proves the node with that certificate,
//! which the join service issued for the node's measured name, and can get
//! a certificate of that name only. Token discovery ([`Discovery::Token`])
//! is what a control plane of an earlier version leaves: a bootstrap token
//! in kubeadm's group for joining nodes, whose node client CSRs are
//! approved for any node name.
//!
//! Every input is checked before it reaches a file (names, addresses,
//! CIDRs, SANs, token formats), and secrets (the bootstrap token, the
//! certificate key) have redacted `Debug` output.

use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::str::FromStr;

use keel_installer::KubernetesVersion;
use keel_verifier::cluster_settings::{is_cert_san, is_cidr, is_dns_name, is_endpoint};
use rand::Rng as _;

use super::yaml::Yaml;

/// The container runtime's CRI socket.
pub const CRI_SOCKET: &str = "unix:///run/containerd/containerd.sock";
/// The API server's port.
pub const API_SERVER_PORT: u16 = 6443;
/// Lifetime of the bootstrap token created by `kubeadm init`.
pub const INIT_TOKEN_TTL: &str = "1h0m0s";

/// Why a configuration was refused.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum ConfigError {
    /// A name is not a DNS-1123 subdomain.
    #[error("{field} {value:?} is not a lower-case DNS name of at most 253 characters")]
    Name {
        /// The field.
        field: &'static str,
        /// The refused value.
        value: String,
    },
    /// A CIDR does not parse.
    #[error("{field} {value:?} is not an address/prefix CIDR")]
    Cidr {
        /// The field.
        field: &'static str,
        /// The refused value.
        value: String,
    },
    /// A certificate SAN is neither an IP address nor a DNS name.
    #[error("API server certificate SAN {0:?} is neither an IP address nor a DNS name")]
    CertSan(String),
    /// The Kubernetes version is older than kubeadm's config APIs support.
    #[error("Kubernetes {0} is not supported (v1.30 or newer)")]
    Version(KubernetesVersion),
    /// The API server endpoint is not `host:port`.
    #[error("API server endpoint {0:?} is not host:port")]
    ApiServerEndpoint(String),
    /// The patches directory is not an absolute UTF-8 path.
    #[error("patches directory {0:?} is not an absolute UTF-8 path")]
    PatchesDir(PathBuf),
    /// A join configuration lists no CA certificate hash.
    #[error("a join needs at least one discovery CA certificate hash")]
    NoCaCertHash,
    /// The discovery kubeconfig's path is not an absolute UTF-8 path.
    #[error("discovery kubeconfig {0:?} is not an absolute UTF-8 path")]
    DiscoveryFile(PathBuf),
}

/// A token does not have kubeadm's format.
#[derive(Debug, Clone, Copy, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum ParseSecretError {
    /// Not `[a-z0-9]{6}.[a-z0-9]{16}`.
    #[error("bootstrap token is not of the form [a-z0-9]{{6}}.[a-z0-9]{{16}}")]
    BootstrapToken,
    /// Not `sha256:` and 64 lower-case hex digits.
    #[error("CA certificate hash is not sha256:<64 hex digits>")]
    CaCertHash,
    /// Not 64 hex digits (32 bytes).
    #[error("certificate key is not 64 hex digits")]
    CertificateKey,
}

/// A kubeadm bootstrap token `abcdef.0123456789abcdef`: a public ID and a
/// secret. `Debug` shows the ID only; zeroized when dropped.
#[derive(Clone)]
pub struct BootstrapToken(zeroize::Zeroizing<String>);

impl BootstrapToken {
    /// A fresh random token.
    pub fn generate() -> Self {
        const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
        let mut rng = rand::rngs::OsRng;
        // ID (6), dot, secret (16), written in place: no copy to zeroize.
        let mut token = zeroize::Zeroizing::new(String::with_capacity(23));
        for i in 0..23 {
            token.push(match i {
                6 => '.',
                _ => char::from(ALPHABET[rng.gen_range(0..ALPHABET.len())]),
            });
        }
        Self(token)
    }

    /// The whole token (secret).
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// The public token ID (before the dot).
    pub fn id(&self) -> &str {
        self.0.split('.').next().unwrap_or_default()
    }

    /// This token's entry in an `InitConfiguration`'s `bootstrapTokens`:
    /// for joining nodes (signing and authentication, kubeadm's group of
    /// node tokens), living `ttl`.
    pub(super) fn config_entry(&self, ttl: &str, description: &str) -> Yaml {
        Yaml::map(vec![
            ("token", Yaml::str(self.expose())),
            ("ttl", Yaml::str(ttl)),
            ("usages", Yaml::strs(["signing", "authentication"])),
            (
                "groups",
                Yaml::strs(["system:bootstrappers:kubeadm:default-node-token"]),
            ),
            ("description", Yaml::str(description)),
        ])
    }
}

impl FromStr for BootstrapToken {
    type Err = ParseSecretError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let ok = |part: &str, n: usize| {
            part.len() == n
                && part
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
        };
        match s.split_once('.') {
            Some((id, secret)) if ok(id, 6) && ok(secret, 16) => Ok(Self(s.to_owned().into())),
            _ => Err(ParseSecretError::BootstrapToken),
        }
    }
}

impl fmt::Debug for BootstrapToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BootstrapToken({}.<redacted>)", self.id())
    }
}

/// `sha256:<hex>` of the cluster CA's SubjectPublicKeyInfo (kubeadm discovery).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CaCertHash(String);

impl CaCertHash {
    /// The hash of the first certificate in `pem`, `None` when it does not
    /// parse.
    pub fn of_ca_pem(pem: &[u8]) -> Option<Self> {
        use sha2::Digest as _;
        use x509_parser::prelude::{FromDer as _, X509Certificate};
        let (_, pem) = x509_parser::pem::parse_x509_pem(pem).ok()?;
        let (_, cert) = X509Certificate::from_der(&pem.contents).ok()?;
        let digest = sha2::Sha256::digest(cert.tbs_certificate.subject_pki.raw);
        Some(Self(format!("sha256:{}", hex::encode(digest))))
    }

    /// The hash as kubeadm takes it.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl FromStr for CaCertHash {
    type Err = ParseSecretError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.strip_prefix("sha256:") {
            Some(hex) if is_lower_hex(hex, 64) => Ok(Self(s.to_owned())),
            _ => Err(ParseSecretError::CaCertHash),
        }
    }
}

/// kubeadm's certificate key (hex of a 32-byte AES key) that decrypts the
/// control-plane certificates uploaded by `kubeadm init --upload-certs`.
#[derive(Clone)]
pub struct CertificateKey(zeroize::Zeroizing<String>);

impl CertificateKey {
    /// The key as hex (secret).
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl FromStr for CertificateKey {
    type Err = ParseSecretError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if is_lower_hex(&s.to_ascii_lowercase(), 64) {
            Ok(Self(zeroize::Zeroizing::new(s.to_ascii_lowercase())))
        } else {
            Err(ParseSecretError::CertificateKey)
        }
    }
}

impl fmt::Debug for CertificateKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("CertificateKey(<redacted>)")
    }
}

/// The kubeadm configuration API version.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConfigApi {
    /// `kubeadm.k8s.io/v1beta3` (Kubernetes v1.30).
    V1Beta3,
    /// `kubeadm.k8s.io/v1beta4` (Kubernetes v1.31 and later).
    V1Beta4,
}

impl ConfigApi {
    /// The API version kubeadm of `version` should be given.
    pub fn for_version(version: KubernetesVersion) -> Result<Self, ConfigError> {
        let at = |s: &str| s.parse::<KubernetesVersion>().ok();
        if at("v1.30.0").is_some_and(|v| version < v) {
            Err(ConfigError::Version(version))
        } else if at("v1.31.0").is_some_and(|v| version < v) {
            Ok(Self::V1Beta3)
        } else {
            Ok(Self::V1Beta4)
        }
    }

    /// The `apiVersion` string.
    pub fn api_version(self) -> &'static str {
        match self {
            Self::V1Beta3 => "kubeadm.k8s.io/v1beta3",
            Self::V1Beta4 => "kubeadm.k8s.io/v1beta4",
        }
    }

    /// The `ClusterConfiguration` entry that makes kubeadm create ECDSA
    /// P-256 keys for the cluster.
    fn ecdsa_keys(self) -> (&'static str, Yaml) {
        match self {
            Self::V1Beta3 => (
                "featureGates",
                Yaml::map(vec![("PublicKeysECDSA", Yaml::Bool(true))]),
            ),
            Self::V1Beta4 => ("encryptionAlgorithm", Yaml::str("ECDSA-P256")),
        }
    }

    /// Extra arguments in this version's shape.
    fn extra_args(self, args: &[(&str, String)]) -> Yaml {
        match self {
            Self::V1Beta3 => Yaml::map(
                args.iter()
                    .map(|(name, value)| (*name, Yaml::str(value.clone()))),
            ),
            Self::V1Beta4 => Yaml::List(
                args.iter()
                    .map(|(name, value)| {
                        Yaml::map(vec![
                            ("name", Yaml::str(*name)),
                            ("value", Yaml::str(value.clone())),
                        ])
                    })
                    .collect(),
            ),
        }
    }
}

/// Everything `kubeadm init` needs.
#[derive(Debug, Clone)]
pub struct InitConfig {
    /// Kubernetes node name of this node.
    pub node_name: String,
    /// The address the API server advertises (and the kubelet's node IP).
    pub advertise_address: IpAddr,
    /// Kubernetes cluster name.
    pub cluster_name: String,
    /// Pinned Kubernetes version.
    pub kubernetes_version: KubernetesVersion,
    /// Extra SANs of the API server certificate (IPs or DNS names).
    pub cert_sans: Vec<String>,
    /// Service CIDR, e.g. `10.96.0.0/12`.
    pub service_cidr: String,
    /// Pod CIDR, e.g. `10.244.0.0/16`.
    pub pod_cidr: String,
    /// Directory of kubeadm patches (see [`crate::paths::PATCHES_DIR`]).
    pub patches_dir: PathBuf,
    /// The bootstrap token kubeadm creates, for the join service to hand out.
    pub bootstrap_token: BootstrapToken,
    /// Where every control plane's API server is reached (`host:port`, the
    /// config's `cluster.api_server_endpoint`): kubeadm's
    /// `controlPlaneEndpoint`, and a SAN of the API server certificates.
    /// Without it, this node's own address and [`API_SERVER_PORT`].
    pub control_plane_endpoint: Option<String>,
}

impl InitConfig {
    /// The kubeadm configuration: `InitConfiguration`, then `ClusterConfiguration`.
    pub fn to_yaml(&self) -> Result<zeroize::Zeroizing<String>, ConfigError> {
        let api = ConfigApi::for_version(self.kubernetes_version)?;
        check_name("node name", &self.node_name)?;
        check_name("cluster name", &self.cluster_name)?;
        check_cidr("service CIDR", &self.service_cidr)?;
        check_cidr("pod CIDR", &self.pod_cidr)?;
        for san in &self.cert_sans {
            check_san(san)?;
        }
        let patches = patches_dir(&self.patches_dir)?;
        let endpoint = match &self.control_plane_endpoint {
            Some(shared) => {
                check_endpoint(shared)?;
                shared.clone()
            }
            None => SocketAddr::new(self.advertise_address, API_SERVER_PORT).to_string(),
        };
        let init = Yaml::map(vec![
            ("apiVersion", Yaml::str(api.api_version())),
            ("kind", Yaml::str("InitConfiguration")),
            (
                "bootstrapTokens",
                Yaml::List(vec![self
                    .bootstrap_token
                    .config_entry(INIT_TOKEN_TTL, "keel: nodes join with this token")]),
            ),
            (
                "nodeRegistration",
                node_registration(api, &self.node_name, self.advertise_address),
            ),
            (
                "localAPIEndpoint",
                Yaml::map(vec![
                    (
                        "advertiseAddress",
                        Yaml::str(self.advertise_address.to_string()),
                    ),
                    ("bindPort", Yaml::Int(API_SERVER_PORT.into())),
                ]),
            ),
            (
                "patches",
                Yaml::map(vec![("directory", Yaml::str(patches))]),
            ),
        ]);
        let mut sans = vec![self.advertise_address.to_string()];
        if let Some((host, _port)) = self
            .control_plane_endpoint
            .as_deref()
            .and_then(|e| e.rsplit_once(':'))
        {
            sans.push(
                host.trim_start_matches('[')
                    .trim_end_matches(']')
                    .to_owned(),
            );
        }
        sans.extend(self.cert_sans.iter().cloned());
        let cluster = Yaml::map(vec![
            ("apiVersion", Yaml::str(api.api_version())),
            ("kind", Yaml::str("ClusterConfiguration")),
            ("clusterName", Yaml::str(&self.cluster_name)),
            (
                "kubernetesVersion",
                Yaml::str(self.kubernetes_version.to_string()),
            ),
            ("controlPlaneEndpoint", Yaml::str(endpoint)),
            (
                "networking",
                Yaml::map(vec![
                    ("serviceSubnet", Yaml::str(&self.service_cidr)),
                    ("podSubnet", Yaml::str(&self.pod_cidr)),
                    ("dnsDomain", Yaml::str("cluster.local")),
                ]),
            ),
            ("apiServer", Yaml::map(vec![("certSANs", Yaml::strs(sans))])),
            api.ecdsa_keys(),
        ]);
        Ok(Yaml::documents(&[init, cluster]))
    }
}

/// The control-plane part of a join.
#[derive(Debug, Clone)]
pub struct ControlPlaneJoin {
    /// The address this node's API server advertises.
    pub advertise_address: IpAddr,
    /// kubeadm's certificate key, when the control-plane certificates come
    /// from `kubeadm init --upload-certs`; `None` when they are written to
    /// `/etc/kubernetes/pki` before the join (the join ticket's files).
    pub certificate_key: Option<CertificateKey>,
}

/// How `kubeadm join` finds the cluster and trusts it, and what the
/// kubelet's TLS bootstrap proves the node with.
#[derive(Debug, Clone)]
pub enum Discovery {
    /// kubeadm's token discovery: the bootstrap token, which the TLS
    /// bootstrap then uses, and the hashes of the CA's public key it pins.
    /// The token is in kubeadm's group for joining nodes, whose node
    /// client CSRs kube-controller-manager approves for any node name.
    Token {
        /// The bootstrap token from the join ticket.
        token: BootstrapToken,
        /// Hashes of the cluster CA's public key (discovery pins these).
        ca_cert_hashes: Vec<CaCertHash>,
    },
    /// kubeadm's file discovery: the kubeconfig written to `path`, whose
    /// client certificate (the ticket's kubelet certificate, issued for the
    /// node's measured name) the TLS bootstrap uses: a node can then ask
    /// for a certificate of its own name only.
    File {
        /// Where the kubeconfig is written for the run.
        path: PathBuf,
        /// The kubeconfig.
        kubeconfig: DiscoveryKubeconfig,
    },
}

/// The kubeconfig of `kubeadm join`'s file discovery: the API server, the
/// cluster CA and the node's client certificate and key, all from the
/// ticket (which the node got over attested TLS).
#[derive(Clone)]
pub struct DiscoveryKubeconfig {
    /// The cluster CA certificate (PEM).
    pub ca_pem: String,
    /// The kubelet's client certificate (PEM).
    pub cert_pem: String,
    /// The kubelet's private key (PEM).
    pub key_pem: zeroize::Zeroizing<String>,
}

impl fmt::Debug for DiscoveryKubeconfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DiscoveryKubeconfig")
            .field("key_pem", &"<redacted>")
            .finish_non_exhaustive()
    }
}

impl DiscoveryKubeconfig {
    /// The kubeconfig (JSON, which kubeconfig readers take as YAML) for the
    /// API server at `endpoint` (`host:port`) and the node `node_name`, in
    /// a buffer wiped when dropped.
    pub fn render(
        &self,
        endpoint: &str,
        node_name: &str,
    ) -> Result<zeroize::Zeroizing<String>, ConfigError> {
        use base64::Engine as _;
        check_name("node name", node_name)?;
        check_endpoint(endpoint)?;
        let b64 = |pem: &str| base64::engine::general_purpose::STANDARD.encode(pem);
        let key = zeroize::Zeroizing::new(b64(&self.key_pem));
        let (ca, cert) = (b64(&self.ca_pem), b64(&self.cert_pem));
        // Written straight into one wiped buffer sized up front, not
        // through `Yaml` (whose tree and output would copy the private key
        // into buffers nothing wipes). Every value is base64 or checked
        // above: nothing to escape.
        let mut out = zeroize::Zeroizing::new(String::with_capacity(
            512 + endpoint.len() + 2 * node_name.len() + ca.len() + cert.len() + key.len(),
        ));
        out.push_str("{\"apiVersion\":\"v1\",\"kind\":\"Config\",\"clusters\":[{\"name\":\"kubernetes\",\"cluster\":{\"server\":\"https://");
        out.push_str(endpoint);
        out.push_str("\",\"certificate-authority-data\":\"");
        out.push_str(&ca);
        out.push_str("\"}}],\"users\":[{\"name\":\"system:node:");
        out.push_str(node_name);
        out.push_str("\",\"user\":{\"client-certificate-data\":\"");
        out.push_str(&cert);
        out.push_str("\",\"client-key-data\":\"");
        out.push_str(&key);
        out.push_str("\"}}],\"contexts\":[{\"name\":\"keel-join\",\"context\":{\"cluster\":\"kubernetes\",\"user\":\"system:node:");
        out.push_str(node_name);
        out.push_str("\"}}],\"current-context\":\"keel-join\"}\n");
        Ok(out)
    }
}

/// Everything `kubeadm join` needs.
#[derive(Debug, Clone)]
pub struct JoinConfig {
    /// Kubernetes node name of this node.
    pub node_name: String,
    /// This node's IP (the kubelet's node IP).
    pub node_ip: IpAddr,
    /// The pinned Kubernetes version (chooses the config API).
    pub kubernetes_version: KubernetesVersion,
    /// `host:port` of the API server.
    pub api_server_endpoint: String,
    /// How it finds the cluster and what the kubelet's TLS bootstrap
    /// proves the node with.
    pub discovery: Discovery,
    /// Present for control-plane joins.
    pub control_plane: Option<ControlPlaneJoin>,
    /// Directory of kubeadm patches (see [`crate::paths::PATCHES_DIR`]).
    pub patches_dir: PathBuf,
}

impl JoinConfig {
    /// The kubeadm `JoinConfiguration`.
    pub fn to_yaml(&self) -> Result<zeroize::Zeroizing<String>, ConfigError> {
        let api = ConfigApi::for_version(self.kubernetes_version)?;
        check_name("node name", &self.node_name)?;
        check_endpoint(&self.api_server_endpoint)?;
        let discovery = match &self.discovery {
            Discovery::Token {
                token,
                ca_cert_hashes,
            } => {
                if ca_cert_hashes.is_empty() {
                    return Err(ConfigError::NoCaCertHash);
                }
                (
                    "bootstrapToken",
                    Yaml::map(vec![
                        ("token", Yaml::str(token.expose())),
                        ("apiServerEndpoint", Yaml::str(&self.api_server_endpoint)),
                        (
                            "caCertHashes",
                            Yaml::strs(ca_cert_hashes.iter().map(|h| h.as_str())),
                        ),
                    ]),
                )
            }
            Discovery::File { path, .. } => (
                "file",
                Yaml::map(vec![("kubeConfigPath", Yaml::str(absolute_utf8(path)?))]),
            ),
        };
        let patches = patches_dir(&self.patches_dir)?;
        let mut doc = vec![
            ("apiVersion", Yaml::str(api.api_version())),
            ("kind", Yaml::str("JoinConfiguration")),
            ("discovery", Yaml::map(vec![discovery])),
            (
                "nodeRegistration",
                node_registration(api, &self.node_name, self.node_ip),
            ),
        ];
        if let Some(cp) = &self.control_plane {
            let mut section = vec![(
                "localAPIEndpoint",
                Yaml::map(vec![
                    (
                        "advertiseAddress",
                        Yaml::str(cp.advertise_address.to_string()),
                    ),
                    ("bindPort", Yaml::Int(API_SERVER_PORT.into())),
                ]),
            )];
            if let Some(key) = &cp.certificate_key {
                section.push(("certificateKey", Yaml::str(key.expose())));
            }
            doc.push(("controlPlane", Yaml::map(section)));
        }
        doc.push((
            "patches",
            Yaml::map(vec![("directory", Yaml::str(patches))]),
        ));
        Ok(Yaml::documents(&[Yaml::map(doc)]))
    }
}

fn node_registration(api: ConfigApi, name: &str, node_ip: IpAddr) -> Yaml {
    Yaml::map(vec![
        ("name", Yaml::str(name)),
        ("criSocket", Yaml::str(CRI_SOCKET)),
        (
            "kubeletExtraArgs",
            api.extra_args(&[("node-ip", node_ip.to_string())]),
        ),
    ])
}

fn is_lower_hex(s: &str, len: usize) -> bool {
    s.len() == len && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// Checks that `value` is a DNS-1123 subdomain
/// ([`keel_verifier::cluster_settings::is_dns_name`]).
fn check_name(field: &'static str, value: &str) -> Result<(), ConfigError> {
    if is_dns_name(value) {
        Ok(())
    } else {
        Err(ConfigError::Name {
            field,
            value: value.to_owned(),
        })
    }
}

fn check_cidr(field: &'static str, value: &str) -> Result<(), ConfigError> {
    if is_cidr(value) {
        Ok(())
    } else {
        Err(ConfigError::Cidr {
            field,
            value: value.to_owned(),
        })
    }
}

fn check_san(san: &str) -> Result<(), ConfigError> {
    if is_cert_san(san) {
        Ok(())
    } else {
        Err(ConfigError::CertSan(san.to_owned()))
    }
}

fn check_endpoint(endpoint: &str) -> Result<(), ConfigError> {
    if is_endpoint(endpoint) {
        Ok(())
    } else {
        Err(ConfigError::ApiServerEndpoint(endpoint.to_owned()))
    }
}

fn absolute_utf8(path: &Path) -> Result<&str, ConfigError> {
    match path.to_str() {
        Some(s) if path.is_absolute() => Ok(s),
        _ => Err(ConfigError::DiscoveryFile(path.to_owned())),
    }
}

fn patches_dir(dir: &Path) -> Result<&str, ConfigError> {
    match dir.to_str() {
        Some(s) if dir.is_absolute() => Ok(s),
        _ => Err(ConfigError::PatchesDir(dir.to_owned())),
    }
}
