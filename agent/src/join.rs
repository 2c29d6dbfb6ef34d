//! The join client: makes this node a member of an existing cluster.
//!
//! It runs while the node is unlocked, next to the init server; whichever
//! takes the node lock first wins. Two paths:
//!
//! * **Join** (no initialised state disk): the node asks the control-plane
//!   endpoints of its measured config in turn for a join ticket, with capped
//!   exponential backoff and jitter, forever, until one issues a ticket or
//!   the node is locked by init. Nothing is written before the lock: the
//!   kubelet key and the disk UUID live in memory until then. With a valid
//!   ticket it takes the lock with the cluster ID derived from the ticket,
//!   then sets up the state disk with the ticket's key, writes the kubelet
//!   certificate and key, the cluster CA and (control-plane joins) the
//!   control-plane PKI files atomically with mode 0600, installs and
//!   measures the components and runs `kubeadm join` (bounded retries). A
//!   failure after the lock marks the state disk for reset and reboots, as
//!   init does.
//! * **Rejoin** (the state disk carries a LUKS header, i.e. the node was a
//!   member before this boot): it asks for a rejoin ticket for the disk's
//!   UUID, checks that the key opens the disk, takes the lock with the
//!   cluster ID, opens the disk and starts the kubelet.
//!
//! **Mutual attestation.** The connection is mutual aTLS: the service
//! validates this node, and this node validates the service before it uses
//! anything from a ticket. The service must run the same boot chain and
//! config (PCRs 4, 9, 11 and 12 equal this node's own, read from its TPM),
//! its EK must chain to the cluster's EK CA, and once the ticket is opened
//! (its secrets are sealed to this TPM) the service's PCR 15 must be exactly
//! the extend of the cluster ID this node derives from the ticket, with that
//! ID in the service's replayed event log. A service of another cluster, or
//! one running another image, never gets this node.

use std::path::{Path, PathBuf};
use std::str::FromStr as _;
use std::sync::Arc;
use std::time::Duration;

use keel_atls::{AtlsClient, Attested, ConnectError};
use keel_installer::{Component, Installer, KubernetesVersion, LogProgress};
use keel_proto::join::join_service_client::JoinServiceClient;
use keel_proto::join::{
    IssueJoinTicketRequest, IssueJoinTicketResponse, IssueRejoinTicketRequest, JoinSecrets,
};
use keel_verifier::config::{NodeConfig, Role};
use keel_verifier::credential::CredentialError;
use keel_verifier::ek::EkTrust;
use keel_verifier::measurement::{event_digest, extend, pcr, Digest32, EventType};
use keel_verifier::measurements::{Expected, Measurements, MeasurementsError};
use keel_verifier::validator::{Validator, Verified};
use prost::Message as _;
use rand::Rng as _;
use tonic::transport::Endpoint;
use x509_parser::prelude::{FromDer as _, X509Certificate};
use zeroize::Zeroizing;

use crate::attestation::credential;
use crate::attestation::issuer::TpmIssuer;
use crate::components::{install_and_measure, InstallComponentsError};
use crate::disk::DiskError;
use crate::disk::StateDisk;
use crate::files::{write_private, WriteFileError};
use crate::init::NodeEnv;
use crate::join_service::{spki_hash, CONTROL_PLANE_FILES};
use crate::key_service::{self, ClusterId, ClusterIdError, DISK_KEY_LEN};
use crate::kubeadm::{
    self, BootstrapToken, CaCertHash, ConfigError, ControlPlaneJoin, JoinConfig, KubeadmError,
};
use crate::measured::SharedTpm;
use crate::nodelock::{LockError, NodeLock};
use crate::tpm::TpmError;

/// PCRs the join service must share with this node: the boot chain the
/// image predicts and the cluster config.
pub const SHARED_PCRS: [u32; 4] = [4, 9, 11, pcr::CONFIG];
/// Largest accepted ticket message.
pub const MAX_TICKET_BYTES: usize = 1024 * 1024;
/// Where the kubelet's client certificate, key and the cluster CA go,
/// relative to the node root.
pub const KUBELET_PKI_DIR: &str = "var/lib/kubelet/pki";
/// The control-plane PKI directory, relative to the node root.
pub const CONTROL_PLANE_PKI_DIR: &str = "etc/kubernetes/pki";
/// Capped exponential backoff with jitter.
#[derive(Clone, Copy, Debug)]
pub struct Backoff {
    /// Pause after the first failure.
    pub initial: Duration,
    /// Longest pause.
    pub max: Duration,
}

impl Default for Backoff {
    /// 1 s, doubling, capped at 30 s.
    fn default() -> Self {
        Self {
            initial: Duration::from_secs(1),
            max: Duration::from_secs(30),
        }
    }
}

impl Backoff {
    /// The pause after failure number `attempt` (from 0): uniformly drawn
    /// from the upper half of `min(max, initial * 2^attempt)`, so clients
    /// that failed together spread out.
    pub fn delay(&self, attempt: u32) -> Duration {
        let full = self
            .initial
            .saturating_mul(1u32.checked_shl(attempt.min(31)).unwrap_or(u32::MAX))
            .min(self.max);
        let half = full / 2;
        half + rand::thread_rng().gen_range(Duration::ZERO..=half)
    }
}

