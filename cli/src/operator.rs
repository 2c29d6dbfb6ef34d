//! The operator API from the CLI's side: connect to each node named, check
//! that it is a member of the workspace's cluster, and make the operator's
//! proof for one request on a fresh challenge of that node, with the
//! node's own operator key (derived from the master secret for the EK the
//! node just attested; the secret itself never leaves this machine). Used
//! by `keel push-measurements`, `keel revoke`, `keel status`,
//! `keel kubeconfig` and `keel upgrade`.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use anyhow::{bail, Context as _};
use keel_atls::AtlsClient;
use keel_proto::operator::operator_service_client::OperatorServiceClient;
use keel_proto::operator::ChallengeRequest;
use keel_verifier::cpu::AttestationConfig;
use keel_verifier::ek::EkDigest;
use keel_verifier::keys::{KeyService, OperatorKey};
use keel_verifier::measurement::pcr;
use keel_verifier::measurements::Measurements;
use keel_verifier::validator::{check_cluster_lock, check_control_plane, Verified};
use tonic::transport::Channel;

use crate::init::connect;
use crate::settings::{check_node_attestation, Settings};
use crate::workspace::{self, MasterSecret};

/// What every operator request needs: the cluster's keys, its ID and a
/// client that validates its members.
pub struct Operator {
    keys: KeyService,
    /// The settings' attestation section, which every node's measured
    /// config must name ([`crate::settings::check_node_attestation`]).
    attestation: AttestationConfig,
    cluster_id: [u8; 32],
    client: AtlsClient<Verified>,
    wait: Duration,
    /// The EK each endpoint answered with so far: one node per endpoint,
    /// one endpoint per node.
    answered: Mutex<BTreeMap<String, EkDigest>>,
    /// The EKs this workspace revoked: nodes that are asked nothing.
    revoked: crate::workspace::RevokedRecord,
}

/// One node, attested and a member of the workspace's cluster.
pub struct Member {
    /// The endpoint it was reached at.
    pub endpoint: String,
    /// Its operator API.
    pub client: OperatorServiceClient<Channel>,
    /// Its EK, as it attested.
    pub ek: EkDigest,
    /// Whether its replayed node identity names the control-plane role
    /// ([`keel_verifier::validator::check_control_plane`]).
    control_plane: bool,
    /// Its operator key.
    key: OperatorKey,
}

/// `endpoints` with each named once (in the order first named): one named
/// twice would have its request made twice.
pub fn distinct(endpoints: &[String]) -> Vec<String> {
    let mut seen = std::collections::BTreeSet::new();
    endpoints
        .iter()
        .filter(|e| seen.insert(e.as_str()))
        .cloned()
        .collect()
}

/// Runs `request` for each control plane of `endpoints` in turn, printing
/// one line per control plane (what it did, or why it failed); fails if any
/// did not `what`. A control plane named twice is asked once.
pub async fn on_each<F, Fut>(endpoints: &[String], what: &str, request: F) -> anyhow::Result<()>
where
    F: Fn(String) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<String>>,
{
    on_each_recorded(endpoints, what, request, || Ok(None)).await
}

/// As [`on_each`], and `record` (the workspace's record of the change, and
/// a line saying so) runs as soon as the first control plane made the
/// change, before the next is asked: a later failure, or a run cut short,
/// does not lose it. If `record` fails, the control planes after it are
/// not asked.
pub async fn on_each_recorded<F, Fut, R>(
    endpoints: &[String],
    what: &str,
    request: F,
    record: R,
) -> anyhow::Result<()>
where
    F: Fn(String) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<String>>,
    R: FnOnce() -> anyhow::Result<Option<String>>,
{
    let endpoints = distinct(endpoints);
    let mut record = Some(record);
    let mut failed = 0;
    for endpoint in &endpoints {
        match request(endpoint.clone()).await {
            Ok(line) => {
                // Recorded before the line: what it reports is kept.
                let noted = record.take().map(|record| record()).transpose();
                let noted = noted.with_context(|| {
                    format!(
                        "{endpoint}: {line}, but the workspace does not record it; the control \
                         planes after it were not asked: run the command again"
                    )
                })?;
                println!("{endpoint}: {line}");
                if let Some(note) = noted.flatten() {
                    println!("{note}");
                }
            }
            Err(e) => {
                failed += 1;
                println!("{endpoint}: FAILED: {}", crate::printable::error_chain(&e));
            }
        }
    }
    if failed > 0 {
        bail!(
            "{failed} of {} control plane(s) did not {what}; run the command again for them",
            endpoints.len()
        );
    }
    Ok(())
}

