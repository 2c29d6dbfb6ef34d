//! The node config: typed, bounded, and in one canonical byte form.
//!
//! A node config document has two parts: `cluster`, identical on every node
//! of a cluster and measured into the config PCR (12, enforced by
//! verifiers), and `node`, this node's name and role, measured into PCR 13
//! (logged, not enforced). The agent measures both before it uses either
//! (`keel_agent::measured`). Sources, in order: an explicit path, the QEMU
//! fw_cfg item `opt/keel/node-config`, the image default
//! `/usr/lib/keel/node-config.json`.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::cpu::{AttestationConfig, CpuPolicy};
use crate::signature::SigningPublicKey;

/// Largest accepted config document.
pub const MAX_CONFIG_BYTES: u64 = 64 * 1024;
/// Largest canonical form of a config, its cluster and node parts
/// together. Both are measured with their bytes into the event log, which
/// every attestation document of the node carries: of the 48 KiB a
/// document may take, the log has 32 KiB, and what the config leaves of
/// it goes to the Kubernetes components and an upgrade's events. A larger
/// config would leave too little for those (upgrades refused for want of
/// room) or, larger still, documents too large for a handshake; so it is
/// refused at load.
pub const MAX_MEASURED_CONFIG_BYTES: usize = 16 * 1024;
/// Where QEMU's `-fw_cfg name=opt/keel/node-config,file=...` appears in the guest.
pub const FW_CFG_PATH: &str = "/sys/firmware/qemu_fw_cfg/by_name/opt/keel/node-config/raw";
/// The image's default config.
pub const IMAGE_DEFAULT_PATH: &str = "/usr/lib/keel/node-config.json";

/// Config errors.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The source could not be read.
    #[error("reading node config {path}")]
    Read {
        /// The source.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The source is larger than [`MAX_CONFIG_BYTES`].
    #[error("node config {path} is larger than {MAX_CONFIG_BYTES} bytes")]
    TooLarge {
        /// The source.
        path: PathBuf,
    },
    /// The document is not a valid config.
    #[error("node config {path} is invalid")]
    Parse {
        /// The source.
        path: PathBuf,
        /// The cause.
        #[source]
        source: serde_json::Error,
    },
    /// A field has a value the agent cannot use.
    #[error("node config field {field}: {reason}")]
    Invalid {
        /// The field.
        field: &'static str,
        /// Why.
        reason: String,
    },
}

/// The node's role in the cluster.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum Role {
    /// Runs the control plane; may initialise the cluster and serves the join service.
    ControlPlane,
    /// Runs workloads.
    #[default]
    Worker,
}

impl Role {
    /// The kebab-case name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::ControlPlane => "control-plane",
            Self::Worker => "worker",
        }
    }
}

/// Cluster-wide settings: the same bytes on every node, measured into PCR 12.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterConfig {
    /// The init secret's argon2id hash ([`crate::init_secret`]); empty
    /// disables the init server.
    #[serde(default)]
    pub init_secret_hash: String,
    /// Join service endpoints (`host:port`) of the control plane, tried in turn.
    #[serde(default)]
    pub control_plane_endpoints: Vec<String>,
    /// Port of the init server.
    #[serde(default = "default_init_port")]
    pub init_port: u16,
    /// Port of the join service (control-plane nodes after init).
    #[serde(default = "default_join_port")]
    pub join_port: u16,
    /// Base URL replacing upstream download hosts, if any.
    #[serde(default)]
    pub component_mirror: Option<String>,
    /// PEM certificates of the CAs that issue TPM endorsement-key certificates.
    #[serde(default)]
    pub ek_ca_pem: String,
    /// The attestation variant and its expected CPU values. The default
    /// (`vtpm`) is left out of the canonical form, so configs without it
    /// measure exactly as before.
    #[serde(default, skip_serializing_if = "AttestationConfig::is_default")]
    pub attestation: AttestationConfig,
    /// Continuous attestation; left out of the canonical form while it has
    /// its defaults, so configs without it measure as before.
    #[serde(default, skip_serializing_if = "EvidenceConfig::is_default")]
    pub evidence: EvidenceConfig,
    /// The public key (PEM SubjectPublicKeyInfo, ECDSA P-256) that signs
    /// the measurements of every image the cluster runs
    /// (`keel-measure --signing-key`). With it, image upgrades are possible
    /// and a node accepts a join service of another image whose signed
    /// measurements it presents; without it, image upgrades are refused.
    /// Left out of the canonical form when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub measurements_signing_key: Option<String>,
    /// Where every control plane's Kubernetes API server is reached
    /// (`host:port`, the host a DNS name or an IP address): a load
    /// balancer, a virtual IP or a DNS name of them all. kubeadm writes it
    /// into every kubeconfig it makes (the kubelets', kube-proxy's, the
    /// admin's), the API servers' certificates name it, and join tickets
    /// send nodes to it. Without it, those name the first control plane's
    /// own address, and the cluster's API is down while that node is.
    /// Left out of the canonical form when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_server_endpoint: Option<String>,
}

