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
use keel_verifier::keys::{KeyService, OperatorKey};
use keel_verifier::measurement::{pcr, EventType};
use keel_verifier::measurements::Measurements;
use keel_verifier::validator::Verified;
use tonic::transport::Channel;
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
    let operator = Operator::new(&settings, workspace)?;
    for endpoint in endpoints {
        let mut node = operator.connect(endpoint, wait).await?;
        let done = node
            .client
            .set_join_measurements(SetJoinMeasurementsRequest {
                measurements: body.clone(),
                proof: node.prove(KIND, &body),
                challenge: node.challenge,
            })
            .await
            .map_err(|s| refused(endpoint, &s))?
            .into_inner();
        println!(
            "{endpoint}: join measurements replaced (sha256:{})",
            hex::encode(done.digest)
        );
    }
    Ok(())
}

/// The operator of the workspace's cluster, talking to its members.
pub struct Operator {
    keys: KeyService,
    cluster_id: Vec<u8>,
    client: AtlsClient<Verified>,
}

/// A member connected for one operator request.
pub struct Member {
    /// The operator API of the node.
    pub client: OperatorServiceClient<Channel>,
    /// A fresh challenge of the node.
    pub challenge: Vec<u8>,
    /// The node's operator key (derived for the EK it attested).
    key: OperatorKey,
}

impl Member {
    /// The operator's proof of `kind` over the challenge and `body`.
    pub fn prove(&self, kind: &str, body: &[u8]) -> Vec<u8> {
        self.key.prove(kind, &self.challenge, body).to_vec()
    }
}

impl Operator {
    /// The operator of the cluster `keel init` wrote to `workspace`; nodes
    /// are validated with the settings' measurements.
    pub fn new(settings: &Settings, workspace: &Path) -> anyhow::Result<Self> {
        let secret = MasterSecret::load(workspace)?;
        let keys =
            KeyService::new(&secret.key, &secret.salt).context("the master secret is unusable")?;
        let cluster_id = workspace::cluster_id(workspace)?;
        // Members have PCR 15 set: judged by their event log in `connect`.
        let current = settings.measurements()?;
        let relaxed = Measurements::new(
            current
                .iter()
                .filter(|(p, _)| **p != pcr::CLUSTER_ID)
                .map(|(p, e)| (*p, e.clone())),
        )
        .context("the settings' measurements without PCR 15")?;
        let client = AtlsClient::server_attested(Arc::new(settings.validator(relaxed)?));
        Ok(Self {
            keys,
            cluster_id: cluster_id.to_vec(),
            client,
        })
    }

    /// Connects to the node at `endpoint` (trying for `wait`), checks that
    /// its attestation locks it into exactly the workspace's cluster, and
    /// asks it for a challenge.
    pub async fn connect(&self, endpoint: &str, wait: Duration) -> anyhow::Result<Member> {
        let (host, port) = Settings::host_port(endpoint)?;
        let uri =
            Endpoint::from_shared(format!("http://{host}:{port}")).context("invalid endpoint")?;
        let bound = connect(&self.client, uri, wait).await?;
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
            [lock] if lock.data == self.cluster_id => {}
            _ => bail!("{endpoint} is not a member of the workspace's cluster; nothing was sent"),
        }
        // The node's own key: derived for the EK it just proved it holds.
        let key = self
            .keys
            .operator_key(&EkDigest::of_public(&attested.claims().ek))
            .context("deriving the node's operator key")?;
        let mut client = OperatorServiceClient::new(bound.channel);
        let challenge = client
            .challenge(ChallengeRequest {})
            .await
            .map_err(|s| anyhow::anyhow!("{endpoint}: {}: {}", s.code(), s.message()))?
            .into_inner()
            .challenge;
        Ok(Member {
            client,
            challenge,
            key,
        })
    }
}

/// A node's refusal, with its code and reason.
pub fn refused(endpoint: &str, status: &tonic::Status) -> anyhow::Error {
    anyhow::anyhow!(
        "{endpoint} refused: {}: {}",
        status.code(),
        status.message()
    )
}
