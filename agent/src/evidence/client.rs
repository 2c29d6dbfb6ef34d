//! The node's end of continuous attestation: once the node is locked into
//! its cluster, one loop per control plane. Each connects over mutual aTLS
//! (the control plane must run this node's boot chain and config and be
//! locked into the same cluster), asks for a nonce, quotes it with the
//! user data of its submission and submits; it reconnects after a failure.
//! A control plane also pulls each other control plane's registry and
//! merges it into its own.

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use keel_atls::{AtlsClient, ConnectError};
use keel_proto::evidence::evidence_service_client::EvidenceServiceClient;
use keel_proto::evidence::{NextNonceRequest, RegistryRequest, SubmitEvidenceRequest};
use keel_verifier::config::Role;
use keel_verifier::keys::ClusterId;
use keel_verifier::validator::{Validator, Verified};
use tonic::transport::{Channel, Endpoint};

use super::{reported_kubernetes_version, user_data};
use crate::attestation::issuer::TpmIssuer;
use crate::backoff::Backoff;
use crate::disk::{DiskState, StateDisk};
use crate::grpc::answer_within;
use crate::join::ticket::check_service;
use crate::measured::SharedTpm;
use crate::provision::Node;
use crate::registry::{ClockGap, Registry, RegistryError, RegistryStore, MAX_REGISTRY_BYTES};

/// Longest one call to a control plane may take, its answer included: a
/// nonce request waits up to one interval (at most 90 s).
const CALL_TIMEOUT: Duration = Duration::from_secs(150);
/// Longest a registry call may take for its node records to be taken:
/// they are dated from when it was asked for, so a host that holds the
/// call up ages them by as much ([`Registry::on_this_clock`]). Also at
/// most half an evidence interval, and at least [`MIN_PROMPT_REGISTRY`].
/// A slower call (a large registry over a slow link, or one held up)
/// still brings its revocations, which spread, but is no view of the
/// nodes: it is not noted as a merge, and a control plane without a
/// current view of its peers revokes no one for silence.
const PROMPT_REGISTRY: Duration = Duration::from_secs(10);
/// The shortest [`PROMPT_REGISTRY`] bound, for intervals of a few seconds.
const MIN_PROMPT_REGISTRY: Duration = Duration::from_secs(2);
/// The longest pause between two tries of the evidence loop's set-up.
const SETUP_RETRY_MAX: Duration = Duration::from_secs(60);

