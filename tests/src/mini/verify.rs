//! `keel verify -o json` against a node, read as a structured report.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use keel_verifier::measurement::{Event, EventType};
use serde::Deserialize;

use super::MiniError;

/// The report `keel verify -o json` prints.
#[derive(Clone, Debug, Deserialize)]
pub struct VerifyReport {
    /// The node's init server.
    pub endpoint: String,
    /// EK certificate trusted, quote valid, event log replays.
    pub attested: bool,
    /// Attested, and every enforced PCR matches.
    pub verified: bool,
    /// Why the node was not attested.
    pub error: Option<String>,
    /// The quoted PCRs (hex).
    pub pcrs: BTreeMap<u32, String>,
    /// Every PCR that differs from the measurements.
    pub mismatches: Vec<PcrMismatch>,
    /// The agent's event log.
    pub events: Vec<Event>,
    /// SHA-256 of the node's EK public area (hex), what its disk key is
    /// bound to.
    #[serde(default)]
    pub ek_digest: Option<String>,
}

/// One PCR that differs from the measurements.
#[derive(Clone, Debug, Deserialize)]
pub struct PcrMismatch {
    /// The PCR.
    pub pcr: u32,
    /// The expected value (hex).
    pub expected: String,
    /// The node's value (hex), if it reported one.
    pub actual: Option<String>,
    /// Only a warning.
    pub warn_only: bool,
}

/// A run of `keel verify -o json`.
#[derive(Clone, Debug)]
pub struct Verification {
    /// Whether `keel verify` exited with status 0.
    pub success: bool,
    /// Its report.
    pub report: VerifyReport,
}

impl VerifyReport {
    /// The enforced PCRs that differ, in order.
    pub fn refused_pcrs(&self) -> Vec<u32> {
        self.mismatches
            .iter()
            .filter(|m| !m.warn_only)
            .map(|m| m.pcr)
            .collect()
    }

    /// The cluster ID the node locked to (hex): the data of its
    /// `cluster-id` event, if any.
    pub fn cluster_id(&self) -> Option<String> {
        self.events
            .iter()
            .find(|e| e.event_type == EventType::ClusterId)
            .map(|e| hex::encode(&e.data))
    }

    /// How many components the node measured into its event log.
    pub fn components(&self) -> usize {
        self.events
            .iter()
            .filter(|e| e.event_type == EventType::Component)
            .count()
    }

    /// A PCR's value (hex), if reported.
    pub fn pcr(&self, pcr: u32) -> Option<&str> {
        self.pcrs.get(&pcr).map(String::as_str)
    }
}

/// Runs `keel verify -o json --settings settings --wait wait` and reads
/// its report: `wait` is how long a node that does not answer yet is tried
/// again. The report is required whatever the exit status; `log` receives
/// it.
pub fn run(
    keel: &Path,
    settings: &Path,
    wait: Duration,
    log: &Path,
) -> Result<Verification, MiniError> {
    // The log is for people; the report below is what counts.
    let wait = wait.as_secs().to_string();
    let args = [
        std::ffi::OsStr::new("verify"),
        "-o".as_ref(),
        "json".as_ref(),
        "--settings".as_ref(),
        settings.as_os_str(),
        "--wait".as_ref(),
        wait.as_ref(),
    ];
    let output = super::run_keel(keel, args, log)?;
    let report = serde_json::from_slice(&output.stdout).map_err(|source| MiniError::Json {
        path: log.to_owned(),
        source,
    })?;
    Ok(Verification {
        success: output.status.success(),
        report,
    })
}