/// How the kubelet is started after a rejoin.
#[derive(Clone, Debug)]
pub enum KubeletStart {
    /// `systemctl start kubelet.service` (a node).
    Systemd,
    /// Runs this program with `--version` and requires success (host tests:
    /// the stand-in kubelet does nothing more).
    Program(PathBuf),
}

/// The join client's settings.
#[derive(Clone, Debug)]
pub struct JoinSettings {
    /// Join service endpoints (`host:port`), tried in turn.
    pub endpoints: Vec<String>,
    /// The CAs trusted to issue the join service's EK certificate.
    pub ek_trust: EkTrust,
    /// Pauses between rounds of attempts.
    pub backoff: Backoff,
    /// Bound of each connection and call.
    pub timeout: Duration,
    /// How the kubelet starts after a rejoin.
    pub kubelet: KubeletStart,
}

impl JoinSettings {
    /// The settings of a node: endpoints and EK CA from its measured config.
    pub fn from_config(config: &NodeConfig) -> Result<Self, JoinError> {
        Ok(Self {
            endpoints: config.cluster.control_plane_endpoints.clone(),
            ek_trust: EkTrust::from_pem(config.cluster.ek_ca_pem.as_bytes())
                .map_err(|_| JoinError::NoEkCa)?,
            backoff: Backoff::default(),
            timeout: Duration::from_secs(30),
            kubelet: KubeletStart::Systemd,
        })
    }
}

