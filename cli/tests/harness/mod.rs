//! What the CLI tests share: a node's TPM measured as the agent measures it,
//! the reference values such a node meets on swtpm, the CLI's settings for
//! it, and the `keel` binary run as an operator runs it.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use keel_agent::measured::{MeasuredTpm, SharedTpm};
use keel_agent::tpm::{TctiSpec, Tpm};
use keel_proto::components::Component;
use keel_testkit::swtpm::{EkCa, Swtpm};
use keel_verifier::config::NodeConfig;
use keel_verifier::measurement::{Event, EventType};
use keel_verifier::measurements::{Expected, Measurements};

/// The init secret the operator holds.
pub const SECRET: &[u8] = b"correct horse battery staple init secret";

/// [`SECRET`] as a node config names it.
pub fn secret_hash() -> String {
    // One salt per test process: configs built apart measure the same.
    static HASH: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    HASH.get_or_init(|| keel_verifier::init_secret::hash(SECRET).unwrap())
        .clone()
}

/// The config of control-plane node `cp-0`, accepting init secrets whose
/// hash is `init_secret_hash`.
pub fn control_plane_config(init_secret_hash: &str) -> NodeConfig {
    let doc = serde_json::json!({
        "cluster": {"init_secret_hash": init_secret_hash},
        "node": {"name": "cp-0", "role": "control-plane"},
    });
    NodeConfig::parse(doc.to_string().as_bytes(), "t".as_ref()).unwrap()
}

/// [`control_plane_config`] of a node that can run a control plane once
/// initialised: it trusts `ca`'s EK certificates (the CA must have
/// manufactured a TPM: its certificates exist from then on).
pub fn serving_control_plane_config(init_secret_hash: &str, ca: &EkCa) -> NodeConfig {
    let ek_ca = String::from_utf8(ca.issuer_pem().unwrap()).unwrap();
    let doc = serde_json::json!({
        "cluster": {"init_secret_hash": init_secret_hash, "ek_ca_pem": ek_ca},
        "node": {"name": "cp-0", "role": "control-plane"},
    });
    NodeConfig::parse(doc.to_string().as_bytes(), "t".as_ref()).unwrap()
}

/// Opens `swtpm` and measures `config` as the agent does at start, with its
/// event log at `log`.
pub fn measured(swtpm: &Swtpm, log: &Path, config: &NodeConfig) -> SharedTpm {
    let tpm = Tpm::open(&swtpm.tcti().parse::<TctiSpec>().unwrap()).unwrap();
    let mut measured = MeasuredTpm::open(tpm, log).unwrap();
    measured
        .record(EventType::NodeConfig, "config", config.cluster_bytes())
        .unwrap();
    measured
        .record(EventType::NodeIdentity, "node", config.node_bytes())
        .unwrap();
    measured.shared()
}

/// The events of `event_type` in the log of `tpm`, in order.
pub fn events(tpm: &SharedTpm, event_type: EventType) -> Vec<Event> {
    tpm.lock()
        .unwrap()
        .events()
        .iter()
        .filter(|e| e.event_type == event_type)
        .cloned()
        .collect()
}

/// What a node on swtpm measures, enforced: PCRs 4, 9 and 11 are zero
/// there, PCR 12 is `pcr12`; then PCR 15 as `pcr15`.
pub fn measurements(pcr12: [u8; 32], pcr15: Expected) -> Measurements {
    Measurements::new([
        (4, Expected::enforced([0; 32])),
        (9, Expected::enforced([0; 32])),
        (11, Expected::enforced([0; 32])),
        (12, Expected::enforced(pcr12)),
        (15, pcr15),
    ])
    .unwrap()
}

/// What the CLI is told about the node it initialises.
pub struct Settings<'a> {
    /// The node's init endpoint.
    pub endpoint: SocketAddr,
    /// What the CLI expects the node to measure.
    pub measurements: &'a Measurements,
    /// The CA of the node's EK certificate.
    pub ek_ca: &'a EkCa,
    /// The init secret the CLI sends.
    pub init_secret: &'a [u8],
    /// The components the CLI sends, if any.
    pub components: Option<&'a [Component]>,
}

impl Settings<'_> {
    /// Writes the settings file `keel.json` and the files it names into
    /// `dir`; returns the settings file.
    pub fn write(&self, dir: &Path) -> PathBuf {
        std::fs::write(dir.join("measurements.json"), self.measurements.to_json()).unwrap();
        std::fs::write(dir.join("ek-ca.pem"), self.ek_ca.issuer_pem().unwrap()).unwrap();
        std::fs::write(dir.join("init-secret"), self.init_secret).unwrap();
        let mut settings = serde_json::json!({
            "endpoint": self.endpoint.to_string(),
            "kubernetes_version": "v1.31",
            "measurements": "measurements.json",
            "ek_ca": "ek-ca.pem",
            "init_secret_file": "init-secret",
        });
        if let Some(components) = self.components {
            let list: Vec<serde_json::Value> = components
                .iter()
                .map(|c| serde_json::json!({"url": c.url, "hash": c.hash, "install_path": c.install_path, "extract": c.extract}))
                .collect();
            std::fs::write(
                dir.join("components.json"),
                serde_json::to_vec(&list).unwrap(),
            )
            .unwrap();
            settings["components_file"] = "components.json".into();
        }
        let path = dir.join("keel.json");
        std::fs::write(&path, settings.to_string()).unwrap();
        path
    }
}

/// `keel <args> --settings <settings> [--workspace <workspace>]`.
pub fn keel(args: &[&str], settings: &Path, workspace: Option<&Path>) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_keel"));
    cmd.args(args).arg("--settings").arg(settings);
    if let Some(workspace) = workspace {
        cmd.arg("--workspace").arg(workspace);
    }
    cmd
}

/// Runs [`keel`] to its end without blocking the test's runtime.
pub async fn run_keel(args: &[&str], settings: &Path, workspace: Option<&Path>) -> Output {
    tokio::process::Command::from(keel(args, settings, workspace))
        .output()
        .await
        .unwrap()
}

/// What a run printed, stdout then stderr.
pub fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}