/// Refuses a command that names no control plane: the operator commands
/// act on each one named.
pub fn require_endpoints(endpoints: &[String]) -> anyhow::Result<()> {
    if endpoints.is_empty() {
        bail!("name each control plane's init port with --endpoint");
    }
    Ok(())
}

/// Formats a failed call of `endpoint`: the node's refusal, or, for a
/// status tonic made of a transport failure, what failed and what the node
/// may have done ([`never_sent`], [`connection_failed`]). A request the
/// node does not know (`Unimplemented`) says that its agent is of an
/// earlier version.
pub fn refused(endpoint: &str, s: &tonic::Status) -> anyhow::Error {
    if never_sent(s) {
        return anyhow::anyhow!(
            "{endpoint}: the connection was gone before the request could be sent ({}); the \
             node did not receive it",
            crate::printable::printable(&transport_failure(s))
        );
    }
    if connection_failed(s) {
        return anyhow::anyhow!(
            "{endpoint}: the connection failed before the node's answer was complete ({}); the \
             node may have acted on the request",
            crate::printable::printable(&transport_failure(s))
        );
    }
    let older = if s.code() == tonic::Code::Unimplemented {
        " (its agent is of an earlier version, which does not take this request: \
         update its image, or ask another control plane)"
    } else {
        ""
    };
    anyhow::anyhow!(
        "{endpoint} refused: {}: {}{older}",
        s.code(),
        crate::printable::printable(s.message())
    )
}

/// Whether `status` is tonic's of a transport failure (it has a source: a
/// status the node sent has none): the connection failed, and the request
/// may have reached the node, which then goes on, or not.
pub(crate) fn connection_failed(status: &tonic::Status) -> bool {
    std::error::Error::source(status).is_some()
}

/// Whether `status` says the request never left: the channel had no
/// connection to send it on (tonic's [`tonic::ConnectError`] in the
/// status's sources; the node may have closed an idle one).
pub(crate) fn never_sent(status: &tonic::Status) -> bool {
    let mut source = std::error::Error::source(status);
    while let Some(e) = source {
        if e.is::<tonic::ConnectError>() {
            return true;
        }
        source = e.source();
    }
    false
}

/// What failed beneath a status tonic made of a transport failure, each
/// cause once (the status's message repeats the first, and errors that
/// wrap another often print it too).
pub(crate) fn transport_failure(status: &tonic::Status) -> String {
    let mut causes: Vec<String> = Vec::new();
    let mut next = std::error::Error::source(status);
    while let Some(e) = next {
        let text = e.to_string();
        if !causes.last().is_some_and(|last| last.ends_with(&text)) {
            causes.push(text);
        }
        next = e.source();
    }
    if causes.is_empty() {
        status.message().to_owned()
    } else {
        causes.join(": ")
    }
}

/// Longest one operator call may take, its answer included (`keel status`
/// receives a registry of up to 32 MiB): a node that stalls does not hold
/// the CLI.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(300);

/// The answer of `endpoint` to `call`: its refusal as an error
/// ([`refused`]), and no answer within [`CALL_TIMEOUT`] too.
pub async fn answer<T>(
    endpoint: &str,
    call: impl std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
) -> anyhow::Result<T> {
    answer_within(endpoint, CALL_TIMEOUT, call).await
}

/// [`answer`], within `limit`.
pub async fn answer_within<T>(
    endpoint: &str,
    limit: Duration,
    call: impl std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
) -> anyhow::Result<T> {
    match tokio::time::timeout(limit, call).await {
        Ok(Ok(response)) => Ok(response.into_inner()),
        Ok(Err(status)) => Err(refused(endpoint, &status)),
        Err(_) => bail!("{endpoint} did not answer within {} s", limit.as_secs()),
    }
}

impl Member {
    /// Whether the node attests the control-plane role.
    pub fn is_control_plane(&self) -> bool {
        self.control_plane
    }

