//! `keel recover`: bring back a control plane when no join service is left
//! to rejoin it.
//!
//! The node is validated like for init (EK chain, quote, measurements) and
//! must be outside any cluster (PCR 15 zero); only then are the master
//! secret from the workspace and the init secret from the settings sealed
//! to that node's TPM and sent, unless the workspace revoked the node's EK
//! (`keel revoke`). The workspace's revoked EKs go with it, for the node's
//! revocation list. The node checks the init secret against its measured
//! config, and that the master secret opens its state disk, before it
//! changes anything.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use keel_atls::AtlsClient;
use keel_proto::recovery::recovery_service_client::RecoveryServiceClient;
use keel_proto::recovery::{RecoverRequest, RecoverySecrets};
use keel_verifier::credential;
use keel_verifier::measurement::pcr;
use prost::Message as _;
use serde::Serialize;
use zeroize::{Zeroize as _, Zeroizing};

use crate::init::connect;
use crate::settings::Settings;
use crate::verify::Output;
use crate::workspace::MasterSecret;

/// How long the node may take to recover (open its disk, start the kubelet):
/// a little longer than the node's own bound on a request of its init port
/// (`OPERATOR_PORT_REQUEST_TIMEOUT` in the agent, 300 s), whose answer
/// then comes first.
const RECOVER_TIMEOUT: Duration = Duration::from_secs(330);

#[derive(Serialize)]
struct Report {
    endpoint: String,
    cluster_id: String,
    seconds: f64,
}

/// Runs `keel recover`.
pub async fn run(
    settings_path: &Path,
    endpoint: Option<String>,
    workspace: &Path,
    output: Output,
    wait: Duration,
) -> anyhow::Result<()> {
    let started = Instant::now();
    let settings = Settings::load(settings_path)?;
    let endpoint = endpoint.unwrap_or_else(|| settings.endpoint.clone());
    let secret = MasterSecret::load(workspace)?;
    // The cluster these secrets make, which the node must lock to; the
    // workspace's ID file, where it has one, must name it. Checked before
    // anything is sent: a node given the wrong measurement salt would lock
    // and refuse only then (and need a reboot).
    let cluster_id =
        crate::workspace::checked_cluster_id(workspace, &secret).context("nothing was sent")?;
    // The node takes the master secret only with the init secret: the
    // master secret proves no operator to a node whose disk the host chose.
    let init_secret = crate::init::read_init_secret(&settings)
        .context("recovery proves the operator with the init secret, as init does")?;
    let mut secrets = RecoverySecrets {
        master_secret: secret.key.to_vec(),
        master_salt: secret.salt.clone(),
        init_secret: init_secret.to_vec(),
    };
    let payload = Zeroizing::new(secrets.encode_to_vec());
    secrets.master_secret.zeroize();
    secrets.master_salt.zeroize();
    secrets.init_secret.zeroize();

    // The node must be one of ours (the measurements) and in no cluster:
    // a node that already rejoined has PCR 15 set and gets nothing.
    let mut measurements = settings.measurements()?;
    // After an image rollout, only the current or the staged image, as the
    // workspace recorded them: the settings may still name a retired one.
    if let Some(image) = crate::workspace::ImageRecord::load(workspace)? {
        image.require(&measurements).context("nothing was sent")?;
    }
    measurements.require(pcr::CLUSTER_ID, [0; 32]);
    let client = AtlsClient::server_attested(Arc::new(settings.validator(measurements)?));
    let uri = Settings::grpc_endpoint(&endpoint)?.timeout(RECOVER_TIMEOUT);
    if output == Output::Text {
        eprintln!(
            "connecting to {} and verifying its attestation",
            crate::printable::printable(&endpoint)
        );
    }
    let bound = connect(&client, &endpoint, uri, wait).await?;
    let attested = bound
        .attested
        .context("the node presented no attestation")?;
    let verified = attested.claims();
    let revoked = crate::workspace::RevokedRecord::load(workspace).context("nothing was sent")?;
    settings
        .check_node_attestation(verified)
        .and_then(|()| crate::init::check_control_plane(verified))
        .and_then(|()| revoked.refuse(&keel_verifier::ek::EkDigest::of_public(&verified.ek)))
        .context("nothing was sent")?;
    crate::init::check_init_secret(
        verified,
        &init_secret,
        keel_verifier::init_secret::matches_any_form,
    )?;
    let sealed = credential::seal(&verified.ek, &verified.ak.name, &payload)
        .context("sealing the secrets to the node's TPM")?;
    if output == Output::Text {
        eprintln!("node attested and outside any cluster; sending the sealed secrets");
    }
    // The channel's timeout ends with the answer's headers; this one
    // covers its body too.
    let mut client = RecoveryServiceClient::new(bound.channel)
        .max_decoding_message_size(keel_proto::MAX_RECOVER_RESPONSE_BYTES);
    // Every node the workspace revoked stays revoked at the node, which
    // may have been down when the revocation was made and be the only
    // control plane left.
    let call = client.recover(RecoverRequest {
        secrets: Some(sealed),
        measurement_salt: secret.measurement_salt,
        revoked_eks: revoked.eks.into_iter().collect(),
    });
    let response = crate::operator::answer_within(&endpoint, RECOVER_TIMEOUT, call)
        .await
        .context("recovery")?;
    if response.cluster_id.len() != 32 {
        bail!("the node answered without a cluster ID");
    }
    // The node locked to the cluster its disk holds, which the workspace's
    // secret opened: another ID means the node misreports, said rather
    // than hidden.
    if response.cluster_id != cluster_id {
        bail!(
            "{endpoint} recovered, but locked to cluster {}, not the workspace's {}",
            hex::encode(&response.cluster_id),
            hex::encode(cluster_id)
        );
    }
    let report = Report {
        endpoint,
        cluster_id: hex::encode(&response.cluster_id),
        seconds: started.elapsed().as_secs_f64(),
    };
    match output {
        Output::Json => println!("{}", crate::printable::json_pretty(&report)?),
        Output::Text => println!(
            "{} recovered: locked to cluster {} and serving joins ({:.1} s)",
            report.endpoint, report.cluster_id, report.seconds
        ),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    /// The CLI waits longer than the node lets a recovery run (its clock
    /// starts earlier, with the connection): with a shorter wait, a
    /// recovery that succeeds late is reported to the operator as a
    /// failure.
    #[test]
    fn the_cli_waits_longer_than_the_node_lets_recovery_run() {
        assert!(
            super::RECOVER_TIMEOUT
                >= keel_agent::node::OPERATOR_PORT_REQUEST_TIMEOUT
                    + std::time::Duration::from_secs(20)
        );
    }
}