/// How joined nodes are attested after they joined.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EvidenceConfig {
    /// Seconds between a node's evidence (1-90, default 60).
    #[serde(default = "default_evidence_interval")]
    pub interval_seconds: u32,
    /// What follows a drifted or silent verdict.
    #[serde(default)]
    pub policy: EvidencePolicy,
}

/// What a control plane does about a node that drifted or fell silent.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum EvidencePolicy {
    /// Record and log the verdict.
    #[default]
    Log,
    /// Also revoke the node.
    Revoke,
}

/// Longest evidence interval: the control plane holds a node's nonce
/// request for up to one interval, within its 120 s request bound.
pub const MAX_EVIDENCE_INTERVAL_SECONDS: u32 = 90;

fn default_evidence_interval() -> u32 {
    60
}

impl Default for EvidenceConfig {
    fn default() -> Self {
        Self {
            interval_seconds: default_evidence_interval(),
            policy: EvidencePolicy::Log,
        }
    }
}

impl EvidenceConfig {
    /// Whether every field has its default.
    pub fn is_default(&self) -> bool {
        *self == Self::default()
    }

    /// The interval, clamped to 1-[`MAX_EVIDENCE_INTERVAL_SECONDS`] s.
    pub fn interval(&self) -> std::time::Duration {
        std::time::Duration::from_secs(u64::from(
            self.interval_seconds
                .clamp(1, MAX_EVIDENCE_INTERVAL_SECONDS),
        ))
    }

    /// How long a drift holds before the `revoke` policy acts on it: an
    /// interval and a half, so that every member has reported under the
    /// same conditions by then.
    pub fn drift_hold(&self) -> std::time::Duration {
        self.interval() * 3 / 2
    }

    /// How long a drift stands against trusted evidence, a control
    /// plane's own or a peer's record: its hold and two intervals more, so
    /// that the sweep (every interval) that first finds the hold over
    /// finds the drift still standing, even a tick late.
    pub fn drift_stands(&self) -> std::time::Duration {
        self.drift_hold() + self.interval() * 2
    }
}

fn default_init_port() -> u16 {
    9000
}

fn default_join_port() -> u16 {
    9090
}

impl Default for ClusterConfig {
    fn default() -> Self {
        Self {
            init_secret_hash: String::new(),
            control_plane_endpoints: Vec::new(),
            init_port: default_init_port(),
            join_port: default_join_port(),
            component_mirror: None,
            ek_ca_pem: String::new(),
            attestation: AttestationConfig::default(),
            evidence: EvidenceConfig::default(),
            measurements_signing_key: None,
            api_server_endpoint: None,
        }
    }
}

impl ClusterConfig {
    /// The checked attestation policy: the variant with exactly its section.
    pub fn cpu_policy(&self) -> Result<CpuPolicy, ConfigError> {
        CpuPolicy::try_from(&self.attestation).map_err(|reason| ConfigError::Invalid {
            field: "cluster.attestation",
            reason,
        })
    }

    /// The measurements signing key, if the config names one.
    pub fn signing_key(&self) -> Result<Option<SigningPublicKey>, ConfigError> {
        self.measurements_signing_key
            .as_deref()
            .map(|pem| SigningPublicKey::from_pem(pem.as_bytes()))
            .transpose()
            .map_err(|e| ConfigError::Invalid {
                field: "cluster.measurements_signing_key",
                reason: e.to_string(),
            })
    }
}