    /// A fresh challenge of the node and the operator's proof for a request
    /// of `kind` over `body` on it.
    pub async fn prove(&mut self, kind: &str, body: &[u8]) -> anyhow::Result<(Vec<u8>, Vec<u8>)> {
        let challenge = answer(&self.endpoint, self.client.challenge(ChallengeRequest {}))
            .await?
            .challenge;
        let proof = self.key.prove(kind, &challenge, body).to_vec();
        Ok((challenge, proof))
    }
}

#[cfg(test)]
impl Member {
    /// A control plane at `endpoint` reached over `channel`, unattested and
    /// with an operator key of zeros: for tests of what follows the
    /// attestation.
    pub fn unattested(endpoint: &str, channel: Channel) -> Self {
        Self {
            endpoint: endpoint.to_owned(),
            client: OperatorServiceClient::new(channel),
            ek: EkDigest::from_hex(&"00".repeat(32)).unwrap(),
            control_plane: true,
            key: OperatorKey::from_slice(&[0; 32]).unwrap(),
        }
    }
}

impl Operator {
    /// Loads the settings at `settings_path` ([`Operator::new`]).
    pub fn load(settings_path: &Path, workspace: &Path, wait: Duration) -> anyhow::Result<Self> {
        Self::new(&Settings::load(settings_path)?, workspace, wait)
    }

    /// The operator of the cluster `keel init` wrote to `workspace`; nodes
    /// are validated with the settings' measurements (PCR 15 aside: a
    /// member's is judged by its event log), unreachable ones retried for
    /// `wait`.
    pub fn new(settings: &Settings, workspace: &Path, wait: Duration) -> anyhow::Result<Self> {
        let secret = MasterSecret::load(workspace)?;
        let keys =
            KeyService::new(&secret.key, &secret.salt).context("the master secret is unusable")?;
        // The cluster the secret makes, which the ID file must name too.
        let cluster_id = workspace::checked_cluster_id(workspace, &secret)?;
        let current = settings.measurements()?;
        let relaxed = Measurements::new(
            current
                .iter()
                .filter(|(p, _)| **p != pcr::CLUSTER_ID)
                .map(|(p, e)| (*p, e.clone())),
        )
        .context("the settings' measurements without PCR 15")?;
        let client = AtlsClient::server_attested(Arc::new(settings.validator(relaxed)?));
        let revoked = crate::workspace::RevokedRecord::load(workspace)?;
        Ok(Self {
            keys,
            revoked,
            attestation: settings.attestation.clone(),
            cluster_id,
            client,
            wait,
            answered: Mutex::new(BTreeMap::new()),
        })
    }

    /// Records that `endpoint` answered with `ek`. Refuses a node that
    /// already answered at another endpoint, and an endpoint that answered
    /// with another node before: the host that sends one endpoint's
    /// connection to another node would otherwise have the operator's
    /// request done twice on one node and never on the other, reported as
    /// done on both.
    fn answered(&self, endpoint: &str, ek: &EkDigest) -> anyhow::Result<()> {
        let mut answered = self.answered.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some((other, _)) = answered.iter().find(|(e, k)| *e != endpoint && *k == ek) {
            bail!(
                "{endpoint} answered as the node at {other} (EK {ek}): two endpoints, one node; \
                 nothing was sent"
            );
        }
        match answered.get(endpoint) {
            Some(before) if before != ek => bail!(
                "{endpoint} answered as another node (EK {ek}) than before (EK {before}); \
                 nothing was sent"
            ),
            Some(_) => {}
            None => {
                answered.insert(endpoint.to_owned(), *ek);
            }
        }
        Ok(())
    }

    /// Connects to the node at `endpoint`; it must be locked into exactly
    /// the workspace's cluster.
    pub async fn connect(&self, endpoint: &str) -> anyhow::Result<Member> {
        let uri = Settings::grpc_endpoint(endpoint)?;
        let bound = connect(&self.client, endpoint, uri, self.wait).await?;
        let attested = bound
            .attested
            .context("the node presented no attestation")?;
        let claims = attested.claims();
        check_node_attestation(&self.attestation, claims)
            .with_context(|| format!("{endpoint}: attestation not accepted; nothing was sent"))?;
        if let Err(why) = check_cluster_lock(claims, &self.cluster_id) {
            bail!(
                "{endpoint} is not a member of the workspace's cluster ({why}); nothing was sent"
            );
        }
        let ek = EkDigest::of_public(&claims.ek);
        // A node revoked from this workspace is asked nothing: cut off
        // when it was revoked, it may not know it is, and what it would
        // answer (a registry, a kubeconfig) is its own.
        self.revoked
            .refuse(&ek)
            .map_err(|why| anyhow::anyhow!("{endpoint}: {why}; nothing was sent"))?;
        self.answered(endpoint, &ek)?;
        let key = self
            .keys
            .operator_key(&ek)
            .context("deriving the node's operator key")?;
        let control_plane = check_control_plane(claims).is_ok();
        Ok(Member {
            endpoint: endpoint.to_owned(),
            // `keel status` gets a whole registry (tonic's default
            // allows 4 MiB).
            client: OperatorServiceClient::new(bound.channel)
                .max_decoding_message_size(keel_proto::MAX_REGISTRY_BYTES + 1024),
            ek,
            control_plane,
            key,
        })
    }

