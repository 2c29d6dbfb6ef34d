//! `keel recover` as the operator runs it when no control plane serves
//! joins: it validates the node's attestation (the measurements with PCR
//! 15 zero, the EK CA) and seals the master secret from `keel init`'s
//! workspace to the node's TPM; the node reopens its state disk and locks
//! to the cluster ID stored there.

use std::ffi::OsString;
use std::path::Path;

use serde::Deserialize;

use super::MiniError;

/// What `keel recover -o json` prints on success.
#[derive(Clone, Debug, Deserialize)]
pub struct RecoverReport {
    /// The node's recovery endpoint, as given.
    pub endpoint: String,
    /// The cluster ID the node locked to again (hex).
    pub cluster_id: String,
}

/// A run of `keel recover`.
#[derive(Clone, Debug)]
pub struct Recovery {
    /// Whether it exited with status 0.
    pub success: bool,
    /// Its report, when standard output held one.
    pub report: Option<RecoverReport>,
}

/// The command line of `keel recover` against `127.0.0.1:port`: the
/// settings file names the measurements and the EK CA the node is
/// validated with (as for `keel init` and `keel verify`), the workspace
/// holds the master secret `keel init` wrote.
fn args(settings: &Path, port: u16, workspace: &Path) -> Vec<OsString> {
    vec![
        "recover".into(),
        "--settings".into(),
        settings.into(),
        "--endpoint".into(),
        format!("127.0.0.1:{port}").into(),
        "--workspace".into(),
        workspace.into(),
        "-o".into(),
        "json".into(),
    ]
}

/// Runs `keel recover` (see [`args`]); its output goes to `log`. The
/// report is read from standard output whatever the exit status.
pub fn run(
    keel: &Path,
    settings: &Path,
    port: u16,
    workspace: &Path,
    log: &Path,
) -> Result<Recovery, MiniError> {
    let output = super::run_keel(keel, args(settings, port, workspace), log)?;
    Ok(Recovery {
        success: output.status.success(),
        report: serde_json::from_slice(&output.stdout).ok(),
    })
}
