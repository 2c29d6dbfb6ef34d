//! What the cluster's files say, written with serde: each node's config
//! (passed by fw_cfg), the predicted measurements, the init secret and the
//! operator CLI's settings.

use std::io::Write as _;
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::Path;

use keel_image::predict::{self, Uki};
use keel_verifier::config::{
    ClusterConfig, EvidenceConfig, EvidencePolicy, NodeConfig, NodeIdentity, Role,
};
use keel_verifier::measurements::{Expected, Measurements};
use rand::RngCore as _;
use serde::Serialize;

use super::{io, MiniError};

/// The init server's port inside a VM.
pub const GUEST_INIT_PORT: u16 = 9000;
/// The join service's port inside a VM.
pub const GUEST_JOIN_PORT: u16 = 9090;
/// The host's loopback as the VMs see it (QEMU user networking).
pub const GUEST_HOST: &str = "10.0.2.2";
/// The state disk's device inside a VM.
pub const STATE_DISK_DEVICE: &str = "/dev/vdb";
/// Seconds between a member's evidence in the local cluster: short, so a
/// scenario sees verdicts quickly (part of the cluster config, PCR 12).
pub const EVIDENCE_INTERVAL_SECONDS: u32 = 10;
/// The PCR that holds the cluster ID once a node is locked.
pub const PCR_CLUSTER_ID: u32 = 15;

/// Measurements a fresh node must match (PCR 15 zero enforced): what
/// `keel init` checks, and what the join service admits.
pub const MEASUREMENTS: &str = "measurements.json";
/// The same with PCR 15 warn-only: a member node verifies against it.
pub const MEASUREMENTS_MEMBER: &str = "measurements.verify.json";
/// The EK CA certificate the nodes and the CLI trust.
pub const EK_CA: &str = "ek-ca.pem";
/// The init secret (hex), mode 0600.
pub const INIT_SECRET: &str = "init-secret";
/// The component list the mirror serves.
pub const COMPONENTS: &str = "components.json";
/// The stand-in components of the version scenario 11 upgrades to.
pub const UPGRADE_COMPONENTS: &str = "components-upgrade.json";
/// The version the local cluster runs, and the one scenario 11 moves to.
pub const KUBERNETES_VERSION: &str = "v1.31.13";
/// See [`KUBERNETES_VERSION`].
pub const UPGRADE_VERSION: &str = "v1.32.9";

/// The join endpoint of a control plane as the VMs reach it: the host
/// port forwarded to its join service, on the host's address.
pub fn join_endpoint(host_port: u16) -> String {
    format!("{GUEST_HOST}:{host_port}")
}

/// The config of a node of this cluster: the cluster part is the same on
/// every node (it is measured into PCR 12), so it lists the join endpoint
/// of every control plane (`join_ports`: the host ports forwarded to
/// them, in order), chosen before any config is written.
pub fn node_config(
    name: &str,
    role: Role,
    secret_hash: &str,
    join_ports: &[u16],
    ek_ca_pem: &str,
) -> NodeConfig {
    NodeConfig {
        cluster: ClusterConfig {
            init_secret_hash: secret_hash.to_owned(),
            control_plane_endpoints: join_ports.iter().map(|p| join_endpoint(*p)).collect(),
            init_port: GUEST_INIT_PORT,
            join_port: GUEST_JOIN_PORT,
            component_mirror: None,
            ek_ca_pem: ek_ca_pem.to_owned(),
            attestation: Default::default(),
            evidence: EvidenceConfig {
                interval_seconds: EVIDENCE_INTERVAL_SECONDS,
                policy: EvidencePolicy::Log,
            },
            measurements_signing_key: None,
            // The VMs reach each other through the host's forwarded ports:
            // no address reaches every control plane's API server.
            api_server_endpoint: None,
        },
        node: NodeIdentity {
            name: name.to_owned(),
            role,
            state_disk: Some(STATE_DISK_DEVICE.to_owned()),
        },
    }
}

