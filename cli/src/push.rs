//! `keel push-measurements`: roll a measurements file out to every control
//! plane, so all join services accept the same boot chain.
//!
//! Each control plane is validated first: its boot chain and config by the
//! settings' measurements, and its event log must lock it into exactly the
//! cluster of the workspace. Then the CLI asks it for a challenge and sends
//! the file with the operator's proof for that challenge (made with the
//! node's operator key, derived from the master secret for the EK the node
//! attested; the secret itself never leaves this machine).

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context as _};
use keel_atls::AtlsClient;
use keel_proto::operator::operator_service_client::OperatorServiceClient;
use keel_proto::operator::{ChallengeRequest, SetJoinMeasurementsRequest};
use keel_verifier::ek::EkDigest;
use keel_verifier::keys::KeyService;
use keel_verifier::measurement::{pcr, EventType};
use keel_verifier::measurements::Measurements;
use tonic::transport::Endpoint;

use crate::init::connect;
use crate::settings::{read_bounded, Settings};
use crate::workspace::{self, MasterSecret};

/// The proof kind the control planes expect.
const KIND: &str = "set-join-measurements";

/// Runs `keel push-measurements`.
pub async fn run(
    settings_path: &Path,
    workspace: &Path,
    file: &Path,
    endpoints: &[String],
    wait: Duration,
) -> anyhow::Result<()> {
    if endpoints.is_empty() {
        bail!("name each control plane's init port with --endpoint");
    }
    let settings = Settings::load(settings_path)?;
    let body = read_bounded(file)?;
    // The control planes refuse what does not parse; refuse it here first.
    Measurements::parse(&body)
        .with_context(|| format!("{} is not a measurements file", file.display()))?;
    let secret = MasterSecret::load(workspace)?;
    let keys =
        KeyService::new(&secret.key, &secret.salt).context("the master secret is unusable")?;
    let cluster_id = workspace::cluster_id(workspace)?;

    // Members have PCR 15 set: judged by their event log below.
    let current = settings.measurements()?;
    let relaxed = Measurements::new(
        current
            .iter()
            .filter(|(p, _)| **p != pcr::CLUSTER_ID)
            .map(|(p, e)| (*p, e.clone())),
    )
    .context("the settings' measurements without PCR 15")?;
    let client = AtlsClient::server_attested(Arc::new(settings.validator(relaxed)?));
    for endpoint in endpoints {
        let (host, port) = Settings::host_port(endpoint)?;
        let uri =
            Endpoint::from_shared(format!("http://{host}:{port}")).context("invalid endpoint")?;
        let bound = connect(&client, uri, wait).await?;
        let attested = bound
            .attested
            .context("the node presented no attestation")?;
        let locks: Vec<_> = attested
            .claims()
            .events
            .iter()
            .filter(|e| e.event_type == EventType::ClusterId)
            .collect();
        match locks.as_slice() {
            [lock] if lock.data == cluster_id => {}
            _ => bail!("{endpoint} is not a member of the workspace's cluster; nothing was sent"),
        }
        // The node's own key: derived for the EK it just proved it holds.
        let operator_key = keys
            .operator_key(&EkDigest::of_public(&attested.claims().ek))
            .context("deriving the node's operator key")?;
        let mut operator = OperatorServiceClient::new(bound.channel);
        let challenge = operator
            .challenge(ChallengeRequest {})
            .await
            .map_err(|s| anyhow::anyhow!("{endpoint}: {}: {}", s.code(), s.message()))?
            .into_inner()
            .challenge;
        let proof = operator_key.prove(KIND, &challenge, &body);
        let done = operator
            .set_join_measurements(SetJoinMeasurementsRequest {
                measurements: body.clone(),
                challenge,
                proof: proof.to_vec(),
            })
            .await
            .map_err(|s| anyhow::anyhow!("{endpoint} refused: {}: {}", s.code(), s.message()))?
            .into_inner();
        println!(
            "{endpoint}: join measurements replaced (sha256:{})",
            hex::encode(done.digest)
        );
    }
    Ok(())
}
