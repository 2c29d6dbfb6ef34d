//! `keel verify`: check a node's attestation and print what it attests.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use keel_atls::AtlsClient;
use keel_verifier::ek::EkDigest;
use keel_verifier::measurement::{Event, HexDigest};
use keel_verifier::measurements::{Measurements, Mismatch};
use keel_verifier::validator::{check_cluster_lock, Verified};
use serde::Serialize;

use crate::printable::printable;
use crate::settings::Settings;

/// How `keel verify` prints its result.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Output {
    /// Lines for a person; fails on the first refusal.
    #[default]
    Text,
    /// One JSON document ([`Report`]), printed whether or not the node
    /// verified; the exit status is 0 only if it did.
    Json,
}

/// The JSON form of one verification.
#[derive(Debug, Serialize)]
struct Report {
    /// The node's init server.
    endpoint: String,
    /// The document is valid: EK certificate trusted, quote by the AK over
    /// this handshake's nonce, event log replays to the quoted PCRs.
    attested: bool,
    /// Attested, and every enforced PCR matches the measurements.
    verified: bool,
    /// Why the node was not attested (unreachable, invalid document).
    error: Option<String>,
    /// The quoted PCR values (hex).
    pcrs: BTreeMap<u32, String>,
    /// Every PCR that differs from the measurements, warn-only ones too.
    mismatches: Vec<MismatchReport>,
    /// The agent's event log.
    events: Vec<Event>,
    /// SHA-256 of the node's marshalled EK public area (hex): what its
    /// disk key is bound to.
    ek_digest: Option<String>,
    /// With `--cluster-id`: the expected cluster and whether the node is
    /// locked into exactly it (part of `verified`).
    #[serde(skip_serializing_if = "Option::is_none")]
    cluster: Option<ClusterReport>,
}

/// The node's lock against an expected cluster ID.
#[derive(Debug, Serialize)]
struct ClusterReport {
    /// The expected cluster ID (hex).
    expected: String,
    /// Locked into exactly it: one cluster-ID event naming it, PCR 15 its extend.
    member: bool,
    /// Why not.
    error: Option<String>,
}

/// Parses a hex cluster ID.
fn parse_cluster_id(text: &str) -> anyhow::Result<[u8; 32]> {
    let mut id = [0u8; 32];
    hex::decode_to_slice(text.trim(), &mut id).context("--cluster-id must be 64 hex digits")?;
    Ok(id)
}

/// One PCR that differs from the measurements.
#[derive(Debug, Serialize)]
struct MismatchReport {
    pcr: u32,
    expected: String,
    /// `None`: the node did not report the PCR.
    actual: Option<String>,
    warn_only: bool,
}

impl From<&Mismatch> for MismatchReport {
    fn from(m: &Mismatch) -> Self {
        Self {
            pcr: m.pcr,
            expected: hex::encode(m.expected),
            actual: m.actual.map(hex::encode),
            warn_only: m.warn_only,
        }
    }
}

/// Runs `keel verify`.
pub async fn run(
    settings_path: &Path,
    endpoint: Option<String>,
    output: Output,
    cluster_id: Option<&str>,
    wait: Duration,
) -> anyhow::Result<()> {
    let settings = Settings::load(settings_path)?;
    let endpoint = endpoint.unwrap_or_else(|| settings.endpoint.clone());
    let uri = Settings::grpc_endpoint(&endpoint)?;
    let measurements = settings.measurements()?;
    let cluster_id = cluster_id.map(parse_cluster_id).transpose()?;
    if output == Output::Json {
        let client = AtlsClient::server_attested(Arc::new(
            settings.diagnostic_validator(measurements.clone())?,
        ));
        let connected = reach(&client, &endpoint, uri.uri(), wait).await;
        return report(&settings, measurements, endpoint, connected, cluster_id);
    }
    let client = AtlsClient::server_attested(Arc::new(settings.validator(measurements)?));
    let stream = reach(&client, &endpoint, uri.uri(), wait)
        .await
        .map_err(|e| anyhow::anyhow!("{}", keel_atls::ErrorChain(&e)))
        .with_context(|| format!("{endpoint}: attestation not accepted"))?;
    let attested = stream
        .peer()
        .attested()
        .context("the node presented no attestation")?;
    let v = attested.claims();
    settings
        .check_node_attestation(v)
        .with_context(|| format!("{endpoint}: attestation not accepted"))?;
    if let Some(id) = &cluster_id {
        if let Err(why) = check_cluster_lock(v, id) {
            anyhow::bail!(
                "{endpoint}: not a member of cluster {}: {why}",
                hex::encode(id)
            );
        }
        println!("{endpoint}: locked into cluster {}", hex::encode(id));
    }
    println!("{endpoint}: attestation verified");
    println!(
        "attestation key: proven resident in the TPM of the certified EK (credential activation)"
    );
    for (pcr, value) in &v.pcrs {
        println!("pcr {pcr:2} {}", HexDigest(value));
    }
    for w in &v.warnings {
        println!("warning: {}", printable(&w.to_string()));
    }
    println!(
        "event log ({} events, replays to PCRs 12, 13, 15):",
        v.events.len()
    );
    for e in &v.events {
        println!(
            "  #{} pcr {} {}: {}",
            e.seq,
            e.pcr,
            e.event_type.as_str(),
            printable(&e.description)
        );
    }
    Ok(())
}