/// Writes `value` as pretty JSON to `path`.
pub fn write_json<T: Serialize>(path: &Path, value: &T) -> Result<(), MiniError> {
    let json = serde_json::to_vec_pretty(value).map_err(|source| MiniError::Json {
        path: path.to_owned(),
        source,
    })?;
    std::fs::write(path, json).map_err(io(path))
}

/// Creates a random init secret (64 hex digits) in `path` with mode 0600
/// and returns its hash as the node config names it (argon2id,
/// [`keel_verifier::init_secret`]).
pub fn init_secret(path: &Path) -> Result<String, MiniError> {
    let mut bytes = [0u8; 32];
    rand::rngs::OsRng.fill_bytes(&mut bytes);
    let secret = hex::encode(bytes);
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .map_err(io(path))?;
    file.write_all(secret.as_bytes()).map_err(io(path))?;
    keel_verifier::init_secret::hash(secret.as_bytes())
        .map_err(|e| io(path)(std::io::Error::other(e.to_string())))
}

/// The measurements of `uki` booted with `config`: keel-measure's
/// ([`predict::measurements`]: PCR 2 with no firmware driver from outside
/// OVMF, as the VMs have no option ROMs; 4, 9, 11 from the UKI; 12 from the
/// config), and PCR 15 zero (enforced, or warn-only for a member).
pub fn measurements(
    uki: &Path,
    config: &NodeConfig,
    member: bool,
) -> Result<Measurements, MiniError> {
    let bytes = std::fs::read(uki).map_err(io(uki))?;
    let predicted = |e: predict::PredictError| {
        MiniError::Check(format!("predicting the PCRs of {}: {e}", uki.display()))
    };
    let uki = Uki::parse(&bytes).map_err(predicted)?;
    let image =
        predict::measurements(&uki, config, predict::FirmwareDrivers::None).map_err(predicted)?;
    let pcr15 = if member {
        Expected::warn_only([0; 32])
    } else {
        Expected::enforced([0; 32])
    };
    Measurements::new(
        image
            .iter()
            .map(|(pcr, expected)| (*pcr, expected.clone()))
            .chain([(PCR_CLUSTER_ID, pcr15)]),
    )
    .map_err(|e| MiniError::Check(format!("the predicted measurements: {e}")))
}

/// The operator CLI's settings file (`keel init`, `keel verify`); paths
/// are relative to the file.
#[derive(Debug, Serialize)]
pub struct CliSettings<'a> {
    /// The node's init server, `host:port`.
    pub endpoint: String,
    /// Kubernetes version.
    pub kubernetes_version: &'a str,
    /// The measurements file.
    pub measurements: &'a str,
    /// The EK CA bundle.
    pub ek_ca: &'a str,
    /// The init secret file.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub init_secret_file: Option<&'a str>,
    /// The component list.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub components_file: Option<&'a str>,
}

impl<'a> CliSettings<'a> {
    /// Settings for `keel init` against `127.0.0.1:port`.
    pub fn init(port: u16) -> Self {
        Self {
            endpoint: format!("127.0.0.1:{port}"),
            kubernetes_version: "v1.31",
            measurements: MEASUREMENTS,
            ek_ca: EK_CA,
            init_secret_file: Some(INIT_SECRET),
            components_file: Some(COMPONENTS),
        }
    }

    /// Settings for `keel verify` against `127.0.0.1:port` with the
    /// measurements file `measurements`.
    pub fn verify(port: u16, measurements: &'a str) -> Self {
        Self {
            endpoint: format!("127.0.0.1:{port}"),
            kubernetes_version: "v1.31",
            measurements,
            ek_ca: EK_CA,
            init_secret_file: None,
            components_file: None,
        }
    }

    /// Settings for `keel recover` against `127.0.0.1:port`: those of
    /// `keel verify` with the init secret, which recovery proves too.
    pub fn recover(port: u16) -> Self {
        Self {
            init_secret_file: Some(INIT_SECRET),
            ..Self::verify(port, MEASUREMENTS)
        }
    }
}