    /// Connects to the control plane at `endpoint` ([`Operator::connect`];
    /// its measured role must be the control plane's, or a compromised
    /// worker the host put there could answer for it) and proves a request
    /// of `kind` over `body` on a fresh challenge of it: returns the node,
    /// the challenge and the proof.
    pub async fn authorise(
        &self,
        endpoint: &str,
        kind: &str,
        body: &[u8],
    ) -> anyhow::Result<(Member, Vec<u8>, Vec<u8>)> {
        let mut member = self.connect(endpoint).await?;
        if !member.is_control_plane() {
            bail!(
                "{endpoint} is not a control plane (its measured node identity); nothing was sent"
            );
        }
        let (challenge, proof) = member.prove(kind, body).await?;
        Ok((member, challenge, proof))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_node_that_does_not_answer_is_given_up_on() {
        let limit = Duration::from_secs(1);
        let stalled = std::future::pending::<Result<tonic::Response<u8>, tonic::Status>>();
        let e = answer_within("cp:9000", limit, stalled).await.unwrap_err();
        assert_eq!(e.to_string(), "cp:9000 did not answer within 1 s");
        let refusal = async { Err::<tonic::Response<u8>, _>(tonic::Status::not_found("\x1b[2J")) };
        let e = answer_within("cp:9000", limit, refusal).await.unwrap_err();
        assert_eq!(
            e.to_string(),
            "cp:9000 refused: Some requested entity was not found: \\u{1b}[2J"
        );
        let unknown = async { Err::<tonic::Response<u8>, _>(tonic::Status::unimplemented("")) };
        let e = answer_within("cp:9000", limit, unknown).await.unwrap_err();
        assert!(e.to_string().contains("of an earlier version"), "{e}");
        let answered = async { Ok(tonic::Response::new(7u8)) };
        assert_eq!(answer_within("cp:9000", limit, answered).await.unwrap(), 7);
    }

    /// A connection that fails under a call (reset, or its keep-alive
    /// timed out) is not the node's refusal: the node may have acted on
    /// the request (a recovery, an upgrade goes on at the node). One that
    /// was gone before the call sent nothing.
    #[test]
    fn a_failed_connection_is_not_reported_as_a_refusal() {
        let reset = tonic::Status::from_error(Box::new(std::io::Error::new(
            std::io::ErrorKind::ConnectionReset,
            "connection reset by peer",
        )));
        let e = refused("cp:9000", &reset).to_string();
        assert!(!e.contains("refused"), "{e}");
        assert_eq!(
            e,
            "cp:9000: the connection failed before the node's answer was complete (connection \
             reset by peer); the node may have acted on the request"
        );
        let gone = tonic::Status::from_error(Box::new(tonic::ConnectError(Box::new(
            std::io::Error::other("connection gone"),
        ))));
        let e = refused("cp:9000", &gone).to_string();
        assert!(!e.contains("refused"), "{e}");
        assert_eq!(
            e,
            "cp:9000: the connection was gone before the request could be sent (connection \
             gone); the node did not receive it"
        );
        // The node's own refusal, a status it sent, still reads as one.
        let sent = tonic::Status::unavailable("the TPM is unavailable");
        let e = refused("cp:9000", &sent).to_string();
        assert_eq!(
            e,
            "cp:9000 refused: The service is currently unavailable: the TPM is unavailable"
        );
    }

    #[test]
    fn an_endpoint_named_twice_is_used_once() {
        let named = ["a:1", "b:2", "a:1", "c:3", "b:2"].map(String::from);
        assert_eq!(distinct(&named), ["a:1", "b:2", "c:3"]);
    }
}
