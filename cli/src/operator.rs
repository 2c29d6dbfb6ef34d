//! The operator API from the CLI's side: connect to each control plane
//! named, check it is a member of the workspace's cluster, and make the
//! operator's proof for one request on a fresh challenge. Used by
//! `keel push-measurements`, `keel revoke` and `keel status`.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context as _};
use keel_atls::AtlsClient;
use keel_proto::operator::operator_service_client::OperatorServiceClient;
use keel_proto::operator::ChallengeRequest;
use keel_verifier::keys::{operator_proof, KeyService};
use keel_verifier::measurement::pcr;
use keel_verifier::measurements::Measurements;
use keel_verifier::validator::check_cluster_lock;
use tonic::transport::{Channel, Endpoint};
use zeroize::Zeroizing;

use crate::init::connect;
use crate::settings::Settings;
use crate::workspace::{self, MasterSecret};

/// What every operator request needs: the operator key, the cluster ID and
/// a client that validates control planes.
pub struct Operator {
    key: Zeroizing<Vec<u8>>,
    cluster_id: [u8; 32],
    client: AtlsClient<keel_verifier::validator::Verified>,
    wait: Duration,
}

/// One control plane, attested and a member of the workspace's cluster.
pub struct ControlPlane {
    /// The endpoint it was reached at.
    pub endpoint: String,
    /// Its operator API.
    pub client: OperatorServiceClient<Channel>,
}

/// Formats a refusal of `endpoint`.
pub fn refused(endpoint: &str, s: &tonic::Status) -> anyhow::Error {
    anyhow::anyhow!("{endpoint} refused: {}: {}", s.code(), s.message())
}

impl Operator {
    /// Loads the settings and the workspace's master secret (which never
    /// leaves this machine; only proofs made with a key derived from it do).
    pub fn load(settings_path: &Path, workspace: &Path, wait: Duration) -> anyhow::Result<Self> {
        let settings = Settings::load(settings_path)?;
        let secret = MasterSecret::load(workspace)?;
        let key = KeyService::new(&secret.key, &secret.salt)
            .context("the master secret is unusable")?
            .operator_key()
            .context("deriving the operator key")?;
        let cluster_id: [u8; 32] = workspace::cluster_id(workspace)?
            .as_slice()
            .try_into()
            .context("the workspace's cluster ID is not 32 bytes")?;
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
            key,
            cluster_id,
            client,
            wait,
        })
    }

    /// Connects to the control plane at `endpoint`; it must be locked into
    /// exactly the workspace's cluster.
    async fn connect(&self, endpoint: &str) -> anyhow::Result<ControlPlane> {
        let (host, port) = Settings::host_port(endpoint)?;
        let uri =
            Endpoint::from_shared(format!("http://{host}:{port}")).context("invalid endpoint")?;
        let bound = connect(&self.client, uri, self.wait).await?;
        let attested = bound
            .attested
            .context("the node presented no attestation")?;
        if let Err(why) = check_cluster_lock(attested.claims(), &self.cluster_id) {
            bail!(
                "{endpoint} is not a member of the workspace's cluster ({why}); nothing was sent"
            );
        }
        Ok(ControlPlane {
            endpoint: endpoint.to_owned(),
            client: OperatorServiceClient::new(bound.channel),
        })
    }

    /// Connects to `endpoint` (see [`Operator::connect`]) and proves a
    /// request of `kind` over `body` on a fresh challenge of it: returns the
    /// control plane, the challenge and the proof.
    pub async fn authorise(
        &self,
        endpoint: &str,
        kind: &str,
        body: &[u8],
    ) -> anyhow::Result<(ControlPlane, Vec<u8>, Vec<u8>)> {
        let mut cp = self.connect(endpoint).await?;
        let (challenge, proof) = self.prove(&mut cp, kind, body).await?;
        Ok((cp, challenge, proof))
    }

    /// A fresh challenge of `cp` and the proof for a request of `kind` over
    /// `body` on it.
    async fn prove(
        &self,
        cp: &mut ControlPlane,
        kind: &str,
        body: &[u8],
    ) -> anyhow::Result<(Vec<u8>, Vec<u8>)> {
        let challenge = cp
            .client
            .challenge(ChallengeRequest {})
            .await
            .map_err(|s| refused(&cp.endpoint, &s))?
            .into_inner()
            .challenge;
        let proof = operator_proof(&self.key, kind, &challenge, body)
            .context("computing the operator proof")?;
        Ok((challenge, proof.to_vec()))
    }
}