/// Connects to the node at `endpoint` (reached at `uri`), retrying for up
/// to `wait` while it is unreachable.
async fn reach(
    client: &AtlsClient<Verified>,
    endpoint: &str,
    uri: &tonic::codegen::http::Uri,
    wait: Duration,
) -> Result<keel_atls::AtlsStream<Verified>, keel_atls::ConnectError> {
    crate::reach::until_reachable(endpoint, wait, || client.connect_uri(uri)).await
}

/// `-o json`: the connection was validated with a diagnostic validator
/// (every check, but measurement mismatches reported rather than refused),
/// so a node that differs is still reported PCR by PCR; its PCRs are judged
/// here against the real measurements. Nothing is sent to the node.
fn report(
    settings: &Settings,
    measurements: Measurements,
    endpoint: String,
    connected: Result<keel_atls::AtlsStream<Verified>, keel_atls::ConnectError>,
    cluster_id: Option<[u8; 32]>,
) -> anyhow::Result<()> {
    let verified: Result<Verified, String> = match connected {
        Ok(stream) => stream
            .peer()
            .attested()
            .map(|a| a.claims().clone())
            .ok_or_else(|| "the node presented no attestation".to_owned()),
        Err(e) => Err(keel_atls::ErrorChain(&e).to_string()),
    };
    let report = match verified {
        Ok(v) => {
            let mismatches = measurements.compare(&v.pcrs);
            // As in text mode: the node's measured config must name the
            // settings' attestation variant and CPU values.
            let variant = settings
                .check_node_attestation(&v)
                .err()
                .map(|e| format!("{e:#}"));
            let cluster = cluster_id.map(|id| {
                let lock = check_cluster_lock(&v, &id);
                ClusterReport {
                    expected: hex::encode(id),
                    member: lock.is_ok(),
                    error: lock.err().map(str::to_owned),
                }
            });
            Report {
                endpoint,
                attested: true,
                verified: variant.is_none()
                    && mismatches.iter().all(|m| m.warn_only)
                    && cluster.as_ref().is_none_or(|c| c.member),
                cluster,
                error: variant,
                pcrs: v.pcrs.iter().map(|(p, d)| (*p, hex::encode(d))).collect(),
                mismatches: mismatches.iter().map(Into::into).collect(),
                ek_digest: Some(hex::encode(EkDigest::of_public(&v.ek).as_bytes())),
                events: v.events,
            }
        }
        Err(error) => Report {
            endpoint,
            attested: false,
            verified: false,
            error: Some(error),
            pcrs: BTreeMap::new(),
            mismatches: Vec::new(),
            events: Vec::new(),
            ek_digest: None,
            cluster: cluster_id.map(|id| ClusterReport {
                expected: hex::encode(id),
                member: false,
                error: Some("the node was not attested".into()),
            }),
        },
    };
    println!("{}", crate::printable::json_pretty(&report)?);
    anyhow::ensure!(
        report.verified,
        "{}: not verified (see the report)",
        report.endpoint
    );
    Ok(())
}