/// This node's own facts, measured into PCR 13.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeIdentity {
    /// Kubernetes node name.
    #[serde(default = "default_name")]
    pub name: String,
    /// Role.
    #[serde(default)]
    pub role: Role,
    /// Block device of the state disk; absent means no disk encryption (host tests).
    #[serde(default)]
    pub state_disk: Option<String>,
}

fn default_name() -> String {
    "node".into()
}

impl Default for NodeIdentity {
    fn default() -> Self {
        Self {
            name: default_name(),
            role: Role::default(),
            state_disk: None,
        }
    }
}

/// A whole node config document.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct NodeConfig {
    /// Measured into PCR 12.
    #[serde(default)]
    pub cluster: ClusterConfig,
    /// Measured into PCR 13.
    #[serde(default)]
    pub node: NodeIdentity,
}

impl NodeConfig {
    /// Parses and validates a document.
    pub fn parse(bytes: &[u8], path: &Path) -> Result<Self, ConfigError> {
        let config: Self = serde_json::from_slice(bytes).map_err(|source| ConfigError::Parse {
            path: path.to_owned(),
            source,
        })?;
        config.validate()?;
        Ok(config)
    }

    /// Loads the first source that exists: `explicit`, fw_cfg, the image
    /// default; with none, the built-in defaults. Returns where it came from.
    pub fn load(explicit: Option<&Path>) -> Result<(Self, String), ConfigError> {
        let candidates: Vec<PathBuf> = match explicit {
            Some(p) => vec![p.to_owned()],
            None => vec![FW_CFG_PATH.into(), IMAGE_DEFAULT_PATH.into()],
        };
        for path in candidates {
            if explicit.is_none() && !path.exists() {
                continue;
            }
            let bytes = read_bounded(&path)?;
            return Ok((Self::parse(&bytes, &path)?, path.display().to_string()));
        }
        Ok((Self::default(), "built-in defaults".into()))
    }

    fn validate(&self) -> Result<(), ConfigError> {
        let measured = self.cluster_bytes().len() + self.node_bytes().len();
        if measured > MAX_MEASURED_CONFIG_BYTES {
            return Err(ConfigError::Invalid {
                field: "cluster",
                reason: format!(
                    "the config is {measured} bytes in its measured (canonical) form, more than \
                     the {MAX_MEASURED_CONFIG_BYTES} an attestation document's event log has \
                     for it; keep ek_ca_pem to the CAs that issue this cluster's EK certificates"
                ),
            });
        }
        let c = &self.cluster;
        // An empty bundle is the built-in default's: such a node attests no
        // peer. One given must be whole (every block a certificate).
        if !c.ek_ca_pem.trim().is_empty() {
            crate::ek::EkTrust::from_pem(c.ek_ca_pem.as_bytes()).map_err(|e| {
                ConfigError::Invalid {
                    field: "cluster.ek_ca_pem",
                    reason: e.to_string(),
                }
            })?;
        }
        if crate::init_secret::is_legacy_sha256(&c.init_secret_hash) {
            tracing::warn!(
                "cluster.init_secret_hash is a SHA-256, the form before argon2id: this node \
                 takes no init (a member's config keeps its measurement); a new cluster's \
                 config needs the hash `keel init-secret` prints"
            );
        } else if !c.init_secret_hash.is_empty() {
            crate::init_secret::check(&c.init_secret_hash).map_err(|why| ConfigError::Invalid {
                field: "cluster.init_secret_hash",
                reason: why.to_string(),
            })?;
        }
        for e in &c.control_plane_endpoints {
            if e.rsplit_once(':')
                .and_then(|(_, p)| p.parse::<u16>().ok())
                .is_none()
            {
                return Err(ConfigError::Invalid {
                    field: "cluster.control_plane_endpoints",
                    reason: format!("{e:?} is not host:port"),
                });
            }
        }
        if let Some(e) = &c.api_server_endpoint {
            if !crate::cluster_settings::is_endpoint(e) {
                return Err(ConfigError::Invalid {
                    field: "cluster.api_server_endpoint",
                    reason: format!(
                        "{e:?} is not host:port with a lower-case DNS name or an IP address \
                         (IPv6 in brackets) as the host"
                    ),
                });
            }
        }
        // The installer's own rule (http or https, no query, no user name
        // or password, since this config is shown to anyone who attests
        // the node): a mirror the agent would refuse at start is refused
        // here.
        if let Some(mirror) = &c.component_mirror {
            keel_installer::Mirror::new(mirror).map_err(|e| ConfigError::Invalid {
                field: "cluster.component_mirror",
                reason: e.to_string(),
            })?;
        }
        self.cluster.cpu_policy()?;
        self.cluster.signing_key()?;
        let n = &self.node;
        if !crate::cluster_settings::is_dns_label(&n.name) {
            return Err(ConfigError::Invalid {
                field: "node.name",
                reason: "must be 1-63 characters of a-z, 0-9 and '-' that begin and end with a \
                         letter or digit"
                    .into(),
            });
        }
        Ok(())
    }