/// Why the join client cannot run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum JoinError {
    /// The config names no join service endpoint.
    #[error("no control-plane endpoints configured")]
    NoEndpoints,
    /// The config has no usable EK CA, so the join service cannot be verified.
    #[error("no EK CA configured: the join service cannot be verified")]
    NoEkCa,
    /// Reading this node's own PCRs failed.
    #[error("reading this node's PCRs")]
    ReadPcrs(#[source] TpmError),
    /// Another thread panicked while holding the TPM.
    #[error("the TPM handle is poisoned")]
    Poisoned,
    /// This node's own PCRs do not make a set of measurements a join
    /// service can be validated with.
    #[error("this node's PCRs do not make usable measurements")]
    OwnMeasurements(#[source] MeasurementsError),
    /// Making the kubelet key or CSR failed.
    #[error("making the kubelet key")]
    KubeletKey(#[source] rcgen::Error),
}

/// Why getting a ticket from one endpoint failed (before the lock: retried).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TicketError {
    /// The endpoint is not `host:port`.
    #[error("invalid endpoint {0:?}")]
    Endpoint(String),
    /// The aTLS connection failed (includes the service's attestation).
    #[error("connecting to the join service")]
    Connect(#[source] ConnectError),
    /// The connection has no validated attestation of the service.
    #[error("the join service is not attested")]
    ServiceNotAttested,
    /// The service refused the request.
    #[error("the join service refused: {}: {}", .0.code(), .0.message())]
    Refused(tonic::Status),
    /// The ticket carries no sealed secrets.
    #[error("the ticket carries no secrets")]
    NoSecrets,
    /// The secrets were not sealed to this TPM.
    #[error("opening the ticket's secrets")]
    Open(#[source] CredentialError),
    /// The TPM could not be used.
    #[error("the TPM is unavailable")]
    Tpm,
    /// The secrets do not decode.
    #[error("the ticket's secrets do not decode")]
    Decode(#[source] prost::DecodeError),
    /// The cluster ID cannot be derived from the ticket.
    #[error("deriving the cluster ID from the ticket")]
    ClusterId(#[source] ClusterIdError),
    /// The service's attestation does not show the ticket's cluster.
    #[error("the join service's attestation does not match the ticket: {0}")]
    ServiceCluster(&'static str),
    /// A ticket field is invalid.
    #[error("invalid ticket: {0}")]
    Invalid(String),
}

/// Why the work after the lock failed (fatal for this boot).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CommitError {
    /// A disk operation failed.
    #[error("state disk")]
    Disk(#[source] DiskError),
    /// Writing a file failed.
    #[error("writing a file")]
    WriteFile(#[from] WriteFileError),
    /// Creating a directory failed.
    #[error("creating {path:?}")]
    CreateDir {
        /// The directory.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The installer could not be set up.
    #[error("setting up the installer")]
    Installer(#[source] keel_installer::InstallError),
    /// Installing the components failed.
    #[error("installing the components")]
    Install(#[source] InstallComponentsError),
    /// The kubeadm configuration is invalid.
    #[error("kubeadm join configuration")]
    KubeadmConfig(#[source] ConfigError),
    /// kubeadm join failed.
    #[error("kubeadm join")]
    Kubeadm(#[source] KubeadmError),
    /// Starting the kubelet failed.
    #[error("starting the kubelet: {0}")]
    Kubelet(String),
    /// A blocking task did not complete.
    #[error("a blocking task failed")]
    Blocking(#[source] tokio::task::JoinError),
    /// Recording the lock failed after PCR 15 changed.
    #[error("taking the node lock: {0}")]
    Lock(String),
}

/// The result of one attempt to take the node lock.
enum Locking {
    Taken,
    /// Something else holds it.
    Lost,
    /// Not taken; the node is still unlocked.
    Retry(String),
    /// Not recorded, yet PCR 15 changed: the node is locked and unusable.
    Broken(String),
}

/// How a join client run ended.
#[derive(Debug)]
pub enum JoinOutcome {
    /// The node joined the cluster.
    Joined {
        /// The cluster ID (now in PCR 15).
        cluster_id: ClusterId,
    },
    /// The node rejoined with its initialised state disk.
    Rejoined {
        /// The cluster ID (now in PCR 15).
        cluster_id: ClusterId,
    },
    /// The node was locked by something else (init won): nothing was touched.
    LostRace,
    /// The join failed for this boot: after the lock the node is unusable
    /// until it reboots (the state disk is marked for reset).
    Failed {
        /// What failed.
        error: String,
    },
}

/// A ticket as the service sent it, with the service's validated attestation.
pub struct RawTicket<T> {
    /// The response.
    pub response: T,
    /// What the service's attestation established.
    pub service: Arc<Attested<Verified>>,
}

/// A checked join ticket.
pub struct JoinTicket {
    /// The cluster ID derived from the ticket.
    pub cluster_id: ClusterId,
    /// The state-disk key for the requested UUID.
    pub disk_key: Zeroizing<Vec<u8>>,
    /// The kubelet client certificate (PEM) for this node's key.
    pub kubelet_cert: String,
    /// The cluster CA certificate (PEM).
    pub ca_cert: String,
    /// `host:port` of the API server.
    pub api_server_endpoint: String,
    /// The bootstrap token.
    pub token: BootstrapToken,
    /// The discovery hash of the CA.
    pub ca_hash: CaCertHash,
    /// Control-plane PKI files (name relative to the PKI dir, contents).
    pub control_plane_files: Vec<(&'static str, Zeroizing<Vec<u8>>)>,
    /// The pinned Kubernetes version.
    pub version: KubernetesVersion,
    /// The components to install.
    pub components: Vec<Component>,
}

impl std::fmt::Debug for JoinTicket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JoinTicket")
            .field("cluster_id", &hex::encode(self.cluster_id))
            .field("api_server_endpoint", &self.api_server_endpoint)
            .field("token", &self.token)
            .field("version", &self.version.to_string())
            .finish_non_exhaustive()
    }
}

/// Opened ticket secrets; wiped when dropped.
pub struct OpenedSecrets(JoinSecrets);

impl std::ops::Deref for OpenedSecrets {
    type Target = JoinSecrets;

    fn deref(&self) -> &JoinSecrets {
        &self.0
    }
}

impl Drop for OpenedSecrets {
    fn drop(&mut self) {
        use zeroize::Zeroize as _;
        self.0.state_disk_key.zeroize();
        self.0.measurement_secret.zeroize();
        self.0.certificate_key.zeroize();
        self.0.bootstrap_token.zeroize();
        for file in &mut self.0.control_plane_files {
            file.data.zeroize();
        }
    }
}

/// A checked rejoin ticket.
pub struct RejoinTicket {
    /// The cluster ID derived from the ticket.
    pub cluster_id: ClusterId,
    /// The state-disk key.
    pub disk_key: Zeroizing<Vec<u8>>,
}

/// A validator of join services: EK trust and this node's own PCRs
/// [`SHARED_PCRS`] as enforced values. Reads the PCRs from `tpm`.
pub fn service_validator(tpm: &SharedTpm, ek_trust: EkTrust) -> Result<Validator, JoinError> {
    let own = tpm
        .lock()
        .map_err(|_| JoinError::Poisoned)?
        .tpm()
        .pcr_read(&SHARED_PCRS)
        .map_err(JoinError::ReadPcrs)?;
    let expected = Measurements::new(
        own.into_iter()
            .map(|(index, value)| (index, Expected::enforced(value))),
    )
    .map_err(JoinError::OwnMeasurements)?;
    Ok(Validator::new(expected, ek_trust))
}

/// Requests and opens tickets over mutual aTLS: attests with the node's TPM,
/// validates the service with [`service_validator`].
#[derive(Clone)]
pub struct TicketClient {
    atls: AtlsClient<Verified>,
    tpm: SharedTpm,
    timeout: Duration,
}

impl TicketClient {
    /// A client attesting with `tpm` and validating services with `validator`.
    pub fn new(tpm: SharedTpm, validator: Validator, timeout: Duration) -> Self {
        let issuer = Arc::new(TpmIssuer::new(tpm.clone()));
        let atls = AtlsClient::mutual(issuer, Arc::new(validator)).with_timeout(timeout);
        Self { atls, tpm, timeout }
    }

    async fn connect(
        &self,
        endpoint: &str,
    ) -> Result<
        (
            JoinServiceClient<tonic::transport::Channel>,
            Arc<Attested<Verified>>,
        ),
        TicketError,
    > {
        let uri = Endpoint::from_shared(format!("http://{endpoint}"))
            .map_err(|_| TicketError::Endpoint(endpoint.to_owned()))?
            .timeout(self.timeout);
        let bound = self
            .atls
            .bind_channel(uri)
            .await
            .map_err(TicketError::Connect)?;
        let service = bound.attested.ok_or(TicketError::ServiceNotAttested)?;
        let client =
            JoinServiceClient::new(bound.channel).max_decoding_message_size(MAX_TICKET_BYTES);
        Ok((client, service))
    }

    /// Asks `endpoint` for a join ticket; returns it unopened.
    pub async fn request_join_ticket(
        &self,
        endpoint: &str,
        request: IssueJoinTicketRequest,
    ) -> Result<RawTicket<IssueJoinTicketResponse>, TicketError> {
        let (mut client, service) = self.connect(endpoint).await?;
        let response = client
            .issue_join_ticket(request)
            .await
            .map_err(TicketError::Refused)?
            .into_inner();
        Ok(RawTicket { response, service })
    }

    /// Opens the secrets of a ticket with this TPM.
    pub async fn open(
        &self,
        sealed: Option<keel_proto::attestation::SealedSecret>,
    ) -> Result<OpenedSecrets, TicketError> {
        let sealed = sealed.ok_or(TicketError::NoSecrets)?;
        let tpm = self.tpm.clone();
        let payload = tokio::task::spawn_blocking(move || {
            let mut guard = tpm.lock().map_err(|_| TicketError::Tpm)?;
            credential::open(guard.tpm(), &sealed).map_err(TicketError::Open)
        })
        .await
        .map_err(|_| TicketError::Tpm)??;
        JoinSecrets::decode(payload.as_slice())
            .map(OpenedSecrets)
            .map_err(TicketError::Decode)
    }

    /// Asks `endpoint` for a join ticket, opens it, checks the service
    /// against the ticket's cluster and every field. `kubelet_spki` is the
    /// DER SubjectPublicKeyInfo of the key the CSR was made for.
    pub async fn join_ticket(
        &self,
        endpoint: &str,
        request: IssueJoinTicketRequest,
        kubelet_spki: &[u8],
    ) -> Result<JoinTicket, TicketError> {
        let is_control_plane = request.is_control_plane;
        let raw = self.request_join_ticket(endpoint, request).await?;
        let mut response = raw.response;
        let secrets = self.open(response.secrets.take()).await?;
        let cluster_id =
            key_service::cluster_id(&secrets.measurement_secret, &response.measurement_salt)
                .map_err(TicketError::ClusterId)?;
        check_service_cluster(raw.service.claims(), &cluster_id)?;
        parse_join_ticket(
            response,
            &secrets,
            cluster_id,
            kubelet_spki,
            is_control_plane,
        )
    }

    /// Asks `endpoint` for the rejoin ticket of the disk `disk_uuid`, opens
    /// it and checks the service against the ticket's cluster.
    pub async fn rejoin_ticket(
        &self,
        endpoint: &str,
        disk_uuid: &str,
    ) -> Result<RejoinTicket, TicketError> {
        let (mut client, service) = self.connect(endpoint).await?;
        let mut response = client
            .issue_rejoin_ticket(IssueRejoinTicketRequest {
                disk_uuid: disk_uuid.to_owned(),
            })
            .await
            .map_err(TicketError::Refused)?
            .into_inner();
        let secrets = self.open(response.secrets.take()).await?;
        let cluster_id =
            key_service::cluster_id(&secrets.measurement_secret, &response.measurement_salt)
                .map_err(TicketError::ClusterId)?;
        check_service_cluster(service.claims(), &cluster_id)?;
        if secrets.state_disk_key.len() != DISK_KEY_LEN {
            return Err(TicketError::Invalid("disk key length".into()));
        }
        Ok(RejoinTicket {
            cluster_id,
            disk_key: Zeroizing::new(secrets.state_disk_key.clone()),
        })
    }
}

/// The service's PCR 15 must be the extend of exactly `cluster_id`, logged
/// as the one cluster-ID event of its replayed log.
pub fn check_service_cluster(
    service: &Verified,
    cluster_id: &ClusterId,
) -> Result<(), TicketError> {
    let events: Vec<_> = service
        .events
        .iter()
        .filter(|e| e.event_type == EventType::ClusterId)
        .collect();
    let [event] = events.as_slice() else {
        return Err(TicketError::ServiceCluster(
            "the service is not locked into exactly one cluster",
        ));
    };
    if event.data.as_slice() != cluster_id.as_slice() {
        return Err(TicketError::ServiceCluster(
            "the service belongs to another cluster than the ticket",
        ));
    }
    let expected: Digest32 = extend(
        &[0; 32],
        &event_digest(event.seq, EventType::ClusterId, cluster_id),
    );
    if service.pcrs.get(&pcr::CLUSTER_ID) != Some(&expected) {
        return Err(TicketError::ServiceCluster(
            "the service's PCR 15 is not the extend of the ticket's cluster ID",
        ));
    }
    Ok(())
}

fn parse_join_ticket(
    response: IssueJoinTicketResponse,
    secrets: &JoinSecrets,
    cluster_id: ClusterId,
    kubelet_spki: &[u8],
    is_control_plane: bool,
) -> Result<JoinTicket, TicketError> {
    let invalid = |m: &str| TicketError::Invalid(m.to_owned());
    if secrets.state_disk_key.len() != DISK_KEY_LEN {
        return Err(invalid("disk key length"));
    }
    let token = BootstrapToken::from_str(&secrets.bootstrap_token)
        .map_err(|_| invalid("bootstrap token format"))?;
    let ca_hash = CaCertHash::from_str(&response.discovery_token_ca_cert_hash)
        .map_err(|_| invalid("discovery CA hash format"))?;
    let ca_cert =
        String::from_utf8(response.cluster_ca_cert).map_err(|_| invalid("CA certificate"))?;
    if spki_hash(ca_cert.as_bytes()).as_ref() != Some(&ca_hash) {
        return Err(invalid("the discovery hash is not the CA certificate's"));
    }
    let kubelet_cert = String::from_utf8(secrets.kubelet_cert.clone())
        .map_err(|_| invalid("kubelet certificate"))?;
    check_kubelet_cert(&kubelet_cert, &ca_cert, kubelet_spki)?;
    let endpoint = response.api_server_endpoint;
    if endpoint.len() > 261
        || endpoint
            .rsplit_once(':')
            .is_none_or(|(h, p)| h.is_empty() || p.parse::<u16>().is_err())
    {
        return Err(invalid("API server endpoint is not host:port"));
    }
    let entry = keel_installer::resolve(&response.kubernetes_version)
        .map_err(|e| TicketError::Invalid(format!("Kubernetes version: {e}")))?;
    let components = match response.kubernetes_components {
        Some(list) if !list.components.is_empty() => list
            .components
            .into_iter()
            .map(Component::try_from)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| TicketError::Invalid(format!("component: {e}")))?,
        _ => entry.components().to_vec(),
    };
    let mut files = Vec::new();
    for file in &secrets.control_plane_files {
        let name = CONTROL_PLANE_FILES
            .into_iter()
            .find(|n| *n == file.name)
            .ok_or_else(|| invalid("unexpected control-plane file"))?;
        if files.iter().any(|(n, _)| *n == name) {
            return Err(invalid("repeated control-plane file"));
        }
        files.push((name, Zeroizing::new(file.data.clone())));
    }
    let has = |n: &str| files.iter().any(|(f, _)| *f == n);
    if is_control_plane && !(has("ca.crt") && has("ca.key")) {
        return Err(invalid("a control-plane ticket needs ca.crt and ca.key"));
    }
    if !is_control_plane && !files.is_empty() {
        return Err(invalid("a worker ticket carries control-plane files"));
    }
    Ok(JoinTicket {
        cluster_id,
        disk_key: Zeroizing::new(secrets.state_disk_key.clone()),
        kubelet_cert,
        ca_cert,
        api_server_endpoint: endpoint,
        token,
        ca_hash,
        control_plane_files: files,
        version: entry.version(),
        components,
    })
}

/// The kubelet certificate must be for this node's key and signed by the CA.
fn check_kubelet_cert(cert_pem: &str, ca_pem: &str, spki: &[u8]) -> Result<(), TicketError> {
    let invalid = |m: &str| TicketError::Invalid(m.to_owned());
    let (_, cert) = x509_parser::pem::parse_x509_pem(cert_pem.as_bytes())
        .map_err(|_| invalid("kubelet certificate PEM"))?;
    let (_, cert) =
        X509Certificate::from_der(&cert.contents).map_err(|_| invalid("kubelet certificate"))?;
    let (_, ca) =
        x509_parser::pem::parse_x509_pem(ca_pem.as_bytes()).map_err(|_| invalid("CA PEM"))?;
    let (_, ca) = X509Certificate::from_der(&ca.contents).map_err(|_| invalid("CA certificate"))?;
    if cert.public_key().raw != spki {
        return Err(invalid("the kubelet certificate is for another key"));
    }
    cert.verify_signature(Some(ca.public_key()))
        .map_err(|_| invalid("the kubelet certificate is not signed by the cluster CA"))
}

/// The kubelet's key and its CSR (`O=system:nodes, CN=system:node:<name>`).
pub struct KubeletKey {
    key: rcgen::KeyPair,
    csr_pem: String,
}

impl KubeletKey {
    /// A fresh P-256 key and its CSR for `node_name`.
    pub fn generate(node_name: &str) -> Result<Self, rcgen::Error> {
        let key = rcgen::KeyPair::generate()?;
        let mut params = rcgen::CertificateParams::default();
        let mut dn = rcgen::DistinguishedName::new();
        dn.push(rcgen::DnType::OrganizationName, "system:nodes");
        dn.push(
            rcgen::DnType::CommonName,
            format!("system:node:{node_name}"),
        );
        params.distinguished_name = dn;
        let csr_pem = params.serialize_request(&key)?.pem()?;
        Ok(Self { key, csr_pem })
    }

    /// The CSR (PEM).
    pub fn csr_pem(&self) -> &str {
        &self.csr_pem
    }

    /// DER SubjectPublicKeyInfo of the key.
    pub fn spki(&self) -> Vec<u8> {
        rcgen::PublicKeyData::subject_public_key_info(&self.key)
    }

    fn private_pem(&self) -> Zeroizing<String> {
        Zeroizing::new(self.key.serialize_pem())
    }
}

/// The join client of this node.
pub struct JoinClient {
    config: NodeConfig,
    tpm: SharedTpm,
    lock: Arc<NodeLock>,
    env: NodeEnv,
    settings: JoinSettings,
    tickets: TicketClient,
}

impl JoinClient {
    /// A join client; reads this node's PCRs for the service validator.
    pub fn new(
        config: NodeConfig,
        tpm: SharedTpm,
        lock: Arc<NodeLock>,
        env: NodeEnv,
        settings: JoinSettings,
    ) -> Result<Self, JoinError> {
        if settings.endpoints.is_empty() {
            return Err(JoinError::NoEndpoints);
        }
        let validator = service_validator(&tpm, settings.ek_trust.clone())?;
        let tickets = TicketClient::new(tpm.clone(), validator, settings.timeout);
        Ok(Self {
            config,
            tpm,
            lock,
            env,
            settings,
            tickets,
        })
    }

    /// Runs until the node joined, lost the race for the lock, or failed
    /// after the lock.
    pub async fn run(self) -> JoinOutcome {
        let disk = self.env.state_disk.clone();
        let existing = match &disk {
            Some(disk) => self.initialised_disk_uuid(disk).await,
            None => None,
        };
        match existing {
            Some(uuid) => self.rejoin(&uuid).await,
            None => self.join().await,
        }
    }

    /// The UUID of the state disk when it already carries a LUKS header.
    /// A disk that cannot be inspected counts as fresh.
    async fn initialised_disk_uuid(&self, disk: &StateDisk) -> Option<String> {
        let disk = disk.clone();
        let found = tokio::task::spawn_blocking(move || {
            if disk.cryptsetup.is_luks(&disk.device)? {
                disk.cryptsetup.uuid(&disk.device).map(Some)
            } else {
                Ok(None)
            }
        })
        .await;
        match found {
            Ok(Ok(uuid)) => uuid,
            Ok(Err(e)) => {
                tracing::warn!(error = %keel_atls::ErrorChain(&e), "inspecting the state disk failed; joining afresh");
                None
            }
            Err(_) => None,
        }
    }

    /// Tries every endpoint in turn until `attempt` yields a value, with
    /// backoff between rounds. `None` when the node got locked meanwhile.
    async fn until_ticket<T, F, Fut>(&self, what: &str, mut attempt: F) -> Option<T>
    where
        F: FnMut(String) -> Fut,
        Fut: std::future::Future<Output = Result<T, TicketError>>,
    {
        let mut round: u32 = 0;
        loop {
            for endpoint in &self.settings.endpoints {
                if self.lock.is_locked() {
                    return None;
                }
                match attempt(endpoint.clone()).await {
                    Ok(ticket) => return Some(ticket),
                    Err(e) => tracing::warn!(
                        %endpoint,
                        error = %keel_atls::ErrorChain(&e),
                        "no {what} ticket from this endpoint"
                    ),
                }
            }
            let pause = self.settings.backoff.delay(round);
            round = round.saturating_add(1);
            tracing::info!(
                pause_ms = pause.as_millis() as u64,
                "retrying the {what} ticket"
            );
            // Sleep in slices so a lock taken by init stops the client promptly.
            let deadline = tokio::time::Instant::now() + pause;
            while tokio::time::Instant::now() < deadline {
                if self.lock.is_locked() {
                    return None;
                }
                let slice = deadline
                    .saturating_duration_since(tokio::time::Instant::now())
                    .min(Duration::from_millis(200));
                tokio::time::sleep(slice).await;
            }
        }
    }

    /// Fetches a ticket ([`Self::until_ticket`]) and takes the node lock with
    /// its cluster ID, fetching again while the lock fails transiently.
    /// `Err` carries the outcome when the race was lost or the lock broke.
    async fn locked_ticket<T, F, Fut>(
        &self,
        what: &str,
        mut attempt: F,
        cluster_id: impl Fn(&T) -> ClusterId,
    ) -> Result<T, JoinOutcome>
    where
        F: FnMut(String) -> Fut,
        Fut: std::future::Future<Output = Result<T, TicketError>>,
    {
        loop {
            let Some(ticket) = self.until_ticket(what, &mut attempt).await else {
                return Err(JoinOutcome::LostRace);
            };
            match self.lock(cluster_id(&ticket)).await {
                Locking::Taken => return Ok(ticket),
                Locking::Lost => return Err(JoinOutcome::LostRace),
                Locking::Retry(e) => {
                    tracing::warn!(error = %e, "taking the node lock failed; retrying")
                }
                Locking::Broken(e) => return Err(self.fail(CommitError::Lock(e)).await),
            }
        }
    }

    /// Takes the lock with `cluster_id`.
    async fn lock(&self, cluster_id: ClusterId) -> Locking {
        let lock = self.lock.clone();
        let taken = tokio::task::spawn_blocking(move || lock.try_lock(cluster_id)).await;
        match taken {
            Ok(Ok(())) => Locking::Taken,
            Ok(Err(LockError::AlreadyLocked)) => Locking::Lost,
            // A failed record may still have extended PCR 15: then the
            // node is locked for good and cannot continue.
            Ok(Err(e)) if self.lock.is_locked() => {
                Locking::Broken(keel_atls::ErrorChain(&e).to_string())
            }
            Ok(Err(e)) => Locking::Retry(keel_atls::ErrorChain(&e).to_string()),
            Err(e) => Locking::Retry(format!("lock task: {e}")),
        }
    }

    async fn join(self) -> JoinOutcome {
        let node = &self.config.node;
        let is_control_plane = node.role == Role::ControlPlane;
        let kubelet = match KubeletKey::generate(&node.name) {
            Ok(k) => k,
            Err(e) => {
                return JoinOutcome::Failed {
                    error: format!("making the kubelet key: {e}"),
                }
            }
        };
        let spki = kubelet.spki();
        let disk_uuid = crate::disk::new_uuid();
        let request = IssueJoinTicketRequest {
            disk_uuid: disk_uuid.clone(),
            kubelet_csr: kubelet.csr_pem().as_bytes().to_vec(),
            is_control_plane,
            node_name: node.name.clone(),
        };
        let (tickets, spki) = (&self.tickets, spki.as_slice());
        let attempt = |endpoint: String| {
            let request = request.clone();
            async move { tickets.join_ticket(&endpoint, request, spki).await }
        };
        let ticket = match self.locked_ticket("join", attempt, |t| t.cluster_id).await {
            Ok(ticket) => ticket,
            Err(outcome) => return outcome,
        };
        tracing::info!(cluster_id = %hex::encode(ticket.cluster_id), "node locked for join");
        match self
            .commit_join(&ticket, &disk_uuid, &kubelet, is_control_plane)
            .await
        {
            Ok(()) => {
                tracing::info!("this node joined the cluster");
                JoinOutcome::Joined {
                    cluster_id: ticket.cluster_id,
                }
            }
            Err(e) => self.fail(e).await,
        }
    }

    async fn rejoin(self, disk_uuid: &str) -> JoinOutcome {
        let Some(disk) = self.env.state_disk.clone() else {
            return JoinOutcome::Failed {
                error: "rejoin without a state disk".into(),
            };
        };
        tracing::info!(disk = %disk.device.display(), uuid = disk_uuid, "state disk initialised: rejoining");
        let tickets = &self.tickets;
        let attempt = |endpoint: String| {
            let disk = disk.clone();
            async move {
                let ticket = tickets.rejoin_ticket(&endpoint, disk_uuid).await?;
                // Before the lock: the key must open this very disk.
                let key = ticket.disk_key.clone();
                let matches = tokio::task::spawn_blocking(move || {
                    disk.cryptsetup.key_matches(&disk.device, &key)
                })
                .await
                .map_err(|_| TicketError::Tpm)?
                .map_err(|e| {
                    TicketError::Invalid(format!(
                        "testing the disk key: {}",
                        keel_atls::ErrorChain(&e)
                    ))
                })?;
                if !matches {
                    return Err(TicketError::Invalid(
                        "the disk key does not open the state disk".into(),
                    ));
                }
                Ok(ticket)
            }
        };
        let ticket = match self
            .locked_ticket("rejoin", attempt, |t| t.cluster_id)
            .await
        {
            Ok(ticket) => ticket,
            Err(outcome) => return outcome,
        };
        match self.commit_rejoin(&ticket, &disk).await {
            Ok(()) => JoinOutcome::Rejoined {
                cluster_id: ticket.cluster_id,
            },
            Err(e) => self.fail(e).await,
        }
    }

    async fn commit_join(
        &self,
        ticket: &JoinTicket,
        disk_uuid: &str,
        kubelet: &KubeletKey,
        is_control_plane: bool,
    ) -> Result<(), CommitError> {
        let env = &self.env;
        if let Some(disk) = env.state_disk.clone() {
            tracing::info!(disk = %disk.device.display(), "formatting the state disk");
            let (uuid, key) = (disk_uuid.to_owned(), ticket.disk_key.clone());
            let mounted = tokio::task::spawn_blocking(move || disk.set_up(&uuid, &key))
                .await
                .map_err(CommitError::Blocking)?
                .map_err(CommitError::Disk)?;
            log_state_disk(mounted.as_deref(), "set up (LUKS2)");
        }
        let root = &env.kubeadm.root;
        let kubelet_dir = root.join(KUBELET_PKI_DIR);
        write_private(
            &kubelet_dir.join("kubelet-client.crt"),
            ticket.kubelet_cert.as_bytes(),
        )?;
        write_private(
            &kubelet_dir.join("kubelet-client.key"),
            kubelet.private_pem().as_bytes(),
        )?;
        write_private(&kubelet_dir.join("ca.crt"), ticket.ca_cert.as_bytes())?;
        let pki = root.join(CONTROL_PLANE_PKI_DIR);
        for (name, data) in &ticket.control_plane_files {
            write_private(&pki.join(name), data)?;
        }

        tracing::info!(count = ticket.components.len(), version = %ticket.version, "installing the components");
        let installer = Installer::new(env.installer.clone()).map_err(CommitError::Installer)?;
        install_and_measure(
            &installer,
            &self.tpm,
            &ticket.components,
            &LogProgress::default(),
        )
        .await
        .map_err(CommitError::Install)?;

        let patches_dir = env
            .kubeadm
            .root
            .join(kubeadm::DEFAULT_PATCHES_DIR.trim_start_matches('/'));
        std::fs::create_dir_all(&patches_dir).map_err(|source| CommitError::CreateDir {
            path: patches_dir.clone(),
            source,
        })?;
        let advertise_address = env.advertise_address.resolve();
        let join = JoinConfig {
            node_name: self.config.node.name.clone(),
            node_ip: advertise_address,
            kubernetes_version: ticket.version,
            api_server_endpoint: ticket.api_server_endpoint.clone(),
            token: ticket.token.clone(),
            ca_cert_hashes: vec![ticket.ca_hash.clone()],
            control_plane: is_control_plane.then_some(ControlPlaneJoin {
                advertise_address,
                certificate_key: None,
            }),
            patches_dir,
        };
        let yaml = Zeroizing::new(join.to_yaml().map_err(CommitError::KubeadmConfig)?);
        let config_path = env.work_dir.join("kubeadm-join.yaml");
        write_private(&config_path, yaml.as_bytes())?;
        tracing::info!("running kubeadm join");
        let mut on_line = |line: &str| tracing::info!(target: "keel_agent::kubeadm", "{line}");
        env.kubeadm
            .join(&config_path, &mut on_line)
            .await
            .map_err(CommitError::Kubeadm)
    }

    async fn commit_rejoin(
        &self,
        ticket: &RejoinTicket,
        disk: &StateDisk,
    ) -> Result<(), CommitError> {
        let (disk, key) = (disk.clone(), ticket.disk_key.clone());
        let mounted = tokio::task::spawn_blocking(move || disk.unlock(&key))
            .await
            .map_err(CommitError::Blocking)?
            .map_err(CommitError::Disk)?;
        log_state_disk(mounted.as_deref(), "opened (LUKS2)");
        start_kubelet(&self.settings.kubelet).await
    }

    /// After a fatal failure: mark the disk for reset and schedule the reboot.
    async fn fail(&self, error: CommitError) -> JoinOutcome {
        let error = keel_atls::ErrorChain(&error).to_string();
        tracing::error!(%error, "join failed after the node lock");
        for line in crate::reboot::reset_node(self.env.state_disk.as_ref(), self.env.reboot).await {
            tracing::error!("{line}");
        }
        JoinOutcome::Failed { error }
    }
}

/// Logs what became of the state disk: `what` and where it is mounted.
fn log_state_disk(mounted: Option<&Path>, what: &str) {
    match mounted {
        Some(at) => tracing::info!(mount_point = %at.display(), "state disk {what}"),
        None => tracing::info!("state disk {what}; key verified, not opened here"),
    }
}

async fn start_kubelet(how: &KubeletStart) -> Result<(), CommitError> {
    let mut command = match how {
        KubeletStart::Systemd => {
            let mut c = tokio::process::Command::new("systemctl");
            c.args(["start", "kubelet.service"]);
            c
        }
        KubeletStart::Program(program) => {
            let mut c = tokio::process::Command::new(program);
            c.arg("--version");
            c
        }
    };
    let status = tokio::time::timeout(Duration::from_secs(60), command.kill_on_drop(true).status())
        .await
        .map_err(|_| CommitError::Kubelet("did not start within 60 s".into()))?
        .map_err(|e| CommitError::Kubelet(e.to_string()))?;
    if status.success() {
        tracing::info!("kubelet started");
        Ok(())
    } else {
        Err(CommitError::Kubelet(format!("exited with {status}")))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn backoff_is_capped_and_jittered() {
        let b = Backoff {
            initial: Duration::from_millis(100),
            max: Duration::from_secs(2),
        };
        for attempt in 0..64 {
            let full = (Duration::from_millis(100) * 2u32.saturating_pow(attempt.min(20)))
                .min(Duration::from_secs(2));
            let d = b.delay(attempt);
            assert!(d >= full / 2 && d <= full, "{attempt}: {d:?}");
        }
        let draws: std::collections::BTreeSet<_> = (0..20).map(|_| b.delay(10)).collect();
        assert!(draws.len() > 1, "no jitter");
    }

    #[test]
    fn uuids_are_valid_key_ids() {
        let a = crate::disk::new_uuid();
        assert!(key_service::disk_key_id(&a).is_ok());
        assert_ne!(a, crate::disk::new_uuid());
    }
}
