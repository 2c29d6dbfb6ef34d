//! `keel verify`: check a node's attestation and print what it attests.

use std::path::Path;
use std::sync::Arc;

use anyhow::Context as _;
use keel_atls::AtlsClient;
use keel_verifier::measurement::HexDigest;

use crate::settings::Settings;

/// Runs `keel verify`.
pub async fn run(settings_path: &Path, endpoint: Option<String>) -> anyhow::Result<()> {
    let settings = Settings::load(settings_path)?;
    let endpoint = endpoint.unwrap_or_else(|| settings.endpoint.clone());
    let (host, port) = Settings::host_port(&endpoint)?;
    let client =
        AtlsClient::server_attested(Arc::new(settings.validator(settings.measurements()?)?));
    let stream = client
        .connect(&host, port)
        .await
        .map_err(|e| anyhow::anyhow!("{}", keel_atls::ErrorChain(&e)))
        .with_context(|| format!("{endpoint}: attestation not accepted"))?;
    let attested = stream
        .peer()
        .attested()
        .context("the node presented no attestation")?;
    let v = attested.claims();
    println!("{endpoint}: attestation verified");
    println!(
        "attestation key: proven resident in the TPM of the certified EK (credential activation)"
    );
    for (pcr, value) in &v.pcrs {
        println!("pcr {pcr:2} {}", HexDigest(value));
    }
    for w in &v.warnings {
        println!("warning: {w}");
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
            e.description
        );
    }
    Ok(())
}