    /// The canonical bytes of the cluster part (what PCR 12 measures).
    pub fn cluster_bytes(&self) -> Vec<u8> {
        canonical(&self.cluster)
    }

    /// The canonical bytes of the node part (what PCR 13 measures first).
    pub fn node_bytes(&self) -> Vec<u8> {
        canonical(&self.node)
    }

    /// The value the config PCR (12) has once the agent measured this
    /// config: the config is always the log's first event.
    pub fn expected_config_pcr(&self) -> crate::measurement::Digest32 {
        use crate::measurement::{event_digest, extend, EventType};
        extend(
            &[0; 32],
            &event_digest(0, EventType::NodeConfig, &self.cluster_bytes()),
        )
    }

    /// Whether `secret` hashes to the configured init secret hash
    /// ([`crate::init_secret::matches`]: memory-hard, so call it off an
    /// async runtime). False when no hash is configured.
    pub fn init_secret_matches(&self, secret: &[u8]) -> bool {
        crate::init_secret::matches(&self.cluster.init_secret_hash, secret)
    }
}

/// Serialises in declaration order without whitespace: the same value
/// always gives the same bytes.
fn canonical<T: Serialize>(value: &T) -> Vec<u8> {
    // Serialising these plain structs cannot fail.
    serde_json::to_vec(value).unwrap_or_default()
}