/// Why a round of evidence failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EvidenceClientError {
    /// The endpoint is not a valid URI.
    #[error("invalid endpoint {0:?}")]
    Endpoint(String),
    /// The aTLS connection failed.
    #[error("connecting to the control plane")]
    Connect(#[source] ConnectError),
    /// The peer is not a control plane locked into this node's cluster.
    #[error("the peer is not a control plane of this node's cluster")]
    OtherCluster(#[source] crate::join::TicketError),
    /// The control plane refused a request.
    #[error("the control plane refused: {}: {}", .0.code(), .0.message())]
    Refused(tonic::Status),
    /// Quoting the nonce failed.
    #[error("quoting the nonce")]
    Quote(#[source] crate::attestation::issuer::IssueError),
    /// The quoting task did not complete.
    #[error("the quoting task failed")]
    Task,
    /// Another control plane's registry is unusable.
    #[error("merging another control plane's registry")]
    Registry(#[source] crate::registry::RegistryError),
    /// The other control plane is revoked here: what its registry says is
    /// not taken.
    #[error("the other control plane is on this control plane's revocation list; its registry is not merged")]
    PeerRevoked,
}

impl EvidenceClientError {
    /// Whether the control plane refused this node as revoked.
    pub fn is_revoked(&self) -> bool {
        matches!(self, Self::Refused(status)
            if status.code() == tonic::Code::PermissionDenied
                && status.message() == super::service::REVOKED_MESSAGE)
    }

    /// Whether the call may have failed on the way (no answer in time, the
    /// connection gone), rather than by the peer's answer: then the
    /// connection is not used again.
    pub fn connection_failed(&self) -> bool {
        matches!(self, Self::Refused(status) if matches!(
            status.code(),
            tonic::Code::DeadlineExceeded
                | tonic::Code::Unavailable
                | tonic::Code::Cancelled
                | tonic::Code::Unknown
        ))
    }
}

/// The state disk's UUID as a node's evidence reports it.
#[derive(Clone)]
enum DiskId {
    /// Given when the client was made.
    Fixed(String),
    /// Read from the disk once its set-up finished (its header labelled
    /// provisioned), then kept; empty until then. The node locks into its
    /// cluster before it formats a fresh disk, so the loop starts while
    /// the disk is still being set up.
    Read {
        disk: StateDisk,
        found: Arc<std::sync::OnceLock<String>>,
    },
}

impl DiskId {
    /// The UUID to report now; empty while there is none to report.
    async fn current(&self) -> String {
        let (disk, found) = match self {
            DiskId::Fixed(uuid) => return uuid.clone(),
            DiskId::Read { disk, found } => (disk, found),
        };
        if let Some(uuid) = found.get() {
            return uuid.clone();
        }
        let inspect = disk.clone();
        match tokio::task::spawn_blocking(move || inspect.inspect()).await {
            Ok(Ok(DiskState::Member { uuid })) => found.get_or_init(|| uuid).clone(),
            Ok(Ok(DiskState::Fresh | DiskState::Unfinished { .. })) => {
                tracing::debug!("the state disk is not set up yet; evidence without its UUID");
                String::new()
            }
            // Damaged since the node set it up (it is open already), or
            // unreadable for now: this round goes without the disk's UUID,
            // as for a node without a header, the control plane judges
            // that, and the next round reads the disk again.
            Ok(Err(e)) => {
                tracing::warn!(
                    error = %keel_atls::ErrorChain(&e),
                    "reading the state disk's UUID failed; evidence without it this round"
                );
                String::new()
            }
            Err(e) => {
                tracing::warn!(error = %e, "reading the state disk's UUID failed; evidence without it this round");
                String::new()
            }
        }
    }
}

/// Most characters of a control plane's verdict a member logs: the
/// service's verdicts are single words, so a longer one is cut.
const MAX_LOGGED_VERDICT: usize = 64;

/// Sends this node's evidence.
#[derive(Clone)]
pub struct EvidenceClient {
    atls: AtlsClient<Verified>,
    /// Makes the handshakes' documents and the rounds' evidence: one batch
    /// queue and PCR cache for every session.
    issuer: TpmIssuer,
    root: PathBuf,
    disk: DiskId,
    retry: Duration,
    /// On a control plane: what it merges the others' registries into,
    /// once it serves (its state disk mounted); until then it reports
    /// like any member.
    registry: Arc<OnceLock<Merging>>,
}

/// A control plane's registry, which it merges the others' into.
#[derive(Clone)]
struct Merging {
    registry: Arc<RegistryStore>,
    /// How long a drift there stands against the others' records.
    drift_stands: Duration,
    /// Its own EK's digest: its own registry is not merged into itself,
    /// since a merge tells its evidence service that another control
    /// plane's view is current.
    own_ek: keel_verifier::ek::EkDigest,
    /// Whether this node logged that it found itself revoked.
    told_revoked: Arc<std::sync::atomic::AtomicBool>,
}

/// The registry an [`EvidenceClient`] merges into, given once it exists.
pub struct MergeLater(Arc<OnceLock<Merging>>);

impl MergeLater {
    /// Merges the other control planes' registries into `registry` from
    /// the next exchange on ([`EvidenceClient::merging_into`]); a second
    /// call changes nothing.
    pub fn fill(
        &self,
        registry: Arc<RegistryStore>,
        drift_stands: Duration,
        own_ek: keel_verifier::ek::EkDigest,
    ) {
        let _ = self.0.set(Merging {
            registry,
            drift_stands,
            own_ek,
            told_revoked: Arc::default(),
        });
    }
}

/// One connection to a control plane's evidence service.
pub struct Session {
    client: EvidenceServiceClient<Channel>,
    /// The control plane's EK, as its handshake attested it.
    server_ek: keel_verifier::ek::EkDigest,
    /// The client's issuer ([`EvidenceClient`]).
    issuer: TpmIssuer,
    disk: DiskId,
    /// The node root, where each round reads the node's version record.
    root: PathBuf,
    /// How long a registry call may take for its node records to be
    /// taken ([`PROMPT_REGISTRY`]).
    prompt_registry: Duration,
}

impl EvidenceClient {
    /// A client attesting with `tpm`, validating control planes with
    /// `validator` (see [`crate::join::service_validator`]), reporting the
    /// disk `disk_uuid` and the version under `root`, retrying after `retry`.
    pub fn new(
        tpm: SharedTpm,
        validator: Validator,
        root: PathBuf,
        disk_uuid: String,
        retry: Duration,
    ) -> Self {
        let issuer = TpmIssuer::new(tpm);
        let atls = AtlsClient::mutual(Arc::new(issuer.clone()), Arc::new(validator))
            .with_timeout(Duration::from_secs(30));
        Self {
            atls,
            issuer,
            root,
            disk: DiskId::Fixed(disk_uuid),
            retry,
            registry: Arc::default(),
        }
    }

    /// How many quotes this client's issuer made for how many documents:
    /// its handshakes' and its rounds' evidence, on every session.
    pub fn issuer_stats(&self) -> crate::batching::BatchStats {
        self.issuer.stats()
    }

    /// The same client reporting the UUID of `disk` instead, read once the
    /// disk's set-up finished.
    pub fn reading_disk(mut self, disk: StateDisk) -> Self {
        self.disk = DiskId::Read {
            disk,
            found: Arc::default(),
        };
        self
    }

    /// The same client on a control plane whose EK has the digest
    /// `own_ek`: after each round with another control plane it merges
    /// that one's registry into `registry`. A drift there stands against
    /// the other's records for `drift_stands`
    /// (`EvidenceConfig::drift_stands`).
    pub fn merging_into(
        self,
        registry: Arc<RegistryStore>,
        drift_stands: Duration,
        own_ek: keel_verifier::ek::EkDigest,
    ) -> Self {
        self.merge_later().fill(registry, drift_stands, own_ek);
        self
    }

    /// Where this client (and its clones) later learns the registry it
    /// merges into ([`Self::merging_into`]); until then it merges nothing.
    pub fn merge_later(&self) -> MergeLater {
        MergeLater(self.registry.clone())
    }

    /// Connects to `endpoint`, which must be locked into `cluster_id`.
    pub async fn connect(
        &self,
        endpoint: &str,
        cluster_id: &ClusterId,
    ) -> Result<Session, EvidenceClientError> {
        let uri = Endpoint::from_shared(format!("http://{endpoint}"))
            .map_err(|_| EvidenceClientError::Endpoint(endpoint.to_owned()))?
            .timeout(CALL_TIMEOUT);
        let bound = self
            .atls
            .bind_channel(uri)
            .await
            .map_err(EvidenceClientError::Connect)?;
        let service = bound
            .attested
            .ok_or(EvidenceClientError::Connect(ConnectError::ServerNotChecked))?;
        check_service(service.claims(), cluster_id).map_err(EvidenceClientError::OtherCluster)?;
        Ok(Session {
            server_ek: keel_verifier::ek::EkDigest::of_public(&service.claims().ek),
            client: EvidenceServiceClient::new(bound.channel)
                // The registry document and its message's few bytes.
                .max_decoding_message_size(MAX_REGISTRY_BYTES + 1024),
            issuer: self.issuer.clone(),
            disk: self.disk.clone(),
            root: self.root.clone(),
            prompt_registry: PROMPT_REGISTRY.min(self.retry / 2).max(MIN_PROMPT_REGISTRY),
        })
    }

    /// Sends evidence to `endpoint` for as long as the task runs. Rounds
    /// start at least half an interval (`retry`) apart whatever the
    /// control plane does: it holds each nonce for an interval, and one
    /// that answers at once (compromised after its attestation) would
    /// otherwise have every member quote, and every control plane pull
    /// its registry, back to back.
    pub async fn run(self, endpoint: String, cluster_id: ClusterId) {
        let pace = self.retry / 2;
        let mut last_round: Option<tokio::time::Instant> = None;
        loop {
            match self.connect(&endpoint, &cluster_id).await {
                Ok(mut session) => loop {
                    if let Some(last) = last_round {
                        tokio::time::sleep_until(last + pace).await;
                    }
                    last_round = Some(tokio::time::Instant::now());
                    match session.round().await {
                        Ok(verdict) if verdict == "trusted" => {
                            tracing::debug!(%endpoint, "evidence accepted");
                        }
                        Ok(verdict) => {
                            let verdict =
                                verdict.chars().take(MAX_LOGGED_VERDICT).collect::<String>();
                            tracing::warn!(%endpoint, verdict = %verdict.escape_debug(), "the control plane's verdict on this node's evidence");
                        }
                        Err(e) => {
                            tracing::warn!(%endpoint, error = %keel_atls::ErrorChain(&e), "evidence round failed");
                            // The peer's registry is taken whatever its
                            // answer: a peer whose own writes fail (it
                            // answers every round with an error) holds its
                            // revocations in memory alone, and only its
                            // peers keep them past its restart. A control
                            // plane refused as revoked takes the revocation
                            // list, its own revocation in it. A connection
                            // that failed on the way is not used again.
                            if !e.connection_failed() {
                                self.exchange_registry(&mut session, &endpoint, !e.is_revoked())
                                    .await;
                            }
                            break;
                        }
                    }
                    self.exchange_registry(&mut session, &endpoint, true).await;
                },
                Err(e) => {
                    tracing::info!(%endpoint, error = %keel_atls::ErrorChain(&e), "evidence connection failed");
                }
            }
            tokio::time::sleep(reconnect_pause(self.retry)).await;
        }
    }
}

/// The pause before a member connects again after its connection failed
/// or ended: drawn from the upper half of `retry`. A control plane that
/// restarts fails every member's connection in the same instant; with one
/// fixed pause they would all come back within milliseconds of each other,
/// each wanting a mutual handshake and a TPM answer, and fail together
/// again past its bounds, every interval.
fn reconnect_pause(retry: Duration) -> Duration {
    Backoff {
        initial: retry,
        max: retry,
    }
    .delay(0)
}

impl EvidenceClient {
    /// Merges the registry of the session's control plane into this
    /// control plane's, if this node merges registries and the peer is
    /// another control plane: the whole registry, or after the peer
    /// refused this one as revoked, its revocation list.
    async fn exchange_registry(&self, session: &mut Session, endpoint: &str, whole: bool) {
        let Some(merging) = self
            .registry
            .get()
            .filter(|m| session.server_ek != m.own_ek)
        else {
            return;
        };
        let merged = if whole {
            session
                .merge_registry(&merging.registry, merging.drift_stands)
                .await
        } else {
            session
                .take_revocations(&merging.registry, merging.drift_stands)
                .await
        };
        match merged {
            Ok(_) => {
                if let Some(revocation) = merging.registry.revocation(&merging.own_ek) {
                    // Said once: every later exchange finds it again.
                    if !merging
                        .told_revoked
                        .swap(true, std::sync::atomic::Ordering::Relaxed)
                    {
                        tracing::error!(%endpoint, %revocation, "this control plane is revoked: it issues no join tickets");
                    }
                }
            }
            Err(e) => {
                tracing::warn!(%endpoint, error = %keel_atls::ErrorChain(&e), "registry exchange failed");
            }
        }
    }
}

impl Session {
    /// The raw client (tests send what a node would not).
    pub fn client(&mut self) -> &mut EvidenceServiceClient<Channel> {
        &mut self.client
    }

    /// Evidence for `nonce`: a fresh quote binding the submission's fields.
    pub async fn evidence(
        &self,
        nonce: Vec<u8>,
    ) -> Result<SubmitEvidenceRequest, EvidenceClientError> {
        let issuer = self.issuer.clone();
        // Read each round: an upgrade changes it while a session lasts.
        let kubernetes_version = reported_kubernetes_version(&self.root);
        let disk_uuid = self.disk.current().await;
        let data = user_data(&disk_uuid, &kubernetes_version);
        let quoted = nonce.clone();
        let document = tokio::task::spawn_blocking(move || issuer.issue(&quoted, &data))
            .await
            .map_err(|_| EvidenceClientError::Task)?
            .map_err(EvidenceClientError::Quote)?;
        Ok(SubmitEvidenceRequest {
            nonce,
            document,
            disk_uuid,
            kubernetes_version,
        })
    }

    /// Waits for the control plane's next nonce.
    pub async fn next_nonce(&mut self) -> Result<Vec<u8>, EvidenceClientError> {
        let call = self.client.next_nonce(NextNonceRequest {});
        Ok(answer_within(CALL_TIMEOUT, call)
            .await
            .map_err(EvidenceClientError::Refused)?
            .nonce)
    }

    /// One round: wait for the nonce, quote, submit; returns the verdict.
    pub async fn round(&mut self) -> Result<String, EvidenceClientError> {
        let nonce = self.next_nonce().await?;
        let request = self.evidence(nonce).await?;
        Ok(answer_within(CALL_TIMEOUT, self.client.submit(request))
            .await
            .map_err(EvidenceClientError::Refused)?
            .verdict)
    }

    /// Pulls the control plane's registry and merges it into `registry`,
    /// where a drift stands against its records for `drift_stands`. A
    /// control plane that `registry` revokes gets nothing merged
    /// ([`RegistryStore::merge_from_peer`]); its registry is not even
    /// pulled.
    pub async fn merge_registry(
        &mut self,
        registry: &Arc<RegistryStore>,
        drift_stands: Duration,
    ) -> Result<usize, EvidenceClientError> {
        self.pull_registry(registry, drift_stands, true).await
    }

    /// [`Session::merge_registry`] after the control plane refused this
    /// one as revoked: what it serves then is its revocation list alone,
    /// taken without counting as a view of the nodes
    /// ([`RegistryStore::merge_revocations_from_peer`]).
    pub async fn take_revocations(
        &mut self,
        registry: &Arc<RegistryStore>,
        drift_stands: Duration,
    ) -> Result<usize, EvidenceClientError> {
        self.pull_registry(registry, drift_stands, false).await
    }

    async fn pull_registry(
        &mut self,
        registry: &Arc<RegistryStore>,
        drift_stands: Duration,
        whole: bool,
    ) -> Result<usize, EvidenceClientError> {
        if self.peer_revoked_in(registry).await? {
            return Err(EvidenceClientError::PeerRevoked);
        }
        let (asked_at, started) = (crate::registry::now(), std::time::Instant::now());
        let call = self.client.registry(RegistryRequest {});
        let served = answer_within(CALL_TIMEOUT, call)
            .await
            .map_err(EvidenceClientError::Refused)?;
        let took = started.elapsed();
        let (bytes, served_at) = (served.registry, served.served_at);
        // Parsing up to the registry bound, the registry's lock and the
        // write after the merge block: not on a worker of the runtime.
        let registry = registry.clone();
        let (peer, prompt) = (self.server_ek, self.prompt_registry);
        let added = tokio::task::spawn_blocking(move || {
            let (theirs, gap) = Registry::parse(&bytes)?.on_this_clock(served_at, asked_at);
            let view = whole && takes_records(gap, took, prompt, &peer);
            // Checked again under the merge's lock: a revocation may have
            // landed during the call. A registry that is no view of the
            // nodes still brings its revocations, and the names its
            // records hold; one a control plane serves a caller it revokes,
            // its revocations alone.
            if view {
                registry.merge_from_peer(theirs, drift_stands, &peer)
            } else if whole {
                let named = theirs.names_only(crate::registry::now());
                registry.merge_revocations_from_peer(named, drift_stands, &peer)
            } else {
                registry.merge_revocations_from_peer(theirs.revocations_only(), drift_stands, &peer)
            }
        })
        .await
        .map_err(|_| EvidenceClientError::Task)?
        .map_err(|e| match e {
            RegistryError::PeerRevoked => EvidenceClientError::PeerRevoked,
            e => EvidenceClientError::Registry(e),
        })?;
        if added > 0 {
            tracing::info!(added, "revocations taken from another control plane");
        }
        Ok(added)
    }

    /// Whether `registry` revokes this session's control plane.
    async fn peer_revoked_in(
        &self,
        registry: &Arc<RegistryStore>,
    ) -> Result<bool, EvidenceClientError> {
        let (registry, peer) = (registry.clone(), self.server_ek);
        tokio::task::spawn_blocking(move || registry.revocation(&peer).is_some())
            .await
            .map_err(|_| EvidenceClientError::Task)
    }
}

/// Whether a peer's registry, its clock `gap` from this one's and its call
/// having taken `took`, is a view of the nodes to take their records from
/// (else only its revocations and the names its records hold are taken),
/// logging why not.
fn takes_records(
    gap: ClockGap,
    took: Duration,
    prompt: Duration,
    peer: &keel_verifier::ek::EkDigest,
) -> bool {
    match gap {
        ClockGap::Apart(apart) => {
            tracing::warn!(
                %peer,
                apart_s = apart,
                "this control plane's clock and the other's are further apart than the skew \
                 allowed: only its revocations and the names it holds are taken"
            );
            false
        }
        ClockGap::Within if took > prompt => {
            tracing::warn!(
                %peer,
                took_ms = took.as_millis() as u64,
                prompt_ms = prompt.as_millis() as u64,
                "the other control plane's registry came late: only its revocations and the \
                 names it holds are taken"
            );
            false
        }
        ClockGap::Within => true,
    }
}

/// Runs the evidence loops of a booted node: waits until it is locked into
/// its cluster, then attests to every control-plane endpoint of its config.
/// A set-up that fails (the TPM, the registry) is tried again with backoff:
/// a node that stopped sending evidence would be found silent, and under
/// the `revoke` policy revoked for good.
pub async fn run_for_node(node: Node) -> anyhow::Result<()> {
    let endpoints = node.config.cluster.control_plane_endpoints.clone();
    if endpoints.is_empty() {
        return Ok(());
    }
    let (client, cluster_id) = setup_backoff(node.config.cluster.evidence.interval())
        .retry("setting up the evidence loop", || client_for(&node))
        .await;
    tracing::info!(
        endpoints = endpoints.len(),
        interval_s = node.config.cluster.evidence.interval().as_secs(),
        "sending evidence to the control planes"
    );
    let mut loops = tokio::task::JoinSet::new();
    for endpoint in endpoints {
        loops.spawn(client.clone().run(endpoint, cluster_id));
    }
    while loops.join_next().await.is_some() {}
    Ok(())
}

/// The pauses between tries of the set-up: from 0.5-1 s, doubling, at most
/// a minute and at most the evidence interval, so a node whose set-up
/// failure cleared sends evidence again within an interval or so, before it
/// is found silent.
fn setup_backoff(interval: Duration) -> Backoff {
    Backoff {
        initial: Duration::from_secs(1),
        max: SETUP_RETRY_MAX.min(interval),
    }
}

/// The evidence client of `node` once it is locked into its cluster, with
/// the cluster's ID. A control plane's reports from its lock on, as any
/// member's: its join (the disk, the downloads, `kubeadm join`) may take
/// longer than its peers wait before they find it silent, and under the
/// `revoke` policy revoke it. It merges the others' registries into its
/// own once it serves, when its state disk is mounted.
async fn client_for(node: &Node) -> anyhow::Result<(EvidenceClient, ClusterId)> {
    // Whether it is locked is read without the TPM; the ID, from the event
    // log under the TPM's mutex, off the runtime's threads.
    let cluster_id = loop {
        if node.lock.is_locked() {
            let lock = Arc::clone(&node.lock);
            let id = tokio::task::spawn_blocking(move || lock.cluster_id())
                .await
                .map_err(|_| anyhow::anyhow!("reading the cluster ID: the task ended"))??;
            if let Some(id) = id {
                break id;
            }
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    };
    // The same validator as the join client's: the control plane's image
    // and config, and its CPU evidence for the hardware variants.
    let validator =
        crate::join::JoinSettings::from_config(&node.config)?.service_validator(&node.tpm)?;
    let mut client = EvidenceClient::new(
        node.tpm.clone(),
        validator,
        node.env.root().to_owned(),
        String::new(),
        node.config.cluster.evidence.interval(),
    );
    if let Some(disk) = node.env.state_disk.clone() {
        client = client.reading_disk(disk);
    }
    if node.config.node.role == Role::ControlPlane {
        let later = client.merge_later();
        let (tpm, root) = (node.tpm.clone(), node.env.root().to_owned());
        let evidence = node.config.cluster.evidence.clone();
        let mut slot = node.cluster.subscribe();
        tokio::spawn(async move {
            // The control plane's state disk is mounted once it serves.
            while slot.borrow_and_update().is_none() {
                if slot.changed().await.is_err() {
                    return;
                }
            }
            let (registry, own_ek) = setup_backoff(evidence.interval())
                .retry("opening the registry the others' are merged into", || {
                    let (tpm, root) = (tpm.clone(), root.clone());
                    async move {
                        let own_ek = tokio::task::spawn_blocking(move || {
                            crate::attestation::shared_own_ek_digest(&tpm)
                        })
                        .await??;
                        anyhow::Ok((RegistryStore::shared(&root)?, own_ek))
                    }
                })
                .await;
            later.fill(registry, evidence.drift_stands(), own_ek);
            tracing::info!("merging the other control planes' registries");
        });
    }
    Ok((client, cluster_id))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// Members whose connections failed together come back spread over
    /// the upper half of the interval, not all after the same pause.
    #[test]
    fn reconnect_pauses_are_spread_over_half_an_interval() {
        let retry = Duration::from_secs(60);
        let pauses: Vec<Duration> = (0..32).map(|_| reconnect_pause(retry)).collect();
        for pause in &pauses {
            assert!(*pause >= retry / 2 && *pause <= retry, "{pause:?}");
        }
        let (least, most) = (pauses.iter().min(), pauses.iter().max());
        assert!(
            most.zip(least)
                .is_some_and(|(most, least)| *most - *least > Duration::from_secs(5)),
            "{pauses:?}"
        );
    }

    /// A round that failed by the peer's answer (a write failing there,
    /// Internal; a refusal) leaves the connection in use for the registry;
    /// one that failed on the way does not.
    #[test]
    fn only_a_failure_on_the_way_gives_the_connection_up() {
        let refused = |code| EvidenceClientError::Refused(tonic::Status::new(code, "x"));
        for code in [
            tonic::Code::Internal,
            tonic::Code::PermissionDenied,
            tonic::Code::ResourceExhausted,
        ] {
            assert!(!refused(code).connection_failed(), "{code:?}");
        }
        for code in [
            tonic::Code::DeadlineExceeded,
            tonic::Code::Unavailable,
            tonic::Code::Cancelled,
            tonic::Code::Unknown,
        ] {
            assert!(refused(code).connection_failed(), "{code:?}");
        }
        let internal: tonic::Status = (&crate::evidence::service::EvidenceError::Registry(
            crate::registry::RegistryError::Task,
        ))
            .into();
        assert!(!EvidenceClientError::Refused(internal).connection_failed());
    }
    use tokio::time::Instant;

    /// A registry that came late, or from a peer whose clock is too far
    /// off, gives no view of the nodes; a prompt one does.
    #[test]
    fn only_a_prompt_peer_within_the_skew_gives_a_view_of_the_nodes() {
        let peer = keel_verifier::ek::EkDigest::from_hex(&hex::encode([1; 32])).unwrap();
        let (prompt, quick) = (Duration::from_secs(2), Duration::from_millis(10));
        assert!(takes_records(ClockGap::Within, quick, prompt, &peer));
        assert!(!takes_records(
            ClockGap::Within,
            Duration::from_secs(3),
            prompt,
            &peer
        ));
        assert!(!takes_records(ClockGap::Apart(301), quick, prompt, &peer));
        assert!(!takes_records(ClockGap::Apart(-301), quick, prompt, &peer));
    }

    /// Runs the set-up's retry loop with a set-up failing until `fails`
    /// says it succeeds (given the time since the start); returns the
    /// pauses between tries.
    async fn pauses(backoff: Backoff, fails: impl Fn(Duration) -> bool) -> Vec<Duration> {
        let start = Instant::now();
        let tries = Mutex::new(Vec::new());
        backoff
            .retry("the test set-up", || {
                let now = Instant::now();
                tries.lock().unwrap().push(now);
                let failing = fails(now - start);
                async move {
                    if failing {
                        return Err(anyhow::anyhow!("reading the TPM failed"));
                    }
                    Ok(())
                }
            })
            .await;
        let tries = tries.into_inner().unwrap();
        tries.windows(2).map(|w| w[1] - w[0]).collect()
    }

    /// A set-up failing three times (a TPM read, the registry) is tried
    /// again after pauses of 0.5-1, 1-2 and 2-4 s.
    #[tokio::test(start_paused = true)]
    async fn a_failing_set_up_is_tried_again_with_growing_pauses() {
        let failures = std::sync::atomic::AtomicU32::new(0);
        let gaps = pauses(setup_backoff(Duration::from_secs(60)), |_| {
            failures.fetch_add(1, std::sync::atomic::Ordering::SeqCst) < 3
        })
        .await;
        assert_eq!(gaps.len(), 3, "{gaps:?}");
        for (gap, low_ms) in gaps.iter().zip([500, 1000, 2000]) {
            let low = Duration::from_millis(low_ms);
            assert!((low..=low * 2).contains(gap), "{gaps:?}");
        }
    }

    /// Past the cap the pauses stop growing: a set-up failing for an hour
    /// is tried again every 30-60 s; and never less often than the
    /// evidence interval, when that is shorter.
    #[tokio::test(start_paused = true)]
    async fn a_set_up_failing_for_long_is_tried_at_least_once_a_minute_or_an_interval() {
        let hour = Duration::from_secs(3600);
        // The interval, and the first pause drawn at the cap (1 s doubled
        // past it).
        for (interval, capped_from) in [(60, 6), (10, 4)] {
            let cap = Duration::from_secs(interval);
            let gaps = pauses(setup_backoff(cap), |since| since < hour).await;
            assert!(gaps.iter().all(|g| *g <= cap), "{interval} s: {gaps:?}");
            assert!(
                gaps[capped_from..].iter().all(|g| *g >= cap / 2),
                "{interval} s: {gaps:?}"
            );
        }
    }
}
