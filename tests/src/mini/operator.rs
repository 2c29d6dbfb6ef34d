//! `keel revoke`, `keel status` and `keel upgrade apply --kubernetes` as
//! the operator runs them against the nodes: the settings name the measurements (PCR 15 judged by the
//! event log: each must be locked into the workspace's cluster) and the EK
//! CA; the workspace holds the master secret the proofs are made with.

use std::ffi::OsString;
use std::path::Path;

use serde::Deserialize;

use super::MiniError;

/// What a refused rejoin of a revoked node says on its console.
pub const REVOKED_MARK: &str = "the node is revoked";

/// One node in a control plane's registry.
#[derive(Clone, Debug, Deserialize)]
pub struct NodeStatus {
    /// Its measured name.
    pub name: String,
    /// Its measured role.
    pub role: String,
    /// SHA-256 of its EK (hex).
    pub ek: String,
    /// Its state disk's UUID.
    pub disk_uuid: String,
    /// `registered`, `trusted`, `drifted` or `silent`.
    pub verdict: String,
    /// Unix time of its last evidence.
    pub last_evidence_at: Option<u64>,
    /// Why its last evidence failed, or why it is silent.
    pub reason: Option<String>,
}

/// One revocation.
#[derive(Clone, Debug, Deserialize)]
pub struct RevokedNode {
    /// The node's name.
    pub name: String,
    /// Its EK hash (hex).
    pub ek: String,
    /// Its disk UUID.
    pub disk_uuid: String,
}

/// A control plane's registry.
#[derive(Clone, Debug, Deserialize)]
pub struct Registry {
    /// Nodes by EK hash.
    pub nodes: std::collections::BTreeMap<String, NodeStatus>,
    /// The revocation list.
    pub revoked: Vec<RevokedNode>,
}

/// One control plane's view in `keel status -o json`.
#[derive(Clone, Debug, Deserialize)]
pub struct View {
    /// The control plane's init port, as given.
    pub endpoint: String,
    /// Its registry.
    pub registry: Registry,
}

/// What `keel status -o json` prints.
#[derive(Clone, Debug, Deserialize)]
pub struct Status {
    /// One view per control plane, in the order named.
    pub control_planes: Vec<View>,
}

impl Registry {
    /// The node named `name`, if the registry has it.
    pub fn node(&self, name: &str) -> Option<&NodeStatus> {
        self.nodes.values().find(|n| n.name == name)
    }
}

fn with_endpoints(
    mut args: Vec<OsString>,
    settings: &Path,
    workspace: &Path,
    ports: &[u16],
) -> Vec<OsString> {
    args.extend(["--settings".into(), settings.into()]);
    args.extend(["--workspace".into(), workspace.into()]);
    for port in ports {
        args.extend(["--endpoint".into(), format!("127.0.0.1:{port}").into()]);
    }
    args
}

/// Runs `keel revoke node` against the control planes on the init `ports`;
/// its output goes to `log`. Returns whether it succeeded.
pub fn revoke(
    keel: &Path,
    settings: &Path,
    workspace: &Path,
    ports: &[u16],
    node: &str,
    log: &Path,
) -> Result<bool, MiniError> {
    let args = with_endpoints(
        vec!["revoke".into(), node.into()],
        settings,
        workspace,
        ports,
    );
    Ok(super::run_keel(keel, args, log)?.status.success())
}

/// Runs `keel upgrade apply --kubernetes version` with the stand-in
/// `components` against the nodes on the init `ports` (control planes
/// first); its output goes to `log`. Returns whether it succeeded.
pub fn upgrade_kubernetes(
    keel: &Path,
    settings: &Path,
    workspace: &Path,
    ports: &[u16],
    version: &str,
    components: &Path,
    log: &Path,
) -> Result<bool, MiniError> {
    let args = with_endpoints(
        vec![
            "upgrade".into(),
            "apply".into(),
            "--kubernetes".into(),
            version.into(),
            "--components".into(),
            components.into(),
            "--skip-phases".into(),
            "image".into(),
        ],
        settings,
        workspace,
        ports,
    );
    Ok(super::run_keel(keel, args, log)?.status.success())
}

/// Runs `keel status -o json` against the control planes on the init
/// `ports`; its output goes to `log`.
pub fn status(
    keel: &Path,
    settings: &Path,
    workspace: &Path,
    ports: &[u16],
    log: &Path,
) -> Result<Status, MiniError> {
    let args = with_endpoints(
        vec!["status".into(), "-o".into(), "json".into()],
        settings,
        workspace,
        ports,
    );
    let output = super::run_keel(keel, args, log)?;
    if !output.status.success() {
        return Err(MiniError::Check(format!(
            "keel status failed; see {}",
            log.display()
        )));
    }
    serde_json::from_slice(&output.stdout).map_err(|e| {
        MiniError::Check(format!(
            "keel status printed no report ({e}); see {}",
            log.display()
        ))
    })
}