/// Reads a file of at most [`MAX_CONFIG_BYTES`].
fn read_bounded(path: &Path) -> Result<Vec<u8>, ConfigError> {
    let read_err = |source| ConfigError::Read {
        path: path.to_owned(),
        source,
    };
    crate::bounded::read(path, MAX_CONFIG_BYTES)
        .map_err(read_err)?
        .ok_or_else(|| ConfigError::TooLarge {
            path: path.to_owned(),
        })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<NodeConfig, ConfigError> {
        NodeConfig::parse(s.as_bytes(), Path::new("test"))
    }

    #[test]
    fn canonical_form_ignores_formatting_and_key_order() {
        let a = parse(r#"{"cluster":{"join_port":1,"init_port":2},"node":{"name":"a"}}"#).unwrap();
        let b = parse(
            "{ \"node\": {\"name\": \"a\"},\n \"cluster\": {\"init_port\": 2, \"join_port\": 1} }",
        )
        .unwrap();
        assert_eq!(a.cluster_bytes(), b.cluster_bytes());
        assert_eq!(a.node_bytes(), b.node_bytes());
        let c = parse(r#"{"cluster":{"join_port":1,"init_port":3}}"#).unwrap();
        assert_ne!(a.cluster_bytes(), c.cluster_bytes());
    }

    #[test]
    fn rejects_unknown_fields_and_bad_values() {
        assert!(matches!(
            parse(r#"{"cluster":{"bogus":1}}"#),
            Err(ConfigError::Parse { .. })
        ));
        for mirror in [
            "http://user:pw@10.0.0.5/k8s/",
            "https://user@m",
            "http://:pw@m?x",
        ] {
            assert!(
                matches!(
                    parse(&format!(
                        r#"{{"cluster":{{"component_mirror":"{mirror}"}}}}"#
                    )),
                    Err(ConfigError::Invalid {
                        field: "cluster.component_mirror",
                        ..
                    })
                ),
                "{mirror}"
            );
        }
        parse(r#"{"cluster":{"component_mirror":"http://10.0.0.5/k8s@v1/"}}"#).unwrap();
        assert!(matches!(
            parse(r#"{"cluster":{"init_secret_hash":"md5:00"}}"#),
            Err(ConfigError::Invalid {
                field: "cluster.init_secret_hash",
                ..
            })
        ));
        assert!(matches!(
            parse(r#"{"cluster":{"control_plane_endpoints":["nohost"]}}"#),
            Err(ConfigError::Invalid { .. })
        ));
        for name in ["UPPER", "cp-", "-cp", "-", "a_b", "a.b"] {
            let doc = format!(r#"{{"node":{{"name":"{name}"}}}}"#);
            assert!(
                matches!(
                    parse(&doc),
                    Err(ConfigError::Invalid {
                        field: "node.name",
                        ..
                    })
                ),
                "{name}"
            );
        }
        assert!(parse(r#"{"node":{"name":"cp-0"}}"#).is_ok());
    }

    #[test]
    fn attestation_variant_is_measured_and_checked() {
        let plain = parse(r#"{"cluster":{"join_port":1}}"#).unwrap();
        let vtpm =
            parse(r#"{"cluster":{"join_port":1,"attestation":{"variant":"vtpm"}}}"#).unwrap();
        // The default variant leaves the measured bytes as they were.
        assert_eq!(plain.cluster_bytes(), vtpm.cluster_bytes());
        assert!(!String::from_utf8(plain.cluster_bytes())
            .unwrap()
            .contains("attestation"));
        assert_eq!(plain.cluster.cpu_policy().unwrap(), CpuPolicy::Vtpm);

        let m = "ab".repeat(48);
        let snp = parse(&format!(
            r#"{{"cluster":{{"join_port":1,"attestation":{{"variant":"sev-snp","sev_snp":{{
                "minimum_tcb":{{"bootloader":3,"tee":0,"snp":8,"microcode":115}},
                "measurement":"{m}"}}}}}}}}"#
        ))
        .unwrap();
        assert_ne!(snp.cluster_bytes(), plain.cluster_bytes());
        assert_ne!(snp.expected_config_pcr(), plain.expected_config_pcr());
        assert!(matches!(
            snp.cluster.cpu_policy().unwrap(),
            CpuPolicy::SevSnp(_)
        ));
        // The VMPL: 0 is the default and measures as before; another is
        // measured; one SNP does not define is refused.
        let snp_at = |vmpl: u32| {
            parse(&format!(
                r#"{{"cluster":{{"join_port":1,"attestation":{{"variant":"sev-snp","sev_snp":{{
                    "minimum_tcb":{{"bootloader":3,"tee":0,"snp":8,"microcode":115}},
                    "measurement":"{m}","vmpl":{vmpl}}}}}}}}}"#
            ))
        };
        assert_eq!(snp_at(0).unwrap().cluster_bytes(), snp.cluster_bytes());
        let at_two = snp_at(2).unwrap();
        assert_ne!(at_two.expected_config_pcr(), snp.expected_config_pcr());
        assert!(matches!(
            at_two.cluster.cpu_policy().unwrap(),
            CpuPolicy::SevSnp(crate::cpu::SnpPolicy { vmpl: 2, .. })
        ));
        assert!(matches!(
            snp_at(4),
            Err(ConfigError::Invalid {
                field: "cluster.attestation",
                ..
            })
        ));

        let tdx = parse(&format!(
            r#"{{"cluster":{{"attestation":{{"variant":"tdx","tdx":{{"mrtd":"{m}",
                "rtmr":["{m}",null,null,null],"allow_tcb_status":["SWHardeningNeeded"]}}}}}}}}"#
        ))
        .unwrap();
        assert!(matches!(
            tdx.cluster.cpu_policy().unwrap(),
            CpuPolicy::Tdx(_)
        ));

        for bad in [
            r#"{"cluster":{"attestation":{"variant":"sev-snp"}}}"#.to_string(),
            r#"{"cluster":{"attestation":{"variant":"tdx"}}}"#.to_string(),
            format!(
                r#"{{"cluster":{{"attestation":{{"variant":"vtpm","tdx":{{"mrtd":"{m}"}}}}}}}}"#
            ),
            format!(
                r#"{{"cluster":{{"attestation":{{"variant":"tdx","tdx":{{"mrtd":"{m}","allow_tcb_status":["Revoked"]}}}}}}}}"#
            ),
            format!(
                r#"{{"cluster":{{"attestation":{{"variant":"tdx","tdx":{{"mrtd":"{m}","allow_tcb_status":["Stale"]}}}}}}}}"#
            ),
        ] {
            assert!(
                matches!(
                    parse(&bad),
                    Err(ConfigError::Invalid {
                        field: "cluster.attestation",
                        ..
                    })
                ),
                "{bad}"
            );
        }
        // A measurement of the wrong length does not parse.
        assert!(matches!(
            parse(r#"{"cluster":{"attestation":{"variant":"tdx","tdx":{"mrtd":"00"}}}}"#),
            Err(ConfigError::Parse { .. })
        ));
    }

    /// Policies written before the per-line minimum and the guest, platform
    /// and TD pins existed: each parses, and its canonical form (what PCR
    /// 12 measures) is byte for byte what it was, so no existing cluster's
    /// config measures differently. Written out by hand: a new field
    /// serialised with its default would show here.
    #[test]
    fn policies_without_the_newer_fields_measure_as_before() {
        let m = "ab".repeat(48);
        let h = "cd".repeat(32);
        let snp = format!(
            r#"{{"cluster":{{"join_port":1,"attestation":{{"variant":"sev-snp","sev_snp":{{"minimum_tcb":{{"bootloader":3,"tee":0,"snp":8,"microcode":115}},"measurement":"{m}","host_data":"{h}","allow_migration_agent":false,"vmpl":2}}}}}}}}"#
        );
        let expected = format!(
            r#"{{"init_secret_hash":"","control_plane_endpoints":[],"init_port":9000,"join_port":1,"component_mirror":null,"ek_ca_pem":"","attestation":{{"variant":"sev-snp","sev_snp":{{"minimum_tcb":{{"bootloader":3,"tee":0,"snp":8,"microcode":115}},"measurement":"{m}","host_data":"{h}","allow_migration_agent":false,"vmpl":2}}}}}}"#
        );
        assert_eq!(
            String::from_utf8(parse(&snp).unwrap().cluster_bytes()).unwrap(),
            expected
        );
        let tdx = format!(
            r#"{{"cluster":{{"join_port":1,"attestation":{{"variant":"tdx","tdx":{{"mrtd":"{m}","rtmr":["{m}",null,null,null],"allow_tcb_status":["SWHardeningNeeded"]}}}}}}}}"#
        );
        let expected = format!(
            r#"{{"init_secret_hash":"","control_plane_endpoints":[],"init_port":9000,"join_port":1,"component_mirror":null,"ek_ca_pem":"","attestation":{{"variant":"tdx","tdx":{{"mrtd":"{m}","rtmr":["{m}",null,null,null],"allow_tcb_status":["SWHardeningNeeded"]}}}}}}"#
        );
        assert_eq!(
            String::from_utf8(parse(&tdx).unwrap().cluster_bytes()).unwrap(),
            expected
        );
    }

    /// The API server endpoint is host:port, measured when given; a value
    /// kubeadm or a kubeconfig would not take is refused at load.
    #[test]
    fn the_api_server_endpoint_is_host_port_and_measured() {
        let with = |e: &str| parse(&format!(r#"{{"cluster":{{"api_server_endpoint":"{e}"}}}}"#));
        for good in ["api.keel.example:6443", "10.0.0.9:6443", "[fd00::9]:443"] {
            let c = with(good).unwrap();
            assert_eq!(c.cluster.api_server_endpoint.as_deref(), Some(good));
            let bytes = String::from_utf8(c.cluster_bytes()).unwrap();
            assert!(
                bytes.ends_with(&format!(r#","api_server_endpoint":"{good}"}}"#)),
                "{bytes}"
            );
            assert_ne!(c.cluster_bytes(), NodeConfig::default().cluster_bytes());
        }
        for bad in [
            "api.keel.example",
            "API.keel.example:6443",
            "https://api.keel.example:6443",
            "api.keel.example:65536",
            "fd00::9:6443",
            ":6443",
            "api keel:6443",
        ] {
            assert!(
                matches!(
                    with(bad),
                    Err(ConfigError::Invalid {
                        field: "cluster.api_server_endpoint",
                        ..
                    })
                ),
                "{bad}"
            );
        }
    }

    #[test]
    fn init_secret_compare() {
        let hash = crate::init_secret::hash(b"secret").unwrap();
        let c = parse(&format!(r#"{{"cluster":{{"init_secret_hash":"{hash}"}}}}"#)).unwrap();
        assert!(c.init_secret_matches(b"secret"));
        assert!(!c.init_secret_matches(b"secreT"));
        // The SHA-256 of earlier configs still parses (a member's config
        // keeps its measurement), but no secret matches it, its own
        // preimage included; anything else that is not argon2id is refused.
        use sha2::Digest as _;
        let fast = hex::encode(sha2::Sha256::digest(b"secret"));
        let c = parse(&format!(
            r#"{{"cluster":{{"init_secret_hash":"sha256:{fast}"}}}}"#
        ))
        .unwrap();
        assert!(!c.init_secret_matches(b"secret"));
        for bad in [format!("sha256:{}", &fast[2..]), format!("sha512:{fast}")] {
            assert!(matches!(
                parse(&format!(r#"{{"cluster":{{"init_secret_hash":"{bad}"}}}}"#)),
                Err(ConfigError::Invalid {
                    field: "cluster.init_secret_hash",
                    ..
                })
            ));
        }
        assert!(!NodeConfig::default().init_secret_matches(b""));
    }

    /// The EK CA bundle is measured as written: one that trusts nothing,
    /// or has a block the node would skip, is refused at load, naming the
    /// field; the built-in default's empty bundle is not.
    #[test]
    fn an_ek_ca_bundle_the_node_would_not_read_whole_is_refused_at_load() {
        let with_pem = |pem: &str| {
            let pem = serde_json::to_string(pem).unwrap();
            parse(&format!(
                r#"{{"cluster":{{"ek_ca_pem":{pem}}},"node":{{"name":"n"}}}}"#
            ))
        };
        with_pem("").unwrap();
        for bundle in [
            "no certificate here",
            "-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n",
        ] {
            let refused = with_pem(bundle).unwrap_err();
            assert!(
                matches!(
                    refused,
                    ConfigError::Invalid {
                        field: "cluster.ek_ca_pem",
                        ..
                    }
                ),
                "{refused}"
            );
        }
    }

    #[test]
    fn a_config_too_large_for_the_event_log_is_refused_at_load() {
        // The PEM's characters count once in the canonical form, like the
        // braces and field names around them (here a CA certificate, then
        // text after its block).
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let ca = params.self_signed(&key).unwrap().pem();
        let with_pem = |len: usize| {
            let pem = serde_json::to_string(&format!("{ca}{}", "A".repeat(len))).unwrap();
            parse(&format!(
                r#"{{"cluster":{{"ek_ca_pem":{pem}}},"node":{{"name":"n"}}}}"#
            ))
        };
        let around = with_pem(0).unwrap();
        let around = around.cluster_bytes().len() + around.node_bytes().len();
        with_pem(MAX_MEASURED_CONFIG_BYTES - around).unwrap();
        let refused = with_pem(MAX_MEASURED_CONFIG_BYTES - around + 1).unwrap_err();
        assert!(
            matches!(&refused, ConfigError::Invalid { field: "cluster", reason }
                if reason.contains(&(MAX_MEASURED_CONFIG_BYTES + 1).to_string())),
            "{refused}"
        );
    }

    #[test]
    fn oversized_source_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("big.json");
        std::fs::write(&path, vec![b' '; (MAX_CONFIG_BYTES + 1) as usize]).unwrap();
        assert!(matches!(
            NodeConfig::load(Some(&path)),
            Err(ConfigError::TooLarge { .. })
        ));
    }
}
